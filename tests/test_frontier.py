"""The speculation frontier and the k schedule (issue 31): the frontier's arithmetic on hand-made summaries (best k,
gain, intervals, crossover, derived schedule), the k schedule at the sim level (deterministic, the step's k drives
the scheduler, acceptance and cost model), bad input, and an 8B sim frontier against the roofline's closed form."""

import math
import re

import numpy as np
import pandas as pd
import pytest
import yaml
from helpers import load_benchmark, simulate
from typer.testing import CliRunner

import simharness
from simharness.cli import app
from simharness.frontier import K, crossover_text, derive_k_schedule, speculation_frontier
from simharness.models import gpu_spec, model_config
from simharness.policy import scheduled_k
from simharness.results import new_run_dir
from simharness.scenario import GpuCosts, ScenarioError, scenario_from_dict
from simharness.stats import bootstrap_ci
from simharness.workload import build_requests

C = "workload.concurrency"


def summary_of(values: dict[tuple[int, int], list[float]], tpot: dict[tuple[int, int], list[float]]) -> pd.DataFrame:
    """A summary.csv-like frame: per (concurrency, k) a row per repeat with the given throughputs and TPOTs."""
    rows = []
    for (c, k), runs in values.items():
        for r, (thr, tp) in enumerate(zip(runs, tpot[(c, k)], strict=True)):
            point = f"{K}={k},{C}={c}" + (f",repeat={r}" if len(runs) > 1 else "")
            rows.append({"point": point, K: k, C: c, "repeat": r, "output_throughput": thr, "mean_tpot_ms": tp})
    return pd.DataFrame(rows)


def test_frontier_picks_the_best_k_with_its_interval_and_the_crossover():
    thr = {(1, 0): [100, 101, 99], (1, 2): [180, 182, 178], (1, 4): [250, 260, 240],
           (8, 0): [700, 710, 690], (8, 2): [900, 905, 895], (8, 4): [800, 810, 790],
           # at 64, k = 2 is lower by its median but its interval overlaps k = 0's: speculation still pays
           (64, 0): [3000, 3100, 2900], (64, 2): [2950, 3120, 2800], (64, 4): [2000, 2010, 1990],
           (128, 0): [5000, 5010, 4990], (128, 2): [4000, 4010, 3990], (128, 4): [3000, 3010, 2990]}
    tpot = {key: [1000 / v for v in runs] for key, runs in thr.items()}
    fr = speculation_frontier(summary_of(thr, tpot), [K, C])
    table = fr.table.set_index(C)
    assert table["best_k_throughput"].to_dict() == {1: 4, 8: 2, 64: 0, 128: 0}
    assert table["best_k_tpot"].to_dict() == {1: 4, 8: 2, 64: 0, 128: 0}
    assert table.loc[1, "throughput"] == 250 and table.loc[1, "throughput_k0"] == 100
    assert table.loc[1, "throughput_gain_pct"] == pytest.approx(150)
    assert table.loc[8, "tpot_gain_pct"] == pytest.approx((1000 / 700 - 1000 / 900) / (1000 / 700) * 100)
    low, high = bootstrap_ci(np.array([250, 260, 240]))
    assert (table.loc[1, "throughput_ci_low"], table.loc[1, "throughput_ci_high"]) == (low, high)
    assert low < 250 < high
    assert table["throughput_pays"].to_dict() == {1: True, 8: True, 64: True, 128: False}
    assert fr.crossovers.loc[0, "crossover_throughput"] == 128
    assert fr.crossovers.loc[0, "crossover_tpot"] == 128
    assert math.isnan(fr.crossovers.loc[0, "pays_again_throughput"])
    # each load's k from the geometric mean of its concurrency and the previous one's: sqrt(8), sqrt(8 * 64)
    assert derive_k_schedule(fr, summary_of(thr, tpot)) == {"all": {1: 4, 3: 2, 23: 0}}


