"""Per-point cost of a sweep of tiny sim points: what the harness spends besides the simulation (the points'
tables, metrics, the run's combined tables and report) bounds a design-space sweep of small points.

The sweep is depth x concurrency x k: 8 x 8 x 17 = 1,088 points of 8 requests each (depth 1-8, concurrency 1-128,
k 0-16; --points 256 takes depth 1-4 and k 1-8, --points 64 depth 1-4, concurrency 1-8, k 1-4). Each source tree
given (`--tree`, default this checkout) runs it as `simharness run` in a fresh process, the trees taking turns,
`--repeats` times: on a shared, noisy machine only figures from one such interleaved run compare. The table gives
each tree's median wall time per point and its spread (min-max), and the same of the CPU time (user and system,
of the run and every process it started: the work, which a busy machine's other jobs slow less than the wall
time; a run that draws in a process of its own spends more CPU than wall time). The runs' results must agree in
every tree (the change is bookkeeping, not results): summary.csv's bytes, the run-level tables' contents, and every
trace file that two runs both wrote (a tree may write traces for fewer points); the plots, frontier.csv and
report.md too. Usage:

    python benchmarks/sweep_overhead.py --tree /tmp/base --tree . [--repeats 3] [--points 1088]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import yaml

ROOT = Path(__file__).resolve().parents[1]
TABLES = ("requests", "steps", "syncs", "emissions", "device_syncs")
SWEEPS = {
    1088: {"scheduler.depth": [1, 2, 3, 4, 5, 6, 7, 8], "workload.concurrency": [1, 2, 4, 8, 16, 32, 64, 128],
           "engine.speculation.k": list(range(17))},
    256: {"scheduler.depth": [1, 2, 3, 4], "workload.concurrency": [1, 2, 4, 8, 16, 32, 64, 128],
          "engine.speculation.k": [1, 2, 3, 4, 5, 6, 7, 8]},
    64: {"scheduler.depth": [1, 2, 3, 4], "workload.concurrency": [1, 2, 4, 8], "engine.speculation.k": [1, 2, 3, 4]},
}


def scenario(points: int) -> dict:
    return {
        "name": "overhead", "seed": 0,
        "workload": {"num_requests": 8, "prompt_len": {"dist": "uniform", "min": 128, "max": 512},
                     "output_len": {"dist": "fixed", "value": 96}, "kinds": {"code_edit": 0.5, "free": 0.5}},
        "engine": {"model": "llama-3-8b", "speculation": {"proposer": "ngram_gpu", "acceptance": {"model": "replay"}}},
        "sweep": SWEEPS[points],
    }  # fmt: skip


def timed_run(tree: Path, scenario_path: Path, out: Path) -> tuple[float, float, Path]:
    """Wall time of `simharness run` from `tree` (start-up, points, combined tables, report), the CPU time (user and
    system) of it and every process it started, and its run directory."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "simharness", "run", str(scenario_path), "--out", str(out)], cwd=tree,
                   env=env, check=True, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return wall, cpu, next(out.glob("*/*/"))


def fingerprint(run_dir: Path, traces: dict[str, set[str]]) -> str:
    """A digest of the run's results: summary.csv, the run-level tables' contents, frontier.csv, the plots' bytes and
    report.md but for its line naming the run (its id and source digest); each trace file's digest is added to
    `traces` (by file name)."""
    digest = hashlib.sha256((run_dir / "summary.csv").read_bytes())
    for path in [run_dir / "frontier.csv", *sorted((run_dir / "plots").glob("*.png"))]:
        if path.is_file():
            digest.update(path.name.encode() + path.read_bytes())
    report = (run_dir / "report.md").read_text().splitlines()
    digest.update("\n".join(line for line in report if not line.startswith("Run `")).encode())
    for name in TABLES:
        table = pd.read_parquet(run_dir / f"{name}.parquet")
        digest.update(",".join(f"{c}:{t}" for c, t in table.dtypes.items()).encode())
        digest.update(pd.util.hash_pandas_object(table, index=False).to_numpy().tobytes())
    for path in sorted((run_dir / "traces").iterdir()):
        traces.setdefault(path.name, set()).add(hashlib.sha256(path.read_bytes()).hexdigest()[:16])
    return digest.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, action="append", help="a source tree to time (repeatable)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--points", type=int, choices=sorted(SWEEPS), default=1088)
    args = parser.parse_args()
    trees = [t.resolve() for t in args.tree or [ROOT]]
    work = Path(tempfile.mkdtemp(prefix="sweep-overhead-"))
    scenario_path = work / "overhead.yaml"
    scenario_path.write_text(yaml.safe_dump(scenario(args.points), sort_keys=False))
    print(f"{args.points} points of 8 requests; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f} "
          f"{os.getloadavg()[1]:.2f} at the start", flush=True)
    for tree in trees:  # a first run compiles the tree's numba functions (cached beside them): not timed
        timed_run(tree, scenario_path, work / "warm-up")
        shutil.rmtree(work / "warm-up")
    walls: dict[Path, list[float]] = {tree: [] for tree in trees}
    cpus: dict[Path, list[float]] = {tree: [] for tree in trees}
    prints: set[str] = set()
    traces: dict[str, set[str]] = {}
    for repeat in range(args.repeats):
        for tree in trees:
            out = work / f"run-{repeat}"
            wall, cpu, run_dir = timed_run(tree, scenario_path, out)
            walls[tree].append(wall)
            cpus[tree].append(cpu)
            prints.add(fingerprint(run_dir, traces))
            print(f"  run {repeat + 1}, {tree}: {wall:.1f} s ({wall / args.points * 1e3:.1f} ms a point; CPU "
                  f"{cpu:.1f} s; load average {os.getloadavg()[0]:.2f} after)", flush=True)
            shutil.rmtree(out)
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} at the end")
    print("| tree | median ms a point | min-max | median CPU ms a point | min-max |")
    print("|---|---|---|---|---|")
    for tree in trees:
        wall, cpu = ([t / args.points * 1e3 for t in times] for times in (walls[tree], cpus[tree]))
        print(f"| {tree} | {statistics.median(wall):.1f} | {min(wall):.1f}-{max(wall):.1f} | "
              f"{statistics.median(cpu):.1f} | {min(cpu):.1f}-{max(cpu):.1f} |")
    print(f"results identical in every run: {'yes' if len(prints) == 1 else 'NO: ' + ', '.join(sorted(prints))}")
    differ = sorted(name for name, digests in traces.items() if len(digests) > 1)
    same = "the same bytes in every run that wrote it" if not differ else "DIFFER: " + ", ".join(differ)
    print(f"{len(traces)} trace files: {same}")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
