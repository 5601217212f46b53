"""The model catalogue: decoder shapes of the Llama family, the sizes derived from them, the shape of a
local Hugging Face checkpoint read from (or written to) its config.json, and the roofline's GPUs.

One table for both levels: the sim level's roofline (`costmodel`) reads the sizes, the torch model
(`engine.model`) is built from the same entry. No torch here: the sim level runs without it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x's RoPE frequency scaling (`rope_type: llama3`): long wavelengths are divided by `factor`,
    short ones kept, those between blended (HF config names in the comments)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int  # original_max_position_embeddings


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer of the Llama family: RMSNorm, RoPE (rotate-half), grouped-query attention,
    SwiGLU. Qwen2 adds q/k/v biases (`qkv_bias`), Qwen3 an RMSNorm of each q and k head (`qk_norm`)."""

    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    tie_embeddings: bool = False
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    qkv_bias: bool = False
    qk_norm: bool = False

    @property
    def qkv_rows(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    @property
    def params(self) -> int:
        """Every parameter: the matrices and hidden-size norms, then the per-head vectors (biases, q/k norms)."""
        per_head = self.qkv_bias * self.qkv_rows + self.qk_norm * 2 * self.head_dim
        return self._matrices_and_norms + self.n_layers * per_head

    @property
    def untied_embedding(self) -> int:
        """Parameters of an embedding table separate from the LM head (0 when tied): a forward gathers
        B x T of its rows, it does not read it."""
        return 0 if self.tie_embeddings else self.vocab_size * self.dim

    @property
    def kv_per_token(self) -> int:
        """K and V values cached per token over all layers."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim

    # ---- the roofline's sizes (bf16). They count the matrices and the hidden-size norms; the per-head
    # vectors (q/k/v biases, q/k norms: under 1e-4 of the weights) are below its resolution.

    @property
    def weight_bytes(self) -> int:
        """bf16 weights read once per forward."""
        return 2 * (self._matrices_and_norms - self.untied_embedding)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.kv_per_token

    @property
    def linear_flops_per_token(self) -> int:
        """2 FLOPs per weight of every matmul, the LM head included."""
        return 2 * (self._matrices_and_norms - self.untied_embedding - self.dim)

    @property
    def attn_flops_per_pair(self) -> int:
        """FLOPs of QK^T and AV for one (query token, context token) pair over all layers."""
        return 4 * self.n_layers * self.n_heads * self.head_dim

    @property
    def _matrices_and_norms(self) -> int:
        attn = self.dim * self.qkv_rows + self.n_heads * self.head_dim * self.dim
        per_layer = attn + 3 * self.dim * self.ffn_dim + 2 * self.dim
        embedding = self.vocab_size * self.dim
        return self.n_layers * per_layer + embedding + self.untied_embedding + self.dim


# The public models' published configs. `tiny` is the CPU test model; its vocabulary is the built-in
# tokenizer's (simharness.tokenizer.DEFAULT_VOCAB_SIZE).
MODELS: dict[str, ModelConfig] = {
    "llama-3.2-1b": ModelConfig(
        n_layers=16, dim=2048, n_heads=32, n_kv_heads=8, head_dim=64, ffn_dim=8192, vocab_size=128256,
        tie_embeddings=True, rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192),
    ),
    "llama-3-8b": ModelConfig(
        n_layers=32, dim=4096, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336, vocab_size=128256,
    ),
    "qwen3-1.7b": ModelConfig(
        n_layers=28, dim=2048, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=6144, vocab_size=151936,
        tie_embeddings=True, rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True,
    ),
    "tiny": ModelConfig(
        n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, vocab_size=32000, rope_theta=10000.0,
    ),
}  # fmt: skip

@dataclass(frozen=True)
class GpuSpec:
    """A roofline GPU of the sim level's cost model."""

    name: str
    mem_bandwidth_gbs: float  # HBM bandwidth, GB/s
    bf16_tflops: float  # dense bf16 tensor-core peak
    architecture: str  # one chip design: a profile carries over between its parts (`profile.derive_profile`)


# Public spec-sheet numbers (dense bf16, SXM parts where there is a choice).
GPUS: dict[str, GpuSpec] = {
    "H100": GpuSpec("H100", 3350.0, 989.0, "Hopper"),
    "H200": GpuSpec("H200", 4800.0, 989.0, "Hopper"),
    "A100": GpuSpec("A100", 2039.0, 312.0, "Ampere"),
    "L40S": GpuSpec("L40S", 864.0, 362.0, "Ada"),
}


def gpu_spec(name: str) -> GpuSpec:
    """`engine.gpu`'s spec (names are case-insensitive); ValueError lists the known ones."""
    for key, spec in GPUS.items():
        if key.lower() == name.lower():
            return spec
    raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")


# Hugging Face architectures this model implements: whether q/k/v carry biases, whether q/k heads are normed.
ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}


