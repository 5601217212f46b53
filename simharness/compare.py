"""Perf-regression gate: compare runs point by point and give each metric a verdict.

Sim-level points are deterministic, so any change beyond float noise is reported and a change
beyond the threshold in the bad direction is a regression (LLMServingSim gates its simulated
clock the same way). Measured runs (hil / real) are judged with the run as the unit of evidence:
with several runs a side (`compare BASE... CURRENT...`, a rolling baseline of the last N runs) a
change is a regression only when it is beyond the threshold and the runs' values differ
(`run_significance`, pooled t-test on logs, alpha split over the families of metrics), and the step
records' figures are gated too (`STEP_METRICS`: device window and busy time and each device phase's, host time per
step and the shares of prep, launch and propose in it, tokens per step; far steadier run to run than latency, and a
phase's own figure says where a change landed); with one run a side that has `repeats: N` the repeats are the
units (`stats.significance`); with one plain run a side the per-request samples are (Mann-Whitney U,
p < 0.01), and a warning says that this cannot tell run-to-run noise from a change. docs/baselines.md
and docs/ci.md ("The GPU gate's statistic") say which test and why, and how the threshold meets the
noise.
The acceptance rate is always compared: a collapse of acceptance is a regression even when latency
looks fine (vLLM #37150). The gate's outputs (Markdown, JSON, JUnit) are in `simharness.gate_report`.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from simharness import stats
from simharness.metrics import HOST_PHASE_METRICS, phase_metric, share_metric
from simharness.pointfiles import read_points
from simharness.records import DEVICE_PHASES
from simharness.results import finished_points, point_dir

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
# Each device phase's time per step, and each host phase's share of the host work where the engine's code runs
# (metrics.HOST_PHASE_METRICS), localize a change to the kernel or host phase that moved, and see one that the step's
# sum hides under its spread (#37238's sampler, #41043's allocations in prep; docs/ci.md "Per-phase step metrics").
DEVICE_PHASE_METRICS = tuple(phase_metric("device", p) for p in DEVICE_PHASES)
# measured levels, with runs or repeats as the units: the step records' figures (engine_metrics). A slower device
# moves its step time by its own size, but TPOT by less (a slower device hides more of the host's time) and under a
# run-to-run spread of TPOT several times that of the step time (docs/ci.md, "The GPU gate's statistic"). The sim
# keeps METRICS' exact verdicts.
STEP_METRICS: dict[str, tuple[bool | None, str]] = {
    "mean_step_ms": (False, "ms"),  # the steps' device windows; gated only between runs of the same steps (SAME_STEPS)
    "mean_device_ms": (False, "ms"),  # the device phases' busy time per step: the same steps only, as above
    **dict.fromkeys(DEVICE_PHASE_METRICS, (False, "ms")),  # the same steps only, as above
    "mean_host_ms_per_step": (False, "ms"),
    **{share_metric(p): (False, "fraction") for p in HOST_PHASE_METRICS},  # not its ms: see metrics.engine_metrics
    "tokens_per_step": (True, "tokens"),
}
# the steps of two runs are alike when these agree (within SAME_STEPS_TOL): a step that does other work (more
# requests, more accepted tokens) takes another device time, which is no regression of the device
SAME_STEPS = ("num_steps", "mean_batch_size", "tokens_per_step")
SAME_STEPS_TOL = 0.005
# what another step's work moves without a regression
SAME_STEPS_METRICS = ("mean_step_ms", "mean_device_ms", *DEVICE_PHASE_METRICS)
DIRECTION = {**METRICS, **STEP_METRICS}  # every metric compare may gate: (bigger is better, unit)
NUMERIC = tuple(dict.fromkeys((*DIRECTION, *SAME_STEPS)))  # the summary columns a side's median is taken of
FLOAT_TOL = 1e-9
P_VALUE = 0.01  # one plain run a side: the Mann-Whitney test on per-request samples
# several runs a side: two-sided, for the whole comparison: split over the families of gated metrics that vary
# (`_Runs`); a regression is a change in the bad direction, so a comparison's false alarms stay near 1%
RUN_ALPHA = 0.02


class CompareError(ValueError):
    """Bad compare input (missing file, nothing in common, runs that cannot be compared)."""


@dataclass
class Run:
    """What compare needs of a run: its scenario name, level, summary rows, raw samples and metadata."""

    path: Path
    scenario: str
    level: str  # "sim" (deterministic) or "hil"/"real" (measured)
    summary: pd.DataFrame
    run_dir: Path | None  # per-request samples live here (absent when given a bare summary.json)
    meta: dict = field(default_factory=dict)
    resolved: dict | None = None  # the run's scenario.yaml (every default spelled out), when there is one
    unfinished: int = 0  # points of its sweep that never finished (a killed run)
    tables: dict[str, pd.DataFrame] | None = None  # per-request samples, once loaded (`_Samples`)


@dataclass
class Row:
    point: str
    metric: str
    base: float
    current: float
    change_pct: float
    # same | changed | improvement | regression | noise, or for a point one side lacks (metric ""): missing in base |
    # missing in current
    verdict: str
    p_value: float | None = None


def load_run(path: str | Path) -> Run:
    """A run directory or its summary.json. A run directory without summary.json (a run killed before it
    combined its points) is read from its finished points, and counts its unfinished ones."""
    path = Path(path)
    if not path.exists():
        raise CompareError(f"{path}: no such file or directory")
    run_dir = path if path.is_dir() else path.parent
    summary_path = path / "summary.json" if path.is_dir() else path
    resolved = _read_yaml(run_dir / "scenario.yaml") if path.is_dir() else None
    unfinished = 0
    if summary_path.is_file():
        rows = _read_json(summary_path)
    elif path.is_dir() and (path / "points").is_dir() and resolved is not None:
        rows, unfinished = _finished_rows(path, resolved)
    else:
        raise CompareError(f"{path}: no summary.json (is it a run directory?)")
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) and "point" in r for r in rows):
        raise CompareError(f"{summary_path}: not a simharness summary (a list of points)")
    points = [r["point"] for r in rows]
    if len(set(points)) != len(points):
        raise CompareError(f"{summary_path}: a point appears more than once")
    meta_path = run_dir / "meta.json"
    meta = _read_json(meta_path) if meta_path.is_file() else {}
    if not isinstance(meta, dict):
        raise CompareError(f"{meta_path}: not a simharness meta.json (a mapping)")
    summary = pd.DataFrame(rows).set_index("point")
    level = str(summary["level"].iloc[0]) if "level" in summary else "sim"
    # a killed run's samples are in its points' tables
    has_samples = (run_dir / "requests.parquet").is_file() or not summary_path.is_file()
    return Run(path, meta.get("scenario", "?"), level, summary, run_dir if has_samples else None, meta, resolved,
               unfinished)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CompareError(f"{path}: not valid JSON ({e})") from None


def _read_yaml(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise CompareError(f"{path}: not valid YAML ({e})") from None
    return data if isinstance(data, dict) else None


def _finished_rows(run_dir: Path, resolved: dict) -> tuple[list[dict], int]:
    """The summary rows of a killed run's finished points, and how many of its sweep's points are missing."""
    rows = [_read_json(point_dir(run_dir, i) / "summary.json") for i in sorted(finished_points(run_dir))]
    sweep = resolved.get("sweep") or {}
    expected = math.prod(len(v) for v in sweep.values() if isinstance(v, list)) * int(resolved.get("repeats", 1))
    if not rows:
        raise CompareError(f"{run_dir}: no point of the run finished (nothing to compare)")
    return rows, max(expected - len(rows), 0)


def load_runs(paths: list[str | Path]) -> list[Run]:
    """Each path's runs: a run directory or summary.json is one run; a directory of run directories (a scenario's
    output folder, `results/<scenario>/`) is every run in it, oldest first."""
    runs = []
    for path in map(Path, paths):
        if path.is_dir() and not _is_run(path):
            inside = sorted(p for p in path.iterdir() if p.is_dir() and _is_run(p))
            if not inside:
                raise CompareError(f"{path}: no summary.json (is it a run directory, or a folder of them?)")
            runs += sorted((load_run(p) for p in inside), key=_written_at)
        else:
            runs.append(load_run(path))
    return runs


def _is_run(path: Path) -> bool:
    return (path / "summary.json").is_file() or (path / "points").is_dir()


def _written_at(run: Run) -> str:
    return str(run.meta.get("written_at") or run.path.name)


def newest(runs: list[Run], last: int | None) -> list[Run]:
    """The `last` most recently written of `runs` (all of them for None): a rolling baseline."""
    if last is None:
        return runs
    if last < 1:
        raise CompareError(f"--last: must be at least 1, got {last}")
    return sorted(runs, key=_written_at)[-last:]


def compare_runs(base: Run | list[Run], current: Run | list[Run], *, threshold: float = 0.05,
                 alpha: float = RUN_ALPHA, force: bool = False) -> list[Row]:
    """Verdicts for every common point and compared metric, and a `missing` row for each point that only one side
    has. Either side may hold several runs (a rolling baseline, or the same tree run again): each point's value is
    then the median over the side's runs, and with more than two runs in all the run is the unit of the test
    (`run_significance`). A run whose scenario is unknown (a bare summary.json with no meta.json beside it) is
    taken to be of the other runs' scenario."""
    bases = base if isinstance(base, list) else [base]
    currents = current if isinstance(current, list) else [current]
    if not math.isfinite(threshold) or threshold <= 0:
        raise CompareError(f"--threshold: must be a finite number > 0, got {threshold}")
    if not 0 < alpha < 1:
        raise CompareError(f"--alpha: must be between 0 and 1, got {alpha}")
    check_comparable(bases, currents, force=force)
    measured = bases[0].level != "sim"
    if len(bases) + len(currents) > 2:
        samples = _Runs(bases, currents, alpha, {**METRICS, **(STEP_METRICS if measured else {})})
        base_run, current_run = samples.medians
    elif stats.REPEAT in bases[0].summary or stats.REPEAT in currents[0].summary:
        samples = _Repeats(bases[0], currents[0])
        base_run, current_run = samples.medians  # a point's repeats are compared as one
    else:
        base_run, current_run = bases[0], currents[0]
        samples = _Samples(base_run, current_run) if measured else None
    common = [p for p in base_run.summary.index if p in current_run.summary.index]
    if not common:
        raise CompareError("the two runs have no sweep point in common")
    if measured and (samples is None or not samples.repeated):
        warnings.warn("measured runs with one sample per point: compare cannot tell run-to-run noise from a change "
                      "(the runs' processes differ by more than their requests do); compare several runs a side "
                      "(`compare BASE... CURRENT...`), or run both with `repeats: N`", stacklevel=2)
    gated = {**METRICS, **(STEP_METRICS if measured and samples is not None and samples.repeated else {})}
    rows = []
    for point in common:
        b, c = base_run.summary.loc[point], current_run.summary.loc[point]
        for metric, (bigger_better, _) in gated.items():
            if metric not in b or metric not in c or pd.isna(b[metric]) or pd.isna(c[metric]):
                continue
            try:
                values = float(b[metric]), float(c[metric])
            except (TypeError, ValueError):
                raise CompareError(f"point {point}: {metric} is not a number") from None
            if metric in SAME_STEPS_METRICS and not _same_steps(b, c):
                bigger_better = None  # other work per step: a diagnostic
            rows.append(_verdict(point, metric, *values, bigger_better, threshold, samples))
    if not rows:
        raise CompareError("the two runs have no compared metric in common (see compare.METRICS)")
    nan = float("nan")
    for lacking, other, name in ((current_run, base_run, "current"), (base_run, current_run, "base")):
        gone = [p for p in other.summary.index if p not in lacking.summary.index]
        rows += [Row(p, "", nan, nan, nan, f"missing in {name}") for p in gone]
    for side, runs in (("base", bases), ("current", currents)):
        for run in runs:
            if run.unfinished and not any(r.verdict == f"missing in {side}" for r in rows):
                rows.append(Row(f"{run.unfinished} unfinished point(s) of {run.path}", "", nan, nan, nan,
                                f"missing in {side}"))
    return rows


