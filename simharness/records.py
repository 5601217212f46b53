"""What a run records, at every level: steps, syncs, emissions, requests.

The engine loop records each settled `Step`: its host columns are kept as a row, and a compiled function
counts its batch table into step counts, emissions and per-request tallies (no pandas, no per-step arrays
kept); `Records` turns them into pandas DataFrames with fixed columns, which metrics, report and trace
consume. All times are seconds since the start of the run (virtual time at the sim and hil levels).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Any

import numpy as np
import pandas as pd

from simharness import policy
from simharness.jit import njit
from simharness.policy import Batch

# The device phases a hardware backend times, in device order: the step's prefill chunks, then the decode
# step's phases (engine/decode.py). Their step columns are `gpu_<phase>_s`.
DEVICE_PHASES = ("prefill", "verify", "sample", "commit", "propose")
DEVICE_PHASE_COLUMNS = [f"gpu_{p}_s" for p in DEVICE_PHASES]


@dataclass(slots=True, eq=False)
class Step:
    """One launched step: its batch and its timeline. The fields from `step` to `harness_s` are the host columns of
    the steps table, in order (`HOST_COLUMNS`); the batch table's outcome rows, filled by the backend, give the
    rest (`COUNT_COLUMNS`).

    Host phases are [start, end) intervals on the engine thread, in seconds since the run's start; a phase that
    did not happen has start == end. `bubble_s` is GPU idle time between the previous step's end and this one's
    start."""

    step: int
    batch: Batch
    in_flight: int = 0
    schedule_start: float = 0.0
    schedule_end: float = 0.0
    prep_start: float = 0.0
    prep_end: float = 0.0
    launch_end: float = 0.0
    gpu_start: float = 0.0
    gpu_end: float = math.inf  # known once the step started
    update_start: float = 0.0
    update_end: float = 0.0
    propose_start: float = 0.0
    propose_end: float = 0.0
    gc_pause_s: float = 0.0
    sync_wait_s: float = 0.0
    n_syncs: int = 0
    bubble_s: float = 0.0
    # Measured levels: the phases this step's times were measured for ("" at the sim level), the device time of
    # each of DEVICE_PHASES (they add up to gpu_end - gpu_start; NaN at the sim level), synchronizing CUDA
    # operations caught in the step, and the harness's own host time for it (NaN at the sim level).
    measured: str = ""
    gpu_prefill_s: float = math.nan
    gpu_verify_s: float = math.nan
    gpu_sample_s: float = math.nan
    gpu_commit_s: float = math.nan
    gpu_propose_s: float = math.nan
    device_syncs: int = 0
    harness_s: float = math.nan
    # Not recorded: prep cut the verified slots to the valid drafts (known at a sync); when the launch began
    # (after the launch phase's syncs); where the backend knows it, when each part of the launch (a prefill chunk,
    # a decode phase) was enqueued, as (start, end) host seconds after launch_start, and each part's device time
    # (None: the step was enqueued at once when its launch ended); the host seconds of its readback, and of the
    # host's wake-up when it blocked on the step (hil: measured at the real wait, `DeviceClock.wait`); when a sync
    # point read it back (None: not read at a sync; the sim level); the level's handle on its completion (a SimPy
    # event at the sim and hil levels).
    trimmed: bool = False
    launch_start: float = 0.0
    enqueue: Sequence[tuple[float, float]] | None = None
    parts_s: Sequence[float] | None = None
    readback_s: float = 0.0
    wake_s: float = 0.0
    read_back: float | None = None
    done: Any = None

    def set_device_phases(self, seconds: Sequence[float]) -> None:
        """The measured device time of each of DEVICE_PHASES, in order."""
        for column, value in zip(DEVICE_PHASE_COLUMNS, seconds, strict=True):
            setattr(self, column, value)


# Step columns counted from the batch table (`record_step`), then one `acc_pos_<i>` per draft position; the
# others are the step's host columns.
COUNT_COLUMNS = ["n_reqs", "n_prefill_reqs", "prefill_tokens", "prefill_context", "decode_tokens", "drafts_scheduled",
                 "drafts_valid", "accepted", "emitted", "wasted_slots"]
_NOT_RECORDED = ("batch", "trimmed", "launch_start", "enqueue", "parts_s", "readback_s", "wake_s", "read_back",
                 "done")
HOST_COLUMNS = [f.name for f in fields(Step) if f.name not in _NOT_RECORDED]
STEP_COLUMNS = [HOST_COLUMNS[0], *COUNT_COLUMNS, *HOST_COLUMNS[1:]]
assert set(DEVICE_PHASE_COLUMNS) <= set(HOST_COLUMNS), "every device phase has its Step field"
_host_row = attrgetter(*HOST_COLUMNS)

SYNC_COLUMNS = ["step", "name", "phase", "waits_for", "start_s", "end_s"]
# Synchronizing CUDA operations caught in a hardware-in-the-loop run (instrument.SyncRecorder).
DEVICE_SYNC_DTYPES = {"step": "int64", "phase": "str", "site": "str", "wait_s": "float64"}
EMISSION_COLUMNS = ["request_id", "step", "time_s", "tokens"]
REQUEST_COLUMNS = [
    "request_id",
    "kind",
    "arrival_s",
    "prompt_tokens",
    "output_tokens",
    "first_token_s",
    "last_token_s",
    "num_chunks",
    "num_drafts",
    "draft_tokens",
    "accepted_tokens",
    "wasted_slots",
]

N_COUNTS = len(COUNT_COLUMNS)
(N_REQS, N_PREFILL_REQS, PREFILL_TOKENS, PREFILL_CONTEXT, DECODE_TOKENS, DRAFTS_SCHEDULED, DRAFTS_VALID, ACCEPTED,
 EMITTED, WASTED_SLOTS) = range(N_COUNTS)
# Per-request tallies: the time columns of REQUEST_COLUMNS (rows of `request_times`), then its counts
# (rows of `request_counts`).
ARRIVAL_S, FIRST_TOKEN_S, LAST_TOKEN_S = range(3)
NUM_CHUNKS, NUM_DRAFTS, DRAFT_TOKENS, ACCEPTED_TOKENS, REQUEST_WASTED_SLOTS = range(5)
STEP_CAPACITY = 1024  # steps buffered before the buffer doubles


class Records:
    """Buffers filled by the engine loop; the `*_frame()` methods return the DataFrames.

    A settled step adds its host row and, in one compiled call, its counts, emissions and per-request
    tallies from the batch table."""

    def __init__(self, k: int, output_len: np.ndarray):
        n_requests = len(output_len)
        self.k = k
        self.steps: list[tuple] = []  # per step, the HOST_COLUMNS
        self.step_counts = np.zeros((STEP_CAPACITY, N_COUNTS + k), dtype=np.int64)  # per step
        self.syncs: list[tuple] = []  # rows of SYNC_COLUMNS
        # Emissions: request id and tokens, compact (int32) since a run's first touch of memory costs more than
        # filling it, and in step order: the emissions of step i end at emission_ends[i], at emission_times[i].
        # An emission carries at least one of the output tokens, so there are at most sum(output_len).
        self.emissions = np.zeros((2, int(output_len.sum())), dtype=np.int32)
        self.emission_ends: list[int] = []
        self.emission_times: list[float] = []
        self.n_emissions = 0
        self.request_times = np.full((3, n_requests), np.nan)  # ARRIVAL_S, FIRST_TOKEN_S, LAST_TOKEN_S (NaN: none)
        self.request_counts = np.zeros((5, n_requests), dtype=np.int64)  # NUM_CHUNKS .. REQUEST_WASTED_SLOTS
        self.request_columns: dict[str, np.ndarray] = {}  # the requests table's arrays, set at the end of the run

    def add_step(self, step: Step, time: float) -> None:
        """A settled step (its batch table holds the outcome rows) and the time its tokens reached the clients."""
        i = len(self.steps)
        if i == len(self.step_counts):
            self.step_counts = np.concatenate((self.step_counts, np.zeros_like(self.step_counts)))
        self.n_emissions = record_step(step.batch.table, time, self.step_counts, i, self.emissions, self.n_emissions,
                                       self.request_times, self.request_counts)
        self.emission_ends.append(self.n_emissions)
        self.emission_times.append(time)
        self.steps.append(_host_row(step))

    def steps_columns(self) -> dict[str, np.ndarray]:
        """The steps table's columns as arrays (metrics read these; `steps_frame` makes them a frame)."""
        # the host rows column by column: numpy gives each column the type from_records gave it, in a third of the
        # time (a frame in between cost more than a small point's metrics)
        rows = self.steps
        columns = _columns(rows, HOST_COLUMNS)
        counts = self.step_counts[: len(rows)]
        columns.update({c: counts[:, i] for i, c in enumerate(COUNT_COLUMNS)})
        columns = {c: columns[c] for c in STEP_COLUMNS}
        columns.update({f"acc_pos_{i}": counts[:, N_COUNTS + i] for i in range(self.k)})
        return columns

    def steps_frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.steps_columns())

    def syncs_columns(self) -> dict[str, np.ndarray]:
        return _columns(self.syncs, SYNC_COLUMNS)

    def syncs_frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.syncs_columns())

    def set_requests(self, kind: np.ndarray, prompt_len: np.ndarray, output_len: np.ndarray) -> None:
        """The per-request table's arrays (`request_columns`, which metrics and the point's writer read), given each
        request's kind name and lengths, once the run ended."""
        t = self.request_times
        columns = [np.arange(len(kind)), kind, t[ARRIVAL_S], prompt_len, output_len, t[FIRST_TOKEN_S],
                   t[LAST_TOKEN_S], *self.request_counts]
        self.request_columns = dict(zip(REQUEST_COLUMNS, columns, strict=True))

    @property
    def requests(self) -> pd.DataFrame:
        """The per-request table (made on each call: a sweep point's writer takes its arrays instead)."""
        return pd.DataFrame(self.request_columns)

    def emissions_columns(self) -> dict[str, np.ndarray]:
        per_step = np.diff(self.emission_ends, prepend=0).astype(np.int64)
        ids, tokens = self.emissions[:, : self.n_emissions].astype(np.int64)
        steps = np.repeat(np.array([row[0] for row in self.steps], dtype=np.int64), per_step)
        times = np.repeat(np.array(self.emission_times, dtype=np.float64), per_step)
        return dict(zip(EMISSION_COLUMNS, (ids, steps, times, tokens), strict=True))

    def emissions_frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.emissions_columns())


