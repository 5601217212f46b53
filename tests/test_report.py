"""The report renders from a run directory for any sweep shape (none, 2 points, 2 x 2), and adds the hil
sections only when points were measured on hardware."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from test_trace import as_hil, synthetic_records

import simharness
from simharness import pointfiles, results
from simharness.metrics import compute_metrics
from simharness.records import EMISSION_COLUMNS, REQUEST_COLUMNS
from simharness.report import write_report
from simharness.scenario import scenario_from_dict, sweep_points


def _requests(n: int, tpot_s: float) -> tuple[pd.DataFrame, pd.DataFrame]:
    """n requests of 8 tokens in 4 chunks, a TTFT of 20 ms and the given TPOT."""
    arrival = np.arange(n) * 0.01
    first = arrival + 0.02
    last = first + 7 * tpot_s
    requests = pd.DataFrame({"request_id": np.arange(n), "kind": "free", "arrival_s": arrival, "prompt_tokens": 100,
                             "output_tokens": 8, "first_token_s": first, "last_token_s": last, "num_chunks": 4,
                             "num_drafts": 3, "draft_tokens": 6, "accepted_tokens": 4, "wasted_slots": 0})
    times = first[:, None] + np.array([0.0, 2, 5, 7]) * tpot_s
    emissions = pd.DataFrame({"request_id": np.repeat(np.arange(n), 4), "step": 0, "time_s": times.ravel(),
                              "tokens": np.tile([1, 2, 3, 2], n)})
    return requests[REQUEST_COLUMNS], emissions[EMISSION_COLUMNS]


def make_run(root: Path, sweep: dict) -> Path:
    """A run directory as the runner writes it: scenario.yaml, points/, combined tables, meta.json."""
    scenario = scenario_from_dict({"name": "demo", "seed": 7, "sweep": sweep, "report": {"timeline_steps": 6}})
    run_dir = results.new_run_dir(root, scenario)
    results.write_meta(run_dir, scenario, device="sim (virtual time, cost model)")
    writer = results.PointWriter(run_dir)
    for point in sweep_points(scenario):
        sc = point.scenario
        depth = 1 if sc.engine.speculation.proposer == "ngram_cpu" else sc.scheduler.depth
        steps, syncs = synthetic_records(40, depth=depth, n_reqs=sc.workload.concurrency, gpu_us=200 + 10 * depth)
        requests, emissions = _requests(20, tpot_s=1e-3 * (1 + sc.workload.concurrency / 16) / depth)
        metrics = compute_metrics(requests, emissions, steps, syncs, duration_s=1.0,
                                  percentiles=sc.report.percentiles, goodput=sc.report.goodput, k=2)
        note = f"fell back: depth {sc.scheduler.depth} -> 1" if depth != sc.scheduler.depth else ""
        summary = {"point": point.id, "index": point.index, **point.values, "effective_depth": depth, "note": note,
                   **metrics}
        frames = {"requests": requests, "steps": steps, "syncs": syncs, "emissions": emissions}
        writer.add(point.index, point.id, summary, {name: {c: df[c].to_numpy() for c in df.columns}
                                                    for name, df in frames.items()})
    writer.flush()
    results.combine(run_dir)
    return run_dir


def _render(run_dir: Path) -> str:
    path = write_report(run_dir)
    assert path == run_dir / "report.md"
    for name in ("tpot", "throughput", "gpu_busy", "timeline"):
        png = run_dir / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    text = path.read_text()
    for link in ("plots/tpot.png", "plots/throughput.png", "plots/gpu_busy.png", "plots/timeline.png"):
        assert f"]({link})" in text
    assert "| point | eff. depth | mean TPOT | P99 TPOT | mean TTFT | P99 TTFT | P99 ITL |" in text
    assert "`output_readback`" in text and "`accepted_counts`" in text
    return text


def _table_rows(text: str, section: str) -> list[str]:
    body = text.split(f"## {section}\n")[1].split("\n## ")[0]
    return [line for line in body.splitlines() if line.startswith("| ") and "---" not in line][1:]


def test_no_sweep(tmp_path) -> None:
    text = _render(make_run(tmp_path, {}))
    assert "**Swept:** nothing (one point)." in text
    assert "Run `" in text and "seed 7, 1 point(s); device: sim" in text
    rows = _table_rows(text, "Summary")
    assert len(rows) == 1 and rows[0].startswith("| demo | 2 |")


def test_two_points_without_concurrency(tmp_path) -> None:
    sweep = {"engine.speculation.proposer": ["ngram_gpu", "ngram_cpu"]}
    run_dir = make_run(tmp_path, sweep)
    summary = pd.read_csv(run_dir / "summary.csv")
    summary.loc[0, ["num_drafts", "acceptance_rate", "mean_acceptance_length"]] = 0  # as with proposer none
    summary.to_csv(run_dir / "summary.csv", index=False)
    text = _render(run_dir)
    assert "`engine.speculation.proposer` ∈ {ngram_gpu, ngram_cpu}" in text
    rows = _table_rows(text, "Summary")
    assert [r.split(" | ")[0] for r in rows] == ["| ngram_gpu", "| ngram_cpu"]
    headers = text.split("## Summary\n\n")[1].splitlines()[0].split(" | ")
    accept = headers.index("accept %")
    assert rows[0].split(" | ")[accept : accept + 2] == ["–", "–"]
    assert rows[1].split(" | ")[accept : accept + 2] == ["66.7", "2.33"]  # per request: 4 of 6 tokens, 1 + 4 / 3
    assert rows[1].endswith("| fell back: depth 2 -> 1 |")
    spec = _table_rows(text, "Speculation")
    assert [r.split(" | ")[0] for r in spec] == ["| ngram_cpu"]  # the point without drafts is left out
    assert "at concurrency" not in text


def test_two_by_two_sweep(tmp_path) -> None:
    sweep = {"engine.speculation.proposer": ["ngram_gpu", "ngram_cpu"], "scheduler.depth": [2],
             "workload.concurrency": [4, 32]}
    run_dir = make_run(tmp_path, sweep)
    text = _render(run_dir)
    rows = _table_rows(text, "Summary")
    assert [r.split(" | ")[0] for r in rows] == [
        "| ngram_gpu, depth=2, concurrency=4", "| ngram_gpu, depth=2, concurrency=32",
        "| ngram_cpu, depth=2→1, concurrency=4", "| ngram_cpu, depth=2→1, concurrency=32"]
    assert "at concurrency 4," in text  # the largest concurrency <= 16
    syncs = _table_rows(text, "Host sync points")
    assert {r.split(" | ")[0] for r in syncs} == {"| ngram_gpu, depth=2", "| ngram_cpu, depth=2→1"}
    readback = next(r for r in syncs if r.startswith("| ngram_gpu, depth=2 | `output_readback`"))
    assert readback.split(" | ")[4] == "1.00"  # one output readback per step
    # 20 requests x (3 drafts, 6 draft tokens, 4 accepted); 40 steps x 4 x 2 scheduled slots at concurrency 4
    spec = _table_rows(text, "Speculation")[0].split(" | ")
    assert spec[1:6] == ["60", "120", "320", "66.7", "25.0"]
    assert spec[6] == "0.43 / 0.22 |"  # per-step acc_pos of the generator: 26 and 13 of 60 drafts


def test_rerender_follows_the_files(tmp_path) -> None:
    run_dir = make_run(tmp_path, {"workload.concurrency": [1, 8]})
    assert "| P99 TPOT |" in _render(run_dir)
    scenario = yaml.safe_load((run_dir / "scenario.yaml").read_text())
    scenario["report"]["percentiles"] = [50, 99.9]  # as if the run had been configured so
    (run_dir / "scenario.yaml").write_text(yaml.safe_dump(scenario))
    summary = pd.read_csv(run_dir / "summary.csv")
    summary.rename(columns=lambda c: c.replace("p99_", "p99.9_")).to_csv(run_dir / "summary.csv", index=False)
    text = write_report(run_dir).read_text()
    assert "| P99.9 TPOT |" in text and "| P99 TPOT |" not in text
    assert [r.split(" | ")[0] for r in _table_rows(text, "Summary")] == ["| concurrency=1", "| concurrency=8"]


def test_run_without_finished_points(tmp_path) -> None:
    scenario = scenario_from_dict({"name": "demo"})
    run_dir = results.new_run_dir(tmp_path, scenario)
    results.combine(run_dir)
    assert "No finished sweep points yet." in write_report(run_dir).read_text()


# --------------------------------------------------------------------------------------------
# hardware-in-the-loop sections, from synthetic hil tables written into a real sim run


@pytest.fixture(scope="module")
def sim_run_dir(tmp_path_factory) -> Path:
    """A real two-point sim run (depth 1 and 2)."""
    scenario = scenario_from_dict({
        "name": "tiny", "seed": 1, "sweep": {"scheduler.depth": [1, 2]},
        "workload": {"num_requests": 6, "concurrency": 3, "output_len": {"dist": "fixed", "value": 24}},
    })
    return simharness.run(scenario, out=tmp_path_factory.mktemp("runs")).run_dir


def _as_hil_run(sim_run_dir: Path, tmp_path: Path, device_syncs: pd.DataFrame | None) -> tuple[Path, pd.DataFrame]:
    """A copy of the run whose first point (depth=1) is made a hil point with files of its own, as a run written
    before batches kept them (the batches no longer list it); returns it and that point's steps."""
    run_dir = Path(shutil.copytree(sim_run_dir, tmp_path / sim_run_dir.name))
    summary = pd.read_csv(run_dir / "summary.csv")
    summary.loc[0, "level"] = "hil"
    summary.to_csv(run_dir / "summary.csv", index=False)
    point = results.point_dir(run_dir, int(summary.loc[0, "index"]))
    steps = pointfiles.read_points(run_dir, "steps", points={summary.loc[0, "point"]}).drop(columns="point")
    hil = as_hil(steps)
    hil["harness_s"] = np.arange(len(hil)) * 1e-6  # median: (n - 1) / 2 us
    hil.to_parquet(point / "steps.parquet", index=False)
    (point / "device_syncs.parquet").unlink(missing_ok=True)
    if device_syncs is not None:
        device_syncs[["step", "phase", "site", "wait_s"]].to_parquet(point / "device_syncs.parquet", index=False)
    for name in ("requests", "syncs", "emissions"):  # its other tables, as its own files too
        table = pointfiles.read_points(run_dir, name, points={summary.loc[0, "point"]}).drop(columns="point")
        table.to_parquet(point / f"{name}.parquet", index=False)
    for batch in pointfiles.batch_dirs(run_dir):  # the point's rows and place in the batches go
        listed = json.loads((batch / "points.json").read_text())
        (batch / "points.json").write_text(json.dumps([p for p in listed if p[0] != int(summary.loc[0, "index"])]))
        for path in batch.glob("*.parquet"):
            table = pd.read_parquet(path)
            table[table["point"] != summary.loc[0, "point"]].to_parquet(path, index=False)
    return run_dir, hil


