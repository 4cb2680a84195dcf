import copy
import dataclasses
import math

import pytest
import torch

import attention as A
import hybrids as Hy
import kernels as K

MAPS = list(A.FEATURE_MAPS)
PATHS = ('quadratic', 'chunked', 'recurrent')  # the PyTorch paths (triton: tests/test_kernels.py)
B, H, D = 2, 3, 8


def qkv(T=37, D=D, seed=0, scale=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, H, T, D, generator=g) * scale).to(dtype) for _ in range(3)]


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def core_of(name, head_dim=D, n_heads=H, causal=True, chunk_size=64, options=None, **fields):
    """An Attention core from the spec's parts (options: the map's, as a dict)."""
    core = Hy.Attention(A.AttnSpec(name, options=options or {}, **fields), head_dim, n_heads, causal=causal)
    core.chunk_size = chunk_size
    return core


@pytest.mark.parametrize("name", MAPS)
@pytest.mark.parametrize("causal", [True, False])
def test_three_paths_agree_forward_and_backward(name, causal):
    """Outputs and gradients (of q, k, v through the map) agree to 1e-5 of their scale in fp32 and to
    1e-9 in float64. (ReLU maps with near-zero denominators are the sensitive case: an exclusive cumsum
    written as cumsum - x once broke the fp32 gradient bound there.)"""
    torch.manual_seed(0)
    fmap = A.make_feature_map(name, D, H)
    for dtype, tol_y, tol_g in ((torch.float32, 1e-5, 1e-5), (torch.float64, 1e-12, 1e-9)):
        q, k, v = qkv(T=37, dtype=dtype)  # 37: not a multiple of the chunk size 8
        fmap = fmap.to(dtype).eval()  # eval: LLN's statistics stay fixed between the three calls
        outs, grads = {}, {}
        for impl in PATHS:
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            phi_q, phi_k = fmap(qq, kk)
            y = A.linear_attention(phi_q, phi_k, vv, causal=causal, impl=impl, chunk_size=8)
            (y * torch.linspace(-1, 1, y.numel(), dtype=dtype).view_as(y)).sum().backward()
            outs[impl], grads[impl] = y.detach(), [t.grad for t in (qq, kk, vv)]
        for impl in ('chunked', 'recurrent'):
            assert rel_err(outs[impl], outs['quadratic']) <= tol_y, (impl, dtype)
            for g, g_ref in zip(grads[impl], grads['quadratic']):
                assert rel_err(g, g_ref) <= tol_g, (impl, dtype, rel_err(g, g_ref))


@pytest.mark.parametrize("impl", PATHS)
def test_state_carry_over(impl):
    q, k, v = qkv(T=29)
    phi_q, phi_k = A.make_feature_map('hedgehog', D, H)(q, k)
    y_full, (S, z) = A.linear_attention(phi_q, phi_k, v, impl=impl, chunk_size=8, return_state=True)
    y1, st = A.linear_attention(phi_q[:, :, :13], phi_k[:, :, :13], v[:, :, :13], impl=impl, chunk_size=8,
                                return_state=True)
    y2, (S2, z2) = A.linear_attention(phi_q[:, :, 13:], phi_k[:, :, 13:], v[:, :, 13:], impl=impl,
                                      chunk_size=8, initial_state=st, return_state=True)
    assert rel_err(torch.cat([y1, y2], 2), y_full) < 1e-5
    assert rel_err(S2, S) < 1e-5 and rel_err(z2, z) < 1e-5


@pytest.mark.parametrize("case", ['state', 'key_shifts', 'key_shifts_no_state'])
@pytest.mark.parametrize("impl", PATHS + ('reference',))
def test_linear_attention_matches_definition(impl, case):
    """Every path, and kernels.py's reference, against the formula written out with a loop in float64, from an
    initial state (S0, z0) ('state'), with key shifts c_k and (S0, z0, m0) ('key_shifts') or with key shifts and no
    initial state: y_t = phi_q_t . S_t / phi_q_t . z_t, S_t = exp(m0) S0 + sum_{s<=t} exp(c_s) phi_k_s v_s^T and
    z_t likewise (the exact features; c = m0 = 0 where not given, S0 = z0 = 0 without a state), 0 for a query whose
    features are all 0. The returned state: S_T, z_T in units exp(-m), m the largest shift seen (m0 included)."""
    T, shifts = 11, case != 'state'
    q, k, v = qkv(T=T)
    phi_q, phi_k = A.make_feature_map('elu', D, H)(q, k)
    phi_q[:, :, 5] = 0   # a query without features: denominator 0
    g = torch.Generator().manual_seed(1)
    S0, z0 = torch.randn(B, H, D, D, generator=g), torch.rand(B, H, D, generator=g) * 3
    c, m0 = torch.randn(B, H, T, generator=g) * 3 - 10, torch.randn(B, H, generator=g) - 10   # below 0
    init = {'state': (S0, z0), 'key_shifts': (S0, z0, m0), 'key_shifts_no_state': None}[case]
    kw = dict(initial_state=init, return_state=True, c_k=c if shifts else None)
    if impl == 'reference':
        y, state = K.causal_linear_attention_reference(phi_q, phi_k, v, **kw)
    else:
        y, state = A.linear_attention(phi_q, phi_k, v, impl=impl, chunk_size=4, **kw)
    c = c.double() if shifts else torch.zeros(B, H, T, dtype=torch.float64)
    m0 = m0.double() if case == 'key_shifts' else torch.zeros(B, H, dtype=torch.float64)
    pq, pk, vd = phi_q.double(), phi_k.double() * c.exp()[..., None], v.double()
    S, z = (S0.double() * m0.exp()[..., None, None], z0.double() * m0.exp()[..., None]) if init else (0., 0.)
    ref = torch.zeros_like(vd)
    for t in range(T):
        S, z = S + pk[:, :, t, :, None] * vd[:, :, t, None], z + pk[:, :, t]
        den = (pq[:, :, t] * z).sum(-1, keepdim=True)
        ref[:, :, t] = (pq[:, :, t, :, None] * S).sum(2) / den.where(den > 0, 1.)
    assert rel_err(y.double(), ref) < 1e-6
    assert len(state) == 2 + shifts
    m = state[2].double() if shifts else torch.zeros(B, H, dtype=torch.float64)
    assert torch.equal(m, c.amax(-1) if init is None else c.amax(-1).maximum(m0))
    assert rel_err(state[0].double() * m.exp()[..., None, None], S) < 1e-6
    assert rel_err(state[1].double() * m.exp()[..., None], z) < 1e-6


CORES = [(n, {}) for n in MAPS + ['softmax']] + [(n, kw) for n in MAPS for kw in ({'window': 4}, {'diag_block': 5})]


@pytest.mark.parametrize("name,kw", CORES)
def test_causality(name, kw):
    q, k, v = qkv(T=21)
    core = core_of(name, chunk_size=8, **kw).eval()
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    t0 = 12
    for t in (q2, k2, v2):
        t[:, :, t0 + 1:] = torch.randn_like(t[:, :, t0 + 1:]) * 3
    impls = PATHS if not kw else ('chunked',)
    for impl in impls:
        core.spec = dataclasses.replace(core.spec, impl=impl)
        y, y2 = core(q, k, v), core(q2, k2, v2)
        assert torch.allclose(y[:, :, :t0 + 1], y2[:, :, :t0 + 1], atol=1e-6), impl
        assert not torch.allclose(y[:, :, t0 + 1:], y2[:, :, t0 + 1:], atol=1e-3)


def test_lln_causal_in_training_mode():
    """LLN's statistics are buffers updated after the forward: training-mode outputs stay causal."""
    q, k, v = qkv(T=21, scale=2.0)
    core = Hy.Attention('lln', D, H).train()
    q2, k2 = q.clone(), k.clone()
    q2[:, :, 13:] *= 5
    k2[:, :, 13:] *= 5
    state = {n: b.clone() for n, b in core.named_buffers()}
    y = core(q, k, v)
    for n, b in core.named_buffers():  # reset the EMA so both calls see the same statistics
        b.copy_(state[n])
    y2 = core(q2, k2, v)
    assert torch.allclose(y[:, :, :13], y2[:, :, :13], atol=1e-6)


def test_taylor_identity():
    q, k, _ = qkv(T=9)
    phi_q, phi_k = A.make_feature_map('taylor', D, H)(q, k)
    s = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(D)
    assert torch.allclose((phi_q.double() @ phi_k.double().transpose(-2, -1)), 1 + s + s ** 2 / 2, rtol=1e-5)
    assert phi_q.shape[-1] == 1 + D + D * D


