"""When does launched work start on an idle device: at the launch call's begin, or later? For a CUDA graph of
N kernels and for the same kernels launched eagerly: event E0 is recorded just before the launch; on an idle
device it fires at once, so the device span E0 -> E1 less the same work's span when queued behind a busy device
is the gap from the call's begin to the work's start. Printed with the host time of the launch call. hil starts a
launch part's device work at its enqueue's begin (`simulation._overlapped_end`); this says by how much a graph
starts later. Usage (a CUDA machine):

    python3 benchmarks/graph_start.py
"""

import statistics
import time

import torch

from simharness.engine.model import capture_graph


def make_graph(layers: int, x0: torch.Tensor, w: torch.Tensor) -> torch.cuda.CUDAGraph:
    """`layers` x (GEMM, relu, scale) captured as one graph (`engine.model.capture_graph`)."""

    def chain() -> torch.Tensor:
        y = x0
        for _ in range(layers):
            y = torch.relu(y @ w) * 0.01
        return y

    graph = capture_graph(chain, x0.device)[0]
    torch.cuda.synchronize()
    return graph


def once(fn, busy: bool) -> tuple[float, float]:
    """One launch of `fn` on an idle (or, `busy`, an occupied) device: its device span from E0 to E1 and the host
    time of the launch call, in microseconds."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    if busy:
        torch.cuda._sleep(3_000_000)  # the device busy ~1-2 ms: the work queues behind it
    e0.record()
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) * 1e3, (t1 - t0) * 1e6


def main() -> None:
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    x0 = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    for layers in (8, 48, 160):
        g = make_graph(layers, x0, w)

        def eager(layers=layers):
            return [torch.relu(x0 @ w) * 0.01 for _ in range(layers)]

        for name, fn in (("graph", g.replay), ("eager", eager)):
            for _ in range(20):
                once(fn, False)
                once(fn, True)
            idle = [once(fn, False) for _ in range(200)]
            busy = [once(fn, True) for _ in range(200)]
            dev_idle = statistics.median(a for a, _ in idle)
            dev_busy = statistics.median(a for a, _ in busy)
            host = statistics.median(b for _, b in idle)
            print(f"{name:5s} {layers * 3:4d} kernels: device span idle {dev_idle:8.1f} us, queued {dev_busy:8.1f} "
                  f"us, start gap {dev_idle - dev_busy:7.1f} us; host launch call {host:8.1f} us", flush=True)


if __name__ == "__main__":
    main()
