"""
One layer's attention, `Attention`, and the families it runs: one small class each, its all-tokens
(parallel) form, its one-token step and its decode state side by side. In reading order:
  1. the hybrids, all tokens at once: sliding-window softmax + linear (LoLCATs-w), block-diagonal
     softmax + linear (LLN+Diag)
  2. the states' parts: LinearState (S, z, m), Slots (pairs in fixed slots); state_nbytes,
     static_state (a CUDA graph's), copy_state_
  3. Attention, the thin layer: the spec, the exact heads (SplitState), the features the maps see
  4. the families: Softmax (KVCache), Linear (LinearState; fusable/fused_step: its step and Window's
     in one Triton launch), Window (WindowState), Diag (DiagState), Lola (LolaState; LoLA's update,
     lola_select; its schedule written out token by token in float64, what the fast forms are tested
     against: tests/test_cache.py)

A decode state is a value: a step returns a new state and never writes where an older state reads,
so continuations of one state (branches, beam search, a chat that rewinds) each equal the full
forward on their tokens, whatever order they run in. Slots are rewritten out of place (a copy of the
window's pairs a step, as the linear state's S is new each step); a KV cache appends past the n
tokens its older states read, copying first where another continuation wrote already. Only a CUDA
graph's state (static_state: buffers of its own) is written in place. A step's shapes do not depend
on the position (a tensor on the device): model.DecodeGraph replays it. q, k, v: (B, H, T, D) after
RoPE, k and v repeated to H heads; states keep the H_kv = H / kv_groups key/value heads (k[:, ::g]).
"""

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as nnf   # F is the feature dimension

import attention as A
import kernels
from attention import (NO_KEY, UsageError, acc, divide, exp_as, linear_attention,
                       linear_attention_parts)

# ---- 1. the hybrids, all tokens at once ----------------------------------------
def _band_blocks(x, w):
    """(B, H, T, E) -> (B, H, n = ceil(T / w), 3w, E): for each block b of w rows, blocks b - 1, b,
    b + 1 (0-padded)."""
    n = math.ceil(x.shape[2] / w)
    x = nnf.pad(x, (0, 0, w, (n + 1) * w - x.shape[2]))  # (B, H, (n + 2) w, E)
    return x.unfold(2, 3 * w, w).mT  # windows of 3w rows every w rows

def _in_window(i, j, w, causal):
    """Key j is in query i's window: i - w < j <= i (causal) or |i - j| < w; the linear part sees
    the rest."""
    return ((i - j < w) & (i >= j)) if causal else ((i - j).abs() < w)

def _window_softmax(q, k, v, visible):
    """The window part, unnormalised: (a v, sum_j a, m), a_ij = exp(s_ij - m_i) where visible, s_ij
    = q_i.k_j / sqrt(D), m_i the row's largest visible score (0 for a row that sees no key)."""
    s = torch.einsum('...id,...jd->...ij', q, k).masked_fill(~visible,
                                                             float('-inf')) * q.shape[-1] ** -0.5
    m = s.amax(-1, keepdim=True).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # -inf: a row that
                                                                              # sees no key
    a = torch.exp(s - m)
    return a @ v, a.sum(-1), m[..., 0]

def _merge(a, b):
    """Two unnormalised parts (num, den, m) over disjoint keys as one, each of true mass den exp(m)
    (_window_softmax's, linear_attention_parts'); m: the larger of the two (a row that sees no key
    has den 0 and adds nothing)."""
    ma, mb = (x[2].where(x[1] > 0, -math.inf) for x in (a, b))
    m = torch.maximum(ma, mb).nan_to_num(neginf=0.0)
    ra = exp_as(ma - m, a[0])
    rb = exp_as(mb - m, b[0])
    return a[0] * ra[..., None] + b[0] * rb[..., None], a[1] * ra + b[1] * rb, m

def combine_window_linear(num_w, den_w, num_l, den_l, c, factor, combine='joint'):
    """The window and linear parts of the sliding-window hybrid combined, per query row: num_w,
    den_w from _window_softmax (its m not needed); num_l, den_l the linear sums of shifted
    features (exact mass exp(c) den_l); factor (H,).
      joint (LoLCATs, ICLR 2025, Eq. 8, and its code): one normalisation of window weights
            gamma exp(s_ij - m_i) and linear weights phi(q_i).phi(k_j), gamma = factor. m_i is NOT
            compensated: window weights are <= gamma, on the kernel's scale (an exact softmax
            window outweighs it by exp(m_i), e^20 and more at sinks);
      mix   (LoLCATs workshop paper, Eq. 8): y = s num_w / den_w + (1 - s) num_l / den_l,
            s = factor.
    As p y_window + (1 - p) y_linear, p the window part's share: for joint, gamma den_w against
    exp(c) den_l, in log space. A row without linear keys is the window part, one without window
    keys the linear part, 0 with neither. Returns y and p, float32 (Window.step: the same for one
    query, in fewer ops)."""
    # (an empty part's den 1 in the log: no nan in a gradient)
    has_w = den_w > 0
    has_l = den_l > 0
    f = factor.to(den_w.dtype)[:, None]                               # (H, 1) against (B, H, T)
    ratio = f * den_w.where(has_w, 1.0) / den_l.where(has_l, 1.0)
    p = torch.sigmoid(torch.log(ratio) - c.to(den_w.dtype)) if combine == 'joint' else f
    p = torch.where(has_w, p.where(has_l, 1.0), 0.0)
    return torch.lerp(divide(num_l, den_l), divide(num_w, den_w), p[..., None]), p

def _window_part(q, k, v, w, n_sinks, causal, keys):
    """The softmax part of the window hybrid, unnormalised (num, den, m) per row (B, H, T, ..): the
    row's window (blocks of w queries against the previous, this and the next block of keys) and
    the first n_sinks keys outside it. keys (B, T): True at real (not padding) keys."""
    T = q.shape[2]
    n = math.ceil(T / w)
    q_blocks = nnf.pad(q, (0, 0, 0, n * w - T)).unflatten(2, (n, w))        # (B, H, n, w, D)
    rows = torch.arange(n * w, device=q.device).view(n, w, 1)                # (n, w, 1) query
                                                                             # positions
    cols = rows[:, :1] - w + torch.arange(3 * w, device=q.device)            # (n, 1, 3w) key
                                                                             # positions
    real = _band_blocks(keys[:, None, :, None].float(), w)[..., 0] > 0.5     # (B, 1, n, 3w)
    visible = _in_window(rows, cols, w, causal) & real[:, :, :, None, :]     # (B, 1, n, w, 3w)
    parts = _window_softmax(q_blocks, _band_blocks(k, w), _band_blocks(v, w), visible)
    window = tuple(x.flatten(2, 3)[:, :, :T] for x in parts)                # (B, H, T, ..)
    if not n_sinks:
        return window
    i = torch.arange(T, device=q.device)[:, None]                            # (T, 1) queries
    j = torch.arange(n_sinks, device=q.device)                               # (N,) sink keys
    outside = ~_in_window(i, j, w, causal) & ((i >= j) | (not causal))       # (T, N)
    sinks = _window_softmax(q, k[:, :, :n_sinks], v[:, :, :n_sinks],
                            outside & keys[:, None, None, :n_sinks])          # mask (B, 1, T, N)
    return _merge(window, sinks)

