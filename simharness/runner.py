"""The sweep driver: scenario -> points -> (workload, mode, backend, level) -> metrics -> run dir."""

from __future__ import annotations

import re
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from simharness import results
from simharness.executors import Event, Executor, LocalPool, make_executor, ray_stopped
from simharness.gcwatch import GC_COLUMNS
from simharness.metrics import compute_metrics
from simharness.model_backend import model_backend
from simharness.models import checkpoint_dir
from simharness.modes import Mode, resolve_mode
from simharness.profile import summary_columns as profile_columns
from simharness.records import device_syncs_frame
from simharness.scenario import (
    Point,
    Scenario,
    ScenarioError,
    ScenarioNote,
    load_scenario,
    resolve_field,
    scenario_diff,
    sweep_points,
)
from simharness.simulation import Simulation
from simharness.trace import trace_events, trace_json
from simharness.workload import Requests, build_requests

if TYPE_CHECKING:
    from simharness.measured import MeasuredEngine


@dataclass
class RunResult:
    """A finished run: where it lives, its summary (one row per point; failed points carry a `failed` reason) and
    its tables (one row per request / step / ...), read from the run directory when first asked for."""

    run_dir: Path
    summary: pd.DataFrame

    @property
    def report(self) -> Path:
        return self.run_dir / "report.md"

    @property
    def failed(self) -> pd.DataFrame:
        """The points that failed after their retries, with the reason."""
        if "failed" not in self.summary.columns:
            return self.summary.iloc[:0]
        return self.summary[self.summary["failed"].notna()]

    @cached_property
    def requests(self) -> pd.DataFrame:
        return results.read_table(self.run_dir, "requests")

    @cached_property
    def steps(self) -> pd.DataFrame:
        return results.read_table(self.run_dir, "steps")

    @cached_property
    def syncs(self) -> pd.DataFrame:
        return results.read_table(self.run_dir, "syncs")

    @cached_property
    def emissions(self) -> pd.DataFrame:
        return results.read_table(self.run_dir, "emissions")

    @cached_property
    def device_syncs(self) -> pd.DataFrame:
        return results.read_table(self.run_dir, "device_syncs")


@dataclass
class SweepStatus:
    """Where a sweep stands, handed to the progress callback after every event: points done (finished or failed),
    failed, running, and the last event (`message` says what happened on a retry or failure)."""

    run_dir: Path
    total: int
    done: int
    failed: int = 0
    running: int = 0
    point_id: str = ""
    message: str = ""


def run(
    scenario: Scenario | str | Path,
    out: str | Path = "results",
    *,
    resume: str | Path | None = None,
    progress: Callable[[SweepStatus], None] | None = None,
    workers: int | str | None = None,
    ray: str | None = None,
    retries: int = 2,
    process_per_point: bool = False,
) -> RunResult:
    """Run every sweep point of `scenario` (a Scenario or a YAML path) into a new run directory
    under `out`, or finish the points still missing in `resume`. Points run in this process, in
    `workers` local processes (a number, or `auto`), or as tasks on the Ray cluster at `ray` (`local`
    starts one here); a point that fails is retried `retries` times; `process_per_point` starts a process for
    each point (measured repeats then differ by process too). `progress(status)` is called once at the start
    and after each event of a point."""
    if not isinstance(scenario, Scenario):
        scenario = load_scenario(scenario)
    try:
        run_dir = execute(scenario, sweep_points(scenario), out, resume=resume, progress=progress, workers=workers,
                          ray=ray, retries=retries, process_per_point=process_per_point)
        summary = combine_and_report(run_dir)
    finally:
        ray_stopped()  # a local cluster this run started stops beside its tail, even one cut short
    return RunResult(run_dir, summary)


def combine_and_report(run_dir: Path) -> pd.DataFrame:
    """Rebuild a run's summary and run-level tables from its points and render its report; returns the summary.
    The report reads the points' own tables, so it renders while another thread combines the run-level ones
    (parquet's reading and encoding run outside the GIL)."""
    from simharness.report import write_report  # matplotlib: ~0.5 s that a worker process, which draws nothing, skips

    with results.writing(run_dir, fresh=False):
        summary = results.combine_summary(run_dir)
        with ThreadPoolExecutor(1) as pool:
            tables = pool.submit(results.combine_tables, run_dir, summary)
            write_report(run_dir)
            tables.result()
    return summary


