"""Tests for convert.py: softmax -> linear attention conversion (attention transfer, DoF selection, LoRA,
finetuning, saving and reloading through model.load), on tiny random GPT-2 / Llama (GQA) / BERT HuggingFace
checkpoints written in the test with transformers' save_pretrained."""
import itertools
import json
import math
import os
import random
import re
import subprocess
import sys

import pytest
import torch
import transformers  # a test dependency: missing, it fails the run (never a silent skip)

import attention as A
import hybrids as Hy
import convert as C
import eval as ev
import tokenizer
import model as M
import train

VOCAB = 257  # train.py's byte tokenizer (offline): 256 bytes + end-of-text
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _save_hf(folder, kind):
    torch.manual_seed(0)
    T = transformers
    # a large initializer_range makes q.k large, so the random teacher's attention is peaked (not uniform)
    if kind == 'gpt2':
        cfg = T.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                           initializer_range=0.15, eos_token_id=VOCAB - 1, bos_token_id=VOCAB - 1)
        m = T.GPT2LMHeadModel(cfg)
    elif kind == 'llama':
        cfg = T.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            initializer_range=0.15, eos_token_id=VOCAB - 1, bos_token_id=VOCAB - 1,
                            pad_token_id=0)
        m = T.LlamaForCausalLM(cfg)
    else:
        cfg = T.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=64, initializer_range=0.15)
        m = T.BertModel(cfg)
    m.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope='module')
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp('hf')
    return {k: _save_hf(root / k, k) for k in ('gpt2', 'llama', 'bert')}


@pytest.fixture(scope='module')
def text_file(tmp_path_factory):
    """A small, very regular text (a model can quickly get better at it)."""
    rng = random.Random(0)
    words = 'the cat sat on a mat and the dog ran to the big red house in the sun'.split()
    lines = [' '.join(rng.choice(words) for _ in range(8)) + '.' for _ in range(500)]
    p = tmp_path_factory.mktemp('text') / 'text.txt'
    p.write_text('\n'.join(lines))
    return str(p)


def _args(init_from, data, out_dir, *extra):
    return ['--init_from', init_from, '--data', data, '--out_dir', str(out_dir), '--block_size', '32',
            '--batch_size', '4', '--eval_batches', '2', '--device', 'cpu', *extra]


def _run(argv):
    cfg, _ = C.train.parse_config(C.ConvertConfig, argv)
    return C.run(cfg)


def _saved(out):
    """The tensors a conversion wrote (out/ckpt.pt)."""
    return torch.load(os.path.join(out, 'ckpt.pt'), weights_only=True)


def _logits(model, x):
    with torch.no_grad():
        if model.config.family == 'bert':
            return model.encode(x)
        return model(x)[0]


# ---------------------------------------------------------------------------------------------------
# LoRA

def test_lora_starts_as_identity_and_only_lora_trains(ckpts, text_file, tmp_path):
    model, _ = M.load(ckpts['gpt2'])
    x = torch.randint(0, VOCAB, (2, 16))
    before = _logits(model, x)
    names = model.add_lora(rank=4, alpha=8)
    assert sorted(n.rsplit('.', 1)[-1] for n in names) == sorted(['q_proj', 'k_proj', 'v_proj', 'o_proj'] * 2)
    assert torch.equal(before, _logits(model, x))
    lin = model.transformer.h[0].attn.q_proj
    assert isinstance(lin, M.LoRALinear) and isinstance(lin, torch.nn.Linear)
    z = torch.randn(3, 32)   # y = x W^T + b + (alpha / r) x A^T B^T, by hand
    with torch.no_grad():
        lin.lora_B.normal_()
        torch.testing.assert_close(lin(z), z @ lin.weight.T + lin.bias + 2.0 * z @ lin.lora_A.T @ lin.lora_B.T)
        lin.lora_B.zero_()
    snap = {n: p.detach().clone() for n, p in model.named_parameters()}
    s = _run(_args(ckpts['gpt2'], text_file, tmp_path / 'l', '--attn', 'softmax', '--stage1_iters', '0',
                   '--stage2_iters', '3', '--lora_rank', '4', '--stage2_lr', '1e-2'))
    m = M.load(str(tmp_path / 'l'))[0]
    for n, p in m.named_parameters():
        changed = n not in snap or not torch.equal(p, snap[n])
        assert changed == n.endswith(('lora_A', 'lora_B')), n
    assert s['stages']['stage2']['mode'] == 'lora'


def test_lora_targets_leave_q_and_k_the_teachers(ckpts, text_file, tmp_path):
    """--lora_targets v,o (QK-Restore): q and k get no LoRA; every weight but the LoRA factors is the teacher's."""
    teacher = {n: p.detach().clone() for n, p in M.load(ckpts['llama'])[0].named_parameters()}
    _run(_args(ckpts['llama'], text_file, tmp_path / 'vo', '--attn', 'softmax', '--stage1_iters', '0',
               '--stage2_iters', '3', '--lora_rank', '4', '--stage2_lr', '1e-2', '--lora_targets', 'v,o'))
    m = M.load(str(tmp_path / 'vo'))[0]
    lora = {n.rsplit('.', 2)[-2] for n, _ in m.named_parameters() if n.endswith('lora_B')}
    assert lora == {'v_proj', 'o_proj'} and not isinstance(m.transformer.h[0].attn.q_proj, M.LoRALinear)
    assert all(torch.equal(p, teacher[n]) for n, p in m.named_parameters() if not n.endswith(('lora_A', 'lora_B')))
    assert any(p.abs().sum() > 0 for n, p in m.named_parameters() if n.endswith('lora_B'))   # they trained


def test_lora_bad_target(ckpts):
    model, _ = M.load(ckpts['gpt2'])
    with pytest.raises(A.UsageError, match='match no Linear'):
        model.add_lora(4, 8, targets=['nope_proj'])


