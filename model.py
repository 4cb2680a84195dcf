"""One transformer for the families the linear-attention papers convert, and every way to load it.

The families, as a config switch rather than three copies of the code:
- GPT-2: learned positions, pre-LayerNorm, GELU (tanh) MLP, tied embeddings, causal;
- Llama: RoPE, RMSNorm, SwiGLU MLP, grouped-query attention (GQA), untied head, causal;
- BERT:  learned positions + token types, post-LayerNorm, GELU (exact) MLP, bidirectional,
  pooler + classifier.
Every layer's attention is an `hybrids.Attention` core built from a spec string such as 'softmax',
'hedgehog:feature_dim=64' or 'lolcats:window=64' (config.attn; config.layer_attn overrides single
layers). Feature maps see queries and keys after RoPE, one map per query head.
"""

import contextlib
import json
import math
import os
import pickle
import warnings
import zipfile
from dataclasses import asdict, dataclass, field, fields, replace
from functools import partial

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import tokenizer as tokenizer_lib
from attention import AttnSpec, UsageError, apply_rope
from hybrids import Attention, copy_state_, state_nbytes, static_state

FAMILIES = ('gpt2', 'llama', 'bert')

@dataclass
class GPTConfig:
    family: str = 'gpt2'        # 'gpt2' | 'llama' | 'bert'
    vocab_size: int = 50304
    block_size: int = 1024      # max positions (learned positions for gpt2/bert; cosformer's M)
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int | None = None   # GQA (llama); None = n_head
    n_embd: int = 768
    intermediate_size: int | None = None  # MLP hidden size; None = 4 * n_embd
    dropout: float = 0.0
    bias: bool = True
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF rope_scaling: rope_type 'linear' or 'llama3'
                                      # (None = plain RoPE)
    tie_embeddings: bool = True
    type_vocab_size: int = 2    # bert
    num_labels: int = 0         # bert classification head (0 = none)
    attn: str = 'softmax'       # every layer's attention, an attention.AttnSpec string
    layer_attn: dict = field(default_factory=dict)  # {layer: spec string}: the layers that
                                                    # differ from `attn`
    lora: dict | None = None    # {'rank', 'alpha', 'targets'}: LoRA adapters on these Linear
                                # modules (convert.py)
    init_std: float = 0.02      # scratch init: N(0, init_std) Linear weights, residual
                                # projections / sqrt(2 n_layer)
    emb_init_std: float = 0.02  # scratch init: N(0, emb_init_std) embeddings
    short_conv: int = 0         # > 0: taps of a causal depthwise conv on the keys
                                # (H3's shift, Based's short conv)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise UsageError(f"unknown family {self.family!r}; choose one of {list(FAMILIES)}")
        if self.n_embd % self.n_head:
            raise UsageError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        self.n_kv_head = self.n_kv_head or self.n_head
        if self.n_head % self.n_kv_head:
            raise UsageError(
                f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}")
        if self.family != 'llama' and self.n_kv_head != self.n_head:
            raise UsageError(
                "grouped-query attention (n_kv_head != n_head) is only for family='llama'")
        if self.family == 'llama' and self.head_dim % 2:
            raise UsageError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.short_conv < 0 or (self.short_conv and self.family == 'bert'):
            raise UsageError(
                f"short_conv must be >= 0 and is causal (not for 'bert'), got {self.short_conv}")
        self.intermediate_size = self.intermediate_size or 4 * self.n_embd
        self.attn = str(AttnSpec.parse(self.attn))                      # validates; one spelling
        self.layer_attn = {int(i): str(AttnSpec.parse(s)) for i, s in self.layer_attn.items()}
        bad = [i for i in self.layer_attn if not 0 <= i < self.n_layer]
        if bad:
            raise UsageError(
                f"layer indices {bad} out of range: the model has {self.n_layer} layers")

    @property
    def head_dim(self):
        return self.n_embd // self.n_head

    @property
    def inv_freq(self):
        """RoPE's inverse frequencies (head_dim/2,) for llama; None for the other families."""
        if self.family == 'llama':
            return rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling)

# ---- building blocks --------------------------------------------------------
class RMSNorm(nn.Module):
    """Llama RMSNorm (HF convention: normalise in float32, scale in the input dtype)."""

    def __init__(self, ndim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)

def make_norm(config):
    if config.family == 'llama':
        return RMSNorm(config.n_embd, eps=config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)

def _rope_type(scaling):
    """The rope_type of an HF rope_scaling dict (older configs: 'type'); 'default' for None."""
    scaling = scaling or {}
    return scaling.get('rope_type', scaling.get('type', 'default'))

