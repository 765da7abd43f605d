"""The time analysis in the store: computed at ingest (commlens.service.ingest -> backend.timing.persist)
into the time tables of a real DuckDB file, on real traces and logs, bad inputs, and the 3 -> 4 upgrade."""

from __future__ import annotations

import itertools
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest
from conftest import shared_data

from commlens import store
from commlens.backend.timing.breakdown import comm_comp_overlap
from commlens.backend.timing.persist import load_run, persist_run
from commlens.ingest.inputs import iter_inputs
from commlens.service.ingest import ingest_run
from commlens.store.tables import TIME_TABLES

DLRM = "kineto-param/dlrm_kineto.tar.gz"
RESNET = "kineto-hta/nccl_parser_config/nccl_data.json.gz"


def _ingest(db: Path, run: str, *paths: Path) -> duckdb.DuckDBPyConnection:
    con = store.connect(db)
    report = ingest_run(con, run, iter_inputs(list(paths)))
    assert all(f.status == "ok" for f in report.files), [f.error for f in report.files]
    return con


def _run_id(con: duckdb.DuckDBPyConnection, run: str) -> int:
    return int(con.execute("SELECT run_id FROM runs WHERE name = ?", [run]).fetchall()[0][0])


def _status(con: duckdb.DuckDBPyConnection, run: str) -> dict[str, list[tuple[bool, str]]]:
    out: dict[str, list[tuple[bool, str]]] = {}
    for part, ok, reason in con.execute(
        "SELECT part, ok, reason FROM time_status WHERE run_id = ? ORDER BY part, reason", [_run_id(con, run)]
    ).fetchall():
        out.setdefault(part, []).append((ok, reason))
    return out


@pytest.fixture(scope="module")
def dlrm_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    db = tmp_path_factory.mktemp("time") / "dlrm.duckdb"
    _ingest(db, "dlrm", shared_data() / DLRM).close()
    return db


@pytest.fixture
def dlrm(dlrm_db: Path) -> Iterator[duckdb.DuckDBPyConnection]:
    con = store.connect(dlrm_db, read_only=True)
    yield con
    con.close()


@pytest.fixture
def dlrm_copy(dlrm_db: Path, tmp_path: Path) -> Iterator[duckdb.DuckDBPyConnection]:
    """A writable copy of the DLRM store, for planting bad input."""
    db = tmp_path / "copy.duckdb"
    shutil.copy(dlrm_db, db)
    con = store.connect(db)
    yield con
    con.close()


# ------------------------------------------------------------------------------------ DLRM, 8 ranks


def test_dlrm_every_instance_matched_on_all_8_ranks(dlrm: duckdb.DuckDBPyConnection) -> None:
    rows = dlrm.execute(
        "SELECT op, members, keyed_by, last_rank, skew_us, real_us FROM time_instances ORDER BY instance_id"
    ).fetchall()
    assert [r[0] for r in rows].count("all_to_all") == 5 and [r[0] for r in rows].count("all_reduce") == 3
    assert {(r[1], r[2]) for r in rows} == {(8, "order")}  # 2023 traces record no PyTorch Seq
    assert [r[3] for r in rows] == [7, 7, 7, 7, 7, 5, 5, 4]
    assert rows[0][4] == pytest.approx(7624.0) and rows[4][5] == pytest.approx(86.0)
    assert dlrm.execute("SELECT count(*) FROM time_mismatches").fetchall() == [(0,)]
    assert dlrm.execute("SELECT count(*) FROM time_unmatched").fetchall() == [(0,)]
    # every member joins its comm_events row, with the same op, and waits for the last arrival
    members = dlrm.execute(
        """
        SELECT m.instance_id, m.rank, m.wait_us, i.last_arrival_ref_us - m.arrival_ref_us, e.op = i.op
        FROM time_instance_members m JOIN time_instances i USING (run_id, instance_id)
        JOIN comm_events e ON e.run_id = m.run_id AND e.source_id = m.source_id AND e.seq = m.seq
        ORDER BY 1, 2
        """
    ).fetchall()
    assert len(members) == 64 and all(r[4] for r in members)
    assert all(r[2] == pytest.approx(r[3]) for r in members)
    assert members[1][:3] == (0, 1, pytest.approx(7624.0)) and members[7][2] == 0.0
    calls = dlrm.execute(
        "SELECT count(*), count(dev_start_us), count(cpu_start_us), count(match_key), "
        "count(*) FILTER (WHERE dev_start_us = ts_us AND dev_end_us = ts_us + dur_us) FROM comm_events"
    ).fetchall()
    assert calls == [(64, 64, 64, 0, 64)]  # arrivals are the kernels' starts


