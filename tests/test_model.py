"""Target model: KV-cache forward vs a float64 full recompute, masking of stale K/V, sizes, steering."""

import dataclasses
import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
import triton
from helpers import interpreted_kernels, single_thread

from simharness.engine import model_triton
from simharness.engine.model import (
    Transformer,
    get_config,
    model_sizes,
    qk_norm_torch,
    rope_attention_torch,
    rope_frequencies,
    steer_logits,
    verify_attention_torch,
)
from simharness.engine.model_triton import prefix_attention_triton, qk_norm_triton, rope_attention_triton
from simharness.models import MODELS, RopeScaling
from simharness.tokenizer import DEFAULT_VOCAB_SIZE

TINY = dataclasses.replace(get_config("tiny"), vocab_size=512)
# The architecture variants: Qwen2's q/k/v biases (tied head), Qwen3's q/k head norms with a head_dim that is not
# dim / n_heads, Llama 3's RoPE scaling (an original context short enough that every frequency regime occurs).
VARIANTS = {
    "untied": TINY,
    "tied": dataclasses.replace(TINY, tie_embeddings=True),
    "qkv_bias": dataclasses.replace(TINY, qkv_bias=True, tie_embeddings=True),
    "qk_norm": dataclasses.replace(TINY, qk_norm=True, head_dim=32, norm_eps=1e-6),
    "rope_scaling": dataclasses.replace(TINY, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64)),
}
# Triton 3.6's interpreter (the GPU machine's image) hands loaded scalars to range() as 1-element arrays, which
# NumPy 2 rejects; 3.9 (CI) runs the attention kernel's loops. The compiled kernels are tested on CUDA there.
old_interpreter = pytest.mark.skipif(
    tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9),
    reason="Triton < 3.9's interpreter cannot loop over loaded scalars under NumPy 2",
)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    yield from single_thread()


