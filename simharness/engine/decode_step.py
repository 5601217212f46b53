"""The decode step's device work, shared by the eager step (`engine.decode`) and the step graphs
(`engine.step_graph`, which capture it): verify each slot's last token and drafts, sample, commit, propose."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from simharness.engine.model import steer_logits
from simharness.kernels import NO_DRAFT
from simharness.kernels.ngram import propose_ngram
from simharness.kernels.rejection import rejection_sample
from simharness.phases import phase

# Reference logit = row max + 30: at temperature 1 over a 128k vocabulary the rest holds < 2e-8 of the mass.
STEER_MARGIN = 30.0


@dataclass
class Staging:
    """One readback ring entry: where a step's results land in pinned host memory, and its marks.

    Eager: `device` holds the packed results [max_slots, k+4], `host` their pinned copy, `events` a CUDA event per
    part boundary (MARKS), then one after the copy. Step graphs (`engine.step_graph`): `host` is the flat copy of
    the graphs' output (MARKS device timestamps, then the packed rows), `inputs` the pinned block of the step's
    inputs, and two events span the step."""

    device: Tensor | None
    host: Tensor
    inputs: Tensor | None = None
    events: list = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # host perf_counter at the part marks (MARKS; CPU: the parts)
    graph_launched: float | None = None  # with CUDA graphs: host perf_counter when a graph's launch returned
    step_id: int = -1



class DecodeState(Protocol):
    """What the step reads and writes of its decode loop (`engine.decode.DecodeLoop`): its shape and its per-slot
    device state (one row per cache slot)."""

    k: int  # the proposer's drafts per row (its limit); a step verifies the first 0..k of them
    step_ks: tuple[int, ...]  # the ks steps may verify (the step graphs are captured for each)
    max_len: int
    model: Any  # engine.model.Transformer: batch_buckets, pad_slot, capture, verify_logits
    device: torch.device
    cuda: bool
    device_proposer: bool
    invalid: Literal["pad", "fill"]
    propose_args: dict
    history: Tensor
    lengths: Tensor
    prompt_lens: Tensor
    reference: Tensor
    reference_lens: Tensor
    drafts: Tensor  # [rows, k]
    num_valid: Tensor
    temperature: Tensor
    positions: Tensor  # 0..k
    all_drafts: Tensor  # k per row

    def to_device(self, ids) -> Tensor:
        ...


def decode_step(
    loop: DecodeState, slots: Tensor, k: int, lengths: Tensor, drafts: Tensor | None, seed: int | Tensor,
    steered: bool, packed: Tensor, verify: Callable[[Tensor, Tensor, Tensor], Tensor], mark: Callable[[], None],
) -> None:  # fmt: skip
    """The step's device work, shared by the eager step and the step graphs: from the slots' committed
    `lengths` (and the host's `drafts` [B, k], else the first k of the device's), verify 1 + k tokens per row,
    sample with `seed`, commit and propose (the proposer's loop.k drafts), and write the packed results to
    `packed[:B]` (loop.k + 4 columns whatever the step's k). `verify` runs the model, `mark` ends each part."""
    width, max_len = loop.k, loop.max_len
    positions = loop.positions[: k + 1]
    with phase("gpu_verify"):
        start = lengths - 1
        row_base = slots * max_len
        last = torch.take(loop.history, row_base + start)
        if drafts is None:
            drafts = loop.drafts[slots] if k == width else loop.drafts[slots, :k]
        if not loop.device_proposer:
            num_drafts = (drafts != NO_DRAFT).sum(dim=1, dtype=torch.int32)
        else:
            num_drafts = loop.num_valid[slots] if loop.invalid == "pad" else loop.all_drafts[: slots.shape[0]]
            if k < width:  # a step verifies the first k drafts (a k schedule's step)
                num_drafts = num_drafts.clamp(max=k)
        # NO_DRAFT is no token id: the model sees the last token there, the sampler still sees it (rejected).
        model_drafts = torch.where(drafts == NO_DRAFT, last[:, None], drafts) if k else drafts
        mark()  # the forward's own part: a graph replay enqueued last is not spread out
        logits = verify(torch.cat([last[:, None], model_drafts], dim=1), slots, start)
        logits = logits.view(slots.shape[0], k + 1, -1)
        if steered:
            # Row position t predicts committed index length + t, i.e. reference index length + t - prompt.
            ref_index = (lengths - loop.prompt_lens[slots])[:, None] + positions
            ref_tokens = torch.take(loop.reference, row_base[:, None] + ref_index.clamp(max=max_len - 1))
            ref_tokens = torch.where(ref_index < loop.reference_lens[slots][:, None], ref_tokens, NO_DRAFT)
            steer_logits(logits, ref_tokens, STEER_MARGIN)
        mark()

    with phase("gpu_sample"):
        output, num_emitted = rejection_sample(logits, drafts, num_drafts, loop.temperature[slots], seed=seed)
        mark()

    with phase("gpu_commit"):
        # Commit with gather / where / scatter (no boolean indexing, which would sync): positions past
        # the emitted tokens get their old values back.
        index = row_base[:, None] + (lengths[:, None] + positions).clamp(max=max_len - 1)
        keep = positions < num_emitted[:, None]
        values = torch.where(keep, output, torch.take(loop.history, index))
        loop.history.view(-1).index_copy_(0, index.view(-1), values.view(-1))
        new_lengths = lengths + num_emitted
        loop.lengths.index_copy_(0, slots, new_lengths)
        mark()

    with phase("gpu_propose"):
        if loop.device_proposer:
            new_drafts, new_valid = propose_ngram(loop.history[slots], new_lengths, **loop.propose_args)
            loop.drafts.index_copy_(0, slots, new_drafts)
            loop.num_valid.index_copy_(0, slots, new_valid)
        mark()

    batch = slots.shape[0]
    packed[:batch, : k + 1] = output
    if k < width:
        packed[:batch, k + 1 : width + 1] = -1  # no tokens past the step's k + 1
    packed[:batch, width + 1] = num_emitted
    packed[:batch, width + 2] = num_drafts
    if loop.device_proposer:
        packed[:batch, width + 3] = new_valid

