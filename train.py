"""
Train a small GPT whose attention is softmax or a linear feature map (attention.py), nanoGPT style.

    python train.py --attn hedgehog                 # associative recall (the default task, no download)
    python train.py --attn=elu --max_iters 500      # --flag value and --flag=value both work
    python train.py --task mqar --n_queries 8       # multi-query associative recall
    python train.py --task text --data ../shared/data/tinyshakespeare/input.txt
    python train.py --task glue --glue_task cola --data ../shared/data/cola --init_from <HF BERT folder>
    python train.py --compare softmax,taylor,hedgehog,elu,performer,cosformer,exp:t=1,exp:t=2 --ar_vocab 128 --max_iters 2000
    torchrun --nproc_per_node=2 train.py ...        # DDP (NCCL on GPUs, gloo on CPU)
    python train.py --help                          # every flag with its default

Tasks and their metric:
- ar / mqar: associative recall (Hedgehog App. B.1, zoology MQAR): key-value pairs then query keys; loss and
  accuracy at the query positions only. Test accuracy, plus the mean attention entropy of the trained model.
- text: language modelling on a text file / folder of .txt files / `datasets` name. Perplexity.
- glue: sequence classification (CoLA, SST-2, MRPC, STS-B, QQP, MNLI, QNLI, RTE) from local TSV/CSV/JSONL
  files or `datasets` GLUE. The task's metric (MCC, accuracy, F1, Pearson/Spearman).

The loop: AdamW (decay on 2-D weights), linear warmup + cosine decay, gradient accumulation, bf16/fp16
autocast on CUDA, atomic checkpoints (out_dir/ckpt.pt) that --resume continues exactly, a stop with a
clear message on a non-finite loss (the last good checkpoint is kept), and out_dir/summary.json (config +
final metrics) at the end. Per-step losses go to out_dir/log.jsonl.

Scratch models (the default) differ from nanoGPT's in two measured ways (README, "Training"): a 2-tap causal
convolution on the keys (--short_conv, as in H3 / Based), without which no linear map learned associative
recall in our runs while softmax did; and embeddings N(0, 1), other weights N(0, 0.08), untied output head
(with nanoGPT's 0.02 softmax does not learn recall without that convolution).

The data helpers (make_associative_recall, load_text, load_glue, glue_metric, ...) are plain
functions that other scripts import.
"""

import argparse
import contextlib
import csv
import glob
import inspect
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, fields, replace

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F

import attention
import tokenizer as tokenizer_lib
from model import GPT, GPTConfig, _read_own_checkpoint, hf_config_to_kwargs, load_checkpoint, save_checkpoint

TASKS = ('ar', 'mqar', 'text', 'glue')
TEST_SEED_OFFSET = 1_000_003   # AR test sequences use seed + this: a stream disjoint from the train seed's
NONFINITE_EXIT = 3             # exit status of a run stopped by a non-finite loss


# -----------------------------------------------------------------------------
# configuration: one dataclass, its fields are the command-line flags

@dataclass
class TrainConfig:
    # task and data
    task: str = 'ar'              # ar | mqar | text | glue
    data: str = ''                # text: a file, a folder of .txt files or a `datasets` name ('wikitext:wikitext-103-raw-v1');
                                  # glue: a folder (or file) of TSV/CSV/JSONL; '' = `datasets` GLUE (online)
    glue_task: str = 'cola'       # cola sst2 mrpc stsb qqp mnli qnli rte
    ar_vocab: int = 40            # associative recall vocabulary (keys = first half, values = second half)
    seq_len: int = 128            # AR sequence length; text/GLUE context length
    n_train: int = 10000          # AR training sequences
    n_test: int = 2000            # AR test sequences
    n_queries: int = 0            # queries per AR sequence (0: 1 for ar, 8 for mqar)
    label_repeats: bool = True    # AR training data: also label every context key that repeats an earlier one
    val_fraction: float = 0.1     # text: the held-out tail used for validation (local files)
    # model
    init_from: str = 'scratch'    # scratch | a HF folder or hub name | a .gguf file | one of our checkpoint files
    tokenizer: str = ''           # text/glue: a HF folder or .gguf file whose tokenizer replaces the model's own
    family: str = 'llama'         # gpt2 | llama | bert (scratch models; glue defaults to bert)
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True
    init_std: float = 0.08        # scratch models: N(0, init_std) Linear weights (residual projections / sqrt(2 n_layer))
    emb_init_std: float = 1.0     # scratch models: N(0, emb_init_std) embeddings, untied head (README: the init notes)
    short_conv: int = 2           # scratch causal models: taps of a causal depthwise conv on the keys (0 = none; see model.py)
    attn: str = 'hedgehog'        # softmax or a feature map; 'exp:t=2' style options allowed
    feature_dim: int = 0          # feature-map size for maps that have one (0 = the map's default)
    temperature: float = 1.0      # the exp map's t
    window: int = 0               # > 0: sliding-window softmax + linear hybrid (LoLCATs)
    window_combine: str = 'joint' # the window hybrid's form: joint (one normalisation) | mix (LoLCATs workshop Eq. 8)
    diag_block: int = 0           # > 0: block-diagonal softmax + linear (LLN+Diag)
    impl: str = 'chunked'         # linear attention implementation: quadratic | chunked | recurrent
    # optimisation
    max_iters: int = 1000
    lr_decay_iters: int = 0       # end of the cosine decay (0 = max_iters)
    batch_size: int = 32          # per process, per micro-step
    grad_accum: int = 1           # micro-steps per optimizer step, over all processes (DDP divides it)
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_iters: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0        # 0 = no clipping
    # evaluation, logging, I/O
    eval_interval: int = 250
    eval_iters: int = 8           # batches per split in estimate_loss
    log_interval: int = 100
    out_dir: str = 'out'
    save: bool = True             # write out_dir/ckpt.pt at every evaluation and at the end
    resume: bool = False          # continue from out_dir/ckpt.pt
    seed: int = 1337
    device: str = 'auto'          # auto | cpu | cuda | cuda:N
    dtype: str = 'auto'           # auto (bf16 on CUDA if supported, else fp16; fp32 on CPU) | float32 | bfloat16 | float16
    compile: bool = False         # torch.compile the model (off by default, and slow to start on CPU)
    threads: int = 0              # torch CPU threads (0 = torch's default), as convert.py and eval.py have
    compare: str = ''             # comma-separated maps: train one model per map, same budget and seeds, print a table


def _str2bool(s):
    if isinstance(s, bool):
        return s
    v = str(s).strip().lower()
    if v in ('1', 'true', 'yes', 'y', 'on'):
        return True
    if v in ('0', 'false', 'no', 'n', 'off'):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {s!r}")


