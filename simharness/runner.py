"""The sweep driver: scenario -> points -> (workload, acceptance, simulation) -> metrics -> run dir."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from simharness import results
from simharness.acceptance import make_acceptance
from simharness.metrics import compute_metrics
from simharness.models import checkpoint_dir
from simharness.records import Records, device_syncs_frame
from simharness.report import write_report
from simharness.scenario import Point, Scenario, ScenarioError, load_scenario, sweep_points
from simharness.simulation import Simulation, resolve_mode
from simharness.trace import trace_events, write_trace
from simharness.workload import build_requests


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
    points = sweep_points(scenario)
    for p in points:  # validate every point before running any
        try:
            resolve_mode(p.scenario)
        except ScenarioError as e:
            raise ScenarioError(f"sweep point {p.id}: {e}") from None
    if resume is not None:
        run_dir = Path(resume)
        stored = results.load_run_scenario(run_dir)
        if stored != scenario:
            raise ScenarioError(f"{run_dir}: was started from a different scenario; resume it with the same one")
    else:
        run_dir = results.new_run_dir(Path(out), scenario)
    done = results.finished_points(run_dir)
    todo = [p for p in points if p.index not in done]
    hil = _Hil(todo) if any(p.scenario.engine.backend == "torch" for p in todo) else None
    device = hil.describe() if hil else "sim (virtual time, cost model)"
    loaded = hil.model.load_stats if hil else None
    results.write_meta(run_dir, scenario, device=device, extra={"checkpoint_load": loaded} if loaded else None)
    if progress is not None:
        progress(run_dir, len(points) - len(todo), len(points), "")
    workloads: dict[str, object] = {}
    for n, point in enumerate(todo):
        _run_point(run_dir, point, workloads, hil)
        if progress is not None:
            progress(run_dir, len(points) - len(todo) + n + 1, len(points), point.id)
    summary, tables = results.combine(run_dir)
    write_report(run_dir)
    return RunResult(run_dir, summary, **tables)


def _workload(sc: Scenario, cache: dict):
    key = sc.workload.model_dump_json() + str(sc.seed) + sc.engine.model
    if key not in cache:
        cache.clear()  # keep one workload in memory: sweeps usually vary the workload last
        cache[key] = build_requests(sc.workload, sc.seed, checkpoint_dir(sc.engine.model))
    return cache[key]


class _Hil:
    """The hardware-in-the-loop side of a run: one target model, sized for every torch point, shared by them."""

    def __init__(self, points: list[Point]):
        from simharness.engine import torch_backend

        self.tb = torch_backend
        torch_points = [p.scenario for p in points if p.scenario.engine.backend == "torch"]
        engines = {(sc.engine.model, sc.engine.device, sc.engine.cuda_graphs) for sc in torch_points}
        if len(engines) > 1:
            raise ScenarioError("engine.model / engine.device / engine.cuda_graphs: a torch run uses one model on "
                                "one device; do not sweep them")
        slots = positions = 0
        cache: dict[str, object] = {}
        for sc in torch_points:
            requests = _workload(sc, cache)
            mode = resolve_mode(sc)
            s, n = torch_backend.capacity(sc, requests, mode.depth, mode.k)
            slots, positions = max(slots, s), max(positions, n)
        self.model = torch_backend.build_model(torch_points[0].engine, slots, positions)
        warmed = set()
        for sc in torch_points:  # each decode-loop configuration once, before anything is measured
            spec, mode = sc.engine.speculation, resolve_mode(sc)
            config = (mode.k, mode.ngram_cpu, mode.depth > 1, mode.optimistic, spec.invalid_slots, spec.min_n,
                      spec.max_n, spec.tie_break)
            if config not in warmed:
                warmed.add(config)
                torch_backend.warm_up(sc, _workload(sc, cache), self.model)

    def describe(self) -> str:
        import torch

        device = self.model.device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        return f"hil: {name}, torch {torch.__version__}, model {self.model.config.n_layers} layers"

    def simulate(self, sc: Scenario, requests) -> tuple[Simulation, Records, float, pd.DataFrame]:
        """Run one point on the real decode loop, recording its synchronizing CUDA operations."""
        backend = self.tb.TorchBackend(sc, requests, self.model, resolve_mode(sc), steer=sc.engine.steer)
        sim = Simulation(sc, requests, None, backend=backend)
        with backend.syncs:
            records, duration = sim.run()
        return sim, records, duration, backend.syncs.frame()


def _run_point(run_dir: Path, point: Point, cache: dict, hil: _Hil | None) -> None:
    sc = point.scenario
    requests = _workload(sc, cache)
    if sc.engine.backend == "torch":
        sim, records, duration, device_syncs = hil.simulate(sc, requests)
        level = "hil"
    else:
        sim = Simulation(sc, requests, make_acceptance(sc.engine.speculation, requests))
        records, duration = sim.run()
        device_syncs, level = device_syncs_frame([]), "sim"
    steps, syncs, emissions = records.steps_frame(), records.syncs_frame(), records.emissions_frame()
    metrics = compute_metrics(
        records.requests,
        emissions,
        steps,
        syncs,
        duration_s=duration,
        percentiles=sc.report.percentiles,
        goodput=sc.report.goodput,
        k=sim.mode.k,
    )
    summary = {"point": point.id, "index": point.index, "level": level}
    summary.update(point.values)
    note = sim.mode.note
    if level == "hil" and sim.backend.starved_steps:
        note = "; ".join(filter(None, [note, f"{sim.backend.starved_steps} steps' enqueue outlasted the GPU hold "
                                            "(their device times may include launch gaps)"]))
    summary.update(effective_depth=sim.mode.depth, note=note)
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
