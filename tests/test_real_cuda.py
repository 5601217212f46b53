"""The real level on CUDA (run on the GPU machine): the 1B-shaped target replays its steered reference in every
scheduling mode, and the wall-clock loop overlaps host and device as CUDA does: a step costs about host +
device at depth 1 and about max(host, device) at depth 2."""

import itertools

import numpy as np
import pytest
import torch
from helpers import emitted, hil_requests

from simharness.engine.decode import DecodeLoop
from simharness.engine.model import Transformer
from simharness.engine.torch_backend import TorchBackend, capacity
from simharness.models import model_config
from simharness.modes import resolve_mode
from simharness.realloop import RealLoop
from simharness.scenario import scenario_from_dict

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

N_REQUESTS = 6
VOCAB = 512


def real_scenario(depth=1, policy="optimistic", proposer="ngram_gpu", invalid="trim", concurrency=4, **host):
    return scenario_from_dict({
        "name": "real-cuda-test",
        "workload": {"arrival": "closed", "concurrency": concurrency, "num_requests": N_REQUESTS},
        "engine": {"level": "real", "device": "cuda", "model": "llama-3.2-1b",
                   "speculation": {"proposer": proposer, "k": 4, "invalid_slots": invalid},
                   **({"host_costs": host} if host else {})},
        "scheduler": {"depth": depth, "policy": policy, "max_num_batched_tokens": 64},
    })


@pytest.fixture(scope="module")
def requests():
    return hil_requests(N_REQUESTS, VOCAB, steer_all=True)


@pytest.fixture(scope="module")
def model(requests):
    deepest = real_scenario(depth=3)
    slots, positions = capacity(deepest, requests, resolve_mode(deepest))
    return Transformer(model_config("llama-3.2-1b"), max_slots=slots, max_len=positions, device="cuda",
                       cuda_graphs=True)


def run_real(sc, requests, model):
    mode = resolve_mode(sc)
    backend = TorchBackend(sc, requests, model, mode, gate=False)
    with backend.syncs:
        records, _ = RealLoop(sc, requests, mode, backend).run()
    return backend, records


MODES = list(itertools.product([1, 2, 3], ["wait", "optimistic"], ["ngram_cpu", "ngram_gpu"], ["trim", "fill"]))


@pytest.mark.parametrize(("depth", "policy", "proposer", "invalid"), MODES)
def test_real_replays_reference_in_every_mode(depth, policy, proposer, invalid, requests, model):
    backend, records = run_real(real_scenario(depth, policy, proposer, invalid), requests, model)
    for rid in range(N_REQUESTS):
        np.testing.assert_array_equal(emitted(backend, rid), requests.output_tokens[rid], err_msg=f"req {rid}")
    steps = records.steps_frame()
    assert steps["emitted"].sum() == requests.output_len.sum()
    assert (steps["gpu_end"] > steps["gpu_start"]).all()
    assert (steps["gpu_start"] >= steps["prep_start"]).all()  # the device starts no earlier than the launch
    assert (steps["update_start"] >= steps["gpu_end"]).all()  # outputs are settled after the device finished
    # a step's window is events it records anyway: a decode-only step's the decode loop's around it (read after
    # their ring entry came round again, it would be a later step's), a step with prefills its first chunk's start
    # and its end; either holds the step's device phases, and steps do not overlap on the device
    phases = steps[["gpu_prefill_s", "gpu_verify_s", "gpu_sample_s", "gpu_commit_s", "gpu_propose_s"]].sum(axis=1)
    assert (steps["gpu_end"] - steps["gpu_start"] >= phases - 1e-6).all()
    assert (steps["n_prefill_reqs"] > 0).any() and (steps["n_prefill_reqs"] == 0).any()
    assert (steps["gpu_start"].iloc[1:].to_numpy() >= steps["gpu_end"].iloc[:-1].to_numpy() - 5e-6).all()


@pytest.mark.parametrize(("depth", "policy", "proposer", "invalid"), MODES)
def test_k_schedule_replays_reference_in_every_mode(depth, policy, proposer, invalid, requests, model):
    """A k schedule's steps, each through the step graph of its bucket and k, on the wall clock: the reference still
    replays exactly, batches of 4 run plain decode steps (no draft slots)."""
    sc = real_scenario(depth, policy, proposer, invalid)
    sc.engine.speculation.k_schedule = {1: 4, 2: 2, 4: 0}
    backend, records = run_real(sc, requests, model)
    for rid in range(N_REQUESTS):
        np.testing.assert_array_equal(emitted(backend, rid), requests.output_tokens[rid], err_msg=f"req {rid}")
    steps = records.steps_frame()
    assert steps["emitted"].sum() == requests.output_len.sum()
    decodes = steps[steps["n_reqs"] > steps["n_prefill_reqs"]]
    k = decodes["drafts_scheduled"] / (decodes["n_reqs"] - decodes["n_prefill_reqs"])
    assert (k[decodes["n_reqs"] >= 4] == 0).all() and (k > 0).any()
    assert (steps["gpu_end"] > steps["gpu_start"]).all()


