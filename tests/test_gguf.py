"""GGUF loading (model.load_gguf via model.load): the tests write tiny llama GGUF files with gguf's own
writer, the q/k rows permuted as llama.cpp's convert_hf_to_gguf.py permutes them, for every supported tensor type:
F32 (logits equal the original model's), F16/BF16 and the types gguf quantizes in numpy (every weight within the
format's error bound; logits equal a model built from the dequantised weights), and the K-quants, whose blocks
are packed here by hand from chosen integer quants and scales following llama.cpp's block layouts (the expected
floats are computed here from those layouts). Plus the errors and the tokenizer a GGUF carries."""
import numpy as np
import pytest
import torch

import gguf
import transformers

import attention as A
import model as M
import tokenizer as T

Q = gguf.GGMLQuantizationType
QK_K = 256


# ---- writing tiny GGUF files --------------------------------------------------------------------------------

def permute(w, n_head):
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (rows of one projection, HF order -> GGUF order)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w, n_head):
    """The inverse of `permute`, through the row permutation it applies (independent of model.unpermute_qk)."""
    order = permute(np.arange(w.shape[0]), n_head)        # GGUF row r holds HF row order[r]
    out = np.empty_like(w)
    out[order] = w
    return out


def tiny_config(tie=True, n_embd=64, inter=128, vocab=None):
    return M.GPTConfig(family='llama', vocab_size=vocab or len(TOKENS), block_size=32, n_layer=2, n_head=4,
                       n_kv_head=2, n_embd=n_embd, intermediate_size=inter, bias=False, norm_eps=1e-5,
                       rope_theta=10000.0, tie_embeddings=tie)


def gguf_tensors(model):
    """Our model's weights under GGUF names, q/k permuted as llama.cpp writes them (float32 numpy, (out, in))."""
    cfg, sd = model.config, model.state_dict()
    names = {'ln_1.weight': 'attn_norm', 'attn.q_proj.weight': 'attn_q', 'attn.k_proj.weight': 'attn_k',
             'attn.v_proj.weight': 'attn_v', 'attn.o_proj.weight': 'attn_output', 'ln_2.weight': 'ffn_norm',
             'mlp.gate_proj.weight': 'ffn_gate', 'mlp.up_proj.weight': 'ffn_up', 'mlp.down_proj.weight': 'ffn_down'}
    out = {'token_embd.weight': sd['transformer.wte.weight'], 'output_norm.weight': sd['transformer.ln_f.weight']}
    if not cfg.tie_embeddings:
        out['output.weight'] = sd['lm_head.weight']
    for i in range(cfg.n_layer):
        for ours, theirs in names.items():
            w = sd[f'transformer.h.{i}.{ours}'].numpy()
            if theirs == 'attn_q':
                w = permute(w, cfg.n_head)
            if theirs == 'attn_k':
                w = permute(w, cfg.n_kv_head)
            out[f'blk.{i}.{theirs}.weight'] = w
    return {k: np.ascontiguousarray(np.asarray(v, dtype=np.float32)) for k, v in out.items()}


