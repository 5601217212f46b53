"""Perf-regression gate: compare two runs point by point and give each metric a verdict.

Sim-level points are deterministic, so any change beyond float noise is reported and a change
beyond the threshold in the bad direction is a regression (LLMServingSim gates its simulated
clock the same way). Runs with repeats (`repeats: N`, any level) compare the median over the repeats
and call a change a regression only when it is beyond the threshold and significant over the repeats
(`stats.significance`, p < 0.05): the repeat is the unit of evidence. Measured points (hil / real)
without repeats compare per-request samples with a Mann-Whitney U test (p < 0.01) and the threshold
together, as asv does; requests of one run are not independent, so a warning says that such a
comparison cannot tell run-to-run noise from a change.
The acceptance rate is always compared: a collapse of acceptance is a regression even when latency
looks fine (vLLM #37150).
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from simharness import stats

LATENCY = ("ttft", "tpot", "itl", "e2el")
STATS = ("mean", "median", "p90", "p99")
# metric -> (bigger is better, unit); None: a diagnostic with no good direction, shown as "changed"
# but never a regression or improvement (a faster GPU lowers the GPU-busy fraction at depth 1, and a
# faster host waits longer at each sync: neither is a regression; an added sync is, via syncs_per_step)
METRICS: dict[str, tuple[bool | None, str]] = {
    **{f"{s}_{m}_ms": (False, "ms") for m in LATENCY for s in STATS},
    "output_throughput": (True, "tok/s"),
    "request_throughput": (True, "req/s"),
    "acceptance_rate": (True, "%"),
    "mean_acceptance_length": (True, "tokens"),
    "gpu_busy_fraction": (None, "fraction"),
    "syncs_per_step": (False, "count"),
    "sync_wait_ms_per_step": (None, "ms"),
}
FLOAT_TOL = 1e-9
P_VALUE = 0.01


class CompareError(ValueError):
    """Bad compare input (missing file, nothing in common, different scenarios)."""


@dataclass
class Run:
    """What compare needs of a run: its scenario name, level, summary rows, and raw samples."""

    path: Path
    scenario: str
    level: str  # "sim" (deterministic) or "hil"/"real" (measured)
    summary: pd.DataFrame
    run_dir: Path | None  # per-request samples live here (absent when given a bare summary.json)


@dataclass
class Row:
    point: str
    metric: str
    base: float
    current: float
    change_pct: float
    # same | changed | improvement | regression | noise, or for a point one run lacks (metric ""): missing in base |
    # missing in current
    verdict: str
    p_value: float | None = None


def load_run(path: str | Path) -> Run:
    """A run directory or its summary.json."""
    path = Path(path)
    if not path.exists():
        raise CompareError(f"{path}: no such file or directory")
    run_dir = path if path.is_dir() else path.parent
    summary_path = path / "summary.json" if path.is_dir() else path
    if not summary_path.is_file():
        raise CompareError(f"{path}: no summary.json (is it a run directory?)")
    try:
        rows = json.loads(summary_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CompareError(f"{summary_path}: not valid JSON ({e})") from None
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) and "point" in r for r in rows):
        raise CompareError(f"{summary_path}: not a simharness summary (a list of points)")
    points = [r["point"] for r in rows]
    if len(set(points)) != len(points):
        raise CompareError(f"{summary_path}: a point appears more than once")
    meta_path = run_dir / "meta.json"
    try:
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CompareError(f"{meta_path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise CompareError(f"{meta_path}: not a simharness meta.json (a mapping)")
    summary = pd.DataFrame(rows).set_index("point")
    level = str(summary["level"].iloc[0]) if "level" in summary else "sim"
    has_samples = (run_dir / "requests.parquet").is_file()
    return Run(path, meta.get("scenario", "?"), level, summary, run_dir if has_samples else None)


def compare_runs(base: Run, current: Run, *, threshold: float = 0.05, force: bool = False) -> list[Row]:
    """Verdicts for every common point and compared metric, and a `missing` row for each point that only one run
    has. A run whose scenario is unknown (a bare summary.json with no meta.json beside it) is taken to be of the
    other run's scenario."""
    if not math.isfinite(threshold) or threshold <= 0:
        raise CompareError(f"--threshold: must be a finite number > 0, got {threshold}")
    if base.scenario != current.scenario and "?" not in (base.scenario, current.scenario) and not force:
        raise CompareError(
            f"different scenarios ({base.scenario!r} vs {current.scenario!r}); pass --force to compare anyway"
        )
    measured = base.level != "sim" or current.level != "sim"
    repeats = _Repeats(base, current) if stats.REPEAT in base.summary or stats.REPEAT in current.summary else None
    if repeats is not None:
        base, current = repeats.medians  # a point's repeats are compared as one
    common = [p for p in base.summary.index if p in current.summary.index]
    if not common:
        raise CompareError("the two runs have no sweep point in common")
    samples = repeats or (_Samples(base, current) if measured else None)
    if measured and (samples is None or not samples.repeated):
        warnings.warn("measured runs with one sample per point: compare cannot tell run-to-run noise from a change "
                      "(the runs' processes differ by more than their requests do); run both with `repeats: N`",
                      stacklevel=2)
    rows = []
    for point in common:
        b, c = base.summary.loc[point], current.summary.loc[point]
        for metric, (bigger_better, _) in METRICS.items():
            if metric not in b or metric not in c or pd.isna(b[metric]) or pd.isna(c[metric]):
                continue
            try:
                values = float(b[metric]), float(c[metric])
            except (TypeError, ValueError):
                raise CompareError(f"point {point}: {metric} is not a number") from None
            rows.append(_verdict(point, metric, *values, bigger_better, threshold, samples))
    if not rows:
        raise CompareError("the two runs have no compared metric in common (see compare.METRICS)")
    nan = float("nan")
    for lacking, other, name in ((current, base, "current"), (base, current, "base")):
        gone = [p for p in other.summary.index if p not in lacking.summary.index]
        rows += [Row(p, "", nan, nan, nan, f"missing in {name}") for p in gone]
    return rows


