"""Convert a pretrained softmax Transformer into a linear-attention one (LoLCATs' recipe).

Attention transfer, then LoRA; Hedgehog's distillation loss; DoF's feature-dimension selection.

    python convert.py --init_from gpt2 --attn hedgehog --data data/tinyshakespeare/input.txt
    python convert.py --report runs/a,runs/b             # the summary table of several conversions
    torchrun --nproc_per_node N convert.py ... [--fsdp]  # N processes (DDP), or each block sharded
                                                         # over them (FSDP2)
The README's recipe:
    python convert.py --init_from SmolLM2.gguf --attn lolcats:window=64 --block_size 1024 ...

The pipeline (`run`):
    teacher = model.load(init_from)        our ckpt.pt, a HF folder or hub name, or a .gguf file
    select_feature_dims                    optional: per-layer feature dims from the DoF
    swap                                   new attention cores on --layers; all else kept
    core.calibrate (attention.py)          data-dependent init: LLN's moments, the 'mix' share
    transfer  (stage 1)                    only the cores train, each on its teacher's q, k, v
    finetune  (stage 2)                    LoRA on q/k/v/o (or every weight) with the task loss
    model.save(out_dir/ckpt.pt, base=...)  only the new tensors (model.load rebuilds the rest)
After the swap and each stage, `evaluate` measures quality and attention fidelity (summary.json).
Both stages run train.fit, the project's one training loop (progress lines, the non-finite-loss
stop), in one process or under torchrun (each process its share of the --grad_accum micro-batches;
all evaluate, rank 0 writes).
"""
import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

import attention as A
from attention import UsageError
import hybrids as H
import model as M
import train
from train import log, num

LORA_LR = 1e-3                  # stage 2's learning rate with LoRA,
FULL_LR = 3e-4                  # and for a full finetune
# attention fidelity is quadratic in T: it reads the first 2 held-out batches, their first 1024
# tokens (causal: the same rows; at 4096 SmolLM2's took 13 GB)
FIDELITY_BATCHES = 2
FIDELITY_TOKENS = 1024
CALIB_BATCHES = 4               # training batches for calibration and DoF
DOF_TOKENS = 4096               # DoF: the queries and keys of at most this many real tokens a head

@dataclass
class ConvertConfig:
    init_from: str = 'gpt2'       # the teacher: our checkpoint, a HF folder or hub name,
                                  # or a .gguf file
    tokenizer: str = ''           # a HF folder or .gguf file whose tokenizer replaces
                                  # the teacher's own
    attn: str = 'hedgehog'        # the student's attention: hedgehog, lolcats:window=64:sinks=4,
                                  # dof:feature_dim=64, softmax:window=64 (no linear part);
                                  # softmax: the control run, stage 2 on the teacher
    layers: str = 'all'           # layers to convert: all | 0,2,5 | 0-3 | -1
    task: Literal['lm', 'glue'] = 'lm'   # lm: next-token loss, perplexity;
                                         # glue: a BERT classifier, its metric
    data: str = 'data/tinyshakespeare/input.txt'   # text (as train.py reads it), or the GLUE folder
    val_data: str = ''            # lm: held-out text ('' = the last 10 % of --data)
    glue_task: Literal[tuple(train.GLUE_TASKS)] = 'cola'
    block_size: int = num(128, ge=2)   # sequence length (at most the model's)
    batch_size: int = num(8, ge=1)   # per process, per micro-step
    grad_accum: int = num(1, ge=1)   # micro-steps per optimizer step,
                                     # over all processes (torchrun divides it)
    eval_batches: int = num(8, ge=1)   # lm: held-out windows of block_size for quality
                                       # (glue: the whole dev set)
    stage1_iters: int = num(200, ge=0)   # attention-transfer steps
    lr: float = num(1e-2, gt=0, le=1)   # stage-1 learning rate (AdamW, no weight decay)
    loss: str = 'auto'            # ce (Hedgehog Eq. 4) | mse (LoLCATs outputs) | l2 (DoF kernel) |
                                  # sums: ce+0.1*mse;
                                  # auto: mse for lolcats and the hybrids, ce otherwise
    dof_budget: float = num(0.0, ge=0, le=2**16)   # > 0: per-layer feature dims from the DoF,
                                                   # this mean (DoF Alg. 1)
    dof_lambda: float = num(2 ** -4, gt=0)   # lambda of tr(G (G + lambda I)^-1)
                                             # (the paper's value for GPT-2)
    dof_samples: int = num(256, ge=2, le=2 * DOF_TOKENS)   # J, the points sampled per head
                                                           # (of its queries and keys)
    dof_clip: bool = False        # DoF + Clip: at most head_dim per layer
                                  # (hedgehog: 2 head_dim), not redistributed
    exact_heads: int = num(0, ge=0)   # > 0: this many KV heads (of all layers')
                                      # stay exact softmax (spec exact=)
    exact_rank: Literal['probe', 'random'] = 'probe'   # which: the teacher's retrieval
                                                       # probe's best, or at random
    stage2_iters: int = num(200, ge=0)   # finetuning steps
    lora_rank: int = num(8, ge=0)   # LoRA rank on every layer's --lora_targets
                                    # (alpha = 2 rank); 0 = full finetune
    lora_targets: str = 'q,k,v,o'   # the projections LoRA adapts;
                                    # v,o: q and k stay the teacher's (QK-Restore)
    passkey_mix: float = num(0.0, ge=0, le=1)   # lm: this share of stage-2 batches:
                                                # retrieval samples (passkey_batch)
    passkey_block: int = num(0, ge=0)   # their length: up to block - 8 tokens
                                        # (0: --block_size)
    stage2_lr: float = num(0.0, ge=0, le=1)   # 0 = 1e-3 with LoRA, 3e-4 for a full finetune
    grad_ckpt: bool = False       # stage 2 remakes each block's activations in backward:
                                  # one block's in memory at a time (long --passkey_block)
    out_dir: str = 'out-convert'
    device: str = 'auto'          # auto | cpu | cuda | cuda:N
    fsdp: bool = False            # under torchrun: every block sharded over the processes
                                  # (FSDP2), for a teacher too big for one device;
                                  # LoRA only (--lora_rank > 0), --task lm
    seed: int = num(0, ge=0, lt=2**32)
    report: str = ''              # comma-separated convert.py out_dirs:
                                  # print their summary table and exit

    def __post_init__(self):
        train.check_ranges(self)
        train.check_device(self.device)
        self.spec = A.AttnSpec.parse(self.attn)
        if self.dof_budget and self.spec.name not in ('dof', 'hedgehog'):
            raise UsageError("--dof_budget is for --attn dof or hedgehog")
        if self.dof_clip and not self.dof_budget:
            raise UsageError("--dof_clip needs --dof_budget")
        if self.exact_heads and (self.task != 'lm' or self.spec.exact):
            raise UsageError(
                "--exact_heads is for --task lm, with an --attn that names no exact= heads")
        self.weights = loss_weights(self.loss, self.spec)
        if not set(t := self.lora_targets.split(',')) <= set('qkvo') or len(set(t)) < len(t):
            raise UsageError(
                f"--lora_targets {self.lora_targets!r}: a comma-separated subset of q,k,v,o")
        if self.passkey_mix and self.task != 'lm':
            raise UsageError("--passkey_mix is for --task lm")

