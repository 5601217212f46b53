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
from dataclasses import dataclass

import numpy as np
import simpy

from simharness.costmodel import CostModel
from simharness.engine.backend import ModelBackend
from simharness.instrument import phase
from simharness.policy import EMITTED, K_SLOTS, Batch, BatchScheduler
from simharness.records import ARRIVAL_S, LAST_TOKEN_S, Records
from simharness.scenario import Scenario, ScenarioError, SyncPoint

# The sync points the harness knows, with the mode in which each is present (vllm-notes §5).
KNOWN_SYNC_POINTS: dict[str, SyncPoint] = {
    # pre-#32951 async: _update_states reads step N's accepted counts before preparing N+1
    "accepted_counts": SyncPoint(name="accepted_counts", phase="prep"),
    # V1 ngram_gpu: update_scheduler_for_invalid_drafts waits for the valid-draft count to trim
    "valid_draft_counts": SyncPoint(name="valid_draft_counts", phase="prep"),
    # what-ifs, absent by default: `.item()` / GPU boolean-mask indexing in metadata build (#38047)
    "metadata_item": SyncPoint(name="metadata_item", phase="prep"),
    "bool_mask_index": SyncPoint(name="bool_mask_index", phase="prep"),
}
# Not a sync point one can remove: settling a step needs its output (engine core `get_output`).
OUTPUT_READBACK = "output_readback"
PHASES = ("schedule", "prep", "launch", "update")
NO_DEVICE_PHASES = (float("nan"),) * 5


@dataclass
class Mode:
    """How a point's engine behaves, resolved from its scenario."""

    depth: int
    k: int
    optimistic: bool
    trim: bool  # host trims invalid drafts, so it must know the valid count before prep
    ngram_cpu: bool
    syncs: list[SyncPoint]
    note: str = ""


def resolve_mode(sc: Scenario) -> Mode:
    """Effective depth, drafting and sync points of a point; raises ScenarioError on bad edits."""
    spec = sc.engine.speculation
    k = spec.k if spec.proposer != "none" else 0
    depth, note = sc.scheduler.depth, ""
    if spec.proposer == "ngram_cpu" and depth > 1:
        # vLLM disables async scheduling for the CPU n-gram proposer (v1_async_sched_incompat)
        depth, note = 1, f"ngram_cpu is incompatible with async scheduling: depth {sc.scheduler.depth} -> 1"
    active = set()
    if depth > 1 and k > 0 and sc.scheduler.policy == "wait":
        active.add("accepted_counts")
    if depth > 1 and k > 0 and spec.proposer == "ngram_gpu" and spec.invalid_slots == "trim":
        active.add("valid_draft_counts")
    edits = sc.scheduler.sync_points
    for name in edits.remove:
        if name == OUTPUT_READBACK:
            raise ScenarioError(f"scheduler.sync_points.remove: {OUTPUT_READBACK} cannot be removed")
        if name not in KNOWN_SYNC_POINTS:
            raise ScenarioError(
                f"scheduler.sync_points.remove: unknown sync point {name!r}; known: {', '.join(KNOWN_SYNC_POINTS)}"
            )
        active.discard(name)
    syncs = [KNOWN_SYNC_POINTS[n] for n in KNOWN_SYNC_POINTS if n in active]
    for item in edits.add:
        if isinstance(item, str):
            if item not in KNOWN_SYNC_POINTS:
                raise ScenarioError(
                    f"scheduler.sync_points.add: unknown sync point {item!r}; known: "
                    f"{', '.join(KNOWN_SYNC_POINTS)} (or give {{name, phase, waits_for}})"
                )
            item = KNOWN_SYNC_POINTS[item]
        if item.name not in {s.name for s in syncs}:
            syncs.append(item)
    # Trimming needs the valid-draft count on the host; without its sync (or at depth 1, where the
    # host already holds the outputs) the engine can only verify every slot.
    trim = k > 0 and (
        spec.proposer == "ngram_cpu"
        or (spec.invalid_slots == "trim" and (depth == 1 or any(s.name == "valid_draft_counts" for s in syncs)))
    )
    optimistic = depth > 1 and k > 0 and sc.scheduler.policy == "optimistic"
    return Mode(depth, k, optimistic, trim, spec.proposer == "ngram_cpu", syncs, note)


