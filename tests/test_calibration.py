"""`simharness calibrate`: the fit recovers known costs from synthetic step records, a sim run calibrated from its
own records reproduces itself, the calibration reaches the sim through `engine.calibration`, bad input exits 2."""

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

import simharness
from simharness.calibration import FitData, _emission_counts, calibrate, load_fit_data, step_reads
from simharness.cli import app
from simharness.costfile import DEVICE_FEATURES
from simharness.scenario import ScenarioError, load_scenario

# µs per unit of each DEVICE_FEATURES: a constant, then linear in rows, tokens, context and prefill
TRUE_DEVICE_US = {"step": 400.0, "decode_rows": 12.0, "decode_tokens": 3.0, "decode_context": 0.02,
                  "prefill_reqs": 300.0, "prefill_tokens": 1.5, "ngram_gpu_step": 40.0, "ngram_gpu_context": 0.01}
TRUE_HOST = {"prep_us": 180.0, "prep_per_req_us": 4.0, "prep_per_token_us": 0.1, "launch_us": 900.0,
             "launch_per_req_us": 2.0, "launch_per_prefill_us": 5000.0, "sync_us": 80.0, "sync_per_req_us": 1.5}


def synthetic_steps(kind: str, n: int = 4000, seed: int = 0) -> pd.DataFrame:
    """Step records whose device and host times follow TRUE_* exactly (`constant`: only the constant terms are
    non-zero; `linear`: every term), or times 5% lognormal noise (`noisy`)."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(1, 65, n)
    prefill = (rng.random(n) < 0.1).astype(int)
    ngram_gpu = (rng.random(n) < 0.5).astype(float)
    f = pd.DataFrame({"step": 1.0, "decode_rows": rows, "decode_tokens": rows * rng.integers(1, 6, n),
                      "decode_context": rows * rng.integers(200, 1200, n), "prefill_reqs": prefill,
                      "prefill_tokens": prefill * rng.integers(100, 1000, n), "ngram_gpu_step": ngram_gpu})
    f["ngram_gpu_context"] = ngram_gpu * f["decode_context"]
    f["n_reqs"] = rows + prefill
    f["n_tokens"] = f["decode_tokens"] + f["prefill_tokens"]
    device, host = dict(TRUE_DEVICE_US), dict(TRUE_HOST)
    if kind == "constant":
        device = {k: v if k == "step" else 0.0 for k, v in device.items()}
        host = {k: v if k in ("prep_us", "launch_us", "sync_us") else 0.0 for k, v in host.items()}
    noise = (lambda: np.exp(rng.normal(0, 0.05, n))) if kind == "noisy" else (lambda: 1.0)  # noqa: E731
    f["device_s"] = f[list(DEVICE_FEATURES)].to_numpy() @ np.array([device[k] for k in DEVICE_FEATURES]) * 1e-6
    f["device_s"] *= noise()
    f["prep_s"] = (host["prep_us"] + host["prep_per_req_us"] * f["n_reqs"] + host["prep_per_token_us"] *
                   f["n_tokens"]) * 1e-6 * noise()
    f["launch_s"] = (host["launch_us"] + host["launch_per_req_us"] * f["n_reqs"] + host["launch_per_prefill_us"] *
                     f["prefill_reqs"]) * 1e-6 * noise()
    f["readback_s"] = (host["sync_us"] + host["sync_per_req_us"] * f["n_reqs"]) * 1e-6 * noise()
    f["schedule_s"] = f["update_s"] = f["propose_s"] = np.nan
    f["proposed"] = f["history"] = 0
    f["measured"] = "prep,launch,gpu,readback"
    return f, device, host


@pytest.mark.parametrize("kind", ["constant", "linear", "noisy"])
def test_fit_recovers_known_costs(kind):
    """Exact records: every coefficient within 0.1% (absolute 1e-3 µs for zeros). Noisy (5%) records: each
    coefficient within 5% of its value (or 2% of the constant's scale in absolute), k-fold error about the noise."""
    steps, device, host = synthetic_steps(kind)
    data = FitData(steps, "NVIDIA H100 80GB HBM3", "H100", "llama-3.2-1b", "hil")
    cal = calibrate(data)
    for name, value in device.items():
        fitted = cal["device_step_us"][name]
        if kind == "noisy":
            scale = {"decode_context": 0.02 * 0.05, "ngram_gpu_context": 0.01 * 0.2}.get(name, 0.02 * device["step"])
            assert fitted == pytest.approx(value, rel=0.05, abs=scale), name
        else:
            assert fitted == pytest.approx(value, rel=1e-3, abs=1e-3), name
    for name, value in host.items():
        assert cal["host_costs"][name] == pytest.approx(value, rel=0.05 if kind == "noisy" else 1e-3, abs=1e-3), name
    assert cal["kept_from_scenario"] == ["schedule_us", "schedule_per_req_us", "update_us", "update_per_req_us",
                                         "ngram_cpu_us", "ngram_cpu_per_req_us", "ngram_cpu_per_token_ns"]
    error = cal["quality"]["device"]["median_rel_error"]
    assert error < 1e-6 if kind != "noisy" else 0.02 < error < 0.05  # median |lognormal 5%| is 3.4%


def test_each_step_is_read_once_where_the_real_loop_reads_it():
    """Steps 0-3 at depth 2, a valid-draft-count sync in each prep (all launched): step 1's reads step 0 alone,
    step 2's finds step 0 settled and reads step 1, step 3's finds nothing in flight; step 2 is read at its settle
    (no sync after its launch) and step 3 too. Each read runs from the step's device end or the read's start. hil
    reads every step at its settle."""
    steps = pd.DataFrame({"step": [0, 1, 2, 3], "launch_end": [1.0, 2.0, 4.0, 9.0], "gpu_end": [3.0, 5.0, 7.5, 10.0]})
    rows = [(1, "valid_draft_counts", "prep", "all_launched", 1.5, 3.2),  # reads 0: from its end at 3.0
            (0, "output_readback", "update", "oldest_in_flight", 3.3, 3.31),  # read already: no sample
            (2, "valid_draft_counts", "prep", "all_launched", 3.5, 5.4),  # reads 1: from its end at 5.0
            (1, "output_readback", "update", "oldest_in_flight", 5.5, 5.51),
            (2, "output_readback", "update", "oldest_in_flight", 7.0, 7.8),  # a settle read: from its end at 7.5
            (3, "valid_draft_counts", "prep", "all_launched", 8.0, 8.01),  # nothing launched unread: no read
            (3, "output_readback", "update", "oldest_in_flight", 10.5, 10.6)]  # read from its start
    syncs = pd.DataFrame(rows, columns=["step", "name", "phase", "waits_for", "start_s", "end_s"])
    reads = step_reads(steps, syncs, "real").sort_index()
    np.testing.assert_allclose(reads.to_numpy(), [0.2, 0.4, 0.3, 0.1])
    assert list(reads.index) == [0, 1, 2, 3]
    # hil measures every readback at the settle (its syncs wait in virtual time)
    np.testing.assert_allclose(step_reads(steps, syncs, "hil").sort_index().to_numpy(), [0.01, 0.01, 0.3, 0.1])


def test_context_is_rebuilt_from_emissions():
    """Request 0 (prompt 10, 6 tokens): its prefill emits 1 at step 0, decodes emit 2 at step 1 and 3 at step 2.
    Request 1 (prompt 20, 2 tokens) emits 1 at step 1 (prefill) and 1 at step 2 (finishes)."""
    requests = pd.DataFrame({"request_id": [0, 1], "prompt_tokens": [10, 20], "output_tokens": [6, 2]})
    emissions = pd.DataFrame({"request_id": [0, 0, 1, 0, 1], "step": [0, 1, 1, 2, 2], "tokens": [1, 2, 1, 3, 1]})
    c = _emission_counts(requests, emissions).set_index("step")
    assert list(c["emitting_decodes"]) == [0, 1, 2]
    assert list(c["emitting_context"]) == [0, 11, 13 + 21]  # context before the step: prompt + tokens so far
    assert list(c["proposed"]) == [1, 2, 0]  # still running after the step
    assert list(c["history"]) == [11, 13 + 21, 0]


SIM = {"name": "cal", "seed": 3,
       "workload": {"num_requests": 48, "prompt_len": {"dist": "uniform", "min": 32, "max": 128},
                    "output_len": {"dist": "fixed", "value": 64}},
       "engine": {"model": "llama-3.2-1b", "profile": "none", "speculation": {"k": 4, "invalid_slots": "fill"}},
       "sweep": {"scheduler.depth": [1, 2], "workload.concurrency": [4, 16]},
       "report": {"trace_steps": 10, "timeline_steps": 2}}  # fmt: skip
H100 = "hil: NVIDIA H100 80GB HBM3, torch 2.11.0, model 16 layers"


def as_measured(run_dir: Path, device: str = H100) -> Path:
    """Relabel a sim run as a hil run on `device` whose prep, launch, device and readback were measured."""
    for path in (run_dir / "points").glob("*/summary.json"):
        path.write_text(json.dumps({**json.loads(path.read_text()), "level": "hil"}))
    for path in [*(run_dir / "points").glob("*/steps.parquet"), *run_dir.glob("steps.parquet")]:  # batches, run's
        pd.read_parquet(path).assign(measured="prep,launch,gpu,readback").to_parquet(path, index=False)
    meta = json.loads((run_dir / "meta.json").read_text())
    (run_dir / "meta.json").write_text(json.dumps({**meta, "device": device}))
    return run_dir


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory) -> Path:
    return simharness.run(simharness.scenario_from_dict(SIM), out=tmp_path_factory.mktemp("sim")).run_dir


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def test_sim_calibrated_from_its_own_records_reproduces_itself(sim_run, tmp_path):
    """The roofline is linear in what a step holds while memory bound (the 1B shape, short prompts: its max(memory,
    compute) is not linear once a prefill is compute bound): the fit's median error stays under 2%; the host
    costs are recovered within 1%; the calibrated sim gives the same mean TPOT within 2%."""
    measured = as_measured(shutil.copytree(sim_run, tmp_path / "run"))
    costs = tmp_path / "costs.yaml"
    r = invoke("calibrate", str(measured), "--out", str(costs))
    assert r.exit_code == 0, r.output
    cal = yaml.safe_load(costs.read_text())
    assert (cal["gpu"], cal["model"], cal["level"]) == ("H100", "llama-3.2-1b", "hil")
    assert cal["provenance"]["runs"][0]["points"] == 4 and cal["provenance"]["runs"][0]["source_digest"]
    assert cal["quality"]["device"]["median_rel_error"] < 0.02
    host = load_scenario(measured / "scenario.yaml").engine.host_costs
    for name in ("prep_us", "prep_per_req_us", "launch_us", "sync_us"):
        assert cal["host_costs"][name] == pytest.approx(getattr(host, name), rel=0.01), name
    calibrated = simharness.run(simharness.scenario_from_dict(SIM, {"engine.calibration": str(costs)}),
                                out=tmp_path / "calibrated")
    base = pd.read_csv(sim_run / "summary.csv").set_index("point")
    again = calibrated.summary.set_index("point")
    assert np.allclose(again["mean_tpot_ms"], base["mean_tpot_ms"], rtol=0.02)


