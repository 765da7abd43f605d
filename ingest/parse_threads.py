"""How many threads one parse may keep busy: every core when it parses alone (a single large NCCL log cuts its
blocks on them), one when parses run side by side in processes (`--jobs`), which already fill the cores.
Light on purpose: the parse pool's workers import it before anything else."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_sharing = 0  # ingests of this process parsing beside worker processes (or 1 for good: a worker itself)


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def parse_threads(wanted: int) -> int:
    """Threads for one parse that could use `wanted`: at most the cores, one while sharing them."""
    return 1 if _sharing else max(1, min(wanted, cores()))


def share_cores() -> None:
    """From now on this process parses beside others (a parse pool's worker, for its whole life)."""
    _add(1)


@contextlib.contextmanager
def sharing_cores() -> Iterator[None]:
    """While the block runs, this process parses beside its workers (the writer of a parallel ingest)."""
    _add(1)
    try:
        yield
    finally:
        _add(-1)


def _add(n: int) -> None:
    global _sharing  # noqa: PLW0603 - one count per process, changed under the lock
    with _lock:
        _sharing += n
