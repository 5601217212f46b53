"""Decode loop and model on CUDA (run on the GPU machine): no host sync in a step, Triton ops and CUDA
graphs agree with the torch path, speculative greedy decoding of the 1B shape in bf16 is exact."""

import pytest
import torch
from helpers import finish

from simharness.engine.decode import FORWARD, DecodeLoop
from simharness.engine.model import PREFILL_PAD, Transformer, get_config, rope_attention_torch
from simharness.engine.model_triton import rope_attention_triton

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ONE_B = get_config("llama-3.2-1b", n_layers=2)
MAX_LEN = 384


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def prompts(n: int, seed: int = 0) -> list[torch.Tensor]:
    """Prompts of different lengths that repeat a phrase, so the n-gram proposer finds matches."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        phrase = torch.randint(ONE_B.vocab_size, (5 + i,), generator=gen)
        out.append(torch.cat([phrase.repeat(3), torch.randint(ONE_B.vocab_size, (3 * i,), generator=gen)]))
    return out


def references(n: int, length: int = 64, seed: int = 1) -> list[list[int]]:
    """Text-like continuations: a phrase repeated with a varying tail."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        phrase = torch.randint(ONE_B.vocab_size, (8,), generator=gen).tolist()
        out.append(((phrase + torch.randint(ONE_B.vocab_size, (3,), generator=gen).tolist()) * 8)[:length])
    return out


def test_triton_ops_match_torch_ops() -> None:
    models = [Transformer(ONE_B, max_slots=16, max_len=MAX_LEN, device="cuda", triton_kernels=t) for t in (False, True)]
    results = []
    for model in models:
        firsts = [model.prefill(slot, prompt.cuda()) for slot, prompt in enumerate(prompts(16))]
        gen = torch.Generator(device="cuda").manual_seed(0)
        # B = 3 splits each row's context into chunks of 256 (row 2 spans two); B = 16 takes one per row.
        # Positions between a prompt and a start hold zeros, as any untouched cache does.
        verified = []
        for slots, start in [([3, 0, 1], [31, 12, 300]), (list(range(15, -1, -1)), list(range(40, 360, 20)))]:
            tokens = torch.randint(ONE_B.vocab_size, (len(slots), 5), device="cuda", generator=gen)
            slots_t, start_t = torch.tensor(slots, device="cuda"), torch.tensor(start, device="cuda")
            verified.append(model.verify(tokens, slots_t, start_t))
        results.append((torch.stack(firsts), *verified, model.k_cache, model.v_cache))
    for reference, fused in zip(*results, strict=True):
        assert rel_err(fused, reference) < 2e-2


