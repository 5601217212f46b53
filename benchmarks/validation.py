"""The profiled sim and the uncalibrated sim (the roofline) against the real level of the committed validation runs
(issue 35: scenario families the profiles never saw). Usage:

    python benchmarks/validation.py [RUN_DIR ...] [--out DIR] [--table results/validation/validation.md]

Each RUN_DIR (default: every fidelity run under results/validation) holds a `simharness fidelity --levels sim,real`
run of one family on the GPU. The real medians are that run's; both sims are re-run here (the sim is
deterministic, so one pass is the measurement; a warning says where this machine's profiled sim no longer matches
the run's own sim level). Writes the table of median and worst |error| per family and metric, and where each sim's
mean TPOT differs from the real one: the steps a request spends per token, or the device or host time of those
steps (`tpot_split`), beside the error of the device time of a step, unweighted (`mean_step_ms`); and the profile's
error on each real step's device window (`window_errors`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

from simharness import results
from simharness.calibration import load_fit_data
from simharness.fidelity import sim_checks
from simharness.models import model_config
from simharness.profile import default_path, load_profile, shape_sizes
from simharness.profile_fit import DeviceFit, device_samples, predict_window, step_features
from simharness.runner import execute
from simharness.stats import error_stats, error_table

METRICS = ("mean_tpot_ms", "p99_tpot_ms", "output_throughput", "mean_ttft_ms")
STEP_COLUMNS = ["point", "n_prefill_reqs", "gpu_start", "gpu_end", "update_end"]
REQUEST_COLUMNS = ["point", "output_tokens", "first_token_s", "last_token_s"]
PERIOD_PARTS = ("decode_device", "prefill_device", "host")
SIMS = {"sim": "auto", "sim-uncalibrated": "none"}  # level label -> engine.profile


def family_errors(run_dir: Path, out: Path) -> tuple[pd.DataFrame, pd.DataFrame, str | None]:
    """Per sim variant and metric: median and worst |error| against the run's real medians; per sim variant and
    point, the mean TPOT split (`tpot_split`)."""
    sc = results.load_run_scenario(run_dir)
    summary = pd.read_csv(run_dir / "summary.csv")
    real = summary[summary["level"] == "real"]
    points = sim_checks(sc, real, SIMS)
    sim_dir = execute(sc, points, out)
    sims = results.combine(sim_dir)
    stats = error_stats(error_table(pd.concat([real, sims], ignore_index=True)))
    split = tpot_split(real, sims, point_periods(run_dir, real["point"]), point_periods(sim_dir, sims["point"]))
    return stats[stats["metric"].isin(METRICS)], split, drift(summary, sims)


def decode_periods(steps: pd.DataFrame, requests: pd.DataFrame) -> dict[str, float]:
    """One point's mean TPOT (s) as a sum over its steps, exactly: each step's period (from the previous step's
    update to its own, when its tokens reach the clients) counts once for every request between its first token
    and its last, over that request's output tokens less one and the requests. Returns that sum (`tpot`), the
    steps' total weight (`weight`: steps per output token after the first, averaged as TPOT averages) and the sum
    split into the device time of steps with decodes only, of steps with a prefill chunk, and the rest of the
    period (`host`: the device idle on the host, or a step's time before the previous one's update), and the share
    of the weight on steps with a prefill chunk (`prefill_weight`)."""
    steps = steps.sort_values("update_end")
    end = steps["update_end"].to_numpy()
    period = np.diff(end, prepend=end[0])
    device = (steps["gpu_end"] - steps["gpu_start"]).to_numpy()
    prefill = steps["n_prefill_reqs"].to_numpy() > 0
    done = requests[requests["last_token_s"].notna() & (requests["output_tokens"] > 1)]
    share = 1.0 / ((done["output_tokens"].to_numpy() - 1) * len(done))
    # each request weighs the steps that settled after its first token, up to and including its last
    delta = np.zeros(len(end) + 1)
    np.add.at(delta, np.searchsorted(end, done["first_token_s"].to_numpy(), "right"), share)
    np.add.at(delta, np.searchsorted(end, done["last_token_s"].to_numpy(), "right"), -share)
    weight = np.cumsum(delta)[:-1]
    return {"tpot": float(weight @ period), "weight": float(weight.sum()),
            "decode_device": float(weight[~prefill] @ device[~prefill]),
            "prefill_device": float(weight[prefill] @ device[prefill]),
            "host": float(weight @ (period - device)), "prefill_weight": float(weight[prefill].sum() / weight.sum())}


def point_periods(run_dir: Path, points: pd.Series) -> dict[str, dict[str, float]]:
    """`decode_periods` of each of the run's `points`, from its step and request records."""
    steps = results.read_table(run_dir, "steps", STEP_COLUMNS).groupby("point", observed=True)
    requests = results.read_table(run_dir, "requests", REQUEST_COLUMNS).groupby("point", observed=True)
    return {p: decode_periods(steps.get_group(p), requests.get_group(p)) for p in points}


