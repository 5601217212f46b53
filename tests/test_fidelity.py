"""`simharness fidelity`: the error arithmetic by hand, the command end to end on a small CPU grid, bad input."""

import errno
import json

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from simharness.cli import app
from simharness.fidelity import (
    TIMELINE,
    check_tolerances,
    fidelity_points,
    host_speed,
    period_split,
    prefill_enqueue,
    run_fidelity,
    spread,
    step_kinds,
    timeline_gaps,
    worst_runs,
)
from simharness.fidelity_report import _gaps_table
from simharness.runner import ignored_fields
from simharness.scenario import load_scenario, scenario_from_dict
from simharness.stats import METRICS, error_stats, error_table

SMALL = {"sweep": {"scheduler.depth": [1, 2]}, "workload.num_requests": 3,
         "workload.output_len": {"dist": "fixed", "value": 8}}  # fmt: skip


def summary_rows(config: str, level: str, tpots: list[float]) -> list[dict]:
    """Summary rows of one point's runs at a level, every metric = 10 except mean TPOT."""
    return [{"config": config, "level": level, "run": r, **dict.fromkeys(METRICS, 10.0), "mean_tpot_ms": t}
            for r, t in enumerate(tpots)]


def test_errors_by_hand():
    runs = {("a", "real"): [2.0, 2.2, 1.8], ("a", "hil"): [2.1, 2.3], ("a", "sim"): [1.0],
            ("b", "real"): [4.0, 4.0], ("b", "hil"): [3.0, 5.0], ("b", "sim"): [5.0]}  # fmt: skip
    summary = pd.DataFrame([row for (config, level), t in runs.items() for row in summary_rows(config, level, t)])
    errors = error_table(summary)
    tpot = errors[errors["metric"] == "mean_tpot_ms"].set_index(["config", "level"])
    # a level's value is its median over runs: real a = 2.0, hil a = 2.2 -> +10%; sim a = 1.0 -> -50%
    assert tpot.loc[("a", "hil"), "rel_error"] == pytest.approx(0.1)
    assert tpot.loc[("a", "sim"), "rel_error"] == pytest.approx(-0.5)
    assert tpot.loc[("b", "hil"), "rel_error"] == pytest.approx(0.0)  # median of 3 and 5 is 4
    assert tpot.loc[("b", "sim"), "rel_error"] == pytest.approx(0.25)
    assert (errors[errors["metric"] != "mean_tpot_ms"]["rel_error"] == 0).all()
    stats = error_stats(errors).set_index(["level", "metric"])
    assert stats.loc[("hil", "mean_tpot_ms"), "median_abs_error"] == pytest.approx(0.05)
    assert stats.loc[("hil", "mean_tpot_ms"), "worst_abs_error"] == pytest.approx(0.1)
    assert stats.loc[("hil", "mean_tpot_ms"), "worst_point"] == "a"
    assert stats.loc[("sim", "mean_tpot_ms"), "median_abs_error"] == pytest.approx(0.375)
    sc = scenario_from_dict({"name": "t", "fidelity": {"tolerances": {
        "hil": {"mean_tpot_ms": {"median": 0.06, "worst": 0.08}}, "sim": {"p99_tpot_ms": {"median": 0.01}}}}})
    assert check_tolerances(error_stats(errors), sc) == ["hil mean_tpot_ms: worst error 10.0% > 8.0%"]
    real = spread(summary, "real").set_index("config")
    assert real.loc["a", "mean_tpot_ms"] == pytest.approx(0.4 / 2.0) and real.loc["a", "runs"] == 3
    assert real.loc["b", "mean_tpot_ms"] == 0


