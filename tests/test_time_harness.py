"""The planted straggler through the whole product: `commlens harness --delay RANK:MS` on real torchrun/gloo
runs, ingested into a store as `commlens harness --ingest` does (`launch.ingest_run`), read back from
`commlens report --format json` (key "time") and the time service.

With `--dp 2 --delay 1:MS` rank 1 sleeps MS ms (DELAY_MS) before every step's forward: it must be named the
dp straggler, arrive last in >= 90% of the dp instances, and rank 0 must wait what rank 1 actually slept (its
`commlens.delay` ranges: a loaded host oversleeps MS) per step, -20% to +50% (harness_runs.imposed_by_the_sleep). With
`--dp 2 --tp 2 --delay 1:MS` the same holds for rank 1's tp group, where rank 1 arrives last only in the
first tp all-reduce of each step (the dozen after it are near-ties), so "last" is weighed by the wait it
causes there. Without a delay no straggler is named. The runs (one-block model, 8 profiled steps) are
tests/harness_runs.py's, launched once per session.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from harness_runs import HarnessRuns, imposed_by_the_sleep, named

from commlens import store
from commlens.contract.time import StragglerReport
from commlens.harness import launch
from commlens.service import time as time_service

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")

pytestmark = pytest.mark.slow


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "commlens.cli", *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.fixture(scope="module")
def run_db(harness_runs: HarnessRuns, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The store holding the named straggler run (tests/harness_runs.py: launched once per session) under its
    name, ingested as `commlens harness --ingest` does, each run once, on first use."""
    db = tmp_path_factory.mktemp("time-harness") / "store.duckdb"
    done: set[str] = set()

    def get(name: str) -> Path:
        if name not in done:
            assert not launch.ingest_run(db, named(harness_runs.straggler(name), name)).failed
            done.add(name)
        return db

    return get


@pytest.fixture(scope="module")
def planted(harness_runs: HarnessRuns) -> Callable[[str], float]:
    """What rank 1 of the named run actually slept per step (HarnessRuns.slept_ms), the analysis' ground truth."""
    return harness_runs.slept_ms


