"""
Causal linear attention in Triton: the naive reference, four kernels in five launches, the autograd wrapper, a static
estimate of their time on an H100 (--plan), a CUDA benchmark.

What it computes. Given feature-mapped queries and keys phi_q, phi_k (B, H, T, F) and values v (B, H, T, D):

    y_t = phi_q_t^T S_t / (phi_q_t^T z_t + eps),   S_t = S_0 + sum_{s<=t} phi_k_s v_s^T   (F, D)
                                                   z_t = z_0 + sum_{s<=t} phi_k_s         (F,)

(0 where the denominator is 0) from an optional initial state (S_0, z_0), optionally returning the final state
(prefill, then decode). Key shifts c (B, H, T), optional: the keys are phi_k_s exp(c_s), and row t is computed in
units of exp(-m_t), m_t = max(m_0, c_1..c_t) (a running max, as online softmax), so every factor exp(c_s - m_t) is
<= 1 whatever the keys' scale; the state (S, z, m) is then in units of exp(-m). `causal_linear_attention_reference`
computes it from the definition, quadratic in T.

Design: flash-linear-attention's two-pass chunk form. Time is cut into chunks of BLOCK_T = 64 rows, NT = T / 64 of
them; M_j is the running max at chunk j's last row (M_-1 = m_0), known beforehand (a cummax in PyTorch). A
sequential pass writes the state every chunk starts from; the attention inside the chunks and the outputs then run
in parallel over (chunk, batch x head, block). Per chunk j (rows t, keys s of the chunk; S_j, z_j: the state
before it, in units exp(-M_j-1); r_t = exp(M_j-1 - m_t)):

    A    = q k^T exp(c_s - m_t), masked to s <= t     (BLOCK_T, BLOCK_T)  fp32 accumulation
    num  = A v + q S_j r                              (BLOCK_T, BLOCK_D)  intra-chunk + inter-chunk
    den  = rowsum(A) + q . z_j r + eps                (BLOCK_T,)          fp32, in the same kernel
    y    = num / den ;   S_j+1 = S_j exp(M_j-1 - M_j) + k^T (v exp(c_s - M_j)), z_j+1 likewise with colsum(k)
The denominator comes from the same A and z, not from a separate pass (where published kernels had silent gradient
bugs). Launches (B*H = BH; grids at B=1, H=12, T=32K, F=128, D=64, bf16 in brackets; `python kernels.py --plan`):

    fwd state   _state_kernel     (BH, F/BF, D/BD) (12, 4, 2): walks the chunks, stores S_j, z_j; holds the
                                  (BF, BD) = (32, 32) fp32 state
    fwd out     _fwd_kernel       (NT, BH, D/BD) (512, 12, 1): y and 1/den of one chunk; holds A, q S_j (BT, BD)
                                  accumulated over feature blocks of 64
    (backward)  _state_kernel     'fwd state' again: the states are recomputed, not saved
    bwd dstate  _state_kernel     REVERSE, (BH, F/BF, D/BD) (12, 4, 2): walks the chunks backward, stores dS, dz
                                  after each chunk; holds the (32, 32) fp32 state gradient
    bwd dqk     _bwd_dqk_kernel   (NT, BH, F/BF) (512, 12, 2): dq, dk of one chunk and feature block of 64; holds
                                  G (BT, BT), dq (BT, BF), dk^T (BF, BT) accumulated over value blocks of 64
    bwd dv      _bwd_dv_kernel    (NT, BH, D/BD) (512, 12, 1): dv of one chunk; holds P^T (BT, BT), k dS (BT, BD)
                                  accumulated over feature blocks of 64
Blocks and warps: BLOCKS and _launches, large blocks that compile without spills, registers to spare, for sm_80 and
sm_90 (tests/test_kernels_compile.py). The stored states cost memory: (BH, NT, F, D) in the operands' dtype if bf16
(the dots read them in bf16 anyway: the same rounding), else fp32, and z (BH, NT, F) fp32; with bf16 operands
2 F D / 64 + 4 F / 64 bytes per token and head: 264 B at F=128, D=64 (q and k in bf16: 512 B), 104 MB at B=1, H=12,
T=32K; 1,040 B at F=256, D=128. The forward frees them; the backward holds two sets (states and their gradients).

Backward. With P_ts = q_t . k_s (s <= t), rden_t = 1 / (den_t + eps) (saved) and delta_t = dy_t . y_t:
    g_t = dL/dnum_t = dy_t rden_t,   r_t = dL/dden_t = -delta_t rden_t,   G_ts = dL/dP_ts = g_t . v_s + r_t
    dq_t = sum_{s<=t} G_ts k_s + S_0 g_t + r_t z_0        dS_0 = dS_T + sum_t q_t g_t^T
    dk_s = sum_{t>=s} G_ts q_t + dS_T v_s + dz_T          dz_0 = dz_T + sum_t r_t q_t
    dv_s = sum_{t>=s} P_ts g_t + dS_T^T k_s
(dS_T, dz_T: the gradients arriving through the returned state; with shifts, P_ts and the state terms carry the
forward's factors.) Chunked, the sums over earlier chunks (dq) are q's state S_j, z_j; those over later chunks (dk,
dv) the state gradient after chunk j, dS_j = dS_j+1 exp(M_j - M_j+1) + sum_{t in j+1} q_t g_t^T exp(M_j - m_t),
dz_j likewise with r_t (units exp(-M_j)). Operands needed transposed are loaded transposed by swapping the pointer
arithmetic; a tl.dot result is never transposed (a Triton miscompile on Hopper): the transposed product is computed
directly (k q^T rather than (q k^T)^T), or stored through transposed pointers.

Precision. Accumulation and state are fp32 (the stored states: see above). Operands are bf16 if an input is bf16
(tensor cores; bf16 has fp32's range), else the promoted dtype: fp32 features with fp16 values stay fp32, since
exp-based features overflow fp16 (65504 = e^11). fp32 multiplies in 'tf32' if torch.backends.cuda.matmul.allow_tf32
(or allow_tf32=True), else 'ieee'; fp16 always in 'tf32' (exact for it). Gradients are written in each input's dtype.

CPU. With TRITON_INTERPRET=1 set before import, the kernels run in Triton's interpreter on CPU tensors (the
tests; bf16 operands are upcast there: the interpreter's bf16 tl.dot is wrong), with blocks of their own (fewer
programs; tests/test_kernels.py also runs the GPU blocks there).
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

# @triton.jit builds interpreter kernels only if the variable is set before the decorator runs (before import)
INTERPRET = HAS_TRITON and os.environ.get('TRITON_INTERPRET', '0') == '1'
NO_KEY = -1e30      # as attention.NO_KEY: the running max before any key
DEFAULT_CHUNK = 64   # BLOCK_T: the chunk of rows each program of the parallel launches owns
MAX_FEATURE_DIM, MAX_HEAD_DIM = 256, 128  # the sizes tests/test_kernels_compile.py checks

def causal_linear_attention_reference(phi_q, phi_k, v, eps=0.0, initial_state=None, return_state=False, c_k=None):
    """The definition, quadratic in T: A_ts = phi_q_t . phi_k_s exp(c_s - m_t) (s <= t), y = (A v + q S_0 exp(m_0 -
    m_t)) / (rowsum(A) + q . z_0 exp(m_0 - m_t) + eps). c_k (B, H, T): the keys' shifts, the exact features being
    phi_k exp(c_k) (None: 0); m_t = max(m_0, c_1..c_t), the units exp(-m_t) row t is computed in. initial_state
    (S_0, z_0[, m_0]) (B, H, F, D), (B, H, F)[, (B, H)] in units exp(-m_0); m_0 = 0 when it has no m_0, and without
    an initial state S_0 = z_0 = 0 and m_0 = NO_KEY (-1e30, no key yet: m_t is the largest c_s, s <= t). Where the
    denominator is 0 or less, y is the numerator undivided: 0 for a query whose features are all 0. Computes in at
    least fp32 (float64 stays float64); y in v.dtype; return_state: also the final state (S, z, m = m_T), S_0, z_0
    and all T keys summed in units exp(-m), in the compute dtype; (S, z) alone without c_k and without an m_0."""
    dt = torch.promote_types(torch.promote_types(phi_q.dtype, v.dtype), torch.float32)
    q, k, v_ = phi_q.to(dt), phi_k.to(dt), v.to(dt)
    (B, H, T, F), D = q.shape, v.shape[-1]
    c = q.new_zeros(B, H, T) if c_k is None else c_k.to(dt)
    S0, z0, *m0 = (q.new_zeros(B, H, F, D), q.new_zeros(B, H, F)) if initial_state is None else initial_state
    S0, z0 = S0.to(dt), z0.to(dt)
    m0 = m0[0].to(dt) if m0 else q.new_full((B, H), NO_KEY if initial_state is None else 0.)
    m = torch.maximum(c.cummax(-1).values, m0[..., None])                            # (B, H, T) running max
    A = (q @ k.transpose(-2, -1) * torch.exp((c[..., None, :] - m[..., None]).clamp(max=0))).tril()  # (B, H, T, T)
    r = torch.exp(m0[..., None] - m)                                                 # (B, H, T) the state's units
    den = A.sum(-1) + (q @ z0[..., None])[..., 0] * r + eps
    y = ((A @ v_ + q @ S0 * r[..., None]) / den.where(den > 0, 1.)[..., None]).to(v.dtype)
    M = m[..., -1]
    kM = k * torch.exp(c - M[..., None])[..., None]
    state = (S0 * torch.exp(m0 - M)[..., None, None] + kM.transpose(-2, -1) @ v_, z0 * torch.exp(m0 - M)[..., None]
             + kM.sum(2), M)
    shifted = c_k is not None or (initial_state is not None and len(initial_state) > 2)
    return (y, state if shifted else state[:2]) if return_state else y

if HAS_TRITON:
    @triton.jit
    def _dot(a, b, BF16: tl.constexpr, PRECISION: tl.constexpr):
        """a @ b with fp32 accumulation; operands in bf16 (tensor cores) or fp32 ('ieee' or 'tf32')."""
        if BF16:
            return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
        else:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)

    @triton.jit
    def _tile(ptr, rows, cols, stride_r, stride_c, mask_r, mask_c):
        """The tile ptr[rows, cols] of a matrix with strides (stride_r, stride_c), 0 where masked; strides
        (1, n) load an (n-column, row-major) matrix transposed."""
        return tl.load(ptr + rows[:, None] * stride_r + cols[None, :] * stride_c,
                       mask=mask_r[:, None] & mask_c[None, :], other=0.)

    @triton.jit
    def _maxes(M, m0_ptr, T, j, BLOCK_T: tl.constexpr):
        """M_{j-1} and M_j: the running max before chunk j (m_0 for j = 0) and at its last row; M: one head's (T,)."""
        return tl.where(j > 0, tl.load(M + tl.maximum(j * BLOCK_T - 1, 0)), tl.load(m0_ptr)), \
            tl.load(M + tl.minimum(j * BLOCK_T + BLOCK_T, T) - 1)

    @triton.jit
    def _state_kernel(
        X, Y,                 # (B*H, T, F), (B*H, T, D): k, v (forward) or q, dy (REVERSE)
        C, M, M0, RDEN, DELTA,  # (B*H, T) key shifts, rows' running max; (B*H,) m0; (B*H, T) 1/(den+eps), dy.y
        H, HZ,                # (B*H, NT, F, D), (B*H, NT, F) out: per chunk, the state the other launches read
        S0, Z0, SF, ZF,       # (B*H, F, D), (B*H, F) fp32: the state it starts from (if HAS_INIT) and ends with
        T, F, D, REVERSE: tl.constexpr, HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
        BF16: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """The sequential pass, one program per (bh, feature block, value block), the state in fp32 registers.
        Forward (chunks 0..NT-1): H[j] = S before chunk j, in units exp(-M_{j-1}); S <- S e^(M_{j-1} - M_j) +
        sum_s k_s (v_s e^(c_s - M_j))^T, z likewise with colsum. REVERSE (chunks NT-1..0): H[j] = dS after chunk j,
        in units exp(-M_j); dS <- dS e^(M_{j-1} - M_j) + sum_t q_t (g_t e^(M_{j-1} - m_t))^T, g = dy rden, dz with
        r_t = -delta_t rden_t in place of g."""
        i_bh, i_f, i_d = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
        offs_t = tl.arange(0, BLOCK_T)
        offs_f = i_f * BLOCK_F + tl.arange(0, BLOCK_F)
        offs_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_f, mask_d = offs_f < F, offs_d < D
        NT = tl.cdiv(T, BLOCK_T)
        X, Y, C, M, RDEN, DELTA = X + i_bh * T * F, Y + i_bh * T * D, C + i_bh * T, M + i_bh * T, RDEN + i_bh * T, \
            DELTA + i_bh * T
        H, HZ = H + i_bh * NT * F * D + offs_f[:, None] * D + offs_d[None, :], HZ + i_bh * NT * F + offs_f

        S = tl.zeros((BLOCK_F, BLOCK_D), dtype=tl.float32)               # S or dS [f-block, d-block], fp32
        z = tl.zeros((BLOCK_F,), dtype=tl.float32)                       # z or dz [f-block]
        if HAS_INIT:
            S = _tile(S0 + i_bh * F * D, offs_f, offs_d, D, 1, mask_f, mask_d)
            z = tl.load(Z0 + i_bh * F + offs_f, mask=mask_f, other=0.)
        for i in range(0, NT):
            j = NT - 1 - i if REVERSE else i
            tl.store(H + j * F * D, S.to(H.dtype.element_ty), mask=mask_f[:, None] & mask_d[None, :])
            if i_d == 0:
                tl.store(HZ + j * F, z, mask=mask_f)
            rows = j * BLOCK_T + offs_t
            mask_t = rows < T
            m_prev, m_last = _maxes(M, M0 + i_bh, T, j, BLOCK_T)                    # M_{j-1}, M_j
            xT = _tile(X, offs_f, rows, 1, F, mask_f, mask_t)                     # (BF, BT) loaded transposed
            y = _tile(Y, rows, offs_d, D, 1, mask_t, mask_d)                      # (BT, BD)
            if REVERSE:
                w = tl.exp(m_prev - tl.load(M + rows, mask=mask_t, other=1e30))   # (BT,) row t -> units M_{j-1}
                rden = tl.load(RDEN + rows, mask=mask_t, other=0.)
                wy, wz = w * rden, -w * rden * tl.load(DELTA + rows, mask=mask_t, other=0.)
            else:
                wy = tl.exp(tl.load(C + rows, mask=mask_t, other=-1e30) - m_last)  # (BT,) key s -> units M_j
                wz = wy
            decay = tl.exp(m_prev - m_last)
            S = S * decay + _dot(xT, y.to(tl.float32) * wy[:, None], BF16, PRECISION)  # (BF, BD)
            z = z * decay + tl.sum(xT.to(tl.float32) * wz[None, :], axis=1)             # (BF,)
        if STORE_FINAL:
            tl.store(SF + i_bh * F * D + offs_f[:, None] * D + offs_d[None, :], S,
                     mask=mask_f[:, None] & mask_d[None, :])
            if i_d == 0:
                tl.store(ZF + i_bh * F + offs_f, z, mask=mask_f)

    @triton.jit
    def _chunk(T, M, M0, i_bh, BLOCK_T: tl.constexpr):
        """Chunk j = program_id(0) of (batch x head) i_bh: its rows, their mask, M_{j-1} and M_j, and the index of
        its state in H, (B*H, NT, ...)."""
        j = tl.program_id(0)
        rows = j * BLOCK_T + tl.arange(0, BLOCK_T)
        m_prev, m_last = _maxes(M + i_bh * T, M0 + i_bh, T, j, BLOCK_T)
        return rows, rows < T, m_prev, m_last, i_bh * tl.cdiv(T, BLOCK_T) + j

    @triton.jit
    def _fwd_kernel(
        Q, K, V, Y, RDEN,     # (B*H, T, F), (B*H, T, F), (B*H, T, D), (B*H, T, D) out, (B*H, T) fp32 out
        H, HZ,                # (B*H, NT, F, D), (B*H, NT, F): the state before each chunk (_state_kernel)
        C, M, M0,             # (B*H, T) key shifts, (B*H, T) the rows' running max, (B*H,) the initial state's
        T, F, D, eps,
        BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
        BF16: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """y for one chunk and value block: A = q k^T e^(c_s - m_t) (s <= t), y = (A v + q S r) / (rowsum(A) +
        q.z r + eps), r_t = e^(M_{j-1} - m_t); program = (chunk, bh, value block), A and q S accumulated over
        feature blocks."""
        i_bh, i_d = tl.program_id(1).to(tl.int64), tl.program_id(2)
        rows, mask_t, m_prev, _, st = _chunk(T, M, M0, i_bh, BLOCK_T)
        offs_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        Q, K, H, HZ = Q + i_bh * T * F, K + i_bh * T * F, H + st * F * D, HZ + st * F

        A = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)
        qS = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        qz = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for f0 in range(0, F, BLOCK_F):
            offs_f = f0 + tl.arange(0, BLOCK_F)
            mask_f = offs_f < F
            q = _tile(Q, rows, offs_f, F, 1, mask_t, mask_f)                          # (BT, BF)
            A += _dot(q, _tile(K, offs_f, rows, 1, F, mask_f, mask_t), BF16, PRECISION)  # (BT, BT) q k^T
            qS += _dot(q, _tile(H, offs_f, offs_d, D, 1, mask_f, mask_d), BF16, PRECISION)  # (BT, BD)
            qz += tl.sum(q.to(tl.float32) * tl.load(HZ + offs_f, mask=mask_f, other=0.)[None, :], axis=1)

        c = tl.load(C + i_bh * T + rows, mask=mask_t, other=-1e30)                   # (BT,) key shifts
        m = tl.load(M + i_bh * T + rows, mask=mask_t, other=1e30)                    # (BT,) rows' running max
        causal = rows[:, None] >= rows[None, :]
        A = tl.where(causal, A * tl.exp(tl.minimum(c[None, :] - m[:, None], 0.)), 0.)
        r = tl.exp(m_prev - m)                                                       # (BT,) state -> row units
        v = _tile(V + i_bh * T * D, rows, offs_d, D, 1, mask_t, mask_d)              # (BT, BD)
        num = _dot(A, v, BF16, PRECISION) + qS * r[:, None]
        den = tl.sum(A, axis=1) + qz * r + eps                                       # (BT,) fp32
        rden = (den > 0).to(tl.float32) / tl.where(den > 0, den, 1.)                 # 0 / 0 -> 0
        tl.store(Y + i_bh * T * D + rows[:, None] * D + offs_d[None, :], (num * rden[:, None]).to(Y.dtype.element_ty),
                 mask=mask_t[:, None] & mask_d[None, :])
        if i_d == 0:
            tl.store(RDEN + i_bh * T + rows, rden, mask=mask_t)

    @triton.jit
    def _bwd_dqk_kernel(
        Q, K, V, DY, RDEN, DELTA,  # (B*H, T, F), (B*H, T, F), (B*H, T, D), (B*H, T, D), (B*H, T), (B*H, T)
        H, HZ, DH, DHZ,            # states before each chunk (forward) and gradients after it (REVERSE pass)
        C, M, M0,                  # key shifts, rows' running max, the initial state's (as the forward)
        DQ, DK,                    # (B*H, T, F) out, in phi_q's and phi_k's dtype
        T, F, D,
        BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
        BF16: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """dq = G k + (g S^T + r z) e^(M_{j-1} - m_t), dk^T = q^T G + (dS v^T + dz) e^(c_s - M_j) for one chunk and
        feature block, G_ts = (g_t . v_s + r_t) e^(c_s - m_t) (s <= t); program = (chunk, bh, feature block), G and
        the state terms accumulated over value blocks."""
        i_bh, i_f = tl.program_id(1).to(tl.int64), tl.program_id(2)
        rows, mask_t, m_prev, m_last, st = _chunk(T, M, M0, i_bh, BLOCK_T)
        offs_f = i_f * BLOCK_F + tl.arange(0, BLOCK_F)
        mask_f = offs_f < F
        V, DY, H, DH = V + i_bh * T * D, DY + i_bh * T * D, H + st * F * D, DH + st * F * D

        G = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)                         # dy v^T
        dq = tl.zeros((BLOCK_T, BLOCK_F), dtype=tl.float32)                        # dy S^T
        dkT = tl.zeros((BLOCK_F, BLOCK_T), dtype=tl.float32)                       # dS v^T
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < D
            dy = _tile(DY, rows, offs_d, D, 1, mask_t, mask_d)                     # (BT, BD)
            vT = _tile(V, offs_d, rows, 1, D, mask_d, mask_t)                      # (BD, BT)
            G += _dot(dy, vT, BF16, PRECISION)
            dq += _dot(dy, _tile(H, offs_d, offs_f, 1, D, mask_d, mask_f), BF16, PRECISION)   # S^T (BD, BF)
            dkT += _dot(_tile(DH, offs_f, offs_d, D, 1, mask_f, mask_d), vT, BF16, PRECISION)  # dS (BF, BD)

        rden = tl.load(RDEN + i_bh * T + rows, mask=mask_t, other=0.)              # (BT,)
        r = -tl.load(DELTA + i_bh * T + rows, mask=mask_t, other=0.) * rden        # (BT,) dL/dden
        c = tl.load(C + i_bh * T + rows, mask=mask_t, other=-1e30)
        m = tl.load(M + i_bh * T + rows, mask=mask_t, other=1e30)
        causal = rows[:, None] >= rows[None, :]
        G = tl.where(causal, (G * rden[:, None] + r[:, None]) * tl.exp(tl.minimum(c[None, :] - m[:, None], 0.)), 0.)
        z = tl.load(HZ + st * F + offs_f, mask=mask_f, other=0.)
        k = _tile(K + i_bh * T * F, rows, offs_f, F, 1, mask_t, mask_f)           # (BT, BF)
        dq = _dot(G, k, BF16, PRECISION) + (dq * rden[:, None] + r[:, None] * z[None, :]) * \
            tl.exp(m_prev - m)[:, None]
        tl.store(DQ + i_bh * T * F + rows[:, None] * F + offs_f[None, :], dq.to(DQ.dtype.element_ty),
                 mask=mask_t[:, None] & mask_f[None, :])
        dz = tl.load(DHZ + st * F + offs_f, mask=mask_f, other=0.)
        qT = _tile(Q + i_bh * T * F, offs_f, rows, 1, F, mask_f, mask_t)          # (BF, BT)
        dkT = _dot(qT, G, BF16, PRECISION) + (dkT + dz[:, None]) * tl.exp(c - m_last)[None, :]
        tl.store(DK + i_bh * T * F + rows[None, :] * F + offs_f[:, None], dkT.to(DK.dtype.element_ty),
                 mask=mask_f[:, None] & mask_t[None, :])

    @triton.jit
    def _bwd_dv_kernel(
        Q, K, DY, RDEN,       # (B*H, T, F), (B*H, T, F), (B*H, T, D), (B*H, T)
        DH,                   # (B*H, NT, F, D): the state gradient after each chunk (REVERSE pass)
        C, M, M0,             # key shifts, rows' running max, the initial state's (as the forward)
        DV,                   # (B*H, T, D) out, in v's dtype
        T, F, D,
        BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
        BF16: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """dv = P^T g + k dS e^(c_s - M_j) for one chunk and value block, P^T_st = k_s . q_t e^(c_s - m_t) (s <= t);
        program = (chunk, bh, value block), P^T and k dS accumulated over feature blocks."""
        i_bh, i_d = tl.program_id(1).to(tl.int64), tl.program_id(2)
        rows, mask_t, _, m_last, st = _chunk(T, M, M0, i_bh, BLOCK_T)
        offs_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        Q, K, DH = Q + i_bh * T * F, K + i_bh * T * F, DH + st * F * D

        PT = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)                        # k q^T (s, t)
        kdS = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        for f0 in range(0, F, BLOCK_F):
            offs_f = f0 + tl.arange(0, BLOCK_F)
            mask_f = offs_f < F
            k = _tile(K, rows, offs_f, F, 1, mask_t, mask_f)                       # (BT, BF)
            PT += _dot(k, _tile(Q, offs_f, rows, 1, F, mask_f, mask_t), BF16, PRECISION)
            kdS += _dot(k, _tile(DH, offs_f, offs_d, D, 1, mask_f, mask_d), BF16, PRECISION)

        c = tl.load(C + i_bh * T + rows, mask=mask_t, other=-1e30)
        m = tl.load(M + i_bh * T + rows, mask=mask_t, other=1e30)
        anticausal = rows[:, None] <= rows[None, :]                                # (BT_s, BT_t) s <= t
        PT = tl.where(anticausal, PT * tl.exp(tl.minimum(c[:, None] - m[None, :], 0.)), 0.)
        rden = tl.load(RDEN + i_bh * T + rows, mask=mask_t, other=0.)
        g = _tile(DY + i_bh * T * D, rows, offs_d, D, 1, mask_t, mask_d).to(tl.float32) * rden[:, None]  # (BT, BD)
        dv = _dot(PT, g, BF16, PRECISION) + kdS * tl.exp(c - m_last)[:, None]
        tl.store(DV + i_bh * T * D + rows[:, None] * D + offs_d[None, :], dv.to(DV.dtype.element_ty),
                 mask=mask_t[:, None] & mask_d[None, :])

# ---- launch and autograd ----------------------------------------------------
# (BLOCK_F, BLOCK_D, num_warps) of the sequential passes, of 'fwd out' and 'bwd dv', of 'bwd dqk', by the operands'
# form: large blocks that compile with no spill for sm_80 and sm_90 with registers to spare (tests/
# test_kernels_compile.py); fp32 operands take twice the registers and shared memory of bf16 ones, and 'ieee' products
# (FMA, no tensor cores) hold whole rows of their operands.
BLOCKS = {'bf16': ((32, 32, 4), (64, 64, 8), (64, 64, 8)), 'tf32': ((32, 32, 4), (32, 32, 8), (64, 32, 8)),
          'ieee': ((16, 16, 8), (32, 32, 8), (32, 32, 8)),
          'interpreter': ((64, 64, 4), (64, 64, 4), (64, 64, 4))}   # few programs: it runs them one at a time

def _launches(BH, T, F, D, chunk, cfg):
    """Every launch, name -> (kernel, grid, meta: blocks, num_warps, cfg (BF16, PRECISION)). The backward runs
    'fwd state' again (the states are recomputed, not saved), then the other three 'bwd' launches."""
    p2 = lambda b, n: max(16, min(b, triton.next_power_of_2(n)))   # noqa: E731
    (sf, sd, sw), (bf, bd, bw), (qf, qd, qw) = ((p2(f, F), p2(d, D), w) for f, d, w in
                                                BLOCKS['interpreter' if INTERPRET else 'bf16' if cfg['BF16'] else
                                                       cfg['PRECISION']])
    meta = lambda f, d, w: dict(BLOCK_T=chunk, BLOCK_F=f, BLOCK_D=d, num_warps=w, **cfg)   # noqa: E731
    nt, seq_grid = triton.cdiv(T, chunk), (BH, triton.cdiv(F, sf), triton.cdiv(D, sd))
    return {'fwd state': (_state_kernel, seq_grid, dict(REVERSE=False, **meta(sf, sd, sw))),
            'fwd out': (_fwd_kernel, (nt, BH, triton.cdiv(D, bd)), meta(bf, bd, bw)),
            'bwd dstate': (_state_kernel, seq_grid, dict(REVERSE=True, **meta(sf, sd, sw))),
            'bwd dqk': (_bwd_dqk_kernel, (nt, BH, triton.cdiv(F, qf)), meta(qf, qd, qw)),
            'bwd dv': (_bwd_dv_kernel, (nt, BH, triton.cdiv(D, bd)), meta(bf, bd, bw))}

def _cfg(dtype, tf32):
    """The operands' form: bf16 (tensor cores), or fp32 multiplies in 'tf32' or 'ieee' (see Precision)."""
    return dict(BF16=dtype == torch.bfloat16 and not INTERPRET,   # the interpreter's bf16 tl.dot is wrong
                PRECISION='ieee' if INTERPRET or (dtype == torch.float32 and not tf32) else 'tf32')

def _run(launch, *args, **flags):
    (kernel, grid, meta) = launch
    kernel[grid](*args, **meta, **flags)

def _states(x, T, F, D, chunk, cfg):
    """Empty per-chunk states (B*H, NT, F, D), bf16 for bf16 operands, else fp32, and their z (B*H, NT, F) fp32."""
    nt, dt = triton.cdiv(T, chunk), torch.bfloat16 if cfg['BF16'] else torch.float32
    return x.new_empty(x.shape[0], nt, F, D, dtype=dt), x.new_empty(x.shape[0], nt, F, dtype=torch.float32)

def _fwd(q, k, v, S0, z0, cm, eps, store_state, chunk, cfg):
    """q, k (BH, T, F), v (BH, T, D) contiguous, one dtype; cm: the shifts (c, m (BH, T), m0 (BH,)) fp32. Returns
    y (BH, T, D), rden (BH, T), (S_T, z_T) or None."""
    (BH, T, F), D = q.shape, v.shape[-1]
    L, (H, HZ) = _launches(BH, T, F, D, chunk, cfg), _states(q, T, F, D, chunk, cfg)
    y, rden = torch.empty_like(v), q.new_empty(BH, T, dtype=torch.float32)
    ST, zT = (q.new_empty(BH, F, D, dtype=torch.float32), q.new_empty(BH, F, dtype=torch.float32)) \
        if store_state else (rden, rden)
    _run(L['fwd state'], k, v, *cm, rden, rden, H, HZ, rden if S0 is None else S0, rden if z0 is None else z0, ST,
         zT, T, F, D, HAS_INIT=S0 is not None, STORE_FINAL=store_state)
    _run(L['fwd out'], q, k, v, y, rden, H, HZ, *cm, T, F, D, float(eps))
    return y, rden, (ST, zT) if store_state else None

def _bwd(q, k, v, y, rden, S0, z0, cm, dy, dST, dzT, need_dinit, chunk, cfg, dtypes):
    """All (BH, ..) contiguous. Returns dq, dk (BH, T, F), dv (BH, T, D) in dtypes, dS0, dz0 (or None) fp32."""
    (BH, T, F), D = q.shape, v.shape[-1]
    delta = (dy.float() * y.float()).sum(-1)                               # (BH, T) dy_t . y_t
    L, (H, HZ), (DH, DHZ) = _launches(BH, T, F, D, chunk, cfg), *(_states(q, T, F, D, chunk, cfg) for _ in range(2))
    dq, dk, dv = (q.new_empty(BH, T, n, dtype=dt) for n, dt in zip((F, F, D), dtypes))
    dS0, dz0 = (q.new_empty(BH, F, D, dtype=torch.float32), q.new_empty(BH, F, dtype=torch.float32)) \
        if need_dinit else (delta, delta)
    _run(L['fwd state'], k, v, *cm, rden, delta, H, HZ, delta if S0 is None else S0, delta if z0 is None else z0,
         delta, delta, T, F, D, HAS_INIT=S0 is not None, STORE_FINAL=False)
    _run(L['bwd dstate'], q, dy, *cm, rden, delta, DH, DHZ, delta if dST is None else dST,
         delta if dzT is None else dzT, dS0, dz0, T, F, D, HAS_INIT=dST is not None, STORE_FINAL=need_dinit)
    _run(L['bwd dqk'], q, k, v, dy, rden, delta, H, HZ, DH, DHZ, *cm, dq, dk, T, F, D)
    _run(L['bwd dv'], q, k, dy, rden, DH, *cm, dv, T, F, D)
    return dq, dk, dv, (dS0, dz0) if need_dinit else (None, None)

class CausalLinearAttention(torch.autograd.Function):
    """apply(phi_q, phi_k, v, S0, z0, c, m0, eps, return_state, chunk_size, allow_tf32) -> y or (y, S_T, z_T, m_T);
    c (B, H, T), m0 (B, H): key shifts and the initial state's units (not differentiated)."""

    @staticmethod
    def forward(ctx, phi_q, phi_k, v, S0, z0, c, m0, eps, return_state, chunk_size, allow_tf32):
        (B, H, T, F), D = phi_q.shape, v.shape[-1]
        dts = (phi_q.dtype, phi_k.dtype, v.dtype)   # bf16 if one is bf16, else promoted (see Precision)
        dtype = torch.bfloat16 if torch.bfloat16 in dts else functools.reduce(torch.promote_types, dts)
        cfg = _cfg(dtype, torch.backends.cuda.matmul.allow_tf32 if allow_tf32 is None else allow_tf32)
        q, k, vv = (x.to(dtype).reshape(B * H, T, -1).contiguous() for x in (phi_q, phi_k, v))
        if S0 is not None:
            S0, z0 = S0.float().reshape(B * H, F, D).contiguous(), z0.float().reshape(B * H, F).contiguous()
        c, m0 = c.float().reshape(B * H, T).contiguous(), m0.float().reshape(B * H).contiguous()
        m = torch.maximum(c.cummax(-1).values, m0[:, None]).contiguous()   # (BH, T) the rows' running max
        y, rden, state = _fwd(q, k, vv, S0, z0, (c, m, m0), eps, return_state, chunk_size, cfg)
        ctx.save_for_backward(q, k, vv, y, rden, S0, z0, c, m, m0)
        ctx.cfg, ctx.dtypes = (B, H, T, F, D, chunk_size, cfg), dts
        y = y.reshape(B, H, T, D).to(v.dtype)
        if not return_state:
            return y
        mT = m[:, -1].reshape(B, H)
        ctx.mark_non_differentiable(mT)
        return y, state[0].reshape(B, H, F, D), state[1].reshape(B, H, F), mT

    @staticmethod
    def backward(ctx, dy, dST=None, dzT=None, dmT=None):
        q, k, vv, y, rden, S0, z0, c, m, m0 = ctx.saved_tensors
        B, H, T, F, D, chunk, cfg = ctx.cfg
        dy = torch.zeros_like(vv) if dy is None else dy.to(vv.dtype).reshape(B * H, T, D).contiguous()
        if dST is not None or dzT is not None:   # the one of the two not used downstream: zeros
            dST, dzT = (q.new_zeros(B * H, *n, dtype=torch.float32) if g is None else
                        g.float().reshape(B * H, *n).contiguous() for g, n in ((dST, (F, D)), (dzT, (F,))))
        need_dinit = S0 is not None and (ctx.needs_input_grad[3] or ctx.needs_input_grad[4])
        with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
            dq, dk, dv, (dS0, dz0) = _bwd(q, k, vv, y, rden, S0, z0, (c, m, m0), dy, dST, dzT, need_dinit, chunk, cfg,
                                          ctx.dtypes)
        grads = [g.reshape(B, H, T, -1) for g in (dq, dk, dv)]
        if need_dinit:
            dS0, dz0 = dS0.reshape(B, H, F, D), dz0.reshape(B, H, F)
        return (*grads, dS0, dz0, None, None, None, None, None, None)

def supports(F, D):
    """Whether the kernel handles feature dimension F and value dimension D (Taylor's 1 + D + D^2 does not)."""
    return F <= MAX_FEATURE_DIM and D <= MAX_HEAD_DIM

def triton_available(x):
    """True when the kernel can run on tensor x: CUDA, or CPU under TRITON_INTERPRET=1 (set before import)."""
    return HAS_TRITON and (x.is_cuda or (INTERPRET and x.device.type == 'cpu'))

@torch.compiler.disable   # torch.compile: a graph break here rather than tracing into the launches
def causal_linear_attention(phi_q, phi_k, v, eps=0.0, initial_state=None, return_state=False, chunk_size=None,
                            allow_tf32=None, c_k=None):
    """The Triton kernel, differentiable: phi_q, phi_k (B, H, T, F), v (B, H, T, D), F <= 256, D <= 128 -> y (B, H,
    T, D) in v.dtype, or (y, (S, z)) with S (B, H, F, D), z (B, H, F) fp32; with key shifts c_k (B, H, T) (or an
    initial state (S, z, m)) the state is (S, z, m). chunk_size: BLOCK_T (default 64, 32 when F > 128); allow_tf32:
    fp32 inputs only (default: torch's flag)."""
    if not triton_available(v):
        raise RuntimeError(f"the Triton kernel needs triton and CUDA tensors (or TRITON_INTERPRET=1 set before "
                           f"importing kernels), got {'no triton' if not HAS_TRITON else v.device.type + ' tensors'}")
    if phi_q.dim() != 4 or phi_q.shape != phi_k.shape or v.shape[:3] != phi_q.shape[:3]:
        raise ValueError(f"expected phi_q, phi_k (B, H, T, F), v (B, H, T, D); got {tuple(phi_q.shape)}, "
                         f"{tuple(phi_k.shape)}, {tuple(v.shape)}")
    chunk_size = chunk_size or DEFAULT_CHUNK
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16, got {chunk_size}")
    shifted = c_k is not None or (initial_state is not None and len(initial_state) > 2)
    S0, z0, *m0 = (None, None) if initial_state is None else initial_state
    m0 = m0[0] if m0 else phi_q.new_full(phi_q.shape[:2], NO_KEY if S0 is None else 0.)   # the state's units
    c = phi_q.new_zeros(phi_q.shape[:3]) if c_k is None else c_k
    with torch.cuda.device(v.device) if v.is_cuda else contextlib.nullcontext():   # launch on v's GPU
        out = CausalLinearAttention.apply(phi_q, phi_k, v, S0, z0, c.detach(), m0.detach(), eps, bool(return_state),
                                          int(chunk_size), allow_tf32)
    return (out[0], out[1:] if shifted else out[1:3]) if return_state else out

# ---- the static estimate (python kernels.py --plan) ------------------------------------------------------------
HBM, PEAK, SMS = 3.35e12, 989e12, 132   # an H100 SXM: bytes/s, bf16 dense tensor-core FLOP/s, SMs

def _plan(B, H, T, F, D, chunk=DEFAULT_CHUNK):
    """name -> (grid, bytes, FLOPs) of every launch with bf16 operands: every tile a program loads or stores, once
    (no cache reuse assumed); the tl.dot FLOPs at full chunks (the masked halves of the (BT, BT) blocks included)."""
    BH, C, L = B * H, chunk, _launches(B * H, T, F, D, chunk, dict(BF16=True, PRECISION='tf32'))
    x, rows, nt = BH * T * 2, BH * T * 4, BH * triton.cdiv(T, C)   # bytes: a bf16 column, an fp32 one; chunks
    hz = lambda n_z: nt * (2 * F * D + 4 * F * n_z)   # noqa: E731  bf16 states (F, D), their z (F,) read n_z times
    (fs, ds), n = L['fwd state'][1][1:], {name: grid[2] for name, (_, grid, _) in L.items()}
    cost = {'fwd state': (x * (ds * F + fs * D) + hz(1) + rows * fs * ds, 2 * BH * T * F * D),
            'fwd out': (x * (2 * F * n['fwd out'] + 2 * D) + hz(n['fwd out']) + rows * (2 * n['fwd out'] + 1),
                        2 * BH * T * (C * F * n['fwd out'] + F * D + C * D)),
            'bwd dstate': (x * (ds * F + fs * D) + hz(1) + 3 * rows * fs * ds, 2 * BH * T * F * D),
            'bwd dqk': (x * (2 * D * n['bwd dqk'] + 4 * F) + 2 * hz(1) + 4 * rows * n['bwd dqk'],
                        2 * BH * T * (C * D * n['bwd dqk'] + 2 * D * F + 2 * C * F)),
            'bwd dv': (x * (2 * F * n['bwd dv'] + 2 * D) + hz(0) + 3 * rows * n['bwd dv'],
                       2 * BH * T * (C * F * n['bwd dv'] + F * D + C * D))}
    return {name: (L[name][1], *cost[name]) for name in L}

PLAN_NOTE = """\
Each launch takes max(bytes / 3.35 TB/s, FLOPs / 989 TFLOP/s), an H100 SXM's HBM3 and bf16 dense tensor-core
peaks, divided by min(1, programs / 132 SMs). Bytes: every tile each program loads or stores, once per program (no
cache reuse); FLOPs: its tl.dot products at full tiles. The backward runs 'fwd state' again. Not counted: the PyTorch
glue (the running max, dy.y, reshapes) and launch overheads. SDPA: 2 B H T^2 D FLOPs forward (causal), 2.5x that
backward (FlashAttention-2's count), at 989 TFLOP/s: a time it cannot beat. This is the figure a GPU run of
"""

def _print_plan(B, H, Ts, F, D):
    """python kernels.py --plan: every launch's grid, bytes, FLOPs and time at each T, then fwd and fwd+bwd vs SDPA."""
    print(f'python kernels.py --plan: a static estimate, not a measurement; B={B} H={H} F={F} D={D}, bf16 operands, '
          f'BLOCK_T={DEFAULT_CHUNK}.\n' + PLAN_NOTE + f'`python kernels.py --B {B} --F {F} --D {D} --T ...` is to be '
          'checked against.\n')
    print(f'{"T":>6}  {"launch":<11}{"grid":<16}{"MB":>9}{"GFLOP":>9}{"us":>9}')
    rows = []
    for T in Ts:
        plan, us = _plan(B, H, T, F, D), {}
        for name, (grid, nbytes, flops) in plan.items():
            us[name] = max(nbytes / HBM, flops / PEAK) / min(1., grid[0] * grid[1] * grid[2] / SMS) * 1e6   # roofline
            print(f'{T:>6}  {name:<11}{str(grid):<16}{nbytes / 1e6:>9.1f}{flops / 1e9:>9.2f}{us[name]:>9.1f}')
        fwd, sdpa = us['fwd state'] + us['fwd out'], 2 * B * H * T * T * D / PEAK * 1e6
        rows.append((T, fwd, sdpa, fwd + sum(v for k, v in us.items() if k != 'fwd out'), 3.5 * sdpa))
    print(f'\n{"T":>6} {"fwd us":>9} {"SDPA fwd":>9} {"ratio":>6} {"fwd+bwd":>9} {"SDPA f+b":>9} {"ratio":>6}')
    for T, f, s, fb, sfb in rows:
        print(f'{T:>6} {f:>9.1f} {s:>9.1f} {s / f:>5.1f}x {fb:>9.1f} {sfb:>9.1f} {sfb / fb:>5.1f}x')

if __name__ == '__main__':  # python kernels.py [--plan] [--T 1024,4096] [--B 4] [--dtype bfloat16] [--F 128] [--D 64]
    import argparse
    p = argparse.ArgumentParser(description='Time the kernel against its naive reference and torch SDPA (CUDA), or '
                                            'print its static estimate (--plan, no GPU needed).')
    p.add_argument('--plan', action='store_true', help="print each launch's grid, bytes, FLOPs (bf16) and the time "
                   "they imply on an H100, beside SDPA's (T default 1K..64K); no GPU needed")
    p.add_argument('--T', default=None, help='comma-separated sequence lengths (default 1024,4096,16384)')
    p.add_argument('--B', type=int, default=4, help='batch size (12 heads)')
    p.add_argument('--dtype', default='bfloat16', choices=['float32', 'bfloat16', 'float16'])
    p.add_argument('--F', type=int, default=128, help='feature dimension (the kernel: F <= 256)')
    p.add_argument('--D', type=int, default=64, help='head dimension (the kernel: D <= 128)')
    a = p.parse_args()
    if a.plan:
        Ts = [int(t) for t in (a.T or ','.join(str(1024 << i) for i in range(7))).split(',')]   # 1K..64K
        raise SystemExit(_print_plan(a.B, 12, Ts, a.F, a.D) if HAS_TRITON else 'kernels.py --plan needs triton')
    if not (HAS_TRITON and torch.cuda.is_available()):
        raise SystemExit('kernels.py: the benchmark needs triton and a CUDA GPU (tests/test_kernels.py: on CPU)')
    B, H, dt = a.B, 12, getattr(torch, a.dtype)
    import importlib.util
    fla = importlib.util.find_spec('fla') and importlib.import_module('fla.ops.linear_attn').chunk_linear_attn
    print(f'B={B} H={H} F={a.F} D={a.D} {a.dtype}: median ms (triton.testing.do_bench), fwd / fwd+bwd' +
          ('; fla: flash-linear-attention chunk_linear_attn(normalize=True), its (B, T, H, .) layout made untimed'
           if fla else ' (pip install flash-linear-attention adds its chunk_linear_attn)'))
    print(f'{"T":>6} {"kernel":>16} {"reference":>16} {"sdpa":>16}' + f' {"fla":>16} {"kernel vs fla":>13}' * bool(fla))
    for T in map(int, (a.T or '1024,4096,16384').split(',')):
        x = [torch.randn(B, H, T, a.D, device='cuda', dtype=dt, requires_grad=True) for _ in range(3)]
        pq, pk = (torch.rand(B, H, T, a.F, device='cuda', dtype=dt, requires_grad=True) for _ in range(2))
        fns = {'kernel': lambda: causal_linear_attention(pq, pk, x[2]),
               'reference': lambda: causal_linear_attention_reference(pq, pk, x[2]),
               'sdpa': lambda: torch.nn.functional.scaled_dot_product_attention(*x, is_causal=True)}
        if fla:   # (B, T, H, .) leaves; scale 1: phi_q and phi_k are already the features
            qkv = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (pq, pk, x[2])]
            fns['fla'] = lambda: fla(*qkv, scale=1.0, normalize=True)[0]
        cells = []
        for fn in fns.values():
            try:
                cells.append('{:7.2f} / {:7.2f}'.format(triton.testing.do_bench(fn),
                                                        triton.testing.do_bench(lambda: fn().sum().backward())))
            except torch.OutOfMemoryError:
                cells.append('out of memory')
            torch.cuda.empty_cache()
        if fla:   # relative difference of the outputs, fp32 norms
            y, yf = fns['kernel']().float(), fns['fla']().transpose(1, 2).float()
            cells.append(f'{((y - yf).norm() / y.norm()).item():.1e}')
        print(f'{T:>6} ' + ' '.join(f'{c:>16}' for c in cells))
