"""Scenario files: the validated description of one experiment and its sweep.

A scenario is YAML validated by pydantic. Every field has a documented default; `--set a.b=v`
overrides any field (`simharness.overrides` merges them); `sweep` maps dotted paths to value lists whose
cartesian product gives the sweep points. Bad input raises `ScenarioError` with a message that names the field
and, for a file with `--set` options, its source.
"""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from simharness.checkpoint_files import check_checkpoint
from simharness.costfile import CalibrationError, check_match, load_calibration
from simharness.errors import ScenarioError, ScenarioNote
from simharness.hostprofile import PROFILE_FIELDS, HostProfileError, load_host_profile
from simharness.hostprofile import host_costs as profile_host_costs
from simharness.levels import LEVELS, LevelName, renamed
from simharness.models import checkpoint_dir, gpu_spec, model_config
from simharness.overrides import field_overrides, format_errors, load_yaml, merged, near_field
from simharness.profile import ProfileError
from simharness.profile import resolve as resolve_profile


class Strict(BaseModel):
    """Base for every scenario section: unknown fields are errors, values are re-validated on set, types are
    strict (`depth: true` or `depth: "3"` is not an integer) and numbers finite."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)


# The largest cost (µs, ns), pause (ms) or weight a scenario takes: larger ones make virtual times overflow.
MAX_VALUE = 1e9
# The largest workload a run takes (requests, and tokens per request): a point runs in one go, without progress
# inside it (milliseconds of CPU and tens of KB of memory a request: minutes and GBs at the limit), so a larger
# one would look hung; split it into runs.
MAX_REQUESTS = 100_000
MAX_TOKENS = 1 << 20

PositiveFloat = Annotated[float, Field(gt=0, le=MAX_VALUE)]
NonNegFloat = Annotated[float, Field(ge=0, le=MAX_VALUE)]
Tokens = Annotated[int, Field(ge=1, le=MAX_TOKENS)]


# --------------------------------------------------------------------------------------------
# workload


class LengthDist(Strict):
    """A token-length distribution: fixed, uniform [min, max], normal clipped to [min, max], or
    `corpus` (the natural length of the sampled corpus passage, clipped to [min, max])."""

    dist: Literal["fixed", "uniform", "normal", "corpus"] = "fixed"
    value: Tokens = Field(128, description="fixed length")
    min: Tokens = 1
    max: Tokens = 4096
    mean: PositiveFloat = 256.0
    std: NonNegFloat = 64.0

    @model_validator(mode="after")
    def _check_range(self) -> LengthDist:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must be <= max ({self.max})")
        return self


class Workload(Strict):
    """Who sends what, when: the client side of `vllm bench serve`."""

    arrival: Literal["closed", "poisson", "gamma"] = Field(
        "closed", description="closed loop with `concurrency` users, or an open-loop arrival process"
    )
    concurrency: int = Field(16, ge=1, le=MAX_REQUESTS, description="closed: users; open: max in-flight requests")
    rate: float = Field(10.0, ge=1e-3, le=MAX_VALUE, description="open loop: requests per second")
    burstiness: float = Field(1.0, ge=1e-3, le=1e3, description="gamma shape (1.0 = Poisson)")
    cap_concurrency: bool = Field(
        False, description="open loop: cap in-flight requests at `concurrency` (vLLM --max-concurrency)"
    )
    num_requests: int = Field(200, ge=1, le=MAX_REQUESTS)
    requests_per_user: int | None = Field(
        None, ge=1, le=MAX_REQUESTS, description="instead of num_requests: concurrency x this many, so a sweep over "
        "concurrency keeps the number of waves"
    )
    prompt_len: LengthDist = LengthDist(dist="uniform", min=128, max=1024)
    output_len: LengthDist = LengthDist(dist="fixed", value=128)
    kinds: dict[Literal["code_edit", "summarize", "free"], NonNegFloat] = Field(
        default_factory=lambda: {"code_edit": 0.5, "summarize": 0.25, "free": 0.25},
        description="mix of request kinds (weights); kinds differ in how much the output copies the prompt",
    )
    random_fraction: float = Field(
        0.0, ge=0, le=1, description="share of requests sampled at temperature 1 (the rest greedy, temperature 0); "
        "sim: their verified tokens cost the sampler `gpu_costs.sampler_random_factor` times a greedy token's",
    )

    @field_validator("kinds")
    @classmethod
    def _kinds_nonzero(cls, v: dict[str, float]) -> dict[str, float]:
        if not v or sum(v.values()) <= 0:
            raise ValueError("at least one request kind needs a positive weight")
        return v

    @model_validator(mode="after")
    def _one_count(self) -> Workload:
        if self.requests_per_user is not None and self.num_requests != Workload.model_fields["num_requests"].default:
            raise ValueError("set num_requests or requests_per_user, not both")
        if self.total_requests > MAX_REQUESTS:
            raise ValueError(f"concurrency x requests_per_user ({self.total_requests}) is above the limit of "
                             f"{MAX_REQUESTS} requests per run")
        return self

    @property
    def total_requests(self) -> int:
        """How many requests the workload has."""
        if self.requests_per_user is not None:
            return self.concurrency * self.requests_per_user
        return self.num_requests


# --------------------------------------------------------------------------------------------
# engine


class Acceptance(Strict):
    """How many drafts the target accepts: i.i.d., per-position conditional rates (vLLM's
    synthetic mode), or replay of greedy decoding over the request's real reference text."""

    model: Literal["iid", "positional", "replay"] = "replay"
    alpha: float = Field(0.7, ge=0, lt=1, description="iid: acceptance probability per draft")
    rates: list[Annotated[float, Field(ge=0, le=1)]] = Field(
        default_factory=lambda: [0.8, 0.7, 0.6, 0.5],
        description="positional: conditional acceptance rate at each draft position",
    )


