"""The real host work behind the seeds' what-ifs at the measured levels: #41043's per-step allocations under a
held heap, and the synchronizing operations of #38047 and of a `.item()` (docs/seeds.md)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from simharness.engine.decode_step import DecodeState
from simharness.engine.mirror import HostMirror


class Allocations:
    """The engine process's long-lived objects that a full collection traverses (`engine.gc.heap_objects`), and
    prep's per-step allocations (`engine.gc.allocations_per_step`)."""

    def __init__(self, heap_objects: int, per_step: int):
        self.heap = [[i] for i in range(heap_objects)]
        self.per_step = per_step

    def step(self, host: HostMirror, rids: np.ndarray) -> None:
        """vLLM's backup tokens before #41043: a `.tolist()`, a list comprehension and an array each step, here
        `per_step` one-item lists of the requests' last tokens and their array, dropped at once; CPython's
        collector runs whenever their count says so, inside the measured prep. `rids`: the step's decode rows
        (at least one)."""
        if not self.per_step:
            return
        last = (host.positions(rids) - 1).tolist()
        rows = [[int(host.history[rids[i % len(rids)], last[i % len(rids)]])] for i in range(self.per_step)]
        np.array(rows, dtype=np.int32)


def _bool_mask_index(loop: DecodeState) -> None:
    """#38047's sync: indexing a device tensor with a device boolean mask (the result's size needs its count)."""
    loop.lengths[loop.num_valid > 0].sum()


def _metadata_item(loop: DecodeState) -> None:
    """A device scalar read with `.item()`."""
    loop.lengths.sum().item()


# The real operation behind each what-if sync point that has one; each waits for everything launched.
SYNC_OPS: dict[str, Callable[[DecodeState], None]] = {"bool_mask_index": _bool_mask_index,
                                                     "metadata_item": _metadata_item}
