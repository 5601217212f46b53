"""Fidelity: every point of a sweep at each level, on the same requests and seed, and each prediction's error.

The real level (wall clock, real overlap) is the reference. Each sweep point runs once at the sim level (it is
deterministic) and `fidelity.runs` times at the measured levels (hil, real); a measured level's value of a
metric is its median over those runs. The relative error of a level at a point is (level - real) / real; per
level and metric the run reports the median and the worst absolute error over the grid, which the scenario's
`fidelity.tolerances` gate (the command exits 1 when one is exceeded). The spread of the real level itself
(max - min over its runs, relative to their median) says how small an error can be told from noise.
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from simharness import results
from simharness.calibration import FitData, point_scenario, read_run
from simharness.executors import ray_stopped
from simharness.jit import loaded_digest
from simharness.levels import LEVELS
from simharness.runner import execute, without_ignored
from simharness.scenario import Point, Scenario, ScenarioError, sweep_points
from simharness.stats import METRICS, REFERENCE, error_stats, error_table


@dataclass
class FidelityResult:
    """A finished fidelity run: where it lives, every run's summary row, the per-point errors, the per-level
    statistics and the tolerances exceeded (empty when the run passes)."""

    run_dir: Path
    summary: pd.DataFrame
    errors: pd.DataFrame
    stats: pd.DataFrame
    violations: list[str]

    @property
    def report(self) -> Path:
        return self.run_dir / "report.md"


def check_levels(sc: Scenario, levels: list[str]) -> None:
    """The levels a fidelity run compares: known names, the real level and at least one other."""
    unknown = [lv for lv in levels if lv not in LEVELS]
    if unknown:
        raise ScenarioError(f"--levels: unknown level {unknown[0]!r}; known: {', '.join(LEVELS)}")
    if REFERENCE not in levels or len(set(levels)) < 2:
        raise ScenarioError("--levels: needs the real level (the reference) and at least one level to check")
    if "engine.level" in sc.sweep:
        raise ScenarioError("sweep.engine.level: a fidelity run chooses the level of each point; do not sweep it")


def fidelity_points(sc: Scenario, levels: list[str]) -> list[Point]:
    """Every sweep point at each level: once at the sim level, `fidelity.runs` times at a measured one. The
    measured levels take turns run by run (hil 0, real 0, hil 1, real 1, ...): a slow spell of the host then
    lands on one run of each level, which the median over runs discards, not on every run of one level."""
    points = []
    measured = [level for level in levels if LEVELS[level].measured]
    for p in sweep_points(sc):
        runs = [(level, 0) for level in levels if not LEVELS[level].measured]
        runs += [(level, run) for run in range(sc.fidelity.runs) for level in measured]
        for level, run in runs:
            scenario = p.scenario.model_copy(deep=True)
            scenario.engine.level = level
            without_ignored(scenario, level)
            point_id = f"level={level},run={run}" + ("" if p.id == "base" else f",{p.id}")
            values = {"config": p.id, "level": level, "run": run, **p.values}
            points.append(Point(id=point_id, index=len(points), values=values, scenario=scenario))
    return points


def sim_checks(sc: Scenario, rows: pd.DataFrame, profiles: dict[str, str], first_index: int = 0) -> list[Point]:
    """Sim points that check a measured run's configurations (`rows`: its summary rows, `config` naming each): one
    per configuration and labelled cost profile (label -> `engine.profile`), the label as the point's level."""
    points = []
    for config, group in rows.groupby("config", sort=False):
        for level, profile in profiles.items():
            scenario = point_scenario(sc, group.iloc[0])
            scenario.engine.level = "sim"
            without_ignored(scenario, "sim")
            scenario.engine.profile = profile
            points.append(Point(id=f"{level},{config}", index=first_index + len(points),
                                values={"config": config, "level": level}, scenario=scenario))
    return points