def test_prefill_enqueue_by_hand():
    """Per measured level: steps with prefills, the enqueue per prompt (launch / prompts), counts over each bound;
    decode-only steps and the sim level are left out."""
    summary = pd.DataFrame({"point": ["s", "h", "r"], "level": ["sim", "hil", "real"]})
    launch_ms = {"s": [90, 90], "h": [10, 50, 170, 5], "r": [30, 100, 1]}
    prompts = {"s": [1, 1], "h": [1, 2, 2, 0], "r": [1, 1, 1]}
    steps = pd.DataFrame([{"point": p, "n_prefill_reqs": n, "prep_end": 1.0, "launch_end": 1.0 + ms / 1e3}
                          for p in launch_ms for ms, n in zip(launch_ms[p], prompts[p], strict=True)])
    table = prefill_enqueue(summary, steps).set_index("level")
    assert list(table.index) == ["hil", "real"]
    # hil per prompt: 10, 25, 85 ms (the decode-only step left out); real: 30, 100, 1 ms
    assert table.loc["hil"].tolist() == pytest.approx([3, 25.0, 2, 1, 1])
    assert table.loc["real"].tolist() == pytest.approx([3, 30.0, 2, 1, 1])
    assert prefill_enqueue(summary, pd.DataFrame()).empty


def step_rows(point: str, starts: list[float], parts_us: list[int], prefills: list[int]) -> list[dict]:
    """Steps of one run, each from its schedule start: schedule, prep, launch, device after it, end to settle,
    settle, each `parts_us` long (the settle ends the step's host cycle), harness 7 µs."""
    rows = []
    for i, (start, n) in enumerate(zip(starts, prefills, strict=True)):
        edges = start + np.cumsum([0, *parts_us]) * 1e-6
        rows.append({"point": point, "step": i, "n_prefill_reqs": n, "schedule_start": edges[0],
                     "schedule_end": edges[1], "prep_start": edges[1], "prep_end": edges[2], "launch_end": edges[3],
                     "gpu_start": edges[2], "gpu_end": edges[4], "update_start": edges[5], "propose_end": edges[6],
                     "harness_s": 7e-6})  # fmt: skip
    return rows


def test_period_split_by_hand():
    """Per point and level: each part's median over decode-only steps, the gap to the next schedule, the period, the
    harness time; medians over runs; a deeper point has its own row, the last step (no next schedule) adds nothing
    of its own, a step with prefills is left out."""
    summary = pd.DataFrame({"point": ["h0", "h1", "r0", "d"], "config": ["a", "a", "a", "b"],
                            "level": ["hil", "hil", "real", "real"], "effective_depth": [1, 1, 1, 2]})
    parts = [10, 20, 30, 1000, 40, 50]  # 1150 µs of host cycle and device
    steps = pd.DataFrame([
        *step_rows("h0", [0.0, 0.0012, 0.0024, 0.0036], parts, [0, 0, 1, 0]),  # gaps 50 µs
        *step_rows("h1", [0.0, 0.0013, 0.0026, 0.0039], parts, [0, 0, 0, 0]),  # gaps 150 µs
        *step_rows("r0", [0.0, 0.0012], [5, 20, 30, 1000, 90, 50], [0, 0]),
        *step_rows("d", [0.0, 0.001], parts, [0, 0])])  # fmt: skip
    table = period_split(summary, steps)
    assert table[["config", "level", "depth"]].values.tolist() == [["a", "hil", 1], ["a", "real", 1], ["b", "real", 2]]
    assert table.iloc[2]["period"] == pytest.approx(1000) and table.iloc[2]["launch"] == pytest.approx(30)
    hil, real = table.iloc[0], table.iloc[1]
    assert hil[["schedule", "prep", "launch", "device_after_launch", "end_to_settle", "settle", "harness"]].tolist() \
        == pytest.approx([10, 20, 30, 1000, 40, 50, 7])
    # h0: the gaps of its decode steps 0 and 1 (50 µs; step 2 has a prefill, step 3 no next), h1: 150 µs
    assert hil["gap"] == pytest.approx(100) and hil["period"] == pytest.approx(1250)
    assert real["schedule"] == pytest.approx(5) and real["end_to_settle"] == pytest.approx(90)
    assert real["gap"] == pytest.approx(5) and real["period"] == pytest.approx(1200)  # a cycle of 1195 µs
    assert period_split(summary, steps.iloc[:0]).empty
    assert period_split(summary.drop(columns="effective_depth"), steps).empty


