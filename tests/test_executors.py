"""Executors: serial, local worker processes and a local Ray cluster give the same run bit for bit; a killed worker's
point is retried; a failed point never loses the others; resume after a killed driver redoes nothing finished."""

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml
from helpers import SMALL
from typer.testing import CliRunner

import simharness
from simharness import pointwork, results
from simharness.cli import app
from simharness.executors import LocalPool, Serial
from simharness.results import TABLES
from simharness.scenario import ScenarioError, scenario_from_dict, sweep_points

ray = pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster():
    """One local Ray cluster (2 CPUs) for the module: starting one takes seconds. Functions of this module travel by
    value, since Ray's workers cannot import tests/."""
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    return simharness.run(scenario_from_dict(SMALL), out=tmp_path_factory.mktemp("serial"))


def assert_same_run(a: Path, b: Path) -> None:
    assert (a / "summary.csv").read_bytes() == (b / "summary.csv").read_bytes()
    for name in TABLES:
        pd.testing.assert_frame_equal(results.read_table(a, name), results.read_table(b, name))


def test_workers_and_ray_give_the_serial_run_bit_for_bit(serial, cluster, tmp_path):
    sc = scenario_from_dict(SMALL)
    pooled = simharness.run(sc, out=tmp_path / "pool", workers=2)
    on_ray = simharness.run(sc, out=tmp_path / "ray", ray="local")
    assert_same_run(serial.run_dir, pooled.run_dir)
    assert_same_run(serial.run_dir, on_ray.run_dir)
    assert len(on_ray.steps) == len(serial.steps) > 0 and on_ray.failed.empty


class _Counting:
    """Work whose state, the number of points this process computed with it, does not travel (as PointWork's)."""

    def __init__(self) -> None:
        self.count = 0

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.count = 0

    def __call__(self, point) -> tuple[int, int]:
        self.count += 1
        return os.getpid(), self.count


def test_a_ray_worker_keeps_its_work_state_between_points(cluster):
    """A Ray worker process computes its points with one copy of the work: its state (a measured engine) is built
    once per process, not once per point."""
    from simharness.raycluster import RayCluster

    done = [e.result for e in RayCluster("local").run(sweep_points(scenario_from_dict(SMALL)), _Counting())
            if e.kind == "done"]
    counts: dict[int, list[int]] = {}
    for pid, count in done:
        counts.setdefault(pid, []).append(count)
    assert len(done) == 4 and max(map(len, counts.values())) > 1
    assert all(sorted(c) == list(range(1, len(c) + 1)) for c in counts.values()), counts


def _die_once(marker: Path, point):
    """Work that kills its own process (kill -9) the first time it meets point 1, mid-point."""
    if point.index == 1 and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return point.index


def _where(point):
    return os.environ.get("CUDA_VISIBLE_DEVICES"), os.getpid()


def _raise_on_2(point):
    if point.index == 2:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    return point.index


def events(executor, work) -> list[tuple[str, int, str]]:
    points = sweep_points(scenario_from_dict(SMALL))
    return [(e.kind, e.point.index, e.reason) for e in executor.run(points, work)]


def test_a_killed_worker_process_gets_its_point_retried(tmp_path):
    seen = events(LocalPool(2, retries=1), functools.partial(_die_once, tmp_path / "died"))
    assert ("retry", 1, "worker died: killed by SIGKILL (kill -9 or the out-of-memory killer)") in seen
    assert sorted(i for kind, i, _ in seen if kind == "done") == [0, 1, 2, 3]


def _index(point):
    return point.index


def test_a_worker_gets_its_next_point_before_the_driver_writes_the_last():
    """A freed worker starts its next point before the driver receives (and writes) the finished one."""
    seen = events(LocalPool(1), _index)
    assert [(kind, i) for kind, i, _ in seen] == [("started", 0), ("started", 1), ("done", 0), ("started", 2),
                                                  ("done", 1), ("started", 3), ("done", 2), ("done", 3)]


def test_a_killed_ray_worker_gets_its_task_retried(cluster, tmp_path):
    from simharness.executors import RayCluster

    seen = events(RayCluster("local", retries=1), functools.partial(_die_once, tmp_path / "died"))
    assert [kind for kind, i, _ in seen if i == 1] == ["started", "retry", "started", "done"]
    assert sorted(i for kind, i, _ in seen if kind == "done") == [0, 1, 2, 3]


