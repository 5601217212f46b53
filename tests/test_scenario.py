"""Scenario validation, overrides and sweep expansion; bad input through the CLI exits 2."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from simharness.overrides import parse_value
from simharness.scenario import (
    ScenarioError,
    ScenarioNote,
    load_scenario,
    scenario_diff,
    scenario_from_dict,
    sweep_points,
    unit_notes,
)

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
    sc = load_scenario(ROOT / "scenarios/quickstart.yaml", {"scheduler.policy": "wait", "engine.speculation.k": 2})
    assert sc.scheduler.policy == "wait" and sc.engine.speculation.k == 2


@pytest.mark.parametrize(
    "data,message",
    [
        ({"scheduler": {"depth": 0}}, "scheduler.depth: Input should be greater than or equal to 1"),
        ({"workload": {"rate": -1}}, "workload.rate: Input should be greater than or equal to 0.001"),
        ({"engine": {"speculation": {"k": -1}}}, "engine.speculation.k: Input should be greater than or equal to 0"),
        ({"engine": {"speculation": {"min_n": 4, "max_n": 2}}}, "engine.speculation: min_n (4) must be <= max_n (2)"),
        ({"sweep": {"scheduler.nope": [1]}}, "sweep.scheduler.nope: scheduler has no field 'nope'"),
        ({"sweep": {"scheduler.depth": []}}, "sweep.scheduler.depth: needs a non-empty list of values"),
        ({"bogus": 1}, "bogus: unknown field"),
        ({"scheduler": {"depth": "two"}}, "scheduler.depth: Input should be a valid integer"),
        ({"engine": {"host_slowdown": 1.0}}, "engine.host_slowdown: Input should be greater than 1"),
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
    measured = scenario_from_dict({"name": "x", "seed": 7, "repeats": 3, "engine": {"level": "hil"}})
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


BASE = "name: x\nworkload: {num_requests: 4, concurrency: 2}\n"


@pytest.mark.parametrize(
    "text,message",
    [
        (BASE + "engine: {gpu: B999}\n", "engine.gpu: unknown GPU 'B999'; known: H100"),
        (BASE + "engine: {model: nope}\n", "engine.model: 'nope' is neither a known model"),
        (BASE + "seed: -1\n", "seed: Input should be greater than or equal to 0"),
        (BASE + "engine: {host_costs: {prep_us: .inf}}\n", "host_costs.prep_us: Input should be a finite number"),
        (BASE + "engine: {gpu_costs: {step_overhead_us: .nan}}\n", "step_overhead_us: Input should be a finite"),
        (BASE + "engine: {gc: {probability: 0.1, mean_ms: .inf}}\n", "engine.gc.mean_ms: Input should be a finite"),
        (BASE + "engine: {gc: {mean_ms: 1e300}}\n", "gc.mean_ms: Input should be less than or equal to 1000000000"),
        ("name: x\nworkload: {arrival: poisson, rate: .inf}\n", "workload.rate: Input should be a finite number"),
        ("name: x\nworkload: {arrival: poisson, rate: 1e-300}\n", "rate: Input should be greater than or equal"),
        (BASE + "engine: {gpu_costs: {mem_bandwidth_gbs: 1e-300}}\n", "gpu_costs.mem_bandwidth_gbs: Input should be "
         "greater than or equal to 1"),
        (BASE + "engine: {gpu_costs: {mem_efficiency: 1e-300}}\n", "engine.gpu_costs.mem_efficiency: Input should be "
         "greater than or equal to 0.01"),
        (BASE + "scheduler: {sync_points: {add: [metadata_item, {name: metadata_item}]}}\n",
         "scheduler.sync_points: add: metadata_item listed more than once"),
        (BASE + "scheduler: {sync_points: {remove: [accepted_counts, accepted_counts]}}\n",
         "scheduler.sync_points: remove: accepted_counts listed more than once"),
        ("name: .\n", "name: '.' is not a usable directory name"),
        ("name: ..\n", "name: '..' is not a usable directory name"),
        (BASE + "seed: 1\nseed: 2\n", "duplicate key 'seed'"),
        (BASE + "scheduler: {depth: 2, depth: 3}\n", "duplicate key 'depth'"),
        (BASE + "scheduler: {depth: true}\n", "scheduler.depth: Input should be a valid integer"),
        (BASE + 'scheduler: {depth: "3"}\n', "scheduler.depth: Input should be a valid integer"),
        (BASE + "scheduler: {depth: 2.0}\n", "scheduler.depth: Input should be a valid integer"),
        (BASE + "scheduler: {chunked_prefill: 1}\n", "scheduler.chunked_prefill: Input should be a valid boolean"),
        (BASE + 'engine: {gc: {probability: "0.1"}}\n', "engine.gc.probability: Input should be a valid number"),
        ("name: x\nworkload: {num_requests: 100000000}\n", "workload.num_requests: Input should be less than or equal "
         "to 100000"),
        ("name: x\nworkload: {concurrency: 1000, requests_per_user: 1000}\n", "above the limit of 100000 requests"),
        ("name: x\nworkload: {output_len: {value: 1000000000}}\n", "output_len.value: Input should be less than"),
        ("name: x\n{1: 2}: 3\n", "a key must be a plain value"),
    ],
)
def test_bad_scenario_file_names_the_field(tmp_path, text, message):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(ScenarioError) as e:
        load_scenario(path)
    assert message in str(e.value)


def test_binary_scenario_file(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_bytes(b"\xff\xfe\x00\x01name: x")
    with pytest.raises(ScenarioError, match="not a UTF-8 text file"):
        load_scenario(path)
    path.write_bytes(b"name: x\x00\x01")
    with pytest.raises(ScenarioError, match="not valid YAML"):
        load_scenario(path)


def test_yaml_floats_without_a_dot_are_numbers():
    sc = scenario_from_dict({"name": "x"}, {"engine.gpu_costs.mem_bandwidth_gbs": parse_value("2e3"),
                                            "workload.rate": parse_value("1E1")})
    assert sc.engine.gpu_costs.mem_bandwidth_gbs == 2000.0 and sc.workload.rate == 10.0


def test_set_on_a_swept_field_replaces_its_sweep_and_says_so():
    data = {"name": "x", "sweep": {"scheduler.depth": [1, 2], "workload.concurrency": [4, 8]}}
    with pytest.warns(ScenarioNote, match=r"--set scheduler.depth replaces sweep.scheduler.depth \[1, 2\]"):
        sc = scenario_from_dict(data, {"scheduler.depth": 3})
    assert sc.sweep == {"workload.concurrency": [4, 8]} and sc.scheduler.depth == 3
    assert {p.scenario.scheduler.depth for p in sweep_points(sc)} == {3}
    # a section above a swept field replaces it too
    with pytest.warns(ScenarioNote, match="replaces sweep.workload.concurrency"):
        sc = scenario_from_dict(data, {"workload": {"concurrency": 2}})
    assert list(sc.sweep) == ["scheduler.depth"]


def test_sweep_is_set_with_a_dotted_key():
    sc = scenario_from_dict({"name": "x", "sweep": {"scheduler.depth": [1, 2]}},
                            {"sweep.scheduler.depth": parse_value("[3, 4]"), "sweep.workload.concurrency": [2]})
    assert sc.sweep == {"scheduler.depth": [3, 4], "workload.concurrency": [2]}
    with pytest.raises(ScenarioError, match="sweep.scheduler.depth: Input should be a valid list"):
        scenario_from_dict({"name": "x"}, {"sweep.scheduler.depth": 3})


def test_scenario_diff_names_the_fields():
    a = scenario_from_dict({"name": "x", "sweep": {"scheduler.depth": [1, 2]}})
    b = scenario_from_dict({"name": "x", "seed": 4, "sweep": {"scheduler.depth": [1, 3]},
                            "engine": {"host_costs": {"prep_us": 1.0}}})
    assert scenario_diff(a, b) == ["seed", "engine.host_costs.prep_us", "sweep.scheduler.depth"]
    assert scenario_diff(a, a) == []


# ---------------------------------------------------------------------------------------------
# issue 36: a section's value merges (1); units (7); errors name their source (8)

FILE = {"name": "x", "workload": {"num_requests": 48, "prompt_len": {"dist": "uniform", "min": 128, "max": 512},
                                  "output_len": {"dist": "fixed", "value": 96}, "kinds": {"code_edit": 1.0}}}


def test_a_section_value_merges_into_the_files_section():
    """`--set 'workload={num_requests: 8}'` and a sweep over a whole section change the fields they name; the
    file's other fields stay (they were reset to their defaults: 128-1024-token prompts, 128-token outputs)."""
    sc = scenario_from_dict(FILE, {"workload": {"num_requests": 8, "prompt_len": {"max": 256}}})
    w = sc.workload
    assert (w.num_requests, w.prompt_len.min, w.prompt_len.max, w.output_len.value) == (8, 128, 256, 96)
    assert w.kinds == {"code_edit": 1.0}
    assert scenario_from_dict(FILE, {"workload.kinds": {"free": 1.0}}).workload.kinds == {"free": 1.0}  # a value
    points = sweep_points(scenario_from_dict({**FILE, "sweep": {"workload": [{"num_requests": 4}, {"rate": 2.0}]}}))
    assert [(p.scenario.workload.num_requests, p.scenario.workload.prompt_len.max,
             p.scenario.workload.output_len.value) for p in points] == [(4, 512, 96), (48, 512, 96)]
    with pytest.raises(ScenarioError, match="workload.bogus: unknown field"):
        scenario_from_dict(FILE, {"workload": {"bogus": 1}})


