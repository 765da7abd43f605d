"""`commlens report`'s time section (the command line, as scripts run it): in JSON the key "time" with
"ranks" and "stragglers", in Markdown a section per rank and the stragglers, on the real 8-rank DLRM
job, on a real torchrun/gloo harness run with a planted straggler, and on a run with no trace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import shared_data
from harness_runs import HarnessRuns, imposed_by_the_sleep, named

from commlens import store
from commlens.ingest.inputs import iter_inputs
from commlens.service.ingest import ingest_run

DLRM = "kineto-param/dlrm_kineto.tar.gz"


def report(db: Path, run: str, fmt: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "commlens.cli", "report", "--run", run, "--db", str(db), "--format", fmt],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,  # the failure is asserted with its output
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def dlrm_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    db = tmp_path_factory.mktemp("report-time") / "store.duckdb"
    con = store.connect(db)
    assert not ingest_run(con, "dlrm", iter_inputs([shared_data() / DLRM])).failed
    ingest_run(con, "log", iter_inputs([shared_data() / "nccl-logs" / "nvidia-nccl-1193.log"]))
    store.ensure_run(con, "empty", description="no files")
    con.close()
    return db


def test_json_time_ranks_and_stragglers_on_the_dlrm_job(dlrm_db: Path) -> None:
    t = json.loads(report(dlrm_db, "dlrm", "json"))["time"]
    assert [(r["rank"], r["steps"], r["instances"], r["arrived_last"], r["wait_us"]) for r in t["ranks"]] == [
        (0, 1, 8, 0, 5580.0),
        (1, 1, 8, 0, 11125.0),
        (2, 1, 8, 0, 3280.0),
        (3, 1, 8, 0, 9571.0),
        (4, 1, 8, 1, 6370.0),
        (5, 1, 8, 2, 6041.0),
        (6, 1, 8, 0, 3342.0),
        (7, 1, 8, 5, 1534.0),
    ]
    assert t["stragglers"] == []
    assert (t["instances"], t["mismatches"], t["status"]["available"]) == (8, 0, True)
    assert t["verdicts"][0]["reason"].endswith("1 step(s) with instances, consistency needs 4")
    # imposed: the other members' waits in the instances a rank arrived last in; they add up to all waits
    assert sum(r["imposed_us"] for r in t["ranks"]) == pytest.approx(sum(r["wait_us"] for r in t["ranks"]))


def test_markdown_time_section_on_the_dlrm_job(dlrm_db: Path) -> None:
    md = report(dlrm_db, "dlrm", "md")
    section = md.split("## Where the time goes", 1)[1].split("\n## ", 1)[0]
    assert "8 collective instances matched across ranks, 0 mismatch(es). Clocks: offsets within the noise" in section
    rows = {line.split(" | ")[0]: line for line in section.splitlines() if line.startswith("| ")}
    assert rows["| rank"].startswith("| rank | steps | step time (steps summed) | exposed comm |")  # a total, said so
    # rank 7: one 12,509 µs step, 1,380 µs waiting + 200 µs exposed, 166 µs overlapped, last in 5 of 8
    assert rows["| 7"].startswith("| 7 | 1 | 12.51 | 1.58 | 0.17 | 8 | 5 | 1.53 |")
    assert rows["| 0"].startswith("| 0 | 1 | 14.46 | 5.54 | 0.26 | 8 | 0 | 5.58 | 0.00 |")
    assert (
        "No straggler.\n- group `world` (calls whose files name no process group, matched as the default group's) "
        "(unattributed): no straggler: too few profiled steps to tell: 1 step(s)" in section
    )


def test_runs_without_timeline_say_why(dlrm_db: Path) -> None:
    # an NCCL log whose lines name no global rank: analysed, and the status says what stopped it
    t = json.loads(report(dlrm_db, "log", "json"))["time"]
    assert (t["ranks"], t["stragglers"], t["instances"]) == ([], [], 0)
    assert t["status"]["parts"] == [
        {"part": "matching", "computed": False, "reason": "no call of a known rank: nothing to match"}
    ]
    section = report(dlrm_db, "log", "md").split("## Where the time goes", 1)[1].split("\n## ", 1)[0]
    assert "Not computed (or only partly):\n\n- matching: no call of a known rank: nothing to match" in section
    assert "No rank has matched instances or profiled steps: the time analysis reads the calls of known" in section
    # a run without files has no analysis at all
    t = json.loads(report(dlrm_db, "empty", "json"))["time"]
    assert t["status"] == {"available": False, "parts": []} and t["ranks"] == []
    section = report(dlrm_db, "empty", "md").split("## Where the time goes", 1)[1]
    assert section.startswith("\n\nNo time analysis for this run (no trace with a timeline).")


def test_harness_straggler_in_json_and_markdown(harness_runs: HarnessRuns, tmp_path: Path) -> None:
    """`--dp 2 --delay 1:MS` on torchrun/gloo (8 profiled steps, shared by the session: tests/harness_runs.py):
    time.stragglers names rank 1 in dp."""
    from commlens.harness import launch

    db = tmp_path / "store.duckdb"
    assert not launch.ingest_run(db, named(harness_runs.straggler("dp-delay"), "late")).failed
    doc = json.loads(report(db, "late", "json"))
    t = doc["time"]
    # what the harness planted sits beside what was found (run.json's delays)
    assert doc["planted_delays"] == [{"rank": 1, "ms": 60.0, "phase": "forward"}]
    (s,) = t["stragglers"]
    assert (s["rank"], s["scheme"], s["verdict"], s["steps"], s["steps_consistent"]) == (1, "dp", "straggler", 8, 8)
    assert imposed_by_the_sleep(s["imposed_ms_per_step"], harness_runs.slept_ms("dp-delay")), s
    ranks = {r["rank"]: r for r in t["ranks"]}
    assert set(ranks) == {0, 1} and ranks[0]["steps"] == ranks[1]["steps"] == 8
    assert ranks[0]["instances"] == ranks[1]["instances"] > 0
    assert ranks[1]["arrived_last"] >= 0.9 * ranks[1]["instances"]
    assert ranks[0]["wait_us"] > ranks[1]["wait_us"]
    md = report(db, "late", "md")
    assert f"- **rank 1** (dp, group `{s['group']}`): last in " in md
    assert f"imposing {s['imposed_ms_per_step']:,.2f} ms per step." in md
    assert "- planted by the harness (run.json): rank 1 sleeps 60 ms before each step's forward" in md
