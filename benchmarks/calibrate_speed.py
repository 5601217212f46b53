"""Wall time of `simharness calibrate` on a committed hil run and of a 64-point sim sweep with `repeats: 5`
(320 points, report included), each measured `--repeats` times in fresh processes. Usage:

    python benchmarks/calibrate_speed.py [--repeats 3] [--hil results/hil/20261123-171526]

Goals (issue 17): calibration of a 100-point hil run under a minute, the sweep under 2 minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SWEEP = """\
name: repeats-speed
seed: 0
repeats: 5
workload: {arrival: closed, num_requests: 48, prompt_len: {dist: uniform, min: 128, max: 512},
           output_len: {dist: fixed, value: 96}, kinds: {code_edit: 0.5, free: 0.5}}
engine: {gpu: H100, model: llama-3-8b, speculation: {proposer: ngram_gpu, k: 4, invalid_slots: fill}}
sweep:
  engine.speculation.proposer: [ngram_cpu, ngram_gpu]
  scheduler.policy: [wait, optimistic]
  scheduler.depth: [1, 2]
  workload.concurrency: [1, 2, 4, 8, 16, 32, 64, 128]
report: {trace_steps: 200}
"""


def timed(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hil", type=Path, default=Path("results/hil/20261123-171526"))
    args = parser.parse_args()
    cli = [sys.executable, "-m", "simharness"]
    with tempfile.TemporaryDirectory() as tmp:
        scenario = Path(tmp) / "sweep.yaml"
        scenario.write_text(SWEEP)
        cases = {
            f"calibrate {args.hil}": cli + ["calibrate", str(args.hil), "--out", f"{tmp}/costs.yaml"],
            "64-point sim sweep, repeats: 5": cli + ["run", str(scenario), "--out", f"{tmp}/runs"],
        }
        for name, command in cases.items():
            times = [timed(command) for _ in range(args.repeats)]
            print(f"{name}: median {statistics.median(times):.1f} s, min {min(times):.1f}, max {max(times):.1f} "
                  f"over {len(times)} runs (process start included)")


if __name__ == "__main__":
    main()
