"""`simharness calibrate`: fit the sim level's costs from the step records of measured (hil or real) runs.

Every measured step gives one sample of the device step time (from its device start, or its launch's end if
later: the sim starts a step no earlier) against what it held (`costfile.DEVICE_FEATURES`: decode rows, decode
tokens, the decode rows' context, prefill chunks and tokens, the GPU proposer's terms), and one sample of each
host phase its level measured (prep, launch, the readback's own cost, the CPU proposer; schedule and update
only where measured) against requests and tokens. Each is a non-negative least-squares fit: of the relative
error for the device (the few long prefill steps, which a linear model fits worst, must not outweigh the many
decode steps), of the error itself for a host phase (its mean is what the sim adds up; its spread is noise).
k-fold cross-validation over the steps gives the relative error on steps a fit did not see. A step's records
hold no context, so it is rebuilt from the requests' prompts and the tokens emitted before the step (device
order: steps run FIFO). Host phases a level models instead of measuring keep the scenario's values.

`fidelity.check_calibration` checks a fit on the configurations it left out (`fit_where`).
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import yaml

from simharness import results
from simharness.costfile import DEVICE_FEATURES, FORMAT
from simharness.costmodel import GPUS
from simharness.engine.buckets import prefill_bucket
from simharness.jit import loaded_digest
from simharness.levels import LEVELS
from simharness.modes import OUTPUT_READBACK, resolve_mode
from simharness.overrides import parse_value
from simharness.pointfiles import finished_rows, read_points
from simharness.policy import scheduled_k
from simharness.profile import graph_rows
from simharness.scenario import Scenario, ScenarioError, scenario_from_dict
from simharness.stats import REFERENCE, config_ids

# the levels whose steps a fit takes, the reference (real) preferred
MEASURED_LEVELS = (REFERENCE, *(name for name, level in LEVELS.items() if level.measured and name != REFERENCE))
FOLDS = 5
MIN_STEPS_PER_TERM = 10  # a fit needs this many steps per coefficient
# host phase (as a step's `measured` names it where its level timed it) -> (its features, the host_costs fields they
# give, each field's unit in seconds)
HOST_PHASES: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[float, ...]]] = {
    "schedule": (("step", "n_reqs"), ("schedule_us", "schedule_per_req_us"), (1e-6, 1e-6)),
    "prep": (("step", "n_reqs", "n_tokens"), ("prep_us", "prep_per_req_us", "prep_per_token_us"), (1e-6, 1e-6, 1e-6)),
    "launch": (("step", "n_reqs", "prefill_reqs"), ("launch_us", "launch_per_req_us", "launch_per_prefill_us"),
               (1e-6, 1e-6, 1e-6)),
    "update": (("step", "n_reqs"), ("update_us", "update_per_req_us"), (1e-6, 1e-6)),
    "propose": (("step", "proposed", "history"), ("ngram_cpu_us", "ngram_cpu_per_req_us", "ngram_cpu_per_token_ns"),
                (1e-6, 1e-6, 1e-9)),
    "readback": (("step", "n_reqs"), ("sync_us", "sync_per_req_us"), (1e-6, 1e-6)),
}  # fmt: skip


@dataclass
class FitData:
    """The measured steps of the points a fit uses, a row per step with its features and phase times, and
    where they came from."""

    steps: pd.DataFrame
    device: str
    gpu: str
    model: str
    level: str
    runs: list[dict] = field(default_factory=list)
    held_out: list[tuple[Path, Scenario, pd.DataFrame]] = field(default_factory=list)  # per run: rows not fitted


def device_name(meta_device: str) -> str:
    """The device part of a run's meta.json `device` ("hil: NVIDIA H100 80GB HBM3, torch ..." -> the GPU)."""
    return re.sub(r"^\w+: ", "", meta_device).split(",")[0].strip()


def catalogue_gpu(device: str) -> str:
    """The roofline catalogue's name for a device (H100 for "NVIDIA H100 80GB HBM3"), else the device itself."""
    return next((name for name in GPUS if re.search(rf"\b{name}\b", device, re.IGNORECASE)), device)