def decode_steps(records):
    steps = records.steps_frame()
    return steps[steps["n_prefill_reqs"] == 0]


def cycle(records) -> tuple[float, float, float, float]:
    """Medians over the decode steps: the step cycle (between consecutive schedule starts), the host's busy time
    outside the launch (schedule, prep, update) and in it, and the device time."""
    s = decode_steps(records)
    period = float(np.median(np.diff(s["schedule_start"].to_numpy())[2:]))
    outside = sum(s[f"{p}_end"] - s[f"{p}_start"] for p in ("schedule", "prep", "update"))
    return (period, float(np.median(outside)), float(np.median(s["launch_end"] - s["prep_end"])),
            float(np.median(s["gpu_end"] - s["gpu_start"])))


def test_overlap_host_bound_and_device_bound(requests, model, monkeypatch):
    """Host-bound (8 ms of modelled update work per step) and device-bound (each decode step first sleeps 8 ms on
    the GPU): at depth 2 the cycle is the larger of host and device, at depth 1 about their sum (the device
    runs a step while the host launches it, so the launch overlaps)."""
    host_bound = {d: cycle(run_real(real_scenario(d, invalid="fill", update_us=8000.0), requests, model)[1])
                  for d in (1, 2)}  # fmt: skip
    (p1, outside1, launch1, device1), (p2, outside2, launch2, _) = host_bound[1], host_bound[2]
    assert p2 == pytest.approx(outside2 + launch2, rel=0.15)
    assert p1 == pytest.approx(outside1 + max(launch1, device1), rel=0.15)

    rate, sleep_s = sleep_rate(), 8e-3
    step = DecodeLoop.step

    def slow_step(self, *args, **kwargs):
        torch.cuda._sleep(int(sleep_s * rate))
        return step(self, *args, **kwargs)

    monkeypatch.setattr(DecodeLoop, "step", slow_step)
    device_bound = {d: cycle(run_real(real_scenario(d, invalid="fill"), requests, model)[1]) for d in (1, 2)}
    # a decode-only step's window is the decode loop's events around its graph, after the sleep: the device is busy
    # for both
    (p1, outside1, launch1, device1), (p2, _, _, device2) = device_bound[1], device_bound[2]
    assert p2 == pytest.approx(sleep_s + device2, rel=0.1)
    assert p1 == pytest.approx(outside1 + max(launch1, sleep_s + device1), rel=0.15)


def sleep_rate() -> float:
    """GPU clock cycles per second of `torch.cuda._sleep` (the device-bound step's extra work)."""
    cycles = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles)  # warm-up
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)


def test_device_clock_stays_on_the_hosts_clock_over_seconds():
    """A mark recorded on an idle device is passed soon after its record: over three seconds of steps the clock,
    anchored anew by each wait the host blocked on, never puts it before the record, and puts it no later at the end
    than at the start (the GPU's timer and the host's clock drift apart by tens of microseconds a second, which one
    anchor at the start would keep: 70 us over this test). How soon is the host's fastest wake-up of the last 50 ms:
    a few microseconds alone, 20-50 us measured within the CUDA suite."""
    import time

    from simharness.engine.timing import DeviceClock

    clock = DeviceClock(cuda=True)
    cycles = int(torch.cuda.get_device_properties(0).clock_rate * 1e3 * 1.5e-3)  # about 1.5 ms of device time
    gaps, start = [], time.perf_counter()
    while time.perf_counter() - start < 3.0:
        torch.cuda._sleep(cycles)
        end = clock.mark()
        clock.wait(end)  # the host blocks: an anchor
        t = time.perf_counter() + 200e-6
        while time.perf_counter() < t:  # the device idles
            pass
        recorded = time.perf_counter()
        idle = clock.mark()
        clock.wait(idle)
        gaps.append(clock.seconds(idle) - recorded)
    gaps = np.array(gaps)
    assert len(gaps) > 500
    assert gaps.min() > -2e-6 and np.median(gaps) < 100e-6
    assert np.median(gaps[-200:]) < np.median(gaps[:200]) + 10e-6
