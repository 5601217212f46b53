"""The gate's statistics on simulated measured runs (seeded): the false-alarm rate of A/A pairs with a realistic
run-to-run spread, the power on known shifts, the test's own level; and the benchmark's draws of runs."""

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import load_benchmark
from scipy.stats import ttest_ind

from simharness.compare import METRICS, Run, compare_runs, run_significance
from simharness.gate_report import verdict

ROOT = Path(__file__).resolve().parents[1]
POINTS = ("concurrency=4", "concurrency=16")
# Run-to-run spread (the standard deviation of a run's log value, on top of a process effect of 0.8% shared by a
# run's metrics) of hil/real runs of one tree on one H100: two real runs differ by 0.5% in mean TPOT (median over the
# fidelity grid, docs/hil.md); tail percentiles spread more than means. docs/baselines.md "Gate power" says how the
# false-alarm rate grows with the tails' spread.
SPREAD = {"mean": 0.01, "median": 0.01, "p90": 0.015, "p99": 0.025}
BASE_MS = {"ttft": 30.0, "tpot": 6.0, "itl": 12.0, "e2el": 600.0}


def fake_run(rng: np.random.Generator, *, tpot_shift: float = 0.0, name: str = "r") -> Run:
    """One measured run's summary: every metric its base value times a lognormal run effect. A run's effect is
    shared by its metrics of one kind (a slow process is slow everywhere), plus a little noise of each."""
    rows = []
    for point in POINTS:
        row = {"point": point, "level": "hil"}
        process = rng.normal(0.0, 0.008)
        for kind, ms in BASE_MS.items():
            shift = tpot_shift if kind in ("tpot", "itl", "e2el") else 0.0
            for stat, sigma in SPREAD.items():
                row[f"{stat}_{kind}_ms"] = ms * math.exp(process + rng.normal(0.0, sigma)) * (1 + shift)
        row["output_throughput"] = 5000.0 * math.exp(-process + rng.normal(0.0, 0.01)) / (1 + tpot_shift)
        row["acceptance_rate"] = 60.0 * math.exp(rng.normal(0.0, 0.002))
        rows.append(row)
    summary = pd.DataFrame(rows).set_index("point")
    return Run(Path(name), "gate", "hil", summary, None, {"scenario": "gate", "device": "H100"})


def gate_fail_rate(n: int, trials: int, seed: int, tpot_shift: float = 0.0, base_runs: int | None = None,
                   **options) -> float:
    rng = np.random.default_rng(seed)
    fails = 0
    for _ in range(trials):
        base = [fake_run(rng) for _ in range(base_runs or n)]
        current = [fake_run(rng, tpot_shift=tpot_shift) for _ in range(n)]
        fails += verdict(compare_runs(base, current, **options)) == "fail"
    return fails / trials


@pytest.mark.parametrize("n", [2, 3, 5])
def test_false_alarm_rate_of_a_a_pairs_is_at_most_one_percent(n):
    # 22 gated metrics at 2 points: the threshold (5%) and the test (p < 0.02 two-sided, split over the families of
    # metrics that vary) together keep the gate quiet
    assert gate_fail_rate(n, 400, seed=n) <= 0.01


def test_the_threshold_alone_would_false_alarm():
    # the same A/A pairs judged by the threshold alone (p < 1 always holds): the tails' spread moves P99 by more
    # than 5% now and then, so the test is what keeps false alarms rare
    assert gate_fail_rate(3, 100, seed=3, alpha=0.999999) > 0.05


@pytest.mark.parametrize("n", [3, 5])
def test_a_five_percent_tpot_change_is_detected_against_a_ten_run_baseline(n):
    # the level is split over the varying families of metrics (`_Runs`): three runs a side leave the test four
    # degrees of freedom, too few for it; a committed baseline of ten runs gives it eleven or more
    assert gate_fail_rate(n, 100, seed=10 + n, tpot_shift=0.05, base_runs=10) >= 0.95
    assert gate_fail_rate(3, 100, seed=10, tpot_shift=0.05) < 0.95


def test_power_grows_with_runs_per_side():
    # 8%: with two runs a side sometimes, with five nearly always
    two, five = (gate_fail_rate(n, 100, seed=21, tpot_shift=0.08) for n in (2, 5))
    assert two < five and five >= 0.95


def test_run_significance_is_a_pooled_t_test_on_logs():
    rng = np.random.default_rng(0)
    a, b = rng.lognormal(0.0, 0.02, 4), rng.lognormal(0.03, 0.02, 3)
    assert run_significance(a, b) == pytest.approx(ttest_ind(np.log(a), np.log(b), equal_var=True).pvalue)
    # one new run against a history of three: Welch's test cannot, the pooled one can
    assert run_significance(a[:3], b[:1]) == pytest.approx(ttest_ind(np.log(a[:3]), np.log(b[:1])).pvalue)
    assert math.isnan(run_significance(a[:1], b[:1]))  # two runs in all: no spread to test against
    assert run_significance([1.0, 1.0], [1.0]) == 1.0 and run_significance([1.0, 1.0], [2.0]) == 0.0


