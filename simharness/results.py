"""The run directory: `results/<scenario>/<run-id>/`, written so nothing is ever lost.

Finished sweep points are written in batches (`PointWriter`): their tables together, then each point's summary
row, which marks it finished, each file through a temporary name and an atomic rename; so a killed sweep keeps
every point of a written batch and `--resume` runs the others (`pointfiles` says where they live). A point that
failed for good leaves `points/<index>.failed.json` (its reason and traceback) instead, which `--resume`
retries. The run's combined tables (`summary.csv`, `summary.json`, `*.parquet`) are rebuilt from the points, a
batch at a time, so they may be larger than memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from simharness.jit import loaded_digest
from simharness.pointfiles import TABLES as TABLES
from simharness.pointfiles import batch_dirs, combine_tables, finished_points, finished_rows, point_dir, text_columns
from simharness.pointfiles import point_table as point_table
from simharness.scenario import Scenario, ScenarioError, load_scenario


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


def check_writable(path: Path, option: str) -> None:
    """Bad input (ScenarioError naming `option`) unless `path` can be written as a file: not a directory, not under
    a file, on a writable file system. Checked before the work, so a long fit or run never ends in a failed write.
    Leaves nothing behind (a probe file in the nearest existing directory is removed)."""
    if path.is_dir():
        raise ScenarioError(f"{option} {path}: cannot write (Is a directory)")
    existing = next(p for p in path.absolute().parents if p.exists())
    if not existing.is_dir():
        raise ScenarioError(f"{option} {path}: cannot write (Not a directory: {existing})")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".probe-")
        os.close(fd)
        os.unlink(probe)
        if path.exists() and not os.access(path, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        raise ScenarioError(f"{option} {path}: cannot write ({e.strerror or e})") from None


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


FLUSH_S = 2.0  # a batch of finished points is written at least this often: a kill loses at most this much work
FLUSH_ROWS = 2_000_000  # ... or once the points waiting hold this many table rows (the driver's memory)


class PointWriter:
    """The driver's writer of finished points. Their tables wait in memory and are written together, one parquet
    file per table, as a batch (`points/batch-<n>/`, atomically), every FLUSH_S seconds, when FLUSH_ROWS rows
    wait, and when the run stops for any reason (`flush`); then each point's summary row (`write_point`), which
    marks it finished. A kill loses the points not yet in a batch, and `--resume` runs exactly those."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.pending: list[tuple[int, str, dict, dict[str, Columns]]] = []
        self.rows = 0
        self.flushed = time.monotonic()
        self.batches = len(batch_dirs(run_dir))

    def add(self, index: int, point_id: str, summary: dict, tables: dict[str, Columns]) -> None:
        """A finished point: its summary row and its tables, each as arrays by column."""
        self.pending.append((index, point_id, summary, tables))
        self.rows += sum(_rows(columns) for columns in tables.values())
        if time.monotonic() - self.flushed >= FLUSH_S or self.rows >= FLUSH_ROWS:
            self.flush()

    def flush(self) -> None:
        """Write the waiting points: their tables as one batch, then each point's summary row."""
        pending = sorted(self.pending, key=lambda p: p[0])
        self.pending, self.rows, self.flushed = [], 0, time.monotonic()
        if not pending:
            return
        final = self.run_dir / "points" / f"batch-{self.batches:05d}"
        self.batches += 1
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name in dict.fromkeys(name for *_, tables in pending for name in tables):
            parts = [(pid, tables[name]) for _, pid, _, tables in pending if name in tables]
            _write_parquet(tmp / f"{name}.parquet", _with_point(parts))
        (tmp / "points.json").write_text(json.dumps([[index, pid] for index, pid, _, _ in pending]))
        os.replace(tmp, final)
        for index, _, summary, _ in pending:
            write_point(self.run_dir, index, summary)


Columns = dict[str, np.ndarray]  # a table as arrays by column, each column's type as a frame of it infers


def _rows(columns: Columns) -> int:
    return len(next(iter(columns.values()), ()))


def _with_point(parts: list[tuple[str, Columns]]) -> pa.Table:
    """Points' tables as one, each row's point id in a `point` column first (built in C++: a Python list of
    ids took most of a large table's time)."""
    table = pa.Table.from_pandas(concat_columns([c for _, c in parts]), preserve_index=False, nthreads=1)
    ids = pa.array([pid for pid, _ in parts], pa.string())
    which = np.repeat(np.arange(len(parts), dtype=np.int32), [_rows(c) for _, c in parts])
    return table.add_column(0, "point", pa.DictionaryArray.from_arrays(pa.array(which), ids).cast(pa.string()))


