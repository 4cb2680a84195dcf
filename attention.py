"""
Attention, softmax and linear, in one file.

The catalogue a reader studies:
  1. softmax attention, the reference (Vaswani et al. 2017)
  2. feature maps phi from four papers (Hedgehog, LoLCATs, Linear Log-Normal, Degrees of Freedom)
     and the baselines they compare with (1+ELU, ReLU, T2R, Performer, cosFormer, Taylor, exp)
  3. three ways to compute linear attention, which agree to float32 precision:
       quadratic  -- materialise phi(q) phi(k)^T, mask, normalise rows (teaching, distillation)
       chunked    -- intra-chunk quadratic + inter-chunk carried state, O(T) memory (training)
       recurrent  -- one token at a time from a state (S, z) (generation)
  4. two hybrids: sliding-window softmax + linear (LoLCATs) and block-diagonal softmax + linear (LLN+Diag)
  5. the per-layer attention core `Attention` that model.py calls, with a recurrent decode state
  6. metrics (entropy, spectral gap, monotonicity, KL) and distillation losses

Linear attention, for one head (Katharopoulos et al. 2020, Eq. 4-6):
    y_t = phi(q_t)^T S_t / (phi(q_t)^T z_t + eps),  S_t = sum_{s<=t} phi(k_s) v_s^T,  z_t = sum_{s<=t} phi(k_s)
The state S (F x D) and normaliser z (F) are accumulated in float32 whatever the input dtype, and every
feature map returns float32 features, so exp-based maps neither overflow in fp16 nor lose their tails in bf16.

Shapes: q, k, v are (B, H, T, D) = (batch, heads, time, head_dim); features are (B, H, T, F).
"""

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EPS = 1e-20  # the denominator's eps: y = num / (den + EPS), float32; it only guards 0 / 0 (see linear_attention)


def _acc(x):
    """x in its accumulation dtype: float32, or float64 when given float64 (for float64 reference checks)."""
    return x.double() if x.dtype == torch.float64 else x.float()


def _check_qk(q, k, head_dim=None, n_heads=None):
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"expected q and k of shape (B, H, T, D), got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share B, H and D")
    if head_dim is not None and q.shape[-1] != head_dim:
        raise ValueError(f"head_dim mismatch: the feature map was built for head_dim={head_dim}, "
                         f"got inputs with last dimension {q.shape[-1]}")
    if n_heads is not None and q.shape[1] != n_heads:
        raise ValueError(f"n_heads mismatch: the feature map was built for n_heads={n_heads}, "
                         f"got inputs with {q.shape[1]} heads (dim 1 of (B, H, T, D))")


# -----------------------------------------------------------------------------
# 1. softmax attention, the reference

def softmax_attention(q, k, v, causal=True, scale=None, attn_mask=None):
    """Exact softmax attention (Vaswani et al. 2017, Eq. 1): softmax(q k^T * scale) v, scale = 1/sqrt(D).
    attn_mask: optional bool mask broadcastable to (B, H, T_q, T_k), True = may attend (used instead of causal).
    k, v may have fewer heads than q (grouped-query attention: query head h uses key head h // (H / H_kv)).
    Uses PyTorch's scaled_dot_product_attention (flash / memory-efficient kernels where they apply)."""
    gqa = k.shape[1] != q.shape[1]
    if not gqa:
        _check_qk(q, k)
    elif q.shape[1] % k.shape[1] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)}: its heads must be a multiple of k's {tuple(k.shape)}, same D")
    if attn_mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal and q.shape[-2] > 1, scale=scale,
                                          enable_gqa=gqa)


def causal_mask(T_q, T_k, device=None):
    """(T_q, T_k) bool, True where query i (at absolute position T_k - T_q + i) may see key j."""
    offset = T_k - T_q
    i = torch.arange(T_q, device=device)[:, None] + offset
    j = torch.arange(T_k, device=device)[None, :]
    return j <= i


def softmax_weights(q, k, causal=True, scale=None):
    """The (B, H, T, T) matrix of softmax attention weights, in float32."""
    _check_qk(q, k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q.float() @ k.float().transpose(-2, -1)) * scale  # (B, H, T, T)
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float('-inf'))
    return torch.softmax(scores, dim=-1)


# -----------------------------------------------------------------------------
# 2. feature maps: phi_q, phi_k = fmap(q, k, offset) on (B, H, T, D) -> float32 (B, H, T, F)

class FeatureMap(nn.Module):
    """Base class. Takes queries and keys together (LLN treats them differently, cosFormer needs
    positions: `offset` is the absolute position of the first token). Subclasses set feature_dim and
    implement `phi(x, which, offset)` with which in {'q', 'k'} -- or, for the exp-based maps,
    `log_phi(x, which, offset)`, the log-features (phi = exp(log_phi)).

    Numerics of the exp-based maps (real LLM queries and keys are large: attention sinks): the query features
    come out divided by exp(c_q), c_q = the query's largest log-feature (per query, detached), so every query
    feature is <= 1 and phi(q).phi(k) cannot overflow. A positive per-query factor cancels exactly in the
    normalisation of linear attention; `features()` also returns c_q for the places that need the exact
    features (the window hybrid, the kernel L2 loss). Keys are not shifted: a per-key factor would change the
    kernel, and a per-sequence one would need future keys in a causal model. (shift_queries=False turns the
    query shift off.)"""

    log_domain = False   # True for maps that define log_phi

    def __init__(self, head_dim, n_heads):
        super().__init__()
        if head_dim < 1 or n_heads < 1:
            raise ValueError(f"head_dim and n_heads must be positive, got {head_dim}, {n_heads}")
        self.head_dim, self.n_heads = head_dim, n_heads
        self.feature_dim = head_dim
        self.shift_queries = True

    def forward(self, q, k, offset=0):
        """(phi_q, phi_k), float32 (B, H, T, F); phi_q up to a positive per-query factor (see the class doc)."""
        phi_q, phi_k, _ = self.features(q, k, offset)
        return phi_q, phi_k

    def features(self, q, k, offset=0):
        """(phi_q', phi_k, c_q) with the exact query features phi(q) = phi_q' * exp(c_q[..., None]);
        c_q (B, H, T) is 0 for maps that are not exp-based."""
        _check_qk(q, k, self.head_dim, self.n_heads)
        q, k = _acc(q), _acc(k)
        if not self.log_domain:
            phi_q = self.phi(q, 'q', offset)
            return phi_q, self.phi(k, 'k', offset), phi_q.new_zeros(phi_q.shape[:-1])
        u_q, u_k = self.log_phi(q, 'q', offset), self.log_phi(k, 'k', offset)
        c_q = u_q.amax(-1, keepdim=True).detach() if self.shift_queries else torch.zeros_like(u_q[..., :1])
        return torch.exp(u_q - c_q), torch.exp(u_k), c_q.squeeze(-1)

    def phi(self, x, which, offset):
        """Exact features of one side (no shift)."""
        return torch.exp(self.log_phi(_acc(x), which, offset))

    def extra_repr(self):
        return f"head_dim={self.head_dim}, n_heads={self.n_heads}, feature_dim={self.feature_dim}"


def _per_head_linear(x, weight, bias=None):
    """x (B, H, T, D) @ weight (H, F, D)^T + bias (H, F) -> (B, H, T, F): one Linear per head."""
    y = torch.einsum('bhtd,hfd->bhtf', x, weight.to(x.dtype))
    return y if bias is None else y + bias.to(x.dtype)[None, :, None, :]


class EluFeatureMap(FeatureMap):
    """1 + ELU(x) (Katharopoulos et al. 2020, Eq. 7); F = D; no scaling, no parameters."""

    def phi(self, x, which, offset):
        return F.elu(x) + 1


class ReluFeatureMap(FeatureMap):
    """ReLU(x) (Kasai et al. 2021; Qin et al. 2022 cosFormer without re-weighting); F = D, no parameters."""

    def phi(self, x, which, offset):
        return F.relu(x)


class T2RFeatureMap(FeatureMap):
    """ReLU(W x + b), trainable, shared by queries and keys (Kasai et al. 2021, T2R, Eq. 4).
    Per-head W (F x D), b (F); F = feature_dim (default D); init U(-1/sqrt(D), 1/sqrt(D)) like nn.Linear."""

    def __init__(self, head_dim, n_heads, feature_dim=None):
        super().__init__(head_dim, n_heads)
        self.feature_dim = feature_dim or head_dim
        bound = 1 / math.sqrt(head_dim)
        self.weight = nn.Parameter(torch.empty(n_heads, self.feature_dim, head_dim).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(n_heads, self.feature_dim).uniform_(-bound, bound))

    def phi(self, x, which, offset):
        return F.relu(_per_head_linear(x, self.weight, self.bias))