# the maps --loss l2 fits: their phi(q).phi(k) estimates exp(q.k/sqrt d)
KERNEL_MAPS = ('dof', 'performer', 'taylor')

def loss_weights(spec, attn):
    """'ce+0.1*mse' -> {'ce': 1.0, 'mse': 0.1}; auto: mse for lolcats and the hybrids (LoLCATs),
    else ce (Hedgehog). (Never l2 by default: the raw kernel L2 is dominated by the largest
    exp(q.k/sqrt d) pairs; and l2 only for the KERNEL_MAPS: for another map the kernel's scale is
    arbitrary, and l2 pulls it away from what the other losses want: lolcats:activation=exp with
    mse+0.01*l2 raised the KL where mse alone lowered it, issue 35.)"""
    if spec == 'auto':
        spec = 'mse' if attn.window or attn.diag_block or attn.name == 'lolcats' else 'ce'
    w = {}
    for part in spec.split('+'):
        m = re.fullmatch(r'\s*(?:([0-9.eE+-]+)\*)?(ce|mse|l2)\s*', part)
        if not m:
            raise UsageError(
                f"bad --loss part {part!r}: use ce, mse, l2 or a weighted sum such as 'ce+0.1*mse'")
        w[m.group(2)] = float(m.group(1) or 1.0)
    if not any(w.values()) or min(w.values()) < 0:
        raise UsageError(f"--loss {spec!r}: the weights must be >= 0 and not all zero")
    if w.get('l2') and attn.name not in KERNEL_MAPS:
        raise UsageError(
            f"--loss l2 compares phi(q).phi(k) with exp(q.k/sqrt d) itself, unnormalised: it fits "
            f"the maps that estimate that kernel ({', '.join(KERNEL_MAPS)}), not {attn.name}")
    return w

def parse_layers(spec, n_layer):
    """'all' -> every layer; '0,2,5', '0-3' or '-1' (negative indices count from the end)."""
    if spec in ('', 'all'):
        return list(range(n_layer))
    out = set()
    for part in spec.split(','):
        m = re.fullmatch(r'\s*(-?\d+)(?:-(\d+))?\s*', part)
        if not m:
            raise UsageError(f"bad --layers entry {part!r}; use e.g. 'all', '0,2,5', '0-3' or '-1'")
        for i in range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1):   # lo..hi
            if not -n_layer <= i < n_layer:
                raise UsageError(
                    f"unknown layer index {i}: the model has {n_layer} layers (0..{n_layer - 1})")
            out.add(i % n_layer)
    return sorted(out)

# ---- DoF feature-dimension selection -----------------------------------------
# Nishikawa et al. 2025, Sec. 3, Algorithm 1 (DoF + Clip: Sec. 4.2): per head the DoF of the
# kernel's Gram matrix / J (the paper gives no J: 256); per layer their max.
DOF_LAMBDA_GPT2 = 2 ** -4  # the paper's lambda for GPT-2 (Sec. 4.1; 2^-8 for Pythia-1B)

def exp_gram(x: torch.Tensor) -> torch.Tensor:
    """S / J: the softmax kernel's Gram matrix [exp(x_i . x_j / sqrt D)] of x (J, D), divided by J
    (float64). Sec. 3.1 defines DoF as tr(Sigma (Sigma + lambda I)^-1) of the kernel's integral
    operator Sigma; the eigenvalues of S / J estimate Sigma's, so its DoF converges as J grows.
    Algorithm 1 writes the Gram matrix S itself: our departure.  Undivided, tr(S (S + lambda I)^-1)
    is the divided DoF at lambda / J, which drifts towards J as J grows (tests/test_dof.py measures
    both)."""
    x = x.double()
    logits = x @ x.T / math.sqrt(x.shape[-1])      # (J, J)
    return torch.exp(logits.clamp(max=700.0)) / x.shape[0]  # float64 overflows at exp(709)

