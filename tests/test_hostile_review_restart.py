"""Issue 17 item 6, attacked again: a `commlens serve` killed with SIGKILL is started again on its port at once.

The killed server's connections outlive it in the kernel (FIN_WAIT/TIME_WAIT, up to a minute). uvicorn binds
with SO_REUSEADDR, so they do not stop it; but `commlens serve` first asked whether the port was free with a
bind without that option, and refused for that minute ("port ... is in use (another server?)") with
nothing listening. Real processes on loopback, a real client connected when the server dies."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from commlens import cli_server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _serve(db: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "commlens.cli", "serve", "--db", str(db), "--port", str(port), "--no-ui"],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )


def _health(proc: subprocess.Popen[bytes], url: str, log: Path) -> dict[str, object]:
    """/api/health once the server answers; fails with its output if it exits first."""
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, f"commlens serve exited {proc.returncode}: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, "commlens serve did not answer in 90 s"
        try:
            return dict(httpx.get(url + "/api/health", timeout=10).json())
        except httpx.TransportError:
            time.sleep(0.05)


def test_a_port_left_by_closed_connections_is_free_and_a_listener_holds_it() -> None:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    assert cli_server.port_in_use("127.0.0.1", port)  # listening
    accepted.close()  # the server's side closes first, as a killed server's does: TIME_WAIT on its port
    assert client.recv(1) == b""
    client.close()
    listener.close()
    assert not cli_server.port_in_use("127.0.0.1", port)


def test_a_server_killed_with_sigkill_starts_again_on_its_port(tmp_path: Path) -> None:
    db, port = tmp_path / "s.duckdb", cli_server.free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    first = _serve(db, port, tmp_path / "first.log")
    second = None
    try:
        _health(first, url, tmp_path / "first.log")
        with httpx.Client(base_url=url, timeout=60) as c:  # a client still connected when the server dies
            assert c.post("/api/runs", json={"name": "kept"}).status_code == 201
            assert c.get("/api/runs/kept").status_code == 200
            os.kill(first.pid, signal.SIGKILL)
            first.wait(30)
            second = _serve(db, port, tmp_path / "second.log")
            health = _health(second, url, tmp_path / "second.log")
        assert health["status"] in ("ok", "recovering") and health["runs"] == 1
        assert re.search(rf"Uvicorn running on http://127\.0\.0\.1:{port}\b", (tmp_path / "second.log").read_text())
        assert httpx.get(url + "/api/runs/kept", timeout=60).json()["name"] == "kept"
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(30)
