"""Numbers from run records: serving metrics with `vllm bench serve` definitions and key names,
vLLM's spec-decode counters, and engine-loop metrics (GPU busy, bubbles, syncs, host time).

Latencies are reported in ms, throughputs per second of (virtual) run time. Everything is
vectorised over the record tables so that a long run costs milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from simharness.records import DEVICE_PHASE_COLUMNS, DEVICE_PHASES
from simharness.scenario import Goodput

MS = 1e3
HOST_WORK = ("schedule", "prep", "launch", "update", "propose")  # host phases that are engine work
# the host phases whose time per step is a metric of its own: where the engine's own code runs at the measured levels
# (schedule and update are the model's host costs there, spun less the harness's own time; docs/ci.md)
HOST_PHASE_METRICS = ("prep", "launch", "propose")
INTERVAL_COLUMNS = ["step", "kind", "name", "phase", "waits_for", "start_s", "end_s"]
# A record table as the metrics read it: a DataFrame, or its columns as arrays (`Records.steps_columns`), which a
# small point reads in a fraction of a frame's per-column cost
Table = pd.DataFrame | dict[str, Any]


def compute_metrics(
    requests: Table,
    emissions: Table,
    steps: Table,
    syncs: Table,
    *,
    duration_s: float,
    percentiles: Sequence[float],
    goodput: Goodput,
    k: int,
) -> dict[str, float]:
    """All metrics of one sweep point; counts are ints, everything else floats.

    Latency and throughput metrics cover finished requests (last_token_s set), as vLLM's cover
    successful ones; the spec-decode and engine metrics cover every recorded step."""
    # on arrays, each column read once: pandas' per-call overhead is most of a small point's cost
    last = _col(requests, "last_token_s")
    done = ~np.isnan(last)
    arrival = _col(requests, "arrival_s")[done]
    ttft = _col(requests, "first_token_s")[done] - arrival
    e2el = last[done] - arrival
    in_tokens = _col(requests, "prompt_tokens")[done]
    out_tokens = _col(requests, "output_tokens")[done]
    multi = out_tokens > 1
    tpot = (e2el[multi] - ttft[multi]) / (out_tokens[multi] - 1)

    metrics: dict[str, float] = {
        "completed": len(e2el),
        "total_input_tokens": int(in_tokens.sum()),
        "total_output_tokens": int(out_tokens.sum()),
        "duration_s": float(duration_s),
        "request_throughput": _ratio(len(e2el), duration_s),
        "output_throughput": _ratio(out_tokens.sum(), duration_s),
        "total_token_throughput": _ratio(out_tokens.sum() + in_tokens.sum(), duration_s),
    }
    itl = pooled_itl(emissions, np.asarray(requests["request_id"])[done])
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        metrics.update(latency_stats(name, values * MS, percentiles))
    if any(slo is not None for slo in (goodput.ttft_ms, goodput.tpot_ms, goodput.e2el_ms)):
        tpot_all = np.where(multi, (e2el - ttft) / np.maximum(out_tokens - 1, 1), 0.0)
        good = _meets_slos(ttft * MS, tpot_all * MS, e2el * MS, goodput)
        metrics["request_goodput"] = _ratio(good, duration_s)
    metrics.update(speculation_metrics(requests, steps, k))
    metrics.update(engine_metrics(steps, syncs))
    return metrics


def pooled_itl(emissions: Table, request_ids: np.ndarray) -> np.ndarray:
    """Gaps (s) between consecutive token-bearing emissions of each request, pooled over requests.

    One emission is one streamed chunk and may carry several tokens, so ITL is per chunk, as in
    vLLM's client."""
    rid = np.asarray(emissions["request_id"])
    keep = np.isin(rid, request_ids) & (np.asarray(emissions["tokens"]) > 0)
    rid, t = rid[keep], _col(emissions, "time_s")[keep]
    order = np.lexsort((t, rid))
    rid, t = rid[order], t[order]
    return np.diff(t)[rid[1:] == rid[:-1]]


