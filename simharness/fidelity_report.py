"""The fidelity run's report: error statistics per level, the per-point table, the real level's own spread and
overhead, and two plots (each level's prediction against the real value, and the error at every point)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from simharness.report import _cell, _header, _markdown_table
from simharness.scenario import Scenario
from simharness.stats import REFERENCE

MARKERS = {"sim": "s", "hil": "o"}
SCATTER = [("mean_tpot_ms", "mean TPOT (ms)"), ("p99_tpot_ms", "P99 TPOT (ms)"), ("mean_ttft_ms", "mean TTFT (ms)"),
           ("output_throughput", "output throughput (tok/s)")]  # fmt: skip


def write_fidelity_report(run_dir: Path, sc: Scenario, summary: pd.DataFrame, errors: pd.DataFrame,
                          stats: pd.DataFrame, facts: dict) -> Path:
    plots = run_dir / "plots"
    plots.mkdir(exist_ok=True)
    if len(errors):
        _plot_scatter(errors, plots / "fidelity_scatter.png")
        _plot_errors(errors, plots / "fidelity_errors.png")
    configs = list(dict.fromkeys(summary["config"]))
    verdict = ("**Tolerances:** all met." if not facts["violations"] else
               "**Tolerances exceeded:**\n\n" + "\n".join(f"- {v}" for v in facts["violations"]))
    if not sc.fidelity.tolerances:
        verdict = "**Tolerances:** none set (`fidelity.tolerances`)."
    # a point is finished once the real level, the reference, has every run of it
    complete = list(dict.fromkeys(errors["config"])) if len(errors) else []
    header = _header(run_dir, sc, complete).replace("# simharness report", "# simharness fidelity report")
    parts = [
        header.replace("`simharness run SCENARIO --resume", "`simharness fidelity SCENARIO --resume"),
        f"Levels {', '.join(facts['levels'])} against the real level, {len(configs)} point(s); measured levels run "
        f"{sc.fidelity.runs} time(s) per point (their value is the median). Relative error = (level − real) / "
        "real.\n",
        verdict + "\n",
        "## Error per level and metric\n",
        _stats_table(stats),
        _worst_runs_note(facts["worst_runs"]),
        "## Per point: mean and P99 TPOT\n",
        _points_table(summary, errors, configs),
        "## The real level's own spread\n",
        "(max − min) / median over the real runs of each point: an error below it cannot be told from noise.\n",
        _spread_table(facts["real_spread"]),
        "## Agreement and overhead\n",
        _agreement_table(facts["agreement"], facts["real_overhead"]),
        "## Where a decode step's time goes\n",
        _period_table(facts["period"]),
        "## Decode-only steps and steps with a prefill chunk\n",
        _kinds_table(facts["step_kinds"]),
        "## Where the timelines part\n",
        _gaps_table(facts["gaps"]),
        "## Prefill enqueue on the host\n",
        _enqueue_table(facts["prefill_enqueue"]),
        "## The host during the runs\n",
        _host_table(facts["host"]),
    ]
    if len(errors):
        parts.append("![predicted vs real](plots/fidelity_scatter.png)\n\n"
                     "![error per point](plots/fidelity_errors.png)\n")
    path = run_dir / "report.md"
    path.write_text("\n".join(parts))
    return path


def _worst_runs_note(worst: list[dict]) -> str:
    """Each level's worst mean-TPOT point with its runs and the real level's (`fidelity.worst_runs`)."""
    if not worst:
        return ""
    lines = ["Each level's worst point in mean TPOT, with its runs (ms) and the real level's; where their ranges "
             "overlap, that error is within the runs' own scatter:\n"]
    for r in worst:
        runs = ", ".join(f"{v:.3f}" for v in r["level_runs"])
        real = ", ".join(f"{v:.3f}" for v in r["real_runs"])
        overlap = " (the ranges overlap)" if r["overlap"] else ""
        lines.append(f"- {r['level']}, {r['config']}: {r['error'] * 100:.1f}%; runs {runs}; real {real}{overlap}")
    return "\n".join(lines) + "\n"


def _stats_table(stats: pd.DataFrame) -> str:
    rows = [[r.level, r.metric, str(r.points), _cell(r.median_abs_error * 100, "{:.1f}%"),
             _cell(r.worst_abs_error * 100, "{:.1f}%"), r.worst_point or "–"] for r in stats.itertuples()]
    return _markdown_table(["level", "metric", "points", "median |error|", "worst |error|", "worst point"], rows)


def _points_table(summary: pd.DataFrame, errors: pd.DataFrame, configs: list[str]) -> str:
    levels = [lv for lv in ("hil", "sim") if lv in set(errors["level"])]
    headers = ["point", "real mean TPOT ms (runs)", *(f"{lv} mean TPOT ms (error)" for lv in levels),
               "real P99 TPOT ms", *(f"{lv} P99 error" for lv in levels)]
    rows = []
    for config in configs:
        real = summary[(summary["config"] == config) & (summary["level"] == "real")]["mean_tpot_ms"]
        row = [config, f"{real.median():.3f} ({', '.join(f'{v:.3f}' for v in real)})" if len(real) else "–"]
        for metric in ("mean_tpot_ms", "p99_tpot_ms"):
            if metric == "p99_tpot_ms":
                p99 = errors[(errors["config"] == config) & (errors["metric"] == metric)]["real"]
                row.append(_cell(p99.iloc[0] if len(p99) else np.nan, "{:.3f}"))
            for level in levels:
                e = errors[(errors["config"] == config) & (errors["level"] == level) & (errors["metric"] == metric)]
                if e.empty:
                    row.append("–")
                elif metric == "mean_tpot_ms":
                    row.append(f"{e['predicted'].iloc[0]:.3f} ({e['rel_error'].iloc[0]:+.1%})")
                else:
                    row.append(_cell(e["rel_error"].iloc[0], "{:+.1%}"))
        rows.append(row)
    return _markdown_table(headers, rows)


def _spread_table(records: list[dict]) -> str:
    metrics = [("mean_tpot_ms", "mean TPOT"), ("p99_tpot_ms", "P99 TPOT"), ("mean_ttft_ms", "mean TTFT"),
               ("output_throughput", "throughput")]  # fmt: skip
    rows = [[r["config"], str(r["runs"]), *(_cell(r[m] * 100, "{:.1f}%") for m, _ in metrics)] for r in records]
    if records:
        spreads = pd.DataFrame(records)
        rows.append(["**median**", "", *(_cell(spreads[m].median() * 100, "{:.1f}%") for m, _ in metrics)])
    return _markdown_table(["point", "runs", *(label for _, label in metrics)], rows)


def _agreement_table(agreement: list[dict], overhead: list[dict]) -> str:
    identical = {r["config"]: r["identical"] for r in agreement}
    rows = [[r["config"], r["point"], "yes" if identical.get(r["config"], True) else "**no**",
             _cell(r["harness_us"], "{:.0f}"), _cell(r["device_us"], "{:.0f}"), _cell(r["ratio"] * 100, "{:.1f}%")]
            for r in overhead]  # fmt: skip
    note = ("Same tokens: every hil and real run of the point emitted the same number of tokens and accepted the "
            "same drafts. Overhead: the real loop's own host time per decode step (median), against the median "
            "device step.\n\n")
    return note + _markdown_table(["point", "real run", "same tokens", "harness µs", "device µs", "overhead"], rows)


def _period_table(period: list[dict]) -> str:
    """The parts of a decode step's time per point and level (`fidelity.period_split`)."""
    if not period:
        return "No point with step records.\n"
    parts = [k for k in period[0] if k not in ("config", "level")]
    rows = [[r["config"], r["level"], *(_cell(r[p], "{:.0f}") for p in parts)] for r in period]
    note = ("Medians over each run's decode-only steps, then over the point's runs, µs: the modelled scheduler, prep "
            "and the launch, the device after the launch returned, the device's end to the settle (the host's "
            "wake-up and readback), the settle (output processing, the CPU proposer), the gap to the next schedule, "
            "the period, and the harness's own host time (`harness_s`: none at the sim level). At depth 1 the parts "
            "follow one another; deeper they overlap the device, the period is the host's cycle, and a long device "
            "end → settle says the host came back late (host-bound). The real loop charges its own host time against "
            "the modelled work that follows it (docs/hil.md), so where that time is longer than the modelled work, "
            "the real level's settle, gap and period grow.\n\n")
    return note + _markdown_table(["point", "level", *(p.replace("_", " ") for p in parts)], rows)


