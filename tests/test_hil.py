"""Hardware in the loop on the CPU: the SimPy scheduler drives the real decode loop (tiny model).

The invariant: greedy speculative decoding under any scheduling mode emits exactly the tokens of plain
greedy decoding, which holds only if positions, drafts, placeholders, corrections and finished-in-flight
requests are all handled right on the real device state."""

import dataclasses
import itertools

import numpy as np
import pytest
import torch
from helpers import emitted, hil_requests, single_thread

from simharness.engine.decode import DecodeLoop
from simharness.engine.mirror import HOST_COMMITTED, HOST_OUTPUT_LEN, HOST_PROMPT_LEN, HOST_VALID, read_back
from simharness.engine.model import Transformer, get_config
from simharness.engine.torch_backend import TorchBackend, capacity
from simharness.modes import resolve_mode
from simharness.policy import (
    ACCEPTED,
    BATCH_ROWS,
    COMPLETES,
    DRAFTS_VALID,
    EMITTED,
    PREFILL,
    REQ,
    VERIFIED,
    WASTED,
)
from simharness.records import DEVICE_PHASE_COLUMNS, STEP_COLUMNS
from simharness.scenario import scenario_from_dict
from simharness.simulation import Simulation
from simharness.workload import Requests

VOCAB = 512
N_REQUESTS = 5
GPU_WAIT_S = 0.02  # how long a faked CUDA wait lasts


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    yield from single_thread()


def hil_scenario(depth=1, policy="optimistic", proposer="ngram_gpu", invalid="trim", budget=48, **engine):
    return scenario_from_dict({
        "name": "hil-test",
        "workload": {"arrival": "closed", "concurrency": 3, "num_requests": N_REQUESTS},
        "engine": {"level": "hil", "device": "cpu", "model": "tiny",
                   "speculation": {"proposer": proposer, "k": 3, "invalid_slots": invalid}, **engine},
        "scheduler": {"depth": depth, "policy": policy, "max_num_batched_tokens": budget},
    })


@pytest.fixture(scope="module")
def requests() -> Requests:
    return hil_requests(N_REQUESTS, VOCAB)


@pytest.fixture(scope="module")
def model(requests: Requests) -> Transformer:
    deepest = hil_scenario(depth=3)
    slots, positions = capacity(deepest, requests, resolve_mode(deepest))
    config = dataclasses.replace(get_config("tiny"), vocab_size=VOCAB)
    return Transformer(config, max_slots=slots, max_len=positions, device="cpu", seed=3)


@pytest.fixture(scope="module")
def plain_greedy(model: Transformer, requests: Requests) -> list[np.ndarray]:
    """Each request decoded alone, one token per step (k = 0), steered the same way."""
    loop = DecodeLoop(model, k=0, min_n=1, max_n=1)
    slot = torch.tensor([0])
    outputs = []
    for prompt, reference, n in zip(requests.prompt_tokens, requests.output_tokens, requests.output_len, strict=True):
        tokens = [int(loop.add_request(0, prompt, reference)[0])]
        while len(tokens) < n:
            tokens.append(int(loop.readback(loop.step(slot)).tokens[0, 0]))
        outputs.append(np.array(tokens))
    return outputs


def run_hil(sc, requests, model):
    mode = resolve_mode(sc)
    backend = TorchBackend(sc, requests, model, mode, gate=True)
    sim = Simulation(sc, requests, mode, backend)
    with backend.syncs:
        records, _ = sim.run()
    return backend, records


MODES = list(itertools.product([1, 2, 3], ["wait", "optimistic"], ["ngram_cpu", "ngram_gpu"], ["trim", "fill"]))


@pytest.mark.parametrize(("depth", "policy", "proposer", "invalid"), MODES)
def test_greedy_equals_plain_greedy_in_every_mode(depth, policy, proposer, invalid, requests, model, plain_greedy):
    sc = hil_scenario(depth, policy, proposer, invalid)
    backend, records = run_hil(sc, requests, model)
    for rid, expected in enumerate(plain_greedy):
        np.testing.assert_array_equal(emitted(backend, rid), expected, err_msg=f"request {rid}")
    steps = records.steps_frame()
    assert steps["emitted"].sum() == requests.output_len.sum()
    assert steps["prefill_tokens"].sum() == requests.prompt_len.sum()
    assert steps["accepted"].sum() > 0  # the proposer's drafts were really verified and accepted