def test_worst_runs_by_hand():
    """Each level's worst mean-TPOT point with its runs and the real level's, and whether their ranges overlap."""
    runs = {("a", "real"): [2.0, 2.2, 1.8], ("a", "hil"): [2.1, 2.3], ("a", "sim"): [1.0],
            ("b", "real"): [4.0, 4.0], ("b", "hil"): [3.0, 5.0], ("b", "sim"): [5.0]}  # fmt: skip
    summary = pd.DataFrame([row for (config, level), t in runs.items() for row in summary_rows(config, level, t)])
    table = worst_runs(summary, error_stats(error_table(summary))).set_index("level")
    # hil: a (+10%), its runs 2.1-2.3 against real 1.8-2.2: they overlap; sim: a (-50%), 1.0 against 1.8-2.2
    assert table.loc["hil", "config"] == "a" and table.loc["hil", "error"] == pytest.approx(0.1)
    assert table.loc["hil", "level_runs"] == [2.1, 2.3] and table.loc["hil", "real_runs"] == [2.0, 2.2, 1.8]
    assert table.loc["hil", "overlap"] and not table.loc["sim", "overlap"]
    assert table.loc["sim", "error"] == pytest.approx(0.5)


def test_step_kinds_by_hand():
    """Per point and level: decode-only steps against steps with a prefill chunk, their mean device period (to the
    next step's device start; the last step has none), the chunk steps' share of the device time, the chunks' median
    device time; medians over runs."""
    summary = pd.DataFrame({"point": ["h0", "h1", "r0"], "config": ["a", "a", "a"], "level": ["hil", "hil", "real"]})

    def run(point, periods_ms, prefills, chunk_ms):
        starts = np.concatenate([[0.0], np.cumsum(periods_ms)]) * 1e-3
        return [{"point": point, "step": i, "n_prefill_reqs": n, "gpu_start": t, "gpu_prefill_s": c * 1e-3}
                for i, (t, n, c) in enumerate(zip(starts, prefills, chunk_ms, strict=True))]

    steps = pd.DataFrame([*run("h0", [2, 6, 2], [0, 1, 0, 0], [np.nan, 4.0, np.nan, np.nan]),
                          *run("h1", [2, 8, 2], [0, 1, 0, 1], [np.nan, 5.0, np.nan, 7.0]),
                          *run("r0", [2, 9, 3], [0, 1, 0, 0], [np.nan, 5.5, np.nan, np.nan])])  # fmt: skip
    table = step_kinds(summary, steps)
    assert table[["config", "level"]].values.tolist() == [["a", "hil"], ["a", "real"]]
    hil, real = table.iloc[0], table.iloc[1]
    # h0: decode periods 2, 2 (the last step has none), one chunk step of 6 (6 / 10 of the time); h1: 2, 2 and 8
    # (the last, a chunk step, has no period): 8 / 12; chunks 4 and 6 ms (the median of 5 and 7)
    assert hil[["decode_steps", "decode_period_ms", "prefill_steps", "prefill_period_ms"]].tolist() \
        == pytest.approx([2.5, 2.0, 1.5, 7.0])
    assert hil["prefill_share"] == pytest.approx((0.6 + 8 / 12) / 2) and hil["chunk_ms"] == pytest.approx(5.0)
    assert real[["decode_period_ms", "prefill_period_ms", "prefill_share", "chunk_ms"]].tolist() \
        == pytest.approx([2.5, 9.0, 9 / 14, 5.5])
    assert step_kinds(summary, steps.iloc[:0]).empty


