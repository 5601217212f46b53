"""What capturing the decode loop's step graphs up front costs, for a fixed k and for a k schedule (one graph per
batch bucket, step k and steering variant; docs/frontier.md, "hil and real"): the seconds a `DecodeLoop` takes to
build, which every warm-up and every measured run of a point pays before it starts. The first build of each set of
ks also compiles Triton kernels; the later ones are what a point pays. With `--max-batch N` (repeatable) the loop
captures the buckets up to the one that holds N rows only, as a point of N users does (`TorchBackend`). Usage (a
CUDA machine):

    python3 benchmarks/step_graph_capture.py --model llama-3.2-1b --slots 256 --ks 8 --ks 8,6,4,2 --repeats 3
    python3 benchmarks/step_graph_capture.py --model llama-3.2-1b --slots 256 --ks 4 --max-batch 1 --max-batch 8
"""

import argparse
import statistics
import time

import torch

from simharness.engine.decode import DecodeLoop
from simharness.engine.model import Transformer
from simharness.models import model_config


def build_seconds(model: Transformer, ks: tuple[int, ...], max_batch: int | None) -> tuple[float, DecodeLoop]:
    """Seconds to build a decode loop whose steps verify `ks` (limit: the largest) and whose batches reach
    `max_batch` rows (None: the model's slots), and the loop."""
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    loop = DecodeLoop(model, k=max(ks), min_n=2, max_n=5, step_ks=ks, step_graphs=True, max_batch=max_batch)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t, loop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=1400)
    ap.add_argument("--ks", action="append", required=True, help="comma-separated step ks (repeatable)")
    ap.add_argument("--max-batch", type=int, action="append", help="the largest batch (repeatable; default: all)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    model = Transformer(model_config(args.model), max_slots=args.slots, max_len=args.max_len,
                        device="cuda" if cuda else "cpu", cuda_graphs=cuda)
    where = torch.cuda.get_device_name() if cuda else "CPU (nothing captured)"
    print(f"{args.model}, {args.slots} slots, {len(model.batch_buckets)} buckets, {where}")
    for spec in args.ks:
        ks = tuple(int(k) for k in spec.split(","))
        for max_batch in args.max_batch or [None]:
            # Each loop is kept until the next is built: the graphs share the model's graph pool, which CUDA's
            # allocator releases (and cannot capture into again) once no graph holds it, as in an engine that keeps
            # its prefill graphs beside the step graphs.
            first, loop = build_seconds(model, ks, max_batch)
            n_graphs = len(loop.graphs._graphs)
            later = []
            for _ in range(args.repeats):
                seconds, loop = build_seconds(model, ks, max_batch)
                later.append(seconds)
            median = statistics.median(later)
            rows = "all buckets" if max_batch is None else f"batches up to {max_batch}"
            print(f"step ks {ks}, {rows}: {n_graphs} step graphs; first build {first:.2f} s, then median "
                  f"{median:.2f} s (min {min(later):.2f}, max {max(later):.2f}, {args.repeats} builds)", flush=True)


if __name__ == "__main__":
    main()
