"""Parsing an ingest's files in worker processes (`commlens ingest --jobs N`).

Workers run the parse step only (`commlens.ingest.parse_file.parse_tables`: bytes to Arrow tables); the
caller's process stays the one DuckDB writer and stores each file in input order, so the result equals a
serial ingest row for row. Archives are expanded in the caller (their limits are the archive's as a
whole) and their members sent by value; files on disk are sent by path. At most two files per worker
are parsed or waiting at a time, so memory is bounded by the workers, not by the number of files.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import itertools
import multiprocessing
import os
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor

from commlens.ingest.inputs import InputFile, Limits, portable
from commlens.ingest.parse_file import ParsedFile, parse_file, parse_tables
from commlens.ingest.records import RankHint

AHEAD = 2  # files per worker parsed or waiting to be stored
# Workers are started when the files to parse hold at least this much: below it starting them costs more
# than they save (about 0.3 s of start-up and imports per worker against ~20 MB/s of parsing)
PARALLEL_MIN_BYTES = 8 << 20


def default_jobs() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def parsed_inputs(
    items: Iterable[InputFile], hint: RankHint, limits: Limits, jobs: int = 1
) -> Iterator[tuple[InputFile, ParsedFile | None]]:
    """Each input with its parse (None for one skipped or unreadable, which is not parsed), in input order.
    With jobs > 1 and at least two files to parse holding PARALLEL_MIN_BYTES, files are parsed in `jobs`
    worker processes."""
    it = iter(items)
    head: list[InputFile] = []  # read ahead until the files to parse are known to be worth workers

    def worth() -> bool:
        todo = [x for x in head if _parses(x)]
        return len(todo) >= 2 and sum(x.size for x in todo) >= PARALLEL_MIN_BYTES

    if jobs > 1:
        for item in it:
            head.append(item)
            if worth():
                break
    rest = itertools.chain(head, it)
    if jobs <= 1 or not worth():
        for item in rest:
            yield item, parse_file(item, hint, limits) if _parses(item) else None
        return
    yield from _in_workers(rest, hint, limits, jobs)


class _NoPandas(importlib.abc.MetaPathFinder):
    """Answers `import pandas` with ModuleNotFoundError (see arrow_without_pandas)."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if fullname.split(".", 1)[0] == "pandas":
            raise ModuleNotFoundError("pandas is not loaded while commlens ingests", name=fullname)


@contextlib.contextmanager
def arrow_without_pandas() -> Iterator[None]:
    """pyarrow imports pandas (0.2-0.3 s) on its first array only to tell pandas objects apart, and commlens
    makes none: while an ingest runs, pandas is absent for it, unless something imported pandas already.
    Afterwards `import pandas` works again (pyarrow's own conversions to pandas import it then)."""
    if "pandas" in sys.modules:
        yield
        return
    blocker = _NoPandas()
    sys.meta_path.insert(0, blocker)
    try:
        yield
    finally:
        sys.meta_path.remove(blocker)


def _worker_start() -> None:
    """A worker process parses only: no pandas for pyarrow (arrow_without_pandas), for its whole life."""
    if "pandas" not in sys.modules:
        sys.meta_path.insert(0, _NoPandas())


def _parses(item: InputFile) -> bool:
    return not item.skip and not item.error


def _in_workers(
    items: Iterator[InputFile], hint: RankHint, limits: Limits, jobs: int
) -> Iterator[tuple[InputFile, ParsedFile | None]]:
    # forkserver: the workers start from a clean process that imported the parsers once, not from a fork of
    # this one (which holds DuckDB's threads)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["commlens.ingest.parse_file"])
    pending: deque[tuple[InputFile, Future[ParsedFile] | None]] = deque()
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_worker_start) as pool:
        try:
            for item in items:
                pending.append(
                    (item, pool.submit(parse_tables, portable(item), hint, limits) if _parses(item) else None)
                )
                while len(pending) > AHEAD * jobs or (pending and pending[0][1] is None):
                    yield _done(pending.popleft())
            while pending:
                yield _done(pending.popleft())
        finally:
            for _, future in pending:
                if future is not None:
                    future.cancel()


def _done(entry: tuple[InputFile, Future[ParsedFile] | None]) -> tuple[InputFile, ParsedFile | None]:
    item, future = entry
    if future is None:
        return item, None
    try:
        return item, future.result()
    except Exception as exc:  # a worker that died (killed, out of memory) fails its file, named
        error = f"{item.name}: the worker process parsing it failed ({type(exc).__name__}: {exc})"
        return item, ParsedFile(item.name, None, "", item.size, error=error)