def degrees_of_freedom(gram: torch.Tensor, lam: float) -> float:
    """N_lambda = tr(G (G + lam I)^-1) = sum_i s_i / (s_i + lam) over the eigenvalues s_i of a
    symmetric G (negative round-off eigenvalues count as 0). lam <= 0 raises ValueError (at 0 the
    trace counts the rank, not a DoF)."""
    if lam <= 0:
        raise ValueError(f'lambda must be > 0, got {lam}')
    s = torch.linalg.eigvalsh(gram.double()).clamp(min=0)  # negative round-off -> 0
    return float((s / (s + lam)).sum())

def head_dofs(q: torch.Tensor, k: torch.Tensor, lam: float, n_samples: int = 256,
              generator: torch.Generator | None = None) -> list[float]:
    """DoF of each head (Algorithm 1's loop over heads): J = n_samples points drawn without
    replacement from the head's 2M pooled queries and keys; q, k (H, M, D)."""
    return [degrees_of_freedom(
                exp_gram(x[torch.randperm(len(x), generator=generator)[:n_samples]]), lam)
            for x in torch.cat([q, k], 1)]   # x: a head's (2M, D) queries and keys

def allocate_dims(dofs, budget: float, clip: int | None = None, min_dim: int = 1) -> list[int]:
    """Per-layer feature dimensions M_s = C dof_s / mean(dof) (Algorithm 1, last line; C =
    `budget`). Ours: the mean is exact (the paper rounds each layer on its own): shares below
    min_dim are raised to it, the others share the rest in proportion, rounded by largest remainder
    so the dims sum to round(C L). clip: DoF + Clip (Sec. 4.2, at the head size): then clamped,
    nothing redistributed (mean cost < C)."""
    dofs = [float(d) for d in dofs]
    L = len(dofs)
    if budget <= 0:
        raise ValueError(f'budget must be > 0, got {budget}')
    if any(d < 0 or not math.isfinite(d) for d in dofs):
        raise ValueError(f'degrees of freedom must be finite and >= 0, got {dofs}')
    if min_dim < 1:
        raise ValueError(f'min_dim must be >= 1, got {min_dim}')
    if clip is not None and clip < min_dim:
        raise ValueError(f'clip {clip} is below min_dim {min_dim}')
    total = max(int(round(budget * L)), min_dim * L)
    w = [d if d > 0 else 1e-12 for d in dofs]
    floored = set()
    while True:  # layers whose share is below min_dim get min_dim; the others share the rest
        free = [i for i in range(L) if i not in floored]
        sw = sum(w[i] for i in free)
        share = {i: (total - min_dim * len(floored)) * w[i] / sw for i in free}
        under = [i for i in free if share[i] < min_dim - 1e-9]
        if not under:
            break
        floored.update(under)
    real = [float(min_dim) if i in floored else share[i] for i in range(L)]
    dims = [max(min_dim, math.floor(r + 1e-9)) for r in real]
    # largest remainders first (ties: the larger DoF); fewer than L units are left
    order = sorted(range(L), reverse=True,
                   key=lambda i: (real[i] - math.floor(real[i] + 1e-9), w[i]))
    for i in order[:max(0, total - sum(dims))]:
        dims[i] += 1
    return dims if clip is None else [min(d, int(clip)) for d in dims]

