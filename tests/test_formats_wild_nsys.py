"""NCCL Inspector output and Nsight Systems SQLite exports in the shapes their sources write, where commlens
read them wrong (found by the formats review helper). Inputs are built here.

Inspector: NVIDIA/nccl plugins/profiler/inspector (v2.30.3-1; ext-profiler/inspector from 2.28.3-1):
inspector_json.cc writes one record per call; `coll_sn` is `eDescr->coll.seqNumber`, which NCCL sets from
`comm->seqNumber[ct->func]` (src/plugin/profiler.cc): a counter per communicator and function."""

from __future__ import annotations

import json
import sqlite3
import struct
from pathlib import Path
from typing import Any

from commlens.service.ingest import ingest_paths

COMM = "0x7f8c496ae9f661"


def inspector_record(rank: int, pid: int, perf: dict[str, Any]) -> str:
    return json.dumps(
        {
            "header": {"id": COMM, "comm_name": "unknown", "rank": rank, "n_ranks": 2, "nnodes": 1},
            "metadata": {
                "inspector_output_format_version": "v4.0",
                "git_rev": "",
                "rec_mechanism": "nccl_profiler_interface",
                "dump_timestamp_us": 1752867229276385,
                "hostname": "node0",
                "pid": pid,
            },
            "coll_perf": perf,
        },
        separators=(",", ":"),
    )


def coll(op: str, sn: int, size: int, us: int) -> dict[str, Any]:
    """coll_perf of a 2-rank communicator with the plugin's own algbw/busbw (inspector.cc)."""
    traffic = size * 2 if op in ("AllGather", "ReduceScatter") else size
    algbw = traffic / 1e9 / (us * 1e-6)
    factor = 1.0 if op == "AllReduce" else 0.5
    return {
        "coll": op,
        "coll_sn": sn,
        "coll_msg_size_bytes": size,
        "coll_exec_time_us": us,
        "coll_timing_source": "kernel_gpu",
        "coll_algobw_gbs": float(f"{algbw:f}"),
        "coll_busbw_gbs": float(f"{algbw * factor:f}"),
    }


def test_inspector_coll_sn_counts_per_function_so_calls_of_two_ops_are_all_matched(con, tmp_path: Path) -> None:
    """AllReduce and AllGather interleaved on one communicator: both have coll_sn 0, 1. Keyed by coll_sn
    alone, each AllGather took its AllReduce's key and the AllReduce instances were lost from matching."""
    job = tmp_path / "job"
    job.mkdir()
    for r in range(2):
        perfs = [
            coll("AllReduce", 0, 1 << 20, 100),
            coll("AllGather", 0, 1 << 16, 50),
            coll("AllReduce", 1, 1 << 20, 100),
            coll("AllGather", 1, 1 << 16, 50),
        ]
        text = "\n".join(inspector_record(r, 100 + r, p) for p in perfs) + "\n"
        (job / f"node0-pid{100 + r}.log").write_text(text)
    files = ingest_paths(con, [job], "insp").files
    assert sorted((f.kind, f.events, f.warnings) for f in files) == [("nccl_inspector", 4, [])] * 2
    (run_id,) = con.execute("SELECT run_id FROM runs WHERE name = 'insp'").fetchone()
    rows = con.execute(
        "SELECT op, msg_bytes, members, keyed_by FROM time_instances WHERE run_id = ? ORDER BY instance_id",
        [run_id],
    ).fetchall()
    assert sorted(rows) == sorted([("all_reduce", 1 << 20, 2, "key")] * 2 + [("all_gather", 1 << 17, 2, "key")] * 2)
    assert con.execute("SELECT count(*) FROM time_mismatches WHERE run_id = ?", [run_id]).fetchone() == (0,)
    # op_count stays the record's own coll_sn
    assert con.execute(
        "SELECT op, list(op_count ORDER BY seq) FROM comm_events WHERE run_id = ? AND rank = 0 GROUP BY op ORDER BY op",
        [run_id],
    ).fetchall() == [("all_gather", [0, 1]), ("all_reduce", [0, 1])]


