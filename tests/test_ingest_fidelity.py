"""Issue 13: every class of real log and trace that used to fail or lose calls, each on real input (log
excerpts pasted into public issues, with their source; traces from the shared data) and on a synthetic
case built as the NCCL / RCCL / PyTorch source prints it, with exact store counts."""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from commlens.ingest.inputs import DEFAULT_LIMITS
from commlens.ingest.kineto import parse_kineto
from commlens.ingest.kineto_events import KERNEL_BEFORE_WINDOW
from commlens.ingest.nccl_log import parse_nccl_log
from commlens.ingest.records import ParseResult, RankHint
from commlens.service.ingest import ingest_paths


def parse_log(text: str) -> ParseResult:
    return parse_nccl_log(io.BufferedReader(io.BytesIO(text.encode())), "t.log", RankHint(), DEFAULT_LIMITS)


def parse_trace(doc: dict[str, Any]) -> ParseResult:
    return parse_kineto(io.BufferedReader(io.BytesIO(json.dumps(doc).encode())), "t.json", RankHint(), DEFAULT_LIMITS)


def ingest_text(con, tmp_path: Path, name: str, text: str, run: str) -> int:
    path = tmp_path / name
    path.write_text(text)
    summary = ingest_paths(con, [path], run)
    assert [f.status for f in summary.files] == ["ok"], summary.files
    return int(con.execute("SELECT run_id FROM runs WHERE name = ?", [run]).fetchone()[0])


def comms_rows(con, run_id: int) -> list[tuple]:
    return con.execute(
        "SELECT rank, op, dtype, msg_bytes, group_size FROM comm_events WHERE run_id = ? AND counted "
        "ORDER BY rank, seq",
        [run_id],
    ).fetchall()


def skipped(con, run_id: int) -> dict[str, int]:
    return json.loads(con.execute("SELECT skipped FROM sources WHERE run_id = ?", [run_id]).fetchone()[0])


# ------------------------------------------------------------------ 1. COLL lines that lose their tail

# NVIDIA/nccl#1238 (https://github.com/NVIDIA/nccl/issues/1238), NCCL 2.18-era, one COLL line as pasted.
REAL_1238 = (
    "ip-172-31-54-74:30125:30125 [0] NCCL INFO AllReduce: opCount 0 sendbuff 0x7fc9c4000000 recvbuff "
    "0x7fc9bc000000 count 33554432 datatype 7 op 0 root 0 comm 0x5631f0816b40 [nranks=1] stream 0x5631f0021140"
)


def test_coll_lines_wrapped_cut_or_without_stream_count_the_call(tmp_path, con):
    """NCCL's format (src/enqueue.cc, 2.3 to today): "%s: opCount %lx sendbuff %p recvbuff %p count %zu
    datatype %d op %d root %d comm %p [nranks=%d] stream %p". Everything a call needs precedes `stream`."""
    head, _, pointer = REAL_1238.rpartition(" ")
    lines = [
        REAL_1238,
        head,  # wrapped after "stream": the pointer went to the next line
        pointer,
        REAL_1238.split(" stream ")[0],  # cut before "stream"
        REAL_1238.split(" stream ")[0] + " str",  # cut inside "stream"
        REAL_1238.split(" [nranks=")[0],  # cut before [nranks=...]: not countable
    ]
    run_id = ingest_text(con, tmp_path, "wrapped.log", "\n".join(lines) + "\n", "wrapped")
    # no Init line: the process's rank is unknown
    assert comms_rows(con, run_id) == [(None, "all_reduce", "float32", 134217728, 1)] * 4
    assert skipped(con, run_id) == {"COLL line cut or garbled": 1}


# ------------------------------------------------------------------ 2. lines without the envelope


