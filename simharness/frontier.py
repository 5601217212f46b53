"""The speculation frontier: per load, the draft length k with the best output throughput and the best mean TPOT,
their gain over k = 0 (no speculation) and the first load at which speculation stops paying; a k schedule derived
from it.

Read only from a run's summary (a sweep over `engine.speculation.k`, with 0, and over concurrency or request rate;
any other swept field, such as the text mix, makes groups of their own), so it works at every level. With repeats
each figure is the median over them with its 95% bootstrap interval (`stats.aggregate`); speculation stops paying
at a load when every k > 0 is worse than k = 0 beyond both intervals (without repeats the intervals are the point).
docs/frontier.md tells how to read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from simharness.results import load_run_scenario
from simharness.scenario import ScenarioError
from simharness.stats import REPEAT, aggregate

K = "engine.speculation.k"
LOADS = ("workload.concurrency", "workload.rate")
THROUGHPUT, TPOT = "output_throughput", "mean_tpot_ms"
# what each metric's best is, and the word for its crossover
METRICS = {THROUGHPUT: ("throughput", max), TPOT: ("tpot", min)}
PLOT_ROW = 3.2  # inches a group's row of panels takes in frontier.png
PLOT_LEGEND = 0.45  # inches of the ks' legend above the rows
PLOT_MARGINS = (0.7, 0.15, 0.55, 0.3)  # left, right, bottom, top inches of a panel: ticks, labels and title


@dataclass(frozen=True)
class Frontier:
    """A sweep's frontier: `table` has a row per group and load (frontier.csv), `points` a row per group, load
    and k (medians and intervals), `crossovers` a row per group (per metric, the first load at which speculation
    stops paying and the first larger one at which it pays again, NaN for none)."""

    load: str  # the swept load path
    groups: list[str]  # the other swept paths
    table: pd.DataFrame
    points: pd.DataFrame
    crossovers: pd.DataFrame


def sweep_axes(swept: list[str]) -> tuple[str, list[str]]:
    """The load path and the group paths of a sweep over k and load; bad input names the missing field."""
    if K not in swept:
        raise ScenarioError(f"sweep.{K}: a frontier needs a sweep over k, with 0 (no speculation) among its values")
    loads = [p for p in LOADS if p in swept]
    if not loads:
        raise ScenarioError(f"sweep.{LOADS[0]} / sweep.{LOADS[1]}: a frontier needs a sweep over the load")
    if len(loads) > 1:
        raise ScenarioError(f"sweep.{LOADS[1]}: a frontier takes one load axis; {LOADS[0]} is swept too")
    return loads[0], [p for p in swept if p not in (K, loads[0], REPEAT)]


def speculation_frontier(summary: pd.DataFrame, swept: list[str]) -> Frontier:
    """The frontier of a run's summary (every repeat a row, as `summary.csv`) whose swept paths are `swept`."""
    load, groups = sweep_axes(swept)
    if "failed" in summary.columns:
        summary = summary[summary["failed"].isna()]
    if summary.empty or K not in summary.columns:
        raise ScenarioError("the run has no finished sweep point yet")
    if not (summary[K] == 0).any():
        raise ScenarioError(f"sweep.{K}: has no finished point at k = 0, the baseline speculation is measured against")
    # the columns the frontier reads: a summary row's hundred others cost most of the aggregation
    points = aggregate(summary[["point", *groups, load, K, THROUGHPUT, TPOT]], [THROUGHPUT, TPOT])
    keep = [*groups, load, K, "repeats"] + [f"{p}{m}" for m in (THROUGHPUT, TPOT) for p in ("", "ci_low.", "ci_high.")]
    points = points[keep].sort_values([*groups, load, K], ignore_index=True)
    rows, crossings = [], []
    for key, group in points.groupby(groups, sort=False) if groups else [((), points)]:
        labels = dict(zip(groups, key if isinstance(key, tuple) else (key,), strict=True))
        per_load = [_load_row(at, load) for _, at in group.groupby(load, sort=True)]
        rows += [{**labels, **row} for row in per_load]
        crossings.append({**labels, **{column: value for name, _ in METRICS.values()
                                      for column, value in _crossover(per_load, load, name).items()}})
    return Frontier(load, groups, pd.DataFrame(rows), points, pd.DataFrame(crossings))


