"""tokenizer.py and the tokenizer that travels with a model: the GGUF byte-level BPE (HFTokenizer.from_bpe)
against HF's `tokenizers` trained on tiny vocabularies for each pre-tokenizer, BERT's WordPiece and classifier
pairs against transformers, spec round trips, the no-tokenizer rules, bytes as the default for training from
scratch whether or not tiktoken's files are cached (issue 22), and the user story end to end: a
BERT finetuned with train.py --init_from <HF folder> carries its tokenizer into ckpt.pt, convert.py --init_from
that checkpoint encodes with it (the HF tokenizer's ids, not bytes), and eval.py on the converted folder too."""
import json
import os
import shutil
import types

import numpy as np
import pytest
import tokenizers
import torch
import transformers
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

import convert as C
import eval as ev
import model as M
import tokenizer as T
import train


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
    return T.HFTokenizer.from_bpe(tokens, merges, types, pre=pre, eos_id=tokens.index('<|endoftext|>'))


@pytest.mark.parametrize('pre,full', [('gpt2', True), ('smollm', True), ('smollm', False), ('llama-bpe', True)])
def test_bpe_matches_hf_tokenizers(pre, full):
    hf = hf_bpe(pre, full)
    ours = ours_from(hf, pre)
    if not full:    # bytes absent from the vocabulary: HF drops them, so do we
        assert not set(pre_tokenizers.ByteLevel.alphabet()) <= set(json.loads(hf.to_str())['model']['vocab'])
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
        T.HFTokenizer.from_bpe(['a'], [], pre='qwen9')


def test_spec_round_trips_and_fingerprints(tmp_path):
    import tiktoken
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({b'he': 256, b'll': 257, b'hell': 258})
    enc = tiktoken.Encoding('tiny', pat_str=T.PRE_TOKENIZERS['gpt2'], mergeable_ranks=ranks,
                            special_tokens={'<|endoftext|>': 259})
    toks = [T.ByteTokenizer(), T.TiktokenTokenizer(enc), ours_from(hf_bpe('smollm'), 'smollm'),
            T.HFTokenizer.from_folder(_bert_folder(tmp_path))]
    for tok in toks:
        spec = json.loads(json.dumps(tok.spec))          # JSON-serialisable
        back = T.load_tokenizer(spec)
        assert type(back) is type(tok) and back.fingerprint == tok.fingerprint and len(tok.fingerprint) == 64
        for text in ('hello world 42', "it's a cat"):
            assert back.encode(text) == tok.encode(text)
        assert back.encode_pair('a cat', 'the dog', 16) == tok.encode_pair('a cat', 'the dog', 16)
    assert len({t.fingerprint for t in toks}) == len(toks)
    with pytest.raises(T.TokenizerError, match="unknown tokenizer spec kind 'nope'"):
        T.load_tokenizer({'kind': 'nope'})


def _bare(vocab_size, tok=None):
    """What resolve() reads of a model: its tokenizer and config.vocab_size."""
    return types.SimpleNamespace(tokenizer=tok, config=types.SimpleNamespace(vocab_size=vocab_size))


def test_no_tokenizer_rules(monkeypatch):
    assert isinstance(T.resolve(_bare(257)), T.ByteTokenizer)
    _tiktoken_gpt2(monkeypatch, cached=True)
    assert T.resolve(_bare(50304)).name == 'tiktoken-gpt2'
    _tiktoken_gpt2(monkeypatch, cached=False)
    with pytest.raises(T.TokenizerError, match="vocab_size 50304 is GPT-2's, but tokenizer 'gpt2' .* cannot be loaded"):
        T.resolve(_bare(50304))
    with pytest.raises(T.TokenizerError, match=r"vocab_size 1000 is not that of a project tokenizer .*--tokenizer"):
        T.resolve(_bare(1000))
    with pytest.raises(T.TokenizerError, match="has 257 tokens but the model's vocab_size is 100"):
        T.resolve(_bare(100, T.ByteTokenizer()))
    ids, types = T.ByteTokenizer().encode_pair('ab', 'c', max_len=5)     # [eot] a [eot] b [eot], truncated
    assert ids == [256, 97, 256, 99, 256] and types == [0, 0, 0, 1, 1]


def _tiktoken_gpt2(monkeypatch, cached):
    """tiktoken.get_encoding('gpt2') as on a machine with its files cached (a tiny encoding under that name), or
    as offline without them."""
    import tiktoken
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({b'th': 256, b'the': 257})
    enc = tiktoken.Encoding('gpt2', pat_str=T.PRE_TOKENIZERS['gpt2'], mergeable_ranks=ranks,
                            special_tokens={'<|endoftext|>': 258})

    def get_encoding(name):
        if not cached:
            raise ConnectionError("offline (test)")
        return enc
    monkeypatch.setattr(tiktoken, 'get_encoding', get_encoding)


