"""Which KV-cache slot each request holds, and how much of its prompt the host has launched (hil and real levels)."""

from __future__ import annotations

import numpy as np


class Slots:
    """A request takes a cache slot at its first prefill chunk and gives it back when the host sees it finish. Every
    step that holds the slot was launched before the release and the next owner's prefill is launched after, so
    the stream's FIFO order keeps the slot safe (as vLLM frees a finished request's blocks on the host at once)."""

    def __init__(self, n_requests: int, n_slots: int):
        self.free = list(range(n_slots - 1, -1, -1))
        self.of = np.full(n_requests, -1, dtype=np.int64)  # each request's slot, -1 when it holds none
        self.prefilled = np.zeros(n_requests, dtype=np.int64)  # prompt tokens whose prefill was launched

    def take(self, rid: int) -> bool:
        """Give request `rid` a slot unless it holds one; True when it took one now (its first chunk)."""
        if self.of[rid] >= 0:
            return False
        self.of[rid] = self.free.pop()
        return True

    def launch_chunk(self, rid: int, tokens: int) -> tuple[int, int]:
        """The prompt positions [start, end) of `rid`'s next chunk of `tokens`, now counted as launched."""
        start = int(self.prefilled[rid])
        self.prefilled[rid] = start + tokens
        return start, start + tokens

    def release(self, rids: np.ndarray) -> None:
        """Free the slots of requests the host saw finish."""
        if len(rids):  # most steps finish no request
            self.free.extend(self.of[rids].tolist())
            self.of[rids] = -1
