"""
The attention core of one layer, `Attention`, and the hybrids of softmax and linear attention it
runs. In reading order:
  1. the hybrids, all tokens at once: sliding-window softmax + linear (LoLCATs-w), block-diagonal softmax + linear
     (LLN+Diag)
  2. the decode states, one small type each: LinearState (S, z, m), Slots (pairs in fixed slots, written in
     place), KVCache, WindowState, DiagState, Pairs and LolaState (LoLA's cache), SplitState (exact heads)
  3. LoLA's sparse-cache update (lola_select); its schedule written out token by token in float64, the
     definition the fast forms are tested against, is tests/test_cache.py's lola_reference
  4. Attention: the mode (softmax, linear, window, diag) fixed when it is built, one method per mode and phase
     (parallel: all tokens from the start; step: one token after a state)

Each call returns a new state; a step writes its token into slots in place, copying them first when
another state wrote there, so two continuations of one state (branches, beam search) do not disturb
each other. A step's shapes do not depend on the position (a tensor on the device):
model.DecodeGraph replays it as a CUDA graph. q, k, v: (B, H, T, D) after RoPE, k and v repeated to
H heads; states keep the H_kv = H / kv_groups key/value heads only (k[:, ::g]).
"""

import copy
import math
from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as nnf   # F is the feature dimension

import attention as A
from attention import NO_KEY, UsageError, acc, linear_attention, linear_attention_parts, softmax_attention

# ---- 1. the hybrids, all tokens at once ----------------------------------------
def _divide(num, den):
    """num / den per row, 0 where den is 0 (a row whose features are all 0)."""
    return num / den.where(den > 0, 1.0)[..., None]

def _band_blocks(x, w):
    """(B, H, T, E) -> (B, H, n = ceil(T / w), 3w, E): for each block b of w rows, blocks b - 1, b, b + 1 (0-padded)."""
    n = math.ceil(x.shape[2] / w)
    x = nnf.pad(x, (0, 0, w, (n + 1) * w - x.shape[2]))  # (B, H, (n + 2) w, E)
    return x.unfold(2, 3 * w, w).transpose(-1, -2)  # windows of 3w rows every w rows

def _in_window(i, j, w, causal):
    """Key j is in query i's window: i - w < j <= i (causal) or |i - j| < w; the linear part sees the rest."""
    return ((i - j < w) & (i >= j)) if causal else ((i - j).abs() < w)

def _window_softmax(q, k, v, visible):
    """The window part, unnormalised: (a v, sum_j a, m), a_ij = exp(s_ij - m_i) where visible, s_ij
    = q_i.k_j / sqrt(D), m_i the row's largest visible score (0 for a row that sees no key)."""
    s = torch.einsum('...id,...jd->...ij', q, k).masked_fill(~visible, float('-inf')) * q.shape[-1] ** -0.5
    m = s.amax(-1, keepdim=True).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # -inf: a row that sees no key
    a = torch.exp(s - m)
    return a @ v, a.sum(-1), m[..., 0]

def _merge(a, b):
    """Two unnormalised parts (num, den, m) over disjoint keys as one, each of true mass den exp(m)
    (_window_softmax's, linear_attention_parts'); m: the larger of the two (a row that sees no key
    has den 0 and adds nothing)."""
    ma, mb = (x[2].where(x[1] > 0, -math.inf) for x in (a, b))
    m = torch.maximum(ma, mb).nan_to_num(neginf=0.0)
    ra, rb = torch.exp(ma - m), torch.exp(mb - m)
    return a[0] * ra[..., None] + b[0] * rb[..., None], a[1] * ra + b[1] * rb, m

def combine_window_linear(num_w, den_w, m, num_l, den_l, c, factor, combine='joint'):
    """The window and linear parts of the sliding-window hybrid combined, per query row: num_w,
    den_w, m from _window_softmax; num_l, den_l the linear sums of shifted features (exact mass
    exp(c) den_l); factor (H,).
      joint (LoLCATs, ICLR 2025, Eq. 8, and its code): one normalisation of window weights
            gamma exp(s_ij - m_i) and linear weights phi(q_i).phi(k_j), gamma = factor. m_i is NOT
            compensated: window weights are <= gamma, on the kernel's scale (an exact softmax window
            outweighs it by exp(m_i), e^20 and more at attention sinks);
      mix   (LoLCATs workshop paper, Eq. 8): y = s num_w / den_w + (1 - s) num_l / den_l, s = factor.
    As p y_window + (1 - p) y_linear, p the window part's share: for joint, gamma den_w against
    exp(c) den_l, compared in log space. A row without linear keys is the window part, one without
    window keys the linear part, 0 with neither. Returns y and p, float32."""
    has_w, has_l = den_w > 0, den_l > 0
    den_w, den_l = den_w.where(has_w, 1.0), den_l.where(has_l, 1.0)
    y_w, y_l = num_w / den_w[..., None], num_l / den_l[..., None]      # each part normalised
    f = factor.to(den_w.dtype).view(-1, *([1] * (den_w.dim() - 2)))   # (H, 1..) against (B, H, ..)
    p = torch.sigmoid(f.log() + den_w.log() - c - den_l.log()) if combine == 'joint' else \
        f.expand_as(den_w)
    p = torch.where(has_w, p.where(has_l, 1.0), 0.0)
    return y_l + p[..., None] * (y_w - y_l), p

def _window_part(q, k, v, w, n_sinks, causal, keys):
    """The softmax part of the window hybrid, unnormalised (num, den, m) per row (B, H, T, ..): the
    row's window (blocks of w queries against the previous, this and the next block of keys) and
    the first n_sinks keys outside it. keys (B, T): True at real (not padding) keys."""
    B, H, T, D = q.shape
    n = math.ceil(T / w)
    q_blocks = nnf.pad(q, (0, 0, 0, n * w - T)).reshape(B, H, n, w, D)      # (B, H, n, w, D)
    rows = torch.arange(n * w, device=q.device).view(n, w, 1)                # (n, w, 1) query positions
    cols = rows[:, :1] - w + torch.arange(3 * w, device=q.device)            # (n, 1, 3w) key positions
    real = _band_blocks(keys[:, None, :, None].float(), w)[..., 0] > 0.5     # (B, 1, n, 3w)
    visible = _in_window(rows, cols, w, causal) & real[:, :, :, None, :]     # (B, 1, n, w, 3w)
    parts = _window_softmax(q_blocks, _band_blocks(k, w), _band_blocks(v, w), visible)
    num, den, m = (x.reshape(B, H, n * w, *x.shape[4:])[:, :, :T] for x in parts)
    if not n_sinks:
        return num, den, m
    i = torch.arange(T, device=q.device)[:, None]                            # (T, 1) queries
    j = torch.arange(n_sinks, device=q.device)                               # (N,) sink keys
    outside = ~_in_window(i, j, w, causal) & ((i >= j) | (not causal))       # (T, N)
    sinks = _window_softmax(q, k[:, :, :n_sinks], v[:, :, :n_sinks],
                            outside & keys[:, None, None, :n_sinks])          # mask (B, 1, T, N)
    return _merge((num, den, m), sinks)