def concat_columns(parts: list[Columns]) -> pd.DataFrame:
    """The frame `pd.concat` makes of the parts' frames (`ignore_index`): the union of their columns in order of
    appearance, a numeric column that some parts lack (or hold as integers, others as floats) as float64, NaN where
    absent. Built column by column from the arrays: a frame per part and pandas' concatenation of them cost a sweep
    of tiny points 2 ms a point. Columns of other types (objects, text some parts lack) go through pandas."""
    lengths = [_rows(c) for c in parts]
    columns = {}
    for name in dict.fromkeys(name for c in parts for name in c):
        arrays = [c.get(name) for c in parts]
        present = [a for a in arrays if a is not None]
        dtypes = {a.dtype for a in present}
        if len(present) == len(parts) and (all(a.dtype.kind == "U" for a in present)
                                           or (len(dtypes) == 1 and present[0].dtype.kind in "iufb")):
            columns[name] = np.concatenate(arrays)
        elif dtypes <= {np.dtype(np.int64), np.dtype(np.float64)}:
            columns[name] = np.concatenate([np.full(n, np.nan) if a is None else a.astype(np.float64)
                                            for a, n in zip(arrays, lengths, strict=True)])
        else:
            return pd.concat([pd.DataFrame(c) for c in parts], ignore_index=True)
    return pd.DataFrame(columns)


def _write_parquet(path: Path, table: pa.Table) -> None:
    pq.write_table(table, path, use_dictionary=text_columns(table.schema))


def write_point(run_dir: Path, index: int, summary: dict) -> None:
    """Write one point's summary row atomically, which marks it finished (its tables are in a batch written
    before); a failed record of an earlier try goes."""
    final = point_dir(run_dir, index)
    final.mkdir(exist_ok=True)
    tmp = final / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1, default=_json_default))
    os.replace(tmp, final / "summary.json")
    failed_path(run_dir, index).unlink(missing_ok=True)


def failed_path(run_dir: Path, index: int) -> Path:
    return run_dir / "points" / f"{index:04d}.failed.json"


def write_failed(run_dir: Path, index: int, record: dict, detail: str = "") -> None:
    """Record a point that failed for good: its summary row (with the `failed` reason) and the traceback."""
    path = failed_path(run_dir, index)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"summary": record, "traceback": detail}, indent=1, default=_json_default))
    os.replace(tmp, path)


def failed_points(run_dir: Path) -> dict[int, dict]:
    """Summary rows of the points that failed and have not finished since, by index."""
    done = finished_points(run_dir)
    found = {}
    for path in (run_dir / "points").glob("[0-9]*.failed.json"):
        index = int(path.name.split(".")[0])
        if index not in done:
            found[index] = json.loads(path.read_text())["summary"]
    return found


def read_table(run_dir: Path, name: str, columns: list[str] | None = None) -> pd.DataFrame:
    """A combined table of the run (`point` column first), or an empty frame when the run has none."""
    path = run_dir / f"{name}.parquet"
    return pd.read_parquet(path, columns=columns) if path.is_file() else pd.DataFrame()


def combine(run_dir: Path) -> pd.DataFrame:
    """Rebuild the run's summary and its run-level tables from the points; returns the summary."""
    summary = combine_summary(run_dir)
    combine_tables(run_dir, summary)
    return summary


def combine_summary(run_dir: Path) -> pd.DataFrame:
    """Rebuild summary.csv/json (a row per point by index; a `failed` column, only when a point failed, gives
    the reason) from the points; returns it. A run kept as its tables only (no `points/`, as `results/` keeps
    measured runs) is refused before anything is rewritten: rebuilding from nothing would empty its summary."""
    if not (run_dir / "points").is_dir():
        raise ScenarioError(f"{run_dir}: no points/ to rebuild the run's tables and report from (a run kept as its "
                            "tables only); nothing was changed")
    rows = finished_rows(run_dir)
    failed = failed_points(run_dir)
    columns = list(dict.fromkeys(k for row in [*rows.values(), *failed.values()] for k in row if k != "failed"))
    if failed:
        columns.append("failed")
    records = [{**rows, **failed}[i] for i in sorted({*rows, *failed})]
    summary = pd.DataFrame(records, columns=columns)
    summary.to_csv(run_dir / "summary.csv", index=False)
    (run_dir / "summary.json").write_text(json.dumps(records, indent=1, default=_json_default))
    return summary


def write_meta(run_dir: Path, scenario: Scenario, device: str | None, extra: dict | None = None) -> None:
    """Versions, device, git revision and seed: what a reader needs to reproduce the run. A measured run's device
    is None until its first point, run wherever, says which it was."""
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