def _shift(x, w, fill=0.0):
    """x_t <- x_{t - w} along time (dim 2); the first w positions filled."""
    front = x.new_full((*x.shape[:2], w, *x.shape[3:]), fill)
    return torch.cat([front, x], 2)[:, :, :x.shape[2]]

def _linear_part(phi_q, phi_k, v, c_k, w, impl, chunk_size):
    """The window hybrid's linear part, unnormalised (num, den, m): causal linear attention over
    the keys that have left each row's window, i.e. over keys shifted w positions later."""
    phi_k = _shift(phi_k, w)
    v = _shift(v, w)
    c_k = _shift(c_k, w, NO_KEY)
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
    T = q.shape[2]
    n_sinks = min(spec.sinks, T)
    num_w, den_w, _ = _window_part(acc(q), acc(k), acc(v), spec.window, n_sinks, causal,
                                   _real(q, key_padding_mask))
    if phi_q is None:   # no linear part: the softmax part alone (a row with no key gives 0)
        return divide(num_w, den_w).to(v.dtype), torch.ones_like(den_w)
    is_sink = torch.arange(T, device=q.device) < n_sinks     # sinks are not in the linear part
    phi_k = acc(phi_k) * ~is_sink[:, None]
    if spec.delta:   # the delta rule (causal) over the keys that left the window; c_k: their gates
        shifted = (_shift(x, spec.window) for x in (phi_k, v, c_k))   # gates 0: beta 0, alpha 1
        num_l = A.delta_rule(phi_q, *shifted, spec.impl, chunk_size)[0]
        den_l = torch.ones_like(num_l[..., 0])                         # (its read needs no z)
        c = None                                                       # (mix: not read)
    else:
        c_k = c_k.masked_fill(is_sink, NO_KEY)
        linear = _linear_part(phi_q, phi_k, v, c_k, spec.window, spec.impl, chunk_size)
        if not causal:   # plus the keys j >= i + window: the same, backwards in time
            flipped = (x.flip(2) for x in (phi_q, phi_k, v, c_k))
            back = _linear_part(*flipped, spec.window, spec.impl, chunk_size)
            linear = _merge(linear, [x.flip(2) for x in back])
        num_l, den_l, m_l = linear
        c = c_q + m_l
    y, share = combine_window_linear(num_w, den_w, num_l, den_l, c, factor, spec.combine)
    return y.to(v.dtype), share

def block_diagonal_softmax(q, k, v, block, causal=True, key_padding_mask=None):
    """Softmax within blocks of `block` tokens (the last maybe shorter): LLN+Diag, Nahshan et al.
    2023, Sec. 4.2."""
    B, _, T, _ = q.shape
    # pad: to a whole number of blocks
    n = math.ceil(T / block)
    pad = -T % block
    qb, kb, vb = (nnf.pad(t, (0, 0, 0, pad)).unflatten(2, (n, block)) for t in (q, k, v))
    # real keys, not padding
    mask = nnf.pad(_real(q, key_padding_mask), (0, pad)).view(B, 1, n, 1, block)
    if causal:
        mask = mask & A.causal_mask(block, block, q.device)
    # a padded query sees itself: finite
    mask = mask | torch.eye(block, dtype=torch.bool, device=q.device)
    return nnf.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask).flatten(2, 3)[:, :, :T]

# ---- 2. the states' parts, and what every state offers ---------------------------
@dataclass(frozen=True)
class LinearState:
    """Linear attention's state in units of exp(-m) (attention.linear_attention_parts):
    S = sum phi_k exp(c - m) v^T, z = sum phi_k exp(c - m) over the n keys folded in."""
    S: torch.Tensor   # (B, H, F, D)
    z: torch.Tensor   # (B, H, F)
    m: torch.Tensor   # (B, H): the largest shift c folded in (NO_KEY: none yet; float64 with a
                      # decay)
    n: int            # tokens folded in (linear and diag: every token so far)
    pos: torch.Tensor | None = None   # (1,) long on the device, linear and diag: tokens seen

    @staticmethod
    def empty(B, H, F, D, like):
        return LinearState(like.new_zeros(B, H, F, D), like.new_zeros(B, H, F),
                           like.new_full((B, H), NO_KEY), 0)

    def fold(self, phi, c, v, n):
        """The state with pairs added: phi (B, H, L, F) shifted features, c (B, H, L) their shifts
        (NO_KEY: not added), v (B, H, L, D); n: how many of them count as folded."""
        Sz = torch.cat([self.S, self.z[..., None]], -1)                    # [S | z] (B, H, F, D +
                                                                           # 1)
        Sz, m = A.fold(Sz, self.m, phi, c, nnf.pad(v, (0, 1), value=1.0))
        return LinearState(Sz[..., :-1], Sz[..., -1], m, self.n + n)

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
        r = exp_as(self.m - m, phi)[..., None]                       # (B, H, 1) old units -> m
        pk = phi * exp_as(c - m, phi)[..., None, None]               # (B, H, 1, F)
        S = torch.addcmul(self.S * r[..., None], pk.mT, v)
        return LinearState(S, torch.addcmul(pk[:, :, 0], self.z, r), m, self.n + 1, pos)

    def read(self, phi_q):
        """num (B, H, L, D) = phi_q S and den (B, H, L) = phi_q . z of queries phi_q (B, H, L, F),
        in its units."""
        return phi_q @ self.S, torch.einsum('bhlf,bhf->bhl', phi_q, self.z)

@dataclass(frozen=True)
class DeltaState:
    """The delta rule's state (attention.delta_step): S = what each unit key recalls, no normaliser,
    no shifts; fold and add take the keys' gates (B, H, L, 2), beta and log alpha, where
    LinearState's take their shifts, and read gives den 1 (y = S^T phi(q))."""
    S: torch.Tensor   # (B, H, F, D)
    n: int            # tokens folded in
    pos: torch.Tensor | None = None   # (1,) long on the device, Linear's: tokens seen

    def fold(self, phi, gates, v, n):
        """The state with keys phi (B, H, L, F) written in order (delta_rule's chunked form)."""
        return DeltaState(A.delta_rule(phi, phi, v, gates, S=self.S)[1], self.n + n)

    def add(self, phi, v, gates):
        """The state with one key per row written: phi (B, H, 1, F), v (B, H, 1, D)."""
        S = A.delta_step(self.S, phi[:, :, 0], v[:, :, 0], gates[:, :, 0])
        return DeltaState(S, self.n + 1, None if self.pos is None else self.pos + 1)

    def read(self, phi_q):
        return phi_q @ self.S, torch.ones_like(phi_q[..., 0])

