"""The n-gram proposer for one request in numpy (the policy is `kernels.ngram`'s): what the simulator's replay
acceptance model calls every simulated step, and the hil backend's host-side proposer. No torch: the sim level
imports it without paying for torch."""

import numpy as np

from simharness.kernels import TieBreak, check_ngram_args

# --------------------------------------------------------------------------------------------------
# numpy, one request: what the simulator's replay acceptance model calls every simulated step.
# --------------------------------------------------------------------------------------------------


def propose_ngram_row(
    history: np.ndarray, *, min_n: int, max_n: int, k: int, tie_break: TieBreak = "earliest"
) -> np.ndarray:
    """Valid drafts (length 0..k) for one request's committed tokens; a few vectorised passes, no Python scan."""
    check_ngram_args(min_n, max_n, k, tie_break)
    size = history.shape[0]
    if k == 0 or size <= min_n:
        return history[:0].copy()
    # Candidate window ends e <= size - 2 whose last token equals the last committed token (n = 1);
    # each pass keeps those that also match one more token to the left.
    ends = np.flatnonzero(history[:-1] == history[-1])
    best = ends if min_n == 1 else ends[:0]
    for n in range(2, max_n + 1):
        ends = ends[ends >= n - 1]
        if ends.size == 0:
            break
        ends = ends[history[ends - (n - 1)] == history[size - n]]
        if n >= min_n and ends.size:
            best = ends
    if best.size == 0:
        return history[:0].copy()
    end = best[0] if tie_break == "earliest" else best[-1]
    return history[end + 1 : end + 1 + k].copy()
