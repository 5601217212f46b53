"""Decode loop on the CPU: speculative greedy decoding equals plain greedy decoding, steering replays a
reference, rejected drafts' K/V never leak, readback matches the device state."""

import dataclasses
import itertools
from collections.abc import Iterator

import pytest
import torch
from helpers import single_thread

from simharness.engine.decode import PHASES, DecodeLoop
from simharness.engine.model import Transformer, get_config

# A random model with a 64-token vocabulary falls into cycles under greedy decoding, as real text
# repeats itself, so the n-gram proposer's drafts get accepted (and rejected) often.
SMALL_VOCAB = dataclasses.replace(get_config("tiny"), vocab_size=64)
MAX_LEN = 96
N_GEN = 28


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    yield from single_thread()


def make_loop(k: int, **kwargs) -> DecodeLoop:
    model = Transformer(SMALL_VOCAB, max_slots=4, max_len=MAX_LEN, device="cpu", seed=0)
    args = {"min_n": 1, "max_n": 3, "tie_break": "earliest", "invalid": "pad"} | kwargs
    return DecodeLoop(model, k=k, **args)


# (join at step, slot, prompt): different lengths, two requests join mid-way, one reuses a freed slot.
REQUESTS = [
    (0, 0, [1, 2, 3, 4, 5] * 3),
    (0, 2, [9, 8, 7] * 4 + [1]),
    (0, 1, list(range(10, 30))),
    (3, 3, [5, 6, 5, 6, 7]),
    (4, 0, [40, 41, 42, 43, 40, 41]),  # waits until slot 0 is free again
]


def decode(loop: DecodeLoop, references: list[list[int]] | None = None, temperature: float = 0.0) -> dict:
    """Drive the loop like a scheduler: requests join and leave, the batch changes every step (every
    third step one request sits out). Returns each request's first N_GEN tokens and the totals."""
    pending, active, streams = list(enumerate(REQUESTS)), {}, {}
    accepted = verified = 0
    for step in itertools.count():
        for i, (join, slot, prompt) in list(pending):
            if join <= step and slot not in active.values():
                reference = None if references is None else references[i]
                first = loop.add_request(slot, prompt, reference_ids=reference, temperature=temperature)
                streams[i] = first.tolist()
                active[i] = slot
                pending.remove((i, (join, slot, prompt)))
        if not active:
            break
        batch = sorted(active)
        if step % 3 == 2 and len(batch) > 1:
            batch.pop(step % len(batch))
        result = loop.step(torch.tensor([active[i] for i in batch]))
        out = loop.readback(result)
        assert len(out.phase_s) == len(PHASES) and min(out.phase_s) >= 0
        # the verify's inputs and its forward are separate parts, which add up to its phase
        assert len(out.parts_s) == len(PHASES) + 1 and out.parts_s[0] + out.parts_s[1] == out.phase_s[0]
        assert out.parts_s[2:] == out.phase_s[1:]
        for row, i in enumerate(batch):
            n = int(out.num_emitted[row])
            assert (out.tokens[row, n:] == -1).all()
            streams[i] += out.tokens[row, :n].tolist()
            accepted += n - 1
            verified += int(out.num_drafts[row])
        for i in batch:
            if len(streams[i]) >= N_GEN:
                # What the host saw equals what the device committed.
                slot = active.pop(i)
                committed = loop.history[slot, : int(loop.lengths[slot])].tolist()
                assert committed == REQUESTS[i][2] + streams[i]
                loop.remove_request(slot)
    return {"tokens": [streams[i][:N_GEN] for i in range(len(REQUESTS))], "accepted": accepted, "verified": verified}


@pytest.fixture(scope="module")
def plain_greedy() -> list[list[int]]:
    return decode(make_loop(k=0))["tokens"]


def test_plain_decoding_equals_greedy_by_full_recompute(plain_greedy: list[list[int]]) -> None:
    model = Transformer(SMALL_VOCAB, max_slots=1, max_len=MAX_LEN, device="cpu", seed=0)
    for (_, _, prompt), generated in zip(REQUESTS[:2], plain_greedy, strict=False):
        seq = list(prompt)
        for _ in range(12):
            seq.append(int(model.prefill(0, torch.tensor(seq)).argmax()))
        assert seq[len(prompt) :] == generated[:12]


@pytest.mark.parametrize(
    ("k", "tie_break", "invalid"), list(itertools.product([2, 4], ["earliest", "latest"], ["pad", "fill"]))
)
def test_speculative_greedy_equals_plain_greedy(plain_greedy: list[list[int]], k: int, tie_break: str, invalid: str):
    result = decode(make_loop(k, tie_break=tie_break, invalid=invalid))
    assert result["tokens"] == plain_greedy
    assert result["accepted"] > 20  # the drafts really were used
    assert result["verified"] > result["accepted"]  # and some were rejected


@pytest.mark.parametrize(("k", "invalid", "temperature"), [(0, "pad", 0.0), (4, "pad", 0.0), (4, "fill", 1.0)])
def test_steering_replays_the_reference(k: int, invalid: str, temperature: float) -> None:
    gen = torch.Generator().manual_seed(3)
    # Text-like references: a random phrase repeated with variations, so drafts get accepted.
    references = []
    for _ in REQUESTS:
        phrase = torch.randint(64, (7,), generator=gen).tolist()
        references.append((phrase + torch.randint(64, (2,), generator=gen).tolist()) * 4 + phrase)
    result = decode(make_loop(k, invalid=invalid), references, temperature)
    assert result["tokens"] == [reference[:N_GEN] for reference in references]
    if k:
        assert result["accepted"] > 50


def test_rejected_drafts_kv_does_not_leak() -> None:
    """After speculative steps with rejections, the next verify of each slot gives the same logits as a
    fresh model that only ever saw the committed tokens."""
    loop = make_loop(k=4, invalid="fill")
    slots = torch.tensor([0, 1, 2])
    for slot, (_, _, prompt) in zip(slots.tolist(), REQUESTS, strict=False):
        loop.add_request(slot, prompt)
    rejected = 0
    for _ in range(6):
        out = loop.readback(loop.step(slots))
        rejected += int((out.num_drafts - (out.num_emitted - 1)).sum())
    assert rejected > 0
    fresh = Transformer(SMALL_VOCAB, max_slots=1, max_len=MAX_LEN, device="cpu", seed=0)
    for slot in slots.tolist():
        n = int(loop.lengths[slot])
        committed = loop.history[slot, :n]
        fresh.prefill(0, committed[:-1])
        # T = 1: the stale K/V at positions >= n lies past the query and must be masked, not attended.
        after_spec = loop.model.verify(committed[-1:][None], slots[slot : slot + 1], torch.tensor([n - 1]))
        clean = fresh.verify(committed[-1:][None], torch.tensor([0]), torch.tensor([n - 1]))
        torch.testing.assert_close(after_spec, clean, rtol=1e-5, atol=1e-5)


def test_readback_too_late_is_refused() -> None:
    loop = make_loop(k=2)
    loop.add_request(0, [1, 2, 3])
    first = loop.step(torch.tensor([0]))
    for _ in range(4):
        loop.step(torch.tensor([0]))
    with pytest.raises(RuntimeError, match="overwritten"):
        loop.readback(first)
