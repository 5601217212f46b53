"""Does CPython's garbage collector pause the measured levels? Every collection inside each measured run, by
generation and length, with the run's metrics and its host time per prefilled prompt.

    python3 benchmarks/gc_probe.py                      # the fidelity scenario's probe points at the real level
    python3 benchmarks/gc_probe.py --freeze             # gc.collect() and gc.freeze() before each measured run
    python3 benchmarks/gc_probe.py --set engine.device=cpu --set engine.model=tiny --set engine.cuda_graphs=false \\
        --set workload.requests_per_user=1 --repeats 1   # a dry run on the CPU

Each probe point (`ngram_gpu`/`ngram_cpu` x concurrency 16/64, `optimistic`, depth 2, by default) is warmed up and
measured `--repeats` times in this one process, in turn, as a sweep with repeats would; `gc.callbacks` time every
collection during the measured run only. vLLM freezes its start-up heap (`gc.freeze()`) for the same worry; the
probe says whether the harness needs to. docs/hil.md ("Prefill through CUDA graphs") has the H100 result: no
generation-2 collection inside a measured run, under 0.4 ms of collections a run, with or without the freeze.
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np
import pandas as pd

import simharness
from simharness.measured import MeasuredEngine, run_level, warm_up
from simharness.metrics import compute_metrics
from simharness.models import checkpoint_dir
from simharness.modes import resolve_mode
from simharness.overrides import parse_sets
from simharness.pointwork import run_on_clock
from simharness.workload import build_requests

PROBE = {"engine.level": "real", "scheduler.policy": "optimistic", "scheduler.depth": 2,
         "sweep": {"engine.speculation.proposer": ["ngram_gpu", "ngram_cpu"], "workload.concurrency": [16, 64]}}


class Collections:
    """Every garbage collection while active: (generation, seconds)."""

    def __init__(self) -> None:
        self.done: list[tuple[int, float]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.done.append((info["generation"], time.perf_counter() - self._start))

    def __enter__(self) -> Collections:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


def probe_run(sc, requests, mode, engine: MeasuredEngine, freeze: bool) -> dict:
    """Warm the point up, then measure it at its level with every collection timed."""
    warm_up(sc, requests, mode, engine.model, run_on_clock)
    if freeze:
        gc.collect()
        gc.freeze()
    with Collections() as collections:
        records, duration, _ = run_level(sc, requests, mode, engine.model, run_on_clock)
    steps = records.steps_frame()
    prefill = steps[steps["n_prefill_reqs"] > 0]
    per_prompt_ms = (prefill["launch_end"] - prefill["prep_end"]) / prefill["n_prefill_reqs"] * 1e3
    metrics = compute_metrics(records.requests, records.emissions_frame(), steps, records.syncs_frame(),
                              duration_s=duration, percentiles=[99], goodput=sc.report.goodput, k=mode.k)
    pauses = [s for _, s in collections.done]
    return {"mean_tpot_ms": metrics["mean_tpot_ms"], "p99_tpot_ms": metrics["p99_tpot_ms"],
            **{f"gen{g}": sum(1 for gen, _ in collections.done if gen == g) for g in range(3)},
            "gc_total_ms": sum(pauses) * 1e3, "gc_max_ms": max(pauses, default=0.0) * 1e3,
            "prefill_ms_per_prompt": float(np.median(per_prompt_ms)) if len(per_prompt_ms) else np.nan}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default="scenarios/fidelity.yaml")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--freeze", action="store_true", help="gc.collect() and gc.freeze() before each measured run")
    ap.add_argument("--set", action="append", default=[], metavar="PATH=VALUE", help="override the scenario")
    args = ap.parse_args()
    overrides = {**PROBE, **parse_sets(args.set)}
    points = simharness.sweep_points(simharness.load_scenario(args.scenario, overrides))
    modes = [resolve_mode(p.scenario) for p in points]

    def requests(sc):
        return build_requests(sc.workload, sc.seed, checkpoint_dir(sc.engine.model))

    workloads = {p.index: requests(p.scenario) for p in points}
    engine = MeasuredEngine([(p.scenario, m) for p, m in zip(points, modes, strict=True)], requests)
    rows = []
    for repeat in range(args.repeats):
        for p, mode in zip(points, modes, strict=True):
            row = probe_run(p.scenario, workloads[p.index], mode, engine, args.freeze)
            rows.append({"point": p.id, "repeat": repeat, **row})
            print(f"{p.id} repeat {repeat}: mean TPOT {row['mean_tpot_ms']:.3f} ms, collections "
                  f"{row['gen0']}/{row['gen1']}/{row['gen2']} taking {row['gc_total_ms']:.2f} ms", flush=True)
    print(f"\n{engine.describe()}; gc.freeze before each run: {args.freeze}")
    print(pd.DataFrame(rows).round(3).to_string(index=False))


if __name__ == "__main__":
    main()