def execute(
    scenario: Scenario,
    points: list[Point],
    out: str | Path,
    *,
    resume: str | Path | None = None,
    progress: Callable[[SweepStatus], None] | None = None,
    workers: int | str | None = None,
    ray: str | None = None,
    retries: int = 2,
    process_per_point: bool = False,
) -> Path:
    """Run `points` (derived from `scenario`, which the run directory records) into a new run directory under
    `out`, or the points still missing in `resume`; returns the run directory. Every point and the executor's
    options are validated first. This process alone writes the run directory, each point as it finishes."""
    modes = {}
    for p in points:  # validate every point before writing anything
        try:
            modes[p.index] = resolve_mode(p.scenario)
        except ScenarioError as e:
            raise ScenarioError(f"sweep point {p.id}: {e}") from None
    _check_one_engine([p.scenario for p in points if p.scenario.engine.backend != "model"])
    note_ignored(points)
    # a cluster may have GPUs this machine lacks: only a local run checks its device
    local = [p for p in points if p.scenario.engine.backend != "model" and ray in (None, "local")]
    try:
        executor = make_executor(points, workers=workers, ray=ray, retries=retries, process_per_point=process_per_point)
    except ScenarioError:
        _require_devices(local)  # a missing device is the first thing to say
        raise
    if isinstance(executor, LocalPool) and executor.gpus:
        executor.start()  # its workers import torch while this process does, to check the device
    try:
        _require_devices(local)
        run_dir = _run_dir(scenario, out, resume)
        with results.writing(run_dir, fresh=resume is None):
            _execute_points(run_dir, scenario, points, modes, progress, executor)
    finally:
        if isinstance(executor, LocalPool):
            executor.close()  # workers started ahead wait for work until told to go
    return run_dir


def _run_dir(scenario: Scenario, out: str | Path, resume: str | Path | None) -> Path:
    """A new run directory under `out`, or `resume` once it is known to hold a run of the same scenario."""
    if resume is None:
        return results.new_run_dir(Path(out), scenario)
    stored = results.load_run_scenario(Path(resume))
    if stored != scenario:
        raise ScenarioError(f"{resume}: was started from a different scenario (differs in "
                            f"{', '.join(scenario_diff(stored, scenario))}); resume it with the same one")
    return Path(resume)


def _execute_points(run_dir: Path, scenario: Scenario, points: list[Point], modes: dict[int, Mode],
                    progress: Callable[[SweepStatus], None] | None, executor: Executor) -> None:
    """The points of `points` not yet finished in `run_dir`, run by `executor`; this process writes each."""
    done = results.finished_points(run_dir)
    todo = [p for p in points if p.index not in done]
    measured = [(p.scenario, modes[p.index]) for p in todo if p.scenario.engine.backend != "model"]
    results.write_meta(run_dir, scenario, device=None if measured else "sim (virtual time, cost model)")
    status = SweepStatus(run_dir, total=len(points), done=len(points) - len(todo))
    if progress is not None:
        progress(status)
    described = False
    try:
        with closing(executor.run(todo, PointWork(modes, measured))) as events:
            for event in events:
                if event.kind == "done" and event.result.device is not None and not described:
                    loaded = event.result.checkpoint_load
                    results.write_meta(run_dir, scenario, device=event.result.device,
                                       extra={"checkpoint_load": loaded} if loaded else None)
                    described = True
                _record(run_dir, event, status)
                if progress is not None:
                    progress(status)
    finally:
        global _state
        _state = None  # a serial run's requests and model go with it


def _record(run_dir: Path, event: Event, status: SweepStatus) -> None:
    """Write what an executor reports (a finished point, a failed one) and count it."""
    point = event.point
    status.point_id, status.message = point.id, ""
    if event.kind == "started":
        status.running += 1
    elif event.kind == "retry":
        status.running -= 1
        status.message = f"{point.id}: {event.reason}; retrying"
    elif event.kind == "done":
        result = event.result
        trace_dir = run_dir / "traces"
        trace_dir.mkdir(exist_ok=True)
        (trace_dir / f"{point.index:04d}_{_slug(point.id)}.json").write_text(result.trace)
        results.write_point(run_dir, point.index, result.summary, result.tables)
        status.running, status.done = status.running - 1, status.done + 1
    else:
        level = LEVELS[point.scenario.engine.backend]
        record = {"point": point.id, "index": point.index, "level": level, **point.values, "failed": event.reason}
        results.write_failed(run_dir, point.index, record, event.detail)
        status.running, status.done, status.failed = status.running - 1, status.done + 1, status.failed + 1
        status.message = f"{point.id}: failed: {event.reason}"


def _check_one_engine(measured: list[Scenario]) -> None:
    engines = {(sc.engine.model, sc.engine.device, sc.engine.cuda_graphs) for sc in measured}
    if len(engines) > 1:
        raise ScenarioError("engine.model / engine.device / engine.cuda_graphs: a measured run uses one model on "
                            "one device; do not sweep them")


def _require_devices(points: list[Point]) -> None:
    """A measured point asking for CUDA where torch sees none is bad input, found before anything is written."""
    for p in points:
        if p.scenario.engine.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ScenarioError(f"sweep point {p.id}: engine.device: cuda was asked for (engine.backend: "
                                    f"{p.scenario.engine.backend}) but torch sees no CUDA device here")


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


@dataclass
class PointResult:
    """One finished point as a worker hands it to the driver: its summary row, its tables as parquet bytes and its
    trace as JSON (encoded where the point ran: the driver only writes them), and for a measured point the device
    that ran it and the checkpoint's load statistics (meta.json)."""

    summary: dict
    tables: dict[str, bytes]
    trace: str
    device: str | None = None
    checkpoint_load: dict | None = None


