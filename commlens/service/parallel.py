"""Parsing an ingest's files in worker processes (`commlens ingest --jobs N`).

Workers run the parse step only (`commlens.ingest.parse_file.parse_tables`: bytes to Arrow tables); the
caller's process parses too, whenever every worker has its share queued, and stays the one DuckDB writer: it
stores each file in input order, so the result equals a serial ingest row for row. Archives are expanded in
the caller (their limits are the archive's as a whole) and their members sent by value; files on disk are
sent by path. At most AHEAD files per parsing process are parsed or waiting at a time, so memory is bounded
by the processes, not by the number of files.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future

from commlens.ingest.inputs import InputFile, Limits, portable
from commlens.ingest.parse_file import ParsedFile, parse_file, parse_tables
from commlens.ingest.parse_threads import sharing_cores
from commlens.ingest.records import RankHint
from commlens.service.parse_pool import ParsePool, default_jobs, worth_workers

__all__ = ["AHEAD", "ParsePool", "default_jobs", "parsed_inputs"]

AHEAD = 2  # files per parsing process parsed or waiting to be stored


def parsed_inputs(
    items: Iterable[InputFile], hint: RankHint, limits: Limits, jobs: int = 1, pool: ParsePool | None = None
) -> Iterator[tuple[InputFile, ParsedFile | None]]:
    """Each input with its parse (None for one skipped or unreadable, which is not parsed), in input order.
    With jobs > 1 and at least two files to parse holding PARALLEL_MIN_BYTES, files are parsed in jobs-1
    worker processes and this one (`pool`, when the caller started it early, else started here)."""
    it = iter(items)
    head: list[InputFile] = []  # read ahead until the files to parse are known to be worth workers

    def worth() -> bool:
        return worth_workers(x.size for x in head if _parses(x))

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
    with sharing_cores():  # this process's own parses run beside its workers'
        if pool is not None:
            yield from _in_workers(rest, hint, limits, pool)
            return
        with ParsePool(jobs - 1) as own:
            yield from _in_workers(rest, hint, limits, own)


def _parses(item: InputFile) -> bool:
    return not item.skip and not item.error


def _in_workers(
    items: Iterator[InputFile], hint: RankHint, limits: Limits, pool: ParsePool
) -> Iterator[tuple[InputFile, ParsedFile | None]]:
    """Files go to the workers while fewer than AHEAD each are queued there; otherwise this process parses the
    next one itself instead of waiting. Parses are handed out in input order as they complete."""
    pending: deque[tuple[InputFile, Future[ParsedFile] | None]] = deque()
    queued = AHEAD * pool.workers

    def in_flight() -> int:
        return sum(1 for _, f in pending if f is not None and not f.done())

    try:
        for item in items:
            if not _parses(item):
                pending.append((item, None))
            elif in_flight() < queued:
                pending.append((item, pool.executor.submit(parse_tables, portable(item), hint, limits)))
            else:
                here: Future[ParsedFile] = Future()
                here.set_result(parse_file(item, hint, limits))
                pending.append((item, here))
            while pending and (pending[0][1] is None or pending[0][1].done()):
                yield _done(pending.popleft())
            while len(pending) > AHEAD * (pool.workers + 1):
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
