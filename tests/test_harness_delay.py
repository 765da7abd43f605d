"""Ground truth for the time analysis: `commlens harness --delay RANK:MS[:PHASE]` plants a straggler.

Real torchrun/gloo runs, checked on the raw trace files (the straggler analysis is tested against these
runs elsewhere): the delayed rank's trace shows the `commlens.delay` range every step, run.json records
the delay and every rank's step wall times, and its peer's all-reduces take about MS longer per step
than in the same run without delay, because gloo's all-reduce blocks until the late rank arrives.

What "rank 0's all-reduce time" is here: the `gloo:all_reduce` ranges on gloo's worker threads, where
the collective really runs. DDP issues its bucket all-reduces asynchronously (the `c10d::allreduce_`
op returns at once), so the wait shows only there; a tp all-reduce is synchronous, so its worker range
lies inside the caller's `commlens:tp:<pg>` label, which is how it is told apart from dp's. A worker
range can end after its step (the last step's is sometimes closed only when the profiler stops, tens of
ms late), so each is cut at its step's end: no step ends before its all-reduces do.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path
from statistics import median
from typing import Any

import orjson
import pytest
from harness_runs import DELAY_MS, PROFILED_STEPS, STRAGGLER_MODEL, HarnessRuns, imposed_by_the_sleep

from commlens.harness.config import ConfigError, Delay, HarnessConfig, parse_delays, validation_errors

# The runs: tests/harness_runs.py's straggler runs (one block, 8 profiled steps, shared with the time, findings,
# report and API tests), and one with a delay in each of the later phases.
PHASES: dict[str, Any] = {"dp": 2, "delays": [Delay(0, 30.0, "backward"), Delay(1, 20.0, "optimizer")]}
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")

Event = dict[str, Any]


# ----------------------------------------------------------------------------- no processes


def test_delay_specs_parse_and_impossible_ones_are_refused():
    assert parse_delays(["1:60", "0:12.5:backward"]) == [Delay(1, 60.0), Delay(0, 12.5, "backward")]
    with pytest.raises(ConfigError) as exc:
        parse_delays(["1", "a:60", "1:60:forward:x"])
    assert str(exc.value).count("expected RANK:MS[:PHASE]") == 2 and "RANK must be an integer" in str(exc.value)
    cfg = HarnessConfig(dp=2, delays=[Delay(2, 60.0), Delay(1, 0.0), Delay(1, 5.0, "sideways")])
    errors = "\n".join(validation_errors(cfg))
    assert "--delay 2:60:forward: rank 2 is not in the job (world size 2" in errors
    assert "--delay 1:0:forward: the delay must be a finite number of milliseconds > 0" in errors
    assert "--delay 1:5:sideways: phase must be one of forward, backward, optimizer" in errors
    assert validation_errors(HarnessConfig(dp=2, delays=[Delay(1, 60.0, "optimizer")])) == []
    # the launcher's config file carries the delays to the ranks
    cfg = HarnessConfig(dp=2, delays=[Delay(1, 60.0, "backward")])
    assert HarnessConfig.from_dict(json.loads(cfg.to_json())) == cfg


def test_cli_refuses_a_delay_outside_the_job_before_starting(tmp_path):
    out = tmp_path / "never"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "commlens.cli",
            "harness",
            "--out",
            str(out),
            "--device",
            "cpu",
            "--dp",
            "2",
            "--delay",
            "1:60",
            "--delay",
            "4:60:optimizer",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "rank 4 is not in the job" in proc.stderr and "rank 1" not in proc.stderr
    assert not out.exists()


def test_a_delay_over_too_few_profiled_steps_is_said(tmp_path):
    """The harness README's `--dp 2 --tp 2 --delay 1:60` profiles 2 steps: the analysis then names no straggler
    ("consistency needs 4"), which the harness now says before it starts, with the flags that make it visible; so
    does 4 profiled steps of a group with one collective a step (DDP's one bucket: 4 instances, 6 needed)."""
    base = [sys.executable, "-m", "commlens.cli", "harness", "--device", "cpu", "--dp", "2", "--dry-run"]
    kw: dict = {"capture_output": True, "text": True, "env": dict(ENV, COLUMNS="300"), "timeout": 120}
    thin = subprocess.run([*base, "--out", str(tmp_path / "thin"), "--delay", "1:60"], check=False, **kw)
    assert thin.returncode == 0, thin.stderr
    said = " ".join(thin.stderr.split())
    assert (
        "names one from 4 profiled steps and 6 collectives of its group on, and this run profiles 2 (a group with one "
        "collective a step, DDP with one bucket, needs 6 steps): add --profile-active 8 --steps 10"
    ) in said
    four = [*base, "--out", str(tmp_path / "four"), "--delay", "1:60", "--steps", "6", "--profile-active", "4"]
    assert "this run profiles 4" in " ".join(subprocess.run(four, check=False, **kw).stderr.split())
    enough = [*base, "--out", str(tmp_path / "enough"), "--delay", "1:60", "--steps", "10", "--profile-active", "8"]
    assert "note: --delay" not in subprocess.run(enough, check=False, **kw).stderr


# ----------------------------------------------------------------------------- real runs


@pytest.fixture
def runs(harness_runs: HarnessRuns):
    """A straggler run (or "phases") by name, shared by the session: launched once, on first use."""

    def get(name: str) -> Path:
        if name == "phases":
            return harness_runs("phases", dict(STRAGGLER_MODEL, **PHASES), alone=True).out
        return harness_runs.straggler(name).out

    return get


def _events(out: Path, rank: int) -> list[Event]:
    with gzip.open(out / f"trace.rank{rank}.json.gz") as f:
        trace = orjson.loads(f.read())
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"]


def _steps(events: list[Event]) -> dict[int, Event]:
    return {int(e["name"].split("#")[1]): e for e in events if e["name"].startswith("ProfilerStep#")}


def _within(inner: Event, outer: Event) -> bool:
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]