def parse_where(items: list[str]) -> dict[str, list]:
    """`--fit-where PATH=V1,V2` options -> {path: [values]}."""
    where = {}
    for item in items:
        path, eq, values = item.partition("=")
        if not eq or not path or not values:
            raise ScenarioError(f"--fit-where {item!r}: expected PATH=V1,V2,... e.g. workload.concurrency=1,16")
        where[path.strip()] = [parse_value(v) for v in values.split(",")]
    return where


def fit_level(run_dirs: list[Path], summaries: list[pd.DataFrame], level: str | None) -> str:
    """The level a fit of these runs' summaries uses: `level`, or real where any run has real points, else hil;
    ScenarioError where the runs hold no measured point at it."""
    levels = {lv for s in summaries for lv in s["level"]}
    level = level or next((lv for lv in MEASURED_LEVELS if lv in levels), None)
    if level not in MEASURED_LEVELS or level not in levels:
        raise ScenarioError(f"{', '.join(map(str, run_dirs))}: no measured ({'/'.join(MEASURED_LEVELS)}) points "
                            f"{'at level ' + level if level else ''} to fit")
    return level


def load_fit_data(run_dirs: list[Path], *, level: str | None = None, where: dict[str, list] | None = None,
                  skip: list[set[str]] | None = None) -> FitData:
    """The measured steps of `run_dirs` (run or fidelity directories) at `level` (`fit_level`), of the points whose
    summary values are in `where`, less those of each run's `skip` (point ids, a set per run)."""
    runs = [(Path(d), read_run(Path(d))) for d in run_dirs]
    level = fit_level(run_dirs, [s for _, (_, _, s) in runs], level)
    devices = {device_name(meta["device"]) for _, (meta, _, _) in runs}
    if len(devices) > 1:
        raise ScenarioError(f"runs from different devices mixed in one fit: {', '.join(sorted(devices))}")
    parts, held_out, provenance, models = [], [], [], set()
    for i, (run_dir, (meta, sc, summary)) in enumerate(runs):
        at_level = summary[summary["level"] == level]
        fitted = _where(at_level, where or {}, run_dir)
        if skip is not None:
            fitted = fitted[~fitted["point"].isin(skip[i])]
        held_out.append((run_dir, sc, at_level[~at_level.index.isin(fitted.index)]))
        tables = _Tables(run_dir)
        for _, row in fitted.iterrows():
            point_sc = point_scenario(sc, row)
            models.add(point_sc.engine.model)
            try:
                point = [tables.get(name, int(row["index"]), row["point"]) for name in TABLES]
            except (OSError, ValueError, pa.ArrowException) as e:  # a run copied in part, a truncated table
                raise ScenarioError(f"{run_dir}: point {int(row['index'])}: its records cannot be read "
                                    f"({type(e).__name__}: {e})") from None
            try:
                parts.append(point_steps(*point, point_sc, level))
            except ValueError as e:  # records this scheduler did not write
                raise ScenarioError(f"{run_dir}: point {int(row['index'])}: {e}") from None
        provenance.append({"run": str(run_dir), "run_id": meta.get("run_id"), "device": meta["device"],
                           "source_digest": meta.get("source_digest"), "git_revision": meta.get("git_revision"),
                           "points": len(fitted)})  # fmt: skip
    if len(models) > 1:
        raise ScenarioError(f"runs of different models mixed in one fit: {', '.join(sorted(models))}")
    if not parts:
        raise ScenarioError(f"--fit-where: no {level} point matches {where}")
    device = devices.pop()
    steps = pd.concat(parts, ignore_index=True)
    return FitData(steps, device, catalogue_gpu(device), models.pop(), level, provenance, held_out)


def read_run(run_dir: Path) -> tuple[dict, Scenario, pd.DataFrame]:
    """A run directory's meta, scenario and finished points' summary rows (with `config`: a fidelity run's own,
    else the point without its repeat); a committed run that kept only its run-level tables gives its
    `summary.json`'s rows."""
    if not run_dir.is_dir():
        raise ScenarioError(f"{run_dir}: not a run directory")
    sc = results.load_run_scenario(run_dir)
    meta_path = run_dir / "meta.json"
    if not meta_path.is_file():
        raise ScenarioError(f"{run_dir}: not a run directory (no meta.json)")
    meta = json.loads(meta_path.read_text())
    rows = list(finished_rows(run_dir).values())
    if not rows and not (run_dir / "points").exists() and (run_dir / "summary.json").is_file():
        rows = json.loads((run_dir / "summary.json").read_text())
    if not rows:
        raise ScenarioError(f"{run_dir}: no finished points")
    summary = pd.DataFrame(rows)
    if "config" not in summary:
        summary["config"] = config_ids(summary)
    return meta, sc, summary


