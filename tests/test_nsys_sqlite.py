"""Nsight Systems SQLite exports built as the export documents its tables (Nsight Systems "SQLite Export
Schema Reference": StringIds, CUPTI_ACTIVITY_KIND_KERNEL/MEMCPY/MEMSET/RUNTIME, NVTX_EVENTS with jsonText,
META_DATA_EXPORT's EXPORT_SCHEMA_VERSION) holding NCCL's own NVTX ranges as NCCL v2.30.3-1 opens them
(src/collectives.cc: an `ncclAllReduce` range whose payload "Message size [bytes]" is count x type size),
and hostile databases refused by name."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from commlens.service.ingest import ingest_paths

TABLES = """
CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE META_DATA_EXPORT (name TEXT, value TEXT);
CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INT NOT NULL, end INT NOT NULL, deviceId INT NOT NULL,
    contextId INT NOT NULL, streamId INT NOT NULL, correlationId INT, globalPid INT, demangledName INT NOT NULL,
    shortName INT NOT NULL);
CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INT NOT NULL, end INT NOT NULL, deviceId INT NOT NULL,
    contextId INT NOT NULL, streamId INT NOT NULL, correlationId INT, globalPid INT, bytes INT NOT NULL,
    copyKind INT NOT NULL);
CREATE TABLE CUPTI_ACTIVITY_KIND_MEMSET (start INT NOT NULL, end INT NOT NULL, deviceId INT NOT NULL,
    contextId INT NOT NULL, streamId INT NOT NULL, correlationId INT, globalPid INT, value INT NOT NULL,
    bytes INT NOT NULL);
CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INT NOT NULL, end INT NOT NULL, eventClass INT NOT NULL,
    globalTid INT, correlationId INT, nameId INT NOT NULL, returnValue INT NOT NULL);
CREATE TABLE NVTX_EVENTS (start INT NOT NULL, end INT, eventType INT NOT NULL, rangeId INT, category INT,
    color INT, text TEXT, globalTid INT, endGlobalTid INT, textId INT, domainId INT, uint64Value INT,
    int64Value INT, doubleValue REAL, uint32Value INT, int32Value INT, floatValue REAL, jsonTextId INT,
    jsonText TEXT);