def test_unprefixed_paste_is_one_process_mapped_through_its_init_line(tmp_path, con):
    """People paste the message alone ("NCCL INFO AllReduce: ..."): the real lines of NVIDIA/nccl#1238
    without their host:pid:tid [dev], and the Init line NCCL 2.18 prints for that communicator."""
    msg = REAL_1238.split("[0] ", 1)[1]
    lines = [
        "NCCL INFO comm 0x5631f0816b40 rank 0 nranks 1 cudaDev 0 nvmlDev 0 busId 101c0 commId 0x1f - Init COMPLETE",
        *[msg.replace("opCount 0", f"opCount {i}") for i in range(3)],
        "> " + msg,  # Markdown quoting
    ]
    res = parse_log("\n".join(lines))
    assert [(e["process"], e["seq"], e["op_count"], e["group_key"]) for e in res.events] == [
        ("unknown/cuda:0", i, c, "nccl:ptr:unknown/cuda:0:0x5631f0816b40:n1") for i, c in enumerate([0, 1, 2, 0])
    ]
    assert [(c["comm_ptr"], c["comm_rank"], c["nranks"], c["bus_id"]) for c in res.nccl_comms] == [
        ("0x5631f0816b40", 0, 1, "101c0")
    ]
    assert res.warnings == ["t.log:line 1: lines without the host:pid:tid [dev] envelope: read as one process"]
    assert not res.skipped
    run_id = ingest_text(con, tmp_path, "bare.log", "\n".join(lines) + "\n", "bare")
    assert comms_rows(con, run_id) == [(0, "all_reduce", "float32", 134217728, 1)] * 4
    assert (
        con.execute("SELECT group_key FROM comm_events WHERE run_id = ?", [run_id]).fetchall() == [("nccl:0x1f",)] * 4
    )


def test_unprefixed_lines_after_enveloped_ones_stay_skipped():
    """Once a file has shown host:pid:tid envelopes, a bare line is damage, not a second process."""
    res = parse_log(
        REAL_1238 + "\nNCCL INFO AllReduce: opCount 1 sendbuff 0x1 recvbuff 0x1 count 1 datatype 7 "
        "op 0 root 0 comm 0xdead [nranks=2] stream 0x2\n"
    )
    assert [e["process"] for e in res.events] == ["ip-172-31-54-74:30125"]
    assert dict(res.skipped) == {"COLL line without its host:pid:tid [dev] prefix (comm pointer not seen elsewhere)": 1}


# ------------------------------------------------------------------ 3. NCCL 2.4 and older

# NVIDIA/nccl#226 (https://github.com/NVIDIA/nccl/issues/226), NCCL 2.4, 64 ranks over sockets.
REAL_226 = """\
ip-172-31-0-119:45328:45333 [0] NCCL INFO Ring 00 : 35 -> 34 [send] via NET/Socket/0
ip-172-31-5-237:45266:45271 [0] NCCL INFO Trees [0] 22->23->-1/-1/-1
ip-172-31-7-247:45553:45558 [0] NCCL INFO comm 0x7efe60002250 rank 15 nranks 64 cudaDev 0 nvmlDev 0 - Init COMPLETE
ip-172-31-4-37:45379:45384 [0] NCCL INFO Ring 00 : 34 -> 33 [receive] via NET/Socket/0
"""


def test_nccl_2_4_init_rings_trees_and_connections():
    res = parse_log(REAL_226)
    assert [
        (c["host"], c["comm_ptr"], c["comm_rank"], c["nranks"], c["cuda_dev"], c["nvml_dev"]) for c in res.nccl_comms
    ] == [("ip-172-31-7-247", "0x7efe60002250", 15, 64, 0, 0)]
    assert [(t["host"], t["kind"], t["src_rank"], t["dst_rank"], t["transport"], t["ranks"]) for t in res.topology] == [
        ("ip-172-31-0-119", "connection", 35, 34, "NET/Socket/0", None),
        ("ip-172-31-5-237", "tree", None, None, None, [-1, -1, -1, 23, 22]),  # children, rank, parent
        ("ip-172-31-4-37", "connection", 34, 33, "NET/Socket/0", None),
    ]
    assert not res.skipped


