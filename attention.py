"""
Attention, softmax and linear, in one file. In reading order:
  1. softmax attention, the reference (Vaswani et al. 2017)
  2. feature maps phi (FEATURE_MAPS): Hedgehog, LoLCATs, Linear Log-Normal (LLN), Degrees of Freedom (DoF), baselines
  3. AttnSpec: the attention of a layer as one value, e.g. 'hedgehog:feature_dim=64:window=64'
  4. linear attention four ways (impl: quadratic, chunked, recurrent, triton), equal to float32 precision
  5. hybrids: sliding-window softmax + linear (LoLCATs), block-diagonal softmax + linear (LLN+Diag)
  6. Attention, the core of one layer that model.py calls, with its decode states
  7. metrics (entropy, spectral gap, monotonicity, KL) and DoF's kernel loss

Linear attention, for one head (Katharopoulos et al. 2020, Eq. 4-6):
    y_t = phi(q_t)^T S_t / phi(q_t)^T z_t,  S_t = sum_{s<=t} phi(k_s) v_s^T,  z_t = sum_{s<=t} phi(k_s)
S (F x D), z (F) accumulate in float32; feature maps return float32; every core but exact softmax computes in float32
also under bf16/fp16 autocast. q, k, v: (B, H, T, D = head_dim), phi (B, H, T, F).
"""

import contextlib
import functools
import inspect
import json
import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels

NO_KEY = -1e30  # the key shift of a key that is not there (padding, sinks), and the running max of a row seeing none

class UsageError(ValueError):
    """What the user asked for cannot be done (a flag, a spec, a path, a file's contents): the scripts' main() print it
    in one line and exit with status 2; any other exception is a bug and keeps its traceback. (Here, at the bottom
    of the imports, so that every module can raise it.)"""

def _acc(x):  # the accumulation dtype: float32, or float64 when given float64 (the float64 reference checks)
    return x.double() if x.dtype == torch.float64 else x.float()

def _choose(what, value, choices):
    if value not in choices:
        raise UsageError(f"unknown {what} {value!r}; choose one of: {', '.join(map(str, choices))}")

def _check_qk(q, k, head_dim, n_heads):
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must be (B, H, T, D) with the same B, H, D; got {tuple(q.shape)}, {tuple(k.shape)}")
    if (q.shape[1], q.shape[-1]) != (n_heads, head_dim):
        raise ValueError(f"n_heads / head_dim mismatch: built for H={n_heads}, D={head_dim}, got q {tuple(q.shape)}")

# ---- 1. softmax attention, the reference ------------------------------------
def softmax_attention(q, k, v, causal=True, attn_mask=None):
    """softmax(q k^T / sqrt(D)) v (Vaswani et al. 2017, Eq. 1), by PyTorch's SDPA. attn_mask: bool (B, H, T_q,
    T_k), True = may attend, replaces causal. k, v may have fewer heads than q (GQA)."""
    causal = causal and attn_mask is None and q.shape[-2] > 1
    return F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])

def causal_mask(T_q, T_k, device=None):
    """(T_q, T_k) bool, True where query i (at absolute position T_k - T_q + i) may see key j."""
    return torch.arange(T_k, device=device) <= torch.arange(T_q, device=device)[:, None] + (T_k - T_q)

def softmax_weights(q, k, causal=True, attn_mask=None):
    """The (B, H, T, T) matrix of softmax attention, float32: its output for the identity matrix as values."""
    eye = torch.eye(k.shape[-2], device=k.device).expand(*k.shape[:2], -1, -1)
    return softmax_attention(q.float(), k.float(), eye, causal, attn_mask)

# ---- 2. feature maps: fmap(q, k, offset) -> (phi_q, phi_k), float32 (B, H, T, F) ---
class FeatureMap(nn.Module):
    """Base class. q and k come together (LLN treats them differently; cosFormer needs positions: offset = the absolute
    position of the first token). A map implements phi(x, which, offset), which in {'q', 'k'}, or, exp-based
    (log_domain), the log-features log_phi(x, which, offset), phi = exp(log_phi). Range (attention sinks make q, k
    large; Performer's and DoF's exp(-|x|^2 / 2 sqrt D) are tiny at large norms): `features` divides an exp-based
    phi(x) by exp(c), c its detached largest log-feature, for every query and key: every feature <= 1. A query's c_q
    cancels in its row; the keys' c_k go to linear attention, which weighs key s in row t by exp(c_s - m_t), m_t the
    largest c_k the row sees (linear_attention_parts). forward(q, k): phi_q and phi_k with ONE key shift per sequence
    and head (the largest), cancelling in the normalisation: plain features while the keys' scales lie within
    float32's range (e^+-87). shift=False: no shifts."""

    log_domain = False

    def __init__(self, head_dim, n_heads):
        super().__init__()
        self.head_dim, self.n_heads, self.feature_dim, self.shift = head_dim, n_heads, head_dim, True

    def forward(self, q, k, offset=0):
        phi_q, phi_k, _, c_k = self.features(q, k, offset)
        return phi_q, phi_k * torch.exp(c_k - c_k.amax(-1, keepdim=True))[..., None]

    def features(self, q, k, offset=0):
        """(phi_q, phi_k, c_q, c_k), c (B, H, T): phi(q) = phi_q exp(c_q), phi(k) = phi_k exp(c_k), float32 (float64
        for float64 inputs) also under autocast; the shifts are 0 for maps that are not exp-based."""
        _check_qk(q, k, self.head_dim, self.n_heads)
        with torch.autocast(q.device.type, enabled=False):
            q, k = _acc(q), _acc(k)
            if not self.log_domain:
                phi_q, phi_k = self.phi(q, 'q', offset), self.phi(k, 'k', offset)
                return phi_q, phi_k, phi_q.new_zeros(phi_q.shape[:-1]), phi_k.new_zeros(phi_k.shape[:-1])
            u_q, u_k = self.log_phi(q, 'q', offset), self.log_phi(k, 'k', offset)
            c_q, c_k = (u.detach().amax(-1) * self.shift for u in (u_q, u_k))
            return torch.exp(u_q - c_q[..., None]), torch.exp(u_k - c_k[..., None]), c_q, c_k

    def phi(self, x, which, offset):  # the exact features of one side
        return torch.exp(self.log_phi(_acc(x), which, offset))

def _per_head_linear(x, weight, bias=None):
    """One Linear per head: x (B, H, T, D), weight (H, F, D), bias (H, F) -> (B, H, T, F)."""
    y = torch.einsum('bhtd,hfd->bhtf', x, weight.to(x.dtype))
    return y if bias is None else y + bias.to(x.dtype)[None, :, None, :]

class EluFeatureMap(FeatureMap):
    """phi(x) = 1 + ELU(x) (Katharopoulos et al. 2020, Eq. 7); F = D, no parameters."""

    def phi(self, x, which, offset):
        return F.elu(x) + 1

class ReluFeatureMap(FeatureMap):
    """phi(x) = ReLU(x) (Kasai et al. 2021; cosFormer, Qin et al. 2022, without its re-weighting); F = D."""

    def phi(self, x, which, offset):
        return F.relu(x)

class T2RFeatureMap(FeatureMap):
    """phi(x) = ReLU(W x + b), trained, shared by q and k (T2R, Kasai et al. 2021, Eq. 4); per head W (F, D),
    b (F), F = feature_dim (default D), init U(-1/sqrt(D), 1/sqrt(D)) as nn.Linear."""

    def __init__(self, head_dim, n_heads, feature_dim=None):
        super().__init__(head_dim, n_heads)
        self.feature_dim = feature_dim or head_dim
        bound = 1 / math.sqrt(head_dim)
        self.weight = nn.Parameter(torch.empty(n_heads, self.feature_dim, head_dim).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(n_heads, self.feature_dim).uniform_(-bound, bound))

    def phi(self, x, which, offset):
        return F.relu(_per_head_linear(x, self.weight, self.bias))

def _orthogonal_gaussian(n_heads, m, d, generator=None):
    """(n_heads, m, d) orthogonal random features (Choromanski et al. 2020, Sec. 2.4): blocks of d orthogonal
    rows (QR of a Gaussian, signs fixed so the rotation is Haar), each rescaled to a N(0, I_d) draw's norm."""
    def rotation():
        qmat, r = torch.linalg.qr(torch.randn(d, d, generator=generator))
        return (qmat * torch.sign(torch.diagonal(r))).T
    return torch.stack([torch.cat([rotation() for _ in range(math.ceil(m / d))])[:m] *
                        torch.randn(m, d, generator=generator).norm(dim=1, keepdim=True) for _ in range(n_heads)])