def run_fidelity(sc: Scenario, out: str | Path = "results/fidelity", *, levels: list[str] | None = None,
                 resume: str | Path | None = None, progress=None, workers: int | str | None = None,
                 ray: str | None = None, retries: int = 2, process_per_point: bool = False) -> FidelityResult:
    """Run `sc` at each of `levels` (default sim, hil, real) into a run directory and write its fidelity report;
    `workers`, `ray`, `retries` and `process_per_point` choose where the points run, as for `simharness.run`."""
    levels = levels or list(LEVELS)
    check_levels(sc, levels)
    try:
        run_dir = execute(sc, fidelity_points(sc, levels), out, resume=resume, progress=progress, workers=workers,
                          ray=ray, retries=retries, process_per_point=process_per_point)
        return write_fidelity(run_dir, levels)
    finally:
        ray_stopped()


def write_fidelity(run_dir: Path, levels: list[str] | None = None) -> FidelityResult:
    """Compute a fidelity run's errors from its finished points and write fidelity.csv/json, plots and report.md;
    a full or read-only disk is bad input (`results.writing`), and the points are kept."""
    sc = results.load_run_scenario(run_dir)
    with results.writing(run_dir, fresh=False):
        summary = results.combine(run_dir)
        steps = results.read_table(run_dir, "steps", columns=STEP_COLUMNS)
        levels = levels or [lv for lv in LEVELS if lv in set(summary["level"])]
        errors = error_table(summary)
        stats = error_stats(errors)
        violations = check_tolerances(stats, sc)
        errors.to_csv(run_dir / "fidelity.csv", index=False)
        facts = {"levels": levels, "stats": stats.to_dict(orient="records"), "violations": violations,
                 "real_spread": spread(summary, REFERENCE).to_dict(orient="records"),
                 "worst_runs": worst_runs(summary, stats).to_dict(orient="records"),
                 "agreement": agreement(summary).to_dict(orient="records"),
                 "real_overhead": overhead(summary, steps).to_dict(orient="records"),
                 "prefill_enqueue": prefill_enqueue(summary, steps).to_dict(orient="records"),
                 "period": period_split(summary, steps).to_dict(orient="records"),
                 "step_kinds": step_kinds(summary, steps).to_dict(orient="records"),
                 "gaps": timeline_gaps(summary, steps).to_dict(orient="records"),
                 "host": host_speed(summary).to_dict(orient="records")}  # fmt: skip
        (run_dir / "fidelity.json").write_text(json.dumps(facts, indent=1, default=float))
        from simharness.fidelity_report import write_fidelity_report  # matplotlib: only when a report is drawn

        write_fidelity_report(run_dir, sc, summary, errors, stats, facts)
    return FidelityResult(run_dir, summary, errors, stats, violations)


def check_tolerances(stats: pd.DataFrame, sc: Scenario) -> list[str]:
    """The scenario's tolerances that the statistics exceed, one line each."""
    exceeded = []
    for level, metrics in sc.fidelity.tolerances.items():
        for metric, tolerance in metrics.items():
            row = stats[(stats["level"] == level) & (stats["metric"] == metric)]
            if row.empty:
                continue  # the level did not run
            for stat, limit in (("median", tolerance.median), ("worst", tolerance.worst)):
                value = float(row[f"{stat}_abs_error"].iloc[0])
                if limit is not None and not value <= limit:
                    exceeded.append(f"{level} {metric}: {stat} error {value:.1%} > {limit:.1%}")
    return exceeded


def spread(summary: pd.DataFrame, level: str) -> pd.DataFrame:
    """Per point, how far a level's runs are apart: (max - min) / median of each metric over its runs."""
    runs = summary[summary["level"] == level].groupby("config", sort=False)[list(METRICS)]
    out = (runs.max() - runs.min()) / runs.median()
    out.insert(0, "runs", runs.size())
    return out.reset_index()


