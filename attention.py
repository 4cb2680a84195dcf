"""Attention, softmax and linear, in one file. In reading order:
  1. softmax attention, the reference (Vaswani et al. 2017)
  2. feature maps phi (FEATURE_MAPS): Hedgehog, LoLCATs, Linear Log-Normal (LLN), Degrees of
     Freedom (DoF), baselines
  3. AttnSpec: the attention of a layer as one value, e.g. 'hedgehog:feature_dim=64:window=64'
  4. linear attention, four impls (quadratic, chunked, recurrent, triton) equal to float32
     precision; 4b. the delta rule (DeltaNet, Gated DeltaNet), recurrent and chunked
  5. metrics (entropy, spectral gap, monotonicity, KL) and DoF's kernel loss
The hybrids, the decode states and the layer core model.py calls (`Attention`) are in hybrids.py.

Linear attention, for one head (Katharopoulos et al. 2020, Eq. 4-6):
    y_t = phi(q_t)^T S_t / phi(q_t)^T z_t
    S_t = sum_{s<=t} phi(k_s) v_s^T,   z_t = sum_{s<=t} phi(k_s)
S (F x D), z (F) accumulate in float32; feature maps return float32; every core but exact softmax
computes in float32 also under bf16/fp16 autocast. q, k, v: (B, H, T, D = head_dim);
phi: (B, H, T, F).
"""

import contextlib
import functools
import json
import math
import re
from dataclasses import dataclass, fields
from typing import get_args, get_type_hints

import torch
import torch.nn as nn
import torch.nn.functional as nnf   # F is the feature dimension

import kernels

NO_KEY = -1e30   # a missing key's shift (padding, sinks), and the running max of a row seeing none

class UsageError(ValueError):
    """What the user asked for cannot be done (a flag, a spec, a path, a file's contents): the
    scripts' main() print it in one line and exit with status 2; any other exception is a bug and
    keeps its traceback. (Here, at the bottom of the imports, so that every module can raise it.)"""