@dataclass(frozen=True)
class Slots:
    """Key-value pairs in fixed slots (dim 2): a window's sinks and ring, LLN+Diag's block. pos
    (L,): the position each slot holds, -1 where none."""
    k: torch.Tensor                   # (B, H_kv, L, D)
    v: torch.Tensor                   # (B, H_kv, L, Dv)
    pos: torch.Tensor                 # (L,) long
    static: bool = False              # a CUDA graph's own: written in place

    @staticmethod
    def empty(k, v, L):
        """L empty slots for pairs shaped like k, v (B, H_kv, ., D)."""
        k, v = (x.new_zeros(*x.shape[:2], L, x.shape[3]) for x in (k, v))
        return Slots(k, v, k.new_full((L,), -1, dtype=torch.long))

    def write(self, slot, position, k, v):
        """The slots with pairs k, v (B, H_kv, m, D) at `slot` ((m,) long, on the device), pos
        recording `position` there: new tensors (the old slots stay as they were), or static,
        written in place."""
        def put(x, src, dim=2):
            return x.index_copy_(dim, slot, src) if self.static else x.index_copy(dim, slot, src)
        return Slots(put(self.k, k), put(self.v, v), put(self.pos, position, 0), self.static)

class Empty:
    """The decode state of no tokens (a prefill of 0): the tokens after it run as from the start,
    by the family's all-tokens form (softmax's: a KV cache of 0 tokens). False, as None."""
    __bool__ = lambda self: False   # noqa: E731

def state_tensors(state):
    """The tensors of a decode state (or a list of them), in order, nested states included."""
    if hasattr(state, '__dataclass_fields__'):   # a state: its fields, in order
        state = list(vars(state).values())
    if torch.is_tensor(state):
        yield state
    elif isinstance(state, (list, tuple)):
        for s in state:
            yield from state_tensors(s)

def state_nbytes(state):
    """Bytes held by a decode state (or a list of them, one per layer), all KV capacity included."""
    return sum(t.numel() * t.element_size() for t in state_tensors(state))

def static_state(state, capacity):
    """The decode state in buffers of its own with fixed shapes, for a CUDA graph
    (model.DecodeGraph), which writes into them in place: KV caches static with room for `capacity`
    tokens, slots and sums copied (the state it was made from stays valid)."""
    if isinstance(state, KVCache):
        return state.reserve(capacity, static=True)
    if isinstance(state, SplitState):
        return SplitState(static_state(state.exact, capacity), static_state(state.rest, capacity))
    if isinstance(state, LolaState):
        raise UsageError(
            "LoLA's cache (spec cache=) changes its shapes as it decodes: no CUDA graph")
    if isinstance(state, Empty):
        raise UsageError("a CUDA graph starts after a prompt of at least 1 token")
    if isinstance(state, WindowState) and state.n < state.sinks:
        raise UsageError(
            f"a CUDA graph starts after the sinks: a prompt of at least {state.sinks} tokens")
    state = _cloned(state)
    return replace(state, slots=replace(state.slots,
                                        static=True)) if hasattr(state, 'slots') else state

def _cloned(state):
    """The state with a copy of each tensor."""
    if torch.is_tensor(state):
        return state.detach().clone()
    if hasattr(state, '__dataclass_fields__'):
        return replace(state, **{name: _cloned(x) for name, x in vars(state).items()})
    return state

def copy_state_(dst, src):
    """Copy the tensors of state src (or a list of states) into those of dst, of the same structure,
    where they are not already the same tensor: a CUDA graph's new states back into its inputs."""
    for a, b in zip(state_tensors(dst), state_tensors(src)):
        if a is not b:
            a.copy_(b)

def _position(like, n):
    """n as a (1,) long tensor on like's device (made there: no copy from the host)."""
    return like.new_full((1,), n, dtype=torch.long)

# ---- 3. the layer: the spec, the exact heads, the features ------------------------
@dataclass(frozen=True)
class SplitState:
    """Exact heads (spec exact=) beside the rest: their own KV cache, the rest's own state."""
    exact: 'KVCache'
    rest: object

def exact_heads(spec, n_kv, causal, has_rope):
    """The KV heads spec exact= keeps softmax, sorted, after the checks that need the layer (its
    n_kv KV heads, whether it is causal and has RoPE): a UsageError naming the problem."""
    exact = sorted({int(h) for h in spec.exact.split('+')} if spec.exact else ())
    for bad, why in ((exact and exact[-1] >= n_kv, f"exact names KV heads of 0..{n_kv - 1}"),
                     (spec.cache and not causal,
                      "the sparse cache follows the tokens (causal models only)"),
                     (spec.decay + spec.delta and not causal,
                      "a decay or the delta rule follows the tokens (causal models only)"),
                     (spec.nope and not has_rope, "nope undoes RoPE, and this model has none")):
        if bad:
            raise UsageError(f"attention spec '{spec}': {why}")
    return exact