def test_a_run_kept_as_its_run_level_tables_is_read_as_the_run(sim_run, tmp_path):
    """A committed run may keep only its run-level tables and summary (no `points/`): the fit reads the same steps."""
    measured = as_measured(shutil.copytree(sim_run, tmp_path / "run"))
    whole = load_fit_data([measured])
    rows = [json.loads(p.read_text()) for p in sorted((measured / "points").glob("*/summary.json"))]
    (measured / "summary.json").write_text(json.dumps(rows))
    shutil.rmtree(measured / "points")
    kept = load_fit_data([measured])
    assert (kept.level, kept.model, kept.gpu) == (whole.level, whole.model, whole.gpu)
    assert (kept.level, kept.model, kept.gpu) == ("hil", "llama-3.2-1b", "H100")
    pd.testing.assert_frame_equal(kept.steps, whole.steps)


def test_fit_where_and_check_on_held_out_points(sim_run, tmp_path):
    """Fitted at concurrency 4, checked at 16 (larger batches, a longer context): mean TPOT within 5%."""
    measured = as_measured(shutil.copytree(sim_run, tmp_path / "run"))
    costs = tmp_path / "half" / "costs.yaml"
    r = invoke("calibrate", str(measured), "--out", str(costs), "--fit-where", "workload.concurrency=4", "--check")
    assert r.exit_code == 0, r.output
    assert yaml.safe_load(costs.read_text())["provenance"]["runs"][0]["points"] == 2
    check = pd.read_csv(next((tmp_path / "half" / "check").glob("*/*/check.csv")))
    tpot = check[check["metric"] == "mean_tpot_ms"].set_index("level")
    assert tpot.loc["sim-calibrated", "points"] == 2  # concurrency 16 at depths 1 and 2
    assert tpot.loc["sim-calibrated", "worst_abs_error"] < 0.05
    assert tpot.loc["sim", "worst_abs_error"] < 1e-9  # the uncalibrated sim is what was "measured"


