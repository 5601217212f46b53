"""Chrome / Perfetto trace-event JSON for one sweep point.

Layout: pid 1 is the host (engine loop thread: schedule, sync waits, prep, launch, update,
propose, GC pauses), pid 2 the GPU stream (one slice per step); a counter tracks in-flight steps
and flow arrows link each launch to its GPU step. Hardware-in-the-loop steps add pid 3, their
measured device phases laid out back to back from each step's GPU start, with a second arrow
from each launch to its first phase. Times are virtual time in microseconds.
Perfetto needs the slices of one (pid, tid) lane to nest strictly (the tests check it: tests/trace_check.py).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from simharness.metrics import host_intervals
from simharness.pointfiles import finished_ids, point_dir, read_points
from simharness.records import DEVICE_PHASE_COLUMNS, DEVICE_PHASES
from simharness.results import load_run_scenario

US = 1e6
HOST_PID, GPU_PID, MEASURED_PID = 1, 2, 3
ENGINE_TID, STREAM_TID, DEVICE_PHASES_TID = 1, 1, 1
MEASURED_FLOW_ID = 1 << 40  # added to the step id: launch -> measured-phase flows never share an id


# --------------------------------------------------------------------------------------------
# building blocks (reused for other lanes, e.g. measured phases of hardware-in-the-loop runs)


def process_metadata(pid: int, name: str, sort_index: int) -> list[dict]:
    """Name a process (a group of lanes) and fix its position in the UI."""
    return [
        {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": sort_index}},
    ]


def thread_metadata(pid: int, tid: int, name: str) -> list[dict]:
    """Name one lane (thread) of a process."""
    return [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}]


def complete_slices(
    pid: int,
    tid: int,
    name: str | Sequence[str],
    start_s: Sequence[float] | np.ndarray,
    end_s: Sequence[float] | np.ndarray,
    *,
    cat: str | Sequence[str],
    args: Sequence[dict] | None = None,
) -> list[dict]:
    """Complete ('X') events for [start, end) intervals given in seconds, one lane.

    `name` and `cat` are one value for all slices or one per slice; intervals of zero length
    (after rounding to ns) are skipped. The intervals of one lane must nest or be disjoint."""
    ts = np.round(np.asarray(start_s, dtype=np.float64) * US, 3)
    end = np.round(np.asarray(end_s, dtype=np.float64) * US, 3)
    names = [name] * len(ts) if isinstance(name, str) else list(name)
    cats = [cat] * len(ts) if isinstance(cat, str) else list(cat)
    starts, ends = ts.tolist(), end.tolist()  # Python floats: indexing numpy scalars one by one is slow
    return [
        {
            "ph": "X",
            "name": names[i],
            "cat": cats[i],
            "pid": pid,
            "tid": tid,
            "ts": starts[i],
            "dur": round(ends[i] - starts[i], 3),
            "args": args[i] if args is not None else {},
        }
        for i in np.flatnonzero(end > ts).tolist()
    ]


# --------------------------------------------------------------------------------------------
# the engine trace


def trace_events(steps: pd.DataFrame, syncs: pd.DataFrame, *, max_steps: int) -> list[dict]:
    """Trace events for the first `max_steps` steps of one sweep point."""
    steps = steps.sort_values("step").head(max_steps)
    syncs = syncs[syncs["step"].isin(steps["step"])]
    events = [
        *process_metadata(HOST_PID, "host (virtual time)", 0),
        *thread_metadata(HOST_PID, ENGINE_TID, "engine loop"),
        *process_metadata(GPU_PID, "GPU (virtual time)", 1),
        *thread_metadata(GPU_PID, STREAM_TID, "stream"),
    ]
    events += _host_slices(steps, syncs)
    events += _gpu_slices(steps)
    events += _in_flight_counter(steps)
    events += _launch_flows(steps)
    if has_measured_phases(steps):
        events += [
            *process_metadata(MEASURED_PID, "hil: measured phases", 2),
            *thread_metadata(MEASURED_PID, DEVICE_PHASES_TID, "device phases"),
        ]
        events += _measured_slices_and_flows(steps)
    return events


def write_traces(run_dir: Path, points: set[str] | None = None) -> list[Path]:
    """Write `traces/<index>_<point>.json` for the finished points of `points` (every one when None) from the run's
    steps and syncs; returns their paths. A run writes them for the points its report draws; the others cost
    ~10 ms each, so they are written when asked for (a sweep of tiny points would spend most of its time on
    them)."""
    ids = finished_ids(run_dir)
    wanted = set(ids.values()) if points is None else points
    default = load_run_scenario(run_dir).report.trace_steps
    steps = read_points(run_dir, "steps", points=wanted)
    syncs = read_points(run_dir, "syncs", points=wanted)
    directory = run_dir / "traces"
    directory.mkdir(exist_ok=True)
    paths = []
    for index, point in ids.items():
        if point not in wanted or steps.empty:
            continue
        row = json.loads((point_dir(run_dir, index) / "summary.json").read_text())
        limit = int(row.get("report.trace_steps", default))  # swept, or the run's
        events = trace_events(_of(steps, point), _of(syncs, point), max_steps=limit)
        path = directory / f"{index:04d}_{_slug(point)}.json"
        path.write_text(trace_json(events, {"point": point}))
        paths.append(path)
    return paths


def _of(table: pd.DataFrame, point: str) -> pd.DataFrame:
    """A point's rows of a table read with `point` first, as the point recorded them."""
    return table[table["point"] == point].drop(columns="point").reset_index(drop=True)