def reference_logits(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [T, V] of one sequence from position 0, recomputed from the weights in float64, no cache."""
    c = model.config
    n, hd, group = tokens.shape[0], c.head_dim, c.n_heads // c.n_kv_heads
    angles = torch.arange(n, dtype=torch.float64)[:, None] * rope_frequencies(c, "cpu")
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]

    def norm(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        return x if w is None else x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.norm_eps) * w.double()

    def rope(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    causal = torch.ones(n, n, dtype=torch.bool).tril()
    x = model.tok_embeddings.double()[tokens]
    for layer in model.layers:
        qkv = norm(x, layer.attn_norm) @ layer.wqkv.double().T
        if layer.bqkv is not None:
            qkv = qkv + layer.bqkv.double()
        q, k, v = qkv.split([c.n_heads * hd, c.n_kv_heads * hd, c.n_kv_heads * hd], dim=-1)
        q = rope(norm(q.view(n, c.n_heads, hd), layer.q_norm))
        k = rope(norm(k.view(n, c.n_kv_heads, hd), layer.k_norm))
        k, v = k.repeat_interleave(group, dim=1), v.view(n, c.n_kv_heads, hd).repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
        weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        x = x + torch.einsum("hts,shd->thd", weights, v).reshape(n, -1) @ layer.wo.double().T
        gate, up = (norm(x, layer.ffn_norm) @ layer.w13.double().T).chunk(2, dim=-1)
        x = x + (F.silu(gate) * up) @ layer.w2.double().T
    return norm(x, model.norm) @ model.output.double().T


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    err = (actual.double() - expected).norm() / expected.norm()
    assert err < 1e-5, f"relative error {err:.2e}"


def random_model(config, **kwargs) -> Transformer:
    """A model of `config` whose q/k head norms (ones by default) are random too."""
    model = Transformer(config, device="cpu", **kwargs)
    gen = torch.Generator().manual_seed(5)
    for layer in model.layers:
        for weight in (layer.q_norm, layer.k_norm):
            if weight is not None:
                weight.copy_(torch.rand(weight.shape, generator=gen) + 0.5)
    return model


@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_verify_steps_equal_full_recompute(variant: str) -> None:
    model = random_model(VARIANTS[variant], max_slots=3, max_len=64)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(TINY.vocab_size, (40,), generator=gen) for _ in range(2)]
    slots, lens = torch.tensor([2, 0]), [11, 6]
    for seq, slot, n in zip(seqs, slots.tolist(), lens, strict=True):
        assert_close(model.prefill(slot, seq[:n]), reference_logits(model, seq[:n])[-1])
    # Both rows in one verify call per step, each at its own position; T varies between steps.
    for n_tokens in [3, 1, 5, 2]:
        tokens = torch.stack([seq[n : n + n_tokens] for seq, n in zip(seqs, lens, strict=True)])
        logits = model.verify(tokens, slots, torch.tensor(lens))
        for row, (seq, n) in enumerate(zip(seqs, lens, strict=True)):
            assert_close(logits[row], reference_logits(model, seq[: n + n_tokens])[n:])
        lens = [n + n_tokens for n in lens]


def test_stale_kv_past_the_query_is_masked() -> None:
    """K/V of rejected drafts sit past the committed length; a later query must never see them."""
    model = Transformer(TINY, max_slots=2, max_len=32, device="cpu")
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(TINY.vocab_size, (12,), generator=gen)
    model.prefill(1, seq[:8])
    # Verify [seq[8], junk, junk, junk]: positions 9..11 now hold K/V of tokens that were "rejected".
    junk = torch.randint(TINY.vocab_size, (3,), generator=gen)
    model.verify(torch.cat([seq[8:9], junk])[None], torch.tensor([1]), torch.tensor([8]))
    model.k_cache[:, 1, 12:] = 1e4  # and anything further out is garbage too
    model.v_cache[:, 1, 12:] = -1e4
    # Accept only seq[8]: the next step starts at position 9 with one token; 10, 11 stay stale.
    logits = model.verify(seq[9:10][None], torch.tensor([1]), torch.tensor([9]))
    assert_close(logits[0], reference_logits(model, seq[:10])[9:])


def test_reused_slot_prefill_ignores_the_previous_request() -> None:
    model = Transformer(TINY, max_slots=1, max_len=32, device="cpu")
    long, short = torch.arange(30) % 7, torch.tensor([5, 9, 2])
    model.prefill(0, long)
    assert_close(model.prefill(0, short), reference_logits(model, short)[-1])
    assert_close(model.verify(torch.tensor([[4, 4]]), torch.tensor([0]), torch.tensor([3]))[0],
                 reference_logits(model, torch.tensor([5, 9, 2, 4, 4]))[3:])  # fmt: skip


def test_prefill_attention_never_takes_cudnn(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuDNN's SDPA builds a graph per new sequence length (~70 ms on the H100): the prefill must not offer it."""
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    model = Transformer(TINY, max_slots=1, max_len=32, device="cpu")
    model.prefill(0, torch.arange(9) % 7)  # fresh: causal SDPA
    model.prefill(0, torch.arange(5) % 7, start=9)  # after a cached prefix: masked SDPA
    assert len(seen) == 2 * TINY.n_layers and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # the process's own setting is left as it was


def test_sizes_match_the_parameters() -> None:
    for config in VARIANTS.values():
        model = Transformer(config, max_slots=3, max_len=16, device="cpu")
        sizes = model_sizes(config, max_slots=3, max_len=16, dtype=torch.float32)
        assert sizes["params"] == sum(p.numel() for p in model.parameters())
        assert sizes["weight_read_bytes"] == model.weight_bytes()
        assert sizes["kv_cache_bytes"] == 2 * model.k_cache.numel() * 4
    # The public models' parameter counts: Llama 3.2 1B has 1.24 B, Llama 3 8B 8.03 B.
    assert model_sizes(MODELS["llama-3.2-1b"])["params"] == pytest.approx(1.236e9, rel=1e-3)
    assert model_sizes(MODELS["llama-3-8b"])["params"] == pytest.approx(8.030e9, rel=1e-3)
    qwen = MODELS["qwen3-1.7b"]  # its model card: 1.7 B parameters, 1.4 B without the embedding
    assert model_sizes(qwen)["params"] - qwen.vocab_size * qwen.dim == pytest.approx(1.4e9, rel=0.01)
    assert get_config("llama-3.2-1b", n_layers=2).n_layers == 2


def test_catalogue_models_embed_the_builtin_tokenizer() -> None:
    """The hil builds a catalogue model as listed: the built-in tokenizer's ids must have embedding rows."""
    assert min(c.vocab_size for c in MODELS.values()) >= DEFAULT_VOCAB_SIZE == MODELS["tiny"].vocab_size


def test_steer_logits() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 4, 100, generator=gen) * 5
    ref = torch.randint(100, (3, 4), generator=gen)
    ref[1, 2] = -1
    original = logits.clone()
    steer_logits(logits, ref, margin=30.0)
    has_ref = ref >= 0
    assert torch.equal(logits.argmax(-1)[has_ref], ref[has_ref])
    assert torch.equal(logits[1, 2], original[1, 2])
    assert (logits.softmax(-1).gather(-1, ref.clamp(min=0)[..., None])[has_ref] > 0.999).all()


