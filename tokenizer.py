"""
Tokenizers that travel with a model.

Every tokenizer here has the same small interface:

    ids = tok.encode(text)                    # list[int], no BOS/EOS/CLS added; special tokens only if special=True
    text = tok.decode(ids)
    ids, type_ids = tok.encode_pair(a, b, max_len)   # classifier input with the model's special tokens
    tok.name, tok.vocab_size, tok.eos_id, tok.bos_id (or None), tok.pad_id
    spec = tok.to_spec()                      # JSON-serialisable; holds everything needed to rebuild it
    tok = load_tokenizer(spec)                # ... from a spec, a HuggingFace folder or a .gguf file
    tok.fingerprint                           # sha256 of the canonical spec: an exact, checkable reference

- `ByteTokenizer`: UTF-8 bytes 0..255 plus an end-of-text token 256 (the project's offline default).
- `TiktokenTokenizer`: tiktoken's GPT-2 BPE (its ranks are copied into the spec, so a checkpoint rebuilds it
  offline).
- `BPETokenizer`: byte-level BPE from a vocabulary and merges, as GGUF files store it
  (`tokenizer.ggml.model == 'gpt2'`), run on tiktoken's BPE core. The pre-tokenizer regex is chosen by
  `tokenizer.ggml.pre` as in llama.cpp's llama-vocab.cpp.
- `HFTokenizer`: a HuggingFace tokenizer folder run through `transformers.AutoTokenizer` (optional
  dependency, loaded on first use); its spec embeds the files.

Models carry one as `model.tokenizer` (model.py stores its spec in checkpoints). A model without one gets the
project tokenizer that matches its vocab_size (`tokenizer_for_vocab`: byte 257, tiktoken gpt2 50257/50304),
otherwise it is an error asking for --tokenizer.
"""

import base64
import hashlib
import json
import os
import tempfile

import numpy as np

TOKENIZER_FILES = ('tokenizer.json', 'vocab.txt', 'vocab.json', 'tokenizer.model', 'spiece.model')
_HF_EXTRA_FILES = ('tokenizer_config.json', 'special_tokens_map.json', 'added_tokens.json', 'merges.txt')


class TokenizerError(ValueError):
    """A tokenizer cannot be built or does not fit the model: one line, naming the problem and the choices."""


class Tokenizer:
    """The common interface (see the module docstring). Subclasses set name, vocab_size, eos_id, bos_id,
    pad_id and implement encode, decode and to_spec."""
    bos_id = None

    @property
    def eot(self):               # train.py's historical name for the end-of-text id
        return self.eos_id

    def encode_array(self, text):
        return np.asarray(self.encode(text), dtype=np.int64)

    def encode_pair(self, a, b=None, max_len=512):
        """[eot] a [eot] (b [eot]) with token types 0 for a, 1 for b; the longer text is truncated first
        (HuggingFace's 'longest_first') so that the whole fits in max_len. The eot token doubles as CLS/SEP."""
        if self.eos_id is None:
            raise TokenizerError(f"tokenizer {self.name} has no end-of-text token to build classifier input")
        ia, ib = self.encode(a), (self.encode(b) if b is not None else [])
        room = max_len - (3 if b is not None else 2)
        while len(ia) + len(ib) > room:
            if len(ia) >= len(ib):
                ia = ia[:-1]
            else:
                ib = ib[:-1]
        ids, types = [self.eos_id] + ia + [self.eos_id], [0] * (len(ia) + 2)
        if b is not None:
            ids, types = ids + ib + [self.eos_id], types + [1] * (len(ib) + 1)
        return ids, types

    @property
    def fingerprint(self):
        if getattr(self, '_fingerprint', None) is None:
            canon = json.dumps(self.to_spec(), sort_keys=True, ensure_ascii=False, separators=(',', ':'))
            self._fingerprint = hashlib.sha256(canon.encode('utf-8')).hexdigest()
        return self._fingerprint

    def __deepcopy__(self, memo):    # immutable: copies of a model share its tokenizer
        return self

    def __repr__(self):
        return f"<{type(self).__name__} {self.name}, vocab {self.vocab_size}>"


