"""The fused Triton rejection sampler (the semantics are `kernels.rejection`'s): imported only where it runs, on
CUDA, or on CPU tensors under TRITON_INTERPRET=1."""

import functools

import torch
import triton
import triton.language as tl

# --------------------------------------------------------------------------------------------------
# Triton. Kernel 1, a 1-D grid of (row, vocab tile) programs, a row's tiles consecutive (neighbouring programs read
# neighbouring memory: 2-3 points of copy bandwidth over a (row, tile) grid that ran rows fastest, H100,
# results/kernels/sampler-variants/NOTES.md): a program reads its BLOCK columns of the row's logits for every
# position <= num_drafts (all loads issued first, then one position after another; no padding of the k+1
# positions to a power of two) and leaves, per (tile, position), only the tile's max logit and, for random
# rows, the sum of 2^(x - max x) (x = logit * log2(e) / T) over the tile, with draft i left out of position
# i's max and sum. Per element that is a max, or a max and an exponential sum: no column index is carried
# through the reduction and no random number is drawn per element, which is what held an earlier
# per-element Gumbel race under the bandwidth goal (results/kernels/sampler-variants/NOTES.md).
# Kernel 2, grid (row,): merges the tiles, walks the accept chain, and finds the emitted tokens by reading
# one tile again: greedy rows the first tile holding the max, at every position (the argmax is its lowest
# column with the max, as torch.argmax); random rows, at the emitted position only, the tile where the
# running sum of the tiles' masses passes u times the residual's total, then the column where the
# running sum of that tile's terms passes the rest (an inverse-CDF sample). Randomness is per row, not per
# element: one Philox call keyed by the seed, counted from (row, position), gives the accept uniform of
# every position and the sample's uniform, so the output is a function of the inputs and the seed, with
# no generator state, and a row's does not depend on the batch around it. The seed is read from device
# memory, not passed as a kernel argument, so that a captured CUDA graph replays each step with its own seed
# (a graph bakes its arguments; `engine.decode` stages the seed).
# On Hopper and later the walk is a programmatic dependent launch (PDL): kernel 1's programs let it be scheduled
# as soon as all of them have started, and it loads what kernel 1 does not write (the row's scalars, drafts, the
# drafts' logits, its random words) before it waits for kernel 1's stores. That hides its launch and prologue
# under kernel 1's last wave: 1.4-4.1 us a call at every batch size and dtype (H100,
# results/kernels/sampler-variants/NOTES.md).
# --------------------------------------------------------------------------------------------------


@triton.jit
def _open_uniform(word):
    """A uint32 word to a float32 in the open interval (0, 1): (m + 1/2) / 2^23 with m its top 23 bits, exact (24 bits
    and a half step would round the top value to 1.0)."""
    return tl.fma((word >> 9).to(tl.float32), 1.0 / 8388608.0, 1.0 / 16777216.0)


@triton.jit
def _tile_stats(xs, drafts, columns, scale, out, num_drafts, max_ptr, sum_ptr, K: tl.constexpr,
                EXCLUDE_DRAFTS: tl.constexpr):  # fmt: skip
    """Random rows' per-position max and sum of 2^(x - max x) over one tile (see _rejection_tile_kernel).
    EXCLUDE_DRAFTS removes draft i from position i's; a tile that holds none of the row's drafts skips that
    per-element work."""
    inf: tl.constexpr = float("inf")
    for i in tl.static_range(K + 1):
        xf = xs[i].to(tl.float32)
        if EXCLUDE_DRAFTS and i < K:
            xf = tl.where(columns == drafts[i], -inf, xf)  # the walk kernel adds the draft's term back
        best = tl.max(xf, axis=0)
        reference = tl.where(best == -inf, 0.0, best * scale)
        tl.store(max_ptr + out + i, best, mask=num_drafts >= i)
        tl.store(sum_ptr + out + i, tl.sum(tl.exp2(tl.fma(xf, scale, -reference)), axis=0), mask=num_drafts >= i)


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
    vocab,
    n_tiles,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    GDC: tl.constexpr,
):
    if GDC:  # the walk may be scheduled once every program here has started: it waits for the stores itself
        tl.extra.cuda.gdc_launch_dependents()
    program = tl.program_id(0)
    row = program // n_tiles
    tile = program % n_tiles
    num_drafts = tl.load(num_drafts_ptr + row)
    temperature = tl.load(temperature_ptr + row)
    start = tile * BLOCK
    columns = start + tl.arange(0, BLOCK)
    ptrs = logits_ptr + row.to(tl.int64) * logits_stride_b + columns
    out = (row * n_tiles + tile) * (K + 1)
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
            tl.store(max_ptr + out + i, tl.max(xs[i].to(tl.float32), axis=0), mask=num_drafts >= i)
    else:
        # Base-2 units: x = logit * log2(e) / T, so p_j = 2^(x_j - log2 sum_i 2^x_i).
        scale = 1.4426950408889634 / temperature
        # At most K of a row's tiles hold a draft; the others skip the per-element exclusion.
        if holds_draft:
            _tile_stats(xs, drafts, columns, scale, out, num_drafts, max_ptr, sum_ptr, K=K, EXCLUDE_DRAFTS=True)
        else:
            _tile_stats(xs, drafts, columns, scale, out, num_drafts, max_ptr, sum_ptr, K=K, EXCLUDE_DRAFTS=False)