def test_scratch_training_uses_bytes_unless_gpt2_is_asked_for(tmp_path, monkeypatch, capsys):
    """Issue 22: training from scratch took tiktoken's gpt2 where its files happened to be cached, else bytes.
    Now bytes everywhere; --tokenizer gpt2 asks for tiktoken, and where it cannot be loaded that is an error."""
    text = tmp_path / 'corpus.txt'
    text.write_text('the cat sat on the mat. ' * 40)
    argv = ['--task', 'text', '--data', str(text), '--n_layer', '1', '--n_head', '2', '--n_embd', '16', '--seq_len',
            '16', '--batch_size', '4', '--max_iters', '1', '--attn', 'elu', '--device', 'cpu']
    _tiktoken_gpt2(monkeypatch, cached=True)
    s = train.main(argv + ['--out_dir', str(tmp_path / 'a')])
    assert s['tokenizer'] == 'byte' and s['model_config']['vocab_size'] == 257
    assert M.load(str(tmp_path / 'a' / 'ckpt.pt'))[0].tokenizer.fingerprint == T.ByteTokenizer().fingerprint
    s = train.main(argv + ['--out_dir', str(tmp_path / 'b'), '--tokenizer', 'gpt2'])
    assert s['tokenizer'] == 'tiktoken-gpt2' and s['model_config']['vocab_size'] == 259
    _tiktoken_gpt2(monkeypatch, cached=False)
    assert train.main(argv + ['--out_dir', str(tmp_path / 'c')])['tokenizer'] == 'byte'
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train.main(argv + ['--out_dir', str(tmp_path / 'd'), '--tokenizer', 'gpt2'])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "tokenizer 'gpt2' (tiktoken) cannot be loaded" in err and "'bytes'" in err
    with pytest.raises(T.TokenizerError, match="tokenizer 'nope': not 'bytes', 'gpt2', a HuggingFace folder"):
        T.load_tokenizer('nope')


# ---- the user story: a BERT finetuned from a HF folder keeps its tokenizer ---------------------------------

WORDS = 'the cat sat on mat a dog ran home we like green tea she reads books of'.split()


def _bert_folder(tmp_path, name='bert', with_tokenizer=True, num_labels=2):
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


TEXTS_BERT = ['the cats sat', 'The Cat SAT on the mat!', "a dog's home, she reads", 'unknown words: café 中文',
              'we like green tea and she reads books of the cat', '']