def _orthogonal_gaussian(n_heads, m, d, generator=None):
    """(n_heads, m, d) random features: blocks of d orthogonal rows (QR of a Gaussian, with the signs of R's
    diagonal folded into Q so the rotation is uniformly (Haar) distributed), each row rescaled
    to the norm of an independent N(0, I_d) vector, so every row is marginally N(0, I_d)
    (Choromanski et al. 2020, Sec. 2.4 orthogonal random features)."""
    rows = []
    for _ in range(n_heads):
        blocks = []
        for _ in range(math.ceil(m / d)):
            g = torch.randn(d, d, generator=generator)
            qmat, r = torch.linalg.qr(g)
            qmat = qmat * torch.sign(torch.diagonal(r))  # sign fix: makes Q Haar-distributed (else biased)
            blocks.append(qmat.T)
        w = torch.cat(blocks, 0)[:m]
        norms = torch.randn(m, d, generator=generator).norm(dim=1, keepdim=True)
        rows.append(w * norms)
    return torch.stack(rows)


class PerformerFeatureMap(FeatureMap):
    """FAVOR+ positive orthogonal random features (Choromanski et al. 2020, Lemma 1, Eq. 7):
    phi(x) = exp(w_m . x' - |x'|^2 / 2) / sqrt(M), x' = x * D^-1/4, w_m orthogonal N(0, I),
    so that E[phi(q) . phi(k)] = exp(q . k / sqrt(D)) exactly (unbiased). F = M = feature_dim (default 2D).
    Stabiliser (stabilize=True, the base class's query shift): the queries' per-token max exponent is
    subtracted, which cancels in the normalisation. Keys are not shifted (see FeatureMap).
    redraw_interval > 0 redraws the features every that many training-mode forward calls."""

    log_domain = True

    def __init__(self, head_dim, n_heads, feature_dim=None, stabilize=True, redraw_interval=0, seed=None):
        super().__init__(head_dim, n_heads)
        self.feature_dim = feature_dim or 2 * head_dim
        self.stabilize = self.shift_queries = bool(stabilize)
        self.redraw_interval = redraw_interval
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.register_buffer('omega', _orthogonal_gaussian(n_heads, self.feature_dim, head_dim, self.generator))
        self.calls = 0

    @torch.no_grad()
    def redraw(self):
        new = _orthogonal_gaussian(self.n_heads, self.feature_dim, self.head_dim, self.generator)
        self.omega.copy_(new.to(self.omega.device))

    def features(self, q, k, offset=0):
        if self.training and self.redraw_interval > 0:
            if self.calls > 0 and self.calls % self.redraw_interval == 0:
                self.redraw()
            self.calls += 1
        return super().features(q, k, offset)

    def log_phi(self, x, which, offset):
        x = x * self.head_dim ** -0.25
        u = _per_head_linear(x, self.omega) - 0.5 * (x * x).sum(-1, keepdim=True)  # (B, H, T, M)
        return u - 0.5 * math.log(self.feature_dim)


class CosformerFeatureMap(FeatureMap):
    """cosFormer (Qin et al. 2022, Eq. 9-11): phi(x_i) = [ReLU(x_i) cos(pi i / 2M), ReLU(x_i) sin(pi i / 2M)],
    so phi(q_i) . phi(k_j) = ReLU(q_i) . ReLU(k_j) cos(pi (i - j) / 2M). F = 2D.
    M = max_len is fixed (the model's context length), not the current length, so a token's output does not
    depend on how many tokens follow it; positions i = offset + t must stay below M."""

    def __init__(self, head_dim, n_heads, max_len=2048):
        super().__init__(head_dim, n_heads)
        self.feature_dim, self.max_len = 2 * head_dim, max_len

    def phi(self, x, which, offset):
        T = x.shape[-2]
        if offset + T > self.max_len:
            raise ValueError(f"cosformer: position {offset + T - 1} is beyond max_len={self.max_len}; "
                             f"build the map with a larger max_len (the model's block_size)")
        angle = math.pi / (2 * self.max_len) * torch.arange(offset, offset + T, device=x.device, dtype=x.dtype)
        x = F.relu(x)
        return torch.cat([x * angle.cos()[:, None], x * angle.sin()[:, None]], dim=-1)


class TaylorFeatureMap(FeatureMap):
    """2nd-order Taylor approximation of exp (Hedgehog Sec. 4.1; Based, Arora et al. 2024):
    phi(x) = [1, x / D^1/4, vec(x x^T) / (sqrt(2) sqrt(D))], so phi(q) . phi(k) = 1 + s + s^2 / 2
    with s = q . k / sqrt(D). F = 1 + D + D^2; no parameters."""

    def __init__(self, head_dim, n_heads):
        super().__init__(head_dim, n_heads)
        self.feature_dim = 1 + head_dim + head_dim ** 2

    def phi(self, x, which, offset):
        D = self.head_dim
        x2 = (x[..., :, None] * x[..., None, :]).flatten(-2) / math.sqrt(2 * D)
        return torch.cat([torch.ones_like(x[..., :1]), x * D ** -0.25, x2], dim=-1)


class ExpFeatureMap(FeatureMap):
    """exp(t x) elementwise with temperature t (Hedgehog Sec. 3.2: a map that is spiky but not monotonic
    in q . k, the control for Hedgehog's monotonic exp map); F = D, no parameters. Queries are shifted per
    token for numerical range (FeatureMap), which cancels."""

    log_domain = True

    def __init__(self, head_dim, n_heads, temperature=1.0):
        super().__init__(head_dim, n_heads)
        self.temperature = temperature

    def log_phi(self, x, which, offset):
        return self.temperature * x


class HedgehogFeatureMap(FeatureMap):
    """Hedgehog (Zhang et al. 2024, Eq. 3 and Eq. 6): u = W x + b, one trainable Linear(D, F/2) per head,
    initialised to the identity (W = I, b = 0), phi(x) = [exp(u), exp(-u)], F = feature_dim (default 2D).
    softmax_dim=True (the default, Eq. 5) uses [softmax(u), softmax(-u)] over the feature dimension: each
    token's features are normalised to sum to 1 per half, which keeps them in [0, 1] (numerically stable)
    and is part of the map's definition, not a shift that cancels. Queries and keys share the MLP.
    With softmax_dim=False the map is exp-based: queries get the per-token shift of FeatureMap."""

    def __init__(self, head_dim, n_heads, feature_dim=None, softmax_dim=True):
        super().__init__(head_dim, n_heads)
        self.feature_dim = feature_dim or 2 * head_dim
        if self.feature_dim % 2:
            raise ValueError(f"hedgehog feature_dim must be even ([f(u), f(-u)]), got {self.feature_dim}")
        self.softmax_dim = softmax_dim
        self.log_domain = not softmax_dim
        half = self.feature_dim // 2
        self.weight = nn.Parameter(torch.eye(half, head_dim).repeat(n_heads, 1, 1))  # (H, F/2, D)
        self.bias = nn.Parameter(torch.zeros(n_heads, half))

    def project(self, x):
        return _per_head_linear(x, self.weight, self.bias)

    def phi(self, x, which, offset):
        if self.log_domain:
            return super().phi(x, which, offset)
        u = self.project(x)
        return torch.cat([torch.softmax(u, dim=-1), torch.softmax(-u, dim=-1)], dim=-1)

    def log_phi(self, x, which, offset):
        u = self.project(x)
        return torch.cat([u, -u], dim=-1)


LOLCATS_ACTIVATIONS = ('softmax', 'exp', 'elu', 'relu')


