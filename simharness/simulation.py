"""The SimPy model: clients, the engine loop (host thread) and the GPU stream, in virtual time.

Engine loop with queue depth D (vLLM `EngineCore.step_with_batch_queue`; D = 1 is `step`):
fill the queue first (schedule, syncs, prep, launch) while fewer than D steps are in flight and
something can be scheduled; otherwise pop the oldest step, wait for its output (the by-design
readback), settle it (`update_from_output`: tokens reach clients now) and, with the CPU n-gram
proposer, draft on the host. The GPU stream runs launched steps FIFO.

Two views of every request are kept, as in vLLM: the host's (`policy.BatchScheduler`, optimistic
under async) and the device's truth here (committed tokens, prefill progress), which advances when
a step starts on the GPU. A request that finished in step N but already sits in step N+1 costs
wasted verify slots.

Speed: the engine computes its host phases ahead of the clock and yields only where it must observe
something (a GPU step's end, the time tokens reach clients); it also starts a step on the GPU itself
when nothing can read the device truth before the step's start (`_launch`), and a started step's end
is scheduled, not waited for. That leaves about three SimPy events per step, and each of these
shortcuts gives the same records, to the bit, as one event per phase would.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import simpy

from simharness.core import EngineCore
from simharness.costmodel import CostModel
from simharness.engine.backend import Backend, model_backend
from simharness.modes import OUTPUT_READBACK, Mode, resolve_mode
from simharness.records import ARRIVAL_S, LAST_TOKEN_S, Records, Step
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
    """One sweep point in virtual time (the sim and hil levels). `run()` returns the records and the run's
    duration."""

    def __init__(self, sc: Scenario, requests: Requests, mode: Mode, backend: Backend):
        self.sc = sc
        self.mode = mode
        self.req = requests
        self.n = len(requests.prompt_len)
        self.core = EngineCore(sc, requests, mode, backend)
        self.backend = backend
        self.records: Records = self.core.records
        # the engine's host work the harness does not reproduce (scheduler, output processing) is modelled
        self.cost = CostModel(sc.engine, optimistic_correction=mode.optimistic)
        self.sync_s = self.cost.sync()  # a sync's own host time, once its GPU event fired
        self.env = simpy.Environment()
        self.stream: deque[Step] = deque()  # launched steps the GPU has not started
        self.gpu_idle: Wake | None = None  # set while the GPU waits for a launch
        self.work = self.env.event()  # fires when a request arrives while the engine is idle
        self.done_events: dict[int, simpy.Event] = {}
        self.gpu_free_at: float | None = None  # the end of the latest step started on the GPU

    # ---------------------------------------------------------------- clients

    def _arrive(self, rid: int) -> simpy.Event:
        self.records.request_times[ARRIVAL_S, rid] = self.env.now
        self.core.sched.arrive(rid)
        ev = self.done_events[rid] = self.env.event()
        if not self.work.triggered:
            self.work.succeed()
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

        The engine queues a step when it computes its launch, ahead of the clock (`_schedule_prep_launch`):
        the step starts no earlier than its `launch_end` nor before the GPU is free. Most steps never reach this
        process: the engine starts them itself when that is safe (`_launch`)."""
        env, stream = self.env, self.stream
        while True:
            if not stream:
                self.gpu_idle = Wake(env)
                yield self.gpu_idle
            step = stream[0]
            start = self._earliest_start(_ready(step))
            if start > env.now:
                yield self._until(start)
            stream.popleft()
            self._start(step, env.now)

    def _earliest_start(self, t: float) -> float:
        """When a step launched at time `t` can start: then, or once the GPU is free."""
        return t if self.gpu_free_at is None else max(t, self.gpu_free_at)

    def _start(self, step: Step, start: float) -> None:
        """Start `step` on the GPU at time `start`: the device truth moves on now. Its end is then known, so its
        `done` is set to fire then (one SimPy event per step; the GPU waits for the next launch meanwhile)."""
        duration, step.readback_s = self.backend.run(step)
        step.gpu_start = start
        step.bubble_s = 0.0 if self.gpu_free_at is None else start - self.gpu_free_at
        end = start + duration if step.enqueue is None else _overlapped_end(step, start)
        step.gpu_end = self.gpu_free_at = end
        step.done.at(end)

    # ---------------------------------------------------------------- engine loop

    def _until(self, t: float) -> simpy.Timeout:
        """A timeout that ends exactly at time `t`, the sum of several host phases."""
        return self.env.timeout(_delay(self.env.now, t))

    def _syncs(self, step: Step, ph: str, t: float):
        """Block the host, from time `t` on, on the GPU event of each sync point of phase `ph` in turn; record the
        waits and return the time the last one ends.

        The host's time runs ahead of the clock: it yields at most once, for the newest step the points wait
        for (`EngineCore.newest_sync_target`). Each sync then starts at t or when its step ended on the GPU,
        whichever is later. Only the engine launches, so what a sync waits for cannot change meanwhile."""
        core = self.core
        newest = core.newest_sync_target(ph, step)
        if newest is not None and newest.gpu_end > self.env.now:
            yield newest.done
        for sp in core.syncs_of(step)[ph]:
            # hil: the real operation, if any, timed alone (its wait stays modelled) is the sync's own cost
            op_s = self.backend.sync_op(step, sp.name)
            start = t
            target = core.sync_target(sp)
            if target is not None and target.gpu_end > t:
                t = target.gpu_end
            t += self.sync_s if op_s is None else op_s
            core.record_sync(step, sp.name, sp.phase, sp.waits_for, start, t)
        return t

    def engine_loop(self):
        env, cost, core = self.env, self.cost, self.core
        sched, in_flight, depth = core.sched, core.in_flight, self.mode.depth
        gc = core.gc.probability > 0
        while sched.n_finished < self.n:
            launched = False
            if len(in_flight) < depth:  # fill the batch queue before consuming any output
                gc_pause = core.gc_pause() if gc else 0.0
                if gc_pause:
                    yield env.timeout(gc_pause)
                step = core.schedule(gc_pause)
                if step is not None:
                    step.done = Wake(env)
                    host = yield from self._schedule_prep_launch(step)
                    launched = True
                elif in_flight:
                    # nothing to schedule: the scheduler call still costs the host its base time
                    yield env.timeout(cost.schedule(0))
            if launched and len(in_flight) < depth:
                yield self._until(host)  # schedule the next step once this launch is done
                continue
            if in_flight:
                yield from self._settle(in_flight.popleft(), host if launched else env.now)
            elif sched.n_finished < self.n:
                self.work = env.event()
                if not sched.has_waiting():
                    yield self.work

    def _schedule_prep_launch(self, step: Step):
        """The host phases from scheduling to launch, computed ahead of the clock (`_syncs`); returns the time
        the launch ends. The engine yields only to wait for the GPU or to read the device truth on time."""
        env, core, b = self.env, self.core, step.batch
        syncs = core.syncs_of(step)
        t = env.now
        if syncs["schedule"]:
            t = yield from self._syncs(step, "schedule", t)
        step.schedule_start = t
        step.schedule_end = t = t + self.cost.schedule(b.size)
        # syncs placed in prep run before prep's own work: trimming below relies on them
        if syncs["prep"]:
            t = yield from self._syncs(step, "prep", t)
        step.prep_start = t
        if core.trims_async and b.n_prefill < b.size:
            # Prep reads the device truth at prep_start: a launched step the GPU has not started may start
            # before then, so the host really waits there (with none, the truth cannot change until launch).
            if self.stream and t > env.now:
                yield self._until(t)
            core.trim(step)
        step.prep_end = t = t + self.backend.prep(step)
        if syncs["launch"]:
            t = yield from self._syncs(step, "launch", t)
        step.launch_start = t
        step.launch_end = t = t + self.backend.launch(step)
        # The launch is queued now and takes effect at launch_end: the GPU does not start the step earlier, and
        # only the engine reads the in-flight queue. So the host need not wake at launch_end.
        core.launched(step)
        self._launch(step, t)
        return t

    def _launch(self, step: Step, t: float) -> None:
        """Hand `step` to the GPU at time `t` (the clock may be behind).

        The engine starts the step itself, ahead of the clock, when nothing could read the device truth between
        now and the step's start: the step's end is then known, its `done` fires then, and the GPU process is not
        involved (one SimPy event per step instead of two). The engine is the truth's only reader and is at t
        already; it reads the truth only when trimming, so a step may start early if it starts at t (an idle
        GPU) or if the engine never trims. Otherwise the step is queued for the GPU process, woken at the step's
        earliest start if it is waiting. A hardware backend's step then runs, and is read back, right here. A step
        whose enqueue the backend reports may start before t (at its first part, `_ready`)."""
        start = self._earliest_start(_ready(step))
        if not self.stream and (start <= t or not self.mode.trim):
            self._start(step, start)
            return
        self.stream.append(step)
        if self.gpu_idle is not None and not self.gpu_idle.triggered:
            self.gpu_idle.at(start)

    def _settle(self, step: Step, start: float):
        """From host time `start` (at or ahead of the clock), wait for the oldest step's output, then update
        requests and emit tokens."""
        env, core = self.env, self.core
        t = start
        if step.gpu_end > env.now:
            yield step.done
            t = max(t, env.now)
        # the readback and the update are one event (a sync point between them is computed ahead, `_syncs`)
        sync_end = t + step.readback_s
        core.record_sync(step, OUTPUT_READBACK, "update", "oldest_in_flight", start, sync_end)
        step.update_start = (yield from self._syncs(step, "update", sync_end)) if core.syncs_of(step)["update"] \
            else sync_end
        now = step.update_end = step.update_start + self.cost.update(step.batch.size)
        yield self._until(now)
        done = core.settle(step)
        step.propose_start = step.propose_end = now
        if self.mode.ngram_cpu and self.mode.k:
            yield env.timeout(self.backend.propose(core.to_propose(step)))
            step.propose_end = env.now
        self.records.add_step(step, now)  # its tokens reached the clients at `now`
        for rid in done.tolist():
            self.done_events.pop(rid).succeed()

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
        loop = env.process(self.engine_loop())
        env.run(until=loop)
        r = self.req
        kind = np.asarray(r.kind_names)[r.kind] if hasattr(r, "kind_names") else np.asarray(r.kind)
        self.records.requests = self.records.requests_frame(kind, r.prompt_len, r.output_len)
        return self.records, float(np.nanmax(self.records.request_times[LAST_TOKEN_S]))


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
    for (begin, enqueued), device_s in zip(step.enqueue, step.parts_s, strict=True):
        part_start = max(end, t0 + begin)
        end = max(part_start + device_s, t0 + enqueued)
    return end


def simulate(sc: Scenario, requests: Requests) -> tuple[Records, float]:
    """One point at the sim level: its mode resolved, the cost-model backend, virtual time."""
    mode = resolve_mode(sc)
    return Simulation(sc, requests, mode, model_backend(sc, requests, mode)).run()
