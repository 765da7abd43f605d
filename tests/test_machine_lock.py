"""tests/machine.py between real processes: a test's shared hold keeps an exclusive request waiting, and a waiting
exclusive request keeps the next test out (the gate), so a worker starting test after test cannot starve it."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# Each process appends "<who> in" and "<who> out" to the log around its hold, "hold" seconds inside; the exclusive
# one (inside a shared hold, as a test's launch is) notes "asks" before its request.
_HOLDER = """
import sys, time, machine
who, how, log, hold = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
def note(what):
    with open(log, "a") as f:
        f.write(f"{who} {what}\\n")
if how == "exclusive":
    with machine.shared():
        note("asks")
        with machine.to_myself():
            note("in"); time.sleep(hold); note("out")
else:
    with machine.shared():
        note("in"); time.sleep(hold); note("out")
"""


def _start(who: str, how: str, log: Path, hold: float, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", _HOLDER, who, how, str(log), str(hold)], env=env)


def _wait_for(check: Callable[[], bool], what: str, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def _held(path: Path) -> bool:
    """Whether some process holds the lock file (an exclusive try from here fails)."""
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_an_exclusive_hold_waits_for_the_running_test_and_goes_before_the_next(tmp_path: Path) -> None:
    run = f"lock-test-{os.getpid()}-{time.monotonic_ns()}"
    env = dict(os.environ, PYTEST_XDIST_TESTRUNUID=run, PYTHONPATH=str(TESTS))
    gate = Path(tempfile.gettempdir()) / f"commlens-tests-{run}.gate.lock"
    log = tmp_path / "order.log"
    procs = []
    try:
        first = _start("test1", "shared", log, 1.0, env)
        procs.append(first)
        _wait_for(lambda: log.exists() and "test1 in" in log.read_text(), "the first test's hold")
        straggler = _start("launch", "exclusive", log, 0.5, env)
        procs.append(straggler)
        _wait_for(lambda: "launch asks" in log.read_text() and _held(gate), "the exclusive request to take the gate")
        second = _start("test2", "shared", log, 0.0, env)
        procs.append(second)
        for p in procs:
            assert p.wait(timeout=120) == 0
    finally:
        for p in procs:
            p.kill()
        for name in ("gate", "main"):
            (Path(tempfile.gettempdir()) / f"commlens-tests-{run}.{name}.lock").unlink(missing_ok=True)
    assert log.read_text().split("\n")[:-1] == [
        "test1 in",
        "launch asks",
        "test1 out",
        "launch in",
        "launch out",
        "test2 in",
        "test2 out",
    ]
