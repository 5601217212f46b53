"""Load a local Hugging Face checkpoint (config.json, model.safetensors or a sharded index) into `Transformer`.

Weights go straight to the device in its dtype (bf16 on CUDA): each tensor is read through its own `safe_open`,
a memory map whose pages are the only host copy and are released when it closes, and copied into its slice of
the preallocated, fused parameters (q/k/v into wqkv, gate/up into w13). Host memory so never holds a second
full copy of the weights; the loading time and the peak host memory are measured and kept in `load_stats`.
`save_checkpoint` writes a model the same way round (the GPU benchmark's random checkpoints, the tests').
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from simharness.checkpoint_files import INDEX, check_tensors, tensor_layout
from simharness.engine.model import Transformer
from simharness.errors import ScenarioError
from simharness.models import checkpoint_config, hf_config


def load_checkpoint(
    path: Path, *, max_slots: int, max_len: int, device: torch.device | str, cuda_graphs: bool = False
) -> Transformer:
    """The checkpoint's model with a cache of `max_slots` x `max_len`; ScenarioError names what does not fit."""
    device = torch.device(device)
    try:
        config = checkpoint_config(path)
    except ValueError as e:
        raise ScenarioError(str(e)) from None
    if device.type == "cuda":
        torch.empty(0, device=device)  # start the CUDA runtime first: its host memory is not the loading's
    rss_before = _reset_peak_rss()
    t0 = time.perf_counter()
    model = Transformer(config, max_slots=max_slots, max_len=max_len, device=device, seed=None,
                        cuda_graphs=cuda_graphs)  # fmt: skip
    files = check_tensors(path, config)
    for name, target in tensor_targets(model).items():
        try:
            with safe_open(files[name], framework="pt", device="cpu") as f:
                target.copy_(f.get_tensor(name))
        except (SafetensorError, OSError) as e:  # changed since the check: bad input all the same, never retried
            raise ScenarioError(f"checkpoint {path}: {files[name]}: cannot read tensor {name} ({e})") from None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    model.load_stats = {
        "checkpoint": str(path),
        "checkpoint_bytes": sum(file.stat().st_size for file in set(files.values())),
        "load_s": time.perf_counter() - t0,
        "host_rss_before_bytes": rss_before,
        "host_peak_added_bytes": _peak_rss() - rss_before,
    }
    return model


def save_checkpoint(model: Transformer, path: Path, shard_bytes: int) -> None:
    """Write `model` as a Hugging Face checkpoint: config.json, bf16 safetensors shards of at most `shard_bytes`
    (a larger tensor gets one of its own) and their index. One shard at a time is held in host memory."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(model.config), indent=1))
    targets = tensor_targets(model)
    shards: list[list[str]] = [[]]
    size = 0
    for name, target in targets.items():
        if shards[-1] and size + 2 * target.numel() > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += 2 * target.numel()
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: targets[name].to("cpu", torch.bfloat16).contiguous() for name in names}
        save_file(tensors, path / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names, file)
    total = sum(2 * target.numel() for target in targets.values())
    (path / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


def tensor_targets(model: Transformer) -> dict[str, Tensor]:
    """Each checkpoint tensor's Hugging Face name and the parameter (or the rows of a fused one) it fills."""
    targets = {}
    for name, (param, rows, _) in tensor_layout(model.config).items():
        target = model.get_parameter(param)
        targets[name] = target if rows is None else target[rows]
    return targets


def _status_bytes(key: str) -> int:
    """A memory line of /proc/self/status (kB there) in bytes."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def _reset_peak_rss() -> int:
    """Restart the kernel's peak-RSS mark of this process at its current RSS, which is returned. Where the
    reset is not allowed the peak stays the process's, an upper bound."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmRSS")


def _peak_rss() -> int:
    return _status_bytes("VmHWM")
