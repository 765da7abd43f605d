"""NCCL and RCCL log line shapes seen in the wild that the reader once read wrongly or skipped (formats.md A).
Each test writes the lines it needs, with made-up hosts, pointers and values; the shapes come from the
NCCL and RCCL sources and from logs pasted into public issues."""

from __future__ import annotations

from test_nccl_speed_shapes import _parse


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