def _kinds_table(kinds: list[dict]) -> str:
    """Decode-only steps against steps with a prefill chunk per point and level (`fidelity.step_kinds`)."""
    if not kinds:
        return "No point with step records.\n"
    rows = [[r["config"], r["level"], _cell(r["decode_steps"], "{:.0f}"), _cell(r["decode_period_ms"], "{:.3f}"),
             _cell(r["prefill_steps"], "{:.0f}"), _cell(r["prefill_period_ms"], "{:.3f}"),
             _cell(r["prefill_share"] * 100, "{:.0f}%"), _cell(r["chunk_ms"], "{:.3f}")] for r in kinds]
    note = ("Per run (medians over the point's runs): the steps of each kind, their mean device period (a step's "
            "device start to the next's), the share of the run's device time in steps with a chunk, and the chunks' "
            "device time (median). A level whose TPOT differs from the real level's differs in one kind or both.\n\n")
    headers = ["point", "level", "decode-only steps", "period ms", "steps with a chunk", "period ms", "their share",
               "chunk ms"]
    return note + _markdown_table(headers, rows)


# the pairs of events a point lists per level: those that differ most from the real level's, among those that
# come at least once every other decode-only step at both levels
TOP_GAPS, MIN_SHARE = 3, 0.5


def _gaps_table(gaps: list[dict]) -> str:
    """Per point and level, the pairs of consecutive events whose median gap differs most from the real level's
    (`fidelity.timeline_gaps`)."""
    table = pd.DataFrame(gaps)
    if not len(table) or REFERENCE not in set(table["level"]):
        return "No point with the real level's step records.\n"
    common = table[table["share"] >= MIN_SHARE]
    real = common[common["level"] == REFERENCE].set_index(["config", "pair"])["gap_us"]
    pairs = common[common["level"] != REFERENCE].join(real.rename("real_us"), on=["config", "pair"], how="inner")
    order = pairs.groupby(["config", "level"], sort=False).ngroup()  # the sweep's order of points and levels
    pairs = pairs.assign(diff=pairs["gap_us"] - pairs["real_us"], order=order)
    pairs = pairs.assign(size=-pairs["diff"].abs()).sort_values(["order", "size"], kind="stable")
    top = pairs.groupby("order", sort=False).head(TOP_GAPS)
    rows = [[r.config, r.level, r.pair, f"{r.gap_us:.0f}", f"{r.real_us:.0f}", f"{r.diff:+.0f}", f"{r.share:.2f}"]
            for r in top.itertuples()]
    note = ("Every step's timestamps merged in time order; the median gap from an event to the next, by the pair they "
            "form, between decode-only steps' events, µs (medians over the point's runs). Per point and level, the "
            f"{TOP_GAPS} pairs that differ most from the real level's, among those seen at least every other step: "
            "where a level's TPOT differs from the real level's, a gap on the host's critical path does (docs/hil.md, "
            "\"Where hil read back\").\n\n")
    return note + _markdown_table(["point", "level", "events", "µs", "real µs", "difference", "per step"], rows)


