"""Points in local worker processes (spawned: no CUDA state inherited), a worker per slot, each pinned to its GPU
when points run on CUDA. A worker that dies or whose point raises is replaced by a fresh one."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import traceback
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from simharness.execution import Event, Work, describe_error
from simharness.scenario import Point, ScenarioError


@dataclass
class _Worker:
    process: multiprocessing.process.BaseProcess
    conn: Connection


class LocalPool:
    """Points in `workers` local processes, started with spawn (no CUDA state is inherited). With `gpus`, worker i
    sees only GPU gpus[i] (CUDA_VISIBLE_DEVICES), so a measured point has its device to itself; each worker gets
    its share of the cores for its CPU threads (OMP_NUM_THREADS, unless set), as Ray gives its tasks. A worker
    that dies or whose point raises is replaced by a fresh one; with `process_per_point`, so is every worker
    after each point."""

    def __init__(self, workers: int, retries: int = 2, gpus: list[str] | None = None, process_per_point: bool = False):
        self.workers, self.retries, self.gpus = workers, retries, gpus
        self.process_per_point = process_per_point
        self.context = multiprocessing.get_context("spawn")
        self.slots: list[_Worker | None] = [None] * workers

    def start(self) -> None:
        """Start every worker now, before the points and their work are known: a GPU worker imports torch while
        the driver still validates the run (itself importing torch to check the device), ~2.6 s on an H100 host."""
        self.slots = [w or self._start(i) for i, w in enumerate(self.slots)]

    def close(self) -> None:
        """Stop every worker (a run's end, or a run refused after `start`)."""
        for w in self.slots:
            if w is not None:
                _stop(w)
        self.slots = [None] * self.workers

    def run(self, points: list[Point], work: Work) -> Iterator[Event]:
        todo = deque((p, 0) for p in points)
        payload = pickle.dumps(work)
        slots = self.slots
        for w in slots:  # started ahead (`start`): each gets the work first
            if w is not None:
                _feed(w, payload)
        busy: dict[int, tuple[Point, int]] = {}  # slot -> (point, attempt)

        def dispatch(slot: int) -> Iterator[Event]:
            """Give an idle slot the next point (starting its worker if it has none)."""
            if todo:
                if slots[slot] is None:
                    slots[slot] = self._start(slot)
                    _feed(slots[slot], payload)
                busy[slot] = todo.popleft()
                with contextlib.suppress(OSError):  # died while idle: its sentinel tells below; retried
                    slots[slot].conn.send(busy[slot][0])
                yield Event("started", busy[slot][0])

        try:
            while todo or busy:
                for slot in range(self.workers):
                    if slot not in busy:
                        yield from dispatch(slot)
                watched = {w: s for s in busy for w in (slots[s].conn, slots[s].process.sentinel)}
                for slot in sorted({watched[w] for w in wait(list(watched))}):
                    point, attempt = busy.pop(slot)
                    status, value, detail = _receive(slots[slot])
                    if status == "ok":
                        if self.process_per_point:
                            _stop(slots[slot])
                            slots[slot] = None
                        # the worker goes on with its next point while the driver writes this one
                        yield from dispatch(slot)
                        yield Event("done", point, value)
                        continue
                    if status == "bad input":
                        raise ScenarioError(value)
                    _stop(slots[slot])
                    slots[slot] = None
                    if attempt < self.retries:
                        todo.appendleft((point, attempt + 1))
                        yield Event("retry", point, reason=value, detail=detail)
                    else:
                        yield Event("failed", point, reason=value, detail=detail)
        finally:
            self.close()

    def _start(self, slot: int) -> _Worker:
        env = {"CUDA_VISIBLE_DEVICES": self.gpus[slot % len(self.gpus)]} if self.gpus else {}
        if "OMP_NUM_THREADS" not in os.environ:  # the workers share the cores (torch on the CPU would oversubscribe)
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.workers))
        parent, child = self.context.Pipe()
        process = self.context.Process(target=_worker_main, args=(child, env), name=f"simharness-{slot}")
        process.start()
        child.close()
        return _Worker(process, parent)


def _feed(worker: _Worker, payload: bytes) -> None:
    """Hand a worker the run's work (pickled), the first message it waits for."""
    with contextlib.suppress(OSError):  # it died: its sentinel tells once it has a point
        worker.conn.send_bytes(payload)


def _worker_main(conn: Connection, env: dict[str, str]) -> None:
    """A worker process: pin the device before anything can touch CUDA, receive the run's work, then run points
    until the driver hangs up. Ctrl-C goes to the whole process group; the driver alone handles it (and stops its
    workers)."""
    os.environ.update(env)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if "CUDA_VISIBLE_DEVICES" in env:  # a GPU worker: torch, the bulk of its measured engine's imports, while it waits
        with contextlib.suppress(ImportError):  # a broken install says so where the first point imports it
            import torch  # noqa: F401
    try:
        work = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return  # started ahead and not needed (the run was refused, or had fewer points than workers)
    while True:
        try:
            point = conn.recv()
        except (EOFError, OSError):
            return
        try:
            answer = ("ok", work(point), "")
        except ScenarioError as e:
            answer = ("bad input", str(e), "")
        except Exception as e:
            answer = ("error", describe_error(e), traceback.format_exc())
        try:
            conn.send(answer)
        except OSError:
            return  # the driver is gone
        if answer[0] == "error":
            return  # its state may be broken (a CUDA error): the driver starts a fresh worker


def _receive(worker: _Worker) -> tuple[str, Any, str]:
    """A busy worker's answer: ("ok", result, ""), ("bad input", message, "") for a ScenarioError, or ("error",
    reason, traceback) when it raised anything else or died."""
    try:
        if worker.conn.poll():
            return worker.conn.recv()
    except (EOFError, OSError):
        pass
    worker.process.join(timeout=5)
    code = worker.process.exitcode
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        hint = " (kill -9 or the out-of-memory killer)" if name == "SIGKILL" else ""
        return "error", f"worker died: killed by {name}{hint}", ""
    return "error", f"worker died: exit status {code}", ""


def _stop(worker: _Worker) -> None:
    worker.conn.close()
    if worker.process.is_alive():
        worker.process.kill()
    worker.process.join(timeout=10)