def rope_inv_freq(head_dim, theta, scaling=None):
    """RoPE inverse frequencies (head_dim/2,), with HF's 'linear' and 'llama3' scalings."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = _rope_type(scaling)
    if rope_type in ('default', 'linear'):   # linear: every frequency divided by the factor
        return inv_freq / (scaling['factor'] if rope_type == 'linear' else 1)
    if rope_type != 'llama3':
        raise UsageError(
            f"unsupported rope_type {rope_type!r}; supported: 'default', 'linear', 'llama3'")
    factor = scaling['factor']
    low = scaling['low_freq_factor']
    high = scaling['high_freq_factor']
    old_len = scaling['original_max_position_embeddings']
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)

class ShortConv(nn.Module):
    """Causal depthwise convolution over time (H3's shift SSM on keys, Based's short convolution).

    y_t = sum_i w_i x_{t-i} per channel, i < K = kernel_size, zeros before the first token,
    w_i = weight[:, K-1-i] (F.conv1d's layout). Identity at init (w_0 = 1): added to a trained
    model, it changes nothing. Decode state: the last K-1 inputs."""

    def __init__(self, channels, kernel_size):
        super().__init__()
        self.kernel_size = kernel_size
        # (C, K): the last tap, the current input's, is 1
        self.weight = nn.Parameter(torch.eye(kernel_size)[-1].repeat(channels, 1))

    def forward(self, x, past=None):
        """x (B, T, C); past (B, K-1, C): the inputs before x (None = zeros)."""
        xx = (F.pad(x, (0, 0, self.kernel_size - 1, 0)) if past is None
              else torch.cat([past.to(x.dtype), x], 1))           # (B, K-1+T, C)
        # (B, C, T) (padding 1, then dropped: T = 0 too)
        y = F.conv1d(xx.transpose(1, 2), self.weight.to(x.dtype).unsqueeze(1), padding=1,
                     groups=x.size(-1))[..., 1:-1]
        return y.transpose(1, 2), xx[:, x.size(1):]                 # and xx's last K-1 rows

class LoRALinear(nn.Linear):
    """y = x W^T + b + (alpha / r) x A^T B^T (Hu et al. 2021): a LoRA adapter on an nn.Linear.

    A (r, in) random, B (out, r) zero: a fresh adapter changes nothing. It *is* the nn.Linear it
    wraps (same `weight`, `bias` and state-dict names) plus lora_A, lora_B."""

    def __init__(self, base, rank=8, alpha=16.0):
        nn.Module.__init__(self)
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.rank = int(rank)
        self.scaling = float(alpha) / rank
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=base.weight.device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, device=base.weight.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, x):   # the base Linear's x W^T + b, plus x A^T B^T scaled
        return super().forward(x) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling

    def extra_repr(self):
        return (f"{self.in_features}, {self.out_features}, "
                f"rank={self.rank}, scaling={self.scaling:g}")

@dataclass(frozen=True)
class LayerState:
    """One layer's decode state: its attention core's (hybrids.py) and its key convolution's.

    The convolution's is its last K-1 inputs."""
    attn: object
    conv: torch.Tensor | None   # (B, K-1, H_kv * D), or None without a convolution

class SelfAttention(nn.Module):
    """q/k/v/o projections around a pluggable attention core (hybrids.Attention)."""

    def __init__(self, config, spec):
        super().__init__()
        C = config.n_embd
        self.n_head = nh = config.n_head
        self.n_kv_head = nkv = config.n_kv_head
        self.head_dim = hs = config.head_dim
        self.q_proj, self.k_proj, self.v_proj = (
            nn.Linear(C, n * hs, bias=config.bias) for n in (nh, nkv, nkv))
        self.o_proj = nn.Linear(nh * hs, C, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.k_conv = ShortConv(nkv * hs, config.short_conv) if config.short_conv else None
        self.core = make_core(config, spec)

    def forward(self, x, rope=None, state=None, return_state=False, key_padding_mask=None,
                shared=None):   # shared: a model step's, for its cores (hybrids.Window.step)
        B, T, C = x.size()
        nh = self.n_head
        nkv = self.n_kv_head
        hs = self.head_dim

        def heads(t, n):   # (B, T, n * hs) -> (B, n, T, hs)
            return t.view(B, T, n, hs).transpose(1, 2)
        q = heads(self.q_proj(x), nh)
        k = self.k_proj(x)                                      # (B, T, nkv * hs)
        conv_past = None
        if self.k_conv is not None:
            k, conv_past = self.k_conv(k, state and state.conv)
        k, v = heads(k, nkv), heads(self.v_proj(x), nkv)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if nkv != nh:  # GQA: query head h uses key/value head h // (nh // nkv), as in HF repeat_kv
            k, v = (t.repeat_interleave(nh // nkv, dim=1) for t in (k, v))
        y = self.core(q, k, v, state and state.attn, return_state, key_padding_mask, shared)
        if return_state:   # the core's state, and the conv's last K-1 inputs
            y, attn_state = y
            state = LayerState(attn_state, conv_past)
        y = y.transpose(1, 2).reshape(B, T, nh * hs)            # (B, nh, T, hs) -> (B, T, C)
        return self.resid_dropout(self.o_proj(y)), state

def make_core(config, spec):
    """The attention core of one layer for `spec` (an AttnSpec or its string).

    cosformer's M is block_size."""
    return Attention(spec, config.head_dim, config.n_head, causal=config.family != 'bert',
                     max_len=config.block_size, kv_groups=config.n_head // config.n_kv_head,
                     rope_inv_freq=config.inv_freq)

class MLP(nn.Module):
    """GELU MLP (gpt2: tanh approximation, bert: exact) or SwiGLU (llama)."""

    def __init__(self, config):
        super().__init__()
        C = config.n_embd
        H = config.intermediate_size
        b = config.bias
        self.family = config.family
        if config.family == 'llama':
            self.gate_proj = nn.Linear(C, H, b)
            self.up_proj = nn.Linear(C, H, b)
            self.down_proj = nn.Linear(H, C, b)
        else:
            self.c_fc = nn.Linear(C, H, b)
            self.c_proj = nn.Linear(H, C, b)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        if self.family == 'llama':
            return self.dropout(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))
        return self.dropout(self.c_proj(
            F.gelu(self.c_fc(x), approximate='tanh' if self.family == 'gpt2' else 'none')))

class Block(nn.Module):
    """One layer: attention and MLP, each a residual branch.

    Pre-norm (GPT-2, Llama) or post-norm (BERT)."""

    def __init__(self, config, spec):
        super().__init__()
        self.post_norm = config.family == 'bert'
        self.ln_1 = make_norm(config)
        self.attn = SelfAttention(config, spec)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x, rope=None, state=None, return_state=False, key_padding_mask=None,
                shared=None):
        if self.post_norm:  # BERT
            a, state = self.attn(x, rope, state, return_state, key_padding_mask)
            x = self.ln_1(x + a)
            return self.ln_2(x + self.mlp(x)), state
        # pre-norm: GPT-2, Llama
        a, state = self.attn(self.ln_1(x), rope, state, return_state, key_padding_mask, shared)
        x = x + a
        return x + self.mlp(self.ln_2(x)), state

# ---- the models: the shared body, then a causal LM (GPT-2, Llama) and an encoder (BERT) ----
class Transformer(nn.Module):
    """The body of every family: embeddings, the blocks, and (causal families) a final norm.

    Token embeddings, plus learned positions for gpt2 and bert (RoPE for llama). The family is read
    here once; GPT and Bert add their heads."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        C = config.n_embd
        self.rope = config.family == 'llama'
        modules = dict(wte=nn.Embedding(config.vocab_size, C), drop=nn.Dropout(config.dropout),
                       h=nn.ModuleList(Block(config, config.layer_attn.get(i, config.attn))
                                       for i in range(config.n_layer)))
        if not self.rope:   # learned positions
            modules['wpe'] = nn.Embedding(config.block_size, C)
        if config.family == 'bert':   # token types; an embedding LayerNorm (post-LN: no final norm)
            modules.update(wtt=nn.Embedding(config.type_vocab_size, C), ln_e=make_norm(config))
        else:
            modules['ln_f'] = make_norm(config)
        self.transformer = nn.ModuleDict(modules)
        # device -> RoPE inverse frequencies in float32 (not a buffer: .to(bf16) must not round)
        self._inv_freq = {}
        self.tokenizer = None  # the tokenizer that travels with the model (load and save handle it)
        # activation checkpointing: with gradients, each block's activations are made again in
        # backward instead of kept (memory of one block at a time, one more forward's time)
        self.grad_ckpt = False

    def _init_weights(self):
        """nanoGPT's init, after the heads are made; the attention cores keep their own.

        N(0, init_std) Linear weights (residual projections / sqrt(2 n_layer)), N(0, emb_init_std)
        embeddings, zero biases."""
        cfg, cores = self.config, {id(m) for c in self.attention_cores() for m in c.modules()}
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)) and id(m) not in cores:
                std = cfg.init_std if isinstance(m, nn.Linear) else cfg.emb_init_std
                nn.init.normal_(m.weight, std=std)
                if getattr(m, 'bias', None) is not None:
                    nn.init.zeros_(m.bias)
        for pn, p in self.named_parameters():
            if pn.endswith(('o_proj.weight', 'c_proj.weight', 'down_proj.weight')):
                nn.init.normal_(p, std=cfg.init_std / math.sqrt(2 * cfg.n_layer))
        if cfg.lora:
            self.add_lora(**cfg.lora)

    def get_num_params(self):
        """Number of parameters, position embeddings excluded (as in nanoGPT)."""
        return sum(p.numel() for n, p in self.named_parameters() if n != 'transformer.wpe.weight')

    def attention_cores(self):
        """The hybrids.Attention core of every layer, in layer order."""
        return [block.attn.core for block in self.transformer.h]

    def set_attention(self, spec, layers=None):
        """New attention cores for `layers` (default: all) from `spec` ('hedgehog:feature_dim=64').

        q/k/v/o and everything else are kept; the config records it, so save/load rebuild the same
        model."""
        cfg, spec = self.config, str(AttnSpec.parse(spec))
        layers = range(cfg.n_layer) if layers is None else list(layers)
        # replace() checks the layers
        new = replace(cfg, layer_attn={**cfg.layer_attn, **dict.fromkeys(layers, spec)})
        device = self.transformer.wte.weight.device
        for i in layers:
            self.transformer.h[i].attn.core = make_core(cfg, spec).to(device)
        if len(set(layers)) == cfg.n_layer:   # every layer: the model's attention
            cfg.attn = spec
        cfg.layer_attn = {i: s for i, s in new.layer_attn.items() if s != cfg.attn}
        return self

    def add_lora(self, rank=8, alpha=16.0, targets=('q_proj', 'k_proj', 'v_proj', 'o_proj'),
                 layers=None):
        """LoRA adapters on the Linear modules whose names end with `targets`, in `layers`.

        layers: default all. Recorded in config.lora (full names) so that save/load rebuild them.
        Returns the adapted module names."""
        layers = range(self.config.n_layer) if layers is None else layers
        names = [n for n, m in self.named_modules()
                 if isinstance(m, nn.Linear) and not isinstance(m, LoRALinear)
                 and n.startswith('transformer.h.') and int(n.split('.')[2]) in layers
                 and n.endswith(tuple(targets))]
        if not names:   # (nor a model's own LoRA: a converted checkpoint's q/k/v/o are LoRALinear)
            raise UsageError(f"LoRA targets {list(targets)} match no Linear module without LoRA "
                             f"in layers {list(layers)}")
        for name in names:
            self.set_submodule(name, LoRALinear(self.get_submodule(name), rank, alpha))
        self.config.lora = dict(rank=rank, alpha=alpha, targets=names)
        return names

    @contextlib.contextmanager
    def capture_qkv(self, layers=None, teacher=False):
        """The q, k, v every layer's core gets: the one q/k capture (transfer, DoF, metrics).

            with model.capture_qkv() as rec:
                model(x)   # rec[i] = (q, k, v, key_padding_mask) that layer i's core got
        q, k, v (B, H, T, D): after RoPE, k and v GQA-repeated; the mask None if causal.
        teacher=True: meanwhile every layer has an exact softmax core (a converted model runs as
        its teacher)."""
        blocks, rec, own = self.transformer.h, {}, self.attention_cores()
        if teacher:
            for b in blocks:
                b.attn.core = make_core(self.config, 'softmax')
        hooks = [blocks[i].attn.core.register_forward_pre_hook(
            lambda mod, args, kw, i=i: rec.__setitem__(i, (*args[:3], kw.get('key_padding_mask'))),
            with_kwargs=True) for i in (range(len(blocks)) if layers is None else layers)]
        try:
            yield rec
        finally:
            for h in hooks:
                h.remove()
            for b, core in zip(blocks, own):
                b.attn.core = core

    def _rope(self, pos):
        """RoPE's (cos, sin) (T, hs) at positions pos, a (T,) long tensor on the device."""
        if pos.device not in self._inv_freq:
            self._inv_freq[pos.device] = self.config.inv_freq.to(pos.device)
        emb = (pos.float()[:, None] * self._inv_freq[pos.device]).repeat(1, 2)   # (T, hs)
        return emb.cos(), emb.sin()

    def hidden_states(self, idx, offset=0, states=None, return_state=False, token_type_ids=None,
                      attention_mask=None):
        """Final hidden states (B, T, C) at positions offset..offset+T-1, and new decode states.

        offset: an int, or decode_step's (1,) tensor on the device. attention_mask (B, T) (BERT):
        1 = real, 0 = padding."""
        tr = self.transformer
        B, T = idx.size()
        pos = offset                                                # decode_step's (1,)
        if not torch.is_tensor(offset):
            pos = torch.arange(offset, offset + T, device=idx.device)   # (T,)
            if states is None and offset and any(c.spec.nope or c.spec.name == 'cosformer'
                                                 for c in self.attention_cores()):
                raise UsageError(f"a prefill at offset {offset} needs the states of the tokens "
                                 "before it: nope's and cosformer's maps depend on the position")
            if not self.rope and offset + T > self.config.block_size:
                raise UsageError(f"{offset + T} positions exceed "
                                 f"block_size={self.config.block_size} (learned positions)")
        x = tr.wte(idx)                                             # (B, T, C)
        if not self.rope:
            x = x + tr.wpe(pos)
        if isinstance(self, Bert):   # token types (default 0), the embedding LayerNorm
            x = tr.ln_e(x + tr.wtt(torch.zeros_like(idx) if token_type_ids is None
                                   else token_type_ids))
        x = tr.drop(x)
        rope = self._rope(pos) if self.rope else None
        # (B, T) True = real
        kpm = None if attention_mask is None else attention_mask.to(idx.device).bool()
        new_states = []
        shared = {}   # what the attention cores make once a step
        ckpt = self.grad_ckpt and torch.is_grad_enabled()   # training: blocks remade in backward
        for i, block in enumerate(tr.h):
            run = partial(checkpoint, block, use_reentrant=False) if ckpt else block
            x, s = run(x, rope, states and states[i], return_state, kpm, shared)
            new_states.append(s)
        return (x if isinstance(self, Bert) else tr.ln_f(x)), (new_states if return_state else None)

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        """AdamW over the trainable parameters, weight decay only where zero is neutral.

        Weight decay pulls towards zero, so it goes only to the 2-D weights of the
        nanoGPT-initialised projections and embeddings, and to LoRA factors. Not decayed: 1-D gains
        and biases, and what starts at the identity or another structured value (attention cores,
        short convolution)."""
        structured = {id(p) for m in self.modules() if isinstance(m, (Attention, ShortConv))
                      for p in m.parameters()}
        decayed = lambda p: p.dim() >= 2 and id(p) not in structured   # noqa: E731
        # the trainable parameters, decayed, then not
        groups = [{'params': [p for p in self.parameters() if p.requires_grad and decayed(p) == d],
                   'weight_decay': wd} for d, wd in ((True, weight_decay), (False, 0.0))]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == 'cuda')

class GPT(Transformer):
    """A causal language model (family gpt2 or llama): the body and an LM head.

    The head is tied to wte unless config.tie_embeddings is False."""

    def __init__(self, config):
        super().__init__(config)
        if config.family == 'bert':
            raise UsageError(
                "family='bert' is an encoder: build it with model.build(config) (a Bert)")
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self._init_weights()

    def forward(self, idx, targets=None):
        """Logits (B, T, vocab) and, given targets (B, T) (-100 = ignored), the loss.

        The loss is the cross-entropy (F.cross_entropy's ignore_index is -100)."""
        logits = self.lm_head(self.hidden_states(idx)[0])           # (B, T, vocab)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), targets.reshape(-1))

    # bytes of the per-layer decode states (KV caches, recurrent)
    decode_state_nbytes = staticmethod(state_nbytes)

    @torch.no_grad()
    def prefill(self, idx, offset=0, states=None):
        """Run idx (B, T) at positions offset.. after `states` (None: from the start).

        Returns (the last position's logits, the states); T = 0: (None, states that decode as from
        the start, hybrids.Empty)."""
        x, states = self.hidden_states(idx, offset=offset, states=states, return_state=True)
        return self.lm_head(x[:, -1]) if idx.shape[1] else None, states

    def decode_step(self, tok, pos, states):
        """prefill of one token per row, tok (B,), at position pos -> (logits (B, vocab), states).

        pos: an int, or a (1,) long tensor on the device (no host copy); its shapes do not depend
        on it, so DecodeGraph can replay it."""
        return self.prefill(tok[:, None], pos, states)                # tok[:, None] (B, 1)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, eos_token_id=None,
                 use_cache=True, graph=False):
        """Append up to max_new_tokens tokens to idx (B, T), each drawn by sample().

        Each token is sample(logits, temperature, top_k). A row that produced eos_token_id (an int
        or a list) keeps producing it; generation stops when every row has. use_cache: prefill,
        then one token at a time with each layer's state (a KV cache for softmax, constant-size for
        linear maps and hybrids); otherwise full forward passes (the reference; learned positions
        crop the context to block_size, as in nanoGPT). graph: the step on buffers of its own
        (DecodeGraph), replayed as a CUDA graph (CUDA) or compiled (the CPU: worth its minutes of
        compiling for long generations alone)."""
        cfg = self.config
        B, T0 = idx.size()
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        if not T0:   # (no logits to draw the first token from)
            raise ValueError("generate needs a prompt of at least one token (e.g. end-of-text)")
        if use_cache and not self.rope and T0 + max_new_tokens - 1 > cfg.block_size:
            raise UsageError(
                f"cached generation needs {T0 + max_new_tokens - 1} positions, more than "
                f"block_size={cfg.block_size} (learned positions); "
                "generate fewer or use use_cache=False (crops)")
        eos = (None if eos_token_id is None   # eos_token_id as a (n,) tensor
               else torch.as_tensor(eos_token_id, device=idx.device).view(-1))
        finished = idx.new_zeros(B, dtype=torch.bool)
        out = torch.cat([idx, idx.new_zeros(B, max_new_tokens)], 1)   # the tokens, preallocated
        states = step = None
        for t in range(T0, T0 + max_new_tokens):   # t: the position of the token generated
            if not use_cache:
                logits = self(out[:, 0 if self.rope else max(t - cfg.block_size, 0):t])[0][:, -1]
            elif states is None:
                logits, states = self.prefill(idx)
                pos = idx.new_full((1,), T0, dtype=torch.long)   # the next input's
                if graph:
                    step = DecodeGraph(self, out[:, T0 - 1], pos, states, T0 + max_new_tokens)
            elif step is not None:
                logits = step(out[:, t - 1])
            else:
                logits, states = self.decode_step(out[:, t - 1], pos, states)
                pos = pos + 1
            nxt = sample(logits, temperature, top_k)
            if eos is not None:
                nxt = eos[0].where(finished, nxt)
                finished |= torch.isin(nxt, eos)
            out[:, t] = nxt
            if eos is not None and finished.all():
                return out[:, :t + 1]
        return out

