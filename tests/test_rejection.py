"""Rejection sampler: greedy rows agree exactly (reference vs Triton interpreted on CPU), random rows keep
the target distribution (chi-squared), and the same test catches deliberately wrong samplers."""

from collections.abc import Callable, Iterator

import pytest
import torch
from helpers import chisquare_pvalue, interpreted_kernels

from simharness.kernels import rejection_triton
from simharness.kernels.rejection import rejection_sample, rejection_sample_reference
from simharness.kernels.rejection_triton import rejection_sample_triton

# The interpreter evaluates masked lanes too (log(0), -inf - -inf); numpy warns, the results are discarded.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

IMPLEMENTATIONS = [rejection_sample_reference, rejection_sample_triton]
Sampler = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@pytest.fixture(scope="module", autouse=True)
def _interpreted_kernels() -> Iterator[None]:
    yield from interpreted_kernels(rejection_triton, ("_rejection_tile_kernel", "_rejection_walk_kernel"))


def random_batch(
    batch: int, k: int, vocab: int, dtype: torch.dtype, seed: int, ties: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits, drafts (mostly the argmax so chains run long, some random, some -1), num_drafts, and a
    temperature per row (half greedy)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, k + 1, vocab, generator=generator) * 3
    if ties:
        logits = logits.round()  # many exact ties: the lowest index must win everywhere
    logits = logits.to(dtype)
    argmax = logits.float().argmax(dim=-1)
    random_tokens = torch.randint(0, vocab, (batch, k), generator=generator)
    drafts = torch.where(torch.rand(batch, k, generator=generator) < 0.7, argmax[:, :k], random_tokens)
    drafts = torch.where(torch.rand(batch, k, generator=generator) < 0.1, -1, drafts)
    num_drafts = torch.randint(0, k + 1, (batch,), generator=generator)
    greedy = torch.rand(batch, generator=generator) < 0.5
    temperature = torch.where(greedy, 0.0, 0.5 + torch.rand(batch, generator=generator))
    return logits, drafts, num_drafts, temperature


def assert_well_formed(
    output: torch.Tensor, num_emitted: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, vocab: int
) -> None:
    """Accepted drafts, then one target token (never the draft it replaces), then -1."""
    assert output.dtype == torch.int64 and num_emitted.dtype == torch.int32
    for b in range(output.shape[0]):
        emitted, last = int(num_emitted[b]), int(num_emitted[b]) - 1
        assert 1 <= emitted <= int(num_drafts[b]) + 1
        assert output[b, :last].tolist() == drafts[b, :last].tolist()
        assert 0 <= int(output[b, last]) < vocab
        if last < int(num_drafts[b]):
            assert int(output[b, last]) != int(drafts[b, last])
        assert (output[b, emitted:] == -1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "batch, k, vocab, ties",
    [
        (6, 4, 50, False),
        (6, 3, 40, True),
        (2, 2, 9000, True),  # several vocab tiles per row (the last one partial), merged by the walk kernel
        (8, 1, 2500, False),  # one tile, its tail columns masked
    ],
)
def test_greedy_rows_agree_exactly(dtype: torch.dtype, batch: int, k: int, vocab: int, ties: bool) -> None:
    logits, drafts, num_drafts, temperature = random_batch(batch, k, vocab, dtype, seed=vocab + k, ties=ties)
    expected = rejection_sample_reference(logits, drafts, num_drafts, temperature, seed=7)
    got = rejection_sample_triton(logits, drafts, num_drafts, temperature, seed=7)
    greedy = temperature == 0
    assert torch.equal(got[0][greedy], expected[0][greedy])
    assert torch.equal(got[1][greedy], expected[1][greedy])
    for output, num_emitted in (expected, got):
        assert_well_formed(output, num_emitted, drafts, num_drafts, vocab)


def test_int32_and_int64_inputs_agree() -> None:
    logits, drafts, num_drafts, temperature = random_batch(6, 3, 40, torch.float32, seed=3)
    wide = rejection_sample_triton(logits, drafts, num_drafts, temperature, seed=2)
    narrow = rejection_sample_triton(logits, drafts.int(), num_drafts.int(), temperature, seed=2)
    assert torch.equal(wide[0], narrow[0]) and torch.equal(wide[1], narrow[1])


