"""Tests for convert.py: softmax -> linear attention conversion (attention transfer, DoF selection, LoRA,
finetuning, saving and strict reloading), on tiny random GPT-2 / Llama (GQA) / BERT HuggingFace
checkpoints written in the test with transformers' save_pretrained."""
import json
import math
import os
import random

import pytest
import torch
import torch.nn as nn

import attention as A
import convert as C

transformers = pytest.importorskip('transformers')

VOCAB = 257  # train.py's byte tokenizer (offline): 256 bytes + end-of-text


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
            '--batch_size', '4', '--eval_batches', '2', '--log_interval', '1000', *extra]


def _run(argv):
    args = C.get_parser().parse_args(argv)
    return C.run(args)


def _logits(model, x):
    with torch.no_grad():
        if model.config.family == 'bert':
            return model.encode(x)
        return model(x)[0]


# ---------------------------------------------------------------------------------------------------
# LoRA

def test_lora_starts_as_identity_and_only_lora_trains(ckpts, text_file):
    model, _ = C.load_base(ckpts['gpt2'])
    x = torch.randint(0, VOCAB, (2, 16))
    before = _logits(model, x)
    names = C.apply_lora(model, rank=4, alpha=8)
    assert sorted(n.rsplit('.', 1)[-1] for n in names) == sorted(['q_proj', 'k_proj', 'v_proj', 'o_proj'] * 2)
    assert torch.equal(before, _logits(model, x))
    lora = set(id(p) for p in C.lora_parameters(model))
    snap = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, VOCAB, (2000,))
    data = C.LMData(ids[:1500], ids[1500:], 16, 2)
    C.finetune(model, data, 3, 1e-2, 'cpu', lora=True, log_every=100)
    for n, p in model.named_parameters():
        changed = not torch.equal(p, snap[n])
        assert changed == (id(p) in lora), n
    # merging the adapter gives the same function
    lin = model.transformer.h[0].attn.q_proj
    assert isinstance(lin, C.LoRALinear) and isinstance(lin, nn.Linear)
    z = torch.randn(3, 32)
    assert torch.allclose(lin.merged()(z), lin(z), atol=1e-5)


def test_lora_bad_target(ckpts):
    model, _ = C.load_base(ckpts['gpt2'])
    with pytest.raises(C.ConversionError, match='matches no nn.Linear'):
        C.apply_lora(model, 4, 8, targets=['nope_proj'])


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
    for f in ('new_parameters.safetensors', 'manifest.json', 'summary.json'):
        assert (out / f).is_file()
    manifest = json.loads((out / 'manifest.json').read_text())
    assert manifest['base_model'] == os.path.abspath(ckpts[kind])
    assert all(k.startswith('transformer.h.') for k in manifest['parameters'])  # only what changed
    assert any('.core.fmap.' in k for k in manifest['parameters'])
    assert any(k.endswith('lora_A') for k in manifest['parameters']) == (kind != 'bert')
    # the live model is gone: rebuild from disk twice, strictly, and compare with a fresh conversion
    m1 = C.load_converted(str(out))
    m2 = C.load_converted(str(out))
    x = torch.randint(0, VOCAB, (2, 24))
    assert torch.equal(_logits(m1, x), _logits(m2, x))
    assert all(c.attn == 'hedgehog' for c in m1.attention_cores())
    base, _ = C.load_base(ckpts[kind])
    assert not torch.allclose(_logits(base, x), _logits(m1, x))


@pytest.mark.slow
def test_stage1_lowers_fidelity_loss_and_stage2_lowers_ppl(ckpts, text_file, tmp_path):
    s = _run(_args(ckpts['gpt2'], text_file, tmp_path / 'a', '--attn', 't2r', '--stage1_iters', '25',
                   '--lr', '1e-2', '--stage2_iters', '20', '--stage2_lr', '1e-2', '--lora_rank', '8'))
    st = s['stages']
    assert st['stage1']['fidelity']['kl_mean'] < 0.8 * st['swap']['fidelity']['kl_mean']
    assert st['stage1']['loss_last'] < st['stage1']['loss_first']
    assert st['stage2']['quality']['ppl'] < st['stage1']['quality']['ppl']
    assert st['stage2']['mode'] == 'lora'
    assert s['teacher']['ppl'] > 0 and s['unigram']['ppl'] > 0
    assert 'recovery_pct' in st['stage2'] and 'ppl_ratio' in st['stage2']
    # the report table reads the summary
    table = C.report([str(tmp_path / 'a')])
    assert '| a | t2r |' in table


