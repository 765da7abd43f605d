"""Timing findings on real runs: the planted straggler of `commlens harness --delay` (torchrun/gloo runs
shared by the session, tests/harness_runs.py, ingested into a store) and the 8-rank DLRM job's exposed
communication. A persistent straggler is named by arrival with the ms per step its peers wait; a run without delay raises no timing finding, the
same on every call; each finding links the steps, ranks and instances it rests on; the inputs stored at
ingest follow a scheme override. The stability rule on synthetic cells: too few steps, noise and an effect
near the floor raise nothing, a consistent effect is raised with its stability."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from math import sqrt
from pathlib import Path
from statistics import fmean, stdev

import duckdb
import pytest
from harness_runs import HarnessRuns, imposed_by_the_sleep, named

from commlens import store
from commlens.backend.findings import findings
from commlens.backend.findings_time import _Cells, _noise, _Rank, _timed
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
def test_dp_delay_finding_names_rank_1_with_its_ms_per_step(harness_con, harness_runs: HarnessRuns) -> None:
    con = harness_con("dp-delay")
    found = findings(con, "dp-delay")
    (f,) = _stragglers(found)
    assert found[0] == f  # ranked by time: the straggler costs most
    assert f.evidence["rank"] == 1 and f.evidence["scheme"] == "dp" and f.severity == "high"
    assert f.title.startswith("Rank 1 is a persistent dp straggler: its peers wait ")
    slept = harness_runs.slept_ms("dp-delay")
    assert imposed_by_the_sleep(f.ms_per_step, slept) and f.evidence["wait_ms_per_step"] == f.ms_per_step, (f, slept)
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
def test_tp_delay_finding_names_rank_1_in_its_tp_group(harness_con, harness_runs: HarnessRuns) -> None:
    con = harness_con("dp-tp-delay")
    found = findings(con, "dp-tp-delay")
    # rank 1's tp group is ranks 0 and 1 (the other, ranks 2 and 3, has nobody sleeping, though a crowded
    # host can make one of them a straggler of its own)
    tp = [f for f in _stragglers(found) if f.evidence["scheme"] == "tp" and f.ranks == [0, 1]]
    assert [f.evidence["rank"] for f in tp] == [1], [f.title for f in found]
    assert imposed_by_the_sleep(tp[0].evidence["imposed_ms_per_step"], harness_runs.slept_ms("dp-tp-delay")), tp[0]
    assert len(tp[0].steps) == 8 and tp[0].severity == "high"
    # rank 0 reaches its dp all-reduce last only because it waited for rank 1: it passes that wait on
    assert not [f for f in _stragglers(found) if f.evidence["rank"] == 0]
    # and the dp all-reduces' wait is rank 1's too: the wait-dominated cause discounts what rank 0 inherited
    causes = con.execute(
        """SELECT op, cause_rank FROM time_finding_keys JOIN runs USING (run_id)
           WHERE name = 'dp-tp-delay' AND kind = 'wait_dominated' AND key = 'dp'"""
    ).fetchall()
    assert ("all_reduce", 1) in causes and not [c for c in causes if c[1] == 0], causes
    # its title says whose mean its wait is (every rank's, the late one's none included), beside the straggler's
    # "its peers wait": the same wait read as two numbers
    waits = [f.title for f in found if f.id.startswith("wait-dominated:")]
    assert waits and all(" per rank per step waiting inside the collective " in t for t in waits), waits


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
        "one profiled step (stability across steps unknown): 5.86 ms; 1.58 ms (rank 7) to 11.1 ms (rank 1) across "
        "8 ranks, standard error 1.14 ms across them"
    )
    # its stability as evidence: too few steps for a spread across them, so the ranks are the replicates (5.86
    # ms less 3 standard errors is 2.43 ms, over 5% of the 16.0 ms mean step: raised)
    assert (f.evidence["steps"], f.evidence["ranks"], f.evidence["spread_across_steps_us"]) == (1, 8, None)
    assert f.evidence["spread_across_ranks_us"] == pytest.approx(stdev(exposed))
    assert f.evidence["standard_error_us"] == pytest.approx(stdev(exposed) / sqrt(8))
    assert f.evidence_text["standard_error_us"] == "1.14 ms" and "spread_across_steps_us" not in f.evidence_text
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


# ------------------------------------------------------------------------- the stability rule, synthetic


def _cells(values: dict[int, list[float]], step_us: float = 100_000.0) -> _Cells:
    """Cells of a quantity (µs per (rank, step)) against a fixed step, summarised as the ingest stores them."""
    ranks = {
        r: _Rank(len(v), sum(v), sum((x - fmean(v)) ** 2 for x in v), step_us * len(v), min(v) < 0.05 * step_us)
        for r, v in values.items()
    }
    n_steps = max(len(v) for v in values.values())
    return _Cells(ranks, n_steps, lambda: list(range(n_steps)))


def _exposed(cells: _Cells) -> Finding | None:
    return _timed("exposed-comm:dp", "{ms} ({share})", cells, {}, {"page": "time"}, "overlap")


def test_too_few_steps_raise_nothing() -> None:
    # 20 ms of a 100 ms step on each of 2 ranks, the same in each of 3 steps: a spread needs 4 steps
    cells = _cells({0: [20_000.0] * 3, 1: [20_000.0] * 3})
    assert _noise(cells) == (
        "too few profiled steps to tell: 3 step(s) on 2 rank(s); a spread across steps needs 4 steps (or 8 ranks "
        "that each show it)"
    )
    assert _exposed(cells) is None
    # one step on 8 ranks is evidence only when every rank shows 5% of its step
    assert _noise(_cells({r: [20_000.0 if r else 4_000.0] for r in range(8)})) == (
        "too few profiled steps to tell, and ranks [0] show under 5.0% of a step"
    )


def test_noise_raises_nothing() -> None:
    # 20 ms on average, but 5 or 35 ms step by step over 8 steps: a spread of 16.0 ms, a standard error of
    # 5.67 ms, and 20 ms less 3 of those is 3.0 ms, under 5% of the 100 ms step
    assert _noise(_cells({0: [5_000.0, 35_000.0] * 4, 1: [35_000.0, 5_000.0] * 4})) == (
        "20.0 ms less 3 standard errors of 5.67 ms is under 5.0% of the step (5.00 ms)"
    )
    # the same swing on 40 ms of the step is evidence: 55 ms less 3 x 5.67 ms is well above the floor
    assert _noise(_cells({0: [40_000.0, 70_000.0] * 4, 1: [70_000.0, 40_000.0] * 4})) is None
    # 6.25 ms ± 2.63 ms over 4 steps: over 5% of the step, but its mean less 3 standard errors (1.31 ms) is
    # 2.30 ms, under 5% of the 100 ms step: an effect this near the floor comes and goes from run to run
    cells = _cells({0: [4_000.0, 9_000.0, 4_000.0, 8_000.0], 1: [4_000.0, 9_000.0, 4_000.0, 8_000.0]})
    assert _noise(cells) == "6.25 ms less 3 standard errors of 1.31 ms is under 5.0% of the step (5.00 ms)"
    assert _exposed(cells) is None


def test_consistent_effect_is_raised_with_its_stability() -> None:
    # 20 ms ± 1 ms on rank 0 and 30 ms ± 1 ms on rank 1, over 8 steps: 25% of the step, high
    cells = _cells({0: [19_000.0, 21_000.0] * 4, 1: [29_000.0, 31_000.0] * 4})
    assert _noise(cells) is None
    f = _exposed(cells)
    assert f is not None and (f.id, f.severity, f.ms_per_step) == ("exposed-comm:dp", "high", 25.0)
    assert f.stability == (
        "25.0 ms ± 1.07 ms per step over 8 steps, standard error 378 µs; 20.0 ms (rank 0) to 30.0 ms (rank 1) "
        "across 2 ranks"
    )
    assert (f.evidence["steps"], f.evidence["ranks"]) == (8, 2)
    assert f.evidence["spread_across_steps_us"] == pytest.approx(sqrt(8 / 7) * 1_000)
    assert f.evidence["spread_across_ranks_us"] == pytest.approx(stdev([20_000.0, 30_000.0]))
    assert f.evidence["standard_error_us"] == pytest.approx(sqrt(8 / 7) * 1_000 / sqrt(8))
    # one step on 8 ranks that each show it: raised, one level lower (thin evidence across steps)
    one = _exposed(_cells({r: [30_000.0 + 1_000 * r] for r in range(8)}))
    assert one is not None and one.severity == "medium" and one.evidence["steps"] == 1


def test_exposed_communication_of_one_ranks_trace_leaves_its_wait_unknown(tmp_path: Path, data_dir: Path) -> None:
    """Rank 0's trace of a 16-rank job: nothing to match its collectives with, so how much of its exposed
    communication is waiting is unknown; it read "wait share 0%", as if overlap would remove all of it."""
    con = store.connect(tmp_path / "nq.duckdb")
    trace = data_dir / "kineto-hta/negative_queue_length_values_check/rank0.json.gz"
    ingest_run(con, "nq", iter_inputs([trace]))
    (f,) = [f for f in findings(con, "nq") if f.id.startswith("exposed-comm:")]
    assert f.evidence["wait_share"] is None and f.evidence["wait_ms_per_step"] is None
    assert "wait_share" not in f.evidence_text and f.ranks == [0]
    assert f.suggestion.endswith(
        "waits need the calls of the other members of its collectives matched call by call, and none of this "
        "scheme's was (one rank's trace, or point-to-point calls, which are not matched)."
    )
    con.close()
