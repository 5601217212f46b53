"""vLLM's own scheduler beside the harness's policy (`simharness.policy`): the same arrivals and the same token
outcomes drive both, step by step, and their batches are compared (docs/host-costs.md, "vLLM's scheduler as
the policy"). Needs vLLM.

Each request's outcomes are drawn once: for its j-th decode, how many of the scheduled drafts are accepted. Each
scheduler then runs on its own (a step it schedules differently sees other requests' outcomes next), so a
difference is a difference of the policies, not of the draws.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from simharness.policy import EMITTED, PREFILL, REQ, TOKENS, VERIFIED, BatchScheduler
from simharness.scenario import Scheduler as SchedulerConfig
from simharness.vllmhost import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    VOCAB,
    engine_request,
    make_scheduler,
    model_dir,
    vllm_request,
)


@dataclass(frozen=True)
class PolicyCase:
    """Requests (prompt and output lengths, the step before which each arrives) and the scheduler's settings."""

    prompt_len: tuple[int, ...]
    output_len: tuple[int, ...]
    arrive_step: tuple[int, ...]  # ascending: requests arrive in id order
    k: int
    async_scheduling: bool
    max_num_seqs: int = 256
    max_batched_tokens: int = 8192
    accept_p: float = 0.7  # each draft, in order, accepted with this chance
    seed: int = 0


class Outcomes:
    """Per request, its tokens generated so far and, for its j-th decode, the drafts accepted (of k)."""

    def __init__(self, case: PolicyCase):
        rng = random.Random(case.seed)
        self.case = case
        self.accepted = [[accepted_drafts(rng, case.k, case.accept_p) for _ in range(n)] for n in case.output_len]
        self.generated = [0] * len(case.output_len)
        self.decodes = [0] * len(case.output_len)

    def emit(self, rid: int, decode: bool, completes: bool, slots: int) -> int:
        """Tokens a step emits for `rid`: a decode 1 + its accepted drafts of `slots`, a prompt's last chunk 1,
        none past the request's output length."""
        left = self.case.output_len[rid] - self.generated[rid]
        if decode:
            n = min(1 + min(self.accepted[rid][self.decodes[rid]], slots), left) if left > 0 else 0
            self.decodes[rid] += 1
        else:
            n = min(int(completes), left)
        self.generated[rid] += n
        return n


def accepted_drafts(rng: random.Random, k: int, p: float) -> int:
    accepted = 0
    while accepted < k and rng.random() < p:
        accepted += 1
    return accepted


class HarnessSide:
    """The harness's BatchScheduler, with at most `depth` steps in flight."""

    def __init__(self, case: PolicyCase):
        cfg = SchedulerConfig(max_num_seqs=case.max_num_seqs, max_num_batched_tokens=case.max_batched_tokens)
        self.case = case
        self.policy = BatchScheduler(cfg, np.array(case.prompt_len), np.array(case.output_len))
        self.outcomes = Outcomes(case)
        self.in_flight: deque = deque()
        self.prompt_left = list(case.prompt_len)

    def arrive(self, rid: int) -> None:
        self.policy.arrive(rid)

    def step(self) -> dict[int, int]:
        batch = self.policy.schedule(self.case.k)
        scheduled = {int(r): int(t) for r, t in zip(batch.table[REQ], batch.table[TOKENS], strict=True)}
        settle(self, batch if scheduled else None)
        return scheduled

    def settle_oldest(self) -> None:
        batch = self.in_flight.popleft()
        for i in range(batch.size):
            rid, tokens = int(batch.table[REQ, i]), int(batch.table[TOKENS, i])
            decode = batch.table[PREFILL, i] == 0
            if not decode:
                self.prompt_left[rid] -= tokens
            completes = not decode and self.prompt_left[rid] == 0
            batch.table[EMITTED, i] = self.outcomes.emit(rid, decode, completes, int(batch.table[VERIFIED, i]))
        self.policy.settle(batch)

    def done(self) -> bool:
        return self.policy.n_finished == len(self.case.prompt_len)