def test_crossover_is_the_first_load_where_speculation_stops_paying_and_a_later_recovery_is_named():
    # without repeats the intervals are the points themselves: any k > 0 below k = 0 is worse
    thr = {(1, 0): [10], (1, 2): [20], (2, 0): [20], (2, 2): [19], (4, 0): [40], (4, 2): [41], (8, 0): [80],
           (8, 2): [70], (16, 0): [160], (16, 2): [100]}

    def crossings(loads: set[int]) -> dict:
        kept = {key: v for key, v in thr.items() if key[0] in loads}
        fr = speculation_frontier(summary_of(kept, {key: [1 / v[0]] for key, v in kept.items()}), [K, C])
        assert (fr.table["throughput_ci_low"] == fr.table["throughput"]).all()
        return fr.crossovers.to_dict("records")[0]

    every = crossings({1, 2, 4, 8, 16})
    assert (every["crossover_throughput"], every["pays_again_throughput"]) == (2, 4)
    assert crossover_text(every, "throughput") == "2 (pays again at 4)"
    assert (every["crossover_tpot"], every["pays_again_tpot"]) == (2, 4)
    later = crossings({1, 4, 8, 16})
    assert later["crossover_throughput"] == 8 and math.isnan(later["pays_again_throughput"])
    assert crossover_text(later, "throughput") == "8"
    never = crossings({1, 4})
    assert math.isnan(never["crossover_throughput"]) and crossover_text(never, "throughput") == "none"


@pytest.mark.parametrize("swept,message", [
    ([C], "sweep.engine.speculation.k: a frontier needs a sweep over k"),
    ([K], "sweep.workload.concurrency / sweep.workload.rate: a frontier needs a sweep over the load"),
])
def test_frontier_without_k_or_load_names_the_field(swept, message):
    with pytest.raises(ScenarioError, match=message):
        speculation_frontier(summary_of({(1, 0): [1.0], (1, 2): [2.0]}, {(1, 0): [1.0], (1, 2): [2.0]}), swept)


def test_frontier_needs_k0():
    with pytest.raises(ScenarioError, match="no finished point at k = 0"):
        speculation_frontier(summary_of({(1, 2): [1.0], (1, 4): [2.0]}, {(1, 2): [1.0], (1, 4): [2.0]}), [K, C])


# ---------------------------------------------------------------------------------------------
# the k schedule


@pytest.mark.parametrize("schedule,message", [
    ({0: 2}, "k_schedule: batch size 0 is not a positive integer"),
    ({1.5: 2}, "k_schedule: batch size 1.5 is not a positive integer"),
    ({"x": 2}, "k_schedule: batch size 'x' is not a positive integer"),
    ({1: -1}, "k_schedule: k -1 at batch size 1 is not an integer >= 0"),
    ({1: 2, 8: 5}, "k_schedule: k 5 at batch size 8 is above the proposer's limit (k = 4)"),
    ({4: 2}, "k_schedule: starts at batch size 4; it must start at 1"),
    ({}, "k_schedule: needs at least one"),
])
def test_bad_k_schedule_names_the_field(schedule, message):
    with pytest.raises(ScenarioError, match=r"^engine\.speculation[.:] ?" + re.escape(message)):
        scenario_from_dict({"name": "x", "engine": {"speculation": {"k": 4, "k_schedule": schedule}}})


def test_k_schedule_survives_the_run_directory_round_trip():
    sc = scenario_from_dict({"name": "x", "engine": {"speculation": {"k": 4, "k_schedule": {1: 4, 16: 2, 64: 0}}}})
    again = scenario_from_dict(yaml.safe_load(yaml.safe_dump(sc.model_dump(mode="json"))))
    assert again.engine.speculation.k_schedule == {1: 4, 16: 2, 64: 0}


def test_scheduled_k_is_the_largest_listed_size_not_above_the_batch():
    schedule = ((1, 6), (8, 4), (64, 0))
    assert [scheduled_k(schedule, b) for b in (1, 7, 8, 63, 64, 500)] == [6, 6, 4, 4, 0, 0]


def _point(depth: int, k: int, schedule: dict[int, int] | None, acceptance: str = "replay"):
    spec = {"k": k, "acceptance": {"model": acceptance, "alpha": 0.6}}
    if schedule is not None:
        spec["k_schedule"] = schedule
    sc = scenario_from_dict({
        "name": "ks", "seed": 2,
        "workload": {"concurrency": 12, "num_requests": 36, "prompt_len": {"dist": "uniform", "min": 32, "max": 96},
                     "output_len": {"dist": "uniform", "min": 16, "max": 48}},
        "engine": {"model": "llama-3.2-1b", "speculation": spec},
        "scheduler": {"depth": depth},
    })
    return sc, build_requests(sc.workload, sc.seed)