def latency_stats(name: str, values_ms: np.ndarray, percentiles: Sequence[float]) -> dict[str, float]:
    """mean/median/std (population) and linear-interpolated percentiles; an empty list gives 0s. numpy's own
    arithmetic (np.mean, np.median, np.std, np.percentile), to the bit, on the values sorted once: each of those
    calls partitions or reduces anew, which was most of a small point's metrics."""
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms",
            *(f"{percentile_label(p)}_{name}_ms" for p in percentiles)]
    n = len(values_ms)
    if not n:
        return dict.fromkeys(keys, 0.0)
    mean = np.add.reduce(values_ms) / n  # pairwise over the values in their order, as np.mean sums
    deviation = values_ms - mean
    std = math.sqrt(np.add.reduce(deviation * deviation) / n)
    s = np.sort(values_ms)
    median = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2  # np.median: the mean of the middle two
    # np.percentile's linear method: between the values at floor((n - 1) q) and the next, the last from n - 1 on
    at = (n - 1) * (np.asarray(percentiles, dtype=np.float64) / 100)
    last = at >= n - 1
    low = np.where(last, -1, np.floor(at)).astype(np.intp)
    high = np.where(last, -1, low + 1)
    gamma = at - low
    a, b = s[low], s[high]
    diff = b - a
    tail = np.where(gamma >= 0.5, b - diff * (1 - gamma), a + diff * gamma)
    if np.isnan(s[-1]):  # numpy's median and percentiles of values with a NaN
        median, tail = math.nan, np.full(len(tail), math.nan)
    return dict(zip(keys, map(float, [mean, median, std, *tail]), strict=True))


def percentile_label(p: float) -> str:
    """vLLM's key spelling: 99 -> 'p99', 99.9 -> 'p99.9'."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


def speculation_metrics(requests: Table, steps: Table, k: int) -> dict[str, float]:
    """vLLM spec-decode counters: drafts are request-steps with >= 1 draft; acceptance rate in %.

    `scheduled_draft_tokens` counts the placeholder slots the scheduler reserved, which is what
    vLLM's async path reports as drafts (the dilution of issue #37150)."""
    num_drafts = int(_col(requests, "num_drafts").sum())
    draft_tokens = int(_col(requests, "draft_tokens").sum())
    accepted = int(_col(requests, "accepted_tokens").sum())
    metrics: dict[str, float] = {
        "num_drafts": num_drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "scheduled_draft_tokens": int(_col(steps, "drafts_scheduled").sum()),
        "acceptance_rate": _ratio(accepted, draft_tokens) * 100,
        "mean_acceptance_length": 1 + accepted / num_drafts if num_drafts else 0.0,
    }
    for i in range(k):
        metrics[f"acceptance_rate_pos_{i}"] = _ratio(_col(steps, f"acc_pos_{i}").sum(), num_drafts)
    return metrics


def engine_metrics(steps: Table, syncs: Table) -> dict[str, float]:
    """Per-step engine-loop figures: GPU time and busy fraction, bubbles, syncs, host phases, GC, and each device
    phase's and gated host phase's time per step (`phase_metric`), which tell where a change of the step's time lands.

    Syncs count only for recorded steps (a step launched as the run ends is never settled nor recorded)."""
    step_ids = np.asarray(steps["step"])
    n = len(step_ids)
    recorded = np.isin(np.asarray(syncs["step"]), step_ids)
    gpu_start, gpu_end = _col(steps, "gpu_start"), _col(steps, "gpu_end")
    gpu = gpu_end - gpu_start
    span = float(gpu_end.max() - gpu_start.min()) if n else 0.0
    gc = _col(steps, "gc_pause_s")
    # the measured levels' device busy time: the sum of a step's device phases, without the idle gaps its window
    # holds while the device waits for the host's enqueues (the sim models no phases: NaN, not compared)
    device = np.column_stack([_col(steps, c) for c in DEVICE_PHASE_COLUMNS])
    phases = _phases(steps, syncs)
    host_s = _host_work_s(phases)
    own_s = {p: _busy_s(*phases[p]) for p in HOST_PHASE_METRICS}  # the host phases with metrics of their own
    wasted = int(_col(steps, "wasted_slots").sum())
    return {
        "num_steps": n,
        "mean_step_ms": _mean(gpu) * MS,
        "gpu_busy_fraction": _ratio(gpu.sum(), span),
        "mean_device_ms": _device_ms(device.sum(axis=1), n),
        "mean_bubble_ms": _mean(_col(steps, "bubble_s")) * MS,
        "syncs_per_step": _ratio(np.count_nonzero(recorded), n),
        "sync_wait_ms_per_step": _ratio((_col(syncs, "end_s")[recorded] - _col(syncs, "start_s")[recorded]).sum(),
                                        n) * MS,
        "mean_host_ms_per_step": _ratio(host_s, n) * MS,
        "gc_pauses_per_step": _ratio(np.count_nonzero(gc > 0), n),
        "gc_pause_ms_per_step": _ratio(gc.sum(), n) * MS,
        "wasted_slots": wasted,
        "wasted_slot_fraction": _ratio(wasted, _col(steps, "decode_tokens").sum()),
        "mean_batch_size": _mean(_col(steps, "n_reqs")),
        "tokens_per_step": _mean(_col(steps, "emitted")),
        **{phase_metric("device", p): _device_ms(device[:, i], n) for i, p in enumerate(DEVICE_PHASES)},
        **{phase_metric("host", p): _ratio(seconds, n) * MS for p, seconds in own_s.items()},
        # a phase's share of the host work: the run's host speed, which moves every phase alike (20-28% run to run
        # at real), cancels, and a change to one phase's code does not
        **{share_metric(p): _ratio(seconds, host_s) for p, seconds in own_s.items()},
    }


