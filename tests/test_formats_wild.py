"""Flight Recorder, NCCL Inspector and Nsight Systems inputs in the shapes their projects write and users
produce (checked against pytorch/pytorch FlightRecorder*.hpp and torch/distributed/flight_recorder,
NVIDIA/nccl plugins/profiler/inspector, the Nsight Systems SQLite schema); each input is built here."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

from commlens.service.ingest import ingest_paths


def fr_entry(record: int, name: str, ins: list[list[int]], outs: list[list[int]], seq: int, **kw: Any) -> dict:
    """One entry with the keys ProcessGroupNCCL writes (dump version 2.10), completed with timing."""
    e = {
        "record_id": record,
        "pg_id": 0,
        "process_group": ("0", "default_pg"),
        "thread_name": "pt_main_thread",
        "thread_id": "140000000000000",
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": record + 1,
        "profiling_name": name,
        "time_created_ns": 1_750_000_000_000_000_000 + 1_000_000 * record,
        "duration_ms": 0.25,
        "input_sizes": ins,
        "input_dtypes": ["BFloat16"] * len(ins),
        "output_sizes": outs,
        "output_dtypes": ["BFloat16"] * len(outs),
        "state": "completed",
        "time_discovered_started_ns": 1_750_000_000_000_000_000 + 1_000_000 * record + 1000,
        "time_discovered_completed_ns": 1_750_000_000_000_000_000 + 1_000_000 * record + 2000,
        "retired": True,
        "timeout_ms": 600000,
        "is_p2p": False,
        "frames": [{"name": "all_reduce", "filename": "distributed_c10d.py", "line": 2800}],
    }
    e.update(kw)
    return e


def fr_dump(entries: list[dict], version: str = "2.10") -> dict:
    return {
        "version": version,
        "comm_lib_version": "2.27.5",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}},
        "pg_status": {
            "0": {"last_enqueued_collective": 3, "last_started_collective": 3, "last_completed_collective": 3}
        },
        "entries": entries,
    }


def _fr_rows(con, tmp_path: Path, dump: dict) -> list[tuple]:
    path = tmp_path / "nccl_trace_rank_0"
    path.write_bytes(pickle.dumps(dump, protocol=2))
    summary = ingest_paths(con, [path], "fr")
    assert [f.status for f in summary.files] == ["ok"], summary.files
    return con.execute(
        "SELECT op, dtype, msg_bytes, elems_in, elems_out, peer FROM comms WHERE run = 'fr' ORDER BY ts_us"
    ).fetchall()


def test_flight_recorder_sizes_every_tensor_of_a_coalesced_or_list_call(con, tmp_path: Path) -> None:
    """allreduce_coalesced (and all_gather_into_tensor_coalesced, gloo's list all_gather) record one shape per
    tensor: S was the first tensor's bytes; it is all of them, as Kineto's summed In/Out msg nelems."""
    rows = _fr_rows(
        con,
        tmp_path,
        fr_dump(
            [
                fr_entry(0, "nccl:allreduce_coalesced", [[100], [200], [4, 75]], [[100], [200], [4, 75]], 1),
                fr_entry(1, "gloo:all_gather", [[8]], [[8], [8], [8], [8]], 2),
            ]
        ),
    )
    assert rows == [
        ("all_reduce", "bfloat16", 1200, 600, 600, None),
        ("all_gather", "bfloat16", 64, 8, 32, None),
    ]


def test_flight_recorder_slow_path_coalesced_all_gather_is_one_call_sized_by_its_parts(con, tmp_path: Path) -> None:
    """Dump 2.7+: an all_gather of unequal tensors records a _broadcast_oop per rank (same collective_seq_id)
    and ends with 'nccl:ALLGATHER_coalesced' without sizes; reduce_scatter likewise with _reduce_oop and
    'nccl:REDUCE_SCATTER_coalesced'. The end entry was a size-less all_gather, the reduce_scatter lost."""
    parts_ag = [fr_entry(i, "nccl:_broadcast_oop", [[n]], [[n]], 1) for i, n in enumerate((10, 20, 30, 40))]
    parts_rs = [fr_entry(5 + i, "nccl:_reduce_oop", [[n]], [[n]], 2) for i, n in enumerate((1, 2, 3, 4))]
    rows = _fr_rows(
        con,
        tmp_path,
        fr_dump(
            [
                *parts_ag,
                fr_entry(4, "nccl:ALLGATHER_coalesced", [], [], 1),
                *parts_rs,
                fr_entry(9, "nccl:REDUCE_SCATTER_coalesced", [], [], 2),
            ]
        ),
    )
    assert [r[:3] for r in rows] == [("all_gather", "bfloat16", 200), ("reduce_scatter", "bfloat16", 20)]
    stored = con.execute("SELECT op, msg_bytes, collective_seq FROM fr_entries ORDER BY record_id").fetchall()
    assert stored == [("all_gather", 200, 1), ("reduce_scatter", 20, 2)]


def test_flight_recorder_send_and_recv_name_their_peer_as_a_global_rank(con, tmp_path: Path) -> None:
    """ProcessGroupNCCL names point-to-point entries 'nccl:send 0->1' / 'nccl:recv 0<-1' (group ranks, the peer
    second, as torch/distributed/flight_recorder/components/types.py Op reads them); peer was NULL. It is
    the peer's global rank, through the group's pg_config ranks."""
    dump = fr_dump(
        [
            fr_entry(0, "nccl:send 0->1", [[64]], [[64]], 0, p2p_seq_id=1, is_p2p=True, process_group=("1", "pp")),
            fr_entry(1, "nccl:recv 0<-1", [[64]], [[64]], 0, p2p_seq_id=2, is_p2p=True, process_group=("1", "pp")),
        ]
    )
    dump["pg_config"]["1"] = {"name": "1", "desc": "pp", "ranks": "[2, 3]"}
    rows = _fr_rows(con, tmp_path, dump)
    assert rows == [("send", "bfloat16", 128, 64, 64, 3), ("recv", "bfloat16", 128, 64, 64, 3)]


def test_flight_recorder_dump_version_1_x_keeps_group_and_sequence(con, tmp_path: Path) -> None:
    """Torch 2.2-2.3 dumps (version "1.x", TraceUtils.h) name the sequence "seq_id", the group only by
    "pg_id" (pg_config: pg_id -> [ranks]) and record no dtypes: group and sequence were NULL, so the hang
    analysis had nothing to compare. They are now read; sizes stay unknown, with a warning."""
    entries = [
        {
            "record_id": i,
            "pg_id": 0,
            "seq_id": i + 1,
            "op_id": i + 1,
            "profiling_name": "nccl:all_reduce",
            "time_created_ns": 1_710_000_000_000_000_000 + 1000 * i,
            "input_sizes": [[1024]],
            "output_sizes": [[1024]],
            "state": "scheduled",
            "time_discovered_started_ns": None,
            "time_discovered_completed_ns": None,
            "retired": False,
            "frames": [],
        }
        for i in range(2)
    ]
    path = tmp_path / "nccl_trace_rank_1"
    path.write_bytes(pickle.dumps({"entries": entries, "version": "1.4", "pg_config": {0: [0, 1]}}, protocol=2))
    summary = ingest_paths(con, [path], "old")
    [f] = summary.files
    assert f.status == "ok" and any("records no input_dtypes" in w for w in f.warnings)
    stored = con.execute("SELECT group_key, group_ranks, collective_seq, msg_bytes FROM fr_entries").fetchall()
    assert stored == [("pg:0", [0, 1], 1, None), ("pg:0", [0, 1], 2, None)]


def test_flight_recorder_dump_of_no_entry_is_a_dump_that_says_so(con, tmp_path: Path) -> None:
    """torch leaves "entries" out of a dump whose buffer is empty: the JSON went to another format's parser and the
    pickle failed as 'not a Flight Recorder dump'."""
    dump = fr_dump([])
    del dump["entries"]
    json_path = tmp_path / "host-rank1.json"
    json_path.write_text(json.dumps(dump))
    pickled = tmp_path / "nccl_trace_rank_2"
    pickled.write_bytes(pickle.dumps(dump, protocol=2))
    summary = ingest_paths(con, [json_path, pickled], "fr")
    assert [(f.kind, f.status) for f in summary.files] == [("flight_recorder", "ok")] * 2, summary.files
    for f in summary.files:
        assert any("holds no entry" in w for w in f.warnings), f.warnings
    assert con.execute("SELECT count(*) FROM comms WHERE run = 'fr'").fetchone() == (0,)