def _same_steps(base: pd.Series, current: pd.Series) -> bool:
    """Whether the two sides ran alike steps: the same number, batch size and tokens per step (SAME_STEPS)."""
    for column in SAME_STEPS:
        if column not in base or column not in current:
            return False
        b, c = float(base[column]), float(current[column])
        if not abs(c - b) <= SAME_STEPS_TOL * abs(b):
            return False
    return True


def check_comparable(bases: list[Run], currents: list[Run], *, force: bool = False) -> None:
    """Refuse runs that cannot be compared, in one message: a mix of levels; runs of different scenarios or devices
    (unless `force`); baselines of one side that are not replicates of each other (another resolved scenario, or at
    the deterministic sim level another source tree)."""
    runs = bases + currents
    levels = {r.level for r in runs}
    if len(levels) > 1:
        listing = "; ".join(f"{lv}: {', '.join(str(r.path) for r in runs if r.level == lv)}" for lv in sorted(levels))
        raise CompareError(f"a mix of levels ({listing}); compare runs of one level")
    for key, what in (("scenario", "scenarios"), ("device", "devices")):
        seen = {str(r.meta.get(key)) for r in runs if r.meta.get(key) not in (None, "?")}
        if len(seen) > 1 and not force:
            raise CompareError(f"different {what} ({' vs '.join(sorted(map(repr, seen)))}); pass --force to "
                               "compare anyway")
    for side, group in (("base", bases), ("current", currents)):
        if len(group) < 2:
            continue
        resolved = [r for r in group if r.resolved is not None]
        if any(r.resolved != resolved[0].resolved for r in resolved):
            odd = next(r for r in resolved if r.resolved != resolved[0].resolved)
            raise CompareError(f"the {side} runs are not of one scenario: {odd.path} resolves its scenario "
                               f"differently from {resolved[0].path}")
        digests = {r.meta.get("source_digest") for r in group if r.meta.get("source_digest")}
        if group[0].level == "sim" and len(digests) > 1:
            raise CompareError(f"the {side} runs come from {len(digests)} different source trees (meta.json "
                               "source_digest): a sim run is exact for its tree, so a median over trees means "
                               "nothing; give the runs of one tree")


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


