"""
Causal linear attention in Triton: the naive reference, four kernels in five launches (one
sequential pass, forward or backward), the autograd wrapper; the fused decode step (one token of a
layer in one launch, decode_step; its reference: hybrids' Linear.step and Window.step); a CUDA
benchmark (where the time goes on an H100: docs/RESULTS.md 16.6).

What it computes. Given feature-mapped queries and keys phi_q, phi_k (B, H, T, F) and values v (B,
H, T, D):

    y_t = phi_q_t^T S_t / (phi_q_t^T z_t + eps),   S_t = S_0 + sum_{s<=t} phi_k_s v_s^T   (F, D)
                                                   z_t = z_0 + sum_{s<=t} phi_k_s         (F,)

(0 where the denominator is 0) from an optional initial state (S_0, z_0), optionally returning the
final state (prefill, then decode). Key shifts c (B, H, T), optional: the keys are phi_k_s exp(c_s),
and row t is computed in units of exp(-m_t), m_t = max(m_0, c_1..c_t) (a running max, as online
softmax), so every factor exp(c_s - m_t) is <= 1 whatever the keys' scale; the state (S, z, m) is
then in units of exp(-m). `causal_linear_attention_reference` computes it from the definition,
quadratic in T.

Design: flash-linear-attention's two-pass chunk form. Time is cut into chunks of BLOCK_T = 64 rows,
NT = T / 64 of them; M_j is the running max at chunk j's last row (M_-1 = m_0), known beforehand (a
cummax in PyTorch, where each chunk's shifts and maxes are rebased to its own M_j: float64 shifts as
large as a decay's keep their precision; in those units M_j = 0, so the kernels read only
M_j-1 - M_j). A sequential pass writes the state every chunk starts from; the attention inside the
chunks and the outputs then run in parallel over (chunk, batch x head, block). Per chunk j (rows
t, keys s of the chunk; S_j, z_j: the state before it, in units exp(-M_j-1); r_t = exp(M_j-1 -
m_t)):

    A    = q k^T exp(c_s - m_t), masked to s <= t     (BLOCK_T, BLOCK_T)  fp32 accumulation
    num  = A v + q S_j r                              (BLOCK_T, BLOCK_D)  intra- + inter-chunk
    den  = rowsum(A) + q . z_j r + eps                (BLOCK_T,)          fp32, the same kernel
    y    = num / den
    S_j+1 = S_j exp(M_j-1 - M_j) + k^T (v exp(c_s - M_j)),   z_j+1 likewise with colsum(k)

The denominator comes from the same A and z, not from a separate pass (where published kernels had
silent gradient bugs). The launches (B*H = BH; in brackets the grids at B=1, H=12, T=32K, F=128,
D=64, bf16):

    fwd state   _state_kernel      (BH, F/BF, D/BD) (12, 4, 2): walks the chunks forward, stores
                                   S_j, z_j; holds its (BF, BD) = (32, 32) block of S in fp32
    fwd out     _fwd_kernel        (NT, BH, D/BD) (512, 12, 1): y and 1/den of one chunk; holds
                                   A, q S_j (BT, BD), accumulated over feature blocks of 64
    (backward)  _state_kernel      'fwd state' again: the states are recomputed, not saved
    bwd dstate  _state_kernel      (BH, F/BF, D/BD) (12, 4, 2): walks the chunks backward, stores
                                   dS, dz after each chunk; holds its (32, 32) block of dS in fp32
    bwd dqk     _bwd_dqk_kernel    (NT, BH, F/BF) (512, 12, 2): dq, dk of one chunk and feature
                                   block of 64; holds G (BT, BT), dq (BT, BF), dk^T (BF, BT),
                                   accumulated over value blocks of 64
    bwd dv      _bwd_dv_kernel     (NT, BH, D/BD) (512, 12, 1): dv of one chunk; holds P^T (BT, BT),
                                   k dS (BT, BD), accumulated over feature blocks of 64

Memory. The stored states are (BH, NT, F, D) in the operands' dtype if bf16 (the dots read them in
bf16 anyway: the same rounding), else fp32, and z (BH, NT, F) fp32; with bf16 operands 2 F D / 64 +
4 F / 64 bytes per token and head: 264 B at F=128, D=64 (q and k in bf16: 512 B), 104 MB at B=1,
H=12, T=32K; 1,040 B at F=256, D=128. The forward frees them; the backward holds two sets (states
and their gradients). Blocks and warps: BLOCKS.

Backward. With P_ts = q_t . k_s (s <= t), rden_t = 1 / (den_t + eps) (saved) and delta_t = dy_t .
y_t:
    g_t = dL/dnum_t = dy_t rden_t,   r_t = dL/dden_t = -delta_t rden_t
    G_ts = dL/dP_ts = g_t . v_s + r_t
    dq_t = sum_{s<=t} G_ts k_s + S_0 g_t + r_t z_0        dS_0 = dS_T + sum_t q_t g_t^T
    dk_s = sum_{t>=s} G_ts q_t + dS_T v_s + dz_T          dz_0 = dz_T + sum_t r_t q_t
    dv_s = sum_{t>=s} P_ts g_t + dS_T^T k_s,              dc_s = dk_s . phi_k_s
(dc: the key scales with exp(c_s).)
(dS_T, dz_T: the gradients arriving through the returned state; with shifts, P_ts and the state
terms carry the forward's factors.) Chunked, the sums over earlier chunks (dq) are q's state S_j,
z_j; those over later chunks (dk, dv) the state gradient after chunk j (units exp(-M_j)),
    dS_j = dS_j+1 exp(M_j - M_j+1) + sum_{t in j+1} q_t g_t^T exp(M_j - m_t),
dz_j likewise with r_t. Operands needed transposed are loaded transposed by swapping the pointer
arithmetic; a tl.dot result is never transposed (a Triton miscompile on Hopper): the transposed
product is computed directly (k q^T rather than (q k^T)^T), or stored through transposed pointers.

Precision. Accumulation and state are fp32 (the stored states: see above). Operands are bf16 if an
input is bf16 (tensor cores; bf16 has fp32's range), else the promoted dtype: fp32 features with
fp16 values stay fp32, since exp-based features overflow fp16 (65504 = e^11). fp32 multiplies in
'tf32' if torch.backends.cuda.matmul.allow_tf32 (or allow_tf32=True), else 'ieee'; fp16 always in
'tf32' (exact for it). Gradients are written in each input's dtype.

CPU. With TRITON_INTERPRET=1 set before import, the kernels run in Triton's interpreter on CPU
tensors (the tests; bf16 operands are upcast there: the interpreter's bf16 tl.dot is wrong), with
blocks of their own (fewer programs; tests/test_kernels.py also runs the GPU blocks there).
"""

import contextlib
import functools
import os

import torch

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

# @triton.jit builds interpreter kernels only if the variable is set before the decorator runs
# (before import)
INTERPRET = HAS_TRITON and os.environ.get('TRITON_INTERPRET', '0') == '1'
NO_KEY = -1e30      # as attention.NO_KEY: the running max before any key
DEFAULT_CHUNK = 64   # BLOCK_T: the chunk of rows each program of the parallel launches owns
# the sizes tests/test_kernels_compile.py checks
MAX_FEATURE_DIM = 256
MAX_HEAD_DIM = 128

