"""The machine's two cores shared between pytest-xdist workers, and taken whole by work whose times are evidence.

Under `pytest -n 2` every test holds a shared lock from its setup to its teardown (conftest.py). A planted
straggler's harness launch, or the gloo traces whose end times the clock rule reads, takes the lock exclusively
(`to_myself`, through HarnessRuns.alone): it waits for the other worker's test to end, and the other worker's next
test waits for it. A second lock, the gate, gives the exclusive request precedence: a test takes the gate before
its shared hold, so a worker starting test after test cannot keep the waiting launch out. Without xdist (one
process) both are no-ops. flock locks belong to the open file, so the worker's own shared hold is let go before
the exclusive request and taken again after it: two workers asking at once wait for each other's test, never
for each other's hold.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # set by xdist in every worker, the same in all of one run
_fds: dict[str, int] = {}


def _fd(name: str) -> int:
    if name not in _fds:
        path = Path(tempfile.gettempdir()) / f"commlens-tests-{_RUN}.{name}.lock"
        _fds[name] = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    return _fds[name]


@contextlib.contextmanager
def shared() -> Iterator[None]:
    """Held by each test of each worker, setup to teardown."""
    if _RUN is None:
        yield
        return
    fcntl.flock(_fd("gate"), fcntl.LOCK_EX)
    fcntl.flock(_fd("main"), fcntl.LOCK_SH)
    fcntl.flock(_fd("gate"), fcntl.LOCK_UN)
    try:
        yield
    finally:
        fcntl.flock(_fd("main"), fcntl.LOCK_UN)


@contextlib.contextmanager
def to_myself() -> Iterator[None]:
    """No test of another worker runs while the block runs (called inside a test of this worker)."""
    if _RUN is None:
        yield
        return
    fcntl.flock(_fd("main"), fcntl.LOCK_UN)
    fcntl.flock(_fd("gate"), fcntl.LOCK_EX)
    try:
        fcntl.flock(_fd("main"), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(_fd("main"), fcntl.LOCK_SH)  # this worker's test goes on, sharing again
    finally:
        fcntl.flock(_fd("gate"), fcntl.LOCK_UN)


def release() -> None:
    """Close and delete this worker's lock files (conftest.py, at the end of its session): a worker that opens
    them later makes new ones, and the other worker holds its own open files until it ends."""
    for name, fd in _fds.items():
        os.close(fd)
        Path(tempfile.gettempdir(), f"commlens-tests-{_RUN}.{name}.lock").unlink(missing_ok=True)
    _fds.clear()
