"""The verify attention's device time by rows and context, on CUDA: what a decode forward's attention costs at the
shapes the validation families hold (the cost profile fits it as FLOPs at one efficiency instead).

    python3 benchmarks/attention_rows.py [--model llama-3.2-1b llama-3-8b]
    TRITON_INTERPRET=1 python3 benchmarks/attention_rows.py --smoke   # tiny shapes on the CPU: the call path only

The engine's Triton verify attention (`model_triton.rope_attention_triton`: RoPE, the step's K/V written to the
cache, attention over the row's context, the split-context merge) for B rows of 1 + k = 5 tokens, every row after
`context` cached tokens, one layer; device µs by `bench.time_call` (25-call medians after an L2 flush), the median of
3 rounds with the lowest-highest round, and that times the model's layers (a forward's attention).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from simharness.bench import time_rounds
from simharness.engine.model_triton import rope_attention_triton
from simharness.models import model_config

ROUNDS, REPEATS, TOKENS = 3, 25, 5
ROWS = (1, 4, 8, 16, 24, 32, 48, 64, 128)
CONTEXTS = (256, 512, 1024, 2048, 3072, 4096)


def attention_call(model: str, rows: int, context: int, device: torch.device):
    """A call of the verify attention for `rows` rows after `context` tokens, its inputs built once."""
    c = model_config(model)
    max_len = CONTEXTS[-1] + 2 * TOKENS
    cache = (rows, max_len, c.n_kv_heads, c.head_dim)
    k_cache = torch.randn(cache, device=device).to(torch.bfloat16)
    v_cache = torch.randn(cache, device=device).to(torch.bfloat16)
    qkv = torch.randn(rows * TOKENS, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim, device=device).to(torch.bfloat16)
    angles = torch.outer(torch.arange(max_len, device=device).float(),
                         torch.rand(c.head_dim // 2, device=device))  # fmt: skip
    cos, sin = angles.cos(), angles.sin()
    slots = torch.arange(rows, device=device)
    start_pos = torch.full((rows,), context, device=device)
    counters = torch.zeros(rows * c.n_kv_heads, dtype=torch.int32, device=device)
    args = (qkv, k_cache, v_cache, cos, sin, slots, start_pos, TOKENS, c.n_heads, counters)
    return lambda: rope_attention_triton(*args), c.n_layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["llama-3.2-1b", "llama-3-8b"])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton's interpreter)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    rows_set, contexts = ((1, 2), (8, 16)) if args.smoke else (ROWS, CONTEXTS)
    rounds, repeats = (1, 1) if args.smoke else (ROUNDS, REPEATS)
    if not args.smoke:
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; k = {TOKENS - 1}")
    for model in args.model:
        print(f"{model}: forward attention ms (one layer us, min-max of rounds)")
        for rows in rows_set:
            cells = []
            for context in contexts:
                call, layers = attention_call(model, rows, context, device)
                us = [1e3 * ms for ms in time_rounds({"attention": call}, device, repeats, rounds)["attention"]]
                median = statistics.median(us)
                spread = f"{min(us):.1f}-{max(us):.1f}"
                cells.append(f"ctx {context:5}: {median * layers / 1e3:6.3f} ({median:6.1f}, {spread})")
            print(f"  B {rows:4}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
