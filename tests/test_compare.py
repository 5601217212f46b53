"""The perf-regression gate: planted regressions are caught, unchanged runs pass, improvements are
reported, measured noise passes and a real measured shift fails; bad input exits 2."""

import json
import math
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

import simharness
from simharness.cli import app
from simharness.compare import METRICS
from simharness.gate_report import markdown, to_json

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "results" / "baselines" / "ci"

# Small and quick (about a second a run). Depth 1 exposes every host phase in TPOT; depth 2 hides
# them behind the GPU, so a sync point shows there. iid acceptance, so alpha is the knob.
BASE = {
    "name": "gate",
    "seed": 1,
    "workload": {"num_requests": 24, "concurrency": 8, "prompt_len": {"dist": "uniform", "min": 64, "max": 256},
                 "output_len": {"dist": "fixed", "value": 48}},
    "engine": {"model": "llama-3.2-1b", "profile": "none",  # PREP_US: the roofline's default host costs
               "speculation": {"k": 4, "invalid_slots": "fill", "acceptance": {"model": "iid", "alpha": 0.8}}},
    "scheduler": {"policy": "optimistic"},
    "sweep": {"scheduler.depth": [1, 2]},
    "report": {"trace_steps": 20, "timeline_steps": 4},
}
PREP_US = 200.0  # HostCosts.prep_us default

PLANTED = {
    "extra_sync": {"scheduler.sync_points": {"add": ["metadata_item"]}},
    "slow_prep": {"engine.host_costs.prep_us": 3 * PREP_US},
    "acceptance_drop": {"engine.speculation.acceptance.alpha": 0.55},
}
FASTER = {
    "fast_prep": {"engine.host_costs.prep_us": PREP_US / 4},
    "faster_gpu": {"engine.gpu": "H200"},
}


def _run(out: Path, overrides: dict | None = None) -> Path:
    return simharness.run(simharness.scenario_from_dict(BASE, overrides), out=out).run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("runs")
    out = {"base": _run(tmp / "base"), "unchanged": _run(tmp / "unchanged")}
    for name, overrides in {**PLANTED, **FASTER}.items():
        out[name] = _run(tmp / name, overrides)
    return out


