"""End to end at the sim level: run directory contents, determinism, resume after a kill."""

import gc
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import SMALL

import simharness
from simharness import results
from simharness.compare import load_run
from simharness.jit import sources_digest
from simharness.modes import resolve_mode
from simharness.pointwork import PointWork, Workloads, point_result
from simharness.runner import combine_and_report
from simharness.scenario import scenario_from_dict, sweep_points
from simharness.trace import trace_events, trace_json, write_traces

ROOT = Path(__file__).resolve().parents[1]


def test_run_writes_the_documented_run_directory(tmp_path):
    result = simharness.run(scenario_from_dict(SMALL), out=tmp_path)
    d = result.run_dir
    assert d.parent == tmp_path / "small"
    for name in ("scenario.yaml", "meta.json", "summary.csv", "summary.json", "requests.parquet", "steps.parquet",
                 "syncs.parquet", "emissions.parquet", "report.md"):
        assert (d / name).is_file(), name
    # traces of the points the report's timeline draws (concurrency 8); the others when asked for
    assert sorted(p.name for p in (d / "traces").glob("*.json")) == [
        "0001_scheduler.depth-1_workload.concurrency-8.json", "0003_scheduler.depth-2_workload.concurrency-8.json"]
    assert len(write_traces(d)) == 4 and len(list((d / "traces").glob("*.json"))) == 4
    assert list(result.summary.point) == [p.id for p in simharness.sweep_points(scenario_from_dict(SMALL))]
    assert {"scheduler.depth", "workload.concurrency", "mean_tpot_ms", "p99_tpot_ms"} <= set(result.summary.columns)
    assert set(result.steps.point) == set(result.summary.point)
    assert len(result.requests) == 4 * 24
    # a second run never overwrites the first
    again = simharness.run(scenario_from_dict(SMALL), out=tmp_path)
    assert again.run_dir != d and d.is_dir()
    meta = json.loads((d / "meta.json").read_text())
    assert meta["source_digest"] == sources_digest()
    git = ["git", "-C", str(ROOT / "simharness")]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    status = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no", "--", "."], capture_output=True,
                            text=True, check=True).stdout  # fmt: skip
    assert meta["git_revision"] == head and meta["git_modified"] == bool(status.strip())
    assert f"source digest `{meta['source_digest'][:12]}`" in (d / "report.md").read_text()


def test_a_trace_written_later_is_the_one_its_point_computed(tmp_path):
    """A trace written from the run's tables (`write_traces`, after the run) is, byte for byte, the one made from
    the point's own records as it ran."""
    sc = scenario_from_dict(SMALL)
    d = simharness.run(sc, out=tmp_path).run_dir
    point = sweep_points(sc)[2]
    result = point_result(point, resolve_mode(point.scenario), Workloads().get(point.scenario), None)
    steps, syncs = (pd.DataFrame(result.tables[name]) for name in ("steps", "syncs"))
    events = trace_events(steps, syncs, max_steps=sc.report.trace_steps)
    (path,) = write_traces(d, {point.id})
    assert path.name.startswith("0002_") and path.read_text() == trace_json(events, {"point": point.id})


def test_a_batch_of_points_tables_is_the_frame_pandas_concatenates():
    """The writer makes a batch's table of the points' arrays (`results.concat_columns`): column for column, types
    and the parquet schema included, what pd.concat makes of the points' frames: points of three k (the steps'
    acc_pos columns some lack), text of several widths, integers beside floats, and columns of other types (objects,
    flags or text that some points lack), which go through pandas."""
    sc = scenario_from_dict({**SMALL, "sweep": {"engine.speculation.k": [3, 0, 5]}})
    points = sweep_points(sc)
    work = PointWork({p.index: resolve_mode(p.scenario) for p in points}, [])
    tables = [work(p).tables for p in points]
    mixed = [{"n": np.array([1, 2]), "s": np.array(["x", "yyy"]), "f": np.array([1, 2])},
             {"n": np.array([], dtype=np.int64), "s": np.array([], dtype=str), "f": np.array([], dtype=np.float64)},
             {"n": np.array([4]), "s": np.array(["zz"]), "f": np.array([0.5])}]
    cases = [[t[name] for t in tables] for name in results.TABLES] + [
        [tables[0]["steps"]], mixed, [*mixed, {"s": np.array(["z"])}],
        [*mixed, {"n": np.array([3]), "s": np.array(["z"]), "f": np.array([1.5]), "o": np.array([None], dtype=object)}],
        [*mixed, {"n": np.array([3]), "s": np.array(["z"]), "f": np.array([1.5]), "b": np.array([True])}],
        [*mixed, {"n": np.array([3]), "f": np.array([1.5])}],
        [{"o": np.array(["x"], dtype=object)}, {"o": np.array([], dtype=object)}],
    ]
    assert {len(t["steps"]) for t in tables} != {0} and len({tuple(t["steps"]) for t in tables}) == 3
    for parts in cases:
        got = results.concat_columns(parts)
        want = pd.concat([pd.DataFrame(p) for p in parts], ignore_index=True)
        pd.testing.assert_frame_equal(got, want, check_exact=True)
        assert pa.Table.from_pandas(got, preserve_index=False).schema.equals(
            pa.Table.from_pandas(want, preserve_index=False).schema, check_metadata=True)


