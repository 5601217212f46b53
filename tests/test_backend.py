"""The model backend's compiled step: the device truth, the acceptance stream, GPU-time totals."""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd

from simharness.acceptance import SurvivalAcceptance
from simharness.costmodel import (
    FORWARD_S,
    PREFIX_S_PER_FLOP,
    SEC_PER_BYTE,
    SEC_PER_FLOP,
    WEIGHT_BYTES,
    CostModel,
    gpu_seconds,
)
from simharness.model_backend import ModelBackend
from simharness.models import MODELS
from simharness.policy import (
    ACCEPTED,
    BATCH_ROWS,
    COMPLETES,
    DRAFTS_VALID,
    EMITTED,
    PREFILL,
    REQ,
    SLOTS,
    TOKENS,
    VERIFIED,
    WASTED,
    Batch,
)
from simharness.scenario import Engine, GpuCosts

K = 4
ALPHA = 0.7
ROOT = Path(__file__).resolve().parents[1]


def backend(prompt: list[int], output: list[int], seed: int = 0) -> ModelBackend:
    requests = SimpleNamespace(prompt_len=np.array(prompt), output_len=np.array(output), random=None)
    cost = CostModel(Engine(profile="none"), optimistic_correction=False)  # the roofline's arithmetic
    acceptance = SurvivalAcceptance(ALPHA ** np.arange(1, K + 1, dtype=np.float64))
    return ModelBackend(requests, acceptance, cost, K, np.random.default_rng(seed))


def step(req: list[int], *, prefill: int = 0, slots: int = K) -> SimpleNamespace:
    """A step of whole prompts (prefill > 0: the prompt length) or of decodes with `slots` draft slots each."""
    table = np.zeros((BATCH_ROWS, len(req)), dtype=np.int64)
    table[REQ] = req
    if prefill:
        table[PREFILL] = table[COMPLETES] = 1
        table[TOKENS] = prefill
    else:
        table[TOKENS] = 1 + slots
        table[SLOTS] = table[VERIFIED] = slots
    return SimpleNamespace(batch=Batch(table, len(req), len(req) * int(prefill > 0), int(table[TOKENS].sum()), K),
                           trimmed=False)


def leading_accepted(u: np.ndarray) -> np.ndarray:
    return (u[:, None] < ALPHA ** np.arange(1, K + 1)).cumprod(axis=1).sum(axis=1)


def test_drawn_acceptance_reads_one_uniform_per_decode_of_a_step_that_verifies_drafts():
    """The uniforms are drawn in blocks, yet each step sees the draws a per-step call would have made."""
    model = backend([4, 4, 4], [10_000] * 3, seed=7)
    reference = np.random.default_rng(7)
    model.run(step([0, 1, 2], prefill=4))
    for size in [3, 2, 3, 1] * 800:  # several blocks of uniforms
        decode = step(list(range(size)))
        model.run(decode)
        expected = leading_accepted(reference.random(size))
        np.testing.assert_array_equal(decode.batch.table[ACCEPTED], expected)
        np.testing.assert_array_equal(decode.batch.table[EMITTED], expected + 1)
    model.run(step([0, 1], slots=0))  # nothing to verify: no draw
    decode = step([2])
    model.run(decode)
    np.testing.assert_array_equal(decode.batch.table[ACCEPTED], leading_accepted(reference.random(1)))


def test_a_request_that_finished_before_its_step_ran_wastes_its_slots():
    model = backend([4, 6], [2, 50])
    model.run(step([0], prefill=4))
    model.run(step([1], prefill=6))
    np.testing.assert_array_equal(model.valid_drafts()[[0, 1]], [K, K])
    model.run(step([0, 1]))  # request 0 emits its last token (at most 2 - 1 = 1 more)
    np.testing.assert_array_equal(model.valid_drafts()[[0]], [0])
    late = step([0, 1], slots=2)
    model.run(late)
    table = late.batch.table
    np.testing.assert_array_equal(table[WASTED], [3, 0])
    np.testing.assert_array_equal(table[[EMITTED, ACCEPTED, DRAFTS_VALID], 0], [0, 0, 0])
    assert table[DRAFTS_VALID, 1] == 2 and table[EMITTED, 1] >= 1