def _field_help():
    """{field: its inline comment in TrainConfig's source} for --help."""
    helps, last = {}, None
    for line in inspect.getsource(TrainConfig).splitlines():
        code, _, comment = line.partition('#')
        if ':' in code and '=' in code:
            last = code.split(':')[0].strip()
            helps[last] = comment.strip()
        elif not code.strip() and comment and last in helps and line.startswith(' ' * 10):
            helps[last] += ' ' + comment.strip()
        else:
            last = None
    return helps


def build_parser():
    p = argparse.ArgumentParser(
        description=__doc__.split('\n\n')[0].strip() + ' Every flag is a TrainConfig field.',
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    helps = _field_help()
    for f in fields(TrainConfig):
        default = f.default
        name = '--' + f.name
        if isinstance(default, bool):
            p.add_argument(name, nargs='?', const=True, default=default, type=_str2bool, metavar='BOOL',
                           help=(helps.get(f.name) or f.name) + f' (--{f.name} / --no-{f.name} / --{f.name}=false)')
            p.add_argument('--no_' + f.name, '--no-' + f.name, dest=f.name, action='store_false',
                           help=argparse.SUPPRESS)
        else:
            choices = {'task': TASKS, 'family': ('gpt2', 'llama', 'bert'),
                       'impl': attention.IMPLS, 'window_combine': attention.WINDOW_COMBINES}.get(f.name)
            p.add_argument(name, type=type(default), default=default, choices=choices, metavar=f.name.upper(),
                           help=(helps.get(f.name) or f.name) + (
                               f"; one of: {', '.join(attention.ATTN_CHOICES)}" if f.name == 'attn' else ''))
    return p


def parse_attn_spec(spec):
    """'exp:t=2' / 'hedgehog:feature_dim=64' -> ('exp', {'temperature': 2.0}). Unknown names raise ValueError."""
    name, _, rest = spec.strip().partition(':')
    if name not in attention.ATTN_CHOICES:
        raise ValueError(f"unknown attention map {name!r}; choose one of: {', '.join(attention.ATTN_CHOICES)}")
    opts = {}
    for item in filter(None, rest.split(':')):
        key, eq, val = item.partition('=')
        if not eq:
            raise ValueError(f"bad map option {item!r} in {spec!r}: expected key=value")
        key = {'t': 'temperature', 'f': 'feature_dim'}.get(key, key)
        try:
            val = json.loads(val)
        except ValueError:
            pass
        opts[key] = val
    return name, opts


def parse_args(argv=None):
    """argv -> (TrainConfig, set of the flags given explicitly). Errors exit with status 2."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    cfg = TrainConfig(**vars(ns))
    given = set()
    for a in (argv if argv is not None else sys.argv[1:]):
        if a.startswith('--'):
            key = a[2:].split('=', 1)[0].replace('-', '_')
            given.add(key[3:] if key.startswith('no_') and key[3:] in vars(ns) else key)
    specs = [cfg.attn] + ([s for s in cfg.compare.split(',') if s.strip()] if cfg.compare else [])
    for s in specs:
        try:
            parse_attn_spec(s)
        except ValueError as e:
            parser.error(str(e))
    return cfg, given


def map_options(cfg, name, extra=None):
    """Feature-map options for map `name` from the config (only the ones its class takes) + explicit extras."""
    if name == 'softmax':
        return dict(extra or {})
    params = inspect.signature(attention.FEATURE_MAPS[name].__init__).parameters
    opts = {}
    if cfg.feature_dim and 'feature_dim' in params:
        opts['feature_dim'] = cfg.feature_dim
    if 'temperature' in params:
        opts['temperature'] = cfg.temperature
    opts.update(extra or {})
    return opts


# -----------------------------------------------------------------------------
# associative recall (Hedgehog App. B.1; zoology's multi-query variant)

def make_associative_recall(n, seq_len=128, vocab=40, seed=0, n_queries=1, label_repeats=False):
    """n sequences (x, y), LongTensors (n, seq_len). Keys are tokens 0..vocab/2-1, values vocab/2..vocab-1;
    every sequence has its own random key->value map (a random permutation). x = k1 v1 k2 v2 ... (keys drawn
    uniformly, with repeats) filling the first seq_len - n_queries positions, then n_queries query keys,
    each one that appeared with its value in the context. y = -100 everywhere except at the query positions,
    where it is the query key's value. (If seq_len - n_queries is odd, the context ends with a lone key.)
    label_repeats=True also labels every context key that repeats an earlier key with its value: each such
    key is a query too (a dense training signal; the queries at the end are unchanged)."""
    if vocab < 4 or vocab % 2:
        raise ValueError(f"vocab must be even and >= 4, got {vocab}")
    ctx_len = seq_len - n_queries
    n_pairs = ctx_len // 2
    if n_queries < 1 or n_pairs < 1:
        raise ValueError(f"seq_len={seq_len} leaves no room for key-value pairs and {n_queries} queries")
    g = torch.Generator().manual_seed(int(seed))
    nk = vocab // 2
    keys = torch.randint(0, nk, (n, (ctx_len + 1) // 2), generator=g)
    kv_map = torch.argsort(torch.rand(n, nk, generator=g), dim=1) + nk          # (n, nk): key -> value
    vals = torch.gather(kv_map, 1, keys)
    ctx = torch.stack([keys, vals], dim=2).reshape(n, -1)[:, :ctx_len]
    q_pos = torch.randint(0, n_pairs, (n, n_queries), generator=g)              # a complete pair's key
    queries = torch.gather(keys, 1, q_pos)
    x = torch.cat([ctx, queries], dim=1)
    y = torch.full_like(x, -100)
    y[:, ctx_len:] = torch.gather(kv_map, 1, queries)
    if label_repeats:
        kp = keys[:, :n_pairs]
        seen = torch.zeros(n, nk, dtype=torch.bool)
        for i in range(n_pairs):   # the key at pair i was seen (with its value) in an earlier pair
            k = kp[:, i]
            rep = seen[torch.arange(n), k]
            y[rep, 2 * i] = vals[rep, i]
            seen[torch.arange(n), k] = True
    return x, y


def ar_datasets(cfg):
    nq = cfg.n_queries or (8 if cfg.task == 'mqar' else 1)
    train_seed, test_seed = cfg.seed, cfg.seed + TEST_SEED_OFFSET
    assert train_seed != test_seed
    train = make_associative_recall(cfg.n_train, cfg.seq_len, cfg.ar_vocab, train_seed, nq, cfg.label_repeats)
    test = make_associative_recall(cfg.n_test, cfg.seq_len, cfg.ar_vocab, test_seed, nq)
    return train, test


# -----------------------------------------------------------------------------
# text: tokenizer, loading, batches


def run_tokenizer(cfg, model=None, verbose=True):
    """The tokenizer of a text or GLUE run (None for associative recall): --tokenizer if given; for a model
    trained from scratch (model=None) bytes (tiktoken's gpt2 only with --tokenizer gpt2); else the
    model's own (its checkpoint's, HF folder's or GGUF file's), or the project tokenizer matching its vocab_size.
    Anything else -- or a tokenizer with more ids than the model's vocabulary -- is an error."""
    if cfg.task not in ('text', 'glue'):
        return None
    if model is None:
        tok = tokenizer_lib.load_tokenizer(cfg.tokenizer or 'bytes')
    else:
        tok = tokenizer_lib.resolve(model, cfg.tokenizer or None)
    if verbose:
        src = ('--tokenizer' if cfg.tokenizer else 'default' if model is None else
               "the model's" if model.tokenizer is tok else 'by vocab_size')
        print(f"tokenizer: {tok.name}, vocab {tok.vocab_size} ({src})")
    return tok


def load_text(path_or_name, split='train'):
    """A text file, a folder of .txt files (sorted, recursive, joined by blank lines) or a HF `datasets`
    name ('wikitext:wikitext-103-raw-v1' = name:config; needs internet or the HF cache) -> str.
    `split` only applies to `datasets` names."""
    if not path_or_name:
        raise ValueError("--data is empty: give a text file, a folder of .txt files or a datasets name")
    if os.path.isfile(path_or_name):
        with open(path_or_name, encoding='utf-8', errors='replace') as f:
            return f.read()
    if os.path.isdir(path_or_name):
        files = sorted(glob.glob(os.path.join(path_or_name, '**', '*.txt'), recursive=True))
        if not files:
            raise ValueError(f"no .txt files under {path_or_name}")
        parts = []
        for fn in files:
            with open(fn, encoding='utf-8', errors='replace') as f:
                parts.append(f.read())
        return '\n\n'.join(parts)
    name, _, config = path_or_name.partition(':')
    try:
        import datasets
        ds = datasets.load_dataset(name, config or None, split=split)
    except Exception as e:
        raise ValueError(f"{path_or_name!r} is not a local file or folder, and loading it with "
                         f"datasets.load_dataset failed ({type(e).__name__}: {str(e)[:200]}); offline, "
                         f"pass a local text file or folder with --data") from None
    col = 'text' if 'text' in ds.column_names else ds.column_names[0]
    return '\n'.join(ds[col])


def text_splits(cfg, tok):
    """(train_ids, val_ids) int64 numpy arrays."""
    local = os.path.exists(cfg.data)
    if local:
        ids = tok.encode_array(load_text(cfg.data))
        n_val = max(int(len(ids) * cfg.val_fraction), cfg.seq_len + 2)
        if len(ids) - n_val < cfg.seq_len + 2:
            raise ValueError(f"{cfg.data}: {len(ids)} tokens is too little text for seq_len={cfg.seq_len}")
        return ids[:-n_val], ids[-n_val:]
    train = tok.encode_array(load_text(cfg.data, 'train'))
    try:
        val = tok.encode_array(load_text(cfg.data, 'validation'))
    except ValueError:
        val = tok.encode_array(load_text(cfg.data, 'test'))
    return train, val


def get_text_batch(ids, offsets, seq_len):
    """Windows of ids starting at offsets -> (x, y) LongTensors (len(offsets), seq_len), y = x shifted by one."""
    idx = np.asarray(offsets)[:, None] + np.arange(seq_len + 1)[None, :]
    w = torch.from_numpy(ids[idx].astype(np.int64))
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


# -----------------------------------------------------------------------------
# GLUE: loading and metrics

GLUE_TASKS = {  # task -> (text_a columns, text_b columns, number of labels (1 = regression))
    'cola': (('sentence',), (), 2),
    'sst2': (('sentence',), (), 2),
    'mrpc': (('sentence1', '#1 String'), ('sentence2', '#2 String'), 2),
    'stsb': (('sentence1',), ('sentence2',), 1),
    'qqp': (('question1',), ('question2',), 2),
    'mnli': (('premise', 'sentence1'), ('hypothesis', 'sentence2'), 3),
    'qnli': (('question',), ('sentence',), 2),
    'rte': (('sentence1',), ('sentence2',), 2),
}
GLUE_ALIASES = {'sst-2': 'sst2', 'sts-b': 'stsb', 'mnli-m': 'mnli', 'mnli_matched': 'mnli'}
GLUE_LABEL_COLS = ('label', 'gold_label', 'is_duplicate', 'score', 'quality')
GLUE_STRING_LABELS = {'entailment': 0, 'neutral': 1, 'contradiction': 2, 'not_entailment': 1}
GLUE_SPLITS = {'train': ('train',), 'validation': ('dev', 'validation', 'val', 'dev_matched', 'validation_matched'),
               'test': ('test', 'test_matched')}


def glue_task_name(task):
    t = task.strip().lower()
    t = GLUE_ALIASES.get(t, t)
    if t not in GLUE_TASKS:
        raise ValueError(f"unknown GLUE task {task!r}; choose one of: {', '.join(GLUE_TASKS)}")
    return t


def glue_num_labels(task):
    return GLUE_TASKS[glue_task_name(task)][2]


def _glue_label(v, task):
    v = str(v).strip()
    if GLUE_TASKS[task][2] == 1:
        return float(v)
    if v.lower() in GLUE_STRING_LABELS:
        return GLUE_STRING_LABELS[v.lower()]
    return int(float(v))


def _glue_from_dicts(rows, task, where):
    a_cols, b_cols, _ = GLUE_TASKS[task]
    out = []
    for r in rows:
        low = {str(k).strip().lower(): v for k, v in r.items()}
        a = next((low[c.lower()] for c in a_cols if c.lower() in low), None)
        b = next((low[c.lower()] for c in b_cols if c.lower() in low), None) if b_cols else None
        lab = next((low[c] for c in GLUE_LABEL_COLS if c in low and low[c] not in (None, '', '-')), None)
        if a is None:
            raise ValueError(f"{where}: no column for text_a among {list(a_cols)} (columns: {list(r)})")
        if b_cols and b is None:
            raise ValueError(f"{where}: no column for text_b among {list(b_cols)} (columns: {list(r)})")
        if lab is None:
            continue  # unlabelled (test) row
        out.append((str(a), None if b is None else str(b), _glue_label(lab, task)))
    return out


def _glue_headerless(rows, task, where):
    """GLUE TSVs without a header: `text<TAB>label`, `a<TAB>b<TAB>label`, or the original CoLA layout
    `source<TAB>label<TAB>mark<TAB>sentence`."""
    out = []
    pair = bool(GLUE_TASKS[task][1])
    for i, r in enumerate(rows):
        if not r or all(not c.strip() for c in r):
            continue
        if task == 'cola' and len(r) == 4:
            out.append((r[3], None, _glue_label(r[1], task)))
        elif not pair and len(r) >= 2:
            out.append((r[0], None, _glue_label(r[-1], task)))
        elif pair and len(r) >= 3:
            out.append((r[-3], r[-2], _glue_label(r[-1], task)))
        else:
            raise ValueError(f"{where} line {i + 1}: cannot read {len(r)} columns as a {task} row without a header")
    return out


def _looks_like_header(row, task):
    names = {c.strip().lower() for c in row}
    a_cols, b_cols, _ = GLUE_TASKS[task]
    known = {c.lower() for c in a_cols + b_cols + GLUE_LABEL_COLS}
    return bool(names & known)


def _find_glue_file(path, split):
    if os.path.isfile(path):
        return path
    cands = []
    for stem in GLUE_SPLITS[split]:
        for ext in ('tsv', 'csv', 'jsonl', 'json'):
            cands += glob.glob(os.path.join(path, f"{stem}.{ext}"))
    if not cands:
        raise ValueError(f"no {split} file in {path}: expected one of "
                         f"{[s + '.tsv|csv|jsonl' for s in GLUE_SPLITS[split]]}")
    return sorted(cands)[0]


def load_glue(task, path=None, split='train'):
    """GLUE examples as a list of (text_a, text_b or None, label) (label: int class, float for STS-B).
    path: a folder holding train.{tsv,csv,jsonl} and dev.* (or validation.*), or a single file; TSVs with a
    header row (GLUE's own layout) or without one (`sentence<TAB>label`, as in ../shared/data/cola).
    path None or '': `datasets.load_dataset('glue', task)` (needs internet or the HF cache)."""
    task = glue_task_name(task)
    split = {'dev': 'validation', 'val': 'validation'}.get(split, split)
    if split not in GLUE_SPLITS:
        raise ValueError(f"unknown split {split!r}; use train, validation or test")
    if not path:
        try:
            import datasets
            hf_split = 'validation_matched' if task == 'mnli' and split == 'validation' else split
            ds = datasets.load_dataset('glue', task, split=hf_split)
        except Exception as e:
            raise ValueError(f"loading GLUE {task} with datasets failed ({type(e).__name__}: {str(e)[:200]}); "
                             f"offline, pass a folder of TSV/CSV/JSONL files with --data") from None
        return _glue_from_dicts(ds, task, f"datasets glue/{task}")
    fn = _find_glue_file(path, split)
    if fn.endswith(('.jsonl', '.json')):
        with open(fn, encoding='utf-8') as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return _glue_from_dicts(rows, task, fn)
    with open(fn, encoding='utf-8', newline='') as f:
        if fn.endswith('.csv'):
            rows = list(csv.reader(f))
        else:
            rows = list(csv.reader(f, delimiter='\t', quoting=csv.QUOTE_NONE))
    if rows and _looks_like_header(rows[0], task):
        head = rows[0]
        return _glue_from_dicts([dict(zip(head, r)) for r in rows[1:] if r], task, fn)
    return _glue_headerless(rows, task, fn)


def _ranks(x):
    """Average ranks (ties share the mean rank), as scipy.stats.rankdata."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, kind='mergesort')
    xs = x[order]
    ranks = np.empty(len(x), dtype=np.float64)
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and xs[j + 1] == xs[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def pearson(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    a, b = a - a.mean(), b - b.mean()
    den = math.sqrt(float((a * a).sum() * (b * b).sum()))
    return float((a * b).sum() / den) if den > 0 else 0.0


def spearman(a, b):
    return pearson(_ranks(a), _ranks(b))


def matthews_corrcoef(labels, preds):
    """Multiclass Matthews correlation (as sklearn.metrics.matthews_corrcoef)."""
    labels, preds = np.asarray(labels), np.asarray(preds)
    classes = np.union1d(labels, preds)
    li, pi = np.searchsorted(classes, labels), np.searchsorted(classes, preds)
    C = np.zeros((len(classes), len(classes)), dtype=np.float64)
    np.add.at(C, (li, pi), 1)
    t, p = C.sum(1), C.sum(0)
    c, s = np.trace(C), C.sum()
    den = math.sqrt((s * s - (p * p).sum()) * (s * s - (t * t).sum()))
    return float((c * s - (t * p).sum()) / den) if den > 0 else 0.0


def f1_binary(labels, preds, positive=1):
    labels, preds = np.asarray(labels), np.asarray(preds)
    tp = float(((preds == positive) & (labels == positive)).sum())
    fp = float(((preds == positive) & (labels != positive)).sum())
    fn = float(((preds != positive) & (labels == positive)).sum())
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn > 0 else 0.0


def glue_metric(task, preds, labels):
    """The task's GLUE metrics as a dict: CoLA mcc; STS-B pearson, spearman; MRPC/QQP accuracy, f1; others
    accuracy. 'main' repeats the one GLUE ranks by (mcc, accuracy or pearson)."""
    task = glue_task_name(task)
    if task == 'stsb':
        out = {'pearson': pearson(preds, labels), 'spearman': spearman(preds, labels)}
        out['main'] = out['pearson']
        return out
    preds, labels = np.asarray(preds), np.asarray(labels)
    out = {'accuracy': float((preds == labels).mean()) if len(labels) else 0.0}
    if task == 'cola':
        out['mcc'] = matthews_corrcoef(labels, preds)
        out['main'] = out['mcc']
    else:
        if task in ('mrpc', 'qqp'):
            out['f1'] = f1_binary(labels, preds)
        out['main'] = out['accuracy']
    return out


class GlueEncoder:
    """Turns (text_a, text_b) into (token ids, token types) for a classifier with the model's tokenizer
    (tokenizer.py encode_pair): a BERT tokenizer gives [CLS] a [SEP] b [SEP]; the others [eot] a [eot] b [eot]
    (eot doubles as CLS and SEP), token type 1 for b. `tok`: a tokenizer; 'scratch' (or '') for the project
    tokenizer; or a HF folder / .gguf file to load one from."""

    def __init__(self, tok, seq_len, verbose=True):
        if isinstance(tok, str):
            tok = tokenizer_lib.load_tokenizer('bytes' if tok in ('', 'scratch') else tok)
        self.tok, self.seq_len = tok, seq_len
        self.name, self.vocab_size = tok.name, tok.vocab_size
        if verbose:
            print(f"glue tokenizer: {self.name}, vocab {self.vocab_size}")

    def encode(self, a, b=None):
        return self.tok.encode_pair(a, b, self.seq_len)


def collate_glue(encoded, labels, pad_id=0):
    """[(ids, token_types)], labels -> (idx, attention_mask, token_type_ids, labels) tensors, right-padded."""
    T = max(len(ids) for ids, _ in encoded)
    B = len(encoded)
    idx = torch.full((B, T), pad_id, dtype=torch.long)
    tt = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.long)
    for i, (ids, types) in enumerate(encoded):
        idx[i, :len(ids)] = torch.tensor(ids)
        tt[i, :len(types)] = torch.tensor(types)
        mask[i, :len(ids)] = 1
    lab = torch.tensor(labels, dtype=torch.float32 if isinstance(labels[0], float) else torch.long)
    return idx, mask, tt, lab


class Classifier(nn.Module):
    """Sequence classification around a GPT: BERT family -> model.classify (pooled [CLS]); causal families
    -> a linear head on the last real token's final hidden state. forward -> (logits, loss)."""

    def __init__(self, model, num_labels):
        super().__init__()
        self.model = model
        self.num_labels = num_labels
        self.head = None
        if model.config.family != 'bert':
            self.head = nn.Linear(model.config.n_embd, num_labels)
            nn.init.normal_(self.head.weight, std=0.02)
            nn.init.zeros_(self.head.bias)

    def forward(self, idx, attention_mask, token_type_ids, labels=None):
        if self.head is None:
            return self.model.classify(idx, attention_mask, token_type_ids, labels)
        h, _ = self.model._hidden(idx)                                        # (B, T, C); causal
        last = attention_mask.long().sum(1).clamp(min=1) - 1
        logits = self.head(h[torch.arange(idx.size(0), device=idx.device), last])
        loss = None
        if labels is not None:
            loss = (F.mse_loss(logits.squeeze(-1).float(), labels.float()) if self.num_labels == 1
                    else F.cross_entropy(logits.float(), labels.long()))
        return logits, loss


# -----------------------------------------------------------------------------
# attention entropy (Hedgehog Fig. 4)

@torch.no_grad()
def mean_attention_entropy(model, x, query_positions=None, batch_size=64):
    """Mean row entropy (nats) of every layer's attention matrix core.weights(q, k) on inputs x, averaged
    over layers, heads, sequences and query rows (all rows, and separately the rows in query_positions).
    Returns (mean over all rows, mean over the query rows or None)."""
    captured = []
    hooks = [core.register_forward_pre_hook(lambda mod, args: captured.append((mod, args[0], args[1])))
             for core in model.attention_cores()]
    tot, n, totq, nq = 0.0, 0, 0.0, 0
    was_training = model.training
    model.eval()
    try:
        for i in range(0, len(x), batch_size):
            captured.clear()
            model(x[i:i + batch_size])
            for core, q, k in list(captured):   # (weights() calls the core: its own hook appends)
                ent = attention.attention_entropy(core.weights(q, k))                # (B, H, T)
                tot += ent.sum().item()
                n += ent.numel()
                if query_positions is not None:
                    e = ent[..., query_positions]
                    totq += e.sum().item()
                    nq += e.numel()
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    return tot / max(n, 1), (totq / nq if nq else None)


# -----------------------------------------------------------------------------
# the training run

class NonFiniteLoss(RuntimeError):
    pass


def _fmt_time(s):
    s = int(round(s))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _fmt_rate(r):
    return f"{r / 1e6:.2f}M" if r >= 1e6 else f"{r / 1e3:.1f}k" if r >= 1e3 else f"{r:.0f}"


def get_lr(cfg, it):
    """Linear warmup, then cosine decay from lr to min_lr at lr_decay_iters (nanoGPT)."""
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if it < cfg.warmup_iters:
        return cfg.lr * (it + 1) / (cfg.warmup_iters + 1)
    if it >= decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.lr - cfg.min_lr)


