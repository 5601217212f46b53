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
import multiprocessing
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Literal, Protocol

from simharness.scenario import Point, ScenarioError

Work = Callable[[Point], Any]
RAY_INSTALL = "pip install 'simharness[ray]'  (or: pip install 'ray>=2.9')"


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


def wants_gpu(point: Point) -> bool:
    """A measured point (hil or real) that runs on a CUDA device: it gets a GPU of its own."""
    engine = point.scenario.engine
    return engine.backend != "model" and engine.device != "cpu"


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
                    kind = "retry" if attempt < self.retries else "failed"
                    yield Event(kind, point, reason=describe_error(e), detail=traceback.format_exc())
                    continue
                yield Event("done", point, result)
                break


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
    if "CUDA_VISIBLE_DEVICES" in env:  # a GPU worker: its measured engine's imports, made while it waits
        with contextlib.suppress(ImportError):  # a broken install says so where the first point imports them
            import simharness.measured  # noqa: F401
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


class RayCluster:
    """Each point a Ray task: on the cluster at `address` (host:port, ray://host:port, or auto), or on a local
    one started here (`local`). A measured point on CUDA asks for one GPU, others for one CPU. A remote cluster
    gets this package's sources with the tasks (runtime_env py_modules); its nodes need the dependencies. With
    `process_per_point`, a Ray worker process runs one task and exits (max_calls=1)."""

    def __init__(self, address: str = "local", retries: int = 2, process_per_point: bool = False):
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ScenarioError(f"--ray: Ray is not installed; install it with: {RAY_INSTALL}") from None
        if address not in ("local", "auto"):
            _check_reachable(address)
        self.address, self.retries, self.process_per_point = address, retries, process_per_point

    def run(self, points: list[Point], work: Work) -> Iterator[Event]:
        import ray

        if not points:
            return
        started_here = self._connect()
        pending: dict[Any, tuple[Point, int]] = {}
        try:
            task = ray.remote(max_calls=1)(_ray_task) if self.process_per_point else ray.remote(_ray_task)
            work_ref = ray.put(work)
            resources = ray.cluster_resources()
            window = max(1, int(resources.get("CPU", 0)) + int(resources.get("GPU", 0)))
            todo = deque((p, 0) for p in points)

            def submit() -> Iterator[Event]:
                while todo and len(pending) < window:
                    point, attempt = todo.popleft()
                    need = {"num_gpus": 1, "num_cpus": 1} if wants_gpu(point) else {"num_cpus": 1}
                    pending[task.options(max_retries=0, **need).remote(work_ref, point)] = (point, attempt)
                    yield Event("started", point)

            while todo or pending:
                yield from submit()
                ready, _ = ray.wait(list(pending), num_returns=1)
                point, attempt = pending.pop(ready[0])
                try:
                    result = ray.get(ready[0])
                except ray.exceptions.RayError as e:
                    cause = getattr(e, "cause", None) if isinstance(e, ray.exceptions.RayTaskError) else None
                    if isinstance(cause, ScenarioError):
                        raise ScenarioError(str(cause)) from None
                    kind = "retry" if attempt < self.retries else "failed"
                    if kind == "retry":
                        todo.appendleft((point, attempt + 1))
                    yield Event(kind, point, reason=describe_error(cause or e), detail=str(e))
                    continue
                yield from submit()  # the freed slot goes on while the driver writes this point
                yield Event("done", point, result)
        finally:
            for ref in pending:
                ray.cancel(ref, force=True)
            if started_here:  # stopping a local cluster takes ~1.5 s: the driver writes the run meanwhile
                global _ray_stopping
                _ray_stopping = threading.Thread(target=ray.shutdown, name="ray-shutdown")
                _ray_stopping.start()

    def _connect(self) -> bool:
        """Join the cluster unless this process already has (a caller's ray.init); True when joined here."""
        import ray

        ray_stopped()
        if ray.is_initialized():
            return False
        options: dict[str, Any] = {"logging_level": "ERROR", "log_to_driver": False, "include_dashboard": False}
        if self.address != "local":
            options["runtime_env"] = {"py_modules": [str(Path(__file__).resolve().parent)]}
        try:
            # joining a cluster, not starting one (whose processes would inherit the hidden descriptor)
            with _ray_log_hidden() if self.address != "local" else contextlib.nullcontext():
                ray.init(address=self.address, **options)
        except (ConnectionError, RuntimeError) as e:
            raise ScenarioError(f"--ray {self.address}: cannot join the Ray cluster ({describe_error(e)})") from None
        return True


@contextmanager
def _ray_log_hidden() -> Iterator[None]:
    """Ray's core writes its connection attempts' warnings straight to file descriptor 2 (a line every few
    seconds while a cluster does not answer): while joining, they go to a temporary file; a failure is said once,
    by the error that follows."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as log:
            os.dup2(log.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


_ray_stopping: threading.Thread | None = None  # the shutdown of the local cluster the last run started


def ray_stopped() -> None:
    """Wait until a local Ray cluster that a run of this process started has stopped: it stops in a thread while
    the driver writes the run, and `simharness.run` returns only after, so its caller may start Ray again."""
    if _ray_stopping is not None:
        _ray_stopping.join()


def _ray_task(work: Work, point: Point) -> Any:
    return work(point)


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A Ray address that does not answer is bad input, found before anything is written."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        raise ScenarioError(f"--ray {address}: expected local, auto, HOST:PORT or ray://HOST:PORT")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as conn:
            conn.sendall(HTTP2_PREFACE)
            head = conn.recv(9)
    except OSError as e:
        raise ScenarioError(f"--ray {address}: no Ray cluster answers there ({e.strerror or e})") from None
    if len(head) < 9 or head[3] != 4:  # a Ray cluster speaks gRPC: HTTP/2, whose server opens with SETTINGS (4)
        raise ScenarioError(f"--ray {address}: something answers there, but not a Ray cluster (no gRPC)")


# An HTTP/2 client's connection preface and an empty SETTINGS frame: a gRPC server (a Ray cluster's GCS or its
# client server) answers with a SETTINGS frame of its own; anything else does not (Ray itself would retry for
# minutes, printing a line of warnings every few seconds).
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


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