class _Runs:
    """Several runs a side: each run's value of a point is its median over its repeats (if any); a side's value is
    the median over its runs (`medians`), and the runs' values are the samples of `run_significance`. A latency's or
    throughput's spread is at least the median spread of those metrics and of the metric's family (`floor`,
    `_family`: they all carry the host's run-to-run speed); a step metric's is its own. The level `alpha` is split
    over the families of the gated metrics that vary (Bonferroni): the metrics of a family move together, the
    families nearly apart, and a comparison, not a metric, is what raises a false alarm."""

    repeated = True

    def __init__(self, bases: list[Run], currents: list[Run], alpha: float, metrics: dict):
        self.runs = []  # per side: point -> its runs' values (a row per run)
        self.medians = []
        for side in (bases, currents):
            stacked = pd.concat([_per_config(r) for r in side], keys=range(len(side)), names=["run", "point"])
            self.runs.append({p: g.droplevel("point") for p, g in stacked.groupby(level="point", sort=False)})
            medians = stacked.groupby(level="point", sort=False).median()
            self.medians.append(Run(side[0].path, side[0].scenario, side[0].level, medians, None, side[0].meta))
        common = [p for p in self.medians[0].summary.index if p in self.medians[1].summary.index]
        gated = [m for m, (better, _) in metrics.items()
                 if better is not None and all(m in s.summary for s in self.medians)]
        spreads = {(p, m): _pooled_log_variance(*self._samples(p, m)) for p in common for m in gated}
        # a spread within float rounding (FLOAT_TOL) is none: runs that agree to the bit give logs that their mean
        # misses by an ulp
        spreads = {k: v for k, v in spreads.items() if math.isfinite(v) and v > FLOAT_TOL**2}
        self.alpha = alpha / max(len({_family(m) for _, m in spreads}), 1)
        spreads = {k: v for k, v in spreads.items() if k[1] in METRICS}
        overall = float(np.median(list(spreads.values()))) if spreads else 0.0
        # a statistic's family (P99 of every latency at every point, ...) spreads alike: its median spread too
        families: dict[str, list[float]] = {}
        for (_, m), v in spreads.items():
            families.setdefault(_family(m), []).append(v)
        self.floor = {f: max(overall, float(np.median(v))) for f, v in families.items()}
        self.overall = overall

    def _samples(self, point: str, metric: str) -> list[np.ndarray]:
        return [side[point][metric].to_numpy(dtype=np.float64) if point in side and metric in side[point]
                else np.array([]) for side in self.runs]

    def p_value(self, point: str, metric: str) -> float | None:
        floor = self.floor.get(_family(metric), self.overall) if metric in METRICS else 0.0
        return run_significance(*self._samples(point, metric), min_variance=floor)


