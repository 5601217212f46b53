"""The real speculative decode loop: verify, rejection-sample, commit, propose, all on the device.

MRV2 style (docs/vllm-notes.md, "N-gram proposer (GPU)" and "Async scheduling and the optimistic correction"): the
device tensors are the truth. Per slot the loop keeps the committed token history, its length, the drafts proposed
for the next step and an optional reference continuation, so step N+1 can be launched without the host having read
step N's result. `readback` is the one device-to-host copy and the one sync of a step; a scheduler may defer it
(async depth >= 2).

Cache invariant: a slot with committed length n has K/V for positions 0..n-2 in the model's cache; its
last committed token is fed at position n-1 together with the k drafts. Rejected drafts' K/V stay past
the new length, masked by causality and overwritten by the next step.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from simharness.engine.decode_step import Staging
from simharness.engine.eager_step import EagerSteps
from simharness.engine.model import Transformer
from simharness.engine.step_graph import StepGraphs
from simharness.kernels import NO_DRAFT
from simharness.kernels.ngram import propose_ngram
from simharness.kernels.rejection import rejection_sample
from simharness.records import DEVICE_PHASES

PHASES = DEVICE_PHASES[1:]  # the decode step's device phases, in order (a step's prefill chunks come first)
# Part boundaries of a decode step: its start, the verify's forward, then the end of each of PHASES.
MARKS = len(PHASES) + 2
FORWARD = 1  # the verify forward's part, after its inputs'
# Steps that may be launched and not yet read back: async queue depth (<= 3 in vLLM) plus one.
READBACK_RING = 4


@dataclass
class StepResult:
    """A launched step; `DecodeLoop.readback` turns it into host values once `DecodeLoop.wait` returned."""

    batch: int
    step_id: int
    ring_index: int


@dataclass
class StepOutput:
    """A step's results on the host, and its per-phase device times in seconds."""

    tokens: np.ndarray  # [B, k+1] int64, -1 after the last emitted token
    num_emitted: np.ndarray  # [B]
    num_drafts: np.ndarray  # [B]
    next_valid: np.ndarray  # [B]: valid drafts proposed for the next step (0 without a device proposer)
    phase_s: tuple[float, ...]  # per PHASES
    parts_s: tuple[float, ...]  # per part: the verify's inputs, its forward, then PHASES[1:]
    packed: np.ndarray  # [B, k+4]: the four above side by side (they are its views), for one compiled call