@pytest.mark.parametrize("depth,acceptance", [(1, "replay"), (2, "replay"), (2, "iid")])
def test_a_constant_schedule_is_that_fixed_k_under_a_higher_limit(depth, acceptance):
    """A schedule giving k = 2 at every batch size, under a proposer limit of 4, schedules, accepts and costs each
    step as a fixed k = 2 does: the step's k, not the limit, drives the scheduler, acceptance and cost model."""
    fixed, scheduled = (simulate(*_point(depth, k, sched, acceptance)) for k, sched in ((2, None), (4, {1: 2})))
    a, b = fixed[0].steps_frame(), scheduled[0].steps_frame()
    common = [c for c in a.columns if not c.startswith("acc_pos_")]
    pd.testing.assert_frame_equal(a[common], b[common])
    assert fixed[1] == scheduled[1]
    assert (b.drafts_scheduled > 0).any()


def test_schedule_gives_each_step_its_batch_sizes_k_and_is_deterministic():
    sc, requests = _point(2, 4, {1: 4, 8: 1})
    records, duration = simulate(sc, requests)
    steps = records.steps_frame()
    again = simulate(sc, build_requests(sc.workload, sc.seed))
    pd.testing.assert_frame_equal(steps, again[0].steps_frame())
    assert duration == again[1]
    decode_rows = steps.n_reqs - steps.n_prefill_reqs
    with_decodes = steps[decode_rows > 0]
    k = with_decodes.drafts_scheduled / (with_decodes.n_reqs - with_decodes.n_prefill_reqs)
    assert set(k) == {1, 4}  # async: every decoding request reserves the step's k slots
    assert (k[with_decodes.n_reqs >= 8] == 1).all()  # a batch of 8 or more holds at least 8
    assert (with_decodes.n_reqs[k == 4] < 8).all()
    # the step's k bounds what is verified and accepted
    assert (with_decodes.drafts_valid <= with_decodes.drafts_scheduled).all()
    assert (with_decodes.accepted <= with_decodes.drafts_valid).all()


def test_a_step_at_k0_under_a_schedule_skips_the_valid_draft_sync():
    """The valid-draft-count sync lets prep trim the step's drafts: a step a schedule gives k = 0 has none."""
    sc, requests = _point(2, 4, {1: 2, 8: 0})
    records, _ = simulate(sc, requests)
    steps = records.steps_frame()
    trims = set(records.syncs_frame().query("name == 'valid_draft_counts'").step)
    decodes = steps[steps.n_reqs > steps.n_prefill_reqs]
    drafted = decodes.drafts_scheduled > 0
    assert drafted.any() and (~drafted).any()
    assert set(decodes.step[drafted]) <= trims and not trims & set(decodes.step[~drafted])


def test_k_schedule_runs_at_hil_and_bad_input_still_exits_2(tmp_path):
    """The CLI runs a k schedule at hil (each step at its batch size's k); one above the proposer's limit is one
    message naming the field, exit 2, nothing written."""

    def run(schedule: dict[int, int], name: str):
        path = tmp_path / f"{name}.yaml"
        speculation = {"k": 2, "k_schedule": schedule}
        workload = {"num_requests": 3, "concurrency": 2, "output_len": {"dist": "fixed", "value": 8}}
        path.write_text(yaml.safe_dump({
            "name": name, "workload": workload,
            "engine": {"level": "hil", "model": "tiny", "device": "cpu", "speculation": speculation},
        }))
        return CliRunner().invoke(app, ["run", str(path), "--out", str(tmp_path / name)])

    ok = run({1: 2, 2: 0}, "ok")
    assert ok.exit_code == 0, ok.output
    steps = pd.read_parquet(next((tmp_path / "ok").rglob("steps.parquet")))
    decodes = steps[steps.n_reqs > steps.n_prefill_reqs]
    k = decodes.drafts_scheduled / (decodes.n_reqs - decodes.n_prefill_reqs)
    assert set(k[decodes.n_reqs >= 2]) == {0} and (k[decodes.n_reqs == 1] > 0).any()
    bad = run({1: 3}, "bad")
    assert bad.exit_code == 2, bad.output
    assert ("engine.speculation: k_schedule: k 3 at batch size 1 is above the proposer's limit (k = 2)"
            in " ".join(bad.stderr.split()))
    assert not (tmp_path / "bad").exists()


