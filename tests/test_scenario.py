"""Scenario validation, overrides and sweep expansion; bad input through the CLI exits 2."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from simharness.scenario import ScenarioError, load_scenario, scenario_from_dict, sweep_points

ROOT = Path(__file__).resolve().parents[1]


def test_sweep_points_are_a_cartesian_product_with_readable_ids():
    sc = scenario_from_dict({"name": "x", "sweep": {"scheduler.depth": [1, 2], "workload.concurrency": [4, 16]}})
    points = sweep_points(sc)
    assert [p.id for p in points] == [
        "scheduler.depth=1,workload.concurrency=4",
        "scheduler.depth=1,workload.concurrency=16",
        "scheduler.depth=2,workload.concurrency=4",
        "scheduler.depth=2,workload.concurrency=16",
    ]
    assert points[3].scenario.scheduler.depth == 2 and points[3].scenario.workload.concurrency == 16
    assert points[3].values == {"scheduler.depth": 2, "workload.concurrency": 16}
    assert sweep_points(scenario_from_dict({"name": "x"}))[0].id == "base"


def test_overrides_reach_any_field():
    sc = load_scenario(ROOT / "scenarios/quickstart.yaml", {"scheduler.depth": 3, "engine.speculation.k": 2})
    assert sc.scheduler.depth == 3 and sc.engine.speculation.k == 2


@pytest.mark.parametrize(
    "data,message",
    [
        ({"scheduler": {"depth": 0}}, "scheduler.depth: Input should be greater than or equal to 1"),
        ({"workload": {"rate": -1}}, "workload.rate: Input should be greater than 0"),
        ({"engine": {"speculation": {"k": -1}}}, "engine.speculation.k: Input should be greater than or equal to 0"),
        ({"engine": {"speculation": {"min_n": 4, "max_n": 2}}}, "engine.speculation: min_n (4) must be <= max_n (2)"),
        ({"sweep": {"scheduler.nope": [1]}}, "sweep: scheduler.nope: scheduler has no field 'nope'"),
        ({"sweep": {"scheduler.depth": []}}, "sweep.scheduler.depth: needs a non-empty list of values"),
        ({"bogus": 1}, "bogus: unknown field"),
        ({"scheduler": {"depth": "two"}}, "scheduler.depth: Input should be a valid integer"),
        ({"workload": {"prompt_len": {"dist": "uniform", "min": 9, "max": 3}}}, "min (9) must be <= max (3)"),
    ],
)
def test_bad_input_names_the_field(data, message):
    with pytest.raises(ScenarioError) as e:
        scenario_from_dict({"name": "x", **data})
    assert message in str(e.value)


def test_bad_sweep_value_names_the_point():
    sc = scenario_from_dict({"name": "x", "sweep": {"scheduler.depth": [1, 0]}})
    with pytest.raises(ScenarioError, match="sweep point scheduler.depth=0: scheduler.depth"):
        sweep_points(sc)


def test_repeats_are_points_of_their_own_with_consecutive_seeds():
    sc = scenario_from_dict({"name": "x", "seed": 7, "repeats": 3, "sweep": {"scheduler.depth": [1, 2]}})
    points = sweep_points(sc)
    assert [p.id for p in points] == [f"scheduler.depth={d},repeat={r}" for r in range(3) for d in (1, 2)]
    assert [p.index for p in points] == list(range(6))
    assert [p.scenario.seed for p in points] == [7, 7, 8, 8, 9, 9]
    assert points[4].values == {"scheduler.depth": 1, "repeat": 2}
    assert all(p.scenario.repeats == 1 for p in points)
    assert [p.id for p in sweep_points(scenario_from_dict({"name": "x", "repeats": 2}))] == ["repeat=0", "repeat=1"]
    measured = scenario_from_dict({"name": "x", "seed": 7, "repeats": 3, "engine": {"backend": "torch"}})
    assert [p.scenario.seed for p in sweep_points(measured)] == [7, 7, 7]  # the same requests, measured again


@pytest.mark.parametrize("values,twice", [([2, 1, 1, 2], "2"), ([1, 1.0], "1"), (["wait", "wait"], "wait")])
def test_repeated_sweep_value_is_rejected_up_front(values, twice):
    with pytest.raises(ScenarioError, match=rf"sweep.scheduler.x: value {twice} appears more than once; to run a "
                       r"point several times set `repeats: N`"):
        scenario_from_dict({"name": "x", "sweep": {"scheduler.x": values}})


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "simharness", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=120)


@pytest.mark.parametrize(
    "content,args,message",
    [
        (None, [], "cannot read scenario file"),
        ("name: x\nscheduler: {depth: 0}\n", [], "scheduler.depth: Input should be greater than or equal to 1"),
        ("name: [unclosed\n", [], "not valid YAML"),
        ("name: x\n", ["--set", "scheduler.depth=-2"], "scheduler.depth"),
        ("name: x\n", ["--set", "nodots"], "expected KEY=VALUE"),
        ("name: x\nsweep: {engine.speculation.k: []}\n", [], "needs a non-empty list"),
        ("name: x\nscheduler: {sync_points: {remove: [nope]}}\n", [], "unknown sync point 'nope'"),
        ("name: x\nsweep: {scheduler.depth: [2, 1, 1, 2]}\n", [], "scheduler.depth: value 2 appears more than once"),
    ],
)
def test_cli_bad_input_exits_2_without_traceback(tmp_path, content, args, message):
    path = tmp_path / "s.yaml"
    if content is not None:
        path.write_text(content)
    r = cli("run", str(path), "--out", str(tmp_path / "out"), *args, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert message in " ".join(r.stderr.split())
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()  # nothing written for bad input