def test_lora_on_a_model_with_lora_is_a_clear_error(ckpts, text_file, tmp_path, capsys):
    """Stage 2 from a conversion that has LoRA already: one line naming it, not a traceback."""
    _run(_args(ckpts['gpt2'], text_file, tmp_path / 'a', '--attn', 'hedgehog', '--stage1_iters', '0',
               '--stage2_iters', '1'))
    with pytest.raises(SystemExit) as e:
        C.main(_args(str(tmp_path / 'a'), text_file, tmp_path / 'b', '--attn', 'softmax', '--stage1_iters', '0',
                     '--stage2_iters', '1'))
    assert e.value.code == 2 and 'no Linear module without LoRA' in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# the pipeline on each layout

@pytest.mark.slow
@pytest.mark.parametrize('kind', ['gpt2', 'llama', 'bert'])
def test_convert_each_layout_and_reload(kind, ckpts, text_file, tmp_path):
    out = tmp_path / kind
    extra = ['--stage2_iters', '0'] if kind == 'bert' else ['--stage2_iters', '3']
    s = _run(_args(ckpts[kind], text_file, out, '--attn', 'hedgehog', '--stage1_iters', '3', *extra))
    assert s['family'] == kind
    assert set(s['stages']) == ({'swap', 'stage1'} if kind == 'bert' else {'swap', 'stage1', 'stage2'})
    for f in ('ckpt.pt', 'summary.json'):
        assert (out / f).is_file()
    saved = _saved(out)
    assert saved['base'] == os.path.abspath(ckpts[kind])
    assert all(k.startswith('transformer.h.') for k in saved['model'])  # only what changed
    assert any('.core.fmap.' in k for k in saved['model'])
    assert any(k.endswith('lora_A') for k in saved['model']) == (kind != 'bert')
    # the live model is gone: rebuild from disk twice, strictly, and compare with the base
    m1, m2 = M.load(str(out))[0], M.load(str(out))[0]
    x = torch.randint(0, VOCAB, (2, 24))
    assert torch.equal(_logits(m1, x), _logits(m2, x))
    assert all(c.spec.name == 'hedgehog' for c in m1.attention_cores())
    base, _ = M.load(ckpts[kind])
    assert not torch.allclose(_logits(base, x), _logits(m1, x))


@pytest.mark.slow
def test_stage1_lowers_fidelity_loss_and_stage2_lowers_ppl(ckpts, text_file, tmp_path):
    s = _run(_args(ckpts['gpt2'], text_file, tmp_path / 'a', '--attn', 't2r', '--stage1_iters', '25',
                   '--lr', '1e-2', '--stage2_iters', '20', '--stage2_lr', '1e-2', '--lora_rank', '8'))
    st = s['stages']
    assert st['stage1']['kl_mean'] < 0.8 * st['swap']['kl_mean']
    assert st['stage1']['loss_last'] < st['stage1']['loss_first']
    assert st['stage2']['quality']['ppl'] < st['stage1']['quality']['ppl']
    assert st['stage2']['mode'] == 'lora'
    assert s['teacher']['ppl'] > 0 and s['unigram'] > 0
    # the report table reads the summary, recovery included
    table = C.report([str(tmp_path / 'a')])
    row = next(r for r in table.splitlines() if r.startswith('| a | t2r |'))
    assert row.count('|') == 13 and ' - |' not in row.split('|')[11]


@pytest.mark.slow
def test_full_finetune_window_hybrid_and_mse(ckpts, text_file, tmp_path):
    out = tmp_path / 'w'
    s = _run(_args(ckpts['llama'], text_file, out, '--attn', 'lolcats:window=8', '--stage1_iters', '20',
                   '--stage2_iters', '15', '--lora_rank', '0', '--stage2_lr', '3e-3', '--layers', '1'))
    assert s['loss_weights'] == {'mse': 1.0}  # LoLCATs: output MSE
    st = s['stages']
    assert st['stage1']['loss_last'] < st['stage1']['loss_first']
    assert st['stage2']['quality']['ppl'] < st['stage1']['quality']['ppl']
    m = M.load(str(out))[0]
    cores = m.attention_cores()
    assert cores[0].spec.name == 'softmax' and cores[1].spec.name == 'lolcats' and cores[1].spec.window == 8
    assert 'transformer.wte.weight' in _saved(out)['model']  # full finetune saves every weight


def test_window_mix_is_calibrated_saved_and_reloaded(ckpts, text_file, tmp_path):
    """combine=mix: s starts at the teacher's window mass (not 1/2), and the converted folder reloads with the
    mix form and its trained factors; map options in --attn reach the map."""
    out = tmp_path / 'mix'
    s = _run(_args(ckpts['llama'], text_file, out, '--attn', 'lolcats:activation=elu:window=8:combine=mix',
                   '--stage1_iters', '3', '--stage2_iters', '0'))
    assert s['attn'] == str(A.AttnSpec.parse('lolcats:window=8:combine=mix:activation=elu'))
    m = M.load(str(out))[0]
    cores = m.attention_cores()
    assert all(c.spec.combine == 'mix' and c.fmap.activation == 'elu' for c in cores)
    assert all((c.factor() - 0.5).abs().max() > 1e-3 for c in cores)  # calibrated, then trained
    base, _ = M.load(ckpts['llama'])
    base.set_attention('lolcats:activation=elu:window=8:combine=mix')
    base.load_state_dict(m.state_dict())
    x = torch.randint(0, VOCAB, (2, 24))
    torch.testing.assert_close(_logits(base, x), _logits(m, x))
    assert '| mix | ' + s['attn'] + ' |' in C.report([str(out)])
    assert A.WINDOW_COMBINES == ('joint', 'mix')


