"""The CLI as people expect it in a pipe or a file, and the Compare page's sweep rule."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from commlens.frontend.page_compare import varied_keys


def _commlens(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}  # a pipe with no terminal width at all
    return subprocess.run(
        [sys.executable, "-m", "commlens.cli", *args], check=False, capture_output=True, text=True, timeout=300, env=env
    )


def test_help_is_plain_text_that_fits_a_pipe() -> None:
    top = _commlens("--help")
    assert top.returncode == 0
    assert "╭" not in top.stdout and "<bool>" not in top.stdout
    assert "  --version  Print the version and exit." in top.stdout.splitlines()
    commands = {line.split()[0] for line in top.stdout.split("Commands:")[1].splitlines() if line.strip()}
    assert {"delete", "ingest", "report", "runs", "serve", "upload", "users"} <= commands
    harness = _commlens("harness", "--help").stdout
    # a command in the help stays on one line, so it can be copied
    assert any(
        line.strip().startswith("torchrun --nnodes 2") and line.strip().endswith("--out /shared/run1")
        for line in harness.splitlines()
    )
    ingest = _commlens("ingest", "--help").stdout
    assert "ingest [OPTIONS] {PATH}...\n" in ingest
    assert "--one-run" in ingest


def test_runs_table_is_not_cut_in_a_pipe(tmp_path: Path, data_dir: Path) -> None:
    db = tmp_path / "s.duckdb"
    name = "a-run-name-long-enough-that-an-eighty-column-table-would-fold-or-cut-it-apart"
    log = data_dir / "nccl-logs/nvidia-nccl-203.log"
    assert _commlens("ingest", str(log), "--db", str(db), "--run", name).returncode == 0
    proc = _commlens("runs", "--db", str(db))
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if name in line]
    assert len(rows) == 1 and [c.strip() for c in rows[0].split("│")[1:6]] == [name, "1", "0", "7", "2"]


def test_a_sweep_is_offered_only_over_the_one_parameter_runs_differ_in() -> None:
    base = {"model.seq_len": 64.0, "parallel.dp": 2.0, "world_size": 2.0, "model.layers": 4.0}
    longer = {**base, "model.seq_len": 128.0}
    wider = {**longer, "parallel.dp": 4.0, "world_size": 4.0}
    assert varied_keys({"a": base, "b": longer}) == ["model.seq_len"]
    # dp and world size vary together: one parameter under two names
    assert varied_keys({"b": longer, "c": wider}) == ["parallel.dp", "world_size"]
    # sequence length and dp both vary: a sweep over either would mix their effects
    assert varied_keys({"a": base, "b": longer, "c": wider}) == []
    assert varied_keys({"a": base, "x": {}}) == []  # a run without a configuration
    assert varied_keys({"a": base, "a2": dict(base)}) == []  # nothing differs


def test_a_port_out_of_range_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """`serve --port 99999` was a traceback from bind(); `ui --port 70000` listened on 4464 (70000 mod 65536)."""
    db = tmp_path / "s.duckdb"
    for args in (
        ("serve", "--db", str(db), "--port", "99999"),
        ("ui", "--api", "http://127.0.0.1:9", "--port", "70000"),
    ):
        proc = _commlens(*args)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert "Invalid value for '--port'" in proc.stderr and "65535" in proc.stderr
    ui = subprocess.run(
        [sys.executable, "-m", "commlens.frontend", "--api", "http://127.0.0.1:9", "--port", "70000"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ui.returncode == 2 and "argument --port: 70000 is not a TCP port (0-65535)" in ui.stderr
    assert not db.exists()


def test_a_mistyped_path_is_said_before_a_store_or_run_is_made(tmp_path: Path, data_dir: Path) -> None:
    """`ingest /no/such/file` made the store and an empty run holding one failed file."""
    db = tmp_path / "s.duckdb"
    log = str(data_dir / "nccl-logs" / "nvidia-nccl-1193.log")
    proc = _commlens("ingest", str(tmp_path / "typo.json"), log, "--db", str(db), "--run", "r1")
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: {tmp_path / 'typo.json'}: No such file or directory"
    assert not db.exists()
