"""A run that starts its own local Ray cluster (`--ray local`) and stops it."""

import time

import pytest
from helpers import SMALL

import simharness
from simharness.scenario import scenario_from_dict

ray = pytest.importorskip("ray")


def test_a_run_stops_the_cluster_it_started_before_it_returns(tmp_path, monkeypatch):
    """The cluster stops beside the run's tail, but the run returns only once it has, so the caller may start Ray
    again at once: even when stopping outlasts the tail (here made to take 3 s more)."""
    shutdown = ray.shutdown

    def slow_shutdown():
        time.sleep(3)
        shutdown()

    monkeypatch.setattr(ray, "shutdown", slow_shutdown)
    assert not ray.is_initialized()
    result = simharness.run(scenario_from_dict(SMALL), out=tmp_path, ray="local")
    assert not ray.is_initialized()
    assert result.failed.empty and len(result.summary) == 4
    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    shutdown()
