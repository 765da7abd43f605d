"""The faster NCCL-log paths against the general ones they replace, row for row: the detected iteration of
every call, counted in numpy columns (`aggregates._insert_iterations`), against the SQL window it replaced
(kept here as the reference) on the real logs and on bench-shaped logs with garbled lines; the time
analysis's matching of members that saw the same keys against the sorting path, on bench-shaped logs
(whole, and with calls lost on one member) and on a real profile."""

from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pytest
from nccl_bench import nccl_bench

from commlens.backend.timing import matching, persist
from commlens.backend.timing.analysis import analyze_columns
from commlens.service.ingest import ingest_paths

# The definition comm_iterations had as one SQL statement: each call's position in its communicator
# (a window over every call) against its communicator's period and its process's iterations.
REFERENCE = """
    WITH x AS (
        SELECT source_id, process, comm, seq,
               row_number() OVER (PARTITION BY source_id, process, comm ORDER BY seq) - 1 AS idx
        FROM (SELECT e.source_id, coalesce(e.process, cast(e.rank AS VARCHAR), '?') AS process,
                     coalesce(e.group_key, 'ptr:' || e.comm_ptr) AS comm, e.seq
              FROM comm_events e
              JOIN agg_sources s ON s.run_id = e.run_id AND s.source_id = e.source_id AND NOT s.has_steps
              WHERE e.run_id = $run AND e.counted)
    ), y AS (
        SELECT x.source_id, x.process, x.seq, x.idx, pi.iterations AS iters, c.period, c.offset_calls,
               CASE WHEN c.period IS NOT NULL AND coalesce(pi.iterations, 0) > 0 AND x.idx >= c.offset_calls
                    THEN (x.idx - c.offset_calls) // (c.period * (c.repeats // pi.iterations)) END AS it
        FROM x
        LEFT JOIN process_iterations pi ON pi.run_id = $run AND pi.source_id = x.source_id AND pi.process = x.process
        LEFT JOIN comm_periods c ON c.run_id = $run AND c.source_id = x.source_id AND c.process = x.process
             AND c.comm IS NOT DISTINCT FROM x.comm
    )
    SELECT source_id, process, seq,
           CASE WHEN it < iters THEN it END,
           CASE WHEN coalesce(iters, 0) = 0 THEN 'no repeating pattern in its process'
                WHEN period IS NULL THEN 'communicator without a repeating pattern'
                WHEN idx < offset_calls THEN 'before the repeating pattern (setup)'
                WHEN it >= iters THEN 'after the last complete iteration'
           END
    FROM y ORDER BY ALL
"""


def _run_id(con, run: str) -> int:
    return int(con.execute("SELECT run_id FROM runs WHERE name = ?", [run]).fetchall()[0][0])


def _same_as_reference(con, run: str) -> list[tuple]:
    run_id = _run_id(con, run)
    stored = con.execute(
        "SELECT source_id, process, seq, iteration, reason FROM comm_iterations WHERE run_id = ? ORDER BY ALL",
        [run_id],
    ).fetchall()
    assert stored == con.execute(REFERENCE, {"run": run_id}).fetchall()
    return stored


def test_real_logs_iterations_equal_the_sql_window(con, data_dir):
    logs = sorted((data_dir / "nccl-logs").glob("*.log"))
    assert len(logs) >= 10
    summary = ingest_paths(con, logs, "real")
    rows = _same_as_reference(con, "real")
    assert len(rows) == sum(f.events for f in summary.files if f.status == "ok")
    reasons = {r[4] for r in rows}
    assert None in reasons and "no repeating pattern in its process" in reasons  # both sides of the rule