class LolcatsFeatureMap(HedgehogFeatureMap):
    """LoLCATs (Zhang et al. 2025, Eq. 6 and the feature maps of its Table 1): phi(x) = f(u), u = x W + b + x,
    a per-head Linear(D, F') with a skip connection, W initialised to 0 and b = 0 (so the map starts from
    f(x)); with F' != D the skip connection uses the first min(D, F') coordinates. The activation f:
      'softmax' (default): [softmax(u), softmax(-u)] over the feature dimension, F = 2 F' (Hedgehog Eq. 5);
      'exp':  [exp(u), exp(-u)], F = 2 F' (Hedgehog Eq. 3; queries shifted per token, see FeatureMap);
      'elu':  1 + ELU(u), F = F' (Katharopoulos et al.);   'relu': ReLU(u), F = F'.
    F = feature_dim, default 2D for softmax/exp and D for elu/relu (as in the official code, which applies
    ELU/ReLU to u alone and softmax/exp to [u, -u]; unlike it we do not clamp the features at 1e-12 and do not
    shift keys: the exact exp map is used). softmax_dim=False is the older spelling of activation='exp'."""

    def __init__(self, head_dim, n_heads, feature_dim=None, softmax_dim=True, activation='softmax'):
        FeatureMap.__init__(self, head_dim, n_heads)
        if activation not in LOLCATS_ACTIVATIONS:
            raise ValueError(f"unknown lolcats activation {activation!r}; choose one of: "
                             f"{', '.join(LOLCATS_ACTIVATIONS)}")
        if not softmax_dim and activation == 'softmax':
            activation = 'exp'
        self.activation, self.softmax_dim = activation, activation == 'softmax'
        self.log_domain = activation == 'exp'
        pm = activation in ('softmax', 'exp')  # [f(u), f(-u)]
        self.feature_dim = feature_dim or (2 * head_dim if pm else head_dim)
        if pm and self.feature_dim % 2:
            raise ValueError(f"lolcats with activation {activation!r} needs an even feature_dim ([f(u), f(-u)]), "
                             f"got {self.feature_dim}")
        width = self.feature_dim // 2 if pm else self.feature_dim
        self.weight = nn.Parameter(torch.zeros(n_heads, width, head_dim))  # (H, F', D)
        self.bias = nn.Parameter(torch.zeros(n_heads, width))

    def project(self, x):
        width = self.weight.shape[1]
        skip = x[..., :width]
        if width > self.head_dim:
            skip = F.pad(skip, (0, width - self.head_dim))
        return _per_head_linear(x, self.weight, self.bias) + skip

    def phi(self, x, which, offset):
        if self.activation == 'elu':
            return F.elu(self.project(x)) + 1
        if self.activation == 'relu':
            return F.relu(self.project(x))
        return super().phi(x, which, offset)


LLN_MATCH = ('paper', 'kernel', 'entropy', 'none')


def _check_lln_match(match):
    if match not in LLN_MATCH:
        raise ValueError(f"unknown LLN match {match!r}; choose one of: {', '.join(LLN_MATCH)}")


def _lln_log_kernel(q, k, s2):
    """log(exp(a q) . exp(a k)) for all query-key pairs, a = sqrt(s2 / 2), so alpha^2 + beta^2 = s2 on unit q, k."""
    a = math.sqrt(s2 / 2)
    return (torch.exp(a * q) @ torch.exp(a * k).transpose(-2, -1)).log()


@functools.lru_cache(maxsize=None)
def lln_fit(head_dim, match='paper', n_tokens=256, reps=8, seed=0):
    """The constants (a, b) of LLN's linear variance model (Nahshan et al. 2023, Eq. 10 and App. A.7)
        sigma_lln^2 = a s~^2 + b,   s~^2 = alpha^2 sigma_q^2 + beta^2 sigma_k^2,
    a least-squares line through (s~^2, sigma_lln^2) measured on q, k ~ N(0, I_D), alpha = beta = sqrt(s~^2 / 2):
      'paper':  sigma_lln^2 = Var[log P_ij], P the LLN attention matrix (numerator over row denominator,
                bidirectional, n_tokens keys), on s~ in [1, 4] (s~^2 = 1, 2, ..., 16). Our reading of App. A.7
                (its text was not available to us): it reproduces the published D = 64 constants a = 0.1486,
                b = -0.3549 (hard-coded in LLN's code): we get a = 0.1482, b = -0.3600.
      'kernel': sigma_lln^2 = Var[log phi(q) . phi(k)], the numerator alone, on s~^2 in [2, 12] (11 points):
                this repository's earlier fit.
    Float64, fixed seed, cached per (head_dim, match)."""
    if match not in ('paper', 'kernel'):
        raise ValueError(f"lln_fit fits match='paper' or 'kernel', got {match!r}")
    grid = {'paper': torch.linspace(1.0, 16.0, 16, dtype=torch.float64),
            'kernel': torch.linspace(2.0, 12.0, 11, dtype=torch.float64)}[match]
    g = torch.Generator().manual_seed(seed)
    ys = []
    for s2 in grid.tolist():
        q = torch.randn(reps, n_tokens, head_dim, generator=g, dtype=torch.float64)
        k = torch.randn(reps, n_tokens, head_dim, generator=g, dtype=torch.float64)
        log_w = _lln_log_kernel(q, k, s2)
        if match == 'paper':
            log_w = log_w - log_w.logsumexp(-1, keepdim=True)  # log P = log numerator - log denominator
        ys.append(log_w.var().item())
    A = torch.stack([grid, torch.ones_like(grid)], dim=1)
    a, b = torch.linalg.lstsq(A, torch.tensor(ys, dtype=torch.float64)[:, None]).solution.squeeze(1).tolist()
    return a, b


def _mean_row_entropy(log_w):
    return -(log_w.exp() * log_w).sum(-1).mean().item()