def causal_linear_attention_reference(phi_q, phi_k, v, eps=0.0, initial_state=None,
                                      return_state=False, c_k=None):
    """The definition, quadratic in T: A_ts = phi_q_t . phi_k_s exp(c_s - m_t) (s <= t), y = (A v +
    q S_0 exp(m_0 - m_t)) / (rowsum(A) + q . z_0 exp(m_0 - m_t) + eps); the key shifts c_k (B, H, T)
    (None: 0) and m_t as above. initial_state (S_0, z_0[, m_0]) (B, H, F, D), (B, H, F) [, (B, H)]
    in units exp(-m_0); m_0 = 0 when it has no m_0, and without an initial state S_0 = z_0 = 0 and
    m_0 = NO_KEY (no key yet: m_t is the largest c_s, s <= t). Where the denominator is 0 or less, y
    is the numerator undivided: 0 for a query whose features are all 0. Computes in at least fp32
    (float64 stays float64); y in v.dtype; return_state: also the final state (S, z, m = m_T), S_0,
    z_0 and all T keys summed in units exp(-m), in the compute dtype; (S, z) alone without c_k and
    without an m_0."""
    dt = torch.promote_types(torch.promote_types(phi_q.dtype, v.dtype), torch.float32)
    q = phi_q.to(dt)
    k = phi_k.to(dt)
    v_ = v.to(dt)
    (B, H, T, F), D = q.shape, v.shape[-1]
    c = q.new_zeros(B, H, T) if c_k is None else c_k.to(dt)               # (B, H, T) key shifts
    if initial_state is None:   # zeros, and no key seen yet
        S0 = q.new_zeros(B, H, F, D)
        z0 = q.new_zeros(B, H, F)
        m0 = q.new_full((B, H), NO_KEY)
    else:
        S0 = initial_state[0].to(dt)
        z0 = initial_state[1].to(dt)
        m0 = initial_state[2].to(dt) if len(initial_state) > 2 else q.new_zeros(B, H)
    m = torch.maximum(c.cummax(-1).values, m0[..., None])                 # (B, H, T) running max
    key_factor = torch.exp((c[..., None, :] - m[..., None]).clamp(max=0))  # (B, H, T, T) e^(c_s -
                                                                           # m_t)
    A = (q @ k.transpose(-2, -1) * key_factor).tril()                     # (B, H, T, T)
    r = torch.exp(m0[..., None] - m)                                      # (B, H, T) state -> row t
    num = A @ v_ + q @ S0 * r[..., None]                                   # (B, H, T, D)
    den = A.sum(-1) + (q @ z0[..., None])[..., 0] * r + eps               # (B, H, T)
    y = (num / den.where(den > 0, 1.)[..., None]).to(v.dtype)
    if not return_state:
        return y
    M = m[..., -1]                                                        # (B, H) the final units
    kM = k * torch.exp(c - M[..., None])[..., None]                       # (B, H, T, F)
    decay = torch.exp(m0 - M)                                             # (B, H)
    S = S0 * decay[..., None, None] + kM.transpose(-2, -1) @ v_           # (B, H, F, D)
    z = z0 * decay[..., None] + kM.sum(2)                                 # (B, H, F)
    shifted = c_k is not None or len(initial_state or ()) > 2
    return y, ((S, z, M) if shifted else (S, z))

