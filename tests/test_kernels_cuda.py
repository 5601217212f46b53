"""CUDA only: the compiled Triton kernels at realistic sizes (B=64, L=8192, V=128256) agree with the
reference / torch versions, keep the target distribution, and the n-gram paths make no host sync. Triton compiles
wherever CUDA is (tests/conftest.py), so they run in the same session as the CPU kernel tests."""

import os
import time

import pytest
import torch
from helpers import chisquare_pvalue

from simharness.kernels.gate import Gate
from simharness.kernels.ngram import propose_ngram_reference, propose_ngram_torch
from simharness.kernels.ngram_triton import propose_ngram_triton
from simharness.kernels.rejection import rejection_sample_reference
from simharness.kernels.rejection_triton import rejection_sample_triton

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BATCH, WIDTH, VOCAB, K = 64, 8192, 128256, 4


@pytest.fixture(autouse=True)
def _compiled_triton() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 was set for this process: compiled kernels cannot run")


def repetitive_histories(seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[BATCH, WIDTH] token rows where earlier spans recur (as in code or quoted text), and seq_lens that
    include the edge cases 0, 1, 2 and WIDTH."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50, (BATCH, WIDTH), generator=generator)
    for b in range(BATCH):
        for _ in range(40):
            length = int(torch.randint(4, 64, (1,), generator=generator))
            source = int(torch.randint(0, WIDTH - length, (1,), generator=generator))
            target = int(torch.randint(source, WIDTH - length + 1, (1,), generator=generator))
            tokens[b, target : target + length] = tokens[b, source : source + length].clone()
    seq_lens = torch.randint(0, WIDTH + 1, (BATCH,), generator=generator)
    seq_lens[:4] = torch.tensor([0, 1, 2, WIDTH])
    return tokens.to(dtype).cuda(), seq_lens.cuda()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("tie_break", ["earliest", "latest"])
@pytest.mark.parametrize("invalid", ["pad", "fill"])
@pytest.mark.parametrize("min_n, max_n, k", [(2, 5, 4), (1, 3, 8)])
def test_ngram_agrees_at_realistic_size(
    dtype: torch.dtype, tie_break: str, invalid: str, min_n: int, max_n: int, k: int
) -> None:
    token_ids, seq_lens = repetitive_histories(seed=min_n, dtype=dtype)
    kwargs = {"min_n": min_n, "max_n": max_n, "k": k, "tie_break": tie_break, "invalid": invalid}
    drafts, num_valid = propose_ngram_triton(token_ids, seq_lens, **kwargs)
    expected_drafts, expected_valid = propose_ngram_torch(token_ids, seq_lens, **kwargs)
    assert torch.equal(drafts, expected_drafts) and torch.equal(num_valid, expected_valid)
    assert (num_valid > 0).sum() > BATCH // 2  # the histories really exercise matching
    rows = slice(0, 12)  # the pure-Python reference is slow: a dozen rows, the edge cases among them
    ref_drafts, ref_valid = propose_ngram_reference(token_ids[rows], seq_lens[rows], **kwargs)
    assert torch.equal(drafts[rows], ref_drafts) and torch.equal(num_valid[rows], ref_valid)


def test_torch_and_triton_paths_make_no_host_sync() -> None:
    token_ids, seq_lens = repetitive_histories(seed=0, dtype=torch.int32)
    logits = torch.randn(2, K + 1, 1000, device="cuda")
    drafts = torch.zeros(2, K, dtype=torch.int64, device="cuda")
    num_drafts = torch.full((2,), K, device="cuda")
    temperature = torch.tensor([0.0, 1.0], device="cuda")
    calls = [
        lambda: propose_ngram_torch(token_ids, seq_lens, min_n=2, max_n=5, k=4),
        lambda: propose_ngram_triton(token_ids, seq_lens, min_n=2, max_n=5, k=4),
        lambda: rejection_sample_triton(logits, drafts, num_drafts, temperature, seed=0),
    ]
    for call in calls:
        call()  # warm-up: compilation may synchronize
    torch.cuda.set_sync_debug_mode("error")
    try:
        for call in calls:
            call()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ties", [False, True])
def test_rejection_greedy_rows_agree_at_realistic_size(dtype: torch.dtype, ties: bool) -> None:
    generator = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(BATCH, K + 1, VOCAB, generator=generator, device="cuda") * 3
    if ties:
        logits = logits.round()  # many exact ties across vocab splits: the lowest index wins
    logits = logits.to(dtype)
    argmax = logits.float().argmax(dim=-1)
    random_tokens = torch.randint(0, VOCAB, (BATCH, K), generator=generator, device="cuda")
    choice = torch.rand(BATCH, K, generator=generator, device="cuda")
    drafts = torch.where(choice < 0.8, argmax[:, :K], torch.where(choice < 0.9, random_tokens, -1))
    num_drafts = torch.randint(0, K + 1, (BATCH,), generator=generator, device="cuda")
    temperature = torch.where(torch.arange(BATCH, device="cuda") % 2 == 0, 0.0, 0.9)
    expected = rejection_sample_reference(logits, drafts, num_drafts, temperature, seed=5)
    got = rejection_sample_triton(logits, drafts, num_drafts, temperature, seed=5)
    greedy = temperature == 0
    assert torch.equal(got[0][greedy], expected[0][greedy])
    assert torch.equal(got[1][greedy], expected[1][greedy])
    # Every row: accepted drafts, then one in-vocab token that is not the rejected draft, then -1.
    output, num_emitted = got
    columns = torch.arange(K + 1, device="cuda")
    last = (num_emitted - 1).long()
    padded = torch.cat([drafts, torch.full((BATCH, 1), -1, device="cuda")], dim=1)
    assert ((num_emitted >= 1) & (num_emitted <= num_drafts + 1)).all()
    assert torch.equal(torch.where(columns < last[:, None], output, 0), torch.where(columns < last[:, None], padded, 0))
    final = output.gather(1, last[:, None]).squeeze(1)
    assert ((final >= 0) & (final < VOCAB)).all()
    rejected = last < num_drafts
    assert (final != padded.gather(1, last[:, None]).squeeze(1))[rejected].all()
    assert (torch.where(columns > last[:, None], output, -1) == -1).all()
    again = rejection_sample_triton(logits, drafts, num_drafts, temperature, seed=5)
    assert torch.equal(again[0], got[0])


@pytest.mark.parametrize(
    "impl, dtype",
    [(rejection_sample_triton, torch.float32), (rejection_sample_triton, torch.bfloat16),
     (rejection_sample_reference, torch.float32)],
)  # fmt: skip
def test_rejection_random_rows_preserve_the_target(impl, dtype: torch.dtype) -> None:
    """Full vocabulary, mass on 8 tokens: the (accepted, token) joint at the first position matches
    q(y) p(y) / p(y) (1 - q(y)); 300 seeds x 64 rows (several vocab tiles per row)."""
    generator = torch.Generator().manual_seed(3)
    temperature, seeds, hot = 0.8, 300, 8
    logits = torch.full((K + 1, VOCAB), -30.0)
    logits[:, :hot] = torch.randn(K + 1, hot, generator=generator) * 1.5
    logits = logits.to(dtype)
    p = torch.softmax(logits[0].double() / temperature, dim=-1)
    q = torch.full((VOCAB,), 0.0, dtype=torch.float64)
    q[:hot] = 0.2 / hot
    q[p.argmax()] += 0.8
    cells = []
    for seed in range(seeds):
        drafts = torch.multinomial(q, BATCH * K, replacement=True, generator=generator).view(BATCH, K)
        output, num_emitted = impl(
            logits.cuda().expand(BATCH, -1, -1),
            drafts.cuda(),
            torch.full((BATCH,), K, device="cuda"),
            torch.full((BATCH,), temperature, device="cuda"),
            seed=seed,
        )
        cells.append(((num_emitted > 1).long() * VOCAB + output[:, 0]).cpu())
    observed = torch.bincount(torch.cat(cells), minlength=2 * VOCAB).numpy()
    probabilities = torch.cat([p * (1 - q), p * q]).numpy()
    assert chisquare_pvalue(observed, probabilities) > 1e-4


def test_rejection_random_rows_preserve_the_target_at_every_position() -> None:
    """200k rows of one target (hot tokens spread over several vocab tiles, the rest at -30): at every
    draft position the (accepted, token) joint given that the position is reached is q(y) p(y) / p(y) (1 - q(y)),
    and the bonus position emits p. Power for the compiled kernels' inverse-CDF sample at every position."""
    generator = torch.Generator().manual_seed(4)
    rows, vocab, temperature = 200_000, 10_000, 0.8
    hot = torch.tensor([3, 17, 2050, 4097, 4100, 6000, 8191, 9999])
    logits = torch.full((K + 1, vocab), -30.0)
    logits[:, hot] = torch.randn(K + 1, len(hot), generator=generator) * 1.5
    p = torch.softmax(logits.double() / temperature, dim=-1)
    q = torch.zeros(K, vocab, dtype=torch.float64)
    q[:, hot] = 0.3 / len(hot)
    q[torch.arange(K), p[:K].argmax(dim=-1)] += 0.7
    drafts = torch.multinomial(q, rows, replacement=True, generator=generator).T.contiguous()
    output, num_emitted = rejection_sample_triton(
        logits.cuda().expand(rows, -1, -1), drafts.cuda(), torch.full((rows,), K, device="cuda"),
        torch.full((rows,), temperature, device="cuda"), seed=21,
    )  # fmt: skip
    output, num_emitted = output.cpu(), num_emitted.cpu()
    for i in range(K + 1):
        reached = num_emitted > i
        tokens = output[reached, i]
        if i < K:
            cells = (num_emitted[reached] > i + 1).long() * vocab + tokens
            probabilities = torch.cat([p[i] * (1 - q[i]), p[i] * q[i]])
        else:
            cells, probabilities = tokens, p[K]
        observed = torch.bincount(cells, minlength=len(probabilities)).numpy()
        assert chisquare_pvalue(observed, probabilities.numpy()) > 1e-4, f"position {i}"


def test_closed_gate_holds_the_stream_until_opened():
    """The hil level's gate (kernels/gate.py): the device waits at a closed gate until the host opens it."""
    gate = Gate()
    before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    before.record()
    gate.close()
    after.record()
    time.sleep(0.05)
    assert not after.query()  # the device still waits at the gate
    gate.open()
    after.synchronize()
    assert before.elapsed_time(after) >= 45.0  # ms: the gate held the stream while the host slept


@pytest.mark.parametrize("n_heads, n_kv_heads, head_dim", [(32, 8, 64), (32, 8, 128)])
def test_prefix_attention_agrees_at_realistic_size(n_heads: int, n_kv_heads: int, head_dim: int) -> None:
    """A later prefill chunk of 700 tokens after 1,500 cached ones (bf16, the 1B's and the 8B's head shapes): the
    Triton prefix kernel against the torch reference, to bf16 rounding."""
    from simharness.engine.model import verify_attention_torch
    from simharness.engine.model_triton import prefix_attention_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    n_tokens, start, max_len = 700, 1500, 4096
    k_cache, v_cache = torch.randn(2, 3, max_len, n_kv_heads, head_dim, generator=gen, device="cuda",
                                   dtype=torch.bfloat16)  # fmt: skip
    q = torch.randn(n_tokens, n_heads, head_dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    slots, starts = torch.tensor([1], device="cuda"), torch.tensor([start], device="cuda")
    expected = verify_attention_torch(q.float(), k_cache.float(), v_cache.float(), slots, starts, n_tokens)
    got = prefix_attention_triton(q, k_cache, v_cache, slots, starts, n_tokens)
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)