@functools.lru_cache(maxsize=None)
def lln_entropy_fit(head_dim, n_tokens=256, reps=16, seed=0, s2_max=8.0, step=0.5):
    """match='entropy' (ours, not in the paper): for the softmax log-variance s^2 = sigma_q^2 sigma_k^2 on the grid
    0, 0.5, ..., 8, the s~^2 = alpha^2 sigma_q^2 + beta^2 sigma_k^2 at which LLN's mean row entropy equals softmax's
    (bidirectional, n_tokens keys, the same q, k ~ N(0, I_D) for every point, float64, fixed seed). LLN's entropy,
    tabulated on s~^2 = 0, 0.5, ... until it is below softmax's at s^2 = 8, falls monotonically and is inverted
    by linear interpolation. Returns (s^2 grid, s~^2 grid), float64; cached per head_dim. Made at n_tokens keys:
    at other sequence lengths the entropies match approximately (README, LLN Fig. 2)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(reps, n_tokens, head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(reps, n_tokens, head_dim, generator=g, dtype=torch.float64)
    s2_grid = torch.arange(0.0, s2_max + step / 2, step, dtype=torch.float64)
    dots = q @ k.transpose(-2, -1) / math.sqrt(head_dim)
    h_sm = torch.tensor([_mean_row_entropy(torch.log_softmax(math.sqrt(s2) * dots, -1)) for s2 in s2_grid.tolist()],
                        dtype=torch.float64)
    xs, h_lln = [0.0], [math.log(n_tokens)]  # s~^2 = 0: uniform weights
    while h_lln[-1] > h_sm[-1].item() and xs[-1] < 1000:
        xs.append(xs[-1] + step)
        log_w = _lln_log_kernel(q, k, xs[-1])
        h_lln.append(_mean_row_entropy(log_w - log_w.logsumexp(-1, keepdim=True)))
    h_lln = torch.tensor(h_lln, dtype=torch.float64)
    if not (h_lln[1:] < h_lln[:-1]).all() or h_lln[-1] > h_sm[-1]:
        raise RuntimeError(f"LLN's entropy is not monotone in s~^2, or never as low as softmax's at s^2 = {s2_max}, "
                           f"at head_dim={head_dim}, n_tokens={n_tokens}")
    return s2_grid, _interp(-h_sm, -h_lln, torch.tensor(xs, dtype=torch.float64))


def _interp(x, xp, fp):
    """Piecewise-linear interpolation of the points (xp, fp) at x, xp increasing; linear beyond both ends."""
    i = torch.searchsorted(xp, x).clamp(1, len(xp) - 1)
    x0, x1, f0, f1 = xp[i - 1], xp[i], fp[i - 1], fp[i]
    return f0 + (f1 - f0) * (x - x0) / (x1 - x0)


def lln_alpha_beta(sigma2_q, sigma2_k, head_dim, match='paper'):
    """LLN's temperatures alpha, beta (Nahshan et al. 2023, Eq. 10) from the query/key variances (tensors), with
    alpha s_q = beta s_k as in the paper, so s~^2 = alpha^2 s_q^2 + beta^2 s_k^2 fixes both:
        alpha = sqrt(s~^2 / 2) / s_q,  beta = sqrt(s~^2 / 2) / s_k.
    s~^2 from the softmax log-variance s^2 = s_q^2 s_k^2 (the variance of q . k / sqrt(D)):
      'paper', 'kernel': moment matching, a s~^2 + b = s^2 with (a, b) = lln_fit(head_dim, match);
      'entropy': LLN's mean row entropy equals softmax's on Gaussian inputs (lln_entropy_fit, interpolated;
                 linear beyond s^2 = 8);
      'none':    alpha = beta = 1 (LLN without moment matching).
    s~^2 / 2 is clamped at 1e-4 (the linear fits give s~^2 < 0 when s^2 < b)."""
    _check_lln_match(match)
    if match == 'none':
        return torch.ones_like(sigma2_q), torch.ones_like(sigma2_k)
    s2 = sigma2_q * sigma2_k
    if match == 'entropy':
        s2_grid, x_grid = lln_entropy_fit(head_dim)
        x = _interp(s2, s2_grid.to(s2), x_grid.to(s2))
    else:
        a, b = lln_fit(head_dim, match)
        x = (s2 - b) / a
    half = (x / 2).clamp_min(1e-4)
    return half.sqrt() / sigma2_q.sqrt(), half.sqrt() / sigma2_k.sqrt()


class LLNFeatureMap(FeatureMap):
    """Linear Log-Normal attention (Nahshan et al. 2023, Eq. 9-10): phi_q = exp(alpha q), phi_k = exp(beta k),
    alpha, beta per head from the query/key variances by `lln_alpha_beta(..., match)`: match='paper' (default,
    moment matching with the App. A.7 fit), 'kernel' (the numerator-only fit), 'entropy' (ours: LLN's row entropy
    equals softmax's on Gaussian inputs), 'none' (alpha = beta = 1). F = D; queries shifted per token (FeatureMap).
    Causal honesty: the official code takes sigma_q, sigma_k over the whole batch and sequence, so a token's
    features depend on future tokens. Here the variances are buffers (init 1.0, i.e. unit-variance inputs):
    set by `calibrate(q, k)`, and in training mode updated as an exponential moving average (momentum 0.1)
    AFTER each forward, so a forward only uses statistics of earlier batches; in eval mode they are frozen.
    No token's output can depend on later tokens of its own sequence."""

    def __init__(self, head_dim, n_heads, momentum=0.1, match='paper'):
        super().__init__(head_dim, n_heads)
        _check_lln_match(match)
        self.momentum, self.match = momentum, match
        self.register_buffer('sigma2_q', torch.ones(n_heads))
        self.register_buffer('sigma2_k', torch.ones(n_heads))

    @staticmethod
    def _head_var(x):
        return x.detach().float().transpose(0, 1).flatten(1).var(dim=1, unbiased=False)  # (H,)

    @torch.no_grad()
    def calibrate(self, q, k):
        """Freeze the statistics to those of calibration queries/keys (B, H, T, D)."""
        self.sigma2_q.copy_(self._head_var(q))
        self.sigma2_k.copy_(self._head_var(k))

    def alpha_beta(self):
        return lln_alpha_beta(self.sigma2_q.double(), self.sigma2_k.double(), self.head_dim, self.match)

    log_domain = True

    def log_phi(self, x, which, offset):
        alpha, beta = self.alpha_beta()
        return (alpha if which == 'q' else beta).to(x.dtype)[None, :, None, None] * x

    def features(self, q, k, offset=0):
        out = super().features(q, k, offset)
        if self.training:  # statistics of this batch are used from the next forward on (causal honesty)
            with torch.no_grad():
                m = self.momentum
                self.sigma2_q.lerp_(self._head_var(q).to(self.sigma2_q.dtype), m)
                self.sigma2_k.lerp_(self._head_var(k).to(self.sigma2_k.dtype), m)
        return out


class DoFFeatureMap(FeatureMap):
    """Learned weighted positive random features (Degrees-of-Freedom paper, Sec. 3, Eq. 8):
    phi(x)_m = sqrt(a_m / M) exp(z_m . x / D^1/4 - |x|^2 / (2 sqrt(D))), m = 1..M, per head;
    z_m init orthogonal N(0, I) rows (then trained), a_m = exp(log_a_m) > 0 with log_a init 0, so at init
    phi(q) . phi(k) is Performer's unbiased estimate of exp(q . k / sqrt(D)). M = feature_dim (default D),
    chosen per layer by convert.py's DoF selection. Queries shifted per token (FeatureMap), keys exact."""

    log_domain = True

    def __init__(self, head_dim, n_heads, feature_dim=None, seed=None):
        super().__init__(head_dim, n_heads)
        self.feature_dim = feature_dim or head_dim
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        self.z = nn.Parameter(_orthogonal_gaussian(n_heads, self.feature_dim, head_dim, g))
        self.log_a = nn.Parameter(torch.zeros(n_heads, self.feature_dim))

    def log_phi(self, x, which, offset):
        D, M = self.head_dim, self.feature_dim
        u = _per_head_linear(x, self.z) * D ** -0.25 - (x * x).sum(-1, keepdim=True) / (2 * math.sqrt(D))
        return u + 0.5 * self.log_a.to(x.dtype)[None, :, None, :] - 0.5 * math.log(M)


FEATURE_MAPS = {
    'elu': EluFeatureMap,
    'relu': ReluFeatureMap,
    't2r': T2RFeatureMap,
    'performer': PerformerFeatureMap,
    'cosformer': CosformerFeatureMap,
    'taylor': TaylorFeatureMap,
    'exp': ExpFeatureMap,
    'hedgehog': HedgehogFeatureMap,
    'lolcats': LolcatsFeatureMap,
    'lln': LLNFeatureMap,
    'dof': DoFFeatureMap,
}
ATTN_CHOICES = ['softmax'] + list(FEATURE_MAPS)
IMPLS = ('quadratic', 'chunked', 'recurrent')


def make_feature_map(name, head_dim, n_heads, **options):
    """FEATURE_MAPS[name](head_dim, n_heads, **options) with clear errors for unknown names/options."""
    if name not in FEATURE_MAPS:
        raise ValueError(f"unknown feature map {name!r}; choose one of: {', '.join(FEATURE_MAPS)}")
    try:
        return FEATURE_MAPS[name](head_dim=head_dim, n_heads=n_heads, **options)
    except TypeError as e:
        raise ValueError(f"bad options {options} for feature map {name!r}: {e}") from None


# -----------------------------------------------------------------------------
# 3. linear attention: quadratic, chunked, recurrent

def _check_linear_inputs(phi_q, phi_k, v, impl, initial_state):
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; choose one of: {', '.join(IMPLS)}")
    if phi_q.dim() != 4 or phi_k.shape != phi_q.shape:
        raise ValueError(f"phi_q {tuple(phi_q.shape)} and phi_k {tuple(phi_k.shape)} must both be (B, H, T, F)")
    if v.dim() != 4 or v.shape[:3] != phi_k.shape[:3]:
        raise ValueError(f"v {tuple(v.shape)} must be (B, H, T, D) with the B, H, T of phi_k {tuple(phi_k.shape)}")
    if initial_state is not None:
        S0, z0 = initial_state
        B, H, _, Fd = phi_k.shape
        if S0.shape != (B, H, Fd, v.shape[-1]) or z0.shape != (B, H, Fd):
            raise ValueError(f"initial_state must be (S (B, H, F, D), z (B, H, F)) = "
                             f"{(B, H, Fd, v.shape[-1])}, {(B, H, Fd)}; got {tuple(S0.shape)}, {tuple(z0.shape)}")


def _zero_state(phi_k, v):
    B, H, _, Fd = phi_k.shape
    return phi_k.new_zeros(B, H, Fd, v.shape[-1]), phi_k.new_zeros(B, H, Fd)


def linear_attention_parts(phi_q, phi_k, v, causal=True, impl='chunked', chunk_size=64, initial_state=None):
    """Unnormalised linear attention: (num (B, H, T, D) float32, den (B, H, T) float32, final state (S, z)).
    num_t = phi_q_t^T S_t, den_t = phi_q_t^T z_t, with S_t, z_t over s <= t (causal) or all s (bidirectional),
    starting from initial_state (S_0, z_0). The final state includes every token."""
    _check_linear_inputs(phi_q, phi_k, v, impl, initial_state)
    q, k, v = _acc(phi_q), _acc(phi_k), _acc(v)
    S0, z0 = initial_state if initial_state is not None else _zero_state(k, v)
    S0, z0 = S0.to(q.dtype), z0.to(q.dtype)

    if impl == 'recurrent':  # one token at a time: S += phi_k_t v_t^T, z += phi_k_t, read out phi_q_t
        S, z = S0, z0
        nums, dens = [], []
        for t in range(k.shape[-2]):
            S = S + k[:, :, t, :, None] * v[:, :, t, None, :]  # (B, H, F, D)
            z = z + k[:, :, t]  # (B, H, F)
            if causal:
                nums.append((q[:, :, t, :, None] * S).sum(-2))
                dens.append((q[:, :, t] * z).sum(-1))
        if not causal:  # bidirectional: read out once the whole sequence is in the state
            return q @ S, (q * z[:, :, None, :]).sum(-1), (S, z)
        return torch.stack(nums, 2), torch.stack(dens, 2), (S, z)

    if impl == 'quadratic' or not causal:
        S_all, z_all = S0 + k.transpose(-2, -1) @ v, z0 + k.sum(-2)  # (B, H, F, D), (B, H, F)
        if impl == 'chunked':  # chunked, bidirectional: one state over the whole sequence
            return q @ S_all, (q * z_all[:, :, None, :]).sum(-1), (S_all, z_all)
        A = q @ k.transpose(-2, -1)  # (B, H, T, T), A_ts = phi_q_t . phi_k_s
        if causal:
            A = A.tril()
        num = A @ v + q @ S0
        den = A.sum(-1) + (q * z0[:, :, None, :]).sum(-1)
        return num, den, (S_all, z_all)

    # chunked, causal: intra-chunk quadratic (masked) + inter-chunk state from a cumsum over chunks.
    # Memory O(T F D / C) for the per-chunk states instead of O(T F D) for a per-token cumsum.
    # The normaliser rides along as an extra value column of ones: [S | z] = sum phi_k [v | 1]^T.
    B, H, T, Fd = q.shape
    D, C = v.shape[-1], chunk_size
    n = math.ceil(T / C)
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], -1)  # (B, H, T, D + 1)
    pad = n * C - T
    if pad:  # zero features add nothing to the state, and padded rows are cut off below
        q, k, v1 = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v1))
    q, k, v1 = (t.view(B, H, n, C, t.shape[-1]) for t in (q, k, v1))  # (B, H, n, C, *)
    state = torch.cumsum(k.transpose(-2, -1) @ v1, dim=2)  # (B, H, n, F, D + 1) [S | z] after each chunk
    out = (q @ k.transpose(-2, -1)).tril() @ v1  # (B, H, n, C, D + 1) intra-chunk
    out[:, :, 1:] += q[:, :, 1:] @ state[:, :, :-1]  # inter-chunk: the state before chunk i is after i - 1
    Sz0 = torch.cat([S0, z0[..., None]], -1)  # (B, H, F, D + 1)
    if initial_state is not None:
        out = out + q @ Sz0[:, :, None]
    out = out.reshape(B, H, n * C, D + 1)[:, :, :T]
    final = Sz0 + state[:, :, -1]
    return out[..., :D], out[..., D], (final[..., :D], final[..., D])