def test_values_in_an_implausible_unit_are_noted_with_the_unit():
    sc = scenario_from_dict({"name": "x", "engine": {"gpu_costs": {"mem_bandwidth_gbs": 3.35}},
                             "sweep": {"engine.host_costs.prep_us": [200, 2e6]}})
    assert unit_notes(sc) == [
        "engine.gpu_costs.mem_bandwidth_gbs: 3.35 GB/s is outside the plausible 100 to 20,000 GB/s; the field is "
        "in GB/s: is the value in another unit?",
        "sweep.engine.host_costs.prep_us: 2,000,000 µs is outside the plausible 0 to 100,000 µs; the field is in "
        "µs: is the value in another unit?"]
    assert unit_notes(scenario_from_dict({"name": "x", "engine": {"gpu_costs": {"mem_bandwidth_gbs": 3350}}})) == []


@pytest.mark.parametrize(("sets", "message"), [
    (["schedular.depth=2"], "--set schedular.depth: schedular: unknown field (did you mean 'scheduler'?)"),
    (["scheduler.depth=0"], "--set scheduler.depth: Input should be greater than or equal to 1"),
    (["scheduler.depth=[1"], "--set scheduler.depth: cannot parse value '[1': expected ',' or ']'"),
    (["sweep.scheduler.dept=[1]"], "--set sweep.scheduler.dept: scheduler has no field 'dept' (did you mean 'depth'?)"),
    (["workload.requests_per_user=2"], "s.yaml (with --set workload.requests_per_user): workload: set num_requests"),
    (["engine.speculation={min_n: 4, max_n: 2}"], "--set engine.speculation.min_n, engine.speculation.max_n: "
                                                  "engine.speculation: min_n (4) must be <= max_n (2)"),
    (["scheduler.dеpth=2"], "--set scheduler.dеpth: unknown field (its 'е' is the non-ASCII U+0435 CYRILLIC SMALL "
                            "LETTER IE; did you mean 'depth'?)"),
    (["scheduler.policy=wаit"], "--set scheduler.policy: Input should be 'wait' or 'optimistic' (its 'а' is the "
                                "non-ASCII U+0430 CYRILLIC SMALL LETTER A)"),
])  # fmt: skip
def test_errors_name_their_source(tmp_path, sets, message):
    from simharness.overrides import parse_sets

    path = tmp_path / "s.yaml"
    path.write_text("name: x\nworkload: {num_requests: 48}\nengine: {speculation: {k: 3}}\n")
    with pytest.raises(ScenarioError) as e:
        load_scenario(path, parse_sets(sets))
    assert str(e.value).startswith(message.replace("s.yaml", str(path)))  # the source first, the file only if it is
    path.write_text("name: x\nschedulеr: {depth: 2}\n")  # the file's own look-alike key is the file's
    with pytest.raises(ScenarioError, match=f"^{path}: schedulеr: unknown field .*did you mean 'scheduler'"):
        load_scenario(path)


