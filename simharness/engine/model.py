"""Llama-family target model with a static per-slot KV cache, for the real decode loop.

gpt-fast style: RMSNorm, RoPE (rotate-half pairing, as HF Llama; Llama 3's frequency scaling), grouped-query
attention, SwiGLU, tied or untied LM head; Qwen2's q/k/v biases and Qwen3's per-head q/k RMSNorm. Shapes come
from the catalogue (`simharness.models`); weights are random and seeded, or a checkpoint's
(`simharness.engine.checkpoint`). The cache is allocated once, `[layers, slots + 1, max_len (+ PREFILL_PAD with
CUDA graphs), kv_heads, head_dim]`; the extra slot is scratch for the padding rows of a CUDA-graph batch bucket,
the extra positions for the padding tokens of a prefill graph's token bucket.

`verify` runs T = 1 + k tokens per batch row, each row at its own slot and start position (tensors, so
nothing is read on the host). On CUDA the per-token ops are small Triton kernels (fused residual add +
RMSNorm; RoPE + KV write + cached attention, its context chunks merged in the same kernel; SiLU-mul) between
cuBLAS GEMMs (`engine.model_triton`, imported only there), so that a layer is eight launches and a captured
CUDA graph stays close to the weight-read floor; elsewhere the same ops run as plain torch.
"""

import dataclasses
import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from simharness.engine.buckets import batch_buckets, prefill_sizes
from simharness.models import MODELS, ModelConfig


def get_config(preset: str, n_layers: int | None = None) -> ModelConfig:
    """A catalogue model, optionally with fewer (or more) layers."""
    config = MODELS[preset]
    return config if n_layers is None else dataclasses.replace(config, n_layers=n_layers)


def model_sizes(
    config: ModelConfig, *, max_slots: int = 0, max_len: int = 0, dtype: torch.dtype = torch.bfloat16
) -> dict[str, int]:
    """Parameter count and bytes, the bytes a forward must read, and KV-cache bytes (per token, total)."""
    elem = dtype.itemsize
    kv_per_token = config.kv_per_token * elem
    return {
        "params": config.params,
        "param_bytes": config.params * elem,
        "weight_read_bytes": (config.params - config.untied_embedding) * elem,
        "kv_bytes_per_token": kv_per_token,
        "kv_cache_bytes": kv_per_token * (max_slots + 1) * max_len,
    }


def rope_frequencies(config: ModelConfig, device: torch.device | str) -> Tensor:
    """RoPE inverse frequencies [head_dim / 2] (float64), with Llama 3's scaling where the config has it: a
    frequency that turns many times over the original context is kept, one that turns few times is divided
    by `factor`, and those between are blended linearly in the number of turns."""
    c = config
    inv_freq = c.rope_theta ** -(torch.arange(0, c.head_dim, 2, device=device, dtype=torch.float64) / c.head_dim)
    s = c.rope_scaling
    if s is None:
        return inv_freq
    turns = s.original_max_position * inv_freq / (2 * math.pi)
    keep = ((turns - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)).clamp(0.0, 1.0)
    return inv_freq * keep + inv_freq / s.factor * (1.0 - keep)


# --------------------------------------------------------------------------------------------------
# Per-token ops, torch version: the CPU path and the oracle for the Triton kernels below.
# --------------------------------------------------------------------------------------------------