def test_dlrm_breakdown_rows_sum_to_the_step(dlrm: duckdb.DuckDBPyConnection) -> None:
    rows = dlrm.execute(
        "SELECT rank, step, step_us, compute_us + overlapped_us + wait_us + exposed_us + memcpy_us + idle_us, "
        "overlapped_us + wait_us + exposed_us FROM time_breakdown WHERE scheme IS NULL ORDER BY rank"
    ).fetchall()
    assert [(r[0], r[1]) for r in rows] == [(r, 10) for r in range(8)]
    assert all(r[3] == pytest.approx(r[2]) and r[2] > 0 for r in rows)
    assert rows[0][2] == pytest.approx(14455.0)
    comm_by_scheme = dict(
        dlrm.execute(
            "SELECT rank, sum(overlapped_us + wait_us + exposed_us) FROM time_breakdown "
            "WHERE scheme IS NOT NULL GROUP BY rank"
        ).fetchall()
    )
    assert all(comm_by_scheme[r[0]] == pytest.approx(r[4]) for r in rows)  # the scheme rows split the total


def test_dlrm_clock_offsets_reported(dlrm: duckdb.DuckDBPyConnection) -> None:
    rows = dlrm.execute(
        "SELECT rank, domain, offset_us, instances, applied, trusted, reason FROM time_clock_offsets ORDER BY rank"
    ).fetchall()
    assert [r[0] for r in rows] == list(range(8))
    assert all(r[2] == 0.0 and r[3] == 8 and not r[4] and r[5] for r in rows)
    assert rows[3][1] == "rank3" and "one shared clock" in rows[3][6]
    status = _status(dlrm, "dlrm")
    assert all(ok for part in status.values() for ok, _ in part)
    assert (True, "8 instances matched (0 by key, 8 by call order)") in status["matching"]


def test_dlrm_rank_totals_memcpy_stragglers_and_path(dlrm: duckdb.DuckDBPyConnection) -> None:
    totals = dlrm.execute(
        "SELECT rank, steps, instances, arrived_last, wait_us, imposed_us FROM time_rank_totals ORDER BY rank"
    ).fetchall()
    assert [t[3] for t in totals] == [0, 0, 0, 0, 1, 2, 0, 5] and {(t[1], t[2]) for t in totals} == {(1, 8)}
    assert sum(t[4] for t in totals) == pytest.approx(sum(t[5] for t in totals))  # every wait is imposed once
    memcpy = dlrm.execute(
        "SELECT direction, bytes, busy_us, gbps FROM time_memcpy WHERE rank = 0 ORDER BY direction"
    ).fetchall()
    assert [m[0] for m in memcpy] == ["dtod", "dtoh", "htod"] and memcpy[2][1] == 31112
    assert all(m[3] == pytest.approx(m[1] / m[2] / 1e3) for m in memcpy)
    assert dlrm.execute("SELECT straggler, rank, reason FROM time_stragglers").fetchall() == [
        (False, None, "no straggler: too few profiled steps to tell: 1 step(s) with instances, consistency needs 4")
    ]
    path = dlrm.execute("SELECT step, end_ref_us - start_ref_us, note FROM time_critical_path").fetchall()
    segs = dlrm.execute("SELECT start_ref_us, end_ref_us FROM time_critical_segments ORDER BY seg").fetchall()
    assert len(path) == 1 and path[0][0] == 10 and path[0][2] is None
    assert all(a[0] == pytest.approx(b[1]) for a, b in itertools.pairwise(segs))  # contiguous, back


