"""The host gauge's arithmetic, and a measured point measured again while the gauge says the host was slow."""

import pytest

import simharness.measured as measured
from simharness.hostspeed import RETRIES, HostGauge
from simharness.measured import MeasuredEngine
from simharness.scenario import scenario_from_dict


def test_gauge_keeps_its_fastest_probe_and_divides_by_it():
    gauge = HostGauge()
    assert gauge.fastest_s > 0
    probes = [gauge.probe() for _ in range(3)]
    assert gauge.fastest_s <= min(probes)
    gauge.fastest_s = 1e-4
    assert gauge.slowdown(2e-4, 1e-4) == pytest.approx(2.0) and gauge.slowdown(1e-4, 3e-4) == pytest.approx(3.0)


class _Gauge:
    """Probes that read the slowdowns given, two per run (before, after), against a fastest time of 1."""

    def __init__(self, slowdowns: list[float]):
        self.fastest_s, self.times = 1.0, [t for s in slowdowns for t in (1.0, s)]

    def probe(self) -> float:
        return self.times.pop(0)

    def slowdown(self, before_s: float, after_s: float) -> float:
        return max(before_s, after_s) / self.fastest_s


@pytest.mark.parametrize(("limit", "slowdowns", "attempts"), [
    (None, [1.6], 1),  # no limit: one run, whatever the gauge
    (1.2, [1.6, 1.1], 2),  # a run in a slow spell, then one outside it
    (1.2, [1.6] * (RETRIES + 1), RETRIES + 1),  # still slow after the retries: the last run is kept
])  # fmt: skip
def test_a_run_in_a_slow_spell_is_measured_again(monkeypatch, limit, slowdowns, attempts):
    runs = []
    monkeypatch.setattr(measured, "warm_up", lambda *a: None)
    monkeypatch.setattr(measured, "run_level", lambda *a: runs.append(len(runs)) or ("records", 1.0, "backend"))
    engine = MeasuredEngine.__new__(MeasuredEngine)
    engine.model, engine.gauge = None, _Gauge(slowdowns)
    sc = scenario_from_dict({"name": "x", "engine": {"level": "real", "host_slowdown": limit}})
    run = engine.run(sc, None, None, None)
    assert len(runs) == attempts and run.host_attempts == attempts
    assert run.host_slowdown == slowdowns[attempts - 1] and run.records == "records"
