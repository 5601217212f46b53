"""benchmarks/seeds.py: a run of one level writes the effects of every level whose rows are in OUT, so re-running
the sim level does not drop the committed hil and real effects."""

import shutil
from pathlib import Path

import pandas as pd
from helpers import load_benchmark

seeds = load_benchmark("seeds")
ROOT = Path(__file__).resolve().parents[1]


def test_the_effects_hold_every_level_in_out(tmp_path):
    for level in ("sim", "hil", "real"):
        shutil.copy(ROOT / "results/seeds" / f"{level}.csv", tmp_path / f"{level}.csv")
    effects = seeds.effects_of_every_level(tmp_path)
    assert set(effects["level"]) == {"sim", "hil", "real"}
    written = pd.read_csv(tmp_path / "effects.csv", dtype={"seed": str})
    assert len(written) == len(effects) and set(written["level"]) == {"sim", "hil", "real"}
    # the committed table is exactly what the level CSVs give
    committed = pd.read_csv(ROOT / "results/seeds/effects.csv", dtype={"seed": str})
    pd.testing.assert_frame_equal(written, committed)
    (tmp_path / "real.csv").unlink()
    assert set(seeds.effects_of_every_level(tmp_path)["level"]) == {"sim", "hil"}