def test_calibration_must_match_the_scenario(sim_run, tmp_path):
    costs = tmp_path / "costs.yaml"
    assert invoke("calibrate", str(as_measured(shutil.copytree(sim_run, tmp_path / "run"))), "--out",
                  str(costs)).exit_code == 0
    with pytest.raises(ScenarioError, match="fitted for model 'llama-3.2-1b', the scenario runs 'llama-3-8b'"):
        simharness.scenario_from_dict({"name": "x", "engine": {"model": "llama-3-8b", "calibration": str(costs)}})
    with pytest.raises(ScenarioError, match=r"measured on 'NVIDIA H100 80GB HBM3' \(gpu H100\).*'A100'"):
        simharness.scenario_from_dict({"name": "x", "engine": {"model": "llama-3.2-1b", "gpu": "A100",
                                                               "calibration": str(costs)}})
    with pytest.raises(ScenarioError, match="engine: calibration: .*cannot read calibration file"):
        simharness.scenario_from_dict({"name": "x", "engine": {"calibration": str(tmp_path / "none.yaml")}})
    scenario = tmp_path / "s.yaml"
    scenario.write_text(yaml.safe_dump({"name": "x", "engine": {"model": "llama-3-8b", "calibration": str(costs)}}))
    r = invoke("run", str(scenario), "--out", str(tmp_path / "out"))
    assert r.exit_code == 2 and "fitted for model" in r.stderr


