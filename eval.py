"""
Evaluate a model: perplexity, GLUE, ROUGE, attention fidelity (with pictures), and benchmarks.

One script, one flag per report; every report prints a table and writes <out_dir>/<report>.json.

    python eval.py --ckpt out --ppl --data ../shared/data/wikitext-2/test.txt --context 256 --stride 128
    python eval.py --ckpt out-cola --glue cola --data ../shared/data/cola
    python eval.py --ckpt out --rouge --data dialogues.jsonl --max_new_tokens 64
    python eval.py --ckpt out-convert --fidelity --data input.txt --layers 0,1 --heads 0,1 --maps elu,performer
    python eval.py --bench attention,decode --out_dir out/bench
    python eval.py --lln --out_dir out/lln                  # LLN Fig. 2 on Gaussian q, k (no model)

--ckpt is a train.py checkpoint (out_dir/ckpt.pt, or the out_dir), a convert.py output folder (manifest.json), a
Hugging Face folder, a llama.cpp .gguf file, or a hub name (model.GPT.from_pretrained). Text is encoded with the
model's own tokenizer (the one its checkpoint carries) or --tokenizer PATH. Matplotlib is optional: without it the
numbers still print and the JSON is written.
"""
import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from collections import Counter

import torch
import torch.nn.functional as F

import attention
import train

BENCH_CHOICES = ['attention', 'model', 'decode', 'kernels', 'all']
REPORTS = ['ppl', 'glue', 'rouge', 'generate', 'fidelity', 'bench', 'lln']

# The SAMSum prompt (Hedgehog, Listing 4): the llama-recipes SAMSum template -- instruction, the dialogue, a
# separator line and "Summary:"; the model continues with the summary and EOS. (Written from the llama-recipes
# template, which the paper's Llama-2 SAMSum runs use; not checked letter by letter against the paper's listing.)
SAMSUM_PROMPT = "Summarize this dialog:\n{dialogue}\n---\nSummary:\n"


class EvalError(Exception):
    """Bad input: reported as one line and a non-zero exit."""


def log(*a):
    print(*a, flush=True)


# -----------------------------------------------------------------------------------------------------------
# ROUGE (F-measure), written here; agrees with rouge-score's RougeScorer(use_stemmer=False) (tests check it).

_NON_ALNUM = re.compile(r'[^a-z0-9]+')
_VALID = re.compile(r'^[a-z0-9]+$')


def rouge_tokenize(text, stemmer=None):
    """rouge-score's default tokenizer: lowercase, non-alphanumerics -> spaces, split; optional stemming of
    tokens longer than 3 characters."""
    tokens = _NON_ALNUM.sub(' ', text.lower()).split()
    if stemmer is not None:
        tokens = [stemmer.stem(t) if len(t) > 3 else t for t in tokens]
    return [t for t in tokens if _VALID.match(t)]


def _prf(hits, n_pred, n_ref):
    p = hits / max(n_pred, 1)
    r = hits / max(n_ref, 1)
    f = 2 * p * r / (p + r) if p + r > 0 else 0.0
    return {'precision': p, 'recall': r, 'fmeasure': f}


def rouge_n(ref_tokens, pred_tokens, n):
    ref = Counter(tuple(ref_tokens[i:i + n]) for i in range(len(ref_tokens) - n + 1))
    pred = Counter(tuple(pred_tokens[i:i + n]) for i in range(len(pred_tokens) - n + 1))
    hits = sum(min(c, pred[g]) for g, c in ref.items())
    return _prf(hits, sum(pred.values()), sum(ref.values()))


def lcs_length(a, b):
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0] * (len(b) + 1)
        for j, y in enumerate(b, 1):
            cur[j] = prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1])
        prev = cur
    return prev[-1]


def rouge_l(ref_tokens, pred_tokens):
    """Sentence-level LCS ROUGE-L (rouge-score's 'rougeL')."""
    if not ref_tokens or not pred_tokens:
        return {'precision': 0.0, 'recall': 0.0, 'fmeasure': 0.0}
    return _prf(lcs_length(ref_tokens, pred_tokens), len(pred_tokens), len(ref_tokens))


def rouge_scores(reference, prediction, stemmer=None):
    """{'rouge1': {...}, 'rouge2': {...}, 'rougeL': {...}} with precision/recall/fmeasure each."""
    r, p = rouge_tokenize(reference, stemmer), rouge_tokenize(prediction, stemmer)
    return {'rouge1': rouge_n(r, p, 1), 'rouge2': rouge_n(r, p, 2), 'rougeL': rouge_l(r, p)}


def rouge_corpus(references, predictions, stemmer=None):
    """Mean per-example F-measure (x100) of ROUGE-1/2/L."""
    if len(references) != len(predictions) or not references:
        raise EvalError(f'need as many predictions as references (got {len(predictions)} and {len(references)})')
    tot = {'rouge1': 0.0, 'rouge2': 0.0, 'rougeL': 0.0}
    for ref, pred in zip(references, predictions):
        s = rouge_scores(ref, pred, stemmer)
        for key in tot:
            tot[key] += s[key]['fmeasure']
    return {key: 100.0 * v / len(references) for key, v in tot.items()}


# -----------------------------------------------------------------------------------------------------------
# model, tokenizer and data loading

def _is_hf_folder(path):
    cfg = os.path.join(path, 'config.json')
    if not (os.path.isdir(path) and os.path.isfile(cfg)):
        return False
    try:
        with open(cfg) as f:
            c = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(c, dict) and ('model_type' in c or 'architectures' in c)


def _find_checkpoint_file(folder):
    """Our checkpoint file inside a folder (train.py's output dir): ckpt.pt / *.safetensors / *.pt."""
    names = sorted(os.listdir(folder))
    for pref in ('ckpt.pt', 'ckpt.safetensors', 'model.safetensors', 'model.pt'):
        if pref in names:
            return os.path.join(folder, pref)
    cands = [n for n in names if n.endswith(('.pt', '.safetensors'))]
    if len(cands) == 1:
        return os.path.join(folder, cands[0])
    raise EvalError(f'--ckpt {folder}: no checkpoint file found (want ckpt.pt or one *.pt / *.safetensors, '
                    f'a convert.py folder with manifest.json, or a Hugging Face folder)')


def load_model(ckpt, device='cpu'):
    """(model, extra). --ckpt may be: one of our checkpoint files (model.save_checkpoint) or a folder holding
    one; a converted folder (manifest.json from convert.py or model.save_new_parameters); a Hugging Face
    folder; a llama.cpp .gguf file; or a hub name (model.GPT.from_pretrained)."""
    import model as model_lib
    if ckpt is None:
        raise EvalError('this report needs --ckpt (a checkpoint from train.py/convert.py, an HF folder or hub name)')
    extra = {}
    try:
        if os.path.isdir(ckpt) and os.path.isfile(os.path.join(ckpt, 'manifest.json')):
            with open(os.path.join(ckpt, 'manifest.json')) as f:
                fmt = json.load(f).get('format')
            if fmt == model_lib.CHECKPOINT_FORMAT:
                m = model_lib.load_new_parameters(ckpt)
            else:
                import convert
                m = convert.load_converted(ckpt, device)
        elif os.path.isdir(ckpt) and not _is_hf_folder(ckpt):
            m, extra = model_lib.load_checkpoint(_find_checkpoint_file(ckpt))
        elif os.path.isfile(ckpt) and ckpt.endswith('.gguf'):
            m = model_lib.GPT.from_pretrained(ckpt)
        elif os.path.isfile(ckpt):
            m, extra = model_lib.load_checkpoint(ckpt)
        else:
            m = model_lib.GPT.from_pretrained(ckpt)
    except EvalError:
        raise
    except Exception as e:  # noqa: BLE001 - one line for the user, whatever the loader raised
        msg = str(e).splitlines()[0][:300] if str(e) else ''
        raise EvalError(f'cannot load --ckpt {ckpt!r}: {type(e).__name__}: {msg}')
    m.to(device).eval()
    return m, (extra or {})


def load_tokenizer(model, path=None):
    """The tokenizer for `model`: --tokenizer PATH (a HF folder or .gguf file) if given, else the model's own
    (from its checkpoint, converted folder, HF folder or GGUF file), else the project tokenizer matching its
    vocab_size (byte 257, tiktoken gpt2 50257/50304). Anything else is an EvalError asking for --tokenizer.
    The result has encode(str) -> list[int], decode(ids), eos_id and name (tokenizer.py)."""
    import tokenizer as tokenizer_lib
    try:
        return tokenizer_lib.resolve(model, path)
    except (tokenizer_lib.TokenizerError, OSError) as e:
        raise EvalError(str(e).splitlines()[0])


def load_corpus_text(data, split='test'):
    """--data: a text file, a folder of .txt files, or a `datasets` name as train.load_text takes it
    ('wikitext:wikitext-103-raw-v1' = name:config, the default); split applies to `datasets` names."""
    data = data or 'wikitext:wikitext-103-raw-v1'
    try:
        text = train.load_text(data, split)
    except ValueError as e:
        raise EvalError(str(e))
    return text, data if os.path.exists(data) else f'{data} ({split})'


