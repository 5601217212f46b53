"""The engine core: the host's scheduling decisions, one piece of code for every level.

Mirrors vLLM's `EngineCore.step_with_batch_queue` (docs/vllm-notes.md, "Engine loop"): while fewer than D
steps are in flight and something can be scheduled, schedule, run the sync points of each host phase,
prepare and launch; otherwise settle the oldest step in flight. This module holds what that loop decides
and remembers (the batch scheduler, the in-flight queue, the sync points of each phase, what a settled step
changes); the levels (`simulation` in virtual time, `realloop` in wall-clock time) hold only where time
comes from. It never calls the backend: the loop (`loop.EngineLoop`) hands it the valid drafts the backend holds and
frees what settles.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import numpy as np

from simharness.modes import HOST_PHASES, Mode
from simharness.phases import phase
from simharness.policy import EMITTED, K_SLOTS, BatchScheduler, scheduled_k
from simharness.records import ARRIVAL_S, Records, Step
from simharness.scenario import Scenario, ScenarioError, SyncPoint
from simharness.workload import GC_STREAM, Requests


class EngineCore:
    """The host side of one point's engine: who runs in the next step, what is in flight, what settles."""

    def __init__(self, sc: Scenario, requests: Requests, mode: Mode, measured: str):
        """`measured`: the step phases the backend measures (`Backend.measured`; "" when all are modelled)."""
        budget = sc.scheduler.max_num_batched_tokens
        if budget < 1 + mode.k:
            raise ScenarioError(f"scheduler.max_num_batched_tokens: {budget} cannot fit a decode of 1 + k tokens")
        if not sc.scheduler.chunked_prefill and int(requests.prompt_len.max()) > budget:
            raise ScenarioError(
                f"scheduler.max_num_batched_tokens: {budget} is below the longest prompt "
                f"({int(requests.prompt_len.max())}) and chunked_prefill is off"
            )
        self.mode = mode
        self.output_len = requests.output_len
        self.sched = BatchScheduler(sc.scheduler, requests.prompt_len, requests.output_len)
        self.records = Records(mode.k, requests.output_len)
        self.syncs = self.records.syncs  # rows of SYNC_COLUMNS
        # launched, not yet settled, oldest first: the loop fills it while shorter than mode.depth, else settles
        # its oldest (popped before settling, so the update's sync points no longer see it)
        self.in_flight: deque[Step] = deque()
        self.last_launched: Step | None = None
        self.n_steps = 0
        self.gc = sc.engine.gc
        self.gc_rng = np.random.default_rng(np.random.SeedSequence([sc.seed, GC_STREAM]))
        self.phase_syncs = {ph: [sp for sp in mode.syncs if sp.phase == ph] for ph in HOST_PHASES}
        # under a k schedule, a step at k = 0 has no drafts to trim: it skips the valid-draft-count sync
        self.undrafted_syncs = {ph: [sp for sp in pts if sp.name != "valid_draft_counts"]
                                for ph, pts in self.phase_syncs.items()}  # fmt: skip
        # whether every sync point of a phase waits for the oldest step in flight, for either set of points
        self.oldest_only, self.undrafted_oldest_only = (
            {ph: all(sp.waits_for == "oldest_in_flight" for sp in pts) for ph, pts in syncs.items()}
            for syncs in (self.phase_syncs, self.undrafted_syncs))
        # Prep cuts the verified slots of a step with decodes to the valid drafts when async and trimming: a
        # synchronous scheduler already reserved the drafts the host holds, and with nothing in flight the
        # device has not moved since.
        self.trims_async = mode.trim and mode.depth > 1
        # NVTX ranges (and sync attribution) only where something is measured
        self.measured = measured
        self.schedule_range, self.update_range = phase("schedule"), phase("update")

    # ---------------------------------------------------------------- decisions

    def arrive(self, rid: int, t: float) -> None:
        """Request `rid` reached the engine at time `t`: its arrival is recorded and it waits to be scheduled."""
        self.records.request_times[ARRIVAL_S, rid] = t
        self.sched.arrive(rid)

    def gc_pause(self) -> float:
        """A garbage-collection pause drawn for this loop iteration (0 for none), from the seed's own stream."""
        gc = self.gc
        if gc.probability > 0 and self.gc_rng.random() < gc.probability:
            if gc.distribution == "exponential":
                return self.gc_rng.exponential(gc.mean_ms * 1e-3)
            return gc.mean_ms * 1e-3
        return 0.0

    def schedule(self, gc_pause: float, valid_drafts: np.ndarray) -> Step | None:
        """The next step's batch, or None when nothing can be scheduled. Its k: the point's, or what its k schedule
        gives the batch the step can hold. `valid_drafts`: what the backend holds per request now."""
        mode = self.mode
        k = scheduled_k(mode.k_schedule, self.sched.batch_size()) if mode.k_schedule else mode.k
        if not self.measured:  # no range to enter (the sim level's hot path)
            batch = self.sched.schedule(k, self._held(valid_drafts))
        else:
            with self.schedule_range:
                batch = self.sched.schedule(k, self._held(valid_drafts))
        if not batch.size:
            return None
        step = Step(self.n_steps, batch, gc_pause_s=gc_pause)
        if self.measured:
            step.measured = self.measured
        self.n_steps += 1
        return step

    def _held(self, valid_drafts: np.ndarray) -> np.ndarray:
        """What the scheduler reserves per decoding request: the drafts each running request holds when
        synchronous and trimming (the host has them), else k placeholder slots (async, or every slot verified)."""
        if self.mode.k and self.mode.depth == 1 and self.mode.trim:
            return valid_drafts
        return K_SLOTS

    def through(self, target: Step) -> Iterator[Step]:
        """The in-flight steps in launch order, up to and including `target`: what a sync that waits for `target`
        reads back (the clocks differ only in how a read is timed)."""
        for step in self.in_flight:
            yield step
            if step is target:
                return

    def sync_target(self, sp: SyncPoint) -> Step | None:
        """The step whose end sync point `sp` waits for (None: nothing launched yet)."""
        if sp.waits_for == "oldest_in_flight" and self.in_flight:
            return self.in_flight[0]
        return self.last_launched

    def _undrafted(self, step: Step) -> bool:
        """Whether a k schedule gives `step` k = 0 (no drafts, so no valid-draft-count sync)."""
        return bool(self.mode.k_schedule) and not step.batch.k

    def syncs_of(self, step: Step) -> dict[str, list[SyncPoint]]:
        """The sync points of each host phase that `step` runs: the mode's, less the valid-draft-count sync for a
        step that a k schedule gives k = 0."""
        return self.undrafted_syncs if self._undrafted(step) else self.phase_syncs

    def newest_sync_target(self, step: Step, ph: str) -> Step | None:
        """The newest step any of `step`'s sync points of phase `ph` waits for: the GPU runs steps in launch order,
        so the others have ended once it has."""
        oldest_only = self.undrafted_oldest_only if self._undrafted(step) else self.oldest_only
        if self.in_flight and oldest_only[ph]:
            return self.in_flight[0]
        return self.last_launched

    def trim(self, step: Step, valid_drafts: np.ndarray) -> None:
        """Cut the verified slots to the `valid_drafts` the host reads now (after the sync that let it); for a step
        with decodes, when `trims_async`."""
        b = step.batch
        b.n_tokens += b.trim(valid_drafts, b.k)  # a decode computes 1 + its slots
        step.trimmed = True

    def launched(self, step: Step) -> None:
        self.in_flight.append(step)
        step.in_flight = len(self.in_flight)
        self.last_launched = step


    # ---------------------------------------------------------------- settling

    def settle(self, step: Step) -> np.ndarray:
        """Process the oldest step's output (`update_from_output`); returns the ids that finished now."""
        if not self.measured:
            return self.sched.settle(step.batch)
        with self.update_range:
            return self.sched.settle(step.batch)

    def to_propose(self, step: Step) -> np.ndarray:
        """With the CPU proposer: the requests it drafts for after this step, those still running that got
        tokens (a prefill's first token included)."""
        b = step.batch
        got = b.req[b.table[EMITTED] > 0]
        return got[self.sched.committed[got] < self.output_len[got]]

    def record_sync(self, step: Step, sp_name: str, ph: str, waits_for: str, start: float, end: float) -> None:
        step.sync_wait_s += end - start
        step.n_syncs += 1
        self.syncs.append((step.step, sp_name, ph, waits_for, start, end))