def _load_row(at: pd.DataFrame, load: str) -> dict[str, object]:
    """One load's frontier: per metric the best k, its median and interval, its gain over k = 0 in % (throughput
    gained, TPOT saved) and whether some k > 0 is not worse than k = 0 beyond the intervals (speculation pays)."""
    row: dict[str, object] = {load: at[load].iloc[0], "repeats": int(at["repeats"].min())}
    base = at[at[K] == 0]
    spec = at[at[K] > 0]
    for metric, (name, best) in METRICS.items():
        pick = at.loc[at[metric].idxmax() if best is max else at[metric].idxmin()]
        row[f"best_k_{name}"] = int(pick[K])
        row[name] = pick[metric]
        row[f"{name}_ci_low"], row[f"{name}_ci_high"] = pick[f"ci_low.{metric}"], pick[f"ci_high.{metric}"]
        if base.empty:
            row[f"{name}_k0"] = row[f"{name}_gain_pct"] = math.nan
            row[f"{name}_pays"] = None
            continue
        b = base.iloc[0]
        row[f"{name}_k0"] = b[metric]
        sign = 1 if best is max else -1
        row[f"{name}_gain_pct"] = sign * (pick[metric] / b[metric] - 1) * 100 + 0.0  # no -0.0
        # worse beyond the intervals: the k's interval lies wholly on the bad side of k = 0's
        if best is max:
            worse = spec[f"ci_high.{metric}"] < b[f"ci_low.{metric}"]
        else:
            worse = spec[f"ci_low.{metric}"] > b[f"ci_high.{metric}"]
        row[f"{name}_pays"] = not bool(worse.all()) if len(spec) else None
    return row


def _crossover(rows: list[dict[str, object]], load: str, name: str) -> dict[str, float]:
    """The smallest load at which speculation stops paying (`crossover_<name>`) and the smallest larger one at
    which it pays again (`pays_again_<name>`); NaN for none."""
    stops = [row[load] for row in rows if row[f"{name}_pays"] is False]
    crossover = stops[0] if stops else math.nan
    again = [row[load] for row in rows if stops and row[load] > crossover and row[f"{name}_pays"]]
    return {f"crossover_{name}": crossover, f"pays_again_{name}": again[0] if again else math.nan}


def crossover_text(row: dict, name: str) -> str:
    """A group's crossover in words: `64`, `64 (pays again at 256)` or `none`."""
    at, again = row[f"crossover_{name}"], row[f"pays_again_{name}"]
    if not np.isfinite(at):
        return "none"
    return f"{at:g}" + (f" (pays again at {again:g})" if np.isfinite(again) else "")


def group_label(row: pd.Series | dict, groups: list[str]) -> str:
    """A group's label from its swept values (`kinds={'free': 1.0}`), or `all` when nothing else is swept."""
    return ", ".join(f"{g.rsplit('.', 1)[-1]}={row[g]}" for g in groups) or "all"


def derive_k_schedule(fr: Frontier, summary: pd.DataFrame) -> dict[str, dict[int, int]]:
    """Per group, a k schedule ({batch size: k}, `engine.speculation.k_schedule`): each load's best-throughput k
    for the batch sizes nearer to that load's than to its neighbours' on a log scale (from the geometric mean of
    its batch size and the previous load's), so that a batch a little under a load's size (a request between
    two of a closed loop's) keeps that load's k. A closed loop's batch size is its concurrency; under a request
    rate, the mean batch size the k = 0 point measured. Equal neighbours merge; the first size is 1."""
    schedules = {}
    for _, rows in fr.table.groupby(fr.groups, sort=False) if fr.groups else [((), fr.table)]:
        sizes = [_batch_size(fr, summary, row) for _, row in rows.iterrows()]
        schedule: dict[int, int] = {}
        for i, k in enumerate(rows["best_k_throughput"]):
            start = 1 if i == 0 else max(math.ceil(math.sqrt(sizes[i - 1] * sizes[i])), max(schedule) + 1)
            if not schedule or k != list(schedule.values())[-1]:
                schedule[start] = int(k)
        schedules[group_label(rows.iloc[0], fr.groups)] = schedule
    return schedules


