"""`commlens export --parquet` checked as a user reads it: a store of several formats (a Kineto archive of 8
ranks, a one-rank DDP trace, NCCL logs, a trace without ranks under a run name that needs URL-encoding), every
relation of the store's catalog in the export, each read exactly as docs/store.md says (read_parquet with the
documented hive partitions and types, empty relations included), and every SQL example of README.md and
docs/*.md answering the same on the store and on the export. Then the errors a user meets."""

from __future__ import annotations

import re
from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

from commlens.cli import app
from commlens.service import export

from .conftest import ROOT, shared_data

# (path under the shared data, run): the run names the documented queries use
INGESTS = (
    ("kineto-param/dlrm_kineto.tar.gz", "dlrm"),
    ("kineto-hta/nccl_parser_config/nccl_data.json.gz", "ddp-demo"),
    ("nccl-logs", "pp-demo"),
    ("kineto-hta/distributed_info_unavailable", "2024 a=b%"),  # no rank: rank=__HIVE_DEFAULT_PARTITION__
)
HIDDEN = {"users"}  # token hashes never leave the store


def _cli(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == code, result.output
    return " ".join(result.output.split())


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    db = tmp_path_factory.mktemp("review") / "s.duckdb"
    for path, run in INGESTS:
        _cli("ingest", str(shared_data() / path), "--db", str(db), "--run", run, "--one-run")
    return db


@pytest.fixture(scope="module")
def exported(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("review-out") / "dataset"
    _cli("export", "--parquet", str(out), "--db", str(store))
    return out


def _catalog(con: duckdb.DuckDBPyConnection, database: str) -> dict[str, list[str]]:
    """Every table and view of the store with its columns."""
    columns: dict[str, list[str]] = {}
    for name, column in con.execute(
        "SELECT table_name, column_name FROM duckdb_columns() WHERE database_name = ? AND schema_name = 'main' "
        "ORDER BY table_name, column_index",
        [database],
    ).fetchall():
        columns.setdefault(name, []).append(column)
    return columns


def _documented_views(con: duckdb.DuckDBPyConnection, out: Path, catalog: dict[str, list[str]]) -> None:
    """A view per relation as docs/store.md says: `run` (VARCHAR) where the relation has a run or a run_id,
    `rank` (INTEGER) where it also has a rank, whatever rows it holds."""
    for name, cols in catalog.items():
        keys = {"run": "VARCHAR", "rank": "INTEGER"} if "rank" in cols else {"run": "VARCHAR"}
        if "run" not in cols and "run_id" not in cols:
            keys = {}
        types = ", ".join(f"'{k}': {t}" for k, t in keys.items())
        hive = f", hive_types = {{{types}}}" if keys else ""
        con.execute(
            f"CREATE VIEW \"{name}\" AS SELECT * FROM read_parquet('{out / name}/**/*.parquet', "
            f"hive_partitioning = true{hive})"
        )


def _documented_queries() -> list[str]:
    """Every SELECT in the SQL blocks of README.md and docs/*.md (comment lines dropped)."""
    queries = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```sql\n(.*?)```", doc.read_text(), re.S):
            for statement in block.split(";"):
                sql = "\n".join(line for line in statement.splitlines() if not line.lstrip().startswith("--"))
                if re.match(r"\s*SELECT\b", sql, re.I):
                    queries.append(sql.strip())
    return queries


def test_every_relation_reads_back_as_documented(store: Path, exported: Path) -> None:
    with duckdb.connect() as con:
        con.execute(f"ATTACH '{store}' AS s (READ_ONLY)")
        _check_relations(con, exported, {k: v for k, v in _catalog(con, "s").items() if k not in HIDDEN})


def _check_relations(con: duckdb.DuckDBPyConnection, exported: Path, catalog: dict[str, list[str]]) -> None:
    assert sorted(p.name for p in exported.iterdir()) == sorted(catalog)
    _documented_views(con, exported, catalog)
    counts, differ = {}, {}
    for name, cols in catalog.items():
        listed = ", ".join(f'"{c}"' for c in cols)
        counts[name] = con.execute(f'SELECT count(*) FROM s."{name}"').fetchone()
        only_there = f'SELECT {listed} FROM s."{name}" EXCEPT ALL SELECT {listed} FROM "{name}"'
        only_here = f'SELECT {listed} FROM "{name}" EXCEPT ALL SELECT {listed} FROM s."{name}"'
        differ[name] = tuple(con.execute(f"SELECT count(*) FROM ({q})").fetchone() for q in (only_there, only_here))
    assert {name: d for name, d in differ.items() if d != ((0,), (0,))} == {}
    # empty relations (no all-to-all split lists, Flight Recorder dumps, review or aliases here) read too
    assert {n for n, c in counts.items() if c == (0,)} >= {"a2a_pairs", "fr_entries", "review_items", "run_aliases"}
    assert counts["comms"] == (64 + 21 + 26 + 6,)
    ranks = con.execute("SELECT run, rank, count(*) FROM comms GROUP BY ALL ORDER BY ALL").fetchall()
    assert ranks[:2] == [("2024 a=b%", None, 6), ("ddp-demo", 0, 21)]
    assert ranks[-1] == ("pp-demo", None, 26)
    assert [r[1] for r in ranks if r[0] == "dlrm"] == list(range(8))


def test_empty_relation_is_in_a_partition_folder(exported: Path) -> None:
    """Zero rows: one file without the partition columns, in a folder of NULL partitions, so the documented
    read (hive_types naming `run` and `rank`) finds the partitions it names."""
    files = [p.relative_to(exported).as_posix() for p in (exported / "a2a_pairs").rglob("*.parquet")]
    assert files == ["a2a_pairs/run=__HIVE_DEFAULT_PARTITION__/rank=__HIVE_DEFAULT_PARTITION__/part-0.parquet"]
    columns = duckdb.sql(
        f"DESCRIBE SELECT * FROM read_parquet('{exported / files[0]}', hive_partitioning = false)"
    ).fetchall()
    assert "run" not in [c[0] for c in columns] and "rank" not in [c[0] for c in columns]


def test_documented_sql_answers_the_same(store: Path, exported: Path) -> None:
    queries = _documented_queries()
    assert len(queries) >= 6
    answers = {}
    with duckdb.connect() as con:
        con.execute(f"ATTACH '{store}' AS s (READ_ONLY)")
        _documented_views(con, exported, {k: v for k, v in _catalog(con, "s").items() if k not in HIDDEN})
        con.execute("DETACH s")
        with duckdb.connect(str(store), read_only=True) as stored:
            for sql in queries:
                expected = stored.execute(sql).fetchall()
                assert sorted(map(repr, con.execute(sql).fetchall())) == sorted(map(repr, expected)), sql
                answers[" ".join(sql.split())[:30]] = len(expected)
    # the queries over comms, the time tables and the aggregates select rows of these runs
    assert answers["SELECT g.scheme, a.op, sum(a.c"] == 2
    assert answers["SELECT scheme, op, sum(msg_byt"] == 2
    assert answers["SELECT group_key, op, count(*)"] == 3
    assert answers["SELECT b.step, b.scheme, avg(b"] == 1
    assert answers["SELECT group_key, scheme, rank"] == 1


def test_a_failed_export_leaves_nothing(store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure half-way (here: planted at `comms`, the 13th relation) leaves neither the folder nor a part of it."""
    real = export._export_one

    def failing(*args: object) -> export.ExportedRelation:
        if args[2] == "comms":  # after a2a_pairs ... comm_periods were written
            raise OSError(28, "No space left on device")
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(export, "_export_one", failing)
    out = tmp_path / "new" / "dataset"
    said = _cli("export", "--parquet", str(out), "--db", str(store), code=2)
    assert f"{out}: the export failed (No space left on device); nothing was written" in said
    assert list(tmp_path.iterdir()) == []  # the folders it made went too
    empty = tmp_path / "empty"
    empty.mkdir()
    _cli("export", "--parquet", str(empty), "--db", str(store), code=2)
    assert list(empty.iterdir()) == [] and list(tmp_path.iterdir()) == [empty]


def test_export_into_the_current_empty_folder(store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert _cli("export", "--parquet", ".", "--db", str(store)).endswith("rows, written under .")
    assert (tmp_path / "comms" / "run=dlrm" / "rank=7" / "part-0.parquet").is_file()


def test_export_errors_name_what_is_wrong(store: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nope.duckdb"
    said = _cli("export", "--parquet", str(tmp_path / "o"), "--db", str(missing), code=2)
    assert said == f"error: no store at {missing}: give --db the store's path"
    assert not missing.exists() and not (tmp_path / "o").exists()
    full = tmp_path / "full"
    (full / "x").mkdir(parents=True)
    said = _cli("export", "--parquet", str(full), "--db", str(store), code=2)
    assert said == f"error: {full}: exists and is not an empty folder; give a new folder for the export"
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    said = _cli("export", "--parquet", str(blocked / "out"), "--db", str(store), code=2)
    assert said.startswith(f"error: {blocked / 'out'}: cannot write there (")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "full"]
    assert [p.name for p in full.iterdir()] == ["x"]
