"""Per-run aggregates (commlens/store/aggregates.py) equal a direct computation over the calls: after ingest,
after scheme attribution and an override, after new files land, and after a schema-1 store is upgraded."""

from __future__ import annotations

import statistics
from pathlib import Path

import duckdb
import pytest
from synthetic import write_rows as write

from commlens import store
from commlens.backend.attribution import attribute_run, attribution_summary, clear_override, set_override
from commlens.backend.bandwidth import bandwidth
from commlens.backend.compare import compare
from commlens.backend.findings import findings
from commlens.backend.histograms import histogram
from commlens.backend.iterations import assign_iterations
from commlens.backend.ranks import rank_totals
from commlens.store import aggregates
from commlens.vocab import busbw_factor

MiB = 1 << 20


def ev(
    rank,
    seq: int,
    op: str,
    size,
    group: str | None,
    n: int = 2,
    dur=None,
    src="kernel",
    step=None,
    process: str | None = None,
    dtype: str = "float32",
) -> dict:
    return {
        "rank": rank,
        "process": process or f"r{rank}",
        "seq": seq,
        "op": op,
        "dtype": dtype,
        "msg_bytes": size,
        "group_size": n,
        "group_key": group,
        "dur_us": dur,
        "dur_source": src if dur is not None else None,
        "step": step,
    }


def group(key: str, ranks: list[int], backend: str = "cuda:nccl") -> dict:
    return {"group_key": key, "ranks": ranks, "size": len(ranks), "origin": "pg_config", "backend": backend}


def grid_run(con, run: str = "grid", extra_small: int = 0) -> None:
    """4 ranks x 3 profiler steps: tp {0,1},{2,3} many small all_reduces, dp {0,2},{1,3} big ones, pp
    sends; kernel durations that differ per rank; a setup call outside the steps and one without a group."""
    groups = [
        group("pg:tpA", [0, 1]),
        group("pg:tpB", [2, 3]),
        group("pg:dpA", [0, 2]),
        group("pg:dpB", [1, 3]),
        group("pg:pp", [0, 1, 2, 3]),
    ]
    for rank in range(4):
        tp, dp = ("pg:tpA" if rank < 2 else "pg:tpB"), ("pg:dpA" if rank % 2 == 0 else "pg:dpB")
        events, seq = [ev(rank, 0, "broadcast", 4096, "pg:pp", n=4, dur=5.0)], 1
        for step in range(3):
            for i in range(6 + extra_small):
                events.append(ev(rank, seq, "all_reduce", 8192 + 64 * i, tp, dur=10.0 + rank + i, step=step))
                seq += 1
            for i in range(2):
                events.append(ev(rank, seq, "all_reduce", 16 * MiB, dp, dur=900.0 + 10 * rank + i, step=step))
                seq += 1
            events.append(
                ev(rank, seq, "send" if rank % 2 == 0 else "recv", 2 * MiB, "pg:pp", n=4, dur=80.0 + rank, step=step)
            )
            seq += 1
        events.append(ev(rank, seq, "all_reduce", 8, None, dur=3.0, step=2))
        steps = [{"rank": rank, "step": s, "ts_us": float(s), "dur_us": 1.0} for s in range(3)]
        write(con, run, events, groups if rank == 0 else [], steps=steps, rank=rank)


def log_run(con, run: str = "log") -> None:
    """One NCCL-log process: dp = setup broadcast + 3 x all_reduce; tp = 3 x 2 micro-batches x
    (all_gather, reduce_scatter), plus one trailing all_gather outside the last complete iteration."""
    events, seq = [], 0

    def add(op, size, comm):
        nonlocal seq
        events.append(ev(None, seq, op, size, comm, n=4, process="host:17"))
        seq += 1

    add("broadcast", 4096, "nccl:dp")
    for _ in range(3):
        for _ in range(2):
            add("all_gather", MiB, "nccl:tp")
            add("reduce_scatter", MiB, "nccl:tp")
        add("all_reduce", 8 * MiB, "nccl:dp")
    add("all_gather", MiB, "nccl:tp")
    write(con, run, events, kind="nccl_log")


# ------------------------------------------------------------------------ direct computations


def run_id(con, run: str) -> int:
    return store.get_run_id(con, run)