def _where(summary: pd.DataFrame, where: dict[str, list], run_dir: Path) -> pd.DataFrame:
    keep = np.ones(len(summary), dtype=bool)
    for path, values in where.items():
        if path not in summary:
            raise ScenarioError(f"--fit-where {path}: not swept in {run_dir} (swept: "
                                f"{', '.join(c for c in summary.columns if '.' in c) or 'nothing'})")
        keep &= summary[path].isin(values).to_numpy()
    return summary[keep]


def point_scenario(sc: Scenario, row: pd.Series) -> Scenario:
    """The scenario of one point of a run: the run's scenario with the point's swept values."""
    base = sc.model_dump(mode="json")
    base["sweep"], base["repeats"] = {}, 1
    # the sweep's own value (its type too: a summary table reads an integer column with gaps as floats, and a swept
    # null as NaN: the 8B grid's `engine.host_slowdown: null`)
    values = {p: next(v for v in sc.sweep[p] if v == row[p] or (v is None and pd.isna(row[p])))
              for p in sc.sweep if p in row}
    return scenario_from_dict(base, values)


class _Tables:
    """A run's tables of one point, each table read once for all points (`pointfiles.read_points`: the points'
    batches or own files, or the run's combined tables, which a committed run may keep alone)."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.combined: dict[str, pd.DataFrame] = {}

    def get(self, name: str, index: int, point: str) -> pd.DataFrame:
        if name not in self.combined:  # the points' batches or own files, else the run-level table
            self.combined[name] = read_points(self.run_dir, name)
            if self.combined[name].columns.empty:
                raise ScenarioError(f"{self.run_dir}: no {name} records (neither per point nor {name}.parquet)")
        table = self.combined[name]
        return table[table["point"] == point].drop(columns="point").reset_index(drop=True)


TABLES = ("steps", "requests", "emissions", "syncs")


def point_steps(steps: pd.DataFrame, requests: pd.DataFrame, emissions: pd.DataFrame, syncs: pd.DataFrame,
                sc: Scenario, level: str) -> pd.DataFrame:
    """One point's steps at `level` with their features (DEVICE_FEATURES and the host phases') and phase times."""
    s = steps.merge(_emission_counts(requests, emissions), on="step", how="left").fillna(
        {"emitting_decodes": 0, "emitting_context": 0, "max_context": 0, "proposed": 0, "history": 0})
    decode_rows = s["n_reqs"] - s["n_prefill_reqs"]
    per_row = (s["emitting_context"] / s["emitting_decodes"].where(s["emitting_decodes"] > 0)).fillna(0.0)
    ngram_gpu = float(sc.engine.speculation.proposer == "ngram_gpu" and sc.engine.speculation.k > 0)
    out = pd.DataFrame({
        "step": 1.0, "decode_rows": decode_rows, "decode_tokens": s["decode_tokens"],
        "decode_context": per_row * decode_rows,  # rows that emitted nothing (wasted) at the mean context
        "max_context": s["max_context"],
        "prefill_reqs": s["n_prefill_reqs"], "prefill_tokens": s["prefill_tokens"], "ngram_gpu_step": ngram_gpu,
        "n_reqs": s["n_reqs"], "n_tokens": s["decode_tokens"] + s["prefill_tokens"],
        "proposed": s["proposed"], "history": s["history"], "measured": s["measured"],
    })  # fmt: skip
    out["ngram_gpu_context"] = ngram_gpu * out["decode_context"]
    out["prefill_context"], out["prefill_padded"] = prefill_chunks(s, requests)
    # what the device computes (a profile's features): 1 + k tokens a row over the graph's bucket of rows, whatever
    # the drafts verified (`model_backend._run_step`); the point's k as the engine resolves it (`modes.resolve_mode`:
    # none without a proposer), a k schedule's k at the step's requests (the engine reads the batch it can hold)
    mode = resolve_mode(sc)
    if mode.k_schedule:
        out["width"] = [1 + scheduled_k(mode.k_schedule, int(n)) for n in s["n_reqs"]]
    else:
        out["width"] = 1 + mode.k
    out["device_rows"] = [graph_rows(int(r)) for r in decode_rows]
    out["device_tokens"] = out["device_rows"] * out["width"]
    # a profile's overlap model (simharness.profile_fit): the device window, the launch, the sampling mix, depth
    out["gpu_start_s"], out["gpu_end_s"], out["launch_end_s"] = s["gpu_start"], s["gpu_end"], s["launch_end"]
    out["prev_gpu_end_s"] = s["gpu_end"].shift(1)
    out["random_fraction"], out["depth"] = sc.workload.random_fraction, sc.scheduler.depth
    out["sample_s"] = s.get("gpu_sample_s", np.nan)  # the sampler's own device time (a profile's random path)
    # the sim starts a step on the device no earlier than its launch's end: its device time runs from then
    out["device_s"] = s["gpu_end"] - np.maximum(s["gpu_start"], s["launch_end"])
    out["schedule_s"] = s["schedule_end"] - s["schedule_start"]
    out["prep_s"] = s["prep_end"] - s["prep_start"]
    launch_syncs = syncs[syncs["phase"] == "launch"].groupby("step")["end_s"].sum() - \
        syncs[syncs["phase"] == "launch"].groupby("step")["start_s"].sum()
    out["launch_s"] = s["launch_end"] - s["prep_end"] - s["step"].map(launch_syncs).fillna(0.0)
    out["update_s"] = s["update_end"] - s["update_start"]
    out["propose_s"] = s["propose_end"] - s["propose_start"] if sc.engine.speculation.proposer == "ngram_cpu" \
        else np.nan
    out["readback_s"] = s["step"].map(step_reads(s, syncs, level))
    return out


def prefill_chunks(steps: pd.DataFrame, requests: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Each step's prompt tokens before its prefill chunks and its chunks' tokens padded to their graphs' token
    buckets (`engine.buckets`), in the rows' order, from the steps' prefill counts and the prompts: the scheduler
    (`policy`) admits requests in id order and cuts a prompt only where the step's token budget ends, so at most one
    request is part-way through its prompt. Its chunk comes first among a step's chunks, the new requests' (from 0)
    after it, all whole but the last; the step's prefill tokens tell how far the last one got. A steps table that
    records `prefill_context` must agree, step by step."""
    prompt = requests.sort_values("request_id")["prompt_tokens"].to_numpy(np.int64)
    context, padded = np.zeros(len(steps), dtype=np.int64), np.zeros(len(steps), dtype=np.int64)
    counts = steps[["n_prefill_reqs", "prefill_tokens"]].to_numpy(np.int64)
    partial, done, admitted = -1, 0, 0  # the request part-way through its prompt, its tokens prefilled; ids admitted
    for i in np.argsort(steps["step"].to_numpy(), kind="stable"):
        chunks, tokens = counts[i]
        sizes = []
        if chunks and partial >= 0:
            left = min(tokens, prompt[partial] - done)  # all its prompt's rest, or all the step's budget left
            context[i], sizes, chunks, tokens = done, [left], chunks - 1, tokens - left
            partial, done = (partial, done + left) if done + left < prompt[partial] else (-1, 0)
        if chunks:
            whole = prompt[admitted : admitted + chunks - 1]
            sizes += [*whole, tokens - whole.sum()]
            admitted += chunks
            if admitted > len(prompt) or not 0 < sizes[-1] <= prompt[admitted - 1]:
                raise ValueError(f"step {steps['step'].iloc[i]}: its prefill chunks do not follow the scheduler's")
            partial, done = (admitted - 1, sizes[-1]) if sizes[-1] < prompt[admitted - 1] else (-1, 0)
        padded[i] = sum(prefill_bucket(int(n)) for n in sizes)
    if "prefill_context" in steps and not np.array_equal(steps["prefill_context"].to_numpy(np.int64), context):
        raise ValueError("the recorded prefill_context differs from the scheduler's chunks")
    return context, padded