def worst_runs(summary: pd.DataFrame, stats: pd.DataFrame, metric: str = "mean_tpot_ms") -> pd.DataFrame:
    """Per level, its worst point on `metric` and the runs behind that error: the level's values and the real
    level's, and whether their ranges overlap (then the error is within the runs' own scatter, which a host of two
    speeds makes wide: docs/hil.md)."""
    columns = ["level", "config", "error", "level_runs", "real_runs", "overlap"]
    rows = []
    for r in stats[(stats["metric"] == metric) & stats["worst_point"].notna()].itertuples():
        point = summary[summary["config"] == r.worst_point]
        own = point.loc[point["level"] == r.level, metric].tolist()
        real = point.loc[point["level"] == REFERENCE, metric].tolist()
        overlap = bool(own and real and min(own) <= max(real) and min(real) <= max(own))
        rows.append({"level": r.level, "config": r.worst_point, "error": r.worst_abs_error, "level_runs": own,
                     "real_runs": real, "overlap": overlap})
    return pd.DataFrame(rows, columns=columns)


def agreement(summary: pd.DataFrame) -> pd.DataFrame:
    """Per point, whether every hil and real run emitted the same tokens and accepted the same drafts."""
    measured = summary[summary["level"].isin(["hil", "real"])]
    counts = measured.groupby("config", sort=False)[["total_output_tokens", "accepted_tokens"]].nunique()
    return pd.DataFrame({"config": counts.index, "identical": (counts == 1).all(axis=1).to_numpy()})


# the parts of a decode step's time, in the order the engine loop runs them (one after another at depth 1): (start,
# end) columns
PERIOD_PARTS = {"schedule": ("schedule_start", "schedule_end"), "prep": ("prep_start", "prep_end"),
                "launch": ("prep_end", "launch_end"), "device_after_launch": ("launch_end", "gpu_end"),
                "end_to_settle": ("gpu_end", "update_start"), "settle": ("update_start", "propose_end")}
# a step's timestamps in the order a step passes them (`timeline_gaps` breaks ties between steps by it); not the
# device's start, which the levels place differently within the launch (hil where the graph's launch returned, the
# real level at its first event, before the staging: docs/hil.md)
TIMELINE = ["schedule_start", "schedule_end", "prep_start", "prep_end", "launch_end", "gpu_end", "update_start",
            "update_end"]
# the step columns `overhead`, `prefill_enqueue`, `period_split`, `step_kinds` and `timeline_gaps` read
STEP_COLUMNS = ["point", "step", "n_prefill_reqs", *TIMELINE, "gpu_start", "propose_end", "harness_s",
                "gpu_prefill_s"]
# 20 ms: the bound over which hil flags a part as one that may have outlasted its gate (engine/timing.STARVED_S);
# 80 ms: a gate's life on the H100 (docs/hil.md).
ENQUEUE_BOUNDS_MS = (20, 40, 80)