# a tiny byte-level BPE vocabulary: the 256 bytes (spelled as GPT-2's bytes_to_unicode spells them: printable
# Latin-1 bytes as themselves, the others as chr(256 + k)), a few merges, one control token
_KEEP = [*range(ord('!'), ord('~') + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
_MOVED = iter(range(256, 512))
_B2U = {b: chr(b) if b in _KEEP else chr(next(_MOVED)) for b in range(256)}
MERGES = ['h e', 'l l', 'he ll', 'hell o', 'Ġ w', 'o r', 'Ġw or', 'l d', 'Ġwor ld']
TOKENS = ['<|endoftext|>'] + [_B2U[b] for b in range(256)] + [m.replace(' ', '') for m in MERGES]
TYPES = [3] + [1] * (len(TOKENS) - 1)


def write_gguf(path, cfg, tensors, arch='llama', tokenizer_model='gpt2', skip=(), rope_scaling=None):
    """tensors: name -> float32 array (written F32), float16 array (F16) or (uint8 block bytes (out, n_bytes), type)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.n_layer)
    w.add_context_length(cfg.block_size)
    w.add_embedding_length(cfg.n_embd)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_kv_head)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if rope_scaling:
        w.add_rope_scaling_type(getattr(gguf.RopeScalingType, rope_scaling[0]))
        w.add_rope_scaling_factor(rope_scaling[1])
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre('gpt2')
    w.add_token_list(TOKENS)
    w.add_token_types(TYPES)
    w.add_token_merges(MERGES)
    w.add_eos_token_id(0)
    for name, t in tensors.items():
        if name in skip:
            continue
        if isinstance(t, tuple):     # the writer derives (out, in) from the byte shape and the type
            w.add_tensor(name, t[0], raw_dtype=t[1])
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _model(tie=True, seed=0, **kw):
    torch.manual_seed(seed)
    m = M.GPT(tiny_config(tie, **kw)).eval()
    with torch.no_grad():          # norms away from 1, so that a mixed-up norm would show
        for n, p in m.named_parameters():
            if n.endswith(('ln_1.weight', 'ln_2.weight', 'ln_f.weight')):
                p.uniform_(0.5, 1.5)
    return m


def _logits(m, seed=1):
    x = torch.randint(0, m.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return m(x)[0]


# ---- float and numpy-quantisable types ---------------------------------------------------------------------

@pytest.mark.parametrize('tie', [True, False])
def test_f32_logits_equal_the_original(tmp_path, tie):
    m = _model(tie)
    path = write_gguf(tmp_path / 'm.gguf', m.config, gguf_tensors(m))
    g = M.load(path)[0].eval()
    assert g.config.tie_embeddings == tie and g.config.n_kv_head == 2 and g.config.vocab_size == len(TOKENS)
    assert g.config.norm_eps == pytest.approx(1e-5) and g.config.block_size == 32
    assert torch.equal(_logits(g), _logits(m))
    # every tensor back in torch's (out, in) Linear layout and HF row order
    for k, v in m.state_dict().items():
        assert torch.equal(g.state_dict()[k], v), k


def test_f32_matches_transformers_llama(tmp_path):
    """The permutation and RoPE convention against an independent reference: HF LlamaForCausalLM weights
    written the way llama.cpp's converter writes them give HF's logits."""
    cfg = tiny_config(tie=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
        max_position_embeddings=cfg.block_size, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=False,
        initializer_range=0.2)).eval()
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    t = {'token_embd.weight': sd['model.embed_tokens.weight'], 'output_norm.weight': sd['model.norm.weight'],
         'output.weight': sd['lm_head.weight']}
    for i in range(cfg.n_layer):
        p = f'model.layers.{i}.'
        t.update({f'blk.{i}.attn_norm.weight': sd[p + 'input_layernorm.weight'],
                  f'blk.{i}.attn_q.weight': permute(sd[p + 'self_attn.q_proj.weight'], cfg.n_head),
                  f'blk.{i}.attn_k.weight': permute(sd[p + 'self_attn.k_proj.weight'], cfg.n_kv_head),
                  f'blk.{i}.attn_v.weight': sd[p + 'self_attn.v_proj.weight'],
                  f'blk.{i}.attn_output.weight': sd[p + 'self_attn.o_proj.weight'],
                  f'blk.{i}.ffn_norm.weight': sd[p + 'post_attention_layernorm.weight'],
                  f'blk.{i}.ffn_gate.weight': sd[p + 'mlp.gate_proj.weight'],
                  f'blk.{i}.ffn_up.weight': sd[p + 'mlp.up_proj.weight'],
                  f'blk.{i}.ffn_down.weight': sd[p + 'mlp.down_proj.weight']})
    g = M.load(write_gguf(tmp_path / 'hf.gguf', cfg, t))[0].eval()
    x = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(g(x)[0], hf(x).logits, atol=1e-4, rtol=1e-4)


def _block_bound(w, kind):
    """The largest error each weight may have after a round trip through `kind`, per block of 32 along a row,
    from llama.cpp's reference quantisers: rounding to the grid of step d (d/2; d for a value clipped at the top
    of Q4_0/Q5_0's asymmetric grid), plus the f16 rounding of the stored d (relative 2^-11, times the largest
    |q|) and of the stored block minimum (Q4_1, Q5_1)."""
    u = 2.0 ** -11
    if kind == 'F16':
        return np.abs(w) * u + 6e-8
    if kind == 'BF16':
        return np.abs(w) * 2.0 ** -8
    b = w.reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(b).max(-1, keepdims=True)
    lo, hi = b.min(-1, keepdims=True), b.max(-1, keepdims=True)
    bound = {'Q8_0': amax / 127 * (0.5 + 127 * u),              # d = amax/127, q in -127..127
             'Q4_0': amax / 8 * (1 + 8 * u),                      # d = -max/8, q in -8..7
             'Q5_0': amax / 16 * (1 + 16 * u),                    # d = -max/16, q in -16..15
             'Q4_1': (hi - lo) / 15 * (0.5 + 15 * u) + np.abs(lo) * u,   # d = (max-min)/15 above the min
             'Q5_1': (hi - lo) / 31 * (0.5 + 31 * u) + np.abs(lo) * u}[kind]
    return np.broadcast_to(bound, b.shape).reshape(w.shape) + 1e-7


@pytest.mark.parametrize('kind', ['F16', 'BF16', 'Q8_0', 'Q4_0', 'Q4_1', 'Q5_0', 'Q5_1'])
def test_quantised_types(tmp_path, kind):
    m = _model(tie=kind in ('F16', 'Q4_0', 'Q5_1'))
    floats = gguf_tensors(m)
    qtype = getattr(Q, kind)
    tensors, deq = {}, {}
    for name, w in floats.items():
        if w.ndim == 2:          # llama.cpp keeps the 1-D norms in F32
            data = gguf.quants.quantize(w, qtype)
            tensors[name] = (data, qtype) if kind != 'F16' else w.astype(np.float16)
            deq[name] = gguf.quants.dequantize(data, qtype).reshape(w.shape)
            err = np.abs(deq[name] - w)
            assert (err <= _block_bound(w, kind)).all(), (name, float(err.max()))
        else:
            tensors[name] = deq[name] = w
    g = M.load(write_gguf(tmp_path / f'{kind}.gguf', m.config, tensors))[0].eval()
    # the reference: the dequantised weights put back by hand (HF row order for q/k) into the original model
    cfg, sd = m.config, m.state_dict()
    ref = M.GPT(cfg).eval()
    put = {'transformer.wte.weight': deq['token_embd.weight'], 'transformer.ln_f.weight': deq['output_norm.weight']}
    if not cfg.tie_embeddings:
        put['lm_head.weight'] = deq['output.weight']
    for i in range(cfg.n_layer):
        for ours, theirs in (('ln_1', 'attn_norm'), ('ln_2', 'ffn_norm'), ('attn.v_proj', 'attn_v'),
                             ('attn.o_proj', 'attn_output'), ('mlp.gate_proj', 'ffn_gate'),
                             ('mlp.up_proj', 'ffn_up'), ('mlp.down_proj', 'ffn_down')):
            put[f'transformer.h.{i}.{ours}.weight'] = deq[f'blk.{i}.{theirs}.weight']
        put[f'transformer.h.{i}.attn.q_proj.weight'] = unpermute_rows(deq[f'blk.{i}.attn_q.weight'], cfg.n_head)
        put[f'transformer.h.{i}.attn.k_proj.weight'] = unpermute_rows(deq[f'blk.{i}.attn_k.weight'], cfg.n_kv_head)
    assert set(put) == {k for k in sd if not (cfg.tie_embeddings and k == 'lm_head.weight')}
    ref.load_state_dict({k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in put.items()}, strict=False)
    assert torch.equal(_logits(g), _logits(ref))


# ---- K-quants, packed by hand from llama.cpp's block layouts (ggml-common.h, dequantize_row_q*_K) ----------

def _f16(rng, n, lo, hi):
    return rng.uniform(lo, hi, n).astype(np.float16)


def _pack_scale_min_k4(sc, mn):
    """Q4_K / Q5_K: eight 6-bit scales and mins in 12 bytes (get_scale_min_k4): j < 4: sc in byte j, min in
    byte j+4 (low 6 bits); j >= 4: low 4 bits of sc / min in byte j+4 (low / high nibble), their top 2 bits
    in the top bits of byte j-4 (sc) and byte j (min)."""
    out = np.zeros((len(sc), 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    return out


def pack_q2_k(rng, nb):
    """block_q2_K (84 bytes): scales[16] (low nibble scale, high nibble min), qs[64], d, dmin (f16). Element i:
    half h = i // 128, j = (i % 128) // 32, l = i % 32 -> 2 bits at shift 2 j of qs[32 h + l]; sub-block i // 16;
    y = d sc q - dmin m."""
    q = rng.integers(0, 4, (nb, QK_K)).astype(np.uint8)
    sc, mn = rng.integers(0, 16, (nb, 16)), rng.integers(0, 16, (nb, 16))
    d, dmin = _f16(rng, nb, 0.01, 0.05), _f16(rng, nb, 0.0, 0.02)
    i = np.arange(QK_K)
    qs = np.zeros((nb, 64), np.uint8)
    np.bitwise_or.at(qs, (slice(None), (i // 128) * 32 + i % 32), q << (2 * ((i % 128) // 32)).astype(np.uint8))
    blocks = np.concatenate([(sc | (mn << 4)).astype(np.uint8), qs, d.view(np.uint8).reshape(nb, 2),
                             dmin.view(np.uint8).reshape(nb, 2)], 1)
    y = d[:, None].astype(np.float64) * sc[:, i // 16] * q - dmin[:, None].astype(np.float64) * mn[:, i // 16]
    return blocks, y


def pack_q3_k(rng, nb):
    """block_q3_K (110 bytes): hmask[32], qs[64], scales[12], d (f16). Element i (h, j, l as Q2_K): low 2 bits at
    shift 2 j of qs[32 h + l], high bit = bit (4 h + j) of hmask[l], set meaning +0, clear meaning -4 (q in -4..3);
    sixteen 6-bit scales s (value s - 32): low nibbles in bytes 0-7 (scale k < 8 in byte k, k >= 8 in the high
    nibble of byte k - 8), top 2 bits in bytes 8-11 (scale k: byte 8 + k % 4, bits 2 (k // 4))."""
    q = rng.integers(-4, 4, (nb, QK_K))
    s = rng.integers(0, 64, (nb, 16))
    d = _f16(rng, nb, 0.005, 0.02)
    i = np.arange(QK_K)
    h, j, l = i // 128, (i % 128) // 32, i % 32
    qs = np.zeros((nb, 64), np.uint8)
    np.bitwise_or.at(qs, (slice(None), h * 32 + l), ((q & 3).astype(np.uint8) << (2 * j).astype(np.uint8)))
    hmask = np.zeros((nb, 32), np.uint8)
    np.bitwise_or.at(hmask, (slice(None), l), ((q >= 0).astype(np.uint8) << (4 * h + j).astype(np.uint8)))
    sb = np.zeros((nb, 12), np.uint8)
    k = np.arange(16)
    np.bitwise_or.at(sb, (slice(None), k % 8), ((s & 0xF) << (4 * (k // 8))).astype(np.uint8))
    np.bitwise_or.at(sb, (slice(None), 8 + k % 4), ((s >> 4) << (2 * (k // 4))).astype(np.uint8))
    blocks = np.concatenate([hmask, qs, sb, d.view(np.uint8).reshape(nb, 2)], 1)
    return blocks, d[:, None].astype(np.float64) * (s[:, i // 16] - 32) * q


def pack_q4_k(rng, nb, bits=4):
    """block_q4_K (144 bytes): d, dmin (f16), scales[12] (_pack_scale_min_k4), qs[128]. Element i: chunk c = i // 64,
    sub-block 2 c + (i % 64 >= 32), nibble (low for the first 32 of the chunk, high for the next 32) of
    qs[32 c + i % 32]; y = d sc q - dmin m. With bits=5 it is block_q5_K (176 bytes): qh[32] before qs, bit
    (2 c + high-half) of qh[i % 32] is the 5th bit."""
    q = rng.integers(0, 2 ** bits, (nb, QK_K))
    sc, mn = rng.integers(0, 64, (nb, 8)), rng.integers(0, 64, (nb, 8))
    d, dmin = _f16(rng, nb, 0.001, 0.004), _f16(rng, nb, 0.0, 0.002)
    i = np.arange(QK_K)
    c, hi, l = i // 64, (i % 64) // 32, i % 32
    qs = np.zeros((nb, 128), np.uint8)
    np.bitwise_or.at(qs, (slice(None), 32 * c + l), ((q & 0xF) << (4 * hi)).astype(np.uint8))
    parts = [d.view(np.uint8).reshape(nb, 2), dmin.view(np.uint8).reshape(nb, 2), _pack_scale_min_k4(sc, mn)]
    if bits == 5:
        qh = np.zeros((nb, 32), np.uint8)
        np.bitwise_or.at(qh, (slice(None), l), ((q >> 4) << (2 * c + hi)).astype(np.uint8))
        parts.append(qh)
    blocks = np.concatenate(parts + [qs], 1)
    sub = 2 * c + hi
    y = d[:, None].astype(np.float64) * sc[:, sub] * q - dmin[:, None].astype(np.float64) * mn[:, sub]
    return blocks, y


def pack_q6_k(rng, nb):
    """block_q6_K (210 bytes): ql[128], qh[64], scales[16] (int8), d (f16). Element i: half h = i // 128,
    quarter k = (i % 128) // 32, l = i % 32: low 4 bits in ql[64 h + l + 32 (k odd)] (low nibble for k < 2),
    high 2 bits at shift 2 k of qh[32 h + l]; q = 6-bit value - 32; y = d scale[i // 16] q."""
    q = rng.integers(-32, 32, (nb, QK_K))
    s = rng.integers(-128, 128, (nb, 16))
    d = _f16(rng, nb, 0.0001, 0.0005)
    u = (q + 32).astype(np.uint8)
    i = np.arange(QK_K)
    h, k, l = i // 128, (i % 128) // 32, i % 32
    ql = np.zeros((nb, 128), np.uint8)
    np.bitwise_or.at(ql, (slice(None), 64 * h + l + 32 * (k % 2)), (u & 0xF) << (4 * (k // 2)).astype(np.uint8))
    qh = np.zeros((nb, 64), np.uint8)
    np.bitwise_or.at(qh, (slice(None), 32 * h + l), (u >> 4) << (2 * k).astype(np.uint8))
    blocks = np.concatenate([ql, qh, s.astype(np.int8).view(np.uint8), d.view(np.uint8).reshape(nb, 2)], 1)
    return blocks, d[:, None].astype(np.float64) * s[:, i // 16] * q


PACKERS = {'Q2_K': pack_q2_k, 'Q3_K': pack_q3_k, 'Q4_K': pack_q4_k, 'Q5_K': lambda r, n: pack_q4_k(r, n, bits=5),
           'Q6_K': pack_q6_k}


@pytest.mark.parametrize('kind', sorted(PACKERS))
def test_k_quants_hand_packed(tmp_path, kind):
    qtype = getattr(Q, kind)
    assert gguf.GGML_QUANT_SIZES[qtype] == (QK_K, {'Q2_K': 84, 'Q3_K': 110, 'Q4_K': 144, 'Q5_K': 176,
                                                   'Q6_K': 210}[kind])
    cfg = tiny_config(tie=kind != 'Q4_K', n_embd=256, inter=256)   # rows of 256 = one K-quant block
    rng = np.random.default_rng(0)
    tensors, expected = {}, {}
    for name, w in gguf_tensors(M.GPT(cfg)).items():
        if w.ndim == 1:
            tensors[name] = expected[name] = w
            continue
        blocks, y = PACKERS[kind](rng, w.size // QK_K)
        tensors[name] = (blocks.reshape(w.shape[0], -1), qtype)
        expected[name] = y.reshape(w.shape)
    g = M.load(write_gguf(tmp_path / f'{kind}.gguf', cfg, tensors))[0]
    sd = g.state_dict()
    got = {'token_embd.weight': sd['transformer.wte.weight'],
           'blk.1.attn_v.weight': sd['transformer.h.1.attn.v_proj.weight'],
           'blk.0.ffn_down.weight': sd['transformer.h.0.mlp.down_proj.weight'],
           'blk.1.attn_q.weight': sd['transformer.h.1.attn.q_proj.weight'],
           'blk.0.attn_k.weight': sd['transformer.h.0.attn.k_proj.weight']}
    if not cfg.tie_embeddings:
        got['output.weight'] = sd['lm_head.weight']
    for name, w in got.items():
        want = expected[name]
        if 'attn_q' in name or 'attn_k' in name:
            want = unpermute_rows(want, cfg.n_head if 'attn_q' in name else cfg.n_kv_head)
        np.testing.assert_allclose(w.numpy(), want, rtol=1e-6, atol=1e-7, err_msg=name)
    assert torch.isfinite(_logits(g.eval())).all()


# ---- errors -------------------------------------------------------------------------------------------------

def test_unsupported_architecture_type_and_missing_tensor(tmp_path):
    m = _model()
    t = gguf_tensors(m)
    with pytest.raises(ValueError, match=r"GGUF architecture 'gpt2' is not supported; supported: 'llama'"):
        M.load(write_gguf(tmp_path / 'a.gguf', m.config, t, arch='gpt2'))[0]
    with pytest.raises(ValueError, match=r"missing keys in the GGUF file: blk\.1\.ffn_down\.weight"):
        M.load(write_gguf(tmp_path / 'b.gguf', m.config, t, skip={'blk.1.ffn_down.weight'}))[0]
    bad = dict(t, **{'blk.0.ffn_up.weight': t['blk.0.ffn_up.weight'].astype(np.float64)})
    with pytest.raises(ValueError, match=r"tensor blk\.0\.ffn_up\.weight has type F64; supported types: F32, F16"):
        M.load(write_gguf(tmp_path / 'c.gguf', m.config, bad))[0]
    extra = dict(t, **{'blk.0.attn_q_norm.weight': np.ones(16, np.float32)})
    with pytest.raises(ValueError, match=r"unexpected keys in the GGUF file: blk\.0\.attn_q_norm\.weight"):
        M.load(write_gguf(tmp_path / 'd.gguf', m.config, extra))[0]
    wrong = dict(t, **{'blk.0.ffn_up.weight': t['blk.0.ffn_up.weight'][:64]})
    with pytest.raises(ValueError, match=r"shape mismatches: blk\.0\.ffn_up\.weight: file \(64, 64\) vs model"):
        M.load(write_gguf(tmp_path / 'e.gguf', m.config, wrong))[0]


def test_a_gguf_file_cut_short_or_not_gguf_is_one_usage_error(tmp_path):
    """Issue 44: a GGUF file an interrupted copy cut short, and a text file named .gguf, are each a UsageError naming
    the file (the scripts print it in one line), not a traceback from gguf's reader."""
    whole = open(write_gguf(tmp_path / 'm.gguf', _model().config, gguf_tensors(_model())), 'rb').read()
    for n in (len(whole) // 2, 100):
        (tmp_path / 'cut.gguf').write_bytes(whole[:n])
        with pytest.raises(A.UsageError, match=r"cannot read .*cut\.gguf as a GGUF file \(cut short\?\)"):
            M.load(str(tmp_path / 'cut.gguf'))
    (tmp_path / 'text.gguf').write_text('not a model\n')
    with pytest.raises(A.UsageError, match=r"text\.gguf is not a checkpoint: neither ours .* nor a GGUF file"):
        M.load(str(tmp_path / 'text.gguf'))


def test_rope_scaling_metadata(tmp_path):
    m = _model()
    t = gguf_tensors(m)
    g = M.load(write_gguf(tmp_path / 'lin.gguf', m.config, t, rope_scaling=('LINEAR', 4.0)))[0]
    assert g.config.rope_scaling == {'rope_type': 'linear', 'factor': 4.0}
    with pytest.raises(ValueError, match=r"RoPE scaling 'yarn' is not supported; supported: none, linear"):
        M.load(write_gguf(tmp_path / 'yarn.gguf', m.config, t, rope_scaling=('YARN', 4.0)))[0]
    t['rope_freqs.weight'] = np.ones(m.config.head_dim // 2, np.float32)
    with pytest.raises(ValueError, match=r"rope_freqs\.weight.* not supported"):
        M.load(write_gguf(tmp_path / 'l3.gguf', m.config, t))[0]


# ---- the tokenizer a GGUF file carries -----------------------------------------------------------------------

def test_tokenizer_metadata_becomes_model_tokenizer_and_travels(tmp_path):
    m = _model()
    g = M.load(write_gguf(tmp_path / 'm.gguf', m.config, gguf_tensors(m)))[0]
    tok = g.tokenizer
    assert isinstance(tok, T.HFTokenizer) and tok.name == 'bpe-gpt2' and tok.eos_id == 0
    assert tok.vocab_size == len(TOKENS)
    ids = tok.encode('hello world<|endoftext|>')
    assert ids[:2] == [TOKENS.index('hello'), TOKENS.index('Ġworld')] and 0 not in ids   # control token: not from text
    assert tok.encode('<|endoftext|>', special=True) == [0]
    assert tok.decode(ids) == 'hello world<|endoftext|>'
    for name in ('ck.pt',):                                # checkpoints carry it
        M.save(str(tmp_path / name), g)
        back, _ = M.load(str(tmp_path / name))
        assert back.tokenizer.fingerprint == tok.fingerprint and back.tokenizer.encode('hello') == tok.encode('hello')


def test_sentencepiece_gguf_loads_without_a_tokenizer(tmp_path):
    m = _model()
    with pytest.warns(UserWarning, match=r"GGUF tokenizer model 'llama' is not supported"):
        g = M.load(write_gguf(tmp_path / 'spm.gguf', m.config, gguf_tensors(m), tokenizer_model='llama'))[0]
    assert g.tokenizer is None
    with pytest.raises(T.TokenizerError, match='pass --tokenizer'):
        T.resolve(g)
