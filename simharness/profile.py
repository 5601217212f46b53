"""A cost profile: one per GPU and model, physical device terms with fitted efficiencies (docs/calibration.md,
"Profiles").

A step's device time is a fixed cost, a cost per forward pass (the decode forward and each prefill chunk), each
forward's weight and KV reads against its FLOPs (a smooth max: a forward is bound by memory or by compute), the
sampler's logit reads (rows x tokens x vocabulary, plus the random path's extra) and the GPU proposer's scan. The
datasheet's bandwidth and peak are the prior; the profile fits by how much each term is slower than the
roofline. Because each term grows with what drives it physically (context, tokens verified, rows), the fit
extrapolates to batch sizes, k and contexts it saw only partly. At the real level a step's device window also
holds the host's launch: the device starts `lead` after the launch starts and ends no earlier than `tail` after
it ends (`overlap`, per depth), which the fit models instead of folding into the device terms.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml
from pydantic import BaseModel

from simharness.jit import njit
from simharness.models import ModelConfig, catalogue_name, gpu_spec, model_config

FORMAT = "simharness-profile-4"  # 2: the attention FLOPs at their own slowdown; 3: a chunk's pairs with its prefix;
# 4: the fixed width and the verify attention's critical path
PACKAGE = Path(__file__).resolve().parent
PROFILES_DIR = PACKAGE / "data" / "profiles"  # the committed profiles (package data)
# What the sim without a profile (the roofline) carried against the real level on the validation families
# (docs/validation.md, results/validation/fresh-20261128/validation.md: H100, medians per family).
UNCALIBRATED_ERROR = ("mean TPOT median |error| 5-18% (llama-3.2-1b; the largest with 2,048-token prefill chunks) and "
                      "8.6% (llama-3-8b) on the H100 validation families (docs/validation.md)")

# The device terms, in the order of the coefficient array (`profile_seconds`): seconds per step and per forward,
# the datasheet's seconds per byte and per FLOP, the slowdowns against it of memory traffic, the linear layers'
# FLOPs (cuBLAS GEMMs) and the logit reads, the random path's extra (in logit reads), seconds per history token the
# GPU proposer scans, the exponent of the memory/compute overlap (large: a hard max), and the slowdown of the
# attention's FLOPs (kernels of their own, with their own efficiency: the harness's Triton verify attention, SDPA for
# a fresh prompt's chunk), and that of a later chunk's pairs with the prompt before it (the Triton prefix kernel,
# which streams the prefix's K/V past each block of the chunk's queries: more traffic a pair than the others); last,
# the verify attention's critical path (`attention_path`): seconds a layer per position one program reads, and per
# partial its last program merges.
TERMS = ("fixed_us", "per_forward_us", "datasheet_s_per_byte", "datasheet_s_per_flop", "memory_slowdown",
         "compute_slowdown", "sampler_slowdown", "random_sampler_extra", "proposer_ns_per_token", "overlap_exponent",
         "attention_slowdown", "prefix_attention_slowdown", "attention_position_ns", "attention_merge_ns")
(FIXED, PER_FORWARD, S_PER_BYTE, S_PER_FLOP, MEMORY, COMPUTE, SAMPLER, RANDOM, PROPOSER, EXPONENT, ATTENTION,
 PREFIX_ATTENTION, POSITION, MERGE) = range(len(TERMS))
# seconds (or 1) per unit of each term in the file
UNITS = (1e-6, 1e-6, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1e-9, 1.0, 1.0, 1.0, 1e-9, 1e-9)
# What a step holds (columns of `step_features`, arguments of `profile_seconds`): decode rows and tokens as the
# device computes them (the graph's bucket of rows, 1 + k tokens a row: `engine.decode_step`'s fixed width).
FEATURES = ("decode_rows", "decode_tokens", "decode_context", "prefill_reqs", "prefill_padded", "random_tokens",
            "history", "prefill_context", "max_context")


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the file and the field."""


def shape_sizes(shape: ModelConfig) -> np.ndarray:
    """The model's sizes the terms scale: weight bytes, KV bytes per token, linear FLOPs per token, attention FLOPs
    per (query, key) pair, fp32 logit bytes per sampled position, layers, KV heads."""
    return np.array([shape.weight_bytes, shape.kv_bytes_per_token, shape.linear_flops_per_token,
                     shape.attn_flops_per_pair, shape.vocab_size * 4, shape.n_layers, shape.n_kv_heads],
                    dtype=np.float64)


