"""The GC watch counts CPython's collections by generation and times them; measured points report them."""

import gc

import numpy as np

import simharness
from simharness.gcwatch import GC_COLUMNS, GcWatch
from simharness.scenario import load_scenario


def test_counts_each_collection_by_generation_and_its_pause():
    with GcWatch() as watch:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    gc.collect(2)  # outside the watch
    assert watch.collections[0] >= 1 and watch.collections[2] == 2
    summary = watch.summary()
    assert summary["gc_full_collections"] == 2 and summary["gc_collections"] == sum(watch.collections)
    assert summary["gc_pause_ms"] > 0
    assert watch._callback not in gc.callbacks


def test_measured_points_report_their_collections_and_sim_points_nan(tmp_path, monkeypatch):
    """A full collection forced in every hil step's prep reaches the point's summary; a sim point has none."""
    from simharness.engine.host_work import Allocations

    monkeypatch.setattr(Allocations, "step", lambda self, host, rids: gc.collect(2))
    overrides = {"sweep": {}, "workload.num_requests": 3, "workload.output_len": {"dist": "fixed", "value": 8}}
    hil = simharness.run(load_scenario("scenarios/hil-cpu.yaml", overrides), tmp_path)
    sim = simharness.run(load_scenario("scenarios/hil-cpu.yaml", {**overrides, "engine.level": "sim"}), tmp_path)
    decode_steps = int((hil.steps["n_reqs"] > hil.steps["n_prefill_reqs"]).sum())
    assert hil.summary.loc[0, "gc_full_collections"] >= decode_steps > 0
    assert hil.summary.loc[0, "gc_collections"] >= hil.summary.loc[0, "gc_full_collections"]
    assert hil.summary.loc[0, "gc_pause_ms"] > 0
    assert np.isnan(sim.summary[list(GC_COLUMNS)].to_numpy(dtype=float)).all()