def test_async_exercises_chunks_and_finished_requests_in_flight(requests, model):
    """The cases the equivalence test must cover: prompts split over steps, wasted slots of requests that
    finished while a later step was in flight, and slot reuse (5 requests through 3 slots)."""
    sc = hil_scenario(3, "optimistic", "ngram_gpu", "fill", budget=32)
    _, records = run_hil(sc, requests, model)
    steps = records.steps_frame()
    assert (steps["n_prefill_reqs"] > 0).sum() > N_REQUESTS  # some prompt took more than one step
    assert steps["wasted_slots"].sum() > 0


def test_read_back_by_hand():
    """The host's bookkeeping of a read-back step, into its batch table: request 2 accepts 2 of its 3 valid
    drafts; request 0 has 1 token left (its extra emitted token is not output); request 1 finished in an earlier
    step and sat in this one (it wastes 1 + 4 slots); request 3's last prompt chunk emits its first token (the
    device reports decoding rows only). Every decoding row's tokens land in the mirror at its committed length."""
    table = np.zeros((BATCH_ROWS, 4), dtype=np.int64)
    table[REQ] = [2, 0, 1, 3]
    table[PREFILL] = [0, 0, 0, 1]
    table[COMPLETES] = [0, 0, 0, 1]
    table[VERIFIED] = [4, 4, 4, 0]
    num_emitted = np.array([3, 2, 1])
    tokens = np.array([[7, 8, 9, -1, -1], [5, 6, -1, -1, -1], [4, -1, -1, -1, -1]])
    num_drafts = np.array([3, 4, 0])
    new_valid = np.array([1, 2, 3])
    packed = np.column_stack([tokens, num_emitted, num_drafts, new_valid])  # as DecodeLoop.readback packs them
    mirror = np.zeros((4, 4), dtype=np.int64)
    mirror[HOST_COMMITTED] = [9, 10, 3, 0]  # per request id
    mirror[HOST_OUTPUT_LEN] = [10, 10, 10, 10]
    mirror[HOST_PROMPT_LEN] = [1, 3, 2, 8]
    history = np.zeros((4, 16), dtype=np.int64)
    read_back(table, packed, 4, False, mirror, history)
    np.testing.assert_array_equal(table[EMITTED], [3, 1, 0, 1])
    np.testing.assert_array_equal(table[ACCEPTED], [2, 1, 0, 0])
    np.testing.assert_array_equal(table[DRAFTS_VALID], [3, 4, 0, 0])
    np.testing.assert_array_equal(table[WASTED], [0, 0, 5, 0])
    np.testing.assert_array_equal(mirror[HOST_COMMITTED], [11, 11, 6, 0])
    np.testing.assert_array_equal(mirror[HOST_VALID], [0, 0, 1, 0])  # requests 0 and 1 have no tokens left
    np.testing.assert_array_equal(history[2, 5:9], [7, 8, 9, 0])  # prompt 2 + committed 3 onwards
    np.testing.assert_array_equal(history[0, 10:13], [5, 6, 0])
    np.testing.assert_array_equal(history[1, 13:15], [4, 0])
    assert history.sum() == 7 + 8 + 9 + 5 + 6 + 4  # nothing else written
    # with fill, the valid drafts verified are those the host mirrored before this step
    table[EMITTED:] = 0
    mirror[HOST_COMMITTED] = [9, 10, 3, 0]
    mirror[HOST_VALID] = [2, 3, 1, 0]
    read_back(table, packed, 4, True, mirror, history)
    np.testing.assert_array_equal(table[DRAFTS_VALID], [1, 2, 0, 0])