def sample(logits, temperature=1.0, top_k=None):
    """The next token per row from logits (B, vocab): argmax at temperature 0, else a draw from
    softmax(logits / temperature) over the top_k tokens."""
    if temperature == 0.0:
        return logits.argmax(-1)                                    # (B,)
    logits = logits.float() / temperature
    if top_k is not None:
        v = logits.topk(min(top_k, logits.size(-1))).values
        logits = logits.masked_fill(logits < v[:, [-1]], float('-inf'))
    return torch.multinomial(logits.softmax(-1), num_samples=1).squeeze(1)

class DecodeGraph:
    """GPT.decode_step on buffers of its own, run for every token: captured once as a CUDA graph and
    replayed (CUDA), or compiled by torch.compile and called (the CPU).

    As mamba_ssm's cg=True, or HF's static cache with torch.compile. The states live in fixed
    buffers (KV caches static, with room for `capacity` tokens; hybrids.static_state), the token and
    position in fixed tensors; a replay launches the step's kernels at once, with no Python between
    them. compile: the step first fused by torch.compile (inductor: fewer kernels than aten ops).
    On the CPU the step is always compiled (inductor's C++ kernels: a C++ compiler is needed; the
    first call compiles: 106-117 s for SmolLM2-135M's shape on one thread, inductor's cache cold)
    and called as it is: the buffers' Python attributes (a window state's token count n) stay
    those of the first step, so that torch.compile's guards on them hold and it compiles once (the
    step reads the position from the device tensor pos; tests/test_model.py::
    test_static_step_replays_like_eager and ::test_cpu_decode_graph_compiles_once_and_equals_eager;
    RESULTS 6.8).
    After a prefill (pos: tok's position):
        step = DecodeGraph(model, tok, pos, states, capacity)
        logits = step(tok)   # the next token's logits; pos moves on"""

    def __init__(self, model, tok, pos, states, capacity, compile=False):
        if tok.device.type not in ('cuda', 'cpu'):
            raise UsageError(f"a DecodeGraph runs on CUDA (a graph) or the CPU (compiled), "
                             f"not {tok.device.type}")
        if any(core.spec.name == 'cosformer' for core in model.attention_cores()):
            raise UsageError(
                "cosformer's features depend on the position on the host: no DecodeGraph")
        self.states = [LayerState(static_state(s.attn, capacity), s.conv) for s in states]
        self.tok = tok.clone()
        self.pos = pos.clone()
        self.left = capacity - int(pos)   # tokens it may decode
        cpu = tok.device.type == 'cpu'
        self.step = torch.compile(model.decode_step, dynamic=False) if compile or cpu else \
            model.decode_step
        self.graph = None
        if cpu:
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        # warm-up off the graph: lazy initialisation, kernel compilation
        with torch.cuda.stream(side):
            for _ in range(2):
                self.step(self.tok, self.pos, self.states)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._run()

    def _run(self):
        """One step on the buffers: the logits; what the step made anew copied back into them."""
        logits, new_states = self.step(self.tok, self.pos, self.states)
        copy_state_(self.states, new_states)
        self.pos.add_(1)
        return logits

    def __call__(self, tok):
        if self.left <= 0:   # (the graph itself cannot check: it would write past its buffers)
            raise UsageError("the DecodeGraph's KV caches are full: make it with a larger capacity")
        self.left -= 1
        self.tok.copy_(tok)
        if self.graph is None:   # the CPU: the compiled step itself
            return self._run()
        self.graph.replay()
        return self.logits

