"""Timing findings on real runs: the planted straggler of `commlens harness --delay` (torchrun/gloo runs
shared by the session, tests/harness_runs.py, ingested into a store) and the 8-rank DLRM job's exposed
communication. A persistent straggler is named by arrival with the ms per step its peers wait; a run without delay raises no timing finding, the
same on every call; each finding links the steps, ranks and instances it rests on; the inputs stored at
ingest follow a scheme override."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import duckdb
import pytest
from harness_runs import DELAY_MS, HarnessRuns, named

from commlens import store
from commlens.backend.findings import findings
from commlens.contract.analysis import Finding
from commlens.harness import launch
from commlens.ingest.inputs import iter_inputs
from commlens.service.ingest import ingest_run
from commlens.service.schemes import override_scheme


@pytest.fixture(scope="module")
def harness_con(
    harness_runs: HarnessRuns, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], duckdb.DuckDBPyConnection]]:
    """A connection to the store holding the named straggler run (tests/harness_runs.py, launched once per
    session), ingested as `commlens harness --ingest` does; each run once, on first use."""
    db = tmp_path_factory.mktemp("findings-time") / "store.duckdb"
    done: set[str] = set()
    opened: list[duckdb.DuckDBPyConnection] = []

    def get(name: str) -> duckdb.DuckDBPyConnection:
        if name not in done:
            for c in opened:  # ingestion writes the store
                c.close()
            opened.clear()
            assert not launch.ingest_run(db, named(harness_runs.straggler(name), name)).failed
            done.add(name)
        if not opened:
            opened.append(store.connect(db))
        return opened[0]

    yield get
    for c in opened:
        c.close()


def _stragglers(found: list[Finding]) -> list[Finding]:
    return [f for f in found if f.id.startswith("straggler:")]


@pytest.mark.slow
def test_dp_delay_finding_names_rank_1_with_its_ms_per_step(harness_con) -> None:
    con = harness_con("dp-delay")
    found = findings(con, "dp-delay")
    (f,) = _stragglers(found)
    assert found[0] == f  # ranked by time: the straggler costs most
    assert f.evidence["rank"] == 1 and f.evidence["scheme"] == "dp" and f.severity == "high"
    assert f.title.startswith("Rank 1 is a persistent dp straggler: its peers wait ")
    assert f.ms_per_step == pytest.approx(DELAY_MS, rel=0.2) and f.evidence["wait_ms_per_step"] == f.ms_per_step
    assert f.step_share is not None and 0.5 < f.step_share < 1.0  # the sleep is most of the step
    assert f.evidence_text["wait_ms_per_step"].endswith(" ms") and f.evidence_text["arrived_last_share"] == "100%"
    assert f.stability is not None and f.stability.startswith("caused most of the group's wait in 8 of 8 steps")
    assert f.ranks == [0, 1] and f.steps == list(range(2, 10))
    # the instances it links are the group's, each one rank 1 arrived last in
    run_id = con.execute("SELECT run_id FROM runs WHERE name = 'dp-delay'").fetchall()[0][0]
    last = {
        i: (r, g)
        for i, r, g in con.execute(
            "SELECT instance_id, last_rank, group_key FROM time_instances WHERE run_id = ?", [run_id]
        ).fetchall()
    }
    assert len(f.instances) == 8 and {last[i] for i in f.instances} == {(1, f.evidence["group"])}
    # time inside collectives no longer names anybody: the arrival analysis replaces that finding
    assert not [x for x in found if x.id.endswith(":time_us")]


@pytest.mark.slow
def test_tp_delay_finding_names_rank_1_in_its_tp_group(harness_con) -> None:
    found = findings(harness_con("dp-tp-delay"), "dp-tp-delay")
    # rank 1's tp group is ranks 0 and 1 (the other, ranks 2 and 3, has nobody sleeping, though a crowded
    # host can make one of them a straggler of its own)
    tp = [f for f in _stragglers(found) if f.evidence["scheme"] == "tp" and f.ranks == [0, 1]]
    assert [f.evidence["rank"] for f in tp] == [1], [f.title for f in found]
    assert tp[0].evidence["imposed_ms_per_step"] == pytest.approx(DELAY_MS, rel=0.2)
    assert len(tp[0].steps) == 8 and tp[0].severity == "high"
    # rank 0 reaches its dp all-reduce last only because it waited for rank 1: it passes that wait on
    assert not [f for f in _stragglers(found) if f.evidence["rank"] == 0]


@pytest.mark.slow
def test_no_delay_names_no_straggler_and_the_same_findings_twice(harness_con) -> None:
    con = harness_con("dp")
    found = findings(con, "dp")
    # no straggler without a planted delay; exposed communication may be real on a CPU run (gloo's
    # all-reduce competes with compute for the same cores), so only its determinism is asserted
    assert not [f.id for f in found if f.id.startswith("straggler:")], [(f.id, f.stability) for f in found]
    assert findings(con, "dp") == found


def test_dlrm_exposed_communication_with_its_evidence(tmp_path: Path, data_dir: Path) -> None:
    con = store.connect(tmp_path / "dlrm.duckdb")
    ingest_run(con, "dlrm", iter_inputs([data_dir / "kineto-param" / "dlrm_kineto.tar.gz"]))
    found = {f.id: f for f in findings(con, "dlrm")}
    f = found["exposed-comm:unattributed"]
    # step 10 on 8 ranks, wait + exposed per rank (docs/time.md): rank 0 5,342 + 195 µs, rank 7 1,380 + 200 µs
    exposed = [5342 + 195, 10854 + 202, 3034 + 183, 9253 + 197, 6337 + 213, 6007 + 204, 3109 + 180, 1380 + 200]
    steps = [14455, 19901, 13017, 19313, 17979, 17797, 13091, 12509]
    assert f.ms_per_step == pytest.approx(sum(exposed) / 8 / 1e3)
    assert f.step_share == pytest.approx(sum(exposed) / sum(steps))
    assert f.evidence["wait_share"] == pytest.approx(
        sum(w for w in (5342, 10854, 3034, 9253, 6337, 6007, 3109, 1380)) / sum(exposed)
    )
    assert (f.steps, f.ranks) == ([10], list(range(8)))
    assert f.severity == "medium"  # 37% of the step is high, but one profiled step is thin evidence
    assert f.title == "unattributed: 5.86 ms of exposed communication per step (37% of the step, no compute running)"
    assert f.evidence_text["ms_per_step"] == "5.86 ms" and f.evidence_text["wait_share"] == "97%"
    assert f.stability == (
        "one profiled step (stability across steps unknown): 5.86 ms; 1.58 ms (rank 7) to 11.1 ms (rank 1) across 8 ranks"
    )
    assert "waiting for a late member" in f.suggestion and f.view == {"page": "time", "scheme": "unattributed"}
    # one step is no evidence of a straggler; nor of waits that rank 7 (12.5 ms step, 0.35 ms waiting in
    # the all_to_alls) barely shows: a single step counts only where every rank shows it
    assert not [i for i in found if i.startswith(("straggler:", "wait-dominated:"))]
    con.close()


@pytest.mark.slow
def test_an_override_moves_the_timing_findings_with_the_stored_inputs(harness_con) -> None:
    con = harness_con("dp-delay")
    (before,) = _stragglers(findings(con, "dp-delay"))
    group = before.evidence["group"]
    override_scheme(con, "dp-delay", group, "other", "test: the dp group pinned elsewhere")
    found = findings(con, "dp-delay")
    (after,) = _stragglers(found)
    # the same straggler and waits, now under the pinned scheme; no timing finding names dp any more
    assert (after.id, after.evidence["rank"], after.evidence["scheme"]) == (f"straggler:{group}", 1, "other")
    assert after.ms_per_step == pytest.approx(before.ms_per_step) and (after.steps, after.ranks) == (
        before.steps,
        before.ranks,
    )
    assert not [f.id for f in found if f.evidence.get("scheme") == "dp"]