def report_time(db: Path, run: str) -> dict[str, Any]:
    proc = _cli("report", "--db", str(db), "--run", run, "--format", "json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["time"]["status"]["available"], doc["time"]["status"]
    return dict(doc["time"])


def findings_of(db: Path, run: str) -> list[dict[str, Any]]:
    proc = _cli("report", "--db", str(db), "--run", run, "--format", "json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return list(json.loads(proc.stdout)["findings"])


def arrivals(db: Path, run: str) -> StragglerReport:
    con = store.connect(db, read_only=True)
    try:
        return time_service.stragglers(con, run)
    finally:
        con.close()


def test_dp_delay_names_rank_1_and_rank_0_waits_the_delay(
    run_db: Callable[[str], Path], planted: Callable[[str], float]
) -> None:
    t = report_time(run_db("dp-delay"), "dp-delay")
    slept = planted("dp-delay")
    (s,) = t["stragglers"]
    assert (s["rank"], s["scheme"]) == (1, "dp"), s
    assert imposed_by_the_sleep(s["imposed_ms_per_step"], slept), (s, slept)
    assert s["steps_consistent"] == s["steps"] == 8, s
    ranks = {r["rank"]: r for r in t["ranks"]}
    assert set(ranks) == {0, 1}
    # one DDP bucket per step: every instance is the dp group's, and rank 1 arrives last in >= 90% of them
    assert ranks[1]["instances"] >= 8 and ranks[1]["arrived_last"] >= 0.9 * ranks[1]["instances"], ranks[1]
    assert imposed_by_the_sleep(ranks[0]["wait_us"] / ranks[0]["steps"] / 1e3, slept), (ranks[0], slept)
    assert ranks[1]["wait_us"] / ranks[1]["steps"] / 1e3 < 0.1 * slept, ranks[1]


def test_dp_without_delay_names_no_straggler(run_db: Callable[[str], Path]) -> None:
    t = report_time(run_db("dp"), "dp")
    assert t["stragglers"] == [] and t["instances"] >= 8
    (verdict,) = t["verdicts"]
    assert verdict["verdict"] == "no straggler" and verdict["reason"].startswith("no straggler: "), verdict


def test_tp_delay_names_rank_1_in_its_tp_group(run_db: Callable[[str], Path], planted: Callable[[str], float]) -> None:
    db = run_db("dp-tp-delay")
    slept = planted("dp-tp-delay")
    t = report_time(db, "dp-tp-delay")
    per_group = arrivals(db, "dp-tp-delay").ranks
    (mine,) = {a.group for a in per_group if a.scheme == "tp" and a.rank == 1}
    tp = [s for s in t["stragglers"] if s["group"] == mine]
    assert [s["rank"] for s in tp] == [1], t["verdicts"]
    assert imposed_by_the_sleep(tp[0]["imposed_ms_per_step"], slept), (tp[0], slept)
    # rank 1's tp group: it causes most of the wait (>= 75% of it, the rule's share, in >= 6 of the 8
    # steps; the crowded host adds waits both ways) and rank 0 waits the delay per step
    group = {a.rank: a for a in per_group if a.group == tp[0]["group"]}
    assert set(group) == {0, 1} and group[1].steps_mostly_last >= 6, group
    assert group[1].imposed_us >= 0.75 * (group[0].imposed_us + group[1].imposed_us), group
    assert imposed_by_the_sleep(group[0].wait_us / group[0].steps / 1e3, slept), (group[0], slept)
    # gloo blocks the thread that issued the collective: rank 0's wait for rank 1 is exposed communication, not
    # overlapped by the autograd Functions around its TP collectives (it read 1.7 ms exposed for 61 ms of wait)
    ranks = {r["rank"]: r for r in t["ranks"]}
    assert ranks[0]["exposed_us"] >= 0.9 * ranks[0]["wait_us"] > 0, ranks[0]
    # rank 1's dp group (one DDP bucket per step) sees the delay second-hand, after the tp waits: it still
    # arrives last in most dp instances (>= the rule's 75%; one instance of 8 may go either way when the
    # host is loaded: seen 7 of 8 in a CI run beside other jobs)
    (dp,) = {a.group for a in per_group if a.scheme == "dp" and a.rank == 1}
    last = next(a for a in per_group if a.group == dp and a.rank == 1)
    assert last.instances >= 8 and last.arrived_last >= 0.75 * last.instances, last


def test_tp_without_delay_names_no_straggler(run_db: Callable[[str], Path]) -> None:
    t = report_time(run_db("dp-tp"), "dp-tp")
    assert t["stragglers"] == [], t["verdicts"]
    assert sorted(v["scheme"] for v in t["verdicts"]) == ["dp", "dp", "tp", "tp"]


def test_pp_delay_is_the_first_stage_exposed_p2p(
    run_db: Callable[[str], Path], planted: Callable[[str], float]
) -> None:
    """`--pp 2 --delay 1:MS`: the first stage's sends and receives wait for the sleeping last stage. gloo's P2P
    range on the caller's thread outlives the c10d op (its enqueue), and ends with the transfer: the calls'
    time is that range, so the wait is rank 0's exposed communication per step, and rank 1 has none of it
    (the call's time was the enqueue: rank 0 read 0.2 ms exposed and 71 ms idle per step)."""
    t = report_time(run_db("pp-delay"), "pp-delay")
    slept = planted("pp-delay")
    ranks = {r["rank"]: r for r in t["ranks"]}
    exposed = {rank: r["exposed_us"] / r["steps"] / 1e3 for rank, r in ranks.items()}
    assert imposed_by_the_sleep(exposed[0], slept), (exposed, slept)
    assert exposed[1] < 0.5 * slept, (exposed, slept)
    # nothing is matched (point-to-point only), and that is the reason given, not "no times (NCCL logs)"
    clocks = [p["reason"] for p in t["status"]["parts"] if p["part"] == "clocks"]
    assert clocks == [
        "no collective matched across ranks (point-to-point calls are not matched): no instance to align clocks by"
    ]
    (f,) = [f for f in findings_of(run_db("pp-delay"), "pp-delay") if f["id"].startswith("exposed-comm:pp")]
    assert f["evidence"]["wait_share"] is None and "point-to-point calls, which are not matched" in f["suggestion"]