class Speculation(Strict):
    """N-gram speculation: proposer placement, draft length and matching rules."""

    proposer: Literal["none", "ngram_cpu", "ngram_gpu"] = "ngram_gpu"
    k: int = Field(4, ge=0, le=16, description="drafts per request per step")
    min_n: int = Field(2, ge=1)
    max_n: int = Field(5, ge=1)
    tie_break: Literal["earliest", "latest"] = "earliest"
    invalid_slots: Literal["trim", "fill"] = Field(
        "trim", description="trim invalid drafts on the host (needs a sync) or verify filled slots"
    )
    acceptance: Acceptance = Acceptance()
    k_schedule: dict[int, int] | None = Field(
        None, description="k by batch size, as vLLM's dynamic speculation chooses it: {batch size: k}, each k for "
        "steps of that many requests up to the next listed size; starts at 1, each k at most `k` (the proposer's "
        "limit, which sizes its drafts); every level (docs/frontier.md)",
    )

    @field_validator("k_schedule", mode="before")
    @classmethod
    def _schedule_sizes(cls, v: Any) -> Any:
        """Batch sizes are positive integers (a JSON round trip writes them as strings of digits), k >= 0."""
        if not isinstance(v, dict):
            return v
        schedule = {}
        for size, k in v.items():
            digits = isinstance(size, str) and size.isdecimal()
            if isinstance(size, bool) or not (isinstance(size, int) or digits) or int(size) < 1:
                raise ValueError(f"batch size {size!r} is not a positive integer")
            if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                raise ValueError(f"k {k!r} at batch size {size} is not an integer >= 0")
            schedule[int(size)] = k
        if not schedule:
            raise ValueError("needs at least one {batch size: k} entry (leave it out for a fixed k)")
        if min(schedule) != 1:
            raise ValueError(f"starts at batch size {min(schedule)}; it must start at 1")
        return schedule

    @model_validator(mode="after")
    def _check_n(self) -> Speculation:
        if self.min_n > self.max_n:
            raise ValueError(f"min_n ({self.min_n}) must be <= max_n ({self.max_n})")
        return self

    @model_validator(mode="after")
    def _schedule_within_limit(self) -> Speculation:
        limit = 0 if self.proposer == "none" else self.k
        over = next((size for size, k in (self.k_schedule or {}).items() if k > limit), None)
        if over is not None:
            raise ValueError(f"k_schedule: k {self.k_schedule[over]} at batch size {over} is above the proposer's "
                             f"limit (k = {limit}{' with proposer none' if self.proposer == 'none' else ''})")
        return self


