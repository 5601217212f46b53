"""The GPU gate's step metrics on simulated measured runs (seeded): the false-alarm rate of an A/A comparison with
the run-to-run spread of the H100 pools, the power on a device slowdown that moves TPOT less than its noise, the
like-for-like rule of the device step time; and the benchmark's re-analysis of packed pools."""

import io
import json
import math
import tarfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import load_benchmark

from simharness.compare import METRICS, STEP_METRICS, Run, _family, _Runs, compare_runs
from simharness.gate_report import verdict
from simharness.metrics import HOST_PHASE_METRICS
from simharness.records import DEVICE_PHASES

ROOT = Path(__file__).resolve().parents[1]
# The real level's run-to-run spread in the H100 pools (results/gate/h100/step-gate/power.md, "Run-to-run spread";
# standard deviations of a run's log value): a run's host speed moves its host time per step by about 19% and its
# latencies by about 3.5% (they correlate 0.85-0.96); the device time per step spreads by 1.4% (0.1% at hil), tail
# latencies by up to 6%; the step counts, tokens per step and acceptance do not move at all (greedy outputs, closed
# loop). The GPU gate compares n new runs with a committed baseline of ten (docs/ci.md).
HOST, LATENCY, TAIL = 0.19, 0.035, 0.06
STEP = {"real": 0.014, "hil": 0.001}
BASE_RUNS = 10


def fake_run(rng: np.random.Generator, *, device: float = 1.0, tokens: float = 20.64, level: str = "real",
             name: str = "r", busy: float | None = None, sample: float | None = None) -> Run:
    """One measured run of one point. `device` scales the device time per step; TPOT moves by the part of it the
    steps do not hide (a third, as the 5% arm's TPOT moved 1.5% in the pools). `sample`, if given, scales the
    sampler's device phase, which spreads 0.7% a run at real (results/gate/h100-20261127/phases/power.md)."""
    host = rng.normal(0.0, 1.0)  # the run's host speed, in standard deviations
    latency = math.exp(LATENCY * (0.9 * host + 0.44 * rng.normal())) * (1 + (device - 1) / 3)
    row = {"point": "base", "level": "real", "num_steps": 112, "mean_batch_size": 6.75, "tokens_per_step": tokens,
           "syncs_per_step": 2.0, "acceptance_rate": 81.2, "mean_acceptance_length": 4.25,
           "mean_host_ms_per_step": 0.57 * math.exp(HOST * host),
           "mean_step_ms": 2.18 * device * math.exp(STEP[level] * (0.9 * host + 0.44 * rng.normal())),
           "output_throughput": 8500.0 / latency, "request_throughput": 87.0 / latency}
    for kind, ms in {"ttft": 12.0, "tpot": 0.68, "itl": 2.2, "e2el": 80.0}.items():
        for stat, sigma in {"mean": 0.0, "median": 0.01, "p90": 0.02, "p99": TAIL}.items():
            row[f"{stat}_{kind}_ms"] = ms * latency * math.exp(rng.normal(0.0, sigma))
    if busy is not None:  # the device phases' busy time per step, with this spread: no host gaps in it
        row["mean_device_ms"] = 1.9 * device * math.exp(busy * rng.normal())
    if sample is not None:
        row["device_sample_ms_per_step"] = 0.0115 * sample * math.exp(0.007 * rng.normal())
    summary = pd.DataFrame([row]).set_index("point")
    return Run(Path(name), "gate-gpu", "real", summary, None, {"scenario": "gate-gpu", "device": "H100"})


def fail_rate(n: int, trials: int, seed: int, level: str = "real", threshold: float = 0.02,
              busy: float | None = None, **current) -> float:
    rng = np.random.default_rng(seed)
    fails = 0
    for _ in range(trials):
        base = [fake_run(rng, level=level, busy=busy) for _ in range(BASE_RUNS)]
        fails += verdict(compare_runs(base, [fake_run(rng, level=level, busy=busy, **current) for _ in range(n)],
                                      threshold=threshold)) == "fail"
    return fails / trials


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_a_a_false_alarms_at_most_one_percent(n):
    assert fail_rate(n, 300, seed=n) <= 0.01


def test_a_five_percent_device_slowdown_is_caught_from_one_run_at_hil():
    # TPOT moves 1.7% under a 3.5% spread: the latencies alone would miss it; the step time spreads 0.1%
    assert fail_rate(1, 100, seed=41, level="hil", device=1.05) >= 0.95


def test_at_real_the_step_time_spread_costs_runs():
    # 1.4% a run: one new run catches 5% now and then, five nearly always
    one, five = (fail_rate(n, 100, seed=50 + n, device=1.05) for n in (1, 5))
    assert one < 0.8 and five >= 0.9


def test_a_steady_device_busy_time_catches_a_five_percent_slowdown_at_real_from_one_run():
    # the window's spread is the host's (1.4%); a busy time without the host's gaps, at 0.3%, decides alone
    assert fail_rate(1, 100, seed=8, busy=0.003, device=1.05) >= 0.95
    assert fail_rate(1, 200, seed=9, busy=0.003) <= 0.02


