"""The real level: the engine loop in wall-clock time over the real decode loop, with real overlap.

The same engine core as the other levels (`core.EngineCore`) makes every decision; this loop only lets time
pass for real. As vLLM's engine core does, the host prepares and launches step N+1 while the device runs
step N (eager launches return at once, so the device starts on the first kernel), and blocks only where the
policy needs device data: at a sync point (it waits for the step the point waits for, and reads back every
step up to it, in launch order) and at the by-design readback of the oldest step before settling it. Host
work the harness does not reproduce (the scheduler's and output processor's own cost, `engine.host_costs`) is
spun on the host for its modelled time, less the loop's own bookkeeping since the last such work, and modelled GC
pauses whole, as hil adds them in virtual time. Device timestamps come from CUDA events on the host's clock
(`engine.timing.DeviceClock`). Requests arrive in wall-clock time: the engine takes in those that arrived at the
top of each loop iteration, as vLLM's engine core reads its input queue once per step.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from simharness.core import EngineCore
from simharness.costmodel import CostModel
from simharness.engine.torch_backend import TorchBackend
from simharness.modes import OUTPUT_READBACK, Mode
from simharness.records import ARRIVAL_S, LAST_TOKEN_S, Records, Step
from simharness.scenario import Scenario
from simharness.workload import Requests


def spin(seconds: float) -> None:
    """Keep the host thread busy for `seconds` (a sleep would hand the core back and wake late)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class RealLoop:
    """One sweep point in wall-clock time on the real decode loop. `run()` returns the records and the run's
    duration."""

    def __init__(self, sc: Scenario, requests: Requests, mode: Mode, backend: TorchBackend):
        self.sc, self.mode, self.req = sc, mode, requests
        self.n = len(requests.prompt_len)
        self.core = EngineCore(sc, requests, mode, backend)
        self.backend = backend
        self.records: Records = self.core.records
        self.cost = CostModel(sc.engine, optimistic_correction=mode.optimistic)
        self.last_gpu_end: float | None = None
        self.t0 = 0.0
        # since the last modelled work: when it ended and the engine's host time then (`_work`)
        self.own_from, self.engine_from = 0.0, 0.0
        # clients: the next request of the closed loop, or the open loop's next arrival and, with capped
        # concurrency, when each free slot became free (FIFO, as SimPy's Resource grants them)
        self.next_id = 0
        self.free_at: deque[float] = deque([0.0] * sc.workload.concurrency)
        self.arriving: list[tuple[int, float]] = []  # closed loop: sent on a completion, not yet taken in
        self.freeing: list[float] = []  # capped open loop: slots freed by a completion, not yet taken in

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def _work(self, seconds: float) -> None:
        """Modelled engine work on the host: spun, and counted as the engine's time. The loop's own host work since
        the last modelled work (reading outcomes back, settling requests, records) is charged against it, not
        added to it: a real engine's scheduler and output processor, which the model costs, do that work, and
        hil leaves the harness's time out. It is still measured (`Step.harness_s`); docs/hil.md,
        "The real loop's own host time"."""
        if seconds <= 0.0:
            return
        now = time.perf_counter()
        own = (now - self.own_from) - (self.backend.engine_s - self.engine_from)
        spun = max(seconds - max(own, 0.0), 0.0)
        spin(spun)
        self.backend.engine_time(spun)
        self._mark_own()

    def _pause(self, seconds: float) -> None:
        """A modelled stall of the host (a GC pause): spun whole, and the engine's time; it absorbs nothing."""
        spin(seconds)
        self.backend.engine_time(seconds)

    def _mark_own(self) -> None:
        """Start counting the loop's own host time anew (after modelled work, or a wait for arrivals)."""
        self.own_from, self.engine_from = time.perf_counter(), self.backend.engine_s

    # ---------------------------------------------------------------- clients

    def _arrive(self, rid: int, t: float) -> None:
        self.records.request_times[ARRIVAL_S, rid] = t
        self.core.sched.arrive(rid)

    def _admit(self) -> None:
        """Take in the open loop's requests whose arrival time has come (and, when capped, a free slot)."""
        if self.sc.workload.arrival == "closed":
            return
        capped, arrival_s, now = self.sc.workload.cap_concurrency, self.req.arrival_s, self.now()
        while self.next_id < self.n and arrival_s[self.next_id] <= now and (self.free_at or not capped):
            # vLLM excludes the time a request waits for --max-concurrency from the request
            t = max(arrival_s[self.next_id], self.free_at.popleft()) if capped else arrival_s[self.next_id]
            self._arrive(self.next_id, t)
            self.next_id += 1

    def _finished(self, rids: np.ndarray, t: float) -> None:
        """Requests completed at time `t`: a closed-loop user sends its next one, a capped slot frees."""
        for _ in range(len(rids)):
            if self.sc.workload.arrival == "closed":
                if self.next_id < self.n:
                    self.arriving.append((self.next_id, t))
                    self.next_id += 1
            else:
                self.freeing.append(t)

    def _take_in(self) -> None:
        """Requests sent on a completion (a closed-loop user's next, or a capped open loop's next through the freed
        slot) reach the engine after its next scheduling decision, as in virtual time (where the client runs once
        the engine next waits): a completion's response and the next request take their time to travel in a real
        serving stack too."""
        for rid, t in self.arriving:
            self._arrive(rid, t)
        self.arriving.clear()
        self.free_at.extend(self.freeing)
        self.freeing.clear()

    def _idle(self) -> None:
        """Nothing to run: wait for the open loop's next arrival."""
        self._take_in()
        if self.next_id < self.n and not self.core.sched.has_waiting():
            wait = self.req.arrival_s[self.next_id] - self.now()
            if wait > 2e-3:
                time.sleep(wait - 1e-3)  # then spin the rest, for the arrival's exact time
            spin(max(self.req.arrival_s[self.next_id] - self.now(), 0.0))
        self._mark_own()  # waiting for an arrival is not the loop's work

    # ---------------------------------------------------------------- engine loop

    def run(self) -> tuple[Records, float]:
        core, cost = self.core, self.cost
        sched, in_flight, depth = core.sched, core.in_flight, self.mode.depth
        gc = core.gc.probability > 0
        self.t0 = time.perf_counter()
        self.backend.start_clock(self.t0)
        self._mark_own()
        if self.sc.workload.arrival == "closed":  # every user sends its first request at once
            for _ in range(min(self.sc.workload.concurrency, self.n)):
                self._arrive(self.next_id, 0.0)
                self.next_id += 1
        while sched.n_finished < self.n:
            self._admit()
            launched = False
            if len(in_flight) < depth:  # fill the batch queue before consuming any output
                gc_pause = core.gc_pause() if gc else 0.0
                self._pause(gc_pause)
                step = core.schedule(gc_pause)
                self._take_in()
                if step is not None:
                    self._schedule_prep_launch(step)
                    launched = True
                elif in_flight:
                    self._work(cost.schedule(0))  # nothing to schedule: the scheduler call still costs its base time
            if launched and len(in_flight) < depth:
                continue
            if in_flight:
                self._settle(in_flight.popleft())
            elif sched.n_finished < self.n:
                self._idle()
        r = self.req
        kind = np.asarray(r.kind_names)[r.kind] if hasattr(r, "kind_names") else np.asarray(r.kind)
        self.records.requests = self.records.requests_frame(kind, r.prompt_len, r.output_len)
        return self.records, float(np.nanmax(self.records.request_times[LAST_TOKEN_S]))

    def _schedule_prep_launch(self, step: Step) -> None:
        core, b, syncs = self.core, step.batch, self.core.phase_syncs
        if syncs["schedule"]:
            self._syncs(step, "schedule")
        step.schedule_start = self.now()
        self._work(self.cost.schedule(b.size))
        step.schedule_end = self.now()
        if syncs["prep"]:
            self._syncs(step, "prep")  # before prep's own work: trimming relies on them
        step.prep_start = self.now()
        if core.trims_async and b.n_prefill < b.size:
            core.trim(step)
        self.backend.prep(step)
        step.prep_end = self.now()
        if syncs["launch"]:
            self._syncs(step, "launch")
        step.launch_start = self.now()
        self.backend.launch(step)
        step.launch_end = self.now()
        core.launched(step)

    def _syncs(self, step: Step, ph: str) -> None:
        """Block on each sync point of phase `ph` in turn: wait for the step it waits for and read back every
        launched step up to it (the data a sync exists to get), recording the wait."""
        core = self.core
        for sp in core.phase_syncs[ph]:
            start = self.now()
            target = core.sync_target(sp)
            # the device operation that blocks, where the backend has one; otherwise a wait and a readback
            if self.backend.sync_op(step, sp.name) is None and target is not None:
                self._read_through(target)
            core.record_sync(step, sp.name, sp.phase, sp.waits_for, start, self.now())

    def _read_through(self, target: Step) -> None:
        """Wait for `target` and read back, in launch order, every launched step up to it not yet read."""
        for step in self.core.in_flight:
            if step.done is None:
                self._read(step)
            if step is target:
                return

    def _read(self, step: Step) -> None:
        """Wait for one step, read it back (its outcome and device timestamps), mark it read (`done`)."""
        self.backend.run(step)
        step.bubble_s = 0.0 if self.last_gpu_end is None else max(step.gpu_start - self.last_gpu_end, 0.0)
        self.last_gpu_end = step.gpu_end
        step.done = True

    def _settle(self, step: Step) -> None:
        """Read back the oldest step (unless a sync already did), update requests and emit tokens."""
        core = self.core
        start = self.now()
        if step.done is None:
            self._read(step)
        core.record_sync(step, OUTPUT_READBACK, "update", "oldest_in_flight", start, self.now())
        if core.phase_syncs["update"]:
            self._syncs(step, "update")
        step.update_start = self.now()
        self._work(self.cost.update(step.batch.size))
        done = core.settle(step)
        step.update_end = now = self.now()
        step.propose_start = step.propose_end = now
        if self.mode.ngram_cpu and self.mode.k:
            self.backend.propose(core.to_propose(step))
            step.propose_end = self.now()
        self.records.add_step(step, now)  # its tokens reached the clients at `now`
        self._finished(done, self.now())
