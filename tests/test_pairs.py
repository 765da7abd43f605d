"""The all-to-all bytes matrix (sender x receiver) on a real torchrun/gloo expert-parallel run.

The harness (harness/moe.py) logs, per profiled step, the rows each rank routes to each ep rank for every
MoE layer call (run.json `moe_routing`). Each such call makes five all_to_all calls on its rank: the
per-expert counts (N/E int64 to every rank), the dispatch (the logged rows), the combine (the rows it
received back, i.e. what each peer routed to it), and in backward the transposes of both. So rank r sends
rank p, per logged call, 2 x (rows r routed to p + rows p routed to r) x hidden x 4 bytes plus N/E x 8 bytes:
the matrix must equal that to the byte, per step and summed over the run, through the service and the API.
A trace whose all_to_all calls record no split list (the 2023 DLRM job) says why there is no matrix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness_runs import HarnessRuns, named
from test_harness_ep import CONFIGS, TINY

from commlens import store
from commlens.backend.api.settings import Settings
from commlens.backend.api.testing import ServerThread
from commlens.harness import launch
from commlens.ingest.inputs import iter_inputs
from commlens.service.ingest import ingest_run
from commlens.service.pairs import pairs

DLRM = "kineto-param/dlrm_kineto.tar.gz"
Matrix = list[list[int]]


@pytest.fixture(scope="module")
def ep_run(harness_runs: HarnessRuns, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict[str, Any]]:
    """`--ep 2 --experts 4 --top-k 2` at test_harness_ep's sizes (the session's run of it: tests/harness_runs.py),
    ingested: (store, run name, run.json)."""
    db = tmp_path_factory.mktemp("pairs") / "store.duckdb"
    run = named(harness_runs("ep2", dict(TINY, **CONFIGS["ep2"])), "ep2")
    assert not launch.ingest_run(db, run).failed
    return db, run.name, json.loads((run.out / "run.json").read_text())


def expected(config: dict[str, Any], step: str) -> Matrix:
    """Sender x receiver bytes of one profiled step from the routing the harness logged."""
    routing = config["moe_routing"][step]
    ep, experts, hidden = config["parallel"]["ep"], config["model"]["experts"], config["model"]["hidden"]
    row_bytes, counts_bytes = hidden * 4, experts // ep * 8  # float32 rows; int64 counts per peer
    out = [[0] * ep for _ in range(ep)]
    for r in range(ep):
        for c, sent in enumerate(routing[str(r)]):
            for p in range(ep):
                received = routing[str(p)][c][r]
                out[r][p] += 2 * (sent[p] + received) * row_bytes + counts_bytes
    return out


def test_matrix_equals_the_logged_routing_per_step_and_over_the_run(ep_run: tuple[Path, str, dict[str, Any]]) -> None:
    db, run, config = ep_run
    steps = sorted(config["moe_routing"], key=int)
    assert len(steps) == 2
    con = store.connect(db)
    try:
        whole = pairs(con, run)
        per_step = {s: pairs(con, run, step=int(s)) for s in steps}
    finally:
        con.close()
    assert whole.reason is None and whole.steps == [int(s) for s in steps]
    assert whole.calls_with_splits == 2 * 2 * 2 * 5 and whole.calls_without_splits == 0  # ranks x steps x layers x 5
    (m,) = whole.matrices
    assert (m.group_key, m.scheme, m.ranks) == ("pg:0", "ep", [0, 1])
    total = [[0, 0], [0, 0]]
    for s in steps:
        (ms,) = per_step[s].matrices
        want = expected(config, s)
        assert ms.bytes == want, s
        assert ms.calls == 2 * 2 * 5 and ms.total_bytes == sum(map(sum, want))
        total = [[a + b for a, b in zip(x, y, strict=True)] for x, y in zip(total, want, strict=True)]
    assert m.bytes == total
    # every a2a_pairs byte is a byte of some all_to_all's measured size S (bytes sent by the rank)
    con = store.connect(db, read_only=True)
    try:
        (s_sum,) = con.execute("SELECT sum(msg_bytes) FROM comms WHERE run = ? AND op = 'all_to_all'", [run]).fetchone()
    finally:
        con.close()
    assert s_sum == m.total_bytes


def test_api_returns_the_matrix(ep_run: tuple[Path, str, dict[str, Any]]) -> None:
    db, run, config = ep_run
    with ServerThread(Settings(db=db)) as srv, httpx.Client(base_url=srv.url + "/api", timeout=60) as api:
        body = api.get(f"/runs/{run}/pairs", params={"step": 3}).json()
        assert body["step"] == 3 and body["matrices"][0]["bytes"] == expected(config, "3")
        whole = api.get(f"/runs/{run}/pairs", params={"group": "pg:0"}).json()
        assert whole["group"] == "pg:0" and len(whole["matrices"]) == 1
        missing = api.get(f"/runs/{run}/pairs", params={"step": 0}).json()
        assert missing["matrices"] == []
        assert missing["reason"] == "no all_to_all call with a split list in step 0 (steps with them: 2, 3)"
        other = api.get(f"/runs/{run}/pairs", params={"group": "pg:1"}).json()
        assert other["reason"] == "no all_to_all call with a split list in group pg:1"
        bad = api.get(f"/runs/{run}/pairs", params={"step": "two"})
        assert bad.status_code == 422 and "step" in bad.text
        unknown = api.get("/runs/nope/pairs")
        assert unknown.status_code == 404 and "no run named 'nope'" in unknown.json()["detail"]


def test_trace_without_splits_says_why(data_dir: Path, tmp_path: Path) -> None:
    con = store.connect(tmp_path / "dlrm.duckdb")
    try:
        assert not ingest_run(con, "dlrm", iter_inputs([data_dir / DLRM])).failed
        (n,) = con.execute("SELECT count(*) FROM comms WHERE op = 'all_to_all'").fetchone()
        report = pairs(con, "dlrm")
    finally:
        con.close()
    assert n > 0 and report.matrices == [] and report.calls_without_splits == n and report.calls_with_splits == 0
    assert report.reason is not None
    assert report.reason.startswith(f"none of the run's {n} all_to_all calls records its split list")


def test_store_at_version_5_gains_the_table(tmp_path: Path) -> None:
    db = tmp_path / "old.duckdb"
    con = store.connect(db)
    con.execute("DROP TABLE a2a_pairs")
    con.execute("UPDATE meta SET value = '5' WHERE key = 'schema_version'")
    con.close()
    con = store.connect(db)
    try:
        assert con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchall() == [
            (str(store.SCHEMA_VERSION),)
        ]
        assert con.execute("SELECT count(*) FROM a2a_pairs").fetchall() == [(0,)]
    finally:
        con.close()


def test_nccl_split_metadata_maps_receivers_to_global_ranks(tmp_path: Path) -> None:
    """record_param_comms' `In split size` (rows per peer; "[]" an even split) on a group of global ranks
    [4, 6], traced on rank 6 only: rank 6's row in global ranks, rank 4's row unknown (no trace)."""
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
    pg = {"pg_name": "0", "pg_desc": "ep", "pg_size": 2, "ranks": [4, 6]}
    trace = tmp_path / "rank6.json"
    info = {"backend": "nccl", "rank": 6, "world_size": 8, "pg_config": [pg]}
    trace.write_text(json.dumps({"distributedInfo": info, "traceEvents": events}))
    con = store.connect(tmp_path / "nccl.duckdb")
    try:
        assert not ingest_run(con, "nccl", iter_inputs([trace])).failed
        report = pairs(con, "nccl")
    finally:
        con.close()
    (m,) = report.matrices
    # 32 float32 elements in 4 rows split [3, 1]; then 16 elements split evenly over 2 ranks
    assert (m.ranks, m.bytes, m.calls) == ([4, 6], [[None, None], [3 * 32 + 32, 32 + 32]], 2)
