"""Acceptance models: iid and positional statistics, replay tables against the real n-gram proposer."""

import dataclasses

import numpy as np
import pytest
import torch
from numba import njit

from simharness.acceptance import _replay_request, accepted_drafts, build_replay, held_drafts, make_acceptance
from simharness.kernels.ngram import propose_ngram_reference
from simharness.kernels.ngram_row import propose_ngram_row
from simharness.scenario import LengthDist, Speculation, Workload
from simharness.workload import KINDS, build_requests

N_DRAWS = 400_000


def speculation(**kw) -> Speculation:
    return Speculation.model_validate(kw)


@pytest.fixture(scope="module")
def requests():
    cfg = Workload(
        num_requests=90, prompt_len=LengthDist(dist="uniform", min=96, max=384), output_len=LengthDist(value=64)
    )
    return build_requests(cfg, seed=11)


@njit(cache=True)
def _accepted_per_draw(survival: np.ndarray, offset: np.ndarray, accepted: np.ndarray, n_drafts: int,
                       u: np.ndarray) -> np.ndarray:
    out = np.empty(len(u), dtype=np.int64)
    for i in range(len(u)):
        out[i] = accepted_drafts(survival, offset, accepted, 0, 1, n_drafts, u[i])
    return out


def draw(model, k: int, n_drafts: int | None = None, seed: int = 0) -> np.ndarray:
    """Accepted drafts of N_DRAWS steps of request 0 at committed length 1, each verifying n_drafts (k) drafts."""
    u = np.random.default_rng(seed).random(N_DRAWS)
    return _accepted_per_draw(model.survival, model.offset, model.accepted, k if n_drafts is None else n_drafts, u)


def held(model, req, committed) -> np.ndarray:
    return np.array([held_drafts(model.survival, model.offset, model.valid, r, j)
                     for r, j in zip(req, committed, strict=True)])


def accepted(model, req, committed, n_drafts) -> np.ndarray:
    """Accepted drafts of deterministic (replay) lookups."""
    return np.array([accepted_drafts(model.survival, model.offset, model.accepted, r, j, n, 0.0)
                     for r, j, n in zip(req, committed, n_drafts, strict=True)])


@pytest.mark.parametrize("alpha", [0.2, 0.6, 0.9])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_iid_mean_emitted_tokens(requests, alpha, k):
    model = make_acceptance(speculation(k=k, acceptance={"model": "iid", "alpha": alpha}), requests)
    expected = (1 - alpha ** (k + 1)) / (1 - alpha)
    assert 1 + model.survival.sum() == pytest.approx(expected)  # tokens per step: 1 + sum_j P(accepted >= j)
    np.testing.assert_array_equal(held(model, np.arange(5), np.ones(5, dtype=np.int64)), k)
    accepted = draw(model, k, seed=k)
    assert accepted.min() >= 0 and accepted.max() <= k
    assert (accepted + 1).mean() == pytest.approx(expected, rel=0.01)


def test_accepted_is_capped_by_the_drafts_verified(requests):
    model = make_acceptance(speculation(k=5, acceptance={"model": "iid", "alpha": 0.95}), requests)
    assert draw(model, 5, n_drafts=2).max() == 2
    assert draw(model, 5, n_drafts=0).max() == 0


def test_positional_per_position_rates(requests):
    rates = [0.9, 0.7, 0.5, 0.3]
    model = make_acceptance(speculation(k=6, acceptance={"model": "positional", "rates": rates}), requests)
    accepted = draw(model, 6)
    reached = [(accepted >= j).mean() for j in range(1, 7)]
    np.testing.assert_allclose(reached, [*np.cumprod(rates), 0.0, 0.0], atol=0.004)
    short = make_acceptance(speculation(k=2, acceptance={"model": "positional", "rates": rates}), requests)
    np.testing.assert_allclose(short.survival, [0.9, 0.63])


@pytest.mark.parametrize("model", ["iid", "positional", "replay"])
def test_no_drafts_without_a_proposer(requests, model):
    for cfg in (
        speculation(proposer="none", acceptance={"model": model}),
        speculation(k=0, acceptance={"model": model}),
    ):
        acc = make_acceptance(cfg, requests)
        req = np.arange(len(requests))
        committed = np.ones(len(requests), dtype=np.int64)
        assert not held(acc, req, committed).any()
        assert not accepted(acc, req, committed, np.full(len(req), 4)).any()


