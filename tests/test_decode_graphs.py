"""The decode step through the step graphs' staging (engine/step_graph.py) against the eager step, on the CPU: where
no graph is captured the same static buffers are staged and the step body runs over them, padding rows and all.
Same tokens, counts and device state in every mode; tests/test_decode_cuda.py replays the captured graphs."""

import cProfile
import dataclasses
import itertools
import pstats
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from helpers import single_thread

from simharness.engine.decode import MARKS, DecodeLoop
from simharness.engine.model import Transformer, get_config
from simharness.kernels import NO_DRAFT

SMALL_VOCAB = dataclasses.replace(get_config("tiny"), vocab_size=64)
SLOTS, MAX_LEN = 6, 160  # buckets 1, 2, 4, 6: batches of 3 and 5 are padded


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    yield from single_thread()


def twin_loops(k: int, **kwargs) -> list[DecodeLoop]:
    """An eager loop and a staged-graph loop over two copies of the same model."""
    loops = []
    for graphs in (False, True):
        model = Transformer(SMALL_VOCAB, max_slots=SLOTS, max_len=MAX_LEN, device="cpu", seed=0)
        loops.append(DecodeLoop(model, k=k, min_n=1, max_n=3, step_graphs=graphs, **kwargs))
    return loops


def run_twins(k: int, *, steer: bool, temperature: str, host_lengths: bool, host_drafts: bool,
              invalid: str = "pad", n_steps: int = 14, seed: int = 0,
              step_ks: tuple[int, ...] | None = None) -> int:  # fmt: skip
    """Drive both loops with the same random batches (every batch size, slots in any order; with `step_ks`, each
    step verifies one of them, drawn) and compare each step's results and the real slots' device state; returns the
    drafts accepted."""
    rng = np.random.default_rng(seed)
    loops = twin_loops(k, invalid=invalid, device_proposer=not host_drafts, seed=seed, step_ks=step_ks)
    temperatures = {"greedy": [0.0] * SLOTS, "random": [1.0] * SLOTS, "mixed": [0.0, 1.0] * (SLOTS // 2)}[temperature]
    for slot in range(SLOTS):
        motif = rng.integers(0, 64, 5).tolist()
        prompt = (motif * 4)[: 8 + slot]
        reference = (motif * 30)[: MAX_LEN - 20] if steer and slot % 2 == 0 else None
        for loop in loops:
            loop.add_request(slot, prompt, reference_ids=reference, temperature=temperatures[slot])
    accepted = 0
    for _ in range(n_steps):
        batch = int(rng.integers(1, SLOTS + 1))
        slots = rng.permutation(SLOTS)[:batch]
        step_k = k if step_ks is None else int(rng.choice(step_ks))
        lengths = loops[0].lengths[slots].numpy().copy() if host_lengths else None
        drafts = None
        if host_drafts and step_k:
            drafts = rng.integers(0, 64, (batch, step_k))
            drafts[rng.random((batch, step_k)) < 0.3] = NO_DRAFT
        outs = [loop.readback(loop.step(slots, k=step_k, lengths=lengths, drafts=drafts)) for loop in loops]
        eager, graphed = outs
        np.testing.assert_array_equal(graphed.packed, eager.packed)
        assert (eager.num_drafts <= step_k).all() and (eager.tokens[:, step_k + 1 :] == -1).all()
        assert len(graphed.parts_s) == MARKS - 1 and min(graphed.parts_s) >= 0
        assert graphed.parts_s[0] + graphed.parts_s[1] == graphed.phase_s[0]
        accepted += int((eager.num_emitted - 1).sum())
        for name in ("history", "lengths", "drafts", "num_valid"):  # the real slots; the scratch row may differ
            assert torch.equal(getattr(loops[1], name)[:SLOTS], getattr(loops[0], name)[:SLOTS]), name
        # K/V to rounding: a padded batch is a GEMM of another shape, whose CPU kernel may round differently
        torch.testing.assert_close(loops[1].model.k_cache[:, :SLOTS], loops[0].model.k_cache[:, :SLOTS])
    return accepted


@pytest.mark.parametrize(("k", "invalid"), [(0, "pad"), (2, "fill"), (4, "pad"), (4, "fill")])
@pytest.mark.parametrize("temperature", ["greedy", "mixed"])
def test_staged_step_equals_eager_step(k: int, invalid: str, temperature: str) -> None:
    for steer, host_lengths in itertools.product((False, True), (False, True)):
        accepted = run_twins(k, steer=steer, temperature=temperature, host_lengths=host_lengths, host_drafts=False,
                             invalid=invalid, seed=k + steer + 2 * host_lengths)  # fmt: skip
        if k and steer:
            assert accepted > 10  # the drafts really were used


@pytest.mark.parametrize("temperature", ["greedy", "random"])
def test_staged_step_equals_eager_step_with_host_drafts(temperature: str) -> None:
    run_twins(3, steer=True, temperature=temperature, host_lengths=True, host_drafts=True)


@pytest.mark.parametrize("invalid", ["pad", "fill"])
def test_staged_step_equals_eager_step_at_each_steps_k(invalid: str) -> None:
    """A k schedule's steps: each verifies its own k of the proposer's 4 drafts (0: a plain decode step), through the
    graph of its bucket and k, with the eager step's tokens, counts and device state."""
    for steer, host_lengths in itertools.product((False, True), (False, True)):
        accepted = run_twins(4, steer=steer, temperature="mixed", host_lengths=host_lengths, host_drafts=False,
                             invalid=invalid, n_steps=20, seed=7 + steer + 2 * host_lengths, step_ks=(0, 1, 4))
        if steer:
            assert accepted > 5
    run_twins(3, steer=True, temperature="greedy", host_lengths=True, host_drafts=True, step_ks=(0, 2, 3))


def test_a_step_k_not_captured_is_refused() -> None:
    eager, graphed = twin_loops(4, step_ks=(0, 2))
    assert set(graphed.graphs._graphs) == {(s, k, steered) for s in (1, 2, 4, 6) for k in (0, 2) for steered in (0, 1)}
    for loop in (eager, graphed):
        loop.add_request(0, [1, 2, 3])
        with pytest.raises(ValueError, match="k = 4"):
            loop.step([0])  # the loop's own k is not among its step ks
    with pytest.raises(ValueError, match="within 0..k"):
        twin_loops(2, step_ks=(0, 3))


def step_calls(loop: DecodeLoop, batches: list[np.ndarray], k: int) -> list[dict[str, int]]:
    """Per step at `k`, how many times each function (Python, builtin, torch method) ran inside `DecodeLoop.step`
    and its readback: the host work of a step, counted."""
    counts = []
    for slots in batches:
        profile = cProfile.Profile()
        profile.enable()
        loop.readback(loop.step(slots, k=k))
        profile.disable()
        counts.append({f"{where}:{name}": calls for (where, _, name), (_, calls, *_) in
                       pstats.Stats(profile).stats.items()})  # fmt: skip
    return counts


@pytest.mark.parametrize("graphs", [False, True])
def test_a_steps_host_work_does_not_depend_on_the_other_step_ks(graphs: bool) -> None:
    """A step at the proposer's k under a k schedule (step ks 0, 2 and 4) does the same host work as a fixed k = 4
    loop's step: no per-step allocation, copy, slice of the drafts or lookup for the ks it does not run (issue 31: on
    the H100 a schedule's steps at k = 8 took 0.3 ms more host time than fixed k = 8's)."""
    rng = np.random.default_rng(5)
    batches = [rng.permutation(SLOTS)[: rng.integers(1, SLOTS + 1)] for _ in range(8)]
    runs = []
    for step_ks in (None, (0, 2, 4)):
        model = Transformer(SMALL_VOCAB, max_slots=SLOTS, max_len=MAX_LEN, device="cpu", seed=0)
        loop = DecodeLoop(model, k=4, min_n=1, max_n=3, step_graphs=graphs, step_ks=step_ks)
        for slot in range(SLOTS):
            loop.add_request(slot, [3, 1, 4, 1, 5, 9, 2, 6][: 3 + slot])
        loop.readback(loop.step(batches[0], k=4))  # first calls (imports, caches) out of the count
        runs.append(step_calls(loop, batches, 4))
    fixed, scheduled = runs
    assert sum(fixed[0].values()) > 50  # the count sees the step's work
    for i, (a, b) in enumerate(zip(fixed, scheduled, strict=True)):
        assert a == b, f"step {i}: {({n: (a.get(n), b.get(n)) for n in a.keys() | b.keys() if a.get(n) != b.get(n)})}"


def test_padding_rows_touch_only_the_scratch_row() -> None:
    """A batch of 3 in the 4-bucket: the padding row steps the scratch slot, and no real slot outside the batch."""
    _, loop = twin_loops(2)
    for slot in range(SLOTS):
        loop.add_request(slot, [1, 2, 3, 1, 2] + [slot])
    before = {name: getattr(loop, name).clone() for name in ("history", "lengths", "drafts")}
    out = loop.readback(loop.step(np.array([4, 0, 2])))
    assert out.tokens.shape == (3, 3)
    for name, old in before.items():
        new = getattr(loop, name)
        assert torch.equal(new[[1, 3, 5]], old[[1, 3, 5]]), name  # slots outside the batch: untouched
    assert int(loop.lengths[SLOTS]) > 1  # the scratch row was stepped (from length 1)


def test_device_tensors_are_staged_too() -> None:
    """Slots and lengths given as tensors take the same path as host arrays (here on the CPU: copied as host data)."""
    loops = twin_loops(2)
    for loop in loops:
        for slot in range(3):
            loop.add_request(slot, [5, 6, 7, 5, 6, slot])
    outs = [loop.readback(loop.step(torch.tensor([2, 0]), lengths=torch.tensor([7, 7]))) for loop in loops]
    np.testing.assert_array_equal(outs[1].packed, outs[0].packed)


def test_drafts_only_without_a_device_proposer() -> None:
    eager, graphed = twin_loops(2)
    for loop in (eager, graphed):
        loop.add_request(0, [1, 2, 3])
        with pytest.raises(ValueError, match="drafts"):
            loop.step([0], drafts=np.zeros((1, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="exceeds"):
        graphed.step(list(range(SLOTS + 1)))


def test_step_graphs_hold_the_buckets_up_to_the_runs_largest_batch():
    """A loop told its largest batch builds the graphs of the buckets up to the one that holds it, steps a batch
    padded into that bucket as the full set of graphs does, and refuses a larger batch with a message."""
    def loop(**kwargs) -> DecodeLoop:
        model = Transformer(SMALL_VOCAB, max_slots=SLOTS, max_len=MAX_LEN, device="cpu", seed=0)
        out = DecodeLoop(model, k=2, min_n=1, max_n=3, step_graphs=True, **kwargs)
        for slot in range(5):
            out.add_request(slot, [1, 2, 3, 1, 2, slot], temperature=0.0)
        return out

    limited, full = loop(max_batch=3), loop()
    assert limited.graphs.sizes == [1, 2, 4] and {size for size, _, _ in limited.graphs._graphs} == {1, 2, 4}
    assert full.graphs.sizes == [1, 2, 4, 6] and loop(max_batch=6).graphs.sizes == [1, 2, 4, 6]
    for slots in ([0, 1, 2], [3], [4, 0]):
        outs = [each.readback(each.step(slots)) for each in (limited, full)]
        np.testing.assert_array_equal(outs[0].packed, outs[1].packed)
    with pytest.raises(ValueError, match="exceeds the step graphs' largest bucket, 4"):
        limited.step([0, 1, 2, 3, 4])
