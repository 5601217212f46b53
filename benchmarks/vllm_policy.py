"""The harness's scheduling policy against vLLM's own Scheduler, step by step (`simharness.vllmpolicy`): the same
arrivals and token outcomes, each case with and without async scheduling; how many steps schedule the same batch
and the first that does not. Needs vLLM (docs/host-costs.md, "vLLM's scheduler as the policy").

    PYTHONPATH=$PWD /work/vllm-venv/bin/python benchmarks/vllm_policy.py --out results/host
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pandas as pd

from simharness.vllmpolicy import PolicyCase, compare_policies, first_difference


def mixed(n: int, seed: int, prompts: tuple[int, int], outputs: tuple[int, int], stagger: int) -> dict:
    """`n` requests of uniform prompt and output lengths, arriving over `stagger` steps."""
    rng = random.Random(seed)
    return {"prompt_len": tuple(rng.randint(*prompts) for _ in range(n)),
            "output_len": tuple(rng.randint(*outputs) for _ in range(n)),
            "arrive_step": tuple(sorted(rng.randint(0, stagger) for _ in range(n)))}


CASES = {
    "64 requests, budget 2048, 32 seqs": {**mixed(64, 1, (64, 3000), (8, 200), 100), "k": 3,
                                          "max_batched_tokens": 2048, "max_num_seqs": 32},
    "32 requests, budget 512, 16 seqs": {**mixed(32, 2, (64, 3000), (8, 200), 50), "k": 3,
                                         "max_batched_tokens": 512, "max_num_seqs": 16},
    "32 requests, no drafts": {**mixed(32, 3, (64, 3000), (8, 200), 50), "k": 0, "max_batched_tokens": 2048,
                               "max_num_seqs": 16},
    "48 requests, k 8, budget 8192": {**mixed(48, 4, (16, 1024), (1, 64), 10), "k": 8},
    "64 short prompts at once, budget 130": {**mixed(64, 5, (16, 16), (32, 32), 0), "k": 3,
                                                             "max_batched_tokens": 130, "max_num_seqs": 64},
}


def random_cases(n: int, seed: int) -> dict[str, dict]:
    """`n` small cases of random sizes, budgets, k and arrivals: where the two policies part, if anywhere."""
    rng = random.Random(seed)
    cases = {}
    for i in range(n):
        seqs = rng.choice((4, 8, 16, 64))
        budget = max(seqs, rng.choice((64, 130, 256, 512, 2048)))
        cases[f"random {i}"] = {**mixed(rng.randint(4, 48), seed * 1000 + i, (1, rng.choice((64, 600, 3000))),
                                        (1, rng.choice((8, 64))), rng.choice((0, 20))),
                                "k": rng.choice((0, 1, 3, 8)), "max_batched_tokens": budget, "max_num_seqs": seqs}
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/host"))
    parser.add_argument("--random", type=int, default=40, help="random cases besides the named ones")
    args = parser.parse_args()
    rows = []
    for name, kwargs in (CASES | random_cases(args.random, seed=0)).items():
        for is_async in (False, True):
            steps = compare_policies(PolicyCase(async_scheduling=is_async, **kwargs))
            first = first_difference(steps)
            rows.append({"case": name, "async_scheduling": is_async, "requests": len(kwargs["prompt_len"]),
                         "steps_harness": sum(bool(s["harness"]) for s in steps),
                         "steps_vllm": sum(bool(s["vllm"]) for s in steps),
                         "same_steps": sum(s["same"] for s in steps), "steps": len(steps),
                         "first_difference": "" if first is None else str(first)})
            print(rows[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(args.out / "policy-vs-vllm.csv", index=False)


if __name__ == "__main__":
    main()
