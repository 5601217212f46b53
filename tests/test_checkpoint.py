"""Hugging Face checkpoints: tiny random Llama (Llama 3 RoPE scaling, sharded), Qwen2 (q/k/v biases) and Qwen3
(q/k head norms, head_dim != dim / heads) checkpoints written by transformers in the test, with a byte-level BPE
tokenizer trained on the corpus, loaded into our Transformer (nothing is downloaded).

fp32 on the CPU: our logits equal transformers' to a relative error (Frobenius norm over every position) below
1e-5 (measured: 5-6e-7), its greedy generations token for token, and greedy speculative decoding equals plain
greedy decoding, alone and through hil runs in every scheduling mode. The bad-input, save/load and CUDA tests
write their checkpoints with `save_checkpoint` and need no transformers."""

import dataclasses
import functools
import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import tokenizers
import torch
import yaml
from helpers import emitted, single_thread
from tokenizers import decoders, models, pre_tokenizers, trainers
from typer.testing import CliRunner

import simharness
from simharness import measured
from simharness.cli import app
from simharness.corpus import documents
from simharness.costmodel import CostModel
from simharness.engine.checkpoint import load_checkpoint, save_checkpoint
from simharness.engine.decode import DecodeLoop
from simharness.engine.model import Transformer
from simharness.models import MODELS, RopeScaling, checkpoint_config, hf_config
from simharness.scenario import scenario_from_dict
from simharness.tokenizer import checkpoint_tokenizer
from simharness.workload import build_requests

TOKENIZER_VOCAB = 1000
VOCAB = 1024  # the model's embedding rows: more than the tokenizer's ids, as Qwen pads its embedding
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "rope_theta": 10000.0, "rms_norm_eps": 1e-6}  # fmt: skip
# Each architecture's config class and what sets it apart; the Llama checkpoint is sharded (100 KB shards).
ARCHS = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": False, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": True, "head_dim": 32}),
}  # fmt: skip
TOLERANCE = 1e-5


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    yield from single_thread()


@functools.cache
def bpe_tokenizer() -> tokenizers.Tokenizer:
    """A byte-level BPE (Llama 3's and Qwen's kind) trained on the corpus text."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator([t for d in documents() for t in d.code + d.prose], trainer)
    return tok


def write_checkpoint(path: Path, arch: str, vocab: int = VOCAB, seed: int = 0):
    """Save a random `arch` model of transformers (every weight random: norms, biases too) and the tokenizer;
    returns the model."""
    transformers = pytest.importorskip("transformers")
    config_class, extra = ARCHS[arch]
    config = getattr(transformers, config_class)(vocab_size=vocab, **SHAPE, **extra)
    torch.manual_seed(seed)
    hf = getattr(transformers, config_class.replace("Config", "ForCausalLM"))(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "embed_tokens" in name:  # small: else a tied head's logits favour the input token, all repeat it
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            else:  # norm weights
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
    hf.save_pretrained(path, max_shard_size="100KB" if arch == "llama" else "50MB")
    bpe_tokenizer().save(str(path / "tokenizer.json"))
    hf.generation_config.eos_token_id = None  # generate exactly max_new_tokens, as our decode loop does
    return hf


@pytest.fixture(scope="module", params=list(ARCHS))
def checkpoint(request, tmp_path_factory) -> tuple[str, Path, object]:
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, write_checkpoint(path, request.param)


def prompts(path: Path, n: int = 3) -> list[np.ndarray]:
    """Code passages cut into the checkpoint's tokens: repetitive enough for n-gram drafts."""
    tok = checkpoint_tokenizer(path)
    code = [p for d in documents() for p in d.code if len(p) > 400]
    return [tok.encode(code[7 * i])[:40] for i in range(n)]


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours.double() - theirs.double()).norm() / theirs.double().norm())


