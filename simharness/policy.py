"""The scheduling policy: who runs in the next step and with how many tokens (the host's view).

Mirrors vLLM V1's scheduler in the parts that shape step composition: running requests first in
admission order, then waiting requests FCFS while `max_num_seqs` and the token budget allow;
chunked prefill splits a prompt over steps. Under async scheduling the host does not know the
outcome of in-flight steps: a decoding request is scheduled with 1 + k placeholder slots, its
progress is advanced optimistically and settled when the step's output is processed (vLLM
`AsyncScheduler`). A request is not scheduled once its in-flight steps, each emitting at least one
token, would already complete it (vLLM skips such requests the same way).

Request ids are assigned in arrival order and admission is FCFS, so "admission order" is simply
ascending id: the running set is `flatnonzero(status == RUNNING)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from simharness.scenario import Scheduler as SchedulerConfig

NOT_ARRIVED, WAITING, RUNNING, FINISHED = 0, 1, 2, 3


@dataclass
class Batch:
    """One scheduled step: per request, the tokens it computes and the draft slots it reserves.

    Arrays may be shared, read-only constants (an all-decode batch's flags): treat them as immutable."""

    req: np.ndarray  # request ids
    tokens: np.ndarray  # tokens scheduled (prefill chunk, or 1 + draft slots)
    prefill: np.ndarray  # bool: a prefill chunk
    completes_prefill: np.ndarray  # bool: the chunk ends the prompt, so the step emits a first token
    draft_slots: np.ndarray  # draft slots reserved (placeholders under async), 0 for prefill
    n_tokens: int  # tokens.sum()
    decode: np.ndarray  # bool: ~prefill
    emits: np.ndarray  # bool: the step emits a token for the request (decode or last prefill chunk)
    n_prefill: int  # prefill.sum()

    @property
    def size(self) -> int:
        return len(self.req)


def frozen(a: np.ndarray) -> np.ndarray:
    """`a`, made read-only so that batches and records can share it."""
    a.flags.writeable = False
    return a


def constant(cache: dict[tuple[int, int], np.ndarray], n: int, value: int, dtype: type) -> np.ndarray:
    """A read-only array of `n` copies of `value`, shared between batches."""
    a = cache.get((n, value))
    if a is None:
        a = cache[n, value] = frozen(np.full(n, value, dtype=dtype))
    return a


class BatchScheduler:
    """Host-side request bookkeeping and the per-step batching decision."""

    def __init__(self, cfg: SchedulerConfig, prompt_len: np.ndarray, output_len: np.ndarray):
        n = len(prompt_len)
        self.cfg = cfg
        self.prompt_len = prompt_len.astype(np.int64)
        self.output_len = output_len.astype(np.int64)
        self.status = np.full(n, NOT_ARRIVED, dtype=np.int8)
        self.prompt_left = self.prompt_len.copy()  # prompt tokens not scheduled yet
        self.left = self.output_len.copy()  # output tokens the host has not processed yet
        # left - (in-flight steps that will emit for the request): a decoding request is a
        # candidate while this is positive
        self.room = self.output_len.copy()
        self.n_arrived = 0
        self.n_admitted = 0
        self.n_finished = 0
        self.n_running = 0
        self.n_prefilling = 0  # running requests with prompt tokens left to schedule
        self._running = frozen(np.zeros(0, dtype=np.int64))  # running ids; batches share it
        self._ints: dict[tuple[int, int], np.ndarray] = {}
        self._flags: dict[tuple[int, int], np.ndarray] = {}

    def arrive(self, rid: int) -> None:
        assert rid == self.n_arrived, "requests arrive in id order"
        self.status[rid] = WAITING
        self.n_arrived += 1

    @property
    def committed(self) -> np.ndarray:
        """Output tokens the host has processed, per request."""
        return self.output_len - self.left

    def has_waiting(self) -> bool:
        return self.n_admitted < self.n_arrived

    def running(self) -> np.ndarray:
        """Running request ids in admission order."""
        return self._running

    def schedule(self, draft_slots: int | Callable[[np.ndarray], np.ndarray]) -> Batch:
        """Pick the next step's batch. `draft_slots` is the number of slots every decoding request
        reserves, or a function giving them for an array of decoding requests."""
        budget = self.cfg.max_num_batched_tokens
        running = self.running()
        room = self.room[running]
        if not self.n_prefilling:
            # every running request decodes: candidates are those with room, in order
            cand = running if not len(running) or np.minimum.reduce(room) > 0 else running[room > 0]
            n_cand = len(cand)
            if isinstance(draft_slots, int):
                # constant tokens per request: the cumulative sum fits the budget for the first n
                n_fit = min(n_cand, budget // (1 + draft_slots))
                slots = constant(self._ints, n_fit, draft_slots, np.int64)
                tok = constant(self._ints, n_fit, 1 + draft_slots, np.int64)
                used = n_fit * (1 + draft_slots)
            else:
                slots = draft_slots(cand)
                cum = np.cumsum(slots + 1)
                n_fit = int(cum.searchsorted(budget, side="right"))
                used = int(cum[n_fit - 1]) if n_fit else 0
                slots = slots[:n_fit]
                tok = slots + 1
            req = cand if n_fit == n_cand else cand[:n_fit]
            n_prefill = 0
            pre = completes = constant(self._flags, n_fit, False, bool)
        else:
            left = self.prompt_left[running]
            prefill = left > 0
            keep = prefill | (room > 0)
            cand, cand_prefill, left = running[keep], prefill[keep], left[keep]
            cand_decode = ~cand_prefill
            slots = np.zeros(len(cand), dtype=np.int64)
            if isinstance(draft_slots, int):
                slots[cand_decode] = draft_slots
            else:
                slots[cand_decode] = draft_slots(cand[cand_decode])
            tokens = np.where(cand_prefill, left, 1 + slots)
            # take requests in order while the budget lasts (tokens >= 1, so the cumsum is increasing);
            # a prefill may be cut to the budget left
            cum = np.cumsum(tokens)
            n_fit = int(cum.searchsorted(budget, side="right"))
            req, tok, pre, slots = cand[:n_fit], tokens[:n_fit], cand_prefill[:n_fit], slots[:n_fit]
            used = int(cum[n_fit - 1]) if n_fit else 0
            if n_fit < len(cand) and cand_prefill[n_fit] and self.cfg.chunked_prefill and used < budget:
                req = np.append(req, cand[n_fit])
                tok = np.append(tok, budget - used)
                pre = np.append(pre, True)
                slots = np.append(slots, 0)
                used = budget
            completes = np.zeros(len(req), dtype=bool)
            rp = req[pre]
            n_prefill = len(rp)
            if n_prefill:
                left = self.prompt_left[rp] - tok[pre]
                self.prompt_left[rp] = left
                completes[pre] = left == 0
                self.n_prefilling -= int(np.count_nonzero(completes))
        # admit waiting requests FCFS
        new_req, new_tok, new_completes = [], [], []
        while self.has_waiting() and self.n_running < self.cfg.max_num_seqs and used < budget:
            rid = self.n_admitted
            need = int(self.prompt_len[rid])
            chunk = min(need, budget - used)
            if chunk < need and not self.cfg.chunked_prefill:
                break
            self.status[rid] = RUNNING
            self.n_admitted += 1
            self.n_running += 1
            self.prompt_left[rid] = need - chunk
            self.n_prefilling += chunk < need
            new_req.append(rid)
            new_tok.append(chunk)
            new_completes.append(chunk == need)
            used += chunk
        if new_req:
            # ids are admitted in ascending order, so appending keeps the running set sorted
            self._running = frozen(np.concatenate((self._running, new_req)))
            m = len(new_req)
            req = np.concatenate((req, new_req))
            tok = np.concatenate((tok, new_tok))
            pre = np.concatenate((pre, [True] * m))
            slots = np.concatenate((slots, [0] * m))
            completes = np.concatenate((completes, new_completes))
            n_prefill += m
        if n_prefill:
            decode = ~pre
            emits = decode | completes
            self.room[req] -= emits  # request ids are unique within a batch
        else:
            decode = emits = constant(self._flags, len(req), True, bool)
            self.room[req] -= 1
        return Batch(req, tok, pre, completes, slots, used, decode, emits, n_prefill)

    def settle(self, batch: Batch, emitted: np.ndarray) -> np.ndarray:
        """Process a step's output (`emitted` is 0 where the batch does not emit): advance the host's
        counts, return the ids that finished now."""
        req = batch.req
        self.room[req] += batch.emits - emitted
        left = self.left[req] - emitted
        self.left[req] = left
        if np.minimum.reduce(left) > 0:
            return left[:0]
        # finished now: no tokens left after this step's (one that finished earlier and sat in
        # this step emits nothing)
        at_end = (left == 0).nonzero()[0]
        done = req[at_end[emitted[at_end] > 0]]
        if len(done):
            self.status[done] = FINISHED
            self.n_finished += len(done)
            self.n_running -= len(done)
            running = self._running
            self._running = frozen(running[self.status[running] == RUNNING])
        return done
