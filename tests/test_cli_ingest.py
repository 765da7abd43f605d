"""`commlens ingest` as a user runs it: a real process, exit status, summary table."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import duckdb


def _commlens(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "commlens.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "COLUMNS": "400"},  # a table row on one line
    )


def _run_json() -> str:
    return json.dumps(
        {
            "schema": "commlens.run/1",
            "strategy": "ddp",
            "world_size": 2,
            "model": {"layers": 2, "hidden": 32, "heads": 4, "vocab": 128, "seq_len": 16},
            "parallel": {"dp": 2},
            "groups": [{"dim": "dp", "ranks": [0, 1], "pg_name": "0"}],
        }
    )


def test_ingest_exit_status_and_summary(tmp_path: Path) -> None:
    good, bad = tmp_path / "run.json", tmp_path / "broken.json.gz"
    good.write_text(_run_json())
    bad.write_bytes(b"\x1f\x8b\x08\x00garbage")
    db = tmp_path / "s.duckdb"
    proc = _commlens("ingest", str(good), str(bad), "--db", str(db), "--run", "demo")
    assert proc.returncode == 1, proc.stderr
    assert "truncated gzip data" in proc.stdout and f"{bad}:byte" in proc.stderr
    assert "2 files: 1 ingested, 0 already present, 1 failed, 0 passed over" in " ".join(proc.stdout.split())
    again = _commlens("ingest", str(good), "--db", str(db), "--run", "demo")
    assert again.returncode == 0, again.stderr
    assert "1 already present" in " ".join(again.stdout.split())
    # a note beside the traces: its row says "passed over", as the count does ("skipped" is lines and events)
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "run.json").write_text(_run_json())
    (folder / "NOTES.md").write_text("# what I ran\n")
    walked = _commlens("ingest", str(folder), "--db", str(db), "--run", "demo")
    row = next(line for line in walked.stdout.splitlines() if "NOTES.md" in line)
    assert "passed over" in row and "skipped" not in row, walked.stdout
    # the broken file replaced by a whole one at the same path: stored, and no longer a failure of the run
    bad.write_bytes(gzip.compress(_run_json().replace('"ddp"', '"ddp" ').encode()))
    fixed = _commlens("ingest", str(bad), "--db", str(db), "--run", "demo")
    assert fixed.returncode == 0, fixed.stdout
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT strategy, world_size FROM runs").fetchall() == [("ddp", 2)]
    assert con.execute("SELECT status FROM sources WHERE path = ?", [str(bad)]).fetchall() == [("ok",)]


def test_ingest_into_a_locked_store_says_who_holds_it(tmp_path: Path) -> None:
    db = tmp_path / "held.duckdb"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import duckdb,sys,time; c=duckdb.connect({str(db)!r}); print('ok', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "ok"  # type: ignore[union-attr]
        (tmp_path / "run.json").write_text(_run_json())
        proc = _commlens("ingest", str(tmp_path / "run.json"), "--db", str(db), "--run", "x")
        assert proc.returncode == 2
        assert "held by another process" in proc.stderr and "commlens serve" in proc.stderr
    finally:
        holder.kill()
        holder.wait()


def test_ingest_into_a_former_run_name_is_refused_without_a_traceback(tmp_path: Path) -> None:
    from commlens import store
    from commlens.service import runs

    good = tmp_path / "run.json"
    good.write_text(_run_json())
    db = tmp_path / "s.duckdb"
    assert _commlens("ingest", str(good), "--db", str(db), "--run", "old").returncode == 0
    con = store.connect(db)
    runs.update_run(con, "old", {"name": "new"})
    con.close()
    proc = _commlens("ingest", str(good), "--db", str(db), "--run", "old")
    assert proc.returncode == 2, proc.stderr
    assert "'old' is a former name of run 'new'" in " ".join(proc.stderr.split())
    assert "Traceback" not in proc.stderr
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT name FROM runs").fetchall() == [("new",)]


def test_a_folder_with_nothing_to_read_makes_no_run(tmp_path: Path) -> None:
    """An empty folder, or a harness run not started yet (`--dry-run` leaves only its hidden config), was
    "0 files: 0 ingested", exit 0, and an empty run in `runs`."""
    empty, planned = tmp_path / "empty", tmp_path / "planned"
    empty.mkdir()
    planned.mkdir()
    (planned / ".harness-config.json").write_text("{}")
    (planned / "NOTES.md").write_text("to do\n")
    db = tmp_path / "s.duckdb"
    proc = _commlens("ingest", str(empty), str(planned), "--db", str(db), "--run", "r")
    said = " ".join(proc.stderr.split())
    assert proc.returncode == 2, proc.stdout
    assert f"{empty}: an empty directory: no trace or log to ingest" in said
    assert f"{planned}: no trace or log to ingest: its 2 file(s) are 1 hidden and 1 passed over" in said
    assert not db.exists()