def test_performer_unbiased():
    """Mean of phi(q).phi(k) over independent draws of the random features -> exp(q.k / sqrt(D)),
    within 4 standard errors of the Monte-Carlo mean."""
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 1, 1, 5, D, generator=g) * 0.5
    exact = torch.exp((q @ k.transpose(-2, -1)) / math.sqrt(D)).double()
    draws = []
    for seed in range(400):
        fmap = A.make_feature_map('performer', D, 1, feature_dim=16, stabilize=False, seed=seed)
        pq, pk = fmap(q, k)
        draws.append((pq @ pk.transpose(-2, -1)).double())
    draws = torch.stack(draws)
    mean, se = draws.mean(0), draws.std(0) / math.sqrt(len(draws))
    assert ((mean - exact).abs() <= 4 * se + 1e-6).all(), ((mean - exact) / se).abs().max()
    # and the stabiliser cancels in the normalised output
    v = torch.randn(1, 1, 5, D, generator=g)
    f1 = A.make_feature_map('performer', D, 1, stabilize=True, seed=3)
    f0 = A.make_feature_map('performer', D, 1, stabilize=False, seed=3)
    assert rel_err(A.linear_attention(*f1(q, k), v), A.linear_attention(*f0(q, k), v)) < 1e-5


def test_performer_redraw():
    fmap = A.make_feature_map('performer', D, H, redraw_interval=2, seed=0).train()
    q, k, _ = qkv(T=4)
    w0 = fmap.omega.clone()
    fmap(q, k), fmap(q, k)
    assert torch.equal(w0, fmap.omega)
    fmap(q, k)
    assert not torch.equal(w0, fmap.omega)


def test_cosformer_independent_of_current_length():
    q, k, v = qkv(T=30)
    core = Hy.Attention('cosformer', D, H, max_len=64)
    y_long = core(q, k, v)
    y_short = core(q[:, :, :17], k[:, :, :17], v[:, :, :17])
    assert torch.allclose(y_long[:, :, :17], y_short, atol=1e-6)
    with pytest.raises(ValueError, match="max_len"):
        A.make_feature_map('cosformer', D, H, max_len=16)(q, k)


def test_cosformer_kernel_is_cos_reweighted_relu():
    q, k, _ = qkv(T=6)
    phi_q, phi_k = A.make_feature_map('cosformer', D, H, max_len=10)(q, k, offset=3)
    pos = torch.arange(3, 9, dtype=torch.float32)
    expect = (q.relu() @ k.relu().transpose(-2, -1)) * torch.cos(math.pi * (pos[:, None] - pos[None, :]) / 20)
    assert torch.allclose(phi_q @ phi_k.transpose(-2, -1), expect, atol=1e-5)


@pytest.mark.parametrize("softmax_dim", [False, True])
def test_hedgehog_identity_init_is_spiky(softmax_dim):
    x, _, _ = qkv(T=16)
    fmap = A.make_feature_map('hedgehog', D, H, softmax_dim=softmax_dim)
    phi_q, phi_k = fmap(x, x)
    w = A.linear_attention_weights(phi_q, phi_k, causal=False)
    s = x.double()[..., :, None, :] + x.double()[..., None, :, :]  # q_i + k_j, (B, H, T, T, D)
    if softmax_dim:  # [softmax(x), softmax(-x)]: sum_m e^{q_m + k_m} / (Z_q Z_k) + sum_m e^{-q_m - k_m} / (Z'_q Z'_k)
        zp, zm = x.double().exp().sum(-1), (-x.double()).exp().sum(-1)
        kern = s.exp().sum(-1) / (zp[..., :, None] * zp[..., None, :]) + \
            (-s).exp().sum(-1) / (zm[..., :, None] * zm[..., None, :])
    else:  # [exp(x), exp(-x)]: sum_m 2 cosh(q_m + k_m)
        kern = (2 * s.cosh()).sum(-1)
    assert torch.allclose(w.double(), kern / kern.sum(-1, keepdim=True), atol=1e-6)
    if not softmax_dim:  # spiky: lower entropy and more weight on itself than 1 + ELU, and (like softmax,
        # unlike ReLU) spikier the larger the inputs
        elu = A.linear_attention_weights(*A.make_feature_map('elu', D, H)(x, x), causal=False)
        assert A.attention_entropy(w).mean() < A.attention_entropy(elu).mean()
        assert torch.diagonal(w, dim1=-2, dim2=-1).mean() > 1.5 * torch.diagonal(elu, dim1=-2, dim2=-1).mean()
        w2 = A.linear_attention_weights(*fmap(2 * x, 2 * x), causal=False)
        assert A.attention_entropy(w2).mean() < A.attention_entropy(w).mean() - 0.5


@pytest.mark.parametrize("name", ['t2r', 'hedgehog', 'lolcats', 'dof'])
def test_gradients_reach_trainable_maps(name):
    q, k, v = qkv(T=12)
    core = Hy.Attention(f'{name}:window=4' if name == 'hedgehog' else name, D, H)
    core(q, k, v).square().sum().backward()
    params = dict(core.named_parameters())
    assert params, name
    for n, p in params.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, n


HALF_SPECS = [f'{name}{hybrid}' for name in MAPS for hybrid in ('', ':window=4:sinks=2', ':diag_block=5')] + \
    ['softmax:window=4:sinks=2']


@pytest.mark.parametrize("spec", HALF_SPECS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_autocast(spec, dtype):
    """Issue 27: under bf16/fp16 autocast (train.py on a GPU) the cores compute in float32: features, the linear state,
    the window softmax, the division (fp16 used to give NaN for Performer and DoF, and overflow LLN). fp32 inputs:
    within 1e-4 of float64, parallel and decode; bf16/fp16 inputs: |y - y64| <= 2 eps(dtype) max|y64|, y64 the
    float64 output on the same rounded inputs, and y in the inputs' dtype."""
    q, k, v = qkv(T=40, D=16, scale=2.0)
    core = Hy.Attention(spec, 16, H).eval()
    core.chunk_size = 16
    ref = core.double()
    y64 = {dt: ref(*(x.to(dt).double() for x in (q, k, v))) for dt in (torch.float32, dtype)}
    core.float()
    with torch.autocast('cpu', dtype=dtype):
        y, y_lp = core(q, k, v), core(q.to(dtype), k.to(dtype), v.to(dtype))
        _, st = core(q[:, :, :9], k[:, :, :9], v[:, :, :9], return_state=True)
        outs = []
        for t in range(9, 40):
            yt, st = core(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state=st, return_state=True)
            outs.append(yt)
    eps = torch.finfo(dtype).eps
    assert y.dtype == torch.float32 and y_lp.dtype == dtype
    assert rel_err(y.double(), y64[torch.float32]) < 1e-4
    assert (y_lp.double() - y64[dtype]).abs().max() <= 2 * eps * y64[dtype].abs().max()
    assert rel_err(torch.cat(outs, 2).double(), y64[torch.float32][:, :, 9:]) < 1e-4


def test_lln_fit_constants():
    a, b = A.lln_fit(64)
    one = torch.ones(1, dtype=torch.float64)
    alpha, beta = A.lln_alpha_beta(one, one, 64)
    assert 2.0 <= alpha.item() <= 2.2 and torch.allclose(alpha, beta)
    assert abs(a - 0.1486) < 0.03 and abs(b + 0.3549) < 0.15  # near the paper's d = 64 values
    # calibration: alpha, beta follow the statistics (smaller variance -> larger alpha)
    fmap = A.make_feature_map('lln', D, H)
    q, k, _ = qkv(T=50)
    fmap.calibrate(q * 0.5, k * 2.0)
    al, be = fmap.alpha_beta()
    assert (al > be).all()


def naive_window_hybrid(q, k, v, phi_q, phi_k, w, gamma, causal):
    """LoLCATs' joint form (ICLR 2025 Eq. 8 as its official code computes it) written out with loops, float64:
    window weights gamma exp(s_ij - m_i) (m_i the row's max window score), linear weights phi(q_i).phi(k_j)."""
    q, k, v, pq, pk = (t.double() for t in (q, k, v, phi_q, phi_k))
    T = q.shape[-2]
    y = torch.zeros_like(v)
    inside = lambda i, j: (i - j < w) if causal else (abs(i - j) < w)  # noqa: E731
    for i in range(T):
        js = [j for j in range(T) if not (causal and j > i)]
        s = {j: (q[:, :, i] * k[:, :, j]).sum(-1) / math.sqrt(q.shape[-1]) for j in js if inside(i, j)}
        m = torch.stack(list(s.values())).amax(0)
        num, den = 0, 0
        for j in js:
            a = gamma.double()[None, :] * torch.exp(s[j] - m) if inside(i, j) else (pq[:, :, i] * pk[:, :, j]).sum(-1)
            num, den = num + a[..., None] * v[:, :, j], den + a[..., None]
        y[:, :, i] = num / den
    return y


@pytest.mark.parametrize("causal", [True, False])
def test_window_hybrid_matches_equation(causal):
    q, k, v = qkv(T=13)
    core = Hy.Attention('hedgehog:window=4', D, H, causal=causal)
    with torch.no_grad():
        core.window_factor.copy_(torch.tensor([-1.0, 0.0, 2.0]))
    phi_q, phi_k = core.fmap(q, k)
    ref = naive_window_hybrid(q, k, v, phi_q, phi_k, 4, torch.sigmoid(core.window_factor.detach()), causal)
    assert rel_err(core(q, k, v).double(), ref) < 1e-5
    assert rel_err((core.weights(q, k) @ v).double(), ref) < 1e-5
    assert torch.allclose(Hy.Attention('hedgehog:window=4', D, H).factor(), torch.full((H,), 0.1))  # official init


@pytest.mark.parametrize("name,kw", [('softmax', {})] + [(n, kw) for n in ('hedgehog', 'cosformer')
                                                       for kw in ({}, {'window': 4}, {'diag_block': 5})])
def test_decode_state_matches_parallel(name, kw):
    q, k, v = qkv(T=17)
    core = core_of(name, **kw)
    y = core(q, k, v)
    yp, st = core(q[:, :, :6], k[:, :, :6], v[:, :, :6], return_state=True)
    outs = [yp]
    sizes = []
    for t in range(6, 17):
        yt, st = core(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state=st, return_state=True)
        outs.append(yt)
        sizes.append(Hy.state_nbytes(st))
    assert rel_err(torch.cat(outs, 2), y) < 1e-5
    if name == 'softmax':
        assert sizes[-1] > sizes[0]  # the KV cache grows
    else:
        assert max(sizes[5:]) <= max(sizes[:5])  # bounded: the window / partial-block buffer never grows
    # a multi-token continuation gives the same as token-by-token
    y2, _ = core(q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], state=core(q[:, :, :6], k[:, :, :6], v[:, :, :6],
                                                                 return_state=True)[1], return_state=True)
    assert rel_err(y2, y[:, :, 6:]) < 1e-5


