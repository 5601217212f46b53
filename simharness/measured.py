"""The measured levels' set-up: the device, one target model shared by a run's points, warm-up, the level.

Above the engine: it builds the real decode loop's model once per run (sized for every point), warms each point
up right before it is measured, and runs it on a `TorchBackend` on the clock its caller hands it
(`pointwork.run_on_clock`: hil in virtual time, real in wall-clock time), so it stands below the clocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from simharness.engine.checkpoint import load_checkpoint
from simharness.engine.model import TORCH_OPS, Transformer
from simharness.engine.torch_backend import TorchBackend, capacity
from simharness.gcwatch import GcWatch
from simharness.hostspeed import RETRIES, HostGauge
from simharness.levels import LEVELS
from simharness.models import checkpoint_dir, model_config
from simharness.modes import Mode
from simharness.records import Records
from simharness.scenario import Engine, Scenario, ScenarioError
from simharness.workload import Requests

# Runs a point over a backend on its level's clock and returns its records and duration (`pointwork.run_on_clock`).
OnClock = Callable[[Scenario, Requests, Mode, TorchBackend], tuple[Records, float]]


def resolve_device(engine: Engine) -> torch.device:
    """`engine.device` as a torch device; `auto` is CUDA when torch sees one."""
    if engine.device == "cuda" and not torch.cuda.is_available():
        raise ScenarioError("engine.device: cuda was asked for but torch sees no CUDA device")
    if engine.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(engine.device)


def build_model(engine: Engine, max_slots: int, max_len: int) -> Transformer:
    """The target model of `engine.model`: a checkpoint's, or a catalogue shape with random weights (every
    catalogue vocabulary holds the built-in tokenizer's ids)."""
    device = resolve_device(engine)
    graphs = engine.cuda_graphs and device.type == "cuda"
    checkpoint = checkpoint_dir(engine.model)
    if checkpoint is not None:
        return load_checkpoint(checkpoint, max_slots=max_slots, max_len=max_len, device=device, cuda_graphs=graphs)
    return Transformer(model_config(engine.model), max_slots=max_slots, max_len=max_len, device=device,
                       cuda_graphs=graphs)


# A warm-up runs a point's first requests, cut to a few output tokens.
WARM_UP_REQUESTS, WARM_UP_TOKENS = 20, 16
TRITON_DIVISOR = 16  # Triton specialises integer arguments on their divisibility by 16


def warm_up(sc: Scenario, requests: Requests, mode: Mode, model: Transformer, on_clock: OnClock) -> None:
    """Run a point on its first WARM_UP_REQUESTS requests, cut to WARM_UP_TOKENS output tokens, at its own level,
    right before it is measured: the kernels' first compilations (seconds each, per specialisation) stay out of
    measured steps, and the device's clocks are up. For Triton's specialisations the closed loop runs at
    concurrency TRITON_DIVISOR (batch sizes up to it cover every class of larger ones too) and one prompt is cut
    to a multiple of it."""
    m = min(WARM_UP_REQUESTS, len(requests.prompt_len))
    cut = np.minimum(requests.output_len[:m], WARM_UP_TOKENS)
    prompt_len = requests.prompt_len[:m].copy()
    if prompt_len[0] > TRITON_DIVISOR:
        prompt_len[0] -= prompt_len[0] % TRITON_DIVISOR
    few = dataclasses.replace(
        requests,
        kind=requests.kind[:m],
        prompt_len=prompt_len,
        output_len=cut,
        prompt_tokens=[t[:p] for t, p in zip(requests.prompt_tokens[:m], prompt_len, strict=True)],
        output_tokens=[t[:c] for t, c in zip(requests.output_tokens[:m], cut, strict=True)],
        arrival_s=None,
    )
    workload = sc.workload.model_copy(update={"arrival": "closed", "concurrency": min(TRITON_DIVISOR, model.max_slots)})
    run_level(sc.model_copy(update={"workload": workload}), few, mode, model, on_clock)


