"""benchmarks/validation.py's split of a sim's mean TPOT error over the steps a request spends per token and the
device and host time of those steps."""

import pandas as pd
import pytest
from helpers import load_benchmark

validation = load_benchmark("validation")


def test_the_mean_tpot_is_the_sum_of_the_periods_each_request_decodes_over():
    # three steps settle at 1, 2 and 4 s; the first and the last carry a prefill chunk
    steps = pd.DataFrame({"n_prefill_reqs": [1, 0, 1], "gpu_start": [0.0, 1.1, 2.2], "gpu_end": [0.8, 1.9, 3.7],
                          "update_end": [1.0, 2.0, 4.0]})
    # request 0: 3 tokens from 1 to 4 s (TPOT 1.5); request 1: 2 tokens from 2 to 4 s (TPOT 2); request 2: unfinished
    requests = pd.DataFrame({"output_tokens": [3, 2, 5], "first_token_s": [1.0, 2.0, 4.0],
                             "last_token_s": [4.0, 4.0, float("nan")]})
    p = validation.decode_periods(steps, requests)
    assert p["tpot"] == pytest.approx((1.5 + 2.0) / 2)
    # weights: request 0 (1/2 of 1/2) on steps 1 and 2, request 1 (1/2) on step 2
    assert p["weight"] == pytest.approx(0.25 * 2 + 0.5)
    assert p["decode_device"] == pytest.approx(0.25 * 0.8)
    assert p["prefill_device"] == pytest.approx(0.75 * 1.5)
    assert p["host"] == pytest.approx(0.25 * (1.0 - 0.8) + 0.75 * (2.0 - 1.5))
    assert p["decode_device"] + p["prefill_device"] + p["host"] == pytest.approx(p["tpot"])
    assert p["prefill_weight"] == pytest.approx(0.75)


def test_the_tpot_error_splits_into_steps_per_token_device_and_host_parts():
    real = pd.DataFrame({"config": ["a", "a"], "point": ["r0", "r1"], "mean_step_ms": [1.9, 2.1]})
    sims = pd.DataFrame({"level": ["sim"], "config": ["a"], "point": ["s"], "mean_step_ms": [1.8]})
    periods = {"r0": {"tpot": 1.0, "weight": 0.5, "decode_device": 0.6, "prefill_device": 0.2, "host": 0.2,
                      "prefill_weight": 0.1},
               "r1": {"tpot": 1.2, "weight": 0.5, "decode_device": 0.7, "prefill_device": 0.2, "host": 0.3,
                      "prefill_weight": 0.1},
               "s": {"tpot": 1.155, "weight": 0.55, "decode_device": 0.66, "prefill_device": 0.22, "host": 0.275,
                     "prefill_weight": 0.08}}
    split = validation.tpot_split(real, sims, {p: periods[p] for p in ("r0", "r1")}, {"s": periods["s"]}).iloc[0]
    assert split["tpot_error"] == pytest.approx(1.155 / 1.1 - 1)
    assert split["tpot_steps"] == pytest.approx(0.1)
    # per unit weight the real runs hold 1.3 decode, 0.4 prefill and 0.5 host; the sim 1.2, 0.4 and 0.5
    assert split["tpot_decode_device"] == pytest.approx((0.66 - 0.55 * 1.3) / 1.1)
    assert split["tpot_prefill_device"] == pytest.approx(0.0)
    assert split["tpot_host"] == pytest.approx(0.0)
    parts = split[["tpot_steps", "tpot_decode_device", "tpot_prefill_device", "tpot_host"]].sum()
    assert parts == pytest.approx(split["tpot_error"])
    assert split["device_step_error"] == pytest.approx(1.8 / 2.0 - 1)
    assert split["real_spread"] == pytest.approx(0.2)
    assert (split["real_prefill_weight"], split["sim_prefill_weight"]) == pytest.approx((0.1, 0.08))