def test_diag_hybrid_is_average_of_block_softmax_and_linear():
    q, k, v = qkv(T=13)
    core = Hy.Attention('lln:diag_block=4', D, H, causal=True).eval()
    phi_q, phi_k = core.fmap(q, k)
    lin = A.linear_attention(phi_q, phi_k, v, impl='quadratic')
    blk = torch.zeros_like(v)
    for s in range(0, 13, 4):
        e = min(s + 4, 13)
        blk[:, :, s:e] = A.softmax_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], causal=True)
    assert rel_err(core(q, k, v), 0.5 * (lin + blk)) < 1e-5


def test_key_padding_mask_bidirectional():
    q, k, v = qkv(T=10)
    mask = torch.ones(B, 10, dtype=torch.bool)
    mask[0, 7:] = False
    for kw in [{}, {'window': 3}, {'window': 3, 'sinks': 2}, {'diag_block': 4}]:
        for name in ['softmax', 'hedgehog']:
            if name == 'softmax' and 'diag_block' in kw:
                continue
            core = core_of(name, causal=False, **kw)
            y = core(q, k, v, key_padding_mask=mask)
            y_cut = core(q[:1, :, :7], k[:1, :, :7], v[:1, :, :7])
            assert rel_err(y[:1, :, :7], y_cut) < 1e-5, (name, kw)


def test_softmax_attention_matches_weights():
    q, k, v = qkv(T=9)
    assert rel_err(A.softmax_attention(q, k, v), A.softmax_weights(q, k) @ v) < 1e-5


def test_metrics():
    T = 6
    uniform = torch.full((1, 1, T, T), 1 / T)
    assert torch.allclose(A.attention_entropy(uniform), torch.full((1, 1, T), math.log(T)))
    assert torch.allclose(A.spectral_gap(uniform), torch.ones(1, 1, dtype=torch.float64))
    ident = torch.eye(T)[None, None]
    assert torch.allclose(A.spectral_gap(ident), torch.zeros(1, 1, dtype=torch.float64))
    P = torch.tensor([[0.9, 0.1], [0.2, 0.8]], dtype=torch.float64)[None, None]  # eigenvalues 1 and 0.7
    assert abs(A.spectral_gap(P).item() - 0.3) < 1e-9
    q, k, _ = qkv(T=12)
    w = A.softmax_weights(q, k, causal=True)
    rho, (s, ww) = A.monotonicity(w, q, k, causal=True)
    assert torch.allclose(rho, torch.ones_like(rho)) and s.shape == ww.shape
    from scipy.stats import spearmanr
    w2 = A.linear_attention_weights(*A.make_feature_map('exp', D, H)(q, k), causal=False)
    rho2, _ = A.monotonicity(w2, q, k, causal=False)
    ref = sum(spearmanr(w2[0, 0, i].numpy(), (q[0, 0, i] @ k[0, 0].T).numpy())[0] for i in range(12)) / 12
    assert abs(rho2[0, 0].item() - ref) < 1e-6
    assert A.kl_divergence(w, w).abs().max() < 1e-6
    assert (A.kl_divergence(w, w2) > 0).all()


def test_kernel_l2():
    """A hand-computed case: q = k = 0 (softmax kernel exp(0) = 1), phi_q = (1, 1), phi_k = (1, 3): the squared
    errors are 0 and 4 per row, so 4/3 over the causal pairs (0,0), (1,0), (1,1) and 2 over all four. And the shifted
    features of `features` restore the exact kernel: the loss is the one of the unshifted features."""
    zero = torch.zeros(1, 1, 2, 1)
    pq, pk = torch.tensor([1.0, 1.0]).view(1, 1, 2, 1), torch.tensor([1.0, 3.0]).view(1, 1, 2, 1)
    assert A.kernel_l2(pq, pk, zero, zero).item() == pytest.approx(4 / 3)
    assert A.kernel_l2(pq, pk, zero, zero, causal=False).item() == pytest.approx(2.0)
    q, k, _ = qkv(T=7, scale=2.0)
    fmap = A.make_feature_map('dof', D, H)
    phi_q, phi_k, c_q, c_k = fmap.features(q, k)
    exact = A.kernel_l2(fmap.phi(q, 'q', 0), fmap.phi(k, 'k', 0), q, k)
    assert torch.allclose(A.kernel_l2(phi_q * c_q.exp()[..., None], phi_k * c_k.exp()[..., None], q, k), exact, rtol=1e-5)


def test_bad_input_errors():
    with pytest.raises(ValueError, match="choose one of: elu, relu"):
        A.make_feature_map('nope', D, H)
    with pytest.raises(ValueError, match="choose one of: softmax, elu"):
        Hy.Attention('nope', D, H)
    with pytest.raises(ValueError, match="quadratic, chunked, recurrent"):
        A.linear_attention(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2), impl='fast')
    q, k, v = qkv(T=5)
    with pytest.raises(ValueError, match="n_heads / head_dim mismatch"):
        A.make_feature_map('elu', 16, H)(q, k)
    with pytest.raises(ValueError, match="n_heads / head_dim mismatch"):
        A.make_feature_map('hedgehog', D, H + 1)(q, k)
    with pytest.raises(ValueError, match=r"\(B, H, T, D\)"):
        A.make_feature_map('elu', D, H)(q[0], k[0])
    with pytest.raises(ValueError, match="must be"):
        A.linear_attention(q, k, v[:, :, :3])
    with pytest.raises(ValueError, match="unknown option"):
        A.make_feature_map('elu', D, H, feature_dim=4)


# ----------------------------------------------------------------------------- real-LLM ranges (attention sinks)

ROBUST_MAPS = [('hedgehog', {}), ('hedgehog', {'softmax_dim': False}), ('lolcats', {}),
               ('lolcats', {'activation': 'exp'}), ('lolcats', {'activation': 'elu'}),
               ('lolcats', {'activation': 'relu'}), ('performer', {}), ('dof', {}), ('lln', {}),
               ('exp', {}), ('exp', {'temperature': 2.0})]


