"""`engine.backend: torch`: the real decode loop behind the SimPy model (hardware in the loop).

The engine loop calls `prep` (build the step's inputs on the host, copy them to the device) and
`launch` (enqueue the prefills and the decode step) when it reaches those phases in virtual time;
the GPU stream calls `run_step` when the step starts there: it waits for the real step, reads it
back and returns the step's measured device time, which advances virtual time. Real work is
enqueued in launch order, so the device sees exactly the order of a FIFO stream, and the emitted
tokens and accepted counts are the rejection sampler's real output.

The host keeps a mirror of the device truth (committed tokens, valid drafts) updated from each
read-back step, as vLLM's engine does from its outputs; it is what the host may use at a sync.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from simharness.engine.checkpoint import load_checkpoint
from simharness.engine.decode import DecodeLoop, StepResult
from simharness.engine.model import Transformer
from simharness.instrument import SyncRecorder, phase
from simharness.jit import njit
from simharness.kernels.ngram import propose_ngram_row
from simharness.models import checkpoint_dir, model_config
from simharness.policy import ACCEPTED, COMPLETES, DRAFTS_VALID, EMITTED, PREFILL, REQ, VERIFIED, WASTED
from simharness.scenario import Engine, ScenarioError

# Rows of the host's mirror of the device truth, one table (a compiled call costs per argument): committed
# output tokens, valid drafts held for the next step (0 once no tokens are left), output and prompt lengths.
COMMITTED, NEXT_VALID, OUTPUT_LEN, PROMPT_LEN = range(4)
# Host enqueue times kept to size the GPU hold (see `TorchBackend.launch`), and the first guesses.
LAUNCH_WINDOW = 16
FIRST_STEP_ENQUEUE_S = 3e-3
FIRST_PREFILL_ENQUEUE_S = 10e-3


def resolve_device(engine: Engine) -> torch.device:
    """`engine.device` as a torch device; `auto` is CUDA when torch sees one."""
    if engine.device == "cuda" and not torch.cuda.is_available():
        raise ScenarioError("engine.device: cuda was asked for but torch sees no CUDA device")
    if engine.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(engine.device)


def build_model(engine: Engine, max_slots: int, max_len: int) -> Transformer:
    """The target model of `engine.model`: a checkpoint's, or a catalogue shape with random weights (every
    catalogue vocabulary holds the built-in tokenizer's ids)."""
    device = resolve_device(engine)
    graphs = engine.cuda_graphs and device.type == "cuda"
    checkpoint = checkpoint_dir(engine.model)
    if checkpoint is not None:
        return load_checkpoint(checkpoint, max_slots=max_slots, max_len=max_len, device=device, cuda_graphs=graphs)
    config = model_config(engine.model)
    return Transformer(config, max_slots=max_slots, max_len=max_len, device=device, cuda_graphs=graphs)


def capacity(sc, requests, depth: int, k: int) -> tuple[int, int]:
    """Cache slots and positions a point needs: its most concurrent requests, and its longest request
    plus the steps a finished request may still sit in (each up to 1 + k tokens) and one spare."""
    n = len(requests.prompt_len)
    slots = min(sc.scheduler.max_num_seqs, n)
    if sc.workload.arrival == "closed" or sc.workload.cap_concurrency:
        slots = min(slots, sc.workload.concurrency)
    longest = int((requests.prompt_len + requests.output_len).max())
    return slots, longest + (depth + 1) * (k + 1) + 1


def warm_up(sc, requests, model: Transformer, n: int = 20, tokens: int = 16) -> None:
    """Run a point's decode-loop configuration on its first `n` requests, cut to `tokens` output tokens,
    so that the kernels' first compilations (seconds each, per specialisation) do not land in measured
    steps. Triton specialises integer arguments on divisibility by 16, so the closed loop runs at
    concurrency 16 (batch sizes 1 to 16) and one prompt is cut to a multiple of 16 tokens."""
    from simharness.simulation import Simulation, resolve_mode

    m = min(n, len(requests.prompt_len))
    cut = np.minimum(requests.output_len[:m], tokens)
    prompt_len = requests.prompt_len[:m].copy()
    if prompt_len[0] > 16:
        prompt_len[0] -= prompt_len[0] % 16
    few = dataclasses.replace(
        requests,
        kind=requests.kind[:m],
        prompt_len=prompt_len,
        output_len=cut,
        prompt_tokens=[t[:p] for t, p in zip(requests.prompt_tokens[:m], prompt_len, strict=True)],
        output_tokens=[t[:c] for t, c in zip(requests.output_tokens[:m], cut, strict=True)],
        arrival_s=None,
    )
    workload = sc.workload.model_copy(update={"arrival": "closed", "concurrency": min(16, model.max_slots)})
    small = sc.model_copy(update={"workload": workload})
    backend = TorchBackend(small, few, model, resolve_mode(small), steer=sc.engine.steer)
    Simulation(small, few, None, backend=backend).run()


