"""The SimPy model against closed forms and invariants (sim level, constant costs where it helps)."""

from types import SimpleNamespace

import numpy as np
import pytest

from simharness.model_backend import model_backend
from simharness.modes import resolve_mode
from simharness.records import Step
from simharness.scenario import ScenarioError, scenario_from_dict
from simharness.simulation import Simulation

# Host phases in µs, no per-request or per-token terms, no sync cost: phases are constants.
HOST = dict(schedule_us=100.0, schedule_per_req_us=0.0, prep_us=200.0, prep_per_req_us=0.0, prep_per_token_us=0.0,
            launch_us=50.0, update_us=150.0, update_per_req_us=0.0, sync_us=0.0)
# A GPU so fast that the roofline vanishes next to the fixed step overhead.
FAST_GPU = dict(mem_bandwidth_gbs=1e15, bf16_tflops=1e15, step_overhead_us=1000.0, sampler_overhead_us=0.0,
                ngram_gpu_us=0.0, ngram_gpu_per_token_ns=0.0, correction_us=0.0)


def make_requests(n: int, prompt: int, output: int) -> SimpleNamespace:
    return SimpleNamespace(prompt_len=np.full(n, prompt, dtype=np.int64), output_len=np.full(n, output, dtype=np.int64),
                           arrival_s=None, kind=np.array(["free"] * n), random=None)


def scenario(depth=1, k=4, proposer="ngram_gpu", acceptance=None, host=None, gpu=None, **extra):
    data = {
        "name": "t",
        "workload": {"arrival": "closed", "concurrency": extra.pop("concurrency", 1)},
        "engine": {
            "speculation": {"proposer": proposer, "k": k, "invalid_slots": extra.pop("invalid_slots", "fill"),
                            "acceptance": acceptance or {"model": "iid", "alpha": 0.6}},
            "host_costs": host or HOST,
            "gpu_costs": gpu or FAST_GPU,
            "gc": extra.pop("gc", {"probability": 0.0}),
            "profile": "none",  # the closed forms are the roofline's (no committed cost profile)
        },
        "scheduler": {"depth": depth, **extra},
    }
    return scenario_from_dict(data)


def simulate(sc, requests):
    mode = resolve_mode(sc)
    sim = Simulation(sc, requests, mode, model_backend(sc, requests, mode))
    records, duration = sim.run()
    return sim, records, duration


def test_sync_one_request_step_time_is_host_plus_gpu():
    sc = scenario(depth=1, k=0, proposer="none")
    _, rec, _ = simulate(sc, make_requests(1, 64, 20))
    st = rec.steps_frame()
    assert len(st) == 20  # one prefill step emitting the first token, then one token per step
    period = np.diff(st.schedule_start.to_numpy())
    gpu = (st.gpu_end - st.gpu_start).to_numpy()[:-1]
    host = (HOST["schedule_us"] + HOST["prep_us"] + HOST["launch_us"] + HOST["update_us"]) * 1e-6
    np.testing.assert_allclose(period, host + gpu, rtol=0, atol=1e-12)
    assert (st.bubble_s.iloc[1:] > 0).all()  # depth 1 exposes every host phase as GPU idle time


def test_async_depth2_host_below_gpu_steady_state_step_time_is_gpu():
    sc = scenario(depth=2, k=0, proposer="none")
    _, rec, _ = simulate(sc, make_requests(1, 64, 40))
    st = rec.steps_frame().iloc[3:-2]  # steady state
    gpu = (st.gpu_end - st.gpu_start).to_numpy()
    np.testing.assert_allclose(np.diff(st.gpu_start.to_numpy()), gpu[:-1], rtol=0, atol=1e-12)
    assert st.bubble_s.max() < 1e-12


@pytest.mark.parametrize("alpha,k", [(0.3, 2), (0.6, 4), (0.8, 4), (0.9, 6)])
def test_iid_mean_emitted_per_step_matches_closed_form(alpha, k):
    sc = scenario(depth=1, k=k, acceptance={"model": "iid", "alpha": alpha}, concurrency=32)
    _, rec, _ = simulate(sc, make_requests(64, 32, 2000))
    st = rec.steps_frame()
    decodes = (st.n_reqs - st.n_prefill_reqs).sum()
    mean_emitted = (st.accepted.sum() + decodes) / decodes  # before capping at the output length
    expected = (1 - alpha ** (k + 1)) / (1 - alpha)
    assert abs(mean_emitted / expected - 1) < 0.01