# ---------------------------------------------------------------------------------------------
# an 8B sim frontier against the roofline

ALPHA, PROMPT, OUTPUT = 0.7, 8, 64
LOADS = [64, 128, 192, 256]
KS = [0, 1, 2]
NO_HOST = {f: 0.0 for f in ("schedule_us", "schedule_per_req_us", "prep_us", "prep_per_req_us", "prep_per_token_us",
                            "launch_us", "update_us", "update_per_req_us", "sync_us")}


def roofline_throughput(b: int, k: int) -> float:
    """Output tokens/s of b decoding requests at k in closed form: a step emits b * a(k) tokens (a(k) = (1 -
    alpha^(k+1)) / (1 - alpha), i.i.d. acceptance) and computes b * (1 + k) tokens plus its share of prompts; it
    takes the larger of reading the weights and KV cache and computing those tokens (the roofline): memory-bound
    below the ridge point, where drafts are nearly free, compute-bound past it, where each costs a token."""
    shape, gpu, costs = model_config("llama-3-8b"), gpu_spec("H100"), GpuCosts()
    bandwidth = gpu.mem_bandwidth_gbs * 1e9 * costs.mem_efficiency
    flops = gpu.bf16_tflops * 1e12 * costs.compute_efficiency
    emitted = (1 - ALPHA ** (k + 1)) / (1 - ALPHA)
    tokens = b * (1 + k) + b * emitted * PROMPT / OUTPUT
    memory = (shape.weight_bytes + shape.kv_bytes_per_token * b * (PROMPT + OUTPUT / 2 + 1 + k)) / bandwidth
    return b * emitted / max(memory, shape.linear_flops_per_token * tokens / flops)


def test_8b_sim_frontier_crosses_over_where_the_roofline_predicts(tmp_path):
    shape, gpu, costs = model_config("llama-3-8b"), gpu_spec("H100"), GpuCosts()
    ridge = (shape.weight_bytes / (gpu.mem_bandwidth_gbs * costs.mem_efficiency * 1e9)) / (
        shape.linear_flops_per_token / (gpu.bf16_tflops * costs.compute_efficiency * 1e12))  # tokens per step
    predicted = next(b for i, b in enumerate(LOADS) if all(
        roofline_throughput(later, k) < roofline_throughput(later, 0) for later in LOADS[i:] for k in KS[1:]))
    # the mechanism: at the predicted crossover every k > 0 computes past the ridge point, k = 0 does not
    assert all(predicted * (1 + k) > ridge for k in KS[1:]) and predicted < ridge
    sc = scenario_from_dict({
        "name": "roofline-8b",
        "workload": {"requests_per_user": 1, "prompt_len": {"dist": "fixed", "value": PROMPT},
                     "output_len": {"dist": "fixed", "value": OUTPUT}, "kinds": {"free": 1.0}},
        "engine": {"model": "llama-3-8b", "gpu": "H100", "host_costs": NO_HOST, "profile": "none",
                   "speculation": {"k": 4, "acceptance": {"model": "iid", "alpha": ALPHA}}},
        "sweep": {K: KS, C: LOADS},
        "report": {"trace_steps": 0, "timeline_steps": 1},
    })
    result = simharness.run(sc, tmp_path)
    fr = speculation_frontier(result.summary, [K, C])
    measured = fr.crossovers.loc[0, "crossover_throughput"]
    assert abs(LOADS.index(measured) - LOADS.index(predicted)) <= 1, (measured, predicted)
    assert (fr.table.set_index(C)["best_k_throughput"].loc[:128] > 0).all()  # well below the ridge drafts pay
    written = pd.read_csv(result.run_dir / "frontier.csv")  # the report's hook wrote the table and plot
    assert written["best_k_throughput"].tolist() == fr.table["best_k_throughput"].tolist()
    assert (result.run_dir / "plots" / "frontier.png").is_file()
    assert "## Speculation frontier" in (result.run_dir / "report.md").read_text()
    r = CliRunner().invoke(app, ["frontier", str(result.run_dir), "--schedule", str(tmp_path / "k.yaml")])
    assert r.exit_code == 0, r.output
    derived = yaml.safe_load((tmp_path / "k.yaml").read_text())["all"]
    assert derived["k_schedule"][1] > 0 and derived["k"] == max(derived["k_schedule"].values())
    scenario_from_dict({"name": "x", "engine": {"speculation": derived}})  # a valid speculation section


