"""The engine loop: the host's phase sequence, written once for every level; the levels are its clocks.

vLLM's `EngineCore.step_with_batch_queue` (docs/vllm-notes.md, "Engine loop") with queue depth D (D = 1 is `step`):
while fewer than D steps are in flight and something can be scheduled, schedule, run each phase's sync points,
prepare (trimming the verified slots) and launch; otherwise settle the oldest step in flight: wait for its output
(the by-design readback), update the requests (tokens reach the clients now), draft on the host with the CPU n-gram
proposer and record the step. `core.EngineCore` makes every decision; this loop only orders them, and it alone calls
the backend.

`EngineLoop.run` is one generator that asks a `Clock` for time and yields what the clock hands it: SimPy events in
virtual time (`simulation.Simulation`, the sim and hil levels), nothing on the wall clock (`realloop.RealLoop`, the
real level). The host's time `t` is threaded through the phases: a virtual clock lets it run ahead of the clock and
yields only where the host must observe something; on the wall clock every call that takes time returns the time it
ended, and `Clock.host` reads it anew after the loop's own work where that takes time (settling requests).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from simharness.backend import Backend, StepTiming
from simharness.core import EngineCore
from simharness.costmodel import CostModel
from simharness.modes import OUTPUT_READBACK, Mode
from simharness.records import LAST_TOKEN_S, Records, Step
from simharness.scenario import Scenario, SyncPoint
from simharness.workload import Requests


class Clock(Protocol):
    """Where a level's time comes from. A method named for a wait returns what the loop yields for it (None: no
    wait); `t` is the host's time as the loop accounts it."""

    def now(self) -> float:
        """The clock's time (the host's at the top of each loop iteration)."""

    def host(self, t: float) -> float:
        """The host's time, `t` as the loop accounts it (read anew after the loop's own work)."""

    def ran(self, t: float, seconds: float) -> float:
        """The host's time after `seconds` of work that began at `t` and has run (a backend's phase)."""

    def work(self, t: float, seconds: float) -> float:
        """Modelled engine work of `seconds` from `t` (what the harness does not reproduce); returns its end."""

    def reach(self, t: float) -> Any:
        """Let the clock reach host time `t`."""

    def pause(self, seconds: float) -> Any:
        """A stall of the host thread (a GC pause)."""

    def wait(self, step: Step | None) -> Any:
        """Wait for `step` to end on the device (None: nothing to wait for)."""

    def truth_at(self, t: float) -> Any:
        """Wait until the device truth the host reads at `t` (to trim) can no longer change before `t`."""

    def synced(self, t: float, target: Step | None, op_s: float | None) -> float:
        """Block from `t` on a sync point that waits for `target` (None: nothing launched yet); `op_s` is the host
        seconds of the backend's own operation for it (None: it has none). Returns when the sync ends."""

    def read(self, step: Step, t: float) -> float:
        """Read back the oldest step's output (its device work ended); returns when the readback ends."""

    def launched(self, step: Step, t: float) -> None:
        """`step` was enqueued on the device by host time `t`."""

    def admit(self) -> None:
        """Take in the requests that arrived by now (top of each loop iteration)."""

    def scheduled(self) -> None:
        """The scheduler decided: requests sent on a completion may reach the engine now."""

    def idle(self) -> Any:
        """Nothing is in flight or can be scheduled: wait for a request."""

    def finished(self, rids: Sequence[int]) -> None:
        """Requests `rids` completed now."""

    def record(self, step: Step) -> None:
        """Record the settled `step` (`Records.add_step`; its tokens reached the clients at its update_end)."""


def record_measured(step: Step, timing: StepTiming) -> None:
    """What a measured backend's run of `step` measured, onto the step (a modelled step has none of it)."""
    step.set_device_phases(timing.phases_s)
    step.device_syncs = timing.device_syncs
    step.harness_s = timing.harness_s


