"""NCCL and RCCL log line shapes seen in the wild that the reader once read wrongly or skipped (formats.md A).
Each test writes the lines it needs, with made-up hosts, pointers and values; the shapes come from the
NCCL and RCCL sources and from logs pasted into public issues."""

from __future__ import annotations

import pytest
from test_nccl_speed_shapes import _parse, _rows, _same

from commlens.ingest.nccl_log import VECTOR_MIN_LINES


def _log(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode()


# ------------------------------------------------------------------------------ NCCL 2.30.7 WARN lines


def test_warn_with_function_is_a_warn_line() -> None:
    """From 2.30.7 a WARN names the function after file:line: `[0] enqueue.cc:2290 (ncclFoo) NCCL WARN ...`.
    It is a WARN (counted, text kept), not a garbled INFO line."""
    res = _parse(
        _log(
            [
                "nodeA:310:310 [0] NCCL INFO comm 0x61a0 rank 0 nranks 2 cudaDev 0 busId 1b000 commId 0x5e - Init COMPLETE",
                "",
                "nodeA:310:312 [0] transport/net.cc:912 (ncclTransportConnect) NCCL WARN peer 1 closed the socket",
                "nodeA:310:312 [0] NCCL INFO transport/net.cc:915 -> 6",
                "[1] misc/socket.cc:44 (socketWait) NCCL WARN lost the envelope's host",
            ]
        )
    )
    assert res.skipped == {}
    assert res.meta["nccl_warn_lines"] == 2
    assert res.meta["nccl_warnings"] == ["peer 1 closed the socket", "lost the envelope's host"]


# --------------------------------------------------------------------- NCCL 2.24-2.29 split START lines


def test_split_start_without_blank_before_dash() -> None:
    """2.24 to 2.29 print a split's START as `... color C key K- Init START` (no blank before the dash).
    A split that hangs never prints its COMPLETE: its START line is the only record of the communicator,
    and the topology lines after it belong to it."""
    res = _parse(
        _log(
            [
                "nodeB:40:40 [3] NCCL INFO ncclCommInitRankConfig comm 0x7a00 rank 3 nranks 8 cudaDev 3 nvmlDev 3 "
                "busId 4c000 commId 0xbeef - Init COMPLETE",
                "nodeB:40:77 [3] NCCL INFO ncclCommSplit comm 0x7b00 rank 1 nranks 4 cudaDev 3 nvmlDev 3 busId 4c000 "
                "parent 0x7a00 splitCount 2 color 1234567 key 3- Init START",
                "nodeB:40:77 [3] NCCL INFO Trees [0] -1/-1/-1->1->0 [1] 2/-1/-1->1->-1",
                "nodeB:40:88 [3] NCCL INFO ncclCommSplit comm 0x7c00 rank 0 nranks 2 cudaDev 3 nvmlDev 3 busId 4c000 "
                "parent 0x7a00 childCount 3 color 7 key 0- Init START",
            ]
        )
    )
    comms = {c["comm_ptr"]: c for c in res.nccl_comms}
    split = comms["0x7b00"]
    assert (split["api"], split["comm_rank"], split["nranks"]) == ("ncclCommSplit", 1, 4)
    assert (split["parent_ptr"], split["color"], split["split_key"]) == ("0x7a00", 1234567, 3)
    assert (comms["0x7c00"]["color"], comms["0x7c00"]["split_key"]) == (7, 0)
    assert res.meta["split_counts"] == {"nodeB:40:0x7b00": 2, "nodeB:40:0x7c00": 3}
    assert [t["comm_ptr"] for t in res.topology if t["kind"] == "tree"] == ["0x7b00", "0x7b00"]
    assert res.skipped == {}


# ------------------------------------------------------------------------------ RCCL MSCCL and MSCCL++

RCCL_INIT = "mi300:900:900 [0] NCCL INFO comm 0x5c10 rank 0 nranks 8 cudaDev 0 busId 11000 commId 0x3c - Init COMPLETE"


def test_rccl_msccl_names() -> None:
    """RCCL runs some calls through MSCCL (on by default on MI300X) and prints the line with its own name,
    `mscclFuncAllReduce: opCount ...`, and through MSCCL++ as `mscclpp_ncclAllReduce: opCount ...` (from
    ROCm 6.3, later with `graphMode N ubr N` after the stream). Same fields, same sizes as the NCCL names;
    an MSCCL Send/Recv prints root 0, not its peer, so the peer stays unknown; an MSCCL AllToAllv prints
    count 0 and is skipped with its own reason."""
    tail = "comm 0x5c10 [nranks=8] stream 0x9a"
    res = _parse(
        _log(
            [
                RCCL_INIT,
                f"mi300:900:900 [0] NCCL INFO mscclFuncAllReduce: opCount 4 sendbuff 0x71 recvbuff 0x71 count 262144 "
                f"datatype 9 op 0 root 0 {tail} task 0 globalrank 0",
                f"mi300:900:900 [0] NCCL INFO mscclFuncAllGather: opCount 5 sendbuff 0x71 recvbuff 0x72 count 100 "
                f"datatype 7 op 0 root 0 {tail} task 0 globalrank 0",
                f"mi300:900:900 [0] NCCL INFO mscclpp_ncclAllReduce: opCount 6 sendbuff 0x71 recvbuff 0x71 count 512 "
                f"datatype 6 op 0 root 0 {tail}",
                f"mi300:900:900 [0] NCCL INFO mscclpp_ncclAllGather: opCount 7 sendbuff 0x71 recvbuff 0x72 count 64 "
                f"datatype 7 op 0 root 0 {tail} graphMode 1 ubr 0",
                f"mi300:900:900 [0] NCCL INFO mscclFuncSend: opCount 8 sendbuff 0x71 recvbuff (nil) count 10 "
                f"datatype 7 op 0 root 0 {tail} task 1 globalrank 0",
                f"mi300:900:900 [0] NCCL INFO mscclFuncAllToAllv: opCount 9 sendbuff 0x71 recvbuff 0x72 count 0 "
                f"datatype 7 op 0 root 0 {tail} task 0 globalrank 0",
                f"mi300:900:900 [0] NCCL INFO Send: opCount a sendbuff 0x71 recvbuff (nil) count 10 datatype 7 op 0 "
                f"root 5 {tail} task 1 globalrank 0",
            ]
        )
    )
    got = [(r["raw_name"], r["op"], r["dtype"], r["msg_bytes"], r["elems_out"], r["peer"]) for r in _rows(res)]
    assert got == [
        ("mscclFuncAllReduce", "all_reduce", "bfloat16", 262144 * 2, 262144, None),
        ("mscclFuncAllGather", "all_gather", "float32", 100 * 4 * 8, 800, None),
        ("mscclpp_ncclAllReduce", "all_reduce", "float16", 512 * 2, 512, None),
        ("mscclpp_ncclAllGather", "all_gather", "float32", 64 * 4 * 8, 512, None),
        ("mscclFuncSend", "send", "float32", 40, 10, None),
        ("Send", "send", "float32", 40, 10, 5),
    ]
    assert res.skipped == {"mscclFuncAllToAllv line without its per-peer counts (not counted)": 1}


def test_rccl_msccl_names_vectorised_as_line_by_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Long runs of MSCCL and MSCCL++ lines take the vectorised path with the same rows as line by line."""
    names = ["mscclFuncAllReduce", "mscclpp_ncclAllReduce", "AllReduce", "mscclFuncRecv", "mscclFuncAllToAllv"]
    lines = [RCCL_INIT]
    for i in range(VECTOR_MIN_LINES + 500):
        name = names[i % len(names)]
        lines.append(
            f"mi300:900:900 [0] NCCL INFO {name}: opCount {i:x} sendbuff 0x71 recvbuff 0x72 count {i + 1} "
            f"datatype 7 op 0 root 2 comm 0x5c10 [nranks=8] stream 0x9a task 0 globalrank 0"
        )
    res = _same(_log(lines), monkeypatch)
    rows = _rows(res)
    assert {r["raw_name"] for r in rows} == set(names) - {"mscclFuncAllToAllv"}
    assert {r["peer"] for r in rows if r["op"] == "recv"} == {None}
    assert sum(res.skipped.values()) == (VECTOR_MIN_LINES + 500) // len(names)


# --------------------------------------------------------------------------- RCCL banner on stdout


def test_rccl_bare_banner_with_colon() -> None:
    """RCCL of ROCm 6.3 and later prints its stdout banner as `RCCL version : 2.21.5-HEAD:1a2b3c4`, then
    `HIP version  : ...` and `ROCm version : ...` lines (prose)."""
    res = _parse(
        _log(
            [
                "RCCL version : 2.21.5-HEAD:1a2b3c4",
                "HIP version  : 6.3.42131-fa1d09cbd",
                "ROCm version : 6.3.0.0-39-b4d8f1e",
                "Hostname     : mi300",
                RCCL_INIT,
            ]
        )
    )
    assert res.meta["nccl_version"] == "2.21.5-HEAD:1a2b3c4"
    assert res.meta["library"] == "rccl"
    assert [c["nccl_version"] for c in res.nccl_comms] == ["2.21.5-HEAD:1a2b3c4"]
