"""A deterministic tokenizer: GPT-2-style pre-tokenisation mapped to ids by a frequency vocabulary.

Why this tokenizer: n-gram speculation matches token ids, so acceptance depends on how text is cut
into tokens. A real BPE (tiktoken, HF `tokenizers`) needs a dependency and a downloaded vocabulary;
this needs neither and still cuts text the way GPT-2 does at its coarsest level (the pre-tokeniser
regex: words with their leading space, digit runs, punctuation runs, whitespace runs), so repeated
text repeats as repeated ids and code indentation becomes whitespace tokens, as under a subword
tokenizer. The difference: a piece is one token or falls back to its bytes, instead of being merged
from subwords, so rare words cost more tokens than under BPE.

Ids: 0..255 are the raw bytes (the fallback for any piece outside the vocabulary, so every string
round-trips); 256.. are the training text's multi-byte pieces, most frequent first (ties by the
piece's text), up to `vocab_size`. The default 32000 keeps ids inside a real target model's
vocabulary (Llama 3: 128256).

With a checkpoint (`engine.model` a directory) the workload's text is cut by the checkpoint's own
tokenizer instead (`CheckpointTokenizer`, its tokenizer.json through the `tokenizers` library): the served
model's tokens decide what an n-gram is.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import tokenizers

from simharness.errors import ScenarioError
from simharness.models import checkpoint_config

DEFAULT_VOCAB_SIZE = 32000
NUM_BYTE_TOKENS = 256

# GPT-2's pattern with the `regex` module's \p{L} / \p{N} written for `re`: letters are word
# characters that are not digits or "_", and "_" counts as punctuation (as in GPT-2, so
# `parse_args` is "parse", "_", "args"). Every character falls in one alternative, so the pieces
# concatenate back to the text.
PIECE_PATTERN = re.compile(r"""'(?:s|t|re|ve|m|ll|d)| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+""")


def pretokenize(text: str) -> list[str]:
    """Split text into GPT-2-style pieces; "".join(pieces) == text."""
    return PIECE_PATTERN.findall(text)


class Tokenizer:
    """Byte tokens 0..255, then one id per vocabulary piece; encode/decode round-trip any text."""

    def __init__(self, pieces: Sequence[str], vocab_size: int = DEFAULT_VOCAB_SIZE):
        if NUM_BYTE_TOKENS + len(pieces) > vocab_size:
            raise ValueError(f"{len(pieces)} pieces + {NUM_BYTE_TOKENS} bytes exceed vocab_size {vocab_size}")
        self.vocab_size = vocab_size  # ids are < vocab_size; the top ones are unused if pieces run out
        self.pieces = tuple(pieces)  # piece i has id NUM_BYTE_TOKENS + i
        self._ids = {piece: NUM_BYTE_TOKENS + i for i, piece in enumerate(self.pieces)}
        self._bytes = [bytes([b]) for b in range(NUM_BYTE_TOKENS)] + [p.encode() for p in self.pieces]

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
        """Vocabulary = the texts' multi-byte pieces by descending count, ties by text (deterministic)."""
        if vocab_size < NUM_BYTE_TOKENS:
            raise ValueError(f"vocab_size must be >= {NUM_BYTE_TOKENS}, got {vocab_size}")
        counts = Counter(piece for text in texts for piece in pretokenize(text))
        multi_byte = [p for p in counts if len(p.encode()) > 1]  # single bytes already have ids
        multi_byte.sort(key=lambda p: (-counts[p], p))
        return cls(multi_byte[: vocab_size - NUM_BYTE_TOKENS], vocab_size)

    def vocabulary(self) -> Iterator[tuple[int, str]]:
        """Id and text of each vocabulary piece (the byte tokens are not listed)."""
        return enumerate(self.pieces, start=NUM_BYTE_TOKENS)

    def encode(self, text: str) -> np.ndarray:
        """Token ids (int32): a vocabulary piece is one id, any other piece its UTF-8 bytes."""
        ids: list[int] = []
        for piece in pretokenize(text):
            i = self._ids.get(piece)
            if i is None:
                ids.extend(piece.encode())
            else:
                ids.append(i)
        return np.array(ids, dtype=np.int32)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Text of a token sequence (invalid UTF-8 from a cut byte sequence shows as U+FFFD)."""
        table = self._bytes
        return b"".join(table[i] for i in np.asarray(ids, dtype=np.int64).tolist()).decode(errors="replace")


class CheckpointTokenizer:
    """A checkpoint's tokenizer.json behind the built-in tokenizer's interface. `pieces` holds every id's text
    (a byte-level token that is part of a UTF-8 character shows as U+FFFD)."""

    def __init__(self, file: Path):
        self._tokenizer = tokenizers.Tokenizer.from_file(str(file))
        self.vocab_size = max(self._tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        ids = [[i] for i in range(self.vocab_size)]
        self.pieces = tuple(self._tokenizer.decode_batch(ids, skip_special_tokens=False))

    def vocabulary(self) -> Iterator[tuple[int, str]]:
        return enumerate(self.pieces)

    def encode(self, text: str) -> np.ndarray:
        """Token ids (int32) of the text alone: no special tokens are added."""
        return np.array(self._tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        return self._tokenizer.decode(np.asarray(ids, dtype=np.int64).tolist(), skip_special_tokens=False)


def checkpoint_tokenizer(path: Path) -> CheckpointTokenizer:
    """The tokenizer of checkpoint directory `path`, checked against its model: every id needs an embedding row."""
    file = path / "tokenizer.json"
    if not file.is_file():
        raise ScenarioError(f"checkpoint {path}: no tokenizer.json")
    try:
        tokenizer = CheckpointTokenizer(file)
    except Exception as e:  # the tokenizers library raises plain Exceptions
        raise ScenarioError(f"checkpoint {path}: cannot read tokenizer.json ({e})") from None
    rows = checkpoint_config(path).vocab_size
    if tokenizer.vocab_size > rows:
        raise ScenarioError(f"checkpoint {path}: tokenizer.json has {tokenizer.vocab_size} tokens, more than the "
                            f"{rows} rows of the model's embedding (config.json vocab_size)")
    return tokenizer
