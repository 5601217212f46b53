"""Instrumentation of the real decode loop: a recorder of synchronizing CUDA ops, each attributed to the phase
open when it ran (`phases`). It assumes one thread (the engine loop), as Python's warning machinery does; torch is
imported only when a recorder is made.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import TextIO

import pandas as pd

from simharness.phases import current_phase, last_boundary
from simharness.records import DEVICE_SYNC_DTYPES, device_syncs_columns

# The text torch's sync debug mode warns with ("... (Triggered internally at ...)" follows it).
SYNC_WARNING = "called a synchronizing CUDA operation"
DEVICE_SYNC_COLUMNS = list(DEVICE_SYNC_DTYPES)
ROOT = Path(__file__).resolve().parents[1]  # sites are reported relative to the repository root


class SyncRecorder:
    """Records the synchronizing CUDA operations run inside `with recorder:` as (step, phase, site, wait_s).

    On CUDA it sets torch's sync debug mode to "warn" and takes the warnings torch emits; without CUDA it
    does nothing, unless `warnings_only`, which installs the warning hook alone (CUDA untouched): then a
    warning with torch's text counts as a sync, which is how the attribution is tested on a CPU.

    torch buffers the warnings a C++ op raises and emits them when the op returns to Python, after the
    sync has waited, so the wait cannot be timed from the handler. `wait_s` is instead the host time
    from the latest mark (phase entry or exit, `start_step`, or the previous sync's return) to the op's
    return: the wait plus any host work since that mark, exact when a phase holds just the sync.
    """

    def __init__(self, *, warnings_only: bool = False) -> None:
        import torch  # here, not at module level: see the module docstring

        self.active = warnings_only or torch.cuda.is_available()
        self.cuda = self.active and not warnings_only
        self.step = -1
        self._mark = time.perf_counter()
        self._rows: list[tuple[int, str, str, float]] = []
        self._counts: Counter[int] = Counter()
        self._skip = (os.path.dirname(torch.__file__) + os.sep, warnings.__file__, __file__)
        self._passthrough = warnings.showwarning
        self._exit: ExitStack | None = None

    def start_step(self, step: int) -> None:
        """Attribute the syncs that follow to `step`."""
        self.step = step
        self._mark = time.perf_counter()

    def __enter__(self) -> SyncRecorder:
        if self._exit is not None:
            raise RuntimeError("this SyncRecorder is already recording")
        with ExitStack() as stack:
            if self.active:
                stack.enter_context(warnings.catch_warnings())  # restores filters and showwarning on exit
                warnings.filterwarnings("always", message=".*" + SYNC_WARNING)
                self._passthrough = warnings.showwarning
                warnings.showwarning = self._show
            if self.cuda:
                import torch

                stack.callback(torch.cuda.set_sync_debug_mode, torch.cuda.get_sync_debug_mode())
                torch.cuda.set_sync_debug_mode("warn")
            self._exit = stack.pop_all()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        stack, self._exit = self._exit, None
        if stack is not None:
            stack.__exit__(exc_type, exc, tb)

    def _show(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        """The `warnings.showwarning` hook: record a sync, hand any other warning on unchanged."""
        if SYNC_WARNING not in str(message):
            self._passthrough(message, category, filename, lineno, file, line)
            return
        wait = time.perf_counter() - max(self._mark, last_boundary())
        self._rows.append((self.step, current_phase(), self._site(), wait))
        self._counts[self.step] += 1
        self._mark = time.perf_counter()

    def _site(self) -> str:
        """`path:line` of the innermost frame outside torch, warnings and this module."""
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(self._skip):
            frame = frame.f_back
        if frame is None:
            return "?"
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(ROOT):
            path = path.relative_to(ROOT)
        return f"{path}:{frame.f_lineno}"

    def count(self, step: int) -> int:
        """Syncs recorded in `step`."""
        return self._counts.get(step, 0)  # without Counter's __missing__ call for a step with none

    def columns(self) -> dict:
        """The recorded syncs as arrays by column (DEVICE_SYNC_COLUMNS), as a point's writer takes its tables."""
        return device_syncs_columns(self._rows)

    def frame(self) -> pd.DataFrame:
        """The recorded syncs, one row each, with columns DEVICE_SYNC_COLUMNS."""
        return pd.DataFrame(self.columns())
