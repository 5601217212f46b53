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
from helpers import SIM_MISSES
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
    # the notebooks write their runs under tempfile.mkdtemp() for a user to look at afterwards; under the tests
    # that is pytest's tmp_path, which pytest prunes (CI had filled the machine's /tmp with them)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
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


def test_quickstart_shows_what_async_buys(python3_kernel):
    """The claims under the quickstart's TPOT plot: the same acceptance in every mode; sync slower than async
    waiting for the accepted counts (one sync more a step), slower than zero-bubble; zero-bubble saves 3-5% of
    mean TPOT (the printed line), more at higher concurrency, roughly the share of a step the GPU idles at depth
    1 (a gap of a few tenths of a ms against a device step of 7-9 ms), which waiting for the counts only
    partly closes."""
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
    busy, bubble, step = by["gpu_busy_fraction"], by["mean_bubble_ms"], by["mean_step_ms"]
    assert (busy[zero] > 0.99).all() and (busy[sync] < 0.98).all(), busy
    # the GPU's gap between steps: a few tenths of a ms at depth 1, less waiting for the counts, none zero-bubble
    assert ((bubble[sync] > bubble[wait]) & (bubble[wait] > 0.1) & (bubble[zero] < 0.01)).all(), bubble
    assert ((bubble[sync] > 0.1) & (bubble[sync] < 0.8)).all() and ((step[sync] > 5) & (step[sync] < 12)).all()
    gain = {int(c): v for c, v in facts["gain"].items()}
    assert gain == pytest.approx((100 * (1 - tpot[zero] / tpot[sync])).to_dict())
    # the text: 3-5%; a change of the saving by 2x either way, or of its sign, fails here
    assert all(2 < v < 7.5 for v in gain.values()), gain
    assert list(gain.values()) == sorted(gain.values()) and len(set(gain.values())) == 3, gain  # grows with load
    idle_share = 100 * bubble[sync] / (step[sync] + bubble[sync])
    ratio = pd.Series(gain) / idle_share
    assert ((ratio > 0.7) & (ratio < 1.5)).all(), (gain, idle_share)


