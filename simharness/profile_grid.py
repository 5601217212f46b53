"""`simharness profile`: measure a designed grid at the real level on one GPU and fit the model's cost profile.

A grid file (scenarios/profile/grid.yaml) holds a base `scenario` and named `blocks`, each a small cartesian
sweep over what changes a step's cost (batch and k, context, sampling mix, prefill chunks, depth, the host's
proposer). The grid is the union of the blocks' points, not their product: each block varies what it is about
around the base, so the terms separate at a fraction of a full product's cost. The run records a scenario whose
sweep lists every value a point takes, so that `calibration.load_fit_data` rebuilds each point's scenario.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml
from pydantic import BaseModel

from simharness import results
from simharness.calibration import FitData, fit_level, load_fit_data, read_run
from simharness.models import catalogue_name, model_config
from simharness.profile import default_path
from simharness.profile_fit import fit_profile
from simharness.runner import execute
from simharness.scenario import Point, Scenario, ScenarioError, resolve_field, scenario_from_dict

GRID = Path(__file__).resolve().parents[1] / "scenarios" / "profile" / "grid.yaml"
RUNS = Path("results/profile-runs")  # where a grid's run directories go
KV_BUDGET_BYTES = 30e9  # of an H100's 80 GB: room for the weights (16 GB for the 8B), CUDA graphs, activations


@dataclass
class ProfileResult:
    """The profile written (`path`), its mapping, the grid runs it was fitted from and a line per run saying which
    blocks it gave."""

    path: Path
    profile: dict
    run_dirs: list[Path]
    sources: list[str]


def grid_points(grid: Path, overrides: dict | None = None,
                blocks: list[str] | None = None) -> tuple[Scenario, list[Point]]:
    """The grid file's run scenario and its points (the union of its blocks, each point once) for the model it
    profiles (`engine.model`): the file's `models` entry for that model sets fields of the base and replaces or adds
    blocks; `overrides` (the `--set` options) apply over both and to every point, a path a block sweeps included
    (its points then take the set value). `blocks` names the blocks to take (default: all)."""
    data = _read_grid(grid)
    overrides = overrides or {}
    model = scenario_from_dict(data["scenario"], overrides).engine.model
    entry = _model_entry(data, grid, model)
    base = scenario_from_dict(data["scenario"], {**entry.get("scenario", {}), **overrides})
    if base.sweep:
        raise ScenarioError(f"{grid}: scenario.sweep: the blocks are the grid; the base scenario sweeps nothing")
    chosen = _chosen_blocks(data, entry, grid, blocks)
    chosen = {n: {p: v for p, v in b.items() if p not in overrides} for n, b in chosen.items()}
    paths: list[str] = []
    for block in chosen.values():
        paths += [p for p in block if p not in paths]
    plain = base.model_dump(mode="json")
    defaults = {}
    for path in paths:
        try:
            value = getattr(*resolve_field(base, path))
            defaults[path] = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
        except ValueError as e:
            raise ScenarioError(f"{grid}: blocks: {e}") from None
    points, seen = [], set()
    for name, block in chosen.items():
        for values in itertools.product(*block.values()):
            full = {**defaults, **dict(zip(block, values, strict=True))}
            key = tuple(_key(full[p]) for p in paths)
            if key in seen:
                continue
            seen.add(key)
            try:
                scenario = scenario_from_dict(plain, full)
            except ScenarioError as e:
                raise ScenarioError(f"{grid}: blocks.{name}: {e}") from None
            point_id = f"{name}," + ",".join(f"{p}={full[p]}" for p in block)
            points.append(Point(id=point_id, index=len(points), values={"block": name, **full}, scenario=scenario))
    sweep = {p: list({_key(pt.values[p]): pt.values[p] for pt in points}.values()) for p in paths}
    return scenario_from_dict({**plain, "sweep": sweep}), points


def _read_grid(grid: Path) -> dict:
    """A grid file's mapping: `scenario`, `blocks` and, optionally, `models`."""
    try:
        data = yaml.safe_load(grid.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise ScenarioError(f"{grid}: not a readable grid file ({type(e).__name__})") from None
    if not isinstance(data, dict) or not {"scenario", "blocks"} <= set(data) <= {"scenario", "blocks", "models"} \
            or not isinstance(data["blocks"], dict):
        raise ScenarioError(f"{grid}: a grid file holds `scenario` (a scenario mapping), `blocks` (name: sweep) and "
                            "optionally `models` (model: its `scenario` fields and `blocks`)")
    return data


def _chosen_blocks(data: dict, entry: dict, grid: Path, blocks: list[str] | None) -> dict[str, dict]:
    """The grid's blocks, the model entry's replacing or added, those `blocks` names (default: all)."""
    every = {**data["blocks"], **entry.get("blocks", {})}
    unknown = [n for n in blocks or [] if n not in every]
    if unknown:
        raise ScenarioError(f"{grid}: no block {', '.join(unknown)} (blocks: {', '.join(every)})")
    chosen = {n: b for n, b in every.items() if blocks is None or n in blocks}
    for name, block in chosen.items():
        if not isinstance(block, dict) or not block or not all(isinstance(v, list) and v for v in block.values()):
            raise ScenarioError(f"{grid}: blocks.{name}: a mapping of dotted paths to non-empty value lists")
    return chosen


def _model_entry(data: dict, grid: Path, model: str) -> dict:
    """The grid's `models` entry for `model` (empty if none): `scenario` (dotted paths of the base to set) and
    `blocks` (name: sweep, replacing or adding a block)."""
    models = data.get("models") or {}
    if not isinstance(models, dict):
        raise ScenarioError(f"{grid}: models: a mapping of catalogue models to their `scenario` and `blocks`")
    for name, entry in models.items():
        if catalogue_name(str(name)) is None:
            raise ScenarioError(f"{grid}: models.{name}: not a catalogue model")
        if not isinstance(entry, dict) or not set(entry) <= {"scenario", "blocks"} \
                or not all(isinstance(v, dict) for v in entry.values()):
            raise ScenarioError(f"{grid}: models.{name}: a mapping of `scenario` (dotted path: value) and `blocks` "
                                "(name: sweep)")
        try:
            scenario_from_dict(data["scenario"], entry.get("scenario"))
        except ScenarioError as e:
            raise ScenarioError(f"{grid}: models.{name}.scenario: {e}") from None
    return next((e for name, e in models.items() if str(name).lower() == model.lower()), {})


def kv_cache_bytes(points: list[Point]) -> int:
    """The KV cache a run of `points` sizes its one model for (`MeasuredEngine`: its most slots times its longest
    request), from the scenarios' bounds: slots x (longest prompt + output + the tokens in flight) per token."""
    def longest(sc: Scenario) -> int:
        w, k = sc.workload, sc.engine.speculation.k
        bound = lambda d: d.value if d.dist == "fixed" else d.max  # noqa: E731
        return bound(w.prompt_len) + bound(w.output_len) + (sc.scheduler.depth + 1) * (k + 1) + 1

    slots = max(min(p.scenario.scheduler.max_num_seqs, p.scenario.workload.concurrency) for p in points) + 1
    per_token = model_config(points[0].scenario.engine.model).kv_bytes_per_token
    return slots * max(longest(p.scenario) for p in points) * per_token


def run_groups(points: list[Point]) -> list[list[Point]]:
    """The grid's points cut into runs whose model's KV cache stays within KV_BUDGET_BYTES (one run's model is sized for
    its largest batch and its longest request together: the 8B at batch 256 and 4,000-token prompts would need
    137 GB). Whole blocks go together; each run's points are numbered from 0."""
    blocks: dict[str, list[Point]] = {}
    for p in points:
        blocks.setdefault(p.values["block"], []).append(p)
    groups: list[list[Point]] = []
    for block in blocks.values():  # each block into the first run it fits in (first fit)
        group = next((g for g in groups if kv_cache_bytes(g + block) <= KV_BUDGET_BYTES), None)
        if group is None:
            groups.append(list(block))
        else:
            group += block
    return [[p.model_copy(update={"index": i}) for i, p in enumerate(group)] for group in groups]


def _key(value) -> object:
    """A value as the sweep tells values apart (1 and 1.0 are one value)."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else repr(value)


def measure_profile(model: str, *, grid: Path = GRID, out: Path | None = None, runs: Path = RUNS,
                    sets: dict | None = None, from_runs: list[Path] | None = None) -> ProfileResult:
    """Run the grid for `model` at the real level (or take the grid runs `from_runs`) and fit its profile, written
    to `out` (default: simharness/data/profiles/<gpu>-<model>.yaml)."""
    if from_runs:
        run_dirs = list(from_runs)
    else:
        scenario, points = grid_points(grid, {**(sets or {}), "engine.model": model, "engine.level": "real"})
        run_dirs = []
        for group in run_groups(points):
            run_dirs.append(execute(scenario, group, runs))
            results.combine(run_dirs[-1])
    data, sources = grid_fit_data(run_dirs, level="real" if not from_runs else None)
    if data.model.lower() != model.lower():
        raise ScenarioError(f"{run_dirs[0]}: field engine.model: the runs measured {data.model!r}, not {model!r}")
    profile = fit_profile(data)
    path = out if out is not None else default_path(data.gpu, data.model)
    if path is None:
        raise ScenarioError(f"--model {model}: not a catalogue model; name the profile file with --out")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(profile, sort_keys=False))
    return ProfileResult(path, profile, run_dirs, sources)


def grid_fit_data(run_dirs: list[Path], level: str | None = None) -> tuple[FitData, list[str]]:
    """The measured steps of grid runs for a profile's fit (`calibration.load_fit_data`) and a line per run naming
    the blocks it gave. A block that a later run also holds comes from the later run alone: a block measured again
    replaces its earlier measurement."""
    runs = [Path(d) for d in run_dirs]
    summaries = [read_run(d)[2] for d in runs]
    level = fit_level(runs, summaries, level)
    later: set[str] = set()  # the blocks of the runs after this one
    skip, blocks, sources = [], [], []
    for run_dir, summary in reversed(list(zip(runs, summaries, strict=True))):
        summary = summary[summary["level"] == level]
        block = summary["block"].fillna("") if "block" in summary else pd.Series("", index=summary.index)
        replaced = block.isin(later) & (block != "")
        taken, dropped = sorted(set(block[~replaced]) - {""}), sorted(set(block[replaced]))
        sources.insert(0, f"{run_dir}: {', '.join(taken) or ('no block' if len(summary) else f'no {level} point')}"
                       + (f" (measured again in a later run: {', '.join(dropped)})" if dropped else ""))
        skip.insert(0, set(summary["point"][replaced]))
        blocks.insert(0, taken)
        later |= set(block)
    data = load_fit_data(runs, level=level, skip=skip)
    for run, taken in zip(data.runs, blocks, strict=True):
        run["blocks"] = taken
    return data, sources