class GpuCosts(Strict):
    """Overrides of the roofline's hardware numbers and fixed GPU costs (None = the GPU's default)."""

    # lower bounds keep step times finite; a huge value is an infinitely fast GPU (the tests' ideal GPU)
    mem_bandwidth_gbs: float | None = Field(None, ge=1)
    bf16_tflops: float | None = Field(None, ge=0.01)
    mem_efficiency: float = Field(0.8, ge=0.01, le=1, description="achieved fraction of bandwidth")
    compute_efficiency: float = Field(0.6, ge=0.01, le=1, description="achieved fraction of peak FLOPs")
    prefix_attention_efficiency: float = Field(
        0.09, ge=0.001, le=1, description="achieved fraction of peak FLOPs in a later prefill chunk's pairs with the "
        "prompt before it (the Triton prefix kernel; the default measured: docs/validation.md, "
        "results/kernels/verify-and-prefill/prefill-1b.txt)",
    )
    step_overhead_us: NonNegFloat = Field(30.0, description="fixed per-step GPU time (graph launch, norms)")
    layer_latency_us: NonNegFloat = Field(
        24.0, description="fixed GPU time per layer of each forward (the decode step's and each prefill chunk's): "
        "its ~8 kernels' latency, which no batch size hides (the default measured: docs/validation.md, "
        "results/kernels/decode-step)",
    )
    sampler_overhead_us: NonNegFloat = Field(15.0, description="rejection sampler fixed cost")
    ngram_gpu_us: NonNegFloat = Field(20.0, description="GPU n-gram proposer fixed cost")
    ngram_gpu_per_token_ns: NonNegFloat = Field(0.05, description="GPU n-gram cost per history token")
    correction_us: NonNegFloat = Field(5.0, description="optimistic correction kernel")
    sampler_random_factor: float = Field(
        1.16, ge=1, description="a random (temperature > 0) row's sampler cost per verified token, relative to a "
        "greedy row's (the default measured: docs/seeds.md, #37238)",
    )