def schedule_vs_fixed(fr: Frontier, group: str, scheduled: pd.DataFrame) -> pd.DataFrame:
    """A k schedule's run over the frontier's loads (`scheduled`: its summary, every repeat a row) against the
    fixed k of the frontier's group labelled `group`: per load, the schedule's throughput (median, interval), the
    best fixed k's, the gap to it in % and the fixed ks the schedule beats or ties (its median at least theirs)."""
    if fr.load not in scheduled.columns:
        raise ScenarioError(f"sweep.{fr.load}: the schedule's run must sweep the frontier's load")
    labels = [group_label(row, fr.groups) for _, row in fr.points.iterrows()]
    points = fr.points[[label == group for label in labels]]
    if points.empty:
        raise ScenarioError(f"no frontier group {group!r}; groups: {', '.join(sorted(set(labels)))}")
    runs = aggregate(scheduled, [THROUGHPUT]).set_index(fr.load)
    rows = []
    for load, fixed in points.groupby(fr.load, sort=True):
        if load not in runs.index:
            continue
        best = fixed.loc[fixed[THROUGHPUT].idxmax()]
        s = runs.loc[load]
        rows.append({"group": group, fr.load: load, "schedule": s[THROUGHPUT],
                     "schedule_ci_low": s[f"ci_low.{THROUGHPUT}"], "schedule_ci_high": s[f"ci_high.{THROUGHPUT}"],
                     "best_fixed_k": int(best[K]), "best_fixed": best[THROUGHPUT],
                     "gap_pct": (s[THROUGHPUT] / best[THROUGHPUT] - 1) * 100,
                     "beats_k": " ".join(str(int(k)) for k in fixed[K][fixed[THROUGHPUT] <= s[THROUGHPUT]])})
    return pd.DataFrame(rows)


def _batch_size(fr: Frontier, summary: pd.DataFrame, row: pd.Series) -> int:
    if fr.load == LOADS[0]:
        return int(row[fr.load])
    at = summary[(summary[fr.load] == row[fr.load]) & (summary[K] == 0)]
    for g in fr.groups:
        at = at[at[g] == row[g]]
    return max(1, round(float(at["mean_batch_size"].median())))


def plot_frontier(fr: Frontier, path: Path) -> None:
    """TPOT and output throughput against load, a line per k (whiskers: intervals over repeats), one row of two
    panels per group, the ks' legend once above them (every panel draws k in the same style); a dotted line
    marks the crossover of each panel's metric, named in the panel's own legend. Laid out by fixed margins."""
    from matplotlib.figure import Figure  # ~0.5 s that `import simharness` (and a worker process) skips

    groups = [pts for _, pts in fr.points.groupby(fr.groups, sort=False)] if fr.groups else [fr.points]
    width, height = 10.0, PLOT_ROW * len(groups) + PLOT_LEGEND
    fig = Figure(figsize=(width, height))
    panels = [(TPOT, "tpot", "mean TPOT (ms)"), (THROUGHPUT, "throughput", "output throughput (tok/s)")]
    left, right, bottom, top = PLOT_MARGINS
    loads = np.unique(fr.points[fr.load].to_numpy(dtype=float))
    for row, (pts, crossing) in enumerate(zip(groups, fr.crossovers.to_dict("records"), strict=True)):
        title = group_label(pts.iloc[0], fr.groups)
        ks, x, repeats = pts[K].to_numpy(), pts[fr.load].to_numpy(dtype=float), pts["repeats"].to_numpy()
        y0 = height - PLOT_LEGEND - (row + 1) * PLOT_ROW + bottom  # rows from the top
        for column, (metric, name, ylabel) in enumerate(panels):
            ax = fig.add_axes(((column * width / 2 + left) / width, y0 / height, (width / 2 - left - right) / width,
                               (PLOT_ROW - bottom - top) / height))
            y = pts[metric].to_numpy(dtype=float)
            err = np.abs(np.vstack([y - pts[f"ci_low.{metric}"], pts[f"ci_high.{metric}"] - y]))
            for k in np.unique(ks):  # points are sorted by load within each k
                line = ks == k
                style = dict(marker="o", markersize=3, label=f"k={k}", color="black" if k == 0 else None,
                             linestyle="--" if k == 0 else "-")
                if repeats[line].max() > 1:
                    ax.errorbar(x[line], y[line], yerr=err[:, line], capsize=2, **style)
                else:
                    ax.plot(x[line], y[line], **style)
            if row == 0 and column == 0:
                handles, labels = ax.get_legend_handles_labels()
                fig.legend(handles, labels, loc="upper center", ncols=-(-len(labels) // 2), fontsize=7,
                           frameon=False)
            at = crossing[f"crossover_{name}"]
            if np.isfinite(at):
                ax.legend(handles=[ax.axvline(at, color="tab:red", linestyle=":", label=f"stops paying ({at:g})")],
                          fontsize=7)
            ax.set_xscale("log", base=2)
            ax.set_xticks(loads, [f"{v:g}" for v in loads])  # the loads, as the metric plots label them
            ax.minorticks_off()
            ax.set_xlabel(fr.load.rsplit(".", 1)[-1])
            ax.set_ylabel(ylabel)
            ax.set_title(title, fontsize=9, y=1.0)  # where it goes anyway; placed, it is not measured at each draw
            ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110)


