"""The run report: `report.md` with a summary table, PNG plots and the host sync points.

Rendered only from the files of a run directory (scenario.yaml, summary.csv, meta.json and the points' steps,
syncs and device_syncs under points/), so `simharness report RUN_DIR` can redo it at any time, and a run renders
it while the run-level tables are being combined. It writes the Perfetto traces of the points its timeline
draws (`trace.write_traces` writes any other's). A "mode" is one combination of the
swept values other than concurrency; plots draw one line per mode against concurrency when concurrency
is swept, and bars per point otherwise. Points measured on hardware (hil) add two sections: the
synchronizing CUDA operations caught, and measured vs modelled.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from matplotlib import rcParams
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from simharness import profile
from simharness.frontier import frontier_section
from simharness.levels import LEVELS
from simharness.metrics import host_intervals
from simharness.modes import OUTPUT_READBACK
from simharness.pointfiles import point_tables, read_points
from simharness.records import DEVICE_PHASE_COLUMNS, DEVICE_PHASES
from simharness.results import load_run_scenario
from simharness.scenario import Scenario, sweep_points
from simharness.stats import REPEAT, aggregate
from simharness.trace import write_traces

CONCURRENCY = "workload.concurrency"
# Timeline colours: host phases, avoidable syncs in red, the by-design output wait in grey.
HOST_COLORS = {
    "gc": ("GC pause", "tab:purple"),
    "schedule": ("schedule", "tab:blue"),
    "prep": ("prep", "tab:orange"),
    "launch": ("launch", "tab:olive"),
    "update": ("update", "tab:green"),
    "propose": ("propose (ngram_cpu)", "tab:brown"),
    "sync": ("sync wait", "tab:red"),
    "readback": ("wait for output", "silver"),
}
GPU_COLORS = ("slategray", "lightslategray")  # alternate so back-to-back steps stay distinct
MARKERS = "os^Dv<>p"
LINESTYLES = ("-", "--", ":", "-.")
LEGEND_ROWS = 18  # legend entries a column holds beside a plot 4 inches tall
DPI = 110
PANEL = (5.5, 4.0)  # inches a metric plot's panel takes, margins included
PANEL_MARGINS = (0.85, 0.15, 0.55, 0.15)  # left, right, bottom, top inches of a panel: ticks and labels
LEGEND_GAP = 0.1  # inches between the last panel and the legend beside it
TIMELINE_MARGINS = (0.45, 0.15, 0.5, 0.55, 0.3)  # left, right, bottom, top (legend) inches and between panels (title)
TIMELINE_PANELS = 8  # at most this many timelines (a panel each, 1.3 inches tall), evenly spaced over the points


def write_report(run_dir: Path) -> Path:
    """Render `run_dir/report.md` and `run_dir/plots/*.png`; return the report's path."""
    run_dir = Path(run_dir)
    scenario = load_run_scenario(run_dir)
    path = run_dir / "report.md"
    summary = _read_summary(run_dir, scenario)
    failed = _failed_section(summary)
    if failed:
        summary = summary[summary["failed"].isna()].reset_index(drop=True)
    if summary.empty:
        path.write_text(_header(run_dir, scenario, []) + "\nNo finished sweep points yet.\n" + failed)
        return path
    points = pa.array(summary["point"], pa.string())
    recorded, steps_of, measured = _step_index(run_dir, points)
    by_concurrency = CONCURRENCY in scenario.sweep
    where, timeline_rows = _timeline_points(summary, by_concurrency)
    hil = _hil_points(summary, measured)
    steps = read_points(run_dir, "steps", points={*timeline_rows["point"], *hil})
    syncs = read_points(run_dir, "syncs", points={*timeline_rows["point"], *hil})
    write_traces(run_dir, set(timeline_rows["point"]))
    plots = run_dir / "plots"
    plots.mkdir(exist_ok=True)
    _plot_metrics(summary, by_concurrency, plots)
    n = scenario.report.timeline_steps
    _plot_timeline(timeline_rows, steps, syncs, n, plots / "timeline.png")
    text = "\n".join([
        _header(run_dir, scenario, list(summary["point"])),
        "## Summary\n",
        _summary_table(summary),
        "Latencies in ms with `vllm bench serve` definitions: TPOT per request without the first token, ITL per "
        "streamed chunk pooled over requests, percentiles linearly interpolated. Accept % = accepted / draft "
        "tokens, accept len = 1 + accepted / drafts. Syncs/step include the by-design output readback.\n",
        "## Plots\n",
        "![TPOT](plots/tpot.png)\n",
        "![Output throughput](plots/throughput.png)\n",
        "![GPU busy](plots/gpu_busy.png)\n",
        "## Timeline\n",
        f"{n} consecutive steps from about a third into the run{where}, one panel per mode. Host lane: sync waits "
        "in red, the wait for a step's output in grey; gaps in the GPU lane are bubbles. These points' Perfetto "
        "traces are in `traces/` (`simharness.trace.write_traces(RUN_DIR)` writes every point's).\n",
        "![Timeline](plots/timeline.png)\n",
        "## Speculation\n",
        _speculation_table(summary),
        "## Host sync points\n",
        _sync_table(summary, run_dir, points, recorded, steps_of),
    ])
    if hil:
        device_syncs = read_points(run_dir, "device_syncs", points=set(hil))
        device_syncs = device_syncs if len(device_syncs.columns) else None
        text += "\n".join([
            "\n## Device sync sites\n",
            _device_sync_table(summary, steps, device_syncs, hil),
            "## Measured vs modelled\n",
            _measured_table(summary, steps, hil),
        ])
    text += frontier_section(run_dir)  # a sweep over k and load only (simharness.frontier, issue 31)
    path.write_text(text + failed)
    return path


