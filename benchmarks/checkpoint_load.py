"""Loading a Hugging Face checkpoint onto the device, and a hil point on it.

Writes a random-weight checkpoint of a catalogue shape (llama-3.2-1b by default) into DIR as the Hub lays it
out (`engine.checkpoint.save_checkpoint`): config.json, bf16 safetensors shards with their index, and a
byte-level BPE tokenizer.json trained on the corpus. Then a fresh process runs one small hil point on it
through `simharness.run` (engine.model = DIR, engine.steer false): the run's meta.json reports the loading
time and the host memory the load added at its peak (RSS), printed here next to the checkpoint's size. The
goal on CUDA is a peak below 1.2x the checkpoint; on the CPU the fp32 model itself lives in host memory, so
the figure there is the model's size plus the load's own. Usage:

    python benchmarks/checkpoint_load.py DIR [--model llama-3.2-1b] [--shard-mb 500] [--device auto] [--out OUT]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from simharness.corpus import documents
from simharness.engine.checkpoint import save_checkpoint
from simharness.engine.model import Transformer
from simharness.models import MODELS


def write_tokenizer(path: Path, vocab_size: int) -> int:
    """A byte-level BPE trained on the corpus, at most `vocab_size` tokens (fewer if the corpus runs out of
    merges); returns its size."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator([t for d in documents() for t in d.code + d.prose], trainer)
    tok.save(str(path / "tokenizer.json"))
    return tok.get_vocab_size()


def hil_point(path: Path, device: str) -> dict:
    """One small closed-loop point: the model's own greedy tokens decide acceptance."""
    return {
        "name": "checkpoint-load",
        "workload": {"arrival": "closed", "concurrency": 8, "num_requests": 24,
                     "prompt_len": {"dist": "uniform", "min": 128, "max": 512},
                     "output_len": {"dist": "fixed", "value": 64}},
        "engine": {"level": "hil", "device": device, "model": str(path), "steer": False,
                   "speculation": {"proposer": "ngram_gpu", "k": 4}},
        "scheduler": {"depth": 2, "policy": "optimistic"},
    }  # fmt: skip


RUN = """
import json, sys
import simharness
result = simharness.run(simharness.scenario_from_dict(json.loads(sys.argv[1])), sys.argv[2])
print(result.run_dir)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, help="where the checkpoint is written (overwritten)")
    ap.add_argument("--model", default="llama-3.2-1b", choices=list(MODELS), help="catalogue shape")
    ap.add_argument("--shard-mb", type=float, default=500.0, help="shard size (MB)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--out", type=Path, default=Path("out/checkpoint_load"), help="results root of the hil run")
    args = ap.parse_args()

    config = MODELS[args.model]
    t0 = time.perf_counter()
    # random weights drawn on the device (bf16 on CUDA), written one shard at a time
    device = "cuda" if args.device == "cuda" or args.device == "auto" and torch.cuda.is_available() else "cpu"
    model = Transformer(config, max_slots=1, max_len=1, device=device)
    save_checkpoint(model, args.dir, int(args.shard_mb * 1e6))
    del model
    torch.cuda.empty_cache()  # the hil process needs the device memory
    vocab = write_tokenizer(args.dir, config.vocab_size)
    shards = sorted(args.dir.glob("*.safetensors"))
    print(f"wrote {args.model}: {len(shards)} shards, tokenizer of {vocab} tokens, {time.perf_counter() - t0:.1f} s")

    scenario = json.dumps(hil_point(args.dir, args.device))
    done = subprocess.run([sys.executable, "-c", RUN, scenario, str(args.out)], capture_output=True, text=True)
    if done.returncode:
        print(done.stderr[-4000:], file=sys.stderr)
        return 1
    run_dir = Path(done.stdout.split()[-1])
    meta = json.loads((run_dir / "meta.json").read_text())
    load = meta["checkpoint_load"]
    (row,) = json.loads((run_dir / "summary.json").read_text())
    size, added = load["checkpoint_bytes"], load["host_peak_added_bytes"]
    print(f"device                 {meta['device']}")
    print(f"checkpoint             {size / 1e9:.3f} GB in {len(shards)} shards")
    print(f"load                   {load['load_s']:.2f} s ({size / load['load_s'] / 1e9:.2f} GB/s)")
    print(f"host RSS before load   {load['host_rss_before_bytes'] / 1e9:.3f} GB")
    print(f"host peak added        {added / 1e9:.3f} GB = {added / size:.2f}x the checkpoint (goal on CUDA: < 1.2x)")
    print(f"hil point              TPOT {row['mean_tpot_ms']:.2f} ms, acceptance rate {row['acceptance_rate']:.1f}%, "
          f"{row['completed']} requests")  # fmt: skip
    print(f"run                    {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
