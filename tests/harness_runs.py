"""Harness runs shared by the whole test session: one torchrun launch per configuration.

A torchrun/gloo run costs seconds of a contended two-core machine (the launcher and every rank import
torch), and several modules read the same run: the `--dp 2 --delay 1:60` straggler is read by the delay,
time, findings, report, API and dashboard tests, the `--ep 2` run by the EP and pairs tests. `HarnessRuns`
launches each configuration once, on first use, keyed by the complete HarnessConfig (so two modules that
ask for the same options get the same directory); a test that ingests a run gives it its own run name
(`named`). A module's `harness_prefetch(items)` lists the runs its selected tests will read: they launch in
the background while the tests before them run. A run that failed is reported again with its output, never launched twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import os
import subprocess
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import machine
import orjson
import pytest

from commlens.harness import launch
from commlens.harness.config import Delay

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
# Well above a run's worst time beside a CPU burner (a 4-rank run of 10 steps: about a minute); the
# process-group timeout of each configuration (`timeout_s`) is what ends a run whose rank died.
LAUNCH_TIMEOUT_S = 600
# Background launches at a time (HarnessRuns.prefetch): two runs of 2-4 ranks overlap each other's start-up and
# the checks of the tests before them on 2 cores without exhausting 24 GiB.
PREFETCH_WORKERS = 2

# The planted straggler's sleep: the ground truth (`--delay 1:60`). A crowded host adds noise to every
# step (one step of 215 ms instead of ~10 beside a CPU burner), which the 8 profiled steps below and the rule's
# medians and spread test absorb; at a load of 12-15 on 2 cores the rule rightly names nobody (then the tests
# fail, saying so: the machine, not the analysis, is the cause).
DELAY_MS = 60.0


def imposed_by_the_sleep(measured_ms: float, slept_ms: float) -> bool:
    """Whether a wait measured for a planted sleep is the sleep's: at least 80% of what rank 1 slept (less is a
    wrong analysis) and at most 1.5 times it. A loaded host only adds: after its sleep rank 1 waits for a core
    before it reaches the collective (77 ms for a 60 ms sleep with a CPU burner beside the suite's two workers,
    load 5, the 4-rank run on 2 cores)."""
    return 0.8 * slept_ms <= measured_ms <= 1.5 * slept_ms


# The straggler runs: one block, 8 profiled steps of one DDP bucket each (the straggler rule needs 6
# instances per group and a spread across steps; medians over 8 steps damp a crowded machine's noise).
STRAGGLER_MODEL: dict[str, Any] = {
    "layers": 1,
    "hidden": 32,
    "heads": 4,
    "vocab": 64,
    "seq_len": 16,
    "micro_batch_size": 2,
    "micro_batches": 1,
    "steps": 10,
    "profile_wait": 1,
    "profile_warmup": 1,
    "profile_active": 8,
    "device": "cpu",
    "dtype": "float32",
    "timeout_s": 120.0,
}
STRAGGLER_RUNS: dict[str, dict[str, Any]] = {
    "dp": {"dp": 2},
    "dp-delay": {"dp": 2, "delays": [Delay(1, DELAY_MS)]},
    "dp-tp": {"dp": 2, "tp": 2},
    "dp-tp-delay": {"dp": 2, "tp": 2, "delays": [Delay(1, DELAY_MS)]},
    "pp-delay": {"pp": 2, "layers": 2, "micro_batches": 2, "delays": [Delay(1, DELAY_MS)]},
}
PROFILED_STEPS = range(
    STRAGGLER_MODEL["profile_wait"] + STRAGGLER_MODEL["profile_warmup"],
    STRAGGLER_MODEL["profile_wait"] + STRAGGLER_MODEL["profile_warmup"] + STRAGGLER_MODEL["profile_active"],
)


def named(run: launch.PlannedRun, name: str) -> launch.PlannedRun:
    """The same outputs under another run name (ingestion names a run after `PlannedRun.name`)."""
    return dataclasses.replace(run, name=name)


Key = tuple[str, int]  # (the HarnessConfig as JSON, replica)


class HarnessRuns:
    """`runs(name, options)`: the finished run of those HarnessConfig options, launched on first use.

    `name` names the directory (and the run, and run.json's command `["pytest", name]`) of the first
    request; a later request for the same options under another name gets that same run. `replica=n` asks
    for the n-th independent launch of the same options (a test comparing two runs of one configuration
    takes replica 0, which other modules share, and replica 1).

    `prefetch` launches runs in the background, PREFETCH_WORKERS at a time, while the tests before those that
    read them run: conftest.py's fixture prefetches, from its first use on, what the selected test modules'
    `harness_prefetch(items)` list (the byte-exact schemes of test_harness, the CP and EP runs...). A run
    whose times are the evidence (the straggler runs) is asked for with `alone=True`: it waits for the
    background launches to end and none starts until it is done, so its steps share the host with nothing of
    ours (a crowded host blurs a 60 ms straggler)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._runs: dict[Key, Future[launch.PlannedRun]] = {}
        self._pool = ThreadPoolExecutor(PREFETCH_WORKERS, thread_name_prefix="harness-run")
        self._state = threading.Condition()
        self._background = 0  # background launches running
        self._alone = False  # a launch that must run alone is waiting or running

    def __call__(self, name: str, options: dict[str, Any], replica: int = 0, alone: bool = False) -> launch.PlannedRun:
        planned, key = self._plan(name, options, replica)
        with self._state:
            future = self._runs.get(key)
            mine = future is None
            if future is None:
                future = self._runs[key] = Future()
        if mine:
            self._run_into(future, planned, alone)
        try:
            return future.result()
        except LaunchError as exc:
            pytest.fail(str(exc))

    def prefetch(self, runs: Iterable[tuple[str, dict[str, Any]] | tuple[str, dict[str, Any], int]]) -> None:
        """Start launching these (name, options[, replica]) in the background, in order; each once."""
        for name, options, *replica in runs:
            planned, key = self._plan(name, options, replica[0] if replica else 0)
            with self._state:
                if key not in self._runs:
                    self._runs[key] = self._pool.submit(self._background_launch, planned)

    def straggler(self, name: str) -> launch.PlannedRun:
        """One of STRAGGLER_RUNS on STRAGGLER_MODEL (alone: its times are the evidence)."""
        return self(name, dict(STRAGGLER_MODEL, **STRAGGLER_RUNS[name]), alone=True)

    def slept_ms(self, name: str) -> float:
        """What rank 1 of the named straggler run actually slept per profiled step, in ms: the mean of its
        `commlens.delay` ranges in its trace. The ground truth for the wait it imposes: a loaded host
        oversleeps DELAY_MS (72.6 ms against 60 seen at load 4.8), so the nominal value is not it."""
        with gzip.open(self.straggler(name).out / "trace.rank1.json.gz") as f:
            events = orjson.loads(f.read())["traceEvents"]
        slept = [e["dur"] for e in events if e.get("ph") == "X" and e.get("name") == "commlens.delay"]
        assert len(slept) >= 8 and min(slept) >= DELAY_MS * 1000, slept
        return float(sum(slept)) / len(slept) / 1000

    def close(self) -> None:
        """Drop the launches not started; wait for the running ones (end of the session)."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _plan(self, name: str, options: dict[str, Any], replica: int) -> tuple[launch.PlannedRun, Key]:
        (planned,) = launch.plan_runs(self.root / name, options, None, [], None)
        return planned, (planned.cfg.to_json(), replica)

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        """Wait for the background launches to end and start none until the block is done: for work whose
        times are the evidence (a straggler run, the gloo traces whose end times the clock rule reads)."""
        with self._state:
            self._alone = True
            self._state.wait_for(lambda: self._background == 0)
        try:
            with machine.to_myself():  # and, under pytest -n, no test of the other worker runs meanwhile
                yield
        finally:
            with self._state:
                self._alone = False
                self._state.notify_all()

    def _run_into(self, future: Future[launch.PlannedRun], planned: launch.PlannedRun, alone: bool) -> None:
        """Launch in this thread; alone: after the background launches end, holding off new ones."""
        with self.alone() if alone else contextlib.nullcontext():
            try:
                future.set_result(self._launch(planned))
            except LaunchError as exc:
                future.set_exception(exc)

    def _background_launch(self, planned: launch.PlannedRun) -> launch.PlannedRun:
        with self._state:
            self._state.wait_for(lambda: not self._alone)
            self._background += 1
        try:
            return self._launch(planned)
        finally:
            with self._state:
                self._background -= 1
                self._state.notify_all()

    def _launch(self, planned: launch.PlannedRun) -> launch.PlannedRun:
        with self._state:  # a directory of its own, also when two threads plan the same name
            out, n = planned.out, 1
            while out.exists():  # the name was taken by other options
                n += 1
                out = planned.out.with_name(f"{planned.out.name}-{n}")
            run = dataclasses.replace(planned, name=out.name, out=out)
            launch.prepare(run, overwrite=False)
        proc = subprocess.run(
            launch.torchrun_command(run, ["pytest", run.name]),
            env=ENV,
            capture_output=True,
            text=True,
            timeout=LAUNCH_TIMEOUT_S,
            check=False,
        )
        if proc.returncode != 0:
            raise LaunchError(
                f"{run.name}: torchrun exited {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-6000:]}"
            )
        return run


class LaunchError(RuntimeError):
    """A harness run that failed, with its output; every later request for it is failed with the same text."""


def params(items: list[pytest.Item], name: str) -> list[Any]:
    """The values of the test parameter `name` over `items`, in run order, each once (a module's
    `harness_prefetch` lists the runs of its selected tests with it)."""
    values: list[Any] = []
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and name in callspec.params and callspec.params[name] not in values:
            values.append(callspec.params[name])
    return values