# ------------------------------------------------------------------------------- ResNet-50 vs HTA


def test_resnet_overlap_from_the_stored_intervals_equals_hta(tmp_path: Path) -> None:
    """HTA's get_comm_comp_overlap on this file: 15.14 % (include_last_profiler_step) and 14.31 %
    (its default, which drops the last step: ours before that step's start); see test_timing_dlrm."""
    con = _ingest(tmp_path / "r.duckdb", "resnet", shared_data() / RESNET)
    data = load_run(con, _run_id(con, "resnet"))
    (rank,) = data.ranks.values()
    assert rank.has_device and rank.steps.step.tolist() == [4, 5, 6]
    assert not len(rank.intervals)  # read when the analysis reaches the rank, not held for the run
    intervals = data.intervals(rank.rank)
    assert 100 * (comm_comp_overlap(intervals) or 0) == pytest.approx(15.14, abs=0.5)
    last = max(rank.steps.start)
    assert 100 * (comm_comp_overlap(intervals, before=last) or 0) == pytest.approx(14.31, abs=0.5)
    # one rank of a 2-rank job: nothing to match, and the status says why; the breakdown is there
    assert (False, "21 calls not matched: group pg:0: members [1] have no trace") in _status(con, "resnet")["matching"]
    assert con.execute("SELECT count(*) FROM time_breakdown WHERE scheme IS NULL").fetchall() == [(3,)]
    con.close()


# ------------------------------------------------------------------------------------- NCCL logs