def test_replay_valid_drafts_and_accept_are_table_lookups(requests):
    acc = make_acceptance(speculation(k=4), requests)
    req = np.array([0, 5, 5, 17])
    committed = np.array([1, 2, 30, 63])
    np.testing.assert_array_equal(held(acc, req, committed), acc.valid[acc.offset[req] + committed])
    full = accepted(acc, req, committed, held(acc, req, committed))
    np.testing.assert_array_equal(full, acc.accepted[acc.offset[req] + committed])
    np.testing.assert_array_equal(accepted(acc, req, committed, [1] * 4), np.minimum(full, 1))


def walk(acc, requests, r: int, k: int, cfg: Speculation) -> tuple[int, list[int]]:
    """Greedy decoding of request r from the tables, each step checked against the proposer.

    Returns the number of decode steps and the tokens emitted (prefill's first token included)."""
    prompt, output = requests.prompt_tokens[r], requests.output_tokens[r]
    history = np.concatenate([prompt, output])
    emitted = [int(output[0])]  # the prefill step emits the first token
    j, steps = 1, 0
    while j < len(output):
        drafts = propose_ngram_row(
            history[: len(prompt) + j], min_n=cfg.min_n, max_n=cfg.max_n, k=k, tie_break=cfg.tie_break
        )
        a = accepted_drafts(acc.survival, acc.offset, acc.accepted, r, j, drafts.size, 0.0)
        assert held_drafts(acc.survival, acc.offset, acc.valid, r, j) == drafts.size
        # greedy verification: the target emits its argmax (the reference token) at the first mismatch
        step = [*drafts[:a].tolist(), *output[j + a : j + a + 1].tolist()]
        assert step == output[j : j + a + 1].tolist()
        assert a == drafts.size or j + a >= len(output) or drafts[a] != output[j + a]
        emitted += step
        j += a + 1
        steps += 1
    return steps, emitted


@pytest.mark.parametrize("tie_break", ["earliest", "latest"])
def test_replay_walk_reproduces_the_reference_output(requests, tie_break):
    cfg = speculation(k=4, min_n=2, max_n=4, tie_break=tie_break)
    acc = make_acceptance(cfg, requests)
    for r in range(0, len(requests), 3):
        _, emitted = walk(acc, requests, r, 4, cfg)
        assert emitted == requests.output_tokens[r].tolist()


def test_replay_off_path_entries_and_smaller_k(requests):
    cfg = speculation(k=4, min_n=1, max_n=3)
    acc4 = make_acceptance(cfg, requests)
    acc2 = build_replay(requests, k=2, min_n=1, max_n=3, tie_break="earliest")
    rng = np.random.default_rng(0)
    for r, j in zip(rng.integers(len(requests), size=40), rng.integers(1, 64, size=40), strict=True):
        history = np.concatenate([requests.prompt_tokens[r], requests.output_tokens[r]])
        for k, acc in ((4, acc4), (2, acc2)):
            drafts = propose_ngram_row(history[: requests.prompt_len[r] + j], min_n=1, max_n=3, k=k)
            ref = requests.output_tokens[r][j : j + drafts.size]
            lead = int(np.cumprod(drafts[: ref.size] == ref).sum())
            assert acc.valid[acc.offset[r] + j] == drafts.size
            assert acc.accepted[acc.offset[r] + j] == lead


def test_replay_code_edit_accepts_far_more_than_free(requests):
    cfg = speculation(k=4)
    acc = make_acceptance(cfg, requests)
    tokens_per_step = {}
    for kind, name in enumerate(KINDS):
        steps = emitted = 0
        for r in np.flatnonzero(requests.kind == kind):
            s, e = walk(acc, requests, int(r), 4, cfg)
            steps, emitted = steps + s, emitted + len(e) - 1
        tokens_per_step[name] = emitted / steps
    assert tokens_per_step["code_edit"] > 2.2
    assert tokens_per_step["code_edit"] > tokens_per_step["summarize"] > tokens_per_step["free"]
    assert tokens_per_step["free"] < 1.5


def test_replay_is_deterministic():
    cfg = Workload(num_requests=30, output_len=LengthDist(value=48))
    a = make_acceptance(speculation(k=3), build_requests(cfg, seed=2))
    b = make_acceptance(speculation(k=3), build_requests(cfg, seed=2))  # new requests: no cache hit
    np.testing.assert_array_equal(a.valid, b.valid)
    np.testing.assert_array_equal(a.accepted, b.accepted)
    np.testing.assert_array_equal(a.offset, b.offset)


