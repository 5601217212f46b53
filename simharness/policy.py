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
    """One scheduled step: per request, the tokens it computes and the draft slots it reserves."""

    req: np.ndarray  # request ids
    tokens: np.ndarray  # tokens scheduled (prefill chunk, or 1 + draft slots)
    prefill: np.ndarray  # bool: a prefill chunk
    completes_prefill: np.ndarray  # bool: the chunk ends the prompt, so the step emits a first token
    draft_slots: np.ndarray  # draft slots reserved (placeholders under async), 0 for prefill
    n_tokens: int  # tokens.sum()
    decode: np.ndarray  # bool: ~prefill
    emits: np.ndarray  # bool: the step emits a token for the request (decode or last prefill chunk)

    @property
    def size(self) -> int:
        return len(self.req)


class BatchScheduler:
    """Host-side request bookkeeping and the per-step batching decision."""

    def __init__(self, cfg: SchedulerConfig, prompt_len: np.ndarray, output_len: np.ndarray):
        n = len(prompt_len)
        self.cfg = cfg
        self.prompt_len = prompt_len.astype(np.int64)
        self.output_len = output_len.astype(np.int64)
        self.status = np.full(n, NOT_ARRIVED, dtype=np.int8)
        self.prefill_scheduled = np.zeros(n, dtype=np.int64)  # prompt tokens scheduled so far
        self.committed = np.zeros(n, dtype=np.int64)  # output tokens the host has processed
        self.in_flight = np.zeros(n, dtype=np.int64)  # in-flight steps that will emit for the request
        self.n_arrived = 0
        self.n_admitted = 0
        self.n_finished = 0
        self.n_running = 0
        self._running: np.ndarray | None = None  # running ids, cached between admissions and finishes

    def arrive(self, rid: int) -> None:
        assert rid == self.n_arrived, "requests arrive in id order"
        self.status[rid] = WAITING
        self.n_arrived += 1

    def has_waiting(self) -> bool:
        return self.n_admitted < self.n_arrived

    def running(self) -> np.ndarray:
        """Running request ids in admission order."""
        if self._running is None:
            self._running = np.flatnonzero(self.status == RUNNING)
        return self._running

    def schedule(self, draft_slots: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Batch:
        """Pick the next step's batch; `draft_slots(req, decode)` gives the slots each request reserves
        (0 where `decode` is False)."""
        budget = self.cfg.max_num_batched_tokens
        running = self.running()
        left = self.prompt_len[running] - self.prefill_scheduled[running]
        prefill = left > 0
        # a decoding request is a candidate while its in-flight steps cannot already complete it
        keep = prefill | (self.committed[running] + self.in_flight[running] < self.output_len[running])
        cand, cand_prefill, left = running[keep], prefill[keep], left[keep]
        slots = draft_slots(cand, ~cand_prefill)
        tokens = np.where(cand_prefill, left, 1 + slots)
        # take requests in order while the budget lasts (tokens >= 1, so the cumsum is increasing);
        # a prefill may be cut to the budget left
        cum = np.cumsum(tokens)
        n_fit = int(np.searchsorted(cum, budget, side="right"))
        req, tok, pre, sl = cand[:n_fit], tokens[:n_fit], cand_prefill[:n_fit], slots[:n_fit]
        used = int(cum[n_fit - 1]) if n_fit else 0
        if n_fit < len(cand) and cand_prefill[n_fit] and self.cfg.chunked_prefill and used < budget:
            req = np.append(req, cand[n_fit])
            tok = np.append(tok, budget - used)
            pre = np.append(pre, True)
            sl = np.append(sl, 0)
            used = budget
        # admit waiting requests FCFS
        new_req, new_tok = [], []
        while self.has_waiting() and self.n_running < self.cfg.max_num_seqs and used < budget:
            rid = self.n_admitted
            need = int(self.prompt_len[rid])
            chunk = min(need, budget - used)
            if chunk < need and not self.cfg.chunked_prefill:
                break
            self.status[rid] = RUNNING
            self.n_admitted += 1
            self.n_running += 1
            new_req.append(rid)
            new_tok.append(chunk)
            used += chunk
        if new_req:
            self._running = None
            req = np.concatenate([req, np.array(new_req, dtype=np.int64)])
            tok = np.concatenate([tok, np.array(new_tok, dtype=np.int64)])
            pre = np.concatenate([pre, np.ones(len(new_req), dtype=bool)])
            sl = np.concatenate([sl, np.zeros(len(new_req), dtype=np.int64)])
        completes = np.zeros(len(req), dtype=bool)
        rp = req[pre]
        if len(rp):
            tp = tok[pre]
            completes[pre] = self.prefill_scheduled[rp] + tp == self.prompt_len[rp]
            self.prefill_scheduled[rp] += tp
        decode = ~pre
        emits = decode | completes
        self.in_flight[req] += emits  # request ids are unique within a batch
        return Batch(req, tok, pre, completes, sl, used, decode, emits)

    def settle(self, batch: Batch, emitted: np.ndarray) -> np.ndarray:
        """Process a step's output (`emitted` is 0 where the batch does not emit): advance the host's
        counts, return the ids that finished now."""
        req, emits = batch.req, batch.emits
        self.in_flight[req] -= emits
        self.committed[req] += emitted
        done = req[emits & (self.committed[req] >= self.output_len[req]) & (self.status[req] == RUNNING)]
        if len(done):
            self.status[done] = FINISHED
            self.n_finished += len(done)
            self.n_running -= len(done)
            self._running = None
        return done
