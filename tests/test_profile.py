"""Cost profiles: the fit recovers known physical costs and extrapolates as the physics says; the sim picks the
profile of its GPU and model; a profile that does not fit is refused with exit 2; the validation scenarios run at
the sim level."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from simharness import profile
from simharness.calibration import prefill_chunks
from simharness.cli import app
from simharness.costmodel import CostModel
from simharness.engine.buckets import batch_buckets, prefill_bucket, prefill_sizes
from simharness.models import model_config
from simharness.profile import (
    ATTENTION,
    COMPUTE,
    EXPONENT,
    FIXED,
    FORMAT,
    MEMORY,
    MERGE,
    PER_FORWARD,
    POSITION,
    PREFIX_ATTENTION,
    PROPOSER,
    RANDOM,
    S_PER_BYTE,
    SAMPLER,
    TERMS,
    UNITS,
    _forward,
    attention_chunk,
    graph_rows,
    own_device_costs,
    prior_coefficients,
    profile_seconds,
    profile_times,
    shape_sizes,
)
from simharness.profile_fit import FITTED, fit_device, fit_profile_host, fit_random_path
from simharness.runner import run, without_ignored
from simharness.scenario import GpuCosts, ScenarioError, load_scenario, scenario_from_dict, sweep_points

SIZES = shape_sizes(model_config("llama-3.2-1b"))
TAILS = {1: 40e-6, 2: 60e-6, 3: 50e-6}


def truth() -> np.ndarray:
    """Known physical costs, away from the roofline prior in every fitted term."""
    coef = prior_coefficients("H100", GpuCosts())
    coef[FIXED], coef[PER_FORWARD], coef[PROPOSER], coef[EXPONENT] = 300e-6, 80e-6, 0.2e-9, 6.0
    coef[MEMORY], coef[COMPUTE], coef[SAMPLER], coef[RANDOM] = 1 / 0.7, 1 / 0.5, 1 / 0.6, 0.3
    coef[ATTENTION], coef[PREFIX_ATTENTION] = 1 / 0.3, 1 / 0.15
    coef[POSITION], coef[MERGE] = 40e-9, 900e-9
    return coef


def design(rng: np.random.Generator, n: int, rows: int, k: int, context: int) -> np.ndarray:
    """Steps (profile.FEATURES) of up to `rows` decode rows, `k` drafts per row, `context` tokens per row, some
    with prefill chunks (half of them later chunks of a long prompt), greedy, random and mixed sampling, and the GPU
    proposer's history."""
    return design_verified(rng, n, rows, k, context)[0]


def design_verified(rng: np.random.Generator, n: int, rows: int, k: int, context: int) -> tuple[np.ndarray, np.ndarray]:
    """`design`'s steps and the tokens each verified (fewer than it computes: trimmed slots)."""
    decode_rows = rng.integers(1, rows + 1, n).astype(float)
    tokens = decode_rows * (1 + rng.integers(0, k + 1, n))
    decode_context = decode_rows * rng.uniform(64, context, n)
    longest = decode_context / decode_rows * rng.uniform(1.0, 2.0, n)
    chunks = (rng.random(n) < 0.2) * rng.integers(1, 4, n)
    prefill_tokens = chunks * rng.integers(16, 1024, n)
    verified = np.round(decode_rows + (tokens - decode_rows) * rng.uniform(0.3, 1.0, n))  # trimmed slots too
    random_tokens = verified * rng.choice([0.0, 0.5, 1.0], n)
    prefill_context = chunks * rng.integers(0, 4096, n) * (rng.random(n) < 0.5)
    padded = np.ceil(prefill_tokens / 64) * 64
    x = np.column_stack([decode_rows, tokens, decode_context, chunks, padded, random_tokens,
                         decode_context + prefill_tokens, prefill_context, longest])
    return x, verified


def known_prior(coef: np.ndarray) -> np.ndarray:
    """The roofline prior with the random path's term at its true value, as the sampler's own time gives it
    (`fit_random_path`): the device fit does not search it."""
    prior = prior_coefficients("H100", GpuCosts())
    prior[RANDOM] = coef[RANDOM]
    return prior


def measured(rng: np.random.Generator, x: np.ndarray, coef: np.ndarray):
    """Real-level windows: the device work, or the launch's end plus its depth's tail where the launch is slower."""
    depth = rng.integers(1, 4, len(x))
    work = profile_times(coef, SIZES, x)
    launch = work * rng.uniform(0.3, 1.5, len(x))  # about half the steps launch-bound
    window = np.maximum(work, launch + np.array([TAILS[d] for d in depth]))
    return window, launch, depth


def test_fit_recovers_known_physical_costs_within_1_percent():
    rng = np.random.default_rng(0)
    coef = truth()
    x = design(rng, 3000, 256, 8, 4096)
    window, launch, depth = measured(rng, x, coef)
    fit = fit_device(x, window, launch, depth, SIZES, known_prior(coef))
    assert RANDOM not in FITTED and fit.coef[RANDOM] == coef[RANDOM]
    for term in FITTED:
        assert fit.coef[term] == pytest.approx(coef[term], rel=0.01), TERMS[term]
    for d, tail in TAILS.items():
        assert fit.tails[d] == pytest.approx(tail, rel=0.01)


