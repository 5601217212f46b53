"""A trace checker for the tests: problems that would make a trace (simharness.trace) invalid or misdrawn in
Perfetto."""

import bisect
import math
from collections import defaultdict
from typing import Any

TOLERANCE_US = 1e-3  # float rounding allowed when comparing slice edges

REQUIRED_KEYS = {
    "X": ("name", "pid", "tid", "ts", "dur"),
    "C": ("name", "pid", "ts", "args"),
    "M": ("name", "pid", "args"),
    "s": ("name", "cat", "id", "pid", "tid", "ts"),
    "t": ("name", "cat", "id", "pid", "tid", "ts"),
    "f": ("name", "cat", "id", "pid", "tid", "ts"),
}


def check_trace(obj: Any) -> list[str]:
    """Problems that would make a trace invalid or misdrawn in Perfetto; [] means valid.

    Checks the top-level shape, required keys per phase, numeric non-negative ts/dur, strict
    nesting of slices per (pid, tid), and that every flow has one start and one finish, each
    inside a slice of its lane."""
    if not isinstance(obj, dict) or not isinstance(obj.get("traceEvents"), list):
        return ["top level must be an object with a 'traceEvents' list"]
    events = obj["traceEvents"]
    problems = [p for i, ev in enumerate(events) for p in _check_event(i, ev)]
    if problems:
        return problems  # lane checks assume well-formed events
    lanes = _lanes(events)
    for lane, slices in lanes.items():
        problems += _check_nesting(lane, slices)
    return problems + _check_flows(events, lanes)


def _check_event(i: int, ev: Any) -> list[str]:
    if not isinstance(ev, dict):
        return [f"event {i}: not an object"]
    ph = ev.get("ph")
    if ph not in REQUIRED_KEYS:
        return [f"event {i}: unsupported phase {ph!r}"]
    problems = [f"event {i} ({ph}): missing {key!r}" for key in REQUIRED_KEYS[ph] if key not in ev]
    if ph == "M" and ev.get("name") == "thread_name" and "tid" not in ev:
        problems.append(f"event {i} (M thread_name): missing 'tid'")
    for key in ("ts", "dur"):
        if key in ev and not _non_negative_number(ev[key]):
            problems.append(f"event {i} ({ph}): {key} must be a non-negative number, got {ev[key]!r}")
    if "args" in ev and not isinstance(ev["args"], dict):
        problems.append(f"event {i} ({ph}): args must be an object")
    return problems


def _non_negative_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _lanes(events: list[dict]) -> dict[tuple, list[tuple[float, float, str]]]:
    """Complete slices per (pid, tid) as (start, end, name), outer slices first at equal starts."""
    lanes: dict[tuple, list[tuple[float, float, str]]] = defaultdict(list)
    for ev in events:
        if ev["ph"] == "X":
            lanes[(ev["pid"], ev["tid"])].append((ev["ts"], ev["ts"] + ev["dur"], ev["name"]))
    for slices in lanes.values():
        slices.sort(key=lambda s: (s[0], -s[1]))
    return lanes


def _check_nesting(lane: tuple, slices: list[tuple[float, float, str]]) -> list[str]:
    problems = []
    open_slices: list[tuple[float, float, str]] = []  # the stack of enclosing slices
    for start, end, name in slices:
        while open_slices and open_slices[-1][1] <= start + TOLERANCE_US:
            open_slices.pop()
        if open_slices and end > open_slices[-1][1] + TOLERANCE_US:
            outer = open_slices[-1]
            problems.append(f"lane {lane}: {name!r} [{start}, {end}] overlaps {outer[2]!r} "
                            f"[{outer[0]}, {outer[1]}] without nesting")
            continue
        open_slices.append((start, end, name))
    return problems


def _check_flows(events: list[dict], lanes: dict[tuple, list[tuple[float, float, str]]]) -> list[str]:
    flows: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for ev in events:
        if ev["ph"] in ("s", "t", "f"):
            flows[(ev["cat"], ev["id"])][ev["ph"]].append(ev)
    tops = {lane: _top_level(slices) for lane, slices in lanes.items()}
    problems = []
    for key, by_ph in flows.items():
        starts, finishes = by_ph["s"], by_ph["f"]
        if len(starts) != 1 or len(finishes) != 1:
            problems.append(f"flow {key}: {len(starts)} start(s) and {len(finishes)} finish(es), need 1 each")
            continue
        if finishes[0]["ts"] < starts[0]["ts"] - TOLERANCE_US:
            problems.append(f"flow {key}: finishes before it starts")
        for ev in (*starts, *by_ph["t"], *finishes):
            if not _inside(tops.get((ev["pid"], ev["tid"]), []), ev["ts"]):
                problems.append(f"flow {key}: {ev['ph']} at {ev['ts']} is not inside a slice of "
                                f"lane {(ev['pid'], ev['tid'])}")
    return problems


def _top_level(slices: list[tuple[float, float, str]]) -> list[tuple[float, float]]:
    """The outermost slices of a (nested) lane: disjoint and sorted."""
    tops: list[tuple[float, float]] = []
    for start, end, _ in slices:
        if not tops or start >= tops[-1][1] - TOLERANCE_US:
            tops.append((start, end))
    return tops


def _inside(tops: list[tuple[float, float]], ts: float) -> bool:
    i = bisect.bisect_right(tops, (ts + TOLERANCE_US, math.inf)) - 1
    return i >= 0 and ts <= tops[i][1] + TOLERANCE_US