class Attention(nn.Module):
    """The attention of one layer, chosen by an AttnSpec (or its string): Attention(spec, ...)
    builds the family's class (section 4): Softmax (or every head exact), Linear, Window
    (sliding-window softmax alone without a map), Lola, Diag. This base holds what they share: the
    feature map (one per query head), its decay, the exact heads (spec exact=: the Softmax family's
    functions on those KV heads' query heads, with a KV cache of their own: SplitState), float32
    inside, the q, k the maps see (nope). A family writes parallel (all tokens from the start) and
    step (one token after a state); decode (tokens after a state) runs the steps unless it has a
    faster way. max_len: cosformer's M unless the spec sets it. share: a window forward's share of
    attention on the softmax part per row (B, H_rest, T), detached. forward's shared: a model step's
    dict (model.hidden_states) where what depends on the position alone is made once for every layer
    (Window.step's slots and masks); None: the call's own.
        y = core(q, k, v)                                            # (B, H, T, D)
        y, state = core(q, k, v, return_state=True)                  # prefill
        y, state = core(q1, k1, v1, state=state, return_state=True)  # decode: a new state
                                                                     # (the old one stays valid)"""
    mode, fuses = None, False   # the family's name; whether its step may run fused (fused_step)

    def __new__(cls, spec='softmax', head_dim=0, n_heads=1, causal=True,
                kv_groups=1, *args, **kwargs):
        if cls is Attention:   # the family, from the spec (and whether it keeps every KV head
                               # exact)
            s = A.AttnSpec.parse(spec)
            n_kv = n_heads // max(kv_groups, 1)
            all_exact = len(exact_heads(s, n_kv, causal, True)) == n_kv   # (nope's check: __init__)
            cls = Softmax if all_exact or (s.name == 'softmax' and not s.window) else \
                Lola if s.cache else Window if s.window else Diag if s.diag_block else Linear
        return super().__new__(cls)

    def __init__(self, spec, head_dim, n_heads, causal=True, kv_groups=1, max_len=None,
                 rope_inv_freq=None):
        super().__init__()
        self.spec = spec = A.AttnSpec.parse(spec)
        if kv_groups < 1 or n_heads % kv_groups:
            raise ValueError(f"kv_groups must divide n_heads={n_heads}, got {kv_groups}")
        n_kv = n_heads // kv_groups
        exact = exact_heads(spec, n_kv, causal, rope_inv_freq is not None)   # KV heads
        self.head_dim = head_dim
        self.n_heads = n_heads
        self.causal = causal
        self.kv_groups = kv_groups
        self.chunk_size = 64   # the linear paths' speed setting, not the outputs'
        exact = [] if len(exact) == n_kv else exact   # every head exact: the Softmax family
        heads = torch.arange(n_heads).view(n_kv, kv_groups)   # query heads by KV head
        self.exact_q = heads[exact].flatten().tolist()   # the query heads kept exact
        self.rest_q = heads[[h for h in range(n_kv) if h not in exact]].flatten().tolist()
        order = torch.tensor(self.exact_q + self.rest_q).argsort().tolist()   # -> head order
        for name, idx in (('exact_idx', self.exact_q), ('exact_kv', heads[exact, 0].tolist()),
                          ('rest_idx', self.rest_q), ('order_idx', order)):   # exact_kv: 1 per KV
            self.register_buffer(name, torch.tensor(idx, dtype=torch.long), persistent=False)
        self.fmap = None
        if spec.name != 'softmax' and self.mode != 'softmax':   # (the spec's own max_len wins)
            cos = {'max_len': max_len} if spec.name == 'cosformer' and max_len is not None else {}
            self.fmap = A.FEATURE_MAPS[spec.name](head_dim, len(self.rest_q),
                                                  **{**cos, **dict(spec.options)})
        self.inv_freq = rope_inv_freq   # (D/2,) RoPE's, fp32: not a buffer, which .to(dtype) would
                                        # cast
        if spec.decay and self.fmap is not None:   # lambda = exp(-g), g = exp(decay_rate) per head
            self.decay_rate = nn.Parameter(torch.full((len(self.rest_q),),
                                                      math.log(math.log(2) / spec.decay)))
        if spec.delta and self.fmap is not None:   # beta and alpha from each key
            self.gates = A.DeltaGates(head_dim, len(self.rest_q), spec.gate)
        # keys' shifts (the delta rule: gates) not 0
        self.shifted = bool(self.fmap and (self.fmap.log_domain or spec.decay or spec.delta))
        self.fusable = fusable(self)

    window = property(lambda self: self.spec.window)

    def extra_repr(self):
        return f"spec='{self.spec}', causal={self.causal}, kv_groups={self.kv_groups}"

    def forward(self, q, k, v, state=None, return_state=False, key_padding_mask=None, shared=None):
        A.check_qk(q, k, self.head_dim, self.n_heads)
        self.shared = {} if shared is None else shared   # what the layers of a model step share
        if (key_padding_mask if self.causal else state) is not None:
            raise ValueError("key_padding_mask is for bidirectional (encoder) attention, a decode "
                             "state for causal attention")
        if not self.exact_q:
            y, state = self._run(q, k, v, state, return_state, key_padding_mask)
            return (y, state) if return_state else y
        qe = q.index_select(1, self.exact_idx)                   # the exact heads (k, v: H_kv's)
        ke, ve = (x.index_select(1, self.exact_kv) for x in (k, v))
        qr, kr, vr = (x.index_select(1, self.rest_idx) for x in (q, k, v))   # the rest
        ye, se = (softmax_decode(qe, ke, ve, state.exact) if state is not None else
                  softmax_prefill(qe, ke, ve, self.causal, key_padding_mask, return_state))
        yr, sr = self._run(qr, kr, vr, state and state.rest, return_state, key_padding_mask)
        y = torch.cat([A.cast(ye, yr.dtype), yr], 1).index_select(1, self.order_idx)   # head order
        return (y, SplitState(se, sr)) if return_state else y

    def _run(self, q, k, v, state, return_state, key_padding_mask):
        """The family on its heads, in float32 (float64 stays): y in v's dtype, and the new state;
        no tokens: (v, the state as it was, Empty if none)."""
        state = state or None   # (tokens after Empty: from the start)
        if not q.shape[2]:
            return v, state or Empty()
        if state is not None and q.shape[2] == 1 and fused(self, q):   # one token, one launch
            return fused_step(self, q, k, v, state)
        with torch.autocast(q.device.type, enabled=False):
            q, k, v32 = acc(q), acc(k), acc(v)
            y, state = self.parallel(q, k, v32, key_padding_mask,
                                     return_state) if state is None else \
                self.decode(q, k, v32, state)
        return A.cast(y, v.dtype), state

    def decode(self, q, k, v, state):
        """Tokens after a state, one step each (one token: the step itself, with no slicing op: a
        decode step's ops are counted, tests/test_model.py)."""
        if q.shape[2] == 1:
            return self.step(q, k, v, state)
        ys = []
        for t in range(q.shape[2]):
            y, state = self.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state)
            ys.append(y)
        return torch.cat(ys, 2), state

    def weights(self, q, k, key_padding_mask=None):
        """The (B, H, T, T) matrix this core applies, float32: its output for identity values."""
        k = k.float()
        return self(q.float(), k, A.identity_values(k), key_padding_mask=key_padding_mask)

    def _features(self, q, k, offset, key_padding_mask=None, pos=None, back=0):
        """fmap.features of q and k at positions from pos (a device tensor, in steps) or offset, k's
        `back` positions earlier (a window step's leaving key), padding keys removed (phi_k 0, c_k
        NO_KEY), spec decay as shifts: lambda^(t-s) = exp(g s) / exp(g t), key s by +g s, query t by
        -g t (in linear attention alone the query's cancels; a window hybrid weighs its two parts by
        it), in float64, where g t and its differences keep their precision at any position. None x
        4 without a linear part."""
        if self.fmap is None:
            return None, None, None, None
        start = offset if pos is None else pos   # the first token's position
        rows = self.shared.setdefault((offset, back, q.shape[2]), [])   # nope's (offset == pos)
        q_in, k_in = map_inputs(self, q, k, start, back, rows)
        phi_q, phi_k, c_q, c_k = self.fmap.features(q_in, k_in, offset)
        if back and isinstance(self.fmap, A.CosformerFeatureMap):   # its features hold the position
            _, phi_k, _, c_k = self.fmap.features(k_in, k_in, offset - back)
        if key_padding_mask is not None:
            phi_k = phi_k * key_padding_mask[:, None, :, None]
            c_k = c_k.masked_fill(~key_padding_mask[:, None], NO_KEY)
        if self.spec.decay:
            g, t = decay_g(self)[:, None], _positions(q, start)   # (H, 1), (T,)
            c_q, c_k = c_q - g * t, c_k + g * (t - back)
        if self.spec.delta:   # unit-norm features (section 4b), and the keys' gates for c_k
            return nnf.normalize(phi_q, dim=-1), nnf.normalize(phi_k, dim=-1), c_q, self.gates(k_in)
        return phi_q, phi_k, c_q, c_k

    @torch.no_grad()
    def calibrate(self, q, k, key_padding_mask=None):
        """Initialisation from teacher queries/keys (B, H, T, D) of B sequences (key_padding_mask
        (B, T): True at real tokens), on the heads with a map (exact heads need nothing): LLN's
        statistics of the real tokens, as its maps see them (the Window family adds mix's share)."""
        if hasattr(self.fmap, 'calibrate'):
            q, k = map_inputs(self, q[:, self.rest_q], k[:, self.rest_q])   # (B, H, T, D) each
            real = _real(q, key_padding_mask)
            self.fmap.calibrate(*(x.transpose(1, 2)[real].transpose(0, 1)[None] for x in (q, k)))