@pytest.mark.parametrize("make", [lambda: Serial(retries=1), lambda: LocalPool(2, retries=1)], ids=["serial", "pool"])
def test_a_point_that_raises_fails_after_its_retries_and_the_others_finish(make):
    seen = events(make(), _raise_on_2)
    reason = "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert [(kind, r) for kind, i, r in seen if i == 2] == [("started", ""), ("retry", reason), ("started", ""),
                                                            ("failed", reason)]
    assert sorted(i for kind, i, _ in seen if kind == "done") == [0, 1, 3]


def _bad_checkpoint(point):
    raise ScenarioError("engine.model: tensor x is missing")


@pytest.mark.parametrize("make", [lambda: Serial(), lambda: LocalPool(2)], ids=["serial", "pool"])
def test_bad_input_found_by_a_point_stops_the_sweep_as_bad_input(make):
    with pytest.raises(ScenarioError, match="^engine.model: tensor x is missing$"):
        events(make(), _bad_checkpoint)


def test_each_worker_sees_only_its_gpu():
    """CPU stand-in for a 2-GPU machine: worker i runs with CUDA_VISIBLE_DEVICES = its GPU, for all its points."""
    points = sweep_points(scenario_from_dict(SMALL))
    seen = [e.result for e in LocalPool(2, gpus=["0", "1"]).run(points, _where) if e.kind == "done"]
    by_pid = {}
    for device, pid in seen:
        by_pid.setdefault(pid, set()).add(device)
    assert all(len(devices) == 1 for devices in by_pid.values())
    assert set.union(*by_pid.values()) == {"0", "1"}


def test_workers_started_ahead_run_the_points_and_stop_when_closed_unused():
    """A GPU pool starts its workers before the run is validated (they import torch meanwhile); those same workers
    then run the points, and a pool closed without a run leaves no process behind."""
    points = sweep_points(scenario_from_dict(SMALL))
    pool = LocalPool(2, gpus=["0", "1"])
    pool.start()
    started = {w.process.pid for w in pool.slots}
    assert {pid for _, pid in (e.result for e in pool.run(points, _where) if e.kind == "done")} == started
    unused = LocalPool(2, gpus=["0", "1"])
    unused.start()
    processes = [w.process for w in unused.slots]
    unused.close()
    assert not any(p.is_alive() for p in processes) and unused.slots == [None, None]


