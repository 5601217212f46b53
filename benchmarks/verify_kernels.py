"""Where a verify forward's device time goes: its kernels' device times (torch.profiler over eager forwards, the same
kernels the graphs replay) grouped by kind, their sum against the graph replay's time (the rest is the gaps between
kernels) and the forward's floors (`bench.verify_floors`).

    python3 benchmarks/verify_kernels.py [--model llama-3.2-1b] [--batch 1 16 64] [--k 4] [--context 512]

Per batch size: the graph replay's median ms (CUDA events, 30 replays), the kernels' summed ms per kind (GEMM,
attention, norm, RoPE/KV write, SiLU, other) and the largest kernels, the weight-read and compute floors.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from simharness.bench import verify_floors
from simharness.engine.model import Transformer
from simharness.models import gpu_spec, model_config

KINDS = (("attention", ("_rope_attention",)), ("norm", ("_rms_norm", "_qk_norm")), ("rope/kv", ("_rope_write",)),
         ("silu", ("_silu",)), ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "gemv", "splitk", "cublas")))


def kind_of(name: str) -> str:
    return next((kind for kind, keys in KINDS if any(key in name.lower() for key in keys)), "other")


def replay_ms(model: Transformer, tokens: torch.Tensor, slots: torch.Tensor, start: torch.Tensor) -> float:
    times = []
    for _ in range(32):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        model.verify(tokens, slots, start)
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times[2:])


def kernel_ms(model: Transformer, tokens: torch.Tensor, slots: torch.Tensor, start: torch.Tensor) -> dict[str, float]:
    """Device ms a forward spends in each kernel (mean of 5 eager forwards)."""
    model.verify_logits(tokens, slots, start)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            model.verify_logits(tokens, slots, start)
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = event.self_cuda_time_total
        if device_us > 0:
            totals[event.key] += device_us / 1e3 / 5
    return dict(totals)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.2-1b", help="catalogue shape")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--gpu", default="H100", help="the catalogue GPU whose datasheet gives the floors")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("verify_kernels.py measures CUDA; no CUDA device here")
    spec = gpu_spec(args.gpu)
    bandwidth, peak = spec.mem_bandwidth_gbs * 1e9, spec.bf16_tflops * 1e12
    n_tokens = args.k + 1
    model = Transformer(model_config(args.model), max_slots=max(args.batch), max_len=args.context + n_tokens + 8,
                        device="cuda", cuda_graphs=True)  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(0)
    for slot in range(max(args.batch)):
        model.prefill(slot, torch.randint(model.config.vocab_size, (args.context,), generator=gen, device="cuda"))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.model}, k = {args.k}, context "
          f"{args.context}; floors at {args.gpu}'s datasheet ({spec.mem_bandwidth_gbs:.0f} GB/s, "
          f"{spec.bf16_tflops:.0f} TFLOP/s)")
    for batch in args.batch:
        tokens = torch.randint(model.config.vocab_size, (batch, n_tokens), generator=gen, device="cuda")
        slots = torch.arange(batch, device="cuda")
        start = torch.full((batch,), args.context, device="cuda")
        graph = replay_ms(model, tokens, slots, start)
        kernels = kernel_ms(model, tokens, slots, start)
        by_kind: dict[str, float] = defaultdict(float)
        for name, ms in kernels.items():
            by_kind[kind_of(name)] += ms
        floors = verify_floors(model, batch, args.k, args.context, bandwidth, peak)
        floor = max(floors["weights_kv_floor_ms"], floors["compute_floor_ms"])
        summed = sum(kernels.values())
        print(f"\nB = {batch}: graph replay {graph:.3f} ms = {graph / floor:.2f}x the floor {floor:.3f} ms "
              f"(weights+KV {floors['weights_kv_floor_ms']:.3f}, compute {floors['compute_floor_ms']:.3f}); "
              f"kernels sum {summed:.3f} ms, gaps {graph - summed:.3f} ms")
        print("  " + ", ".join(f"{kind} {ms:.3f}" for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1])))
        for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:8]:
            print(f"    {ms:7.3f} ms  {name[:110]}")


if __name__ == "__main__":
    main()
