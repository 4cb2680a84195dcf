"""tokenizer.py and the tokenizer that travels with a model: BPETokenizer against HF's `tokenizers` on tiny
vocabularies for each pre-tokenizer, spec round trips, the no-tokenizer rules, and the user story end to end: a
BERT finetuned with train.py --init_from <HF folder> carries its tokenizer into ckpt.pt, convert.py --init_from
that checkpoint encodes with it (the HF tokenizer's ids, not bytes), and eval.py on the converted folder too."""
import json
import os
import shutil

import numpy as np
import pytest
import torch

import convert as C
import eval as ev
import model as M
import tokenizer as T
import train

tokenizers = pytest.importorskip('tokenizers')
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers  # noqa: E402

CORPUS = ["Hello world, it's 2024: the 12 cats (and 3 dogs) weren't there.", "  indented\n\tand tabs 42\n\n7 x",
          "I'LL say it's 99.5% done -- Don't you think? 1st, 2nd and 3rd.", "numbers 1234567 and a 12:30 meeting"] * 20
TEXTS = ["Hello world", "it's 2024 now", "a  1 b \n 2\n\n3", "x   42   y", "I'LL GO, they'RE here 's",
         "tabs\t\t9 and \r\n newlines\n\n\n", "unseen: é, 中文, 😀 and \x04", "  leading  and trailing  ", "",
         "<|endoftext|> starts and ends <|endoftext|>", "3.14159 and 1,000,000", "don't stop 100%!"]
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def hf_bpe(pre, full_alphabet=True):
    """A tiny byte-level BPE trained with HF tokenizers, pre-tokenized as llama.cpp's `pre` type describes."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre_tok = {'gpt2': byte_level,
               'smollm': pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]),
               'llama-bpe': pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), 'isolated'),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                              use_regex=False)])}[pre]
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tok, decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet() if full_alphabet else []
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=420, special_tokens=['<|endoftext|>'],
                                                        initial_alphabet=alphabet, show_progress=False))
    return tok


def ours_from(hf, pre):
    model = json.loads(hf.to_str())['model']
    tokens = [t for t, _ in sorted(model['vocab'].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else ' '.join(m) for m in model['merges']]
    types = [T.CONTROL if t == '<|endoftext|>' else T.NORMAL for t in tokens]
    return T.BPETokenizer(tokens, merges, types, pre=pre, eos_id=tokens.index('<|endoftext|>'))


@pytest.mark.parametrize('pre,full', [('gpt2', True), ('smollm', True), ('smollm', False), ('llama-bpe', True)])
def test_bpe_matches_hf_tokenizers(pre, full):
    hf = hf_bpe(pre, full)
    ours = ours_from(hf, pre)
    if not full:
        assert ours._missing          # bytes absent from the vocabulary: HF drops them, so do we
    for text in TEXTS + CORPUS[:4]:
        want = hf.encode(text, add_special_tokens=False).ids          # HF matches its special tokens in text
        assert ours.encode(text, special=True) == want, (pre, text)
        if '<|endoftext|>' not in text:
            assert ours.encode(text) == want
            if full:
                assert ours.decode(ours.encode(text)) == text
    assert ours.encode('<|endoftext|>') != [ours.eos_id] and ours.encode('<|endoftext|>', special=True) == [ours.eos_id]


def test_smollm_digits_split_before_the_gpt2_regex():
    """llama.cpp's smollm: \\p{N} first, then the GPT-2 regex on each stretch -- whitespace before a digit is a
    piece of its own (GPT-2's regex alone would give ' ' + ' 1')."""
    import regex
    pat = T.PRE_TOKENIZERS['smollm']
    assert regex.findall(pat, 'a  12 b') == ['a', '  ', '1', '2', ' b']
    assert regex.findall(T.PRE_TOKENIZERS['gpt2'], 'a  12 b') == ['a', ' ', ' 12', ' b']
    with pytest.raises(T.TokenizerError, match="unsupported GGUF pre-tokenizer 'qwen9'; supported:"):
        T.BPETokenizer(['a'], [], pre='qwen9')


def test_spec_round_trips_and_fingerprints(tmp_path):
    import tiktoken
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({b'he': 256, b'll': 257, b'hell': 258})
    enc = tiktoken.Encoding('tiny', pat_str=T._GPT2_PAT, mergeable_ranks=ranks, special_tokens={'<|endoftext|>': 259})
    toks = [T.ByteTokenizer(), T.TiktokenTokenizer(enc), ours_from(hf_bpe('smollm'), 'smollm'),
            T.HFTokenizer.from_folder(_bert_folder(tmp_path))]
    for tok in toks:
        spec = json.loads(json.dumps(tok.to_spec()))          # JSON-serialisable
        back = T.load_tokenizer(spec)
        assert type(back) is type(tok) and back.fingerprint == tok.fingerprint and len(tok.fingerprint) == 64
        for text in ('hello world 42', "it's a cat"):
            assert back.encode(text) == tok.encode(text)
        assert back.encode_pair('a cat', 'the dog', 16) == tok.encode_pair('a cat', 'the dog', 16)
    assert len({t.fingerprint for t in toks}) == len(toks)
    with pytest.raises(T.TokenizerError, match="unknown tokenizer spec kind 'nope'"):
        T.load_tokenizer({'kind': 'nope'})


def test_no_tokenizer_rules():
    assert isinstance(T.tokenizer_for_vocab(257), T.ByteTokenizer)
    with pytest.raises(T.TokenizerError, match=r"vocab_size 1000 is not that of a project tokenizer .*--tokenizer"):
        T.tokenizer_for_vocab(1000)
    with pytest.raises(T.TokenizerError, match="has 257 tokens but the model's vocab_size is 100"):
        T.check_fits(T.ByteTokenizer(), 100)
    ids, types = T.ByteTokenizer().encode_pair('ab', 'c', max_len=5)     # [eot] a [eot] b [eot], truncated
    assert ids == [256, 97, 256, 99, 256] and types == [0, 0, 0, 1, 1]


# ---- the user story: a BERT finetuned from a HF folder keeps its tokenizer ---------------------------------

WORDS = 'the cat sat on mat a dog ran home we like green tea she reads books of'.split()


def _bert_folder(tmp_path, name='bert', with_tokenizer=True, num_labels=2):
    transformers = pytest.importorskip('transformers')
    folder = tmp_path / name
    if folder.exists():
        return str(folder)
    folder.mkdir()
    vocab = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] + WORDS + ['##s', '##ed']
    (folder / 'vocab.txt').write_text('\n'.join(vocab) + '\n')
    if with_tokenizer:
        tok = transformers.BertTokenizerFast(str(folder / 'vocab.txt'))     # (transformers 5 ignores vocab_file=)
        assert len(tok) == len(vocab) and tok.unk_token_id not in tok.encode('the cats reads')
        tok.save_pretrained(str(folder))
    else:
        os.remove(folder / 'vocab.txt')
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=64, num_labels=num_labels)
    transformers.BertForSequenceClassification(cfg).save_pretrained(str(folder))
    return str(folder)