def test_output_mse_never_forms_the_attention_matrix(ckpts, monkeypatch):
    """The LoLCATs loss goes through the core's chunked linear path (no T x T student weights)."""
    model, _ = M.load(ckpts['gpt2'])
    model.set_attention('hedgehog')
    x = torch.randint(0, VOCAB, (1, 64))
    with torch.no_grad(), model.capture_qkv(teacher=True) as rec:
        model(x)
    called = []
    monkeypatch.setattr(A, 'linear_attention_weights', lambda *a, **k: called.append(1))
    core = model.attention_cores()[1]
    monkeypatch.setattr(core, 'weights', lambda *a, **k: called.append(1))
    loss = C.transfer_loss(core, *rec[1], {'mse': 1.0})
    assert loss.requires_grad and not called


def test_teacher_forcing_captures_exact_softmax(ckpts):
    model, _ = M.load(ckpts['llama'])
    x = torch.randint(0, VOCAB, (2, 16))
    ref = _logits(model, x)
    model.set_attention('elu')
    with torch.no_grad(), model.capture_qkv(teacher=True) as rec:
        out = _logits(model, x)
    assert torch.allclose(out, ref, atol=1e-5)  # the residual stream is the teacher's
    q, k, v, mask = rec[0]
    assert q.shape == k.shape == v.shape == (2, 4, 16, 8) and mask is None  # GQA keys repeated to 4 heads
    assert all(c.mode == 'linear' for c in model.attention_cores())  # the students are back
    assert not torch.allclose(_logits(model, x), ref)


@pytest.mark.slow
def test_dof_selection_in_the_pipeline(ckpts, text_file, tmp_path, capsys):
    s = _run(_args(ckpts['gpt2'], text_file, tmp_path / 'd', '--attn', 'dof', '--dof_budget', '6',
                   '--dof_samples', '32', '--stage1_iters', '2', '--stage2_iters', '0'))
    assert 'DoF feature-dimension selection' in capsys.readouterr().out
    dims = [s['feature_dims'][l] for l in range(2)]
    assert sum(dims) / 2 == 6
    assert [r['feature_dim'] for r in s['dof_table']] == dims
    m = M.load(str(tmp_path / 'd'))[0]
    assert [c.fmap.feature_dim for c in m.attention_cores()] == dims
    # the hedgehog extension allocates even widths (F = 2 x MLP outputs), mean F == budget
    s = _run(_args(ckpts['gpt2'], text_file, tmp_path / 'h', '--attn', 'hedgehog', '--dof_budget', '12',
                   '--dof_samples', '32', '--stage1_iters', '0', '--stage2_iters', '0'))
    dims = [s['feature_dims'][l] for l in range(2)]
    assert sum(dims) / 2 == 12 and all(d % 2 == 0 for d in dims)
    # DoF + Clip (paper Sec. 4.2) at head_dim 8 (hedgehog: F at 16), no redistribution; summary.json records it
    s = _run(_args(ckpts['gpt2'], text_file, tmp_path / 'c', '--attn', 'hedgehog', '--dof_budget', '20',
                   '--dof_samples', '32', '--dof_clip', '--stage1_iters', '0', '--stage2_iters', '0'))
    dims = [s['feature_dims'][l] for l in range(2)]
    assert sum(r['unclipped'] for r in s['dof_table']) == 40 and dims == [16, 16]  # mean cost 16 < 20
    assert [r['feature_dim'] for r in s['dof_table']] == dims
    c = s['config']
    assert (c['dof_lambda'], c['dof_samples'], c['dof_budget'], c['dof_clip']) == (2 ** -4, 32, 20, True)


@pytest.mark.slow
def _glue_files(folder):
    rng = random.Random(0)
    good = ['the cat sat on the mat', 'a dog ran home', 'the sun is big', 'we like red houses']
    bad = ['cat the mat on sat', 'ran dog home a', 'big is sun the', 'houses red like we']
    for split, n in (('train', 60), ('dev', 16)):
        rows = [f'{rng.choice(good)}\t1' if i % 2 else f'{rng.choice(bad)}\t0' for i in range(n)]
        (folder / f'{split}.tsv').write_text('\n'.join(rows) + '\n')


def test_glue_calibration_is_per_sentence(ckpts, tmp_path, monkeypatch):
    """Issue 27: GLUE calibration joined four batches of sentences into one bidirectional sequence (an N x N matrix,
    3 GB at 12 heads and 8K tokens); now each sentence is its own sequence, padded to the batch's longest."""
    _glue_files(tmp_path)
    shapes, weights = [], A.softmax_weights
    monkeypatch.setattr(A, 'softmax_weights', lambda q, k, *a, **kw: shapes.append(q.shape) or weights(q, k, *a, **kw))
    _run(['--init_from', ckpts['bert'], '--data', str(tmp_path), '--task', 'glue', '--attn', 'lln:window=3:combine=mix',
          '--out_dir', str(tmp_path / 'o'), '--stage1_iters', '0', '--stage2_iters', '0', '--batch_size', '8',
          '--block_size', '32', '--device', 'cpu'])
    calibration = [s for s in shapes if s[0] == 1]   # (the fidelity report's batches of 8 aside)
    assert len(calibration) == 4 * 8 * 2 and all(s[2] <= 32 for s in calibration)   # 2 layers, 32 sentences
    assert len(shapes) == len(calibration) + 2 * 2 and all(s[0] == 8 for s in shapes if s[0] != 1)