def test_fit_extrapolates_to_k8_long_context_and_batch_256():
    """Fitted on batches up to 64, k up to 4 and 1024 tokens of context per row, the profile predicts batches to
    256, k = 8 and 4096-token contexts within 1%, as the physical terms grow with what drives them; a linear fit in
    the calibration's features (rows, tokens, context) on the same steps does not."""
    rng = np.random.default_rng(1)
    coef = truth()
    x = design(rng, 3000, 64, 4, 1024)
    window, launch, depth = measured(rng, x, coef)
    fit = fit_device(x, window, launch, depth, SIZES, known_prior(coef))
    far = design(rng, 1000, 256, 8, 4096)
    far = far[(far[:, 0] > 128) | (far[:, 1] > 5 * far[:, 0]) | (far[:, 2] > 2048 * far[:, 0])]
    expected = profile_times(coef, SIZES, far)
    error = np.abs(profile_times(fit.coef, SIZES, far) / expected - 1)
    assert error.max() < 0.01
    linear_x = np.column_stack([np.ones(len(x)), x[:, :5]])
    work = profile_times(coef, SIZES, x)
    beta = np.linalg.lstsq(linear_x, work, rcond=None)[0]
    linear_error = np.abs(np.column_stack([np.ones(len(far)), far[:, :5]]) @ beta / expected - 1)
    assert linear_error.max() > 0.2


def test_graph_rows_and_attention_chunks_are_the_engines():
    """The cost model's decode geometry is the engine's: a batch runs as its smallest captured bucket
    (`engine.buckets.batch_buckets`), and the verify attention splits a row's context as the kernel does
    (`engine.model_triton.attention_chunk_size`, 0 here where it reads the whole context)."""
    buckets = batch_buckets(256)
    for rows in range(1, 257):
        assert graph_rows(rows) == min(b for b in buckets if b >= rows)
    pytest.importorskip("triton")
    from simharness.engine.model_triton import attention_chunk_size

    whole = 1 << 20  # the kernel's chunk where it reads the whole context: max_len
    for rows in [*range(1, 40), 64, 256]:
        for heads in (1, 2, 4, 8, 16, 32):
            assert (attention_chunk(rows, heads) or whole) == attention_chunk_size(rows, heads, whole), (rows, heads)


def test_the_verify_attentions_critical_path_counts_where_it_outlasts_the_kv_read():
    """A decode forward pays its attention's critical path (the longest program's positions, and the partials its
    row's last program merges) where that is longer than the KV read at the fitted bandwidth: one row over 4,096
    tokens splits into 32 chunks of 128 (1B: 8 KV heads); 16 rows read whole contexts; 256 rows are bandwidth-bound."""
    coef, layers = truth(), SIZES[5]
    kv_s = lambda tokens: coef[MEMORY] * SIZES[1] * tokens * coef[S_PER_BYTE]  # noqa: E731

    def extra(rows: int, context: int, longest: int) -> float:
        with_path = profile_seconds(coef, SIZES, rows, rows * 5, rows * context, 0, 0, 0, 0, 0, longest)
        zero = coef.copy()
        zero[POSITION] = zero[MERGE] = 0.0
        return with_path - profile_seconds(zero, SIZES, rows, rows * 5, rows * context, 0, 0, 0, 0, 0, longest)

    path = layers * (128 * coef[POSITION] + 32 * coef[MERGE])  # 4,091 + 5 positions: 32 chunks of 128
    assert extra(1, 4091, 4091) == pytest.approx(path - kv_s(4096), rel=1e-12)
    # 16 rows: no split, the longest row's context (not the mean) sets the path
    assert extra(16, 2000, 3995) == pytest.approx(layers * 4000 * coef[POSITION] - kv_s(16 * 2005), rel=1e-12)
    assert extra(16, 2000, 2000) < extra(16, 2000, 3995)
    assert extra(256, 2000, 2000) == 0.0
    assert attention_chunk(1, 8) == 128 and attention_chunk(8, 8) == 512 and attention_chunk(16, 8) == 0


def test_a_later_prefill_chunk_reads_and_attends_to_the_prompt_before_it():
    """A chunk of C tokens after S prompt tokens: its forward reads the S tokens' KV besides its own and computes
    C * S attention pairs more than the prompt's first chunk of C tokens, at the prefix pairs' own slowdown; a chunk
    costs its token bucket's tokens."""
    coef = truth()
    weights, kv, linear, attention = SIZES[:4]

    def forward(memory: float, flops: float, own: float, prefix: float = 0.0) -> float:
        return _forward(coef, memory, flops, attention * (coef[ATTENTION] * own + coef[PREFIX_ATTENTION] * prefix))

    first = profile_seconds(coef, SIZES, 0, 0, 0, 1, 512, 0, 0, 0, 0)
    later = profile_seconds(coef, SIZES, 0, 0, 0, 1, 512, 0, 0, 2048, 0)
    own = 512 * 513 / 2
    assert later - first == pytest.approx(
        forward(weights + kv * (2048 + 512), linear * 512, own, 512 * 2048)
        - forward(weights + kv * 512, linear * 512, own), rel=1e-12)
    assert later > first * 1.05  # the 1B's 2,048-token prefix: a tenth of the chunk's FLOPs
    # two chunks: pairs and reads at the mean chunk and the mean prefix (as the decode rows' at the mean row)
    two = profile_seconds(coef, SIZES, 0, 0, 0, 2, 1024, 0, 0, 4096, 0)  # chunks of 500 padded to 512
    assert two - coef[PER_FORWARD] * 2 - coef[FIXED] == pytest.approx(
        forward(2 * weights + kv * (4096 + 1024), linear * 1024, 1024 * 513 / 2, 1024 * 2048)
        + 2 * coef[SAMPLER] * SIZES[4] * coef[S_PER_BYTE], rel=1e-12)