@pytest.mark.slow
def test_full_finetune_window_hybrid_and_mse(ckpts, text_file, tmp_path):
    out = tmp_path / 'w'
    s = _run(_args(ckpts['llama'], text_file, out, '--attn', 'lolcats', '--window', '8', '--stage1_iters', '20',
                   '--stage2_iters', '15', '--lora_rank', '0', '--stage2_lr', '3e-3', '--layers', '1'))
    assert s['loss_weights'] == {'ce': 0.0, 'mse': 1.0, 'l2': 0.0}  # LoLCATs: output MSE
    st = s['stages']
    assert st['stage1']['loss_last'] < st['stage1']['loss_first']
    assert st['stage2']['quality']['ppl'] < st['stage1']['quality']['ppl']
    m = C.load_converted(str(out))
    cores = m.attention_cores()
    assert cores[0].attn == 'softmax' and cores[1].attn == 'lolcats' and cores[1].window == 8
    manifest = json.loads((out / 'manifest.json').read_text())
    assert 'transformer.wte.weight' in manifest['parameters']  # full finetune saves every weight


def test_window_mix_is_calibrated_saved_and_reloaded(ckpts, text_file, tmp_path):
    """--window_combine mix: s starts at the teacher's window mass (not 1/2), and the converted folder reloads
    with the mix form and its trained factors; map options in --attn reach the map."""
    import attention as A
    out = tmp_path / 'mix'
    s = _run(_args(ckpts['llama'], text_file, out, '--attn', 'lolcats:activation=elu', '--window', '8',
                   '--window_combine', 'mix', '--stage1_iters', '3', '--stage2_iters', '0'))
    assert s['window_combine'] == 'mix' and s['attn_options'] == {'activation': 'elu'}
    m = C.load_converted(str(out))
    cores = m.attention_cores()
    assert all(c.window_combine == 'mix' and c.fmap.activation == 'elu' for c in cores)
    assert all((c.factor() - 0.5).abs().max() > 1e-3 for c in cores)  # calibrated, then trained
    base, _ = C.load_base(ckpts['llama'])
    C.swap_attention(base, 'lolcats', [0, 1], window=8, window_combine='mix', map_options={'activation': 'elu'})
    base.load_state_dict(m.state_dict())
    x = torch.randint(0, VOCAB, (2, 24))
    torch.testing.assert_close(_logits(base, x), _logits(m, x))
    assert '| mix | lolcats:activation=elu-w8(mix) |' in C.report([str(out)])
    assert A.WINDOW_COMBINES == ('joint', 'mix')


def test_output_mse_never_forms_the_attention_matrix(ckpts, monkeypatch):
    """The LoLCATs loss goes through the core's chunked linear path (no T x T weights)."""
    model, _ = C.load_base(ckpts['gpt2'])
    C.swap_attention(model, 'hedgehog', [0, 1])
    cap = C.TeacherCapture(model.attention_cores(), [0, 1])
    x = torch.randint(0, VOCAB, (1, 64))
    with torch.no_grad(), cap.teacher():
        model(x)
    called = []
    monkeypatch.setattr(A, 'softmax_weights', lambda *a, **k: called.append(1))
    monkeypatch.setattr(A, 'linear_attention_weights', lambda *a, **k: called.append(1))
    (q, k, v), kw = cap.inputs[1]
    losses = C.transfer_losses(model.attention_cores()[1], q, k, v, cap.outputs[1], kw, {'mse': 1.0})
    assert set(losses) == {'mse'} and losses['mse'].requires_grad and not called


def test_teacher_forcing_captures_exact_softmax(ckpts):
    model, _ = C.load_base(ckpts['llama'])
    x = torch.randint(0, VOCAB, (2, 16))
    ref = _logits(model, x)
    C.swap_attention(model, 'elu', [0, 1])
    cap = C.TeacherCapture(model.attention_cores(), [0, 1])
    with torch.no_grad(), cap.teacher():
        out = _logits(model, x)
    assert torch.allclose(out, ref, atol=1e-5)  # the residual stream is the teacher's
    (q, k, v), _ = cap.inputs[0]
    assert q.shape == k.shape == v.shape == (2, 4, 16, 8)  # GQA keys already repeated to 4 heads
    assert torch.allclose(cap.outputs[0], A.softmax_attention(q, k, v), atol=1e-5)
    assert not any(c.teacher for c in model.attention_cores())  # restored
    assert not torch.allclose(_logits(model, x), ref)