def _shift(x, w, fill=0.0):
    """x_t <- x_{t - w} along time (dim 2); the first w positions filled."""
    front = x.new_full((*x.shape[:2], w, *x.shape[3:]), fill)
    return torch.cat([front, x], 2)[:, :, :x.shape[2]]

def _linear_part(phi_q, phi_k, v, c_k, w, impl, chunk_size):
    """The window hybrid's linear part, unnormalised (num, den, m): causal linear attention over
    the keys that have left each row's window, i.e. over keys shifted w positions later."""
    phi_k, v, c_k = _shift(phi_k, w), _shift(v, w), _shift(c_k, w, NO_KEY)
    return linear_attention_parts(phi_q, phi_k, v, True, impl, chunk_size, c_k=c_k)[:3]

def window_linear_attention(q, k, v, phi_q, phi_k, c_q, c_k, spec, factor, causal=True,
                            key_padding_mask=None, chunk_size=64):
    """Sliding-window softmax + linear attention (LoLCATs-w), window, sinks, combine and impl from
    spec: softmax over W(i) = {i - window < j <= i} (causal) or {|i - j| < window},
    phi(q_i).phi(k_j) over the other keys (exact kernel: exp(c_q_i + c_k_j) phi_q_i.phi_k_j). sinks:
    keys j < sinks join every query's softmax part (StreamingLLM's sink tokens, Xiao et al. 2024),
    not the linear part. phi_q None: sliding-window softmax alone (with its sinks); phi_k: 0 at
    padding keys (c_k NO_KEY). O(T window + T F D / chunk) memory. Returns y and each row's share of
    attention on the softmax part (combine_window_linear)."""
    B, _, T, _ = q.shape
    n_sinks = min(spec.sinks, T)
    keys = key_padding_mask if key_padding_mask is not None else \
        torch.ones(B, T, dtype=torch.bool, device=q.device)
    num_w, den_w, m_w = _window_part(acc(q), acc(k), acc(v), spec.window, n_sinks, causal, keys)
    if phi_q is None:   # no linear part: the softmax part alone (a row with no key gives 0)
        return _divide(num_w, den_w).to(v.dtype), torch.ones_like(den_w)
    is_sink = torch.arange(T, device=q.device) < n_sinks     # sinks are not in the linear part
    phi_k, c_k = acc(phi_k) * ~is_sink[:, None], c_k.masked_fill(is_sink, NO_KEY)
    linear = _linear_part(phi_q, phi_k, v, c_k, spec.window, spec.impl, chunk_size)
    if not causal:   # plus the keys j >= i + window: the same, backwards in time
        flipped = (x.flip(2) for x in (phi_q, phi_k, v, c_k))
        back = _linear_part(*flipped, spec.window, spec.impl, chunk_size)
        linear = _merge(linear, [x.flip(2) for x in back])
    num_l, den_l, m_l = linear
    y, share = combine_window_linear(num_w, den_w, m_w, num_l, den_l, c_q + m_l, factor,
                                     spec.combine)
    return y.to(v.dtype), share

def block_diagonal_softmax(q, k, v, block, causal=True, key_padding_mask=None):
    """Softmax within blocks of `block` tokens (the last maybe shorter): LLN+Diag, Nahshan et al. 2023, Sec. 4.2."""
    B, H, T, D = q.shape
    n, pad = math.ceil(T / block), -T % block  # pad: to a whole number of blocks
    qb, kb, vb = (nnf.pad(t, (0, 0, 0, pad)).reshape(B, H, n, block, t.shape[-1]) for t in (q, k, v))
    keys = torch.ones(B, T, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask
    mask = nnf.pad(keys, (0, pad)).view(B, 1, n, 1, block)  # real keys, not padding
    mask = mask & torch.ones(block, block, dtype=torch.bool, device=q.device).tril() if causal else mask
    mask = mask | torch.eye(block, dtype=torch.bool, device=q.device)  # a padded query sees itself: finite
    return nnf.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask).reshape(B, H, n * block, -1)[:, :, :T]

# ---- 2. the decode states -------------------------------------------------------
def state_tensors(state):
    """The tensors of a decode state (or a list of them), in order, nested states included."""
    if isinstance(state, (list, tuple)):
        for s in state:
            yield from state_tensors(s)
    elif torch.is_tensor(state):
        yield state
    elif hasattr(state, '__dataclass_fields__'):
        for f in fields(state):
            yield from state_tensors(getattr(state, f.name))

def state_nbytes(state):
    """Bytes held by a decode state (or a list of them, one per layer), all KV capacity included."""
    return sum(t.numel() * t.element_size() for t in state_tensors(state))

def static_state(state, capacity):
    """The decode state with fixed shapes, for a CUDA graph (model.DecodeGraph): KV caches static
    with room for `capacity` tokens, slots written in place without copies (the graph's alone)."""
    if isinstance(state, KVCache):
        return state.reserve(capacity, static=True)
    if isinstance(state, SplitState):
        return SplitState(static_state(state.exact, capacity), static_state(state.rest, capacity))
    if isinstance(state, WindowState) and state.n < state.slots.sinks:
        raise UsageError(f"a CUDA graph starts after the sinks: a prompt of at least "
                         f"{state.slots.sinks} tokens")
    if isinstance(state, (WindowState, DiagState)):
        return replace(state, slots=replace(state.slots, static=True))
    if isinstance(state, LolaState):
        raise UsageError("LoLA's cache (spec cache=) changes its shapes as it decodes: no CUDA graph")
    return state   # a LinearState