@dataclass
class _Launch:
    """What `prep` built for a step and what `launch` enqueued."""

    decode_rids: np.ndarray
    slots: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    drafts: torch.Tensor | None = None
    prefills: list[tuple[int, int, int, bool, torch.Tensor]] = field(default_factory=list)  # rid, start, end, last
    result: StepResult | None = None
    first_rids: list[int] = field(default_factory=list)
    first_device: torch.Tensor | None = None  # [2, n]: first tokens, their valid drafts
    first_host: torch.Tensor | None = None
    events: list = field(default_factory=list)  # CUDA, steps with prefills: each chunk's start and end, then the end
    prefill_s: float = 0.0  # CPU: measured on the host


class TorchBackend:
    """Runs each launched step on the real decode loop; durations and outcomes are measured."""

    measured = True

    def __init__(self, sc, requests, model: Transformer, mode, *, steer: bool = True):
        spec = sc.engine.speculation
        self.req = requests
        self.mode = mode
        self.k = mode.k
        self.steer = steer
        # synchronizing CUDA operations in the backend's calls; the runner records inside `with backend.syncs:`
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
        )
        self.ngram_args = {"min_n": spec.min_n, "max_n": spec.max_n, "k": mode.k, "tie_break": spec.tie_break}
        n = len(requests.prompt_len)
        # host mirror of the device truth, as of the last read-back step that held the request; the attributes
        # are views of its rows
        self.mirror = np.zeros((4, n), dtype=np.int64)
        self.mirror[OUTPUT_LEN], self.mirror[PROMPT_LEN] = requests.output_len, requests.prompt_len
        self.committed, self.next_valid = self.mirror[COMMITTED], self.mirror[NEXT_VALID]
        self.output_len, self.prompt_len = self.mirror[OUTPUT_LEN], self.mirror[PROMPT_LEN]
        slots, positions = capacity(sc, requests, mode.depth, mode.k)
        if slots > model.max_slots or positions > model.max_len:
            raise ValueError(f"the model's cache ({model.max_slots} x {model.max_len}) is smaller than this point "
                             f"needs ({slots} x {positions})")
        self.free_slots = list(range(model.max_slots - 1, -1, -1))
        self.slot = np.full(n, -1, dtype=np.int64)
        self.prefilled = np.zeros(n, dtype=np.int64)  # prompt tokens whose prefill was launched
        # prompt + generated tokens (host copy), as wide as the request's cache positions
        self.history = np.zeros((n, positions), dtype=np.int64)
        # The valid drafts a step verified: the device's count of the drafts it verified (pad: only valid ones,
        # as the CPU proposer's), or with fill (k slots verified, fillers among them) the device proposer's valid
        # count as of the previous read-back step, which the host mirrors.
        self.valid_from_mirror = self.loop.invalid == "fill"
        self.host_drafts = np.full((n, max(mode.k, 1)), -1, dtype=np.int64)  # CPU proposer's drafts
        self.launches: dict[int, _Launch] = {}
        self.n_launched = self.n_read = 0
        self.step_enqueue: deque[float] = deque([FIRST_STEP_ENQUEUE_S], maxlen=LAUNCH_WINDOW)
        self.prefill_enqueue: deque[float] = deque([FIRST_PREFILL_ENQUEUE_S], maxlen=LAUNCH_WINDOW)
        self.starved_steps = 0  # steps whose enqueue outlasted the hold: their device time may hold gaps
        self.sleep_cycles_per_s = _sleep_rate() if self.cuda else 0.0
        # harness overhead: wall time outside the engine's measured work (prep, launch, the readback wait and
        # copy, the CPU proposer), per read-back step
        self.inside = 0.0
        self.mark = time.perf_counter()
        self.held = 0.0  # host time of the GPU holds in the current launch (harness time, `_hold`)

    # ---------------------------------------------------------------- host view

    def valid_drafts(self) -> np.ndarray:
        """Valid drafts per request id as the host last read them (0 for finished ones); a view to read, not keep."""
        return self.next_valid

    def output_tokens(self, rid: int) -> np.ndarray:
        """The tokens request `rid` emitted (its first `output_len` generated tokens)."""
        p = self.prompt_len[rid]
        return self.history[rid, p : p + self.output_len[rid]]

    # ---------------------------------------------------------------- engine-loop phases (measured)

    def prep(self, step) -> float:
        """Build the step's device inputs: slot ids, positions (wait policy), CPU drafts, prompt chunks."""
        t0 = time.perf_counter()
        self.syncs.start_step(step.id)
        with phase("prep"):
            b = step.batch
            launch = _Launch(decode_rids=b.req[b.decode])
            for i in np.flatnonzero(b.prefill):
                rid, start = int(b.req[i]), int(self.prefilled[b.req[i]])
                if self.slot[rid] < 0:  # its first chunk
                    self.slot[rid] = self.free_slots.pop()
                    self.history[rid, : self.prompt_len[rid]] = self.req.prompt_tokens[rid]
                end = start + int(b.tokens[i])
                self.prefilled[rid] = end
                last = bool(b.completes_prefill[i])
                # the whole prompt goes along with the last chunk (add_request writes the history)
                ids = self.req.prompt_tokens[rid] if last else self.req.prompt_tokens[rid][start:end]
                launch.prefills.append((rid, start, end, last, self._to_device(ids)))
            r = launch.decode_rids
            if len(r):
                launch.slots = self._to_device(self.slot[r])
                if not self.mode.optimistic and self.n_read == self.n_launched:
                    # the host has read every step's accepted counts: it sends exact positions
                    launch.lengths = self._to_device(self.prompt_len[r] + self.committed[r])
                if self.mode.ngram_cpu:
                    launch.drafts = self._to_device(self.host_drafts[r, : self.k]).view(len(r), self.k)
            self.launches[step.id] = launch
        return self._leave(t0)

    def launch(self, step) -> float:
        """Enqueue the step's prefills and decode step on the device; returns the host's enqueue time."""
        launch = self.launches[step.id]
        t0 = time.perf_counter()
        self.syncs.start_step(step.id)
        self.held = 0.0  # the holds and their events (`_hold`, `_record_end`) are left out of the measured launch
        starved = False
        with phase("launch"):
            with phase("gpu_prefill"):
                firsts, valid = [], []
                for rid, start, _end, last, ids in launch.prefills:
                    if self.cuda:
                        hold = self._hold(self.prefill_enqueue, launch.events)
                    t = time.perf_counter()
                    slot = int(self.slot[rid])
                    if not last:
                        self.loop.prefill_chunk(slot, ids, start)
                    else:
                        reference = self.req.output_tokens[rid] if self.steer else None
                        firsts.append(self.loop.add_request(slot, ids, reference, cached=start))
                        valid.append(self.loop.num_valid[slot : slot + 1].to(torch.int64))
                        launch.first_rids.append(rid)
                    enqueue = time.perf_counter() - t
                    self.prefill_enqueue.append(enqueue)
                    if self.cuda:
                        starved |= enqueue > hold
                        self._record_end(launch.events)  # the chunk's end on the device
                    else:
                        launch.prefill_s += enqueue  # on the CPU the work ran inside the call
                if firsts:
                    launch.first_device = torch.stack([torch.cat(firsts), torch.cat(valid)])
            step_s = 0.0
            if len(launch.decode_rids):
                if self.cuda:
                    hold = self._hold(self.step_enqueue)  # the decode loop's own events time the step's phases
                t = time.perf_counter()
                launch.result = self.loop.step(launch.slots, lengths=launch.lengths, drafts=launch.drafts)
                step_s = time.perf_counter() - t
                self.step_enqueue.append(step_s)
                if self.cuda:
                    starved |= step_s > hold
            if launch.first_device is not None:
                host = torch.empty(launch.first_device.shape, dtype=torch.int64, pin_memory=self.cuda)
                launch.first_host = host.copy_(launch.first_device, non_blocking=self.cuda)
            if launch.events:
                self._record_end(launch.events)  # after the first tokens' copy: what the readback waits for
        self.n_launched += 1
        wall = time.perf_counter() - t0 - self.held
        self.inside += wall
        if self.cuda:
            self.starved_steps += starved
            return wall
        # On the CPU the device work ran synchronously inside the launch; it is timed as the device phases.
        return max(wall - launch.prefill_s - step_s, 0.0)

    def _hold(self, enqueue: deque[float], events: list | None = None) -> float:
        """Hold the GPU (a spin kernel) while the host enqueues the next part of a step (a prefill chunk, or the
        decode step), so that device events time its work alone, not gaps where the GPU waited for launches (~30
        us each, eager); with `events`, record the part's start there. Returns the hold's seconds.

        Three times the fastest recent enqueue of such parts, plus 0.5 ms. Not the median: an enqueue the host
        spent blocked (a kernel's first compilation, or a full launch queue behind earlier holds) would grow
        the next hold, which makes the GPU fall further behind and the next enqueue block longer. On the H100
        that feedback gave a step prefilling about a dozen prompts (~60 ms of device work) 1.2-1.5 s of launch,
        and with one hold per chunk it ran away. A step whose enqueue still outlasts its hold is counted in
        `starved_steps`.

        Each prefill chunk gets its own hold, and before it the host waits for the chunk two back to end: a
        CUDA stream queues a bounded number of launches (about a thousand kernels, some six eager chunks), and
        a host blocked on a full queue would time the holds' spinning as its launch. A decode-only step gets
        the spin kernel alone: every CUDA call is tens of µs of harness time on a slow host. The hold's host
        time, that wait included, is added to `held` (harness time)."""
        t = time.perf_counter()
        if events is not None and len(events) >= 4:
            events[-3].synchronize()  # the end of the chunk two back
        hold = 3.0 * min(enqueue) + 5e-4
        torch.cuda._sleep(int(hold * self.sleep_cycles_per_s))
        if events is not None:
            _record(events)
        self.held += time.perf_counter() - t
        return hold

    def _record_end(self, events: list) -> None:
        """Record the end of a part of a step in `events` (CUDA); like the hold, harness time added to `held`."""
        t = time.perf_counter()
        _record(events)
        self.held += time.perf_counter() - t

    def propose(self, rids: np.ndarray) -> float:
        """The CPU n-gram proposer over each request's committed tokens (after its step was settled)."""
        t0 = time.perf_counter()
        with phase("propose"):
            k = self.k
            for rid in rids:
                n = self.prompt_len[rid] + self.committed[rid]
                drafts = propose_ngram_row(self.history[rid, :n], **self.ngram_args)
                self.host_drafts[rid, :k] = -1
                self.host_drafts[rid, : len(drafts)] = drafts
                self.next_valid[rid] = len(drafts)
        return self._leave(t0)

    def release(self, rids: np.ndarray) -> None:
        """Free the slots of requests the host saw finish. Every step that holds them was launched
        before, and the next owner's prefill is launched after, so FIFO order keeps the slot safe."""
        if len(rids):  # most steps finish no request
            self.free_slots.extend(self.slot[rids].tolist())
            self.slot[rids] = -1

    # ---------------------------------------------------------------- GPU stream

    def run_step(self, step) -> float:
        """Wait for the real step, read it back, fill in its outcome; returns its device seconds."""
        t0 = time.perf_counter()
        self.syncs.start_step(step.id)
        launch = self.launches.pop(step.id)
        b = step.batch
        with phase("readback"):
            # The wait is the GPU's time (the hold's spin included), not the host's readback: it ends before t_read.
            if launch.events:
                launch.events[-1].synchronize()  # the step, its readback copy and the first tokens' copy
            elif launch.result is not None:
                self.loop.wait(launch.result)
            t_read = time.perf_counter()
            out = self.loop.readback(launch.result) if launch.result is not None else None
            first = launch.first_host.numpy().copy() if launch.first_host is not None else None
            marks = launch.events  # CUDA: each prefill chunk's start and end, then the step's end
            chunks_ms = sum(marks[i].elapsed_time(marks[i + 1]) for i in range(0, len(marks) - 1, 2))
            prefill_s = launch.prefill_s + chunks_ms / 1e3
            first_rids = launch.first_rids
            # The step's tensors and events are the decode loop's: they are freed here, in its readback, not
            # wherever Python drops the last reference (a free returns memory to torch's caching allocators and
            # destroys events, driver calls that are slow on some hosts).
            del launch
            step.readback_s = self._leave(t0) - (t_read - t0)
        # The host's mirror and the step's outcome are the harness's own work, like the SimPy model's: one
        # compiled pass over the batch writes the outcome into its table, since a few dozen small array
        # operations would cost more than the step's own host phases on a slow host.
        if out is not None:
            read_back(b.table, out.packed, self.k, self.valid_from_mirror, self.mirror, self.history)
            device_phases = (prefill_s, *out.phase_s.values())  # the step records' order: prefill, then decode's PHASES
        else:
            b.table[EMITTED] = b.table[COMPLETES]  # prefills only: a last chunk emits the request's first token
            device_phases = (prefill_s, 0.0, 0.0, 0.0, 0.0)
        if first is not None:
            rids = np.asarray(first_rids)
            self.history[rids, self.prompt_len[rids]] = first[0]
            self.committed[rids] = 1
            self.next_valid[rids] = first[1] * (self.output_len[rids] > 1)
        self.n_read += 1
        step.device_phases = device_phases
        step.device_syncs = self.syncs.count(step.id)
        now = time.perf_counter()
        step.harness_s = (now - self.mark) - self.inside
        self.mark, self.inside = now, 0.0
        return float(sum(device_phases))

    # ---------------------------------------------------------------- helpers

    def _to_device(self, values) -> torch.Tensor:
        t = torch.as_tensor(np.ascontiguousarray(values), dtype=torch.int64)
        if self.cuda:
            return t.pin_memory().to(self.loop.device, non_blocking=True)
        return t

    def _leave(self, t0: float) -> float:
        """Seconds since `t0`, counted as time inside the backend."""
        dt = time.perf_counter() - t0
        self.inside += dt
        return dt