def test_bad_input_exits_2(sim_run, tmp_path):
    (tmp_path / "empty").mkdir()
    cases = {"not a run directory": [str(tmp_path / "empty")], "no measured": [str(sim_run)]}
    a = as_measured(shutil.copytree(sim_run, tmp_path / "a"))
    b = as_measured(shutil.copytree(sim_run, tmp_path / "b"), device="hil: NVIDIA A100-SXM4-80GB, torch 2.11.0")
    cases["different devices"] = [str(a), str(b)]
    c = shutil.copytree(a, tmp_path / "c")
    stored = yaml.safe_load((c / "scenario.yaml").read_text())
    stored["engine"]["model"] = "tiny"
    (c / "scenario.yaml").write_text(yaml.safe_dump(stored))
    cases["different models"] = [str(a), str(c)]
    cases["no hil point matches"] = [str(a), "--fit-where", "workload.concurrency=7"]
    cases["not swept"] = [str(a), "--fit-where", "engine.gpu=H100"]
    for message, args in cases.items():
        r = invoke("calibrate", *args, "--out", str(tmp_path / "x.yaml"))
        assert r.exit_code == 2 and message in r.stderr, (message, r.output)


def test_unwritable_out_exits_2_before_the_fit(sim_run, tmp_path, monkeypatch):
    """An existing directory, a path under a file, a read-only file system (simulated: root ignores permission
    bits): exit 2 naming --out, before the fit runs, and nothing written."""
    import errno
    import tempfile

    from simharness import calibration

    run = str(as_measured(shutil.copytree(sim_run, tmp_path / "run")))
    (tmp_path / "file").write_text("")
    fits = []
    monkeypatch.setattr(calibration, "calibrate", lambda data: fits.append(data))
    for out, reason in ((tmp_path, "Is a directory"), (tmp_path / "file" / "costs.yaml", "Not a directory")):
        r = invoke("calibrate", run, "--out", str(out))
        assert r.exit_code == 2 and f"--out {out}: cannot write ({reason}" in " ".join(r.stderr.split()), r.output

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    out = tmp_path / "new" / "costs.yaml"
    r = invoke("calibrate", run, "--out", str(out))
    assert r.exit_code == 2 and "cannot write (Read-only file system)" in " ".join(r.stderr.split()), r.output
    assert not fits and not (tmp_path / "new").exists()


def test_too_few_steps(tmp_path):
    tiny = {**SIM, "workload": {"num_requests": 2, "output_len": {"dist": "fixed", "value": 4}}, "sweep": {}}
    run = as_measured(simharness.run(simharness.scenario_from_dict(tiny), out=tmp_path).run_dir)
    r = invoke("calibrate", str(run), "--out", str(tmp_path / "x.yaml"))
    assert r.exit_code == 2 and "too few steps to fit" in r.stderr


def test_real_level_device_residue_is_fitted_on_plain_error():
    """A real step's device time after its launch: where the host's enqueue bounds the step (small batches) the
    device finishes microseconds after the launch; where the device bounds it, its work shows. Fitted on relative
    error the microsecond residues would pull every coefficient towards zero; the real level's plain-error fit
    predicts the device-bound steps, on which the sim's totals depend, within 20% (a line through both regimes)."""
    steps, _, _ = synthetic_steps("noisy")
    rows = steps["decode_rows"].to_numpy()
    host_bound = rows < 32
    steps.loc[host_bound, "device_s"] = 3e-6 * np.exp(np.random.default_rng(1).normal(0, 0.5, host_bound.sum()))
    heavy = ~host_bound
    for level in ("real", "hil"):
        cal = calibrate(FitData(steps, "NVIDIA H100 80GB HBM3", "H100", "llama-3.2-1b", level))
        coef = np.array([cal["device_step_us"][f] for f in DEVICE_FEATURES]) * 1e-6
        predicted = steps.loc[heavy, list(DEVICE_FEATURES)].to_numpy() @ coef
        error = np.median(np.abs(predicted / steps.loc[heavy, "device_s"].to_numpy() - 1))
        if level == "real":
            assert error < 0.2, error
        else:  # relative error: the residues win, the device-bound steps come out far too short
            assert error > 0.5, error


