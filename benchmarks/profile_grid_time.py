"""The GPU time of a model's profile grid, estimated from committed grid runs of that model (docs/calibration.md,
"The 8B grid's GPU time"). Usage:

    python benchmarks/profile_grid_time.py RUN_DIR ... [--model llama-3-8b] [--grid scenarios/profile/grid.yaml]

Each point of the grid (`profile_grid.grid_points`, cut into runs by `run_groups`) costs what the committed point
of the same scenario cost: its measured duration per run of it (one, or `host_attempts` where the grid keeps the
host-speed retries), a warm-up, and per decode loop built (the warm-up's and each run's) the capture of two step
graphs (steered or not) per batch bucket of its run's model. A run adds its model's build, the command its start.
The constants come from the committed 8B runs' wall times (run ids and first-point times in their meta.json).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from simharness.calibration import point_scenario, read_run
from simharness.engine.buckets import batch_buckets
from simharness.profile_grid import GRID, grid_points, run_groups
from simharness.scenario import Scenario

GRAPH_S = 0.028  # one step graph's capture, 8B on the H100 (with its eager warm-up run)
RUN_S = 6.0  # a run's model build and prefill-graph capture
START_S = 20.0  # the command's package install, imports and CUDA start
WARM_UP_S, LONG_WARM_UP_S = 0.4, 2.0  # a point's warm-up run; with prompts of 2,000 tokens or more


def work(sc: Scenario) -> str:
    """What a point measures: its workload, schedule, model and speculation (not the sim's costs, which change)."""
    return repr(sc.model_dump(mode="json", include={"workload": True, "scheduler": True,
                                                    "engine": {"model", "speculation"}}))


def committed_costs(run_dirs: list[Path]) -> dict[str, tuple[float, int]]:
    """Per measured scenario: (duration of one run, runs of it) of the committed points (a later run's wins)."""
    costs = {}
    for run_dir in run_dirs:
        _, sc, summary = read_run(run_dir)
        for _, row in summary[summary["level"] == "real"].iterrows():
            costs[work(point_scenario(sc, row))] = (float(row["duration_s"]), int(row["host_attempts"]))
    return costs


def estimate(grid: Path, model: str, run_dirs: list[Path]) -> tuple[float, list[str]]:
    """The grid's estimated seconds and a line per run."""
    _, points = grid_points(grid, {"engine.model": model, "engine.level": "real"})
    costs = committed_costs(run_dirs)
    total, lines = START_S, []
    for group in run_groups(points):
        slots = max(min(p.scenario.scheduler.max_num_seqs, p.scenario.workload.concurrency) for p in group) + 1
        graphs = 2 * len(batch_buckets(slots))
        seconds, missing = RUN_S, []
        for p in group:
            sc = p.scenario
            if work(sc) not in costs:
                missing.append(p.id)
                continue
            duration, attempts = costs[work(sc)]
            runs = 1 if sc.engine.host_slowdown is None else attempts
            prompt = sc.workload.prompt_len
            long = (prompt.value if prompt.dist == "fixed" else prompt.max) >= 2000
            seconds += (1 + runs) * graphs * GRAPH_S + runs * duration + (LONG_WARM_UP_S if long else WARM_UP_S)
        total += seconds
        blocks = ", ".join(dict.fromkeys(p.values["block"] for p in group))
        lines.append(f"run of {len(group)} points ({blocks}), {slots} slots, {graphs} step graphs a decode loop: "
                     f"{seconds:.0f} s" + (f"; no committed point for {len(missing)}: {missing}" if missing else ""))
    return total, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--grid", type=Path, default=GRID)
    args = parser.parse_args()
    total, lines = estimate(args.grid, args.model, args.runs)
    print("\n".join(lines))
    print(f"{args.grid} for {args.model}: about {total:.0f} s")


if __name__ == "__main__":
    main()
