"""Reading a run's finished points back: their ids from the batches, and a few points' rows from only the files
that hold them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
from helpers import SMALL

import simharness
from simharness import pointfiles, results
from simharness.scenario import scenario_from_dict

ROOT = Path(__file__).resolve().parents[1]


def test_finished_ids_are_the_summary_rows_ids(tmp_path, monkeypatch):
    """A batch per point, one point's summary gone (not finished): the ids come from the batches' lists, the
    unfinished point left out; a run of the old layout (a directory of tables per point) gives its rows' ids."""
    monkeypatch.setattr(results, "FLUSH_S", 0.0)
    run_dir = simharness.run(scenario_from_dict(SMALL), out=tmp_path).run_dir
    (pointfiles.point_dir(run_dir, 2) / "summary.json").unlink()
    rows = pointfiles.finished_rows(run_dir)
    assert sorted(rows) == [0, 1, 3]
    assert pointfiles.finished_ids(run_dir) == {i: row["point"] for i, row in rows.items()}
    old = Path(shutil.copytree(ROOT / "results" / "quickstart" / "20261123-082759", tmp_path / "old"))
    assert not pointfiles.batch_dirs(old)
    ids = pointfiles.finished_ids(old)
    assert ids and ids == {i: row["point"] for i, row in pointfiles.finished_rows(old).items()}


def test_some_points_are_read_from_the_files_that_hold_them(tmp_path, monkeypatch):
    """A batch per point: asking for two points opens their two files and gives exactly their rows, as filtering
    the run's table would."""
    monkeypatch.setattr(results, "FLUSH_S", 0.0)
    run_dir = simharness.run(scenario_from_dict(SMALL), out=tmp_path).run_dir
    ids = pointfiles.finished_ids(run_dir)
    wanted = {ids[1], ids[3]}
    opened = []
    read_part = pointfiles._read_part
    monkeypatch.setattr(pointfiles, "_read_part", lambda part, *a: opened.append(part.path.parent.name) or
                        read_part(part, *a))
    steps = pointfiles.read_points(run_dir, "steps", points=wanted)
    assert opened == ["batch-00001", "batch-00003"]
    whole = results.read_table(run_dir, "steps")
    pd.testing.assert_frame_equal(steps, whole[whole["point"].isin(wanted)].reset_index(drop=True))
    listed = [json.loads((run_dir / "points" / name / "points.json").read_text()) for name in opened]
    assert {pid for batch in listed for _, pid in batch} == wanted


def test_only_points_no_batch_lists_are_looked_for_in_their_own_directory(tmp_path, monkeypatch):
    """A point a batch lists is read from the batch, with no look at its own directory (a file system call per
    point and table); one that no batch lists (run before batches) is read from its own files."""
    run_dir = simharness.run(scenario_from_dict(SMALL), out=tmp_path).run_dir
    looked = []
    point_table = pointfiles.point_table
    monkeypatch.setattr(pointfiles, "point_table", lambda run_dir, i, name: looked.append(i) or
                        point_table(run_dir, i, name))
    whole = results.read_table(run_dir, "steps")
    pd.testing.assert_frame_equal(pointfiles.read_points(run_dir, "steps"), whole)
    assert looked == []
    (batch,) = pointfiles.batch_dirs(run_dir)  # point 0 made a point of the old layout: its own file, not batched
    first = whole["point"].iloc[0]
    whole[whole["point"] == first].drop(columns="point").to_parquet(pointfiles.point_dir(run_dir, 0) / "steps.parquet",
                                                                 index=False)
    listed = json.loads((batch / "points.json").read_text())
    (batch / "points.json").write_text(json.dumps([p for p in listed if p[0] != 0]))
    whole[whole["point"] != first].to_parquet(batch / "steps.parquet", index=False)
    pd.testing.assert_frame_equal(pointfiles.read_points(run_dir, "steps"), whole)
    assert looked == [0]
