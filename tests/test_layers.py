"""Imports run one way: every module of the package sits in a layer and imports only from layers below its
own (or from its own layer without a circle), function-level, relative and `importlib` imports included; and the
tower the imports build stays no taller than `MAX_FLOORS`."""

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "simharness"

# Low to high: data flows scenario -> workload -> policy -> engine -> levels -> outputs -> drivers -> interface.
LAYERS = [
    # the scenario (its levels, its overrides), model catalogue, leaf utilities (the host gauge, the host profiles,
    # the GC watch, the NVTX phases among them)
    ["errors", "jit", "models", "checkpoint_files", "costfile", "hostprofile", "profile", "levels", "overrides",
     "scenario", "tokenizer", "kernels", "hostspeed", "gcwatch", "ledger", "phases"],
    ["corpus", "workload"],  # requests
    # the decode loop's kernels (Triton versions apart: imported only where they run), the hil gate
    ["kernels.ngram", "kernels.ngram_row", "kernels.ngram_triton", "kernels.rejection", "kernels.rejection_triton",
     "kernels.gate", "kernels.clock"],
    ["acceptance", "costmodel"],  # the sim level's models of the device
    ["policy", "modes"],  # the scheduling policy
    ["records", "instrument", "backend"],  # what a step records, the Backend contract
    ["engine", "engine.buckets", "engine.model", "engine.model_triton", "engine.checkpoint", "engine.timing",
     "engine.decode", "engine.step_graph", "engine.mirror", "engine.slots", "engine.host_work", "engine.decode_step",
     "engine.eager_step", "engine.torch_backend", "model_backend"],
    ["core", "loop"],  # the host's decisions and the phase sequence, shared by every level
    # set-up of the measured levels (run on the clock their caller hands them), benchmarks (vLLM's own host costs
    # and scheduler)
    ["measured", "bench", "vllmhost", "vllmpolicy"],
    ["simulation", "realloop"],  # the levels: where time comes from
    # outputs, and the fits of the sim level's costs read from them
    ["stats", "metrics", "pointfiles", "trace", "results", "report", "fidelity_report", "compare", "gate_report",
     "frontier", "calibration", "profile_fit"],
    # what a point computes; where points run: this process, local workers, a Ray cluster
    ["pointwork", "execution", "localpool", "raycluster", "executors"],
    ["runner", "fidelity", "profile_grid", "seeds"],  # drivers
    ["cli", "__main__", "__init__"],  # interfaces
]
# The longest chain of imports, in modules (`__main__ -> cli -> ... -> errors`): 19 before issue 32, 18 after its
# first part, 16 since a local pool's GPU worker imports torch ahead instead of the measured engine and a step's
# launch lives in the torch backend, 14 since the NVTX phases stand apart from the sync recorder (which reads the
# records' schema) and the engine core no longer calls the backend, 13 since a point picks its level's clock and
# hands it to the measured engine, which no longer imports the clocks (docs/design.md, "Code map", names the column).
MAX_FLOORS = 13


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    return name.removesuffix(".__init__") if name != "__init__" else name


def imports(path: Path, root: Path = PACKAGE) -> set[str]:
    """The package's modules that `path` imports, anywhere in it: `from simharness.x import y` names x.y when
    that is a module, a relative import is resolved against `path`'s package, and
    `importlib.import_module("simharness.x")` names x. An `importlib` import of a computed name fails."""
    package = path.relative_to(root).parent.parts
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # `from . import x`, `from ..x import y`
                base = package[: len(package) - (node.level - 1)] if node.level - 1 <= len(package) else None
                assert base is not None, f"{path.name}: relative import above the package"
                module = ".".join(["simharness", *base, *filter(None, [node.module])])
            if module.startswith("simharness"):
                names = [module, *(f"{module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Call) and _dynamic_import(node.func):
            arg = node.args[0] if node.args else None
            assert isinstance(arg, ast.Constant) and isinstance(arg.value, str), \
                f"{path.name}:{node.lineno}: a dynamic import of a computed name, which this test cannot place"
            names = [arg.value]
        for name in names:
            if name.startswith("simharness."):
                found.add(name.removeprefix("simharness."))
    return found


def _dynamic_import(func: ast.expr) -> bool:
    """`importlib.import_module(...)`, `import_module(...)` or `__import__(...)`."""
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in ("import_module", "__import__")


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in imports(path) if m in modules and m != name} for name, path in modules.items()}


def test_every_module_has_a_layer():
    placed = [m for layer in LAYERS for m in layer]
    assert len(placed) == len(set(placed))
    assert set(graph()) == set(placed), "place new modules in LAYERS (and remove gone ones)"


def test_imports_point_down_and_have_no_circles():
    layer = {m: i for i, names in enumerate(LAYERS) for m in names}
    deps = graph()
    upward = [f"{m} -> {d}" for m, ds in deps.items() for d in ds if layer[d] > layer[m]]
    assert upward == []
    # within a layer: no circle (a depth-first search finds no back edge)
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in deps[m]:
            assert state.get(d) != 1, f"import circle: {' -> '.join([*path, m, d])}"
            if d not in state:
                visit(d, [*path, m])
        state[m] = 2

    for m in deps:
        if m not in state:
            visit(m, [])


def tower(deps: dict[str, set[str]]) -> list[str]:
    """The longest chain of imports, top down."""

    @functools.cache
    def chain(m: str) -> tuple[str, ...]:
        return (m, *max((chain(d) for d in deps[m]), key=len, default=()))

    return list(max((chain(m) for m in deps), key=len))


def test_the_tower_stays_low():
    chain = tower(graph())
    assert len(chain) <= MAX_FLOORS, " -> ".join(chain)


@pytest.mark.parametrize("source,found", [
    ("from . import scenario", {"scenario"}),
    ("from .scenario import Scenario", {"scenario", "scenario.Scenario"}),
    ("import importlib\nimportlib.import_module('simharness.runner')", {"runner"}),
    ("def f():\n    from simharness import cli", {"cli"}),
])
def test_relative_and_importlib_imports_are_seen(tmp_path, source, found):
    (tmp_path / "x.py").write_text(source)
    assert imports(tmp_path / "x.py", tmp_path) == found


def test_a_computed_dynamic_import_fails(tmp_path):
    (tmp_path / "x.py").write_text("import importlib\nname = 'simharness.runner'\nimportlib.import_module(name)")
    with pytest.raises(AssertionError, match="computed name"):
        imports(tmp_path / "x.py", tmp_path)