def decay_g(core):
    """The decay's g (H,) float64 of a core with spec decay, lambda = exp(-g): exp(decay_rate) in
    float32 (whatever the parameter's dtype), then float64, on every path (the fused step's too): a
    prompt's keys and the decoded ones shift by one g (two g were off by |g32 - g64| t: 2.7e-4 at
    262K tokens)."""
    return torch.exp(core.decay_rate.float()).double()

def map_inputs(core, q, k, start=0, back=0, rows=None):
    """q, k (B, H, T, D) as core's linear-part maps see them: with spec nope, rotated back to
    position 0 from positions start..start+T-1 (k's: `back` positions earlier); as given otherwise.
    rows: a list that keeps the angles' cos and -sin once made (Attention._features passes a model
    step's, so that its layers make them once, as they share the model's own RoPE rows)."""
    if not core.spec.nope:
        return q, k
    rows = [] if rows is None else rows
    if not rows:
        if core.inv_freq.device != q.device:   # once per device, before any graph capture
            core.inv_freq = core.inv_freq.to(q.device)
        t = _positions(q, start)
        angle = torch.stack([t, t - back])[..., None] * core.inv_freq   # (2, T, D/2)
        angle = angle.repeat(1, 1, 2)[:, None, None]                     # (2, 1, 1, T, D)
        rows += angle.cos(), -angle.sin()
    return A.apply_rope(torch.stack([q, k]), *rows).unbind(0)

def _positions(q, start):
    """The positions of q's tokens, (T,) long on q's device: from start (an int, or a (1,)
    tensor)."""
    return torch.arange(q.shape[2], device=q.device) + start

def _real(q, key_padding_mask):
    """(B, T) bool, True at the real tokens of q (B, H, T, D)."""
    if key_padding_mask is None:
        return q.new_ones(q.shape[0], q.shape[2], dtype=torch.bool)
    return key_padding_mask.bool()

# ---- 4. the families ------------------------------------------------------------
@dataclass(frozen=True)
class KVCache:
    """Softmax's decode state: the keys and values of the H_kv heads in buffers of some capacity,
    the first n filled. Eager: an append writes past n, where no older state reads (copying first
    where another state wrote past n), the capacity doubles when full, and a step reads the first n.
    static (CUDA graphs): a fixed capacity, and a step reads it all with a mask of the filled
    slots."""
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
        cap = max(capacity, self.k.shape[2])
        n = self.n

        def grown(x):   # the first n tokens, then zeros up to cap
            return nnf.pad(x[:, :, :n], (0, 0, 0, cap - n))
        return KVCache(grown(self.k), grown(self.v), self.pos.clone(), n, [n], static)

    def append(self, k, v):
        """The cache with T more tokens k, v (B, H_kv, T, D)."""
        n = self.n
        T = k.shape[2]
        capacity = self.k.shape[2]
        cache = self
        if n + T > capacity:                  # full: larger buffers, the first n copied
            if self.static:
                raise UsageError(f"the static KV cache of {capacity} tokens is full: a CUDA graph "
                                 f"decodes at most that many")
            cache = self.reserve(max(2 * capacity, n + T))
        elif not self.static and self.fill[0] != n:   # another state wrote past n: copy first
            cache = KVCache(self.k.clone(), self.v.clone(), self.pos, n, [n])
        if T == 1:   # at pos, on the device
            cache.k.index_copy_(2, cache.pos, k)
            cache.v.index_copy_(2, cache.pos, v)
        else:
            cache.k[:, :, n:n + T] = k
            cache.v[:, :, n:n + T] = v
        if not self.static:
            cache.fill[0] = n + T
        return KVCache(cache.k, cache.v, cache.pos + T, n + T, cache.fill, self.static)

    def keys(self):
        """(k, v, mask): what a query after the last token reads; mask None, or (capacity,) bool."""
        if not self.static:
            return self.k[:, :, :self.n], self.v[:, :, :self.n], None
        slots = torch.arange(self.k.shape[2], device=self.k.device)
        return self.k, self.v, (slots < self.pos)[None]   # (1, capacity)

def softmax_prefill(q, k, v, causal=True, key_padding_mask=None, return_state=False):
    """Exact softmax (SDPA) over the tokens, k and v of the H_kv heads (B, H_kv, T, D); a KV
    cache."""
    mask = None if key_padding_mask is None else key_padding_mask[:, None, None, :]
    y = A.softmax_attention(q, k, v, causal, attn_mask=mask)
    return y, KVCache.start(k, v) if return_state and causal else None

def softmax_decode(q, k, v, cache):
    """Tokens after a KV cache, k and v of the H_kv heads: appended, then every query reads the
    cache (causal within the new tokens)."""
    st = cache.append(k, v)
    keys, values, mask = st.keys()
    if q.shape[2] > 1:
        mask = A.causal_mask(q.shape[2], st.n, q.device)
    return A.softmax_attention(q, keys, values, causal=False, attn_mask=mask), st

class Softmax(Attention):
    """Exact softmax attention (Vaswani et al. 2017) in the inputs' dtype, its state a KVCache."""
    mode = 'softmax'

    def _run(self, q, k, v, state, return_state, key_padding_mask):
        k, v = (x[:, ::self.kv_groups] for x in (k, v))   # (B, H_kv, T, D): the model's heads
        if state is None:
            return softmax_prefill(q, k, v, self.causal, key_padding_mask, return_state)
        return softmax_decode(q, k, v, state)

class Linear(Attention):
    """Linear attention (Katharopoulos et al. 2020) with the spec's map, its state (S, z, m) a
    LinearState: one path (spec impl) from the start and after a state; a step is one outer product
    into the state and one read."""
    mode = 'linear'
    fuses = True

    def parallel(self, q, k, v, key_padding_mask, return_state):
        return self._from(q, k, v, None, key_padding_mask)

    def decode(self, q, k, v, st):
        return self.step(q, k, v, st) if q.shape[2] == 1 else self._from(q, k, v, st)

    def _from(self, q, k, v, st, key_padding_mask=None):
        """Tokens after state st (None: from the start), all at once."""
        n = 0 if st is None else st.n
        pos = None if st is None else st.pos
        T = q.shape[2]
        phi_q, phi_k, _, c_k = self._features(q, k, n, key_padding_mask, pos)
        pos = _position(q, n + T) if pos is None else pos + T
        if self.spec.delta:   # c_k: the keys' gates
            y, S = A.delta_rule(phi_q, phi_k, v, c_k, self.spec.impl, self.chunk_size, st and st.S)
            return y, DeltaState(S, n + T, pos)
        init = None if st is None else (st.S, st.z, st.m)
        y, (S, z, m) = linear_attention(phi_q, phi_k, v, self.causal, self.spec.impl, 0.0,
                                        self.chunk_size, init, True, c_k)
        return y, LinearState(S, z, m, n + T, pos) if self.causal else None

    def step(self, q, k, v, st):
        phi_q, phi_k, _, c_k = self._features(q, k, st.n, pos=st.pos)
        linear = st.add(phi_k, v, c_k if self.shifted else None)
        return divide(*linear.read(phi_q)), linear