def test_frontier_command_over_a_run_without_k_exits_2(tmp_path):
    sc = scenario_from_dict({"name": "nok", "sweep": {C: [1, 2]}})
    run_dir = new_run_dir(tmp_path, sc)
    summary_of({(1, 4): [1.0], (2, 4): [2.0]}, {(1, 4): [1.0], (2, 4): [2.0]}).to_csv(run_dir / "summary.csv")
    r = CliRunner().invoke(app, ["frontier", str(run_dir)])
    assert r.exit_code == 2, r.output
    assert "sweep.engine.speculation.k: a frontier needs a sweep over k" in " ".join(r.stderr.split())
    assert "Traceback" not in r.output
    assert not (run_dir / "frontier.csv").exists()


def test_frontier_help_lists_its_exit_codes():
    r = CliRunner().invoke(app, ["frontier", "--help"], env={"COLUMNS": "100"})
    assert r.exit_code == 0, r.output
    assert "Exit status: 0 done; 2 not a run directory" in " ".join(r.stdout.split())


def _validation_points(throughput: dict[int, dict[int, float]]) -> pd.DataFrame:
    """A frontier's points.csv from {load: {k: throughput}}, mean TPOT its inverse (the same best k)."""
    return pd.DataFrame([{"workload.kinds": "a", "workload.concurrency": load, K: k, "output_throughput": v,
                          "mean_tpot_ms": 1000 / v} for load, per_k in throughput.items() for k, v in per_k.items()])


def test_frontier_validation_compares_best_k_crossover_and_error():
    compare = load_benchmark("frontier_validation").compare
    measured = _validation_points({1: {0: 100, 2: 150, 4: 200}, 4: {0: 300, 2: 305, 4: 304},
                                   16: {0: 500, 2: 490, 4: 450}})
    sim = _validation_points({1: {0: 90, 2: 200, 4: 180}, 4: {0: 300, 2: 280, 4: 270}, 16: {0: 500, 2: 400, 4: 300}})
    best, cross, points = compare(measured, {"s": sim}, 2.0)
    thr = best[best.metric == "throughput"].set_index("workload.concurrency")
    assert thr["measured_best_k"].tolist() == [4, 2, 0]
    assert thr.loc[4, "measured_ties"] == "0 2 4"  # 305 beats 300 by 1.7%: a tie
    assert thr["s_best_k"].tolist() == [2, 0, 0]
    assert thr["s_k_steps"].tolist() == [1, 1, 0]
    assert best[best.metric == "tpot"]["s_best_k"].tolist() == [2, 0, 0]
    for _, row in cross.iterrows():
        # measured: k = 2 still beats k = 0 at 4 (by 1.7%, a tie), so it stops paying at 16, tie-aware at 4
        assert (row["measured"], row["measured_tie_aware"], row["s"], row["s_tie_aware"]) == (16, 4, 4, 4)
        assert (row["s_steps"], row["s_tie_aware_steps"]) == (1, 0)
    first = points[(points["workload.concurrency"] == 1) & (points[K] == 0)].iloc[0]
    assert first["throughput_s_error_pct"] == pytest.approx(-10.0)
    assert first["tpot_s_error_pct"] == pytest.approx(100 / 90 * 100 - 100)


def test_frontier_validation_counts_no_crossover_one_step_past_the_grid():
    steps = load_benchmark("frontier_validation").steps
    assert steps([1, 4, 16], math.nan, 16) == 1
    assert steps([1, 4, 16], math.nan, 1) == 3
    assert steps([1, 4, 16], 4, 4) == 0