class EngineLoop:
    """The phase sequence of one point's engine over a clock: its core and the cost of the host work it models."""

    def __init__(self, sc: Scenario, requests: Requests, mode: Mode, backend: Backend, clock: Clock):
        self.core = EngineCore(sc, requests, mode, backend.measured)
        self.cost = CostModel(sc.engine, optimistic_correction=mode.optimistic)
        self.clock, self.mode, self.backend = clock, mode, backend
        self.requests, self.n = requests, len(requests.prompt_len)

    def result(self) -> tuple[Records, float]:
        """Once run: the records, with their requests' arrays, and the run's duration (until the last token)."""
        r, records = self.requests, self.core.records
        kind = np.asarray(r.kind_names)[r.kind] if hasattr(r, "kind_names") else np.asarray(r.kind)
        records.set_requests(kind, r.prompt_len, r.output_len)
        return records, float(np.nanmax(records.request_times[LAST_TOKEN_S]))

    def run(self):
        """Until every request finished: fill the batch queue before consuming any output, else settle the oldest
        step, else wait for work."""
        core, clock, n = self.core, self.clock, self.n
        sched, in_flight, depth = core.sched, core.in_flight, self.mode.depth
        gc = core.gc.probability > 0
        admit, scheduled, now, valid_drafts = clock.admit, clock.scheduled, clock.now, self.backend.valid_drafts
        while sched.n_finished < n:
            admit()
            launched = False
            if len(in_flight) < depth:
                gc_pause = core.gc_pause() if gc else 0.0
                if gc_pause:
                    yield clock.pause(gc_pause)
                step = core.schedule(gc_pause, valid_drafts())
                scheduled()
                if step is not None:
                    host = yield from self.schedule_prep_launch(step, now())
                    launched = True
                elif in_flight:
                    # nothing to schedule: the scheduler call still costs the host its base time
                    yield clock.reach(clock.work(now(), self.cost.schedule(0)))
            if launched and len(in_flight) < depth:
                yield clock.reach(host)  # schedule the next step once this launch is done
                continue
            if in_flight:
                yield from self.settle(in_flight.popleft(), host if launched else now())
            elif sched.n_finished < n:
                idle = clock.idle()
                if idle is not None:
                    yield idle

    def schedule_prep_launch(self, step: Step, t: float):
        """The host phases from scheduling to launch, from host time `t`; returns the time the launch ends."""
        core, clock, backend, b = self.core, self.clock, self.backend, step.batch
        syncs = core.syncs_of(step)
        if syncs["schedule"]:
            t = yield from self.syncs(step, "schedule", syncs["schedule"], t)
        step.schedule_start = t
        step.schedule_end = t = clock.work(t, self.cost.schedule(b.size))
        # syncs placed in prep run before prep's own work: trimming below relies on them
        if syncs["prep"]:
            t = yield from self.syncs(step, "prep", syncs["prep"], t)
        step.prep_start = t
        if core.trims_async and b.n_prefill < b.size:
            truth = clock.truth_at(t)
            if truth is not None:
                yield truth
            core.trim(step, backend.valid_drafts())
        step.prep_end = t = clock.ran(t, backend.prep(step))
        if syncs["launch"]:
            t = yield from self.syncs(step, "launch", syncs["launch"], t)
        step.launch_start = t
        seconds, step.enqueue = backend.launch(step)
        step.launch_end = t = clock.ran(t, seconds)
        core.launched(step)
        clock.launched(step, t)
        return t

    def syncs(self, step: Step, ph: str, points: list[SyncPoint], t: float):
        """Block the host, from time `t` on, on each of the step's sync points `points` of phase `ph` in turn; record
        the waits and return the time the last one ends. The GPU runs steps in launch order, so a virtual clock waits
        at most once, for the newest step the points wait for (`EngineCore.newest_sync_target`)."""
        core, clock = self.core, self.clock
        newest = clock.wait(core.newest_sync_target(step, ph))
        if newest is not None:
            yield newest
        for sp in points:
            start = t
            # the backend's real operation behind the point, if any (at hil timed alone: its wait stays modelled)
            op_s = self.backend.sync_op(step, sp.name)
            t = clock.synced(t, core.sync_target(sp), op_s)
            core.record_sync(step, sp.name, sp.phase, sp.waits_for, start, t)
        return t

    def settle(self, step: Step, t: float):
        """From host time `t`, wait for the oldest step's output, then update requests, emit tokens and draft."""
        core, clock = self.core, self.clock
        start = t
        done = clock.wait(step)
        if done is not None:
            yield done
        # the readback and the update are one event (a sync point between them is computed ahead, `syncs`)
        t = clock.read(step, t)
        core.record_sync(step, OUTPUT_READBACK, "update", "oldest_in_flight", start, t)
        points = core.syncs_of(step)["update"]
        if points:
            t = yield from self.syncs(step, "update", points, t)
        step.update_start = t
        t = clock.work(t, self.cost.update(step.batch.size))
        yield clock.reach(t)
        finished = core.settle(step)
        self.backend.release(finished)
        step.update_end = step.propose_start = step.propose_end = t = clock.host(t)
        if self.mode.ngram_cpu and self.mode.k:
            t = clock.ran(t, self.backend.propose(core.to_propose(step)))
            yield clock.reach(t)
            step.propose_end = t
        clock.record(step)
        clock.finished(finished)
