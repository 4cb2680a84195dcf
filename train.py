"""Train a small GPT, nanoGPT style, whose attention is softmax or a linear feature map.

    python train.py --attn hedgehog      # associative recall (the default task, no download)
    python train.py --attn lolcats:feature_dim=16:window=16:combine=mix   # options go in --attn
    python train.py --task text --data data/tinyshakespeare/input.txt
    python train.py --task glue --glue_task cola --data data/cola --init_from <HF BERT folder>
    python train.py --compare softmax,hedgehog,elu,exp:t=2 --ar_vocab 128 --max_iters 2000
    torchrun --nproc_per_node=2 train.py ...         # DDP (NCCL on GPUs, gloo on CPU)

In reading order: `parse_config`, TrainConfig; data: associative recall (Hedgehog App. B.1,
zoology's MQAR), text and `perplexity`, GLUE, attention entropy (Hedgehog Fig. 4); `fit`, the one
loop (convert.py's too); `train`.

Scratch models differ from nanoGPT's as measured (README): a 2-tap causal conv on the keys
(--short_conv, H3 / Based), without which no linear map learned recall; N(0, 1) embeddings,
N(0, 0.08) weights, an untied head (--init wide).
"""
import argparse
import contextlib
import csv
import functools
import glob
import inspect
import itertools
import json
import math
import operator
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Literal, get_args, get_origin, get_type_hints

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
import torch.nn as nn

import attention
from attention import UsageError
import tokenizer as tokenizer_lib
import model as M

NONFINITE_EXIT = 3             # exit status of a run stopped by a non-finite loss
BETAS = (0.9, 0.99)            # AdamW's (nanoGPT's beta2 0.95 -> 0.99: small models, short runs)
GRAD_CLIP = 1.0                # gradient-norm clipping (nanoGPT)
EVAL_ITERS = 8                 # batches per split in estimate_loss
N_TEST = 2000                  # associative recall test sequences, from seed + TEST_SEED_OFFSET:
TEST_SEED_OFFSET = 1_000_003   # a stream disjoint from the training seed's
INIT_STDS = {'wide': (0.08, 1.0), 'nanogpt': (0.02, 0.02)}   # scratch std: (Linear, embedding)
# the errors a script reports in one line (exit status 2): the user's, not a bug (a traceback)
USER_ERRORS = (UsageError, tokenizer_lib.TokenizerError, OSError)
GLUE_TASKS = {  # task -> (text_a columns, text_b columns, number of labels (1 = regression))
    'cola': (('sentence',), (), 2), 'sst2': (('sentence',), (), 2),
    'mrpc': (('sentence1', '#1 String'), ('sentence2', '#2 String'), 2),
    'stsb': (('sentence1',), ('sentence2',), 1), 'qqp': (('question1',), ('question2',), 2),
    'mnli': (('premise', 'sentence1'), ('hypothesis', 'sentence2'), 3),
    'qnli': (('question',), ('sentence',), 2), 'rte': (('sentence1',), ('sentence2',), 2)}
log = functools.partial(print, flush=True)   # a line shown at once (progress; convert.py, eval.py)

# ---- the command line: a dataclass whose fields are the flags ----------------
def _comments(cls):
    """{field: its comment in cls's source, continued on comment-only lines aligned with it}: the
    flags' help."""
    helps = {}
    last = None   # the field whose comment continues (col: its column)
    for line in inspect.getsource(cls).splitlines():
        code, _, comment = line.partition('#')
        if ':' in code and '=' in code:
            last = code.split(':')[0].strip()
            col = len(code)
            helps[last] = comment.strip()
        elif last and not code.strip() and len(code) == col:
            helps[last] += ' ' + comment.strip()
        else:
            last = None
    return helps

