"""The decode loop's kernels: the n-gram proposer and the rejection sampler (reference, torch and Triton)."""

from typing import Literal

# "No token here": a draft slot without a draft, and the padding after a step's last emitted token.
NO_DRAFT = -1

# The n-gram proposer's matching rules, shared by its torch, numpy and Triton versions (kernels.ngram,
# kernels.ngram_triton): which occurrence wins a tie, and what fills the slots past the valid drafts.
TieBreak = Literal["earliest", "latest"]
Invalid = Literal["pad", "fill"]


def check_ngram_args(min_n: int, max_n: int, k: int, tie_break: str, invalid: str = "pad") -> None:
    """The n-gram proposer's arguments, checked once for every version."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if tie_break not in ("earliest", "latest"):
        raise ValueError(f"tie_break must be 'earliest' or 'latest', got {tie_break!r}")
    if invalid not in ("pad", "fill"):
        raise ValueError(f"invalid must be 'pad' or 'fill', got {invalid!r}")