# -----------------------------------------------------------------------------
# the project's own tokenizers

class ByteTokenizer(Tokenizer):
    """UTF-8 bytes 0..255 plus an end-of-text token 256."""
    name = 'byte'
    vocab_size = 257
    eos_id = pad_id = 256

    def encode(self, text, special=False):
        return list(text.encode('utf-8'))

    def encode_array(self, text):
        return np.frombuffer(text.encode('utf-8'), dtype=np.uint8).astype(np.int64)

    def decode(self, ids):
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode('utf-8', errors='replace')

    def to_spec(self):
        return {'kind': 'byte'}


class TiktokenTokenizer(Tokenizer):
    """A tiktoken encoding (the project uses GPT-2's). Special tokens are never encoded from text."""

    def __init__(self, enc):
        self.enc = enc
        self.name = 'tiktoken-gpt2' if enc.name == 'gpt2' else f'tiktoken-{enc.name}'
        self.vocab_size = enc.n_vocab
        self.eos_id = self.pad_id = enc.eot_token

    def encode(self, text, special=False):
        return self.enc.encode(text, allowed_special='all') if special else self.enc.encode_ordinary(text)

    def decode(self, ids):
        return self.enc.decode([int(i) for i in ids])

    def to_spec(self):
        ranks = sorted(self.enc._mergeable_ranks.items(), key=lambda kv: kv[1])
        if [r for _, r in ranks] != list(range(len(ranks))):
            raise TokenizerError(f"tiktoken encoding {self.enc.name}: ranks are not 0..n-1, cannot store it")
        return {'kind': 'tiktoken', 'name': self.enc.name, 'pat_str': self.enc._pat_str,
                'ranks': [base64.b64encode(t).decode('ascii') for t, _ in ranks],
                'special_tokens': dict(self.enc._special_tokens)}

    @classmethod
    def from_spec(cls, spec):
        import tiktoken
        ranks = {base64.b64decode(t): i for i, t in enumerate(spec['ranks'])}
        return cls(tiktoken.Encoding(spec['name'], pat_str=spec['pat_str'], mergeable_ranks=ranks,
                                     special_tokens=spec['special_tokens']))


def get_tokenizer(verbose=True):
    """tiktoken's GPT-2 encoding when it can be loaded (installed and its files cached or downloadable),
    else the byte-level tokenizer: the tokenizer of a model trained from scratch. Prints which one runs."""
    try:
        import tiktoken
        tok, why = TiktokenTokenizer(tiktoken.get_encoding('gpt2')), ''
    except Exception as e:  # not installed, or offline without the cached BPE files
        tok, why = ByteTokenizer(), f" (tiktoken gpt2 unavailable: {type(e).__name__})"
    if verbose:
        print(f"tokenizer: {tok.name}, vocab {tok.vocab_size}{why}")
    return tok


# -----------------------------------------------------------------------------
# byte-level BPE from a vocabulary and merges (GGUF), on tiktoken's BPE core