def test_timeline_gaps_by_hand():
    """Every step's events in time order, the median gap per pair of consecutive events, only between decode-only
    steps' events, medians over runs; ties within a step keep the step's order. The report lists, per point and
    level, the pairs that differ most from the real level's."""
    summary = pd.DataFrame({"point": ["h0", "h1", "r0"], "config": ["a", "a", "a"], "level": ["hil", "hil", "real"]})
    # per step, µs: schedule, (prep starts as schedule ends), prep, launch, device, end to settle, settle, gap
    hil_parts, real_parts = [5, 0, 10, 20, 1000, 40, 15], [5, 0, 10, 20, 1000, 100, 15]

    def run(point, parts, gap_us, prefills):
        rows, t = [], 0.0
        for i, n in enumerate(prefills):
            times = np.cumsum([t, *(p * 1e-6 for p in parts)])
            rows.append({"point": point, "step": i, "n_prefill_reqs": n, **dict(zip(TIMELINE, times, strict=True))})
            t = times[-1] + gap_us * 1e-6
        return rows

    steps = pd.DataFrame([*run("h0", hil_parts, 10, [0, 0, 1, 0]), *run("h1", hil_parts, 30, [0, 0, 1, 0]),
                          *run("r0", real_parts, 20, [0, 0, 1, 0])])  # fmt: skip
    table = timeline_gaps(summary, steps).set_index(["level", "pair"])
    assert table.loc[("hil", "schedule_end → prep_start"), "gap_us"] == pytest.approx(0)
    assert table.loc[("hil", "gpu_end → update_start"), "gap_us"] == pytest.approx(40)
    assert table.loc[("real", "gpu_end → update_start"), "gap_us"] == pytest.approx(100)
    # the gap to the next step only from step 0 to 1 (2 is a chunk step): the median of 10 and 30, 1 of 3 steps
    assert table.loc[("hil", "update_end → schedule_start"), ["gap_us", "share"]].tolist() == pytest.approx([20, 1 / 3])
    assert table.loc[("hil", "prep_end → launch_end"), "share"] == pytest.approx(1.0)
    assert len(table) == 2 * 8  # seven pairs within a step and one between steps, per level
    report = _gaps_table(timeline_gaps(summary, steps).to_dict(orient="records"))
    rows = [line for line in report.splitlines() if line.startswith("| a | hil")]
    assert len(rows) == 3 and rows[0].startswith("| a | hil | gpu_end → update_start | 40 | 100 | -60 |")
    assert timeline_gaps(summary, steps.iloc[:0]).empty
    assert _gaps_table([]).startswith("No point")


def test_host_speed_by_hand():
    summary = pd.DataFrame({"level": ["sim", "hil", "hil", "real", "real", "real"],
                            "host_slowdown": [float("nan"), 1.0, 1.5, 1.1, 1.3, 1.0],
                            "host_attempts": [float("nan"), 1, 3, 1, 2, 1]})  # fmt: skip
    table = host_speed(summary).set_index("level")
    assert table.loc["hil"].tolist() == [2, 1.25, 1.5, 1, 1] and table.loc["real"].tolist() == [3, 1.1, 1.3, 1, 1]
    assert host_speed(summary.drop(columns=["host_slowdown", "host_attempts"])).empty  # runs before the gauge


def test_points_run_each_level_on_the_same_requests():
    sc = load_scenario("scenarios/fidelity-cpu.yaml", SMALL)
    points = fidelity_points(sc, ["sim", "hil", "real"])
    assert len(points) == 2 * (1 + 2 + 2)  # sim once, the measured levels fidelity.runs = 2 times
    assert {p.scenario.engine.level for p in points} == {"sim", "hil", "real"}
    assert {p.scenario.seed for p in points} == {sc.seed}
    assert len({p.id for p in points}) == len(points) and [p.index for p in points] == list(range(len(points)))
    # per sweep point: sim, then the measured levels taking turns run by run
    order = [(p.values["level"], p.values["run"]) for p in points[:5]]
    assert order == [("sim", 0), ("hil", 0), ("real", 0), ("hil", 1), ("real", 1)]


