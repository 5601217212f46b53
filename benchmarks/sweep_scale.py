"""Wall time of one sweep run serially, in local worker processes, on a local Ray cluster the run starts and on
one already running; or, with --gpu, a hil sweep on one GPU and on two (one worker pinned to each).

Each configuration is the `simharness run` command itself (a fresh process: start-up, worker start, the cluster's
start and the final report all count), run in turn `--repeats` times; the table gives the median wall time, the
spread (min-max) and the speed-up against the first configuration, and checks that every run's summary.csv is
the same bytes (sim) or has every point (hil). The machine's load average is printed before and after, and how
many times the work of one CPU-bound process two of them do at once: on a shared machine that, not the core
count, bounds what two workers can gain. Usage:

    python benchmarks/sweep_scale.py [--repeats 2] [--requests 200] [--out DIR]  # 64 sim points, 2 workers
    python3 benchmarks/sweep_scale.py --gpu --out $OUT         # a 2-GPU machine: 32 hil points (about 4 minutes)

Each run directory is deleted once its summary is checked, unless --keep-runs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

SIM = {  # 64 points: 8 concurrencies x depth 1/2 x k 2/4 x wait/optimistic
    "name": "scale-sim",
    "seed": 0,
    "workload": {"num_requests": 200, "prompt_len": {"dist": "uniform", "min": 128, "max": 512},
                 "output_len": {"dist": "uniform", "min": 64, "max": 128}, "kinds": {"code_edit": 0.5, "free": 0.5}},
    "engine": {"model": "llama-3-8b", "speculation": {"proposer": "ngram_gpu", "acceptance": {"model": "replay"}}},
    "sweep": {"workload.concurrency": [1, 2, 4, 8, 16, 32, 64, 128], "scheduler.depth": [1, 2],
              "engine.speculation.k": [2, 4], "scheduler.policy": ["wait", "optimistic"]},
}
# 32 hil points of scenarios/hil.yaml (ngram_cpu runs at depth 1 whatever the depth asked, as in vLLM)
HIL_SWEEP = {"engine.speculation.proposer": ["ngram_gpu", "ngram_cpu"], "scheduler.policy": ["wait", "optimistic"],
             "scheduler.depth": [1, 2], "workload.concurrency": [4, 8, 16, 32]}


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _spin(n: int) -> int:
    total = 0
    for i in range(n):
        total += i * i % 7
    return total


def parallelism(n: int = 10_000_000) -> float:
    """How many times the work of one CPU-bound process two such processes do in the same wall time, now: the
    ceiling of a 2-worker speed-up on this machine while others share it (2.0 on two idle cores)."""
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        pool.map(_spin, [1000, 1000])  # both started
        start = time.perf_counter()
        pool.map(_spin, [n])
        one = time.perf_counter() - start
        start = time.perf_counter()
        pool.map(_spin, [n, n], chunksize=1)
        two = time.perf_counter() - start
    return 2 * one / two


def timed_run(scenario: Path, out: Path, options: list[str], watch_gpus: bool) -> tuple[float, Path, set[str]]:
    """One `simharness run`: its wall time, run directory and (with watch_gpus) the GPUs its processes used."""
    cmd = [sys.executable, "-m", "simharness", "run", str(scenario), "--out", str(out), *options]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    used: set[str] = set()
    done = threading.Event()
    watch_gpus = watch_gpus and shutil.which("nvidia-smi") is not None
    watcher = threading.Thread(target=_watch_gpus, args=(used, done), daemon=True) if watch_gpus else None
    if watcher:
        watcher.start()
    start = time.perf_counter()
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    done.set()
    if result.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    run_dir = Path(result.stdout.split("report:")[-1].strip()).parent
    return wall, run_dir, used


def start_cluster() -> str:
    """A local Ray cluster of 2 CPUs, started before a `--ray auto` run joins it (as a Ray user has one up): that
    configuration's wall time leaves out the cluster's start and stop. Returns the `ray` command."""
    ray = str(Path(sys.executable).parent / "ray")
    started = subprocess.run([ray, "start", "--head", "--num-cpus=2", "--include-dashboard=false",
                              "--disable-usage-stats"], capture_output=True, text=True)
    if started.returncode != 0:
        sys.exit(f"ray start failed:\n{started.stderr[-2000:]}")
    return ray


def _watch_gpus(used: set[str], done: threading.Event) -> None:
    """The GPUs (bus ids) on which a compute process runs, sampled each second: shows that workers are pinned."""
    while not done.wait(1.0):
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=gpu_bus_id", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout
        used.update(line.strip() for line in out.splitlines() if line.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="hil points on CUDA: --workers 1 vs --workers 2")
    parser.add_argument("--repeats", type=int, default=None, help="runs of each configuration (sim 2, hil 1)")
    parser.add_argument("--requests", type=int, default=None, help="requests per point (sim 200, hil 64)")
    parser.add_argument("--out", type=Path, default=None, help="write scale.json (and kept runs) here")
    parser.add_argument("--keep-runs", action="store_true",
                        help="keep every run directory (a 64-point run of 4,000-request points is about 1.8 GB)")
    parser.add_argument("--scenario", type=Path, default=ROOT / "scenarios" / "hil.yaml",
                        help="--gpu: the hil scenario whose sweep is replaced (hil-cpu.yaml: try it on a CPU)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="sweep-scale-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.gpu:
        scenario = yaml.safe_load(args.scenario.read_text())
        scenario.update(name="scale-hil", sweep=HIL_SWEEP)
        scenario["workload"]["num_requests"] = args.requests or 64
        configs = {"1 GPU": ["--workers", "1"], "2 GPUs": ["--workers", "2"]}
    else:
        scenario = {**SIM, "workload": {**SIM["workload"], "num_requests": args.requests or 200}}
        configs = {"serial": [], "--workers 2": ["--workers", "2"], "--ray local": ["--ray", "local"],
                   "--ray auto (running cluster)": ["--ray", "auto"]}
    path = out / f"{scenario['name']}.yaml"
    path.write_text(yaml.safe_dump(scenario, sort_keys=False))
    points = 1
    for values in scenario["sweep"].values():
        points *= len(values)
    print(f"{points} {'hil' if args.gpu else 'sim'} points, {scenario['workload']['num_requests']} requests each; "
          f"{os.cpu_count()} CPUs; load average {load()} (1, 5, 15 min); 2 processes do {parallelism():.2f}x the "
          "work of one")
    if args.gpu:  # fill the kernel and numba caches on disk first, so no configuration pays for them
        warm = {**scenario, "name": "scale-warm", "sweep": {"workload.concurrency": [4]}}
        (out / "warm.yaml").write_text(yaml.safe_dump(warm, sort_keys=False))
        timed_run(out / "warm.yaml", out / "runs", [], watch_gpus=False)
    walls: dict[str, list[float]] = {name: [] for name in configs}
    summaries, gpus = set(), {}
    for _ in range(args.repeats or (1 if args.gpu else 2)):
        for name, options in configs.items():
            ray = start_cluster() if "auto" in options else None  # not timed: a Ray user's cluster is up
            wall, run_dir, used = timed_run(path, out / "runs", options, watch_gpus=args.gpu)
            if ray is not None:
                subprocess.run([ray, "stop"], capture_output=True)
            walls[name].append(wall)
            gpus[name] = sorted(used)
            summary = (run_dir / "summary.csv").read_bytes()
            assert summary.count(b"\n") == points + 1, f"{run_dir}: not every point finished"
            summaries.add(summary)
            if not args.keep_runs:
                shutil.rmtree(run_dir)
            print(f"  {name}: {wall:.1f} s  ({run_dir})", flush=True)
    base = statistics.median(next(iter(walls.values())))
    print(f"\n| configuration | median wall s | min-max s | speed-up |{' GPUs used |' if args.gpu else ''}")
    print(f"|---|---|---|---|{'---|' if args.gpu else ''}")
    for name, times in walls.items():
        median = statistics.median(times)
        extra = f" {', '.join(gpus[name])} |" if args.gpu else ""
        print(f"| {name} | {median:.1f} | {min(times):.1f}-{max(times):.1f} | {base / median:.2f}x |{extra}")
    same = len(summaries) == 1 if not args.gpu else None  # measured points differ from run to run
    ceiling = parallelism()
    print(f"\nload average after: {load()}; 2 processes do {ceiling:.2f}x the work of one"
          + ("" if args.gpu else f"; summary.csv identical across runs: {same}"))
    facts = {"points": points, "cpus": os.cpu_count(), "walls_s": walls, "gpus_used": gpus,
             "summary_identical": same, "load_after": load(), "parallelism_after": ceiling}
    (out / "scale.json").write_text(json.dumps(facts, indent=1))


if __name__ == "__main__":
    main()
