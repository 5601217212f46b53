"""A profile fitted on part of a committed real-level run, checked on the rest: the sim with that profile and the
uncalibrated sim against the real level's medians on the configurations the fit did not see. Usage:

    python benchmarks/profile_holdout.py --fit-on 1,4,16 [--run results/fidelity/20261126-005756] [--out DIR]

Fits on the points at `workload.concurrency` in --fit-on, checks the others. The sim is deterministic and the real
medians are the run's, so one pass is the measurement; the sim rebuilds the run's requests on this machine (a
check that `fidelity.sim_drift` warns about where they differ). docs/calibration.md, "Profiles", has the result.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import yaml

from simharness import results
from simharness.calibration import load_fit_data
from simharness.fidelity import sim_checks, sim_drift
from simharness.profile_fit import fit_profile
from simharness.runner import execute
from simharness.stats import error_stats, error_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, default=Path("results/fidelity/20261126-005756"))
    parser.add_argument("--fit-on", required=True, help="concurrencies to fit on, e.g. 1,4,16")
    parser.add_argument("--out", type=Path, default=Path("/tmp/profile-holdout"))
    args = parser.parse_args()
    data = load_fit_data([args.run], level="real",
                         where={"workload.concurrency": [int(v) for v in args.fit_on.split(",")]})
    profile = fit_profile(data)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "profile.yaml"
    path.write_text(yaml.safe_dump(profile, sort_keys=False))
    points, measured = [], []
    for _run_dir, sc, rows in data.held_out:
        points += sim_checks(sc, rows, {"sim": "none", "sim-profiled": str(path)}, first_index=len(points))
        measured.append(rows.assign(level="real"))
    run_dir = execute(data.held_out[0][1], points, args.out)
    summary = results.combine(run_dir)
    stats = error_stats(error_table(pd.concat([*measured, summary], ignore_index=True)))
    print(f"fit: {profile['quality']['device']}")
    print(stats[["level", "metric", "points", "median_abs_error", "worst_abs_error"]].to_string(index=False))
    drift = sim_drift([args.run], summary[summary["level"] == "sim"])
    if drift:
        print(f"warning: {drift}")


if __name__ == "__main__":
    main()