def _slug(point_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", point_id.replace("=", "-"))[:120] or "base"


def has_measured_phases(steps: pd.DataFrame) -> bool:
    """Whether steps carry device phases measured on hardware (not so at the sim level or in old runs)."""
    return "gpu_verify_s" in steps.columns and bool(steps["gpu_verify_s"].notna().any())


def trace_json(events: list[dict], metadata: Mapping[str, Any]) -> str:
    """A trace JSON object; `metadata` (scenario, point, seed...) goes to `otherData`. Strict JSON: an event at a
    non-finite time is left out, and any other non-finite number is written as null (no `Infinity`/`NaN`, which
    trace viewers reject)."""
    timed = [ev for ev in events if _finite(ev.get("ts")) and _finite(ev.get("dur"))]
    obj = {"traceEvents": timed, "displayTimeUnit": "ms", "otherData": dict(metadata)}
    try:  # the usual case, every number finite: no copy of the events
        return json.dumps(obj, separators=(",", ":"), default=_finite_str, allow_nan=False)
    except ValueError:
        return json.dumps(_finite_json(obj), separators=(",", ":"), default=str, allow_nan=False)


def _finite(x: Any) -> bool:
    return not isinstance(x, float) or math.isfinite(x)


def _finite_str(value: Any) -> str:
    """json's fallback for other types (str), refusing a non-finite numpy float as json does a float."""
    if isinstance(value, np.floating) and not math.isfinite(value):
        raise ValueError("non-finite number")
    return str(value)


def _finite_json(value: Any) -> Any:
    """`value` with every non-finite float replaced by None, in dicts and lists at any depth."""
    if isinstance(value, dict):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_json(v) for v in value]
    if isinstance(value, float | np.floating) and not math.isfinite(value):
        return None
    return value


def _host_slices(steps: pd.DataFrame, syncs: pd.DataFrame) -> list[dict]:
    iv = host_intervals(steps, syncs)
    kinds = iv["kind"].tolist()
    args = [
        {"step": int(step), "phase": phase, "waits_for": waits_for} if kind == "sync" else {"step": int(step)}
        for step, kind, phase, waits_for in zip(iv["step"].tolist(), kinds, iv["phase"].tolist(),
                                                iv["waits_for"].tolist(), strict=True)
    ]
    cats = [kind if kind in ("gc", "sync") else "host" for kind in kinds]
    return complete_slices(HOST_PID, ENGINE_TID, list(iv["name"]), iv["start_s"], iv["end_s"],
                           cat=cats, args=args)


