"""What one sweep point computes, wherever an executor runs it: its requests, a run at its level (simulated, or
measured on the engine), its metrics, its summary row and its tables. The driver (`runner`) writes the result.

A worker keeps what the next point can reuse in an explicit `WorkerState` (the last point's requests, the measured
engine), held by the `PointWork` it was handed: a serial run's state goes with the run, a worker process's with
the process.
"""

from __future__ import annotations

import gc
import sys
import uuid
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING

import numpy as np

from simharness.gcwatch import GC_COLUMNS
from simharness.levels import LEVELS
from simharness.metrics import compute_metrics
from simharness.model_backend import model_backend
from simharness.models import checkpoint_dir
from simharness.modes import Mode
from simharness.profile import summary_columns as profile_columns
from simharness.realloop import RealLoop
from simharness.records import Records, device_syncs_columns
from simharness.scenario import Point, Scenario, resolve_field
from simharness.simulation import Simulation
from simharness.workload import Requests, build_requests

if TYPE_CHECKING:
    from simharness.backend import Backend
    from simharness.measured import MeasuredEngine


def run_on_clock(sc: Scenario, requests: Requests, mode: Mode, backend: Backend) -> tuple[Records, float]:
    """One point over `backend` on its level's clock (`levels.LEVELS`): SimPy's virtual clock (sim, hil) or the wall
    clock (real, whose backend is a `MeasuredBackend`); its records and duration."""
    clock = Simulation if LEVELS[sc.engine.level].clock == "virtual" else RealLoop
    return clock(sc, requests, mode, backend).run()


def ignored_fields(sc: Scenario, level: str) -> list[str]:
    """The fields a point of `level` ignores that `sc` sets away from their defaults."""
    default = _defaults()
    return [path for path in LEVELS[level].ignores
            if getattr(*resolve_field(sc, path)) != getattr(*resolve_field(default, path))]


@cache
def _defaults() -> Scenario:
    """A scenario of default fields, built once (0.5 ms a point otherwise); only read."""
    return Scenario(name="defaults")


@cache
def _no_device_syncs() -> dict[str, np.ndarray]:
    """The empty device-syncs table of every sim point, built once; only read."""
    return device_syncs_columns([])


def ignored_message(fields: list[str], level: str) -> str:
    reason = "measures what they model" if LEVELS[level].measured else "runs no decode loop"
    return f"{', '.join(fields)}: set, but a {level} point {reason}; ignored"


@dataclass
class PointResult:
    """One finished point as a worker hands it to the driver: its summary row and its tables (requests, steps,
    syncs, emissions, device_syncs) as arrays by column (the writer makes each table of a batch of points a frame
    once: frames per point cost a sweep of tiny points 2 ms a point), and for a measured point the device that ran
    it and the checkpoint's load statistics (meta.json)."""

    summary: dict
    tables: dict[str, dict[str, np.ndarray]]
    device: str | None = None
    checkpoint_load: dict | None = None


class Workloads:
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
class WorkerState:
    """What a worker keeps from one point to the next: the last requests, and the measured engine (sized for every
    measured point of the run, built on the first one)."""

    workloads: Workloads = field(default_factory=Workloads)
    engine: MeasuredEngine | None = None


@dataclass
class PointWork:
    """Computes one point wherever an executor calls it (this process, a worker process, a Ray task). Pickled
    without its state: each process that unpickles it starts a fresh one and keeps it for its next points."""

    modes: dict[int, Mode]  # each point's mode by index, resolved once when the run was validated
    measured: list[tuple[Scenario, Mode]]
    key: str = field(default_factory=lambda: uuid.uuid4().hex)
    state: WorkerState = field(default_factory=WorkerState, repr=False, compare=False)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "state": None}

    def __setstate__(self, data: dict) -> None:
        self.__dict__.update(data, state=WorkerState())

    def __call__(self, point: Point) -> PointResult:
        state = self.state
        if state.engine is None and LEVELS[point.scenario.engine.level].measured:
            from simharness.measured import MeasuredEngine  # torch and Triton: only where a point runs on them

            state.engine = MeasuredEngine(self.measured, state.workloads.get)
        result = point_result(point, self.modes[point.index], state.workloads.get(point.scenario), state.engine)
        if state.engine is not None:
            result.device, result.checkpoint_load = state.engine.describe(), state.engine.model.load_stats
        return result

    def release(self) -> None:
        """Free this process's measured engine (model, KV cache, step graphs) now, not when the cyclic collector gets
        to it: the next run of the process builds its own, sized for its points, and two need not fit one GPU (the
        8B's profile grid is two runs, a 30 GB KV budget each)."""
        if self.state.engine is None:
            return
        self.state.engine = None
        gc.collect()  # the decode loops' graphs and events sit in reference cycles
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()


def point_result(point: Point, mode: Mode, requests: Requests, measured: MeasuredEngine | None) -> PointResult:
    """Run one point at its level and sum it up: its summary row (swept values, notes, metrics, host columns) and
    its tables."""
    sc = point.scenario
    notes = [mode.note]
    level = sc.engine.level
    if LEVELS[level].measured:
        run = measured.run(sc, requests, mode, run_on_clock)
        records, duration, backend = run.records, run.duration, run.backend
        host = {"host_slowdown": run.host_slowdown, "host_attempts": run.host_attempts, **run.gc.summary()}
        limit = sc.engine.host_slowdown
        if limit is not None and (run.host_attempts > 1 or run.host_slowdown > limit):
            notes.append(f"measured {run.host_attempts} times: the host was {run.host_slowdown:.2f}x slower than its "
                         f"fastest around the run kept (engine.host_slowdown: {limit})")
        device_syncs = backend.syncs.columns()
        if level == "hil" and backend.starved_steps:
            notes.append(f"{backend.starved_steps} steps' enqueue may have outlasted a GPU gate (their device times "
                         "may include launch gaps)")
    else:
        records, duration = run_on_clock(sc, requests, mode, model_backend(sc, requests, mode))
        # the same columns at every level (a sim point's GC pauses are modelled, in its steps' gc_pause_s)
        host = dict.fromkeys(["host_slowdown", "host_attempts", *GC_COLUMNS], np.nan)
        device_syncs = _no_device_syncs()
    ignored = ignored_fields(sc, level)
    if ignored:
        notes.append(ignored_message(ignored, level))
    # the metrics read the tables' arrays, which the writer takes as they are
    steps, syncs, emissions = records.steps_columns(), records.syncs_columns(), records.emissions_columns()
    metrics = compute_metrics(
        records.request_columns,
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
    tables = {"requests": records.request_columns, "steps": steps, "syncs": syncs, "emissions": emissions,
              "device_syncs": device_syncs}
    return PointResult(summary, tables)
