"""A small gzip bomb (a real NCCL log followed by 4 GiB of newlines in 4.3 MB of gzip) must not hold the
ingest: with the default limits it is refused from its first MiB; with limits loose enough to read a
1 GiB one whole, it costs what decompressing costs (blank lines are never split), and a 1.7 KB log
uploaded while it runs is done first (the pool: another worker takes it). Real servers on loopback; order
asserted, not times."""

from __future__ import annotations

import gzip
import io
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from commlens.backend.api import Settings
from commlens.backend.api.testing import ServerThread, wait_job
from commlens.ingest.inputs import Limits
from commlens.ingest.nccl_log import parse_nccl_log
from commlens.ingest.records import RankHint

LOG = "nccl-logs/nvidia-nccl-1238.log"  # 4 all_reduce calls
SMALL = "nccl-logs/nvidia-nccl-203.log"  # 1.7 KB, 7 calls
GiB, MiB = 1 << 30, 1 << 20


def bomb(log: bytes, newlines: int) -> bytes:
    """The log, then `newlines` newlines: one gzip member per MiB (a multi-member gzip, as `cat a.gz b.gz`)."""
    member = gzip.compress(b"\n" * MiB, compresslevel=9)
    return gzip.compress(log) + member * (newlines // MiB)


@pytest.fixture
def logs(data_dir: Path) -> tuple[bytes, bytes]:
    return (data_dir / LOG).read_bytes(), (data_dir / SMALL).read_bytes()


def _upload(c: httpx.Client, run: str, name: str, data: bytes) -> str:
    assert c.post("/api/runs", json={"name": run}).status_code == 201
    r = c.post(f"/api/runs/{run}/files", files={"files": (name, data)})
    assert r.status_code == 202, r.text
    return str(r.json()["job_id"])


def _wait_state(c: httpx.Client, job_id: str, states: set[str]) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while (job := c.get(f"/api/jobs/{job_id}").json())["state"] not in states:
        assert time.monotonic() < deadline, job
        time.sleep(0.02)
    return job


def test_the_bomb_is_refused_from_its_first_mib(tmp_path: Path, logs: tuple[bytes, bytes]) -> None:
    log, small = logs
    data = bomb(log, 4 * GiB)
    assert len(data) < 4.4e6  # 4.3 MB
    with ServerThread(Settings(db=tmp_path / "s.duckdb")) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        big = _upload(c, "bombed", "x.log.gz", data)
        little = _upload(c, "small", "small.log", small)
        done = wait_job(c, little)
        assert [(r["status"], r["events"]) for r in done["results"]] == [("ok", 7)]
        refused = wait_job(c, big)
        [result] = refused["results"]
        assert result["status"] == "failed" and "x.log.gz" in result["error"]
        assert "compression ratio above 200:1 after" in result["error"] and "decompression bomb" in result["error"]
        after = int(result["error"].split(" after ")[1].split(" bytes")[0])
        assert after < 3 * MiB  # refused in its first MiBs, not after 256 MiB
        assert c.get("/api/runs/bombed/sources").json()["items"][0]["status"] == "failed"


def test_a_small_upload_is_not_held_by_a_bomb_being_read(tmp_path: Path, logs: tuple[bytes, bytes]) -> None:
    log, small = logs
    loose = Settings(db=tmp_path / "s.duckdb", ingest_limits=Limits(max_ratio=1e9))  # reads it whole
    with ServerThread(loose) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        big = _upload(c, "bombed", "x.log.gz", bomb(log, GiB))
        _wait_state(c, big, {"running", "done", "failed"})
        little = _upload(c, "small", "small.log", small)
        done = wait_job(c, little)
        assert [(r["status"], r["events"]) for r in done["results"]] == [("ok", 7)]
        read = wait_job(c, big, timeout=600)
        assert [(r["status"], r["events"]) for r in read["results"]] == [("ok", 4)]  # the log's calls, no more
        assert read["updated_at"] > done["updated_at"]  # the small job finished first


def test_blank_lines_cost_no_parsing(logs: tuple[bytes, bytes]) -> None:
    """Megabytes of newlines around the log: the calls are the log's, and a garbled line after them is named
    at its own line number (blank lines are counted, not parsed)."""
    log, _ = logs
    coll = next(line for line in log.splitlines() if b"NCCL INFO AllReduce" in line)
    head = b"\n" * (8 * MiB) + log + b"\n" * (64 * MiB) + log.replace(b"opCount 0 ", b"opCount 1 ")
    padded = head + coll[: len(coll) // 2] + b"\n"
    result = parse_nccl_log(io.BufferedReader(io.BytesIO(padded)), "x.log", RankHint(), Limits())
    assert result.n_events == 8
    assert result.skipped == {"COLL line cut or garbled": 1}
    garbled_line = head.count(b"\n") + 1
    assert any(w.startswith(f"x.log:line {garbled_line}: skipped") for w in result.warnings), result.warnings