def parse_config(cls, argv=None, doc=None):
    """argv -> (a `cls` instance, the names of the fields given explicitly), for the config
    dataclasses of train.py, convert.py and eval.py. `--name value` or `--name=value`; a bool is
    `--name` / `--no_name`; a Literal[...] takes only its values; a list[...] field is a repeatable
    flag; help: the field's comment, `doc` heads --help. A bad value, an unknown flag, a ValueError
    from __post_init__ (checks across fields), an --out_dir in a file's place: one line, exit status
    2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    helps = _comments(cls)
    types = get_type_hints(cls)
    fmt = type('Help', (argparse.ArgumentDefaultsHelpFormatter,
                        argparse.RawDescriptionHelpFormatter), {})
    p = argparse.ArgumentParser(description=doc, formatter_class=fmt, allow_abbrev=False)
    p.error = lambda msg: p.exit(2, f"{p.prog}: error: {msg}\n")   # one line, no usage block
    for f in fields(cls):
        t = types[f.name]
        flag = '--' + f.name
        h = (helps.get(f.name) or f.name).replace('%', '%%')
        if t is bool:
            p.add_argument(flag, action='store_true', default=f.default,
                           help=f"{h}; --no_{f.name}: off")
            p.add_argument('--no_' + f.name, dest=f.name, action='store_false',
                           help=argparse.SUPPRESS)
        elif get_origin(t) is list:   # a repeatable flag
            p.add_argument(flag, action='append', type=get_args(t)[0], default=[], help=h)
        else:
            choices = get_args(t) if get_origin(t) is Literal else None
            p.add_argument(flag, type=type(choices[0]) if choices else t, choices=choices,
                           default=f.default, help=h)
    ns = p.parse_args(argv)   # (argparse appends to a copy of a list default)
    try:
        cfg = cls(**vars(ns))
    except ValueError as e:
        p.error(str(e))
    out = getattr(cfg, 'out_dir', '')   # the nearest part of --out_dir that exists must be a folder
    while out and not os.path.exists(out):
        out = os.path.dirname(out)
    if out and not os.path.isdir(out):
        p.error(f"--out_dir {cfg.out_dir}: {out} is a file, not a folder")
    given = {a[2:].split('=')[0] for a in argv if a.startswith('--')}
    return cfg, {g[3:] if g.startswith('no_') and g[3:] in vars(ns) else g for g in given}

_OPS = {'ge': ('>=', operator.ge), 'gt': ('>', operator.gt),
        'le': ('<=', operator.le), 'lt': ('<', operator.lt)}

def num(default, **bounds):
    """A numeric config field and its valid range: ge=1 (>= 1), gt=0 (> 0), le=, lt=; a bound may
    name another field (le='seq_len'). check_ranges checks them (the configs' __post_init__): the
    one place for numeric ranges."""
    return field(default=default, metadata=bounds)

def check_ranges(cfg):
    """A ValueError naming the first numeric field of cfg outside its num() bounds (or not finite),
    and its range."""
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        limits = [(op, getattr(cfg, b) if isinstance(b, str) else b, b)
                  for op, b in f.metadata.items()]
        if limits and not (math.isfinite(v) and all(_OPS[op][1](v, x) for op, x, _ in limits)):
            want = ' and '.join(f"{_OPS[op][0]} {b}" + (f" ({x})" if isinstance(b, str) else '')
                                for op, x, b in limits)
            raise ValueError(f"--{f.name} must be {want}, got {v}")

def check_device(device):
    """auto, cpu, cuda or cuda:N, and CUDA there if named (else a one-line ValueError) -> the
    device, auto resolved."""
    if device not in ('auto', 'cpu', 'cuda') \
            and not (device.startswith('cuda:') and device[5:].isdigit()):
        raise ValueError(f"unknown --device {device!r}: use auto, cpu, cuda or cuda:N")
    if device.startswith('cuda') and not torch.cuda.is_available():
        raise ValueError(f"--device {device} but CUDA is not available (use --device cpu or auto)")
    return ('cuda' if torch.cuda.is_available() else 'cpu') if device == 'auto' else device

@dataclass
class TrainConfig:
    task: Literal['ar', 'mqar', 'text', 'glue'] = 'ar'   # ar: one query at the end, mqar: eight
    data: str = ''                # text: a file, a folder of .txt files or a `datasets` name;
                                  # glue: a folder
    glue_task: Literal[tuple(GLUE_TASKS)] = 'cola'
    ar_vocab: int = num(40, ge=4, le=2**16)   # associative recall vocabulary
                                              # (keys = first half, values = second half)
    seq_len: int = num(128, ge=2, le=2**20)   # AR sequence length; text/GLUE context length
    n_train: int = num(10000, ge=1, le=2**20)   # AR training sequences (and 2000 test sequences)
    init_from: str = 'scratch'    # scratch | a HF folder or hub name | a .gguf file |
                                  # one of our checkpoints
    tokenizer: str = ''           # text/glue: '' = bytes or the model's own |
                                  # gpt2 (tiktoken) | HF folder, .gguf
    family: Literal['gpt2', 'llama', 'bert'] = 'llama'   # scratch models (glue: bert unless given)
    n_layer: int = num(2, ge=1, le=2**10)
    n_head: int = num(4, ge=1)
    n_embd: int = num(64, ge=1, le=2**16)
    dropout: float = num(0.0, ge=0, lt=1)
    init: Literal[tuple(INIT_STDS)] = 'wide'   # scratch: N(0, 0.08) weights,
                                               # N(0, 1) embeddings | all N(0, 0.02)
    short_conv: int = num(2, ge=0, le='seq_len')   # scratch causal models: taps of a causal
                                                   # conv on the keys (0 = none)
    attn: str = 'hedgehog'        # softmax or a feature map, with options: exp:t=2,
                                  # hedgehog:feature_dim=64, lolcats:window=64:combine=mix,
                                  # lln:diag_block=16, elu:impl=recurrent
    max_iters: int = num(1000, ge=1)
    batch_size: int = num(32, ge=1)   # per process, per micro-step
    grad_accum: int = num(1, ge=1)   # micro-steps per optimizer step,
                                     # over all processes (DDP divides it)
    lr: float = num(3e-3, gt=0, le=1)   # AdamW; warmup, then cosine decay to lr/10 at max_iters;
                                        # gradient clipping at 1
    warmup_iters: int = num(100, ge=0)
    weight_decay: float = num(0.1, ge=0, le=1)
    eval_interval: int = num(250, ge=0)   # evaluate and write out_dir/ckpt.pt
                                          # every this many steps and at the end
    out_dir: str = 'out'
    save: bool = True             # write out_dir/ckpt.pt
    resume: bool = False          # continue exactly from out_dir/ckpt.pt
    seed: int = num(1337, ge=0, lt=2**32)
    device: str = 'auto'          # auto | cpu | cuda | cuda:N
    dtype: Literal['auto', 'float32', 'bfloat16', 'float16'] = 'auto'   # auto: bf16 (or fp16)
                                                                        # on CUDA, else fp32
    compare: str = ''             # comma-separated --attn values: one run each
                                  # (same budget, seeds), one table

    def __post_init__(self):
        check_ranges(self)
        check_device(self.device)
        for spec in [self.attn] + [s for s in self.compare.split(',') if s.strip()]:
            attention.AttnSpec.parse(spec)

    def data_config(self):
        return _subset(DataConfig, self)

@dataclass
class DataConfig:
    """What a Task reads (train.py's flags of the same names; convert.py builds its own)."""
    task: str = 'ar'              # ar | mqar | text | glue
    data: str = ''                # text: a file, .txt folder or `datasets` name; glue: a folder
    val_data: str = ''            # text: the held-out text ('' = the last val_fraction of data)
    glue_task: str = 'cola'
    ar_vocab: int = 40
    seq_len: int = 128
    n_train: int = 10000
    batch_size: int = 32
    seed: int = 1337
    val_fraction: float = 0.1

@dataclass
class Schedule:
    """What fit reads: the optimizer steps, the learning rate (get_lr), the evaluations and where
    the logs go."""
    max_iters: int
    lr: float
    warmup_iters: int = 0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_accum: int = 1
    # evaluate (and save) every this many steps and at the end (0: at the end only)
    eval_interval: int = 0
    out_dir: str = 'out'
    seed: int = 0

def _subset(cls, cfg):
    """A cls made of cfg's attributes of the same names (its defaults for the others)."""
    return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls) if hasattr(cfg, f.name)})

