"""The real level on the CPU (tiny model): the wall-clock engine loop makes the same decisions as hil, so greedy
speculative decoding emits exactly the tokens of plain greedy decoding, and of hil, in every mode."""

import dataclasses

import numpy as np
import pytest
from helpers import emitted
from test_hil import MODES, N_REQUESTS, hil_scenario, model, plain_greedy, requests, run_hil  # noqa: F401

import simharness
from simharness.engine.torch_backend import TorchBackend
from simharness.ledger import HostLedger
from simharness.modes import resolve_mode
from simharness.realloop import RealLoop
from simharness.records import COUNT_COLUMNS, DEVICE_PHASE_COLUMNS
from simharness.scenario import load_scenario
from simharness.simulation import Simulation


def run_real(sc, requests, model):  # noqa: F811
    mode = resolve_mode(sc)
    backend = TorchBackend(sc, requests, model, mode, gate=False)
    with backend.syncs:
        records, duration = RealLoop(sc, requests, mode, backend).run()
    return backend, records, duration


@pytest.mark.parametrize(("depth", "policy", "proposer", "invalid"), MODES)
def test_real_emits_the_tokens_of_plain_greedy_and_of_hil(depth, policy, proposer, invalid, requests, model,  # noqa: F811
                                                           plain_greedy):  # noqa: F811
    sc = hil_scenario(depth, policy, proposer, invalid).model_copy(deep=True)
    sc.engine.level = "real"
    backend, records, _ = run_real(sc, requests, model)
    hil, hil_records = run_hil(hil_scenario(depth, policy, proposer, invalid), requests, model)
    for rid, expected in enumerate(plain_greedy):
        np.testing.assert_array_equal(emitted(backend, rid), expected, err_msg=f"request {rid}")
    steps = records.steps_frame()
    assert steps["emitted"].sum() == requests.output_len.sum()
    assert steps["accepted"].sum() > 0
    # per request the same drafts verified and accepted as hil (when requests arrive may differ with timing)
    columns = ["output_tokens", "draft_tokens", "accepted_tokens"]
    np.testing.assert_array_equal(records.requests[columns].to_numpy(), hil_records.requests[columns].to_numpy())


def test_real_makes_the_decisions_of_hil_step_by_step(requests, model):  # noqa: F811
    """With every request sent at once, nothing depends on timing: the same batches, outcomes and syncs, step by
    step (the engine core is one piece of code)."""
    n = model.max_slots  # as many requests as the closed loop's users
    first = dataclasses.replace(requests, kind=requests.kind[:n], prompt_len=requests.prompt_len[:n],
                                output_len=requests.output_len[:n], prompt_tokens=requests.prompt_tokens[:n],
                                output_tokens=requests.output_tokens[:n])  # fmt: skip
    for depth, policy in [(1, "wait"), (3, "optimistic"), (2, "wait")]:
        hil_sc = hil_scenario(depth, policy, "ngram_gpu", "trim")
        sc = hil_sc.model_copy(deep=True)
        sc.engine.level = "real"
        _, records, _ = run_real(sc, first, model)
        _, hil_records = run_hil(hil_sc, first, model)
        counts = COUNT_COLUMNS
        steps, hil_steps = records.steps_frame(), hil_records.steps_frame()
        np.testing.assert_array_equal(steps[counts].to_numpy(), hil_steps[counts].to_numpy())
        assert records.syncs_frame()["name"].tolist() == hil_records.syncs_frame()["name"].tolist()


def test_real_timeline_is_wall_clock_and_ordered(requests, model):  # noqa: F811
    sc = hil_scenario(2, "wait", "ngram_gpu", "trim").model_copy(deep=True)
    sc.engine.level = "real"
    _, records, duration = run_real(sc, requests, model)
    steps = records.steps_frame()
    order = ["schedule_start", "schedule_end", "prep_start", "prep_end", "launch_end"]
    for a, b in zip(order, order[1:], strict=False):
        assert (steps[b] >= steps[a]).all(), (a, b)
    # on the CPU the device work runs inside the launch: the device window lies in the host's launch
    assert (steps["gpu_start"] >= steps["prep_end"]).all() and (steps["gpu_end"] <= steps["launch_end"]).all()
    assert (steps["update_start"] >= steps["gpu_end"]).all()
    assert (steps[DEVICE_PHASE_COLUMNS].sum(axis=1) <= (steps["gpu_end"] - steps["gpu_start"]) * (1 + 1e-9)).all()
    # the modelled host work is really spun, less the loop's own time it absorbs (which `harness_s` holds)
    cost = sc.engine.host_costs
    modelled = (cost.schedule_us + cost.update_us + (cost.schedule_per_req_us + cost.update_per_req_us)
                * steps["n_reqs"]).sum() * 1e-6
    spun = (steps["schedule_end"] - steps["schedule_start"] + steps["update_end"] - steps["update_start"]).sum()
    assert modelled > 0 and spun + steps["harness_s"].sum() >= modelled
    assert duration == pytest.approx(records.requests["last_token_s"].max())
    syncs = records.syncs_frame()
    assert set(syncs["name"]) == {"output_readback", "accepted_counts", "valid_draft_counts"}


