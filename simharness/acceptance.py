"""Acceptance models: how many drafts a request has and how many of them the target accepts.

Lookups are per request `r` at committed length `j` (the number of its output tokens already
committed, >= 1 while decoding: the prefill step emits the first token).
- `iid(alpha)` and `positional(rates)`: k drafts every step; the accepted count is drawn so that
  P(accepted >= j) is alpha^j, or the product of the first j conditional rates (vLLM's synthetic
  rejection sampler, docs/vllm-notes.md "Rejection sampler").
- `replay`: greedy decoding of the request's reference output with the real n-gram proposer. Under
  greedy sampling a draft is accepted iff it equals the next reference token, so the drafts and the
  accepted count at each committed length depend only on the token stream, not on scheduling: they
  are computed once per request at build time and looked up. Where a decode verifies the proposer's
  fillers (`verifies_fillers`), the slots past the valid drafts hold the last token and are accepted
  as drafts are, while the reference repeats that token.
With proposer `none` or k = 0 there are no drafts.

The simulator's compiled step reads a model as four arrays (`AcceptanceModel`) through `held_drafts`
and `accepted_drafts`: `survival` for the drawn models, the replay tables for replay, the rest empty.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from simharness.jit import njit
from simharness.kernels import check_ngram_args
from simharness.scenario import Speculation
from simharness.workload import Requests

if TYPE_CHECKING:
    from simharness.kernels import TieBreak

NO_SURVIVAL = np.zeros(0, dtype=np.float64)
NO_TABLE = np.zeros(0, dtype=np.int64)


class AcceptanceModel(Protocol):
    survival: np.ndarray  # float64 [k]: drawn models (P(accepted >= j) = survival[j - 1]); empty for replay
    offset: np.ndarray  # int64 [N]: replay, where request r's entries start; empty for the drawn models
    valid: np.ndarray  # int64: replay, drafts held at entry offset[r] + j
    accepted: np.ndarray  # int64: replay, drafts accepted at entry offset[r] + j


@dataclass(frozen=True, eq=False)
class SurvivalAcceptance:
    """k drafts every step; accepted drafts follow a survival function: P(accepted >= j) = survival[j - 1].

    iid(alpha): survival[j - 1] = alpha^j (leading successes of i.i.d. Bernoulli(alpha) trials).
    positional(rates): survival[j - 1] = rates[0] * ... * rates[j - 1], rates[i] being the acceptance
    probability of draft i given drafts < i were accepted (0 past the list). vLLM's synthetic mode
    is configured with the unconditional rates (these products) and divides them back.
    """

    survival: np.ndarray  # float64 [k], non-increasing
    offset = valid = accepted = NO_TABLE


@dataclass(frozen=True, eq=False)
class ReplayAcceptance:
    """Tables over (request, committed length j): entry offset[r] + j, for j in [0, output_len[r])."""

    offset: np.ndarray  # int64 [N]
    valid: np.ndarray  # int64 [sum(output_len)]: drafts proposed from prompt + output[:j]
    accepted: np.ndarray  # int64 [sum(output_len)]: leading drafts (and fillers, `fill`) equal to output[j:]
    survival = NO_SURVIVAL


# The lookups are inlined into the model backend's per-row loops: a call that passes arrays costs numba
# reference counting per row, several times the lookup itself.
@njit(inline="always")
def held_drafts(survival: np.ndarray, offset: np.ndarray, valid: np.ndarray, r: int, j: int) -> int:
    """Drafts (0..k) the proposer holds for request r at committed length j."""
    if len(survival):
        return len(survival)
    return valid[offset[r] + j]


@njit(inline="always")
def accepted_drafts(
    survival: np.ndarray, offset: np.ndarray, accepted: np.ndarray, r: int, j: int, n_drafts: int, u: float
) -> int:
    """Accepted drafts (0..n_drafts) of a step that verifies `n_drafts` drafts of request r at committed length
    j (its valid drafts, or every slot where the fillers are verified too); `u` is a uniform draw in [0, 1), read
    by the drawn models only."""
    if len(survival):
        # Inverse CDF: accepted >= i iff u < survival[i - 1], which has probability survival[i - 1]
        # because survival is non-increasing.
        n = 0
        while n < n_drafts and u < survival[n]:
            n += 1
        return n
    # Greedy verification is deterministic.
    return min(accepted[offset[r] + j], n_drafts)


def verifies_fillers(cfg: Speculation) -> bool:
    """Whether a decode verifies all its slots with the proposer's fillers (the last token) past the valid drafts,
    as drafts: `fill` with the GPU proposer (MRV2); the CPU proposer's shorter draft lists are padded, never
    accepted, as the real level runs them (docs/design.md, "Invalid slots")."""
    return cfg.invalid_slots == "fill" and cfg.proposer == "ngram_gpu"


def make_acceptance(cfg: Speculation, requests: Requests) -> AcceptanceModel:
    """The acceptance model of one sweep point."""
    k = 0 if cfg.proposer == "none" else cfg.k
    model = cfg.acceptance
    if k == 0 or model.model == "replay":  # replay, or no drafts at all (all-zero tables)
        return build_replay(requests, k=k, min_n=cfg.min_n, max_n=cfg.max_n, tie_break=cfg.tie_break,
                            fill=verifies_fillers(cfg))
    if model.model == "iid":
        return SurvivalAcceptance(model.alpha ** np.arange(1, k + 1, dtype=np.float64))
    rates = np.zeros(k)  # positional
    given = np.asarray(model.rates[:k], dtype=np.float64)
    rates[: len(given)] = given
    return SurvivalAcceptance(np.cumprod(rates))


# Tables are built for the largest k the schema allows and clipped to each point's k: the proposer's
# match does not depend on k, so k drafts are the first k of the longest proposal, and a sweep over k
# (or over anything but the proposer's matching rules) reuses one build.
_TABLE_K = 16


def build_replay(requests: Requests, *, k: int, min_n: int, max_n: int, tie_break: TieBreak,
                 fill: bool = False) -> ReplayAcceptance:
    """Replay tables for draft length k (cached per requests object and matching rules); `fill`: the slots past
    the valid drafts hold the last token and are verified (`verifies_fillers`)."""
    if k == 0:
        none = np.zeros(int(requests.output_len.sum()), dtype=np.int64)
        return ReplayAcceptance(_offsets(requests), none, none)
    offset, valid, accepted = _replay_tables(requests, max(k, _TABLE_K), min_n, max_n, tie_break, fill)
    return ReplayAcceptance(offset, np.minimum(valid, k), np.minimum(accepted, k))


@functools.lru_cache(maxsize=4)
def _replay_tables(
    requests: Requests, k: int, min_n: int, max_n: int, tie_break: TieBreak, fill: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run the n-gram proposer at every committed length of every request's reference output.

    Every length, not only those on the greedy path (j -> j + accepted + 1), so that a scheduler
    that verifies fewer drafts than were proposed (vLLM trims drafts to the token budget) still
    finds its entry. One compiled pass per request (`_replay_request`, the proposer of
    `kernels.ngram_row.propose_ngram_row`, against which it is tested)."""
    check_ngram_args(min_n, max_n, k, tie_break)
    offset = _offsets(requests)
    valid = np.zeros(int(requests.output_len.sum()), dtype=np.int64)
    accepted = np.zeros_like(valid)
    for r, (prompt, output) in enumerate(zip(requests.prompt_tokens, requests.output_tokens, strict=True)):
        history = np.concatenate([prompt, output], dtype=np.int64)
        _replay_request(history, len(prompt), k, min_n, max_n, tie_break == "latest", fill, valid, accepted,
                        int(offset[r]))
    return offset, valid, accepted


