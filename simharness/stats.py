"""Statistics over repeats: the median of each metric with a 95% bootstrap interval, and the test that tells a
change between two runs from run-to-run noise; and the error of a level's predictions against the real level's.

The repeat (a whole run of a point, with its own seed, warm-up and process state) is the unit of evidence: the
requests of one run share its batch and its device state, so they are not independent samples of what another
run would give.
"""

from __future__ import annotations

import math
from typing import get_args

import numpy as np
import pandas as pd

from simharness.scenario import FidelityMetric

BOOTSTRAP_RESAMPLES = 2000
CONFIDENCE = 0.95
ALPHA = 0.05  # a change between runs with repeats is significant below this p-value
REPEAT = "repeat"  # the summary column of a repeat's number (sweep_points)
METRICS: tuple[str, ...] = get_args(FidelityMetric)  # the metrics a level's error is computed on
REFERENCE = "real"  # the level the others' errors are measured against


def bootstrap_ci(values: np.ndarray, *, confidence: float = CONFIDENCE, resamples: int = BOOTSTRAP_RESAMPLES,
                 seed: int = 0) -> tuple[float, float]:
    """The percentile bootstrap interval of the median of `values` (NaNs dropped); deterministic for a seed.
    One value gives a zero-width interval; none gives NaNs."""
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]
    if len(x) == 0:
        return math.nan, math.nan
    if len(x) == 1:
        return float(x[0]), float(x[0])
    rng = np.random.default_rng(seed)
    medians = np.median(x[rng.integers(0, len(x), size=(resamples, len(x)))], axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(medians, [tail, 100 - tail])
    return float(low), float(high)


def t_interval(values: np.ndarray, *, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Mean and half-width of the t interval of the mean of `values` (half-width NaN with one value, 0 with no
    spread): for few repeats of a paired effect, where a bootstrap of three values says little."""
    x = np.asarray(values, dtype=np.float64)
    mean = float(np.mean(x))
    if len(x) < 2:
        return mean, math.nan
    from scipy.stats import t  # scipy.stats takes seconds to import: only when needed

    return mean, float(t.ppf(0.5 + confidence / 2, len(x) - 1) * np.std(x, ddof=1) / math.sqrt(len(x)))


def aggregate(summary: pd.DataFrame, metrics: list[str]) -> pd.DataFrame:
    """One row per configuration (`config_ids`): the first repeat's other columns, `config`, `repeats`, each
    metric's median over the repeats and its bootstrap interval as `ci_low.<metric>` / `ci_high.<metric>`."""
    ids = config_ids(summary)
    if ids.is_unique:
        return _unrepeated(summary, ids, metrics)
    rows = []
    for config, group in summary.groupby(ids, sort=False):
        row = group.iloc[0].to_dict()
        row["config"], row["repeats"] = config, len(group)
        for metric in metrics:
            values = pd.to_numeric(group[metric], errors="coerce").to_numpy(dtype=np.float64)
            finite = values[np.isfinite(values)]
            row[metric] = float(np.median(finite)) if len(finite) else math.nan
            row[f"ci_low.{metric}"], row[f"ci_high.{metric}"] = bootstrap_ci(values)
        rows.append(row)
    return pd.DataFrame(rows)


def _unrepeated(summary: pd.DataFrame, ids: pd.Series, metrics: list[str]) -> pd.DataFrame:
    """`aggregate` of configurations run once each, column by column (row by row, a large sweep's summary cost a
    third of a millisecond a row): each metric its finite value (else NaN), its interval that value. A column of
    text is typed anew from its values, as rows are (text that is all missing is a float column)."""
    columns = {c: v if pd.api.types.is_numeric_dtype(v) else pd.Series(v.tolist(), dtype=None).to_numpy()
               for c, v in summary.items()}
    columns.update(config=ids.to_numpy(), repeats=np.ones(len(summary), dtype=np.int64))
    for metric in metrics:
        values = pd.to_numeric(summary[metric], errors="coerce").to_numpy(dtype=np.float64)
        values = np.where(np.isfinite(values), values, np.nan)
        columns.update({metric: values, f"ci_low.{metric}": values, f"ci_high.{metric}": values.copy()})
    return pd.DataFrame({c: np.asarray(v) for c, v in columns.items()})


def config_ids(summary: pd.DataFrame) -> pd.Series:
    """Each row's point id without its `,repeat=r` part: the configuration its repeats share."""
    return summary["point"].str.replace(r"(^|,)repeat=\d+$", "", regex=True).replace("", "base")


def significance(base: np.ndarray, current: np.ndarray) -> float:
    """Two-sided p-value that two sets of repeats differ in location: Welch's t-test on the logarithms (run
    times and rates vary by a factor, not by an amount), on the values themselves when one is not positive.
    NaN with fewer than two finite repeats on a side; 0 or 1 when neither side varies."""
    a = np.asarray(base, dtype=np.float64)
    b = np.asarray(current, dtype=np.float64)
    a, b = a[np.isfinite(a)], b[np.isfinite(b)]
    if len(a) < 2 or len(b) < 2:
        return math.nan
    if (a > 0).all() and (b > 0).all():
        a, b = np.log(a), np.log(b)
    if a.var() == 0 and b.var() == 0:
        return 0.0 if a[0] != b[0] else 1.0
    from scipy.stats import ttest_ind  # scipy.stats takes seconds to import: only when needed

    return float(ttest_ind(a, b, equal_var=False).pvalue)


def level_values(summary: pd.DataFrame) -> pd.DataFrame:
    """Each level's value of every metric at every point: the median over its runs."""
    return summary.groupby(["config", "level"], sort=False)[list(METRICS)].median()


def error_table(summary: pd.DataFrame) -> pd.DataFrame:
    """One row per point, level (other than the reference) and metric: the level's value, the real value and the
    relative error (NaN where the real value is 0 or missing)."""
    values = level_values(summary)
    real = values.xs(REFERENCE, level="level")
    rows = []
    for (config, level), row in values.iterrows():
        if level == REFERENCE or config not in real.index:
            continue
        for metric in METRICS:
            truth, predicted = real.at[config, metric], row[metric]
            error = predicted / truth - 1 if truth and np.isfinite(truth) else np.nan
            rows.append({"config": config, "level": level, "metric": metric, "predicted": predicted,
                         "real": truth, "rel_error": error})  # fmt: skip
    return pd.DataFrame(rows, columns=["config", "level", "metric", "predicted", "real", "rel_error"])


def error_stats(errors: pd.DataFrame) -> pd.DataFrame:
    """Per level and metric: the median and worst absolute relative error over the points, and the worst point."""
    rows = []
    for (level, metric), group in errors.groupby(["level", "metric"], sort=False):
        absolute = group["rel_error"].abs().dropna()
        worst = group.loc[absolute.idxmax(), "config"] if len(absolute) else None
        rows.append({"level": level, "metric": metric, "points": len(absolute),
                     "median_abs_error": float(absolute.median()) if len(absolute) else np.nan,
                     "worst_abs_error": float(absolute.max()) if len(absolute) else np.nan, "worst_point": worst})
    return pd.DataFrame(rows, columns=["level", "metric", "points", "median_abs_error", "worst_abs_error",
                                       "worst_point"])  # fmt: skip
