"""What can a verify forward made of one kernel per matrix product reach at one row, at best? Each weight matrix
of the model read by a bare streaming kernel of its own, in the forward's order, against the same bytes read by
one kernel, on CUDA (issue 30, item 2).

    python3 benchmarks/verify_read_floor.py [--model llama-3.2-1b llama-3-8b]

At B = 1 the verify step is bound by its weight reads. Here every layer's four products (q/k/v, o, gate/up, down)
and the LM head are bf16 tensors of the model's shapes, and each is read by the Triton read kernel
of `sampler_read_floor.py` (the best of its configurations there), one launch a matrix, the whole sequence captured
in a CUDA graph and replayed (so the host adds nothing); `one kernel` reads a buffer of the same total bytes with
one launch. Device ms by `bench.time_call` (25-call medians after an L2 flush), the median of 3 rounds with the
lowest-highest round, as multiples of the weight-read floor (the matrices' bytes over the measured copy bandwidth).
A forward whose products run as separate kernels reads its weights no faster than `per matrix`, whatever the
products compute, before its attention, norms and activations. Then the same matrices as cuBLAS products
(`F.linear`) of 1 to 512 token rows, one graph a row count: what a forward's GEMMs cost by the tokens it verifies,
against the floor and against the bare reads (the small-batch GEMM efficiency a cost profile would need).
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch
import torch.nn.functional as F
from sampler_read_floor import triton_read  # noqa: E402 (benchmarks/ is the script's directory)

from simharness.bench import measure_copy_bandwidth, time_rounds
from simharness.engine.model import capture_graph
from simharness.models import model_config

ROUNDS, REPEATS, BLOCK, WARPS = 3, 25, 1024, 1
ROWS = (1, 2, 4, 5, 8, 10, 16, 20, 32, 40, 64, 80, 128, 160, 256, 320, 512)  # B x (1 + k) at k = 0 and 4, and more


def matrices(model: str) -> list[tuple[int, int]]:
    """(rows, columns) of every weight matrix a forward reads, in the forward's order."""
    c = model_config(model)
    layer = [(c.qkv_rows, c.dim), (c.dim, c.n_heads * c.head_dim), (2 * c.ffn_dim, c.dim), (c.dim, c.ffn_dim)]
    return layer * c.n_layers + [(c.vocab_size, c.dim)]


def graphed(calls: list) -> torch.cuda.CUDAGraph:
    """The calls, in order, captured as one CUDA graph (`engine.model.capture_graph`)."""
    return capture_graph(lambda: [call() for call in calls], torch.device("cuda"))[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["llama-3.2-1b", "llama-3-8b"])
    parser.add_argument("--rows", nargs="*", type=int, default=list(ROWS), help="tokens of the GEMM rows (none: skip)")
    args = parser.parse_args()
    device = torch.device("cuda")
    copy_gbps = measure_copy_bandwidth(device, quick=False)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth {copy_gbps:.0f} GB/s")
    for model in args.model:
        shapes = matrices(model)
        weights = [torch.ones(rows, cols, dtype=torch.bfloat16, device=device) for rows, cols in shapes]
        flats = [w.view(-1) for w in weights]
        outs = [torch.empty(-(-f.numel() // BLOCK), device=device) for f in flats]
        total = sum(f.numel() for f in flats)
        whole = torch.ones(total, dtype=torch.bfloat16, device=device)
        whole_out = torch.empty(-(-total // BLOCK), device=device)
        reads = [functools.partial(triton_read, f, o, BLOCK, WARPS) for f, o in zip(flats, outs, strict=True)]
        per_matrix = graphed(reads)
        one = graphed([functools.partial(triton_read, whole, whole_out, BLOCK, WARPS)])
        floor_ms = total * 2 / (copy_gbps * 1e9) * 1e3
        print(f"{model}: {len(shapes)} matrices, {total * 2 / 1e9:.3f} GB, floor {floor_ms:.3f} ms")
        times = time_rounds({"per matrix": per_matrix.replay, "one kernel": one.replay}, device, REPEATS, ROUNDS)
        for name, ms in times.items():
            median = statistics.median(ms)
            print(f"  {name:11} {median:7.3f} ms ({min(ms):.3f}-{max(ms):.3f}) {median / floor_ms:5.2f}x the floor")
        del flats, outs, reads, whole, whole_out, one
        read_ms = statistics.median(times["per matrix"])
        for rows in args.rows:  # the same matrices as cuBLAS products of `rows` tokens (torch's F.linear)
            inputs = [torch.ones(rows, cols, dtype=torch.bfloat16, device=device) for _, cols in shapes]
            gemms = graphed([functools.partial(F.linear, x, w) for x, w in zip(inputs, weights, strict=True)])
            ms = time_rounds({"gemms": gemms.replay}, device, REPEATS, ROUNDS)["gemms"]
            median = statistics.median(ms)
            print(f"  GEMMs at {rows:4} rows {median:7.3f} ms ({min(ms):.3f}-{max(ms):.3f}) "
                  f"{median / floor_ms:5.2f}x the floor, {median / read_ms:5.2f}x the reads")  # fmt: skip
            del inputs, gemms
        del weights, per_matrix
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