class Bert(Transformer):
    """A bidirectional encoder (family bert): the body, a pooler, and a classifier.

    The classifier is there when config.num_labels > 0."""

    def __init__(self, config):
        super().__init__(config)
        self.pooler = nn.Linear(config.n_embd, config.n_embd)
        if config.num_labels > 0:
            self.classifier = nn.Linear(config.n_embd, config.num_labels)
        self._init_weights()

    def forward(self, idx, attention_mask=None, token_type_ids=None):
        """The last hidden states (B, T, C). attention_mask (B, T): 1 = real token, 0 = padding."""
        return self.hidden_states(idx, token_type_ids=token_type_ids,
                                  attention_mask=attention_mask)[0]

    encode = forward

    def pool(self, hidden):
        """BERT pooler: tanh(W h_[CLS])."""
        return torch.tanh(self.pooler(hidden[:, 0]))

    def classify(self, idx, attention_mask=None, token_type_ids=None, labels=None):
        """Sequence classification: (logits (B, num_labels), loss or None).

        num_labels 1: regression (MSE)."""
        if self.config.num_labels <= 0:
            raise ValueError("classify() needs num_labels > 0 (load with num_labels=N)")
        pooled = self.pool(self(idx, attention_mask, token_type_ids))
        return classification_loss(self.classifier(self.transformer.drop(pooled)), labels)

