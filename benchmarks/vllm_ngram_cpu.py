"""vLLM's own CPU n-gram proposer (`NgramProposer.propose`, the drafter of #29184's arm A) timed on this host, and
the fit of the harness's `ngram_cpu_us` + `ngram_cpu_per_req_us` x requests + `ngram_cpu_per_token_ns` x history
tokens (docs/seeds.md, #29184). Needs vLLM.

    PYTHONPATH=$PWD /work/vllm-venv/bin/python benchmarks/vllm_ngram_cpu.py --out results/host

Histories are random tokens from a 2,000-token vocabulary (matches happen, as in text); each request proposes
k = 3 with n = 2..2 (#29184's setting). Each (requests, history) point is timed `--calls` times by the thread's
CPU time after a warm-up; the median per point is fitted by relative least squares.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pandas as pd

from simharness.vllmhost import MAX_MODEL_LEN, vllm_version

REQUESTS = (1, 2, 4, 8, 16, 32, 64, 128)
HISTORY = (256, 1024, 4096)


def proposer(directory: Path, k: int, max_num_seqs: int):
    """vLLM's NgramProposer for k drafts, n = 2..2, from the local model config."""
    from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer

    model = ModelConfig(model=str(directory), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=MAX_MODEL_LEN)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_max=2, prompt_lookup_min=2,
                             target_model_config=model, target_parallel_config=ParallelConfig())
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192, max_model_len=MAX_MODEL_LEN,
                            is_encoder_decoder=False)
    return NgramProposer(VllmConfig(model_config=model, speculative_config=spec, scheduler_config=sched,
                                    device_config=DeviceConfig("cpu")))


def main() -> None:
    from simharness.vllmhost import model_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/host"))
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    version = vllm_version()
    rng = np.random.default_rng(0)
    rows = []
    with model_dir() as directory:
        drafter = proposer(directory, k=3, max_num_seqs=max(REQUESTS))
        tokens = np.zeros((max(REQUESTS), MAX_MODEL_LEN), dtype=np.int32)
        for n in REQUESTS:
            for history in HISTORY:
                lengths = np.zeros(max(REQUESTS), dtype=np.int32)
                lengths[:n] = history
                tokens[:n, :history] = rng.integers(0, 2000, size=(n, history))
                sampled = [[1]] * n
                times = []
                for call in range(args.calls + 20):
                    start = time.thread_time()
                    drafter.propose(3, sampled, lengths, tokens)
                    if call >= 20:  # the first calls warm up
                        times.append((time.thread_time() - start) * 1e6)
                q = np.percentile(times, [25, 50, 75])
                rows.append({"requests": n, "history": history, "p25_us": q[0], "median_us": q[1], "p75_us": q[2]})
                print(rows[-1], flush=True)
    frame = pd.DataFrame(rows)
    x = np.column_stack([np.ones(len(frame)), frame["requests"], frame["requests"] * frame["history"]])
    y = frame["median_us"].to_numpy()
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    error = np.abs(x @ coef / y - 1)
    print(f"vLLM {version} NgramProposer.propose: {coef[0]:.1f} us + {coef[1]:.2f} us/request + "
          f"{coef[2] * 1e3:.2f} ns/history token; median |error| {np.median(error):.1%}, worst {error.max():.1%}")
    args.out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out / f"ngram-cpu-vllm-{version}.csv", index=False, float_format="%.2f")


if __name__ == "__main__":
    main()
