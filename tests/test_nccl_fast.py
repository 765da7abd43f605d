"""The detected iteration of every NCCL-log call, counted in numpy columns (`aggregates._insert_iterations`),
against the SQL window it replaced (kept here as the reference), row for row: on the real logs and on a
bench-shaped interleaved log with garbled lines."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

from commlens.service.ingest import ingest_paths

ROOT = Path(__file__).resolve().parents[1]

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


def _bench():
    spec = importlib.util.spec_from_file_location("bench_nccl", ROOT / "bench" / "nccl.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_nccl"] = module
    spec.loader.exec_module(module)
    return module


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
    bench = _bench()
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
    bench = _bench()
    bench.write_per_process(tmp_path / shape, 16_000, "2.21.5")
    summary = ingest_paths(con, sorted((tmp_path / shape).iterdir()), "pp")
    assert [f.status for f in summary.files] == ["ok"] * 8
    rows = _same_as_reference(con, "pp")
    assert len(rows) == sum(f.events for f in summary.files)
    assert {r[3] for r in rows if r[3] is not None}