if HAS_TRITON:
    @triton.jit
    def _dot(a, b, BF16: tl.constexpr, PRECISION: tl.constexpr):
        """a @ b with fp32 accumulation; operands in bf16 (tensor cores) or fp32 ('ieee' or
        'tf32')."""
        if BF16:
            return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
        else:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)

    @triton.jit
    def _tile(ptr, rows, cols, stride_r, stride_c, mask_r, mask_c):
        """The tile ptr[rows, cols] of a matrix with strides (stride_r, stride_c), 0 where masked;
        strides (1, n) load an (n-column, row-major) matrix transposed."""
        return tl.load(ptr + rows[:, None] * stride_r + cols[None, :] * stride_c,
                       mask=mask_r[:, None] & mask_c[None, :], other=0.)

    @triton.jit
    def _put(ptr, rows, cols, stride_r, stride_c, mask_r, mask_c, x):
        """Store x, in ptr's dtype, as the tile ptr[rows, cols] (_tile's layout) where not
        masked."""
        tl.store(ptr + rows[:, None] * stride_r + cols[None, :] * stride_c,
                 x.to(ptr.dtype.element_ty), mask=mask_r[:, None] & mask_c[None, :])

    @triton.jit
    def _store_state(S_OUT, Z_OUT, S, z, offs_f, offs_d, D, mask_f, mask_d, i_d):
        """Store one program's block of a state (S_OUT (F, D) in its own dtype); z from the first
        value block only."""
        _put(S_OUT, offs_f, offs_d, D, 1, mask_f, mask_d, S)
        if i_d == 0:
            tl.store(Z_OUT + offs_f, z, mask=mask_f)

    @triton.jit
    def _state_kernel(
        X, Y,                 # (B*H, T, F), (B*H, T, D): forward k, v; backward q, dy
        C, M, MB,             # (B*H, T) key shifts (forward), the rows' running max, (B*H, NT)
                              # M_{j-1}
        RDEN, DELTA,          # (B*H, T) 1/den, dy.y (backward)
        STATES, ZS,           # out (B*H, NT, F, D), (B*H, NT, F): the state before each chunk
                              # (forward), its gradient after each chunk (backward)
        S_IN, Z_IN,           # (B*H, F, D), (B*H, F) fp32: the initial state (forward), the
                              # gradient reaching the final state (backward), or None
        S_OUT, Z_OUT,         # (B*H, F, D), (B*H, F) fp32 out: the final state (forward), the
                              # initial state's gradient (backward), or None
        T, F, D,
        BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
        BF16: tl.constexpr, PRECISION: tl.constexpr, BACKWARD: tl.constexpr,
    ):
        """A sequential pass, one program per (bh, feature block, value block), its block of the
        state in fp32 registers. Forward, chunks j = 0 .. NT-1: STATES[j] = the state before chunk
        j, in units exp(-M_{j-1}); then
            S <- S e^(M_{j-1} - M_j) + sum_s k_s (v_s e^(c_s - M_j))^T,
        z likewise with k_s alone. Backward, chunks j = NT-1 .. 0: STATES[j] = dS after chunk j, in
        units exp(-M_j); then, with g_t = dy_t / den_t and r_t = -(dy_t . y_t) / den_t (dL/dnum and
        dL/dden of row t):
            dS <- dS e^(M_{j-1} - M_j) + sum_t q_t (g_t e^(M_{j-1} - m_t))^T,
        dz likewise with r_t."""
        i_bh = tl.program_id(0).to(tl.int64)
        i_f = tl.program_id(1)
        i_d = tl.program_id(2)
        offs_t = tl.arange(0, BLOCK_T)
        offs_f = i_f * BLOCK_F + tl.arange(0, BLOCK_F)
        offs_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_f = offs_f < F
        mask_d = offs_d < D
        NT = tl.cdiv(T, BLOCK_T)
        # this head's rows
        X = X + i_bh * T * F
        Y = Y + i_bh * T * D
        M = M + i_bh * T
        STATES = STATES + i_bh * NT * F * D
        ZS = ZS + i_bh * NT * F
        # this program's block of the state, (BF, BD) and (BF,) fp32 (zeros where S_IN is None)
        S = tl.zeros((BLOCK_F, BLOCK_D), dtype=tl.float32)
        z = tl.zeros((BLOCK_F,), dtype=tl.float32)
        if S_IN is not None:
            S = _tile(S_IN + i_bh * F * D, offs_f, offs_d, D, 1, mask_f, mask_d)
            z = tl.load(Z_IN + i_bh * F + offs_f, mask=mask_f, other=0.)

        for i in range(0, NT):
            j = NT - 1 - i if BACKWARD else i
            _store_state(STATES + j * F * D, ZS + j * F, S, z, offs_f, offs_d, D,
                         mask_f, mask_d, i_d)
            rows = j * BLOCK_T + offs_t
            mask_t = rows < T
            m_before = tl.load(MB + i_bh * NT + j)   # M_{j-1} in chunk j's units (M_j = 0)
            xT = _tile(X, offs_f, rows, 1, F, mask_f, mask_t)                    # (BF, BT)
            y = _tile(Y, rows, offs_d, D, 1, mask_t, mask_d).to(tl.float32)     # (BT, BD)
            if BACKWARD:   # (BT,) row t's factor, times g_t's 1/den_t (for dS), and r_t's (dz)
                w = tl.exp(m_before - tl.load(M + rows, mask=mask_t, other=1e30))
                w = w * tl.load(RDEN + i_bh * T + rows, mask=mask_t, other=0.)
                w_z = -w * tl.load(DELTA + i_bh * T + rows, mask=mask_t, other=0.)
            else:   # (BT,) key s's factor, for S and z alike
                w = tl.exp(tl.load(C + i_bh * T + rows, mask=mask_t, other=-1e30))
                w_z = w
            # the state's new units
            decay = tl.exp(m_before)
            S = S * decay + _dot(xT, y * w[:, None], BF16, PRECISION)           # (BF, BD)
            z = z * decay + tl.sum(xT.to(tl.float32) * w_z[None, :], axis=1)    # (BF,)
        if S_OUT is not None:
            _store_state(S_OUT + i_bh * F * D, Z_OUT + i_bh * F, S, z, offs_f, offs_d, D,
                         mask_f, mask_d, i_d)

    @triton.jit
    def _chunk(T, MB, BLOCK_T: tl.constexpr):
        """This program's (batch x head) i_bh = program_id(1) and chunk j = program_id(0): i_bh,
        the chunk's rows, their mask, M_{j-1} (the running max before it, m_0 for j = 0, in chunk
        j's units: M_j = 0) and the index st of its state in STATES (B*H, NT, ...), and of its
        M_{j-1} in MB (B*H, NT)."""
        i_bh = tl.program_id(1).to(tl.int64)
        j = tl.program_id(0)
        rows = j * BLOCK_T + tl.arange(0, BLOCK_T)
        st = i_bh * tl.cdiv(T, BLOCK_T) + j
        return i_bh, rows, rows < T, tl.load(MB + st), st

    @triton.jit
    def _shifts(C, M, i_bh, T, rows, mask_t):
        """The rows' key shifts c and running max m (BT,): past the end no key, and a max no key
        reaches (loaded where used, after the chunk's loop: fewer registers held across it)."""
        return (tl.load(C + i_bh * T + rows, mask=mask_t, other=-1e30),
                tl.load(M + i_bh * T + rows, mask=mask_t, other=1e30))

    @triton.jit
    def _fwd_kernel(
        Q, K, V, Y, RDEN,     # (B*H, T, F), (B*H, T, F), (B*H, T, D), out (B*H, T, D), out (B*H, T)
        STATES, ZS,           # (B*H, NT, F, D), (B*H, NT, F): the state before each chunk
        C, M, MB,             # (B*H, T) key shifts, the rows' running max, (B*H, NT) M_{j-1}
        T, F, D, eps,
        BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
        BF16: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """y of one chunk and value block: A = q k^T e^(c_s - m_t) (s <= t), y = (A v + q S r) /
        (rowsum(A) + q.z r + eps), r_t = e^(M_{j-1} - m_t); program = (chunk, bh, value block), A
        and q S accumulated over feature blocks."""
        i_bh, rows, mask_t, m_before, st = _chunk(T, MB, BLOCK_T)
        i_d = tl.program_id(2)
        offs_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        Q = Q + i_bh * T * F
        K = K + i_bh * T * F
        V = V + i_bh * T * D
        S_j = STATES + st * F * D
        z_j = ZS + st * F

        A = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)
        qS = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        qz = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for f0 in range(0, F, BLOCK_F):
            offs_f = f0 + tl.arange(0, BLOCK_F)
            mask_f = offs_f < F
            q = _tile(Q, rows, offs_f, F, 1, mask_t, mask_f)                           # (BT, BF)
            kT = _tile(K, offs_f, rows, 1, F, mask_f, mask_t)                          # (BF, BT)
            A += _dot(q, kT, BF16, PRECISION)                                          # (BT, BT)
            qS += _dot(q, _tile(S_j, offs_f, offs_d, D, 1, mask_f, mask_d), BF16, PRECISION)
            z = tl.load(z_j + offs_f, mask=mask_f, other=0.)
            qz += tl.sum(q.to(tl.float32) * z[None, :], axis=1)                        # (BT,)

        c, m = _shifts(C, M, i_bh, T, rows, mask_t)                    # (BT,) each
        causal = rows[:, None] >= rows[None, :]
        A = tl.where(causal, A * tl.exp(tl.minimum(c[None, :] - m[:, None], 0.)), 0.)
        r = tl.exp(m_before - m)                                       # (BT,) state -> row units
        v = _tile(V, rows, offs_d, D, 1, mask_t, mask_d)               # (BT, BD)
        num = _dot(A, v, BF16, PRECISION) + qS * r[:, None]
        den = tl.sum(A, axis=1) + qz * r + eps                         # (BT,) fp32
        rden = (den > 0).to(tl.float32) / tl.where(den > 0, den, 1.)   # 0 / 0 -> 0
        _put(Y + i_bh * T * D, rows, offs_d, D, 1, mask_t, mask_d, num * rden[:, None])   # y
        if i_d == 0:
            tl.store(RDEN + i_bh * T + rows, rden, mask=mask_t)

    @triton.jit
    def _bwd_dqk_kernel(
        Q, K, V, DY, RDEN, DELTA,  # (B*H, T, F) twice, (B*H, T, D) twice, (B*H, T) twice
        STATES, ZS,                # the state before each chunk ('fwd state')
        DSTATES, DZS,              # its gradient after each chunk ('bwd dstate')
        C, M, MB,                  # key shifts, the rows' running max, M_{j-1} (as the forward)
        DQ, DK,                    # out (B*H, T, F), in phi_q's and phi_k's dtype
        T, F, D,
        BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
        BF16: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """dq and dk of one chunk and feature block, G_ts = (g_t . v_s + r_t) e^(c_s - m_t)
        (s <= t):
            dq = G k + (g S^T + r z) e^(M_{j-1} - m_t),
            dk^T = q^T G + (dS v^T + dz) e^(c_s - M_j);
        program = (chunk, bh, feature block), G and the state terms accumulated over value
        blocks."""
        i_bh, rows, mask_t, m_before, st = _chunk(T, MB, BLOCK_T)
        i_f = tl.program_id(2)
        offs_f = i_f * BLOCK_F + tl.arange(0, BLOCK_F)
        mask_f = offs_f < F
        V = V + i_bh * T * D
        DY = DY + i_bh * T * D
        S_j = STATES + st * F * D
        dS_j = DSTATES + st * F * D

        G = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)                 # dy v^T
        dq = tl.zeros((BLOCK_T, BLOCK_F), dtype=tl.float32)                # dy S^T
        dkT = tl.zeros((BLOCK_F, BLOCK_T), dtype=tl.float32)               # dS v^T
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < D
            dy = _tile(DY, rows, offs_d, D, 1, mask_t, mask_d)             # (BT, BD)
            vT = _tile(V, offs_d, rows, 1, D, mask_d, mask_t)              # (BD, BT)
            ST = _tile(S_j, offs_d, offs_f, 1, D, mask_d, mask_f)          # (BD, BF) S^T
            dS = _tile(dS_j, offs_f, offs_d, D, 1, mask_f, mask_d)         # (BF, BD)
            G += _dot(dy, vT, BF16, PRECISION)
            dq += _dot(dy, ST, BF16, PRECISION)
            dkT += _dot(dS, vT, BF16, PRECISION)

        rden = tl.load(RDEN + i_bh * T + rows, mask=mask_t, other=0.)      # (BT,)
        r = -tl.load(DELTA + i_bh * T + rows, mask=mask_t, other=0.) * rden  # (BT,) dL/dden
        c, m = _shifts(C, M, i_bh, T, rows, mask_t)
        causal = rows[:, None] >= rows[None, :]
        shifts = tl.exp(tl.minimum(c[None, :] - m[:, None], 0.))           # (BT, BT)
        G = tl.where(causal, (G * rden[:, None] + r[:, None]) * shifts, 0.)

        z = tl.load(ZS + st * F + offs_f, mask=mask_f, other=0.)           # (BF,)
        k = _tile(K + i_bh * T * F, rows, offs_f, F, 1, mask_t, mask_f)    # (BT, BF)
        dq_state = (dq * rden[:, None] + r[:, None] * z[None, :]) * tl.exp(m_before - m)[:, None]
        dq = _dot(G, k, BF16, PRECISION) + dq_state
        _put(DQ + i_bh * T * F, rows, offs_f, F, 1, mask_t, mask_f, dq)

        dz = tl.load(DZS + st * F + offs_f, mask=mask_f, other=0.)         # (BF,)
        qT = _tile(Q + i_bh * T * F, offs_f, rows, 1, F, mask_f, mask_t)   # (BF, BT)
        dkT = _dot(qT, G, BF16, PRECISION) + (dkT + dz[:, None]) * tl.exp(c)[None, :]
        _put(DK + i_bh * T * F, offs_f, rows, 1, F, mask_f, mask_t, dkT)   # dk, transposed

    @triton.jit
    def _bwd_dv_kernel(
        Q, K, DY, RDEN,       # (B*H, T, F), (B*H, T, F), (B*H, T, D), (B*H, T)
        DSTATES,              # (B*H, NT, F, D): the state gradient after each chunk
        C, M, MB,             # key shifts, the rows' running max, M_{j-1} (as the forward)
        DV,                   # out (B*H, T, D), in v's dtype
        T, F, D,
        BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
        BF16: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """dv = P^T g + k dS e^(c_s - M_j) for one chunk and value block, P^T_st = k_s . q_t e^(c_s
        - m_t) (s <= t); program = (chunk, bh, value block), P^T and k dS accumulated over feature
        blocks."""
        i_bh, rows, mask_t, _, st = _chunk(T, MB, BLOCK_T)
        i_d = tl.program_id(2)
        offs_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        Q = Q + i_bh * T * F
        K = K + i_bh * T * F
        dS_j = DSTATES + st * F * D

        PT = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)                # k q^T (s, t)
        kdS = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        for f0 in range(0, F, BLOCK_F):
            offs_f = f0 + tl.arange(0, BLOCK_F)
            mask_f = offs_f < F
            k = _tile(K, rows, offs_f, F, 1, mask_t, mask_f)               # (BT, BF)
            PT += _dot(k, _tile(Q, offs_f, rows, 1, F, mask_f, mask_t), BF16, PRECISION)
            kdS += _dot(k, _tile(dS_j, offs_f, offs_d, D, 1, mask_f, mask_d), BF16, PRECISION)

        c, m = _shifts(C, M, i_bh, T, rows, mask_t)
        anticausal = rows[:, None] <= rows[None, :]                        # (BT_s, BT_t) s <= t
        PT = tl.where(anticausal, PT * tl.exp(tl.minimum(c[:, None] - m[None, :], 0.)), 0.)
        rden = tl.load(RDEN + i_bh * T + rows, mask=mask_t, other=0.)
        dy = _tile(DY + i_bh * T * D, rows, offs_d, D, 1, mask_t, mask_d).to(tl.float32)
        g = dy * rden[:, None]                                             # (BT, BD)
        dv = _dot(PT, g, BF16, PRECISION) + kdS * tl.exp(c)[:, None]
        _put(DV + i_bh * T * D, rows, offs_d, D, 1, mask_t, mask_d, dv)

