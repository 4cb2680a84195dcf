"""Tests for convert.py's DoF feature-dimension selection (Nishikawa et al. 2025, Sec. 3, Algorithm 1, DoF + Clip
of Sec. 4.2): the Gram matrix / J and its degrees of freedom on hand examples, their convergence in J, the
allocation with and without the clip.  Tiny, CPU, no transformers."""
import math

import pytest
import torch

import convert as C


# ---------------------------------------------------------------------------------------------------
# degrees of freedom

def test_degrees_of_freedom_known_spectrum():
    G = torch.diag(torch.tensor([3.0, 1.0, 0.0, 0.0], dtype=torch.float64))
    assert C.degrees_of_freedom(G, 1.0) == pytest.approx(3 / 4 + 1 / 2)
    # a rotated copy has the same eigenvalues
    Q, _ = torch.linalg.qr(torch.randn(4, 4, dtype=torch.float64))
    assert C.degrees_of_freedom(Q @ G @ Q.T, 1.0) == pytest.approx(1.25, abs=1e-9)
    # smaller lambda -> more degrees of freedom; bounded by the rank
    assert C.degrees_of_freedom(G, 1e-6) == pytest.approx(2.0, abs=1e-5)
    with pytest.raises(ValueError):
        C.degrees_of_freedom(G, 0.0)


def test_gram_and_dof_on_a_hand_example():
    # two points x1 = (1, 0), x2 = (1, 1) in d = 2: K = exp(x.y / sqrt 2), Gram [K(x_i, x_j)] divided by J = 2
    a, b, c = math.exp(1 / math.sqrt(2)), math.exp(1 / math.sqrt(2)), math.exp(2 / math.sqrt(2))
    x = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    G = C.exp_gram(x)
    assert torch.allclose(G, torch.tensor([[a, b], [b, c]], dtype=torch.float64) / 2, rtol=1e-12, atol=0)
    # eigenvalues of [[a, b], [b, c]] / 2 in closed form
    m, r = (a + c) / 2, math.sqrt(((a - c) / 2) ** 2 + b * b)
    lam = 2 ** -4  # the paper's lambda for GPT-2 (and our default)
    want = sum(s / 2 / (s / 2 + lam) for s in (m + r, m - r))
    assert C.degrees_of_freedom(G, lam) == pytest.approx(want, rel=1e-12)
    # head_dofs with J = 2 on one query and one key draws both points (the paper's pooled sampling)
    q, k = x[:1][None], x[1:][None]  # (H=1, M=1, D=2)
    assert C.DOF_LAMBDA_GPT2 == lam
    assert C.head_dofs(q, k, lam, n_samples=2)[0] == pytest.approx(want, rel=1e-12)
    assert C.select_feature_dims({0: (q, k)}, budget=4, n_samples=2, verbose=False)[1][0]['dof_max'] == \
        pytest.approx(want, abs=1e-3)