def resolve_device(name):
    if name == 'auto':
        return 'cuda' if torch.cuda.is_available() else 'cpu'
    if name.startswith('cuda') and not torch.cuda.is_available():
        raise SystemExit(f"error: --device {name} but CUDA is not available (use --device cpu or auto)")
    if name != 'cpu' and not name.startswith('cuda'):
        raise SystemExit(f"error: unknown --device {name!r}: use auto, cpu, cuda or cuda:N")
    return name


def resolve_dtype(name, device):
    if name == 'auto':
        if device.startswith('cuda'):
            return 'bfloat16' if torch.cuda.is_bf16_supported() else 'float16'
        return 'float32'
    if name not in ('float32', 'bfloat16', 'float16'):
        raise SystemExit(f"error: unknown --dtype {name!r}: use auto, float32, bfloat16 or float16")
    return name


def _write_json(path, obj):
    tmp = path + '.tmp'
    with open(tmp, 'w') as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def _dist():
    """(ddp, rank, local_rank, world_size) from torchrun's environment."""
    if int(os.environ.get('RANK', -1)) == -1:
        return False, 0, 0, 1
    return True, int(os.environ['RANK']), int(os.environ.get('LOCAL_RANK', 0)), int(os.environ['WORLD_SIZE'])


def build_model(cfg, vocab_size, num_labels=0, explicit=()):
    """The GPT for this run (scratch or --init_from), with the requested attention."""
    name, extra = parse_attn_spec(cfg.attn)
    attn_kw = dict(attn=name, window=cfg.window, diag_block=cfg.diag_block, impl=cfg.impl,
                   window_combine=cfg.window_combine, attn_options=map_options(cfg, name, extra))
    if cfg.init_from in ('', 'scratch'):
        family = 'bert' if cfg.task == 'glue' and 'family' not in explicit else cfg.family
        gcfg = GPTConfig(family=family, vocab_size=vocab_size, block_size=cfg.seq_len, n_layer=cfg.n_layer,
                         n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout, bias=cfg.bias,
                         num_labels=num_labels if family == 'bert' else 0, init_std=cfg.init_std,
                         emb_init_std=cfg.emb_init_std, tie_embeddings=False,
                         short_conv=0 if family == 'bert' else cfg.short_conv, **attn_kw)
        return GPT(gcfg)
    overrides = {'dropout': cfg.dropout}
    if explicit & {'attn', 'window', 'diag_block', 'window_combine', 'impl', 'feature_dim', 'temperature'}:
        overrides.update(attn_kw)   # otherwise keep the checkpoint's own attention
    if num_labels and _init_family(cfg.init_from) == 'bert':
        overrides['num_labels'] = num_labels
    return GPT.from_pretrained(cfg.init_from, **overrides)


