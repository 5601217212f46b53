"""Trace events: valid per check_trace for a synthetic engine timeline; check_trace catches errors."""

from __future__ import annotations

import copy
import json
from collections import deque

import numpy as np
import pandas as pd
import pytest
from trace_check import check_trace

import simharness
from simharness.metrics import host_intervals
from simharness.records import STEP_COLUMNS, SYNC_COLUMNS
from simharness.scenario import scenario_from_dict
from simharness.trace import (
    DEVICE_PHASE_COLUMNS,
    DEVICE_PHASES,
    MEASURED_FLOW_ID,
    MEASURED_PID,
    complete_slices,
    trace_events,
    trace_json,
)


def synthetic_records(
    n: int, *, depth: int = 2, k: int = 2, n_reqs: int = 4, gpu_us: float = 300.0, sync: bool = True
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A tiny depth-D engine loop like simulation.py's: steps and syncs with the columns of records.py.

    Each step: optional GC pause (every 5th step), schedule, a sync waiting for the previous
    step (the `wait` policy), prep, launch; the GPU runs steps FIFO; once D steps are in flight the
    host pops the oldest, waits for its output (the `output_readback` sync) and updates."""
    us = 1e-6
    t, gpu_free = 0.0, 0.0
    rows: list[dict] = []
    syncs: list[tuple] = []
    queue: deque[dict] = deque()
    for step in range(n):
        row: dict = {"step": step, "gc_pause_s": 100 * us if step % 5 == 3 else 0.0}
        t += row["gc_pause_s"]
        row["schedule_start"], row["schedule_end"] = t, t + 40 * us
        t = row["schedule_end"]
        row["sync_wait_s"], row["n_syncs"] = 0.0, 0
        if sync and rows:
            end = max(t, rows[-1]["gpu_end"]) + 5 * us
            syncs.append((step, "accepted_counts", "prep", "all_launched", t, end))
            row["sync_wait_s"], row["n_syncs"] = end - t, 1
            t = end
        row["prep_start"], row["prep_end"] = t, t + 60 * us
        row["launch_end"] = row["prep_end"] + 20 * us
        t = row["launch_end"]
        row["gpu_start"] = max(t, gpu_free)
        row["gpu_end"] = gpu_free = row["gpu_start"] + gpu_us * us
        row["bubble_s"] = row["gpu_start"] - rows[-1]["gpu_end"] if rows else 0.0
        queue.append(row)
        row["in_flight"] = len(queue)
        rows.append(row)
        while len(queue) == depth or (step == n - 1 and queue):
            done = queue.popleft()
            end = max(t, done["gpu_end"]) + 5 * us
            syncs.append((done["step"], "output_readback", "update", "oldest_in_flight", t, end))
            done["sync_wait_s"] += end - t
            done["n_syncs"] += 1
            t = end
            done["update_start"], done["update_end"] = t, t + 30 * us
            done["propose_start"] = done["propose_end"] = done["update_end"]
            t = done["update_end"]
    for row in rows:
        accepted = row["step"] % (k + 1)
        row.update(n_reqs=n_reqs, n_prefill_reqs=0, prefill_tokens=0, prefill_context=0,
                   decode_tokens=n_reqs * (1 + k), drafts_scheduled=n_reqs * k, drafts_valid=n_reqs * k,
                   accepted=accepted, emitted=n_reqs + accepted, wasted_slots=(1 + k) if row["step"] % 7 == 6 else 0)
        # hardware-in-the-loop columns as the sim level writes them
        row.update(measured="", device_syncs=0, harness_s=np.nan, **dict.fromkeys(DEVICE_PHASE_COLUMNS, np.nan))
    steps = pd.DataFrame(rows)[STEP_COLUMNS]
    for i in range(k):
        steps[f"acc_pos_{i}"] = (steps["accepted"] > i).astype(np.int64)
    return steps, pd.DataFrame(syncs, columns=SYNC_COLUMNS)


def _trace(n: int = 30, max_steps: int = 1000, **kw) -> dict:
    steps, syncs = synthetic_records(n, **kw)
    return {"traceEvents": trace_events(steps, syncs, max_steps=max_steps)}


def test_synthetic_trace_is_valid() -> None:
    for depth in (1, 2, 3):
        assert check_trace(_trace(depth=depth)) == []


def test_trace_lanes_and_contents() -> None:
    events = _trace(n=30)["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and "name" in e["args"]}
    assert names == {(1, "host (virtual time)"), (1, "engine loop"), (2, "GPU (virtual time)"), (2, "stream")}
    host = [e for e in events if e["ph"] == "X" and e["pid"] == 1]
    gpu = [e for e in events if e["ph"] == "X" and e["pid"] == 2]
    assert len(gpu) == 30
    assert gpu[3]["args"] == {"step": 3, "n_reqs": 4, "tokens": 12, "drafts": 8, "drafts_valid": 8, "accepted": 0,
                              "emitted": 4, "wasted_slots": 0}
    by_name = pd.Series([e["name"] for e in host]).value_counts()
    assert by_name["schedule"] == by_name["prep"] == by_name["launch"] == by_name["update"] == 30
    assert by_name["accepted_counts"] == 29 and by_name["output_readback"] == 30 and by_name["gc"] == 6
    assert "propose" not in by_name  # zero-length phases are skipped
    sync = next(e for e in host if e["name"] == "accepted_counts")
    assert sync["cat"] == "sync" and sync["args"]["phase"] == "prep" and sync["args"]["waits_for"] == "all_launched"
    gc = next(e for e in host if e["name"] == "gc")
    schedule = next(e for e in host if e["name"] == "schedule" and e["args"]["step"] == gc["args"]["step"])
    assert abs(gc["ts"] + gc["dur"] - schedule["ts"]) < 1e-6 and abs(gc["dur"] - 100.0) < 1e-6
    # times are microseconds: step 0 schedules at 0 for 40 us
    first = next(e for e in host if e["name"] == "schedule")
    assert first["ts"] == 0.0 and first["dur"] == 40.0


def test_counter_and_flows() -> None:
    events = _trace(n=30, depth=2)["traceEvents"]
    counter = [e["args"]["steps"] for e in events if e["ph"] == "C"]
    assert counter and max(counter) == 2 and min(counter) >= 0
    starts = [e for e in events if e["ph"] == "s"]
    finishes = [e for e in events if e["ph"] == "f"]
    assert len(starts) == len(finishes) == 30
    assert all(f["bp"] == "e" and f["pid"] == 2 for f in finishes) and all(s["pid"] == 1 for s in starts)


def test_max_steps() -> None:
    events = _trace(n=50, max_steps=10)["traceEvents"]
    steps = {e["args"]["step"] for e in events if e["ph"] == "X"}
    assert steps == set(range(10))
    assert check_trace({"traceEvents": events}) == []
    assert [e for e in _trace(n=5, max_steps=0)["traceEvents"] if e["ph"] != "M"] == []


def test_check_trace_catches_overlap() -> None:
    obj = _trace(n=10)
    update = next(e for e in obj["traceEvents"] if e["ph"] == "X" and e["name"] == "update")
    obj["traceEvents"].append({**update, "name": "planted", "ts": update["ts"] + 1.0})
    problems = check_trace(obj)
    assert len(problems) == 1 and "planted" in problems[0] and "overlaps" in problems[0]


def test_check_trace_allows_nesting_and_touching() -> None:
    events = complete_slices(1, 1, ["outer", "inner", "next"], [0.0, 1e-6, 3e-6], [3e-6, 3e-6, 4e-6], cat="x")
    assert check_trace({"traceEvents": events}) == []


def test_check_trace_catches_dangling_flow() -> None:
    obj = _trace(n=10)
    finish = next(e for e in obj["traceEvents"] if e["ph"] == "f")
    obj["traceEvents"].remove(finish)
    problems = check_trace(obj)
    assert problems == [f"flow ('launch', {finish['id']}): 1 start(s) and 0 finish(es), need 1 each"]


def test_check_trace_catches_unbound_flow() -> None:
    obj = _trace(n=10)
    start = next(e for e in obj["traceEvents"] if e["ph"] == "s")
    start["ts"] = 1e9
    problems = check_trace(obj)
    assert any("not inside a slice" in p for p in problems)


def test_check_trace_catches_malformed_events() -> None:
    assert check_trace([]) == ["top level must be an object with a 'traceEvents' list"]
    bad = [
        {"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": -1.0, "dur": 2.0},
        {"ph": "X", "name": "b", "pid": 1, "tid": 1, "ts": 1.0},
        {"ph": "X", "name": "c", "pid": 1, "tid": 1, "ts": "1", "dur": 1.0},
        {"ph": "M", "name": "thread_name", "pid": 1, "args": {"name": "x"}},
        {"ph": "Q", "name": "d"},
    ]
    problems = check_trace({"traceEvents": bad})
    assert len(problems) == 5
    assert "ts must be a non-negative number" in problems[0]
    assert "missing 'dur'" in problems[1] and "ts must be" in problems[2]
    assert "missing 'tid'" in problems[3] and "unsupported phase 'Q'" in problems[4]


def test_json_round_trip(tmp_path) -> None:
    steps, syncs = synthetic_records(40)
    events = trace_events(steps, syncs, max_steps=25)
    path = tmp_path / "trace.json"
    path.write_text(trace_json(events, {"scenario": "demo", "point": "scheduler.depth=2", "seed": np.int64(3)}))
    obj = json.loads(path.read_text())
    assert obj["traceEvents"] == copy.deepcopy(events)
    assert obj["otherData"] == {"scenario": "demo", "point": "scheduler.depth=2", "seed": "3"}
    assert check_trace(obj) == []


def test_host_intervals_are_sorted_and_non_empty() -> None:
    steps, syncs = synthetic_records(20)
    iv = host_intervals(steps, syncs)
    assert (iv["end_s"] > iv["start_s"]).all() and iv["start_s"].is_monotonic_increasing
    assert set(iv["kind"]) == {"gc", "schedule", "sync", "prep", "launch", "update"}
    empty = host_intervals(steps.iloc[:0], syncs.iloc[:0])
    assert list(empty.columns) == ["step", "kind", "name", "phase", "waits_for", "start_s", "end_s"]


# --------------------------------------------------------------------------------------------
# measured device phases (hardware in the loop)

# shares of a step's GPU time per device phase (prefill only in steps with prefill requests; propose: the rest)
SHARES = {"gpu_prefill_s": 0.3, "gpu_verify_s": 0.5, "gpu_sample_s": 0.1, "gpu_commit_s": 0.04}


def as_hil(steps: pd.DataFrame) -> pd.DataFrame:
    """A sim steps frame with the hardware-in-the-loop columns filled in consistently: device phases that
    add up to each step's GPU time, no prefill phase without prefill requests, one sync every 4th step."""
    hil = steps.copy()
    gpu = hil["gpu_end"] - hil["gpu_start"]
    for column, share in SHARES.items():
        hil[column] = gpu * share
    hil.loc[hil["n_prefill_reqs"] == 0, "gpu_prefill_s"] = 0.0
    hil["gpu_propose_s"] = gpu - hil[list(SHARES)].sum(axis=1)
    hil["measured"] = "prep,launch,gpu,readback"
    hil["device_syncs"] = (hil["step"] % 4 == 0).astype(np.int64)
    hil["harness_s"] = 20e-6
    return hil


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory) -> simharness.RunResult:
    """A tiny real sim run: one point at depth 2, with chunked prefill and speculation."""
    scenario = scenario_from_dict({
        "name": "tiny", "seed": 1, "scheduler": {"depth": 2},
        "workload": {"num_requests": 6, "concurrency": 3, "output_len": {"dist": "fixed", "value": 24}},
    })
    return simharness.run(scenario, out=tmp_path_factory.mktemp("runs"))


