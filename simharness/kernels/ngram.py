"""N-gram (prompt-lookup) draft proposer: plain-Python reference, vectorised torch, fused Triton, numpy row.

Policy (shared by every implementation, see docs/design.md "Kernels" and docs/vllm-notes.md "N-gram proposer"):
take the longest n in [min_n, max_n] such that the last n committed tokens (the suffix) also occur at an earlier
start p with at least one committed token after them (p + n <= seq_len - 1, which also excludes the suffix itself);
among the occurrences of that n pick the earliest (vLLM V1 GPU/CPU) or the most recent (vLLM MRV2 Triton); draft
the up-to-k committed tokens that follow it. Invalid slots hold -1 ("pad", V1) or the last committed token ("fill",
MRV2, which verifies them as ordinary drafts instead of trimming; -1 for an empty row).

The fast versions index candidates by the window's *end* e = p + n - 1: the drafts start at e + 1 for
every n, and the window of length n ending at e matches iff the window of length n - 1 ending at e
matches and token[e - n + 1] == token[seq_len - n]. So one pass over i = 0..max_n-1 gives every n.
"""

from typing import Literal

import numpy as np
import torch
import triton
import triton.language as tl

TieBreak = Literal["earliest", "latest"]
Invalid = Literal["pad", "fill"]


def _check_args(min_n: int, max_n: int, k: int, tie_break: str, invalid: str = "pad") -> None:
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if tie_break not in ("earliest", "latest"):
        raise ValueError(f"tie_break must be 'earliest' or 'latest', got {tie_break!r}")
    if invalid not in ("pad", "fill"):
        raise ValueError(f"invalid must be 'pad' or 'fill', got {invalid!r}")


