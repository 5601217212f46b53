"""The run directory: `results/<scenario>/<run-id>/`, written so nothing is ever lost.

Each finished sweep point is written to `points/<index>/` through a temporary directory and an
atomic rename, so a killed sweep keeps every finished point and `--resume` skips them. A point that
failed for good leaves `points/<index>.failed.json` (its reason and traceback) instead, which
`--resume` retries. The run's combined tables (`summary.csv`, `summary.json`, `*.parquet`) are
rebuilt from the points, one point's table at a time, so they may be larger than memory.
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
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import yaml

from simharness.jit import loaded_digest
from simharness.scenario import Scenario, ScenarioError, load_scenario

TABLES = ("requests", "steps", "syncs", "emissions", "device_syncs")
ROW_GROUP = 1 << 20  # rows a row group of a run-level table holds (points' rows are gathered up to it)


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


FLUSH_S = 2.0  # a batch of finished points is written at least this often: a kill loses at most this much work
FLUSH_ROWS = 2_000_000  # ... or once the points waiting hold this many table rows (the driver's memory)


class PointWriter:
    """The driver's writer of finished points. Their tables wait in memory and are written together, one parquet
    file per table, as a batch (`points/batch-<n>/`, atomically), every FLUSH_S seconds, when FLUSH_ROWS rows
    wait, and when the run stops for any reason (`flush`); then each point's summary row (`write_point`), which
    marks it finished. A kill loses the points not yet in a batch, and `--resume` runs exactly those."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.pending: list[tuple[int, str, dict, dict[str, pd.DataFrame]]] = []
        self.rows = 0
        self.flushed = time.monotonic()
        self.batches = len(_batch_dirs(run_dir))

    def add(self, index: int, point_id: str, summary: dict, tables: dict[str, pd.DataFrame]) -> None:
        self.pending.append((index, point_id, summary, tables))
        self.rows += sum(len(df) for df in tables.values())
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
            frames = [(pid, tables[name]) for _, pid, _, tables in pending if name in tables]
            _write_parquet(tmp / f"{name}.parquet", _with_point(frames))
        (tmp / "points.json").write_text(json.dumps([[index, pid] for index, pid, _, _ in pending]))
        os.replace(tmp, final)
        for index, _, summary, _ in pending:
            write_point(self.run_dir, index, summary)


def _with_point(frames: list[tuple[str, pd.DataFrame]]) -> pa.Table:
    """Points' frames as one table, each row's point id in a `point` column first (built in C++: a Python list of
    ids took most of a large table's time)."""
    df = pd.concat([f for _, f in frames], ignore_index=True) if len(frames) > 1 else frames[0][1]
    table = pa.Table.from_pandas(df, preserve_index=False, nthreads=1)
    ids = pa.array([pid for pid, _ in frames], pa.string())
    which = np.repeat(np.arange(len(frames), dtype=np.int32), [len(f) for _, f in frames])
    return table.add_column(0, "point", pa.DictionaryArray.from_arrays(pa.array(which), ids).cast(pa.string()))


def _write_parquet(path: Path, table: pa.Table) -> None:
    pq.write_table(table, path, use_dictionary=_text_columns(table.schema))


def _text_columns(schema: pa.Schema) -> list[str]:
    """The columns worth dictionary-encoding: text (a point's id, a sync's name). pyarrow's default tries a
    dictionary on every column; on the float and counter columns of a large table it made writing 2.5x and
    reading 4x slower, and the file larger."""
    return [f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]


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


def finished_rows(run_dir: Path) -> dict[int, dict]:
    """The summary rows of the finished points, by index."""
    return {i: json.loads((point_dir(run_dir, i) / "summary.json").read_text())
            for i in sorted(finished_points(run_dir))}


def point_table(run_dir: Path, index: int, name: str) -> Path | None:
    """A point's own file of table `name` (a run written before batches), or None where it has none."""
    path = point_dir(run_dir, index) / f"{name}.parquet"
    return path if path.is_file() else None


@dataclass
class _Part:
    """A file holding rows of table `name` for finished points (`indices`, in the file's order): a batch, whose
    `point` column names each row's point, or a point's own file (no `point` column: `own` is its point).
    `keep`: the points its rows are read for, when not all of them (a point run again after a kill between its
    batch and its summary, a point not finished)."""

    path: Path
    indices: list[int]
    own: str | None = None
    keep: list[str] | None = None


def _batch_dirs(run_dir: Path) -> list[Path]:
    return sorted(p for p in (run_dir / "points").glob("batch-[0-9]*") if p.name[6:].isdigit())


def _parts(run_dir: Path, name: str, point_of: dict[int, str]) -> list[_Part]:
    """The files of table `name` that hold the finished points (`point_of`: their ids by index): each point's
    rows from its own file if it has one, else from the last batch listing it."""
    own = {i: path for i in sorted(point_of) if (path := point_table(run_dir, i, name))}
    parts = [_Part(path, [i], own=point_of[i]) for i, path in own.items()]
    manifests = [json.loads((batch / "points.json").read_text()) for batch in _batch_dirs(run_dir)]
    last = {index: n for n, manifest in enumerate(manifests) for index, _ in manifest}
    for n, batch in enumerate(_batch_dirs(run_dir)):
        kept = [(i, pid) for i, pid in manifests[n] if i in point_of and i not in own and last[i] == n]
        if kept and (batch / f"{name}.parquet").is_file():
            keep = None if len(kept) == len(manifests[n]) else [pid for _, pid in kept]
            parts.append(_Part(batch / f"{name}.parquet", [i for i, _ in kept], keep=keep))
    return parts


