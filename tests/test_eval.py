"""eval.py: every report runs on tiny local data on CPU; metric code agrees with trusted references
(rouge-score for ROUGE, scikit-learn / scipy for the GLUE metrics)."""
import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from rouge_score import rouge_scorer
from scipy import stats
from sklearn import metrics

import attention
import hybrids
import eval as ev
import model as M
import tokenizer
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
        "First Citizen:\nYou are all resolved rather to die than to famish?\n\nAll:\nResolved. resolved.\n") * 3


def _vocab():
    return tokenizer.load_tokenizer('bytes').vocab_size


def _tiny_gpt(tmp_path, attn='softmax', name='tiny.pt', block_size=64, **kw):
    torch.manual_seed(0)
    cfg = M.GPTConfig(family='gpt2', vocab_size=_vocab(), block_size=block_size, n_layer=2, n_head=2, n_embd=32,
                      attn=attn, **kw)
    m = M.GPT(cfg).eval()
    path = str(tmp_path / name)
    M.save(path, m)
    return m, path


def _text_file(tmp_path):
    p = tmp_path / 'text.txt'
    p.write_text(TEXT)
    return str(p)


def _run(argv):
    return ev.main(argv)


def _json(out_dir, report):
    with open(os.path.join(out_dir, f'{report}.json')) as f:
        return json.load(f)


# ---- ROUGE ------------------------------------------------------------------------------------------------

def test_rouge_hand_computed():
    """rouge(): the corpus mean of rouge-score's F-measures, x100, on a case worked by hand.
    'the cat sat' vs 'the cat': ROUGE-1 P 1, R 2/3, F 0.8; ROUGE-2 P 1, R 1/2, F 2/3; ROUGE-L (LCS 2) F 0.8.
    'a b' vs 'c d': 0 for all three. Means x100: 40, 33.33, 40."""
    got = ev.rouge(['the cat sat', 'a b'], ['The cat!', 'c d'])
    assert got == pytest.approx({'rouge1': 40.0, 'rouge2': 100 / 3, 'rougeL': 40.0}, abs=1e-9)
    with pytest.raises(attention.UsageError, match='as many predictions as references'):
        ev.rouge(['a'], [])


class _Bytes:
    """A stand-in tokenizer: UTF-8 bytes, EOS chosen by the test."""
    def __init__(self, eos_id):
        self.eos_id = eos_id

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(ids).decode('utf-8', errors='replace')


def test_summarize_prompt_and_eos(tmp_path):
    """summarize(): the greedy continuation of the SAMSum prompt around the dialogue, cut at EOS, stripped."""
    m, _ = _tiny_gpt(tmp_path, block_size=256)
    prompt = list(ev.SAMSUM_PROMPT.format(dialogue='A: hi\nB: hello').encode())
    new = m.generate(torch.tensor([prompt]), 8, temperature=0.0)[0, len(prompt):].tolist()
    cut = new.index(new[3])                                 # pretend the 4th generated token is EOS
    assert ev.summarize(m, _Bytes(new[3]), 'A: hi\nB: hello\n', 8) == bytes(new[:cut]).decode(
        'utf-8', errors='replace').strip()
    with pytest.raises(attention.UsageError, match='leaves no room'):
        ev.summarize(m, _Bytes(None), 'x', 256)


def test_rouge_report(tmp_path, capsys):
    _, ckpt = _tiny_gpt(tmp_path, block_size=256)
    data = tmp_path / 'dialogues.jsonl'
    rows = [{'dialogue': 'Amanda: I baked cookies. Do you want some?\nJerry: Sure!', 'summary':
             'Amanda baked cookies and will bring Jerry some tomorrow.'},
            {'dialogue': 'Tom: are you busy?\nAnn: yes', 'summary': 'Ann is busy.'}]
    data.write_text('\n'.join(json.dumps(r) for r in rows) + '\n')
    out = str(tmp_path / 'out')
    assert _run(['--ckpt', ckpt, '--rouge', '--data', str(data), '--max_new_tokens', '12', '--out_dir', out]) == 0
    res = _json(out, 'rouge')
    assert res['examples'] == 2 and set(res['scores']) == {'rouge1', 'rouge2', 'rougeL'}
    assert res['prompt_template'].startswith('Summarize this dialog:')
    assert [x[:22] for x in capsys.readouterr().out.splitlines() if x.startswith('rouge: ')] == \
        ['rouge: 1/2 dialogues |', 'rouge: 2/2 dialogues |']   # progress lines
    sc = rouge_scorer.RougeScorer(['rouge1', 'rouge2', 'rougeL'])
    for key, val in res['scores'].items():
        want = 100 * sum(sc.score(s['summary'], s['generated'])[key].fmeasure for s in res['samples']) / 2
        assert val == pytest.approx(want, abs=1e-6)


