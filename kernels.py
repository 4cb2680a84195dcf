"""
Causal linear attention in Triton: forward, backward, autograd wrapper, dispatcher, reference, benchmark.

What it computes. Given feature-mapped queries/keys phi_q, phi_k (B, H, T, F) and values v (B, H, T, D):

    y_t = phi_q_t^T S_t / (phi_q_t^T z_t + eps),   S_t = S_0 + sum_{s<=t} phi_k_s v_s^T   (F, D)
                                                   z_t = z_0 + sum_{s<=t} phi_k_s         (F,)

optionally from an initial state (S_0, z_0) and returning the final state (S_T, z_T), so a prompt can be
prefilled and generation continued. Same maths as attention.linear_attention(..., causal=True).

Algorithm (chunked, as in the Triton tutorials' flash attention but with a carried state instead of a softmax).
Time is cut into chunks of BLOCK_T rows (64; 32 when F > 128). One program owns one (batch, head) and one block of the value
dimension (the value dimension is split across programs, the feature dimension never is, so every program
sees whole dot products phi_q . phi_k). For each chunk, in order:

    A    = q k^T, masked to s <= t                    (BLOCK_T, BLOCK_T)  tensor cores, fp32 accumulation
    num  = A v + q S                                  (BLOCK_T, BLOCK_D)  intra-chunk + inter-chunk
    den  = rowsum(A) + q . z                          (BLOCK_T,)          fp32, in the same kernel
    y    = num / (den + eps)
    S   += k^T v ;  z += colsum(k)                    state kept in fp32 registers, never written to memory

The denominator is computed in the kernel from the same A and the fp32 z, never as a separate cumsum pass
(separate normalisation passes are where published linear-attention kernels had silent gradient bugs).

Backward. Write P_ts = q_t . k_s (s <= t), num_t = sum_s P_ts v_s + q_t S_0, den_t = sum_s P_ts + q_t . z_0.
With rden_t = 1 / (den_t + eps) (saved by the forward, (B, H, T) fp32) and delta_t = dy_t . y_t:

    dL/dnum_t = g_t = dy_t * rden_t                   (D,)
    dL/dden_t = r_t = -delta_t * rden_t               scalar
    dL/dP_ts  = G_ts = g_t . v_s + r_t                (s <= t)

(the value is in effect augmented with a constant 1 whose "output" is the denominator), so

    dq_t = sum_{s<=t} G_ts k_s + S_0 g_t + r_t z_0
    dk_s = sum_{t>=s} G_ts q_t + dS_T v_s + dz_T
    dv_s = sum_{t>=s} P_ts g_t + dS_T^T k_s
    dS_0 = dS_T + sum_t q_t g_t^T,   dz_0 = dz_T + sum_t r_t q_t

(dS_T, dz_T: gradients arriving through the returned final state.) In chunked form the sums over earlier
(dq) or later (dk, dv) chunks become a carried state: S^T and z for dq, dS = dS_T + sum_{later t} q_t g_t^T and
dz = dz_T + sum_{later t} r_t q_t for dk and dv, so e.g. dk_s = [G^T q]_intra-chunk + dS v_s + dz.
Three kernels, each a single
pass over time that carries its state in fp32 registers (recompute, nothing per-chunk is stored, memory is
O(T) only through the inputs/outputs): dq runs forward in time and splits the feature dimension, dk runs
backward in time and splits the feature dimension (it also writes dS_0, dz_0), dv runs backward in time and
splits the value dimension. Each split is the one that keeps the kernel's contraction dimension whole.

Transposes: operands that are needed transposed (k^T, q^T, v^T, dy^T) are loaded transposed straight from
memory by swapping the pointer arithmetic; the result of a tl.dot is never transposed (a known Triton
miscompile on Hopper), the transposed product is computed directly instead (e.g. k q^T rather than (q k^T)^T).

Precision. Inputs fp32 / bf16 / fp16, accumulation and state always fp32. Mixed inputs (fp32 features from a
feature map, bf16 values under autocast) run in the half-precision dtype. Matmul operands are bf16 for bf16
inputs (tensor cores) and fp32 otherwise: 'tf32' for fp16 inputs (whose values tf32 holds exactly; this keeps
the fp32 state and the 1/(den+eps)-scaled gradients out of fp16's narrow range), and for fp32 inputs 'ieee'
unless torch.backends.cuda.matmul.allow_tf32 (or allow_tf32=True): exact, but without tensor cores on the GPU
and far slower (ptxas shows heavy spilling), so enable tf32 or use bf16 for speed. Under TRITON_INTERPRET=1 (CPU) the interpreter's tl.dot mishandles bf16 operands
(it multiplies the raw uint16 bits), so there bf16 operands are upcast to fp32 for the dot.

CPU / CI. `causal_linear_attention` uses the Triton path for CUDA tensors, and for CPU tensors when this module
was imported with TRITON_INTERPRET=1 (the tests do that); otherwise it falls back, with a one-line notice printed
once, to attention.linear_attention(..., impl='chunked'). `triton_causal_linear_attention` is the Triton path
without any fallback (attention.py calls it directly, to avoid recursion).

Benchmark: `python kernels.py --help` or `python eval.py --bench kernels` (calls `bench`).
"""

import contextlib
import os
import sys

import torch

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except Exception:  # pragma: no cover - triton missing or broken
    triton = None
    tl = None
    HAS_TRITON = False

# Decided once, at import: @triton.jit builds interpreter kernels only if the variable is set before the decorator
# runs (i.e. before this module is imported).
INTERPRET = HAS_TRITON and os.environ.get('TRITON_INTERPRET', '0') == '1'

DEFAULT_EPS = 1e-20  # as attention.EPS: only guards 0 / 0 (a tiny eps keeps small but real denominators exact)
DEFAULT_CHUNK = 64   # BLOCK_T; 32 when F > 128 (register budget, see _blocks)


# ----------------------------------------------------------------------------------------------------------------
# Reference implementations (plain PyTorch)
# ----------------------------------------------------------------------------------------------------------------

