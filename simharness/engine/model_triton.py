"""The target model's per-token ops as Triton kernels (the torch versions and their semantics are `engine.model`'s):
fused residual add + RMSNorm, q/k head norms, RoPE + KV write, RoPE + KV write + cached attention with its context
chunks merged in the kernel, a later prefill chunk's attention over its cached prefix, SiLU-mul. Imported only for a
model that runs them (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""

import torch
import triton
import triton.language as tl
from torch import Tensor

# --------------------------------------------------------------------------------------------------
# Per-token ops, Triton version (CUDA; also CPU tensors under TRITON_INTERPRET=1). Same signatures.
# --------------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, eps, DIM: tl.constexpr, BLOCK: tl.constexpr,
                     ADD_RESIDUAL: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < DIM
    x = tl.load(x_ptr + row * DIM + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        # Round the sum to the stream's dtype before normalising, exactly as `residual += x` does.
        x = (x + tl.load(res_ptr + row * DIM + cols, mask=mask, other=0.0).to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * DIM + cols, x, mask=mask)
        x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / DIM + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * DIM + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor:
    out = torch.empty_like(x)
    n_rows, dim = x.shape
    add = residual is not None
    _rms_norm_kernel[(n_rows,)](
        x, residual if add else x, weight, out, eps, DIM=dim, BLOCK=triton.next_power_of_2(dim),
        ADD_RESIDUAL=add, num_warps=4,
    )  # fmt: skip
    return out


@triton.jit
def _qk_norm_kernel(qkv_ptr, qw_ptr, kw_ptr, eps, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                    BLOCK_H: tl.constexpr):  # fmt: skip
    # One program per token: its q heads, then its k heads (contiguous in the qkv row), each normed over D.
    n = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, D)[None, :]
    mask = h < HQ + HKV
    ptrs = qkv_ptr + n * (HQ + 2 * HKV) * D + h * D + d
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.where(h < HQ, tl.load(qw_ptr + d).to(tl.float32), tl.load(kw_ptr + d).to(tl.float32))
    tl.store(ptrs, (x * rstd[:, None] * w).to(qkv_ptr.dtype.element_ty), mask=mask)


def qk_norm_triton(qkv: Tensor, q_weight: Tensor, k_weight: Tensor, n_heads: int, n_kv_heads: int, eps: float) -> None:
    head_dim = q_weight.shape[0]
    _qk_norm_kernel[(qkv.shape[0],)](
        qkv, q_weight, k_weight, eps, HQ=n_heads, HKV=n_kv_heads, D=head_dim,
        BLOCK_H=triton.next_power_of_2(n_heads + n_kv_heads), num_warps=4,
    )  # fmt: skip


@triton.jit
def _rope_write_kv_kernel(
    qkv_ptr, q_ptr, k_cache_ptr, v_cache_ptr, cos_ptr, sin_ptr, slots_ptr, start_ptr,
    n_tokens, max_pos, stride_slot, stride_pos,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    # One program per token: all its q heads (rotated, to q), k heads (rotated) and v heads (to the cache).
    n = tl.program_id(0)
    b = n // n_tokens
    slot = tl.load(slots_ptr + b)
    pos = tl.minimum(tl.load(start_ptr + b) + n % n_tokens, max_pos)
    D: tl.constexpr = 2 * HALF
    i = tl.arange(0, HALF)[None, :]
    h = tl.arange(0, BLOCK_H)[:, None]
    cos = tl.load(cos_ptr + pos * HALF + i)
    sin = tl.load(sin_ptr + pos * HALF + i)
    src = qkv_ptr + n * (HQ + 2 * HKV) * D + h * D + i

    is_q = h < HQ
    x1 = tl.load(src, mask=is_q, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=is_q, other=0.0).to(tl.float32)
    dst = q_ptr + n * HQ * D + h * D + i
    tl.store(dst, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty), mask=is_q)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty), mask=is_q)

    is_kv = h < HKV
    cache = slot * stride_slot + pos * stride_pos + h * D + i
    x1 = tl.load(src + HQ * D, mask=is_kv, other=0.0).to(tl.float32)
    x2 = tl.load(src + HQ * D + HALF, mask=is_kv, other=0.0).to(tl.float32)
    tl.store(k_cache_ptr + cache, (x1 * cos - x2 * sin).to(k_cache_ptr.dtype.element_ty), mask=is_kv)
    tl.store(k_cache_ptr + cache + HALF, (x2 * cos + x1 * sin).to(k_cache_ptr.dtype.element_ty), mask=is_kv)
    tl.store(v_cache_ptr + cache, tl.load(src + (HQ + HKV) * D, mask=is_kv, other=0.0), mask=is_kv)
    tl.store(v_cache_ptr + cache + HALF, tl.load(src + (HQ + HKV) * D + HALF, mask=is_kv, other=0.0), mask=is_kv)


def rope_write_kv_triton(
    qkv: Tensor, k_cache: Tensor, v_cache: Tensor, cos: Tensor, sin: Tensor,
    slots: Tensor, start_pos: Tensor, n_tokens: int, n_heads: int,
) -> Tensor:  # fmt: skip
    max_len, n_kv_heads, head_dim = k_cache.shape[1:]
    q = torch.empty(qkv.shape[0], n_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _rope_write_kv_kernel[(qkv.shape[0],)](
        qkv, q, k_cache, v_cache, cos, sin, slots, start_pos, n_tokens, max_len - 1,
        k_cache.stride(0), k_cache.stride(1),
        HQ=n_heads, HKV=n_kv_heads, HALF=head_dim // 2, BLOCK_H=triton.next_power_of_2(n_heads), num_warps=4,
    )  # fmt: skip
    return q


@triton.jit
def _rotated(ptr, rows, cos_ptr, sin_ptr, pos, mask, HALF: tl.constexpr):
    """RoPE of [R, 2 HALF] head vectors at ptr + rows (row offsets) for positions pos [R] (rotate-half pairing):
    each element takes its partner in the other half, so the result is one [R, D] block for tl.dot."""
    d = tl.arange(0, 2 * HALF)[None, :]
    partner = (d + HALF) % (2 * HALF)
    x = tl.load(ptr + rows[:, None] + d, mask=mask[:, None], other=0.0).to(tl.float32)
    x_partner = tl.load(ptr + rows[:, None] + partner, mask=mask[:, None], other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + pos[:, None] * HALF + d % HALF)
    sin = tl.load(sin_ptr + pos[:, None] * HALF + d % HALF)
    return x * cos + tl.where(d < HALF, -x_partner, x_partner) * sin


@triton.jit
def _attend_tile(q, k_cache_ptr, v_cache_ptr, kv_off, kv_ok, j, q_pos, sm_scale, m_i, l_i, acc):
    """One K/V tile (positions j, at kv_off in the caches) of FlashAttention's online softmax: q's causal scores
    against the tile's keys (positions past a query are masked), then the running max, sum and output updated. A
    row that sees no position yet keeps a max of -inf and adds nothing. V is loaded after the scores, as the
    kernels had it (its load overlaps the softmax)."""
    k = tl.load(k_cache_ptr + kv_off, mask=kv_ok, other=0.0)
    s = tl.dot(q, tl.trans(k)) * sm_scale
    s = tl.where(j[None, :] <= q_pos, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache_ptr + kv_off, mask=kv_ok, other=0.0)
    return m_new, l_i, acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _rope_attention_kernel(
    qkv_ptr, k_cache_ptr, v_cache_ptr, cos_ptr, sin_ptr, slots_ptr, start_ptr, out_ptr,
    acc_ptr, ml_ptr, counter_ptr,
    n_tokens, max_len, chunk_size, sm_scale, stride_slot, stride_pos,
    HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    # One program per (row, kv head, chunk of positions): its T x G query rows share every K/V tile (GQA). It
    # rotates q, and rotates and writes to the cache the step's k and v whose positions fall in its chunk (so it
    # alone reads them back). The context length is read on the device, so one launch (or graph) fits every
    # length; chunks past it exit at once. With several chunks, each leaves an unnormalised partial (acc, max,
    # sum), and the last to arrive merges them in position order and re-arms the counter. Tiles sit at fixed
    # positions and masked positions add exact zeros, so a query's result does not depend on where its step starts.
    D: tl.constexpr = 2 * HALF
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    chunk = tl.program_id(2)
    start = tl.load(start_ptr + b)
    n_ctx = tl.minimum(start + n_tokens, max_len)
    lo = chunk * chunk_size
    if lo >= n_ctx:
        return
    hi = tl.minimum(lo + chunk_size, n_ctx)
    slot = tl.load(slots_ptr + b)
    row_width = (HQ + 2 * HKV) * D
    kv_base = slot * stride_slot + kv_head * D
    d = tl.arange(0, D)[None, :]
    # Past max_len the caller's results are garbage, but writes stay inside the row's own slot.
    tn = tl.arange(0, BLOCK_T)
    new_pos = tl.minimum(start + tn, max_len - 1)
    mine = (tn < n_tokens) & (new_pos >= lo) & (new_pos < hi)
    new_rows = (b * n_tokens + tn) * row_width + (HQ + kv_head) * D
    new_k = _rotated(qkv_ptr, new_rows, cos_ptr, sin_ptr, new_pos, mine, HALF)
    new_v = tl.load(qkv_ptr + new_rows[:, None] + HKV * D + d, mask=mine[:, None])
    tl.store(k_cache_ptr + kv_base + new_pos[:, None] * stride_pos + d, new_k, mask=mine[:, None])
    tl.store(v_cache_ptr + kv_base + new_pos[:, None] * stride_pos + d, new_v, mask=mine[:, None])
    tl.debug_barrier()  # read back below by other threads of this program

    r = tl.arange(0, BLOCK_M)
    t = r // G
    row_ok = t < n_tokens
    q_rows = (b * n_tokens + t) * row_width + (kv_head * G + r % G) * D
    q = _rotated(qkv_ptr, q_rows, cos_ptr, sin_ptr, tl.minimum(start + t, max_len - 1), row_ok, HALF)
    q = q.to(k_cache_ptr.dtype.element_ty)
    q_pos = (start + t)[:, None]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for j0 in range(lo, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        kv_off = kv_base + j[:, None] * stride_pos + d
        kv_ok = (j < hi)[:, None]
        # Causal: positions past the query (this step's later tokens, stale rejected drafts) are masked; a row may
        # see no position in a chunk.
        m_i, l_i, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, kv_off, kv_ok, j, q_pos, sm_scale, m_i, l_i, acc)
    last_chunk = (n_ctx - 1) // chunk_size
    if last_chunk > 0:
        head = b * HKV + kv_head
        part = head * tl.num_programs(2) + chunk
        tl.store(acc_ptr + (part * BLOCK_M + r)[:, None] * D + d, acc)
        tl.store(ml_ptr + part * 2 * BLOCK_M + r, m_i)
        tl.store(ml_ptr + part * 2 * BLOCK_M + BLOCK_M + r, l_i)
        tl.debug_barrier()  # every thread's partial is written before the arrival is published
        if tl.atomic_add(counter_ptr + head, 1, sem="acq_rel") != last_chunk:
            return
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for c in range(0, last_chunk + 1):
            # .cg: read from L2, where the other programs' stores are (never a stale L1 line)
            other = head * tl.num_programs(2) + c
            m_c = tl.load(ml_ptr + other * 2 * BLOCK_M + r, cache_modifier=".cg")
            m_new = tl.maximum(m_i, m_c)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            scale_old = tl.exp(m_i - m_safe)
            scale_c = tl.exp(m_c - m_safe)
            l_c = tl.load(ml_ptr + other * 2 * BLOCK_M + BLOCK_M + r, cache_modifier=".cg")
            l_i = l_i * scale_old + l_c * scale_c
            acc_c = tl.load(acc_ptr + (other * BLOCK_M + r)[:, None] * D + d, cache_modifier=".cg")
            acc = acc * scale_old[:, None] + acc_c * scale_c[:, None]
            m_i = m_new
        tl.store(counter_ptr + head, 0)
    out_ptrs = out_ptr + ((b * n_tokens + t) * HQ + kv_head * G + r % G)[:, None] * D + d
    tl.store(out_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def attention_chunk_size(batch: int, n_kv_heads: int, max_len: int) -> int:
    """Positions per attention program. Fewer than 128 (row, kv head) programs leave most of the GPU idle
    (8 at B = 1), so small batches split the context into chunks (flash-decoding), more for fewer rows."""
    programs = batch * n_kv_heads
    return max_len if programs >= 128 else 128 * triton.next_power_of_2(triton.cdiv(programs, 16))


def rope_attention_triton(
    qkv: Tensor, k_cache: Tensor, v_cache: Tensor, cos: Tensor, sin: Tensor,
    slots: Tensor, start_pos: Tensor, n_tokens: int, n_heads: int, counters: Tensor,
) -> Tensor:  # fmt: skip
    batch, (max_len, n_kv_heads, head_dim) = slots.shape[0], k_cache.shape[1:]
    group = n_heads // n_kv_heads
    block_m = max(16, triton.next_power_of_2(n_tokens * group))
    chunk_size = attention_chunk_size(batch, n_kv_heads, max_len)
    n_chunks = triton.cdiv(max_len, chunk_size)
    if batch * n_kv_heads > counters.numel():
        raise ValueError(f"{batch * n_kv_heads} (row, kv head) pairs exceed the {counters.numel()} arrival counters")
    out = torch.empty(qkv.shape[0], n_heads * head_dim, dtype=qkv.dtype, device=qkv.device)
    parts = batch * n_kv_heads * n_chunks if n_chunks > 1 else 1
    acc = torch.empty(parts, block_m, head_dim, dtype=torch.float32, device=qkv.device)
    ml = torch.empty(parts, 2, block_m, dtype=torch.float32, device=qkv.device)
    _rope_attention_kernel[(batch, n_kv_heads, n_chunks)](
        qkv, k_cache, v_cache, cos, sin, slots, start_pos, out, acc, ml, counters,
        n_tokens, max_len, chunk_size, head_dim**-0.5, k_cache.stride(0), k_cache.stride(1),
        HQ=n_heads, HKV=n_kv_heads, G=group, HALF=head_dim // 2, BLOCK_M=block_m, BLOCK_N=64,
        BLOCK_T=triton.next_power_of_2(n_tokens),
    )  # fmt: skip
    return out


@triton.jit
def _prefix_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, start_ptr, out_ptr,
    n_tokens, max_len, sm_scale, stride_slot, stride_pos,
    HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # One program per (block of a chunk's queries, q head, row): FlashAttention over the row's cached prefix and the
    # chunk's own earlier tokens, reading keys only up to its last query's position (start + its last token), which
    # it reads on the device, so one graph per chunk size serves every prefix length.
    m_block = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)
    start = tl.load(start_ptr + b)
    slot = tl.load(slots_ptr + b)
    t = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)[None, :]
    row_ok = t < n_tokens
    q = tl.load(q_ptr + ((b * n_tokens + t) * HQ + head)[:, None] * D + d, mask=row_ok[:, None], other=0.0)
    q_pos = (start + t)[:, None]
    hi = tl.minimum(start + tl.minimum(n_tokens, (m_block + 1) * BLOCK_M), max_len)
    kv_base = slot * stride_slot + (head // G) * D
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for j0 in range(0, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        kv_off = kv_base + j[:, None] * stride_pos + d
        kv_ok = (j < hi)[:, None]
        # causal: position 0 is before every query, so every row's max is finite after the first tile
        m_i, l_i, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, kv_off, kv_ok, j, q_pos, sm_scale, m_i, l_i, acc)
    out_ptrs = out_ptr + ((b * n_tokens + t) * HQ + head)[:, None] * D + d
    tl.store(out_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def prefix_attention_triton(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, start_pos: Tensor, n_tokens: int
) -> Tensor:
    """`engine.model.verify_attention_torch` for long chunks (a later prefill chunk over its cached prefix): each
    query reads its row's keys up to its own position only, not the whole cache (the masked SDPA path reads and
    scores every cached position, docs/validation.md)."""
    batch, (max_len, n_kv_heads, head_dim) = slots.shape[0], k_cache.shape[1:]
    n_heads = q.shape[1]
    out = torch.empty(q.shape[0], n_heads * head_dim, dtype=q.dtype, device=q.device)
    block_m = 128 if n_tokens > 64 else 64
    _prefix_attention_kernel[(triton.cdiv(n_tokens, block_m), n_heads, batch)](
        q, k_cache, v_cache, slots, start_pos, out, n_tokens, max_len, head_dim**-0.5,
        k_cache.stride(0), k_cache.stride(1), HQ=n_heads, G=n_heads // n_kv_heads, D=head_dim,
        BLOCK_M=block_m, BLOCK_N=64, num_warps=8 if head_dim > 64 else 4, num_stages=3,
    )  # fmt: skip
    return out


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, FFN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < FFN
    gate = tl.load(gate_up_ptr + row * 2 * FFN + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * FFN + FFN + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * FFN + cols, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul_triton(gate_up: Tensor) -> Tensor:
    n_rows, ffn = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(n_rows, ffn, dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_kernel[(n_rows, triton.cdiv(ffn, 1024))](gate_up, out, FFN=ffn, BLOCK=1024, num_warps=4)
    return out