def _verdict(point, metric, base, cur, bigger_better, threshold, samples) -> Row:
    diff = cur - base
    change = diff / abs(base) if base else (0.0 if diff == 0 else float("inf") * np.sign(diff))
    if abs(diff) <= FLOAT_TOL * max(abs(base), 1.0):
        return Row(point, metric, base, cur, 0.0, "same")
    if bigger_better is None:
        return Row(point, metric, base, cur, 100 * change, "changed")
    worse = diff < 0 if bigger_better else diff > 0
    beyond = abs(change) > threshold
    p_value = None
    if samples is not None:
        p_value = samples.p_value(point, metric)
        if p_value is not None and not math.isnan(p_value) and p_value >= samples.alpha:
            return Row(point, metric, base, cur, 100 * change, "noise", p_value)
    verdict = ("regression" if worse else "improvement") if beyond else "changed"
    return Row(point, metric, base, cur, 100 * change, verdict, p_value)


class _Repeats:
    """Runs with repeats: each configuration's median over its repeats (`medians`, the runs compare them) and
    the repeats' values, for `stats.significance`."""

    alpha = stats.ALPHA

    def __init__(self, base: Run, current: Run):
        self.groups, self.medians = [], []
        for run in (base, current):
            summary = run.summary.reset_index()
            numeric = [m for m in METRICS if m in summary]
            groups = summary.groupby(stats.config_ids(summary), sort=False)[numeric]
            self.groups.append(groups)
            self.medians.append(Run(run.path, run.scenario, run.level, groups.median(), run.run_dir))
        # both runs have more than one repeat of some configuration
        self.repeated = all(int(g.size().max()) > 1 for g in self.groups)

    def p_value(self, point: str, metric: str) -> float | None:
        return stats.significance(*(g.get_group(point)[metric].to_numpy() for g in self.groups))


class _Samples:
    """Per-request samples of measured runs, for the Mann-Whitney U test."""

    alpha = P_VALUE
    repeated = False

    def __init__(self, base: Run, current: Run):
        self.tables = [self._load(r) for r in (base, current)]

    COLUMNS = {
        "requests": ("point", "arrival_s", "first_token_s", "last_token_s", "output_tokens"),
        "emissions": ("point", "request_id", "time_s"),
    }

    @classmethod
    def _load(cls, run: Run) -> dict[str, pd.DataFrame] | None:
        if run.run_dir is None:
            return None
        tables = {}
        for name, columns in cls.COLUMNS.items():
            path = run.run_dir / f"{name}.parquet"
            if not path.is_file():
                return None  # no samples: the threshold alone decides
            try:
                df = pd.read_parquet(path)
            except Exception as e:  # any unreadable file is bad input
                raise CompareError(f"{path}: cannot read ({e})") from None
            missing = [c for c in columns if c not in df.columns]
            if missing:
                raise CompareError(f"{path}: missing column(s) {', '.join(missing)}")
            tables[name] = df
        return tables

    def p_value(self, point: str, metric: str) -> float | None:
        if any(t is None for t in self.tables):
            return None
        kind = next((m for m in LATENCY if f"_{m}_" in metric), None)
        if kind is None:
            return None
        a, b = (_latency_samples(t, point, kind) for t in self.tables)
        a, b = a[np.isfinite(a)], b[np.isfinite(b)]
        if len(a) < 2 or len(b) < 2:
            return None
        from scipy.stats import mannwhitneyu  # scipy.stats takes seconds to import: only when needed

        return float(mannwhitneyu(a, b, alternative="two-sided").pvalue)


