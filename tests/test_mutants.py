"""Bugs the rest of the suite let through, each planted once in a scratch copy: every test here fails on its bug.

compare's significance level over repeats (0.05), a bootstrap that resamples every value, the 95% intervals the
reports promise, the median (not the mean) over a fidelity point's runs and in the real level's spread, the unit
of the calibration's nanosecond field, and the source digest that keeps numba's cache fresh covering subpackages.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy.stats import binom
from scipy.stats import t as student_t
from test_calibration import synthetic_steps

import simharness
from simharness.calibration import FitData, calibrate
from simharness.fidelity import spread
from simharness.jit import PACKAGE, sources_digest
from simharness.stats import METRICS, bootstrap_ci, error_table, level_values, t_interval


def _repeats_run(path: Path, values: list[float]) -> Path:
    """A bare summary.json of one configuration run len(values) times."""
    path.mkdir()
    rows = [{"point": f"scheduler.depth=1,repeat={r}", "index": r, "level": "sim", "repeat": r, "mean_tpot_ms": v}
            for r, v in enumerate(values)]
    (path / "summary.json").write_text(json.dumps(rows))
    return path / "summary.json"


def test_compare_calls_p_below_0_05_significant(tmp_path):
    """Five repeats a side, +7.6% mean TPOT at p = 0.018: a regression at the 0.05 level (noise at 0.01)."""
    base = [10.0, 10.4, 9.7, 10.2, 9.9]
    current = [v * 1.07 / 1.06 for v in (10.9, 10.1, 11.2, 10.3, 11.0)]
    (row,) = [r for r in simharness.compare(_repeats_run(tmp_path / "a", base), _repeats_run(tmp_path / "b", current))
              if r.metric == "mean_tpot_ms"]
    assert 0.01 < row.p_value < 0.05 and row.change_pct > 5
    assert row.verdict == "regression", row


def test_bootstrap_resamples_every_value():
    """Of two values, a quarter of the resamples draw the second twice: the 95% interval reaches it (and the
    first)."""
    assert bootstrap_ci(np.array([0.0, 1.0])) == (0.0, 1.0)
    assert bootstrap_ci(np.array([5.0, 5.0, 5.0, 5.0, 100.0]))[1] == 100.0  # 5.8% of medians are the last value


def test_bootstrap_interval_is_95_percent():
    """1001 distinct values: the median of a resample is at or below the k-th value with probability
    P(Binomial(1001, (k + 1) / 1001) >= 501); the interval's ends are that distribution's 2.5% and 97.5% points
    (a 90% interval's lie about 5 values inside them)."""
    n = 1001
    values = np.arange(n, dtype=np.float64)
    below = binom.sf(n // 2, n, (values + 1) / n)  # P(median <= values[k])
    exact = (np.searchsorted(below, 0.025), np.searchsorted(below, 0.975))
    low, high = bootstrap_ci(values, resamples=5000)
    assert abs(low - exact[0]) <= 2 and abs(high - exact[1]) <= 2, ((low, high), exact)


def test_t_interval_is_95_percent():
    mean, half = t_interval(np.array([1.0, 2.0, 3.0]))
    assert mean == 2.0 and half == pytest.approx(student_t.ppf(0.975, 2) / np.sqrt(3))


# runs of one fidelity point whose median (11) and mean (13.67) differ
RUNS = {"hil": [10.0, 11.0, 20.0], "real": [8.0, 10.0, 9.0]}


def _fidelity_summary() -> pd.DataFrame:
    rows = [{"config": "base", "level": level, "run": run, "mean_tpot_ms": v}
            for level, values in RUNS.items() for run, v in enumerate(values)]
    summary = pd.DataFrame(rows)
    for metric in METRICS:
        if metric not in summary:
            summary[metric] = 1.0
    return summary


def test_fidelity_takes_the_median_over_runs():
    summary = _fidelity_summary()
    assert level_values(summary).loc[("base", "hil"), "mean_tpot_ms"] == 11.0
    errors = error_table(summary).set_index("metric")
    assert errors.loc["mean_tpot_ms", "rel_error"] == pytest.approx(11.0 / 9.0 - 1)


def test_real_spread_is_range_over_median():
    out = spread(_fidelity_summary(), "hil").set_index("config")
    assert out.loc["base", "mean_tpot_ms"] == pytest.approx((20.0 - 10.0) / 11.0)
    assert out.loc["base", "runs"] == 3


def test_calibration_gives_the_cpu_proposer_per_token_cost_in_ns():
    """Propose times of 30 µs + 2 µs a request + 250 ns a history token: the fit gives each in its field's unit."""
    steps, _, _ = synthetic_steps("linear")
    rng = np.random.default_rng(1)
    steps["proposed"] = rng.integers(1, 65, len(steps))
    steps["history"] = steps["proposed"] * rng.integers(200, 2000, len(steps))
    steps["propose_s"] = (30.0 + 2.0 * steps["proposed"]) * 1e-6 + 250.0 * steps["history"] * 1e-9
    steps["measured"] = "prep,launch,gpu,readback,propose"
    host = calibrate(FitData(steps, "NVIDIA H100 80GB HBM3", "H100", "llama-3.2-1b", "hil"))["host_costs"]
    assert host["ngram_cpu_us"] == pytest.approx(30.0, rel=1e-3)
    assert host["ngram_cpu_per_req_us"] == pytest.approx(2.0, rel=1e-3)
    assert host["ngram_cpu_per_token_ns"] == pytest.approx(250.0, rel=1e-3)


@pytest.mark.parametrize("module", ["engine/decode.py", "kernels/ngram.py", "__init__.py"])
def test_source_digest_covers_every_subpackage(tmp_path, module):
    """An edit anywhere in the package, subpackages included, changes the digest that stamps numba's cache."""
    copy = shutil.copytree(PACKAGE, tmp_path / "simharness", ignore=shutil.ignore_patterns("__pycache__", "data"))
    before = sources_digest(copy)
    path = copy / module
    path.write_text(path.read_text() + "\n# edited\n")
    assert sources_digest(copy) != before
