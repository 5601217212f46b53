"""benchmarks/validation.py's split of a sim's step error into its device part and its host part."""

import pandas as pd
import pytest
from helpers import load_benchmark


def test_the_step_error_splits_into_a_device_part_and_a_host_part():
    # real: 2 ms steps, 1.5 ms of them device (two runs, the median taken); sim: 1.5 ms steps, 1.2 ms device
    real = pd.DataFrame({"config": ["a", "a"], "mean_tpot_ms": [1.0, 1.2], "mean_step_ms": [1.9, 2.1],
                         "gpu_busy_fraction": [0.75, 0.75]})
    sims = pd.DataFrame({"level": ["sim"], "config": ["a"], "mean_tpot_ms": [0.88], "mean_step_ms": [1.5],
                         "gpu_busy_fraction": [0.8]})
    split = load_benchmark("validation").step_split(real, sims).iloc[0]
    assert split["sim"] == "sim" and split["config"] == "a"
    assert split["tpot_error"] == pytest.approx(-0.2)
    assert split["step_error"] == pytest.approx(-0.25)
    assert split["device_part"] == pytest.approx((1.2 - 1.5) / 2.0)
    assert split["host_part"] == pytest.approx((0.3 - 0.5) / 2.0)
    assert split["device_part"] + split["host_part"] == pytest.approx(split["step_error"])
    assert (split["real_device_ms"], split["sim_device_ms"]) == pytest.approx((1.5, 1.2))