# ---- perplexity -------------------------------------------------------------------------------------------

@pytest.mark.parametrize('n,context,stride', [(2, 4, 4), (10, 4, 4), (11, 4, 2), (50, 16, 5), (17, 16, 16), (5, 8, 3)])
def test_ppl_windows_score_every_token_once(n, context, stride):
    seen = []
    for b, e, new in train.ppl_windows(n, context, stride):
        assert e - b <= context and 0 < new <= e - b
        seen += list(range(e - new + 1, e + 1))  # target positions scored by this window
    assert seen == list(range(1, n))


def test_ppl_matches_direct_computation(tmp_path):
    m, _ = _tiny_gpt(tmp_path)
    ids = torch.randint(0, m.config.vocab_size, (131,), generator=torch.Generator().manual_seed(1))
    C = 32
    res = train.perplexity(m, ids, context=C, stride=C, batch_size=3)
    # direct: non-overlapping blocks of C inputs, log-softmax of the full logits
    nll, count = 0.0, 0
    with torch.no_grad():
        for b in range(0, len(ids) - 1, C):
            x, y = ids[b:min(b + C, len(ids) - 1)], ids[b + 1:min(b + C, len(ids) - 1) + 1]
            logits, _ = m(x[None])
            nll += -F.log_softmax(logits[0].double(), -1).gather(-1, y[:, None]).sum().item()
            count += len(y)
    assert res['tokens_scored'] == count == len(ids) - 1
    assert res['nll'] == pytest.approx(nll / count, rel=1e-5)
    assert res['ppl'] == pytest.approx(math.exp(nll / count), rel=1e-5)
    # a smaller stride scores the same tokens, with more context
    res2 = train.perplexity(m, ids, context=C, stride=8)
    assert res2['tokens_scored'] == count and math.isfinite(res2['ppl'])


def test_ppl_report(tmp_path, capsys):
    _, ckpt = _tiny_gpt(tmp_path)
    out = str(tmp_path / 'out')
    assert _run(['--ckpt', ckpt, '--ppl', '--data', _text_file(tmp_path), '--context', '32', '--stride', '16',
                 '--batch_size', '1', '--out_dir', out]) == 0
    res = _json(out, 'ppl')
    assert res['context'] == 32 and res['stride'] == 16 and res['ppl'] > 1
    ids = tokenizer.load_tokenizer('bytes').encode(TEXT)
    assert res['tokens_scored'] == len(ids) - 1
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith('perplexity: ')]   # progress, as training
    assert 2 <= len(lines) <= 10 and lines[-1].startswith(f'perplexity: {len(ids) - 1:,}/{len(ids) - 1:,} tokens | ')
    assert all(' tokens/s | eta ' in x for x in lines)


