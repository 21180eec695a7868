"""python -m fp8moe.data: text to the token file of `fp8moe train
dataset_type=tokens`, and back.

    python -m fp8moe.data encode --tokenizer PATH --tokenizer-type huggingface|sentencepiece
        --in TEXT_FILES... --out CORPUS [--split paragraph|line|file] [--eos-id N]
    python -m fp8moe.data decode --tokenizer PATH --tokenizer-type ... --in CORPUS
        [--out TEXT] [--split paragraph|line|file]

Tokenization stays in the tokenizers people already use: `huggingface` is the
`tokenizers` package (PATH: a tokenizer.json, or a Hugging Face model
directory holding one), `sentencepiece` the `sentencepiece` package (PATH: a
.model file, or a directory holding tokenizer.model). The names are MaxText's
`tokenizer_type` values. Neither package is imported until encode or decode
runs, so fp8moe imports without them.

The file (docs/train.md, Data, has the byte table): a 48-byte little-endian
header (magic b"FP8MTOKS", version 1, id width 2 or 4 bytes: uint16 when
vocab_size <= 65536, else uint32; vocab_size, EOS id, document count D,
token count N), then D + 1 uint64 document offsets (document d is ids
[off[d], off[d+1])), then the N ids. Every document ends with the EOS id,
which encode appends: the C++ reader packs the id stream as it is.

Documents (--split): `paragraph` (the default) splits each file at blank
lines, `line` at newlines, `file` keeps each file whole; empty documents are
left out. decode joins documents back the same way (paragraphs with a blank
line, lines with a newline, each followed by it; files back to back), so
encode then decode gives the input back where the tokenizer is lossless and
the input is in that normal form (single blank lines between paragraphs, a
final newline).

Errors (a missing file, an unknown tokenizer type, a tokenizer whose ids do
not fit uint32, a damaged token file) print `error: ...` naming the thing and
exit 2.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import struct
import sys
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, List, Optional, Sequence

import numpy as np

__all__ = ["MAGIC", "VERSION", "HEADER", "DataError", "Corpus", "Tokenizer", "write_corpus", "read_corpus",
           "split_documents", "join_documents", "load_tokenizer", "encode_files",
           "decode_corpus", "main"]

MAGIC = b"FP8MTOKS"
VERSION = 1
# magic, version, id bytes, vocab_size, eos_id, documents, tokens
HEADER = struct.Struct("<8sIIQQQQ")
TOKENIZER_TYPES = ("huggingface", "sentencepiece")
SPLITS = ("paragraph", "line", "file")
# Input read between two progress lines on stderr (and the size from which
# a file reports progress at all).
PROGRESS_BYTES = 16 << 20


class DataError(Exception):
    """Bad input: main() prints `error: <message>` and exits 2."""


def id_bytes(vocab_size: int) -> int:
    """The narrowest id width that holds vocab_size ids: 2 (uint16) or 4."""
    if not 1 <= vocab_size <= 1 << 32:
        raise DataError(f"a vocabulary of {vocab_size} ids does not fit the token file's "
                        "uint32 ids (1..2^32 ids)")
    return 2 if vocab_size <= 1 << 16 else 4


@dataclass
class Corpus:
    """A token file in memory: ids [N] (uint16 or uint32), offsets [D + 1]."""
    vocab_size: int
    eos_id: int
    offsets: np.ndarray
    ids: np.ndarray

    def documents(self) -> Iterator[np.ndarray]:
        """Each document's ids, its EOS included."""
        for d in range(len(self.offsets) - 1):
            yield self.ids[self.offsets[d]:self.offsets[d + 1]]


def _header(vocab_size: int, eos_id: int, documents: int, tokens: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, id_bytes(vocab_size), vocab_size, eos_id, documents,
                       tokens)


def write_corpus(path: str, documents: Iterable[Sequence[int]], vocab_size: int,
                 eos_id: int) -> Corpus:
    """Writes documents (lists of ids without EOS; EOS is appended to each) as
    a token file at path, atomically (a temporary file renamed into place)."""
    width = id_bytes(vocab_size)
    if not 0 <= eos_id < vocab_size:
        raise DataError(f"EOS id {eos_id} is outside the vocabulary of {vocab_size} ids")
    dtype = np.dtype("<u2" if width == 2 else "<u4")
    parts, offsets = [], [0]
    for doc in documents:
        a = np.append(np.asarray(doc, dtype=np.int64), eos_id)
        if a.size and (a.min() < 0 or a.max() >= vocab_size):
            bad = int(a[(a < 0) | (a >= vocab_size)][0])
            raise DataError(f"id {bad} is outside the vocabulary of {vocab_size} ids")
        parts.append(a.astype(dtype))
        offsets.append(offsets[-1] + a.size)
    ids = np.concatenate(parts) if parts else np.zeros(0, dtype)
    offs = np.asarray(offsets, dtype="<u8")
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(_header(vocab_size, eos_id, len(offsets) - 1, int(ids.size)))
            f.write(offs.tobytes())
            f.write(ids.tobytes())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return Corpus(vocab_size, eos_id, offs, ids)


