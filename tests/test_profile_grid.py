"""The profile grid per model (scenarios/profile/grid.yaml, `models`): the 8B runs its own reduced grid by default,
the 1B the grid as it is, a `--set` is never dropped, and a bad `models` entry exits 2 naming it."""

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from simharness.cli import app
from simharness.profile_grid import GRID, grid_points
from simharness.scenario import ScenarioError

BASE = {"scenario": {"name": "g", "engine": {"model": "llama-3.2-1b"}},
        "blocks": {"batch": {"workload.concurrency": [1, 8]}, "depth": {"scheduler.depth": [1, 3]}}}


def write(tmp_path: Path, grid: dict) -> Path:
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(grid, sort_keys=False))
    return path


def test_the_8b_runs_its_models_entry_and_the_1b_the_grid_as_it_is(tmp_path):
    data = yaml.safe_load(GRID.read_text())
    entry = data["models"]["llama-3-8b"]
    _, eight = grid_points(GRID, {"engine.model": "llama-3-8b"})
    for p in eight:
        assert p.scenario.workload.requests_per_user == entry["scenario"]["workload.requests_per_user"]
        # no host-speed retries but in the host block, which sweeps them back on
        assert p.scenario.engine.host_slowdown == (1.2 if p.values["block"] == "host" else None)
    blocks = {p.values["block"] for p in eight}
    assert blocks == set(data["blocks"]) | set(entry["blocks"])
    for name, block in entry["blocks"].items():  # each of the entry's blocks is its own, not the grid's
        at = [p for p in eight if p.values["block"] == name]
        for path, listed in block.items():
            assert {str(p.values[path]) for p in at} <= {str(v) for v in listed}
    fill = [p for p in eight if p.scenario.engine.speculation.invalid_slots == "fill"]
    assert fill and all(p.scenario.engine.speculation.k > 0 for p in fill)  # k = 0 verifies one token either way
    # the 1B: the grid without the entry, point for point
    _, one = grid_points(GRID, {"engine.model": "llama-3.2-1b"})
    plain = write(tmp_path, {k: v for k, v in data.items() if k != "models"})
    _, expected = grid_points(plain, {"engine.model": "llama-3.2-1b"})
    assert [(p.id, p.scenario.model_dump()) for p in one] == [(p.id, p.scenario.model_dump()) for p in expected]
    assert len(eight) < len(one)


def test_a_set_applies_over_the_models_entry_and_over_a_block_that_sweeps_it():
    sets = {"engine.model": "llama-3-8b", "workload.requests_per_user": 2, "engine.host_slowdown": 1.5}
    scenario, points = grid_points(GRID, sets)
    assert {p.scenario.workload.requests_per_user for p in points} == {2}
    assert {p.scenario.engine.host_slowdown for p in points} == {1.5}  # the host block's 1.2 included
    assert "engine.host_slowdown" not in scenario.sweep
    _, concurrency = grid_points(GRID, {"engine.model": "llama-3-8b", "workload.concurrency": 4})
    assert {p.scenario.workload.concurrency for p in concurrency} == {4}


def test_blocks_can_be_picked_and_an_unknown_one_is_named(tmp_path):
    path = write(tmp_path, {**BASE, "models": {"llama-3.2-1b": {"blocks": {"extra": {"scheduler.depth": [3]}}}}})
    _, points = grid_points(path, blocks=["extra", "batch"])
    assert {p.values["block"] for p in points} == {"batch", "extra"}
    with pytest.raises(ScenarioError, match="no block nothing"):
        grid_points(path, blocks=["nothing"])
    _, other = grid_points(path, {"engine.model": "llama-3-8b"})  # another model's entry does not apply
    assert {p.values["block"] for p in other} == {"batch", "depth"}


@pytest.mark.parametrize(
    "models,message",
    [
        ({"llama-99b": {}}, "models.llama-99b: not a catalogue model"),
        ({"llama-3.2-1b": {"blocks": [1]}}, "models.llama-3.2-1b: a mapping of `scenario`"),
        ({"llama-3.2-1b": {"grid": {}}}, "models.llama-3.2-1b: a mapping of `scenario`"),
        ({"llama-3.2-1b": {"blocks": {"batch": {"workload.concurrency": []}}}}, "blocks.batch: a mapping"),
        ({"llama-3.2-1b": {"scenario": {"workload.nothing": 1}}}, "models.llama-3.2-1b.scenario: workload.nothing"),
        ([1], "models: a mapping"),
    ],
)
def test_a_bad_models_entry_exits_2_naming_it(tmp_path, models, message):
    path = write(tmp_path, {**BASE, "models": models})
    r = CliRunner().invoke(app, ["profile", "--grid", str(path), "--runs", str(tmp_path / "runs")])
    assert r.exit_code == 2, r.output
    assert message in " ".join(r.stderr.split())
    assert "Traceback" not in r.output
    assert not (tmp_path / "runs").exists()