def _init_family(init_from):
    """The model family of --init_from: one of our checkpoint files, a HF folder, a GGUF file (llama) or a hub
    name (a guess)."""
    if os.path.isfile(init_from) and init_from.endswith('.gguf'):
        return 'llama'
    if os.path.isfile(init_from):
        return _read_own_checkpoint(init_from)[0]['config']['family']
    cfg_file = os.path.join(init_from, 'config.json')
    if os.path.isfile(cfg_file):
        with open(cfg_file) as f:
            return hf_config_to_kwargs(json.load(f))['family']
    return 'bert' if 'bert' in init_from.lower() else 'gpt2'


class Task:
    """The data side of a run: training micro-batches, estimate_loss batches and final metrics."""

    def __init__(self, cfg, verbose=True, tokenizer=None):
        """tokenizer: the run's tokenizer for text and GLUE (run_tokenizer; default the project tokenizer)."""
        self.cfg = cfg
        self.tokenizer = None
        if cfg.task in ('text', 'glue') and tokenizer is None:
            tokenizer = tokenizer_lib.load_tokenizer('bytes')
        self.num_labels = 0
        if cfg.task in ('ar', 'mqar'):
            (self.x_train, self.y_train), (self.x_test, self.y_test) = ar_datasets(cfg)
            self.vocab_size = cfg.ar_vocab
            self.n_train = len(self.x_train)
            self.tokens_per_example = cfg.seq_len
        elif cfg.task == 'text':
            tok = tokenizer
            self.tokenizer = tok.name
            self.train_ids, self.val_ids = text_splits(cfg, tok)
            self.vocab_size = tok.vocab_size if tok.vocab_size < 1000 else (tok.vocab_size + 63) // 64 * 64
            self.n_train = len(self.train_ids) - cfg.seq_len - 1
            self.tokens_per_example = cfg.seq_len
            if verbose:
                print(f"text: {len(self.train_ids):,} train / {len(self.val_ids):,} val tokens")
        else:
            self.glue_task = glue_task_name(cfg.glue_task)
            self.num_labels = glue_num_labels(self.glue_task)
            self.enc = GlueEncoder(tokenizer, cfg.seq_len, verbose=verbose)
            self.tokenizer = self.enc.name
            self.vocab_size = self.enc.vocab_size
            self.train = load_glue(self.glue_task, cfg.data, 'train')
            self.dev = load_glue(self.glue_task, cfg.data, 'validation')
            self.train_enc = [self.enc.encode(a, b) for a, b, _ in self.train]
            self.dev_enc = [self.enc.encode(a, b) for a, b, _ in self.dev]
            self.n_train = len(self.train)
            self.tokens_per_example = float(np.mean([len(i) for i, _ in self.train_enc]))
            if verbose:
                print(f"glue {self.glue_task}: {len(self.train)} train / {len(self.dev)} dev examples")
        if self.n_train < 1:
            raise ValueError("no training data")

    def draw(self, gen, count):
        """`count` random training example indices (or text offsets) from generator gen."""
        return torch.randint(0, self.n_train, (count,), generator=gen)

    def batch(self, sel, device, split='train'):
        """Model inputs for examples sel (indices into the split, or text offsets)."""
        cfg = self.cfg
        if cfg.task in ('ar', 'mqar'):
            x, y = (self.x_train, self.y_train) if split == 'train' else (self.x_test, self.y_test)
            return x[sel].to(device), y[sel].to(device)
        if cfg.task == 'text':
            ids = self.train_ids if split == 'train' else self.val_ids
            x, y = get_text_batch(ids, np.asarray(sel), cfg.seq_len)
            return x.to(device), y.to(device)
        data, enc = (self.train, self.train_enc) if split == 'train' else (self.dev, self.dev_enc)
        sel = [int(i) for i in sel]
        b = collate_glue([enc[i] for i in sel], [data[i][2] for i in sel])
        return tuple(t.to(device) for t in b)

    def eval_selections(self, split, n_batches, batch_size):
        """Deterministic evaluation batches (independent of the training data stream)."""
        cfg = self.cfg
        if cfg.task == 'text':
            ids = self.train_ids if split == 'train' else self.val_ids
            g = torch.Generator().manual_seed(cfg.seed + (7 if split == 'train' else 11))
            return [torch.randint(0, len(ids) - cfg.seq_len - 1, (batch_size,), generator=g)
                    for _ in range(n_batches)]
        n = self.n_train if split == 'train' else (len(self.x_test) if cfg.task in ('ar', 'mqar') else len(self.dev))
        n_use = min(n, n_batches * batch_size)
        return [torch.arange(i, min(i + batch_size, n_use)) for i in range(0, n_use, batch_size)]


