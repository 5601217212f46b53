"""numba compilation of the per-step functions, cached on disk and dropped whenever the package's sources change.

numba's `cache=True` keys a function's cached machine code on its own file only, but compiled functions call
and inline code of other modules (the roofline of `costmodel`, the lookups of `acceptance`, the batch-table rows
of `policy`): after an edit there, the cache would keep serving the old code, and a changed cost model would
silently give the old results. So every compiled function of the package goes through `njit` below, which
empties its cache directory once when the sources differ from those its files were compiled from.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from pathlib import Path

import numba

PACKAGE = Path(__file__).resolve().parent
STAMP = "simharness-sources.sha256"  # beside numba's files: the digest of the sources they were compiled from
_checked: set[Path] = set()


def sources_digest(package: Path = PACKAGE) -> str:
    """SHA-256 over a package's Python sources (relative paths and contents, in path order): equal digests,
    equal code, whichever checkout or copy it lies in."""
    h = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        h.update(path.relative_to(package).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


@functools.cache
def loaded_digest() -> str:
    """The digest of this package's sources, read once per process: the code it imported (run metadata, the
    numba cache's stamp)."""
    return sources_digest()


def drop_stale(cache_dir: Path, digest: str) -> None:
    """Delete numba's cache files in `cache_dir` unless they were compiled from sources with this digest."""
    stamp = cache_dir / STAMP
    if stamp.is_file() and stamp.read_text() == digest:
        return
    for pattern in ("*.nbi", "*.nbc"):
        for path in cache_dir.glob(pattern):
            path.unlink(missing_ok=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    stamp.write_text(digest)


def njit(fn: Callable | None = None, **options):
    """`numba.njit(cache=True, **options)` with the stale-cache check of this module; use as `@njit` or
    `@njit(inline="always")`."""

    def compile_cached(f: Callable):
        dispatcher = numba.njit(cache=True, **options)(f)
        cache_dir = Path(dispatcher._cache.cache_path)
        if cache_dir not in _checked:  # once per directory and process, before anything is loaded from it
            _checked.add(cache_dir)
            drop_stale(cache_dir, loaded_digest())
        return dispatcher

    return compile_cached if fn is None else compile_cached(fn)