def causal_linear_attention_reference(phi_q, phi_k, v, eps=DEFAULT_EPS, initial_state=None, return_state=False):
    """Naive cumsum reference: materialises S_t for every t, (B, H, T, F, D) memory. Computes in at least fp32
    (float64 inputs stay float64), returns y in v.dtype and the state in the compute dtype."""
    dt = torch.promote_types(torch.promote_types(phi_q.dtype, v.dtype), torch.float32)
    q, k, vv = phi_q.to(dt), phi_k.to(dt), v.to(dt)
    S = torch.cumsum(k.unsqueeze(-1) * vv.unsqueeze(-2), dim=2)   # (B, H, T, F, D)
    z = torch.cumsum(k, dim=2)                                    # (B, H, T, F)
    if initial_state is not None:
        S0, z0 = initial_state
        S = S + S0.to(dt).unsqueeze(2)
        z = z + z0.to(dt).unsqueeze(2)
    num = torch.einsum('bhtf,bhtfd->bhtd', q, S)                  # (B, H, T, D)
    den = torch.einsum('bhtf,bhtf->bht', q, z)                    # (B, H, T)
    y = (num / (den.unsqueeze(-1) + eps)).to(v.dtype)
    if return_state:
        return y, (S[:, :, -1], z[:, :, -1])
    return y


def causal_linear_attention_recurrent(phi_q, phi_k, v, eps=DEFAULT_EPS, initial_state=None, return_state=False):
    """The recurrence written out token by token (slow; O(F D) memory). Used by the tests as a second opinion."""
    dt = torch.promote_types(torch.promote_types(phi_q.dtype, v.dtype), torch.float32)
    B, H, T, F = phi_q.shape
    D = v.shape[-1]
    if initial_state is None:
        S = phi_q.new_zeros(B, H, F, D, dtype=dt)
        z = phi_q.new_zeros(B, H, F, dtype=dt)
    else:
        S, z = (x.to(dt) for x in initial_state)
    ys = []
    for t in range(T):
        qt, kt, vt = phi_q[:, :, t].to(dt), phi_k[:, :, t].to(dt), v[:, :, t].to(dt)
        S = S + kt.unsqueeze(-1) * vt.unsqueeze(-2)
        z = z + kt
        num = torch.einsum('bhf,bhfd->bhd', qt, S)
        den = (qt * z).sum(-1, keepdim=True)
        ys.append(num / (den + eps))
    y = torch.stack(ys, dim=2).to(v.dtype)
    return (y, (S, z)) if return_state else y