def test_nccl_2_4_ring_lines_as_init_cc_prints_them():
    """NCCL 2.4 src/init.cc buildRings: rank 0 prints dumpLine(ring, nranks, "Channel %02d : "), each rank
    as " %3d", the line padded with blanks to 115 characters; P2P connections print
    "Ring %02d : %d -> %d via P2P/IPC" (no [send]/[receive], no bus ids)."""
    ring = ("Channel 00 : " + "".join(f" {r:3d}" for r in (0, 1, 3, 2))).ljust(115)
    log = "\n".join(
        [
            f"h:7:8 [0] NCCL INFO {ring}",
            "h:7:8 [0] NCCL INFO Ring 00 : 0 -> 1 via P2P/IPC",
            "h:7:8 [0] NCCL INFO Trees [0] -1->0->1/-1/-1 [1] -1->0->1/-1/-1",
            "h:7:8 [0] NCCL INFO comm 0x11 rank 0 nranks 4 cudaDev 0 nvmlDev 0 - Init COMPLETE",
        ]
    )
    res = parse_log(log)
    assert [
        (t["kind"], t["comm_ptr"], t["channel"], t["ranks"], t["src_rank"], t["dst_rank"], t["transport"])
        for t in res.topology
    ] == [
        ("ring", "0x11", 0, [0, 1, 3, 2], None, None, None),
        ("connection", "0x11", 0, None, 0, 1, "P2P/IPC"),
        ("tree", "0x11", 0, [1, -1, -1, 0, -1], None, None, None),
        ("tree", "0x11", 1, [1, -1, -1, 0, -1], None, None, None),
    ]
    assert not res.skipped and not res.warnings


# ------------------------------------------------------------------ 6. RCCL logs

# ROCm/ROCm#6074 (https://github.com/ROCm/ROCm/issues/6074), comment 1: RCCL 2.27.7 on ROCm 7.2, two
# Radeon RX 7900 XTX, torchrun --nproc_per_node=2. RCCL adds "acc %p" before count and "task %d globalrank
# %d" after the stream; its version banner is "RCCL version : x.y.z-HEAD:hash" inside an INFO line.
REAL_ROCM_6074 = """\
TARS:829507:829507 [0] NCCL INFO RCCL version : 2.27.7-HEAD:0d2c4fd
HIP version  : 7.2.26015-fc0010cf6a
ROCm version : 7.2.0.0-43-fc0010cf6a
TARS:829508:829508 [1] NCCL INFO RCCL version : 2.27.7-HEAD:0d2c4fd
TARS:829507:829550 [0] NCCL INFO ncclCommInitRankConfig_impl comm 0x2bc1f840 rank 0 nranks 2 cudaDev 0 nvmlDev 0 busId 3000 commId 0xcde2ea451c75c2ba - Init START
TARS:829508:829551 [1] NCCL INFO ncclCommInitRankConfig_impl comm 0x3ab1b680 rank 1 nranks 2 cudaDev 1 nvmlDev 1 busId d000 commId 0xcde2ea451c75c2ba - Init START
TARS:829508:829551 [1] NCCL INFO Ring 0 : 0 -> 1 -> 0 comm 0x3ab1b680 nRanks 02 busId d000
TARS:829507:829550 [0] NCCL INFO Channel 00/02 : 0 1
TARS:829507:829550 [0] NCCL INFO Channel 00/0 : 0[3000] -> 1[d000] via P2P/IPC comm 0x2bc1f840 nRanks 02
TARS:829508:829551 [1] NCCL INFO Channel 00/0 : 1[d000] -> 0[3000] via P2P/IPC comm 0x3ab1b680 nRanks 02
TARS:829507:829550 [0] NCCL INFO ncclCommInitRankConfig_impl comm 0x2bc1f840 rank 0 nranks 2 cudaDev 0 nvmlDev 0 busId 3000 commId 0xcde2ea451c75c2ba - Init COMPLETE
TARS:829508:829551 [1] NCCL INFO ncclCommInitRankConfig_impl comm 0x3ab1b680 rank 1 nranks 2 cudaDev 1 nvmlDev 1 busId d000 commId 0xcde2ea451c75c2ba - Init COMPLETE
TARS:829507:829507 [0] NCCL INFO AllReduce: opCount 0 sendbuff 0x7973d6e00400 recvbuff 0x7973d6e00400 acc (nil) count 1 datatype 7 op 0 root 0 comm 0x2bc1f840 [nranks=2] stream (nil) task 0 globalrank 0
TARS:829507:829507 [0] NCCL INFO pre-adjustment threadThreshold:16 nBytes:4 nc:2
TARS:829508:829508 [1] NCCL INFO AllReduce: opCount 0 sendbuff 0x7a1bf0a00400 recvbuff 0x7a1bf0a00400 acc (nil) count 1 datatype 7 op 0 root 0 comm 0x3ab1b680 [nranks=2] stream (nil) task 0 globalrank 1
[rank=1 local_rank=1] barrier passed
TARS:829508:829508 [1] NCCL INFO AllReduce: opCount 1 sendbuff 0x7a1bf0a00000 recvbuff 0x7a1bf0a00000 acc (nil) count 1 datatype 7 op 0 root 0 comm 0x3ab1b680 [nranks=2] stream (nil) task 0 globalrank 1
TARS:829507:829507 [0] NCCL INFO AllReduce: opCount 1 sendbuff 0x7973d6e00000 recvbuff 0x7973d6e00000 acc (nil) count 1 datatype 7 op 0 root 0 comm 0x2bc1f840 [nranks=2] stream (nil) task 0 globalrank 0
TARS:829508:829627 [1] NCCL INFO comm 0x3ab1b680 rank 1 nranks 2 cudaDev 1 busId d000 - Destroy COMPLETE
"""