def copy_state_(dst, src):
    """Copy the tensors of state src (or a list of states) into those of dst, of the same structure,
    where they are not already the same tensor: a CUDA graph's new states back into its inputs."""
    for a, b in zip(state_tensors(dst), state_tensors(src)):
        if a is not b:
            a.copy_(b)

@dataclass(frozen=True)
class LinearState:
    """Linear attention's state in units of exp(-m) (attention.linear_attention_parts):
    S = sum phi_k exp(c - m) v^T, z = sum phi_k exp(c - m) over the n keys folded in."""
    S: torch.Tensor   # (B, H, F, D)
    z: torch.Tensor   # (B, H, F)
    m: torch.Tensor   # (B, H): the largest shift c folded in (NO_KEY: none yet)
    n: int            # tokens folded in (linear and diag modes: every token so far)
    pos: torch.Tensor | None = None   # (1,) long on the device, linear mode: tokens seen

    @staticmethod
    def empty(B, H, F, D, like):
        S, z = like.new_zeros(B, H, F, D), like.new_zeros(B, H, F)
        return LinearState(S, z, like.new_full((B, H), NO_KEY), 0)

    def fold(self, phi, c, v, n):
        """The state with pairs added: phi (B, H, L, F) shifted features, c (B, H, L) their shifts
        (NO_KEY: not added), v (B, H, L, D); n: how many of them count as folded."""
        m = torch.maximum(self.m, c.amax(-1)) if c.shape[-1] else self.m
        pk, r = A.scaled_keys(phi, c, m), torch.exp(self.m - m)   # (B, H, L, F) in units exp(-m)
        S = self.S * r[..., None, None] + pk.transpose(-2, -1) @ v
        return LinearState(S, self.z * r[..., None] + pk.sum(-2), m, self.n + n)

    def add(self, phi, v, c=None):
        """The state with one key per row: phi (B, H, 1, F) its shifted features, v (B, H, 1, D),
        c (B, H, 1) its shift (None: 0, a map that is not exp-based); one outer product:
            S <- S exp(m_old - m) + (phi exp(c - m))^T v,   z likewise,   m = max(m_old, c)."""
        pos = None if self.pos is None else self.pos + 1
        if c is None:   # every shift 0: m is 0 from the first key on, and S, z only add
            S = torch.addcmul(self.S, phi.mT, v)
            return LinearState(S, self.z + phi[:, :, 0], self.m.clamp_min(0.0), self.n + 1, pos)
        c = c[:, :, 0]                                               # (B, H)
        m = torch.maximum(self.m, c)
        r = torch.exp(self.m - m)[..., None]                         # (B, H, 1) old units -> m
        pk = phi * torch.exp(c - m)[..., None, None]                 # (B, H, 1, F)
        S = torch.addcmul(self.S * r[..., None], pk.mT, v)
        return LinearState(S, torch.addcmul(pk[:, :, 0], self.z, r), m, self.n + 1, pos)

    def read(self, phi_q):
        """num (B, H, 1, D) = phi_q S and den (B, H, 1) = phi_q . z of one query per row, phi_q
        (B, H, 1, F), in the state's units."""
        return phi_q @ self.S, (phi_q * self.z[:, :, None]).sum(-1)

@dataclass(frozen=True)
class Slots:
    """Key-value pairs in fixed slots (dim 2), written in place: a KV cache, a window's ring and
    sinks, LLN+Diag's block. pos (L,): the position each slot holds, -1 where none (or where it
    must not be attended). States of the same slots share `owner`, the tokens seen by the state
    that wrote last; any other state copies the slots before it writes, so a state stays valid
    after a decode from it (branches, beam search)."""
    k: torch.Tensor                   # (B, H_kv, L, D)
    v: torch.Tensor                   # (B, H_kv, L, Dv)
    pos: torch.Tensor                 # (L,) long
    phi: torch.Tensor | None = None   # (B, H, L, F): shifted key features, for a linear part
    c: torch.Tensor | None = None     # (B, H, L): their shifts
    owner: list = field(default_factory=lambda: [0])
    static: bool = False              # a CUDA graph's: written in place, never copied
    sinks: int = 0                    # the first slots that hold the sinks (a window's)

    @staticmethod
    def empty(k, v, L, phi=None, c=None, sinks=0):
        """L empty slots for pairs shaped like k, v (B, H_kv, ., D) (and phi, c)."""
        def zeros(x):
            return None if x is None else x.new_zeros(*x.shape[:2], L, *x.shape[3:])
        pos = torch.full((L,), -1, dtype=torch.long, device=k.device)
        return Slots(zeros(k), zeros(v), pos, zeros(phi), zeros(c), sinks=sinks)

    def write(self, n, n_new, slot, position, k, v, phi=None, c=None):
        """The slots with pairs k, v (B, H_kv, m, D) (and phi, c) written at `slot` ((m,) long, on
        the device) by a state that has seen n tokens, for one that has seen n_new; position (m,):
        what pos records there."""
        s = self if self.static or self.owner[0] == n else self.copy()   # (static: no Python state)
        s.pos.index_copy_(0, slot, position)
        for dst, src in ((s.k, k), (s.v, v), (s.phi, phi), (s.c, c)):
            if src is not None:
                dst.index_copy_(2, slot, src)
        if not self.static:
            s.owner[0] = n_new
        return s

    def copy(self):
        clone = [None if x is None else x.clone() for x in (self.k, self.v, self.pos, self.phi, self.c)]
        return Slots(*clone, owner=[-1], sinks=self.sinks)