def test_closed_loop_littles_law():
    sc = scenario(depth=2, concurrency=8, host={**HOST, "update_per_req_us": 5.0})
    sim, rec, duration = simulate(sc, make_requests(400, 64, 50))
    req = rec.requests
    e2e = (req.last_token_s - req.arrival_s).mean()
    throughput = len(req) / duration
    assert abs(throughput * e2e / 8 - 1) < 0.03


def test_every_mode_emits_exactly_the_requested_tokens_and_async_wastes_slots():
    wasted = {}
    for depth in (1, 2, 3):
        for policy in ("wait", "optimistic"):
            sc = scenario(depth=depth, policy=policy, concurrency=4, invalid_slots="trim")
            reqs = make_requests(24, 48, 33)
            _, rec, _ = simulate(sc, reqs)
            em = rec.emissions_frame()
            per_req = em.groupby("request_id").tokens.sum()
            assert (per_req == 33).all() and len(per_req) == 24
            wasted[depth, policy] = rec.steps_frame().wasted_slots.sum()
    assert wasted[1, "wait"] == 0 and wasted[1, "optimistic"] == 0
    assert wasted[2, "optimistic"] > 0 and wasted[3, "optimistic"] >= wasted[2, "optimistic"]


def test_sync_points_follow_the_mode_and_can_be_edited():
    names = lambda sc: [s.name for s in resolve_mode(sc).syncs]  # noqa: E731
    assert names(scenario(depth=2, policy="wait", invalid_slots="trim")) == ["accepted_counts", "valid_draft_counts"]
    assert names(scenario(depth=2, policy="optimistic", invalid_slots="fill")) == []
    assert names(scenario(depth=1, policy="wait", invalid_slots="trim")) == []
    edited = scenario(depth=2, policy="optimistic", invalid_slots="trim",
                      sync_points={"remove": ["valid_draft_counts"], "add": ["metadata_item"]})
    mode = resolve_mode(edited)
    assert [s.name for s in mode.syncs] == ["metadata_item"]
    assert not mode.trim  # without its readback the host cannot trim: every slot is verified
    with pytest.raises(ScenarioError, match="unknown sync point 'nope'"):
        resolve_mode(scenario(sync_points={"remove": ["nope"]}))


def test_a_sync_before_prep_creates_bubbles_at_depth_2():
    base = dict(depth=2, policy="optimistic", invalid_slots="fill", concurrency=4)
    _, clean, _ = simulate(scenario(**base), make_requests(16, 48, 40))
    _, synced, _ = simulate(scenario(**base, sync_points={"add": ["metadata_item"]}), make_requests(16, 48, 40))
    st_clean, st_sync = clean.steps_frame(), synced.steps_frame()
    assert st_clean.bubble_s.iloc[5:].max() < 1e-12
    assert st_sync.bubble_s.iloc[5:].min() > 0
    assert (st_sync.n_syncs == st_clean.n_syncs + 1).all()
    assert set(synced.syncs_frame().name) == {"metadata_item", "output_readback"}


