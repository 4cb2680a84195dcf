"""eval.py as a client of lm-evaluation-harness (0.4.x), offline on tiny local tasks, against computations written
here: model(idx) logits and log_softmax, and model.generate."""
import json
import math
from types import SimpleNamespace

import pytest
import torch

import eval as ev
import train
import lm_eval  # noqa: F401 - a test dependency (requirements-dev.txt): missing, the run fails
import model as M
import tokenizer


@pytest.fixture
def tiny(tmp_path):
    torch.manual_seed(0)
    m = M.GPT(M.GPTConfig(family='llama', vocab_size=257, block_size=64, n_layer=2, n_head=2, n_embd=32,
                          attn='hedgehog:window=4')).eval()
    m.tokenizer = tokenizer.load_tokenizer('bytes')
    path = str(tmp_path / 'tiny.pt')
    M.save(path, m)
    return m, m.tokenizer, path


def logprobs(m, ids):
    """log p(ids[t] | ids[:t]) for t >= 1, straight from the logits."""
    with torch.no_grad():
        lp = m(torch.tensor([ids]))[0][0].float().log_softmax(-1)
    return lp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_rolling_scores_every_token_after_eos(tiny):
    m, tok, _ = tiny
    lm = ev.lm_eval_adapter(m, tok, context=64, stride=32)
    short, long = 'the cat sat on the mat', 'a much longer document, ' * 8            # 22 and 200 bytes
    got = lm.loglikelihood_rolling([SimpleNamespace(args=(short,)), SimpleNamespace(args=(long,))])
    want = float(logprobs(m, [tok.eos_id] + tok.encode(short)).sum())          # every byte scored, after EOS
    assert abs(got[0] - want) / abs(want) < 1e-4
    ids, want, done = [tok.eos_id] + tok.encode(long), 0.0, 0   # windows of 64 inputs moved by 32: each target
    for b in range(0, len(ids) - 1, 32):                          # once, with the most context its window has
        e = min(b + 64, len(ids) - 1)                             # targets b+1..e; the new ones: done+1..e
        want += float(logprobs(m, ids[b:e + 1])[-(e - done):].sum())
        done = e
        if e == len(ids) - 1:
            break
    assert abs(got[1] - want) / abs(want) < 1e-4


def test_loglikelihood_and_greedy_flag(tiny):
    m, tok, _ = tiny
    lm = ev.lm_eval_adapter(m, tok, context=64, stride=32, batch_size=2)
    reqs = [('Question: 2+2=', ' 4'), ('The sky is ', 'blue'), ('', 'hello'), ('x' * 80, ' y')]
    got = lm.loglikelihood([SimpleNamespace(args=r) for r in reqs])
    for (ctx, cont), (ll, greedy) in zip(reqs, got):
        n = len(ctx) - len(ctx.rstrip())          # trailing spaces move to the continuation (lm-eval's rule)
        c_ids = tok.encode(ctx[:len(ctx) - n]) if ctx else [tok.eos_id]
        t_ids = tok.encode(ctx[len(ctx) - n:] + cont)
        ids = (c_ids + t_ids)[-65:]               # at most context + 1 tokens
        lp = logprobs(m, ids)[-len(t_ids):]
        assert abs(ll - float(lp.sum())) < 1e-4 * abs(float(lp.sum()))
        with torch.no_grad():
            pred = m(torch.tensor([ids[:-1]]))[0][0, -len(t_ids):].argmax(-1)
        assert greedy == bool((pred == torch.tensor(t_ids)).all())


def test_generate_until_is_model_generate(tiny):
    m, tok, _ = tiny
    lm = ev.lm_eval_adapter(m, tok, context=64, stride=32)
    out = lm.generate_until([SimpleNamespace(args=('Once upon a', {'until': ['\n'], 'max_gen_toks': 12}))])
    ids = torch.tensor([tok.encode('Once upon a')])
    want = tok.decode(m.generate(ids, 12, temperature=0.0, eos_token_id=tok.eos_id)[0, ids.shape[1]:].tolist())
    assert out == [want.split('\n')[0]]


def test_multiple_choice_task_through_the_harness(tiny, tmp_path, monkeypatch):
    """A local multiple-choice task (jsonl + yaml) run by lm-eval offline: its accuracy equals the direct one."""
    monkeypatch.setenv('HF_DATASETS_OFFLINE', '1')
    m, tok, path = tiny
    rows = [{'q': f'Item {i}: the colour is', 'choices': [' red', ' green', ' blue'], 'label': i % 3} for i in range(6)]
    (tmp_path / 'mc.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    (tmp_path / 'mc.yaml').write_text(
        'task: tiny_mc\ndataset_path: json\n'
        f'dataset_kwargs: {{data_files: {{test: {json.dumps(str(tmp_path / "mc.jsonl"))}}}}}\n'
        'test_split: test\noutput_type: multiple_choice\ndoc_to_text: "{{q}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: label\nmetric_list: [{metric: acc, aggregation: mean, higher_is_better: true}]\n')
    out = str(tmp_path / 'out')
    assert ev.main(['--lm_eval', 'tiny_mc', '--lm_eval_include', str(tmp_path), '--ckpt', path, '--out_dir', out]) == 0
    with open(f'{out}/lm_eval.json') as f:
        acc = json.load(f)['results']['tiny_mc']['acc,none']
    right = 0
    for r in rows:
        scores = [float(logprobs(m, tok.encode(r['q']) + tok.encode(c))[-len(tok.encode(c)):].sum())
                  for c in r['choices']]
        right += max(range(3), key=scores.__getitem__) == r['label']
    assert math.isclose(acc, right / len(rows))


def test_passkey_task_is_deterministic_and_sized(tiny, tmp_path):
    _, tok, _ = tiny
    a = ev.passkey_task(str(tmp_path / 'a'), tok, [1000, 2000], samples=2)
    b = ev.passkey_task(str(tmp_path / 'b'), tok, [1000, 2000], samples=2)
    assert a == b and len(a) == 2 * 5 * 2 and len({r['target'] for r in a}) == len(a)
    for r in a:   # lines as Mohtashami & Jaggi's prompt: task, filler, key, filler, question on its own line
        assert r['length'] - 100 < r['tokens'] <= r['length'] and r['target'] in r['input']
        lines = r['input'].split('\n')
        needle = lines.index(f"The pass key is {r['target']}. Remember it. {r['target']} is the pass key.")
        assert lines[-1] == 'What is the pass key? The pass key is' and lines[0].endswith('memorize it.')
        assert all(lines) and len(lines) == 4 + (r['depth'] > 0)
        n_before, n = r['input'].split(lines[needle])[0].count('The grass is green.'), r['input'].count('The grass')
        assert n > 1 and n_before == round((n - 1) * r['depth'] / 100) and lines[needle + 1].startswith('The grass')
        assert needle == 1 + (n_before > 0) and (n_before == 0 or lines[1] == (train.PASSKEY_TEMPLATES['eval'][1] * n_before).strip())
    other = ev.passkey_task(str(tmp_path / 'c'), tok, [1000], samples=1, template='eval2')   # issue 56: other words
    assert all(r['input'].endswith('The magic number is') and r['tokens'] <= 1000 for r in other)
    yaml = (tmp_path / 'a' / 'passkey.yaml').read_text()
    assert 'output_type: generate_until' in yaml and 'exact_match' in yaml