class DecodeLoop:
    """Speculative decoding over the model's cache slots with the n-gram proposer and rejection sampler.

    `k = 0` is plain decoding. A step verifies `k` drafts per row, or, given its own k (one of `step_ks`, each
    0..k: a k schedule's), the first that many of the proposer's k; at 0 it is a plain decode step (one token per
    row, nothing to reject), the proposer still drafting k for the next. `invalid="pad"` verifies invalid draft
    slots as -1 (always rejected; the model sees the last token there), `"fill"` verifies the proposer's filler
    token as an ordinary draft. With `device_proposer=False` the drafts come from the host with every step (the CPU
    n-gram proposer). A slot may be stepped while its committed length + k <= max_len; at most `max_in_flight`
    steps may be launched and not yet read back. With `step_graphs` (default: the model's `cuda_graphs`) each step
    replays the whole step captured as one CUDA graph per batch bucket and step k (`engine.step_graph`), the buckets
    up to the one that holds `max_batch` rows when given (a step of more then fails); without,
    the step's ops are enqueued one by one around the model's verify (a graph replay with `cuda_graphs`): the
    reference, and the CPU's path.
    """

    def __init__(
        self,
        model: Transformer,
        *,
        k: int,
        min_n: int,
        max_n: int,
        tie_break: Literal["earliest", "latest"] = "earliest",
        invalid: Literal["pad", "fill"] = "pad",
        seed: int = 0,
        device_proposer: bool = True,
        max_in_flight: int = READBACK_RING,
        step_graphs: bool | None = None,
        step_ks: Sequence[int] | None = None,
        max_batch: int | None = None,
    ):
        self.model, self.k, self.seed = model, k, seed
        self.step_ks = tuple(sorted(set(step_ks))) if step_ks is not None else (k,)
        if not all(0 <= sk <= k for sk in self.step_ks):
            raise ValueError(f"step ks {self.step_ks} must each be within 0..k = {k}")
        self.device_proposer = device_proposer and k > 0
        self.propose_args = {"min_n": min_n, "max_n": max_n, "k": k, "tie_break": tie_break, "invalid": invalid}
        self.invalid = invalid
        self.max_slots, self.max_len = model.max_slots, model.max_len
        self.device = device = model.device
        self.cuda = device.type == "cuda"
        # One row past the slots: the scratch slot (the model's pad_slot) where a graph's padding rows go.
        rows, length = self.max_slots + 1, self.max_len

        def longs(*shape: int, fill: int = 0) -> Tensor:
            return torch.full(shape, fill, dtype=torch.int64, device=device)

        self.history = longs(rows, length)  # committed tokens (prompt, then generated)
        self.lengths = longs(rows)  # committed length
        self.prompt_lens = longs(rows)
        self.reference = longs(rows, length, fill=NO_DRAFT)  # continuation to replay, from the first generated token
        self.reference_lens = longs(rows)  # 0: not steered
        self.drafts = longs(rows, k, fill=NO_DRAFT)  # proposed for the next step
        self.num_valid = torch.zeros(rows, dtype=torch.int32, device=device)
        self.temperature = torch.zeros(rows, dtype=torch.float32, device=device)
        self.positions = torch.arange(k + 1, device=device)
        self.all_drafts = torch.full((rows,), k, dtype=torch.int32, device=device)
        self._no_drafts = (longs(1, 0), torch.zeros(1, dtype=torch.int32, device=device))
        self._steered: set[int] = set()  # host mirror of reference_lens > 0: skip steering when empty
        self._step_id = 0
        self.graphs: StepGraphs | None = None
        if model.cuda_graphs if step_graphs is None else step_graphs:
            self.graphs = StepGraphs(self, stamps=MARKS, max_batch=max_batch)
        elif model.cuda_graphs:
            for sk in self.step_ks:
                model.capture_graphs(sk + 1)
        self.steps = self.graphs if self.graphs is not None else EagerSteps(self, MARKS)
        self._ring = [self.steps.new_staging() for _ in range(max_in_flight)]

    def to_device(self, ids: Sequence[int] | np.ndarray | Tensor) -> Tensor:
        """Token ids as a 1-D int64 device tensor; host data goes through pinned memory so that no
        pageable copy stalls the host on work already queued."""
        ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        if self.cuda and not ids.is_cuda:
            ids = ids.pin_memory().to(self.device, non_blocking=True)
        return ids.to(self.device)

    def seed_of(self, step_id: int) -> int:
        """The sampler's seed for a step. Bit 62 and bit 0 set: once so that Triton would not compile new variants
        for small or even seeds passed as arguments; kept so that seeds, and so sampled tokens, stay as before."""
        return hash((self.seed, step_id)) & 0x3FFF_FFFF_FFFF_FFFF | 1 << 62 | 1

    def add_request(
        self,
        slot: int,
        prompt_ids: Sequence[int] | Tensor,
        reference_ids: Sequence[int] | Tensor | None = None,
        temperature: float | None = None,
        cached: int = 0,
    ) -> Tensor:
        """Prefill `prompt_ids` into `slot` (all but its first `cached` tokens, which `prefill_chunk` wrote),
        emit the first token (reference[0] if a reference is given, else sampled from the last prompt
        position) and propose the first drafts. `temperature` None keeps the slot's (0 unless its caller set
        `temperature[slot]`; `remove_request` resets it). No host sync: returns the first token as a device tensor
        [1] for the caller to read at its next sync."""
        prompt = self.to_device(prompt_ids)
        n_prompt = prompt.shape[0]
        if n_prompt + 1 + self.k > self.max_len:
            raise ValueError(f"prompt of {n_prompt} tokens leaves no room for a step in max_len {self.max_len}")
        logits = self.model.prefill(slot, prompt[cached:], start=cached)
        # fill_ takes the scalar as a kernel argument; `t[i] = x` would copy a host scalar and sync.
        if temperature is not None:
            self.temperature[slot].fill_(temperature)
        if reference_ids is None:
            first, _ = rejection_sample(
                logits.view(1, 1, -1), *self._no_drafts, self.temperature[slot : slot + 1], seed=self.seed_of(-1 - slot)
            )
            self.reference_lens[slot].fill_(0)
            self._steered.discard(slot)
        else:
            reference = self.to_device(reference_ids)[: self.max_len]
            first = reference[:1]
            self.reference[slot, : reference.shape[0]] = reference
            self.reference_lens[slot].fill_(reference.shape[0])
            self._steered.add(slot)
        self.history[slot, :n_prompt] = prompt
        self.history[slot, n_prompt : n_prompt + 1] = first.view(1)
        self.lengths[slot].fill_(n_prompt + 1)
        self.prompt_lens[slot].fill_(n_prompt)
        if self.device_proposer:
            drafts, num_valid = propose_ngram(
                self.history[slot : slot + 1], self.lengths[slot : slot + 1], **self.propose_args
            )
            self.drafts[slot] = drafts[0]
            self.num_valid[slot] = num_valid[0]
        return first.view(1)

    def prefill_chunk(self, slot: int, chunk_ids: Sequence[int] | Tensor, start: int) -> None:
        """Write the K/V of prompt tokens start..start+len-1 of `slot` (a chunked prefill's earlier chunks)."""
        self.model.prefill(slot, self.to_device(chunk_ids), start=start)

    def remove_request(self, slot: int) -> None:
        """Free a slot; its cache rows are simply overwritten by the next request's prefill."""
        self.lengths[slot].fill_(0)
        self.reference_lens[slot].fill_(0)
        self.num_valid[slot].fill_(0)
        self.temperature[slot].fill_(0.0)
        self.drafts[slot].fill_(-1)
        self._steered.discard(slot)

    def step(
        self,
        slots: Sequence[int] | np.ndarray | Tensor,
        *,
        k: int | None = None,
        lengths: Sequence[int] | np.ndarray | Tensor | None = None,
        drafts: np.ndarray | Tensor | None = None,
    ) -> StepResult:
        """Verify each slot's last token + drafts (the first `k`, one of `step_ks`; default: the loop's k), sample,
        commit, propose the next drafts.

        `slots` are distinct slot ids (any subset, any order, changing every step), host values (one copy to the
        device with step graphs) or an int64 device tensor. Everything is launched on the device; nothing here
        waits for it. By default the device state is the truth: committed lengths (positions) and drafts are the
        device's own, which is the optimistic policy's GPU-side correction (docs/vllm-notes.md, "Async
        scheduling"). A host that knows better passes them: `lengths` [B] after reading the accepted counts (the
        `wait` policy), `drafts` [B, k] (NO_DRAFT = none) from the CPU proposer (then required).
        """
        k = self.k if k is None else k
        if k not in self.step_ks:
            raise ValueError(f"a step of k = {k}: this loop's steps verify k in {self.step_ks}")
        if k == 0:
            drafts = None  # plain decoding: nothing to verify
        elif (drafts is None) != self.device_proposer:
            raise ValueError("the host's drafts are needed without a device proposer, and taken only then")
        ring_index = self._step_id % len(self._ring)
        staging = self._ring[ring_index]
        batch = self.steps.launch(staging, slots, k, lengths, drafts, self.seed_of(self._step_id),
                                  bool(self._steered))
        staging.step_id = self._step_id
        self._step_id += 1
        return StepResult(batch, staging.step_id, ring_index)

    def host_marks(self, result: StepResult) -> list[float]:
        """The host's perf_counter at the step's part boundaries (its start, then the end of each part; with step
        graphs every part's enqueue ends when the graph's launch returned)."""
        return self._staging(result).times

    def prefill_launched(self) -> float | None:
        """With CUDA graphs, the host's perf_counter when the last prefill chunk's graph launch returned (in
        `prefill_chunk` or `add_request`): the chunk's device work runs from then, not from its call. Else None."""
        return self.model.prefill_launched

    def graph_launched(self, result: StepResult) -> float | None:
        """With CUDA graphs, the host's perf_counter when the graph's launch returned: the verify graph's (within
        the forward's part, after its inputs' copies) or the step graph's (every part). The graph runs once
        launched whole, so not before then. Else None."""
        return self._staging(result).graph_launched

    def wait(self, result: StepResult) -> None:
        """Block until the step and its copy to the host are done (CUDA; on the CPU it ran when launched)."""
        if self.cuda:
            self.done_mark(result).synchronize()

    def done_mark(self, result: StepResult) -> torch.cuda.Event | None:
        """The event after the step and its copy to the host (None on the CPU, where the step ran when launched)."""
        return self._staging(result).events[-1] if self.cuda else None

    def span_marks(self, result: StepResult) -> list:
        """The events around the whole step (its inputs' copy, graph and output copy; CUDA), for a caller that times
        its device window: they are recorded again when the ring entry is, `max_in_flight` steps later."""
        return self._staging(result).events

    def readback(self, result: StepResult) -> StepOutput:
        """Copy a finished step's tokens and counts to the host and read its phase times; call `wait` first (the
        one sync of a step, which a caller times apart from the readback)."""
        staging = self._staging(result)
        if self.cuda and not staging.events[-1].query():
            raise RuntimeError(f"step {result.step_id} read back before `wait` returned for it")
        parts_s, packed = self.steps.unpack(staging, result.batch)
        phase_s = (parts_s[0] + parts_s[1], *parts_s[2:])
        k = self.k
        tokens, emitted, drafts, valid = packed[:, : k + 1], packed[:, k + 1], packed[:, k + 2], packed[:, k + 3]
        return StepOutput(tokens, emitted, drafts, valid, phase_s, parts_s, packed)

    def _staging(self, result: StepResult) -> Staging:
        staging = self._ring[result.ring_index]
        if staging.step_id != result.step_id:
            raise RuntimeError(f"step {result.step_id} was overwritten: read back within {len(self._ring)} steps")
        return staging