def _failed_section(summary: pd.DataFrame) -> str:
    """The points that failed after their retries, with the reason; empty when none did."""
    if "failed" not in summary.columns or summary["failed"].isna().all():
        return ""
    rows = [[r["label"], str(r["failed"])] for _, r in summary[summary["failed"].notna()].iterrows()]
    return "\n## Failed points\n\n" + _markdown_table(["point", "reason"], rows) + (
        "\nEach failed on every try (see `points/*.failed.json` for the traceback); `--resume` runs them again.\n"
    )


# --------------------------------------------------------------------------------------------
# inputs


def _read_summary(run_dir: Path, scenario: Scenario) -> pd.DataFrame:
    """summary.csv with two label columns: `label` (all swept values) and `mode` (all but concurrency)."""
    try:
        summary = pd.read_csv(run_dir / "summary.csv", dtype={"note": str, "failed": str})
    except pd.errors.EmptyDataError:
        return pd.DataFrame()
    if summary.empty:
        return summary
    summary = summary.sort_values("index", ignore_index=True)
    # a run whose every point failed has only the failed records' columns
    summary["note"] = summary["note"].fillna("") if "note" in summary else ""
    if REPEAT in summary:
        summary = _collapse_repeats(run_dir, summary, scenario)
    paths = list(scenario.sweep)
    rows = summary[[*paths, *(["effective_depth"] if "effective_depth" in summary else [])]].to_dict("records")
    summary["label"] = [point_label(row, paths) or scenario.name for row in rows]
    others = [p for p in paths if p != CONCURRENCY]
    summary["mode"] = [point_label(row, others) or scenario.name for row in rows]
    return summary


def _collapse_repeats(run_dir: Path, summary: pd.DataFrame, scenario: Scenario) -> pd.DataFrame:
    """A run with repeats: one row per configuration, each metric its median over the repeats with a 95%
    bootstrap interval (`ci_low.<metric>`, `ci_high.<metric>`), also written to `summary_median.csv`. The row keeps its
    first repeat's point, whose steps the timeline draws."""
    fixed = {"index", REPEAT, "effective_depth", *scenario.sweep}
    metrics = [c for c in summary.columns if c not in fixed and pd.api.types.is_numeric_dtype(summary[c])]
    collapsed = aggregate(summary, metrics)
    collapsed.to_csv(run_dir / "summary_median.csv", index=False)
    return collapsed


def point_label(row: pd.Series | dict, paths: list[str]) -> str:
    """A short label from swept values: strings as they are, others as `name=value`
    (`depth=2, ngram_gpu, optimistic`); a depth the engine fell back from shows `depth=2→1`."""
    parts = []
    effective = row.get("effective_depth")  # none for a failed point
    for path in paths:
        value = row[path]
        name = path.rsplit(".", 1)[-1]
        if path == "scheduler.depth" and pd.notna(effective) and effective != value:
            parts.append(f"depth={value}→{row['effective_depth']}")
        elif isinstance(value, str):
            parts.append(value)
        else:
            parts.append(f"{name}={value}")
    return ", ".join(parts)