def test_sync_points_shows_what_each_sync_costs(python3_kernel):
    """The claims under the what-if plot and the GC plot. Removing the valid-draft-count sync restores the
    overlap and cuts TPOT by about 9% at 4 users and 5% at 32: the GPU verifies every slot, yet a step is no longer
    (the decode loop's fixed width: 1 + k tokens a row, trimmed or not); throughput rises, TTFT and E2E fall. A
    second sync that waits for the same data costs nothing more (the data
    was read); a `.item()` there costs its round trip, about half of the first sync at 4 users; the swap undoes
    the gain; a `.item()` before schedule costs about 1.6x and 3.4x one before prep. GC pauses: depth 1 exposes
    nearly all pause time, depth 2 hides part of it and suffers less in ms
    and in %; the tail moves much more than the mean."""
    import pandas as pd

    facts = _facts("sync-points.ipynb", python3_kernel,
                   '{"table": table.to_dict(orient="records"), "gc": g.to_dict(orient="records"), '
                   '"removal": removal.reset_index().to_dict(orient="records")}')
    table = pd.DataFrame(facts["table"]).set_index(["what_if", "workload.concurrency"])
    base = table.loc["as shipped (trim: valid-draft-count sync)"]

    def change(what_if: str, metric: str = "mean_tpot_ms") -> pd.Series:
        return table.loc[what_if][metric] / base[metric] - 1

    removed_name = "remove the valid-draft-count sync"
    removed = table.loc[removed_name]
    assert (removed["gpu_busy_fraction"] > 0.99).all() and (base["gpu_busy_fraction"] < 0.97).all()
    assert (removed["mean_bubble_ms"] < 0.01).all() and base["mean_bubble_ms"].between(0.07, 0.3).all()
    assert (removed["verified_tokens_per_step"] > 2 * base["verified_tokens_per_step"]).all()
    removal = pd.DataFrame(facts["removal"]).set_index("workload.concurrency") / 100  # the notebook's own table
    assert removal["mean_tpot_ms"].to_dict() == pytest.approx(change(removed_name).to_dict())
    tpot, step = removal["mean_tpot_ms"], removal["mean_step_ms"]
    # 4 users: -9.1% (text: about 9%); 32 users: -4.9%; the step as long (the fixed width), the step with its
    # bubble -6.4% at 32, throughput +6.8%, TTFT -6.6%, E2E -5.6%
    assert -0.13 < tpot[4] < -0.06 and -0.08 < tpot[32] < -0.025, removal
    assert (step.abs() < 1e-9).all(), step
    assert -0.09 < removal["step_and_bubble_ms"][32] < -0.04, removal.loc[32]
    assert 0.04 < removal["output_throughput"][32] < 0.1 and -0.09 < removal["mean_e2el_ms"][32] < -0.03
    assert -0.1 < removal["mean_ttft_ms"][32] < -0.033, removal.loc[32]
    assert (removal["output_throughput"] > 0).all() and (removal["mean_e2el_ms"] < 0).all()
    # a second sync that waits for the same data: nothing more (the valid-draft sync read it)
    assert change("+ accepted-count readback (policy wait)").abs().max() < 1e-9
    item = change("+ .item() in metadata build")  # its round trip: +5.5% at 4 users, +4.6% at 32
    assert ((item > 0.03) & (item < 0.08)).all() and 0.25 < item[4] / -tpot[4] < 0.75, item
    extra = table.loc["+ .item() in metadata build"]["mean_bubble_ms"] - base["mean_bubble_ms"]  # 0.10 ms
    assert ((extra > 0.03) & (extra < 0.13)).all(), extra
    swap = change("swap: remove valid-draft sync, + .item()")  # -0.1% at 4, -0.5% at 32 (the .item() drains alike)
    assert (swap.abs() < 0.02).all(), swap
    before_schedule = change("+ .item() before schedule") / item  # 1.6x, 3.4x
    assert 1.4 < before_schedule[4] < 4 and 2.5 < before_schedule[32] < 10, before_schedule
    gc = pd.DataFrame(facts["gc"])
    added = {}
    for depth, part in gc.groupby("scheduler.depth"):
        part = part.sort_values("engine.gc.probability")
        for metric in ("mean_tpot_ms", "p99_tpot_ms", "p99_itl_ms"):
            assert part[metric].is_monotonic_increasing, (depth, metric)
        first, last = (part[["mean_tpot_ms", "p99_itl_ms", "mean_bubble_ms", "gc_pause_ms_per_step"]].iloc[i]
                       for i in (0, -1))
        added[depth] = last - first
        assert added[depth]["p99_itl_ms"] > 5 * added[depth]["mean_tpot_ms"] > 0, (depth, added[depth])
        added[depth]["relative"] = last["mean_tpot_ms"] / first["mean_tpot_ms"] - 1
        added[depth]["exposed"] = added[depth]["mean_bubble_ms"] / added[depth]["gc_pause_ms_per_step"]
    # pause time that becomes GPU idle time: 0.58 of 0.59 ms a step at depth 1, 0.35 of 0.62 at depth 2
    assert 0.8 < added[1]["exposed"] < 1.1 and 0.3 < added[2]["exposed"] < 0.8, added
    # mean TPOT +0.37 ms (+28%) at depth 1, +0.23 ms (+20%) at depth 2
    assert 0.3 < added[2]["mean_tpot_ms"] / added[1]["mean_tpot_ms"] < 0.9, added
    assert added[2]["relative"] < added[1]["relative"], added


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
    # the text: the sim misses #32951's mean TPOT (-0.09%, 8B profile; hil and real reproduce it), #41043's P99
    # (-1.9%, 1B profile; hil and real miss it too), and on the roofline #29184 (+7.8%, posted +20.6%) and #38047's
    # TTFT (-9.2%, posted -20%), both of which hil and real reproduce: the misses tests/helpers.SIM_MISSES names
    effect = shown.set_index(["level", "seed", "metric"])
    missed = effect.loc["sim"].index[~effect.loc["sim"].reproduced.astype(bool)]
    assert set(missed) == set(SIM_MISSES), missed
    assert -0.5 < effect.effect_pct["sim", "32951", "mean_tpot_ms"] < 0  # the sign right, far under the posted -3.2%
    assert -4 < effect.effect_pct["sim", "41043", "p99_tpot_ms"] < -1
    assert 4 < effect.effect_pct["sim", "29184", "output_throughput"] < 10.3  # under half the posted +20.6%
    assert -10 < effect.effect_pct["sim", "38047", "mean_ttft_ms"] < -4  # under half the posted -20%
    for level in ("hil", "real"):
        reproduced = effect.reproduced[level]
        assert reproduced["32951", "mean_tpot_ms"] and not reproduced["41043", "p99_tpot_ms"], level
        assert reproduced["29184", "output_throughput"] and reproduced["38047", "mean_ttft_ms"], level
    live, sim = shown[shown.level == "sim (live)"], shown[shown.level == "sim"]
    assert sorted(zip(live.seed, live.metric, strict=True)) == sorted(zip(sim.seed, sim.metric, strict=True))
    for row in live.itertuples():
        if (row.seed, row.metric) in SIM_MISSES:  # the sim's known misses (tests/helpers.py)
            continue
        assert np.sign(row.effect_pct) == simharness.SEEDS[row.seed].sign[row.metric], (row.seed, row.metric)
        if row.reported_pct is not None and not np.isnan(row.reported_pct):
            assert 0.5 <= row.effect_pct / row.reported_pct <= 2.0, (row.seed, row.metric, row.effect_pct)
    # #29184 at 2, 8 and 16 prompts: both host models, the committed runs' effects
    assert len(prompts) == 6 and set(prompts.prompts) == {2, 8, 16} and set(prompts.host) == {"before", "after"}
    for row in prompts.itertuples():
        committed = pd.read_csv(results / "host-model" / f"{row.host}-29184-c{row.prompts}" / "effects.csv")
        assert row.effect_pct == pytest.approx(committed.effect_pct.iloc[0], rel=1e-9)
