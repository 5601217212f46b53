"""The fused Triton rejection sampler (the semantics are `kernels.rejection`'s): imported only where it runs, on
CUDA, or on CPU tensors under TRITON_INTERPRET=1."""

import torch
import triton
import triton.language as tl

# --------------------------------------------------------------------------------------------------
# Triton. Kernel 1, grid (row, vocab tile): a program reads its BLOCK columns of the row's logits for every
# position <= num_drafts (all loads issued first, then one position after another; no padding of the k+1
# positions to a power of two) and leaves, per (tile, position), the target token's key
# and column: greedy rows the max logit and its lowest column; random rows the winner of a Gumbel race
# over p with the draft removed, plus the max and sum of 2^x (x = logit * log2(e) / T) that normalise
# p(draft) at draft positions. The race noise is drawn once per (row, column) and shared by the row's
# positions: sound because only one position per row (the first rejection, or the bonus) is ever
# emitted, and it cuts the Philox work by k+1. Kernel 2, grid (row,): merges the tiles, walks the accept
# chain and writes the output. Randomness is counter-based (Philox keyed by the seed, counters from
# (row, vocab column) and (row, position), under two keys), so the output is a function of the inputs and the seed, with
# no generator state. The seed is read from device memory, not passed as a kernel argument, so that a captured
# CUDA graph replays each step with its own seed (a graph bakes its arguments; `engine.decode` stages the seed).
# --------------------------------------------------------------------------------------------------


@triton.jit
def _open_uniform(word):
    """A uint32 word to a float32 in the open interval (0, 1): (m + 1/2) / 2^23 with m its top 23 bits, exact (24 bits
    and a half step would round the top value to 1.0, whose log is 0)."""
    return tl.fma((word >> 9).to(tl.float32), 1.0 / 8388608.0, 1.0 / 16777216.0)


