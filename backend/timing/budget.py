"""The memory the time analysis may hold, and its share of it per run.

The analysis holds a run's calls as columns and one rank's timeline intervals at a time (docs/time.md, Scale):
about 1.0 GB at its peak for 1 M calls over 8 ranks with 18.8 M timeline intervals, 1.2 GB for one rank's 5 M
calls and 5 M intervals. A run larger than the
machine can hold would be killed by the kernel's out-of-memory killer, and with it the server and every job it
runs, again at each restart's recovery. So each analysis first reserves its estimated peak: one larger than the
whole budget is not computed (time_status says why; every other analysis of the run is unaffected), and analyses
that fit together run together while the others wait for their share.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import duckdb

ENV = "COMMLENS_TIME_MEMORY"  # e.g. "8GB": the memory the time analyses of this process may hold together
SHARE = 0.75  # of the machine's (or the container's) memory, without ENV
# Estimated peak per call, per timeline interval of the largest rank (held during its turn) and per interval of the
# run (DuckDB's cache of the blocks the reads touched), against measured peaks of the whole process (bench/README.md,
# 2026-12-01; estimated in brackets): 1 M calls over 8 ranks with 2.77 M intervals 0.76 GB (0.90), over 64 ranks
# 0.82 GB (0.85); with 18.8 M intervals 1.03 GB (1.45) and 1.09 GB (1.15); one rank's 5 M calls and 5 M intervals
# 1.19 GB (4.83).
CALL_BYTES = 800
INTERVAL_BYTES = 150
CACHED_INTERVAL_BYTES = 16
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """Bytes of "8GB", "512 MiB" or "1000000"."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{ENV}={text!r} is not a size (write e.g. 8GB, 512MiB or a number of bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def machine_memory() -> int:
    """Physical memory, or the container's limit where cgroup v2 sets a lower one."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def budget() -> tuple[int, str]:
    """The bytes the analyses may hold together, and where that figure comes from."""
    text = os.environ.get(ENV)
    if text:
        return parse_size(text), ENV
    return int(machine_memory() * SHARE), f"{SHARE:.0%} of this machine's memory; {ENV} sets it"


def estimate(con: duckdb.DuckDBPyConnection, run_id: int) -> tuple[int, int, int]:
    """(calls, timeline intervals of the largest rank, estimated peak bytes) of a run's time analysis: the
    calls are held for the whole run, a rank's intervals only during its turn (analysis.analyze_columns)."""
    calls, largest, intervals = con.execute(
        """SELECT (SELECT count(*) FROM comm_events WHERE run_id = $run AND counted AND rank IS NOT NULL),
                  coalesce(max(n), 0), coalesce(sum(n), 0)
           FROM (SELECT count(*) AS n FROM timeline_intervals WHERE run_id = $run GROUP BY rank)""",
        {"run": run_id},
    ).fetchall()[0]
    return calls, largest, calls * CALL_BYTES + largest * INTERVAL_BYTES + int(intervals) * CACHED_INTERVAL_BYTES


class MemoryBudget:
    """Reservations against one budget, shared by the threads of a process (the server's ingest workers)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held = 0

    @contextmanager
    def reserve(self, need: int, total: int) -> Iterator[None]:
        """Hold `need` bytes of `total` for the block, waiting while others hold too much (need <= total)."""
        with self._cond:
            while self._held and self._held + need > total:
                self._cond.wait()
            self._held += need
        try:
            yield
        finally:
            with self._cond:
                self._held -= need
                self._cond.notify_all()


BUDGET = MemoryBudget()


def _size(n: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def refusal(calls: int, intervals: int, need: int, total: int, source: str) -> str:
    return (
        f"not computed: the time analysis of {calls:,} calls, with {intervals:,} timeline intervals on its largest "
        f"rank, needs about {_size(need)}, more than the {_size(total)} it may use ({source}); the run's other "
        "analyses are unaffected"
    )