def acc(x):
    """x in the accumulation dtype: float32, or float64 when given float64 (the float64 checks)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()

def cast(x, dtype):
    """x in dtype, with no op where it is already (a decode step's ops are counted,
    tests/test_model.py)."""
    return x if x.dtype == dtype else x.to(dtype)

def apply_rope(x, cos, sin):
    """RoPE (HF Llama's rotate_half layout): x (B, H, T, D) rotated by angles whose cos, sin are
    (T, D); with -sin, rotated back."""
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)

def _choose(what, value, choices):
    if value not in choices:
        raise UsageError(f"unknown {what} {value!r}; choose one of: {', '.join(map(str, choices))}")

def check_qk(q, k, head_dim, n_heads):
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError("q and k must be (B, H, T, D) with the same B, H, D; "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}")
    if (q.shape[1], q.shape[-1]) != (n_heads, head_dim):
        raise ValueError(f"n_heads / head_dim mismatch: built for H={n_heads}, D={head_dim}; "
                         f"got q {tuple(q.shape)}")

# ---- 1. softmax attention, the reference ------------------------------------
def softmax_attention(q, k, v, causal=True, attn_mask=None):
    """softmax(q k^T / sqrt(D)) v (Vaswani et al. 2017, Eq. 1), by PyTorch's SDPA. attn_mask: bool
    (B, H, T_q, T_k), True = may attend, replaces causal. k, v may have fewer heads than q (GQA)."""
    causal = causal and attn_mask is None and q.shape[-2] > 1
    return nnf.scaled_dot_product_attention(q, k, v, attn_mask, is_causal=causal,
                                            enable_gqa=k.shape[1] != q.shape[1])   # GQA

def causal_mask(T_q, T_k, device=None):
    """(T_q, T_k) bool, True where query i (at absolute position T_k - T_q + i) may see key j."""
    query_positions = torch.arange(T_q, device=device)[:, None] + (T_k - T_q)
    return torch.arange(T_k, device=device) <= query_positions

def identity_values(x):
    """(B, H, T, T) identity matrices for x (B, H, T, .), float32 (float64 stays): as values, an
    attention's output is its weights."""
    eye = torch.eye(x.shape[2], device=x.device, dtype=acc(x).dtype)
    return eye.expand(*x.shape[:2], -1, -1)

def softmax_weights(q, k, causal=True, attn_mask=None):
    """The (B, H, T, T) matrix of softmax attention, float32: its output for identity values."""
    k = k.float()
    return softmax_attention(q.float(), k, identity_values(k), causal, attn_mask)

# ---- 2. feature maps: fmap(q, k, offset) -> (phi_q, phi_k), float32 (B, H, T, F) ---
class FeatureMap(nn.Module):
    """Base class. q and k come together (LLN treats them differently; cosFormer needs positions:
    offset = the absolute position of the first token). A map implements phi(x, which, offset),
    which in {'q', 'k'}, or, exp-based (log_domain), the log-features log_phi(x, which, offset), phi
    = exp(log_phi). Range (attention sinks make q, k large; Performer's and DoF's exp(-|x|^2 / 2
    sqrt D) are tiny at large norms): `features` divides an exp-based phi(x) by exp(c), c its
    detached largest log-feature, for every query and key: every feature <= 1. A query's c_q cancels
    in its row; the keys' c_k go to linear attention, which weighs key s in row t by exp(c_s - m_t),
    m_t the largest c_k the row sees (linear_attention_parts). forward(q, k): phi_q and phi_k with
    ONE key shift per sequence and head (the largest), cancelling in the normalisation: plain
    features while the keys' scales lie within float32's range (e^+-87). shift=False: no shifts."""

    log_domain = False

    def __init__(self, head_dim, n_heads, feature_dim=None):   # F: head_dim unless given
        super().__init__()
        self.head_dim = head_dim
        self.n_heads = n_heads
        self.feature_dim = feature_dim or head_dim
        self.shift = True

    def forward(self, q, k, offset=0):
        phi_q, phi_k, _, c_k = self.features(q, k, offset)
        return phi_q, phi_k * torch.exp(c_k - c_k.amax(-1, keepdim=True))[..., None]

    def features(self, q, k, offset=0):
        """(phi_q, phi_k, c_q, c_k), c (B, H, T): phi(q) = phi_q exp(c_q), phi(k) = phi_k exp(c_k),
        float32 (float64 inputs: float64) also under autocast; c = 0 for maps not exp-based."""
        check_qk(q, k, self.head_dim, self.n_heads)
        with torch.autocast(q.device.type, enabled=False):
            q = acc(q)
            k = acc(k)
            if not self.log_domain:
                phi_q, phi_k = self._sides(self.phi, q, k, offset)
                c = phi_q.new_zeros(phi_q.shape[:-1])   # c: 0, one tensor for sides of one shape
                return phi_q, phi_k, c, c if q.shape == k.shape else phi_k.new_zeros(k.shape[:-1])
            u_q, u_k = self._sides(self.log_phi, q, k, offset)
            c_q, c_k = (u.detach().amax(-1) * self.shift for u in (u_q, u_k))
            return torch.exp(u_q - c_q[..., None]), torch.exp(u_k - c_k[..., None]), c_q, c_k

    def _sides(self, fn, q, k, offset):
        """fn(q, 'q', offset), fn(k, 'k', offset); in one call on q and k stacked (2, B, H, T, D)
        where they have one shape (LLN, which treats the two differently, overrides it)."""
        if q.shape == k.shape:
            return fn(torch.stack([q, k]), 'qk', offset).unbind(0)
        return fn(q, 'q', offset), fn(k, 'k', offset)

    def phi(self, x, which, offset):  # the exact features of one side
        return torch.exp(self.log_phi(acc(x), which, offset))

def _per_head_linear(x, weight, bias=None):
    """One Linear per head: x (..., H, T, D), weight (H, F, D), bias (H, F) -> (..., H, T, F), as
    one batched product over the heads (the weights are not copied: the rows of x are)."""
    y = torch.einsum('...htd,hfd->...htf', x, cast(weight, x.dtype))
    return y if bias is None else y + cast(bias, x.dtype)[:, None]

class EluFeatureMap(FeatureMap):
    """phi(x) = 1 + ELU(x) (Katharopoulos et al. 2020, Eq. 7); F = D, no parameters."""

    def phi(self, x, which, offset):
        return nnf.elu(x) + 1

class ReluFeatureMap(FeatureMap):
    """phi(x) = ReLU(x), F = D (Kasai et al. 2021; cosFormer, Qin et al. 2022, no reweighting)."""

    def phi(self, x, which, offset):
        return nnf.relu(x)

class T2RFeatureMap(FeatureMap):
    """phi(x) = ReLU(W x + b), trained, shared by q and k (T2R, Kasai et al. 2021, Eq. 4); per head
    W (F, D), b (F), F = feature_dim (default D), init U(-1/sqrt(D), 1/sqrt(D)) as nn.Linear."""

    def __init__(self, head_dim, n_heads, feature_dim: int | None = None):
        super().__init__(head_dim, n_heads, feature_dim)
        bound = 1 / math.sqrt(head_dim)
        weight = torch.empty(n_heads, self.feature_dim, head_dim).uniform_(-bound, bound)
        self.weight = nn.Parameter(weight)                                       # (H, F, D)
        self.bias = nn.Parameter(torch.empty(n_heads, self.feature_dim).uniform_(-bound, bound))

    def phi(self, x, which, offset):
        return nnf.relu(_per_head_linear(x, self.weight, self.bias))

def _orthogonal_gaussian(n_heads, m, d, generator=None):
    """(n_heads, m, d) orthogonal random features (Choromanski et al. 2020, Sec. 2.4): blocks of d
    orthogonal rows (Haar: QR of a Gaussian, signs fixed), each with a N(0, I_d) draw's norm."""
    def rotation():
        qmat, r = torch.linalg.qr(torch.randn(d, d, generator=generator))
        return (qmat * torch.sign(torch.diagonal(r))).T

    def head():   # (m, d): rotations stacked, rows rescaled to Gaussian norms
        rows = torch.cat([rotation() for _ in range(math.ceil(m / d))])[:m]
        return rows * torch.randn(m, d, generator=generator).norm(dim=1, keepdim=True)
    return torch.stack([head() for _ in range(n_heads)])

class PerformerFeatureMap(FeatureMap):
    """FAVOR+ (Choromanski et al. 2020, Lemma 1, Eq. 7): phi(x) = exp(w_m . x' - |x'|^2 / 2) /
    sqrt(M), x' = x D^-1/4, w_m orthogonal N(0, I) (buffer omega): E[phi(q).phi(k)] = exp(q.k /
    sqrt(D)). M = feature_dim (default 2D); stabilize=False: no shifts; redraw_interval > 0: new w_m
    every that many training calls."""

    log_domain = True

    def __init__(self, head_dim, n_heads, feature_dim: int | None = None, stabilize: bool = True,
                 redraw_interval: int = 0, seed: int | None = None):
        super().__init__(head_dim, n_heads, feature_dim or 2 * head_dim)
        self.shift = bool(stabilize)
        self.redraw_interval = redraw_interval
        self.calls = 0
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        omega = _orthogonal_gaussian(n_heads, self.feature_dim, head_dim, self.generator)
        self.register_buffer('omega', omega)                                     # (H, M, D)

    def features(self, q, k, offset=0):
        if self.training and self.redraw_interval > 0:
            if self.calls > 0 and self.calls % self.redraw_interval == 0:
                self.omega.copy_(_orthogonal_gaussian(*self.omega.shape, self.generator))
            self.calls += 1
        return super().features(q, k, offset)

    def log_phi(self, x, which, offset):
        x = x * self.head_dim ** -0.25
        norm2 = (x * x).sum(-1, keepdim=True)
        return _per_head_linear(x, self.omega) - 0.5 * norm2 - 0.5 * math.log(self.feature_dim)

class CosformerFeatureMap(FeatureMap):
    """cosFormer (Qin et al. 2022, Eq. 9-11): phi(x_i) = [ReLU(x_i) cos(pi i / 2M), ReLU(x_i) sin(pi
    i / 2M)]: phi(q_i).phi(k_j) = ReLU(q_i).ReLU(k_j) cos(pi (i - j) / 2M); F = 2D. M = max_len
    (default 2048, the context length), fixed where the paper takes the length, so causal."""

    def __init__(self, head_dim, n_heads, max_len: int = 2048):
        super().__init__(head_dim, n_heads, 2 * head_dim)
        self.max_len = max_len

    def phi(self, x, which, offset):
        T = x.shape[-2]
        if offset + T > self.max_len:
            raise UsageError(f"cosformer: position {offset + T - 1} is beyond "
                             f"max_len={self.max_len} (set it larger)")
        positions = torch.arange(offset, offset + T, device=x.device, dtype=x.dtype)
        angle = (math.pi / (2 * self.max_len) * positions)[:, None]                 # (T, 1)
        return torch.cat([nnf.relu(x) * angle.cos(), nnf.relu(x) * angle.sin()], dim=-1)

class TaylorFeatureMap(FeatureMap):
    """2nd-order Taylor of exp (Hedgehog Sec. 4.1; Based, Arora et al. 2024): phi(x) = [1, x /
    D^1/4, vec(x x^T) / sqrt(2D)], so phi(q).phi(k) = 1 + s + s^2 / 2, s = q.k / sqrt(D); F = 1 + D
    + D^2."""

    def __init__(self, head_dim, n_heads):
        super().__init__(head_dim, n_heads, 1 + head_dim + head_dim ** 2)

    def phi(self, x, which, offset):   # (B, H, T, D) -> (B, H, T, 1 + D + D^2)
        x2 = (x[..., :, None] * x[..., None, :]).flatten(-2) / math.sqrt(2 * self.head_dim)
        return torch.cat([torch.ones_like(x[..., :1]), x * self.head_dim ** -0.25, x2], dim=-1)

class ExpFeatureMap(FeatureMap):
    """phi(x) = exp(t x) elementwise, t = temperature (default 1) (Hedgehog Sec. 3.2: spiky but not
    monotonic in q.k, the control for Hedgehog's map); F = D, no parameters."""

    log_domain = True

    def __init__(self, head_dim, n_heads, temperature: float = 1.0):
        super().__init__(head_dim, n_heads)
        self.temperature = temperature

    def log_phi(self, x, which, offset):
        return self.temperature * x

class HedgehogFeatureMap(FeatureMap):
    """Hedgehog (Zhang et al. 2024, Eq. 3, 5-6): u = W x + b, a Linear(D, F/2) per head shared by q
    and k, init W = I, b = 0; phi(x) = [softmax(u), softmax(-u)] over the features
    (softmax_dim=True, Eq. 5: each half sums to 1, part of the map) or [exp(u), exp(-u)]
    (softmax_dim=False, Eq. 3). F = feature_dim, default 2D."""

    def __init__(self, head_dim, n_heads, feature_dim: int | None = None, softmax_dim: bool = True):
        super().__init__(head_dim, n_heads)
        self._mlp(feature_dim, 'softmax' if softmax_dim else 'exp', torch.eye)

    def _mlp(self, feature_dim, activation, init):
        """Per-head Linear(D, width), weight init(width, D); F: width, doubled for [f(u), f(-u)]."""
        pm = activation in ('softmax', 'exp')
        self.activation = activation
        self.log_domain = activation == 'exp'
        self.feature_dim = feature_dim or (2 if pm else 1) * self.head_dim
        if pm and self.feature_dim % 2:
            raise UsageError(f"{activation} features [f(u), f(-u)] need an even feature_dim, "
                             f"got {self.feature_dim}")
        width = self.feature_dim // 2 if pm else self.feature_dim
        # (H, width, D)
        self.weight = nn.Parameter(init(width, self.head_dim).repeat(self.n_heads, 1, 1))
        self.bias = nn.Parameter(torch.zeros(self.n_heads, width))

    def project(self, x):
        return _per_head_linear(x, self.weight, self.bias)

    def phi(self, x, which, offset):
        u = self.project(x)
        if self.activation in ('elu', 'relu'):  # LoLCATs' one-sided features
            return nnf.elu(u) + 1 if self.activation == 'elu' else nnf.relu(u)
        f = torch.exp if self.log_domain else lambda t: torch.softmax(t, dim=-1)
        return torch.cat([f(u), f(-u)], dim=-1)

    def log_phi(self, x, which, offset):
        u = self.project(x)
        return torch.cat([u, -u], dim=-1)

class LolcatsFeatureMap(HedgehogFeatureMap):
    """LoLCATs (Zhang et al. 2025, Eq. 6, Table 1): phi(x) = f(u), u = x W + b + x, a per-head
    Linear(D, F') with a skip connection (its first min(D, F') coordinates), init W = 0, b = 0. f:
    'softmax' [softmax(u), softmax(-u)] or 'exp' [exp(u), exp(-u)], F = 2F' (default 2D); 'elu' 1 +
    ELU(u) or 'relu' ReLU(u), F = F' (default D). Unlike the official code, no clamp at 1e-12."""

    def __init__(self, head_dim, n_heads, feature_dim: int | None = None,
                 activation: str = 'softmax'):
        FeatureMap.__init__(self, head_dim, n_heads)
        _choose('lolcats activation', activation, ('softmax', 'exp', 'elu', 'relu'))
        self._mlp(feature_dim, activation, torch.zeros)

    def project(self, x):
        width = self.weight.shape[1]
        if width == self.head_dim:   # the skip connection: x itself (no pad op in a decode step:
                                     # tests/test_model.py counts them)
            return super().project(x) + x
        return super().project(x) + nnf.pad(x[..., :width], (0, max(width - self.head_dim, 0)))

LLN_MATCH = ('paper', 'entropy', 'none')

def _lln_log_weights(q, k, s2):
    """log P of LLN's bidirectional attention with alpha = beta = sqrt(s2 / 2) on q, k (n, T, D)."""
    t = math.sqrt(s2 / 2)
    log_k = (torch.exp(t * q) @ torch.exp(t * k).mT).log()
    return log_k - log_k.logsumexp(-1, keepdim=True)

@functools.lru_cache(maxsize=None)
def lln_fit(head_dim, n_tokens=256, reps=8, seed=0):
    """(a, b) of LLN's variance model sigma_lln^2 = a s~^2 + b, s~^2 = alpha^2 s_q^2 + beta^2 s_k^2
    (Nahshan et al. 2023, Eq. 10, App. A.7, as we read it): a line through Var[log P_ij] of LLN
    attention at s~^2 = 1..16 (n_tokens keys, q, k ~ N(0, I_D)). D = 64: a = 0.1482, b = -0.3600
    (published: 0.1486, -0.3549)."""
    grid = torch.linspace(1.0, 16.0, 16, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    ys = []
    for s2 in grid.tolist():
        q, k = torch.randn(2, reps, n_tokens, head_dim, generator=g, dtype=torch.float64)
        ys.append(_lln_log_weights(q, k, s2).var())
    A = torch.vander(grid, 2)                                    # (16, 2): columns s~^2, 1
    return tuple(torch.linalg.lstsq(A, torch.stack(ys)[:, None]).solution.squeeze(1).tolist())

@functools.lru_cache(maxsize=None)
def lln_entropy_fit(head_dim, n_tokens=256, reps=16, seed=0, s2_max=8.0, step=0.5):
    """match='entropy' (ours: docs/RESULTS.md's LLN Fig. 2 shows moment matching leaves LLN's rows
    spikier than softmax): for s^2 = 0, 0.5, .., 8 the s~^2 where LLN's mean row entropy (monotone
    in s~^2) equals softmax's (n_tokens keys, q, k ~ N(0, I_D)) -> (s^2 grid, s~^2 grid)."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, reps, n_tokens, head_dim, generator=g, dtype=torch.float64)

    def entropy(log_w):   # the mean row entropy
        return -(log_w.exp() * log_w).sum(-1).mean().item()
    s2_grid = torch.arange(0.0, s2_max + step / 2, step, dtype=torch.float64)
    dots = q @ k.mT / math.sqrt(head_dim)
    h_sm = s2_grid.new_tensor([entropy(torch.log_softmax(s * dots, -1)) for s in s2_grid.sqrt()])
    xs = [0.0]                     # s~^2 = 0: uniform weights,
    h_lln = [math.log(n_tokens)]   # entropy log n
    while h_lln[-1] > h_sm[-1].item() and xs[-1] < 1000:
        xs.append(xs[-1] + step)
        h_lln.append(entropy(_lln_log_weights(q, k, xs[-1])))
    h_lln = torch.tensor(h_lln, dtype=torch.float64)
    if not (h_lln[1:] < h_lln[:-1]).all() or h_lln[-1] > h_sm[-1]:
        raise RuntimeError(f"LLN's entropy is not monotone in s~^2, or never as low as softmax's "
                           f"at s^2 = {s2_max}, at head_dim={head_dim}, n_tokens={n_tokens}")
    return s2_grid, _interp(-h_sm, -h_lln, torch.tensor(xs, dtype=torch.float64))

def _interp(x, xp, fp):
    """Piecewise-linear interpolation of (xp, fp) at x, xp increasing; linear beyond the ends."""
    i = torch.searchsorted(xp, x).clamp(1, len(xp) - 1)
    return fp[i - 1] + (fp[i] - fp[i - 1]) * (x - xp[i - 1]) / (xp[i] - xp[i - 1])

def lln_alpha_beta(sigma2_q, sigma2_k, head_dim, match='paper'):
    """LLN's temperatures (Nahshan et al. 2023, Eq. 10) from the q/k variances, alpha s_q = beta
    s_k: alpha = sqrt(s~^2 / 2) / s_q, beta = sqrt(s~^2 / 2) / s_k. For softmax's log-variance s^2 =
    s_q^2 s_k^2, s~^2 answers: 'paper' equal attention log-variance, a s~^2 + b = s^2, (a, b) =
    lln_fit; 'entropy' equal mean row entropy on Gaussian inputs (lln_entropy_fit); 'none' alpha =
    beta = 1 (the paper's ablation). s~^2 / 2 >= 1e-4 (the fit gives s~^2 < 0 when s^2 < b)."""
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
    """Linear Log-Normal attention (Nahshan et al. 2023, Eq. 9-10): phi_q = exp(alpha q), phi_k =
    exp(beta k), alpha, beta per head by lln_alpha_beta(.., match); F = D. The variances: buffers,
    init 1, set by calibrate(q, k) (the official code: whole batch and sequence, later tokens too);
    in training an EMA (momentum 0.1) updated AFTER each forward (causal); frozen in eval."""

    log_domain = True

    def __init__(self, head_dim, n_heads, momentum: float = 0.1, match: str = 'paper'):
        super().__init__(head_dim, n_heads)
        _choose('LLN match', match, LLN_MATCH)
        self.momentum = momentum
        self.match = match
        self.register_buffer('sigma2_q', torch.ones(n_heads))
        self.register_buffer('sigma2_k', torch.ones(n_heads))

    @torch.no_grad()
    def calibrate(self, q, k, weight=1.0):
        """Move the statistics to those of calibration queries/keys (B, H, T, D); weight < 1: an EMA
        step. Per head, over batch, time and dimension."""
        for sigma2, x in ((self.sigma2_q, q), (self.sigma2_k, k)):
            per_head = x.detach().float().transpose(0, 1).flatten(1)         # (H, B T D)
            sigma2.lerp_(per_head.var(1, unbiased=False).to(sigma2.dtype), weight)

    def alpha_beta(self):
        return lln_alpha_beta(self.sigma2_q.double(), self.sigma2_k.double(),
                              self.head_dim, self.match)

    def log_phi(self, x, which, offset):
        return self.alpha_beta()[which == 'k'].to(x.dtype)[:, None, None] * x  # alpha or beta

    def _sides(self, fn, q, k, offset):   # alpha q, beta k: the temperatures computed once
        alpha, beta = (t.to(q.dtype)[:, None, None] for t in self.alpha_beta())   # (H, 1, 1)
        return alpha * q, beta * k

    def features(self, q, k, offset=0):
        out = super().features(q, k, offset)
        if self.training:  # this batch's statistics count from the next forward on (causal honesty)
            self.calibrate(q, k, self.momentum)
        return out

class DoFFeatureMap(FeatureMap):
    """Learned weighted positive random features (DoF paper, Sec. 3, Eq. 8): phi(x)_m = sqrt(a_m /
    M) exp(z_m.x / D^1/4 - |x|^2 / (2 sqrt D)) per head; z_m init orthogonal N(0, I), log a_m init 0
    (Performer's unbiased estimate); both trained. M = feature_dim (default D)."""

    log_domain = True

    def __init__(self, head_dim, n_heads, feature_dim: int | None = None, seed: int | None = None):
        super().__init__(head_dim, n_heads, feature_dim)
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        self.z = nn.Parameter(_orthogonal_gaussian(n_heads, self.feature_dim, head_dim, g))
        self.log_a = nn.Parameter(torch.zeros(n_heads, self.feature_dim))

    def log_phi(self, x, which, offset):
        D = self.head_dim
        norm2 = (x * x).sum(-1, keepdim=True)
        u = _per_head_linear(x, self.z) * D ** -0.25 - norm2 / (2 * math.sqrt(D))
        return u + 0.5 * self.log_a.to(x.dtype)[:, None, :] - 0.5 * math.log(self.feature_dim)

FEATURE_MAPS = {'elu': EluFeatureMap, 'relu': ReluFeatureMap, 't2r': T2RFeatureMap,
                'performer': PerformerFeatureMap, 'cosformer': CosformerFeatureMap,
                'taylor': TaylorFeatureMap, 'exp': ExpFeatureMap, 'hedgehog': HedgehogFeatureMap,
                'lolcats': LolcatsFeatureMap, 'lln': LLNFeatureMap, 'dof': DoFFeatureMap}
ATTN_CHOICES = ['softmax'] + list(FEATURE_MAPS)

def make_feature_map(name, head_dim, n_heads, **options):
    _choose('feature map', name, FEATURE_MAPS)
    AttnSpec(name, options=options)  # checks the options
    return FEATURE_MAPS[name](head_dim, n_heads, **options)

# ---- 3. the attention choice as one value -----------------------------------
IMPLS = ('quadratic', 'chunked', 'recurrent', 'triton')
WINDOW_COMBINES = ('joint', 'mix')
OPTION_ALIASES = {'t': 'temperature', 'f': 'feature_dim'}

def _fits(value, annotation):
    """value has the annotated type: int, float (an int too), bool, str, or a union (int | None)."""
    return any(type(value) is t or (t is float and type(value) is int)
               for t in get_args(annotation) or (annotation,))

@dataclass(frozen=True)
class AttnSpec:
    """The attention of a layer as 'name[:key=value..]': 'softmax', 'hedgehog:feature_dim=64',
    'exp:t=2', 'lolcats:window=64:combine=mix'. parse reads it, str() writes it without defaults.
    Keys besides the settings below are the map's options (t = temperature, f = feature_dim), typed
    by its __init__'s annotations; values are JSON where they parse (a str setting or option: as
    written). A changed copy: dataclasses.replace(spec, impl='recurrent') (options: a dict too)."""
    name: str = 'softmax'     # 'softmax' or a FEATURE_MAPS key
    window: int = 0           # > 0: sliding-window softmax + linear (LoLCATs), or alone for softmax
    sinks: int = 0            # the first tokens, kept in the window's softmax part (StreamingLLM)
    cache: int = 0            # > 0: LoLA's sparse cache of that many pairs, in the softmax part too
    cache_block: int = 64     # LoLA: the cache's update, each time this many pairs left the window
    combine: str = 'joint'    # the window form: joint | mix
    diag_block: int = 0       # > 0: block-diagonal softmax + linear (LLN+Diag)
    impl: str = 'chunked'     # the linear-attention path: quadratic | chunked | recurrent | triton
    exact: str = ''           # KV heads kept exact softmax, with a KV cache of their own, e.g. 0+2
    decay: int = 0            # > 0: the linear state decays, S_t = lambda S_t-1 + phi(k_t) v_t^T, a
                              # learned lambda per head starting at a half-life of this many tokens
    nope: int = 0             # 1: the linear part's maps see q, k with RoPE undone (issue 41), so
                              # their weights do not depend on the position (LoLCATs: rotated q, k)
    delta: int = 0            # 1: the linear part overwrites, the delta rule (section 4b): S_t =
                              # S_t-1 + beta_t phi(k_t) (v_t - S_t-1^T phi(k_t))^T; beside a
                              # window, combine=mix (it has no normaliser z to share)
    gate: int = 0             # 1: the delta rule's S decays by a learned alpha_t first (Gated
                              # DeltaNet)
    options: tuple = ()       # the feature map's own options, sorted (key, value) pairs

    @classmethod
    def settings(cls):
        """{setting: its type}: the fields between the name and the map's options."""
        return {f.name: f.type for f in fields(cls) if f.name not in ('name', 'options')}

    def __post_init__(self):
        object.__setattr__(self, 'options', tuple(sorted(dict(self.options).items())))
        _choose('attention', self.name, ATTN_CHOICES)
        _choose('window combine', self.combine, WINDOW_COMBINES)
        _choose('impl', self.impl, IMPLS)
        for why in self._errors():
            raise UsageError(f"attention spec '{self}': {why}")

    def _errors(self):
        """What cannot be, in order: values of the wrong type, settings that do not go together (the
        hybrid's, then the linear part's), options the map does not know."""
        known = get_type_hints(FEATURE_MAPS[self.name].__init__) if self.name != 'softmax' else {}
        types = {**self.settings(), **known}   # the settings' and the map's options' types
        values = [(key, getattr(self, key)) for key in self.settings()] + list(self.options)
        wrong = [f"{key}={value!r} is not {getattr(types[key], '__name__', types[key])}"
                 for key, value in values if key in types and not _fits(value, types[key])]
        if wrong:
            yield ', '.join(wrong)
            return
        if self.window < 0 or self.diag_block < 0:
            yield "window and diag_block must be >= 0"
        if self.window and self.diag_block:
            yield "choose one hybrid, window or diag_block, not both"
        if self.combine != 'joint' and not self.window:
            yield "combine is the window's form: set window"
        if self.sinks < 0 or (self.sinks and not self.window):
            yield "sinks (>= 0) belong to a window"
        if self.cache < 0 or (self.cache and (not self.window or self.name == 'softmax')):
            yield "cache (>= 0) belongs to a window with a linear part (its state scores the pairs)"
        if self.cache_block < 1:
            yield "cache_block must be >= 1"
        if self.name == 'softmax' and (self.diag_block or self.combine != 'joint'):
            yield "softmax takes a window and sinks, no diag_block or combine"
        if self.decay < 0 or (self.decay and self.name == 'softmax'):
            yield "decay (>= 0) is the linear state's: a feature map's"
        if self.nope not in (0, 1) or (self.nope and self.name == 'softmax'):
            yield "nope (0 or 1) is the linear part's: a feature map's"
        if {self.delta, self.gate} - {0, 1} or self.gate > self.delta:
            yield "delta and gate are 0 or 1, gate with delta"
        if self.delta and (self.name == 'softmax' or self.diag_block or self.cache or self.decay
                           or self.impl in ('quadratic', 'triton')
                           or self.window and self.combine == 'joint'):
            yield ("delta is a feature map's linear part, alone or beside a window with "
                   "combine=mix (it has no normaliser z to share with the window), impl chunked or "
                   "recurrent: no diag_block, cache or decay (gate=1 is its decay)")
        if self.exact and not re.fullmatch(r'\d+(\+\d+)*', self.exact):
            yield "exact takes KV head indices joined by +, e.g. exact=0+2"
        unknown = [key for key, _ in self.options if key not in known]
        if unknown:
            yield (f"unknown option(s) {', '.join(unknown)}; "
                   f"{self.name}'s options: {', '.join(known) or 'none'}")

    @classmethod
    def parse(cls, s):
        if isinstance(s, cls):
            return s
        name, *items = str(s).split(':')
        settings = {}
        options = {}
        for item in items:
            key, eq, value = item.partition('=')
            key = OPTION_ALIASES.get(key, key)
            if not eq or key in settings or key in options:
                raise UsageError(f"attention spec {s!r}: expected name:key=value:.. "
                                 f"with distinct keys, got {item!r}")
            if cls.settings().get(key) is not str:   # a str setting as written ('0+2': not JSON)
                with contextlib.suppress(ValueError):
                    value = json.loads(value)
            (settings if key in cls.settings() else options)[key] = value
        return cls(name, options=options, **settings)

    def __str__(self):
        settings = [f'{f.name}={getattr(self, f.name)}' for f in fields(self)
                    if f.name in self.settings() and getattr(self, f.name) != f.default]
        options = [f'{k}={v if isinstance(v, str) else json.dumps(v, default=str)}'
                   for k, v in self.options]
        return ':'.join([self.name] + settings + options)

# ---- 4. linear attention: quadratic, chunked, recurrent, triton -------------
# The PyTorch forms return unnormalised parts: the normaliser rides along as a value column of ones,
# [S | z] = sum_s phi_k_s [v_s | 1]^T (B, H, F, D + 1), so num and den come out of one product.
# Key shifts (c, with the running max m and the state's units M): see linear_attention_parts.

def exp_as(x, like):
    """exp(x) in like's dtype: x a difference of shifts, float64 where a decay makes them large."""
    return cast(torch.exp(x), like.dtype)

def scaled_keys(k, c, M):
    """phi_k_s exp(c_s - M): keys (B, H, T, F) in units of exp(-M), M >= every c_s."""
    return k * exp_as(c - M[..., None], k)[..., None]

def _start(initial_state, B, H, F, D, like):
    """The [S | z] (B, H, F, D + 1) and m (B, H) to start from: initial_state (S, z[, m = 0]), or
    zeros with no key seen (m = NO_KEY); m keeps its dtype (float64 under a decay)."""
    if initial_state is None:
        return like.new_zeros(B, H, F, D + 1), like.new_full((B, H), NO_KEY)
    S, z = initial_state[:2]
    m = initial_state[2] if len(initial_state) > 2 else like.new_zeros(B, H)
    return torch.cat([S, z[..., None]], -1).to(like.dtype), m

def fold(Sz, m, k, c, v1):
    """The state Sz (B, H, F, E) in units exp(-m) (B, H) with keys k (B, H, L, F), their shifts c
    (B, H, L) and values v1 (B, H, L, E) added, in no order: (Sz', M), M = max(m, every c)."""
    M = torch.maximum(m, c.amax(-1)) if c.shape[-1] else m
    return Sz * exp_as(m - M, k)[..., None, None] + scaled_keys(k, c, M).mT @ v1, M

def divide(num, den):
    """num / den per row, 0 where den is 0 (a row whose features are all 0)."""
    return num / den.where(den > 0, 1.0)[..., None]

def _quadratic(q, k, v1, c, m, Sz0, m0, causal):
    """The definition, (B, H, T, T) weights A_ts = phi_q_t . phi_k_s exp(c_s - m_t) over s <= t
    (causal) or every s, plus the starting state read in row t's units."""
    A = (q @ k.mT) * exp_as((c[..., None, :] - m[..., None]).clamp(max=0), q)
    A = A.tril() if causal else A
    out = A @ v1 + (q @ Sz0) * exp_as(m0[..., None] - m, q)[..., None]         # (B, H, T, D + 1)
    return out, fold(Sz0, m0, k, c, v1)[0]

def _recurrent(q, k, v1, c, Sz0, m0):
    """One token at a time (fold with one key), the state in row t's units, m_t = max(m_t-1, c_t):
        [S | z] <- [S | z] exp(m_t-1 - m_t) + phi_k_t exp(c_t - m_t) [v_t | 1]^T
        out_t = phi_q_t [S | z]"""
    outs = []
    Sz = Sz0
    m_t = m0
    for t in range(q.shape[2]):
        Sz, m_t = fold(Sz, m_t, k[:, :, t:t + 1], c[..., t:t + 1], v1[:, :, t:t + 1])
        outs.append(q[:, :, t:t + 1] @ Sz)                                     # (B, H, 1, D + 1)
    return torch.cat(outs, 2), Sz

def _chunked(q, k, v1, c, m, Sz0, m0, C):
    """Quadratic inside chunks of C tokens, the state carried from chunk to chunk: O(T F D / C)
    memory. The state before chunk j is in units of exp(-M_j-1), M_j = m at chunk j's last row."""
    T = q.shape[2]
    n = math.ceil(T / C)
    pad = -T % C

    def chunks(x):   # (B, H, T, E) -> (B, H, n, C, E), zero-padded
        return nnf.pad(x, (0, 0, 0, pad)).unflatten(2, (n, C))
    qc = chunks(q)
    kc = chunks(k)
    vc = chunks(v1)
    cc = nnf.pad(c, (0, pad), value=NO_KEY).unflatten(2, (n, C))             # padding: no key
    mc = nnf.pad(m, (0, pad), 'replicate').unflatten(2, (n, C))              # (B, H, n, C)
    A = (qc @ kc.mT) * exp_as((cc[..., None, :] - mc[..., None]).clamp(max=0), q)
    M_after = mc[..., -1]                                                     # (B, H, n)
    M_before = torch.cat([m0[..., None], M_after[..., :-1]], -1)              # (B, H, n)
    kv = scaled_keys(kc, cc, M_after).mT @ vc                                 # (B, H, n, F, D + 1)
    states = []
    Sz = Sz0
    for j in range(n):   # Sz: the state before chunk j, then after it
        states.append(Sz)
        Sz = Sz * exp_as(M_before[..., j] - M_after[..., j], q)[..., None, None] + kv[:, :, j]
    r = exp_as(M_before[..., None] - mc, q)[..., None]                        # (B, H, n, C, 1)
    out = A.tril() @ vc + (qc @ torch.stack(states, 2)) * r                   # (B, H, n, C, D + 1)
    return out.flatten(2, 3)[:, :, :T], Sz

def linear_attention_parts(phi_q, phi_k, v, causal=True, impl='chunked', chunk_size=64,
                           initial_state=None, c_k=None):
    """Unnormalised linear attention in PyTorch: num_t = phi_q_t^T S_t (B, H, T, D),
    den_t = phi_q_t^T z_t (B, H, T), S_t, z_t over s <= t (causal) or all s, from initial_state
    (S, z[, m = 0]). Key shifts c_k (B, H, T) (None: 0): the exact key features are
    phi_k exp(c_k), and row t comes in units of exp(-m_t), m_t the largest c_s of the keys it sees
    (a running max, as online softmax: every factor exp(c_s - m_t) <= 1, so no key overflows, and a
    row that sees only small keys keeps them). Returns num, den, m (B, H, T) and the final state
    (S, z, m), float32; bidirectional rows all read the final state."""
    q = acc(phi_q)
    k = acc(phi_k)
    v1 = nnf.pad(acc(v), (0, 1), value=1.0)                          # [v | 1] (B, H, T, D + 1)
    B, H, T, F = q.shape
    c = q.new_zeros(B, H, T) if c_k is None else acc(c_k)
    Sz0, m0 = _start(initial_state, B, H, F, v.shape[-1], q)
    m = c.cummax(-1).values if causal else c.amax(-1, keepdim=True).expand_as(c)
    m = m.maximum(m0[..., None])   # (B, H, T): the running max, or (bidirectional) every key's
    if impl == 'quadratic':
        out, Sz = _quadratic(q, k, v1, c, m, Sz0, m0, causal)
    elif not causal:
        Sz = fold(Sz0, m0, k, c, v1)[0]
        out = q @ Sz
    elif impl == 'recurrent':
        out, Sz = _recurrent(q, k, v1, c, Sz0, m0)
    else:
        out, Sz = _chunked(q, k, v1, c, m, Sz0, m0, chunk_size)
    return out[..., :-1], out[..., -1], m, (Sz[..., :-1], Sz[..., -1], m[..., -1])   # [..., -1]: z

def linear_attention(phi_q, phi_k, v, causal=True, impl='chunked', eps=0.0, chunk_size=64,
                     initial_state=None, return_state=False, c_k=None):
    """y_t = phi_q_t^T S_t / (phi_q_t^T z_t + eps), 0 where that is 0 (Katharopoulos et al. 2020):
    phi_q, phi_k (B, H, T, F), v (B, H, T, D) -> y in v's dtype [, the final state, float32]; c_k:
    key shifts (linear_attention_parts). The state is (S, z), or (S, z, m) with key shifts or such
    an initial_state. impl 'chunked' runs the Triton kernel on CUDA with triton installed, where it
    fits (causal, F <= 256, D <= 128), else PyTorch's chunked path; 'triton' insists."""
    _choose('impl', impl, IMPLS)
    if phi_q.dim() != 4 or phi_k.shape != phi_q.shape \
            or v.dim() != 4 or v.shape[:3] != phi_k.shape[:3]:
        raise ValueError("phi_q, phi_k must be (B, H, T, F) and v (B, H, T, D); "
                         f"got {tuple(phi_q.shape)}, {tuple(phi_k.shape)}, {tuple(v.shape)}")
    F = phi_q.shape[-1]
    D = v.shape[-1]
    fits = causal and kernels.triton_available(v) and kernels.supports(F, D)   # the kernel fits
    if impl == 'triton' and not fits:
        raise UsageError(
            "impl='triton' needs causal attention, CUDA tensors (or TRITON_INTERPRET=1) and "
            f"F <= {kernels.MAX_FEATURE_DIM}, D <= {kernels.MAX_HEAD_DIM}; "
            f"got causal={causal}, {v.device.type}, F={F}, D={D}: use impl='chunked'")
    if impl == 'triton' or (impl == 'chunked' and v.is_cuda and fits):
        return kernels.causal_linear_attention(phi_q, phi_k, v, eps, initial_state,
                                               return_state, c_k=c_k)
    num, den, _, state = linear_attention_parts(phi_q, phi_k, v, causal, impl, chunk_size,
                                                initial_state, c_k)
    y = divide(num, den + eps).to(v.dtype)
    shifted = c_k is not None or len(initial_state or ()) > 2
    return (y, state if shifted else state[:2]) if return_state else y

def linear_attention_weights(phi_q, phi_k, causal=True, c_k=None):
    """The (B, H, T, T) matrix of linear attention: its output for the identity matrix as values."""
    return linear_attention(phi_q, phi_k, identity_values(phi_q), causal, 'quadratic', c_k=c_k)

# ---- 4b. the delta rule: a state that overwrites ---------------------------------
# The sum S_t = S_t-1 + phi(k_t) v_t^T only adds: a key written once is blurred by every later one.
# The delta rule (Schlag et al. 2021, arXiv 2102.11174; DeltaNet, Yang et al. 2024, arXiv
# 2406.06484) first reads what S holds at k_t and moves it beta_t of the way to v_t; Gated DeltaNet
# (Yang et al. 2025, arXiv 2412.06464) decays S by alpha_t first. In this file's layout (S is F x D,
# y_t = S_t^T phi(q_t)):
#     S_t = alpha_t S_t-1 + beta_t phi(k_t) (v_t - alpha_t S_t-1^T phi(k_t))^T
# With |phi(k)| = 1 and 0 < beta <= 1 the write I - beta phi(k) phi(k)^T has eigenvalues 1 - beta
# and 1: S never grows (a contraction), so the caller L2-normalises phi(k), and phi(q) too (y is
# then a recalled value, not a sum). No normaliser z, no key shifts c (a normalised key has none).
# q, k: (B, H, T, F) unit-norm features; v (B, H, T, D); beta, log_alpha (B, H, T); S (B, H, F, D).

class DeltaGates(nn.Module):
    """The delta rule's gates of keys k (B, H, T, D) -> (B, H, T, 2), per head:
        beta_t = sigmoid(w_b.k_t + b_b)                                      (DeltaNet)
        log alpha_t = -softplus(w_a.k_t + b_a) with gate, else 0             (Gated DeltaNet)
    init beta 1/2, alpha = exp(-dt), dt from 0.001 to 0.1 over the heads (Mamba 2's range). Ours:
    from the key (as the maps see it), where the papers project the layer's input, which an
    attention core does not see; and without Gated DeltaNet's A = exp(A_log) in -A softplus(.),
    which w_a and b_a absorb in both of softplus's regimes (A e^x = e^(x + log A); A x: A w_a, A
    b_a)."""

    def __init__(self, head_dim, n_heads, gate):
        super().__init__()
        dt = torch.logspace(-3, -1, n_heads)
        self.weight = nn.Parameter(torch.zeros(n_heads, 2, head_dim))             # (H, 2, D)
        self.bias = nn.Parameter(torch.stack([torch.zeros(n_heads), dt.expm1().log()], 1))
        self.gate = gate

    def forward(self, k):
        u = _per_head_linear(k, self.weight, self.bias)                          # (B, H, T, 2)
        return torch.stack([torch.sigmoid(u[..., 0]), -nnf.softplus(u[..., 1]) * self.gate], -1)

def delta_step(S, k, v, gates):
    """One token, every head, line for line the equation: k (B, H, F), v (B, H, D), gates (B, H, 2)
    beta and log alpha -> the new S."""
    beta, log_alpha = gates.unbind(-1)
    S = S * log_alpha.exp()[..., None, None]                         # alpha_t S_t-1
    recalled = torch.einsum('bhf,bhfd->bhd', k, S)                   # S^T phi(k_t)
    return S + torch.einsum('bhf,bhd->bhfd', beta[..., None] * k, v - recalled)

def _delta_recurrent(q, k, v, gates, S):
    """The reference: one delta_step a token, then y_t = S_t^T q_t."""
    ys = []
    for t in range(q.shape[2]):
        S = delta_step(S, k[:, :, t], v[:, :, t], gates[:, :, t])
        ys.append(torch.einsum('bhf,bhfd->bhd', q[:, :, t], S))
    return torch.stack(ys, 2), S

def _delta_chunked(q, k, v, gates, S, C):
    """The same in chunks of C tokens (DeltaNet's and Gated DeltaNet's chunkwise WY / UT form;
    fla's naive chunk_delta_rule is the same algebra). In a chunk, with gamma_i = alpha_1 .. alpha_i
    and S0 the state before it,
        S_i = gamma_i S0 + sum_{j<=i} (gamma_i / gamma_j) k_j u_j^T
    where u_j, what token j writes, depends on the u_l before it: (I + L) U = diag(beta) (V -
    diag(gamma) K S0), L_jl = beta_j (gamma_j / gamma_l) k_j.k_l for l < j, lower triangular. One
    solve for every chunk at once gives [W | U~] = (I + L)^-1 diag(beta) [diag(gamma) K | V], so
    that U = U~ - W S0; then, chunk after chunk (only S0 passes on):
        y_i = gamma_i S0^T q_i + sum_{j<=i} (gamma_i / gamma_j) (q_i.k_j) u_j
        S_C = gamma_C S0 + sum_j (gamma_C / gamma_j) k_j u_j^T
    Padding writes nothing (beta 0, alpha 1)."""
    T, F = k.shape[2:]
    n = math.ceil(T / C)

    def chunks(x):   # (B, H, T, E) -> (B, H, n, C, E), zero-padded
        return nnf.pad(x, (0, 0, 0, -T % C)).unflatten(2, (n, C))
    qc, kc, vc, gc = (chunks(x) for x in (q, k, v, gates))
    bc = gc[..., 0]                                                  # (B, H, n, C): beta
    g = gc[..., 1].cumsum(-1)                                        # (B, H, n, C): log gamma_i
    ratio = (g[..., :, None] - g[..., None, :]).tril().exp().tril()  # gamma_i / gamma_j, j <= i
    L = (kc @ kc.mT) * ratio * bc[..., None]          # (its diagonal unread: unitriangular)
    rhs = bc[..., None] * torch.cat([g.exp()[..., None] * kc, vc], -1)
    W, U = torch.linalg.solve_triangular(L, rhs, upper=False,
                                         unitriangular=True).split([F, v.shape[-1]], -1)
    scores = (qc @ kc.mT) * ratio                                    # (B, H, n, C, C)
    k_end = kc * (g[..., -1:] - g).exp()[..., None]                  # (gamma_C / gamma_j) k_j
    ys = []
    for j in range(n):
        u = U[:, :, j] - W[:, :, j] @ S                              # (B, H, C, D)
        ys.append(g[:, :, j, :, None].exp() * (qc[:, :, j] @ S) + scores[:, :, j] @ u)
        S = g[:, :, j, -1, None, None].exp() * S + k_end[:, :, j].mT @ u
    return torch.cat(ys, 2)[:, :, :T] if ys else v, S   # (T = 0: v, no tokens)

def delta_rule(phi_q, phi_k, v, gates, impl='chunked', chunk_size=64, S=None):
    """The delta rule over T tokens after state S (None: zeros): phi_q, phi_k unit-norm (B, H, T,
    F), v (B, H, T, D), gates (B, H, T, 2) each key's beta and log alpha -> y (B, H, T, D), the
    final S, float32 (float64 stays). impl: 'recurrent' or 'chunked' (chunks of chunk_size)."""
    q, k, v, gates = (acc(x) for x in (phi_q, phi_k, v, gates))
    S = q.new_zeros(*q.shape[:2], q.shape[-1], v.shape[-1]) if S is None else S
    if impl == 'recurrent':
        return _delta_recurrent(q, k, v, gates, S)
    return _delta_chunked(q, k, v, gates, S, chunk_size)

# ---- 5. metrics and DoF's kernel loss ---------------------------------------
def as_distribution(w):
    """Attention weights (.., T) as a distribution per row, float32: their positive part,
    renormalised. No change for softmax's and a sum's (distributions already); the delta rule's
    (section 4b) may be negative and need not sum to 1."""
    w = w.float().clamp_min(0)
    return w / w.sum(-1, keepdim=True).clamp_min(1e-12)

def attention_entropy(w, eps=1e-12):
    """Row entropies -sum_j w_ij log w_ij in nats: (B, H, T, T) -> (B, H, T) (Hedgehog Fig. 4), of
    the rows as_distribution."""
    w = as_distribution(w)
    return -(w * (w + eps).log()).sum(-1)

def spectral_gap(w):
    """1 - |lambda_2| of each row-stochastic (B, H, T, T) matrix -> (B, H) float64 (eigenvalues by
    modulus, lambda_1 = 1); for bidirectional ones: a causal one's eigenvalues are its diagonal."""
    return 1.0 - torch.linalg.eigvals(w.double()).abs().sort(dim=-1, descending=True).values[..., 1]

def ranks(x):
    """Ranks along the last dimension, ties sharing their mean rank, float64."""
    x = x.double().contiguous()
    s = x.sort(-1).values
    return (torch.searchsorted(s, x) + torch.searchsorted(s, x, right=True) - 1).double() / 2

def monotonicity(w, q, k, causal=True):
    """How monotonic attention weights are in q.k (Hedgehog Fig. 3, Sec. 3.2): the Spearman
    correlation, per query row, of w_ij and s_ij = q_i.k_j / sqrt(D) over the keys the row sees
    (rows with fewer than 3 keys skipped), averaged per head. Returns (rho (B, H) float64, (scores,
    weights) of every visible pair, 1-D)."""
    s = (q.double() @ k.double().mT) * q.shape[-1] ** -0.5
    w = w.double()
    T = w.shape[-1]
    rhos = []
    for i in range(2 if causal else 0, w.shape[-2]):
        rs, rw = (ranks(x[..., i, :i + 1 if causal else T]) for x in (s, w))
        rs -= rs.mean(-1, keepdim=True)   # centred
        rw -= rw.mean(-1, keepdim=True)
        norms = (rs.square().sum(-1) * rw.square().sum(-1)).sqrt()
        rhos.append((rs * rw).sum(-1) / (norms + 1e-30))
    vis = (causal_mask(T, T, w.device) | (not causal)).expand_as(w)   # the visible pairs
    return torch.stack(rhos, -1).mean(-1), (s[vis].float(), w[vis].float())

def kl_divergence(p, q, eps=1e-12):
    """KL(p || q) per row of two (B, H, T, T) attention matrices -> (B, H, T), nats, q's rows
    as_distribution."""
    q = as_distribution(q)
    return (p.float() * ((p.float() + eps).log() - (q + eps).log())).sum(-1)

def kernel_l2(phi_q, phi_k, q, k, causal=True):
    """DoF's kernel loss: MSE of phi(q_i).phi(k_j) against exp(q_i.k_j / sqrt(D)) over the visible
    pairs (quadratic in T), unnormalised: pass exact features (fmap.features' phi exp(c))."""
    err = (phi_q.float() @ phi_k.float().mT -
           torch.exp((q.float() @ k.float().mT) * q.shape[-1] ** -0.5)).square()
    if not causal:
        return err.mean()
    return err[causal_mask(*err.shape[-2:], err.device).expand_as(err)].mean()
