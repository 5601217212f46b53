"""The seed changes: five vLLM decode-loop changes with a posted effect, each an A/B scenario, and the effect a
level predicts for it with a 95% interval over repeats (docs/seeds.md).

A seed's scenario (`scenarios/seeds/<pr>.yaml`) sweeps the field that is the change: its first value is the
code before the change (arm A), its last the code after (arm B); a value between is another arm, named by it.
A repeat runs the scenario with another seed (another workload, other random draws), so the interval holds
the workload's variation as well as a measured level's noise; A and B of one repeat see the same requests,
and the effect is computed per repeat, then averaged.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from simharness.runner import run
from simharness.scenario import load_scenario
from simharness.stats import t_interval

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios" / "seeds"


@dataclass(frozen=True)
class Seed:
    """One seed change: its scenario's swept field and the metrics its PR reported, with the posted relative change
    in percent (None: a direction without a number)."""

    pr: str
    title: str
    field: str
    reported: dict[str, float | None]  # metric -> posted change in %, (after - before) / before
    sign: dict[str, int]  # metric -> the posted direction (+1 / -1)


SEEDS: dict[str, Seed] = {
    "29184": Seed("29184", "n-gram proposer on the GPU, with async scheduling", "engine.speculation.proposer",
                  {"output_throughput": 20.6}, {"output_throughput": 1}),
    "32951": Seed("32951", "zero-bubble async speculative decoding", "scheduler.policy",
                  {"mean_tpot_ms": -3.2}, {"mean_tpot_ms": -1}),
    "41043": Seed("41043", "no per-step allocation in prepare_next_token_ids_padded", "engine.gc.allocations_per_step",
                  {"p99_tpot_ms": -9.3, "mean_tpot_ms": -0.8}, {"p99_tpot_ms": -1, "mean_tpot_ms": -1}),
    "38047": Seed("38047", "no GPU->CPU sync in the attention metadata build", "scheduler.sync_points.add",
                  {"output_throughput": 7.0, "mean_ttft_ms": -20.0},
                  {"output_throughput": 1, "mean_ttft_ms": -1}),
    "37238": Seed("37238", "greedy path in the rejection sampler", "workload.random_fraction",
                  {"mean_step_ms": None, "mean_sample_ms": None, "median_sample_ms": None},
                  {"mean_step_ms": -1, "mean_sample_ms": -1, "median_sample_ms": -1}),
}  # fmt: skip


def seed_scenario_path(pr: str) -> Path:
    return SCENARIOS / f"{pr}.yaml"


def run_seed(pr: str, level: str, repeats: int, out: str | Path,
             overrides: dict[str, Any] | None = None) -> pd.DataFrame:
    """Run seed `pr`'s scenario at `level` (sim, hil or real) `repeats` times, with scenario seeds 0, 1, ...
    (one run whose sweep adds `seed`); one row per repeat, arm and metric: seed, level, repeat, arm (A, B, or the
    value of an arm between), metric, measured value."""
    seed = SEEDS[pr]
    scenario_seeds = list(range(repeats))
    base = load_scenario(seed_scenario_path(pr), overrides)
    values = base.sweep[seed.field]
    # one run, its sweep the repeats (outer) by the arms: a measured run builds its model once
    sc = load_scenario(seed_scenario_path(pr), {**(overrides or {}), "engine.level": level,
                                                "sweep": {"seed": scenario_seeds, seed.field: values}})
    result = run(sc, out=out)
    # the sampler's device time, measured levels only (NaN at sim); at real a step's interval also holds any launch
    # gap of a host-bound loop, which a run's median leaves out and its mean does not (docs/seeds.md, #37238)
    sample = result.steps.groupby("point")["gpu_sample_s"]
    sample_ms = {"mean_sample_ms": sample.mean() * 1e3, "median_sample_ms": sample.median() * 1e3}
    rows = []
    for _, point in result.summary.sort_values("index").iterrows():
        repeat, i = divmod(int(point["index"]), len(values))
        arm = "A" if i == 0 else "B" if i == len(values) - 1 else f"{seed.field}={values[i]}"
        for metric in seed.reported:
            value = sample_ms[metric].get(point["point"], np.nan) if metric in sample_ms else point[metric]
            rows.append({"seed": pr, "level": level, "repeat": scenario_seeds[repeat], "arm": arm, "metric": metric,
                         "measured": float(value)})
    return pd.DataFrame(rows)


def seed_effects(rows: pd.DataFrame) -> pd.DataFrame:
    """Per seed, level and metric of `run_seed`'s rows: A and B (means over repeats), the effect (after - before)
    / before in % (the mean of the per-repeat effects) with its 95% t interval, the reported change, and whether
    the level reproduces it: the interval excludes 0, the sign is the reported one and, where a size was posted,
    it is within 2x of it."""
    out = []
    rows = rows.dropna(subset=["measured"])  # a metric a level does not measure (the sampler's time at sim)
    for (pr, level, metric), group in rows.groupby(["seed", "level", "metric"], sort=False):
        seed = SEEDS[pr]
        table = group.pivot_table(index="repeat", columns="arm", values="measured")
        a, b = table["A"], table["B"]
        effect = ((b - a) / a * 100).to_numpy()
        mean, half = t_interval(effect)
        reported = seed.reported[metric]
        excludes_zero = (mean - half) > 0 or (mean + half) < 0
        same_sign = np.sign(mean) == seed.sign[metric]
        within_2x = reported is None or (same_sign and 0.5 <= mean / reported <= 2.0)
        out.append({"seed": pr, "level": level, "metric": metric, "A": a.mean(), "B": b.mean(), "effect_pct": mean,
                    "ci_low": mean - half, "ci_high": mean + half, "repeats": len(effect), "reported_pct": reported,
                    "excludes_zero": bool(excludes_zero), "same_sign": bool(same_sign), "within_2x": bool(within_2x),
                    "reproduced": bool(excludes_zero and same_sign and within_2x)})
    return pd.DataFrame(out)