def test_fidelity_end_to_end_on_the_cpu(tmp_path, monkeypatch):
    sc = load_scenario("scenarios/fidelity-cpu.yaml", SMALL)
    result = run_fidelity(sc, tmp_path)
    assert sorted(set(result.summary["level"])) == ["hil", "real", "sim"]
    assert len(result.errors) == 2 * 2 * len(METRICS)  # 2 points x 2 levels checked x metrics
    assert result.errors["rel_error"].notna().all()
    for name in ("report.md", "fidelity.csv", "fidelity.json", "plots/fidelity_scatter.png",
                 "plots/fidelity_errors.png", "summary.csv", "steps.parquet"):
        assert (result.run_dir / name).is_file(), name
    facts = json.loads((result.run_dir / "fidelity.json").read_text())
    assert all(r["identical"] for r in facts["agreement"])  # hil and real emitted the same tokens
    assert len(facts["real_overhead"]) == 2 * 2
    assert {r["level"]: r["runs"] for r in facts["host"]} == {"hil": 4, "real": 4}  # the gauge ran around each
    assert (result.summary.loc[result.summary["level"] != "sim", "host_slowdown"] >= 1).all()
    enqueue = {r["level"]: r for r in facts["prefill_enqueue"]}
    steps = pd.read_parquet(result.run_dir / "steps.parquet")
    levels = result.summary.set_index("point")["level"]
    for level in ("hil", "real"):
        prefills = steps[(steps["point"].map(levels) == level) & (steps["n_prefill_reqs"] > 0)]
        assert enqueue[level]["prefill_steps"] == len(prefills) > 0
        assert enqueue[level]["median_ms"] > 0 and 0 <= enqueue[level]["over_80ms"] <= enqueue[level]["over_20ms"]
    period = pd.DataFrame(facts["period"])
    configs = result.summary["config"].unique()
    assert len(configs) and set(period["config"]) == set(configs)
    assert period.groupby("config")["level"].apply(list).to_dict() == {c: ["sim", "hil", "real"] for c in configs}
    assert set(period["depth"]) == set(result.summary["effective_depth"]) and len(set(period["depth"])) > 1
    assert (period.set_index("level").loc[["hil", "real"], ["period", "harness"]] > 0).all().all()
    kinds = pd.DataFrame(facts["step_kinds"])
    assert kinds.groupby("config")["level"].apply(list).to_dict() == {c: ["sim", "hil", "real"] for c in configs}
    assert (kinds["decode_steps"] > 0).all() and (kinds["prefill_steps"] > 0).all()
    assert ((kinds["prefill_share"] > 0) & (kinds["prefill_share"] < 1)).all()
    # the chunks' device time is measured at hil and real, modelled (none recorded) at the sim level
    measured = kinds.set_index("level").loc[["hil", "real"]]
    assert (measured["chunk_ms"] > 0).all() and (measured["prefill_period_ms"] > 0).all()
    report = result.report.read_text()
    assert "## Where a decode step's time goes" in report
    assert "## Decode-only steps and steps with a prefill chunk" in report
    gaps = pd.DataFrame(facts["gaps"])
    assert set(gaps["level"]) == {"sim", "hil", "real"} and (gaps["gap_us"] >= 0).all()
    section = report.split("## Where the timelines part")[1].split("## ")[0]
    assert any(" | hil | " in line and " → " in line for line in section.splitlines())
    assert {r["level"] for r in facts["worst_runs"]} == {"sim", "hil"}
    assert "Each level's worst point in mean TPOT" in report
    assert "## Error per level and metric" in report and "hil" in report
    assert "## Prefill enqueue on the host" in report and "| real | " in report
    # resume: nothing left to run, the same errors
    again = run_fidelity(sc, tmp_path, resume=result.run_dir)
    pd.testing.assert_frame_equal(again.errors[["config", "level", "metric"]], result.errors[["config", "level",
                                                                                                 "metric"]])
    # the report command re-renders a fidelity run's report
    out = CliRunner().invoke(app, ["report", str(result.run_dir)])
    assert out.exit_code == 0 and "report:" in out.output
    # a full disk while the fidelity report is written: one message, exit 2, the points kept
    from simharness import fidelity_report

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fidelity_report, "write_fidelity_report", full)
    out = CliRunner().invoke(app, ["report", str(result.run_dir)])
    assert out.exit_code == 2 and "Traceback" not in out.output
    assert "cannot write the run (No space left on device)" in " ".join(out.output.split())
    assert len(list((result.run_dir / "points").glob("*/summary.json"))) == len(result.summary)