def bytes_to_unicode():
    """GPT-2's reversible byte -> printable character map: byte-level BPE vocabularies spell tokens with it
    (a space is 'Ġ'). Printable Latin-1 bytes map to themselves, the other 68 to chr(256 + k)."""
    keep = list(range(ord('!'), ord('~') + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, k = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + k)
            k += 1
    return out


# Pre-tokenizer regexes by GGUF `tokenizer.ggml.pre`, from llama.cpp's llama-vocab.cpp.
_GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# smollm: llama.cpp splits off every digit (\p{N}) first, then runs the GPT-2 regex on each stretch between
# digits (as HF's Sequence[Digits(individual_digits), ByteLevel]). One regex with the same result: digits
# first, no ' ?\p{N}+', and a whitespace run that ends at a digit is one piece (the end of its stretch).
_SMOLLM_PAT = (r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?=\p{N})|\s+(?!\S)|\s+""")
_LLAMA3_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# 'default' (a file without a pre-tokenizer type): GPT-2's regex, as transformers reads such files. llama.cpp
# runs its own 4-regex fallback there and warns that quality will be degraded; we do not copy that fallback.
PRE_TOKENIZERS = {'default': _GPT2_PAT, 'gpt2': _GPT2_PAT, 'smollm': _SMOLLM_PAT,
                  'llama-bpe': _LLAMA3_PAT, 'llama3': _LLAMA3_PAT, 'llama-v3': _LLAMA3_PAT}
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4     # GGUF tokenizer.ggml.token_type values used here


class BPETokenizer(Tokenizer):
    """Byte-level BPE (GPT-2 style) from `tokens` (spelled in the bytes_to_unicode alphabet), `merges`
    ('a b', in priority order) and GGUF token types. Encoding runs tiktoken's BPE core: tiktoken merges the
    adjacent pair whose concatenation has the lowest rank, so each token's rank is the position of the first
    merge that makes it (the merge order of HF's BPE); tiktoken ids are these ranks, mapped back to token ids.
    Control tokens (type 3, e.g. <|im_start|>) are encoded from text only with special=True; user-defined
    tokens (type 4) always, as llama.cpp and transformers do. Bytes the vocabulary lacks are dropped, as HF's
    BPE without an unk token does (e.g. SmolLM2 has no token for '\\x04').
    Where tiktoken's core differs from HF's BPE: it joins any adjacent pair whose concatenation is a token (HF
    only the pairs listed as merges) and takes a piece that is itself a token whole. The two agree unless some
    token can be reached by another split than its own merge during encoding: no difference on the tests'
    vocabularies nor on SmolLM2's over WikiText-2 and Tiny Shakespeare (README, Tokenizers)."""

    def __init__(self, tokens, merges, token_types=None, pre='gpt2', bos_id=None, eos_id=None, pad_id=None,
                 add_bos=False):
        if pre not in PRE_TOKENIZERS:
            raise TokenizerError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: {sorted(PRE_TOKENIZERS)}")
        types = list(token_types) if token_types is not None else [NORMAL] * len(tokens)
        self.tokens, self.merges, self.token_types, self.pre = list(tokens), list(merges), types, pre
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, bool(add_bos)
        self.pad_id = pad_id if pad_id is not None else eos_id
        self.vocab_size = len(self.tokens)
        self.name = f'bpe-{pre}'
        u2b = {c: b for b, c in bytes_to_unicode().items()}
        self._bytes = [bytes(u2b[c] for c in t) if all(c in u2b for c in t) else t.encode('utf-8')
                       for t in self.tokens]
        ranked = self._rank_order()                            # token ids in tiktoken rank order
        special = [i for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)]
        self._to_id = np.array(ranked + special, dtype=np.int64)   # tiktoken id -> token id
        self._pat = PRE_TOKENIZERS[pre]
        self._special = {self.tokens[i]: len(ranked) + k for k, i in enumerate(special)}
        self._always = {self.tokens[i] for i in special if types[i] == USER_DEFINED}
        have = {self._bytes[i] for i in ranked if len(self._bytes[i]) == 1}
        self._missing = bytes(b for b in range(256) if bytes([b]) not in have)
        import tiktoken
        self._enc = tiktoken.Encoding(self.name, pat_str=self._pat, special_tokens=self._special,
                                      mergeable_ranks={self._bytes[i]: r for r, i in enumerate(ranked)})

    def _rank_order(self):
        """Single-byte tokens first, then the products of the merges in merge order (first merge wins)."""
        index = {t: i for i, t in enumerate(self.tokens)}
        order = [i for i, t in enumerate(self.tokens) if self.token_types[i] == NORMAL and len(self._bytes[i]) == 1]
        seen = {self._bytes[i] for i in order}
        for k, m in enumerate(self.merges):
            a, sep, b = m.partition(' ')
            i = index.get(a + b)
            if not sep or i is None or a not in index or b not in index:
                raise TokenizerError(f"merge {k} {m!r} does not join two tokens of the vocabulary into a third")
            if self._bytes[i] not in seen:
                seen.add(self._bytes[i])
                order.append(i)
        return order

    def encode(self, text, special=False):
        allowed = set(self._special) if special else self._always
        data = text.encode('utf-8')
        if self._missing and len(data.translate(None, self._missing)) != len(data):
            ids = self._encode_dropping_missing(text, allowed)
        elif allowed:
            ids = self._enc.encode(text, allowed_special=allowed, disallowed_special=())
        else:
            ids = self._enc.encode_ordinary(text)
        return self._to_id[np.asarray(ids, dtype=np.int64)].tolist()

    def _encode_dropping_missing(self, text, allowed):
        """Slow path for text with bytes the vocabulary lacks: pre-tokenize here and drop those bytes from
        each piece before BPE (tiktoken would need a token for every byte)."""
        import regex
        specials = sorted(allowed, key=len, reverse=True)
        parts = regex.split('(' + '|'.join(regex.escape(s) for s in specials) + ')', text) if specials else [text]
        out = []
        for j, part in enumerate(parts):
            if j % 2:                       # a special token (the split keeps the separators at odd positions)
                out.append(self._special[part])
                continue
            for piece in regex.findall(self._pat, part):
                piece = piece.encode('utf-8').translate(None, self._missing)
                if piece:
                    out.extend(self._enc._encode_single_piece(piece))
        return out

    def decode(self, ids):
        try:
            return b''.join(self._bytes[int(i)] for i in ids).decode('utf-8', errors='replace')
        except IndexError:
            bad = max(int(i) for i in ids)
            raise TokenizerError(f"token id {bad} is outside {self.name}'s vocabulary of {self.vocab_size}") from None

    def to_spec(self):
        return {'kind': 'bpe', 'pre': self.pre, 'tokens': self.tokens, 'merges': self.merges,
                'token_types': self.token_types, 'bos_id': self.bos_id, 'eos_id': self.eos_id,
                'pad_id': self.pad_id, 'add_bos': self.add_bos}

    @classmethod
    def from_spec(cls, spec):
        return cls(spec['tokens'], spec['merges'], spec['token_types'], spec['pre'], spec['bos_id'],
                   spec['eos_id'], spec['pad_id'], spec['add_bos'])

    @classmethod
    def from_gguf(cls, reader_or_path):
        """The tokenizer a GGUF file carries (a gguf.GGUFReader or a path). Only byte-level BPE
        (tokenizer.ggml.model 'gpt2': SmolLM2, Llama 3, ...) is supported."""
        import gguf
        reader = gguf.GGUFReader(reader_or_path) if isinstance(reader_or_path, (str, os.PathLike)) else reader_or_path

        def get(key, default=None):
            f = reader.fields.get('tokenizer.ggml.' + key)
            return default if f is None else f.contents()
        model = get('model')
        if model != 'gpt2':
            raise TokenizerError(f"GGUF tokenizer model {model!r} is not supported (SentencePiece 'llama' "
                                 "vocabularies among them); supported: 'gpt2' (byte-level BPE)")
        if get('tokens') is None or get('merges') is None:
            raise TokenizerError("GGUF file has no tokenizer.ggml.tokens / tokenizer.ggml.merges")
        return cls(get('tokens'), get('merges'), get('token_type'), get('pre', 'default'), get('bos_token_id'),
                   get('eos_token_id'), get('padding_token_id'), get('add_bos_token', False))


# -----------------------------------------------------------------------------
# HuggingFace tokenizer folders (transformers, optional)

class HFTokenizer(Tokenizer):
    """A HuggingFace tokenizer (tokenizer.json / vocab.txt / ...) through transformers.AutoTokenizer, loaded on
    first use from the files embedded in the spec. Classifier pairs use the tokenizer's own special tokens
    when it has [CLS]/[SEP] (BERT: [CLS] a [SEP] b [SEP]), else the eot format of the base class."""

    def __init__(self, files):
        self.files = dict(files)               # name -> text, or {'base64': ...} for binary files
        self._hf = None

    @classmethod
    def from_folder(cls, folder):
        files = {}
        for name in TOKENIZER_FILES + _HF_EXTRA_FILES:
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                with open(path, 'rb') as f:
                    data = f.read()
                try:
                    files[name] = data.decode('utf-8')
                except UnicodeDecodeError:
                    files[name] = {'base64': base64.b64encode(data).decode('ascii')}
        if not any(name in files for name in TOKENIZER_FILES):
            raise TokenizerError(f"{folder} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)})")
        cfg = os.path.join(folder, 'config.json')
        if os.path.isfile(cfg):   # AutoTokenizer may need the model type; nothing else of the config is kept
            with open(cfg) as f:
                model_type = json.load(f).get('model_type')
            if model_type:
                files['config.json'] = json.dumps({'model_type': model_type})
        return cls(files)

    @property
    def hf(self):
        if self._hf is None:
            try:
                from transformers import AutoTokenizer
            except ImportError:
                raise TokenizerError("this model's tokenizer is a HuggingFace one and needs the transformers "
                                     "package (pip install transformers)") from None
            with tempfile.TemporaryDirectory() as tmp:
                for name, content in self.files.items():
                    data = base64.b64decode(content['base64']) if isinstance(content, dict) else content.encode()
                    with open(os.path.join(tmp, name), 'wb') as f:
                        f.write(data)
                try:
                    self._hf = AutoTokenizer.from_pretrained(tmp)
                except Exception as e:  # whatever transformers raises for files it cannot read
                    msg = str(e).splitlines()[0][:200] if str(e) else ''
                    raise TokenizerError(f"cannot load the HuggingFace tokenizer ({type(e).__name__}: {msg})") from None
        return self._hf

    name = property(lambda self: f"hf:{type(self.hf).__name__}")
    vocab_size = property(lambda self: len(self.hf))
    eos_id = property(lambda self: self.hf.eos_token_id)
    bos_id = property(lambda self: self.hf.bos_token_id)
    pad_id = property(lambda self: self.hf.pad_token_id if self.hf.pad_token_id is not None else 0)

    def encode(self, text, special=False):
        return self.hf.encode(text, add_special_tokens=False, split_special_tokens=not special)

    def decode(self, ids):
        return self.hf.decode([int(i) for i in ids], clean_up_tokenization_spaces=False)

    def encode_pair(self, a, b=None, max_len=512):
        if self.hf.cls_token_id is None or self.hf.sep_token_id is None:
            return super().encode_pair(a, b, max_len)
        enc = self.hf(a, b, truncation=True, max_length=max_len)
        ids = list(enc['input_ids'])
        return ids, list(enc.get('token_type_ids') or [0] * len(ids))

    def to_spec(self):
        return {'kind': 'hf', 'files': self.files}

    @classmethod
    def from_spec(cls, spec):
        return cls(spec['files'])


# -----------------------------------------------------------------------------
# loading, and the rules for models without a tokenizer

def has_tokenizer_files(folder):
    return os.path.isdir(folder) and any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES)