def test_rccl_log_of_rocm_7_2_links_two_ranks(tmp_path, con):
    res = parse_log(REAL_ROCM_6074)
    assert res.meta["library"] == "rccl" and res.meta["nccl_version"] == "2.27.7-HEAD:0d2c4fd"
    assert [(e["process"], e["op_count"], e["msg_bytes"]) for e in res.events] == [
        ("TARS:829507", 0, 4),
        ("TARS:829508", 0, 4),
        ("TARS:829508", 1, 4),
        ("TARS:829507", 1, 4),
    ]
    assert not res.skipped
    run_id = ingest_text(con, tmp_path, "rccl.log", REAL_ROCM_6074, "rccl")
    assert (
        comms_rows(con, run_id) == [(0, "all_reduce", "float32", 4, 2)] * 2 + [(1, "all_reduce", "float32", 4, 2)] * 2
    )
    assert con.execute("SELECT DISTINCT group_key FROM comm_events WHERE run_id = ?", [run_id]).fetchall() == [
        ("nccl:0xcde2ea451c75c2ba",)
    ]
    assert con.execute(
        "SELECT kind, src_rank, dst_rank, transport FROM nccl_topology WHERE run_id = ? AND kind = 'connection' "
        "ORDER BY src_rank",
        [run_id],
    ).fetchall() == [("connection", 0, 1, "P2P/IPC"), ("connection", 1, 0, "P2P/IPC")]


# ------------------------------------------------------------------ 9. NCCL 2.27+: opCount stays 0


def _log_2_27(pid: int, rank: int) -> list[str]:
    """Two processes of one node under NCCL 2.27 (NVIDIA/nccl#2021: "2.27+ single node, opCount always
    0"): the 2.23+ Init line, then 3 iterations of [AllReduce 4096 float32, AllGather 256 bf16] whose
    opCount never moves."""
    env = f"node:{pid}:{pid} [{rank}] NCCL INFO "
    lines = [
        f"{env}ncclCommInitRankConfig comm 0x{pid}0 rank {rank} nranks 2 cudaDev {rank} nvmlDev {rank} "
        f"busId {rank + 1}000 commId 0xab27 - Init COMPLETE"
    ]
    for _ in range(3):
        for name, count, dt in (("AllReduce", 4096, 7), ("AllGather", 256, 9)):
            lines.append(
                f"{env}{name}: opCount 0 sendbuff 0x1 recvbuff 0x2 count {count} datatype {dt} op 0 root 0 "
                f"comm 0x{pid}0 [nranks=2] stream 0x3"
            )
    return lines


def test_nccl_2_27_zero_opcounts_keep_order_and_iterations(tmp_path, con):
    text = "\n".join(a for pair in zip(_log_2_27(11, 0), _log_2_27(12, 1), strict=True) for a in pair)
    run_id = ingest_text(con, tmp_path, "nccl227.log", text + "\n", "n227")
    rows = con.execute(
        "SELECT rank, seq, op, msg_bytes, op_count FROM comm_events WHERE run_id = ? ORDER BY rank, seq", [run_id]
    ).fetchall()
    assert rows == [
        (r, i, op, size, 0)
        for r in (0, 1)
        for i, (op, size) in enumerate([("all_reduce", 16384), ("all_gather", 1024)] * 3)
    ]
    assert con.execute(
        "SELECT rank, iterations FROM process_iterations WHERE run_id = ? ORDER BY rank", [run_id]
    ).fetchall() == [(0, 3), (1, 3)]