@pytest.mark.slow
def test_dof_selection_in_the_pipeline(ckpts, text_file, tmp_path, capsys):
    s = _run(_args(ckpts['gpt2'], text_file, tmp_path / 'd', '--attn', 'dof', '--dof_budget', '6',
                   '--dof_samples', '32', '--stage1_iters', '2', '--stage2_iters', '0'))
    assert 'DoF feature-dimension selection' in capsys.readouterr().out
    dims = [s['feature_dims'][str(l)] for l in range(2)]
    assert sum(dims) / 2 == 6
    assert [r['feature_dim'] for r in s['dof_table']] == dims
    m = C.load_converted(str(tmp_path / 'd'))
    assert [c.fmap.feature_dim for c in m.attention_cores()] == dims
    # the hedgehog extension allocates even widths (F = 2 x MLP outputs), mean F == budget
    s = _run(_args(ckpts['gpt2'], text_file, tmp_path / 'h', '--attn', 'hedgehog', '--dof_budget', '12',
                   '--dof_samples', '32', '--stage1_iters', '0', '--stage2_iters', '0'))
    dims = [s['feature_dims'][str(l)] for l in range(2)]
    assert sum(dims) / 2 == 12 and all(d % 2 == 0 for d in dims)
    # DoF + Clip (paper Sec. 4.2) at head_dim 8 (hedgehog: F at 16), no redistribution; summary.json records it
    s = _run(_args(ckpts['gpt2'], text_file, tmp_path / 'c', '--attn', 'hedgehog', '--dof_budget', '20',
                   '--dof_samples', '32', '--dof_clip', '--stage1_iters', '0', '--stage2_iters', '0'))
    dims = [s['feature_dims'][str(l)] for l in range(2)]
    assert sum(r['unclipped'] for r in s['dof_table']) == 40 and dims == [16, 16]  # mean cost 16 < 20
    assert [r['feature_dim'] for r in s['dof_table']] == dims
    assert s['dof'] == {'lambda': 2 ** -4, 'J': 32, 'budget': 20, 'clip': 16, 'calib_tokens': 4 * 4 * 32,
                        'mean_feature_dim': 16}


@pytest.mark.slow
def test_glue_classifier_conversion(ckpts, tmp_path):
    rng = random.Random(0)
    good = ['the cat sat on the mat', 'a dog ran home', 'the sun is big', 'we like red houses']
    bad = ['cat the mat on sat', 'ran dog home a', 'big is sun the', 'houses red like we']
    for split, n in (('train', 60), ('dev', 16)):
        rows = [f'{rng.choice(good)}\t1' if i % 2 else f'{rng.choice(bad)}\t0' for i in range(n)]
        (tmp_path / f'{split}.tsv').write_text('\n'.join(rows) + '\n')
    out = tmp_path / 'glue'
    s = _run(['--init_from', ckpts['bert'], '--data', str(tmp_path), '--task', 'glue', '--glue_task', 'cola',
              '--attn', 'hedgehog', '--out_dir', str(out), '--stage1_iters', '2', '--stage2_iters', '8',
              '--stage2_lr', '3e-3', '--batch_size', '8', '--eval_batches', '2', '--block_size', '32'])
    q = s['stages']['stage2']['quality']
    assert 'mcc' in q and 'accuracy' in q and 'loss' in q
    assert s['teacher'] is not None and 'mcc' in s['teacher']
    m = C.load_converted(str(out))
    assert m.config.num_labels == 2
    x = torch.randint(0, VOCAB, (2, 10))
    logits, _ = m.classify(x, attention_mask=torch.ones_like(x))
    assert logits.shape == (2, 2)
    # the new classifier head is saved with the adapters: two rebuilds are the same function
    again, _ = C.load_converted(str(out)).classify(x, attention_mask=torch.ones_like(x))
    assert torch.equal(logits, again)
    assert 'classifier.weight' in json.loads((out / 'manifest.json').read_text())['parameters']