def test_sim_report_has_no_hil_sections(sim_run_dir) -> None:
    text = (sim_run_dir / "report.md").read_text()
    assert "## Host sync points" in text
    assert "## Device sync sites" not in text and "## Measured vs modelled" not in text
    assert write_report(sim_run_dir).read_text() == text


def test_hil_sections(sim_run_dir, tmp_path) -> None:
    syncs = pd.DataFrame({
        "step": [0, 1, 2, 2, 5],
        "phase": ["prep", "prep", "prep", "", "readback"],
        "site": ["simharness/engine/torch_backend.py:150"] * 3 + ["simharness/simulation.py:40", "tests/x.py:7"],
        "wait_s": [1e-3, 2e-3, 3e-3, 0.5e-3, 0.25e-3],
    })
    run_dir, hil = _as_hil_run(sim_run_dir, tmp_path, syncs)
    text = write_report(run_dir).read_text()
    n = len(hil)
    rows = _table_rows(text, "Device sync sites")
    assert rows == [
        f"| depth=1 | `simharness/engine/torch_backend.py:150` | prep | 3 | {3 / n:.2f} | 6.000 | 2.000 |",
        f"| depth=1 | `simharness/simulation.py:40` | – | 1 | {1 / n:.2f} | 0.500 | 0.500 |",
        f"| depth=1 | `tests/x.py:7` | readback | 1 | {1 / n:.2f} | 0.250 | 0.250 |",
    ]
    measured = _table_rows(text, "Measured vs modelled")
    assert len(measured) == 1  # the depth=2 point stays a sim point
    cells = measured[0].strip("| ").split(" | ")
    gpu_ms = (hil["gpu_end"] - hil["gpu_start"]).median() * 1e3
    assert cells[:3] == ["depth=1", "prep, launch, gpu, readback", f"{gpu_ms:.3f}"]
    assert cells[3:8] == [f"{hil[f'gpu_{p}_s'].median() * 1e3:.3f}" for p in ("prefill", "verify", "sample",
                                                                              "commit", "propose")]
    harness_ms = (n - 1) / 2 * 1e-3
    assert cells[8:] == [f"{harness_ms:.3f}", f"{100 * harness_ms / gpu_ms:.1f}"]
    sim_text = (sim_run_dir / "report.md").read_text()
    assert text.startswith(sim_text)  # the sim sections are untouched


