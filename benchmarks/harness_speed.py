"""The speed of three pieces of the sim level's own work, medians over repeats (timings belong here, not in tests).

- `propose_ngram_row` on a 4k-token history (the replay acceptance model calls it every simulated step);
- `build_requests` of 1,000 requests (replayed text, per-request drafts);
- `compute_metrics` over a long run (5,000 requests, 100k emissions, 20k steps).

Usage: python benchmarks/harness_speed.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import pandas as pd

from simharness.corpus import load_corpus
from simharness.kernels.ngram_row import propose_ngram_row
from simharness.metrics import compute_metrics
from simharness.records import REQUEST_COLUMNS, STEP_COLUMNS, SYNC_COLUMNS
from simharness.scenario import Goodput, Workload
from simharness.workload import build_requests


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    fn()  # warm-up (numba compiles, caches fill)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def long_run() -> Callable[[], object]:
    rng = np.random.default_rng(0)
    n_req, n_emit, n_steps = 5_000, 100_000, 20_000
    rid = rng.integers(0, n_req, n_emit)
    emissions = pd.DataFrame({"request_id": rid, "step": np.arange(n_emit), "time_s": rng.random(n_emit) * 100,
                              "tokens": rng.integers(1, 5, n_emit)})
    first = emissions.groupby("request_id")["time_s"].min()
    last = emissions.groupby("request_id")["time_s"].max()
    requests = pd.DataFrame({"request_id": first.index, "arrival_s": 0.0, "output_tokens": 20, "kind": "free",
                             "prompt_tokens": 10, "first_token_s": first.values, "last_token_s": last.values},
                            columns=REQUEST_COLUMNS).fillna(0)
    steps = pd.DataFrame(0.0, index=range(n_steps), columns=STEP_COLUMNS)
    steps["step"] = np.arange(n_steps)
    steps["gpu_start"] = np.arange(n_steps) * 1e-3
    steps["gpu_end"] = steps["gpu_start"] + 0.9e-3
    for i in range(4):
        steps[f"acc_pos_{i}"] = 0
    syncs = pd.DataFrame(columns=SYNC_COLUMNS)
    return lambda: compute_metrics(requests, emissions, steps, syncs, duration_s=100.0, percentiles=[50, 90, 99],
                                   goodput=Goodput(tpot_ms=50), k=4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    history = np.random.default_rng(0).integers(0, 200, 4096)
    load_corpus()
    cases = {
        "propose_ngram_row, 4k history": (lambda: propose_ngram_row(history, min_n=2, max_n=5, k=4), 200),
        "build_requests, 1000 requests": (lambda: build_requests(Workload(num_requests=1000), seed=0), 1),
        "compute_metrics, 20k steps": (long_run(), 1),
    }
    print(f"{'case':34} {'median':>12} {'min':>12} {'max':>12}")
    for name, (fn, inner) in cases.items():
        times = [t / inner for t in timed(lambda fn=fn, inner=inner: [fn() for _ in range(inner)], args.repeats)]
        print(f"{name:34} {statistics.median(times) * 1e3:10.3f}ms {min(times) * 1e3:10.3f}ms "
              f"{max(times) * 1e3:10.3f}ms")


if __name__ == "__main__":
    main()