def test_glue_classifier_conversion(ckpts, tmp_path):
    _glue_files(tmp_path)
    out = tmp_path / 'glue'
    s = _run(['--init_from', ckpts['bert'], '--data', str(tmp_path), '--task', 'glue', '--glue_task', 'cola',
              '--attn', 'hedgehog', '--out_dir', str(out), '--stage1_iters', '2', '--stage2_iters', '8',
              '--stage2_lr', '3e-3', '--batch_size', '8', '--eval_batches', '2', '--block_size', '32',
              '--device', 'cpu'])
    q = s['stages']['stage2']['quality']
    assert 'dev_mcc' in q and 'dev_accuracy' in q and 'dev_loss' in q
    assert s['teacher'] is not None and 'dev_mcc' in s['teacher']
    m = M.load(str(out))[0]
    assert m.config.num_labels == 2
    x = torch.randint(0, VOCAB, (2, 10))
    logits, _ = m.classify(x, attention_mask=torch.ones_like(x))
    assert logits.shape == (2, 2)
    # the new classifier head is saved with the adapters: two rebuilds are the same function
    again, _ = M.load(str(out))[0].classify(x, attention_mask=torch.ones_like(x))
    assert torch.equal(logits, again)
    assert 'classifier.weight' in _saved(out)['model']


# ---------------------------------------------------------------------------------------------------
# saving / strict reloading / bad input

def test_strict_reload_rejects_tampered_files(ckpts, text_file, tmp_path):
    out = tmp_path / 'o'
    _run(_args(ckpts['gpt2'], text_file, out, '--attn', 'performer', '--stage1_iters', '0',
               '--stage2_iters', '1'))
    m = M.load(str(out))[0]
    x = torch.randint(0, VOCAB, (1, 12))
    # the random features (a buffer) are saved too: a rebuilt model is the same function
    assert torch.equal(_logits(m, x), _logits(M.load(str(out))[0], x))
    saved = _saved(out)
    lora_key = next(k for k in saved['model'] if k.endswith('lora_A'))
    del saved['model'][lora_key]
    torch.save(saved, out / 'ckpt.pt')
    with pytest.raises(ValueError, match='missing'):
        M.load(str(out))
    with pytest.raises(FileNotFoundError, match='ckpt.pt'):
        M.load(str(tmp_path))


@pytest.mark.parametrize('extra,message', [
    (['--init_from', '/nonexistent/ckpt.pt'], 'no such checkpoint'),
    (['--layers', '0,7'], 'unknown layer index 7'),
    (['--attn', 'nosuchmap'], "unknown attention 'nosuchmap'"),
    (['--attn', 'hedgehog:feature_dim=7'], 'feature_dim'),
    (['--attn', 'elu', '--dof_budget', '8'], '--dof_budget is for'),
    (['--attn', 'dof', '--dof_clip'], '--dof_clip needs --dof_budget'),
    (['--attn', 'dof', '--dof_budget', '8', '--dof_lambda', '0'], '--dof_lambda must be > 0'),
    (['--loss', 'kl'], "bad --loss part 'kl'"),
    (['--fsdp'], "--fsdp shards a --task lm conversion with LoRA (--lora_rank > 0) over torchrun's processes"),
])
def test_bad_input_is_a_clear_error(extra, message, ckpts, text_file, tmp_path, capsys):
    argv = _args(ckpts['gpt2'], text_file, tmp_path / 'x', '--stage1_iters', '0', '--stage2_iters', '0') + extra
    with pytest.raises(SystemExit) as e:
        C.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert 'error:' in err and message in err


def test_bert_needs_a_task_for_stage2(ckpts, text_file, tmp_path, capsys):
    with pytest.raises(SystemExit):
        C.main(_args(ckpts['bert'], text_file, tmp_path / 'b', '--stage2_iters', '5'))
    assert 'use --task glue' in capsys.readouterr().err


def test_help_lists_the_stable_flags(capsys):
    with pytest.raises(SystemExit):
        C.main(['--help'])
    out = capsys.readouterr().out
    for flag in ('--init_from', '--attn', '--data', '--out_dir', '--stage1_iters', '--stage2_iters',
                 '--lora_rank', '--dof_budget', '--layers', '--loss'):
        assert flag in out


def test_softmax_control_run_only_finetunes(ckpts, text_file, tmp_path):
    out = tmp_path / 'ctl'
    s = _run(_args(ckpts['gpt2'], text_file, out, '--attn', 'softmax', '--stage1_iters', '5',
                   '--stage2_iters', '2'))
    assert s['stages']['swap']['kl_mean'] == pytest.approx(0.0, abs=1e-6)
    assert s['stages']['swap']['quality']['ppl'] == pytest.approx(s['teacher']['ppl'])
    m = M.load(str(out))[0]
    assert all(c.spec.name == 'softmax' for c in m.attention_cores())
    assert all(k.endswith(('lora_A', 'lora_B')) for k in _saved(out)['model'])


def test_stage2_alone_on_a_stage1_checkpoint(ckpts, text_file, tmp_path):
    """Stage 1 alone, then --init_from it with --attn softmax and --stage1_iters 0 keeps the converted layers (their
    maps unchanged) and trains only the LoRA factors."""
    _run(_args(ckpts['llama'], text_file, tmp_path / 's1', '--attn', 'hedgehog', '--stage1_iters', '2',
               '--stage2_iters', '0'))
    s = _run(_args(str(tmp_path / 's1'), text_file, tmp_path / 's2', '--attn', 'softmax', '--stage1_iters', '0',
                   '--stage2_iters', '2', '--stage2_lr', '1e-2'))
    assert s['stages']['stage2']['mode'] == 'lora'
    first, second = M.load(str(tmp_path / 's1'))[0], M.load(str(tmp_path / 's2'))[0]
    assert [str(c.spec) for c in second.attention_cores()] == ['hedgehog'] * 2
    a, b = first.state_dict(), second.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a if '.core.' in k)   # the trained maps, as stage 1 left them
    assert any(not torch.equal(b[k], 0 * b[k]) for k in b if k.endswith('lora_B'))


def test_parameter_free_map_saves_no_tensors(ckpts, text_file, tmp_path):
    out = tmp_path / 'elu'
    _run(_args(ckpts['llama'], text_file, out, '--attn', 'elu', '--stage1_iters', '5', '--stage2_iters', '0'))
    assert _saved(out)['model'] == {}
    m = M.load(str(out))[0]
    assert all(c.spec.name == 'elu' for c in m.attention_cores())


