"""`commlens export --parquet`: every table and view of a real store as hive-partitioned Parquet, read back by
DuckDB equal to the store, and the SQL docs/store.md documents running unchanged on it."""

from __future__ import annotations

import re
from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

from commlens.cli import app

from .conftest import ROOT, shared_data

DLRM = "kineto-param/dlrm_kineto.tar.gz"
TYPES = {"run": "VARCHAR", "rank": "INTEGER"}  # the partition columns' types as in the store


def _cli(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The DLRM job under the two run names the documented queries use."""
    db = tmp_path_factory.mktemp("export") / "s.duckdb"
    for run in ("ddp-demo", "pp-demo"):
        _cli("ingest", str(shared_data() / DLRM), "--db", str(db), "--run", run, "--one-run")
    return db


def _views(con: duckdb.DuckDBPyConnection, out: Path) -> list[str]:
    """A view per exported relation, reading its Parquet files."""
    names = sorted(p.name for p in out.iterdir())
    for name in names:
        first = next((out / name).rglob("*.parquet")).relative_to(out / name)
        keys = [part.split("=")[0] for part in first.parts[:-1]]
        types = ", ".join(f"'{k}': {TYPES[k]}" for k in keys)
        hive = f", hive_types = {{{types}}}" if keys else ""
        con.execute(
            f"CREATE VIEW \"{name}\" AS SELECT * FROM read_parquet('{out / name}/**/*.parquet', hive_partitioning = true{hive})"
        )
    return names


def _same(a: list[tuple], b: list[tuple]) -> bool:
    """Equal as multisets of rows."""
    return sorted(map(repr, a)) == sorted(map(repr, b))


def _differ(con: duckdb.DuckDBPyConnection, name: str) -> tuple[int, int, int]:
    """(rows in the store, rows only there, rows only in the export) of a relation, on the store's columns."""
    cols = ", ".join(f'"{r[0]}"' for r in con.execute(f'DESCRIBE SELECT * FROM s."{name}"').fetchall())
    counts = [
        con.execute(f'SELECT count(*) FROM s."{name}"').fetchone(),
        con.execute(
            f'SELECT count(*) FROM (SELECT {cols} FROM s."{name}" EXCEPT ALL SELECT {cols} FROM "{name}")'
        ).fetchone(),
        con.execute(
            f'SELECT count(*) FROM (SELECT {cols} FROM "{name}" EXCEPT ALL SELECT {cols} FROM s."{name}")'
        ).fetchone(),
    ]
    return tuple(int(c[0]) if c else -1 for c in counts)  # type: ignore[return-value]


def test_export_round_trip(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "all"
    said = _cli("export", "--parquet", str(out), "--db", str(store))
    assert "written under" in said
    assert (out / "comms" / "run=ddp-demo" / "rank=3" / "part-0.parquet").is_file()
    assert (out / "comm_events" / "run=pp-demo" / "rank=0" / "part-0.parquet").is_file()
    # empty for Kineto traces: its columns in a folder of NULL partitions
    assert (out / "nccl_comms" / "run=__HIVE_DEFAULT_PARTITION__" / "part-0.parquet").is_file()
    assert not (out / "users").exists()  # token hashes never leave the store
    con = duckdb.connect()
    con.execute(f"ATTACH '{store}' AS s (READ_ONLY)")
    names = _views(con, out)
    assert {"comms", "comm_events", "runs", "sources", "comm_agg", "time_instances", "meta"} <= set(names)
    rows = {name: _differ(con, name) for name in names}
    assert {name: r for name, r in rows.items() if r[1] or r[2]} == {}
    assert rows["time_finding_runs"][0] == 2  # its HUGEINT byte sums came through exactly
    n = con.execute("SELECT count(*) FROM comms WHERE run = 'ddp-demo'").fetchone()
    con.close()
    assert n == (64,)


def test_export_of_one_run(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "one"
    _cli("export", "--parquet", str(out), "--db", str(store), "--run", "pp-demo")
    assert sorted(p.name for p in (out / "comms").iterdir()) == ["run=pp-demo"]
    result = CliRunner().invoke(app, ["export", "--parquet", str(out), "--db", str(store)])
    assert result.exit_code == 2 and "not an empty folder" in result.output
    result = CliRunner().invoke(app, ["export", "--parquet", str(tmp_path / "x"), "--db", str(store), "--run", "nope"])
    assert result.exit_code == 2 and "no run named 'nope'" in result.output


def test_documented_sql_runs_unchanged_on_the_export(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "docs"
    _cli("export", "--parquet", str(out), "--db", str(store))
    blocks = re.findall(r"```sql\n(.*?)```", (ROOT / "docs" / "store.md").read_text(), re.S)
    queries = [q.strip() for block in blocks for q in block.split(";") if re.search(r"\bSELECT\b", q)]
    on_comms = [q for q in queries if re.search(r"\bFROM comms\b", q)]
    assert len(on_comms) >= 2
    con = duckdb.connect()
    _views(con, out)
    stored = duckdb.connect(str(store), read_only=True)
    for sql in queries:
        expected = stored.execute(sql).fetchall()
        assert _same(con.execute(sql).fetchall(), expected), sql
        if sql in on_comms:
            assert expected, sql  # the comms queries select rows of the two runs
    stored.close()
