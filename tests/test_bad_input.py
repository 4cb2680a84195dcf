"""Issue 44: every option of train.py, convert.py and eval.py as a careless user types it -- each number at -1 and at
an absurd size, each other value (paths, specs, names) as a missing file, a text file and a truncated checkpoint --
on tiny models: every run ends within seconds with exit 0 (a valid value: VALID says why) or exit 2 and one line
`X.py: error: ...`; never a traceback (an exception other than SystemExit), never a silent clamp (an absurd value
accepted). The options are the fields of the scripts' config dataclasses, which train.parse_config makes the flags
of: a new option is walked without a new test. (Bools take no value: argparse refuses one.)"""
import contextlib
import dataclasses
import io
import json
import signal
import sys
import time
import typing

import pytest
import torch

import convert
import eval as ev
import model as M
import tokenizer
import train

HUGE = {int: 10**9, float: 1e9}
SECONDS = 60   # a run's limit (the slowest, lm-eval's task index, takes about 20 s on a 2-core CPU)

VALID = {   # (option, value) -> why exit 0 is right; any other value must be refused
    ('warmup_iters', 'huge'): 'a warmup longer than the run: the lr ramps over it',
    ('eval_interval', 'huge'): 'evaluate at the end only',
    ('seed', 'huge'): 'any seed below 2^32',
    ('limit', 'huge'): 'eval: at most N, so all of them',
    ('eval_batches', 'huge'): 'convert: at most N windows, so the whole held-out text',
    ('dof_lambda', 'huge'): 'any lambda > 0 (a large one gives every layer the same dim)',
    ('rope_theta', 'huge'): 'any RoPE base (a large one turns q and k by nearly nothing)',
    ('data', 'text'): 'text to read', ('val_data', 'text'): 'text to read',
    ('prompt', 'missing'): 'any text is a prompt', ('prompt', 'text'): 'any text is a prompt',
    ('prompt', 'trunc'): 'any text is a prompt',
    ('out_dir', 'missing'): 'made',
}
LONG = {'max_iters', 'grad_accum', 'stage1_iters', 'stage2_iters'}   # valid at any size, a long run: config only


