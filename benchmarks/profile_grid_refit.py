"""A smaller profile grid checked on committed grid runs: the profile refitted from only the points the grid holds,
and that fit's error on the points it dropped (docs/calibration.md, "The 8B's grid"). Usage:

    python benchmarks/profile_grid_refit.py RUN_DIR ... --out refit.yaml [--model llama-3-8b] [--grid FILE]

RUN_DIRs are the profile's grid runs (its `provenance.runs`, unpacked from results/profiles/runs/). Prints the
refit's device-step k-fold median and P90, its efficiencies, and the median and P90 |error| of its device window
on every step of the dropped points (steps it never saw). Check the validation family with the refit in place of
the shipped profile: `python benchmarks/validation.py results/validation/<family>/<run> --table /tmp/v.md`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import yaml

from simharness.calibration import load_fit_data, point_scenario, read_run
from simharness.models import model_config
from simharness.profile import load_profile, shape_sizes
from simharness.profile_fit import DeviceFit, device_samples, fit_profile, predict_window, step_features
from simharness.profile_grid import GRID, grid_points

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_grid_time import work  # noqa: E402


def split(run_dirs: list[Path], kept: set[str]) -> tuple[list[set[str]], list[set[str]]]:
    """Per run, the point ids the grid drops and those it keeps."""
    dropped, held = [], []
    for run_dir in run_dirs:
        _, sc, summary = read_run(run_dir)
        ids = {row["point"]: work(point_scenario(sc, row)) in kept for _, row in summary.iterrows()}
        dropped.append({p for p, k in ids.items() if not k})
        held.append({p for p, k in ids.items() if k})
    return dropped, held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--grid", type=Path, default=GRID)
    args = parser.parse_args()
    _, points = grid_points(args.grid, {"engine.model": args.model, "engine.level": "real"})
    dropped, held = split(args.runs, {work(p.scenario) for p in points})
    profile = fit_profile(load_fit_data(args.runs, level="real", skip=dropped))
    args.out.write_text(yaml.safe_dump(profile, sort_keys=False))
    q = profile["quality"]["device"]
    print(f"{args.grid} for {args.model}: {len(points)} points, refitted from "
          f"{sum(len(h) for h in held)} of the runs' points ({q['steps']} steps): k-fold median "
          f"{q['median_rel_error']:.2%}, P90 {q['p90_rel_error']:.2%}; per forward "
          f"{profile['device_step']['per_forward_us']:.0f} µs; efficiencies " +
          ", ".join(f"{k} {v:.3f}" for k, v in profile["efficiency"].items()))
    if any(dropped):
        ok = device_samples(load_fit_data(args.runs, level="real", skip=held).steps)
        loaded = load_profile(args.out)
        launch = (ok["launch_end_s"] - ok["gpu_start_s"]).to_numpy(float)
        depth = ok["depth"].to_numpy(int)
        fit = DeviceFit(np.array(loaded.coef), {d: loaded.overlap_at(d)[1] for d in set(depth.tolist())}, np.empty(0),
                      float("nan"))
        window = predict_window(fit, step_features(ok), launch, depth, shape_sizes(model_config(args.model)))
        errors = np.abs(window / ok["window_s"].to_numpy(float) - 1)
        print(f"on the {sum(len(d) for d in dropped)} dropped points ({len(errors)} steps): median |error| "
              f"{np.median(errors):.2%}, P90 {np.percentile(errors, 90):.2%}")


if __name__ == "__main__":
    main()