def _read_part(part: _Part, columns: list[str] | None, points: set[str] | None) -> pa.Table:
    """A part's rows (`point` column first), of `points` only when given."""
    file = pq.ParquetFile(part.path)
    names = file.schema_arrow.names
    if part.own is not None:
        table = file.read(columns=[c for c in columns if c in names] if columns else None)
        return table.add_column(0, "point", pa.array(np.full(table.num_rows, part.own, dtype=object), pa.string()))
    table = file.read(columns=[c for c in dict.fromkeys(["point", *columns]) if c in names] if columns else None)
    if "point" not in table.column_names:
        return table  # a run-level table no point had rows for: no columns
    wanted = set(part.keep) if part.keep is not None else None
    if points is not None:
        wanted = points if wanted is None else wanted & points
    if wanted is not None:
        table = table.filter(pc.is_in(table["point"], value_set=pa.array(sorted(wanted), pa.string())))
    return table


def point_tables(run_dir: Path, name: str, columns: list[str] | None = None,
                 points: set[str] | None = None) -> Iterator[pa.Table]:
    """Table `name` of the run's finished points (of `points` only, when given), a file at a time, `point` first:
    from the points' batches or own files, else (a committed run may keep only those) the run-level table."""
    point_of = {i: row["point"] for i, row in finished_rows(run_dir).items()}
    parts = _parts(run_dir, name, point_of)
    if not parts and (run_dir / f"{name}.parquet").is_file():
        parts = [_Part(run_dir / f"{name}.parquet", [])]
    for part in parts:
        table = _read_part(part, columns, points)
        if table.num_rows or part is parts[0]:
            yield table


def read_points(run_dir: Path, name: str, columns: list[str] | None = None,
                points: set[str] | None = None) -> pd.DataFrame:
    """`point_tables` as one frame (the union of the files' columns); a frame without columns when no point has
    the table (a run from before it existed)."""
    tables = list(point_tables(run_dir, name, columns, points))
    if not tables:
        return pd.DataFrame()
    return pa.concat_tables(tables, promote_options="permissive").to_pandas()


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


def combine_tables(run_dir: Path, summary: pd.DataFrame) -> None:
    """Rebuild the run-level parquet tables (`TABLES`) from the finished points' batches and own files; `summary`
    (from `combine_summary`) names each point. A table no point file holds is left as it is (a committed run
    may keep only the run-level tables)."""
    point_of = dict(zip(summary["index"], summary["point"], strict=True)) if len(summary) else {}
    point_of = {i: point_of[i] for i in finished_points(run_dir)}
    # One thread per table: reading, encoding and compressing parquet run outside the GIL.
    with ThreadPoolExecutor(len(TABLES)) as pool:
        for done in [pool.submit(_combine_table, run_dir, name, point_of) for name in TABLES]:
            done.result()


def _combine_table(run_dir: Path, name: str, point_of: dict[int, str]) -> None:
    """Write table `name` of the finished points to `<name>.parquet` (`point` first), in point order whatever
    order they finished in. A file is read when its first point's turn comes and dropped after its last (a few
    at a time: workers finish points about in order). Columns are the union over files in order of appearance (a
    file lacking one gets nulls); points with no rows are left out unless none has any."""
    parts = _parts(run_dir, name, point_of)
    final = run_dir / f"{name}.parquet"
    tmp = final.with_name(final.name + ".tmp")
    if not parts:
        if final.is_file():
            return  # the run-level table is the only copy
        pd.DataFrame().to_parquet(tmp, index=False)
        os.replace(tmp, final)
        return
    schemas = [pq.read_schema(part.path).remove_metadata() for part in parts]
    schemas = [s if part.own is None else pa.schema([pa.field("point", pa.string()), *s])
               for part, s in zip(parts, schemas, strict=True)]
    schema = pa.unify_schemas(schemas, promote_options="permissive")
    part_of = {i: part for part in parts for i in part.indices}
    left = {id(part): len(part.indices) for part in parts}
    loaded: dict[int, tuple[pa.Table, dict[str, tuple[int, int]]]] = {}
    pending: list[pa.Table] = []
    with pq.ParquetWriter(tmp, schema, use_dictionary=_text_columns(schema)) as writer:
        for index in sorted(part_of):
            part = part_of[index]
            if id(part) not in loaded:
                table = _conform(_read_part(part, None, None), schema)
                loaded[id(part)] = table, _spans(table)
            table, spans = loaded[id(part)]
            start, length = spans.get(point_of[index], (0, 0))
            if length:
                pending.append(table.slice(start, length))
            left[id(part)] -= 1
            if not left[id(part)]:
                del loaded[id(part)]
            if sum(t.num_rows for t in pending) >= ROW_GROUP:
                writer.write_table(pa.concat_tables(pending))
                pending = []
        if pending:
            writer.write_table(pa.concat_tables(pending))
    os.replace(tmp, final)


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """`table` in `schema`: its columns in that order, a missing one all nulls."""
    columns = [table.column(f.name) if f.name in table.column_names else pa.nulls(table.num_rows, f.type)
               for f in schema]
    return pa.Table.from_arrays(columns, names=schema.names).cast(schema)


def _spans(table: pa.Table) -> dict[str, tuple[int, int]]:
    """Each point's rows in a file (consecutive): (first row, count) by point id."""
    ids = table.column("point").to_numpy(zero_copy_only=False)
    if not len(ids):
        return {}
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    ends = np.r_[starts[1:], len(ids)]
    return {ids[a]: (int(a), int(b - a)) for a, b in zip(starts, ends, strict=True)}


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
