"""The profiled sim and the uncalibrated sim (the roofline) against the real level of the committed validation runs
(issue 35: scenario families the profiles never saw). Usage:

    python benchmarks/validation.py [RUN_DIR ...] [--out DIR] [--table results/validation/validation.md]

Each RUN_DIR (default: every fidelity run under results/validation) holds a `simharness fidelity --levels sim,real`
run of one family on the GPU. The real medians are that run's; both sims are re-run here (the sim is
deterministic, so one pass is the measurement; a warning says where this machine's profiled sim no longer matches
the run's own sim level). Writes the table of median and worst |error| per family and metric, and where each sim's
mean step differs from the real one: its device time or the host-bound time the device sits idle (`step_split`).
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


def family_errors(run_dir: Path, out: Path) -> tuple[pd.DataFrame, pd.DataFrame, str | None]:
    """Per sim variant and metric: median and worst |error| against the run's real medians; per sim variant and
    point, the step split (`step_split`)."""
    sc = results.load_run_scenario(run_dir)
    summary = pd.read_csv(run_dir / "summary.csv")
    real = summary[summary["level"] == "real"]
    points = sim_checks(sc, real, SIMS)
    sims = results.combine(execute(sc, points, out))
    stats = error_stats(error_table(pd.concat([real, sims], ignore_index=True)))
    return stats[stats["metric"].isin(METRICS)], step_split(real, sims), drift(summary, sims)


def step_split(real: pd.DataFrame, sims: pd.DataFrame) -> pd.DataFrame:
    """Per sim variant and configuration, the relative error of the mean step against the real medians, split
    into its device part and its host part (the step's time with the device idle, waiting on the host), each as
    a fraction of the real step, so that the two add up to the step's error."""
    cols = ["mean_tpot_ms", "mean_step_ms", "gpu_busy_fraction"]
    ref = real.groupby("config")[cols].median()
    ref_device = ref["mean_step_ms"] * ref["gpu_busy_fraction"]
    rows = []
    for level, sim in sims.groupby("level"):
        s = sim.set_index("config")[cols].reindex(ref.index)
        device = s["mean_step_ms"] * s["gpu_busy_fraction"]
        rows.append(pd.DataFrame({
            "sim": level, "config": ref.index, "tpot_error": s["mean_tpot_ms"] / ref["mean_tpot_ms"] - 1,
            "step_error": s["mean_step_ms"] / ref["mean_step_ms"] - 1,
            "device_part": (device - ref_device) / ref["mean_step_ms"],
            "host_part": (s["mean_step_ms"] - device - ref["mean_step_ms"] + ref_device) / ref["mean_step_ms"],
            "real_device_ms": ref_device, "sim_device_ms": device,
        }).reset_index(drop=True))  # fmt: skip
    return pd.concat(rows, ignore_index=True)


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
    rows, splits = [], []
    for run_dir in runs:
        stats, split, drift = family_errors(run_dir, args.out)
        if drift:
            print(f"warning: {run_dir}: {drift}")
        splits.append(split.assign(family=run_dir.parent.name.removeprefix("validation-"), run=run_dir.name))
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
    split = pd.concat(splits, ignore_index=True)
    lines += ["", "Where each sim's mean step differs from the real one (medians over a family's points, fractions of "
              "the real step; the device part and the host part add up to the step's error):", "",
              "| family | sim | mean TPOT error | step error | device part | host part | real / sim device ms |",
              "|---|---|---|---|---|---|---|"]
    for (family, sim), r in split.groupby(["family", "sim"], sort=False).median(numeric_only=True).iterrows():
        lines.append(f"| {family} | {sim} | {r['tpot_error']:+.1%} | {r['step_error']:+.1%} | "
                     f"{r['device_part']:+.1%} | {r['host_part']:+.1%} | "
                     f"{r['real_device_ms']:.2f} / {r['sim_device_ms']:.2f} |")
    args.table.write_text("\n".join(lines) + "\n")
    table.to_csv(args.table.with_suffix(".csv"), index=False)
    split.to_csv(args.table.with_name(args.table.stem + "-steps.csv"), index=False)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
