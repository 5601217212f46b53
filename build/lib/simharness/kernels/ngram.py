"""N-gram (prompt-lookup) draft proposer: plain-Python reference and vectorised torch (the numpy version for one
request is `kernels.ngram_row`, which the sim level imports without torch; the fused Triton version is
`kernels.ngram_triton`, imported only where it runs).

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

import torch

from simharness.kernels import Invalid, TieBreak, check_ngram_args


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
    if token_ids.is_cuda:
        from simharness.kernels.ngram_triton import propose_ngram_triton  # Triton: only where a GPU kernel runs

        return propose_ngram_triton(token_ids, seq_lens, min_n=min_n, max_n=max_n, k=k, tie_break=tie_break,
                                    invalid=invalid)
    return propose_ngram_torch(token_ids, seq_lens, min_n=min_n, max_n=max_n, k=k, tie_break=tie_break, invalid=invalid)


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
    check_ngram_args(min_n, max_n, k, tie_break, invalid)
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
    check_ngram_args(min_n, max_n, k, tie_break, invalid)
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