@njit
def graph_rows(rows: int) -> int:
    """The rows a decode step's CUDA graph computes for `rows` requests: its batch bucket (1, 2, 4, then multiples of
    8: `engine.buckets.batch_buckets`); the bucket's padding rows are computed with the rest."""
    return rows if rows <= 2 else 4 if rows <= 4 else -(-rows // 8) * 8


@njit
def attention_chunk(rows: int, n_kv_heads: int) -> int:
    """Positions a verify-attention program reads for a graph of `rows` rows, 0 where a program reads its row's whole
    context: the engine's kernel (`engine.model_triton.attention_chunk_size`) splits the context below 128 (row, KV
    head) pairs into chunks of 128 times the next power of two of a sixteenth of the pairs."""
    pairs = rows * n_kv_heads
    if pairs >= 128:
        return 0
    power = 1
    while power * 16 < pairs:
        power *= 2
    return 128 * power


@njit
def attention_path(coef: np.ndarray, layers: float, n_kv_heads: float, rows: float, longest: float) -> float:
    """The verify attention's critical path over a decode forward: its longest program reads its positions one
    after another, and with a split context the last program of a row merges the row's partials
    (`attention_chunk`). Where few (row, KV head) pairs run, this path, not the bandwidth, sets the
    kernel's time (results/kernels/verify-and-prefill/attention-rows-20261128.txt)."""
    chunk = attention_chunk(int(rows), int(n_kv_heads))
    if chunk == 0:
        return layers * longest * coef[POSITION]
    chunks = np.ceil(longest / chunk)
    merged = chunks if chunks > 1 else 0.0
    return layers * (min(longest, chunk) * coef[POSITION] + merged * coef[MERGE])


@njit
def _forward(coef: np.ndarray, memory_bytes: float, linear_flops: float, slowed_attention_flops: float) -> float:
    """One forward's time: its memory and compute times at the fitted slowdowns (the attention's FLOPs come already
    times theirs), overlapped (a p-norm)."""
    m = coef[MEMORY] * memory_bytes * coef[S_PER_BYTE]
    c = (coef[COMPUTE] * linear_flops + slowed_attention_flops) * coef[S_PER_FLOP]
    hi, lo = max(m, c), min(m, c)
    if hi <= 0.0:
        return 0.0
    return hi * (1.0 + (lo / hi) ** coef[EXPONENT]) ** (1.0 / coef[EXPONENT])


@njit
def profile_seconds(coef: np.ndarray, sizes: np.ndarray, decode_rows: float, decode_tokens: float,
                    decode_context: float, prefill_reqs: float, prefill_padded: float, random_tokens: float,
                    history: float, prefill_context: float, max_context: float) -> float:
    """A step's device time from what it holds: decode rows, their tokens and context (KV tokens before the step),
    prefill chunks and the tokens they compute (each chunk padded to its graph's token bucket, `engine.buckets`),
    verified tokens of rows sampled at a temperature, history the GPU proposer scans, and the prompt tokens before
    the prefill chunks (a later chunk of a long prompt reads their KV and attends to them), and the longest decode
    row's context. Attention pairs are taken at the mean row (decode) and chunk (prefill), so the fit and the sim
    see the same features; the attention's critical path at the longest row, where it outlasts the KV read."""
    weights, kv, linear, attention, logits = sizes[0], sizes[1], sizes[2], sizes[3], sizes[4]
    t = coef[FIXED] + coef[PER_FORWARD] * prefill_reqs + coef[PROPOSER] * history
    if decode_rows > 0:
        q, c = decode_tokens / decode_rows, decode_context / decode_rows
        pairs = decode_tokens * (c + (q + 1.0) / 2.0)
        kv_bytes = kv * (decode_context + decode_tokens)
        t += coef[PER_FORWARD] + _forward(coef, weights + kv_bytes, linear * decode_tokens,
                                          coef[ATTENTION] * attention * pairs)
        path = attention_path(coef, sizes[5], sizes[6], decode_rows, max_context + q)
        t += max(0.0, path - coef[MEMORY] * kv_bytes * coef[S_PER_BYTE])
    if prefill_reqs > 0:
        # a chunk's padding tokens run through every layer as its own tokens do (their K/V land past the chunk)
        own = prefill_padded * (prefill_padded / prefill_reqs + 1.0) / 2.0
        prefix = prefill_padded * prefill_context / prefill_reqs  # a later chunk's pairs with the prompt before it
        slowed = attention * (coef[ATTENTION] * own + coef[PREFIX_ATTENTION] * prefix)
        t += _forward(coef, weights * prefill_reqs + kv * (prefill_context + prefill_padded), linear * prefill_padded,
                      slowed)
    # logits: the LM head writes them at every position computed (the fixed width), which the sampler then reads;
    # its random path's extra follows the positions verified (the kernel skips a row's slots past its drafts)
    sampled = decode_tokens + prefill_reqs  # each position computed, and a prompt's last
    return t + (coef[SAMPLER] * sampled + coef[RANDOM] * random_tokens) * logits * coef[S_PER_BYTE]


@njit
def profile_times(coef: np.ndarray, sizes: np.ndarray, x: np.ndarray) -> np.ndarray:
    """`profile_seconds` of every row of `x` (columns: FEATURES)."""
    out = np.empty(x.shape[0])
    for i in range(x.shape[0]):
        out[i] = profile_seconds(coef, sizes, x[i, 0], x[i, 1], x[i, 2], x[i, 3], x[i, 4], x[i, 5], x[i, 6], x[i, 7],
                                 x[i, 8])
    return out


ATTENTION_POSITION_PRIOR_S, ATTENTION_MERGE_PRIOR_S = 15e-9, 300e-9


def prior_coefficients(gpu: str, g: BaseModel) -> np.ndarray:
    """The roofline as a profile: the datasheet's rates and the efficiencies of `g` (the scenario defaults'
    `scenario.GpuCosts`), so that a term the profile's grid cannot separate stays where the roofline puts it."""
    spec = gpu_spec(gpu)
    coef = np.zeros(len(TERMS))
    coef[FIXED] = (g.step_overhead_us + g.sampler_overhead_us) * 1e-6
    coef[S_PER_BYTE], coef[S_PER_FLOP] = 1 / (spec.mem_bandwidth_gbs * 1e9), 1 / (spec.bf16_tflops * 1e12)
    coef[MEMORY], coef[COMPUTE], coef[SAMPLER] = 1 / g.mem_efficiency, 1 / g.compute_efficiency, 1 / g.mem_efficiency
    coef[RANDOM] = (g.sampler_random_factor - 1) / g.mem_efficiency
    coef[PROPOSER] = g.ngram_gpu_per_token_ns * 1e-9
    coef[EXPONENT] = 4.0
    # the prefix pairs too: the roofline's own `prefix_attention_efficiency` came later, and the committed profiles
    # are refitted from their grid runs exactly with this prior (docs/validation.md, "The uncalibrated roofline")
    coef[ATTENTION] = coef[PREFIX_ATTENTION] = 1 / g.compute_efficiency
    # the verify attention's critical path has no datasheet figure: the prior is what the engine's kernel took on the
    # H100 for the 1B (results/kernels/verify-and-prefill/attention-rows-20261128.txt: 14-15 ns a position and layer
    # at 16 rows, unsplit; about 0.3 µs a partial merged at one row)
    coef[POSITION], coef[MERGE] = ATTENTION_POSITION_PRIOR_S, ATTENTION_MERGE_PRIOR_S
    return coef


# ------------------------------------------------------------------------------------------------ the file


@dataclass(frozen=True)
class Profile:
    """A loaded profile: where it was measured, its device coefficients (`TERMS`, seconds), the launch overlap per
    measured depth ((lead, tail) seconds), the fitted host costs (fields of `engine.host_costs`) and the validation
    error it carried (a sentence, or None before validation)."""

    path: str
    device: str
    gpu: str
    model: str
    coef: tuple[float, ...]
    overlap: dict[int, tuple[float, float]]
    host_costs: dict[str, float]
    validation: str | None

    def overlap_at(self, depth: int) -> tuple[float, float]:
        """(lead, tail) seconds at `depth`, or at the nearest depth measured."""
        return self.overlap[min(self.overlap, key=lambda d: (abs(d - depth), d))]

    def describe(self) -> str:
        error = self.validation or "not yet validated (scenarios/validation)"
        return f"{self.path} (measured on {self.device}; validation: {error})"


def default_path(gpu: str, model: str) -> Path | None:
    """The committed profile of a catalogue GPU and model, e.g. simharness/data/profiles/h100-llama-3.2-1b.yaml."""
    name = catalogue_name(model)
    return None if name is None else PROFILES_DIR / f"{gpu.lower()}-{name}.yaml"


def resolve(engine) -> Profile | None:
    """The profile a sim-level engine runs on: none with `engine.calibration` or `engine.profile: none`, the file
    `engine.profile` names, or (`auto`) the committed profile of `engine.gpu` and `engine.model` if there is one.
    ProfileError names the file and field of one that does not fit."""
    if engine.calibration is not None or engine.profile == "none" or own_device_costs(engine):
        return None
    path = default_path(engine.gpu, engine.model) if engine.profile == "auto" else Path(engine.profile)
    if engine.profile != "auto" and _sets_device_costs(engine):
        raise ProfileError(f"{path}: engine.gpu_costs is set, but the profile replaces the roofline's device costs: "
                           "unset engine.gpu_costs, or set engine.profile: none to run the roofline with them")
    if path is None or (engine.profile == "auto" and not path.is_file()):
        return None
    profile = load_profile(path)
    unknown = sorted(set(profile.host_costs) - set(type(engine.host_costs).model_fields))
    if unknown:
        raise ProfileError(f"{path}: field host_costs.{unknown[0]}: not a host cost")
    if profile.gpu.lower() != engine.gpu.lower():
        raise ProfileError(f"{path}: field gpu: measured on {profile.gpu!r}, the scenario models {engine.gpu!r} "
                           "(engine.gpu)")
    if profile.model.lower() != engine.model.lower():
        raise ProfileError(f"{path}: field model: fitted for {profile.model!r}, the scenario runs {engine.model!r} "
                           "(engine.model)")
    return profile


def own_device_costs(engine) -> bool:
    """`engine.profile: auto` with device costs the scenario sets where a committed profile would otherwise run:
    the roofline those costs describe runs instead, not the profile, which would ignore them (the run notes it)."""
    if engine.profile != "auto" or engine.calibration is not None or not _sets_device_costs(engine):
        return False
    path = default_path(engine.gpu, engine.model)
    return path is not None and path.is_file()


def _sets_device_costs(engine) -> bool:
    """`engine.gpu_costs` away from its defaults (values decide, as for the host costs)."""
    return engine.gpu_costs != type(engine.gpu_costs)()


def describe(engine) -> str:
    """Which cost profile a sim point of `engine` runs on, and the error it carried in validation."""
    if engine.calibration is not None:
        return f"calibration {engine.calibration} (no profile)"
    profile = resolve(engine)
    if profile is None:
        return f"none: the sim is uncalibrated (roofline), which carried {UNCALIBRATED_ERROR}"
    return profile.describe()


def summary_columns(engine, level: str) -> dict[str, str]:
    """A point's summary columns: the cost profile its sim ran on (a path, `none`, or the calibration's path) and
    the error that carried in validation; empty at the measured levels, which measure their costs."""
    if level != "sim":
        return {"cost_profile": "", "cost_profile_validation": ""}
    if engine.calibration is not None:
        return {"cost_profile": f"calibration {engine.calibration}", "cost_profile_validation": ""}
    profile = resolve(engine)
    if profile is None:
        return {"cost_profile": "none", "cost_profile_validation": f"uncalibrated: {UNCALIBRATED_ERROR}"}
    return {"cost_profile": profile.path, "cost_profile_validation": profile.validation or "not yet validated"}


def load_profile(path: str | Path) -> Profile:
    """Read and check a profile file (cached per path and modification time)."""
    path = Path(path)
    try:
        mtime = path.stat().st_mtime_ns
    except OSError as e:
        raise ProfileError(f"{path}: cannot read profile file ({e.strerror})") from None
    return _load(str(path), mtime)


@functools.lru_cache(maxsize=16)
def _load(path: str, mtime: int) -> Profile:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ProfileError(f"{path}: not a readable YAML file ({type(e).__name__})") from None
    if not isinstance(data, dict) or "format" not in data:
        raise ProfileError(f"{path}: field format: missing; not a simharness profile (`format: {FORMAT}`)")
    if data["format"] != FORMAT:
        raise ProfileError(f"{path}: field format: {data['format']!r} is not {FORMAT!r} (another file kind or an "
                           "older profile: fit it again from its grid runs with `simharness profile --from RUN_DIR`, "
                           "on a CPU, or measure it again)")
    field = "gpu"
    try:
        gpu, model, device = str(data["gpu"]), str(data["model"]), str(data["device"])
        field = "device_step"
        step = data["device_step"]
        coef = []
        for name, unit in zip(TERMS, UNITS, strict=True):
            field = f"device_step.{name}"
            value = float(step[name]) * unit
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"{value} is not a finite non-negative number")
            coef.append(value)
        field = "overlap"
        overlap = {int(d): (float(v["lead_us"]) * 1e-6, float(v["tail_us"]) * 1e-6) for d, v in data["overlap"].items()}
        if not overlap:
            raise ValueError("no depth")
        field = "host_costs"
        host = {str(k): float(v) for k, v in (data.get("host_costs") or {}).items()}
        field = "validation"
        validation = data.get("validation")
        validation = None if validation is None else str(validation["summary"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ProfileError(f"{path}: field {field}: malformed ({type(e).__name__}: {e})") from None
    if coef[EXPONENT] < 1:
        raise ProfileError(f"{path}: field device_step.overlap_exponent: {coef[EXPONENT]} is below 1")
    try:
        model_config(model)
    except ValueError:
        raise ProfileError(f"{path}: field model: {model!r} is not a catalogue model") from None
    return Profile(_display_name(Path(path)), device, gpu, model, tuple(coef), overlap, host, validation)


def derive_profile(path: str | Path, gpu: str) -> dict:
    """A profile for `gpu` from one measured on another part of the same chip design (the H200 from the H100): the
    datasheet's bandwidth and peak of `gpu` replace the measured GPU's, and everything fitted stays — each term's
    slowdown against the datasheet, the per-step and per-forward costs (the same SMs and clocks), the launch overlap
    and the host costs (the host's, not the GPU's). docs/calibration.md, "A profile for another GPU". ProfileError
    names the file and field of a profile that cannot carry over."""
    source = load_profile(path)
    try:
        target, measured = gpu_spec(gpu), gpu_spec(source.gpu)
    except ValueError as e:
        raise ProfileError(f"{path}: field gpu: {e}") from None
    if target.architecture != measured.architecture:
        raise ProfileError(f"{path}: field gpu: measured on the {measured.name} ({measured.architecture}); a profile "
                           f"carries over only to a part of the same chip design, not to the {target.name} "
                           f"({target.architecture}): measure it there (`simharness profile`)")
    coef = np.array(source.coef)
    coef[S_PER_BYTE], coef[S_PER_FLOP] = 1 / (target.mem_bandwidth_gbs * 1e9), 1 / (target.bf16_tflops * 1e12)
    data = yaml.safe_load(Path(path).read_text())
    data["device_step"]["datasheet_s_per_byte"] = float(coef[S_PER_BYTE])  # seconds: its unit is 1
    data["device_step"]["datasheet_s_per_flop"] = float(coef[S_PER_FLOP])
    # A depth's tail is the device's work left after the launch ends: it shrinks as the step's work does.
    ratio = work_ratio(np.array(source.coef), coef, model_config(source.model))
    for overlap in data["overlap"].values():
        overlap["tail_us"] *= ratio
    data["note"] = (f"derived from {source.path} (measured on {source.device}) by the {target.name} datasheet "
                    f"({target.mem_bandwidth_gbs:.0f} GB/s, {target.bf16_tflops:.0f} TFLOPs bf16), launch tails "
                    f"times the decode steps' work ratio {ratio:.3f}: `simharness derive-profile`")
    data["gpu"] = target.name
    data["device"] = f"{source.device} (derived for the {target.name})"
    data.pop("validation", None)  # the source's validation is not this profile's
    return data


def work_ratio(measured: np.ndarray, derived: np.ndarray, shape: ModelConfig) -> float:
    """The median, over decode steps spanning a profile grid's (1-256 rows, 512 and 2,048 tokens of context, k = 0, 4
    and 8), of a step's device work with coefficients `derived` over its work with `measured`."""
    sizes = shape_sizes(shape)
    ratios = [profile_seconds(derived, sizes, rows, rows * (1 + k), rows * context, 0, 0, 0, 0, 0, context)
              / profile_seconds(measured, sizes, rows, rows * (1 + k), rows * context, 0, 0, 0, 0, 0, context)
              for rows in (1, 4, 16, 64, 256) for context in (512, 2048) for k in (0, 4, 8)]
    return float(np.median(ratios))


def _display_name(path: Path) -> str:
    """A shipped profile by its package path (not by this machine's install path), any other as given."""
    full = path.resolve()
    return f"simharness/{full.relative_to(PACKAGE)}" if full.is_relative_to(PACKAGE) else str(path)
