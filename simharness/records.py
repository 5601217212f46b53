"""What a simulated (or hardware-in-the-loop) run records: steps, syncs, emissions, requests.

The SimPy model appends plain rows while it runs (cheap: no pandas in the hot path); `Records`
turns them into pandas DataFrames with fixed columns, which metrics, report and trace consume.
All times are seconds of virtual time since the start of the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

# One row per engine step. Host phases are [start, end) intervals on the engine thread; a phase
# that did not happen has start == end. `bubble_s` is GPU idle time between the previous step's
# end and this step's start. `acc_pos_<i>` columns (i < k) count drafts accepted at position i.
STEP_COLUMNS = [
    "step",
    "n_reqs",
    "n_prefill_reqs",
    "prefill_tokens",
    "decode_tokens",
    "drafts_scheduled",
    "drafts_valid",
    "accepted",
    "emitted",
    "wasted_slots",
    "in_flight",
    "schedule_start",
    "schedule_end",
    "prep_start",
    "prep_end",
    "launch_end",
    "gpu_start",
    "gpu_end",
    "update_start",
    "update_end",
    "propose_start",
    "propose_end",
    "gc_pause_s",
    "sync_wait_s",
    "n_syncs",
    "bubble_s",
    # hardware in the loop: the phases measured in this step ("" at the sim level), the measured device
    # time of each device phase (they add up to gpu_end - gpu_start; NaN at the sim level), synchronizing
    # CUDA operations caught in the step, and the harness's own host time for it (NaN at the sim level)
    "measured",
    "gpu_prefill_s",
    "gpu_verify_s",
    "gpu_sample_s",
    "gpu_commit_s",
    "gpu_propose_s",
    "device_syncs",
    "harness_s",
]

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


@dataclass
class Records:
    """Row buffers filled by the SimPy model; `frames()` returns the DataFrames."""

    k: int
    steps: list[tuple] = field(default_factory=list)
    # accepted drafts per decoding request of each step; `acc_pos_<i>` is computed from them at the end
    accepted: list[np.ndarray] = field(default_factory=list)
    syncs: list[tuple] = field(default_factory=list)
    # emissions are kept per step as (step, time, request ids, token counts) to stay vectorised
    emission_batches: list[tuple[int, float, np.ndarray, np.ndarray]] = field(default_factory=list)
    requests: pd.DataFrame | None = None
    _emission_columns: tuple[int, tuple[np.ndarray, ...]] | None = field(default=None, repr=False)

    def add_step(self, row: tuple, accepted: np.ndarray) -> None:
        self.steps.append(row)
        self.accepted.append(accepted)

    def add_sync(self, step: int, name: str, phase: str, waits_for: str, start: float, end: float) -> None:
        self.syncs.append((step, name, phase, waits_for, start, end))

    def add_emissions(self, step: int, time: float, request_ids: np.ndarray, tokens: np.ndarray) -> None:
        if len(request_ids):
            self.emission_batches.append((step, time, request_ids, tokens))

    def steps_frame(self) -> pd.DataFrame:
        df = pd.DataFrame.from_records(self.steps, columns=STEP_COLUMNS)
        n = len(self.steps)
        acc = np.concatenate(self.accepted) if n else np.zeros(0, dtype=np.int64)
        step = np.repeat(np.arange(n), [len(a) for a in self.accepted])
        for i in range(self.k):
            df[f"acc_pos_{i}"] = np.bincount(step[acc > i], minlength=n).astype(np.int64)
        return df

    def syncs_frame(self) -> pd.DataFrame:
        return pd.DataFrame.from_records(self.syncs, columns=SYNC_COLUMNS)

    def emission_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The emissions as columns: request ids, steps, times, token counts (one entry per emission)."""
        batches = self.emission_batches
        if self._emission_columns is None or self._emission_columns[0] != len(batches):
            steps, times, ids, tokens = zip(*batches, strict=True)
            sizes = [len(x) for x in ids]
            columns = (
                np.concatenate(ids).astype(np.int64, copy=False),
                np.repeat(np.array(steps, dtype=np.int64), sizes),
                np.repeat(np.array(times, dtype=np.float64), sizes),
                np.concatenate(tokens).astype(np.int64, copy=False),
            )
            self._emission_columns = (len(batches), columns)  # the simulation and the frame both need them
        return self._emission_columns[1]

    def emissions_frame(self) -> pd.DataFrame:
        if not self.emission_batches:
            return pd.DataFrame({c: pd.Series(dtype="float64" if c == "time_s" else "int64")
                                 for c in EMISSION_COLUMNS})
        return pd.DataFrame(dict(zip(EMISSION_COLUMNS, self.emission_arrays(), strict=True)))


def device_syncs_frame(rows: list[tuple[int, str, str, float]]) -> pd.DataFrame:
    """The device-syncs table from (step, phase, site, wait_s) rows; empty at the sim level."""
    columns = list(zip(*rows, strict=True)) if rows else [()] * len(DEVICE_SYNC_DTYPES)
    dtypes = DEVICE_SYNC_DTYPES.items()
    return pd.DataFrame({c: pd.Series(v, dtype=t) for (c, t), v in zip(dtypes, columns, strict=True)})
