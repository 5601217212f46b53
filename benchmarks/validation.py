"""The profiled sim and the uncalibrated sim (the roofline) against the real level of the committed validation runs
(issue 35: scenario families the profiles never saw). Usage:

    python benchmarks/validation.py [RUN_DIR ...] [--out DIR] [--table results/validation/validation.md]

Each RUN_DIR (default: every fidelity run under results/validation) holds a `simharness fidelity --levels sim,real`
run of one family on the GPU. The real medians are that run's; both sims are re-run here (the sim is
deterministic, so one pass is the measurement; a warning says where this machine's profiled sim no longer matches
the run's own sim level). Writes the table of median and worst |error| per family and metric.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from simharness import results
from simharness.fidelity import sim_checks
from simharness.runner import execute
from simharness.stats import error_stats, error_table

METRICS = ("mean_tpot_ms", "p99_tpot_ms", "output_throughput", "mean_ttft_ms")
SIMS = {"sim": "auto", "sim-uncalibrated": "none"}  # level label -> engine.profile


def family_errors(run_dir: Path, out: Path) -> tuple[pd.DataFrame, str | None]:
    """Per sim variant and metric: median and worst |error| against the run's real medians."""
    sc = results.load_run_scenario(run_dir)
    summary = pd.read_csv(run_dir / "summary.csv")
    real = summary[summary["level"] == "real"]
    points = sim_checks(sc, real, SIMS)
    sims = results.combine(execute(sc, points, out))
    stats = error_stats(error_table(pd.concat([real, sims], ignore_index=True)))
    return stats[stats["metric"].isin(METRICS)], drift(summary, sims)


def drift(summary: pd.DataFrame, sims: pd.DataFrame) -> str | None:
    """Where this machine's profiled sim differs from the run's own sim level (another profile, another tree)."""
    then = summary[summary["level"] == "sim"].set_index("config")["mean_tpot_ms"]
    now = sims[sims["level"] == "sim"].set_index("config")["mean_tpot_ms"].reindex(then.index)
    moved = (now / then - 1).abs()
    if moved.isna().any():
        return f"{int(moved.isna().sum())} of the run's sim points have no counterpart here"
    return f"the sim's mean TPOT moved by up to {moved.max():.2%} since the run" if moved.max() > 1e-9 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", type=Path)
    parser.add_argument("--out", type=Path, default=Path("/tmp/validation"))
    parser.add_argument("--table", type=Path, default=Path("results/validation/validation.md"))
    args = parser.parse_args()
    runs = args.runs or sorted(p.parent for p in Path("results/validation").glob("*/*/fidelity.json"))
    rows = []
    for run_dir in runs:
        stats, drift = family_errors(run_dir, args.out)
        if drift:
            print(f"warning: {run_dir}: {drift}")
        for _, r in stats.iterrows():
            rows.append({"family": run_dir.parent.name.removeprefix("validation-"), "run": run_dir.name,
                         "sim": r["level"], "metric": r["metric"], "points": r["points"],
                         "median": r["median_abs_error"], "worst": r["worst_abs_error"]})
    table = pd.DataFrame(rows)
    wide = table.pivot_table(index=["family", "metric"], columns="sim", values=["median", "worst"], sort=False)
    lines = ["| family | metric | profiled sim median / worst | uncalibrated median / worst |", "|---|---|---|---|"]
    for (family, metric), r in wide.iterrows():
        lines.append(f"| {family} | {metric} | {r[('median', 'sim')]:.1%} / {r[('worst', 'sim')]:.1%} | "
                     f"{r[('median', 'sim-uncalibrated')]:.1%} / {r[('worst', 'sim-uncalibrated')]:.1%} |")
    args.table.write_text("\n".join(lines) + "\n")
    table.to_csv(args.table.with_suffix(".csv"), index=False)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
