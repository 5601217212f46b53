"""Hardware in the loop on the CPU: the SimPy scheduler drives the real decode loop (tiny model).

The invariant: greedy speculative decoding under any scheduling mode emits exactly the tokens of plain
greedy decoding, which holds only if positions, drafts, placeholders, corrections and finished-in-flight
requests are all handled right on the real device state."""

import dataclasses
import itertools

import numpy as np
import pytest
import torch
from helpers import hil_requests, single_thread

from simharness.engine.decode import DecodeLoop
from simharness.engine.model import Transformer, get_config
from simharness.engine.torch_backend import TorchBackend, capacity
from simharness.records import STEP_COLUMNS
from simharness.scenario import scenario_from_dict
from simharness.simulation import Simulation, resolve_mode
from simharness.workload import Requests

VOCAB = 512
N_REQUESTS = 5


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    yield from single_thread()


def hil_scenario(depth=1, policy="optimistic", proposer="ngram_gpu", invalid="trim", budget=48, **engine):
    return scenario_from_dict({
        "name": "hil-test",
        "workload": {"arrival": "closed", "concurrency": 3, "num_requests": N_REQUESTS},
        "engine": {"backend": "torch", "device": "cpu", "model": "tiny",
                   "speculation": {"proposer": proposer, "k": 3, "invalid_slots": invalid}, **engine},
        "scheduler": {"depth": depth, "policy": policy, "max_num_batched_tokens": budget},
    })


@pytest.fixture(scope="module")
def requests() -> Requests:
    return hil_requests(N_REQUESTS, VOCAB)


@pytest.fixture(scope="module")
def model(requests: Requests) -> Transformer:
    slots, positions = capacity(hil_scenario(depth=3), requests, 3, 3)
    config = dataclasses.replace(get_config("tiny"), vocab_size=VOCAB)
    return Transformer(config, max_slots=slots, max_len=positions, device="cpu", seed=3)


@pytest.fixture(scope="module")
def plain_greedy(model: Transformer, requests: Requests) -> list[np.ndarray]:
    """Each request decoded alone, one token per step (k = 0), steered the same way."""
    loop = DecodeLoop(model, k=0, min_n=1, max_n=1)
    slot = torch.tensor([0])
    outputs = []
    for prompt, reference, n in zip(requests.prompt_tokens, requests.output_tokens, requests.output_len, strict=True):
        tokens = [int(loop.add_request(0, prompt, reference)[0])]
        while len(tokens) < n:
            tokens.append(int(loop.readback(loop.step(slot)).tokens[0, 0]))
        outputs.append(np.array(tokens))
    return outputs


def run_hil(sc, requests, model):
    backend = TorchBackend(sc, requests, model, resolve_mode(sc))
    sim = Simulation(sc, requests, None, backend=backend)
    with backend.syncs:
        records, _ = sim.run()
    return backend, records


MODES = list(itertools.product([1, 2, 3], ["wait", "optimistic"], ["ngram_cpu", "ngram_gpu"], ["trim", "fill"]))


@pytest.mark.parametrize(("depth", "policy", "proposer", "invalid"), MODES)
def test_greedy_equals_plain_greedy_in_every_mode(depth, policy, proposer, invalid, requests, model, plain_greedy):
    sc = hil_scenario(depth, policy, proposer, invalid)
    backend, records = run_hil(sc, requests, model)
    for rid, expected in enumerate(plain_greedy):
        np.testing.assert_array_equal(backend.output_tokens(rid), expected, err_msg=f"request {rid}")
    steps = records.steps_frame()
    assert steps["emitted"].sum() == requests.output_len.sum()
    assert steps["prefill_tokens"].sum() == requests.prompt_len.sum()
    assert steps["accepted"].sum() > 0  # the proposer's drafts were really verified and accepted


def test_async_exercises_chunks_and_finished_requests_in_flight(requests, model):
    """The cases the equivalence test must cover: prompts split over steps, wasted slots of requests that
    finished while a later step was in flight, and slot reuse (5 requests through 3 slots)."""
    sc = hil_scenario(3, "optimistic", "ngram_gpu", "fill", budget=32)
    _, records = run_hil(sc, requests, model)
    steps = records.steps_frame()
    assert (steps["n_prefill_reqs"] > 0).sum() > N_REQUESTS  # some prompt took more than one step
    assert steps["wasted_slots"].sum() > 0


def test_steps_record_measured_phases(requests, model):
    sc = hil_scenario(2, "wait", "ngram_gpu", "trim")
    _, records = run_hil(sc, requests, model)
    steps = records.steps_frame()
    assert list(steps.columns[: len(STEP_COLUMNS)]) == STEP_COLUMNS
    assert (steps["measured"] == "prep,launch,gpu,readback").all()
    device = steps[["gpu_prefill_s", "gpu_verify_s", "gpu_sample_s", "gpu_commit_s", "gpu_propose_s"]]
    assert (device >= 0).all().all()
    np.testing.assert_allclose(device.sum(axis=1), steps["gpu_end"] - steps["gpu_start"], rtol=1e-9, atol=1e-12)
    decode = steps["decode_tokens"] > 0
    assert (steps.loc[decode, "gpu_verify_s"] > 0).all()
    assert (steps.loc[steps["n_prefill_reqs"] > 0, "gpu_prefill_s"] > 0).all()
    assert (steps["harness_s"] >= 0).all()
    assert (steps["device_syncs"] == 0).all()  # no CUDA here: nothing to catch


def test_cpu_proposer_phase_is_measured(requests, model):
    sc = hil_scenario(1, "wait", "ngram_cpu", "trim")
    _, records = run_hil(sc, requests, model)
    steps = records.steps_frame()
    assert (steps["measured"] == "prep,launch,gpu,readback,propose").all()
    assert (steps["propose_end"] > steps["propose_start"]).any()
