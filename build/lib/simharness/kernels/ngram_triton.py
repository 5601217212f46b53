"""The fused Triton n-gram proposer (the policy is `kernels.ngram`'s): a scan kernel over (row, block of end
positions) and a per-row finalize. Imported only where it runs: CUDA, or CPU tensors under TRITON_INTERPRET=1."""

import torch
import triton
import triton.language as tl

from simharness.kernels import Invalid, TieBreak, check_ngram_args

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
    check_ngram_args(min_n, max_n, k, tie_break, invalid)
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
