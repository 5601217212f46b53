"""Every seed change's A/B at the measured levels (hil, real) with repeats, in one process (CUDA context and Triton
compilations are reused across runs); docs/seeds.md.

    python benchmarks/seeds.py --out $OUT                       # hil and real on the GPU, 3 repeats
    python benchmarks/seeds.py --out /tmp/s --levels sim --repeats 10
    python benchmarks/seeds.py --out /tmp/s --repeats 1 --set engine.model=tiny --set engine.device=cpu \\
        --set workload.num_requests=8        # dry run on a CPU
    python benchmarks/seeds.py --out results/seeds --from-csv   # effects.csv and the table from OUT/<level>.csv

Writes OUT/<level>.csv (one row per repeat, arm and metric: `simharness.run_seed`), OUT/effects.csv (per seed,
level and metric: A, B, effect % and its 95% interval, the reported change), OUT/seconds-<levels>.csv (wall time
per seed and level), OUT/settings-<levels>.json (repeats, overrides, device) and, with --keep-runs, every run
directory under OUT/runs; results/seeds/ holds the same files. Prints the effects as a table at the end.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import pandas as pd

import simharness
from simharness.overrides import parse_sets


def effects_of_every_level(out: Path) -> pd.DataFrame:
    """The effects of every OUT/<level>.csv there is, written to OUT/effects.csv."""
    rows = [pd.read_csv(out / f"{level}.csv", dtype={"seed": str}) for level in ("sim", "hil", "real")
            if (out / f"{level}.csv").exists()]
    effects = simharness.seed_effects(pd.concat(rows))
    effects.to_csv(out / "effects.csv", index=False)
    return effects


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--levels", nargs="+", default=["hil", "real"], choices=["sim", "hil", "real"])
    ap.add_argument("--seeds", nargs="+", default=list(simharness.SEEDS), choices=list(simharness.SEEDS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], metavar="PATH=VALUE", help="override every seed scenario")
    ap.add_argument("--keep-runs", action="store_true", help="keep each run directory under OUT/runs")
    ap.add_argument("--from-csv", action="store_true", help="run nothing: the effects of every OUT/<level>.csv")
    args = ap.parse_args()
    if args.from_csv:
        effects = effects_of_every_level(args.out)
        print(table(effects))
        return
    overrides = parse_sets(args.set)
    args.out.mkdir(parents=True, exist_ok=True)
    # the run directories live only as long as this benchmark, unless --keep-runs
    with tempfile.TemporaryDirectory(prefix="seeds-") as tmp:
        runs = args.out / "runs" if args.keep_runs else Path(tmp)
        seconds = []
        for level in args.levels:
            level_rows = []
            for pr in args.seeds:
                t = time.perf_counter()
                rows = simharness.run_seed(pr, level, args.repeats, runs, overrides)
                seconds.append({"seed": pr, "level": level, "seconds": time.perf_counter() - t})
                print(f"{pr} {level}: {seconds[-1]['seconds']:.1f} s", flush=True)
                level_rows.append(rows)
                # written after every seed: a run cut short keeps what it finished
                pd.concat(level_rows).to_csv(args.out / f"{level}.csv", index=False)
                pd.DataFrame(seconds).to_csv(args.out / f"seconds-{'-'.join(args.levels)}.csv", index=False)
        # every level's rows in OUT, not only this run's: a run of one level keeps the others' effects
        effects = effects_of_every_level(args.out)
        measured = set(args.levels) - {"sim"}
        settings = {"repeats": args.repeats, "levels": args.levels, "overrides": overrides,
                    "device": device() if measured else "sim (virtual time, cost model)"}
        (args.out / f"settings-{'-'.join(args.levels)}.json").write_text(json.dumps(settings, indent=1))
        print(table(effects))


def device() -> str:
    """The GPU the measured levels ran on, or the host's processor."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "CPU"


def table(effects: pd.DataFrame) -> str:
    """The effects as a fixed-width table: seed, level, metric, A, B, effect % [95% interval], reported %."""
    lines = [f"{'seed':<6} {'level':<5} {'metric':<18} {'A':>10} {'B':>10} {'effect %':>9}  {'95% interval':<18} "
             f"{'reported':>8}  reproduced"]
    for r in effects.itertuples():
        reported = "sign" if pd.isna(r.reported_pct) else f"{r.reported_pct:+.1f}"
        interval = f"[{r.ci_low:+.2f}, {r.ci_high:+.2f}]"
        lines.append(f"{r.seed:<6} {r.level:<5} {r.metric:<18} {r.A:>10.4g} {r.B:>10.4g} {r.effect_pct:>+9.2f}  "
                     f"{interval:<18} {reported:>8}  {'yes' if r.reproduced else 'no'}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