def read_corpus(path: str) -> Corpus:
    """Reads and checks a token file (the checks of the C++ reader)."""
    try:
        data = open(path, "rb").read()
    except OSError as e:
        raise DataError(f"cannot read token file '{path}': {e.strerror}") from None
    if len(data) < HEADER.size:
        raise DataError(f"'{path}' has {len(data)} bytes, fewer than the {HEADER.size}-byte "
                        "header of a token file")
    magic, version, width, vocab, eos, docs, tokens = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise DataError(f"'{path}' is not a token file (no {MAGIC.decode()} magic)")
    if version != VERSION:
        raise DataError(f"'{path}' is token file version {version}; this fp8moe reads "
                        f"version {VERSION}")
    if width != id_bytes(vocab):
        raise DataError(f"'{path}' stores ids in {width} bytes but its vocab_size {vocab} "
                        f"takes {id_bytes(vocab)}")
    expected = HEADER.size + 8 * (docs + 1) + width * tokens
    if expected != len(data):
        raise DataError(f"'{path}' has {len(data)} bytes but its header makes it {expected}")
    offs = np.frombuffer(data, "<u8", docs + 1, HEADER.size)
    ids = np.frombuffer(data, "<u2" if width == 2 else "<u4", tokens, HEADER.size + 8 * (docs + 1))
    if offs[0] != 0 or offs[-1] != tokens or np.any(np.diff(offs.astype(np.int64)) <= 0):
        raise DataError(f"'{path}' has damaged document offsets")
    return Corpus(vocab, eos, offs, ids)


def split_documents(text: str, split: str) -> List[str]:
    """The documents of one file's text; empty ones are left out."""
    if split == "file":
        docs = [text]
    elif split == "line":
        docs = text.split("\n")
    elif split == "paragraph":
        docs = re.split(r"\n(?:[ \t]*\n)+", text)
        if docs and docs[-1].endswith("\n"):
            docs[-1] = docs[-1][:-1]
    else:
        raise DataError(f"--split {split!r} is not one of {', '.join(SPLITS)}")
    return [d for d in docs if d.strip()]


def join_documents(docs: Sequence[str], split: str) -> str:
    """The inverse of split_documents for text in its normal form."""
    if split == "file":
        return "".join(docs)
    sep = "\n" if split == "line" else "\n\n"
    return sep.join(docs) + "\n" if docs else ""


@dataclass
class Tokenizer:
    vocab_size: int
    eos_id: Optional[int]
    encode: Callable[[str], List[int]]
    decode: Callable[[List[int]], str]


def _import(package: str, tokenizer_type: str):
    """The tokenizer package, imported only now (fp8moe does not depend on it)."""
    try:
        return importlib.import_module(package)
    except ImportError:
        raise DataError(f"--tokenizer-type {tokenizer_type} needs the `{package}` package: "
                        f"pip install {package}") from None


def _tokenizer_file(path: str, name: str, what: str) -> str:
    """path, or path/name for a directory; it must exist."""
    file = os.path.join(path, name) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise DataError(f"tokenizer '{file}' does not exist; give {what}")
    return file


def _load(file: str, package: str, load: Callable[[str], object]):
    # Both packages raise plain Exception / RuntimeError / OSError on a bad file.
    try:
        return load(file)
    except Exception as e:
        raise DataError(f"tokenizer '{file}' cannot be read by {package}: {e}") from None


def _hf_tokenizer(path: str) -> Tokenizer:
    tokenizers = _import("tokenizers", "huggingface")
    file = _tokenizer_file(path, "tokenizer.json",
                           "a tokenizer.json or a Hugging Face model directory holding one")
    tok = _load(file, "tokenizers", tokenizers.Tokenizer.from_file)
    # EOS: the model directory's tokenizer_config.json names it; else the
    # usual names, if the vocabulary has one.
    names = []
    cfg = os.path.join(os.path.dirname(os.path.abspath(file)), "tokenizer_config.json")
    if os.path.isfile(cfg):
        eos = json.load(open(cfg)).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            names.append(eos)
    names += ["</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>"]
    eos_id = next((tok.token_to_id(n) for n in names if tok.token_to_id(n) is not None), None)
    return Tokenizer(tok.get_vocab_size(with_added_tokens=True), eos_id,
                     lambda s: tok.encode(s, add_special_tokens=False).ids,
                     lambda ids: tok.decode(ids, skip_special_tokens=False))