def _tail_key(summary: pd.DataFrame, metric: str) -> tuple[str, str] | None:
    """The highest percentile column of a latency metric, e.g. ('p99_tpot_ms', 'P99')."""
    found = [(float(m.group(1)), c) for c in summary.columns if (m := re.fullmatch(rf"p([\d.]+)_{metric}_ms", c))]
    if not found:
        return None
    _, key = max(found)
    return key, "P" + key.split("_")[0][1:]


# --------------------------------------------------------------------------------------------
# markdown


def _header(run_dir: Path, scenario: Scenario, finished: list[str]) -> str:
    meta_path = run_dir / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    total = math.prod(len(values) for values in scenario.sweep.values()) * scenario.repeats
    # the finished points are points of the sweep: all there when as many (no need to expand the sweep)
    done = set(finished)
    missing = [] if len(done) == total else [p.id for p in sweep_points(scenario) if p.id not in done]
    count = f"{len(finished)} of {total} points" if missing else f"{total} point(s)"
    run = f"Run `{run_dir.name}` of scenario `{scenario.name}`, seed {scenario.seed}, {count}"
    if scenario.repeats > 1:
        run += (f", each run {scenario.repeats} times (seeds {scenario.seed}…{scenario.seed + scenario.repeats - 1}): "
                "values are medians over the repeats, [low, high] their 95% bootstrap interval, error bars the same")
    if meta.get("device"):
        run += f"; device: {meta['device']}"
    if meta.get("git_revision"):
        run += f"; git `{meta['git_revision'][:12]}`" + (" with changes" if meta.get("git_modified") else "")
    if meta.get("source_digest"):
        run += f"; source digest `{meta['source_digest'][:12]}`"
    e, spec, s, w = scenario.engine, scenario.engine.speculation, scenario.scheduler, scenario.workload
    # the sim level models a named GPU; a measured level runs on engine.device (a CPU run is not "on H100")
    sim = LEVELS[e.level].backend == "model"
    where = f"a modelled {e.gpu}" if sim else f"`{e.device}`"
    setup = (
        f"**Setup:** `{e.model}` on {where} ({e.level} level); proposer `{spec.proposer}`, k={spec.k}, "
        f"acceptance `{spec.acceptance.model}`, invalid slots `{spec.invalid_slots}`; scheduler depth {s.depth}, "
        f"policy `{s.policy}`; workload `{w.arrival}`, concurrency {w.concurrency}, {w.total_requests} requests."
    )
    setup += f"\n\n**Sim cost profile:** {profile.describe(e)}." if sim else ""
    if scenario.sweep:
        axes = " × ".join(f"`{p}` ∈ {{{', '.join(str(v) for v in vs)}}}" for p, vs in scenario.sweep.items())
        swept = f"**Swept:** {axes} (swept values replace the setup's)."
    else:
        swept = "**Swept:** nothing (one point)."
    text = f"# simharness report: {scenario.name}\n\n{run}.\n\n{setup}\n\n{swept}\n"
    if missing:
        text += (f"\n**Incomplete:** {len(missing)} point(s) missing (an interrupted run; `simharness run SCENARIO "
                 f"--resume {run_dir}` finishes it): {', '.join(f'`{p}`' for p in missing)}.\n")
    return text


def _summary_table(summary: pd.DataFrame) -> str:
    cols = [
        ("eff. depth", "effective_depth", "{:.0f}"),
        ("mean TPOT", "mean_tpot_ms", "{:.2f}"),
        *_tail_column(summary, "tpot", "TPOT", "{:.2f}"),
        ("mean TTFT", "mean_ttft_ms", "{:.1f}"),
        *_tail_column(summary, "ttft", "TTFT", "{:.1f}"),
        *_tail_column(summary, "itl", "ITL", "{:.2f}"),
        ("out tok/s", "output_throughput", "{:,.0f}"),
        ("accept %", "acceptance_rate", "{:.1f}"),
        ("accept len", "mean_acceptance_length", "{:.2f}"),
        ("GPU busy %", "gpu_busy_pct", "{:.1f}"),
        ("bubble ms/step", "mean_bubble_ms", "{:.3f}"),
        ("syncs/step", "syncs_per_step", "{:.2f}"),
        ("wasted slots", "wasted_slots", "{:,.0f}"),
    ]
    drafted = summary["num_drafts"] > 0  # without drafts acceptance is undefined (vLLM reports 0)
    table = summary.assign(gpu_busy_pct=summary["gpu_busy_fraction"] * 100,
                           acceptance_rate=summary["acceptance_rate"].where(drafted),
                           mean_acceptance_length=summary["mean_acceptance_length"].where(drafted))
    rows = [
        [row["label"], *(_cell(row.get(key), fmt, row.get(f"ci_low.{key}"), row.get(f"ci_high.{key}"))
                         for _, key, fmt in cols), row["note"]]
        for row in table.to_dict("records")
    ]
    return _markdown_table(["point", *(h for h, _, _ in cols), "notes"], rows)