def test_a_chunks_bucket_is_the_prefill_graph_it_replays():
    assert [prefill_bucket(n) for n in range(1, 9000)] == [prefill_sizes(n)[-1] for n in range(1, 9000)]


def test_steps_record_the_prompt_before_each_prefill_chunk(tmp_path):
    """`prefill_context` of a step is the prompt tokens prefilled before its chunks: one request at a time, a
    1,000-token prompt in chunks of a 256-token budget starts its chunks at 0, 256, 512 and 768; the last chunk's
    232 tokens run as a 256-token bucket."""
    sc = scenario_from_dict({"name": "chunks", "workload": {"num_requests": 2, "concurrency": 1,
                                                             "prompt_len": {"dist": "fixed", "value": 1000},
                                                             "output_len": {"dist": "fixed", "value": 4}},
                             "engine": {"speculation": {"k": 0}}, "scheduler": {"max_num_batched_tokens": 256}})
    steps = pd.read_parquet(run(sc, tmp_path).run_dir / "steps.parquet")
    chunks = steps[steps["n_prefill_reqs"] > 0]
    assert chunks["prefill_tokens"].tolist() == [256, 256, 256, 232] * 2
    assert chunks["prefill_context"].tolist() == [0, 256, 512, 768] * 2
    assert (steps.loc[steps["n_prefill_reqs"] == 0, "prefill_context"] == 0).all()
    context, padded = prefill_chunks(chunks, pd.read_parquet(run(sc, tmp_path).run_dir / "requests.parquet"))
    assert context.tolist() == [0, 256, 512, 768] * 2 and padded.tolist() == [256] * 8