def rms_norm_torch(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor:
    """RMSNorm of x, or of `residual += x` (updated in place) when a residual stream is given."""
    if residual is not None:
        residual += x
        x = residual
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def qk_norm_torch(qkv: Tensor, q_weight: Tensor, k_weight: Tensor, n_heads: int, n_kv_heads: int, eps: float) -> None:
    """RMSNorm of each q and each k head of `qkv [N, (Hq + 2 Hkv) * D]` over its D values, in place (Qwen3)."""
    heads = qkv.view(qkv.shape[0], -1, q_weight.shape[0])
    q, k = heads[:, :n_heads], heads[:, n_heads : n_heads + n_kv_heads]
    q.copy_(rms_norm_torch(q, q_weight, eps))
    k.copy_(rms_norm_torch(k, k_weight, eps))


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rope_write_kv_torch(
    qkv: Tensor, k_cache: Tensor, v_cache: Tensor, cos: Tensor, sin: Tensor,
    slots: Tensor, start_pos: Tensor, n_tokens: int, n_heads: int,
) -> Tensor:  # fmt: skip
    """Rotate q and k of `qkv [B*T, (Hq + 2 Hkv) * D]`, write k and v to the cache; returns q [B*T, Hq, D]."""
    max_len, n_kv_heads, head_dim = k_cache.shape[1:]
    q, k, v = qkv.view(qkv.shape[0], -1, head_dim).split([n_heads, n_kv_heads, n_kv_heads], dim=1)
    arange = torch.arange(n_tokens, device=qkv.device)
    # Past max_len the caller's results are garbage, but writes stay inside the row's own slot.
    pos = (start_pos[:, None] + arange).clamp(max=max_len - 1).view(-1)
    rows = slots[:, None].expand(-1, n_tokens).reshape(-1)
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    k_cache[rows, pos] = _rotate(k, c, s)
    v_cache[rows, pos] = v
    return _rotate(q, c, s)


def verify_attention_torch(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, start_pos: Tensor, n_tokens: int,
    expand_heads: bool = False,
) -> Tensor:
    """Causal attention of q [B*T, Hq, D] over each row's cached positions <= its own; returns [B*T, Hq*D].
    `expand_heads` repeats the K/V heads up to Hq instead of asking SDPA for grouped-query attention: with a mask,
    SDPA runs grouped queries only on its math kernel, which materialises [B, Hq, T, L] fp32 scores (a later
    prefill chunk of 2,048 tokens over the cache: about 12x the chunk's roofline on the H100, docs/validation.md);
    expanded, the memory-efficient kernel takes the mask. Worth it for long chunks, not for a verify batch."""
    batch, (max_len, _, head_dim) = slots.shape[0], k_cache.shape[1:]
    n_heads = q.shape[1]
    q_pos = start_pos[:, None] + torch.arange(n_tokens, device=q.device)
    mask = torch.arange(max_len, device=q.device)[None, None, :] <= q_pos[:, :, None]  # [B, T, L]
    q = q.view(batch, n_tokens, n_heads, head_dim).transpose(1, 2)
    k, v = k_cache[slots].transpose(1, 2), v_cache[slots].transpose(1, 2)  # [B, Hkv, L, D]
    if expand_heads:
        groups = n_heads // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=not expand_heads)
    return out.transpose(1, 2).reshape(batch * n_tokens, n_heads * head_dim)


def rope_attention_torch(
    qkv: Tensor, k_cache: Tensor, v_cache: Tensor, cos: Tensor, sin: Tensor,
    slots: Tensor, start_pos: Tensor, n_tokens: int, n_heads: int, counters: Tensor,
) -> Tensor:  # fmt: skip
    """The verify step's attention from qkv: RoPE, the step's K/V into the cache, causal attention [B*T, Hq*D]."""
    q = rope_write_kv_torch(qkv, k_cache, v_cache, cos, sin, slots, start_pos, n_tokens, n_heads)
    return verify_attention_torch(q, k_cache, v_cache, slots, start_pos, n_tokens)


def silu_mul_torch(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class _Ops:
    rms_norm: Callable[..., Tensor]
    qk_norm: Callable[..., None]
    rope_write_kv: Callable[..., Tensor]  # prefill: RoPE and the K/V write, then the chunk's own attention
    rope_attention: Callable[..., Tensor]
    prefix_attention: Callable[..., Tensor]  # a later prefill chunk over its cached prefix
    silu_mul: Callable[[Tensor], Tensor]


TORCH_OPS = _Ops(rms_norm_torch, qk_norm_torch, rope_write_kv_torch, rope_attention_torch,
                 partial(verify_attention_torch, expand_heads=True), silu_mul_torch)


def triton_ops() -> _Ops:
    """The Triton versions of the per-token ops (`engine.model_triton`), imported only for a model that runs them,
    so that a CPU-only install without Triton runs the torch ones."""
    from simharness.engine import model_triton as t

    return _Ops(t.rms_norm_triton, t.qk_norm_triton, t.rope_write_kv_triton, t.rope_attention_triton,
                t.prefix_attention_triton, t.silu_mul_triton)


# --------------------------------------------------------------------------------------------------
# The model.
# --------------------------------------------------------------------------------------------------


class Block(nn.Module):
    """One decoder layer's weights; q/k/v and gate/up are fused into one matrix each (fewer launches). The
    q/k/v bias (Qwen2) and the q and k head norms (Qwen3) are None where the model has none."""

    def __init__(self, c: ModelConfig, normal: Callable[[int, int], Tensor], ones: Callable[[int], Tensor]):
        super().__init__()
        self.attn_norm = nn.Parameter(ones(c.dim), requires_grad=False)
        self.wqkv = nn.Parameter(normal(c.qkv_rows, c.dim), requires_grad=False)
        self.bqkv = nn.Parameter(normal(c.qkv_rows, 1, 0.1).view(-1), requires_grad=False) if c.qkv_bias else None
        self.q_norm = nn.Parameter(ones(c.head_dim), requires_grad=False) if c.qk_norm else None
        self.k_norm = nn.Parameter(ones(c.head_dim), requires_grad=False) if c.qk_norm else None
        self.wo = nn.Parameter(normal(c.dim, c.n_heads * c.head_dim), requires_grad=False)
        self.ffn_norm = nn.Parameter(ones(c.dim), requires_grad=False)
        self.w13 = nn.Parameter(normal(2 * c.ffn_dim, c.dim), requires_grad=False)  # gate rows, then up rows
        self.w2 = nn.Parameter(normal(c.dim, c.ffn_dim), requires_grad=False)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    tokens: Tensor
    slots: Tensor
    start_pos: Tensor
    logits: Tensor
    last: Tensor | None = None  # a prefill graph's index of the chunk's last real token


# A prefill graph pads its chunk with tokens whose K/V land past the chunk, in its own slot; the cache holds
# this many positions past max_len so that they never overwrite a real one.
PREFILL_PAD = 255


# The prefill's attention backends: not cuDNN, torch's first choice on an H100, which builds an execution graph for
# every new sequence length (about 70 ms of host time each on the H100, docs/hil.md), so that every prompt length
# not seen before stalls the step that prefills it. vLLM runs FlashAttention, which has no per-shape build.
PREFILL_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def capture_graph(forward: Callable[[], object], device: torch.device | str,
                  pool: object = None) -> tuple[torch.cuda.CUDAGraph, object]:
    """`forward` captured as a CUDA graph (into `pool`, a graph pool handle, or a pool of its own), and its output;
    warmed up first on a side stream (kernel compilation, cuBLAS handles), as capture requires."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # No cyclic garbage collection while capturing: collecting there may free another graph's CUDA objects
    # (graphs, events), which invalidates the capture.
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            output = forward()
    finally:
        if collecting:
            gc.enable()
    return graph, output


class Transformer(nn.Module):
    """Llama-family model with a static KV cache of `max_slots` slots x `max_len` positions.

    bf16 on CUDA, fp32 elsewhere. Weights are random, drawn from `seed`; with `seed=None` they are left
    uninitialised for a checkpoint to be copied in (`engine.checkpoint.load_checkpoint`). With `cuda_graphs`,
    `verify` replays a graph captured per batch-size bucket (and per T); the first verify with a new T captures
    all buckets (call `capture_graphs` to do it up front, since capture synchronises). A prefill chunk replays a
    graph captured per token bucket (`prefill_sizes`; `capture_prefill_graphs` captures them up front), so that
    its host cost is a few launches, not a few hundred eager ones: an eager 1B prefill took 5-10 ms of host time
    on the H100 for 2-3 ms of device work, and the host's speed moved runs by up to 40% (docs/hil.md).
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        max_slots: int,
        max_len: int,
        device: torch.device | str,
        seed: int | None = 0,
        cuda_graphs: bool = False,
        triton_kernels: bool | None = None,
    ):
        super().__init__()
        device = torch.device(device)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        if cuda_graphs and device.type != "cuda":
            raise ValueError("cuda_graphs needs a CUDA device")
        c = self.config = config
        self.max_slots, self.max_len, self.pad_slot = max_slots, max_len, max_slots
        self.cuda_graphs = cuda_graphs
        self.ops = triton_ops() if (device.type == "cuda" if triton_kernels is None else triton_kernels) else TORCH_OPS

        # Weights are drawn on the device itself (fast for 8B shapes), in a fixed order from one generator.
        # Scale 1/sqrt(fan_in) keeps activations O(1); with a tied head the logits are O(sqrt(dim)).
        gen = None if seed is None else torch.Generator(device=device).manual_seed(seed)

        def normal(rows: int, cols: int, std: float | None = None) -> Tensor:
            if gen is None:
                return torch.empty(rows, cols, device=device, dtype=dtype)
            w = torch.randn(rows, cols, generator=gen, device=device, dtype=dtype)
            return w.mul_(cols**-0.5 if std is None else std)

        def ones(n: int) -> Tensor:
            return torch.ones(n, device=device, dtype=dtype)

        self.tok_embeddings = nn.Parameter(normal(c.vocab_size, c.dim, 1.0), requires_grad=False)
        self.layers = nn.ModuleList(Block(c, normal, ones) for _ in range(c.n_layers))
        self.norm = nn.Parameter(ones(c.dim), requires_grad=False)
        self.output = (
            self.tok_embeddings if c.tie_embeddings else nn.Parameter(normal(c.vocab_size, c.dim), requires_grad=False)
        )

        # Zero-filled, not empty: the torch attention path multiplies masked positions by 0, and NaN * 0 = NaN.
        cache_len = max_len + (PREFILL_PAD if cuda_graphs else 0)
        cache_shape = (c.n_layers, max_slots + 1, cache_len, c.n_kv_heads, c.head_dim)
        self.k_cache = torch.zeros(cache_shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(cache_shape, device=device, dtype=dtype)
        angles = torch.arange(cache_len, device=device, dtype=torch.float64)[:, None] * rope_frequencies(c, device)
        self.cos, self.sin = angles.cos().float(), angles.sin().float()  # [cache_len, head_dim / 2]
        self.slot_ids = torch.arange(max_slots + 1, device=device)
        # Arrival counters of the attention kernel's chunk merge (one per (row, kv head) of a launch): zero between
        # launches, each launch leaves them zero.
        self.counters = torch.zeros((max_slots + 1) * config.n_kv_heads, dtype=torch.int32, device=device)
        self.batch_buckets = batch_buckets(max_slots)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._prefill_graphs: dict[tuple[int, bool], _Graph] = {}  # by token bucket, and fresh or a later chunk
        # the host's perf_counter when the last prefill's graph launch returned (None: it ran without a graph)
        self.prefill_launched: float | None = None
        # Shared by every graph of the model and of its decode loop's step graphs.
        self._graph_pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.load_stats: dict[str, float | str] | None = None  # a checkpoint's loading time and memory

    @property
    def device(self) -> torch.device:
        return self.k_cache.device

    def weight_bytes(self) -> int:
        """Bytes of weights a forward reads: every parameter once, less an untied embedding table
        (a gather touches only B x T of its rows). This over the copy bandwidth is the weight-read floor."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        untied = self.tok_embeddings.numel() * self.tok_embeddings.element_size()
        return total - (0 if self.config.tie_embeddings else untied)

    def _forward(self, tokens: Tensor, slots: Tensor, start_pos: Tensor, attention: str = "verify") -> Tensor:
        """Final normed hidden states [B*T, dim]; writes every layer's K/V for the tokens into the cache.
        `attention`: "verify" (the verify kernel, built for T = 1 + k), "prefix" (a later prefill chunk: attention
        over the cached prefix and the chunk's own earlier tokens, any T), "fresh" (one row at positions 0..T-1:
        causal attention over its own tokens only)."""
        c, ops = self.config, self.ops
        n_tokens = tokens.shape[1]
        residual = F.embedding(tokens.reshape(-1), self.tok_embeddings)
        x = ops.rms_norm(residual, self.layers[0].attn_norm, c.norm_eps)
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = self.k_cache[i], self.v_cache[i]
            qkv = F.linear(x, layer.wqkv, layer.bqkv)
            if c.qk_norm:
                ops.qk_norm(qkv, layer.q_norm, layer.k_norm, c.n_heads, c.n_kv_heads, c.norm_eps)
            if attention == "verify":
                attn = ops.rope_attention(
                    qkv, k_cache, v_cache, self.cos, self.sin, slots, start_pos, n_tokens, c.n_heads, self.counters
                )
            else:
                q = ops.rope_write_kv(qkv, k_cache, v_cache, self.cos, self.sin, slots, start_pos, n_tokens, c.n_heads)
                if attention == "prefix":
                    attn = ops.prefix_attention(q, k_cache, v_cache, slots, start_pos, n_tokens)
                else:  # a fresh sequence at positions 0..T-1 attends only to itself: plain causal SDPA
                    # index_select, not k_cache[slot]: the slot is a device tensor inside a prefill graph.
                    k = k_cache[:, :n_tokens].index_select(0, slots).transpose(1, 2)  # [1, Hkv, T, D]
                    v = v_cache[:, :n_tokens].index_select(0, slots).transpose(1, 2)
                    attn = F.scaled_dot_product_attention(
                        q.transpose(0, 1)[None], k, v, is_causal=True, enable_gqa=True
                    )
                    attn = attn[0].transpose(0, 1).reshape(n_tokens, -1)
            x = ops.rms_norm(F.linear(attn, layer.wo), layer.ffn_norm, c.norm_eps, residual)
            h = ops.silu_mul(F.linear(x, layer.w13))
            next_norm = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else self.norm
            x = ops.rms_norm(F.linear(h, layer.w2), next_norm, c.norm_eps, residual)
        return x

    def _logits(self, x: Tensor) -> Tensor:
        """fp32 logits; on CUDA straight out of the bf16 GEMM (no separate upcast pass over [N, V])."""
        if x.is_cuda and x.dtype != torch.float32:
            return torch.mm(x, self.output.t(), out_dtype=torch.float32)
        return F.linear(x, self.output).float()

    def prefill(self, slot: int, tokens: Tensor, start: int = 0) -> Tensor:
        """Write a prompt chunk's K/V at positions start..start+len-1 of `slot` (positions below `start`
        already cached); returns the chunk's last position's logits [V]."""
        if not 0 < tokens.shape[0] <= self.max_len - start:
            raise ValueError(f"prompt chunk of {tokens.shape[0]} tokens at {start} does not fit max_len {self.max_len}")
        self.prefill_launched = None
        if self.cuda_graphs:
            return self._replay_prefill(slot, tokens, start)
        slots = self.slot_ids[slot : slot + 1]
        with sdpa_kernel(PREFILL_SDPA):
            # A later chunk of a chunked prefill attends to the cached prefix too.
            x = self._forward(tokens[None], slots, torch.full_like(slots, start), "fresh" if start == 0 else "prefix")
        return self._logits(x[-1:])[0]

    def _replay_prefill(self, slot: int, tokens: Tensor, start: int) -> Tensor:
        """`prefill` through the graph of the chunk's token bucket and attention (captured on first use); the
        chunk's tokens lead the bucket and the rest pad it: causal attention keeps them out of the chunk's rows,
        their K/V land past the chunk (overwritten before anything attends there) and their logits nowhere."""
        n = tokens.shape[0]
        key = (prefill_sizes(n)[-1], start == 0)  # the last bucket is the one that holds n tokens
        if key not in self._prefill_graphs:
            self.capture_prefill_graphs(key[0])
        g = self._prefill_graphs[key]
        # fill_ takes the scalars as kernel arguments: no host-to-device copy, no sync.
        g.tokens[0, :n].copy_(tokens)
        g.slots.fill_(slot)
        g.start_pos.fill_(start)
        g.last.fill_(n - 1)
        g.graph.replay()
        self.prefill_launched = time.perf_counter()
        return g.logits.clone()  # the buffer is the next prefill's

    def capture_prefill_graphs(self, longest: int) -> None:
        """Capture the prefill of every token bucket up to `longest` tokens not yet captured, largest first, in
        the verify graphs' pool: a fresh prompt (causal attention over its own tokens, FlashAttention) and a later
        chunk (attention over the cached prefix)."""
        for size in reversed(prefill_sizes(longest)):
            for fresh in (True, False):
                if (size, fresh) not in self._prefill_graphs:
                    self._prefill_graphs[(size, fresh)] = self._capture_prefill(size, fresh)

    def _capture_prefill(self, size: int, fresh: bool) -> _Graph:
        tokens = torch.zeros(1, size, dtype=torch.int64, device=self.device)
        slots = torch.full((1,), self.pad_slot, dtype=torch.int64, device=self.device)
        start_pos, last = torch.zeros(1, dtype=torch.int64, device=self.device), torch.zeros_like(slots)

        def forward() -> Tensor:
            with sdpa_kernel(PREFILL_SDPA):
                x = self._forward(tokens, slots, start_pos, "fresh" if fresh else "prefix")
            return self._logits(x.index_select(0, last))[0]

        graph, logits = self.capture(forward)
        return _Graph(graph, tokens, slots, start_pos, logits, last)

    def capture(self, forward: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
        """`forward` captured into the model's graph pool (which the decode loop's step graphs share), and its
        output (`capture_graph`)."""
        return capture_graph(forward, self.device, self._graph_pool)

    def verify(self, tokens: Tensor, slots: Tensor, start_pos: Tensor) -> Tensor:
        """Logits [B, T, V] (fp32) for `tokens [B, T]` at positions start_pos..start_pos+T-1 of `slots`.

        Each row attends to its slot's cache positions <= its own, after writing its T tokens' K/V; the
        slots must be distinct, and start_pos + T <= max_len. With CUDA graphs the result is a view of a
        static buffer, valid until the next verify.
        """
        batch, n_tokens = tokens.shape
        if not self.cuda_graphs:
            return self.verify_logits(tokens, slots, start_pos).view(batch, n_tokens, -1)
        if (self.max_slots, n_tokens) not in self._graphs:
            self.capture_graphs(n_tokens)
        size = next(s for s in self.batch_buckets if s >= batch)
        g = self._graphs[(size, n_tokens)]
        g.tokens[:batch].copy_(tokens)
        g.slots[:batch].copy_(slots)
        g.start_pos[:batch].copy_(start_pos)
        # Rows past the batch must write only the scratch slot: stale rows from an earlier, larger batch
        # would otherwise overwrite live slots' K/V.
        g.slots[batch:].fill_(self.pad_slot)
        g.graph.replay()
        return g.logits[:batch]

    def verify_logits(self, tokens: Tensor, slots: Tensor, start_pos: Tensor) -> Tensor:
        """`verify`'s logits [B*T, V] computed eagerly (what a graph captures: the decode loop's step graphs too)."""
        return self._logits(self._forward(tokens, slots, start_pos))

    def capture_graphs(self, n_tokens: int) -> None:
        """Capture the verify step for T = n_tokens at every batch-size bucket (largest first, one pool);
        a no-op when already captured."""
        if (self.max_slots, n_tokens) in self._graphs:
            return
        for size in reversed(self.batch_buckets):
            tokens = torch.zeros(size, n_tokens, dtype=torch.int64, device=self.device)
            slots = torch.full((size,), self.pad_slot, dtype=torch.int64, device=self.device)
            start_pos = torch.zeros(size, dtype=torch.int64, device=self.device)
            graph, logits = self.capture(partial(self.verify_logits, tokens, slots, start_pos))
            self._graphs[(size, n_tokens)] = _Graph(graph, tokens, slots, start_pos, logits.view(size, n_tokens, -1))


def steer_logits(logits: Tensor, ref_tokens: Tensor, margin: float) -> Tensor:
    """Make `ref_tokens [B, T]` the argmax of `logits [B, T, V]` (in place) where ref >= 0.

    The reference logit becomes row max + margin, so at temperature tau it holds at least
    1 / (1 + V exp(-margin / tau)) of the mass: real compute, replayed token identities.
    """
    index = ref_tokens.clamp(min=0).unsqueeze(-1)
    steered = logits.amax(dim=-1, keepdim=True) + margin
    return logits.scatter_(-1, index, torch.where(ref_tokens.unsqueeze(-1) >= 0, steered, logits.gather(-1, index)))