def test_ppl_and_generate_past_block_size_on_rope_only(tmp_path, capsys):
    """Issue 60: a RoPE model is scored past its trained length (--context > block_size: 16K on SmolLM2, trained to
    8K), equal to the direct log-softmax over one window (with --rope_theta, that of the weights built with the
    base), and generates past it (--max_new_tokens > block_size) as
    model.generate does; learned positions stop at block_size, in one line each."""
    torch.manual_seed(0)
    cfg = M.GPTConfig(family='llama', vocab_size=_vocab(), block_size=16, n_layer=2, n_head=2, n_kv_head=1,
                      n_embd=32, bias=False, intermediate_size=64)
    m = M.GPT(cfg).eval()
    ckpt, out = str(tmp_path / 'rope.pt'), str(tmp_path / 'out')
    M.save(ckpt, m)
    ids = tokenizer.load_tokenizer('bytes').encode(TEXT)[:49]
    (tmp_path / 'short.txt').write_text(bytes(ids).decode())
    assert _run(['--ckpt', ckpt, '--ppl', '--data', str(tmp_path / 'short.txt'), '--context', '48', '--stride', '48',
                 '--out_dir', out]) == 0
    x = torch.tensor(ids)

    def direct_nll(net):   # the mean NLL of one window, by the model's own forward in float64 log-softmax
        with torch.no_grad():
            return -F.log_softmax(net(x[None, :-1])[0][0].double(), -1).gather(-1, x[1:, None]).mean().item()
    nll = direct_nll(m)
    assert _json(out, 'ppl')['ppl'] == pytest.approx(math.exp(nll), rel=1e-5)
    # --rope_theta: the weights built with that base (q, o and the tied head scaled up: random weights attend
    # near evenly, and the blocks' outputs hardly move the logits)
    scale = {'q_proj': 30, 'o_proj': 30, 'wte': 10, 'lm_head': 10}
    sharp = M.GPT(cfg).eval()
    sharp.load_state_dict({k: w * scale.get(k.split('.')[-2], 1) for k, w in m.state_dict().items()})
    M.save(str(tmp_path / 'sharp.pt'), sharp)
    ntk = M.GPT(dataclasses.replace(cfg, rope_theta=cfg.rope_theta * 3 ** (16 / 14))).eval()
    ntk.load_state_dict(sharp.state_dict())
    nlls = []
    for theta, net in ((0, sharp), (ntk.config.rope_theta, ntk)):
        assert _run(['--ckpt', str(tmp_path / 'sharp.pt'), '--ppl', '--data', str(tmp_path / 'short.txt'),
                     '--context', '48', '--stride', '48', '--rope_theta', str(theta), '--out_dir', out]) == 0
        nlls.append(direct_nll(net))
        assert _json(out, 'ppl')['ppl'] == pytest.approx(math.exp(nlls[-1]), rel=1e-5)
    assert abs(nlls[1] - nlls[0]) > 1e-3
    _, gpt2 = _tiny_gpt(tmp_path, block_size=16)
    capsys.readouterr()
    assert ev.main(['--ckpt', gpt2, '--ppl', '--data', str(tmp_path / 'short.txt'), '--rope_theta', '1e5']) == 2
    assert capsys.readouterr().err.strip() == 'eval.py: error: --rope_theta needs a RoPE model (llama), got gpt2'
    assert ev.main(['--ckpt', gpt2, '--ppl', '--data', str(tmp_path / 'short.txt'), '--context', '48']) == 2
    assert capsys.readouterr().err.strip() == 'eval.py: error: --context 48 > block_size 16 (learned positions)'
    assert _run(['--ckpt', ckpt, '--generate', '--prompt', 'ab', '--max_new_tokens', '24', '--out_dir', out]) == 0
    want = m.generate(torch.tensor([list(b'ab')]), 24, temperature=0.0, eos_token_id=256)[0, 2:].tolist()
    assert _json(out, 'generate')['samples'][0]['softmax']['text'] == bytes(t for t in want if t < 256).decode(
        'utf-8', 'replace')
    assert ev.main(['--ckpt', gpt2, '--generate', '--prompt', 'ab', '--max_new_tokens', '24']) == 2
    assert 'needs 25 positions, more than block_size=16 (learned positions)' in capsys.readouterr().err


def test_ppl_on_linear_checkpoint_dir(tmp_path):
    """--ckpt may be train.py's out_dir (holding ckpt.pt); a linear-attention model evaluates the same way."""
    d = tmp_path / 'run'
    d.mkdir()
    _tiny_gpt(d, attn='hedgehog', name='ckpt.pt')
    out = str(tmp_path / 'out')
    assert _run(['--ckpt', str(d), '--ppl', '--data', _text_file(tmp_path), '--context', '32', '--out_dir', out]) == 0
    res = _json(out, 'ppl')
    assert res['attn'] == 'hedgehog' and res['stride'] == 16 and math.isfinite(res['ppl'])


def test_softmax_shares_and_a_cache_added_at_load(tmp_path, capsys):
    """softmax_shares: each window layer's share of attention on its softmax part, against the attention matrix
    (the weights on the window and sink keys, summed per row). --attn loads a window model with a sparse cache
    (its trained maps kept) and --ppl reports both the perplexity and the shares."""
    m, path = _tiny_gpt(tmp_path, attn='hedgehog:window=4:sinks=1', block_size=64)
    x = torch.randint(0, _vocab(), (2, 40))
    with torch.no_grad(), ev.softmax_shares(m) as shares, m.capture_qkv() as rec:
        m(x)
    for i, core in enumerate(m.attention_cores()):
        w = core.weights(*rec[i][:2]).double()   # (2, H, 40, 40)
        a, b = torch.arange(40)[:, None], torch.arange(40)[None, :]
        soft = (w * (((a - b < 4) | (b < 1)) & (b <= a))).sum(-1)   # the window and the sink
        assert shares[i]['mean'] == pytest.approx(soft.mean().item(), rel=1e-5)
        assert shares[i]['last'] == pytest.approx(soft[..., -1].mean().item(), rel=1e-5)
    out = str(tmp_path / 'out')
    assert _run(['--ckpt', path, '--attn', 'hedgehog:window=4:sinks=1:cache=4', '--ppl', '--data', _text_file(tmp_path),
                 '--context', '48', '--out_dir', out]) == 0
    res = _json(out, 'ppl')
    assert res['attn'] == 'hedgehog:window=4:sinks=1:cache=4' and set(res['softmax_share']) == {'0', '1'}
    printed = capsys.readouterr().out
    assert 'softmax-part share ' in printed and 're-initialised' not in printed