def test_config_and_sharded_files_are_read(checkpoint) -> None:
    arch, path, hf = checkpoint
    config = checkpoint_config(path)
    assert (config.qkv_bias, config.qk_norm, config.tie_embeddings) == {
        "llama": (False, False, False), "qwen2": (True, False, True), "qwen3": (False, True, True)}[arch]
    assert config.head_dim == (32 if arch == "qwen3" else 16)
    assert (config.rope_scaling is not None) == (arch == "llama")
    assert (len(list(path.glob("*.safetensors"))) > 1) == (arch == "llama")
    model = load_checkpoint(path, max_slots=1, max_len=8, device="cpu")
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters()) == config.params
    stats = model.load_stats
    assert stats["checkpoint_bytes"] == sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert stats["load_s"] > 0 and stats["host_rss_before_bytes"] > 0 and stats["host_peak_added_bytes"] >= 0
    # the sim level's roofline reads the same shape
    engine = scenario_from_dict({"name": "x", "engine": {"model": str(path)}}).engine
    assert CostModel(engine, optimistic_correction=False).shape == config


def test_logits_match_transformers(checkpoint) -> None:
    """Every position of one 48-token pass, then a prompt prefilled and verify steps on its cache."""
    _, path, hf = checkpoint
    model = load_checkpoint(path, max_slots=2, max_len=64, device="cpu")
    tokens = torch.randint(TOKENIZER_VOCAB, (48,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens[None]).logits[0]
    slot0, slot1 = torch.tensor([0]), torch.tensor([1])
    assert relative_error(model.verify(tokens[None], slot1, torch.tensor([0]))[0], expected) < TOLERANCE
    assert relative_error(model.prefill(0, tokens[:30]), expected[29]) < TOLERANCE
    for start, n in [(30, 4), (34, 1), (35, 13)]:
        got = model.verify(tokens[None, start : start + n], slot0, torch.tensor([start]))[0]
        assert relative_error(got, expected[start : start + n]) < TOLERANCE


def greedy(model: Transformer, prompt_list: list[np.ndarray], n_new: int, k: int) -> tuple[list[list[int]], int]:
    """Our greedy decoding of all prompts in one batch (n-gram drafts when k > 0): tokens and drafts accepted."""
    loop = DecodeLoop(model, k=k, min_n=1, max_n=3)
    tokens = [[int(loop.add_request(i, p)[0])] for i, p in enumerate(prompt_list)]
    accepted = 0
    while short := [i for i, t in enumerate(tokens) if len(t) < n_new]:
        out = loop.readback(loop.step(torch.tensor(short)))
        for i, row, n_emitted in zip(short, out.tokens, out.num_emitted, strict=True):
            tokens[i] += row[:n_emitted].tolist()
        accepted += int(out.num_emitted.sum()) - len(short)
    return [t[:n_new] for t in tokens], accepted


def test_greedy_generation_matches_transformers_and_speculation(checkpoint) -> None:
    _, path, hf = checkpoint
    model = load_checkpoint(path, max_slots=3, max_len=96, device="cpu")
    prompt_list, n_new = prompts(path), 32
    plain, _ = greedy(model, prompt_list, n_new, k=0)
    for prompt, ours in zip(prompt_list, plain, strict=True):
        ids = torch.as_tensor(prompt, dtype=torch.int64)[None]
        with torch.no_grad():
            theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n_new)
        assert theirs[0, len(prompt) :].tolist() == ours
    speculative, accepted = greedy(model, prompt_list, n_new, k=3)
    assert speculative == plain
    assert accepted > 0  # drafts were verified and accepted, not only rejected


MODES = list(itertools.product([1, 2], ["wait", "optimistic"], ["ngram_cpu", "ngram_gpu"], ["trim", "fill"]))


def hil_scenario(path: Path, **engine) -> dict:
    return {
        "name": "checkpoint",
        "seed": 4,
        "workload": {"arrival": "closed", "concurrency": 3, "num_requests": 5, "kinds": {"code_edit": 1.0},
                     "prompt_len": {"dist": "uniform", "min": 20, "max": 60},
                     "output_len": {"dist": "fixed", "value": 20}},
        "engine": {"level": "hil", "device": "cpu", "model": str(path),
                   "speculation": {"k": 3, "min_n": 1, "max_n": 3}, **engine},
        "scheduler": {"max_num_batched_tokens": 64},
    }  # fmt: skip