def test_dof_converges_as_j_doubles():
    """Gaussian queries and keys of small norm (std 0.4, d = 8): exp(x.y/sqrt d) = sum_n (x.y/sqrt d)^n / n!
    with x.y/sqrt d ~ 0.06, so the integral operator's eigenvalues fall like 0.06^n / n! per degree n and only
    a few exceed lambda: the DoF of S/J settles as J grows.  The undivided S (Algorithm 1's matrix) has
    eigenvalues J times larger, so its DoF at lambda, the divided one at lambda / J, keeps growing."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 512, 8, generator=g) * 0.4  # (H=1, M=512, D=8) each: 1024 pooled points
    lam = 1e-2
    div = {J: C.head_dofs(q, k, lam, J, torch.Generator().manual_seed(1))[0] for J in (256, 512)}
    assert 5 < div[256] < 50 and div[512] == pytest.approx(div[256], rel=0.1)
    und = {}
    for J in (256, 512):  # the same draws as head_dofs, Gram not divided
        x = torch.cat([q[0], k[0]])[torch.randperm(1024, generator=torch.Generator().manual_seed(1))[:J]]
        S = torch.exp(x.double() @ x.double().T / math.sqrt(8))
        assert torch.allclose(C.exp_gram(x) * J, S, rtol=1e-12, atol=0)
        und[J] = C.degrees_of_freedom(S, lam)
        assert C.degrees_of_freedom(S, J * lam) == pytest.approx(div[J], rel=1e-9)  # undivided at J lambda
    assert und[512] > 1.3 * und[256] and und[256] > 3 * div[256]


def test_head_dofs_sampling():
    torch.manual_seed(0)
    q, k = torch.randn(3, 30, 8), torch.randn(3, 30, 8)
    # J = 2M takes every query and key
    full = [C.degrees_of_freedom(C.exp_gram(torch.cat([q[h], k[h]])), 0.1) for h in range(3)]
    assert C.head_dofs(q, k, 0.1, 60) == pytest.approx(full, rel=1e-9)
    d = C.head_dofs(q, k, 1e-3, 16, torch.Generator().manual_seed(0))  # bounded by J
    assert len(d) == 3 and all(0 < v <= 16 for v in d)
    # nearly collinear queries/keys have far fewer degrees of freedom than spread ones
    lowrank = torch.randn(1, 300, 1) * torch.randn(1, 1, 8) * 0.3
    spread = torch.randn(1, 300, 8)
    assert C.head_dofs(lowrank, lowrank, 2 ** -4, 64)[0] < C.head_dofs(spread, spread, 2 ** -4, 64)[0]


# ---------------------------------------------------------------------------------------------------
# allocation (Algorithm 1's last line) and DoF + Clip

@pytest.mark.parametrize('dofs,budget,min_dim', [
    ([1.0, 2.0, 3.0, 4.0], 8, 1),
    ([1.0, 2.0, 3.0, 40.0], 8, 1),
    ([0.1, 0.1, 50.0, 50.0], 8, 2),
    ([5.0, 5.0, 5.0], 7, 2),
    ([0.5, 30.0, 2.0, 7.0, 1.0, 1.0], 12, 2),
])
def test_allocate_dims_mean_equals_budget(dofs, budget, min_dim):
    dims = C.allocate_dims(dofs, budget, min_dim=min_dim)
    assert sum(dims) / len(dims) == budget
    assert all(d >= min_dim for d in dims)
    order = sorted(range(len(dofs)), key=lambda i: dofs[i])  # monotone in the degrees of freedom
    assert [dims[i] for i in order] == sorted(dims)


def test_allocate_dims_hand_example_and_min_dim():
    # shares 32 * [1, 2, 3, 40] / 46 = [0.70, 1.39, 2.09, 27.83]: the first is raised to min_dim 1, the
    # others share 31 -> [1.38, 2.07, 27.56] -> floors [1, 2, 27] + the largest remainder to the last
    assert C.allocate_dims([1.0, 2.0, 3.0, 40.0], 8) == [1, 1, 2, 28]
    assert C.allocate_dims([0.1, 0.1, 50.0, 50.0], 8, min_dim=2) == [2, 2, 14, 14]
    assert C.allocate_dims([0.0, 0.0], 3) == [3, 3]  # zero DoF everywhere: equal shares


def test_dof_clip_lowers_the_mean_cost():
    """DoF + Clip (paper Sec. 4.2): the unclipped allocation at mean C, then clamped; nothing redistributed."""
    dofs = [1.0, 2.0, 3.0, 40.0]
    assert C.allocate_dims(dofs, 8, clip=16) == [1, 1, 2, 16]  # mean 5 < 8
    # a clip that no layer exceeds changes nothing
    free = C.allocate_dims([1.0, 2.0, 3.0, 4.0], 8, min_dim=2)
    assert C.allocate_dims([1.0, 2.0, 3.0, 4.0], 8, clip=max(free), min_dim=2) == free
    # the paper's setting, C = clip = head size: not the fixed allocation, and cheaper
    dims = C.allocate_dims([10.0, 1.0, 1.0, 1.0], 64, clip=64, min_dim=2)
    assert dims[0] == 64 and sum(dims) / 4 < 64 and dims != [64] * 4
    assert dims[1:] == C.allocate_dims([10.0, 1.0, 1.0, 1.0], 64, min_dim=2)[1:]
    assert C.allocate_dims([1.0, 2.0], 100, clip=8) == [8, 8]


@pytest.mark.parametrize('kwargs,message', [
    (dict(dofs=[1.0, 2.0], budget=0), 'budget must be > 0'),
    (dict(dofs=[1.0, -2.0], budget=4), 'finite and >= 0'),
    (dict(dofs=[1.0, float('nan')], budget=4), 'finite and >= 0'),
    (dict(dofs=[1.0, 2.0], budget=4, clip=1, min_dim=2), 'clip 1 is below min_dim 2'),
    (dict(dofs=[1.0, 2.0], budget=4, min_dim=0), 'min_dim must be >= 1'),
])
def test_allocate_dims_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        C.allocate_dims(**kwargs)


def test_select_feature_dims_table(capsys):
    torch.manual_seed(0)
    qk = {0: (torch.randn(2, 200, 8) * 0.2, torch.randn(2, 200, 8) * 0.2),
          1: (torch.randn(2, 200, 8) * 2, torch.randn(2, 200, 8) * 2)}
    dims, table = C.select_feature_dims(qk, budget=12, n_samples=64)
    out = capsys.readouterr().out
    assert 'max DoF' in out and 'mean feature_dim = 12 ' in out
    assert 'lambda=0.0625, J=64, G = exp(x_i.x_j/sqrt d) / J,' in out
    assert sum(dims.values()) / 2 == 12
    for r in table:
        assert all(0 < d <= 64 for d in r['dof_heads'])
        assert r['dof_max'] == max(r['dof_heads']) and 'unclipped' not in r
    assert dims[1] > dims[0]  # larger q.k spread -> more degrees of freedom
    # DoF + Clip at 8: the larger layer is clamped, the table shows both and the mean cost falls below C
    dims_c, table_c = C.select_feature_dims(qk, budget=12, n_samples=64, clip=8, lam=1e-2)
    out = capsys.readouterr().out
    assert dims_c[1] == 8 and sum(dims_c.values()) / 2 < 12
    assert [r['unclipped'] for r in table_c] == C.allocate_dims([r['dof_max'] for r in table_c], 12, min_dim=2)
    assert 'DoF + Clip at 8' in out and '1 of 2 layers clipped at 8' in out
