"""Schema 10: time_instances and time_instance_members without primary keys (DuckDB's index on their millions of
rows was most of an NCCL log's time analysis). The keys stay unique by construction: checked here on real runs;
a schema-9 store is upgraded with every row kept (and, schema 11, each instance's last_own_us filled), and the reads by
instance answer as before."""

from __future__ import annotations

import re
from pathlib import Path

import duckdb
import pytest
from nccl_bench import nccl_bench

from commlens import store
from commlens.service import time as service
from commlens.service.ingest import ingest_paths
from commlens.store.migrations import _create_tables

KEYS = {"time_instances": "(run_id, instance_id)", "time_instance_members": "(run_id, instance_id, rank)"}


def _with_key(table: str) -> str:
    """The table's schema-9 DDL: today's without the columns later schemas added, with its primary key."""
    (ddl,) = _create_tables("time.sql", (table,))
    ddl = re.sub(r",\s*last_own_us\s+DOUBLE", "", re.sub(r"--[^\n]*", "", ddl))
    return re.sub(r"\s*\n\);$", f",\n    PRIMARY KEY {KEYS[table]}\n);", ddl)


def _plant_v9(db: Path) -> None:
    """A schema-9 store with two runs' instances and members, written out of key order."""
    con = duckdb.connect(str(db))
    con.execute(store.schema_sql())
    for table in KEYS:
        con.execute(f"DROP TABLE {table}")
        con.execute(_with_key(table))
    con.execute("INSERT INTO meta VALUES ('schema_version', '9')")
    for run_id, name in ((1, "a"), (2, "b")):
        con.execute("INSERT INTO runs (run_id, name) VALUES (?, ?)", [run_id, name])
        con.execute(
            """INSERT INTO time_instances
               SELECT ?, i, 'g' || (i % 2), 'dp', 'all_reduce', 'float32', 1024 * i, i // 10, i, 'key', 2,
                      10.0 * i, 10.0 * i + 1, 1, 1.0, 5.0, 0.2, 0.2
               FROM range(40) t(i) ORDER BY i DESC""",
            [run_id],
        )
        con.execute(
            """INSERT INTO time_instance_members
               SELECT ?, i, r, 7, i, 10.0 * i + r, 10.0 * i + 6, 1.0 - r
               FROM range(40) t(i), range(2) u(r) ORDER BY r DESC, i""",
            [run_id],
        )
    con.close()


def test_a_schema_9_store_upgrades_without_the_keys(tmp_path: Path) -> None:
    db = tmp_path / "v9.duckdb"
    _plant_v9(db)
    con = duckdb.connect(str(db))
    before = {t: sorted(con.execute(f"SELECT * FROM {t}").fetchall()) for t in KEYS}
    with pytest.raises(duckdb.ConstraintException):  # schema 9 kept the keys
        con.execute("INSERT INTO time_instance_members SELECT * FROM time_instance_members LIMIT 1")
    con.close()

    con = store.connect(db)
    try:
        assert con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchall() == [
            (str(store.SCHEMA_VERSION),)
        ]
        # schema 11 fills last_own_us with each instance's whole imposed wait: rank 0 waited 1 µs for rank 1
        assert con.execute("SELECT DISTINCT last_own_us FROM time_instances").fetchall() == [(1.0,)]
        for table, key in KEYS.items():
            planted = "* EXCLUDE (last_own_us)" if table == "time_instances" else "*"
            stored = con.execute(f"SELECT {planted} FROM {table} ORDER BY rowid").fetchall()
            assert sorted(stored) == before[table] and len(stored) == {"time_instances": 80}.get(table, 160)
            width = len(key.split(","))
            assert stored == sorted(stored, key=lambda r: tuple(r[:width]))  # rewritten in key order
            con.execute(f"INSERT INTO {table} SELECT * FROM {table} LIMIT 1")  # no key refuses a row now
            con.execute(f"DELETE FROM {table} WHERE rowid = (SELECT max(rowid) FROM {table})")
        # reads by instance answer the planted rows
        one = service.instance(con, "b", 7)
        assert (one.instance_id, one.msg_bytes, [(m.rank, m.wait_us) for m in one.members]) == (
            7,
            7168,
            [(0, 1.0), (1, 0.0)],
        )
        page = service.instances(con, "a", rank=1, limit=5, offset=10)
        assert page.total == 40 and [i.instance_id for i in page.items] == [10, 11, 12, 13, 14]
    finally:
        con.close()


def test_the_analysis_writes_each_key_once(tmp_path: Path, con, data_dir: Path) -> None:
    """What the keys checked: one instance per instance_id and one member per (instance, rank), on a real job's
    profiler traces (DLRM, 8 ranks), every real NCCL log, and a bench-shaped log of 8 processes ingested twice into
    the same run (its second ingest analyses the run again)."""
    nccl_bench().write_interleaved(tmp_path / "bench.log", 8_000, "2.21.5")
    runs = {"dlrm": [data_dir / "kineto-param/dlrm_kineto.tar.gz"], "bench": [tmp_path / "bench.log"]}
    runs |= {f"log-{p.stem}": [p] for p in sorted((data_dir / "nccl-logs").glob("*.log"))}
    for run, paths in runs.items():
        assert not ingest_paths(con, paths, run).failed
    ingest_paths(con, [tmp_path / "bench.log"], "bench")  # the same file again: refused as already present
    for table, key in KEYS.items():
        rows, distinct = con.execute(f"SELECT count(*), count(DISTINCT {key}) FROM {table}").fetchone()
        assert rows == distinct, table
    dlrm = con.execute(
        "SELECT count(*), sum(members) FROM time_instances JOIN runs USING (run_id) WHERE name = 'dlrm'"
    ).fetchone()
    assert dlrm == (8, 64)  # its 5 all-to-alls and 3 all-reduces, each matched on the 8 ranks
    members, instances, calls = con.execute(
        """SELECT (SELECT count(*) FROM time_instance_members m JOIN runs USING (run_id) WHERE name = 'bench'),
                  (SELECT sum(members) FROM time_instances i JOIN runs USING (run_id) WHERE name = 'bench'),
                  (SELECT count(*) FROM comm_events c JOIN runs USING (run_id) WHERE name = 'bench')"""
    ).fetchone()
    assert members == instances and 5_000 < members <= calls  # each matched call once, after a second ingest too