def big_qk(T=48, D=16, seed=0, sink=True):
    """Queries and keys with norms up to 30 and |q.k| / sqrt(D) up to 30 (float64, H = 2): random directions
    and radii, plus (sink=True) a key every query points at (q.k / sqrt(D) = +30 for the largest queries) and
    its opposite (-30), as attention sinks give in real LLMs."""
    g = torch.Generator().manual_seed(seed)
    unit = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    q = unit(torch.randn(1, 2, T, D, generator=g, dtype=torch.float64)) * 30 * torch.rand(1, 2, T, 1, generator=g, dtype=torch.float64)
    k = unit(torch.randn(1, 2, T, D, generator=g, dtype=torch.float64)) * 30 * torch.rand(1, 2, T, 1, generator=g, dtype=torch.float64)
    if sink:
        e = unit(torch.randn(1, 2, 1, D, generator=g, dtype=torch.float64))
        q = 0.8 * q + 4.0 * e * torch.rand(1, 2, T, 1, generator=g, dtype=torch.float64)  # |q| <= 28
        k[:, :, 0:1], k[:, :, 5:6] = 30 * e, -30 * e
    s = (q @ k.transpose(-2, -1)).abs().amax() / math.sqrt(D)
    if s > 30:
        q, k = q * (30 / s) ** 0.5, k * (30 / s) ** 0.5
    assert q.norm(dim=-1).max() <= 30 + 1e-9 and k.norm(dim=-1).max() <= 30 + 1e-9
    return q, k


def exact_log_kernel(fmap, q, k):
    """log phi(q_i).phi(k_j) in float64 from the map's exact (unshifted) features, via logsumexp for exp maps."""
    fmap = fmap.double()
    if fmap.log_domain:
        u_q, u_k = fmap.log_phi(q, 'q', 0), fmap.log_phi(k, 'k', 0)
        return torch.logsumexp(u_q[..., :, None, :] + u_k[..., None, :, :], dim=-1)
    return (fmap.phi(q, 'q', 0) @ fmap.phi(k, 'k', 0).transpose(-2, -1)).log()


@pytest.mark.parametrize("name,opts", ROBUST_MAPS)
@pytest.mark.parametrize("sink", [False, True])
def test_large_queries_and_keys_match_float64(name, opts, sink):
    """fp32 outputs of every path equal a float64 evaluation of the exact formula sum_j k_ij v_j / sum_j k_ij
    (no eps) for |q|, |k| <= 30 and |q.k| / sqrt(D) <= 30: no overflow, no denominator lost against eps."""
    torch.manual_seed(0)
    q, k = big_qk(sink=sink)
    v = torch.randn(1, 2, 48, 16, dtype=torch.float64)
    fmap = A.make_feature_map(name, 16, 2, **opts).eval()
    logk = exact_log_kernel(fmap, q, k)
    for causal in (True, False):
        if causal:
            logk_c = logk.masked_fill(~A.causal_mask(48, 48), float('-inf'))
        ref = torch.softmax(logk_c if causal else logk, -1) @ v
        phi_q, phi_k = fmap.float()(q.float(), k.float())
        assert torch.isfinite(phi_q).all() and torch.isfinite(phi_k).all()
        for impl in PATHS:
            y = A.linear_attention(phi_q, phi_k, v.float(), causal=causal, impl=impl, chunk_size=16)
            assert rel_err(y.double(), ref) < 1e-4, (impl, causal, rel_err(y.double(), ref))


def naive_window_ref(q, k, v, logk, w, f, causal, combine, sinks=0):
    """Both window forms written out in float64 from the exact log-kernel: 'joint' (one normalisation, g on
    the linear term) and 'mix' (s y_window + (1 - s) y_linear, each normalised; window only if no linear key);
    logk None: sliding-window softmax alone. The first `sinks` keys are in every row's softmax part."""
    T, D = q.shape[-2], q.shape[-1]
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    seen = (i >= j) if causal else torch.ones(T, T, dtype=torch.bool)
    win = ((i - j < w) & seen if causal else (i - j).abs() < w) | ((j < sinks) & seen)
    lin = seen & ~win
    s = (q @ k.transpose(-2, -1)) / math.sqrt(D)
    if logk is None:
        return torch.softmax(s.masked_fill(~win, float('-inf')), -1) @ v
    f = f.double().view(1, -1, 1, 1)
    if combine == 'joint':  # window weights gamma exp(s_ij - m_i), m_i the row's max window score
        m = s.masked_fill(~win, float('-inf')).amax(-1, keepdim=True)
        logits = torch.where(win, s - m + f.log(), torch.where(lin, logk, torch.tensor(float('-inf'), dtype=s.dtype)))
        return torch.softmax(logits, -1) @ v
    y_w = torch.softmax(s.masked_fill(~win, float('-inf')), -1) @ v
    y_l = torch.softmax(logk.masked_fill(~lin, float('-inf')), -1).nan_to_num(0.0) @ v
    has_l = lin.any(-1)[:, None]
    return torch.where(has_l, f * y_w + (1 - f) * y_l, y_w)


@pytest.mark.parametrize("combine", A.WINDOW_COMBINES)
@pytest.mark.parametrize("name,opts", [('hedgehog', {}), ('lolcats', {'activation': 'exp'}), ('performer', {}),
                                       ('exp', {'temperature': 2.0}), ('lln', {})])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("sinks", [0, 3])
def test_window_hybrid_matches_float64_on_large_inputs(combine, name, opts, causal, sinks):
    q, k = big_qk(sink=True)
    v = torch.randn(1, 2, 48, 16, dtype=torch.float64)
    core = core_of(name, 16, 2, causal=causal, window=5, combine=combine, chunk_size=16, options=opts,
                   sinks=sinks).eval()
    with torch.no_grad():
        core.window_factor.copy_(torch.tensor([-1.5, 1.0]))
    ref = naive_window_ref(q, k, v, exact_log_kernel(core.fmap, q, k), 5, core.factor().detach(), causal, combine,
                           sinks)
    core.float()
    y = core(q.float(), k.float(), v.float())
    assert torch.isfinite(y).all()
    assert rel_err(y.double(), ref) < 1e-4, rel_err(y.double(), ref)
    assert rel_err((core.weights(q.float(), k.float()) @ v.float()).double(), ref) < 1e-4


@pytest.mark.parametrize("spec", ['hedgehog:window=4', 'hedgehog:window=4:combine=mix', 'hedgehog:window=4:sinks=3',
                                  'hedgehog:window=4:sinks=3:combine=mix', 'softmax:window=4',
                                  'softmax:window=4:sinks=3'])
@pytest.mark.parametrize("prefill", [2, 3, 9])
def test_window_forms_decode_matches_parallel(spec, prefill):
    """Token-by-token decoding from the constant-size state equals the parallel form, for both combines, with
    and without sink tokens (a prefill shorter than, equal to and longer than the sinks plus the window)."""
    q, k = big_qk(T=23, sink=True)
    q, k = q.float(), k.float()
    v = torch.randn(1, 2, 23, 16)
    core = Hy.Attention(spec, 16, 2).eval()
    if core.fmap is not None:
        with torch.no_grad():
            core.window_factor.copy_(torch.tensor([0.7, -0.3]))
    y = core(q, k, v)
    _, st = core(q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill], return_state=True)
    outs, sizes = [y[:, :, :prefill]], []
    for t in range(prefill, 23):
        yt, st = core(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state=st, return_state=True)
        outs.append(yt)
        sizes.append(Hy.state_nbytes(st))
    assert rel_err(torch.cat(outs, 2), y) < 1e-5
    assert len(set(sizes[-5:])) == 1  # constant size once the sinks are filled


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("sinks", [0, 1, 4])
def test_sliding_window_softmax_matches_float64(causal, sinks):
    """softmax:window=w[:sinks=N] (StreamingLLM's sink tokens): softmax over the window and the first N keys."""
    q, k = big_qk(sink=True)
    v = torch.randn(1, 2, 48, 16, dtype=torch.float64)
    core = core_of('softmax', 16, 2, causal=causal, window=5, sinks=sinks)
    y = core(q.float(), k.float(), v.float())
    ref = naive_window_ref(q, k, v, None, 5, None, causal, None, sinks)
    assert rel_err(y.double(), ref) < 1e-5
    assert rel_err((core.weights(q.float(), k.float()) @ v.float()).double(), ref) < 1e-5
    w = core.weights(q.float(), k.float())[0, 0]
    assert (w[20, 16:21] > 0).all() and (w[20, sinks:16] == 0).all() and (w[20, :sinks] > 0).all()
    if causal:
        assert (w.triu(1) == 0).all()  # no future key