def propose_ngram(
    token_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    min_n: int,
    max_n: int,
    k: int,
    tie_break: TieBreak = "earliest",
    invalid: Invalid = "pad",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts for a batch: the Triton kernel on CUDA, the vectorised torch version elsewhere."""
    impl = propose_ngram_triton if token_ids.is_cuda else propose_ngram_torch
    return impl(token_ids, seq_lens, min_n=min_n, max_n=max_n, k=k, tie_break=tie_break, invalid=invalid)


# --------------------------------------------------------------------------------------------------
# Reference: plain Python, one row at a time, obviously correct.
# --------------------------------------------------------------------------------------------------


def propose_ngram_reference(
    token_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    min_n: int,
    max_n: int,
    k: int,
    tie_break: TieBreak = "earliest",
    invalid: Invalid = "pad",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loops over rows, n from max_n down, and every start position; returns (drafts [B, k], num_valid [B])."""
    _check_args(min_n, max_n, k, tie_break, invalid)
    rows = token_ids.cpu().tolist()
    lens = seq_lens.cpu().tolist()
    all_drafts: list[list[int]] = []
    num_valid: list[int] = []
    for row, seq_len in zip(rows, lens, strict=True):
        tokens = row[:seq_len]
        found: list[int] = []
        for n in range(max_n, min_n - 1, -1):
            suffix = tokens[seq_len - n :] if seq_len >= n else None
            # p + n <= seq_len - 1: at least one committed token follows the occurrence.
            starts = [p for p in range(seq_len - n) if tokens[p : p + n] == suffix]
            if starts:
                p = starts[0] if tie_break == "earliest" else starts[-1]
                found = tokens[p + n : p + n + k]
                break
        fill = tokens[-1] if invalid == "fill" and seq_len > 0 else -1
        all_drafts.append(found + [fill] * (k - len(found)))
        num_valid.append(len(found))
    drafts = torch.tensor(all_drafts, dtype=token_ids.dtype).reshape(len(rows), k)
    return drafts.to(token_ids.device), torch.tensor(num_valid, dtype=torch.int32, device=token_ids.device)


# --------------------------------------------------------------------------------------------------
# Vectorised torch: any device, no host sync. O(B * L * max_n) over the padded width L.
# --------------------------------------------------------------------------------------------------


def propose_ngram_torch(
    token_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    min_n: int,
    max_n: int,
    k: int,
    tie_break: TieBreak = "earliest",
    invalid: Invalid = "pad",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole-batch tensor ops over the padded width (like vLLM V1's torch.compile kernel): no .item(), no masks."""
    _check_args(min_n, max_n, k, tie_break, invalid)
    batch, width = token_ids.shape
    device = token_ids.device
    seq_lens = seq_lens.to(device=device, dtype=torch.int64)
    ends = torch.arange(width, device=device)
    # match[b, e]: the window ending at e equals the suffix on its last n tokens (n grows each pass).
    # A committed token must follow the window (e <= seq_len - 2).
    match = ends[None, :] <= (seq_lens[:, None] - 2)
    best_end = torch.full((batch,), -1, dtype=torch.int64, device=device)
    for n in range(1, min(max_n, width) + 1):
        i = n - 1
        suffix_token = token_ids.gather(1, (seq_lens - n).clamp(min=0)[:, None])
        shifted_equal = torch.zeros_like(match)
        shifted_equal[:, i:] = token_ids[:, : width - i] == suffix_token  # token[e - i] == token[len - n]
        match &= shifted_equal
        if n < min_n:
            continue
        if tie_break == "earliest":
            end = torch.where(match, ends, width).amin(dim=1)
            found = end < width
        else:
            end = torch.where(match, ends, -1).amax(dim=1)
            found = end >= 0
        best_end = torch.where(found, end, best_end)  # a longer n overrides a shorter one

    positions = best_end[:, None] + 1 + torch.arange(k, device=device)
    valid = (best_end[:, None] >= 0) & (positions < seq_lens[:, None])
    tokens = token_ids.gather(1, positions.clamp(max=width - 1))
    if invalid == "fill":
        last = token_ids.gather(1, (seq_lens - 1).clamp(min=0)[:, None])
        fill = torch.where(seq_lens[:, None] > 0, last, -1)
    else:
        fill = torch.full_like(tokens[:, :1], -1)
    drafts = torch.where(valid, tokens, fill)
    return drafts, valid.sum(dim=1, dtype=torch.int32)


# --------------------------------------------------------------------------------------------------
# Triton: scan kernel over (row, block of end positions) + per-row finalize. Blocks past a row's
# seq_len exit at once, so the work scales with the real lengths, not the padded width (as vLLM MRV2).
# --------------------------------------------------------------------------------------------------


@triton.jit
def _ngram_scan_kernel(
    tokens_ptr,
    tokens_stride,
    seq_lens_ptr,
    best_ptr,
    n_blocks,
    width,
    MIN_N: tl.constexpr,
    MAX_N: tl.constexpr,
    EARLIEST: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    block = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + row).to(tl.int32)
    start = block * BLOCK
    if start > seq_len - 2:  # no window ending here has a committed token after it
        return
    row_ptr = tokens_ptr + row.to(tl.int64) * tokens_stride
    ends = start + tl.arange(0, BLOCK)
    alive = ends <= seq_len - 2
    length = tl.zeros([BLOCK], dtype=tl.int32)
    for i in tl.static_range(MAX_N):
        alive = alive & (ends >= i)
        token = tl.load(row_ptr + ends - i, mask=alive, other=0)
        suffix_token = tl.load(row_ptr + seq_len - 1 - i, mask=seq_len - 1 - i >= 0, other=0)
        alive = alive & (token == suffix_token)
        length += alive.to(tl.int32)
    # One int64 score orders by (n, position): a single max picks the longest n, then the tie-break.
    position_rank = width - ends if EARLIEST else ends + 1
    score = length.to(tl.int64) * (width + 1) + position_rank
    score = tl.where(length >= MIN_N, score, 0)
    tl.store(best_ptr + row * n_blocks + block, tl.max(score, axis=0))


@triton.jit
def _ngram_finalize_kernel(
    tokens_ptr,
    tokens_stride,
    seq_lens_ptr,
    best_ptr,
    n_blocks,
    drafts_ptr,
    num_valid_ptr,
    width,
    k,
    EARLIEST: tl.constexpr,
    FILL: tl.constexpr,
    BLOCK: tl.constexpr,
    REDUCE_BLOCK: tl.constexpr,
    K_BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    seq_len = tl.load(seq_lens_ptr + row).to(tl.int32)
    row_ptr = tokens_ptr + row.to(tl.int64) * tokens_stride
    live_blocks = (seq_len + BLOCK - 2) // BLOCK  # the scan blocks that did not exit early
    best = tl.zeros([REDUCE_BLOCK], dtype=tl.int64)
    for b0 in range(0, live_blocks, REDUCE_BLOCK):
        offs = b0 + tl.arange(0, REDUCE_BLOCK)
        best = tl.maximum(best, tl.load(best_ptr + row * n_blocks + offs, mask=offs < live_blocks, other=0))
    score = tl.max(best, axis=0)
    position_rank = score % (width + 1)
    end = width - position_rank if EARLIEST else position_rank - 1
    end = tl.where(score > 0, end, seq_len)  # no match: every draft position is past seq_len
    slots = tl.arange(0, K_BLOCK)
    positions = end + 1 + slots
    valid = (slots < k) & (positions < seq_len)
    drafts = tl.load(row_ptr + positions, mask=valid, other=0)
    fill = tl.load(row_ptr + seq_len - 1, mask=seq_len > 0, other=-1) if FILL else -1
    drafts = tl.where(valid, drafts, fill)
    tl.store(drafts_ptr + row * k + slots, drafts, mask=slots < k)
    tl.store(num_valid_ptr + row, tl.sum(valid.to(tl.int32), axis=0))


def propose_ngram_triton(
    token_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    min_n: int,
    max_n: int,
    k: int,
    tie_break: TieBreak = "earliest",
    invalid: Invalid = "pad",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused Triton version (CUDA, or CPU tensors under TRITON_INTERPRET=1); work follows the real seq_lens."""
    _check_args(min_n, max_n, k, tie_break, invalid)
    batch, width = token_ids.shape
    device = token_ids.device
    drafts = torch.empty((batch, k), dtype=token_ids.dtype, device=device)
    num_valid = torch.zeros((batch,), dtype=torch.int32, device=device)
    if batch == 0 or k == 0 or width == 0:
        return drafts, num_valid
    if token_ids.stride(1) != 1:
        token_ids = token_ids.contiguous()
    seq_lens = seq_lens.to(device=device, dtype=torch.int32)
    block = min(1024, max(16, triton.next_power_of_2(width)))
    n_blocks = triton.cdiv(width, block)
    best = torch.empty((batch, n_blocks), dtype=torch.int64, device=device)
    earliest = tie_break == "earliest"
    _ngram_scan_kernel[(batch, n_blocks)](
        token_ids, token_ids.stride(0), seq_lens, best, n_blocks, width,
        MIN_N=min_n, MAX_N=max_n, EARLIEST=earliest, BLOCK=block, num_warps=4,
    )  # fmt: skip
    _ngram_finalize_kernel[(batch,)](
        token_ids, token_ids.stride(0), seq_lens, best, n_blocks, drafts, num_valid, width, k,
        EARLIEST=earliest, FILL=invalid == "fill", BLOCK=block,
        REDUCE_BLOCK=min(128, triton.next_power_of_2(n_blocks)), K_BLOCK=triton.next_power_of_2(k),
        num_warps=1,
    )  # fmt: skip
    return drafts, num_valid


# --------------------------------------------------------------------------------------------------
# numpy, one request: what the simulator's replay acceptance model calls every simulated step.
# --------------------------------------------------------------------------------------------------


def propose_ngram_row(
    history: np.ndarray, *, min_n: int, max_n: int, k: int, tie_break: TieBreak = "earliest"
) -> np.ndarray:
    """Valid drafts (length 0..k) for one request's committed tokens; a few vectorised passes, no Python scan."""
    _check_args(min_n, max_n, k, tie_break)
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
