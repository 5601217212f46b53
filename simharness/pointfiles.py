"""Where a run's finished points live on disk, and reading them back whatever layout wrote them.

A finished point has `points/<index>/summary.json`, its summary row, which marks it finished. Its tables are in a
batch, `points/batch-<n>/` (one parquet file per table for the points finished together, a `point` column naming
each row's point, and `points.json` listing them), or, in runs written before batches, in its own directory. A
point listed by several batches (a kill between a batch and its points' summaries: the point ran again) is read
from the last. A committed run may keep only the run-level tables (`<name>.parquet`); readers fall back to them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

TABLES = ("requests", "steps", "syncs", "emissions", "device_syncs")
ROW_GROUP = 1 << 20  # rows a row group of a run-level table holds (points' rows are gathered up to it)


def point_dir(run_dir: Path, index: int) -> Path:
    return run_dir / "points" / f"{index:04d}"


def finished_points(run_dir: Path) -> set[int]:
    """Indices of the points whose results are complete on disk."""
    found = set()
    for p in (run_dir / "points").glob("[0-9]*"):  # not a `.tmp` directory that a kill during a write left
        if p.name.isdigit() and (p / "summary.json").is_file():
            found.add(int(p.name))
    return found


def finished_rows(run_dir: Path) -> dict[int, dict]:
    """The summary rows of the finished points, by index."""
    return {i: json.loads((point_dir(run_dir, i) / "summary.json").read_text())
            for i in sorted(finished_points(run_dir))}


def finished_ids(run_dir: Path) -> dict[int, str]:
    """The finished points' ids, by index: as the batches list them (a point's summary row is read only where no
    batch lists it, a run written before batches)."""
    done = finished_points(run_dir)
    ids = {index: pid for batch in batch_dirs(run_dir) for index, pid in _manifest(batch) if index in done}
    ids.update({i: json.loads((point_dir(run_dir, i) / "summary.json").read_text())["point"]
                for i in done - ids.keys()})
    return dict(sorted(ids.items()))


def _manifest(batch: Path) -> list[tuple[int, str]]:
    """The (index, id) of the points a batch holds, in its files' order."""
    return [(index, pid) for index, pid in json.loads((batch / "points.json").read_text())]


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


def batch_dirs(run_dir: Path) -> list[Path]:
    return sorted(p for p in (run_dir / "points").glob("batch-[0-9]*") if p.name[6:].isdigit())


def _parts(run_dir: Path, name: str, point_of: dict[int, str]) -> list[_Part]:
    """The files of table `name` that hold the finished points (`point_of`: their ids by index): each point's
    rows from the last batch listing it, else (a point run before batches) from its own file. Only the points no
    batch lists are looked for on disk: a file system call per point and table was a twentieth of a small sweep."""
    batches = batch_dirs(run_dir)
    manifests = [_manifest(batch) for batch in batches]
    last = {index: n for n, manifest in enumerate(manifests) for index, _ in manifest}
    own = {i: path for i in sorted(point_of) if i not in last and (path := point_table(run_dir, i, name))}
    parts = [_Part(path, [i], own=point_of[i]) for i, path in own.items()]
    for n, batch in enumerate(batches):
        kept = [(i, pid) for i, pid in manifests[n] if i in point_of and last[i] == n]
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
    ids = finished_ids(run_dir)
    parts = _parts(run_dir, name, ids)
    if not parts and (run_dir / f"{name}.parquet").is_file():
        parts = [_Part(run_dir / f"{name}.parquet", [])]
    if points is not None:  # only the files holding one of them (the first anyway: its columns)
        parts = [p for p in parts if p.own in points or any(ids[i] in points for i in p.indices)] or parts[:1]
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
    with pq.ParquetWriter(tmp, schema, use_dictionary=text_columns(schema)) as writer:
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


def text_columns(schema: pa.Schema) -> list[str]:
    """The columns worth dictionary-encoding: text (a point's id, a sync's name). pyarrow's default tries a
    dictionary on every column; on the float and counter columns of a large table it made writing 2.5x and
    reading 4x slower, and the file larger."""
    return [f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]
