"""
One transformer covering the three model families the linear-attention papers convert:

- GPT-2: learned positions, pre-LayerNorm, GELU (tanh) MLP, tied embeddings, causal;
- Llama: RoPE, RMSNorm, SwiGLU MLP, grouped-query attention, untied head, causal;
- BERT:  learned positions + token types, post-LayerNorm, GELU (exact) MLP, bidirectional,
         pooler + optional sequence-classification head.

The family is a config switch (`GPTConfig.family`), not three copies of the code. Every layer's
attention core is an `attention.Attention` chosen by `config.attn` (softmax or any linear feature
map, plus the sliding-window and block-diagonal hybrids). Feature maps see queries and keys after
RoPE, one map per query head (GQA keys/values are repeated to n_head before the core). An optional
short causal convolution on the keys (`short_conv`, H3 / Based) gives scratch-trained linear attention
the previous token (see the README on associative recall).

Also here: loading HuggingFace checkpoints (`GPT.from_pretrained`), generation with a KV cache
(softmax) or a constant-size recurrent state (linear maps, window hybrid), our own checkpoints
(`save_checkpoint` / `load_checkpoint`) and partial "new parameters only" checkpoints
(`save_new_parameters` / `load_new_parameters`). All files are written atomically.
"""

import glob
import inspect
import json
import math
import os
import pickle
import tempfile
import warnings
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn as nn
from torch.nn import functional as F

import tokenizer as tokenizer_lib
from attention import ATTN_CHOICES, Attention, AttnSpec, state_nbytes

FAMILIES = ('gpt2', 'llama', 'bert')
CHECKPOINT_FORMAT = 'linear-attn-gpt/1'