def overhead(summary: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Per point, the real level's own host time per decode step (everything but the engine phases it times),
    median over its decode steps, against the median device step."""
    real = summary.loc[summary["level"] == REFERENCE, ["point", "config"]]
    by_point = dict(tuple(steps[steps["n_prefill_reqs"] == 0].groupby("point", sort=False))) if len(steps) else {}
    rows = []
    for point, config in real.itertuples(index=False):
        s = by_point.get(point)
        device = float((s["gpu_end"] - s["gpu_start"]).median()) if s is not None else np.nan
        harness = float(s["harness_s"].median()) if s is not None else np.nan
        rows.append({"config": config, "point": point, "harness_us": harness * 1e6, "device_us": device * 1e6,
                     "ratio": harness / device if device else np.nan})
    return pd.DataFrame(rows, columns=["config", "point", "harness_us", "device_us", "ratio"])


def prefill_enqueue(summary: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Per measured level, the host's enqueue time of its steps with prefills, per prompt prefilled: the median and
    how many steps took longer than each of ENQUEUE_BOUNDS_MS. It tells how many of hil's "may have outlasted a
    GPU gate" notes came near a gate's life, and whether the real level's host is as slow."""
    columns = ["level", "prefill_steps", "median_ms", *(f"over_{b}ms" for b in ENQUEUE_BOUNDS_MS)]
    if not len(steps):
        return pd.DataFrame(columns=columns)
    level = summary.set_index("point")["level"]
    s = steps[steps["n_prefill_reqs"] > 0]
    s = s.assign(level=s["point"].map(level), ms=(s["launch_end"] - s["prep_end"]) / s["n_prefill_reqs"] * 1e3)
    rows = []
    for lv in [lv for lv in LEVELS if LEVELS[lv].measured and lv in set(s["level"])]:
        ms = s.loc[s["level"] == lv, "ms"]
        rows.append({"level": lv, "prefill_steps": len(ms), "median_ms": float(ms.median()),
                     **{f"over_{b}ms": int((ms > b).sum()) for b in ENQUEUE_BOUNDS_MS}})  # fmt: skip
    return pd.DataFrame(rows, columns=columns)


def period_split(summary: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Per point and level, where a decode-only step's time goes (µs): each of PERIOD_PARTS, the gap from the settle's
    end to the next schedule, the period (schedule start to the next) and the harness's own host time; medians over
    each run's decode-only steps, then over the point's runs. At depth 1 the parts follow one another, so a level's
    part that differs from the real level's says where its time differs; deeper, the host's phases overlap the device
    and the period is the host's cycle, where a long device end → settle says the host came back late (host-bound;
    docs/hil.md)."""
    parts = [*PERIOD_PARTS, "gap", "period", "harness"]
    columns = ["config", "level", "depth", *parts]
    runs = summary if "effective_depth" in summary else summary.iloc[:0]
    if not len(steps) or not len(runs):
        return pd.DataFrame(columns=columns)
    rows = []
    for (config, level, depth), s in _point_steps(runs, steps, ["config", "level", "effective_depth"]):
        times = {name: s[end] - s[start] for name, (start, end) in PERIOD_PARTS.items()}
        following = s["schedule_start"].shift(-1)  # the next step's schedule
        times |= {"gap": following - s["propose_end"], "period": following - s["schedule_start"],
                  "harness": s["harness_s"]}
        decode = s["n_prefill_reqs"] == 0
        rows.append({"config": config, "level": level, "depth": int(depth),
                     **{name: float(t[decode].median()) * 1e6 for name, t in times.items()}})
    table = pd.DataFrame(rows, columns=columns)
    return _sweep_order(table.groupby(["config", "level", "depth"], sort=False)[parts].median().reset_index(), summary)


def step_kinds(summary: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Per point and level, decode-only steps against steps with a prefill chunk: how many a run has, their mean device
    period (one step's device start to the next's, ms), the share of the run's device time in steps with a chunk,
    and the chunks' device time (median `gpu_prefill_s`, ms); medians over the point's runs. A level whose mean TPOT
    differs from the real level's differs in one kind or both (docs/hil.md: hil's bias at depth >= 2 sat in the
    steps with a chunk)."""
    parts = ["decode_steps", "decode_period_ms", "prefill_steps", "prefill_period_ms", "prefill_share", "chunk_ms"]
    columns = ["config", "level", *parts]
    if not len(steps) or not len(summary):
        return pd.DataFrame(columns=columns)
    rows = []
    for (config, level), s in _point_steps(summary, steps, ["config", "level"]):
        period = (s["gpu_start"].shift(-1) - s["gpu_start"]) * 1e3
        chunk = s["n_prefill_reqs"] > 0
        total = period.sum()
        rows.append({"config": config, "level": level, "decode_steps": int((~chunk).sum()),
                     "decode_period_ms": float(period[~chunk].mean()), "prefill_steps": int(chunk.sum()),
                     "prefill_period_ms": float(period[chunk].mean()),
                     "prefill_share": float(period[chunk].sum() / total) if total else np.nan,
                     "chunk_ms": float(s.loc[chunk, "gpu_prefill_s"].median() * 1e3)})  # fmt: skip
    table = pd.DataFrame(rows, columns=columns)
    return _sweep_order(table.groupby(["config", "level"], sort=False)[parts].median().reset_index(), summary)


def timeline_gaps(summary: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Per point, level and pair of events: every step's timestamps (TIMELINE) merged in time order, and the median
    gap from an event to the next one, by the pair they form (`gpu_end → prep_start`: a step's device end to the next
    step's prep), over the gaps between two decode-only steps' events; medians over the point's runs, µs. Where a
    measured level's TPOT differs from the real level's, a gap on the host's critical path differs: stop 49 found
    hil's bias this way (docs/hil.md, "Where hil read back"). `share` is the pair's gaps per decode-only step."""
    columns = ["config", "level", "pair", "gap_us", "share"]
    if not len(steps) or not len(summary):
        return pd.DataFrame(columns=columns)
    rank = {e: i for i, e in enumerate(TIMELINE)}
    rows = []
    for (config, level), s in _point_steps(summary, steps, ["config", "level"]):
        events = s.melt(id_vars=["step", "n_prefill_reqs"], value_vars=TIMELINE, var_name="event", value_name="t")
        events = events.assign(rank=events["event"].map(rank)).sort_values(["t", "rank"], kind="stable")
        decode, nxt = events["n_prefill_reqs"].to_numpy() == 0, events.shift(-1)
        keep = decode & (nxt["n_prefill_reqs"].to_numpy() == 0)  # the last event's next is NaN: dropped too
        gaps = pd.DataFrame({"pair": (events["event"] + " → " + nxt["event"])[keep],
                             "gap": (nxt["t"] - events["t"])[keep] * 1e6})
        n_decode = max(int((s["n_prefill_reqs"] == 0).sum()), 1)
        for pair, g in gaps.groupby("pair", sort=False):
            rows.append({"config": config, "level": level, "pair": pair, "gap_us": float(g["gap"].median()),
                         "share": len(g) / n_decode})
    table = pd.DataFrame(rows, columns=columns)
    table = table.groupby(["config", "level", "pair"], sort=False)[["gap_us", "share"]].median().reset_index()
    return _sweep_order(table, summary)


def _point_steps(runs: pd.DataFrame, steps: pd.DataFrame, fields: list[str]):
    """Each run of `runs` that has step records: its `fields` and its steps in order."""
    by_point = dict(tuple(steps.groupby("point", sort=False)))
    for point, *values in runs[["point", *fields]].itertuples(index=False):
        s = by_point.get(point)
        if s is not None:
            yield values, s.sort_values("step")


def _sweep_order(table: pd.DataFrame, summary: pd.DataFrame) -> pd.DataFrame:
    """`table`'s rows in the sweep's order of points, and the levels in LEVELS' order within each."""
    rank = {**{c: i for i, c in enumerate(dict.fromkeys(summary["config"]))}, **{lv: i for i, lv in enumerate(LEVELS)}}
    return table.sort_values(["config", "level"], key=lambda c: c.map(rank), kind="stable", ignore_index=True)


# a run whose host gauge was this many times slower than the fastest is counted as measured in a slow spell
SLOW_HOST = 1.2


def host_speed(summary: pd.DataFrame) -> pd.DataFrame:
    """Per measured level, the host gauge around its runs (`simharness.hostspeed`): the median and largest slowdown,
    the runs over SLOW_HOST, and the runs measured more than once (`engine.host_slowdown`). Empty for runs made
    before the gauge existed."""
    columns = ["level", "runs", "median_slowdown", "max_slowdown", f"over_{SLOW_HOST}", "measured_again"]
    if "host_slowdown" not in summary:
        return pd.DataFrame(columns=columns)
    rows = []
    for level, runs in summary[summary["level"] != "sim"].groupby("level", sort=False):
        slowdown = runs["host_slowdown"]
        rows.append({"level": level, "runs": len(runs), "median_slowdown": float(slowdown.median()),
                     "max_slowdown": float(slowdown.max()), f"over_{SLOW_HOST}": int((slowdown > SLOW_HOST).sum()),
                     "measured_again": int((runs["host_attempts"] > 1).sum())})  # fmt: skip
    return pd.DataFrame(rows, columns=columns)


# ------------------------------------------------------------------------------------------------ held-out check
# `simharness calibrate --check`: the configurations a fit left out (`fit_where`) at the sim level with and without
# the calibration, and their errors against the measured medians.


def check_calibration(data: FitData, costs: Path, out: Path) -> tuple[pd.DataFrame, Path, str | None]:
    """Run every held-out configuration at the sim level, uncalibrated (`sim`) and with `costs`
    (`sim-calibrated`), into a run directory under `out`; returns their error statistics against the measured
    level's medians (stats.error_stats), the run directory, and `sim_drift`'s warning if any."""
    held = [(run_dir, sc, rows) for run_dir, sc, rows in data.held_out if len(rows)]
    if not held:
        raise ScenarioError("--check: the fit used every point; leave some out with --fit-where")
    points, measured = [], []
    for _run_dir, sc, rows in held:
        for config, group in rows.groupby("config", sort=False):
            for level, calibration in (("sim", None), ("sim-calibrated", str(costs))):
                scenario = point_scenario(sc, group.iloc[0])
                scenario.engine.level = "sim"
                without_ignored(scenario, "sim")  # the measured run's decode-loop fields
                scenario.engine.calibration = None  # the scenario's own, if any, is neither of the two
                if calibration is not None:
                    scenario.engine.gpu = data.gpu
                    scenario.engine.calibration = calibration
                point_id = f"{level},{config}"
                points.append(Point(id=point_id, index=len(points), values={"config": config, "level": level},
                                    scenario=scenario))
        measured.append(rows.assign(level=REFERENCE))  # the reference of error_table
    run_dir = execute(held[0][1], points, out)
    summary = results.combine(run_dir)
    stats = error_stats(error_table(pd.concat([*measured, summary], ignore_index=True)))
    stats.to_csv(run_dir / "check.csv", index=False)
    return stats, run_dir, sim_drift([run for run, _, _ in held], summary[summary["level"] == "sim"])


# What the uncalibrated sim of the check and a run's own sim level are compared on.
DRIFT_METRICS = ("mean_tpot_ms", "p99_tpot_ms", "mean_acceptance_length")


def sim_drift(run_dirs: list[Path], sim: pd.DataFrame) -> str | None:
    """Where a held-out run also ran the sim level uncalibrated (a fidelity run), whether this machine's sim
    (`sim`, the check's) reproduces it. The check rebuilds the run's requests here: with another Python (its
    standard library is the text corpus), numpy (random streams) or source tree they can come out different, and
    the check's errors then include that difference. Returns a warning naming it, or None."""
    mine = sim.set_index("config")[list(DRIFT_METRICS)]
    theirs, metas = [], []
    for run_dir in run_dirs:
        meta, sc, summary = read_run(run_dir)
        if sc.engine.calibration is None and "sim" in set(summary["level"]):
            theirs.append(summary[summary["level"] == "sim"].groupby("config")[list(DRIFT_METRICS)].first())
            metas.append(meta)
    if not theirs:
        return None
    theirs = pd.concat(theirs)
    common = mine.index.intersection(theirs.index)
    change = mine.loc[common] / theirs.loc[common] - 1
    differ = int((change.abs() > 1e-9).any(axis=1).sum())
    if not differ:
        return None
    medians = ", ".join(f"{m} {change[m].median():+.1%}" for m in DRIFT_METRICS)
    run = "; ".join(f"Python {m.get('python')}, numpy {m.get('versions', {}).get('numpy')}, source "
                    f"{str(m.get('source_digest'))[:12]}" for m in metas)
    here = f"Python {platform.python_version()}, numpy {np.__version__}, source {loaded_digest()[:12]}"
    return (f"this machine's sim does not reproduce the run's own sim level in {differ} of {len(common)} held-out "
            f"configurations (median change: {medians}): the requests or the code rebuilt here differ from the "
            f"run's (run: {run}; here: {here}), and the errors above include that difference. Run the check "
            "where the run ran for errors on the same requests.")

