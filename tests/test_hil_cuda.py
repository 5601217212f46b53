"""Hardware in the loop on CUDA (run on the GPU machine): the 1B-shaped target in bf16 replays its steered
reference exactly in every scheduling mode, and a planted host sync shows up in the report's sync sites."""

import itertools
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import emitted, hil_requests

import simharness
from simharness.engine.model import Transformer, get_config
from simharness.engine.torch_backend import TorchBackend, capacity
from simharness.modes import resolve_mode
from simharness.phases import phase
from simharness.records import DEVICE_PHASE_COLUMNS
from simharness.scenario import scenario_from_dict
from simharness.simulation import Simulation

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

N_REQUESTS = 6
VOCAB = 512  # prompt ids; the model keeps the 1B shape's vocabulary


def hil_scenario(depth=1, policy="optimistic", proposer="ngram_gpu", invalid="trim"):
    return scenario_from_dict({
        "name": "hil-cuda-test",
        "workload": {"arrival": "closed", "concurrency": 4, "num_requests": N_REQUESTS},
        "engine": {"level": "hil", "device": "cuda", "model": "llama-3.2-1b",
                   "speculation": {"proposer": proposer, "k": 4, "invalid_slots": invalid}},
        "scheduler": {"depth": depth, "policy": policy, "max_num_batched_tokens": 64},
    })


@pytest.fixture(scope="module")
def requests():
    # steered all the way: a margin of 30 dwarfs bf16 noise, so the tokens are the reference in any batch
    return hil_requests(N_REQUESTS, VOCAB, steer_all=True)


@pytest.fixture(scope="module")
def model(requests):
    deepest = hil_scenario(depth=3)
    slots, positions = capacity(deepest, requests, resolve_mode(deepest))
    return Transformer(get_config("llama-3.2-1b"), max_slots=slots, max_len=positions, device="cuda", cuda_graphs=True)


MODES = list(itertools.product([1, 2, 3], ["wait", "optimistic"], ["ngram_cpu", "ngram_gpu"], ["trim", "fill"]))


def replay(sc, requests, model):
    """Run `sc` at hil on the GPU; every request's emitted tokens are its reference. The backend and the steps."""
    mode = resolve_mode(sc)
    backend = TorchBackend(sc, requests, model, mode, gate=True)
    with backend.syncs:
        records, _ = Simulation(sc, requests, mode, backend).run()
    for rid in range(N_REQUESTS):
        np.testing.assert_array_equal(emitted(backend, rid), requests.output_tokens[rid], err_msg=f"req {rid}")
    steps = records.steps_frame()
    assert steps["emitted"].sum() == requests.output_len.sum()
    assert steps["accepted"].sum() > 0
    return backend, steps


@pytest.mark.parametrize(("depth", "policy", "proposer", "invalid"), MODES)
def test_greedy_replays_reference_in_every_mode(depth, policy, proposer, invalid, requests, model):
    _, steps = replay(hil_scenario(depth, policy, proposer, invalid), requests, model)
    device = steps[DEVICE_PHASE_COLUMNS]
    # the device phases fill the step's device window but for the times the device waited for the enqueue
    assert (device.sum(axis=1) <= (steps["gpu_end"] - steps["gpu_start"]) * (1 + 1e-9)).all()
    assert (steps.loc[steps["decode_tokens"] > 0, "gpu_verify_s"] > 0).all()


# Under the proposer's k = 4 at concurrency 4: the limit, a k below it and plain decode steps (docs/frontier.md).
SCHEDULE = {1: 4, 2: 2, 4: 0}


@pytest.mark.parametrize(("depth", "policy", "proposer", "invalid"), MODES)
def test_k_schedule_replays_reference_in_every_mode(depth, policy, proposer, invalid, requests, model):
    """Each step verifies its batch size's k through the step graph of its bucket and k: the reference still
    replays exactly, and every decoding request's draft slots are at most its step's k."""
    sc = hil_scenario(depth, policy, proposer, invalid)
    sc.engine.speculation.k_schedule = SCHEDULE
    backend, steps = replay(sc, requests, model)
    assert backend.loop.graphs is not None and {key[1] for key in backend.loop.graphs._graphs} == {0, 2, 4}
    decodes = steps[steps["n_reqs"] > steps["n_prefill_reqs"]]
    k = decodes["drafts_scheduled"] / (decodes["n_reqs"] - decodes["n_prefill_reqs"])
    assert (k[decodes["n_reqs"] >= 4] == 0).all() and (k <= 4).all() and (k > 0).any()
    assert (decodes["gpu_verify_s"] > 0).all()


def test_planted_sync_shows_up_in_the_report(tmp_path, monkeypatch):
    planted = torch.ones(1, device="cuda")
    prep = TorchBackend.prep

    def prep_with_item(self, step):
        seconds = prep(self, step)
        with phase("prep"):
            planted.sum().item()  # PLANTED SYNC
        return seconds

    monkeypatch.setattr(TorchBackend, "prep", prep_with_item)
    sc = scenario_from_dict({
        "name": "planted",
        "workload": {"arrival": "closed", "concurrency": 4, "num_requests": 6,
                     "prompt_len": {"dist": "uniform", "min": 32, "max": 64},
                     "output_len": {"dist": "fixed", "value": 24}},
        "engine": {"level": "hil", "device": "cuda", "model": "llama-3.2-1b", "speculation": {"k": 4}},
        "scheduler": {"depth": 2},
    })
    result = simharness.run(sc, tmp_path)
    source = Path(__file__).read_text().splitlines()
    line = next(i for i, text in enumerate(source, 1) if "PLANTED SYNC" in text and "planted.sum" in text)
    site = f"tests/test_hil_cuda.py:{line}"
    syncs = pd.read_parquet(result.run_dir / "device_syncs.parquet")
    planted_rows = syncs[syncs["site"] == site]
    assert len(planted_rows) == len(result.steps), syncs["site"].value_counts()
    assert (planted_rows["phase"] == "prep").all()
    assert (result.steps["device_syncs"] >= 1).all()
    assert site in result.report.read_text()