def direct_calls(con, run: str) -> dict[tuple, tuple]:
    """(rank key, group, op, dtype, size) -> (calls, summed positive kernel/cpu durations) from comm_events."""
    rows = con.execute(
        """
        SELECT coalesce(cast(rank AS VARCHAR), process, '?'), group_key, op, dtype, msg_bytes, count(*),
               sum(dur_us) FILTER (WHERE dur_us > 0 AND dur_source IN ('kernel', 'cpu_op'))
        FROM comm_events WHERE run_id = ? GROUP BY ALL
        """,
        [run_id(con, run)],
    ).fetchall()
    return {tuple(r[:5]): (r[5], r[6]) for r in rows}


def agg_calls(con, run: str) -> dict[tuple, tuple]:
    rows = con.execute(
        """
        SELECT rank_key, group_key, op, dtype, msg_bytes, sum(calls),
               sum(sum_dur_us) FILTER (WHERE dur_kind IS NOT NULL)
        FROM comm_agg WHERE run_id = ? GROUP BY ALL
        """,
        [run_id(con, run)],
    ).fetchall()
    return {tuple(r[:5]): (r[5], r[6]) for r in rows}


def assert_calls_equal(con, run: str) -> None:
    direct, agg = direct_calls(con, run), agg_calls(con, run)
    assert direct.keys() == agg.keys()
    for key, (calls, dur) in direct.items():
        assert agg[key][0] == calls, key
        assert agg[key][1] == pytest.approx(dur), key


def direct_scheme_bandwidth(con, run: str) -> dict[tuple, tuple]:
    """(scheme, op) -> (calls, time, median busbw) over the measured calls of the comms view (every call
    of these runs has a group size, a size and a kernel duration)."""
    values: dict[tuple, list] = {}
    for scheme, op, n, size, dur in con.execute(
        "SELECT scheme, op, group_size, msg_bytes, dur_us FROM comms WHERE run = ? "
        "AND msg_bytes > 0 AND dur_us > 0 AND op <> 'barrier'",
        [run],
    ).fetchall():
        values.setdefault((scheme, op), []).append((dur, size / dur / 1e3 * busbw_factor(op, n)))
    return {k: (len(v), sum(d for d, _ in v), statistics.median(b for _, b in v)) for k, v in values.items()}


def report_scheme_bandwidth(con, run: str) -> dict[tuple, tuple]:
    return {(s.scheme, s.op): (s.calls, s.time_us, s.median_busbw_gbps) for s in bandwidth(con, run).by_scheme}


def assert_bandwidth_equal(con, run: str) -> None:
    direct, report = direct_scheme_bandwidth(con, run), report_scheme_bandwidth(con, run)
    assert direct.keys() == report.keys()
    for key, (calls, time, median) in direct.items():
        assert report[key][0] == calls, key
        assert report[key][1] == pytest.approx(time) and report[key][2] == pytest.approx(median), key


# ------------------------------------------------------------------------------------ tests


def test_after_ingest_and_write(con):
    grid_run(con)
    assert not aggregates.is_fresh(con, run_id(con, "grid"))  # written by write_result, not yet refreshed
    h = histogram(con, "grid")  # the first read refreshes
    assert aggregates.is_fresh(con, run_id(con, "grid"))
    assert_calls_equal(con, "grid")
    # Iterations: 3 profiler steps per rank; calls inside steps are exactly those with a step.
    assert assign_iterations(con, "grid").info.iterations == {"0": 3, "1": 3, "2": 3, "3": 3}
    rid = run_id(con, "grid")
    inside = con.execute("SELECT sum(calls) FROM comm_agg WHERE run_id = ? AND in_iteration", [rid]).fetchall()[0][0]
    stepped = con.execute("SELECT count(*) FROM comm_events WHERE run_id = ? AND step IS NOT NULL", [rid]).fetchall()
    assert inside == stepped[0][0]
    assert h.excluded == {"outside profiler steps": 4}
    # A new file of the run makes the aggregates stale; the next read sees it.
    write(
        con,
        "grid",
        [ev(4, 0, "all_reduce", 16 * MiB, "pg:dpA", dur=1000.0, step=0)],
        steps=[{"rank": 4, "step": 0}],
        rank=4,
    )
    assert not aggregates.is_fresh(con, run_id(con, "grid"))
    assert rank_totals(con, "grid").rows[-1].rank == "4"
    assert_calls_equal(con, "grid")