class HostCosts(Strict):
    """Host (engine thread) phase costs in microseconds: base per step + per request (+ per token).

    schedule and update default to vLLM's own `Scheduler.schedule` and `update_from_output` (async scheduling,
    folded at 3 drafts per request), measured on the development machine: `results/host/vllm-0.32.0.json`,
    docs/host-costs.md. The other phases are the harness's own figures (measured at hil/real)."""

    vllm_version: str = Field(
        "0.32.0", description="the vLLM version whose host costs these stand for; a `profile` of another one is noted"
    )
    profile: str | None = Field(
        None, description="a host profile (`simharness host-profile`): its schedule and update costs (folded at "
        "`profile_k` drafts per request, scaled to `host_gauge_us`) replace the defaults; fields set here still win"
    )
    profile_k: int = Field(3, ge=0, le=64, description="drafts per request at which the profile's per-draft cost "
                           "is folded into the per-request cost")
    host_gauge_us: float | None = Field(
        None, gt=0, le=MAX_VALUE, description="the host gauge (`simharness.hostspeed`, fastest median, µs) of the "
        "host modelled: the profile's costs scale by it over the profile's own (unset: the profile's host)"
    )
    schedule_us: NonNegFloat = 23.27
    schedule_per_req_us: NonNegFloat = 9.40
    prep_us: NonNegFloat = 200.0
    prep_per_req_us: NonNegFloat = 5.0
    prep_per_token_us: NonNegFloat = 0.05
    launch_us: NonNegFloat = 60.0
    launch_per_req_us: NonNegFloat = 0.0
    launch_per_prefill_us: NonNegFloat = Field(0.0, description="per prefill chunk (its launch is not a replay)")
    update_us: NonNegFloat = 7.57
    update_per_req_us: NonNegFloat = 5.16
    ngram_cpu_us: NonNegFloat = 20.0
    ngram_cpu_per_req_us: NonNegFloat = 3.0
    ngram_cpu_per_token_ns: NonNegFloat = Field(2.0, description="CPU n-gram cost per history token")
    sync_us: NonNegFloat = Field(15.0, description="cost of one host sync once its event has fired (D2H)")
    sync_per_req_us: NonNegFloat = Field(0.0, description="sim: a step's readback per request it holds")
    gc_ns_per_object: NonNegFloat = Field(
        30.0, description="sim: a full garbage collection's host time per GC-tracked object of the heap "
        "(docs/seeds.md, #41043)"
    )

    @model_validator(mode="before")
    @classmethod
    def _from_profile(cls, data: Any) -> Any:
        # nothing to take, or taken already: a resolved scenario (a run's, a sweep point's) holds the profile's costs
        if not isinstance(data, dict) or data.get("profile") is None or all(name in data for name in PROFILE_FIELDS):
            return data
        try:
            profile = load_host_profile(data["profile"])
        except HostProfileError as e:
            raise ValueError(f"profile: {e}") from None
        version = data.get("vllm_version", cls.model_fields["vllm_version"].default)
        if profile.vllm_version != version:
            warnings.warn(f"engine.host_costs.profile {data['profile']} is for vLLM {profile.vllm_version}, the "
                          f"scenario names vLLM {version} (engine.host_costs.vllm_version)", ScenarioNote, stacklevel=2)
        k = data.get("profile_k", cls.model_fields["profile_k"].default)
        costs = profile_host_costs(profile, k=k, gauge_us=data.get("host_gauge_us"))
        return {**costs, **data}


class GcPauses(Strict):
    """Stochastic host pauses (garbage collection triggered by per-step allocations)."""

    probability: float = Field(0.0, ge=0, le=1, description="chance of a pause per engine-loop iteration")
    mean_ms: NonNegFloat = Field(2.0, description="mean pause length")
    distribution: Literal["fixed", "exponential"] = "exponential"
    allocations_per_step: int = Field(
        0, ge=0, description="GC-tracked objects prep allocates and drops every step (vLLM before #41043 built "
        "lists and arrays there); hil/real: really allocated, so CPython's collector runs when it will; sim: every "
        "`full_every` of them a full collection pauses prep for `heap_objects` x `host_costs.gc_ns_per_object`",
    )
    heap_objects: int = Field(
        0, ge=0, le=50_000_000, description="long-lived GC-tracked objects the engine process holds (what a full "
        "collection traverses); hil/real: really held by the backend; sim: sizes the full collection's pause",
    )
    full_every: int = Field(
        70_000, ge=1, description="sim: allocations between two full collections (CPython's thresholds 700 x 10 x "
        "10, were every allocation to count; CPython counts allocations less deallocations: docs/seeds.md)",
    )


