"""The decode step captured whole (verify, steering, rejection sampling, commit, n-gram proposal, packing of the
results) as one CUDA graph per batch bucket, step k (each of the decode loop's `step_ks`: a k schedule's steps
verify the first k of the proposer's drafts) and steering variant; the proposer's k, the invalid-slot mode and the
proposer are fixed per decode loop.

An eager step enqueues dozens of small ops around the model's verify graph, about 1.1 ms of host time a step on
the H100 (docs/hil.md, "Where a decode step's time goes"). Here the host writes the step's inputs (slot ids, the
host's lengths or -1 for the device's own, the host's drafts, the sampler's seed) into a pinned block, copies it to
the bucket's static input buffer in one copy, launches the graph, and copies the graph's output back to pinned
memory in one copy. A bucket's padding rows take the scratch slot (the model's `pad_slot`, a row of every decode
tensor too) at length 1, so they write nowhere else.

A graph replays the same event nodes every time, and a step may be replayed again before the last one is read
back; so the part boundaries are timed by device timestamps (`kernels.clock`) written into the output ahead of
the packed rows, and they travel to the host in the same copy. Two events per ring entry around the whole step
add its copies and the graph's start to the first part (the verify's inputs).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from simharness.engine.decode_step import DecodeState, Staging, decode_step
from simharness.kernels import NO_DRAFT

# The seed of the captures' warm-up run (a replay takes each step's own from its inputs).
WARMUP_SEED = 1 << 62 | 1


@dataclass
class _StepGraph:
    graph: torch.cuda.CUDAGraph | None  # None on the CPU, where the step body runs as it is (tests of the staging)
    inputs: Tensor  # [size * (2 + k) + 1] int64 on the device: slots, lengths (-1: the device's), drafts, seed


class StepGraphs:
    """The step graphs of one decode loop, captured up front (capture synchronises) for every bucket and step k,
    largest first, in the model's graph pool: their intermediate tensors are dead between replays, so they share its
    memory."""

    def __init__(self, loop: DecodeState, stamps: int, max_batch: int | None = None):
        # A weak reference: no cycle, so a dropped loop is freed at once, not by the cyclic collector in the middle of
        # a later capture (freeing its graphs and events there would invalidate that capture).
        self.loop, self.stamps = weakref.proxy(loop), stamps
        # the buckets up to the first that holds `max_batch` (the most requests the loop's run has at once): a
        # model sized for 256 rows has 36 buckets, and a point of 8 users needs 4 of them
        buckets = loop.model.batch_buckets
        last = len(buckets) - 1 if max_batch is None else next((i for i, s in enumerate(buckets) if s >= max_batch),
                                                                 len(buckets) - 1)
        self.sizes = buckets[: last + 1]
        self.pad_slot = loop.model.pad_slot
        self.width = loop.k + 4  # packed columns per row, whatever the step's k
        # Written by every graph: the device's clock at each part boundary, then each row's packed results.
        self.output = torch.zeros(stamps + self.sizes[-1] * self.width, dtype=torch.int64, device=loop.device)
        self._graphs = {(size, k, steered): self._capture(size, k, steered) for size in reversed(self.sizes)
                        for k in sorted(loop.step_ks, reverse=True) for steered in (False, True)}  # fmt: skip

    @staticmethod
    def _input_size(size: int, k: int) -> int:
        return size * (2 + k) + 1

    def _capture(self, size: int, k: int, steered: bool) -> _StepGraph:
        block = torch.empty(self._input_size(size, k), dtype=torch.int64)
        self._fill_pads(block.numpy(), 0, size, k, WARMUP_SEED)
        step = _StepGraph(None, block.to(self.loop.device))
        if self.loop.cuda:  # the warm-up run and the capture touch the scratch slot only
            step.graph, _ = self.loop.model.capture(lambda: self._run(step.inputs, size, k, steered))
        return step

    def _fill_pads(self, block: np.ndarray, batch: int, size: int, k: int, seed: int) -> None:
        """Rows batch..size-1 of an input block as padding (the scratch slot at length 1, no drafts), and the seed."""
        block[batch:size] = self.pad_slot
        block[size + batch : 2 * size] = 1
        block[2 * size + batch * k : size * (2 + k)] = NO_DRAFT
        block[size * (2 + k)] = seed

    def _run(self, inputs: Tensor, size: int, k: int, steered: bool) -> None:
        """The step body over a bucket's static inputs (what each graph captured), stamps at the part boundaries."""
        loop = self.loop
        self._stamp(0)
        slots, given = inputs[:size], inputs[size : 2 * size]
        lengths = torch.where(given >= 0, given, loop.lengths[slots])
        host_drafts = k > 0 and not loop.device_proposer
        drafts = inputs[2 * size : size * (2 + k)].view(size, k) if host_drafts else None
        marks = iter(range(1, self.stamps))
        packed = self.output[self.stamps :].view(-1, self.width)
        decode_step(loop, slots, k, lengths, drafts, inputs[size * (2 + k) :], steered, packed,
                    loop.model.verify_logits, lambda: self._stamp(next(marks)))  # fmt: skip

    def _stamp(self, index: int) -> None:
        if self.loop.cuda:
            from simharness.kernels.clock import stamp  # Triton: only where a GPU kernel runs

            stamp(self.output, index)
        else:
            self.output[index] = time.perf_counter_ns()

    def new_staging(self) -> Staging:
        """A readback ring entry: pinned blocks for a step's inputs and for the copy of the graphs' output."""
        cuda = self.loop.cuda
        host = torch.zeros(self.output.shape, dtype=torch.int64, pin_memory=cuda)
        inputs = torch.zeros(self._input_size(self.sizes[-1], max(self.loop.step_ks)), dtype=torch.int64,
                             pin_memory=cuda)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else []  # the step's span
        return Staging(None, host, inputs, events=events)

    def launch(self, staging: Staging, slots, k: int, lengths, drafts, seed: int, steered: bool) -> int:
        """Stage a step's inputs, replay its graph (of its bucket and `k`), copy its output to `staging`; returns the
        batch size. Host values go in the one copy of the input block; device tensors are copied into the static
        buffer after it."""
        t0 = time.perf_counter()
        if staging.events and not staging.events[-1].query():
            staging.events[-1].synchronize()  # a ring entry's pinned blocks are not rewritten under its last copy
        batch = len(slots)
        size = next((s for s in self.sizes if s >= batch), None)
        if size is None:
            raise ValueError(f"a step of {batch} slots exceeds the step graphs' largest bucket, {self.sizes[-1]}")
        if staging.events:
            staging.events[0].record()
        block = staging.inputs.numpy()
        self._fill_pads(block, batch, size, k, seed)
        on_device = []
        for values, begin in ((slots, 0), (lengths, size), (drafts, 2 * size)):
            if values is None:
                block[begin : begin + batch * (k if begin == 2 * size else 1)] = -1  # lengths: the device's
            elif isinstance(values, Tensor) and values.device.type != "cpu":
                on_device.append((values.reshape(-1), begin))
            else:
                flat = np.asarray(values, dtype=np.int64).reshape(-1)
                block[begin : begin + flat.shape[0]] = flat
        step = self._graphs[(size, k, steered)]
        n = self._input_size(size, k)
        step.inputs.copy_(staging.inputs[:n], non_blocking=True)
        for values, begin in on_device:
            step.inputs[begin : begin + values.shape[0]].copy_(values)
        if step.graph is not None:
            step.graph.replay()
        else:
            self._run(step.inputs, size, k, steered)
        launched = time.perf_counter()
        n_out = self.stamps + batch * self.width
        staging.host[:n_out].copy_(self.output[:n_out], non_blocking=True)
        if staging.events:
            staging.events[-1].record()
        staging.times = [t0] + [launched] * (self.stamps - 1)
        staging.graph_launched = launched if step.graph is not None else None
        return batch

    def unpack(self, staging: Staging, batch: int) -> tuple[tuple[float, ...], np.ndarray]:
        """A finished step's part times in seconds (from its device timestamps) and packed rows [B, k+4], copied
        out of pinned memory. On CUDA the first part also takes what the step's span (events around its input
        copy, graph and output copy) holds beyond the stamped parts: the two copies and the graph's start."""
        flat = staging.host.numpy()
        stamps = flat[: self.stamps]
        parts = [float(stamps[i + 1] - stamps[i]) / 1e9 for i in range(self.stamps - 1)]
        if staging.events:
            span = staging.events[0].elapsed_time(staging.events[-1]) / 1e3
            parts[0] += max(span - sum(parts), 0.0)
        rows = flat[self.stamps : self.stamps + batch * self.width].reshape(batch, self.width)
        return tuple(parts), rows.copy()
