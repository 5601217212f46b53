"""The decode step enqueued op by op around the model's verify (a graph replay with the model's `cuda_graphs`): the
reference for the step captured whole (`engine.step_graph`, whose interface this shares), and the CPU's path. A
mark (a CUDA event and the host's time) at each part boundary times the parts."""

from __future__ import annotations

import time
import weakref

import numpy as np
import torch
from torch import Tensor

from simharness.engine.decode_step import DecodeState, Staging, decode_step


class EagerSteps:
    """The eager steps of one decode loop, which owns them; `marks`: part boundaries per step."""

    def __init__(self, loop: DecodeState, marks: int):
        self.loop, self.marks = weakref.proxy(loop), marks

    def new_staging(self) -> Staging:
        """A readback ring entry: the packed results [max_slots, k+4] on the device, their pinned copy, a CUDA event
        per part boundary, then one after the copy."""
        loop = self.loop
        packed = torch.zeros(loop.model.max_slots, loop.k + 4, dtype=torch.int64, device=loop.device)
        if not loop.cuda:  # on the CPU the packed results already are host memory
            return Staging(device=packed, host=packed)
        host = torch.zeros_like(packed, device="cpu").pin_memory()
        return Staging(packed, host, events=[torch.cuda.Event(enable_timing=True) for _ in range(self.marks + 1)])

    def launch(self, staging: Staging, slots, k: int, lengths, drafts, seed: int, steered: bool) -> int:
        """Enqueue the step's ops (verifying `k` drafts per row) one by one into `staging`; returns the batch size."""
        loop = self.loop
        staging.times, staging.graph_launched = [], None
        self._mark(staging)
        slots = loop.to_device(slots)
        lengths = loop.lengths[slots] if lengths is None else loop.to_device(lengths)
        if drafts is not None:
            drafts = loop.to_device(drafts).view(-1, k)

        def verify(tokens: Tensor, slots: Tensor, start: Tensor) -> Tensor:
            logits = loop.model.verify(tokens, slots, start)
            if loop.model.cuda_graphs:  # verify returns as soon as the graph's launch has
                staging.graph_launched = time.perf_counter()
            return logits

        decode_step(loop, slots, k, lengths, drafts, seed, steered, staging.device, verify,
                    lambda: self._mark(staging))
        batch = slots.shape[0]
        if loop.cuda:
            staging.host[:batch].copy_(staging.device[:batch], non_blocking=True)
            staging.events[self.marks].record()
        return batch

    def _mark(self, staging: Staging) -> None:
        """The next part boundary: a device event on CUDA, and the host's time (on CUDA, when the part's enqueue
        ended)."""
        if self.loop.cuda:
            staging.events[len(staging.times)].record()
        staging.times.append(time.perf_counter())

    def unpack(self, staging: Staging, batch: int) -> tuple[tuple[float, ...], np.ndarray]:
        """A finished step's part times in seconds (CUDA: between its events; CPU: between the host's marks) and
        packed rows [B, k+4], copied out of pinned memory."""
        if self.loop.cuda:
            marks = staging.events
            parts_s = tuple(marks[i].elapsed_time(marks[i + 1]) / 1e3 for i in range(self.marks - 1))
        else:
            marks = staging.times
            parts_s = tuple(marks[i + 1] - marks[i] for i in range(self.marks - 1))
        return parts_s, staging.host[:batch].numpy().copy()