# ---- GLUE -------------------------------------------------------------------------------------------------

def test_glue_metrics_match_sklearn_scipy():
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 2, (200,), generator=g).tolist()
    preds = [y if torch.rand(1, generator=g).item() < 0.7 else 1 - y for y in labels]
    cola = train.glue_metric('cola', preds, labels)
    assert cola['mcc'] == pytest.approx(metrics.matthews_corrcoef(labels, preds), abs=1e-9)
    mrpc = train.glue_metric('mrpc', preds, labels)
    assert mrpc['f1'] == pytest.approx(metrics.f1_score(labels, preds), abs=1e-9)
    assert mrpc['accuracy'] == pytest.approx(metrics.accuracy_score(labels, preds), abs=1e-9)
    labels3 = torch.randint(0, 3, (100,), generator=g).tolist()
    preds3 = torch.randint(0, 3, (100,), generator=g).tolist()
    assert train.glue_metric('mnli', preds3, labels3)['accuracy'] == pytest.approx(
        metrics.accuracy_score(labels3, preds3))
    y = (torch.rand(80, generator=g) * 5).tolist()
    p = [v + 0.8 * torch.randn(1, generator=g).item() for v in y]
    p[3] = p[4]  # a tie for Spearman's ranks
    st = train.glue_metric('stsb', p, y)
    assert st['pearson'] == pytest.approx(stats.pearsonr(p, y)[0], abs=1e-9)
    assert st['spearman'] == pytest.approx(stats.spearmanr(p, y)[0], abs=1e-9)


def _cola_dir(tmp_path):
    d = tmp_path / 'cola'
    d.mkdir()
    rows = ['the cat sat on the mat .\t1', 'cat the mat on sat .\t0', 'she reads books .\t1',
            'books she reads the the .\t0', 'we walked home .\t1', 'home walked we .\t0', 'it rains .\t1']
    (d / 'train.tsv').write_text('\n'.join(rows) + '\n')
    (d / 'dev.tsv').write_text('\n'.join(rows) + '\n')
    return str(d)


@pytest.mark.parametrize('family', ['bert', 'gpt2'])
def test_glue_report(tmp_path, family):
    torch.manual_seed(0)
    cfg = M.GPTConfig(family=family, vocab_size=_vocab(), block_size=32, n_layer=1, n_head=2, n_embd=32,
                      num_labels=2 if family == 'bert' else 0, attn='elu')
    m = M.build(cfg).eval()
    extra = {'train_config': {'task': 'glue', 'glue_task': 'cola', 'seq_len': 32, 'init_from': 'scratch'}}
    if family != 'bert':
        head = train.Classifier(m, 2).head
        extra['cls_head'] = head.state_dict()
    ckpt = str(tmp_path / 'cls.pt')
    M.save(ckpt, m, **extra)
    out = str(tmp_path / 'out')
    data = _cola_dir(tmp_path)
    assert _run(['--ckpt', ckpt, '--glue', 'cola', '--data', data, '--out_dir', out]) == 0
    res = _json(out, 'glue')
    assert res['task'] == 'cola' and res['examples'] == 7
    # the reported MCC is sklearn's on the same predictions
    model, extra = M.load(ckpt)
    module = train.Classifier(model, 2)
    if family != 'bert':
        module.head.load_state_dict(extra['cls_head'])
    enc = train.GlueEncoder('scratch', 32, verbose=False)
    preds, labels = ev.predict_glue(module.eval(), enc, train.load_glue('cola', data, 'validation'), 2)
    assert res['metrics']['mcc'] == pytest.approx(metrics.matthews_corrcoef(labels, preds), abs=1e-9)
    # a checkpoint for another task is refused
    assert _run(['--ckpt', ckpt, '--glue', 'sst2', '--data', data, '--out_dir', out]) == 2


