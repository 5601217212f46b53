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
        self.acc = acceptance
        self.cost = cost
        self.k = k
        self.rng = rng
        self.prefilled = np.zeros(n, dtype=np.int64)
        self.committed = np.zeros(n, dtype=np.int64)

    def live(self, r: np.ndarray) -> np.ndarray:
        """Requests that have not yet produced all their output tokens on the device."""
        return self.committed[r] < self.output_len[r]

    def valid_drafts(self, r: np.ndarray) -> np.ndarray:
        """Valid drafts the proposer holds for requests `r` (0 for finished ones)."""
        if not self.k:
            return np.zeros(len(r), dtype=np.int64)
        return self.acc.valid_drafts(r, self._position(r)) * self.live(r)

    def _position(self, r: np.ndarray) -> np.ndarray:
        # committed length, clamped into the acceptance tables (finished requests are masked)
        return np.clip(self.committed[r], 1, np.maximum(self.output_len[r] - 1, 1))

    def run_step(self, step) -> float:
        """Advance the device truth by one step, fill in its outcome, return its GPU seconds."""
        b = step.batch
        req = b.req
        emitted = np.zeros(len(req), dtype=np.int64)
        accepted = np.zeros(len(req), dtype=np.int64)
        drafts_valid = np.zeros(len(req), dtype=np.int64)
        wasted = np.zeros(len(req), dtype=np.int64)
        query = b.tokens.copy()
        context = np.where(b.prefill, self.prefilled[req], self.prompt_len[req] + self.committed[req])
        if b.prefill.any():
            self.prefilled[req[b.prefill]] += b.tokens[b.prefill]
            emitted[b.completes_prefill] = 1  # the last prefill chunk samples the first token
        dec = ~b.prefill
        if dec.any():
            r = req[dec]
            slots = step.verified_slots[dec]
            query[dec] = 1 + slots
            live = self.live(r)
            # a request that finished in an earlier step but sits in this one wastes its slots
            wasted[dec] = np.where(live, 0, 1 + slots)
            valid = step.valid[dec] if step.valid is not None else self.valid_drafts(r)
            n_drafts = np.minimum(valid, slots) * live
            acc = np.zeros(len(r), dtype=np.int64)
            if self.k and n_drafts.any():
                acc = self.acc.accept(r, self._position(r), n_drafts, self.rng)
            remaining = self.output_len[r] - self.committed[r]
            emitted[dec] = np.where(live, np.minimum(acc + 1, remaining), 0)
            accepted[dec] = acc
            drafts_valid[dec] = n_drafts
        emits = dec | b.completes_prefill
        self.committed[req[emits]] += emitted[emits]
        step.emitted, step.accepted, step.drafts_valid, step.wasted = emitted, accepted, drafts_valid, wasted
        return self.cost.gpu_step(query, context, self.prompt_len[req] + self.committed[req])
