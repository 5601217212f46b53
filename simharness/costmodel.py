"""How long a step takes at the sim level: a roofline for the GPU, parameters for the host.

GPU step time = fixed overhead + a fixed latency per layer of each forward (the decode step's and each
prefill chunk's) + the matrix products' max(weight bytes / bandwidth, FLOPs / peak) (weights read once per
forward) + the attention's max(KV bytes / bandwidth, FLOPs / peak) (a later chunk's pairs with its prefix at
their own, lower efficiency), plus the rejection sampler (reads the
logits), the GPU n-gram proposer and the optimistic correction kernel (docs/validation.md, "The uncalibrated
roofline"). Host phase costs are
linear in requests and tokens with the scenario's `engine.host_costs`. With `engine.calibration` the step time
is the calibration's linear model of what the step holds (`fitted_seconds`) and its fitted host costs replace
those of `engine.host_costs`; otherwise a cost profile (`engine.profile`, simharness.profile) does the same with
its physical terms.
"""

from __future__ import annotations

import functools

import numpy as np

from simharness.costfile import DEVICE_FEATURES, NGRAM_GPU_FEATURES, load_calibration
from simharness.jit import njit
from simharness.levels import LEVELS
from simharness.models import GPUS, ModelConfig, gpu_spec, model_config
from simharness.profile import PROPOSER, shape_sizes
from simharness.profile import resolve as resolve_profile
from simharness.scenario import Engine, GpuCosts, HostCosts


@functools.cache
def _default_host_costs() -> HostCosts:
    return HostCosts()


def fitted_host_costs(scenario: HostCosts, fitted: dict[str, float]) -> HostCosts:
    """The scenario's host costs with a fit's (a calibration's, a profile's) in place of those still at their
    defaults: a host cost the scenario sets to another value is the user's, never replaced by a fitted one. Values,
    not the fields a file named, decide, so that sweep points and resumed runs (which store every field) agree."""
    default = _default_host_costs()
    return scenario.model_copy(update={k: v for k, v in fitted.items() if getattr(scenario, k) == getattr(default, k)})

class CostModel:
    """Step and host-phase durations (seconds) for one sweep point."""

    def __init__(self, engine: Engine, *, optimistic_correction: bool):
        calibration = load_calibration(engine.calibration) if engine.calibration else None
        self.ngram_gpu = engine.speculation.proposer == "ngram_gpu" and engine.speculation.k > 0
        # the calibration's device model, seconds per unit of DEVICE_FEATURES (empty: the roofline)
        self.fit = np.zeros(0)
        self.h: HostCosts = engine.host_costs
        if calibration is not None:
            self.fit = np.array(calibration.device_us) * 1e-6
            if not self.ngram_gpu:
                self.fit[[DEVICE_FEATURES.index(f) for f in NGRAM_GPU_FEATURES]] = 0.0
            self.h = fitted_host_costs(engine.host_costs, calibration.host_costs)
        # the profile's device terms (simharness.profile; empty: none), only where no calibration replaces it
        self.profile = resolve_profile(engine) if LEVELS[engine.level].backend == "model" else None
        self.prof = np.zeros(0)
        if self.profile is not None:
            self.prof = np.array(self.profile.coef)
            if not self.ngram_gpu:
                self.prof[PROPOSER] = 0.0
            self.h = fitted_host_costs(engine.host_costs, self.profile.host_costs)
        # a calibrated device need not be in the roofline's catalogue (a CPU): its roofline is unused
        self.gpu = gpu_spec(engine.gpu) if calibration is None else gpu_spec_or_h100(engine.gpu)
        self.shape: ModelConfig = model_config(engine.model)  # the catalogue (simharness.models)
        g: GpuCosts = engine.gpu_costs
        self.g = g
        bw = (g.mem_bandwidth_gbs or self.gpu.mem_bandwidth_gbs) * 1e9 * g.mem_efficiency
        flops = (g.bf16_tflops or self.gpu.bf16_tflops) * 1e12 * g.compute_efficiency
        self.sec_per_byte = 1.0 / bw
        self.sec_per_flop = 1.0 / flops
        # a later prefill chunk's pairs with the prompt before it run in the Triton prefix kernel, far below the
        # GEMMs' efficiency (docs/validation.md, "The uncalibrated roofline")
        prefix_s_per_flop = 1.0 / (flops / g.compute_efficiency * g.prefix_attention_efficiency)
        self.correction = optimistic_correction
        # fixed part of every step: overhead, sampler, proposer, correction
        self.fixed_s = (
            g.step_overhead_us * 1e-6
            + g.sampler_overhead_us * 1e-6
            + (g.ngram_gpu_us * 1e-6 if self.ngram_gpu else 0.0)
            + (g.correction_us * 1e-6 if self.correction else 0.0)
        )
        # the roofline's coefficients, read by the compiled step (`gpu_seconds`): the shape's sizes, then rates
        # (integers: sizes times token counts stay exact, below)
        s = self.shape
        self.sizes = shape_sizes(s).astype(np.int64)
        ngram_s_per_token = g.ngram_gpu_per_token_ns * 1e-9 if self.ngram_gpu else 0.0
        # a random row's sampler work beyond a greedy row's, per verified token
        random_s_per_token = (g.sampler_random_factor - 1.0) * s.vocab_size * 4 * self.sec_per_byte
        forward_s = s.n_layers * g.layer_latency_us * 1e-6  # a forward's kernel latencies
        self.rates = np.array([self.fixed_s, self.sec_per_byte, self.sec_per_flop, ngram_s_per_token,
                               random_s_per_token, forward_s, prefix_s_per_flop])
        # a full garbage collection's pause (sim: every `gc.full_every` allocations prep makes)
        self.full_gc_s = engine.gc.heap_objects * self.h.gc_ns_per_object * 1e-9

    def schedule(self, n_reqs: int) -> float:
        return (self.h.schedule_us + self.h.schedule_per_req_us * n_reqs) * 1e-6

    def prep(self, n_reqs: int, n_tokens: int) -> float:
        return (self.h.prep_us + self.h.prep_per_req_us * n_reqs + self.h.prep_per_token_us * n_tokens) * 1e-6

    def launch(self, n_reqs: int, n_prefill: int) -> float:
        h = self.h
        return (h.launch_us + h.launch_per_req_us * n_reqs + h.launch_per_prefill_us * n_prefill) * 1e-6

    def update(self, n_reqs: int) -> float:
        return (self.h.update_us + self.h.update_per_req_us * n_reqs) * 1e-6

    def ngram_cpu(self, n_reqs: int, history_tokens: int) -> float:
        h = self.h
        return (h.ngram_cpu_us + h.ngram_cpu_per_req_us * n_reqs) * 1e-6 + h.ngram_cpu_per_token_ns * 1e-9 * (
            history_tokens
        )

    def sync(self) -> float:
        return self.h.sync_us * 1e-6

    def readback(self, n_reqs: int) -> float:
        """One step's readback of `n_reqs` requests' outputs, once the step ended on the device."""
        return (self.h.sync_us + self.h.sync_per_req_us * n_reqs) * 1e-6