def load_tokenizer(source):
    """A tokenizer from a spec dict (to_spec), a HuggingFace folder with tokenizer files, or a .gguf file."""
    if isinstance(source, dict):
        kinds = {'byte': lambda s: ByteTokenizer(), 'tiktoken': TiktokenTokenizer.from_spec,
                 'bpe': BPETokenizer.from_spec, 'hf': HFTokenizer.from_spec}
        if source.get('kind') not in kinds:
            raise TokenizerError(f"unknown tokenizer spec kind {source.get('kind')!r}; known: {sorted(kinds)}")
        return kinds[source['kind']](source)
    source = str(source)
    if os.path.isfile(source) and source.endswith('.gguf'):
        return BPETokenizer.from_gguf(source)
    if os.path.isdir(source):
        return HFTokenizer.from_folder(source)
    raise TokenizerError(f"--tokenizer {source!r}: not a HuggingFace folder with tokenizer files or a .gguf file")


def tokenizer_for_vocab(vocab_size):
    """The project tokenizer for a model that carries none, chosen by its vocab_size: 257 -> byte,
    50257 / 50304 (GPT-2, padded) -> tiktoken gpt2. Anything else is an error asking for --tokenizer."""
    if vocab_size == ByteTokenizer.vocab_size:
        return ByteTokenizer()
    if vocab_size in (50257, 50304):
        try:
            import tiktoken
            return TiktokenTokenizer(tiktoken.get_encoding('gpt2'))
        except Exception as e:  # offline without tiktoken's cached files
            raise TokenizerError(f"the model carries no tokenizer; its vocab_size {vocab_size} is GPT-2's but "
                                 f"tiktoken's gpt2 encoding cannot be loaded ({type(e).__name__}); pass "
                                 "--tokenizer PATH (a HuggingFace folder or a .gguf file)") from None
    raise TokenizerError(f"the model carries no tokenizer and its vocab_size {vocab_size} is not that of a "
                         "project tokenizer (byte 257, tiktoken gpt2 50257/50304): pass --tokenizer PATH "
                         "(the model's HuggingFace folder or .gguf file)")


