"""Points as tasks on a Ray cluster: a remote one (host:port, ray://host:port, auto) or a local one started here.
A remote cluster's address is checked before anything is written, and Ray's own connection noise is hidden."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from simharness.execution import Event, Work, describe_error, wants_gpu
from simharness.scenario import Point, ScenarioError

RAY_INSTALL = "pip install 'simharness[ray]'  (or: pip install 'ray>=2.9')"


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
            task = ray.remote(max_calls=1)(_task(work)) if self.process_per_point else ray.remote(_task(work))
            resources = ray.cluster_resources()
            window = max(1, int(resources.get("CPU", 0)) + int(resources.get("GPU", 0)))
            todo = deque((p, 0) for p in points)

            def submit() -> Iterator[Event]:
                while todo and len(pending) < window:
                    point, attempt = todo.popleft()
                    need = {"num_gpus": 1, "num_cpus": 1} if wants_gpu(point) else {"num_cpus": 1}
                    pending[task.options(max_retries=0, **need).remote(point)] = (point, attempt)
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


def _task(work: Work) -> Callable[[Point], Any]:
    """The Ray task computing a point with `work`. Ray ships a task's function to a worker process once and keeps
    it there, so the work's state (the measured engine) lives on from one of the worker's points to the next."""

    def task(point: Point) -> Any:
        return work(point)

    return task


def _check_reachable(address: str) -> None:
    """A Ray address that does not answer (within 5 s) is bad input, found before anything is written."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        raise ScenarioError(f"--ray {address}: expected local, auto, HOST:PORT or ray://HOST:PORT")
    try:
        with socket.create_connection((host, int(port)), timeout=5.0) as conn:
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
