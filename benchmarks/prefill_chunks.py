"""A later prefill chunk's device time against its compute floor: the attention over the cached prefix as the Triton
prefix kernel runs it (`engine.model_triton.prefix_attention_triton`, the real level's path) and as the masked SDPA
path ran it before (K/V heads repeated, every cached position scored), in the same process, through the prefill's
CUDA graphs.

    python3 benchmarks/prefill_chunks.py [--model llama-3.2-1b] [--chunks 512 2048] [--prefixes 0 1024 2048 3800]

Per (chunk, prefix): the median and p10/p90 of `--repeats` graph replays (CUDA events), the compute floor (2 x the
matmul parameters x tokens + attention FLOPs over the prefix and the chunk's causal half, at the datasheet's bf16
peak) and the ratio. Prefix 0 is a fresh prompt (FlashAttention, the same on both paths).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from functools import partial

import torch

from simharness.engine.model import Transformer, verify_attention_torch
from simharness.models import gpu_spec, model_config


def chunk_ms(model: Transformer, tokens: torch.Tensor, prefix: int, repeats: int) -> list[float]:
    """Device ms of `repeats` prefills of `tokens` after `prefix` cached positions of slot 0 (graph replays)."""
    times = []
    for _ in range(repeats + 2):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        model.prefill(0, tokens, start=prefix)
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return times[2:]  # the first replays may capture the bucket's graph


def floor_ms(model: Transformer, chunk: int, prefix: int, peak_flops: float) -> float:
    c = model.config
    matmul_params = sum(p.numel() for p in model.layers.parameters() if p.dim() == 2)
    pairs = chunk * prefix + chunk * (chunk + 1) / 2
    attention = 4 * c.n_layers * c.n_heads * c.head_dim * pairs
    return (2 * matmul_params * chunk + attention + 2 * model.output.numel()) / peak_flops * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.2-1b", help="catalogue shape")
    ap.add_argument("--chunks", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--prefixes", type=int, nargs="+", default=[0, 1024, 2048, 3800])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--gpu", default="H100", help="the catalogue GPU whose bf16 peak is the floor")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("prefill_chunks.py measures CUDA; no CUDA device here")
    peak = gpu_spec(args.gpu).bf16_tflops * 1e12
    max_len = max(args.prefixes) + max(args.chunks) + 16
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.model}, {args.repeats} replays a point; "
          f"floor at {args.gpu}'s {peak / 1e12:.0f} TFLOP/s")
    print("chunk  prefix  path    median_ms  p10_ms  p90_ms  floor_ms  x_floor")
    for path in ("prefix", "masked"):
        # A model per path (the same seeded weights), its attention set before anything is captured.
        model = Transformer(model_config(args.model), max_slots=2, max_len=max_len, device="cuda", cuda_graphs=True)
        if path == "masked":
            model.ops = dataclasses.replace(model.ops, prefix_attention=partial(verify_attention_torch,
                                                                                expand_heads=True))
        gen = torch.Generator(device="cuda").manual_seed(0)
        model.prefill(0, torch.randint(model.config.vocab_size, (max_len - 16,), generator=gen, device="cuda"))
        for chunk in args.chunks:
            tokens = torch.randint(model.config.vocab_size, (chunk,), generator=gen, device="cuda")
            for prefix in args.prefixes:
                if path == "masked" and prefix == 0:
                    continue  # a fresh prompt takes FlashAttention on both paths
                ms = sorted(chunk_ms(model, tokens, prefix, args.repeats))
                floor = floor_ms(model, chunk, prefix, peak)
                p10, p90 = ms[len(ms) // 10], ms[(9 * len(ms)) // 10]
                median = statistics.median(ms)
                print(f"{chunk:5d}  {prefix:6d}  {path:6s}  {median:9.2f}  {p10:6.2f}  {p90:6.2f}  {floor:8.2f}  "
                      f"{median / floor:7.2f}")
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
