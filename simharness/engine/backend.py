"""Engine backends: what runs a launched step on the GPU stream and decides its outcome.

The SimPy model never knows which backend it drives (DESIGN.md). A backend owns the device-side
truth of every request (prompt tokens in the KV cache, committed output tokens) and answers two
questions: how many valid drafts the proposer holds for a request now (read by the host only at
a sync), and what a step does (tokens emitted, drafts accepted, wasted slots) and how long it
takes on the GPU.
"""

from __future__ import annotations

import numpy as np

from simharness.costmodel import CostModel


class ModelBackend:
    """`engine.backend: model`: outcomes from the acceptance model, durations from the cost model."""

    measured = False

    def __init__(self, requests, acceptance, cost: CostModel, k: int, rng: np.random.Generator):
        n = len(requests.prompt_len)
        self.prompt_len = requests.prompt_len
        self.output_len = requests.output_len
        self.max_position = np.maximum(self.output_len - 1, 1)  # last entry of a request in the tables
        self.acc = acceptance
        self.cost = cost
        self.k = k
        self.rng = rng
        self.prefilled = np.zeros(n, dtype=np.int64)
        self.committed = np.zeros(n, dtype=np.int64)

    def valid_drafts(self, r: np.ndarray) -> np.ndarray:
        """Valid drafts the proposer holds for requests `r` (0 for finished ones)."""
        if not self.k:
            return np.zeros(len(r), dtype=np.int64)
        committed = self.committed[r]
        return self.acc.valid_drafts(r, self._position(r, committed)) * (committed < self.output_len[r])

    def _position(self, r: np.ndarray, committed: np.ndarray) -> np.ndarray:
        # committed length, clamped into the acceptance tables (finished requests are masked)
        return np.minimum(np.maximum(committed, 1), self.max_position[r])

    def run_step(self, step) -> float:
        """Advance the device truth by one step, fill in its outcome, return its GPU seconds.

        `step.accepted`, `step.drafts_valid` and `step.wasted` are per decoding request
        (`batch.req[batch.decode]`); `step.emitted` is per request of the batch."""
        b = step.batch
        req, pre, dec = b.req, b.prefill, b.decode
        committed = self.committed[req]
        prompt = self.prompt_len[req]
        context = np.where(pre, self.prefilled[req], prompt + committed)
        emitted = b.completes_prefill.astype(np.int64)  # the last prefill chunk samples the first token
        query = b.tokens
        r = req[dec]
        if len(r) < len(req):
            self.prefilled[req[pre]] += b.tokens[pre]
        if len(r):
            slots = step.verified_slots[dec]
            if step.verified_slots is not b.draft_slots:  # trimmed: fewer slots than scheduled
                query = b.tokens.copy()
                query[dec] = 1 + slots
            rc = committed[dec]
            remaining = self.output_len[r] - rc  # 0 for a request that already finished
            live = remaining > 0
            # a request that finished in an earlier step but sits in this one wastes its slots
            wasted = (1 + slots) * ~live
            if step.valid is not None:
                valid = step.valid[dec]
                position = None
            else:
                position = self._position(r, rc)
                valid = self.acc.valid_drafts(r, position) * live if self.k else np.zeros(len(r), dtype=np.int64)
            n_drafts = np.minimum(valid, slots) * live
            acc = np.zeros(len(r), dtype=np.int64)
            if self.k and n_drafts.any():
                if position is None:
                    position = self._position(r, rc)
                acc = self.acc.accept(r, position, n_drafts, self.rng)
            emitted[dec] = np.minimum(acc + 1, remaining)
        else:
            acc = wasted = n_drafts = np.zeros(0, dtype=np.int64)
        self.committed[req] += emitted  # request ids are unique within a batch
        step.emitted, step.accepted, step.drafts_valid, step.wasted = emitted, acc, n_drafts, wasted
        return self.cost.gpu_step(query, context, prompt + committed + emitted)
