"""LoLA's sparse cache in the window hybrid (spec cache=N): lola_reference (here), the schedule token by token in
float64, which the parallel form and decoding both equal; the self-recall error against float64; the needle
kept; causality; the state's size; loading a conversion with a cache."""
import copy
import math

import pytest
import torch

import attention as A
import hybrids as Hy


@torch.no_grad()
def lola_reference(core, q, k, v):
    """The window hybrid with LoLA's cache written out token by token from sets of indices, in float64: what
    Attention computes for spec window=w, sinks=s, cache=N, cache_block=C. Query t's softmax part: the sinks (j < s),
    the cache G and the tokens p..t; its linear part: the folded pairs, with the exact kernel phi(q).phi(k). When the
    block p..p+C-1 has left the window (t - w >= p + C - 1), G and the block compete: per KV head, the mean over its
    query heads of ||S^T phi(k_j) / z^T phi(k_j) - v_j||^2 (S, z: sums over the folded pairs; 0 recalled where
    z^T phi(k_j) = 0); the N largest stay, the rest are folded, and p moves on by C. Attention runs the same schedule
    vectorised; this is sequential for clarity (and slow: tests and small checks)."""
    spec, g, H = core.spec, core.kv_groups, q.shape[1]
    w, ns, N, C = spec.window, spec.sinks, spec.cache, spec.cache_block
    q, k, v = q.double(), k.double(), v.double()
    fm = copy.deepcopy(core.fmap).double()
    pq, pk = fm.phi(q, 'q', 0), fm.phi(k, 'k', 0)   # the exact features
    f, (B, _, T, D) = core.factor().double(), q.shape
    G, folded = ([[[] for _ in range(H // g)] for _ in range(B)] for _ in range(2))
    y, p = torch.zeros_like(v), ns
    for t in range(T):
        if t - w >= p + C - 1:   # the pending block has left the window: the update
            for b in range(B):
                for hk in range(H // g):
                    cand, sre = G[b][hk] + list(range(p, p + C)), torch.zeros(len(G[b][hk]) + C, dtype=torch.float64)
                    for h in range(hk * g, hk * g + g):
                        S = sum((torch.outer(pk[b, h, j], v[b, h, j]) for j in folded[b][hk]), pk.new_zeros(pk.shape[-1], v.shape[-1]))
                        z = sum((pk[b, h, j] for j in folded[b][hk]), pk.new_zeros(pk.shape[-1]))
                        for i, j in enumerate(cand):
                            den = z @ pk[b, h, j]
                            recall = S.T @ pk[b, h, j] / den if den > 0 else torch.zeros_like(v[b, h, j])
                            sre[i] += ((recall - v[b, h, j]) ** 2).sum() / g
                    keep = set(sre.topk(min(N, len(cand))).indices.tolist())
                    G[b][hk] = sorted(cand[i] for i in keep)
                    folded[b][hk] += [cand[i] for i in range(len(cand)) if i not in keep]
            p += C
        for b in range(B):
            for h in range(H):
                soft, lin = list(range(min(ns, t + 1))) + G[b][h // g] + list(range(max(p, ns), t + 1)), folded[b][h // g]
                s = torch.stack([q[b, h, t] @ k[b, h, j] for j in soft]) / math.sqrt(D)
                a = torch.exp(s - s.max())   # the window part, unnormalised: exp(s - m), m the row's largest score
                if not lin:
                    y[b, h, t] = a @ v[b, h, soft] / a.sum()
                    continue
                kl = torch.stack([pq[b, h, t] @ pk[b, h, j] for j in lin])   # the linear part: phi(q).phi(k)
                if spec.combine == 'joint':   # one normalisation of gamma exp(s - m) and phi(q).phi(k)
                    y[b, h, t] = (f[h] * a @ v[b, h, soft] + kl @ v[b, h, lin]) / (f[h] * a.sum() + kl.sum())
                else:                         # mix: s y_window + (1 - s) y_linear
                    y[b, h, t] = f[h] * a @ v[b, h, soft] / a.sum() + (1 - f[h]) * kl @ v[b, h, lin] / kl.sum()
    return y



def make(spec, T=41, H=4, g=2, D=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, H, T, D, generator=gen)
    k, v = (torch.randn(2, H // g, T, D, generator=gen).repeat_interleave(g, 1) for _ in range(2))
    core = Hy.Attention(spec + ':cache_block=4', D, H, kv_groups=g).eval()
    with torch.no_grad():
        core.window_factor.copy_(torch.linspace(-1.0, 1.0, H))
        for p in core.fmap.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return core, q, k, v


@pytest.mark.parametrize('spec', ['hedgehog:window=5:cache=3', 'hedgehog:window=5:sinks=2:cache=3:combine=mix',
                                  'lolcats:window=3:sinks=1:cache=6', 'exp:window=4:cache=2'])
def test_parallel_and_decode_equal_the_naive_schedule(spec):
    core, q, k, v = make(spec)
    ref = lola_reference(core, q, k, v)
    y = core(q, k, v)
    assert ((y.double() - ref).abs().max() / ref.abs().max()) < 1e-5
    for prefill in (1, 9, 22):   # before, at and after updates
        yp, st = core(q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill], return_state=True)
        ys = [yp]
        for t in range(prefill, q.shape[2]):
            yt, st = core(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state=st, return_state=True)
            ys.append(yt)
        assert ((torch.cat(ys, 2).double() - ref).abs().max() / ref.abs().max()) < 1e-5, prefill


def test_self_recall_error_against_float64():
    """lola_select on a hand-sized case: two query heads sharing one KV head, a state of two folded pairs, three
    candidates, keep one. The scores in float64 from the definition; the kept pair is the worst recalled, the other two
    are folded into (S, z) exactly (shifts included: the state moves to the larger of m and their c)."""
    torch.manual_seed(0)
    phi = torch.rand(1, 2, 5, 3, dtype=torch.float64)   # five pairs' key features, per query head
    c = torch.tensor([[[0.5, -1.0, 2.0, 0.0, 1.0]] * 2], dtype=torch.float64)
    k, v = torch.randn(1, 1, 5, 4, dtype=torch.float64), torch.randn(1, 1, 5, 4, dtype=torch.float64)
    ex = phi * c.exp()[..., None]   # exact features
    S, z = ex[:, :, :2].transpose(-2, -1) @ v[:, :, :2].expand(1, 2, 2, 4), ex[:, :, :2].sum(2)   # pairs 0, 1 folded
    m = torch.zeros(1, 2, dtype=torch.float64)
    cand = Hy.Pairs(k[:, :, 2:], v[:, :, 2:], phi[:, :, 2:], c[:, :, 2:])
    keep, st = Hy.lola_select(Hy.LinearState(S, z, m, 2), cand, 1, 2)
    S2, z2, m2 = st.S, st.z, st.m
    assert st.n == 4   # two folded before, two now
    sre = [sum(((S[0, h].T @ phi[0, h, j] / (z[0, h] @ phi[0, h, j]) - v[0, 0, j]) ** 2).sum() for h in (0, 1)) / 2
           for j in (2, 3, 4)]
    worst = 2 + max(range(3), key=lambda i: sre[i])
    assert keep.tolist() == [[[worst - 2]]]
    rest = [j for j in (2, 3, 4) if j != worst]
    S_ref = S + ex[:, :, rest].transpose(-2, -1) @ v[:, :, rest].expand(1, 2, 2, 4)
    z_ref = z + ex[:, :, rest].sum(2)
    scale = m2.exp()[..., None]
    assert torch.allclose(S2 * scale[..., None], S_ref) and torch.allclose(z2 * scale, z_ref)
    assert (m2 == torch.maximum(torch.zeros(()), c[0, 0, rest].max())).all()


def test_the_cache_keeps_the_needle():
    """A haystack of two repeated pairs, which the state recalls well once folded, and one unique pair among them,
    which it cannot: the update keeps the needle in the cache, and the last query, asking for the needle's key, reads
    its value from the softmax part (mix form, s = 0.95); without the cache the needle is folded into the state."""
    D, T = 8, 60
    e = torch.eye(D)
    keys, vals = [4 * e[i % 2] for i in range(T)], [e[i % 2] for i in range(T)]
    keys[21], vals[21] = 4 * e[3], e[3]   # the needle, in the third block
    k, v = (torch.stack(x)[None, None] for x in (keys, vals))
    q = k.clone()
    q[0, 0, -1] = 4 * e[3]
    out = {}
    for spec in ('hedgehog:window=4:combine=mix', 'hedgehog:window=4:combine=mix:cache=2:cache_block=8'):
        core = Hy.Attention(spec, D, 1).eval()
        with torch.no_grad():
            core.window_factor.fill_(math.log(0.95 / 0.05))
        out[spec], st = core(q, k, v, return_state=True)
    assert any(torch.equal(x, 4 * e[3]) for x in st.cache.k[0, 0])   # in the cache
    assert out[spec][0, 0, -1, 3] > 0.8 and out['hedgehog:window=4:combine=mix'][0, 0, -1, 3] < 0.2


def test_cache_is_causal_and_its_state_periodic():
    core, q, k, v = make('hedgehog:window=5:sinks=1:cache=3', T=60)
    y = core(q, k, v)
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[:, :, 33:] = torch.randn_like(x[:, :, 33:]) * 3
    assert torch.equal(core(q2, k2, v2)[:, :, :33], y[:, :, :33])
    _, st = core(q[:, :, :2], k[:, :, :2], v[:, :, :2], return_state=True)
    sizes = []
    for t in range(2, 60):
        _, st = core(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state=st, return_state=True)
        sizes.append(Hy.state_nbytes(st))
    C = core.spec.cache_block   # once the cache is full, the state repeats every C tokens: it does not grow with T
    assert sizes[-C:] == sizes[-2 * C:-C] and max(sizes) == max(sizes[-C:])


def test_cache_errors():
    with pytest.raises(A.UsageError, match='causal models only'):
        Hy.Attention('hedgehog:window=4:cache=2', 8, 2, causal=False)
    for bad in ('hedgehog:cache=2', 'softmax:window=4:cache=2', 'hedgehog:window=4:cache=-1'):
        with pytest.raises(A.UsageError, match='cache'):
            A.AttnSpec.parse(bad)


def test_decode_period_is_the_specs_not_the_chunk_size():
    """Issue 35: LoLA's update period is the spec's cache_block (saved with the checkpoint), not the linear paths'
    chunk_size (a speed setting): changing chunk_size leaves a cache core's outputs as they are."""
    core, q, k, v = make('hedgehog:window=5:cache=3', T=41)
    y = core(q, k, v)
    core.chunk_size = 7
    assert torch.allclose(core(q, k, v), y, atol=1e-6)
    assert str(core.spec) == 'hedgehog:window=5:cache=3:cache_block=4'


def test_weights_with_a_cache_at_any_length():
    """Issue 35: Attention.weights (values: the T x T identity) of a cache core for T != head_dim; each row is the
    core's output for one-hot values, so the rows equal lola_reference's."""
    core, q, k, v = make('hedgehog:window=4:sinks=1:cache=2', T=16)
    w = core.weights(q, k)
    assert w.shape == (2, 4, 16, 16)
    eye = torch.eye(16).expand(2, 4, 16, 16)
    assert torch.allclose(w.double(), lola_reference(core, q, k, eye), atol=1e-6)
    assert torch.allclose(w.sum(-1), torch.ones(2, 4, 16), atol=1e-5)
