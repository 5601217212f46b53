"""The kernel benchmark's floor arithmetic (simharness/bench.py) against numbers worked out by hand, and its rounds
of timed calls."""

import pytest
import torch

from simharness.bench import time_rounds, verify_floors
from simharness.engine.model import Transformer, get_config


def test_verify_floors_by_hand() -> None:
    # tiny: 2 layers, dim 64, 4 heads and 2 kv heads of 16, ffn 128, vocabulary 32000, untied head; fp32 on the CPU.
    model = Transformer(get_config("tiny"), max_slots=2, max_len=32, device="cpu")
    floors = verify_floors(model, batch=2, k=3, context=10, bandwidth=1e9, peak_flops=1e12)
    # Weights read: every parameter but the untied embedding table, 4 bytes each:
    # 2 x (qkv 128x64 + o 64x64 + gate/up 256x64 + down 64x128 + 2 norms of 64) + final norm 64 + head 32000x64.
    weight_bytes = (2 * (8192 + 4096 + 16384 + 8192 + 128) + 64 + 32000 * 64) * 4
    assert weight_bytes == 8_488_192
    assert floors["weights_floor_ms"] == pytest.approx(8.488192)
    # K/V read: 2 (k, v) x 2 layers x 2 kv heads x 16 x 4 bytes = 512 per position, over 10 + 4 positions, 2 rows.
    assert floors["kv_read_bytes"] == 14_336
    assert floors["weights_kv_floor_ms"] == pytest.approx(8.502528)
    # FLOPs per token: 2 x (2 x 36864 layer matmul params + 2,048,000 head) + attention 4 x 2 x 4 x 16 x 14;
    # 8 tokens.
    assert floors["flops"] == (2 * 2_121_728 + 7_168) * 8 == 34_004_992
    assert floors["compute_floor_ms"] == pytest.approx(0.034004992)


def test_time_rounds_alternates_the_calls_within_each_round():
    order: list[str] = []
    calls = {name: (lambda name=name: order.append(name)) for name in ("a", "b")}
    times = time_rounds(calls, torch.device("cpu"), repeats=2, rounds=3)
    assert list(times) == ["a", "b"] and all(len(t) == 3 and min(t) >= 0 for t in times.values())
    per_call = 3 + 2  # time_call's warm-up calls, then its repeats
    assert order == (["a"] * per_call + ["b"] * per_call) * 3
