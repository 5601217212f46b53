"""The notebooks execute top to bottom on their (small) default parameters, use only the public API,
and are stored without outputs."""

import ast
import json
import os
import sys
from pathlib import Path

import nbformat
import numpy as np
import pytest
from helpers import PROFILE_MISSES
from nbclient import NotebookClient

import simharness

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
NAMES = ["quickstart.ipynb", "sync-points.ipynb", "seeds.ipynb"]
PUBLIC = set(simharness.__all__)


def _code(nb) -> list[str]:
    return [c.source for c in nb.cells if c.cell_type == "code"]


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_stored_clean_and_uses_the_public_api(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, "store notebooks without outputs"
    used = set()
    for source in _code(nb):
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("simharness"), f"from-import of {node.module}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert alias.name == "simharness" or not alias.name.startswith("simharness"), alias.name
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "simharness":
                used.add(node.attr)
    assert used and used <= PUBLIC, f"not public API: {used - PUBLIC}"
    assert "tempfile" in "".join(_code(nb))  # results go to a temporary directory, not the repo


@pytest.fixture
def python3_kernel(tmp_path, monkeypatch):
    """Make kernel "python3" this interpreter (the venv's), whatever kernelspecs the machine has:
    JUPYTER_PATH comes first in the kernelspec search."""
    spec = tmp_path / "jupyter" / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (simharness tests)",
        "language": "python",
    }))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    return "python3"


@pytest.mark.parametrize("name", [n for n in NAMES if n != "seeds.ipynb"])  # seeds: its own test below
def test_notebook_executes(name, python3_kernel, tmp_path):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    # a last cell that says which interpreter and which simharness the kernel ran
    check = "import sys, simharness; print(sys.executable); print(simharness.__file__)"
    nb.cells.append(nbformat.v4.new_code_cell(check))
    before = sorted(p.name for p in ROOT.iterdir())
    client = NotebookClient(nb, kernel_name=python3_kernel, timeout=300,
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()  # raises CellExecutionError, with the cell and traceback, if any cell fails
    executable, package = nb.cells[-1].outputs[0]["text"].split()
    assert Path(executable).resolve() == Path(sys.executable).resolve()
    assert Path(package).resolve() == (ROOT / "simharness" / "__init__.py").resolve()
    images = sum(1 for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                 if "image/png" in o.get("data", {}))
    assert images >= 2, "the plots did not render"
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.get("output_type") == "error"]
    assert not errors
    assert sorted(p.name for p in ROOT.iterdir()) == before  # nothing written into the repository
    assert not (NOTEBOOKS / "results").exists()
    nbformat.write(nb, tmp_path / name)  # the executed copy, for a look when debugging


def test_frontier_notebook(python3_kernel, tmp_path):
    """notebooks/frontier.ipynb (issue 31): stored clean, public API only, executes on its small live sim grid."""
    test_notebook_is_stored_clean_and_uses_the_public_api("frontier.ipynb")
    test_notebook_executes("frontier.ipynb", python3_kernel, tmp_path)


# ---------------------------------------------------------------------------------------------
# what the quickstart and sync-points notebooks show, asserted on the values they compute


