"""Loading a Hugging Face checkpoint onto the device, and a hil point on it.

Writes a random-weight checkpoint of a catalogue shape (llama-3.2-1b by default) into DIR as the Hub lays it
out: config.json, bf16 safetensors shards with model.safetensors.index.json, and a byte-level BPE
tokenizer.json trained on the corpus. Then a fresh process runs one small hil point on it through
`simharness.run` (engine.model = DIR, engine.steer false): the run's meta.json reports the loading time and
the host memory the load added at its peak (RSS), printed here next to the checkpoint's size. The goal on
CUDA is a peak below 1.2x the checkpoint; on the CPU the fp32 model itself lives in host memory, so the
figure there is the model's size plus the load's own. Usage:

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
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from simharness.corpus import documents
from simharness.engine.checkpoint import INDEX, tensor_targets
from simharness.engine.model import Transformer
from simharness.models import MODELS, ModelConfig, checkpoint_config


def hf_config(c: ModelConfig) -> dict:
    """config.json of a catalogue shape, as transformers writes it for the matching architecture."""
    arch, model_type = ("Qwen3ForCausalLM", "qwen3") if c.qk_norm else ("Qwen2ForCausalLM", "qwen2") if c.qkv_bias \
        else ("LlamaForCausalLM", "llama")  # fmt: skip
    s = c.rope_scaling
    rope = None if s is None else {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                                   "high_freq_factor": s.high_freq_factor,
                                   "original_max_position_embeddings": s.original_max_position}  # fmt: skip
    return {
        "architectures": [arch], "model_type": model_type, "hidden_size": c.dim, "intermediate_size": c.ffn_dim,
        "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim, "vocab_size": c.vocab_size, "tie_word_embeddings": c.tie_embeddings,
        "rope_theta": c.rope_theta, "rope_scaling": rope, "rms_norm_eps": c.norm_eps, "hidden_act": "silu",
        "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
    }  # fmt: skip


def write_checkpoint(path: Path, config: ModelConfig, shard_bytes: int) -> None:
    """Random bf16 weights (std 1/sqrt(fan_in), norms 1) in shards of at most `shard_bytes` (a larger tensor gets
    its own), written one shard at a time so that the writer holds one shard in memory."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(config), indent=1))
    assert checkpoint_config(path) == config, "config.json does not read back as the catalogue shape"
    shapes = {name: t.shape for name, t in tensor_targets(Transformer(config, max_slots=1, max_len=1, device="meta",
                                                                      seed=None)).items()}  # fmt: skip
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = 2 * shape.numel()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: (torch.randn(shapes[name], generator=gen, dtype=torch.bfloat16) * shapes[name][-1] ** -0.5
                          if len(shapes[name]) == 2 else torch.ones(shapes[name], dtype=torch.bfloat16))
                   for name in names}  # fmt: skip
        save_file(tensors, path / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names, file)
    total = sum(2 * shape.numel() for shape in shapes.values())
    (path / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


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
        "engine": {"backend": "torch", "device": device, "model": str(path), "steer": False,
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
    write_checkpoint(args.dir, config, int(args.shard_mb * 1e6))
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
