"""The speculation frontier of a scenario and the k schedule derived from it, checked against every fixed k
(issue 31, docs/frontier.md).

    python benchmarks/frontier.py scenarios/frontier-8b.yaml --out results/frontier/8b
    python benchmarks/frontier.py scenarios/frontier-1b.yaml --out /tmp/f --set repeats=1 --set engine.level=real
    python benchmarks/frontier.py scenarios/frontier-8b.yaml --out /tmp/f --from RUN_DIR   # frontier of a finished run

Runs the scenario's sweep over k and load (or reads RUN_DIR), writes its frontier, then, for each group (text mix),
runs the derived k schedule (`engine.speculation.k_schedule`) over the same loads at the scenario's level (sim, hil
or real) and compares it with each fixed k; --no-schedule writes the frontier only. OUT gets frontier.csv (per
group and load), points.csv (per group, load and k: medians and 95% intervals), crossovers.csv, frontier.png,
schedule.yaml (the derived schedules), schedule.csv (schedule against fixed k per load) and settings.json
(scenario, overrides, commit, seconds, and with --from the run's meta.json); with --keep-runs the run directories
under OUT/runs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pandas as pd
import yaml

import simharness
from simharness.frontier import K, group_label, schedule_vs_fixed, write_frontier
from simharness.overrides import parse_sets
from simharness.scenario import load_scenario


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenario", type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--set", action="append", default=[], metavar="PATH=VALUE", help="override the scenario")
    ap.add_argument("--from", dest="run_dir", type=Path, help="the frontier of this finished run (runs no sweep)")
    ap.add_argument("--keep-runs", action="store_true", help="keep the run directories under OUT/runs")
    ap.add_argument("--no-schedule", action="store_true", help="write the frontier only (no schedule runs)")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "simharness"], capture_output=True, text=True).stdout
    overrides = parse_sets(args.set)
    sc = load_scenario(args.scenario, overrides)
    args.out.mkdir(parents=True, exist_ok=True)
    # the run directories live only as long as this benchmark, unless --keep-runs
    with tempfile.TemporaryDirectory(prefix="frontier-") as tmp:
        runs = args.out / "runs" if args.keep_runs else Path(tmp)
        seconds = {}
        t = time.perf_counter()
        run_dir = args.run_dir or simharness.run(sc, runs).run_dir
        seconds["frontier"] = time.perf_counter() - t
        fr, schedules = write_frontier(run_dir)
        fr.table.to_csv(args.out / "frontier.csv", index=False)
        fr.points.to_csv(args.out / "points.csv", index=False)
        fr.crossovers.to_csv(args.out / "crossovers.csv", index=False)
        shutil.copy(run_dir / "plots" / "frontier.png", args.out / "frontier.png")
        (args.out / "schedule.yaml").write_text(yaml.safe_dump(
            {label: {"k": max(s.values()), "k_schedule": s} for label, s in schedules.items()}, sort_keys=False))
        compared = []
        if not args.no_schedule:
            for values in itertools.product(*(sc.sweep[g] for g in fr.groups)):
                fixed = dict(zip(fr.groups, values, strict=True))
                label = group_label({g: str(v) for g, v in fixed.items()}, fr.groups)
                schedule = schedules[label]
                t = time.perf_counter()
                scheduled = simharness.run(load_scenario(args.scenario, {
                    **overrides, **fixed, K: max(schedule.values()), "engine.speculation.k_schedule": schedule,
                    "name": f"{sc.name}-schedule"}), runs)
                seconds[f"schedule {label}"] = time.perf_counter() - t
                compared.append(schedule_vs_fixed(fr, label, scheduled.summary))
                pd.concat(compared).to_csv(args.out / "schedule.csv", index=False)
        (args.out / "settings.json").write_text(json.dumps({
            "scenario": str(args.scenario), "overrides": overrides, "level": sc.engine.level, "repeats": sc.repeats,
            "commit": commit + (" (simharness/ modified)" if dirty else ""), "seconds": seconds,
            "run": json.loads((run_dir / "meta.json").read_text()) if (run_dir / "meta.json").exists() and args.run_dir
            else None}, indent=1))
        print(fr.crossovers.to_string(index=False))
        if compared:
            print(pd.concat(compared).round(2).to_string(index=False))


if __name__ == "__main__":
    main()
