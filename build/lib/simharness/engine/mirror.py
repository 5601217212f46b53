"""The host's mirror of the device truth per request, as of the last read-back step that held it: committed
tokens and their history, the valid drafts held for the next step, the CPU proposer's drafts. vLLM's engine
updates its requests from each step's outputs the same way; it is all the host may use at a sync.
"""

from __future__ import annotations

import numpy as np

from simharness.jit import njit
from simharness.kernels import NO_DRAFT
from simharness.kernels.ngram_row import propose_ngram_row
from simharness.policy import ACCEPTED, COMPLETES, DRAFTS_VALID, EMITTED, PREFILL, REQ, VERIFIED, WASTED
from simharness.workload import Requests

# Rows of the mirror, one table (a compiled call costs per argument): committed output tokens, valid drafts held
# for the next step (0 once no tokens are left), output and prompt lengths.
HOST_COMMITTED, HOST_VALID, HOST_OUTPUT_LEN, HOST_PROMPT_LEN = range(4)


class HostMirror:
    """Per request id: `committed`, `next_valid`, `output_len`, `prompt_len` (views of one table's rows), the
    prompt + generated tokens (`history`, as wide as the request's cache positions) and the CPU proposer's
    `drafts`. `valid_from_mirror` (fill: k slots verified, fillers among them): a step's valid drafts are the
    device proposer's count as of the previous read-back step, not the device's count of verified drafts."""

    def __init__(self, requests: Requests, positions: int, k: int, *, valid_from_mirror: bool):
        n = len(requests.prompt_len)
        self.k, self.valid_from_mirror = k, valid_from_mirror
        self.table = np.zeros((4, n), dtype=np.int64)
        self.table[HOST_OUTPUT_LEN], self.table[HOST_PROMPT_LEN] = requests.output_len, requests.prompt_len
        self.committed, self.next_valid = self.table[HOST_COMMITTED], self.table[HOST_VALID]
        self.output_len, self.prompt_len = self.table[HOST_OUTPUT_LEN], self.table[HOST_PROMPT_LEN]
        self.history = np.zeros((n, positions), dtype=np.int64)
        self.drafts = np.full((n, max(k, 1)), NO_DRAFT, dtype=np.int64)

    def positions(self, rids: np.ndarray) -> np.ndarray:
        """Each request's committed length in its cache row (prompt + committed output tokens)."""
        return self.prompt_len[rids] + self.committed[rids]

    def first_tokens(self, rids: np.ndarray, tokens: np.ndarray, valid: np.ndarray) -> None:
        """Requests whose last prefill chunk was read back: their first token and the valid drafts it left."""
        self.history[rids, self.prompt_len[rids]] = tokens
        self.committed[rids] = 1
        self.next_valid[rids] = valid * (self.output_len[rids] > 1)

    def read_back(self, batch_table: np.ndarray, packed: np.ndarray) -> None:
        """A read-back decode step: its outcome into the batch table, its tokens into the mirror."""
        read_back(batch_table, packed, self.k, self.valid_from_mirror, self.table, self.history)

    def propose(self, rids: np.ndarray, ngram_args: dict) -> None:
        """The CPU n-gram proposer over each request's committed tokens."""
        k = self.k
        for rid in rids:
            drafts = propose_ngram_row(self.history[rid, : self.prompt_len[rid] + self.committed[rid]], **ngram_args)
            self.drafts[rid, :k] = NO_DRAFT
            self.drafts[rid, : len(drafts)] = drafts
            self.next_valid[rid] = len(drafts)


@njit
def read_back(
    table: np.ndarray, packed: np.ndarray, k: int, valid_from_mirror: bool, mirror: np.ndarray, history: np.ndarray
) -> None:
    """Fill a read-back step's outcome rows in its batch table and apply its tokens to the host's mirror.

    The device reports decoding requests in batch order (row i of `packed`, whose columns are `StepOutput`'s
    tokens, num_emitted, num_drafts and new_valid): request r emitted num_emitted[i] tokens, verified
    num_drafts[i] drafts (or, with `valid_from_mirror`, held next_valid[r] valid ones before this step) and now
    holds new_valid[i] (0 once it has no tokens left). A request that finished in an earlier step but sat in
    this one (no tokens left) emits and accepts nothing and wastes its 1 + slots positions. A prefill column
    emits its first token when its chunk is the last."""
    committed, next_valid = mirror[HOST_COMMITTED], mirror[HOST_VALID]
    output_len, prompt_len = mirror[HOST_OUTPUT_LEN], mirror[HOST_PROMPT_LEN]
    tokens, num_emitted = packed[:, : k + 1], packed[:, k + 1]
    num_drafts, new_valid = packed[:, k + 2], packed[:, k + 3]
    i = 0
    for c in range(table.shape[1]):
        if table[PREFILL, c]:
            table[EMITTED, c] = table[COMPLETES, c]
            continue
        rid = table[REQ, c]
        before = committed[rid]
        remaining = output_len[rid] - before
        e = num_emitted[i]
        if remaining > 0:
            valid = next_valid[rid] if valid_from_mirror else num_drafts[i]
            table[EMITTED, c] = min(e, remaining)
            table[ACCEPTED, c] = e - 1
            table[DRAFTS_VALID, c] = min(valid, table[VERIFIED, c])
        else:
            table[WASTED, c] = 1 + table[VERIFIED, c]
        start = prompt_len[rid] + before
        for j in range(e):
            history[rid, start + j] = tokens[i, j]
        committed[rid] = before + e
        next_valid[rid] = new_valid[i] if committed[rid] < output_len[rid] else 0
        i += 1
