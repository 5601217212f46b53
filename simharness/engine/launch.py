"""A step's launch on the real decode loop: what prep builds for it, its enqueue part by part (each part timed on
CUDA, `engine.timing`), and the wait for and readback of everything it enqueued."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from simharness.engine.decode import FORWARD, DecodeLoop, StepOutput, StepResult
from simharness.engine.timing import DeviceClock, PartTiming


class Readback(NamedTuple):
    """What a launch gave back: the decode step's output, the first tokens of the requests whose prefill ended
    (with their valid drafts) and the prefill chunks' device time; on the real level's clock, the device window."""

    out: StepOutput | None
    first: np.ndarray | None  # [2, n]: first tokens, their valid drafts
    first_rids: list[int]
    chunks_s: list[float]  # CUDA: each prefill chunk's device time
    prefill_s: float
    window: tuple[float, ...] | None


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
    first_device: torch.Tensor | None = None  # [2, n]: first tokens, their valid drafts
    first_host: torch.Tensor | None = None
    events: list = field(default_factory=list)  # CUDA, steps with prefills: each chunk's start and end, then the end
    enqueue: list[tuple[float, float]] = field(default_factory=list)  # CUDA: see `backend.Enqueue`
    window: list = field(default_factory=list)  # with a device clock: marks before and after the step's work
    prefill_s: float = 0.0  # CPU: measured on the host

    def enqueue_prefills(self, loop: DecodeLoop, slot_of: np.ndarray, references: Sequence | None,
                         timing: PartTiming | None, t0: float) -> None:
        """Enqueue each prefill chunk (a last chunk also emits the first token and drafts, steered by its reference
        where given); on CUDA each is timed by its own start and end events, and its enqueue noted relative to the
        launch's start `t0`."""
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
                begin = t - t0 - timing.host_s
                self.enqueue.append((begin, begin + enqueue))
                timing.mark(self.events)  # the chunk's end on the device
        if firsts:
            self.first_device = torch.stack([torch.cat(firsts), torch.cat(valid)])

    def enqueue_decode(self, loop: DecodeLoop, timing: PartTiming | None, t0: float) -> float:
        """Enqueue the decode step, if any, then the first tokens' copy to the host; returns the step's enqueue
        time."""
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
        if self.first_device is not None:
            host = torch.empty(self.first_device.shape, dtype=torch.int64, pin_memory=loop.cuda)
            self.first_host = host.copy_(self.first_device, non_blocking=loop.cuda)
        if self.events:
            timing.mark(self.events)  # after the first tokens' copy: what the readback waits for
        return step_s

    def wait(self, loop: DecodeLoop) -> None:
        """Block until the launch's device work is done."""
        if self.window and loop.cuda:
            self.window[-1].synchronize()  # after everything the step enqueued
        elif self.events:
            self.events[-1].synchronize()  # the step, its readback copy and the first tokens' copy
        elif self.result is not None:
            loop.wait(self.result)

    def read(self, loop: DecodeLoop, clock: DeviceClock | None) -> Readback:
        """Read back what the launch computed (after `wait`)."""
        window = tuple(clock.seconds(m) for m in self.window) if self.window else None
        out = loop.readback(self.result) if self.result is not None else None
        first = self.first_host.numpy().copy() if self.first_host is not None else None
        marks = self.events  # CUDA: each prefill chunk's start and end, then the step's end
        chunks_s = [marks[i].elapsed_time(marks[i + 1]) / 1e3 for i in range(0, len(marks) - 1, 2)]
        return Readback(out, first, self.first_rids, chunks_s, self.prefill_s + sum(chunks_s), window)


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
