"""The compiled functions' disk cache follows the sources: an edit anywhere in the package reaches every function
that inlines the edited code (numba alone keys a function's cache on its own file)."""

import shutil
import subprocess
import sys
from pathlib import Path

from simharness.jit import PACKAGE, STAMP, drop_stale, sources_digest

RUN_POINT = """
from simharness.model_backend import model_backend
from simharness.modes import resolve_mode
from simharness.scenario import scenario_from_dict
from simharness.simulation import Simulation
from simharness.workload import build_requests
sc = scenario_from_dict({"name": "jit", "workload": {"num_requests": 8, "concurrency": 4},
                         "engine": {"profile": "none"}})  # the roofline, which the test edits
requests = build_requests(sc.workload, sc.seed)
mode = resolve_mode(sc)
print(Simulation(sc, requests, mode, model_backend(sc, requests, mode)).run()[1])
"""


def test_drop_stale_keeps_a_matching_cache_and_empties_another(tmp_path: Path) -> None:
    (tmp_path / "f-1.py311.nbi").write_text("index")
    (tmp_path / "f-1.py311.0.nbc").write_text("code")
    (tmp_path / "f.cpython-311.pyc").write_text("bytecode")
    drop_stale(tmp_path, "new")  # no stamp: compiled from unknown sources
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([STAMP, "f.cpython-311.pyc"])
    assert (tmp_path / STAMP).read_text() == "new"
    (tmp_path / "f-1.py311.nbi").write_text("index")
    drop_stale(tmp_path, "new")
    assert (tmp_path / "f-1.py311.nbi").exists()
    drop_stale(tmp_path, "newer")
    assert not (tmp_path / "f-1.py311.nbi").exists()


def test_digest_covers_every_source_file() -> None:
    assert len(sources_digest()) == 64
    assert (PACKAGE / "engine" / "decode.py").is_file()  # subpackages are under PACKAGE too (rglob)


def test_an_edit_to_an_inlined_function_reaches_the_cached_callers(tmp_path: Path) -> None:
    """The model backend's compiled step inlines the roofline of costmodel.py: doubling the roofline there must
    double the run's GPU time although model_backend.py, whose cache holds the step, did not change."""
    shutil.copytree(PACKAGE, tmp_path / "simharness", ignore=shutil.ignore_patterns("__pycache__"))

    def duration() -> float:
        out = subprocess.run([sys.executable, "-c", RUN_POINT], cwd=tmp_path, capture_output=True, text=True,
                             env={"PYTHONPATH": str(tmp_path), "PATH": ""}, check=True)  # fmt: skip
        return float(out.stdout.split()[-1])

    before = duration()
    assert duration() == before  # unchanged sources: the cached code, the same result
    costmodel = tmp_path / "simharness" / "costmodel.py"
    text = costmodel.read_text()
    line = "    return rates[FIXED_S] + forwards * rates[FORWARD_S] + linear + attention + sampler + proposer\n"
    assert text.count(line) == 1
    doubled = line.replace("return ", "return 2.0 * (").replace("\n", ")\n")
    costmodel.write_text(text.replace(line, doubled))
    assert duration() > 1.5 * before