class Engine(Strict):
    """What executes a step and where time comes from (`level`, simharness.levels): the cost model in virtual
    time (sim), or the real decode loop (target verify, rejection sampler and n-gram proposer really run) in
    virtual time (hil, hardware in the loop) or in wall-clock time with real overlap (real)."""

    level: LevelName = Field(
        "sim", description="sim: the cost model; hil: the real decode loop, measured steps in virtual time; real: "
        "the real decode loop in wall-clock time (the old `backend: model|torch|real` is read as sim|hil|real)"
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="hil/real: where the decode loop runs")
    cuda_graphs: bool = Field(True, description="hil/real on CUDA: replay each decode step whole (verify, sampling, "
                              "commit, proposal, the copy back) and each prefill chunk as CUDA graphs")
    calibration: str | None = Field(
        None, description="sim level: a calibration file (`simharness calibrate`) fitted on this gpu and model; its "
        "device step times and measured host phases replace the roofline and those host_costs"
    )
    profile: str = Field(
        "auto", description="sim level: the cost profile (`simharness profile`, docs/calibration.md): auto = the "
        "committed simharness/data/profiles/<gpu>-<model>.yaml where there is one, none = the roofline, or a profile "
        "file; "
        "engine.calibration, when set, is used instead"
    )
    gpu: str = Field("H100", description="roofline GPU: H100, H200, A100, L40S")
    model: str = Field(
        "llama-3-8b",
        description="a catalogue model (simharness.models: llama-3.2-1b, llama-3-8b, qwen3-1.7b, tiny; torch: random "
        "weights) or a local Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json), whose "
        "tokenizer then cuts the workload's text",
    )
    steer: bool = Field(
        True, description="hil/real: steer the logits to the reference text (false: the model's own greedy "
        "predictions decide what is accepted)"
    )
    host_slowdown: float | None = Field(
        None, gt=1, le=10, description="hil/real: measure a run again (at most twice more) when the host gauge around "
        "it (`simharness.hostspeed`) was this many times slower than the fastest this process has seen; every run's "
        "gauge is in the summary (host_slowdown, host_attempts)"
    )
    speculation: Speculation = Speculation()
    gpu_costs: GpuCosts = GpuCosts()
    host_costs: HostCosts = HostCosts()
    gc: GcPauses = GcPauses()

    @model_validator(mode="before")
    @classmethod
    def _old_name(cls, data: Any) -> Any:
        """`backend: model|torch|real`, the old name of `level`, read as it (a scenario stored by an older run)."""
        if not isinstance(data, dict) or "backend" not in data:
            return data
        if "level" in data:
            raise ValueError("backend: the old name of level; set level only")
        return _renamed_key(data, "backend", "level", renamed(data["backend"]))

    @field_validator("model")
    @classmethod
    def _known_model(cls, v: str, info: ValidationInfo) -> str:
        model_config(v)  # a catalogue name, or a checkpoint directory of a supported architecture
        checkpoint = checkpoint_dir(v)
        level = LEVELS.get(info.data.get("level", ""))
        if checkpoint is not None and level is not None and level.backend == "torch":  # the levels that load it
            check_checkpoint(checkpoint)
        return v

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, v: str, info: ValidationInfo) -> str:
        if info.data.get("calibration") is None:  # a calibrated device need not be in the roofline's catalogue
            gpu_spec(v)
        return v

    @model_validator(mode="after")
    def _matching_calibration(self) -> Engine:
        # a measured level reads neither (it notes them as ignored): a recorded real run stays readable, and a
        # profile grid refittable, after its shipped profile changed format; a point set to sim is checked then
        if LEVELS[self.level].backend != "model":
            return self
        if self.calibration is not None:
            try:
                cal = load_calibration(self.calibration)
                check_match(cal, self.gpu, self.model)
            except CalibrationError as e:
                raise ValueError(f"calibration: {e}") from None
            unknown = sorted(set(cal.host_costs) - set(HostCosts.model_fields))
            if unknown:
                raise ValueError(f"calibration: {self.calibration}: unknown host cost {unknown[0]!r}")
        try:
            resolve_profile(self)
        except ProfileError as e:
            raise ValueError(f"profile: {e}") from None
        return self


def _renamed_key(mapping: dict, old: str, new: str, value: Any) -> dict:
    """`mapping` with its key `old` renamed `new`, in the same place, holding `value`."""
    return {(new if k == old else k): (value if k == old else v) for k, v in mapping.items()}


# --------------------------------------------------------------------------------------------
# scheduler


class SyncPoint(Strict):
    """A host phase that blocks on a GPU event: all launched work (on one FIFO stream that is the
    previous step's end) or the oldest step still in flight (differs from it at depth >= 3)."""

    name: str
    phase: Literal["schedule", "prep", "launch", "update"] = "prep"
    waits_for: Literal["all_launched", "oldest_in_flight"] = "all_launched"


