"""`commlens ingest --cluster` checked as a user runs it: one folder mixing Kineto traces, NCCL logs, a .tar.gz
archive and a broken trace, on a real Dask LocalCluster (2 worker processes), against the single-process ingest
of the same folder, every table row for row; then the scheduler addresses a user gets wrong."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

from commlens.cli import app

from .conftest import shared_data

distributed = pytest.importorskip("distributed", reason="dask[distributed] is not installed (extra `cluster`)")

MIXED = (
    "kineto-param/dlrm_kineto.tar.gz",  # 8 ranks of one job in an archive
    "kineto-hta/nccl_parser_config/nccl_data.json.gz",
    "kineto-hta/rank_non_gpu/rank_non_gpu.json.gz",
    "nccl-logs/nvidia-nccl-1193.log",
    "nccl-logs/nvidia-nccl-203.log",
    "nccl-logs/nvidia-nccl-584.log",
)
# a trace cut off inside its second event
BROKEN = b'{"schemaVersion": 1, "distributedInfo": {"rank": 1}, "traceEvents": [{"ph": "X", "ts": 1}, {"ph": "X"'


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=":0"
    ) as c:
        yield c.scheduler_address


def _ingest(db: Path, *args: str, code: int = 0) -> str:
    result = CliRunner().invoke(app, ["ingest", *args, "--db", str(db), "--run", "job"])
    assert result.exit_code == code, result.output
    return " ".join(result.output.split())


def _differences(a: Path, b: Path) -> dict[str, tuple[int, int, int]]:
    """Every table of store `a`: (rows, rows only in a, rows only in b) as multisets, clock times left out."""
    with duckdb.connect() as con:
        con.execute(f"ATTACH '{a}' AS a (READ_ONLY)")
        con.execute(f"ATTACH '{b}' AS b (READ_ONLY)")
        tables = [
            r[0] for r in con.execute("SELECT table_name FROM duckdb_tables() WHERE database_name = 'a'").fetchall()
        ]
        rows = {}
        for t in tables:
            cols = ", ".join(
                f'"{r[0]}"'
                for r in con.execute(
                    "SELECT column_name FROM duckdb_columns() WHERE database_name = 'a' AND table_name = ? "
                    "AND data_type NOT LIKE 'TIMESTAMP%' ORDER BY column_index",
                    [t],
                ).fetchall()
            )
            n = con.execute(f'SELECT count(*) FROM a."{t}"').fetchone()
            x = con.execute(f'SELECT count(*) FROM (SELECT {cols} FROM a."{t}" EXCEPT ALL SELECT {cols} FROM b."{t}")')
            only_a = x.fetchone()
            y = con.execute(f'SELECT count(*) FROM (SELECT {cols} FROM b."{t}" EXCEPT ALL SELECT {cols} FROM a."{t}")')
            only_b = y.fetchone()
            assert n and only_a and only_b
            rows[t] = (int(n[0]), int(only_a[0]), int(only_b[0]))
    return rows


def test_mixed_folder_equals_single_process(cluster: str, tmp_path: Path) -> None:
    folder = tmp_path / "job"
    folder.mkdir()
    for path in MIXED:
        (folder / Path(path).name).symlink_to(shared_data() / path)
    broken = folder / "broken.json"
    broken.write_bytes(BROKEN)
    single, dask = tmp_path / "single.duckdb", tmp_path / "dask.duckdb"
    said = _ingest(single, str(folder), code=1)
    assert _ingest(dask, str(folder), "--cluster", cluster, "--parquet-out", str(tmp_path / "parts"), code=1) == said
    rows = _differences(single, dask)
    assert {t: r for t, r in rows.items() if r[1] or r[2]} == {}
    assert rows["sources"][0] == 14 and rows["comm_events"][0] == 64 + 21 + 6 + 4 + 7 + 7
    assert rows["runs"][0] == 6  # the DLRM job, and a run for each file of another job
    with duckdb.connect(str(dask), read_only=True) as con:
        error = con.execute("SELECT error FROM sources WHERE status = 'failed'").fetchall()
    end = len(BROKEN) + 1  # the column just past the last byte
    assert error == [(f"{broken}:line 1 column {end}: truncated JSON: the document ends inside $.traceEvents[1]",)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("tcp://127.0.0.1:{port}", "cannot reach the Dask scheduler (Connection refused)"),
        ("http://127.0.0.1:8786", "not a Dask scheduler address (unknown address scheme 'http'"),
        ("scheduler-without-port", "not a Dask scheduler address (missing port number in address"),
    ],
)
def test_a_scheduler_address_that_cannot_work_is_said_at_once(tmp_path: Path, address: str, reason: str) -> None:
    """Refused or malformed: said before the store is opened, so no store file is made and nothing parsed; a
    refused connection is said as such (Dask's own connect retries it for 30 s, then says it timed out)."""
    address = address.format(port=_free_port())
    db = tmp_path / "new.duckdb"
    said = _ingest(db, str(shared_data() / MIXED[1]), "--cluster", address, code=2)
    assert said.startswith(f"error: --cluster {address}: {reason}")
    assert list(tmp_path.iterdir()) == []


def test_a_dataset_folder_that_holds_files_is_refused(cluster: str, tmp_path: Path) -> None:
    """The parts would mix with what the folder holds: refused before anything is parsed or stored."""
    parts = tmp_path / "parts"
    (parts / "comm_events" / "run=old").mkdir(parents=True)
    db = tmp_path / "s.duckdb"
    said = _ingest(db, str(shared_data() / MIXED[1]), "--cluster", cluster, "--parquet-out", str(parts), code=2)
    assert said == (
        f"error: --parquet-out {parts}: a folder that is not empty; give a new or empty folder for the dataset"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["parts"] and [p.name for p in parts.iterdir()] == [
        "comm_events"
    ]
    (parts / "comm_events" / "run=old").rmdir()
    (parts / "comm_events").rmdir()
    _ingest(db, str(shared_data() / MIXED[1]), "--cluster", cluster, "--parquet-out", str(parts))  # empty: taken
    assert (parts / "comm_events" / "run=job" / "rank=0").is_dir()