def test_gpu_time_totals_count_queries_kv_and_attention_pairs():
    model = backend([5, 7], [50, 50])
    sizes, rates = model.cost.sizes, model.cost.rates
    # prefills: query t over a context of 0: twice the pairs is t * (t + 1); the proposer scans prompt + 1
    assert model.run(step([0], prefill=5)).device_s == gpu_seconds(sizes, rates, 5, 5, 30, 6, 0, 1, 0, 5)
    model.run(step([1], prefill=7))
    # decodes over contexts 6 and 8 (prompt + first token) verify 1 + 2 slots (the sampler reads those), but the
    # device computes the decode loop's fixed width, 1 + K tokens a row; the proposer scans the new contexts
    decode = step([0, 1], slots=2)
    timing = model.run(decode)
    emitted = int(decode.batch.table[EMITTED].sum())
    w = 1 + K
    assert timing.device_s == gpu_seconds(sizes, rates, 2 * w, 6 + 8 + 2 * w, w * (12 + w + 1) + w * (16 + w + 1),
                                          6 + 8 + emitted, 0, 1, 0, 2 * 3)
    assert timing.readback_s == model.cost.sync() and timing.phases_s is None


def test_a_decode_batch_is_computed_at_its_graphs_bucket_of_rows():
    """Three decode rows run as the graph of four (`engine.buckets`): the padding row computes 1 + K tokens at no
    context."""
    model = backend([5, 5, 5], [50, 50, 50])
    sizes, rates = model.cost.sizes, model.cost.rates
    model.run(step([0, 1, 2], prefill=5))
    decode = step([0, 1, 2], slots=K)
    timing = model.run(decode)
    emitted = int(decode.batch.table[EMITTED].sum())
    w = 1 + K
    assert timing.device_s == gpu_seconds(sizes, rates, 4 * w, 3 * 6 + 4 * w, 3 * w * (12 + w + 1) + w * (w + 1),
                                          3 * 6 + emitted, 0, 1, 0, 3 * w)


def test_each_prefill_chunk_is_a_forward_that_reads_the_weights_and_pays_its_layers_latency():
    model = backend([5, 7], [50, 50])
    sizes, rates = model.cost.sizes, model.cost.rates
    two_chunks = model.run(step([0, 1], prefill=5)).device_s
    assert two_chunks == gpu_seconds(sizes, rates, 10, 10, 60, 6 + 8, 0, 2, 0, 10)
    # (the proposer scans each prompt and its first token) a second forward adds one weight read (memory-bound
    # at a few tokens) and one forward's layer latencies
    one_chunk = gpu_seconds(sizes, rates, 10, 10, 60, 6 + 8, 0, 1, 0, 10)
    extra = sizes[WEIGHT_BYTES] * rates[SEC_PER_BYTE] + rates[FORWARD_S]
    assert abs(two_chunks - one_chunk - extra) < 1e-12


def test_a_later_chunks_pairs_with_its_prefix_are_counted_apart():
    model = backend([10], [50])
    sizes, rates = model.cost.sizes, model.cost.rates
    rates[PREFIX_S_PER_FLOP] = 1e-9  # a prefix pair far dearer than any other FLOP: the attention is bound by them
    first = step([0], prefill=6)
    first.batch.table[COMPLETES] = 0  # 6 of the prompt's 10 tokens: no first token yet
    assert model.run(first).device_s == gpu_seconds(sizes, rates, 6, 6, 42, 10, 0, 1, 0, 6)
    # (the proposer scans the request's context) the last 4 tokens over the 6 before them: 24 of their 4 * (12 + 5) / 2
    # pairs are with the prefix
    later = model.run(step([0], prefill=4)).device_s
    assert later == gpu_seconds(sizes, rates, 4, 10, 68, 11, 0, 1, 24, 4)
    assert later > 2 * gpu_seconds(sizes, rates, 4, 10, 68, 11, 0, 1, 0, 4)