def _facts(name: str, kernel: str, code: str) -> dict:
    """Execute notebook `name` with a last cell that prints the JSON of `code` (an expression over the notebook's
    variables); returns it."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(f"import json; print(json.dumps({code}, default=str))"))
    NotebookClient(nb, kernel_name=kernel, timeout=300, resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return json.loads(nb.cells[-1].outputs[0]["text"])


@pytest.mark.xfail(strict=True, reason="with the H100 cost profile the default sim's async gain is 3.0-5.0% "
                                       "(the notebook's text: 5-20%)")
def test_quickstart_shows_what_async_buys(python3_kernel):
    """The three modes at each concurrency: the same acceptance; sync slower than async waiting for the accepted
    counts (one sync more a step), slower than zero-bubble; zero-bubble keeps the GPU busy, and the printed saving
    is zero-bubble against sync."""
    import pandas as pd

    facts = _facts("quickstart.ipynb", python3_kernel,
                   '{"summary": summary[columns].to_dict(orient="records"), "gain": gain.to_dict()}')
    summary = pd.DataFrame(facts["summary"])
    by = summary.pivot(index="workload.concurrency", columns="mode")
    sync, wait, zero = "sync (depth 1)", "async depth 2, wait for accepted counts", "async depth 2, zero-bubble"
    assert set(by["mean_tpot_ms"].columns) == {sync, wait, zero} and len(by) == 3
    assert (by["acceptance_rate"].nunique(axis=1) == 1).all()  # scheduling does not change what is accepted
    tpot = by["mean_tpot_ms"]
    assert ((tpot[sync] > tpot[wait]) & (tpot[wait] > tpot[zero])).all(), tpot
    assert (by["syncs_per_step"][wait] == by["syncs_per_step"][zero] + 1).all()
    busy = by["gpu_busy_fraction"]
    # with the H100 profile's measured device steps the host's share of a sync step is a few percent
    assert (busy[zero] > 0.99).all() and (busy[sync] < 0.98).all(), busy
    gain = {int(c): v for c, v in facts["gain"].items()}
    assert gain == pytest.approx((100 * (1 - tpot[zero] / tpot[sync])).to_dict())
    assert all(5 < v < 20 for v in gain.values()), gain


@pytest.mark.xfail(strict=True, reason="with the H100 cost profile, removing the valid-draft-count sync changes "
                                       "TPOT -6.9% at 4 and +4.3% at 32 (the notebook's text: < -10%)")
def test_sync_points_shows_what_each_sync_costs(python3_kernel):
    """The claims under the what-if table and the GC plot: removing the only sync before prep restores the
    overlap and cuts TPOT while the GPU verifies more tokens; a second sync at the same place, or the swap, costs
    little; a sync before schedule costs more than one before prep; GC pauses add latency as they become more
    likely, more to the tail than to the mean, and more in relative terms to the faster async loop."""
    import pandas as pd

    facts = _facts("sync-points.ipynb", python3_kernel,
                   '{"table": table.to_dict(orient="records"), "gc": g.to_dict(orient="records")}')
    table = pd.DataFrame(facts["table"]).set_index(["what_if", "workload.concurrency"])
    base = table.loc["as shipped (trim: valid-draft-count sync)"]

    def change(what_if: str, metric: str = "mean_tpot_ms") -> pd.Series:
        return table.loc[what_if][metric] / base[metric] - 1

    removed = table.loc["remove the valid-draft-count sync"]
    assert (removed["gpu_busy_fraction"] > 0.99).all() and (base["gpu_busy_fraction"] < 0.97).all()
    assert (change("remove the valid-draft-count sync") < -0.1).all()
    assert (removed["verified_tokens_per_step"] > 2 * base["verified_tokens_per_step"]).all()
    for second in ("+ accepted-count readback (policy wait)", "+ .item() in metadata build",
                   "swap: remove valid-draft sync, + .item()"):
        assert (change(second).abs() < 0.02).all(), (second, change(second))
    before_schedule = change("+ a sync before schedule")
    assert (before_schedule > change("+ .item() in metadata build") + 0.02).all(), before_schedule
    gc = pd.DataFrame(facts["gc"])
    relative = {}
    for depth, part in gc.groupby("scheduler.depth"):
        part = part.sort_values("engine.gc.probability")
        for metric in ("mean_tpot_ms", "p99_tpot_ms", "p99_itl_ms"):
            assert part[metric].is_monotonic_increasing, (depth, metric)
        added = part[["mean_tpot_ms", "p99_itl_ms"]].iloc[-1] - part[["mean_tpot_ms", "p99_itl_ms"]].iloc[0]
        assert added["p99_itl_ms"] > 5 * added["mean_tpot_ms"] > 0, (depth, added)
        relative[depth] = part["mean_tpot_ms"].iloc[-1] / part["mean_tpot_ms"].iloc[0]
    assert relative[2] > relative[1], relative


def test_seeds_notebook_shows_the_committed_and_live_effects(python3_kernel, tmp_path):
    """seeds.ipynb runs, and the effects it shows are the committed ones (`results/seeds/**/effects.csv`, written
    by benchmarks/seeds.py from the same rows) and, for its live sim run, the posted sign and size within 2x."""
    import pandas as pd

    nb = nbformat.read(NOTEBOOKS / "seeds.ipynb", as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell('print(effects.to_json(orient="records")); '
                                              'print(prompts.to_json(orient="records"))'))
    before = sorted(p.name for p in ROOT.iterdir())
    client = NotebookClient(nb, kernel_name=python3_kernel, timeout=300,
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()
    assert sorted(p.name for p in ROOT.iterdir()) == before and not (NOTEBOOKS / "results").exists()
    images = sum(1 for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {}))
    assert images >= 3, "the plots did not render"
    shown, prompts = (pd.DataFrame(json.loads(line)) for line in nb.cells[-1].outputs[0]["text"].splitlines())
    shown["seed"] = shown["seed"].astype(str)
    results = ROOT / "results" / "seeds"
    for level, path in (("sim", results / "effects.csv"), ("hil", results / "effects.csv"),
                        ("real", results / "effects.csv"),
                        ("sim, host before", results / "host-model" / "before" / "effects.csv")):
        committed = pd.read_csv(path, dtype={"seed": str})
        committed = committed[committed.level == ("sim" if level.startswith("sim") else level)]
        merged = committed.merge(shown[shown.level == level], on=["seed", "metric"], suffixes=("", "_shown"))
        assert len(merged) == len(committed) > 0, level
        assert np.allclose(merged.effect_pct, merged.effect_pct_shown, rtol=1e-9), level
        assert (merged.reproduced == merged.reproduced_shown).all(), level
    live, sim = shown[shown.level == "sim (live)"], shown[shown.level == "sim"]
    assert sorted(zip(live.seed, live.metric, strict=True)) == sorted(zip(sim.seed, sim.metric, strict=True))
    for row in live.itertuples():
        if row.seed in PROFILE_MISSES:  # the profiled sim's known misses (tests/helpers.py): test_seeds pins them
            continue
        assert np.sign(row.effect_pct) == simharness.SEEDS[row.seed].sign[row.metric], (row.seed, row.metric)
        if row.reported_pct is not None and not np.isnan(row.reported_pct):
            assert 0.5 <= row.effect_pct / row.reported_pct <= 2.0, (row.seed, row.metric, row.effect_pct)
    # #29184 at 2, 8 and 16 prompts: both host models, the committed runs' effects
    assert len(prompts) == 6 and set(prompts.prompts) == {2, 8, 16} and set(prompts.host) == {"before", "after"}
    for row in prompts.itertuples():
        committed = pd.read_csv(results / "host-model" / f"{row.host}-29184-c{row.prompts}" / "effects.csv")
        assert row.effect_pct == pytest.approx(committed.effect_pct.iloc[0], rel=1e-9)