def test_the_step_metrics_are_what_catches_it():
    rng = np.random.default_rng(7)
    base = [fake_run(rng, level="hil") for _ in range(BASE_RUNS)]
    rows = compare_runs(base, [fake_run(rng, level="hil", device=1.05) for _ in range(3)], threshold=0.02)
    regressed = {r.metric for r in rows if r.verdict == "regression"}
    assert "mean_step_ms" in regressed and not any(m.endswith("tpot_ms") for m in regressed), regressed


def test_a_slowdown_of_the_thresholds_size_is_caught_about_half_the_time():
    # 2% is the threshold itself: about half of the observed changes fall short of it
    assert 0.2 < fail_rate(3, 100, seed=5, level="hil", device=1.02) < 0.9


def test_device_step_time_of_other_steps_is_a_diagnostic():
    # more tokens per step (better acceptance) make longer device steps: no device regression
    rng = np.random.default_rng(3)
    base = [fake_run(rng) for _ in range(BASE_RUNS)]
    base = [fake_run(rng, busy=0.003) for _ in range(BASE_RUNS)]
    rows = compare_runs(base, [fake_run(rng, device=1.2, tokens=24.0, busy=0.003) for _ in range(3)], threshold=0.02)
    for metric in ("mean_step_ms", "mean_device_ms"):
        step = next(r for r in rows if r.metric == metric)
        assert step.verdict == "changed" and step.change_pct > 15
    assert next(r for r in rows if r.metric == "tokens_per_step").verdict == "improvement"


def test_a_device_phase_that_moved_is_gated_between_runs_of_the_same_steps_only():
    # #37238's sampler: its own phase 5% slower, the whole step 0.06% (nothing else moves)
    rng = np.random.default_rng(12)
    base = [fake_run(rng, sample=1.0) for _ in range(BASE_RUNS)]
    rows = compare_runs(base, [fake_run(rng, sample=1.05) for _ in range(2)], threshold=0.02)
    row = next(r for r in rows if r.metric == "device_sample_ms_per_step")
    assert row.verdict == "regression" and 4 < row.change_pct < 6
    assert verdict(rows) == "fail" and {r.metric for r in rows if r.verdict == "regression"} == {row.metric}
    other = compare_runs(base, [fake_run(rng, sample=1.05, tokens=24.0) for _ in range(2)], threshold=0.02)
    assert next(r for r in other if r.metric == "device_sample_ms_per_step").verdict == "changed"


def test_each_phase_metric_is_a_family_of_its_own():
    # the alpha is split over families (`_Runs`); a phase's name must not read as a latency statistic's
    phases = [m for m in STEP_METRICS if m.startswith(("device_", "host_"))]
    assert len(phases) == len(DEVICE_PHASES) + len(HOST_PHASE_METRICS)
    assert {m: _family(m) for m in (*phases, "mean_step_ms", "mean_device_ms")} == {
        m: m for m in (*phases, "mean_step_ms", "mean_device_ms")}
    assert {_family(m) for m in ("mean_tpot_ms", "mean_itl_ms")} == {"mean"}
    assert _family("p99_e2el_ms") == "p99" and _family("output_throughput") == "throughput"


def test_the_level_is_split_over_the_families_that_vary():
    # mean, median, P90, P99, throughput, the step window, the host time: 7; acceptance, syncs and tokens per step
    # are the same in every run (their logs' mean misses them by an ulp: no spread), as is a phase no run has
    rng = np.random.default_rng(13)
    base, current = ([fake_run(rng, sample=1.0) for _ in range(n)] for n in (BASE_RUNS, 2))
    assert _Runs(base, current, 0.02, {**METRICS, **STEP_METRICS}).alpha == pytest.approx(0.02 / 8)  # and sample
    base, current = ([fake_run(rng) for _ in range(n)] for n in (BASE_RUNS, 2))
    assert _Runs(base, current, 0.02, {**METRICS, **STEP_METRICS}).alpha == pytest.approx(0.02 / 7)


def test_step_metrics_are_not_gated_at_the_sim_or_with_one_plain_run_a_side():
    rng = np.random.default_rng(4)
    with pytest.warns(UserWarning, match="one sample per point"):
        one = compare_runs(fake_run(rng), fake_run(rng, device=1.3))
    assert not {r.metric for r in one} & set(STEP_METRICS)
    sims = []
    for _ in range(3):
        run = fake_run(rng)
        sims.append(Run(run.path, run.scenario, "sim", run.summary.assign(level="sim"), None, run.meta))
    assert not {r.metric for r in compare_runs(sims[:2], sims[2:])} & set(STEP_METRICS)


# ---------------------------------------------------------------------------------------------- the benchmark


def _benchmark():
    return load_benchmark("gate_power")