def check_fits(tok, vocab_size):
    """A tokenizer whose ids reach past the model's embedding table is an error."""
    if tok.vocab_size > vocab_size:
        raise TokenizerError(f"tokenizer {tok.name} has {tok.vocab_size} tokens but the model's vocab_size is "
                             f"{vocab_size}: its ids would be out of range (pass the model's own tokenizer "
                             "with --tokenizer)")
    return tok


def resolve(model, path=None):
    """The tokenizer to use with `model`: --tokenizer PATH if given, else the model's own, else the project
    tokenizer matching its vocab_size (an error if none does); checked against the vocab_size."""
    tok = load_tokenizer(path) if path else (model.tokenizer or tokenizer_for_vocab(model.config.vocab_size))
    return check_fits(tok, model.config.vocab_size)


# -----------------------------------------------------------------------------
# a tokenizer next to a saved folder (converted models): its spec in a file, named in the manifest

SPEC_FILE = 'tokenizer_spec.json'


def save_spec(folder, tok):
    """Write tok's spec to folder/tokenizer_spec.json; returns the manifest entry {name, fingerprint, file}
    (None for no tokenizer)."""
    if tok is None:
        return None
    tmp = os.path.join(folder, '.' + SPEC_FILE + '.tmp')
    with open(tmp, 'w') as f:
        json.dump(tok.to_spec(), f, ensure_ascii=False)
    os.replace(tmp, os.path.join(folder, SPEC_FILE))
    return {'name': tok.name, 'fingerprint': tok.fingerprint, 'file': SPEC_FILE}


