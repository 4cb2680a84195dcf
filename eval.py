"""Evaluate a model: one report per run, printed and written to <out_dir>/<report>.json.

Figures go beside it as PNG where matplotlib is installed.

    python eval.py --ckpt out --ppl --data data/wikitext-2/test.txt --context 256 --stride 128
    python eval.py --ckpt out-cola --glue cola --data data/cola
    python eval.py --ckpt out --rouge --data dialogues.jsonl --max_new_tokens 64
    python eval.py --ckpt out-convert --generate --prompt 'The capital of France is'
    python eval.py --ckpt out-convert --fidelity --data input.txt --maps elu,lln --heads 0:0,1:1
    python eval.py --bench attention,decode --maps elu,hedgehog --out_dir out/bench
    python eval.py --lln --out_dir out/lln                  # LLN Fig. 2 on Gaussian q, k (no model)
    python eval.py --ckpt out-convert --passkey --sweep 512,1024   # or --lm_eval hellaswag,arc_easy
"""
import contextlib
import ctypes
import functools
import itertools
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch.utils import benchmark

import attention
import hybrids
from attention import UsageError
import model as M
import tokenizer
import train
from train import log, num

REPORTS = ['ppl', 'glue', 'rouge', 'generate', 'fidelity', 'bench', 'lln', 'lm_eval', 'passkey']
# --bench parts and their default lengths
BENCH_SWEEPS = {'attention': '512,1024,2048,4096,8192', 'prefill': '256,512,1024,2048,4096',
                'decode': '512,1024,2048,4096,8192,16384,32768'}
LLN_GRID = '0.25,0.5,1,1.5,2,2.5,3,3.5,4,5,6'      # LLN Fig. 2's temperatures sigma^2
LLN_CURVES = (('entropy_bits', 'row entropy (bits)'),
              ('spectral_gap', 'spectral gap 1 - |lambda_2|'))
DECODE_STEPS = 64
FIG_TOKENS = 64
SCATTER_ROWS = 8
# The SAMSum prompt (Hedgehog, Listing 4): llama-recipes' SAMSum template, which the paper's Llama-2
# runs use (not checked letter by letter against the paper's listing); the model continues with the
# summary and EOS.
SAMSUM_PROMPT = "Summarize this dialog:\n{dialogue}\n---\nSummary:\n"
DEFAULT_PROMPTS = ('The capital of France is Paris. The capital of Germany is',
                   'Water boils at a temperature of',
                   'Once upon a time, in a small village,')

# ---- loading -----------------------------------------------------------------
def load_model(ckpt, device='cpu', **overrides):
    """(model, extra) by model.load with the GPTConfig `overrides` that are set (attn, rope_theta),
    its error in one line."""
    try:
        m, extra = M.load(ckpt, **{k: v for k, v in overrides.items() if v})
    except train.USER_ERRORS as e:
        # a UsageError names the problem; other errors are named by their type
        why = '' if isinstance(e, UsageError) else f'{type(e).__name__}: '
        raise UsageError(
            f'cannot load --ckpt {ckpt!r}: {why}{(str(e).splitlines() or [""])[0][:300]}')
    return m.to(device).eval(), extra

def load(args, causal_for=None, with_tokenizer=True):
    """(model, extra, tokenizer) of --ckpt: the model's own tokenizer or --tokenizer's.

    (tokenizer.resolve picks it and checks that it fits.)"""
    if not args.ckpt:
        raise UsageError('this report needs --ckpt (a checkpoint from train.py/convert.py, '
                         'an HF folder or hub name)')
    model, extra = load_model(args.ckpt, args.device, attn=args.attn, rope_theta=args.rope_theta)
    if causal_for and model.config.family == 'bert':
        raise UsageError(f'--{causal_for} needs a causal model (family gpt2 or llama), got bert')
    if args.rope_theta and not model.rope:
        raise UsageError(f'--rope_theta needs a RoPE model (llama), got {model.config.family}')
    if args.context > model.config.block_size and not model.rope:   # RoPE runs past it
        raise UsageError(f'--context {args.context} > block_size {model.config.block_size} '
                         '(learned positions)')
    return model, extra, tokenizer.resolve(model, args.tokenizer) if with_tokenizer else None

def load_text(data):
    """--data: a text file, a folder of .txt files or a `datasets` name:config (its test split)."""
    data = data or 'wikitext:wikitext-103-raw-v1'
    return train.load_text(data, 'test'), data

def describe_attention(model):
    """One label, or per-layer labels where the layers differ (a partial conversion)."""
    labels = [str(c.spec) for c in model.attention_cores()]
    if len(set(labels)) == 1:
        return labels[0]
    return ', '.join(f'L{i}:{a}' for i, a in enumerate(labels))

@torch.no_grad()
def capture_qk(model, idx, teacher=False):
    """[(q, k)] per layer, float on the CPU (model.capture_qkv).

    teacher=True: those of the softmax teacher's pass."""
    with model.capture_qkv(teacher=teacher) as rec:
        model(idx)   # (a Bert's forward: its encoder)
    return [tuple(t.float().cpu() for t in rec[i][:2]) for i in sorted(rec)]   # (q, k)

