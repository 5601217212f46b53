"""The sim level's backend (`backend.Backend`): step outcomes from the acceptance model, durations from the cost model.

It keeps the device-side truth of every request (prompt tokens in the KV cache, committed output tokens, the valid
drafts the proposer holds) and advances it one step at a time in compiled code (`_run_step`).
"""

from __future__ import annotations

import numpy as np

from simharness.acceptance import AcceptanceModel, accepted_drafts, held_drafts, make_acceptance, verifies_fillers
from simharness.backend import Enqueue, StepTiming
from simharness.costmodel import CostModel, fitted_seconds, gpu_seconds
from simharness.engine.buckets import prefill_bucket
from simharness.jit import njit
from simharness.modes import DEVICE_OP_SYNCS, Mode
from simharness.policy import (
    ACCEPTED,
    COMPLETES,
    DRAFTS_VALID,
    EMITTED,
    PREFILL,
    REQ,
    TOKENS,
    VERIFIED,
    WASTED,
)
from simharness.profile import graph_rows, profile_seconds
from simharness.records import Step
from simharness.scenario import Scenario
from simharness.workload import ACCEPTANCE_STREAM, HEAP_STREAM, Requests

# Rows of the device truth, a column per request: prompt tokens, prompt tokens in the KV cache, context
# (prompt + committed output tokens, which ends at END = prompt + output) and the valid drafts the
# proposer holds at that context (0 once finished).
PROMPT, PREFILLED, CONTEXT, END, HELD = range(5)
# Uniform draws of the acceptance stream taken at a time: one block is a prefix of the stream, so the
# draws are those of one call per step.
UNIFORM_BLOCK = 4096


def model_backend(sc: Scenario, requests: Requests, mode: Mode) -> ModelBackend:
    """The sim level's backend of one point: its acceptance model, cost model and acceptance stream (seeded by
    the scenario's seed alone, so that every point of a sweep sees the same random numbers)."""
    acceptance = make_acceptance(sc.engine.speculation, requests)
    cost = CostModel(sc.engine, optimistic_correction=mode.optimistic)
    rng = np.random.default_rng(np.random.SeedSequence([sc.seed, ACCEPTANCE_STREAM]))
    backend = ModelBackend(requests, acceptance, cost, mode.k, rng, sc.engine.gc.allocations_per_step,
                           sc.engine.gc.full_every, verifies_fillers(sc.engine.speculation))
    if cost.profile is not None:
        backend.overlap = cost.profile.overlap_at(mode.depth)
    if backend.allocations_per_step:
        # the process's earlier allocations left the collector's count anywhere (the seed's own stream)
        backend.allocated = int(np.random.default_rng(np.random.SeedSequence([sc.seed, HEAP_STREAM])).integers(
            sc.engine.gc.full_every))
    return backend


