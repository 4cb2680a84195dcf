"""
Causal linear attention in Triton: the naive reference, four kernels, the autograd wrapper, a CUDA benchmark.

What it computes. Given feature-mapped queries and keys phi_q, phi_k (B, H, T, F) and values v (B, H, T, D):

    y_t = phi_q_t^T S_t / (phi_q_t^T z_t + eps),   S_t = S_0 + sum_{s<=t} phi_k_s v_s^T   (F, D)
                                                   z_t = z_0 + sum_{s<=t} phi_k_s         (F,)

(0 where the denominator is 0) from an optional initial state (S_0, z_0), optionally returning the final state
(prefill, then decode). Key shifts c (B, H, T), optional: the keys are phi_k_s exp(c_s), and row t is computed in
units of exp(-m_t), m_t = max(m_0, c_1..c_t) (a running max, as online softmax), so every factor exp(c_s - m_t) is
<= 1 whatever the keys' scale; the state (S, z, m) is then in units of exp(-m). `causal_linear_attention_reference`
computes it from the definition, quadratic in T.

Forward (chunked, like the Triton tutorials' flash attention, with a carried state instead of a softmax).
Time is cut into chunks of BLOCK_T rows (64; 32 when F > 128). One program owns one (batch, head) and one
block of the value dimension (F is never split, so every program sees whole dot products). Per chunk:

    A    = q k^T, masked to s <= t                    (BLOCK_T, BLOCK_T)  fp32 accumulation
    num  = A v + q S                                  (BLOCK_T, BLOCK_D)  intra-chunk + inter-chunk
    den  = rowsum(A) + q . z                          (BLOCK_T,)          fp32, in the same kernel
    y    = num / (den + eps)
    S   += k^T v ;  z += colsum(k)                    state in fp32 registers, never written to memory
With shifts, A_ts carries exp(c_s - m_t), the state's terms exp(M - m_t) (M: m before the chunk), and the state
moves to the chunk's last m before its keys, weighted exp(c_s - m), are added.

The denominator comes from the same A and z, not from a separate pass (where published kernels had
silent gradient bugs).

Backward. With P_ts = q_t . k_s (s <= t), rden_t = 1 / (den_t + eps) (saved) and delta_t = dy_t . y_t:
    g_t = dL/dnum_t = dy_t rden_t,   r_t = dL/dden_t = -delta_t rden_t,   G_ts = dL/dP_ts = g_t . v_s + r_t
    dq_t = sum_{s<=t} G_ts k_s + S_0 g_t + r_t z_0        dS_0 = dS_T + sum_t q_t g_t^T
    dk_s = sum_{t>=s} G_ts q_t + dS_T v_s + dz_T          dz_0 = dz_T + sum_t r_t q_t
    dv_s = sum_{t>=s} P_ts g_t + dS_T^T k_s
(dS_T, dz_T: the gradients arriving through the returned state; with shifts, P_ts and the state terms carry the
forward's factors, and the carried sums move between the chunks' units as in the forward.) Chunked, the sums over
earlier chunks (dq)
or later chunks (dk, dv) become a carried state. Single-pass kernels recompute what they need: dq runs forward
in time; dk and dv, one kernel launched twice (they carry the same dS), backward. Each launch splits the
dimension its contraction leaves whole. Operands needed transposed are loaded transposed by swapping the pointer
arithmetic; a tl.dot result is never transposed (a Triton miscompile on Hopper): the transposed product is
computed directly (k q^T rather than (q k^T)^T), or stored through transposed pointers.

Precision. Accumulation and state are fp32. Operands are bf16 if an input is bf16 (tensor cores; bf16 has
fp32's range), else the promoted dtype: fp32 features with fp16 values stay fp32, since exp-based features
overflow fp16 (65504 = e^11). fp32 multiplies in 'tf32' if torch.backends.cuda.matmul.allow_tf32 (or
allow_tf32=True), else 'ieee'; fp16 always in 'tf32' (exact for it).

CPU. With TRITON_INTERPRET=1 set before import, the kernels run in Triton's interpreter on CPU tensors (the
tests; bf16 operands are upcast there: the interpreter's bf16 tl.dot is wrong).
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
DEFAULT_CHUNK = 64   # BLOCK_T; 32 when F > 128 (register budget, see _blocks)
MAX_FEATURE_DIM, MAX_HEAD_DIM = 256, 128  # the sizes the register blocking is built for

def causal_linear_attention_reference(phi_q, phi_k, v, eps=0.0, initial_state=None, return_state=False, c_k=None):
    """The definition, quadratic in T: A_ts = phi_q_t . phi_k_s exp(c_s - m_t) (s <= t), y = (A v + q S_0 exp(m_0 -
    m_t)) / (rowsum(A) + q . z_0 exp(m_0 - m_t) + eps). Computes in at least fp32 (float64 stays float64); y in
    v.dtype, the state (S, z[, m]) in the compute dtype."""
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
    def _fwd_kernel(
        Q, K, V, Y,         # (B*H, T, F), (B*H, T, F), (B*H, T, D), (B*H, T, D), contiguous
        RDEN,               # (B*H, T) fp32: 1 / (den + eps), saved for the backward
        S0, Z0, ST, ZT,     # (B*H, F, D), (B*H, F) fp32 initial (if HAS_INIT) and final (if STORE_STATE) state
        C, M, M0,           # (B*H, T) key shifts, (B*H, T) the rows' running max, (B*H,) the initial state's, fp32
        T, F, D, eps, HAS_INIT: tl.constexpr, STORE_STATE: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
        BF16: tl.constexpr, PRECISION: tl.constexpr,
    ):
        i_bh, i_d = tl.program_id(0).to(tl.int64), tl.program_id(1)
        offs_t = tl.arange(0, BLOCK_T)
        offs_f = tl.arange(0, BLOCK_F)
        offs_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_f, mask_d = offs_f < F, offs_d < D
        causal = offs_t[:, None] >= offs_t[None, :]                      # (BT, BT) t >= s
        Q, K, V, Y, RDEN = Q + i_bh * T * F, K + i_bh * T * F, V + i_bh * T * D, Y + i_bh * T * D, RDEN + i_bh * T
        C, M, m_prev = C + i_bh * T, M + i_bh * T, tl.load(M0 + i_bh)   # m_prev: the state's units exp(-m_prev)

        S = tl.zeros((BLOCK_F, BLOCK_D), dtype=tl.float32)               # state S[:, d-block], fp32
        z = tl.zeros((BLOCK_F,), dtype=tl.float32)                       # normaliser state, fp32
        if HAS_INIT:
            S = _tile(S0 + i_bh * F * D, offs_f, offs_d, D, 1, mask_f, mask_d)
            z = tl.load(Z0 + i_bh * F + offs_f, mask=mask_f, other=0.)

        for t0 in range(0, T, BLOCK_T):
            rows = t0 + offs_t
            mask_t = rows < T
            q = _tile(Q, rows, offs_f, F, 1, mask_t, mask_f)                     # (BT, BF)
            kT = _tile(K, offs_f, rows, 1, F, mask_f, mask_t)                    # (BF, BT) loaded transposed
            v = _tile(V, rows, offs_d, D, 1, mask_t, mask_d)                     # (BT, BD)
            c = tl.load(C + rows, mask=mask_t, other=-1e30)                     # (BT,) key shifts
            m = tl.load(M + rows, mask=mask_t, other=1e30)                      # (BT,) rows' running max

            A = tl.where(causal, _dot(q, kT, BF16, PRECISION) * tl.exp(tl.minimum(c[None, :] - m[:, None], 0.)), 0.)
            r = tl.exp(m_prev - m)                                              # (BT,) state -> row units
            num = _dot(A, v, BF16, PRECISION) + _dot(q, S, BF16, PRECISION) * r[:, None]    # (BT, BD)
            den = tl.sum(A, axis=1) + tl.sum(q.to(tl.float32) * z[None, :], axis=1) * r + eps  # (BT,) fp32
            rden = (den > 0).to(tl.float32) / tl.where(den > 0, den, 1.)         # 0 / 0 -> 0
            tl.store(Y + rows[:, None] * D + offs_d[None, :], (num * rden[:, None]).to(Y.dtype.element_ty),
                     mask=mask_t[:, None] & mask_d[None, :])
            if i_d == 0:
                tl.store(RDEN + rows, rden, mask=mask_t)

            m_new = tl.max(tl.where(mask_t, m, -1e30), axis=0)                  # m after the chunk
            kT = kT.to(tl.float32) * tl.exp(c - m_new)[None, :]                 # keys in units exp(-m_new)
            S = S * tl.exp(m_prev - m_new) + _dot(kT, v, BF16, PRECISION)       # (BF, BD)
            z = z * tl.exp(m_prev - m_new) + tl.sum(kT, axis=1)                 # (BF,)
            m_prev = m_new

        if STORE_STATE:
            tl.store(ST + i_bh * F * D + offs_f[:, None] * D + offs_d[None, :], S,
                     mask=mask_f[:, None] & mask_d[None, :])
            if i_d == 0:
                tl.store(ZT + i_bh * F + offs_f, z, mask=mask_f)

    @triton.jit
    def _bwd_dq_kernel(
        K, V, DY, RDEN, DELTA,   # (B*H, T, F), (B*H, T, D), (B*H, T, D), (B*H, T), (B*H, T)
        S0, Z0,                  # initial state (read if HAS_INIT)
        C, M, M0,                # key shifts, rows' running max, the initial state's (as the forward)
        DQ,                      # (B*H, T, F) fp32 output
        T, F, D, HAS_INIT: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
        BF16: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """dq_t = sum_{s<=t} G_ts k_s + S_{before chunk} g_t + r_t z_{before chunk}. Forward in time; program =
        (bh, feature block), the whole value dimension in the block (BLOCK_D >= D: G contracts over it)."""
        i_bh, i_f = tl.program_id(0).to(tl.int64), tl.program_id(1)
        offs_t = tl.arange(0, BLOCK_T)
        offs_f = i_f * BLOCK_F + tl.arange(0, BLOCK_F)
        offs_d = tl.arange(0, BLOCK_D)
        mask_f, mask_d = offs_f < F, offs_d < D
        causal = offs_t[:, None] >= offs_t[None, :]                      # (BT, BT) t >= s
        K, V, DY, DQ = K + i_bh * T * F, V + i_bh * T * D, DY + i_bh * T * D, DQ + i_bh * T * F
        RDEN, DELTA = RDEN + i_bh * T, DELTA + i_bh * T
        C, M, m_prev = C + i_bh * T, M + i_bh * T, tl.load(M0 + i_bh)

        ST = tl.zeros((BLOCK_D, BLOCK_F), dtype=tl.float32)              # S^T[:, f-block] (kept transposed)
        z = tl.zeros((BLOCK_F,), dtype=tl.float32)
        if HAS_INIT:
            ST = _tile(S0 + i_bh * F * D, offs_d, offs_f, 1, D, mask_d, mask_f)
            z = tl.load(Z0 + i_bh * F + offs_f, mask=mask_f, other=0.)

        for t0 in range(0, T, BLOCK_T):
            rows = t0 + offs_t
            mask_t = rows < T
            k = _tile(K, rows, offs_f, F, 1, mask_t, mask_f)                     # (BT, BF)
            vT = _tile(V, offs_d, rows, 1, D, mask_d, mask_t)                    # (BD, BT)
            dy = _tile(DY, rows, offs_d, D, 1, mask_t, mask_d)                   # (BT, BD)
            rden = tl.load(RDEN + rows, mask=mask_t, other=0.)                  # (BT,)
            r = -tl.load(DELTA + rows, mask=mask_t, other=0.) * rden            # (BT,) dL/dden
            c = tl.load(C + rows, mask=mask_t, other=-1e30)
            m = tl.load(M + rows, mask=mask_t, other=1e30)

            # G_ts = ((dy_t . v_s) rden_t + r_t) exp(c_s - m_t); scaling after the dot keeps 1/(den+eps) out of the
            # operands
            G = tl.where(causal, (_dot(dy, vT, BF16, PRECISION) * rden[:, None] + r[:, None]) *
                         tl.exp(tl.minimum(c[None, :] - m[:, None], 0.)), 0.)  # (BT, BT)
            dq = _dot(G, k, BF16, PRECISION)                                       # (BT, BF)
            dq += (_dot(dy, ST, BF16, PRECISION) * rden[:, None] + r[:, None] * z[None, :]) * \
                tl.exp(m_prev - m)[:, None]
            tl.store(DQ + rows[:, None] * F + offs_f[None, :], dq, mask=mask_t[:, None] & mask_f[None, :])

            m_new = tl.max(tl.where(mask_t, m, -1e30), axis=0)
            k = k.to(tl.float32) * tl.exp(c - m_new)[:, None]
            ST = ST * tl.exp(m_prev - m_new) + _dot(vT, k, BF16, PRECISION)        # (BD, BF)
            z = z * tl.exp(m_prev - m_new) + tl.sum(k, axis=0)
            m_prev = m_new

    @triton.jit
    def _bwd_dkv_kernel(
        Q, K, V, DY, RDEN, DELTA,   # (B*H, T, F), (B*H, T, F), (B*H, T, D), (B*H, T, D), (B*H, T), (B*H, T)
        DST, DZT,                   # gradient of the final state (read if HAS_DSTATE)
        OUT,                        # (B*H, T, F) dk if DK else (B*H, T, D) dv, fp32 output
        DS0, DZ0,                   # gradient of the initial state (written if STORE_DINIT)
        C, M, M0,                   # key shifts, rows' running max, the initial state's (as the forward)
        T, F, D, DK: tl.constexpr, HAS_DSTATE: tl.constexpr, STORE_DINIT: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
        BF16: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """Backward in time, carrying dS_s = dS_T + sum_{t>=s} q_t g_t^T and dz_s = dz_T + sum_{t>=s} r_t q_t.
        DK: dk_s = sum_{t>=s} G_ts q_t + dS_s v_s + dz_s, program = (bh, feature block), the whole value dimension
        in the block (G contracts over it). Else dv_s = sum_{t>=s} P_ts g_t + dS_s^T k_s, program = (bh, value
        block), the whole feature dimension in the block (P contracts over it)."""
        i_bh, i_blk = tl.program_id(0).to(tl.int64), tl.program_id(1)
        offs_t = tl.arange(0, BLOCK_T)
        offs_f = (i_blk * BLOCK_F if DK else 0) + tl.arange(0, BLOCK_F)
        offs_d = (0 if DK else i_blk * BLOCK_D) + tl.arange(0, BLOCK_D)
        mask_f, mask_d = offs_f < F, offs_d < D
        causal = offs_t[:, None] >= offs_t[None, :]                      # (BT_t, BT_s) t >= s
        anticausal = offs_t[:, None] <= offs_t[None, :]                  # (BT_s, BT_t) s <= t
        Q, K, V, DY = Q + i_bh * T * F, K + i_bh * T * F, V + i_bh * T * D, DY + i_bh * T * D
        OUT, RDEN, DELTA = OUT + i_bh * T * (F if DK else D), RDEN + i_bh * T, DELTA + i_bh * T
        C, M = C + i_bh * T, M + i_bh * T

        dS = tl.zeros((BLOCK_F, BLOCK_D), dtype=tl.float32)              # dS[f-block, d-block], fp32
        dz = tl.zeros((BLOCK_F,), dtype=tl.float32)
        if HAS_DSTATE:
            dS = _tile(DST + i_bh * F * D, offs_f, offs_d, D, 1, mask_f, mask_d)
            dz = tl.load(DZT + i_bh * F + offs_f, mask=mask_f, other=0.)

        n_chunks = tl.cdiv(T, BLOCK_T)
        for i in range(0, n_chunks):
            t0 = (n_chunks - 1 - i) * BLOCK_T
            rows = t0 + offs_t
            mask_t = rows < T
            qT = _tile(Q, offs_f, rows, 1, F, mask_f, mask_t)                    # (BF, BT)
            dy = _tile(DY, rows, offs_d, D, 1, mask_t, mask_d)                   # (BT, BD)
            rden = tl.load(RDEN + rows, mask=mask_t, other=0.)                  # (BT,)
            g = dy.to(tl.float32) * rden[:, None]                                # (BT, BD) dL/dnum
            c = tl.load(C + rows, mask=mask_t, other=-1e30)
            m = tl.load(M + rows, mask=mask_t, other=1e30)
            m_j = tl.max(tl.where(mask_t, m, -1e30), axis=0)                     # the carried sums' units exp(-m_j)
            m_prev = tl.where(t0 > 0, tl.load(M + tl.maximum(t0 - 1, 0)), tl.load(M0 + i_bh))   # m before the chunk
            ks = tl.exp(c - m_j)                                                 # (BT,) the keys' factor
            if DK:  # dk^T, in the layout of the state: q^T G + (dS v^T + dz) ks, G as in the dq kernel
                vT = _tile(V, offs_d, rows, 1, D, mask_d, mask_t)                # (BD, BT)
                r = -tl.load(DELTA + rows, mask=mask_t, other=0.) * rden        # (BT,) dL/dden
                G = tl.where(causal, (_dot(dy, vT, BF16, PRECISION) * rden[:, None] + r[:, None]) *
                             tl.exp(tl.minimum(c[None, :] - m[:, None], 0.)), 0.)  # (BT, BT)
                dkT = _dot(qT, G, BF16, PRECISION) + (_dot(dS, vT, BF16, PRECISION) + dz[:, None]) * ks[None, :]
                tl.store(OUT + rows[None, :] * F + offs_f[:, None], dkT, mask=mask_f[:, None] & mask_t[None, :])
                dz = dz * tl.exp(m_prev - m_j) + tl.sum(qT.to(tl.float32) * (r * tl.exp(m_prev - m))[None, :], axis=1)
            else:
                k = _tile(K, rows, offs_f, F, 1, mask_t, mask_f)                 # (BT, BF)
                PT = tl.where(anticausal, _dot(k, qT, BF16, PRECISION) *         # (BT_s, BT_t) = P^T directly
                              tl.exp(tl.minimum(c[:, None] - m[None, :], 0.)), 0.)
                dv = _dot(PT, g, BF16, PRECISION) + _dot(k, dS, BF16, PRECISION) * ks[:, None]  # (BT, BD)
                tl.store(OUT + rows[:, None] * D + offs_d[None, :], dv, mask=mask_t[:, None] & mask_d[None, :])
            dS = dS * tl.exp(m_prev - m_j) + _dot(qT, g * tl.exp(m_prev - m)[:, None], BF16, PRECISION)  # += q^T g

        if STORE_DINIT:
            tl.store(DS0 + i_bh * F * D + offs_f[:, None] * D + offs_d[None, :], dS,
                     mask=mask_f[:, None] & mask_d[None, :])
            tl.store(DZ0 + i_bh * F + offs_f, dz, mask=mask_f)

# ---- launch and autograd ----------------------------------------------------
def _blocks(F, D, chunk):
    """(BLOCK_F, BLOCK_D) of the forward and dv launches (whole F), of the dq and dk launches (whole D), and
    num_warps: the largest blocks whose fp32 state and operands fit in registers without spilling at 8 warps
    (from ptxas resource usage for sm_90; F=128, D=64: forward/dv BLOCK_D=32, dq/dk BLOCK_F=32)."""
    BF, BD = max(16, triton.next_power_of_2(F)), max(16, triton.next_power_of_2(D))
    fwd = (BF, max(16, min(BD, 4096 // BF)))      # state (F, BLOCK_D) <= 4096 fp32
    bwd = (max(16, min(BF, 2048 // BD)), BD)      # state (D, BLOCK_F) <= 2048 fp32
    return fwd, bwd, 8 if chunk * max(BF, BD) >= 64 * 64 else 4

def _fwd(q, k, v, S0, z0, cm, eps, store_state, chunk, cfg):
    """q, k (BH, T, F), v (BH, T, D) contiguous, one dtype; cm: the shifts (c, m (BH, T), m0 (BH,)) fp32. Returns
    y (BH, T, D), rden (BH, T), S_T, z_T."""
    (BH, T, F), D = q.shape, v.shape[-1]
    (BLOCK_F, BLOCK_D), _, warps = _blocks(F, D, chunk)
    y, rden = torch.empty_like(v), q.new_empty(BH, T, dtype=torch.float32)
    ST, zT = (q.new_empty(BH, F, D, dtype=torch.float32), q.new_empty(BH, F, dtype=torch.float32)) \
        if store_state else (rden, rden)
    _fwd_kernel[(BH, triton.cdiv(D, BLOCK_D))](
        q, k, v, y, rden, rden if S0 is None else S0, rden if z0 is None else z0, ST, zT, *cm, T, F, D, float(eps),
        HAS_INIT=S0 is not None, STORE_STATE=store_state, BLOCK_T=chunk, BLOCK_F=BLOCK_F, BLOCK_D=BLOCK_D,
        num_warps=warps, **cfg)
    return y, rden, (ST, zT) if store_state else None

def _bwd(q, k, v, y, rden, S0, z0, cm, dy, dST, dzT, need_dinit, chunk, cfg):
    """All (BH, ..) contiguous. Returns dq, dk (BH, T, F), dv (BH, T, D), dS0, dz0 (or None), fp32."""
    (BH, T, F), D = q.shape, v.shape[-1]
    delta = (dy.float() * y.float()).sum(-1)                               # (BH, T) dy_t . y_t
    dq, dk, dv = (q.new_empty(BH, T, n, dtype=torch.float32) for n in (F, F, D))
    dS0, dz0 = (q.new_empty(BH, F, D, dtype=torch.float32), q.new_empty(BH, F, dtype=torch.float32)) \
        if need_dinit else (delta, delta)
    (BF_fwd, BD_fwd), (BLOCK_F, BLOCK_D), warps = _blocks(F, D, chunk)
    blocks = dict(BLOCK_T=chunk, BLOCK_F=BLOCK_F, BLOCK_D=BLOCK_D, num_warps=warps, **cfg)
    grid = (BH, triton.cdiv(F, BLOCK_F))   # dq and dk: split the features, the whole value dimension per program
    _bwd_dq_kernel[grid](k, v, dy, rden, delta, delta if S0 is None else S0, delta if z0 is None else z0, *cm, dq,
                         T, F, D, HAS_INIT=S0 is not None, **blocks)
    dstate = (delta, delta) if dST is None else (dST, dzT)
    _bwd_dkv_kernel[grid](q, k, v, dy, rden, delta, *dstate, dk, dS0, dz0, *cm, T, F, D, DK=True,
                          HAS_DSTATE=dST is not None, STORE_DINIT=need_dinit, **blocks)
    blocks.update(BLOCK_F=BF_fwd, BLOCK_D=BD_fwd)   # dv: split the values, the whole feature dimension
    _bwd_dkv_kernel[(BH, triton.cdiv(D, BD_fwd))](q, k, v, dy, rden, delta, *dstate, dv, dS0, dz0, *cm, T, F, D,
                                                  DK=False, HAS_DSTATE=dST is not None, STORE_DINIT=False, **blocks)
    return dq, dk, dv, (dS0, dz0) if need_dinit else (None, None)

class CausalLinearAttention(torch.autograd.Function):
    """apply(phi_q, phi_k, v, S0, z0, c, m0, eps, return_state, chunk_size, allow_tf32) -> y or (y, S_T, z_T, m_T);
    c (B, H, T), m0 (B, H): key shifts and the initial state's units (not differentiated)."""

    @staticmethod
    def forward(ctx, phi_q, phi_k, v, S0, z0, c, m0, eps, return_state, chunk_size, allow_tf32):
        (B, H, T, F), D = phi_q.shape, v.shape[-1]
        dts = (phi_q.dtype, phi_k.dtype, v.dtype)   # bf16 if one is bf16, else promoted (see Precision)
        dtype = torch.bfloat16 if torch.bfloat16 in dts else functools.reduce(torch.promote_types, dts)
        tf32 = torch.backends.cuda.matmul.allow_tf32 if allow_tf32 is None else allow_tf32
        cfg = dict(BF16=dtype == torch.bfloat16 and not INTERPRET,   # the interpreter's bf16 tl.dot is wrong
                   PRECISION='ieee' if INTERPRET or (dtype == torch.float32 and not tf32) else 'tf32')
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
            dq, dk, dv, (dS0, dz0) = _bwd(q, k, vv, y, rden, S0, z0, (c, m, m0), dy, dST, dzT, need_dinit, chunk, cfg)
        grads = [g.reshape(B, H, T, -1).to(dt) for g, dt in zip((dq, dk, dv), ctx.dtypes)]
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
    chunk_size = chunk_size or (DEFAULT_CHUNK if phi_q.shape[-1] <= 128 else DEFAULT_CHUNK // 2)
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

if __name__ == '__main__':  # python kernels.py [--T 1024,4096,16384] [--dtype bfloat16] [--F 128] [--D 64]: CUDA only
    import argparse
    p = argparse.ArgumentParser(description='Time the kernel against its naive reference and torch SDPA (CUDA).')
    p.add_argument('--T', default='1024,4096,16384', help='comma-separated sequence lengths')
    p.add_argument('--dtype', default='bfloat16', choices=['float32', 'bfloat16', 'float16'])
    p.add_argument('--F', type=int, default=128, help='feature dimension (the kernel: F <= 256)')
    p.add_argument('--D', type=int, default=64, help='head dimension (the kernel: D <= 128)')
    a = p.parse_args()
    if not (HAS_TRITON and torch.cuda.is_available()):
        raise SystemExit('kernels.py: the benchmark needs triton and a CUDA GPU (tests/test_kernels.py: on CPU)')
    B, H, dt = 4, 12, getattr(torch, a.dtype)
    print(f'B={B} H={H} F={a.F} D={a.D} {a.dtype}: median ms (triton.testing.do_bench), fwd / fwd+bwd')
    print(f'{"T":>6} {"kernel":>16} {"reference":>16} {"sdpa":>16}')
    for T in map(int, a.T.split(',')):
        x = [torch.randn(B, H, T, a.D, device='cuda', dtype=dt, requires_grad=True) for _ in range(3)]
        pq, pk = (torch.rand(B, H, T, a.F, device='cuda', dtype=dt, requires_grad=True) for _ in range(2))
        fns = {'kernel': lambda: causal_linear_attention(pq, pk, x[2]),
               'reference': lambda: causal_linear_attention_reference(pq, pk, x[2]),
               'sdpa': lambda: torch.nn.functional.scaled_dot_product_attention(*x, is_causal=True)}
        cells = []
        for fn in fns.values():
            try:
                cells.append('{:7.2f} / {:7.2f}'.format(triton.testing.do_bench(fn),
                                                        triton.testing.do_bench(lambda: fn().sum().backward())))
            except torch.OutOfMemoryError:
                cells.append('out of memory')
            torch.cuda.empty_cache()
        print(f'{T:>6} ' + ' '.join(f'{c:>16}' for c in cells))