def classification_loss(logits, labels=None):
    """(logits (B, num_labels), their loss or None without labels): a regression's (one label)
    MSE, else the cross-entropy."""
    if labels is None:
        return logits, None
    if logits.size(-1) == 1:
        return logits, F.mse_loss(logits.squeeze(-1).float(), labels.float())
    return logits, F.cross_entropy(logits.float(), labels.long())

def build(config):
    return (Bert if config.family == 'bert' else GPT)(config)

# ---- load and save: one loader for every format, one checkpoint format ------
def load(path, **overrides):
    """(model, extra) from our checkpoint, an HF folder or hub name, or a llama.cpp .gguf file.

    Our checkpoint: save()'s out_dir/ckpt.pt or its folder; a converted model's names its base and
    holds only what the conversion added. An HF folder: config.json + safetensors / .bin, sharded or
    not; a hub name needs internet. A .gguf file is dequantised to float32. `overrides` are
    GPTConfig fields (attn='hedgehog:feature_dim=64', num_labels=2, ...). Only new attention
    parameters may be absent; when `attn` changes a layer's map in our checkpoint, its trained core
    is re-initialised (with a message); a change of `impl`, `sinks`, `cache`, `decay` or `nope`
    alone keeps it (a decay added at load starts at its half-life). model.tokenizer is the
    checkpoint's own (or None). extra: what save(**extra) stored, and 'base' (a conversion's
    starting model)."""
    names = [f.name for f in fields(GPTConfig)]
    bad = sorted(set(overrides) - set(names))
    if bad:
        raise UsageError(f"unknown override(s) {bad}; GPTConfig fields are {names}")
    return _load(str(path), overrides)

def _file_kind(path):
    """'ours' (a zip, as torch.save writes) or 'gguf', by the first bytes.

    Else a UsageError: neither, or cut short."""
    with open(path, 'rb') as f:
        kind = {b'PK\x03\x04': 'ours', b'GGUF': 'gguf'}.get(f.read(4))
    if kind is None:
        raise UsageError(
            f"{path} is not a checkpoint: neither ours (train.py, convert.py), a HuggingFace "
            "folder nor a GGUF file")
    if kind == 'ours' and not zipfile.is_zipfile(path):   # its zip directory, at the end, is gone
        raise UsageError(
            f"{path} is cut short (an interrupted copy or save?): not a whole checkpoint")
    return kind

def _load(path, overrides, as_base=False):
    """load(); as_base: the base of a converted model.

    The conversion's file holds that base's new tensors (new_tensor_names)."""
    ckpt = os.path.join(path, 'ckpt.pt') if os.path.isdir(path) else path
    kind = _file_kind(ckpt) if os.path.isfile(ckpt) else None
    if kind == 'gguf':
        import gguf
        try:
            reader = gguf.GGUFReader(ckpt)
        except ValueError as e:   # gguf's numpy views of a file that ends too soon
            raise UsageError(f"cannot read {ckpt} as a GGUF file (cut short?): {e}") from None
        model = _new_model(gguf_config_to_kwargs(reader, ckpt), overrides, ckpt)
        _load_hf_state(model, _read_gguf_tensors(reader, ckpt), ckpt, gguf_key_map(model.config),
                       ' in the GGUF file')
        try:
            model.tokenizer = tokenizer_lib.HFTokenizer.from_gguf(reader)
        except tokenizer_lib.TokenizerError as e:   # e.g. SentencePiece vocabularies
            warnings.warn(
                f"{ckpt}: {e}; model.tokenizer is None (give one, e.g. --tokenizer <HF folder>)")
    elif kind == 'ours':
        return _load_ours(ckpt, overrides, as_base)
    else:
        folder = _hf_folder(path)
        model = _new_model(_hf_config(os.path.join(folder, 'config.json')), overrides, path)
        _load_hf_state(model, _read_hf_tensors(folder), path)
        if tokenizer_lib.has_tokenizer_files(folder):
            model.tokenizer = tokenizer_lib.HFTokenizer.from_folder(folder)
    return model, {}

def _new_model(kwargs, overrides, source):
    if overrides.get('family', kwargs['family']) != kwargs['family']:
        raise UsageError(
            f"family={overrides['family']!r} does not match {source} ({kwargs['family']!r})")
    return build(GPTConfig(**{**kwargs, **overrides}))

def new_tensor_names(model):
    """What a conversion adds, found by type: (state-dict names, {layer: its core's name prefix}).

    The names are those of every attention core's tensors (maps, window factors) and LoRA
    factor."""
    cores = {id(c): i for i, c in enumerate(model.attention_cores())}   # id -> layer
    names = set()
    prefixes = {}
    for name, m in model.named_modules():
        if id(m) in cores:
            prefixes[cores[id(m)]] = name + '.'
            names |= {f'{name}.{k}' for k in m.state_dict()}
        elif isinstance(m, LoRALinear):
            names |= {f'{name}.lora_A', f'{name}.lora_B'}
    return names, prefixes

def _own_tensors(model, sd=None):
    """The state dict (or `sd`) less a tied lm_head.weight (it is transformer.wte.weight)."""
    return {k: v for k, v in (sd or model.state_dict()).items()
            if not (model.config.tie_embeddings and k == 'lm_head.weight')}

def save(path, model, base=None, keep=(), tensors=None, **extra):
    """Write model (config, weights, tokenizer) and `extra` (e.g. optimizer state) to `path`.

    Written atomically. base: the model this one was converted from (a path or hub name): then only
    the new tensors (attention cores, LoRA, and names starting with a prefix in `keep`, e.g. a new
    classifier) are written; load() rebuilds the rest. tensors: the state dict to write instead of
    the model's (an FSDP-sharded model's, gathered: convert.py)."""
    new = new_tensor_names(model)[0]
    sd = {k: v.detach().cpu().contiguous() for k, v in _own_tensors(model, tensors).items()
          if base is None or k in new or any(k.startswith(p) for p in keep)}
    obj = dict(config=asdict(model.config), model=sd,
               tokenizer=model.tokenizer and model.tokenizer.spec,
               base=base and str(base), extra=extra)
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f'{path}.{os.getpid()}.tmp'
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)   # never a half-written checkpoint
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)

