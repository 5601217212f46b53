"""The held-out check of a fit (`simharness calibrate --check`): the configurations the fit left out (`fit_where`)
run at the sim level with and without the calibration, and their errors against the measured medians, as
`simharness fidelity` reports them; and whether this machine's sim reproduces the runs' own sim level.
"""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import pandas as pd

from simharness import results
from simharness.calibration import FitData, point_scenario, read_run
from simharness.jit import loaded_digest
from simharness.runner import execute, without_ignored
from simharness.scenario import Point, ScenarioError
from simharness.stats import REFERENCE, error_stats, error_table


def check_calibration(data: FitData, costs: Path, out: Path) -> tuple[pd.DataFrame, Path, str | None]:
    """Run every held-out configuration at the sim level, uncalibrated (`sim`) and with `costs`
    (`sim-calibrated`), into a run directory under `out`; returns their error statistics against the measured
    level's medians (stats.error_stats), the run directory, and `sim_drift`'s warning if any."""
    held = [(run_dir, sc, rows) for run_dir, sc, rows in data.held_out if len(rows)]
    if not held:
        raise ScenarioError("--check: the fit used every point; leave some out with --fit-where")
    points, measured = [], []
    for _run_dir, sc, rows in held:
        for config, group in rows.groupby("config", sort=False):
            for level, calibration in (("sim", None), ("sim-calibrated", str(costs))):
                scenario = point_scenario(sc, group.iloc[0])
                scenario.engine.level = "sim"
                without_ignored(scenario, "sim")  # the measured run's decode-loop fields
                scenario.engine.calibration = None  # the scenario's own, if any, is neither of the two
                if calibration is not None:
                    scenario.engine.gpu = data.gpu
                    scenario.engine.calibration = calibration
                point_id = f"{level},{config}"
                points.append(Point(id=point_id, index=len(points), values={"config": config, "level": level},
                                    scenario=scenario))
        measured.append(rows.assign(level=REFERENCE))  # the reference of error_table
    run_dir = execute(held[0][1], points, out)
    summary = results.combine(run_dir)
    stats = error_stats(error_table(pd.concat([*measured, summary], ignore_index=True)))
    stats.to_csv(run_dir / "check.csv", index=False)
    return stats, run_dir, sim_drift([run for run, _, _ in held], summary[summary["level"] == "sim"])


# What the uncalibrated sim of the check and a run's own sim level are compared on.
DRIFT_METRICS = ("mean_tpot_ms", "p99_tpot_ms", "mean_acceptance_length")


def sim_drift(run_dirs: list[Path], sim: pd.DataFrame) -> str | None:
    """Where a held-out run also ran the sim level uncalibrated (a fidelity run), whether this machine's sim
    (`sim`, the check's) reproduces it. The check rebuilds the run's requests here: with another Python (its
    standard library is the text corpus), numpy (random streams) or source tree they can come out different, and
    the check's errors then include that difference. Returns a warning naming it, or None."""
    mine = sim.set_index("config")[list(DRIFT_METRICS)]
    theirs, metas = [], []
    for run_dir in run_dirs:
        meta, sc, summary = read_run(run_dir)
        if sc.engine.calibration is None and "sim" in set(summary["level"]):
            theirs.append(summary[summary["level"] == "sim"].groupby("config")[list(DRIFT_METRICS)].first())
            metas.append(meta)
    if not theirs:
        return None
    theirs = pd.concat(theirs)
    common = mine.index.intersection(theirs.index)
    change = mine.loc[common] / theirs.loc[common] - 1
    differ = int((change.abs() > 1e-9).any(axis=1).sum())
    if not differ:
        return None
    medians = ", ".join(f"{m} {change[m].median():+.1%}" for m in DRIFT_METRICS)
    run = "; ".join(f"Python {m.get('python')}, numpy {m.get('versions', {}).get('numpy')}, source "
                    f"{str(m.get('source_digest'))[:12]}" for m in metas)
    here = f"Python {platform.python_version()}, numpy {np.__version__}, source {loaded_digest()[:12]}"
    return (f"this machine's sim does not reproduce the run's own sim level in {differ} of {len(common)} held-out "
            f"configurations (median change: {medians}): the requests or the code rebuilt here differ from the "
            f"run's (run: {run}; here: {here}), and the errors above include that difference. Run the check "
            "where the run ran for errors on the same requests.")