class SyncPoints(Strict):
    """What-if edits to the sync points the mode implies (see modes.KNOWN_SYNC_POINTS)."""

    add: list[SyncPoint | str] = Field(default_factory=list)
    remove: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _once_each(self) -> SyncPoints:
        for field, names in (("add", [p if isinstance(p, str) else p.name for p in self.add]), ("remove", self.remove)):
            repeated = sorted({n for n in names if names.count(n) > 1})
            if repeated:
                raise ValueError(f"{field}: {', '.join(repeated)} listed more than once")
        return self


class Scheduler(Strict):
    """The engine loop: queue depth, correction policy, batching limits, sync points."""

    depth: int = Field(2, ge=1, le=8, description="max batches in flight (1 = synchronous)")
    policy: Literal["wait", "optimistic"] = Field(
        "optimistic", description="async correction: wait for accepted counts, or correct on the GPU"
    )
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(8192, ge=1)
    chunked_prefill: bool = True
    sync_points: SyncPoints = SyncPoints()


# --------------------------------------------------------------------------------------------
# report


class Goodput(Strict):
    """SLOs in ms for goodput (None = no constraint), as `vllm bench serve --goodput`."""

    ttft_ms: PositiveFloat | None = None
    tpot_ms: PositiveFloat | None = None
    e2el_ms: PositiveFloat | None = None


class Report(Strict):
    percentiles: list[Annotated[float, Field(ge=0, le=100)]] = Field(default_factory=lambda: [50, 90, 99])
    goodput: Goodput = Goodput()
    trace_steps: int = Field(400, ge=0, description="steps per point written to the Perfetto trace")
    timeline_steps: int = Field(8, ge=1, description="steps per mode drawn in the report's timeline")


# --------------------------------------------------------------------------------------------
# fidelity

FidelityMetric = Literal["mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms",
                         "output_throughput", "mean_acceptance_length"]  # fmt: skip


class Tolerance(Strict):
    """The largest relative error allowed against the real level: of the median point of the grid, and of its
    worst point (None: not checked)."""

    median: float | None = Field(None, gt=0, le=10)
    worst: float | None = Field(None, gt=0, le=10)


class Fidelity(Strict):
    """How `simharness fidelity` checks the levels against the real level."""

    runs: int = Field(2, ge=1, le=20, description="runs of each measured point (hil and real); sim runs once")
    tolerances: dict[Literal["sim", "hil"], dict[FidelityMetric, Tolerance]] = Field(
        default_factory=dict, description="per level and metric; exceeding one makes the command exit 1"
    )


# --------------------------------------------------------------------------------------------
# scenario