# ------------------------------------------------------------------ Kineto traces


def _trace(events: list[dict[str, Any]], pg: bool = True, **top: Any) -> dict[str, Any]:
    dist: dict[str, Any] = {"backend": "nccl", "rank": 0, "world_size": 2}
    if pg:
        dist["pg_config"] = [
            {"pg_name": "0", "pg_desc": "default_pg", "backend_config": "cuda:nccl", "pg_size": 2, "ranks": [0, 1]}
        ]
    return {"distributedInfo": dist, "traceEvents": events, **top}


def _x(name: str, cat: str, ts: float, dur: float, tid: int = 1, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


RPC_META = {
    "Collective name": "allreduce",
    "In msg nelems": 1024,
    "Out msg nelems": 1024,
    "dtype": "Float",
    "Group size": 2,
    "Process Group Name": "0",
}
KERNEL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


# ------------------------------------------------------------------ 4. kernels launched before the window


def test_real_trace_kernels_launched_outside_the_window_are_skipped():
    """HTA's negative_queue_length trace: 5 SendRecv kernels whose cudaLaunchKernel is not in the trace."""
    from conftest import shared_data

    path = shared_data() / "kineto-hta/negative_queue_length_values_check/rank0.json.gz"
    with gzip.open(path) as f:
        res = parse_kineto(io.BufferedReader(f), path.name, RankHint(), DEFAULT_LIMITS)  # type: ignore[arg-type]
    assert len(res.events) == 85
    assert res.skipped[KERNEL_BEFORE_WINDOW] == 5


def test_kernel_of_a_call_issued_before_the_window_is_no_call():
    """Correlation-linked traces (kineto before 2024): the first kernel's cudaLaunchKernel is missing."""
    events = [
        _x("ProfilerStep#3", "user_annotation", 0, 1000),
        _x(KERNEL, "kernel", 10, 30, tid=7, correlation=3, stream=7),  # launched before the window
        _x("record_param_comms", "cpu_op", 100, 10, **RPC_META, **{"External id": 5}),
        _x("cudaLaunchKernel", "cuda_runtime", 105, 2, correlation=9, **{"External id": 9}),
        _x(KERNEL, "kernel", 120, 50, tid=7, correlation=9, stream=7),
    ]
    res = parse_trace(_trace(events))
    assert [(e["op"], e["msg_bytes"], e["ts_us"], e["dur_us"], e["step"]) for e in res.events] == [
        ("all_reduce", 4096, 120, 50, 3)
    ]
    assert dict(res.skipped) == {KERNEL_BEFORE_WINDOW: 1}
    comm = res.intervals.filter(pa_equal(res.intervals["kind"], "comm"))
    assert list(zip(comm["start_us"].to_pylist(), comm["end_us"].to_pylist(), strict=True)) == [(10, 40), (120, 170)]


def test_kernel_without_external_id_in_an_external_id_trace_is_no_call():
    """Newer kineto links kernels to their op by External id; a kernel without one has no op in the trace."""
    events = [_x("ProfilerStep#1", "user_annotation", 0, 10_000)]
    for i in range(20):
        t = 100 + i * 100
        events += [
            _x("record_param_comms", "cpu_op", t, 10, **RPC_META, **{"External id": i + 1}),
            _x("cudaLaunchKernel", "cuda_runtime", t + 5, 2, correlation=1000 + i, **{"External id": i + 1}),
            _x(KERNEL, "kernel", t + 20, 30, tid=7, correlation=1000 + i, stream=7, **{"External id": i + 1}),
        ]
    events.append(_x(KERNEL, "kernel", 5, 30, tid=7, correlation=999, stream=7))
    res = parse_trace(_trace(events))
    assert res.meta["scan"]["kernel_link"] == "external_id"
    assert len(res.events) == 20 and {e["msg_bytes"] for e in res.events} == {4096}
    assert dict(res.skipped) == {KERNEL_BEFORE_WINDOW: 1}


@pytest.mark.parametrize("bad, shown", [("abc", '"abc"'), (1.5, "1.5"), (True, "true")])
def test_a_count_that_is_no_whole_number_is_named_and_sizes_nothing(bad: Any, shown: str) -> None:
    """An `In msg nelems` of "abc" was dropped without a word (the call sized from its other fields)."""
    events = [_x("ProfilerStep#1", "user_annotation", 0, 10_000)]
    for i in range(3):
        t = 100.25 + i * 100
        meta = RPC_META | {"In msg nelems": bad, "External id": i + 1}
        events += [
            _x("record_param_comms", "cpu_op", t, 10, **meta),
            _x("cudaLaunchKernel", "cuda_runtime", t + 5, 2, correlation=1000 + i, **{"External id": i + 1}),
            _x(KERNEL, "kernel", t + 20, 30, tid=7, correlation=1000 + i, stream=7, **{"External id": i + 1}),
        ]
    res = parse_trace(_trace(events))
    # sized by Out msg nelems (an all-reduce's output is its input); the bad count is not stored
    assert [(e["msg_bytes"], e["elems_in"], e["elems_out"]) for e in res.events] == [(4096, None, 1024)] * 3
    assert res.warnings == [
        f"record_param_comms at ts 100.25: 'In msg nelems' is {shown}, not a whole number: not used to size the call"
    ]


def pa_equal(column: Any, value: str) -> Any:
    import pyarrow.compute as pc

    return pc.equal(column, value)


# ------------------------------------------------------------------ 5. collectives outside NCCL and gloo


def test_symmetric_memory_collectives_and_their_wrapper_count_once():
    """PyTorch's symm_mem ops (torch/csrc/distributed/c10d/symm_mem/SymmetricMemory.cpp, torch 2.6+):
    `two_shot_all_reduce_(Tensor(a!) input, str reduce_op, str group_name)`,
    `multimem_all_gather_out(Tensor input, str group_name, Tensor(a!) out)`; vLLM's
    `vllm::all_reduce(Tensor tensor, str group_name)` wraps the first and is the same call."""
    bf16 = "c10::BFloat16"
    events = [
        _x("ProfilerStep#1", "user_annotation", 0, 1000),
        _x(
            "vllm::all_reduce",
            "cpu_op",
            100,
            50,
            **{"Input Dims": [[8, 4096], []], "Input type": [bf16, "str"], "Concrete Inputs": ["", "tp:0"]},
        ),
        _x(
            "symm_mem::two_shot_all_reduce_",
            "cpu_op",
            105,
            30,
            **{
                "Input Dims": [[8, 4096], [], []],
                "Input type": [bf16, "str", "str"],
                "Concrete Inputs": ["", "sum", "0"],
            },
        ),
        _x(
            "symm_mem::multimem_all_gather_out",
            "cpu_op",
            200,
            30,
            **{
                "Input Dims": [[8, 4096], [], [16, 4096]],
                "Input type": [bf16, "str", bf16],
                "Concrete Inputs": ["", "0", ""],
            },
        ),
        _x("symm_mem::memset32_", "cpu_op", 300, 5),  # not a collective: silent
        _x("trtllm::allreduce", "cpu_op", 400, 5),
        _x("trtllm::allreduce", "cpu_op", 500, 5),
    ]
    res = parse_trace(_trace(events))
    assert [
        (e["op"], e["raw_name"], e["dtype"], e["msg_bytes"], e["group_key"], e["group_size"]) for e in res.events
    ] == [
        ("all_reduce", "symm_mem::two_shot_all_reduce_", "bfloat16", 65536, "pg:0", 2),
        ("all_gather", "symm_mem::multimem_all_gather_out", "bfloat16", 131072, "pg:0", 2),
    ]
    assert "2 events named 'trtllm::allreduce' look like a collective but are not understood: not counted" in (
        res.warnings
    )
    assert not res.skipped


def test_wrapper_alone_is_a_call_sized_by_its_input():
    bf16 = "c10::BFloat16"
    events = [_x("vllm::all_reduce", "cpu_op", 100, 50, **{"Input Dims": [[4, 1024], []], "Input type": [bf16, "str"]})]
    res = parse_trace(_trace(events))
    assert [(e["op"], e["raw_name"], e["msg_bytes"]) for e in res.events] == [("all_reduce", "vllm::all_reduce", 8192)]


# ------------------------------------------------------------------ 6. RCCL traces (ROCm, MI series)


def test_rocm_trace_with_rccl_generic_kernels():
    """On ROCm the profiler names every RCCL kernel `ncclDevKernel_Generic(ncclDevComm*, channelMasks,
    ncclWork*)` (ROCm/roctracer#101, ROCm 6.0.1 on MI300X) and launches through hipExtLaunchKernel: the op
    comes from the CPU call, the duration from the kernel."""
    generic = "ncclDevKernel_Generic(ncclDevComm*, channelMasks, ncclWork*)"
    events = [
        _x("ProfilerStep#2", "user_annotation", 0, 1000),
        _x("record_param_comms", "cpu_op", 100, 10, **RPC_META, **{"External id": 5}),
        _x("hipExtLaunchKernel", "cuda_runtime", 105, 2, correlation=9, **{"External id": 9}),
        _x(generic, "kernel", 120, 50, tid=7, correlation=9, stream=7),
    ]
    doc = _trace(events, deviceProperties=[{"id": 0, "name": "AMD Instinct MI300X", "gcnArchName": "gfx942"}])
    doc["distributedInfo"]["nccl_version"] = "2.20.5"
    res = parse_trace(doc)
    assert [(e["op"], e["msg_bytes"], e["dur_us"], e["dur_source"]) for e in res.events] == [
        ("all_reduce", 4096, 50, "kernel")
    ]
    assert res.meta["devices"] == 1 and res.meta["nccl_version"] == "2.20.5"
    assert not res.skipped


@pytest.mark.parametrize("name", ["ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)"])
def test_rccl_sendrecv_kernel_alone_is_skipped_with_its_reason(name):
    """RCCL (ROCm/rccl#505) runs grouped calls in one SendRecv kernel: alone, it does not tell the op."""
    events = [
        _x("cudaLaunchKernel", "cuda_runtime", 105, 2, correlation=9, **{"External id": 9}),
        _x(name, "kernel", 120, 50, tid=7, correlation=9, stream=7),
    ]
    res = parse_trace(_trace(events))
    assert not res.events
    assert dict(res.skipped) == {
        "NCCL kernel with no CPU call, whose name does not tell the collective (SendRecv, Generic)": 1
    }


# ------------------------------------------------------------------ 7. text printed through rich


def test_cli_prints_bracketed_text_of_skip_reasons_and_names(tmp_path):
    """Rich reads "[...]" as markup: a skip reason naming "[dev]" and a run named "exp[1]" must print as is."""
    log = tmp_path / "garbled.log"
    log.write_text(REAL_1238 + "\nh1:11:12 NCCL INFO Channel 00/02 :    0   1\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "commlens.cli",
            "ingest",
            str(log),
            "--db",
            str(tmp_path / "s.duckdb"),
            "--run",
            "exp[1]",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "400"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "run exp[1]: files" in proc.stdout
    assert "NCCL INFO line without a '[dev] NCCL INFO' prefix (garbled): 1" in proc.stdout


def test_one_log_holding_two_jobs_says_so(tmp_path: Path) -> None:
    """Two jobs' logs in one file (two srun steps of a batch script, one output file): communicators that never
    meet, ranks 0-7 twice. It was stored as one run without a word, the second job's processes without ranks."""
    from nccl_bench import nccl_bench

    nccl_bench().write_interleaved(tmp_path / "a.log", 3_000, "2.21.5")
    first = (tmp_path / "a.log").read_text()
    # the same job again as another: new communicator ids, new pids (52100.. -> 62100..)
    second = re.sub(r"^([\w.-]+):52(\d{3}):", r"\1:62\2:", first.replace("0x6a00", "0x7b00"), flags=re.M)
    second = second.replace("0x5f3e9c2a1b7d4e60", "0x6f3e9c2a1b7d4e60")
    alone = parse_log(first)
    assert not [w for w in alone.warnings if "jobs:" in w]
    both = parse_log(first + second)
    (said,) = [w for w in both.warnings if " jobs: " in w]
    assert said.startswith("t.log: holds 2 jobs: world communicators 0x5f3e9c2a1b7d4e60, 0x6f3e9c2a1b7d4e60 of 8 ")
    assert said.endswith("split the file per job (per srun step or restart) and ingest each into its own run")