# ---- perplexity and GLUE (train.py's perplexity, GLUE data, metrics and classifier) ----
def report_ppl(args):
    model, _, tok = load(args, 'ppl')
    text, source = load_text(args.data)
    ids = tok.encode(text)[:args.limit or None]
    context = args.context or min(model.config.block_size, 1024)
    attn = describe_attention(model)
    t0 = time.time()
    log(f'tokenizer: {tok.name}; data: {source} ({len(ids):,} tokens); attention: {attn}')
    with softmax_shares(model) as shares:
        res = train.perplexity(model, ids, context, args.stride or max(context // 2, 1),
                               args.device, args.batch_size)
    res.update(ckpt=args.ckpt, data=source, tokenizer=tok.name, attn=attn,
               seconds=round(time.time() - t0, 2), softmax_share=shares)
    log(f'perplexity {res["ppl"]:.3f} (mean NLL {res["nll"]:.4f} nats/token) over '
        f'{res["tokens_scored"]:,} tokens, context {context}, stride {res["stride"]}, '
        f'{res["windows"]} windows, {res["seconds"]} s{describe_shares(shares)}')
    return res

@contextlib.contextmanager
def softmax_shares(model):
    """{layer: {'mean', 'last'}}: each window hybrid layer's share of attention on its softmax part.

    Filled in at the end, from the forward passes inside. The softmax part is the window, sinks and
    cache; the rest is on the linear part. 'mean': over the batch, heads and rows; 'last': at the
    last row of the last pass."""
    acc = {}   # layer: the shares of every pass
    out = {}
    hooks = [c.register_forward_hook(
                 lambda m, a, o, i=i: acc.setdefault(i, []).append(m.share.mean((0, 1))))
             for i, c in enumerate(model.attention_cores())
             if c.mode == 'window' and c.fmap is not None]
    try:
        yield out
    finally:
        for h in hooks:
            h.remove()
        out.update({i: {'mean': torch.cat(x).mean().item(), 'last': x[-1][-1].item()}
                    for i, x in acc.items()})

def describe_shares(shares):
    """'; softmax-part share 0.71 (last row 0.42), layers 0.55-0.93' ('' without window hybrids)."""
    if not shares:
        return ''
    m = [x['mean'] for x in shares.values()]
    last = statistics.mean(x['last'] for x in shares.values())
    return (f'; softmax-part share {statistics.mean(m):.2f} (last row {last:.2f}), '
            f'layers {min(m):.2f}-{max(m):.2f}')

def report_glue(args):
    """A finetuned classifier on the task's validation split.

    The classifier: train.py --task glue's, or a BERT with its head."""
    model, extra, tok = load(args)
    task = args.glue
    tc = extra.get('train_config') or {}
    bert = model.config.family == 'bert'
    num_labels = train.glue_num_labels(task)
    if tc.get('task') == 'glue' and tc.get('glue_task', task) != task:
        raise UsageError(f'--ckpt was finetuned on {tc["glue_task"]}, not {task}')
    if bert and model.config.num_labels != num_labels:
        raise UsageError(f'{task} has {num_labels} label(s), '
                         f'the checkpoint classifier {model.config.num_labels}')
    if not bert and not extra.get('cls_head'):
        raise UsageError('--ckpt has no classifier: '
                         'want a bert with num_labels > 0 or a train.py --task glue one')
    module = train.Classifier(model, num_labels)
    if not bert:
        module.head.load_state_dict(extra['cls_head'])
    dev = train.load_glue(task, args.data, 'validation')[:args.limit or None]
    if not dev:
        raise UsageError(f'no labelled validation examples for {task} in {args.data}')
    enc = train.GlueEncoder(tok, tc.get('seq_len') or model.config.block_size, verbose=False)
    log(f'tokenizer: {enc.name}; GLUE {task} validation: {len(dev)} examples '
        f'from {args.data or "datasets"}')
    preds, labels = predict_glue(module.to(args.device).eval(), enc, dev, num_labels,
                                 args.device, args.batch_size)
    metrics = train.glue_metric(task, preds, labels)
    log(f'GLUE {task} validation ({len(labels)} examples): '
        + ', '.join(f'{k} {v:.4f}' for k, v in metrics.items()))
    return {'task': task, 'split': 'validation', 'examples': len(labels), 'ckpt': args.ckpt,
            'metrics': metrics, 'data': args.data or 'datasets glue', 'tokenizer': enc.name,
            'attn': describe_attention(model)}

@torch.no_grad()
def predict_glue(module, enc, examples, num_labels, device='cpu', batch_size=32):
    """Predicted classes (or regression values) and labels for [(text_a, text_b, label)]."""
    preds = []
    labels = []
    for i in range(0, len(examples), batch_size):
        batch = examples[i:i + batch_size]
        idx, mask, tt, lab = train.collate_glue([enc.encode(a, b) for a, b, _ in batch],
                                                [y for _, _, y in batch])
        logits, _ = module(idx.to(device), mask.to(device), tt.to(device))
        preds += (logits.view(-1).float() if num_labels == 1 else logits.argmax(-1)).cpu().tolist()
        labels += lab.tolist()
    return preds, labels

# ---- greedy generation: ROUGE of summaries; the model next to its softmax teacher ----
def load_summaries(data, limit=0):
    """[(dialogue, summary)] from a JSONL of {dialogue, summary}, or a `datasets` name.

    The `datasets` default: samsum, its test split."""
    if data and os.path.isfile(data):
        with open(data, encoding='utf-8') as f:
            rows = [(n, json.loads(line)) for n, line in enumerate(f, 1) if line.strip()]
        bad = [n for n, r in rows if 'dialogue' not in r or 'summary' not in r]
        if bad:
            raise UsageError(f'{data}:{bad[0]}: each line needs "dialogue" and "summary" keys')
        return [(r['dialogue'], r['summary']) for _, r in rows][:limit or None], data
    try:
        import datasets
        ds = datasets.load_dataset(data or 'samsum', split='test')
    except Exception as e:  # noqa: BLE001
        raise UsageError(
            f'--data {data or "samsum"}: not a file, and datasets cannot load it '
            f'({type(e).__name__}); pass a JSONL of {{"dialogue", "summary"}}')
    return list(zip(ds['dialogue'], ds['summary']))[:limit or None], f'{data or "samsum"} (test)'

def greedy(model, ids, max_new_tokens, eos_id, device='cpu', graph=False):
    """The new tokens (a list) of model's greedy continuation of the token list ids.

    Up to max_new_tokens, stopping after eos_id (model.GPT.generate)."""
    return model.generate(torch.tensor([ids], device=device), max_new_tokens, temperature=0.0,
                          eos_token_id=eos_id, graph=graph)[0, len(ids):].tolist()

def summarize(model, tok, dialogue, max_new_tokens, device='cpu'):
    """Greedy summary of a dialogue in the SAMSum prompt, up to EOS.

    The prompt keeps its end if too long."""
    room = model.config.block_size - max_new_tokens
    if room < 1:
        raise UsageError(f'--max_new_tokens {max_new_tokens} leaves no room '
                         f'in block_size {model.config.block_size}')
    ids = tok.encode(SAMSUM_PROMPT.format(dialogue=dialogue.strip('\n')))[-room:]
    new = greedy(model, ids, max_new_tokens, tok.eos_id, device)
    return tok.decode(new[:new.index(tok.eos_id)] if tok.eos_id in new else new).strip()

def rouge(references, predictions):
    """Mean F-measure x100 of ROUGE-1/2/L by rouge-score.

    The papers' ROUGE: rouge-score's default tokenizer, no stemming."""
    try:
        from rouge_score import rouge_scorer
    except ImportError:
        raise UsageError('ROUGE needs the rouge-score package: pip install rouge-score')
    if not references or len(references) != len(predictions):
        raise UsageError(f'need as many predictions as references '
                         f'(got {len(predictions)} and {len(references)})')
    keys = ['rouge1', 'rouge2', 'rougeL']
    scorer = rouge_scorer.RougeScorer(keys)
    scores = [scorer.score(r, p) for r, p in zip(references, predictions)]
    return {k: 100.0 * sum(s[k].fmeasure for s in scores) / len(scores) for k in keys}

def report_rouge(args):
    model, _, tok = load(args, 'rouge')
    rows, source = load_summaries(args.data, args.limit)
    if not rows:
        raise UsageError(f'no examples in {source}')
    log(f'tokenizer: {tok.name}; data: {source} ({len(rows)} dialogues); greedy, up to '
        f'{args.max_new_tokens} new tokens, stop at EOS ({tok.eos_id})')
    t0 = time.time()
    refs = [s for _, s in rows]
    preds = []
    for i, (d, _) in enumerate(rows):
        preds.append(summarize(model, tok, d, args.max_new_tokens, args.device))
        train.progress('rouge', i + 1, i, len(rows), t0, 'dialogues')
    scores = rouge(refs, preds)
    log('ROUGE F-measure (x100): ' + ', '.join(f'{k} {v:.2f}' for k, v in scores.items()))
    log(f'example: reference {refs[0]!r}\n         generated {preds[0]!r}')
    return {'data': source, 'examples': len(rows), 'ckpt': args.ckpt,
            'attn': describe_attention(model), 'max_new_tokens': args.max_new_tokens,
            'prompt_template': SAMSUM_PROMPT, 'scores': scores,
            'samples': [{'summary': s, 'generated': p} for s, p in zip(refs[:5], preds)],
            'seconds': round(time.time() - t0, 2)}

def generate_prompts(args, tok):
    """--prompt (repeatable); else prompts from --data; else built-ins.

    From --data: with --context N, --limit (default 3) passages of N tokens at evenly spaced
    offsets (long prompts reach a window hybrid's linear part), else one per line."""
    if args.prompt or not args.data:
        return args.prompt or DEFAULT_PROMPTS
    text = load_text(args.data)[0]
    if not args.context:
        return [p for p in text.splitlines() if p.strip()][:args.limit or None]
    ids = tok.encode(text)
    n = args.limit or 3
    L = args.context
    if len(ids) < L:
        raise UsageError(f'--data has {len(ids)} tokens, fewer than --context {L}')
    return [tok.decode(ids[o:o + L])
            for o in range(0, len(ids) - L + 1, max((len(ids) - L) // n, 1))][:n]

def report_generate(args):
    """Greedy continuations by the model and, for a convert.py folder, by its softmax teacher.

    The teacher is the folder's base model (without LoRA)."""
    model, extra, tok = load(args, 'generate')
    runs = [(describe_attention(model), model)]
    base = extra.get('base')   # a convert.py checkpoint names its base
    if any(c.mode != 'softmax' for c in model.attention_cores()) and base:
        teacher = load_model(base, args.device, rope_theta=args.rope_theta)[0]
        runs += [('softmax teacher', teacher)]
    log(f'tokenizer: {tok.name}; greedy, {args.max_new_tokens} new tokens '
        f'(stop at EOS {tok.eos_id}); {" vs ".join(n for n, _ in runs)}')
    rows = []
    for p in generate_prompts(args, tok):   # (an empty prompt: after the end-of-text token)
        ids = tok.encode(p) or [tok.eos_id]
        row = {'prompt': p}
        if None in ids:
            raise UsageError(f"--prompt {p!r}: an empty prompt starts after the end-of-text "
                             f"token, and the tokenizer {tok.name} has none: give a prompt")
        log(f'\nprompt: {p!r}')
        for name, m in runs:
            t0 = time.perf_counter()
            new = greedy(m, ids, args.max_new_tokens, tok.eos_id, args.device, args.graph)
            sec = time.perf_counter() - t0
            row[name] = {'text': tok.decode(new), 'tokens': len(new), 'seconds': round(sec, 3)}
            log(f'  {name:>20s}: {tok.decode(new)!r}  '
                f'({len(new)} tokens, {len(new) / sec:.1f} tok/s)')
        rows.append(row)
    return {'ckpt': args.ckpt, 'tokenizer': tok.name, 'max_new_tokens': args.max_new_tokens,
            'models': [n for n, _ in runs], 'samples': rows}

# ---- lm-evaluation-harness (0.4.x, optional: imported only by --lm_eval) and the passkey task ----
def lm_eval_adapter(model, tok, context, stride, device='cpu', batch_size=8):
    """`model` as an lm-eval `LM`: loglikelihood, loglikelihood_rolling, generate_until (greedy).

    loglikelihood_rolling: train.perplexity's windows. A document or an empty context starts after
    the end-of-text token (lm-eval's prefix token), so every token of a document is scored; eval.py
    --ppl prepends nothing and scores a text's tokens after its first."""
    from lm_eval.api.model import LM
    eos = tok.eos_id

    def split(ctx, cont):
        """(context ids, continuation ids), the context's trailing spaces in the continuation.

        (That is lm-eval's convention.)"""
        cont = ctx[len(ctx.rstrip()):] + cont
        ctx = ctx.rstrip()
        whole = tok.encode(ctx + cont)
        head = tok.encode(ctx)
        return (head, whole[len(head):]) if ctx else ([eos], whole)

    class Adapter(LM):
        @torch.no_grad()
        def loglikelihood(self, requests):
            pairs = [split(*r.args) for r in requests]
            out = []
            # right-padded: a causal model's padding is after its tokens
            for i in range(0, len(pairs), batch_size):
                batch = pairs[i:i + batch_size]
                group = [(c + t)[-(context + 1):] for c, t in batch]   # at most context + 1
                x = torch.nn.utils.rnn.pad_sequence(
                    [torch.tensor(g[:-1], dtype=torch.long) for g in group], batch_first=True)
                logp = model(x.to(device))[0].float().log_softmax(-1).cpu()
                for r, (g, (_, t)) in enumerate(zip(group, batch)):
                    lp = logp[r, len(g) - 1 - len(t):len(g) - 1]   # (len(t), vocab)
                    y = torch.tensor(t)
                    out.append((float(lp.gather(-1, y[:, None]).sum()),
                                bool((lp.argmax(-1) == y).all())))
            return out

        def loglikelihood_rolling(self, requests):
            res = [train.perplexity(model, [eos] + tok.encode(r.args[0]), context, stride, device,
                                    batch_size) for r in requests]
            return [-r['nll'] * r['tokens_scored'] for r in res]

        def generate_until(self, requests):
            out = []
            for ctx, kw in (r.args for r in requests):
                until = kw.get('until') or [tok.decode([eos])]
                ids = tok.encode(ctx) or [eos]
                text = tok.decode(greedy(model, ids, kw.get('max_gen_toks', 256), eos, device))
                out.append(min((text.split(s)[0] for s in until), key=len))
            return out
    return Adapter()

PASSKEY_TASK = {   # the lm-eval task (passkey_task writes it as passkey.yaml, with its data file)
    'task': 'passkey_retrieval', 'dataset_path': 'json', 'test_split': 'test',
    'output_type': 'generate_until', 'doc_to_text': '{{input}}', 'doc_to_target': '{{target}}',
    'generation_kwargs': {'until': ['\n', '.'], 'max_gen_toks': 8, 'do_sample': False},
    'filter_list': [{'name': 'number', 'filter': [{'function': 'regex', 'regex_pattern': r'(\d+)'},
                                                  {'function': 'take_first'}]}],
    'metric_list': [{'metric': 'exact_match', 'aggregation': 'mean', 'higher_is_better': True}]}

def passkey_task(folder, tok, lengths, depths=(0, 25, 50, 75, 100), samples=6, seed=0,
                 template='eval'):
    """Passkey retrieval (train.passkey_prompts) as a local lm-eval task in `folder`.

    Scored: the first number of the greedy answer equals the key (exact match)."""
    import yaml
    rows = train.passkey_prompts(tok, lengths, depths, samples, seed, template)
    os.makedirs(folder, exist_ok=True)
    path = os.path.abspath(os.path.join(folder, 'passkey.jsonl'))
    with open(path, 'w') as f:
        f.writelines(json.dumps(r) + '\n' for r in rows)
    with open(os.path.join(folder, 'passkey.yaml'), 'w') as f:
        yaml.safe_dump({**PASSKEY_TASK, 'dataset_kwargs': {'data_files': {'test': path}}}, f,
                       sort_keys=False)
    return rows

def run_lm_eval(args, model, tok, tasks, include=None, limit=None, log_samples=False):
    """lm_eval.simple_evaluate on our model, `limit` samples per task (None: all).

    Loglikelihood inputs are at most --context tokens."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    if include and not os.path.isdir(include):
        raise UsageError(f'--lm_eval_include {include}: not a folder (of lm-eval task yamls)')
    manager = TaskManager(include_path=include) if include else lm_eval_tasks()
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        local = f' and those in {include}' if include else ''
        raise UsageError(f'unknown lm-eval task(s) {", ".join(unknown)}: not among lm-eval\'s '
                         f'{len(manager.all_tasks)} tasks (lm-eval ls tasks){local}')
    context = args.context or model.config.block_size
    return lm_eval.simple_evaluate(
        model=lm_eval_adapter(model, tok, context, args.stride or max(context // 2, 1),
                              args.device, args.batch_size),
        tasks=tasks, task_manager=manager, limit=limit, log_samples=log_samples)

@functools.cache
def lm_eval_tasks():
    """lm-eval's own task index, once a process.

    (TaskManager reads some thousands of yamls: about 20 s.)"""
    from lm_eval.tasks import TaskManager
    return TaskManager()

def report_lm_eval(args):
    """--lm_eval TASKS (comma-separated; --lm_eval_include DIR adds local task yamls) through
    lm-eval 0.4."""
    from lm_eval.utils import make_table
    model, _, tok = load(args, 'lm_eval')
    res = run_lm_eval(args, model, tok, args.lm_eval.split(','),
                      args.lm_eval_include, args.limit or None)
    log(make_table(res))
    return {'ckpt': args.ckpt, 'attn': describe_attention(model), 'results': res['results']}

def report_passkey(args):
    """Passkey retrieval through lm-eval: --sweep lengths x depths 0-100 %.

    --sweep default 512,1024,2048; --limit samples per cell (default 6). The accuracy table, a
    length x depth heatmap, and per length the softmax_shares."""
    model, _, tok = load(args, 'passkey')
    lengths = parse_list(args.sweep or '512,1024,2048', 'sweep')
    t0 = time.time()
    folder = os.path.join(args.out_dir, 'passkey_task')
    n = args.limit or 6
    prompts = passkey_task(folder, tok, lengths, samples=n, template=args.passkey_template)
    # every sample written
    res = run_lm_eval(args, model, tok, ['passkey_retrieval'], folder, log_samples=True)
    cells = {}   # (length, depth): exact matches
    for smp in res['samples']['passkey_retrieval']:
        doc = smp['doc']
        cells.setdefault((doc['length'], doc['depth']), []).append(float(smp['exact_match']))
    depths = sorted({d for _, d in cells})
    acc = [[statistics.mean(cells[L, d]) for d in depths] for L in lengths]
    rows = ['| tokens | ' + ' | '.join(f'depth {d} %' for d in depths) + ' | mean |',
            '|---' * (len(depths) + 2) + '|']
    rows += [f'| {L} | ' + ' | '.join(f'{a:.2f}' for a in r + [sum(r) / len(r)]) + ' |'
             for L, r in zip(lengths, acc)]
    log('\n'.join(rows)
        + f'\n{describe_attention(model)}: {n} samples per cell, {time.time() - t0:.0f} s')
    shares = {}
    for L in lengths:   # where the attention goes: on the first prompt of each length at depth 50 %
        prompt = next(r['input'] for r in prompts if (r['length'], r['depth']) == (L, 50))
        with torch.no_grad(), softmax_shares(model) as shares[L]:
            model(torch.tensor([tok.encode(prompt)], device=args.device))
        log(f'{L} tokens, depth 50 %{describe_shares(shares[L])}')
    if plt := pyplot():
        fig, ax = plt.subplots(figsize=(4.5, 3))
        fig.colorbar(ax.imshow(acc, vmin=0, vmax=1, cmap='RdYlGn', aspect='auto'))
        ax.set(xticks=range(len(depths)), xticklabels=depths, yticks=range(len(lengths)),
               yticklabels=lengths, xlabel='depth of the key (%)', ylabel='tokens',
               title=f'passkey: {describe_attention(model)}'[:60])
        _save_figure(fig, args.out_dir, 'passkey.png')
    return {'ckpt': args.ckpt, 'attn': describe_attention(model), 'lengths': lengths,
            'depths': depths, 'accuracy': acc, 'samples_per_cell': n, 'softmax_share': shares,
            'seconds': round(time.time() - t0, 1)}

# ---- attention fidelity ------------------------------------------------------
def parse_list(s, what, kind=int):
    """'1,2,4' -> [1, 2, 4]: positive numbers of `kind`, else a one-line error."""
    try:
        vals = [kind(x) for x in s.split(',') if x.strip()]
    except ValueError:
        raise UsageError(
            f'--{what} wants comma-separated {"integers" if kind is int else "numbers"}, got {s!r}')
    if not vals or any(not v > 0 for v in vals):
        raise UsageError(f'--{what} wants positive numbers, got {s!r}')
    return vals

def parse_maps(s):
    """--maps 'elu,exp:t=2' -> [(label, attention.AttnSpec)], the label as written.

    (softmax is the reference they are compared with.)"""
    specs = [m for m in map(str.strip, s.split(',')) if m]
    bad = [m for m in specs if m.partition(':')[0] not in attention.FEATURE_MAPS]
    if bad:
        raise UsageError(
            f'unknown map(s) {", ".join(bad)}: choose from {", ".join(attention.FEATURE_MAPS)}')
    return [(m, attention.AttnSpec.parse(m)) for m in specs]

def parse_heads(s, n_layer, n_head):
    """--heads 'L:H,...' -> [(layer, head)] (at most 6) for the figures.

    Default: the first and last layer, heads 0, 1."""
    if not s:
        return [(li, h) for li in sorted({0, n_layer - 1}) for h in range(min(2, n_head))]
    pairs = [p.split(':') for p in s.split(',')]
    if not all(len(p) == 2 and p[0].isdigit() and p[1].isdigit()
               and int(p[0]) < n_layer and int(p[1]) < n_head for p in pairs):
        raise UsageError(f'--heads wants layer:head pairs, '
                         f'layers 0..{n_layer - 1}, heads 0..{n_head - 1}; got {s!r}')
    return [(int(li), int(h)) for li, h in pairs][:6]

def fidelity_windows(tok, ids, context, n_samples, bert=False):
    """(n, context) windows of consecutive token ids.

    A BERT's are framed as in its training: [CLS] text [SEP]."""
    frame = tok.encode_pair('', None, context)[0] if bert else []   # [CLS] [SEP]
    body = context - len(frame)
    n = min(len(ids) // body, n_samples)
    if n < 1:
        framed = ' (with [CLS] and [SEP])' if bert else ''
        raise UsageError(
            f'need at least --context={context} tokens of text{framed}, got {len(ids)}')
    return torch.tensor([frame[:1] + ids[i * body:(i + 1) * body] + frame[1:] for i in range(n)],
                        dtype=torch.long)

@torch.no_grad()
def fidelity_stats(q, k, maps, causal=True):
    """({name: {metric: (H,)}}, {name: weights}) of maps {name: fn(q, k) -> weights}.

    The metrics: KL(softmax || map), entropy and monotonicity per head, mean over samples and rows
    (softmax first, without KL)."""
    weights = {'softmax': attention.softmax_weights(q, k, causal=causal).float(),
               **{name: fn(q, k).float() for name, fn in maps.items()}}
    stats = {name: {'kl': attention.kl_divergence(weights['softmax'], w).mean((0, 2)),
                    'entropy': attention.attention_entropy(w).mean((0, 2)),
                    'monotonicity':
                        attention.monotonicity(w, q, k, causal=causal)[0].float().mean(0)}
             for name, w in weights.items()}
    del stats['softmax']['kl']
    return stats, weights

def layer_maps(cfg, core, specs, q, k, device):
    """{label: fn(q, k) -> weights}: the maps compared on one layer, beside softmax.

    The layer's own core (unless softmax), then a new core of each of `specs`, calibrated on the
    layer's q, k as convert.py does first (LLN's sigma_q^2, sigma_k^2, the mix form's s); a map with
    nope gets the model's RoPE undone."""
    maps = {}
    if core.spec.name != 'softmax':   # the model's own core, on its device
        maps[f'{core.spec} (model)'] = lambda a, b: core.weights(a.to(device), b.to(device)).cpu()
    for label, spec in specs:
        m = M.make_core(cfg, spec)
        calibrated = hasattr(m.fmap, 'calibrate') or spec.combine == 'mix'
        m.calibrate(q, k)
        maps[label + (' (calibrated)' if calibrated else ' (untrained)')] = m.weights
    return maps

def report_fidelity(args):
    specs = parse_maps(args.maps)
    model, _, tok = load(args)
    cfg = model.config
    cores = model.attention_cores()
    context = args.context or min(cfg.block_size, 128)
    pairs = parse_heads(args.heads, cfg.n_layer, cfg.n_head)
    text, source = load_text(args.data)
    idx = fidelity_windows(tok, tok.encode(text)[:context * args.batch_size], context,
                           args.batch_size, bert=cfg.family == 'bert').to(args.device)
    if not specs and all(c.spec.name == 'softmax' for c in cores):
        specs = parse_maps('elu,performer,cosformer,taylor,hedgehog')
    log(f'tokenizer: {tok.name}; data: {source}; {len(idx)} x {context} tokens; model attention: '
        f'{describe_attention(model)}; q, k from the {args.qk}; compared: '
        f'{", ".join(s[0] for s in specs) or "-"}')
    qk = capture_qk(model, idx, teacher=args.qk == 'teacher')
    torch.manual_seed(0)
    layers = []    # per layer and head, the stats
    summary = {}   # {name: {metric_per_layer: [...], metric_mean: ...}}
    first = []     # per layer, {name: sample 0's weights}
    for li, (core, (q, k)) in enumerate(zip(cores, qk)):
        stats, weights = fidelity_stats(q, k, layer_maps(cfg, core, specs, q, k, args.device),
                                        core.causal)
        layers.append({'layer': li, 'attn': str(core.spec), 'heads': [
            {'head': h, 'softmax': {m: v[h].item() for m, v in stats['softmax'].items()},
             'maps': {n: {m: v[h].item() for m, v in s.items()}
                      for n, s in stats.items() if n != 'softmax'}}
            for h in range(q.shape[1])]})
        for name, s in stats.items():
            row = summary.setdefault(name, {})
            for m, v in s.items():
                row.setdefault(f'{m}_per_layer', [None] * len(cores))[li] = v.mean().item()
        first.append({name: w[0] for name, w in weights.items()})     # sample 0, for the figures
    for s in summary.values():
        s.update({k.replace('per_layer', 'mean'): statistics.mean(v for v in per if v is not None)
                  for k, per in s.items()})
    log(f'{"map":32s} {"KL(softmax||map)":>16s} {"entropy":>9s} {"monotonicity":>12s}  '
        '(mean: layers, heads, rows)')
    for name, s in summary.items():
        # softmax, the reference itself, has no KL
        kl = f'{s["kl_mean"]:16.4f}' if 'kl_mean' in s else f'{"-":>16s}'
        log(f'{name:32s} {kl} {s["entropy_mean"]:9.3f} {s["monotonicity_mean"]:12.3f}')
    return {'ckpt': args.ckpt, 'data': source, 'samples': len(idx), 'context': context,
            'qk': args.qk, 'attn': describe_attention(model), 'maps': list(summary),
            'summary': summary, 'layers': layers,
            'figures': fidelity_figures(args.out_dir, qk, first, layers, summary, pairs, cores)}

def _save_figure(fig, out_dir, name):
    import matplotlib.pyplot as plt
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    log(f'wrote {path}')
    return path

def pyplot():
    """matplotlib.pyplot drawing to files, or None where matplotlib is not installed.

    (Then a line says so.)"""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        log('matplotlib not installed: no figures (the numbers are in the JSON)')
        return None
    plt.switch_backend('Agg')
    return plt

def line_plots(panels, title, ncols=None):
    """A figure of line plots: (fig, axes), or (None, None) without matplotlib.

    panels: [{'series': {label: (xs, ys)}, 'title', 'xlabel', 'xscale', ...}] (the rest goes to
    Axes.set). softmax black; past 10 maps the colours repeat, dashed."""
    plt = pyplot()
    if plt is None:
        return None, None
    ncols = ncols or len(panels)
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.4 * nrows), squeeze=False)
    labels = [lab for lab in dict.fromkeys(lab for p in panels for lab in p['series'])
              if lab != 'softmax']
    for ax, panel in zip(axes.flat, panels):
        for label, (xs, ys) in panel['series'].items():
            if label == 'softmax':
                style = {'color': 'k', 'lw': 2}
            else:   # one colour per label across the panels
                n = labels.index(label)
                style = {'color': f'C{n % 10}', 'ls': '-' if n < 10 else '--'}
            ax.plot(xs, ys, marker='o', ms=3, label=label, **style)
        ax.set(**{k: v for k, v in panel.items() if k != 'series'})
        ax.title.set_fontsize(9)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    return fig, list(axes.flat)

def fidelity_figures(out_dir, qk, weights, layers, summary, pairs, cores):
    """The fidelity report's figures (their files): entropy and KL per layer, heatmaps, a scatter.

    Entropy and KL(softmax || map) per layer, mean over heads; heatmaps, softmax next to each map on
    the (layer, head) pairs, first FIG_TOKENS tokens of sample 0 (Hedgehog Fig. 7/9); the first
    pair's scatter (fidelity_scatter)."""
    panels = []
    for key, title, yscale in (
            ('entropy_per_layer', 'attention entropy (nats, mean over heads and rows)', 'linear'),
            ('kl_per_layer', 'KL(softmax || map) per layer', 'log')):
        series = {name: list(zip(*[(li, max(v, 1e-8))
                                   for li, v in enumerate(s[key]) if v is not None]))
                  for name, s in summary.items() if key in s}
        panels.append({'series': series, 'title': title, 'xlabel': 'layer', 'yscale': yscale,
                       'xticks': range(len(layers))})
    fig, _ = line_plots(panels, 'attention entropy and KL per layer')
    if fig is None:     # no matplotlib
        return []
    import matplotlib.pyplot as plt
    from matplotlib.colors import PowerNorm
    files = [_save_figure(fig, out_dir, 'fidelity_entropy.png')]
    names = list(dict.fromkeys(n for li, _ in pairs for n in weights[li]))
    T = min(FIG_TOKENS, weights[0]['softmax'].shape[-1])
    fig, axes = plt.subplots(len(pairs), len(names),
                             figsize=(2.3 * len(names), 2.3 * len(pairs)), squeeze=False)
    for (r, (li, h)), (c, name) in itertools.product(enumerate(pairs), enumerate(names)):
        ax = axes[r][c]
        vmax = max(float(weights[li]['softmax'][h, :T, :T].max()), 1e-6)   # the row's colour scale
        ax.set(xticks=[], yticks=[])
        if name not in weights[li]:    # a layer the conversion left as softmax
            ax.axis('off')
            continue
        ax.imshow(weights[li][name][h, :T, :T].numpy(), norm=PowerNorm(0.5, vmin=0, vmax=vmax),
                  interpolation='nearest')
        ax.set_title(name.replace(' (', '\n(') if r == 0 else '', fontsize=8)
        ax.set_ylabel(f'layer {li} head {h}' if c == 0 else '', fontsize=8)
        ax.set_xlabel('' if name == 'softmax'
                      else f'KL {layers[li]["heads"][h]["maps"][name]["kl"]:.3f}', fontsize=7)
    fig.suptitle(f'attention weights, first {T} tokens of sample 0 (colour: sqrt scale, shared '
                 'per row); KL(softmax || map) of the head over all rows and samples', fontsize=9)
    files.append(_save_figure(fig, out_dir, 'fidelity_heatmaps.png'))
    li, h = pairs[0]
    return files + [fidelity_scatter(out_dir, qk[li], weights[li], li, h, cores[li].causal)]

def fidelity_scatter(out_dir, qk, weights, li, h, causal):
    """Weight against q.k/sqrt(d) of layer li's head h on the last SCATTER_ROWS query rows.

    Those rows see about T keys each, so their weights are comparable (Hedgehog Fig. 3; rho =
    monotonicity over all rows). qk: the layer's (q, k); weights: {map: sample 0's weights}."""
    import matplotlib.pyplot as plt
    q, k = (x[:1, h:h + 1] for x in qk)                                       # (1, 1, T, D)
    T = q.shape[-2]
    rows = torch.arange(max(T - SCATTER_ROWS, 0), T)
    scores = (q[0, 0, rows].double() @ k[0, 0].double().T) * q.shape[-1] ** -0.5    # (R, T)
    vis = (torch.arange(T)[None, :] <= rows[:, None] if causal   # the keys each row sees
           else torch.ones_like(scores, dtype=torch.bool))
    fig, axes = plt.subplots(1, len(weights), figsize=(2.6 * len(weights), 2.6), squeeze=False)
    for c, (name, w) in enumerate(weights.items()):
        rho = attention.monotonicity(w[h][None, None], q, k, causal=causal)[0]
        ax = axes[0][c]
        ax.scatter(scores[vis].numpy(), w[h][rows][vis].numpy(),
                   s=3, alpha=0.5, color=f'C{c % 10}')
        ax.set_title(f'{name.replace(" (", chr(10) + "(")}\nrho {float(rho.mean()):.2f}',
                     fontsize=8)
        ax.set_xlabel('q.k / sqrt(d)', fontsize=8)
        ax.tick_params(labelsize=6)
    axes[0][0].set_ylabel('attention weight', fontsize=8)
    fig.suptitle(f'weight vs q.k, layer {li} head {h}, last {len(rows)} query rows', fontsize=9)
    return _save_figure(fig, out_dir, 'fidelity_scatter.png')

# ---- LLN Fig. 2: does moment matching make LLN concentrate like softmax? -----
# (label, attention name, map options): the curves of LLN Fig. 2 plus the LLN temperature choices
# and baselines
LLN_FIG2_METHODS = [('softmax', 'softmax', {}),
                    ('lln paper', 'lln', {'match': 'paper'}),
                    ('lln entropy', 'lln', {'match': 'entropy'}),
                    ('lln none', 'lln', {'match': 'none'}),
                    ('elu', 'elu', {}), ('relu', 'relu', {})]

@torch.no_grad()
def lln_fig2(head_dim=64, tokens=256, grid=(1.0, 2.0, 4.0), seeds=3, seed=0):
    """Row entropy (bits) and spectral gap of bidirectional attention by temperature: LLN Fig. 2.

    The softmax temperature is sigma^2 = sigma_q^2 sigma_k^2: q, k ~ N(0, sqrt(sigma^2) I_D), so
    sigma_q^2 = sigma_k^2 = sigma; `seeds` sequences, the same unit draws (generator seed 1000 +
    seed: not the LLN fits' samples) rescaled at every sigma^2, LLN maps calibrated on them.
    {label: {'entropy_bits', 'entropy_std', 'spectral_gap', 'spectral_gap_std'[, 'alpha']}}: per
    sigma^2, mean (std) over sequences."""
    g = torch.Generator().manual_seed(1000 + seed)
    q0, k0 = (torch.randn(seeds, 1, tokens, head_dim, generator=g, dtype=torch.float64)
              for _ in range(2))
    res = {label: {} for label, _, _ in LLN_FIG2_METHODS}
    for s2, (label, name, opts) in itertools.product(grid, LLN_FIG2_METHODS):
        q = q0 * s2 ** 0.25   # sigma_q^2 = sigma_k^2 = sigma
        k = k0 * s2 ** 0.25
        core = hybrids.Attention(attention.AttnSpec(name, options=opts), head_dim, 1, causal=False)
        if name == 'lln':
            core.fmap.calibrate(q, k)
            res[label].setdefault('alpha', []).append(core.fmap.alpha_beta()[0].item())
        w = core.weights(q, k).double()
        bits = attention.attention_entropy(w).mean((1, 2)) / math.log(2)   # (seeds,)
        gap = attention.spectral_gap(w)[:, 0]                                 # (seeds,)
        for key, std_key, v in (('entropy_bits', 'entropy_std', bits),
                                ('spectral_gap', 'spectral_gap_std', gap)):
            res[label].setdefault(key, []).append(v.mean().item())
            res[label].setdefault(std_key, []).append(v.std().item() if seeds > 1 else 0.0)
    return res

def report_lln(args):
    """LLN Fig. 2 at head_dim 64 (the paper's; its fit is published for it).

    --context tokens per sequence (default 256), --batch_size sequences, --sweep temperatures
    sigma^2."""
    grid = parse_list(args.sweep or LLN_GRID, 'sweep', float)
    D = 64
    T = args.context or 256
    n = args.batch_size
    if T < 2 or n * T * T > 2**28:   # (its T x T weights, float64)
        raise UsageError(
            f'--lln wants --context >= 2 and --batch_size x --context^2 <= 2^28, got {n} x {T}^2')
    a, b = attention.lln_fit(D)
    curves = lln_fig2(D, T, grid, n)
    ref = curves['softmax']['entropy_bits']
    near = [i for i, s2 in enumerate(grid) if 1 <= s2 <= 4]
    err = {lab: max((abs(d['entropy_bits'][i] - ref[i]) for i in near), default=None)
           for lab, d in curves.items() if lab != 'softmax'}
    log(f'LLN Fig. 2 on Gaussian q, k: head_dim {D}, {T} tokens, bidirectional, {n} sequences; '
        f'sigma^2 = sigma_q^2 sigma_k^2 with sigma_q^2 = sigma_k^2; moment-matching fit '
        f'a s~^2 + b: a = {a:.4f} b = {b:+.4f} (published for D = 64: a = 0.1486 b = -0.3549)')
    for key, title in LLN_CURVES:
        log(f'{title}, mean over {n} sequences\n{"sigma^2":>8s} '
            + ' '.join(f'{lab:>11s}' for lab in curves))
        for i, s2 in enumerate(grid):
            log(f'{s2:8.3g} ' + ' '.join(f'{d[key][i]:11.3f}' for d in curves.values()))
    log('max |entropy - softmax entropy| over sigma^2 in [1, 4] (bits): '
        + ', '.join(f'{lab} {e:.2f}' for lab, e in err.items() if e is not None))
    panels = [{'series': {lab: (grid, d[key]) for lab, d in curves.items()}, 'ylabel': ylabel,
               'xlabel': 'temperature sigma^2 = sigma_q^2 sigma_k^2'} for key, ylabel in LLN_CURVES]
    fig, axes = line_plots(
        panels, f'LLN Fig. 2 on Gaussian q, k (head_dim {D}, {T} tokens, bidirectional)')
    for ax in axes or []:
        ax.axvspan(1, 4, color='0.92', zorder=0)
        for line in ax.lines:                       # the baselines dashed
            line.set_linestyle('--' if line.get_label() in ('elu', 'relu') else '-')
        ax.legend(fontsize=7)
    return {'head_dim': D, 'tokens': T, 'seeds': n, 'seed': 0, 'grid_sigma2': grid,
            'fits': {'paper': {'a': a, 'b': b}}, 'curves': curves, 'max_entropy_error_1_4': err,
            'figures': [_save_figure(fig, args.out_dir, 'lln.png')] if fig else []}

# ---- benchmarks --------------------------------------------------------------
def timed(fn, number=0):
    """Seconds per call of fn(), by torch.utils.benchmark.Timer.

    CUDA synchronised, on the process's torch threads: the median over blocked_autorange (which
    warms up), or the mean of `number` calls after 2 warm-up (Timer.timeit)."""
    t = benchmark.Timer('fn()', globals={'fn': fn}, num_threads=torch.get_num_threads())
    return t.timeit(number).mean if number else t.blocked_autorange(min_run_time=0.2).median

def _proc_mb(key):
    """A /proc/self/status size (VmRSS, VmHWM) in MB; None without /proc."""
    try:
        with open('/proc/self/status') as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith(key + ':'))
    except (OSError, StopIteration):
        return None

def peak_memory_mb(fn, device):
    """Extra memory at the peak of one call of fn(), MB; None where it cannot be measured.

    On CUDA torch.cuda.max_memory_allocated above the allocation before; on a Linux CPU the peak
    resident set (VmHWM, reset through /proc/self/clear_refs) above the resident set before, glibc
    told to mmap blocks >= 64 KiB so that freed tensors leave it."""
    if torch.device(device).type == 'cuda':
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    try:
        ctypes.CDLL('libc.so.6').mallopt(-3, 64 * 1024)   # M_MMAP_THRESHOLD
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')
    except (OSError, AttributeError):
        return None
    base = _proc_mb('VmRSS')
    fn()
    return max(_proc_mb('VmHWM') - base, 0.0)

def bench_model(spec, block_size, n_layer, n_head, n_embd, device):
    """A random gpt2-style model (vocab 256) with attention `spec` in every layer."""
    torch.manual_seed(0)
    return M.build(M.GPTConfig(family='gpt2', vocab_size=256, block_size=block_size,
                               n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                               attn=str(spec))).to(device).eval()

@torch.no_grad()
def bench_forward(part, lengths, specs, device):
    """Median ms (Timer) and peak extra memory per map and length: part 'attention' or 'prefill'.

    'attention': one core on random q, k, v (fp16 on CUDA; softmax by SDPA, the maps chunked or by
    the Triton kernel on CUDA); 'prefill': one forward of T tokens through a random model (the
    setups: BENCH_TABLES' captions)."""
    rows = []
    dtype = torch.float16 if torch.device(device).type == 'cuda' else torch.float32
    for label, spec in [('softmax', attention.AttnSpec())] + specs:
        m = hybrids.Attention(spec, 64, 12).to(device) if part == 'attention' else \
            bench_model(spec, max(lengths), 2, 12, 768, device)
        for T in lengths:   # x: q, k, v or the token ids
            x = torch.randn(3, 1, 12, T, 64, device=device, dtype=dtype).unbind(0) \
                if part == 'attention' else [torch.randint(0, 256, (1, T), device=device)]
            fn = lambda: m(*x)  # noqa: E731
            rows.append({'T': T, 'attn': label, 'peak_mb': peak_memory_mb(fn, device),
                         'ms': timed(fn) * 1e3})
            log(f'  {part} T={T:6d} {label:12s} {rows[-1]["ms"]:9.2f} ms  '
                f'peak +{rows[-1]["peak_mb"] or 0:8.1f} MB')
    return rows

def step_ops(fn):
    """The kernels one call of fn() issues: its top-level aten ops and Triton launches.

    By torch.profiler; what runs inside another aten op or a launch (as the interpreter's own ops)
    is not counted."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()

    def top_level(e):
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith(('aten::', 'triton::')):
            parent = parent.cpu_parent
        return parent is None
    return sum(1 for e in prof.events()
               if e.name.startswith(('aten::', 'triton::')) and top_level(e))

@torch.no_grad()
def bench_decode(lengths, specs, device, model=None, teacher=True, batches=(1,), graph=False):
    """Per-token decode time and memory at generated length L, greedy, for each batch size B.

    model.prefill builds the state of the first L - DECODE_STEPS - 2 tokens of B random rows (the KV
    cache or recurrent state generation would hold), then Timer.timeit runs 2 warm-up and
    DECODE_STEPS timed steps up to L (their mean): model.decode_step, or with graph the step
    on buffers of its own (model.DecodeGraph: replayed as a CUDA graph, or compiled on the CPU);
    tokens/s: B / time per step. aten_ops: the kernels of one eager step (step_ops). Memory: the
    attention state (exact) and the process RSS. Random models of softmax and each map, or `model`'s
    attention against its softmax teacher (teacher=False: alone)."""
    rows = []
    own = specs if model is None else [(describe_attention(model), None)]
    for label, spec in [('softmax', attention.AttnSpec())] * (model is None or teacher) + own:
        m = model or bench_model(spec, max(lengths) + 1, 1, 2, 128, device)
        # capture_qkv for its teacher mode only: no layer recorded
        with m.capture_qkv(layers=(), teacher=model is not None and label == 'softmax'):
            for B, L in itertools.product(batches, lengths):
                steps = min(DECODE_STEPS, max(L // 2, 1))
                pos = max(L - steps - 3, 1)
                logits, states = m.prefill(
                    torch.randint(0, m.config.vocab_size, (B, pos), device=device))
                run = {'tok': logits.argmax(-1),
                       'pos': torch.full((1,), pos, device=device), 'states': states}

                def step():
                    logits, run['states'] = m.decode_step(run['tok'], run['pos'], run['states'])
                    run['tok'] = logits.argmax(-1)
                    run['pos'] = run['pos'] + 1
                ops = step_ops(step)
                if graph:   # from here on the step is the graph's
                    g = M.DecodeGraph(m, run['tok'], run['pos'], run['states'], L + 1)
                    run['states'] = g.states

                    def step():
                        run['tok'] = g(run['tok']).argmax(-1)
                sec = timed(step, steps)
                name = label + (f', B={B}' if len(batches) > 1 else '')
                rows.append({'attn': name, 'batch': B, 'length': L, 'ms_per_token': sec * 1e3,
                             'tokens_per_s': B / sec, 'aten_ops': ops, 'rss_mb': _proc_mb('VmRSS'),
                             'state_mb': m.decode_state_nbytes(run['states']) / 2**20})
                del run, states, logits
                log(f'  decode {name:12s} at {L:6d} tokens: {sec * 1e3:7.3f} ms/token, '
                    f'{B / sec:9.1f} tokens/s, {ops} kernels, '
                    f'state {rows[-1]["state_mb"]:9.3f} MB, RSS {rows[-1]["rss_mb"] or 0:8.1f} MB')
    return rows

BENCH_TABLES = {   # part: (x, (time, memory), caption, cell)
    'attention': ('T', ('ms', 'peak_mb'),
                  'Attention layer (B=1, 12 heads, head_dim 64), median ms / peak extra memory MB',
                  lambda r: f'{r["ms"]:.2f} ms / {r["peak_mb"] or 0:.1f}'),
    'prefill': ('T', ('ms', 'peak_mb'),
                'Model prefill (gpt2-style, 2 layers, 12 heads, n_embd 768, vocab 256), '
                'median ms / peak extra memory MB',
                lambda r: f'{r["ms"]:.1f} ms / {r["peak_mb"] or 0:.1f}'),
    'decode': ('length', ('ms_per_token', 'state_mb'),
               'Decode ({decode_model}), per-token ms (tokens/s), attention state MB, process RSS '
               'MB, kernels (aten ops, Triton launches) per step, vs generated length',
               lambda r: f'{r["ms_per_token"]:.3f} ms ({r["tokens_per_s"]:.0f}/s), '
                         f'state {r["state_mb"]:.2f}, RSS {r["rss_mb"] or 0:.0f}, '
                         f'{r["aten_ops"]} kernels')}

def bench_markdown(res):
    """A table per part, a row per length, a column per map.

    Then, for decode, per map: the longest length's figures over the shortest's."""
    out = []
    for part, (x, _, caption, cell) in BENCH_TABLES.items():
        rows = res.get(part)
        if not rows:
            continue
        cols = list(dict.fromkeys(r['attn'] for r in rows))
        out += [caption.format(**res['config']) + ':', '', f'| {x} | ' + ' | '.join(cols) + ' |',
                '|---:|' + '---:|' * len(cols)]
        for v in sorted({r[x] for r in rows}):
            cells = {r['attn']: cell(r) for r in rows if r[x] == v}
            out.append(f'| {v} | ' + ' | '.join(cells.get(a, '-') for a in cols) + ' |')
        out.append('')
    for a in dict.fromkeys(r['attn'] for r in res.get('decode') or []):
        rr = sorted((r for r in res['decode'] if r['attn'] == a), key=lambda r: r['length'])
        x = {k: (rr[-1][k] or 0) / (rr[0][k] or 1) for k in ('ms_per_token', 'state_mb', 'rss_mb')}
        out.append(f'- {a}, {rr[0]["length"]} -> {rr[-1]["length"]} tokens: per-token time '
                   f'x{x["ms_per_token"]:.2f}, state x{x["state_mb"]:.2f}, RSS x{x["rss_mb"]:.2f}')
    return '\n'.join(out)

def report_bench(args):
    """--bench attention,prefill,decode (or all) of --maps (default elu) against softmax.

    At the --sweep lengths (default: BENCH_SWEEPS)."""
    parts = [w.strip() for w in args.bench.split(',') if w.strip()]
    if not parts or not set(parts) <= set(BENCH_SWEEPS) | {'all'}:
        raise UsageError(
            f'--bench {args.bench!r}: choose from {", ".join([*BENCH_SWEEPS, "all"])}, '
            'comma-separated')
    specs = parse_maps(args.maps or 'elu')
    cuda = torch.device(args.device).type == 'cuda'
    n = torch.get_num_threads()
    cfg = {'threads': n, 'maps': [s[0] for s in specs],
           'device_name': torch.cuda.get_device_name() if cuda
           else f'{os.cpu_count()}-core CPU ({n} torch threads)',
           'memory': 'cuda max_memory_allocated' if cuda else 'VmHWM - VmRSS (clear_refs)',
           'decode_model': f'gpt2-style, 1 layer, 2 heads of 64, vocab 256; greedy, mean of '
                           f'{DECODE_STEPS} steps after prefill',
           'loadavg': list(os.getloadavg()) if hasattr(os, 'getloadavg') else None}
    res = {'config': cfg}
    model = None
    batches = parse_list(args.decode_batch or '1', 'decode_batch')
    for part in BENCH_SWEEPS if 'all' in parts else parts:
        lengths = parse_list(args.sweep or BENCH_SWEEPS[part], 'sweep')
        mine = ', '.join(cfg['maps'])
        # a real checkpoint: its own attention against its softmax teacher
        if part == 'decode' and args.ckpt:
            model = load(args, 'bench decode', with_tokenizer=False)[0]
            cfg['decode_model'] = (
                f'{args.ckpt}, {model.get_num_params() / 1e6:.1f}M parameters, vs its softmax '
                f'teacher; greedy, mean of {DECODE_STEPS} steps after prefill')
            mine = describe_attention(model)
        log(f'{part}: {mine} vs softmax at lengths {lengths}')
        res[part] = (bench_decode(lengths, specs, args.device, model, args.teacher, batches,
                                  args.graph) if part == 'decode'
                     else bench_forward(part, lengths, specs, args.device))
    md = bench_markdown(res)
    res['table'] = os.path.join(args.out_dir, 'bench.md')
    with open(res['table'], 'w') as f:
        f.write(f'{cfg["device_name"]}, torch {torch.__version__}; memory: {cfg["memory"]}; '
                f'load average at the start {cfg["loadavg"]}\n\n{md}\n')
    log(md)
    res['figure'] = bench_figure(res, args.out_dir)
    return res

def bench_figure(res, out_dir):
    """report_bench's figure, its file (None without matplotlib).

    Per part, time (top row) and memory (bottom row) against length, log-log, a line per map."""
    panels = []
    for row, p in itertools.product((0, 1), [p for p in BENCH_TABLES if res.get(p)]):
        x = BENCH_TABLES[p][0]
        y = BENCH_TABLES[p][1][row]   # its time or memory
        series = {a: list(zip(*[(r[x], max(r[y] or 0, 1e-3)) for r in res[p] if r['attn'] == a]))
                  for a in dict.fromkeys(r['attn'] for r in res[p])}
        panels.append({'series': series, 'title': f'{p}: {y}', 'xlabel': x,
                       'xscale': 'log', 'yscale': 'log'})
    fig, _ = line_plots(panels, f'{res["config"]["device_name"]}, torch {torch.__version__}',
                        ncols=len(panels) // 2)
    return _save_figure(fig, out_dir, 'bench.png') if fig else None

# ---- command line ------------------------------------------------------------
@dataclass
class EvalConfig:   # the flags (train.parse_config); the reports first, one per run
    ppl: bool = False             # perplexity on --data (text file, folder, datasets name)
    glue: Literal[('', *train.GLUE_TASKS)] = ''   # GLUE task on its validation split
    rouge: bool = False           # ROUGE-1/2/L of greedy summaries of dialogues (JSONL or SAMSum)
    generate: bool = False        # greedy continuations by the model (and
                                  # a convert.py folder's softmax teacher)
    fidelity: bool = False        # attention fidelity: KL to softmax,
                                  # entropy, monotonicity, with figures
    bench: str = ''               # comma-separated, of attention, prefill, decode, all
    lln: bool = False             # LLN Fig. 2: entropy and spectral gap vs
                                  # temperature on Gaussian q, k (no --ckpt)
    lm_eval: str = ''             # lm-evaluation-harness tasks,
                                  # comma-separated (pip install lm-eval)
    passkey: bool = False         # passkey retrieval by length (--sweep) and depth, through lm-eval
    passkey_template: Literal['eval', 'eval2'] = 'eval'   # its wording (train.PASSKEY_TEMPLATES)
    lm_eval_include: str = ''     # a folder of local lm-eval task yamls (dataset_path: json)
    ckpt: str = ''                # train.py checkpoint or out_dir, convert.py
                                  # folder, HF folder or hub name, .gguf file
    attn: str = ''                # load --ckpt with this attention: e.g.
                                  # lolcats:window=64:sinks=4:cache=256 (trained maps
                                  # kept if only impl/sinks/cache/decay/nope change)
    rope_theta: float = num(0.0, ge=0)   # llama: RoPE's base in place of the checkpoint's
                                  # (0: its own); past the trained length L, NTK-aware
                                  # scaling to F x L: theta F^(D/(D-2)), D the head size
                                  # (RESULTS 21.7)
    tokenizer: str = ''           # a HF folder or .gguf file whose
                                  # tokenizer replaces the model's own
    data: str = ''                # input data (see each report)
    out_dir: str = 'out/eval'     # where JSON (and PNG) results go
    device: str = 'cuda' if torch.cuda.is_available() else 'cpu'   # auto | cpu | cuda | cuda:N
    batch_size: int = num(8, ge=1)   # sequences per forward pass: ppl windows,
                                     # GLUE examples, fidelity/lln samples
    context: int = num(0, ge=0)   # tokens per window, 0 = ppl min(block_size, 1024),
                                  # fidelity min(block_size, 128), lln 256; generate: prompts
                                  # of N tokens cut from --data (0: one per line); lm_eval:
                                  # the longest loglikelihood input (0 = block_size)
    stride: int = num(0, ge=0)    # ppl (and lm_eval's rolling windows) stride (0 = context // 2)
    limit: int = num(0, ge=0)     # only the first N (0 = all): ppl tokens, GLUE/ROUGE
                                  # examples, generate prompts (with --context: N
                                  # passages, default 3), lm_eval documents per task;
                                  # passkey: samples per length and depth (default 6)
    max_new_tokens: int = num(64, ge=0)   # rouge, generate (learned positions: within block_size)
    prompt: list[str] = field(default_factory=list)   # generate: a prompt (repeat
                                                      # the flag for several)
    maps: str = ''                # maps against softmax, with options (exp:t=2): bench
                                  # (default elu), fidelity (default for a softmax
                                  # model: elu,performer,cosformer,taylor,hedgehog)
    teacher: bool = True          # bench decode --ckpt: time its softmax
                                  # teacher too (--no_teacher: the model only)
    decode_batch: str = ''        # bench decode: batch sizes, comma-separated (default 1)
    graph: bool = False           # bench decode, generate: the one-token step
                                  # replayed as a CUDA graph (cuda), compiled (cpu)
    qk: Literal['model', 'teacher'] = 'model'   # fidelity: q, k from the model's own pass,
                                                # or from its softmax teacher's (every core
                                                # in teacher mode, as convert.py measures it)
    heads: str = ''               # fidelity figures: layer:head pairs, e.g. 0:0,11:3
                                  # (default first and last layer, heads 0 and 1; at most 6)
    sweep: str = ''               # bench: lengths (default attention 512..8192,
                                  # prefill 256..4096, decode 512..32768, doubling);
                                  # lln: temperatures sigma^2 (default 0.25..6)

    def __post_init__(self):
        chosen = [name for name in REPORTS if getattr(self, name)]
        if len(chosen) != 1:
            raise ValueError(
                f'choose exactly one report: --{", --".join(REPORTS)} (got {len(chosen)})')
        self.report = chosen[0]
        train.check_ranges(self)
        self.device = train.check_device(self.device)
        parse_list(self.decode_batch or '1', 'decode_batch')   # checked here
        if self.graph and self.device.split(':')[0] not in ('cuda', 'cpu'):
            raise UsageError(f'--graph runs on cuda (a CUDA graph) or cpu (compiled), '
                             f'not {self.device}')
        parse_maps(self.maps)   # their specs, checked here
        attention.AttnSpec.parse(self.attn or 'softmax')

def main(argv=None):
    """Runs one report: 0, or 2 and one line `eval.py: error: ...` on bad input."""
    try:
        args, _ = train.parse_config(EvalConfig, argv, __doc__)
        os.makedirs(args.out_dir, exist_ok=True)
        torch.manual_seed(0)
        res = {'report': args.report, **globals()['report_' + args.report](args)}
    except SystemExit as e:   # parse_config printed its one line
        return e.code
    except train.USER_ERRORS as e:
        # one line (a bug, any other exception, keeps its traceback)
        print(f"eval.py: error: {(str(e).splitlines() or [''])[0]}", file=sys.stderr)
        return 2
    with open(os.path.join(args.out_dir, f'{args.report}.json'), 'w') as f:
        json.dump(res, f, indent=1, default=float)
    log(f'wrote {os.path.join(args.out_dir, args.report + ".json")}')
    return 0

if __name__ == '__main__':
    sys.exit(main())