def test_hil_run_without_device_syncs(sim_run_dir, tmp_path) -> None:
    empty = pd.DataFrame({"step": pd.Series(dtype="int64"), "phase": pd.Series(dtype=str),
                          "site": pd.Series(dtype=str), "wait_s": pd.Series(dtype="float64")})
    run_dir, hil = _as_hil_run(sim_run_dir, tmp_path, empty)
    section = write_report(run_dir).read_text().split("## Device sync sites\n")[1].split("\n## ")[0]
    assert section.strip() == (f"No synchronizing CUDA operation outside the by-design readback in {len(hil):,} "
                               "steps: torch's sync debug mode caught none (the readback waits on a CUDA event, "
                               "which that mode does not report).")
    for path in [*(run_dir / "points").glob("*/device_syncs.parquet"), run_dir / "device_syncs.parquet"]:
        path.unlink()  # a run from before the table existed
    text = write_report(run_dir).read_text()
    assert "Not recorded: these points have no `device_syncs.parquet`." in text
    assert "## Measured vs modelled" in text


def test_coinciding_lines_stay_distinct() -> None:
    """Two modes with the same values (depth 1 under either policy): each line differs in marker, fill, size and
    dash, so both are seen."""
    from matplotlib.figure import Figure

    from simharness.report import ModeLines, _draw_lines

    summary = pd.DataFrame({"mode": ["wait"] * 2 + ["optimistic"] * 2, "workload.concurrency": [4, 1, 1, 4],
                            "mean_tpot_ms": [3.0, 2.0, 2.0, 3.0]})
    ax = Figure().subplots()
    _draw_lines(ax, summary, ModeLines.of(summary), "mean_tpot_ms", "TPOT")
    a, b = ax.get_lines()
    assert list(a.get_xdata()) == list(b.get_xdata()) == [1, 4]  # each line by concurrency
    assert list(a.get_ydata()) == list(b.get_ydata()) == [2.0, 3.0]
    assert a.get_marker() != b.get_marker() and a.get_linestyle() != b.get_linestyle()
    assert a.get_markersize() > b.get_markersize() and a.get_fillstyle() != b.get_fillstyle()
    assert a.get_color() != b.get_color()
    assert ax.get_legend_handles_labels()[1] == ["wait", "optimistic"]


