"""
Convert a pretrained softmax Transformer into a linear-attention one.

    python convert.py --init_from gpt2 --attn hedgehog --data ../shared/data/tinyshakespeare/input.txt \
        --out_dir out-convert --stage1_iters 200 --stage2_iters 200 --lora_rank 8

The pipeline follows Hedgehog (Zhang et al. 2024, App. A.3), LoLCATs (Zhang et al. 2024, Sec. 3) and
DoF (Nishikawa et al. 2025, Sec. 3):

 0. load the teacher (a HuggingFace hub name or folder, or one of our own checkpoints) and swap every
    attention core (or the `--layers` subset) for the chosen map; the q/k/v/o projections are kept.
 1. attention transfer: the teacher's weights are frozen and only the new parameters (feature maps,
    window factors) train.  One forward pass of the model with every core in teacher mode (exact
    softmax) captures each layer's (q, k, v) and softmax output; every student core is then trained on
    its own layer's teacher inputs (teacher forcing, so the layers train independently, all at once).
    Losses: soft-label cross-entropy on the attention weights (Hedgehog Eq. 4, quadratic in T), MSE on
    the attention outputs (LoLCATs, computed through the chunked linear path, never T x T) and the L2
    kernel loss (DoF); any weighted sum of them.
 2. optional feature-dimension selection (DoF Algorithm 1, see `select_feature_dims`).
 3. finetune: LoRA on q/k/v/o (rank 8, alpha 16 by default; `LoRALinear` below) or full finetuning,
    with the next-token loss (or the GLUE task loss for a BERT classifier).
 4. save only what changed (new parameters, LoRA factors; every weight for a full finetune) with a
    manifest naming the base model; `load_converted(out_dir)` rebuilds and reloads strictly.

Fidelity (KL between the teacher's softmax weights and the student's, per layer) and quality (held-out
perplexity, or the GLUE metric) are measured before and after every stage and written to
`<out_dir>/summary.json`.  `python convert.py --report DIR [DIR ...]` prints a table of several runs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

MANIFEST = 'manifest.json'
PARAMS_FILE = 'new_parameters.safetensors'
SUMMARY = 'summary.json'
FORMAT = 'convert.py/1'


class ConversionError(ValueError):
    """Bad input to the conversion (reported as a one-line error by the command line)."""


# ----------------------------------------------------------------------------------------------------
# LoRA

class LoRALinear(nn.Linear):
    """y = x W^T + b + (alpha / r) * x A^T B^T, with W and b frozen and A (r, in), B (out, r) trained.

    It *is* an nn.Linear that shares the wrapped layer's `weight` and `bias` Parameters, so the base
    weights keep their state-dict names (`...q_proj.weight`) and code that reads `.weight` still works;
    the adapter adds `...q_proj.lora_A` and `...q_proj.lora_B`.  B starts at zero, so a fresh adapter
    leaves the outputs unchanged (Hu et al. 2021).
    """

    def __init__(self, base: nn.Linear, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0):
        nn.Module.__init__(self)
        if rank < 1:
            raise ValueError(f'LoRA rank must be >= 1, got {rank}')
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.rank, self.alpha = int(rank), float(alpha)
        self.scaling = self.alpha / self.rank
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=w.device, dtype=w.dtype))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, device=w.device, dtype=w.dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        return y + F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B) * self.scaling

    def extra_repr(self):
        return f'{self.in_features}, {self.out_features}, rank={self.rank}, alpha={self.alpha:g}'

    @torch.no_grad()
    def merged(self) -> nn.Linear:
        """A plain nn.Linear with the adapter folded into the weight."""
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        device=self.weight.device, dtype=self.weight.dtype)
        lin.weight.copy_(self.weight + self.scaling * self.lora_B @ self.lora_A)
        if self.bias is not None:
            lin.bias.copy_(self.bias)
        return lin


# names (last path component) of the attention input/output projections in the layouts we load
_QKV_NAMES = {'q_proj', 'k_proj', 'v_proj', 'o_proj', 'c_attn', 'qkv', 'qkv_proj', 'wq', 'wk', 'wv', 'wo',
              'query', 'key', 'value', 'out_proj', 'q', 'k', 'v', 'o'}
_OUT_NAMES = {'c_proj', 'proj', 'dense', 'out', 'o'}
_ATTN_PARENTS = ('attn', 'attention', 'self_attn')


def default_lora_targets(model: nn.Module) -> list[str]:
    """Qualified names of the q/k/v/o nn.Linear modules of `model` (attention projections only)."""
    out = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear) or isinstance(mod, LoRALinear):
            continue
        parts = name.split('.')
        last, parents = parts[-1], parts[:-1]
        in_attn = any(any(a in p.lower() for a in _ATTN_PARENTS) for p in parents)
        if last in _QKV_NAMES and (in_attn or last in {'q_proj', 'k_proj', 'v_proj', 'o_proj', 'c_attn'}):
            out.append(name)
        elif last in _OUT_NAMES and in_attn:
            out.append(name)
    return out


def apply_lora(model: nn.Module, rank: int = 8, alpha: float = 16.0, targets=None, dropout: float = 0.0):
    """Replace the target nn.Linear modules by LoRALinear in place; returns the list of names.

    `targets`: None (the q/k/v/o projections, see default_lora_targets), or a list of qualified names
    or name suffixes (e.g. ['q_proj', 'v_proj'])."""
    all_linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)
                  and not isinstance(m, LoRALinear)]
    if targets is None:
        names = default_lora_targets(model)
    else:
        names = []
        for t in targets:
            hit = [n for n in all_linear if n == t or n.endswith('.' + t)]
            if not hit:
                raise ConversionError(f'LoRA target {t!r} matches no nn.Linear module')
            names += [n for n in hit if n not in names]
    if not names:
        raise ConversionError('found no attention projections to put LoRA on; pass --lora_targets')
    for name in names:
        parent_name, _, child = name.rpartition('.')
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(getattr(parent, child), rank=rank, alpha=alpha, dropout=dropout))
    return names


def lora_parameters(model: nn.Module):
    return [p for m in model.modules() if isinstance(m, LoRALinear) for p in (m.lora_A, m.lora_B)]


# ----------------------------------------------------------------------------------------------------
# DoF feature-dimension selection (Nishikawa et al. 2025, Sec. 3, Algorithm 1; DoF + Clip: Sec. 4.2)
#
# Per head: J points drawn from the pooled teacher queries and keys (after RoPE), the kernel Gram matrix
# divided by J, N_lambda = tr(S/J (S/J + lambda I)^-1); layer DoF = max over heads; M_s = C N_s / mean N_s,
# so the mean cost is C.  The paper gives no J: we use 256.  DoF + Clip clamps M_s at the head size.

DOF_LAMBDA_GPT2 = 2 ** -4  # the paper's lambda for GPT-2 (Sec. 4.1; 2^-8 for Pythia-1B)


def exp_gram(x: torch.Tensor) -> torch.Tensor:
    """S / J: the softmax kernel's Gram matrix [exp(x_i . x_j / sqrt D)] of x (J, D), divided by J (float64).

    Sec. 3.1 defines DoF as tr(Sigma (Sigma + lambda I)^-1) of the kernel's integral operator Sigma; the
    eigenvalues of S / J estimate Sigma's, so its DoF converges as J grows.  Algorithm 1 writes the Gram matrix
    S itself: our departure.  Undivided, tr(S (S + lambda I)^-1) is the divided DoF at lambda / J, which drifts
    towards J as J grows (tests/test_dof.py measures both)."""
    x = x.double()
    logits = x @ x.T / math.sqrt(x.shape[-1])      # (J, J)
    return torch.exp(logits.clamp(max=700.0)) / x.shape[0]  # float64 overflows at exp(709)


def degrees_of_freedom(gram: torch.Tensor, lam: float) -> float:
    """N_lambda = tr(G (G + lam I)^-1) = sum_i s_i / (s_i + lam) over the eigenvalues s_i of a symmetric G."""
    if lam <= 0:
        raise ValueError(f'lambda must be > 0, got {lam}')
    s = torch.linalg.eigvalsh(gram.double()).clamp(min=0)  # negative round-off -> 0
    return float((s / (s + lam)).sum())


def head_dofs(q: torch.Tensor, k: torch.Tensor, lam: float, n_samples: int = 256,
              generator: torch.Generator | None = None) -> list[float]:
    """DoF of each head (Algorithm 1's loop over heads): J = n_samples points drawn without replacement from
    the head's 2M pooled queries and keys; q, k (H, M, D)."""
    pool = torch.cat([q, k], 1)  # (H, 2M, D)
    return [degrees_of_freedom(exp_gram(x[torch.randperm(len(x), generator=generator)[:n_samples]]), lam)
            for x in pool]


def allocate_dims(dofs, budget: float, clip: int | None = None, min_dim: int = 1) -> list[int]:
    """Per-layer feature dimensions M_s = C dof_s / mean(dof) (Algorithm 1, last line; C = `budget`).

    Ours: the mean is exact (the paper rounds each layer on its own): shares below min_dim are raised to it,
    the others share the rest in proportion, rounded by largest remainder so the dims sum to round(C L).
    clip: DoF + Clip (Sec. 4.2, at the head size): then clamped, nothing redistributed (mean cost < C)."""
    dofs, L = [float(d) for d in dofs], len(dofs)
    if L == 0:
        return []
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
    floored: set[int] = set()
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
    order = sorted(range(L), key=lambda i: (real[i] - math.floor(real[i] + 1e-9), w[i]), reverse=True)
    for i in order[:max(0, total - sum(dims))]:  # largest remainders first (fewer than L units are left)
        dims[i] += 1
    return dims if clip is None else [min(d, int(clip)) for d in dims]


def select_feature_dims(layer_qk: dict, budget: float, lam: float = DOF_LAMBDA_GPT2, n_samples: int = 256,
                        clip: int | None = None, min_dim: int = 2, seed: int = 0, verbose: bool = True):
    """DoF Algorithm 1 (+ Clip): layer_qk {layer: (q, k)}, q, k (H, M, D) teacher queries/keys after RoPE.
    Returns (dims {layer: int}, table: a dict per layer; with a clip each also has 'unclipped')."""
    g = torch.Generator().manual_seed(seed)
    layers = sorted(layer_qk)
    per_head = [head_dofs(*layer_qk[l], lam, n_samples, g) for l in layers]
    layer_dof = [max(d) for d in per_head]
    dims = allocate_dims(layer_dof, budget, clip=clip, min_dim=min_dim)
    free = allocate_dims(layer_dof, budget, min_dim=min_dim)
    table = [dict(layer=l, dof_heads=[round(x, 3) for x in h], dof_max=round(d, 3), feature_dim=fd,
                  **({'unclipped': u} if clip is not None else {}))
             for l, h, d, fd, u in zip(layers, per_head, layer_dof, dims, free)]
    if verbose:
        print(format_dof_table(table, budget, lam, n_samples, clip))
    return dict(zip(layers, dims)), table


def format_dof_table(table, budget, lam, n_samples, clip=None) -> str:
    """The per-layer DoF table (markdown) with its settings, the mean cost and a note where DoF nears J."""
    c = clip is not None
    lines = [f'DoF feature-dimension selection (DoF Alg. 1): lambda={lam:g}, J={n_samples}, '
             f'G = exp(x_i.x_j/sqrt d) / J, budget C={budget:g}' + (f', DoF + Clip at {clip}' if c else ''),
             '| layer | DoF per head | max DoF | feature_dim |' + (' before clip |' if c else ''),
             '|---|---|---|---|' + ('---|' if c else '')]
    lines += [f"| {r['layer']} | {' '.join(f'{x:.1f}' for x in r['dof_heads'])} | {r['dof_max']:.2f} | "
              f"{r['feature_dim']} |" + (f" {r['unclipped']} |" if c else '') for r in table]
    if table:
        n_clipped = sum(r['unclipped'] > r['feature_dim'] for r in table) if c else 0
        lines.append(f"mean feature_dim = {sum(r['feature_dim'] for r in table) / len(table):g} (budget C = "
                     f'{budget:g}' + (f'; {n_clipped} of {len(table)} layers clipped at {clip}' if c else '') + ')')
        top = max(r['dof_max'] for r in table)
        if top > 0.9 * n_samples:
            lines.append(f'note: max DoF {top:.1f} is near J = {n_samples}, where the estimate saturates; '
                         'a larger --dof_lambda separates the layers')
    return '\n'.join(lines)


# ----------------------------------------------------------------------------------------------------
# teacher forcing: capture every core's (q, k, v) and softmax output from one forward pass

class TeacherCapture:
    """Forward hooks on the attention cores.  Inside `with cap.teacher():` every core computes exact
    softmax attention (core.teacher = True), so the residual stream is the teacher's, and the inputs
    (q, k, v, kwargs) and outputs of the cores in `layers` are recorded (detached)."""

    def __init__(self, cores, layers):
        self.cores, self.layers = list(cores), list(layers)
        self.active = False
        self.inputs: dict = {}
        self.outputs: dict = {}
        self.handles = []
        for i in self.layers:
            c = self.cores[i]
            self.handles.append(c.register_forward_pre_hook(self._pre_hook(i), with_kwargs=True))
            self.handles.append(c.register_forward_hook(self._hook(i), with_kwargs=True))

    def _pre_hook(self, i):
        def hook(mod, args, kwargs):
            if self.active:
                names = ['q', 'k', 'v']
                qkv = list(args[:3]) + [kwargs[n] for n in names[len(args[:3]):] if n in kwargs]
                if len(qkv) != 3:
                    raise RuntimeError('attention core called without (q, k, v)')
                kw = {n: v for n, v in kwargs.items() if n not in names}
                kw.pop('state', None)
                kw.pop('return_state', None)
                self.inputs[i] = (tuple(t.detach() for t in qkv),
                                  {n: (v.detach() if torch.is_tensor(v) else v) for n, v in kw.items()})
        return hook

    def _hook(self, i):
        def hook(mod, args, kwargs, out):
            if self.active:
                y = out[0] if isinstance(out, (tuple, list)) else out
                self.outputs[i] = y.detach()
        return hook

    @contextmanager
    def teacher(self):
        flags = [c.teacher for c in self.cores]
        for c in self.cores:
            c.teacher = True
        self.inputs, self.outputs, self.active = {}, {}, True
        try:
            yield self
        finally:
            self.active = False
            for c, f in zip(self.cores, flags):
                c.teacher = f

    @torch.no_grad()
    def record(self, model, batch):
        """One frozen teacher pass: every recorded layer's ((q, k, v), kwargs) into self.inputs and its exact
        softmax output into self.outputs."""
        with self.teacher():
            model_forward(model, batch)

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []


def _masked_weights(w, key_mask):
    """Zero the padded keys of attention weights (B, H, T, T) and renormalise the rows."""
    if key_mask is None:
        return w
    w = w * key_mask[:, None, None, :].to(w.dtype)
    return w / w.sum(-1, keepdim=True).clamp(min=1e-12)


def _row_mean(x, key_mask):
    """Mean of per-row values (B, H, T) over the real (unpadded) query rows."""
    if key_mask is None:
        return x.mean()
    m = key_mask[:, None, :].to(x.dtype).expand_as(x)
    return (x * m).sum() / m.sum().clamp(min=1)


def transfer_losses(core, q, k, v, y_teacher, kw, weights: dict) -> dict:
    """The stage-1 losses of one student core on its teacher inputs: {'ce', 'mse', 'l2'} (those with
    a non-zero weight).  ce: Hedgehog Eq. 4 on the attention weights (T x T); mse: LoLCATs, student
    output through the core's own (chunked) linear path; l2: the DoF kernel loss."""
    import attention as A
    out = {}
    mask = kw.get('key_padding_mask')
    causal = getattr(core, 'causal', True)
    if weights.get('ce', 0) > 0:
        w_t = A.softmax_weights(q, k, causal=causal)
        w_s = core.weights(q, k, key_padding_mask=mask)
        if mask is None:
            out['ce'] = A.attention_cross_entropy(w_s, w_t)
        else:
            w_t, w_s = _masked_weights(w_t, mask), _masked_weights(w_s, mask)
            ce = -(w_t * torch.log(w_s.clamp(min=1e-12))).sum(-1)
            out['ce'] = _row_mean(ce, mask)
    if weights.get('mse', 0) > 0:
        y_s = core(q, k, v, **kw)
        out['mse'] = A.output_mse(y_s, y_teacher)
    if weights.get('l2', 0) > 0:
        if core.fmap is None:
            raise ConversionError('the l2 kernel loss needs a feature map')
        phi_q, phi_k, c_q = core.fmap.features(q, k, offset=0)
        phi_q = phi_q * torch.exp(c_q)[..., None]  # the exact query features (the kernel is compared unnormalised)
        if mask is not None:  # only real keys and queries
            keep = mask.bool()
            out['l2'] = sum(A.kernel_l2(phi_q[b:b + 1, :, keep[b]], phi_k[b:b + 1, :, keep[b]],
                                        q[b:b + 1, :, keep[b]], k[b:b + 1, :, keep[b]], causal=causal)
                            for b in range(q.shape[0])) / q.shape[0]
        else:
            out['l2'] = A.kernel_l2(phi_q, phi_k, q, k, causal=causal)
    return out


# ----------------------------------------------------------------------------------------------------
# loading the base model, swapping attention, saving and reloading

def load_base(init_from: str, device='cpu', **overrides):
    """Load the teacher: one of our checkpoint files (model.save_checkpoint, e.g. train.py's ckpt.pt; a
    folder holding one also works), a local HuggingFace folder, a llama.cpp .gguf file, or a hub name (needs
    internet). model.tokenizer is the checkpoint's own tokenizer, or None.
    Returns (model, info) with info = {'base', 'base_kind', 'extra'}."""
    import model as M
    looks_local = os.path.sep in init_from or init_from.startswith('.') or init_from.endswith(
        ('.pt', '.safetensors', '.json', '.gguf'))
    extra = {}
    try:
        if os.path.isfile(init_from) and init_from.endswith('.gguf'):     # llama.cpp file (model.load_gguf)
            base = os.path.abspath(init_from)
            model, kind = M.GPT.from_pretrained(base, **overrides), 'gguf'
        elif os.path.isfile(init_from) or (os.path.isdir(init_from) and _own_checkpoint_in(init_from)):
            path = os.path.abspath(init_from if os.path.isfile(init_from) else _own_checkpoint_in(init_from))
            if overrides:
                model = M.GPT.from_pretrained(path, **overrides)
            else:
                model, extra = M.load_checkpoint(path)
            kind, base = 'checkpoint', path
        elif os.path.isdir(init_from):
            base = os.path.abspath(init_from)
            model, kind = M.GPT.from_pretrained(base, **overrides), 'hf'
        elif looks_local:
            raise ConversionError(f'--init_from {init_from!r}: no such checkpoint file or folder')
        else:
            kind, base = 'hub', init_from
            try:
                model = M.GPT.from_pretrained(init_from, **overrides)
            except Exception as e:  # offline, unknown name, ...
                raise ConversionError(f'could not load {init_from!r} from the HuggingFace hub '
                                      f'({type(e).__name__}: {_first_line(e)}); pass a local HuggingFace '
                                      'folder or one of our checkpoints') from e
    except ConversionError:
        raise
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise ConversionError(f'cannot load --init_from {init_from!r}: {type(e).__name__}: {_first_line(e)}') from e
    model.to(device)
    model.eval()
    return model, {'base': base, 'base_kind': kind, 'extra': extra or {}}


def _first_line(e):
    s = str(e)
    return s.splitlines()[0][:300] if s else ''


def _own_checkpoint_in(folder):
    """train.py's output folder: the checkpoint file in it (None for a HuggingFace folder)."""
    if os.path.isfile(os.path.join(folder, 'config.json')):
        return None
    for name in ('ckpt.pt', 'ckpt.safetensors', 'model.pt'):
        if os.path.isfile(os.path.join(folder, name)):
            return os.path.join(folder, name)
    return None


def parse_layers(spec, n_layer: int) -> list[int]:
    """'all' / None -> every layer; '0,2,5' or '0-3' (negative indices count from the end)."""
    if spec in (None, '', 'all'):
        return list(range(n_layer))
    out = []
    for part in str(spec).split(','):
        part = part.strip()
        m = re.fullmatch(r'(\d+)-(\d+)', part)
        try:
            idx = list(range(int(m.group(1)), int(m.group(2)) + 1)) if m else [int(part)]
        except ValueError:
            raise ConversionError(f'bad --layers entry {part!r}; use e.g. "0,2,5", "0-3", "-1" or "all"') from None
        for i in idx:
            j = i + n_layer if i < 0 else i
            if not 0 <= j < n_layer:
                raise ConversionError(f'unknown layer index {i}: the model has {n_layer} layers '
                                      f'(valid 0..{n_layer - 1})')
            if j not in out:
                out.append(j)
    return sorted(out)


def swap_attention(model, attn, layers, window=0, diag_block=0, map_options=None, layer_options=None,
                   max_feature_dim=None, window_combine='joint'):
    """model.set_attention on `layers` (one call per group of layers sharing their options; per-layer
    options such as a DoF-selected feature_dim come in layer_options {layer: {option: value}}).
    Errors (an unknown map, options the map rejects, a head_dim the map cannot take, a feature
    dimension above max_feature_dim) are ConversionError."""
    import attention as A
    if attn not in A.ATTN_CHOICES:
        raise ConversionError(f'unknown --attn {attn!r}; choose from {", ".join(A.ATTN_CHOICES)}')
    if attn == 'softmax':
        raise ConversionError('--attn softmax is the teacher itself; choose a linear map: '
                              + ', '.join(A.FEATURE_MAPS))
    map_options = dict(map_options or {})
    layer_options = layer_options or {}
    hd = model.config.head_dim
    groups: dict = {}
    for l in layers:
        opts = {**map_options, **layer_options.get(l, {})}
        groups.setdefault(json.dumps(opts, sort_keys=True), (opts, []))[1].append(l)
    for opts, ls in groups.values():
        try:
            model.set_attention(attn, layers=ls, window=window, diag_block=diag_block, window_combine=window_combine,
                                **dict(opts))
        except (ValueError, AssertionError, TypeError) as e:
            raise ConversionError(f'cannot convert layers {ls} of this model (head_dim={hd}) to {attn!r} '
                                  f'with options {opts}, window={window}, diag_block={diag_block}: '
                                  f'{_first_line(e)}') from e
    cores = model.attention_cores()
    if max_feature_dim:
        for l in layers:
            F_ = cores[l].fmap.feature_dim
            if F_ > max_feature_dim:
                raise ConversionError(f'{attn!r} on head_dim={hd} has feature dimension {F_} > '
                                      f'--max_feature_dim {max_feature_dim} (e.g. taylor grows as 1 + D + D^2); '
                                      'choose another map or raise --max_feature_dim')
    return cores


def _is_lora_name(k):
    return k.endswith(('.lora_A', '.lora_B'))


def new_state_dict(model, finetune: str, extra_prefixes=()) -> dict:
    """The tensors that differ from the base model: the attention cores' parameters and buffers (feature
    maps, window factors, LLN statistics, Performer projections), the LoRA factors and any module named
    in extra_prefixes (a GLUE classifier head, new and trained); every tensor of the model after a full
    finetune (the tied lm_head duplicate excluded)."""
    import model as M
    sd = model.state_dict()
    if model.config.family != 'bert' and model.config.tie_embeddings:
        sd.pop('lm_head.weight', None)
    if finetune == 'full':
        return dict(sd)
    return {k: v for k, v in sd.items() if M.is_new_parameter(k) or _is_lora_name(k)
            or k.startswith(tuple(extra_prefixes))}


def save_converted(out_dir, model, manifest: dict):
    """Write out_dir/new_parameters.safetensors and out_dir/manifest.json (both atomically, manifest last).
    The manifest has model.save_new_parameters' fields (base_model, config, layers, parameters, tokenizer) plus
    format 'convert.py/1' and `convert` (LoRA, finetune mode, overrides, ...) for load_converted. The tokenizer
    goes to out_dir/tokenizer_spec.json; its manifest entry also holds the fingerprint of the base model's own
    tokenizer (manifest['base_tokenizer'], None if it had none), which load_converted checks."""
    from dataclasses import asdict
    from safetensors.torch import save_file
    import tokenizer as tokenizer_lib
    os.makedirs(out_dir, exist_ok=True)
    tensors = {k: v.detach().to('cpu').clone().contiguous()
               for k, v in new_state_dict(model, manifest['finetune'], manifest.get('extra_prefixes', ())).items()}
    # (a parameter-free map without stage 2 -- elu, cosformer, taylor -- saves an empty file: the manifest
    # alone rebuilds it)
    full = dict(format=FORMAT, base_model=str(manifest['base_model']), config=asdict(model.config),
                layers=model.layer_specs, parameters={k: list(v.shape) for k, v in tensors.items()},
                convert={k: v for k, v in manifest.items() if k != 'base_model'})
    json.dumps(full, default=_json_default)
    tmp = os.path.join(out_dir, '.' + PARAMS_FILE + '.tmp')
    save_file(tensors, tmp)
    os.replace(tmp, os.path.join(out_dir, PARAMS_FILE))
    full['tokenizer'] = tokenizer_lib.save_spec(out_dir, getattr(model, 'tokenizer', None))
    if full['tokenizer'] is not None and 'base_tokenizer' in manifest:
        full['tokenizer']['base_fingerprint'] = manifest['base_tokenizer']
    _write_json(os.path.join(out_dir, MANIFEST), full)
    return full


def _write_json(path, obj):
    tmp = os.path.join(os.path.dirname(path) or '.', '.' + os.path.basename(path) + '.tmp')
    with open(tmp, 'w') as f:
        json.dump(obj, f, indent=2, default=_json_default)
    os.replace(tmp, path)


def _json_default(o):
    if torch.is_tensor(o):
        return o.tolist()
    return str(o)


def read_manifest(out_dir):
    mpath = os.path.join(out_dir, MANIFEST)
    if not os.path.isfile(mpath):
        raise ConversionError(f'{out_dir}: no {MANIFEST} (not a convert.py output folder)')
    with open(mpath) as f:
        manifest = json.load(f)
    if manifest.get('format') != FORMAT:
        raise ConversionError(f'{mpath}: format {manifest.get("format")!r} is not {FORMAT!r}')
    return manifest


def build_converted(manifest: dict, device='cpu', init_from=None):
    """Base model + the manifest's per-layer attention + LoRA adapters (weights not loaded yet)."""
    conv = manifest['convert']
    model, _ = load_base(init_from or manifest['base_model'], device, **conv.get('overrides', {}))
    model._apply_layer_specs(manifest['layers'])
    lora = conv.get('lora')
    if lora:
        apply_lora(model, lora['rank'], lora['alpha'], targets=lora['targets'])
    return model.to(device)


def load_converted(out_dir, device='cpu', init_from=None):
    """Rebuild a converted model from out_dir and load its saved tensors strictly (model.load_new_parameters
    plus an exact key-set check: the file must hold precisely the rebuilt model's new tensors).
    `init_from` overrides the base named in the manifest (e.g. when the base folder moved)."""
    import model as M
    manifest = read_manifest(out_dir)
    model = build_converted(manifest, device, init_from)
    conv = manifest['convert']
    expected = set(new_state_dict(model, conv['finetune'], conv.get('extra_prefixes', ())))
    saved = set(manifest['parameters'])
    if expected != saved:
        raise ConversionError(f'{out_dir}: saved parameters do not match the rebuilt model (missing '
                              f'{sorted(expected - saved)[:5]}, unexpected {sorted(saved - expected)[:5]})')
    try:
        M.load_new_parameters(out_dir, model, map_location=device)
    except ValueError as e:
        raise ConversionError(f'{out_dir}: {_first_line(e)}') from e
    for c in model.attention_cores():
        c.teacher = False
    model.requires_grad_(False)
    return model.eval()


# ----------------------------------------------------------------------------------------------------
# data: token streams for language modelling, padded sentence batches for a GLUE classifier

class LMData:
    """Next-token data: random block_size windows of the training tokens; fixed, non-overlapping
    windows of the held-out tokens for evaluation."""

    def __init__(self, train_ids, val_ids, block_size, batch_size, seed=0):
        self.train = torch.as_tensor(train_ids, dtype=torch.long).flatten()
        self.val = torch.as_tensor(val_ids, dtype=torch.long).flatten()
        for name, ids in (('training', self.train), ('held-out', self.val)):
            if ids.numel() < block_size + 2:
                raise ConversionError(f'the {name} text has {ids.numel()} tokens, fewer than --block_size '
                                      f'{block_size} + 2; use more text or a smaller --block_size')
        self.block_size, self.batch_size = block_size, batch_size
        self.gen = torch.Generator().manual_seed(seed)

    def batch(self, split='train'):
        ids = self.train if split == 'train' else self.val
        ix = torch.randint(ids.numel() - self.block_size - 1, (self.batch_size,), generator=self.gen)
        x = torch.stack([ids[i:i + self.block_size] for i in ix.tolist()])
        y = torch.stack([ids[i + 1:i + 1 + self.block_size] for i in ix.tolist()])
        return {'idx': x, 'targets': y}

    def eval_batches(self, n_batches, split='val'):
        ids = self.val if split == 'val' else self.train
        T, B = self.block_size, self.batch_size
        n_win = min((ids.numel() - 1) // T, n_batches * B)
        out = []
        for s in range(0, n_win, B):
            w = list(range(s, min(s + B, n_win)))
            x = torch.stack([ids[i * T:(i + 1) * T] for i in w])
            y = torch.stack([ids[i * T + 1:(i + 1) * T + 1] for i in w])
            out.append({'idx': x, 'targets': y})
        return out

    def tokens(self, batch):
        return batch['idx'].numel()


class GlueData:
    """A GLUE task: (input_ids, attention_mask, token_type_ids, label) examples, padded per batch."""

    def __init__(self, train, dev, batch_size, task, pad_id=0, seed=0, max_len=None):
        self.train_ex, self.dev_ex = train, dev
        self.batch_size, self.task, self.pad_id, self.max_len = batch_size, task, pad_id, max_len
        self.gen = torch.Generator().manual_seed(seed)

    def _collate(self, exs):
        ids = [list(e['input_ids'])[:self.max_len] if self.max_len else list(e['input_ids']) for e in exs]
        T = max(len(i) for i in ids)
        x = torch.full((len(ids), T), self.pad_id, dtype=torch.long)
        m = torch.zeros(len(ids), T, dtype=torch.bool)
        tt = torch.zeros(len(ids), T, dtype=torch.long)
        for r, (e, i) in enumerate(zip(exs, ids)):
            x[r, :len(i)] = torch.tensor(i)
            m[r, :len(i)] = True
            if e.get('token_type_ids') is not None:
                t = list(e['token_type_ids'])[:len(i)]
                tt[r, :len(t)] = torch.tensor(t)
        labs = [e['label'] for e in exs]
        lab = torch.tensor(labs, dtype=torch.float32 if isinstance(labs[0], float) else torch.long)
        return {'idx': x, 'attention_mask': m, 'token_type_ids': tt, 'labels': lab}

    def batch(self, split='train'):
        exs = self.train_ex if split == 'train' else self.dev_ex
        ix = torch.randint(len(exs), (self.batch_size,), generator=self.gen).tolist()
        return self._collate([exs[i] for i in ix])

    def eval_batches(self, n_batches, split='val'):
        exs = self.dev_ex if split == 'val' else self.train_ex
        n = len(exs) if n_batches <= 0 else min(len(exs), n_batches * self.batch_size)
        return [self._collate(exs[s:s + self.batch_size]) for s in range(0, n, self.batch_size)]

    def tokens(self, batch):
        return int(batch['attention_mask'].sum())


def unigram_loss(train_ids, val_ids, vocab_size) -> float:
    """Held-out cross-entropy (nats/token) of an add-one-smoothed unigram model of the training tokens:
    the 'no context' baseline for the recovery percentage."""
    counts = torch.bincount(torch.as_tensor(train_ids).flatten(), minlength=vocab_size).double() + 1.0
    logp = (counts / counts.sum()).log()
    return float(-logp[torch.as_tensor(val_ids).flatten()].mean())


# ----------------------------------------------------------------------------------------------------
# evaluation

def _family(model):
    return getattr(getattr(model, 'config', None), 'family', 'gpt2')


def model_forward(model, batch):
    """The forward pass used for teacher forcing: the final hidden states (no LM head, no loss -- the capture
    only needs every layer's attention inputs and outputs)."""
    if _family(model) == 'bert':
        return model.encode(batch['idx'], attention_mask=batch.get('attention_mask'),
                            token_type_ids=batch.get('token_type_ids'))
    return model._hidden(batch['idx'])[0]


def _to(batch, device):
    return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}


@torch.no_grad()
def evaluate_quality(model, batches, device, task='lm', glue_task=None):
    """Held-out quality: {'loss', 'ppl'} for language modelling (token-weighted mean next-token loss),
    {'loss', 'metric', <name>: value} for a GLUE classifier (train.glue_metric)."""
    was = model.training
    model.eval()
    try:
        if task == 'lm':
            tot, n = 0.0, 0
            for b in batches:
                b = _to(b, device)
                _, loss = model(b['idx'], targets=b['targets'])
                k = int((b['targets'] != -100).sum())
                tot += float(loss) * k
                n += k
            loss = tot / max(n, 1)
            return {'loss': loss, 'ppl': math.exp(min(loss, 50.0))}
        tot, n, preds, labels = 0.0, 0, [], []
        for b in batches:
            b = _to(b, device)
            logits, loss = model.classify(b['idx'], attention_mask=b['attention_mask'],
                                          token_type_ids=b['token_type_ids'], labels=b['labels'])
            tot += float(loss) * len(b['labels'])
            n += len(b['labels'])
            preds.append(logits.squeeze(-1) if logits.shape[-1] == 1 else logits.argmax(-1))
            labels.append(b['labels'])
        out = {'loss': tot / max(n, 1)}
        out.update(_glue_metric(glue_task, torch.cat(preds).cpu().numpy(), torch.cat(labels).cpu().numpy()))
        return out
    finally:
        model.train(was)


def _glue_metric(glue_task, preds, labels) -> dict:
    import train
    m = train.glue_metric(glue_task, preds, labels)
    if isinstance(m, dict):
        return {k: float(v) for k, v in m.items()}
    return {'metric': float(m)}


@torch.no_grad()
def evaluate_fidelity(model, capture: TeacherCapture, layers, batches, device):
    """Per-layer mean KL(teacher softmax weights || student weights) in nats, and the mean squared error of the
    attention outputs (LoLCATs' transfer loss), on held-out batches, each layer on its own teacher-forced
    (q, k, v) (so the figures are per layer, not compounded). Returns {'kl_mean', 'kl_layers', 'mse_mean',
    'mse_layers'}; quadratic in T (evaluation only)."""
    import attention as A
    cores = model.attention_cores()
    was = model.training
    model.eval()
    sums = {l: 0.0 for l in layers}
    mses = {l: 0.0 for l in layers}
    count = 0
    try:
        for b in batches:
            capture.record(model, _to(b, device))
            for l in layers:
                (q, k, v), kw = capture.inputs[l]
                mask = kw.get('key_padding_mask')
                causal = getattr(cores[l], 'causal', True)
                w_t = _masked_weights(A.softmax_weights(q, k, causal=causal), mask)
                w_s = _masked_weights(cores[l].weights(q, k, key_padding_mask=mask), mask)
                sums[l] += float(_row_mean(A.kl_divergence(w_t, w_s), mask))
                err = (cores[l](q, k, v, **kw).float() - capture.outputs[l].float()).square().mean(-1)  # (B, H, T)
                mses[l] += float(_row_mean(err, mask))
            count += 1
    finally:
        model.train(was)
    kl = {l: sums[l] / max(count, 1) for l in layers}
    mse = {l: mses[l] / max(count, 1) for l in layers}
    return {'kl_mean': sum(kl.values()) / max(len(kl), 1), 'kl_layers': {str(l): v for l, v in kl.items()},
            'mse_mean': sum(mse.values()) / max(len(mse), 1), 'mse_layers': {str(l): v for l, v in mse.items()}}


@torch.no_grad()
def collect_qk(model, capture: TeacherCapture, layers, batches, device, max_tokens=4096):
    """Teacher queries and keys of each layer on calibration batches: {layer: (q, k)} with q, k
    (H, M, D) float32 (tokens pooled over batch and time; padded tokens dropped), M <= max_tokens."""
    qs = {l: [] for l in layers}
    ks = {l: [] for l in layers}
    for b in batches:
        capture.record(model, _to(b, device))
        for l in layers:
            (q, k, _v), kw = capture.inputs[l]
            mask = kw.get('key_padding_mask')
            q, k = q.float().transpose(0, 1), k.float().transpose(0, 1)  # (H, B, T, D)
            if mask is not None:
                q, k = q[:, mask.bool()], k[:, mask.bool()]
            else:
                q, k = q.flatten(1, 2), k.flatten(1, 2)
            qs[l].append(q.cpu())
            ks[l].append(k.cpu())
    return {l: (torch.cat(qs[l], 1)[:, :max_tokens], torch.cat(ks[l], 1)[:, :max_tokens]) for l in layers}


@torch.no_grad()
def calibrate_cores(model, capture, layers, batches, device):
    """Data-dependent initialisation on calibration batches: LLN's moment matching (the teacher's query/key
    variances), and the 'mix' window hybrid's s = the teacher's mean softmax mass inside the window
    (attention.window_mass, see attention.Attention.calibrate)."""
    import attention as A
    cores = model.attention_cores()
    todo = [l for l in layers if cores[l].fmap is not None and hasattr(cores[l].fmap, 'calibrate')]
    if todo:
        qk = collect_qk(model, capture, todo, batches, device, max_tokens=1 << 30)
        for l in todo:
            q, k = qk[l]
            cores[l].fmap.calibrate(q[None].to(device), k[None].to(device))  # (1, H, M, D)
    mix = [l for l in layers if cores[l].window and cores[l].window_combine == 'mix']
    if not mix:
        return
    sums, rows = {l: 0.0 for l in mix}, {l: 0 for l in mix}
    for b in batches:
        capture.record(model, _to(b, device))
        for l in mix:
            (q, k, _v), _kw = capture.inputs[l]
            t, n = A.window_mass(q, k, cores[l].window, cores[l].causal)
            sums[l], rows[l] = sums[l] + t, rows[l] + n
    for l in mix:
        if rows[l]:
            cores[l].set_window_mix(sums[l] / rows[l])


# ----------------------------------------------------------------------------------------------------
# progress

class Progress:
    def __init__(self, name, total, every=1):
        self.name, self.total, self.every = name, total, max(1, every)
        self.t0 = time.time()
        self.tokens = 0

    def step(self, it, tokens, msg):
        self.tokens += tokens
        if (it + 1) % self.every and it + 1 != self.total:
            return
        dt = max(time.time() - self.t0, 1e-9)
        eta = dt / (it + 1) * (self.total - it - 1)
        print(f'{self.name} {it + 1}/{self.total} | {msg} | {self.tokens / dt:,.0f} tok/s | '
              f'ETA {_fmt_time(eta)}', flush=True)


def _fmt_time(s):
    s = int(round(s))
    return f'{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}' if s >= 3600 else f'{s // 60}:{s % 60:02d}'


# ----------------------------------------------------------------------------------------------------
# stage 1: attention transfer; stage 2: finetuning

def new_parameters(model, layers):
    cores = model.attention_cores()
    return [p for l in layers for p in cores[l].parameters()]


def attention_transfer(model, capture, layers, data, iters, lr, loss_weights, device, log_every=1,
                       grad_clip=1.0):
    """Stage 1: freeze the teacher, train only the converted cores' parameters so that each layer,
    fed the teacher's (q, k, v), matches the teacher's attention.  Returns the per-step mean loss."""
    params = new_parameters(model, layers)
    if not params or iters <= 0:
        if iters > 0:
            print('stage 1: the map has no trainable parameters; skipped')
        return []
    cores = model.attention_cores()
    model.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    model.eval()  # no dropout in the teacher; the students' parameters still get gradients
    for l in layers:
        cores[l].train()  # (e.g. performer redraws, LLN statistics follow the module's mode)
    prog = Progress('stage1', iters, log_every)
    history = []
    w = {k: v for k, v in loss_weights.items() if v > 0}
    for it in range(iters):
        b = _to(data.batch('train'), device)
        capture.record(model, b)
        total = 0.0
        parts = {k: 0.0 for k in w}
        for l in layers:
            (q, k_, v), kw = capture.inputs[l]
            losses = transfer_losses(cores[l], q, k_, v, capture.outputs[l], kw, w)
            loss_l = sum(w[n] * losses[n] for n in losses)
            total = total + loss_l
            for n in losses:
                parts[n] += losses[n].item() / len(layers)
        opt.zero_grad(set_to_none=True)
        total.backward()
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        mean = total.item() / len(layers)
        history.append(mean)
        prog.step(it, data.tokens(b), f'loss/layer {mean:.4f} (' +
                  ', '.join(f'{n} {v:.4f}' for n, v in parts.items()) + ')')
    model.eval()
    return history


def finetune(model, data, iters, lr, device, task='lm', lora=True, log_every=1, grad_clip=1.0,
             weight_decay=0.0, extra_trainable=()):
    """Stage 2: next-token (or GLUE task) loss; LoRA factors (plus the modules named by the prefixes in
    extra_trainable, e.g. a new classifier head) only, or every parameter."""
    if iters <= 0:
        return []
    if lora:
        model.requires_grad_(False)
        params = lora_parameters(model)
        if not params:
            raise ConversionError('stage 2 with LoRA but the model has no LoRA modules')
        params += [p for n, p in model.named_parameters() if n.startswith(tuple(extra_trainable))]
        for p in params:
            p.requires_grad_(True)
    else:
        model.requires_grad_(True)
        params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    for c in model.attention_cores():
        c.teacher = False
    model.train()
    prog = Progress('stage2', iters, log_every)
    history = []
    for it in range(iters):
        b = _to(data.batch('train'), device)
        if task == 'lm':
            _, loss = model(b['idx'], targets=b['targets'])
        else:
            _, loss = model.classify(b['idx'], attention_mask=b['attention_mask'],
                                     token_type_ids=b['token_type_ids'], labels=b['labels'])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        history.append(loss.item())
        prog.step(it, data.tokens(b), f'loss {history[-1]:.4f}')
    model.eval()
    model.requires_grad_(False)
    return history


# ----------------------------------------------------------------------------------------------------
# the command line

DEFAULT_LORA_LR, DEFAULT_FULL_LR = 1e-3, 3e-4


def get_parser():
    p = argparse.ArgumentParser(
        description='Convert a pretrained softmax Transformer into a linear-attention one: attention '
                    'transfer (stage 1), then finetuning (stage 2). See the module docstring.',
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group('what to convert')
    g.add_argument('--init_from', default='gpt2',
                   help='teacher: a hub name (needs internet), a local HuggingFace folder, a llama.cpp .gguf file, '
                        'or one of our checkpoints (train.py output file or folder)')
    g.add_argument('--tokenizer', default=None,
                   help="a HuggingFace folder or .gguf file whose tokenizer replaces the teacher's own (e.g. for "
                        'old checkpoints that carry none)')
    g.add_argument('--attn', default='hedgehog',
                   help='the linear map (any attention.FEATURE_MAPS name, with options as in train.py: '
                        '"lolcats:activation=elu", "exp:t=2"); softmax = a control run that skips '
                        'the conversion and only finetunes the teacher (stage 2), same data and budget')
    g.add_argument('--layers', default='all', help='layers to convert: "all", "0,2,5", "0-3", "-1"')
    g.add_argument('--window', type=int, default=0,
                   help='> 0: sliding-window softmax + linear hybrid (LoLCATs-w) with this window')
    g.add_argument('--window_combine', default='joint', choices=['joint', 'mix'],
                   help='the window hybrid\'s form: joint = one normalisation over window and linear terms, g on '
                        'the linear term (LoLCATs ICLR 2025 Eq. 8); mix = s y_window + (1 - s) y_linear, each '
                        'normalised, s initialised to the teacher\'s window mass (LoLCATs workshop paper Eq. 8)')
    g.add_argument('--diag_block', type=int, default=0,
                   help='> 0: block-diagonal softmax + linear, averaged (LLN+Diag), with this block')
    g.add_argument('--feature_dim', type=int, default=None,
                   help='feature dimension of maps that take one (t2r, performer, dof, hedgehog, lolcats)')
    g.add_argument('--impl', default='chunked', choices=['chunked', 'quadratic', 'recurrent'],
                   help='linear-attention implementation of the student (chunked never forms T x T)')
    g.add_argument('--max_feature_dim', type=int, default=8192,
                   help='refuse maps whose feature dimension exceeds this on the base model\'s head_dim')
    g = p.add_argument_group('data')
    g.add_argument('--data', default='../shared/data/tinyshakespeare/input.txt',
                   help='text file or folder, or a `datasets` name (as train.py reads it); for --task glue '
                        'the GLUE data (as train.py load_glue reads it)')
    g.add_argument('--val_data', default=None,
                   help='held-out text; default: the last --val_fraction of --data')
    g.add_argument('--val_fraction', type=float, default=0.1)
    g.add_argument('--task', default='lm', choices=['lm', 'glue'],
                   help='lm: next-token loss and perplexity; glue: a BERT classifier, task loss and metric')
    g.add_argument('--glue_task', default='cola')
    g.add_argument('--batch_size', type=int, default=8)
    g.add_argument('--block_size', type=int, default=128, help='sequence length (capped at the model\'s)')
    g.add_argument('--eval_batches', type=int, default=8, help='held-out batches per evaluation')
    g.add_argument('--fidelity_batches', type=int, default=0,
                   help='of those, how many the attention fidelity (KL, output MSE; quadratic in the block size) '
                        'uses (0 = all)')
    g = p.add_argument_group('stage 1: attention transfer (teacher frozen, new parameters only)')
    g.add_argument('--stage1_iters', type=int, default=200)
    g.add_argument('--lr', type=float, default=1e-2, help='stage-1 AdamW learning rate (weight decay 0)')
    g.add_argument('--loss', default='auto',
                   help="'ce' (Hedgehog Eq. 4, quadratic), 'mse' (LoLCATs outputs, chunked), 'l2' (DoF "
                        "kernel exp(q.k/sqrt d), quadratic, unnormalised), or a sum such as 'ce+mse'; auto: mse "
                        'for lolcats and the hybrids, ce otherwise')
    g.add_argument('--ce_weight', type=float, default=None, help='override the weight of the ce loss')
    g.add_argument('--mse_weight', type=float, default=None, help='override the weight of the mse loss')
    g.add_argument('--l2_weight', type=float, default=None, help='override the weight of the l2 loss')
    g = p.add_argument_group('DoF feature-dimension selection (DoF Algorithm 1)')
    g.add_argument('--dof_budget', type=float, default=0,
                   help='> 0: choose per-layer feature dimensions from the degrees of freedom with this mean '
                        '(dof: M random features; hedgehog: the total width F = 2 x MLP outputs)')
    g.add_argument('--dof_lambda', type=float, default=DOF_LAMBDA_GPT2,
                   help="lambda in tr(G (G + lambda I)^-1), G = the Gram matrix / J; default 2^-4, the paper's "
                        'value for GPT-2 (2^-8 for Pythia-1B), which the paper applies to the undivided Gram')
    g.add_argument('--dof_samples', type=int, default=256,
                   help='J, the points sampled per head (the paper leaves J open)')
    g.add_argument('--dof_clip', action='store_true',
                   help='DoF + Clip (paper Sec. 4.2): clamp each layer at head_dim after the allocation '
                        '(hedgehog: F at 2 x head_dim), nothing redistributed: the mean cost falls below the budget')
    g.add_argument('--dof_calib_batches', type=int, default=4)
    g = p.add_argument_group('stage 2: finetuning')
    g.add_argument('--stage2_iters', type=int, default=200)
    g.add_argument('--lora_rank', type=int, default=8, help='LoRA rank on q/k/v/o; 0 = full finetune')
    g.add_argument('--lora_alpha', type=float, default=16.0)
    g.add_argument('--lora_targets', default=None,
                   help='comma-separated module names or suffixes (default: q_proj,k_proj,v_proj,o_proj)')
    g.add_argument('--stage2_lr', type=float, default=None,
                   help=f'default {DEFAULT_LORA_LR:g} with LoRA, {DEFAULT_FULL_LR:g} for a full finetune')
    g = p.add_argument_group('run')
    g.add_argument('--out_dir', default='out-convert')
    g.add_argument('--device', default='cpu')
    g.add_argument('--seed', type=int, default=0)
    g.add_argument('--log_interval', type=int, default=10, help='print progress every this many steps')
    g.add_argument('--threads', type=int, default=0, help='torch threads (0 = torch default)')
    g.add_argument('--report', nargs='+', metavar='DIR', default=None,
                   help='print a table of the summary.json of these convert.py output folders and exit')
    return p


def resolve_loss_weights(args) -> dict:
    spec = args.loss
    if spec == 'auto':  # (not l2 for dof: the raw kernel L2 is dominated by the largest exp(q.k/sqrt d)
        # pairs -- ~1e23 on our byte-level teacher -- and barely moves the attention KL; see the README)
        spec = 'mse' if (args.window or args.diag_block or args.attn == 'lolcats') else 'ce'
    w = {'ce': 0.0, 'mse': 0.0, 'l2': 0.0}
    for part in spec.split('+'):
        part = part.strip()
        if part not in w:
            raise ConversionError(f"unknown --loss part {part!r}; use ce, mse, l2 or a sum like 'ce+mse'")
        w[part] = 1.0
    for name in w:
        v = getattr(args, f'{name}_weight')
        if v is not None:
            if v < 0:
                raise ConversionError(f'--{name}_weight must be >= 0')
            w[name] = float(v)
    if not any(w.values()):
        raise ConversionError('all stage-1 loss weights are zero')
    return w


def get_tokenizer(model, path=None):
    """The tokenizer for the model's data: --tokenizer PATH (a HF folder or .gguf) if given, else the model's own
    (from its checkpoint, HF folder or GGUF file), else the project tokenizer matching its vocab_size (byte 257,
    tiktoken gpt2 50257/50304). Anything else is a ConversionError asking for --tokenizer: no fallback to bytes."""
    import tokenizer as tokenizer_lib
    try:
        return tokenizer_lib.resolve(model, path)
    except (tokenizer_lib.TokenizerError, OSError) as e:
        raise ConversionError(_first_line(e)) from None


def load_lm_data(args, model, block_size):
    """(train_ids, val_ids) of --data with model.tokenizer (get_tokenizer).  Held-out text: --val_data, else
    the same split train.py uses (the last --val_fraction of a local file/folder, or the `datasets`
    validation split), so a teacher trained with train.py is evaluated on text it has not seen."""
    import types
    import train
    tok = model.tokenizer
    enc = tok.encode_array
    try:
        if args.val_data:
            train_ids = enc(train.load_text(args.data))
            val_ids = enc(train.load_text(args.val_data))
        else:
            cfg = types.SimpleNamespace(data=args.data, val_fraction=args.val_fraction, seq_len=block_size)
            train_ids, val_ids = train.text_splits(cfg, _EncodeArray(enc))
    except (ValueError, OSError) as e:
        raise ConversionError(f'--data {args.data!r}: {_first_line(e)}') from e
    train_ids = torch.as_tensor(train_ids, dtype=torch.long)
    val_ids = torch.as_tensor(val_ids, dtype=torch.long)
    V = model.config.vocab_size
    top = int(max(train_ids.max(), val_ids.max()))
    if top >= V:
        raise ConversionError(f'the tokenizer ({tok.name}) produced id {top} but the model has vocab_size {V}')
    return train_ids, val_ids


class _EncodeArray:
    def __init__(self, enc):
        self.encode_array = enc


def load_glue_data(args, tok, block_size):
    """GLUE train/dev examples encoded as train.py does it (GlueEncoder with the model's tokenizer `tok`:
    [CLS] a [SEP] b [SEP] for a BERT tokenizer, else [eot] a [eot] b [eot])."""
    import train
    try:
        task = train.glue_task_name(args.glue_task)
        enc = train.GlueEncoder(tok, block_size)
        splits = {}
        for split in ('train', 'validation'):
            rows = train.load_glue(task, args.data, split)
            splits[split] = [dict(zip(('input_ids', 'token_type_ids'), enc.encode(a, b)), label=lab)
                             for a, b, lab in rows]
    except (ValueError, OSError) as e:
        raise ConversionError(f'GLUE {args.glue_task!r} from {args.data!r}: {_first_line(e)}') from e
    return {'task': task, 'num_labels': train.glue_num_labels(task), 'train': splits['train'],
            'dev': splits['validation']}


def _stage_record(model, capture, layers, eval_batches, device, task, glue_task, seconds=None, history=None,
                  fidelity_batches=0):
    rec = {}
    if eval_batches is not None:
        fid = eval_batches[:fidelity_batches] if fidelity_batches > 0 else eval_batches
        rec['fidelity'] = evaluate_fidelity(model, capture, layers, fid, device)
        if task == 'lm' and _family(model) == 'bert':
            rec['quality'] = None
        else:
            rec['quality'] = evaluate_quality(model, eval_batches, device, task, glue_task)
    if seconds is not None:
        rec['seconds'] = round(seconds, 2)
    if history:
        rec['loss_first'], rec['loss_last'] = history[0], history[-1]
    return rec


def _print_stage(name, rec, teacher=None):
    fid = rec.get('fidelity')
    q = rec.get('quality')
    parts = []
    if fid:
        per = ' '.join(f"L{l}={v:.3f}" for l, v in fid['kl_layers'].items())
        parts.append(f"KL(teacher||student) mean {fid['kl_mean']:.4f} nats [{per}], output MSE "
                     f"{fid['mse_mean']:.4g}")
    if q:
        parts.append(' '.join(f'{k} {v:.4g}' for k, v in q.items()))
    print(f'== {name}: ' + ' | '.join(parts), flush=True)


def recovery(loss, teacher_loss, unigram):
    """Recovery of the teacher's gain over the unigram baseline, in % of the loss gap:
    100 (L_unigram - L) / (L_unigram - L_teacher)."""
    if unigram is None or teacher_loss is None or loss is None or unigram - teacher_loss <= 0:
        return None
    return 100.0 * (unigram - loss) / (unigram - teacher_loss)


def run(args):
    """The whole conversion; returns the summary dict (also written to out_dir/summary.json)."""
    t_start = time.time()
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    import attention as A
    import train
    name = args.attn.partition(':')[0]
    if name not in A.ATTN_CHOICES:
        raise ConversionError(f'unknown --attn {name!r}; choose from {", ".join(A.FEATURE_MAPS)} '
                              '(or softmax: the control run, stage 2 on the unconverted teacher)')
    try:  # 'lolcats:activation=elu' / 'exp:t=2': a map name with options (train.parse_attn_spec)
        args.attn, args.attn_options = train.parse_attn_spec(args.attn)
    except ValueError as e:
        raise ConversionError(f'--attn {args.attn!r}: {e}') from None
    if args.attn not in A.ATTN_CHOICES:
        raise ConversionError(f'unknown --attn {args.attn!r}; choose from {", ".join(A.FEATURE_MAPS)} '
                              '(or softmax: the control run, stage 2 on the unconverted teacher)')
    if args.attn == 'softmax' and (args.window or args.diag_block or args.feature_dim):
        raise ConversionError('--attn softmax (the control run) takes no --window, --diag_block or --feature_dim')
    for name in ('stage1_iters', 'stage2_iters', 'lora_rank', 'window', 'diag_block', 'batch_size',
                 'block_size', 'eval_batches', 'fidelity_batches'):
        if getattr(args, name) < 0:
            raise ConversionError(f'--{name} must be >= 0')
    if args.batch_size < 1 or args.block_size < 2:
        raise ConversionError('--batch_size must be >= 1 and --block_size >= 2')
    if args.window and args.diag_block:
        raise ConversionError('choose one hybrid: --window (LoLCATs) or --diag_block (LLN+Diag)')
    if args.dof_budget and args.attn not in ('dof', 'hedgehog'):
        raise ConversionError(f'--dof_budget applies to --attn dof or hedgehog, not {args.attn!r}')
    if args.dof_budget < 0 or (args.dof_clip and not args.dof_budget):
        raise ConversionError('--dof_budget must be > 0 to select dimensions (and --dof_clip needs it)')
    if args.dof_budget and (args.dof_lambda <= 0 or args.dof_samples < 2):
        raise ConversionError(f'--dof_lambda must be > 0 and --dof_samples (J) >= 2, got {args.dof_lambda:g} '
                              f'and {args.dof_samples}')
    weights = resolve_loss_weights(args)
    device = args.device
    overrides = {}
    if args.task == 'glue':
        import train
        try:
            overrides['num_labels'] = train.glue_num_labels(train.glue_task_name(args.glue_task))
        except ValueError as e:
            raise ConversionError(f'--glue_task: {_first_line(e)}') from None
    model, info = load_base(args.init_from, device, **overrides)
    base_tokenizer = model.tokenizer   # recorded: load_converted checks that the base still has this tokenizer
    model.tokenizer = get_tokenizer(model, args.tokenizer)
    print(f'tokenizer: {model.tokenizer.name}, vocab {model.tokenizer.vocab_size}', flush=True)
    cfg = model.config
    family = cfg.family
    if args.task == 'lm' and family == 'bert' and args.stage2_iters > 0:
        raise ConversionError('a BERT model has no next-token loss: use --task glue (or --stage2_iters 0)')
    if args.task == 'glue' and family != 'bert':
        raise ConversionError(f'--task glue needs a BERT model, this one is {family!r}')
    layers = parse_layers(args.layers, cfg.n_layer)
    block_size = min(args.block_size, cfg.block_size)
    # ---- data
    unigram = None
    if args.task == 'lm':
        train_ids, val_ids = load_lm_data(args, model, block_size)
        data = LMData(train_ids, val_ids, block_size, args.batch_size, args.seed)
        if family != 'bert':
            u = unigram_loss(train_ids, val_ids, cfg.vocab_size)
            unigram = {'loss': u, 'ppl': math.exp(u)}
    else:
        glue = load_glue_data(args, model.tokenizer, block_size)
        data = GlueData(glue['train'], glue['dev'], args.batch_size, glue['task'], pad_id=0, seed=args.seed,
                        max_len=block_size)
    eval_batches = data.eval_batches(args.eval_batches)
    calib = [data.batch('train') for _ in range(max(1, args.dof_calib_batches))]
    print(f'converting {info["base"]} ({family}, {cfg.n_layer} layers, {cfg.n_head} heads, head_dim '
          f'{cfg.head_dim}) to {args.attn!r} on layers {layers}; block {block_size}, batch {args.batch_size}; '
          f'stage-1 loss weights {weights}', flush=True)
    summary = {'base_model': info['base'], 'base_kind': info['base_kind'], 'family': family,
               'attn': args.attn, 'attn_options': args.attn_options, 'window_combine': args.window_combine,
               'layers': layers, 'window': args.window, 'diag_block': args.diag_block,
               'loss_weights': weights, 'task': args.task, 'glue_task': args.glue_task if args.task == 'glue'
               else None, 'block_size': block_size, 'args': vars(args), 'unigram': unigram,
               'recovery_definition': '100 (L_unigram - L) / (L_unigram - L_teacher), held-out nats/token; '
                                      'ppl_ratio = teacher ppl / model ppl'}
    # ---- the teacher
    if args.task == 'lm' and family == 'bert':
        summary['teacher'] = None
    else:
        summary['teacher'] = evaluate_quality(model, eval_batches, device, args.task, args.glue_task)
        print('== teacher: ' + ' '.join(f'{k} {v:.4g}' for k, v in summary['teacher'].items())
              + (f" | unigram ppl {unigram['ppl']:.4g}" if unigram else ''), flush=True)
    # ---- DoF feature-dimension selection
    map_options = dict(args.attn_options)
    if args.feature_dim:
        map_options['feature_dim'] = args.feature_dim
    layer_options = {}
    if args.dof_budget:
        cap0 = TeacherCapture(model.attention_cores(), layers)
        qk = collect_qk(model, cap0, layers, calib, device)
        cap0.remove()
        f = 2 if args.attn == 'hedgehog' else 1  # hedgehog's F = 2 x (MLP outputs): allocate MLP outputs
        clip = cfg.head_dim if args.dof_clip else None  # DoF + Clip: M <= head size (hedgehog: F <= 2 head_dim)
        dims, table = select_feature_dims(qk, args.dof_budget / f, args.dof_lambda, args.dof_samples, clip=clip,
                                          min_dim=1 if f == 2 else 2, seed=args.seed, verbose=False)
        dims = {l: f * d for l, d in dims.items()}
        for r in table:
            r['feature_dim'] *= f
            if 'unclipped' in r:
                r['unclipped'] *= f
        clip = clip and f * clip
        print(format_dof_table(table, args.dof_budget, args.dof_lambda, args.dof_samples, clip), flush=True)
        layer_options = {l: {'feature_dim': d} for l, d in dims.items()}
        summary['dof'] = {'lambda': args.dof_lambda, 'J': args.dof_samples, 'budget': args.dof_budget,
                          'clip': clip, 'calib_tokens': qk[layers[0]][0].shape[1],
                          'mean_feature_dim': sum(dims.values()) / len(dims)}
        summary['dof_table'] = table
    # ---- swap
    torch.manual_seed(args.seed)
    if args.attn != 'softmax':  # softmax: the control run (no conversion; stage 2 on the teacher itself)
        swap_attention(model, args.attn, layers, args.window, args.diag_block, dict(map_options, impl=args.impl),
                       layer_options, args.max_feature_dim, args.window_combine)
    model.to(device)
    cores = model.attention_cores()
    summary['feature_dims'] = {str(l): cores[l].fmap.feature_dim for l in layers if cores[l].fmap is not None}
    capture = TeacherCapture(cores, layers)
    calibrate_cores(model, capture, layers, calib, device)
    stages = summary['stages'] = {}
    stages['swap'] = _stage_record(model, capture, layers, eval_batches, device, args.task, args.glue_task,
                                   fidelity_batches=args.fidelity_batches)
    _print_stage('after swap (untrained)', stages['swap'])
    # ---- stage 1
    t0 = time.time()
    h1 = attention_transfer(model, capture, layers, data, args.stage1_iters, args.lr, weights, device,
                            args.log_interval)
    stages['stage1'] = _stage_record(model, capture, layers, eval_batches, device, args.task, args.glue_task,
                                     time.time() - t0, h1, args.fidelity_batches)
    _print_stage('after stage 1 (attention transfer)', stages['stage1'])
    # ---- stage 2
    lora = None
    finetune_mode = 'none'
    # a GLUE head is new (randomly initialised by from_pretrained): train it with LoRA and always save it
    extra_prefixes = ['classifier.'] if args.task == 'glue' else []
    if args.stage2_iters > 0:
        if args.lora_rank > 0:
            targets = [t.strip() for t in args.lora_targets.split(',')] if args.lora_targets else None
            names = apply_lora(model, args.lora_rank, args.lora_alpha, targets)
            model.to(device)
            lora = {'rank': args.lora_rank, 'alpha': args.lora_alpha, 'targets': names}
            finetune_mode = 'lora'
            print(f'stage 2: LoRA rank {args.lora_rank} alpha {args.lora_alpha:g} on {len(names)} modules '
                  f'({sum(p.numel() for p in lora_parameters(model)):,} parameters)', flush=True)
        else:
            finetune_mode = 'full'
            print(f'stage 2: full finetune ({sum(p.numel() for p in model.parameters()):,} parameters)',
                  flush=True)
        lr2 = args.stage2_lr or (DEFAULT_LORA_LR if lora else DEFAULT_FULL_LR)
        t0 = time.time()
        h2 = finetune(model, data, args.stage2_iters, lr2, device, args.task, lora=lora is not None,
                      log_every=args.log_interval, extra_trainable=extra_prefixes)
        stages['stage2'] = _stage_record(model, capture, layers, eval_batches, device, args.task,
                                         args.glue_task, time.time() - t0, h2, args.fidelity_batches)
        stages['stage2']['mode'] = finetune_mode
        stages['stage2']['lr'] = lr2
        _print_stage(f'after stage 2 ({finetune_mode})', stages['stage2'])
    capture.remove()
    # ---- recovery figures
    if summary['teacher'] and args.task == 'lm':
        tl, tp = summary['teacher']['loss'], summary['teacher']['ppl']
        for name, rec in stages.items():
            if rec.get('quality'):
                rec['recovery_pct'] = recovery(rec['quality']['loss'], tl, unigram and unigram['loss'])
                rec['ppl_ratio'] = tp / rec['quality']['ppl']
    # ---- save
    manifest = {'base_model': info['base'], 'base_kind': info['base_kind'], 'attn': args.attn,
                'layers': layers, 'window': args.window, 'diag_block': args.diag_block,
                'overrides': overrides, 'lora': lora, 'finetune': finetune_mode, 'seed': args.seed,
                'feature_dims': summary['feature_dims'], 'task': args.task, 'extra_prefixes': extra_prefixes,
                'base_tokenizer': base_tokenizer.fingerprint if base_tokenizer is not None else None}
    save_converted(args.out_dir, model, manifest)
    summary['out_dir'] = os.path.abspath(args.out_dir)
    summary['seconds'] = round(time.time() - t_start, 1)
    _write_json(os.path.join(args.out_dir, SUMMARY), summary)
    print(f'saved {args.out_dir}/{PARAMS_FILE}, {MANIFEST}, {SUMMARY} ({summary["seconds"]:.0f} s)', flush=True)
    return summary


def _fmt_num(x, spec='.3f'):
    return '-' if x is None else format(x, spec)


def report(dirs) -> str:
    """A markdown table of several runs' summary.json: quality (perplexity, or the GLUE metric), attention
    fidelity (mean KL to the teacher's weights, mean output MSE) after each stage, and the run's wall time."""
    rows = ['| run | attn | F (mean) | teacher | swap | stage 1 | stage 2 | KL swap | KL stage 1 | KL stage 2 | '
            'MSE stage 1 | MSE stage 2 | recovery s1 % | recovery s2 % | time |', '|' + '---|' * 15]
    for d in dirs:
        path = os.path.join(d, SUMMARY) if os.path.isdir(d) else d
        if not os.path.isfile(path):
            raise ConversionError(f'{d}: no {SUMMARY}')
        with open(path) as f:
            s = json.load(f)
        st = s.get('stages', {})

        def fid(n, key):
            return _fmt_num(((st.get(n) or {}).get('fidelity') or {}).get(key), '.3f' if key == 'kl_mean' else '.4f')

        def qual(rec):  # perplexity for language modelling, the task's main metric for GLUE
            rec = rec or {}
            return _fmt_num(rec.get('ppl', rec.get('main', rec.get('metric'))), '.2f' if 'ppl' in rec else '.4f')

        def rec(n):
            return _fmt_num((st.get(n) or {}).get('recovery_pct'), '.1f')
        opts = ''.join(f':{k}={v}' for k, v in (s.get('attn_options') or {}).items())
        mix = '(mix)' if s.get('window') and s.get('window_combine') == 'mix' else ''
        attn = s['attn'] + opts + (f"-w{s['window']}{mix}" if s.get('window') else '') + (
            f"+diag{s['diag_block']}" if s.get('diag_block') else '')
        fd = s.get('feature_dims') or {}
        fmean = sum(fd.values()) / len(fd) if fd else None
        mode = (st.get('stage2') or {}).get('mode', '')
        rows.append(f"| {os.path.basename(os.path.normpath(d))} | {attn} | {_fmt_num(fmean, '.0f')} | "
                    f"{qual(s.get('teacher'))} | {qual((st.get('swap') or {}).get('quality'))} | "
                    f"{qual((st.get('stage1') or {}).get('quality'))} | "
                    f"{qual((st.get('stage2') or {}).get('quality'))}{' (' + mode + ')' if mode else ''} | "
                    f"{fid('swap', 'kl_mean')} | {fid('stage1', 'kl_mean')} | {fid('stage2', 'kl_mean')} | "
                    f"{fid('stage1', 'mse_mean')} | {fid('stage2', 'mse_mean')} | {rec('stage1')} | {rec('stage2')} | "
                    f"{_fmt_time(s['seconds']) if s.get('seconds') else '-'} |")
    return '\n'.join(rows)


def main(argv=None):
    args = get_parser().parse_args(argv)
    try:
        if args.report:
            print(report(args.report))
            return 0
        run(args)
    except ConversionError as e:
        print(f'convert.py: error: {e}', file=sys.stderr)
        return 2
    return 0


if __name__ == '__main__':
    sys.exit(main())