def test_a_run_keeps_the_libraries_out_of_full_collections_and_then_restores_them(tmp_path):
    """While points run, the objects alive at the start (and those the first point loaded) are frozen, out of the
    garbage collector's full passes; the run leaves the collector as it found it."""
    before = gc.get_freeze_count()
    frozen = []
    simharness.run(scenario_from_dict(SMALL), out=tmp_path, progress=lambda _: frozen.append(gc.get_freeze_count()))
    assert gc.get_freeze_count() == before
    assert min(frozen) > before + 10_000 and frozen[-1] > frozen[0]


def test_a_measured_run_leaves_the_heap_as_it_is(tmp_path):
    """At a measured level a full collection's pause over the whole heap is part of what is measured: nothing is
    frozen while its points run."""
    before = gc.get_freeze_count()
    frozen = []
    sc = scenario_from_dict({"name": "hil", "workload": {"num_requests": 3, "concurrency": 2,
                                                         "output_len": {"dist": "fixed", "value": 8}},
                             "engine": {"level": "hil", "model": "tiny", "device": "cpu"}})
    simharness.run(sc, out=tmp_path, progress=lambda _: frozen.append(gc.get_freeze_count()))
    assert frozen and set(frozen) == {before}


def test_a_measured_run_frees_its_engine_before_the_next_run_builds_one(tmp_path, monkeypatch):
    """A run's model, KV cache and step graphs sit in reference cycles: left to the cyclic collector, two runs of one
    process (the 8B's profile grid) held two models at once and the second ran out of GPU memory."""
    import weakref

    from simharness import measured

    engines = []
    build = measured.MeasuredEngine.__init__

    def tracked(self, *args, **kwargs):
        build(self, *args, **kwargs)
        self.cycle = self  # as CUDA's step graphs and events make one
        engines.append(weakref.ref(self))

    monkeypatch.setattr(measured.MeasuredEngine, "__init__", tracked)
    gc.disable()  # no automatic collection: only the run's own release may free it
    try:
        sc = scenario_from_dict({"name": "hil", "workload": {"num_requests": 2, "concurrency": 2,
                                                             "output_len": {"dist": "fixed", "value": 4}},
                                 "engine": {"level": "hil", "model": "tiny", "device": "cpu"}})
        simharness.run(sc, out=tmp_path)
        assert len(engines) == 1 and engines[0]() is None
    finally:
        gc.enable()


def test_only_text_columns_are_dictionary_encoded(tmp_path):
    """The run's and the batches' parquet tables dictionary-encode their text columns and no others (a dictionary
    on every float column made a large table 4x slower to read)."""
    d = simharness.run(scenario_from_dict(SMALL), out=tmp_path).run_dir
    for path in [d / "syncs.parquet", d / "points" / "batch-00000" / "syncs.parquet"]:
        meta = pq.ParquetFile(path).metadata
        schema = pq.read_schema(path)
        for i, field in enumerate(schema):
            encodings = meta.row_group(0).column(i).encodings
            text = pa.types.is_string(field.type) or pa.types.is_large_string(field.type)
            assert ("RLE_DICTIONARY" in encodings) == text, (path.name, field.name, encodings)
        assert {"point", "name"} & set(schema.names)


