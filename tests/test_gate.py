"""The device gate (kernels/gate.py) on the CPU, in Triton's interpreter: an open gate lets the kernel through at
once and a closed one gives up after its polls. tests/test_kernels_cuda.py checks that on CUDA a closed gate
holds the stream until the host opens it."""

import pytest
import torch

from simharness.kernels.gate import Gate


@pytest.fixture(autouse=True)
def _interpreted_gate() -> None:
    """Triton interprets only on a machine without CUDA (tests/conftest.py); on a CUDA machine the compiled gate is
    tested in tests/test_kernels_cuda.py."""
    if torch.cuda.is_available():
        pytest.skip("CUDA machine: the compiled gate is tested in tests/test_kernels_cuda.py")


def test_gate_tickets_and_polls_on_the_cpu():
    gate = Gate("cpu", max_polls=50)  # built on an open gate: the compile, no wait
    assert gate.ticket == 1 and gate.host[0] == 1
    gate.open()
    gate.close()  # ticket 2 while the counter says 1: polls 50 times, then gives up
    assert gate.ticket == 2 and gate.host[0] == 1
    gate.open()
    assert gate.host[0] == 2
    gate.host[0] = 5  # a counter past the ticket lets every later gate through
    gate.close()
    assert gate.ticket == 3 and gate.host[0] == 5