def test_cuda_launch_at_real_records_one_event_a_step_with_prefills(requests, model, plain_greedy, monkeypatch):  # noqa: F811
    """The real level's CUDA launch, run on the CPU with the timing events faked: each event recorded costs the host
    12-38 µs that the real loop's timeline carries, so a step with prefills records one, its first chunk's start,
    and the decode step's own events (faked here) end its chunks and its window; a step of prefills only records its
    end too. The prefill phase is the first chunk's start to the decode step's start, and the tokens are right."""
    from simharness.engine import timing as timing_module
    from simharness.engine import torch_backend

    clock, records_made = [0.0], []

    class Event:
        def __init__(self, enable_timing: bool = True):
            self.ms = None

        def record(self):
            clock[0] += 2.0  # each event 2 ms after the previous one
            self.ms = clock[0]
            records_made.append(self)

        def elapsed_time(self, end) -> float:
            return end.ms - self.ms

        def synchronize(self):
            pass

    class Clock:  # the device clock, on the fake events' milliseconds
        def wait(self, mark):
            return None

        def seconds_of(self, marks):
            return tuple(m.ms / 1e3 for m in marks)

    empty = torch_backend.torch.empty
    monkeypatch.setattr(torch_backend.torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    monkeypatch.setattr(timing_module.torch.cuda, "Event", Event)
    sc = hil_scenario(2, "optimistic", "ngram_gpu", "trim", budget=32).model_copy(deep=True)
    sc.engine.level = "real"
    mode = resolve_mode(sc)
    backend = TorchBackend(sc, requests, model, mode, gate=False)
    backend.cuda, backend.timing = True, timing_module.PartTiming(gate=False)
    backend.clock, backend.start_clock = Clock(), lambda: None
    spans = {}  # the decode loop's events around each step (CUDA only, so faked: 2 ms, then 2 ms more)
    step_ = backend.loop.step

    def step(*a, **k):
        result = step_(*a, **k)
        spans[result.step_id] = [Event(), Event()]
        for event in spans[result.step_id]:
            clock[0] += 2.0
            event.ms = clock[0]
        return result

    backend.loop.step = step
    backend.loop.span_marks = lambda result: spans[result.step_id]
    backend.loop.done_mark = lambda result: spans[result.step_id][-1]
    records, _ = RealLoop(sc, requests, mode, backend).run()
    for rid, expected in enumerate(plain_greedy):
        np.testing.assert_array_equal(emitted(backend, rid), expected, err_msg=f"request {rid}")
    steps = records.steps_frame()
    with_prefill = steps["n_prefill_reqs"] > 0
    prefills_only = with_prefill & (steps["decode_tokens"] == 0)
    assert (steps["n_prefill_reqs"] > 1).any() and prefills_only.any() and (with_prefill & ~prefills_only).any()
    assert len(records_made) == with_prefill.sum() + prefills_only.sum()
    # each step with prefills: its start event, then (2 ms on) the decode step's start or the launch's end
    np.testing.assert_allclose(steps.loc[with_prefill, "gpu_prefill_s"], 2e-3)
    np.testing.assert_allclose(steps.loc[~with_prefill, "gpu_prefill_s"], 0.0)
    window = steps["gpu_end"] - steps["gpu_start"]
    np.testing.assert_allclose(window[with_prefill & ~prefills_only], 4e-3)  # its start to the decode step's end
    np.testing.assert_allclose(window[prefills_only], 2e-3)
    np.testing.assert_allclose(window[~with_prefill], 2e-3)


def test_open_loop_arrivals_are_honoured_in_wall_clock_time(requests, model):  # noqa: F811
    sc = hil_scenario(2, "optimistic", "ngram_gpu", "fill").model_copy(deep=True)
    sc.engine.level = "real"
    sc.workload.arrival, sc.workload.cap_concurrency = "poisson", True  # as many in flight as the model has slots
    arrivals = np.array([0.0, 0.02, 0.04, 0.6, 0.62])[:N_REQUESTS]
    timed = dataclasses.replace(requests, arrival_s=arrivals)
    _, records, duration = run_real(sc, timed, model)
    got = records.requests["arrival_s"].to_numpy()
    # three slots: the first three enter at their arrival; a later one at its arrival if a slot is free then, else
    # when one frees (vLLM's bench leaves the wait for --max-concurrency out of the request), however loaded the
    # machine running this test is
    np.testing.assert_array_equal(got[:3], arrivals[:3])
    done = np.sort(records.requests["last_token_s"].to_numpy())
    for i in range(3, N_REQUESTS):
        assert got[i] == arrivals[i] or (got[i] > arrivals[i] and np.isclose(done, got[i], rtol=0, atol=1e-3).any())
    assert (records.requests["first_token_s"].to_numpy() > got).all() and duration > 0.62


def test_a_capped_open_loop_takes_in_freed_slots_as_hil_does(requests, model):  # noqa: F811
    """Every request arrives at once into fewer slots than requests: at both levels a slot freed by a completion
    takes its next request after the engine's next scheduling decision, so the batches match step by step (the
    real loop used to admit it before that decision, one step earlier than hil)."""
    hil_sc = hil_scenario(2, "optimistic", "ngram_gpu", "fill").model_copy(deep=True)
    hil_sc.workload.arrival, hil_sc.workload.cap_concurrency, hil_sc.workload.concurrency = "poisson", True, 2
    sc = hil_sc.model_copy(deep=True)
    sc.engine.level = "real"
    at_once = dataclasses.replace(requests, arrival_s=np.zeros(N_REQUESTS))
    _, records, _ = run_real(sc, at_once, model)
    _, hil_records = run_hil(hil_sc, at_once, model)
    counts = COUNT_COLUMNS
    steps, hil_steps = records.steps_frame(), hil_records.steps_frame()
    np.testing.assert_array_equal(steps[counts].to_numpy(), hil_steps[counts].to_numpy())
    assert (records.requests["arrival_s"].to_numpy()[2:] > 0).all()  # the later three waited for a slot


def test_real_level_through_the_public_api(tmp_path, monkeypatch):
    """The CI variant of the hil scenario at the real level: the same tables as the other levels, its warm-up and
    its run on the wall clock (`pointwork.run_on_clock` picks it), a sim point's on the virtual clock."""
    clocks = []
    for clock in (RealLoop, Simulation):
        monkeypatch.setattr(clock, "run", lambda self, run=clock.run: clocks.append(type(self).__name__) or run(self))
    overrides = {"sweep": {}, "workload.num_requests": 3, "workload.output_len": {"dist": "fixed", "value": 8}}
    real = simharness.run(load_scenario("scenarios/hil-cpu.yaml", {**overrides, "engine.level": "real"}), tmp_path)
    assert clocks == ["RealLoop", "RealLoop"]
    sim = simharness.run(load_scenario("scenarios/hil-cpu.yaml", {**overrides, "engine.level": "sim"}), tmp_path)
    assert clocks[2:] == ["Simulation"]
    assert list(real.summary["level"]) == ["real"]
    for name in ("summary", "requests", "steps", "syncs", "emissions", "device_syncs"):
        assert list(getattr(real, name).columns) == list(getattr(sim, name).columns), name
    assert real.steps["gpu_verify_s"].notna().all()


class _Ledger(HostLedger):
    """A ledger that also lists each engine time counted (the modelled work `RealLoop.work` spins)."""

    def __init__(self):
        super().__init__()
        self.spun: list[float] = []

    def engine(self, seconds: float) -> None:
        super().engine(seconds)
        self.spun.append(seconds)


def test_modelled_host_work_absorbs_the_loops_own_time():
    """The loop's own host time since the last modelled work is charged against the next modelled work: it spins
    only the rest, and what it cannot absorb is owed by the work after it; engine time in between (the backend's
    phases) is not the loop's and absorbs nothing, and neither does the loop's time before a wait on which the host
    blocked (it ran while the device worked), nor what was owed then."""
    import time

    loop = RealLoop.__new__(RealLoop)
    loop.t0, ledger = time.perf_counter(), _Ledger()
    loop.ledger, spun = ledger, ledger.spun

    def own(seconds: float) -> None:  # the loop's own work began `seconds` ago (nothing owed before it)
        ledger.charge_mark, ledger.owed_s = (time.perf_counter() - seconds, ledger.engine_s), 0.0

    own(0.2)  # the loop's own work began 200 ms ago ...
    ledger.engine(0.15)  # ... and 150 ms of it were the engine's: 50 ms are the loop's own
    spun.clear()
    loop.work(0.0, 0.1)
    assert 0.03 < spun[0] <= 0.05 + 1e-9
    own(0.25)  # 250 ms of the loop's own against 100 ms modelled: none spun, 150 ms owed by the next work ...
    loop.work(0.0, 0.1)
    assert spun[1] == 0.0
    before = ledger.charge_mark
    loop.work(0.0, 0.0)  # (no modelled work: nothing spun, nothing charged)
    assert len(spun) == 2 and ledger.charge_mark == before
    loop.work(0.0, 0.1)  # ... which absorbs 100 ms of it, and the next the last 50 ms and the loop's time since
    loop.work(0.0, 0.2)
    assert spun[2] == 0.0 and 0.12 < spun[3] <= 0.15 + 1e-9
    own(0.05)  # 50 ms of the loop's own time ...
    loop.pause(0.02)  # ... which a modelled GC pause does not absorb: it is spun whole, as the engine's time
    loop.work(0.0, 0.1)  # the next modelled work still absorbs the 50 ms (the pause was engine time, not the loop's)
    assert spun[4] == 0.02 and 0.03 < spun[5] <= 0.05 + 1e-9
    # 80 ms of the loop's own time (with 300 ms owed), then a wait of 30 ms that blocked (engine time), then 10 ms
    # more of its own: only those 10 ms are charged
    own(0.12)
    ledger.owed_s = 0.3
    wait_began = (time.perf_counter() - 0.04, ledger.engine_s)
    ledger.engine(0.03)
    ledger.blocked(wait_began)
    loop.work(0.0, 0.1)
    assert 0.08 < spun[7] <= 0.09 + 1e-9


def test_device_clock_anchors_follow_a_drifting_timer():
    """The device's timer runs 30 us a second slow against the host's clock and the host wakes 2-40 us after the
    device passes a mark: anchored on its recent waits, the clock stays within a few microseconds of the truth for
    ten seconds, where the first anchor alone would be 300 us off at the end."""
    from simharness.engine.timing import Anchors

    rng = np.random.default_rng(0)
    drift = 30e-6  # host seconds gained per device second
    device = np.cumsum(rng.uniform(1.5e-3, 2.5e-3, 5000))  # a device step's end, every ~2 ms
    truth = device * (1 + drift)  # when the device passed each end, on the host's clock
    wake = 2e-6 + rng.exponential(8e-6, len(device)).clip(max=38e-6)
    anchors = Anchors(0.0, 0.0)
    errors = []
    for d, t, w in zip(device, truth, wake, strict=True):
        anchors.add(d, t + w)
        errors.append(d + anchors.offset() - t)
    errors = np.abs(errors)
    assert errors[-1000:].max() < 6e-6 and np.median(errors) < 4e-6
    assert truth[-1] - device[-1] > 250e-6  # what one anchor at the start would miss


def test_device_clock_anchors_on_waits_the_host_blocked_on(monkeypatch):
    """Only a wait the host blocked on anchors the clock (a mark the device had passed already says nothing of
    when), and a mark's time is the device's timer plus the tightest recent offset."""
    from simharness.engine import timing as timing_module

    class Event:
        elapsed = {}

        def __init__(self, enable_timing: bool = False):
            self.done = False

        def record(self):
            pass

        def synchronize(self):
            self.done = True

        def query(self):
            return self.done

        def elapsed_time(self, other):
            return Event.elapsed[id(other)]

    monkeypatch.setattr(timing_module.torch.cuda, "Event", Event)
    monkeypatch.setattr(timing_module.torch.cuda, "synchronize", lambda: None)
    clock = timing_module.DeviceClock(cuda=True)
    ref = clock.reference_s
    host = iter([ref + 0.010 + 40e-6, ref + 0.020 - 30e-6, ref + 0.100 - 20e-6])
    monkeypatch.setattr(timing_module.time, "perf_counter", lambda: next(host))
    late, passed, ahead, later = clock.mark(), clock.mark(), clock.mark(), clock.mark()
    Event.elapsed.update({id(late): 10.0, id(passed): 15.0, id(ahead): 20.0, id(later): 100.0})  # ms after the ref
    passed.done = True
    # blocked: woke 40 us after the device passed it (by its timer), 40 us later than the reference's wake-up
    assert clock.wait(late) == pytest.approx(40e-6, abs=1e-9)
    assert clock.wait(passed) is None  # the device had passed it: no anchor (and no host time read)
    assert clock.anchors.offset() == 0.0  # the reference's own wake-up is the tighter
    # the host woke 30 us before the timer says the device passed: the timer runs ahead; the tightest wake-up yet
    assert clock.wait(ahead) == 0.0
    assert clock.seconds(passed) == pytest.approx(ref + 0.015 - 30e-6, abs=1e-12)
    assert clock.wait(later) == 0.0  # 80 ms on: the older anchors are out of the window, it is the only one
    assert clock.seconds(later) == pytest.approx(ref + 0.100 - 20e-6, abs=1e-12)
    # several marks at once: each as `seconds` gives it
    assert clock.seconds_of([passed, later]) == (clock.seconds(passed), clock.seconds(later))