def phase_metric(side: str, phase: str) -> str:
    """The metric of one phase's time per step: `device_verify_ms_per_step`, `host_prep_ms_per_step` (a name that is
    no latency statistic's, `<stat>_<kind>_ms`: each phase is a family of its own in compare's test)."""
    return f"{side}_{phase}_ms_per_step"


def share_metric(phase: str) -> str:
    """The metric of a host phase's share of the host work: `host_prep_share`."""
    return f"host_{phase}_share"


def _device_ms(seconds: np.ndarray, n: int) -> float:
    """The mean over the steps with a measured time (ms); NaN where steps have none (the sim), 0 with no steps."""
    measured = seconds[np.isfinite(seconds)]
    return _mean(measured) * MS if len(measured) or not n else math.nan


def host_intervals(steps: pd.DataFrame, syncs: pd.DataFrame) -> pd.DataFrame:
    """Every non-empty interval of the engine thread, sorted by start (outer first at ties).

    Columns: step, kind (gc, schedule, prep, launch, update, propose, sync), name (the sync's
    name, else the kind), phase and waits_for (syncs only), start_s, end_s. Launch runs from the
    end of prep, or of the step's launch-phase syncs, to launch_end. A GC pause opens the loop
    iteration: it ends where schedule starts, or where the step's first (schedule-phase) sync does."""
    phases = _phases(steps, syncs)
    n = len(steps)
    if not n + len(syncs):
        return pd.DataFrame(columns=INTERVAL_COLUMNS)
    # built as arrays and made a frame once (a frame per phase, concatenated, took most of a small point's time)
    kinds = np.repeat(np.array(list(phases), dtype=object), n)
    nones = np.full(len(phases) * n, None, dtype=object)
    columns = {
        "step": [np.tile(steps["step"].to_numpy(), len(phases)), syncs["step"].to_numpy()],
        "kind": [kinds, np.full(len(syncs), "sync", dtype=object)],
        "name": [kinds, syncs["name"].to_numpy(dtype=object)],
        "phase": [nones, syncs["phase"].to_numpy(dtype=object)],
        "waits_for": [nones, syncs["waits_for"].to_numpy(dtype=object)],
        "start_s": [np.concatenate([start for start, _ in phases.values()]), _col(syncs, "start_s")],
        "end_s": [np.concatenate([end for _, end in phases.values()]), _col(syncs, "end_s")],
    }
    # each column from the parts that have rows (a part without rows adds no dtype of its own)
    merged = {name: np.concatenate([p for p in parts if len(p)]) for name, parts in columns.items()}
    order = _order(merged["start_s"], merged["end_s"])
    frame = {name: values[order] for name, values in merged.items()}
    # the dtypes a concatenation of per-phase frames gave: text, and the syncs' own where no step row has None
    text = pd.StringDtype(na_value=np.nan)
    typed = {"kind": text, "name": text, "phase": object if n else syncs["phase"].dtype,
             "waits_for": object if n else syncs["waits_for"].dtype}
    return pd.DataFrame({name: pd.Series(values, dtype=typed[name]) if name in typed else values
                         for name, values in frame.items()})