class ModelBackend:
    """The sim level (`engine.level: sim`): outcomes from the acceptance model, durations from the cost model."""

    measured = ""

    def __init__(self, requests, acceptance: AcceptanceModel, cost: CostModel, k: int, rng: np.random.Generator,
                 allocations_per_step: int = 0, full_every: int = 1, fill: bool = False):
        n = len(requests.prompt_len)
        # rows sampled at a temperature take the sampler's random path
        self.random = requests.random if requests.random is not None else np.zeros(n, dtype=bool)
        # prep's per-step allocations: a full collection pauses prep whenever they pass `full_every` more
        self.allocations_per_step, self.full_every = allocations_per_step, full_every
        self.allocated = 0
        self.acc = acceptance
        self.cost = cost
        # the launch's cost, unless it varies with the batch (a calibration's per-request and per-prefill terms)
        self.launch_s = None if cost.h.launch_per_req_us or cost.h.launch_per_prefill_us else cost.launch(0, 0)
        self.k = k
        self.fill = fill  # a decode verifies every slot, the proposer's fillers past its valid drafts as drafts
        self.rng = rng
        self.truth = np.zeros((5, n), dtype=np.int64)
        self.truth[PROMPT] = self.truth[CONTEXT] = requests.prompt_len
        self.truth[END] = self.truth[PROMPT] + requests.output_len
        _hold_initial(self.truth, k, acceptance.survival, acceptance.offset, acceptance.valid)
        self.held = self.truth[HELD]  # a view: indexing one row is several times cheaper than the table
        # only the drawn models read uniforms
        self.draws = k > 0 and len(acceptance.survival) > 0
        self.uniforms = np.zeros(0, dtype=np.float64)
        self.next_uniform = 0
        # a profile's launch overlap at this depth (lead, tail seconds): the device starts `lead` into the launch
        # and ends no earlier than `tail` after it (None: the step starts once its launch ends)
        self.overlap: tuple[float, float] | None = None

    def valid_drafts(self) -> np.ndarray:
        """Valid drafts the proposer holds now, per request id (0 for finished ones); a view to read, not keep."""
        return self.held

    def prep(self, step: Step) -> float:
        seconds = self.cost.prep(step.batch.size, step.batch.n_tokens)
        if self.allocations_per_step:
            self.allocated += self.allocations_per_step
            if self.allocated >= self.full_every:
                self.allocated -= self.full_every
                seconds += self.cost.full_gc_s
        return seconds

    def sync_op(self, step: Step, name: str) -> float | None:
        """A device operation's round trip (`modes.DEVICE_OP_SYNCS`: about a readback's, 0.1 ms at real on the H100,
        docs/seeds.md #38047); None for a sync that only reads back the steps it waits for."""
        return self.cost.sync() if name in DEVICE_OP_SYNCS else None

    def launch(self, step: Step) -> tuple[float, Enqueue]:
        seconds = self.launch_s
        if seconds is None:
            seconds = self.cost.launch(step.batch.size, step.batch.n_prefill)
        if self.overlap is not None:  # one part, enqueued over the launch (simulation._overlapped_end)
            lead, tail = self.overlap
            return seconds, ((min(lead, seconds), seconds + tail),)
        return seconds, None

    def propose(self, rids: np.ndarray) -> float:
        # the proposer scans each request's whole history: its context (only at depth 1, so the host's view)
        return self.cost.ngram_cpu(len(rids), int(self.truth[CONTEXT][rids].sum()))

    def release(self, rids: np.ndarray) -> None:
        pass  # the cost model holds nothing per request

    def run(self, step: Step) -> StepTiming:
        """Advance the device truth by one step and write its outcome into the batch table; returns its GPU time
        and the modelled readback."""
        b = step.batch
        if self.draws and self.next_uniform + b.size > len(self.uniforms):
            fresh = self.rng.random(max(UNIFORM_BLOCK, b.size))
            self.uniforms = np.concatenate((self.uniforms[self.next_uniform :], fresh))
            self.next_uniform = 0
        acc = self.acc
        seconds, self.next_uniform = _run_step(
            b.table, step.trimmed, self.fill, self.k, b.k, self.truth, acc.survival, acc.offset, acc.valid,
            acc.accepted, self.uniforms, self.next_uniform, self.cost.sizes, self.cost.rates, self.random,
            self.cost.fit, self.cost.prof,
        )
        readback_s = self.cost.readback(b.size)
        if self.overlap is not None:  # the launch's one part (`launch`)
            return StepTiming(seconds, readback_s, (seconds,))
        return StepTiming(seconds, readback_s)


@njit
def _hold_initial(truth: np.ndarray, k: int, survival: np.ndarray, offset: np.ndarray, valid: np.ndarray) -> None:
    """Drafts held before the first token, read only by a trimming host whose sync did not wait for the
    prefill: the proposer's at committed length 1, the first a decode reads."""
    for rid in range(truth.shape[1]):
        output_len = truth[END, rid] - truth[PROMPT, rid]
        truth[HELD, rid] = held_drafts(survival, offset, valid, rid, min(1, output_len - 1)) if k else 0


