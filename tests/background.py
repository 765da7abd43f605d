"""Commands that mostly wait, started when collection ends so that their waiting overlaps the tests before them.

A planted hang (`commlens harness --hang`) spends its process-group timeout, 20 s, with every rank blocked: run in
place, the suite waits that long doing nothing. A test module lists such commands in `BACKGROUND` (name -> a
function of an empty folder giving the command); conftest.py starts each selected module's commands once
collection ends, and the test takes its result with `result(name, make)`, which starts the command then if it was
not started (the test run alone). Output goes to files (a pipe nobody reads would block a chatty process), and
whatever still runs when the session ends is killed with its process group."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Command:
    args: list[str]
    env: dict[str, str]


Make = Callable[[Path], Command]


class Started:
    """One command running in its own folder and process group, its stdout and stderr going to files there."""

    def __init__(self, folder: Path, command: Command) -> None:
        self.folder = folder
        self._out = open(folder / "stdout.txt", "w+")  # noqa: SIM115 - closed by wait() or stop()
        self._err = open(folder / "stderr.txt", "w+")  # noqa: SIM115 - closed by wait() or stop()
        self.proc = subprocess.Popen(
            command.args, env=command.env, stdout=self._out, stderr=self._err, text=True, start_new_session=True
        )

    def wait(self, timeout: float) -> subprocess.CompletedProcess[str]:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            self.stop()
        stdout, stderr = ((self.folder / f"{name}.txt").read_text() for name in ("stdout", "stderr"))
        return subprocess.CompletedProcess(self.proc.args, code, stdout, stderr)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._out.close()
        self._err.close()


_started: dict[str, Started] = {}


def start(name: str, make: Make) -> None:
    """Start `name`'s command in a new folder, once per session."""
    if name not in _started:
        folder = Path(tempfile.mkdtemp(prefix=f"commlens-{name}-"))
        _started[name] = Started(folder, make(folder))


def any_started() -> bool:
    return bool(_started)


def result(name: str, make: Make, timeout: float) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The folder and the finished process of `name`'s command (started now if it was not)."""
    start(name, make)
    return _started[name].folder, _started[name].wait(timeout)


def stop_all() -> None:
    """End what still runs and remove the folders (conftest.py, at the session's end)."""
    for started in _started.values():
        started.stop()
        shutil.rmtree(started.folder, ignore_errors=True)
    _started.clear()
