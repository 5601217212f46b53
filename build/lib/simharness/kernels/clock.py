"""Device timestamps: a one-thread kernel that writes the GPU's global nanosecond timer (%globaltimer) to memory.

A CUDA graph replays the same event nodes every time, so a graph replayed again before the previous replay's events
were read would overwrite them. The decode loop's captured step instead stamps each phase boundary into its
output buffer, which travels to the host with the step's tokens (`engine.decode`). Triton is imported only when a
stamp is first launched: the sim level and the CPU never need it.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["index"])  # one compile for every index
    def write_globaltimer(out_ptr, index):
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        tl.store(out_ptr + index, now)

    return write_globaltimer


def stamp(out: torch.Tensor, index: int) -> None:
    """Enqueue a write of the device's nanosecond clock to `out[index]` (int64, CUDA) after the work before it."""
    _kernel()[(1,)](out, index, num_warps=1)