def test_sim_level_steps_have_no_measured_group(sim_run) -> None:
    events = trace_events(sim_run.steps, sim_run.syncs, max_steps=1000)
    assert all(e["pid"] != MEASURED_PID for e in events)
    old = sim_run.steps.drop(columns=[*DEVICE_PHASE_COLUMNS, "measured", "device_syncs", "harness_s"],
                             errors="ignore")  # a run written before these columns existed
    assert trace_events(old, sim_run.syncs, max_steps=1000) == events


def test_measured_phases_group(sim_run, tmp_path) -> None:
    steps = as_hil(sim_run.steps)
    assert (steps["n_prefill_reqs"] > 0).any() and (steps["n_prefill_reqs"] == 0).any()
    events = trace_events(steps, sim_run.syncs, max_steps=1000)
    meta = {(e["pid"], e["name"]): e["args"] for e in events if e["ph"] == "M"}
    assert meta[(MEASURED_PID, "process_name")] == {"name": "hil: measured phases"}
    assert meta[(MEASURED_PID, "process_sort_index")]["sort_index"] > meta[(2, "process_sort_index")]["sort_index"]
    assert meta[(MEASURED_PID, "thread_name")] == {"name": "device phases"}

    # the phases tile each GPU step exactly, in launch order, zero-length ones left out
    phases = [e for e in events if e["ph"] == "X" and e["pid"] == MEASURED_PID]
    gpu = {e["args"]["step"]: e for e in events if e["ph"] == "X" and e["pid"] == 2}
    assert {e["args"]["step"] for e in phases} == set(gpu) == set(steps["step"])
    for step, row in steps.set_index("step").iterrows():
        mine = [e for e in phases if e["args"]["step"] == step]
        assert [e["name"] for e in mine] == [p for p in DEVICE_PHASES if row[f"gpu_{p}_s"] > 0]
        assert mine[0]["ts"] == gpu[step]["ts"] and mine[0]["cat"] == "measured"
        assert abs(mine[-1]["ts"] + mine[-1]["dur"] - gpu[step]["ts"] - gpu[step]["dur"]) < 2e-3
        for a, b in zip(mine, mine[1:], strict=False):
            assert abs(a["ts"] + a["dur"] - b["ts"]) < 2e-3
        for e in mine:
            assert abs(e["dur"] - row[f"gpu_{e['name']}_s"] * 1e6) < 2e-3

    # each launch has an arrow to its GPU step and one to its first measured phase; all ids distinct
    starts = {(e["cat"], e["id"]): e for e in events if e["ph"] == "s"}
    finishes = {(e["cat"], e["id"]): e for e in events if e["ph"] == "f"}
    assert starts.keys() == finishes.keys() and len({key[1] for key in starts}) == len(starts) == 2 * len(steps)
    first = {e["args"]["step"]: e for e in reversed(phases)}
    for step in steps["step"]:
        start, finish = starts[("measured", MEASURED_FLOW_ID + step)], finishes[("measured", MEASURED_FLOW_ID + step)]
        assert start["ts"] == starts[("launch", step)]["ts"]  # from the same launch slice
        assert finish["pid"] == MEASURED_PID and finish["bp"] == "e"
        assert first[step]["ts"] < finish["ts"] < first[step]["ts"] + first[step]["dur"]

    path = tmp_path / "trace.json"
    path.write_text(trace_json(events, {"point": "base"}))
    obj = json.loads(path.read_text())
    assert obj["traceEvents"] == copy.deepcopy(events)
    assert check_trace(obj) == []


