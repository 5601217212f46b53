"""Filled slots (`invalid_slots: fill`, the GPU proposer) at the sim level and at hil on the CPU (tiny model): a decode
verifies every slot, the proposer's fillers (the last token) past its valid drafts as drafts, and the real rejection
sampler accepts a filler where the reference repeats the last token. The sim's replay accepts the same ones, so hil
takes the sim's decisions step by step where nothing depends on timing (issue 35: it did not, at 13 of 120 requests
of the bursty-long validation family)."""

import dataclasses

import numpy as np
import pytest
from helpers import hil_requests, simulate
from test_hil import N_REQUESTS, VOCAB, hil_scenario, model, requests, run_hil  # noqa: F401

from simharness.records import COUNT_COLUMNS


def repeating_requests():
    """As many steered requests as the closed loop's users (every one sent at once: the batches depend on no
    timing), each reference with a run of its third token where the motif's match breaks off."""
    n = hil_scenario().workload.concurrency
    every = hil_requests(N_REQUESTS, VOCAB, steer_all=True)
    outputs = []
    for out in every.output_tokens[:n]:
        out = out.copy()
        out[3:9] = out[2]
        outputs.append(out)
    return dataclasses.replace(every, kind=every.kind[:n], prompt_len=every.prompt_len[:n],
                               output_len=every.output_len[:n], prompt_tokens=every.prompt_tokens[:n],
                               output_tokens=outputs)  # fmt: skip


@pytest.mark.parametrize(("depth", "policy"), [(1, "wait"), (2, "optimistic"), (3, "wait")])
def test_hil_and_sim_accept_the_same_fillers(depth, policy, model):  # noqa: F811
    first = repeating_requests()
    hil_sc = hil_scenario(depth, policy, "ngram_gpu", "fill")
    sim_sc = hil_sc.model_copy(deep=True)
    sim_sc.engine.level = "sim"
    _, hil = run_hil(hil_sc, first, model)
    sim, _ = simulate(sim_sc, first)
    counts = COUNT_COLUMNS  # n_reqs .. wasted_slots: the batches, their chunks, draft slots, outcomes
    hil_steps, sim_steps = hil.steps_frame(), sim.steps_frame()
    np.testing.assert_array_equal(hil_steps[counts].to_numpy(), sim_steps[counts].to_numpy())
    # fillers were accepted: more drafts accepted than valid ones in some step
    assert (hil_steps["accepted"] > hil_steps["drafts_valid"]).any()