def _tail_column(summary: pd.DataFrame, metric: str, header: str, fmt: str) -> list[tuple[str, str, str]]:
    tail = _tail_key(summary, metric)
    return [] if tail is None else [(f"{tail[1]} {header}", tail[0], fmt)]


def _speculation_table(summary: pd.DataFrame) -> str:
    """Real drafts against the placeholder slots an async scheduler reserves, and per-position acceptance."""
    drafted = summary[summary["num_drafts"] > 0]
    if drafted.empty:
        return "No drafts (speculation off).\n"
    k = max(int(c.rsplit("_", 1)[1]) + 1 for c in summary.columns if c.startswith("acceptance_rate_pos_"))
    rows = [
        [row["label"], _cell(row["num_drafts"], "{:,.0f}"), _cell(row["draft_tokens"], "{:,.0f}"),
         _cell(row["scheduled_draft_tokens"], "{:,.0f}"), _cell(row["acceptance_rate"], "{:.1f}"),
         _cell(100 * row["accepted_tokens"] / row["scheduled_draft_tokens"], "{:.1f}"),
         " / ".join(_cell(row.get(f"acceptance_rate_pos_{i}"), "{:.2f}") for i in range(k))]
        for row in drafted.to_dict("records")
    ]
    headers = ["point", "drafts", "draft tokens", "scheduled slots", "accept %", "accept % of scheduled",
               "acceptance by position"]
    return _markdown_table(headers, rows) + (
        "\nScheduled slots are the drafts the scheduler reserved (k placeholders per decoding request under "
        "async scheduling); rating acceptance against them is what dilutes vLLM's reported rate (issue #37150).\n"
    )


def _sync_table(summary: pd.DataFrame, run_dir: Path, points: pa.Array, recorded: pa.Array,
                steps_of: dict[str, int]) -> str:
    """Per mode, over all its points: how often each sync point fires per step and how long it waits. One file of
    the points' syncs in memory at a time: a large sweep's need not fit."""
    keys = ["name", "phase", "waits_for"]
    mode_of = dict(zip(summary["point"], summary["mode"], strict=True))
    parts = []
    for s in point_tables(run_dir, "syncs", ["step", *keys, "start_s", "end_s"], set(mode_of)):
        # recorded steps only, as in metrics; aggregated in Arrow (a point's syncs are many rows of a few names)
        s = s.filter(pc.is_in(_step_keys(s, points), value_set=recorded))
        wait_us = pc.multiply(pc.subtract(s["end_s"], s["start_s"]), 1e6)
        g = pa.table([s["point"], *(s[k] for k in keys), wait_us], names=["point", *keys, "wait_us"])
        g = g.group_by(["point", *keys], use_threads=False).aggregate([("wait_us", "count"), ("wait_us", "sum")])
        parts.append(g.to_pandas())
    found = pd.concat(parts) if parts else pd.DataFrame()
    if found.empty:
        return "No host syncs recorded.\n"
    found["mode"] = found["point"].map(mode_of)
    g = found.groupby(["mode", *keys], sort=False, dropna=False)[["wait_us_count", "wait_us_sum"]].sum()
    order = {m: i for i, m in enumerate(dict.fromkeys(summary["mode"]))}
    g = g.iloc[np.argsort([order[m] for m in g.index.get_level_values(0)], kind="stable")]
    g.columns = ["size", "sum"]
    mode_of = summary.set_index("point")["mode"]
    steps_per_mode = pd.Series(steps_of, dtype=np.int64).groupby(mode_of).sum()
    rows = []
    for (mode, name, phase, waits_for), r in g.iterrows():
        n_steps = steps_per_mode.get(mode, 0)
        rows.append([mode, f"`{name}`", phase, waits_for, _cell(r["size"] / n_steps if n_steps else np.nan, "{:.2f}"),
                     _cell(r["sum"] / r["size"], "{:.1f}"), _cell(r["sum"] / n_steps if n_steps else np.nan, "{:.1f}")])
    if not rows:
        return "No host syncs recorded.\n"
    headers = ["mode", "sync point", "phase", "waits for", "count/step", "mean wait µs", "wait µs/step"]
    return _markdown_table(headers, rows) + "\nOver all points of each mode.\n"