def test_a_later_chunks_prefix_pairs_run_at_the_prefix_kernels_efficiency():
    # one FLOP a pair; a GEMM FLOP costs 1 s, a prefix pair's 10 s; no bytes: the attention is compute-bound
    sizes = np.array([0, 0, 0, 1, 0], dtype=np.int64)
    rates = np.array([0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 10.0])
    assert gpu_seconds(sizes, rates, 4, 10, 68, 0, 0, 1, 24, 4) == (34 - 24) * 1.0 + 24 * 10.0
    cost = CostModel(Engine(profile="none", gpu_costs={"prefix_attention_efficiency": 0.15}),
                     optimistic_correction=False)
    assert abs(cost.rates[PREFIX_S_PER_FLOP] / cost.rates[SEC_PER_FLOP] - 0.6 / 0.15) < 1e-12


def test_the_default_prefix_attention_efficiency_is_the_prefill_benchmarks():
    """`prefix_attention_efficiency` is the median, over the committed H100 prefill benchmark's chunk sizes and
    prefixes, of the compute floor a prefix adds over the time it adds (the same chunk after no prefix)."""
    lines = (ROOT / "results/kernels/verify-and-prefill/prefill-1b.txt").read_text().splitlines()[2:]
    rows = [line.split() for line in lines if line.split()[2] == "prefix"]
    fresh = {chunk: (float(ms), float(floor)) for chunk, prefix, _, ms, _, _, floor, _ in rows if prefix == "0"}
    added = [(float(floor) - fresh[chunk][1]) / (float(ms) - fresh[chunk][0])
             for chunk, prefix, _, ms, _, _, floor, _ in rows if prefix != "0"]
    assert len(added) == 6
    assert abs(GpuCosts().prefix_attention_efficiency - float(np.median(added))) < 0.005


def test_a_forwards_latency_is_the_layers_times_the_per_layer_latency():
    for name in ("llama-3.2-1b", "llama-3-8b"):
        cost = CostModel(Engine(profile="none", model=name, gpu_costs={"layer_latency_us": 10.0}),
                         optimistic_correction=False)
        assert cost.rates[FORWARD_S] == MODELS[name].n_layers * 10.0 * 1e-6


def test_the_matrix_products_and_the_attention_are_each_bound_by_their_own_resource():
    # one byte and one FLOP a second: the products compute-bound (2 s against 1), the attention memory-bound (3 s)
    sizes = np.array([1, 1, 2, 0, 0], dtype=np.int64)  # weight bytes, KV bytes/token, FLOPs/token, /pair, logits
    rates = np.array([0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    assert gpu_seconds(sizes, rates, 1, 3, 0, 0, 0, 1, 0, 1) == 2.0 + 3.0


def test_the_default_layer_latency_reproduces_the_measured_decode_step_at_one_row():
    """The default `layer_latency_us` comes from the committed H100 decode-step runs at B = 1 of both shapes
    (results/kernels/decode-step, docs/validation.md): the roofline with it is within 5% of each, without it
    12-30% short."""
    runs = pd.concat([pd.read_csv(ROOT / f"results/kernels/decode-step/run{i}.csv") for i in (1, 2, 3)])
    one_row = runs[(runs["impl"] == "step_graph") & (runs["batch"] == 1)].groupby("model")["device_ms"].median()
    assert set(one_row.index) == {"llama-3.2-1b", "llama-3-8b"}
    k, context = 4, 512  # the runs' drafts and prompt
    for name, measured_ms in one_row.items():
        for latency_us, within in ((None, 0.05), (0.0, None)):
            costs = {} if latency_us is None else {"layer_latency_us": latency_us}
            engine = Engine(profile="none", model=name, gpu_costs=costs, speculation={"proposer": "ngram_gpu", "k": k})
            cost = CostModel(engine, optimistic_correction=False)
            seconds = gpu_seconds(cost.sizes, cost.rates, k + 1, context + k + 1, (k + 1) * (2 * context + k + 2),
                                  context, 0, 1, 0, k + 1)
            error = seconds * 1e3 / measured_ms - 1
            assert abs(error) < within if within else error < -0.1, (name, latency_us, error)