@dataclass(frozen=True)
class KVCache:
    """Softmax's decode state: the keys and values of the H_kv heads in buffers of some capacity,
    the first n filled. Eager: appends write in place (copying first when another state wrote past
    n), the capacity doubles when full, and a step reads the first n. static (CUDA graphs): a fixed
    capacity, and a step reads it all with a mask of the filled slots."""
    k: torch.Tensor     # (B, H_kv, capacity, D)
    v: torch.Tensor     # (B, H_kv, capacity, Dv)
    pos: torch.Tensor   # (1,) long, on the device: tokens held (n)
    n: int
    fill: list          # [tokens written into these buffers by any state]
    static: bool = False

    @staticmethod
    def start(k, v):
        """A cache holding k, v (B, H_kv, T, D), no room to spare."""
        T = k.shape[2]
        return KVCache(k.contiguous(), v.contiguous(), _position(k, T), T, [T])

    def reserve(self, capacity, static=False):
        """The cache in buffers of at least `capacity` tokens (the first n copied)."""
        if capacity <= self.k.shape[2] and static == self.static:
            return self
        cap, n = max(capacity, self.k.shape[2]), self.n

        def grown(x):
            return torch.cat([x[:, :, :n], x.new_zeros(*x.shape[:2], cap - n, x.shape[3])], 2)
        return KVCache(grown(self.k), grown(self.v), self.pos, n, [n], static)

    def append(self, k, v):
        """The cache with T more tokens k, v (B, H_kv, T, D)."""
        n, T, capacity = self.n, k.shape[2], self.k.shape[2]
        cache = self
        if n + T > capacity:                  # full: larger buffers, the first n copied
            if self.static:
                raise RuntimeError(f"the static KV cache of {capacity} tokens is full")
            cache = self.reserve(max(2 * capacity, n + T))
        elif not self.static and self.fill[0] != n:   # another state wrote past n: copy first
            cache = KVCache(self.k.clone(), self.v.clone(), self.pos, n, [n])
        if T == 1:   # at pos, on the device
            cache.k.index_copy_(2, cache.pos, k)
            cache.v.index_copy_(2, cache.pos, v)
        else:
            cache.k[:, :, n:n + T], cache.v[:, :, n:n + T] = k, v
        if not self.static:
            cache.fill[0] = n + T
        return KVCache(cache.k, cache.v, cache.pos + T, n + T, cache.fill, self.static)

    def keys(self):
        """(k, v, mask): what a query after the last token reads; mask None, or (capacity,) bool."""
        if not self.static:
            return self.k[:, :, :self.n], self.v[:, :, :self.n], None
        slots = torch.arange(self.k.shape[2], device=self.k.device)
        return self.k, self.v, (slots < self.pos)[None]   # (1, capacity)

def _position(like, n):
    """n as a (1,) long tensor on like's device (made there: no copy from the host)."""
    return torch.full((1,), n, dtype=torch.long, device=like.device)

@dataclass(frozen=True)
class WindowState:
    """The sliding-window hybrid's decode state (without LoLA's cache): slots for the sinks (the
    first `sinks` tokens), then a ring of `window` slots, token p at sinks + p % window (a sink in
    the ring is marked -1: it is attended once, as a sink); the linear part folds each token as it
    leaves the window (None: sliding-window softmax alone, leaving tokens are dropped). After n
    tokens the next query sees the sinks, tokens n - window + 1 .. n - 1 and itself."""
    slots: Slots
    linear: LinearState | None
    pos: torch.Tensor   # (1,) long on the device: tokens seen (n)
    n: int

@dataclass(frozen=True)
class DiagState:
    """LLN+Diag's decode state: every token in the linear state, the current block's pairs in
    diag_block slots (token p at p % diag_block)."""
    linear: LinearState
    slots: Slots
    pos: torch.Tensor   # (1,) long on the device: tokens seen
    n: int

@dataclass(frozen=True)
class Pairs:
    """LoLA's key-value pairs, oldest first: the sinks, its cache, the window buffer; phi and c (the
    keys' shifted features and shifts, per query head) where a linear part may fold them later."""
    k: torch.Tensor                   # (B, H_kv, L, D)
    v: torch.Tensor                   # (B, H_kv, L, Dv)
    phi: torch.Tensor | None = None   # (B, H, L, F)
    c: torch.Tensor | None = None     # (B, H, L)

    def __len__(self):
        return self.k.shape[2]

    def _map(self, fn, other=None):
        xs = [getattr(self, f.name) for f in fields(self)]
        ys = [getattr(other, f.name) for f in fields(other)] if other is not None else [None] * 4
        return Pairs(*(None if x is None else fn(x, y) for x, y in zip(xs, ys)))

    def cat(self, other):
        return self._map(lambda x, y: torch.cat([x, y], 2), other)

    def cut(self, a, b=None):   # pairs a..b - 1
        return self._map(lambda x, _: x[:, :, a:b])

    def take(self, idx, g):
        """The pairs idx (B, H_kv, n) of each KV head (its query heads: the same pairs)."""
        def gather(x):   # along time; idx per KV head, or repeated to the query heads
            i = idx if x.shape[1] == idx.shape[1] else idx.repeat_interleave(g, 1)
            i = i.view(*i.shape, *[1] * (x.dim() - 3)).expand(*i.shape, *x.shape[3:])
            return x.gather(2, i)
        return self._map(lambda x, _: gather(x))

@dataclass(frozen=True)
class LolaState:
    """The window hybrid's decode state with LoLA's cache: query t's softmax part is the sinks, the
    cache and the buffer's tokens up to t; its linear part the folded pairs."""
    offset: int                  # tokens seen
    sinks: Pairs                 # the first `sinks` tokens (never folded)
    cache: Pairs                 # LoLA's cached pairs
    buffer: Pairs                # the last tokens: the pending block, then the window
    linear: LinearState

@dataclass(frozen=True)
class SplitState:
    """Exact heads (spec exact=) beside the rest: their own KV cache, the rest's own state."""
    exact: KVCache
    rest: object

# ---- 3. LoLA's sparse cache: the update, and its schedule token by token ----------
def lola_select(state, cand, n_keep, kv_groups):
    """LoLA's sparse-cache update (McDermott et al. 2025, Sec. 3): candidate Pairs (the cache and
    the pending block) scored by their self-recall error against the linear state, SRE(k, v) = ||S^T
    phi(k) / z^T phi(k) - v||^2 (phi(k): the key's features; 0 recalled where z^T phi(k) = 0), per
    KV head the mean over its query heads. The n_keep worst recalled stay in the cache; the rest are
    folded into the state. (The paper's SRE; its public code scores differently.) -> (kept: sorted
    indices (B, H_kv, n_keep), the new LinearState)."""
    rep = lambda x: x.repeat_interleave(kv_groups, 1)  # noqa: E731, GQA: query head h reads kv head h // g
    num, den = cand.phi @ state.S, (cand.phi @ state.z[..., None])[..., 0]   # (B, H, L, D), (B, H, L)
    sre = (_divide(num, den) - rep(cand.v)).square().sum(-1)                         # (B, H, L)
    sre = sre.unflatten(1, (-1, kv_groups)).mean(2)                                               # (B, H_kv, L)
    keep = sre.topk(min(n_keep, sre.shape[-1]), -1).indices.sort(-1).values                      # (B, H_kv, n_keep)
    fold = rep(torch.ones_like(sre, dtype=torch.bool).scatter(-1, keep, False))                  # (B, H, L)
    return keep, state.fold(cand.phi * fold[..., None], cand.c.masked_fill(~fold, NO_KEY), rep(cand.v),
                            len(cand) - keep.shape[-1])