@old_interpreter
def test_triton_ops_match_torch_ops_in_the_interpreter() -> None:
    """The CUDA path's Triton kernels, run by Triton's CPU interpreter (it must be on before they are
    decorated, hence a subprocess): same prefill (a fresh prompt and a later chunk) and verify logits and the same
    cache as the torch ops, for Llama and for a model with Qwen's q/k/v biases and q/k head norms."""
    code = textwrap.dedent("""
        import dataclasses
        import torch
        from simharness.engine.model import Transformer, get_config
        torch.set_num_threads(1)
        qwen = dataclasses.replace(get_config("tiny"), qkv_bias=True, qk_norm=True, head_dim=32)
        models = [Transformer(c, max_slots=3, max_len=48, device="cpu", triton_kernels=t)
                  for c in (get_config("tiny"), qwen) for t in (False, True)]
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(512, (n,), generator=gen) for n in (20, 13)]
        tokens = torch.randint(512, (2, 5), generator=gen)
        outs = []
        for m in models:
            prefill = [m.prefill(slot, p) for slot, p in zip((2, 0), prompts)]
            prefill.append(m.prefill(1, prompts[0][:8]))
            prefill.append(m.prefill(1, prompts[0][8:], start=8))  # a later chunk: attention over its prefix
            outs.append((prefill, m.verify(tokens, torch.tensor([2, 0]), torch.tensor([20, 13])), m.k_cache, m.v_cache))
        for (p0, v0, k0, c0), (p1, v1, k1, c1) in (outs[:2], outs[2:]):
            for a, b in [*zip(p0, p1), (v0, v1), (k0, k1), (c0, c1)]:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture
def interpreted() -> Iterator[None]:
    """The attention kernel in Triton's CPU interpreter, in this process."""
    yield from interpreted_kernels(model_triton, ("_rope_attention_kernel", "_rotated", "_attend_tile"))


@pytest.fixture
def interpreted_prefix() -> Iterator[None]:
    yield from interpreted_kernels(model_triton, ("_prefix_attention_kernel", "_attend_tile"))


@pytest.fixture
def interpreted_qk_norm() -> Iterator[None]:
    yield from interpreted_kernels(model_triton, ("_qk_norm_kernel",))


def test_qk_norm_matches_torch(interpreted_qk_norm: None) -> None:
    """Qwen3's per-head q and k norms: the Triton kernel (interpreted) against the torch op; v is untouched and
    a normed head divided by its weight has an RMS of 1."""
    gen = torch.Generator().manual_seed(3)
    n_heads, n_kv_heads, head_dim = 6, 2, 32  # 8 q and k heads: no padding; 6 + 1 below: padded to 8
    for kv in (n_kv_heads, 1):
        qkv = torch.randn(5, (n_heads + 2 * kv) * head_dim, generator=gen) * 3
        q_weight, k_weight = torch.rand(2, head_dim, generator=gen) + 0.5
        expected, got = qkv.clone(), qkv.clone()
        qk_norm_torch(expected, q_weight, k_weight, n_heads, kv, 1e-6)
        qk_norm_triton(got, q_weight, k_weight, n_heads, kv, 1e-6)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        heads = expected.view(5, -1, head_dim)
        assert torch.equal(heads[:, n_heads + kv :], qkv.view(5, -1, head_dim)[:, n_heads + kv :])  # v as it was
        torch.testing.assert_close((heads[:, 0] / q_weight).pow(2).mean(-1), torch.ones(5))
        torch.testing.assert_close((heads[:, n_heads] / k_weight).pow(2).mean(-1), torch.ones(5))


@old_interpreter
def test_rope_attention_matches_torch(interpreted: None) -> None:
    """RoPE + K/V write + attention against the torch ops: contexts cut into several chunks (merged by the last
    program to arrive) or one, a row at position 0, a step that straddles a chunk boundary, one-token steps; a
    row whose positions run past max_len (garbage output) writes only inside its own slot."""
    gen = torch.Generator().manual_seed(0)
    counters = torch.zeros(256, dtype=torch.int32)
    for batch, max_len, n_heads, n_kv_heads, head_dim, n_tokens in [
        (3, 300, 4, 2, 16, 5),  # 6 programs: chunks of 128
        (64, 80, 4, 2, 16, 3),  # 128 programs: one chunk per row
        (2, 260, 4, 1, 16, 1),
    ]:
        k_cache, v_cache = torch.randn(2, batch + 1, max_len, n_kv_heads, head_dim, generator=gen)
        qkv = torch.randn(batch * n_tokens, (n_heads + 2 * n_kv_heads) * head_dim, generator=gen)
        slots = torch.randperm(batch + 1, generator=gen)[:batch]
        start = torch.randint(0, max_len - n_tokens + 1, (batch,), generator=gen)
        start[0] = 0
        if batch > 2:
            start[-1] = max_len + 7  # past max_len
        if max_len > 128 + n_tokens:
            start[1 % batch] = 126  # positions 126..126+T-1 straddle the chunk boundary at 128
        angles = torch.rand(max_len, head_dim // 2, generator=gen) * 6
        args = (angles.cos(), angles.sin(), slots, start, n_tokens, n_heads, counters)
        caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
        expected = rope_attention_torch(qkv, *caches[0], *args)
        got = rope_attention_triton(qkv, *caches[1], *args)
        live = batch - 1 if batch > 2 else batch
        torch.testing.assert_close(got[: live * n_tokens], expected[: live * n_tokens], rtol=1e-4, atol=1e-4)
        untouched = torch.ones(batch + 1, dtype=torch.bool)
        untouched[slots[live:]] = False  # the garbage row's slot: written at clamped positions by both
        for triton_cache, torch_cache, original in zip(caches[1], caches[0], (k_cache, v_cache), strict=True):
            torch.testing.assert_close(triton_cache[untouched], torch_cache[untouched])
            below = slice(0, max_len - n_tokens)
            assert torch.equal(triton_cache[~untouched][:, below], original[~untouched][:, below])
        assert not counters.any()


@old_interpreter
def test_rope_attention_does_not_depend_on_where_a_step_starts(interpreted: None) -> None:
    """Three tokens verified in one step, or one per step (the other two slots junk), give bitwise the same
    outputs and cache: what greedy speculative == plain greedy in bf16 rests on."""
    gen = torch.Generator().manual_seed(1)
    batch, max_len, n_heads, n_kv_heads, head_dim, n_tokens, start = 2, 300, 4, 2, 16, 3, 190
    k_cache, v_cache = torch.randn(2, batch + 1, max_len, n_kv_heads, head_dim, generator=gen)
    qkv = torch.randn(batch, n_tokens, (n_heads + 2 * n_kv_heads) * head_dim, generator=gen)
    angles = torch.rand(max_len, head_dim // 2, generator=gen) * 6
    slots, counters = torch.tensor([2, 0]), torch.zeros(8, dtype=torch.int32)
    args = (angles.cos(), angles.sin(), slots)
    whole = (k_cache.clone(), v_cache.clone())
    together = rope_attention_triton(
        qkv.flatten(0, 1), *whole, *args, torch.full((batch,), start), n_tokens, n_heads, counters
    ).view(batch, n_tokens, -1)
    apart = (k_cache.clone(), v_cache.clone())
    for i in range(n_tokens):
        step = torch.randn(batch, n_tokens, qkv.shape[-1], generator=gen)  # junk after the real token
        step[:, 0] = qkv[:, i]
        out = rope_attention_triton(
            step.flatten(0, 1), *apart, *args, torch.full((batch,), start + i), n_tokens, n_heads, counters
        ).view(batch, n_tokens, -1)
        assert torch.equal(out[:, 0], together[:, i])
    for a, b in zip(apart, whole, strict=True):
        assert torch.equal(a[:, : start + n_tokens], b[:, : start + n_tokens])


@old_interpreter
def test_prefix_attention_matches_torch(interpreted_prefix: None) -> None:
    """A later prefill chunk's attention (Triton, interpreted) against the torch reference: chunks of one token,
    of a partial query block and of two blocks; prefixes of 0, mid-cache and up to the cache's end; grouped and
    plain heads; two rows at once. Stale keys past each query (a longer earlier request in the slot) are ignored."""
    gen = torch.Generator().manual_seed(5)
    for batch, max_len, n_heads, n_kv_heads, head_dim, n_tokens in [
        (1, 300, 4, 2, 16, 130),  # two query blocks of 128 (the second partial)
        (2, 200, 6, 2, 32, 7),
        (1, 90, 2, 2, 16, 1),
    ]:
        k_cache, v_cache = torch.randn(2, batch + 1, max_len, n_kv_heads, head_dim, generator=gen)
        q = torch.randn(batch * n_tokens, n_heads, head_dim, generator=gen)
        slots = torch.randperm(batch + 1, generator=gen)[:batch]
        for first in (0, (max_len - n_tokens) // 2, max_len - n_tokens):
            start = torch.full((batch,), first)
            start[-1] = max(0, first - 3)
            expected = verify_attention_torch(q, k_cache, v_cache, slots, start, n_tokens)
            got = prefix_attention_triton(q, k_cache, v_cache, slots, start, n_tokens)
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("batch,n_tokens", [(1, 7), (3, 1), (2, 4)])
def test_expanded_heads_attend_exactly_as_grouped_queries(batch: int, n_tokens: int) -> None:
    """The later prefill chunk's attention repeats the K/V heads (so that SDPA's memory-efficient kernel takes the
    mask on CUDA); on the CPU both paths run the math kernel and must agree to rounding, for every row's prefix."""
    g = torch.Generator().manual_seed(batch * 10 + n_tokens)
    max_len, n_kv, n_heads, dim = 24, 2, 6, 8
    k_cache, v_cache = (torch.randn(batch + 1, max_len, n_kv, dim, generator=g) for _ in range(2))
    q = torch.randn(batch * n_tokens, n_heads, dim, generator=g)
    slots = torch.randperm(batch + 1, generator=g)[:batch]
    start = torch.randint(0, max_len - n_tokens + 1, (batch,), generator=g)
    grouped = verify_attention_torch(q, k_cache, v_cache, slots, start, n_tokens)
    expanded = verify_attention_torch(q, k_cache, v_cache, slots, start, n_tokens, expand_heads=True)
    torch.testing.assert_close(expanded, grouped, rtol=1e-5, atol=1e-6)
