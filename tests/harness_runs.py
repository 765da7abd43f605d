"""Harness runs shared by the whole test session: one torchrun launch per configuration.

A torchrun/gloo run costs seconds of a contended two-core machine (the launcher and every rank import
torch), and several modules read the same run: the `--dp 2 --delay 1:60` straggler is read by the delay,
time, findings, report, API and dashboard tests, the `--ep 2` run by the EP and pairs tests. `HarnessRuns`
launches each configuration once, on first use, keyed by the complete HarnessConfig (so two modules that
ask for the same options get the same directory); a test that ingests a run gives it its own run name
(`named`). A run that failed is reported again with its output, never launched twice.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from commlens.harness import launch
from commlens.harness.config import Delay

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
# Well above a run's worst time beside a CPU burner (a 4-rank run of 10 steps: about a minute); the
# process-group timeout of each configuration (`timeout_s`) is what ends a run whose rank died.
LAUNCH_TIMEOUT_S = 600

# The planted straggler's sleep: the ground truth (`--delay 1:60`). A crowded host adds noise to every
# step (one step of 215 ms instead of ~10 beside a CPU burner), which the 8 profiled steps below and the rule's
# medians and spread test absorb; at a load of 12-15 on 2 cores the rule rightly names nobody (then the tests
# fail, saying so: the machine, not the analysis, is the cause).
DELAY_MS = 60.0
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
}
PROFILED_STEPS = range(
    STRAGGLER_MODEL["profile_wait"] + STRAGGLER_MODEL["profile_warmup"],
    STRAGGLER_MODEL["profile_wait"] + STRAGGLER_MODEL["profile_warmup"] + STRAGGLER_MODEL["profile_active"],
)


def named(run: launch.PlannedRun, name: str) -> launch.PlannedRun:
    """The same outputs under another run name (ingestion names a run after `PlannedRun.name`)."""
    return dataclasses.replace(run, name=name)


class HarnessRuns:
    """`runs(name, options)`: the finished run of those HarnessConfig options, launched on first use.

    `name` names the directory (and the run, and run.json's command `["pytest", name]`) of the first
    request; a later request for the same options under another name gets that same run. `replica=n` asks
    for the n-th independent launch of the same options (a test comparing two runs of one configuration
    takes replica 0, which other modules share, and replica 1)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._done: dict[tuple[str, int], launch.PlannedRun] = {}
        self._failed: dict[tuple[str, int], str] = {}

    def __call__(self, name: str, options: dict[str, Any], replica: int = 0) -> launch.PlannedRun:
        (planned,) = launch.plan_runs(self.root / name, options, None, [], None)
        key = (planned.cfg.to_json(), replica)
        if key in self._failed:
            pytest.fail(f"this harness run failed earlier in the session:\n{self._failed[key]}")
        if key not in self._done:
            self._done[key] = self._launch(planned, key)
        return self._done[key]

    def straggler(self, name: str) -> launch.PlannedRun:
        """One of STRAGGLER_RUNS on STRAGGLER_MODEL."""
        return self(name, dict(STRAGGLER_MODEL, **STRAGGLER_RUNS[name]))

    def _launch(self, planned: launch.PlannedRun, key: tuple[str, int]) -> launch.PlannedRun:
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
            self._failed[key] = (
                f"{run.name}: torchrun exited {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-6000:]}"
            )
            pytest.fail(self._failed[key])
        return run