def describe_attention(model):
    """'softmax', 'hedgehog', or per-layer labels when the layers differ (a partial conversion)."""
    labels = [_map_label(c).replace(' (model)', '') for c in model.attention_cores()]
    if len(set(labels)) == 1:
        return labels[0]
    return ', '.join(f'L{i}:{a}' for i, a in enumerate(labels))


def _check_vocab(ids, model):
    v = model.config.vocab_size
    if ids and max(ids) >= v:
        raise EvalError(f'token id {max(ids)} >= model vocab_size {v}: tokenizer does not match the checkpoint')


# -----------------------------------------------------------------------------------------------------------
# perplexity

def ppl_windows(n_tokens, context, stride):
    """Sliding windows over the n_tokens-1 next-token predictions: (begin, end, n_new) with inputs
    ids[begin:end], targets ids[begin+1:end+1], of which only the last n_new are scored (each once)."""
    if stride < 1 or context < 1 or stride > context:
        raise EvalError(f'need 1 <= stride <= context (got context={context}, stride={stride})')
    m = n_tokens - 1
    out, prev = [], 0
    for b in range(0, max(m, 0), stride):
        e = min(b + context, m)
        if e > prev:
            out.append((b, e, e - prev))
        prev = e
        if e == m:
            break
    return out


@torch.no_grad()
def perplexity(model, ids, context, stride, device='cpu', batch_size=8):
    """Token-weighted mean NLL over every next-token prediction of ids, sliding window (HF style): each
    token is scored once, with up to context-1 tokens before it (at least context-stride after the first)."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    windows = ppl_windows(ids.numel(), context, stride)
    if not windows:
        raise EvalError('need at least 2 tokens of text for perplexity')
    total_nll, total = 0.0, 0
    i = 0
    while i < len(windows):
        length = windows[i][1] - windows[i][0]
        j = i + 1
        while j < len(windows) and j - i < batch_size and windows[j][1] - windows[j][0] == length:
            j += 1
        group = windows[i:j]
        x = torch.stack([ids[b:e] for b, e, _ in group])
        y = torch.stack([ids[b + 1:e + 1] for b, e, _ in group]).clone()
        for r, (_, _, n) in enumerate(group):
            y[r, :length - n] = -100
        _, loss = model(x.to(device), targets=y.to(device))
        count = sum(n for _, _, n in group)
        total_nll += float(loss) * count
        total += count
        i = j
    nll = total_nll / total
    return {'nll': nll, 'ppl': math.exp(nll), 'tokens_scored': total, 'windows': len(windows),
            'context': context, 'stride': stride}


def report_ppl(args):
    device = args.device
    model, _ = load_model(args.ckpt, device)
    if model.config.family == 'bert':
        raise EvalError('--ppl needs a causal model (family gpt2 or llama), got bert')
    tok = load_tokenizer(model, args.tokenizer)
    text, source = load_corpus_text(args.data, args.split)
    ids = tok.encode(text)
    if args.max_tokens:
        ids = ids[:args.max_tokens]
    _check_vocab(ids, model)
    context = args.context or min(model.config.block_size, 1024)
    if context > model.config.block_size:
        raise EvalError(f'--context {context} > model block_size {model.config.block_size}')
    stride = args.stride or max(context // 2, 1)
    log(f'tokenizer: {tok.name}; data: {source} ({len(ids):,} tokens); attention: {describe_attention(model)}')
    t0 = time.time()
    res = perplexity(model, ids, context, stride, device, args.batch_size)
    res.update(ckpt=args.ckpt, data=source, tokenizer=tok.name, attn=describe_attention(model),
               seconds=round(time.time() - t0, 2))
    log(f'perplexity {res["ppl"]:.3f} (mean NLL {res["nll"]:.4f} nats/token) over {res["tokens_scored"]:,} tokens, '
        f'context {context}, stride {stride}, {res["windows"]} windows, {res["seconds"]} s')
    return res


# -----------------------------------------------------------------------------------------------------------
# GLUE (data loading, encoding and metrics live in train.py; this runs a finetuned classifier on validation)

def report_glue(args):
    """A finetuned classifier (train.py --task glue) on the task's validation split, scored with
    train.glue_metric; data loading (train.load_glue), encoding (train.GlueEncoder) and the classifier
    wrapper (train.Classifier, with the saved head of a causal model) are train.py's."""
    try:
        task = train.glue_task_name(args.glue)
    except ValueError:
        raise EvalError(f'--glue {args.glue!r}: choose from {", ".join(train.GLUE_TASKS)}')
    model, extra = load_model(args.ckpt, args.device)
    tc = extra.get('train_config') or {}
    if tc.get('task') == 'glue' and tc.get('glue_task') and train.glue_task_name(tc['glue_task']) != task:
        raise EvalError(f'--ckpt was finetuned on {tc["glue_task"]}, not {task}')
    num_labels = train.glue_num_labels(task)
    module = train.Classifier(model, num_labels)
    if model.config.family == 'bert':
        if model.config.num_labels != num_labels:
            raise EvalError(f'{task} has {num_labels} label(s) but the checkpoint classifier has '
                            f'{model.config.num_labels}: not a {task} checkpoint')
    elif extra.get('cls_head'):
        module.head.load_state_dict(extra['cls_head'])
    else:
        raise EvalError('--ckpt has no classifier: want a bert checkpoint with num_labels > 0, or a train.py '
                        '--task glue checkpoint (its head is saved as cls_head)')
    module.to(args.device).eval()
    try:
        dev = train.load_glue(task, args.data, 'validation')
    except ValueError as e:
        raise EvalError(str(e))
    if args.limit:
        dev = dev[:args.limit]
    if not dev:
        raise EvalError(f'no labelled validation examples for {task} in {args.data}')
    enc = train.GlueEncoder(load_tokenizer(model, args.tokenizer), tc.get('seq_len') or model.config.block_size,
                            verbose=False)
    log(f'tokenizer: {enc.name}; GLUE {task} validation: {len(dev)} examples from {args.data or "datasets"}')
    preds, labels = predict_glue(module, enc, dev, num_labels, args.device, args.batch_size)
    metrics = train.glue_metric(task, preds, labels)
    log(f'GLUE {task} validation ({len(labels)} examples): ' +
        ', '.join(f'{k} {v:.4f}' for k, v in metrics.items()))
    return {'task': task, 'split': 'validation', 'examples': len(labels), 'ckpt': args.ckpt,
            'data': args.data or 'datasets glue', 'tokenizer': enc.name, 'attn': describe_attention(model),
            'metrics': metrics}


@torch.no_grad()
def predict_glue(module, enc, examples, num_labels, device='cpu', batch_size=32):
    """Predicted classes (or regression values) and labels for [(text_a, text_b, label)]."""
    preds, labels = [], []
    for i in range(0, len(examples), batch_size):
        batch = examples[i:i + batch_size]
        idx, mask, tt, lab = train.collate_glue([enc.encode(a, b) for a, b, _ in batch], [y for _, _, y in batch])
        logits, _ = module(idx.to(device), mask.to(device), tt.to(device))
        if num_labels == 1:
            preds += logits.view(-1).float().cpu().tolist()
        else:
            preds += logits.argmax(-1).cpu().tolist()
        labels += lab.tolist()
    return preds, labels


# -----------------------------------------------------------------------------------------------------------
# ROUGE on generated summaries

def load_summaries(data, split='test', limit=0):
    """[(dialogue, summary)] from a JSONL of {dialogue, summary}, or a `datasets` name (default samsum)."""
    rows = []
    if data and os.path.isfile(data):
        with open(data, encoding='utf-8') as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    r = json.loads(line)
                    if 'dialogue' not in r or 'summary' not in r:
                        raise EvalError(f'{data}:{n}: each line needs "dialogue" and "summary" keys')
                    rows.append((r['dialogue'], r['summary']))
        source = data
    elif data and (os.sep in data or data.endswith(('.jsonl', '.json'))):
        raise EvalError(f'--data {data!r}: no such file (want a JSONL of {{"dialogue", "summary"}})')
    else:
        name = data or 'samsum'
        try:
            import datasets
            ds = datasets.load_dataset(name, split=split)
        except Exception as e:  # noqa: BLE001
            raise EvalError(f'cannot load dataset {name} ({split}) with datasets ({type(e).__name__}); offline? '
                            f'pass --data FILE.jsonl')
        rows = list(zip(ds['dialogue'], ds['summary']))
        source = f'{name} ({split})'
    return (rows[:limit] if limit else rows), source


@torch.no_grad()
def summarize(model, tok, dialogue, max_new_tokens, device='cpu'):
    prompt_ids = tok.encode(SAMSUM_PROMPT.format(dialogue=dialogue.strip('\n')))
    room = model.config.block_size - max_new_tokens
    if room < 1:
        raise EvalError(f'--max_new_tokens {max_new_tokens} leaves no room in block_size {model.config.block_size}')
    prompt_ids = prompt_ids[-room:]  # keep the end ("...---\nSummary:\n") if the dialogue is too long
    _check_vocab(prompt_ids, model)
    idx = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    out = model.generate(idx, max_new_tokens, temperature=0.0, eos_token_id=tok.eos_id)
    new = out[0, len(prompt_ids):].tolist()
    if tok.eos_id is not None and tok.eos_id in new:
        new = new[:new.index(tok.eos_id)]
    return tok.decode(new).strip()