def test_hil_run_emits_plain_greedy_tokens_in_every_mode(checkpoint, tmp_path, monkeypatch) -> None:
    """`simharness.run` on the checkpoint with `engine.steer: false`: the model's own greedy tokens, whatever the
    depth, policy, proposer placement and invalid-slot handling; the load is reported in meta.json."""
    arch, path, _ = checkpoint
    data = hil_scenario(path, steer=False)
    data["sweep"] = {"scheduler.depth": [1, 2], "scheduler.policy": ["wait", "optimistic"],
                     "engine.speculation.proposer": ["ngram_cpu", "ngram_gpu"],
                     "engine.speculation.invalid_slots": ["trim", "fill"]}  # fmt: skip
    by_mode: dict[str, list[np.ndarray]] = {}
    run_level = measured.run_level

    def recording(sc, requests, mode, model, on_clock):
        records, duration, backend = run_level(sc, requests, mode, model, on_clock)
        # the point's own run comes after its warm-up's, and replaces it
        by_mode[f"{sc.scheduler.depth}-{sc.scheduler.policy}-{sc.engine.speculation.proposer}-"
                f"{sc.engine.speculation.invalid_slots}"] = [emitted(backend, r).copy() for r in range(5)]
        return records, duration, backend

    monkeypatch.setattr(measured, "run_level", recording)
    result = simharness.run(scenario_from_dict(data), tmp_path)

    sc = scenario_from_dict(hil_scenario(path))
    requests = build_requests(sc.workload, sc.seed, path)
    assert requests.vocab_size == TOKENIZER_VOCAB
    model = load_checkpoint(path, max_slots=1, max_len=128, device="cpu")
    expected = [greedy(model, [p], n, k=0)[0][0] for p, n in zip(requests.prompt_tokens, requests.output_len,
                                                                 strict=True)]  # fmt: skip
    assert sorted(by_mode) == sorted("-".join(map(str, m)) for m in MODES)
    for mode, outputs in by_mode.items():
        for rid, tokens in enumerate(outputs):
            assert tokens.tolist() == expected[rid], f"{arch} {mode} request {rid}"
    assert (result.summary["acceptance_rate"] > 0).all()
    meta = json.loads((result.run_dir / "meta.json").read_text())
    assert meta["checkpoint_load"]["checkpoint"] == str(path)
    assert meta["checkpoint_load"]["load_s"] > 0


def test_steered_hil_run_replays_the_reference_in_the_checkpoints_tokens(qwen2_dir, tmp_path, monkeypatch) -> None:
    """Steering (the default) works in the checkpoint's tokens: the outputs are the reference, re-tokenized."""
    path, outputs = qwen2_dir, []
    run_level = measured.run_level

    def recording(sc, requests, mode, model, on_clock):
        records, duration, backend = run_level(sc, requests, mode, model, on_clock)
        outputs[:] = [emitted(backend, r).copy() for r in range(len(requests.prompt_len))]  # the last run's
        return records, duration, backend

    monkeypatch.setattr(measured, "run_level", recording)
    sc = scenario_from_dict(hil_scenario(path))
    simharness.run(sc, tmp_path)
    requests = build_requests(sc.workload, sc.seed, path)
    for got, reference in zip(outputs, requests.output_tokens, strict=True):
        np.testing.assert_array_equal(got, reference)


# ------------------------------------------------------------------------------------------------ bad input


def run_cli(tmp_path: Path, data: dict):
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(yaml.safe_dump(data))
    return CliRunner().invoke(app, ["run", str(scenario), "--out", str(tmp_path / "out")])