@pytest.mark.slow
@pytest.mark.parametrize('name', ['hedgehog', 'lolcats', 'dof'])
def test_every_stage1_loss_runs_and_lowers_itself(name, ckpts, text_file, tmp_path):
    """The three papers' transfer losses (Hedgehog's ce, LoLCATs' mse, DoF's l2) and a weighted sum, end to end; l2
    only where the map estimates exp(q.k/sqrt d) (issue 35: refused for the others, in one line)."""
    for loss in ('ce', 'mse', 'l2', 'ce+0.5*mse+0.1*l2'):
        if 'l2' in loss and name not in C.KERNEL_MAPS:
            with pytest.raises(SystemExit) as e:
                C.main(_args(ckpts['gpt2'], text_file, tmp_path / loss, '--attn', name, '--loss', loss))
            assert e.value.code == 2
            continue
        s = _run(_args(ckpts['gpt2'], text_file, tmp_path / loss, '--attn', name, '--loss', loss, '--stage1_iters',
                       '12', '--stage2_iters', '0', '--lr', '1e-2'))
        st = s['stages']['stage1']
        assert s['loss_weights'] == C.loss_weights(loss, A.AttnSpec(name))
        assert st['loss_last'] < st['loss_first'], (name, loss, st['loss_first'], st['loss_last'])


@pytest.mark.parametrize('nope', [0, 1])
def test_l2_loss_is_dofs_kernel_loss_in_float64(nope):
    """DoF's kernel L2 on a hand-sized case, against float64 written from DoF Eq. 8: phi(x)_m = sqrt(a_m / M)
    exp(z_m.x / D^1/4 - |x|^2 / (2 sqrt D)), unnormalised phi(q).phi(k) against exp(q.k / sqrt D), causal pairs.
    The keys are large, so the features carry shifts that the loss must undo. With nope=1 the teacher's q, k are
    rotated by RoPE (at positions 0-2, written out here) and the maps must see them unrotated."""
    torch.manual_seed(0)
    D, M_ = 4, 3
    inv_freq = torch.tensor([1.0, 0.01])
    core = Hy.Attention(f'dof:feature_dim=3:nope={nope}', D, 1, rope_inv_freq=inv_freq)
    with torch.no_grad():
        core.fmap.z.copy_(torch.tensor([[[1., 0, 0, 0], [0, 1, 0, 0], [.5, .5, -.5, .5]]]))
        core.fmap.log_a.copy_(torch.tensor([[0.2, -0.3, 0.1]]))
    q = torch.tensor([[[[0.5, -1., 0., 1.], [1., 1., 0., 0.], [0., 0.5, 0.5, 0.]]]])
    k = torch.tensor([[[[3., 1., 0., 2.], [-2., 0., 1., 1.], [4., 4., -1., 0.]]]])
    angle = torch.arange(3.0)[:, None] * inv_freq * nope   # (T, D/2): RoPE's, (x_i, x_(i + D/2)) turned

    def rope(x):
        x1, x2 = x.double().chunk(2, -1)
        return torch.cat((x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()), -1)
    qr, kr = rope(q), rope(k)   # what the teacher's layer computes with
    loss = C.transfer_loss(core, qr.float(), kr.float(), torch.randn(1, 1, 3, D), None, {"l2": 1.0}).detach()
    z, a = core.fmap.z.detach()[0].double(), core.fmap.log_a.detach()[0].double().exp()

    def phi(x):   # (T, D) -> (T, M)
        return (a / M_).sqrt() * torch.exp(x @ z.T / D ** 0.25 - (x * x).sum(-1, keepdim=True) / (2 * D ** 0.5))
    qd, kd = q[0, 0].double(), k[0, 0].double()
    err = (phi(qd) @ phi(kd).T - torch.exp(qr[0, 0] @ kr[0, 0].T / D ** 0.5)) ** 2
    ref = err[torch.tril(torch.ones(3, 3, dtype=torch.bool))].mean()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)


def test_l2_refused_for_a_map_that_does_not_estimate_the_kernel(capsys):
    """Issue 35: lolcats:activation=exp with mse+0.01*l2 raised the KL where mse alone lowered it (the kernel's scale
    is arbitrary for a map that does not estimate exp(q.k/sqrt d)): one line naming the maps l2 fits, exit 2."""
    with pytest.raises(SystemExit) as e:
        C.main(['--attn', 'lolcats:activation=exp', '--loss', 'mse+0.01*l2'])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and 'dof, performer, taylor' in err and 'lolcats' in err
    assert C.loss_weights('l2', A.AttnSpec('dof')) == {'l2': 1.0}


def test_retrieval_scores_against_the_weights_by_hand(ckpts):
    """Issue 36: the probe's score of each KV head, recomputed from the teacher's q and k with the full causal
    softmax matrix in float64: the mass on the key's tokens, over the answer rows, query heads and prompts."""
    model, _ = M.load(ckpts['llama'])   # 4 query heads, 2 KV heads
    tok = train.get_tokenizer('', model, verbose=False)
    got = C.retrieval_scores(model, tok, 'cpu', length=120, samples=2)
    want = torch.zeros_like(got)
    for p in train.passkey_prompts(tok, [120], depths=(50,), samples=2, seed=1, template='probe'):
        text, n = p['input'] + ' ' + p['target'], len(tok.encode(p['input']))
        ids = tok.encode(text)[:-1]
        keys = [t for a, b in p['keys'] for t in range(len(tok.encode(text[:a])), len(tok.encode(text[:b])))]
        assert tok.decode([tok.encode(text)[t] for t in keys[:5]]) == p['target']   # the key's tokens (bytes)
        with torch.no_grad(), model.capture_qkv(teacher=True) as rec:
            model(torch.tensor([ids]))
        for l, (q, k, _, _) in rec.items():
            s = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.shape[-1])
            w = torch.softmax(s.masked_fill(~torch.ones(len(ids), len(ids), dtype=torch.bool).tril(), -math.inf), -1)
            want[l] += w[0, :, n - 1:][..., keys].sum(-1).mean(-1).view(2, 2).mean(-1) / 2
    assert torch.allclose(got, want, atol=1e-5) and (got > 0).all()
    assert C.exact_heads(got, 3) == {l: sorted(h) for l, h in _top(got, 3).items()}
    rand = C.exact_heads(got, 3, 'random', seed=5)
    assert sum(map(len, rand.values())) == 3 and rand == C.exact_heads(got, 3, 'random', seed=5)