def linear_attention(phi_q, phi_k, v, causal=True, impl='chunked', eps=EPS, chunk_size=64,
                     initial_state=None, return_state=False):
    """Normalised linear attention y_t = phi_q_t^T S_t / (phi_q_t^T z_t + eps) (Katharopoulos et al. 2020).
    phi_q, phi_k (B, H, T, F); v (B, H, T, D) -> y (B, H, T, D) in v's dtype; state, num, den in float32.
    impl: 'quadratic' | 'chunked' | 'recurrent'; causal=False is the bidirectional (encoder) form.
    initial_state=(S_0, z_0) continues a sequence; return_state=True also returns the final (S, z).
    On CUDA the causal chunked path runs kernels.py's Triton kernel when Triton is available and F <= 256,
    D <= 128."""
    if phi_q.is_cuda and causal and impl == 'chunked' and _triton_available():
        import kernels
        if kernels.supports(phi_q.shape[-1], v.shape[-1]):  # else (e.g. Taylor's F = 1 + D + D^2): PyTorch
            _check_linear_inputs(phi_q, phi_k, v, impl, initial_state)
            return kernels.triton_causal_linear_attention(phi_q, phi_k, v, eps=eps, initial_state=initial_state,
                                                          return_state=return_state)
    num, den, state = linear_attention_parts(phi_q, phi_k, v, causal, impl, chunk_size, initial_state)
    y = (num / (den[..., None] + eps)).to(v.dtype)
    return (y, state) if return_state else y


@functools.lru_cache(maxsize=None)
def _triton_available():
    try:
        import triton  # noqa: F401
        import kernels  # noqa: F401
        return hasattr(kernels, 'triton_causal_linear_attention')
    except ImportError:
        return False


def linear_attention_weights(phi_q, phi_k, causal=True, eps=EPS):
    """The (B, H, T, T) matrix of linear attention weights phi_q_t . phi_k_s / (sum_s' ... + eps)."""
    A = phi_q.float() @ phi_k.float().transpose(-2, -1)
    if causal:
        A = A.masked_fill(~causal_mask(A.shape[-2], A.shape[-1], A.device), 0.0)
    return A / (A.sum(-1, keepdim=True) + eps)


# -----------------------------------------------------------------------------
# 4. hybrids

def _band_blocks(x, w, pad_value=0.0):
    """(B, H, T, E) -> (B, H, n, 3w, E): for each block of w queries, the keys of the previous, current
    and next block (zero-padded at the ends), n = ceil(T / w)."""
    B, H, T, E = x.shape
    n = math.ceil(T / w)
    x = F.pad(x, (0, 0, w, (n + 1) * w - T), value=pad_value)  # (B, H, (n + 2) w, E)
    return torch.cat([x[:, :, i * w:(i + n) * w].reshape(B, H, n, w, E) for i in range(3)], dim=3)


WINDOW_COMBINES = ('joint', 'mix')


def combine_window_linear(num_w, den_w, m, num_l, den_l, c_q, factor, combine='joint'):
    """Combine the window (softmax) and linear parts of the sliding-window hybrid; every tensor is per query row:
    num_w (.., D), den_w (..) = sum_{j in W(i)} exp(s_ij - m_i) [num_w with v_j], m (..) the row's max window
    score, num_l (.., D), den_l (..) = the linear sums with the shifted query features phi_q' = phi_q exp(-c_q).
      joint (LoLCATs, ICLR 2025 version, Eq. 8, and its official code): one normalisation over both parts with
             window weights gamma exp(s_ij - m_i) and linear weights phi(q_i).phi(k_j):
             y = (gamma den_w y_w + E_l y_l) / (gamma den_w + E_l),  E_l = exp(c_q) den_l,  gamma = factor (H,).
             The row max m_i is NOT compensated in the linear term: every window weight is <= gamma, on the
             scale of the feature kernel, whatever the size of q.k (an exactly normalised softmax window would
             outweigh any bounded feature kernel by exp(m_i), e^20 and more with a real LLM's attention sinks).
      mix   (LoLCATs workshop paper, Eq. 8): two separately normalised attentions mixed by a learned
             s = factor (H,): y = s y_w + (1 - s) y_l.
    y_w = num_w / den_w, y_l = num_l / den_l. The two masses are compared in log space (exp(c_q) is never
    formed: no overflow). A row with no linear keys (den_l = 0: the first `window` tokens) is the window part
    alone; a row with no window keys (a padded query of a padded batch) is the linear part alone, 0 with neither.
    Returns (y float32, p) with p the weight of the window part, (..)."""
    has_w, has_l = den_w > 0, den_l > 0
    one = torch.ones_like(den_w)
    y_w = num_w / torch.where(has_w, den_w, one)[..., None]
    y_l = num_l / torch.where(has_l, den_l, one)[..., None]
    f = factor.to(den_w.dtype).view(1, -1, *([1] * (den_w.dim() - 2)))  # (1, H, 1...) against (B, H, ...)
    if combine == 'joint':
        log_w = torch.where(has_w, torch.log(f) + torch.log(torch.where(has_w, den_w, one)), 0 * one)
        log_l = torch.where(has_l, c_q + torch.log(torch.where(has_l, den_l, one)), 0 * one)
        p = torch.sigmoid(log_w - log_l)
    elif combine == 'mix':
        p = f.expand_as(den_w)
    else:
        raise ValueError(f"unknown window_combine {combine!r}; choose one of: {', '.join(WINDOW_COMBINES)}")
    p = torch.where(has_l, p, one)
    p = torch.where(has_w, p, 0 * one)
    return p[..., None] * y_w + (1 - p[..., None]) * y_l, p


