"""The seam between the engine loop and what executes its steps: the `Backend` Protocol and what a step's run gives.

The engine loop (every level) talks to a `Backend` only; it never asks which one it drives. A backend owns the
device-side truth of every request (prompt tokens in the KV cache, committed output tokens) and answers how many
valid drafts the proposer holds for a request now (read by the host only at a sync), what a step does (tokens
emitted, drafts accepted, wasted slots: the outcome rows of the step's batch table) and how long each of its phases
takes (returned, never written into the step). `model_backend.ModelBackend` answers from the acceptance and cost
models (the sim level); `engine.torch_backend.TorchBackend` runs the real decode loop and measures (hil and real).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np

from simharness.ledger import HostLedger
from simharness.records import Step

# When the host enqueued each part of a launch (a prefill chunk, a decode phase), as (start, end) host seconds after
# the launch's start; None: the step was enqueued at once when its launch ended.
Enqueue = Sequence[tuple[float, float]] | None


class StepTiming(NamedTuple):
    """What a step's run on the device gives the level, in seconds. The last five come from a measured backend."""

    device_s: float  # the step's device time
    readback_s: float  # the host time of its readback
    parts_s: Sequence[float] | None = None  # the device time of each enqueued part, in order (with an `Enqueue`)
    window: Sequence | None = None  # the real level: marks of the step's device start and end (`device_seconds`)
    phases_s: Sequence[float] | None = None  # the device time of each of DEVICE_PHASES (None: modelled)
    device_syncs: int = 0  # synchronizing CUDA operations caught in the step
    harness_s: float = math.nan  # the harness's own host time for it
    wake_s: float = 0.0  # how much later than its tightest the host woke when it blocked on the step's end


@runtime_checkable
class Backend(Protocol):
    """What the engine loop asks of whatever executes its steps. Times are seconds, returned by each call."""

    # the step phases this backend measures, as recorded in each step's `measured` column ("" = all modelled)
    measured: str

    def valid_drafts(self) -> np.ndarray:
        """Valid drafts the proposer holds now, per request id, as the host may read them at a sync."""

    def prep(self, step: Step) -> float:
        """Build the step's inputs; returns the host time it took."""

    def launch(self, step: Step) -> tuple[float, Enqueue]:
        """Enqueue the step on the device; returns the host time it took and when each part was enqueued."""

    def run(self, step: Step) -> StepTiming:
        """The step on the device: fill its batch table's outcome rows; returns its timing."""

    def propose(self, rids: np.ndarray) -> float:
        """The CPU n-gram proposer drafts for these requests (after their step was settled); returns its host time."""

    def sync_op(self, step: Step, name: str) -> float | None:
        """For `step`, run the device operation that makes sync point `name` block, where this backend has one
        (it then blocks until the device is done with everything launched); returns the operation's own host
        seconds, or None where the backend has none."""

    def release(self, rids: np.ndarray) -> None:
        """The host saw these requests finish: free what they held."""


@runtime_checkable
class MeasuredBackend(Backend, Protocol):
    """A backend whose phases take real host time, kept in its ledger (the real level charges its modelled host
    work there too)."""

    ledger: HostLedger

    def start_clock(self) -> None:
        """The wall clock starts: read device timestamps on the host's clock from now on. Anchored at the start of
        the run and again at each wait the host blocks on: the GPU's timer and the host's clock drift apart by tens of
        microseconds a second (docs/hil.md, "The real level's device clock")."""

    def device_seconds(self, marks: Sequence) -> tuple[float, ...]:
        """A read-back step's device marks (`StepTiming.window`) in host seconds: what the device clock reads is the
        harness's own work, which the real level does off the critical path."""
