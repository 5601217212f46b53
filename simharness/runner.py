"""The sweep driver: scenario -> points -> (workload, mode, backend, level) -> metrics -> run dir."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from simharness import results
from simharness.engine.backend import model_backend
from simharness.metrics import compute_metrics
from simharness.models import checkpoint_dir
from simharness.modes import Mode, resolve_mode
from simharness.records import device_syncs_frame
from simharness.report import write_report
from simharness.scenario import Point, Scenario, ScenarioError, load_scenario, scenario_diff, sweep_points
from simharness.simulation import Simulation
from simharness.trace import trace_events, write_trace
from simharness.workload import Requests, build_requests

if TYPE_CHECKING:
    from simharness.measured import MeasuredEngine


@dataclass
class RunResult:
    """A finished run: where it lives and its tables (one row per point / request / step)."""

    run_dir: Path
    summary: pd.DataFrame
    requests: pd.DataFrame
    steps: pd.DataFrame
    syncs: pd.DataFrame
    emissions: pd.DataFrame
    device_syncs: pd.DataFrame

    @property
    def report(self) -> Path:
        return self.run_dir / "report.md"


def run(
    scenario: Scenario | str | Path,
    out: str | Path = "results",
    *,
    resume: str | Path | None = None,
    progress: Callable[[Path, int, int, str], None] | None = None,
) -> RunResult:
    """Run every sweep point of `scenario` (a Scenario or a YAML path) into a new run directory
    under `out`, or finish the points still missing in `resume`. `progress(run_dir, done, total,
    point_id)` is called once at the start and after each point."""
    if not isinstance(scenario, Scenario):
        scenario = load_scenario(scenario)
    run_dir = execute(scenario, sweep_points(scenario), out, resume=resume, progress=progress)
    with results.writing(run_dir, fresh=False):
        summary, tables = results.combine(run_dir)
        write_report(run_dir)
    return RunResult(run_dir, summary, **tables)


def execute(
    scenario: Scenario,
    points: list[Point],
    out: str | Path,
    *,
    resume: str | Path | None = None,
    progress: Callable[[Path, int, int, str], None] | None = None,
) -> Path:
    """Run `points` (derived from `scenario`, which the run directory records) into a new run directory under
    `out`, or the points still missing in `resume`; returns the run directory. Every point is validated first."""
    modes = {}
    for p in points:  # validate every point before writing anything
        try:
            modes[p.index] = resolve_mode(p.scenario)
            if p.scenario.engine.backend != "model":
                _require_device(p.scenario)
        except ScenarioError as e:
            raise ScenarioError(f"sweep point {p.id}: {e}") from None
    if resume is not None:
        run_dir = Path(resume)
        stored = results.load_run_scenario(run_dir)
        if stored != scenario:
            raise ScenarioError(f"{run_dir}: was started from a different scenario (differs in "
                                f"{', '.join(scenario_diff(stored, scenario))}); resume it with the same one")
    else:
        run_dir = results.new_run_dir(Path(out), scenario)
    with results.writing(run_dir, fresh=resume is None):
        _execute_points(run_dir, scenario, points, modes, progress)
    return run_dir


def _execute_points(run_dir: Path, scenario: Scenario, points: list[Point], modes: dict[int, Mode],
                    progress: Callable[[Path, int, int, str], None] | None) -> None:
    """The points of `points` not yet finished in `run_dir`, one after the other."""
    done = results.finished_points(run_dir)
    todo = [p for p in points if p.index not in done]
    workloads = _Workloads()
    measured = [(p.scenario, modes[p.index]) for p in todo if p.scenario.engine.backend != "model"]
    engine = None
    if measured:
        from simharness.measured import MeasuredEngine  # torch and Triton: only where a point runs on them

        engine = MeasuredEngine(measured, workloads.get)
    device = engine.describe() if engine else "sim (virtual time, cost model)"
    loaded = engine.model.load_stats if engine else None
    results.write_meta(run_dir, scenario, device=device, extra={"checkpoint_load": loaded} if loaded else None)
    if progress is not None:
        progress(run_dir, len(points) - len(todo), len(points), "")
    for n, point in enumerate(todo):
        _run_point(run_dir, point, modes[point.index], workloads.get(point.scenario), engine)
        if progress is not None:
            progress(run_dir, len(points) - len(todo) + n + 1, len(points), point.id)


def _require_device(sc: Scenario) -> None:
    """A measured point asking for CUDA where torch sees none is bad input, found before anything is written."""
    if sc.engine.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ScenarioError(f"engine.device: cuda was asked for (engine.backend: {sc.engine.backend}) but torch "
                                "sees no CUDA device here")


class _Workloads:
    """Each point's requests, built from its workload section and seed (in a checkpoint's tokens when the model is
    one); one is kept in memory, since sweeps usually vary the workload last."""

    def __init__(self) -> None:
        self.key: str | None = None
        self.requests: Requests | None = None

    def get(self, sc: Scenario) -> Requests:
        # what build_requests reads: concurrency and the count fields only through total_requests
        w = sc.workload
        key = w.model_dump_json(exclude={"concurrency", "cap_concurrency", "num_requests", "requests_per_user"})
        key += f"{w.total_requests},{sc.seed},{sc.engine.model}"
        if key != self.key:
            self.key, self.requests = key, build_requests(sc.workload, sc.seed, checkpoint_dir(sc.engine.model))
        return self.requests


# The level of each engine.backend.
LEVELS = {"model": "sim", "torch": "hil", "real": "real"}
# Fields a measured point reads nowhere: its device and step times are measured, its acceptance is the sampler's.
MEASURED_IGNORES = ("engine.gpu", "engine.gpu_costs", "engine.speculation.acceptance", "engine.calibration",
                    "engine.gc.full_every", "engine.host_costs.gc_ns_per_object")


def ignored_fields(sc: Scenario) -> list[str]:
    """The fields of a measured point set away from their defaults, which it ignores."""
    default = Scenario(name=sc.name)
    changed = []
    for path in MEASURED_IGNORES:
        mine, theirs = sc, default
        for part in path.split("."):
            mine, theirs = getattr(mine, part), getattr(theirs, part)
        if mine != theirs:
            changed.append(path)
    return changed


def _run_point(run_dir: Path, point: Point, mode: Mode, requests: Requests, measured: MeasuredEngine | None) -> None:
    sc = point.scenario
    notes = [mode.note]
    level = LEVELS[sc.engine.backend]
    if level != "sim":
        records, duration, backend = measured.run(sc, requests, mode)
        device_syncs = backend.syncs.frame()
        if level == "hil" and backend.starved_steps:
            notes.append(f"{backend.starved_steps} steps' enqueue may have outlasted a GPU gate (their device times "
                         "may include launch gaps)")
        ignored = ignored_fields(sc)
        if ignored:
            message = f"{', '.join(ignored)}: set, but a {level} point measures what they model; ignored"
            warnings.warn(f"sweep point {point.id}: {message}", stacklevel=2)
            notes.append(message)
    else:
        records, duration = Simulation(sc, requests, mode, model_backend(sc, requests, mode)).run()
        device_syncs = device_syncs_frame([])
    steps, syncs, emissions = records.steps_frame(), records.syncs_frame(), records.emissions_frame()
    metrics = compute_metrics(
        records.requests,
        emissions,
        steps,
        syncs,
        duration_s=duration,
        percentiles=sc.report.percentiles,
        goodput=sc.report.goodput,
        k=mode.k,
    )
    summary = {"point": point.id, "index": point.index, "level": level}
    summary.update(point.values)
    summary.update(effective_depth=mode.depth, note="; ".join(filter(None, notes)))
    summary.update(metrics)
    trace_dir = run_dir / "traces"
    trace_dir.mkdir(exist_ok=True)
    events = trace_events(steps, syncs, max_steps=sc.report.trace_steps)
    write_trace(trace_dir / f"{point.index:04d}_{_slug(point.id)}.json", events, {"point": point.id})
    tables = {"requests": records.requests, "steps": steps, "syncs": syncs, "emissions": emissions,
              "device_syncs": device_syncs}
    results.write_point(run_dir, point.index, summary, tables)


def _slug(point_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", point_id.replace("=", "-"))[:120] or "base"