def _gpu_slices(steps: pd.DataFrame) -> list[dict]:
    columns = ["step", "n_reqs", "prefill_tokens", "decode_tokens", "drafts_scheduled", "drafts_valid", "accepted",
               "emitted", "wasted_slots"]
    args = [
        {
            "step": int(step),
            "n_reqs": int(n_reqs),
            "tokens": int(prefill + decode),
            "drafts": int(drafts),
            "drafts_valid": int(valid),
            "accepted": int(accepted),
            "emitted": int(emitted),
            "wasted_slots": int(wasted),
        }
        for step, n_reqs, prefill, decode, drafts, valid, accepted, emitted, wasted
        in zip(*(steps[c].tolist() for c in columns), strict=True)
    ]
    return complete_slices(GPU_PID, STREAM_TID, "step", steps["gpu_start"], steps["gpu_end"],
                           cat="gpu", args=args)


def _in_flight_counter(steps: pd.DataFrame) -> list[dict]:
    """Steps launched and not yet processed (launch end -> update start), as a counter track.

    Only up to the last included launch: after it, later (excluded) launches would be missing."""
    if steps.empty:
        return []
    times = np.concatenate([steps["launch_end"], steps["update_start"]])
    deltas = np.concatenate([np.ones(len(steps)), -np.ones(len(steps))])
    order = np.argsort(times, kind="stable")
    times, level = times[order], np.cumsum(deltas[order])
    last = np.r_[times[1:] != times[:-1], True]  # one value per timestamp: the last one
    keep = last & (times <= steps["launch_end"].max())
    return [
        {"ph": "C", "name": "in-flight steps", "pid": HOST_PID, "ts": round(float(t) * US, 3),
         "args": {"steps": int(v)}}
        for t, v in zip(times[keep], level[keep], strict=True)
    ]


def _launch_flows(steps: pd.DataFrame) -> list[dict]:
    """Arrows from each launch slice's start to its GPU step's midpoint (the device may start on a step while the
    host still enqueues it, as the real level measures and a cost profile replays, so not from the launch's end)."""
    events = []
    columns = ["step", "prep_end", "launch_end", "gpu_start", "gpu_end"]
    for step, prep_end, launch_end, gpu_start, gpu_end in zip(*(steps[c].tolist() for c in columns), strict=True):
        launch_us = (round(prep_end * US, 3), round(launch_end * US, 3))
        gpu_us = (round(gpu_start * US, 3), round(gpu_end * US, 3))
        if launch_us[1] <= launch_us[0] or gpu_us[1] <= gpu_us[0]:
            continue
        common = {"name": "launch", "cat": "launch", "id": int(step)}
        events.append({**common, "ph": "s", "pid": HOST_PID, "tid": ENGINE_TID, "ts": launch_us[0]})
        events.append({**common, "ph": "f", "bp": "e", "pid": GPU_PID, "tid": STREAM_TID,
                       "ts": sum(gpu_us) / 2})
    return events


def _measured_slices_and_flows(steps: pd.DataFrame) -> list[dict]:
    """Each step's measured device phases back to back from its GPU start, and an arrow from its launch
    slice's start to the first of them. A phase that did not run (0 s, or not measured) gets no slice."""
    durations = steps[DEVICE_PHASE_COLUMNS].to_numpy(dtype=np.float64, na_value=0.0)
    start = steps["gpu_start"].to_numpy(dtype=np.float64)
    edges = start[:, None] + np.concatenate([np.zeros((len(steps), 1)), np.cumsum(durations, axis=1)], axis=1)
    events = []
    for r, step_edges in zip(steps.itertuples(), edges, strict=True):
        args = [{"step": int(r.step)} for _ in DEVICE_PHASES]
        slices = complete_slices(MEASURED_PID, DEVICE_PHASES_TID, list(DEVICE_PHASES), step_edges[:-1],
                                 step_edges[1:], cat="measured", args=args)
        events += slices
        launch_us = (round(r.prep_end * US, 3), round(r.launch_end * US, 3))
        if not slices or launch_us[1] <= launch_us[0]:
            continue
        common = {"name": "launch", "cat": "measured", "id": MEASURED_FLOW_ID + int(r.step)}
        events.append({**common, "ph": "s", "pid": HOST_PID, "tid": ENGINE_TID, "ts": launch_us[0]})
        events.append({**common, "ph": "f", "bp": "e", "pid": MEASURED_PID, "tid": DEVICE_PHASES_TID,
                       "ts": slices[0]["ts"] + slices[0]["dur"] / 2})
    return events