def test_the_level_field_names_the_rows_of_the_levels_table():
    from typing import get_args

    from simharness.levels import LEVELS, LevelName

    assert get_args(LevelName) == tuple(LEVELS)
    assert [name for name, level in LEVELS.items() if not level.measured] == ["sim"]
    assert {level.old_name for level in LEVELS.values()} == {"model", "torch", "real"}


def test_the_old_backend_field_is_read_as_the_level_with_one_note(tmp_path):
    from simharness.levels import _note_old_name

    _note_old_name.cache_clear()
    path = tmp_path / "old.yaml"  # a scenario stored by a run made before engine.level
    path.write_text("name: x\nengine: {backend: torch, device: cpu}\nsweep: {engine.backend: [model, real]}\n")
    with pytest.warns(ScenarioNote) as notes:
        old = load_scenario(path)
        assert load_scenario(path) == old  # a second read (resume, compare) notes nothing more
    assert len(notes) == 1 and "engine.backend is the old name of engine.level" in str(notes[0].message)
    assert old.engine.level == "hil" and old.sweep == {"engine.level": ["sim", "real"]}
    assert old == scenario_from_dict({"name": "x", "engine": {"level": "hil", "device": "cpu"},
                                      "sweep": {"engine.level": ["sim", "real"]}})
    # an old --set on a migrated file (CI_GATE_SET=engine.backend=torch), as a field or in its section
    assert scenario_from_dict({"name": "x", "engine": {"level": "real"}}, {"engine.backend": "torch"}).engine.level \
        == scenario_from_dict({"name": "x"}, {"engine": {"backend": "torch"}}).engine.level == "hil"
    with pytest.raises(ScenarioError, match="engine: backend: the old name of level; set level only"):
        scenario_from_dict({"name": "x", "engine": {"backend": "torch", "level": "hil"}})
    with pytest.raises(ScenarioError, match="engine.level: Input should be 'sim', 'hil' or 'real'"):
        scenario_from_dict({"name": "x", "engine": {"backend": "simulated"}})
