"""N-gram proposer: reference, torch, Triton (interpreted on CPU) and the numpy row version agree exactly."""

from collections.abc import Iterator

import pytest
import torch
from helpers import interpreted_kernels
from hypothesis import given, settings
from hypothesis import strategies as st

from simharness.kernels import ngram_triton
from simharness.kernels.ngram import propose_ngram, propose_ngram_reference, propose_ngram_torch
from simharness.kernels.ngram_row import propose_ngram_row
from simharness.kernels.ngram_triton import propose_ngram_triton


@pytest.fixture(scope="module", autouse=True)
def _interpreted_kernels() -> Iterator[None]:
    yield from interpreted_kernels(ngram_triton, ("_ngram_scan_kernel", "_ngram_finalize_kernel"))


def assert_all_agree(token_ids: torch.Tensor, seq_lens: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The four implementations give identical drafts and counts; returns the reference result."""
    drafts, num_valid = propose_ngram_reference(token_ids, seq_lens, **kwargs)
    assert drafts.dtype == token_ids.dtype and drafts.shape == (token_ids.shape[0], kwargs["k"])
    assert num_valid.dtype == torch.int32
    for impl in (propose_ngram_torch, propose_ngram_triton):
        got_drafts, got_valid = impl(token_ids, seq_lens, **kwargs)
        assert got_drafts.dtype == token_ids.dtype, impl.__name__
        assert torch.equal(got_drafts, drafts), (impl.__name__, got_drafts, drafts)
        assert torch.equal(got_valid, num_valid), (impl.__name__, got_valid, num_valid)
    row_kwargs = {key: value for key, value in kwargs.items() if key != "invalid"}
    for b in range(token_ids.shape[0]):
        history = token_ids[b, : int(seq_lens[b])].numpy()
        row = propose_ngram_row(history, **row_kwargs)
        assert row.tolist() == drafts[b, : int(num_valid[b])].tolist(), (b, row, drafts[b])
    return drafts, num_valid


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_batches_agree(data: st.DataObject) -> None:
    batch = data.draw(st.integers(1, 4))
    width = data.draw(st.integers(1, 40))
    vocab = data.draw(st.integers(1, 4))  # a small vocabulary makes matches of every length common
    dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))
    min_n = data.draw(st.integers(1, 3))
    max_n = data.draw(st.integers(min_n, min_n + 3))
    rows = data.draw(
        st.lists(st.lists(st.integers(0, vocab - 1), min_size=width, max_size=width), min_size=batch, max_size=batch)
    )
    seq_lens = data.draw(st.lists(st.integers(0, width), min_size=batch, max_size=batch))
    assert_all_agree(
        torch.tensor(rows, dtype=dtype),
        torch.tensor(seq_lens),
        min_n=min_n,
        max_n=max_n,
        k=data.draw(st.integers(0, 5)),
        tie_break=data.draw(st.sampled_from(["earliest", "latest"])),
        invalid=data.draw(st.sampled_from(["pad", "fill"])),
    )


def one_row(tokens: list[int], seq_len: int | None = None, **kwargs) -> tuple[list[int], int]:
    """Run a single row through every implementation; returns (drafts, num_valid) as Python values."""
    seq_len = len(tokens) if seq_len is None else seq_len
    drafts, num_valid = assert_all_agree(torch.tensor([tokens]), torch.tensor([seq_len]), **kwargs)
    return drafts[0].tolist(), int(num_valid[0])


@pytest.mark.parametrize("invalid, fill", [("pad", -1), ("fill", 5)])
def test_no_match(invalid: str, fill: int) -> None:
    assert one_row([1, 2, 3, 4, 5], min_n=1, max_n=3, k=3, invalid=invalid) == ([fill] * 3, 0)


def test_match_at_the_very_start() -> None:
    assert one_row([7, 8, 9, 1, 2, 7, 8], min_n=2, max_n=3, k=4) == ([9, 1, 2, 7], 4)


def test_continuation_shorter_than_k() -> None:
    assert one_row([1, 2, 3, 1, 2], min_n=2, max_n=2, k=5) == ([3, 1, 2, -1, -1], 3)
    assert one_row([1, 2, 3, 1, 2], min_n=2, max_n=2, k=5, invalid="fill") == ([3, 1, 2, 2, 2], 3)


def test_min_n_one() -> None:
    assert one_row([5, 6, 5], min_n=1, max_n=1, k=2) == ([6, 5], 2)


def test_seq_len_below_min_n() -> None:
    assert one_row([4, 4, 4, 4], seq_len=2, min_n=3, max_n=4, k=2) == ([-1, -1], 0)
    assert one_row([4, 4, 4, 4], seq_len=2, min_n=3, max_n=4, k=2, invalid="fill") == ([4, 4], 0)


def test_longest_n_beats_a_more_recent_shorter_match() -> None:
    tokens = [1, 2, 3, 4, 9, 3, 7, 1, 2, 3]  # [1, 2, 3] at 0; the 1-gram [3] again at 5, more recently
    for tie_break in ("earliest", "latest"):
        assert one_row(tokens, min_n=1, max_n=3, k=4, tie_break=tie_break) == ([4, 9, 3, 7], 4)


def test_tie_breaks_pick_different_occurrences() -> None:
    tokens = [1, 2, 10, 1, 2, 20, 1, 2]
    assert one_row(tokens, min_n=2, max_n=2, k=4, tie_break="earliest") == ([10, 1, 2, 20], 4)
    assert one_row(tokens, min_n=2, max_n=2, k=4, tie_break="latest") == ([20, 1, 2, -1], 3)


def test_tokens_past_seq_len_are_never_read() -> None:
    # Committed: [3, 1, 2, 9, 1, 2]; the padding would match [1, 2] and continue with 8 if it were read.
    tokens = [3, 1, 2, 9, 1, 2, 1, 2, 8, 8]
    assert one_row(tokens, seq_len=6, min_n=2, max_n=2, k=4, tie_break="latest") == ([9, 1, 2, -1], 3)


def test_padding_rows_full_rows_and_k_zero() -> None:
    token_ids = torch.tensor([[1, 2, 1, 2, 1, 2], [7, 7, 7, 7, 7, 7], [1, 2, 3, 1, 2, 3]])
    seq_lens = torch.tensor([0, 6, 6])
    drafts, num_valid = assert_all_agree(token_ids, seq_lens, min_n=1, max_n=3, k=3, invalid="fill")
    assert drafts.tolist() == [[-1, -1, -1], [7, 7, 7], [1, 2, 3]]
    assert num_valid.tolist() == [0, 3, 3]
    drafts, num_valid = assert_all_agree(token_ids, seq_lens, min_n=1, max_n=3, k=0)
    assert drafts.shape == (3, 0) and num_valid.tolist() == [0, 0, 0]


def test_strided_rows_and_many_scan_blocks() -> None:
    """A row view of a wider buffer (stride > width) and rows long enough for several Triton scan blocks."""
    generator = torch.Generator().manual_seed(0)
    buffer = torch.randint(0, 3, (3, 3000), generator=generator, dtype=torch.int32)
    token_ids = buffer[:, :2500]
    seq_lens = torch.tensor([2500, 1100, 17])
    for tie_break in ("earliest", "latest"):
        assert_all_agree(token_ids, seq_lens, min_n=3, max_n=6, k=4, tie_break=tie_break)


def test_dispatch_on_cpu_uses_torch() -> None:
    token_ids = torch.tensor([[1, 2, 3, 1, 2]])
    got = propose_ngram(token_ids, torch.tensor([5]), min_n=2, max_n=2, k=2)
    assert got[0].tolist() == [[3, 1]] and got[1].tolist() == [2]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_n": 0, "max_n": 2, "k": 1},
        {"min_n": 3, "max_n": 2, "k": 1},
        {"min_n": 1, "max_n": 2, "k": -1},
        {"min_n": 1, "max_n": 2, "k": 1, "tie_break": "middle"},
        {"min_n": 1, "max_n": 2, "k": 1, "invalid": "zero"},
    ],
)
def test_bad_arguments_raise(kwargs: dict) -> None:
    for impl in (propose_ngram_reference, propose_ngram_torch, propose_ngram_triton):
        with pytest.raises(ValueError):
            impl(torch.zeros((1, 4), dtype=torch.int64), torch.tensor([4]), **kwargs)