def test_probe_finds_the_keys_tokens_with_a_gpt2_style_tokenizer():
    """Issue 41, 4a: a tokenizer that joins the space before the digits to them (GPT-2's ' 12345'): the key's tokens
    are ' 1', '2', .. '5'; counting the tokens of the text before the key (which ends in a lone ' ') started one
    late, at '2' (the probe then scored part of the key); train.token_span finds all of them."""
    import tiktoken
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({b' ' + bytes([b]): 256 + i for i, b in enumerate(b'0123456789')})   # ' 1' .. ' 9': one token each
    tok = tokenizer.TiktokenTokenizer(tiktoken.Encoding('spaced', pat_str=tokenizer.PRE_TOKENIZERS['gpt2'],
                                                        mergeable_ranks=ranks,
                                                        special_tokens={'<|endoftext|>': 266}))
    for p in train.passkey_prompts(tok, [200], depths=(0, 50, 100), samples=2, template='probe'):
        text = p['input'] + ' ' + p['target']
        ids = tok.encode(text)
        for a, b in p['keys'] + [(len(p['input']) + 1, len(text))]:   # both mentions and the answer
            i, j = train.token_span(tok, text, a, b)
            assert tok.decode(ids[i:j]) == ' ' + text[a:b]   # every digit, and the space joined to the first
            assert len(tok.encode(text[:a])) == i + 1        # the old count: one late


def test_each_passkey_template_has_words_of_its_own():
    """Issue 41, 4b; issue 56: the probe's prompts, stage 2's retrieval samples ('train') and the two evaluations'
    share no sentence (heads were chosen on the test's own template, with other keys)."""
    tok = tokenizer.ByteTokenizer()
    text = {t: train.passkey_prompts(tok, [300], depths=(50,), samples=1, seed=1, template=t)[0]['input']
            for t in train.PASSKEY_TEMPLATES}
    sentences = lambda text: {s.strip() for line in text.splitlines() for s in line.split('. ') if s.strip()}  # noqa
    assert len(text) == 4 and all(not sentences(text[a]) & sentences(text[b]) for a, b in itertools.combinations(text, 2))


def test_passkey_batch_scores_the_answer_alone(tmp_path):
    """Issue 56: stage 2's retrieval samples (--passkey_mix) within --block_size (RESULTS 21.6: as long as it allows,
    filler in whole lines), 'train' wording, right-padded; the
    loss is the mean negative log-likelihood of the answer's tokens (' ' and the key's 5 digits, bytes here) alone,
    recomputed by hand from the logits in float64."""
    torch.manual_seed(0)
    m = M.GPT(M.GPTConfig(family='llama', vocab_size=VOCAB, block_size=512, n_layer=2, n_head=4, n_kv_head=2, n_embd=32))
    tok, gen = tokenizer.ByteTokenizer(), torch.Generator().manual_seed(3)
    x, y = C.passkey_batch(tok, gen, 400, 3)
    assert x.shape == y.shape and 400 - 80 < x.shape[1] <= 400   # (the old rule: from 100)
    with torch.no_grad():
        logp, loss, want = m(x)[0].double().log_softmax(-1), float(train.task_loss(m, (x, y))), []
    for b in range(3):
        text = bytes(t for t in x[b].tolist() if t).decode()   # (padded with 0)
        key = re.search(r'The access code is (\d{5})\. Note it down', text).group(1)
        end = len(text.encode())   # rows end - 6 .. end - 1 predict the answer (its last token is no input)
        assert text.endswith('What is the access code? The access code is' + (' ' + key)[:-1]), text[-60:]
        assert y[b, end - 6:end].tolist() == list((' ' + key).encode())
        assert (y[b, :end - 6] == -100).all() and (y[b, end:] == -100).all()
        want += [-logp[b, t, y[b, t]] for t in range(end - 6, end)]
    assert math.isclose(loss, float(sum(want) / len(want)), rel_tol=1e-5)


def test_passkey_mix_draws_retrieval_batches_at_its_rate(tmp_path, text_file, monkeypatch):
    """Issue 56: with --passkey_mix 0.25 a quarter of stage 2's batches are retrieval samples (the rest the text's),
    within --block_size (issue 60: --passkey_block's, block - 8 tokens or a line less), and a run with it trains and
    reloads."""
    torch.manual_seed(0)
    m = M.GPT(M.GPTConfig(family='llama', vocab_size=VOCAB, block_size=512, n_layer=1, n_head=2, n_kv_head=1, n_embd=16))
    m.tokenizer = tokenizer.load_tokenizer('bytes')
    M.save(tmp_path / 'tiny.pt', m)
    fit, drawn = train.fit, []

    def spy(module, params, loss_fn, next_batch, *a, **k):   # 400 draws of stage 2's batches, then the real fit
        g = torch.Generator().manual_seed(0)
        drawn.extend(next_batch(g) for _ in range(400))
        assert module.grad_ckpt   # --grad_ckpt reaches the model stage 2 trains
        return fit(module, params, loss_fn, next_batch, *a, **k)
    monkeypatch.setattr(train, 'fit', spy)
    _run(_args(str(tmp_path / 'tiny.pt'), text_file, tmp_path / 'pk', '--block_size', '256', '--attn', 'softmax',
               '--stage1_iters', '0', '--stage2_iters', '2', '--passkey_mix', '0.25',
               '--passkey_block', '480', '--grad_ckpt'))   # (issue 60: samples longer than the text's)
    share = sum(bool((y == -100).any()) for _, y in drawn) / len(drawn)
    sizes = [x.shape[1] for x, y in drawn if (y == -100).any()]
    assert 0.18 < share < 0.32 and all(x.shape[1] <= 256 for x, y in drawn if not (y == -100).any())
    assert all(480 - 80 < s <= 480 for s in sizes)
    assert M.load(str(tmp_path / 'pk'))[0] is not None