def test_sinks_spec_errors():
    assert str(A.AttnSpec.parse('softmax:window=64:sinks=4')) == 'softmax:window=64:sinks=4'
    for bad, msg in [('hedgehog:sinks=4', 'sinks'), ('softmax:window=8:combine=mix', 'no diag_block or combine'),
                     ('softmax:diag_block=8', 'no diag_block')]:
        with pytest.raises(ValueError, match=msg):
            A.AttnSpec.parse(bad)


def test_window_mix_calibration_sets_teacher_window_mass():
    q, k, v = qkv(T=30, scale=2.0)
    core = Hy.Attention('hedgehog:window=6:combine=mix', D, H)
    assert torch.allclose(core.factor(), torch.full((H,), 0.5))  # uncalibrated: s = 1/2
    core.calibrate(q, k)
    W = A.softmax_weights(q, k)
    i, j = torch.arange(30)[:, None], torch.arange(30)[None, :]
    mass = (W * ((i - j < 6) & (i >= j))).sum(-1)[..., 6:].mean(dim=(0, 2))
    assert torch.allclose(core.factor(), mass, atol=1e-5)
    joint = Hy.Attention('hedgehog:window=6', D, H)
    joint.calibrate(q, k)  # the joint form's gamma is not data-initialised
    assert torch.allclose(joint.factor(), torch.full((H,), 0.1))
    with pytest.raises(ValueError, match="joint, mix"):
        Hy.Attention('hedgehog:window=6:combine=sum', D, H)


def test_window_mix_calibration_counts_sinks_and_padding():
    """Issue 27: the softmax part holds the sink tokens too, so s is the teacher's mass on window and sinks (rows that
    see a key of neither); with a key padding mask (GLUE's sentences) each sentence is calibrated on its own real
    tokens, T x T at a time, never one N x N matrix of every sentence joined."""
    q, k, _ = qkv(T=30, scale=2.0)
    core = Hy.Attention('hedgehog:window=6:sinks=3:combine=mix', D, H)
    core.calibrate(q, k)
    W = A.softmax_weights(q, k)
    i, j = torch.arange(30)[:, None], torch.arange(30)[None, :]
    mass = (W * ((((i - j < 6) | (j < 3)) & (i >= j)))).sum(-1)[..., 9:].mean(dim=(0, 2))  # rows 9..: see key 3
    assert torch.allclose(core.factor(), mass, atol=1e-5)
    lengths = [30, 17, 22]  # three sentences, padded to 30, bidirectional
    mask = torch.arange(30)[None, :] < torch.tensor(lengths)[:, None]
    qp, kp = qkv(T=30, scale=2.0, seed=1)[:2]
    qp, kp = qp[:1].repeat(3, 1, 1, 1), kp[:1].repeat(3, 1, 1, 1)
    bi = Hy.Attention('hedgehog:window=4:combine=mix', D, H, causal=False)
    bi.calibrate(qp, kp, mask)
    total, rows = 0, 0
    for n in lengths:   # each sentence alone, unpadded
        w = A.softmax_weights(qp[:1, :, :n], kp[:1, :, :n], causal=False)[0]
        a, b = torch.arange(n)[:, None], torch.arange(n)[None, :]
        see = (~((a - b).abs() < 4)).any(-1)
        total, rows = total + (w * ((a - b).abs() < 4)).sum(-1)[:, see].double().sum(-1), rows + int(see.sum())
    assert torch.allclose(bi.factor().double(), total / rows, atol=1e-5)


def test_features_shift_is_exact():
    """phi(x) = phi' exp(c) for every query and key; for the exp maps c is its largest log-feature, so every feature
    is <= 1 and the largest is 1 (any scale of q and k); forward() keeps one key shift per sequence, the largest."""
    q, k = big_qk(sink=True)
    k = k * 3  # key log-features far past float32's e^88
    for name, opts in ROBUST_MAPS:
        fmap = A.make_feature_map(name, 16, 2, **opts).double().eval()
        pq, pk, c_q, c_k = fmap.features(q, k)
        assert c_q.shape == c_k.shape == q.shape[:3], name
        assert torch.allclose(pq * c_q.exp()[..., None], fmap.phi(q, 'q', 0), rtol=1e-9), name
        if fmap.log_domain:
            assert torch.allclose(pk.log() + c_k[..., None], fmap.log_phi(k, 'k', 0), rtol=1e-9, atol=1e-9), name
            for p in (pq, pk):
                assert p.amax(-1).sub(1).abs().max() < 1e-12 and (p <= 1).all(), name
            _, pk_fwd = fmap(q, k)
            assert torch.allclose(pk_fwd, pk * (c_k - c_k.amax(-1, keepdim=True)).exp()[..., None]), name
        else:
            assert torch.allclose(pk, fmap.phi(k, 'k', 0), rtol=1e-9) and (c_k == 0).all(), name


def log_space_ref(fmap, q, k, v, causal):
    """float64 softmax over the exact log-kernel (logsumexp over the features): sum_j k_ij v_j / sum_j k_ij."""
    logk = exact_log_kernel(fmap, q, k)
    if causal:
        logk = logk.masked_fill(~A.causal_mask(q.shape[-2], q.shape[-2]), -math.inf)
    return torch.softmax(logk, -1) @ v


def check_paths_and_decode(name, q, k, v, opts=None, tol=1e-4, prefill=7):
    """fp32 outputs of every PyTorch path, causal and bidirectional, and of decoding token by token from a prefill,
    against the log-space float64 reference."""
    for causal in (True, False):
        core = core_of(name, q.shape[-1], q.shape[1], causal=causal, chunk_size=16, options=opts).eval()
        ref = log_space_ref(core.fmap, q, k, v, causal)
        core.float()
        qf, kf, vf = q.float(), k.float(), v.float()
        for impl in PATHS:
            core.spec = dataclasses.replace(core.spec, impl=impl)
            assert rel_err(core(qf, kf, vf).double(), ref) < tol, (impl, causal, rel_err(core(qf, kf, vf).double(), ref))
        if causal:
            y, st = core(qf[:, :, :prefill], kf[:, :, :prefill], vf[:, :, :prefill], return_state=True)
            ys = [y]
            for t in range(prefill, q.shape[-2]):
                y, st = core(qf[:, :, t:t + 1], kf[:, :, t:t + 1], vf[:, :, t:t + 1], state=st, return_state=True)
                ys.append(y)
            assert rel_err(torch.cat(ys, 2).double(), ref) < tol


def unit_rows(*shape, g):
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    return x / x.norm(dim=-1, keepdim=True)