# ---- 4. the attention core of one layer -------------------------------------------
class Attention(nn.Module):
    """The attention of one layer, chosen by an AttnSpec (or its string); owns the feature map and
    the window factors, one map per query head (q, k, v and kv_groups: see the module docstring).
    max_len: cosformer's M unless the spec sets it (the model's block_size). The mode is fixed here:
    softmax (exact, or with spec window: sliding-window softmax alone, 'window'), linear, window
    (the sliding-window hybrid, LoLA's cache), diag (LLN+Diag). Exact heads (spec exact=): the query
    heads of those KV heads run exact softmax with a KV cache of their own, the others the mode,
    with maps of their own (SplitState); every KV head exact is a softmax layer. share: after a
    window forward, each row's share of attention on the softmax part (B, H_rest, T), detached.
        y = core(q, k, v)                                            # (B, H, T, D)
        y, state = core(q, k, v, return_state=True)                  # prefill
        y, state = core(q1, k1, v1, state=state, return_state=True)  # decode: a new state (the old one stays valid)"""

    def __init__(self, spec, head_dim, n_heads, causal=True, kv_groups=1, max_len=None,
                 rope_inv_freq=None):
        super().__init__()
        self.spec = spec = A.AttnSpec.parse(spec)
        if kv_groups < 1 or n_heads % kv_groups:
            raise ValueError(f"kv_groups must divide n_heads={n_heads}, got {kv_groups}")
        if spec.cache and not causal:
            raise UsageError(f"attention spec '{spec}': the sparse cache follows the tokens (causal "
                             "models only)")
        self.head_dim, self.n_heads, self.causal, self.kv_groups = head_dim, n_heads, causal, kv_groups
        self.chunk_size = 64   # the linear paths' speed setting, not the outputs'
        self.share = None
        n_kv = n_heads // kv_groups
        exact = sorted({int(h) for h in spec.exact.split('+')} if spec.exact else ())   # KV heads
        if exact and exact[-1] >= n_kv:
            raise UsageError(f"attention spec '{spec}': exact names KV heads of 0..{n_kv - 1}")
        all_exact = len(exact) == n_kv   # every head exact: the layer is exact softmax
        exact = [] if all_exact else exact
        heads = torch.arange(n_heads).view(n_kv, kv_groups)   # query heads by KV head
        rest = [h for h in range(n_kv) if h not in exact]
        self.exact_q = heads[exact].flatten().tolist()   # the query heads kept exact
        self.rest_q = heads[rest].flatten().tolist()     # the others, with the mode's maps
        self.order = torch.tensor(self.exact_q + self.rest_q).argsort().tolist()   # -> head order
        for name, heads in (('exact_idx', self.exact_q), ('rest_idx', self.rest_q), ('order_idx', self.order)):
            self.register_buffer(name, torch.tensor(heads, dtype=torch.long), persistent=False)
        self.fmap = None
        if spec.name != 'softmax' and not all_exact:
            options = {'max_len': max_len} if spec.name == 'cosformer' and max_len is not None else {}
            options.update(spec.options)  # the spec's own max_len wins
            self.fmap = A.FEATURE_MAPS[spec.name](head_dim, len(self.rest_q), **options)
        if all_exact or (self.fmap is None and not spec.window):   # the modes: see the docstring
            self.mode = 'softmax'
        else:
            self.mode = 'window' if spec.window else 'diag' if spec.diag_block else 'linear'
        if spec.nope and rope_inv_freq is None:
            raise UsageError(f"attention spec '{spec}': nope undoes RoPE, and this model has none")
        self.inv_freq = rope_inv_freq   # (D/2,) RoPE's, fp32: not a buffer, which .to(dtype) would cast
        if spec.decay and self.fmap is not None:   # lambda = exp(-g), g = exp(decay_rate) per head
            rate = math.log(math.log(2) / spec.decay)
            self.decay_rate = nn.Parameter(torch.full((len(self.rest_q),), rate))
        if spec.window and self.fmap is not None:
            # gamma = sigmoid(theta) = 0.1 (LoLCATs' code: -2.197); mix: s = 1/2 until calibrate()
            theta = math.log(0.1 / 0.9) if spec.combine == 'joint' else 0.0
            self.window_factor = nn.Parameter(torch.full((len(self.rest_q),), theta))

    window = property(lambda self: self.spec.window)

    def factor(self):
        """The window factor through its sigmoid, per head: gamma (joint) or s (mix), on the window part."""
        return torch.sigmoid(self.window_factor) if self.fmap is not None else None

    def extra_repr(self):
        return f"spec='{self.spec}', causal={self.causal}, kv_groups={self.kv_groups}"

    def forward(self, q, k, v, state=None, return_state=False, key_padding_mask=None):
        A.check_qk(q, k, self.head_dim, self.n_heads)
        if key_padding_mask is not None and self.causal:
            raise ValueError("key_padding_mask is for bidirectional (encoder) attention only")
        if state is not None and not self.causal:
            raise ValueError("a bidirectional core has no decode state")
        if not self.exact_q:
            y, state = self._run(q, k, v, state, return_state, key_padding_mask)
            return (y, state) if return_state else y
        # exact heads (spec exact=) with a KV cache of their own, beside the rest
        e, r = self.exact_idx, self.rest_idx
        qe, ke, ve = (x.index_select(1, e) for x in (q, k, v))
        qr, kr, vr = (x.index_select(1, r) for x in (q, k, v))
        ye, se = (self._softmax_decode(qe, ke, ve, state.exact) if state is not None else
                  self._softmax_parallel(qe, ke, ve, key_padding_mask, return_state))
        yr, sr = self._run(qr, kr, vr, state and state.rest, return_state, key_padding_mask)
        y = torch.cat([ye.to(yr.dtype), yr], 1).index_select(1, self.order_idx)   # head order
        return (y, SplitState(se, sr)) if return_state else y

    def _run(self, q, k, v, state, return_state, key_padding_mask):
        """The mode's method for this phase: (y, the new state)."""
        if self.mode == 'softmax':
            if state is None:
                return self._softmax_parallel(q, k, v, key_padding_mask, return_state)
            return self._softmax_decode(q, k, v, state)
        with torch.autocast(q.device.type, enabled=False):   # float32 inside (float64 stays)
            q, k, v32 = acc(q), acc(k), acc(v)
            if self.mode == 'linear':
                y, state = self._linear(q, k, v32, state, key_padding_mask)
            elif self.spec.cache:   # LoLA runs its decode schedule from the start
                y, state = self._lola(q, k, v32, state)
            elif state is None:
                parallel = self._window_parallel if self.mode == 'window' else self._diag_parallel
                y, state = parallel(q, k, v32, key_padding_mask, return_state)
            else:   # tokens after a state, one step each
                step = self._window_step if self.mode == 'window' else self._diag_step
                ys = []
                for t in range(q.shape[2]):
                    y, state = step(q[:, :, t:t + 1], k[:, :, t:t + 1], v32[:, :, t:t + 1], state)
                    ys.append(y)
                y = ys[0] if len(ys) == 1 else torch.cat(ys, 2)
        return y.to(v.dtype), state   # y in v's dtype

    def weights(self, q, k, key_padding_mask=None):
        """The (B, H, T, T) matrix this core applies, float32: its output for identity values."""
        eye = torch.eye(k.shape[-2], device=k.device).expand(*k.shape[:2], -1, -1)
        return self(q.float(), k.float(), eye, key_padding_mask=key_padding_mask)

    def _features(self, q, k, offset, key_padding_mask=None, pos=None):
        """fmap.features with padding keys removed (phi_k 0, c_k NO_KEY) and spec decay as shifts:
        lambda^(t-s) = exp(g s) / exp(g t), key s by +g s, query t by -g t (in linear attention alone
        the query's cancels; a window hybrid weighs the two parts by it); positions from pos (a device
        tensor, in steps) or offset. None x 4 without a linear part."""
        if self.fmap is None:
            return None, None, None, None
        start = offset if pos is None else pos   # the first token's position
        phi_q, phi_k, c_q, c_k = self.fmap.features(*self.map_inputs(q, k, start), offset)
        if key_padding_mask is not None:
            phi_k = phi_k * key_padding_mask[:, None, :, None]
            c_k = c_k.masked_fill(~key_padding_mask[:, None], NO_KEY)
        if self.spec.decay:
            t = torch.arange(q.shape[2], device=q.device) + start             # (T,)
            gt = torch.exp(self.decay_rate)[:, None] * t                      # (H, T)
            c_q, c_k = c_q - gt, c_k + gt
        return phi_q, phi_k, c_q, c_k

    def map_inputs(self, q, k, start=0):
        """q, k (B, H, T, D) as the linear part's maps see them: with nope, rotated back to position 0
        from positions start..start+T-1; as given otherwise."""
        if not self.spec.nope:
            return q, k
        if self.inv_freq.device != q.device:   # once per device, before any graph capture
            self.inv_freq = self.inv_freq.to(q.device)
        t = torch.arange(q.shape[2], device=q.device) + start                # (T,)
        angle = (t[:, None] * self.inv_freq).repeat(1, 2)                    # (T, D)
        return tuple(A.apply_rope(x, angle.cos(), -angle.sin()) for x in (q, k))

    @property
    def shifted(self):
        """Whether the keys' shifts can be other than 0: exp-based maps, or a decay."""
        return self.fmap is not None and (self.fmap.log_domain or bool(self.spec.decay))

    # -- softmax: SDPA; its decode state a KV cache
    def _softmax_parallel(self, q, k, v, key_padding_mask, return_state):
        k, v = k[:, ::self.kv_groups], v[:, ::self.kv_groups]   # (B, H_kv, T, D): the model's heads
        mask = None if key_padding_mask is None else key_padding_mask[:, None, None, :]
        y = softmax_attention(q, k, v, self.causal, attn_mask=mask)
        return y, KVCache.start(k, v) if return_state and self.causal else None

    def _softmax_decode(self, q, k, v, state):
        """Tokens after a KV cache: appended, then every query reads the cache (causal within the
        new tokens)."""
        st = state.append(k[:, ::self.kv_groups], v[:, ::self.kv_groups])
        keys, values, mask = st.keys()
        if q.shape[2] > 1:
            mask = A.causal_mask(q.shape[2], st.n, q.device)
        return softmax_attention(q, keys, values, causal=False, attn_mask=mask), st

    # -- linear: one path for both phases, from a state (S, z, m) or from zeros
    def _linear(self, q, k, v, state, key_padding_mask=None):
        n, T = (0 if state is None else state.n), q.shape[2]
        pos = None if state is None else state.pos
        phi_q, phi_k, _, c_k = self._features(q, k, n, key_padding_mask, pos)
        if state is not None and T == 1:   # one token: one outer product, one read
            linear = state.add(phi_k, v, c_k if self.shifted else None)
            return _divide(*linear.read(phi_q)), linear
        init = None if state is None else (state.S, state.z, state.m)
        y, (S, z, m) = linear_attention(phi_q, phi_k, v, self.causal, self.spec.impl, 0.0,
                                        self.chunk_size, init, True, c_k)
        if not self.causal:
            return y, None
        return y, LinearState(S, z, m, n + T, _position(q, n + T) if pos is None else pos + T)

    # -- diag (LLN+Diag): linear attention plus softmax within blocks, averaged
    def _diag_parallel(self, q, k, v, key_padding_mask, return_state):
        T, b = q.shape[2], self.spec.diag_block
        y, linear = self._linear(q, k, v, None, key_padding_mask)
        y = 0.5 * (y + block_diagonal_softmax(q, k, v, b, self.causal, key_padding_mask))
        if not (return_state and self.causal):
            return y, None
        g, start = self.kv_groups, T // b * b   # the partial block: tokens start..T-1
        k1, v1 = k[:, ::g, start:], v[:, ::g, start:]
        positions = torch.arange(start, T, device=q.device)
        slots = Slots.empty(k1, v1, b).write(0, T, positions % b, positions, k1, v1)
        return y, DiagState(linear, slots, _position(q, T), T)

    def _diag_step(self, q, k, v, st):
        """One token: the linear state with it, then read; softmax over its block so far."""
        b, g = self.spec.diag_block, self.kv_groups
        phi_q, phi_k, _, c_k = self._features(q, k, st.n, pos=st.pos)
        linear = st.linear.add(phi_k, v, c_k if self.shifted else None)
        y_linear = _divide(*linear.read(phi_q))                            # (B, H, 1, D)
        slot = st.pos % b
        slots = st.slots.write(st.n, st.n + 1, slot, st.pos, k[:, ::g], v[:, ::g])
        in_block = (slots.pos >= st.pos - slot)[None]                      # (1, b) this block's
        y_block = softmax_attention(q, slots.k, slots.v, causal=False, attn_mask=in_block)
        return 0.5 * (y_linear + y_block), DiagState(linear, slots, st.pos + 1, st.n + 1)

    # -- window: sliding-window softmax + linear (LoLCATs), sinks
    def _window_parallel(self, q, k, v, key_padding_mask, return_state):
        """All tokens from the start, without a cache: window_linear_attention; a WindowState."""
        phi_q, phi_k, c_q, c_k = self._features(q, k, 0, key_padding_mask)
        y, share = window_linear_attention(q, k, v, phi_q, phi_k, c_q, c_k, self.spec, self.factor(),
                                           self.causal, key_padding_mask, self.chunk_size)
        self.share = share.detach()
        if not (return_state and self.causal):
            return y, None
        return y, self._window_state(k, v, phi_k, c_k)

    def _window_state(self, k, v, phi_k, c_k):
        """The window's decode state after tokens k, v (B, H, T, D) with their features (or None)."""
        (B, H, T, D), g = k.shape, self.kv_groups
        W, N = self.window, min(self.spec.sinks, T)
        k1, v1 = k[:, ::g], v[:, ::g]                                      # (B, H_kv, T, D)
        c_kept = c_k if self.shifted else None   # shifts, if any
        slots = Slots.empty(k1, v1, self.spec.sinks + W, phi_k, c_kept, sinks=self.spec.sinks)
        sinks = torch.arange(N, device=k.device)
        recent = torch.arange(max(T - W, 0), T, device=k.device)           # the ring's tokens
        marker = recent.where(recent >= self.spec.sinks, -1)               # a sink: attended as one
        for p, slot, mark in ((sinks, sinks, sinks), (recent, self.spec.sinks + recent % W, marker)):
            pairs = (None if x is None else x[:, :, p] for x in (k1, v1, phi_k, c_kept))
            slots = slots.write(slots.owner[0], T, slot, mark, *pairs)
        linear = None
        if phi_k is not None:   # tokens sinks..T-W have left the window: folded
            fold = slice(self.spec.sinks, max(T - W + 1, self.spec.sinks))
            empty = LinearState.empty(B, H, phi_k.shape[-1], D, k)
            linear = empty.fold(phi_k[:, :, fold], c_k[:, :, fold], v[:, :, fold], T)
        return WindowState(slots, linear, _position(k, T), T)

    def _window_step(self, q, k, v, st):
        """One token after state st: written into its ring slot (and its sink slot while there are
        fewer than `sinks`), the query attends to the slots (softmax) and to the folded pairs
        (linear), then the token that leaves the window for the next query is folded."""
        W, N, g = self.window, self.spec.sinks, self.kv_groups
        phi_q, phi_k, c_q, c_k = self._features(q, k, st.n, pos=st.pos)
        features = () if phi_k is None else (phi_k, c_k if self.shifted else None)
        k1, v1 = (k, v) if g == 1 else (k[:, ::g], v[:, ::g])            # (B, H_kv, 1, D)
        ring = st.pos % W + N                                              # (1,) its ring slot
        marker = st.pos.where(st.pos >= N, -1) if st.n < N else st.pos    # a sink: attended as one
        slots = st.slots.write(st.n, st.n + 1, ring, marker, k1, v1, *features)
        if st.n < N:   # a sink: in its own slot too
            slots = slots.write(st.n + 1, st.n + 1, st.pos, st.pos, k1, v1, *features)
        num, den, m = self._slots_softmax(q, slots)                       # (B, H, 1, D), (B, H, 1)
        if st.linear is None:   # sliding-window softmax alone
            return num / den[..., None], replace(st, slots=slots, pos=st.pos + 1, n=st.n + 1)
        num_l, den_l = st.linear.read(phi_q)
        y, _ = combine_window_linear(num, den, m, num_l, den_l, c_q + st.linear.m[..., None],
                                     self.factor(), self.spec.combine)
        return y, WindowState(slots, self._fold_leaving(st, slots), st.pos + 1, st.n + 1)

    def _slots_softmax(self, q, slots):
        """One query per head q (B, H, 1, D) against the slots' pairs (B, H_kv, L, D) where their
        pos >= 0, unnormalised: num (B, H, 1, D), den and m (B, H, 1) as _window_softmax; the g
        query heads of a KV head are g rows of one product."""
        B, H, _, D = q.shape
        qg = q.view(B, H // self.kv_groups, self.kv_groups, D) * D ** -0.5   # (B, H_kv, g, D)
        s = (qg @ slots.k.mT).masked_fill(slots.pos < 0, float('-inf'))       # (B, H_kv, g, L)
        m = s.amax(-1, keepdim=True)                                           # the token: finite
        a = torch.exp(s - m)
        return (a @ slots.v).view(B, H, 1, -1), a.sum(-1).view(B, H, 1), m.view(B, H, 1)

    def _fold_leaving(self, st, slots):
        """st's linear state with the token that leaves the window for the next query folded: the
        one in the ring's next slot (none where that slot is empty or holds a sink)."""
        W, N, g = self.window, self.spec.sinks, self.kv_groups
        leaving = (st.pos + 1) % W + N                                     # (1,)
        phi, v = slots.phi.index_select(2, leaving), slots.v.index_select(2, leaving)
        v = v if g == 1 else v.repeat_interleave(g, 1)                     # (B, H, 1, D)
        c = slots.c.index_select(2, leaving) if slots.c is not None else None
        if st.n + 1 - W < N:   # the slot may be empty or hold a sink: weigh it 0
            real = slots.pos.index_select(0, leaving) >= 0                 # (1,) bool
            phi, c = phi * real, None if c is None else c.masked_fill(~real, NO_KEY)
        return st.linear.add(phi, v, c)

    # -- LoLA's sparse cache (spec cache=): its schedule in segments, prefill and decode alike
    def _lola(self, q, k, v, state):
        """Tokens after a state (or from the start) in segments within which the linear part is
        fixed: each ends where a block of cache_block pairs leaves the softmax part (the update)."""
        if state is None:   # from the start: no pairs, an empty linear state
            (B, H, _, D), Dv, g, F = q.shape, v.shape[-1], self.kv_groups, self.fmap.feature_dim
            none = Pairs(q.new_zeros(B, H // g, 0, D), q.new_zeros(B, H // g, 0, Dv))
            with_phi = replace(none, phi=q.new_zeros(B, H, 0, F), c=q.new_zeros(B, H, 0))
            state = LolaState(0, none, with_phi, with_phi, LinearState.empty(B, H, F, Dv, q))
        C, T = self.spec.cache_block, q.shape[2]
        ys, shares, t = [], [], 0
        while t < T:
            n = min(T - t, self.window - 1 + C - len(state.buffer))   # tokens up to the next update
            qs, ks, vs = (x[:, :, t:t + n] for x in (q, k, v))
            y, share, phi_k, c_k = self._lola_segment(qs, ks, vs, state)
            state = self._lola_update(self._lola_push(state, ks, vs, phi_k, c_k))
            ys, shares, t = ys + [y], shares + [share], t + n
        self.share = torch.cat(shares, 2).detach()
        return torch.cat(ys, 2), state

    def _lola_segment(self, q, k, v, st):
        """Outputs of tokens q, k, v (B, H, n, D) right after state st, the linear part fixed:
        (y, share, phi_k, c_k). Softmax part: the sinks, the cache (always seen) and the buffer and
        new tokens up to the query."""
        n, o, g = q.shape[2], st.offset, self.kv_groups
        soft = st.sinks.cat(st.cache).cat(st.buffer).cat(Pairs(k[:, ::g], v[:, ::g]))
        pos = torch.cat([torch.arange(len(st.sinks)), torch.full((len(st.cache),), -1),
                         torch.arange(o - len(st.buffer), o + n)]).to(q.device)   # keys' positions
        keys, vals = soft.k.repeat_interleave(g, 1), soft.v.repeat_interleave(g, 1)
        visible = pos <= torch.arange(o, o + n, device=q.device)[:, None]
        num_w, den_w, m_w = _window_softmax(q, keys, vals, visible)
        phi_q, phi_k, c_q, c_k = self._features(q, k, o)
        L = st.linear
        num_l, den_l = phi_q @ L.S, (phi_q @ L.z[..., None])[..., 0]
        y, share = combine_window_linear(num_w, den_w, m_w, num_l, den_l, c_q + L.m[..., None],
                                         self.factor(), self.spec.combine)
        return y, share, phi_k, c_k

    def _lola_push(self, st, k, v, phi_k, c_k):
        """The state with tokens k, v (B, H, n, D) appended: the first go to the sinks while there
        are fewer than spec.sinks, the others to the buffer."""
        s, g = min(max(self.spec.sinks - st.offset, 0), k.shape[2]), self.kv_groups
        sinks = st.sinks.cat(Pairs(k[:, ::g, :s], v[:, ::g, :s]))
        rest = Pairs(k[:, ::g, s:], v[:, ::g, s:], phi_k[:, :, s:], c_k[:, :, s:])
        return replace(st, offset=st.offset + k.shape[2], sinks=sinks, buffer=st.buffer.cat(rest))

    def _lola_update(self, st):
        """Once the buffer holds window - 1 + C tokens, its first C leave the softmax part: they and
        the cache compete (lola_select), the losers are folded."""
        C = self.spec.cache_block
        if len(st.buffer) < self.window - 1 + C:
            return st
        cand, g = st.cache.cat(st.buffer.cut(0, C)), self.kv_groups
        keep, linear = lola_select(st.linear, cand, self.spec.cache, g)
        return replace(st, buffer=st.buffer.cut(C), cache=cand.take(keep, g), linear=linear)

    @torch.no_grad()
    def calibrate(self, q, k, key_padding_mask=None):
        """Initialisation from teacher queries/keys (B, H, T, D) of B sequences (key_padding_mask
        (B, T): True at real tokens): LLN's statistics of the real tokens; mix's s = the teacher's
        mean softmax mass in the softmax part (window and sinks) over the rows that also see other
        keys, exact for an average row (clamped to [1e-4, 1 - 1e-4]), one sequence at a time (H x T
        x T floats)."""
        q, k = q[:, self.rest_q], k[:, self.rest_q]   # the heads with a map (exact heads need nothing)
        B, H, T, _ = q.shape
        real = torch.ones(B, T, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask
        if hasattr(self.fmap, 'calibrate'):
            seen = self.map_inputs(q, k)   # (B, H, T, D) each -> the real tokens, (1, H, N, D)
            self.fmap.calibrate(*(x.transpose(1, 2)[real.bool()].transpose(0, 1)[None] for x in seen))
        if self.window and self.fmap is not None and self.spec.combine == 'mix':
            j = torch.arange(T, device=q.device)
            seen = A.causal_mask(T, T, q.device) if self.causal else torch.ones(T, T, dtype=torch.bool, device=q.device)
            soft = (_in_window(j[:, None], j, self.window, self.causal) | (j < self.spec.sinks)) & seen  # (T, T)
            total, n = 0.0, 0
            for b in range(B):
                vis = seen & real[b].bool()  # the real keys of each row
                rows = real[b].bool() & (vis & ~soft).any(-1)  # real rows that see keys of the linear part too
                total = total + (A.softmax_weights(q[b:b + 1], k[b:b + 1], attn_mask=vis)[0] * soft).sum(-1)[:, rows] \
                    .double().sum(-1)  # (H,)
                n += int(rows.sum())
            if n:
                self.window_factor.copy_(torch.logit((total / n).clamp(1e-4, 1 - 1e-4)))
