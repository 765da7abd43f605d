"""Findings a team can trust, on real data: the exact findings and severities of the ResNet-50 DDP trace,
the 8-rank DLRM job and the NCCL log excerpts (one run per job, and all in one run); suggestions that name
only views with data for the run; evidence for people; and the findings of two gloo harness runs of one
configuration the same."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest
from harness_runs import HarnessRuns, named

from commlens import store
from commlens.backend.findings import findings
from commlens.contract.analysis import Finding
from commlens.harness import launch
from commlens.ingest.inputs import iter_inputs
from commlens.service.ingest import ingest_run

# The checks this audit covers (the timing findings have their own tests: test_findings_time.py).
BYTE_BASED = ("small-messages:", "imbalance:", "low-busbw:", "zero-accumulation", "above-prediction:")


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[duckdb.DuckDBPyConnection]:
    from conftest import shared_data

    data = shared_data()
    con = store.connect(tmp_path_factory.mktemp("trust") / "s.duckdb")
    ingest_run(con, "resnet", iter_inputs([data / "kineto-hta" / "nccl_parser_config" / "nccl_data.json.gz"]))
    ingest_run(con, "dlrm", iter_inputs([data / "kineto-param" / "dlrm_kineto.tar.gz"]))
    ingest_run(con, "logs", iter_inputs([data / "nccl-logs"]), split_jobs=True)
    ingest_run(con, "merged", iter_inputs([data / "nccl-logs"]))  # what --one-run stores
    yield con
    con.close()


def _set(found: list[Finding]) -> set[tuple[str, str]]:
    return {(f.id, f.severity) for f in found}


def test_resnet50_and_dlrm_exact_findings(real: duckdb.DuckDBPyConnection) -> None:
    # ResNet-50 over 2 ranks: 5 gradient buckets and 2 buffer broadcasts a step, none small; the exposed
    # all-reduce time, 13.2 ± 4.9 ms of a 222 ms step on the one traced rank over 3 profiled steps, is too
    # few steps to tell (findings_time.MIN_STEPS): nothing
    assert _set(findings(real, "resnet")) == set()
    dlrm = {f.id: f for f in findings(real, "dlrm")}
    assert _set(list(dlrm.values())) == {
        ("exposed-comm:unattributed", "medium"),
        ("small-messages:unattributed", "medium"),
    }
    small = dlrm["small-messages:unattributed"]
    # 56 of 64 calls are small: the all_to_alls of embedding lookups below 64 KiB (their curve reaches half its best
    # at 8 KiB, still latency-bound, so the floor) and the all_reduces below the 1 MiB of theirs. Medium by calls,
    # not high: 64 calls of one profiled step
    assert small.title == "unattributed: 88% of calls and 97% of communication time are small, latency-bound messages"
    assert (small.evidence["calls"], small.evidence["small_calls"], small.evidence["ranks"]) == (64, 56, 8)
    assert small.evidence_text == {
        "calls": "64",
        "small_calls": "56",
        "small_call_share": "88%",
        "small_time_share": "97%",
        "small_time_us": "47.0 ms",
        "small_bytes": "7.42 MiB",
        "most_common_small_op": "all_to_all",
        "threshold": "below 1 MiB for all_reduce (the size where busbw reaches half its best, measured on the device "
        "in this run); below 64 KiB for all_to_all (the floor: this run's device curve reaches half its best at a "
        "smaller size, still latency-bound)",
        "threshold_bytes": "1 MiB",
        "threshold_bytes_min": "64 KiB",
        "ranks": "8",
    }
    assert small.stability == "small calls' share of time 94% to 99% across 8 rank(s)"
    assert small.ms_per_step == pytest.approx(47_010 / 8 / 1000) and small.view == {
        "page": "histograms",
        "scheme": None,
        "op": "all_to_all",
    }


def test_nccl_log_excerpts_raise_nothing_split_or_merged(real: duckdb.DuckDBPyConnection) -> None:
    """Excerpts of a few calls of a few ranks: no finding in any of the 19 runs but the collective mismatch of the
    rccl#429 hang report, and merged into one run no "uneven bytes across ranks" (their groups miss most of their
    ranks; 1193 is 3 ranks of 128)."""
    runs = [r[0] for r in real.execute("SELECT name FROM runs WHERE name LIKE 'logs%' ORDER BY 1").fetchall()]
    assert len(runs) == 19
    mismatch = {("collective-mismatch:communicator of 4 ranks (COLL lines only)", "high")}
    assert {run: _set(findings(real, run)) for run in runs} == {
        run: mismatch if run == "logs-rocm-rccl-429" else set() for run in runs
    }
    assert _set(findings(real, "merged")) == mismatch  # the one log with processes of 4-rank communicators


def test_suggestions_name_only_views_with_data(real: duckdb.DuckDBPyConnection) -> None:
    for run in ("resnet", "dlrm"):
        run_id = real.execute("SELECT run_id FROM runs WHERE name = ?", [run]).fetchall()[0][0]
        has = {
            "time": real.execute("SELECT count(*) FROM time_breakdown WHERE run_id = ?", [run_id]).fetchall()[0][0],
            "topology": real.execute("SELECT count(*) FROM nccl_topology WHERE run_id = ?", [run_id]).fetchall()[0][0],
            "bandwidth": real.execute("SELECT count(*) FROM bw_bins WHERE run_id = ?", [run_id]).fetchall()[0][0],
        }
        assert has["topology"] == 0  # profiler traces: no NCCL topology lines
        for f in findings(real, run):
            page = f.view["page"]
            assert has.get(str(page), 1), (run, f.id, page)
            assert "topology page" not in f.suggestion, (run, f.id)


def harness_prefetch(items: list[pytest.Item]) -> list[tuple[str, dict, int]]:
    """Both runs of the stability test (tests/harness_runs.py launches them in the background)."""
    from test_harness import SCHEMES, TINY

    if not any(item.name == "test_two_harness_runs_of_one_config_give_the_same_findings" for item in items):
        return []
    return [("tp", dict(TINY, **SCHEMES["tp"]), replica) for replica in (0, 1)]


def test_two_harness_runs_of_one_config_give_the_same_findings(harness_runs: HarnessRuns, tmp_path: Path) -> None:
    """Two real gloo runs of one configuration (CPU op times that move with the host's load) raise the same
    findings, timing ones included (those are raised only on stable evidence, findings_time._noise). The
    small tensor-parallel all-reduces (4 KiB activations) are found in both, with the same severity and
    evidence counts; neither the size threshold nor the severity rests on those times. The runs: test_harness's
    `tp` configuration, its session run (shared with test_harness) and a second launch of it."""
    from test_harness import SCHEMES, TINY

    db = tmp_path / "s.duckdb"
    for replica, run in enumerate(("a", "b")):
        launched = harness_runs("tp", dict(TINY, **SCHEMES["tp"]), replica=replica)
        assert not launch.ingest_run(db, named(launched, run)).failed
    con = duckdb.connect(str(db))
    try:
        every = {run: findings(con, run) for run in ("a", "b")}
    finally:
        con.close()
    # every finding, timing ones included, in both runs or in neither; each timing one states its stability
    assert {f.id for f in every["a"]} == {f.id for f in every["b"]}, [(f.id, f.stability) for f in every["a"]]
    timed = [f for f in every["a"] + every["b"] if not f.id.startswith(BYTE_BASED)]
    assert all(f.stability and isinstance(f.evidence["steps"], int) for f in timed), [f.id for f in timed]
    found = {run: {f.id: f for f in every[run] if f.id.startswith(BYTE_BASED)} for run in ("a", "b")}
    # per rank and profiled step 10 activation all-reduces of 4 KiB (4 per block, the embedding's and the head's)
    # and 3 of the loss's 128 B: 52 calls over 2 ranks and 2 steps, all small, low (under MEDIUM_CALLS calls)
    assert _set(list(found["a"].values())) == _set(list(found["b"].values())) == {("small-messages:tp", "low")}
    for run in ("a", "b"):
        tp = found[run]["small-messages:tp"]
        assert (tp.evidence["calls"], tp.evidence["small_calls"], tp.evidence["threshold_bytes"]) == (52, 52, 65536)
        assert tp.ms_per_step is None and tp.stability is not None and tp.stability.endswith("not used to rank it")