def test_passkey_mix_refused_before_any_work_where_no_sample_fits(tmp_path, text_file, monkeypatch):
    """Issue 61: --passkey_mix with a --block_size no retrieval sample fits (the shortest: 175 byte
    tokens; the default block is 128) is refused in one line before any work (the swap,
    calibration and stage 1 ran, then stage 2 stopped), naming the smallest useful block: there the
    longest samples have filler before and after the key, a block smaller they do not."""
    m = M.GPT(M.GPTConfig(family='llama', vocab_size=VOCAB, block_size=512, n_layer=1, n_head=2,
                          n_kv_head=1, n_embd=16))
    m.tokenizer = tokenizer.load_tokenizer('bytes')
    M.save(tmp_path / 'tiny.pt', m)
    monkeypatch.setattr(C, 'evaluate', lambda *a, **k: pytest.fail('work before the refusal'))
    want = (r"^--passkey_mix: a retrieval sample takes at least 175 tokens, over its block of 128 "
            r"\(--passkey_block, else --block_size\); from \d+ its key has filler before and after "
            r"it \(a depth\)$")
    for block in (['--block_size', '128'], ['--block_size', '256', '--passkey_block', '128']):
        with pytest.raises(A.UsageError, match=want) as e:
            _run(_args(str(tmp_path / 'tiny.pt'), text_file, tmp_path / 'pk', *block,
                       '--passkey_mix', '0.25'))
    with pytest.raises(A.UsageError, match=r"^--passkey_block 1024 is more than the teacher's 512"):
        _run(_args(str(tmp_path / 'tiny.pt'), text_file, tmp_path / 'pk', '--block_size', '128',
                   '--passkey_mix', '0.25', '--passkey_block', '1024'))
    useful, tok = int(re.search(r'from (\d+)', str(e.value)).group(1)), m.tokenizer
    for block, before in ((useful, True), (useful - 1, False)):   # the longest prompts: block - 8
        text = train.passkey_prompts(tok, [block - 8], depths=(100,), template='train')[0]['input']
        at = text.index('The access code is')
        assert ('Ships sail at night' in text[:at]) == before and 'Ships sail at night' in text[at:]
    assert C.passkey_batch(tok, torch.Generator().manual_seed(0), 175, 4)[0].shape[1] <= 175