def _sp_tokenizer(path: str) -> Tokenizer:
    spm = _import("sentencepiece", "sentencepiece")
    file = _tokenizer_file(path, "tokenizer.model",
                           "a sentencepiece .model file or a directory holding tokenizer.model")
    sp = _load(file, "sentencepiece", lambda f: spm.SentencePieceProcessor(model_file=f))
    eos = sp.eos_id()
    return Tokenizer(sp.get_piece_size(), eos if eos >= 0 else None,
                     lambda s: list(sp.encode(s)), lambda ids: sp.decode(ids))


def load_tokenizer(path: str, tokenizer_type: str) -> Tokenizer:
    if tokenizer_type == "huggingface":
        tok = _hf_tokenizer(path)
    elif tokenizer_type == "sentencepiece":
        tok = _sp_tokenizer(path)
    else:
        raise DataError(f"--tokenizer-type {tokenizer_type!r} is not one of "
                        f"{', '.join(TOKENIZER_TYPES)}")
    id_bytes(tok.vocab_size)  # a vocabulary past uint32 is refused here
    return tok


def encode_files(tok: Tokenizer, files: Sequence[str], out: str, split: str = "paragraph",
                 eos_id: Optional[int] = None, progress=sys.stderr) -> Corpus:
    """Encodes the files' documents with tok and writes the token file."""
    eos = tok.eos_id if eos_id is None else eos_id
    if eos is None:
        raise DataError("the tokenizer names no EOS token (no eos_token in tokenizer_config.json, "
                        "no </s>, <|endoftext|>, <eos>); give --eos-id N")
    for f in files:
        if not os.path.isfile(f):
            raise DataError(f"input '{f}' does not exist or is not a file")
    docs: List[np.ndarray] = []
    for f in files:
        size = os.path.getsize(f)
        with open(f, encoding="utf-8") as fh:
            text = fh.read()
        done, next_report = 0, PROGRESS_BYTES
        for d in split_documents(text, split):
            docs.append(np.asarray(tok.encode(d), dtype=np.int64))
            done += len(d)
            if size >= PROGRESS_BYTES and done >= next_report and progress is not None:
                print(f"fp8moe.data: {f}: {done >> 20} of ~{size >> 20} MiB, "
                      f"{len(docs)} documents", file=progress, flush=True)
                next_report += PROGRESS_BYTES
    corpus = write_corpus(out, docs, tok.vocab_size, eos)
    if progress is not None:
        print(f"fp8moe.data: wrote {out}: {len(docs)} documents, {corpus.ids.size} tokens, "
              f"vocab {tok.vocab_size}, EOS {eos}", file=progress)
    return corpus


def decode_corpus(tok: Tokenizer, corpus: Corpus, split: str = "paragraph") -> str:
    """The corpus's text: each document without its EOS, joined by split."""
    return join_documents([tok.decode([int(i) for i in d[:-1]]) for d in corpus.documents()],
                          split)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fp8moe.data",
                                description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("encode", "decode"):
        s = sub.add_parser(name)
        s.add_argument("--tokenizer", required=True, help="tokenizer.json, .model or a model dir")
        s.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
        s.add_argument("--split", default="paragraph", choices=SPLITS,
                       help="documents: per blank-line paragraph, per line, or per file")
        if name == "encode":
            s.add_argument("--in", dest="inputs", nargs="+", required=True, metavar="TEXT")
            s.add_argument("--out", required=True, metavar="CORPUS")
            s.add_argument("--eos-id", type=int, default=None,
                           help="the EOS id (default: the tokenizer's)")
        else:
            s.add_argument("--in", dest="input", required=True, metavar="CORPUS")
            s.add_argument("--out", default=None, metavar="TEXT", help="default: stdout")
    a = p.parse_args(argv)
    try:
        tok = load_tokenizer(a.tokenizer, a.tokenizer_type)
        if a.command == "encode":
            encode_files(tok, a.inputs, a.out, a.split, a.eos_id)
        else:
            corpus = read_corpus(a.input)
            if corpus.vocab_size > tok.vocab_size:
                raise DataError(f"'{a.input}' has a vocabulary of {corpus.vocab_size} ids but "
                                f"the tokenizer has {tok.vocab_size}; give the tokenizer it "
                                "was encoded with")
            text = decode_corpus(tok, corpus, a.split)
            if a.out is None:
                sys.stdout.write(text)
            else:
                with open(a.out, "w", encoding="utf-8") as f:
                    f.write(text)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (OSError, UnicodeDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