def _cola(tmp_path):
    d = tmp_path / 'cola'
    d.mkdir(exist_ok=True)
    good = ['the cat sat on the mat', 'a dog ran home', 'we like green tea', 'she reads books']
    bad = ['cat the mat on sat', 'ran dog a home', 'tea green like we', 'books she reads the of']
    rows = [f"{s}\t1" for s in good] + [f"{s}\t0" for s in bad]
    (d / 'train.tsv').write_text('\n'.join(rows * 2) + '\n')
    (d / 'dev.tsv').write_text('\n'.join(rows) + '\n')
    return str(d)


def test_user_story_bert_tokenizer_travels(tmp_path, monkeypatch, capsys):
    transformers = pytest.importorskip('transformers')
    bert, data = _bert_folder(tmp_path), _cola(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(bert)
    # 1. train.py --task glue --init_from <HF folder>: ckpt.pt carries the folder's tokenizer
    out = str(tmp_path / 'ft')
    train.main(['--task', 'glue', '--glue_task', 'cola', '--data', data, '--init_from', bert, '--seq_len', '32',
                '--max_iters', '2', '--eval_interval', '2', '--batch_size', '4', '--device', 'cpu', '--out_dir', out])
    ft, _ = M.load_checkpoint(os.path.join(out, 'ckpt.pt'))
    assert isinstance(ft.tokenizer, T.HFTokenizer)
    assert ft.tokenizer.fingerprint == T.HFTokenizer.from_folder(bert).fingerprint
    # 2. convert.py --init_from that checkpoint encodes GLUE with it: exactly the HF tokenizer's ids
    seen = {}

    class Recording(C.GlueData):
        def __init__(self, train_rows, *a, **k):
            seen['train'] = train_rows
            super().__init__(train_rows, *a, **k)
    monkeypatch.setattr(C, 'GlueData', Recording)
    conv = str(tmp_path / 'conv')
    capsys.readouterr()
    C.run(C.get_parser().parse_args([
        '--init_from', os.path.join(out, 'ckpt.pt'), '--task', 'glue', '--glue_task', 'cola', '--data', data,
        '--attn', 'hedgehog', '--stage1_iters', '1', '--stage2_iters', '1', '--block_size', '32', '--batch_size', '4',
        '--eval_batches', '1', '--log_interval', '1000', '--out_dir', conv]))
    assert 'tokenizer: hf:' in capsys.readouterr().out
    rows = train.load_glue('cola', data, 'train')
    want = [hf(a, b, truncation=True, max_length=32) for a, b, _ in rows]
    assert [r['input_ids'] for r in seen['train']] == [list(w['input_ids']) for w in want]
    assert [r['token_type_ids'] for r in seen['train']] == [list(w['token_type_ids']) for w in want]
    assert seen['train'][0]['input_ids'][0] == hf.cls_token_id                # not byte ids
    assert not any(hf.unk_token_id in r['input_ids'] for r in seen['train'])  # every word is in the vocabulary
    manifest = C.read_manifest(conv)
    assert manifest['tokenizer']['fingerprint'] == ft.tokenizer.fingerprint
    assert C.load_converted(conv).tokenizer.fingerprint == ft.tokenizer.fingerprint
    # 3. eval.py on the converted folder uses it too
    ev_out = str(tmp_path / 'ev')
    assert ev.main(['--ckpt', conv, '--glue', 'cola', '--data', data, '--out_dir', ev_out]) == 0
    with open(os.path.join(ev_out, 'glue.json')) as f:
        assert json.load(f)['tokenizer'].startswith('hf:')
    # 4. a base whose tokenizer changed is an error
    ft.tokenizer = T.ByteTokenizer()
    M.save_checkpoint(os.path.join(out, 'ckpt.pt'), ft)
    with pytest.raises(C.ConversionError, match="base model's tokenizer .* is not the one this folder was saved"):
        C.load_converted(conv)


def test_model_without_tokenizer_is_an_error_not_byte_ids(tmp_path, capsys):
    """A BERT folder without tokenizer files (vocab 22, not a project tokenizer's): train.py, convert.py and
    eval.py stop with a one-line error asking for --tokenizer; with --tokenizer they run on its ids."""
    bare, data, bert = _bert_folder(tmp_path, 'bare', with_tokenizer=False), _cola(tmp_path), _bert_folder(tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train.main(['--task', 'glue', '--data', data, '--init_from', bare, '--max_iters', '1', '--device', 'cpu',
                    '--out_dir', str(tmp_path / 'o')])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert 'carries no tokenizer' in err and '--tokenizer' in err and len(err.strip().splitlines()) == 1
    argv = ['--init_from', bare, '--task', 'glue', '--data', data, '--stage1_iters', '0', '--stage2_iters', '0',
            '--block_size', '32', '--eval_batches', '1', '--out_dir', str(tmp_path / 'c')]
    assert C.main(argv) == 2
    assert 'pass --tokenizer' in capsys.readouterr().err
    assert C.main(argv + ['--tokenizer', bert]) == 0
    assert C.load_converted(str(tmp_path / 'c')).tokenizer.fingerprint == T.HFTokenizer.from_folder(bert).fingerprint
    # an old checkpoint without a tokenizer, and a tokenizer with more ids than the model has
    torch.manual_seed(0)
    gpt = M.GPT(M.GPTConfig(family='gpt2', vocab_size=20, block_size=32, n_layer=1, n_head=2, n_embd=16))
    M.save_checkpoint(str(tmp_path / 'old.pt'), gpt)
    text = tmp_path / 't.txt'
    text.write_text('the cat sat on the mat ' * 20)
    base = ['--ckpt', str(tmp_path / 'old.pt'), '--ppl', '--data', str(text), '--context', '16',
            '--out_dir', str(tmp_path / 'e')]
    assert ev.main(base) == 2
    assert 'vocab_size 20 is not that of a project tokenizer' in capsys.readouterr().err
    assert ev.main(base + ['--tokenizer', bert]) == 2       # 22 tokens > vocab_size 20
    assert 'its ids would be out of range' in capsys.readouterr().err