class VllmSide:
    """vLLM's Scheduler (AsyncScheduler with async scheduling) on the same requests; without async scheduling
    each request that sampled is handed k drafts after each step, as the engine does with a CPU drafter."""

    def __init__(self, case: PolicyCase, directory: Path):
        longest = max(p + o for p, o in zip(case.prompt_len, case.output_len, strict=True))
        blocks = len(case.prompt_len) * (longest // BLOCK_SIZE + 2) + 64  # every request's KV at once: no preemption
        self.case = case
        self.scheduler = make_scheduler(directory, k=case.k, async_scheduling=case.async_scheduling,
                                        max_num_seqs=case.max_num_seqs, max_batched_tokens=case.max_batched_tokens,
                                        blocks=blocks)
        self.outcomes = Outcomes(case)
        self.in_flight: deque = deque()
        self.rng = random.Random(case.seed)

    def arrive(self, rid: int) -> None:
        prompt = [self.rng.randrange(VOCAB) for _ in range(self.case.prompt_len[rid])]
        self.scheduler.add_request(vllm_request(engine_request(str(rid), prompt, self.case.output_len[rid])))

    def step(self) -> dict[int, int]:
        requests = self.scheduler.requests
        prefilling = {r for r, q in requests.items() if q.num_computed_tokens < q.num_prompt_tokens}
        out = self.scheduler.schedule()
        scheduled = {int(r): int(t) for r, t in out.num_scheduled_tokens.items()}
        done_prompt = {r for r in prefilling & set(out.num_scheduled_tokens)
                       if requests[r].num_computed_tokens >= requests[r].num_prompt_tokens}
        settle(self, (out, prefilling, done_prompt) if scheduled else None)
        return scheduled

    def settle_oldest(self) -> None:
        from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

        out, prefilling, done_prompt = self.in_flight.popleft()
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for r in ids:
            decode = r not in prefilling
            n = self.outcomes.emit(int(r), decode, r in done_prompt, len(out.scheduled_spec_decode_tokens.get(r, ())))
            sampled.append([self.rng.randrange(VOCAB) for _ in range(n)])
        runner = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                   sampled_token_ids=sampled)
        self.scheduler.update_from_output(out, runner)
        if self.case.k and not self.case.async_scheduling:
            live = [r for r, s in zip(ids, sampled, strict=True) if s and r in self.scheduler.requests]
            drafts = [[self.rng.randrange(VOCAB) for _ in range(self.case.k)] for _ in live]
            self.scheduler.update_draft_token_ids(DraftTokenIds(live, drafts))

    def done(self) -> bool:
        return not self.scheduler.has_unfinished_requests() and not self.in_flight


def settle(side, step) -> None:
    """Put a scheduled step in flight (None: nothing scheduled) and take in the oldest once `depth` are in flight,
    or when nothing new was scheduled."""
    if step is not None:
        side.in_flight.append(step)
    depth = 2 if side.case.async_scheduling else 1
    if side.in_flight and (step is None or len(side.in_flight) >= depth):
        side.settle_oldest()


def compare_policies(case: PolicyCase, max_steps: int = 100_000) -> list[dict]:
    """Run both schedulers on `case` until both finished every request; one row per step: each one's batch
    (request id -> tokens scheduled) and whether they are the same."""
    if max(p + o for p, o in zip(case.prompt_len, case.output_len, strict=True)) + case.k > MAX_MODEL_LEN:
        raise ValueError(f"a request's prompt and output exceed vLLM's max_model_len here ({MAX_MODEL_LEN})")
    rows = []
    with model_dir() as directory:
        harness, vllm = HarnessSide(case), VllmSide(case, directory)
        arrivals = deque(enumerate(case.arrive_step))
        step = 0
        while arrivals or not (harness.done() and vllm.done()):
            if step >= max_steps:
                raise RuntimeError(f"not finished after {max_steps} steps")
            while arrivals and arrivals[0][1] <= step:
                rid, _ = arrivals.popleft()
                harness.arrive(rid)
                vllm.arrive(rid)
            ours = harness.step() if not harness.done() else {}
            theirs = vllm.step() if not vllm.done() else {}
            rows.append({"step": step, "harness": ours, "vllm": theirs, "same": ours == theirs})
            step += 1
    return rows


def first_difference(rows: list[dict]) -> dict | None:
    """The first step whose batches differ, with what each scheduled that the other did not (None: no step)."""
    for row in rows:
        if not row["same"]:
            ours, theirs = row["harness"], row["vllm"]
            return {"step": row["step"],
                    "harness_only": {r: t for r, t in ours.items() if theirs.get(r) != t},
                    "vllm_only": {r: t for r, t in theirs.items() if ours.get(r) != t}}
    return None