def _host_work_s(phases: dict[str, tuple[np.ndarray, np.ndarray]]) -> float:
    """The engine thread's time in host work (the HOST_WORK phases of `_phases`), summed in `host_intervals`'
    order."""
    work = [bounds for kind, bounds in phases.items() if kind in HOST_WORK]
    return _busy_s(np.concatenate([start for start, _ in work]), np.concatenate([end for _, end in work]))


def _busy_s(start: np.ndarray, end: np.ndarray) -> float:
    """The total length of the non-empty intervals, summed in `host_intervals`' order."""
    order = _order(start, end)
    return float((end[order] - start[order]).sum())  # pairwise, as pandas' sum of these (NaN-free) gaps was


def _order(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """The non-empty intervals, by start, outer (later end) first at ties; stable."""
    keep = np.flatnonzero(end > start)
    return keep[np.lexsort((-end[keep], start[keep]))]


def _phases(steps: Table, syncs: Table) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each host phase's [start, end) per step. Launch runs from the end of prep, or of the step's launch-phase
    syncs, to launch_end; a GC pause ends where schedule starts, or where the step's first sync does."""
    step_ids, sync_steps = np.asarray(steps["step"]), np.asarray(syncs["step"])
    first_sync = _per_step(step_ids, sync_steps, _col(syncs, "start_s"), np.fmin)
    launch = np.asarray(syncs["phase"], dtype=object) == "launch"
    launch_sync_end = _per_step(step_ids, sync_steps[launch], _col(syncs, "end_s")[launch], np.fmax)
    schedule_start = _col(steps, "schedule_start")
    gc_end = np.fmin(schedule_start, first_sync)
    prep_end = _col(steps, "prep_end")
    return {
        "gc": (gc_end - _col(steps, "gc_pause_s"), gc_end),
        "schedule": (schedule_start, _col(steps, "schedule_end")),
        "prep": (_col(steps, "prep_start"), prep_end),
        "launch": (np.fmax(prep_end, launch_sync_end), _col(steps, "launch_end")),
        "update": (_col(steps, "update_start"), _col(steps, "update_end")),
        "propose": (_col(steps, "propose_start"), _col(steps, "propose_end")),
    }


def _per_step(step_ids: np.ndarray, keys: np.ndarray, values: np.ndarray, reduce: np.ufunc) -> np.ndarray:
    """For each step of `step_ids`, `reduce` (np.fmin, np.fmax) over the `values` whose key is that step; NaN for a
    step with none (a groupby and a map, in numpy: a pandas groupby took a tenth of a small point's time)."""
    order = np.argsort(step_ids, kind="stable")
    pos = np.minimum(np.searchsorted(step_ids[order], keys), max(len(step_ids) - 1, 0))
    found = step_ids[order][pos] == keys if len(step_ids) else np.zeros(len(keys), dtype=bool)
    out = np.full(len(step_ids), np.nan)
    reduce.at(out, order[pos[found]], values[found])  # fmin/fmax: NaN gives way to the first value
    return out


def _meets_slos(ttft_ms: np.ndarray, tpot_ms: np.ndarray, e2el_ms: np.ndarray, goodput: Goodput) -> int:
    """Requests within every SLO that is set (a metric equal to its SLO passes, as in vLLM)."""
    ok = np.ones(len(ttft_ms), dtype=bool)
    for values, slo in ((ttft_ms, goodput.ttft_ms), (tpot_ms, goodput.tpot_ms), (e2el_ms, goodput.e2el_ms)):
        if slo is not None:
            ok &= values <= slo
    return int(ok.sum())


def _col(table: Table, name: str) -> np.ndarray:
    return np.asarray(table[name], dtype=np.float64)


def _mean(values: np.ndarray) -> float:
    return float(values.mean()) if len(values) else 0.0


def _ratio(num: float, den: float) -> float:
    return float(num) / float(den) if den else 0.0
