"""The virtual clock: the engine loop (`loop.EngineLoop`), its clients and the GPU stream as SimPy processes.

The sim level runs it over the modelled backend, the hil level over the real decode loop (each step's measured
device time then advances virtual time). The GPU stream runs launched steps FIFO. Two views of every request are
kept, as in vLLM: the host's (`policy.BatchScheduler`, optimistic under async) and the device's truth (the
backend's: committed tokens, prefill progress), which advances when a step starts on the GPU. A request that
finished in step N but already sits in step N+1 costs wasted verify slots.

Speed: the loop computes its host phases ahead of the clock and yields only where it must observe something (a
GPU step's end, the time tokens reach clients); this clock also starts a step on the GPU itself when nothing can
read the device truth before the step's start (`launched`), and a started step's end is scheduled, not waited for.
That leaves about three SimPy events per step, and each of these shortcuts gives the same records, to the bit, as
one event per phase would.
"""

from __future__ import annotations

import math
import operator
from collections import deque

import numpy as np
import simpy

from simharness.backend import Backend
from simharness.loop import EngineLoop, record_measured
from simharness.modes import Mode
from simharness.records import Records, Step
from simharness.scenario import Scenario
from simharness.workload import Requests


def _delay(now: float, t: float) -> float:
    """The delay from `now` that lands exactly on time `t`. Several consecutive host phases are one SimPy event,
    and `now + (t - now)` may differ from `t` in the last bit, so the delay is nudged until it lands on `t`, the
    time the phases' own timeouts would have reached."""
    delay = t - now
    while now + delay < t:
        delay = math.nextafter(delay, math.inf)
    while now + delay > t:
        delay = math.nextafter(delay, -math.inf)
    return delay


class Wake(simpy.Event):
    """An event that fires at a time set after its creation: the idle GPU waits on one until the engine sets it
    for a step's start, and a started step ends with its `done` set for the step's end."""

    def at(self, t: float) -> None:
        """Fire at time `t` (not before now)."""
        self._ok, self._value = True, None  # what `succeed` sets; scheduled with a delay, as simpy's Timeout is
        self.env.schedule(self, delay=_delay(self.env.now, t))