# ----------------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _dot(a, b, BF16: tl.constexpr, PRECISION: tl.constexpr):
        """a @ b with fp32 accumulation; operands in bf16 (tensor cores) or fp32 ('ieee' or 'tf32')."""
        if BF16:
            return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
        else:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)

    @triton.jit
    def _fwd_kernel(
        Q, K, V,            # (B*H, T, F), (B*H, T, F), (B*H, T, D), contiguous
        Y,                  # (B*H, T, D) output, dtype of the compute inputs
        RDEN,               # (B*H, T) fp32: 1 / (den + eps), saved for the backward
        S0, Z0,             # (B*H, F, D), (B*H, F) fp32 initial state (read if HAS_INIT)
        ST, ZT,             # (B*H, F, D), (B*H, F) fp32 final state (written if STORE_STATE)
        T, F, D, eps,
        HAS_INIT: tl.constexpr, STORE_STATE: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
        BF16: tl.constexpr, PRECISION: tl.constexpr,
    ):
        i_bh = tl.program_id(0).to(tl.int64)
        i_d = tl.program_id(1)
        offs_t = tl.arange(0, BLOCK_T)
        offs_f = tl.arange(0, BLOCK_F)
        offs_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_f = offs_f < F
        mask_d = offs_d < D
        causal = offs_t[:, None] >= offs_t[None, :]                      # (BT, BT) t >= s
        Q += i_bh * T * F
        K += i_bh * T * F
        V += i_bh * T * D
        Y += i_bh * T * D
        RDEN += i_bh * T

        S = tl.zeros((BLOCK_F, BLOCK_D), dtype=tl.float32)               # state S[:, d-block], fp32
        z = tl.zeros((BLOCK_F,), dtype=tl.float32)                       # normaliser state, fp32
        if HAS_INIT:
            S = tl.load(S0 + i_bh * F * D + offs_f[:, None] * D + offs_d[None, :],
                        mask=mask_f[:, None] & mask_d[None, :], other=0.)
            z = tl.load(Z0 + i_bh * F + offs_f, mask=mask_f, other=0.)

        for t0 in range(0, T, BLOCK_T):
            rows = t0 + offs_t
            mask_t = rows < T
            q = tl.load(Q + rows[:, None] * F + offs_f[None, :],
                        mask=mask_t[:, None] & mask_f[None, :], other=0.)          # (BT, BF)
            kT = tl.load(K + rows[None, :] * F + offs_f[:, None],
                         mask=mask_t[None, :] & mask_f[:, None], other=0.)         # (BF, BT) loaded transposed
            v = tl.load(V + rows[:, None] * D + offs_d[None, :],
                        mask=mask_t[:, None] & mask_d[None, :], other=0.)          # (BT, BD)

            A = _dot(q, kT, BF16, PRECISION)                                       # (BT, BT) fp32
            A = tl.where(causal, A, 0.)
            num = _dot(A, v, BF16, PRECISION) + _dot(q, S, BF16, PRECISION)       # (BT, BD)
            den = tl.sum(A, axis=1) + tl.sum(q.to(tl.float32) * z[None, :], axis=1)  # (BT,) fp32
            rden = 1. / tl.where(mask_t, den + eps, 1.)                           # padded rows: 1, not 1/0
            y = num * rden[:, None]
            tl.store(Y + rows[:, None] * D + offs_d[None, :], y.to(Y.dtype.element_ty),
                     mask=mask_t[:, None] & mask_d[None, :])
            if i_d == 0:
                tl.store(RDEN + rows, rden, mask=mask_t)

            S += _dot(kT, v, BF16, PRECISION)                                      # (BF, BD)
            z += tl.sum(kT.to(tl.float32), axis=1)                                 # (BF,)

        if STORE_STATE:
            tl.store(ST + i_bh * F * D + offs_f[:, None] * D + offs_d[None, :], S,
                     mask=mask_f[:, None] & mask_d[None, :])
            if i_d == 0:
                tl.store(ZT + i_bh * F + offs_f, z, mask=mask_f)

    @triton.jit
    def _bwd_dq_kernel(
        K, V, DY, RDEN, DELTA,   # (B*H, T, F), (B*H, T, D), (B*H, T, D), (B*H, T), (B*H, T)
        S0, Z0,                  # initial state (read if HAS_INIT)
        DQ,                      # (B*H, T, F) fp32 output
        T, F, D,
        HAS_INIT: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
        BF16: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """dq_t = sum_{s<=t} G_ts k_s + S_{t'<chunk} g_t + r_t z_{t'<chunk}. Forward in time; program = (bh,
        feature block); the whole value dimension is in the block (BLOCK_D >= D) because G contracts over it."""
        i_bh = tl.program_id(0).to(tl.int64)
        i_f = tl.program_id(1)
        offs_t = tl.arange(0, BLOCK_T)
        offs_f = i_f * BLOCK_F + tl.arange(0, BLOCK_F)
        offs_d = tl.arange(0, BLOCK_D)
        mask_f = offs_f < F
        mask_d = offs_d < D
        causal = offs_t[:, None] >= offs_t[None, :]                      # (BT, BT) t >= s
        K += i_bh * T * F
        V += i_bh * T * D
        DY += i_bh * T * D
        RDEN += i_bh * T
        DELTA += i_bh * T
        DQ += i_bh * T * F

        ST = tl.zeros((BLOCK_D, BLOCK_F), dtype=tl.float32)              # S^T[:, f-block] (state kept transposed)
        z = tl.zeros((BLOCK_F,), dtype=tl.float32)
        if HAS_INIT:
            ST = tl.load(S0 + i_bh * F * D + offs_f[None, :] * D + offs_d[:, None],
                         mask=mask_f[None, :] & mask_d[:, None], other=0.)
            z = tl.load(Z0 + i_bh * F + offs_f, mask=mask_f, other=0.)

        for t0 in range(0, T, BLOCK_T):
            rows = t0 + offs_t
            mask_t = rows < T
            k = tl.load(K + rows[:, None] * F + offs_f[None, :],
                        mask=mask_t[:, None] & mask_f[None, :], other=0.)          # (BT, BF)
            vT = tl.load(V + rows[None, :] * D + offs_d[:, None],
                         mask=mask_t[None, :] & mask_d[:, None], other=0.)         # (BD, BT)
            dy = tl.load(DY + rows[:, None] * D + offs_d[None, :],
                         mask=mask_t[:, None] & mask_d[None, :], other=0.)         # (BT, BD)
            rden = tl.load(RDEN + rows, mask=mask_t, other=0.)                    # (BT,)
            r = -tl.load(DELTA + rows, mask=mask_t, other=0.) * rden              # (BT,) dL/dden

            # G_ts = (dy_t . v_s) rden_t + r_t; scaling after the dot keeps 1/(den+eps) out of the operands
            G = _dot(dy, vT, BF16, PRECISION) * rden[:, None] + r[:, None]          # (BT, BT)
            G = tl.where(causal, G, 0.)
            dq = _dot(G, k, BF16, PRECISION)                                         # (BT, BF)
            dq += _dot(dy, ST, BF16, PRECISION) * rden[:, None] + r[:, None] * z[None, :]
            tl.store(DQ + rows[:, None] * F + offs_f[None, :], dq,
                     mask=mask_t[:, None] & mask_f[None, :])

            ST += _dot(vT, k, BF16, PRECISION)                                       # (BD, BF)
            z += tl.sum(k.to(tl.float32), axis=0)

    @triton.jit
    def _bwd_dk_kernel(
        Q, V, DY, RDEN, DELTA,   # (B*H, T, F), (B*H, T, D), (B*H, T, D), (B*H, T), (B*H, T)
        DST, DZT,                # gradient of the final state (read if HAS_DSTATE)
        DK,                      # (B*H, T, F) fp32 output
        DS0, DZ0,                # gradient of the initial state (written if STORE_DINIT)
        T, F, D,
        HAS_DSTATE: tl.constexpr, STORE_DINIT: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
        BF16: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """dk_s = sum_{t>=s} G_ts q_t + dS_s v_s + dz_s. Backward in time; program = (bh, feature block),
        whole value dimension in the block."""
        i_bh = tl.program_id(0).to(tl.int64)
        i_f = tl.program_id(1)
        offs_t = tl.arange(0, BLOCK_T)
        offs_f = i_f * BLOCK_F + tl.arange(0, BLOCK_F)
        offs_d = tl.arange(0, BLOCK_D)
        mask_f = offs_f < F
        mask_d = offs_d < D
        anticausal = offs_t[:, None] <= offs_t[None, :]                  # (BT_s, BT_t) s <= t
        Q += i_bh * T * F
        V += i_bh * T * D
        DY += i_bh * T * D
        RDEN += i_bh * T
        DELTA += i_bh * T
        DK += i_bh * T * F

        dST = tl.zeros((BLOCK_D, BLOCK_F), dtype=tl.float32)             # dS^T[:, f-block], fp32
        dz = tl.zeros((BLOCK_F,), dtype=tl.float32)
        if HAS_DSTATE:
            dST = tl.load(DST + i_bh * F * D + offs_f[None, :] * D + offs_d[:, None],
                          mask=mask_f[None, :] & mask_d[:, None], other=0.)
            dz = tl.load(DZT + i_bh * F + offs_f, mask=mask_f, other=0.)

        n_chunks = tl.cdiv(T, BLOCK_T)
        for i in range(0, n_chunks):
            rows = (n_chunks - 1 - i) * BLOCK_T + offs_t
            mask_t = rows < T
            q = tl.load(Q + rows[:, None] * F + offs_f[None, :],
                        mask=mask_t[:, None] & mask_f[None, :], other=0.)          # (BT, BF)
            v = tl.load(V + rows[:, None] * D + offs_d[None, :],
                        mask=mask_t[:, None] & mask_d[None, :], other=0.)          # (BT, BD)
            dyT = tl.load(DY + rows[None, :] * D + offs_d[:, None],
                          mask=mask_t[None, :] & mask_d[:, None], other=0.)        # (BD, BT)
            rden = tl.load(RDEN + rows, mask=mask_t, other=0.)
            r = -tl.load(DELTA + rows, mask=mask_t, other=0.) * rden

            # G^T_st = (v_s . dy_t) rden_t + r_t, computed directly in (s, t) layout
            GT = _dot(v, dyT, BF16, PRECISION) * rden[None, :] + r[None, :]         # (BT_s, BT_t)
            GT = tl.where(anticausal, GT, 0.)
            dk = _dot(GT, q, BF16, PRECISION) + _dot(v, dST, BF16, PRECISION) + dz[None, :]
            tl.store(DK + rows[:, None] * F + offs_f[None, :], dk,
                     mask=mask_t[:, None] & mask_f[None, :])

            dST += _dot(dyT * rden[None, :], q, BF16, PRECISION)                    # (BD, BF) += g^T q
            dz += tl.sum(q.to(tl.float32) * r[:, None], axis=0)                      # (BF,)

        if STORE_DINIT:
            tl.store(DS0 + i_bh * F * D + offs_f[None, :] * D + offs_d[:, None], dST,
                     mask=mask_f[None, :] & mask_d[:, None])
            tl.store(DZ0 + i_bh * F + offs_f, dz, mask=mask_f)

    @triton.jit
    def _bwd_dv_kernel(
        Q, K, DY, RDEN,          # (B*H, T, F), (B*H, T, F), (B*H, T, D), (B*H, T)
        DST,                     # gradient of the final S (read if HAS_DSTATE)
        DV,                      # (B*H, T, D) fp32 output
        T, F, D,
        HAS_DSTATE: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
        BF16: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """dv_s = sum_{t>=s} P_ts g_t + dS_s^T k_s. Backward in time; program = (bh, value block), whole
        feature dimension in the block (P contracts over it)."""
        i_bh = tl.program_id(0).to(tl.int64)
        i_d = tl.program_id(1)
        offs_t = tl.arange(0, BLOCK_T)
        offs_f = tl.arange(0, BLOCK_F)
        offs_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_f = offs_f < F
        mask_d = offs_d < D
        anticausal = offs_t[:, None] <= offs_t[None, :]                  # (BT_s, BT_t) s <= t
        Q += i_bh * T * F
        K += i_bh * T * F
        DY += i_bh * T * D
        RDEN += i_bh * T
        DV += i_bh * T * D

        dS = tl.zeros((BLOCK_F, BLOCK_D), dtype=tl.float32)              # dS[:, d-block], fp32
        if HAS_DSTATE:
            dS = tl.load(DST + i_bh * F * D + offs_f[:, None] * D + offs_d[None, :],
                         mask=mask_f[:, None] & mask_d[None, :], other=0.)

        n_chunks = tl.cdiv(T, BLOCK_T)
        for i in range(0, n_chunks):
            rows = (n_chunks - 1 - i) * BLOCK_T + offs_t
            mask_t = rows < T
            k = tl.load(K + rows[:, None] * F + offs_f[None, :],
                        mask=mask_t[:, None] & mask_f[None, :], other=0.)          # (BT, BF)
            qT = tl.load(Q + rows[None, :] * F + offs_f[:, None],
                         mask=mask_t[None, :] & mask_f[:, None], other=0.)         # (BF, BT)
            dy = tl.load(DY + rows[:, None] * D + offs_d[None, :],
                         mask=mask_t[:, None] & mask_d[None, :], other=0.)         # (BT, BD)
            rden = tl.load(RDEN + rows, mask=mask_t, other=0.)
            g = dy.to(tl.float32) * rden[:, None]                                  # (BT, BD) dL/dnum

            PT = _dot(k, qT, BF16, PRECISION)                                      # (BT_s, BT_t) = P^T directly
            PT = tl.where(anticausal, PT, 0.)
            dv = _dot(PT, g, BF16, PRECISION) + _dot(k, dS, BF16, PRECISION)      # (BT, BD)
            tl.store(DV + rows[:, None] * D + offs_d[None, :], dv,
                     mask=mask_t[:, None] & mask_d[None, :])

            dS += _dot(qT, g, BF16, PRECISION)                                     # (BF, BD)


# ----------------------------------------------------------------------------------------------------------------
# Launch helpers and the autograd.Function
# ----------------------------------------------------------------------------------------------------------------

def _pow2(n, lo=16):
    return max(lo, triton.next_power_of_2(int(n)))


def _dot_config(dtype, allow_tf32=None):
    """(BF16, PRECISION) constexprs for a compute dtype (see the module docstring)."""
    if allow_tf32 is None:
        allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    bf16 = dtype == torch.bfloat16 and not INTERPRET   # the interpreter's bf16 tl.dot is broken: use fp32 there
    if dtype == torch.float32:
        precision = 'tf32' if allow_tf32 else 'ieee'
    else:
        precision = 'tf32'   # fp16 values are exact in tf32; bf16 operands ignore it
    if INTERPRET:
        precision = 'ieee'
    return bf16, precision


def _compute_dtype(*dtypes):
    """The operand dtype: a half-precision input wins (autocast style: fp32 features from a feature map with bf16
    values run with bf16 operands on tensor cores, fp32 accumulation); otherwise the promoted dtype."""
    for d in dtypes[::-1]:
        if d in (torch.bfloat16, torch.float16):
            return d
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out


def _blocks(F, D, chunk):
    """Block sizes and warps. Chosen without a GPU at hand, from ptxas resource usage for sm_90 (compiled here
    through triton.compile with a GPUTarget): the largest blocks whose fp32 state plus operands fit in registers
    without spilling at 8 warps (F=128, D=64: forward/dv BLOCK_D=32, dq/dk BLOCK_F=32). Smaller blocks also give
    more programs, which matters when B*H is small.
    Returns (BLOCK_F, BLOCK_D) for the forward and dv kernels (whole F), (BLOCK_F, BLOCK_D) for dq and dk (whole D),
    and num_warps."""
    BF_full, BD_full = _pow2(F), _pow2(D)
    fwd = (BF_full, max(16, min(BD_full, 4096 // BF_full)))      # state (F, BLOCK_D) <= 4096 fp32
    bwd = (max(16, min(BF_full, 2048 // BD_full)), BD_full)      # state (D, BLOCK_F) <= 2048 fp32
    warps = 8 if chunk * max(BF_full, BD_full) >= 64 * 64 else 4
    return fwd, bwd, warps


def _fwd(q, k, v, S0, z0, eps, store_state, chunk, bf16, precision):
    """q, k (BH, T, F), v (BH, T, D) contiguous, same dtype. Returns y (BH, T, D), rden (BH, T), S_T, z_T."""
    BH, T, F = q.shape
    D = v.shape[-1]
    (BLOCK_F, BLOCK_D), _, warps = _blocks(F, D, chunk)
    y = torch.empty_like(v)
    rden = torch.empty(BH, T, device=q.device, dtype=torch.float32)
    ST = torch.empty(BH, F, D, device=q.device, dtype=torch.float32) if store_state else rden
    zT = torch.empty(BH, F, device=q.device, dtype=torch.float32) if store_state else rden
    has_init = S0 is not None
    grid = (BH, triton.cdiv(D, BLOCK_D))
    _fwd_kernel[grid](
        q, k, v, y, rden,
        S0 if has_init else rden, z0 if has_init else rden, ST, zT,
        T, F, D, float(eps),
        HAS_INIT=has_init, STORE_STATE=store_state,
        BLOCK_T=chunk, BLOCK_F=BLOCK_F, BLOCK_D=BLOCK_D, BF16=bf16, PRECISION=precision, num_warps=warps,
    )
    return y, rden, (ST if store_state else None), (zT if store_state else None)


def _bwd(q, k, v, y, rden, S0, z0, dy, dST, dzT, need_dinit, chunk, bf16, precision):
    """All (BH, ...) contiguous. Returns dq, dk (BH, T, F) fp32, dv (BH, T, D) fp32, dS0, dz0 (fp32 or None)."""
    BH, T, F = q.shape
    D = v.shape[-1]
    dev = q.device
    delta = (dy.float() * y.float()).sum(-1)                               # (BH, T) dy_t . y_t
    dq = torch.empty(BH, T, F, device=dev, dtype=torch.float32)
    dk = torch.empty(BH, T, F, device=dev, dtype=torch.float32)
    dv = torch.empty(BH, T, D, device=dev, dtype=torch.float32)
    dS0 = torch.empty(BH, F, D, device=dev, dtype=torch.float32) if need_dinit else delta
    dz0 = torch.empty(BH, F, device=dev, dtype=torch.float32) if need_dinit else delta
    has_init = S0 is not None
    has_dstate = dST is not None
    if has_dstate and dzT is None:
        dzT = torch.zeros(BH, F, device=dev, dtype=torch.float32)

    (BF_fwd, BD_fwd), (BLOCK_F, BLOCK_D), warps = _blocks(F, D, chunk)
    # dq and dk: split the feature dimension, whole value dimension per program
    grid = (BH, triton.cdiv(F, BLOCK_F))
    _bwd_dq_kernel[grid](
        k, v, dy, rden, delta,
        S0 if has_init else delta, z0 if has_init else delta, dq,
        T, F, D, HAS_INIT=has_init,
        BLOCK_T=chunk, BLOCK_F=BLOCK_F, BLOCK_D=BLOCK_D, BF16=bf16, PRECISION=precision, num_warps=warps,
    )
    _bwd_dk_kernel[grid](
        q, v, dy, rden, delta,
        dST if has_dstate else delta, dzT if has_dstate else delta, dk, dS0, dz0,
        T, F, D, HAS_DSTATE=has_dstate, STORE_DINIT=need_dinit,
        BLOCK_T=chunk, BLOCK_F=BLOCK_F, BLOCK_D=BLOCK_D, BF16=bf16, PRECISION=precision, num_warps=warps,
    )
    # dv: split the value dimension, whole feature dimension per program (same blocks as the forward)
    _bwd_dv_kernel[(BH, triton.cdiv(D, BD_fwd))](
        q, k, dy, rden, dST if has_dstate else delta, dv,
        T, F, D, HAS_DSTATE=has_dstate,
        BLOCK_T=chunk, BLOCK_F=BF_fwd, BLOCK_D=BD_fwd, BF16=bf16, PRECISION=precision, num_warps=warps,
    )
    return dq, dk, dv, (dS0 if need_dinit else None), (dz0 if need_dinit else None)


class CausalLinearAttention(torch.autograd.Function):
    """autograd wrapper: apply(phi_q, phi_k, v, S0, z0, eps, return_state, chunk_size, allow_tf32)."""

    @staticmethod
    def forward(ctx, phi_q, phi_k, v, S0, z0, eps, return_state, chunk_size, allow_tf32):
        B, H, T, F = phi_q.shape
        D = v.shape[-1]
        dtype = _compute_dtype(phi_q.dtype, phi_k.dtype, v.dtype)
        bf16, precision = _dot_config(dtype, allow_tf32)
        q = phi_q.to(dtype).reshape(B * H, T, F).contiguous()
        k = phi_k.to(dtype).reshape(B * H, T, F).contiguous()
        vv = v.to(dtype).reshape(B * H, T, D).contiguous()
        if S0 is not None:
            S0 = S0.float().reshape(B * H, F, D).contiguous()
            z0 = z0.float().reshape(B * H, F).contiguous()
        y, rden, ST, zT = _fwd(q, k, vv, S0, z0, eps, return_state, chunk_size, bf16, precision)
        ctx.save_for_backward(q, k, vv, y, rden, S0, z0)
        ctx.cfg = (B, H, T, F, D, chunk_size, bf16, precision, phi_q.dtype, phi_k.dtype, v.dtype)
        y = y.reshape(B, H, T, D).to(v.dtype)
        if return_state:
            return y, ST.reshape(B, H, F, D), zT.reshape(B, H, F)
        return y

    @staticmethod
    def backward(ctx, dy, dST=None, dzT=None):
        q, k, vv, y, rden, S0, z0 = ctx.saved_tensors
        B, H, T, F, D, chunk, bf16, precision, q_dt, k_dt, v_dt = ctx.cfg
        if dy is None:
            dy = torch.zeros(B * H, T, D, device=q.device, dtype=vv.dtype)
        else:
            dy = dy.to(vv.dtype).reshape(B * H, T, D).contiguous()
        if dST is not None:
            dST = dST.float().reshape(B * H, F, D).contiguous()
        if dzT is not None:
            dzT = dzT.float().reshape(B * H, F).contiguous()
            if dST is None:
                dST = torch.zeros(B * H, F, D, device=q.device, dtype=torch.float32)
        need_dinit = S0 is not None and (ctx.needs_input_grad[3] or ctx.needs_input_grad[4])
        with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
            dq, dk, dv, dS0, dz0 = _bwd(q, k, vv, y, rden, S0, z0, dy, dST, dzT, need_dinit, chunk, bf16,
                                        precision)
        dq = dq.reshape(B, H, T, F).to(q_dt)
        dk = dk.reshape(B, H, T, F).to(k_dt)
        dv = dv.reshape(B, H, T, D).to(v_dt)
        if need_dinit:
            dS0 = dS0.reshape(B, H, F, D)
            dz0 = dz0.reshape(B, H, F)
        return dq, dk, dv, dS0, dz0, None, None, None, None


@torch.compiler.disable   # torch.compile: a graph break here rather than tracing into the launches
def triton_causal_linear_attention(phi_q, phi_k, v, eps=DEFAULT_EPS, initial_state=None, return_state=False,
                                   chunk_size=None, allow_tf32=None):
    """The Triton path, no fallback. phi_q, phi_k (B, H, T, F), v (B, H, T, D); F <= 256, D <= 128 recommended.
    Returns y (B, H, T, D) in v.dtype, or (y, (S, z)) with S (B, H, F, D), z (B, H, F) fp32.
    chunk_size: BLOCK_T (default 64, 32 when F > 128); allow_tf32: fp32 inputs only (default: torch's flag)."""
    if not HAS_TRITON:
        raise RuntimeError('triton is not importable')
    assert phi_q.dim() == 4 and phi_q.shape == phi_k.shape, (phi_q.shape, phi_k.shape)
    assert v.shape[:3] == phi_q.shape[:3], (v.shape, phi_q.shape)
    if chunk_size is None:
        chunk_size = DEFAULT_CHUNK if phi_q.shape[-1] <= 128 else DEFAULT_CHUNK // 2
    assert chunk_size >= 16 and chunk_size & (chunk_size - 1) == 0, 'chunk_size: a power of two >= 16'
    S0, z0 = (None, None) if initial_state is None else initial_state
    with torch.cuda.device(v.device) if v.is_cuda else contextlib.nullcontext():   # launch on v's GPU
        out = CausalLinearAttention.apply(phi_q, phi_k, v, S0, z0, eps, bool(return_state), int(chunk_size),
                                          allow_tf32)
    if return_state:
        y, S, z = out
        return y, (S, z)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Dispatcher
# ----------------------------------------------------------------------------------------------------------------

_fallback_noticed = False


MAX_FEATURE_DIM, MAX_HEAD_DIM = 256, 128   # the sizes the kernel's register blocking is built for


def supports(F, D):
    """Whether the kernel handles feature dimension F and value dimension D (Taylor's 1 + D + D^2 does not)."""
    return F <= MAX_FEATURE_DIM and D <= MAX_HEAD_DIM


def triton_available(x):
    """True when the Triton path can run on tensor x: CUDA, or CPU under TRITON_INTERPRET=1 (set before import)."""
    return HAS_TRITON and (x.is_cuda or (INTERPRET and x.device.type == 'cpu'))


def causal_linear_attention(phi_q, phi_k, v, eps=DEFAULT_EPS, initial_state=None, return_state=False):
    """Differentiable causal linear attention, (B, H, T, F) / (B, H, T, D) layout. Triton on CUDA; elsewhere the
    PyTorch chunked path attention.linear_attention(..., impl='chunked') after a one-line notice (printed once)."""
    if triton_available(v) and supports(phi_q.shape[-1], v.shape[-1]):
        return triton_causal_linear_attention(phi_q, phi_k, v, eps=eps, initial_state=initial_state,
                                              return_state=return_state)
    global _fallback_noticed
    if not _fallback_noticed:
        _fallback_noticed = True
        if not HAS_TRITON:
            why = 'triton is not importable'
        elif not triton_available(v):
            why = f'tensors on {v.device.type}'
        else:
            why = f'F={phi_q.shape[-1]}, D={v.shape[-1]} beyond the kernel\'s {MAX_FEATURE_DIM}, {MAX_HEAD_DIM}'
        print(f'kernels: Triton causal linear attention unavailable ({why}); using the PyTorch chunked path',
              file=sys.stderr)
    import attention  # lazy: attention.py imports this module lazily too
    return attention.linear_attention(phi_q, phi_k, v, causal=True, impl='chunked', eps=eps,
                                      initial_state=initial_state, return_state=return_state)


# ----------------------------------------------------------------------------------------------------------------
# Benchmark (not a test): python kernels.py --help, or python eval.py --bench kernels
# ----------------------------------------------------------------------------------------------------------------

def proc_status_bytes(key):
    """A /proc/self/status field (VmRSS, VmHWM, ...) in bytes, or None where there is no /proc."""
    try:
        with open('/proc/self/status') as f:
            for line in f:
                if line.startswith(key + ':'):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


_MALLOC_SET = False


def release_freed_memory():
    """Make freed memory go back to the OS (glibc: fixed mmap threshold, trim), so RSS follows allocations."""
    global _MALLOC_SET
    try:
        import ctypes
        libc = ctypes.CDLL('libc.so.6')
        if not _MALLOC_SET:
            libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: blocks >= 64 KiB are mmapped, freed to the OS
            _MALLOC_SET = True
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """Peak extra memory of a block: CUDA max_memory_allocated above the allocation at entry; on CPU (Linux)
    the peak resident set size (VmHWM, reset through /proc/self/clear_refs) above the RSS at entry."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == 'cuda'
        self.method = 'cuda max_memory_allocated' if self.cuda else 'VmHWM - VmRSS (clear_refs)'
        self.peak = None

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            release_freed_memory()
            try:
                with open('/proc/self/clear_refs', 'w') as f:
                    f.write('5')
                self.base = proc_status_bytes('VmRSS')
            except OSError:
                self.base = None
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        elif self.base is not None:
            hwm = proc_status_bytes('VmHWM')
            self.peak = None if hwm is None else max(hwm - self.base, 0)
        return False


def _bench_methods(device):
    """name -> (fn(q, k, v, phi_q, phi_k) -> y, note). Softmax attention gets q, k, v; the rest phi_q, phi_k, v."""
    import torch.nn.functional as Fn
    methods = {'sdpa': lambda q, k, v, pq, pk: Fn.scaled_dot_product_attention(q, k, v, is_causal=True)}
    try:
        import attention
        if hasattr(attention, 'linear_attention_parts'):   # the PyTorch chunked path itself (no CUDA dispatch)
            def chunked(q, k, v, pq, pk):
                num, den, _ = attention.linear_attention_parts(pq, pk, v, True, 'chunked', DEFAULT_CHUNK)
                return (num / (den[..., None] + DEFAULT_EPS)).to(v.dtype)
        else:
            def chunked(q, k, v, pq, pk):
                return attention.linear_attention(pq, pk, v, causal=True, impl='chunked')
        methods['chunked'] = chunked
    except ImportError as e:
        print(f'kernels.bench: attention.py not importable ({e}); no chunked rows', file=sys.stderr)
    methods['cumsum'] = lambda q, k, v, pq, pk: causal_linear_attention_reference(pq, pk, v)
    if torch.device(device).type == 'cuda' and HAS_TRITON:
        methods['triton'] = lambda q, k, v, pq, pk: triton_causal_linear_attention(pq, pk, v)
        try:
            from fla.ops.linear_attn import chunk_linear_attn

            def fla(q, k, v, pq, pk):   # fla layout (B, T, H, K); scale 1 so it computes the same thing
                o, _ = chunk_linear_attn(pq.transpose(1, 2), pk.transpose(1, 2), v.transpose(1, 2), scale=1.0,
                                         normalize=True)
                return o.transpose(1, 2)
            methods['fla'] = fla
        except Exception as e:  # not installed, or an API change
            print(f'kernels.bench: flash-linear-attention not usable ({type(e).__name__}: {e}); no fla rows',
                  file=sys.stderr)
    return methods


def _est_bytes(method, B, H, T, F, D, backward):
    """Rough upper estimate of a method's extra memory, only used to skip configurations that cannot fit."""
    el = 4
    if method == 'cumsum':                       # (B, H, T, F, D) cumsum, its input, and autograd copies
        return B * H * T * F * D * el * (6 if backward else 3)
    if method == 'sdpa':                         # flash/efficient kernels are O(T); the math fallback is O(T^2)
        return B * H * T * (3 * D + 4) * el * 4
    return B * H * T * (2 * F + 2 * D) * el * 8  # chunked / triton / fla: O(T) with per-chunk states


def bench(device=None, B=None, H=12, D=64, F=128, T_list=None, dtype=None, repeats=3, max_seconds=20.0,
          mem_budget_gb=None, methods=None, backward=True, out=None, verbose=True, threads=None):
    """Forward and forward+backward time (median of repeats, after one warm-up) and peak extra memory of causal
    attention at several sequence lengths: SDPA softmax (q, k, v of head_dim D), the PyTorch chunked path
    (attention.linear_attention_parts, impl='chunked'), the naive cumsum reference, and on CUDA the Triton
    kernel and flash-linear-attention's chunk_linear_attn (if installed) on phi_q, phi_k (F features), v.
    Defaults: CUDA B=4, T 1K..32K, bf16; CPU B=1, T 1K..16K, fp32. Configurations whose estimated memory
    exceeds mem_budget_gb are skipped (reported). On the CPU a configuration whose first run takes longer than
    max_seconds is timed once (that run; marked 'single run'). threads: torch.set_num_threads for the CPU (on a
    loaded machine 1 thread avoids OpenMP stalls that add ~10 ms per op). Returns a list of dict rows; prints a markdown table (and writes it to `out`)."""
    import time
    device = torch.device(device or ('cuda' if torch.cuda.is_available() else 'cpu'))
    cuda = device.type == 'cuda'
    if threads:
        torch.set_num_threads(threads)
    B = B or (4 if cuda else 1)
    T_list = list(T_list or ([1024, 2048, 4096, 8192, 16384, 32768] if cuda else [1024, 2048, 4096, 8192, 16384]))
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    if mem_budget_gb is None:
        mem_budget_gb = (0.8 * torch.cuda.mem_get_info(device)[0] / 2**30) if cuda else 6.0
    table = _bench_methods(device)
    names = [m for m in (methods or list(table)) if m in table]
    pm_method = PeakMemory(device).method

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    rows = []
    for T in T_list:
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(B, H, T, D, device=device, dtype=dtype, generator=gen) for _ in range(3))
        # positive features, as a feature map would give (softmax over the feature dim, Hedgehog-style)
        pq, pk = (torch.softmax(torch.randn(B, H, T, F, device=device, generator=gen), -1).to(dtype)
                  for _ in range(2))
        gy = torch.randn(B, H, T, D, device=device, dtype=dtype, generator=gen)
        for name in names:
            for mode in (['fwd', 'fwd+bwd'] if backward else ['fwd']):
                row = {'T': T, 'method': name, 'mode': mode, 'B': B, 'H': H, 'D': D, 'F': F,
                       'dtype': str(dtype).replace('torch.', ''), 'device': str(device), 'ms': None,
                       'peak_mb': None, 'repeats': 0, 'mem_method': pm_method, 'note': '',
                       'threads': torch.get_num_threads()}
                est = _est_bytes(name, B, H, T, F, D, mode != 'fwd')
                if est > mem_budget_gb * 2**30:
                    row['note'] = f'skipped: est. {est / 2**30:.1f} GB > budget {mem_budget_gb:.1f} GB'
                    rows.append(row)
                    continue
                fn = table[name]
                if mode == 'fwd':
                    def run():
                        with torch.no_grad():
                            return fn(q, k, v, pq, pk)
                else:
                    leaves = [x.detach().requires_grad_() for x in (q, k, v, pq, pk)]

                    def run():
                        y = fn(*leaves)
                        y.backward(gy)
                        for x in leaves:
                            x.grad = None
                try:
                    # first call: warm-up (Triton compilation, allocator); on the CPU it is also measured, and a
                    # configuration slower than max_seconds keeps it as its only timing
                    with PeakMemory(device) as pm:
                        t0 = time.perf_counter()
                        run()
                        sync()
                        first = time.perf_counter() - t0
                    times, peak = [], pm.peak
                    if cuda or first <= max_seconds:
                        for i in range(repeats):
                            with PeakMemory(device) as pm:
                                t0 = time.perf_counter()
                                run()
                                sync()
                                times.append(time.perf_counter() - t0)
                            peak = pm.peak if i == 0 else peak
                    else:
                        times = [first]
                        row['note'] = 'single run'
                    times.sort()
                    row.update(ms=1e3 * times[len(times) // 2], repeats=len(times),
                               peak_mb=None if peak is None else peak / 2**20)
                except torch.OutOfMemoryError:
                    row['note'] = 'out of memory'
                    if cuda:
                        torch.cuda.empty_cache()
                except Exception as e:  # report, keep going
                    row['note'] = f'failed: {type(e).__name__}: {str(e)[:80]}'
                rows.append(row)
                if verbose:
                    ms = '-' if row['ms'] is None else f'{row["ms"]:10.2f} ms'
                    mb = '-' if row['peak_mb'] is None else f'{row["peak_mb"]:9.1f} MB'
                    print(f'  T={T:6d} {name:8s} {mode:8s} {ms:>13s} {mb:>12s} {row["note"]}', file=sys.stderr,
                          flush=True)
        del q, k, v, pq, pk, gy
    md = bench_markdown(rows)
    if verbose:
        print(md)
    if out:
        with open(out, 'w') as f:
            f.write(md + '\n')
    return rows


def bench_markdown(rows):
    """One table per mode: rows T, columns methods, cells 'ms / peak MB'; plus SDPA / chunked speed-up."""
    if not rows:
        return ''
    r0 = rows[0]
    where = r0['device'] + ('' if r0['device'].startswith('cuda') else f' ({r0["threads"]} threads)')
    out = [f'Causal attention, B={r0["B"]}, H={r0["H"]}, head_dim {r0["D"]}, F={r0["F"]}, {r0["dtype"]} on '
           f'{where}; median ms / peak extra memory MB ({r0["mem_method"]}).', '']
    names = list(dict.fromkeys(r['method'] for r in rows))
    for mode in dict.fromkeys(r['mode'] for r in rows):
        sub = [r for r in rows if r['mode'] == mode]
        extra = ['sdpa / chunked'] if {'sdpa', 'chunked'} <= set(names) else []
        out += [f'**{mode}**', '', '| T | ' + ' | '.join(names + extra) + ' |',
                '|---:|' + '---:|' * (len(names) + len(extra))]
        for T in sorted({r['T'] for r in sub}):
            cells, ms = [], {}
            for n in names:
                r = next((r for r in sub if r['T'] == T and r['method'] == n), None)
                if r is None or r['ms'] is None:
                    cells.append('-' if r is None else r['note'].split(':')[0])
                else:
                    ms[n] = r['ms']
                    mb = '-' if r['peak_mb'] is None else f'{r["peak_mb"]:.0f}'
                    cells.append(f'{r["ms"]:.1f}{"*" if r["note"] == "single run" else ""} / {mb}')
            if extra:
                cells.append(f'{ms["sdpa"] / ms["chunked"]:.1f}x' if 'sdpa' in ms and 'chunked' in ms else '-')
            out.append(f'| {T} | ' + ' | '.join(cells) + ' |')
        out.append('')
    if any(r['note'] == 'single run' for r in rows):
        out += ['\\* a single run (slower than max_seconds), not a median.', '']
    return '\n'.join(out)


if __name__ == '__main__':
    import argparse
    p = argparse.ArgumentParser(description='Benchmark causal attention implementations (see bench()).')
    p.add_argument('--device', default=None)
    p.add_argument('--B', type=int, default=None)
    p.add_argument('--H', type=int, default=12)
    p.add_argument('--D', type=int, default=64)
    p.add_argument('--F', type=int, default=128)
    p.add_argument('--T', default=None, help='comma-separated sequence lengths')
    p.add_argument('--dtype', default=None, choices=['float32', 'bfloat16', 'float16'])
    p.add_argument('--repeats', type=int, default=3)
    p.add_argument('--max_seconds', type=float, default=20.0)
    p.add_argument('--mem_budget_gb', type=float, default=None)
    p.add_argument('--methods', default=None, help='comma-separated subset of sdpa,chunked,cumsum,triton,fla')
    p.add_argument('--no_backward', action='store_true')
    p.add_argument('--out', default=None, help='write the markdown table here')
    p.add_argument('--threads', type=int, default=None, help='torch.set_num_threads (CPU)')
    a = p.parse_args()
    bench(device=a.device, B=a.B, H=a.H, D=a.D, F=a.F,
          T_list=[int(t) for t in a.T.split(',')] if a.T else None,
          dtype=getattr(torch, a.dtype) if a.dtype else None, repeats=a.repeats, max_seconds=a.max_seconds,
          mem_budget_gb=a.mem_budget_gb, methods=a.methods.split(',') if a.methods else None,
          backward=not a.no_backward, out=a.out, threads=a.threads)
