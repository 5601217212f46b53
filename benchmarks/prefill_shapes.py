"""What the first prefill of a new prompt length costs on CUDA, and the warm-up that pays it before measuring.

    python3 benchmarks/prefill_shapes.py --first-calls 300 [--profile]   # a one-layer model, lengths 1..300
    CUDA_MODULE_LOADING=EAGER python3 benchmarks/prefill_shapes.py --first-calls 300   # every kernel loaded first
    python3 benchmarks/prefill_shapes.py --warm 1024                     # the full model after its warm-up

--first-calls N: a one-layer model of the shape, a sync after each prefill, lengths 1..N fresh and after a
cached prefix; prints the total, the median and slowest first calls, and a second call of one length (a cost
paid once per length shows as first calls far above the second). --profile adds cProfile over 40 more lengths.
--warm L: the full model with CUDA graphs, `measured.warm_prefill_shapes(model, L)` timed (since the prefill runs
through CUDA graphs, that is the capture of every token bucket up to L), its second call (a no-op), then three
calls of lengths up to L and two past it (whose bucket is captured on its first call). Run the two parts in
separate processes: what the first loads, the second would not pay. docs/hil.md ("cuDNN attention builds per
shape") has the H100 figures of the eager prefill; they came from two scratch scripts whose parts this file joins.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import os
import pstats
import time
from collections.abc import Callable

import torch

from simharness import measured
from simharness.engine.model import Transformer
from simharness.models import model_config


def timed_ms(f: Callable[..., object], *args: object, **kwargs: object) -> float:
    """f(*args, **kwargs) in ms, the device synchronized before and after."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    f(*args, **kwargs)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def first_calls(name: str, n: int, profile: bool) -> None:
    model = Transformer(dataclasses.replace(model_config(name), n_layers=1), max_slots=65, max_len=n + 100,
                        device="cuda")  # fmt: skip
    tokens = torch.zeros(n + 41, dtype=torch.int64, device="cuda")
    fresh, cached = [], []
    t = time.perf_counter()
    for length in range(1, n + 1):
        fresh.append(timed_ms(model.prefill, 0, tokens[:length]))
        cached.append(timed_ms(model.prefill, 0, tokens[:length], start=1))
    print(f"lengths 1..{n}, one layer: {time.perf_counter() - t:.1f} s (fresh {sum(fresh) / 1e3:.1f} s, after a "
          f"prefix {sum(cached) / 1e3:.1f} s)")
    for label, ms in (("fresh", fresh), ("after a prefix", cached)):
        slowest = sorted(((v, i + 1) for i, v in enumerate(ms)), reverse=True)[:5]
        print(f"  {label}: median first call {sorted(ms)[n // 2]:.2f} ms; slowest (ms, length): "
              + ", ".join(f"({v:.0f}, {length})" for v, length in slowest))
    half = tokens[: n // 2]
    print(f"  a second call of length {n // 2}: fresh {timed_ms(model.prefill, 0, half):.2f} ms, "
          f"after a prefix {timed_ms(model.prefill, 0, half, start=1):.2f} ms")
    if profile:
        stats = cProfile.Profile()
        stats.enable()
        for length in range(n + 1, n + 41):
            model.prefill(0, tokens[:length])
            model.prefill(0, tokens[:length], start=1)
        torch.cuda.synchronize()
        stats.disable()
        pstats.Stats(stats).sort_stats("tottime").print_stats(12)


def warmed(name: str, longest: int) -> None:
    model = Transformer(model_config(name), max_slots=65, max_len=longest + 100, device="cuda", cuda_graphs=True)
    tokens = torch.zeros(longest + 90, dtype=torch.int64, device="cuda")
    t = time.perf_counter()
    measured.warm_prefill_shapes(model, longest)
    print(f"warm-up of chunks up to {longest} tokens: {time.perf_counter() - t:.1f} s")
    t = time.perf_counter()
    measured.warm_prefill_shapes(model, longest)
    print(f"  its second call (nothing left to do): {time.perf_counter() - t:.3f} s")
    for length in sorted({1, 7, 100, longest // 3, longest // 2, longest - 1, longest} & set(range(1, longest + 1))):
        fresh = [timed_ms(model.prefill, 0, tokens[:length]) for _ in range(3)]
        cached = [timed_ms(model.prefill, 0, tokens[:length], start=1) for _ in range(3)]
        print(f"  length {length}: fresh {' / '.join(f'{v:.1f}' for v in fresh)} ms, after a prefix "
              f"{' / '.join(f'{v:.1f}' for v in cached)} ms")
    for length in (longest + 6, longest + 66):
        fresh = [timed_ms(model.prefill, 0, tokens[:length]) for _ in range(2)]
        print(f"  length {length} (past the warm-up): fresh {fresh[0]:.1f} / {fresh[1]:.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.2-1b", help="catalogue shape")
    ap.add_argument("--first-calls", type=int, metavar="N", help="first-call cost of lengths 1..N (one layer)")
    ap.add_argument("--profile", action="store_true", help="with --first-calls: cProfile 40 more lengths")
    ap.add_argument("--warm", type=int, metavar="L", help="the full model after warming lengths 1..L")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("prefill_shapes.py measures CUDA; no CUDA device here")
    if not (args.first_calls or args.warm):
        raise SystemExit("give --first-calls N or --warm L (in separate processes)")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA_MODULE_LOADING="
          f"{os.environ.get('CUDA_MODULE_LOADING', '(unset: lazy)')}")
    if args.first_calls:
        first_calls(args.model, args.first_calls, args.profile)
    if args.warm:
        warmed(args.model, args.warm)


if __name__ == "__main__":
    main()