# ---- launch and autograd ----------------------------------------------------
# (BLOCK_F, BLOCK_D, num_warps) of the sequential passes, of 'fwd out' and 'bwd dv', and of 'bwd
# dqk', by the operands' form: large blocks that compile with no spill for sm_80 and sm_90 with
# registers to spare (tests/test_kernels_compile.py); fp32 operands take twice the registers and
# shared memory of bf16 ones, and 'ieee' products (FMA, no tensor cores) hold whole rows of their
# operands. The interpreter runs its programs one at a time: few, large blocks.
BLOCKS = {'bf16': ((32, 32, 4), (64, 64, 8), (64, 64, 8)),
          'tf32': ((32, 32, 8), (32, 32, 8), (64, 32, 8)),
          'ieee': ((16, 16, 8), (32, 32, 8), (32, 32, 8)),
          'interpreter': ((64, 64, 4), (64, 64, 4), (64, 64, 4))}

def _launches(BH, T, F, D, chunk, cfg):
    """Every launch, name -> (kernel, grid, meta: blocks, num_warps, cfg (BF16, PRECISION))."""
    form = 'interpreter' if INTERPRET else 'bf16' if cfg['BF16'] else cfg['PRECISION']

    def meta(block_f, block_d, warps):   # blocks no larger than the (power-of-two) sizes need
        block_f = max(16, min(block_f, triton.next_power_of_2(F)))
        block_d = max(16, min(block_d, triton.next_power_of_2(D)))
        return dict(BLOCK_T=chunk, BLOCK_F=block_f, BLOCK_D=block_d, num_warps=warps, **cfg)
    seq, out, dqk = (meta(*blocks) for blocks in BLOCKS[form])
    nt = triton.cdiv(T, chunk)
    seq_grid = (BH, triton.cdiv(F, seq['BLOCK_F']), triton.cdiv(D, seq['BLOCK_D']))
    out_grid = (nt, BH, triton.cdiv(D, out['BLOCK_D']))
    return {'fwd state': (_state_kernel, seq_grid, dict(seq, BACKWARD=False)),
            'fwd out': (_fwd_kernel, out_grid, out),
            'bwd dstate': (_state_kernel, seq_grid, dict(seq, BACKWARD=True)),
            'bwd dqk': (_bwd_dqk_kernel, (nt, BH, triton.cdiv(F, dqk['BLOCK_F'])), dqk),
            'bwd dv': (_bwd_dv_kernel, out_grid, out)}