# ---- fidelity ---------------------------------------------------------------------------------------------

def test_fidelity_stats_sanity():
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    stats, weights = ev.fidelity_stats(q, k, {'same': lambda q_, k_: attention.softmax_weights(q_, k_),
                                              'uniform': lambda q_, k_: attention.linear_attention_weights(
                                                  torch.ones(1, 2, 16, 1), torch.ones(1, 2, 16, 1))})
    assert list(weights) == ['softmax', 'same', 'uniform'] and 'kl' not in stats['softmax']
    for h in range(2):
        assert stats['same']['kl'][h] == pytest.approx(0.0, abs=1e-5)
        assert stats['softmax']['monotonicity'][h] == pytest.approx(1.0, abs=1e-6)
        assert stats['uniform']['kl'][h] > 0.01
        assert stats['uniform']['entropy'][h] > stats['softmax']['entropy'][h]  # uniform rows: maximal entropy


def test_fidelity_report_converted_model(tmp_path):
    m, _ = _tiny_gpt(tmp_path)
    m.set_attention('hedgehog', layers=[1])  # "converted" layer 1: its map is the student of the softmax teacher
    ckpt = str(tmp_path / 'hh.pt')
    M.save(ckpt, m)
    out = str(tmp_path / 'out')
    assert _run(['--ckpt', ckpt, '--fidelity', '--data', _text_file(tmp_path), '--context', '32',
                 '--maps', 'elu,performer', '--heads', '0:0,1:0', '--out_dir', out]) == 0
    res = _json(out, 'fidelity')
    assert set(res['maps']) == {'softmax', 'hedgehog (model)', 'elu (untrained)', 'performer (untrained)'}
    assert len(res['layers']) == 2 and len(res['layers'][0]['heads']) == 2
    hh = res['summary']['hedgehog (model)']
    assert hh['kl_per_layer'][0] is None and hh['kl_per_layer'][1] >= 0 and hh['kl_mean'] == hh['kl_per_layer'][1]
    for layer in res['layers']:
        for h in layer['heads']:
            for name, s in h['maps'].items():
                assert s['kl'] >= -1e-6 and s['entropy'] > 0 and -1 <= s['monotonicity'] <= 1
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert res['figures'] == []
    else:
        assert len(res['figures']) == 3 and all(os.path.getsize(f) > 1000 for f in res['figures'])


def test_fidelity_report_softmax_model_defaults(tmp_path):
    """A plain softmax model: untrained maps are compared to it."""
    _, ckpt = _tiny_gpt(tmp_path)
    out = str(tmp_path / 'out')
    assert _run(['--ckpt', ckpt, '--fidelity', '--data', _text_file(tmp_path), '--context', '16',
                 '--maps', 'cosformer', '--out_dir', out]) == 0
    res = _json(out, 'fidelity')
    assert res['maps'] == ['softmax', 'cosformer (untrained)']


def _fidelity_of(tmp_path, model, extra):
    """Saves `model`, runs eval.py --fidelity on it (16-token windows) with `extra` flags -> (fidelity.json, ckpt)."""
    ckpt = str(tmp_path / 'fid.pt')
    M.save(ckpt, model)
    out = str(tmp_path / 'out')
    assert _run(['--ckpt', ckpt, '--fidelity', '--data', _text_file(tmp_path), '--context', '16', *extra,
                 '--out_dir', out]) == 0
    return _json(out, 'fidelity'), ckpt


def test_fidelity_teacher_qk_and_map_options(tmp_path):
    """--qk teacher takes every layer's q, k from the softmax forward pass (what the unconverted model computes);
    --qk model from the converted model's own pass. --maps takes options ('exp:t=2')."""
    soft, _ = _tiny_gpt(tmp_path)
    m, _ = _tiny_gpt(tmp_path, name='other.pt')
    m.set_attention('elu')      # same q/k/v weights as `soft`, every layer linear
    idx = torch.randint(0, 200, (2, 24))
    want = ev.capture_qk(soft, idx)
    got_t, got_m = ev.capture_qk(m, idx, teacher=True), ev.capture_qk(m, idx)
    assert all(c.mode == 'linear' for c in m.attention_cores())   # the students are back
    for (qw, kw), (qt, kt), (qm, km) in zip(want, got_t, got_m):
        torch.testing.assert_close(qt, qw)
        torch.testing.assert_close(kt, kw)
    torch.testing.assert_close(got_m[0][0], want[0][0])       # layer 0 sees the embeddings either way
    assert (got_m[1][0] - want[1][0]).abs().max() > 1e-4      # layer 1 sees layer 0's linear attention
    res, ckpt = _fidelity_of(tmp_path, m, ['--qk', 'teacher', '--maps', 'exp,exp:t=2'])
    assert res['qk'] == 'teacher'
    assert res['maps'] == ['softmax', 'elu (model)', 'exp (untrained)', 'exp:t=2 (untrained)']
    s = res['summary']
    assert s['exp (untrained)']['kl_mean'] != pytest.approx(s['exp:t=2 (untrained)']['kl_mean'], rel=1e-3)
    assert _run(['--ckpt', ckpt, '--fidelity', '--data', _text_file(tmp_path), '--maps', 'exp:t']) == 2