# Coefficients of `gpu_seconds`: CostModel.sizes and CostModel.rates.
WEIGHT_BYTES, KV_BYTES_PER_TOKEN, LINEAR_FLOPS_PER_TOKEN, ATTN_FLOPS_PER_PAIR, LOGIT_BYTES = range(5)
FIXED_S, SEC_PER_BYTE, SEC_PER_FLOP, NGRAM_S_PER_TOKEN, RANDOM_S_PER_TOKEN, FORWARD_S, PREFIX_S_PER_FLOP = range(7)


@njit
def gpu_seconds(sizes: np.ndarray, rates: np.ndarray, tokens: int, kv_tokens: int, pairs2: int, history: int,
                random_tokens: int, forwards: int, prefix_pairs: int, sampled: int) -> float:
    """GPU time of one step from batch totals: `tokens` computed now, `kv_tokens` in the KV cache after the
    step (context + query), `pairs2` twice the attention pairs (sum over requests of query * (2 * context +
    query + 1)), `history` tokens the GPU n-gram proposer scans (its rate is 0 without it), `random_tokens`
    verified tokens of rows sampled at a temperature (the sampler's random path), `forwards` the step's forward
    passes (the decode step's, each prefill chunk's: each reads the weights and pays its layers' latency),
    `prefix_pairs` the pairs of later prefill chunks with the prompt before them (part of `pairs2` / 2), `sampled`
    the positions the sampler reads (the tokens verified and prefilled)."""
    # pairs2 / 2 is exact (an integer or half-integer far below 2^52), so this equals the float sum
    # of query * (context + (query + 1) / 2) over the batch in any order. Sizes times token counts are exact
    # integers, rounded once when scaled by a rate.
    pairs = pairs2 / 2
    # the matrix products and the attention are kernels of their own: each is bound by memory or by compute
    linear = max(sizes[WEIGHT_BYTES] * forwards * rates[SEC_PER_BYTE],
                 sizes[LINEAR_FLOPS_PER_TOKEN] * tokens * rates[SEC_PER_FLOP])
    attention = max(sizes[KV_BYTES_PER_TOKEN] * kv_tokens * rates[SEC_PER_BYTE],
                    sizes[ATTN_FLOPS_PER_PAIR] * ((pairs - prefix_pairs) * rates[SEC_PER_FLOP]
                                                  + prefix_pairs * rates[PREFIX_S_PER_FLOP]))
    # the sampler reads fp32 logits of every position verified (`sampled`: fewer than `tokens` where the decode
    # loop computes its fixed width over trimmed slots and padding rows)
    sampler = sampled * sizes[LOGIT_BYTES] * rates[SEC_PER_BYTE] + random_tokens * rates[RANDOM_S_PER_TOKEN]
    proposer = rates[NGRAM_S_PER_TOKEN] * history
    return rates[FIXED_S] + forwards * rates[FORWARD_S] + linear + attention + sampler + proposer


@njit
def fitted_seconds(fit: np.ndarray, decode_rows: int, decode_tokens: int, decode_context: int, prefill_reqs: int,
                   prefill_tokens: int) -> float:
    """GPU time of one step from a calibration's coefficients (seconds per unit of costfile.DEVICE_FEATURES; its
    GPU-proposer terms are 0 without that proposer)."""
    return (fit[0] + fit[1] * decode_rows + fit[2] * decode_tokens + fit[3] * decode_context + fit[4] * prefill_reqs
            + fit[5] * prefill_tokens + fit[6] + fit[7] * decode_context)


def gpu_spec_or_h100(name: str):
    """A calibrated device's roofline entry, unused by the fit: its own, or the H100's where the catalogue has none."""
    try:
        return gpu_spec(name)
    except ValueError:
        return GPUS["H100"]