def _cfg(dtype, tf32):
    """The operands' form: bf16 (tensor cores), or fp32 multiplies in 'tf32' or 'ieee'
    (Precision)."""
    interpreter_or_ieee = INTERPRET or (dtype == torch.float32 and not tf32)
    return dict(BF16=dtype == torch.bfloat16 and not INTERPRET,   # the interpreter's bf16 dot is
                                                                  # wrong
                PRECISION='ieee' if interpreter_or_ieee else 'tf32')

def _launch(launches, name, *args):
    kernel, grid, meta = launches[name]
    kernel[grid](*args, **meta)

def _chunk_states(x, T, F, D, chunk, cfg):
    """Empty per-chunk states (B*H, NT, F, D) and their z (B*H, NT, F) (dtypes: Memory above)."""
    dt = torch.bfloat16 if cfg['BF16'] else torch.float32
    return _new_state(x, F, D, triton.cdiv(T, chunk), dtype=dt)

def _new_state(x, F, D, *nt, dtype=torch.float32):
    """An empty state S (B*H, *nt, F, D) in dtype, z (B*H, *nt, F) fp32, beside x (B*H, ...): one
    fp32 state, or one per chunk (nt chunks)."""
    S = x.new_empty(x.shape[0], *nt, F, D, dtype=dtype)
    return S, x.new_empty(x.shape[0], *nt, F, dtype=torch.float32)