def test_after_attribution_and_override(con):
    grid_run(con)
    attribute_run(con, "grid")
    rid = run_id(con, "grid")
    assert aggregates.is_fresh(con, rid)
    assert_calls_equal(con, "grid")
    assert_bandwidth_equal(con, "grid")
    schemes = {s.scheme for s in bandwidth(con, "grid").by_scheme}
    assert {"tp", "dp", None} <= schemes
    before = con.execute("SELECT sources_fp, groups_fp FROM agg_runs WHERE run_id = ?", [rid]).fetchall()[0]
    set_override(con, "grid", "pg:tpA", "other", "test: tpA is really something else")
    after = con.execute("SELECT sources_fp, groups_fp FROM agg_runs WHERE run_id = ?", [rid]).fetchall()[0]
    assert after[0] == before[0] and after[1] != before[1]  # refreshed for the scheme change only
    assert_calls_equal(con, "grid")
    assert_bandwidth_equal(con, "grid")
    assert ("other", "all_reduce") in report_scheme_bandwidth(con, "grid")
    # Scheme totals follow the override at query time.
    direct = dict(
        con.execute(
            "SELECT coalesce(scheme, 'unattributed'), count(*) FROM comms WHERE run = 'grid' GROUP BY ALL"
        ).fetchall()
    )
    assert attribution_summary(con, "grid").events_by_scheme == direct
    per_rank = {(r.rank, r.scheme): r.calls for r in rank_totals(con, "grid").rows}
    assert per_rank == {
        (str(k[0]), k[1]): k[2]
        for k in con.execute("SELECT rank, scheme, count(*) FROM comms WHERE run = 'grid' GROUP BY ALL").fetchall()
    }
    clear_override(con, "grid", "pg:tpA")
    assert ("other", "all_reduce") not in report_scheme_bandwidth(con, "grid")
    assert_bandwidth_equal(con, "grid")


def test_detected_iterations_are_stored(con):
    log_run(con)
    h = histogram(con, "log")
    assert h.iterations.mode == "detected" and h.iterations.iterations == {"host:17": 3}
    rid = run_id(con, "log")
    rows = con.execute(
        "SELECT i.seq, i.iteration, i.reason FROM comm_iterations i WHERE run_id = ? ORDER BY seq", [rid]
    ).fetchall()
    assert len(rows) == con.execute("SELECT count(*) FROM comm_events WHERE run_id = ?", [rid]).fetchall()[0][0]
    by_seq = {seq: (it, reason) for seq, it, reason in rows}
    assert by_seq[0] == (None, "before the repeating pattern (setup)")
    assert [by_seq[s][0] for s in range(1, 16)] == [0] * 5 + [1] * 5 + [2] * 5
    assert by_seq[16] == (None, "after the last complete iteration")
    assert_calls_equal(con, "log")
    inside = con.execute("SELECT sum(calls) FROM comm_agg WHERE run_id = ? AND in_iteration", [rid]).fetchall()
    assert inside[0][0] == 15
    # One detected iteration, read from the stored iterations.
    one = histogram(con, "log", step=1, normalize=False)
    assert sum(sum(s.calls) for s in one.series) == 5


def test_reads_wait_for_a_running_job(con):
    grid_run(con)
    rid = run_id(con, "grid")
    histogram(con, "grid")
    write(con, "grid", [ev(4, 0, "all_reduce", 16 * MiB, "pg:dpA", dur=1000.0, step=0)], rank=4)
    con.execute("INSERT INTO jobs (job_id, run_id, state) VALUES ('j1', ?, 'running')", [rid])
    assert {r.rank for r in rank_totals(con, "grid").rows} == {"0", "1", "2", "3"}  # last refresh, not recomputed
    con.execute("UPDATE jobs SET state = 'done' WHERE job_id = 'j1'")
    assert {r.rank for r in rank_totals(con, "grid").rows} == {"0", "1", "2", "3", "4"}