def _loss(module, task, batch):
    return module(*batch)[1]


@torch.no_grad()
def estimate_loss(module, task, device, ctx, eval_iters, batch_size):
    """Mean loss over eval_iters deterministic batches of the train and val/test splits (nanoGPT), plus
    AR accuracy at the query positions."""
    out = {}
    module.eval()
    for split in ('train', 'val'):
        losses, correct, total = [], 0, 0
        for sel in task.eval_selections(split, eval_iters, batch_size):
            batch = task.batch(sel, device, split)
            with ctx:
                logits, loss = module(*batch)
            losses.append(loss.item())
            if task.cfg.task in ('ar', 'mqar'):
                y = batch[1]
                m = y != -100
                correct += (logits.argmax(-1)[m] == y[m]).sum().item()
                total += m.sum().item()
        out[split] = float(np.mean(losses))
        if total:
            out[split + '_acc'] = correct / total
    module.train()
    return out


@torch.no_grad()
def final_metrics(module, model, task, device, ctx, batch_size):
    """Metrics on the whole test / validation split at the end of a run."""
    cfg = task.cfg
    module.eval()
    m = {}
    if cfg.task in ('ar', 'mqar'):
        tot_loss, correct, total = 0.0, 0, 0
        for i in range(0, len(task.x_test), batch_size):
            x, y = task.x_test[i:i + batch_size].to(device), task.y_test[i:i + batch_size].to(device)
            with ctx:
                logits, _ = module(x)
            mask = y != -100
            lg = logits[mask].float()
            tot_loss += F.cross_entropy(lg, y[mask], reduction='sum').item()
            correct += (lg.argmax(-1) == y[mask]).sum().item()
            total += mask.sum().item()
        m['test_loss'] = tot_loss / total
        m['test_acc'] = correct / total
        nq = cfg.n_queries or (8 if cfg.task == 'mqar' else 1)
        n_ent = min(len(task.x_test), 256)
        with ctx:
            ent, ent_q = mean_attention_entropy(model, task.x_test[:n_ent].to(device),
                                                list(range(cfg.seq_len - nq, cfg.seq_len)))
        m['attn_entropy'] = ent
        m['attn_entropy_query'] = ent_q
    elif cfg.task == 'text':
        ids = task.val_ids
        T = cfg.seq_len
        starts = np.arange(0, len(ids) - T - 1, T)[:4096]   # non-overlapping windows (at most 4096)
        tot, n = 0.0, 0
        for i in range(0, len(starts), batch_size):
            x, y = get_text_batch(ids, starts[i:i + batch_size], T)
            with ctx:
                logits, _ = module(x.to(device))
            tot += F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.to(device).view(-1),
                                   reduction='sum').item()
            n += y.numel()
        m['val_loss'] = tot / n
        m['val_ppl'] = math.exp(min(m['val_loss'], 700))
        m['val_tokens'] = n
    else:
        preds, labels, tot, n = [], [], 0.0, 0
        for i in range(0, len(task.dev), batch_size):
            sel = list(range(i, min(i + batch_size, len(task.dev))))
            idx, mask, tt, lab = task.batch(sel, device, 'val')
            with ctx:
                logits, loss = module(idx, mask, tt, lab)
            tot += loss.item() * len(sel)
            n += len(sel)
            logits = logits.float()
            preds += (logits.squeeze(-1) if task.num_labels == 1 else logits.argmax(-1)).tolist()
            labels += lab.tolist()
        m['dev_loss'] = tot / max(n, 1)
        m.update({f"dev_{k}": v for k, v in glue_metric(task.glue_task, preds, labels).items()})
    module.train()
    return m


