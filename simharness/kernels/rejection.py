"""Rejection sampler for n-gram drafts (one-hot q): readable torch reference and a fused Triton version.

Semantics (DESIGN.md "Kernels", vllm-notes §3): greedy rows (temperature 0) accept draft i while it
equals argmax(logits[i]) and emit that argmax at the first rejection; random rows accept draft x with
probability min(1, p_i(x)) where p = softmax(logits / T), and at the first rejection sample from p_i
with x removed (Leviathan et al. 2023 with q = one-hot). If every draft is accepted, a bonus token
comes from position num_drafts. A -1 draft is always rejected. Output [B, k+1] int64 padded with -1,
and num_emitted = accepted + 1.
"""

import torch
import triton
import triton.language as tl


def rejection_sample(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    temperature: torch.Tensor,
    *,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a batch of drafts: the fused Triton kernels on CUDA, the torch reference elsewhere."""
    impl = rejection_sample_triton if target_logits.is_cuda else rejection_sample_reference
    return impl(target_logits, draft_tokens, num_drafts, temperature, seed=seed)


def _assemble(
    draft_tokens: torch.Tensor, num_accepted: torch.Tensor, final_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output row: the accepted drafts, then the token at position num_accepted, then -1."""
    batch, k = draft_tokens.shape
    columns = torch.arange(k + 1, device=draft_tokens.device)
    padded_drafts = torch.cat([draft_tokens.long(), draft_tokens.new_full((batch, 1), -1).long()], dim=1)
    output = torch.where(columns < num_accepted[:, None], padded_drafts, -1)
    last = num_accepted[:, None]
    output.scatter_(1, last, final_tokens.gather(1, last))
    return output, (num_accepted + 1).to(torch.int32)


def rejection_sample_reference(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    temperature: torch.Tensor,
    *,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch over whole [B, k+1, V] tensors; randomness from a torch.Generator seeded with `seed`."""
    batch, k_plus_1, _ = target_logits.shape
    k = k_plus_1 - 1
    device = target_logits.device
    generator = torch.Generator(device=device).manual_seed(seed)
    logits = target_logits.float()
    greedy = (temperature == 0).to(device)[:, None]
    num_drafts = num_drafts.to(device)

    positions = torch.arange(k, device=device)
    is_draft = (positions[None, :] < num_drafts[:, None]) & (draft_tokens >= 0)
    drafts = draft_tokens.long().clamp(min=0)

    # Greedy rows: the target token is the argmax (lowest index on ties, like torch.argmax).
    argmax = logits.argmax(dim=-1)
    greedy_accept = is_draft & (drafts == argmax[:, :k])

    # Random rows: accept x with probability p(x) (q(x) = 1 for a one-hot draft).
    safe_temperature = torch.where(temperature == 0, 1.0, temperature).float().to(device)
    probs = torch.softmax(logits / safe_temperature[:, None, None], dim=-1)
    p_draft = probs[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
    uniform = torch.rand((batch, k), generator=generator, device=device)
    random_accept = is_draft & (uniform < p_draft)

    accept = torch.where(greedy, greedy_accept, random_accept)
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # leading run of accepted drafts

    # Recovery at a rejected draft samples from p with x removed; the bonus position samples from p.
    removed = torch.zeros_like(probs)
    removed[:, :k].scatter_(-1, drafts[..., None], is_draft[..., None].float())
    residual = probs * (1 - removed)
    # Exponential race: argmax(r / E), E ~ Exp(1), draws index j with probability r_j / sum(r).
    noise = torch.empty_like(residual).exponential_(generator=generator)
    sampled = (residual / noise).argmax(dim=-1)

    final_tokens = torch.where(greedy, argmax, sampled)
    return _assemble(draft_tokens, num_accepted, final_tokens)


# --------------------------------------------------------------------------------------------------
# Triton. Kernel 1, grid (row, vocab split): one pass over the row's logits for all k+1 positions at
# once ([columns, positions] tiles), keeping per position the max and argmax (greedy rows), or the max and
# sum of 2^x (x = logit * log2(e) / T) and the winner of an exponential race over p with the draft
# removed (random rows). Running values are kept per lane and reduced once at the end, so the loop body
# is elementwise. The race noise is shared by a row's positions: sound because only one position per row
# (the first rejection, or the bonus) is ever emitted, and it cuts the Philox work by k+1. Kernel 2, grid
# (row,): merges the splits, walks the accept chain and writes the output. Randomness is counter-based
# (Philox keyed by the seed, counters from (row, vocab column) and (row, position)), so the output is a
# function of the inputs and the seed, with no generator state.
# --------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["seed"])
def _rejection_stats_kernel(
    logits_ptr,
    logits_stride_b,
    logits_stride_k,
    drafts_ptr,
    num_drafts_ptr,
    temperature_ptr,
    max_ptr,
    sum_ptr,
    key_ptr,
    index_ptr,
    vocab,
    split_size,
    noise_per_row,
    seed,
    K: tl.constexpr,
    K_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    num_drafts = tl.load(num_drafts_ptr + row)
    temperature = tl.load(temperature_ptr + row)
    positions = tl.arange(0, K_BLOCK)
    # Positions after the bonus position are never emitted: their logits are not read.
    live = positions <= num_drafts
    drafts = tl.load(drafts_ptr + row * K + positions, mask=positions < num_drafts, other=-1)
    # Tiles are [columns, positions]: the vocab axis is the contiguous one, so the compiler spreads columns
    # over threads and keeps all positions of a column in one thread; per-column work (the race noise) is
    # then done once per column rather than once per thread holding one of its positions.
    ptrs = logits_ptr + row.to(tl.int64) * logits_stride_b + positions[None, :].to(tl.int64) * logits_stride_k
    lo = split * split_size
    hi = tl.minimum(lo + split_size, vocab)
    # Each block of BLOCK columns is read as four quarters of Q columns (four loads in flight, and one
    # Philox call gives four words per counter, one per quarter).
    Q: tl.constexpr = BLOCK // 4
    lanes = tl.arange(0, Q)

    lane_max = tl.full([Q, K_BLOCK], -float("inf"), dtype=tl.float32)
    lane_sum = tl.zeros([Q, K_BLOCK], dtype=tl.float32)
    lane_key = tl.full([Q, K_BLOCK], -float("inf"), dtype=tl.float32)
    lane_index = tl.zeros([Q, K_BLOCK], dtype=tl.int32)
    if temperature == 0:
        for start in range(lo, hi, BLOCK):
            for quarter in tl.static_range(4):
                columns = start + quarter * Q + lanes
                x = tl.load(ptrs + columns[:, None], mask=(columns < hi)[:, None] & live[None, :], other=-float("inf"))
                x = x.to(tl.float32)
                better = x > lane_max  # strict: each lane keeps its earliest column on ties
                lane_index = tl.where(better, columns[:, None], lane_index)
                lane_max = tl.where(better, x, lane_max)
        lane_key = lane_max
    else:
        # Base-2 units: x = logit * log2(e) / T, so p_j = 2^(x_j - log2 sum_i 2^x_i), and exp2 is one MUFU op.
        scale = 1.4426950408889634 / temperature
        lane_max = tl.full([Q, K_BLOCK], -3.0e38, dtype=tl.float32)  # finite: no inf - inf below
        lane_key = tl.zeros([Q, K_BLOCK], dtype=tl.float32)
        for start in range(lo, hi, BLOCK):
            w0, w1, w2, w3 = tl.randint4x(seed, row * noise_per_row + start // 4 + lanes)
            for quarter in tl.static_range(4):
                if quarter == 0:
                    word = w0
                elif quarter == 1:
                    word = w1
                elif quarter == 2:
                    word = w2
                else:
                    word = w3
                columns = start + quarter * Q + lanes
                x = tl.load(ptrs + columns[:, None], mask=(columns < hi)[:, None] & live[None, :], other=-float("inf"))
                x = x.to(tl.float32) * scale
                # Online sum of 2^(x - lane_max); the race keys below share the lane's reference.
                new_max = tl.maximum(lane_max, x)
                rescale = tl.exp2(lane_max - new_max)
                weight = tl.exp2(x - new_max)
                lane_sum = lane_sum * rescale + weight
                lane_key = lane_key * rescale
                lane_max = new_max
                # Exponential race: argmax_j p_j / E_j with E_j = -ln(u_j) ~ Exp(1) is a sample of p (one E per
                # column, shared by the positions). The draft itself is excluded at draft positions.
                uniform = ((word >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)  # in (0, 1)
                key = weight * (-1.0 / tl.log(uniform))[:, None]
                key = tl.where(columns[:, None] == drafts[None, :], 0.0, key)
                better = key > lane_key
                lane_index = tl.where(better, columns[:, None], lane_index)
                lane_key = tl.where(better, key, lane_key)
        lane_key = tl.log2(lane_key) + lane_max  # back to one scale for all lanes: log2(p_j / E_j) + const

    row_max = tl.max(lane_max, axis=0)
    safe_max = tl.where(row_max == -float("inf"), 0.0, row_max)
    row_sum = tl.sum(lane_sum * tl.exp2(lane_max - safe_max[None, :]), axis=0)
    # Greedy: the max logit and its lowest column. Random: the race winner.
    best_key = tl.max(lane_key, axis=0)
    best_index = tl.min(tl.where(lane_key == best_key[None, :], lane_index, vocab), axis=0)
    out = (row * tl.num_programs(1) + split) * K_BLOCK + positions
    tl.store(max_ptr + out, row_max)
    tl.store(sum_ptr + out, row_sum)
    tl.store(key_ptr + out, best_key)
    tl.store(index_ptr + out, best_index)


@triton.jit(do_not_specialize=["seed"])
def _rejection_walk_kernel(
    logits_ptr,
    logits_stride_b,
    logits_stride_k,
    drafts_ptr,
    num_drafts_ptr,
    temperature_ptr,
    max_ptr,
    sum_ptr,
    key_ptr,
    index_ptr,
    output_ptr,
    num_emitted_ptr,
    vocab,
    n_splits,
    accept_counter_base,
    seed,
    K: tl.constexpr,
    K_BLOCK: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    num_drafts = tl.load(num_drafts_ptr + row)
    temperature = tl.load(temperature_ptr + row)
    positions = tl.arange(0, K_BLOCK)
    is_draft = positions < num_drafts
    drafts = tl.load(drafts_ptr + row * K + positions, mask=is_draft, other=-1)
    has_token = is_draft & (drafts >= 0)

    # Merge the per-split partials: [K_BLOCK, SPLIT_BLOCK] tiles. The target token of a position is
    # the index of the best key (greedy: the max logit, whose lowest column wins ties, as torch.argmax).
    splits = tl.arange(0, SPLIT_BLOCK)
    partial = (row * n_splits + splits[None, :]) * K_BLOCK + positions[:, None]
    mask = (splits < n_splits)[None, :] & (positions <= num_drafts)[:, None]
    split_key = tl.load(key_ptr + partial, mask=mask, other=-float("inf"))
    split_index = tl.load(index_ptr + partial, mask=mask, other=0)
    best_key = tl.max(split_key, axis=1)
    token = tl.min(tl.where(split_key == best_key[:, None], split_index, vocab), axis=1)

    if temperature == 0:
        accept = has_token & (drafts == token)
    else:
        # Accept x with probability p(x) = 2^(x_x - log2 sum_j 2^x_j), x = logit * log2(e) / T as in kernel 1.
        scale = 1.4426950408889634 / temperature
        split_max = tl.load(max_ptr + partial, mask=mask, other=-float("inf"))
        split_sum = tl.load(sum_ptr + partial, mask=mask, other=0.0)
        global_max = tl.max(split_max, axis=1)
        safe_max = tl.where(global_max == -float("inf"), 0.0, global_max)
        log_norm = safe_max + tl.log2(tl.sum(split_sum * tl.exp2(split_max - safe_max[:, None]), axis=1))
        draft_logit = tl.load(
            logits_ptr + row.to(tl.int64) * logits_stride_b + positions.to(tl.int64) * logits_stride_k + drafts,
            mask=has_token,
            other=-float("inf"),
        ).to(tl.float32)
        p_draft = tl.exp2(draft_logit * scale - log_norm)
        word, _, _, _ = tl.randint4x(seed, accept_counter_base + row * K_BLOCK + positions)
        uniform = ((word >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)  # in (0, 1)
        accept = has_token & (uniform < p_draft)

    num_accepted = tl.min(tl.where(is_draft & ~accept, positions, num_drafts), axis=0)
    output = tl.where(positions < num_accepted, drafts, tl.where(positions == num_accepted, token, -1))
    tl.store(output_ptr + row * (K + 1) + positions, output.to(tl.int64), mask=positions <= K)
    tl.store(num_emitted_ptr + row, num_accepted + 1)


# Vocab columns per loop step (four quarters of 512), with 4 warps and ~2 programs per SM: the best
# setting for greedy and random rows, fp32 and bf16, in a sweep on an H100.
_BLOCK = 2048


def _num_splits(batch: int, vocab: int, device: torch.device) -> int:
    """Vocab splits per row: at small batch sizes, enough programs for ~2 per SM."""
    target_programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    return max(1, min(triton.cdiv(vocab, _BLOCK), triton.cdiv(target_programs, batch)))


def rejection_sample_triton(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    temperature: torch.Tensor,
    *,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused Triton version (CUDA, or CPU tensors under TRITON_INTERPRET=1): reads the logits once."""
    batch, k_plus_1, vocab = target_logits.shape
    k = k_plus_1 - 1
    device = target_logits.device
    output = torch.empty((batch, k_plus_1), dtype=torch.int64, device=device)
    num_emitted = torch.empty((batch,), dtype=torch.int32, device=device)
    if batch == 0:
        return output, num_emitted
    if target_logits.stride(2) != 1:
        target_logits = target_logits.contiguous()
    draft_tokens = draft_tokens.to(device=device, dtype=torch.int32).contiguous()
    num_drafts = num_drafts.to(device=device, dtype=torch.int32)
    temperature = temperature.to(device=device, dtype=torch.float32)

    n_splits = _num_splits(batch, vocab, device)
    split_size = triton.cdiv(triton.cdiv(vocab, n_splits), _BLOCK) * _BLOCK
    n_splits = triton.cdiv(vocab, split_size)
    k_block = triton.next_power_of_2(k_plus_1)
    partials = torch.empty((4, batch, n_splits, k_block), dtype=torch.float32, device=device)
    row_max, row_sum, best_key = partials[0], partials[1], partials[2]
    best_index = partials[3].view(torch.int32)
    # Philox counters: [0, batch * noise_per_row) for the race noise, then the accept uniforms.
    noise_per_row = triton.cdiv(vocab, _BLOCK) * (_BLOCK // 4)
    accept_counter_base = batch * noise_per_row
    if accept_counter_base + batch * k_block >= 2**31:
        raise ValueError(f"batch {batch} x vocab {vocab} exceeds the 31-bit Philox counter space")
    seed = seed % 2**63

    _rejection_stats_kernel[(batch, n_splits)](
        target_logits, target_logits.stride(0), target_logits.stride(1), draft_tokens, num_drafts, temperature,
        row_max, row_sum, best_key, best_index, vocab, split_size, noise_per_row, seed,
        K=k, K_BLOCK=k_block, BLOCK=_BLOCK, num_warps=4,
    )  # fmt: skip
    _rejection_walk_kernel[(batch,)](
        target_logits, target_logits.stride(0), target_logits.stride(1), draft_tokens, num_drafts, temperature,
        row_max, row_sum, best_key, best_index, output, num_emitted, vocab, n_splits, accept_counter_base,
        seed,
        K=k, K_BLOCK=k_block, SPLIT_BLOCK=triton.next_power_of_2(n_splits), num_warps=1,
    )  # fmt: skip
    return output, num_emitted