@dataclass
class GPTConfig:
    family: str = 'gpt2'        # 'gpt2' | 'llama' | 'bert'
    vocab_size: int = 50304
    block_size: int = 1024      # max positions (learned positions for gpt2/bert; cosformer's max_len)
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int | None = None   # GQA (llama); None = n_head
    n_embd: int = 768
    intermediate_size: int | None = None  # MLP hidden; None = 4 * n_embd
    dropout: float = 0.0
    bias: bool = True
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    type_vocab_size: int = 2     # bert
    num_labels: int = 0          # bert classification head (0 = none)
    attn: str = 'softmax'
    window: int = 0
    diag_block: int = 0
    window_combine: str = 'joint'  # window hybrid: 'joint' (one normalisation) or 'mix' (LoLCATs workshop Eq. 8)
    impl: str = 'chunked'
    attn_options: dict = field(default_factory=dict)  # feature-map options, e.g. {'feature_dim': 64}
    # Llama RoPE scaling as in HF `rope_parameters` / `rope_scaling` (None = plain RoPE);
    # supported rope_type: 'default', 'linear', 'llama3'. (Addition to the interface contract.)
    rope_scaling: dict | None = None
    # initialisation of a model trained from scratch: N(0, init_std) Linear weights (residual output projections
    # scaled by 1/sqrt(2 n_layer)) and N(0, emb_init_std) embeddings; nanoGPT's 0.02 by default. Tiny models may
    # want larger values (see the associative-recall notes in the README)
    init_std: float = 0.02
    emb_init_std: float = 0.02
    # > 0: a causal depthwise convolution of this many taps on the keys, before RoPE and the feature map
    # (H3's shift on K; Based's short convolution), identity-initialised. Gives linear attention the
    # previous token that a softmax head finds by position (see the README on associative recall)
    short_conv: int = 0

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unknown family {self.family!r}; choose one of {list(FAMILIES)}")
        if self.attn not in ATTN_CHOICES:
            raise ValueError(f"unknown attn {self.attn!r}; choose one of {ATTN_CHOICES}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.n_head % self.n_kv_head != 0:
            raise ValueError(f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}")
        if self.family != 'llama' and self.n_kv_head != self.n_head:
            raise ValueError(f"grouped-query attention (n_kv_head != n_head) is only for family='llama'")
        if self.family == 'llama' and (self.n_embd // self.n_head) % 2 != 0:
            raise ValueError(f"RoPE needs an even head_dim, got {self.n_embd // self.n_head}")
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.n_embd
        if self.window < 0 or self.diag_block < 0:
            raise ValueError("window and diag_block must be >= 0")
        if self.short_conv < 0:
            raise ValueError(f"short_conv must be >= 0 (0 = none), got {self.short_conv}")
        if self.short_conv and self.family == 'bert':
            raise ValueError("short_conv is a causal convolution: not for family='bert' (bidirectional)")
        if self.attn_options is None:
            self.attn_options = {}
        self.attn_options = dict(self.attn_options)

    @property
    def head_dim(self):
        return self.n_embd // self.n_head

    @property
    def causal(self):
        return self.family != 'bert'


# -----------------------------------------------------------------------------
# building blocks

class RMSNorm(nn.Module):
    """Llama RMSNorm (HF convention: normalise in float32, scale in the input dtype)."""

    def __init__(self, ndim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def make_norm(config):
    if config.family == 'llama':
        return RMSNorm(config.n_embd, eps=config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)


def rope_inv_freq(head_dim, theta, scaling=None):
    """RoPE inverse frequencies (head_dim/2,), with HF's 'linear' and 'llama3' scalings."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get('rope_type', (scaling or {}).get('type', 'default'))
    if rope_type == 'default':
        return inv_freq
    if rope_type == 'linear':
        return inv_freq / scaling['factor']
    if rope_type == 'llama3':
        factor = scaling['factor']
        low, high = scaling['low_freq_factor'], scaling['high_freq_factor']
        old_len = scaling['original_max_position_embeddings']
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: 'default', 'linear', 'llama3'")


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    # x (B, nh, T, hs); cos, sin (T, hs) -- HF Llama rotate_half convention
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


def map_options(config, attn, options):
    """A copy of the feature-map options with the model's defaults filled in: cosformer's M (max_len) is the
    model's context length."""
    options = dict(options)
    if attn == 'cosformer' and options.get('max_len') is None:
        options['max_len'] = config.block_size
    return options


def make_core(config, attn=None, window=None, diag_block=None, impl=None, options=None, window_combine=None):
    """The attention core of one layer (an attention.Attention)."""
    attn = config.attn if attn is None else attn
    if attn not in ATTN_CHOICES:
        raise ValueError(f"unknown attn {attn!r}; choose one of {ATTN_CHOICES}")
    spec = AttnSpec(attn, window=config.window if window is None else window,
                    combine=config.window_combine if window_combine is None else window_combine,
                    diag_block=config.diag_block if diag_block is None else diag_block,
                    impl=config.impl if impl is None else impl,
                    options=config.attn_options if options is None else options)
    return Attention(spec, config.head_dim, config.n_head, causal=config.causal,
                     kv_groups=config.n_head // config.n_kv_head, max_len=config.block_size)


class ShortConv(nn.Module):
    """Causal depthwise convolution over time (H3's shift SSM on keys, Based's short convolution):
    y_t = sum_{i=0}^{K-1} w_i * x_{t-i} per channel, K = kernel_size, zeros before the first token.
    w_i = weight[:, K-1-i] (F.conv1d's layout). Initialised to the identity (w_0 = 1, the rest 0), so adding
    it to a trained model changes nothing. The decode state is the last K-1 inputs."""

    def __init__(self, channels, kernel_size):
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.zeros(channels, kernel_size))   # (C, K); last tap = current token
        with torch.no_grad():
            self.weight[:, -1] = 1.0

    def forward(self, x, past=None):
        # x (B, T, C); past (B, K-1, C): the inputs before x (None = zeros)
        B, T, C = x.shape
        if past is None:
            past = x.new_zeros(B, self.kernel_size - 1, C)
        xx = torch.cat([past.to(x.dtype), x], dim=1)                      # (B, K-1+T, C)
        y = F.conv1d(xx.transpose(1, 2), self.weight.to(x.dtype).unsqueeze(1), groups=C)  # (B, C, T)
        return y.transpose(1, 2), xx[:, xx.size(1) - (self.kernel_size - 1):]


class SelfAttention(nn.Module):
    """q/k/v/o projections around a pluggable attention core."""

    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        C, hs = config.n_embd, config.head_dim
        self.q_proj = nn.Linear(C, self.n_head * hs, bias=config.bias)
        self.k_proj = nn.Linear(C, self.n_kv_head * hs, bias=config.bias)
        self.v_proj = nn.Linear(C, self.n_kv_head * hs, bias=config.bias)
        self.o_proj = nn.Linear(self.n_head * hs, C, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.k_conv = ShortConv(self.n_kv_head * hs, config.short_conv) if config.short_conv else None
        self.core = make_core(config)

    def forward(self, x, rope=None, state=None, return_state=False, key_padding_mask=None):
        B, T, C = x.size()
        nh, nkv, hs = self.n_head, self.n_kv_head, self.head_dim
        q = self.q_proj(x).view(B, T, nh, hs).transpose(1, 2)   # (B, nh, T, hs)
        k = self.k_proj(x)                                      # (B, T, nkv * hs)
        conv_past = None
        if self.k_conv is not None:
            k, conv_past = self.k_conv(k, None if state is None else state.get('k_conv'))
        k = k.view(B, T, nkv, hs).transpose(1, 2)               # (B, nkv, T, hs)
        v = self.v_proj(x).view(B, T, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        if rope is not None:
            cos, sin = rope                                     # (T, hs) each
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if nkv != nh:  # GQA: query head h uses key/value head h // (nh // nkv), as in HF repeat_kv
            k = k.repeat_interleave(nh // nkv, dim=1)           # (B, nh, T, hs)
            v = v.repeat_interleave(nh // nkv, dim=1)           # (B, nh, T, hs)
        kwargs = {} if key_padding_mask is None else {'key_padding_mask': key_padding_mask}
        if return_state:
            core_state = None if state is None else {n: t for n, t in state.items() if n != 'k_conv'}
            y, state = self.core(q, k, v, state=core_state, return_state=True, **kwargs)
            if conv_past is not None:
                state = {**state, 'k_conv': conv_past}
        else:
            y = self.core(q, k, v, **kwargs)                    # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, nh * hs)  # (B, T, C)
        y = self.resid_dropout(self.o_proj(y))
        return y, state


class MLP(nn.Module):
    """GELU MLP (gpt2: tanh approximation, bert: exact) or SwiGLU (llama)."""

    def __init__(self, config):
        super().__init__()
        C, H = config.n_embd, config.intermediate_size
        self.family = config.family
        if config.family == 'llama':
            self.gate_proj = nn.Linear(C, H, bias=config.bias)
            self.up_proj = nn.Linear(C, H, bias=config.bias)
            self.down_proj = nn.Linear(H, C, bias=config.bias)
        else:
            self.c_fc = nn.Linear(C, H, bias=config.bias)
            self.c_proj = nn.Linear(H, C, bias=config.bias)
            self.approximate = 'tanh' if config.family == 'gpt2' else 'none'
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        if self.family == 'llama':
            x = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        else:
            x = self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))
        return self.dropout(x)


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.post_norm = config.family == 'bert'
        self.ln_1 = make_norm(config)
        self.attn = SelfAttention(config)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x, rope=None, state=None, return_state=False, key_padding_mask=None):
        if self.post_norm:  # BERT
            a, state = self.attn(x, rope, state, return_state, key_padding_mask)
            x = self.ln_1(x + a)
            x = self.ln_2(x + self.mlp(x))
        else:               # GPT-2, Llama
            a, state = self.attn(self.ln_1(x), rope, state, return_state, key_padding_mask)
            x = x + a
            x = x + self.mlp(self.ln_2(x))
        return x, state


# -----------------------------------------------------------------------------
# the model

class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert isinstance(config, GPTConfig)
        self.config = config
        fam = config.family
        modules = dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
        )
        if fam in ('gpt2', 'bert'):
            modules['wpe'] = nn.Embedding(config.block_size, config.n_embd)
        if fam == 'bert':
            modules['wtt'] = nn.Embedding(config.type_vocab_size, config.n_embd)
            modules['ln_e'] = make_norm(config)   # embedding LayerNorm (post-LN model, no final norm)
        else:
            modules['ln_f'] = make_norm(config)
        self.transformer = nn.ModuleDict(modules)
        if fam == 'bert':
            self.pooler = nn.Linear(config.n_embd, config.n_embd)
            if config.num_labels > 0:
                self.classifier = nn.Linear(config.n_embd, config.num_labels)
        else:
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
            if config.tie_embeddings:
                self.lm_head.weight = self.transformer.wte.weight
        self._inv_freq = {}  # device -> RoPE inverse frequencies, float32 (not a buffer: .to(bf16) must not round it)
        self.tokenizer = None  # a tokenizer.py tokenizer (from_pretrained / checkpoints set it), or None
        # per-layer attention settings (what set_attention may change layer by layer)
        self.layer_specs = [self._spec(config.attn, config.window, config.diag_block, config.impl,
                                       config.attn_options, config.window_combine) for _ in range(config.n_layer)]
        # init (nanoGPT); the attention cores keep their own initialisation (e.g. identity feature maps)
        for name, module in self.named_modules():
            if '.core' not in name and not name.endswith('core'):
                self._init_weights(module)
        for pn, p in self.named_parameters():
            if pn.endswith(('o_proj.weight', 'c_proj.weight', 'down_proj.weight')) and '.core.' not in pn:
                torch.nn.init.normal_(p, mean=0.0, std=config.init_std / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _spec(attn, window, diag_block, impl, options, window_combine='joint'):
        return dict(attn=attn, window=int(window), diag_block=int(diag_block), impl=impl,
                    options=dict(options or {}), window_combine=window_combine)

    @staticmethod
    def spec_from_dict(s):
        """A saved per-layer spec in the current form (files written before window_combine existed are 'joint')."""
        return GPT._spec(s['attn'], s['window'], s['diag_block'], s['impl'], s['options'],
                         s.get('window_combine', 'joint'))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=self.config.emb_init_std)

    def get_num_params(self, non_embedding=True):
        """Number of parameters (position embeddings excluded by default, as in nanoGPT)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and 'wpe' in self.transformer:
            n -= self.transformer.wpe.weight.numel()
        return n

    # ---- attention cores -----------------------------------------------------

    def attention_cores(self):
        """The attention.Attention core of every layer, in layer order."""
        return [block.attn.core for block in self.transformer.h]

    def set_attention(self, attn, layers=None, window=0, diag_block=0, window_combine='joint', **map_options):
        """Replace the attention core of `layers` (default: all), keeping q/k/v/o and everything else.
        `map_options` go to the feature map (e.g. feature_dim=64); `impl=` picks the linear-attention
        implementation (default config.impl); window_combine 'joint' or 'mix' the window hybrid's form
        (attention.combine_window_linear). Changing all layers also updates the config."""
        n = self.config.n_layer
        if layers is None:
            layers = list(range(n))
        elif isinstance(layers, int):
            layers = [layers]
        layers = list(layers)
        bad = [i for i in layers if not isinstance(i, int) or not 0 <= i < n]
        if bad:
            raise ValueError(f"layer indices {bad} out of range: the model has {n} layers (0..{n - 1})")
        if attn not in ATTN_CHOICES:
            raise ValueError(f"unknown attn {attn!r}; choose one of {ATTN_CHOICES}")
        impl = map_options.pop('impl', self.config.impl)
        ref = self.transformer.h[0].attn.q_proj.weight
        for i in layers:
            core = make_core(self.config, attn, window, diag_block, impl, map_options, window_combine)
            self.transformer.h[i].attn.core = core.to(ref.device)
            self.layer_specs[i] = self._spec(attn, window, diag_block, impl, map_options, window_combine)
        if sorted(set(layers)) == list(range(n)):
            self.config.attn, self.config.window, self.config.diag_block = attn, window, diag_block
            self.config.impl, self.config.attn_options = impl, dict(map_options)
            self.config.window_combine = window_combine
        return self

    def _apply_layer_specs(self, specs):
        """Re-create per-layer cores from saved specs (only where they differ from the current ones)."""
        if len(specs) != self.config.n_layer:
            raise ValueError(f"{len(specs)} layer attention specs for a {self.config.n_layer}-layer model")
        for i, s in enumerate(specs):
            s = self.spec_from_dict(s)
            if s != self.layer_specs[i]:
                self.set_attention(s['attn'], layers=[i], window=s['window'], diag_block=s['diag_block'],
                                   window_combine=s['window_combine'], impl=s['impl'], **s['options'])

    # ---- forward ---------------------------------------------------------------

    def _rope(self, offset, T, device):
        if device not in self._inv_freq:
            cfg = self.config
            self._inv_freq[device] = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
        pos = torch.arange(offset, offset + T, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, self._inv_freq[device])           # (T, hs/2)
        emb = torch.cat((freqs, freqs), dim=-1)                    # (T, hs)
        return emb.cos(), emb.sin()

    def _hidden(self, idx, offset=0, states=None, return_state=False, token_type_ids=None,
                attention_mask=None):
        """Final hidden states (B, T, C) for tokens at positions offset..offset+T-1, and new states."""
        cfg = self.config
        B, T = idx.size()
        device = idx.device
        x = self.transformer.wte(idx)                               # (B, T, C)
        if 'wpe' in self.transformer:
            if offset + T > cfg.block_size:
                raise ValueError(f"sequence of length {offset + T} is longer than block_size="
                                 f"{cfg.block_size} (learned position embeddings)")
            pos = torch.arange(offset, offset + T, dtype=torch.long, device=device)
            x = x + self.transformer.wpe(pos)                       # (B, T, C)
        if cfg.family == 'bert':
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(idx)
            x = self.transformer.ln_e(x + self.transformer.wtt(token_type_ids))
        x = self.transformer.drop(x)
        rope = self._rope(offset, T, device) if cfg.family == 'llama' else None
        kpm = None
        if attention_mask is not None:
            if attention_mask.shape != idx.shape:
                raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != idx shape {tuple(idx.shape)}")
            kpm = attention_mask.to(device).bool()                  # (B, T) True = real token
        new_states = []
        for i, block in enumerate(self.transformer.h):
            x, s = block(x, rope, None if states is None else states[i], return_state, kpm)
            new_states.append(s)
        if 'ln_f' in self.transformer:
            x = self.transformer.ln_f(x)
        return x, (new_states if return_state else None)

    def forward(self, idx, targets=None):
        """Causal LM: logits (B, T, vocab) for every position, and the cross-entropy loss if targets
        (B, T) are given (targets[t] is the token that follows idx[t]; -100 is ignored)."""
        if self.config.family == 'bert':
            raise ValueError("family='bert' is bidirectional: use model.encode(...) or model.classify(...)")
        x, _ = self._hidden(idx)
        logits = self.lm_head(x)                                    # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1),
                                   ignore_index=-100)
        return logits, loss

    def encode(self, idx, attention_mask=None, token_type_ids=None):
        """BERT: last hidden states (B, T, C). attention_mask (B, T): 1 = real token, 0 = padding."""
        if self.config.family != 'bert':
            raise ValueError(f"encode() is for family='bert' (this model is {self.config.family!r})")
        x, _ = self._hidden(idx, token_type_ids=token_type_ids, attention_mask=attention_mask)
        return x

    def pool(self, hidden):
        """BERT pooler: tanh(W h_[CLS])."""
        return torch.tanh(self.pooler(hidden[:, 0]))

    def classify(self, idx, attention_mask=None, token_type_ids=None, labels=None):
        """BERT sequence classification: (logits (B, num_labels), loss or None).
        num_labels == 1 is regression (MSE), otherwise cross-entropy."""
        if self.config.family != 'bert' or self.config.num_labels <= 0:
            raise ValueError("classify() needs family='bert' and num_labels > 0 "
                             f"(got family={self.config.family!r}, num_labels={self.config.num_labels})")
        pooled = self.pool(self.encode(idx, attention_mask, token_type_ids))
        logits = self.classifier(self.transformer.drop(pooled))
        loss = None
        if labels is not None:
            if self.config.num_labels == 1:
                loss = F.mse_loss(logits.squeeze(-1).float(), labels.float())
            else:
                loss = F.cross_entropy(logits.float(), labels.long())
        return logits, loss

    # ---- training helpers ------------------------------------------------------

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        """AdamW over the trainable parameters; weight decay on 2-D+ tensors only (nanoGPT), not on the
        identity-initialised short convolution."""
        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        decay = [p for n, p in named if p.dim() >= 2 and 'k_conv' not in n]
        nodecay = [p for n, p in named if p.dim() < 2 or 'k_conv' in n]
        groups = [{'params': decay, 'weight_decay': weight_decay},
                  {'params': nodecay, 'weight_decay': 0.0}]
        use_fused = device_type == 'cuda' and 'fused' in inspect.signature(torch.optim.AdamW).parameters
        extra = dict(fused=True) if use_fused else dict()
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **extra)

    def crop_block_size(self, block_size):
        """Shrink the learned position table (nanoGPT)."""
        assert block_size <= self.config.block_size
        self.config.block_size = block_size
        if 'wpe' in self.transformer:
            self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])

    # ---- generation --------------------------------------------------------------

    def decode_state_nbytes(self, states):
        """Bytes held by the per-layer decoding states (KV caches or recurrent states)."""
        return sum(state_nbytes(s) for s in states)

    @torch.no_grad()
    def prefill(self, idx):
        """Run the prompt and return (logits of the last position (B, vocab), per-layer states)."""
        x, states = self._hidden(idx, offset=0, return_state=True)
        return self.lm_head(x[:, -1]), states

    @torch.no_grad()
    def decode_step(self, tok, offset, states):
        """Feed one token per row (B,) at absolute position `offset`; returns (logits (B, vocab), states)."""
        x, states = self._hidden(tok.view(-1, 1), offset=offset, states=states, return_state=True)
        return self.lm_head(x[:, -1]), states

    @staticmethod
    def _sample(logits, temperature, top_k):
        if temperature == 0.0:
            return logits.argmax(dim=-1)
        logits = logits.float() / temperature
        if top_k is not None:
            v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
            logits = logits.masked_fill(logits < v[:, [-1]], float('-inf'))
        return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1).squeeze(1)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, eos_token_id=None, use_cache=True):
        """Append up to max_new_tokens tokens to idx (B, T) and return (B, T + n).

        temperature=0.0 is greedy decoding (argmax); otherwise sample from softmax(logits / temperature),
        restricted to the top_k most likely tokens if top_k is given (top_k=1 is also greedy).
        eos_token_id (int or list of ints): a row that produced EOS keeps producing EOS (padding), and
        generation stops early once every row has produced one.
        use_cache=True: prefill the prompt, then one token at a time passing each layer's state back --
        a KV cache for softmax (grows with length), a constant-size recurrent state for linear maps and the
        window hybrid. use_cache=False: full forward passes over the whole sequence (the reference;
        learned-position models crop the context to the last block_size tokens, as nanoGPT does).
        """
        cfg = self.config
        if cfg.family == 'bert':
            raise ValueError("generate() needs a causal family (gpt2 or llama), not 'bert'")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        B, T0 = idx.size()
        if max_new_tokens <= 0:
            return idx
        learned_pos = 'wpe' in self.transformer
        if use_cache and learned_pos and T0 + max_new_tokens - 1 > cfg.block_size:
            raise ValueError(f"cached generation of {max_new_tokens} tokens after a {T0}-token prompt needs "
                             f"{T0 + max_new_tokens - 1} positions, more than block_size={cfg.block_size} "
                             f"(learned positions); generate fewer tokens or use use_cache=False (crops the context)")
        eos = None
        if eos_token_id is not None:
            eos = torch.as_tensor(eos_token_id, device=idx.device).view(-1)
        finished = torch.zeros(B, dtype=torch.bool, device=idx.device)
        if use_cache:
            logits, states = self.prefill(idx)
        for i in range(max_new_tokens):
            if not use_cache:
                idx_cond = idx[:, -cfg.block_size:] if learned_pos else idx
                logits = self(idx_cond)[0][:, -1, :]
            nxt = self._sample(logits, temperature, top_k)          # (B,)
            if eos is not None:
                nxt = torch.where(finished, eos[0], nxt)
                finished |= torch.isin(nxt, eos)
            idx = torch.cat((idx, nxt[:, None]), dim=1)
            if eos is not None and bool(finished.all()):
                break
            if use_cache and i < max_new_tokens - 1:
                logits, states = self.decode_step(nxt, idx.size(1) - 1, states)
        return idx

    # ---- pretrained weights ----------------------------------------------------------

    @classmethod
    def from_pretrained(cls, name_or_dir, **overrides):
        """Load a HuggingFace GPT-2 / Llama / BERT checkpoint from a local folder (config.json +
        model.safetensors, sharded model.safetensors.index.json, or pytorch_model.bin) or from the hub by
        name (needs internet, e.g. 'gpt2', 'bert-base-uncased'). A llama.cpp .gguf file (load_gguf) and one of
        our own checkpoint files (save_checkpoint) also work. Overrides are GPTConfig fields, e.g.
        attn='hedgehog', window=64, attn_options={'feature_dim': 64}, num_labels=2, dropout=0.1, block_size=256.
        Every checkpoint key and shape is checked; the new attention parameters (feature maps etc.,
        inside each layer's `core`) are the only parameters allowed to be absent. `model.tokenizer` is the
        checkpoint's tokenizer (a HF folder's tokenizer files, the GGUF vocabulary, our checkpoint's) or None."""
        bad = sorted(set(overrides) - {f.name for f in fields(GPTConfig)})
        if bad:
            raise ValueError(f"unknown override(s) {bad}; GPTConfig fields are {[f.name for f in fields(GPTConfig)]}")
        if os.path.isfile(name_or_dir) and str(name_or_dir).endswith('.gguf'):
            return load_gguf(name_or_dir, **overrides)
        if os.path.isfile(name_or_dir):
            return _load_own_checkpoint(name_or_dir, overrides)[0]
        folder = _resolve_hf_folder(name_or_dir)
        with open(os.path.join(folder, 'config.json')) as f:
            hf = json.load(f)
        cfg_kwargs = hf_config_to_kwargs(hf)
        if overrides.get('family', cfg_kwargs['family']) != cfg_kwargs['family']:
            raise ValueError(f"family={overrides['family']!r} does not match the checkpoint ({cfg_kwargs['family']!r})")
        cfg_kwargs.update(overrides)
        config = GPTConfig(**cfg_kwargs)
        model = cls(config)
        tensors = _read_hf_tensors(folder)
        _load_hf_state(model, tensors, name_or_dir)
        if tokenizer_lib.has_tokenizer_files(folder):
            model.tokenizer = tokenizer_lib.HFTokenizer.from_folder(folder)
        return model


# -----------------------------------------------------------------------------
# HuggingFace checkpoints

def hf_config_to_kwargs(hf):
    """HF config.json dict -> GPTConfig keyword arguments."""
    mt = hf.get('model_type')
    if mt == 'gpt2':
        act = hf.get('activation_function', 'gelu_new')
        if act not in ('gelu_new', 'gelu_pytorch_tanh'):
            raise ValueError(f"GPT-2 activation {act!r} not supported (expects gelu_new)")
        if hf.get('scale_attn_by_inverse_layer_idx') or not hf.get('scale_attn_weights', True):
            raise ValueError("GPT-2 variants with scale_attn_by_inverse_layer_idx or without scale_attn_weights "
                             "are not supported")
        n_embd = hf['n_embd']
        return dict(family='gpt2', vocab_size=hf['vocab_size'], block_size=hf['n_positions'],
                    n_layer=hf['n_layer'], n_head=hf['n_head'], n_embd=n_embd,
                    intermediate_size=hf.get('n_inner') or 4 * n_embd, bias=True,
                    norm_eps=hf.get('layer_norm_epsilon', 1e-5),
                    tie_embeddings=hf.get('tie_word_embeddings', True))
    if mt == 'llama':
        if hf.get('hidden_act', 'silu') != 'silu':
            raise ValueError(f"Llama activation {hf.get('hidden_act')!r} not supported (expects silu)")
        attn_bias, mlp_bias = hf.get('attention_bias', False), hf.get('mlp_bias', False)
        if attn_bias != mlp_bias:
            raise ValueError(f"attention_bias={attn_bias} with mlp_bias={mlp_bias} is not supported "
                             "(one bias flag for the whole model)")
        n_embd, n_head = hf['hidden_size'], hf['num_attention_heads']
        if hf.get('head_dim') not in (None, n_embd // n_head):
            raise ValueError(f"head_dim={hf['head_dim']} != hidden_size/num_attention_heads={n_embd // n_head} "
                             "is not supported")
        if hf.get('pretraining_tp', 1) != 1:
            warnings.warn("pretraining_tp != 1 is ignored (it only changes how HF splits the matmuls)")
        rope = hf.get('rope_parameters') or {}   # transformers >= 5
        theta = rope.get('rope_theta', hf.get('rope_theta', 10000.0))
        scaling = hf.get('rope_scaling') or rope
        scaling = {k: v for k, v in scaling.items() if k != 'rope_theta'}
        if scaling.get('rope_type', scaling.get('type', 'default')) == 'default':
            scaling = None
        else:
            rope_inv_freq(2, theta, scaling)   # fail early on an unsupported rope_type
        return dict(family='llama', vocab_size=hf['vocab_size'], block_size=hf.get('max_position_embeddings', 2048),
                    n_layer=hf['num_hidden_layers'], n_head=n_head,
                    n_kv_head=hf.get('num_key_value_heads') or n_head, n_embd=n_embd,
                    intermediate_size=hf['intermediate_size'], bias=bool(attn_bias),
                    norm_eps=hf.get('rms_norm_eps', 1e-6), rope_theta=float(theta), rope_scaling=scaling,
                    tie_embeddings=hf.get('tie_word_embeddings', False))
    if mt == 'bert':
        if hf.get('hidden_act', 'gelu') != 'gelu':
            raise ValueError(f"BERT activation {hf.get('hidden_act')!r} not supported (expects exact gelu)")
        if hf.get('position_embedding_type', 'absolute') != 'absolute':
            raise ValueError("BERT with relative position embeddings is not supported")
        archs = hf.get('architectures') or []
        num_labels = 0
        if any(a.endswith('ForSequenceClassification') for a in archs):
            num_labels = len(hf['id2label']) if hf.get('id2label') else hf.get('num_labels', 2)
        return dict(family='bert', vocab_size=hf['vocab_size'], block_size=hf['max_position_embeddings'],
                    n_layer=hf['num_hidden_layers'], n_head=hf['num_attention_heads'], n_embd=hf['hidden_size'],
                    intermediate_size=hf['intermediate_size'], bias=True,
                    norm_eps=hf.get('layer_norm_eps', 1e-12), type_vocab_size=hf.get('type_vocab_size', 2),
                    num_labels=num_labels, tie_embeddings=False)
    raise ValueError(f"unsupported model_type {mt!r}; supported: 'gpt2', 'llama', 'bert'")


def _resolve_hf_folder(name_or_dir):
    if os.path.isdir(name_or_dir):
        if not os.path.isfile(os.path.join(name_or_dir, 'config.json')):
            raise FileNotFoundError(f"{name_or_dir} has no config.json (expected a HuggingFace checkpoint folder)")
        return name_or_dir
    if name_or_dir.startswith(('/', '.', '~')) or name_or_dir.count('/') > 1:
        raise FileNotFoundError(f"no such checkpoint folder or file: {name_or_dir}")
    try:
        from huggingface_hub import snapshot_download
        files = ['config.json', '*.json', 'vocab.txt', 'merges.txt', 'tokenizer.model']  # config + tokenizer
        folder = snapshot_download(name_or_dir, allow_patterns=files + ['*.safetensors'])
        if not glob.glob(os.path.join(folder, '*.safetensors')):
            folder = snapshot_download(name_or_dir, allow_patterns=files + ['*.bin'])
    except Exception as e:  # offline, unknown repo, gated model, ...
        raise RuntimeError(
            f"could not download {name_or_dir!r} from the HuggingFace hub ({type(e).__name__}: {e}). "
            "Downloading needs internet access (and a token for gated models such as meta-llama/*); "
            "otherwise pass a local folder with config.json and *.safetensors.") from e
    return folder


def _read_hf_tensors(folder):
    """All tensors of a HF checkpoint folder: {name: tensor} (safetensors, sharded or not; else .bin)."""
    from safetensors.torch import load_file
    index = os.path.join(folder, 'model.safetensors.index.json')
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)['weight_map'].values()))
        files = [os.path.join(folder, s) for s in shards]
        missing = [p for p in files if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(f"shards listed in {index} are missing: {missing}")
        out = {}
        for p in files:
            out.update(load_file(p))
        return out
    if os.path.isfile(os.path.join(folder, 'model.safetensors')):
        return load_file(os.path.join(folder, 'model.safetensors'))
    bins = []
    bin_index = os.path.join(folder, 'pytorch_model.bin.index.json')
    if os.path.isfile(bin_index):
        with open(bin_index) as f:
            bins = [os.path.join(folder, s) for s in sorted(set(json.load(f)['weight_map'].values()))]
    elif os.path.isfile(os.path.join(folder, 'pytorch_model.bin')):
        bins = [os.path.join(folder, 'pytorch_model.bin')]
    if not bins:
        raise FileNotFoundError(f"no model.safetensors, model.safetensors.index.json or pytorch_model.bin in {folder}")
    out = {}
    for p in bins:
        out.update(torch.load(p, map_location='cpu', weights_only=True))
    return out


# buffers / heads some HF checkpoints hold that this model does not use (skipped, never an error)
_HF_IGNORED_SUFFIXES = ('.attn.bias', '.attn.masked_bias', 'rotary_emb.inv_freq', 'embeddings.position_ids')


def _normalise_hf_keys(family, tensors):
    out = {}
    for k, v in tensors.items():
        if family == 'gpt2' and k.startswith('transformer.'):
            k = k[len('transformer.'):]
        if family == 'bert':
            if k.startswith('bert.'):
                k = k[len('bert.'):]
            if k.endswith('LayerNorm.gamma'):
                k = k[:-len('gamma')] + 'weight'
            if k.endswith('LayerNorm.beta'):
                k = k[:-len('beta')] + 'bias'
        out[k] = v
    return out


def _hf_key_map(config):
    """{our parameter name: (hf key, transform)} for everything we load from a HF checkpoint."""
    fam, C, n_layer = config.family, config.n_embd, config.n_layer
    T = lambda t: t.t()                                          # Conv1D (in, out) -> Linear (out, in)
    ident = lambda t: t
    m = {}
    if fam == 'gpt2':
        m['transformer.wte.weight'] = ('wte.weight', ident)
        m['transformer.wpe.weight'] = ('wpe.weight', lambda t: t[:config.block_size])
        for i in range(n_layer):
            h, o = f'h.{i}.', f'transformer.h.{i}.'
            for j, name in enumerate(('q_proj', 'k_proj', 'v_proj')):
                m[o + f'attn.{name}.weight'] = (h + 'attn.c_attn.weight', lambda t, j=j: t.t()[j * C:(j + 1) * C])
                m[o + f'attn.{name}.bias'] = (h + 'attn.c_attn.bias', lambda t, j=j: t[j * C:(j + 1) * C])
            m[o + 'attn.o_proj.weight'] = (h + 'attn.c_proj.weight', T)
            m[o + 'attn.o_proj.bias'] = (h + 'attn.c_proj.bias', ident)
            for ln in ('ln_1', 'ln_2'):
                for p in ('weight', 'bias'):
                    m[o + f'{ln}.{p}'] = (h + f'{ln}.{p}', ident)
            for lin in ('c_fc', 'c_proj'):
                m[o + f'mlp.{lin}.weight'] = (h + f'mlp.{lin}.weight', T)
                m[o + f'mlp.{lin}.bias'] = (h + f'mlp.{lin}.bias', ident)
        for p in ('weight', 'bias'):
            m[f'transformer.ln_f.{p}'] = (f'ln_f.{p}', ident)
        if not config.tie_embeddings:
            m['lm_head.weight'] = ('lm_head.weight', ident)
    elif fam == 'llama':
        m['transformer.wte.weight'] = ('model.embed_tokens.weight', ident)
        ps = ('weight', 'bias') if config.bias else ('weight',)
        for i in range(n_layer):
            h, o = f'model.layers.{i}.', f'transformer.h.{i}.'
            for name in ('q_proj', 'k_proj', 'v_proj', 'o_proj'):
                for p in ps:
                    m[o + f'attn.{name}.{p}'] = (h + f'self_attn.{name}.{p}', ident)
            for name in ('gate_proj', 'up_proj', 'down_proj'):
                for p in ps:
                    m[o + f'mlp.{name}.{p}'] = (h + f'mlp.{name}.{p}', ident)
            m[o + 'ln_1.weight'] = (h + 'input_layernorm.weight', ident)
            m[o + 'ln_2.weight'] = (h + 'post_attention_layernorm.weight', ident)
        m['transformer.ln_f.weight'] = ('model.norm.weight', ident)
        if not config.tie_embeddings:
            m['lm_head.weight'] = ('lm_head.weight', ident)
    else:  # bert
        e = 'embeddings.'
        m['transformer.wte.weight'] = (e + 'word_embeddings.weight', ident)
        m['transformer.wpe.weight'] = (e + 'position_embeddings.weight', lambda t: t[:config.block_size])
        m['transformer.wtt.weight'] = (e + 'token_type_embeddings.weight', ident)
        for p in ('weight', 'bias'):
            m[f'transformer.ln_e.{p}'] = (e + f'LayerNorm.{p}', ident)
        for i in range(n_layer):
            h, o = f'encoder.layer.{i}.', f'transformer.h.{i}.'
            for p in ('weight', 'bias'):
                m[o + f'attn.q_proj.{p}'] = (h + f'attention.self.query.{p}', ident)
                m[o + f'attn.k_proj.{p}'] = (h + f'attention.self.key.{p}', ident)
                m[o + f'attn.v_proj.{p}'] = (h + f'attention.self.value.{p}', ident)
                m[o + f'attn.o_proj.{p}'] = (h + f'attention.output.dense.{p}', ident)
                m[o + f'ln_1.{p}'] = (h + f'attention.output.LayerNorm.{p}', ident)
                m[o + f'mlp.c_fc.{p}'] = (h + f'intermediate.dense.{p}', ident)
                m[o + f'mlp.c_proj.{p}'] = (h + f'output.dense.{p}', ident)
                m[o + f'ln_2.{p}'] = (h + f'output.LayerNorm.{p}', ident)
            # (bias may be absent from our LayerNorms if bias=False; filtered against the model below)
        for p in ('weight', 'bias'):
            m[f'pooler.{p}'] = (f'pooler.dense.{p}', ident)
            if config.num_labels > 0:
                m[f'classifier.{p}'] = (f'classifier.{p}', ident)
    return m


def _is_core_name(name):
    return '.attn.core.' in name


def _fmt(names, limit=20):
    names = sorted(names)
    s = ', '.join(names[:limit])
    return s + (f', ... ({len(names) - limit} more)' if len(names) > limit else '')


def _raise_key_errors(header, missing, unexpected, shape_problems, where=''):
    """One ValueError naming every missing, unexpected and mis-shaped tensor (nothing when all match)."""
    if not (missing or unexpected or shape_problems):
        return
    msg = [header + ':']
    if missing:
        msg.append(f"missing keys{where}: {_fmt(missing)}")
    if unexpected:
        msg.append(f"unexpected keys{where}: {_fmt(unexpected)}")
    if shape_problems:
        msg.append("shape mismatches: " + '; '.join(shape_problems[:20]))
    raise ValueError('\n  '.join(msg))


def _load_hf_state(model, tensors, source):
    cfg = model.config
    tensors = _normalise_hf_keys(cfg.family, tensors)
    kmap = _hf_key_map(cfg)
    own = {k: v for k, v in model.state_dict().items()}
    if cfg.tie_embeddings and 'lm_head.weight' in own:
        del own['lm_head.weight']           # tied to transformer.wte.weight
    expected = {k for k in own if not _is_core_name(k)}
    allowed_new = set()
    # a classification head requested on a checkpoint that has none is new (randomly initialised)
    if cfg.family == 'bert' and cfg.num_labels > 0 and 'classifier.weight' not in tensors:
        allowed_new |= {'classifier.weight', 'classifier.bias'}
    # a BERT saved without its pooler (BertModel(add_pooling_layer=False), token-classification and masked-LM
    # checkpoints): encode() does not need it; classify() gets a newly initialised pooler that finetuning trains
    if cfg.family == 'bert' and not any(k.startswith('pooler.') for k in tensors):
        allowed_new |= {'pooler.weight', 'pooler.bias'}
        warnings.warn(f"{source}: the checkpoint has no pooler (pooler.dense.*); loaded without it: encode() is "
                      "unaffected, the pooler used by classify() is newly initialised (N(0, 0.02)) and trains with "
                      "the classifier")
    ignored, problems = [], []
    unmapped = sorted(expected - set(kmap))
    if unmapped:  # a bug in the key map, not in the checkpoint
        raise RuntimeError(f"model.py has no HF source for parameters: {_fmt(unmapped)}")
    missing = sorted(k for k in expected - allowed_new if kmap[k][0] not in tensors)
    used = {kmap[k][0] for k in expected if kmap[k][0] in tensors}
    unexpected = []
    for k in sorted(set(tensors) - used):
        if k.endswith(_HF_IGNORED_SUFFIXES):
            continue
        if cfg.family == 'bert' and k.startswith('cls.'):
            ignored.append(k)          # BERT pretraining heads (MLM / NSP): not modelled here
        elif cfg.family == 'bert' and k.startswith('classifier.') and cfg.num_labels == 0:
            ignored.append(k)          # classification head of a checkpoint loaded with num_labels=0
        elif k == 'lm_head.weight' and cfg.tie_embeddings:
            ignored.append(k)          # tied head saved explicitly
        else:
            unexpected.append(k)
    shapes = {}
    for k in sorted(expected):
        src = kmap[k][0]
        if src not in tensors:
            continue
        t = kmap[k][1](tensors[src])
        if tuple(t.shape) != tuple(own[k].shape):
            problems.append(f"{src} -> {k}: checkpoint {tuple(tensors[src].shape)} gives {tuple(t.shape)}, "
                            f"model expects {tuple(own[k].shape)}")
        else:
            shapes[k] = t
    _raise_key_errors(f"cannot load {source!r} into a {cfg.family} model", [kmap[k][0] for k in missing],
                      unexpected, problems, where=' in checkpoint')
    if ignored:
        warnings.warn(f"ignored {len(ignored)} checkpoint tensors this model does not use: {_fmt(ignored, 5)}")
    with torch.no_grad():
        for k, t in shapes.items():
            own[k].copy_(t)


# -----------------------------------------------------------------------------
# GGUF files (llama.cpp): the config from the metadata, the tensors dequantised by gguf's own reader

GGUF_TENSOR_TYPES = ('F32', 'F16', 'BF16', 'Q8_0', 'Q4_0', 'Q4_1', 'Q5_0', 'Q5_1',
                     'Q2_K', 'Q3_K', 'Q4_K', 'Q5_K', 'Q6_K')
# GGUF tensor names -> HF Llama names: blk.N.<x>.weight -> model.layers.N.<y>.weight, and the three outside layers
_GGUF_LAYER_NAMES = {'attn_norm': 'input_layernorm', 'attn_q': 'self_attn.q_proj', 'attn_k': 'self_attn.k_proj',
                     'attn_v': 'self_attn.v_proj', 'attn_output': 'self_attn.o_proj',
                     'ffn_norm': 'post_attention_layernorm', 'ffn_gate': 'mlp.gate_proj', 'ffn_up': 'mlp.up_proj',
                     'ffn_down': 'mlp.down_proj'}
_GGUF_TOP_NAMES = {'token_embd': 'model.embed_tokens', 'output_norm': 'model.norm', 'output': 'lm_head'}


def gguf_to_hf_name(name, reverse=False):
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight' (reverse=True: back); names it does
    not know come back unchanged."""
    head, _, suffix = name.rpartition('.')
    if not reverse:
        parts = head.split('.')
        if len(parts) == 3 and parts[0] == 'blk' and parts[2] in _GGUF_LAYER_NAMES:
            return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{suffix}"
        return f"{_GGUF_TOP_NAMES[head]}.{suffix}" if head in _GGUF_TOP_NAMES else name
    layer, top = ({v: k for k, v in d.items()} for d in (_GGUF_LAYER_NAMES, _GGUF_TOP_NAMES))
    if head.startswith('model.layers.'):
        i, _, rest = head[len('model.layers.'):].partition('.')
        return f"blk.{i}.{layer[rest]}.{suffix}" if rest in layer else name
    return f"{top[head]}.{suffix}" if head in top else name


def gguf_config_to_kwargs(reader, path):
    """GGUF metadata (a gguf.GGUFReader) -> GPTConfig keyword arguments. Architecture 'llama' only."""
    def get(key, default=...):
        f = reader.fields.get(key)
        if f is None and default is ...:
            raise ValueError(f"{path}: the GGUF metadata has no {key!r}")
        return default if f is None else f.contents()
    arch = get('general.architecture')
    if arch != 'llama':
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; supported: 'llama' (Llama 2/3, "
                         "TinyLlama, SmolLM2, ...)")
    n_embd, n_head = get('llama.embedding_length'), get('llama.attention.head_count')
    n_kv_head, head_dim = get('llama.attention.head_count_kv', n_head), n_embd // n_head
    if not isinstance(n_kv_head, int):
        raise ValueError(f"{path}: per-layer head_count_kv {n_kv_head} is not supported (one value for all layers)")
    for key in ('rope.dimension_count', 'attention.key_length', 'attention.value_length'):
        if get('llama.' + key, head_dim) != head_dim:
            raise ValueError(f"{path}: llama.{key} = {get('llama.' + key)} is not head_dim = embedding_length / "
                             f"head_count = {head_dim}; only RoPE on the whole head is supported")
    names = {t.name for t in reader.tensors}
    if 'rope_freqs.weight' in names:
        raise ValueError(f"{path}: per-frequency RoPE factors (rope_freqs.weight: llama.cpp's form of Llama 3.1 "
                         "rope scaling) are not supported; supported RoPE scaling: none, linear")
    scaling = get('llama.rope.scaling.type', 'none')
    if scaling not in ('none', 'linear'):
        raise ValueError(f"{path}: RoPE scaling {scaling!r} is not supported; supported: none, linear")
    if scaling == 'linear':
        scaling = {'rope_type': 'linear', 'factor': float(get('llama.rope.scaling.factor'))}
    else:
        scaling = None
    tokens = reader.fields.get('tokenizer.ggml.tokens')
    vocab = get('llama.vocab_size', None if tokens is None else len(tokens.data))
    if vocab is None:
        raise ValueError(f"{path}: the GGUF metadata has neither llama.vocab_size nor tokenizer.ggml.tokens")
    return dict(family='llama', vocab_size=vocab, block_size=get('llama.context_length', 2048),
                n_layer=get('llama.block_count'), n_head=n_head, n_kv_head=n_kv_head, n_embd=n_embd,
                intermediate_size=get('llama.feed_forward_length'), bias='blk.0.attn_q.bias' in names,
                norm_eps=float(get('llama.attention.layer_norm_rms_epsilon')),
                rope_theta=float(get('llama.rope.freq_base', 10000.0)), rope_scaling=scaling,
                tie_embeddings='output.weight' not in names)


def unpermute_qk(w, n_heads):
    """Undo llama.cpp's q/k row order. convert_hf_to_gguf.py's `permute(w, n_head, n_head_kv)` reshapes the
    rows to (heads, 2, head_dim/2) and swaps the last two axes, so that each head's two RoPE halves interleave
    (GGML's rope rotates adjacent pairs); this goes back to HF's rotate_half layout (halves in blocks).
    w: (n_heads * head_dim, ...) with n_heads = n_head for q, n_kv_head for k."""
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _read_gguf_tensors(reader, model, path):
    """{HF name: float32 tensor} of a GGUF file, checked against `model` first: every name and shape (reported
    with GGUF names, as _raise_key_errors does for HF files) and every tensor type."""
    import gguf
    import numpy as np
    cfg = model.config
    own = {k: v for k, v in model.state_dict().items() if not _is_core_name(k)}
    if cfg.tie_embeddings:
        own.pop('lm_head.weight', None)
    kmap = _hf_key_map(cfg)
    expected = {gguf_to_hf_name(kmap[k][0], reverse=True): own[k].shape for k in own}
    found = {t.name: t for t in reader.tensors}
    problems = [f"{n}: file {tuple(reversed(found[n].shape.tolist()))} vs model {tuple(s)}"
                for n, s in expected.items() if n in found and tuple(reversed(found[n].shape.tolist())) != tuple(s)]
    _raise_key_errors(f"cannot load {path!r} into a llama model", set(expected) - set(found),
                      set(found) - set(expected), problems, where=' in the GGUF file')
    supported = [getattr(gguf.GGMLQuantizationType, t) for t in GGUF_TENSOR_TYPES]
    out = {}
    for t in reader.tensors:
        if t.tensor_type not in supported:
            raise ValueError(f"{path}: tensor {t.name} has type {t.tensor_type.name}; supported types: "
                             f"{', '.join(GGUF_TENSOR_TYPES)}")
        w = np.require(gguf.quants.dequantize(t.data, t.tensor_type), np.float32, ['C', 'W'])
        w = torch.from_numpy(w.reshape(tuple(reversed(t.shape.tolist()))))   # (out, in): torch Linear layout
        if t.name.startswith('blk.') and t.name.split('.')[2] in ('attn_q', 'attn_k'):
            w = unpermute_qk(w, cfg.n_head if '.attn_q.' in t.name else cfg.n_kv_head)
        out[gguf_to_hf_name(t.name)] = w
    return out


def load_gguf(path, **overrides):
    """A llama.cpp GGUF file -> GPT (family 'llama'): hyperparameters from the metadata, every tensor dequantised
    to float32 by gguf's reader (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K-Q6_K), q/k rows put back in
    HF order (unpermute_qk). model.tokenizer is the file's byte-level BPE vocabulary (tokenizer.HFTokenizer); a
    vocabulary it cannot read (SentencePiece) leaves it None with a warning, so that using the model for text
    asks for a tokenizer. `overrides` as in GPT.from_pretrained."""
    import gguf
    reader = gguf.GGUFReader(path)
    cfg_kwargs = gguf_config_to_kwargs(reader, path)
    if overrides.get('family', 'llama') != 'llama':
        raise ValueError(f"family={overrides['family']!r} does not match the GGUF file ('llama')")
    cfg_kwargs.update(overrides)
    model = GPT(GPTConfig(**cfg_kwargs))
    _load_hf_state(model, _read_gguf_tensors(reader, model, path), path)
    try:
        model.tokenizer = tokenizer_lib.HFTokenizer.from_gguf(reader)
    except tokenizer_lib.TokenizerError as e:
        warnings.warn(f"{path}: {e}; model.tokenizer is None (give one, e.g. --tokenizer <HF folder>)")
    return model


# -----------------------------------------------------------------------------
# our own checkpoints

def _atomic_write(path, write_fn):
    """Write via a temporary file in the same folder, then os.replace (never a half-written file)."""
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix='.' + os.path.basename(path) + '.', suffix='.tmp')
    os.close(fd)
    try:
        write_fn(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _model_tensors(model, include=None):
    """state_dict without the tied lm_head duplicate, as contiguous CPU tensors."""
    sd = model.state_dict()
    if model.config.family != 'bert' and model.config.tie_embeddings:
        sd.pop('lm_head.weight', None)
    return {k: v.detach().contiguous().cpu() for k, v in sd.items() if include is None or include(k)}


def _meta(model):
    return {'format': CHECKPOINT_FORMAT, 'config': asdict(model.config), 'layers': model.layer_specs}


def save_checkpoint(path, model, **extra):
    """Save config + weights (+ extra, e.g. iter_num, optimizer state) atomically.
    path ending in .safetensors: a safetensors file whose header holds the config and extra (extra must be
    JSON-serialisable); any other path: torch.save of {'meta', 'model', 'extra'} (extra may hold tensors).
    meta['tokenizer'] is the spec of model.tokenizer (tokenizer.py), so that the file carries it."""
    tensors = _model_tensors(model)
    meta = _meta(model)
    meta['tokenizer'] = model.tokenizer.to_spec() if model.tokenizer is not None else None
    if str(path).endswith('.safetensors'):
        from safetensors.torch import save_file
        try:
            extra_json = json.dumps(extra)
        except TypeError as e:
            raise TypeError(f"extra values must be JSON-serialisable for a .safetensors checkpoint ({e}); "
                            "use a .pt path to store tensors such as optimizer state") from e
        metadata = {'meta': json.dumps(meta), 'extra': extra_json}
        _atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
    else:
        obj = {'meta': meta, 'model': tensors, 'extra': extra}
        _atomic_write(path, lambda tmp: torch.save(obj, tmp))


def _read_own_checkpoint(path, map_location='cpu'):
    if str(path).endswith('.safetensors'):
        from safetensors import safe_open
        from safetensors.torch import load_file
        with safe_open(path, framework='pt') as f:
            md = f.metadata() or {}
        if 'meta' not in md:
            raise ValueError(f"{path} is not a checkpoint written by save_checkpoint (no 'meta' in its header)")
        return json.loads(md['meta']), load_file(path, device=str(map_location)), json.loads(md.get('extra', '{}'))
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{path}: extra holds objects torch.load(weights_only=True) refuses ({e})") from e
    if not isinstance(obj, dict) or 'meta' not in obj or 'model' not in obj:
        raise ValueError(f"{path} is not a checkpoint written by save_checkpoint")
    return obj['meta'], obj['model'], obj.get('extra', {})


def _strict_load(model, tensors, what, skip=()):
    """Copy tensors into model; error naming missing / unexpected keys and shape mismatches."""
    own = _model_tensors_live(model)
    missing = sorted(set(own) - set(tensors) - set(skip))
    unexpected = sorted(set(tensors) - set(own))
    shape = [f"{k}: file {tuple(tensors[k].shape)} vs model {tuple(own[k].shape)}"
             for k in sorted(set(own) & set(tensors)) if tuple(own[k].shape) != tuple(tensors[k].shape)]
    _raise_key_errors(f"cannot load {what}", missing, unexpected, shape)
    with torch.no_grad():
        for k, t in tensors.items():
            own[k].copy_(t)


def _model_tensors_live(model):
    sd = model.state_dict(keep_vars=True)
    if model.config.family != 'bert' and model.config.tie_embeddings:
        sd.pop('lm_head.weight', None)
    return {k: v.data for k, v in sd.items()}


_ATTN_FIELDS = ('attn', 'window', 'diag_block', 'window_combine', 'impl', 'attn_options')


def _load_own_checkpoint(path, overrides=None, map_location='cpu'):
    meta, tensors, extra = _read_own_checkpoint(path, map_location)
    cfg = dict(meta['config'])
    overrides = dict(overrides or {})
    cfg.update(overrides)
    model = GPT(GPTConfig(**cfg))
    if any(k in overrides for k in _ATTN_FIELDS):
        # new attention requested: the checkpoint's own attention parameters are dropped
        tensors = {k: v for k, v in tensors.items() if not _is_core_name(k)}
        skip = [k for k in _model_tensors_live(model) if _is_core_name(k)]
    else:
        model._apply_layer_specs(meta.get('layers') or model.layer_specs)
        skip = ()
    _strict_load(model, tensors, f"checkpoint {path}", skip)
    if meta.get('tokenizer'):
        model.tokenizer = tokenizer_lib.load_tokenizer(meta['tokenizer'])
    return model, extra


def load_checkpoint(path, map_location='cpu'):
    """Load a save_checkpoint file -> (model, extra). Strict: every key and shape must match.
    A save_new_parameters folder also works: its base model is loaded and the new parameters put in
    (extra is then the manifest's extra)."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, MANIFEST_FILE)) or \
                read_manifest(path).get('format') != CHECKPOINT_FORMAT:
            raise ValueError(f"{path} is a folder but not one written by save_new_parameters "
                             f"(no {MANIFEST_FILE} with format {CHECKPOINT_FORMAT!r})")
        return load_new_parameters(path, None, map_location), read_manifest(path).get('extra', {})
    return _load_own_checkpoint(path, None, map_location)


# -----------------------------------------------------------------------------
# converted models saved as only their new parameters

NEW_PARAMS_FILE = 'new_parameters.safetensors'
MANIFEST_FILE = 'manifest.json'


def is_new_parameter(name):
    """Default filter for save_new_parameters: the attention cores' tensors (feature maps, window factors)."""
    return _is_core_name(name)


def save_new_parameters(path, model, base_model_name, include=None, **extra):
    """Save only the parameters a conversion added (default: everything inside the attention cores;
    pass include=lambda name: ... to add e.g. LoRA weights) to folder `path`:
    path/new_parameters.safetensors and path/manifest.json = {base_model, config, layers, parameters, extra,
    tokenizer}. base_model_name is what load_new_parameters rebuilds the base from (a hub name, a HF folder, or
    one of our checkpoint files). model.tokenizer goes to path/tokenizer_spec.json, named with its fingerprint
    in the manifest. Files are written atomically (manifest last)."""
    from safetensors.torch import save_file
    include = include or is_new_parameter
    tensors = _model_tensors(model, include)
    if not tensors:
        raise ValueError("no parameters match `include`: nothing new to save (is the model still softmax?)")
    manifest = dict(format=CHECKPOINT_FORMAT, base_model=str(base_model_name), config=asdict(model.config),
                    layers=model.layer_specs, parameters={k: list(v.shape) for k, v in tensors.items()},
                    extra=extra)
    json.dumps(manifest)  # fail before writing anything if extra is not JSON-serialisable
    os.makedirs(path, exist_ok=True)
    _atomic_write(os.path.join(path, NEW_PARAMS_FILE), lambda tmp: save_file(tensors, tmp))
    manifest['tokenizer'] = tokenizer_lib.save_spec(path, model.tokenizer)
    _atomic_write(os.path.join(path, MANIFEST_FILE),
                  lambda tmp: open(tmp, 'w').write(json.dumps(manifest, indent=2)))


def read_manifest(path):
    with open(os.path.join(path, MANIFEST_FILE)) as f:
        return json.load(f)


def load_new_parameters(path, model=None, map_location='cpu'):
    """Load a save_new_parameters folder strictly into `model` (which must have the same attention layers
    as the manifest; add LoRA adapters etc. before loading) and return the model. With model=None the base
    model named in the manifest is loaded first (GPT.from_pretrained) and given the manifest's attention.
    Errors name missing keys (new parameters of the model absent from the file), unexpected keys (in the
    file but not in the model) and shape mismatches. The saved tokenizer is attached (model.tokenizer); a base
    whose own tokenizer is not the one saved is an error."""
    from safetensors.torch import load_file
    manifest = read_manifest(path)
    tensors = load_file(os.path.join(path, NEW_PARAMS_FILE), device=str(map_location))
    if sorted(tensors) != sorted(manifest['parameters']):
        raise ValueError(f"{path}: {NEW_PARAMS_FILE} does not hold the parameters its manifest lists")
    if model is None:
        cfg = manifest['config']
        model = GPT.from_pretrained(manifest['base_model'], **{k: cfg[k] for k in _ATTN_FIELDS if k in cfg})
        model._apply_layer_specs(manifest['layers'])
    specs = [GPT.spec_from_dict(s) for s in manifest['layers']]
    if specs != model.layer_specs:
        diff = [i for i, (a, b) in enumerate(zip(specs, model.layer_specs)) if a != b]
        if len(specs) != len(model.layer_specs):
            diff = f"{len(specs)} layers in the manifest vs {len(model.layer_specs)} in the model"
        raise ValueError(f"attention layers of the model differ from the manifest in {path} (layers {diff}): "
                         f"manifest {[specs[i] for i in diff][:2] if isinstance(diff, list) else ''} vs model "
                         f"{[model.layer_specs[i] for i in diff][:2] if isinstance(diff, list) else ''}; "
                         "use model.set_attention(...) first")
    own = _model_tensors_live(model)
    missing = sorted(k for k in own if is_new_parameter(k) and k not in tensors)
    unexpected = sorted(set(tensors) - set(own))
    if missing or unexpected:
        msg = [f"cannot load new parameters from {path} into this model:"]
        if missing:
            msg.append(f"missing keys: {_fmt(missing)}")
        if unexpected:
            msg.append(f"unexpected keys: {_fmt(unexpected)} (add adapters such as LoRA to the model first)")
        raise ValueError('\n  '.join(msg))
    _strict_load_subset(own, tensors, path)
    return tokenizer_lib.attach_saved(path, manifest.get('tokenizer'), model)


def _strict_load_subset(own, tensors, what):
    shape = [f"{k}: file {tuple(t.shape)} vs model {tuple(own[k].shape)}"
             for k, t in tensors.items() if tuple(own[k].shape) != tuple(t.shape)]
    if shape:
        raise ValueError(f"cannot load {what}: shape mismatches: " + '; '.join(shape[:20]))
    with torch.no_grad():
        for k, t in tensors.items():
            own[k].copy_(t)