def test_steps_record_measured_phases(requests, model):
    sc = hil_scenario(2, "wait", "ngram_gpu", "trim")
    _, records = run_hil(sc, requests, model)
    steps = records.steps_frame()
    assert list(steps.columns[: len(STEP_COLUMNS)]) == STEP_COLUMNS
    assert (steps["measured"] == "prep,launch,gpu,readback").all()
    device = steps[DEVICE_PHASE_COLUMNS]
    assert (device >= 0).all().all()
    np.testing.assert_allclose(device.sum(axis=1), steps["gpu_end"] - steps["gpu_start"], rtol=1e-9, atol=1e-12)
    decode = steps["decode_tokens"] > 0
    assert (steps.loc[decode, "gpu_verify_s"] > 0).all()
    assert (steps.loc[steps["n_prefill_reqs"] > 0, "gpu_prefill_s"] > 0).all()
    assert (steps["harness_s"] >= 0).all()
    assert (steps["device_syncs"] == 0).all()  # no CUDA here: nothing to catch


def test_cpu_proposer_phase_is_measured(requests, model):
    sc = hil_scenario(1, "wait", "ngram_cpu", "trim")
    _, records = run_hil(sc, requests, model)
    steps = records.steps_frame()
    assert (steps["measured"] == "prep,launch,gpu,readback,propose").all()
    assert (steps["propose_end"] > steps["propose_start"]).any()


def test_hil_and_sim_runs_have_the_same_columns_and_a_valid_trace(tmp_path):
    """The CI variant of the hil scenario, cut to one small point, run at both levels through the public API."""
    import json

    from trace_check import check_trace

    import simharness
    from simharness.scenario import load_scenario

    overrides = {"sweep": {}, "workload.num_requests": 3, "workload.output_len": {"dist": "fixed", "value": 8}}
    hil = simharness.run(load_scenario("scenarios/hil-cpu.yaml", overrides), tmp_path / "hil")
    sim = simharness.run(load_scenario("scenarios/hil-cpu.yaml", {**overrides, "engine.level": "sim"}), tmp_path)
    assert list(hil.summary["level"]) == ["hil"] and list(sim.summary["level"]) == ["sim"]
    for name in ("summary", "requests", "steps", "syncs", "emissions", "device_syncs"):
        assert list(getattr(hil, name).columns) == list(getattr(sim, name).columns), name
    assert hil.steps["gpu_verify_s"].notna().all() and sim.steps["gpu_verify_s"].isna().all()
    (trace,) = (hil.run_dir / "traces").glob("*.json")
    events = json.loads(trace.read_text())
    assert check_trace(events) == []
    assert any(e.get("ph") == "M" and e["args"].get("name") == "hil: measured phases" for e in events["traceEvents"])
    report = hil.report.read_text()
    assert "## Device sync sites" in report and "## Measured vs modelled" in report


def test_part_timing_gates_each_part_until_enqueued(monkeypatch):
    """The gate in front of a part of a launch (CUDA only, so faked here): closed before the part's start event,
    opened once the part is enqueued; from the third part of a launch on, the host first waits for the end of the
    part two back, so that it cannot fill the stream's launch queue. An enqueue too long for the gate's polls
    marks the launch starved. Without a gate (the real level) only the first part's start and the launch's end are
    recorded."""
    from simharness.engine import timing as timing_module

    calls = []

    class Event:
        def __init__(self, enable_timing: bool = False, name: str = "new"):
            self.name = name

        def record(self):
            calls.append("record")

        def synchronize(self):
            calls.append(f"wait {self.name}")

    class Gate:
        def close(self):
            calls.append("close")

        def open(self):
            calls.append("open")

    monkeypatch.setattr(timing_module.torch.cuda, "Event", Event)
    monkeypatch.setattr(timing_module, "Gate", Gate)
    timing = timing_module.PartTiming(gate=True)
    events = []
    timing.before(events)
    timing.after(1e-3)
    assert calls == ["close", "record", "open"] and len(events) == 1 and not timing.starved
    timing.after(timing_module.STARVED_S * 2)  # a host blocked longer than the gate polls
    assert timing.starved
    calls.clear()
    events = [Event(name=f"{kind}{i}") for i in range(2) for kind in ("start", "end")]  # two chunks launched
    timing.before(events)
    assert calls == ["wait end0", "close", "record"] and len(events) == 5
    assert timing.host_s > 0
    timing.start_launch()
    assert timing.host_s == 0 and not timing.starved
    calls.clear()
    # the real level marks only the launch's first part's start, and its end (no part ends: its window is timed)
    plain = timing_module.PartTiming(gate=False)
    events = []
    plain.before(events)
    plain.after(10.0)
    plain.part_end(events)
    plain.before(events)
    plain.part_end(events)
    assert calls == ["record"] and len(events) == 1 and not plain.starved
    plain.mark(events)
    assert calls == ["record", "record"] and len(events) == 2


