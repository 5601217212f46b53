"""The levels a point runs at, one row each: what runs a step, where time comes from, whether it is measured, and
the fields it reads nowhere. `engine.level` names a row; every other site reads this table.

Scenarios written before `engine.level` named a level by its backend (`engine.backend: model|torch|real`); they
are still read, through `OLD_NAMES`, with one note.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Literal

from simharness.errors import ScenarioNote

LevelName = Literal["sim", "hil", "real"]


@dataclass(frozen=True)
class Level:
    backend: Literal["model", "torch"]  # what runs a step: the cost model, or the real decode loop
    clock: Literal["virtual", "wall"]  # where time comes from: SimPy's virtual clock, or the wall clock
    measured: bool  # its step times are measured on a device (warmed up; its repeats keep the seed)
    ignores: tuple[str, ...]  # fields it reads nowhere: set away from their defaults, they are noted
    old_name: str  # its name as `engine.backend`


# A measured point's device and step times are measured and its acceptance is the sampler's.
_MEASURED_IGNORES = ("engine.gpu", "engine.gpu_costs", "engine.speculation.acceptance", "engine.calibration",
                     "engine.profile", "engine.gc.full_every", "engine.host_costs.gc_ns_per_object")
LEVELS: dict[str, Level] = {
    # a sim point runs no decode loop and has no host to gauge
    "sim": Level("model", "virtual", False, ("engine.device", "engine.cuda_graphs", "engine.steer",
                                             "engine.host_slowdown"), "model"),
    "hil": Level("torch", "virtual", True, _MEASURED_IGNORES, "torch"),  # the sim clock with measured steps
    "real": Level("torch", "wall", True, _MEASURED_IGNORES, "real"),
}
OLD_NAMES = {level.old_name: name for name, level in LEVELS.items()}  # engine.backend value -> level


def renamed(value: object) -> object:
    """The level an old `engine.backend` value names (noted once per process); any other value unchanged, for the
    validation of `engine.level` to name it."""
    if not isinstance(value, str) or value not in OLD_NAMES:
        return value
    _note_old_name()
    return OLD_NAMES[value]


@functools.cache
def _note_old_name() -> None:
    pairs = ", ".join(f"{old}: {level}" for old, level in OLD_NAMES.items())
    warnings.warn(ScenarioNote(f"engine.backend is the old name of engine.level ({pairs}); read as engine.level"),
                  stacklevel=2)