def report_rouge(args):
    model, _ = load_model(args.ckpt, args.device)
    if model.config.family == 'bert':
        raise EvalError('--rouge needs a causal model (family gpt2 or llama), got bert')
    tok = load_tokenizer(model, args.tokenizer)
    rows, source = load_summaries(args.data, args.split, args.limit)
    if not rows:
        raise EvalError(f'no examples in {source}')
    log(f'tokenizer: {tok.name}; data: {source} ({len(rows)} dialogues); greedy, up to {args.max_new_tokens} '
        f'new tokens, stop at EOS ({tok.eos_id})')
    t0 = time.time()
    preds = [summarize(model, tok, d, args.max_new_tokens, args.device) for d, _ in rows]
    refs = [s for _, s in rows]
    scores = rouge_corpus(refs, preds)
    res = {'data': source, 'examples': len(rows), 'ckpt': args.ckpt, 'attn': describe_attention(model),
           'max_new_tokens': args.max_new_tokens, 'prompt_template': SAMSUM_PROMPT, 'scores': scores,
           'samples': [{'summary': s, 'generated': p} for s, p in list(zip(refs, preds))[:5]],
           'seconds': round(time.time() - t0, 2)}
    log('ROUGE F-measure (x100): ' + ', '.join(f'{k} {v:.2f}' for k, v in scores.items()))
    if preds:
        log(f'example: reference {refs[0]!r}\n         generated {preds[0]!r}')
    return res


# -----------------------------------------------------------------------------------------------------------
# generation: the model next to its softmax teacher

DEFAULT_PROMPTS = ('The capital of France is Paris. The capital of Germany is',
                   'Water boils at a temperature of',
                   'Once upon a time, in a small village,')


def _teacher_of(ckpt, model, device):
    """The softmax model a checkpoint was converted from: a convert.py folder's base model (without its LoRA
    adapters); None for a model that is softmax already or that names no base."""
    if all(c.kind == 'softmax' for c in model.attention_cores()):
        return None
    path = os.path.join(ckpt, 'manifest.json') if os.path.isdir(ckpt) else None
    if not path or not os.path.isfile(path):
        return None
    with open(path) as f:
        base = json.load(f).get('base_model')
    return load_model(base, device)[0] if base else None


@torch.no_grad()
def _greedy(model, ids, max_new_tokens, eos_id, device):
    x = torch.tensor([ids], dtype=torch.long, device=device)
    t0 = time.perf_counter()
    out = model.generate(x, max_new_tokens, temperature=0.0, eos_token_id=eos_id)
    return out[0, len(ids):].tolist(), time.perf_counter() - t0