def _nccl_log(path: Path, op_counts: dict[int, list[int]]) -> Path:
    """A 2-rank NCCL log: Init lines of one communicator, then each rank's AllReduce calls."""
    lines = [
        f"node1:{100 + r}:{200 + r} [{r}] NCCL INFO comm 0x55{r:02d} rank {r} nranks 2 cudaDev {r} "
        f"nvmlDev {r} busId {r}000 commId 0xabcdef - Init COMPLETE"
        for r in op_counts
    ]
    for r, counts in op_counts.items():
        lines += [
            f"node1:{100 + r}:{200 + r} [{r}] NCCL INFO AllReduce: opCount {c:x} sendbuff 0x7f00 recvbuff 0x7f00 "
            f"count {1024 * (i + 1)} datatype 7 op 0 root 0 comm 0x55{r:02d} [nranks=2] stream 0x7e00"
            for i, c in enumerate(counts)
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_nccl_log_instances_by_opcount(tmp_path: Path) -> None:
    # rank 1 lacks opCount 3: keyed matching pairs the rest and reports the gap with both sides
    log = _nccl_log(tmp_path / "job.log", {0: [1, 2, 3, 4], 1: [1, 2, 4]})
    con = _ingest(tmp_path / "n.duckdb", "nccl", log)
    rows = con.execute("SELECT match_key, keyed_by, members, skew_us FROM time_instances ORDER BY 1").fetchall()
    assert [r[0] for r in rows] == [1, 2] and {r[1:] for r in rows} == {("key", 2, None)}
    # opCount 4 pairs 4096 B (rank 0's 4th call) with 3072 B (rank 1's 3rd): both sides are reported
    assert con.execute(
        "SELECT position, reason, rank_a, side_a, rank_b, side_b FROM time_mismatches ORDER BY position"
    ).fetchall() == [
        (3, "missing on a member", 0, "seq 2: all_reduce float32 12288 B", 1, None),
        (4, "sizes disagree", 0, "seq 3: all_reduce float32 16384 B", 1, "seq 2: all_reduce float32 12288 B"),
    ]
    status = _status(con, "nccl")
    assert (False, "the calls carry no times (NCCL logs): no arrivals, skew or waits") in status["waits"]
    assert (False, "1 calls missing on some members: instances missing on some ranks") in status["matching"]
    con.close()


def test_nccl_log_zero_opcount_falls_back_to_order(tmp_path: Path) -> None:
    log = _nccl_log(tmp_path / "job.log", {0: [0, 0, 0], 1: [0, 0, 0]})  # NCCL 2.27+ logs opCount 0
    con = _ingest(tmp_path / "n.duckdb", "nccl", log)
    assert con.execute("SELECT match_key, keyed_by, members FROM time_instances ORDER BY 1").fetchall() == [
        (0, "order", 2),
        (1, "order", 2),
        (2, "order", 2),
    ]
    con.close()


def test_shared_nccl_excerpt_without_ranks_says_why(tmp_path: Path) -> None:
    con = _ingest(tmp_path / "n.duckdb", "excerpt", shared_data() / "nccl-logs/nvidia-nccl-203.log")
    assert _status(con, "excerpt") == {"matching": [(False, "no call of a known rank: nothing to match")]}
    assert con.execute("SELECT count(*) FROM time_instances").fetchall() == [(0,)]
    con.close()


# ------------------------------------------------------------------------------------- bad input


def test_clocks_that_cannot_be_aligned(dlrm_copy: duckdb.DuckDBPyConnection) -> None:
    """Ranks 4-7 on another host whose end times disagree by +-1 ms from call to call: no offset is
    applied, skew and waits are not computed, and the breakdown still is."""
    run_id = _run_id(dlrm_copy, "dlrm")
    for r in range(8):
        dlrm_copy.execute(
            "INSERT INTO nccl_comms (run_id, source_id, group_key, host, global_rank) VALUES (?, 0, 'x', ?, ?)",
            [run_id, "a" if r < 4 else "b", r],
        )
    dlrm_copy.execute(
        "UPDATE comm_events SET ts_us = ts_us + CASE WHEN seq % 2 = 0 THEN 1000 ELSE -1000 END WHERE rank >= 4"
    )
    persist_run(dlrm_copy, run_id)
    status = _status(dlrm_copy, "dlrm")
    ((ok, reason),) = status["clocks"]
    assert not ok and reason.startswith("clocks not aligned: b: end differences spread")
    assert not any(ok for ok, _ in status["waits"])
    assert dlrm_copy.execute("SELECT count(*), count(skew_us) FROM time_instances").fetchall() == [(8, 0)]
    assert dlrm_copy.execute("SELECT DISTINCT applied, trusted FROM time_clock_offsets").fetchall() == [(False, False)]
    assert dlrm_copy.execute("SELECT count(*) FROM time_breakdown WHERE scheme IS NULL").fetchall() == [(8,)]


def test_an_instance_missing_on_a_rank(dlrm_copy: duckdb.DuckDBPyConnection) -> None:
    run_id = _run_id(dlrm_copy, "dlrm")
    dlrm_copy.execute("DELETE FROM comm_events WHERE rank = 3 AND seq = 7")  # rank 3's last all_reduce
    persist_run(dlrm_copy, run_id)
    assert dlrm_copy.execute(
        "SELECT position, reason, rank_a, side_a, rank_b, side_b FROM time_mismatches"
    ).fetchall() == [(7, "missing on a member", 0, "seq 7: all_reduce float32 907840 B", 3, None)]
    assert dlrm_copy.execute("SELECT count(*), count(skew_us) FROM time_instances").fetchall() == [(7, 7)]
    assert (False, "1 calls missing on some members: instances missing on some ranks") in _status(dlrm_copy, "dlrm")[
        "matching"
    ]
    assert dlrm_copy.execute("SELECT count(*) FROM time_breakdown WHERE scheme IS NULL").fetchall() == [(8,)]


def test_a_trace_without_device_activity(tmp_path: Path) -> None:
    con = _ingest(tmp_path / "c.duckdb", "cpu", shared_data() / "kineto-hta/rank_non_gpu/rank_non_gpu.json.gz")
    # its 6 NCCL calls record only their enqueue (no duration): the CPU ops are its only activity
    kinds = con.execute("SELECT kind, count(*) FROM timeline_intervals GROUP BY kind").fetchall()
    assert kinds == [("compute", 901)]  # 942 before the calls' enqueue time was taken out of their thread's ops
    status = _status(con, "cpu")
    # said once (the timeline's note and the breakdown's were two rows), and what fails is said apart
    assert [r for _, r in status["breakdown"] if "no device activity" in r] == [
        "rank 0: no device activity: compute is CPU ops, communication the calls' CPU time"
    ]
    assert any(not ok and "6 of 6 calls have no measured duration" in r for ok, r in status["breakdown"])
    assert any(not ok and "no device activity on ranks" in reason for ok, reason in status["memcpy"])
    assert con.execute("SELECT count(*) FROM time_memcpy").fetchall() == [(0,)]
    con.close()


# ------------------------------------------------------------------------------------- migration


def _make_v3(path: Path) -> None:
    """A schema-3 store as the previous commlens made it (no time columns or tables), with one run."""
    v3 = store.schema_sql()
    for version, steps in store.MIGRATIONS.items():
        for ddl in steps:
            if version >= 3 and ddl.startswith("CREATE"):
                v3 = v3.replace(ddl, "")
    v3 = re.sub(r"\n    (match_key|cpu_start_us|cpu_end_us|dev_start_us|dev_end_us) [^\n]*", "", v3)
    assert "timeline_intervals" not in v3 and "dev_end_us" not in v3 and "time_status" not in v3
    con = duckdb.connect(str(path))
    con.execute(v3)
    con.execute("INSERT INTO meta VALUES ('schema_version', '3')")
    con.execute("INSERT INTO runs (name) VALUES ('old')")
    for r in (0, 1):
        con.execute(
            "INSERT INTO sources (run_id, path, kind, sha256, size_bytes, rank, status) "
            "VALUES (1, ?, 'kineto', ?, 1, ?, 'ok')",
            [f"r{r}.json", f"sha{r}", r],
        )
        for seq in range(6):
            t = 1000.0 * seq + 50 * r
            con.execute(
                "INSERT INTO comm_events (run_id, source_id, rank, seq, op, dtype, msg_bytes, group_size, ts_us, dur_us) "
                "VALUES (1, ?, ?, ?, 'all_reduce', 'float32', 4096, 2, ?, ?)",
                [r + 1, r, seq, t, 100.0 - 50 * r],
            )
    con.close()


def test_upgrade_from_schema_3(tmp_path: Path) -> None:
    db = tmp_path / "v3.duckdb"
    _make_v3(db)
    with pytest.raises(store.StoreError, match="schema version 3"):
        store.connect(db, read_only=True)
    con = store.connect(db)
    assert con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchall() == [
        (str(store.SCHEMA_VERSION),)
    ]
    assert con.execute("SELECT count(*), count(match_key), count(dev_start_us) FROM comm_events").fetchall() == [
        (12, 0, 0)
    ]
    assert all(con.execute(f"SELECT count(*) FROM {t}").fetchall() == [(0,)] for t in TIME_TABLES)
    persist_run(con, 1)  # what the run's next ingest does: its calls' CPU-era times suffice to match
    rows = con.execute(
        "SELECT keyed_by, members, last_rank, skew_us FROM time_instances ORDER BY instance_id"
    ).fetchall()
    assert rows == [("order", 2, 1, pytest.approx(50.0))] * 6
    assert con.execute("SELECT count(*) FROM comms").fetchall() == [(12,)]
    con.close()


def test_a_scheme_override_recomputes_the_time_tables(tmp_path: Path) -> None:
    """The time tables carry each call's scheme: pinning a communicator's scheme re-labels its instances at
    once, and dropping the pin restores what the evidence says."""
    from commlens.service.schemes import clear_scheme_override, override_scheme

    con = _ingest(tmp_path / "n.duckdb", "nccl", _nccl_log(tmp_path / "job.log", {0: [1, 2, 3], 1: [1, 2, 3]}))
    run_id = _run_id(con, "nccl")
    (group, before), *rest = con.execute(
        "SELECT group_key, any_value(scheme) FROM time_instances WHERE run_id = ? GROUP BY group_key", [run_id]
    ).fetchall()
    assert rest == []

    def schemes() -> list[tuple[str | None, int]]:
        return con.execute(
            "SELECT scheme, count(*) FROM time_instances WHERE run_id = ? AND group_key = ? GROUP BY scheme",
            [run_id, group],
        ).fetchall()

    target = "tp" if before != "tp" else "pp"
    override_scheme(con, "nccl", group, target, "the job's tensor-parallel communicator")
    assert schemes() == [(target, 3)]
    clear_scheme_override(con, "nccl", group)
    assert schemes() == [(before, 3)]
    con.close()


def test_deleting_a_run_leaves_no_row_in_any_of_its_tables(dlrm_copy: duckdb.DuckDBPyConnection) -> None:
    """The one list of a run's tables covers the time analysis and the findings' inputs computed at ingest."""
    from commlens.service.runs import delete_run
    from commlens.store.tables import RUN_TABLES, TIME_FINDING_TABLES

    run_id = _run_id(dlrm_copy, "dlrm")
    filled = [
        t
        for t in RUN_TABLES
        if dlrm_copy.execute(f"SELECT count(*) FROM {t} WHERE run_id = ?", [run_id]).fetchall()[0][0]
    ]
    assert {"comm_events", "timeline_intervals", "time_instances", *TIME_FINDING_TABLES} <= set(filled)
    delete_run(dlrm_copy, "dlrm")
    assert [
        t
        for t in RUN_TABLES
        if dlrm_copy.execute(f"SELECT count(*) FROM {t} WHERE run_id = ?", [run_id]).fetchall()[0][0]
    ] == []


def test_compute_less_the_collectives_of_its_thread() -> None:
    """subtract_intervals: what an enclosing op computes is its span outside its thread's collectives."""
    import numpy as np

    from commlens.ingest.kineto_timeline import subtract_intervals

    keep_s, keep_e = np.array([0.0, 10.0, 30.0]), np.array([5.0, 20.0, 40.0])
    cut_s, cut_e = np.array([2.0, 12.0, 18.0, 35.0, 60.0]), np.array([3.0, 14.0, 25.0, 50.0, 70.0])
    s, e = subtract_intervals(keep_s, keep_e, cut_s, cut_e)
    assert list(zip(s.tolist(), e.tolist(), strict=True)) == [(0, 2), (3, 5), (10, 12), (14, 18), (30, 35)]
    s, e = subtract_intervals(np.array([1.0]), np.array([2.0]), np.array([0.0]), np.array([3.0]))
    assert len(s) == len(e) == 0  # wholly inside a collective
    s, e = subtract_intervals(keep_s, keep_e, np.zeros(0), np.zeros(0))
    assert s is keep_s and e is keep_e


def test_per_rank_notes_are_said_once_with_their_ranks() -> None:
    """A gloo run's every rank said 'no device activity' twice (the timeline's note and the breakdown's), each
    as a part not computed, though its breakdown is of CPU times."""
    from commlens.backend.timing.persist import _per_rank_notes

    cpu = "no device activity: compute is CPU ops, communication the calls' CPU time"
    gloo = "no device activity: communication is the collectives' CPU time (gloo), compute the other CPU ops"
    notes = [f"rank {r}: {n}" for r in (0, 1, 2, 5) for n in (cpu, gloo)] + ["rank ?: no profiler steps", "plain"]
    assert _per_rank_notes(notes) == [
        (f"ranks 0-2, 5: {cpu}", True),
        ("rank ?: no profiler steps", False),
        ("plain", False),
    ]
