"""A calibration file: the step and host costs `simharness calibrate` fitted from measured runs, with their
provenance. A scenario names one in `engine.calibration`; the sim cost model then takes its device step time
from the fitted linear model and its measured host phases from the fitted costs instead of the roofline and
`engine.host_costs`.

The device step time is linear in what the step holds (`DEVICE_FEATURES`, seconds per unit in the file as µs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import yaml

# What a step holds, in the order of the fitted coefficients: a constant per step, decode rows, decode tokens
# (1 + verified slots per row), the decode rows' context (KV tokens read), prefill chunks, prefill tokens, and,
# with the GPU n-gram proposer only, a constant per step and the context it scans.
DEVICE_FEATURES = ("step", "decode_rows", "decode_tokens", "decode_context", "prefill_reqs", "prefill_tokens",
                   "ngram_gpu_step", "ngram_gpu_context")  # fmt: skip
NGRAM_GPU_FEATURES = ("ngram_gpu_step", "ngram_gpu_context")
FORMAT = "simharness-calibration-1"


class CalibrationError(ValueError):
    """A calibration file that cannot be read or does not fit the scenario; the message names the problem."""


@dataclass(frozen=True)
class Calibration:
    """A loaded calibration: where it was measured (`gpu` is the catalogue name the scenario's `engine.gpu`
    must give), for which model, the device coefficients (µs per unit of each DEVICE_FEATURES) and the fitted
    host costs (fields of `engine.host_costs`)."""

    path: str
    device: str
    gpu: str
    model: str
    device_us: tuple[float, ...]
    host_costs: dict[str, float]


def load_calibration(path: str | Path) -> Calibration:
    """Read and check a calibration file (cached per path and modification time)."""
    path = Path(path)
    try:
        mtime = path.stat().st_mtime_ns
    except OSError as e:
        raise CalibrationError(f"{path}: cannot read calibration file ({e.strerror})") from None
    return _load(str(path), mtime)


@functools.lru_cache(maxsize=16)
def _load(path: str, mtime: int) -> Calibration:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise CalibrationError(f"{path}: not a readable calibration file ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CalibrationError(f"{path}: not a simharness calibration (no `format: {FORMAT}`)")
    try:
        device = data["device_step_us"]
        coefficients = tuple(float(device[name]) for name in DEVICE_FEATURES)
        host = {str(k): float(v) for k, v in (data.get("host_costs") or {}).items()}
        return Calibration(path, str(data["device"]), str(data["gpu"]), str(data["model"]), coefficients, host)
    except (KeyError, TypeError, ValueError) as e:
        raise CalibrationError(f"{path}: malformed calibration ({type(e).__name__}: {e})") from None


def check_match(cal: Calibration, gpu: str, model: str) -> None:
    """A calibration answers only for the device and model it was measured on."""
    if cal.model != model:
        raise CalibrationError(f"{cal.path} was fitted for model {cal.model!r}, the scenario runs {model!r} "
                               "(engine.model)")
    if cal.gpu.lower() != gpu.lower():
        raise CalibrationError(f"{cal.path} was measured on {cal.device!r} (gpu {cal.gpu}), the scenario models "
                               f"{gpu!r} (engine.gpu)")
