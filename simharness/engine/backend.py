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
from simharness.policy import constant

_sum, _min, _max = np.add.reduce, np.minimum.reduce, np.maximum.reduce  # without ndarray method dispatch


class ModelBackend:
    """`engine.backend: model`: outcomes from the acceptance model, durations from the cost model."""

    measured = False

    def __init__(self, requests, acceptance, cost: CostModel, k: int, rng: np.random.Generator):
        n = len(requests.prompt_len)
        self.prompt_len = requests.prompt_len
        self.output_len = requests.output_len
        self.max_position = np.maximum(self.output_len - 1, 1)  # last entry of a request in the tables
        self.acc = acceptance
        self.uniform_drafts = acceptance.uniform_drafts if k else 0
        self.cost = cost
        self.k = k
        self.rng = rng
        self.prefilled = np.zeros(n, dtype=np.int64)
        # the device truth: committed output tokens, kept as a decoding request's context
        # (prompt_len + committed), which ends at prompt_len + output_len
        self.context = self.prompt_len.astype(np.int64)
        self.end = self.context + self.output_len
        self._zeros: dict[tuple[int, int], np.ndarray] = {}

    def valid_drafts(self, r: np.ndarray) -> np.ndarray:
        """Valid drafts the proposer holds for requests `r` (0 for finished ones)."""
        if not self.k:
            return np.zeros(len(r), dtype=np.int64)
        ctx = self.context[r]
        live = ctx < self.end[r]
        if self.uniform_drafts is not None:
            return self.uniform_drafts * live
        return self.acc.valid_drafts(r, self._position(r, ctx - self.prompt_len[r])) * live

    def _position(self, r: np.ndarray, committed: np.ndarray) -> np.ndarray:
        # committed length, clamped into the acceptance tables (finished requests are masked)
        return np.minimum(np.maximum(committed, 1), self.max_position[r])

    def run_step(self, step) -> float:
        """Advance the device truth by one step, fill in its outcome, return its GPU seconds.

        `step.accepted`, `step.drafts_valid` and `step.wasted` are per decoding request
        (`batch.req[batch.decode]`); `step.emitted` is per request of the batch."""
        b = step.batch
        req = b.req
        # GPU time needs batch totals, all integers: query tokens, KV tokens after the step, twice the
        # attention pairs (query * (2 * context + query + 1)) and the history the proposer scans.
        tokens = kv_tokens = pairs2 = history = 0
        if b.n_prefill:
            # prefill rows are few (the requests admitted this step): one at a time
            rows = b.prefill.nonzero()[0]
            for i in rows.tolist():
                rid, t = int(req[i]), int(b.tokens[i])
                c = int(self.prefilled[rid])  # a chunk's context is the prompt prefilled before it
                self.prefilled[rid] = c + t
                tokens += t
                kv_tokens += c + t
                pairs2 += t * (2 * c + t + 1)
                if b.completes_prefill[i]:  # the last prefill chunk samples the first token
                    self.context[rid] += 1
                history += int(self.context[rid])
            emitted = b.completes_prefill.astype(np.int64)
            n_decode = len(req) - b.n_prefill
            # admitted requests come last: then the decode rows are a prefix
            dec = slice(0, n_decode) if not n_decode or rows[0] == n_decode else b.decode
            r = req[dec]
            slots = step.verified_slots[dec]
            n_slots = int(_sum(slots))
        else:
            r = req
            slots = step.verified_slots
            # untrimmed, a decode's tokens are 1 + its scheduled slots
            n_slots = b.n_tokens - len(r) if slots is b.draft_slots else int(_sum(slots))
        if len(r):
            # decode rows: query 1 + slots over context prompt + committed
            ctx = self.context[r]
            remaining = self.end[r] - ctx
            acc, n_drafts, wasted = self._decode(step, r, slots, n_slots, ctx, remaining)
            em = np.minimum(acc + 1, remaining)
            self.context[r] = ctx + em
            n, ctx_sum = len(r), int(_sum(ctx))
            tokens += n + n_slots
            kv_tokens += ctx_sum + n + n_slots
            # sum of (1 + s) * (2 * c + 2 + s) = 2 * sum(c) + 2 * (s . c) + 2n + 3 * sum(s) + s . s, where
            # slots never exceed k: if they sum to n * k, every one is k
            if n_slots == n * self.k:
                sc, ss = self.k * ctx_sum, n_slots * self.k
            else:
                sc, ss = int(np.dot(slots, ctx)), int(np.dot(slots, slots))
            pairs2 += 2 * (ctx_sum + sc) + 2 * n + 3 * n_slots + ss
            if self.cost.ngram_gpu:
                history += ctx_sum + int(_sum(em))
            if b.n_prefill:
                emitted[dec] = em
            else:
                emitted = em
        else:
            acc = wasted = n_drafts = np.zeros(0, dtype=np.int64)
        step.emitted, step.accepted, step.drafts_valid, step.wasted = emitted, acc, n_drafts, wasted
        return self.cost.gpu_time(tokens, kv_tokens, pairs2, history if self.cost.ngram_gpu else 0)

    def _decode(
        self, step, r: np.ndarray, slots: np.ndarray, n_slots: int, ctx: np.ndarray, remaining: np.ndarray
    ) -> tuple[np.ndarray, ...]:
        """Accepted drafts, verified valid drafts and wasted slots of decoding requests `r`."""
        if _min(remaining) > 0:
            live = None
            wasted = constant(self._zeros, len(r), 0, np.int64)
        else:
            # a request that finished in an earlier step but sits in this one wastes its slots
            live = remaining > 0
            wasted = (1 + slots) * ~live
        position = None
        if self.uniform_drafts is None:
            # a decoding request has committed its first token; a live one is inside its table row
            committed = ctx - self.prompt_len[r]
            position = committed if live is None else self._position(r, committed)
        if step.valid is not None:
            valid = step.valid[step.batch.decode] if step.batch.n_prefill else step.valid
        elif self.uniform_drafts is not None:
            valid = self.uniform_drafts
        else:
            valid = self.acc.valid_drafts(r, position)
        if live is None:
            # slots never exceed k, so with k drafts held every slot carries a valid draft
            n_drafts = slots if isinstance(valid, int) and valid >= self.k else np.minimum(valid, slots)
        else:
            n_drafts = np.minimum(valid, slots) * live
        if self.k and (n_slots if n_drafts is slots else _max(n_drafts)) > 0:
            acc = self.acc.accept(r, position, n_drafts, self.rng)
        else:
            acc = np.zeros(len(r), dtype=np.int64)
        return acc, n_drafts, wasted
