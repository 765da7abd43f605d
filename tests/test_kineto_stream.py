"""A long Kineto trace is parsed in bounded batches: its rows move into Arrow tables every ROW_BATCH calls,
each shape of call is described once, and the result equals the unbatched parse row for row; a trace
that would make the parse hold more records than the budget is refused, naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import shared_data
from kineto_synth import EVENTS_PER_CALL, STEP_CALLS, write_trace_gz

from commlens import store
from commlens.ingest import kineto
from commlens.ingest.inputs import Limits, iter_inputs
from commlens.ingest.parse_file import ParsedFile, parse_file
from commlens.ingest.records import RankHint
from commlens.service.ingest import ingest_paths

CALLS = 20_000  # 80,020 trace events
RESNET = "kineto-hta/nccl_parser_config/nccl_data.json.gz"


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("stream") / "allreduce.json.gz"
    assert write_trace_gz(shared_data() / RESNET, CALLS, path) == CALLS * EVENTS_PER_CALL + CALLS // STEP_CALLS
    return path


def _parse(path: Path, limits: Limits | None = None) -> ParsedFile:
    item = next(iter_inputs([path]))
    return parse_file(item, RankHint(), limits) if limits else parse_file(item, RankHint())


def test_batched_parse_equals_the_unbatched_one(trace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kineto, "ROW_BATCH", 10**9)
    whole = _parse(trace).result
    monkeypatch.setattr(kineto, "ROW_BATCH", 1500)
    batched = _parse(trace).result
    assert whole is not None and batched is not None
    assert not whole.event_tables and len(whole.events) == CALLS
    assert len(batched.event_tables) == CALLS // 1500 and len(batched.events) == CALLS % 1500
    rows = batched.all_events()
    assert rows == whole.all_events()
    assert rows[0] == {
        "rank": 0,
        "process": "0",
        "seq": 0,
        "op": "all_reduce",
        "dtype": "float32",
        "msg_bytes": 4096,
        "elems_in": 1024,
        "elems_out": 1024,
        "group_size": 2,
        "group_key": "pg:0",
        "peer": None,
        "step": 0,
        "ts_us": rows[0]["dev_start_us"],
        "dur_us": 15.0,
        "dur_source": "kernel",
        "op_count": None,
        "comm_ptr": None,
        "raw_name": "allreduce",
        "match_key": None,
        "cpu_start_us": rows[0]["cpu_start_us"],
        "cpu_end_us": rows[0]["cpu_start_us"] + 20.0,
        "dev_start_us": rows[0]["cpu_start_us"] + 12.0,
        "dev_end_us": rows[0]["cpu_start_us"] + 27.0,
    }
    assert [r["seq"] for r in rows] == list(range(CALLS))
    assert {r["step"] for r in rows} == set(range(CALLS // STEP_CALLS))
    assert batched.groups == whole.groups and batched.steps == whole.steps
    assert batched.intervals is not None and whole.intervals is not None
    assert batched.intervals.equals(whole.intervals)
    assert batched.meta == whole.meta and batched.skipped == whole.skipped and batched.warnings == whole.warnings


def test_batched_rows_are_stored_whole(trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kineto, "ROW_BATCH", 1500)
    con = store.connect(tmp_path / "s.duckdb")
    summary = ingest_paths(con, [trace], "long")
    assert [(f.status, f.events) for f in summary.files] == [("ok", CALLS)]
    got = con.execute(
        "SELECT count(*), count(DISTINCT seq), sum(msg_bytes), min(step), max(step), sum(dur_us) FROM comm_events"
    ).fetchone()
    assert got == (CALLS, CALLS, CALLS * 4096, 0, CALLS // STEP_CALLS - 1, CALLS * 15.0)


def test_a_trace_past_the_event_budget_is_refused_naming_the_file(trace: Path) -> None:
    parsed = _parse(trace, Limits(max_trace_events=10_000))
    assert parsed.result is None
    assert parsed.error is not None
    assert parsed.error.startswith(f"{trace}: more than 10,000 communication records")
    assert "--max-trace-events" in parsed.error
