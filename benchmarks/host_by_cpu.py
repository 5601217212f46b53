"""The host phases of one measured point, each run in a fresh process pinned to one CPU (and some unpinned): does a
process's host speed depend on the CPU it runs on? Usage (on the GPU machine):

    python benchmarks/host_by_cpu.py --cpus 0 1 2 8 --unpinned 2 --out DIR [--scenario S] [--set PATH=VALUE ...]

Each process runs SCENARIO (one point: the overrides must leave no sweep) under `taskset -c CPU`, with the host
gauge's workload (`simharness.hostspeed`) timed in it before and after the run, and with no CUDA at all in a
process of its own first (`--bare`, the interpreter alone). Prints and writes (DIR/host-by-cpu.csv) per process
the medians over its decode-only steps of each host phase (µs, `metrics.host_intervals`' phases: launch without
its syncs), the device window, the step period, the gauge's fastest time before and after the run (µs), the CPU
the process ended on and its context switches; DIR/lscpu.txt holds the machine's CPU topology. The validation
runs of issue 35 showed one point's launch at 141 µs in one process and 283 µs in another (docs/validation.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from simharness.hostspeed import HostGauge
from simharness.metrics import host_intervals

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("schedule", "prep", "launch", "update", "propose")


def process_facts() -> dict:
    """What the kernel says of this process: the CPU it runs on now and its context switches so far."""
    stat = Path("/proc/self/stat").read_text()
    facts = {"cpu_now": int(stat[stat.rindex(")") + 2 :].split()[36])}  # field 39: the CPU it last ran on
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
            name, value = line.split(":")
            facts[name.split("_")[0]] = int(value)
    return facts


def child(args: argparse.Namespace) -> None:
    """In the measured process: the gauge, the point (unless --bare), the gauge again; facts to DIR/facts.json."""
    gauge = HostGauge()
    facts = {"gauge_before_us": gauge.fastest_s * 1e6}
    if not args.bare:
        import simharness
        from simharness.overrides import parse_sets

        simharness.run(simharness.load_scenario(args.scenario, parse_sets(args.set)), out=args.out)
        gauge = HostGauge()
        facts["gauge_after_us"] = gauge.fastest_s * 1e6
    facts.update(process_facts())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "facts.json").write_text(json.dumps(facts))


def process_row(label: str, run_dir: Path) -> dict:
    """Medians (µs) over the decode-only steps of one process's run."""
    steps = pd.read_parquet(run_dir / "steps.parquet").sort_values("step")
    decode = steps["n_prefill_reqs"] == 0
    intervals = host_intervals(steps, pd.read_parquet(run_dir / "syncs.parquet"))
    intervals = intervals[intervals["step"].isin(steps.loc[decode, "step"])]
    seconds = (intervals["end_s"] - intervals["start_s"]).groupby(intervals["kind"]).median()
    row = {"process": label, "steps": int(decode.sum())}
    row.update({name: float(seconds.get(name, np.nan)) * 1e6 for name in PHASES})
    row["device"] = float(np.nanmedian((steps["gpu_end"] - steps["gpu_start"])[decode])) * 1e6
    row["period"] = float(np.nanmedian(steps["update_end"].diff()[decode])) * 1e6
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", type=Path, default=ROOT / "scenarios/validation/cpu-proposer-sampling.yaml")
    ap.add_argument("--set", action="append", default=[
        "workload.concurrency=6", "workload.random_fraction=0.1", "engine.level=real"], metavar="PATH=VALUE")
    ap.add_argument("--cpus", nargs="+", type=int, default=[0, 1, 2, 3])
    ap.add_argument("--unpinned", type=int, default=2, help="processes run without a pin")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lscpu.txt").write_text(subprocess.run(["lscpu", "-e"], capture_output=True, text=True).stdout)
    sets = [f"--set={s}" for s in args.set]
    plan = [(f"cpu {c}", ["taskset", "-c", str(c)]) for c in args.cpus]
    plan += [(f"unpinned {i}", []) for i in range(args.unpinned)]
    rows = []
    for label, pin in plan:
        out = args.out / "runs" / label.replace(" ", "-")
        me = [sys.executable, __file__, "--child", "--scenario", str(args.scenario), *sets]
        bare = subprocess.run([*pin, *me, "--bare", "--out", str(out / "bare")], capture_output=True, text=True)
        done = subprocess.run([*pin, *me, "--out", str(out)], capture_output=True, text=True)
        if done.returncode != 0 or bare.returncode != 0:
            print(f"{label}: exit {done.returncode}\n{done.stderr[-2000:]}{bare.stderr[-2000:]}", flush=True)
            continue
        run_dir = max(p.parent for p in out.rglob("steps.parquet"))
        facts = json.loads((out / "facts.json").read_text())
        facts["gauge_bare_us"] = json.loads((out / "bare" / "facts.json").read_text())["gauge_before_us"]
        rows.append(process_row(label, run_dir) | facts)
        print({k: round(v, 1) if isinstance(v, float) else v for k, v in rows[-1].items()}, flush=True)
    table = pd.DataFrame(rows)
    table.to_csv(args.out / "host-by-cpu.csv", index=False)
    print(table.round(1).to_string(index=False))


if __name__ == "__main__":
    main()
