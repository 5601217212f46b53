"""The SimPy model against closed forms and invariants (sim level, constant costs where it helps)."""

from types import SimpleNamespace

import numpy as np
import pytest

from simharness.model_backend import model_backend
from simharness.modes import resolve_mode
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
def test_each_sync_ends_when_its_step_ended_on_the_gpu_plus_its_cost(phase, depth):
    """A sync starts where the host is (the previous sync's end, or the phase's start) and ends at the later
    of that and its step's GPU end, plus the sync's own cost: the host may be computed ahead of the clock,
    but every recorded wait is what blocking on each GPU event in turn gives. An all_launched sync waits for
    the newest step launched by then; an oldest_in_flight one for some earlier step."""
    cost = 7e-6
    points = [{"name": "a", "phase": phase, "waits_for": "oldest_in_flight"},
              {"name": "b", "phase": phase, "waits_for": "all_launched"}]
    sc = scenario(depth=depth, policy="optimistic", concurrency=4, host=dict(HOST, sync_us=cost * 1e6),
                  sync_points={"add": points})
    _, rec, _ = simulate(sc, make_requests(8, 48, 30))
    steps = rec.steps_frame()
    launch_end, gpu_end = steps.launch_end.to_numpy(), steps.gpu_end.to_numpy()
    syncs = rec.syncs_frame()
    # the last steps' syncs may wait for steps still in flight when the last request ended (never recorded)
    syncs = syncs[syncs.step < len(steps) - depth]
    a, b = syncs[syncs.name == "a"].reset_index(), syncs[syncs.name == "b"].reset_index()
    assert len(a) == len(b) == len(steps) - depth and (a.step == b.step).all()
    np.testing.assert_array_equal(b.start_s, a.end_s)  # b follows a at once
    for row in a.itertuples():
        assert row.end_s == row.start_s + cost or (row.end_s > row.start_s + cost and row.end_s - cost in gpu_end)
    for row in b.itertuples():
        launched = np.flatnonzero(launch_end <= row.start_s)
        if len(launched) == 0:  # the first step's: nothing to wait for
            assert row.end_s == row.start_s + cost
            continue
        newest = launched.max()
        assert row.end_s == max(row.start_s, gpu_end[newest]) + cost
    waited = (a.end_s - a.start_s > 1.5 * cost) | (b.end_s - b.start_s > 1.5 * cost)
    assert waited.any() == (depth > 1)  # the GPU was behind the host at some of them, unless synchronous


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
