"""Schema 9: time_breakdown and time_memcpy stored in step-block order (commlens/store/layout.py), written so by
the time analysis and rewritten so by the 8 -> 9 upgrade, with every row and every read unchanged."""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pytest

from commlens import store
from commlens.backend.timing.persist import _insert
from commlens.service import time as service
from commlens.store.layout import STEP_BLOCK

RANKS, STEPS = 3, 2 * STEP_BLOCK + 10  # three step blocks, the last one partial


def _block_order(rows: list[tuple]) -> list[tuple]:
    """(run_id, rank, step, scheme-or-direction) rows in the documented order."""
    return sorted(rows, key=lambda r: (r[0], r[2] // STEP_BLOCK, r[1], r[2], r[3] is not None, r[3] or ""))


def _stored(con: duckdb.DuckDBPyConnection, table: str, last: str) -> list[tuple]:
    return con.execute(f"SELECT run_id, rank, step, {last} FROM {table} ORDER BY rowid").fetchall()


def _plant_v8(db: Path) -> None:
    """A schema-8 store (today's DDL, version 8) with two runs' time rows in the old (rank, step) order."""
    con = duckdb.connect(str(db))
    con.execute(store.schema_sql())
    con.execute("INSERT INTO meta VALUES ('schema_version', '8')")
    for run_id, name in ((1, "a"), (2, "b")):
        con.execute("INSERT INTO runs (run_id, name) VALUES (?, ?)", [run_id, name])
        con.execute(
            """INSERT INTO time_breakdown
               SELECT ?, r, s, sc, w, w, 1.0 * s, 2.0 * r, 3.0, w, w
               FROM (SELECT *, CASE WHEN sc IS NULL THEN 1000.0 * r + s END AS w
                     FROM range(?) t(r), range(?) u(s), (VALUES (NULL), ('dp')) v(sc))
               ORDER BY r, s, sc NULLS FIRST""",
            [run_id, RANKS, STEPS],
        )
        con.execute(
            """INSERT INTO time_memcpy SELECT ?, r, s, d, 100 * r + s, 1.0, 0.5
               FROM range(?) t(r), range(?) u(s), (VALUES ('dtoh'), ('htod')) v(d) ORDER BY r, s, d""",
            [run_id, RANKS, STEPS],
        )
    con.close()


def test_a_schema_8_store_upgrades_to_the_step_block_order(tmp_path: Path) -> None:
    db = tmp_path / "v8.duckdb"
    _plant_v8(db)
    con = duckdb.connect(str(db))
    before = {t: _stored(con, t, last) for t, last in (("time_breakdown", "scheme"), ("time_memcpy", "direction"))}
    steps_a = con.execute(
        "SELECT * FROM time_breakdown WHERE run_id = 1 AND step = 300 ORDER BY rank, scheme"
    ).fetchall()
    con.close()
    assert before["time_breakdown"][:3] == [(1, 0, 0, None), (1, 0, 0, "dp"), (1, 0, 1, None)]

    con = store.connect(db)
    try:
        assert store.SCHEMA_VERSION >= 9  # upgraded through 9, to the current version
        assert con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchall() == [
            (str(store.SCHEMA_VERSION),)
        ]
        for table, last in (("time_breakdown", "scheme"), ("time_memcpy", "direction")):
            after = _stored(con, table, last)
            assert after == _block_order(before[table]) and sorted(map(str, after)) == sorted(map(str, before[table]))
        # the first block holds every rank's first 256 steps, rank by rank; the next block starts at step 256
        assert _stored(con, "time_breakdown", "scheme")[2 * STEP_BLOCK - 1 : 2 * STEP_BLOCK + 1] == [
            (1, 0, STEP_BLOCK - 1, "dp"),
            (1, 1, 0, None),
        ]
        assert _stored(con, "time_breakdown", "scheme")[2 * STEP_BLOCK * RANKS] == (1, 0, STEP_BLOCK, None)
        assert (
            con.execute("SELECT * FROM time_breakdown WHERE run_id = 1 AND step = 300 ORDER BY rank, scheme").fetchall()
            == steps_a
        )
        # the rewritten time_memcpy keeps its primary key
        with pytest.raises(duckdb.ConstraintException):
            con.execute("INSERT INTO time_memcpy VALUES (1, 0, 0, 'dtoh', 1, 1.0, 1.0)")
        # reads by step and by rank answer the planted values
        one_step = service.breakdown(con, "b", step=300)
        assert one_step.total == RANKS and [(r.rank, r.step, r.step_us) for r in one_step.rows] == [
            (0, 300, 300.0),
            (1, 300, 1300.0),
            (2, 300, 2300.0),
        ]
        assert [(m.direction, m.bytes) for m in one_step.rows[2].memcpy] == [("dtoh", 500), ("htod", 500)]
        assert [(s.scheme, s.overlapped_us, s.wait_us) for s in one_step.rows[1].schemes] == [("dp", 300.0, 2.0)]
        one_rank = service.breakdown(con, "a", rank=2, limit=3, offset=STEP_BLOCK - 1)
        assert one_rank.total == STEPS and one_rank.next_offset == STEP_BLOCK + 2
        assert [(r.step, r.step_us, [m.bytes for m in r.memcpy]) for r in one_rank.rows] == [
            (255, 2255.0, [455, 455]),
            (256, 2256.0, [456, 456]),
            (257, 2257.0, [457, 457]),
        ]
    finally:
        con.close()


def test_the_time_analysis_writes_the_step_block_order(tmp_path: Path) -> None:
    con = store.connect(tmp_path / "new.duckdb")
    try:
        rank, step = np.repeat(np.arange(2), 300), np.tile(np.arange(300), 2)  # (rank, step) order, as analysed
        n = len(rank)
        _insert(
            con,
            "time_breakdown",
            7,
            {
                "rank": rank,
                "step": step,
                "scheme": pa.nulls(n, pa.string()),
                "overlapped_us": np.zeros(n),
                "wait_us": np.zeros(n),
                "exposed_us": np.zeros(n),
            },
        )
        stored = _stored(con, "time_breakdown", "scheme")
        assert stored == _block_order(stored) and len(stored) == 600
        assert stored[STEP_BLOCK - 1 : STEP_BLOCK + 1] == [(7, 0, STEP_BLOCK - 1, None), (7, 1, 0, None)]
        assert stored[2 * STEP_BLOCK] == (7, 0, STEP_BLOCK, None)
    finally:
        con.close()