class Scenario(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", max_length=100)
    seed: int = Field(0, ge=0, le=2**63 - 1)
    workload: Workload = Workload()
    engine: Engine = Field(default_factory=Engine)  # per scenario: a bad shipped profile is bad input, at run time
    scheduler: Scheduler = Scheduler()
    sweep: dict[str, list[Any]] = Field(default_factory=dict)
    report: Report = Report()
    fidelity: Fidelity = Fidelity()
    repeats: int = Field(1, ge=1, le=100, description="runs of each sweep point (sim: seeds seed ... seed + repeats - "
                         "1; measured: the seed, each repeat warmed up anew); the summary keeps every repeat, the "
                         "report gives medians and 95% intervals")

    @field_validator("name")
    @classmethod
    def _not_a_dot_path(cls, v: str) -> str:
        if set(v) == {"."}:
            raise ValueError(f"{v!r} is not a usable directory name")
        return v

    @model_validator(mode="before")
    @classmethod
    def _old_sweep_name(cls, data: Any) -> Any:
        """A sweep of `engine.backend`, the old name of `engine.level`, read as a sweep of the level."""
        sweep = data.get("sweep") if isinstance(data, dict) else None
        if not isinstance(sweep, dict) or "engine.backend" not in sweep or "engine.level" in sweep:
            return data
        values = sweep["engine.backend"]
        levels = [renamed(v) for v in values] if isinstance(values, list) else values
        return {**data, "sweep": _renamed_key(sweep, "engine.backend", "engine.level", levels)}

    @model_validator(mode="after")
    def _check_sweep(self) -> Scenario:
        for path, values in self.sweep.items():
            if not isinstance(values, list) or not values:
                raise ValueError(f"sweep.{path}: needs a non-empty list of values")
            ids = [_fmt(v) for v in values]
            twice = next((v for v in ids if ids.count(v) > 1), None)
            if twice is not None:
                raise ValueError(f"sweep.{path}: value {twice} appears more than once; to run a point several "
                                 "times set `repeats: N`")
            try:
                resolve_field(self, path)
            except ValueError as e:
                raise ValueError(f"sweep.{e}") from None
        return self


# Physically plausible ranges of the fields with a unit: a value outside one is most likely in another unit
# (`mem_bandwidth_gbs: 3.35`, TB/s meant, runs 1000 times too slow). A note, not an error: the tests' ideal GPU is
# unphysical on purpose. A cost is at most 100 ms a step (or request), 10 µs a token (or object).
_COST_UNITS = {"us": ("µs", 1.0), "ns": ("ns", 1000.0)}  # unit, and in it a µs


def _cost_range(name: str, unit: str) -> tuple[float, float, str]:
    label, per_us = _COST_UNITS[unit]
    return 0, (10 if "per_token" in name or "per_object" in name else 100_000) * per_us, label


PLAUSIBLE: dict[str, tuple[float, float, str]] = {
    "engine.gpu_costs.mem_bandwidth_gbs": (100, 20_000, "GB/s"),  # an L4 300, an H100 SXM 3,350, a B200 8,000
    "engine.gpu_costs.bf16_tflops": (10, 10_000, "TFLOP/s"),  # an L4 121, an H100 SXM 989, a B200 2,250
    "engine.gc.mean_ms": (0, 10_000, "ms"),
    "report.goodput.ttft_ms": (1, 10_000_000, "ms"),
    "report.goodput.tpot_ms": (0.1, 100_000, "ms"),
    "report.goodput.e2el_ms": (1, 10_000_000, "ms"),
    **{f"engine.{section}.{name}": _cost_range(name, unit)
       for section, fields in (("gpu_costs", GpuCosts.model_fields), ("host_costs", HostCosts.model_fields))
       for name in fields for unit in name.split("_") if unit in _COST_UNITS},
}


def unit_notes(scenario: Scenario) -> list[str]:
    """A note for each value, set or swept, outside the plausible range of its field (`PLAUSIBLE`)."""
    notes = []
    for path, (low, high, unit) in PLAUSIBLE.items():
        if path in scenario.sweep:
            values = [(f"sweep.{path}", v) for v in scenario.sweep[path]]
        else:
            values = [(path, getattr(*resolve_field(scenario, path)))]
        for where, v in values:
            if isinstance(v, int | float) and not isinstance(v, bool) and not low <= v <= high:
                notes.append(f"{where}: {v:,.10g} {unit} is outside the plausible {low:,.10g} to {high:,.10g} "
                             f"{unit}; the field is in {unit}: is the value in another unit?")
    return notes


class Point(BaseModel):
    """One sweep point: its readable id and its fully resolved scenario."""

    id: str
    index: int
    values: dict[str, Any]  # swept path -> the value this point takes
    scenario: Scenario


def resolve_field(scenario: BaseModel, path: str) -> tuple[BaseModel, str]:
    """Return (section, field) for a dotted path, or raise naming the part that does not exist."""
    parts = path.split(".")
    node: Any = scenario
    for i, part in enumerate(parts):
        if not isinstance(node, BaseModel) or part not in type(node).model_fields:
            where = ".".join(parts[:i]) or "the scenario"
            near = near_field(type(node), part) if isinstance(node, BaseModel) else ""
            raise ValueError(f"{path}: {where} has no field {part!r}{near}")
        if i == len(parts) - 1:
            return node, part
        node = getattr(node, part)
    raise ValueError(f"{path}: empty path")


def scenario_from_dict(data: Any, overrides: dict[str, Any] | None = None, *, file: str | None = None) -> Scenario:
    """Validate a scenario mapping, after applying dotted-path overrides (a section's value merges into the
    section). With `file`, where `data` was read, the overrides are `--set` options and every problem names
    its source: the file or the option."""
    if not isinstance(data, dict):
        raise ScenarioError(f"{file + ': ' if file else ''}a scenario must be a YAML mapping")
    fields = [("engine.level", renamed(v)) if p == "engine.backend" else (p, v)
              for p, v in field_overrides(Scenario, overrides or {})]
    try:
        mapping = merged(data, fields)
    except ScenarioError as e:
        raise ScenarioError(f"--set {e}" if file else str(e)) from None
    try:
        return Scenario.model_validate(mapping)
    except ValidationError as e:
        raise ScenarioError(format_errors(e, Scenario, file, data, fields)) from None


def load_scenario(path: str | Path, overrides: dict[str, Any] | None = None) -> Scenario:
    """Read and validate a scenario YAML file; `overrides` (`--set` options) maps dotted paths to values. A
    problem names its source: the file, or the option."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ScenarioError(f"{path}: cannot read scenario file ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ScenarioError(f"{path}: not a UTF-8 text file (byte {e.start})") from None
    try:
        data = load_yaml(text)
    except yaml.YAMLError as e:
        raise ScenarioError(f"{path}: not valid YAML ({e})") from None
    return scenario_from_dict(data, overrides, file=str(path))


def scenario_diff(a: Scenario, b: Scenario) -> list[str]:
    """The dotted paths whose values differ between two scenarios (a swept path as `sweep.<path>`)."""

    def walk(x: Any, y: Any, prefix: str) -> list[str]:
        if isinstance(x, dict) and isinstance(y, dict):
            keys = list(x) + [k for k in y if k not in x]
            return [d for k in keys for d in walk(x.get(k), y.get(k), f"{prefix}.{k}" if prefix else str(k))]
        return [] if x == y else [prefix]

    return walk(a.model_dump(mode="json"), b.model_dump(mode="json"), "")


def sweep_points(scenario: Scenario) -> list[Point]:
    """Expand the sweep into points (cartesian product, in the order the paths are written), each `repeats` times
    in a row (`repeat_points`)."""
    paths = list(scenario.sweep)
    base = scenario.model_dump(mode="json")
    base["sweep"] = {}
    base["repeats"] = 1
    points = []
    for index, values in enumerate(itertools.product(*(scenario.sweep[p] for p in paths))):
        point_id = ",".join(f"{p}={_fmt(v)}" for p, v in zip(paths, values, strict=True)) or "base"
        overrides = dict(zip(paths, values, strict=True))
        try:
            resolved = scenario_from_dict(base, overrides)
        except ScenarioError as e:
            raise ScenarioError(f"sweep point {point_id}: {e}") from None
        points.append(Point(id=point_id, index=index, values=overrides, scenario=resolved))
    return repeat_points(points, scenario.repeats)


def repeat_points(points: list[Point], repeats: int) -> list[Point]:
    """Each point `repeats` times as points of their own (no change for 1): repeat r has the value `repeat` = r
    and the id suffix `,repeat=r`, so any executor runs them as it runs points. At the sim level repeat r has the
    seed seed + r (the same seed would repeat it to the bit); a measured repeat keeps the seed, so the same
    requests are measured again after a warm-up of their own. Repeat 0 of every point comes first, then repeat
    1, ...: consecutive points share a seed, hence their requests and replay tables."""
    if repeats == 1:
        return points
    out = []
    for r in range(repeats):
        for p in points:
            measured = LEVELS[p.scenario.engine.level].measured
            scenario = p.scenario.model_copy(update={"seed": p.scenario.seed if measured else p.scenario.seed + r})
            point_id = f"repeat={r}" if p.id == "base" else f"{p.id},repeat={r}"
            out.append(Point(id=point_id, index=len(out), values={**p.values, "repeat": r}, scenario=scenario))
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, dict)):
        return yaml.safe_dump(value, default_flow_style=True).strip()
    return str(value)