def catalogue_name(model: str) -> str | None:
    """The catalogue's spelling of `model` (names are case-insensitive), or None if it is not listed."""
    return next((name for name in MODELS if name.lower() == model.lower()), None)


def checkpoint_dir(model: str) -> Path | None:
    """The checkpoint directory `engine.model` names, or None for a catalogue name."""
    return None if catalogue_name(model) else Path(model).expanduser()


def model_config(model: str) -> ModelConfig:
    """`engine.model`'s shape: a catalogue entry, or a checkpoint directory's config.json. ValueError names
    the problem."""
    name = catalogue_name(model)
    if name is not None:
        return MODELS[name]
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(f"{model!r} is neither a known model ({', '.join(MODELS)}) nor a checkpoint directory")
    return checkpoint_config(path)


def checkpoint_config(path: Path) -> ModelConfig:
    """The shape in a Hugging Face checkpoint's config.json, if this model implements its architecture."""
    file = path / "config.json"
    try:
        hf = json.loads(file.read_text())
    except FileNotFoundError:
        raise ValueError(f"checkpoint {path}: no config.json") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"checkpoint {path}: cannot read config.json ({e})") from None
    arch = (hf.get("architectures") or ["(none given)"])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"checkpoint {path}: architecture {arch} is not supported ({', '.join(ARCHITECTURES)} are)")
    qkv_bias, qk_norm = ARCHITECTURES[arch]
    unsupported = [key for key in ("attention_bias", "mlp_bias", "use_sliding_window") if hf.get(key)]
    if hf.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act {hf['hidden_act']}")
    # Older configs keep rope_theta and rope_scaling at the top; transformers 5 writes rope_parameters.
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        unsupported.append(f"rope_type {rope_type}")
    if unsupported:
        raise ValueError(f"checkpoint {path}: {arch} with {', '.join(unsupported)} is not supported")
    try:
        n_heads = hf["num_attention_heads"]
        return ModelConfig(
            n_layers=hf["num_hidden_layers"],
            dim=hf["hidden_size"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
            ffn_dim=hf["intermediate_size"],
            vocab_size=hf["vocab_size"],
            tie_embeddings=hf.get("tie_word_embeddings", False),
            rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=None if rope_type == "default" else RopeScaling(
                float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                int(rope["original_max_position_embeddings"]),
            ),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
        )  # fmt: skip
    except KeyError as e:
        raise ValueError(f"checkpoint {path}: config.json lacks {e.args[0]}") from None


def hf_config(config: ModelConfig) -> dict:
    """config.json of a shape, as transformers writes it for the matching architecture (`checkpoint_config`
    reads it back as the same shape)."""
    c, s = config, config.rope_scaling
    arch = next(a for a, variant in ARCHITECTURES.items() if variant == (c.qkv_bias, c.qk_norm))
    rope = None if s is None else {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                                   "high_freq_factor": s.high_freq_factor,
                                   "original_max_position_embeddings": s.original_max_position}  # fmt: skip
    return {
        "architectures": [arch], "model_type": arch.removesuffix("ForCausalLM").lower(), "hidden_size": c.dim,
        "intermediate_size": c.ffn_dim, "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim, "vocab_size": c.vocab_size,
        "tie_word_embeddings": c.tie_embeddings, "rope_theta": c.rope_theta, "rope_scaling": rope,
        "rms_norm_eps": c.norm_eps, "hidden_act": "silu", "torch_dtype": "bfloat16",
    }  # fmt: skip
