"""How long a step takes at the sim level: a roofline for the GPU, parameters for the host.

GPU step time = fixed overhead + max(bytes moved / bandwidth, FLOPs / peak) for the target
forward over the batch's tokens (weights + KV read), plus the rejection sampler (reads the
logits), the GPU n-gram proposer and the optimistic correction kernel. Host phase costs are
linear in requests and tokens with the scenario's `engine.host_costs`.
"""

from __future__ import annotations

import numpy as np

from simharness.jit import njit
from simharness.models import ModelConfig, gpu_spec, model_config
from simharness.scenario import Engine, GpuCosts, HostCosts


class CostModel:
    """Step and host-phase durations (seconds) for one sweep point."""

    def __init__(self, engine: Engine, *, optimistic_correction: bool):
        self.gpu = gpu_spec(engine.gpu)
        self.shape: ModelConfig = model_config(engine.model)  # the catalogue (simharness.models)
        g: GpuCosts = engine.gpu_costs
        self.g = g
        self.h: HostCosts = engine.host_costs
        bw = (g.mem_bandwidth_gbs or self.gpu.mem_bandwidth_gbs) * 1e9 * g.mem_efficiency
        flops = (g.bf16_tflops or self.gpu.bf16_tflops) * 1e12 * g.compute_efficiency
        self.sec_per_byte = 1.0 / bw
        self.sec_per_flop = 1.0 / flops
        self.ngram_gpu = engine.speculation.proposer == "ngram_gpu" and engine.speculation.k > 0
        self.correction = optimistic_correction
        # fixed part of every step: overhead, weight read, sampler, proposer, correction
        self.fixed_s = (
            g.step_overhead_us * 1e-6
            + g.sampler_overhead_us * 1e-6
            + (g.ngram_gpu_us * 1e-6 if self.ngram_gpu else 0.0)
            + (g.correction_us * 1e-6 if self.correction else 0.0)
        )
        # the roofline's coefficients, read by the compiled step (`gpu_seconds`): the shape's sizes, then rates
        s = self.shape
        self.sizes = np.array([s.weight_bytes, s.kv_bytes_per_token, s.linear_flops_per_token, s.attn_flops_per_pair,
                               s.vocab_size * 4], dtype=np.int64)
        ngram_s_per_token = g.ngram_gpu_per_token_ns * 1e-9 if self.ngram_gpu else 0.0
        # a random row's sampler work beyond a greedy row's, per verified token
        random_s_per_token = (g.sampler_random_factor - 1.0) * s.vocab_size * 4 * self.sec_per_byte
        self.rates = np.array([self.fixed_s, self.sec_per_byte, self.sec_per_flop, ngram_s_per_token,
                               random_s_per_token])
        # a full garbage collection's pause (sim: every `gc.full_every` allocations prep makes)
        self.full_gc_s = engine.gc.heap_objects * self.h.gc_ns_per_object * 1e-9

    def schedule(self, n_reqs: int) -> float:
        return (self.h.schedule_us + self.h.schedule_per_req_us * n_reqs) * 1e-6

    def prep(self, n_reqs: int, n_tokens: int) -> float:
        return (self.h.prep_us + self.h.prep_per_req_us * n_reqs + self.h.prep_per_token_us * n_tokens) * 1e-6

    def launch(self) -> float:
        return self.h.launch_us * 1e-6

    def update(self, n_reqs: int) -> float:
        return (self.h.update_us + self.h.update_per_req_us * n_reqs) * 1e-6

    def ngram_cpu(self, n_reqs: int, history_tokens: int) -> float:
        h = self.h
        return (h.ngram_cpu_us + h.ngram_cpu_per_req_us * n_reqs) * 1e-6 + h.ngram_cpu_per_token_ns * 1e-9 * (
            history_tokens
        )

    def sync(self) -> float:
        return self.h.sync_us * 1e-6


# Coefficients of `gpu_seconds`: CostModel.sizes and CostModel.rates.
WEIGHT_BYTES, KV_BYTES_PER_TOKEN, LINEAR_FLOPS_PER_TOKEN, ATTN_FLOPS_PER_PAIR, LOGIT_BYTES = range(5)
FIXED_S, SEC_PER_BYTE, SEC_PER_FLOP, NGRAM_S_PER_TOKEN, RANDOM_S_PER_TOKEN = range(5)


@njit
def gpu_seconds(sizes: np.ndarray, rates: np.ndarray, tokens: int, kv_tokens: int, pairs2: int, history: int,
                random_tokens: int) -> float:
    """GPU time of one step from batch totals: `tokens` computed now, `kv_tokens` in the KV cache after the
    step (context + query), `pairs2` twice the attention pairs (sum over requests of query * (2 * context +
    query + 1)), `history` tokens the GPU n-gram proposer scans (its rate is 0 without it), `random_tokens`
    verified tokens of rows sampled at a temperature (the sampler's random path)."""
    # pairs2 / 2 is exact (an integer or half-integer far below 2^52), so this equals the float sum
    # of query * (context + (query + 1) / 2) over the batch in any order. Sizes times token counts are exact
    # integers, rounded once when scaled by a rate.
    pairs = pairs2 / 2
    mem = (sizes[WEIGHT_BYTES] + sizes[KV_BYTES_PER_TOKEN] * kv_tokens) * rates[SEC_PER_BYTE]
    compute = (sizes[LINEAR_FLOPS_PER_TOKEN] * tokens + sizes[ATTN_FLOPS_PER_PAIR] * pairs) * rates[SEC_PER_FLOP]
    # the sampler reads fp32 logits of every verified position
    sampler = tokens * sizes[LOGIT_BYTES] * rates[SEC_PER_BYTE] + random_tokens * rates[RANDOM_S_PER_TOKEN]
    proposer = rates[NGRAM_S_PER_TOKEN] * history
    return rates[FIXED_S] + max(mem, compute) + sampler + proposer