def fusable(core):
    """Whether core's step can run fused: the Linear and Window families with Hedgehog's map or
    LoLCATs' (its skip the whole width), softmax or exp features, tiles kernels.decode_warps serves.
    A window spec with impl=triton that cannot: a UsageError naming the reason that applies."""
    fm = core.fmap
    spec = core.spec
    D = core.head_dim
    L = spec.sinks + core.window
    why = "LoLA's cache (cache=) has none" if spec.cache else \
        'the delta rule has none' if spec.delta else \
        'a window without a map (softmax) has none' if fm is None or not core.fuses else \
        'it takes a hedgehog or lolcats map with softmax or exp features' if not (
            isinstance(fm, A.HedgehogFeatureMap) and fm.activation in ('softmax', 'exp') and
            (fm.weight.shape[1] == D or type(fm) is A.HedgehogFeatureMap)) else \
        'it takes a window of 2 or more' if core.window == 1 else \
        f'its tiles ({fm.feature_dim} features, {L} slots of sinks and window, each x head size ' \
        f'{D}) exceed the 8,192 values it holds' if not kernels.decode_warps(fm.feature_dim, D, L) \
        else ''
    if spec.impl == 'triton' and core.mode == 'window' and why:
        raise UsageError(f"attention spec '{spec}': impl=triton runs the window's decode step "
                         f"fused, and {why}: use impl=chunked")
    return not why

def fused(core, x):
    """Whether core's one-token step on x runs fused_step: under torch.no_grad() (the kernel has no
    backward), for a fusable map, with spec impl=triton (wherever triton runs, the interpreter
    included) or impl=chunked on CUDA; the other maps and families keep their PyTorch step."""
    if torch.is_grad_enabled() or not core.fusable or core.spec.impl not in ('chunked', 'triton'):
        return False
    if core.spec.impl == 'triton' and not kernels.triton_available(x):
        raise UsageError(
            f"attention spec '{core.spec}': impl=triton needs triton and CUDA tensors (or "
            f"TRITON_INTERPRET=1), got {x.device.type}: use impl=chunked")
    return core.spec.impl == 'triton' or (x.is_cuda and kernels.triton_available(x))

def fused_step(core, q, k, v, st):
    """Linear's or Window's step (st a LinearState or a WindowState) in one launch,
    kernels.decode_step: the same output and state."""
    window = isinstance(st, WindowState)
    fm = core.fmap
    lin = st.linear if window else st
    slots = st.slots if window else None
    if core.spec.nope and core.inv_freq.device != q.device:
        core.inv_freq = core.inv_freq.to(q.device)
    y, (S, z, m), ring = kernels.decode_step(
        q, k, v, st.pos, fm.weight, fm.bias, (lin.S, lin.z, lin.m), slots and (slots.k,
                                                                               slots.v, slots.pos),
        core.kv_groups, core.window, core.spec.sinks,
        skip=type(fm) is A.LolcatsFeatureMap, log=fm.log_domain,
        mix=core.spec.combine == 'mix', theta=getattr(core, 'window_factor', None),
        decay_g=decay_g(core) if core.spec.decay else None,
        inv_freq=core.inv_freq if core.spec.nope else None,
        in_place=bool(slots and slots.static))
    if not window:
        return y, LinearState(S, z, m, st.n + 1, st.pos + 1)
    return y, WindowState(Slots(*ring, slots.static), LinearState(S, z, m, lin.n + 1),
                          st.pos + 1, st.n + 1, st.sinks)

@dataclass(frozen=True)
class WindowState:
    """The sliding-window hybrid's decode state after n tokens: `sinks` slots for the first tokens,
    then a ring of `window` slots, token p >= sinks at sinks + p % window; the linear part (None:
    sliding-window softmax alone) holds tokens sinks .. n - window, outside the next query's window:
    the sinks, tokens n - window + 1 .. n - 1 and itself."""
    slots: Slots
    linear: LinearState | None
    pos: torch.Tensor   # (1,) long on the device: tokens seen (n)
    n: int
    sinks: int