class PerformerFeatureMap(FeatureMap):
    """FAVOR+ (Choromanski et al. 2020, Lemma 1, Eq. 7): phi(x) = exp(w_m . x' - |x'|^2 / 2) / sqrt(M),
    x' = x D^-1/4, w_m orthogonal N(0, I) (buffer omega): E[phi(q).phi(k)] = exp(q.k / sqrt(D)). M = feature_dim
    (default 2D); stabilize=False: no shifts; redraw_interval > 0: new w_m every that many training calls."""

    log_domain = True

    def __init__(self, head_dim, n_heads, feature_dim=None, stabilize=True, redraw_interval=0, seed=None):
        super().__init__(head_dim, n_heads)
        self.feature_dim, self.shift = feature_dim or 2 * head_dim, bool(stabilize)
        self.redraw_interval, self.calls = redraw_interval, 0
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.register_buffer('omega', _orthogonal_gaussian(n_heads, self.feature_dim, head_dim, self.generator))

    def features(self, q, k, offset=0):
        if self.training and self.redraw_interval > 0:
            if self.calls > 0 and self.calls % self.redraw_interval == 0:
                self.omega.copy_(_orthogonal_gaussian(self.n_heads, self.feature_dim, self.head_dim, self.generator))
            self.calls += 1
        return super().features(q, k, offset)

    def log_phi(self, x, which, offset):
        x = x * self.head_dim ** -0.25
        return _per_head_linear(x, self.omega) - 0.5 * (x * x).sum(-1, keepdim=True) - 0.5 * math.log(self.feature_dim)

class CosformerFeatureMap(FeatureMap):
    """cosFormer (Qin et al. 2022, Eq. 9-11): phi(x_i) = [ReLU(x_i) cos(pi i / 2M), ReLU(x_i) sin(pi i / 2M)],
    so phi(q_i).phi(k_j) = ReLU(q_i).ReLU(k_j) cos(pi (i - j) / 2M); F = 2D. M = max_len (default 2048, the
    model's context length), fixed: no output depends on the tokens that follow (the paper uses the length)."""

    def __init__(self, head_dim, n_heads, max_len=2048):
        super().__init__(head_dim, n_heads)
        self.feature_dim, self.max_len = 2 * head_dim, max_len

    def phi(self, x, which, offset):
        T = x.shape[-2]
        if offset + T > self.max_len:
            raise UsageError(f"cosformer: position {offset + T - 1} is beyond max_len={self.max_len} (set it larger)")
        angle = math.pi / (2 * self.max_len) * torch.arange(offset, offset + T, device=x.device, dtype=x.dtype)
        return torch.cat([F.relu(x) * angle.cos()[:, None], F.relu(x) * angle.sin()[:, None]], dim=-1)

class TaylorFeatureMap(FeatureMap):
    """2nd-order Taylor of exp (Hedgehog Sec. 4.1; Based, Arora et al. 2024): phi(x) = [1, x / D^1/4,
    vec(x x^T) / sqrt(2D)], so phi(q).phi(k) = 1 + s + s^2 / 2, s = q.k / sqrt(D); F = 1 + D + D^2."""

    def __init__(self, head_dim, n_heads):
        super().__init__(head_dim, n_heads)
        self.feature_dim = 1 + head_dim + head_dim ** 2

    def phi(self, x, which, offset):
        """x (B, H, T, D) -> (B, H, T, 1 + D + D^2): [1, x / D^1/4, vec(x x^T) / sqrt(2D)], the same for q and k."""
        x2 = torch.einsum('bhti,bhtj->bhtij', x, x).flatten(-2) / math.sqrt(2 * self.head_dim)
        return torch.cat([torch.ones_like(x[..., :1]), x * self.head_dim ** -0.25, x2], dim=-1)

class ExpFeatureMap(FeatureMap):
    """phi(x) = exp(t x) elementwise, t = temperature (default 1) (Hedgehog Sec. 3.2: spiky but not monotonic in
    q.k, the control for Hedgehog's map); F = D, no parameters."""

    log_domain = True

    def __init__(self, head_dim, n_heads, temperature=1.0):
        super().__init__(head_dim, n_heads)
        self.temperature = temperature

    def log_phi(self, x, which, offset):
        return self.temperature * x

class HedgehogFeatureMap(FeatureMap):
    """Hedgehog (Zhang et al. 2024, Eq. 3, 5-6): u = W x + b, a Linear(D, F/2) per head shared by q and k,
    init W = I, b = 0; phi(x) = [softmax(u), softmax(-u)] over the features (softmax_dim=True, Eq. 5: each half
    sums to 1, part of the map) or [exp(u), exp(-u)] (softmax_dim=False, Eq. 3). F = feature_dim, default 2D."""

    def __init__(self, head_dim, n_heads, feature_dim=None, softmax_dim=True):
        super().__init__(head_dim, n_heads)
        self._mlp(feature_dim, 'softmax' if softmax_dim else 'exp', torch.eye)

    def _mlp(self, feature_dim, activation, init):
        """The per-head Linear(D, width), weight init(width, D); F = 2 width for [f(u), f(-u)], else width."""
        pm = activation in ('softmax', 'exp')
        self.activation, self.log_domain = activation, activation == 'exp'
        self.feature_dim = feature_dim or (2 if pm else 1) * self.head_dim
        if pm and self.feature_dim % 2:
            raise UsageError(f"{activation} features [f(u), f(-u)] need an even feature_dim, got {self.feature_dim}")
        width = self.feature_dim // 2 if pm else self.feature_dim
        self.weight = nn.Parameter(init(width, self.head_dim).repeat(self.n_heads, 1, 1))  # (H, width, D)
        self.bias = nn.Parameter(torch.zeros(self.n_heads, width))

    def project(self, x):
        return _per_head_linear(x, self.weight, self.bias)

    def phi(self, x, which, offset):
        u = self.project(x)
        if self.activation in ('elu', 'relu'):  # LoLCATs' one-sided features
            return F.elu(u) + 1 if self.activation == 'elu' else F.relu(u)
        f = torch.exp if self.log_domain else lambda t: torch.softmax(t, dim=-1)
        return torch.cat([f(u), f(-u)], dim=-1)

    def log_phi(self, x, which, offset):
        u = self.project(x)
        return torch.cat([u, -u], dim=-1)

class LolcatsFeatureMap(HedgehogFeatureMap):
    """LoLCATs (Zhang et al. 2025, Eq. 6, Table 1): phi(x) = f(u), u = x W + b + x, a per-head Linear(D, F')
    with a skip connection (its first min(D, F') coordinates), init W = 0, b = 0. activation f: 'softmax'
    [softmax(u), softmax(-u)] or 'exp' [exp(u), exp(-u)], F = 2F' (default 2D); 'elu' 1 + ELU(u) or 'relu'
    ReLU(u), F = F' (default D). Unlike the official code, no clamp of the features at 1e-12."""

    def __init__(self, head_dim, n_heads, feature_dim=None, activation='softmax'):
        FeatureMap.__init__(self, head_dim, n_heads)
        _choose('lolcats activation', activation, ('softmax', 'exp', 'elu', 'relu'))
        self._mlp(feature_dim, activation, torch.zeros)

    def project(self, x):
        width = self.weight.shape[1]
        return super().project(x) + F.pad(x[..., :width], (0, max(width - self.head_dim, 0)))

LLN_MATCH = ('paper', 'entropy', 'none')

def _lln_log_weights(q, k, s2):
    """log P of LLN's bidirectional attention with alpha = beta = sqrt(s2 / 2) on q, k (n, T, D)."""
    log_k = (torch.exp(math.sqrt(s2 / 2) * q) @ torch.exp(math.sqrt(s2 / 2) * k).transpose(-2, -1)).log()
    return log_k - log_k.logsumexp(-1, keepdim=True)

