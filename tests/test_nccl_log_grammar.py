"""The NCCL log grammar alone: message classification and Init line fields, without a reader's state."""

from __future__ import annotations

import pytest

from commlens.ingest.nccl_grammar import classify, init_fields


@pytest.mark.parametrize(
    ("msg", "kind"),
    [
        ("NCCL version 2.21.5+cuda12.4", "version"),
        ("RCCL version 2.18.3+hip6.0", "version"),
        ("NVLS Trees [0] 1/-1/-1->0->-1", "nvls_trees"),
        ("NVLS Head  0:  0 8", "nvls_head"),
        ("NVLS multicast support is available", None),  # starts like NVLS, is none of them: not tried further
        ("cudaDriverVersion 12040", "driver"),
        ("comm 0x55 rank 0 nRanks 8 nNodes 1 localRanks 8 localRank 0 MNNVL 0", "nodes"),
        ("comm 0x55 rank 0 nranks 8 cudaDev 0 nvmlDev 0 busId 1000 commId 0xabc - Init COMPLETE", "init"),
        ("ncclCommInitRank comm 0x55 rank 0 nranks 8 - Init START", "init"),
        ("comm 0x55 rank 0 nranks 8 - Init garbled", None),
        ("Channel 00/02 :    0   1   2   3", "ring"),
        ("Channel 00/0 : 0[0] -> 1[1] via P2P/IPC", "connection"),
        ("Channel 00 : nothing to see", None),
        ("Trees [0] 1/-1/-1->0->-1 [1] 1/-1/-1->0->-1", "trees"),
        ("AllReduce: 4194304 Bytes -> Algo 0 proto 1 time 35.5", "tuning"),
        (
            "32 coll channels, 32 collnet channels, 0 nvls channels, 32 p2p channels, 32 p2p channels per peer",
            "channels",
        ),
        ("Using network Socket", None),
    ],
)
def test_classify(msg: str, kind: str | None) -> None:
    found = classify(msg)
    assert (found[0] if found else None) == kind


def test_init_fields_read_by_table_and_report_what_does_not_read() -> None:
    values, bad = init_fields(" cudaDev 3 nvmlDev x busId 1A000 commId 0x0 color 7 key -1 splitCount 2 extra 1 tail")
    assert values == {"cuda_dev": 3, "bus_id": "1a000", "color": 7, "split_key": -1, "_split_count": 2}
    assert bad == [("nvmlDev", "x")]
    assert init_fields(" commId 0xABC parent 0x77")[0] == {"comm_id": "0xabc", "parent_ptr": "0x77"}
