"""The worker processes of a parallel ingest, startable before the caller's own imports.

This module imports nothing heavy, so the CLI can start the workers first thing: a worker's imports (about
0.3 s) then overlap the CLI's (numpy, pyarrow, DuckDB) on another core instead of following them. Workers
are forked only from a process with no other thread (the CLI before it opens DuckDB), else spawned (a clean
interpreter), and there is no fork server process: a parse pool of N workers is N processes.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from types import TracebackType

from commlens.ingest.parse_threads import cores, share_cores
from commlens.service.no_pandas import block_pandas

# Workers are started when the files to parse hold at least this much: below it starting them costs more
# than they save (about 0.3 s of start-up and imports per worker against ~100 MB/s of parsing)
PARALLEL_MIN_BYTES = 8 << 20


def default_jobs() -> int:
    """The cores this process may run on."""
    return cores()


def _worker_start() -> None:
    """A worker process parses only, one core's worth beside the others (`parse_threads`), and without pandas
    for pyarrow (no_pandas.py), for its whole life."""
    share_cores()
    block_pandas()


def _warm() -> None:
    """Import the parsers (the first task of each worker, so that its imports run while the caller's do)."""
    import commlens.ingest.parse_file  # noqa: F401


class ParsePool:
    """`workers` processes for the parse step (the caller's process parses too: `--jobs N` is N-1 workers and
    the caller). With `fork_ok` and no other thread in this process yet (the CLI before it opens DuckDB) they
    are forked: no interpreter start, and no semaphore tracker process; otherwise spawned. Close it (or use it
    as a context manager) to stop them."""

    def __init__(self, workers: int, fork_ok: bool = False) -> None:
        self.workers = workers
        method = "fork" if fork_ok and threading.active_count() == 1 and os.name == "posix" else "spawn"
        self.start_method = method
        self.executor = ProcessPoolExecutor(
            max_workers=workers, mp_context=multiprocessing.get_context(method), initializer=_worker_start
        )
        for _ in range(workers):  # spawned on demand: one task each starts them all now
            self.executor.submit(_warm)

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> ParsePool:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def worth_workers(sizes: Iterable[int]) -> bool:
    """Whether files of these sizes are worth parsing in workers: at least two holding PARALLEL_MIN_BYTES."""
    total = 0
    for n, size in enumerate(sizes, 1):
        total += size
        if n >= 2 and total >= PARALLEL_MIN_BYTES:
            return True
    return False


def local_sizes(paths: Iterable[Path], limit: int = 10_000) -> Iterable[int]:
    """Sizes of the files at `paths` (directories walked; at most `limit` files looked at): the CLI's early
    guess at worth_workers before the inputs are read; the real decision is parallel.parsed_inputs'."""
    seen = 0
    stack = list(paths)
    while stack and seen < limit:
        path = stack.pop()
        try:
            if path.is_dir():
                stack.extend(p for p in path.iterdir() if not p.name.startswith("."))
            elif path.is_file():
                seen += 1
                yield path.stat().st_size
        except OSError:  # unreadable: the ingest itself says so
            continue


def start_pool(jobs: int, paths: Iterable[Path]) -> ParsePool | None:
    """A pool of jobs-1 workers when the files at `paths` look worth it, else None."""
    if jobs <= 1 or not worth_workers(local_sizes(paths)):
        return None
    return ParsePool(jobs - 1, fork_ok=True)
