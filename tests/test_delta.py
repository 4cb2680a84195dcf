"""Issue 63: the delta rule (spec delta=1, gate=1; attention.py section 4b). Its three forms (the recurrent reference,
the chunked WY form, the one-token step) against an independent float64 recurrence written here with matrices, a
hand-computed overwrite, the layer (decode equals the parallel form; branches: tests/test_attention.py's
BRANCH_SPECS, CUDA-graph replay and the meta device: tests/test_model.py's STEP_SPECS) and the spec's refusals."""
import pytest
import torch
import torch.nn.functional as nnf

import attention as A
import hybrids as Hy

B, H, F, D = 2, 3, 5, 4


def inputs(T, dtype=torch.float64, seed=0):
    """Unit-norm q, k (B, H, T, F), v (B, H, T, D), gates (B, H, T, 2) = (beta in (0, 1), log alpha <= 0), S0."""
    g = torch.Generator().manual_seed(seed)
    q, k = (nnf.normalize(torch.randn(B, H, T, F, generator=g, dtype=dtype), dim=-1) for _ in range(2))
    v = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    gates = torch.stack([torch.rand(B, H, T, generator=g, dtype=dtype),
                         -0.5 * torch.rand(B, H, T, generator=g, dtype=dtype)], -1)
    return q, k, v, gates, torch.randn(B, H, F, D, generator=g, dtype=dtype)


def reference(q, k, v, gates, S):
    """Gated DeltaNet's recurrence as its paper writes it, S_t = alpha_t (I - beta_t k_t k_t^T) S_t-1 + beta_t k_t v_t^T
    (this file's layout: S is F x D), y_t = S_t^T q_t, in float64 matrices, one token at a time."""
    q, k, v, gates, S = (x.double() for x in (q, k, v, gates, S))
    eye = torch.eye(F, dtype=torch.float64)
    ys = []
    for t in range(q.shape[2]):
        kt = k[:, :, t, :, None]                                                  # (B, H, F, 1)
        beta, alpha = gates[:, :, t, 0, None, None], gates[:, :, t, 1, None, None].exp()
        S = alpha * (eye - beta * kt @ kt.mT) @ S + beta * kt @ v[:, :, t, None, :]
        ys.append((q[:, :, t, None, :] @ S)[:, :, 0])
    return torch.stack(ys, 2), S