@pytest.mark.parametrize("phase", ["schedule", "prep", "launch", "update"])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_each_sync_reads_the_steps_up_to_its_target_not_read_yet(phase, depth):
    """A sync starts where the host is (the previous sync's end, or the phase's start) and reads back, in launch
    order, every step in flight up to the one it waits for (oldest_in_flight: the oldest; all_launched: the newest
    launched) that no sync read before: each read starts at the later of the host's time and the step's GPU end
    and costs a readback. A settle's readback costs one unless a sync read the step. Replayed here from the
    records: the host may be computed ahead of the clock, but every recorded wait is what the real loop's reads
    in turn give."""
    cost = 7e-6
    points = [{"name": "a", "phase": phase, "waits_for": "oldest_in_flight"},
              {"name": "b", "phase": phase, "waits_for": "all_launched"}]
    sc = scenario(depth=depth, policy="optimistic", concurrency=4, host=dict(HOST, sync_us=cost * 1e6),
                  sync_points={"add": points})
    _, rec, _ = simulate(sc, make_requests(8, 48, 30))
    steps = rec.steps_frame()
    launch_end, gpu_end = steps.launch_end.to_numpy(), steps.gpu_end.to_numpy()
    read, settled, sync_reads = set(), set(), 0
    # the last steps' syncs may read steps still in flight when the last request ended (never recorded)
    recorded = len(steps) - depth
    for row in rec.syncs_frame().itertuples():
        if row.step >= recorded:
            break
        if row.name == "output_readback":
            charged = 0.0 if row.step in read else cost
            assert row.end_s == max(row.start_s, gpu_end[row.step]) + charged
            read.add(row.step)
            settled.add(row.step)
            continue
        launched = [int(i) for i in np.flatnonzero(launch_end <= row.start_s)]
        in_flight = [i for i in launched if i not in settled]
        if not launched:  # the first step's: nothing to wait for
            assert row.end_s == row.start_s
            continue
        target = in_flight[0] if row.waits_for == "oldest_in_flight" and in_flight else launched[-1]
        t = row.start_s
        for i in in_flight:
            if i not in read:
                t = max(t, gpu_end[i]) + cost
                read.add(i)
                sync_reads += 1
            if i == target:
                break
        assert row.end_s == t
    assert settled == set(range(len(settled))) and len(settled) > recorded - 2 * depth  # in order, nearly all
    assert (sync_reads > 0) == (depth > 1)  # synchronous: every step is settled before the next is scheduled


def test_a_sync_that_reads_two_steps_charges_two_reads_and_their_settles_none():
    """Three steps in flight, a sync waiting for the second: it reads the first and the second in turn (the
    second's read starts at its GPU end, after the first's read); settling them then costs nothing more, the
    third (not read at the sync) pays its own read at its settle."""
    sc = scenario(depth=3, host=dict(HOST, sync_us=10.0, sync_per_req_us=2.0))
    sim = Simulation(sc, make_requests(1, 8, 4), resolve_mode(sc), model_backend(sc, make_requests(1, 8, 4),
                                                                                 resolve_mode(sc)))
    steps = [Step(i, None, gpu_end=end, readback_s=sim.loop.cost.readback(n))
             for i, (end, n) in enumerate([(1.0, 3), (1.00002, 5), (2.0, 1)])]
    sim.core.in_flight.extend(steps)
    assert steps[0].readback_s == pytest.approx(16e-6) and steps[1].readback_s == pytest.approx(20e-6)
    end = sim.synced(0.5, steps[1], None)
    assert end == max(1.0 + 16e-6, 1.00002) + 20e-6
    assert [s.read_back for s in steps] == [1.0 + 16e-6, end, None]
    assert sim.read(steps[0], 3.0) == 3.0 and sim.read(steps[1], 3.0) == 3.0
    assert sim.read(steps[2], 3.0) == 3.0 + 12e-6
    assert sim.synced(3.5, steps[1], None) == 3.5  # read already: a sync costs nothing of its own
    assert sim.synced(3.5, steps[1], 4e-6) == 3.5 + 4e-6  # the backend's own operation (hil's what-ifs)


def test_a_sync_adds_a_measured_steps_wake_up_only_where_it_blocked():
    """hil reads at a sync as the real loop does: a measured step's readback, plus the wake-up its real wait
    measured where the host reached the sync before the step's end, none where the step had ended; its settle then
    costs nothing more."""
    sc = scenario(depth=3)
    reqs = make_requests(1, 8, 4)
    sim = Simulation(sc, reqs, resolve_mode(sc), model_backend(sc, reqs, resolve_mode(sc)))
    steps = [Step(0, None, gpu_end=1.0, readback_s=20e-6, wake_s=5e-6),
             Step(1, None, gpu_end=2.0, readback_s=30e-6, wake_s=7e-6)]
    sim.core.in_flight.extend(steps)
    assert sim.synced(0.5, steps[0], None) == pytest.approx(1.0 + 20e-6 + 5e-6)
    assert sim.synced(2.5, steps[1], None) == pytest.approx(2.5 + 30e-6)
    assert sim.read(steps[0], 3.0) == 3.0 and sim.read(steps[1], 3.0) == 3.0