def test_argmax_ties_across_tiles_take_the_lowest_index() -> None:
    logits = torch.zeros(2, 2, 9000)
    logits[:, 0, [8900, 4500, 7]] = 5.0  # position 0: tied maxima in different vocab tiles
    drafts = torch.tensor([[7], [4500]])
    for impl in IMPLEMENTATIONS:
        output, num_emitted = impl(logits, drafts, torch.tensor([1, 1]), torch.zeros(2), seed=0)
        # Row 0 accepts 7 and takes the bonus argmax of the all-equal position 1: index 0.
        assert output.tolist() == [[7, 0], [7, -1]] and num_emitted.tolist() == [2, 1], impl.__name__


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_greedy_hand_cases(impl: Sampler) -> None:
    logits = torch.full((5, 4, 10), -1.0)
    for position, token in enumerate([3, 1, 4, 2]):
        logits[:, position, token] = 1.0
    drafts = torch.tensor([[3, 1, 4], [3, 0, 4], [-1, 1, 4], [3, 1, 4], [3, 1, 9]])
    num_drafts = torch.tensor([3, 3, 3, 0, 2])
    output, num_emitted = impl(logits, drafts, num_drafts, torch.zeros(5), seed=0)
    assert output.tolist() == [
        [3, 1, 4, 2],  # perfect match: all drafts, then the bonus
        [3, 1, -1, -1],  # mismatch at 1: the argmax there, then -1
        [3, -1, -1, -1],  # a -1 draft is always rejected
        [3, -1, -1, -1],  # no drafts: the bonus from position 0
        [3, 1, 4, -1],  # two drafts: the bonus comes from position 2, its draft slot is ignored
    ]
    assert num_emitted.tolist() == [4, 2, 1, 1, 3]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_random_rows_with_a_certain_target(impl: Sampler) -> None:
    """p is one-hot up to e^-60: the draft equal to the target is accepted, any other is replaced by it."""
    logits = torch.zeros(3, 3, 10)
    logits[:, torch.arange(3), torch.tensor([5, 6, 7])] = 60.0
    drafts = torch.tensor([[5, 6], [5, 0], [-1, 6]])
    output, num_emitted = impl(logits, drafts, torch.tensor([2, 2, 2]), torch.ones(3), seed=3)
    assert output.tolist() == [[5, 6, 7], [5, 6, -1], [5, -1, -1]]
    assert num_emitted.tolist() == [3, 2, 1]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_deterministic_for_a_seed(impl: Sampler) -> None:
    logits, drafts, num_drafts, temperature = random_batch(6, 3, 64, torch.float32, seed=5)
    temperature = torch.full_like(temperature, 2.0)  # flat targets: outcomes depend on the random numbers
    first = impl(logits, drafts, num_drafts, temperature, seed=11)
    again = impl(logits, drafts, num_drafts, temperature, seed=11)
    other = impl(logits, drafts, num_drafts, temperature, seed=12)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], other[0])


def test_dispatch_on_cpu_uses_the_reference() -> None:
    logits, drafts, num_drafts, temperature = random_batch(4, 2, 30, torch.float32, seed=2)
    got = rejection_sample(logits, drafts, num_drafts, temperature, seed=4)
    expected = rejection_sample_reference(logits, drafts, num_drafts, temperature, seed=4)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


# --------------------------------------------------------------------------------------------------
# Distribution. One target (k+1 positions over a small vocabulary) shared by every row; each row draws
# its own drafts from q (mostly the target's top token: likely drafts, as n-gram drafts often are).
# Given that position i is reached, the pair (draft i accepted?, token emitted at i) has probability
# q_i(y) p_i(y) for "accepted, y" and p_i(y) (1 - q_i(y)) for "rejected, y" (the resample from p_i
# without y's draft), so the token alone is p_i; the bonus position emits p_k.
# --------------------------------------------------------------------------------------------------

VOCAB, K, TEMPERATURE = 8, 2, 0.8