def _replay_reference(history, p, k, min_n, max_n, tie_break, fill):
    """The replay tables of one request from the numpy proposer, position by position (the old build); with `fill`
    the k slots past the valid drafts hold the last token (none before any token)."""
    n_out = len(history) - p
    valid, accepted = np.zeros(n_out, np.int64), np.zeros(n_out, np.int64)
    for j in range(n_out):
        drafts = propose_ngram_row(history[: p + j], min_n=min_n, max_n=max_n, k=k, tie_break=tie_break)
        valid[j] = drafts.size
        if fill and p + j > 0:
            drafts = np.concatenate([drafts, np.full(k - drafts.size, history[p + j - 1])])
        if drafts.size == 0:
            continue
        ref = history[p + j : p + j + drafts.size]
        same = drafts[: ref.size] == ref
        accepted[j] = ref.size if same.all() else int(same.argmin())
    return valid, accepted


@pytest.mark.parametrize("fill", [False, True])
@pytest.mark.parametrize("tie_break", ["earliest", "latest"])
def test_compiled_replay_pass_matches_the_numpy_proposer(tie_break, fill):
    """Random histories over small vocabularies (many repeats, so long matches and ties), every min_n <= max_n
    up to 4 and k up to 5, with and without fillers, and edge cases: an empty prompt, a one-token history, no
    output."""
    rng = np.random.default_rng(7)
    cases = [(np.array([3], np.int64), 1), (np.array([1, 1, 1, 1], np.int64), 0), (np.array([2, 2, 2], np.int64), 3)]
    for _ in range(120):
        vocab = int(rng.integers(2, 6))
        history = rng.integers(0, vocab, size=int(rng.integers(1, 60))).astype(np.int64)
        cases.append((history, int(rng.integers(0, len(history) + 1))))
    for history, p in cases:
        for min_n in range(1, 5):
            for max_n in range(min_n, 5):
                for k in (1, 3, 5):
                    n_out = len(history) - p
                    valid, accepted = np.zeros(n_out + 2, np.int64), np.zeros(n_out + 2, np.int64)
                    _replay_request(history, p, k, min_n, max_n, tie_break == "latest", fill, valid, accepted, 1)
                    want_valid, want_accepted = _replay_reference(history, p, k, min_n, max_n, tie_break, fill)
                    np.testing.assert_array_equal(valid[1 : n_out + 1], want_valid, err_msg=f"{history} {p}")
                    np.testing.assert_array_equal(accepted[1 : n_out + 1], want_accepted, err_msg=f"{history} {p}")
                    assert valid[0] == valid[-1] == accepted[0] == accepted[-1] == 0  # nothing outside its rows


def test_replay_with_fillers_accepts_those_the_reference_repeats(requests):
    """With fillers verified (`fill`, the GPU proposer), an entry accepts the leading slots of the kernels' reference
    proposer's k drafts, fillers (the last token) included, that equal the reference's next tokens."""
    # a request whose reference repeats its last prompt token where the n-gram match breaks off
    prompt = np.arange(100, 140, dtype=np.int32)
    output = np.concatenate([np.full(6, 139), np.arange(100, 110), np.full(5, 7)]).astype(np.int32)
    repeats = dataclasses.replace(requests, kind=requests.kind[:1], prompt_len=np.array([40]),
                                  output_len=np.array([len(output)]), prompt_tokens=[prompt], output_tokens=[output],
                                  random=None)  # fmt: skip
    k = 4
    cfg = speculation(k=k, invalid_slots="fill", min_n=2, max_n=4)
    rng = np.random.default_rng(1)
    cases = [(repeats, 0, j) for j in range(len(output))]
    cases += [(requests, int(r), int(j)) for r, j in zip(rng.integers(len(requests), size=40),
                                                         rng.integers(1, 64, size=40), strict=True)]
    fillers_accepted = 0
    for reqs, r, j in cases:
        acc = make_acceptance(cfg, reqs)
        history = np.concatenate([reqs.prompt_tokens[r], reqs.output_tokens[r]])
        size = reqs.prompt_len[r] + j
        drafts, valid = propose_ngram_reference(torch.from_numpy(history[None, :size].astype(np.int64)),
                                                torch.tensor([size]), min_n=2, max_n=4, k=k, invalid="fill")
        ref = reqs.output_tokens[r][j : j + k]
        lead = int(np.cumprod(drafts[0, : ref.size].numpy() == ref).sum())
        assert acc.valid[acc.offset[r] + j] == int(valid[0])
        assert accepted_drafts(acc.survival, acc.offset, acc.accepted, r, j, k, 0.0) == lead
        fillers_accepted += lead > int(valid[0])
    assert fillers_accepted >= 5
    # without fillers (trim) an entry accepts at most its valid drafts
    trim = make_acceptance(speculation(k=k, min_n=2, max_n=4), repeats)
    assert (trim.accepted <= trim.valid).all() and trim.accepted.sum() < make_acceptance(cfg, repeats).accepted.sum()