def step_reads(steps: pd.DataFrame, syncs: pd.DataFrame, level: str) -> pd.Series:
    """Each step's readback seconds (from its device end, or the read's start if later), read where `level` reads
    it: the real loop (`realloop.RealLoop`) at the first sync point after its launch that waits for it (with the
    other launched steps not yet read), else at its settle; hil at its settle, where it measures the readback (its
    sync points wait in virtual time). A sync that read several steps gives none of them a sample (its reads ran
    one after another, partly while the device still ran the newer ones)."""
    if level != REFERENCE:
        syncs = syncs[syncs["name"] == OUTPUT_READBACK]
    by_step = steps.set_index("step")
    gpu_end = by_step["gpu_end"]
    # per step, in step order: when its launch ended and when it was settled (never: inf)
    ids, launch_end = by_step.index.to_numpy(), by_step["launch_end"].to_numpy()
    settled = syncs[syncs["name"] == OUTPUT_READBACK].groupby("step")["start_s"].first()
    settle_start = settled.reindex(ids).fillna(np.inf).to_numpy()
    reads: dict[int, float] = {}
    for row in syncs.sort_values("start_s", kind="stable").itertuples(index=False):
        if row.name == OUTPUT_READBACK:
            read = [] if row.step in reads else [row.step]
        else:
            unsettled = ids[(launch_end <= row.start_s) & (settle_start > row.start_s)].tolist()
            if row.waits_for == "oldest_in_flight":
                unsettled = unsettled[:1]
            read = [i for i in unsettled if i not in reads]
        for i in read:
            reads[i] = np.nan
        if len(read) == 1:
            reads[read[0]] = row.end_s - max(row.start_s, gpu_end[read[0]])
    return pd.Series(reads, dtype=np.float64)