@pytest.mark.parametrize('impl,chunk', [('recurrent', 64), ('chunked', 4), ('chunked', 1), ('chunked', 64)])
@pytest.mark.parametrize('dtype,tol', [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_delta_forms_equal_a_float64_recurrence(impl, chunk, dtype, tol):
    """Both forms, 13 tokens (not a whole number of chunks of 4) after a random state: the outputs, the final state and
    every gradient (q, k, v, beta, log alpha, the state) within 1e-5 of the float64 recurrence in float32."""
    xs = [x.to(dtype).requires_grad_() for x in inputs(13)]
    x64 = [x.detach().double().requires_grad_() for x in xs]
    y, S = A.delta_rule(*xs[:4], impl, chunk, xs[4])
    y_ref, S_ref = reference(*x64)
    assert (y.double() - y_ref).abs().max() < tol and (S.double() - S_ref).abs().max() < tol
    w = torch.randn_like(y_ref)
    grads = torch.autograd.grad((y * w.to(dtype)).sum() + S.square().sum(), xs)
    grads_ref = torch.autograd.grad((y_ref * w).sum() + S_ref.square().sum(), x64)
    for name, g, g_ref in zip(('q', 'k', 'v', 'gates', 'S0'), grads, grads_ref):
        assert (g.double() - g_ref).abs().max() < tol * max(1.0, g_ref.abs().max().item()), name


def test_delta_step_is_the_recurrence_one_token_at_a_time():
    """delta_step, the decode step's write: 13 tokens one step each equal the recurrence's final state in float64."""
    q, k, v, gates, S = inputs(13)
    for t in range(13):
        S = A.delta_step(S, k[:, :, t], v[:, :, t], gates[:, :, t])
    assert (S - reference(q, k, v, gates, inputs(13)[4])[1]).abs().max() < 1e-12


def test_delta_overwrites_where_a_sum_adds():
    """By hand, one head, keys e1, e1, e2 with values a, b, c. beta = 1: e1 recalls b (the sum: a + b), e2 recalls c.
    beta = 1/2: e1 recalls a/2, then a/2 + (b - a/2)/2 = a/4 + b/2. A gate alpha = 1/2 on the third token halves what e1
    recalls."""
    e = torch.eye(2, dtype=torch.float64)
    a, b, c = (torch.tensor([x, -x], dtype=torch.float64) for x in (1.0, 3.0, 5.0))
    k = torch.stack([e[0], e[0], e[1]])[None, None]                                # (1, 1, 3, 2)
    v = torch.stack([a, b, c])[None, None]

    def recall(beta, log_alpha, key):   # what S^T key gives after the three writes
        gates = torch.tensor([[beta, 0.0], [beta, 0.0], [beta, log_alpha]], dtype=torch.float64)[None, None]
        y, _ = A.delta_rule(key.expand(1, 1, 3, 2), k, v, gates, 'chunked', 2)
        return y[0, 0, -1]
    torch.testing.assert_close(recall(1.0, 0.0, e[0]), b)
    torch.testing.assert_close(recall(1.0, 0.0, e[1]), c)
    torch.testing.assert_close(recall(0.5, 0.0, e[0]), a / 4 + b / 2)
    torch.testing.assert_close(recall(1.0, -torch.log(torch.tensor(2.0)).item(), e[0]), b / 2)
    sum_rule = A.linear_attention(e[0].expand(1, 1, 3, 2), k, v, impl='quadratic', eps=0.0)
    torch.testing.assert_close(sum_rule[0, 0, 1] * 2, a + b)   # the sum's normalised read: (a + b) / 2


def test_delta_gates_follow_the_papers_forms():
    """beta = sigmoid(w_b.k + b_b), log alpha = -softplus(w_a.k + b_a) (gate=1; 0 without), per head, from the
    parameters written out; at init beta 1/2 and alpha = exp(-dt), dt 0.001 .. 0.1 over the heads."""
    gates = A.DeltaGates(D, H, gate=1)
    k = torch.randn(B, H, 7, D)
    g0 = gates(k)
    torch.testing.assert_close(g0[..., 0], torch.full((B, H, 7), 0.5))
    torch.testing.assert_close(g0[0, :, 0, 1].exp(), torch.exp(-torch.tensor([0.001, 0.01, 0.1])))
    with torch.no_grad():
        for p in gates.parameters():
            p.normal_()
    w, b = gates.weight.double(), gates.bias.double()
    u = torch.einsum('bhtd,hgd->bhtg', k.double(), w) + b[:, None]
    want = torch.stack([torch.sigmoid(u[..., 0]), -nnf.softplus(u[..., 1])], -1)
    torch.testing.assert_close(gates(k).double(), want, atol=1e-6, rtol=1e-5)
    assert (A.DeltaGates(D, H, gate=0)(k)[..., 1] == 0).all()


SPECS = ['hedgehog:delta=1', 'hedgehog:delta=1:gate=1', 'exp:delta=1:impl=recurrent',
         'lolcats:window=4:combine=mix:delta=1:gate=1', 'lolcats:window=4:sinks=2:combine=mix:delta=1',
         'hedgehog:window=3:combine=mix:delta=1:gate=1:exact=1', 'lolcats:window=4:combine=mix:delta=1:nope=1']


@pytest.mark.parametrize('spec', SPECS)
def test_delta_decodes_as_its_parallel_form(spec):
    """The layer: a prefill of 9 tokens then one step a token, and a prefill of 5 then 18 tokens at once, equal the
    parallel form on all 23 (GQA: 2 query heads a KV head; the gates' parameters drawn away from their init); the
    gates train (a gradient reaches them)."""
    torch.manual_seed(0)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
    core = Hy.Attention(spec, D, 4, kv_groups=2, rope_inv_freq=inv_freq)
    with torch.no_grad():
        for p in core.parameters():
            p.add_(0.3 * torch.randn_like(p))
    q, k, v = torch.randn(3, B, 4, 23, D)
    k, v = (x[:, ::2].repeat_interleave(2, 1) for x in (k, v))
    y = core(q, k, v)
    y.square().sum().backward()
    assert core.gates.weight.grad.abs().sum() > 0
    with torch.no_grad():
        _, st = core(q[:, :, :9], k[:, :, :9], v[:, :, :9], return_state=True)
        steps = []
        for t in range(9, 23):
            y_t, st = core(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state=st, return_state=True)
            steps.append(y_t)
        _, st5 = core(q[:, :, :5], k[:, :, :5], v[:, :, :5], return_state=True)
        at_once, _ = core(q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], state=st5, return_state=True)
    torch.testing.assert_close(torch.cat(steps, 2), y[:, :, 9:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(at_once, y[:, :, 5:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('spec,why', [
    ('hedgehog:gate=1', 'gate with delta'), ('hedgehog:delta=2', 'delta and gate are 0 or 1'),
    ('softmax:delta=1', "delta is a feature map's linear part"), ('hedgehog:delta=1:decay=8', 'gate=1 is its decay'),
    ('hedgehog:delta=1:diag_block=4', 'no diag_block'), ('hedgehog:window=4:cache=8:combine=mix:delta=1', 'cache'),
    ('hedgehog:delta=1:impl=triton', 'impl chunked or'), ('hedgehog:window=4:delta=1', 'beside a window with combine=mix')])
def test_delta_spec_refusals(spec, why):
    with pytest.raises(A.UsageError, match=why):
        A.AttnSpec.parse(spec)


def test_delta_is_refused_in_a_bidirectional_layer():
    with pytest.raises(A.UsageError, match='a decay or the delta rule follows the tokens'):
        Hy.Attention('hedgehog:delta=1', D, H, causal=False)


def test_fidelity_kl_of_the_delta_rules_weights():
    """The delta rule's weights (its output for identity values) can be negative and need not sum to 1: the fidelity
    KL compares softmax with their positive part, renormalised (finite, where the plain formula gave nan); for a
    distribution it is the plain KL, written out here in float64."""
    torch.manual_seed(0)
    q, k = torch.randn(2, B, H, 16, D)
    w = Hy.Attention('hedgehog:delta=1', D, H).weights(q, k)
    p = A.softmax_weights(q, k)
    assert (w < 0).any() and torch.isfinite(A.kl_divergence(p, w)).all()
    assert torch.isfinite(A.attention_entropy(w)).all()   # (train.py's entropy column: nan before)
    wn = w.clamp_min(0) / w.clamp_min(0).sum(-1, keepdim=True)
    torch.testing.assert_close(A.kl_divergence(p, w), A.kl_divergence(p, wn))
    plain = (p.double() * ((p.double() + 1e-12).log() - (wn.double() + 1e-12).log())).sum(-1)   # (eps as in it)
    torch.testing.assert_close(A.kl_divergence(p, wn).double(), plain, atol=1e-4, rtol=1e-4)
