"""The wall clock (the real level): the engine loop (`loop.EngineLoop`) over the real decode loop, with real overlap.

As vLLM's engine core does, the host prepares and launches step N+1 while the device runs step N (eager launches
return at once, so the device starts on the first kernel), and blocks only where the policy needs device data: at a
sync point (it waits for the step the point waits for, and reads back every step up to it, in launch order) and at
the by-design readback of the oldest step before settling it. Host work the harness does not reproduce (the
scheduler's and output processor's own cost, `engine.host_costs`) is spun on the host for its modelled time, less
the loop's own bookkeeping since the last such work (`ledger.HostLedger`), and modelled GC pauses whole, as hil adds
them in virtual time. Device timestamps come from CUDA events on the host's clock (`engine.timing.DeviceClock`).
Requests arrive in wall-clock time: the engine takes in those that arrived at the top of each loop iteration, as
vLLM's engine core reads its input queue once per step.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from simharness.backend import MeasuredBackend, StepTiming
from simharness.loop import EngineLoop, record_measured
from simharness.modes import Mode
from simharness.records import Records, Step
from simharness.scenario import Scenario
from simharness.workload import Requests


def spin(seconds: float) -> None:
    """Keep the host thread busy for `seconds` (a sleep would hand the core back and wake late)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class RealLoop:
    """One sweep point in wall-clock time on a measured backend: the engine loop's clock. `run()` returns the
    records and the run's duration."""

    def __init__(self, sc: Scenario, requests: Requests, mode: Mode, backend: MeasuredBackend):
        self.sc, self.mode, self.req = sc, mode, requests
        self.n = len(requests.prompt_len)
        self.loop = EngineLoop(sc, requests, mode, backend, self)
        self.core = self.loop.core
        self.backend = backend
        self.ledger = backend.ledger
        self.last_gpu_end: float | None = None
        self.t0 = 0.0
        # what the harness records off the critical path (`flush`): steps read back (with what their run measured)
        # and steps settled, each in order
        self.measured: list[tuple[Step, StepTiming]] = []
        self.settled: list[Step] = []
        # clients: the next request of the closed loop, or the open loop's next arrival and, with capped
        # concurrency, when each free slot became free (FIFO, as SimPy's Resource grants them)
        self.next_id = 0
        self.free_at: deque[float] = deque([0.0] * sc.workload.concurrency)
        self.arriving: list[tuple[int, float]] = []  # closed loop: sent on a completion, not yet taken in
        self.freeing: list[float] = []  # capped open loop: slots freed by a completion, not yet taken in

    # ---------------------------------------------------------------- the engine loop's clock

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def host(self, t: float) -> float:
        return self.now()

    def ran(self, t: float, seconds: float) -> float:
        return self.now()

    def work(self, t: float, seconds: float) -> float:
        """Modelled engine work on the host: spun, and counted as the engine's time. The loop's own host work since
        the last modelled work (reading outcomes back, settling requests, records), and what an earlier work could
        not absorb, is charged against it, not added to it: a real engine's scheduler and output processor, which
        the model costs, do that work, and hil leaves the harness's time out. It is still measured
        (`Step.harness_s`); docs/hil.md, "The real loop's own host time"."""
        if seconds > 0.0:
            spun = seconds - self.ledger.charge(seconds)
            spin(spun)
            self.ledger.engine(spun)
        return self.now()

    def reach(self, t: float) -> None:
        pass  # the clock is there: the host's time is the wall clock's

    def pause(self, seconds: float) -> None:
        """A modelled stall of the host (a GC pause): spun whole, and the engine's time; it absorbs nothing."""
        spin(seconds)
        self.ledger.engine(seconds)

    def wait(self, step: Step | None) -> None:
        pass  # the host blocks where it reads (`synced`, `read`)

    def truth_at(self, t: float) -> None:
        pass

    def synced(self, t: float, target: Step | None, op_s: float | None) -> float:
        """The backend's operation, where it has one, was the wait; otherwise wait for the step the point waits for
        and read back every launched step up to it (the data a sync exists to get)."""
        if op_s is None and target is not None:
            for step in self.core.through(target):
                if step.done is None:
                    self._read(step)
        return self.now()

    def read(self, step: Step, t: float) -> float:
        if step.done is None:  # unless a sync read it already
            self._read(step)
        return self.now()

    def _read(self, step: Step) -> None:
        """Wait for one step, read it back (its outcome and device timestamps), mark it read (`done`); what it measured
        goes onto the step off the critical path (`flush`)."""
        self.measured.append((step, self.backend.run(step)))
        step.done = True

    def record(self, step: Step) -> None:
        self.settled.append(step)  # recorded off the critical path (`flush`)

    def launched(self, step: Step, t: float) -> None:
        """The backend's launch enqueued `step` on the device: while it runs, the harness records what it kept."""
        self.flush()

    def flush(self) -> None:
        """The harness's records, kept from the critical path (from reading a step back to the next launch) as vLLM's
        output processing runs beside its engine core: what each read-back step measured, in read order, then
        each settled step, in settle order. A decode-only step's window marks are the decode loop's ring events,
        recorded again `depth + 1` launches later; every step read before a launch is flushed right after it."""
        for step, timing in self.measured:
            record_measured(step, timing)
            start, end = self.backend.device_seconds(timing.window)
            step.gpu_start, step.gpu_end = start - self.t0, end - self.t0
            step.bubble_s = 0.0 if self.last_gpu_end is None else max(step.gpu_start - self.last_gpu_end, 0.0)
            self.last_gpu_end = step.gpu_end
        self.measured.clear()
        for step in self.settled:
            self.core.records.add_step(step, step.update_end)  # its tokens reached the clients at update_end
        self.settled.clear()

    # ---------------------------------------------------------------- clients

    def admit(self) -> None:
        """Take in the open loop's requests whose arrival time has come (and, when capped, a free slot)."""
        if self.sc.workload.arrival == "closed":
            return
        capped, arrival_s, now = self.sc.workload.cap_concurrency, self.req.arrival_s, self.now()
        while self.next_id < self.n and arrival_s[self.next_id] <= now and (self.free_at or not capped):
            # vLLM excludes the time a request waits for --max-concurrency from the request
            t = max(arrival_s[self.next_id], self.free_at.popleft()) if capped else arrival_s[self.next_id]
            self.core.arrive(self.next_id, t)
            self.next_id += 1

    def finished(self, rids: np.ndarray) -> None:
        """Requests completed now: a closed-loop user sends its next one, a capped slot frees."""
        t = self.now()
        for _ in range(len(rids)):
            if self.sc.workload.arrival == "closed":
                if self.next_id < self.n:
                    self.arriving.append((self.next_id, t))
                    self.next_id += 1
            else:
                self.freeing.append(t)

    def scheduled(self) -> None:
        """Requests sent on a completion (a closed-loop user's next, or a capped open loop's next through the freed
        slot) reach the engine after its next scheduling decision, as in virtual time (where the client runs once
        the engine next waits): a completion's response and the next request take their time to travel in a real
        serving stack too."""
        for rid, t in self.arriving:
            self.core.arrive(rid, t)
        self.arriving.clear()
        self.free_at.extend(self.freeing)
        self.freeing.clear()

    def idle(self) -> None:
        """Nothing to run: wait for the open loop's next arrival."""
        self.flush()
        self.scheduled()
        if self.next_id < self.n and not self.core.sched.has_waiting():
            wait = self.req.arrival_s[self.next_id] - self.now()
            if wait > 2e-3:
                time.sleep(wait - 1e-3)  # then spin the rest, for the arrival's exact time
            spin(max(self.req.arrival_s[self.next_id] - self.now(), 0.0))
        self.ledger.drop()  # waiting for an arrival is not the loop's work

    # ---------------------------------------------------------------- run

    def run(self) -> tuple[Records, float]:
        self.t0 = time.perf_counter()
        self.backend.start_clock()
        self.ledger.drop()
        if self.sc.workload.arrival == "closed":  # every user sends its first request at once
            for _ in range(min(self.sc.workload.concurrency, self.n)):
                self.core.arrive(self.next_id, 0.0)
                self.next_id += 1
        for _ in self.loop.run():  # the wall clock hands the loop nothing to wait on
            pass
        self.flush()
        return self.loop.result()
