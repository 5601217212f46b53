"""The stdlib corpus and the tokenizer: present, deterministic, lossless."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from simharness import corpus
from simharness.tokenizer import NUM_BYTE_TOKENS, Tokenizer, pretokenize

# Any text that UTF-8 can encode (lone surrogates cannot be).
TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)))


def test_pieces_are_gpt2_style():
    assert pretokenize("def parse_args(x=42):\n    return x's") == [
        "def", " parse", "_", "args", "(", "x", "=", "42", "):", "\n   ", " return", " x", "'s",
    ]  # fmt: skip


@given(TEXT)
def test_pretokenize_covers_any_text(text):
    assert "".join(pretokenize(text)) == text


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return corpus.load_corpus().tokenizer


@given(TEXT)
def test_round_trip_any_text(tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids.dtype == np.int32
    assert tokenizer.decode(ids) == text


def test_corpus_streams_round_trip():
    c = corpus.load_corpus()
    docs = corpus.documents()
    assert c.tokenizer.decode(c.code.tokens) == "".join(t for d in docs for t in d.code)
    assert c.tokenizer.decode(c.prose.tokens) == "".join(t for d in docs for t in d.prose)


def test_vocabulary_is_deterministic_and_bounded():
    texts = ["the cat sat on the mat", "the cat ran", " cat cat"]
    a, b = Tokenizer.train(texts, 260), Tokenizer.train(list(reversed(texts)), 260)
    assert a.pieces == b.pieces == (" cat", "the", " mat", " on")  # by count, then text
    ids = a.encode("the cat purred")
    assert ids.max() < a.vocab_size
    assert (ids < NUM_BYTE_TOKENS).sum() == len(" purred")  # out of vocabulary: bytes
    assert a.decode(ids) == "the cat purred"


def test_corpus_is_present_and_identical_on_reload():
    first = corpus.load_corpus()
    assert first.names == corpus.FILES
    assert first.tokenizer.vocab_size == 32000
    assert len(first.tokenizer.pieces) > 5000
    assert first.code.tokens.size > 100_000 and first.prose.tokens.size > 20_000
    corpus.load_corpus.cache_clear()
    corpus.documents.cache_clear()
    again = corpus.load_corpus()
    assert again is not first
    assert again.fingerprint == first.fingerprint
    assert again.tokenizer.pieces == first.tokenizer.pieces
    for name in ("code", "prose"):
        s, t = getattr(first, name), getattr(again, name)
        for field in ("tokens", "start", "length", "doc"):
            np.testing.assert_array_equal(getattr(s, field), getattr(t, field))


def test_passages_tile_each_stream():
    c = corpus.load_corpus()
    for stream in (c.code, c.prose):
        assert stream.start[0] == 0
        np.testing.assert_array_equal(stream.start[1:], (stream.start + stream.length)[:-1])
        assert stream.start[-1] + stream.length[-1] == stream.tokens.size
        assert (stream.length > 0).all()
        assert (np.diff(stream.doc) >= 0).all() and stream.doc.max() < len(c.names)


def test_window_wraps_around_the_stream():
    stream = corpus.load_corpus().prose
    size = stream.tokens.size
    w = stream.window(size - 3, 5)
    np.testing.assert_array_equal(w, np.concatenate([stream.tokens[-3:], stream.tokens[:2]]))


def test_vendored_sources_hold_exactly_the_listed_files():
    import gzip
    import json

    vendored = json.loads(gzip.decompress(corpus.SOURCES.read_bytes()))
    assert sorted(vendored["files"]) == list(corpus.FILES) and vendored["python"] == "3.11.7"
    assert vendored["files"]["heapq.py"].startswith('"""Heap queue algorithm')
    assert corpus.SOURCES.with_name("CORPUS-LICENSE.txt").read_text().count("PYTHON SOFTWARE FOUNDATION LICENSE")


def test_corpus_fingerprint_is_pinned():
    """The tokens every replayed workload is cut from, on any machine and Python: the vendored text, the vocabulary
    trained on it and the passages. A change here changes every workload and replay acceptance (and the committed
    sim results with them): make it on purpose, and re-baseline."""
    assert corpus.load_corpus().fingerprint == "df9dd588d231f0b0"