def _load_ours(path, overrides, as_base):
    try:
        obj = torch.load(path, map_location='cpu', weights_only=True)
    except (RuntimeError, pickle.UnpicklingError) as e:
        # a zip that torch.save did not write, or a damaged one
        raise UsageError(
            f"{path} is not a checkpoint torch can read: {str(e).splitlines()[0]}") from None
    if not isinstance(obj, dict) or not {'config', 'model'} <= set(obj):
        raise UsageError(f"{path} is not a checkpoint written by model.save")
    saved = GPTConfig(**obj['config'])
    base = obj.get('base')
    want = {**obj['config'], **overrides}
    if 'attn' in overrides and 'layer_attn' not in overrides:
        converted = [i for i in range(saved.n_layer)
                     if saved.layer_attn.get(i, saved.attn) != 'softmax']
        # some layers converted: the new attention on those, the layers left softmax stay softmax
        if 0 < len(converted) < saved.n_layer:
            want['attn'] = saved.attn
            want['layer_attn'] = dict.fromkeys(converted, overrides['attn'])
        else:
            want['layer_attn'] = {}
    if base:   # a converted model: the base first, with the saved attention and adapters
        model, _ = _load(base, {k: v for k, v in want.items() if k != 'family'}, as_base=True)
    else:
        model = build(GPTConfig(**want))
    # a layer's map, less the options a trained core survives
    spec = lambda cfg, i: replace(AttnSpec.parse(cfg.layer_attn.get(i, cfg.attn)),   # noqa: E731
                                  impl='chunked', sinks=0, cache=0, decay=0, nope=0)
    changed = [i for i in range(saved.n_layer) if spec(saved, i) != spec(model.config, i)]
    if changed and not as_base:
        print(f"{path}: attention of layers {changed} changed to {overrides.get('attn')}: "
              "their cores are re-initialised")
    new, prefixes = new_tensor_names(model)
    kept = lambda k: not any(k.startswith(prefixes[i]) for i in changed)   # noqa: E731
    tensors = {k: v for k, v in obj['model'].items() if kept(k)}
    own = _own_tensors(model)
    # a converted model's file holds its new tensors; a base's (or a plain model's), the rest
    need = {k for k in own if kept(k) and (k in new if base else not (as_base and k in new))}
    if as_base and base:   # a base with a base of its own: the outer file holds every new tensor
        need = set()
    # a decay added at load
    need -= {k for k in own if k.endswith('.decay_rate') and k not in tensors}
    _copy_checked(f"cannot load checkpoint {path}", own, tensors,
                  {k: (k, lambda t: t) for k in own}, need)
    if obj.get('tokenizer'):
        model.tokenizer = tokenizer_lib.load_tokenizer(obj['tokenizer'])
    return model, dict(obj.get('extra') or {}, base=base)

def _fmt(names, limit=20):
    names = sorted(names)
    more = f', ... ({len(names) - limit} more)' if len(names) > limit else ''
    return ', '.join(names[:limit]) + more

def _copy_checked(header, own, tensors, kmap, need, skip=(), where=''):
    """Copy `tensors` (keyed by file names) into the model's state `own`, or raise one error.

    kmap: {our name: (file name, transform)}. The one UsageError names every missing (of `need`),
    unexpected (beyond `skip`) and mis-shaped tensor."""
    mapped = {k: kmap[k][1](tensors[kmap[k][0]]) for k in own if kmap[k][0] in tensors}
    problems = sorted(
        {f"{kmap[k][0]}: file {tuple(tensors[kmap[k][0]].shape)} vs model {tuple(own[k].shape)}"
         for k, t in mapped.items() if t.shape != own[k].shape})
    bad = (('missing', {kmap[k][0] for k in need} - set(tensors)),
           ('unexpected', set(tensors) - {kmap[k][0] for k in own} - set(skip)))
    msg = [f"{what} keys{where}: {_fmt(names)}" for what, names in bad if names]
    msg += ["shape mismatches: " + '; '.join(problems[:20])] if problems else []
    if msg:
        raise UsageError('\n  '.join([header + ':'] + msg))
    with torch.no_grad():
        for k, t in mapped.items():
            own[k].copy_(t)

# ---- HuggingFace checkpoints ------------------------------------------------
def hf_config_to_kwargs(hf):
    """HF config.json dict -> GPTConfig keyword arguments: GPT-2, Llama, BERT; else an error."""
    get = hf.get
    mt = get('model_type')

    def sizes():   # Llama's and BERT's, by the same HF names
        return dict(vocab_size=hf['vocab_size'], n_layer=hf['num_hidden_layers'],
                    n_head=hf['num_attention_heads'], n_embd=hf['hidden_size'],
                    intermediate_size=hf['intermediate_size'])
    if mt == 'gpt2':
        if get('activation_function', 'gelu_new') not in ('gelu_new', 'gelu_pytorch_tanh') or \
                get('scale_attn_by_inverse_layer_idx') or not get('scale_attn_weights', True):
            raise UsageError(
                "GPT-2 variants other than gelu_new with scale_attn_weights are not supported")
        return dict(family='gpt2', vocab_size=hf['vocab_size'], block_size=hf['n_positions'],
                    n_layer=hf['n_layer'], n_head=hf['n_head'], n_embd=hf['n_embd'],
                    intermediate_size=get('n_inner') or 4 * hf['n_embd'],
                    norm_eps=get('layer_norm_epsilon', 1e-5),
                    tie_embeddings=get('tie_word_embeddings', True))
    if mt == 'llama':
        bias = get('attention_bias', False)
        if get('hidden_act', 'silu') != 'silu' or bias != get('mlp_bias', False) or \
                get('head_dim') not in (None, hf['hidden_size'] // hf['num_attention_heads']):
            raise UsageError("Llama variants other than silu, one bias flag, "
                             "head_dim = hidden/heads are unsupported")
        rope = get('rope_parameters') or {}   # transformers >= 5
        theta = rope.get('rope_theta', get('rope_theta', 10000.0))
        scaling = {k: v for k, v in (get('rope_scaling') or rope).items() if k != 'rope_theta'}
        rope_inv_freq(2, theta, scaling)   # fail early on an unsupported rope_type
        scaling = None if _rope_type(scaling) == 'default' else scaling
        return dict(family='llama', **sizes(), block_size=get('max_position_embeddings', 2048),
                    n_kv_head=get('num_key_value_heads'), bias=bool(bias),
                    norm_eps=get('rms_norm_eps', 1e-6),
                    rope_theta=float(theta), rope_scaling=scaling,
                    tie_embeddings=get('tie_word_embeddings', False))
    if mt == 'bert':
        if get('hidden_act', 'gelu') != 'gelu' or \
                get('position_embedding_type', 'absolute') != 'absolute':
            raise UsageError(
                "BERT variants other than exact gelu with absolute positions are not supported")
        clf = any(a.endswith('ForSequenceClassification') for a in get('architectures') or [])
        return dict(family='bert', **sizes(), block_size=hf['max_position_embeddings'],
                    norm_eps=get('layer_norm_eps', 1e-12),
                    type_vocab_size=get('type_vocab_size', 2),
                    num_labels=(len(get('id2label') or {}) or get('num_labels', 2)) if clf else 0,
                    tie_embeddings=False)
    raise UsageError(f"unsupported model_type {mt!r}; supported: 'gpt2', 'llama', 'bert'")

def _hf_config(path):
    """An HF config.json as GPTConfig keyword arguments.

    One that is cut short, not an object or lacks a size is a UsageError naming it."""
    with open(path) as f:
        try:
            hf = json.load(f)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path} is not JSON (cut short?): {e}") from None
    if not isinstance(hf, dict):
        raise UsageError(f"{path} holds a JSON {type(hf).__name__}, not a model config")
    try:
        return hf_config_to_kwargs(hf)
    except KeyError as e:
        raise UsageError(
            f"{path} has no {e.args[0]!r} (model_type {hf.get('model_type')!r})") from None

