"""Statistics over repeats: the bootstrap interval, the aggregation of a summary, and the significance test's
power and false-positive rate on planted data."""

import math

import numpy as np
import pandas as pd
import pytest

from simharness.stats import ALPHA, aggregate, bootstrap_ci, config_ids, significance, t_interval

REPEATS = 5
NOISE = 0.03  # run-to-run spread of a metric: lognormal, 3% standard deviation
CHANGE = 1.10  # a planted 10% change


def test_bootstrap_interval_holds_the_median_and_is_deterministic():
    values = np.array([1.0, 1.2, 0.9, 1.1, 1.05])
    low, high = bootstrap_ci(values)
    assert low <= np.median(values) <= high
    assert min(values) <= low and high <= max(values)
    assert bootstrap_ci(values) == (low, high)
    assert bootstrap_ci(np.array([2.0, math.nan])) == (2.0, 2.0)  # one finite value: zero width
    assert all(math.isnan(v) for v in bootstrap_ci(np.array([math.nan])))


def test_bootstrap_interval_covers_the_true_median():
    """95% nominal; the percentile bootstrap of a median of 15 draws covers a little less: above 85%."""
    rng = np.random.default_rng(0)
    covered = 0
    for seed in range(200):
        low, high = bootstrap_ci(rng.normal(10.0, 1.0, 15), resamples=500, seed=seed)
        covered += low <= 10.0 <= high
    assert covered / 200 > 0.85


def test_aggregate_groups_repeats_of_a_point():
    summary = pd.DataFrame({"point": ["a=1,repeat=0", "a=1,repeat=1", "a=1,repeat=2", "a=2,repeat=0", "a=2,repeat=1"],
                            "mean_tpot_ms": [1.0, 3.0, 2.0, 5.0, 7.0]})
    assert list(config_ids(summary)) == ["a=1"] * 3 + ["a=2"] * 2
    out = aggregate(summary, ["mean_tpot_ms"]).set_index("config")
    assert out.loc["a=1", "mean_tpot_ms"] == 2.0 and out.loc["a=2", "mean_tpot_ms"] == 6.0
    assert out.loc["a=1", "repeats"] == 3 and out.loc["a=1", "point"] == "a=1,repeat=0"
    assert out.loc["a=1", "ci_low.mean_tpot_ms"] <= 2.0 <= out.loc["a=1", "ci_high.mean_tpot_ms"]
    assert list(config_ids(pd.DataFrame({"point": ["repeat=0", "repeat=1"]}))) == ["base", "base"]


def _repeats(rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    return scale * np.exp(rng.normal(0.0, NOISE, REPEATS))


def test_significance_flags_a_planted_change_and_not_noise():
    """Power: a 10% change with 5 repeats of 3% noise is flagged in at least 98% of 300 seeds. False positives:
    pure noise is flagged at about the test's level, 5% (between 2% and 8% over 1000 seeds; 4.4% over 10,000)."""
    rng = np.random.default_rng(17)
    flagged = sum(significance(_repeats(rng), _repeats(rng, CHANGE)) < ALPHA for _ in range(300))
    assert flagged / 300 >= 0.98
    false_positives = sum(significance(_repeats(rng), _repeats(rng)) < ALPHA for _ in range(1000))
    assert 0.02 <= false_positives / 1000 <= 0.08


def test_significance_edge_cases():
    assert math.isnan(significance(np.array([1.0]), np.array([1.0, 2.0])))  # one repeat: no evidence
    assert significance(np.array([2.0, 2.0]), np.array([3.0, 3.0])) == 0.0  # no spread, different
    assert significance(np.array([2.0, 2.0]), np.array([2.0, 2.0])) == 1.0
    assert significance(np.array([0.0, 1.0, 2.0]), np.array([0.0, 1.0, 2.0])) == pytest.approx(1.0)  # not positive


def test_t_interval_by_hand():
    mean, half = t_interval(np.array([1.0, 2.0, 3.0]))  # sd 1, t(0.975, 2) = 4.302653
    assert mean == 2.0 and half == pytest.approx(4.302653 / np.sqrt(3), rel=1e-6)
    assert t_interval(np.array([5.0, 5.0]))[1] == 0.0
    assert t_interval(np.array([5.0]))[0] == 5.0 and np.isnan(t_interval(np.array([5.0]))[1])


def test_aggregate_without_repeats_matches_one_repeat_of_each():
    """Configurations run once each (a large sweep, aggregated column by column): the same columns, types and
    values as when every configuration is a group of repeats of that value; an infinite metric is NaN."""
    once = pd.DataFrame({"point": ["k=0", "k=1", "k=2"], "engine.speculation.k": [0, 1, 2],
                         "output_throughput": [100.0, math.inf, 120.5], "mean_tpot_ms": [2.0, 1.5, math.nan],
                         "note": ["", "fell back", math.nan], "failed": [math.nan] * 3, "level": "sim"})
    once["note"] = once["note"].astype("str")
    twice = pd.concat([once.assign(point=once["point"] + f",repeat={r}", repeat=r) for r in range(2)])
    metrics = ["output_throughput", "mean_tpot_ms"]
    fast = aggregate(once, metrics)
    grouped = aggregate(twice.sort_values("engine.speculation.k", kind="stable"), metrics)
    assert list(fast["repeats"]) == [1, 1, 1] and list(grouped["repeats"]) == [2, 2, 2]
    assert list(fast["config"]) == list(once["point"])
    assert math.isnan(fast.loc[1, "output_throughput"]) and fast.loc[2, "ci_low.output_throughput"] == 120.5
    pd.testing.assert_frame_equal(fast.drop(columns=["repeats"]),
                                  grouped.drop(columns=["repeats", "repeat"]).assign(point=once["point"]),
                                  check_exact=True)