def window_linear_attention(q, k, v, phi_q, phi_k, window, factor, causal=True, eps=EPS,
                            key_padding_mask=None, impl='chunked', chunk_size=64, return_weights=False,
                            c_q=None, combine='joint'):
    """Sliding-window softmax + linear attention (LoLCATs-w). Window W(i) = {i - window < j <= i} (causal) or
    {|i - j| < window} (bidirectional): softmax weights exp(q_i.k_j / sqrt D); the linear term covers
    j <= i - window (causal) or |i - j| >= window with phi(q_i).phi(k_j). The two parts are combined by
    `combine_window_linear` ('joint': one normalisation, window weights exp(s_ij - m_i) times gamma = factor;
    'mix': separately normalised, mixed with s = factor). phi_q may carry a per-query shift: exact phi(q) = phi_q exp(c_q)
    (c_q (B, H, T), default 0). Memory O(T window + T F D / chunk): the window part is computed in blocks of
    `window` queries against 2-3 blocks of keys, the linear part by shifting keys `window` steps."""
    B, H, T, D = q.shape
    w = window
    c_q = _acc(phi_q).new_zeros(B, H, T) if c_q is None else _acc(c_q)
    # the window (softmax) part, blockwise
    qb = F.pad(_acc(q), (0, 0, 0, math.ceil(T / w) * w - T)).reshape(B, H, -1, w, D)  # (B, H, n, w, D)
    kb, vb = _band_blocks(_acc(k), w), _band_blocks(_acc(v), w)  # (B, H, n, 3w, D)
    n = qb.shape[2]
    i = torch.arange(n, device=q.device)[:, None, None] * w + torch.arange(w, device=q.device)[None, :, None]
    j = torch.arange(n, device=q.device)[:, None, None] * w - w + torch.arange(3 * w, device=q.device)[None, None, :]
    valid = (j >= 0) & (j < T)  # (n, w, 3w)
    if key_padding_mask is not None:
        keep = _band_blocks(key_padding_mask[:, None, :, None].float(), w).squeeze(-1) > 0.5  # (B, 1, n, 3w)
        valid = valid & keep[:, :, :, None, :]
    in_window = ((i - j < w) & (i >= j)) if causal else ((i - j).abs() < w)
    s = (qb @ kb.transpose(-2, -1)) * D ** -0.5  # (B, H, n, w, 3w)
    s = s.masked_fill(~(valid & in_window), float('-inf'))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a padded query may see no window key
    a_sm = torch.exp(s - m)  # (B, H, n, w, 3w), 0 outside the window
    # the linear part: keys outside the window
    pk = _acc(phi_k) if key_padding_mask is None else _acc(phi_k) * key_padding_mask[:, None, :, None]
    shift = lambda x: F.pad(x, (0, 0, w, 0))[:, :, :T]  # noqa: E731, x_t <- x_{t - w}
    num_l, den_l, _ = linear_attention_parts(phi_q, shift(pk), shift(v), True, impl, chunk_size)
    if not causal:  # plus keys j >= i + w: the same, run backwards in time
        flip = lambda x: x.flip(2)  # noqa: E731
        num_r, den_r, _ = linear_attention_parts(flip(phi_q), shift(flip(pk)), shift(flip(v)), True, impl, chunk_size)
        num_l, den_l = num_l + flip(num_r), den_l + flip(den_r)
    cut = lambda x: x.reshape(B, H, n * w, *x.shape[4:])[:, :, :T]  # noqa: E731, (B, H, n, w, ..) -> (B, H, T, ..)
    m_t = cut(m.squeeze(-1))
    y, p = combine_window_linear(cut(a_sm @ vb), cut(a_sm.sum(-1)), m_t, num_l, den_l, c_q, factor, combine)
    y = y.to(v.dtype)
    if not return_weights:
        return y
    # the full (B, H, T, T) matrix, for distillation and fidelity (quadratic, short sequences only)
    ii, jj = torch.arange(T, device=q.device)[:, None], torch.arange(T, device=q.device)[None, :]
    win = ((ii - jj < w) & (ii >= jj)) if causal else ((ii - jj).abs() < w)
    lin = (ii - jj >= w) if causal else ((ii - jj).abs() >= w)
    E = torch.exp((_acc(q) @ _acc(k).transpose(-2, -1)) * D ** -0.5 - m_t[..., None]).masked_fill(~win, 0.0)
    if key_padding_mask is not None:
        E = E.masked_fill(~key_padding_mask[:, None, None, :], 0.0)
    L = (_acc(phi_q) @ pk.transpose(-2, -1)).masked_fill(~lin, 0.0)
    Ew, Ll = E.sum(-1, keepdim=True), L.sum(-1, keepdim=True)
    p = p[..., None]
    W = p * E / torch.where(Ew > 0, Ew, torch.ones_like(Ew)) + (1 - p) * L / torch.where(Ll > 0, Ll, torch.ones_like(Ll))
    return y, W


@torch.no_grad()
def window_mass(q, k, window, causal=True):
    """How much softmax attention falls inside the sliding window: (sum over query rows of the mass of
    softmax(q_i.k_j / sqrt D) on j in W(i), per head (H,) float64, number of rows summed). Only rows that also
    have keys outside the window count (causal: i >= window). One batch element at a time (H x T x T floats)."""
    T = q.shape[-2]
    i, j = torch.arange(T, device=q.device)[:, None], torch.arange(T, device=q.device)[None, :]
    inside = ((i - j < window) & (i >= j)) if causal else ((i - j).abs() < window)
    rows = (torch.arange(T, device=q.device) >= window) if causal else ((i - j).abs() >= window).any(-1)
    total = torch.zeros(q.shape[1], dtype=torch.float64, device=q.device)
    for b in range(q.shape[0]):
        W = softmax_weights(q[b:b + 1], k[b:b + 1], causal)[0]  # (H, T, T)
        total += (W * inside).sum(-1)[:, rows].double().sum(-1)
    return total, int(rows.sum()) * q.shape[0]


def block_diagonal_softmax(q, k, v, block, causal=True, key_padding_mask=None, return_weights=False):
    """Softmax attention restricted to diagonal blocks of `block` tokens (LLN+Diag, Nahshan et al. 2023,
    Sec. 4.2); the last block may be shorter. Causal inside a block when causal=True."""
    B, H, T, D = q.shape
    n = math.ceil(T / block)
    pad = n * block - T
    qb, kb, vb = (F.pad(t, (0, 0, 0, pad)).reshape(B, H, n, block, D) for t in (q, k, v))
    pos = torch.arange(n * block, device=q.device).reshape(n, block)
    mask = (pos[:, None, :] < T).expand(n, block, block)  # real keys
    if causal:
        mask = mask & torch.ones(block, block, dtype=torch.bool, device=q.device).tril()
    mask = mask[None, None]
    if key_padding_mask is not None:
        keep = F.pad(key_padding_mask, (0, pad)).reshape(B, 1, n, 1, block)
        mask = mask & keep
    # a padded query row may see no key at all: let it see its own position so softmax stays finite
    mask = mask | torch.eye(block, dtype=torch.bool, device=q.device)
    y = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask).reshape(B, H, n * block, D)[:, :, :T]
    if not return_weights:
        return y
    s = (qb.float() @ kb.float().transpose(-2, -1)) * D ** -0.5
    wb = torch.softmax(s.masked_fill(~mask, float('-inf')), -1)  # (B, H, n, block, block)
    W = q.new_zeros(B, H, n * block, n * block, dtype=torch.float32)
    for b in range(n):
        W[:, :, b * block:(b + 1) * block, b * block:(b + 1) * block] = wb[:, :, b]
    return y, W[:, :, :T, :T]


# -----------------------------------------------------------------------------
# 5. the attention core of one layer