def test_cuda_launch_gates_each_prefill_chunk_and_the_decode_step(requests, model, plain_greedy, monkeypatch):
    """The CUDA path of launch and readback, run on the CPU with the spin kernel and the timing events faked:
    every prefill chunk gets its own gate and a start and end event, the decode step one gate and no event of
    the backend's, a step of prefills only one last event that the readback waits for; the prefill phase is the
    sum of its chunks' event intervals, the gates count as harness time, and the tokens are still right."""
    import time

    from simharness.engine import timing as timing_module
    from simharness.engine import torch_backend

    calls = []
    clock = [0.0]

    class Event:
        def __init__(self, enable_timing: bool):
            self.ms = None

        def record(self):
            clock[0] += 2.0  # each recorded event is 2 ms after the previous one
            self.ms = clock[0]
            calls.append("record")

        def elapsed_time(self, end) -> float:
            return end.ms - self.ms

        def synchronize(self):
            if self is waited_for[0]:  # the GPU's time, which must stay out of the measured readback
                time.sleep(GPU_WAIT_S)
            calls.append("wait")

    class Gate:
        def close(self) -> None:
            time.sleep(2e-3)  # host time the gate costs, which must land in harness_s
            calls.append("gate")

        def open(self) -> None:
            calls.append("open")

    empty = torch.empty
    monkeypatch.setattr(torch_backend.torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    monkeypatch.setattr(torch_backend.torch.cuda, "Event", Event)
    monkeypatch.setattr(timing_module, "Gate", Gate)
    sc = hil_scenario(2, "optimistic", "ngram_gpu", "trim", budget=32)
    mode = resolve_mode(sc)
    backend = TorchBackend(sc, requests, model, mode, gate=True)
    backend.cuda, backend.timing = True, timing_module.PartTiming(gate=True)
    waited_for = [None]  # the event a step with prefills is waited for at its readback (its last)
    launch_ = backend.launch

    def launch(step):
        dt = launch_(step)
        events = backend.launches[step.step].events
        waited_for[0] = events[-1] if events else None
        return dt

    class Clock:  # the device clock's wait, without its wake-up (tested with the clock)
        def wait(self, mark) -> float:
            mark.synchronize()
            return 0.0

    class StepEnd:  # a decode-only step waits for its decode loop's last event (CPU here: it ran when launched)
        def synchronize(self):
            time.sleep(GPU_WAIT_S)
            calls.append("wait")

    backend.launch, backend.clock = launch, Clock()
    backend.loop.done_mark = lambda result: StepEnd()
    sim = Simulation(sc, requests, mode, backend)
    records, _ = sim.run()
    for rid, expected in enumerate(plain_greedy):
        np.testing.assert_array_equal(emitted(backend, rid), expected, err_msg=f"request {rid}")
    steps = records.steps_frame()
    chunks, decodes = int(steps["n_prefill_reqs"].sum()), int((steps["decode_tokens"] > 0).sum())
    with_prefill = int((steps["n_prefill_reqs"] > 0).sum())
    assert chunks > N_REQUESTS  # some prompt took more than one chunk
    assert calls.count("gate") == calls.count("open") == chunks + decodes
    prefills_only = int(((steps["n_prefill_reqs"] > 0) & (steps["decode_tokens"] == 0)).sum())
    assert 0 < prefills_only < with_prefill  # a step with prefills and decodes waits for its decode step's end
    assert calls.count("record") == 2 * chunks + prefills_only
    # every step is waited for at its readback, and from its third prefill chunk on each chunk waits for the end
    # of the chunk two back
    assert calls.count("wait") == len(steps) + int((steps["n_prefill_reqs"] - 2).clip(lower=0).sum())
    # the readback (after the host reached it and the GPU finished the step) leaves out the GPU's waits (half of
    # one is margin for a loaded runner)
    syncs = records.syncs_frame()
    readback = syncs[syncs["name"] == "output_readback"].merge(steps, on="step")
    assert (readback["end_s"] - np.maximum(readback["start_s"], readback["gpu_end"]) < GPU_WAIT_S / 2).all()
    assert (steps["n_prefill_reqs"] > 2).any()
    np.testing.assert_allclose(steps["gpu_prefill_s"], 2e-3 * steps["n_prefill_reqs"])
    assert steps["harness_s"].sum() >= 2e-3 * (chunks + decodes)


def test_prefill_shape_warm_up_runs_a_one_layer_twin_once_per_length(monkeypatch):
    """Every length up to the longest, fresh and after a prefix, through a one-layer twin; a process warms each
    length of a model shape once (kernels stay loaded), so a later, longer call warms only the new lengths."""
    from simharness import measured

    built, calls = [], []

    class Twin:
        def __init__(self, config, **kwargs):
            built.append((config.n_layers, kwargs["max_len"]))

        def prefill(self, slot, tokens, start=0):
            calls.append((tokens.shape[0], start))

    config = get_config("llama-3.2-1b", n_layers=4)
    model = type("Model", (), {"device": torch.device("cuda"), "config": config, "max_slots": 3, "max_len": 64,
                               "ops": object(), "cuda_graphs": False})()  # fmt: skip
    monkeypatch.setattr(measured, "Transformer", Twin)
    monkeypatch.setattr(measured, "_warmed_lengths", {})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch, "zeros", lambda n, **kw: torch.empty(n, dtype=torch.int64))
    measured.warm_prefill_shapes(model, 5)
    assert built == [(1, 64)] and calls == [(n, s) for n in range(1, 6) for s in (0, 1)]
    measured.warm_prefill_shapes(model, 5)
    measured.warm_prefill_shapes(model, 3)
    assert len(built) == 1 and len(calls) == 10
    measured.warm_prefill_shapes(model, 7)
    assert calls[10:] == [(6, 0), (6, 1), (7, 0), (7, 1)]