def select_feature_dims(layer_qk: dict, budget: float, lam: float = DOF_LAMBDA_GPT2,
                        n_samples: int = 256, clip: int | None = None, unit: int = 1, seed: int = 0,
                        verbose: bool = True):
    """DoF Algorithm 1 (+ Clip): layer_qk {layer: (q, k)}, q, k (H, M, D) teacher queries/keys after
    RoPE. unit: feature dims come in multiples of it (hedgehog's F is 2 x its MLP outputs: those are
    allocated); every layer gets at least 2. -> (dims {layer: int}, a table row per layer (with a
    clip: its 'unclipped' dim))."""
    layers = sorted(layer_qk)
    g = torch.Generator().manual_seed(seed)
    per_head = [head_dofs(*layer_qk[l], lam, n_samples, g) for l in layers]
    layer_dof = [max(d) for d in per_head]
    alloc = lambda c: [unit * d for d in allocate_dims(   # in units, then in feature dims
        layer_dof, budget / unit, clip=c and c // unit, min_dim=max(1, 2 // unit))]
    dims = alloc(clip)
    free = alloc(None)
    table = [dict(layer=l, dof_heads=[round(x, 3) for x in h], dof_max=round(d, 3), feature_dim=fd,
                  **({'unclipped': u} if clip is not None else {}))
             for l, h, d, fd, u in zip(layers, per_head, layer_dof, dims, free)]
    if verbose:
        print(format_dof_table(table, budget, lam, n_samples, clip))
    return dict(zip(layers, dims)), table

def format_dof_table(table, budget, lam, n_samples, clip=None) -> str:
    """The per-layer DoF table (markdown) with its settings, the mean cost and a note where DoF
    nears J."""
    c = clip is not None
    at_clip = f', DoF + Clip at {clip}' if c else ''
    lines = [f'DoF feature-dimension selection (DoF Alg. 1): lambda={lam:g}, J={n_samples}, '
             f'G = exp(x_i.x_j/sqrt d) / J, budget C={budget:g}{at_clip}',
             '| layer | DoF per head | max DoF | feature_dim |' + (' before clip |' if c else ''),
             '|---|---|---|---|' + ('---|' if c else '')]
    lines += [f"| {r['layer']} | {' '.join(f'{x:.1f}' for x in r['dof_heads'])} | "
              f"{r['dof_max']:.2f} | {r['feature_dim']} |" + (f" {r['unclipped']} |" if c else '')
              for r in table]
    if table:
        n_clipped = sum(r['unclipped'] > r['feature_dim'] for r in table) if c else 0
        clipped = f'; {n_clipped} of {len(table)} layers clipped at {clip}' if c else ''
        lines.append(f"mean feature_dim = {sum(r['feature_dim'] for r in table) / len(table):g} "
                     f"(budget C = {budget:g}{clipped})")
        top = max(r['dof_max'] for r in table)
        if top > 0.9 * n_samples:
            lines.append(f'note: max DoF {top:.1f} is near J = {n_samples}, where the estimate '
                         'saturates; a larger --dof_lambda separates the layers')
    return '\n'.join(lines)

# ---- stage 1: the attention-transfer loss of one layer, on its teacher's q, k, v ----
def _teacher(core, q, k, v, mask, weights=True):
    """The teacher's softmax weights (B, H, T, T; a T x T x T product, None unless `weights`) and
    outputs of this layer (padded keys masked)."""
    m = None if mask is None else mask.bool()[:, None, None, :]
    w = A.softmax_weights(q, k, core.causal, attn_mask=m) if weights else None
    return w, A.softmax_attention(q, k, v, core.causal, attn_mask=m)

def _row_mean(x, mask):
    """Mean of per-row values (B, H, T) over the real (unpadded) query rows."""
    if mask is None:
        return x.mean()
    m = mask[:, None, :].to(x.dtype).expand_as(x)
    return (x * m).sum() / m.sum().clamp(min=1)

def transfer_loss(core, q, k, v, mask, weights):
    """The stage-1 loss of one student core: a weighted sum of
      ce  soft-label cross-entropy of the attention weights (Hedgehog Eq. 4; T x T),
      mse squared error of the attention outputs (LoLCATs; the core's chunked path, not T x T),
      l2  squared error of the raw kernel phi(q).phi(k) against exp(q.k/sqrt d) (DoF; T x T)."""
    w_t, y_t = _teacher(core, q, k, v, mask, weights=bool(weights.get('ce')))
    loss = 0.0
    if weights.get('ce'):
        w = core.weights(q, k, key_padding_mask=mask)
        ce = -(w_t * w.clamp(min=1e-12).log()).sum(-1)                           # (B, H, T)
        loss += weights['ce'] * _row_mean(ce, mask)
    if weights.get('mse'):
        err = (core(q, k, v, key_padding_mask=mask) - y_t).square().mean(-1)     # (B, H, T)
        loss += weights['mse'] * _row_mean(err, mask)
    if weights.get('l2'):   # (only for the KERNEL_MAPS: loss_weights), on the heads with a map
        q = q[:, core.rest_q]
        k = k[:, core.rest_q]
        # the kernel unnormalised: the features with their shifts undone
        phi_q, phi_k, c_q, c_k = core.fmap.features(*H.map_inputs(core, q, k))
        phi_q = phi_q * c_q.exp()[..., None]
        phi_k = phi_k * c_k.exp()[..., None]
        if mask is not None:
            phi_k = phi_k * mask[:, None, :, None]
        loss += weights['l2'] * A.kernel_l2(phi_q, phi_k, q, k, causal=core.causal)
    return loss

# ---- data and evaluation -----------------------------------------------------
@torch.no_grad()
def _teacher_qkv(model, batch, layers, device):
    """{layer: (q, k, v, key mask)} (model.capture_qkv) as the teacher runs on a text (x, y) or a
    GLUE batch."""
    x = batch[0].to(device)
    mask = types = None      # text: (x, y)
    if len(batch) == 4:      # GLUE: (idx, mask, token types, labels)
        mask, types = (t.to(device) for t in batch[1:3])
    with model.capture_qkv(layers, teacher=True) as rec:
        model.hidden_states(x, attention_mask=mask, token_type_ids=types)
    return rec

def load_task(cfg, model):
    """train.Task with the teacher's tokenizer: --data's text (held out: --val_data or its last 10
    %), or the GLUE task's train and dev sets."""
    tok = model.tokenizer = train.get_tokenizer(cfg.tokenizer, model)   # (its ids fit the model)
    if cfg.passkey_mix:   # a stage-2 retrieval sample drawn before any work: its error now
        passkey_batch(tok, torch.Generator(), cfg.passkey_block or cfg.block_size, 1)
    return train.Task(train.DataConfig(
        task='text' if cfg.task == 'lm' else 'glue', data=cfg.data, val_data=cfg.val_data,
        glue_task=cfg.glue_task, batch_size=cfg.batch_size, seq_len=cfg.block_size,
        seed=cfg.seed), tok)

@torch.no_grad()
def evaluate(model, module, task, cfg, rt, layers):
    """Quality -- lm: held-out perplexity (train.perplexity on the first eval_batches windows);
    glue: dev loss and metric -- and attention fidelity: per converted layer, each on its teacher's
    own q, k, v (so not compounded), the mean row KL(teacher softmax || student) in nats and the
    output MSE."""
    model.eval()
    out = {}
    if cfg.task == 'glue':
        out['quality'] = train.final_metrics(module, model, task, rt)
    elif model.config.family != 'bert':
        T = task.cfg.seq_len
        out['quality'] = train.perplexity(
            model, task.splits['val'][:cfg.eval_batches * cfg.batch_size * T + 1], T, T,
            rt.device, cfg.batch_size)
    cores = model.attention_cores()
    kl = dict.fromkeys(layers, 0.0)
    mse = dict.fromkeys(layers, 0.0)
    sels = task.eval_batches('val', FIDELITY_BATCHES) if layers else []
    batches = [task.batch('val', s) for s in sels]
    for b in batches:
        rec = _teacher_qkv(model, b, layers, rt.device)
        for l in layers:
            core = cores[l]
            q, k, v, mask = rec[l]
            if core.causal:   # (bidirectional: GLUE's short padded batches, whole)
                q, k, v = (x[:, :, :FIDELITY_TOKENS] for x in (q, k, v))
            w_t, y_t = _teacher(core, q, k, v, mask)
            kl_rows = A.kl_divergence(w_t, core.weights(q, k, key_padding_mask=mask))   # (B, H, T)
            mse_rows = (core(q, k, v, key_padding_mask=mask) - y_t).square().mean(-1)
            kl[l] += float(_row_mean(kl_rows, mask)) / len(batches)
            mse[l] += float(_row_mean(mse_rows, mask)) / len(batches)
    n = max(len(layers), 1)
    return dict(out, kl_layers=kl, mse_layers=mse, kl_mean=sum(kl.values()) / n,
                mse_mean=sum(mse.values()) / n)

# ---- the pipeline ------------------------------------------------------------
def teacher_qk(model, batches, layers, rt):
    """{layer: (q, k, mask)}: the teacher's queries and keys (N, H, T, D) on calibration batches,
    their sequences stacked (GLUE's sentences padded to the longest); mask (N, T): True at real
    tokens."""
    recs = [_teacher_qkv(model, b, layers, rt.device) for b in batches]
    out = {}
    T = max(r[l][0].shape[2] for r in recs for l in layers)

    def grow(x, d):   # x zero-padded to T along dimension d
        return torch.cat([x, x.new_zeros(*x.shape[:d], T - x.shape[d], *x.shape[d + 1:])], d)
    for l in layers:
        q, k = (torch.cat([grow(r[l][i].float(), 2) for r in recs]) for i in (0, 1))
        masks = [torch.ones_like(r[l][0][:, 0, :, 0], dtype=torch.bool) if r[l][3] is None
                 else r[l][3].bool() for r in recs]   # (N, T)
        out[l] = (q, k, torch.cat([grow(m, 1) for m in masks]))
    return out

# ---- exact heads (issue 36): the teacher's retrieval heads keep exact softmax ----
@torch.no_grad()
def retrieval_scores(model, tok, device, length=1024, samples=3, seed=1):
    """Each KV head's retrieval score on the teacher, (L, H_kv) float64: on passkey prompts of about
    `length` tokens (train.passkey_prompts: depth 50 %, the probe's template and seed 1, not the
    test's) with the answer teacher-forced, the attention mass its query heads put on the key's
    tokens (both mentions), averaged over the rows that predict the answer, the query heads and the
    prompts. A soft form of Wu et al. 2024's retrieval score (how often the head's largest weight is
    on the token being copied): it needs no correct greedy answer."""
    cfg = model.config
    score = torch.zeros(cfg.n_layer, cfg.n_kv_head, dtype=torch.float64)
    prompts = train.passkey_prompts(tok, [min(length, cfg.block_size - 8)], depths=(50,),
                                    samples=samples, seed=seed, template='probe')
    for p in prompts:
        text = p['input'] + ' ' + p['target']
        n = len(tok.encode(p['input']))
        ids = tok.encode(text)[:-1]   # the rows n - 1 .. end predict the answer's tokens
        keys = sorted({t for a, b in p['keys'] for t in range(*train.token_span(tok, text, a, b))})
        with model.capture_qkv(teacher=True) as rec:
            model(torch.tensor([ids], device=device))
        mask = A.causal_mask(len(ids) - n + 1, len(ids), device)   # the answer's rows, causal
        for l, (q, k, _, _) in rec.items():
            w = A.softmax_weights(q[:, :, n - 1:], k, attn_mask=mask)[0]   # (H, rows, T)
            mass = w[..., keys].sum(-1).mean(-1).double().cpu()            # (H,): on the key
            score[l] += mass.view(cfg.n_kv_head, -1).mean(-1) / len(prompts)   # per KV head
    return score

def exact_heads(scores, n, rank='probe', seed=0):
    """{layer: sorted KV heads} of the n heads kept exact, among those scored >= 0 (L, H_kv): the n
    best scores (rank 'probe'), or n at random (the control)."""
    flat = scores.flatten()
    cand = (flat >= 0).nonzero()[:, 0]
    order = cand[flat[cand].argsort(descending=True) if rank == 'probe'
                 else torch.randperm(len(cand), generator=torch.Generator().manual_seed(seed))]
    out = {}
    for i in sorted(order[:n].tolist()):
        out.setdefault(i // scores.shape[1], []).append(i % scores.shape[1])
    return out

def swap(model, cfg, layers, qk):
    """New attention cores on `layers` (DoF: each with its own feature_dim, from the teacher's q, k;
    with --exact_heads, the heads kept exact on each layer), calibrated on the teacher's q, k."""
    spec = cfg.spec
    specs = {l: spec for l in layers}
    out = {}
    if cfg.dof_budget:   # hedgehog's F is 2 x its MLP outputs (so its clip is 2 head_dim)
        unit = 2 if spec.name == 'hedgehog' else 1
        pooled = {}
        for l in layers:   # (H, N, D): the real tokens, as the map sees them (nope: RoPE undone)
            q, k, real = qk[l]
            seen = H.map_inputs(M.make_core(model.config, spec), q, k)
            pooled[l] = tuple(x.transpose(1, 2)[real].transpose(0, 1)[:, :DOF_TOKENS].cpu()
                              for x in seen)
        clip = unit * model.config.head_dim if cfg.dof_clip else None
        dims, out['dof_table'] = select_feature_dims(pooled, cfg.dof_budget, cfg.dof_lambda,
                                                     cfg.dof_samples, clip, unit, cfg.seed)
        specs = {l: replace(spec, options={**dict(spec.options), 'feature_dim': d})
                 for l, d in dims.items()}
    if cfg.exact_heads:
        scores = retrieval_scores(model, model.tokenizer, next(model.parameters()).device)
        scores[[l for l in range(len(scores)) if l not in layers]] = -1.0   # converted layers only
        out.update(retrieval_scores=scores.tolist(),
                   exact_heads=exact_heads(scores, cfg.exact_heads, cfg.exact_rank, cfg.seed))
        specs.update({l: replace(specs[l], exact='+'.join(map(str, h)))
                      for l, h in out['exact_heads'].items()})
        log(f"exact KV heads ({cfg.exact_rank}): {out['exact_heads']}")
    for l, s in specs.items():   # (set_attention: on the model's device)
        model.set_attention(s, [l])
        model.attention_cores()[l].calibrate(*qk[l])   # LLN's moments, the 'mix' window share
    cores = model.attention_cores()
    out['feature_dims'] = {l: getattr(cores[l].fmap, 'feature_dim', 0) for l in layers}
    return out

def _schedule(cfg, iters, lr):
    """A stage's train.Schedule: its steps at a constant learning rate (no warmup, no weight
    decay)."""
    return train.Schedule(iters, lr, min_lr_ratio=1.0, grad_accum=cfg.grad_accum,
                          out_dir=cfg.out_dir, seed=cfg.seed)

class Through(torch.nn.ModuleList):
    """Modules whose forward(fn) is fn(): a DDP wrapper around them averages the gradients of what
    fn computes."""
    def forward(self, fn):
        return fn()

def transfer(model, task, cfg, rt, layers):
    """Stage 1: the teacher frozen (every core in teacher mode for the forward pass), only the
    converted cores' parameters train, each layer on its own teacher q, k, v (so all layers train at
    once). Under torchrun each process captures q, k, v on its own batches; the cores (whole on
    every process) train under DDP. Only what the loss reaches trains: l2 alone reads the maps'
    features, not a decay or a window factor (DDP stops at a trainable parameter without a
    gradient)."""
    cores = model.attention_cores()
    w = cfg.weights
    params = [p for l in layers for n, p in cores[l].named_parameters()
              if n.startswith('fmap.') or w.get('ce') or w.get('mse')]
    if not params or not cfg.stage1_iters:
        log("stage 1: skipped" + ('' if cfg.stage1_iters else ' (0 steps)')
            + ('' if params else ' (the map has no trainable parameters)'))
        return None
    model.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)

    def loss_fn(net, batch):   # net: the cores, or their DDP wrapper
        rec = _teacher_qkv(model, batch, layers, rt.device)
        return net(lambda: sum(transfer_loss(cores[l], *rec[l], cfg.weights) for l in layers)
                   / len(layers))
    model.eval()   # no dropout in the teacher; the students' parameters still get gradients
    out = train.fit(Through(cores[l] for l in layers), params, loss_fn, task.next_batch,
                    _schedule(cfg, cfg.stage1_iters, cfg.lr), rt, log_name='stage1.jsonl')
    if not rt.master:   # (rank 0 writes the log)
        return out
    with open(os.path.join(cfg.out_dir, 'stage1.jsonl')) as f:
        losses = [json.loads(line)['loss'] for line in f]
    return dict(out, loss_first=losses[0], loss_last=losses[-1])

def passkey_batch(tok, gen, block_size, batch_size):
    """(x, y) of stage-2 retrieval samples: passkey prompts of PASSKEY_TEMPLATES['train'] (not the
    probe's, not the test's) as long as passkey_prompts makes them for block_size - 8 tokens
    (whole filler lines: 7,774 for 8,192 in SmolLM2's tokens), the longest that leave room for
    the answer, so that keys are drawn as far back as the block allows (RESULTS 21.6); the key at
    a random depth, then the answer; y is -100 (no loss) but at the answer's tokens. Right-padded,
    so each row's tokens see the same as alone (causal)."""
    xs = []
    ys = []
    draw = lambda a, b: int(torch.randint(a, b, (), generator=gen))   # in [a, b)
    for _ in range(batch_size):
        seed = draw(0, 2**31)
        depth = draw(0, 101)
        p = train.passkey_prompts(tok, [block_size - 8], depths=(depth,), samples=1, seed=seed,
                                  template='train')[0]
        n_prompt = len(tok.encode(p['input']))
        ids = tok.encode(p['input'] + ' ' + p['target'])
        if len(ids) - 1 > block_size:   # (then without filler, the shortest; passkey_prompts sizes
            # the filler on its lines with blank lines between: 2 filler lines in block - 8 tokens)
            useful = 8 + len(tok.encode(p['input'].replace('\n', '\n\n'))) + \
                2 * len(tok.encode(train.PASSKEY_TEMPLATES['train'][1]))
            raise UsageError(f"--passkey_mix: a retrieval sample takes at least {len(ids) - 1} "
                             f"tokens, over its block of {block_size} (--passkey_block, else "
                             f"--block_size); from {useful} its key has filler before and after it "
                             "(a depth)")
        xs.append(ids[:-1])   # row i predicts ids[i + 1]: y labels only the answer's rows
        ys.append([-100] * (n_prompt - 1) + ids[n_prompt:])
    T = max(len(x) for x in xs)
    return tuple(torch.tensor([r + [pad] * (T - len(r)) for r in rows])
                 for rows, pad in ((xs, 0), (ys, -100)))

def finetune(model, module, task, cfg, rt):
    """Stage 2: the task loss (next token, or the GLUE classifier's) on the LoRA factors of every
    layer's --lora_targets (q/k/v/o) plus a new classifier, or on every weight (--lora_rank 0)."""
    if not cfg.stage2_iters:
        return None
    model.requires_grad_(cfg.lora_rank == 0)
    if cfg.lora_rank:
        if not cfg.fsdp:   # (--fsdp added them before sharding)
            add_lora(model, cfg).to(rt.device)
        for n, p in model.named_parameters():
            p.requires_grad_(n.endswith(('lora_A', 'lora_B')) or n.startswith('classifier.'))
    params = [p for p in module.parameters() if p.requires_grad]
    lr = cfg.stage2_lr or (LORA_LR if cfg.lora_rank else FULL_LR)
    model.train()
    model.grad_ckpt = cfg.grad_ckpt

    def batch(g):   # a retrieval sample at --passkey_mix's rate, else the task's
        if cfg.passkey_mix and torch.rand((), generator=g) < cfg.passkey_mix:
            return passkey_batch(model.tokenizer, g, cfg.passkey_block or cfg.block_size,
                                 cfg.batch_size)
        return task.next_batch(g)
    out = train.fit(module, params, train.task_loss, batch, _schedule(cfg, cfg.stage2_iters, lr),
                    rt, log_name='stage2.jsonl')
    model.requires_grad_(False)
    return dict(out, lr=lr, mode='lora' if cfg.lora_rank else 'full')

def add_lora(model, cfg):
    """LoRA on every layer's --lora_targets, drawn from --seed (the same on every process, whenever
    it is added: --fsdp adds it first) and leaving the random stream as it was; B = 0: the model
    unchanged."""
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed)
        names = model.add_lora(cfg.lora_rank, 2 * cfg.lora_rank,
                               [f'{t}_proj' for t in cfg.lora_targets.split(',')])
    log(f"stage 2: LoRA rank {cfg.lora_rank} on {len(names)} modules")
    return model

def shard(model, cfg, rt):
    """--fsdp: LoRA first when stage 2 runs (no module is replaced after sharding), then FSDP2 on
    every block, its frozen weights included, then the root. The attention cores stay whole on every
    process (stage 1, calibration and fidelity call them on captured q, k, v; DDP averages their
    gradients in stage 1)."""
    if cfg.stage2_iters:
        add_lora(model, cfg)
    cores = {p for c in model.attention_cores() for p in c.parameters()}
    for m in [*model.transformer.h, model]:
        fully_shard(m, ignored_params=cores)
    for c in model.attention_cores():
        c.to(rt.device)

def check_fits(cfg, c, layers):
    """The options the teacher (config c) bounds, converting `layers`; a UsageError in one line."""
    kv = len(layers) * c.n_kv_head
    side = min(c.n_embd, c.n_kv_head * c.head_dim)
    for name, most, what in [
        ('block_size', c.block_size, f"the teacher's {c.block_size} positions"),
        ('passkey_block', c.block_size, f"the teacher's {c.block_size} positions"),
        ('exact_heads', kv - 1, f"{kv - 1}: --layers has {kv} KV heads, all exact is the teacher"),
        ('lora_rank', side, f"{side}, the smallest side of q/k/v/o")]:
        if getattr(cfg, name) > most:
            raise UsageError(f"--{name} {getattr(cfg, name)} is more than {what}")

def load_teacher(cfg):
    """The teacher of cfg.init_from and the layers to convert, with the checks that need its
    config -> (model, num_labels, layers)."""
    num_labels = train.glue_num_labels(cfg.glue_task) if cfg.task == 'glue' else 0
    model, _ = M.load(cfg.init_from, **({'num_labels': num_labels} if num_labels else {}))
    c = model.config
    if cfg.task == 'glue' and c.family != 'bert':
        raise UsageError(f"--task glue needs a BERT model, this one is {c.family!r}")
    if cfg.task == 'lm' and c.family == 'bert' and cfg.stage2_iters:
        raise UsageError(
            "a BERT model has no next-token loss: use --task glue (or --stage2_iters 0)")
    layers = parse_layers(cfg.layers, c.n_layer)
    check_fits(cfg, c, layers)
    return model, num_labels, layers

def numbers(d):
    """['name value'] for each float of a dict (None: [])."""
    return [f"{k} {v:.4g}" for k, v in (d or {}).items() if isinstance(v, float)]

def run(cfg):
    """The whole conversion -> the summary (also out_dir/summary.json)."""
    t_start = time.time()
    rt = train.setup(cfg.device, 'float32', cfg.grad_accum)
    if cfg.fsdp and (not rt.ddp or cfg.task != 'lm' or not cfg.lora_rank):
        raise UsageError("--fsdp shards a --task lm conversion with LoRA (--lora_rank > 0) over "
                         "torchrun's processes: torchrun --nproc_per_node N convert.py ... --fsdp")
    if not rt.master:   # under torchrun rank 0 prints
        sys.stdout = open(os.devnull, 'w')
    torch.manual_seed(cfg.seed)
    model, num_labels, layers = load_teacher(cfg)
    c = model.config
    task = load_task(cfg, model)
    module = train.Classifier(model, num_labels) if cfg.task == 'glue' else model
    shard(model, cfg, rt) if cfg.fsdp else module.to(rt.device)
    calib = [task.next_batch(torch.Generator().manual_seed(cfg.seed + i))
             for i in range(CALIB_BATCHES)]
    log(f"converting {cfg.init_from} ({c.family}, {c.n_layer} layers, {c.n_head} heads of "
        f"{c.head_dim}) to {cfg.spec} on layers {layers}; loss {cfg.weights}")
    teacher = evaluate(model, module, task, cfg, rt, []).get('quality')
    summary = dict(config=asdict(cfg), attn=str(cfg.spec), family=c.family, layers=layers,
                   loss_weights=cfg.weights, teacher=teacher, stages={})
    if cfg.task == 'lm' and teacher:
        summary['unigram'] = unigram_loss(task.splits['train'], task.splits['val'], c.vocab_size)
    log("== teacher: " + ' | '.join(numbers(teacher)))
    if cfg.spec != A.AttnSpec():   # plain softmax: the control run, stage 2 on the teacher itself
        summary.update(swap(model, cfg, layers, teacher_qk(model, calib, layers, rt)))
    stages = {'swap': lambda: {},
              'stage1': lambda: transfer(model, task, cfg, rt, layers),
              'stage2': lambda: finetune(model, module, task, cfg, rt)}
    for name, step in stages.items():
        fit = step()
        if fit is None:   # a stage of 0 steps
            continue
        rec = summary['stages'][name] = dict(fit, **evaluate(model, module, task, cfg, rt, layers))
        kl = ' '.join(f"L{l}={v:.3f}" for l, v in rec['kl_layers'].items())
        log(f"== {name}: KL(teacher||student) mean {rec['kl_mean']:.4f} nats [{kl}], "
            + ' | '.join([f"output MSE {rec['mse_mean']:.4g}"] + numbers(rec.get('quality'))))
    return save_conversion(model, cfg, rt, summary, t_start)

def save_conversion(model, cfg, rt, summary, t_start):
    """out_dir/ckpt.pt (the new tensors, and the base it needs) and out_dir/summary.json, written
    by rank 0 -> the summary (None on the other ranks)."""
    full = cfg.stage2_iters and not cfg.lora_rank   # every weight trained: no base to keep
    # a local base by its absolute path, else a hub name
    base = os.path.abspath(cfg.init_from) if os.path.exists(cfg.init_from) else cfg.init_from
    tensors = None
    if cfg.fsdp:   # the whole state, gathered on rank 0
        tensors = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    summary['held'] = held(model, rt)
    if rt.ddp:
        dist.destroy_process_group()
    if not rt.master:
        return None
    M.save(os.path.join(cfg.out_dir, 'ckpt.pt'), model, base=None if full else base,
           keep=('classifier.',), tensors=tensors)
    summary['seconds'] = round(time.time() - t_start, 1)
    train.write_json(os.path.join(cfg.out_dir, 'summary.json'), summary)
    log(f"saved {cfg.out_dir}/ckpt.pt and summary.json ({summary['seconds']:.0f} s)")
    return summary

def held(model, rt):
    """What each process holds, one entry per process: {'param_bytes' (under FSDP: its shards and
    the whole cores), 'peak_bytes' (CUDA's most allocated; None on the CPU)}."""
    local = [p.to_local() if hasattr(p, 'to_local') else p for p in model.parameters()]
    cuda = rt.device.startswith('cuda')
    mine = dict(param_bytes=sum(p.nbytes for p in local),
                peak_bytes=torch.cuda.max_memory_allocated(rt.device) if cuda else None)
    out = [mine] * rt.world
    if rt.ddp:
        dist.all_gather_object(out, mine)
    return out

def unigram_loss(train_ids, val_ids, vocab_size):
    """Held-out cross-entropy (nats/token) of an add-one unigram model of the training tokens: the
    no-context baseline of the recovery figure."""
    counts = torch.bincount(torch.as_tensor(train_ids).flatten(), minlength=vocab_size)
    counts = counts.double() + 1.0   # add one
    return float(-(counts / counts.sum()).log()[torch.as_tensor(val_ids).flatten()].mean())

# ---- the table of several conversions, and the command line ------------------
def report(dirs):
    """A markdown table of conversions' summary.json: quality (perplexity, or the GLUE metric) of
    the teacher and after each stage, mean KL to the teacher's attention, recovery (lm: 100
    (L_unigram - L) / (L_unigram - L_teacher), the share of the teacher's gain over a unigram model)
    and wall time."""
    rows = ['| run | attn | teacher | swap | stage 1 | stage 2 | KL swap | KL stage 1 | KL stage 2 '
            '| recovery s1 % | recovery s2 % | time |',
            '|' + '---|' * 12]
    fmt = lambda x, spec: '-' if x is None else format(x, spec)
    for d in dirs:
        with open(os.path.join(d, 'summary.json')) as f:
            s = json.load(f)
        t = s.get('teacher')
        u = s.get('unigram')
        st = [s['stages'].get(n) or {} for n in ('swap', 'stage1', 'stage2')]
        # ppl or the GLUE metric: of the teacher, after the swap, stage 1 and stage 2
        quality = [t] + [x.get('quality') for x in st]
        cells = [fmt((q or {}).get('ppl', (q or {}).get('dev_main')), '.4g') for q in quality]
        cells += [fmt(x.get('kl_mean'), '.3f') for x in st]
        cells += [fmt(100 * (u - q['nll']) / (u - t['nll'])
                      if q and u and 'nll' in q and u > t['nll'] else None, '.1f')
                  for q in quality[2:]]   # recovery after stages 1 and 2
        rows.append(f"| {os.path.basename(os.path.normpath(d))} | {s['attn']} | "
                    f"{' | '.join(cells)} | {s['seconds']:.0f} s |")
    return '\n'.join(rows)

def main(argv=None):
    try:
        cfg, _ = train.parse_config(ConvertConfig, argv, __doc__)
        print(report([d for d in cfg.report.split(',') if d])) if cfg.report else run(cfg)
        return 0
    except train.USER_ERRORS as e:
        # the user's error in one line (a bug keeps its traceback)
        print(f"convert.py: error: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None

if __name__ == '__main__':
    main()