@pytest.fixture(scope='module')
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp('walk')
    (d / 'text.txt').write_text('the cat sat on the mat. the dog ran to the big red house.\n' * 60)
    torch.manual_seed(0)
    m = M.GPT(M.GPTConfig(family='llama', vocab_size=257, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32))
    m.tokenizer = tokenizer.load_tokenizer('bytes')
    M.save(d / 'tiny.pt', m)
    whole = (d / 'tiny.pt').read_bytes()
    (d / 'trunc.pt').write_bytes(whole[:len(whole) // 2])   # as an interrupted copy leaves it
    return {'dir': d, 'text': str(d / 'text.txt'), 'ckpt': str(d / 'tiny.pt'), 'trunc': str(d / 'trunc.pt')}


def base(script, option, f):
    """A quick valid run of the script, and what `option` needs to be read (the report it belongs to)."""
    out, common = str(f['dir'] / f'out-{script}'), ['--device', 'cpu']
    if script == 'train':
        home = {'ar_vocab': ['--task', 'ar', '--n_train', '64'], 'n_train': ['--task', 'ar']}
        return ['--task', 'text', '--data', f['text'], '--seq_len', '16', '--n_layer', '1', '--n_head', '2',
                '--n_embd', '16', '--batch_size', '2', '--max_iters', '2', '--warmup_iters', '0', '--out_dir', out,
                *common, *home.get(option, [])]
    if script == 'convert':
        home = {'dof_lambda': ['--dof_budget', '4'], 'dof_samples': ['--dof_budget', '4']}
        return ['--init_from', f['ckpt'], '--data', f['text'], '--block_size', '16', '--batch_size', '2',
                '--eval_batches', '1', '--stage1_iters', '1', '--stage2_iters', '1', '--out_dir', out, *common,
                *home.get(option, [])]
    home = {'max_new_tokens': ['--generate'], 'prompt': ['--generate'], 'maps': ['--fidelity'],
            'heads': ['--fidelity'], 'context': ['--lln'], 'batch_size': ['--lln'], 'sweep': ['--lln'],
            'lm_eval_include': ['--lm_eval', 'hellaswag']}
    report = [] if option in ev.REPORTS else home.get(option, ['--ppl'])
    return ['--ckpt', f['ckpt'], '--data', f['text'], '--out_dir', out, *common, *report]


SCRIPTS = {'train': (train.TrainConfig, train.main), 'convert': (convert.ConvertConfig, convert.main),
           'eval': (ev.EvalConfig, ev.main)}
CASES = [(s, f.name) for s, (cls, _) in SCRIPTS.items() for f in dataclasses.fields(cls)
         if typing.get_type_hints(cls)[f.name] is not bool]


def values(t, f, name):
    if t in HUGE:
        return {'neg': str(t(-1)), 'huge': str(HUGE[t])}
    return {'missing': str(f['dir'] / 'no' / name / 'such.pt'), 'text': f['text'], 'trunc': f['trunc']}   # (--out_dir
                                                                                                    # makes `missing`)


def run(main, argv):
    """(exit status, stderr) of main(argv) in this process, at most SECONDS; any other exception propagates."""
    def too_long(*_):
        raise TimeoutError(f"still running after {SECONDS} s")
    err, old = io.StringIO(), signal.signal(signal.SIGALRM, too_long)
    signal.alarm(SECONDS)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as e:
                rc = e.code
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return rc if isinstance(rc, int) else 0, err.getvalue()   # (train.main returns its summary)


@pytest.mark.slow
@pytest.mark.parametrize('script, option', CASES, ids=[f'{s}-{o}' for s, o in CASES])
def test_every_option_refuses_bad_input_in_one_line(script, option, files, monkeypatch):
    cls, main = SCRIPTS[script]
    monkeypatch.setattr(sys, 'argv', [f'{script}.py'])   # argparse's prog, as on the command line
    t = typing.get_type_hints(cls)[option]
    for kind, value in values(t, files, f'{script}-{option}').items():
        argv = base(script, option, files) + [f'--{option}', value]
        if kind == 'huge' and option in LONG:   # a long run: the config is built and keeps the value
            assert getattr(train.parse_config(cls, argv)[0], option) == t(value)
            continue
        t0 = time.time()
        code, err = run(main, argv)
        lines = err.strip().splitlines()
        where = f"{script}.py --{option} {value} ({kind}): exit {code}, {time.time() - t0:.1f} s, stderr {lines}"
        if (option, kind) in VALID:
            assert code == 0, where
            if t in HUGE:   # not clamped in the config either
                assert getattr(train.parse_config(cls, argv)[0], option) == t(value), where
        else:
            assert code == 2 and len(lines) == 1 and lines[0].startswith(f'{script}.py: error: '), where


@pytest.mark.parametrize('broken', ['cut', 'no_hidden_size', 'list'])
def test_a_broken_hf_folder_is_one_line(broken, files, tmp_path, monkeypatch):
    """Issue 52: a HuggingFace folder whose config.json is cut short, lacks hidden_size or is a list, as --init_from
    and --ckpt: exit 2 and one line naming the file (a JSONDecodeError, KeyError and AttributeError before)."""
    cfg = dict(model_type='llama', hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64,
               vocab_size=257)
    text = {'cut': json.dumps(cfg)[:40], 'list': json.dumps([cfg]),
            'no_hidden_size': json.dumps({k: v for k, v in cfg.items() if k != 'hidden_size'})}[broken]
    folder = tmp_path / broken
    folder.mkdir()
    (folder / 'config.json').write_text(text)
    for script, option in (('train', 'init_from'), ('convert', 'init_from'), ('eval', 'ckpt')):
        monkeypatch.setattr(sys, 'argv', [f'{script}.py'])
        code, err = run(SCRIPTS[script][1], base(script, option, files) + [f'--{option}', str(folder)])
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith(f'{script}.py: error: '), (script, lines)
        assert 'config.json' in lines[0], lines


@pytest.mark.parametrize('script', SCRIPTS)
def test_out_dir_under_a_file_is_refused_by_name(script, files, monkeypatch):
    """Issue 55: an --out_dir that is a file, or under one, is refused before any work, naming the option (not
    os.makedirs' '[Errno 17] File exists' after the run)."""
    monkeypatch.setattr(sys, 'argv', [f'{script}.py'])
    for out in (files['text'], files['text'] + '/sub/dir'):
        t0 = time.time()
        code, err = run(SCRIPTS[script][1], base(script, 'out_dir', files) + ['--out_dir', out])
        assert (code, err) == (2, f"{script}.py: error: --out_dir {out}: {files['text']} is a file, not a folder\n")
        assert time.time() - t0 < 5, out