def _record(events: list) -> None:
    """Record a new timing event on the current stream and append it to `events`."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    events.append(event)


_SLEEP_RATE: list[float] = []


def _sleep_rate() -> float:
    """GPU clock cycles per second of `torch.cuda._sleep`, measured once per process."""
    if not _SLEEP_RATE:
        cycles = 10_000_000
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)  # warm-up
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _SLEEP_RATE.append(cycles / (start.elapsed_time(end) / 1e3))
    return _SLEEP_RATE[0]


@njit
def read_back(
    table: np.ndarray, packed: np.ndarray, k: int, valid_from_mirror: bool, mirror: np.ndarray, history: np.ndarray
) -> None:
    """Fill a read-back step's outcome rows in its batch table and apply its tokens to the host's mirror.

    The device reports decoding requests in batch order (row i of `packed`, whose columns are `StepOutput`'s
    tokens, num_emitted, num_drafts and new_valid): request r emitted num_emitted[i] tokens, verified
    num_drafts[i] drafts (or, with `valid_from_mirror`, held next_valid[r] valid ones before this step) and now
    holds new_valid[i] (0 once it has no tokens left). A request that finished in an earlier step but sat in
    this one (no tokens left) emits and accepts nothing and wastes its 1 + slots positions. A prefill column
    emits its first token when its chunk is the last."""
    committed, next_valid = mirror[COMMITTED], mirror[NEXT_VALID]
    output_len, prompt_len = mirror[OUTPUT_LEN], mirror[PROMPT_LEN]
    tokens, num_emitted = packed[:, : k + 1], packed[:, k + 1]
    num_drafts, new_valid = packed[:, k + 2], packed[:, k + 3]
    i = 0
    for c in range(table.shape[1]):
        if table[PREFILL, c]:
            table[EMITTED, c] = table[COMPLETES, c]
            continue
        rid = table[REQ, c]
        before = committed[rid]
        remaining = output_len[rid] - before
        e = num_emitted[i]
        if remaining > 0:
            valid = next_valid[rid] if valid_from_mirror else num_drafts[i]
            table[EMITTED, c] = min(e, remaining)
            table[ACCEPTED, c] = e - 1
            table[DRAFTS_VALID, c] = min(valid, table[VERIFIED, c])
        else:
            table[WASTED, c] = 1 + table[VERIFIED, c]
        start = prompt_len[rid] + before
        for j in range(e):
            history[rid, start + j] = tokens[i, j]
        committed[rid] = before + e
        next_valid[rid] = new_valid[i] if committed[rid] < output_len[rid] else 0
        i += 1