def test_fidelity_calibrates_lln(tmp_path):
    """issue 22: --maps lln is calibrated (sigma_q^2, sigma_k^2 per head) on the q, k it is measured on, as convert.py
    calibrates before stage 1, and labelled so; it was reported uncalibrated (sigma^2 = 1) as "lln (untrained)"."""
    m, _ = _tiny_gpt(tmp_path)
    res, _ = _fidelity_of(tmp_path, m, ['--maps', 'lln,elu', '--batch_size', '4'])
    assert res['maps'] == ['softmax', 'lln (calibrated)', 'elu (untrained)']
    tok = train.get_tokenizer(verbose=False)
    q, k = ev.capture_qk(m, torch.tensor(tok.encode(TEXT)[:64]).view(4, 16))[1]     # layer 1
    calibrated, raw = hybrids.Attention('lln', 16, 2), hybrids.Attention('lln', 16, 2)
    calibrated.fmap.calibrate(q, k)
    w_t = attention.softmax_weights(q, k)
    kl = {name: attention.kl_divergence(w_t, c.weights(q, k)).mean().item()
          for name, c in (('calibrated', calibrated), ('raw', raw))}
    got = res['summary']['lln (calibrated)']['kl_per_layer'][1]
    assert got == pytest.approx(kl['calibrated'], rel=1e-4) and abs(got - kl['raw']) > 1e-3 * kl['raw'], (got, kl)


def test_fidelity_of_a_nope_map_on_a_rope_model(tmp_path):
    """Issue 52: --maps elu:nope=1 on a Llama (RoPE) model runs (it said the model had no RoPE), and its KL is elu's
    on q, k with RoPE undone by hand."""
    from test_attention import _rope
    torch.manual_seed(0)
    cfg = M.GPTConfig(family='llama', vocab_size=_vocab(), block_size=64, n_layer=2, n_head=2, n_kv_head=1, n_embd=32,
                      bias=False, intermediate_size=64)
    m = M.GPT(cfg).eval()
    res, _ = _fidelity_of(tmp_path, m, ['--maps', 'elu:nope=1,elu', '--batch_size', '2'])
    tok = train.get_tokenizer(verbose=False)
    q, k = ev.capture_qk(m, torch.tensor(tok.encode(TEXT)[:32]).view(2, 16))[1]     # layer 1, windows from 0
    inv_freq = M.rope_inv_freq(cfg.head_dim, cfg.rope_theta)
    plain = hybrids.Attention('elu', cfg.head_dim, 2)
    w = plain.weights(_rope(q, 0, -inv_freq), _rope(k, 0, -inv_freq))
    want = attention.kl_divergence(attention.softmax_weights(q, k), w).mean().item()
    s = res['summary']
    assert s['elu:nope=1 (untrained)']['kl_per_layer'][1] == pytest.approx(want, rel=1e-4)
    assert abs(s['elu (untrained)']['kl_per_layer'][1] - want) > 1e-2 * want


def test_fidelity_bert_windows_are_framed(tmp_path):
    """A BERT's fidelity windows are [CLS] text [SEP] (the tokenizer's single-sentence input), each of --context."""
    tok = tokenizer.load_tokenizer('bytes')
    frame = tok.encode_pair('', None, 8)[0]
    ids = tok.encode(TEXT)
    w = ev.fidelity_windows(tok, ids, 16, 3, bert=True)
    assert w.shape == (3, 16)
    assert w[:, 0].tolist() == [frame[0]] * 3 and w[:, -1].tolist() == [frame[-1]] * 3
    assert w[1, 1:-1].tolist() == ids[14:28]                   # consecutive text between the frames
    assert ev.fidelity_windows(tok, ids, 16, 3).tolist() == torch.tensor(ids[:48]).view(3, 16).tolist()
    torch.manual_seed(0)
    bert = M.build(M.GPTConfig(family='bert', vocab_size=_vocab(), block_size=32, n_layer=2, n_head=2, n_embd=32,
                             attn='hedgehog')).eval()
    res, _ = _fidelity_of(tmp_path, bert, ['--maps', 'elu', '--batch_size', '2'])
    assert res['samples'] == 2 and res['context'] == 16
    assert res['maps'] == ['softmax', 'hedgehog (model)', 'elu (untrained)']