def _tarball(path: Path, top: str, processes: dict[str, list[int]]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        def add(name: str, text: str) -> None:
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/pool/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        add("plan.json", json.dumps({"top": top}))
        for level, numbers in processes.items():
            for p in numbers:
                add(f"{level}/A/p{p:02d}/gate/run/summary.json", json.dumps([{"point": "base", "p": p}]))
    return path


def test_packed_pools_are_numbered_one_after_another(tmp_path):
    gp = _benchmark()
    first = _tarball(tmp_path / "1.tgz", "gate", {"hil": [0, 1], "real": [0, 1, 2]})
    second = _tarball(tmp_path / "2.tgz", "gate2", {"hil": [0], "real": [0, 1]})
    (tmp_path / "out").mkdir()
    pool = gp.unpack_pools([first, second], tmp_path / "out")
    assert json.loads((pool / "plan.json").read_text()) == {"top": "gate"}
    found = {lv: sorted(p.name for p in (pool / lv / "A").iterdir()) for lv in ("hil", "real")}
    assert found == {"hil": ["p00", "p01", "p02"], "real": ["p00", "p01", "p02", "p03", "p04"]}
    moved = json.loads((pool / "real" / "A" / "p04" / "gate" / "run" / "summary.json").read_text())
    assert moved[0]["p"] == 1  # the second tarball's p01


def test_trials_with_a_baseline_of_b_runs():
    gp = _benchmark()
    pool = {"A": {p: f"A{p}" for p in range(9)}, "X": {p: f"X{p}" for p in range(9)}}
    for n, b in ((1, 5), (3, 5), (5, 4)):  # five runs, or what the nine processes leave
        drawn = list(gp.trials(pool, "A", "X", n, count=50, base_runs=5))
        assert len(drawn) == 50
        for base, current in drawn:
            assert len(base) == b and len(current) == n
            assert len({r[1:] for r in base + current}) == b + n


def test_step_metrics_reach_every_output():
    from simharness.gate_report import junit, markdown, to_json

    rng = np.random.default_rng(9)
    base = [fake_run(rng, level="hil") for _ in range(BASE_RUNS)]
    rows = compare_runs(base, [fake_run(rng, level="hil", device=1.1) for _ in range(2)], threshold=0.02)
    data = to_json(rows)
    assert "base mean_step_ms" in [e["name"] for e in data["customSmallerIsBetter"]]
    assert "base tokens_per_step" in [e["name"] for e in data["customBiggerIsBetter"]]
    assert "mean_step_ms" in [r["metric"] for r in data["regression_rows"]]
    assert '<testcase classname="base" name="mean_step_ms">\n      <failure' in junit(rows)
    assert "| base | mean_step_ms |" in markdown(rows).split("#### Changes")[0]


def test_spread_table_gives_a_spread_and_each_arms_change():
    gp = _benchmark()
    rng = np.random.default_rng(11)
    pool = {"A": {p: fake_run(rng, level="hil") for p in range(6)},
            "slow": {p: fake_run(rng, level="hil", device=1.1) for p in range(6)}}
    text = gp.spread_table(pool, [("A/A", "A", "A", ""), ("slow", "A", "slow", "")])
    assert text.splitlines()[0] == "| metric | spread (A) | slow |"
    step = next(line for line in text.splitlines() if line.startswith("| mean_step_ms |")).split("|")
    assert 0.0 < float(step[2].strip(" %")) < 0.5 and 9.0 < float(step[3].strip(" %+")) < 11.0
    assert "| syncs_per_step | 0.00% | +0.0% |" in text


def test_an_old_pools_run_gets_the_step_metrics_its_summary_lacks(tmp_path):
    # the pools of 2026-11-27 predate the per-phase metrics: they are computed from each run's steps.parquet
    from simharness.compare import load_run
    from simharness.metrics import engine_metrics
    from simharness.records import STEP_COLUMNS, SYNC_COLUMNS

    gp = _benchmark()
    ms = 1e-3
    steps = pd.DataFrame([dict.fromkeys(STEP_COLUMNS, 0.0) | {"point": point, "step": i, "prep_end": 0.5 * ms * scale,
                                                              "gpu_verify_s": (i + 1) * ms * scale}
                          for point, scale in (("a", 1.0), ("b", 2.0)) for i in range(2)])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    summary = [{"point": p, "level": "real", "mean_step_ms": 9.0} for p in "ab"]
    (run_dir / "summary.json").write_text(json.dumps(summary))
    old = load_run(run_dir)
    assert gp.with_step_metrics(old, run_dir) is old  # no steps.parquet: as it was
    steps.to_parquet(run_dir / "steps.parquet")
    summary = gp.with_step_metrics(load_run(run_dir), run_dir).summary
    assert summary.loc["a", "device_verify_ms_per_step"] == pytest.approx(1.5)  # (1 + 2) / 2 ms
    assert summary.loc["b", "device_verify_ms_per_step"] == pytest.approx(3.0)
    assert summary.loc["b", "host_prep_share"] == pytest.approx(1.0)  # prep is all the host work there
    assert (summary["mean_step_ms"] == 9.0).all()  # a metric the summary has is kept
    expected = engine_metrics(steps[steps["point"] == "b"], pd.DataFrame(columns=SYNC_COLUMNS))
    assert {m: summary.loc["b", m] for m in STEP_METRICS if m != "mean_step_ms"} == {
        m: expected[m] for m in STEP_METRICS if m != "mean_step_ms"}
