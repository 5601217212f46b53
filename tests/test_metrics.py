"""Metrics against hand calculations on hand-built records (vLLM `bench serve` definitions)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from simharness.metrics import compute_metrics, host_intervals, latency_stats, percentile_label
from simharness.records import (
    DEVICE_PHASE_COLUMNS,
    DEVICE_PHASES,
    EMISSION_COLUMNS,
    REQUEST_COLUMNS,
    STEP_COLUMNS,
    SYNC_COLUMNS,
)
from simharness.scenario import Goodput

NO_SLO = Goodput()


def _requests(rows: list[dict]) -> pd.DataFrame:
    defaults = {"kind": "free", "prompt_tokens": 10, "num_chunks": 0, "num_drafts": 0, "draft_tokens": 0,
                "accepted_tokens": 0, "wasted_slots": 0}
    return pd.DataFrame([{**defaults, **r} for r in rows], columns=REQUEST_COLUMNS)


def _emissions(rows: list[tuple[int, float, int]]) -> pd.DataFrame:
    return pd.DataFrame([(rid, i, t, n) for i, (rid, t, n) in enumerate(rows)], columns=EMISSION_COLUMNS)


def _steps(rows: list[dict], k: int = 0) -> pd.DataFrame:
    df = pd.DataFrame([dict.fromkeys(STEP_COLUMNS, 0.0) | {"step": i} | r for i, r in enumerate(rows)],
                      columns=STEP_COLUMNS)
    for i in range(k):
        df[f"acc_pos_{i}"] = [r.get(f"acc_pos_{i}", 0) for r in rows]
    return df


EMPTY_STEPS = _steps([])
EMPTY_SYNCS = pd.DataFrame(columns=SYNC_COLUMNS)

# Three finished requests and one unfinished:
#   r0: arrival 0.00, chunks at 0.10 (1 tok), 0.20 (2), 0.50 (2): 5 tokens.
#       TTFT 100 ms, E2E 500 ms, TPOT (500-100)/4 = 100 ms, ITL 100, 300 ms.
#   r1: arrival 0.05, chunks at 0.25, 0.40, 0.65 (1 tok each): 3 tokens.
#       TTFT 200 ms, E2E 600 ms, TPOT (600-200)/2 = 200 ms, ITL 150, 250 ms.
#   r2: arrival 0.10, one chunk at 0.40: 1 token. TTFT = E2E = 300 ms, no TPOT, no ITL.
#   r3: arrived, never finished (ignored, as vLLM ignores failed requests).
REQUESTS = _requests([
    {"request_id": 0, "arrival_s": 0.00, "prompt_tokens": 10, "output_tokens": 5, "first_token_s": 0.10,
     "last_token_s": 0.50, "num_drafts": 3, "draft_tokens": 6, "accepted_tokens": 4},
    {"request_id": 1, "arrival_s": 0.05, "prompt_tokens": 20, "output_tokens": 3, "first_token_s": 0.25,
     "last_token_s": 0.65, "num_drafts": 2, "draft_tokens": 4, "accepted_tokens": 1},
    {"request_id": 2, "arrival_s": 0.10, "prompt_tokens": 30, "output_tokens": 1, "first_token_s": 0.40,
     "last_token_s": 0.40},
    {"request_id": 3, "arrival_s": 0.20, "prompt_tokens": 40, "output_tokens": 0, "first_token_s": np.nan,
     "last_token_s": np.nan},
])
# deliberately out of order: ITL must sort by request, then time
EMISSIONS = _emissions([(1, 0.40, 1), (0, 0.20, 2), (2, 0.40, 1), (0, 0.10, 1), (1, 0.65, 1), (0, 0.50, 2),
                        (1, 0.25, 1), (3, 0.30, 1)])


def _metrics(percentiles=(50, 90, 99), goodput=NO_SLO, steps=EMPTY_STEPS, syncs=EMPTY_SYNCS, k=0):
    return compute_metrics(REQUESTS, EMISSIONS, steps, syncs, duration_s=2.0, percentiles=list(percentiles),
                           goodput=goodput, k=k)


def test_counts_and_throughput() -> None:
    m = _metrics()
    assert m["completed"] == 3
    assert m["total_input_tokens"] == 60 and m["total_output_tokens"] == 9
    assert m["duration_s"] == 2.0
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(34.5)


def test_ttft_tpot_e2el() -> None:
    m = _metrics()
    # TTFT [100, 200, 300]: p90 at rank 0.9 * 2 = 1.8 -> 200 + 0.8 * 100
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["std_ttft_ms"] == pytest.approx((20000 / 3) ** 0.5)  # population std, as numpy/vLLM
    assert m["p90_ttft_ms"] == pytest.approx(280.0)
    assert m["p99_ttft_ms"] == pytest.approx(298.0)
    # TPOT [100, 200] (the 1-token request has none): p90 at rank 0.9 -> 190
    assert m["mean_tpot_ms"] == pytest.approx(150.0)
    assert m["p90_tpot_ms"] == pytest.approx(190.0)
    # E2E [500, 600, 300]
    assert m["mean_e2el_ms"] == pytest.approx(1400 / 3)
    assert m["median_e2el_ms"] == pytest.approx(500.0)


def test_pooled_itl_per_chunk() -> None:
    m = _metrics()
    # pooled gaps [100, 300, 150, 250] -> sorted [100, 150, 250, 300]
    assert m["mean_itl_ms"] == pytest.approx(200.0)
    assert m["median_itl_ms"] == pytest.approx(200.0)  # rank 1.5: halfway 150 -> 250
    assert m["std_itl_ms"] == pytest.approx(6250**0.5)
    assert m["p90_itl_ms"] == pytest.approx(285.0)  # rank 2.7: 250 + 0.7 * 50
    assert m["p99_itl_ms"] == pytest.approx(298.5)  # rank 2.97: 250 + 0.97 * 50


def test_percentile_keys() -> None:
    assert [percentile_label(p) for p in (99, 99.0, 99.9, 0.5, 50)] == ["p99", "p99", "p99.9", "p0.5", "p50"]
    m = _metrics(percentiles=(25, 99.9))
    assert m["p25_itl_ms"] == pytest.approx(137.5)  # rank 0.75: 100 + 0.75 * 50
    assert m["p99.9_tpot_ms"] == pytest.approx(199.9)
    assert "p99_itl_ms" not in m


def test_goodput() -> None:
    assert "request_goodput" not in _metrics()
    # r0 (TTFT 100, TPOT 100) passes; r1 fails TPOT 200; r2 fails TTFT 300
    assert _metrics(goodput=Goodput(ttft_ms=250, tpot_ms=150))["request_goodput"] == pytest.approx(0.5)
    # a 1-token request counts TPOT 0, so r2 passes a TPOT-only SLO
    assert _metrics(goodput=Goodput(tpot_ms=150))["request_goodput"] == pytest.approx(1.0)
    # equal to the SLO passes: E2E [500, 600, 300] <= 500
    assert _metrics(goodput=Goodput(e2el_ms=500))["request_goodput"] == pytest.approx(1.0)


def test_speculation() -> None:
    steps = _steps([{"drafts_scheduled": 8, "acc_pos_0": 3, "acc_pos_1": 1}, {"drafts_scheduled": 4, "acc_pos_0": 1}],
                   k=2)
    m = _metrics(steps=steps, k=2)
    assert (m["num_drafts"], m["draft_tokens"], m["accepted_tokens"]) == (5, 10, 5)
    assert m["acceptance_rate"] == pytest.approx(50.0)
    assert m["mean_acceptance_length"] == pytest.approx(2.0)  # 1 + 5 / 5
    assert m["acceptance_rate_pos_0"] == pytest.approx(0.8)  # 4 / 5
    assert m["acceptance_rate_pos_1"] == pytest.approx(0.2)
    assert "acceptance_rate_pos_2" not in m
    assert m["scheduled_draft_tokens"] == 12


def test_engine_metrics() -> None:
    ms = 1e-3
    steps = _steps([
        # step 0: schedule 1 ms, launch-phase sync 2 ms inside [prep_end, launch_end], launch 1 ms
        {"n_reqs": 2, "decode_tokens": 6, "emitted": 4, "schedule_start": 0, "schedule_end": 1 * ms,
         "prep_start": 1 * ms, "prep_end": 2 * ms, "launch_end": 5 * ms, "gpu_start": 5 * ms, "gpu_end": 105 * ms,
         "update_start": 110 * ms, "update_end": 111 * ms, "propose_start": 111 * ms, "propose_end": 111 * ms},
        # step 1: GC pause of 5 ms before a schedule-phase sync [106, 107] ms; 50 ms bubble; 2 wasted slots
        {"n_reqs": 2, "decode_tokens": 6, "emitted": 3, "wasted_slots": 2, "gc_pause_s": 5 * ms,
         "schedule_start": 107 * ms, "schedule_end": 108 * ms, "prep_start": 108 * ms, "prep_end": 109 * ms,
         "launch_end": 110 * ms, "gpu_start": 155 * ms, "gpu_end": 255 * ms, "bubble_s": 50 * ms,
         "update_start": 260 * ms, "update_end": 262 * ms, "propose_start": 262 * ms, "propose_end": 264 * ms},
        {"n_reqs": 1, "decode_tokens": 4, "emitted": 2, "schedule_start": 264 * ms, "schedule_end": 264 * ms,
         "prep_start": 264 * ms, "prep_end": 264 * ms, "launch_end": 264 * ms, "gpu_start": 255 * ms,
         "gpu_end": 405 * ms, "update_start": 405 * ms, "update_end": 405 * ms, "propose_start": 405 * ms,
         "propose_end": 405 * ms},
    ])
    syncs = pd.DataFrame([(0, "metadata_item", "launch", "all_launched", 2 * ms, 4 * ms),
                          (1, "early", "schedule", "all_launched", 106 * ms, 107 * ms),
                          (3, "unrecorded_step", "prep", "all_launched", 406 * ms, 407 * ms)], columns=SYNC_COLUMNS)
    m = _metrics(steps=steps, syncs=syncs)
    assert m["num_steps"] == 3
    assert m["mean_step_ms"] == pytest.approx(350 / 3)  # GPU 100 + 100 + 150 ms
    assert m["gpu_busy_fraction"] == pytest.approx(350 / 400)  # span 5 -> 405 ms
    assert m["mean_bubble_ms"] == pytest.approx(50 / 3)
    assert m["syncs_per_step"] == pytest.approx(2 / 3)
    assert m["sync_wait_ms_per_step"] == pytest.approx(1.0)  # (2 + 1) / 3; step 3 was never recorded
    # host work: step 0: 1 + 1 + 1 (launch after its sync) + 1; step 1: 1 + 1 + 1 + 2 + 2 propose
    assert m["mean_host_ms_per_step"] == pytest.approx(11 / 3)
    assert m["gc_pauses_per_step"] == pytest.approx(1 / 3)
    assert m["gc_pause_ms_per_step"] == pytest.approx(5 / 3)
    assert m["wasted_slots"] == 2 and m["wasted_slot_fraction"] == pytest.approx(2 / 16)
    assert m["mean_batch_size"] == pytest.approx(5 / 3)
    assert m["tokens_per_step"] == pytest.approx(3.0)
    # the host phases with a metric of their own: prep 1 + 1, launch 1 + 1 (step 0's after its sync), propose 2
    assert m["host_prep_ms_per_step"] == pytest.approx(2 / 3)
    assert m["host_launch_ms_per_step"] == pytest.approx(2 / 3)
    assert m["host_propose_ms_per_step"] == pytest.approx(2 / 3)
    # and their shares of the host work (11 ms in all)
    assert [m[f"host_{p}_share"] for p in ("prep", "launch", "propose")] == pytest.approx([2 / 11] * 3)
    iv = host_intervals(steps, syncs)
    gc = iv[iv["kind"] == "gc"].iloc[0]
    assert (gc["start_s"], gc["end_s"]) == pytest.approx((101 * ms, 106 * ms))  # ends where the sync starts
    launch = iv[(iv["kind"] == "launch") & (iv["step"] == 0)].iloc[0]
    assert (launch["start_s"], launch["end_s"]) == pytest.approx((4 * ms, 5 * ms))


def test_device_busy_time_per_step_is_the_sum_of_its_phases() -> None:
    # the window (gpu_start..gpu_end) holds idle gaps while the device waits for the host; the busy time does not
    ms = 1e-3
    phases = [{"gpu_prefill_s": 0.0, "gpu_verify_s": 1 * ms, "gpu_sample_s": 0.5 * ms, "gpu_commit_s": 0.1 * ms,
               "gpu_propose_s": 0.4 * ms, "gpu_start": 0.0, "gpu_end": 3 * ms},
              {"gpu_prefill_s": 2 * ms, "gpu_verify_s": 1 * ms, "gpu_sample_s": 0.5 * ms, "gpu_commit_s": 0.1 * ms,
               "gpu_propose_s": 0.4 * ms, "gpu_start": 3 * ms, "gpu_end": 8 * ms}]
    m = _metrics(steps=_steps(phases), syncs=EMPTY_SYNCS)
    assert m["mean_device_ms"] == pytest.approx(3.0)  # (2 + 4) / 2
    assert m["mean_step_ms"] == pytest.approx(4.0)  # the windows: (3 + 5) / 2
    # each phase's own: the mean over the steps, a step without the phase counting 0
    each = {p: m[f"device_{p}_ms_per_step"] for p in DEVICE_PHASES}
    assert each == pytest.approx({"prefill": 1.0, "verify": 1.0, "sample": 0.5, "commit": 0.1, "propose": 0.4})
    # a phase a step did not measure (NaN) is left out of that phase's mean, and the step out of the busy time
    unmeasured = _metrics(steps=_steps([phases[0], phases[1] | {"gpu_verify_s": math.nan}]), syncs=EMPTY_SYNCS)
    assert unmeasured["device_verify_ms_per_step"] == pytest.approx(1.0)
    assert unmeasured["device_prefill_ms_per_step"] == pytest.approx(1.0) and unmeasured["mean_device_ms"] == 2.0
    sim = _metrics(steps=_steps([{c: math.nan for c in DEVICE_PHASE_COLUMNS} | {"gpu_end": 1 * ms,
                                                                               "prep_end": 2 * ms}]),
                   syncs=EMPTY_SYNCS)
    assert math.isnan(sim["mean_device_ms"])  # the sim models no phases
    assert all(math.isnan(sim[f"device_{p}_ms_per_step"]) for p in DEVICE_PHASES)
    assert sim["host_prep_ms_per_step"] == pytest.approx(2.0)  # its host phases are modelled


def test_single_token_requests_have_no_tpot() -> None:
    requests = _requests([{"request_id": i, "arrival_s": 0.0, "output_tokens": 1, "first_token_s": 0.1 * (i + 1),
                           "last_token_s": 0.1 * (i + 1)} for i in range(3)])
    emissions = _emissions([(i, 0.1 * (i + 1), 1) for i in range(3)])
    m = compute_metrics(requests, emissions, EMPTY_STEPS, EMPTY_SYNCS, duration_s=1.0, percentiles=[99],
                        goodput=NO_SLO, k=0)
    assert m["mean_tpot_ms"] == m["p99_tpot_ms"] == m["mean_itl_ms"] == 0.0
    assert m["mean_ttft_ms"] == pytest.approx(200.0)


def test_empty_inputs() -> None:
    m = compute_metrics(_requests([]), _emissions([]), _steps([], k=2), EMPTY_SYNCS, duration_s=0.0,
                        percentiles=[50, 99], goodput=Goodput(ttft_ms=100), k=2)
    assert m["completed"] == 0 and m["num_steps"] == 0
    assert all(v == 0 for key, v in m.items()), {key: v for key, v in m.items() if v != 0}
    assert "p99_itl_ms" in m and "acceptance_rate_pos_1" in m and "request_goodput" in m


def test_a_long_run() -> None:
    """100k emissions over 20k steps (benchmarks/harness_speed.py times it)."""
    rng = np.random.default_rng(0)
    n_req, n_emit = 5_000, 100_000
    rid = rng.integers(0, n_req, n_emit)
    emissions = pd.DataFrame({"request_id": rid, "step": np.arange(n_emit), "time_s": rng.random(n_emit) * 100,
                              "tokens": rng.integers(1, 5, n_emit)})
    first = emissions.groupby("request_id")["time_s"].min()
    last = emissions.groupby("request_id")["time_s"].max()
    requests = _requests([{"request_id": i, "arrival_s": 0.0, "output_tokens": 20, "first_token_s": first[i],
                           "last_token_s": last[i]} for i in first.index])
    steps = _steps([{"gpu_start": i * 1e-3, "gpu_end": (i + 0.9) * 1e-3} for i in range(20_000)], k=4)
    m = compute_metrics(requests, emissions, steps, EMPTY_SYNCS, duration_s=100.0, percentiles=[50, 90, 99],
                        goodput=Goodput(tpot_ms=50), k=4)
    assert m["completed"] == n_req and m["gpu_busy_fraction"] == pytest.approx(0.9 * 20_000 / 19_999.9)


def test_tables_as_frames_or_arrays_give_the_same_metrics() -> None:
    """The sweep hands the records' arrays (`Records.*_columns`), other callers frames: the same numbers, to the
    bit, with syncs (text columns as numpy gives them) and GC pauses."""
    ms = 1e-3
    steps = _steps([
        {"n_reqs": 2, "decode_tokens": 6, "emitted": 4, "drafts_scheduled": 3, "acc_pos_0": 1, "schedule_end": ms,
         "prep_start": ms, "prep_end": 2 * ms, "launch_end": 5 * ms, "gpu_start": 5 * ms, "gpu_end": 105 * ms,
         "update_start": 110 * ms, "update_end": 111 * ms},
        {"n_reqs": 1, "decode_tokens": 4, "emitted": 3, "gc_pause_s": 5 * ms, "schedule_start": 107 * ms,
         "schedule_end": 108 * ms, "prep_start": 108 * ms, "prep_end": 109 * ms, "launch_end": 110 * ms,
         "gpu_start": 155 * ms, "gpu_end": 255 * ms, "bubble_s": 50 * ms},
    ], k=1)
    sync_rows = [(0, "metadata_item", "launch", "all_launched", 2 * ms, 4 * ms),
                 (1, "early", "schedule", "all_launched", 106 * ms, 107 * ms)]
    syncs = pd.DataFrame.from_records(sync_rows, columns=SYNC_COLUMNS)
    sync_arrays = {c: np.array(values) for c, values in zip(SYNC_COLUMNS, zip(*sync_rows, strict=True), strict=True)}

    def arrays(df: pd.DataFrame) -> dict[str, np.ndarray]:
        return {c: df[c].to_numpy() for c in df.columns}

    goodput = Goodput(ttft_ms=150)
    framed = compute_metrics(REQUESTS, EMISSIONS, steps, syncs, duration_s=2.0, percentiles=[50, 99], goodput=goodput,
                             k=1)
    arrayed = compute_metrics(arrays(REQUESTS), arrays(EMISSIONS), arrays(steps), sync_arrays, duration_s=2.0,
                              percentiles=[50, 99], goodput=goodput, k=1)
    assert framed["mean_host_ms_per_step"] > 0 and framed["syncs_per_step"] == 1.0
    assert framed == arrayed


def test_latency_stats_are_numpys_to_the_bit():
    """mean, median, std and percentiles (computed on the values sorted once) are exactly numpy's np.mean,
    np.median, np.std and np.percentile: odd and even counts, one value, ties, wide ranges, the 0th and 100th
    percentile, a NaN."""
    rng = np.random.default_rng(0)
    percentiles = [0, 1, 25, 50, 90, 99, 99.9, 100]
    samples = [rng.lognormal(0, 2, n) for n in (1, 2, 3, 7, 8, 9, 40, 41, 517) for _ in range(20)]
    samples += [np.array([2.5, 2.5, 2.5]), rng.integers(0, 4, 12) * 0.1, np.array([1.0, np.nan, 3.0])]
    for values in samples:
        got = latency_stats("x", values, percentiles)
        want = [np.mean(values), np.median(values), np.std(values), *np.percentile(values, percentiles)]
        np.testing.assert_array_equal(np.array(list(got.values())), np.array(want, dtype=np.float64), strict=True)
        assert list(got) == ["mean_x_ms", "median_x_ms", "std_x_ms", *(f"{percentile_label(p)}_x_ms"
                                                                       for p in percentiles)]
    assert latency_stats("x", np.array([]), [50]) == {"mean_x_ms": 0.0, "median_x_ms": 0.0, "std_x_ms": 0.0,
                                                      "p50_x_ms": 0.0}