def test_rope_attention_with_many_chunks_is_deterministic() -> None:
    """B = 1 at the 1B shape cuts a 1000-position context into chunks merged by the last program to arrive: it
    matches torch, and 20 launches give bitwise the same output (the merge never reads a missing partial)."""
    c, batch, n_tokens, max_len = ONE_B, 2, 5, 1024
    gen = torch.Generator(device="cuda").manual_seed(0)
    k_cache, v_cache = torch.randn(2, batch + 1, max_len, c.n_kv_heads, c.head_dim, generator=gen, device="cuda")
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    qkv = torch.randn(batch * n_tokens, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim, generator=gen, device="cuda")
    qkv = qkv.bfloat16()
    angles = torch.rand(max_len, c.head_dim // 2, generator=gen, device="cuda") * 6
    counters = torch.zeros(64, dtype=torch.int32, device="cuda")
    args = (angles.cos(), angles.sin(), torch.tensor([2, 0], device="cuda"), torch.tensor([1000, 126], device="cuda"))
    expected = rope_attention_torch(qkv, k_cache.clone(), v_cache.clone(), *args, n_tokens, c.n_heads, counters)
    outs = [rope_attention_triton(qkv, k_cache, v_cache, *args, n_tokens, c.n_heads, counters) for _ in range(20)]
    assert rel_err(outs[0], expected) < 2e-2
    assert all(torch.equal(out, outs[0]) for out in outs) and not counters.any()


def test_cuda_graph_verify_matches_eager_and_padding_rows_touch_only_scratch() -> None:
    eager, graphed = (
        Transformer(ONE_B, max_slots=8, max_len=MAX_LEN, device="cuda", cuda_graphs=g) for g in (False, True)
    )
    lengths = [p.shape[0] for p in prompts(8)]
    for model in (eager, graphed):
        for slot, prompt in enumerate(prompts(8)):
            model.prefill(slot, prompt.cuda())
    tokens = torch.randint(ONE_B.vocab_size, (4, 5), device="cuda")
    # B = 4 fills the 4-bucket with slots 4..7; then B = 3 reuses that bucket, whose row 3 still holds
    # slot 7: it must go to the scratch slot, not write slot 7 (cleared in between to see any write). Each row
    # starts right after its prompt, as a decode does: past it the graphed prefill's pads hold K/V, eager zeros.
    for slots in ([4, 5, 6, 7], [0, 1, 2]):
        slots_t, start_t = torch.tensor(slots, device="cuda"), torch.tensor([lengths[s] for s in slots], device="cuda")
        logits = [m.verify(tokens[: len(slots)], slots_t, start_t).clone() for m in (eager, graphed)]
        assert rel_err(logits[1], logits[0]) < 2e-2
        for m in (eager, graphed):
            m.k_cache[:, 7].zero_()
    for slot in range(7):
        end = lengths[slot] + (0 if slot == 3 else 5)
        assert rel_err(graphed.k_cache[:, slot, :end], eager.k_cache[:, slot, :end]) < 1e-2
    assert not graphed.k_cache[:, 7].any()


def test_cuda_graph_prefill_matches_eager_and_pads_touch_nothing_live() -> None:
    """Fresh prompts and later chunks (at a cached prefix) through the prefill graphs give the eager logits and
    K/V; a result survives the next prefill; the pads' K/V stay past the chunk, in its own slot."""
    eager, graphed = (
        Transformer(ONE_B, max_slots=8, max_len=1200, device="cuda", cuda_graphs=g) for g in (False, True)
    )
    graphed.capture_prefill_graphs(1100)
    chunks = [(slot, p, 0) for slot, p in enumerate(prompts(5))]
    long = torch.randint(ONE_B.vocab_size, (1100,), generator=torch.Generator().manual_seed(3))
    chunks += [(5, long[:70], 0), (5, long[70:1090], 70), (6, long, 0), (0, long[:9], prompts(5)[0].shape[0])]
    results = []
    for m in (eager, graphed):
        results.append([m.prefill(slot, p.cuda(), start=start) for slot, p, start in chunks])
    for a, b in zip(*results, strict=True):
        assert rel_err(b, a) < 2e-2
    ends = {}
    for slot, p, start in chunks:
        ends[slot] = max(ends.get(slot, 0), start + p.shape[0])
    for slot, end in ends.items():
        assert rel_err(graphed.k_cache[:, slot, :end], eager.k_cache[:, slot, :end]) < 1e-2
        assert rel_err(graphed.v_cache[:, slot, :end], eager.v_cache[:, slot, :end]) < 1e-2
    assert not graphed.k_cache[:, 7].any()
    assert graphed.k_cache.shape[2] == 1200 + PREFILL_PAD and eager.k_cache.shape[2] == 1200


@pytest.mark.parametrize(("invalid", "step_graphs", "step_ks"), [
    ("pad", False, None), ("fill", False, None), ("pad", True, None), ("fill", True, None),
    ("pad", False, (0, 2, 4)), ("fill", True, (0, 2, 4)),  # a k schedule's steps, each at its own k
])  # fmt: skip
def test_step_makes_no_host_sync(invalid: str, step_graphs: bool, step_ks: tuple[int, ...] | None) -> None:
    model = Transformer(ONE_B, max_slots=8, max_len=MAX_LEN, device="cuda", cuda_graphs=True)
    loop = DecodeLoop(model, k=4, min_n=1, max_n=3, invalid=invalid, step_graphs=step_graphs, step_ks=step_ks)
    ks = step_ks or (4, 4, 4)
    refs = references(1)
    for slot, prompt in enumerate(prompts(3)):
        loop.add_request(slot, prompt, reference_ids=refs[0] if slot == 1 else None, temperature=0.5 * slot)
    slots = torch.tensor([0, 1, 2], device="cuda")
    for k in ks:  # warm-up: Triton compilation of the proposer and sampler (per k)
        finish(loop, loop.step(slots, k=k))
    joined = torch.tensor([3, 0], device="cuda")  # a pageable host-to-device copy syncs: made outside
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        # Three steps in flight (async depth 3), then a request joins while they run.
        results = [loop.step(slots, k=k) for k in ks]
        loop.add_request(3, prompts(4)[3], temperature=1.0)
        results.append(loop.step(joined, k=ks[1]))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    outs = [finish(loop, r) for r in results]
    assert all((out.num_emitted >= 1).all() for out in outs)
    assert all(len(out.phase_s) == 4 and min(out.phase_s) >= 0 for out in outs)
    # the verify graph's launch returned within the forward's part (hil starts the part's device work there); the
    # step graph's launch ends every part's enqueue
    for r in results:
        marks = loop.host_marks(r)
        if step_graphs:
            assert marks[0] < loop.graph_launched(r) and set(marks[1:]) == {loop.graph_launched(r)}
        else:
            assert marks[FORWARD] < loop.graph_launched(r) <= marks[FORWARD + 1]
    assert all(min(out.parts_s) > 0 for out in outs)  # device timestamps (graphs) or events: every part took time


def run_loop(k: int, *, refs: list[list[int]] | None, n_steps: int, **kwargs) -> list[list[int]]:
    """Decode every slot every step (the batch never changes) and return each request's tokens."""
    model = Transformer(ONE_B, max_slots=4, max_len=MAX_LEN, device="cuda", cuda_graphs=True)
    args = {"min_n": 1, "max_n": 3} | kwargs
    loop = DecodeLoop(model, k=k, **args)
    streams = []
    for slot, prompt in enumerate(prompts(4)):
        streams.append(loop.add_request(slot, prompt, reference_ids=None if refs is None else refs[slot]).tolist())
    slots = torch.arange(4, device="cuda")
    for _ in range(n_steps):
        out = finish(loop, loop.step(slots))
        for row in range(4):
            streams[row] += out.tokens[row, : out.num_emitted[row]].tolist()
    return streams


def test_greedy_speculative_equals_plain_in_bf16() -> None:
    """What is exactly comparable in bf16. Plain decoding (k = 0) runs T = 1 GEMMs, speculative k = 4 runs
    T = 5: different shapes may pick different GEMM kernels, whose bf16 rounding differs, so argmax ties
    (near-ties) can flip between them. Two comparisons are exact all the same:
    - steered to a reference (margin 30 dwarfs bf16 noise): k = 0 and k = 4 both replay it exactly;
    - unsteered, plain greedy run through the *same* T = 5 shape (a proposer that never matches, so every
      step verifies only the last token) against k = 4 speculation: same batch every step, and every op
      computes a row/position independently of the others (GEMM rows, per-row attention whose extra
      masked blocks add exact zeros), so each token's logits are bitwise the same in both runs."""
    refs = references(4)
    for k in (0, 4):
        streams = run_loop(k, refs=refs, n_steps=60)
        assert all(s[:60] == r[:60] for s, r in zip(streams, refs, strict=True))

    n_steps = 24
    plain = run_loop(4, refs=None, n_steps=n_steps * 5, min_n=64, max_n=64)
    spec = run_loop(4, refs=None, n_steps=n_steps)
    print(f"unsteered: {sum(map(len, spec)) - 4 * (n_steps + 1)} drafts accepted in {4 * n_steps} request-steps")
    for s, p in zip(spec, plain, strict=True):
        assert s == p[: len(s)]


@pytest.mark.parametrize(("k", "invalid", "host_drafts", "step_ks"), [
    (0, "pad", False, None), (4, "pad", False, None), (4, "fill", False, None), (3, "pad", True, None),
    (4, "pad", False, (0, 1, 4)), (4, "fill", False, (0, 2, 4)), (3, "pad", True, (0, 2, 3)),  # k schedules
])  # fmt: skip
def test_step_graphs_equal_the_eager_step(k: int, invalid: str, host_drafts: bool,
                                          step_ks: tuple[int, ...] | None) -> None:
    """Random batches (padded to their buckets, slots in any order), greedy and random rows, steered and free ones,
    the device's lengths or the host's, and with `step_ks` each step at a k drawn from them: the replayed step
    graphs give the eager step's tokens, counts and state bit for bit (the same verify shapes: the eager step
    replays the model's verify graph of the same bucket and k)."""
    gen = torch.Generator().manual_seed(k)
    n_slots = 12
    loops = []
    for graphs in (False, True):
        model = Transformer(ONE_B, max_slots=n_slots, max_len=MAX_LEN, device="cuda", cuda_graphs=True)
        loops.append(DecodeLoop(model, k=k, min_n=1, max_n=3, invalid=invalid, device_proposer=not host_drafts,
                                seed=5, step_graphs=graphs, step_ks=step_ks))  # fmt: skip
    refs = references(n_slots, length=200)
    for slot, prompt in enumerate(prompts(n_slots)):
        for loop in loops:
            loop.add_request(slot, prompt, reference_ids=refs[slot] if slot % 3 == 0 else None,
                             temperature=float(slot % 2))  # fmt: skip
    for step in range(16):
        batch = int(torch.randint(1, n_slots + 1, (1,), generator=gen))
        slots = torch.randperm(n_slots, generator=gen)[:batch].numpy()
        lengths = loops[0].lengths[slots].cpu().numpy() if step % 2 else None
        step_k = k if step_ks is None else step_ks[int(torch.randint(len(step_ks), (1,), generator=gen))]
        drafts = None
        if host_drafts and step_k:
            drafts = torch.randint(ONE_B.vocab_size, (batch, step_k), generator=gen)
            drafts[torch.rand(batch, step_k, generator=gen) < 0.3] = -1
            drafts = drafts.numpy()
        outs = [finish(loop, loop.step(slots, k=step_k, lengths=lengths, drafts=drafts)) for loop in loops]
        assert (outs[1].packed == outs[0].packed).all(), step
        assert (outs[0].num_drafts <= step_k).all() and (outs[0].tokens[:, step_k + 1 :] == -1).all()
        for name in ("history", "lengths", "drafts", "num_valid"):
            assert torch.equal(getattr(loops[1], name)[:n_slots], getattr(loops[0], name)[:n_slots]), name
