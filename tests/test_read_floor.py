"""The device-floor benchmarks' own pieces (benchmarks/sampler_read_floor.py, verify_read_floor.py,
attention_rows.py): the bare read kernel sums what it reads, the matrices a forward reads add up to the weight-read
floor's bytes, and the attention benchmark's call runs the engine's verify attention on its inputs."""

from collections.abc import Iterator

import pytest
import torch
from helpers import interpreted_kernels, load_benchmark

from simharness.engine import model_triton
from simharness.models import model_config

read_floor = load_benchmark("sampler_read_floor")


@pytest.fixture
def _interpreted() -> Iterator[None]:
    yield from interpreted_kernels(read_floor, ("_read_kernel",))


@pytest.mark.usefixtures("_interpreted")
@pytest.mark.parametrize("n, block", [(1, 16), (100, 16), (128, 32), (1000, 64)])
def test_the_read_kernel_sums_each_block_it_reads(n: int, block: int):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    out = torch.full((-(-n // block),), float("nan"))
    read_floor.triton_read(x, out, block, 1)
    padded = torch.cat([x.float(), torch.zeros(len(out) * block - n)])
    torch.testing.assert_close(out, padded.view(-1, block).sum(dim=1))


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3-8b"])
def test_the_forwards_matrices_are_the_weight_floors_bytes_less_the_norms(name: str):
    verify_floor = load_benchmark("verify_read_floor")  # imports sampler_read_floor, registered above
    c = model_config(name)
    matrices = verify_floor.matrices(name)
    assert len(matrices) == 4 * c.n_layers + 1
    norms = (2 * c.n_layers + 1) * c.dim  # two RMSNorm weights a layer and the final one
    assert 2 * sum(rows * cols for rows, cols in matrices) == c.weight_bytes - 2 * norms


@pytest.fixture
def _interpreted_attention() -> Iterator[None]:
    yield from interpreted_kernels(model_triton, ("_rope_attention_kernel", "_rotated", "_attend_tile"))


@pytest.mark.usefixtures("_interpreted_attention")
def test_the_attention_benchmark_calls_the_verify_attention_on_its_shapes():
    attention_rows = load_benchmark("attention_rows")
    c = model_config("llama-3.2-1b")
    call, layers = attention_rows.attention_call("llama-3.2-1b", 2, 16, torch.device("cpu"))
    out = call()
    assert layers == c.n_layers
    assert out.shape == (2 * attention_rows.TOKENS, c.n_heads * c.head_dim) and bool(out.float().isfinite().all())