# ---- associative recall (Hedgehog App. B.1; zoology's multi-query variant) ----
def make_associative_recall(n, seq_len=128, vocab=40, seed=0, n_queries=1, label_repeats=False):
    """n sequences (x, y), LongTensors (n, seq_len). Keys are tokens 0..vocab/2-1, values
    vocab/2..vocab-1; every sequence has its own random key->value map (a permutation). x = k1 v1 k2
    v2 ... (keys uniform, with repeats) fills the first seq_len - n_queries positions (an odd length
    ends on a lone key), then n_queries keys of complete pairs as queries. y = -100 except at the
    queries: their values; label_repeats=True also labels every context key that repeats an earlier
    one with its value (a dense training signal). The draws, in this order from one torch.Generator
    seeded with `seed` (part of the contract: another order changes every number trained on it): the
    keys randint(0, vocab/2, (n, ceil(ctx/2))), the maps argsort(rand(n, vocab/2)), the queries'
    pair indices randint(0, n_pairs, (n, n_queries)), n_pairs = floor(ctx/2), ctx = seq_len -
    n_queries."""
    if vocab < 4 or vocab % 2:
        raise UsageError(f"vocab must be even and >= 4, got {vocab}")
    ctx_len = seq_len - n_queries
    nk = vocab // 2
    n_pairs = ctx_len // 2
    g = torch.Generator().manual_seed(int(seed))
    if n_queries < 1 or n_pairs < 1:
        raise UsageError(
            f"seq_len={seq_len} leaves no room for key-value pairs and {n_queries} queries")
    keys = torch.randint(0, nk, (n, (ctx_len + 1) // 2), generator=g)
    kv_map = torch.rand(n, nk, generator=g).argsort(1) + nk   # (n, nk): key -> value
    vals = kv_map.gather(1, keys)
    ctx = torch.stack([keys, vals], 2).reshape(n, -1)[:, :ctx_len]
    # complete pairs' keys
    queries = keys.gather(1, torch.randint(0, n_pairs, (n, n_queries), generator=g))
    x = torch.cat([ctx, queries], 1)
    y = torch.full_like(x, -100)
    y[:, ctx_len:] = kv_map.gather(1, queries)
    if label_repeats:
        seen = torch.zeros(n, nk, dtype=torch.bool)
        rows = torch.arange(n)
        for i in range(n_pairs):   # the key at pair i was seen (with its value) in an earlier pair
            rep = seen[rows, keys[:, i]]
            y[rep, 2 * i] = vals[rep, i]
            seen[rows, keys[:, i]] = True
    return x, y

# ---- text: tokenizer, data, perplexity ---------------------------------------
def get_tokenizer(name='', model=None, verbose=True):
    """A run's tokenizer: `name` ('bytes', 'gpt2', a HF folder or .gguf file) if given, else
    `model`'s own (tokenizer.resolve: checked to fit it), else bytes -- from scratch, one command,
    one model on every machine."""
    tok = (tokenizer_lib.load_tokenizer(name or 'bytes') if model is None
           else tokenizer_lib.resolve(model, name or None))
    if verbose:
        print(f"tokenizer: {tok.name}, vocab {tok.vocab_size}")
    return tok

def load_text(path_or_name, split='train'):
    """A text file, a folder of .txt files (sorted, recursive, joined by blank lines) or a HF
    `datasets` name ('wikitext:wikitext-103-raw-v1' = name:config; needs internet or the HF cache;
    `split` is its)."""
    if not path_or_name:
        raise UsageError(
            "--data is empty: give a text file, a folder of .txt files or a datasets name")
    files = None   # a `datasets` name
    if os.path.isdir(path_or_name):
        files = sorted(glob.glob(os.path.join(path_or_name, '**', '*.txt'), recursive=True))
    elif os.path.isfile(path_or_name):
        files = [path_or_name]
    if files == []:
        raise UsageError(f"no .txt files under {path_or_name}")
    if files:
        text = '\n\n'.join(open(fn, encoding='utf-8', errors='replace').read() for fn in files)
        if '\0' in text:
            raise UsageError(f"{path_or_name} is not text (it has NUL bytes): "
                             "give a text file or a folder of .txt files")
        return text
    name, _, config = path_or_name.partition(':')
    if name.startswith(('/', '.', '~')) or name.endswith('.txt'):   # a path, not a `datasets` name
        raise UsageError(f"no such file or folder: {path_or_name}")
    try:
        import datasets
        ds = datasets.load_dataset(name, config or None, split=split)
    except Exception as e:
        raise UsageError(f"{path_or_name!r} is not a local file or folder, and "
                         f"datasets.load_dataset failed ({type(e).__name__}: {str(e)[:200]}); "
                         "offline, pass a local text file or folder") from None
    return '\n'.join(ds['text' if 'text' in ds.column_names else ds.column_names[0]])

def text_splits(cfg, tok):
    """(train_ids, val_ids) of cfg.data: all of it and cfg.val_data; or a local file or folder's
    last cfg.val_fraction held out, or a `datasets` name's own validation split."""
    if cfg.val_data or not os.path.exists(cfg.data):   # two texts (or two splits of a dataset)
        val = cfg.val_data or cfg.data
        return tok.encode_array(load_text(cfg.data)), tok.encode_array(load_text(val, 'validation'))
    ids = tok.encode_array(load_text(cfg.data))
    n_val = max(int(len(ids) * cfg.val_fraction), cfg.seq_len + 2)
    if len(ids) - n_val < cfg.seq_len + 2:
        raise UsageError(
            f"{cfg.data}: {len(ids)} tokens is too little text for seq_len={cfg.seq_len}")
    return ids[:-n_val], ids[-n_val:]

def get_text_batch(ids, offsets, seq_len):
    """Windows of ids starting at offsets -> (x, y) LongTensors (len(offsets), seq_len), y = x
    shifted by one."""
    rows = np.asarray(offsets)[:, None] + np.arange(seq_len + 1)   # (B, seq_len + 1) positions
    w = torch.from_numpy(ids[rows].astype(np.int64))
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()

def ppl_windows(n_tokens, context, stride):
    """Sliding windows over the n_tokens-1 next-token predictions: (begin, end, n_new) with inputs
    ids[begin:end], targets ids[begin+1:end+1], of which only the last n_new are scored (each
    once)."""
    if stride < 1 or context < 1 or stride > context:
        raise UsageError(f'need 1 <= stride <= context (got context={context}, stride={stride})')
    m = n_tokens - 1
    # stride <= context: each window ends past the one before; up to the first to reach the end
    ends = [min(b + context, m) for b in range(0, m, stride)]
    ends = ends[:ends.index(m) + 1] if ends else []
    return [(b, e, e - prev) for b, e, prev in zip(range(0, m, stride), ends, [0] + ends)]

@torch.no_grad()
def perplexity(model, ids, context, stride, device='cpu', batch_size=8):
    """Token-weighted mean NLL of a causal LM over the next-token predictions of ids, in sliding
    windows of `context` tokens moved by `stride` (HF style). The first token is only context
    (nothing is prepended): n tokens give n-1 predictions, each scored once, given the up to
    `context` tokens before it in its window (after the first window, at least context - stride +
    1). -> {'nll', 'ppl', 'tokens_scored', 'windows', 'context', 'stride'}"""
    ids = torch.as_tensor(ids, dtype=torch.long)
    windows = ppl_windows(ids.numel(), context, stride)
    if not windows:
        raise UsageError('need at least 2 tokens of text for perplexity')
    total_nll = 0.0
    total = 0
    t0 = time.time()
    n_all = sum(n for _, _, n in windows)
    # windows of one length
    runs = [list(g) for _, g in itertools.groupby(windows, key=lambda w: w[1] - w[0])]
    for group in (run[i:i + batch_size] for run in runs for i in range(0, len(run), batch_size)):
        x = torch.stack([ids[b:e] for b, e, _ in group])
        y = torch.stack([ids[b + 1:e + 1] for b, e, _ in group])
        for r, (_, _, n) in enumerate(group):
            y[r, :x.size(1) - n] = -100
        _, loss = model(x.to(device), targets=y.to(device))
        count = sum(n for _, _, n in group)
        total_nll += float(loss) * count
        total += count
        progress('perplexity', total, total - count, n_all, t0)
    nll = total_nll / total
    return {'nll': nll, 'ppl': math.exp(nll), 'tokens_scored': total, 'windows': len(windows),
            'context': context, 'stride': stride}

# ---- passkey retrieval prompts (eval.py's task, convert.py's retrieval probe) ----
PASSKEY_TEMPLATES = {   # name: (intro, filler, needle, question)
    # the evaluation's: Mohtashami & Jaggi 2023's prompt
    'eval': ('There is important info hidden inside a lot of irrelevant text. '
             'Find it and memorize it.',
             'The grass is green. The sky is blue. The sun is yellow. Here we go. '
             'There and back again. ',
             'The pass key is {key}. Remember it. {key} is the pass key.',
             'What is the pass key? The pass key is'),
    # convert.py's retrieval probe: its own prompts, so that no head is picked on the test's words
    'probe': ('Below is a long note. One line in it holds a number worth keeping.',
              'Rivers run to the sea. Birds sing at dawn. Bread is baked in ovens. Time moves on. ',
              'The secret number is {key}. Keep it in mind. {key} is the secret number.',
              'What was the secret number? The secret number is'),
    # convert.py --passkey_mix's stage-2 samples: their own words (no recipe tuned to the test's)
    'train': ('A record follows. Somewhere in it is a code to recall later.',
              'Snow falls in winter. Ships sail at night. Leaves turn brown. The road is long. ',
              'The access code is {key}. Note it down. {key} is the access code.',
              'What is the access code? The access code is'),
    # eval.py --passkey_template eval2: the test in other words (did a recipe learn the wording?)
    'eval2': ('Read the text below. A number is stated in it; you will be asked for that number.',
              'The cat sleeps on the mat. Rain falls on the roof. The clock ticks. We walk home. ',
              'The magic number is {key}. Do not forget it. {key} is the magic number.',
              'What is the magic number? The magic number is')}

def passkey_prompts(tok, lengths, depths=(0, 25, 50, 75, 100), samples=6, seed=0, template='eval'):
    """Passkey retrieval prompts (Mohtashami & Jaggi 2023), `samples` per length and depth: as their
    prompt, lines of the task, the filler before (none at depth 0), the key sentence, the filler
    after and the question; about `length` tokens of `tok`, the key at `depth` % of the filler.
    Ours: at depth 100 % one filler sentence (about 25 tokens) still separates the key from the
    question (with none, SmolLM2 answered 'a key that is used to ...' in 5 of 18 prompts at 512-2K
    tokens). template: a PASSKEY_TEMPLATES name. Rows: input, target (the key), length, depth,
    tokens, keys (the key's two character spans in input)."""
    rng = random.Random(seed)
    rows = []
    intro, filler, needle_text, question = PASSKEY_TEMPLATES[template]
    per_filler = len(tok.encode(filler))
    for length, depth, i in itertools.product(lengths, depths, range(samples)):
        key = rng.randint(10000, 99999)
        needle = needle_text.format(key=key)
        frame = len(tok.encode('\n'.join([intro, '', needle, '', question])))   # all but filler
        n = max((length - frame) // per_filler, 0)      # filler sentences,
        before = round(max(n - 1, 0) * depth / 100)     # those before the key (100 %: all but one)
        parts = [intro, (filler * before).strip(), needle,
                 (filler * (n - before)).strip(), question]
        text = '\n'.join(p for p in parts if p)
        at = text.index(needle)
        keys = [(at + j, at + j + 5) for j in (needle.index(str(key)), needle.rindex(str(key)))]
        rows.append(dict(input=text, target=str(key), length=length, depth=depth,
                         tokens=len(tok.encode(text)), keys=keys))
    return rows

def token_span(tok, text, a, b):
    """[i, j): the tokens of tok.encode(text) that hold characters a..b-1. Those before the span are
    the ones that text[:a] alone encodes to and the whole text shares: a tokenizer may join the
    space before the span to the span's first token (GPT-2's ' 12345'), and text[:a] alone then ends
    in a token of its own, so counting its tokens would start one late. Likewise at b, where a token
    may straddle the end."""
    ids = tok.encode(text)

    def shared(prefix):
        """(how many leading tokens of the whole text the prefix also encodes to, its tokens)"""
        p = tok.encode(prefix)
        same = next((i for i, (x, y) in enumerate(zip(p, ids)) if x != y), min(len(p), len(ids)))
        return same, len(p)
    i, _ = shared(text[:a])
    j, n_b = shared(text[:b])
    return i, j + (j < n_b)

# ---- GLUE: files, metrics, the classifier ------------------------------------
GLUE_LABELS = ('label', 'gold_label', 'is_duplicate', 'score', 'quality')
NLI_LABELS = {'entailment': 0, 'neutral': 1, 'contradiction': 2, 'not_entailment': 1}
GLUE_FILES = {'train': ('train',), 'validation': ('dev', 'validation', 'dev_matched')}

def glue_task_name(task):
    if task not in GLUE_TASKS:
        raise UsageError(f"unknown GLUE task {task!r}; choose one of: {', '.join(GLUE_TASKS)}")
    return task

def glue_num_labels(task):
    return GLUE_TASKS[glue_task_name(task)][2]

def _glue_example(row, task, where):
    """A row -> (text_a, text_b or None, label), None if empty or unlabelled. A dict (headered file)
    by column names; a list as text<TAB>label, a<TAB>b<TAB>label or CoLA's
    source<TAB>label<TAB>mark<TAB>sentence."""
    a_cols, b_cols, n_labels = GLUE_TASKS[task]
    if isinstance(row, dict):
        low = {str(k).strip().lower(): v for k, v in row.items()}
        a, b = (next((low[c.lower()] for c in cols if c.lower() in low), None)
                for cols in (a_cols, b_cols))
        if a is None or (b_cols and b is None):
            raise UsageError(f"{where}: no column {list(a_cols + b_cols)} for {task}'s texts "
                             f"(columns: {list(row)})")
        label = next((low[c] for c in GLUE_LABELS if low.get(c) not in (None, '', '-')), None)
    elif not any(c.strip() for c in row):
        return None
    elif task == 'cola' and len(row) == 4:
        a = row[3]
        b = None
        label = row[1]
    elif len(row) >= 2 + bool(b_cols):
        a = row[-2 - bool(b_cols)]
        b = row[-2] if b_cols else None
        label = row[-1]
    else:
        raise UsageError(
            f"{where}: cannot read {len(row)} columns as a {task} row without a header")
    if label is None:
        return None
    label = str(label).strip()
    label = float(label) if n_labels == 1 else int(float(NLI_LABELS.get(label.lower(), label)))
    return str(a), None if b is None else str(b), label

def load_glue(task, path, split='train'):
    """GLUE examples [(text_a, text_b or None, label)] (label: int class, float for STS-B) of split
    train or validation. path: a folder holding train.{tsv,csv,jsonl} and dev.* (or validation.*;
    MNLI dev_matched.*), or one file; TSVs with GLUE's header row or without one
    (`sentence<TAB>label`, data/cola)."""
    task = glue_task_name(task)
    if split not in GLUE_FILES or not path:
        raise UsageError(f"unknown split {split!r}; use train or validation" if path
                         else "--data is empty: give a folder of GLUE TSV/CSV/JSONL files")
    found = (fn for stem in GLUE_FILES[split] for ext in ('tsv', 'csv', 'jsonl')
             for fn in glob.glob(os.path.join(path, f"{stem}.{ext}")))
    fn = path if os.path.isfile(path) else next(found, None)
    if fn is None:
        raise UsageError(
            f"no {split} file in {path!r}: expected {'|'.join(GLUE_FILES[split])}.tsv|csv|jsonl")
    with open(fn, encoding='utf-8', newline='') as f:
        if fn.endswith('.jsonl'):
            rows = [json.loads(line) for line in f if line.strip()]
        else:
            tsv = {} if fn.endswith('.csv') else dict(delimiter='\t', quoting=csv.QUOTE_NONE)
            rows = list(csv.reader(f, **tsv))
            names = {c.lower() for c in sum(GLUE_TASKS[task][:2], ()) + GLUE_LABELS}
            if rows and {c.strip().lower() for c in rows[0]} & names:   # a header row
                rows = [dict(zip(rows[0], r)) for r in rows[1:] if r]
    return [ex for ex in (_glue_example(r, task, fn) for r in rows) if ex]

def pearson(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    # 0 for a constant
    return float(np.corrcoef(a, b)[0, 1]) if a.std() > 0 and b.std() > 0 else 0.0

def matthews_corrcoef(labels, preds):
    """Multiclass Matthews correlation (as sklearn.metrics.matthews_corrcoef), from the confusion
    matrix C."""
    classes = np.union1d(labels, preds)
    C = np.zeros((len(classes), len(classes)))
    np.add.at(C, (np.searchsorted(classes, labels), np.searchsorted(classes, preds)), 1)
    t = C.sum(1)
    p = C.sum(0)
    c = np.trace(C)
    s = C.sum()
    den = math.sqrt((s * s - (p * p).sum()) * (s * s - (t * t).sum()))
    return float((c * s - (t * p).sum()) / den) if den > 0 else 0.0

def glue_metric(task, preds, labels):
    """The task's GLUE metrics: CoLA mcc; STS-B pearson, spearman; MRPC/QQP accuracy, f1 (of class
    1); the others accuracy. 'main' repeats the one GLUE ranks by (mcc, accuracy or pearson)."""
    if glue_task_name(task) == 'stsb':
        r = pearson(preds, labels)
        rho = pearson(*(attention.ranks(torch.as_tensor(x)).numpy() for x in (preds, labels)))
        return {'pearson': r, 'spearman': rho, 'main': r}
    preds = np.asarray(preds)
    labels = np.asarray(labels)
    out = {'accuracy': float((preds == labels).mean()) if len(labels) else 0.0}
    if task in ('mrpc', 'qqp'):
        tp = ((preds == 1) & (labels == 1)).sum()
        n = (preds == 1).sum() + (labels == 1).sum()
        out['f1'] = float(2 * tp / n) if n else 0.0
    if task == 'cola':
        out['mcc'] = matthews_corrcoef(labels, preds)
    return {**out, 'main': out.get('mcc', out['accuracy'])}

class GlueEncoder:
    """(text_a, text_b) -> (ids, token types) by the tokenizer's encode_pair: [CLS] a [SEP] b [SEP]
    (BERT) or [eot] a [eot] b [eot]. `tok`: a tokenizer, or a get_tokenizer name ('scratch' and ''
    are bytes)."""

    def __init__(self, tok, seq_len, verbose=True):
        if isinstance(tok, str):
            tok = get_tokenizer('' if tok == 'scratch' else tok, verbose=False)
        self.tok = tok
        self.seq_len = seq_len
        self.name = tok.name
        if verbose:
            print(f"glue tokenizer: {self.name}, vocab {self.tok.vocab_size}")

    def encode(self, a, b=None):
        return self.tok.encode_pair(a, b, self.seq_len)

def collate_glue(encoded, labels):
    """[(ids, token_types)], labels -> (idx, attention_mask, token_type_ids, labels) tensors,
    0-padded right."""
    T = max(len(ids) for ids, _ in encoded)
    idx, tt, mask = torch.zeros(3, len(encoded), T, dtype=torch.long)
    for i, (ids, types) in enumerate(encoded):
        idx[i, :len(ids)] = torch.tensor(ids)
        tt[i, :len(types)] = torch.tensor(types)
        mask[i, :len(ids)] = 1
    # float labels: a regression's
    return idx, mask, tt, torch.tensor(
        labels, dtype=torch.float32 if isinstance(labels[0], float) else torch.long)

class Classifier(nn.Module):
    """Sequence classification around a GPT: BERT family -> model.classify (pooled [CLS]); causal
    families -> a linear head on the last real token's final hidden state. forward -> (logits,
    loss)."""

    def __init__(self, model, num_labels):
        super().__init__()
        self.model = model
        self.num_labels = num_labels
        self.head = None   # BERT: model.classify's own
        if not isinstance(model, M.Bert):
            self.head = nn.Linear(model.config.n_embd, num_labels)
            nn.init.normal_(self.head.weight, std=0.02)
            nn.init.zeros_(self.head.bias)
            # the LM head is unused here: frozen (DDP wants a gradient for each trainable one)
            if not model.config.tie_embeddings:
                model.lm_head.requires_grad_(False)

    def forward(self, idx, attention_mask, token_type_ids, labels=None):
        if self.head is None:
            return self.model.classify(idx, attention_mask, token_type_ids, labels)
        h, _ = self.model.hidden_states(idx)                    # (B, T, C); causal
        last = attention_mask.long().sum(1).clamp(min=1) - 1   # each row's last real token
        return M.classification_loss(
            self.head(h[torch.arange(idx.size(0), device=idx.device), last]), labels)

@torch.no_grad()
def mean_attention_entropy(model, x, query_positions, batch_size=64):
    """Mean row entropy (nats) of the attention matrices core.weights(q, k) of every layer and head
    on inputs x (Hedgehog Fig. 4). -> (the mean over all rows, over the rows in query_positions)."""
    ents = []   # (B, H, T) per batch and layer
    cores = model.attention_cores()
    for i in range(0, len(x), batch_size):
        with model.capture_qkv() as rec:
            model(x[i:i + batch_size])
        for layer, (q, k, _, _) in rec.items():
            ents.append(attention.attention_entropy(cores[layer].weights(q, k)).double())
    ent = torch.cat(ents)
    return ent.mean().item(), ent[..., query_positions].mean().item()

# ---- the training loop -------------------------------------------------------
def _fmt_time(s):
    s = round(s)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"

def _rate(x):   # 67.2k, or 41.0 when below a thousand (a 1024-token step every 25 s is not 0.0k)
    return f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.1f}"

def progress(what, done, before, total, t0, unit='tokens'):
    """A long report's progress line, `what: done/total unit | rate | eta`, when done passes a tenth
    of total."""
    if done * 10 // max(total, 1) > before * 10 // max(total, 1):
        dt = time.time() - t0
        log(f"{what}: {done:,}/{total:,} {unit} | {done / max(dt, 1e-9):,.1f} {unit}/s | "
            f"eta {_fmt_time(dt * (total - done) / max(done, 1))}")

def get_lr(cfg, it):
    """Linear warmup, then cosine decay from cfg.lr to cfg.lr * cfg.min_lr_ratio at cfg.max_iters
    (nanoGPT)."""
    min_lr = cfg.lr * cfg.min_lr_ratio
    if it < cfg.warmup_iters:
        return cfg.lr * (it + 1) / (cfg.warmup_iters + 1)
    ratio = min(1.0, (it - cfg.warmup_iters) / max(1, cfg.max_iters - cfg.warmup_iters))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.lr - min_lr)

@dataclass
class Runtime:
    """This process's place in a run (setup makes it)."""
    ddp: bool            # launched by torchrun
    rank: int
    world: int           # processes
    master: bool         # rank 0: logs, evaluates, saves
    device: str
    dtype: str           # float32 | bfloat16 | float16
    autocast: object     # torch.autocast for CUDA bf16/fp16, else a null context

def setup(device='auto', dtype='auto', grad_accum=1):
    """This process's Runtime from the flags and torchrun's RANK / LOCAL_RANK / WORLD_SIZE; starts
    the process group."""
    ddp = 'RANK' in os.environ
    rank = int(os.environ.get('RANK', 0))
    world = int(os.environ.get('WORLD_SIZE', 1))
    device = check_device(device)
    cuda = device.startswith('cuda')
    if grad_accum % world:
        raise UsageError(f"--grad_accum {grad_accum} must be a multiple of the {world} processes")
    if ddp and not dist.is_initialized():
        dist.init_process_group(backend='nccl' if cuda else 'gloo')
    if ddp and cuda:   # one GPU per process
        torch.cuda.set_device(device := f"cuda:{os.environ.get('LOCAL_RANK', 0)}")
    if dtype == 'auto':   # bf16 (or fp16) on CUDA, else fp32
        dtype = ('bfloat16' if torch.cuda.is_bf16_supported() else 'float16') if cuda else 'float32'
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    return Runtime(ddp, rank, world, rank == 0, device, dtype,   # and autocast:
                   torch.autocast('cuda', getattr(torch, dtype)) if cuda and dtype != 'float32'
                   else contextlib.nullcontext())

def _start(params_or_optimizer, cfg, rt, resume):
    """(optimizer, grad scaler, data-stream generator, step): fresh, or continued from a
    checkpoint's state."""
    opt = params_or_optimizer
    if not isinstance(opt, torch.optim.Optimizer):
        opt = torch.optim.AdamW(opt, lr=cfg.lr, betas=BETAS, weight_decay=cfg.weight_decay)
    scaler = torch.amp.GradScaler('cuda', enabled=rt.dtype == 'float16')
    gen = torch.Generator().manual_seed(cfg.seed)     # the one batch stream of every process
    step = int(resume['iter_num']) if resume else 0
    if resume:
        opt.load_state_dict(resume['optimizer'])
        if resume['scaler']:
            scaler.load_state_dict(resume['scaler'])
        gen.set_state(resume['data_rng'])
    if resume and rt.master:
        torch.set_rng_state(resume['torch_rng'])
        if resume['cuda_rng'] is not None and rt.device.startswith('cuda'):
            torch.cuda.set_rng_state(resume['cuda_rng'], rt.device)
    else:
        torch.manual_seed(cfg.seed + rt.rank + 7919 * step)   # per-process seeds (dropout etc.)
    return opt, scaler, gen, step

def write_json(path, obj):
    """obj as indented JSON at path, atomically (a .tmp file, then os.replace); what JSON cannot
    hold as its str."""
    with open(path + '.tmp', 'w') as f:
        json.dump(obj, f, indent=2, default=str)
    os.replace(path + '.tmp', path)

def _open_log(path, step):
    """out_dir/log.jsonl with the rows before `step` (those of the run resumed), open to append."""
    with open(path + '.tmp', 'w') as f, open(path, 'a+') as old:
        old.seek(0)
        f.writelines(r for r in old if r.strip() and json.loads(r)['iter'] < step)
    os.replace(path + '.tmp', path)
    return open(path, 'a')

def _accumulate(net, loss_fn, next_batch, gen, scaler, cfg, rt):
    """The gradients of one step: cfg.grad_accum micro-batches of the global stream, which every
    process draws, taking micro-batch j when j % world == rank; gradients sync on its last one. ->
    (mean loss, tokens)."""
    total = torch.zeros((), device=rt.device)
    tokens = 0
    for j in range(cfg.grad_accum):
        batch = next_batch(gen)
        tokens += batch[0].numel()
        if j % rt.world != rt.rank:
            continue
        batch = tuple(t.to(rt.device) for t in batch)
        # gradients sync on this process's last micro-batch (FSDP, without no_sync: on every one)
        sync = j >= cfg.grad_accum - rt.world or not hasattr(net, 'no_sync')
        with contextlib.nullcontext() if sync else net.no_sync():
            with rt.autocast:
                loss = loss_fn(net, batch) / (cfg.grad_accum // rt.world)
            scaler.scale(loss).backward()
        total += loss.detach()
    if rt.ddp:
        dist.all_reduce(total)
        total /= rt.world
    return total.item(), tokens

class NonFiniteLoss(RuntimeError):
    def __init__(self, what, value, step, saved, cfg, rt):
        # saved: the last checkpoint's path, True (one was loaded to resume) or None
        kept = "no checkpoint was written"
        if saved:
            kept = f"the last good checkpoint{'' if saved is True else ' ' + saved} was kept"
        super().__init__(f"non-finite {what} ({value}) at step {step}; stopped, {kept}. "
                         f"Try a lower --lr (now {cfg.lr:g}), --dtype float32 (now {rt.dtype}), "
                         "or a numerically stable feature map (hedgehog with its softmax over the "
                         "feature dim, lolcats; --attn softmax checks the setup).")

def _progress(step, loss, lr, tokens, clock, cfg):
    """Ten progress lines a run, `step s/N | loss | lr | tok/s | eta`. clock: (time, step) of the
    last line -> the clock after this step."""
    if step % max(1, cfg.max_iters // 10) and step != cfg.max_iters:
        return clock
    dt = (time.time() - clock[0]) / max(step - clock[1], 1)   # seconds a step since the last line
    log(f"step {step}/{cfg.max_iters} | loss {loss:.4f} | lr {lr:.2e} | "
        f"{_rate(tokens / max(dt, 1e-9))} tok/s | eta {_fmt_time(dt * (cfg.max_iters - step))}")
    return time.time(), step

def _evaluate(module, evaluate, step, saved, cfg, rt):
    """evaluate() in eval mode -> {name: float}, printed; a non-finite one raises NonFiniteLoss."""
    module.eval()
    est = evaluate() if evaluate else {}
    module.train()
    if not all(math.isfinite(v) for v in est.values()):
        raise NonFiniteLoss('evaluation loss', est, step, saved, cfg, rt)
    if est:
        log(f"eval step {step}: " + ', '.join(f"{k} {v:.4f}" for k, v in est.items()))
    return est

def fit(module, params_or_optimizer, loss_fn, next_batch, cfg, rt, evaluate=None, save=None,
        resume=None, log_name='log.jsonl'):
    """Train `module` for cfg.max_iters optimizer steps (the one loop of train.py and convert.py).
    - module: on rt.device (rt = setup(cfg), made first); its DDP wrapper is made here (none if
      FSDP shards it).
    - params_or_optimizer: an optimizer (lr set each step), or parameters for
      AdamW(weight_decay=cfg.weight_decay).
    - loss_fn(net, batch) -> scalar loss; it calls `net` (module or its DDP wrapper), so that DDP
      syncs gradients.
    - next_batch(gen) -> a micro-batch of CPU tensors (the first: the tokens counted), drawn with
      the generator `gen` only (seeded, checkpointed): every process draws every micro-batch and
      takes its share (one data stream).
    - cfg: a Schedule (train.py: TrainConfig's fields of the same names).
    - evaluate() -> {name: float}: on the master, in eval mode, every cfg.eval_interval steps and
      at the end.
    - save(state) -> path (None: no checkpoints): after each evaluation, writes the model and
      `state` (optimizer, scaler, step, data stream, RNGs); given back as `resume` it continues
      exactly (you load the weights).
    - log_name: out_dir's per-step {'iter', 'loss', 'lr'} rows.
    A non-finite loss, gradient norm or evaluation raises NonFiniteLoss.
    -> {'iters', 'train_time_s', 'cpu_time_s', 'last_eval', 'evals' (each {'iter', name: value})}"""
    opt, scaler, gen, step = _start(params_or_optimizer, cfg, rt, resume)
    params = [p for g in opt.param_groups for p in g['params']]
    net = module
    if rt.ddp and not isinstance(module, FSDPModule):   # FSDP shards: no DDP wrapper
        net = nn.parallel.DistributedDataParallel(module)
    os.makedirs(cfg.out_dir, exist_ok=True)
    t0 = time.time()
    cpu0 = time.process_time()
    clock = (t0, step)            # (time, step) of the last progress line
    est = {}                      # the last evaluation
    evals = []                    # every evaluation, with its step
    saved = resume is not None    # a checkpoint stands (NonFiniteLoss says which)
    log_file = _open_log(os.path.join(cfg.out_dir, log_name), step) if rt.master else None
    with log_file or contextlib.nullcontext():
        while step < cfg.max_iters:
            lr = get_lr(cfg, step)
            for g in opt.param_groups:
                g['lr'] = lr
            loss, tokens = _accumulate(net, loss_fn, next_batch, gen, scaler, cfg, rt)
            if not math.isfinite(loss):
                raise NonFiniteLoss('loss', loss, step, saved, cfg, rt)
            scaler.unscale_(opt)
            gnorm = torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
            if not torch.isfinite(gnorm) and not scaler.is_enabled():
                raise NonFiniteLoss('gradient norm', gnorm.item(), step, saved, cfg, rt)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            step += 1
            if not rt.master:
                continue
            log_file.write(json.dumps({'iter': step - 1, 'loss': loss, 'lr': lr}) + '\n')
            clock = _progress(step, loss, lr, tokens, clock, cfg)
            if cfg.eval_interval and step % cfg.eval_interval == 0 or step == cfg.max_iters:
                log_file.flush()
                est = _evaluate(module, evaluate, step, saved, cfg, rt)
                evals.append({'iter': step, **est})
                if save:   # the state that `resume` continues from exactly (_start)
                    cuda = rt.device.startswith('cuda')
                    cuda_rng = torch.cuda.get_rng_state(rt.device) if cuda else None
                    saved = save(dict(optimizer=opt.state_dict(), scaler=scaler.state_dict(),
                                      iter_num=step, cuda_rng=cuda_rng, data_rng=gen.get_state(),
                                      torch_rng=torch.get_rng_state()))
    return {'iters': step, 'train_time_s': round(time.time() - t0, 2),
            'cpu_time_s': round(time.process_time() - cpu0, 2), 'last_eval': est, 'evals': evals}

# ---- the driver: a task's data and model, fit, the final metrics -------------
class Task:
    """A run's data (a DataConfig): 'train' and 'val' splits of examples (text: window offsets into
    the token ids), batches of them as CPU tensors -- (x, y) for AR and text, (idx, mask, token
    types, labels) for GLUE."""

    def __init__(self, cfg, tok=None, verbose=True):
        self.cfg = cfg
        self.tokenizer = tok and tok.name
        self.num_labels = 0
        if cfg.task == 'text':
            self.splits = dict(zip(('train', 'val'), text_splits(cfg, tok)))
            V = tok.vocab_size
            self.vocab_size = V if V < 1000 else (V + 63) // 64 * 64   # a large one: to 64s
        elif cfg.task == 'glue':
            enc = GlueEncoder(tok, cfg.seq_len, verbose)

            def split(name):   # the examples encoded, in tensors
                return collate_glue(*zip(*[(enc.encode(a, b), label) for a, b, label
                                           in load_glue(cfg.glue_task, cfg.data, name)]))
            self.splits = {'train': split('train'), 'val': split('validation')}
            self.num_labels = glue_num_labels(cfg.glue_task)
            self.vocab_size = tok.vocab_size
        else:   # (the test labels its final queries only)
            nq = 8 if cfg.task == 'mqar' else 1
            args = (cfg.seq_len, cfg.ar_vocab)
            self.splits = {
                'train': make_associative_recall(cfg.n_train, *args, cfg.seed, nq,
                                                 label_repeats=True),
                'val': make_associative_recall(N_TEST, *args, cfg.seed + TEST_SEED_OFFSET, nq)}
            self.vocab_size = cfg.ar_vocab
        self.size = {k: len(d) - cfg.seq_len - 1 if cfg.task == 'text' else len(d[0])
                     for k, d in self.splits.items()}
        if verbose:   # (examples; for text, window offsets)
            print(f"{cfg.task}: {self.size['train']:,} train / {self.size['val']:,} val examples")
        if cfg.batch_size > self.size['train']:
            raise UsageError(f"--batch_size {cfg.batch_size} is more than the "
                             f"{self.size['train']:,} training examples")

    def batch(self, split, sel):
        if self.cfg.task == 'text':
            return get_text_batch(self.splits[split], sel, self.cfg.seq_len)
        b = tuple(t[sel] for t in self.splits[split])
        if self.cfg.task == 'glue':   # cut the padding to the batch's longest example
            b = tuple(t[:, :int(b[1].sum(1).max())] if t.dim() == 2 else t for t in b)
        return b

    def next_batch(self, gen):
        sel = torch.randint(0, self.size['train'], (self.cfg.batch_size,), generator=gen)
        return self.batch('train', sel)

    def eval_batches(self, split, n_batches=EVAL_ITERS):
        """Fixed batches of a split: its first examples (text: its first non-overlapping
        windows)."""
        B = self.cfg.batch_size
        step = self.cfg.seq_len if self.cfg.task == 'text' else 1
        n = min((self.size[split] - 1) // step + 1, n_batches * B)
        return [torch.arange(i, min(i + B, n)) * step for i in range(0, n, B)]

def task_loss(module, batch):
    """The loss of every task: the module's own (LM, recall or classifier)."""
    return module(*batch)[1]

@torch.no_grad()
def _predict(module, task, split, sels, rt):
    """-> per-batch losses and label counts, predictions and labels (AR, text: at the labelled
    positions)."""
    stats = []
    preds = []
    labels = []
    for sel in sels:
        batch = tuple(t.to(rt.device) for t in task.batch(split, sel))
        with rt.autocast:
            logits, loss = module(*batch)
        y = batch[-1]
        if task.cfg.task != 'glue':   # AR, text: the labelled positions
            labelled = y != -100
            logits = logits[labelled]
            y = y[labelled]
        stats.append((loss.item(), len(y)))
        preds += (logits.float().squeeze(-1) if task.num_labels == 1
                  else logits.argmax(-1)).tolist()
        labels += y.tolist()
    return *np.array(stats).T, np.array(preds), np.array(labels)

def estimate_loss(module, task, rt):
    """Mean loss over the fixed evaluation batches of each split (nanoGPT); AR also its accuracy."""
    out = {}
    for split in ('train', 'val'):
        losses, _, preds, labels = _predict(module, task, split, task.eval_batches(split), rt)
        out[split] = float(losses.mean())
        if task.cfg.task in ('ar', 'mqar'):
            out[split + '_acc'] = float((preds == labels).mean())
    return out

def final_metrics(module, model, task, rt):
    """On the whole val split: text perplexity (windows of seq_len, stride seq_len); GLUE dev loss
    and the task's metrics; AR test loss, accuracy and the mean attention entropy of its first 256
    sequences."""
    cfg = task.cfg
    module.eval()
    if cfg.task == 'text':
        with rt.autocast:
            r = perplexity(model, task.splits['val'], cfg.seq_len, cfg.seq_len,
                           rt.device, cfg.batch_size)
        return {'val_loss': r['nll'], 'val_ppl': r['ppl'], 'val_tokens': r['tokens_scored']}
    sels = task.eval_batches('val', task.size['val'])   # all of it
    losses, counts, preds, labels = _predict(module, task, 'val', sels, rt)
    loss = float((losses * counts).sum() / counts.sum())
    if cfg.task == 'glue':
        return {'dev_loss': loss,
                **{f"dev_{k}": v for k, v in glue_metric(cfg.glue_task, preds, labels).items()}}
    nq = 8 if cfg.task == 'mqar' else 1
    with rt.autocast:
        ent, ent_q = mean_attention_entropy(
            model, task.splits['val'][0][:256].to(rt.device), slice(-nq, None))
    return {'test_loss': loss, 'test_acc': float((preds == labels).mean()), 'attn_entropy': ent,
            'attn_entropy_query': ent_q}

def build_model(cfg, vocab_size, num_labels=0, explicit=()):
    """A GPT from scratch: cfg's family (glue: bert unless --family is given), size, init and
    attention."""
    family = 'bert' if cfg.task == 'glue' and 'family' not in explicit else cfg.family
    init_std, emb_init_std = INIT_STDS[cfg.init]
    return M.build(M.GPTConfig(
        family=family, vocab_size=vocab_size, block_size=cfg.seq_len, n_layer=cfg.n_layer,
        n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout, init_std=init_std,
        emb_init_std=emb_init_std, num_labels=num_labels if family == 'bert' else 0,
        tie_embeddings=False, short_conv=0 if family == 'bert' else cfg.short_conv, attn=cfg.attn))

def _model_and_task(cfg, explicit, verbose):
    """(model, task, resume state): resumed from out_dir/ckpt.pt, or loaded from --init_from (its
    tokenizer encodes the data; its attention is kept unless --attn is given), or from scratch
    (bytes for text/glue)."""
    ckpt = os.path.join(cfg.out_dir, 'ckpt.pt')
    model = state = None
    if cfg.resume:
        if not os.path.exists(ckpt):
            raise UsageError(f"--resume but there is no checkpoint {ckpt}")
        model, state = M.load(ckpt)   # as saved: no overrides
    elif cfg.init_from != 'scratch':
        over = dict({'attn': cfg.attn} if 'attn' in explicit else {}, dropout=cfg.dropout)
        glue = {'num_labels': glue_num_labels(cfg.glue_task)} if cfg.task == 'glue' else {}
        model, _ = M.load(cfg.init_from, **over, **glue)
    tok = get_tokenizer(cfg.tokenizer, model, verbose) if cfg.task in ('text', 'glue') else None
    task = Task(cfg.data_config(), tok, verbose)
    if model is None:
        torch.manual_seed(cfg.seed)   # the same initial weights on every process
        model = build_model(cfg, task.vocab_size, task.num_labels, explicit)
    model.tokenizer = tok or model.tokenizer   # ckpt.pt carries it
    return model, task, state

def train(cfg, explicit=frozenset()):
    """One training run. -> the summary (also out_dir/summary.json) on the master process, None
    elsewhere."""
    rt = setup(cfg.device, cfg.dtype, cfg.grad_accum)
    try:
        model, task, state = _model_and_task(cfg, set(explicit), rt.master)
        module = (Classifier(model, task.num_labels) if cfg.task == 'glue' else model).to(rt.device)
        head = getattr(module, 'head', None)           # the GLUE head of a causal model
        if state and state.get('cls_head'):
            head.load_state_dict(state['cls_head'])
        c = model.config
        if rt.master:
            ddp = f", DDP x{rt.world}" if rt.ddp else ''
            print(f"model: {c.family}, {c.n_layer} layers, {c.n_head} heads, n_embd {c.n_embd}, "
                  f"attention {c.attn} {model.get_num_params() / 1e6:.3f}M parameters; "
                  f"device {rt.device}, dtype {rt.dtype}{ddp}")
        opt = model.configure_optimizers(cfg.weight_decay, cfg.lr, BETAS, rt.device.split(':')[0])
        if head is not None:
            opt.add_param_group({'params': [head.weight], 'weight_decay': cfg.weight_decay})
            opt.add_param_group({'params': [head.bias], 'weight_decay': 0.0})
        ckpt = os.path.join(cfg.out_dir, 'ckpt.pt')

        def save(st):
            M.save(ckpt, model, **st, train_config=asdict(cfg),
                   cls_head=head.state_dict() if head else {})
            return ckpt
        run = fit(module, opt, task_loss, task.next_batch, _subset(Schedule, cfg), rt,
                  lambda: estimate_loss(module, task, rt), save if cfg.save else None, state)
        if rt.ddp:
            dist.barrier()
        if not rt.master:
            return None
        metrics = {**{f"last_eval_{k}": v for k, v in run.pop('last_eval').items()},
                   **final_metrics(module, model, task, rt)}
        summary = {'config': asdict(cfg), 'model_config': asdict(c), 'metrics': metrics, **run,
                   'n_params': model.get_num_params(), 'tokenizer': task.tokenizer,
                   'device': rt.device, 'dtype': rt.dtype, 'world_size': rt.world,
                   'torch': torch.__version__}
        write_json(os.path.join(cfg.out_dir, 'summary.json'), summary)
        final = [f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                 for k, v in metrics.items() if not k.startswith('last_eval')]
        print(f"final: {', '.join(final)} ({_fmt_time(run['train_time_s'])} training)")
        return summary
    finally:
        if rt.ddp and dist.is_initialized():
            dist.destroy_process_group()

def compare(cfg, explicit=frozenset()):
    """One run per --attn value in cfg.compare (same config, budget and seeds; each in
    out_dir/<value>/), and a markdown table of the task metric, attention entropy, final train loss
    and times (out_dir/compare.md)."""
    if 'RANK' in os.environ:
        raise UsageError("--compare runs one process; launch it without torchrun")
    rows = []
    t0 = time.time()
    for spec in (s.strip() for s in cfg.compare.split(',') if s.strip()):
        log(f"=== {spec} ===")
        one = replace(cfg, attn=spec, compare='',
                      out_dir=os.path.join(cfg.out_dir, spec.replace(':', '_').replace('=', '')))
        rows.append((spec, train(one, set(explicit) | {'attn'})))
    metric = {'ar': 'test_acc', 'mqar': 'test_acc', 'text': 'val_ppl', 'glue': 'dev_main'}[cfg.task]
    lines = [f"| map | {metric} | mean attention entropy (all rows) | at query rows "
             "| final train loss | train time | CPU time |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for spec, s in rows:
        m = s['metrics']
        ent = ' | '.join('' if m.get(k) is None else f"{m[k]:.3f}"
                         for k in ('attn_entropy', 'attn_entropy_query'))
        lines.append(f"| {spec} | {m[metric]:.4f} | {ent} | {m['last_eval_train']:.4f} | "
                     f"{_fmt_time(s['train_time_s'])} | {_fmt_time(s['cpu_time_s'])} |")
    table = '\n'.join(lines)
    print(table + f"\ntotal {_fmt_time(time.time() - t0)}")
    with open(os.path.join(cfg.out_dir, 'compare.md'), 'w') as f:
        f.write(table + '\n')
    curves(rows, 'val_acc' if cfg.task in ('ar', 'mqar') else 'val', cfg.out_dir)
    return rows

def curves(rows, key, out_dir):
    """out_dir/compare.png: each run's evaluated `key` against its steps (every --eval_interval),
    where matplotlib is installed."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return print("matplotlib not installed: no compare.png")
    plt.switch_backend('Agg')
    fig, ax = plt.subplots()
    for spec, s in rows:
        ax.plot([e['iter'] for e in s['evals']], [e[key] for e in s['evals']], 'o-', label=spec)
    ax.set(xlabel='step', ylabel=key)
    ax.legend()
    fig.savefig(os.path.join(out_dir, 'compare.png'), dpi=80, bbox_inches='tight')
    print(f"wrote {os.path.join(out_dir, 'compare.png')}")

def main(argv=None):
    cfg, explicit = parse_config(TrainConfig, argv, __doc__)
    try:
        return compare(cfg, explicit) if cfg.compare else train(cfg, explicit)
    except (NonFiniteLoss, *USER_ERRORS) as e:
        # the user's error in one line (a bug keeps its traceback)
        print(f"train.py: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(NONFINITE_EXIT if isinstance(e, NonFiniteLoss) else 2) from None

if __name__ == '__main__':
    main()