# Nsight Systems: NVTX_EVENTS as recent exports declare it (binaryData after jsonText), NCCL's payload schemas
# in NVTX_PAYLOAD_SCHEMAS / NVTX_PAYLOAD_SCHEMA_ENTRIES (the first entry's offset NULL), schema ids
# NVTX_PAYLOAD_ENTRY_TYPE_SCHEMA_ID_STATIC_START (1 << 24) + NVTX_SID_* of NCCL's src/include/nvtx.h.
NSYS_TABLES = """
CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE META_DATA_EXPORT (name TEXT, value TEXT);
CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INT NOT NULL, end INT NOT NULL, deviceId INT NOT NULL,
    contextId INT NOT NULL, streamId INT NOT NULL, correlationId INT, globalPid INT, demangledName INT NOT NULL,
    shortName INT NOT NULL);
CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INT NOT NULL, end INT NOT NULL, eventClass INT NOT NULL,
    globalTid INT, correlationId INT, nameId INT NOT NULL, returnValue INT NOT NULL);
CREATE TABLE NVTX_EVENTS (start INT NOT NULL, end INT, eventType INT NOT NULL, rangeId INT, category INT,
    color INT, text TEXT, globalTid INT, endGlobalTid INT, textId INT, domainId INT, uint64Value INT,
    int64Value INT, doubleValue REAL, uint32Value INT, int32Value INT, floatValue REAL, jsonTextId INT,
    jsonText TEXT, binaryData BLOB);
CREATE TABLE NVTX_PAYLOAD_SCHEMAS (domainId INTEGER, schemaId INTEGER, name TEXT, type INTEGER, flags INTEGER,
    numEntries INTEGER, payloadSize INTEGER, alignTo INTEGER);
CREATE TABLE NVTX_PAYLOAD_SCHEMA_ENTRIES (domainId INTEGER NOT NULL, schemaId INTEGER NOT NULL,
    idx INTEGER NOT NULL, flags INTEGER, type INTEGER, name TEXT, description TEXT, arrayOrUnionDetail INTEGER,
    offset INTEGER);
"""
TID = 281474976710656
SID = 1 << 24
INIT, ALLGATHER, ALLREDUCE, ALLTOALL, REDOP = SID + 11, SID + 4, SID + 5, SID + 16, SID + 100


def blob(schema: int, payload: bytes, domain: int = 1) -> bytes:
    return struct.pack("<QQQQ", domain, schema, len(payload), 32) + payload


def build_binary_payload_export(path: Path, init: bool = True, alltoall: bool = False) -> None:
    """One rank of a 4-rank communicator 0xabc: an AllReduce of 4 MiB and an AllGather of 1 MiB per rank,
    their sizes only in binaryData (jsonText NULL), their names registered strings (textId). `init`: with the
    ncclCommInitRankConfig range giving the communicator's size; `alltoall`: and an AlltoAll of 256 KiB per
    peer (ncclDevKernel_SendRecv)."""
    con = sqlite3.connect(path)
    con.executescript(NSYS_TABLES)
    con.executemany(
        "INSERT INTO StringIds VALUES (?, ?)",
        [
            (1, "ncclDevKernel_AllReduce_Sum_f32_RING_LL"),
            (2, "ncclDevKernel_AllGather_RING_LL"),
            (4, "cudaLaunchKernel"),
            (10, "ncclCommInitRankConfig"),
            (11, "ncclAllReduce"),
            (12, "ncclAllGather"),
            (13, "ncclAlltoAll"),
            (14, "ncclDevKernel_SendRecv"),
        ],
    )
    con.execute("INSERT INTO META_DATA_EXPORT VALUES ('EXPORT_SCHEMA_VERSION', '3.11.1')")
    con.executemany(
        "INSERT INTO NVTX_PAYLOAD_SCHEMAS VALUES (1, ?, NULL, 1, NULL, ?, ?, NULL)",
        [(INIT, 4, 24), (ALLREDUCE, 3, 24), (ALLGATHER, 2, 16), (ALLTOALL, 2, 16)],
    )
    entries = [
        (INIT, 0, 18, "NCCL communicator ID", None),
        (INIT, 1, 5, "No. of ranks", 8),
        (INIT, 2, 5, "Rank", 12),
        (INIT, 3, 5, "CUDA device", 16),
        (ALLREDUCE, 0, 18, "NCCL communicator ID", None),
        (ALLREDUCE, 1, 22, "Message size [bytes]", 8),
        (ALLREDUCE, 2, REDOP, "Reduction operation", 16),
        (ALLGATHER, 0, 18, "NCCL communicator ID", None),
        (ALLGATHER, 1, 22, "Message size [bytes]", 8),
        (ALLTOALL, 0, 18, "NCCL communicator ID", None),
        (ALLTOALL, 1, 22, "Message size [bytes]", 8),
    ]
    con.executemany(
        "INSERT INTO NVTX_PAYLOAD_SCHEMA_ENTRIES VALUES (1, ?, ?, NULL, ?, ?, NULL, NULL, ?)",
        entries,
    )
    nvtx = "INSERT INTO NVTX_EVENTS (start, end, eventType, globalTid, textId, domainId, binaryData) VALUES "
    ranges = [
        (10_000, 11_000, TID, 11, blob(ALLREDUCE, struct.pack("<QQii", 0xABC, 4 << 20, 0, 0))),
        (30_000, 31_000, TID, 12, blob(ALLGATHER, struct.pack("<QQ", 0xABC, 1 << 20))),
    ]
    launches, kernels = (
        [(10_500, 10_600, TID, 101), (30_500, 30_600, TID, 103)],
        [(12_000, 52_000, 101, 1, 1), (110_000, 130_000, 103, 2, 2)],
    )
    if init:
        ranges.append((1_000, 2_000, TID, 10, blob(INIT, struct.pack("<Qiiii", 0xABC, 4, 1, 0, 0))))
    if alltoall:
        ranges.append((40_000, 41_000, TID, 13, blob(ALLTOALL, struct.pack("<QQ", 0xABC, 256 << 10))))
        launches.append((40_500, 40_600, TID, 104))
        kernels.append((140_000, 150_000, 104, 14, 14))
    con.executemany(nvtx + "(?, ?, 59, ?, ?, 1, ?)", ranges)
    con.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, 1, ?, ?, 4, 0)", launches)
    con.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, 0, 1, 13, ?, 1, ?, ?)", kernels)
    con.commit()
    con.close()