@njit
def _run_step(
    table: np.ndarray,
    trimmed: bool,
    fill: bool,
    k: int,
    k_step: int,
    truth: np.ndarray,
    survival: np.ndarray,
    offset: np.ndarray,
    valid: np.ndarray,
    accepted: np.ndarray,
    uniforms: np.ndarray,
    next_uniform: int,
    sizes: np.ndarray,
    rates: np.ndarray,
    random: np.ndarray,
    fit: np.ndarray,
    prof: np.ndarray,
) -> tuple[float, int]:
    """One step on the device truth: fills the batch's outcome rows, returns its GPU seconds (from its query
    tokens, KV tokens after the step, twice the attention pairs and the history the proposer scans; or, with a
    calibration's `fit`, from its decode rows, tokens and context and its prefill chunks and tokens) and the
    next unread uniform.

    Twice the pairs of a row with query q over context c is q * (2 * c + q + 1): an integer, so the
    totals do not depend on the order of the rows. Acceptance and the drafts held are separate passes:
    numba keeps their calls cheap only in short loops."""
    size = table.shape[1]
    width = 1 + k_step
    tokens = kv_tokens = pairs2 = history = random_tokens = verified = 0
    decode_rows = decode_context = max_context = prefill_reqs = prefill_tokens = prefill_context = prefill_padded = 0
    prefix_pairs = 0  # a later chunk's pairs with the prompt before it
    any_drafts = False
    for i in range(size):
        rid = table[REQ, i]
        if table[PREFILL, i]:
            t = table[TOKENS, i]
            c = truth[PREFILLED, rid]  # a chunk's context is the prompt prefilled before it
            truth[PREFILLED, rid] = c + t
            tokens += t
            kv_tokens += c + t
            pairs2 += t * (2 * c + t + 1)
            prefill_reqs += 1
            prefill_tokens += t
            prefill_context += c
            prefix_pairs += t * c
            prefill_padded += prefill_bucket(t)  # the real loop replays the chunk's token-bucket graph
            if table[COMPLETES, i]:  # the last prefill chunk samples the first token
                truth[CONTEXT, rid] += 1
                table[EMITTED, i] = 1
            history += truth[CONTEXT, rid]
            continue
        # a decode verifies its 1 + slots, but the device computes 1 + k a row whatever the slots (the decode loop's
        # fixed width, `engine.decode_step`: trimmed slots are padding there)
        slots, c = table[VERIFIED, i], truth[CONTEXT, rid]
        verified += 1 + slots
        tokens += width
        if random[rid]:
            random_tokens += 1 + slots
        kv_tokens += c + width
        decode_rows += 1
        decode_context += c
        max_context = max(max_context, c)
        pairs2 += width * (2 * c + width + 1)
        history += c
        if c < truth[END, rid]:
            # trimmed slots carry valid drafts only; otherwise the proposer's drafts fill the first slots
            n_drafts = slots if trimmed else min(truth[HELD, rid], slots)
            table[DRAFTS_VALID, i] = n_drafts
            any_drafts |= (slots if fill else n_drafts) > 0
        else:
            # a request that finished in an earlier step but sits in this one wastes its slots
            table[WASTED, i] = 1 + slots
    if k and any_drafts:
        next_uniform = _accept(table, fill, truth, survival, offset, accepted, uniforms, next_uniform)
    for i in range(size):
        if not table[PREFILL, i]:
            rid = table[REQ, i]
            c = truth[CONTEXT, rid]
            emitted = min(table[ACCEPTED, i] + 1, truth[END, rid] - c)  # 0 for a finished request
            table[EMITTED, i] = emitted
            truth[CONTEXT, rid] = c + emitted
            history += emitted
    _hold(table, truth, k, survival, offset, valid)
    if len(fit):  # a calibration's terms are of the rows and tokens verified
        seconds = fitted_seconds(fit, decode_rows, verified, decode_context, prefill_reqs, prefill_tokens)
        return seconds, next_uniform
    # the batch's graph holds a bucket of rows: its padding rows (at length 1, no context) are computed too
    pad = graph_rows(decode_rows) - decode_rows
    tokens += pad * width
    kv_tokens += pad * width
    pairs2 += pad * width * (width + 1)
    decode_rows += pad
    decode_tokens = tokens - prefill_tokens  # every token computed is a prefill's or a decode's
    if len(prof):
        seconds = profile_seconds(prof, sizes, decode_rows, decode_tokens, decode_context, prefill_reqs,
                                  prefill_padded, random_tokens, history, prefill_context, max_context)
        return seconds, next_uniform
    forwards = prefill_reqs + (decode_rows > 0)  # each prefill chunk is a forward of its own
    seconds = gpu_seconds(sizes, rates, tokens, kv_tokens, pairs2, history, random_tokens, forwards, prefix_pairs,
                          verified + prefill_tokens)
    return seconds, next_uniform


@njit
def _accept(
    table: np.ndarray, fill: bool, truth: np.ndarray, survival: np.ndarray, offset: np.ndarray,
    accepted: np.ndarray, uniforms: np.ndarray, next_uniform: int,
) -> int:
    """Accepted drafts of the batch's live decoding requests (its ACCEPTED row), of their valid drafts or, with
    `fill`, of every slot verified (the fillers past the valid drafts too); a drawn model reads one uniform per
    decoding request. Returns the next unread uniform."""
    draws = len(survival) > 0
    for i in range(table.shape[1]):
        if table[PREFILL, i]:
            continue
        rid = table[REQ, i]
        c = truth[CONTEXT, rid]
        if c < truth[END, rid]:
            u = uniforms[next_uniform] if draws else 0.0
            table[ACCEPTED, i] = accepted_drafts(survival, offset, accepted, rid, c - truth[PROMPT, rid],
                                                 table[VERIFIED if fill else DRAFTS_VALID, i], u)
        if draws:
            next_uniform += 1
    return next_uniform


@njit
def _hold(table: np.ndarray, truth: np.ndarray, k: int, survival: np.ndarray, offset: np.ndarray,
          valid: np.ndarray) -> None:
    """The drafts held by the batch's requests whose context moved: the proposer's at the new committed
    length, 0 once finished."""
    for i in range(table.shape[1]):
        if table[EMITTED, i]:
            rid = table[REQ, i]
            c = truth[CONTEXT, rid]
            live = c < truth[END, rid]
            truth[HELD, rid] = held_drafts(survival, offset, valid, rid, c - truth[PROMPT, rid]) if k and live else 0