def _latency_samples(tables: dict[str, pd.DataFrame], point: str, kind: str) -> np.ndarray:
    r = tables["requests"]
    r = r[r["point"] == point].astype({"output_tokens": "float64"})
    ttft = r["first_token_s"] - r["arrival_s"]
    e2e = r["last_token_s"] - r["arrival_s"]
    if kind == "ttft":
        return ttft.to_numpy(dtype=float)
    if kind == "e2el":
        return e2e.to_numpy(dtype=float)
    if kind == "tpot":
        many = r["output_tokens"] > 1
        return ((e2e - ttft)[many] / (r["output_tokens"][many] - 1)).to_numpy(dtype=float)
    # ITL: one sample per request (its mean gap). The gaps of one request share its batch and its
    # speed, so pooling them would treat thousands of correlated gaps as independent samples and call
    # run-to-run noise significant.
    e = tables["emissions"]
    e = e[e["point"] == point].sort_values(["request_id", "time_s"])
    gaps = e.assign(gap=e.groupby("request_id")["time_s"].diff()).dropna(subset=["gap"])
    return gaps.groupby("request_id")["gap"].mean().to_numpy(dtype=float)


def markdown(rows: list[Row], *, show_all: bool = False) -> str:
    """A table fit for a pull-request comment: regressions first, then points missing from a run, improvements and
    changes."""
    order = {"regression": 0, "missing in current": 1, "missing in base": 1, "improvement": 2, "changed": 3,
             "noise": 4, "same": 5}
    shown = [r for r in rows if show_all or r.verdict not in ("same", "noise")]
    shown.sort(key=lambda r: (order[r.verdict], r.point, r.metric))
    count = {v: sum(r.verdict == v for r in rows) for v in ("regression", "improvement", "changed")}
    missing = {side: sum(r.verdict == f"missing in {side}" for r in rows) for side in ("base", "current")}
    compared = [r for r in rows if not r.verdict.startswith("missing")]
    head = (f"**{count['regression']} regression(s), {count['improvement']} improvement(s), {count['changed']} "
            f"changed**" + "".join(f", **{n} point(s) missing in {side}**" for side, n in missing.items() if n)
            + f" over {len(compared)} metrics at {len({r.point for r in compared})} common points"
            f" ({sum(r.verdict in ('same', 'noise') for r in rows)} unchanged or within noise)")
    if any(r.p_value is not None for r in rows):
        head += ("; a regression or improvement is beyond the threshold and significant (its p-value shown), noise "
                 "is not significant")
    if not shown:
        return head + "\n"
    lines = [head, "", "| point | metric | base | current | change % | verdict |", "|---|---|---:|---:|---:|---|"]
    for r in shown:
        if r.verdict.startswith("missing"):
            here, gone = ("absent", "present") if r.verdict == "missing in base" else ("present", "absent")
            lines.append(f"| {r.point} | (all) | {here} | {gone} | | ⚠️ {r.verdict} |")
            continue
        mark = {"regression": "❌ regression", "improvement": "✅ improvement"}.get(r.verdict, r.verdict)
        if r.p_value is not None and math.isfinite(r.p_value):
            mark += f" (p={r.p_value:.2g})"
        lines.append(f"| {r.point} | {r.metric} | {r.base:.4g} | {r.current:.4g} | {r.change_pct:+.2f} | {mark} |")
    return "\n".join(lines) + "\n"


def to_json(rows: list[Row]) -> dict:
    """Rows plus github-action-benchmark / Bencher lists of the current values (diagnostics, which
    have no good direction, are in the rows only)."""
    smaller, bigger = [], []
    for r in rows:
        if r.metric not in METRICS:  # a missing point's row
            continue
        bigger_better, unit = METRICS[r.metric]
        if bigger_better is None:
            continue
        entry = {"name": f"{r.point} {r.metric}", "unit": unit, "value": _finite(r.current)}
        (bigger if bigger_better else smaller).append(entry)
    return {
        "regressions": sum(r.verdict == "regression" for r in rows),
        "improvements": sum(r.verdict == "improvement" for r in rows),
        "changed": sum(r.verdict == "changed" for r in rows),
        "missing_points": {side: [r.point for r in rows if r.verdict == f"missing in {side}"]
                           for side in ("base", "current")},
        "rows": [{k: _finite(v) for k, v in asdict(r).items()} for r in rows],
        "customSmallerIsBetter": smaller,
        "customBiggerIsBetter": bigger,
    }


def _finite(value):
    """Strict JSON has no inf/NaN (a change from a zero base is infinite): write null instead."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def compare(base: str | Path, current: str | Path, *, threshold: float = 0.05, force: bool = False) -> list[Row]:
    """Compare two run directories (or summary.json files); see `compare_runs`."""
    return compare_runs(load_run(base), load_run(current), threshold=threshold, force=force)