@pytest.mark.parametrize("name", ['performer', 'dof'])
@pytest.mark.parametrize("norm", [1, 10, 40, 100])
def test_keys_at_any_norm_match_log_space(name, norm):
    """Issue 27: Performer's and DoF's features carry exp(-|x|^2 / 2 sqrt D), e^-625 at |k| = 100 (D = 64), where a
    shared key shift left the denominator below any eps (rows between 1e-13 and 0.57 instead of weighted means).
    Every key at one norm from 1 to 100, queries at norm 8: every path and decoding equal the log-space formula."""
    g = torch.Generator().manual_seed(norm)
    q, k = unit_rows(1, 2, 40, 64, g=g) * 8, unit_rows(1, 2, 40, 64, g=g) * norm
    check_paths_and_decode(name, q, k, torch.randn(1, 2, 40, 64, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("level", [-100, -60, 0, 60, 100])
def test_exp_map_log_features_from_minus_100_to_100(level):
    """exp map: key log-features (its coordinates) around `level`, from e^-100 (below float32) to e^100 (above it):
    the outputs equal the log-space formula; every key coordinate at -60 and every value 1 gives exactly 1."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 30, 16, generator=g, dtype=torch.float64)
    k = level + torch.randn(1, 2, 30, 16, generator=g, dtype=torch.float64)
    check_paths_and_decode('exp', q, k, torch.randn(1, 2, 30, 16, generator=g, dtype=torch.float64))
    ones = torch.ones(1, 2, 30, 16)
    y = core_of('exp', 16, 2)(q.float(), torch.full_like(ones, -60.0), ones)
    assert (y - 1).abs().max() < 1e-6


@pytest.mark.parametrize("name", ['performer', 'dof', 'exp'])
def test_key_norms_varying_within_a_sequence(name):
    """Key scales that differ by more than float32's range within one sequence: the first 20 keys tiny (norm 40,
    exp: coordinates near -150), the rest at norm 2. Each causal row is scaled by the largest key it sees (a running
    max), so a query that sees only the tiny keys gets their weighted mean; later rows are dominated by the large
    keys, as in float64. Bidirectional rows see every key, so one scale (the largest) serves them all."""
    g = torch.Generator().manual_seed(1)
    T, D = 40, 16
    q = unit_rows(1, 2, T, D, g=g) * 4
    if name == 'exp':
        k = torch.randn(1, 2, T, D, generator=g, dtype=torch.float64) - 150 * (torch.arange(T) < 20)[:, None]
    else:
        k = unit_rows(1, 2, T, D, g=g) * torch.where(torch.arange(T) < 20, 40.0, 2.0)[:, None].double()
    v = torch.randn(1, 2, T, D, generator=g, dtype=torch.float64)
    check_paths_and_decode(name, q, k, v, prefill=5)


def test_lolcats_activations():
    """phi(x) = f(x W + b + x): [softmax(u), softmax(-u)], [exp(u), exp(-u)], 1 + ELU(u), ReLU(u)."""
    q, k, _ = qkv(T=5)
    for act, F_ in (('softmax', 2 * D), ('exp', 2 * D), ('elu', D), ('relu', D)):
        fmap = A.make_feature_map('lolcats', D, H, activation=act)
        with torch.no_grad():
            fmap.weight.normal_()
            fmap.bias.normal_()
        assert fmap.feature_dim == F_
        u = torch.einsum('bhtd,hfd->bhtf', q, fmap.weight) + fmap.bias[None, :, None] + q
        want = {'softmax': lambda: torch.cat([u.softmax(-1), (-u).softmax(-1)], -1),
                'exp': lambda: torch.cat([u.exp(), (-u).exp()], -1),
                'elu': lambda: torch.nn.functional.elu(u) + 1, 'relu': lambda: u.relu()}[act]()
        assert torch.allclose(fmap.phi(q, 'q', 0), want, rtol=1e-5, atol=1e-6), act
    with pytest.raises(ValueError, match="softmax, exp, elu, relu"):
        A.make_feature_map('lolcats', D, H, activation='tanh')


# ----------------------------------------------------------------------------- AttnSpec

@pytest.mark.parametrize("text", ['softmax', 'hedgehog:feature_dim=64', 'lolcats:window=64:combine=mix',
                                  'lln:diag_block=64', 'exp:temperature=2', 'performer:impl=recurrent:seed=3',
                                  'lln:match=entropy', 'hedgehog:softmax_dim=false:window=8'])
def test_attn_spec_round_trip(text):
    spec = A.AttnSpec.parse(text)
    assert A.AttnSpec.parse(str(spec)) == spec and A.AttnSpec.parse(spec) is spec
    assert hash(spec) == hash(A.AttnSpec.parse(str(spec)))


def test_attn_spec_fields_aliases_and_defaults():
    spec = A.AttnSpec.parse('exp:t=2:window=16:combine=mix')
    assert spec == A.AttnSpec('exp', window=16, combine='mix', options={'temperature': 2})
    assert str(spec) == 'exp:window=16:combine=mix:temperature=2'  # defaults left out, options last
    assert A.AttnSpec.parse('hedgehog:f=32').options == (('feature_dim', 32),)
    assert str(A.AttnSpec()) == 'softmax' and str(A.AttnSpec('elu', impl='chunked')) == 'elu'
    assert dataclasses.replace(spec, impl='recurrent').impl == 'recurrent'
    core = Hy.Attention('lolcats:window=4:activation=elu:f=16', D, H)
    assert (core.spec.name, core.window, core.spec.combine, core.mode, core.fmap.activation, core.fmap.feature_dim) == \
        ('lolcats', 4, 'joint', 'window', 'elu', 16)
    assert A.AttnSpec.parse('lolcats:window=4:cache=2:cache_block=8').cache_block == 8


@pytest.mark.parametrize("text,msg", [
    ('nope', "unknown attention 'nope'; choose one of: softmax, elu"),
    ('hedgehog:temperature=2', "unknown option.* temperature; hedgehog's options: feature_dim, softmax_dim"),
    ('elu:f=8', "elu's options: none"),
    ('hedgehog:window=4:diag_block=4', "not both"),
    ('softmax:diag_block=4', "softmax takes a window and sinks, no diag_block"),
    ('softmax:feature_dim=4', "unknown option"),
    ('hedgehog:combine=sum:window=4', "unknown window combine 'sum'; choose one of: joint, mix"),
    ('hedgehog:combine=mix', "set window"),
    ('hedgehog:impl=fast', "unknown impl 'fast'; choose one of: quadratic, chunked, recurrent, triton"),
    ('hedgehog:window=-1', ">= 0"),
    ('hedgehog:window', "expected name:key=value"),
    ('hedgehog:f=8:feature_dim=8', "distinct keys"),
    ('hedgehog:window=4.5', "window=4.5 is not int"),   # issue 27: it failed later, inside F.pad
    ('softmax:window=w', "window='w' is not int"),
    ('hedgehog:feature_dim=4.5', "feature_dim=4.5 is not int"),
    ('hedgehog:softmax_dim=1', "softmax_dim=1 is not bool"),
])
def test_attn_spec_errors(text, msg):
    with pytest.raises(ValueError, match=msg) as e:
        A.AttnSpec.parse(text)
    assert '\n' not in str(e.value)


# ----------------------------------------------------------------------------- issue 22 defects

def test_fp32_key_log_features_past_float32_range():
    """Issue 22 (key shift): key log-features of 60..100 overflow exp in float32 (e^88.7); the shared key shift
    keeps every path finite and equal to float64 (logsumexp of the exact log-kernel); decoding agrees too."""
    g = torch.Generator().manual_seed(0)
    q, v = torch.randn(1, 2, 24, 16, generator=g), torch.randn(1, 2, 24, 16, generator=g)
    k = 60 + 40 * torch.rand(1, 2, 24, 16, generator=g)
    logk = torch.logsumexp(q.double()[..., :, None, :] + k.double()[..., None, :, :], -1)
    ref = torch.softmax(logk.masked_fill(~A.causal_mask(24, 24), -math.inf), -1) @ v.double()
    for impl in PATHS:
        core = core_of('exp', 16, 2, impl=impl, chunk_size=8)
        assert rel_err(core(q, k, v).double(), ref) < 1e-5, impl
    y, st = core(q[:, :, :5], k[:, :, :5], v[:, :, :5], return_state=True)
    ys = [y]
    for t in range(5, 24):
        y, st = core(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state=st, return_state=True)
        ys.append(y)
    assert rel_err(torch.cat(ys, 2).double(), ref) < 1e-5


@pytest.mark.parametrize("spec", ['hedgehog:window=4', 'hedgehog:window=4:combine=mix', 'lln:diag_block=5',
                                  'exp:window=3'])
def test_gqa_hybrid_state_keeps_kv_heads(spec):
    """Issue 22: a grouped-query model's hybrid decode state keeps its H_kv key/value heads (as the softmax KV
    cache does), phi(k) per query head; decoding still equals the parallel form token by token."""
    g = torch.Generator().manual_seed(0)
    H_, G = 4, 2  # 4 query heads, 2 key/value heads
    q = torch.randn(2, H_, 19, D, generator=g)
    k, v = (torch.randn(2, H_ // G, 19, D, generator=g).repeat_interleave(G, 1) for _ in range(2))
    core = Hy.Attention(spec, D, H_, kv_groups=G).eval()  # eval: LLN's statistics stay fixed
    with torch.no_grad():
        if core.window:
            core.window_factor.copy_(torch.tensor([0.5, -0.5, 1.0, 0.0]))
    y = core(q, k, v)
    _, st = core(q[:, :, :7], k[:, :, :7], v[:, :, :7], return_state=True)
    outs = [y[:, :, :7]]
    for t in range(7, 19):
        yt, st = core(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state=st, return_state=True)
        outs.append(yt)
        slots, F = st.slots, core.fmap.feature_dim   # the window's sinks and ring, or LLN+Diag's block
        L = core.window or core.spec.diag_block
        assert slots.k.shape == slots.v.shape == (2, H_ // G, L, D) and slots.pos.shape == (L,)
        assert st.linear.S.shape == (2, H_, F, D) and st.linear.z.shape == (2, H_, F)
        if core.window:   # the last window tokens, each at p % window
            assert sorted(slots.pos.tolist()) == list(range(t + 1 - L, t + 1))
        else:             # the current block's tokens
            assert sorted(p for p in slots.pos.tolist() if p > t - (t + 1) % L) == \
                list(range(t + 1 - (t + 1) % L, t + 1))
            assert st.linear.n == t + 1
    assert rel_err(torch.cat(outs, 2), y) < 1e-5


def test_softmax_kv_cache_grows_by_doubling():
    """Issue 22: decoding appends into a preallocated KV cache that doubles when full, instead of copying the
    whole cache at every token (torch.cat); decode == parallel, and state_nbytes counts the capacity held."""
    q, k, v = qkv(T=40)
    core = Hy.Attention('softmax', D, H)
    y = core(q, k, v)
    _, st = core(q[:, :, :4], k[:, :, :4], v[:, :, :4], return_state=True)
    outs, moves = [y[:, :, :4]], 0
    for t in range(4, 40):
        ptr = st.k.data_ptr()
        yt, st = core(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state=st, return_state=True)
        outs.append(yt)
        moves += st.k.data_ptr() != ptr
        assert st.k.shape[2] >= t + 1 and st.n == t + 1
    assert moves == 4  # capacity 4 -> 8 -> 16 -> 32 -> 64
    assert rel_err(torch.cat(outs, 2), y) < 1e-5
    assert Hy.state_nbytes(st) == 2 * B * H * 64 * D * 4 + 8  # k and v, the whole capacity, float32; pos
    _, st = core(q[:, :, :30], k[:, :, :30], v[:, :, :30], return_state=True)
    y2, st = core(q[:, :, 30:], k[:, :, 30:], v[:, :, 30:], state=st, return_state=True)  # 10 tokens at once
    assert rel_err(y2, y[:, :, 30:]) < 1e-5 and st.k.shape[2] == 60


BRANCH_SPECS = ['softmax', 'elu', 'hedgehog:decay=4', 'hedgehog:window=4', 'hedgehog:window=4:sinks=2',
                'softmax:window=4', 'softmax:window=4:sinks=1', 'lln:diag_block=5', 'elu:window=4:exact=1',
                'hedgehog:window=4:cache=2:cache_block=3', 'lolcats:window=3:sinks=1:decay=8:exact=0+2',
                'hedgehog:delta=1:gate=1', 'lolcats:window=3:sinks=1:combine=mix:delta=1:gate=1:exact=0']


@pytest.mark.parametrize('spec', BRANCH_SPECS)
def test_branches_from_one_state_in_any_order(spec):
    """Issues 35, 52: a decode state is a value. From one state after 10 tokens, branch a runs 4, 1, 8 or 2 steps
    ahead, then branch b (other tokens) as far from the same state, then a again: each equals the full forward on its
    own tokens (before issue 52, b after a's first steps was 0.4-0.9 off for the window, diag and exact-head specs)."""
    T0 = 10
    q, k, v = qkv(T=T0 + 8)
    alt = [torch.cat([x[:, :, :T0], torch.randn_like(x[:, :, T0:])], 2) for x in (q, k, v)]
    core = Hy.Attention(spec, D, H).eval()
    want = {'a': core(q, k, v)[:, :, T0:], 'b': core(*alt)[:, :, T0:]}
    _, st = core(q[:, :, :T0], k[:, :, :T0], v[:, :, :T0], return_state=True)

    def branch(name, steps):
        src, state, ys = (q, k, v) if name == 'a' else alt, st, []
        for t in range(T0, T0 + steps):
            y, state = core(*(x[:, :, t:t + 1] for x in src), state=state, return_state=True)
            ys.append(y)
        return torch.cat(ys, 2)
    for steps in (4, 1, 8, 2):
        for name in 'aba':
            assert rel_err(branch(name, steps), want[name][:, :, :steps]) < 1e-5, (steps, name)


def test_chunked_on_cuda_without_triton_runs_pytorch(monkeypatch):
    """Issue 35: impl='chunked' on CUDA tensors where triton is missing (PyTorch's Windows CUDA wheels) runs the
    PyTorch chunked path it names, instead of routing to the kernel and failing. CUDA tensors are faked here: a
    subclass that says is_cuda."""
    class FakeCuda(torch.Tensor):
        is_cuda = property(lambda self: True)
    monkeypatch.setattr(K, 'HAS_TRITON', False)
    q, k, v = qkv(T=21)
    phi_q, phi_k = A.FEATURE_MAPS['elu'](D, H)(q, k)
    want = A.linear_attention(phi_q, phi_k, v, impl='quadratic')
    got = A.linear_attention(*(x.as_subclass(FakeCuda) for x in (phi_q, phi_k, v)), impl='chunked')
    assert v.as_subclass(FakeCuda).is_cuda and rel_err(got.as_subclass(torch.Tensor), want) < 1e-5
    with pytest.raises(A.UsageError, match="impl='triton' needs"):   # asked for by name: a clear error
        A.linear_attention(*(x.as_subclass(FakeCuda) for x in (phi_q, phi_k, v)), impl='triton')


@pytest.mark.parametrize('spec', ['lolcats:window=4:exact=1', 'softmax:window=4:sinks=1:exact=0', 'hedgehog:exact=2',
                                  'lolcats:window=3:cache=2:cache_block=3:exact=0+2', 'lln:diag_block=4:exact=1'])
def test_exact_heads(spec):
    """Issue 36: KV heads kept exact (spec exact=) run softmax over every key for their query heads, as a softmax core
    on those heads alone computes in float64; the other heads are the core without them (the same maps); decoding
    equals the parallel form; the state holds a KV cache of the exact heads only, beside the rest's own state."""
    g, Hq, T = 2, 6, 23   # 3 KV heads of 2 query heads each
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, Hq, T, D, generator=gen)
    k, v = (torch.randn(2, Hq // g, T, D, generator=gen).repeat_interleave(g, 1) for _ in range(2))
    core = Hy.Attention(spec, D, Hq, kv_groups=g).eval()
    exact = [int(h) for h in A.AttnSpec.parse(spec).exact.split('+')]
    e = [h for h in range(Hq) if h // g in exact]
    r = [h for h in range(Hq) if h not in e]
    y = core(q, k, v)
    ref = A.softmax_attention(q[:, e].double(), k[:, e].double(), v[:, e].double())
    assert rel_err(y[:, e], ref) < 1e-6
    rest = Hy.Attention(dataclasses.replace(A.AttnSpec.parse(spec), exact=''), D, len(r), kv_groups=g).eval()
    rest.load_state_dict(core.state_dict())
    assert rel_err(y[:, r], rest(q[:, r], k[:, r], v[:, r])) < 1e-6
    _, st = core(q[:, :, :9], k[:, :, :9], v[:, :, :9], return_state=True)
    outs = [y[:, :, :9]]
    for t in range(9, T):
        yt, st = core(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state=st, return_state=True)
        outs.append(yt)
    assert rel_err(torch.cat(outs, 2), y) < 1e-5
    assert st.exact.n == T and st.exact.k.shape[:2] == (2, len(exact))
    kv = 2 * st.exact.k.numel() * 4 + 8   # k and v, the whole capacity, float32; its position (int64)
    assert Hy.state_nbytes(st) == kv + Hy.state_nbytes(st.rest) and Hy.state_nbytes(st.rest) > 0
    every = Hy.Attention(dataclasses.replace(A.AttnSpec.parse(spec), exact='0+1+2'), D, Hq, kv_groups=g)
    assert every.mode == 'softmax' and every.fmap is None and not list(every.parameters())   # the layer is softmax
    assert rel_err(every(q, k, v), A.softmax_attention(q.double(), k.double(), v.double())) < 1e-6


def decayed_recurrence(core, q, k, v):
    """Spec decay, written out in float64: S_t = lambda S_t-1 + phi(k_t) v_t^T, z_t = lambda z_t-1 + phi(k_t),
    y_t = phi(q_t) S_t / phi(q_t) z_t, lambda = exp(-exp(decay_rate)) per head, phi the map's exact features."""
    fm = copy.deepcopy(core.fmap).double()
    pq, pk = fm.phi(q.double(), 'q', 0), fm.phi(k.double(), 'k', 0)
    lam = torch.exp(-torch.exp(core.decay_rate.detach().double()))[:, None, None]   # (H, 1, 1)
    S, z = pq.new_zeros(*pq.shape[:2], pq.shape[-1], v.shape[-1]), pq.new_zeros(*pq.shape[:2], pq.shape[-1])
    ys = []
    for t in range(q.shape[2]):
        S = lam * S + pk[:, :, t, :, None] * v.double()[:, :, t, None, :]
        z = lam[..., 0] * z + pk[:, :, t]
        ys.append((pq[:, :, t, None] @ S)[:, :, 0] / (pq[:, :, t] * z).sum(-1, keepdim=True))
    return torch.stack(ys, 2)


@pytest.mark.parametrize('name', ['elu', 'hedgehog', 'exp'])
@pytest.mark.parametrize('impl', PATHS)
def test_decay_is_the_decayed_recurrence(name, impl):
    """Issue 41: spec decay=N decays the linear state, lambda = exp(-g) per head (g = ln 2 / N at init, trained);
    every path equals the recurrence in float64, and decoding from a prefill equals the parallel form."""
    q, k, v = qkv(T=37)
    core = core_of(name, impl=impl, decay=8, chunk_size=8)
    with torch.no_grad():
        core.decay_rate.copy_(torch.tensor([0.05, 0.3, 1.5]).log())   # half-lives of about 14, 2.3, 0.5 tokens
    y = core(q, k, v)
    assert rel_err(y.double(), decayed_recurrence(core, q, k, v)) < 1e-5
    _, st = core(q[:, :, :20], k[:, :, :20], v[:, :, :20], return_state=True)
    outs = []
    for t in range(20, 37):
        yt, st = core(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state=st, return_state=True)
        outs.append(yt)
    assert rel_err(torch.cat(outs, 2), y[:, :, 20:]) < 1e-5


@pytest.mark.parametrize('spec', ['hedgehog:window=4:decay=8', 'hedgehog:window=4:decay=8:combine=mix',
                                  'exp:window=3:sinks=1:decay=4', 'lln:diag_block=5:decay=8'])
def test_decay_in_the_hybrids_decodes_as_it_runs_in_parallel(spec):
    """Issue 41: the hybrids with a decaying linear part: token-by-token decoding from a prefill equals the parallel
    form (the decay as shifts of keys by +g s and queries by -g t, positions on the device in steps)."""
    q, k, v = qkv(T=29)
    core = Hy.Attention(spec, D, H).eval()
    with torch.no_grad():
        core.decay_rate.copy_(torch.tensor([0.05, 0.3, 1.5]).log())
    y = core(q, k, v)
    _, st = core(q[:, :, :11], k[:, :, :11], v[:, :, :11], return_state=True)
    outs = []
    for t in range(11, 29):
        yt, st = core(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state=st, return_state=True)
        outs.append(yt)
    assert rel_err(torch.cat(outs, 2), y[:, :, 11:]) < 1e-5


def _rope(x, start, inv_freq):
    """x (B, H, T, D) rotated by RoPE at positions start..start+T-1, written from its definition: each pair
    (x_i, x_(i + D/2)) turned by the angle t * inv_freq_i."""
    angle = (torch.arange(start, start + x.shape[2]).double()[:, None] * inv_freq.double())   # (T, D/2)
    x1, x2 = x.double().chunk(2, -1)
    cos, sin = angle.cos(), angle.sin()
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).float()


@pytest.mark.parametrize('impl', PATHS)
def test_nope_maps_see_q_and_k_before_rope(impl):
    """Issue 41: with nope=1 the linear part's maps get q and k with RoPE undone. On q, k rotated at positions from
    any start, the core equals the same core without nope on the unrotated q, k (its weights, hence, do not depend on
    the position), a prefill and its decode steps included."""
    q, k, v = qkv(T=29)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
    core = Hy.Attention(f'hedgehog:nope=1:impl={impl}', D, H, rope_inv_freq=inv_freq)
    plain = Hy.Attention(f'hedgehog:impl={impl}', D, H)
    plain.load_state_dict(core.state_dict())
    want = plain(q, k, v)
    for start in (0, 3000):
        qr, kr = _rope(q, start, inv_freq), _rope(k, start, inv_freq)
        _, st = core(qr[:, :, :1], kr[:, :, :1], v[:, :, :1], return_state=True)
        st = dataclasses.replace(st, n=start, pos=None)   # a state of `start` tokens with these pairs only
        y, st = core(qr, kr, v, state=dataclasses.replace(st, S=st.S * 0, z=st.z * 0), return_state=True)
        assert rel_err(y, want) < 1e-5
    with pytest.raises(A.UsageError, match='nope undoes RoPE'):
        Hy.Attention('hedgehog:nope=1', D, H)


def test_nope_calibration_sees_q_and_k_before_rope():
    """LLN's moments under nope=1 are those of the q, k its maps see: calibrated on rotated q, k, equal to a core
    without nope calibrated on the unrotated ones (q and k with a mean, which a rotation moves between coordinates)."""
    q, k, _ = qkv(T=29)
    q, k = q + torch.linspace(-2, 2, D), k + 1.5
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
    core = Hy.Attention('lln:nope=1', D, H, rope_inv_freq=inv_freq)
    plain = Hy.Attention('lln', D, H)
    core.calibrate(_rope(q, 0, inv_freq), _rope(k, 0, inv_freq))
    plain.calibrate(q, k)
    for name in ('sigma2_q', 'sigma2_k'):
        assert rel_err(getattr(core.fmap, name), getattr(plain.fmap, name)) < 1e-5
    for bad in ('hedgehog:nope=2', 'softmax:nope=1'):
        with pytest.raises(A.UsageError, match='nope'):
            A.AttnSpec.parse(bad)


@pytest.mark.parametrize('spec', ['hedgehog:decay=16', 'hedgehog:window=8:decay=16', 'lolcats:window=8:sinks=2:decay=16'])
def test_decay_float32_error_flat_in_position(spec):
    """Issue 52: a decay's shifts are positions, g t; made in float32 their error followed float32's spacing at g t
    (3.3e-4 at 64K tokens, half-life 16, against 2.9e-6 in the first 1K); in float64 it is flat: float32 against the
    same core in float64 within 2e-6 over the first and the last 1K of 64K tokens, and in the steps
    after. (The float64 copy makes g = exp(decay_rate) as every path does, in float32: issue 61.)"""
    T, g = 65536, torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, T + 3, 8, generator=g) for _ in range(3))
    core = Hy.Attention(spec, 8, 2).eval()
    ref = copy.deepcopy(core).double()
    with torch.no_grad():
        (y, st), (y64, st64) = (c(*(x[:, :, :T].to(dt) for x in (q, k, v)), return_state=True)
                                for c, dt in ((core, torch.float32), (ref, torch.float64)))
        err = ((y.double() - y64).abs().amax(-1) / y64.abs().amax(-1)).amax((0, 1))   # (T,) per position
        assert err[:1024].max() < 2e-6 and err[-1024:].max() < 2e-6
        for t in range(T, T + 3):
            y, st = core(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state=st, return_state=True)
            y64, st64 = ref(*(x[:, :, t:t + 1].double() for x in (q, k, v)), state=st64, return_state=True)
            assert rel_err(y.double(), y64) < 2e-6


