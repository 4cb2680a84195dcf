"""Tokenizers that travel with a model.

In reading order:
    tok = load_tokenizer(source)   # 'bytes', 'gpt2' (tiktoken), a HF folder, a .gguf file,
                                   # or a spec (tok.spec)
    ids = tok.encode(text)         # list[int], nothing added; special tokens in the text
                                   # only if special=True
    ids, types = tok.encode_pair(a, b, max_len)   # classifier input: [CLS] a [SEP] b [SEP],
                                                  # or eos for both
    tok.decode(ids), tok.name, tok.vocab_size, tok.eos_id (or None)
    tok.encode_array(text)         # the ids as an int64 numpy array
    tok.spec, tok.fingerprint      # JSON that rebuilds it offline (checkpoints store it),
                                   # and its sha256
    tok = resolve(model, source)   # for a model: source if given, else its own, else by
                                   # vocab_size; must fit
"""
import base64
import functools
import hashlib
import json
import os

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

class TokenizerError(ValueError):
    """A tokenizer cannot be built or does not fit the model.

    Its message is one line, naming the problem and the choices."""

class Tokenizer:
    """The common interface: name, vocab_size, eos_id, spec, encode, decode."""
    cls_sep = (None, None)   # (CLS, SEP) ids of a classifier input; without both, eos_id for both

    def encode_array(self, text):
        return np.asarray(self.encode(text), dtype=np.int64)

    def encode_pair(self, a, b=None, max_len=512):
        """CLS a SEP (b SEP) and its token types (0 for a, 1 for b).

        Cut to max_len as HF's 'longest_first' cuts."""
        cls, sep = self.cls_sep if None not in self.cls_sep else (self.eos_id, self.eos_id)
        if sep is None:
            raise TokenizerError(
                f"tokenizer {self.name} has no end-of-text token to build classifier input")
        pair = b is not None
        ia = self.encode(a)
        ib = self.encode(b) if pair else []
        room = max_len - (3 if pair else 2)
        na = len(ia)
        nb = len(ib)
        # the shorter text (a on a tie) keeps up to half of the room, the other the rest
        if na + nb > room:
            short = min(na, nb, room // 2)
            na, nb = (room - short, short) if na > nb else (short, room - short)
        ids = [cls] + ia[:na] + [sep] + (ib[:nb] + [sep] if pair else [])
        return ids, [0] * (na + 2) + [1] * (len(ids) - na - 2)

    @property
    def fingerprint(self):
        canon = json.dumps(self.spec, sort_keys=True, ensure_ascii=False, separators=(',', ':'))
        return hashlib.sha256(canon.encode('utf-8')).hexdigest()

    def __deepcopy__(self, memo):    # immutable: copies of a model share its tokenizer
        return self

class ByteTokenizer(Tokenizer):
    """UTF-8 bytes 0..255 plus an end-of-text token 256."""
    name = 'byte'
    vocab_size = 257
    eos_id = 256
    spec = {'kind': 'byte'}

    def encode(self, text, special=False):
        return list(text.encode('utf-8'))

    def encode_array(self, text):
        return np.frombuffer(text.encode('utf-8'), dtype=np.uint8).astype(np.int64)

    def decode(self, ids):
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode('utf-8', errors='replace')

class TiktokenTokenizer(Tokenizer):
    """A tiktoken encoding (GPT-2's).

    Its spec copies the ranks (private in tiktoken) to rebuild it offline."""

    def __init__(self, enc):
        self.enc = enc
        self.name = f'tiktoken-{enc.name}'
        self.vocab_size = enc.n_vocab
        self.eos_id = enc.eot_token
        self.spec = {'kind': 'tiktoken', 'name': enc.name, 'pat_str': enc._pat_str,
                     'special_tokens': dict(enc._special_tokens),
                     'ranks': [base64.b64encode(t).decode('ascii')   # in rank order
                               for t in sorted(enc._mergeable_ranks, key=enc._mergeable_ranks.get)]}

    def encode(self, text, special=False):
        if special:
            return self.enc.encode(text, allowed_special='all')
        return self.enc.encode_ordinary(text)

    def decode(self, ids):
        return self.enc.decode([int(i) for i in ids])

# Split regexes by GGUF `tokenizer.ggml.pre`, from llama.cpp's llama-vocab.cpp; 'default' (none
# given) is GPT-2's.
_GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# smollm: every digit first, then GPT-2's regex on each stretch between digits (HF:
# Digits(individual_digits) before ByteLevel); as one regex: digits first, no ' ?\p{N}+', and
# whitespace before a digit is a piece.
_SMOLLM_PAT = (r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+"""
               r"""|\s+(?=\p{N})|\s+(?!\S)|\s+""")
_LLAMA3_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
               r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
PRE_TOKENIZERS = {'default': _GPT2_PAT, 'gpt2': _GPT2_PAT, 'smollm': _SMOLLM_PAT,
                  'llama-bpe': _LLAMA3_PAT, 'llama3': _LLAMA3_PAT, 'llama-v3': _LLAMA3_PAT}
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4     # GGUF tokenizer.ggml.token_type values used here

class HFTokenizer(Tokenizer):
    """HF `tokenizers` (tokenizer.json, BERT vocab.txt, GGUF byte-level BPE).

    Its spec is the tokenizer's JSON."""

    def __init__(self, json_str, name, eos_id=None):
        self.spec = {'kind': 'tokenizers', 'name': name, 'eos_id': eos_id, 'json': json_str}
        self.tk = tokenizers.Tokenizer.from_str(json_str)
        self.name = name
        self.eos_id = eos_id
        self.tk.no_truncation()   # some tokenizer.json files truncate (MiniLM at 128); we never do
        self.tk.no_padding()
        self.vocab_size = self.tk.get_vocab_size(with_added_tokens=True)
        self.cls_sep = (self.tk.token_to_id('[CLS]'), self.tk.token_to_id('[SEP]'))

    def encode(self, text, special=False):
        self.tk.encode_special_tokens = not special
        return self.tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self.tk.decode([int(i) for i in ids], skip_special_tokens=False)

    @classmethod
    def from_folder(cls, folder):
        """tokenizer.json, else a BERT vocab.txt.

        From tokenizer_config.json, if any: do_lower_case, strip_accents, eos_token and the
        tokenizer's class (its name)."""
        path = functools.partial(os.path.join, folder)   # path(name): the folder's file
        config = {}
        if os.path.isfile(path('tokenizer_config.json')):
            with open(path('tokenizer_config.json')) as f:
                config = json.load(f)
        if os.path.isfile(path('tokenizer.json')):
            tk = tokenizers.Tokenizer.from_file(path('tokenizer.json'))
        elif os.path.isfile(path('vocab.txt')):
            tk = tokenizers.Tokenizer(
                models.WordPiece.from_file(path('vocab.txt'), unk_token='[UNK]'))
            tk.normalizer = normalizers.BertNormalizer(lowercase=config.get('do_lower_case', True),
                                                       strip_accents=config.get('strip_accents'))
            tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
            tk.decoder = decoders.WordPiece()
            tk.add_special_tokens([t for t in ('[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]')
                                   if t in tk.get_vocab()])
        else:
            raise TokenizerError(
                f"{folder} has no tokenizer.json or vocab.txt (save_pretrained writes one)")
        eos = config.get('eos_token') or '<|endoftext|>'
        eos = eos['content'] if isinstance(eos, dict) else eos
        return cls(tk.to_str(), f"hf:{config.get('tokenizer_class') or type(tk.model).__name__}",
                   tk.token_to_id(eos))

    @classmethod
    def from_bpe(cls, tokens, merges, token_types=(), pre='gpt2', eos_id=None):
        """Byte-level BPE from GGUF's `tokens`, `merges` and token types.

        tokens are in GPT-2's byte alphabet (a space is 'Ġ'); merges are 'a b', by priority. Control
        tokens are special, user-defined ones always matched (as llama.cpp does). Bytes without a
        token are dropped (as HF's BPE does). llama3 takes a piece that is a token whole."""
        if pre not in PRE_TOKENIZERS:
            raise TokenizerError(
                f"unsupported GGUF pre-tokenizer {pre!r}; supported: {sorted(PRE_TOKENIZERS)}")
        try:
            vocab = {t: i for i, t in enumerate(tokens)}
            pairs = [tuple(m.split(' ', 1)) for m in merges]
            tk = tokenizers.Tokenizer(
                models.BPE(vocab, pairs, ignore_merges=pre.startswith('llama')))
        except Exception as e:  # tokenizers' message names the merge
            raise TokenizerError(f"GGUF vocabulary: {e}") from None
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_TOKENIZERS[pre]), 'isolated'),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tk.decoder = decoders.ByteLevel()
        tk.add_tokens([AddedToken(t, special=k == CONTROL, normalized=False)
                       for t, k in zip(tokens, token_types) if k in (CONTROL, USER_DEFINED)])
        return cls(tk.to_str(), f'bpe-{pre}', eos_id)

    @classmethod
    def from_gguf(cls, reader):
        """The tokenizer of a gguf.GGUFReader's file: byte-level BPE ('gpt2') only."""
        get = {k[len('tokenizer.ggml.'):]: f.contents() for k, f in reader.fields.items()
               if k.startswith('tokenizer.ggml.')}.get
        if get('model') != 'gpt2' or get('tokens') is None or get('merges') is None:
            raise TokenizerError(
                f"GGUF tokenizer model {get('model')!r} is not supported (SentencePiece 'llama' "
                "among them) or has no tokens / merges; supported: 'gpt2' (byte-level BPE)")
        return cls.from_bpe(get('tokens'), get('merges'), get('token_type', ()),
                            get('pre', 'default'), get('eos_token_id'))

