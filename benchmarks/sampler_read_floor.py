"""How close can any rejection sampler get to its bandwidth floor at small batches? The committed Triton sampler
against a plain streaming read of the same logits and a launch of nothing, on CUDA (issue 30, item 3).

    python3 benchmarks/sampler_read_floor.py

k = 4, V = 128,256, every row 4 random drafts, the seed a device tensor. Device µs by `bench.time_call` (25-call
medians after an L2 flush), the median of 3 rounds with the lowest-highest round. `read` sums the logits viewed as
rows of 4,096 elements (torch's reduction); `triton read B/W` is a Triton kernel whose programs each sum B
consecutive elements with W warps (a streaming read, one float written a program); `launch` is a one-element fill (a
launch's device time with no data). The floor is the logits' bytes over the measured copy bandwidth (bytes read plus
written, as `simharness bench kernels` measures it); each time is given as a multiple of it. A sampler must read
every logit once and then walk each row's tiles, so `read` is what the first of its two passes can approach.
"""

from __future__ import annotations

import functools
import statistics

import torch
import triton
import triton.language as tl

from simharness.bench import measure_copy_bandwidth, time_rounds
from simharness.kernels.rejection_triton import rejection_sample_triton

K, VOCAB, ROUNDS, REPEATS, ROW = 4, 128256, 3, 25, 4096
READS = ((1024, 1), (2048, 2), (4096, 4), (8192, 8))  # (elements a program, warps) of the Triton read


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """One program sums BLOCK consecutive elements: a streaming read with one float written per program."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # 64-bit: buffers past 2^31 elements
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(x.to(tl.float32)))


def triton_read(flat: torch.Tensor, out: torch.Tensor, block: int, warps: int) -> None:
    _read_kernel[(triton.cdiv(flat.numel(), block),)](flat, out, flat.numel(), BLOCK=block, num_warps=warps)


def main() -> None:
    device = torch.device("cuda")
    copy_gbps = measure_copy_bandwidth(device, quick=False)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth {copy_gbps:.0f} GB/s")
    generator = torch.Generator(device=device).manual_seed(0)
    seed = torch.ones(1, dtype=torch.int64, device=device)
    one = torch.empty(1, device=device)
    for dtype in (torch.bfloat16, torch.float32):
        for batch in (1, 16, 64, 256):
            logits = torch.randn((batch, K + 1, VOCAB), generator=generator, device=device).to(dtype)
            drafts = torch.randint(0, VOCAB, (batch, K), generator=generator, device=device)
            num_drafts = torch.full((batch,), K, device=device)
            flat = logits.view(-1)
            rows = flat[: flat.numel() // ROW * ROW].view(-1, ROW)  # the last partial row left out: < 8 KB
            greedy = (logits, drafts, num_drafts, torch.zeros(batch, device=device))
            random = (logits, drafts, num_drafts, torch.ones(batch, device=device))
            out = torch.empty(triton.cdiv(flat.numel(), 1024), device=device)
            calls = {
                "launch": lambda: one.fill_(1.0),
                "read": lambda rows=rows: rows.sum(dim=1, dtype=torch.float32),
                **{f"triton read {block}/{warps}": functools.partial(triton_read, flat, out, block, warps)
                   for block, warps in READS},
                "greedy": lambda args=greedy: rejection_sample_triton(*args, seed=seed),
                "random": lambda args=random: rejection_sample_triton(*args, seed=seed),
            }
            floor_us = logits.numel() * logits.element_size() / (copy_gbps * 1e9) * 1e6
            for name, ms in time_rounds(calls, device, REPEATS, ROUNDS).items():
                us = [1e3 * m for m in ms]
                median = statistics.median(us)
                print(f"{str(dtype).removeprefix('torch.'):8} {batch:4} floor {floor_us:6.1f} us  {name:20} "
                      f"{median:6.1f} ({min(us):.1f}-{max(us):.1f}) {median / floor_us:5.2f}x", flush=True)

if __name__ == "__main__":
    main()