def tpot_split(real: pd.DataFrame, sims: pd.DataFrame, real_periods: dict, sim_periods: dict) -> pd.DataFrame:
    """Per sim variant and configuration, the mean TPOT error against the real runs' mean (`decode_periods`, the
    median of two runs) split exactly into: the steps a request spends per output token (`tpot_steps`: the
    run's structure) and, in the period of those steps, the device time of steps with decodes only, of steps with
    a prefill chunk and the host's rest, each a fraction of the real mean TPOT. Also the error of the device time
    of a step, unweighted (`mean_step_ms`, against the runs' median), the real runs' spread in mean TPOT
    (max / min - 1) and the weight on steps with a prefill chunk at either level."""
    rows = []
    for config, ref in real.groupby("config"):
        runs = pd.DataFrame([real_periods[p] for p in ref["point"]])
        r, real_step_ms = runs.mean(), ref["mean_step_ms"].median()
        for _, sim in sims[sims["config"] == config].iterrows():
            s = sim_periods[sim["point"]]
            row = {"sim": sim["level"], "config": config, "tpot_error": s["tpot"] / r["tpot"] - 1,
                   "tpot_steps": s["weight"] / r["weight"] - 1,
                   "device_step_error": sim["mean_step_ms"] / real_step_ms - 1,
                   "real_device_ms": real_step_ms, "sim_device_ms": sim["mean_step_ms"],
                   "real_spread": runs["tpot"].max() / runs["tpot"].min() - 1,
                   "real_prefill_weight": r["prefill_weight"], "sim_prefill_weight": s["prefill_weight"]}
            for part in PERIOD_PARTS:  # the sim's part less the real one's per unit weight, at the sim's weight
                row[f"tpot_{part}"] = (s[part] - s["weight"] * r[part] / r["weight"]) / r["tpot"]
            rows.append(row)
    return pd.DataFrame(rows)


def window_errors(run_dir: Path) -> dict[str, float]:
    """The shipped profile's error on each real step's device window, as `simharness profile` models the window (the
    step's work, or the launch's end plus its depth's tail where that is later): the per-step check of the issue's
    held-out figure, on records of a family the profile was not fitted on."""
    data = load_fit_data([run_dir], level="real")
    ok = device_samples(data.steps)
    profile = load_profile(default_path(data.gpu, data.model))
    depth = ok["depth"].to_numpy(int)
    tails = {d: profile.overlap_at(d)[1] for d in set(depth.tolist())}
    fit = DeviceFit(np.array(profile.coef), tails, np.zeros(0), 0.0)
    launch = (ok["launch_end_s"] - ok["gpu_start_s"]).to_numpy(float)
    predicted = predict_window(fit, step_features(ok), launch, depth, shape_sizes(model_config(data.model)))
    error = predicted / ok["window_s"].to_numpy(float) - 1
    chunk = ok["prefill_reqs"].to_numpy() > 0
    return {"steps": len(error), "median": float(np.median(np.abs(error))),
            "p90": float(np.percentile(np.abs(error), 90)), "signed": float(np.median(error)),
            "decode_only": float(np.median(np.abs(error[~chunk]))),
            "with_chunk": float(np.median(np.abs(error[chunk]))) if chunk.any() else float("nan")}


