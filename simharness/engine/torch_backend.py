"""The real decode loop behind the engine loop: the measured levels (`engine.level: hil` and `real`).

The engine loop calls `prep` (build the step's inputs on the host; prompt chunks go to the device there, the
decode step's inputs in one copy with its launch) and `launch` (enqueue the prefills and the decode step) when
it reaches those phases, and `run` when it needs the step's outcome: `run` waits for the real step, reads it back
and returns the step's measured device time.
At the hil level that is when the step starts in virtual time (which its device time then advances), at
the real level when the host blocks on it. Real work is enqueued in launch order, so the device sees the
order of a FIFO stream, and the emitted tokens and accepted counts are the rejection sampler's real output.

The host keeps a mirror of the device truth (`engine.mirror`: committed tokens, valid drafts) updated from
each read-back step, as vLLM's engine does from its outputs; it is what the host may use at a sync.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from simharness.backend import Enqueue, StepTiming
from simharness.engine.decode import DecodeLoop
from simharness.engine.host_work import SYNC_OPS, Allocations
from simharness.engine.launch import Launch
from simharness.engine.mirror import HostMirror
from simharness.engine.model import Transformer
from simharness.engine.slots import Slots
from simharness.engine.timing import DeviceClock, PartTiming
from simharness.instrument import SyncRecorder, phase
from simharness.ledger import HostLedger
from simharness.modes import Mode
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
            step_ks=[k for _, k in mode.k_schedule] or None,  # a k schedule's steps verify their own k
        )
        self.references = requests.output_tokens if steer else None  # what a first token is steered to
        self.ngram_args = {"min_n": spec.min_n, "max_n": spec.max_n, "k": mode.k, "tie_break": spec.tie_break}
        n = len(requests.prompt_len)
        slots, positions = capacity(sc, requests, mode)
        if slots > model.max_slots or positions > model.max_len:
            raise ValueError(f"the model's cache ({model.max_slots} x {model.max_len}) is smaller than this point "
                             f"needs ({slots} x {positions})")
        self.slots = Slots(n, model.max_slots)
        self.host = HostMirror(requests, positions, mode.k, valid_from_mirror=self.loop.invalid == "fill")
        self.launches: dict[int, Launch] = {}
        self.n_launched = self.n_read = 0
        self.hil = gate
        self.timing = PartTiming(gate) if self.cuda else None
        self.clock = None if gate else DeviceClock(self.cuda)  # the real level's device timestamps
        self.starved_steps = 0  # steps whose enqueue may have outlasted a gate: their device time may hold gaps
        # The engine's host time (every phase here; the real level adds its modelled phases): the harness's own
        # time per read-back step is the wall time since the last read-back outside it.
        self.ledger = HostLedger()
        self.read_mark = self.ledger.mark()
        self.allocations = Allocations(sc.engine.gc.heap_objects, sc.engine.gc.allocations_per_step)
        self.random = requests.random  # rows sampled at temperature 1 (None: every row greedy)

    def start_clock(self) -> None:
        """Anchor the real level's device timestamps now, at the wall clock's start (`MeasuredBackend`)."""
        if self.clock is not None:
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
                launch.prefills.append((rid, start, last, self._to_device(ids)))
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
        if self.clock is not None:
            launch.window = [self.clock.mark()]  # before the step's first kernel
        with phase("launch"):
            with phase("gpu_prefill"):
                launch.enqueue_prefills(self.loop, self.slots.of, self.references, timing, t0)
            step_s = launch.enqueue_decode(self.loop, timing, t0)
            if self.clock is not None:
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
        t0 = time.perf_counter()
        self.syncs.start_step(step.step)
        launch = self.launches.pop(step.step)
        with phase("readback"):
            # The wait is the GPU's time (gates included), not the host's readback: it ends before t_read.
            launch.wait(self.loop)
            t_read = time.perf_counter()
            read = launch.read(self.loop, self.clock)
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
        return StepTiming(read.prefill_s + sum(decode_s), readback_s, parts_s, read.window,
                          (read.prefill_s, *decode_s), self.syncs.count(step.step), harness_s)

    # ---------------------------------------------------------------- helpers

    def _to_device(self, values) -> torch.Tensor:
        t = torch.as_tensor(np.ascontiguousarray(values), dtype=torch.int64)
        if self.cuda:
            return t.pin_memory().to(self.loop.device, non_blocking=True)
        return t

    def _leave(self, t0: float) -> float:
        """Seconds since `t0`, counted as time inside the backend."""
        dt = time.perf_counter() - t0
        self.ledger.engine(dt)
        return dt