def test_bench_shaped_log_with_garbled_lines(tmp_path, con):
    bench = nccl_bench()
    clean = tmp_path / "clean.log"
    bench.write_interleaved(clean, 30_000, "2.21.5")
    lines = clean.read_text().splitlines()
    rnd = random.Random(3)
    garbled = 0
    for i in sorted(rnd.sample(range(200, len(lines)), 25), reverse=True):
        if "opCount" in lines[i]:
            lines.insert(i, lines[i][: lines[i].index(" count ")] + " count zz")  # a COLL line cut and damaged
            garbled += 1
    assert garbled >= 10
    path = tmp_path / "garbled.log"
    path.write_text("\n".join(lines) + "\n")
    summary = ingest_paths(con, [path], "bench")
    (outcome,) = summary.files
    assert outcome.status == "ok"
    assert sum(outcome.skipped.values()) == garbled
    rows = _same_as_reference(con, "bench")
    assert len(rows) == outcome.events
    # planted: one loss all-reduce on the world communicator per training iteration, in every process
    losses = sum("AllReduce: opCount" in line and "[nranks=8]" in line for line in lines) // 8
    assert losses == 90
    for process in range(8):
        its = {r[3] for r in rows if r[1] == f"gpu-a100-017:{52100 + 17 * process}" and r[3] is not None}
        assert its == set(range(losses))


@pytest.mark.parametrize("shape", ["per-process"])
def test_per_process_files_iterations_equal_the_sql_window(tmp_path, con, shape):
    bench = nccl_bench()
    bench.write_per_process(tmp_path / shape, 16_000, "2.21.5")
    summary = ingest_paths(con, sorted((tmp_path / shape).iterdir()), "pp")
    assert [f.status for f in summary.files] == ["ok"] * 8
    rows = _same_as_reference(con, "pp")
    assert len(rows) == sum(f.events for f in summary.files)
    assert {r[3] for r in rows if r[3] is not None}


def _last_per_key_sorted(k, rows):
    """The general form of matching._last_per_key: sort every member's keys."""
    uk, first = np.unique(k[::-1], return_index=True)
    return uk, rows[::-1][first]


def _time_tables(con, run: str) -> dict:
    data = persist.load_run(con, _run_id(con, run))
    job = analyze_columns(data.ranks, data.calls, data.world_size, data.hosts, data.schemes)
    return persist.result_tables(data, job)


def _assert_same_tables(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for table, columns in a.items():
        assert columns.keys() == b[table].keys(), table
        for name, x in columns.items():
            y = b[table][name]
            if isinstance(x, np.ndarray):
                assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), (table, name)
            elif isinstance(x, pa.Array | pa.ChunkedArray):
                assert x.equals(y), (table, name)
            else:
                assert x == y, (table, name)


def _time_same_as_general_path(con, run: str, monkeypatch) -> dict:
    fast = _time_tables(con, run)
    with monkeypatch.context() as m:
        m.setattr(matching, "_last_per_key", _last_per_key_sorted)
        m.setattr(matching, "_aligned", matching._aligned_any)
        general = _time_tables(con, run)
    _assert_same_tables(fast, general)
    return fast


def test_time_analysis_fast_keys_equal_the_general_path(tmp_path, con, monkeypatch):
    bench = nccl_bench()
    path = tmp_path / "job.log"
    bench.write_interleaved(path, 24_000, "2.28.3")
    ingest_paths(con, [path], "whole")
    whole = _time_same_as_general_path(con, "whole", monkeypatch)
    # the generator stops each process mid-iteration: the last calls of a communicator miss on some members
    ends = whole["time_mismatches"]["reason"]
    assert set(ends) == {"missing on a member"}
    # the same job with 5 calls of process 3 lost: keys differ between members, some missing on one
    lines = path.read_text().splitlines()
    lost = [i for i, line in enumerate(lines) if ":52151:52151 [3]" in line and "AllGather: opCount" in line][5:10]
    damaged = tmp_path / "lost.log"
    damaged.write_text("\n".join(line for i, line in enumerate(lines) if i not in set(lost)) + "\n")
    ingest_paths(con, [damaged], "lost")
    out = _time_same_as_general_path(con, "lost", monkeypatch)
    assert out["time_mismatches"]["reason"] == ["missing on a member"] * (len(ends) + 5)
    n_whole = len(whole["time_instances"]["instance_id"])
    assert len(out["time_instances"]["instance_id"]) == n_whole - 5


def test_time_analysis_fast_keys_on_a_real_profile(con, data_dir, monkeypatch):
    ingest_paths(con, [data_dir / "kineto-param/dlrm_kineto.tar.gz"], "dlrm")
    out = _time_same_as_general_path(con, "dlrm", monkeypatch)
    assert len(out["time_instances"]["instance_id"]) == 8
