"""The sweep driver: scenario -> points -> (workload, mode, backend, level) -> metrics -> run dir."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing, contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pandas as pd

from simharness import results
from simharness.executors import Event, Executor, LocalPool, make_executor, ray_stopped
from simharness.levels import LEVELS
from simharness.modes import Mode, resolve_mode
from simharness.pointwork import PointWork, ignored_fields, ignored_message
from simharness.profile import own_device_costs
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
    """Rebuild a run's summary and run-level tables from its points and render its report (with the Perfetto
    traces of the points it draws); returns the summary. The report reads the points' batches, so it renders
    while another thread combines the run-level tables (parquet's reading and encoding run outside the GIL)."""
    from simharness.report import write_report  # matplotlib: ~0.5 s that a worker process, which draws nothing, skips

    with _heap_frozen(), results.writing(run_dir, fresh=False):
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
    _check_one_engine([p.scenario for p in points if LEVELS[p.scenario.engine.level].measured])
    note_ignored(points)
    # a cluster may have GPUs this machine lacks: only a local run checks its device
    local = [p for p in points if LEVELS[p.scenario.engine.level].measured and ray in (None, "local")]
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


@contextmanager
def _heap_frozen(enabled: bool = True) -> Iterator[None]:
    """Leave the objects alive now (the imported libraries' modules, functions and types: some 10^5) out of the
    garbage collector's full passes until the block ends. Each pass traversed them all, about ten times a run: a
    twentieth of a sweep of tiny points. The block's own garbage is collected as ever. Not while a measured level
    runs (`enabled` False): there a full collection's pause over the process's whole heap is part of what is
    measured (`engine.gc`, seed #41043), as it was when the committed GPU results were made."""
    if not enabled:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


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
    measured = [(p.scenario, modes[p.index]) for p in todo if LEVELS[p.scenario.engine.level].measured]
    with _heap_frozen(not measured):  # sim points only: measured ones keep the whole heap (`_heap_frozen`)
        results.write_meta(run_dir, scenario, device=None if measured else "sim (virtual time, cost model)")
        status = SweepStatus(run_dir, total=len(points), done=len(points) - len(todo))
        if progress is not None:
            progress(status)
        described = refrozen = False
        writer = results.PointWriter(run_dir)
        work = PointWork(modes, measured)
        try:
            with closing(executor.run(todo, work)) as events:
                for event in events:
                    if event.kind == "done" and not refrozen and not measured:
                        gc.freeze()  # what the first point loaded (numba, the requests) is left out too (_heap_frozen)
                        refrozen = True
                    if event.kind == "done" and event.result.device is not None and not described:
                        loaded = event.result.checkpoint_load
                        results.write_meta(run_dir, scenario, device=event.result.device,
                                           extra={"checkpoint_load": loaded} if loaded else None)
                        described = True
                    _record(writer, event, status)
                    if progress is not None:
                        progress(status)
        finally:
            writer.flush()  # whatever stopped the run, the points it finished are kept
            work.release()  # a serial run's engine: before the process's next run builds one


def _record(writer: results.PointWriter, event: Event, status: SweepStatus) -> None:
    """Write what an executor reports (a finished point, a failed one) and count it."""
    point = event.point
    status.point_id, status.message = point.id, ""
    if event.kind == "started":
        status.running += 1
    elif event.kind == "retry":
        status.running -= 1
        status.message = f"{point.id}: {event.reason}; retrying"
    elif event.kind == "done":
        writer.add(point.index, point.id, event.result.summary, event.result.tables)
        status.running, status.done = status.running - 1, status.done + 1
    else:
        level = point.scenario.engine.level
        record = {"point": point.id, "index": point.index, "level": level, **point.values, "failed": event.reason}
        results.write_failed(writer.run_dir, point.index, record, event.detail)
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
                raise ScenarioError(f"sweep point {p.id}: engine.device: cuda was asked for (engine.level: "
                                    f"{p.scenario.engine.level}) but torch sees no CUDA device here")


def note_ignored(points: list[Point]) -> None:
    """Say once per run (a ScenarioNote, which the CLI prints as a note) which set fields its points ignore and at
    how many points; each point's summary also notes it."""
    where: dict[str, int] = {}
    for p in points:
        level = p.scenario.engine.level
        fields = ignored_fields(p.scenario, level)
        if fields:
            message = ignored_message(fields, level)
            where[message] = where.get(message, 0) + 1
        if level == "sim" and own_device_costs(p.scenario.engine):
            message = ("engine.gpu_costs: set, so the sim runs the roofline with them, not the committed cost profile "
                       f"of {p.scenario.engine.gpu} and {p.scenario.engine.model} (engine.profile: auto); unset them "
                       "to run the profile, or set engine.profile: none to say so")
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