def _columns(rows: list[tuple], names: list[str]) -> dict[str, np.ndarray]:
    """Rows of `names` as one array per column: numpy infers each column's type as `DataFrame.from_records` did
    (object where there are no rows), at a fraction of its cost."""
    columns = zip(*rows, strict=True) if rows else [np.array([], dtype=object)] * len(names)
    return dict(zip(names, map(np.array, columns), strict=True))


@njit
def record_step(
    table: np.ndarray,
    time: float,
    step_counts: np.ndarray,
    row: int,
    emissions: np.ndarray,
    n_emissions: int,
    request_times: np.ndarray,
    request_counts: np.ndarray,
) -> int:
    """Count a settled step's batch table into `step_counts[row]` (COUNT_COLUMNS, then accepted drafts per
    position), append its emissions and add them, at `time`, to the per-request tallies; returns the number of
    emissions."""
    counts = step_counts[row]
    k = len(counts) - N_COUNTS
    counts[N_REQS] = table.shape[1]
    for i in range(table.shape[1]):
        rid = table[policy.REQ, i]
        if table[policy.PREFILL, i]:
            counts[N_PREFILL_REQS] += 1
            counts[PREFILL_TOKENS] += table[policy.TOKENS, i]
            counts[PREFILL_CONTEXT] += table[policy.START, i]  # the prompt tokens before each chunk
        else:
            counts[DECODE_TOKENS] += 1 + table[policy.VERIFIED, i]  # a decode computes 1 + its verified slots
            counts[DRAFTS_SCHEDULED] += table[policy.SLOTS, i]
        drafts, accepted, wasted = table[policy.DRAFTS_VALID, i], table[policy.ACCEPTED, i], table[policy.WASTED, i]
        counts[DRAFTS_VALID] += drafts
        counts[ACCEPTED] += accepted
        counts[WASTED_SLOTS] += wasted
        for position in range(min(accepted, k)):
            counts[N_COUNTS + position] += 1
        request_counts[NUM_DRAFTS, rid] += int(drafts > 0)  # vLLM counts a request-step with a draft
        request_counts[DRAFT_TOKENS, rid] += drafts
        request_counts[ACCEPTED_TOKENS, rid] += accepted
        request_counts[REQUEST_WASTED_SLOTS, rid] += wasted
        emitted = table[policy.EMITTED, i]
        if emitted:
            if n_emissions == emissions.shape[1]:  # compiled code does not check bounds
                raise IndexError("more emissions than output tokens")
            counts[EMITTED] += emitted
            emissions[0, n_emissions] = rid
            emissions[1, n_emissions] = emitted
            n_emissions += 1
            if np.isnan(request_times[FIRST_TOKEN_S, rid]) or time < request_times[FIRST_TOKEN_S, rid]:
                request_times[FIRST_TOKEN_S, rid] = time
            if np.isnan(request_times[LAST_TOKEN_S, rid]) or time > request_times[LAST_TOKEN_S, rid]:
                request_times[LAST_TOKEN_S, rid] = time
            request_counts[NUM_CHUNKS, rid] += 1
    return n_emissions


def device_syncs_columns(rows: list[tuple[int, str, str, float]]) -> dict[str, np.ndarray]:
    """The device-syncs table's arrays from (step, phase, site, wait_s) rows; empty at the sim level."""
    columns = list(zip(*rows, strict=True)) if rows else [()] * len(DEVICE_SYNC_DTYPES)
    dtypes = DEVICE_SYNC_DTYPES.items()
    return {c: np.array(v, dtype=t) for (c, t), v in zip(dtypes, columns, strict=True)}