def _emission_counts(requests: pd.DataFrame, emissions: pd.DataFrame) -> pd.DataFrame:
    """Per step, from its emissions in device order: decode rows that emitted and their context before the step,
    and the requests the CPU proposer drafts for afterwards (still running) with the history it scans."""
    e = emissions.sort_values(["request_id", "step"], kind="stable")
    prompt = requests.set_index("request_id")["prompt_tokens"].reindex(e["request_id"]).to_numpy()
    target = requests.set_index("request_id")["output_tokens"].reindex(e["request_id"]).to_numpy()
    before = (e.groupby("request_id")["tokens"].cumsum() - e["tokens"]).to_numpy()
    after = before + e["tokens"].to_numpy()
    decode, running = before > 0, after < target  # a request's first emission is its prefill's
    context = np.where(decode, prompt + before, 0)
    frame = pd.DataFrame({"step": e["step"].to_numpy(), "emitting_decodes": decode, "emitting_context": context,
                          "max_context": context, "proposed": running,
                          "history": np.where(running, prompt + after, 0)})  # fmt: skip
    return frame.groupby("step", as_index=False).agg(
        {"emitting_decodes": "sum", "emitting_context": "sum", "max_context": "max", "proposed": "sum",
         "history": "sum"})


# ------------------------------------------------------------------------------------------------ fitting


def fit_nonneg(x: np.ndarray, y: np.ndarray, relative: bool) -> np.ndarray:
    """Non-negative least squares of the residuals x @ coef - y, or of the relative residuals (divided by y).
    Columns are scaled to unit size first (the features differ by orders of magnitude); all-zero columns get 0."""
    from scipy.optimize import nnls  # scipy takes a second to import: only when fitting

    weight = 1 / y if relative else np.ones(len(y))
    xw, yw = x * weight[:, None], y * weight
    scale = np.sqrt((xw**2).mean(axis=0))
    used = scale > 0
    coef = np.zeros(x.shape[1])
    coef[used] = nnls(xw[:, used] / scale[used], yw, maxiter=50 * x.shape[1])[0] / scale[used]
    return coef


