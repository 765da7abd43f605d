"""All-to-all matrices binned by the server (`bins`): a group wider than `bins` ranks comes as sums over
blocks of consecutive ranks, the full matrix stays the default."""

from __future__ import annotations

import json
from pathlib import Path

from commlens import store
from commlens.contract.pairs import PairMatrix
from commlens.ingest.inputs import iter_inputs
from commlens.service.ingest import ingest_run
from commlens.service.pairs import binned, pairs


def test_blocks_hold_the_sums_of_their_cells() -> None:
    rows: list[list[int | None]] = [[10 * s + r for r in range(5)] for s in range(5)]
    rows[4] = [None] * 5  # rank 4 sent nothing known (no trace)
    m = PairMatrix(group_key="g", scheme="ep", ranks=[0, 2, 4, 6, 8], bytes=rows, calls=5, total_bytes=0)
    b = binned(m, 2)
    assert (b.per_block, b.labels, b.ranks) == (3, ["0-4", "6-8"], [0, 2, 4, 6, 8])
    # block 0 x block 0: senders 0-2 to receivers 0-2; block 1 holds only sender 3 (sender 4 unknown)
    assert b.bytes == [[0 + 1 + 2 + 10 + 11 + 12 + 20 + 21 + 22, 3 + 4 + 13 + 14 + 23 + 24], [30 + 31 + 32, 33 + 34]]
    rows[3] = [None] * 5
    assert binned(m.model_copy(update={"bytes": rows}), 2).bytes[1] == [None, None]


def test_the_service_bins_only_when_asked_and_only_wider_groups(tmp_path: Path) -> None:
    """Rank 6 of group [4, 6] traced: 32 float32 elements over 4 rows split [3, 1], then 16 split evenly."""
    meta = {
        "Collective name": "all_to_allv",
        "dtype": "Float",
        "Group size": 2,
        "Process Group Name": "0",
        "Process Group Ranks": "[4, 6]",
        "In msg nelems": 32,
        "Out msg nelems": 40,
        "In split size": "[3, 1]",
    }
    events = []
    for i, args in enumerate((meta, dict(meta, **{"In msg nelems": 16, "In split size": "[]"}))):
        ts = 100.0 * (i + 1)
        events += [
            {"ph": "X", "cat": "cpu_op", "name": "c10d::alltoall_base_", "pid": 1, "tid": 1, "ts": ts, "dur": 50.0},
            {"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 1, "tid": 1, "ts": ts + 1, "dur": 40.0}
            | {"args": args},
        ]
    info = {"backend": "nccl", "rank": 6, "world_size": 8, "pg_config": [{"pg_name": "0", "ranks": [4, 6]}]}
    trace = tmp_path / "rank6.json"
    trace.write_text(json.dumps({"distributedInfo": info, "traceEvents": events}))
    con = store.connect(tmp_path / "bins.duckdb")
    try:
        assert not ingest_run(con, "a2a", iter_inputs([trace])).failed
        (full,) = pairs(con, "a2a").matrices
        (same,) = pairs(con, "a2a", bins=2).matrices
        (one,) = pairs(con, "a2a", bins=1).matrices
    finally:
        con.close()
    assert full == same and (full.bytes, full.per_block, full.labels) == ([[None, None], [128, 64]], 1, [])
    assert (one.bytes, one.per_block, one.labels, one.total_bytes) == ([[192]], 2, ["4-6"], 192)