def _hf_folder(name_or_dir):
    """A local HF folder, or the hub snapshot of a name (config, tokenizer files and weights)."""
    if os.path.isdir(name_or_dir):
        if not os.path.isfile(os.path.join(name_or_dir, 'config.json')):
            raise FileNotFoundError(
                f"{name_or_dir} has neither ckpt.pt nor config.json (a HuggingFace folder)")
        return name_or_dir
    # not a hub name ('org/model'): a path, or a file name
    if name_or_dir.startswith(('/', '.', '~')) or name_or_dir.count('/') > 1 \
            or os.path.splitext(name_or_dir)[1]:
        raise FileNotFoundError(f"no such checkpoint folder or file: {name_or_dir}")
    try:
        from huggingface_hub import snapshot_download
        files = ['*.json', 'vocab.txt', 'merges.txt', 'tokenizer.model']
        folder = snapshot_download(name_or_dir, allow_patterns=files + ['*.safetensors'])
        if not any(f.endswith('.safetensors') for f in os.listdir(folder)):
            folder = snapshot_download(name_or_dir, allow_patterns=files + ['*.bin'])
    except Exception as e:  # offline, unknown repo, gated model, ...
        raise UsageError(
            f"could not download {name_or_dir!r} from the HuggingFace hub ({type(e).__name__}: "
            f"{e}); that needs internet access (and a token for gated models); "
            "or give a local folder") from e
    return folder