def _fake_nvidia_smi(directory: Path, monkeypatch, extra: str = "") -> None:
    """An nvidia-smi first on PATH that lists two GPUs (and `extra` lines), CUDA_VISIBLE_DEVICES unset."""
    smi = directory / "nvidia-smi"
    listing = "GPU 0: NVIDIA H200 (UUID: GPU-a)\\nGPU 1: NVIDIA H200 (UUID: GPU-b)\\n" + extra
    smi.write_text(f"#!/bin/sh\nprintf '{listing}'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{directory}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_visible_gpus_are_counted_by_nvidia_smi_and_mig_is_left_to_torch(tmp_path, monkeypatch):
    import torch

    from simharness.executors import visible_gpus

    _fake_nvidia_smi(tmp_path, monkeypatch)
    assert visible_gpus() == ["0", "1"]
    _fake_nvidia_smi(tmp_path, monkeypatch, extra="  MIG 1g.10gb Device 0: (UUID: MIG-c)\\n")
    assert len(visible_gpus()) == torch.cuda.device_count()  # torch counts MIG instances
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert visible_gpus() == ["3", "1"]


def test_a_run_refused_after_its_gpu_workers_started_writes_nothing_and_leaves_no_worker(tmp_path, monkeypatch):
    """nvidia-smi lists two GPUs, so the pool starts its two workers ahead; torch then sees no CUDA device (a CPU
    build): the run is refused as bad input, nothing is written, and the workers are gone."""
    import multiprocessing

    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine where torch sees no CUDA device")
    _fake_nvidia_smi(tmp_path, monkeypatch)
    started = []
    monkeypatch.setattr(LocalPool, "start", lambda pool, start=LocalPool.start: started.append(start(pool)))
    doc = {**SMALL, "engine": {**SMALL["engine"], "level": "hil", "device": "cuda"}}
    with pytest.raises(ScenarioError, match="engine.device: cuda was asked for .* sees no CUDA device here"):
        simharness.run(scenario_from_dict(doc), out=tmp_path / "out", workers=2)
    assert started and not (tmp_path / "out").exists()
    assert multiprocessing.active_children() == []


def test_a_failed_point_is_recorded_kept_apart_and_retried_by_resume(serial, tmp_path, monkeypatch):
    original = pointwork.point_result

    def flaky(point, *args):
        if point.index == 2:
            raise ValueError("boom")
        return original(point, *args)

    monkeypatch.setattr(pointwork, "point_result", flaky)
    sc = scenario_from_dict(SMALL)
    broken = simharness.run(sc, out=tmp_path, retries=0)
    assert broken.failed["point"].tolist() == ["scheduler.depth=2,workload.concurrency=2"]
    assert broken.failed["failed"].tolist() == ["ValueError: boom"]
    assert len(broken.summary) == 4 and broken.summary["mean_tpot_ms"].notna().sum() == 3
    assert "## Failed points" in broken.report.read_text()
    assert "Traceback" in (broken.run_dir / "points" / "0002.failed.json").read_text()
    result = CliRunner().invoke(app, ["run", str(_write(tmp_path, SMALL)), "--out", str(tmp_path / "cli"),
                                      "--retries", "0"])  # fmt: skip
    assert result.exit_code == 1 and "failed: scheduler.depth=2,workload.concurrency=2: ValueError: boom" in (
        result.output)
    monkeypatch.setattr(pointwork, "point_result", original)
    resumed = simharness.run(sc, resume=broken.run_dir)
    assert resumed.failed.empty and not (broken.run_dir / "points" / "0002.failed.json").exists()
    assert_same_run(serial.run_dir, resumed.run_dir)


def test_a_run_whose_every_point_failed_still_gets_its_report(tmp_path, monkeypatch):
    def broken(point, *args):
        raise ValueError("boom")

    monkeypatch.setattr(pointwork, "point_result", broken)
    run = simharness.run(scenario_from_dict(SMALL), out=tmp_path, retries=0)
    assert run.failed["failed"].tolist() == ["ValueError: boom"] * 4
    text = run.report.read_text()
    assert "No finished sweep points yet." in text and text.count("ValueError: boom") == 4


def _write(tmp_path: Path, scenario: dict) -> Path:
    path = tmp_path / f"{scenario['name']}.yaml"
    path.write_text(yaml.safe_dump(scenario))
    return path


def _children(pid: int) -> list[int]:
    """Worker processes of a driver (not multiprocessing's resource tracker)."""
    found = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline:
            found.append(int(child))
    return found


def _alive(pid: int) -> bool:
    try:
        return "\tZ" not in Path(f"/proc/{pid}/status").read_text().split("State:")[1].splitlines()[0]
    except FileNotFoundError:
        return False


def _finished(out: Path) -> list[Path]:
    return [p for p in out.glob("*/*/points/[0-9]*") if (p / "summary.json").is_file()]


def _wait_for(condition, timeout_s: float = 180.0) -> None:
    deadline = time.time() + timeout_s
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def _pid(point):
    return os.getpid()


def test_process_per_point_runs_every_point_in_a_process_of_its_own(cluster):
    from simharness.executors import RayCluster, make_executor

    points = sweep_points(scenario_from_dict(SMALL))

    def pids(executor) -> list[int]:
        return [e.result for e in executor.run(points, _pid) if e.kind == "done"]

    assert len(set(pids(LocalPool(1)))) == 1  # a worker keeps running points
    assert len(set(pids(make_executor(points, process_per_point=True)))) == len(points) == 4
    assert len(set(pids(LocalPool(2, process_per_point=True)))) == 4
    assert len(set(pids(RayCluster("local", process_per_point=True)))) == 4


def test_a_run_with_a_process_per_point_gives_the_serial_run_bit_for_bit(serial, tmp_path):
    result = CliRunner().invoke(app, ["run", str(_write(tmp_path, SMALL)), "--out", str(tmp_path / "out"),
                                      "--process-per-point"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert_same_run(serial.run_dir, next((tmp_path / "out").glob("*/*")))


def test_killed_worker_and_killed_driver_then_resume_redoes_nothing_finished(tmp_path):
    """kill -9 a worker mid-sweep (its point is retried), then kill -9 the driver; resume finishes the rest and
    matches the serial run. The points are long enough for the run to span several batches (results.FLUSH_S):
    the driver's kill loses only the points not yet in one."""
    big = {**SMALL, "name": "big", "workload": {**SMALL["workload"], "num_requests": 2000},
           "sweep": {"scheduler.depth": [1, 2, 3], "workload.concurrency": [2, 3, 4, 6, 8, 12, 16, 24]}}
    scenario = _write(tmp_path, big)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "simharness", "run", str(scenario), "--workers", "2"]
    out = tmp_path / "out"
    with open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen([*cmd, "--out", str(out)], env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        _wait_for(lambda: len(_finished(out)) >= 1)
        os.kill(_children(proc.pid)[0], signal.SIGKILL)
        before = len(_finished(out))  # then a batch written after the retry
        _wait_for(lambda: "worker died" in (tmp_path / "stderr").read_text() and len(_finished(out)) > before)
        workers = _children(proc.pid)
        proc.kill()
        proc.wait(timeout=30)
    stderr = (tmp_path / "stderr").read_text()
    assert "worker died: killed by SIGKILL" in stderr, stderr[-3000:]
    _wait_for(lambda: not any(_alive(w) for w in workers), 60)  # the workers leave with the driver
    finished = {p: (p / "summary.json").stat().st_mtime_ns for p in _finished(out)}
    # what the waits above guarantee: a batch written after the retry, and not the whole sweep
    assert before < len(finished) < 24, (before, len(finished), stderr[-3000:])
    run_dir = next(iter(finished)).parents[1]
    r = subprocess.run([*cmd, "--resume", str(run_dir)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert {p: (p / "summary.json").stat().st_mtime_ns for p in finished} == finished  # not redone
    reference = simharness.run(scenario_from_dict(big), out=tmp_path / "serial")
    assert_same_run(reference.run_dir, run_dir)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workers", "0"], "--workers 0: must be a whole number >= 1, or auto"),
        (["--workers", "two"], "--workers 'two': expected a whole number >= 1, or auto"),
        (["--retries", "-1"], "--retries: must be >= 0"),
        (["--workers", "2", "--ray", "local"], "--workers and --ray: choose one"),
        (["--ray", "127.0.0.1:9"], "--ray 127.0.0.1:9: no Ray cluster answers there"),
        (["--ray", "nowhere"], "--ray nowhere: expected local, auto, HOST:PORT or ray://HOST:PORT"),
    ],
)
def test_bad_executor_options_exit_2_and_write_nothing(tmp_path, args, message):
    result = CliRunner().invoke(app, ["run", str(_write(tmp_path, SMALL)), "--out", str(tmp_path / "out"), *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert not (tmp_path / "out").exists()


def test_ray_address_that_is_not_a_cluster_exits_2_at_once(tmp_path):
    """A port that answers but is no Ray cluster (a web server) is refused before Ray tries to join it (which took
    minutes, printing Ray's own warnings); the GCS of a real cluster passes the same check."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(1024)
            conn.sendall(b"HTTP/1.0 400 Bad request\r\n\r\n")

    threading.Thread(target=answer, daemon=True).start()
    result = CliRunner().invoke(app, ["run", str(_write(tmp_path, SMALL)), "--out", str(tmp_path / "out"), "--ray",
                                      f"127.0.0.1:{port}"])  # fmt: skip
    server.close()
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"error: --ray 127.0.0.1:{port}: something answers there, but not a Ray " \
                                    "cluster (no gRPC)"
    assert not (tmp_path / "out").exists()


def test_a_ray_clusters_address_passes_the_check(cluster):
    from simharness.raycluster import _check_reachable

    _check_reachable(ray.get_runtime_context().gcs_address)


def test_ray_without_ray_installed_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now fails as if it were not installed
    result = CliRunner().invoke(app, ["run", str(_write(tmp_path, SMALL)), "--out", str(tmp_path / "out"), "--ray",
                                      "local"])  # fmt: skip
    assert result.exit_code == 2
    assert "Ray is not installed; install it with: pip install 'simharness[ray]'" in " ".join(result.output.split())
    assert not (tmp_path / "out").exists()


def test_a_ctrl_c_inside_compiled_code_stops_the_serial_run_and_is_not_retried():
    """numba's dispatcher hands a KeyboardInterrupt that lands in compiled code back as a SystemError caused by it:
    the run stops (the CLI then keeps the finished points and prints --resume) instead of retrying the point."""
    calls = []

    def work(point):
        calls.append(point.id)
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as ki:
            raise SystemError("CPUDispatcher(<function _schedule>) returned a result with an exception set") from ki

    sc = scenario_from_dict(SMALL)
    events = Serial(retries=2).run(sweep_points(sc), work)
    assert next(events).kind == "started"
    with pytest.raises(KeyboardInterrupt):
        next(events)
    assert len(calls) == 1


def test_an_error_without_a_ctrl_c_in_its_chain_is_still_retried():
    def work(point):
        try:
            raise ValueError("inner")
        except ValueError as inner:
            raise SystemError("outer") from inner

    events = list(Serial(retries=1).run(sweep_points(scenario_from_dict(SMALL))[:1], work))
    assert [e.kind for e in events] == ["started", "retry", "started", "failed"]