def _top(scores, n):
    out = {}
    for i in sorted(range(scores.numel()), key=lambda i: -scores.flatten()[i])[:n]:
        out.setdefault(i // scores.shape[1], []).append(i % scores.shape[1])
    return out


def test_convert_with_exact_heads(ckpts, text_file, tmp_path):
    """Issue 36: --exact_heads 2 keeps the probe's two best KV heads exact (per layer in the saved specs), trains the
    rest, saves the scores and the choice; the folder reloads, and decoding equals the full forward pass."""
    out = tmp_path / 'exact'
    s = _run(_args(ckpts['llama'], text_file, out, '--attn', 'hedgehog:window=4', '--exact_heads', '2',
                   '--stage1_iters', '3', '--stage2_iters', '2'))
    chosen = {int(l): h for l, h in s['exact_heads'].items()}
    assert sum(map(len, chosen.values())) == 2 and chosen == C.exact_heads(torch.tensor(s['retrieval_scores']), 2)
    m = M.load(str(out))[0].eval()
    specs = [c.spec for c in m.attention_cores()]
    assert [s.exact for s in specs] == ['+'.join(map(str, chosen.get(l, []))) for l in range(len(specs))]
    x = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        full, (_, st) = m(x)[0], m.prefill(x[:, :5])
        for t in range(5, 12):
            logits, st = m.decode_step(x[:, t], t, st)
            assert torch.allclose(logits, full[:, t], atol=1e-4)


def test_l2_loss_with_exact_heads_is_the_other_heads():
    """Issue 52: --loss l2 with exact heads (dof:exact=0) is the kernel loss of the heads with a map, as a core of
    those heads alone computes it (the map was handed every head: a traceback)."""
    torch.manual_seed(0)
    core = Hy.Attention('dof:feature_dim=3:exact=0', 4, 2)
    rest = Hy.Attention('dof:feature_dim=3', 4, 1)
    rest.load_state_dict(core.state_dict())
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    got = C.transfer_loss(core, q, k, v, None, {'l2': 1.0})
    assert got.item() == pytest.approx(C.transfer_loss(rest, q[:, 1:], k[:, 1:], v[:, 1:], None, {'l2': 1.0}).item())


def test_dof_selection_sees_what_nope_maps_see(ckpts, monkeypatch):
    """Issue 52: under nope=1, DoF's feature-dimension selection measures the q, k the maps will see, RoPE undone
    (by hand here), not the rotated ones."""
    from test_attention import _rope
    model = M.load(ckpts['llama'])[0]
    cfg = C.ConvertConfig(init_from=ckpts['llama'], attn='dof:nope=1', dof_budget=4, device='cpu')
    q, k = (torch.randn(2, 4, 6, 8) for _ in range(2))
    qk = {l: (q, k, torch.ones(2, 6, dtype=torch.bool)) for l in range(2)}
    seen = {}
    monkeypatch.setattr(C, 'select_feature_dims', lambda layer_qk, *a, **kw: (
        seen.update(layer_qk) or ({l: 4 for l in layer_qk}, [])))
    C.swap(model, cfg, [0, 1], qk)
    inv_freq = M.rope_inv_freq(8, model.config.rope_theta)
    want = _rope(q, 0, -inv_freq).transpose(1, 2).reshape(12, 4, 8).transpose(0, 1)   # (H, N, D) pooled
    torch.testing.assert_close(seen[0][0], want)


@pytest.mark.parametrize('attn,loss,n', [('dof:window=4:decay=8', 'l2', 4),
                                         ('dof:decay=8', 'l2+0*mse', 4),
                                         ('dof:window=4:decay=8', 'ce+0.1*l2', 8)])
def test_stage1_trains_what_its_loss_reaches(ckpts, text_file, tmp_path, monkeypatch, attn, loss,
                                             n):
    """Issue 61: every parameter stage 1 trains gets a gradient from its loss (DDP stops at one
    that does not: "Expected to have finished reduction"), and only those: --loss l2 alone reads
    the maps' features, so a decay and a window factor stay as they were (they trained under DDP:
    a traceback on every rank). n: 2 layers' z and log_a of the dof maps (and decay, window)."""
    fit, seen = train.fit, {}

    def spy(module, params, loss_fn, next_batch, *a, **k):   # one loss's gradients, then fit
        loss_fn(module, next_batch(torch.Generator().manual_seed(0))).backward()
        seen.update(trained=params, reached=[p for p in module.parameters() if p.grad is not None])
        module.zero_grad()
        return fit(module, params, loss_fn, next_batch, *a, **k)
    monkeypatch.setattr(train, 'fit', spy)
    _run(_args(ckpts['llama'], text_file, tmp_path / 'o', '--attn', attn, '--loss', loss,
               '--stage1_iters', '1', '--stage2_iters', '0'))
    assert {id(p) for p in seen['trained']} == {id(p) for p in seen['reached']}
    assert len(seen['trained']) == n


@pytest.mark.slow
def test_torchrun_l2_loss_with_a_decay_and_a_window_equals_one_process(ckpts, text_file, tmp_path):
    """Issue 61: --loss l2 with a decay and a window (dof:window=4:decay=8), stage 1 under torchrun
    (2 gloo processes, DDP): the maps train as in one process with the same global batch (within
    1e-5), the decay and the window factor stay at their init (before: "Expected to have finished
    reduction" on both ranks)."""
    args = _args(ckpts['llama'], text_file, tmp_path / 'one', '--attn', 'dof:window=4:decay=8',
                 '--loss', 'l2', '--grad_accum', '2', '--stage1_iters', '2', '--stage2_iters', '0')
    _run(args)
    r = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone',
                        '--nproc_per_node=2', 'convert.py', *args, '--out_dir',
                        str(tmp_path / 'ddp')], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS='1'), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    a, b = _saved(tmp_path / 'one')['model'], _saved(tmp_path / 'ddp')['model']
    init = M.load(ckpts['llama'], attn='dof:window=4:decay=8')[0].state_dict()
    assert a.keys() == b.keys() and any(k.endswith('decay_rate') for k in a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-5, msg=k)
        if k.endswith(('decay_rate', 'window_factor')):
            torch.testing.assert_close(b[k], init[k], msg=k)


@pytest.mark.slow
def test_torchrun_ddp_and_fsdp_equal_one_process(ckpts, text_file, tmp_path):
    """Issue 54: both stages under torchrun, 2 gloo processes, data-parallel and with every block sharded (FSDP2),
    equal one process with the same global batch (--grad_accum 2): calibration (the probe's exact head, the mix
    share), the trained tensors within 1e-5 and the perplexity; under FSDP each process holds about half of the
    parameters; the checkpoints load in eval.py without torchrun and score the same. The FSDP run remakes each
    block's activations in backward (--grad_ckpt: the blocks' own FSDP hooks gather their weights again)."""
    args = _args(ckpts['llama'], text_file, tmp_path / 'one', '--attn', 'lolcats:window=4:combine=mix',
                 '--exact_heads', '1', '--batch_size', '2', '--grad_accum', '2', '--stage1_iters', '3',
                 '--stage2_iters', '3')
    one = _run(args)
    for how in ('ddp', 'fsdp'):
        r = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                            'convert.py', *args, '--out_dir', str(tmp_path / how)] + ['--fsdp', '--grad_ckpt'] * (how == 'fsdp'),
                           cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS='1'),
                           timeout=300)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert r.stdout.count('== stage2') == 1   # rank 0 prints
        s = json.loads((tmp_path / how / 'summary.json').read_text())
        assert s['exact_heads'] == {str(l): h for l, h in one['exact_heads'].items()}
        for stage in ('swap', 'stage1', 'stage2'):
            assert s['stages'][stage]['quality']['ppl'] == pytest.approx(one['stages'][stage]['quality']['ppl'],
                                                                         rel=1e-5)
        a, b = _saved(tmp_path / 'one')['model'], _saved(tmp_path / how)['model']
        assert a.keys() == b.keys() and any(k.endswith('window_factor') for k in a)
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-5, msg=k)
        whole = one['held'][0]['param_bytes']
        assert [h['param_bytes'] < 0.6 * whole for h in s['held']] == [how == 'fsdp'] * 2, s['held']
    ppl = [ev.report_ppl(ev.EvalConfig(ckpt=str(tmp_path / d), ppl=True, data=text_file, context=32, limit=300,
                                       device='cpu'))['ppl'] for d in ('one', 'ddp', 'fsdp')]
    assert ppl == pytest.approx([ppl[0]] * 3, rel=1e-5)