def assert_one_message(result, *parts: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and result.stderr.count("error:") == 1
    for part in parts:
        assert part in result.stderr.replace("\n", ""), result.stderr


QWEN2 = dataclasses.replace(MODELS["tiny"], vocab_size=VOCAB, qkv_bias=True, tie_embeddings=True)
# transformers' own shape variants, written by save_checkpoint (no transformers needed)
OURS = {
    "llama": dataclasses.replace(MODELS["tiny"], vocab_size=VOCAB, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64)),
    "qwen2": QWEN2,
    "qwen3": dataclasses.replace(MODELS["tiny"], vocab_size=VOCAB, tie_embeddings=True, qk_norm=True, head_dim=32),
}


def save_ours(path: Path, config, shard_bytes: int = 10**9) -> Transformer:
    """A random model of ours saved with the test tokenizer; returns the model."""
    model = Transformer(config, max_slots=1, max_len=8, device="cpu", seed=2)
    save_checkpoint(model, path, shard_bytes)
    bpe_tokenizer().save(str(path / "tokenizer.json"))
    return model


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen2")
    save_ours(path, QWEN2)
    return path


@pytest.mark.parametrize("arch", OURS)
def test_saved_checkpoint_loads_back(arch: str, tmp_path: Path) -> None:
    """save_checkpoint then load_checkpoint (40 KB shards here): every weight is back, rounded to bf16."""
    saved = save_ours(tmp_path, OURS[arch], shard_bytes=40_000)
    assert len(list(tmp_path.glob("*.safetensors"))) > 3
    loaded = load_checkpoint(tmp_path, max_slots=1, max_len=8, device="cpu")
    assert loaded.config == saved.config
    for (name, a), (_, b) in zip(saved.named_parameters(), loaded.named_parameters(), strict=True):
        assert torch.equal(a.to(torch.bfloat16).float(), b), name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", OURS)
def test_cuda_load_matches_the_cpu(arch: str, tmp_path: Path) -> None:
    """On CUDA the checkpoint loads in bf16 and runs the Triton kernels (q/k norms, RoPE scaling, biases) under
    CUDA graphs: its logits match the fp32 CPU model of the same checkpoint to bf16 precision."""
    save_ours(tmp_path, OURS[arch], shard_bytes=40_000)
    cpu, cuda = (load_checkpoint(tmp_path, max_slots=2, max_len=64, device=d, cuda_graphs=d == "cuda")
                 for d in ("cpu", "cuda"))  # fmt: skip
    assert all(p.dtype == torch.bfloat16 for p in cuda.parameters())
    tokens = torch.randint(TOKENIZER_VOCAB, (40,), generator=torch.Generator().manual_seed(1))
    for model in (cpu, cuda):
        model.prefill(1, tokens[:30].to(model.device))
    expected = cpu.verify(tokens[None, 30:35], torch.tensor([1]), torch.tensor([30]))[0]
    got = cuda.verify(tokens[None, 30:35].cuda(), torch.tensor([1], device="cuda"), torch.tensor([30], device="cuda"))
    assert relative_error(got[0].cpu(), expected) < 2e-2


def broken_copy(qwen2_dir: Path, tmp_path: Path) -> Path:
    path = tmp_path / "broken"
    shutil.copytree(qwen2_dir, path)
    return path


def test_directory_without_config(qwen2_dir: Path, tmp_path: Path) -> None:
    path = broken_copy(qwen2_dir, tmp_path)
    (path / "config.json").unlink()
    assert_one_message(run_cli(tmp_path, hil_scenario(path)), "engine.model", "no config.json")


