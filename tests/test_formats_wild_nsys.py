"""NCCL Inspector output and Nsight Systems SQLite exports in the shapes their sources write, where commlens
read them wrong (found by the formats review helper). Inputs are built here.

Inspector: NVIDIA/nccl plugins/profiler/inspector (v2.30.3-1; ext-profiler/inspector from 2.28.3-1):
inspector_json.cc writes one record per call; `coll_sn` is `eDescr->coll.seqNumber`, which NCCL sets from
`comm->seqNumber[ct->func]` (src/plugin/profiler.cc): a counter per communicator and function."""

from __future__ import annotations

import json
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