def report_generate(args):
    """Greedy continuations of the same prompts by the model and, for a convert.py folder, by the softmax model it
    was converted from. Prompts: --prompt (repeatable); else from --data: with --prompt_tokens N, --n_prompts
    passages of N tokens at evenly spaced offsets (long prompts, so that a window hybrid's linear part is used),
    otherwise one prompt per line; else three built-in ones."""
    model, _ = load_model(args.ckpt, args.device)
    if model.config.family == 'bert':
        raise EvalError('--generate needs a causal model (family gpt2 or llama), got bert')
    tok = load_tokenizer(model, args.tokenizer)
    if args.prompt:
        prompts = list(args.prompt)
    elif args.data and args.prompt_tokens > 0:
        ids = tok.encode(load_corpus_text(args.data, args.split)[0])
        n, L = max(args.n_prompts, 1), args.prompt_tokens
        if len(ids) < L:
            raise EvalError(f'--data has {len(ids)} tokens, fewer than --prompt_tokens {L}')
        prompts = [tok.decode(ids[o:o + L]) for o in range(0, len(ids) - L + 1, max((len(ids) - L) // n, 1))][:n]
    elif args.data:
        prompts = [p for p in load_corpus_text(args.data, args.split)[0].splitlines() if p.strip()]
    else:
        prompts = list(DEFAULT_PROMPTS)
    teacher = _teacher_of(args.ckpt, model, args.device)
    runs = [(describe_attention(model), model)] + ([('softmax teacher', teacher)] if teacher is not None else [])
    log(f'tokenizer: {tok.name}; greedy, {args.max_new_tokens} new tokens (stop at EOS {tok.eos_id}); '
        f'{" vs ".join(n for n, _ in runs)}')
    rows = []
    for p in prompts:
        ids = tok.encode(p)
        _check_vocab(ids, model)
        row = {'prompt': p}
        log(f'\nprompt: {p!r}')
        for name, m in runs:
            new, sec = _greedy(m, ids, args.max_new_tokens, tok.eos_id, args.device)
            row[name] = {'text': tok.decode(new), 'tokens': len(new), 'seconds': round(sec, 3)}
            log(f'  {name:>20s}: {tok.decode(new)!r}  ({len(new)} tokens, {len(new) / sec:.1f} tok/s)')
        rows.append(row)
    return {'ckpt': args.ckpt, 'tokenizer': tok.name, 'max_new_tokens': args.max_new_tokens,
            'models': [n for n, _ in runs], 'samples': rows}


# -----------------------------------------------------------------------------------------------------------
# attention fidelity

def _parse_ints(s, what):
    if not s:
        return None
    try:
        return [int(x) for x in s.split(',') if x.strip()]
    except ValueError:
        raise EvalError(f'--{what} wants comma-separated integers, got {s!r}')


def parse_maps(s):
    if not s:
        return []
    maps = [m.strip() for m in s.split(',') if m.strip()]
    bad = [m for m in maps if m not in attention.FEATURE_MAPS]
    if bad:
        raise EvalError(f'unknown map(s) {", ".join(bad)}: choose from {", ".join(attention.FEATURE_MAPS)}')
    return maps


def parse_map_specs(s):
    """--maps for fidelity: names with optional options as train.py takes them ('exp:t=2') -> [(label, name,
    options)], the label being the spec as written."""
    specs = [m.strip() for m in s.split(',') if m.strip()] if s else []
    parse_maps(','.join(m.partition(':')[0] for m in specs))   # unknown names: the one-line error above
    out = []
    for spec in specs:
        try:
            name, opts = train.parse_attn_spec(spec)
        except ValueError as e:
            raise EvalError(f'--maps {spec!r}: {e}')
        out.append((spec, name, opts))
    return out


@torch.no_grad()
def capture_qk(model, idx, teacher=False):
    """q, k (after RoPE, GQA already repeated) that each layer's attention core receives on idx. teacher=True:
    from the softmax teacher's forward pass (every core in teacher mode, exact softmax), so a converted layer is
    compared on the teacher's own inputs (teacher forcing, as convert.py measures it)."""
    store = {}
    hooks = []
    modes = [c.teacher for c in model.attention_cores()]
    for i, core in enumerate(model.attention_cores()):
        core.teacher = modes[i] or teacher
        def pre(mod, args, kwargs, i=i):
            q = args[0] if len(args) > 0 else kwargs['q']
            k = args[1] if len(args) > 1 else kwargs['k']
            store[i] = (q.detach().float().cpu(), k.detach().float().cpu())
        hooks.append(core.register_forward_pre_hook(pre, with_kwargs=True))
    try:
        if model.config.family == 'bert':
            model.encode(idx)
        else:
            model(idx)
    finally:
        for h, core, mode in zip(hooks, model.attention_cores(), modes):
            h.remove()
            core.teacher = mode
    return [store[i] for i in sorted(store)]


@torch.no_grad()
def student_weights(core, q, k):
    """The attention matrix a (possibly converted) core uses, with teacher mode switched off."""
    teacher = getattr(core, 'teacher', False)
    try:
        core.teacher = False
        return core.weights(q, k).float()
    finally:
        core.teacher = teacher


@torch.no_grad()
def fidelity_stats(q, k, maps, causal=True):
    """maps: {name: callable(q, k) -> weights}. Per head: KL(teacher || map), entropies, monotonicity."""
    w_t = attention.softmax_weights(q, k, causal=causal).float()
    H = q.shape[1]
    ent_t = attention.attention_entropy(w_t).mean(dim=(0, 2))
    mono_t = attention.monotonicity(w_t, q, k, causal=causal)[0].float().mean(0)
    heads = [{'head': h, 'softmax': {'entropy': float(ent_t[h]), 'monotonicity': float(mono_t[h])}, 'maps': {}}
             for h in range(H)]
    weights = {'softmax': w_t}
    for name, fn in maps.items():
        w = fn(q, k).float()
        weights[name] = w
        kl = attention.kl_divergence(w_t, w).mean(dim=(0, 2))
        ent = attention.attention_entropy(w).mean(dim=(0, 2))
        mono = attention.monotonicity(w, q, k, causal=causal)[0].float().mean(0)
        for h in range(H):
            heads[h]['maps'][name] = {'kl': float(kl[h]), 'entropy': float(ent[h]), 'monotonicity': float(mono[h])}
    return heads, weights


def _map_label(core):
    label = core.attn
    if getattr(core, 'window', 0):
        label += f'+window{core.window}'
    if getattr(core, 'diag_block', 0):
        label += f'+diag{core.diag_block}'
    return label + ' (model)'


def fidelity_windows(tok, ids, context, n_samples, bert=False):
    """(n, context) windows of consecutive token ids. A BERT sees text framed as in its training, [CLS] text
    [SEP] (the tokenizer's single-sentence classifier input): each window is [CLS] + context - 2 tokens + [SEP]."""
    pre, suf = [], []
    if bert:
        frame = tok.encode_pair('', None, context)[0]   # [CLS] [SEP]
        pre, suf = frame[:1], frame[1:]
    body = context - len(pre) - len(suf)
    ids = ids[:body * n_samples]
    n = len(ids) // body
    if n < 1:
        raise EvalError(f'need at least --context={context} tokens of text' + (' (with [CLS] and [SEP])' if bert
                        else '') + f', got {len(ids)}')
    return torch.tensor([pre + ids[i * body:(i + 1) * body] + suf for i in range(n)], dtype=torch.long)


def report_fidelity(args):
    import model as model_lib
    extra_maps = parse_map_specs(args.maps)
    model, _ = load_model(args.ckpt, args.device)
    cfg = model.config
    tok = load_tokenizer(model, args.tokenizer)
    text, source = load_corpus_text(args.data, args.split)
    context = args.context or min(cfg.block_size, 128)
    if context > cfg.block_size:
        raise EvalError(f'--context {context} > model block_size {cfg.block_size}')
    ids = tok.encode(text)[:context * args.n_samples]
    _check_vocab(ids, model)
    idx = fidelity_windows(tok, ids, context, args.n_samples, bert=cfg.family == 'bert').to(args.device)
    n = idx.shape[0]
    cores = model.attention_cores()
    own = [c for c in cores if c.attn != 'softmax']
    if not own and not extra_maps:
        extra_maps = [(m, m, {}) for m in ('elu', 'performer', 'cosformer', 'taylor', 'hedgehog')]
    log(f'tokenizer: {tok.name}; data: {source}; {n} x {context} tokens; model attention: {describe_attention(model)}; '
        f'q, k from the {args.qk}; compared maps: {", ".join(m[0] for m in extra_maps) if extra_maps else "-"}')
    qk = capture_qk(model, idx, teacher=args.qk == 'teacher')
    torch.manual_seed(args.seed)
    layers, per_layer_weights = [], []
    for li, (core, (q, k)) in enumerate(zip(cores, qk)):
        causal = getattr(core, 'causal', cfg.family != 'bert')
        H, D = q.shape[1], q.shape[-1]
        fns = {}
        if core.attn != 'softmax':
            dev = args.device
            fns[_map_label(core)] = lambda q_, k_, c=core, d=dev: student_weights(c, q_.to(d), k_.to(d)).cpu()
        for label, name, opts in extra_maps:
            c = attention.Attention(name, D, H, causal=causal, **model_lib.map_options(cfg, name, opts))
            fns[label + ' (untrained)'] = lambda q_, k_, c=c: c.weights(q_, k_)
        heads, weights = fidelity_stats(q, k, fns, causal=causal)
        layers.append({'layer': li, 'attn': core.attn, 'heads': heads})
        per_layer_weights.append({name: w[0] for name, w in weights.items()})  # first sample only, for figures
    summary = summarize_fidelity(layers)
    print_fidelity(layers, summary)
    res = {'ckpt': args.ckpt, 'data': source, 'samples': n, 'context': context, 'attn': describe_attention(model),
           'qk': args.qk, 'maps': list(summary), 'summary': summary, 'layers': layers, 'figures': []}
    res['figures'] = fidelity_figures(args, qk, per_layer_weights, layers, cores)
    return res


def summarize_fidelity(layers):
    """{map: {metric_per_layer: [mean over heads or None where the layer lacks the map], metric_mean}}."""
    names = ['softmax'] + list(dict.fromkeys(n for layer in layers for n in layer['heads'][0]['maps']))
    summary = {}
    for name in names:
        keys = ('entropy', 'monotonicity') if name == 'softmax' else ('kl', 'entropy', 'monotonicity')
        d = {}
        for key in keys:
            per = []
            for layer in layers:
                src = [h['softmax'] if name == 'softmax' else h['maps'].get(name) for h in layer['heads']]
                per.append(None if src[0] is None else sum(x[key] for x in src) / len(src))
            vals = [v for v in per if v is not None]
            d[f'{key}_per_layer'] = per
            d[f'{key}_mean'] = sum(vals) / len(vals)
        summary[name] = d
    return summary


def print_fidelity(layers, summary):
    names = list(summary)
    log(f'{"map":32s} {"KL(softmax||map)":>16s} {"entropy":>9s} {"monotonicity":>12s}   (means over layers, heads, rows)')
    for name in names:
        s = summary[name]
        kl = f'{s["kl_mean"]:.4f}' if 'kl_mean' in s else '-'
        log(f'{name:32s} {kl:>16s} {s["entropy_mean"]:9.3f} {s["monotonicity_mean"]:12.3f}')
    log('per layer: KL(softmax||map) / entropy (nats), mean over heads')
    for li in range(len(layers)):
        parts = [f'softmax H {summary["softmax"]["entropy_per_layer"][li]:.3f}']
        for name in names[1:]:
            s = summary[name]
            if s['kl_per_layer'][li] is not None:
                parts.append(f'{name.split(" (")[0]} {s["kl_per_layer"][li]:.3f} / {s["entropy_per_layer"][li]:.3f}')
        log(f'  layer {li}: ' + '; '.join(parts))


def _matplotlib():
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None


def _save_figure(fig, out_dir, name, dpi):
    """Lay out, write out_dir/name as PNG, close; returns the path."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def fidelity_figures(args, qk, per_layer_weights, layers, cores):
    plt = _matplotlib()
    if plt is None:
        log('matplotlib not installed: no figures (numbers are in the JSON)')
        return []
    from matplotlib.colors import PowerNorm
    os.makedirs(args.out_dir, exist_ok=True)
    n_layer, H = len(layers), len(layers[0]['heads'])
    sel_layers = _parse_ints(args.layers, 'layers') or sorted({0, n_layer - 1})
    sel_heads = _parse_ints(args.heads, 'heads') or list(range(min(2, H)))
    bad = [x for x in sel_layers if not 0 <= x < n_layer] + [x for x in sel_heads if not 0 <= x < H]
    if bad:
        raise EvalError(f'--layers must be in 0..{n_layer - 1} and --heads in 0..{H - 1} (got {bad})')
    names = list(dict.fromkeys(n for li in sel_layers for n in per_layer_weights[li]))
    T = min(args.fig_tokens, per_layer_weights[0]['softmax'].shape[-1])
    files = []

    # 1. heatmaps, softmax vs each map side by side (Hedgehog Fig. 7/9)
    pairs = [(li, h) for li in sel_layers for h in sel_heads][:6]
    fig, axes = plt.subplots(len(pairs), len(names), figsize=(2.3 * len(names), 2.3 * len(pairs)), squeeze=False)
    for r, (li, h) in enumerate(pairs):
        vmax = float(per_layer_weights[li]['softmax'][h, :T, :T].max())
        for c, name in enumerate(names):
            ax = axes[r][c]
            if name not in per_layer_weights[li]:  # a layer the conversion left as softmax
                ax.axis('off')
                continue
            w = per_layer_weights[li][name][h, :T, :T].numpy()
            ax.imshow(w, cmap='viridis', norm=PowerNorm(0.5, vmin=0, vmax=max(vmax, 1e-6)), interpolation='nearest')
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(name.replace(' (', '\n('), fontsize=8)
            if c == 0:
                ax.set_ylabel(f'layer {li} head {h}', fontsize=8)
            if name != 'softmax':
                kl = layers[li]['heads'][h]['maps'][name]['kl']
                ax.set_xlabel(f'KL {kl:.3f}', fontsize=7)
    fig.suptitle(f'attention weights, first {T} tokens of sample 0 (colour: sqrt scale, shared per row); '
                 f'KL(softmax || map) of the head over all rows and samples', fontsize=9)
    path = _save_figure(fig, args.out_dir, 'fidelity_heatmaps.png', args.dpi)
    files.append(path)

    # 2. weight vs q.k scatter for the first selected layer/head (Hedgehog Fig. 3): the last query rows
    # (each sees about T keys, so their weights are comparable), rho = monotonicity over all rows
    li, h = pairs[0]
    q, k = qk[li][0][:1, h:h + 1], qk[li][1][:1, h:h + 1]
    causal = getattr(cores[li], 'causal', True)
    Tq = q.shape[-2]
    rows = list(range(max(Tq - args.scatter_rows, 0), Tq))
    scores = (q[0, 0, rows].double() @ k[0, 0].double().T) * q.shape[-1] ** -0.5  # (R, T)
    vis = torch.ones_like(scores, dtype=torch.bool)
    if causal:
        vis = torch.arange(Tq)[None, :] <= torch.tensor(rows)[:, None]
    names = list(per_layer_weights[li])
    fig, axes = plt.subplots(1, len(names), figsize=(2.6 * len(names), 2.6), squeeze=False)
    for c, name in enumerate(names):
        w_full = per_layer_weights[li][name][h]  # (T, T)
        rho = attention.monotonicity(w_full[None, None], q, k, causal=causal)[0]
        ax = axes[0][c]
        ax.scatter(scores[vis].numpy(), w_full[rows][vis].numpy(), s=3, alpha=0.5, color=f'C{c % 10}')
        ax.set_title(f'{name.replace(" (", chr(10) + "(")}\nrho {float(rho.mean()):.2f}', fontsize=8)
        ax.set_xlabel('q.k / sqrt(d)', fontsize=8)
        if c == 0:
            ax.set_ylabel('attention weight', fontsize=8)
        ax.tick_params(labelsize=6)
        ax.locator_params(axis='x', nbins=4)
    fig.suptitle(f'weight vs q.k, layer {li} head {h}, last {len(rows)} query rows', fontsize=9)
    path = _save_figure(fig, args.out_dir, 'fidelity_scatter.png', args.dpi)
    files.append(path)

    # 3. entropy (and KL) per layer
    summary = summarize_fidelity(layers)
    has_kl = any('kl_per_layer' in s for s in summary.values())
    fig, axes = plt.subplots(1, 2 if has_kl else 1, figsize=(9 if has_kl else 4.5, 3.2), squeeze=False)
    x = list(range(n_layer))
    for c, name in enumerate(summary):   # softmax black; past 10 maps the colours repeat, dashed
        style = {'color': 'k', 'linewidth': 2} if name == 'softmax' else \
            {'color': f'C{(c - 1) % 10}', 'linestyle': '-' if c <= 10 else '--'}
        ent = summary[name]['entropy_per_layer']
        xs = [i for i in x if ent[i] is not None]
        axes[0][0].plot(xs, [ent[i] for i in xs], marker='o', label=name, **style)
        if has_kl and 'kl_per_layer' in summary[name]:
            kl = summary[name]['kl_per_layer']
            axes[0][1].plot(xs, [max(kl[i], 1e-8) for i in xs], marker='o', label=name, **style)
    axes[0][0].set_title('attention entropy (nats, mean over heads/rows)', fontsize=9)
    axes[0][0].set_xlabel('layer')
    axes[0][0].legend(fontsize=7)
    if has_kl:
        axes[0][1].set_title('KL(softmax || map) per layer', fontsize=9)
        axes[0][1].set_xlabel('layer')
        axes[0][1].set_yscale('log')
    for ax in axes[0]:
        ax.set_xticks(x)
    path = _save_figure(fig, args.out_dir, 'fidelity_entropy.png', args.dpi)
    files.append(path)
    for p in files:
        log(f'wrote {p}')
    return files


# -----------------------------------------------------------------------------------------------------------
# LLN Fig. 2: does moment matching make LLN concentrate like softmax?

# (label, attention name, map options): the curves of LLN Fig. 2 plus the LLN temperature choices and baselines
LLN_FIG2_METHODS = [('softmax', 'softmax', {}), ('lln paper', 'lln', {'match': 'paper'}),
                    ('lln kernel', 'lln', {'match': 'kernel'}), ('lln entropy', 'lln', {'match': 'entropy'}),
                    ('lln none', 'lln', {'match': 'none'}), ('elu', 'elu', {}), ('relu', 'relu', {})]


def _parse_floats(s, what):
    try:
        vals = [float(x) for x in s.split(',') if x.strip()]
    except ValueError:
        raise EvalError(f'--{what} wants comma-separated numbers, got {s!r}')
    if not vals or any(not v > 0 for v in vals):
        raise EvalError(f'--{what} wants positive numbers, got {s!r}')
    return vals


@torch.no_grad()
def lln_fig2(head_dim=64, tokens=256, grid=(1.0, 2.0, 4.0), seeds=3, seed=0):
    """Row entropy (bits) and spectral gap of bidirectional attention matrices against the softmax temperature
    sigma^2 = sigma_q^2 sigma_k^2 (LLN Fig. 2): q, k ~ N(0, sqrt(sigma^2) I_D), so sigma_q^2 = sigma_k^2 = sigma;
    `seeds` independent sequences (the same unit draws, rescaled, at every sigma^2; generator seed 1000 + seed, so
    they are not the samples the LLN fits were made on). LLN maps are calibrated on the q, k they are applied to.
    Returns {label: {'entropy_bits', 'entropy_std', 'spectral_gap', 'spectral_gap_std', 'alpha'}}, one value per
    sigma^2: mean (std) over sequences of the per-sequence value (entropy: its mean over rows)."""
    g = torch.Generator().manual_seed(1000 + seed)
    q0 = torch.randn(seeds, 1, tokens, head_dim, generator=g, dtype=torch.float64)
    k0 = torch.randn(seeds, 1, tokens, head_dim, generator=g, dtype=torch.float64)
    res = {label: {'entropy_bits': [], 'entropy_std': [], 'spectral_gap': [], 'spectral_gap_std': [], 'alpha': []}
           for label, _, _ in LLN_FIG2_METHODS}
    for s2 in grid:
        q, k = q0 * s2 ** 0.25, k0 * s2 ** 0.25
        for label, name, opts in LLN_FIG2_METHODS:
            core = attention.Attention(name, head_dim, 1, causal=False, **opts)
            if name == 'lln':
                core.fmap.calibrate(q, k)
                res[label]['alpha'].append(core.fmap.alpha_beta()[0].item())
            w = core.weights(q, k).double()
            ent = attention.attention_entropy(w).mean(dim=(1, 2)) / math.log(2)  # (seeds,) bits
            gap = attention.spectral_gap(w)[:, 0]  # (seeds,)
            res[label]['entropy_bits'].append(ent.mean().item())
            res[label]['entropy_std'].append(ent.std().item() if seeds > 1 else 0.0)
            res[label]['spectral_gap'].append(gap.mean().item())
            res[label]['spectral_gap_std'].append(gap.std().item() if seeds > 1 else 0.0)
    return {label: {key: v for key, v in d.items() if v} for label, d in res.items()}


def lln_entropy_error(curves, grid, lo=1.0, hi=4.0):
    """{label: max over sigma^2 in [lo, hi] of |entropy - softmax's entropy|} in bits (None if no point there)."""
    idx = [i for i, s2 in enumerate(grid) if lo <= s2 <= hi]
    ref = curves['softmax']['entropy_bits']
    return {label: (max(abs(d['entropy_bits'][i] - ref[i]) for i in idx) if idx else None)
            for label, d in curves.items() if label != 'softmax'}


def report_lln(args):
    grid = _parse_floats(args.lln_grid, 'lln_grid')
    if args.lln_head_dim < 1 or args.lln_tokens < 2 or args.lln_seeds < 1:
        raise EvalError(f'--lln_head_dim >= 1, --lln_tokens >= 2 and --lln_seeds >= 1 please, got '
                        f'{args.lln_head_dim}, {args.lln_tokens}, {args.lln_seeds}')
    D, T = args.lln_head_dim, args.lln_tokens
    fits = {m: attention.lln_fit(D, m) for m in ('paper', 'kernel')}
    log(f'LLN Fig. 2 on Gaussian q, k: head_dim {D}, {T} tokens, bidirectional, {args.lln_seeds} sequences; '
        f'sigma^2 = sigma_q^2 sigma_k^2 with sigma_q^2 = sigma_k^2')
    log('  fits a s~^2 + b: ' + '; '.join(f'{m} a = {a:.4f} b = {b:+.4f}' for m, (a, b) in fits.items())
        + '  (paper, published for D = 64: a = 0.1486 b = -0.3549)')
    curves = lln_fig2(D, T, grid, args.lln_seeds, args.seed)
    err = lln_entropy_error(curves, grid)
    labels = list(curves)
    for key, title in (('entropy_bits', 'row entropy (bits)'), ('spectral_gap', 'spectral gap 1 - |lambda_2|')):
        log(f'{title}, mean over {args.lln_seeds} sequences')
        log(f'{"sigma^2":>8s} ' + ' '.join(f'{lab:>11s}' for lab in labels))
        for i, s2 in enumerate(grid):
            log(f'{s2:8.3g} ' + ' '.join(f'{curves[lab][key][i]:11.3f}' for lab in labels))
    log('LLN alpha = beta per sigma^2: ' + '; '.join(
        f'{lab} ' + ' '.join(f'{a:.2f}' for a in curves[lab]['alpha']) for lab in labels if 'alpha' in curves[lab]))
    log('max |entropy - softmax entropy| over sigma^2 in [1, 4] (bits): ' + ', '.join(
        f'{lab} {e:.2f}' for lab, e in err.items() if e is not None))
    res = {'head_dim': D, 'tokens': T, 'seeds': args.lln_seeds, 'seed': args.seed, 'grid_sigma2': grid,
           'fits': {m: {'a': a, 'b': b} for m, (a, b) in fits.items()}, 'curves': curves,
           'max_entropy_error_1_4': err, 'figures': []}
    res['figures'] = lln_figure(args, grid, curves)
    return res


def lln_figure(args, grid, curves):
    plt = _matplotlib()
    if plt is None:
        log('matplotlib not installed: no figure (numbers are in the JSON)')
        return []
    os.makedirs(args.out_dir, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for label, d in curves.items():
        style = dict(color='k', lw=2.5) if label == 'softmax' else dict(ls='--' if label in ('elu', 'relu') else '-')
        axes[0].plot(grid, d['entropy_bits'], marker='o', ms=3, label=label, **style)
        axes[1].plot(grid, d['spectral_gap'], marker='o', ms=3, label=label, **style)
    axes[0].set_ylabel('row entropy (bits)')
    axes[1].set_ylabel('spectral gap 1 - |lambda_2|')
    for ax in axes:
        ax.set_xlabel('temperature sigma^2 = sigma_q^2 sigma_k^2')
        ax.axvspan(1, 4, color='0.92', zorder=0)
    axes[0].legend(fontsize=7)
    fig.suptitle(f'LLN Fig. 2 on Gaussian q, k (head_dim {args.lln_head_dim}, {args.lln_tokens} tokens, '
                 f'bidirectional)', fontsize=9)
    path = _save_figure(fig, args.out_dir, 'lln.png', args.dpi)
    log(f'wrote {path}')
    return [path]


# -----------------------------------------------------------------------------------------------------------
# benchmarks

def _sync(device):
    if torch.device(device).type == 'cuda':
        torch.cuda.synchronize()


def time_fn(fn, device, warmup=1, repeats=3):
    """Median wall-clock seconds of fn() after warm-up (CUDA synchronized), and all timings."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def _dtype(device):
    return torch.float16 if torch.device(device).type == 'cuda' else torch.float32


@torch.no_grad()
def bench_attention(T_list, maps, device, B=1, H=12, D=64, warmup=1, repeats=3):
    """One attention layer's core on random q, k, v (B, H, T, D): softmax (SDPA) vs linear (chunked; and the
    Triton kernel on CUDA). Time and peak memory per sequence length."""
    import kernels  # lazily: PeakMemory etc.; importing triton early would break the interpreter tests
    rows = []
    dt = _dtype(device)
    methods = [('softmax', 'sdpa', None)] + [(m, 'chunked', None) for m in maps]
    if torch.device(device).type == 'cuda':
        methods += [(m, 'triton', kernels) for m in maps]
    for T in T_list:
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(B, H, T, D, device=device, dtype=dt, generator=gen) for _ in range(3))
        for name, impl, kern in methods:
            if name == 'softmax':
                def fn():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                core = attention.Attention(name, D, H, impl='chunked').to(device)
                if kern is None:
                    def fn(core=core):
                        return core(q, k, v)
                else:
                    def fn(core=core, kern=kern):
                        pq, pk = core.fmap(q, k)
                        return kern.causal_linear_attention(pq, pk, v)
            with kernels.PeakMemory(device) as pm:
                fn()
            med, times = time_fn(fn, device, warmup, repeats)
            rows.append({'T': T, 'attn': name, 'impl': impl, 'ms': med * 1e3, 'times_ms': [t * 1e3 for t in times],
                         'peak_mem_mb': None if pm.peak is None else pm.peak / 2**20, 'mem_method': pm.method})
            log(f'  attention T={T:6d} {name:9s} {impl:8s} {med * 1e3:9.2f} ms  '
                f'peak +{rows[-1]["peak_mem_mb"] or 0:8.1f} MB')
        del q, k, v
    return rows


def bench_model_config(attn, block_size, n_layer=2, n_head=12, n_embd=768, vocab_size=256):
    import model as model_lib
    return model_lib.GPTConfig(family='gpt2', vocab_size=vocab_size, block_size=block_size, n_layer=n_layer,
                               n_head=n_head, n_embd=n_embd, attn=attn)


@torch.no_grad()
def bench_prefill(T_list, maps, device, n_layer=2, n_head=12, n_embd=768, warmup=1, repeats=3):
    """Whole-model prefill (one forward over T tokens) on a small random GPT."""
    import kernels  # lazily: PeakMemory etc.; importing triton early would break the interpreter tests
    import model as model_lib
    rows = []
    for name in ['softmax'] + list(maps):
        torch.manual_seed(0)
        m = model_lib.GPT(bench_model_config(name, max(T_list), n_layer, n_head, n_embd)).to(device).eval()
        for T in T_list:
            idx = torch.randint(0, m.config.vocab_size, (1, T), device=device)

            def fn():
                return m(idx)
            with kernels.PeakMemory(device) as pm:
                fn()
            med, times = time_fn(fn, device, warmup, repeats)
            rows.append({'T': T, 'attn': name, 'ms': med * 1e3, 'tokens_per_s': T / med,
                         'peak_mem_mb': None if pm.peak is None else pm.peak / 2**20, 'mem_method': pm.method})
            log(f'  prefill T={T:6d} {name:9s} {med * 1e3:9.1f} ms ({T / med:9.0f} tok/s)  '
                f'peak +{rows[-1]["peak_mem_mb"] or 0:8.1f} MB')
        del m
    return rows


@torch.no_grad()
def bench_decode(lengths, maps, device, n_layer=1, n_head=2, n_embd=128, window=64, prompt=16,
                 softmax_mode='prefill', linear_mode='generate', model=None):
    """Per-token decode time and memory vs generated length L, greedy, one token at a time with
    model.prefill / model.decode_step. 'generate' mode: max(lengths) tokens in one go; the per-token time at L is
    the median over the `window` steps ending at L (linear maps: constant state). 'prefill' mode (the softmax
    default: generating 32K tokens with a growing cache is O(L^2) in total, slow on a CPU): for each L, the
    state of the first prompt + L - window tokens is built by prefill (the same KV cache or recurrent state that
    generation would hold), then the `window` decode steps up to L are timed. Memory at L: the attention state
    (exact) and process RSS. Random gpt2-style models of each map by default; with `model` (a real checkpoint)
    it is timed with its own attention and as its softmax teacher (every core in teacher mode: a KV cache)."""
    import kernels  # lazily: PeakMemory etc.; importing triton early would break the interpreter tests
    import model as model_lib
    n_new = max(lengths)
    want = set(lengths)
    rows = []

    def make(name):
        if model is not None:  # the checkpoint itself; 'softmax' = its teacher (exact attention, KV cache)
            for c in model.attention_cores():
                c.teacher = name == 'softmax'
            return model
        torch.manual_seed(0)
        return model_lib.GPT(bench_model_config(name, n_new + prompt + 1, n_layer, n_head, n_embd)).to(device).eval()

    def step(m, tok, pos, states):
        t0 = time.perf_counter()
        logits, states = m.decode_step(tok, pos, states)
        tok = logits.argmax(-1)
        _sync(device)
        return tok, states, time.perf_counter() - t0

    for name in ['softmax'] + list(maps):
        m = make(name)
        kernels.release_freed_memory()
        t_start = time.perf_counter()
        times, mem = {}, {}
        mode = softmax_mode if name == 'softmax' else linear_mode
        if mode == 'generate':
            idx = torch.randint(0, m.config.vocab_size, (1, prompt), device=device)
            logits, states = m.prefill(idx)
            tok, all_times = logits.argmax(-1), []
            for i in range(1, n_new + 1):
                tok, states, dt = step(m, tok, prompt + i - 1, states)
                all_times.append(dt)
                if i in want:
                    times[i] = all_times[max(0, i - window):i]
                    mem[i] = (m.decode_state_nbytes(states) / 2**20, (kernels.proc_status_bytes('VmRSS') or 0) / 2**20)
                    log(f'  decode {name:9s} {i:6d} tokens generated, {time.perf_counter() - t_start:6.1f} s')
        else:
            for L in sorted(want):
                w = min(window, L)
                idx = torch.randint(0, m.config.vocab_size, (1, prompt + L - w), device=device)
                logits, states = m.prefill(idx)
                tok, ts = logits.argmax(-1), []
                for i in range(L - w + 1, L + 1):
                    tok, states, dt = step(m, tok, prompt + i - 1, states)
                    ts.append(dt)
                times[L] = ts
                mem[L] = (m.decode_state_nbytes(states) / 2**20, (kernels.proc_status_bytes('VmRSS') or 0) / 2**20)
                del states, logits
                kernels.release_freed_memory()
                log(f'  decode {name:9s} at {L:6d} (prefill {prompt + L - w} + {w} decode steps), '
                    f'{time.perf_counter() - t_start:6.1f} s')
        for L in sorted(want):
            med = statistics.median(times[L])
            rows.append({'attn': name, 'length': L, 'mode': mode, 'ms_per_token': med * 1e3,
                         'tokens_per_s': 1.0 / med, 'state_mb': mem[L][0], 'rss_mb': mem[L][1]})
            log(f'  decode {name:9s} at {L:6d} tokens: {med * 1e3:7.3f} ms/token ({1 / med:7.0f} tok/s), '
                f'state {mem[L][0]:9.3f} MB, RSS {mem[L][1]:8.1f} MB')
        del m
    if model is not None:
        for c in model.attention_cores():
            c.teacher = False
    return rows


def bench_markdown(res):
    out = []
    if res.get('attention'):
        out += ['Attention layer (B=1, 12 heads, head_dim 64), median ms / peak extra memory MB:', '',
                '| T | ' + ' | '.join(f'{a} ({i})' for a, i in _methods(res['attention'])) + ' |',
                '|---:|' + '---:|' * len(_methods(res['attention']))]
        for T in sorted({r['T'] for r in res['attention']}):
            cells = []
            for a, i in _methods(res['attention']):
                r = next((r for r in res['attention'] if r['T'] == T and r['attn'] == a and r['impl'] == i), None)
                cells.append('-' if r is None else f'{r["ms"]:.2f} ms / {_mb(r["peak_mem_mb"])}')
            out.append(f'| {T} | ' + ' | '.join(cells) + ' |')
        out.append('')
    if res.get('prefill'):
        names = list(dict.fromkeys(r['attn'] for r in res['prefill']))
        out += [f'Model prefill ({res["config"]["prefill_model"]}), median ms / peak extra memory MB:', '',
                '| T | ' + ' | '.join(names) + ' |', '|---:|' + '---:|' * len(names)]
        for T in sorted({r['T'] for r in res['prefill']}):
            cells = []
            for a in names:
                r = next((r for r in res['prefill'] if r['T'] == T and r['attn'] == a), None)
                cells.append('-' if r is None else f'{r["ms"]:.1f} ms / {_mb(r["peak_mem_mb"])}')
            out.append(f'| {T} | ' + ' | '.join(cells) + ' |')
        out.append('')
    if res.get('decode'):
        names = list(dict.fromkeys(r['attn'] for r in res['decode']))
        out += [f'Decode ({res["config"]["decode_model"]}), per-token ms (tokens/s), attention state MB, '
                f'process RSS MB, vs generated length:', '',
                '| generated | ' + ' | '.join(names) + ' |', '|---:|' + '---:|' * len(names)]
        for L in sorted({r['length'] for r in res['decode']}):
            cells = []
            for a in names:
                r = next((r for r in res['decode'] if r['length'] == L and r['attn'] == a), None)
                cells.append('-' if r is None else
                             f'{r["ms_per_token"]:.3f} ms ({r["tokens_per_s"]:.0f}/s), state {r["state_mb"]:.2f}, '
                             f'RSS {r["rss_mb"]:.0f}')
            out.append(f'| {L} | ' + ' | '.join(cells) + ' |')
        out.append('')
        for a, f in res.get('decode_flatness', {}).items():
            out.append(f'- {a}, {f["from"]} -> {f["to"]} tokens: per-token time x{f["time_ratio"]:.2f} '
                       f'(max/min over lengths {f["time_max_over_min"]:.2f}), state x{f["state_ratio"]:.2f}, '
                       f'RSS x{f["rss_ratio"]:.2f}; flat within 10%: {"yes" if f["flat_within_10pct"] else "no"}')
        out.append('')
    return '\n'.join(out)


def _methods(rows):
    return list(dict.fromkeys((r['attn'], r['impl']) for r in rows))


def _mb(x):
    return '-' if x is None else f'{x:.1f}'


def bench_plot(res, path):
    plt = _matplotlib()
    if plt is None:
        return None
    panels = [p for p in ('attention', 'prefill', 'decode') if res.get(p)]
    if not panels:
        return None
    fig, axes = plt.subplots(2, len(panels), figsize=(4.2 * len(panels), 6.4), squeeze=False)
    for c, p in enumerate(panels):
        rows = res[p]
        if p == 'decode':
            keys = list(dict.fromkeys(r['attn'] for r in rows))
            for n, a in enumerate(keys):
                rr = [r for r in rows if r['attn'] == a]
                x = [r['length'] for r in rr]
                axes[0][c].plot(x, [r['ms_per_token'] for r in rr], marker='o', label=a, color=f'C{n}')
                axes[1][c].plot(x, [r['state_mb'] for r in rr], marker='o', label=f'{a} state', color=f'C{n}')
                axes[1][c].plot(x, [r['rss_mb'] or 0 for r in rr], marker='x', ls='--', label=f'{a} RSS',
                                color=f'C{n}', alpha=0.6)
            axes[0][c].set_title('decode: ms per token (median)', fontsize=9)
            axes[0][c].set_yscale('log')
            axes[1][c].set_title('decode: state MB (solid), process RSS MB (dashed)', fontsize=8)
            axes[1][c].set_xlabel('generated tokens')
            axes[1][c].set_yscale('log')
        else:
            keys = _methods(rows) if p == 'attention' else [(a, None) for a in dict.fromkeys(r['attn'] for r in rows)]
            for n, (a, i) in enumerate(keys):
                rr = [r for r in rows if r['attn'] == a and (i is None or r['impl'] == i)]
                label = a if i is None else f'{a} ({i})'
                axes[0][c].plot([r['T'] for r in rr], [r['ms'] for r in rr], marker='o', label=label, color=f'C{n}')
                axes[1][c].plot([r['T'] for r in rr], [r['peak_mem_mb'] or 0 for r in rr], marker='o', label=label,
                                color=f'C{n}')
            axes[0][c].set_title(f'{p}: median ms', fontsize=9)
            axes[1][c].set_title(f'{p}: peak extra memory MB', fontsize=9)
            axes[1][c].set_xlabel('sequence length T')
            axes[0][c].set_yscale('log')
        for r in range(2):
            axes[r][c].set_xscale('log', base=2)
            axes[r][c].legend(fontsize=7)
    fig.suptitle(f'{res["config"]["device_name"]}, torch {torch.__version__}', fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _device_name(device):
    if torch.device(device).type == 'cuda':
        return torch.cuda.get_device_name()
    n = torch.get_num_threads()
    return f'{os.cpu_count()}-core CPU ({n} torch thread{"s" if n > 1 else ""})'


def report_bench(args):
    import kernels  # lazily: PeakMemory etc.; importing triton early would break the interpreter tests
    parts = [w.strip() for w in args.bench.split(',') if w.strip()]
    bad = [w for w in parts if w not in BENCH_CHOICES]
    if bad or not parts:
        raise EvalError(f'--bench {args.bench!r}: choose from {", ".join(BENCH_CHOICES)} (or a comma-separated list)')
    what = set(BENCH_CHOICES[:-1]) if 'all' in parts else set(parts)
    device = args.device
    if args.threads:
        torch.set_num_threads(args.threads)
    maps = parse_maps(args.bench_maps) or ['elu']
    cfg = {'device': device, 'device_name': _device_name(device), 'torch': torch.__version__, 'maps': maps,
           'warmup': args.warmup, 'repeats': args.repeats,
           'prefill_model': f'gpt2-style, {args.bench_layers} layers, 12 heads, n_embd 768, vocab 256',
           'decode_model': f'gpt2-style, {args.decode_layers} layer(s), {args.decode_heads} heads of 64, vocab 256, '
                           f'greedy; median of {args.decode_window} steps; softmax cache by {args.decode_softmax}',
           'threads': torch.get_num_threads(),
           'memory_method': kernels.PeakMemory(device).method,
           'loadavg_start': _loadavg()}
    res = {'config': cfg}
    T_list = _parse_ints(args.bench_T, 'bench_T')
    if 'attention' in what:
        log(f'attention layer: {", ".join(maps)} vs softmax (SDPA), T={T_list}')
        res['attention'] = bench_attention(T_list, maps, device, warmup=args.warmup, repeats=args.repeats)
    if 'model' in what:
        P_list = _parse_ints(args.prefill_T, 'prefill_T')
        log(f'model prefill, T={P_list}')
        res['prefill'] = bench_prefill(P_list, maps, device, n_layer=args.bench_layers, warmup=args.warmup,
                                       repeats=args.repeats)
    if 'decode' in what:
        L_list = _parse_ints(args.decode_lengths, 'decode_lengths')
        log(f'decode, generated lengths {L_list}')
        real, dmaps = None, maps
        if args.ckpt:  # a real checkpoint: its own attention against its softmax teacher (KV cache)
            real, _ = load_model(args.ckpt, device)
            if real.config.family == 'bert':
                raise EvalError('--bench decode needs a causal model (gpt2 or llama), got bert')
            dmaps = [describe_attention(real)]
            c = real.config
            cfg['decode_model'] = (f'{args.ckpt}: {c.family}, {c.n_layer} layers, {c.n_head} heads ({c.n_kv_head} '
                                   f'KV heads) of {c.head_dim}, vocab {c.vocab_size}, {real.get_num_params() / 1e6:.1f}M '
                                   f'parameters; {dmaps[0]} vs its softmax teacher (KV cache); greedy; median of '
                                   f'{args.decode_window} steps; states by softmax {args.decode_softmax}, '
                                   f'{dmaps[0]} {args.decode_linear}')
        res['decode'] = bench_decode(L_list, dmaps, device, n_layer=args.decode_layers, n_head=args.decode_heads,
                                     n_embd=64 * args.decode_heads, window=args.decode_window,
                                     softmax_mode=args.decode_softmax, linear_mode=args.decode_linear, model=real)
        flat = {}
        for a in dict.fromkeys(r['attn'] for r in res['decode']):
            rr = sorted((r for r in res['decode'] if r['attn'] == a), key=lambda r: r['length'])
            if len(rr) >= 2:
                ms = [r['ms_per_token'] for r in rr]
                flat[a] = {'from': rr[0]['length'], 'to': rr[-1]['length'],
                           'time_ratio': ms[-1] / ms[0], 'time_max_over_min': max(ms) / min(ms),
                           'state_ratio': rr[-1]['state_mb'] / max(rr[0]['state_mb'], 1e-12),
                           'rss_ratio': (rr[-1]['rss_mb'] or 0) / max(rr[0]['rss_mb'] or 0, 1e-12)}
                flat[a]['flat_within_10pct'] = (flat[a]['time_max_over_min'] <= 1.10 and
                                                flat[a]['state_ratio'] <= 1.10 and flat[a]['rss_ratio'] <= 1.10)
        res['decode_flatness'] = flat
    if 'kernels' in what:
        res['kernels'] = bench_kernels(args, T_list)
    cfg['loadavg_end'] = _loadavg()
    os.makedirs(args.out_dir, exist_ok=True)
    md = bench_markdown(res)
    if res.get('kernels', {}).get('table'):
        md += '\nkernels.bench (attention implementations on feature maps, forward and backward):\n\n' + \
            res['kernels']['table']
    if md:
        path = os.path.join(args.out_dir, 'bench.md')
        with open(path, 'w') as f:
            f.write(f'{cfg["device_name"]}, torch {torch.__version__}; memory: {cfg["memory_method"]}; '
                    f'load average {cfg["loadavg_start"]} at the start, {cfg["loadavg_end"]} at the end\n\n' + md)
        log(md)
        res['table'] = path
    png = bench_plot(res, os.path.join(args.out_dir, 'bench.png'))
    if png:
        res['figure'] = png
        log(f'wrote {png}')
    return res


def bench_kernels(args, T_list):
    """kernels.bench: forward and forward+backward of SDPA vs the chunked PyTorch path (and Triton on CUDA)
    on phi features, at the --bench_T lengths."""
    try:
        import kernels
    except ImportError as e:
        log(f'kernels.py not importable ({e}); skipping --bench kernels')
        return {'skipped': str(e)}
    log(f'kernels.bench, T={T_list}')
    rows = kernels.bench(device=args.device, T_list=T_list, repeats=args.repeats, verbose=False)
    return {'rows': rows, 'table': kernels.bench_markdown(rows)}


# -----------------------------------------------------------------------------------------------------------
# command line

class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f'{self.prog}: error: {message}\n')


def build_parser():
    p = _Parser(prog='eval.py', description=__doc__.split('\n\n')[0].strip(),
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    r = p.add_argument_group('reports (one per run)')
    r.add_argument('--ppl', action='store_true', help='perplexity on --data (text file, folder, datasets name)')
    r.add_argument('--glue', metavar='TASK', help='GLUE task on its validation split: ' + ', '.join(train.GLUE_TASKS))
    r.add_argument('--rouge', action='store_true', help='ROUGE-1/2/L of generated summaries (JSONL or SAMSum)')
    r.add_argument('--generate', action='store_true',
                   help='greedy continuations of --prompt (or of --data lines) by the model and, for a convert.py '
                        'folder, by the softmax model it was converted from')
    r.add_argument('--fidelity', action='store_true', help='attention fidelity vs softmax, with figures')
    r.add_argument('--bench', nargs='?', const='all', metavar='WHAT',
                   help='one of ' + ', '.join(BENCH_CHOICES) + ', or a comma-separated list')
    r.add_argument('--lln', action='store_true', help='LLN Fig. 2: entropy and spectral gap vs temperature, '
                   'Gaussian q, k (no --ckpt)')
    p.add_argument('--ckpt', help='checkpoint from train.py/convert.py, HF folder, .gguf file or hub name')
    p.add_argument('--tokenizer', help="a HF folder or .gguf file whose tokenizer replaces the model's own (e.g. "
                   'for old checkpoints that carry none)')
    p.add_argument('--data', help='input data (see each report)')
    p.add_argument('--out_dir', default='out/eval', help='where JSON (and PNG) results go')
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--batch_size', type=int, default=8)
    p.add_argument('--context', type=int, default=0, help='window length (ppl: default min(block_size, 1024); '
                   'fidelity: default min(block_size, 128))')
    p.add_argument('--stride', type=int, default=0, help='ppl stride (default context // 2)')
    p.add_argument('--max_tokens', type=int, default=0, help='ppl: only the first N tokens of the data (0 = all)')
    p.add_argument('--split', default='test', help='ppl/rouge: split when loading from `datasets`')
    p.add_argument('--limit', type=int, default=0, help='rouge/glue: first N examples only (0 = all)')
    p.add_argument('--max_new_tokens', type=int, default=64)
    p.add_argument('--prompt', action='append', help='generate: a prompt (repeat the flag for several)')
    p.add_argument('--prompt_tokens', type=int, default=0,
                   help='generate: prompts of this many tokens taken from --data (0: one prompt per line)')
    p.add_argument('--n_prompts', type=int, default=3, help='generate: how many --prompt_tokens passages')
    p.add_argument('--n_samples', type=int, default=2, help='fidelity: sequences of --context tokens')
    p.add_argument('--maps', default='', help='fidelity: also compare these untrained maps (options as in '
                   "train.py, e.g. exp:t=2): " + ','.join(attention.FEATURE_MAPS))
    p.add_argument('--qk', default='model', choices=['model', 'teacher'],
                   help="fidelity: q, k from the model's own forward pass, or from its softmax teacher's (every "
                        'core in teacher mode: each layer on the teacher\'s inputs, as convert.py measures it)')
    p.add_argument('--layers', default='', help='fidelity figures: layers (default first and last)')
    p.add_argument('--heads', default='', help='fidelity figures: heads (default 0,1)')
    p.add_argument('--fig_tokens', type=int, default=64, help='fidelity heatmaps: first N tokens')
    p.add_argument('--scatter_rows', type=int, default=8, help='fidelity scatter: last N query rows')
    p.add_argument('--dpi', type=int, default=80)
    p.add_argument('--bench_maps', default='elu', help='bench: linear maps to time against softmax')
    p.add_argument('--bench_T', default='512,1024,2048,4096,8192', help='bench attention: sequence lengths')
    p.add_argument('--prefill_T', default='256,512,1024,2048,4096', help='bench model: prefill lengths')
    p.add_argument('--bench_layers', type=int, default=2, help='bench model: layers of the prefill model')
    p.add_argument('--decode_lengths', default='512,1024,2048,4096,8192,16384,32768')
    p.add_argument('--decode_layers', type=int, default=1)
    p.add_argument('--decode_heads', type=int, default=2)
    p.add_argument('--decode_window', type=int, default=256, help='bench decode: steps per median')
    p.add_argument('--decode_linear', default='generate', choices=['generate', 'prefill'],
                   help='bench decode: how the linear maps reach length L (generate every token, or prefill to '
                        'L - window then time window decode steps, as --decode_softmax prefill does)')
    p.add_argument('--decode_softmax', default='prefill', choices=['prefill', 'generate'],
                   help='bench decode: build the softmax KV cache for each length by prefill, or generate it')
    p.add_argument('--threads', type=int, default=0, help='torch CPU threads (0 = torch default)')
    p.add_argument('--warmup', type=int, default=1)
    p.add_argument('--repeats', type=int, default=3)
    p.add_argument('--lln_head_dim', type=int, default=64, help='lln: head dimension of the Gaussian q, k')
    p.add_argument('--lln_tokens', type=int, default=256, help='lln: tokens per sequence')
    p.add_argument('--lln_grid', default='0.25,0.5,1,1.5,2,2.5,3,3.5,4,5,6', help='lln: temperatures sigma^2')
    p.add_argument('--lln_seeds', type=int, default=8, help='lln: independent sequences (from --seed)')
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    chosen = [name for name in REPORTS if getattr(args, name) not in (None, False)]
    if len(chosen) != 1:
        print(f'eval.py: error: choose exactly one report: --{", --".join(REPORTS)} (got {len(chosen)})',
              file=sys.stderr)
        return 2
    report = chosen[0]
    torch.manual_seed(args.seed)
    if args.threads < 0:
        print(f'eval.py: error: --threads must be >= 0 (0 = torch default), got {args.threads}', file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        res = {'ppl': report_ppl, 'glue': report_glue, 'rouge': report_rouge, 'generate': report_generate,
               'fidelity': report_fidelity, 'bench': report_bench, 'lln': report_lln}[report](args)
    except EvalError as e:
        print(f'eval.py: error: {e}', file=sys.stderr)
        return 2
    res = {'report': report, **res}
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f'{report}.json')
    with open(path, 'w') as f:
        json.dump(res, f, indent=1, default=float)
    log(f'wrote {path}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
