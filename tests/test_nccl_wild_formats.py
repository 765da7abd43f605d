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
