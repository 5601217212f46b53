"""The seed changes at the sim level: each A/B runs and its effect has the sign the PR posted and, where the PR
posted a number, a size within 2x of it (a change of the model that flips or shrinks one fails here); the options
the seeds added do what they say at every level."""

import time

import numpy as np
import pytest
from helpers import SIM_MISSES

import simharness
from simharness.engine.torch_backend import TorchBackend, capacity
from simharness.measured import build_model, run_level
from simharness.model_backend import model_backend
from simharness.modes import resolve_mode
from simharness.pointwork import run_on_clock
from simharness.scenario import ScenarioError, load_scenario, scenario_from_dict
from simharness.seeds import SEEDS, seed_scenario_path
from simharness.simulation import Simulation
from simharness.workload import build_requests

# the seeds whose seed 0 misses a posted effect (tests/helpers.py): strict xfail, failing the day the sim reproduces it
SEED_0_MISSES = {seed: miss.reason for (seed, _), miss in SIM_MISSES.items() if miss.seed_0}


@pytest.mark.parametrize("pr", [pytest.param(pr, marks=pytest.mark.xfail(strict=True, reason=SEED_0_MISSES[pr]))
                                if pr in SEED_0_MISSES else pr for pr in sorted(SEEDS)])
def test_seed_effect_has_the_posted_sign_and_size(pr, tmp_path):
    effects = simharness.seed_effects(simharness.run_seed(pr, "sim", 1, tmp_path))
    assert len(effects) > 0 and set(effects.metric) <= set(SEEDS[pr].reported)  # the sampler's time: not at sim
    for row in effects.itertuples():
        assert np.sign(row.effect_pct) == SEEDS[pr].sign[row.metric], (pr, row.metric, row.effect_pct)
        reported = SEEDS[pr].reported[row.metric]
        if reported is not None:
            assert 0.5 <= row.effect_pct / reported <= 2.0, (pr, row.metric, row.effect_pct, reported)


def test_seed_scenarios_sweep_their_field():
    for pr, seed in SEEDS.items():
        sc = load_scenario(seed_scenario_path(pr))
        assert list(sc.sweep) == [seed.field] and len(sc.sweep[seed.field]) >= 2


def test_random_fraction_marks_that_share_and_costs_the_sampler():
    base = {"name": "t", "workload": {"num_requests": 10, "output_len": {"dist": "fixed", "value": 16}}}
    assert build_requests(scenario_from_dict(base).workload, 0).random is None
    sc = scenario_from_dict(base, {"workload.random_fraction": 0.3})
    assert build_requests(sc.workload, 0).random.sum() == 3
    steps = {}
    for fraction in (0.0, 1.0):
        sc = scenario_from_dict(base, {"workload.random_fraction": fraction})
        requests = build_requests(sc.workload, 0)
        mode = resolve_mode(sc)
        records, _ = Simulation(sc, requests, mode, model_backend(sc, requests, mode)).run()
        steps[fraction] = records.steps_frame()
    gpu = {f: (s.gpu_end - s.gpu_start).sum() for f, s in steps.items()}
    assert gpu[1.0] > gpu[0.0]
    with pytest.raises(ScenarioError, match="workload.random_fraction"):
        scenario_from_dict(base, {"workload.random_fraction": 1.5})


def test_allocations_pause_prep_once_per_full_every():
    workload = {"num_requests": 16, "output_len": {"dist": "fixed", "value": 32}}
    sc = scenario_from_dict({"name": "t", "workload": workload,
                             "engine": {"gc": {"allocations_per_step": 10, "full_every": 50, "heap_objects": 100000}}})
    requests = build_requests(sc.workload, 0)
    mode = resolve_mode(sc)
    backend = model_backend(sc, requests, mode)
    start = backend.allocated
    records, _ = Simulation(sc, requests, mode, backend).run()
    steps = records.steps_frame()
    prep = (steps.prep_end - steps.prep_start).to_numpy()
    pause = 100000 * sc.engine.host_costs.gc_ns_per_object * 1e-9
    paused = np.count_nonzero(prep > pause)
    assert paused == (start + 10 * len(steps)) // 50
    with pytest.raises(ScenarioError, match="engine.gc.full_every"):
        scenario_from_dict({"name": "t", "engine": {"gc": {"full_every": 0}}})


@pytest.mark.parametrize("level", ["hil", "real"])
def test_seed_options_run_on_the_real_decode_loop(level, monkeypatch):
    """Random rows, per-step allocations, a heap and the real boolean-mask sync run on the tiny CPU model: the
    sync is the backend's operation before every prep but the first, and the heap is held."""
    sc = scenario_from_dict({
        "name": "t", "seed": 1,
        "workload": {"num_requests": 6, "concurrency": 3, "prompt_len": {"dist": "uniform", "min": 24, "max": 40},
                     "output_len": {"dist": "fixed", "value": 12}, "random_fraction": 0.5},
        "engine": {"level": level, "device": "cpu", "model": "tiny",
                   "gc": {"allocations_per_step": 5, "heap_objects": 1000}},
        "scheduler": {"depth": 2, "sync_points": {"add": ["bool_mask_index"]}},
    })  # fmt: skip
    requests = build_requests(sc.workload, sc.seed)
    mode = resolve_mode(sc)
    model = build_model(sc.engine, *capacity(sc, requests, mode))
    ops = []
    original = TorchBackend.sync_op

    def spy(self, step, name):
        ops.append(name)
        return original(self, step, name)

    monkeypatch.setattr(TorchBackend, "sync_op", spy)
    records, _, backend_used = run_level(sc, requests, mode, model, run_on_clock)
    assert len(backend_used.allocations.heap) == 1000
    syncs = records.syncs_frame()
    assert ops.count("bool_mask_index") == (syncs.name == "bool_mask_index").sum() >= len(records.steps_frame()) - 1
    assert requests.random.sum() == 3


def test_hil_charges_a_sync_its_operations_own_time(monkeypatch):
    """At hil a what-if sync's wait is modelled and its real operation, timed alone, is its own cost: a slow
    operation (50 ms here) lengthens every such sync by that much, which the modelled 15 µs would not."""
    from simharness.engine import host_work

    monkeypatch.setitem(host_work.SYNC_OPS, "bool_mask_index", lambda loop: time.sleep(0.05))
    sc = scenario_from_dict({
        "name": "t", "seed": 1,
        "workload": {"num_requests": 4, "concurrency": 2, "prompt_len": {"dist": "uniform", "min": 24, "max": 40},
                     "output_len": {"dist": "fixed", "value": 6}},
        "engine": {"level": "hil", "device": "cpu", "model": "tiny"},
        "scheduler": {"depth": 2, "sync_points": {"add": ["bool_mask_index"]}},
    })  # fmt: skip
    requests = build_requests(sc.workload, sc.seed)
    mode = resolve_mode(sc)
    records, _, _ = run_level(sc, requests, mode, build_model(sc.engine, *capacity(sc, requests, mode)), run_on_clock)
    syncs = records.syncs_frame()
    waits = (syncs["end_s"] - syncs["start_s"])[syncs["name"] == "bool_mask_index"]
    assert len(waits) > 3 and (waits >= 0.05).all()
