"""The run directory: `results/<scenario>/<run-id>/`, written so nothing is ever lost.

Each finished sweep point is written to `points/<index>/` through a temporary directory and an
atomic rename, so a killed sweep keeps every finished point and `--resume` skips them. The run's
combined tables (`summary.csv`, `summary.json`, `*.parquet`) are rebuilt from the points.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

import pandas as pd
import yaml

from simharness.jit import loaded_digest
from simharness.scenario import Scenario, ScenarioError, load_scenario

TABLES = ("requests", "steps", "syncs", "emissions", "device_syncs")


def new_run_dir(out: Path, scenario: Scenario) -> Path:
    """Create a fresh run directory; an existing one is never reused."""
    base = out / scenario.name
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        base.mkdir(parents=True, exist_ok=True)
        for n in range(1000):
            run_dir = base / (stamp if n == 0 else f"{stamp}-{n}")
            try:
                run_dir.mkdir(exist_ok=False)
                break
            except FileExistsError:
                continue
        else:
            raise ScenarioError(f"--out {out}: 1000 run directories of this second exist under {base}")
    except OSError as e:
        raise ScenarioError(f"--out {out}: cannot create a run directory there ({e.strerror or e})") from None
    with writing(run_dir, fresh=True):
        (run_dir / "points").mkdir()
        (run_dir / "scenario.yaml").write_text(yaml.safe_dump(scenario.model_dump(mode="json"), sort_keys=False))
    return run_dir


@contextmanager
def writing(run_dir: Path, *, fresh: bool) -> Iterator[None]:
    """Writes into a run directory: a full or read-only file system is bad input (ScenarioError naming the
    directory), and a `fresh` run directory in which no point finished is removed on any error."""
    try:
        yield
    except Exception as e:
        if fresh and not finished_points(run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                run_dir.parent.rmdir()  # the scenario's directory, if this was its only run
        if isinstance(e, OSError):
            raise ScenarioError(f"{run_dir}: cannot write the run ({e.strerror or e})") from None
        raise


def load_run_scenario(run_dir: Path) -> Scenario:
    path = run_dir / "scenario.yaml"
    if not path.is_file():
        raise ScenarioError(f"{run_dir}: not a run directory (no scenario.yaml)")
    return load_scenario(path)


def point_dir(run_dir: Path, index: int) -> Path:
    return run_dir / "points" / f"{index:04d}"


def finished_points(run_dir: Path) -> set[int]:
    """Indices of the points whose results are complete on disk."""
    found = set()
    for p in (run_dir / "points").glob("[0-9]*"):  # not a `.tmp` directory that a kill during a write left
        if p.name.isdigit() and (p / "summary.json").is_file():
            found.add(int(p.name))
    return found


def write_point(run_dir: Path, index: int, summary: dict, tables: dict[str, pd.DataFrame]) -> None:
    """Write one point's results atomically (temp dir, then rename)."""
    final = point_dir(run_dir, index)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, df in tables.items():
        df.to_parquet(tmp / f"{name}.parquet", index=False)
    (tmp / "summary.json").write_text(json.dumps(summary, indent=1, default=_json_default))
    os.replace(tmp, final)


def read_point_table(run_dir: Path, index: int, name: str) -> pd.DataFrame:
    return pd.read_parquet(point_dir(run_dir, index) / f"{name}.parquet")


def combine(run_dir: Path) -> tuple[pd.DataFrame, dict[str, pd.DataFrame]]:
    """Rebuild summary.csv/json and the run-level parquet tables from the finished points."""
    indices = sorted(finished_points(run_dir))
    rows = [json.loads((point_dir(run_dir, i) / "summary.json").read_text()) for i in indices]
    summary = pd.DataFrame(rows)
    summary.to_csv(run_dir / "summary.csv", index=False)
    (run_dir / "summary.json").write_text(json.dumps(rows, indent=1, default=_json_default))
    tables = {}
    for name in TABLES:
        parts = []
        for i, row in zip(indices, rows, strict=True):
            if not (point_dir(run_dir, i) / f"{name}.parquet").is_file():
                continue  # a point written before the table existed (device_syncs)
            df = read_point_table(run_dir, i, name)
            df.insert(0, "point", row["point"])
            parts.append(df)
        filled = [df for df in parts if len(df)] or parts[:1]
        tables[name] = pd.concat(filled, ignore_index=True) if filled else pd.DataFrame()
        tables[name].to_parquet(run_dir / f"{name}.parquet", index=False)
    return summary, tables


def write_meta(run_dir: Path, scenario: Scenario, device: str, extra: dict | None = None) -> None:
    """Versions, device, git revision and seed: what a reader needs to reproduce the run."""
    meta = {
        "scenario": scenario.name,
        "seed": scenario.seed,
        "run_id": run_dir.name,
        "device": device,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(sys.argv),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_revision": _git_revision(),
        # the code that ran, whatever git says: a copied tree (a GPU machine's) may carry a stale .git
        "git_modified": _git_modified(),
        "source_digest": loaded_digest(),
        "versions": {p: _version(p) for p in ("simharness", "simpy", "numpy", "pandas", "torch", "triton")},
    }
    meta.update(extra or {})
    (run_dir / "meta.json").write_text(json.dumps(meta, indent=1))


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def _git_revision() -> str | None:
    return (_git("rev-parse", "HEAD") or "").strip() or None


def _git_modified() -> bool | None:
    """Whether the package's tracked files differ from the git revision (None without git)."""
    out = _git("status", "--porcelain", "--untracked-files=no", "--", ".")
    return None if out is None else bool(out.strip())


def _json_default(value):
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
