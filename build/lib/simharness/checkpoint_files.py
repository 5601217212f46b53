"""What a local Hugging Face checkpoint's files hold, read from config.json and the safetensors headers alone:
the tensors config.json implies (`tensor_layout`), those the files hold, and the up-front check that the scenario
runs before a measured level loads anything (torch is not needed; engine.checkpoint loads the weights)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from simharness.errors import ScenarioError
from simharness.models import ModelConfig, checkpoint_config

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def check_checkpoint(path: Path) -> None:
    """Raise ScenarioError naming the file unless the checkpoint holds every tensor config.json implies, in its
    shape and a floating-point dtype, within its file, and nothing else. Reads config.json and the files'
    headers only (kilobytes, milliseconds), so that a broken checkpoint is bad input found before a run starts
    (a load would fail the same way every time; retrying it would not help)."""
    try:
        config = checkpoint_config(path)
    except ValueError as e:
        raise ScenarioError(str(e)) from None
    check_tensors(path, config)


def tensor_layout(c: ModelConfig) -> dict[str, tuple[str, slice | None, list[int]]]:
    """Each checkpoint tensor's Hugging Face name -> the `Transformer` parameter it fills, the rows of it (q/k/v
    of the fused wqkv, gate/up of w13; None: all) and the tensor's shape, as config.json implies it."""
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    layout = {"model.embed_tokens.weight": ("tok_embeddings", None, [c.vocab_size, c.dim]),
              "model.norm.weight": ("norm", None, [c.dim])}  # fmt: skip
    if not c.tie_embeddings:
        layout["lm_head.weight"] = ("output", None, [c.vocab_size, c.dim])
    rows = {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}
    for i in range(c.n_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        layout[hf + "input_layernorm.weight"] = (ours + "attn_norm", None, [c.dim])
        for proj, r in rows.items():
            layout[hf + f"self_attn.{proj}_proj.weight"] = (ours + "wqkv", r, [r.stop - r.start, c.dim])
            if c.qkv_bias:
                layout[hf + f"self_attn.{proj}_proj.bias"] = (ours + "bqkv", r, [r.stop - r.start])
        if c.qk_norm:
            layout[hf + "self_attn.q_norm.weight"] = (ours + "q_norm", None, [c.head_dim])
            layout[hf + "self_attn.k_norm.weight"] = (ours + "k_norm", None, [c.head_dim])
        layout[hf + "self_attn.o_proj.weight"] = (ours + "wo", None, [c.dim, q])
        layout[hf + "post_attention_layernorm.weight"] = (ours + "ffn_norm", None, [c.dim])
        layout[hf + "mlp.gate_proj.weight"] = (ours + "w13", slice(0, c.ffn_dim), [c.ffn_dim, c.dim])
        layout[hf + "mlp.up_proj.weight"] = (ours + "w13", slice(c.ffn_dim, 2 * c.ffn_dim), [c.ffn_dim, c.dim])
        layout[hf + "mlp.down_proj.weight"] = (ours + "w2", None, [c.dim, c.ffn_dim])
    return layout


def tensor_shapes(path: Path) -> dict[str, tuple[Path, list[int]]]:
    """Every tensor of the checkpoint: the file that holds it and its shape (read from the files' headers)."""
    if (path / INDEX).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
            files = sorted({path / name for name in weight_map.values()})
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ScenarioError(f"checkpoint {path}: {INDEX} has no readable weight_map ({e})") from None
    elif (path / SINGLE).is_file():
        files = [path / SINGLE]
    else:
        raise ScenarioError(f"checkpoint {path}: neither {SINGLE} nor {INDEX}")
    shapes = {}
    for file in files:
        if not file.is_file():
            raise ScenarioError(f"checkpoint {path}: {INDEX} names {file.name}, which does not exist")
        shapes |= {name: (file, shape) for name, shape in read_header(file).items()}
    return shapes


# The dtypes a parameter is loaded from (copied into the model's own dtype), and their sizes in bytes.
FLOAT_DTYPES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2}


def read_header(file: Path) -> dict[str, list[int]]:
    """A safetensors file's tensors and their shapes, from its header alone, once the header is whole JSON and
    every tensor a floating-point one whose bytes lie in the file (a truncated copy fails here, not mid-load)."""
    try:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise ScenarioError(f"{file}: truncated or not a safetensors file ({size} bytes)")
            length = int.from_bytes(f.read(8), "little")
            if 8 + length > size:
                raise ScenarioError(f"{file}: truncated or not a safetensors file (its header announces {length:,} "
                                    f"bytes; the file has {size:,})")
            header = json.loads(f.read(length))
    except OSError as e:
        raise ScenarioError(f"{file}: cannot read it ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ScenarioError(f"{file}: corrupt or not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ScenarioError(f"{file}: corrupt or not a safetensors file (its header is not a mapping)")
    data = size - 8 - length
    shapes = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            numel = math.prod(int(n) for n in shape)
        except (TypeError, KeyError, ValueError):
            raise ScenarioError(f"{file}: corrupt header: tensor {name}'s entry lacks a dtype, shape or data "
                                "offsets") from None
        if not isinstance(dtype, str) or dtype not in FLOAT_DTYPES:
            raise ScenarioError(f"{file}: tensor {name} is {dtype}, not a floating-point dtype "
                                f"({', '.join(FLOAT_DTYPES)})")
        if not (isinstance(begin, int) and isinstance(end, int) and begin >= 0
                and end - begin == numel * FLOAT_DTYPES[dtype]):  # fmt: skip
            raise ScenarioError(f"{file}: corrupt header: tensor {name}'s bytes [{begin}, {end}) cannot hold a "
                                f"{dtype} tensor of shape {shape}")
        if end > data:
            raise ScenarioError(f"{file}: truncated: tensor {name} ends at byte {end:,} of the data, which holds "
                                f"{data:,} bytes")
        shapes[name] = list(shape)
    return shapes


def check_tensors(path: Path, config: ModelConfig) -> dict[str, Path]:
    """The file of each tensor the model needs, once every one is there with the shape config.json implies and
    the checkpoint holds nothing else (a tied model's checkpoint may still carry the LM head)."""
    found = tensor_shapes(path)
    layout = tensor_layout(config)
    for name, (_, _, shape) in layout.items():
        if name not in found:
            raise ScenarioError(f"checkpoint {path}: tensor {name} is missing")
        if found[name][1] != shape:
            raise ScenarioError(f"checkpoint {path}: tensor {name} has shape {found[name][1]}, but config.json "
                                f"implies {shape}")  # fmt: skip
    extra = sorted(set(found) - set(layout) - ({"lm_head.weight"} if config.tie_embeddings else set()))
    if extra:
        raise ScenarioError(f"checkpoint {path}: unexpected tensor {extra[0]}" + (
            f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))  # fmt: skip
    return {name: found[name][0] for name in layout}
