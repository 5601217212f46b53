"""The real decode loop behind the engine loop: the measured levels (`engine.level: hil` and `real`).

The engine loop calls `prep` (build the step's inputs on the host; prompt chunks go to the device there, the
decode step's inputs in one copy with its launch) and `launch` (enqueue the prefills and the decode step) when
it reaches those phases, and `run` when it needs the step's outcome: `run` waits for the real step, reads it back
and returns the step's measured device time.
At the hil level that is when the step starts in virtual time (which its device time then advances), at
the real level when the host blocks on it. Real work is enqueued in launch order, so the device sees the
order of a FIFO stream, and the emitted tokens and accepted counts are the rejection sampler's real output.

The host keeps a mirror of the device truth (`engine.mirror`: committed tokens, valid drafts) updated from
each read-back step, as vLLM's engine does from its outputs; it is what the host may use at a sync. Each step's
`Launch` holds what prep built for it and what its launch enqueued, part by part (each part timed on CUDA,
`engine.timing`), until `run` waits for and reads back everything it enqueued.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from simharness.backend import Enqueue, StepTiming
from simharness.engine.decode import FORWARD, DecodeLoop, StepOutput, StepResult
from simharness.engine.host_work import SYNC_OPS, Allocations
from simharness.engine.mirror import HostMirror
from simharness.engine.model import Transformer
from simharness.engine.slots import Slots
from simharness.engine.timing import DeviceClock, PartTiming
from simharness.instrument import SyncRecorder
from simharness.ledger import HostLedger
from simharness.modes import Mode
from simharness.phases import phase
from simharness.policy import COMPLETES, EMITTED
from simharness.records import Step
from simharness.scenario import Scenario
from simharness.workload import Requests


def capacity(sc: Scenario, requests: Requests, mode: Mode) -> tuple[int, int]:
    """Cache slots and positions a point needs: its most concurrent requests, and its longest request
    plus the steps a finished request may still sit in (each up to 1 + k tokens) and one spare."""
    n = len(requests.prompt_len)
    slots = min(sc.scheduler.max_num_seqs, n)
    if sc.workload.arrival == "closed" or sc.workload.cap_concurrency:
        slots = min(slots, sc.workload.concurrency)
    longest = int((requests.prompt_len + requests.output_len).max())
    return slots, longest + (mode.depth + 1) * (mode.k + 1) + 1


def reachable_ks(schedule: tuple[tuple[int, int], ...], slots: int) -> list[int] | None:
    """The ks a k schedule gives the batch sizes a point reaches (1..`slots`, its `capacity`); None without a
    schedule. The decode loop builds its steps (on CUDA a step graph per bucket) for these only: a k that only
    larger batches get would cost its captures and hold its graphs for nothing (docs/frontier.md)."""
    return [k for size, k in schedule if size <= slots] or None


class TorchBackend:
    """Runs each launched step on the real decode loop; durations and outcomes are measured. The caller says the
    level: `gate` is hil's, where each measurement is taken alone (on CUDA the device is held in front of each part
    of a launch until it is enqueued, so that its device time excludes launch gaps, and settled before a sync's
    operation); without it, the real level's, where each step's device start and end are timestamped on the host's
    clock."""

    def __init__(self, sc: Scenario, requests: Requests, model: Transformer, mode: Mode, *, gate: bool,
                 steer: bool = True):
        spec = sc.engine.speculation
        self.req = requests
        self.mode = mode
        self.measured = "prep,launch,gpu,readback" + (",propose" if mode.ngram_cpu else "")
        # synchronizing CUDA operations in the backend's calls; the level records inside `with backend.syncs:`
        self.syncs = SyncRecorder()
        self.cuda = model.device.type == "cuda"
        n = len(requests.prompt_len)
        slots, positions = capacity(sc, requests, mode)
        if slots > model.max_slots or positions > model.max_len:
            raise ValueError(f"the model's cache ({model.max_slots} x {model.max_len}) is smaller than this point "
                             f"needs ({slots} x {positions})")
        self.loop = DecodeLoop(
            model,
            k=mode.k,
            min_n=spec.min_n,
            max_n=spec.max_n,
            tie_break=spec.tie_break,
            invalid="fill" if spec.invalid_slots == "fill" and not mode.ngram_cpu else "pad",
            seed=sc.seed,
            device_proposer=not mode.ngram_cpu,
            max_in_flight=mode.depth + 1,
            step_ks=reachable_ks(mode.k_schedule, slots),  # a k schedule's steps verify their own k
            max_batch=slots,  # step graphs for the buckets this point's batches reach only
        )
        self.references = requests.output_tokens if steer else None  # what a first token is steered to
        self.ngram_args = {"min_n": spec.min_n, "max_n": spec.max_n, "k": mode.k, "tie_break": spec.tie_break}
        self.slots = Slots(n, model.max_slots)
        self.host = HostMirror(requests, positions, mode.k, valid_from_mirror=self.loop.invalid == "fill")
        self.launches: dict[int, Launch] = {}
        self.n_launched = self.n_read = 0
        self.hil = gate
        self.timing = PartTiming(gate) if self.cuda else None
        # the real level's device timestamps; at both levels, the host's wake-up at each blocking wait
        self.clock = DeviceClock(self.cuda)
        self.starved_steps = 0  # steps whose enqueue may have outlasted a gate: their device time may hold gaps
        # The engine's host time (every phase here; the real level adds its modelled phases): the harness's own
        # time per read-back step is the wall time since the last read-back outside it.
        self.ledger = HostLedger()
        self.read_mark = self.ledger.mark()
        self.allocations = Allocations(sc.engine.gc.heap_objects, sc.engine.gc.allocations_per_step)
        self.random = requests.random  # rows sampled at temperature 1 (None: every row greedy)

    def start_clock(self) -> None:
        """Anchor the real level's device timestamps now, at the wall clock's start (`MeasuredBackend`)."""
        self.clock = DeviceClock(self.cuda)

    # ---------------------------------------------------------------- host view

    def valid_drafts(self) -> np.ndarray:
        """Valid drafts per request id as the host last read them (0 for finished ones); a view to read, not keep."""
        return self.host.next_valid

    # ---------------------------------------------------------------- engine-loop phases (measured)

    def prep(self, step: Step) -> float:
        """Build the step's device inputs: slot ids, positions (wait policy), CPU drafts, prompt chunks."""
        t0 = time.perf_counter()
        self.syncs.start_step(step.step)
        with phase("prep"):
            b = step.batch
            launch = Launch(decode_rids=b.req[b.decode], k=b.k)
            for i in np.flatnonzero(b.prefill):
                rid = int(b.req[i])
                if self.slots.take(rid):  # its first chunk
                    self.host.history[rid, : self.host.prompt_len[rid]] = self.req.prompt_tokens[rid]
                    if self.random is not None:  # the slot's sampling temperature (fill_: no sync)
                        self.loop.temperature[self.slots.of[rid]].fill_(1.0 if self.random[rid] else 0.0)
                start, end = self.slots.launch_chunk(rid, int(b.tokens[i]))
                last = bool(b.completes_prefill[i])
                # the whole prompt goes along with the last chunk (add_request writes the history)
                ids = self.req.prompt_tokens[rid] if last else self.req.prompt_tokens[rid][start:end]
                launch.prefills.append((rid, start, last, self.loop.to_device(ids)))
            r = launch.decode_rids
            if len(r):  # host arrays: the decode loop copies them to the device with the step (one copy, graphed)
                launch.slots = self.slots.of[r]
                if not self.mode.optimistic and self.n_read == self.n_launched:
                    # the host has read every step's accepted counts: it sends exact positions
                    launch.lengths = self.host.positions(r)
                if self.mode.ngram_cpu:
                    launch.drafts = self.host.drafts[r, : b.k]  # the step verifies the first b.k
                self.allocations.step(self.host, r)
            self.launches[step.step] = launch
        return self._leave(t0)

    def sync_op(self, step: Step, name: str) -> float | None:
        """Run the real operation behind what-if sync point `name` (`engine.host_work.SYNC_OPS`) as part of prep;
        None when it has none. At the real level the operation is the wait itself. At hil, where the wait is
        modelled, the device is settled first and the operation timed alone: its host seconds (the tiny kernels
        it launches, their copy back and the host's wake-up) are the sync's own cost, which the model adds after
        the wait."""
        op = SYNC_OPS.get(name)
        if op is None:
            return None
        self.syncs.start_step(step.step)
        t0 = time.perf_counter()
        with phase("prep"):
            if self.hil and self.cuda:
                torch.cuda.synchronize()
            t_op = time.perf_counter()
            op(self.loop)
        self._leave(t0)
        return time.perf_counter() - t_op

    def launch(self, step: Step) -> tuple[float, Enqueue]:
        """Enqueue the step's prefills and decode step on the device; returns the host's enqueue time (on the CPU,
        where the work runs inside the calls, the enqueue less that work, which is timed as the device phases).
        On CUDA it also returns when each part was enqueued, which the hil level's device timeline overlaps with
        the device's work."""
        launch = self.launches[step.step]
        timing = self.timing
        t0 = time.perf_counter()
        self.syncs.start_step(step.step)
        if timing is not None:
            timing.start_launch()
        own_window = not self.hil and not self.cuda  # the CPU's window marks (`Launch.device_window`)
        if own_window:
            launch.window = [self.clock.mark()]  # before the step's first kernel
        with phase("launch"):
            with phase("gpu_prefill"):
                launch.enqueue_prefills(self.loop, self.slots.of, self.references, timing, t0)
            step_s = launch.enqueue_decode(self.loop, timing, t0)
            if own_window:
                launch.window.append(self.clock.mark())  # after its last
        self.n_launched += 1
        wall = time.perf_counter() - t0
        if timing is None:  # the CPU: the device work ran synchronously inside the launch
            self.ledger.engine(wall)
            return max(wall - launch.prefill_s - step_s, 0.0), None
        wall -= timing.host_s  # the timing's own host time is the harness's
        self.ledger.engine(wall)
        self.starved_steps += timing.starved
        return wall, launch.enqueue

    def propose(self, rids: np.ndarray) -> float:
        """The CPU n-gram proposer over each request's committed tokens (after its step was settled)."""
        t0 = time.perf_counter()
        with phase("propose"):
            self.host.propose(rids, self.ngram_args)
        return self._leave(t0)

    def release(self, rids: np.ndarray) -> None:
        """Free the slots of requests the host saw finish (`engine.slots`)."""
        self.slots.release(rids)

    # ---------------------------------------------------------------- the device step

    def run(self, step: Step) -> StepTiming:
        """Wait for the real step, read it back and fill in its outcome; returns its measured timing."""
        start = self.ledger.mark()
        t0 = start[0]
        self.syncs.start_step(step.step)
        launch = self.launches.pop(step.step)
        with phase("readback"):
            # The wait is the GPU's time (gates included) and the host's wake-up, not its readback: it ends
            # before t_read.
            wake_s = launch.wait(self.loop, self.clock)
            if wake_s is not None:
                self.ledger.blocked(start)
            t_read = time.perf_counter()
            read = launch.read(self.loop)
            marks = launch.device_window(self.loop) if not self.hil else []
            # The step's tensors and events are the decode loop's: they are freed here, in its readback, not
            # wherever Python drops the last reference (frees are driver calls, slow on some hosts).
            del launch
            readback_s = self._leave(t0) - (t_read - t0)
        # The host's mirror and the step's outcome are the harness's own work: one compiled pass over the batch
        # writes the outcome into its table (a few dozen small array operations would cost more than the step's
        # own host phases on a slow host).
        b, out = step.batch, read.out
        decode_s = out.phase_s if out is not None else (0.0,) * 4
        if out is not None:
            self.host.read_back(b.table, out.packed)
        else:
            b.table[EMITTED] = b.table[COMPLETES]  # prefills only: a last chunk emits the request's first token
        if read.first is not None:
            self.host.first_tokens(np.asarray(read.first_rids), read.first[0], read.first[1])
        self.n_read += 1
        harness_s = self.ledger.outside(self.read_mark)
        self.read_mark = self.ledger.mark()
        # the device time of each enqueued part, in order (read where the launch returned its enqueue)
        parts_s = (*read.chunks_s, *(out.parts_s if out is not None else ()))
        return StepTiming(read.prefill_s + sum(decode_s), readback_s, parts_s, marks or None,
                          (read.prefill_s, *decode_s), self.syncs.count(step.step), harness_s, wake_s or 0.0)

    def device_seconds(self, marks: Sequence) -> tuple[float, ...]:
        """The real level's marks of a read-back step in host seconds (`MeasuredBackend`)."""
        return self.clock.seconds_of(marks)

    # ---------------------------------------------------------------- helpers

    def _leave(self, t0: float) -> float:
        """Seconds since `t0`, counted as time inside the backend."""
        dt = time.perf_counter() - t0
        self.ledger.engine(dt)
        return dt