def _step_index(run_dir: Path, points: pa.Array) -> tuple[pa.Array, dict[str, int], set[str]]:
    """The recorded steps of `points` (their `_step_keys`), each point's number of them, and the points whose
    steps have measured device phases (hil)."""
    tables = list(point_tables(run_dir, "steps", ["step", "gpu_verify_s"]))
    if not tables:
        return pa.array([], pa.int64()), {}, set()
    steps = pa.concat_tables(tables, promote_options="permissive")
    counts = steps.group_by("point", use_threads=False).aggregate([("step", "count")])
    measured = set()
    if "gpu_verify_s" in steps.column_names:
        measured = set(pc.unique(steps.filter(pc.is_valid(steps["gpu_verify_s"]))["point"]).to_pylist())
    return (_step_keys(steps, points), dict(zip(counts["point"].to_pylist(), counts["step_count"].to_pylist(),
                                                strict=True)), measured)


def _step_keys(table: pa.Table, points: pa.Array) -> pa.Array:
    """Each row's (point, step) as one integer, to match rows of two tables: the point's place in `points` (null
    for another point) above the step's 32 bits."""
    place = pc.cast(pc.index_in(table["point"], value_set=points), pa.int64())
    return pc.add(pc.shift_left(place, 32), pc.cast(table["step"], pa.int64()))


def _hil_points(summary: pd.DataFrame, measured: set[str]) -> list[str]:
    """Points measured on hardware, in summary order: level "hil", or device phases in their steps."""
    hil = set(measured)
    if "level" in summary.columns:
        hil |= set(summary.loc[summary["level"] == "hil", "point"])
    return [p for p in summary["point"] if p in hil]


def _device_sync_table(summary: pd.DataFrame, steps: pd.DataFrame, device_syncs: pd.DataFrame | None,
                       points: list[str]) -> str:
    """Per hil point, each (site, phase) where torch's sync debug mode caught a synchronizing CUDA operation."""
    if device_syncs is None:
        return "Not recorded: these points have no `device_syncs.parquet`.\n"
    n_steps = steps.groupby("point").size()
    found = device_syncs[device_syncs["point"].isin(points)] if len(device_syncs) else device_syncs
    if found.empty:
        total = sum(int(n_steps.get(p, 0)) for p in points)
        return (f"No synchronizing CUDA operation outside the by-design readback in {total:,} steps: torch's sync "
                "debug mode caught none (the readback waits on a CUDA event, which that mode does not report).\n")
    g = found.groupby(["point", "site", "phase"], sort=False)["wait_s"].agg(["size", "sum", "mean"])
    g = g.reset_index().assign(order=lambda d: d["point"].map({p: i for i, p in enumerate(points)}))
    g = g.sort_values(["order", "size", "site"], ascending=[True, False, True])
    label = summary.set_index("point")["label"]
    rows = [
        [label[r.point], f"`{r.site}`", r.phase or "–", f"{r.size:,}", _cell(r.size / n_steps[r.point], "{:.2f}"),
         _cell(r.sum * 1e3, "{:.3f}"), _cell(r.mean * 1e3, "{:.3f}")]
        for r in g.itertuples()
    ]
    headers = ["point", "site", "phase", "count", "count/step", "total wait ms", "mean wait ms"]
    return _markdown_table(headers, rows) + (
        "\nCaught by torch's sync debug mode; phase is the innermost instrumented phase open at the call. torch "
        "reports a sync once the operation has returned, so a wait is the host time from the latest phase boundary, "
        "step start or earlier sync to that return: an upper bound on the time spent waiting.\n"
    )


def _measured_table(summary: pd.DataFrame, steps: pd.DataFrame, points: list[str]) -> str:
    """Per hil point: what was measured, the median device time per step by device phase, the harness's own time."""
    label = summary.set_index("point")["label"]
    rows = []
    for point in points:
        s = steps[steps["point"] == point]
        measured = list(dict.fromkeys(name for names in s["measured"] for name in names.split(",") if name))
        device_ms = float((s["gpu_end"] - s["gpu_start"]).median()) * 1e3
        harness_ms = float(s["harness_s"].median()) * 1e3
        rows.append([
            label[point], ", ".join(measured) or "–", _cell(device_ms, "{:.3f}"),
            *(_cell(float(s[c].median()) * 1e3, "{:.3f}") for c in DEVICE_PHASE_COLUMNS),
            _cell(harness_ms, "{:.3f}"), _cell(100 * harness_ms / device_ms if device_ms else np.nan, "{:.1f}"),
        ])
    headers = ["point", "measured", "device ms/step", *(f"{p} ms" for p in DEVICE_PHASES), "harness ms/step",
               "harness % of device"]
    return _markdown_table(headers, rows) + (
        "\nMedians over the point's steps (the phase medians need not add up to the step's). Measured phases ran "
        "on the hardware; the engine loop's other host work (schedule, update, ...) comes from the cost model. "
        "Harness: the harness's own host time per step, outside the decode loop.\n"
    )