class Step:
    """One launched step: its batch, what the GPU did with it, and its host timeline (seconds).

    The outcome lives in the batch table (its rows VERIFIED..WASTED, filled by the backend). Attributes a
    step may not set keep their class defaults."""

    trimmed: bool = False  # prep cut the verified slots to the valid drafts (known at a sync)
    sync_wait: float = 0.0
    n_syncs: int = 0
    in_flight: int
    schedule_start: float
    schedule_end: float
    prep_start: float
    prep_end: float
    launch_end: float
    gpu_start: float
    gpu_end: float = math.inf  # known once the step started (often ahead of the clock, `_launch`)
    bubble: float
    update_start: float
    update_end: float
    propose_start: float
    propose_end: float
    # measured by a hardware backend (engine.backend: torch)
    readback_s: float = 0.0
    device_phases: tuple[float, ...] = NO_DEVICE_PHASES  # prefill, verify, sample, commit, propose
    device_syncs: int = 0
    harness_s: float = float("nan")

    def __init__(self, id: int, batch: Batch, done: Wake, gc_pause: float):
        self.id = id
        self.batch = batch
        self.done = done
        self.gc_pause = gc_pause


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
    """One sweep point in virtual time. `run()` returns the records and the run's duration."""

    def __init__(self, sc: Scenario, requests, acceptance, backend=None):
        self.sc = sc
        self.mode = resolve_mode(sc)
        self.req = requests
        self.cost = CostModel(sc.engine, optimistic_correction=self.mode.optimistic)
        n = len(requests.prompt_len)
        self.n = n
        budget = sc.scheduler.max_num_batched_tokens
        if budget < 1 + self.mode.k:
            raise ScenarioError(f"scheduler.max_num_batched_tokens: {budget} cannot fit a decode of 1 + k tokens")
        if not sc.scheduler.chunked_prefill and int(requests.prompt_len.max()) > budget:
            raise ScenarioError(
                f"scheduler.max_num_batched_tokens: {budget} is below the longest prompt "
                f"({int(requests.prompt_len.max())}) and chunked_prefill is off"
            )
        self.sched = BatchScheduler(sc.scheduler, requests.prompt_len, requests.output_len)
        # Common random numbers across points: streams depend on the seed only, not on the point.
        acc_rng = np.random.default_rng(np.random.SeedSequence([sc.seed, 1]))
        self.gc_rng = np.random.default_rng(np.random.SeedSequence([sc.seed, 2]))
        self.backend = backend or ModelBackend(requests, acceptance, self.cost, self.mode.k, acc_rng)
        # a hardware backend measures prep, launch, the device step, the readback and the CPU proposer
        self.measured = self.backend.measured
        self.measured_phases = ("prep,launch,gpu,readback" + (",propose" if self.mode.ngram_cpu else "")
                                if self.measured else "")
        self.records = Records(self.mode.k, requests.output_len)
        self.env = simpy.Environment()
        self.stream: deque[Step] = deque()  # launched steps the GPU has not started
        self.gpu_idle: Wake | None = None  # set while the GPU waits for a launch
        self.work = self.env.event()  # fires when a request arrives while the engine is idle
        self.done_events: dict[int, simpy.Event] = {}
        self.gpu_free_at: float | None = None  # the end of the latest step started on the GPU
        self.last_launched: Step | None = None
        self.phase_syncs = {ph: [sp for sp in self.mode.syncs if sp.phase == ph] for ph in PHASES}
        self.oldest_only = {ph: all(sp.waits_for == "oldest_in_flight" for sp in pts)
                            for ph, pts in self.phase_syncs.items()}  # fmt: skip
        self.sync_s = self.cost.sync()  # a sync's own host time, once its GPU event fired

    # ---------------------------------------------------------------- clients

    def _arrive(self, rid: int) -> simpy.Event:
        self.records.request_times[ARRIVAL_S, rid] = self.env.now
        self.sched.arrive(rid)
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
            start = self._earliest_start(step.launch_end)
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
        duration = self.backend.run_step(step)
        step.gpu_start = start
        step.bubble = 0.0 if self.gpu_free_at is None else start - self.gpu_free_at
        step.gpu_end = self.gpu_free_at = start + duration
        step.done.at(step.gpu_end)

    # ---------------------------------------------------------------- engine loop

    def _until(self, t: float) -> simpy.Timeout:
        """A timeout that ends exactly at time `t`, the sum of several host phases."""
        return self.env.timeout(_delay(self.env.now, t))

    def _held(self) -> np.ndarray:
        """What the scheduler reserves per decoding request: the drafts each running request holds when
        synchronous and trimming (the host has them), else k placeholder slots (async, or every slot verified)."""
        if self.mode.k and self.mode.depth == 1 and self.mode.trim:
            return self.backend.valid_drafts()
        return K_SLOTS

    def _syncs(self, step: Step, phase: str, in_flight: deque, t: float):
        """Block the host, from time `t` on, on the GPU event of each sync point of `phase` in turn; record the
        waits and return the time the last one ends.

        The host's time runs ahead of the clock: it yields at most once, for the newest step the points wait
        for (the GPU runs steps in launch order, so the older ones are done when it is): the last launched,
        unless every point waits for the oldest in flight. Each sync then starts at t or when its step ended on
        the GPU, whichever is later. Only the engine launches, so what a sync waits for cannot change meanwhile."""
        newest = in_flight[0] if (in_flight and self.oldest_only[phase]) else self.last_launched
        if newest is not None and newest.gpu_end > self.env.now:
            yield newest.done
        for sp in self.phase_syncs[phase]:
            start = t
            target = in_flight[0] if (sp.waits_for == "oldest_in_flight" and in_flight) else self.last_launched
            if target is not None and target.gpu_end > t:
                t = target.gpu_end
            t += self.sync_s
            step.sync_wait += t - start
            step.n_syncs += 1
            self.records.add_sync(step.id, sp.name, sp.phase, sp.waits_for, start, t)
        return t

    def engine_loop(self):
        env, cost, mode, sched = self.env, self.cost, self.mode, self.sched
        in_flight: deque[Step] = deque()
        next_step = 0
        gc = self.sc.engine.gc
        while sched.n_finished < self.n:
            launched = False
            if len(in_flight) < mode.depth:
                gc_pause = 0.0
                if gc.probability > 0 and self.gc_rng.random() < gc.probability:
                    gc_pause = gc.mean_ms * 1e-3
                    if gc.distribution == "exponential":
                        gc_pause = self.gc_rng.exponential(gc.mean_ms * 1e-3)
                    yield env.timeout(gc_pause)
                if not self.measured:
                    batch = sched.schedule(mode.k, self._held())
                else:
                    with phase("schedule"):
                        batch = sched.schedule(mode.k, self._held())
                if batch.size:
                    step = Step(next_step, batch, Wake(env), gc_pause)
                    next_step += 1
                    host = yield from self._schedule_prep_launch(step, in_flight)
                    launched = True
                elif in_flight:
                    # nothing to schedule: the scheduler call still costs the host its base time
                    yield env.timeout(cost.schedule(0))
            if launched and len(in_flight) < mode.depth:
                yield self._until(host)  # schedule the next step once this launch is done
                continue
            if in_flight:
                yield from self._settle(in_flight.popleft(), in_flight, host if launched else env.now)
            elif sched.n_finished < self.n:
                self.work = env.event()
                if not sched.has_waiting():
                    yield self.work

    def _schedule_prep_launch(self, step: Step, in_flight: deque):
        """The host phases from scheduling to launch, computed ahead of the clock (`_syncs`); returns the time
        the launch ends. The engine yields only to wait for the GPU or to read the device truth on time."""
        env, cost, mode, b = self.env, self.cost, self.mode, step.batch
        syncs = self.phase_syncs
        t = env.now
        if syncs["schedule"]:
            t = yield from self._syncs(step, "schedule", in_flight, t)
        step.schedule_start = t
        step.schedule_end = t = t + cost.schedule(b.size)
        # syncs placed in prep run before prep's own work: trimming below relies on them
        if syncs["prep"]:
            t = yield from self._syncs(step, "prep", in_flight, t)
        step.prep_start = t
        n_tokens = b.n_tokens
        # Trimming at prep is for async scheduling: a synchronous scheduler already reserved the drafts the
        # host holds, and with nothing in flight the device has not moved since.
        if mode.trim and mode.depth > 1 and b.n_prefill < b.size:
            # Prep reads the device truth at prep_start: a launched step the GPU has not started may start
            # before then, so the host really waits there (with none, the truth cannot change until launch).
            if self.stream and t > env.now:
                yield self._until(t)
            n_tokens += b.trim(self.backend.valid_drafts(), mode.k)  # a decode computes 1 + its slots
            step.trimmed = True
        step.prep_end = t = t + (self.backend.prep(step) if self.measured else cost.prep(b.size, n_tokens))
        if syncs["launch"]:
            t = yield from self._syncs(step, "launch", in_flight, t)
        step.launch_end = t = t + (self.backend.launch(step) if self.measured else cost.launch())
        # The launch is queued now and takes effect at launch_end: the GPU does not start the step earlier, and
        # only the engine reads in_flight and last_launched. So the host need not wake at launch_end.
        in_flight.append(step)
        step.in_flight = len(in_flight)
        self.last_launched = step
        self._launch(step, t)
        return t

    def _launch(self, step: Step, t: float) -> None:
        """Hand `step` to the GPU at time `t` (the clock may be behind).

        The engine starts the step itself, ahead of the clock, when nothing could read the device truth between
        now and the step's start: the step's end is then known, its `done` fires then, and the GPU process is not
        involved (one SimPy event per step instead of two). The engine is the truth's only reader and is at t
        already; it reads the truth only when trimming, so a step may start early if it starts at t (an idle
        GPU) or if the engine never trims. Otherwise the step is queued for the GPU process, woken at the step's
        earliest start if it is waiting. A hardware backend's step then runs, and is read back, right here."""
        start = self._earliest_start(t)
        if not self.stream and (start == t or not self.mode.trim):
            self._start(step, start)
            return
        self.stream.append(step)
        if self.gpu_idle is not None and not self.gpu_idle.triggered:
            self.gpu_idle.at(start)

    def _settle(self, step: Step, in_flight: deque, start: float):
        """From host time `start` (at or ahead of the clock), wait for the oldest step's output, then update
        requests and emit tokens."""
        env, b, syncs = self.env, step.batch, self.phase_syncs["update"]
        t = start
        if step.gpu_end > env.now:
            yield step.done
            t = max(t, env.now)
        # the readback and the update are one event (a sync point between them is computed ahead, `_syncs`)
        sync_end = t + (step.readback_s if self.measured else self.sync_s)
        step.sync_wait += sync_end - start
        step.n_syncs += 1
        self.records.add_sync(step.id, OUTPUT_READBACK, "update", "oldest_in_flight", start, sync_end)
        step.update_start = (yield from self._syncs(step, "update", in_flight, sync_end)) if syncs else sync_end
        now = step.update_end = step.update_start + self.cost.update(b.size)
        yield self._until(now)
        if not self.measured:
            done = self.sched.settle(b)
        else:
            with phase("update"):
                done = self.sched.settle(b)
            self.backend.release(done)
        step.propose_start = step.propose_end = now
        if self.mode.ngram_cpu and self.mode.k:
            # the CPU proposer drafts for the requests still running that got tokens (a prefill's first
            # token included), over their whole history
            got = b.req[b.table[EMITTED] > 0]
            live = got[self.sched.committed[got] < self.req.output_len[got]]
            if self.measured:
                yield env.timeout(self.backend.propose(live))
            else:
                hist = int((self.req.prompt_len[live] + self.sched.committed[live]).sum())
                yield env.timeout(self.cost.ngram_cpu(len(live), hist))
            step.propose_end = env.now
        s = step
        row = (s.id, s.in_flight, s.schedule_start, s.schedule_end, s.prep_start, s.prep_end, s.launch_end,
               s.gpu_start, s.gpu_end, s.update_start, s.update_end, s.propose_start, s.propose_end, s.gc_pause,
               s.sync_wait, s.n_syncs, s.bubble, self.measured_phases, *s.device_phases, s.device_syncs, s.harness_s)
        self.records.add_step(b.table, now, row)  # its tokens reached the clients at `now`
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
