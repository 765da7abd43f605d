"""NCCL Inspector output built exactly as NVIDIA/nccl v2.30.3-1 writes it (plugins/profiler/inspector/
inspector_json.cc at commit 5067397c: header {id, comm_name, rank, n_ranks, nnodes}, metadata
{inspector_output_format_version "v4.0", git_rev, rec_mechanism, dump_timestamp_us, hostname, pid},
coll_perf / p2p_perf; 2.28's records without comm_name), one file per process named <host>-pid<pid>.log."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from commlens.service.ingest import ingest_paths

WORLD, TP = "0x7f8c496ae9f661", "0xe62dedaa97644a"


def record(comm: str, rank: int, n: int, host: str, pid: int, perf: dict[str, Any], name: bool = True) -> str:
    header: dict[str, Any] = {"id": comm, "rank": rank, "n_ranks": n, "nnodes": 1}
    if name:  # 2.30 writes comm_name after id; 2.28-2.29 do not
        header = {"id": comm, "comm_name": "unknown", "rank": rank, "n_ranks": n, "nnodes": 1}
    rec = {
        "header": header,
        "metadata": {
            "inspector_output_format_version": "v4.0",
            "git_rev": "",
            "rec_mechanism": "nccl_profiler_interface",
            "dump_timestamp_us": 1752867229276385,
            "hostname": host,
            "pid": pid,
        },
        "coll_perf" if "coll" in perf else "p2p_perf": perf,
    }
    return json.dumps(rec, separators=(",", ":"))


def coll(op: str, sn: int, size: int, us: int, n: int) -> dict[str, Any]:
    """coll_perf with the plugin's own algbw/busbw (inspector.cc: traffic = size x n for AllGather and
    ReduceScatter; busbw = algbw x 2(n-1)/n for AllReduce, (n-1)/n for AllGather/ReduceScatter)."""
    traffic = size * n if op in ("AllGather", "ReduceScatter") else size
    algbw = traffic / 1e9 / (us * 1e-6)
    factor = {"AllReduce": 2 * (n - 1) / n, "AllGather": (n - 1) / n, "ReduceScatter": (n - 1) / n}.get(op, 1.0)
    return {
        "coll": op,
        "coll_sn": sn,
        "coll_msg_size_bytes": size,
        "coll_exec_time_us": us,
        "coll_timing_source": "kernel_gpu",
        "coll_algobw_gbs": round(algbw, 6),
        "coll_busbw_gbs": round(algbw * factor, 6),
    }


def write_job(root: Path) -> None:
    """Four processes on two hosts: a world communicator of 4 (3 AllReduce of 64 MiB each), and a
    communicator of 2 over global ranks 2 and 3 (2 AllGather of 1 MiB per rank, comm ranks 0 and 1)."""
    root.mkdir()
    for g in range(4):
        host, pid = f"node{g // 2}", 1000 + g
        lines = [record(WORLD, g, 4, host, pid, coll("AllReduce", sn, 64 << 20, 900 + sn, 4)) for sn in range(3)]
        if g >= 2:
            lines += [record(TP, g - 2, 2, host, pid, coll("AllGather", sn, 1 << 20, 50, 2), False) for sn in range(2)]
        text = "\n".join(lines) + "\n"
        if g == 3:
            (root / f"{host}-pid{pid}.jsonl.gz").write_bytes(gzip.compress(text.encode()))
        else:
            (root / f"{host}-pid{pid}.log").write_text(text)


def test_a_directory_of_inspector_files_is_one_run_with_global_ranks(con, tmp_path: Path) -> None:
    write_job(tmp_path / "nccl-inspector-unknown-jobid")
    summary = ingest_paths(con, [tmp_path / "nccl-inspector-unknown-jobid"], "insp")
    assert (
        sorted((f.kind, f.events, f.status) for f in summary.files)
        == [("nccl_inspector", 3, "ok")] * 2 + [("nccl_inspector", 5, "ok")] * 2
    )
    rows = con.execute(
        """SELECT rank, op, msg_bytes, group_key, group_size, count(*) FROM comms WHERE run = 'insp'
           GROUP BY ALL ORDER BY ALL"""
    ).fetchall()
    assert rows == [
        (0, "all_reduce", 64 << 20, f"nccl:{WORLD}", 4, 3),
        (1, "all_reduce", 64 << 20, f"nccl:{WORLD}", 4, 3),
        (2, "all_gather", 2 << 20, f"nccl:{TP}", 2, 2),  # S = per-rank bytes x 2 ranks (formats.md A.3)
        (2, "all_reduce", 64 << 20, f"nccl:{WORLD}", 4, 3),
        (3, "all_gather", 2 << 20, f"nccl:{TP}", 2, 2),
        (3, "all_reduce", 64 << 20, f"nccl:{WORLD}", 4, 3),
    ]
    groups = con.execute("SELECT group_key, ranks FROM process_groups ORDER BY 1").fetchall()
    assert groups == [(f"nccl:{WORLD}", [0, 1, 2, 3]), (f"nccl:{TP}", [2, 3])]
    durs = con.execute("SELECT dur_us FROM comms WHERE rank = 0 AND op = 'all_reduce' ORDER BY dur_us").fetchall()
    assert durs == [(900.0,), (901.0,), (902.0,)]
    meta = json.loads(con.execute("SELECT meta FROM sources WHERE path LIKE '%pid1003%'").fetchone()[0])
    assert (meta["busbw_checked"], meta["busbw_disagreeing"], meta["records"]) == (5, 0, "per_call")


def test_busbw_that_disagrees_with_ours_is_named(con, tmp_path: Path) -> None:
    perf = coll("AllReduce", 0, 1 << 20, 100, 4)
    perf["coll_busbw_gbs"] = 99.0
    path = tmp_path / "h-pid1.log"
    path.write_text(record(WORLD, 0, 4, "h", 1, perf) + "\n")
    [f] = ingest_paths(con, [path], "bw").files
    assert f.status == "ok"
    assert f.warnings == [
        "line 1: $.coll_perf: busbw 99 GB/s in the record, 15.7286 GB/s by commlens's factors "
        "(all_reduce, 1048576 B, 100 us, 4 ranks)"
    ]


def test_p2p_records_and_nan_bandwidth(con, tmp_path: Path) -> None:
    p2p = {
        "p2p": "Send",
        "p2p_sn": 4,
        "p2p_peer": 1,
        "p2p_msg_size_bytes": 8192,
        "p2p_exec_time_us": 0,
        "p2p_timing_source": "kernel_gpu",
        "p2p_algobw_gbs": "nan",
        "p2p_busbw_gbs": "nan",
    }
    path = tmp_path / "h-pid2.log"
    path.write_text(record(WORLD, 0, 2, "h", 2, p2p) + "\n")
    [f] = ingest_paths(con, [path], "p2p").files
    assert f.status == "ok" and f.warnings == []
    assert con.execute("SELECT op, msg_bytes, peer, dur_us FROM comm_events").fetchall() == [("send", 8192, 1, 0.0)]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            '{"header":{"id":"0x1","rank":0,"n_ranks":2,"nnodes":1},"metadata":{"inspector_output_format_versi'
            'on":"v4.0","hostname":"h","pid":1},"coll_perf":{"coll":"AllRed',
            "line 1: truncated JSON record",
        ),
        (
            '{"header":{"id":"0x1","rank":0,"n_ranks":2,"nnodes":1},"metadata":{"inspector_output_format_version":'
            '"v9.0","hostname":"h","pid":1},"coll_perf":{}}\n',
            "line 1: $.metadata.inspector_output_format_version: inspector_output_format_version 'v9.0' is unknown",
        ),
        (
            '{"header":{"id":"0x1","rank":5,"n_ranks":2,"nnodes":1},"metadata":{"inspector_output_format_version":'
            '"v4.0","hostname":"h","pid":1},"coll_perf":{}}\n',
            "line 1: $.header.rank: rank 5 outside the communicator's 2 ranks",
        ),
    ],
)
def test_bad_records_fail_the_file_by_line_and_nothing_stored_is_lost(
    con, tmp_path: Path, text: str, error: str
) -> None:
    good = tmp_path / "good-pid1.log"
    good.write_text(record(WORLD, 0, 2, "good", 1, coll("AllReduce", 0, 1 << 20, 10, 2)) + "\n")
    ingest_paths(con, [good], "r")
    bad = tmp_path / "bad-pid2.log"
    bad.write_text(text)
    [f] = ingest_paths(con, [bad], "r").files
    assert f.status == "failed" and f.kind == "nccl_inspector"
    assert f.error == f"{bad}:{error}" or (f.error or "").startswith(f"{bad}:{error}")
    assert con.execute("SELECT count(*) FROM comm_events").fetchone() == (1,)


def test_prometheus_output_is_refused_by_name(con, tmp_path: Path) -> None:
    path = tmp_path / "nccl_inspector.prom"
    path.write_text(
        'nccl_bus_bandwidth_gbs{version="v5.1",slurm_job_id="unknown",node="nvl72004-T01",gpu="GPU0",'
        'comm_name="DP Group 0",n_nodes="1",nranks="4",collective="AllReduce",message_size="4-5GB",'
        'algo_proto="Ring_ll"} 678.263\n'
    )
    [f] = ingest_paths(con, [path], "prom").files
    assert f.status == "failed" and f.kind == "nccl_inspector_prom"
    assert "without call counts" in (f.error or "")


def _two_rank_log(path: Path, calls: int) -> None:
    """The NCCL log of tests/test_nccl_log.py: two processes of one world communicator (commId 0xfeed)."""
    lines = [
        f"node1:{100 + r}:{200 + r} [{r}] NCCL INFO comm 0x5{r} rank {r} nranks 2 cudaDev {r} nvmlDev {r} "
        f"busId {r}000 commId 0xfeed - Init COMPLETE"
        for r in range(2)
    ]
    lines += [
        f"node1:{100 + r}:{200 + r} [{r}] NCCL INFO AllReduce: opCount {i:x} sendbuff 0x1 recvbuff 0x2 "
        f"count 1024 datatype 7 op 0 root 0 comm 0x5{r} [nranks=2] stream 0x3"
        for i in range(calls)
        for r in range(2)
    ]
    path.write_text("\n".join(lines) + "\n")


def test_a_mixed_run_counts_every_call_once(con, tmp_path: Path, data_dir: Path) -> None:
    """Rank 0: the real DDP ResNet-50 profiler trace (rank 0 of 2), an NCCL log and Inspector records; rank 1:
    the log and Inspector records. Rank 0 counts from its trace, rank 1 from its log; nothing twice."""
    log = tmp_path / "nccl.node1.log"
    _two_rank_log(log, calls=6)
    insp = tmp_path / "inspector"
    insp.mkdir()
    for r in range(2):
        lines = [record("0xfeed", r, 2, "node1", 100 + r, coll("AllReduce", sn, 4096, 20, 2)) for sn in range(6)]
        (insp / f"node1-pid{100 + r}.log").write_text("\n".join(lines) + "\n")
    trace = data_dir / "kineto-hta" / "nccl_parser_config" / "nccl_data.json.gz"
    ingest_paths(con, [insp], "mixed")
    assert con.execute("SELECT rank, count(*) FROM comms GROUP BY rank ORDER BY rank").fetchall() == [(0, 6), (1, 6)]
    ingest_paths(con, [log], "mixed")
    ingest_paths(con, [trace], "mixed")
    per_rank = con.execute(
        "SELECT rank, source_kind, count(*) FROM comms WHERE run = 'mixed' GROUP BY ALL ORDER BY ALL"
    ).fetchall()
    assert per_rank == [(0, "kineto", 21), (1, "nccl_log", 6)]
    assert con.execute(
        "SELECT s.kind, count(*) FROM comm_events e JOIN sources s USING (source_id) WHERE NOT e.counted GROUP BY 1 "
        "ORDER BY 1"
    ).fetchall() == [("nccl_inspector", 12), ("nccl_log", 6)]
    # Inspector and the log name the same communicator (commId = Inspector's header.id)
    assert con.execute("SELECT DISTINCT group_key FROM comm_events WHERE group_key LIKE 'nccl:%'").fetchall() == [
        ("nccl:0xfeed",)
    ]