class Attention(nn.Module):
    """The attention of one layer, chosen by name: 'softmax' or any FEATURE_MAPS key, optionally as a hybrid
    (window > 0: sliding-window softmax + linear, LoLCATs; diag_block > 0: block-diagonal softmax + linear,
    outputs averaged, LLN+Diag). Owns the feature map (per-head parameters) and the window factors; q, k, v
    come from the model's projections, after RoPE, with GQA keys/values repeated to n_heads.
        y = core(q, k, v)                                   # (B, H, T, D)
        y, state = core(q, k, v, state=None, return_state=True)   # prefill
        y, state = core(q1, k1, v1, state=state, return_state=True)  # continue (decode)
    `teacher = True` makes the core compute exact softmax attention whatever its map (convert.py).
    kv_groups = n_heads / n_kv_heads of a grouped-query model: k, v still arrive repeated to n_heads (every map
    is per query head), but the softmax KV cache keeps only the model's own n_kv_heads."""

    def __init__(self, attn, head_dim, n_heads, causal=True, window=0, diag_block=0, impl='chunked',
                 eps=EPS, chunk_size=64, window_combine='joint', kv_groups=1, **map_options):
        super().__init__()
        if attn not in ATTN_CHOICES:
            raise ValueError(f"unknown attention {attn!r}; choose one of: {', '.join(ATTN_CHOICES)}")
        if impl not in IMPLS:
            raise ValueError(f"unknown impl {impl!r}; choose one of: {', '.join(IMPLS)}")
        if window_combine not in WINDOW_COMBINES:
            raise ValueError(f"unknown window_combine {window_combine!r}; choose one of: {', '.join(WINDOW_COMBINES)}")
        if window and diag_block:
            raise ValueError("choose one hybrid: window > 0 (LoLCATs) or diag_block > 0 (LLN+Diag), not both")
        if window < 0 or diag_block < 0:
            raise ValueError(f"window and diag_block must be >= 0, got {window}, {diag_block}")
        if attn == 'softmax' and (window or diag_block or map_options):
            raise ValueError("softmax attention takes no feature-map options, window or diag_block")
        self.attn, self.head_dim, self.n_heads, self.causal = attn, head_dim, n_heads, causal
        self.window, self.diag_block, self.impl, self.eps, self.chunk_size = window, diag_block, impl, eps, chunk_size
        self.window_combine = window_combine
        self.kv_groups = kv_groups  # GQA: k, v arrive repeated to n_heads; the KV cache keeps n_heads / kv_groups
        self.teacher = False
        self.fmap = None if attn == 'softmax' else make_feature_map(attn, head_dim, n_heads, **map_options)
        if window:
            # joint: gamma = sigmoid(theta) on the window weights, gamma = 0.1 at init (LoLCATs' official code:
            # init_window_factor = -2.197); mix: s = sigmoid(theta) on the window part, theta = 0 (s = 1/2) until
            # calibrate() sets s to the teacher's mean attention mass inside the window (see calibrate)
            theta = math.log(0.1 / 0.9) if window_combine == 'joint' else 0.0
            self.window_factor = nn.Parameter(torch.full((n_heads,), theta))

    def factor(self):
        """The window factor through its sigmoid, per head: gamma (joint) or s (mix), both on the window part."""
        return torch.sigmoid(self.window_factor)

    @torch.no_grad()
    def calibrate(self, q, k):
        """Data-dependent initialisation from teacher queries/keys (B, H, T, D) (convert.py calls it before
        stage 1): LLN's moment-matching statistics, and for the 'mix' window hybrid s per head = the teacher's
        mean softmax mass inside the window over the rows that have keys outside it (`window_mass`): s is the
        window's share in y = s y_w + (1 - s) y_l, so this is the mix that is exact for an average row."""
        if self.fmap is not None and hasattr(self.fmap, 'calibrate'):
            self.fmap.calibrate(q, k)
        if self.window and self.window_combine == 'mix':
            total, rows = window_mass(q, k, self.window, self.causal)
            if rows:
                self.set_window_mix(total / rows)

    @torch.no_grad()
    def set_window_mix(self, s):
        """Set the 'mix' factor s (H,) (clamped to [1e-4, 1 - 1e-4])."""
        s = torch.as_tensor(s, dtype=torch.float64).clamp(1e-4, 1 - 1e-4)
        self.window_factor.copy_(torch.logit(s).to(self.window_factor))

    def extra_repr(self):
        return (f"attn={self.attn!r}, causal={self.causal}, window={self.window}, "
                f"diag_block={self.diag_block}, impl={self.impl!r}")

    @property
    def kind(self):
        if self.fmap is None or self.teacher:
            return 'softmax'
        return 'window' if self.window else 'diag' if self.diag_block else 'linear'

    def forward(self, q, k, v, state=None, return_state=False, key_padding_mask=None):
        _check_qk(q, k, self.head_dim, self.n_heads)
        if key_padding_mask is not None and self.causal:
            raise ValueError("key_padding_mask is for bidirectional (encoder) attention only")
        if state is not None and not self.causal:
            raise ValueError("a decode state only makes sense for causal attention")
        if state is not None and state['kind'] != self.kind:
            raise ValueError(f"state was made by {state['kind']!r} attention, this core is {self.kind!r}")
        if state is not None and state['kind'] in ('window', 'diag') and q.shape[-2] > 1:
            y, states = [], state  # continue a hybrid one token at a time
            for t in range(q.shape[-2]):
                yt, states = self._forward(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], states, None)
                y.append(yt)
            y, state = torch.cat(y, 2), states
        else:
            y, state = self._forward(q, k, v, state, key_padding_mask)
        return (y, state) if return_state else y

    def _forward(self, q, k, v, state, key_padding_mask):
        T = q.shape[-2]
        offset = 0 if state is None else state['offset']
        kind = self.kind
        if kind == 'softmax':
            g = self.kv_groups  # cache only the model's own key/value heads (k, v come repeated, GQA)
            k, v = k[:, ::g], v[:, ::g]
            if state is not None:
                k, v = torch.cat([state['k'], k], 2), torch.cat([state['v'], v], 2)
            mask = None
            if key_padding_mask is not None:
                mask = key_padding_mask[:, None, None, :]
            elif state is not None and T > 1:
                mask = causal_mask(T, k.shape[-2], q.device)
            y = softmax_attention(q, k, v, causal=self.causal and state is None, attn_mask=mask)
            return y, {'kind': kind, 'offset': offset + T, 'k': k, 'v': v}

        phi_q, phi_k, c_q = self.fmap.features(q, k, offset)
        if key_padding_mask is not None:
            phi_k = phi_k * key_padding_mask[:, None, :, None]
        if kind == 'linear':
            init = None if state is None else (state['S'], state['z'])
            y, (S, z) = linear_attention(phi_q, phi_k, v, self.causal, self.impl, self.eps, self.chunk_size,
                                         initial_state=init, return_state=True)
            return y, {'kind': kind, 'offset': offset + T, 'S': S, 'z': z}
        if kind == 'diag':
            b = self.diag_block
            if state is None:
                y_lin, (S, z) = linear_attention(phi_q, phi_k, v, self.causal, self.impl, self.eps,
                                                 self.chunk_size, return_state=True)
                y_blk = block_diagonal_softmax(q, k, v, b, self.causal, key_padding_mask)
                start = (T // b) * b  # the current, partial block
                new = {'k': k[:, :, start:], 'v': v[:, :, start:]}
            else:  # one token: its block is the buffered partial block plus itself
                y_lin, (S, z) = linear_attention(phi_q, phi_k, v, True, 'recurrent', self.eps,
                                                 initial_state=(state['S'], state['z']), return_state=True)
                if offset % b == 0:
                    kb, vb = k, v
                else:
                    kb, vb = torch.cat([state['k'], k], 2), torch.cat([state['v'], v], 2)
                y_blk = softmax_attention(q, kb, vb, causal=False)
                new = {'k': kb, 'v': vb} if (offset + 1) % b else {'k': k[:, :, :0], 'v': v[:, :, :0]}
            y = 0.5 * (y_lin + y_blk.to(y_lin.dtype))
            return y, {'kind': kind, 'offset': offset + T, 'S': S, 'z': z, **new}
        return self._window(q, k, v, phi_q, phi_k, c_q, state, key_padding_mask)

    def _window(self, q, k, v, phi_q, phi_k, c_q, state, key_padding_mask):
        """The sliding-window hybrid: all tokens at once (state None), or one decode step. The decode state is
        (S, z) over the tokens that left the window plus the last window - 1 tokens' k, v, phi(k): constant size."""
        w, T = self.window, q.shape[-2]
        if state is None:
            y = window_linear_attention(q, k, v, phi_q, phi_k, w, self.factor(), self.causal, self.eps,
                                        key_padding_mask, self.impl, self.chunk_size, c_q=c_q,
                                        combine=self.window_combine)
            if not self.causal:
                return y, None
            cut = max(T - (w - 1), 0)  # (S, z) over tokens <= T - w; the last w - 1 tokens stay in the window
            S = phi_k[:, :, :cut].transpose(-2, -1) @ _acc(v[:, :, :cut])
            z = phi_k[:, :, :cut].sum(-2)
            buf = {'k': k[:, :, cut:], 'v': v[:, :, cut:], 'phi_k': phi_k[:, :, cut:]}
            return y, {'kind': 'window', 'offset': T, 'S': S, 'z': z, **buf}
        # one token: softmax over the buffer + itself, linear over the state
        kw, vw = torch.cat([state['k'], k], 2), torch.cat([state['v'], v], 2)
        pkw = torch.cat([state['phi_k'], phi_k], 2)
        s = (_acc(q) @ _acc(kw).transpose(-2, -1)) * self.head_dim ** -0.5  # (B, H, 1, <=w)
        m = s.amax(-1, keepdim=True)
        a = torch.exp(s - m)
        num_l, den_l = phi_q @ state['S'], (phi_q @ state['z'][..., None]).squeeze(-1)
        y, _ = combine_window_linear(a @ _acc(vw), a.sum(-1), m.squeeze(-1), num_l, den_l, c_q, self.factor(),
                                     self.window_combine)
        S, z = state['S'], state['z']
        if kw.shape[-2] > w - 1:  # the oldest token leaves the window for the linear state
            S = S + pkw[:, :, :1].transpose(-2, -1) @ _acc(vw[:, :, :1])
            z = z + pkw[:, :, 0]
            kw, vw, pkw = kw[:, :, 1:], vw[:, :, 1:], pkw[:, :, 1:]
        return y.to(v.dtype), {'kind': 'window', 'offset': state['offset'] + 1, 'S': S, 'z': z,
                               'k': kw, 'v': vw, 'phi_k': pkw}

    def weights(self, q, k, key_padding_mask=None):
        """The (B, H, T, T) attention matrix this core applies (float32, quadratic in T)."""
        _check_qk(q, k, self.head_dim, self.n_heads)
        kind = self.kind
        if kind == 'softmax':
            return softmax_weights(q, k, self.causal)
        phi_q, phi_k, c_q = self.fmap.features(q, k)
        if kind == 'linear':
            return linear_attention_weights(phi_q, phi_k, self.causal, self.eps)
        if kind == 'diag':
            _, W = block_diagonal_softmax(q, k, k, self.diag_block, self.causal, key_padding_mask, True)
            return 0.5 * (W + linear_attention_weights(phi_q, phi_k, self.causal, self.eps))
        _, W = window_linear_attention(q, k, k, phi_q, phi_k, self.window, self.factor(), self.causal, self.eps,
                                       key_padding_mask, return_weights=True, c_q=c_q,
                                       combine=self.window_combine)
        return W


def state_nbytes(state):
    """Bytes held by a decode state (a dict of tensors, or a list of them, one per layer)."""
    if isinstance(state, (list, tuple)):
        return sum(state_nbytes(s) for s in state)
    if isinstance(state, dict):
        return sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
    return 0


# -----------------------------------------------------------------------------
# 6. metrics and distillation losses

def attention_entropy(w, eps=1e-12):
    """Row entropies -sum_j w_ij log w_ij in nats: (B, H, T, T) -> (B, H, T) (Hedgehog Fig. 4)."""
    w = w.float()
    return -(w * (w + eps).log()).sum(-1)


def spectral_gap(w):
    """1 - |lambda_2| of each row-stochastic (B, H, T, T) matrix, in float64 (general eigenvalues, sorted by
    modulus; lambda_1 = 1). Meant for bidirectional matrices: a causal (triangular) matrix's eigenvalues
    are its diagonal. Returns (B, H) float64."""
    ev = torch.linalg.eigvals(w.double())  # (B, H, T) complex
    mod = ev.abs().sort(dim=-1, descending=True).values
    return 1.0 - mod[..., 1]


def _ranks(x):
    """Average ranks along the last dimension (ties share their mean rank), float64."""
    x = x.double()
    order = x.argsort(dim=-1)
    ranks = torch.empty_like(x)
    ranks.scatter_(-1, order, torch.arange(x.shape[-1], dtype=torch.float64, device=x.device).expand_as(x).clone())
    # average over ties: for each value, mean rank of equal values
    sorted_x = x.gather(-1, order)
    same = sorted_x[..., 1:] == sorted_x[..., :-1]
    if same.any():
        flat_x, flat_r = x.reshape(-1, x.shape[-1]), ranks.reshape(-1, x.shape[-1])
        for r in range(flat_x.shape[0]):
            vals, inv = torch.unique(flat_x[r], return_inverse=True)
            sums = torch.zeros(len(vals), dtype=torch.float64, device=x.device).index_add_(0, inv, flat_r[r])
            counts = torch.zeros(len(vals), dtype=torch.float64, device=x.device).index_add_(0, inv, torch.ones_like(flat_r[r]))
            flat_r[r] = (sums / counts)[inv]
        ranks = flat_r.reshape(x.shape)
    return ranks


def monotonicity(w, q, k, causal=True, scale=None):
    """How monotonic attention weights are in q.k (Hedgehog Fig. 3 / Sec. 3.2): the Spearman correlation,
    per query row, between w_ij and s_ij = q_i.k_j * scale over the keys the row sees (rows with fewer than
    3 keys are skipped), averaged per head. Returns (rho (B, H) float64, (scores, weights) 1-D tensors of
    every visible pair, for a scatter plot)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q.double() @ k.double().transpose(-2, -1)) * scale
    w = w.double()
    T = w.shape[-1]
    rhos = []
    for i in range(2 if causal else 0, w.shape[-2]):
        n = i + 1 if causal else T
        rs, rw = _ranks(s[..., i, :n]), _ranks(w[..., i, :n])
        rs, rw = rs - rs.mean(-1, keepdim=True), rw - rw.mean(-1, keepdim=True)
        rho = (rs * rw).sum(-1) / ((rs.square().sum(-1) * rw.square().sum(-1)).sqrt() + 1e-30)
        rhos.append(rho)
    rho = torch.stack(rhos, -1).mean(-1)
    vis = causal_mask(T, T, w.device).expand_as(w) if causal else torch.ones_like(w, dtype=torch.bool)
    return rho, (s[vis].float(), w[vis].float())


def kl_divergence(p, q, eps=1e-12):
    """KL(p || q) per row of two (B, H, T, T) attention matrices -> (B, H, T), nats."""
    p, q = p.float(), q.float()
    return (p * ((p + eps).log() - (q + eps).log())).sum(-1)


def attention_cross_entropy(w_student, w_teacher, eps=1e-12):
    """Hedgehog's distillation loss (Eq. 4): soft-label cross-entropy -sum_j w_teacher_ij log w_student_ij,
    averaged over rows (and batch and heads). Quadratic in T: for short sequences."""
    return -(w_teacher.float() * (w_student.float() + eps).log()).sum(-1).mean()


def output_mse(y_student, y_teacher):
    """LoLCATs' attention-transfer loss: mean squared error between attention outputs (B, H, T, D).
    Works at any length through the chunked path: nothing T x T is formed."""
    return F.mse_loss(y_student.float(), y_teacher.float())


def kernel_l2(phi_q, phi_k, q, k, causal=True):
    """DoF's kernel loss: mean squared error between the feature kernel phi(q_i).phi(k_j) and the softmax
    kernel exp(q_i.k_j / sqrt(D)) over visible pairs (quadratic in T). phi_q must be the exact query features
    (`fmap.features` returns shifted ones: multiply by exp(c_q)), since the kernel is compared unnormalised."""
    approx = phi_q.float() @ phi_k.float().transpose(-2, -1)
    exact = torch.exp((q.float() @ k.float().transpose(-2, -1)) * q.shape[-1] ** -0.5)
    err = (approx - exact).square()
    if causal:
        vis = causal_mask(err.shape[-2], err.shape[-1], err.device)
        return err.masked_select(vis.expand_as(err)).mean()
    return err.mean()


if __name__ == '__main__':
    # Self-check: `python attention.py` prints how far the three paths are apart for every map (fp32, causal
    # and bidirectional, T = 203, chunk 64) and the fitted LLN constants per head_dim.
    torch.manual_seed(0)
    B, H, T, D = 2, 4, 203, 16
    q, k, v = torch.randn(3, B, H, T, D).unbind(0)
    print(f"max |path - quadratic| / max |quadratic|, fp32, B={B} H={H} T={T} D={D}, chunk 64")
    print(f"{'map':<10} {'F':>5} {'chunked':>10} {'recurrent':>10} {'chunked':>10} {'recurrent':>10}")
    print(f"{'':<16} {'(causal)':>21} {'(bidirectional)':>21}")
    for name in FEATURE_MAPS:
        fmap = make_feature_map(name, D, H).eval()
        phi_q, phi_k = fmap(q, k)
        errs = []
        for causal in (True, False):
            ref = linear_attention(phi_q, phi_k, v, causal, 'quadratic')
            for impl in ('chunked', 'recurrent'):
                y = linear_attention(phi_q, phi_k, v, causal, impl)
                errs.append(((y - ref).abs().max() / ref.abs().max()).item())
        print(f"{name:<10} {fmap.feature_dim:>5} " + " ".join(f"{e:>10.1e}" for e in errs))
    print("\nLLN fit sigma_lln^2 = a (alpha^2 s_q^2 + beta^2 s_k^2) + b, and alpha = beta for unit-variance q, k")
    one = torch.ones(1, dtype=torch.float64)
    for d in (16, 32, 64, 128):
        a, b = lln_fit(d)
        alpha, _ = lln_alpha_beta(one, one, d)
        print(f"head_dim {d:>4}: a = {a:.4f}  b = {b:+.4f}  alpha = beta = {alpha.item():.3f}")
