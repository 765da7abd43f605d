"""The CLI while `commlens serve` holds the store (a real server process): read commands read through it,
write commands say which API call does their work, nothing creates or deletes a store it should not."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

LOG = "nccl-logs/nvidia-nccl-1193.log"  # 4 all-reduce calls of a 128-rank job


def _commlens(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "commlens.cli", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env={**os.environ, "COLUMNS": "400"},
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str, int]]:
    """A store with run "big" (the 1193 excerpt), held by a running `commlens serve`."""
    from conftest import shared_data

    data = shared_data()
    db = tmp_path_factory.mktemp("served") / "store.duckdb"
    proc = _commlens("ingest", str(data / LOG), "--db", str(db), "--run", "big")
    assert proc.returncode == 0, proc.stderr
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "commlens.cli", "serve", "--db", str(db), "--port", str(port), "--no-ui"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.communicate()[1]
            try:
                if httpx.get(f"{url}/api/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.3)
        yield db, url, port
    finally:
        server.terminate()
        server.wait(30)
    assert not (db.parent / "store.duckdb.server.json").exists()  # the server withdrew its marker


def test_report_and_runs_read_through_the_server(served: tuple[Path, str, int]) -> None:
    db, url, _ = served
    marker = json.loads((db.parent / "store.duckdb.server.json").read_text())
    assert marker["url"] == url
    proc = _commlens("report", "--db", str(db), "--run", "big", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["run"] == "big"
    hist = rep["histogram"]  # per rank: the 4 calls of the 3 ranks that logged them
    assert hist["n_ranks"] == 3 and sum(s["total_calls"] for s in hist["series"]) * 3 == pytest.approx(4)
    md = _commlens("report", "--db", str(db), "--run", "big")
    assert md.returncode == 0 and "big" in md.stdout.splitlines()[0]
    runs = _commlens("runs", "--db", str(db), "--format", "json")
    assert runs.returncode == 0, runs.stderr
    assert [(r["name"], r["events"], r["world_size"]) for r in json.loads(runs.stdout)] == [("big", 4, 128)]
    table = _commlens("runs", "--api", url)
    assert table.returncode == 0 and f"1 runs in {url}" in table.stdout and "big" in table.stdout
    missing = _commlens("report", "--db", str(db), "--run", "nope")
    assert missing.returncode == 2 and "no run named 'nope'" in missing.stderr


def test_write_commands_say_how_to_do_it_through_the_api(served: tuple[Path, str, int], data_dir: Path) -> None:
    db, url, port = served
    proc = _commlens("ingest", str(data_dir / LOG), "--db", str(db), "--run", "other")
    assert proc.returncode == 2
    said = " ".join(proc.stderr.split())
    assert f"held by another process, `commlens serve` at {url}" in said
    assert f"commlens upload {data_dir / LOG} --run other --api {url}" in said
    users = _commlens("users", "add", "ann", "--db", str(db))
    said = " ".join(users.stderr.split())
    auth = '-H "Authorization: Bearer $ADMIN_TOKEN" '
    request = f"""curl -s -H 'Content-Type: application/json' -d '{{"name": "ann", "admin": false}}' {url}/api/users"""
    # the token a server off loopback needs is in the request said, and that loopback needs none
    shown = request.replace("curl -s ", "curl -s " + auth) + " (an admin's token; none is needed from loopback)"
    assert users.returncode == 2 and f"do it through the server: {shown}" in said
    listed = _commlens("users", "list", "--db", str(db))
    assert listed.returncode == 2 and f"GET {url}/api/users (an admin's token)" in " ".join(listed.stderr.split())
    made = subprocess.run(shlex.split(request), capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(made.stdout)["name"] == "ann"  # the request said, as it is, creates the user from loopback
    again = _commlens("serve", "--db", str(db), "--port", str(port), "--no-ui")
    assert again.returncode == 2 and f"is already served at {url}" in " ".join(again.stderr.split())
    other = _commlens("serve", "--db", str(db.parent / "x.duckdb"), "--port", str(port), "--no-ui")
    assert other.returncode == 2 and f"port {port} on 127.0.0.1 is in use" in " ".join(other.stderr.split())
    assert not (db.parent / "x.duckdb").exists()


def test_make_demo_refuses_a_served_store(served: tuple[Path, str, int]) -> None:
    db, url, port = served
    proc = subprocess.run(
        [sys.executable, "-m", "commlens.cli_server", str(db), str(port)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    said = " ".join(proc.stderr.split())
    assert f"is served by a running `commlens serve` ({url})" in said and "make demo DB=demo2.duckdb" in said
    assert db.is_file()


def test_read_commands_never_create_a_store(tmp_path: Path) -> None:
    for args in (["report", "--run", "x"], ["runs"]):
        proc = _commlens(*args, "--db", str(tmp_path / "none.duckdb"))
        assert proc.returncode == 2
        assert "no store at" in proc.stderr and "never create one" in proc.stderr
    (tmp_path / "c.json").write_text("{}")
    # commands that change what a store holds: users list created an empty store, config's help said it would
    for args in (
        ["users", "list"],
        ["users", "token", "x"],
        ["users", "remove", "x"],
        ["delete", "x", "--yes"],
        ["config", "--run", "x", str(tmp_path / "c.json")],
    ):
        proc = _commlens(*args, "--db", str(tmp_path / "none.duckdb"))
        assert proc.returncode == 2 and "no store at" in proc.stderr, args
    assert "(never created)" in " ".join(_commlens("config", "--help").stdout.split())
    assert [p.name for p in tmp_path.iterdir()] == ["c.json"]


def test_version_and_runs_without_a_server(tmp_path: Path, data_dir: Path) -> None:
    from commlens import __version__

    proc = _commlens("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"commlens {__version__}"
    db = tmp_path / "s.duckdb"
    assert _commlens("ingest", str(data_dir / LOG), "--db", str(db), "--run", "big").returncode == 0
    runs = _commlens("runs", "--db", str(db))
    assert runs.returncode == 0, runs.stderr
    row = next(line for line in runs.stdout.splitlines() if " big " in line)
    assert row.split("│")[1:6] == [" big ", "     1 ", "      0 ", "     4 ", "        128 "]