@dataclass
class PointWork:
    """Computes one point wherever an executor calls it (this process, a worker process, a Ray task). Picklable;
    within a process it keeps the last point's requests and the measured engine (sized for every measured point
    of the run, built on the first one) for the next call."""

    modes: dict[int, Mode]  # each point's mode by index, resolved once when the run was validated
    measured: list[tuple[Scenario, Mode]]
    key: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __call__(self, point: Point) -> PointResult:
        global _state
        if _state is None or _state[0] != self.key:
            _state = (self.key, _Workloads(), None)
        key, workloads, engine = _state
        if engine is None and point.scenario.engine.backend != "model":
            from simharness.measured import MeasuredEngine  # torch and Triton: only where a point runs on them

            engine = MeasuredEngine(self.measured, workloads.get)
            _state = (key, workloads, engine)
        result = _point_result(point, self.modes[point.index], workloads.get(point.scenario), engine)
        if engine is not None:
            result.device, result.checkpoint_load = engine.describe(), engine.model.load_stats
        return result


_state: tuple[str, _Workloads, MeasuredEngine | None] | None = None  # this process's PointWork: (key, ...)


# The level of each engine.backend.
LEVELS = {"model": "sim", "torch": "hil", "real": "real"}
# Fields a level reads nowhere: a measured point's device and step times are measured and its acceptance is the
# sampler's; a sim point runs no decode loop and has no host to gauge.
IGNORED = {
    "measured": ("engine.gpu", "engine.gpu_costs", "engine.speculation.acceptance", "engine.calibration",
                 "engine.profile", "engine.gc.full_every", "engine.host_costs.gc_ns_per_object"),
    "sim": ("engine.device", "engine.cuda_graphs", "engine.steer", "engine.host_slowdown"),
}


def ignored_fields(sc: Scenario, level: str) -> list[str]:
    """The fields a point of `level` ignores that `sc` sets away from their defaults."""
    default = Scenario(name=sc.name)
    return [path for path in IGNORED["sim" if level == "sim" else "measured"]
            if getattr(*resolve_field(sc, path)) != getattr(*resolve_field(default, path))]


def ignored_message(fields: list[str], level: str) -> str:
    reason = "runs no decode loop" if level == "sim" else "measures what they model"
    return f"{', '.join(fields)}: set, but a {level} point {reason}; ignored"


def note_ignored(points: list[Point]) -> None:
    """Say once per run (a ScenarioNote, which the CLI prints as a note) which set fields its points ignore and at
    how many points; each point's summary also notes it."""
    where: dict[str, int] = {}
    for p in points:
        level = LEVELS[p.scenario.engine.backend]
        fields = ignored_fields(p.scenario, level)
        if fields:
            message = ignored_message(fields, level)
            where[message] = where.get(message, 0) + 1
    for message, count in where.items():
        warnings.warn(ScenarioNote(f"{message} ({count} of {len(points)} points)"), stacklevel=3)


def without_ignored(sc: Scenario, level: str) -> None:
    """Set the fields a point of `level` ignores back to their defaults (a fidelity run drives one scenario at
    every level on purpose, so its points do not warn about the other levels' fields)."""
    default = Scenario(name=sc.name)
    for path in ignored_fields(sc, level):
        section, name = resolve_field(sc, path)
        setattr(section, name, getattr(*resolve_field(default, path)))


def _point_result(point: Point, mode: Mode, requests: Requests, measured: MeasuredEngine | None) -> PointResult:
    sc = point.scenario
    notes = [mode.note]
    level = LEVELS[sc.engine.backend]
    if level != "sim":
        run = measured.run(sc, requests, mode)
        records, duration, backend = run.records, run.duration, run.backend
        host = {"host_slowdown": run.host_slowdown, "host_attempts": run.host_attempts, **run.gc.summary()}
        limit = sc.engine.host_slowdown
        if limit is not None and (run.host_attempts > 1 or run.host_slowdown > limit):
            notes.append(f"measured {run.host_attempts} times: the host was {run.host_slowdown:.2f}x slower than its "
                         f"fastest around the run kept (engine.host_slowdown: {limit})")
        device_syncs = backend.syncs.frame()
        if level == "hil" and backend.starved_steps:
            notes.append(f"{backend.starved_steps} steps' enqueue may have outlasted a GPU gate (their device times "
                         "may include launch gaps)")
    else:
        records, duration = Simulation(sc, requests, mode, model_backend(sc, requests, mode)).run()
        # the same columns at every level (a sim point's GC pauses are modelled, in its steps' gc_pause_s)
        host = dict.fromkeys(["host_slowdown", "host_attempts", *GC_COLUMNS], np.nan)
        device_syncs = device_syncs_frame([])
    ignored = ignored_fields(sc, level)
    if ignored:
        notes.append(ignored_message(ignored, level))
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
    summary.update(host)
    summary.update(profile_columns(sc.engine, level))
    trace = trace_json(trace_events(steps, syncs, max_steps=sc.report.trace_steps), {"point": point.id})
    tables = {"requests": records.requests, "steps": steps, "syncs": syncs, "emissions": emissions,
              "device_syncs": device_syncs}
    return PointResult(summary, results.encode_tables(tables), trace)


def _slug(point_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", point_id.replace("=", "-"))[:120] or "base"