def frontier_markdown(fr: Frontier, schedules: dict[str, dict[int, int]]) -> str:
    """The report's frontier section: the crossovers, the per-load table and the derived k schedules."""
    lines = ["| group | stops paying: throughput | stops paying: TPOT | derived k_schedule |", "|---|--:|--:|---|"]
    for row in fr.crossovers.to_dict("records"):
        label = group_label(row, fr.groups)
        cells = [crossover_text(row, m) for m in ("throughput", "tpot")]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | `{schedules[label]}` |")
    load = fr.load.rsplit(".", 1)[-1]
    table = ["| group | " + load + " | best k (tok/s) | tok/s | gain vs k=0 | best k (TPOT) | TPOT ms | TPOT saved |",
             "|---|--:|--:|--:|--:|--:|--:|--:|"]
    for row in fr.table.to_dict("records"):
        table.append(f"| {group_label(row, fr.groups)} | {row[fr.load]:g} | {row['best_k_throughput']} | "
                     f"{_interval(row, 'throughput', '{:.0f}')} | {row['throughput_gain_pct']:+.1f}% | "
                     f"{row['best_k_tpot']} | {_interval(row, 'tpot', '{:.3f}')} | {row['tpot_gain_pct']:+.1f}% |")
    return "\n".join([
        "\n## Speculation frontier\n",
        f"Per {load}, the k with the best output throughput and the best mean TPOT (medians over repeats, 95% "
        "intervals in brackets where there are repeats) and their gain over k = 0; speculation stops paying at the "
        "first load where every k > 0 is worse than k = 0 beyond the intervals (a larger load where some k pays "
        "again is named). `frontier.csv` holds the table; the derived schedule gives each load's best-throughput "
        "k to the batch sizes nearest it (from the geometric mean of its batch size and the previous load's).\n",
        *lines, "", *table, "", "![Frontier](plots/frontier.png)\n",
    ])


def _interval(row: dict, name: str, fmt: str) -> str:
    text = fmt.format(row[name])
    if row["repeats"] > 1:
        text += f" [{fmt.format(row[f'{name}_ci_low'])}, {fmt.format(row[f'{name}_ci_high'])}]"
    return text


def write_frontier(run_dir: Path) -> tuple[Frontier, dict[str, dict[int, int]]]:
    """Compute a run's frontier from its summary.csv; write frontier.csv and plots/frontier.png."""
    run_dir = Path(run_dir)
    scenario = load_run_scenario(run_dir)
    swept = list(scenario.sweep)
    sweep_axes(swept)  # bad input before reading anything
    try:
        summary = pd.read_csv(run_dir / "summary.csv", dtype={"note": str, "failed": str})
    except (OSError, pd.errors.EmptyDataError):
        raise ScenarioError(f"{run_dir}: no summary.csv with finished points yet") from None
    fr = speculation_frontier(summary, swept)
    schedules = derive_k_schedule(fr, summary)
    fr.table.to_csv(run_dir / "frontier.csv", index=False)
    (run_dir / "plots").mkdir(exist_ok=True)
    plot_frontier(fr, run_dir / "plots" / "frontier.png")
    return fr, schedules


def frontier_section(run_dir: Path) -> str:
    """The report's hook: the frontier section of a run that sweeps k and load (writing its csv and plot), or
    nothing for any other run."""
    swept = list(load_run_scenario(run_dir).sweep)
    if K not in swept or not any(p in swept for p in LOADS):
        return ""
    try:
        return frontier_markdown(*write_frontier(run_dir))
    except ScenarioError as e:
        return f"\n## Speculation frontier\n\nNot drawn: {e}\n"