def _cell(value: object, fmt: str, low: object = None, high: object = None) -> str:
    """A formatted value, followed by its interval [low, high] when it has one (a run with repeats)."""
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return "–"
    if low is None or high is None or np.isnan(low) or np.isnan(high):
        return fmt.format(value)
    return f"{fmt.format(value)} [{fmt.format(low)}, {fmt.format(high)}]"


def _markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(headers), line(["---"] * len(headers)), *(line(r) for r in rows)]) + "\n"


# --------------------------------------------------------------------------------------------
# plots


def _plot_metrics(summary: pd.DataFrame, by_concurrency: bool, plots: Path) -> None:
    """tpot.png (mean and tail TPOT), throughput.png and gpu_busy.png: a line per mode against concurrency, the
    modes' legend beside the panels, when concurrency is swept; else a bar per point. The legend is laid out and
    drawn once, as an image each plot pastes at the same place (a legend of a hundred modes cost more than the
    plot it stands beside, three times over)."""
    summary = summary.assign(gpu_busy_pct=summary["gpu_busy_fraction"] * 100)
    tpot = [("mean_tpot_ms", "mean TPOT (ms)")]
    tail = _tail_key(summary, "tpot")
    if tail is not None:
        tpot.append((tail[0], f"{tail[1]} TPOT (ms)"))
    figures = {"tpot": tpot, "throughput": [("output_throughput", "output throughput (tok/s)")],
               "gpu_busy": [("gpu_busy_pct", "GPU busy (%)")]}
    lines = ModeLines.of(summary) if by_concurrency else None
    legend = None
    for name, panels in figures.items():
        if lines is None:
            fig = Figure(figsize=(5.5 * len(panels), 4), layout="constrained")
            for ax, (column, ylabel) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels, strict=True):
                _draw_bars(ax, summary, column, ylabel)
        else:
            fig = Figure(dpi=DPI)
            axes = [fig.add_subplot() for _ in panels]
            for ax, (column, ylabel) in zip(axes, panels, strict=True):
                _draw_lines(ax, summary, lines, column, ylabel)
            if legend is None:
                legend = legend_image(*axes[-1].get_legend_handles_labels(), ncols=-(-len(lines.modes) // LEGEND_ROWS))
            _place_beside(fig, axes, legend)
        fig.savefig(plots / f"{name}.png", dpi=DPI)


@dataclass(frozen=True)
class ModeLines:
    """A sweep over concurrency as lines: mode i's rows of the summary, by concurrency, are
    `order[bounds[i]:bounds[i + 1]]` (modes in the order they first appear)."""

    modes: list[str]
    order: np.ndarray
    bounds: np.ndarray

    @classmethod
    def of(cls, summary: pd.DataFrame) -> ModeLines:
        codes, modes = pd.factorize(summary["mode"].astype(str))
        order = np.lexsort((summary[CONCURRENCY].to_numpy(), codes))
        return cls(list(modes), order, np.searchsorted(codes[order], np.arange(len(modes) + 1)))


def _draw_lines(ax: Axes, summary: pd.DataFrame, lines: ModeLines, column: str, ylabel: str) -> None:
    """One line per mode against concurrency (log2 axis); error bars only where there are intervals."""
    x, y = summary[CONCURRENCY].to_numpy()[lines.order], summary[column].to_numpy(dtype=np.float64)[lines.order]
    errors = _error_bars(summary, column)
    colors = rcParams["axes.prop_cycle"].by_key()["color"]  # the colours lines take in turn, resolved once
    for i, mode in enumerate(lines.modes):
        rows = slice(lines.bounds[i], lines.bounds[i + 1])
        # modes whose lines coincide (depth 1 under either policy) stay visible: each later line is drawn
        # thinner, with a smaller open or filled marker of another shape, in another dash pattern
        style = dict(color=colors[i % len(colors)], marker=MARKERS[i % len(MARKERS)], label=mode,
                     linestyle=LINESTYLES[i % len(LINESTYLES)], linewidth=max(0.8, 2.2 - 0.3 * i),
                     markersize=max(3.0, 9.0 - 1.2 * i), fillstyle="none" if i % 2 else "full", zorder=2 + i)
        if errors is None:
            ax.plot(x[rows], y[rows], **style)
        else:
            ax.errorbar(x[rows], y[rows], yerr=errors[:, lines.order[rows]], capsize=3, **style)
    xs = sorted(summary[CONCURRENCY].unique())
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.minorticks_off()
    ax.set_xlabel("concurrency")
    _finish_axes(ax, summary, column, ylabel)


def _draw_bars(ax: Axes, summary: pd.DataFrame, column: str, ylabel: str) -> None:
    ax.bar(range(len(summary)), summary[column], yerr=_error_bars(summary, column), color="tab:blue", capsize=3)
    ax.set_xticks(range(len(summary)), summary["label"], rotation=20, ha="right", fontsize="small")
    _finish_axes(ax, summary, column, ylabel)


def _finish_axes(ax: Axes, summary: pd.DataFrame, column: str, ylabel: str) -> None:
    ax.set_ylabel(ylabel)
    top = summary[f"ci_high.{column}"] if f"ci_high.{column}" in summary else summary[column]
    ax.set_ylim(0, 1.08 * float(top.max()) or 1.0)
    ax.grid(alpha=0.3)


def legend_image(handles: list, labels: list[str], **options: object) -> np.ndarray:
    """A legend of `handles` drawn alone, at DPI, as an RGBA image just its size (1 px of margin), to paste into
    figures drawn at DPI (`Figure.figimage`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.transforms import IdentityTransform

    fig = Figure(dpi=DPI)
    legend = fig.legend(handles, labels, fontsize="small", loc="lower left", bbox_to_anchor=(1, 1),
                        bbox_transform=IdentityTransform(), borderaxespad=0, **options)
    canvas = FigureCanvasAgg(fig)
    box = legend.get_window_extent(canvas.get_renderer())
    fig.set_size_inches((np.ceil(box.width) + 2) / DPI, (np.ceil(box.height) + 2) / DPI)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba()).copy()


def _place_beside(fig: Figure, axes: list[Axes], legend: np.ndarray) -> None:
    """Size `fig` for its panels (PANEL inches wide each, in a row) and the legend image beside the last one, top
    aligned; the margins hold the tick labels and axis labels (a fixed layout: nothing to measure)."""
    left, right, bottom, top = PANEL_MARGINS
    legend_h, legend_w = legend.shape[0] / DPI, legend.shape[1] / DPI
    width = PANEL[0] * len(axes) + LEGEND_GAP + legend_w
    height = max(PANEL[1], legend_h + top + bottom)
    fig.set_size_inches(width, height)
    for i, ax in enumerate(axes):
        ax.set_position(((i * PANEL[0] + left) / width, bottom / height, (PANEL[0] - left - right) / width,
                         (height - bottom - top) / height))
    x = (len(axes) * PANEL[0] - right + LEGEND_GAP) * DPI
    fig.figimage(legend, xo=round(x), yo=round((height - top - legend_h) * DPI), origin="upper")


def _error_bars(rows: pd.DataFrame, column: str) -> np.ndarray | None:
    """The distance from each median to its interval's ends (a run with repeats), else None."""
    if f"ci_low.{column}" not in rows:
        return None
    return np.abs(np.vstack([rows[column] - rows[f"ci_low.{column}"], rows[f"ci_high.{column}"] - rows[column]]))


def _timeline_points(summary: pd.DataFrame, by_concurrency: bool) -> tuple[str, pd.DataFrame]:
    """The points whose timelines are drawn: one per mode at the largest concurrency <= 16 (else
    the middle one), or every point when concurrency is not swept; at most TIMELINE_PANELS of them, evenly
    spaced in sweep order (a panel each: a large sweep's image stays a readable size)."""
    where, rows = "", summary
    if by_concurrency:
        values = sorted(summary[CONCURRENCY].unique())
        small = [c for c in values if c <= 16]
        chosen = small[-1] if small else values[len(values) // 2]
        where, rows = f" at concurrency {chosen}", summary[summary[CONCURRENCY] == chosen]
    if len(rows) > TIMELINE_PANELS:
        where += f" ({TIMELINE_PANELS} of {len(rows)} points, evenly spaced in sweep order)"
        rows = rows.iloc[np.linspace(0, len(rows) - 1, TIMELINE_PANELS).round().astype(int)]
    return where, rows


def _plot_timeline(rows: pd.DataFrame, steps: pd.DataFrame, syncs: pd.DataFrame, n: int, path: Path) -> None:
    """A panel per point, the legend above them; laid out by fixed margins (the panels' labels are of known size)."""
    height = 0.8 + 1.3 * len(rows)
    fig = Figure(figsize=(11, height))
    axes = fig.subplots(len(rows), 1, sharex=True, squeeze=False)[:, 0]
    left, right, bottom, top, gap = TIMELINE_MARGINS
    panel = (height - top - bottom - gap * (len(rows) - 1)) / len(rows)
    fig.subplots_adjust(left=left / 11, right=1 - right / 11, bottom=bottom / height, top=1 - top / height,
                        hspace=gap / panel)
    longest = 0.0
    for ax, (_, row) in zip(axes, rows.iterrows(), strict=True):
        point_steps = steps[steps["point"] == row["point"]] if len(steps) else steps
        point_syncs = syncs[syncs["point"] == row["point"]] if len(syncs) else syncs
        longest = max(longest, _draw_timeline(ax, point_steps, point_syncs, n, row["mode"]))
    axes[-1].set_xlim(0, longest or 1.0)
    axes[-1].set_xlabel("time from window start (ms)")
    handles = [Patch(color=color, label=label) for label, color in HOST_COLORS.values()]
    handles.append(Patch(color=GPU_COLORS[0], label="GPU step"))
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize="small", frameon=False)
    fig.savefig(path, dpi=DPI)


def _draw_timeline(ax: Axes, steps: pd.DataFrame, syncs: pd.DataFrame, n: int, title: str) -> float:
    """Host and GPU lanes for `n` steady-state steps from a third into the run; returns the window (ms)."""
    ax.set_yticks([0.5, 1.5], ["GPU", "host"])
    ax.set_ylim(0, 2)
    if steps.empty:
        ax.set_title(f"{title}: no steps recorded", loc="left", fontsize="small", y=1.0)
        return 0.0
    steps = steps.sort_values("step")
    first = min(len(steps) // 3, max(len(steps) - n, 0))
    window = steps.iloc[first : first + n]
    intervals = host_intervals(steps, syncs)
    t0 = min([*intervals.loc[intervals["step"] == window["step"].iloc[0], "start_s"], window["gpu_start"].iloc[0]])
    t1 = window["gpu_end"].iloc[-1]
    shown = intervals[(intervals["end_s"] > t0) & (intervals["start_s"] < t1)]
    kinds = np.where(shown["name"] == OUTPUT_READBACK, "readback", shown["kind"])
    for kind, (_, color) in HOST_COLORS.items():
        part = shown[kinds == kind]
        ax.broken_barh(_bars(part["start_s"], part["end_s"], t0, t1), (1.1, 0.8), facecolors=color,
                       zorder=3 if kind == "sync" else 2)
    gpu = steps[(steps["gpu_end"] > t0) & (steps["gpu_start"] < t1)]
    bars = _bars(gpu["gpu_start"], gpu["gpu_end"], t0, t1)
    ax.broken_barh(bars, (0.1, 0.8), facecolors=[GPU_COLORS[step % 2] for step in gpu["step"]])
    span_ms = (t1 - t0) * 1e3
    for (x, width), step in zip(bars, gpu["step"], strict=True):
        if width > 0.04 * span_ms:
            ax.text(x + width / 2, 0.5, str(step), ha="center", va="center", fontsize=7, color="white")
    busy = sum(width for _, width in bars) / span_ms if span_ms else 0.0
    # the title names what the panel shows: every GPU step with a bar in it (the window's, and any step before or
    # after it that overlaps its edges, clipped)
    ax.set_title(f"{title}: GPU steps {gpu['step'].min()}–{gpu['step'].max()} in {span_ms:.2f} ms, "
                 f"GPU busy {busy:.0%}", loc="left", fontsize="small", y=1.0)  # placed: not measured at each draw
    return span_ms


def _bars(start_s: pd.Series, end_s: pd.Series, t0: float, t1: float) -> list[tuple[float, float]]:
    """(x, width) in ms from t0 of intervals clipped to [t0, t1]."""
    start = (np.maximum(start_s.to_numpy(dtype=np.float64), t0) - t0) * 1e3
    end = (np.minimum(end_s.to_numpy(dtype=np.float64), t1) - t0) * 1e3
    return [(float(s), float(e - s)) for s, e in zip(start, end, strict=True)]