def speculative_case(samples: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns logits [samples, K+1, VOCAB] (one row expanded), drafts [samples, K], p [K+1, V], q [K, V]."""
    generator = torch.Generator().manual_seed(2024)
    logits = torch.randn(K + 1, VOCAB, generator=generator) * 1.5
    p = torch.softmax(logits.double() / TEMPERATURE, dim=-1)
    q = 0.2 / VOCAB + 0.8 * torch.nn.functional.one_hot(p[:K].argmax(dim=-1), VOCAB).double()
    drafts = torch.multinomial(q, samples, replacement=True, generator=generator).T
    return logits.expand(samples, -1, -1), drafts, p, q


def position_pvalues(output: torch.Tensor, num_emitted: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> list[float]:
    """One p-value per position: the (accepted, token) joint at draft positions, the token at the bonus."""
    k, vocab = q.shape
    pvalues = []
    for i in range(k + 1):
        reached = num_emitted > i
        tokens = output[reached, i]
        if i < k:
            accepted = (num_emitted[reached] > i + 1).long()
            cells = accepted * vocab + tokens
            probabilities = torch.cat([p[i] * (1 - q[i]), p[i] * q[i]])
        else:
            cells, probabilities = tokens, p[k]
        observed = torch.bincount(cells, minlength=len(probabilities)).numpy()
        pvalues.append(chisquare_pvalue(observed, probabilities.numpy()))
    return pvalues


def wrong_sampler(
    logits: torch.Tensor, drafts: torch.Tensor, temperature: torch.Tensor, *, seed: int, mistake: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deliberately broken speculative sampler (every row random, every row with K drafts):
    'sqrt' accepts x with probability p(x)**0.5; 'keep_draft' resamples from p without removing x;
    'unweighted_tiles' resamples as if the tiles' sums were merged without weighing each by its max (bf16
    tiles), i.e. from the residual divided by its tile's max."""
    generator = torch.Generator().manual_seed(seed)
    probs = torch.softmax(logits.float() / temperature[:, None, None], dim=-1)
    batch, _, vocab = probs.shape
    p_draft = probs[:, :K].gather(-1, drafts[..., None]).squeeze(-1)
    accept_probability = p_draft.sqrt() if mistake == "sqrt" else p_draft
    accepted = torch.rand(batch, K, generator=generator) < accept_probability
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    residual = probs.clone()
    if mistake != "keep_draft":
        residual[:, :K].scatter_(-1, drafts[..., None], 0.0)
    if mistake == "unweighted_tiles":
        tiles = torch.nn.functional.pad(residual, (0, -vocab % BF16_TILE)).unflatten(-1, (-1, BF16_TILE))
        residual = (tiles / tiles.amax(dim=-1, keepdim=True)).flatten(-2)[..., :vocab]
    final = torch.multinomial(residual.reshape(-1, vocab), 1, generator=generator).reshape(batch, K + 1)
    output = torch.cat([drafts, torch.full((batch, 1), -1)], dim=1)
    output = torch.where(torch.arange(K + 1) < num_accepted[:, None], output, -1)
    output.scatter_(1, num_accepted[:, None], final.gather(1, num_accepted[:, None]))
    return output, num_accepted + 1


# The interpreted Triton kernels cost tens of ms per row, so they get fewer samples; the wrong-sampler
# test below shows that even that many samples reject a wrong sampler overwhelmingly.
SAMPLES = {"rejection_sample_reference": 20_000, "rejection_sample_triton": 500}


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_random_rows_preserve_the_target_distribution(impl: Sampler) -> None:
    samples = SAMPLES[impl.__name__]
    logits, drafts, p, q = speculative_case(samples)
    num_drafts = torch.full((samples,), K)
    output, num_emitted = impl(logits, drafts, num_drafts, torch.full((samples,), TEMPERATURE), seed=99)
    pvalues = position_pvalues(output, num_emitted, p, q)
    assert min(pvalues) > 1e-4, pvalues


@pytest.mark.parametrize("samples", sorted(set(SAMPLES.values())))
@pytest.mark.parametrize("mistake", ["sqrt", "keep_draft"])
def test_the_distribution_test_rejects_a_wrong_sampler(mistake: str, samples: int) -> None:
    logits, drafts, p, q = speculative_case(samples)
    output, num_emitted = wrong_sampler(logits, drafts, torch.full((samples,), TEMPERATURE), seed=99, mistake=mistake)
    pvalues = position_pvalues(output, num_emitted, p, q)
    assert pvalues[0] < 1e-6, pvalues


# The same over several vocab tiles (bf16: 512 columns a tile in kernel 1): the hot columns, where the mass is,
# lie in every tile, several in a tile with the draft; the walk kernel merges the tiles' sums and samples the
# residual by its running sum across tiles, then across one tile's columns.
BF16_TILE, TILED_VOCAB, TILED_SAMPLES = 512, 1300, 300
HOT = [3, 200, 520, 600, 1023, 1100, 1200, 1299]  # the likely drafts (520, 600) come first in their tile


def tiled_case(samples: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """speculative_case's over TILED_VOCAB bf16 columns (three tiles), the mass on HOT, the rest at -30."""
    generator = torch.Generator().manual_seed(2025)
    logits = torch.full((K + 1, TILED_VOCAB), -30.0)
    logits[:, HOT] = torch.randn(K + 1, len(HOT), generator=generator) * 1.5
    logits = logits.to(torch.bfloat16)
    p = torch.softmax(logits.double() / TEMPERATURE, dim=-1)
    q = torch.zeros(K, TILED_VOCAB, dtype=torch.float64)
    q[:, HOT] = 0.2 / len(HOT)
    q[torch.arange(K), p[:K].argmax(dim=-1)] += 0.8
    drafts = torch.multinomial(q, samples, replacement=True, generator=generator).T
    return logits.expand(samples, -1, -1), drafts, p, q


def test_random_rows_preserve_the_target_across_vocab_tiles() -> None:
    logits, drafts, p, q = tiled_case(TILED_SAMPLES)
    temperature = torch.full((TILED_SAMPLES,), TEMPERATURE)
    output, num_emitted = rejection_sample_triton(logits, drafts, torch.full((TILED_SAMPLES,), K), temperature, seed=5)
    pvalues = position_pvalues(output, num_emitted, p, q)
    assert min(pvalues) > 1e-4, pvalues


@pytest.mark.parametrize("mistake", ["unweighted_tiles", "keep_draft"])
def test_the_tiled_distribution_test_rejects_a_wrong_sampler(mistake: str) -> None:
    logits, drafts, p, q = tiled_case(TILED_SAMPLES)
    temperature = torch.full((TILED_SAMPLES,), TEMPERATURE)
    output, num_emitted = wrong_sampler(logits, drafts, temperature, seed=5, mistake=mistake)
    pvalues = position_pvalues(output, num_emitted, p, q)
    assert min(pvalues) < 1e-6, pvalues
