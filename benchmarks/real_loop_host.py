"""The real loop's own host time per decode step against the modelled host work it is charged against.

The real level spins the modelled scheduler and output-processor time less the loop's own host time since the last
such work (`realloop.RealLoop.work`); where its own time is longer, the rest lengthens the step's period, and the
real level is slower than the engine it models (results/fidelity/CONTENTS.md, `20261127-151245`). This measures,
per concurrency, the median over a run's decode-only steps of the harness's host time (`Step.harness_s`) and of
the modelled schedule + update time (the hil level's records of the same point: its clock is virtual, so its
modelled phases are the model's), over several runs. Usage:

    python benchmarks/real_loop_host.py [--scenario S] [--concurrency 1 16] [--runs 5] [--set PATH=VALUE ...]

The default scenario runs the tiny model on the CPU (the device work then runs inside the launch and is engine
time, so the harness time is what it is on any device); on the GPU machine pass `scenarios/fidelity.yaml`.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from tempfile import TemporaryDirectory

import simharness
from simharness.overrides import parse_sets
from simharness.scenario import Workload

ROOT = Path(__file__).resolve().parents[1]


def decode_medians(sc, out: str) -> tuple[float, float]:
    """One run's medians over its decode-only steps (µs): harness time, and modelled schedule + update time."""
    steps = simharness.run(sc, out=out).steps
    decode = steps[steps["n_prefill_reqs"] == 0]
    modelled = (decode["schedule_end"] - decode["schedule_start"]) + (decode["update_end"] - decode["update_start"])
    return float(decode["harness_s"].median()) * 1e6, float(modelled.median()) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", type=Path, default=ROOT / "scenarios/fidelity-cpu.yaml")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--set", action="append", default=[], metavar="PATH=VALUE")
    args = ap.parse_args()
    # two requests a user (num_requests back at its default, which is what leaves requests_per_user to count)
    base = {"sweep": {}, "scheduler.depth": 1, "scheduler.policy": "wait", "engine.speculation.proposer": "ngram_gpu",
            "workload.output_len": {"dist": "uniform", "min": 100, "max": 150}, "workload.requests_per_user": 2,
            "workload.num_requests": Workload.model_fields["num_requests"].default, **parse_sets(args.set)}
    print(f"{'concurrency':>11} {'harness µs (median, min-max)':>30} {'modelled µs':>12} {'harness / modelled':>19}")
    with TemporaryDirectory() as out:
        for c in args.concurrency:
            point = {**base, "workload.concurrency": c}
            real = simharness.load_scenario(args.scenario, {**point, "engine.level": "real"})
            hil = simharness.load_scenario(args.scenario, {**point, "engine.level": "hil"})
            decode_medians(real, out)  # warm-up: compiles, caches
            harness = [decode_medians(real, out)[0] for _ in range(args.runs)]
            modelled = decode_medians(hil, out)[1]
            h = statistics.median(harness)
            print(f"{c:>11} {h:>12.1f} ({min(harness):.1f}-{max(harness):.1f}){'':>6} {modelled:>12.1f} "
                  f"{h / modelled:>19.2f}", flush=True)


if __name__ == "__main__":
    main()
