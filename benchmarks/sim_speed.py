"""Simulated decode steps per second at concurrency 64, k = 4, next to a bare two-process SimPy loop.

The bare loop is the floor of any SimPy engine model: a host process that launches a step and a
GPU process that runs it, exchanging one event each way. Both are measured in the same run, so
their ratio is meaningful on a noisy shared machine. Usage:

    python benchmarks/sim_speed.py [--repeats 5] [--steps 20000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import simpy

from simharness.model_backend import model_backend
from simharness.modes import resolve_mode
from simharness.scenario import scenario_from_dict
from simharness.simulation import Simulation
from simharness.workload import build_requests


def bare_loop_rate(n_steps: int) -> float:
    """Steps/s of a host process and a GPU process handing steps through a store."""
    env = simpy.Environment()
    stream = simpy.Store(env)

    def gpu():
        while True:
            done = yield stream.get()
            yield env.timeout(1e-3)
            done.succeed()

    def host():
        for _ in range(n_steps):
            yield env.timeout(1e-4)
            done = env.event()
            stream.put(done)
            yield done

    env.process(gpu())
    t = time.perf_counter()
    env.run(until=env.process(host()))
    return n_steps / (time.perf_counter() - t)


def harness_rate(depth: int, policy: str, invalid: str, acceptance: str) -> tuple[float, int]:
    """Steps/s of the full model at concurrency 64, k = 4 (workload and tables built beforehand)."""
    sc = scenario_from_dict(
        {
            "name": "speed",
            "workload": {"arrival": "closed", "concurrency": 64, "num_requests": 1200,
                         "prompt_len": {"dist": "uniform", "min": 128, "max": 512},
                         "output_len": {"dist": "fixed", "value": 256}},
            "engine": {"speculation": {"proposer": "ngram_gpu", "k": 4, "invalid_slots": invalid,
                                       "acceptance": {"model": acceptance, "alpha": 0.7}}},
            "scheduler": {"depth": depth, "policy": policy},
        }
    )
    requests = build_requests(sc.workload, sc.seed)
    mode = resolve_mode(sc)
    sim = Simulation(sc, requests, mode, model_backend(sc, requests, mode))
    t = time.perf_counter()
    records, _ = sim.run()
    return len(records.steps) / (time.perf_counter() - t), len(records.steps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20000)
    args = ap.parse_args()
    cases = [(1, "wait", "trim", "iid"), (2, "optimistic", "fill", "iid"), (2, "wait", "trim", "iid"),
             (2, "optimistic", "fill", "replay")]
    bare = []
    rates: dict[tuple, list[float]] = {c: [] for c in cases}
    for _ in range(args.repeats):  # interleave so machine noise hits every case alike
        bare.append(bare_loop_rate(args.steps))
        for c in cases:
            rates[c].append(harness_rate(*c)[0])
    b = statistics.median(bare)
    print(f"bare two-process SimPy loop: {b:,.0f} steps/s (median of {args.repeats})")
    # The machine's speed drifts between repeats: each repeat's ratio is taken against the bare loop measured
    # just before it, and the table gives the median of those ratios (with their range).
    print("| depth | policy | slots | acceptance | steps/s (median) | vs bare loop (median of repeats) | range |")
    print("|---|---|---|---|---|---|---|")
    for c, r in rates.items():
        ratios = [x / y for x, y in zip(r, bare, strict=True)]
        print(f"| {c[0]} | {c[1]} | {c[2]} | {c[3]} | {statistics.median(r):,.0f} | {statistics.median(ratios):.0%} "
              f"| {min(ratios):.0%}–{max(ratios):.0%} |")


if __name__ == "__main__":
    main()