def test_a_tolerance_exceeded_exits_1(tmp_path):
    scenario = tmp_path / "tight.yaml"
    data = load_scenario("scenarios/fidelity-cpu.yaml", {**SMALL, "sweep": {"scheduler.depth": [1]},
                                                         "fidelity.runs": 1}).model_dump(mode="json")
    data["fidelity"]["tolerances"] = {"sim": {"mean_tpot_ms": {"median": 0.001}}}  # sim is far off on a CPU
    scenario.write_text(json.dumps(data))
    out = CliRunner().invoke(app, ["fidelity", str(scenario), "--out", str(tmp_path / "out")])
    assert out.exit_code == 1, out.output
    assert "tolerance exceeded" in out.output and "sim mean_tpot_ms" in out.output


@pytest.mark.parametrize(("args", "message"), [
    (["--levels", "sim,hil,gpu"], "unknown level 'gpu'"),
    (["--levels", "sim,hil"], "needs the real level"),
    (["--levels", "real"], "needs the real level"),
    (["--set", "sweep={engine.level: [sim, real]}"], "sweep.engine.level"),
    (["--set", "sweep={engine.backend: [model, real]}"], "sweep.engine.level"),  # the old name
    (["--set", "fidelity.runs=0"], "fidelity.runs"),
    (["--set", "fidelity.tolerances.hil.mean_tpot_ms.median=-1"], "fidelity.tolerances.hil.mean_tpot_ms.median"),
    (["--set", "engine.device=cuda"], "engine.device: cuda"),
])  # fmt: skip
def test_bad_input_exits_2_and_writes_nothing(tmp_path, args, message):
    import torch

    if "engine.device=cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = CliRunner().invoke(app, ["fidelity", "scenarios/fidelity-cpu.yaml", "--out", str(tmp_path / "o"), *args])
    assert out.exit_code == 2, out.output
    assert message in out.output and "Traceback" not in out.output
    assert not (tmp_path / "o").exists()


def test_levels_of_a_point_agree_on_its_emitted_tokens():
    """The per-point token check compares every measured run: a differing count is reported."""
    from simharness.fidelity import agreement

    summary = pd.DataFrame({"config": ["a"] * 3 + ["b"] * 2, "level": ["sim", "hil", "real", "hil", "real"],
                            "total_output_tokens": [1, 5, 5, 7, 8], "accepted_tokens": [0, 3, 3, 4, 4]})
    got = agreement(summary).set_index("config")["identical"]
    assert got.to_dict() == {"a": True, "b": False}


def test_fidelity_points_drop_what_each_level_ignores():
    """One scenario drives every level of a fidelity run: each point keeps only what its level reads."""
    sc = load_scenario("scenarios/fidelity-cpu.yaml", {**SMALL, "engine.device": "cpu", "engine.host_slowdown": 1.5})
    points = fidelity_points(sc, ["sim", "hil", "real"])
    for p in points:
        level = p.values["level"]
        assert ignored_fields(p.scenario, level) == []
        assert p.scenario.engine.host_slowdown == (None if level == "sim" else 1.5)