def test_run_significance_holds_its_level():
    # A/A: p < alpha in about alpha of the trials, for any number of runs a side
    rng = np.random.default_rng(1)
    for n_base, n_cur in ((3, 1), (2, 2), (5, 5)):
        p = np.array([run_significance(rng.lognormal(0, 0.01, n_base), rng.lognormal(0, 0.01, n_cur))
                      for _ in range(4000)])
        for alpha in (0.01, 0.05):
            assert abs((p < alpha).mean() - alpha) < 0.6 * alpha + 0.004, (n_base, n_cur, alpha)


def test_every_gated_metric_has_a_direction_in_the_fake_runs():
    run = fake_run(np.random.default_rng(0))
    assert set(run.summary.columns) - {"level"} <= set(METRICS)


# ---------------------------------------------------------------------------------------------- the benchmark


def _benchmark():
    return load_benchmark("gate_power")


def test_trials_draw_distinct_processes_for_the_two_sides():
    gp = _benchmark()
    pool = {"A": {p: f"A{p}" for p in range(6)}, "X": {p: f"X{p}" for p in range(6)}}
    drawn = list(gp.trials(pool, "A", "X", 3, count=500))
    assert len(drawn) == len({tuple(b + c) for b, c in drawn}) == 20  # C(6, 6) x C(6, 3) splits: all of them
    for base, current in drawn:
        procs = [int(r[1:]) for r in base + current]
        assert len(set(procs)) == 6 and all(r[0] == "A" for r in base) and all(r[0] == "X" for r in current)
    assert list(gp.trials(pool, "A", "A", 5, count=10)) == []  # ten distinct processes needed, six in the pool
    assert len(list(gp.trials(pool, "A", "A", 1, count=7))) == 7


def test_table_reports_rates_and_smallest_detected_slowdown():
    gp = _benchmark()
    power = pd.DataFrame([
        {"level": "hil", "comparison": c, "change": c, "n": n, "trials": 10, "processes": 10, "fail_rate": r,
         "flagged_rate": 1.0, "worst_pct": 1.0}
        for c, n, r in [("A/A", 2, 0.0), ("device+2%", 2, 0.5), ("device+5%", 2, 0.96), ("device+10%", 2, 1.0),
                        ("A/A", 3, 0.0), ("device+2%", 3, 0.97), ("device+5%", 3, 1.0), ("device+10%", 3, 1.0)]])
    text = gp.table(power, "hil")
    assert "| A/A | A/A | 0.0% (10) | 0.0% (10) |" in text
    assert text.splitlines()[-1] == "| smallest device slowdown failed in >= 95% | | 5% | 2% |"


def test_the_real_device_arm_settles_at_its_fraction_of_the_base_step(monkeypatch):
    # each step's measured decode time holds the sleep injected into it; the injection reads the measured times
    # back and must settle at fraction x the base time, not compound (CPU path: a host spin after each step)
    import torch

    from simharness import realloop
    from simharness.backend import StepTiming
    from simharness.engine.decode import DecodeLoop

    bench = load_benchmark("gate_power")
    spins = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(realloop, "spin", spins.append)
    monkeypatch.setattr(DecodeLoop, "step", lambda self: None)
    base = [1e-3 * (1 + 0.1 * math.sin(i)) for i in range(200)]

    def run(self, step):  # the step's device time holds the spin injected into it
        return StepTiming(base[step] + (spins[-1] if spins else 0.0), 0.0)

    patched = {}
    bench._slower_steps(lambda owner, name, new: patched.__setitem__((owner.__name__, name), new), run, 0.05)
    assert set(patched) == {("TorchBackend", "run"), ("DecodeLoop", "step")}
    measured, slower = patched["TorchBackend", "run"], patched["DecodeLoop", "step"]
    for i in range(200):
        slower(None)
        measured(None, i)
    assert spins[0] == 0.0  # nothing read back yet
    assert np.mean(spins[50:]) == pytest.approx(0.05 * np.mean(base), rel=0.01)


def test_pin_reads_a_taskset_cpu_list_and_refuses_cpus_this_machine_lacks():
    import os

    bench = load_benchmark("gate_power")
    have = sorted(os.sched_getaffinity(0))
    assert bench._cpus(f"{have[0]}-{have[-1]}") == have
    assert bench._cpus(f"{have[0]},{have[0]}") == [have[0]]
    for bad in ("a", "1-x", "", f"{have[-1] + 1}"):
        with pytest.raises(ValueError):
            bench._cpus(bad)


def test_the_acceptance_arm_reaches_the_decode_steps_proposer(tmp_path):
    # the step's proposer is decode_step's own name for it: patching decode's alone left acceptance as it was
    import simharness
    from simharness.scenario import load_scenario

    bench = load_benchmark("gate_power")
    sc = load_scenario("scenarios/hil-cpu.yaml", {**bench.MEASURED, "workload.num_requests": 4, "engine.level": "hil"})
    plain = simharness.run(sc, out=tmp_path / "plain").summary.iloc[0]["acceptance_rate"]
    with bench.inject("acceptance", 0.1, "hil"):
        collapsed = simharness.run(sc, out=tmp_path / "collapsed").summary.iloc[0]["acceptance_rate"]
    assert plain > 30 and collapsed < plain / 3, (plain, collapsed)


def test_pin_is_refused_where_no_worker_runs(monkeypatch, capsys, tmp_path):
    bench = load_benchmark("gate_power")
    monkeypatch.setattr("sys.argv", ["gate_power.py", "--analyse", str(tmp_path), "--pin", "0", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code == 2 and "--pin" in capsys.readouterr().err