def test_unsupported_architecture(qwen2_dir: Path, tmp_path: Path) -> None:
    path = broken_copy(qwen2_dir, tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"]}))
    assert_one_message(run_cli(tmp_path, hil_scenario(path)), "architecture MistralForCausalLM is not supported")


def test_missing_tensor(qwen2_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = broken_copy(qwen2_dir, tmp_path)
    (shard,) = path.glob("*.safetensors")
    tensors = load_file(shard)
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, shard, metadata={"format": "pt"})
    assert_one_message(run_cli(tmp_path, hil_scenario(path)), "tensor model.layers.1.self_attn.k_proj.bias is missing")


def test_mismatched_tensor(qwen2_dir: Path, tmp_path: Path) -> None:
    path = broken_copy(qwen2_dir, tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    assert_one_message(run_cli(tmp_path, hil_scenario(path)), "tensor model.layers.0.mlp.gate_proj.weight has shape "
                       "[128, 64], but config.json implies [96, 64]")


def test_tokenizer_larger_than_the_embedding(tmp_path: Path) -> None:
    path = tmp_path / "small"
    save_ours(path, dataclasses.replace(QWEN2, vocab_size=512))
    assert_one_message(run_cli(tmp_path, {**hil_scenario(path), "engine": {"model": str(path)}}),
                       "tokenizer.json has 1000 tokens, more than the 512 rows")


def test_unknown_model_name(tmp_path: Path) -> None:
    assert_one_message(run_cli(tmp_path, {"name": "x", "engine": {"model": "llama-9"}}),
                       "engine.model", "'llama-9' is neither a known model", *MODELS)


@pytest.mark.parametrize(("change", "message"), [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "LlamaForCausalLM with rope_type yarn is not supported"),
    ({"use_sliding_window": True}, "with use_sliding_window is not supported"),
    ({"attention_bias": True, "hidden_act": "gelu"}, "with attention_bias, hidden_act gelu is not supported"),
    ({"intermediate_size": None}, "config.json lacks intermediate_size"),
])  # fmt: skip
def test_config_features_we_do_not_implement(change: dict, message: str, tmp_path: Path) -> None:
    config = {k: v for k, v in {**hf_config(OURS["llama"]), **change}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        checkpoint_config(tmp_path)


def _truncate(shard: Path, keep: int) -> None:
    shard.write_bytes(shard.read_bytes()[:keep])


def _header(shard: Path, edit) -> None:
    """Rewrite a shard's header through `edit` (a dict -> dict), keeping the data as it is."""
    raw = shard.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.dumps(edit(json.loads(raw[8 : 8 + length]))).encode()
    shard.write_bytes(len(header).to_bytes(8, "little") + header + raw[8 + length :])


def _retype(header: dict) -> dict:
    header["model.norm.weight"]["dtype"] = "I16"  # same size as bf16: only the dtype is wrong
    return header


@pytest.mark.parametrize(("damage", "message"), [
    (lambda shard: _truncate(shard, 5), "truncated or not a safetensors file (5 bytes)"),
    (lambda shard: _truncate(shard, 200), "truncated or not a safetensors file (its header announces"),
    (lambda shard: _truncate(shard, shard.stat().st_size - 100), "truncated: tensor"),
    (lambda shard: shard.write_bytes(b"\x10" + bytes(7) + b"not json at all!" + bytes(64)), "header is not JSON"),
    (lambda shard: _header(shard, _retype), "tensor model.norm.weight is I16, not a floating-point dtype"),
])  # fmt: skip
def test_corrupt_or_truncated_safetensors_is_bad_input_up_front(damage, message, qwen2_dir, tmp_path, monkeypatch):
    """A broken weights file is found from its header before the run (nothing loaded, nothing written, no retry
    of a failure that would repeat): exit 2 with one message naming engine.model and the file."""
    path = broken_copy(qwen2_dir, tmp_path)
    (shard,) = path.glob("*.safetensors")
    damage(shard)
    monkeypatch.setattr(measured, "load_checkpoint", lambda *a, **k: pytest.fail("the run started"))
    result = run_cli(tmp_path, hil_scenario(path))
    assert_one_message(result, "engine.model", str(shard), message)
    assert not (tmp_path / "out").exists()


def test_checkpoint_check_passes_a_good_checkpoint(qwen2_dir: Path) -> None:
    from simharness.checkpoint_files import check_checkpoint, read_header

    (shard,) = qwen2_dir.glob("*.safetensors")
    assert read_header(shard)["model.embed_tokens.weight"] == [VOCAB, QWEN2.dim]
    check_checkpoint(qwen2_dir)