def load_spec(folder, entry):
    """The tokenizer a manifest entry (save_spec) names, checked against its fingerprint."""
    with open(os.path.join(folder, entry['file'])) as f:
        tok = load_tokenizer(json.load(f))
    if tok.fingerprint != entry['fingerprint']:
        raise TokenizerError(f"{os.path.join(folder, entry['file'])} does not match the fingerprint in the "
                             "manifest (the file was changed)")
    return tok


def attach_saved(folder, entry, model):
    """Give `model` (a base rebuilt from a saved folder) the tokenizer the folder recorded (save_spec's entry;
    nothing happens for None). A base that has a tokenizer must still have the one the folder was saved
    against (entry['base_fingerprint'] if recorded, else the saved tokenizer): otherwise the base changed."""
    if not entry:
        return model
    tok = load_spec(folder, entry)
    then = entry.get('base_fingerprint', entry['fingerprint'])
    now = model.tokenizer.fingerprint if model.tokenizer is not None else None
    if now is not None and now != then:
        raise TokenizerError(f"{folder}: the base model's tokenizer ({model.tokenizer.name}, fingerprint "
                             f"{now[:12]}) is not the one this folder was saved with ({then[:12] if then else 'none'})"
                             ": the base model changed")
    model.tokenizer = tok
    return model