# ---- bench ------------------------------------------------------------------------------------------------

def test_bench_runs_tiny(tmp_path):
    out = str(tmp_path / 'out')
    assert _run(['--bench', 'all', '--maps', 'elu', '--sweep', '16,32', '--device', 'cpu', '--out_dir', out]) == 0
    res = _json(out, 'bench')
    assert {(r['T'], r['attn']) for r in res['attention']} == {(16, 'softmax'), (32, 'softmax'), (16, 'elu'), (32, 'elu')}
    assert all(r['ms'] > 0 for r in res['attention'] + res['prefill'])
    dec = {(r['attn'], r['length']): r for r in res['decode']}
    # exact state sizes: the KV cache grows with the length, the linear state does not
    assert dec[('softmax', 32)]['state_mb'] > dec[('softmax', 16)]['state_mb']
    assert dec[('elu', 32)]['state_mb'] == dec[('elu', 16)]['state_mb'] > 0
    assert os.path.exists(os.path.join(out, 'bench.md'))
    assert '| T |' in open(os.path.join(out, 'bench.md')).read()


def test_bench_decode_on_a_checkpoint(tmp_path):
    """--bench decode --ckpt: the checkpoint's own attention against its softmax teacher (KV cache), both states
    built by prefill; the teacher mode is switched off again afterwards."""
    _, ckpt = _tiny_gpt(tmp_path, attn='hedgehog:window=4', block_size=128)
    out = str(tmp_path / 'out')
    assert _run(['--bench', 'decode', '--ckpt', ckpt, '--sweep', '8,40', '--device', 'cpu', '--out_dir', out]) == 0
    res = _json(out, 'bench')
    dec = {(r['attn'], r['length']): r for r in res['decode']}
    assert set(dec) == {('softmax', 8), ('softmax', 40), ('hedgehog:window=4', 8), ('hedgehog:window=4', 40)}
    assert dec[('softmax', 40)]['state_mb'] > dec[('softmax', 8)]['state_mb']
    assert dec[('hedgehog:window=4', 40)]['state_mb'] == dec[('hedgehog:window=4', 8)]['state_mb']
    assert tmp_path.joinpath('out', 'bench.md').exists()
    assert _run(['--bench', 'decode', '--ckpt', ckpt, '--sweep', '8', '--no_teacher', '--out_dir', out]) == 0
    assert [r['attn'] for r in _json(out, 'bench')['decode']] == ['hedgehog:window=4']   # the model alone


def test_peak_memory_of_an_allocation():
    """peak_memory_mb: a 64 MiB tensor made and freed inside fn shows as about 64 MB at the peak (CPU: VmHWM)."""
    mb = ev.peak_memory_mb(lambda: torch.ones(16, 2**20).sum(), 'cpu')
    if mb is None:
        pytest.skip('no /proc/self/clear_refs here')
    assert 60 <= mb <= 100, mb
    assert ev.peak_memory_mb(lambda: None, 'cpu') < 8


def test_generate_next_to_teacher(tmp_path):
    """--generate on a convert.py folder: the converted model's and the softmax base's greedy continuations."""
    import convert
    _, ckpt = _tiny_gpt(tmp_path)
    out_conv = str(tmp_path / 'conv')
    assert convert.main(['--init_from', ckpt, '--data', _text_file(tmp_path), '--attn', 'elu', '--block_size', '32',
                         '--batch_size', '2', '--eval_batches', '1', '--stage1_iters', '0', '--stage2_iters', '0',
                         '--out_dir', out_conv]) == 0
    out = str(tmp_path / 'out')
    assert _run(['--generate', '--ckpt', out_conv, '--prompt', 'First Citizen:', '--prompt', 'All:',
                 '--max_new_tokens', '5', '--out_dir', out]) == 0
    res = _json(out, 'generate')
    assert res['models'] == ['elu', 'softmax teacher'] and len(res['samples']) == 2
    teacher, _ = ev.load_model(ckpt)
    ids = torch.tensor([list(b'All:')])
    want = teacher.generate(ids, 5, temperature=0.0)[0, 4:].tolist()
    assert res['samples'][1]['softmax teacher']['text'] == bytes(want).decode('utf-8', errors='replace')
    assert res['samples'][0]['elu']['tokens'] == 5