def _named(events: list[Event], name: str, step: Event) -> list[Event]:
    return sorted((e for e in events if e["name"] == name and _within(e, step)), key=lambda e: e["ts"])


def allreduce_ms_per_step(out: Path, rank: int, dim: str) -> dict[int, float]:
    """Per profiled step, the time the rank's gloo all-reduces of the `dim` group ran, in ms (module doc)."""
    events = _events(out, rank)
    tp_labels = [e for e in events if e["name"].startswith("commlens:tp:")]
    work = [e for e in events if e["name"] == "gloo:all_reduce"]
    mine = [w for w in work if any(_within(w, label) for label in tp_labels) == (dim == "tp")]
    per_step = {}
    for n, step in _steps(events).items():
        end = step["ts"] + step["dur"]
        per_step[n] = sum(min(w["ts"] + w["dur"], end) - w["ts"] for w in mine if step["ts"] <= w["ts"] < end) / 1000
    return per_step


def _run_json(out: Path) -> dict[str, Any]:
    return json.loads((out / "run.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("delayed, base", [("dp-delay", "dp"), ("dp-tp-delay", "dp-tp")])
def test_delay_is_recorded_and_visible_in_the_traces(delayed, base, runs):
    from commlens.run_json import RunConfig

    out = runs(delayed)
    rc = RunConfig.model_validate(_run_json(out))
    assert [d.model_dump() for d in rc.delays] == [{"rank": 1, "ms": DELAY_MS, "phase": "forward"}]
    assert sorted(rc.step_wall_ms) == list(range(rc.world_size))
    assert all(len(walls) == STRAGGLER_MODEL["steps"] for walls in rc.step_wall_ms.values())
    assert min(rc.step_wall_ms[1]) >= DELAY_MS  # the sleep is inside the timed step
    assert RunConfig.model_validate(_run_json(runs(base))).delays == []

    events = _events(out, 1)
    steps = _steps(events)
    assert sorted(steps) == list(PROFILED_STEPS)
    slept = []  # ms per step (a loaded host oversleeps DELAY_MS): what rank 0's extra wait is compared with
    for n, step in steps.items():  # once per step, before the forward, at least the delay long
        (delay,) = _named(events, "commlens.delay", step)
        assert delay["dur"] >= DELAY_MS * 1000, (n, delay)
        slept.append(delay["dur"] / 1000)
        assert all(e["ts"] >= delay["ts"] + delay["dur"] for e in _named(events, "aten::embedding", step))
    assert not any(e["name"] == "commlens.delay" for e in _events(out, 0))

    # rank 0 waits for rank 1 in the group they share: about what rank 1 slept more all-reduce time per step
    dim = "dp" if base == "dp" else "tp"
    with_delay = allreduce_ms_per_step(out, 0, dim)
    without = allreduce_ms_per_step(runs(base), 0, dim)
    assert sorted(with_delay) == sorted(without) == list(PROFILED_STEPS)
    if dim == "dp":  # medians across steps: one crowded step of either run moves a mean by tens of ms
        extra = median(with_delay.values()) - median(without.values())
        assert imposed_by_the_sleep(extra, median(slept)), (with_delay, without, slept)
        return
    # Four ranks on a two-core host: without delay, rank 0 also waits for peers that the scheduler
    # set aside (10-25 ms per step on a busy machine), and the sleep absorbs part of that, so the extra
    # over the run without delay falls short of the delay by that much. The control that shares the
    # contention is the run's other tp group: rank 2 holds rank 0's place in it and nobody there sleeps.
    # Crowding only adds waits (a CI run beside a CPU burner measured +73 ms over the control for a 60 ms
    # delay), so this raw check is one-sided; the analysis's band (-20%, +50%) for the tp group is asserted in
    # tests/test_time_harness.py, on arrivals rather than on all-reduce durations.
    # Medians across steps: one crowded step (215 ms in an undelayed run beside a burner) moves a mean by more
    # than the delay.
    # A loaded host also delays rank 0's own arrival, which the sleep then absorbs: 0.78x the delay over the
    # control was measured with a second test session on the two cores (2026-12-03), so 0.6x, as below.
    control = allreduce_ms_per_step(out, 2, dim)
    assert median(with_delay.values()) - median(control.values()) >= 0.6 * DELAY_MS, (with_delay, control)
    assert median(with_delay.values()) - median(without.values()) >= 0.6 * DELAY_MS, (with_delay, without)


@pytest.mark.slow
def test_backward_and_optimizer_delays_sit_before_their_phase(runs):
    from commlens.run_json import RunConfig

    out = runs("phases")
    assert [(d.rank, d.ms, d.phase) for d in RunConfig.model_validate(_run_json(out)).delays] == [
        (0, 30.0, "backward"),
        (1, 20.0, "optimizer"),
    ]
    for rank, ms in ((0, 30.0), (1, 20.0)):
        events = _events(out, rank)
        for step in _steps(events).values():
            (delay,) = _named(events, "commlens.delay", step)
            assert delay["dur"] >= ms * 1000
            (forward,) = _named(events, "DistributedDataParallel.forward", step)
            assert delay["ts"] >= forward["ts"] + forward["dur"]  # after the forward
            first_grad = _named(events, "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", step)
            labels = _named(events, "commlens:dp:" + _dp_pg_name(out), step)
            if rank == 0:  # backward: before any gradient exists, so before DDP's all-reduce
                assert delay["ts"] + delay["dur"] <= first_grad[0]["ts"]
            else:  # optimizer: after the backward's all-reduces were issued
                assert delay["ts"] >= labels[-1]["ts"] + labels[-1]["dur"]


def _dp_pg_name(out: Path) -> str:
    (group,) = [g for g in _run_json(out)["groups"] if g["dim"] == "dp"]
    return str(group["pg_name"])