@functools.lru_cache(maxsize=None)
def lln_fit(head_dim, n_tokens=256, reps=8, seed=0):
    """(a, b) of LLN's variance model sigma_lln^2 = a s~^2 + b, s~^2 = alpha^2 s_q^2 + beta^2 s_k^2 (Nahshan et
    al. 2023, Eq. 10, App. A.7, as we read it): a line through Var[log P_ij] of LLN attention at s~^2 = 1..16
    (n_tokens keys, q, k ~ N(0, I_D)). D = 64: a = 0.1482, b = -0.3600 (published: 0.1486, -0.3549)."""
    grid, g = torch.linspace(1.0, 16.0, 16, dtype=torch.float64), torch.Generator().manual_seed(seed)
    ys = [_lln_log_weights(*torch.randn(2, reps, n_tokens, head_dim, generator=g, dtype=torch.float64), s2).var()
          for s2 in grid.tolist()]
    A = torch.stack([grid, torch.ones_like(grid)], dim=1)
    return tuple(torch.linalg.lstsq(A, torch.stack(ys)[:, None]).solution.squeeze(1).tolist())

@functools.lru_cache(maxsize=None)
def lln_entropy_fit(head_dim, n_tokens=256, reps=16, seed=0, s2_max=8.0, step=0.5):
    """match='entropy' (ours: LLN Fig. 2 in docs/RESULTS.md shows moment matching leaves LLN's rows flatter
    than softmax's): for s^2 = 0, 0.5, .., 8 the s~^2 at which LLN's mean row entropy equals softmax's (n_tokens
    keys, q, k ~ N(0, I_D)); LLN's entropy falls monotonically in s~^2. Returns (s^2 grid, s~^2 grid)."""
    q, k = torch.randn(2, reps, n_tokens, head_dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    entropy = lambda log_w: -(log_w.exp() * log_w).sum(-1).mean().item()  # noqa: E731, the mean row entropy
    s2_grid = torch.arange(0.0, s2_max + step / 2, step, dtype=torch.float64)
    dots = q @ k.transpose(-2, -1) / math.sqrt(head_dim)
    h_sm = torch.tensor([entropy(torch.log_softmax(s * dots, -1)) for s in s2_grid.sqrt()], dtype=torch.float64)
    xs, h_lln = [0.0], [math.log(n_tokens)]  # s~^2 = 0: uniform weights
    while h_lln[-1] > h_sm[-1].item() and xs[-1] < 1000:
        xs.append(xs[-1] + step)
        h_lln.append(entropy(_lln_log_weights(q, k, xs[-1])))
    h_lln = torch.tensor(h_lln, dtype=torch.float64)
    if not (h_lln[1:] < h_lln[:-1]).all() or h_lln[-1] > h_sm[-1]:
        raise RuntimeError(f"LLN's entropy is not monotone in s~^2, or never as low as softmax's at s^2 = {s2_max}, "
                           f"at head_dim={head_dim}, n_tokens={n_tokens}")
    return s2_grid, _interp(-h_sm, -h_lln, torch.tensor(xs, dtype=torch.float64))

def _interp(x, xp, fp):
    """Piecewise-linear interpolation of the points (xp, fp) at x, xp increasing; linear beyond both ends."""
    i = torch.searchsorted(xp, x).clamp(1, len(xp) - 1)
    return fp[i - 1] + (fp[i] - fp[i - 1]) * (x - xp[i - 1]) / (xp[i] - xp[i - 1])

def lln_alpha_beta(sigma2_q, sigma2_k, head_dim, match='paper'):
    """LLN's temperatures (Nahshan et al. 2023, Eq. 10) from the query/key variances, alpha s_q = beta s_k:
    alpha = sqrt(s~^2 / 2) / s_q, beta = sqrt(s~^2 / 2) / s_k. For the softmax log-variance s^2 = s_q^2 s_k^2,
    s~^2 answers: 'paper' (the paper's question) equal log-variance of the attention, a s~^2 + b = s^2, (a, b)
    = lln_fit; 'entropy' equal mean row entropy on Gaussian inputs (lln_entropy_fit); 'none' alpha = beta = 1
    (the paper's ablation). s~^2 / 2 >= 1e-4 (the fit gives s~^2 < 0 when s^2 < b)."""
    _choose('LLN match', match, LLN_MATCH)
    if match == 'none':
        return torch.ones_like(sigma2_q), torch.ones_like(sigma2_k)
    s2 = sigma2_q * sigma2_k
    if match == 'entropy':
        x = _interp(s2, *(grid.to(s2) for grid in lln_entropy_fit(head_dim)))
    else:
        a, b = lln_fit(head_dim)
        x = (s2 - b) / a
    half = (x / 2).clamp_min(1e-4).sqrt()
    return half / sigma2_q.sqrt(), half / sigma2_k.sqrt()

class LLNFeatureMap(FeatureMap):
    """Linear Log-Normal attention (Nahshan et al. 2023, Eq. 9-10): phi_q = exp(alpha q), phi_k = exp(beta k),
    alpha, beta per head by lln_alpha_beta(.., match); F = D. The variances (the official code: of the whole
    batch and sequence, later tokens included) are buffers, init 1: set by calibrate(q, k); in training an
    exponential moving average (momentum 0.1) updated AFTER each forward, so causal; frozen in eval mode."""

    log_domain = True

    def __init__(self, head_dim, n_heads, momentum=0.1, match='paper'):
        super().__init__(head_dim, n_heads)
        _choose('LLN match', match, LLN_MATCH)
        self.momentum, self.match = momentum, match
        self.register_buffer('sigma2_q', torch.ones(n_heads))
        self.register_buffer('sigma2_k', torch.ones(n_heads))

    @torch.no_grad()
    def calibrate(self, q, k, weight=1.0):
        """Move the statistics to those of calibration queries/keys (B, H, T, D); weight < 1: an EMA step."""
        for sigma2, x in ((self.sigma2_q, q), (self.sigma2_k, k)):  # per head, over batch, time and dimension
            sigma2.lerp_(x.detach().float().transpose(0, 1).flatten(1).var(1, unbiased=False).to(sigma2.dtype), weight)

    def alpha_beta(self):
        return lln_alpha_beta(self.sigma2_q.double(), self.sigma2_k.double(), self.head_dim, self.match)

    def log_phi(self, x, which, offset):
        return self.alpha_beta()[which == 'k'].to(x.dtype)[None, :, None, None] * x  # alpha q or beta k

    def features(self, q, k, offset=0):
        out = super().features(q, k, offset)
        if self.training:  # this batch's statistics are used from the next forward on (causal honesty)
            self.calibrate(q, k, self.momentum)
        return out

class DoFFeatureMap(FeatureMap):
    """Learned weighted positive random features (DoF paper, Sec. 3, Eq. 8): phi(x)_m = sqrt(a_m / M)
    exp(z_m . x / D^1/4 - |x|^2 / (2 sqrt(D))) per head, z_m init orthogonal N(0, I), a_m = exp(log_a_m), log_a
    init 0 (Performer's unbiased estimate at init); both trained. M = feature_dim (default D)."""

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

FEATURE_MAPS = {'elu': EluFeatureMap, 'relu': ReluFeatureMap, 't2r': T2RFeatureMap, 'performer': PerformerFeatureMap,
                'cosformer': CosformerFeatureMap, 'taylor': TaylorFeatureMap, 'exp': ExpFeatureMap,
                'hedgehog': HedgehogFeatureMap, 'lolcats': LolcatsFeatureMap, 'lln': LLNFeatureMap,
                'dof': DoFFeatureMap}
ATTN_CHOICES = ['softmax'] + list(FEATURE_MAPS)

def make_feature_map(name, head_dim, n_heads, **options):
    _choose('feature map', name, FEATURE_MAPS)
    AttnSpec(name, options=options)  # checks the options
    return FEATURE_MAPS[name](head_dim, n_heads, **options)

# ---- 3. the attention choice as one value -----------------------------------
IMPLS = ('quadratic', 'chunked', 'recurrent', 'triton')
WINDOW_COMBINES = ('joint', 'mix')
OPTION_ALIASES = {'t': 'temperature', 'f': 'feature_dim'}

@dataclass(frozen=True)
class AttnSpec:
    """The attention of a layer as 'name[:key=value..]': 'softmax', 'hedgehog:feature_dim=64', 'exp:t=2',
    'lolcats:window=64:combine=mix', 'lln:diag_block=64'. parse reads it, str() writes it without defaults. Keys
    other than the fields are the map's options (t = temperature, f = feature_dim), values JSON where they parse.
    A changed copy: dataclasses.replace(spec, impl='recurrent') (options may be a dict)."""
    name: str = 'softmax'     # 'softmax' or a FEATURE_MAPS key
    window: int = 0           # > 0: sliding-window softmax + linear (LoLCATs); softmax: sliding-window softmax alone
    sinks: int = 0            # the first `sinks` tokens stay in the window's softmax part (StreamingLLM's sink tokens)
    cache: int = 0            # > 0: LoLA's sparse cache of that many pairs in the softmax part too (causal window)
    combine: str = 'joint'    # the window form: joint | mix
    diag_block: int = 0       # > 0: block-diagonal softmax + linear (LLN+Diag)
    impl: str = 'chunked'     # the linear-attention path: quadratic | chunked | recurrent | triton
    options: tuple = ()       # the feature map's own options, sorted (key, value) pairs

    def __post_init__(self):
        object.__setattr__(self, 'options', tuple(sorted(dict(self.options).items())))
        _choose('attention', self.name, ATTN_CHOICES)
        _choose('window combine', self.combine, WINDOW_COMBINES)
        _choose('impl', self.impl, IMPLS)
        params = inspect.signature(FEATURE_MAPS.get(self.name, FeatureMap)).parameters
        known = list(params)[2:]
        unknown = [key for key, _ in self.options if key not in known]
        types = {**{f.name: f.type for f in fields(self)[1:-1]},   # a map option's: its default's (None: int)
                 **{key: int if params[key].default is None else type(params[key].default) for key in known}}
        ok = lambda x, t: type(x) is t or (t is float and type(x) is int)  # noqa: E731
        wrong = [f"{key}={value!r} is not {types[key].__name__}" for key, value in
                 [(f.name, getattr(self, f.name)) for f in fields(self)[1:-1]] + list(self.options)
                 if key in types and not ok(value, types[key])]
        if wrong:
            raise UsageError(f"attention spec '{self}': {', '.join(wrong)}")
        for bad, why in ((self.window < 0 or self.diag_block < 0, "window and diag_block must be >= 0"),
                         (self.window and self.diag_block, "choose one hybrid, window or diag_block, not both"),
                         (self.combine != 'joint' and not self.window, "combine is the window's form: set window"),
                         (self.sinks < 0 or (self.sinks and not self.window), "sinks (>= 0) belong to a window"),
                         (self.cache < 0 or (self.cache and (not self.window or self.name == 'softmax')),
                          "cache (>= 0) belongs to a window with a linear part (its state scores the pairs)"),
                         (self.impl == 'triton' and self.window, "the window hybrid has no triton path"),
                         (self.name == 'softmax' and (self.diag_block or self.combine != 'joint'),
                          "softmax takes a window and sinks, no diag_block or combine"),
                         (unknown, f"unknown option(s) {', '.join(unknown)}; {self.name}'s options: "
                                   f"{', '.join(known) or 'none'}")):
            if bad:
                raise UsageError(f"attention spec '{self}': {why}")

    @classmethod
    def parse(cls, s):
        if isinstance(s, cls):
            return s
        name, *items = str(s).split(':')
        fields_, options = {}, {}
        for item in items:
            key, eq, value = item.partition('=')
            key = OPTION_ALIASES.get(key, key)
            if not eq or key in fields_ or key in options:
                raise UsageError(f"attention spec {s!r}: expected name:key=value:.. with distinct keys, got {item!r}")
            with contextlib.suppress(ValueError):
                value = json.loads(value)
            (fields_ if key in {f.name for f in fields(cls)[1:-1]} else options)[key] = value   # window, sinks, ..
        return cls(name, options=options, **fields_)

    def __str__(self):
        parts = [f'{f.name}={getattr(self, f.name)}' for f in fields(self)[1:-1] if getattr(self, f.name) != f.default]
        parts += [f'{k}={v if isinstance(v, str) else json.dumps(v, default=str)}' for k, v in self.options]
        return ':'.join([self.name] + parts)

# ---- 4. linear attention: quadratic, chunked, recurrent, triton -------------
def _scaled(k, c, M):  # phi_k_s exp(c_s - M): keys in units of exp(-M), M >= every c_s (B, H, T, F)
    return k * torch.exp(c - M[..., None])[..., None]

def linear_attention_parts(phi_q, phi_k, v, causal=True, impl='chunked', chunk_size=64, initial_state=None, c_k=None):
    """Unnormalised linear attention in PyTorch: num_t = phi_q_t^T S_t (B, H, T, D), den_t = phi_q_t^T z_t (B, H, T),
    S_t, z_t over s <= t (causal) or all s, from initial_state. The normaliser rides along as a value column of ones:
    [S | z] = sum_s phi_k_s [v_s | 1]^T, (B, H, F, D + 1). Key shifts c_k (B, H, T) (None: 0): the exact key features
    are phi_k exp(c_k), and row t comes in units of exp(-m_t), m_t the largest c_s of the keys it sees (a running max,
    as online softmax: every factor exp(c_s - m_t) <= 1, so no key overflows, and a row that sees only small keys keeps
    them). Returns num, den, m (B, H, T) and the final (S, z, m), float32; initial_state (S, z[, m = 0])."""
    q, k, v1 = _acc(phi_q), _acc(phi_k), F.pad(_acc(v), (0, 1), value=1.0)  # v1 = [v | 1] (B, H, T, D + 1)
    B, H, T, Fd = q.shape
    c = q.new_zeros(B, H, T) if c_k is None else _acc(c_k)
    Sz0, m0 = (q.new_zeros(B, H, Fd, v1.shape[-1]), q.new_full((B, H), NO_KEY)) if initial_state is None else \
        (torch.cat([initial_state[0], initial_state[1][..., None]], -1).to(q.dtype),
         initial_state[2].to(q.dtype) if len(initial_state) > 2 else q.new_zeros(B, H))
    m = (c.cummax(-1).values if causal else c.amax(-1, keepdim=True).expand_as(c)).maximum(m0[..., None])
    M = m[..., -1]  # (B, H): the final state's units, all keys in
    Sz = Sz0 * torch.exp(m0 - M)[..., None, None] + _scaled(k, c, M).transpose(-2, -1) @ v1
    if impl == 'quadratic':  # A_ts = phi_q_t . phi_k_s exp(c_s - m_t), s <= t (causal) or all s
        A = (q @ k.transpose(-2, -1)) * torch.exp((c[..., None, :] - m[..., None]).clamp(max=0))
        out = (A.tril() if causal else A) @ v1 + (q @ Sz0) * torch.exp(m0[..., None] - m)[..., None]
    elif not causal:  # bidirectional: every row reads the final state
        out = q @ Sz
    elif impl == 'recurrent':  # one token at a time: [S | z] <- [S | z] exp(m_t-1 - m_t) + phi_k_t exp(c_t - m_t) [v 1]
        outs, St, mt = [], Sz0, m0
        for t in range(T):
            kt = k[:, :, t] * torch.exp(c[..., t] - m[..., t])[..., None]
            St = St * torch.exp(mt - m[..., t])[..., None, None] + torch.einsum('bhf,bhd->bhfd', kt, v1[:, :, t])
            mt = m[..., t]
            outs.append(torch.einsum('bhf,bhfd->bhd', q[:, :, t], St))
        out = torch.stack(outs, 2)
    else:  # chunked: quadratic inside chunks of C, the state carried from chunk to chunk, O(T F D / C) memory
        C, n = chunk_size, math.ceil(T / chunk_size)
        qc, kc, vc = (F.pad(t, (0, 0, 0, n * C - T)).view(B, H, n, C, t.shape[-1]) for t in (q, k, v1))  # (B,H,n,C,*)
        cc = F.pad(c, (0, n * C - T), value=NO_KEY).view(B, H, n, C)
        mc = F.pad(m, (0, n * C - T), 'replicate').view(B, H, n, C)  # (B, H, n, C)
        A = (qc @ kc.transpose(-2, -1)) * torch.exp((cc[..., None, :] - mc[..., None]).clamp(max=0))
        Mc = mc[..., -1]  # (B, H, n): m after each chunk
        Mb = torch.cat([m0[..., None], Mc[..., :-1]], -1)  # and before it
        kv = _scaled(kc, cc, Mc).transpose(-2, -1) @ vc  # (B, H, n, F, D + 1): each chunk's keys, units exp(-M_j)
        before = [Sz0]
        for j in range(n - 1):  # the state before chunk j + 1, in units of exp(-M_j)
            before.append(before[-1] * torch.exp(Mb[..., j] - Mc[..., j])[..., None, None] + kv[:, :, j])
        out = A.tril() @ vc + (qc @ torch.stack(before, 2)) * torch.exp(Mb[..., None] - mc)[..., None]
        out = out.reshape(B, H, n * C, -1)[:, :, :T]
    return out[..., :-1], out[..., -1], m, (Sz[..., :-1], Sz[..., -1], M)  # the last column: the normaliser

def linear_attention(phi_q, phi_k, v, causal=True, impl='chunked', eps=0.0, chunk_size=64, initial_state=None,
                     return_state=False, c_k=None):
    """y_t = phi_q_t^T S_t / (phi_q_t^T z_t + eps), 0 where that is 0 (a row whose features are all 0) (Katharopoulos
    et al. 2020): phi_q, phi_k (B, H, T, F), v (B, H, T, D) -> y in v's dtype [, the final state, float32]; c_k: the
    keys' shifts (linear_attention_parts). The state is (S, z), or (S, z, m) with key shifts or such an initial_state.
    impl 'chunked' runs the Triton kernel on CUDA where it fits (causal, F <= 256, D <= 128); 'triton' insists."""
    _choose('impl', impl, IMPLS)
    if phi_q.dim() != 4 or phi_k.shape != phi_q.shape or v.dim() != 4 or v.shape[:3] != phi_k.shape[:3]:
        raise ValueError(f"phi_q, phi_k must be (B, H, T, F) and v (B, H, T, D); got {tuple(phi_q.shape)}, "
                         f"{tuple(phi_k.shape)}, {tuple(v.shape)}")
    Fd, D = phi_q.shape[-1], v.shape[-1]
    if impl == 'triton' or (impl == 'chunked' and causal and v.is_cuda and kernels.supports(Fd, D)):
        if not (causal and kernels.triton_available(v) and kernels.supports(Fd, D)):
            raise UsageError(f"impl='triton' needs causal attention, CUDA tensors (or TRITON_INTERPRET=1) and "
                             f"F <= {kernels.MAX_FEATURE_DIM}, D <= {kernels.MAX_HEAD_DIM}; got causal={causal}, "
                             f"{v.device.type}, F={Fd}, D={D}: use impl='chunked'")
        return kernels.causal_linear_attention(phi_q, phi_k, v, eps, initial_state, return_state, c_k=c_k)
    num, den, _, state = linear_attention_parts(phi_q, phi_k, v, causal, impl, chunk_size, initial_state, c_k)
    den = den + eps
    y = (num / den.where(den > 0, 1.0)[..., None]).to(v.dtype)
    shifted = c_k is not None or (initial_state is not None and len(initial_state) > 2)
    return (y, state if shifted else state[:2]) if return_state else y

def linear_attention_weights(phi_q, phi_k, causal=True, c_k=None):
    """The (B, H, T, T) matrix of linear attention: its output for the identity matrix as values."""
    eye = torch.eye(phi_q.shape[2], device=phi_q.device, dtype=_acc(phi_q).dtype).expand(*phi_q.shape[:2], -1, -1)
    return linear_attention(phi_q, phi_k, eye, causal, 'quadratic', c_k=c_k)

# ---- 5. hybrids: sliding-window softmax + linear (LoLCATs), block-diagonal softmax + linear (LLN+Diag) ---
def _band_blocks(x, w):
    """(B, H, T, E) -> (B, H, n = ceil(T / w), 3w, E): for each block b of w rows, blocks b - 1, b, b + 1 (0-padded)."""
    n = math.ceil(x.shape[2] / w)
    x = F.pad(x, (0, 0, w, (n + 1) * w - x.shape[2]))  # (B, H, (n + 2) w, E)
    return x.unfold(2, 3 * w, w).transpose(-1, -2)  # windows of 3w rows every w rows

def _in_window(i, j, w, causal):
    """Key j is in query i's window: i - w < j <= i (causal) or |i - j| < w; the linear part sees the rest."""
    return ((i - j < w) & (i >= j)) if causal else ((i - j).abs() < w)

def _window_softmax(q, k, v, visible):
    """The window part, unnormalised: (a v, sum_j a, m), a_ij = exp(s_ij - m_i) where visible, s_ij =
    q_i.k_j / sqrt(D), m_i the row's largest visible score (0 for a row that sees no key)."""
    s = torch.einsum('...id,...jd->...ij', q, k).masked_fill(~visible, float('-inf')) * q.shape[-1] ** -0.5
    m = s.amax(-1, keepdim=True).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # -inf: a row that sees no key
    a = torch.exp(s - m)
    return a @ v, a.sum(-1), m[..., 0]

def _merge(a, b):
    """Two unnormalised parts (num, den, m) over disjoint keys as one, each of true mass den exp(m) (_window_softmax's,
    linear_attention_parts'); m: the larger of the two (a row that sees no key has den 0 and adds nothing)."""
    ma, mb = (x[2].where(x[1] > 0, -math.inf) for x in (a, b))
    m = torch.maximum(ma, mb).nan_to_num(neginf=0.0)
    ra, rb = torch.exp(ma - m), torch.exp(mb - m)
    return a[0] * ra[..., None] + b[0] * rb[..., None], a[1] * ra + b[1] * rb, m

def combine_window_linear(num_w, den_w, m, num_l, den_l, c, factor, combine='joint'):
    """The window and linear parts of the sliding-window hybrid combined, per query row: num_w, den_w, m from
    _window_softmax; num_l, den_l the linear sums of shifted features (exact mass exp(c) den_l); factor (H,).
      joint (LoLCATs, ICLR 2025, Eq. 8, and its code): one normalisation of window weights gamma exp(s_ij - m_i) and
            linear weights phi(q_i).phi(k_j), gamma = factor. m_i is NOT compensated: window weights are <= gamma, on
            the kernel's scale (an exact softmax window outweighs it by exp(m_i), e^20 and more at attention sinks);
      mix   (LoLCATs workshop paper, Eq. 8): y = s num_w / den_w + (1 - s) num_l / den_l, s = factor.
    Masses compare in log space. A row without linear keys is the window part, one without window keys the
    linear part, 0 with neither. Returns y and p, the share of each row's attention on the window part, float32."""
    has_w, has_l = den_w > 0, den_l > 0
    den_w, den_l = den_w.where(has_w, 1.0), den_l.where(has_l, 1.0)
    f = factor.to(den_w.dtype).view(1, -1, *([1] * (den_w.dim() - 2)))  # (1, H, 1..) against (B, H, ..)
    p = torch.sigmoid(f.log() + den_w.log() - c - den_l.log()) if combine == 'joint' else f.expand_as(den_w)
    p = torch.where(has_w, p.where(has_l, 1.0), 0.0)  # the window part's weight
    return p[..., None] * num_w / den_w[..., None] + (1 - p[..., None]) * num_l / den_l[..., None], p

def window_linear_attention(q, k, v, phi_q, phi_k, c_q, c_k, spec, factor, causal=True, key_padding_mask=None,
                            chunk_size=64):
    """Sliding-window softmax + linear attention (LoLCATs-w), window, sinks, combine and impl from spec: softmax over
    W(i) = {i - window < j <= i} (causal) or {|i - j| < window}, phi(q_i).phi(k_j) over the other keys (exact kernel:
    exp(c_q_i + c_k_j) phi_q_i.phi_k_j). sinks: keys j < sinks join every query's softmax part (StreamingLLM's sink
    tokens, Xiao et al. 2024), not the linear part. phi_q None: sliding-window softmax alone (with its sinks); phi_k:
    0 at padding keys (c_k NO_KEY). O(T window + T F D / chunk) memory: blocks of `window` queries, linear keys
    shifted `window`."""
    (B, H, T, D), w = q.shape, spec.window
    n, N = math.ceil(T / w), min(spec.sinks, T)
    qb = F.pad(_acc(q), (0, 0, 0, n * w - T)).reshape(B, H, n, w, D)  # (B, H, n, w, D)
    i = (torch.arange(n, device=q.device) * w)[:, None, None] + torch.arange(w, device=q.device)[:, None]
    j = i[:, :1] - w + torch.arange(3 * w, device=q.device)  # (n, 1, 3w): the previous, this and the next block
    keys = torch.ones(B, T, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask
    real = _band_blocks(keys[:, None, :, None].float(), w)[..., 0] > 0.5  # (B, 1, n, 3w): not padding
    visible = _in_window(i, j, w, causal) & real[:, :, :, None, :]  # (B, 1, n, w, 3w)
    cut = lambda x: x.reshape(B, H, n * w, *x.shape[4:])[:, :, :T]  # noqa: E731, (B, H, n, w, ..) -> (B, H, T, ..)
    num_w, den_w, m = (cut(x) for x in _window_softmax(qb, _band_blocks(_acc(k), w), _band_blocks(_acc(v), w), visible))
    if N:  # the sink keys outside the window: (T, N), with the padding (B, 1, T, N)
        i, j = torch.arange(T, device=q.device)[:, None], torch.arange(N, device=q.device)
        visible = ~_in_window(i, j, w, causal) & ((i >= j) | (not causal)) & keys[:, None, None, :N]
        num_w, den_w, m = _merge((num_w, den_w, m), _window_softmax(_acc(q), _acc(k[:, :, :N]), _acc(v[:, :, :N]),
                                                                    visible))
    if phi_q is None:  # no linear part: the softmax part alone (a row with no key gives 0)
        return (num_w / den_w.where(den_w > 0, 1.0)[..., None]).to(v.dtype), torch.ones_like(den_w)
    sink = torch.arange(T, device=q.device) < N  # sinks are not in the linear part
    pk, ck = _acc(phi_k) * ~sink[:, None], c_k.masked_fill(sink, NO_KEY)
    shift = lambda x, fill=0.0: torch.cat([x.new_full((*x.shape[:2], w, *x.shape[3:]), fill), x], 2)[:, :, :T]  # noqa
    # (shift: x_t <- x_{t - w})
    lin = linear_attention_parts(phi_q, shift(pk), shift(v), True, spec.impl, chunk_size, c_k=shift(ck, NO_KEY))[:3]
    if not causal:  # plus the keys j >= i + w: the same, backwards in time
        back = linear_attention_parts(phi_q.flip(2), shift(pk.flip(2)), shift(v.flip(2)), True, spec.impl, chunk_size,
                                      c_k=shift(ck.flip(2), NO_KEY))[:3]
        lin = _merge(lin, [x.flip(2) for x in back])
    num_l, den_l, m_l = lin
    y, p = combine_window_linear(num_w, den_w, m, num_l, den_l, c_q + m_l, factor, spec.combine)
    return y.to(v.dtype), p

def lola_select(S, z, m, k, v, phi_k, c, n_keep, kv_groups):
    """LoLA's sparse-cache update (McDermott et al. 2025, Sec. 3): candidate pairs k, v (B, H_kv, n, D), with their
    features phi_k (B, H, n, F) and shifts c (B, H, n), scored by the self-recall error against the state (S, z, m),
    SRE(k, v) = ||S^T phi(k) / z^T phi(k) - v||^2 (phi(k): the key's features; 0 recalled where z^T phi(k) = 0),
    per KV head the mean over its query heads. The n_keep worst recalled stay in the cache; the rest are folded into
    the state. (The paper's SRE; its public code scores differently.) -> (kept: sorted indices (B, H_kv, n_keep),
    S, z, m)."""
    rep = lambda x: x.repeat_interleave(kv_groups, 1)  # noqa: E731, GQA: query head h reads kv head h // g
    num, den = phi_k @ S, (phi_k @ z[..., None])[..., 0]  # (B, H, n, D), (B, H, n)
    sre = (num / den.where(den > 0, 1.0)[..., None] - rep(v)).square().sum(-1).unflatten(1, (-1, kv_groups)).mean(2)
    keep = sre.topk(min(n_keep, sre.shape[-1]), -1).indices.sort(-1).values  # (B, H_kv, n_keep)
    fold = rep(torch.ones_like(sre, dtype=torch.bool).scatter(-1, keep, False))  # (B, H, n)
    c = c.masked_fill(~fold, NO_KEY)
    m_new = torch.maximum(m, c.amax(-1))
    pk, r = _scaled(phi_k * fold[..., None], c, m_new), torch.exp(m - m_new)
    return keep, S * r[..., None, None] + pk.transpose(-2, -1) @ rep(v), z * r[..., None] + pk.sum(-2), m_new

def block_diagonal_softmax(q, k, v, block, causal=True, key_padding_mask=None):
    """Softmax within blocks of `block` tokens (the last maybe shorter): LLN+Diag, Nahshan et al. 2023, Sec. 4.2."""
    B, H, T, D = q.shape
    n, pad = math.ceil(T / block), -T % block  # pad: to a whole number of blocks
    qb, kb, vb = (F.pad(t, (0, 0, 0, pad)).reshape(B, H, n, block, t.shape[-1]) for t in (q, k, v))
    keys = torch.ones(B, T, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask
    mask = F.pad(keys, (0, pad)).view(B, 1, n, 1, block)  # real keys, not padding
    mask = mask & torch.ones(block, block, dtype=torch.bool, device=q.device).tril() if causal else mask
    mask = mask | torch.eye(block, dtype=torch.bool, device=q.device)  # a padded query sees itself: finite
    return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask).reshape(B, H, n * block, -1)[:, :, :T]

# ---- 6. the attention core of one layer -------------------------------------
def _grow(cache, x, n):
    """Write x (B, H, T, D) at positions n, n+1, .. of a KV cache (B, H, capacity, D), doubling the capacity
    when it is full: one copy now and then instead of a copy of the whole cache at every token."""
    if n + x.shape[2] > cache.shape[2]:
        capacity = max(2 * cache.shape[2], n + x.shape[2])
        cache = torch.cat([cache[:, :, :n], cache.new_empty(*cache.shape[:2], capacity - n, cache.shape[3])], 2)
    cache[:, :, n:n + x.shape[2]] = x
    return cache

class Attention(nn.Module):
    """The attention of one layer, chosen by an AttnSpec (or its string); owns the feature map and the window
    factors. q (B, H, T, D), k, v come from the model's projections after RoPE, k and v repeated to H heads (the
    maps are per query head); kv_groups = H / H_kv: decode states keep the H_kv key/value heads only. max_len:
    cosformer's M unless the spec sets it (the model's block_size). teacher = True: exact softmax (conversion). share:
    after a window hybrid's forward, each row's share of attention on the softmax part (B, H, T), detached.
        y = core(q, k, v)                                            # (B, H, T, D)
        y, state = core(q, k, v, return_state=True)                  # prefill
        y, state = core(q1, k1, v1, state=state, return_state=True)  # decode; a state is updated in place"""

    def __init__(self, spec, head_dim, n_heads, causal=True, kv_groups=1, max_len=None):
        super().__init__()
        self.spec = spec = AttnSpec.parse(spec)
        if kv_groups < 1 or n_heads % kv_groups:
            raise ValueError(f"kv_groups must divide n_heads={n_heads}, got {kv_groups}")
        if spec.cache and not causal:
            raise UsageError(f"attention spec '{spec}': the sparse cache follows the tokens (causal models only)")
        self.head_dim, self.n_heads, self.causal, self.kv_groups = head_dim, n_heads, causal, kv_groups
        self.chunk_size, self.teacher, self.share = 64, False, None
        options = {'max_len': max_len} if spec.name == 'cosformer' and max_len is not None else {}
        options.update(spec.options)  # the spec's own max_len wins
        self.fmap = None if spec.name == 'softmax' else FEATURE_MAPS[spec.name](head_dim, n_heads, **options)
        if spec.window and self.fmap is not None:  # joint: gamma = sigmoid(theta) = 0.1 at init (LoLCATs' code: -2.197)
            theta = math.log(0.1 / 0.9) if spec.combine == 'joint' else 0.0  # mix: s = 1/2 until calibrate() sets it
            self.window_factor = nn.Parameter(torch.full((n_heads,), theta))

    attn = property(lambda self: self.spec.name)
    window = property(lambda self: self.spec.window)
    window_combine = property(lambda self: self.spec.combine)

    @property
    def kind(self):
        if self.teacher or (self.fmap is None and not self.window):
            return 'softmax'
        return 'window' if self.window else 'diag' if self.spec.diag_block else 'linear'

    def factor(self):
        """The window factor through its sigmoid, per head: gamma (joint) or s (mix), on the window part."""
        return torch.sigmoid(self.window_factor) if self.fmap is not None else None

    @torch.no_grad()
    def calibrate(self, q, k, key_padding_mask=None):
        """Initialisation from teacher queries/keys (B, H, T, D) of B sequences (key_padding_mask (B, T): True at real
        tokens): LLN's statistics of the real tokens; mix's s = the teacher's mean softmax mass in the softmax part
        (window and sinks) over the rows that also see other keys, exact for an average row (clamped to [1e-4,
        1 - 1e-4]), one sequence at a time (H x T x T floats)."""
        B, H, T, _ = q.shape
        real = torch.ones(B, T, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask
        if hasattr(self.fmap, 'calibrate'):
            self.fmap.calibrate(*(x.transpose(1, 2)[real.bool()].transpose(0, 1)[None] for x in (q, k)))  # (1, H, N, D)
        if self.window and self.window_combine == 'mix':
            j = torch.arange(T, device=q.device)
            seen = causal_mask(T, T, q.device) if self.causal else torch.ones(T, T, dtype=torch.bool, device=q.device)
            soft = (_in_window(j[:, None], j, self.window, self.causal) | (j < self.spec.sinks)) & seen  # (T, T)
            total, n = 0.0, 0
            for b in range(B):
                vis = seen & real[b].bool()  # the real keys of each row
                rows = real[b].bool() & (vis & ~soft).any(-1)  # real rows that see keys of the linear part too
                total = total + (softmax_weights(q[b:b + 1], k[b:b + 1], attn_mask=vis)[0] * soft).sum(-1)[:, rows] \
                    .double().sum(-1)  # (H,)
                n += int(rows.sum())
            if n:
                self.window_factor.copy_(torch.logit((total / n).clamp(1e-4, 1 - 1e-4)))

    def extra_repr(self):
        return f"spec='{self.spec}', causal={self.causal}, kv_groups={self.kv_groups}"

    def forward(self, q, k, v, state=None, return_state=False, key_padding_mask=None):
        _check_qk(q, k, self.head_dim, self.n_heads)
        if key_padding_mask is not None and self.causal:
            raise ValueError("key_padding_mask is for bidirectional (encoder) attention only")
        if state is not None and (not self.causal or state['kind'] != self.kind):
            raise ValueError(f"a decode state of {state['kind']!r} attention does not fit this "
                             f"{'causal' if self.causal else 'bidirectional'} {self.kind!r} core")
        if self.kind == 'softmax':
            y, state = self._softmax(q, k, v, state, key_padding_mask, return_state)
        else:  # the internals in float32 (float64 for float64 inputs) whatever autocast says; y in v's dtype
            with torch.autocast(q.device.type, enabled=False):
                qa, ka, va = _acc(q), _acc(k), _acc(v)
                if self.spec.cache or (state is not None and self.kind == 'window'):
                    y, state = self._window_steps(qa, ka, va, state)
                elif state is None or self.kind == 'linear':
                    y, state = self._parallel(qa, ka, va, state, key_padding_mask, return_state)
                else:  # LLN+Diag continues one token at a time
                    ys = []
                    for t in range(q.shape[-2]):
                        y, state = self._diag_step(qa[:, :, t:t + 1], ka[:, :, t:t + 1], va[:, :, t:t + 1], state)
                        ys.append(y)
                    y = torch.cat(ys, 2)
            y = y.to(v.dtype)
        return (y, state) if return_state else y

    def _softmax(self, q, k, v, state, key_padding_mask, return_state):
        """Exact softmax; its decode state is a KV cache of the H_kv heads that grows by doubling (_grow)."""
        T, g = q.shape[-2], self.kv_groups
        k, v = k[:, ::g], v[:, ::g]  # (B, H_kv, T, D): the model's own heads (they arrive repeated)
        if state is None:
            mask = None if key_padding_mask is None else key_padding_mask[:, None, None, :]
            y = softmax_attention(q, k, v, self.causal, attn_mask=mask)
            return y, return_state and {'kind': 'softmax', 'offset': T, 'k': k.contiguous(), 'v': v.contiguous()}
        n = state['offset']
        kc, vc = _grow(state['k'], k, n), _grow(state['v'], v, n)
        mask = causal_mask(T, n + T, q.device) if T > 1 else None
        y = softmax_attention(q, kc[:, :, :n + T], vc[:, :, :n + T], causal=False, attn_mask=mask)
        return y, {'kind': 'softmax', 'offset': n + T, 'k': kc, 'v': vc}

    def _parallel(self, q, k, v, state, key_padding_mask, return_state):
        """All tokens at once: linear (from a state or not), or a hybrid from scratch. The state: (S, z) in units of
        exp(-m), m the largest key shift in it, and for a hybrid the tokens still in its window / partial block."""
        T, g, causal, lin = q.shape[-2], self.kv_groups, self.causal, self.fmap is not None  # lin: a linear part
        offset = 0 if state is None else state['offset']
        phi_q, phi_k, c_q, c_k = self.fmap.features(q, k, offset) if lin else (None,) * 4
        if key_padding_mask is not None and lin:
            phi_k, c_k = phi_k * key_padding_mask[:, None, :, None], c_k.masked_fill(~key_padding_mask[:, None], NO_KEY)
        new = {'kind': self.kind, 'offset': offset + T}
        if self.kind == 'window':
            y, p = window_linear_attention(q, k, v, phi_q, phi_k, c_q, c_k, self.spec, self.factor(), causal,
                                           key_padding_mask, self.chunk_size)
            self.share = p.detach()
            if not (return_state and causal):
                return y, None
            n = min(self.spec.sinks, T)  # tokens < n: the sinks; from cut on: in the window; between: in (S, z)
            cut, e = max(T - (self.window - 1), n), k[:, ::g, :0]
            new.update(k=k[:, ::g, cut:].clone(), v=v[:, ::g, cut:].clone(), sk=k[:, ::g, :n].clone(),
                       sv=v[:, ::g, :n].clone(), gk=e, gv=e)  # g*: _window_step's cache, empty
            if not lin:
                return y, new
            m = F.pad(c_k[..., n:cut], (1, 0), value=NO_KEY).amax(-1)  # (B, H), NO_KEY when no token left
            pk = _scaled(phi_k[:, :, n:cut], c_k[..., n:cut], m)
            return y, {**new, 'phi_k': phi_k[:, :, cut:].clone(), 'c': c_k[..., cut:].clone(), 'z': pk.sum(-2),
                       'S': torch.einsum('bhtf,bhtd->bhfd', pk, v[:, :, n:cut]), 'm': m, 'gphi_k': phi_k[:, :, :0],
                       'gc': c_k[..., :0]}
        init = None if state is None else (state['S'], state['z'], state['m'])
        y, (S, z, m) = linear_attention(phi_q, phi_k, v, causal, self.spec.impl, 0.0, self.chunk_size, init, True, c_k)
        if self.kind == 'diag':
            b = self.spec.diag_block
            y = 0.5 * (y + block_diagonal_softmax(q, k, v, b, causal, key_padding_mask))
            new.update(k=k[:, ::g, T // b * b:].clone(), v=v[:, ::g, T // b * b:].clone())  # the partial block
        return y, {**new, 'S': S, 'z': z, 'm': m}

    def _diag_step(self, q, k, v, state):
        """One decode token of LLN+Diag: linear attention from (S, z), softmax over its block so far."""
        g, offset = self.kv_groups, state['offset']
        phi_q, phi_k, c_q, c_k = self.fmap.features(q, k, offset)
        kw, vw = torch.cat([state['k'], k[:, ::g]], 2), torch.cat([state['v'], v[:, ::g]], 2)  # (B, H_kv, <=b, D)
        y, (S, z, m) = linear_attention(phi_q, phi_k, v, True, 'recurrent', 0.0, 1, (state['S'], state['z'],
                                                                                       state['m']), True, c_k)
        y = 0.5 * (y + softmax_attention(q, kw, vw, causal=False))
        keep = kw.shape[2] if (offset + 1) % self.spec.diag_block else 0  # a full block empties the buffer
        return y, {'kind': 'diag', 'offset': offset + 1, 'S': S, 'z': z, 'm': m, 'k': kw[:, :, :keep],
                   'v': vw[:, :, :keep]}

    def _window_steps(self, q, k, v, state):
        """The window hybrid's decoding, and LoLA's sparse cache (spec.cache = N pairs) in prefill and decode alike: the
        tokens go in segments that end when C pairs have left the window since the last update (the pending block;
        C = chunk_size with a cache, else 1); then the pending block and the cache compete (lola_select). Query t's
        softmax part: the sinks, the cache, and the tokens from the pending block's first to t; its linear part: the
        state (S, z), fixed within a segment. Without a cache a token joins (S, z) as it leaves the window."""
        (B, H, T, D), g = q.shape, self.kv_groups
        if state is None:  # the sinks, the cache (g*), the buffer (the pending block, the window): empty
            F_, e = self.fmap.feature_dim, lambda *shape: q.new_zeros(B, *shape)  # noqa: E731
            state = {'kind': 'window', 'offset': 0, 'S': e(H, F_, D), 'z': e(H, F_), 'm': q.new_full((B, H), NO_KEY),
                     **{n: e(H // g, 0, D) for n in ('sk', 'sv', 'gk', 'gv', 'k', 'v')}, 'gphi_k': e(H, 0, F_),
                     'phi_k': e(H, 0, F_), 'gc': e(H, 0), 'c': e(H, 0)}
        out, t, C = [], 0, self.chunk_size if self.spec.cache else 1
        while t < T:
            p = max(state['offset'] - state['k'].shape[2], self.spec.sinks)  # the buffer's first token
            n = min(T - t, p + C + self.window - 1 - state['offset'])
            out.append(self._window_step(q[:, :, t:t + n], k[:, :, t:t + n], v[:, :, t:t + n], state, C))
            t, state = t + n, out[-1][2]
        self.share = torch.cat([o[1] for o in out], 2)
        return torch.cat([o[0] for o in out], 2), state

    def _window_step(self, q, k, v, state, C):
        """Tokens q, k, v (B, H, n, D) after the state's, at most up to the next update: (y, share, the new state)."""
        n, g, o, lin = q.shape[2], self.kv_groups, state['offset'], self.fmap is not None
        s = min(max(self.spec.sinks - o, 0), n)  # the new tokens that are sinks
        new = {'sk': k[:, ::g, :s], 'sv': v[:, ::g, :s], 'k': k[:, ::g, s:], 'v': v[:, ::g, s:]}
        if lin:
            phi_q, phi_k, c_q, c_k = self.fmap.features(q, k, o)
            new.update(phi_k=phi_k[:, :, s:], c=c_k[..., s:])
        st = {**state, 'offset': o + n, **{x: torch.cat([state[x], t], 2) for x, t in new.items()}}
        L, kv = st['k'].shape[2], lambda x: x.repeat_interleave(g, 1)  # noqa: E731
        pos = torch.cat([torch.arange(st['sk'].shape[2]), torch.full((st['gk'].shape[2],), -1),  # the cache: always
                         torch.arange(o + n - L, o + n)]).to(q.device)  # the keys' positions: sinks, cache, buffer
        keys, vals = (kv(torch.cat([st[a], st[b], st[c]], 2)) for a, b, c in (('sk', 'gk', 'k'), ('sv', 'gv', 'v')))
        num_w, den_w, mw = _window_softmax(q, keys, vals, pos <= torch.arange(o, o + n, device=q.device)[:, None])
        y, p = (num_w / den_w[..., None], torch.ones_like(den_w)) if not lin else combine_window_linear(
            num_w, den_w, mw, phi_q @ st['S'], (phi_q @ st['z'][..., None])[..., 0], c_q + st['m'][..., None],
            self.factor(), self.window_combine)
        if L == self.window - 1 + C:  # a full pending block: it and the cache compete, the rest joins (S, z)
            if lin:
                cand = [torch.cat([st['g' + x], st[x][:, :, :C]], 2) for x in ('k', 'v', 'phi_k', 'c')]
                keep, st['S'], st['z'], st['m'] = lola_select(st['S'], st['z'], st['m'], *cand, self.spec.cache, g)
                for x, i, c in zip(('k', 'v', 'phi_k', 'c'), (keep, keep, kv(keep), kv(keep)), cand):
                    st['g' + x] = c.gather(2, i if c.dim() == 3 else i[..., None].expand(*i.shape, c.shape[-1]))
            st.update({x: st[x][:, :, C:] for x in ('k', 'v', 'phi_k', 'c') if x in st})
        return y, p, st

    def weights(self, q, k, key_padding_mask=None):
        """The (B, H, T, T) matrix this core applies, float32: its output for the identity matrix as values."""
        eye = torch.eye(k.shape[-2], device=k.device).expand(*k.shape[:2], -1, -1)
        return self(q.float(), k.float(), eye, key_padding_mask=key_padding_mask)

def state_nbytes(state):
    """Bytes held by a decode state (a dict of tensors, or a list of them, one per layer), all KV capacity included."""
    if isinstance(state, (list, tuple)):
        return sum(state_nbytes(s) for s in state)
    return sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t)) if state else 0

# ---- 7. metrics and DoF's kernel loss ---------------------------------------
def attention_entropy(w, eps=1e-12):
    """Row entropies -sum_j w_ij log w_ij in nats: (B, H, T, T) -> (B, H, T) (Hedgehog Fig. 4)."""
    return -(w.float() * (w.float() + eps).log()).sum(-1)

def spectral_gap(w):
    """1 - |lambda_2| of each row-stochastic (B, H, T, T) matrix -> (B, H) float64 (eigenvalues sorted by modulus,
    lambda_1 = 1). Meant for bidirectional matrices: a causal one's eigenvalues are its diagonal."""
    return 1.0 - torch.linalg.eigvals(w.double()).abs().sort(dim=-1, descending=True).values[..., 1]

def ranks(x):
    """Ranks along the last dimension, ties sharing their mean rank, float64."""
    x = x.double().contiguous()
    s = x.sort(-1).values
    return (torch.searchsorted(s, x) + torch.searchsorted(s, x, right=True) - 1).double() / 2

def monotonicity(w, q, k, causal=True):
    """How monotonic attention weights are in q.k (Hedgehog Fig. 3, Sec. 3.2): the Spearman correlation, per
    query row, of w_ij and s_ij = q_i.k_j / sqrt(D) over the keys the row sees (rows with fewer than 3 keys
    skipped), averaged per head. Returns (rho (B, H) float64, (scores, weights) of every visible pair, 1-D)."""
    s = (q.double() @ k.double().transpose(-2, -1)) * q.shape[-1] ** -0.5
    w, T, rhos = w.double(), w.shape[-1], []
    for i in range(2 if causal else 0, w.shape[-2]):
        rs, rw = (ranks(x[..., i, :i + 1 if causal else T]) for x in (s, w))
        rs, rw = rs - rs.mean(-1, keepdim=True), rw - rw.mean(-1, keepdim=True)
        rhos.append((rs * rw).sum(-1) / ((rs.square().sum(-1) * rw.square().sum(-1)).sqrt() + 1e-30))
    vis = causal_mask(T, T, w.device).expand_as(w) if causal else torch.ones_like(w, dtype=torch.bool)
    return torch.stack(rhos, -1).mean(-1), (s[vis].float(), w[vis].float())

def kl_divergence(p, q, eps=1e-12):
    """KL(p || q) per row of two (B, H, T, T) attention matrices -> (B, H, T), nats."""
    return (p.float() * ((p.float() + eps).log() - (q.float() + eps).log())).sum(-1)

def kernel_l2(phi_q, phi_k, q, k, causal=True):
    """DoF's kernel loss: the mean squared error of phi(q_i).phi(k_j) against exp(q_i.k_j / sqrt(D)) over the
    visible pairs (quadratic in T), unnormalised: pass exact features (fmap.features' phi_q times exp(c_q + c_k))."""
    err = (phi_q.float() @ phi_k.float().transpose(-2, -1) -
           torch.exp((q.float() @ k.float().transpose(-2, -1)) * q.shape[-1] ** -0.5)).square()
    return err.masked_select(causal_mask(*err.shape[-2:], err.device).expand_as(err)).mean() if causal else err.mean()