def test_timeline_title_names_the_steps_drawn() -> None:
    from matplotlib.figure import Figure

    from simharness.report import _draw_timeline

    steps, syncs = synthetic_records(40, depth=2, n_reqs=4, gpu_us=220)
    ax = Figure().subplots()
    span_ms = _draw_timeline(ax, steps.assign(point="p"), syncs.assign(point="p"), 6, "mode")
    drawn = [bar for coll in ax.collections for bar in coll.get_paths()]
    gpu = steps[(steps["gpu_end"] > steps["gpu_start"].min()) & (steps["gpu_start"] < steps["gpu_end"].max())]
    assert drawn and len(gpu)
    title = ax.get_title(loc="left")
    first, last = (int(x) for x in title.split("GPU steps ")[1].split(" in ")[0].split("–"))
    bars = [t for t in ax.texts]  # GPU bars wide enough carry their step number
    assert {int(t.get_text()) for t in bars} <= set(range(first, last + 1))
    assert f"in {span_ms:.2f} ms" in title


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[16:24]
    return int.from_bytes(head[:4], "big"), int.from_bytes(head[4:], "big")


def test_many_modes_keep_their_legend_beside_the_lines(tmp_path, monkeypatch) -> None:
    """40 modes: every plot pastes the one legend image, whole inside the image and over no part of a plot; the
    legend holds every mode."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    import simharness.report as report

    modes = [f"ngram_gpu, optimistic, depth={d}, k={k}" for d in range(1, 6) for k in range(1, 9)]
    summary = pd.DataFrame([{"mode": m, "workload.concurrency": c, "mean_tpot_ms": i + c, "p99_tpot_ms": i + 2 * c,
                             "output_throughput": 100.0 * c, "gpu_busy_fraction": 0.5}
                            for i, m in enumerate(modes) for c in (1, 4, 16)])
    figures, legends = [], []
    monkeypatch.setattr(Figure, "savefig", lambda self, *args, **kwargs: figures.append(self))
    draw_legend = report.legend_image
    monkeypatch.setattr(report, "legend_image", lambda handles, labels, **kw: legends.append(labels) or
                        draw_legend(handles, labels, **kw))
    report._plot_metrics(summary, True, tmp_path)
    assert legends == [modes]  # drawn once
    assert [len(fig.axes) for fig in figures] == [2, 1, 1]
    for fig in figures:
        FigureCanvasAgg(fig).draw()
        (image,) = fig.images
        x0, x1, y0, y1 = image.get_extent()
        assert (y1 - y0, x1 - x0) == image.get_array().shape[:2]
        assert fig.bbox.x0 <= x0 and x1 <= fig.bbox.x1 and fig.bbox.y0 <= y0 and y1 <= fig.bbox.y1
        assert all(ax.get_tightbbox().x1 < x0 for ax in fig.axes)


def test_timeline_of_a_large_sweep_draws_a_few_evenly_spaced_points(tmp_path) -> None:
    from simharness.report import TIMELINE_PANELS, _timeline_points

    summary = pd.DataFrame({"point": [f"p{i}" for i in range(136)], "mode": [f"m{i}" for i in range(136)]})
    where, rows = _timeline_points(summary, by_concurrency=False)
    assert list(rows["point"]) == ["p0", "p19", "p39", "p58", "p77", "p96", "p116", "p135"]
    assert where == f" ({TIMELINE_PANELS} of 136 points, evenly spaced in sweep order)"
    run_dir = make_run(tmp_path, {"scheduler.depth": [1, 2, 3], "engine.speculation.k": [1, 2, 3, 4]})
    text = _render(run_dir)
    assert "(8 of 12 points, evenly spaced in sweep order), one panel per mode" in text
    width, height = _png_size(run_dir / "plots" / "timeline.png")
    assert height <= (0.8 + 1.3 * TIMELINE_PANELS) * 110 + 1, (width, height)


def test_setup_names_the_device_a_level_runs_on(tmp_path) -> None:
    """A sim run models a GPU; a measured run on the CPU is not labelled with the (ignored) engine.gpu."""
    text = _render(make_run(tmp_path, {}))
    assert "**Setup:** `llama-3-8b` on a modelled H100 (sim level)" in text
    run_dir = make_run(tmp_path / "cpu", {})
    stored = yaml.safe_load((run_dir / "scenario.yaml").read_text())
    del stored["engine"]["level"]
    stored["engine"].update(backend="torch", device="cpu", model="tiny")  # a run stored before engine.level
    (run_dir / "scenario.yaml").write_text(yaml.safe_dump(stored))
    text = write_report(run_dir).read_text()
    assert "**Setup:** `tiny` on `cpu` (hil level)" in text and "H100" not in text.split("**Swept")[0]