def drift(summary: pd.DataFrame, sims: pd.DataFrame) -> str | None:
    """Where this machine's profiled sim differs from the run's own sim level (another profile, another tree)."""
    then = summary[summary["level"] == "sim"].set_index("config")["mean_tpot_ms"]
    now = sims[sims["level"] == "sim"].set_index("config")["mean_tpot_ms"].reindex(then.index)
    moved = (now / then - 1).abs()
    if moved.isna().any():
        return f"{int(moved.isna().sum())} of the run's sim points have no counterpart here"
    return f"the sim's mean TPOT moved by up to {moved.max():.2%} since the run" if moved.max() > 1e-9 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", type=Path)
    parser.add_argument("--out", type=Path, default=Path("/tmp/validation"))
    parser.add_argument("--table", type=Path, default=Path("results/validation/validation.md"))
    args = parser.parse_args()
    runs = args.runs or sorted(p.parent for p in Path("results/validation").glob("*/*/fidelity.json"))
    rows, splits, windows = [], [], []
    for run_dir in runs:
        family = run_dir.parent.name.removeprefix("validation-")
        windows.append({"family": family, **window_errors(run_dir)})
        stats, split, drift = family_errors(run_dir, args.out)
        if drift:
            print(f"warning: {run_dir}: {drift}")
        splits.append(split.assign(family=family, run=run_dir.name))
        for _, r in stats.iterrows():
            rows.append({"family": family, "run": run_dir.name,
                         "sim": r["level"], "metric": r["metric"], "points": r["points"],
                         "median": r["median_abs_error"], "worst": r["worst_abs_error"]})
    table = pd.DataFrame(rows)
    wide = table.pivot_table(index=["family", "metric"], columns="sim", values=["median", "worst"], sort=False)
    lines = ["| family | metric | profiled sim median / worst | uncalibrated median / worst |", "|---|---|---|---|"]
    for (family, metric), r in wide.iterrows():
        lines.append(f"| {family} | {metric} | {r[('median', 'sim')]:.1%} / {r[('worst', 'sim')]:.1%} | "
                     f"{r[('median', 'sim-uncalibrated')]:.1%} / {r[('worst', 'sim-uncalibrated')]:.1%} |")
    split = pd.concat(splits, ignore_index=True)
    lines += ["", "Where each sim's mean TPOT differs from the real one, split exactly over the steps a request spends "
              "per output token (the run's structure) and the period of those steps: the device time of steps with "
              "decodes only, of steps with a prefill chunk, and the host's rest of the period (`tpot_split`; medians "
              "over a family's points, fractions of the real mean TPOT, so the parts add up point by point, not in "
              "the medians). Beside it: the error of a step's device time, unweighted (`mean_step_ms`), the real "
              "runs' spread in mean TPOT, and the share of the decoding requests' steps that carry a prefill chunk:",
              "",
              "| family | sim | mean TPOT error | steps per token | device, decode-only steps | "
              "device, steps with a prefill chunk | host | device step error (real / sim ms) | real runs' spread | "
              "prefill-chunk steps real / sim |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (family, sim), r in split.groupby(["family", "sim"], sort=False).median(numeric_only=True).iterrows():
        lines.append(f"| {family} | {sim} | {r['tpot_error']:+.1%} | {r['tpot_steps']:+.1%} | "
                     f"{r['tpot_decode_device']:+.1%} | {r['tpot_prefill_device']:+.1%} | {r['tpot_host']:+.1%} | "
                     f"{r['device_step_error']:+.1%} ({r['real_device_ms']:.2f} / {r['sim_device_ms']:.2f}) | "
                     f"{r['real_spread']:.1%} | {r['real_prefill_weight']:.1%} / {r['sim_prefill_weight']:.1%} |")
    lines += ["", "The profile's error on each real step's device window (the work, or the launch's end plus the "
              "depth's tail where that is later, as the profile's fit models it; `window_errors`), over every measured "
              "step of the family's real runs:", "",
              "| family | steps | median \\|error\\| | P90 | signed median | decode-only steps | steps with a chunk |",
              "|---|---|---|---|---|---|---|"]
    for w in windows:
        lines.append(f"| {w['family']} | {w['steps']} | {w['median']:.1%} | {w['p90']:.1%} | {w['signed']:+.1%} | "
                     f"{w['decode_only']:.1%} | {w['with_chunk']:.1%} |")
    args.table.write_text("\n".join(lines) + "\n")
    table.to_csv(args.table.with_suffix(".csv"), index=False)
    split.to_csv(args.table.with_name(args.table.stem + "-steps.csv"), index=False)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