def _family(metric: str) -> str:
    """The statistic a latency metric (`<stat>_<ttft|tpot|itl|e2el>_ms`) is (mean, median, p90, p99); the throughputs
    are one family; any other metric is a family of its own (`mean_step_ms` is no latency)."""
    if metric.endswith("_throughput"):
        return "throughput"
    stat, kind, unit = (metric.split("_") + ["", ""])[:3]
    return stat if metric.count("_") == 2 and kind in LATENCY and unit == "ms" else metric


def _per_config(run: Run) -> pd.DataFrame:
    """A run's metrics by configuration: the median over its repeats, or its summary as it is."""
    summary = run.summary.reset_index()
    numeric = [m for m in NUMERIC if m in summary]
    values = summary[numeric]
    text = [m for m, dtype in values.dtypes.items() if not pd.api.types.is_numeric_dtype(dtype)]
    if text:  # a value that is no number is NaN: not compared
        values = values.assign(**{m: pd.to_numeric(values[m], errors="coerce") for m in text})
    if stats.REPEAT not in summary:
        return values.set_index(summary["point"])
    return values.groupby(stats.config_ids(summary), sort=False).median()


def _logs(base: np.ndarray, current: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The finite values of each side, as logarithms when all are positive."""
    a = np.asarray(base, dtype=np.float64)
    b = np.asarray(current, dtype=np.float64)
    a, b = a[np.isfinite(a)], b[np.isfinite(b)]
    if len(a) and len(b) and (a > 0).all() and (b > 0).all():
        return np.log(a), np.log(b)
    return a, b


def _pooled_log_variance(base: np.ndarray, current: np.ndarray) -> float:
    """The variance within sides, pooled over both (NaN with fewer than three values in all or a side empty)."""
    a, b = _logs(base, current)
    if len(a) == 0 or len(b) == 0 or len(a) + len(b) < 3:
        return math.nan
    return float((((a - a.mean()) ** 2).sum() + ((b - b.mean()) ** 2).sum()) / (len(a) + len(b) - 2))


def run_significance(base: np.ndarray, current: np.ndarray, *, min_variance: float = 0.0) -> float:
    """Two-sided p-value that runs of two sides differ in location, a run being one value: Student's t-test with
    the variance pooled over both sides, on the logarithms (on the values themselves when one is not positive).
    Pooled, because the runs of one tree on one machine spread alike, and so one new run can be tested against a
    history of several (n + m - 2 degrees of freedom; Welch's test leaves about one with two runs a side). The
    variance is taken as at least `min_variance`: from a few runs a spread can come out small by chance, and would
    then call noise significant. NaN with fewer than three finite runs in all or one side empty; 0 or 1 when no run
    varies and no floor is given."""
    a, b = _logs(base, current)
    pooled = _pooled_log_variance(base, current)
    if math.isnan(pooled):
        return math.nan
    pooled = max(pooled, min_variance)
    diff = b.mean() - a.mean()
    if pooled == 0:
        return 0.0 if diff != 0 else 1.0
    from scipy.stats import t  # scipy.stats takes seconds to import: only when needed

    statistic = diff / math.sqrt(pooled * (1 / len(a) + 1 / len(b)))
    return float(2 * t.sf(abs(statistic), len(a) + len(b) - 2))


class _Repeats:
    """Runs with repeats: each configuration's median over its repeats (`medians`, the runs compare them) and
    the repeats' values, for `stats.significance`."""

    alpha = stats.ALPHA

    def __init__(self, base: Run, current: Run):
        self.groups, self.medians = [], []
        for run in (base, current):
            summary = run.summary.reset_index()
            numeric = [m for m in NUMERIC if m in summary]
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
        for run in (base, current):
            if run.tables is None and run.run_dir is not None:
                run.tables = self._load(run)
        self.tables = [base.tables, current.tables]

    COLUMNS = {
        "requests": ("point", "arrival_s", "first_token_s", "last_token_s", "output_tokens"),
        "emissions": ("point", "request_id", "time_s"),
    }

    @classmethod
    def _load(cls, run: Run) -> dict[str, pd.DataFrame] | None:
        tables = {}
        for name, columns in cls.COLUMNS.items():
            path = run.run_dir / f"{name}.parquet"
            if path.is_file():
                df = _read_parquet(path)
            elif not (run.run_dir / "summary.json").is_file():  # a killed run: its points' tables
                df = _points_table(run, name)
            else:
                return None  # no samples: the threshold alone decides
            if df is None:
                return None
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


def _read_parquet(path: Path) -> pd.DataFrame:
    try:
        return pd.read_parquet(path)
    except Exception as e:  # any unreadable file is bad input
        raise CompareError(f"{path}: cannot read ({e})") from None


def _points_table(run: Run, name: str) -> pd.DataFrame | None:
    """Table `name` of a killed run, from its finished points' files (batches or per-point files, `point` first);
    None where no point has it."""
    try:
        table = read_points(run.run_dir, name)
    except (OSError, ValueError) as e:
        raise CompareError(f"{run.run_dir}: the finished points' {name} table cannot be read ({e})") from None
    return None if table.columns.empty else table


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


def compare(base: str | Path | list[str | Path], current: str | Path | list[str | Path], *, threshold: float = 0.05,
            alpha: float = RUN_ALPHA, last: int | None = None, force: bool = False) -> list[Row]:
    """Compare runs (directories, summary.json files or folders of run directories; a list on either side); the
    baseline is the `last` newest of its runs. See `compare_runs`."""
    bases = load_runs(base if isinstance(base, list) else [base])
    currents = load_runs(current if isinstance(current, list) else [current])
    return compare_runs(newest(bases, last), currents, threshold=threshold, alpha=alpha, force=force)