@triton.jit
def _log2(x, FAST: tl.constexpr):
    """log2 of positive normal floats: the MUFU approximation (absolute error 2^-22 on [0.5, 2], 2 ulp elsewhere)
    when FAST (compiled CUDA), else tl.log2 (an accurate software routine, and what Triton's interpreter runs)."""
    if FAST:
        return tl.inline_asm_elementwise(
            "lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return tl.log2(x)


@triton.jit
def _gumbel2(word, FAST: tl.constexpr):
    """Base-2 Gumbel noise up to a constant, -log2(-log2 u) = -log2(E) + log2(ln 2) with E = -ln(u) ~ Exp(1), from
    a uint32 word (the constant shifts every key of a race alike). -log2(u) is accurate where it is small (u near 1:
    the columns most likely to win a race): a series in w = 1 - u there, log2(u) elsewhere."""
    u = _open_uniform(word)
    w = 1.0 - u  # exact: u is a multiple of 2^-24
    # -log2(1 - w) = (w + w^2 / 2 + w^3 / 3 + ...) / ln 2, truncated: relative error < w^3 / 4
    series = w * (1.4426950408889634 + w * (0.7213475204444817 + w * 0.48089834696298783))
    return -_log2(tl.where(w < 0.0078125, series, -_log2(u, FAST)), FAST)


@triton.jit
def _race(xs, noise, drafts, columns, start, scale, out, num_drafts, max_ptr, sum_ptr, key_ptr, index_ptr,
          K: tl.constexpr, EXCLUDE_DRAFTS: tl.constexpr):  # fmt: skip
    """Random rows' per-position results for one tile (see _rejection_tile_kernel). EXCLUDE_DRAFTS removes draft i
    from position i's race and sum; a tile that holds none of the row's drafts skips that per-element work."""
    inf: tl.constexpr = float("inf")
    for i in tl.static_range(K + 1):
        xf = xs[i].to(tl.float32)
        if EXCLUDE_DRAFTS and i < K:
            # The draft is excluded from the race and from this sum (the walk kernel adds its term back).
            xf = tl.where(columns == drafts[i], -inf, xf)
        best, index = tl.max(xf + noise, axis=0, return_indices=True, return_indices_tie_break_left=False)
        tl.store(key_ptr + out + i, best, mask=num_drafts >= i)
        tl.store(index_ptr + out + i, start + index, mask=num_drafts >= i)
        if i < K:
            # The sum of 2^x relative to the best key (base-2 units): a column's term is at most 2^-(its noise)
            # <= 24 (-log2 u <= 24), so nothing overflows, and the best key's column keeps >= 2^-24.
            reference = tl.where(best == -inf, 0.0, best * scale)
            tl.store(max_ptr + out + i, reference, mask=num_drafts > i)
            tl.store(sum_ptr + out + i, tl.sum(tl.exp2(tl.fma(xf, scale, -reference)), axis=0), mask=num_drafts > i)


@triton.jit
def _rejection_tile_kernel(
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
    noise_per_row,
    seed_ptr,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    FAST_LOG: tl.constexpr,
):
    row = tl.program_id(0)
    tile = tl.program_id(1)
    num_drafts = tl.load(num_drafts_ptr + row)
    temperature = tl.load(temperature_ptr + row)
    start = tile * BLOCK
    columns = start + tl.arange(0, BLOCK)
    ptrs = logits_ptr + row.to(tl.int64) * logits_stride_b + columns
    out = (row * tl.num_programs(1) + tile) * (K + 1)
    # Every position's load is issued up front (the bytes in flight hide the memory latency). Positions
    # after the bonus position (num_drafts) are never emitted: their logits are not read (a limit, not
    # `in_vocab & live`: Triton's interpreter rejects a scalar & block mask).
    inf: tl.constexpr = float("inf")
    drafts = ()
    holds_draft = False
    for i in tl.static_range(K):
        draft = tl.where(num_drafts > i, tl.load(drafts_ptr + row * K + i).to(tl.int32), -1)
        drafts = drafts + (draft,)
        holds_draft = holds_draft | ((draft >= start) & (draft < start + BLOCK))
    xs = ()
    for i in tl.static_range(K + 1):
        xs = xs + (tl.load(ptrs + i * logits_stride_k, mask=columns < tl.where(num_drafts >= i, vocab, 0), other=-inf),)
    # Positions are processed without branches (results past num_drafts are computed but not stored), so the
    # compiler can interleave their independent reductions.
    if temperature == 0:
        for i in tl.static_range(K + 1):
            best, index = tl.max(xs[i].to(tl.float32), axis=0, return_indices=True, return_indices_tie_break_left=True)
            tl.store(key_ptr + out + i, best, mask=num_drafts >= i)
            tl.store(index_ptr + out + i, start + index, mask=num_drafts >= i)
    else:
        # Base-2 units: x = logit * log2(e) / T, so p_j = 2^(x_j - log2 sum_i 2^x_i).
        scale = 1.4426950408889634 / temperature
        # One Philox call gives four words: column c takes word c % 4 of the row's counter c // 4 (so the noise
        # does not depend on BLOCK).
        counters = row * noise_per_row + start // 4 + tl.arange(0, BLOCK // 4)
        w0, w1, w2, w3 = tl.randint4x(tl.load(seed_ptr), counters)
        words = tl.interleave(tl.interleave(w0, w2), tl.interleave(w1, w3))
        # Gumbel race: argmax_j (x_j + g_j), g_j base-2 Gumbel noise, is a sample of p. Keys stay in logit units
        # (logit + g / scale = logit + g T ln 2: the same order), one add per element.
        noise = _gumbel2(words, FAST_LOG) * (temperature * 0.6931471805599453)
        # At most K of a row's tiles hold a draft; the others run the race without the per-element exclusion.
        if holds_draft:
            _race(xs, noise, drafts, columns, start, scale, out, num_drafts, max_ptr, sum_ptr, key_ptr, index_ptr,
                  K=K, EXCLUDE_DRAFTS=True)  # fmt: skip
        else:
            _race(xs, noise, drafts, columns, start, scale, out, num_drafts, max_ptr, sum_ptr, key_ptr, index_ptr,
                  K=K, EXCLUDE_DRAFTS=False)  # fmt: skip


@triton.jit
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
    n_tiles,
    seed_ptr,
    K: tl.constexpr,
    K_BLOCK: tl.constexpr,
    TILE_BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    num_drafts = tl.load(num_drafts_ptr + row)
    temperature = tl.load(temperature_ptr + row)
    positions = tl.arange(0, K_BLOCK)
    is_draft = positions < num_drafts
    drafts = tl.load(drafts_ptr + row * K + positions, mask=is_draft, other=-1)
    has_token = is_draft & (drafts >= 0)

    # Merge the per-tile partials: [K_BLOCK, TILE_BLOCK] tiles. The target token of a position is
    # the index of the best key (greedy: the max logit, whose lowest column wins ties, as torch.argmax).
    tiles = tl.arange(0, TILE_BLOCK)
    partial = (row * n_tiles + tiles[None, :]) * (K + 1) + positions[:, None]
    mask = (tiles < n_tiles)[None, :] & (positions <= num_drafts)[:, None]
    tile_key = tl.load(key_ptr + partial, mask=mask, other=-float("inf"))
    tile_index = tl.load(index_ptr + partial, mask=mask, other=0)
    best_key = tl.max(tile_key, axis=1)
    token = tl.min(tl.where(tile_key == best_key[:, None], tile_index, vocab), axis=1)

    if temperature == 0:
        accept = has_token & (drafts == token)
    else:
        # Accept x with probability p(x) = 2^(x_x - log2 sum_j 2^x_j), x = logit * log2(e) / T as in kernel 1.
        scale = 1.4426950408889634 / temperature
        # Kernel 1 left, per tile and draft position, a reference and the sum of 2^(x - reference) over the
        # tile's columns other than the draft; the draft's own term is added here.
        draft_logit = tl.load(
            logits_ptr + row.to(tl.int64) * logits_stride_b + positions.to(tl.int64) * logits_stride_k + drafts,
            mask=has_token,
            other=-float("inf"),
        ).to(tl.float32)
        draft_x = draft_logit * scale
        stats_mask = mask & is_draft[:, None]
        tile_ref = tl.load(max_ptr + partial, mask=stats_mask, other=-float("inf"))
        tile_sum = tl.load(sum_ptr + partial, mask=stats_mask, other=0.0)
        global_ref = tl.maximum(tl.max(tile_ref, axis=1), draft_x)
        safe_ref = tl.where(global_ref == -float("inf"), 0.0, global_ref)
        total = tl.sum(tile_sum * tl.exp2(tile_ref - safe_ref[:, None]), axis=1) + tl.exp2(draft_x - safe_ref)
        p_draft = tl.exp2(draft_x - safe_ref - tl.log2(total))
        # Keyed by the seed with bit 0 flipped: a stream apart from the race noise's, counted from the row alone.
        word, _, _, _ = tl.randint4x(tl.load(seed_ptr) ^ 1, row * K_BLOCK + positions)
        accept = has_token & (_open_uniform(word) < p_draft)

    num_accepted = tl.min(tl.where(is_draft & ~accept, positions, num_drafts), axis=0)
    output = tl.where(positions < num_accepted, drafts, tl.where(positions == num_accepted, token, -1))
    tl.store(output_ptr + row * (K + 1) + positions, output.to(tl.int64), mask=positions <= K)
    tl.store(num_emitted_ptr + row, num_accepted + 1)


# Kernel 1's (vocab columns per program, warps, register cap) by logits element size: the best at B=256, k=4,
# V=128256 in a sweep on an H100. One-warp programs reduce with shuffles alone (no shared-memory round trips); a
# register cap that spills nothing raises the resident warps per SM.
_CONFIGS = {4: (2048, 4, 128), 2: (512, 1, 128)}


def rejection_sample_triton(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    temperature: torch.Tensor,
    *,
    seed: int | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused Triton version (CUDA, or CPU tensors under TRITON_INTERPRET=1): reads the logits once. `seed` is an int
    or a one-element int64 tensor on the logits' device (what a CUDA graph replays with a new value each step)."""
    batch, k_plus_1, vocab = target_logits.shape
    k = k_plus_1 - 1
    device = target_logits.device
    output = torch.empty((batch, k_plus_1), dtype=torch.int64, device=device)
    num_emitted = torch.empty((batch,), dtype=torch.int32, device=device)
    if batch == 0:
        return output, num_emitted
    if target_logits.stride(2) != 1:
        target_logits = target_logits.contiguous()
    # Integer inputs are read in their own dtype (int32 or int64): no conversion kernels before the sampler.
    draft_tokens = draft_tokens.to(device).contiguous()
    num_drafts = num_drafts.to(device).contiguous()
    temperature = temperature.to(device=device, dtype=torch.float32).contiguous()

    max_block, num_warps, maxnreg = _CONFIGS[target_logits.element_size()]
    block = max(16, min(max_block, triton.next_power_of_2(vocab)))
    n_tiles = triton.cdiv(vocab, block)
    partials = torch.empty((4, batch, n_tiles, k_plus_1), dtype=torch.float32, device=device)
    tile_max, tile_sum, best_key = partials[0], partials[1], partials[2]
    best_index = partials[3].view(torch.int32)
    # Philox counters from the row and column (the race noise) or position (the accept uniforms, another key): a
    # row's randomness does not depend on the batch around it, so a batch padded to a graph's bucket samples the
    # same tokens.
    noise_per_row = triton.cdiv(vocab, 4)
    k_block = triton.next_power_of_2(k_plus_1)
    if batch * max(noise_per_row, k_block) >= 2**31:
        raise ValueError(f"batch {batch} x vocab {vocab} exceeds the 31-bit Philox counter space")
    if isinstance(seed, int):  # fill_ takes the scalar as a kernel argument: no host-to-device copy, no sync
        seed = torch.empty(1, dtype=torch.int64, device=device).fill_(seed % 2**63)

    _rejection_tile_kernel[(batch, n_tiles)](
        target_logits, target_logits.stride(0), target_logits.stride(1), draft_tokens, num_drafts, temperature,
        tile_max, tile_sum, best_key, best_index, vocab, noise_per_row, seed,
        K=k, BLOCK=block, FAST_LOG=device.type == "cuda", num_warps=num_warps, maxnreg=maxnreg,
    )  # fmt: skip
    tile_block = triton.next_power_of_2(n_tiles)
    _rejection_walk_kernel[(batch,)](
        target_logits, target_logits.stride(0), target_logits.stride(1), draft_tokens, num_drafts, temperature,
        tile_max, tile_sum, best_key, best_index, output, num_emitted, vocab, n_tiles, seed,
        K=k, K_BLOCK=k_block, TILE_BLOCK=tile_block, num_warps=min(8, max(1, tile_block // 128)),
    )  # fmt: skip
    return output, num_emitted