def train(cfg, explicit=frozenset(), verbose=True):
    """One training run. Returns the summary dict (also written to out_dir/summary.json)."""
    ddp, rank, local_rank, world = _dist()
    master = rank == 0
    say = print if (master and verbose) else (lambda *a, **k: None)
    device = resolve_device(cfg.device)
    if ddp:
        import torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group(backend='nccl' if device.startswith('cuda') else 'gloo')
        if device.startswith('cuda'):
            device = f'cuda:{local_rank}'
            torch.cuda.set_device(device)
        if cfg.grad_accum % world:
            raise SystemExit(f"error: --grad_accum {cfg.grad_accum} must be a multiple of the {world} processes")
    local_accum = cfg.grad_accum // world
    if cfg.threads < 0:
        raise SystemExit(f"error: --threads must be >= 0 (0 = torch's default), got {cfg.threads}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dtype = resolve_dtype(cfg.dtype, device)
    device_type = 'cuda' if device.startswith('cuda') else 'cpu'
    ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
    ctx = (torch.autocast(device_type='cuda', dtype=ptdtype) if device_type == 'cuda' and dtype != 'float32'
           else contextlib.nullcontext())
    if device_type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    os.makedirs(cfg.out_dir, exist_ok=True)
    ckpt_path = os.path.join(cfg.out_dir, 'ckpt.pt')
    log_path = os.path.join(cfg.out_dir, 'log.jsonl')

    torch.manual_seed(cfg.seed)   # the same initial weights on every process
    model, extra = None, {}
    if cfg.resume:
        if not os.path.exists(ckpt_path):
            raise SystemExit(f"error: --resume but there is no checkpoint {ckpt_path}")
        model, extra = load_checkpoint(ckpt_path)
        say(f"resuming from {ckpt_path} at step {extra['iter_num']}")
    elif cfg.init_from not in ('', 'scratch'):   # a pretrained model first: its tokenizer encodes the data
        num_labels = glue_num_labels(glue_task_name(cfg.glue_task)) if cfg.task == 'glue' else 0
        model = build_model(cfg, None, num_labels, set(explicit))
    tok = run_tokenizer(cfg, model, verbose=master and verbose)
    task = Task(cfg, verbose=master and verbose, tokenizer=tok)
    if model is None:
        torch.manual_seed(cfg.seed)
        model = build_model(cfg, task.vocab_size, task.num_labels, set(explicit))
    if tok is not None:
        model.tokenizer = tok        # so that ckpt.pt carries the tokenizer
    module = Classifier(model, task.num_labels) if cfg.task == 'glue' else model
    if cfg.task == 'glue' and extra.get('cls_head'):
        module.head.load_state_dict(extra['cls_head'])
    module.to(device)
    say(f"model: {model.config.family}, {model.config.n_layer} layers, {model.config.n_head} heads, "
        f"n_embd {model.config.n_embd}, attention {model.config.attn} {model.config.attn_options or ''}, "
        f"{model.get_num_params() / 1e6:.3f}M parameters; device {device}, dtype {dtype}"
        + (f", DDP x{world}" if ddp else ''))

    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.lr, (cfg.beta1, cfg.beta2), device_type)
    if getattr(module, 'head', None) is not None:   # the GLUE head of a causal model
        optimizer.add_param_group({'params': [module.head.weight], 'weight_decay': cfg.weight_decay})
        optimizer.add_param_group({'params': [module.head.bias], 'weight_decay': 0.0})
    scaler = torch.amp.GradScaler('cuda', enabled=(dtype == 'float16' and device_type == 'cuda'))
    data_gen = torch.Generator().manual_seed(cfg.seed)   # the global batch stream, the same on every process
    iter_num = 0
    history = []
    if cfg.resume:
        optimizer.load_state_dict(extra['optimizer'])
        if extra.get('scaler'):
            scaler.load_state_dict(extra['scaler'])
        iter_num = int(extra['iter_num'])
        data_gen.set_state(extra['data_rng'])
        if master:
            torch.set_rng_state(extra['torch_rng'])
            if device_type == 'cuda' and extra.get('cuda_rng') is not None:
                torch.cuda.set_rng_state(extra['cuda_rng'], device)
        else:
            torch.manual_seed(cfg.seed + rank + 7919 * iter_num)
        if os.path.exists(log_path) and master:
            with open(log_path) as f:
                history = [json.loads(line) for line in f if line.strip()]
            history = [h for h in history if h['iter'] < iter_num]
    else:
        torch.manual_seed(cfg.seed + rank)            # per-process seeds (dropout and the like)
    if master:
        with open(log_path + '.tmp', 'w') as f:
            f.writelines(json.dumps(h) + '\n' for h in history)
        os.replace(log_path + '.tmp', log_path)
    train_module = torch.compile(module) if cfg.compile else module
    if ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP
        train_module = DDP(train_module, device_ids=[local_rank] if device_type == 'cuda' else None)

    def save(step):
        if not (master and cfg.save):
            return
        save_checkpoint(ckpt_path, model, optimizer=optimizer.state_dict(), scaler=scaler.state_dict(),
                        iter_num=step, data_rng=data_gen.get_state(), torch_rng=torch.get_rng_state(),
                        cuda_rng=torch.cuda.get_rng_state(device) if device_type == 'cuda' else None,
                        train_config=asdict(cfg),
                        cls_head=module.head.state_dict() if getattr(module, 'head', None) is not None else {})

    def nonfinite(step, what, value):
        last = f"the last good checkpoint {ckpt_path} was kept" if os.path.exists(ckpt_path) and cfg.save \
            else "no checkpoint was written"
        return NonFiniteLoss(
            f"non-finite {what} ({value}) at step {step}; stopped, {last}. Try a lower --lr (now {cfg.lr:g}), "
            f"--dtype float32 (now {dtype}), or a numerically stable feature map variant (e.g. hedgehog with its "
            f"default softmax over the feature dim, lolcats, or --attn softmax to check the setup).")

    tokens_per_step = cfg.batch_size * cfg.grad_accum * task.tokens_per_example
    log_f = open(log_path, 'a') if master else None
    t_start, cpu_start = time.time(), time.process_time()
    t_last, it_last = t_start, iter_num
    metrics = {}
    try:
        while iter_num < cfg.max_iters:
            lr = get_lr(cfg, iter_num)
            for g in optimizer.param_groups:
                g['lr'] = lr
            sel = task.draw(data_gen, cfg.grad_accum * cfg.batch_size)
            loss_sum = torch.zeros((), device=device)
            for m in range(local_accum):
                j = m * world + rank                     # this process's share of the global batch
                batch = task.batch(sel[j * cfg.batch_size:(j + 1) * cfg.batch_size], device)
                if ddp:
                    train_module.require_backward_grad_sync = (m == local_accum - 1)
                with ctx:
                    loss = _loss(train_module, task, batch) / local_accum
                scaler.scale(loss).backward()
                loss_sum += loss.detach()
            if ddp:
                dist.all_reduce(loss_sum)
                loss_sum /= world
            loss_val = loss_sum.item()
            if not math.isfinite(loss_val):
                raise nonfinite(iter_num, 'loss', loss_val)
            scaler.unscale_(optimizer)
            gnorm = torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else float('inf'))
            if not torch.isfinite(gnorm) and not scaler.is_enabled():
                raise nonfinite(iter_num, 'gradient norm', gnorm.item())
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            iter_num += 1
            if master:
                log_f.write(json.dumps({'iter': iter_num - 1, 'loss': loss_val, 'lr': lr}) + '\n')
            if master and verbose and (iter_num % cfg.log_interval == 0 or iter_num == cfg.max_iters):
                now = time.time()
                dt = (now - t_last) / max(iter_num - it_last, 1)
                eta = dt * (cfg.max_iters - iter_num)
                print(f"step {iter_num}/{cfg.max_iters} | loss {loss_val:.4f} | lr {lr:.2e} | "
                      f"{_fmt_rate(tokens_per_step / max(dt, 1e-9))} tok/s | eta {_fmt_time(eta)}", flush=True)
                t_last, it_last = now, iter_num
            if iter_num % cfg.eval_interval == 0 or iter_num == cfg.max_iters:
                if master:
                    log_f.flush()
                    est = estimate_loss(module, task, device, ctx, cfg.eval_iters, cfg.batch_size)
                    if not all(math.isfinite(v) for v in est.values()):
                        raise nonfinite(iter_num, 'evaluation loss', est)
                    say(f"eval step {iter_num}: " + ', '.join(f"{k} {v:.4f}" for k, v in est.items()))
                    save(iter_num)
                    metrics.update({f"last_eval_{k}": v for k, v in est.items()})
        train_time, cpu_time = time.time() - t_start, time.process_time() - cpu_start
        if master:
            log_f.close()
            log_f = None
            metrics.update(final_metrics(module, model, task, device, ctx, cfg.batch_size))
    except NonFiniteLoss as e:
        if log_f is not None:
            log_f.close()
        if ddp and dist.is_initialized():
            dist.destroy_process_group()
        raise SystemExitNonFinite(str(e)) from None
    if ddp:
        dist.barrier()
    summary = None
    if master:
        summary = {'config': asdict(cfg), 'model_config': asdict(model.config), 'metrics': metrics,
                   'iters': iter_num, 'train_time_s': round(train_time, 2), 'cpu_time_s': round(cpu_time, 2),
                   'n_params': model.get_num_params(), 'tokenizer': task.tokenizer, 'device': device,
                   'dtype': dtype, 'world_size': world, 'torch': torch.__version__}
        _write_json(os.path.join(cfg.out_dir, 'summary.json'), summary)
        say("final: " + ', '.join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                  for k, v in metrics.items() if not k.startswith('last_eval')))
        say(f"wrote {os.path.join(cfg.out_dir, 'summary.json')} ({_fmt_time(train_time)} training)")
    if ddp:
        dist.destroy_process_group()
    return summary