def _read_hf_tensors(folder):
    """Every tensor of a HF checkpoint folder.

    From model.safetensors(.index.json), else pytorch_model.bin(.index.json)."""
    from safetensors.torch import load_file
    for name, read in (('model.safetensors', load_file),
                       ('pytorch_model.bin',
                        lambda p: torch.load(p, map_location='cpu', weights_only=True))):
        index = os.path.join(folder, name + '.index.json')
        if os.path.isfile(index):
            with open(index) as f:
                files = [os.path.join(folder, s)
                         for s in sorted(set(json.load(f)['weight_map'].values()))]
        elif os.path.isfile(os.path.join(folder, name)):
            files = [os.path.join(folder, name)]
        else:
            continue
        missing = [p for p in files if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(f"shards listed in {index} are missing: {missing}")
        return {k: v for p in files for k, v in read(p).items()}
    raise FileNotFoundError(
        f"no model.safetensors, model.safetensors.index.json or pytorch_model.bin in {folder}")

def _hf_key_map(config):
    """{our parameter name: (HF key, transform)} for everything loaded from a HF checkpoint.

    The HF keys are those after dropping GPT-2's 'transformer.' and BERT's 'bert.' prefixes."""
    C = config.n_embd
    fam = config.family
    ident = lambda w: w   # noqa: E731
    top, layer_prefix, layer = {
        'gpt2': (dict(wte='wte', wpe='wpe', ln_f='ln_f'), 'h.{}.',
                 {'attn.o_proj': 'attn.c_proj',
                  **{n: n for n in ('ln_1', 'ln_2', 'mlp.c_fc', 'mlp.c_proj')}}),
        'llama': (dict(wte='model.embed_tokens', ln_f='model.norm'), 'model.layers.{}.',
                  {'ln_1': 'input_layernorm', 'ln_2': 'post_attention_layernorm',
                   **{f'attn.{p}': f'self_attn.{p}'
                      for p in ('q_proj', 'k_proj', 'v_proj', 'o_proj')},
                   **{f'mlp.{p}': f'mlp.{p}' for p in ('gate_proj', 'up_proj', 'down_proj')}}),
        'bert': (dict(wte='embeddings.word_embeddings', wpe='embeddings.position_embeddings',
                      wtt='embeddings.token_type_embeddings',
                      ln_e='embeddings.LayerNorm'), 'encoder.layer.{}.',
                 {'ln_1': 'attention.output.LayerNorm', 'ln_2': 'output.LayerNorm',
                  'attn.q_proj': 'attention.self.query', 'attn.k_proj': 'attention.self.key',
                  'attn.v_proj': 'attention.self.value', 'attn.o_proj': 'attention.output.dense',
                  'mlp.c_fc': 'intermediate.dense', 'mlp.c_proj': 'output.dense'})}[fam]
    names = {f'transformer.{o}': (h, (lambda w: w[:config.block_size]) if o == 'wpe' else ident)
             for o, h in top.items()}
    names.update(lm_head=('lm_head', ident), pooler=('pooler.dense', ident),
                 classifier=('classifier', ident))
    # GPT-2's Conv1D weights are (in, out): transposed (1-D tensors stay as they are)
    conv1d = (lambda w: w.t()) if fam == 'gpt2' else ident
    for i in range(config.n_layer):
        o = f'transformer.h.{i}.'   # our layer's prefix, and HF's
        h = layer_prefix.format(i)
        names.update({o + ours: (h + hf, conv1d) for ours, hf in layer.items()})
        if fam == 'gpt2':   # one fused c_attn (in, 3C) -> q, k, v
            names.update({o + f'attn.{p}': (h + 'attn.c_attn',
                                            lambda w, j=j: w.t()[j * C:(j + 1) * C])
                          for j, p in enumerate(('q_proj', 'k_proj', 'v_proj'))})
    return {f'{ours}.{p}': (f'{hf}.{p}', fn) for ours, (hf, fn) in names.items()
            for p in ('weight', 'bias')}

def _load_hf_state(model, tensors, source, kmap=None, where=' in checkpoint'):
    """Copy a HF state dict (or a GGUF file's tensors, given their kmap) into model.

    May be absent: the new cores and adapters, a classifier requested on a checkpoint without one, a
    BERT pooler (classify() then trains a new one; with a warning). Skipped: HF buffers, and other
    heads (with a warning)."""
    cfg = model.config
    kmap = kmap or _hf_key_map(cfg)
    prefix = {'gpt2': 'transformer.', 'bert': 'bert.'}.get(cfg.family, '')
    tensors = {k.removeprefix(prefix).replace('LayerNorm.gamma', 'LayerNorm.weight')
               .replace('LayerNorm.beta', 'LayerNorm.bias'): v for k, v in tensors.items()}
    new = new_tensor_names(model)[0]
    own = {k: t for k, t in _own_tensors(model).items() if k not in new}
    absent_ok = set()
    if 'classifier.weight' not in tensors:
        absent_ok |= {'classifier.weight', 'classifier.bias'}
    if cfg.family == 'bert' and not any(k.startswith('pooler.') for k in tensors):
        absent_ok |= {'pooler.weight', 'pooler.bias'}
        warnings.warn(
            f"{source}: the checkpoint has no pooler (pooler.dense.*); encode() is unaffected, the "
            "pooler of classify() is newly initialised and trains with the classifier")
    used = {kmap[k][0] for k in own}
    ignored = {k for k in set(tensors) - used if k.startswith(('cls.', 'classifier.', 'lm_head.'))}
    if ignored:
        warnings.warn(f"ignored {len(ignored)} checkpoint tensors this model does not use: "
                      f"{_fmt(ignored, 5)}")
    buffers = {k for k in tensors if k.endswith(('.attn.bias', '.attn.masked_bias',
                                                 'rotary_emb.inv_freq', 'embeddings.position_ids'))}
    _copy_checked(f"cannot load {source!r} into a {cfg.family} model", own, tensors, kmap,
                  set(own) - absent_ok, ignored | buffers, where)

# ---- GGUF files (llama.cpp) ----------------------------------------------------
# The config from the metadata, the tensors dequantised by gguf's own reader.
GGUF_TENSOR_TYPES = 'F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q3_K Q4_K Q5_K Q6_K'.split()
# llama.cpp's names for HF Llama's: model.layers.N.<x> -> blk.N.<y>, and the three outside the
# layers
_GGUF_LAYER_NAMES = {'input_layernorm': 'attn_norm', 'self_attn.q_proj': 'attn_q',
                     'self_attn.k_proj': 'attn_k', 'self_attn.v_proj': 'attn_v',
                     'self_attn.o_proj': 'attn_output', 'mlp.up_proj': 'ffn_up',
                     'post_attention_layernorm': 'ffn_norm', 'mlp.gate_proj': 'ffn_gate',
                     'mlp.down_proj': 'ffn_down'}
_GGUF_TOP_NAMES = {'model.embed_tokens': 'token_embd', 'model.norm': 'output_norm',
                   'lm_head': 'output'}

def gguf_key_map(config):
    """_hf_key_map in llama.cpp's names, q and k rows unpermuted (unpermute_qk).

    'blk.3.attn_q.weight' for 'model.layers.3.self_attn.q_proj.weight'."""
    m = {}
    for ours, (hf, fn) in _hf_key_map(config).items():
        head, _, suffix = hf.rpartition('.')
        head = _GGUF_TOP_NAMES.get(head, head)
        if head.startswith('model.layers.'):
            i, _, rest = head.removeprefix('model.layers.').partition('.')
            head = f'blk.{i}.{_GGUF_LAYER_NAMES[rest]}'
        n = {'attn_q': config.n_head, 'attn_k': config.n_kv_head}.get(head.rpartition('.')[2])
        m[ours] = (f'{head}.{suffix}', (lambda w, n=n: unpermute_qk(w, n)) if n else fn)
    return m

def gguf_config_to_kwargs(reader, path):
    """GGUF metadata (a gguf.GGUFReader) -> GPTConfig keyword arguments; architecture 'llama'."""
    def get(key, default=...):
        f = reader.fields.get(key)
        if f is None and default is ...:
            raise UsageError(f"{path}: the GGUF metadata has no {key!r}")
        return default if f is None else f.contents()
    if get('general.architecture') != 'llama':
        raise UsageError(
            f"{path}: GGUF architecture {get('general.architecture')!r} is not supported; "
            "supported: 'llama' (Llama 2/3, TinyLlama, SmolLM2, ...)")
    n_embd = get('llama.embedding_length')
    n_head = get('llama.attention.head_count')
    n_kv_head = get('llama.attention.head_count_kv', n_head)
    head_dim = n_embd // n_head
    if not isinstance(n_kv_head, int):
        raise UsageError(f"{path}: per-layer head_count_kv {n_kv_head} is not supported "
                         "(one value for all layers)")
    for key in ('rope.dimension_count', 'attention.key_length', 'attention.value_length'):
        if get('llama.' + key, head_dim) != head_dim:
            raise UsageError(
                f"{path}: llama.{key} = {get('llama.' + key)} is not head_dim = embedding_length / "
                f"head_count = {head_dim}; only RoPE on the whole head is supported")
    names = {t.name for t in reader.tensors}
    scaling = get('llama.rope.scaling.type', 'none')
    if 'rope_freqs.weight' in names or scaling not in ('none', 'linear'):
        what = ('per-frequency factors (rope_freqs.weight, Llama 3.1)' if scaling == 'none'
                else repr(scaling))
        raise UsageError(f"{path}: RoPE scaling {what} is not supported; supported: none, linear")
    # the vocabulary size when llama.vocab_size is absent
    tokens = reader.fields.get('tokenizer.ggml.tokens')
    vocab = get('llama.vocab_size') if tokens is None else get('llama.vocab_size', len(tokens.data))
    return dict(family='llama', vocab_size=vocab, block_size=get('llama.context_length', 2048),
                n_layer=get('llama.block_count'), n_head=n_head, n_kv_head=n_kv_head, n_embd=n_embd,
                intermediate_size=get('llama.feed_forward_length'),
                bias='blk.0.attn_q.bias' in names,
                norm_eps=float(get('llama.attention.layer_norm_rms_epsilon')),
                rope_theta=float(get('llama.rope.freq_base', 10000.0)),
                tie_embeddings='output.weight' not in names,
                rope_scaling={'rope_type': 'linear',
                              'factor': float(get('llama.rope.scaling.factor'))}
                if scaling == 'linear' else None)

def unpermute_qk(w, n_heads):
    """Undo llama.cpp's q/k row order: convert_hf_to_gguf.py's `permute(w, n_head, n_head_kv)`
    reshapes the rows to (heads, 2, head_dim/2) and swaps the last two axes, interleaving each
    head's two RoPE halves (GGML's rope rotates adjacent pairs); back to HF's rotate_half layout
    (halves in blocks). n_heads: n_head for q, n_kv_head for k."""
    if w.shape[0] % (2 * n_heads):   # a mis-shaped tensor: as it is, for load to report
        return w
    # (heads, hd/2, 2, ...)
    return w.reshape(n_heads, -1, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)

def _read_gguf_tensors(reader, path):
    """{GGUF name: float32 tensor in torch's (out, in) layout} of a GGUF file.

    Every tensor's type is checked."""
    import numpy as np
    from gguf.quants import dequantize
    out = {}
    for t in reader.tensors:
        if t.tensor_type.name not in GGUF_TENSOR_TYPES:
            raise UsageError(
                f"{path}: tensor {t.name} has type {t.tensor_type.name}; supported types: "
                f"{', '.join(GGUF_TENSOR_TYPES)}")
        w = np.require(dequantize(t.data, t.tensor_type), np.float32, ['C', 'W'])
        out[t.name] = torch.from_numpy(w.reshape(tuple(reversed(t.shape.tolist()))))
    return out