def test_measured_phases_with_max_steps(sim_run) -> None:
    events = trace_events(as_hil(sim_run.steps), sim_run.syncs, max_steps=5)
    assert {e["args"]["step"] for e in events if e["ph"] == "X" and e["pid"] == MEASURED_PID} == set(range(5))
    assert check_trace({"traceEvents": events}) == []


def test_trace_json_is_strict(tmp_path):
    """Viewers reject `Infinity`/`NaN`: an event at a non-finite time is left out, other non-finite numbers are null."""
    events = [
        {"ph": "X", "name": "ok", "pid": 0, "tid": 0, "ts": 1.0, "dur": 2.0, "args": {"x": float("nan")}},
        {"ph": "X", "name": "inf", "pid": 0, "tid": 0, "ts": 1.0, "dur": float("inf"), "args": {}},
        {"ph": "C", "name": "nan", "pid": 0, "ts": float("nan"), "args": {"steps": 1}},
    ]
    path = tmp_path / "t.json"
    path.write_text(trace_json(events, {"point": "p", "bad": [np.float64("-inf")]}))

    def no_constants(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    obj = json.loads(path.read_text(), parse_constant=no_constants)
    assert [ev["name"] for ev in obj["traceEvents"]] == ["ok"]
    assert obj["traceEvents"][0]["args"] == {"x": None} and obj["otherData"]["bad"] == [None]