def test_prefill_warm_up_with_cuda_graphs_captures_the_prefill_graphs_instead(monkeypatch):
    from simharness import measured

    captured = []
    model = type("Model", (), {"device": torch.device("cuda"), "cuda_graphs": True,
                               "capture_prefill_graphs": lambda self, n: captured.append(n)})()  # fmt: skip
    monkeypatch.setattr(measured, "Transformer", None)  # no twin is built
    measured.warm_prefill_shapes(model, 700)
    assert captured == [700]


def test_prefill_buckets_cover_every_chunk_with_bounded_padding():
    from simharness.engine.buckets import prefill_sizes
    from simharness.engine.model import PREFILL_PAD

    assert prefill_sizes(1) == [16] and prefill_sizes(16) == [16] and prefill_sizes(17) == [16, 32]
    assert prefill_sizes(1024)[-4:] == [832, 896, 960, 1024] and prefill_sizes(1025)[-2:] == [1024, 1280]
    for n in [*range(1, 2100), 8192, 8193]:
        size = next(s for s in prefill_sizes(n) if s >= n)
        assert n <= size <= n + PREFILL_PAD and (size - n < 64 or n > 1024)
        assert prefill_sizes(size) == prefill_sizes(n)  # the bucket of n is the largest captured for n


def test_a_prefill_chunk_starts_on_the_device_when_its_graph_launch_returned():
    """A prefill chunk's part begins on hil's device timeline when its prefill graph's launch returned, after the host
    staged the chunk (the device cannot run the graph before), not when its call began; a chunk run without a graph
    begins with its call."""
    import time
    from types import SimpleNamespace

    from simharness.engine.torch_backend import Launch

    class Loop:
        def __init__(self, graphed: bool):
            self.graphed, self.calls, self.launches = graphed, [], []

        def prefill_chunk(self, slot, ids, start):
            self.calls.append(time.perf_counter())
            time.sleep(0.003)  # staging the chunk's inputs
            self.launches.append(time.perf_counter() if self.graphed else None)
            time.sleep(0.001)

        def prefill_launched(self):
            return self.launches[-1]

    timing = SimpleNamespace(host_s=0.0, before=lambda events: None, after=lambda seconds: None,
                             part_end=lambda events: None)  # fmt: skip
    ids = torch.arange(16)
    for graphed in (True, False):
        loop = Loop(graphed)
        launch = Launch(decode_rids=np.array([], dtype=np.int64), k=2,
                        prefills=[(0, 0, False, ids), (0, 16, False, ids)])
        t0 = time.perf_counter()
        launch.enqueue_prefills(loop, np.array([0]), None, timing, t0)
        assert len(launch.enqueue) == 2
        for (begin, end), call, launched in zip(launch.enqueue, loop.calls, loop.launches, strict=True):
            if graphed:
                assert begin == pytest.approx(launched - t0, abs=1e-9) and end >= begin + 0.0009
            else:
                assert begin <= call - t0 and end >= begin + 0.004


