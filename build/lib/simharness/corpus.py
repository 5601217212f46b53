"""The text corpus: Python standard-library source, shipped with the package.

Two token streams, each cut into natural passages:
- `code`: the full source of `FILES`, cut at every top-level `def`/`class` and every method (with
  its decorators), so a passage is one function, one method or one class header;
- `prose`: the docstrings of the same files (module, class and function docstrings, cleaned as
  `inspect.cleandoc` does), one passage per docstring, in source order.

The files' text is vendored (`SOURCES`, written by `scripts/vendor-corpus` from CPython 3.11.7, PSF licence in
`data/CORPUS-LICENSE.txt`), not read from the running Python: the listed files are byte-identical in CPython
3.11.2, 3.11.7, 3.12.1 and 3.13.0, but patch releases backport fixes into such modules, and a corpus that
follows the installed Python gives other requests, and other replay acceptance, on another machine (the H100's
Python 3.12.3 most likely did: docs/calibration.md). `Corpus.fingerprint` tells two machines' corpora apart.
"""

from __future__ import annotations

import ast
import functools
import gzip
import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from simharness.tokenizer import DEFAULT_VOCAB_SIZE, CheckpointTokenizer, Tokenizer, checkpoint_tokenizer

# Sorted; paths relative to the stdlib directory.
FILES = (
    "__future__.py",
    "_compression.py",
    "_markupbase.py",
    "_py_abc.py",
    "_threading_local.py",
    "_weakrefset.py",
    "asyncio/protocols.py",
    "concurrent/futures/_base.py",
    "difflib.py",
    "email/_encoded_words.py",
    "email/contentmanager.py",
    "email/headerregistry.py",
    "email/mime/image.py",
    "email/quoprimime.py",
    "graphlib.py",
    "heapq.py",
    "json/__init__.py",
    "multiprocessing/heap.py",
    "multiprocessing/reduction.py",
    "multiprocessing/sharedctypes.py",
    "optparse.py",
    "pyclbr.py",
    "string.py",
    "tomllib/_parser.py",
    "tracemalloc.py",
    "unittest/suite.py",
    "unittest/util.py",
    "urllib/robotparser.py",
    "weakref.py",
    "wsgiref/headers.py",
    "xml/dom/__init__.py",
    "xml/dom/domreg.py",
    "xml/dom/pulldom.py",
    "xml/dom/xmlbuilder.py",
    "xml/etree/ElementPath.py",
    "xml/sax/handler.py",
    "xml/sax/saxutils.py",
    "zoneinfo/_common.py",
)

# Docstrings shorter than this are labels ("Return x."), not prose worth summarising.
MIN_DOCSTRING_CHARS = 80


@dataclass(frozen=True)
class Document:
    """One file's passages as text: its code cut at definitions, and its long docstrings."""

    name: str
    code: tuple[str, ...]
    prose: tuple[str, ...]


@dataclass(frozen=True, eq=False)
class Stream:
    """One genre's documents tokenised back to back; passage p is tokens[start[p] : start[p] + length[p]]."""

    tokens: np.ndarray  # int32 [T]
    start: np.ndarray  # int64 [P], ascending
    length: np.ndarray  # int64 [P], > 0
    doc: np.ndarray  # int64 [P], index into Corpus.names

    def window(self, start: int, length: int) -> np.ndarray:
        """`length` tokens from `start`, wrapping past the end of the stream (a copy)."""
        if start + length <= len(self.tokens):
            return self.tokens[start : start + length].copy()
        return np.take(self.tokens, np.arange(start, start + length), mode="wrap")


@dataclass(frozen=True, eq=False)
class Corpus:
    tokenizer: Tokenizer | CheckpointTokenizer
    names: tuple[str, ...]  # the files that were found, in FILES order
    code: Stream
    prose: Stream

    @property
    def fingerprint(self) -> str:
        """sha256 over the vocabulary and both streams: equal iff two machines see the same tokens."""
        h = hashlib.sha256()
        h.update("\0".join(self.tokenizer.pieces).encode())
        for stream in (self.code, self.prose):
            for array in (stream.tokens, stream.start, stream.length, stream.doc):
                h.update(array.tobytes())
        return h.hexdigest()[:16]


# The vendored source of FILES: {"python": where it was taken from, "files": {name: text}}.
SOURCES = Path(__file__).with_name("data") / "corpus.json.gz"


def _split_code(source: str, tree: ast.Module) -> tuple[str, ...]:
    """Cut a module's source at each top-level definition and each method, decorators included."""
    nodes: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            nodes.append(node)
        if isinstance(node, ast.ClassDef):
            nodes.extend(n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    starts = {0} | {min([n.lineno, *(d.lineno for d in n.decorator_list)]) - 1 for n in nodes}
    lines = source.splitlines(keepends=True)
    bounds = [*sorted(starts), len(lines)]
    return tuple("".join(lines[a:b]) for a, b in itertools.pairwise(bounds) if a < b)


def _docstrings(tree: ast.Module) -> tuple[str, ...]:
    """The module's, classes' and functions' docstrings in source order, long enough to be prose."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= MIN_DOCSTRING_CHARS:
                line = node.body[0].lineno
                found.append((line, doc + "\n\n"))
    return tuple(doc for _, doc in sorted(found))


@functools.lru_cache(maxsize=1)
def documents() -> tuple[Document, ...]:
    """The corpus files as text passages, in FILES order."""
    sources = json.loads(gzip.decompress(SOURCES.read_bytes()))["files"]
    docs = []
    for name in FILES:
        source = sources[name]
        tree = ast.parse(source)
        docs.append(Document(name, _split_code(source, tree), _docstrings(tree)))
    return tuple(docs)


def _stream(tokenizer: Tokenizer | CheckpointTokenizer, passages_by_doc: list[tuple[str, ...]]) -> Stream:
    parts, doc_of = [], []
    for d, passages in enumerate(passages_by_doc):
        for text in passages:
            ids = tokenizer.encode(text)
            if len(ids):
                parts.append(ids)
                doc_of.append(d)
    length = np.array([len(p) for p in parts], dtype=np.int64)
    start = np.concatenate([[0], np.cumsum(length)[:-1]]).astype(np.int64)
    return Stream(np.concatenate(parts), start, length, np.array(doc_of, dtype=np.int64))


@functools.lru_cache(maxsize=4)
def load_corpus(vocab_size: int = DEFAULT_VOCAB_SIZE, checkpoint: Path | None = None) -> Corpus:
    """The corpus tokenised with a vocabulary trained on it, or with a checkpoint directory's own tokenizer
    (cached per process)."""
    docs = documents()
    if checkpoint is None:
        tokenizer = Tokenizer.train([t for d in docs for t in d.code + d.prose], vocab_size)
    else:
        tokenizer = checkpoint_tokenizer(checkpoint)
    return Corpus(
        tokenizer=tokenizer,
        names=tuple(d.name for d in docs),
        code=_stream(tokenizer, [d.code for d in docs]),
        prose=_stream(tokenizer, [d.prose for d in docs]),
    )
