"""The device fit's robustness (simharness.profile_fit): it starts from several launch tails, and it reports the
near-equal optima the steps cannot tell apart (the per-forward time against the weight reads, an unmeasured tail)."""

import numpy as np
import pytest
from test_profile import SIZES, TAILS, design, known_prior, measured, truth

from simharness.profile import PER_FORWARD, profile_times
from simharness.profile_fit import fit_device_starts, near_equal_optima


def fitted(x: np.ndarray, seed: int = 0, launch_bound: bool = True):
    rng = np.random.default_rng(seed)
    coef = truth()
    window, launch, depth = measured(rng, x, coef)
    if not launch_bound:  # depth 3's launches end early: no step of it is bound by the launch
        launch = np.where(depth == 3, 0.1 * profile_times(coef, SIZES, x), launch)
        window = np.maximum(profile_times(coef, SIZES, x), launch + np.array([TAILS[d] for d in depth]))
    prior = known_prior(coef)
    best, starts = fit_device_starts(x, window, launch, depth, SIZES, prior)
    return coef, best, near_equal_optima(x, window, launch, depth, SIZES, prior, best, starts)


def test_the_per_forward_time_is_pinned_where_kv_reads_vary_and_a_range_where_they_do_not():
    rng = np.random.default_rng(0)
    # k up to 8: a decode row's attention FLOPs grow with its tokens, its KV reads do not, which tells the attention's
    # slowdown from the reads (as the profile grid's k = 0-8 do); at k <= 4 it trades with the per-forward time
    x = design(rng, 600, 64, 8, 4096)
    coef, best, near = fitted(x)
    assert best.coef[PER_FORWARD] == pytest.approx(coef[PER_FORWARD], rel=0.05)
    lo, hi = near["per_forward_us"]  # the fits held at the scan's next multiples (of at least 100 µs) are further
    assert 0.7 * coef[PER_FORWARD] * 1e6 <= lo <= hi <= 1.3 * coef[PER_FORWARD] * 1e6
    # no context and no prefill: every forward reads the weights once and nothing else, so the per-forward time and
    # the weight reads (the memory slowdown) trade off freely (in steps of a few tokens, none compute bound)
    x = design(rng, 600, 32, 4, 4096)
    x[:, 2] = x[:, 3] = x[:, 4] = 0.0
    x[:, 6] = x[:, 7] = 0.0  # no history, no prompt before a chunk
    _, _, flat = fitted(x)
    lo, hi = flat["per_forward_us"]
    assert hi > 2 * max(lo, 100.0)
    assert flat["memory_efficiency"][1] > 1.2 * flat["memory_efficiency"][0]
    assert set(flat) >= {"memory_efficiency", "compute_efficiency", "attention_efficiency"}


def test_a_tail_no_step_is_bound_by_is_reported_as_a_range_and_the_measured_ones_are_recovered():
    rng = np.random.default_rng(1)
    x = design(rng, 600, 64, 4, 2048)
    _, best, near = fitted(x, launch_bound=False)
    for d in (1, 2):
        assert best.tails[d] == pytest.approx(TAILS[d], rel=0.01)
        assert near["tail_us"][d] == pytest.approx([TAILS[d] * 1e6] * 2, rel=0.01)
    lo, hi = near["tail_us"][3]
    assert hi - lo > 200.0  # the starts' tails fit equally, up to where they would bind a step: nothing measured it
