"""What runs a sweep's points and the driver agree on: the work (a picklable callable computing one point's
result), the executor's interface, the events it yields about each point, and how an error reads in one line."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from simharness.levels import LEVELS
from simharness.scenario import Point

Work = Callable[[Point], Any]


@dataclass
class Event:
    """What happened to a point: `started` on a worker, `retry` after a failed attempt, `done` with its `result`,
    or `failed` for good. `reason` is one line (the error or how the worker died); `detail` a traceback if any."""

    kind: Literal["started", "retry", "done", "failed"]
    point: Point
    result: Any = None
    reason: str = ""
    detail: str = ""


class Executor(Protocol):
    def run(self, points: list[Point], work: Work) -> Iterator[Event]: ...


def describe_error(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    message = str(e).strip().splitlines()
    return f"{type(e).__name__}: {message[0]}" if message else type(e).__name__


def interrupted(e: BaseException) -> bool:
    """Whether `e` carries a Ctrl-C: one that lands inside compiled code comes back from numba's dispatcher as a
    SystemError caused by the KeyboardInterrupt ("returned a result with an exception set"); it must stop the run,
    not be retried as a failed point."""
    seen: set[int] = set()
    cause: BaseException | None = e
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


def wants_gpu(point: Point) -> bool:
    """A measured point (hil or real) that runs on a CUDA device: it gets a GPU of its own."""
    engine = point.scenario.engine
    return LEVELS[engine.level].measured and engine.device != "cpu"
