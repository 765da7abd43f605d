"""Flight Recorder dumps as PyTorch 2.13 writes them (FlightRecorder.hpp, dump version "2.10": the keys and
values below are those of `_dump_fr_trace_json` / `_dump_fr_trace` from real gloo processes of torch
2.13.0), the restricted unpickler, and the hang analysis on the stored entries."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest

from commlens.backend.hang import FrCall, analyze, run_hang
from commlens.backend.report import build_report, render_markdown
from commlens.service.hang import hang_report
from commlens.service.ingest import ingest_paths
from commlens.store import get_run_id


def entry(record: int, pg: tuple[str, str], seq: int, op: str, numel: int, dtype: str = "Float") -> dict[str, Any]:
    """One entry with every key torch 2.13 writes for gloo (state stays "scheduled": gloo records no start)."""
    return {
        "collective_seq_id": seq,
        "input_dtypes": [dtype],
        "input_sizes": [[numel]],
        "is_p2p": False,
        "op_id": seq,
        "output_dtypes": [dtype],
        "output_sizes": [[numel]],
        "p2p_seq_id": 0,
        "pg_id": int(pg[0]),
        "process_group": list(pg),
        "profiling_name": f"gloo:{op}",
        "record_id": record,
        "retired": True,
        "state": "scheduled",
        "thread_id": "139986137566080",
        "thread_name": "python3",
        "time_created_ns": 1795563968466959460 + 1000 * record,
        "time_discovered_completed_ns": 0,
        "time_discovered_started_ns": 0,
        "timeout_ms": 3000,
    }


WORLD = ("0", "default_pg")
DP = ("1", "dp")


def dump(entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "comm_lib_version": "",
        "entries": entries,
        "nccl_comm_state": {},
        "pg_config": {"": {"desc": "", "name": "", "ranks": "[]"}},
        "pg_status": {"0": {"last_completed_collective": "4", "last_enqueued_collective": "4"}},
        "version": "2.10",
    }


# Rank 0 entered all_reduce #3 of the default group (bf16, 8 elements); rank 1 stopped after broadcast #2.
RANK0 = [
    entry(0, WORLD, 1, "all_reduce", 4),
    entry(1, DP, 1, "all_reduce", 4),
    entry(2, WORLD, 2, "broadcast", 4),
    entry(3, WORLD, 3, "all_reduce", 8, "BFloat16"),
]
RANK1 = RANK0[:3]


def write_run(tmp_path: Path) -> list[Path]:
    a = tmp_path / "nccl_trace_rank_0.json"
    a.write_text(json.dumps(dump(RANK0)))
    b = tmp_path / "host-b_rank1"  # the pickle form, as TORCH_FR_DUMP_TEMP_FILE files are
    b.write_bytes(pickle.dumps(dump([{**e, "process_group": tuple(e["process_group"])} for e in RANK1]), protocol=2))
    return [a, b]


def test_dumps_become_calls_and_the_hang_names_the_rank_that_never_arrived(con, tmp_path: Path) -> None:
    summary = ingest_paths(con, write_run(tmp_path), "fr")
    assert [(f.kind, f.rank, f.events, f.status) for f in summary.files] == [
        ("flight_recorder", 0, 4, "ok"),
        ("flight_recorder", 1, 3, "ok"),
    ]
    rows = con.execute(
        "SELECT rank, op, dtype, msg_bytes, group_key, source_kind FROM comms WHERE run = 'fr' ORDER BY rank, ts_us"
    ).fetchall()
    assert rows[3] == (0, "all_reduce", "bfloat16", 16, "pg:0", "flight_recorder")
    assert rows[4] == (1, "all_reduce", "float32", 16, "pg:0", "flight_recorder")
    states = con.execute("SELECT DISTINCT state FROM fr_entries").fetchall()
    assert states == [("scheduled",)]
    report = hang_report(con, "fr")
    assert report.dumped_ranks == [0, 1]
    [g] = report.groups
    assert (g.group, g.group_key, g.op, g.seq, g.msg_bytes) == ("default_pg", "pg:0", "all_reduce", 3, 16)
    assert (g.arrived_ranks, g.missing_ranks, g.mismatches) == ([0], [1], [])
    rank1 = next(r for r in g.ranks if r.rank == 1)
    assert (rank1.last_seq, rank1.last_op) == (2, "broadcast")
    assert "never entered #3" in rank1.doing
    full = build_report(con, "fr")
    assert [h.model_dump(include={"group", "op", "seq", "arrived_ranks", "missing_ranks"}) for h in full.hang] == [
        {"group": "default_pg", "op": "all_reduce", "seq": 3, "arrived_ranks": [0], "missing_ranks": [1]}
    ]
    assert json.loads(full.model_dump_json())["hang"][0]["missing_ranks"] == [1]
    assert "never arrived [1]" in render_markdown(full)


def test_a_run_that_completed_has_an_empty_hang_list(con, tmp_path: Path) -> None:
    for r in (0, 1):
        (tmp_path / f"fr.rank{r}.json").write_text(json.dumps(dump(RANK0)))
    ingest_paths(con, sorted(tmp_path.iterdir()), "ok")
    assert run_hang(con, get_run_id(con, "ok") or -1) == []
    assert json.loads(build_report(con, "ok").model_dump_json())["hang"] == []


def test_mismatched_op_and_a_missing_member_of_a_known_group() -> None:
    calls = [
        FrCall(0, "pg:1", "tp", 7, "all_reduce", 1024, "started", 10.0, (0, 1, 2)),
        FrCall(1, "pg:1", "tp", 7, "all_gather", 4096, "started", 10.0, (0, 1, 2)),
        FrCall(2, "pg:1", "tp", 6, "all_reduce", 1024, "completed", 5.0, (0, 1, 2)),
        FrCall(2, "pg:2", "pp", 3, "send", 64, "started", 11.0, (2, 3)),
    ]
    [tp, pp] = analyze(calls, [0, 1, 2])
    assert (tp.seq, tp.arrived_ranks, tp.missing_ranks) == (7, [0, 1], [2])
    assert tp.mismatches == ["rank 1 entered all_gather (4096 B) at #7 where rank 0 entered all_reduce (1024 B)"]
    doing = next(r for r in tp.ranks if r.rank == 2).doing
    assert doing == (
        "last in this group all_reduce #6 in tp (completed, 1024 B); latest call send #3 in pp (started, 64 B)"
    )
    # NCCL records starts and completions: a started call at the frontier is unfinished though all arrived;
    # rank 3 never dumped.
    assert (pp.arrived_ranks, pp.missing_ranks) == ([2], [3])
    assert next(r for r in pp.ranks if r.rank == 3).doing == "no Flight Recorder dump of this rank"


class _Exploit:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        import os

        return (os.system, ("echo pwned > /dev/null",))


def test_a_pickle_that_would_run_code_is_refused_by_name_and_nothing_stored_is_lost(con, tmp_path: Path) -> None:
    good = write_run(tmp_path)[:1]
    ingest_paths(con, good, "fr")
    before = con.execute("SELECT count(*) FROM comm_events").fetchone()
    bad = tmp_path / "nccl_trace_rank_1"
    bad.write_bytes(pickle.dumps({"entries": [_Exploit()], "version": "2.10"}, protocol=2))
    summary = ingest_paths(con, [bad], "fr")
    [f] = summary.files
    assert f.status == "failed" and f.kind == "flight_recorder"
    assert f.error == (
        f"{bad}:pickle: a pickle that would load posix.system: refused (a Flight Recorder dump holds only "
        "plain containers and scalars; an uploaded pickle is code)"
    )
    assert con.execute("SELECT count(*) FROM comm_events").fetchone() == before
    assert con.execute("SELECT count(*) FROM fr_entries").fetchone() == (4,)


@pytest.mark.parametrize(
    ("content", "error"),
    [
        (b'{"comm_lib_version": "", "entries": [{"profiling_name": "gloo:all_re', "truncated or malformed JSON"),
        (b'{"comm_lib_version": "", "entries": 3}', "not a Flight Recorder dump: no 'entries' list"),
        (pickle.dumps(["not", "a", "dump"], protocol=4), "not a Flight Recorder dump: no 'entries' list"),
    ],
)
def test_bad_dumps_are_refused_with_the_reason(con, tmp_path: Path, content: bytes, error: str) -> None:
    path = tmp_path / "fr_rank0.json"
    path.write_bytes(content)
    [f] = ingest_paths(con, [path], "bad").files
    assert f.status == "failed" and error in (f.error or "")


def test_a_dump_without_a_rank_in_its_name_asks_for_one(con, tmp_path: Path) -> None:
    path = tmp_path / "dump.json"
    path.write_text(json.dumps(dump(RANK0)))
    [f] = ingest_paths(con, [path], "norank").files
    assert f.status == "failed" and "does not say its rank" in (f.error or "")


def test_upload_through_the_api_and_the_dashboard_client(tmp_path: Path) -> None:
    """Dumps uploaded like any file (the upload check asks the registry), the hang and the per-rank sources
    served by a real server and read by the dashboard's typed client."""
    import httpx

    from commlens.backend.api import Settings
    from commlens.backend.api.testing import ServerThread, wait_job
    from commlens.frontend import page_overview
    from commlens.frontend.client import ApiClient

    files = write_run(tmp_path)
    with ServerThread(Settings(db=tmp_path / "api.duckdb")) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        assert c.post("/api/runs", json={"name": "hung"}).status_code == 201
        r = c.post("/api/runs/hung/files", files=[("files", (p.name, p.read_bytes())) for p in files])
        assert r.status_code == 202
        job = wait_job(c, r.json()["job_id"])
        assert [(x["kind"], x["status"]) for x in job["results"]] == [("flight_recorder", "ok")] * 2
        hang = c.get("/api/runs/hung/hang").json()
        assert hang["dumped_ranks"] == [0, 1]
        assert [(g["group"], g["op"], g["seq"], g["arrived_ranks"], g["missing_ranks"]) for g in hang["groups"]] == [
            ("default_pg", "all_reduce", 3, [0], [1])
        ]
        assert c.get("/api/runs/nope/hang").status_code == 404
        ui = ApiClient(srv.url)
        assert ui.hang("hung").groups[0].missing_ranks == [1]
        per_rank = ui.rank_sources("hung")
        assert [(x.rank, [(s.kind, s.calls, s.counted) for s in x.sources]) for x in per_rank.ranks] == [
            (0, [("flight_recorder", 4, 4)]),
            (1, [("flight_recorder", 3, 3)]),
        ]
        section = str(page_overview.hang(ui, "hung"))
        assert "Hung: ranks 1 never arrived." in section and "never entered #3" in section
        table = page_overview.rank_sources(ui, "hung").children  # one Markdown table, every cell escaped
        assert "| flight\\_recorder |" in table.children