def has_tokenizer_files(folder):
    return any(os.path.isfile(os.path.join(folder, f)) for f in ('tokenizer.json', 'vocab.txt'))

def load_tokenizer(source):
    kind = source.get('kind') if isinstance(source, dict) else None
    if source == 'bytes' or kind == 'byte':
        return ByteTokenizer()
    if kind == 'tokenizers':
        return HFTokenizer(source['json'], source['name'], source['eos_id'])
    if kind == 'tiktoken':
        import tiktoken
        ranks = {base64.b64decode(t): i for i, t in enumerate(source['ranks'])}
        return TiktokenTokenizer(tiktoken.Encoding(
            source['name'], pat_str=source['pat_str'], mergeable_ranks=ranks,
            special_tokens=source['special_tokens']))
    if isinstance(source, dict):
        raise TokenizerError(
            f"unknown tokenizer spec kind {kind!r}; known: byte, tiktoken, tokenizers")
    if source == 'gpt2':
        try:
            import tiktoken
            return TiktokenTokenizer(tiktoken.get_encoding('gpt2'))
        except Exception as e:  # not installed, or offline without tiktoken's cached files
            raise TokenizerError(
                f"tokenizer 'gpt2' (tiktoken) cannot be loaded ({type(e).__name__}: its files are "
                "not cached, nor downloadable); pass 'bytes', a HF folder or a .gguf file"
            ) from None
    if str(source).endswith('.gguf') and os.path.isfile(source):
        import gguf
        return HFTokenizer.from_gguf(gguf.GGUFReader(source))
    if os.path.isdir(source):
        return HFTokenizer.from_folder(source)
    raise TokenizerError(
        f"tokenizer {source!r}: not 'bytes', 'gpt2', a HuggingFace folder or a .gguf file")

def resolve(model, source=None):
    """The tokenizer for `model`: `source` if given, else its own, else the project tokenizer.

    The project tokenizer is the one of the model's vocab_size (bytes 257, gpt2 50257/50304)."""
    V = model.config.vocab_size
    tok = load_tokenizer(source) if source else model.tokenizer
    if tok is None and V not in (257, 50257, 50304):
        raise TokenizerError(
            f"the model carries no tokenizer and its vocab_size {V} is not that of a project "
            "tokenizer (bytes 257, gpt2 50257/50304): "
            "pass --tokenizer (its HF folder or .gguf file)")
    try:
        tok = tok or load_tokenizer('bytes' if V == 257 else 'gpt2')
    except TokenizerError as e:
        raise TokenizerError(
            f"the model carries no tokenizer and its vocab_size {V} is GPT-2's, but {e}") from None
    if tok.vocab_size > V:
        raise TokenizerError(
            f"tokenizer {tok.name} has {tok.vocab_size} tokens but the model's vocab_size is {V}: "
            "its ids would be out of range (pass the model's own tokenizer with --tokenizer)")
    return tok
