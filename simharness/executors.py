"""Where a sweep's points run: in this process, in local worker processes, or as tasks on a Ray cluster.

An executor takes the points still to run and `work`, a picklable callable that computes one point's result, and
yields what happens to each point as it happens (started, retried, done, failed). It writes nothing: the driver
writes each finished point as it arrives, so a run directory looks the same whatever ran its points. A point whose
worker dies (kill -9, the out-of-memory killer, a CUDA error) or whose computation raises is retried, on a fresh
worker, up to `retries` times, then reported failed with the reason; the other points go on. A point that raises
ScenarioError (bad input found only when it runs, such as a broken checkpoint) stops the sweep with that error:
no retry can fix it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import traceback
from collections.abc import Iterator

from simharness.execution import Event, Executor, Work, describe_error, interrupted, wants_gpu
from simharness.localpool import LocalPool
from simharness.raycluster import RayCluster, ray_stopped
from simharness.scenario import Point, ScenarioError

__all__ = ["Event", "Executor", "LocalPool", "RayCluster", "Serial", "make_executor", "ray_stopped", "visible_gpus"]


class Serial:
    """Every point in this process, one after another: the default, and what the others are checked against."""

    def __init__(self, retries: int = 2):
        self.retries = retries

    def run(self, points: list[Point], work: Work) -> Iterator[Event]:
        for point in points:
            for attempt in range(self.retries + 1):
                yield Event("started", point)
                try:
                    result = work(point)
                except ScenarioError:
                    raise
                except Exception as e:
                    if interrupted(e):
                        raise KeyboardInterrupt from e
                    kind = "retry" if attempt < self.retries else "failed"
                    yield Event(kind, point, reason=describe_error(e), detail=traceback.format_exc())
                    continue
                yield Event("done", point, result)
                break


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (or their indices). Counted by nvidia-smi
    where it can (0.1 s, where importing torch to ask takes 2-3 s), else by torch."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip()]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        lines = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=True).stdout
        gpus = [line for line in lines.splitlines() if line.startswith("GPU ")]
        if gpus and "MIG " not in lines:  # MIG instances are CUDA devices of their own: let torch count them
            return [str(i) for i in range(len(gpus))]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def make_executor(points: list[Point], *, workers: int | str | None = None, ray: str | None = None,
                  retries: int = 2, process_per_point: bool = False) -> Executor:
    """The executor for `points`: serial (neither option), `workers` local processes (`auto`: one per CPU, or
    one per visible GPU when a point runs on CUDA, each pinned to its GPU), or Ray tasks at address `ray`. With
    `process_per_point` each point runs in a process started for it (one worker unless `workers` says more), so
    measured repeats also differ by process: CUDA context, allocator, compiled-kernel caches, heap."""
    if retries < 0:
        raise ScenarioError("--retries: must be >= 0")
    if workers is not None and ray is not None:
        raise ScenarioError("--workers and --ray: choose one")
    if ray is not None:
        return RayCluster(ray, retries, process_per_point)
    if workers is None and not process_per_point:
        return Serial(retries)
    gpus = visible_gpus() if any(wants_gpu(p) for p in points) else None
    if workers is None:
        workers = 1
    elif workers == "auto":
        workers = len(gpus) if gpus is not None else os.cpu_count() or 1
    if not isinstance(workers, int) or workers < 1:
        raise ScenarioError(f"--workers {workers}: must be a whole number >= 1, or auto")
    if gpus is not None and workers > len(gpus):
        raise ScenarioError(f"--workers {workers}: a point runs on CUDA and each worker needs a GPU of its own; "
                            f"{len(gpus)} visible")
    return LocalPool(workers, retries, gpus, process_per_point)