def warm_prefill_shapes(model: Transformer, longest: int) -> None:
    """On CUDA: with CUDA graphs, capture the prefill graphs of every chunk up to `longest` tokens (capture
    synchronizes); without, run a prefill chunk of every length up to `longest`, fresh and after a cached prefix,
    once per process and shape. A GEMM of a new shape may use a cuBLAS kernel not used before, and CUDA loads
    kernels lazily, on first use, synchronizing the device to do so: in a measured step that blocks the host
    mid-enqueue (in hil, behind a closed gate, until the gate gives up). docs/hil.md has the H100 measurement."""
    if model.device.type != "cuda":
        return
    if model.cuda_graphs:
        model.capture_prefill_graphs(longest)
        return
    triton = model.ops is not TORCH_OPS
    key = (model.config, model.max_slots, model.max_len, str(model.device), triton)
    done = _warmed_lengths.get(key, 0)
    if longest <= done:
        return
    # Every layer runs the same kernels on the same shapes, so a one-layer twin of the model loads them all, at
    # 1/n_layers of the work.
    twin = Transformer(dataclasses.replace(model.config, n_layers=1), max_slots=model.max_slots,
                       max_len=model.max_len, device=model.device, triton_kernels=triton)
    tokens = torch.zeros(longest, dtype=torch.int64, device=model.device)
    for n in range(done + 1, min(longest, model.max_len - 1) + 1):
        twin.prefill(0, tokens[:n])
        twin.prefill(0, tokens[:n], start=1)
    torch.cuda.synchronize()
    _warmed_lengths[key] = longest


_warmed_lengths: dict[tuple, int] = {}  # this process's warmed prefill lengths, per model shape and device


def run_level(sc: Scenario, requests: Requests, mode: Mode, model: Transformer,
              on_clock: OnClock) -> tuple[Records, float, TorchBackend]:
    """One point on the real decode loop at its level, on the clock `on_clock` runs it on: hil (virtual time, the
    device gated in front of each launch part so that device times exclude launch gaps) or real (wall clock).
    Synchronizing CUDA operations are recorded."""
    gate = LEVELS[sc.engine.level].clock == "virtual"
    backend = TorchBackend(sc, requests, model, mode, gate=gate, steer=sc.engine.steer)
    with backend.syncs:
        records, duration = on_clock(sc, requests, mode, backend)
    return records, duration, backend


@dataclasses.dataclass
class MeasuredRun:
    """A measured point's records and duration, its backend, and the host gauge around the run that was kept:
    how many times slower than its fastest the host was, and which run of the point it is (1: the first); and
    CPython's garbage collections during that run."""

    records: Records
    duration: float
    backend: TorchBackend
    host_slowdown: float
    host_attempts: int
    gc: GcWatch


class MeasuredEngine:
    """One target model on one device, sized for every measured point of a run and shared by them."""

    def __init__(self, points: list[tuple[Scenario, Mode]], workload: Callable[[Scenario], Requests]):
        """`points` share one model, device and graph setting (the runner checks so before anything runs)."""
        slots = positions = longest = 0
        for sc, mode in points:
            requests = workload(sc)
            s, n = capacity(sc, requests, mode)
            chunk = min(int(requests.prompt_len.max()), sc.scheduler.max_num_batched_tokens)
            slots, positions, longest = max(slots, s), max(positions, n), max(longest, chunk)
        self.model = build_model(points[0][0].engine, slots, positions)
        warm_prefill_shapes(self.model, longest)
        self.gauge = HostGauge()

    def describe(self) -> str:
        device = self.model.device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        return f"{name}, torch {torch.__version__}, model {self.model.config.n_layers} layers"

    def run(self, sc: Scenario, requests: Requests, mode: Mode, on_clock: OnClock) -> MeasuredRun:
        """Warm the point up, then measure it at its level (on `on_clock`); with `engine.host_slowdown`, again (at
        most `hostspeed.RETRIES` times) while the host gauge says the run was measured in a slow spell."""
        warm_up(sc, requests, mode, self.model, on_clock)
        limit, attempt = sc.engine.host_slowdown, 0
        while True:
            attempt += 1
            before = self.gauge.probe()
            with GcWatch() as collections:
                records, duration, backend = run_level(sc, requests, mode, self.model, on_clock)
            slowdown = self.gauge.slowdown(before, self.gauge.probe())
            if limit is None or slowdown <= limit or attempt > RETRIES:
                return MeasuredRun(records, duration, backend, slowdown, attempt, collections)