def test_a_graphed_forward_starts_on_the_device_when_its_launch_returned():
    """The decode step's parts are enqueued between the host's marks; with the verify's CUDA graph the forward's
    part begins when the graph's launch returned (the device cannot run a graph before), which delays the step's
    device end where the device would otherwise have started earlier; with the step graphs every part does; on the
    CPU no graph is launched."""
    from types import SimpleNamespace

    from simharness.engine.torch_backend import decode_enqueue
    from simharness.simulation import _overlapped_end

    class Loop:
        launched = None
        graphs = None  # the verify's graph only: the step graphs start every part at the launch

        def host_marks(self, result):
            return [10.0, 10.1, 10.3, 10.4, 10.5, 10.6]  # start, then the end of each of the five parts

        def graph_launched(self, result):
            return self.launched

    loop, device_s = Loop(), (0.05, 1.0, 0.05, 0.05, 0.05)
    eager = decode_enqueue(loop, None, 10.0)
    np.testing.assert_allclose(eager, [(0, 0.1), (0.1, 0.3), (0.3, 0.4), (0.4, 0.5), (0.5, 0.6)])
    loop.launched = 10.25
    graphed = decode_enqueue(loop, None, 10.0)
    np.testing.assert_allclose(graphed, [(0, 0.1), (0.25, 0.3), (0.3, 0.4), (0.4, 0.5), (0.5, 0.6)])
    ends = [_overlapped_end(SimpleNamespace(launch_start=0.0, enqueue=e, parts_s=device_s), 0.0)
            for e in (eager, graphed)]
    assert ends == pytest.approx([0.1 + 1.0 + 0.15, 0.25 + 1.0 + 0.15])  # the forward waits 0.15 for its launch
    loop.graphs, loop.host_marks = object(), lambda result: [10.0] + [10.25] * 5  # one graph for the whole step
    whole = decode_enqueue(loop, None, 10.0)
    np.testing.assert_allclose(whole, [(0.25, 0.25)] * 5)
    end = _overlapped_end(SimpleNamespace(launch_start=0.0, enqueue=whole, parts_s=device_s), 0.0)
    assert end == pytest.approx(0.25 + 1.2)  # nothing of the step runs before its launch returned
    cpu = DecodeLoop(Transformer(get_config("tiny"), max_slots=2, max_len=64, device="cpu"), k=2, min_n=1, max_n=3)
    cpu.add_request(0, [1, 2, 3, 1, 2])
    assert cpu.graph_launched(cpu.step(torch.tensor([0]))) is None
