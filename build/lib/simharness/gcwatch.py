"""CPython's garbage collections during a measured run: how many, how many full ones, and how long they held the
host. A measured level's host phases contain any collection that ran inside them; this says whether there were
any (the #41043 seed asks whether per-step allocations provoke them, docs/seeds.md)."""

from __future__ import annotations

import gc
import time

# The summary columns: collections of any generation, full (generation 2) ones, their pause in ms.
GC_COLUMNS = ("gc_collections", "gc_full_collections", "gc_pause_ms")


class GcWatch:
    """Within `with GcWatch() as watch:`, every collection CPython runs, through `gc.callbacks`."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]  # per generation
        self.pause_s = 0.0
        self._started = 0.0

    def __enter__(self) -> GcWatch:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.collections[info["generation"]] += 1
            self.pause_s += time.perf_counter() - self._started

    def summary(self) -> dict[str, float]:
        """The run's `GC_COLUMNS`."""
        return dict(zip(GC_COLUMNS, (sum(self.collections), self.collections[2], self.pause_s * 1e3), strict=True))