@pytest.mark.parametrize('spec,D,why', [
    ('lolcats:window=64', 128, r"its tiles \(256 features, 64 slots .* 128\) exceed the 8,192 .*"),
    ('lolcats:window=200', 64, r"its tiles \(128 features, 200 slots .* 64\) exceed the 8,192 .*"),
    ('lolcats:window=8:cache=32', 64, r"LoLA's cache \(cache=\) has none"),
    ('softmax:window=64', 64, r"a window without a map \(softmax\) has none"),
    ('cosformer:window=4', 64, r"it takes a hedgehog or lolcats map with softmax or exp features"),
    ('lolcats:window=1', 64, r"it takes a window of 2 or more")])
def test_impl_triton_refusal_names_the_reason(spec, D, why):
    """Issue 61: a window spec whose decode step cannot run fused is refused with impl=triton in
    one line naming the reason that applies (it named the map and the window whatever the reason:
    the tile size for Llama 3 8B's head size 128 at window 64, LoLA's cache, a window without a
    map); the same spec at head size 64 with a window of 64 fuses."""
    with pytest.raises(A.UsageError, match=f"impl=triton runs the window's decode step fused, and "
                                           f"{why}: use impl=chunked$"):
        Hy.Attention(f'{spec}:impl=triton', D, 2)
    assert Hy.Attention('lolcats:window=64:impl=triton', 64, 2).fusable