def test_generate_from_an_empty_prompt(tmp_path, capsys, monkeypatch):
    """Issue 61: --generate --prompt '' (a traceback on the embedding's dtype, for the softmax
    teacher too): an empty prompt starts after the end-of-text token, as lm-eval's empty context;
    both models continue it as generate does from that token. A tokenizer without one: refused in
    one line."""
    import convert
    _, ckpt = _tiny_gpt(tmp_path)
    conv = str(tmp_path / 'conv')
    assert convert.main(['--init_from', ckpt, '--data', _text_file(tmp_path), '--attn', 'hedgehog',
                         '--block_size', '32', '--batch_size', '2', '--eval_batches', '1',
                         '--stage1_iters', '0', '--stage2_iters', '0', '--out_dir', conv]) == 0
    out = str(tmp_path / 'out')
    argv = ['--generate', '--ckpt', conv, '--prompt', '', '--max_new_tokens', '4', '--out_dir', out]
    assert _run(argv) == 0
    row = _json(out, 'generate')['samples'][0]
    for name, path in (('hedgehog', conv), ('softmax teacher', ckpt)):
        m = ev.load_model(path)[0]
        want = m.generate(torch.tensor([[256]]), 4, temperature=0.0, eos_token_id=256)[0, 1:]
        want = bytes(t for t in want.tolist() if t < 256).decode('utf-8', 'replace')
        assert row[name]['text'] == want
    monkeypatch.setattr(tokenizer.ByteTokenizer, 'eos_id', None)
    capsys.readouterr()
    assert _run(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "an empty prompt starts after the end-of-text token" in err[0], err


# ---- command line -----------------------------------------------------------------------------------------

@pytest.mark.parametrize('argv,needle', [
    (['--bench', 'nope'], 'attention, prefill, decode, all'),
    (['--bench', 'attention', '--sweep', '8,x'], 'comma-separated integers'),
    (['--lln', '--sweep', '0,1'], 'positive numbers'),
    (['--fidelity', '--ckpt', 'x', '--context', '-1'], '--context must be >= 0, got -1'),
    (['--fidelity', '--ckpt', 'x', '--qk', 'nope'], "choose from 'model', 'teacher'"),
    (['--glue', 'nope', '--ckpt', 'x'], 'cola'),
    (['--ppl', '--glue', 'cola'], 'exactly one report'),
    ([], 'exactly one report'),
    (['--fidelity', '--ckpt', 'x', '--maps', 'elu,nope'], 'hedgehog'),
    (['--ppl', '--ckpt', '/no/such/ckpt.pt'], 'cannot load'),
    (['--ppl', '--nope'], 'unrecognized arguments'),
])
def test_bad_input_is_one_line_and_nonzero(argv, needle, capsys):
    try:
        rc = ev.main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    assert rc != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_cli_exit_status():
    r = subprocess.run([sys.executable, os.path.join(ROOT, 'eval.py'), '--bench', 'nope'], capture_output=True,
                       text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and r.stderr.count('\n') == 1 and 'choose from' in r.stderr


def test_a_bug_keeps_its_traceback(monkeypatch, capsys, tmp_path):
    """Issue 27: main() turned every ValueError into one 'error:' line, so a bug (convert.py's l2 loss: 'too many
    values to unpack') read as bad input and lost its traceback. Now only UsageError (and OSError, TokenizerError)
    are one line, exit 2; anything else propagates, in eval.py, train.py and convert.py alike."""
    import convert
    monkeypatch.chdir(tmp_path)
    bug = ValueError('too many values to unpack (expected 3)')
    monkeypatch.setattr(ev, 'lln_fig2', lambda *a, **k: (_ for _ in ()).throw(bug))
    monkeypatch.setattr(train, 'make_associative_recall', lambda *a, **k: (_ for _ in ()).throw(bug))
    monkeypatch.setattr(convert, 'run', lambda *a, **k: (_ for _ in ()).throw(bug))
    for main, argv in ((ev.main, ['--lln']), (train.main, ['--max_iters', '1']), (convert.main, [])):
        with pytest.raises(ValueError, match='too many values'):
            main(argv)
    assert ev.main(['--lln', '--sweep', '1,x']) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["eval.py: error: --sweep wants comma-separated numbers, "
                                                             "got '1,x'"]