def test_a_settle_pays_the_hosts_wake_up_only_where_it_blocked_on_the_step():
    """hil's wake-up measured at the real wait (`StepTiming.wake_s`) is host time after the step's end: a settle
    reached before the step ended blocked on it and pays the wake-up after its readback; one reached after the
    end did not block, and does not."""
    sc = scenario(depth=2)
    requests = make_requests(1, 8, 4)
    sim = Simulation(sc, requests, resolve_mode(sc), model_backend(sc, requests, resolve_mode(sc)))
    blocked = Step(0, None, gpu_end=1.0, readback_s=20e-6, wake_s=30e-6)
    ended = Step(1, None, gpu_end=1.5, readback_s=20e-6, wake_s=30e-6)
    sim.env.run(until=1.0)  # the host waited for the first step's end
    assert sim.read(blocked, 0.9) == 1.0 + 20e-6 + 30e-6
    sim.env.run(until=2.0)
    assert sim.read(ended, 2.0) == 2.0 + 20e-6


def test_ngram_cpu_falls_back_to_depth_1():
    mode = resolve_mode(scenario(depth=3, proposer="ngram_cpu"))
    assert mode.depth == 1 and "depth 3 -> 1" in mode.note
    sc = scenario(depth=3, proposer="ngram_cpu", concurrency=2)
    _, rec, _ = simulate(sc, make_requests(4, 32, 20))
    st = rec.steps_frame()
    assert st.in_flight.max() == 1 and (st.propose_end > st.propose_start).all()


def test_gc_pauses_hit_every_step_with_probability_one():
    gc = {"probability": 1.0, "mean_ms": 1.0, "distribution": "fixed"}
    _, with_gc, d_gc = simulate(scenario(gc=gc), make_requests(2, 32, 20))
    _, without, d = simulate(scenario(), make_requests(2, 32, 20))
    st = with_gc.steps_frame()
    np.testing.assert_allclose(st.gc_pause_s, 1e-3)
    assert d_gc > d


def test_same_seed_same_records():
    sc = scenario(depth=2, concurrency=4, acceptance={"model": "iid", "alpha": 0.7})
    a = simulate(sc, make_requests(16, 40, 30))[1]
    b = simulate(sc, make_requests(16, 40, 30))[1]
    assert a.steps_frame().equals(b.steps_frame())
    assert a.emissions_frame().equals(b.emissions_frame())


def test_budget_too_small_for_a_decode_is_a_scenario_error():
    with pytest.raises(ScenarioError, match="max_num_batched_tokens"):
        simulate(scenario(k=4, max_num_batched_tokens=3), make_requests(2, 2, 4))


def test_a_device_operation_sync_costs_its_round_trip_where_a_data_sync_costs_nothing_more():
    """A `.item()` in metadata build (a device operation at the measured levels, engine.host_work.SYNC_OPS) costs
    its round trip after the wait even where the step's data was read already; a second sync that only waits for
    the same data reads nothing more and costs nothing."""
    from simharness.engine.host_work import SYNC_OPS
    from simharness.modes import DEVICE_OP_SYNCS

    assert set(SYNC_OPS) == DEVICE_OP_SYNCS  # the sim's catalogue of operation syncs is the measured levels'

    def run(add: list[str]) -> tuple[float, int]:
        sc = scenario(depth=2, k=2, concurrency=4, invalid_slots="trim", policy="optimistic",
                      sync_points={"add": add})
        _, rec, duration = simulate(sc, make_requests(4, 32, 16))
        return duration, len(rec.steps_frame())

    shipped, steps = run([])
    assert run(["accepted_counts"]) == (pytest.approx(shipped, rel=1e-12), steps)  # read at the trim sync already
    with_item, item_steps = run(["metadata_item"])
    assert item_steps == steps and with_item - shipped == pytest.approx(steps * HOST["sync_us"] * 1e-6, rel=0.5)
