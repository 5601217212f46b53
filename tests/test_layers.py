"""Imports run one way: every module of the package sits in a layer and imports only from layers below its
own (or from its own layer without a circle), function-level imports included."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "simharness"

# Low to high: data flows scenario -> workload -> policy -> engine -> levels -> outputs -> drivers -> interface.
LAYERS = [
    # the scenario, model catalogue, leaf utilities (the host gauge, the host profiles, the GC watch among them)
    ["errors", "jit", "models", "checkpoint_files", "costfile", "hostprofile", "profile", "scenario", "tokenizer",
     "kernels", "hostspeed", "gcwatch"],
    ["corpus", "workload"],  # requests
    # the decode loop's kernels (Triton versions apart: imported only where they run), the hil gate
    ["kernels.ngram", "kernels.ngram_row", "kernels.ngram_triton", "kernels.rejection", "kernels.rejection_triton",
     "kernels.gate", "kernels.clock"],
    ["acceptance", "costmodel"],  # the sim level's models of the device
    ["policy", "modes"],  # the scheduling policy
    ["records", "instrument"],  # what a step records
    ["engine", "engine.model", "engine.model_triton", "engine.checkpoint", "engine.timing", "engine.decode",
     "engine.step_graph", "engine.backend", "engine.mirror", "engine.slots", "engine.host_work",
     "engine.torch_backend"],
    ["core"],  # the host's decisions, shared by every level
    ["simulation", "realloop"],  # the levels: where time comes from
    ["measured", "bench", "vllmhost"],  # set-up of the measured levels, benchmarks (vllmhost: vLLM's own host costs)
    ["stats", "metrics", "pointfiles", "trace", "results", "report", "fidelity_report", "compare", "gate_report",
     "frontier"],  # outputs
    # what a point computes; where points run: this process, local workers, a Ray cluster
    ["pointwork", "execution", "localpool", "raycluster", "executors"],
    ["runner", "fidelity", "calibration", "profile_fit", "profile_grid"],  # drivers
    ["seeds"],  # the seed changes, run through the driver
    ["cli", "__main__", "__init__"],  # interfaces
]


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    return name.removesuffix(".__init__") if name != "__init__" else name


def imports(path: Path) -> set[str]:
    """The package's modules that `path` imports, anywhere in it (`from simharness.x import y` names x.y
    when that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("simharness"):
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if name.startswith("simharness."):
                found.add(name.removeprefix("simharness."))
    return found


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
