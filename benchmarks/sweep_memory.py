"""Peak resident memory of the process that drives a large sim sweep (1,000 points of 200 requests by default).

This process is the driver, doing what `simharness run` does: it runs the sweep (points in `--workers` local
processes, or here with `--workers 0`) writing each point as it arrives, then combines the run's tables while it
renders the report (`runner.combine_and_report`). Printed: the driver's peak RSS (getrusage) after the points and
after the rest, the largest worker's, the wall time, and how large the run's combined tables are uncompressed:
what the driver would hold if it kept every point's records at once. Usage:

    python benchmarks/sweep_memory.py [--points 1000] [--requests 200] [--workers 2] [--out DIR] [--resume RUN]
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from simharness.results import TABLES
from simharness.runner import combine_and_report, execute
from simharness.scenario import scenario_from_dict, sweep_points

# 40 modes (depth x k x policy x invalid slots) x 25 concurrencies = 1,000 points
MODES = {"scheduler.depth": [1, 2], "engine.speculation.k": [1, 2, 3, 4, 5], "scheduler.policy": ["wait", "optimistic"],
         "engine.speculation.invalid_slots": ["trim", "fill"]}


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=1000, help="a multiple of 40")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2, help="0: run the points in this process")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--resume", type=Path, default=None, help="finish this run directory of the same sweep")
    args = parser.parse_args()
    concurrencies = [2 * (i + 1) for i in range(max(1, args.points // 40))]
    sc = scenario_from_dict({"name": "memory", "workload": {"num_requests": args.requests},
                             "engine": {"speculation": {"proposer": "ngram_gpu"}},
                             "sweep": {**MODES, "workload.concurrency": concurrencies}})  # fmt: skip
    out = args.out or Path(tempfile.mkdtemp(prefix="sweep-memory-"))
    start = time.perf_counter()
    run_dir = execute(sc, sweep_points(sc), out, resume=args.resume, workers=args.workers or None)
    peaks = {"points": peak_mib()}
    summary = combine_and_report(run_dir)
    peaks["tail"] = peak_mib()
    wall = time.perf_counter() - start
    worker = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(f"{len(summary)} points x {args.requests} requests, workers: {args.workers or 'this process'}"
          f"{f', resuming {args.resume}' if args.resume else ''}; {wall:.0f} s; run directory {run_dir}")
    print(f"driver peak RSS: {peaks['tail']:.0f} MiB (after the points {peaks['points']:.0f}, after combining the "
          f"tables beside the report {peaks['tail']:.0f}); largest worker's: {worker:.0f} MiB")
    total = 0
    for name in TABLES:
        meta = pq.read_metadata(run_dir / f"{name}.parquet")
        size = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)) / 2**20
        total += size
        print(f"  {name}: {meta.num_rows:,} rows, {size:.0f} MiB uncompressed")
    print(f"  all tables: {total:.0f} MiB uncompressed")


if __name__ == "__main__":
    main()