"""

TID = 281474976710656  # a globalTid as nsys serialises (pid << 24 | tid)


def build(path: Path, version: str = "3.11.1", extra: str = "") -> None:
    """One rank: ncclCommInitRank (4 ranks, comm 0xabc), two AllReduce of 4 MiB (f32) and one AllGather of
    1 MiB per rank (bf16) launched inside their NCCL ranges, a GEMM, a HtoD copy and a memset."""
    con = sqlite3.connect(path)
    con.executescript(TABLES + extra)
    con.executemany(
        "INSERT INTO StringIds VALUES (?, ?)",
        [
            (1, "ncclDevKernel_AllReduce_Sum_f32_RING_LL"),
            (2, "ncclDevKernel_AllGather_RING_LL"),
            (3, "ampere_sgemm_128x64_tn"),
            (4, "cudaLaunchKernel"),
        ],
    )
    con.executemany(
        "INSERT INTO META_DATA_EXPORT VALUES (?, ?)",
        [("EXPORT_SCHEMA_VERSION", version), ("EXPORT_PRODUCT_VERSION", "2024.5.1")],
    )

    def nvtx(start: int, end: int, text: str, payload: dict[str, int]) -> tuple[object, ...]:
        return (
            start,
            end,
            59,
            None,
            None,
            None,
            text,
            TID,
            None,
            None,
            0,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            json.dumps(payload),
        )

    con.executemany(
        "INSERT INTO NVTX_EVENTS VALUES (" + ",".join("?" * 19) + ")",
        [
            nvtx(
                1_000,
                2_000,
                "ncclCommInitRank",
                {"NCCL communicator ID": 2748, "No. of ranks": 4, "Rank": 1, "CUDA device": 0},
            ),
            nvtx(10_000, 11_000, "ncclAllReduce", {"NCCL communicator ID": 2748, "Message size [bytes]": 4 << 20}),
            nvtx(20_000, 21_000, "ncclAllReduce", {"NCCL communicator ID": 2748, "Message size [bytes]": 4 << 20}),
            nvtx(30_000, 31_000, "ncclAllGather", {"NCCL communicator ID": 2748, "Message size [bytes]": 1 << 20}),
        ],
    )
    con.executemany(
        "INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, 1, ?, ?, 4, 0)",
        [(10_500, 10_600, TID, 101), (20_500, 20_600, TID, 102), (30_500, 30_600, TID, 103), (5_000, 5_100, TID, 100)],
    )
    con.executemany(
        "INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, 0, 1, ?, ?, 1, ?, ?)",
        [
            (6_000, 9_000, 7, 100, 3, 3),  # compute on stream 7
            (12_000, 52_000, 13, 101, 1, 1),
            (60_000, 100_000, 13, 102, 1, 1),
            (110_000, 130_000, 13, 103, 2, 2),
        ],
    )
    con.execute("INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY VALUES (1000, 3000, 0, 1, 7, 99, 1, 65536, 1)")
    con.execute("INSERT INTO CUPTI_ACTIVITY_KIND_MEMSET VALUES (3000, 3500, 0, 1, 7, 98, 1, 0, 4096)")
    con.commit()
    con.close()


def test_nccl_kernels_sized_by_their_nvtx_ranges_and_the_timeline(con, tmp_path: Path) -> None:
    path = tmp_path / "report.rank1.sqlite"
    build(path)
    [f] = ingest_paths(con, [path], "nsys").files
    assert (f.kind, f.rank, f.events, f.status, f.warnings) == ("nsys_sqlite", 1, 3, "ok", [])
    assert con.execute(
        "SELECT rank, op, dtype, msg_bytes, ts_us, dur_us, source_kind FROM comms ORDER BY ts_us"
    ).fetchall() == [
        (1, "all_reduce", "float32", 4 << 20, 12.0, 40.0, "nsys_sqlite"),
        (1, "all_reduce", "float32", 4 << 20, 60.0, 40.0, "nsys_sqlite"),
        (1, "all_gather", None, 4 << 20, 110.0, 20.0, "nsys_sqlite"),  # S = 1 MiB x 4 ranks
    ]
    assert con.execute(
        "SELECT kind, stream, start_us, end_us, nbytes FROM timeline_intervals ORDER BY start_us"
    ).fetchall() == [
        ("memcpy_htod", 7, 1.0, 3.0, 65536),
        ("memset", 7, 3.0, 3.5, 4096),
        ("compute", 7, 6.0, 9.0, 0),
        ("comm", 13, 12.0, 52.0, 0),
        ("comm", 13, 60.0, 100.0, 0),
        ("comm", 13, 110.0, 130.0, 0),
    ]
    meta = json.loads(con.execute("SELECT meta FROM sources").fetchone()[0])
    assert meta == {"format": "nsys_sqlite", "export_schema_version": "3.11.1", "devices": [0]}


@pytest.mark.parametrize(
    ("extra", "version", "error"),
    [
        (
            "CREATE TRIGGER t AFTER INSERT ON StringIds BEGIN SELECT abs(1); END;",
            "3.11.1",
            "sqlite_master: SQLite trigger 't': refused (an Nsight Systems export has none)",
        ),
        (
            "CREATE VIEW v AS SELECT readfile('/etc/passwd') AS x FROM StringIds;",
            "3.11.1",
            "sqlite_master: SQLite view 'v' calls functions: refused",
        ),
        ("", "9.0.0", "META_DATA_EXPORT.EXPORT_SCHEMA_VERSION: Nsight Systems export schema 9.0.0 is unknown"),
    ],
)
def test_hostile_or_unknown_databases_are_refused_by_name_and_nothing_stored_is_lost(
    con, tmp_path: Path, extra: str, version: str, error: str
) -> None:
    good = tmp_path / "good.rank0.sqlite"
    build(good)
    ingest_paths(con, [good], "r")
    bad = tmp_path / "bad.rank1.sqlite"
    build(bad, version, extra)
    [f] = ingest_paths(con, [bad], "r").files
    assert f.status == "failed" and f.kind == "nsys_sqlite"
    assert (f.error or "").startswith(f"{bad}:{error}")
    assert con.execute("SELECT count(*) FROM comm_events").fetchone() == (3,)


def test_attach_and_unknown_tables_are_denied_by_the_authorizer(tmp_path: Path) -> None:
    from commlens.ingest.nsys_sqlite import _open

    path = tmp_path / "x.sqlite"
    build(path, extra="CREATE TABLE secrets (s TEXT);")
    db = _open(path)
    try:
        with pytest.raises(sqlite3.DatabaseError, match="not authorized"):
            db.execute(f"ATTACH DATABASE '{tmp_path / 'y.sqlite'}' AS y")
        with pytest.raises(sqlite3.DatabaseError, match=r"access to secrets\.s is prohibited"):
            db.execute("SELECT s FROM secrets")
        with pytest.raises(sqlite3.DatabaseError, match="not authorized"):
            db.execute("SELECT upper(value) FROM StringIds")
        with pytest.raises(sqlite3.DatabaseError, match="not authorized"):
            db.execute("PRAGMA writable_schema = 1")
        assert db.execute("SELECT id FROM StringIds").fetchall() == [(1,), (2,), (3,), (4,)]
    finally:
        db.close()


def test_a_sqlite_file_that_is_no_export_says_so(con, tmp_path: Path) -> None:
    path = tmp_path / "other.rank0.db"
    c = sqlite3.connect(path)
    c.execute("CREATE TABLE t (x INT)")
    c.commit()
    c.close()
    [f] = ingest_paths(con, [path], "other").files
    assert f.status == "failed" and "not an Nsight Systems export" in (f.error or "")