def _on_device(x):
    """Launch on x's GPU (a no-op on the CPU)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()

def _rows(x, *shape, fp32=True):
    """x as contiguous fp32 (B*H, *shape), the kernels' layout of states and per-row vectors
    (fp32=False: float64 stays)."""
    return (x if x.dtype == torch.float64 and not fp32 else x.float()).reshape(-1,
                                                                               *shape).contiguous()

def _rebased(c, m0, T, chunk):
    """Key shifts c (B, H, T) and the initial units m0 (B, H) as the kernels take them, (B*H, T)
    fp32: c, the rows' running max m and M_{j-1} (B*H, NT), each in units of its chunk's M_j, so
    that a shift as large as g t (spec decay, float64) keeps its precision at any t."""
    c = _rows(c, T, fp32=False)
    m0 = _rows(m0, fp32=False)
    m = torch.maximum(c.cummax(-1).values, m0[:, None]).detach()          # (BH, T) running max
    last = m[:, chunk - 1::chunk]
    M = torch.cat([last, m[:, -1:]], 1) if T % chunk else last            # (BH, NT): M_j
    M_before = torch.cat([m0[:, None].detach(), M[:, :-1]], 1) - M
    units = M.repeat_interleave(chunk, 1)[:, :T]
    m_units = (m - units).float().contiguous()                            # 0 at each chunk's end
    return (c - units).float(), m_units, M_before.float().contiguous(), m[:, -1]

class CausalLinearAttention(torch.autograd.Function):
    """apply(phi_q, phi_k, v, S0, z0, c, m, MB, eps, return_state, chunk_size, allow_tf32) -> y, or
    (y, S_T, z_T); c, m, MB from _rebased (c differentiated: dc_s = dk_s . phi_k_s, the key's
    features scale with exp(c_s); m and MB are units, not differentiated)."""

    @staticmethod
    def forward(ctx, phi_q, phi_k, v, S0, z0, c, m, MB, eps, return_state, chunk_size, allow_tf32):
        (B, H, T, F), D = phi_q.shape, v.shape[-1]
        dtypes = (phi_q.dtype, phi_k.dtype, v.dtype)   # -> the operands' dtype: see Precision
        dtype = functools.reduce(torch.promote_types, dtypes)
        if torch.bfloat16 in dtypes:
            dtype = torch.bfloat16
        cfg = _cfg(dtype, torch.backends.cuda.matmul.allow_tf32
                   if allow_tf32 is None else allow_tf32)
        q, k, vv = (x.to(dtype).reshape(B * H, T, -1).contiguous() for x in (phi_q, phi_k, v))
        if S0 is not None:
            S0 = _rows(S0, F, D)
            z0 = _rows(z0, F)
        c = c.contiguous()
        launches = _launches(B * H, T, F, D, chunk_size, cfg)
        states, zs = _chunk_states(q, T, F, D, chunk_size, cfg)
        # rden: 1 / den
        y = torch.empty_like(vv)
        rden = q.new_empty(B * H, T, dtype=torch.float32)
        S_end, z_end = _new_state(q, F, D) if return_state else (None, None)
        _launch(launches, 'fwd state', k, vv, c, m, MB, None, None, states, zs, S0, z0, S_end,
                z_end, T, F, D)
        _launch(launches, 'fwd out', q, k, vv, y, rden, states, zs, c, m, MB, T, F, D, float(eps))
        del states, zs   # the backward recomputes them
        ctx.save_for_backward(q, k, vv, y, rden, S0, z0, c, m, MB)
        ctx.cfg = (B, H, T, F, D, chunk_size, cfg)
        ctx.dtypes = dtypes
        y = y.reshape(B, H, T, D).to(v.dtype)
        if not return_state:
            return y
        return y, S_end.reshape(B, H, F, D), z_end.reshape(B, H, F)

    @staticmethod
    def backward(ctx, dy, dS_end=None, dz_end=None):
        q, k, vv, y, rden, S0, z0, c, m, MB = ctx.saved_tensors
        B, H, T, F, D, chunk, cfg = ctx.cfg
        # (autograd gives zeros for an output not used downstream: materialize_grads)
        dy = dy.to(vv.dtype).reshape(vv.shape).contiguous()
        if dS_end is not None:   # return_state: the gradients reaching the final state
            dS_end = _rows(dS_end, F, D)
            dz_end = _rows(dz_end, F)
        need_dinit = S0 is not None and (ctx.needs_input_grad[3] or ctx.needs_input_grad[4])
        with _on_device(q):   # dS_end, dz_end: the gradients reaching the final state, or None
            delta = (dy.float() * y.float()).sum(-1)                           # (BH, T) dy_t . y_t
            launches = _launches(B * H, T, F, D, chunk, cfg)
            states, zs = _chunk_states(q, T, F, D, chunk, cfg)
            dstates, dzs = _chunk_states(q, T, F, D, chunk, cfg)
            dq, dk, dv = (torch.empty_like(x, dtype=dt) for x, dt in zip((q, k, vv), ctx.dtypes))
            dS0, dz0 = _new_state(q, F, D) if need_dinit else (None, None)   # fp32
            _launch(launches, 'fwd state', k, vv, c, m, MB, None, None, states, zs, S0, z0, None,
                    None, T, F, D)
            _launch(launches, 'bwd dstate', q, dy, None, m, MB, rden, delta, dstates, dzs, dS_end,
                    dz_end, dS0, dz0, T, F, D)
            _launch(launches, 'bwd dqk', q, k, vv, dy, rden, delta, states, zs, dstates, dzs, c, m,
                    MB, dq, dk, T, F, D)
            _launch(launches, 'bwd dv', q, k, dy, rden, dstates, c, m, MB, dv, T, F, D)
        dc = (dk.float() * k.float()).sum(-1) if ctx.needs_input_grad[5] else None   # (BH, T)
        grads = [g.reshape(B, H, T, -1) for g in (dq, dk, dv)]
        if need_dinit:
            dS0 = dS0.reshape(B, H, F, D)
            dz0 = dz0.reshape(B, H, F)
        return (*grads, dS0, dz0, dc, None, None, None, None, None, None)

# ---- the fused decode step: one token of one layer in one launch ---------------------------------
if HAS_TRITON:
    @triton.jit
    def _unrope(X, offs_d, D, pos, INV_FREQ, NOPE: tl.constexpr):
        """x (BD,) fp32 from X, and with NOPE rotated back from position pos (RoPE's halves layout:
        x_i with x_(i + D/2) turned by pos inv_freq_i), as a linear part's map sees it."""
        x = tl.load(X + offs_d, mask=offs_d < D, other=0.).to(tl.float32)
        if NOPE:
            half = D // 2
            partner = tl.load(X + (offs_d + half) % D, mask=offs_d < D, other=0.).to(tl.float32)
            angle = pos.to(tl.float32) * tl.load(INV_FREQ + offs_d % half,
                                                 mask=offs_d < D, other=0.)
            x = x * tl.cos(angle) + tl.where(offs_d < half, partner, -partner) * tl.sin(angle)
        return x

    @triton.jit
    def _features(xq, xk, h, MAP_W, MAP_B, offs_d, D, FW, BU: tl.constexpr,
                  SKIP: tl.constexpr, LOG: tl.constexpr):
        """Hedgehog's and LoLCATs' features of a query and a key (BD,) for query head h: u = W_h x +
        b_h (+ x, LoLCATs' skip), phi = [f(u), f(-u)] (F = 2 FW): f a softmax over each half, or exp
        (LOG), shifted by c, the largest log-feature -> (phi_q, c_q, phi_k, c_k), phi (2 BU,):
        feature f at row (f // BU) FW + f % BU of the state; c in float64 (the decay shifts it
        there)."""
        offs_u = tl.arange(0, BU)
        w = _tile(MAP_W + h * FW * D, offs_u, offs_d, D, 1, offs_u < FW, offs_d < D)    # (BU, BD)
        if SKIP:
            w += tl.where(offs_u[:, None] == offs_d[None, :], 1., 0.)
        bias = tl.load(MAP_B + h * FW + offs_u, mask=offs_u < FW, other=0.)
        phi_q, c_q = _activate(tl.sum(w * xq[None, :], 1) + bias, FW, BU, LOG)
        phi_k, c_k = _activate(tl.sum(w * xk[None, :], 1) + bias, FW, BU, LOG)
        return phi_q, c_q.to(tl.float64), phi_k, c_k.to(tl.float64)   # c in float64, as hybrids'

    @triton.jit
    def _activate(u, FW, BU: tl.constexpr, LOG: tl.constexpr):
        """[f(u), f(-u)] of u (BU,) as (2 BU,): (phi, c) as _features."""
        offs = tl.arange(0, 2 * BU)
        first = offs < BU
        valid = offs % BU < FW
        u = tl.where(valid, tl.reshape(tl.permute(tl.join(u, -u), (1, 0)),
                                       (2 * BU,)), -float('inf'))
        c = tl.max(u, 0)
        if LOG:
            return tl.exp(u - c), c
        inf = float('inf')
        top = tl.where(first, tl.max(tl.where(first, u, -inf), 0),
                       tl.max(tl.where(first, -inf, u), 0))
        e = tl.exp(u - top)
        total = tl.where(first, tl.sum(tl.where(first, e, 0.), 0),
                         tl.sum(tl.where(first, 0., e), 0))
        return e / total, c * 0.

    @triton.jit
    def _slots(R, x, new, offs_l, offs_d, D, L):
        """The slots R (L, D) with x (BD,) in the row where new: (BL, BD), fp32."""
        return tl.where(new, x[None, :], _tile(R, offs_l, offs_d, D, 1, offs_l < L, offs_d < D))

    @triton.jit
    def _fold(S, z, m, phi, c, v):
        """(S, z, m) with one key added: m' = max(m, c), S' = S e^(m - m') + phi e^(c - m') v^T."""
        new = tl.maximum(m, c)
        r = tl.exp(m - new).to(tl.float32)
        w = tl.exp(c - new).to(tl.float32)
        return S * r + (w * phi)[:, None] * v[None, :], z * r + w * phi, new

    @triton.jit
    def _decode_kernel(
        Q, K, V, Y,               # (B, H, D) this token's q, k and v (GQA-repeated), out y (B, H,
                                  # D)
        MAP_W, MAP_B, INV_FREQ,   # the map's (H, FW, D), (H, FW); RoPE's (D/2,) (NOPE)
        DECAY_G, THETA,           # (H,) g float64 (DECAY), window_factor (WINDOW)
        S, Z, M, S2, Z2, M2,      # the linear state (B, H, F, D), (B, H, F), (B, H), in and out
        RK, RV, RP, RK2, RV2, RP2,   # WINDOW: the slots (B, H / G, L, D) x 2, (L,), in and out
        POS, H, D, FW, L, W, N,   # (1,) this token's position; the window, its sinks, L = N + W
        G: tl.constexpr, BD: tl.constexpr, BU: tl.constexpr, BL: tl.constexpr, SKIP: tl.constexpr,
        LOG: tl.constexpr, NOPE: tl.constexpr, DECAY: tl.constexpr,
        WINDOW: tl.constexpr, MIX: tl.constexpr,
    ):
        """One token of one layer, program (b, j): batch row b, KV head j and its G query heads. The
        state goes from (S, .., RP) to (S2, .., RP2): new buffers, or the same ones (a CUDA
        graph's).
            Linear   fold the token into (S, z, m); y = phi(q) S / phi(q) z
            Window   write the token into its slot (its sink's while pos < N, else N + pos % W);
                     softmax over the slots; the linear part read as it was; joint or mix combine;
                     fold the token leaving the window for the next query (features made again)"""
        b, j = tl.program_id(0).to(tl.int64), tl.program_id(1)
        offs_d, offs_f, offs_l = tl.arange(0, BD), tl.arange(0, 2 * BU), tl.arange(0, BL)
        mask_d, F, pos = offs_d < D, 2 * FW, tl.load(POS)
        rows_f, mask_f = offs_f // BU * FW + offs_f % BU, offs_f % BU < FW   # feature f's row of S
        kv = (b * H + j * G) * D                                   # the KV head's k and v
        k = tl.load(K + kv + offs_d, mask=mask_d, other=0.).to(tl.float32)
        v = tl.load(V + kv + offs_d, mask=mask_d, other=0.).to(tl.float32)
        # the token the linear state folds in, its position and its key as the maps see it: this
        # token (Linear), or under WINDOW the one leaving the window for the next query
        t_fold, k_fold = pos, _unrope(K + kv, offs_d, D, pos, INV_FREQ, NOPE)
        if WINDOW:   # the slots with this token written; the token leaving: t_fold, k_fold, v_out
            ring, slot = (b * (H // G) + j) * L * D, tl.where(pos < N, pos, N + pos % W)
            new = offs_l[:, None] == slot
            p = tl.where(offs_l == slot, pos, tl.load(RP + offs_l, mask=offs_l < L, other=-1))
            # the slots written to RK2, RV2 (RK, RV themselves: in place)
            _put(RK2 + ring, offs_l, offs_d, D, 1, offs_l < L, mask_d,
                 _slots(RK + ring, k, new, offs_l, offs_d, D, L))
            _put(RV2 + ring, offs_l, offs_d, D, 1, offs_l < L, mask_d,
                 _slots(RV + ring, v, new, offs_l, offs_d, D, L))
            tl.store(RP2 + offs_l, p, mask=offs_l < L)
            leaving, t_fold = N + (pos + 1) % W, pos + 1 - W
            real = tl.load(RP + leaving) >= 0
            v_out = tl.load(RV + ring + leaving * D + offs_d, mask=mask_d, other=0.).to(tl.float32)
            k_fold = _unrope(RK + ring + leaving * D, offs_d, D, t_fold, INV_FREQ, NOPE)
        for i in range(G):
            h = j * G + i
            row = b * H + h
            qn = _unrope(Q + row * D, offs_d, D, pos, INV_FREQ, NOPE)
            phi_q, c_q, phi_k, c_k = _features(qn, k_fold, h, MAP_W, MAP_B, offs_d,
                                               D, FW, BU, SKIP, LOG)
            if DECAY:   # lambda^(t - s) as shifts, in float64 as hybrids' (g: made there, one way)
                g = tl.load(DECAY_G + h)
                c_q, c_k = c_q - g * pos, c_k + g * t_fold
            if WINDOW:   # the softmax part first (the slots), then the linear state
                q = tl.load(Q + row * D + offs_d, mask=mask_d, other=0.).to(tl.float32)
                Kw = _slots(RK + ring, k, new, offs_l, offs_d, D, L)
                s = tl.where(p >= 0,
                             tl.sum(Kw * q[None, :], 1) / tl.sqrt(D.to(tl.float32)), -float('inf'))
                a = tl.exp(s - tl.max(s, 0))                               # (BL,) the window's
                                                                           # weights
                Vw = _slots(RV + ring, v, new, offs_l, offs_d, D, L)
                y_w = tl.sum(a[:, None] * Vw, 0) / tl.sum(a, 0)
            S_h = _tile(S + row * F * D, rows_f, offs_d, D, 1, mask_f, mask_d)
            z_h = tl.load(Z + row * F + rows_f, mask=mask_f, other=0.)
            m_h = tl.load(M + row).to(tl.float64)
            if not WINDOW:   # the token folded first (a window's linear part: read as it was)
                S_h, z_h, m_h = _fold(S_h, z_h, m_h, phi_k, c_k, v)
            num, den = tl.sum(phi_q[:, None] * S_h, 0), tl.sum(phi_q * z_h, 0)
            y = tl.where(den > 0, num / tl.where(den > 0, den, 1.), 0.)   # the linear part
            if WINDOW:
                share = 1. / (1. + tl.exp(-tl.load(THETA + h)))          # the window factor
                if not MIX:   # joint: the window part's share of gamma den_w + exp(c) den
                    c = (c_q + m_h).to(tl.float32)
                    share = 1. / (1. + tl.exp(c + tl.log(tl.where(den > 0, den, 1.))
                                              - tl.log(share * tl.sum(a, 0))))
                y = y + tl.where(den > 0, share, 1.) * (y_w - y)
                if LOG or DECAY:   # (an empty slot: no key; else as a map without shifts, c = 0)
                    c_k = tl.where(real, c_k, -1e30)
                S_h, z_h, m_h = _fold(S_h, z_h, m_h, tl.where(real, phi_k, 0.), c_k, v_out)
            tl.store(Y + row * D + offs_d, y.to(Y.dtype.element_ty), mask=mask_d)
            _store_state(S2 + row * F * D, Z2 + row * F, S_h, z_h, rows_f, offs_d,
                         D, mask_f, mask_d, 0)
            tl.store(M2 + row, m_h.to(M2.dtype.element_ty))

def decode_step(q, k, v, pos, map_w, map_b, linear, slots=None, kv_groups=1, window=0, sinks=0,
                skip=False, log=False, mix=False, theta=None, decay_g=None,
                inv_freq=None, in_place=False):
    """One token of one layer's heads with a Hedgehog or LoLCATs map, in one launch of
    _decode_kernel (its reference: hybrids' Linear.step, Window.step). q, k, v (B, H, 1, D), k and v
    GQA-repeated; pos (1,) long: the token's position; map_w (H, FW, D), map_b (H, FW); linear (S,
    z, m); slots (k, v, pos) of a window (None: linear attention alone); theta: the window factor,
    raw, (H,); decay_g: the decay's g (H,) float64, hybrids.decay_g (lambda = exp(-g));
    inv_freq: RoPE's (nope). in_place: the state's own buffers are written (a CUDA graph's). -> y
    (B, H, 1, D) in v's dtype, the new linear state and slots."""
    (B, H, _, D), FW = q.shape, map_w.shape[1]
    q, k, v, *state = (x.contiguous() for x in (q, k, v, *linear, *(slots or ())))
    linear = state[:3]
    slots = state[3:] or None
    out = [(x if in_place else torch.empty_like(x)) for x in state]
    y = torch.empty_like(v)
    L = slots[0].shape[2] if slots else 1
    opt = [map_b if x is None else x for x in (inv_freq, decay_g, theta)]   # (unused pointers where
    # a part is off; the slots' likewise: pos)
    # (eval.step_ops counts it)
    with _on_device(v), torch.profiler.record_function('triton::decode_step'):
        _decode_kernel[(B, H // kv_groups)](
            q, k, v, y, map_w, map_b, *opt, *linear, *out[:3], *(slots or (pos,) * 3),
            *(out[3:] or (pos,) * 3), pos, H, D, FW, L, max(window, 1), sinks,
            G=kv_groups, BD=triton.next_power_of_2(D), BU=triton.next_power_of_2(FW),
            BL=triton.next_power_of_2(L),
            SKIP=skip, LOG=log, NOPE=inv_freq is not None, DECAY=decay_g is not None,
            WINDOW=slots is not None, MIX=mix, num_warps=decode_warps(2 * FW, D))
    return y, tuple(out[:3]), tuple(out[3:]) or None

def decode_warps(F, D, L=1):
    """The fused decode step's warps for F features, head size D and L slots: 4 for tiles (powers of
    two) up to 2,048 values, 8 up to 8,192; 0 where F x D or L x D is larger: it would spill there
    (no spill on sm_80 and sm_90 otherwise, tests/test_kernels_compile.py)."""
    size = lambda n: 1 << (n - 1).bit_length()   # noqa: E731, the power of two a tile of n rounds
                                                 # up to
    tile = max(size(F), size(L)) * size(D)
    return 0 if tile > 8192 else 4 if size(F) * size(D) <= 2048 else 8

def supports(F, D):
    """Whether the kernel handles feature dim F and value dim D (Taylor's F = 1 + D + D^2: not)."""
    return F <= MAX_FEATURE_DIM and D <= MAX_HEAD_DIM

def triton_available(x):
    """Whether the kernel runs on x: CUDA, or CPU under TRITON_INTERPRET=1 set before import."""
    return HAS_TRITON and (x.is_cuda or (INTERPRET and x.device.type == 'cpu'))

@torch.compiler.disable   # torch.compile: a graph break here rather than tracing into the launches
def causal_linear_attention(phi_q, phi_k, v, eps=0.0, initial_state=None, return_state=False,
                            chunk_size=None, allow_tf32=None, c_k=None):
    """The Triton kernel, differentiable: phi_q, phi_k (B, H, T, F), v (B, H, T, D), F <= 256, D <=
    128 -> y (B, H, T, D) in v.dtype, or (y, (S, z)) with S (B, H, F, D), z (B, H, F) fp32; with key
    shifts c_k (B, H, T) (or an initial state (S, z, m)) the state is (S, z, m). chunk_size: BLOCK_T
    (default 64); allow_tf32: fp32 inputs only (default: torch's flag)."""
    if not triton_available(v):
        got = 'no triton' if not HAS_TRITON else v.device.type + ' tensors'
        raise RuntimeError(
            f"the Triton kernel needs triton and CUDA tensors (or TRITON_INTERPRET=1 set before "
            f"importing kernels), got {got}")
    if phi_q.dim() != 4 or phi_q.shape != phi_k.shape or v.shape[:3] != phi_q.shape[:3]:
        raise ValueError(f"expected phi_q, phi_k (B, H, T, F), v (B, H, T, D); got "
                         f"{tuple(phi_q.shape)}, {tuple(phi_k.shape)}, {tuple(v.shape)}")
    chunk_size = chunk_size or DEFAULT_CHUNK
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16, got {chunk_size}")
    shifted = c_k is not None or len(initial_state or ()) > 2
    heads = phi_q.shape[:2]   # (B, H)
    if initial_state is None:   # no state: no key yet
        S0 = None
        z0 = None
        m0 = phi_q.new_full(heads, NO_KEY, dtype=torch.float32)
    else:
        S0, z0 = initial_state[:2]
        m0 = initial_state[2] if len(initial_state) > 2 else phi_q.new_zeros(heads)
    c = phi_q.new_zeros(phi_q.shape[:3]) if c_k is None else c_k
    c, m, MB, m_end = _rebased(c, m0, phi_q.shape[2], chunk_size)
    with _on_device(v):
        out = CausalLinearAttention.apply(phi_q, phi_k, v, S0, z0, c, m, MB, eps,
                                          bool(return_state), int(chunk_size), allow_tf32)
    if not return_state:
        return out
    return out[0], (*out[1:], m_end.view(heads)) if shifted else out[1:]

# ---- the benchmark (python kernels.py, CUDA) ---------------------------------------------------
def _benchmark(B, H, Ts, F, D, dt):
    """python kernels.py: median ms of the kernel, the naive reference, SDPA (and fla's chunk form
    where installed), forward and forward+backward, on CUDA."""
    try:
        from fla.ops.linear_attn import chunk_linear_attn as fla
    except ImportError:   # not installed
        fla = None
    print(f'B={B} H={H} F={F} D={D} {dt}: median ms (triton.testing.do_bench), fwd / fwd+bwd' + (
        '; fla: flash-linear-attention chunk_linear_attn(normalize=True), its (B, T, H, .) layout '
        'made untimed' if fla else ' (pip install flash-linear-attention adds its '
                                   'chunk_linear_attn)'))
    print(f'{"T":>6} {"kernel":>16} {"reference":>16} {"sdpa":>16}'
          + f' {"fla":>16} {"kernel vs fla":>13}' * bool(fla))
    for T in Ts:
        x = [torch.randn(B, H, T, D, device='cuda', dtype=dt, requires_grad=True) for _ in range(3)]
        pq, pk = (torch.rand(B, H, T, F, device='cuda', dtype=dt,
                             requires_grad=True) for _ in range(2))
        fns = {'kernel': lambda: causal_linear_attention(pq, pk, x[2]),
               'reference': lambda: causal_linear_attention_reference(pq, pk, x[2]),
               'sdpa': lambda: torch.nn.functional.scaled_dot_product_attention(*x, is_causal=True)}
        if fla:   # (B, T, H, .) leaves; scale 1: phi_q and phi_k are already the features
            qkv = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (pq, pk, x[2])]
            fns['fla'] = lambda: fla(*qkv, scale=1.0, normalize=True)[0]
        cells = []
        for fn in fns.values():
            try:
                fwd = triton.testing.do_bench(fn)
                fwd_bwd = triton.testing.do_bench(lambda: fn().sum().backward())
                cells.append(f'{fwd:7.2f} / {fwd_bwd:7.2f}')
            except torch.OutOfMemoryError:
                cells.append('out of memory')
            torch.cuda.empty_cache()
        if fla:   # relative difference of the outputs, fp32 norms
            y = fns['kernel']().float()
            yf = fns['fla']().transpose(1, 2).float()
            cells.append(f'{((y - yf).norm() / y.norm()).item():.1e}')
        print(f'{T:>6} ' + ' '.join(f'{c:>16}' for c in cells))

if __name__ == '__main__':   # python kernels.py [--T 1024,4096] [--B 4] [--dtype bfloat16] [--F
                             # 128] [--D 64]
    import argparse
    p = argparse.ArgumentParser(
        description='Time the kernel against its naive reference and torch SDPA on a CUDA GPU.')
    p.add_argument('--T', default='1024,4096,16384', help='comma-separated sequence lengths')
    p.add_argument('--B', type=int, default=4, help='batch size (12 heads)')
    p.add_argument('--dtype', default='bfloat16', choices=['float32', 'bfloat16', 'float16'])
    p.add_argument('--F', type=int, default=128, help='feature dimension (the kernel: F <= 256)')
    p.add_argument('--D', type=int, default=64, help='head dimension (the kernel: D <= 128)')
    a = p.parse_args()
    if not (HAS_TRITON and torch.cuda.is_available()):
        raise SystemExit(
            'kernels.py: the benchmark needs triton and a CUDA GPU (tests/test_kernels.py: on CPU)')
    _benchmark(a.B, 12, [int(t) for t in a.T.split(',')], a.F, a.D, getattr(torch, a.dtype))