def test_source_digest_names_the_code_not_the_copy(tmp_path):
    """Equal sources give equal digests wherever they lie; an edit changes it; bytecode caches do not."""
    package = ROOT / "simharness"
    copy = tmp_path / "copy"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert sources_digest(copy) == sources_digest(package)
    (copy / "__pycache__").mkdir(exist_ok=True)
    (copy / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    assert sources_digest(copy) == sources_digest(package)
    policy = copy / "policy.py"
    policy.write_text(policy.read_text() + "\n")
    assert sources_digest(copy) != sources_digest(package)


def test_same_seed_gives_a_bit_identical_summary(tmp_path):
    a = simharness.run(scenario_from_dict(SMALL), out=tmp_path / "a")
    b = simharness.run(scenario_from_dict(SMALL), out=tmp_path / "b")
    assert (a.run_dir / "summary.csv").read_bytes() == (b.run_dir / "summary.csv").read_bytes()
    other = simharness.run(scenario_from_dict({**SMALL, "seed": 4}), out=tmp_path / "c")
    assert (other.run_dir / "summary.csv").read_bytes() != (a.run_dir / "summary.csv").read_bytes()


def test_repeats_are_bit_identical_for_a_seed_and_each_is_its_seeds_run(tmp_path):
    """Repeat r of a run with `repeats` is the run with seed + r, to the bit; the report gives the medians."""
    small = {**SMALL, "sweep": {"scheduler.depth": [1, 2]}}
    a = simharness.run(scenario_from_dict({**small, "repeats": 3}), out=tmp_path / "a")
    b = simharness.run(scenario_from_dict({**small, "repeats": 3}), out=tmp_path / "b")
    assert (a.run_dir / "summary.csv").read_bytes() == (b.run_dir / "summary.csv").read_bytes()
    assert list(a.summary["repeat"]) == [0, 0, 1, 1, 2, 2]
    single = simharness.run(scenario_from_dict({**small, "seed": SMALL["seed"] + 2}), out=tmp_path / "c").summary
    repeat = a.summary[a.summary["repeat"] == 2].reset_index(drop=True)
    metrics = [c for c in single.columns if c not in ("point", "index")]
    pd.testing.assert_frame_equal(repeat[metrics], single[metrics], check_exact=True)
    medians = pd.read_csv(a.run_dir / "summary_median.csv")
    assert list(medians["repeats"]) == [3, 3] and "ci_low.mean_tpot_ms" in medians
    assert "[" in (a.run_dir / "report.md").read_text().split("## Summary")[1].split("## Plots")[0]


def test_resume_finishes_missing_points_without_redoing_others(tmp_path):
    """What a kill between a batch and its points' summaries leaves: the batch lists points 2 and 3, which are not
    finished. Resume runs exactly those, into a batch of their own, and the run's tables hold each point once, in
    point order: as the uninterrupted run's."""
    sc = scenario_from_dict(SMALL)
    full = simharness.run(sc, out=tmp_path / "full")
    cut = simharness.run(sc, out=tmp_path / "cut")
    points = cut.run_dir / "points"
    kept = points / "0000"
    kept_mtime = (kept / "summary.json").stat().st_mtime_ns
    shutil.rmtree(points / "0002")
    shutil.rmtree(points / "0003")
    assert results.finished_points(cut.run_dir) == {0, 1}
    resumed = simharness.run(sc, resume=cut.run_dir)
    assert (kept / "summary.json").stat().st_mtime_ns == kept_mtime  # not redone
    assert [json.loads((p / "points.json").read_text()) for p in sorted(points.glob("batch-*"))][1] == [
        [2, "scheduler.depth=2,workload.concurrency=2"], [3, "scheduler.depth=2,workload.concurrency=8"]]
    pd.testing.assert_frame_equal(resumed.summary, full.summary)
    for name in results.TABLES:
        pd.testing.assert_frame_equal(results.read_table(cut.run_dir, name), results.read_table(full.run_dir, name))


def test_points_written_a_batch_each_give_the_same_run(tmp_path, monkeypatch):
    """Batches as small as one point (a flush after every point, as for points that take seconds) give the run
    of one batch: the batch boundary is bookkeeping."""
    sc = scenario_from_dict(SMALL)
    one = simharness.run(sc, out=tmp_path / "one")
    monkeypatch.setattr(results, "FLUSH_S", 0.0)
    each = simharness.run(sc, out=tmp_path / "each")
    assert len(list((each.run_dir / "points").glob("batch-*"))) == 4
    assert len(list((one.run_dir / "points").glob("batch-*"))) == 1
    assert (each.run_dir / "summary.csv").read_bytes() == (one.run_dir / "summary.csv").read_bytes()
    for name in results.TABLES:
        pd.testing.assert_frame_equal(results.read_table(each.run_dir, name), results.read_table(one.run_dir, name))


@pytest.mark.parametrize("committed", ["quickstart/20261123-082759", "hil/20261123-171526"])
def test_a_committed_run_of_the_old_layout_reports_and_keeps_its_tables(tmp_path, committed):
    """Runs on disk from before batches still report and compare: one with a directory of tables per point, one
    that kept only its run-level tables (whose report must not empty them)."""
    run_dir = Path(shutil.copytree(ROOT / "results" / committed, tmp_path / "run"))
    before = {name: results.read_table(run_dir, name) for name in results.TABLES}
    summary = combine_and_report(run_dir)
    assert len(summary) == len(json.loads((ROOT / "results" / committed / "summary.json").read_text()))
    for name, table in before.items():
        if len(table.columns):
            pd.testing.assert_frame_equal(results.read_table(run_dir, name), table)
    assert "## Host sync points" in (run_dir / "report.md").read_text()
    assert load_run(run_dir).summary.equals(load_run(ROOT / "results" / committed).summary)


def test_point_work_travels_without_its_state_and_keeps_it_between_points():
    """A worker process gets the work pickled, with a fresh state; within the process the state (the last requests,
    the measured engine) is kept from one point to the next."""
    sc = scenario_from_dict(SMALL)
    points = sweep_points(sc)
    work = PointWork({p.index: resolve_mode(p.scenario) for p in points}, [])
    work(points[0])
    requests = work.state.workloads.requests
    assert requests is not None
    copy = pickle.loads(pickle.dumps(work))
    assert copy.key == work.key and copy.state.workloads.requests is None
    work(points[2])  # the same workload section and seed (depth differs): the requests are kept
    assert work.state.workloads.requests is requests


def test_killed_cli_sweep_keeps_finished_points_and_resumes(tmp_path):
    scenario = tmp_path / "s.yaml"
    # Enough points (about 0.5 s each here) that the 34 left after the second cannot all finish before the signal
    # lands, even on a loaded machine: with 12 points a run once exited 0, as one that finished first would.
    big = {**SMALL, "workload": {**SMALL["workload"], "num_requests": 600},
           "sweep": {"scheduler.depth": [1, 2, 3], "workload.concurrency": [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32]}}
    import yaml

    scenario.write_text(yaml.safe_dump(big))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "simharness", "run", str(scenario), "--out", str(tmp_path / "out")]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    run_dirs = []
    while time.time() < deadline:
        run_dirs = list((tmp_path / "out" / "small").glob("*/points/0001"))
        if run_dirs:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert run_dirs, "no point finished in time"
    run_dir = run_dirs[0].parents[1]
    finished = {p.name for p in (run_dir / "points").iterdir() if (p / "summary.json").is_file()}
    assert proc.returncode == 130 and "--resume" in stderr, stderr[-3000:]
    assert 2 <= len(finished) < 36
    r = subprocess.run(cmd + ["--resume", str(run_dir)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "report:" in r.stdout
    summary = pd.read_csv(run_dir / "summary.csv")
    assert len(summary) == 36 and summary["index"].tolist() == list(range(36))


def test_cli_summary_table_keeps_numbers_whole_on_a_narrow_terminal(tmp_path):
    """The summary `simharness run` prints: each point labelled by its swept values as in the report, each
    number on one line even at 80 columns (the label folds instead)."""
    from rich.console import Console

    from simharness.cli import summary_table

    result = simharness.run(scenario_from_dict(SMALL), out=tmp_path)
    console = Console(width=80, record=True)
    console.print(summary_table(result.summary, ["scheduler.depth", "workload.concurrency"]))
    text = console.export_text()
    for _, row in result.summary.iterrows():
        assert f"depth={row['scheduler.depth']}," in text
        numbers = rf"{row['mean_tpot_ms']:.3f} +{row['p99_tpot_ms']:.3f} +{row['mean_ttft_ms']:.1f} "
        assert any(re.search(numbers, ln) for ln in text.splitlines()), numbers


def test_measured_points_on_two_models_are_bad_input_before_anything_is_written(tmp_path):
    """A measured run builds one model on one device for all its points: sweeping the model is refused up front."""
    doc = {**SMALL, "engine": {"level": "hil", "device": "cpu", "cuda_graphs": False},
           "sweep": {"engine.model": ["tiny", "llama-3.2-1b"]}}
    try:
        simharness.run(scenario_from_dict(doc), out=tmp_path)
    except simharness.ScenarioError as e:
        assert "engine.model / engine.device / engine.cuda_graphs" in str(e)
    else:
        raise AssertionError("a sweep over the measured model ran")
    assert not any(tmp_path.iterdir())


def test_a_field_the_level_ignores_is_named_not_silently_dropped(tmp_path):
    """A sim point ignores the decode loop's fields: it says so in a warning and in its note."""
    sc = scenario_from_dict({**SMALL, "sweep": {}, "engine": {**SMALL.get("engine", {}), "steer": False,
                                                               "host_slowdown": 1.5}})  # fmt: skip
    with pytest.warns(UserWarning, match="engine.steer, engine.host_slowdown: set, but a sim point runs no decode"):
        result = simharness.run(sc, out=tmp_path)
    assert "engine.steer, engine.host_slowdown: set, but a sim point runs no decode loop; ignored" in \
        result.summary["note"].iloc[0]

