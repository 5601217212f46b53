"""Both backends conform to the `Backend` Protocol the engine loop talks to: every member, each method with the
Protocol's parameters and return annotation; the measured one also to `MeasuredBackend` (the real level's ledger)."""

import inspect

from test_backend import backend as a_model_backend
from test_hil import hil_scenario, model, requests  # noqa: F401 (fixtures)

from simharness.backend import Backend, MeasuredBackend
from simharness.engine.torch_backend import TorchBackend
from simharness.modes import resolve_mode


def assert_conforms(backend: object, protocol: type) -> None:
    assert isinstance(backend, protocol)  # every member present
    own = [c for c in protocol.__mro__ if c in (Backend, MeasuredBackend)]
    methods = {n: f for c in own for n, f in vars(c).items() if inspect.isfunction(f) and not n.startswith("_")}
    assert methods and all(hasattr(backend, n) for c in own for n in c.__annotations__)
    for name, spec in methods.items():
        got, want = inspect.signature(getattr(type(backend), name)), inspect.signature(spec)
        assert list(got.parameters) == list(want.parameters), name
        assert got.return_annotation == want.return_annotation, name


def test_the_model_backend_conforms_to_the_protocol():
    backend = a_model_backend([4], [8])
    assert_conforms(backend, Backend)
    assert not isinstance(backend, MeasuredBackend)  # it keeps no host time: the real level cannot run it


def test_the_torch_backend_conforms_to_the_measured_protocol(requests, model):  # noqa: F811
    sc = hil_scenario()
    assert_conforms(TorchBackend(sc, requests, model, resolve_mode(sc), gate=True), MeasuredBackend)