def test_nsys_nccl_payloads_in_binary_data_size_the_calls(con, tmp_path: Path) -> None:
    """Exports hold NCCL's NVTX payloads as binaryData against NVTX_PAYLOAD_SCHEMA_ENTRIES, jsonText NULL:
    only jsonText was read, so every call was unsized (and all_gather lost its communicator size)."""
    path = tmp_path / "report.rank1.sqlite"
    build_binary_payload_export(path)
    [f] = ingest_paths(con, [path], "nsys").files
    assert (f.kind, f.rank, f.events, f.status, f.warnings) == ("nsys_sqlite", 1, 2, "ok", [])
    assert con.execute(
        "SELECT op, dtype, msg_bytes, ts_us, dur_us FROM comms WHERE run = 'nsys' ORDER BY ts_us"
    ).fetchall() == [("all_reduce", "float32", 4 << 20, 12.0, 40.0), ("all_gather", None, 4 << 20, 110.0, 20.0)]


def test_nsys_alltoall_without_the_communicator_size_is_unsized_not_zero(con, tmp_path: Path) -> None:
    """ncclAlltoAll's payload is count x type size per peer, S = that x nranks (as for AllGather). Without an
    ncclCommInit* range giving nranks the AlltoAll was stored with S = 0 (payload x 0); it is now unknown, with
    a warning naming why, and payload x nranks where the range is there."""
    bare, full = tmp_path / "bare.rank1.sqlite", tmp_path / "full.rank1.sqlite"
    build_binary_payload_export(bare, init=False, alltoall=True)
    build_binary_payload_export(full, init=True, alltoall=True)
    [f] = ingest_paths(con, [bare], "bare").files
    assert f.events == 3
    assert len(f.warnings) == 1 and "ncclCommInit" in f.warnings[0] and f.warnings[0].startswith("2 all_gather/")
    [g] = ingest_paths(con, [full], "full").files
    assert g.warnings == []
    rows = con.execute("SELECT run, op, msg_bytes FROM comms WHERE run IN ('bare', 'full') ORDER BY run, ts_us")
    assert rows.fetchall() == [
        ("bare", "all_reduce", 4 << 20),
        ("bare", "all_gather", None),
        ("bare", "all_to_all", None),
        ("full", "all_reduce", 4 << 20),
        ("full", "all_gather", 4 << 20),
        ("full", "all_to_all", 1 << 20),
    ]


def test_inspector_invalid_records_say_what_they_are(con, tmp_path: Path) -> None:
    """The plugin writes "Invalid" for the functions its name lookup lacks (AlltoAll, Gather, Scatter): the skip
    says so, instead of calling it no communication op."""
    path = tmp_path / "node0-pid100.log"
    bad = {**coll("AllReduce", 0, 1 << 20, 100), "coll": "Invalid", "coll_algobw_gbs": 0.0, "coll_busbw_gbs": 0.0}
    path.write_text(
        inspector_record(0, 100, coll("AllReduce", 0, 1 << 20, 100)) + "\n" + inspector_record(0, 100, bad) + "\n"
    )
    (f,) = ingest_paths(con, [path], "insp").files
    assert (f.kind, f.events) == ("nccl_inspector", 1)
    assert f.skipped == {"a call the plugin names 'Invalid' (its AlltoAll, Gather and Scatter): op unknown": 1}
