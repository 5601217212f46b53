"""The SimPy model: clients, the engine loop (host thread) and the GPU stream, in virtual time.

Engine loop with queue depth D (vLLM `EngineCore.step_with_batch_queue`; D = 1 is `step`):
fill the queue first (schedule, syncs, prep, launch) while fewer than D steps are in flight and
something can be scheduled; otherwise pop the oldest step, wait for its output (the by-design
readback), settle it (`update_from_output`: tokens reach clients now) and, with the CPU n-gram
proposer, draft on the host. The GPU stream runs launched steps FIFO.

Two views of every request are kept, as in vLLM: the host's (`policy.BatchScheduler`, optimistic
under async) and the device's truth here (committed tokens, prefill progress), which the GPU
stream advances when a step runs. A request that finished in step N but already sits in step N+1
costs wasted verify slots.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import simpy

from simharness.costmodel import CostModel
from simharness.engine.backend import ModelBackend
from simharness.policy import Batch, BatchScheduler
from simharness.records import REQUEST_COLUMNS, Records
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


@dataclass(eq=False)
class Step:
    """One launched step: its batch, what the GPU did with it, and its host timeline."""

    id: int
    batch: Batch
    done: simpy.Event
    verified_slots: np.ndarray | None = None  # draft slots the GPU verifies per request
    valid: np.ndarray | None = None  # valid drafts, when known at prep (trim)
    emitted: np.ndarray | None = None
    accepted: np.ndarray | None = None
    drafts_valid: np.ndarray | None = None
    wasted: np.ndarray | None = None
    in_flight: int = 0
    t: dict[str, float] = field(default_factory=dict)
    gc_pause: float = 0.0
    sync_wait: float = 0.0
    n_syncs: int = 0


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
        # per-request tallies
        self.arrival = np.full(n, np.nan)
        self.first_token = np.full(n, np.nan)
        self.last_token = np.full(n, np.nan)
        self.chunks = np.zeros(n, dtype=np.int64)
        self.num_drafts = np.zeros(n, dtype=np.int64)
        self.draft_tokens = np.zeros(n, dtype=np.int64)
        self.accepted_tokens = np.zeros(n, dtype=np.int64)
        self.wasted_slots = np.zeros(n, dtype=np.int64)
        # Common random numbers across points: streams depend on the seed only, not on the point.
        acc_rng = np.random.default_rng(np.random.SeedSequence([sc.seed, 1]))
        self.gc_rng = np.random.default_rng(np.random.SeedSequence([sc.seed, 2]))
        self.backend = backend or ModelBackend(requests, acceptance, self.cost, self.mode.k, acc_rng)
        self.records = Records(k=self.mode.k)
        self.env = simpy.Environment()
        self.stream: simpy.Store = simpy.Store(self.env)
        self.work = self.env.event()  # fires when a request arrives while the engine is idle
        self.done_events: dict[int, simpy.Event] = {}
        self.gpu_free_at = 0.0
        self.last_gpu_end: float | None = None
        self.last_launched: Step | None = None

    # ---------------------------------------------------------------- clients

    def _arrive(self, rid: int) -> simpy.Event:
        self.arrival[rid] = self.env.now
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
        """Runs launched steps in order; the step's outcome is decided by the device truth now."""
        while True:
            step: Step = yield self.stream.get()
            start = self.env.now
            duration = self.backend.run_step(step)
            step.t["gpu_start"] = start
            step.t["bubble"] = 0.0 if self.last_gpu_end is None else start - self.last_gpu_end
            yield self.env.timeout(duration)
            step.t["gpu_end"] = self.env.now
            self.last_gpu_end = self.env.now
            step.done.succeed()

    # ---------------------------------------------------------------- engine loop

    def _draft_slots(self, r: np.ndarray) -> np.ndarray:
        """Draft slots the scheduler reserves: k placeholders under async, known drafts when synchronous."""
        if not self.mode.k:
            return np.zeros(len(r), dtype=np.int64)
        if self.mode.depth > 1 or not self.mode.trim:
            return np.full(len(r), self.mode.k, dtype=np.int64)
        # synchronous: the host holds the drafts proposed after the last step
        return self.backend.valid_drafts(r)

    def _sync(self, step: Step, sp: SyncPoint, in_flight: deque):
        """Block the host on a GPU event; record the wait."""
        start = self.env.now
        target = in_flight[0] if (sp.waits_for == "oldest_in_flight" and in_flight) else self.last_launched
        if target is not None and not target.done.triggered:
            yield target.done
        yield self.env.timeout(self.cost.sync())
        step.sync_wait += self.env.now - start
        step.n_syncs += 1
        self.records.add_sync(step.id, sp.name, sp.phase, sp.waits_for, start, self.env.now)

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
                batch = sched.schedule(self._draft_slots)
                if batch.size:
                    step = Step(id=next_step, batch=batch, done=env.event(), gc_pause=gc_pause)
                    next_step += 1
                    yield from self._phase_syncs(step, "schedule", in_flight)
                    step.t["schedule_start"] = env.now
                    yield env.timeout(cost.schedule(batch.size))
                    step.t["schedule_end"] = env.now
                    yield from self._prep_and_launch(step, in_flight)
                    launched = True
                elif in_flight:
                    # nothing to schedule: the scheduler call still costs the host its base time
                    yield env.timeout(cost.schedule(0))
            if launched and len(in_flight) < mode.depth:
                continue
            if in_flight:
                yield from self._settle(in_flight.popleft(), in_flight)
            elif sched.n_finished < self.n:
                self.work = env.event()
                if not sched.has_waiting():
                    yield self.work

    def _prep_and_launch(self, step: Step, in_flight: deque):
        env, cost, mode, b = self.env, self.cost, self.mode, step.batch
        # syncs placed in prep run before prep's own work: trimming below relies on them
        for sp in mode.syncs:
            if sp.phase == "prep":
                yield from self._sync(step, sp, in_flight)
        dec = ~b.prefill
        slots = b.draft_slots.copy()
        if mode.trim and dec.any():
            r = b.req[dec]
            valid = self.backend.valid_drafts(r)
            slots[dec] = np.minimum(valid, mode.k)
            step.valid = np.zeros(len(b.req), dtype=np.int64)
            step.valid[dec] = slots[dec]
        step.verified_slots = slots
        n_tokens = int(np.where(dec, 1 + slots, b.tokens).sum())
        step.t["prep_start"] = env.now
        yield env.timeout(cost.prep(b.size, n_tokens))
        step.t["prep_end"] = env.now
        yield from self._phase_syncs(step, "launch", in_flight)
        yield env.timeout(cost.launch())
        step.t["launch_end"] = env.now
        in_flight.append(step)
        step.in_flight = len(in_flight)
        self.last_launched = step
        self.stream.put(step)

    def _phase_syncs(self, step: Step, phase: str, in_flight: deque):
        for sp in self.mode.syncs:
            if sp.phase == phase:
                yield from self._sync(step, sp, in_flight)

    def _settle(self, step: Step, in_flight: deque):
        """Wait for the oldest step's output, then update requests and emit tokens."""
        env, b = self.env, step.batch
        start = env.now
        if not step.done.triggered:
            yield step.done
        yield env.timeout(self.cost.sync())
        step.sync_wait += env.now - start
        step.n_syncs += 1
        self.records.add_sync(step.id, OUTPUT_READBACK, "update", "oldest_in_flight", start, env.now)
        yield from self._phase_syncs(step, "update", in_flight)
        step.t["update_start"] = env.now
        yield env.timeout(self.cost.update(b.size))
        now = step.t["update_end"] = env.now
        done = self.sched.settle(b, step.emitted)
        out = step.emitted > 0
        r = b.req[out]
        self.records.add_emissions(step.id, now, r, step.emitted[out])
        first = np.isnan(self.first_token[r])
        self.first_token[r[first]] = now
        self.last_token[r] = now
        self.chunks[r] += 1
        dec = ~b.prefill
        rd = b.req[dec]
        self.num_drafts[rd] += step.drafts_valid[dec] > 0
        self.draft_tokens[rd] += step.drafts_valid[dec]
        self.accepted_tokens[rd] += step.accepted[dec]
        self.wasted_slots[rd] += step.wasted[dec]
        step.t["propose_start"] = step.t["propose_end"] = now
        if self.mode.ngram_cpu and self.mode.k:
            # the CPU proposer drafts for the requests still running, over their whole history
            live = rd[self.sched.committed[rd] < self.req.output_len[rd]]
            hist = int((self.req.prompt_len[live] + self.sched.committed[live]).sum())
            yield env.timeout(self.cost.ngram_cpu(len(live), hist))
            step.t["propose_end"] = env.now
        self._record_step(step)
        for rid in done:
            self.done_events.pop(int(rid)).succeed()

    def _record_step(self, s: Step) -> None:
        b, t = s.batch, s.t
        dec = ~b.prefill
        acc = s.accepted[dec]
        acc_pos = (acc[:, None] > np.arange(self.mode.k)).sum(axis=0)
        self.records.add_step(
            (
                s.id,
                b.size,
                int(b.prefill.sum()),
                int(b.tokens[b.prefill].sum()),
                int((1 + s.verified_slots[dec]).sum()),
                int(b.draft_slots[dec].sum()),
                int(s.drafts_valid.sum()),
                int(s.accepted.sum()),
                int(s.emitted.sum()),
                int(s.wasted.sum()),
                s.in_flight,
                t["schedule_start"],
                t["schedule_end"],
                t["prep_start"],
                t["prep_end"],
                t["launch_end"],
                t["gpu_start"],
                t["gpu_end"],
                t["update_start"],
                t["update_end"],
                t["propose_start"],
                t["propose_end"],
                s.gc_pause,
                s.sync_wait,
                s.n_syncs,
                t["bubble"],
            ),
            acc_pos,
        )

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
        self.records.requests = self.requests_frame()
        return self.records, float(np.nanmax(self.last_token))

    def requests_frame(self) -> pd.DataFrame:
        r = self.req
        cols = [
            np.arange(self.n),
            np.asarray(r.kind_names)[r.kind] if hasattr(r, "kind_names") else np.asarray(r.kind),
            self.arrival,
            r.prompt_len,
            r.output_len,
            self.first_token,
            self.last_token,
            self.chunks,
            self.num_drafts,
            self.draft_tokens,
            self.accepted_tokens,
            self.wasted_slots,
        ]
        return pd.DataFrame(dict(zip(REQUEST_COLUMNS, cols, strict=True)))