@triton.jit
def _greedy_targets(row_logits, tile_max, tiles, live, vocab, TILE_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    """Each position's argmax, the lowest column holding the max (torch.argmax's tie rule): it lies in the first
    tile whose max is the position's, whose BLOCK columns are read again ([positions, BLOCK])."""
    best = tl.max(tile_max, axis=1)
    first = tl.min(tl.where(tile_max == best[:, None], tiles[None, :], TILE_BLOCK), axis=1)
    columns = first[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    x = tl.load(row_logits + columns, mask=(columns < vocab) & live[:, None], other=-float("inf"))
    return tl.min(tl.where(x.to(tl.float32) == best[:, None], columns, vocab), axis=1)


@triton.jit
def _sample_residual(row_logits, tile_max, tile_sum, weight, tiles, emitted, excluded, scale, uniform, vocab,
                     BLOCK: tl.constexpr):  # fmt: skip
    """An inverse-CDF sample of the emitted position's residual (its draft excluded): the tile where the running
    sum of the tiles' weights passes u times their total, then the column where the running sum of that tile's
    terms, its BLOCK columns read again, passes the rest."""
    # The emitted position's row of the [positions, tiles] partials.
    weight = tl.sum(tl.where(emitted[:, None], weight, 0.0), axis=0)
    tile_sum = tl.sum(tl.where(emitted[:, None], tile_sum, 0.0), axis=0)
    tile_max = tl.max(tl.where(emitted[:, None], tile_max, -float("inf")), axis=0)
    below = tl.cumsum(weight, axis=0)
    target = uniform * tl.max(below, axis=0)
    # The first tile whose running sum passes the target; should rounding leave none, the last with any mass.
    last = tl.max(tl.where(weight > 0, tiles, 0), axis=0)
    tile = tl.min(tl.where(below > target, tiles, last), axis=0)
    here = tiles == tile
    before = tl.max(tl.where(tiles < tile, below, 0.0), axis=0)
    # The rest of the target in the units of kernel 1's sum for that tile (terms relative to the tile's max).
    fraction = (target - before) / tl.sum(tl.where(here, weight, 0.0), axis=0)
    rest = fraction * tl.sum(tl.where(here, tile_sum, 0.0), axis=0)
    reference = tl.max(tl.where(here, tile_max, -float("inf")), axis=0) * scale
    columns = tile * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(row_logits + columns, mask=columns < vocab, other=-float("inf")).to(tl.float32)
    terms = tl.exp2(tl.fma(tl.where(columns == excluded, -float("inf"), x), scale, -reference))
    token = tl.min(tl.where(tl.cumsum(terms, axis=0) > rest, columns, vocab), axis=0)
    # Should rounding leave the rest unpassed, the last column with any mass (never the excluded draft).
    return tl.where(token == vocab, tl.max(tl.where(terms > 0, columns, 0), axis=0), token)


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
    output_ptr,
    num_emitted_ptr,
    vocab,
    n_tiles,
    seed_ptr,
    K: tl.constexpr,
    K_BLOCK: tl.constexpr,
    TILE_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
    GDC: tl.constexpr,
):
    row = tl.program_id(0)
    num_drafts = tl.load(num_drafts_ptr + row)
    temperature = tl.load(temperature_ptr + row)
    positions = tl.arange(0, K_BLOCK)
    is_draft = positions < num_drafts
    live = positions <= num_drafts
    drafts = tl.load(drafts_ptr + row * K + positions, mask=is_draft, other=-1)
    has_token = is_draft & (drafts >= 0)
    row_logits = logits_ptr + row.to(tl.int64) * logits_stride_b + positions.to(tl.int64) * logits_stride_k

    # Kernel 1's partials: [K_BLOCK, TILE_BLOCK] tiles.
    tiles = tl.arange(0, TILE_BLOCK)
    partial = (row * n_tiles + tiles[None, :]) * (K + 1) + positions[:, None]
    mask = (tiles < n_tiles)[None, :] & live[:, None]

    if temperature == 0:
        if GDC:  # what follows reads kernel 1's partials
            tl.extra.cuda.gdc_wait()
        tile_max = tl.load(max_ptr + partial, mask=mask, other=-float("inf"))
        token = _greedy_targets(row_logits[:, None], tile_max, tiles, live, vocab, TILE_BLOCK=TILE_BLOCK, BLOCK=BLOCK)
        accept = has_token & (drafts == token)
        num_accepted = tl.min(tl.where(is_draft & ~accept, positions, num_drafts), axis=0)
    else:
        # Accept x with probability p(x) = 2^(x_x - log2 sum_j 2^x_j), x = logit * log2(e) / T as in kernel 1.
        scale = 1.4426950408889634 / temperature
        draft_x = tl.load(row_logits + drafts, mask=has_token, other=-float("inf")).to(tl.float32) * scale
        # Keyed by the seed with bit 0 flipped, counted from the row and position: word 0 is the position's
        # accept uniform, word 1 at the emitted position the sample's.
        word0, word1, _, _ = tl.randint4x(tl.load(seed_ptr) ^ 1, row * K_BLOCK + positions)
        if GDC:  # what follows reads kernel 1's partials
            tl.extra.cuda.gdc_wait()
        tile_max = tl.load(max_ptr + partial, mask=mask, other=-float("inf"))
        # Kernel 1 left, per tile and position, the max and the sum of 2^(x - max x) over the tile's columns
        # other than the draft: weighed here against one reference per position; the draft's own term is added.
        tile_sum = tl.load(sum_ptr + partial, mask=mask, other=0.0)
        tile_ref = tile_max * scale
        reference = tl.maximum(tl.max(tile_ref, axis=1), draft_x)
        reference = tl.where(reference == -float("inf"), 0.0, reference)
        weight = tile_sum * tl.exp2(tile_ref - reference[:, None])
        draft_weight = tl.exp2(draft_x - reference)
        p_draft = draft_weight / (tl.sum(weight, axis=1) + draft_weight)
        accept = has_token & (_open_uniform(word0) < p_draft)
        num_accepted = tl.min(tl.where(is_draft & ~accept, positions, num_drafts), axis=0)
        emitted = positions == num_accepted
        uniform = tl.sum(tl.where(emitted, _open_uniform(word1), 0.0), axis=0)
        excluded = tl.sum(tl.where(emitted, drafts, 0), axis=0)  # -1 (none) at the bonus and at a -1 draft
        emitted_logits = logits_ptr + row.to(tl.int64) * logits_stride_b + num_accepted.to(tl.int64) * logits_stride_k
        sampled = _sample_residual(emitted_logits, tile_max, tile_sum, weight, tiles, emitted, excluded, scale,
                                   uniform, vocab, BLOCK=BLOCK)  # fmt: skip
        token = tl.where(emitted, sampled, 0)

    output = tl.where(positions < num_accepted, drafts, tl.where(positions == num_accepted, token, -1))
    tl.store(output_ptr + row * (K + 1) + positions, output.to(tl.int64), mask=positions <= K)
    tl.store(num_emitted_ptr + row, num_accepted + 1)


# Kernel 1's (vocab columns per program, warps, register cap or None) by logits element size: the best at B=256,
# k=4, V=128256 in sweeps on an H100 (NOTES.md above; fp32's from an earlier kernel 1). One-warp programs reduce
# with shuffles alone (no shared-memory round trips). Another BLOCK moves the tiles, and so the order of the random
# rows' sums: their tokens may then differ where rounding decides.
_CONFIGS = {4: (2048, 4, 128), 2: (512, 1, None)}


@functools.cache
def _dependent_launch(device: torch.device) -> bool:
    """Whether the walk runs as a programmatic dependent launch: CUDA devices of compute capability 9.0 or later
    (not the interpreter's CPU tensors)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def rejection_sample_triton(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    temperature: torch.Tensor,
    *,
    seed: int | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused Triton version (CUDA, or CPU tensors under TRITON_INTERPRET=1): reads the logits once, and one tile
    of them again per position. `seed` is an int or a one-element int64 tensor on the logits' device (what a CUDA
    graph replays with a new value each step)."""
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
    partials = torch.empty((2, batch, n_tiles, k_plus_1), dtype=torch.float32, device=device)
    # Philox counters from the row and position: a row's randomness does not depend on the batch around it, so a
    # batch padded to a graph's bucket samples the same tokens.
    k_block = triton.next_power_of_2(k_plus_1)
    if batch * k_block >= 2**31:
        raise ValueError(f"batch {batch} x positions {k_block} exceeds the 31-bit Philox counter space")
    if isinstance(seed, int):  # fill_ takes the scalar as a kernel argument: no host-to-device copy, no sync
        seed = torch.empty(1, dtype=torch.int64, device=device).fill_(seed % 2**63)

    pdl = _dependent_launch(device)
    launch = {"launch_pdl": True} if pdl else {}
    _rejection_tile_kernel[(batch * n_tiles,)](
        target_logits, target_logits.stride(0), target_logits.stride(1), draft_tokens, num_drafts, temperature,
        partials[0], partials[1], vocab, n_tiles, K=k, BLOCK=block, GDC=pdl, num_warps=num_warps, maxnreg=maxnreg,
    )  # fmt: skip
    tile_block = triton.next_power_of_2(n_tiles)
    # About 32 elements a thread in the walk's largest block ([positions, tiles] or [positions, BLOCK] columns).
    walk_warps = min(8, max(1, k_block * max(tile_block, block) // 1024))
    _rejection_walk_kernel[(batch,)](
        target_logits, target_logits.stride(0), target_logits.stride(1), draft_tokens, num_drafts, temperature,
        partials[0], partials[1], output, num_emitted, vocab, n_tiles, seed,
        K=k, K_BLOCK=k_block, TILE_BLOCK=tile_block, BLOCK=block, GDC=pdl, num_warps=walk_warps, **launch,
    )  # fmt: skip
    return output, num_emitted
