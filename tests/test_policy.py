"""The host's batching decision and bookkeeping (policy.BatchScheduler and its compiled functions)."""

import numpy as np

from simharness.policy import COMPLETES, EMITTED, N_RUNNING, PREFILL, SLOTS, VERIFIED, BatchScheduler
from simharness.scenario import Scheduler


def running(sched: BatchScheduler) -> np.ndarray:
    """The running request ids in admission order."""
    return sched.running_ids[: sched.counts[N_RUNNING]]


def scheduler(prompt, output, **cfg) -> BatchScheduler:
    sched = BatchScheduler(Scheduler.model_validate(cfg), np.array(prompt), np.array(output))
    for rid in range(len(prompt)):
        sched.arrive(rid)
    return sched


def test_fcfs_admission_chunks_the_prompt_that_overflows_the_budget():
    sched = scheduler([6, 8, 5], [3, 3, 3], max_num_batched_tokens=10)
    first = sched.schedule(k=2)
    np.testing.assert_array_equal(first.req, [0, 1])
    np.testing.assert_array_equal(first.tokens, [6, 4])
    np.testing.assert_array_equal(first.table[COMPLETES], [1, 0])
    assert (first.n_prefill, first.n_tokens) == (2, 10)
    # async: request 0 decodes with k placeholder slots before step 1 settles; request 1's prompt goes on;
    # request 2 gets what is left of the budget
    second = sched.schedule(k=2)
    np.testing.assert_array_equal(second.req, [0, 1, 2])
    np.testing.assert_array_equal(second.tokens, [3, 4, 3])
    np.testing.assert_array_equal(second.table[PREFILL], [0, 1, 1])
    np.testing.assert_array_equal(second.table[COMPLETES], [0, 1, 0])
    np.testing.assert_array_equal(second.table[SLOTS], [2, 0, 0])
    np.testing.assert_array_equal(second.table[VERIFIED], second.table[SLOTS])
    assert (second.n_prefill, second.n_tokens) == (2, 10)


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    sched = scheduler([6, 8], [3, 3], max_num_batched_tokens=10, chunked_prefill=False)
    np.testing.assert_array_equal(sched.schedule(k=2).req, [0])
    np.testing.assert_array_equal(sched.schedule(k=2).req, [0])  # 3 + 8 tokens would not fit
    assert sched.has_waiting()


def test_max_num_seqs_and_requests_whose_steps_in_flight_complete_them():
    sched = scheduler([4, 4, 4], [2, 2, 2], max_num_seqs=2)
    np.testing.assert_array_equal(sched.schedule(k=3).req, [0, 1])
    np.testing.assert_array_equal(sched.schedule(k=3).req, [0, 1])  # one token left each, one step can emit it
    assert len(sched.schedule(k=3).req) == 0  # both are complete once those steps are settled
    np.testing.assert_array_equal(running(sched), [0, 1])


def test_held_drafts_set_the_slots_and_the_budget_counts_them():
    sched = scheduler([2, 2, 2], [9, 9, 9], max_num_batched_tokens=8)
    sched.schedule(k=4)  # the three prefills
    batch = sched.schedule(k=4, held=np.array([4, 0, 3]))
    np.testing.assert_array_equal(batch.req, [0, 1])  # 5 + 1 tokens; request 2's 4 would pass the budget
    np.testing.assert_array_equal(batch.table[SLOTS], [4, 0])
    assert batch.n_tokens == 6


def test_settle_finishes_requests_in_batch_order_and_keeps_the_running_order():
    sched = scheduler([2, 2, 2], [1, 3, 2], max_num_batched_tokens=100)
    prefill = sched.schedule(k=2)
    prefill.table[EMITTED] = 1  # every prompt completes and emits its first token
    np.testing.assert_array_equal(sched.settle(prefill), [0])
    decode = sched.schedule(k=2)
    np.testing.assert_array_equal(decode.req, [1, 2])
    decode.table[EMITTED] = [1, 1]
    np.testing.assert_array_equal(sched.settle(decode), [2])
    np.testing.assert_array_equal(running(sched), [1])
    np.testing.assert_array_equal(sched.committed, [1, 2, 2])
    assert sched.n_finished == 2


def test_trim_cuts_the_decodes_verified_slots_to_the_drafts_held():
    sched = scheduler([2, 2, 8], [9, 9, 9], max_num_batched_tokens=10)
    sched.schedule(k=2)  # request 2's prompt is cut after 6 tokens
    batch = sched.schedule(k=2)
    np.testing.assert_array_equal(batch.table[PREFILL], [0, 0, 1])
    assert batch.trim(np.array([1, 5, 9]), 2) == -1  # a prefill keeps no slots, held or not
    np.testing.assert_array_equal(batch.table[VERIFIED], [1, 2, 0])
    np.testing.assert_array_equal(batch.table[SLOTS], [2, 2, 0])
    np.testing.assert_array_equal(batch.tokens, [3, 3, 2])
