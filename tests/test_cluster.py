"""`commlens ingest --cluster` on a real Dask LocalCluster (2 worker processes on loopback) against the
single-process ingest of the same files, table by table and row by row; and `export --parquet` read back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

from commlens.cli import app
from commlens.store.tables import RUN_TABLES

from .conftest import shared_data

distributed = pytest.importorskip("distributed", reason="dask[distributed] is not installed (extra `cluster`)")

DLRM = "kineto-param/dlrm_kineto.tar.gz"
# Tables whose rows a run's ingest fills (users and the API's jobs stay empty in both stores).
COMPARED = ("runs", *(t for t in RUN_TABLES if t not in ("jobs", "review_items")))


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=":0"
    ) as c:
        yield c.scheduler_address


def _ingest(db: Path, *args: str, ok: bool = True) -> str:
    result = CliRunner().invoke(app, ["ingest", *args, "--db", str(db), "--run", "job"])
    assert result.exit_code == (0 if ok else 1), result.output
    return result.output


def _compare(single: Path, dask: Path) -> dict[str, tuple[int, int, int]]:
    """Every compared table's (rows, rows only in the single-process store, rows only in the cluster's)."""
    con = duckdb.connect()
    con.execute(f"ATTACH '{single}' AS single (READ_ONLY)")
    con.execute(f"ATTACH '{dask}' AS dask (READ_ONLY)")
    rows = {table: _diff(con, table) for table in COMPARED}
    con.close()
    return rows


def _columns(con: duckdb.DuckDBPyConnection, table: str) -> str:
    """The table's columns but its clock times (when each store was written)."""
    rows = con.execute(
        "SELECT column_name FROM duckdb_columns() WHERE database_name = 'single' AND table_name = ? "
        "AND data_type NOT LIKE 'TIMESTAMP%' ORDER BY column_index",
        [table],
    ).fetchall()
    return ", ".join(f'"{r[0]}"' for r in rows)


def _diff(con: duckdb.DuckDBPyConnection, table: str) -> tuple[int, int, int]:
    """(rows, rows only in the single-process store, rows only in the cluster's), as multisets."""
    cols = _columns(con, table)
    n = con.execute(f"SELECT count(*) FROM single.{table}").fetchone()
    a = con.execute(
        f"SELECT count(*) FROM (FROM (SELECT {cols} FROM single.{table}) EXCEPT ALL FROM (SELECT {cols} FROM dask.{table}))"
    ).fetchone()
    b = con.execute(
        f"SELECT count(*) FROM (FROM (SELECT {cols} FROM dask.{table}) EXCEPT ALL FROM (SELECT {cols} FROM single.{table}))"
    ).fetchone()
    assert n is not None and a is not None and b is not None
    return int(n[0]), int(a[0]), int(b[0])


def test_cluster_ingest_equals_single_process(cluster: str, tmp_path: Path) -> None:
    """The 8-rank DLRM archive: its members dealt out over both workers."""
    archive = shared_data() / DLRM
    single, dask, dataset = tmp_path / "single.duckdb", tmp_path / "dask.duckdb", tmp_path / "parts"
    _ingest(single, str(archive))
    _ingest(dask, str(archive), "--cluster", cluster, "--parquet-out", str(dataset))
    rows = _compare(single, dask)
    assert {t: r for t, r in rows.items() if r[1] or r[2]} == {}
    # the 8-rank DLRM job: its calls, intervals, aggregates and time tables all came through
    assert rows["sources"][0] == 8
    assert rows["comm_events"][0] == 64  # 8 calls per rank in the profiled step
    assert {t: rows[t][0] for t in ("timeline_intervals", "steps", "comm_agg")} == {
        "timeline_intervals": 2241,
        "steps": 8,
        "comm_agg": 56,
    }
    # the workers' dataset: hive partitions per run and rank, readable as it is
    ranks = duckdb.sql(
        f"SELECT DISTINCT rank FROM read_parquet('{dataset}/comm_events/*/*/*.parquet', hive_partitioning = true) "
        "ORDER BY 1"
    ).fetchall()
    assert [r[0] for r in ranks] == list(range(8))


def test_cluster_ingest_of_folders_splits_jobs_and_names_bad_files(cluster: str, tmp_path: Path) -> None:
    """Folders of traces of different jobs (split into a run each), a broken file and a README: the same runs,
    rows, failure and error text as the single-process ingest, the bad file named."""
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "broken.json.gz").write_bytes(b"\x1f\x8b\x08\x00garbage")
    (extra / "README.md").write_text("notes")
    hta = shared_data() / "kineto-hta"
    paths = [str(hta / "distributed_info_unavailable"), str(hta / "rank_non_gpu"), str(extra)]
    single, dask = tmp_path / "single.duckdb", tmp_path / "dask.duckdb"
    said = _ingest(single, *paths, ok=False)
    assert _ingest(dask, *paths, "--cluster", cluster, ok=False) == said
    assert f"{extra / 'broken.json.gz'}:byte" in said
    rows = _compare(single, dask)
    assert {t: r for t, r in rows.items() if r[1] or r[2]} == {}
    assert rows["runs"][0] == 2 and rows["sources"][0] == 3 and rows["comm_events"][0] == 12


def test_cluster_reads_and_writes_through_fsspec_urls(tmp_path: Path) -> None:
    """Inputs and dataset as fsspec URLs (an in-memory filesystem, shared by a cluster of one thread in this
    process: fsspec's memory files are shared objects whose read position two threads would move under each
    other): the archive is read through fsspec, the dataset written and attached through it."""
    import fsspec

    memory = fsspec.filesystem("memory")
    memory.pipe("/cluster-test/in/dlrm_kineto.tar.gz", (shared_data() / DLRM).read_bytes())
    try:
        with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as c:
            db = tmp_path / "s.duckdb"
            args = ("memory://cluster-test/in", "--cluster", c.scheduler_address)
            _ingest(db, *args, "--parquet-out", "memory://cluster-test/parts", "--one-run")
        assert memory.glob("/cluster-test/parts/comm_events/run=job/rank=7/*.parquet")
    finally:
        memory.rm("/cluster-test", recursive=True)
    con = duckdb.connect(str(db), read_only=True)
    files = con.execute("SELECT path FROM sources ORDER BY path").fetchall()
    calls = con.execute("SELECT count(*) FROM comms").fetchone()
    con.close()
    assert len(files) == 8 and all(f[0].startswith("memory://cluster-test/in/dlrm_kineto.tar.gz!") for f in files)
    assert calls == (64,)


def test_a_worker_failure_names_the_file(cluster: str, tmp_path: Path) -> None:
    """A dataset folder the workers cannot write: every file fails, named, with the worker's error."""
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    path = shared_data() / "kineto-hta" / "rank_non_gpu"
    said = _ingest(tmp_path / "s.duckdb", str(path), "--cluster", cluster, "--parquet-out", str(blocked), ok=False)
    assert f"{path / 'rank_non_gpu.json.gz'}: failed on a cluster worker" in " ".join(said.split())