def test_check_warns_when_this_machines_sim_does_not_reproduce_the_runs_own(sim_run, tmp_path):
    """A run that also ran the sim level (as a fidelity run does): the check's uncalibrated sim is compared with it,
    silently where they agree, with a warning naming the difference where they do not (the requests rebuilt here
    differ: another Python's corpus, numpy's random streams, another source)."""
    measured = as_measured(shutil.copytree(sim_run, tmp_path / "run"))
    points = sorted(path.parent for path in (measured / "points").glob("*/summary.json"))
    twins = []
    for i, point in enumerate(points):  # each hil point's sim twin: the same values, as the same code gives
        summary = json.loads((point / "summary.json").read_text())
        twin = measured / "points" / f"{len(points) + i:04d}"
        shutil.copytree(point, twin)
        (twin / "summary.json").write_text(json.dumps({**summary, "level": "sim", "index": len(points) + i}))
        twins.append(twin)
    args = ("calibrate", str(measured), "--out", str(tmp_path / "c.yaml"), "--fit-where", "workload.concurrency=4",
            "--check")
    r = invoke(*args)
    assert r.exit_code == 0 and "does not reproduce" not in r.output, r.output
    twin = next(t for t in twins if json.loads((t / "summary.json").read_text())["workload.concurrency"] == 16)
    summary = json.loads((twin / "summary.json").read_text())
    (twin / "summary.json").write_text(json.dumps({**summary, "p99_tpot_ms": summary["p99_tpot_ms"] * 1.1}))
    r = invoke(*args)
    assert r.exit_code == 0, r.output
    assert "does not reproduce the run's own sim level in 1 of 2 held-out configurations" in r.output
    assert "p99_tpot_ms -4.5%" in r.output.replace("\n", " ")  # the median of 0 and 1 / 1.1 - 1


def test_a_point_whose_swept_value_is_null_is_read_back_from_its_summary_row():
    # a summary table holds a swept null as NaN (the 8B grid sweeps engine.host_slowdown over null and 1.2)
    from simharness.calibration import point_scenario
    from simharness.scenario import scenario_from_dict

    sc = scenario_from_dict({"name": "s", "sweep": {"engine.host_slowdown": [None, 1.2],
                                                     "workload.concurrency": [1, 4]}})
    for slowdown, concurrency in ((float("nan"), 4.0), (1.2, 1.0)):
        row = pd.Series({"engine.host_slowdown": slowdown, "workload.concurrency": concurrency})
        point = point_scenario(sc, row)
        assert point.engine.host_slowdown == (None if slowdown != slowdown else 1.2)
        assert point.workload.concurrency == int(concurrency)


def test_the_steps_carry_what_the_device_computes(sim_run, tmp_path):
    """A profile's features: each decode step at its graph's bucket of rows and the fixed width 1 + k, whatever its
    drafts verified (k as the engine resolves it: none without a proposer), and the longest row's context."""
    from simharness.profile import graph_rows

    steps = load_fit_data([as_measured(shutil.copytree(sim_run, tmp_path / "run"))]).steps
    decode = steps[steps["decode_rows"] > 0]
    assert (decode["width"] == 5).all()  # k = 4, `fill`
    assert (decode["device_rows"] == [graph_rows(int(r)) for r in decode["decode_rows"]]).all()
    assert (decode["device_tokens"] == decode["device_rows"] * 5).all()
    assert (decode["decode_tokens"] <= decode["device_tokens"]).all()
    per_row = decode["decode_context"] / decode["decode_rows"]
    assert (decode["max_context"] >= per_row - 1e-9).all() and (decode["max_context"] > per_row).any()
    no_proposer = {**SIM, "engine": {**SIM["engine"], "speculation": {"proposer": "none", "k": 4}},
                   "sweep": {"workload.concurrency": [4]}}
    run_dir = simharness.run(simharness.scenario_from_dict(no_proposer), out=tmp_path / "none").run_dir
    assert (load_fit_data([as_measured(run_dir)]).steps["width"] == 1).all()