# ---------------------------------------------------------------- a step's launch

class Readback(NamedTuple):
    """What a launch gave back: the decode step's output, the first tokens of the requests whose prefill ended
    (with their valid drafts) and the prefill chunks' device time."""

    out: StepOutput | None
    first: np.ndarray | None  # [2, n]: first tokens, their valid drafts
    first_rids: list[int]
    chunks_s: list[float]  # CUDA: each prefill chunk's device time (hil); the real level's, one for all its chunks
    prefill_s: float


@dataclass
class Launch:
    """What prep built for a step and what its launch enqueued."""

    decode_rids: np.ndarray
    k: int  # drafts each decode verifies at most: the step's k (its k schedule's for the batch)
    slots: np.ndarray | None = None
    lengths: np.ndarray | None = None
    drafts: np.ndarray | None = None
    prefills: list[tuple[int, int, bool, torch.Tensor]] = field(default_factory=list)  # rid, start, last chunk, ids
    result: StepResult | None = None
    first_rids: list[int] = field(default_factory=list)
    first_host: torch.Tensor | None = None
    # CUDA, steps with prefills: each chunk's start and end at hil, the first chunk's start at real; then, with no
    # decode step, the launch's end
    events: list = field(default_factory=list)
    enqueue: list[tuple[float, float]] = field(default_factory=list)  # CUDA: see `backend.Enqueue`
    window: list = field(default_factory=list)  # the real level on the CPU: clock marks before and after its work
    prefill_s: float = 0.0  # CPU: measured on the host

    def enqueue_prefills(self, loop: DecodeLoop, slot_of: np.ndarray, references: Sequence | None,
                         timing: PartTiming | None, t0: float) -> None:
        """Enqueue each prefill chunk (a last chunk also emits the first token and drafts, steered by its reference
        where given), then the first tokens' copy to the host; on CUDA each chunk is timed (`PartTiming`) and its
        enqueue noted relative to the launch's start `t0`."""
        firsts, valid = [], []
        for rid, start, last, ids in self.prefills:
            if timing is not None:
                timing.before(self.events)
            t = time.perf_counter()
            slot = int(slot_of[rid])
            if not last:
                loop.prefill_chunk(slot, ids, start)
            else:
                reference = references[rid] if references is not None else None
                firsts.append(loop.add_request(slot, ids, reference, cached=start))
                valid.append(loop.num_valid[slot : slot + 1].to(torch.int64))
                self.first_rids.append(rid)
            enqueue = time.perf_counter() - t
            if timing is None:
                self.prefill_s += enqueue  # on the CPU the work ran inside the call
            else:
                timing.after(enqueue)
                # A chunk through its prefill graph starts on the device when the graph's launch returned, after
                # the host staged its inputs (as the decode step's graph: `decode_enqueue`).
                launched = loop.prefill_launched()
                begin = (t if launched is None else launched) - t0 - timing.host_s
                self.enqueue.append((begin, t + enqueue - t0 - timing.host_s))
                timing.part_end(self.events)  # the chunk's end on the device (hil)
        if firsts:
            # copied before the decode step, whose end event then covers the copy too
            first = torch.stack([torch.cat(firsts), torch.cat(valid)])
            host = torch.empty(first.shape, dtype=torch.int64, pin_memory=loop.cuda)
            self.first_host = host.copy_(first, non_blocking=loop.cuda)

    def enqueue_decode(self, loop: DecodeLoop, timing: PartTiming | None, t0: float) -> float:
        """Enqueue the decode step, if any; returns its enqueue time."""
        step_s = 0.0
        if len(self.decode_rids):
            if timing is not None:
                timing.before(None)
            t = time.perf_counter()
            self.result = loop.step(self.slots, k=self.k, lengths=self.lengths, drafts=self.drafts)
            step_s = time.perf_counter() - t
            if timing is not None:
                timing.after(step_s)
                self.enqueue += decode_enqueue(loop, self.result, t0 + timing.host_s)
        if self.events and self.result is None:
            timing.mark(self.events)  # prefills only: their end, after the first tokens' copy (what readback waits for)
        return step_s

    def device_window(self, loop: DecodeLoop) -> list:
        """The real level's marks around the step's device work. On CUDA, events the step records anyway, since
        recording one costs the host 12-38 µs on the H100 machines, which the real loop's timeline would carry
        (results/host/real-loop/CONTENTS.md): a step with prefills, its first chunk's start and its end (what the
        readback waits for); a decode-only step, the decode loop's events around it (`DecodeLoop.span_marks`). On the
        CPU, the clock's own marks (`window`)."""
        if self.window:
            return self.window
        if self.events:
            return [self.events[0], self._end(loop)]
        return loop.span_marks(self.result) if self.result is not None else []

    def _end(self, loop: DecodeLoop):
        """The event after everything the launch enqueued on CUDA: the decode step's last, else the launch's own."""
        if self.result is not None:
            return loop.done_mark(self.result)
        return self.events[-1] if self.events else None  # None: the CPU, where the work ran inside the launch

    def wait(self, loop: DecodeLoop, clock: DeviceClock) -> float | None:
        """Block until the launch's device work is done; returns the host's wake-up (None: it did not block;
        `DeviceClock.wait`)."""
        last = self.window[-1] if self.window else self._end(loop)  # after everything the step enqueued
        return clock.wait(last)  # on the CPU, nothing to wait for: the work ran inside the launch

    def read(self, loop: DecodeLoop) -> Readback:
        """Read back what the launch computed (after `wait`)."""
        out = loop.readback(self.result) if self.result is not None else None
        first = self.first_host.numpy().copy() if self.first_host is not None else None
        marks = self.events  # pairs: each chunk's start and end (hil), or the first's start and the launch's end (real)
        if len(marks) == 1 and self.result is not None:  # the real level's chunks end where the decode step begins
            marks = [marks[0], loop.span_marks(self.result)[0]]
        chunks_s = [marks[i].elapsed_time(marks[i + 1]) / 1e3 for i in range(0, len(marks) - 1, 2)]
        return Readback(out, first, self.first_rids, chunks_s, self.prefill_s + sum(chunks_s))


def decode_enqueue(loop: DecodeLoop, result: StepResult, shift: float) -> list[tuple[float, float]]:
    """When the host enqueued each part of a decode step, relative to `shift`: between its marks. With CUDA graphs
    the graph's parts begin when its launch returned: the device cannot start a graph before it is launched whole,
    and the launch (with the inputs' copies before it) takes host time that the gated device time leaves out
    (docs/hil.md, "What hil still misses"). That is the forward's part with the verify graph, and every part with
    the step graphs (`engine.step_graph`)."""
    marks = loop.host_marks(result)
    parts = [(marks[i] - shift, marks[i + 1] - shift) for i in range(len(marks) - 1)]
    launched = loop.graph_launched(result)
    if launched is not None:
        first = 0 if loop.graphs is not None else FORWARD
        parts[first] = (launched - shift, parts[first][1])
    return parts
