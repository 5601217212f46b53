"""Workload: deterministic requests whose lengths, kinds, arrivals and copy structure are as configured."""


import numpy as np
import pytest

from simharness.corpus import load_corpus
from simharness.scenario import LengthDist, Workload
from simharness.workload import KINDS, arrival_times, build_requests


def workload(**kw) -> Workload:
    return Workload.model_validate(kw)


def assert_same(a, b):
    for field in ("kind", "prompt_len", "output_len"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    for x, y in zip(a.prompt_tokens + a.output_tokens, b.prompt_tokens + b.output_tokens, strict=True):
        np.testing.assert_array_equal(x, y)


def test_deterministic_for_a_seed():
    cfg = workload(num_requests=60, arrival="gamma", burstiness=0.5)
    a, b = build_requests(cfg, seed=7), build_requests(cfg, seed=7)
    assert_same(a, b)
    np.testing.assert_array_equal(a.arrival_s, b.arrival_s)
    c = build_requests(cfg, seed=8)
    assert any(len(x) != len(y) or (x != y).any() for x, y in zip(a.output_tokens, c.output_tokens, strict=True))


def test_content_does_not_depend_on_the_arrival_process():
    closed = build_requests(workload(num_requests=40), seed=3)
    poisson = build_requests(workload(num_requests=40, arrival="poisson", rate=5.0), seed=3)
    assert closed.arrival_s is None
    assert_same(closed, poisson)


def test_token_streams_match_lengths():
    reqs = build_requests(workload(num_requests=150), seed=1)
    assert len(reqs) == 150
    for arrays, lengths in ((reqs.prompt_tokens, reqs.prompt_len), (reqs.output_tokens, reqs.output_len)):
        assert [len(a) for a in arrays] == lengths.tolist()
        assert all(a.dtype == np.int32 and a.min() >= 0 and a.max() < reqs.vocab_size for a in arrays)
    assert reqs.prompt_len.dtype == reqs.output_len.dtype == np.int64


@pytest.mark.parametrize(
    "dist",
    [
        LengthDist(dist="fixed", value=77),
        LengthDist(dist="uniform", min=50, max=300),
        LengthDist(dist="normal", mean=200, std=80, min=120, max=260),
        LengthDist(dist="corpus", min=20, max=400),
    ],
    ids=lambda d: d.dist,
)
def test_length_distributions(dist):
    reqs = build_requests(workload(num_requests=300, prompt_len=dist, output_len=dist), seed=2)
    for lengths in (reqs.prompt_len, reqs.output_len):
        if dist.dist == "fixed":
            assert (lengths == dist.value).all()
            continue
        assert lengths.min() >= dist.min and lengths.max() <= dist.max
        assert len(np.unique(lengths)) > 20
    if dist.dist == "uniform":
        assert abs(reqs.prompt_len.mean() - 175) < 15
    if dist.dist == "normal":
        assert (reqs.prompt_len == dist.min).any() and (reqs.prompt_len == dist.max).any()  # clipped tails


def test_kinds_follow_weights():
    reqs = build_requests(workload(num_requests=1000, kinds={"code_edit": 0.6, "free": 0.4}), seed=4)
    share = np.bincount(reqs.kind, minlength=len(KINDS)) / len(reqs)
    assert reqs.kind_names == KINDS
    assert abs(share[KINDS.index("code_edit")] - 0.6) < 0.05
    assert share[KINDS.index("summarize")] == 0


def copied_fraction(prompt: np.ndarray, output: np.ndarray, n: int = 4) -> float:
    """Share of the output's n-grams that also occur in the prompt."""
    seen = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    grams = [tuple(output[i : i + n]) for i in range(len(output) - n + 1)]
    return sum(g in seen for g in grams) / len(grams)


def test_kinds_differ_in_how_much_the_output_copies_the_prompt():
    reqs = build_requests(workload(num_requests=240), seed=5)
    copied = {
        name: np.mean(
            [copied_fraction(reqs.prompt_tokens[i], reqs.output_tokens[i]) for i in np.flatnonzero(reqs.kind == k)]
        )
        for k, name in enumerate(KINDS)
    }
    assert copied["code_edit"] > 0.7
    assert 0.25 < copied["summarize"] < 0.7
    assert copied["free"] < 0.2


def test_code_edit_renames_and_changes_lines():
    natural = LengthDist(dist="corpus", min=1, max=4096)  # the output is the whole edited passage
    cfg = workload(num_requests=60, kinds={"code_edit": 1.0}, prompt_len=natural, output_len=natural)
    reqs = build_requests(cfg, seed=6)
    tok = load_corpus().tokenizer
    changed = renamed = 0
    for prompt, output in zip(reqs.prompt_tokens, reqs.output_tokens, strict=True):
        instruction, body = tok.decode(prompt).split("\n\n", 1)
        text = tok.decode(output)
        assert instruction.startswith("Rewrite this code")
        changed += text != body  # a one-line passage has no line to change and nothing to rename
        if "rename `" in instruction:
            renamed += instruction.split("`")[3] in text
    assert changed >= 55 and renamed > 40


def test_arrival_processes():
    n, rate = 20_000, 8.0
    rng = np.random.default_rng(0)
    poisson = arrival_times(workload(arrival="poisson", rate=rate), n, rng)
    assert poisson[-1] == pytest.approx(n / rate)  # vLLM's rescaling: mean gap exactly 1 / rate
    gaps = np.diff(poisson, prepend=0.0)
    assert (gaps > 0).all()
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.04)
    for shape in (0.25, 4.0):
        times = arrival_times(workload(arrival="gamma", rate=rate, burstiness=shape), n, rng)
        gaps = np.diff(times, prepend=0.0)
        assert gaps.mean() == pytest.approx(1 / rate)
        assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(shape), rel=0.05)
    assert arrival_times(workload(arrival="closed"), n, rng) is None
