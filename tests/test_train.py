"""Tests for train.py: CLI, data and metric helpers, tiny training runs (AR, text, GLUE), resume, the
non-finite stop, compare mode and DDP (2 gloo processes vs one process)."""

import hashlib
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers
from scipy import stats
from sklearn import metrics as sklearn_metrics
from torch.nn import functional as F

import attention
import model as M
import train as T

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = ['--n_layer', '1', '--n_head', '2', '--n_embd', '16', '--seq_len', '16', '--batch_size', '4',
        '--n_train', '64', '--warmup_iters', '2', '--lr', '1e-2', '--device', 'cpu']


def run(tmp_path, *args, name='run'):
    """train.main on TINY + args into tmp_path/name; returns (summary, per-step log rows)."""
    out = str(tmp_path / name)
    summary = T.main(TINY + ['--out_dir', out] + list(args))
    return summary, read_log(out)


def read_log(out):
    with open(os.path.join(out, 'log.jsonl')) as f:
        return [json.loads(line) for line in f if line.strip()]


def sha(path):
    with open(path, 'rb') as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture
def no_tiktoken(monkeypatch):
    """Make tiktoken unusable (as offline without its cached BPE files)."""
    import tiktoken

    def fail(name):
        raise ConnectionError("offline (test)")
    monkeypatch.setattr(tiktoken, 'get_encoding', fail)


@pytest.fixture
def with_tiktoken(monkeypatch):
    """Make tiktoken's 'gpt2' load (as online or with its cached files): a small BPE of the bytes and two
    merges, built offline, standing in for GPT-2's."""
    import tiktoken
    ranks = {bytes([i]): i for i in range(256)} | {b'th': 256, b'he': 257}
    enc = tiktoken.Encoding('gpt2', pat_str=r"""'s|'t| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+""",
                            mergeable_ranks=ranks, special_tokens={'<|endoftext|>': 258})
    monkeypatch.setattr(tiktoken, 'get_encoding', lambda name: enc)


# -----------------------------------------------------------------------------
# CLI

def parse(argv):
    return T.parse_config(T.TrainConfig, argv)


def test_cli_both_flag_forms_and_bools():
    for argv in (['--attn', 'elu'], ['--attn=elu']):
        cfg, given = parse(argv)
        assert cfg.attn == 'elu' and 'attn' in given
    cfg, given = parse(['--max_iters', '7', '--lr=0.5', '--resume', '--no_save'])
    assert (cfg.max_iters, cfg.lr, cfg.resume, cfg.save) == (7, 0.5, True, False)
    assert given == {'max_iters', 'lr', 'resume', 'save'}
    assert parse(['--resume', '--no_resume'])[0].resume is False
    assert parse([])[0] == T.TrainConfig()
    cfg, _ = parse(['--attn', 'exp:t=2'])
    assert attention.AttnSpec.parse(cfg.attn).options == (('temperature', 2),)


def test_parse_config_serves_any_dataclass(capsys):
    """convert.py and eval.py use the helper for their own dataclasses: help from the field comments, bools,
    Literal choices, and __post_init__'s ValueError as a one-line usage error."""
    from dataclasses import dataclass
    from typing import Literal

    @dataclass
    class Cfg:
        stage: Literal['one', 'two'] = 'one'   # which stage
        n: int = 3                             # how many,
                                               # at most ten
        # a section comment, not a flag's help
        fast: bool = False

        def __post_init__(self):
            if self.n > 10:
                raise ValueError(f"--n must be <= 10, got {self.n}")
    assert T.parse_config(Cfg, ['--stage', 'two', '--fast']) == (Cfg('two', 3, True), {'stage', 'fast'})
    with pytest.raises(SystemExit) as e:
        T.parse_config(Cfg, ['--help'], 'The doc.')
    out = capsys.readouterr().out
    assert e.value.code == 0 and 'The doc.' in out and 'how many, at most ten (default: 3)' in out
    assert "{one,two}" in out and 'which stage' in out and 'section comment' not in out
    assert T.parse_config(Cfg, ['--fast', '--no_fast'])[0].fast is False
    for argv, needle in ((['--n', '11'], '--n must be <= 10, got 11'), (['--fast=yes'], 'ignored explicit argument'),
                         (['--stage', 'three'], "invalid choice: 'three'")):
        with pytest.raises(SystemExit) as e:
            T.parse_config(Cfg, argv)
        assert e.value.code == 2 and needle in capsys.readouterr().err