def _cli(*args, cwd=ROOT) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    return subprocess.Popen([sys.executable, "-m", "simharness", "compare", *map(str, args)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(procs: dict[str, subprocess.Popen]) -> dict[str, tuple[int, str, str]]:
    """Start the slow CLI processes together, collect them together."""
    done = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=180)
        done[name] = (p.returncode, stdout, stderr)
    return done


def _invoke(*args):
    return CliRunner().invoke(app, ["compare", *map(str, args)])


def _by(rows, point=None, metric=None):
    return {(r.point, r.metric): r for r in rows if (point in (None, r.point)) and (metric in (None, r.metric))}


# ---------------------------------------------------------------------------------------------
# sim level: exact


def test_unchanged_run_is_bit_identical_and_passes(runs):
    rows = simharness.compare(runs["base"], runs["unchanged"])
    assert rows and {r.verdict for r in rows} == {"same"}
    assert len({r.point for r in rows}) == 2
    assert "**PASS: 0 regression(s), 0 improvement(s), 0 changed over" in markdown(rows)


@pytest.mark.parametrize("name", list(PLANTED))
def test_planted_regression_is_caught(runs, name):
    rows = simharness.compare(runs["base"], runs[name])
    regressed = {(r.point, r.metric) for r in rows if r.verdict == "regression"}
    depth1, depth2 = "scheduler.depth=1", "scheduler.depth=2"
    if name == "extra_sync":
        # a sync before prep stalls the async loop: depth 2 loses its overlap
        assert {(depth1, "syncs_per_step"), (depth2, "syncs_per_step"), (depth2, "mean_tpot_ms"),
                (depth2, "p99_tpot_ms"), (depth2, "output_throughput")} <= regressed
    elif name == "slow_prep":
        # a slower host phase shows at depth 1 (exposed), and is hidden at depth 2
        assert {(depth1, "mean_tpot_ms"), (depth1, "p99_tpot_ms"), (depth1, "output_throughput")} <= regressed
        assert _by(rows, depth2, "mean_tpot_ms")[(depth2, "mean_tpot_ms")].verdict != "regression"
    else:
        for point in (depth1, depth2):
            assert {(point, "acceptance_rate"), (point, "mean_acceptance_length"), (point, "mean_tpot_ms")} <= regressed
    tpot = _by(rows, metric="mean_tpot_ms")
    worst = max(r.change_pct for r in tpot.values())
    assert worst > 5.0
    md = markdown(rows)
    assert md.startswith("#### Regressions (")  # regressions first, then changes, then the verdict
    assert md.splitlines()[4].endswith("❌ regression |")
    assert md.index("#### Regressions") < md.index("#### Changes") < md.index("**FAIL: ")


@pytest.mark.parametrize("name", list(FASTER))
def test_faster_run_is_an_improvement_and_passes(runs, name):
    rows = simharness.compare(runs["base"], runs[name])
    verdicts = Counter(r.verdict for r in rows)
    assert verdicts["regression"] == 0, markdown(rows)
    assert verdicts["improvement"] > 0
    point = "scheduler.depth=1"  # the host-bound point gains from either
    assert _by(rows, point, "mean_tpot_ms")[(point, "mean_tpot_ms")].verdict == "improvement"
    assert _by(rows, point, "output_throughput")[(point, "output_throughput")].verdict == "improvement"


def test_diagnostics_never_gate(runs):
    # A faster GPU lowers the GPU-busy fraction at depth 1 and a faster host waits longer at a sync:
    # they are shown as changed, never as a regression.
    rows = simharness.compare(runs["base"], runs["faster_gpu"]) + simharness.compare(runs["base"], runs["fast_prep"])
    diagnostics = {"gpu_busy_fraction", "sync_wait_ms_per_step"}
    moved = [r for r in rows if r.metric in diagnostics and r.verdict != "same"]
    assert {r.metric for r in moved} == diagnostics
    assert {r.verdict for r in moved} == {"changed"} and max(abs(r.change_pct) for r in moved) > 5
    assert {METRICS[m][0] for m in diagnostics} == {None}


def test_threshold_separates_changed_from_regression(runs):
    rows = simharness.compare(runs["base"], runs["slow_prep"], threshold=10.0)  # 1000 %: nothing is beyond it
    assert {r.verdict for r in rows} <= {"same", "changed"} and "changed" in {r.verdict for r in rows}


def test_cli_exit_status_and_json(runs, tmp_path):
    # the real command line, in subprocesses (started together: each imports torch)
    js = tmp_path / "compare.json"
    done = _finish({
        "regression": _cli(runs["base"], runs["extra_sync"], "--json", js),
        "unchanged": _cli("results/baselines/ci", "results/baselines/ci/summary.json"),
        "missing": _cli(runs["base"], tmp_path / "nope"),
    })
    code, stdout, stderr = done["regression"]
    assert code == 1, stderr
    assert "❌ regression" in stdout and "| scheduler.depth=2 | mean_tpot_ms |" in stdout
    data = json.loads(js.read_text())
    assert data["regressions"] > 0 and data["regressions"] == stdout.count("❌ regression")
    assert {"customSmallerIsBetter", "customBiggerIsBetter", "rows"} <= set(data)
    code, stdout, stderr = done["unchanged"]
    assert code == 0, stderr
    assert stdout.startswith("**PASS: 0 regression(s), 0 improvement(s), 0 changed over ") and "| point |" not in stdout
    code, stdout, stderr = done["missing"]
    assert code == 2 and "nope: no such file or directory" in stderr and "Traceback" not in stderr


def test_cli_unchanged_exits_zero(runs):
    r = _invoke(runs["base"], runs["unchanged"])
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("**PASS: 0 regression(s), 0 improvement(s), 0 changed") and "| point |" not in r.stdout


def test_cli_improvement_exits_zero(runs):
    r = _invoke(runs["base"], runs["fast_prep"])
    assert r.exit_code == 0, r.output
    assert "✅ improvement" in r.stdout and "❌" not in r.stdout


def test_summary_json_path_is_accepted(runs):
    r = _invoke(runs["base"] / "summary.json", runs["unchanged"] / "summary.json", "--all")
    assert r.exit_code == 0, r.output
    assert r.stdout.count("| same |") == len(simharness.compare(runs["base"], runs["unchanged"]))


# ---------------------------------------------------------------------------------------------
# bad input: exit 2 and one clear line


def _copy_run(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for name in ("summary.json", "meta.json"):
        shutil.copy(src / name, dst / name)
    return dst


def test_different_scenarios_need_force(runs, tmp_path):
    other = _copy_run(runs["base"], tmp_path / "other")
    meta = json.loads((other / "meta.json").read_text())
    (other / "meta.json").write_text(json.dumps({**meta, "scenario": "other"}))
    r = _invoke(runs["base"], other)
    assert r.exit_code == 2
    assert "different scenarios ('gate' vs 'other')" in r.stderr and "--force" in r.stderr
    r = _invoke(runs["base"], other, "--force")
    assert r.exit_code == 0, r.output


def test_no_common_points(runs, tmp_path):
    other = _copy_run(runs["base"], tmp_path / "other")
    rows = json.loads((other / "summary.json").read_text())
    (other / "summary.json").write_text(json.dumps([{**r, "point": "x" + r["point"]} for r in rows]))
    r = _invoke(runs["base"], other)
    assert r.exit_code == 2 and "no sweep point in common" in r.stderr


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no summary.json (is it a run directory"),
        ("{not json", "not valid JSON"),
        ("[]", "not a simharness summary"),
        ("[1, 2]", "not a simharness summary"),
        ('{"point": "a"}', "not a simharness summary"),
        ('[{"point": "a"}, {"point": "a"}]', "appears more than once"),
        ('[{"point": "a", "mean_tpot_ms": "fast"}]', "mean_tpot_ms is not a number"),
        ('[{"point": "a", "foo": 1}]', "no compared metric in common"),
    ],
)
def test_bad_summaries(runs, tmp_path, content, message):
    bad = tmp_path / "bad"
    bad.mkdir()
    if content is not None:
        (bad / "summary.json").write_text(content)
    if "a" in (content or ""):
        good = tmp_path / "good"
        good.mkdir()
        (good / "summary.json").write_text('[{"point": "a", "mean_tpot_ms": 1.0}]')
    else:
        good = runs["base"]
    r = _invoke(good, bad)
    assert r.exit_code == 2, r.output
    assert message in r.stderr and "Traceback" not in r.output


def test_bad_threshold(runs):
    r = _invoke(runs["base"], runs["unchanged"], "--threshold", "0")
    assert r.exit_code == 2 and "--threshold" in r.stderr


def test_json_is_strict_when_base_is_zero(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps([{"point": "p", "syncs_per_step": 0.0, "mean_tpot_ms": 1.0}]))
    b.write_text(json.dumps([{"point": "p", "syncs_per_step": 1.0, "mean_tpot_ms": 1.0}]))
    rows = simharness.compare(a, b)
    assert _by(rows, "p", "syncs_per_step")[("p", "syncs_per_step")].verdict == "regression"

    def no_constants(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    json.loads(json.dumps(to_json(rows)), parse_constant=no_constants)


# ---------------------------------------------------------------------------------------------
# the committed baseline


def test_committed_baseline_matches_ci_scenario():
    assert (BASELINE / "summary.json").is_file(), "record it with scripts/refresh-baseline"
    source = yaml.safe_load((BASELINE / "scenario.source.yaml").read_text())
    assert source == yaml.safe_load((ROOT / "scenarios" / "ci.yaml").read_text()), (
        "scenarios/ci.yaml changed without scripts/refresh-baseline")
    summary = json.loads((BASELINE / "summary.json").read_text())
    points = [p.id for p in simharness.sweep_points(simharness.load_scenario(ROOT / "scenarios" / "ci.yaml"))]
    assert [r["point"] for r in summary] == points
    assert {r["level"] for r in summary} == {"sim"}
    assert json.loads((BASELINE / "meta.json").read_text())["scenario"] == "ci"
    assert not list(BASELINE.glob("*.parquet"))  # the summary is enough; keep the repo small


def test_cli_on_committed_runs_prints_a_readable_table(tmp_path):
    # the committed baseline against a copy of it in which one point got 10 % slower at P99
    slower = _copy_run(BASELINE, tmp_path / "slower")
    rows = json.loads((slower / "summary.json").read_text())
    rows[-1]["p99_tpot_ms"] *= 1.10
    (slower / "summary.json").write_text(json.dumps(rows))
    r = _invoke(BASELINE, slower)
    assert r.exit_code == 1, r.output
    lines = r.stdout.strip().splitlines()
    assert lines[0] == "#### Regressions (1)"
    assert lines[2] == "| point | metric | base | current | change % | verdict |"
    assert lines[4].startswith(f"| {rows[-1]['point']} | p99_tpot_ms |")
    assert lines[4].endswith("| +10.00 | ❌ regression |")
    assert lines[6].startswith("**FAIL: 1 regression(s), 0 improvement(s), 0 changed over")
    assert lines[6].endswith("; base: 1 run(s), current: 1 run(s); threshold 0.05**")
    assert len(lines) == 7


# ---------------------------------------------------------------------------------------------
# measured level (hil / real): statistics decide, not the threshold alone


def _percentiles(x: np.ndarray, prefix: str) -> dict[str, float]:
    ms = 1000 * x
    return {f"mean_{prefix}_ms": ms.mean(), f"median_{prefix}_ms": np.median(ms),
            f"p90_{prefix}_ms": np.percentile(ms, 90), f"p99_{prefix}_ms": np.percentile(ms, 99)}


def fake_measured_run(path: Path, *, seed: int, n: int, tpot_scale: float = 1.0, acceptance: float = 60.0,
                      scenario: str = "measured") -> Path:
    """A hil run directory written by hand: per-request samples whose summary follows from them.

    Each request has its own decode speed (lognormal, like batch composition and KV length vary in
    a real engine), so summary statistics of two runs differ by a few % from noise alone."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    requests, emissions, summary = [], [], []
    for point in ("concurrency=4", "concurrency=16"):
        reqs, ems = [], []
        for rid in range(n):
            arrival = 0.05 * rid
            ttft = rng.lognormal(np.log(0.030), 0.35)
            speed = rng.lognormal(np.log(0.006 * tpot_scale), 0.35)  # seconds per step of this request
            steps = 24
            gaps = speed * rng.lognormal(0.0, 0.2, size=steps)
            tokens = rng.integers(1, 5, size=steps)  # tokens per step: 1 + accepted drafts
            times = arrival + ttft + np.concatenate([[0.0], np.cumsum(gaps)])
            toks = np.concatenate([[1], tokens])
            reqs.append({"request_id": rid, "arrival_s": arrival, "output_tokens": int(toks.sum()),
                         "first_token_s": times[0], "last_token_s": times[-1]})
            ems += [{"request_id": rid, "step": i, "time_s": t, "tokens": int(k)}
                    for i, (t, k) in enumerate(zip(times, toks, strict=True))]
        r, e = pd.DataFrame(reqs), pd.DataFrame(ems)
        ttft = (r.first_token_s - r.arrival_s).to_numpy()
        e2e = (r.last_token_s - r.arrival_s).to_numpy()
        tpot = (e2e - ttft) / (r.output_tokens.to_numpy() - 1)
        itl = e.sort_values(["request_id", "time_s"]).groupby("request_id")["time_s"].diff().dropna().to_numpy()
        # throughputs have no per-request samples (the threshold alone judges them): keep them fixed
        summary.append({"point": point, "level": "hil", "acceptance_rate": acceptance,
                        "output_throughput": 50_000.0, "request_throughput": 20.0,
                        **_percentiles(ttft, "ttft"), **_percentiles(tpot, "tpot"), **_percentiles(itl, "itl"),
                        **_percentiles(e2e, "e2el")})
        requests.append(r.assign(point=point))
        emissions.append(e.assign(point=point))
    pd.concat(requests).to_parquet(path / "requests.parquet", index=False)
    pd.concat(emissions).to_parquet(path / "emissions.parquet", index=False)
    (path / "summary.json").write_text(json.dumps(summary))
    (path / "meta.json").write_text(json.dumps({"scenario": scenario, "device": "fake"}))
    return path


def test_measured_noise_passes(tmp_path):
    base = fake_measured_run(tmp_path / "a", seed=1, n=60)
    cur = fake_measured_run(tmp_path / "b", seed=2, n=60)  # same distribution, other samples
    rows = simharness.compare(base, cur)
    latency = [r for r in rows if r.metric.endswith("_ms")]
    assert all(r.p_value is not None for r in latency)
    # the noise moves statistics beyond the 5 % threshold, and the test on the samples says noise
    noisy = [r for r in latency if abs(r.change_pct) > 5]
    assert noisy and all(r.verdict == "noise" for r in noisy), markdown(rows, show_all=True)
    assert not any(r.verdict == "regression" for r in rows)
    r = _invoke(base, cur)
    assert r.exit_code == 0, r.output


def test_measured_real_shift_fails(tmp_path):
    base = fake_measured_run(tmp_path / "a", seed=1, n=200)
    cur = fake_measured_run(tmp_path / "b", seed=2, n=200, tpot_scale=1.2)  # decode 20 % slower
    rows = simharness.compare(base, cur)
    for point in ("concurrency=4", "concurrency=16"):
        for metric in ("mean_tpot_ms", "median_tpot_ms", "mean_itl_ms"):
            row = _by(rows, point, metric)[(point, metric)]
            assert row.verdict == "regression" and row.p_value < 1e-3 and 10 < row.change_pct < 30, row
        assert _by(rows, point, "mean_ttft_ms")[(point, "mean_ttft_ms")].verdict != "regression"  # unchanged
    r = _invoke(base, cur)
    assert r.exit_code == 1 and "❌ regression" in r.stdout


def test_measured_acceptance_drop_fails_without_latency_change(tmp_path):
    base = fake_measured_run(tmp_path / "a", seed=1, n=60)
    cur = fake_measured_run(tmp_path / "b", seed=1, n=60, acceptance=40.0)  # same samples
    rows = simharness.compare(base, cur)
    assert {(r.metric, r.verdict) for r in rows if r.verdict != "same"} == {("acceptance_rate", "regression")}
    assert _invoke(base, cur).exit_code == 1


def test_measured_bad_sample_table(tmp_path):
    base = fake_measured_run(tmp_path / "a", seed=1, n=10)
    cur = fake_measured_run(tmp_path / "b", seed=2, n=10)
    pd.read_parquet(cur / "requests.parquet").drop(columns=["first_token_s"]).to_parquet(cur / "requests.parquet")
    r = _invoke(base, cur)
    assert r.exit_code == 2 and "missing column(s) first_token_s" in r.stderr


def test_to_json_lists_are_finite(tmp_path):
    base = fake_measured_run(tmp_path / "a", seed=1, n=20)
    data = to_json(simharness.compare(base, base))
    names = [e["name"] for e in data["customSmallerIsBetter"] + data["customBiggerIsBetter"]]
    assert len(names) == len(set(names)) > 0
    assert all(math.isfinite(e["value"]) for e in data["customSmallerIsBetter"])


def test_bare_summary_without_meta_is_taken_as_the_same_scenario(runs, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(runs["base"] / "summary.json", bare / "summary.json")  # no meta.json: scenario unknown
    r = _invoke(bare / "summary.json", runs["unchanged"])
    assert r.exit_code == 0, r.output
    assert {x.verdict for x in simharness.compare(bare, runs["extra_sync"])} >= {"regression"}


# ---------------------------------------------------------------------------------------------
# an honest gate: missing points, unwritable --json, bad thresholds, changed rows counted


def test_missing_points_are_listed_and_fail(runs, tmp_path):
    partial = _copy_run(runs["base"], tmp_path / "partial")
    rows = json.loads((partial / "summary.json").read_text())
    (partial / "summary.json").write_text(json.dumps(rows[:1]))  # an interrupted run: one point of two
    r = _invoke(runs["base"], partial)
    assert r.exit_code == 3, r.output
    assert "**INCOMPLETE: 0 regression(s), 0 improvement(s), 0 changed, 1 point(s) missing in current over" in r.stdout
    assert r.stdout.index("#### Changes (1)") < r.stdout.index("**INCOMPLETE")
    assert f"| {rows[1]['point']} | (all) | present | absent | | ⚠️ missing in current |" in r.stdout
    r = _invoke(partial, runs["base"], "--json", tmp_path / "c.json")
    assert r.exit_code == 3 and "missing in base" in r.stdout
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["missing_points"] == {"base": [rows[1]["point"]], "current": []}
    # a regression still says 1
    slower = _copy_run(runs["base"], tmp_path / "slower")
    (slower / "summary.json").write_text(json.dumps([{**rows[0], "mean_tpot_ms": 2 * rows[0]["mean_tpot_ms"]}]))
    assert _invoke(runs["base"], slower).exit_code == 1


def test_headline_counts_changed_rows(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps([{"point": "p", "gpu_busy_fraction": 0.5, "mean_tpot_ms": 1.0}]))
    b.write_text(json.dumps([{"point": "p", "gpu_busy_fraction": 0.6, "mean_tpot_ms": 1.0}]))
    r = _invoke(a, b)
    assert r.exit_code == 0 and "**PASS: 0 regression(s), 0 improvement(s), 1 changed over 2 metrics" in r.stdout


def test_unwritable_json_exits_2(runs, tmp_path):
    (tmp_path / "file").write_text("")
    for target in (tmp_path / "file" / "c.json", tmp_path / "nodir" / "c.json", tmp_path):
        r = _invoke(runs["base"], runs["extra_sync"], "--json", target)  # a regression: still 2, never 1
        assert r.exit_code == 2, r.output
        assert "--json" in r.stderr and "cannot write" in r.stderr and "Traceback" not in r.output


@pytest.mark.parametrize("threshold", ["0", "-0.1", "nan", "inf", "-inf"])
def test_non_finite_or_negative_threshold_exits_2(runs, threshold):
    r = _invoke(runs["base"], runs["unchanged"], "--threshold", threshold)
    assert r.exit_code == 2 and "--threshold: must be a finite number > 0" in r.stderr, r.output


# runs with repeats: the repeat is the unit of evidence


def test_repeats_regression_must_be_beyond_threshold_and_significant(tmp_path):
    """Five repeats (seeds 1..5) a side. A planted 2x prep cost (+25% mean TPOT at depth 1) is a significant
    regression; runs on other seeds (11..15) differ by noise only and nothing regresses."""
    repeated = {**BASE, "repeats": 5}
    base = simharness.run(simharness.scenario_from_dict(repeated), out=tmp_path / "a").run_dir
    slow = simharness.run(simharness.scenario_from_dict(repeated, {"engine.host_costs.prep_us": 2 * PREP_US}),
                          out=tmp_path / "b").run_dir
    other = simharness.run(simharness.scenario_from_dict({**repeated, "seed": 11}), out=tmp_path / "c").run_dir
    rows = simharness.compare(base, slow)
    assert {r.point for r in rows} == {"scheduler.depth=1", "scheduler.depth=2"}  # repeats compared as one
    row = _by(rows, "scheduler.depth=1", "mean_tpot_ms")[("scheduler.depth=1", "mean_tpot_ms")]
    assert row.verdict == "regression" and row.p_value < 0.05 and row.change_pct > 5, row
    assert "(p=" in markdown(rows)
    noise = simharness.compare(base, other)
    assert all(r.p_value is not None for r in noise if r.verdict not in ("same", "changed"))
    assert not any(r.verdict == "regression" for r in noise), markdown(noise, show_all=True)
    beyond = [r for r in noise if abs(r.change_pct) > 5 and METRICS[r.metric][0] is not None]
    assert all(r.verdict == "noise" for r in beyond)


def test_single_sample_measured_runs_warn(tmp_path):
    base = fake_measured_run(tmp_path / "a", seed=1, n=20)
    cur = fake_measured_run(tmp_path / "b", seed=2, n=20)
    with pytest.warns(UserWarning, match="cannot tell run-to-run noise from a change"):
        simharness.compare(base, cur)
    r = _invoke(base, cur)
    assert "warning:" in r.stderr and "repeats: N" in r.stderr


# ---------------------------------------------------------------------------------------------
# a killed run (no summary.json) is unfinished: exit 3, not 2


def _killed(run_dir: Path, dst: Path, keep: int) -> Path:
    """A copy of a run as a kill leaves it: its points' directories (the first `keep`), no combined files."""
    shutil.copytree(run_dir, dst)
    for p in dst.iterdir():
        if p.is_file() and p.name not in ("scenario.yaml", "meta.json"):
            p.unlink()
    for p in sorted((dst / "points").iterdir())[keep:]:
        shutil.rmtree(p)
    return dst


def test_killed_run_is_unfinished_not_bad_input(runs, tmp_path):
    killed = _killed(runs["base"], tmp_path / "killed", keep=1)
    r = _invoke(runs["base"], killed)
    assert r.exit_code == 3, r.output
    assert "| scheduler.depth=2 | (all) | present | absent | | ⚠️ missing in current |" in r.stdout
    assert "| scheduler.depth=1 |" not in r.stdout  # its finished point is the same
    # against another killed run: the same point is missing on both sides, and the run is still unfinished
    r = _invoke(killed, _killed(runs["extra_sync"], tmp_path / "killed2", keep=1))
    assert r.exit_code == 1 and "1 unfinished point(s) of" in r.stdout  # a regression at depth 1 says 1 first
    r = _invoke(killed, killed)
    assert r.exit_code == 3 and "1 unfinished point(s) of" in r.stdout, r.output
    assert not (killed / "summary.json").exists()  # compare reads, never writes


def test_killed_measured_run_reads_its_points_samples(tmp_path):
    base = fake_measured_run(tmp_path / "a", seed=1, n=30)
    killed = tmp_path / "b"
    fake_measured_run(killed, seed=2, n=30)
    rows = json.loads((killed / "summary.json").read_text())
    (killed / "scenario.yaml").write_text(yaml.safe_dump({"name": "measured", "sweep": {"concurrency": [4, 16]}}))
    for index, row in enumerate(rows[:1]):  # the first point finished, the second did not
        point = killed / "points" / f"{index:04d}"
        point.mkdir(parents=True)
        (point / "summary.json").write_text(json.dumps({**row, "index": index}))
        for name in ("requests", "emissions"):
            table = pd.read_parquet(killed / f"{name}.parquet")
            table[table.point == row["point"]].drop(columns="point").to_parquet(point / f"{name}.parquet")
    for name in ("summary.json", "requests.parquet", "emissions.parquet"):
        (killed / name).unlink()
    full = simharness.compare(base, fake_measured_run(tmp_path / "c", seed=2, n=30))
    part = simharness.compare(base, killed)
    assert [(r.point, r.metric, r.p_value) for r in part if r.point == "concurrency=4"] == \
        [(r.point, r.metric, r.p_value) for r in full if r.point == "concurrency=4"]
    assert [r.verdict for r in part if r.point == "concurrency=16"] == ["missing in current"]


# ---------------------------------------------------------------------------------------------
# several runs a side: a rolling baseline, the run as the unit


def _summary_run(path: Path, values: dict[str, float], *, level: str = "hil", device: str = "H100",
                 written: str = "2026-11-01T00:00:00", digest: str = "d1", scenario: str = "gate") -> Path:
    path.mkdir(parents=True)
    (path / "summary.json").write_text(json.dumps([{"point": "p", "level": level, **values}]))
    (path / "meta.json").write_text(json.dumps({"scenario": scenario, "device": device, "written_at": written,
                                                "source_digest": digest}))
    return path


def test_rolling_baseline_is_the_median_of_the_last_n(tmp_path):
    history = tmp_path / "history"
    for day, tpot in enumerate([9.0, 1.0, 1.2, 1.1, 5.0]):  # the oldest run is an outlier the window leaves out
        _summary_run(history / f"run{day}", {"mean_tpot_ms": tpot}, written=f"2026-11-0{day + 1}T00:00:00")
    current = _summary_run(tmp_path / "current", {"mean_tpot_ms": 1.15})
    rows = simharness.compare([history], current, last=4)
    assert rows[0].base == pytest.approx(np.median([1.0, 1.2, 1.1, 5.0]))
    assert simharness.compare([history], current)[0].base == pytest.approx(1.2)  # all five
    assert simharness.compare([history], current, last=2)[0].base == pytest.approx(3.05)
    # the CLI: a folder of runs, or runs named one by one, then --last
    r = _invoke(history, current, "--last", "4")
    assert r.exit_code == 0 and "base: 4 run(s) (median), current: 1 run(s)" in r.stdout, r.output
    r = _invoke(*sorted(history.iterdir()), current, "--last", "0")
    assert r.exit_code == 2 and "--last: must be at least 1" in r.stderr


def test_runs_are_the_unit_of_the_test(tmp_path):
    rng = np.random.default_rng(3)
    base = [_summary_run(tmp_path / f"b{i}", {"mean_tpot_ms": 1.0 * rng.lognormal(0, 0.01)}) for i in range(3)]
    slow = [_summary_run(tmp_path / "s" / f"c{i}", {"mean_tpot_ms": 1.1 * rng.lognormal(0, 0.01)}) for i in range(3)]
    same = [_summary_run(tmp_path / "n" / f"c{i}", {"mean_tpot_ms": 1.0 * rng.lognormal(0, 0.01)}) for i in range(3)]
    row = simharness.compare(base, [tmp_path / "s"])[0]
    assert row.verdict == "regression" and row.p_value < 0.01
    assert simharness.compare(base, [tmp_path / "n"])[0].verdict in ("same", "noise", "changed")
    # a 10% shift within noise of 10% a run is not significant with three runs a side
    noisy = [_summary_run(tmp_path / "x" / f"c{i}", {"mean_tpot_ms": v}) for i, v in enumerate([0.9, 1.3, 1.1])]
    row = simharness.compare(base, [tmp_path / "x"])[0]
    assert row.change_pct > 5 and row.verdict == "noise", row
    assert len(slow) == len(same) == len(noisy) == 3


@pytest.mark.parametrize(("change", "message"), [
    ({"level": "sim"}, "a mix of levels (hil: "),
    ({"device": "A100"}, "different devices ('A100' vs 'H100'); pass --force"),
    ({"scenario": "other"}, "different scenarios ('gate' vs 'other'); pass --force"),
])
def test_runs_that_cannot_be_compared_exit_2(tmp_path, change, message):
    a = _summary_run(tmp_path / "a", {"mean_tpot_ms": 1.0})
    b = _summary_run(tmp_path / "b", {"mean_tpot_ms": 1.0})
    odd = _summary_run(tmp_path / "odd", {"mean_tpot_ms": 1.0}, **change)
    for args in ((a, b, odd), (a, odd, b)):  # in the baseline or as the current run
        r = _invoke(*args)
        assert r.exit_code == 2 and message in r.stderr and "Traceback" not in r.output, r.output
        assert r.stderr.count("error:") == 1


def test_sim_baselines_of_different_trees_exit_2(tmp_path):
    a = _summary_run(tmp_path / "a", {"mean_tpot_ms": 1.0}, level="sim", digest="d1")
    b = _summary_run(tmp_path / "b", {"mean_tpot_ms": 1.0}, level="sim", digest="d2")
    c = _summary_run(tmp_path / "c", {"mean_tpot_ms": 1.0}, level="sim", digest="d3")
    r = _invoke(a, b, c)
    assert r.exit_code == 2 and "the base runs come from 2 different source trees" in r.stderr
    assert _invoke(a, c).exit_code == 0  # one baseline of another tree: that is what a gate compares
    # measured baselines of several trees are a dashboard's history: allowed
    h = [_summary_run(tmp_path / f"h{i}", {"mean_tpot_ms": 1.0 + i / 100}, digest=f"t{i}") for i in range(3)]
    assert _invoke(*h, _summary_run(tmp_path / "now", {"mean_tpot_ms": 1.0})).exit_code == 0


def test_baselines_of_different_resolved_scenarios_exit_2(tmp_path):
    a = _summary_run(tmp_path / "a", {"mean_tpot_ms": 1.0})
    b = _summary_run(tmp_path / "b", {"mean_tpot_ms": 1.0})
    (a / "scenario.yaml").write_text("name: gate\nseed: 0\n")
    (b / "scenario.yaml").write_text("name: gate\nseed: 1\n")
    r = _invoke(a, b, _summary_run(tmp_path / "c", {"mean_tpot_ms": 1.0}))
    assert r.exit_code == 2 and "the base runs are not of one scenario" in r.stderr


# ---------------------------------------------------------------------------------------------
# the outputs: Markdown, JSON and JUnit say the same


def test_markdown_json_and_junit_agree(runs, tmp_path):
    import xml.etree.ElementTree as ET

    js, xml, md = tmp_path / "c.json", tmp_path / "c.xml", tmp_path / "summary.md"
    md.write_text("earlier step\n")  # a job summary is appended to, never replaced
    r = _invoke(runs["base"], runs["slow_prep"], "--json", js, "--junit", xml, "--markdown", md)
    assert r.exit_code == 1, r.output
    data = json.loads(js.read_text())
    assert md.read_text() == "earlier step\n" + r.stdout.rstrip("\n") + "\n"
    assert data["verdict"] == "fail" and f"**{data['verdict_line']}**" in r.stdout
    assert data["verdict_line"].startswith(f"FAIL: {data['regressions']} regression(s)")
    md_regressions = [line for line in r.stdout.splitlines() if line.endswith("❌ regression |")]
    assert [f"| {x['point']} | {x['metric']} |" for x in data["regression_rows"]] == \
        [line[: line.index(" |", line.index(" | ") + 3) + 2] for line in md_regressions]
    assert len(data["change_rows"]) == data["improvements"] + data["changed"]
    suite = ET.parse(xml).getroot().find("testsuite")
    cases = suite.findall("testcase")
    assert len(cases) == len(data["rows"]) == int(suite.get("tests"))
    failed = [(c.get("classname"), c.get("name")) for c in cases if c.find("failure") is not None]
    assert failed == [(x["point"], x["metric"]) for x in data["rows"] if x["verdict"] == "regression"]
    assert int(suite.get("failures")) == data["regressions"] and suite.get("errors") == "0"
    assert suite.find("properties/property").get("value") == data["verdict_line"]


def test_junit_marks_missing_points_as_errors(runs, tmp_path):
    import xml.etree.ElementTree as ET

    partial = _copy_run(runs["base"], tmp_path / "partial")
    rows = json.loads((partial / "summary.json").read_text())
    (partial / "summary.json").write_text(json.dumps(rows[:1]))
    xml = tmp_path / "c.xml"
    assert _invoke(runs["base"], partial, "--junit", xml).exit_code == 3
    suite = ET.parse(xml).getroot().find("testsuite")
    errors = [c for c in suite.findall("testcase") if c.find("error") is not None]
    assert [(c.get("classname"), c.get("name")) for c in errors] == [(rows[1]["point"], "(all)")]
    assert suite.get("errors") == "1" and suite.get("failures") == "0"


def test_unwritable_junit_or_markdown_exits_2(runs, tmp_path):
    for option in ("--junit", "--markdown"):
        r = _invoke(runs["base"], runs["extra_sync"], option, tmp_path / "nodir" / "x")
        assert r.exit_code == 2 and f"{option} " in r.stderr and "cannot write" in r.stderr, r.output


def test_one_path_is_not_a_comparison(runs):
    r = _invoke(runs["base"])
    assert r.exit_code == 2 and "at least one baseline and the current run" in r.stderr


def test_a_spread_small_by_chance_is_floored_by_its_family(tmp_path):
    # P99 TPOT's three runs a side happen to agree within 0.1%, and moved 6%; the other P99s spread by 5% a run: the
    # family's spread, not the chance one, decides, and 6% is noise. The means spread little and moved nothing.
    def runs(side, shift, spreads):
        out = []
        for i, e in enumerate(spreads):
            values = {"mean_tpot_ms": 1.0 + e / 10, "p99_tpot_ms": 2.0 * shift * (1 + e / 50),
                      **{f"p99_{k}_ms": 3.0 * (1 + e) for k in ("ttft", "itl", "e2el")}}
            out.append(_summary_run(tmp_path / side / f"r{i}", values))
        return out

    runs("base", 1.0, [-0.05, 0.0, 0.05])
    runs("current", 1.06, [0.05, -0.05, 0.0])
    row = _by(simharness.compare([tmp_path / "base"], [tmp_path / "current"]), "p", "p99_tpot_ms")[("p", "p99_tpot_ms")]
    assert row.change_pct > 5 and row.verdict == "noise", row
    # alone, its own spread would call it significant
    from simharness.compare import run_significance

    assert run_significance([2.0 * (1 + e / 50) for e in (-0.05, 0, 0.05)],
                            [2.12 * (1 + e / 50) for e in (0.05, -0.05, 0)]) < 1e-4