class Window(Attention):
    """Sliding-window softmax + linear attention (LoLCATs-w; without a map, sliding-window softmax
    alone): window_linear_attention all at once; a step writes the token into the ring and folds
    the one leaving the window into the linear part."""
    mode = 'window'
    fuses = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.fmap is not None:   # gamma = sigmoid(theta) = 0.1 (LoLCATs' code: -2.197); mix: 1/2
                                    # till calibrate()
            theta = math.log(0.1 / 0.9) if self.spec.combine == 'joint' else 0.0
            self.window_factor = nn.Parameter(torch.full((len(self.rest_q),), theta))

    def factor(self):
        """The window factor through its sigmoid, per head: gamma (joint) or s (mix), on the window
        part."""
        return torch.sigmoid(self.window_factor) if self.fmap is not None else None

    def parallel(self, q, k, v, key_padding_mask, return_state):
        phi_q, phi_k, c_q, c_k = self._features(q, k, 0, key_padding_mask)
        y, share = window_linear_attention(q, k, v, phi_q, phi_k,
                                           c_q, c_k, self.spec, self.factor(), self.causal,
                                           key_padding_mask, self.chunk_size)
        self.share = share.detach()
        return y, self._state(k, v, phi_k, c_k) if return_state and self.causal else None

    def _state(self, k, v, phi_k, c_k):
        """The decode state after tokens k, v (B, H, T, D) with their features (or None)."""
        B, H, T, D = k.shape
        g = self.kv_groups
        W = self.window
        N = self.spec.sinks
        # (B, H_kv, T, D)
        k1 = k[:, ::g]
        v1 = v[:, ::g]
        first = min(max(T - W + 1, N), T)                                   # the ring's first token
        kept = torch.cat([torch.arange(min(N, T), device=k.device),
                          torch.arange(first, T, device=k.device)])
        slot = kept.where(kept < N, N + kept % W)                           # the sinks, the ring
        slots = Slots.empty(k1, v1, N + W).write(slot, kept, k1[:, :, kept], v1[:, :, kept])
        linear = None
        if phi_k is not None:   # tokens sinks .. T - W are outside the next query's window: folded
            F = phi_k.shape[-1]
            empty = DeltaState(k.new_zeros(B, H, F, D), 0) if self.spec.delta else \
                LinearState.empty(B, H, F, D, k)
            left = slice(N, max(first, N))
            linear = empty.fold(phi_k[:, :, left], c_k[:, :, left], v[:, :, left], T)
        return WindowState(slots, linear, _position(k, T), T, N)

    def step(self, q, k, v, st):
        """One token after st: window_linear_attention for its query (B, H, 1, D) at position pos,
        as the fused kernel computes it (kernels._decode_kernel: this is its reference), each term
        one or two batched ops over every head:
            y = y_l + p (y_w - y_l),  y_w = sum_j a_j v_j,  a_j = softmax_j(q.k_j / sqrt(D)) over
            the slots,  y_l = phi(q) S / phi(q).z,  p = sigmoid(log(gamma den_w / den) - c) (joint)
            or s (mix); joint without shifts (c = 0) is LoLCATs' Eq. 8 as written, each side
            divided by den_w = 1 / max_j a_j:  y = (gamma y_w + r phi(q) S) / (gamma + r phi(q).z),
            r = max_j a_j
        Line by line:
          at          what depends on the position alone, made by a model step's first window
                      layer, shared by the others (self.shared): slot, this token's (a sink's own
                      while pos < sinks, else sinks + pos % W); leaving, the slot of the token at
                      pos - back (back = W - 1), which leaves the window for the next query; filled,
                      the slots holding a token once this one is written (bias: 0 there, -inf at
                      the empty ones); pos + 1
          slots       k, v written first, then read (the leaving pair too: with W = 1, this one):
                      a step reads no slot's old contents that it overwrites, so on a static
                      state (written in place) it runs again the same, as a CUDA graph's warm-up
                      does; new tensors otherwise (st stays as it was)
          a, y_w      the softmax part over the filled slots; its mass den_w = sum_j exp(s_j - m)
                      is 1 / max_j a_j (m the largest score, whose weight is exp(0) / den_w)
          k_out       the leaving pair, in the window still for this query, folded after it (the
                      last lines), its key's features made again (phi_k, c_k)
          num, den    the linear part, phi(q) S and phi(q).z over the tokens st holds (sinks ..
                      pos - W)
          f, r, y     joint without shifts: Eq. 8 as written (gamma = f; den = 0: y = y_w)
          c, p, y     otherwise, the softmax part's share: joint, gamma den_w against exp(c) den
                      (c the linear sums' scale), in log space; mix, s = f; 1 where den = 0; y_l:
                      num / den, 0 where den = 0
          linear      the leaving pair folded into S and z (with real, the leaving slot's filled,
                      False before the sinks' end: 0)."""
        W = self.window
        N = st.sinks
        g = self.kv_groups
        back = W - 1                       # the leaving token: back positions before this one
        at = (W, N, st.n, st.pos.device)   # (the window layers' only key in self.shared)
        if at not in self.shared:
            slot = st.pos if st.n < N else st.pos % W + N
            pos = st.pos + 1
            leaving = pos % W + N          # (pos - back) % W
            filled = st.slots.pos.index_copy(0, slot, st.pos) >= 0
            self.shared[at] = slot, leaving, pos, torch.where(filled, 0.0, -math.inf), filled
        slot, leaving, pos, bias, filled = self.shared[at]
        slots = st.slots.write(slot, st.pos, k[:, ::g], v[:, ::g])
        kq, vq = (x.repeat_interleave(g, 1) for x in (slots.k, slots.v))   # (B, H, L, D)
        s = torch.einsum('bhtd,bhld->bhtl', q, kq)
        a = torch.add(bias, s, alpha=q.shape[-1] ** -0.5).softmax(-1)      # (B, H, 1, L)
        y_w = a @ vq                                                       # (B, H, 1, D)
        if st.linear is None:   # sliding-window softmax alone
            return y_w, WindowState(slots, None, pos, st.n + 1, N)
        k_out, v_out = (x.index_select(2, leaving) for x in (kq, vq))
        phi_q, phi_k, c_q, c_k = self._features(q, k_out, st.n, pos=st.pos, back=back)
        num, den = st.linear.read(phi_q)                                   # (B, H, 1, D), (B, H, 1)
        den = den[..., None]
        f = self.factor().view(-1, 1, 1)                                   # (H, 1, 1)
        joint = self.spec.combine == 'joint'
        if joint and not self.shifted:   # Eq. 8, each side times max_j a_j = 1 / den_w (den 0: y_w)
            r = a.amax(-1, keepdim=True)
            y = torch.addcmul(r * num, f, y_w) / torch.addcmul(f, r, den)
        else:   # y_l + p (y_w - y_l): joint's p in log space, where exp(c) may overflow; den 0: p 1
            if joint:
                c = (c_q + st.linear.m[..., None]).to(den.dtype)[..., None]   # (B, H, 1, 1)
                p = torch.sigmoid(torch.log(f / (a.amax(-1, keepdim=True) * den)) - c)
            else:
                p = f.where(den > 0, 1.0)
            y = torch.lerp((num / den).nan_to_num(), y_w, p)
        if st.n - back < N:   # the leaving token may come before the sinks' end: its slot empty
            # (the linear part holds no token yet then: a delta rule's gates masked so, alpha 0 and
            # a key of 0, leave its S at 0, as the parallel form's sinks do)
            real = filled[leaving]
            phi_k = phi_k * real
            c_k = c_k.masked_fill(~real, NO_KEY)
        linear = st.linear.add(phi_k, v_out, c_k if self.shifted else None)
        return y, WindowState(slots, linear, pos, st.n + 1, N)

    @torch.no_grad()
    def calibrate(self, q, k, key_padding_mask=None):
        """As Attention's, and for mix: s = the teacher's mean softmax mass in the softmax part
        (window and sinks) over the rows that also see other keys, exact for an average row
        (clamped to [1e-4, 1 - 1e-4]), one sequence at a time (H x T x T floats)."""
        super().calibrate(q, k, key_padding_mask)
        if self.fmap is None or self.spec.combine != 'mix':
            return
        q = q[:, self.rest_q]
        k = k[:, self.rest_q]
        T = q.shape[2]
        real = _real(q, key_padding_mask)
        j = torch.arange(T, device=q.device)
        seen = A.causal_mask(T, T, q.device) | (not self.causal)
        # (T, T)
        soft = (_in_window(j[:, None], j, self.window, self.causal) | (j < self.spec.sinks)) & seen
        total = 0.0
        n = 0
        for b in range(q.shape[0]):
            visible = seen & real[b]                     # the real keys of each row
            rows = real[b] & (visible & ~soft).any(-1)   # real rows that also see keys of the
                                                         # linear part
            w = A.softmax_weights(q[b:b + 1], k[b:b + 1], attn_mask=visible)[0]   # (H, T, T)
            total += (w * soft).sum(-1)[:, rows].double().sum(-1)                # (H,)
            n += int(rows.sum())
        if n:
            self.window_factor.copy_(torch.logit((total / n).clamp(1e-4, 1 - 1e-4)))

@dataclass(frozen=True)
class DiagState:
    """LLN+Diag's decode state: every token in the linear state, the current block's pairs in
    diag_block slots (token p at p % diag_block)."""
    linear: LinearState
    slots: Slots