# ---------------------------------------------------------------------------------------------------
# saving / strict reloading / bad input

def test_strict_reload_rejects_tampered_files(ckpts, text_file, tmp_path):
    out = tmp_path / 'o'
    _run(_args(ckpts['gpt2'], text_file, out, '--attn', 'performer', '--stage1_iters', '0',
               '--stage2_iters', '1'))
    m = C.load_converted(str(out))
    x = torch.randint(0, VOCAB, (1, 12))
    # the random features (a buffer) are saved too: a rebuilt model is the same function
    assert torch.equal(_logits(m, x), _logits(C.load_converted(str(out)), x))
    mpath = out / 'manifest.json'
    manifest = json.loads(mpath.read_text())
    lora_key = next(k for k in manifest['parameters'] if k.endswith('lora_A'))
    manifest['parameters'].pop(lora_key)
    mpath.write_text(json.dumps(manifest))
    with pytest.raises(C.ConversionError, match='do not match'):
        C.load_converted(str(out))
    with pytest.raises(C.ConversionError, match='no manifest.json'):
        C.load_converted(str(tmp_path))


@pytest.mark.parametrize('extra,message', [
    (['--init_from', '/nonexistent/ckpt.pt'], 'no such checkpoint'),
    (['--layers', '0,7'], 'unknown layer index 7'),
    (['--attn', 'nosuchmap'], "unknown --attn 'nosuchmap'"),
    (['--attn', 'hedgehog', '--feature_dim', '7'], 'head_dim=8'),
    (['--attn', 'taylor', '--max_feature_dim', '32'], 'feature dimension 73'),
    (['--attn', 'elu', '--dof_budget', '8'], '--dof_budget applies to'),
    (['--attn', 'dof', '--dof_clip'], '--dof_clip needs it'),
    (['--attn', 'dof', '--dof_budget', '8', '--dof_lambda', '0'], '--dof_lambda must be > 0'),
    (['--loss', 'kl'], "unknown --loss part 'kl'"),
])
def test_bad_input_is_a_clear_error(extra, message, ckpts, text_file, tmp_path, capsys):
    argv = _args(ckpts['gpt2'], text_file, tmp_path / 'x', '--stage1_iters', '0', '--stage2_iters', '0') + extra
    assert C.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith('convert.py: error:') and message in err and '\n' not in err


def test_bert_needs_a_task_for_stage2(ckpts, text_file, tmp_path, capsys):
    assert C.main(_args(ckpts['bert'], text_file, tmp_path / 'b', '--stage2_iters', '5')) == 2
    assert 'use --task glue' in capsys.readouterr().err


def test_help_lists_the_stable_flags(capsys):
    with pytest.raises(SystemExit):
        C.main(['--help'])
    out = capsys.readouterr().out
    for flag in ('--init_from', '--attn', '--data', '--out_dir', '--stage1_iters', '--stage2_iters',
                 '--lora_rank', '--window', '--dof_budget', '--layers', '--loss', '--diag_block'):
        assert flag in out


def test_softmax_control_run_only_finetunes(ckpts, text_file, tmp_path):
    out = tmp_path / 'ctl'
    s = _run(_args(ckpts['gpt2'], text_file, out, '--attn', 'softmax', '--stage1_iters', '5',
                   '--stage2_iters', '2'))
    assert s['stages']['swap']['fidelity']['kl_mean'] == pytest.approx(0.0, abs=1e-6)
    assert s['stages']['swap']['quality']['ppl'] == pytest.approx(s['teacher']['ppl'])
    m = C.load_converted(str(out))
    assert all(c.attn == 'softmax' for c in m.attention_cores())
    assert all(k.endswith(('lora_A', 'lora_B')) for k in json.loads((out / 'manifest.json').read_text())['parameters'])


def test_parameter_free_map_saves_a_manifest_only(ckpts, text_file, tmp_path):
    out = tmp_path / 'elu'
    _run(_args(ckpts['llama'], text_file, out, '--attn', 'elu', '--stage1_iters', '5', '--stage2_iters', '0'))
    assert json.loads((out / 'manifest.json').read_text())['parameters'] == {}
    m = C.load_converted(str(out))
    assert all(c.attn == 'elu' for c in m.attention_cores())