def kfold_errors(x: np.ndarray, y: np.ndarray, relative: bool, folds: int = FOLDS, seed: int = 0) -> np.ndarray:
    """Relative errors |predicted / measured - 1| of every step, each predicted by a fit on the other folds."""
    order = np.random.default_rng(seed).permutation(len(y))
    errors = np.empty(len(y))
    for fold in np.array_split(order, folds):
        train = np.ones(len(y), dtype=bool)
        train[fold] = False
        errors[fold] = np.abs(x[fold] @ fit_nonneg(x[train], y[train], relative) / y[fold] - 1)
    return errors


def fit_phase(steps: pd.DataFrame, features: tuple[str, ...], target: str,
              relative: bool = False) -> tuple[np.ndarray, dict] | None:
    """Fit one phase on the steps where it was measured (finite, positive): coefficients (seconds per unit) and
    the k-fold quality; None with too few steps."""
    ok = steps[np.isfinite(steps[target]) & (steps[target] > 0)]
    if len(ok) < MIN_STEPS_PER_TERM * len(features):
        return None
    x, y = ok[list(features)].to_numpy(dtype=np.float64), ok[target].to_numpy(dtype=np.float64)
    errors = kfold_errors(x, y, relative)
    quality = {"steps": len(ok), "median_rel_error": float(np.median(errors)),
               "p90_rel_error": float(np.percentile(errors, 90))}
    return fit_nonneg(x, y, relative), quality


def calibrate(data: FitData) -> dict:
    """The calibration (a YAML-ready mapping) from the measured steps."""
    steps = data.steps
    gpu = measured(steps, "gpu")
    # hil's device times are the work alone (gated), fitted on relative error; a real step's device time after its
    # launch is near zero where the host's enqueue bounds it (low concurrency), and there relative error would
    # weigh those residues above the device-bound steps: plain error
    device = fit_phase(steps[gpu], DEVICE_FEATURES, "device_s", relative=data.level == "hil")
    if device is None:
        need = MIN_STEPS_PER_TERM * len(DEVICE_FEATURES)
        usable = int((gpu & (steps["device_s"] > 0)).sum())
        raise ScenarioError(f"too few steps to fit: {usable} of {len(steps)} measured steps have device time after "
                            f"their launch, need {need} (on a CPU the device work runs inside the launch)")
    coef, quality = device
    host, kept, qualities = fit_host(steps)
    qualities = {"device": quality, **qualities}
    return {
        "format": FORMAT,
        "note": f"fitted by `simharness calibrate` from {data.level}-level step records",
        "device": data.device, "gpu": data.gpu, "model": data.model, "level": data.level,
        "device_step_us": {f: float(c * 1e6) for f, c in zip(DEVICE_FEATURES, coef, strict=True)},
        "host_costs": host,
        "kept_from_scenario": kept,
        "quality": qualities,
        "provenance": {"runs": data.runs, "steps": len(steps), "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                       "calibrate_source_digest": loaded_digest()},
    }  # fmt: skip


def fit_host(steps: pd.DataFrame) -> tuple[dict[str, float], list[str], dict[str, dict]]:
    """The host phases' affine fits (HOST_PHASES) on the steps whose level measured them: the fitted host costs,
    the fields kept from the scenario (too few steps), and each fitted phase's k-fold quality."""
    host, kept, qualities = {}, [], {}
    for phase, (features, fields, units) in HOST_PHASES.items():
        fitted = fit_phase(steps[measured(steps, phase)], features, f"{phase}_s")
        if fitted is None:
            kept.extend(fields)
            continue
        host.update({f: float(c / unit) for f, c, unit in zip(fields, fitted[0], units, strict=True)})
        qualities[phase] = fitted[1]
    return host, kept, qualities


def measured(steps: pd.DataFrame, phase: str) -> pd.Series:
    """Which steps' level measured `phase` (it is in their `measured` list)."""
    return steps["measured"].str.split(",").map(lambda names: phase in names).astype(bool)


def write_calibration(calibration: dict, out: Path) -> Path:
    """Write the calibration YAML (whole or not at all: a temporary file, then a rename); a target that cannot be
    written is bad input naming --out (`results.check_writable` finds most before the fit)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(yaml.safe_dump(calibration, sort_keys=False))
        os.replace(tmp, out)
    except OSError as e:
        raise ScenarioError(f"--out {out}: cannot write ({e.strerror or e})") from None
    return out