@njit
def _replay_request(history: np.ndarray, p: int, k: int, min_n: int, max_n: int, latest: bool, fill: bool,
                    valid: np.ndarray, accepted: np.ndarray, base: int) -> None:
    """For each committed length j of one request (`history` = prompt + reference output, `p` prompt tokens):
    the n-gram proposer's drafts on history[:p + j] (the window ending at the last token that matches the
    longest suffix, at most max_n and at least min_n tokens; the earliest or `latest` such window), how many
    (valid[base + j]) and how many equal the reference's next tokens (accepted[base + j]). Under greedy
    decoding the target's token after prompt + output[:j + i] is output[j + i]; drafts past the end of the
    reference have nothing to match and count as rejected. With `fill`, the k slots past the valid drafts hold
    the last token, and once every valid draft is accepted each filler is, while the reference repeats it."""
    total = len(history)
    if k == 0:
        return
    for j in range(total - p):
        size = p + j
        drafts = same = 0
        if size > min_n:
            last = history[size - 1]
            best_n, best_end = 0, -1
            for end in range(size - 1):
                if history[end] != last:
                    continue
                n = 1
                while n < max_n and end - n >= 0 and history[end - n] == history[size - 1 - n]:
                    n += 1
                if n > best_n or (latest and n == best_n):
                    best_n, best_end = n, end
            if best_n >= min_n:
                drafts = min(k, size - best_end - 1)
                ref = min(drafts, total - size)
                while same < ref and history[best_end + 1 + same] == history[size + same]:
                    same += 1
        valid[base + j] = drafts
        if fill and size > 0 and same == drafts:  # the fillers: the last token (none before any token)
            while same < k and size + same < total and history[size + same] == history[size - 1]:
                same += 1
        accepted[base + j] = same


def _offsets(requests: Requests) -> np.ndarray:
    """Where each request's entries start in the flat tables (one entry per output position)."""
    return np.concatenate([[0], np.cumsum(requests.output_len)[:-1]]).astype(np.int64)
