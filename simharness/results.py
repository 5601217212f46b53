"""The run directory: `results/<scenario>/<run-id>/`, written so nothing is ever lost.

Each finished sweep point is written to `points/<index>/` through a temporary directory and an
atomic rename, so a killed sweep keeps every finished point and `--resume` skips them. A point that
failed for good leaves `points/<index>.failed.json` (its reason and traceback) instead, which
`--resume` retries. The run's combined tables (`summary.csv`, `summary.json`, `*.parquet`) are
rebuilt from the points, one point's table at a time, so they may be larger than memory.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
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


def point_dir(run_dir: Path, index: int) -> Path:
    return run_dir / "points" / f"{index:04d}"


def finished_points(run_dir: Path) -> set[int]:
    """Indices of the points whose results are complete on disk."""
    found = set()
    for p in (run_dir / "points").glob("[0-9]*"):  # not a `.tmp` directory that a kill during a write left
        if p.name.isdigit() and (p / "summary.json").is_file():
            found.add(int(p.name))
    return found


def encode_tables(tables: dict[str, pd.DataFrame]) -> dict[str, bytes]:
    """Each table as the bytes of its parquet file: a worker encodes its point's tables, so the driver only writes
    them (and pickles bytes, not frames, between processes)."""
    encoded = {}
    for name, df in tables.items():
        buffer = io.BytesIO()
        table = pa.Table.from_pandas(df, preserve_index=False, nthreads=1)  # small tables: no thread pool a call
        pq.write_table(table, buffer, use_dictionary=_text_columns(table.schema))
        encoded[name] = buffer.getvalue()
    return encoded


def _text_columns(schema: pa.Schema) -> list[str]:
    """The columns worth dictionary-encoding: text (a point's id, a sync's name). pyarrow's default tries a
    dictionary on every column; on the float and counter columns of a large table it made writing 2.5x and
    reading 4x slower, and the file larger."""
    return [f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]


def write_point(run_dir: Path, index: int, summary: dict, tables: dict[str, bytes]) -> None:
    """Write one point's results atomically (temp dir, then rename); a failed record of an earlier try goes.
    `tables`: each table's parquet bytes (`encode_tables`)."""
    final = point_dir(run_dir, index)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, data in tables.items():
        (tmp / f"{name}.parquet").write_bytes(data)
    (tmp / "summary.json").write_text(json.dumps(summary, indent=1, default=_json_default))
    os.replace(tmp, final)
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


def point_table(run_dir: Path, index: int, name: str) -> Path | None:
    """A point's own file of table `name`, or None where it has none (a point that failed, or one run before the
    table existed)."""
    path = point_dir(run_dir, index) / f"{name}.parquet"
    return path if path.is_file() else None


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
    the reason) from the points; returns it."""
    indices = sorted(finished_points(run_dir))
    rows = {i: json.loads((point_dir(run_dir, i) / "summary.json").read_text()) for i in indices}
    failed = failed_points(run_dir)
    columns = list(dict.fromkeys(k for row in [*rows.values(), *failed.values()] for k in row if k != "failed"))
    if failed:
        columns.append("failed")
    records = [{**rows, **failed}[i] for i in sorted({*rows, *failed})]
    summary = pd.DataFrame(records, columns=columns)
    summary.to_csv(run_dir / "summary.csv", index=False)
    (run_dir / "summary.json").write_text(json.dumps(records, indent=1, default=_json_default))
    return summary


def combine_tables(run_dir: Path, summary: pd.DataFrame) -> None:
    """Rebuild the run-level parquet tables (`TABLES`) from the finished points' tables; `summary` (from
    `combine_summary`) names each point."""
    point_of = dict(zip(summary["index"], summary["point"], strict=True)) if len(summary) else {}
    points = [(i, point_of[i]) for i in sorted(finished_points(run_dir))]
    # One thread per table: reading, encoding and compressing parquet run outside the GIL.
    with ThreadPoolExecutor(len(TABLES)) as pool:
        for done in [pool.submit(_combine_table, run_dir, name, points) for name in TABLES]:
            done.result()


def _combine_table(run_dir: Path, name: str, points: list[tuple[int, str]]) -> None:
    """Append every point's table to `<name>.parquet` (`point` first), one point in memory at a time. Columns
    are the union over points in order of appearance (a point lacking one gets nulls); points with no rows are
    left out unless no point has any (a point written before the table existed has no file)."""
    parts = [(path, pid) for i, pid in points if (path := point_table(run_dir, i, name)) is not None]
    filled = [(path, pid) for path, pid in parts if pq.read_metadata(path).num_rows] or parts[:1]
    final = run_dir / f"{name}.parquet"
    tmp = final.with_name(final.name + ".tmp")
    if not filled:
        pd.DataFrame().to_parquet(tmp, index=False)
        os.replace(tmp, final)
        return
    schema = pa.unify_schemas([pq.read_schema(path).remove_metadata() for path, _ in filled],
                              promote_options="permissive")
    schema = pa.schema([pa.field("point", pa.string()), *schema])
    with pq.ParquetWriter(tmp, schema, use_dictionary=_text_columns(schema)) as writer:
        for path, pid in filled:
            table = pq.read_table(path)
            # the point's id on every row, built in C++ (a Python list of it took most of a large table's time)
            ids = pa.DictionaryArray.from_arrays(pa.array(np.zeros(table.num_rows, np.int32)), pa.array([pid]))
            table = table.add_column(0, "point", ids.cast(pa.string()))
            columns = [table.column(f.name) if f.name in table.column_names else pa.nulls(table.num_rows, f.type)
                       for f in schema]
            writer.write_table(pa.Table.from_arrays(columns, names=schema.names).cast(schema))
    os.replace(tmp, final)


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