def test_cli_help_lists_flags_with_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        parse(['--help'])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for f in ('--attn', '--task', '--max_iters', '--grad_accum', '--resume', '--compare', '--init_from'):
        assert f in out
    assert 'default: hedgehog' in out


@pytest.mark.parametrize('argv, needle', [
    (['--attn', 'nope'], "unknown attention 'nope'; choose one of: softmax, elu"),
    (['--attn=nope'], "unknown attention 'nope'"),
    (['--compare', 'softmax,bogus'], "unknown attention 'bogus'"),
    (['--bogus_flag', '1'], 'unrecognized arguments: --bogus_flag'),
    (['--max_iters', 'ten'], "invalid int value: 'ten'"),
    (['--task', 'nope'], "invalid choice: 'nope'"),
    (['--glue_task', 'sts-b'], "invalid choice: 'sts-b'"),
    (['--device', 'gpu'], "unknown --device 'gpu'"),
])
def test_cli_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_cli_error_from_the_command_line():
    r = subprocess.run([sys.executable, 'train.py', '--attn', 'nope'], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2
    assert "unknown attention 'nope'" in r.stderr and 'hedgehog' in r.stderr


def test_attn_value_carries_map_options_and_the_core_settings(tmp_path, capsys):
    cfg = T.TrainConfig(attn='lolcats:window=16:combine=mix:feature_dim=8:impl=recurrent', n_layer=1, n_head=2,
                        n_embd=16)
    (a,) = T.build_model(cfg, 32).attention_cores()
    assert (a.spec.window, a.spec.combine, a.spec.impl, a.fmap.feature_dim) == (16, 'mix', 'recurrent', 8)
    cfg = T.TrainConfig(attn='exp:t=2', n_layer=1, n_head=2, n_embd=16)
    assert T.build_model(cfg, 32).config.attn == 'exp:temperature=2'
    # an option the map does not take is an error, not ignored
    with pytest.raises(SystemExit) as e:
        run(tmp_path, '--attn', 'elu:feature_dim=8', '--max_iters', '1')
    assert e.value.code == 2 and "unknown option(s) feature_dim; elu's options: none" in capsys.readouterr().err


# -----------------------------------------------------------------------------
# associative recall data

@pytest.mark.parametrize('seq_len, nq', [(128, 1), (127, 1), (64, 8)])
def test_associative_recall_layout_and_values(seq_len, nq):
    V = 40
    x, y = T.make_associative_recall(300, seq_len, V, seed=3, n_queries=nq)
    assert x.shape == y.shape == (300, seq_len) and x.dtype == y.dtype == torch.long
    ctx = seq_len - nq
    assert (y[:, :ctx] == -100).all() and (y[:, ctx:] != -100).all()
    keys, vals = x[:, 0:ctx:2], x[:, 1:ctx:2]
    assert ((keys >= 0) & (keys < V // 2)).all() and ((vals >= V // 2) & (vals < V)).all()
    assert ((x[:, ctx:] >= 0) & (x[:, ctx:] < V // 2)).all()           # queries are keys
    assert ((y[:, ctx:] >= V // 2) & (y[:, ctx:] < V)).all()           # targets are values
    n_pairs = ctx // 2
    for i in range(300):
        kv = {}
        for k, v in zip(keys[i, :n_pairs].tolist(), vals[i, :n_pairs].tolist()):
            assert kv.setdefault(k, v) == v                               # one map per sequence
        for t in range(ctx, seq_len):
            assert x[i, t].item() in kv and y[i, t].item() == kv[x[i, t].item()]
    # maps differ between sequences
    maps = {tuple(sorted(zip(keys[i].tolist(), vals[i].tolist()))) for i in range(300)}
    assert len(maps) == 300


def test_associative_recall_label_repeats():
    x, y = T.make_associative_recall(200, 64, 40, seed=5, n_queries=2, label_repeats=True)
    x0, y0 = T.make_associative_recall(200, 64, 40, seed=5, n_queries=2)
    assert torch.equal(x, x0) and torch.equal(y[:, -2:], y0[:, -2:])       # same data, same queries
    for i in range(200):
        seen = {}
        for t in range(0, 62, 2):
            k, v = x[i, t].item(), x[i, t + 1].item()
            assert y[i, t + 1] == -100
            assert y[i, t].item() == (v if k in seen else -100)           # labelled iff the key repeats
            seen[k] = v


def test_associative_recall_seeds():
    a = T.make_associative_recall(50, 32, 40, seed=1)
    b = T.make_associative_recall(50, 32, 40, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    cfg = T.TrainConfig(n_train=2000, seq_len=32)
    splits = T.Task(cfg.data_config(), verbose=False).splits
    xtr, xte = splits['train'][0], splits['val'][0]
    assert len(xte) == T.N_TEST
    train_rows = {tuple(r) for r in xtr.tolist()}
    assert not any(tuple(r) in train_rows for r in xte.tolist())       # disjoint train / test
    assert T.TEST_SEED_OFFSET != 0


def test_associative_recall_draw_order():
    """The docstring's draw order, replayed on a generator: keys, then the maps, then the queries (lesson 3's
    numbers depend on it)."""
    n, seq_len, vocab, nq = 7, 21, 12, 2
    x, y = T.make_associative_recall(n, seq_len, vocab, seed=4, n_queries=nq)
    g, nk, ctx = torch.Generator().manual_seed(4), vocab // 2, seq_len - nq
    keys = torch.randint(0, nk, (n, (ctx + 1) // 2), generator=g)
    maps = torch.argsort(torch.rand(n, nk, generator=g), dim=1) + nk
    pairs = torch.randint(0, ctx // 2, (n, nq), generator=g)
    for i in range(n):
        assert x[i, 0:ctx:2].tolist() == keys[i].tolist()                       # the keys, then their values
        assert x[i, 1:ctx:2].tolist() == maps[i][keys[i][:ctx // 2]].tolist()
        assert x[i, ctx:].tolist() == keys[i][pairs[i]].tolist()                # the queries
        assert y[i, ctx:].tolist() == maps[i][keys[i][pairs[i]]].tolist()


# -----------------------------------------------------------------------------
# text helpers

def test_byte_tokenizer_is_the_default(no_tiktoken, capsys):
    tok = T.get_tokenizer()
    assert tok.name == 'byte' and tok.vocab_size == 257 and tok.eos_id == 256
    assert 'tokenizer: byte' in capsys.readouterr().out
    s = 'héllo wörld ✓'
    assert tok.decode(tok.encode(s)) == s
    assert tok.encode_array(s).tolist() == tok.encode(s)


@pytest.mark.parametrize('tiktoken_loads', [False, True])
def test_text_from_scratch_is_bytes_whether_or_not_tiktoken_loads(tmp_path, request, capsys, tiktoken_loads):
    """Issue 22: one command, one vocabulary on every machine. Bytes by default; --tokenizer gpt2 asks for
    tiktoken's GPT-2 BPE, and where tiktoken cannot load it that is an error saying so."""
    request.getfixturevalue('with_tiktoken' if tiktoken_loads else 'no_tiktoken')
    text = tmp_path / 'corpus.txt'
    text.write_text('the other theme: the heather. ' * 40)
    args = ['--task', 'text', '--data', str(text), '--max_iters', '1', '--attn', 'elu']
    s, _ = run(tmp_path, *args, name='default')
    assert (s['tokenizer'], s['model_config']['vocab_size']) == ('byte', 257)
    if tiktoken_loads:
        s, _ = run(tmp_path, *args, '--tokenizer', 'gpt2', name='gpt2')
        assert (s['tokenizer'], s['model_config']['vocab_size']) == ('tiktoken-gpt2', 259)
        model, _ = M.load(str(tmp_path / 'gpt2' / 'ckpt.pt'))
        assert model.tokenizer.encode('the') == [256, 101]                # 'th' 'e': the BPE, not bytes
    else:
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            run(tmp_path, *args, '--tokenizer', 'gpt2', name='gpt2')
        err = capsys.readouterr().err
        assert e.value.code == 2 and "tokenizer 'gpt2' (tiktoken) cannot be loaded" in err and 'ConnectionError' in err


def test_load_text_file_folder_and_offline_name(tmp_path, monkeypatch):
    (tmp_path / 'a.txt').write_text('first')
    (tmp_path / 'sub').mkdir()
    (tmp_path / 'sub' / 'b.txt').write_text('second')
    (tmp_path / 'c.md').write_text('ignored')
    assert T.load_text(str(tmp_path / 'a.txt')) == 'first'
    assert T.load_text(str(tmp_path)) == 'first\n\nsecond'
    import datasets

    def offline(*a, **k):
        raise ConnectionError('no internet')
    monkeypatch.setattr(datasets, 'load_dataset', offline)
    with pytest.raises(ValueError, match='offline, pass a local text file or folder'):
        T.load_text('wikitext:wikitext-103-raw-v1')


def test_get_text_batch():
    ids = np.arange(100)
    x, y = T.get_text_batch(ids, [0, 10], 5)
    assert x.tolist() == [[0, 1, 2, 3, 4], [10, 11, 12, 13, 14]]
    assert torch.equal(y, x + 1)


# -----------------------------------------------------------------------------
# GLUE loading and metrics

def test_load_glue_layouts(tmp_path):
    cola = tmp_path / 'cola'
    cola.mkdir()
    (cola / 'train.tsv').write_text('the cat sat\t1\ncat the sat "\t0\n')
    (cola / 'dev.tsv').write_text('gj04\t1\t\tthe dog ran\n')       # original GLUE CoLA layout
    assert T.load_glue('cola', str(cola), 'train') == [('the cat sat', None, 1), ('cat the sat "', None, 0)]
    assert T.load_glue('cola', str(cola), 'validation') == [('the dog ran', None, 1)]
    mrpc = tmp_path / 'mrpc'
    mrpc.mkdir()
    (mrpc / 'train.tsv').write_text('Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t1\t2\tA b.\tA c.\n')
    assert T.load_glue('mrpc', str(mrpc)) == [('A b.', 'A c.', 1)]
    stsb = tmp_path / 'stsb'
    stsb.mkdir()
    (stsb / 'validation.csv').write_text('sentence1,sentence2,label\n"x, y",z,3.5\n')
    assert T.load_glue('stsb', str(stsb), 'validation') == [('x, y', 'z', 3.5)]
    mnli = tmp_path / 'mnli'
    mnli.mkdir()
    rows = [{'premise': 'p', 'hypothesis': 'h', 'label': 'contradiction'},
            {'premise': 'p2', 'hypothesis': 'h2', 'label': 0},
            {'premise': 'p3', 'hypothesis': 'h3', 'label': 'entailment'}]    # 0: not a number
    (mnli / 'dev_matched.jsonl').write_text('\n'.join(json.dumps(r) for r in rows))
    assert T.load_glue('mnli', str(mnli), 'validation') == [('p', 'h', 2), ('p2', 'h2', 0), ('p3', 'h3', 0)]
    with pytest.raises(ValueError, match='no train file'):
        T.load_glue('rte', str(mnli), 'train')
    with pytest.raises(ValueError, match='unknown GLUE task'):
        T.load_glue('squad', str(mnli))
    with pytest.raises(ValueError, match="unknown GLUE task 'sts-b'"):     # one spelling per task
        T.load_glue('sts-b', str(stsb), 'validation')


def test_glue_metrics_match_sklearn_and_scipy():
    rng = np.random.default_rng(0)
    for n_cls in (2, 3):
        labels, preds = rng.integers(0, n_cls, 200), rng.integers(0, n_cls, 200)
        preds[:120] = labels[:120]
        assert T.matthews_corrcoef(labels, preds) == pytest.approx(
            sklearn_metrics.matthews_corrcoef(labels, preds), abs=1e-12)
    m = T.glue_metric('cola', preds % 2, labels % 2)
    assert m['mcc'] == pytest.approx(sklearn_metrics.matthews_corrcoef(labels % 2, preds % 2), abs=1e-12)
    assert m['main'] == m['mcc']
    m = T.glue_metric('mrpc', preds % 2, labels % 2)
    assert m['f1'] == pytest.approx(sklearn_metrics.f1_score(labels % 2, preds % 2), abs=1e-12)
    assert m['accuracy'] == pytest.approx(sklearn_metrics.accuracy_score(labels % 2, preds % 2))
    assert T.glue_metric('mnli', preds, labels)['accuracy'] == pytest.approx(np.mean(preds == labels))
    a = rng.normal(size=100)
    b = np.round(a + rng.normal(size=100), 1)        # ties for the ranks
    m = T.glue_metric('stsb', a, b)
    assert m['pearson'] == pytest.approx(stats.pearsonr(a, b)[0], abs=1e-10)
    assert m['spearman'] == pytest.approx(stats.spearmanr(a, b)[0], abs=1e-10)
    assert T.matthews_corrcoef([1, 1, 1], [1, 1, 1]) == 0.0          # degenerate: sklearn gives 0 too


# -----------------------------------------------------------------------------
# training runs

def test_train_ar_tiny(tmp_path, capsys):
    s, log = run(tmp_path, '--max_iters', '6', '--eval_interval', '3', '--attn', 'hedgehog')
    out = capsys.readouterr().out
    assert 'step 6/6 | loss ' in out and 'tok/s | eta ' in out
    assert len(log) == 6 and [r['iter'] for r in log] == list(range(6))
    with open(tmp_path / 'run' / 'summary.json') as f:
        saved = json.load(f)
    assert saved['config']['attn'] == 'hedgehog' and saved['iters'] == 6
    m = saved['metrics']
    assert s['metrics'] == m
    # the metrics, recomputed from the checkpoint on the 2000 test sequences (seed 1337 + 1_000_003, one query each)
    model, _ = M.load(str(tmp_path / 'run' / 'ckpt.pt'))
    x, y = T.make_associative_recall(2000, 16, 40, 1337 + 1_000_003)
    with torch.no_grad():
        logits = model(x)[0][:, -1].double()
    assert m['test_acc'] == pytest.approx((logits.argmax(-1) == y[:, -1]).double().mean().item(), abs=1e-12)
    assert m['test_loss'] == pytest.approx(F.cross_entropy(logits, y[:, -1]).item(), rel=1e-4)
    with model.capture_qkv() as rec, torch.no_grad():
        model(x[:256])
    w = model.attention_cores()[0].weights(*rec[0][:2]).double()   # (256, H, 16, 16)
    ent = -(w * w.clamp_min(1e-300).log()).sum(-1)
    assert m['attn_entropy'] == pytest.approx(ent.mean().item(), rel=1e-4)
    assert m['attn_entropy_query'] == pytest.approx(ent[..., -1].mean().item(), rel=1e-4)


def test_default_recipe_learns_recall_and_needs_the_short_conv(tmp_path):
    """The scratch recipe (N(0, 1) embeddings, N(0, 0.08) weights, untied head, 2-tap conv on the keys) learns a
    small associative recall with hedgehog (chance 1/8); the same run without the key convolution does not."""
    args = ['--n_layer', '2', '--n_head', '2', '--n_embd', '32', '--seq_len', '32', '--ar_vocab', '16',
            '--n_train', '2000', '--batch_size', '32', '--max_iters', '400', '--warmup_iters', '20',
            '--eval_interval', '1000', '--no_save', '--device', 'cpu',
            '--attn', 'hedgehog']
    with_conv = T.main(args + ['--out_dir', str(tmp_path / 'conv')])
    without = T.main(args + ['--short_conv', '0', '--out_dir', str(tmp_path / 'plain')])
    assert with_conv['metrics']['test_acc'] >= 0.95       # measured 0.993 (2000 test sequences)
    assert without['metrics']['test_acc'] < 0.5           # measured 0.2225


def test_train_mqar_softmax_learns_something(tmp_path):
    s, log = run(tmp_path, '--task', 'mqar', '--attn', 'softmax', '--max_iters', '30',
                 '--eval_interval', '30', '--no_save')
    assert log[-1]['loss'] < log[0]['loss']
    assert not os.path.exists(tmp_path / 'run' / 'ckpt.pt')


def test_train_text_tiny_byte_tokenizer(tmp_path, no_tiktoken, capsys):
    text = tmp_path / 'corpus.txt'
    text.write_text('the quick brown fox jumps over the lazy dog. ' * 60)
    s, log = run(tmp_path, '--task', 'text', '--data', str(text), '--max_iters', '8', '--eval_interval', '4',
                 '--attn', 'elu')
    assert 'tokenizer: byte' in capsys.readouterr().out
    assert s['tokenizer'] == 'byte' and s['model_config']['vocab_size'] == 257
    m = s['metrics']
    assert m['val_ppl'] == pytest.approx(np.exp(m['val_loss']))
    assert m['val_ppl'] < 257 and m['val_tokens'] > 0
    val_ids = T.text_splits(T.TrainConfig(data=str(text), seq_len=16).data_config(), T.get_tokenizer(verbose=False))[1]
    assert m['val_tokens'] == len(val_ids) - 1               # T.perplexity: every token but the first


def test_perplexity_scores_every_token_but_the_first_once():
    """Against forwards computed by hand: with context >= the text, perplexity is one forward's mean NLL of
    tokens 1..n-1; with context 16, stride 5, token t > 16 is predicted from ids[b:t] with b = 5 * ceil((t - 16)
    / 5) (the window that first reaches it), each token once. (The model's loss is float32: rel 1e-6.)"""
    torch.manual_seed(0)
    m = T.build_model(T.TrainConfig(attn='softmax', n_layer=1, n_head=2, n_embd=16, seq_len=64), 50).double().eval()
    ids = torch.randint(0, 50, (40,))

    def nll(b, t):   # -log p(ids[t] | ids[b:t])
        return F.cross_entropy(m(ids[None, b:t])[0][0, -1:], ids[t:t + 1]).item()
    with torch.no_grad():
        full = np.mean([nll(0, t) for t in range(1, 40)])
        windowed = np.mean([nll(0 if t <= 16 else 5 * math.ceil((t - 16) / 5), t) for t in range(1, 40)])
    r = T.perplexity(m, ids, context=64, stride=64)
    assert (r['tokens_scored'], r['windows']) == (39, 1)
    assert r['nll'] == pytest.approx(full, rel=1e-6) and r["ppl"] == pytest.approx(math.exp(full), rel=1e-6)
    r = T.perplexity(m, ids, context=16, stride=5, batch_size=3)
    assert (r['tokens_scored'], r['windows']) == (39, 6)
    assert r['nll'] == pytest.approx(windowed, rel=1e-6) and abs(windowed - full) > 1e-4


def test_finetune_from_our_checkpoint(tmp_path, no_tiktoken):
    text = tmp_path / 'corpus.txt'
    text.write_text('abc def ghi. ' * 100)
    run(tmp_path, '--task', 'text', '--data', str(text), '--max_iters', '3', '--attn', 'elu', name='pre')
    ckpt = str(tmp_path / 'pre' / 'ckpt.pt')
    s, _ = run(tmp_path, '--task', 'text', '--data', str(text), '--max_iters', '2', '--init_from', ckpt, name='ft')
    assert s['model_config']['attn'] == 'elu'                           # the checkpoint's attention is kept
    s, _ = run(tmp_path, '--task', 'text', '--data', str(text), '--max_iters', '2', '--init_from', ckpt,
               '--attn', 'hedgehog', name='ft2')
    assert s['model_config']['attn'] == 'hedgehog'                      # unless --attn is given


def _cola(tmp_path):
    d = tmp_path / 'cola'
    d.mkdir()
    good = ['the cat sat on the mat', 'a dog ran home', 'we like green tea', 'she reads books']
    bad = ['cat the mat on sat', 'ran dog a home', 'tea green like we', 'books she reads the of']
    rows = [f"{s}\t1" for s in good] + [f"{s}\t0" for s in bad]
    (d / 'train.tsv').write_text('\n'.join(rows * 3) + '\n')
    (d / 'dev.tsv').write_text('\n'.join(rows) + '\n')
    return d


def test_train_glue_scratch_bert_and_gpt(tmp_path, no_tiktoken):
    d = _cola(tmp_path)
    s, _ = run(tmp_path, '--task', 'glue', '--glue_task', 'cola', '--data', str(d), '--seq_len', '48',
               '--max_iters', '4', '--eval_interval', '2', name='bert')
    assert s['model_config']['family'] == 'bert' and s['model_config']['num_labels'] == 2
    assert set(s['metrics']) >= {'dev_mcc', 'dev_accuracy', 'dev_loss'}
    # a causal model classifies from its last token; its head is saved with the checkpoint and resumes
    s, _ = run(tmp_path, '--task', 'glue', '--data', str(d), '--seq_len', '48', '--family', 'gpt2',
               '--max_iters', '4', '--eval_interval', '2', '--attn', 'elu', name='gpt')
    assert s['model_config']['family'] == 'gpt2' and -1 <= s['metrics']['dev_mcc'] <= 1
    s, _ = run(tmp_path, '--task', 'glue', '--data', str(d), '--seq_len', '48', '--family', 'gpt2',
               '--max_iters', '6', '--eval_interval', '2', '--attn', 'elu', '--resume', name='gpt')
    assert s['iters'] == 6


def test_train_glue_from_hf_bert_with_its_tokenizer(tmp_path, capsys):
    d = _cola(tmp_path)
    words = sorted({w for line in open(d / 'train.tsv') for w in line.split('\t')[0].split()})
    vocab = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] + words
    hf_dir = tmp_path / 'bert'
    hf_dir.mkdir()
    (hf_dir / 'vocab.txt').write_text('\n'.join(vocab) + '\n')
    transformers.BertTokenizer(str(hf_dir / 'vocab.txt')).save_pretrained(str(hf_dir))
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=32, max_position_embeddings=64)
    transformers.BertModel(config).save_pretrained(str(hf_dir))
    s, log = run(tmp_path, '--task', 'glue', '--data', str(d), '--init_from', str(hf_dir), '--seq_len', '32',
                 '--max_iters', '4', '--eval_interval', '4', '--attn', 'hedgehog')
    assert 'glue tokenizer: hf:BertTokenizer' in capsys.readouterr().out
    assert s['model_config']['attn'] == 'hedgehog' and s['model_config']['n_embd'] == 16
    assert s['model_config']['num_labels'] == 2 and 'dev_mcc' in s['metrics']
    assert all(np.isfinite(r['loss']) for r in log)


def test_train_glue_stsb_regression(tmp_path, no_tiktoken):
    d = tmp_path / 'stsb'
    d.mkdir()
    rows = ['sentence1\tsentence2\tscore'] + [f"s {i}\tt {i % 3}\t{i % 5}.0" for i in range(12)]
    (d / 'train.tsv').write_text('\n'.join(rows) + '\n')
    (d / 'dev.tsv').write_text('\n'.join(rows[:7]) + '\n')
    s, _ = run(tmp_path, '--task', 'glue', '--glue_task', 'stsb', '--data', str(d), '--seq_len', '32',
               '--max_iters', '3', '--eval_interval', '3')
    assert s['model_config']['num_labels'] == 1
    assert {'dev_pearson', 'dev_spearman'} <= set(s['metrics'])


def test_resume_continues_exactly(tmp_path, monkeypatch):
    common = ['--max_iters', '8', '--eval_interval', '4', '--dropout', '0.1', '--attn', 'hedgehog']
    _, full = run(tmp_path, *common, name='full')
    real_loss, calls = T.task_loss, {'n': 0}

    def killed(module, batch):   # the process dies in step 6, after the checkpoint of step 4
        calls['n'] += 1
        if calls['n'] == 6:
            raise RuntimeError('killed (test)')
        return real_loss(module, batch)
    monkeypatch.setattr(T, 'task_loss', killed)
    with pytest.raises(RuntimeError, match='killed'):
        run(tmp_path, *common, name='split')
    monkeypatch.setattr(T, 'task_loss', real_loss)
    _, resumed = run(tmp_path, *common, '--resume', name='split')
    assert [r['iter'] for r in resumed] == list(range(8))
    assert [r['loss'] for r in resumed] == [r['loss'] for r in full]      # bit-identical loss curve
    a, _ = M.load(str(tmp_path / 'full' / 'ckpt.pt'))
    b, _ = M.load(str(tmp_path / 'split' / 'ckpt.pt'))
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), n


def test_resume_without_checkpoint_is_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        run(tmp_path, '--resume', '--max_iters', '2')
    assert e.value.code == 2 and 'no checkpoint' in capsys.readouterr().err


def test_nonfinite_loss_stops_and_keeps_last_checkpoint(tmp_path, monkeypatch, capsys):
    run(tmp_path, '--max_iters', '4', '--eval_interval', '2')
    ckpt = tmp_path / 'run' / 'ckpt.pt'
    real_loss = T.task_loss
    calls = {'n': 0}

    def poisoned(module, batch):   # a NaN loss from the 3rd micro-step of the resumed run (step 6)
        calls['n'] += 1
        loss = real_loss(module, batch)
        return loss * float('nan') if calls['n'] >= 3 else loss
    monkeypatch.setattr(T, 'task_loss', poisoned)
    with pytest.raises(SystemExit) as e:
        run(tmp_path, '--max_iters', '10', '--eval_interval', '1', '--resume')
    assert e.value.code == T.NONFINITE_EXIT
    err = capsys.readouterr().err
    assert 'non-finite loss (nan) at step 6' in err
    assert 'lower --lr' in err and '--dtype float32' in err and 'feature map' in err
    assert 'last good checkpoint' in err and 'was kept' in err
    model, extra = M.load(str(ckpt))
    assert extra['iter_num'] == 6                                   # saved after steps 4 and 5, not after 6
    assert all(torch.isfinite(p).all() for p in model.parameters())
    before = sha(ckpt)
    with pytest.raises(SystemExit):                                  # stopping again leaves it untouched
        run(tmp_path, '--max_iters', '10', '--eval_interval', '1', '--resume')
    assert sha(ckpt) == before


def test_diverging_lr_stops_with_exit_status(tmp_path):
    """The largest --lr allowed (1; above it, one line and exit 2) sends hedgehog's exponentials to inf within steps."""
    r = subprocess.run([sys.executable, 'train.py'] + TINY + [
        '--out_dir', str(tmp_path / 'x'), '--max_iters', '50', '--eval_interval', '50', '--lr', '1',
        '--warmup_iters', '0', '--attn', 'hedgehog'], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == T.NONFINITE_EXIT, r.stdout + r.stderr
    assert 'train.py: error: non-finite' in r.stderr and 'lower --lr (now 1)' in r.stderr
    assert 'no checkpoint was written' in r.stderr


def test_compare_two_maps(tmp_path, capsys):
    rows = T.main(TINY + ['--out_dir', str(tmp_path), '--compare', 'softmax,exp:t=2', '--max_iters', '4',
                          '--eval_interval', '2', '--no_save'])
    assert [spec for spec, _ in rows] == ['softmax', 'exp:t=2']
    # issue 63: every evaluation kept with its step (compare.png draws them)
    assert [e['iter'] for e in rows[1][1]['evals']] == [2, 4]
    assert rows[1][1]['evals'][-1]['val_acc'] == rows[1][1]['metrics']['last_eval_val_acc']
    assert (tmp_path / 'compare.png').stat().st_size > 1000
    table = (tmp_path / 'compare.md').read_text()
    assert '| softmax |' in table and '| exp:t=2 |' in table
    assert json.loads((tmp_path / 'exp_t2' / 'summary.json').read_text())['model_config']['attn'] == \
        'exp:temperature=2'
    assert '| map | test_acc |' in capsys.readouterr().out


# -----------------------------------------------------------------------------
# DDP: 2 CPU processes with gloo == 1 process with the same global batch

@pytest.mark.slow
def test_ddp_two_gloo_processes_match_single_process(tmp_path):
    args = TINY + ['--max_iters', '4', '--eval_interval', '4', '--batch_size', '4', '--grad_accum', '4',
                   '--attn', 'hedgehog']
    single = str(tmp_path / 'single')
    T.main(args + ['--out_dir', single])
    ddp = str(tmp_path / 'ddp')
    env = dict(os.environ, OMP_NUM_THREADS='1')
    r = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                        'train.py'] + args + ['--out_dir', ddp], cwd=ROOT, capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert 'DDP x2' in r.stdout
    assert r.stdout.count('final: ') == 1                       # only rank 0 logs
    a, b = read_log(single), read_log(ddp)
    assert [x['iter'] for x in b] == list(range(4))
    np.testing.assert_allclose([x['loss'] for x in b], [x['loss'] for x in a], rtol=1e-5, atol=1e-6)
    ma, _ = M.load(os.path.join(single, 'ckpt.pt'))
    mb, _ = M.load(os.path.join(ddp, 'ckpt.pt'))
    for (n, p), (_, q) in zip(ma.state_dict().items(), mb.state_dict().items()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-5, msg=n)


@pytest.mark.slow
def test_ddp_glue_on_a_causal_model(tmp_path):
    """Issue 27: a causal model classifies from its last token through a new head, so its untied lm_head gets no
    gradient; DDP (which expects every trainable parameter to) stopped at the second step. 2 gloo processes match
    one process with the same global batch, and the lm_head is unchanged."""
    d = _cola(tmp_path)
    args = TINY + ['--task', 'glue', '--data', str(d), '--family', 'llama', '--seq_len', '48', '--max_iters', '3',
                   '--eval_interval', '3', '--grad_accum', '2', '--attn', 'elu']
    T.main(args + ['--out_dir', str(tmp_path / 'single')])
    r = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                        'train.py'] + args + ['--out_dir', str(tmp_path / 'ddp')], cwd=ROOT, capture_output=True,
                       text=True, env=dict(os.environ, OMP_NUM_THREADS='1'), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    a, b = read_log(str(tmp_path / 'single')), read_log(str(tmp_path / 'ddp'))
    np.testing.assert_allclose([x['loss'] for x in b], [x['loss'] for x in a], rtol=1e-5, atol=1e-6)
    (ma, sa), (mb, _) = (M.load(str(tmp_path / n / 'ckpt.pt')) for n in ('single', 'ddp'))
    torch.testing.assert_close(mb.lm_head.weight, ma.lm_head.weight)
    torch.manual_seed(1337)   # the scratch model's initial weights (train.py seeds them with --seed)
    init = T.build_model(*T.parse_config(T.TrainConfig, args)[:1], 257, 2, explicit={'family'})
    torch.testing.assert_close(ma.lm_head.weight, init.lm_head.weight)
