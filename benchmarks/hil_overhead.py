"""The harness's own host time per real step in a hardware-in-the-loop run, next to the step's device time.

Runs the points of a hil scenario (by default `scenarios/hil.yaml` at concurrency 64, ngram_gpu, optimistic,
depth 1/2/3) on the real decode loop and reads the steps table: `harness_s` is the host time per read-back
step spent outside the engine's measured work (the SimPy model, the scheduler, the host's mirror of the
device, the records). The goal is below 10% of the step's device time at concurrency 64 on the GPU machine.
A breakdown times the scheduler's calls, the backend's bookkeeping after each readback, the slot
release and the GPU gates (CUDA) by wrapping them; the rest is the SimPy model and the records. Usage:

    python benchmarks/hil_overhead.py [--scenario scenarios/hil.yaml] [--set K=V]... [--depths 1 2 3]
"""

from __future__ import annotations

import argparse
import functools
import time

import numpy as np

from simharness.engine import torch_backend
from simharness.measured import MeasuredEngine
from simharness.modes import resolve_mode
from simharness.overrides import parse_value
from simharness.scenario import load_scenario, sweep_points
from simharness.simulation import Simulation
from simharness.workload import build_requests

DEFAULTS = {"workload.concurrency": 64, "engine.speculation.proposer": "ngram_gpu", "scheduler.policy": "optimistic"}


def timed(obj, name: str, totals: dict[str, float], key: str | None = None) -> None:
    """Replace `obj.name` by a wrapper adding its wall time to `totals[key or name]`."""
    f = getattr(obj, name)
    key = key or name

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - t

    setattr(obj, name, wrapper)


def run_point(sc, requests, hil: MeasuredEngine, *, breakdown: bool) -> tuple[object, dict[str, float], float]:
    """Run one point on the real decode loop; with `breakdown`, also time the harness's pieces (the
    wrappers add a little host time of their own, so the headline figures come from a run without them)."""
    mode = resolve_mode(sc)
    backend = hil.backend(sc, requests, mode)
    sim = Simulation(sc, requests, mode, backend)
    totals = dict.fromkeys(["schedule", "settle", "release", "gate", "run_step", "run_step_measured", "read_back"],
                           0.0)  # fmt: skip
    if breakdown:
        timed(sim.core.sched, "schedule", totals)
        timed(sim.core.sched, "settle", totals)
        timed(backend, "release", totals)
        if backend.timing is not None:  # CUDA only: the GPU gate before each launch part
            timed(backend.timing, "before", totals, "gate")
        # bookkeeping after a readback = run's wall time less what it counts as measured (wait and copy)
        inside_run_step = [False]
        run_step, leave = backend.run, backend._leave

        def run_step_timed(step):
            inside_run_step[0] = True
            t0 = time.perf_counter()
            try:
                return run_step(step)
            finally:
                inside_run_step[0] = False
                totals["run_step"] += time.perf_counter() - t0

        def leave_timed(t0: float) -> float:
            dt = leave(t0)
            if inside_run_step[0]:
                totals["run_step_measured"] += dt
            return dt

        backend.run, backend._leave = run_step_timed, leave_timed
        # the compiled pass of the bookkeeping (a module global that run looks up at each call)
        read_back = torch_backend.read_back

        def read_back_timed(*args) -> None:
            t0 = time.perf_counter()
            read_back(*args)
            totals["read_back"] += time.perf_counter() - t0

        torch_backend.read_back = read_back_timed
    t = time.perf_counter()
    try:
        with backend.syncs:
            records, _ = sim.run()
    finally:
        if breakdown:
            torch_backend.read_back = read_back
    return records.steps_frame(), totals, time.perf_counter() - t


def measure(sc, requests, hil: MeasuredEngine, *, breakdown: bool) -> dict[str, float]:
    """One point: medians over its decode steps of device time, harness time and their ratio, the ratio of
    the run's totals, and (with `breakdown`) the mean host time per step of each harness piece (µs)."""
    steps, _, wall = run_point(sc, requests, hil, breakdown=False)
    n = len(steps)
    decode = steps[steps.n_prefill_reqs == 0]
    device = (decode.gpu_end - decode.gpu_start).to_numpy()
    harness = decode.harness_s.to_numpy()
    row = {
        "steps": n,
        "decode_steps": len(decode),
        "device_us": float(np.median(device)) * 1e6,
        "harness_us": float(np.median(harness)) * 1e6,
        "ratio_median": float(np.median(harness / device)),
        "ratio_total": float(steps.harness_s.sum() / (steps.gpu_end - steps.gpu_start).sum()),
        "wall_per_step_us": wall / n * 1e6,
    }
    if breakdown:
        steps, totals, _ = run_point(sc, requests, hil, breakdown=True)
        n = len(steps)
        bookkeeping = totals["run_step"] - totals["run_step_measured"]
        pieces = {"schedule": totals["schedule"], "settle": totals["settle"], "bookkeeping": bookkeeping,
                  "release": totals["release"], "gate": totals["gate"]}
        pieces["rest"] = float(steps.harness_s.sum()) - sum(pieces.values())  # the SimPy model and the records
        pieces["read_back"] = totals["read_back"]  # part of bookkeeping: its compiled pass
        row.update({f"{k}_us": v / n * 1e6 for k, v in pieces.items()})
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", default="scenarios/hil.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="K=V")
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--repeats", type=int, default=1, help="runs of each point (medians are reported per run)")
    ap.add_argument("--breakdown", action="store_true", help="one more run per point, timing the harness's pieces")
    args = ap.parse_args()
    overrides = dict(DEFAULTS)
    overrides.update({k: parse_value(v) for k, v in (s.split("=", 1) for s in args.set)})
    overrides["sweep"] = {"scheduler.depth": args.depths}
    points = sweep_points(load_scenario(args.scenario, overrides))
    first = points[0].scenario
    requests = build_requests(first.workload, first.seed)
    hil = MeasuredEngine([(p.scenario, resolve_mode(p.scenario)) for p in points], lambda sc: requests)
    print(f"# {args.scenario} with {overrides}; model {first.engine.model} on {hil.model.device}", flush=True)
    cols = ["steps", "decode_steps", "device_us", "harness_us", "ratio_median", "ratio_total", "wall_per_step_us"]
    if args.breakdown:
        cols += ["schedule_us", "settle_us", "bookkeeping_us", "read_back_us", "release_us", "gate_us", "rest_us"]
    print("| point | run | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 2) + "|")
    for p in points:
        for run in range(args.repeats):
            row = measure(p.scenario, requests, hil, breakdown=args.breakdown)
            print(f"| {p.id} | {run} | " + " | ".join(f"{row[c]:.3g}" for c in cols) + " |", flush=True)


if __name__ == "__main__":
    main()
