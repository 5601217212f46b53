"""The scheduling policy: who runs in the next step and with how many tokens (the host's view).

Mirrors vLLM V1's scheduler in the parts that shape step composition: running requests first in
admission order, then waiting requests FCFS while `max_num_seqs` and the token budget allow;
chunked prefill splits a prompt over steps. Under async scheduling the host does not know the
outcome of in-flight steps: a decoding request is scheduled with 1 + k placeholder slots, its
progress is advanced optimistically and settled when the step's output is processed (vLLM
`AsyncScheduler`). A request is not scheduled once its in-flight steps, each emitting at least one
token, would already complete it (vLLM skips such requests the same way).

Request ids are assigned in arrival order and admission is FCFS, so "admission order" is simply
ascending id: the running set is kept as an id list, appended on admission, filtered on finish.

A step's batch is one int64 table, a row per field and a column per request, that compiled
functions (numba) fill and read: scheduling and settling a step are one call each, whatever the batch.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np

from simharness.jit import njit
from simharness.scenario import Scheduler as SchedulerConfig

# Rows of a batch table. The scheduler fills REQ to VERIFIED (VERIFIED = SLOTS until prep trims) and a prefill
# chunk's START (the prompt tokens prefilled before it, whose KV the chunk's attention reads); the outcome rows are
# filled when the step runs, per request, 0 where they do not apply (a prefill's drafts).
# The compiled functions of other modules (model_backend, records, engine.torch_backend) bake these in; their
# disk cache is dropped when they change (simharness/jit.py).
REQ, TOKENS, PREFILL, COMPLETES, SLOTS, VERIFIED, EMITTED, ACCEPTED, DRAFTS_VALID, WASTED, START = range(11)
BATCH_ROWS = 11
# The host's request counters, one array that the compiled functions update in place.
N_ARRIVED, N_ADMITTED, N_RUNNING, N_PREFILLING = range(4)
# Rows of the host's per-request state, one table (a compiled call costs per argument, most on a cold cache):
# prompt tokens, prompt tokens not scheduled yet, output tokens the host has not processed yet, and that
# less the in-flight steps that will emit for the request (a decoding request is a candidate while positive).
PROMPT_LEN, PROMPT_LEFT, LEFT, ROOM = range(4)
# The scheduler's limits, one array: the token budget, max_num_seqs, chunked prefill (0/1).
BUDGET, MAX_NUM_SEQS, CHUNKED = range(3)
# `held` when every decoding request reserves k slots (no per-request valid drafts)
K_SLOTS = np.zeros(0, dtype=np.int64)


def scheduled_k(schedule: tuple[tuple[int, int], ...], batch_size: int) -> int:
    """The k a schedule of (batch size, k) pairs, sorted and starting at 1, gives a step of `batch_size` requests:
    that of the largest listed size not above it (vLLM's dynamic speculation, k by batch size)."""
    return schedule[bisect.bisect_right(schedule, (batch_size, math.inf)) - 1][1]


@dataclass(eq=False)
class Batch:
    """One scheduled step: its table (rows REQ..WASTED above, a column per request), two totals and its k.

    The properties are the per-request views a hardware backend reads."""

    table: np.ndarray  # int64 [BATCH_ROWS, size]
    size: int  # requests
    n_prefill: int  # prefill chunks
    n_tokens: int  # tokens to compute (a prefill chunk, or 1 + verified slots per decode; prep's trim updates it)
    k: int  # draft slots per decoding request at most (the point's k, or its k schedule's for this batch size)

    @property
    def req(self) -> np.ndarray:
        return self.table[REQ]

    @property
    def tokens(self) -> np.ndarray:
        return self.table[TOKENS]

    @property
    def prefill(self) -> np.ndarray:
        return self.table[PREFILL] == 1

    @property
    def completes_prefill(self) -> np.ndarray:
        """The chunk ends the prompt, so the step emits the request's first token."""
        return self.table[COMPLETES] == 1

    @property
    def decode(self) -> np.ndarray:
        return self.table[PREFILL] == 0

    def trim(self, held: np.ndarray, k: int) -> int:
        """Cut each decoding request's verified slots to the valid drafts it holds (`held`, per request id, read
        at a sync); returns the change in tokens computed."""
        return _trim(self.table, held, k)


class BatchScheduler:
    """Host-side request bookkeeping and the per-step batching decision."""

    def __init__(self, cfg: SchedulerConfig, prompt_len: np.ndarray, output_len: np.ndarray):
        n = len(prompt_len)
        self.limits = np.array([cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.chunked_prefill], dtype=np.int64)
        self.output_len = output_len.astype(np.int64)
        self.state = np.zeros((4, n), dtype=np.int64)  # rows PROMPT_LEN, PROMPT_LEFT, LEFT, ROOM
        self.state[PROMPT_LEN] = self.state[PROMPT_LEFT] = prompt_len
        self.state[LEFT] = self.state[ROOM] = output_len
        self.left = self.state[LEFT]  # a view
        self.counts = np.zeros(4, dtype=np.int64)  # N_ARRIVED, N_ADMITTED, N_RUNNING, N_PREFILLING
        self.running_ids = np.zeros(n, dtype=np.int64)  # the first counts[N_RUNNING] are the running set
        self.finished = np.zeros(n, dtype=np.int64)  # ids that finished in the last settled step
        self.n_finished = 0

    def arrive(self, rid: int) -> None:
        assert rid == self.counts[N_ARRIVED], "requests arrive in id order"
        self.counts[N_ARRIVED] += 1

    @property
    def committed(self) -> np.ndarray:
        """Output tokens the host has processed, per request."""
        return self.output_len - self.left

    def has_waiting(self) -> bool:
        return self.counts[N_ADMITTED] < self.counts[N_ARRIVED]

    def batch_size(self) -> int:
        """Requests the next step can hold: the running ones and the waiting ones max_num_seqs admits (what a k
        schedule reads, before the step is scheduled)."""
        n_running = int(self.counts[N_RUNNING])
        waiting = int(self.counts[N_ARRIVED] - self.counts[N_ADMITTED])
        return n_running + min(waiting, max(int(self.limits[MAX_NUM_SEQS]) - n_running, 0))

    def schedule(self, k: int, held: np.ndarray = K_SLOTS) -> Batch:
        """Pick the next step's batch. A decoding request reserves `k` draft slots, or, when `held` is
        given (the valid drafts per request id), as many as it holds, at most k."""
        table, n_prefill, n_tokens = _schedule(self.state, self.running_ids, self.counts, held, k, self.limits)
        return Batch(table, table.shape[1], n_prefill, n_tokens, k)

    def settle(self, batch: Batch) -> np.ndarray:
        """Process a step's output (its EMITTED row): advance the host's counts, return the ids that
        finished now (a view, valid until the next call)."""
        n_done = _settle(batch.table, self.state, self.running_ids, self.counts, self.finished)
        self.n_finished += n_done
        return self.finished[:n_done]


@njit
def _schedule(
    state: np.ndarray, running: np.ndarray, counts: np.ndarray, held: np.ndarray, k: int, limits: np.ndarray
) -> tuple[np.ndarray, int, int]:
    """The next batch as a table, its prefill chunks and its tokens; updates the host's state."""
    prompt_len, prompt_left, room = state[PROMPT_LEN], state[PROMPT_LEFT], state[ROOM]
    budget, max_num_seqs, chunked = limits[BUDGET], limits[MAX_NUM_SEQS], limits[CHUNKED] != 0
    n_running = counts[N_RUNNING]
    # at most every running request and the waiting ones max_num_seqs admits, each at least one token
    n_admissible = min(counts[N_ARRIVED] - counts[N_ADMITTED], max(max_num_seqs - n_running, 0))
    table = np.zeros((BATCH_ROWS, min(n_running + n_admissible, budget)), dtype=np.int64)
    size = used = n_prefill = 0
    # running requests in admission order while the budget lasts; a prefill may be cut to the budget left
    for j in range(n_running):
        rid = running[j]
        prefill = prompt_left[rid] > 0
        if prefill:
            tokens, slots = prompt_left[rid], 0
        elif room[rid] > 0:
            slots = k if len(held) == 0 else min(held[rid], k)
            tokens = 1 + slots
        else:
            continue
        if used + tokens > budget:
            if not (prefill and chunked and used < budget):
                break
            tokens = budget - used
        table[REQ, size] = rid
        table[TOKENS, size] = tokens
        table[SLOTS, size] = table[VERIFIED, size] = slots
        used += tokens
        if prefill:
            table[PREFILL, size] = 1
            table[START, size] = prompt_len[rid] - prompt_left[rid]
            prompt_left[rid] -= tokens
            n_prefill += 1
            if prompt_left[rid] == 0:
                table[COMPLETES, size] = 1
                counts[N_PREFILLING] -= 1
        size += 1
    # admit waiting requests FCFS
    while counts[N_ADMITTED] < counts[N_ARRIVED] and counts[N_RUNNING] < max_num_seqs and used < budget:
        rid = counts[N_ADMITTED]
        need = prompt_len[rid]
        chunk = min(need, budget - used)
        if chunk < need and not chunked:
            break
        # ids are admitted in ascending order, so appending keeps the running set in admission order
        running[counts[N_RUNNING]] = rid
        counts[N_ADMITTED] += 1
        counts[N_RUNNING] += 1
        prompt_left[rid] = need - chunk
        if chunk < need:
            counts[N_PREFILLING] += 1
        table[REQ, size] = rid
        table[TOKENS, size] = chunk
        table[PREFILL, size] = 1
        table[COMPLETES, size] = chunk == need
        used += chunk
        n_prefill += 1
        size += 1
    # every decode and every last prefill chunk will emit at least one token
    for i in range(size):
        if table[PREFILL, i] == 0 or table[COMPLETES, i] == 1:
            room[table[REQ, i]] -= 1
    return table[:, :size].copy(), n_prefill, used


@njit
def _trim(table: np.ndarray, held: np.ndarray, k: int) -> int:
    """Verified slots of decoding requests cut to min(held[request id], k); returns the change in tokens."""
    change = 0
    for i in range(table.shape[1]):
        if table[PREFILL, i] == 0:
            slots = min(held[table[REQ, i]], k)
            change += slots - table[SLOTS, i]
            table[VERIFIED, i] = slots
    return change


@njit
def _settle(table: np.ndarray, state: np.ndarray, running: np.ndarray, counts: np.ndarray, finished: np.ndarray) -> int:
    """Advance the host's counts by a step's output; write the ids that finished now to `finished`
    (in batch order), return how many there are."""
    left, room = state[LEFT], state[ROOM]
    n_done = 0
    for i in range(table.shape[1]):
        rid, emitted = table[REQ, i], table[EMITTED, i]
        emits = int(table[PREFILL, i] == 0 or table[COMPLETES, i] == 1)
        room[rid] += emits - emitted
        left[rid] -= emitted
        # finished now: no tokens left after this step's (one that finished earlier and sat in this
        # step emits nothing)
        if left[rid] == 0 and emitted > 0:
            finished[n_done] = rid
            n_done += 1
    if n_done:
        # a running request is one with output left: drop the finished ones, keeping the order
        n_running = 0
        for j in range(counts[N_RUNNING]):
            if left[running[j]] > 0:
                running[n_running] = running[j]
                n_running += 1
        counts[N_RUNNING] = n_running
    return n_done