@pytest.mark.parametrize("settings", [
    {"workload": {"concurrency": 64}, "scheduler": {"max_num_batched_tokens": 512}},
    {"workload": {"concurrency": 8, "arrival": "poisson", "rate": 400.0}, "scheduler": {"max_num_batched_tokens": 300}},
    {"workload": {"concurrency": 256}, "scheduler": {"max_num_batched_tokens": 8192, "depth": 3}},
])
def test_the_prefill_context_of_older_runs_is_rebuilt_exactly(settings, tmp_path):
    """Runs recorded before the steps table held `prefill_context`: `calibration.prefill_chunks` rebuilds it from the
    steps' prefill counts and the prompts, equal to what the scheduler records, step by step; its chunks' buckets
    add up to no fewer tokens than the step's and at most 63 (or a quarter, past 1,024 tokens) more per chunk; a
    table whose record disagrees is refused."""
    base = {"name": "rebuild", "seed": 3, "workload": {"num_requests": 120, "prompt_len":
            {"dist": "uniform", "min": 16, "max": 1500}, "output_len": {"dist": "uniform", "min": 2, "max": 40}}}
    sc = scenario_from_dict(base, {f"{s}.{k}": v for s, fields in settings.items() for k, v in fields.items()})
    run_dir = run(sc, tmp_path).run_dir
    steps, requests = pd.read_parquet(run_dir / "steps.parquet"), pd.read_parquet(run_dir / "requests.parquet")
    assert (steps["prefill_context"] > 0).sum() >= 5
    shuffled = steps.sample(frac=1.0, random_state=0)
    context, padded = prefill_chunks(shuffled.drop(columns="prefill_context"), requests)
    assert context.tolist() == shuffled["prefill_context"].tolist()
    tokens, chunks = shuffled["prefill_tokens"].to_numpy(), shuffled["n_prefill_reqs"].to_numpy()
    assert (padded >= tokens).all() and (padded <= tokens + np.maximum(63 * chunks, tokens // 4 + 255)).all()
    assert (padded[chunks == 0] == 0).all() and (padded > tokens).any()
    shuffled.loc[shuffled["prefill_context"] > 0, "prefill_context"] += 1
    with pytest.raises(ValueError, match="recorded prefill_context differs"):
        prefill_chunks(shuffled, requests)


def test_the_random_path_comes_from_the_samplers_own_time():
    """The sampler's device time per step, generated as a base, a cost per sampled position and 1.0 logit reads per
    random token (3% scatter), gives the random path's term back within 2%. Steps whose sampler was not timed (the
    sim's records) or with no random row leave it to the roofline (None)."""
    rng = np.random.default_rng(3)
    x, verified = design_verified(rng, 2000, 256, 8, 4096)
    logit = SIZES[4] * prior_coefficients("H100", GpuCosts())[S_PER_BYTE]
    sample = (8e-6 + 0.8e-6 * (verified + x[:, 3]) + 1.0 * logit * x[:, 5]) * np.exp(rng.normal(0, 0.03, len(x)))
    steps = pd.DataFrame({"sample_s": sample, "decode_tokens": verified})
    value, quality = fit_random_path(steps, x, logit)
    assert value == pytest.approx(1.0, rel=0.02)
    assert quality["random_steps"] == (x[:, 5] > 0).sum() and quality["median_rel_error"] < 0.03
    assert fit_random_path(pd.DataFrame({"sample_s": np.full(len(x), np.nan)}), x, logit) is None
    greedy = x.copy()
    greedy[:, 5] = 0.0
    assert fit_random_path(pd.DataFrame({"sample_s": sample}), greedy, logit) is None


def proposer_steps(rng: np.random.Generator, prompts: list, steps: int = 60) -> pd.DataFrame:
    """CPU proposer records of a host block: at each concurrency and prompt length, steps drafting for half to all
    of the users, each request's history its prompt (`prompts`: fixed lengths, or one (low, high) range per
    request) and up to 48 generated tokens; 20 µs + 3 µs a request + 10 ns a history token, 2% scatter."""
    rows = []
    for users in (1, 16, 64, 256):
        for prompt in prompts:
            for _ in range(steps):
                reqs = int(rng.integers(max(1, users // 2), users + 1))
                lengths = np.full(reqs, prompt) if np.isscalar(prompt) else rng.integers(*prompt, reqs)
                rows.append({"proposed": reqs, "history": float(lengths.sum() + rng.integers(0, 49, reqs).sum())})
    out = pd.DataFrame(rows).assign(step=1.0, measured="propose")
    out["propose_s"] = (20e-6 + 3e-6 * out["proposed"] + 10e-9 * out["history"]) * np.exp(
        rng.normal(0, 0.02, len(out)) - 0.02**2 / 2)
    for phase in ("schedule", "prep", "launch", "update", "readback"):  # not measured
        out[f"{phase}_s"] = np.nan
    return out.assign(n_reqs=out["proposed"], n_tokens=0.0, prefill_reqs=0.0)


def test_the_cpu_proposers_per_request_and_per_token_costs_separate():
    """The host block at two prompt lengths per concurrency (scenarios/profile/grid.yaml): requests and history
    tokens vary apart, and the proposer's three costs come back within 1%. Plain least squares (the calibration's
    host fit) gets the per-step cost wrong by several percent on the same records: the largest steps decide."""
    from simharness.calibration import fit_host

    truth = {"ngram_cpu_us": 20.0, "ngram_cpu_per_req_us": 3.0, "ngram_cpu_per_token_ns": 10.0}
    steps = proposer_steps(np.random.default_rng(4), [192, 1536])
    host, kept, quality = fit_profile_host(steps)
    for field, value in truth.items():
        assert host[field] == pytest.approx(value, rel=0.01), field
    assert quality["propose"]["steps"] == len(steps) and "ngram_cpu_us" not in kept
    assert abs(fit_host(steps)[0]["ngram_cpu_us"] / truth["ngram_cpu_us"] - 1) > 0.02


# ------------------------------------------------------------------------------------------------ files


def profile_mapping(gpu: str = "H100", model: str = "tiny", **changes) -> dict:
    coef = truth()
    data = {"format": FORMAT, "device": "test device", "gpu": gpu, "model": model, "level": "real",
            "device_step": {name: float(coef[i] / UNITS[i]) for i, name in enumerate(TERMS)},
            "overlap": {1: {"lead_us": 20.0, "tail_us": 40.0}, 2: {"lead_us": 25.0, "tail_us": 60.0}},
            "host_costs": {"launch_us": 300.0}, "validation": {"summary": "mean TPOT median |error| 3.0%"}}
    data.update(changes)
    return data


@pytest.fixture
def profiles(tmp_path, monkeypatch) -> Path:
    """A profiles directory holding an H100 profile of the tiny model."""
    monkeypatch.setattr(profile, "PROFILES_DIR", tmp_path / "profiles")
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "h100-tiny.yaml").write_text(yaml.safe_dump(profile_mapping()))
    return tmp_path / "profiles"


TINY = {"name": "p", "workload": {"num_requests": 12, "concurrency": 4, "prompt_len": {"dist": "fixed", "value": 64},
                                  "output_len": {"dist": "fixed", "value": 24}},
        "engine": {"gpu": "H100", "model": "tiny"}, "report": {"trace_steps": 0}}


def test_sim_uses_the_profile_of_its_gpu_and_model(profiles, tmp_path):
    sc = scenario_from_dict(TINY)
    cost = CostModel(sc.engine, optimistic_correction=True)
    assert cost.profile is not None and cost.profile.path == str(profiles / "h100-tiny.yaml")
    assert cost.h.launch_us == 300.0  # the profile's host costs replace the scenario's
    assert CostModel(scenario_from_dict(TINY, {"engine.gpu": "H200"}).engine, optimistic_correction=True).profile \
        is None  # no H200 profile: the roofline
    assert CostModel(scenario_from_dict(TINY, {"engine.profile": "none"}).engine,
                     optimistic_correction=True).profile is None
    with_profile = run(sc, tmp_path / "a")
    roofline = run(scenario_from_dict(TINY, {"engine.profile": "none"}), tmp_path / "b")
    assert with_profile.summary["cost_profile"].iloc[0] == str(profiles / "h100-tiny.yaml")
    assert with_profile.summary["cost_profile_validation"].iloc[0] == "mean TPOT median |error| 3.0%"
    assert roofline.summary["cost_profile"].iloc[0] == "none"
    assert "uncalibrated" in roofline.summary["cost_profile_validation"].iloc[0]
    # every step's device window holds at least the profile's fixed 300 µs and 80 µs per forward; the roofline's
    # tiny-model steps are far shorter
    window = lambda r: r.steps["gpu_end"] - r.steps["gpu_start"]  # noqa: E731
    assert window(with_profile).min() >= 380e-6
    assert window(roofline).median() < 200e-6
    # the device starts during the launch (the profile's lead), not after it
    steps = with_profile.steps
    assert (steps["gpu_start"] < steps["launch_end"]).any()
    report = (with_profile.run_dir / "report.md").read_text()
    assert f"**Sim cost profile:** {profiles / 'h100-tiny.yaml'}" in report
    assert "the sim is uncalibrated" in (roofline.run_dir / "report.md").read_text()


def test_device_costs_the_scenario_sets_run_the_roofline_and_say_so(profiles, tmp_path):
    """`engine.gpu_costs` set under `engine.profile: auto`: the roofline with those costs runs (the profile would
    ignore them), and the run says so; with a profile named explicitly, they conflict: exit 2."""
    sc = scenario_from_dict(TINY, {"engine.gpu_costs.mem_bandwidth_gbs": 2000})
    assert CostModel(sc.engine, optimistic_correction=True).profile is None
    assert CostModel(scenario_from_dict(TINY).engine, optimistic_correction=True).profile is not None
    # only where a committed profile would have run: no H200 profile, no note (the roofline runs either way)
    assert own_device_costs(sc.engine)
    assert not own_device_costs(scenario_from_dict(TINY, {"engine.gpu": "H200",
                                                          "engine.gpu_costs.mem_bandwidth_gbs": 2000}).engine)
    scenario = tmp_path / "s.yaml"
    scenario.write_text(yaml.safe_dump(TINY))
    r = CliRunner().invoke(app, ["run", str(scenario), "--out", str(tmp_path / "a"), "--set",
                                 "engine.gpu_costs.mem_bandwidth_gbs=2000"])
    assert r.exit_code == 0, r.output
    assert "note: engine.gpu_costs: set, so the sim runs the roofline with them" in " ".join(r.stderr.split())
    summary = next((tmp_path / "a").glob("*/*/summary.csv")).read_text()
    assert ",none," in summary and "h100-tiny.yaml" not in summary
    r = CliRunner().invoke(app, ["run", str(scenario), "--out", str(tmp_path / "b"), "--set",
                                 "engine.gpu_costs.mem_bandwidth_gbs=2000", "--set",
                                 f"engine.profile={profiles / 'h100-tiny.yaml'}"])
    assert r.exit_code == 2, r.output
    assert "engine.gpu_costs is set, but the profile replaces" in " ".join(r.stderr.split())
    assert not (tmp_path / "b").exists()


def test_a_profile_carries_over_to_a_part_of_its_chip_design(profiles, tmp_path):
    """`derive-profile`: the H200's datasheet rates replace the H100's and every fitted term stays; the sim of an
    H200 then runs on it by default, with shorter steps where they are bound by memory. It never overwrites a file
    and refuses another chip design (exit 2, nothing written)."""
    source = profiles / "h100-tiny.yaml"
    r = CliRunner().invoke(app, ["derive-profile", str(source), "--gpu", "h200"])
    assert r.exit_code == 0, r.output
    derived = profiles / "h200-tiny.yaml"
    h100, h200 = profile.load_profile(source), profile.load_profile(derived)
    assert h200.gpu == "H200" and h200.validation is None and "derived for the H200" in h200.device
    assert h200.coef[S_PER_BYTE] == pytest.approx(1 / 4800e9, rel=1e-12)
    changed = [i for i in range(len(TERMS)) if h200.coef[i] != h100.coef[i]]
    assert changed == [S_PER_BYTE]  # the H200's peak bf16 FLOPs equal the H100's in the datasheet
    assert h200.host_costs == h100.host_costs
    # each depth's launch tail (device work left after the launch) shrinks by the decode steps' work ratio: more
    # than nothing, less than the bandwidth ratio (part of a step is not memory-bound)
    ratio = profile.work_ratio(np.array(h100.coef), np.array(h200.coef), model_config("tiny"))
    assert 3350 / 4800 < ratio < 1
    one_step = profile.profile_seconds(np.array(h200.coef), shape_sizes(model_config("tiny")), 16, 80, 16 * 512,
                                       0, 0, 0, 0, 0, 512)
    assert one_step < profile.profile_seconds(np.array(h100.coef), shape_sizes(model_config("tiny")), 16, 80,
                                              16 * 512, 0, 0, 0, 0, 0, 512)
    for depth, (lead, tail) in h100.overlap.items():
        assert h200.overlap[depth] == (lead, pytest.approx(tail * ratio, rel=1e-9))
    sc = scenario_from_dict(TINY, {"engine.gpu": "H200", "workload.concurrency": 1})
    assert CostModel(sc.engine, optimistic_correction=True).profile.path == str(derived)
    window = lambda r: float((r.steps["gpu_end"] - r.steps["gpu_start"]).median())  # noqa: E731
    slow = run(scenario_from_dict(TINY, {"workload.concurrency": 1}), tmp_path / "h100")
    assert window(run(sc, tmp_path / "h200")) < window(slow)
    before = derived.read_bytes()
    again = CliRunner().invoke(app, ["derive-profile", str(source), "--gpu", "H200"])
    assert again.exit_code == 2 and "exists" in again.stderr and derived.read_bytes() == before
    other = CliRunner().invoke(app, ["derive-profile", str(source), "--gpu", "A100", "--out", str(tmp_path / "a.yaml")])
    assert other.exit_code == 2 and "same chip design" in " ".join(other.stderr.split())
    assert "Traceback" not in other.output and not (tmp_path / "a.yaml").exists()


@pytest.mark.parametrize(
    "content,message",
    [
        (profile_mapping(model="llama-3-8b"), "field model: fitted for 'llama-3-8b'"),
        (profile_mapping(gpu="H200"), "field gpu: measured on 'H200'"),
        (profile_mapping(format="simharness-profile-0"), "field format: 'simharness-profile-0'"),
        ({"format": "simharness-calibration-1", "device": "x"}, "field format: 'simharness-calibration-1'"),
        ({"weights": [1, 2]}, "field format: missing"),
        ("device_step: [unclosed", "not a readable YAML file"),
        (profile_mapping(device_step={"fixed_us": 1.0}), "field device_step.per_forward_us"),
        (profile_mapping(overlap={1: {"lead_us": "x", "tail_us": 1}}), "field overlap"),
        (profile_mapping(host_costs={"warp_us": 1.0}), "field host_costs.warp_us"),
    ],
)
def test_a_profile_that_does_not_fit_exits_2_naming_file_and_field(tmp_path, content, message):
    path = tmp_path / "bad.yaml"
    path.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
    scenario = tmp_path / "s.yaml"
    scenario.write_text(yaml.safe_dump(TINY))
    r = CliRunner().invoke(app, ["run", str(scenario), "--out", str(tmp_path / "out"), "--set",
                                 f"engine.profile={path}"])
    assert r.exit_code == 2, r.output
    assert str(path) in " ".join(r.stderr.split()).replace(" ", "") or str(path) in r.stderr
    assert message in " ".join(r.stderr.split())
    assert "Traceback" not in r.output
    assert not (tmp_path / "out").exists()


def test_only_the_sim_level_reads_the_profile(tmp_path):
    """A profile of an older format is refused where the sim would run on it, not at a measured level, which reads
    none: a recorded real run (a profile grid's) stays readable after the shipped profiles change format. Set to
    the sim later, as a fidelity run's sim checks are, the point is checked then."""
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(profile_mapping(format="simharness-profile-1")))
    refit = "field format: 'simharness-profile-1'.*`simharness profile --from RUN_DIR`"  # how to refit it, no GPU
    with pytest.raises(ScenarioError, match=refit):
        scenario_from_dict(TINY, {"engine.profile": str(old)})
    sc = scenario_from_dict(TINY, {"engine.profile": str(old), "engine.level": "real"})
    assert sc.engine.profile == str(old)
    with pytest.raises(ValueError, match="field format: 'simharness-profile-1'"):
        sc.engine.level = "sim"


def test_a_corrupt_committed_profile_is_refused(profiles, tmp_path):
    (profiles / "h100-tiny.yaml").write_text(yaml.safe_dump(profile_mapping(model="llama-3.2-1b")))
    with pytest.raises(ValueError, match="h100-tiny.yaml: field model"):
        scenario_from_dict(TINY)


# ------------------------------------------------------------------------------------------------ validation

VALIDATION = sorted((Path(__file__).resolve().parents[1] / "scenarios" / "validation").glob("*.yaml"))


@pytest.mark.parametrize("path", VALIDATION, ids=lambda p: p.stem)
def test_validation_scenarios_run_at_the_sim_level(path, tmp_path):
    """Each family at tiny sizes (the test override), every sweep point, at the sim level."""
    sc = load_scenario(path)
    count = "workload.requests_per_user" if sc.workload.requests_per_user else "workload.num_requests"
    small = load_scenario(path, {count: 2, "workload.output_len": {"dist": "fixed", "value": 12},
                                 "workload.prompt_len": {"dist": "uniform", "min": 32, "max": 96},
                                 "engine.model": "tiny"})
    without_ignored(small, "sim")  # as `simharness fidelity` does for its sim level
    result = run(small, tmp_path)
    assert len(VALIDATION) >= 5
    assert result.failed.empty
    assert (result.summary["output_throughput"] > 0).all()


# ------------------------------------------------------------------------------------------------ through records


def measured_grid_run(root: Path, blocks: dict, source: Path) -> Path:
    """The committed grid's base with `blocks`, run at the sim level on the profile `source` (one request per user,
    16 tokens), its records relabelled as measured at the real level on an H100: what `profile --from` takes."""
    from simharness.profile_grid import GRID, grid_points
    from simharness.runner import execute

    grid = {**yaml.safe_load(GRID.read_text()), "blocks": blocks}
    root.mkdir(parents=True)
    (root / "grid.yaml").write_text(yaml.safe_dump(grid))
    scenario, points = grid_points(root / "grid.yaml", {
        "engine.level": "sim", "engine.profile": str(source), "workload.requests_per_user": 1,
        "workload.output_len": {"dist": "fixed", "value": 16}})
    run_dir = execute(scenario, points, root / "runs")
    for path in (run_dir / "points").glob("*/summary.json"):
        path.write_text(json.dumps({**json.loads(path.read_text()), "level": "real"}))
    for path in [*(run_dir / "points").glob("*/steps.parquet"), *run_dir.glob("steps.parquet")]:  # batches, run's
        pd.read_parquet(path).assign(measured="prep,launch,gpu,readback").to_parquet(path, index=False)
    meta = json.loads((run_dir / "meta.json").read_text())
    (run_dir / "meta.json").write_text(json.dumps({**meta, "device": "real: NVIDIA H100 80GB HBM3, torch 2"}))
    return run_dir


DEPTH_BLOCK = {"depth": {"scheduler.depth": [1, 3], "workload.concurrency": [4]}}


def test_profile_command_fits_the_costs_a_sim_run_was_made_with(tmp_path):
    """The designed grid (tiny sizes) run at the sim level on a known profile, its records relabelled as measured at
    the real level, then `simharness profile --from`: the step records' features, the device windows and the
    launch overlap give back the profile the run was made with. The records hold no sampling flag per row and the
    CPU proposer's history, not the GPU's, so the recovery is close, not exact. The depth
    block measured again in a second run comes from that run, and the command says which blocks each run gave."""
    source = tmp_path / "truth.yaml"
    source.write_text(yaml.safe_dump(profile_mapping(model="llama-3.2-1b")))
    blocks = {"batch_tokens": {"workload.concurrency": [1, 8, 48], "engine.speculation.k": [0, 4, 8]},
              "context": {"workload.prompt_len": [{"dist": "fixed", "value": 2000}]},
              "sampling": {"workload.random_fraction": [1.0]},
              "prefill": {"scheduler.max_num_batched_tokens": [256], "workload.concurrency": [2]}, **DEPTH_BLOCK}
    run_dir = measured_grid_run(tmp_path / "a", blocks, source)  # the committed grid's blocks, smaller
    again = measured_grid_run(tmp_path / "b", DEPTH_BLOCK, source)
    out = tmp_path / "fitted.yaml"
    r = CliRunner().invoke(app, ["profile", "--model", "llama-3.2-1b", "--from", str(run_dir), "--from", str(again),
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    output = " ".join(r.stdout.split())
    assert f"grid run {run_dir}: batch_tokens, context, prefill, sampling (measured again in a later run: depth)" \
        in output
    assert f"grid run {again}: depth" in output
    fitted = yaml.safe_load(out.read_text())
    assert [run["blocks"] for run in fitted["provenance"]["runs"]] == [
        ["batch_tokens", "context", "prefill", "sampling"], ["depth"]]
    assert (fitted["gpu"], fitted["model"], fitted["level"]) == ("H100", "llama-3.2-1b", "real")
    assert fitted["quality"]["device"]["median_rel_error"] < 0.02
    true_step = profile_mapping()["device_step"]
    for name in ("fixed_us", "memory_slowdown"):
        assert fitted["device_step"][name] == pytest.approx(true_step[name], rel=0.05), name
    for depth, overlap in fitted["overlap"].items():
        truth_overlap = profile_mapping()["overlap"][min(depth, 2)]
        assert overlap["lead_us"] == pytest.approx(truth_overlap["lead_us"], rel=0.01)
    assert fitted["host_costs"]["launch_us"] == pytest.approx(300.0, rel=0.01)
    assert profile.load_profile(out).model == "llama-3.2-1b"


def test_a_block_measured_again_replaces_the_earlier_runs(tmp_path):
    """Fitting from an old run and a new one: the points of a block the new run also holds come from the new run
    alone (its slower device here), the old run's other blocks stay; given the other way round, the old run's
    block replaces the new one's."""
    from simharness.profile_grid import grid_fit_data

    old_costs, new_costs = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old_costs.write_text(yaml.safe_dump(profile_mapping(model="llama-3.2-1b")))
    slower = {**profile_mapping()["device_step"], "fixed_us": 50000.0}
    new_costs.write_text(yaml.safe_dump(profile_mapping(model="llama-3.2-1b", device_step=slower)))
    blocks = {"batch_tokens": {"workload.concurrency": [1, 8]}, **DEPTH_BLOCK}
    old = measured_grid_run(tmp_path / "old", blocks, old_costs)
    new = measured_grid_run(tmp_path / "new", DEPTH_BLOCK, new_costs)
    data, sources = grid_fit_data([old, new])
    window = data.steps["gpu_end_s"] - data.steps["gpu_start_s"]
    depth_block = data.steps["depth"] != 2  # the base runs at depth 2, the depth block at 1 and 3
    assert (window[depth_block] >= 50e-3).all() and (window[~depth_block] < 20e-3).all()
    alone = [grid_fit_data([run])[0].steps for run in (old, new)]
    assert len(data.steps) == (alone[0]["depth"] == 2).sum() + len(alone[1])
    assert sources == [f"{old}: batch_tokens (measured again in a later run: depth)", f"{new}: depth"]
    assert [run["points"] for run in data.runs] == [2, 2]
    reversed_data, _ = grid_fit_data([new, old])  # now the old run is the later one
    assert ((reversed_data.steps["gpu_end_s"] - reversed_data.steps["gpu_start_s"]) < 20e-3).all()
    meta = json.loads((new / "meta.json").read_text())
    (new / "meta.json").write_text(json.dumps({**meta, "device": "real: NVIDIA A100-SXM4-80GB, torch 2"}))
    with pytest.raises(ScenarioError, match="runs from different devices mixed in one fit"):
        grid_fit_data([old, new])


def test_a_run_copied_in_part_exits_2_naming_the_run(tmp_path):
    """A grid run whose points' record batches lost their tables (copied with a filter, say): `profile --from` says
    which run and point cannot be read, exit 2, no traceback."""
    source = tmp_path / "truth.yaml"
    source.write_text(yaml.safe_dump(profile_mapping(model="llama-3.2-1b")))
    run_dir = measured_grid_run(tmp_path / "a", DEPTH_BLOCK, source)
    batches = list((run_dir / "points").glob("batch-*"))
    assert batches
    for batch in batches:
        for path in batch.iterdir():
            path.unlink()
    r = CliRunner().invoke(app, ["profile", "--model", "llama-3.2-1b", "--from", str(run_dir),
                                 "--out", str(tmp_path / "fitted.yaml")])
    assert r.exit_code == 2, r.output
    message = " ".join(r.stderr.split())
    assert "its records cannot be read" in message and "point 0" in message, message
    assert "Traceback" not in r.output
    assert not (tmp_path / "fitted.yaml").exists()


def test_the_grid_is_cut_into_runs_whose_kv_cache_fits():
    """One run's model is sized for its largest batch and longest request together: the 8B grid as one run would
    need over 100 GB of KV cache; cut by blocks, every run stays within the budget and every point runs once."""
    from simharness.profile_grid import GRID, KV_BUDGET_BYTES, grid_points, kv_cache_bytes, run_groups

    _, points = grid_points(GRID, {"engine.model": "llama-3-8b"})
    assert kv_cache_bytes(points) > 100e9
    groups = run_groups(points)
    assert len(groups) > 1
    assert all(kv_cache_bytes(g) <= KV_BUDGET_BYTES for g in groups)
    assert sorted(p.id for g in groups for p in g) == sorted(p.id for p in points)
    assert all([p.index for p in g] == list(range(len(g))) for g in groups)


@pytest.mark.parametrize(
    "grid,message",
    [
        ({"scenario": {"name": "g"}}, "a grid file holds `scenario`"),
        ({"scenario": {"name": "g"}, "blocks": {"b": {"workload.concurrency": []}}}, "blocks.b: a mapping"),
        ({"scenario": {"name": "g"}, "blocks": {"b": {"workload.nothing": [1]}}}, "workload.nothing"),
        ({"scenario": {"name": "g", "sweep": {"scheduler.depth": [1, 2]}}, "blocks": {"b": {"scheduler.depth": [1]}}},
         "the base scenario sweeps nothing"),
    ],
)
def test_a_bad_grid_exits_2(tmp_path, grid, message):
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(grid))
    r = CliRunner().invoke(app, ["profile", "--grid", str(path), "--runs", str(tmp_path / "runs")])
    assert r.exit_code == 2, r.output
    assert message in " ".join(r.stderr.split())
    assert not (tmp_path / "runs").exists()


def test_a_host_cost_the_scenario_sets_is_never_replaced_by_the_profiles() -> None:
    """The sim takes the host phases the scenario leaves at their defaults from the shipped H100 profile, and keeps
    a host cost the scenario sets itself, also through a sweep point (which stores every field)."""
    fitted = profile.load_profile(profile.PROFILES_DIR / "h100-llama-3.2-1b.yaml").host_costs
    base = {"name": "x", "engine": {"level": "sim", "gpu": "H100", "model": "llama-3.2-1b"}}
    plain = CostModel(scenario_from_dict(base).engine, optimistic_correction=False).h
    assert plain.prep_us == fitted["prep_us"] != 600.0
    explicit = scenario_from_dict(base, {"engine.host_costs.prep_us": 600.0, "sweep.scheduler.depth": [1, 2]})
    for point in sweep_points(explicit):
        h = CostModel(point.scenario.engine, optimistic_correction=False).h
        assert h.prep_us == 600.0 and h.launch_us == fitted["launch_us"]