def _enqueue_table(enqueue: list[dict]) -> str:
    """Steps with prefills per measured level: host enqueue time per prompt, and the steps over each bound."""
    bounds = [k for k in (enqueue[0] if enqueue else {}) if k.startswith("over_")]
    rows = [[r["level"], str(r["prefill_steps"]), _cell(r["median_ms"], "{:.1f}"), *(str(r[b]) for b in bounds)]
            for r in enqueue]  # fmt: skip
    note = ("The launch of each step with prefills, per prompt it prefills (one forward per prompt: a CUDA-graph "
            "replay with `engine.cuda_graphs`, eager launches without). hil notes a launch part over 20 ms as one "
            "that may have outlasted its GPU gate; a gate lasts about 80 ms on the H100 (docs/hil.md). The same "
            "counts at the real level say the host, not the gate, is slow.\n\n")
    headers = ["level", "steps with prefills", "median ms per prompt",
               *(f"> {b.removeprefix('over_').removesuffix('ms')} ms" for b in bounds)]
    return note + _markdown_table(headers, rows)


def _host_table(host: list[dict]) -> str:
    """The host gauge around the measured runs, per level."""
    if not host:
        return "No host gauge in these runs (measured before `simharness.hostspeed` existed).\n"
    over = next(k for k in host[0] if k.startswith("over_"))
    rows = [[r["level"], str(r["runs"]), _cell(r["median_slowdown"], "{:.2f}x"), _cell(r["max_slowdown"], "{:.2f}x"),
             str(r[over]), str(r["measured_again"])] for r in host]  # fmt: skip
    note = ("A fixed pure-Python workload timed before and after each run, against the fastest time of its process "
            "(`simharness.hostspeed`): a small model's decode loop is host-bound, so a run measured while the host "
            "was slow is slow too, at either level. `engine.host_slowdown` measures such a run again.\n\n")
    headers = ["level", "runs", "median slowdown", "largest", f"runs > {over.removeprefix('over_')}x",
               "measured again"]
    return note + _markdown_table(headers, rows)


