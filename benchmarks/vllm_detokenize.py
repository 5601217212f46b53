"""vLLM's output processing with and without detokenisation: `OutputProcessor.process_outputs` per decode step,
its processor given no tokenizer (as the host profile measures it) or a byte-level BPE tokenizer, so that each
request's new tokens go through vLLM's own incremental detokenizer (docs/host-costs.md). Needs vLLM.

    PYTHONPATH=$PWD /work/vllm-venv/bin/python benchmarks/vllm_detokenize.py --out results/host

No tokenizer can be downloaded here, so one is trained on the harness's corpus (`simharness.corpus`, its code
and prose) with HF `tokenizers` (8,000 tokens: a smaller vocabulary than a served model's, the same decoding
path). Token ids are drawn from its vocabulary. Async scheduling, k = 3, 512-token prompts, 30 decode steps a
point, every point `--repeats` times interleaved; per point the median over repeats of the mean step.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import numpy as np
import pandas as pd

from simharness.corpus import documents
from simharness.vllmhost import Point, model_dir, run_point, vllm_version

REQUESTS = (4, 16, 64, 256)


def corpus_tokenizer(vocab_size: int = 8000):
    """A byte-level BPE tokenizer trained on the harness's corpus, as transformers' fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [passage for doc in documents() for passage in (*doc.code, *doc.prose)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/host"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    version = vllm_version()
    tokenizer = corpus_tokenizer()
    rows = []
    with model_dir() as directory:
        for repeat in range(args.repeats):
            for detokenize in (False, True):
                for n in REQUESTS:
                    steps = run_point(Point(n, 3, 512, True), directory, 30, random.Random(repeat),
                                      tokenizer if detokenize else None)
                    decode = [s for s in steps if s["prefill_reqs"] == 0]
                    rows.append({"requests": n, "detokenize": detokenize, "repeat": repeat,
                                 "output_us": np.mean([s["output_us"] for s in decode]),
                                 "sampled_tokens": np.mean([s["sampled_tokens"] for s in decode])})
    frame = pd.DataFrame(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out / f"detokenize-vllm-{version}.csv", index=False, float_format="%.2f")
    table = frame.groupby(["detokenize", "requests"]).agg(output_us=("output_us", "median"),
                                                         low=("output_us", "min"), high=("output_us", "max"),
                                                         tokens=("sampled_tokens", "median"))
    table["per_request_us"] = table["output_us"] / table.index.get_level_values("requests")
    print(table.round(2).to_string())


if __name__ == "__main__":
    main()
