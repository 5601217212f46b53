"""A device gate: a one-thread kernel that spins until a counter in pinned host memory reaches its ticket.

The hil level closes a gate in front of each part of a launch and opens it once the host has enqueued the
whole part, so the device runs the part back to back and its events time the work alone, whatever the host
did meanwhile (a compile, a blocked enqueue, a GC pause). It replaces a spin of fixed length
(`torch.cuda._sleep`), which had to guess how long the host would take (docs/hil.md). Triton is imported
only when a gate is built: the sim level never needs it.
"""

from __future__ import annotations

import functools

import torch

# A closed gate gives up after this many polls of host memory (about 4 us each on the H100, over PCIe), so that
# a host blocked inside a part's enqueue (a sync, a kernel loaded on first use, a full launch queue) is not
# deadlocked against it for long; the hil level flags such steps.
MAX_POLLS = 20_000


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["ticket"])  # one compile, whatever the ticket
    def wait_for_ticket(counter_ptr, ticket, max_polls):
        polls = 0
        while (tl.load(counter_ptr, volatile=True) < ticket) & (polls < max_polls):
            polls += 1

    return wait_for_ticket


class Gate:
    """Tickets handed out in order: `close()` enqueues a wait for the next one, `open()` lets the device past
    every gate closed so far. The counter only grows, so no gate is ever reset under a waiting kernel."""

    def __init__(self, device: torch.device | str = "cuda", max_polls: int = MAX_POLLS):
        pinned = torch.device(device).type == "cuda"
        self.counter = torch.zeros(1, dtype=torch.int64, pin_memory=pinned)
        self.host = self.counter.numpy()  # a plain store to the pinned page, which the device polls
        self.ticket = 0
        self.max_polls = max_polls
        self.host[0] = 1
        self.close()  # the one compile, on an open gate, before anything is timed

    def close(self) -> None:
        self.ticket += 1
        _kernel()[(1,)](self.counter, self.ticket, self.max_polls)

    def open(self) -> None:
        self.host[0] = self.ticket