def test_bert_wordpiece_and_pairs_match_transformers(tmp_path):
    """A folder's tokenizer.json, and a vocab.txt alone (WordPiece built here, lower-cased unless
    tokenizer_config.json says do_lower_case false), encode as transformers' BertTokenizerFast does, and
    classifier pairs, truncated to every max_len, are its [CLS] a [SEP] b [SEP] with its token types."""
    bert = _bert_folder(tmp_path)
    vocab_only = tmp_path / 'vocab_only'
    vocab_only.mkdir()
    shutil.copy(os.path.join(bert, 'vocab.txt'), vocab_only / 'vocab.txt')
    cased = tmp_path / 'cased'
    shutil.copytree(vocab_only, cased)
    (cased / 'tokenizer_config.json').write_text('{"do_lower_case": false}')
    truncating = tmp_path / 'truncating'      # a tokenizer.json that truncates (as MiniLM's does, at 128)
    shutil.copytree(bert, truncating)
    spec = json.loads((truncating / 'tokenizer.json').read_text())
    spec['truncation'] = {'direction': 'Right', 'max_length': 4, 'strategy': 'LongestFirst', 'stride': 0}
    (truncating / 'tokenizer.json').write_text(json.dumps(spec))
    assert not T.has_tokenizer_files(str(tmp_path)) and T.has_tokenizer_files(str(vocab_only))
    for folder, hf in [(bert, transformers.AutoTokenizer.from_pretrained(bert)),
                       (vocab_only, transformers.BertTokenizerFast(str(vocab_only / 'vocab.txt'))),
                       (cased, transformers.BertTokenizerFast(str(cased / 'vocab.txt'), do_lower_case=False)),
                       (truncating, transformers.AutoTokenizer.from_pretrained(str(truncating)))]:
        ours = T.load_tokenizer(str(folder))
        assert ours.name == ('hf:WordPiece' if 'tokenizer.json' not in os.listdir(folder) else 'hf:BertTokenizer')
        assert ours.vocab_size == len(hf) and len(ours.encode(TEXTS_BERT[4])) > 4
        for a in TEXTS_BERT:
            assert ours.encode(a) == hf.encode(a, add_special_tokens=False), (folder, a)
            for b in TEXTS_BERT[:3] + [None]:
                for max_len in (4, 5, 6, 7, 9, 12, 64):
                    want = hf(a, b, truncation=True, max_length=max_len)
                    assert ours.encode_pair(a, b, max_len) == (want['input_ids'], want['token_type_ids'])
    with pytest.raises(T.TokenizerError, match="has no tokenizer.json or vocab.txt"):
        T.HFTokenizer.from_folder(str(tmp_path))


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
    bert, data = _bert_folder(tmp_path), _cola(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(bert)
    # 1. train.py --task glue --init_from <HF folder>: ckpt.pt carries the folder's tokenizer
    out = str(tmp_path / 'ft')
    train.main(['--task', 'glue', '--glue_task', 'cola', '--data', data, '--init_from', bert, '--seq_len', '32',
                '--max_iters', '2', '--eval_interval', '2', '--batch_size', '4', '--device', 'cpu', '--out_dir', out])
    ft, _ = M.load(os.path.join(out, 'ckpt.pt'))
    assert isinstance(ft.tokenizer, T.HFTokenizer)
    assert ft.tokenizer.fingerprint == T.HFTokenizer.from_folder(bert).fingerprint
    # 2. convert.py --init_from that checkpoint encodes GLUE with it: exactly the HF tokenizer's ids
    conv = str(tmp_path / 'conv')
    argv = ['--init_from', os.path.join(out, 'ckpt.pt'), '--task', 'glue', '--glue_task', 'cola', '--data', data,
            '--attn', 'hedgehog', '--stage1_iters', '1', '--stage2_iters', '1', '--block_size', '32',
            '--batch_size', '4', '--eval_batches', '1', '--out_dir', conv]
    capsys.readouterr()
    C.main(argv)
    assert 'tokenizer: hf:' in capsys.readouterr().out
    cfg, _ = train.parse_config(C.ConvertConfig, argv)
    idx, mask, types, _ = C.load_task(cfg, M.load(os.path.join(out, 'ckpt.pt'))[0]).splits['train']
    rows = train.load_glue('cola', data, 'train')
    want = [hf(a, b, truncation=True, max_length=32) for a, b, _ in rows]
    assert [r[m.bool()].tolist() for r, m in zip(idx, mask)] == [list(w['input_ids']) for w in want]
    assert [r[m.bool()].tolist() for r, m in zip(types, mask)] == [list(w['token_type_ids']) for w in want]
    assert idx[0, 0] == hf.cls_token_id                                         # not byte ids
    assert not (idx == hf.unk_token_id).any()                                   # every word is in the vocabulary
    assert M.load(conv)[0].tokenizer.fingerprint == ft.tokenizer.fingerprint
    # 3. eval.py on the converted folder uses it too
    ev_out = str(tmp_path / 'ev')
    assert ev.main(['--ckpt', conv, '--glue', 'cola', '--data', data, '--out_dir', ev_out]) == 0
    with open(os.path.join(ev_out, 'glue.json')) as f:
        assert json.load(f)['tokenizer'].startswith('hf:')
    # 4. the converted checkpoint carries its tokenizer: a base whose tokenizer changed does not change it
    ft.tokenizer = T.ByteTokenizer()
    M.save(os.path.join(out, 'ckpt.pt'), ft)
    assert M.load(conv)[0].tokenizer.fingerprint == T.HFTokenizer.from_folder(bert).fingerprint


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
    with pytest.raises(SystemExit) as e:
        C.main(argv)
    assert e.value.code == 2 and '--tokenizer' in capsys.readouterr().err
    C.main(argv + ['--tokenizer', bert])
    assert M.load(str(tmp_path / 'c'))[0].tokenizer.fingerprint == T.HFTokenizer.from_folder(bert).fingerprint
    # an old checkpoint without a tokenizer, and a tokenizer with more ids than the model has
    torch.manual_seed(0)
    gpt = M.GPT(M.GPTConfig(family='gpt2', vocab_size=20, block_size=32, n_layer=1, n_head=2, n_embd=16))
    M.save(str(tmp_path / 'old.pt'), gpt)
    text = tmp_path / 't.txt'
    text.write_text('the cat sat on the mat ' * 20)
    base = ['--ckpt', str(tmp_path / 'old.pt'), '--ppl', '--data', str(text), '--context', '16',
            '--out_dir', str(tmp_path / 'e')]
    assert ev.main(base) == 2
    assert 'vocab_size 20 is not that of a project tokenizer' in capsys.readouterr().err
    assert ev.main(base + ['--tokenizer', bert]) == 2       # 22 tokens > vocab_size 20
    assert 'its ids would be out of range' in capsys.readouterr().err