class SystemExitNonFinite(SystemExit):
    def __init__(self, msg):
        super().__init__(NONFINITE_EXIT)
        self.msg = msg


def compare_table(rows, task='ar'):
    """Markdown table of [(map spec, summary)]: the task metric, mean attention entropy, time."""
    metric = 'test_acc' if task in ('ar', 'mqar') else 'val_ppl' if task == 'text' else 'dev_main'
    lines = [f"| map | {metric} | mean attention entropy (all rows) | at query rows | final train loss | "
             "train time | CPU time |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for spec, s in rows:
        m = s['metrics']
        ent, entq = m.get('attn_entropy'), m.get('attn_entropy_query')
        lines.append(f"| {spec} | {m.get(metric, float('nan')):.4f} | "
                     f"{'' if ent is None else f'{ent:.3f}'} | {'' if entq is None else f'{entq:.3f}'} | "
                     f"{m.get('last_eval_train', float('nan')):.4f} | {_fmt_time(s['train_time_s'])} | "
                     f"{_fmt_time(s.get('cpu_time_s', 0))} |")
    return '\n'.join(lines)


def compare(cfg, explicit=frozenset()):
    """Train one model per map in cfg.compare (same config, budget and seeds) and print a markdown table of
    test accuracy and mean attention entropy. Each run goes to out_dir/<map>/; the table to out_dir/compare.md."""
    rows = []
    specs = [s.strip() for s in cfg.compare.split(',') if s.strip()]
    t0 = time.time()
    for spec in specs:
        sub = replace(cfg, attn=spec, compare='', out_dir=os.path.join(cfg.out_dir, spec.replace(':', '_').replace('=', '')))
        print(f"=== {spec} ===", flush=True)
        s = train(sub, set(explicit) | {'attn'})
        rows.append((spec, s))
    table = compare_table(rows, cfg.task)
    print(table)
    print(f"total {_fmt_time(time.time() - t0)}")
    with open(os.path.join(cfg.out_dir, 'compare.md'), 'w') as f:
        f.write(table + '\n')
    _write_json(os.path.join(cfg.out_dir, 'compare.json'),
                {'config': asdict(cfg), 'runs': {spec: s['metrics'] for spec, s in rows},
                 'times_s': {spec: s['train_time_s'] for spec, s in rows}})
    return rows


def main(argv=None):
    cfg, explicit = parse_args(argv)
    try:
        if cfg.compare:
            if _dist()[0]:
                raise SystemExit("error: --compare runs one process; launch it without torchrun")
            os.makedirs(cfg.out_dir, exist_ok=True)
            return compare(cfg, explicit)
        return train(cfg, explicit)
    except SystemExitNonFinite as e:
        print(f"error: {e.msg}", file=sys.stderr, flush=True)
        raise
    except ValueError as e:  # bad data paths, GLUE files, options: one clear line
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


if __name__ == '__main__':
    main()