class Diag(Linear):
    """LLN+Diag (Nahshan et al. 2023, Sec. 4.2): the average of linear attention over every token
    and softmax within blocks of diag_block tokens; a step is Linear's beside softmax over its block
    so far."""
    mode = 'diag'
    fuses = False
    decode = Attention.decode   # tokens after a state: one step each

    def parallel(self, q, k, v, key_padding_mask, return_state):
        T = q.shape[2]
        b = self.spec.diag_block
        g = self.kv_groups
        y, linear = super().parallel(q, k, v, key_padding_mask, return_state)
        y = 0.5 * (y + block_diagonal_softmax(q, k, v, b, self.causal, key_padding_mask))
        if not (return_state and self.causal):
            return y, None
        p = torch.arange(T // b * b, T, device=q.device)   # the tokens of the last, partial block
        slots = Slots.empty(k[:, ::g], v[:, ::g], b).write(p % b, p, k[:, ::g, p], v[:, ::g, p])
        return y, DiagState(linear, slots)

    def step(self, q, k, v, st):
        y_linear, linear = super().step(q, k, v, st.linear)                # (B, H, 1, D)
        b = self.spec.diag_block
        g = self.kv_groups
        pos = st.linear.pos
        slots = st.slots.write(pos % b, pos, k[:, ::g], v[:, ::g])
        in_block = (slots.pos >= pos - pos % b)[None]                      # (1, b) this block's
        y_block = A.softmax_attention(q, slots.k, slots.v, causal=False, attn_mask=in_block)
        return 0.5 * (y_linear + y_block), DiagState(linear, slots)

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
        """fn(x, y) on each field x of self (None stays) and y of other (None: y is x)."""
        return Pairs(*(None if x is None else fn(x, y) for x, y in
                       zip(vars(self).values(), vars(self if other is None else other).values())))

    def cat(self, other):
        return self._map(lambda x, y: torch.cat([x, y], 2), other)

    def cut(self, a, b=None):   # pairs a..b - 1
        return self._map(lambda x, _: x[:, :, a:b])

    def take(self, idx, g):
        """The pairs idx (B, H_kv, n) of each KV head (its query heads: the same pairs)."""
        def gather(x):   # along time; idx per KV head, or repeated to the query heads
            i = idx if x.shape[1] == idx.shape[1] else idx.repeat_interleave(g, 1)
            return torch.take_along_dim(x, i.view(*i.shape, *[1] * (x.dim() - 3)), 2)
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

def lola_select(state, cand, n_keep, kv_groups):
    """LoLA's sparse-cache update (McDermott et al. 2025, Sec. 3): candidate Pairs (the cache and
    the pending block) scored by their self-recall error against the linear state, SRE(k, v) = ||S^T
    phi(k) / z^T phi(k) - v||^2 (phi(k): the key's features; 0 recalled where z^T phi(k) = 0), per
    KV head the mean over its query heads. The n_keep worst recalled stay in the cache; the rest are
    folded into the state. (The paper's SRE; its public code scores differently.) -> (kept: sorted
    indices (B, H_kv, n_keep), the new LinearState)."""
    rep = lambda x: x.repeat_interleave(kv_groups, 1)  # noqa: E731, GQA: query head h reads kv head
                                                       # h // g
    sre = (divide(*state.read(cand.phi)) - rep(cand.v)).square().sum(-1)          # (B, H, L)
    sre = sre.unflatten(1, (-1, kv_groups)).mean(2)                               # (B, H_kv, L)
    keep = sre.topk(min(n_keep, sre.shape[-1]), -1).indices.sort(-1).values      # (B, H_kv, n_keep)
    fold = rep(torch.ones_like(sre, dtype=torch.bool).scatter(-1, keep, False))  # (B, H, L)
    return keep, state.fold(cand.phi * fold[..., None], cand.c.masked_fill(~fold, NO_KEY),
                            rep(cand.v), len(cand) - keep.shape[-1])

class Lola(Window):
    """The window hybrid with LoLA's sparse cache (McDermott et al. 2025, spec cache=): pairs leave
    the window into a pending block; every cache_block of them, the block and the cache compete
    (lola_select). Prefill and decoding run one schedule, in segments within which the linear part
    is fixed: each ends where a block leaves the softmax part."""
    mode = 'window'
    fuses = False

    def parallel(self, q, k, v, key_padding_mask, return_state):
        B, H = q.shape[:2]
        g = self.kv_groups
        F = self.fmap.feature_dim
        none = Pairs(k[:, ::g, :0], v[:, ::g, :0])   # no pairs: 0 tokens of the KV heads
        with_phi = replace(none, phi=q.new_zeros(B, H, 0, F), c=q.new_zeros(B, H, 0))
        return self.decode(q, k, v, LolaState(0, none, with_phi, with_phi,
                                              LinearState.empty(B, H, F, v.shape[-1], q)))

    def decode(self, q, k, v, state):
        C = self.spec.cache_block
        T = q.shape[2]
        ys = []
        shares = []
        t = 0
        while t < T:
            n = min(T - t, self.window - 1 + C - len(state.buffer))   # tokens up to the next update
            qs, ks, vs = (x[:, :, t:t + n] for x in (q, k, v))
            y, share, phi_k, c_k = self._segment(qs, ks, vs, state)
            state = self._update(self._push(state, ks, vs, phi_k, c_k))
            ys.append(y)
            shares.append(share)
            t = t + n
        self.share = torch.cat(shares, 2).detach()
        return torch.cat(ys, 2), state

    def _segment(self, q, k, v, st):
        """Outputs of tokens q, k, v (B, H, n, D) right after state st, the linear part fixed:
        (y, share, phi_k, c_k). Softmax part: the sinks, the cache (always seen) and the buffer and
        new tokens up to the query."""
        n = q.shape[2]
        o = st.offset
        g = self.kv_groups
        soft = st.sinks.cat(st.cache).cat(st.buffer).cat(Pairs(k[:, ::g], v[:, ::g]))
        pos = torch.cat([torch.arange(len(st.sinks)), torch.full((len(st.cache),), -1),
                         torch.arange(o - len(st.buffer), o + n)]).to(q.device)   # keys' positions
        keys = soft.k.repeat_interleave(g, 1)
        vals = soft.v.repeat_interleave(g, 1)
        visible = pos <= torch.arange(o, o + n, device=q.device)[:, None]
        num_w, den_w, _ = _window_softmax(q, keys, vals, visible)
        phi_q, phi_k, c_q, c_k = self._features(q, k, o)
        num_l, den_l = st.linear.read(phi_q)
        y, share = combine_window_linear(num_w, den_w, num_l, den_l, c_q + st.linear.m[..., None],
                                         self.factor(), self.spec.combine)
        return y, share, phi_k, c_k

    def _push(self, st, k, v, phi_k, c_k):
        """The state with tokens k, v (B, H, n, D) appended: the first go to the sinks while there
        are fewer than spec.sinks, the others to the buffer."""
        s = min(max(self.spec.sinks - st.offset, 0), k.shape[2])
        g = self.kv_groups
        new = Pairs(k[:, ::g], v[:, ::g], phi_k, c_k)
        return replace(st, offset=st.offset + k.shape[2],   # (the sinks keep no phi, c)
                       sinks=st.sinks.cat(new.cut(0, s)), buffer=st.buffer.cat(new.cut(s)))

    def _update(self, st):
        """Once the buffer holds window - 1 + C tokens, its first C leave the softmax part: they and
        the cache compete (lola_select), the losers are folded."""
        C = self.spec.cache_block
        if len(st.buffer) < self.window - 1 + C:
            return st
        cand = st.cache.cat(st.buffer.cut(0, C))
        g = self.kv_groups
        keep, linear = lola_select(st.linear, cand, self.spec.cache, g)
        return replace(st, buffer=st.buffer.cut(C), cache=cand.take(keep, g), linear=linear)