def _plot_scatter(errors: pd.DataFrame, path: Path) -> None:
    fig = Figure(figsize=(4.2 * len(SCATTER), 4), layout="constrained")
    for ax, (metric, label) in zip(fig.subplots(1, len(SCATTER), squeeze=False)[0], SCATTER, strict=True):
        rows = errors[errors["metric"] == metric]
        for level, group in rows.groupby("level"):
            ax.scatter(group["real"], group["predicted"], marker=MARKERS.get(level, "x"), label=level, alpha=0.8)
        finite = rows[["real", "predicted"]].to_numpy(dtype=float)
        finite = finite[np.isfinite(finite)]
        if len(finite):
            lo, hi = finite.min() * 0.9, finite.max() * 1.1
            ax.plot([lo, hi], [lo, hi], color="grey", linewidth=1, label="y = x")
        ax.set(xlabel=f"real {label}", ylabel=f"predicted {label}", title=label)
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def _plot_errors(errors: pd.DataFrame, path: Path) -> None:
    configs = list(dict.fromkeys(errors["config"]))
    fig = Figure(figsize=(max(6.0, 0.45 * len(configs) + 3), 4.5), layout="constrained")
    ax = fig.subplots()
    x = np.arange(len(configs))
    for (level, metric), group in errors[errors["metric"].isin([m for m, _ in SCATTER])].groupby(["level", "metric"]):
        values = group.set_index("config").reindex(configs)["rel_error"] * 100
        ax.plot(x, values, marker=MARKERS.get(level, "x"), linestyle="-" if level == "hil" else ":",
                label=f"{level} {metric}")
    ax.axhline(0, color="grey", linewidth=1)
    # tick labels are the swept values only (the paths would take the figure's height): the x label names the paths
    pairs = [[kv.partition("=") for kv in c.split(",")] if c else [] for c in configs]
    ax.set_xticks(x, [" ".join(value for _, _, value in p) for p in pairs], rotation=60, ha="right", fontsize=7)
    ax.set(xlabel=", ".join(path for path, _, _ in pairs[0]) if pairs else "", ylabel="relative error (%)",
           title="error against the real level, per point")
    ax.legend(fontsize=7, ncol=2)
    fig.savefig(path, dpi=110)