def _analyses(con, run: str) -> dict:
    return {
        "histogram": histogram(con, run).model_dump(),
        "step": histogram(con, run, step=1, rank=2).model_dump(),
        "ranks": rank_totals(con, run).model_dump(),
        "bandwidth": bandwidth(con, run).model_dump(),
        "findings": [f.model_dump() for f in findings(con, run)],
        "compare": compare(con, run).model_dump(),
        "groups": attribution_summary(con, run).model_dump(),
    }


def _make_v1(path: Path) -> None:
    """A schema-1 store: the schema without the aggregate tables, version 1, rows written by the store."""
    con = duckdb.connect(str(path))
    v1 = store.schema_sql()
    for ddl in store.MIGRATIONS[1]:
        v1 = v1.replace(ddl, "")
    counted = v1[
        v1.index("raw_name   VARCHAR,") : v1.index("-- same run describes the same calls (they count there, once)")
    ]
    v1 = v1.replace(counted, "raw_name   VARCHAR -- ").replace("\nWHERE e.counted;", ";")  # schema 3's column
    assert "counted" not in v1
    con.execute(v1)
    con.execute("INSERT INTO meta VALUES ('schema_version', '1')")
    grid_run(con)
    log_run(con)
    tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    assert not tables & set(aggregates.AGG_TABLES)
    con.close()


def test_v1_store_upgrade(tmp_path: Path):
    old = tmp_path / "v1.duckdb"
    _make_v1(old)
    with pytest.raises(store.StoreError, match="schema version 1"):
        store.connect(old, read_only=True)
    con = store.connect(old)  # upgrades: tables created, filled by each run's first refresh
    try:
        assert con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchall() == [
            (str(store.SCHEMA_VERSION),)
        ]
        assert (
            con.execute("SELECT count(*) FROM comm_events WHERE counted").fetchone()[0] > 0
        )  # schema 3: every call counts
        assert con.execute("SELECT count(*) FROM agg_runs").fetchall() == [(0,)]
        assert aggregates.refresh_all(con) == 2
        assert aggregates.refresh_all(con) == 0  # fresh now
        for run in ("grid", "log"):
            assert_calls_equal(con, run)
        attribute_run(con, "grid")
        upgraded = _analyses(con, "grid")
        assert_bandwidth_equal(con, "grid")
    finally:
        con.close()
    # The same rows written into a new store give the same answers.
    fresh = store.connect(tmp_path / "v2.duckdb")
    try:
        grid_run(fresh)
        attribute_run(fresh, "grid")
        assert _analyses(fresh, "grid") == upgraded
    finally:
        fresh.close()


def test_ingest_refreshes_real_runs(con, data_dir):
    from commlens.service.ingest import ingest_paths

    ingest_paths(
        con, [data_dir / "kineto-hta" / "nccl_parser_config", data_dir / "nccl-logs" / "nvidia-nccl-1238.log"], "mixed"
    )
    rid = run_id(con, "mixed")
    assert aggregates.is_fresh(con, rid)  # finalize_run refreshed
    assert_calls_equal(con, "mixed")
    info = assign_iterations(con, "mixed").info
    assert info.mode == "mixed"
    steps = con.execute(
        "SELECT count(DISTINCT step) FROM comm_events WHERE run_id = ? AND step IS NOT NULL", [rid]
    ).fetchall()[0][0]
    assert steps in info.iterations.values()
    attribute_run(con, "mixed")
    assert_bandwidth_equal(con, "mixed")


def test_aggregates_of_older_rules_are_recomputed_on_read(con):
    """A store whose aggregates were computed by older rules (here: a busbw median with the floor's large calls
    counted otherwise) is stale though its data did not change: the first read recomputes them."""
    grid_run(con)
    rid = run_id(con, "grid")
    bandwidth(con, "grid")
    assert aggregates.is_fresh(con, rid)
    con.execute(
        "UPDATE agg_runs SET sources_fp = replace(sources_fp, ?, 'rules1:') WHERE run_id = ?",
        [f"rules{aggregates.RULES}:", rid],
    )
    con.execute("UPDATE bw_schemes SET large_calls = -1 WHERE run_id = ?", [rid])
    assert not aggregates.is_fresh(con, rid)
    assert all(s.large_calls >= 0 for s in bandwidth(con, "grid").by_scheme)
    assert aggregates.is_fresh(con, rid)