class Simulation:
    """One sweep point in virtual time (the sim and hil levels): the engine loop's clock. `run()` returns the
    records and the run's duration."""

    def __init__(self, sc: Scenario, requests: Requests, mode: Mode, backend: Backend):
        self.sc = sc
        self.mode = mode
        self.req = requests
        self.n = len(requests.prompt_len)
        self.loop = EngineLoop(sc, requests, mode, backend, self)
        self.core = self.loop.core
        self.backend = backend
        self.env = simpy.Environment()
        self.stream: deque[Step] = deque()  # launched steps the GPU has not started
        self.gpu_idle: Wake | None = None  # set while the GPU waits for a launch
        self.arrived = self.env.event()  # fires when a request arrives while the engine is idle
        self.done_events: dict[int, simpy.Event] = {}
        self.gpu_free_at: float | None = None  # the end of the latest step started on the GPU

    # ---------------------------------------------------------------- clients

    def _arrive(self, rid: int) -> simpy.Event:
        self.core.arrive(rid, self.env.now)
        ev = self.done_events[rid] = self.env.event()
        if not self.arrived.triggered:
            self.arrived.succeed()
        return ev

    def closed_client(self, next_id: list[int]):
        """A user that sends its next request as soon as the previous one completes."""
        while next_id[0] < self.n:
            rid = next_id[0]
            next_id[0] += 1
            yield self._arrive(rid)

    def open_clients(self):
        """Arrivals at the workload's precomputed times, optionally capped at `concurrency`."""
        cap = simpy.Resource(self.env, self.sc.workload.concurrency) if self.sc.workload.cap_concurrency else None
        for rid, t in enumerate(self.req.arrival_s):
            if t > self.env.now:
                yield self.env.timeout(t - self.env.now)
            if cap is None:
                self._arrive(rid)
            else:
                slot = cap.request()
                yield slot  # vLLM excludes time waiting on --max-concurrency from the request
                self.env.process(self._capped(rid, cap, slot))

    def _capped(self, rid: int, cap: simpy.Resource, slot):
        yield self._arrive(rid)
        cap.release(slot)

    # ---------------------------------------------------------------- GPU stream

    def gpu_stream(self):
        """Runs queued steps in order; a step's outcome is decided by the device truth when it starts.

        The engine queues a step when it computes its launch, ahead of the clock (`EngineLoop.schedule_prep_launch`):
        the step starts no earlier than its `launch_end` nor before the GPU is free. Most steps never reach this
        process: the engine starts them itself when that is safe (`launched`)."""
        env, stream = self.env, self.stream
        while True:
            if not stream:
                self.gpu_idle = Wake(env)
                yield self.gpu_idle
            step = stream[0]
            start = self._earliest_start(_ready(step))
            if start > env.now:
                yield self.reach(start)
            stream.popleft()
            self._start(step, env.now)

    def _earliest_start(self, t: float) -> float:
        """When a step launched at time `t` can start: then, or once the GPU is free."""
        return t if self.gpu_free_at is None else max(t, self.gpu_free_at)

    def _start(self, step: Step, start: float) -> None:
        """Start `step` on the GPU at time `start`: the device truth moves on now. Its end is then known, so its
        `done` is set to fire then (one SimPy event per step; the GPU waits for the next launch meanwhile)."""
        timing = self.backend.run(step)
        step.readback_s, step.wake_s = timing.readback_s, timing.wake_s
        if timing.phases_s is not None:
            record_measured(step, timing)
        step.gpu_start = start
        step.bubble_s = 0.0 if self.gpu_free_at is None else start - self.gpu_free_at
        if step.enqueue is None:
            end = start + timing.device_s
        else:
            step.parts_s = timing.parts_s
            end = _overlapped_end(step, start)
        step.gpu_end = self.gpu_free_at = end
        step.done.at(end)

    # ---------------------------------------------------------------- the engine loop's clock

    def now(self) -> float:
        return self.env.now

    def host(self, t: float) -> float:
        return t

    # the host's time is the loop's own account: work, modelled or measured, adds its seconds to it (a builtin: the
    # hot path's cheapest call)
    ran = work = staticmethod(operator.add)

    def reach(self, t: float) -> simpy.Timeout:
        """A timeout that ends exactly at time `t`, the sum of several host phases."""
        return self.env.timeout(_delay(self.env.now, t))

    def pause(self, seconds: float) -> simpy.Timeout:
        return self.env.timeout(seconds)

    def wait(self, step: Step | None) -> simpy.Event | None:
        """The step's end, unless it is past (launched steps only: their end is known or will be)."""
        return step.done if step is not None and step.gpu_end > self.env.now else None

    def truth_at(self, t: float) -> simpy.Timeout | None:
        """A launched step the GPU has not started may start before `t`: the host really waits until then (with
        none, the truth cannot change until the next launch)."""
        return self.reach(t) if self.stream and t > self.env.now else None

    def synced(self, t: float, target: Step | None, op_s: float | None) -> float:
        """The host's time runs ahead of the clock: the sync starts at `t` or when its step ended on the GPU, whichever
        is later (the loop waited for the newest step it may wait for). A sync that waits for data reads back every
        launched step up to it not read yet, in launch order, as the real loop does (`realloop.RealLoop.synced`; the
        grid shows no cost of its own beyond them, docs/calibration.md): each step's readback (modelled, or hil's
        measured one and, where the host blocked on it, its wake-up), once, and not again at its settle. One with a
        device operation (`modes.DEVICE_OP_SYNCS`, `op_s`) costs the operation after the wait, at every level. Only
        the engine launches, so what a sync waits for cannot change meanwhile."""
        if op_s is None:
            if target is not None:
                for step in self.core.through(target):
                    if step.read_back is None:
                        blocked = step.gpu_end > t
                        t = max(t, step.gpu_end) + step.readback_s + (step.wake_s if blocked else 0.0)
                        step.read_back = t
            return t
        if target is not None and target.gpu_end > t:
            t = target.gpu_end
        return t + op_s

    def read(self, step: Step, t: float) -> float:
        """The settle's readback, unless a sync read the step already. A host that reached the settle before the step
        ended blocked on it, and hil adds the wake-up it measured at the real wait (the sim's readback cost, fitted on
        the real level's steps, holds its wake-ups already)."""
        blocked = step.gpu_end > t
        t = max(t, self.env.now)
        if step.read_back is not None:
            return t
        t += step.readback_s
        return t + step.wake_s if blocked else t

    def admit(self) -> None:
        pass  # clients are processes of their own

    def scheduled(self) -> None:
        pass

    def idle(self) -> simpy.Event | None:
        self.arrived = self.env.event()
        return None if self.core.sched.has_waiting() else self.arrived

    def finished(self, rids: np.ndarray) -> None:
        for rid in rids.tolist():
            self.done_events.pop(rid).succeed()

    def record(self, step: Step) -> None:
        self.core.records.add_step(step, step.update_end)  # its tokens reached the clients at update_end

    def launched(self, step: Step, t: float) -> None:
        """Hand `step` to the GPU at time `t`, its launch's end (the clock may be behind): the GPU does not start the
        step earlier, and only the engine reads the in-flight queue, so the host need not wake then.

        The engine starts the step itself, ahead of the clock, when nothing could read the device truth between
        now and the step's start: the step's end is then known, its `done` fires then, and the GPU process is not
        involved (one SimPy event per step instead of two). The engine is the truth's only reader and is at t
        already; it reads the truth only when trimming, so a step may start early if it starts at t (an idle
        GPU) or if the engine never trims. Otherwise the step is queued for the GPU process, woken at the step's
        earliest start if it is waiting. A hardware backend's step then runs, and is read back, right here. A step
        whose enqueue the backend reports may start before t (at its first part, `_ready`)."""
        step.done = Wake(self.env)
        start = self._earliest_start(_ready(step))
        if not self.stream and (start <= t or not self.mode.trim):
            self._start(step, start)
            return
        self.stream.append(step)
        if self.gpu_idle is not None and not self.gpu_idle.triggered:
            self.gpu_idle.at(start)

    # ---------------------------------------------------------------- run

    def run(self) -> tuple[Records, float]:
        env = self.env
        if self.sc.workload.arrival == "closed":
            next_id = [0]
            for _ in range(min(self.sc.workload.concurrency, self.n)):
                env.process(self.closed_client(next_id))
        else:
            env.process(self.open_clients())
        env.process(self.gpu_stream())
        loop = env.process(self.loop.run())
        env.run(until=loop)
        return self.loop.result()


def _ready(step: Step) -> float:
    """When the device can start `step`: once its first part was enqueued, or, where the backend does not say
    when its parts were enqueued, once its launch ended."""
    return step.launch_end if step.enqueue is None else step.launch_start + step.enqueue[0][0]


def _overlapped_end(step: Step, start: float) -> float:
    """The device end of a step started at `start` whose parts the host enqueued one after another while the
    device ran them (CUDA streams do so): a part starts when the previous one ended and once its enqueue began,
    and ends no earlier than its own device time after that, nor before its enqueue ended (its last kernel
    cannot run before it was launched). docs/hil.md gives the measurements behind this model."""
    t0, end = step.launch_start, start
    if len(step.enqueue) == len(step.parts_s) == 1:  # one part (a sim step on a profile): the loop unrolled
        (begin, enqueued), device_s = step.enqueue[0], step.parts_s[0]
        return max(max(end, t0 + begin) + device_s, t0 + enqueued)
    for (begin, enqueued), device_s in zip(step.enqueue, step.parts_s, strict=True):
        part_start = max(end, t0 + begin)
        end = max(part_start + device_s, t0 + enqueued)
    return end

