"""Writes from another web site and DNS rebinding, against a real `commlens serve` on loopback (tokenless
local mode) and a real Chromium: a page served from another loopback port posts a multipart upload with
`mode: 'no-cors'` (a simple request, no preflight) and is refused with nothing stored; a page reached
through a name re-pointed at 127.0.0.1 is refused by its Host; the server's own origin and clients that
are not browsers (no Origin, no Sec-Fetch-Site) keep writing."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from commlens.backend.api.origin import host_name, refusal
from commlens.backend.api.testing import wait_job

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path(os.environ.get("COMMLENS_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"]
LOG = "nccl-logs/nvidia-nccl-1238.log"
# The attack: a multipart upload the browser sends without a preflight; the page cannot read the answer.
POST_UPLOAD = """async ([url, text]) => {
  const form = new FormData();
  form.append('files', new Blob([text]), 'evil.log');
  await fetch(url, {method: 'POST', mode: 'no-cors', body: form});
}"""


def _browser_missing() -> str | None:
    if importlib.util.find_spec("playwright") is None:
        return "playwright is not installed"
    if not CHROMIUM.exists():
        return f"no Chromium at {CHROMIUM}"
    return None


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`commlens serve` on 127.0.0.1 with a run 'victim' created by a plain HTTP client."""
    tmp = tmp_path_factory.mktemp("origin")
    log = open(tmp / "serve.log", "w+")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "commlens.cli", "serve", "--db", str(tmp / "s.duckdb"), "--port", "0", "--no-ui"],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    url = ""
    try:
        deadline = time.monotonic() + 60
        while not url:
            assert proc.poll() is None, "commlens serve exited: " + (tmp / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "commlens serve did not start in 60 s"
            m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", (tmp / "serve.log").read_text())
            url = m.group(1) if m else ""
            time.sleep(0.1)
        assert httpx.post(url + "/api/runs", json={"name": "victim"}).status_code == 201
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def other_site() -> Iterator[str]:
    """Another loopback origin: a blank page on its own port (same host, another port: another origin)."""

    class Blank(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<!doctype html><title>elsewhere</title><p>elsewhere</p>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Blank)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def chromium(served: str) -> Iterator[Any]:
    missing = _browser_missing()
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{missing}; CI needs it")
        pytest.skip(missing)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # rebind.test resolves to 127.0.0.1 in this browser: what a rebinding attacker's DNS answer achieves
        b = p.chromium.launch(
            executable_path=str(CHROMIUM), args=[*CHROMIUM_ARGS, "--host-resolver-rules=MAP rebind.test 127.0.0.1"]
        )
        yield b
        b.close()


def _state(api: httpx.Client) -> tuple[int, int]:
    """(jobs, files of run 'victim') as a plain client sees them."""
    return api.get("/api/jobs").json()["total"], api.get("/api/runs/victim/sources").json()["total"]


def test_a_page_of_another_origin_cannot_upload(served: str, other_site: str, chromium: Any, data_dir: Path) -> None:
    text = (data_dir / LOG).read_text()
    with httpx.Client(base_url=served, timeout=60) as api:
        before = _state(api)
        page = chromium.new_page()
        page.goto(other_site + "/")
        target = served + "/api/runs/victim/files"
        with page.expect_response(target) as answer:
            page.evaluate(POST_UPLOAD, [target, text])
        response = answer.value
        assert response.status == 403  # loopback mode has no other 403: the same fetch from the own origin is 202
        page.close()
        assert _state(api) == before  # no job, no file
        assert api.get("/api/runs/victim/sources").json()["items"] == []


def test_the_servers_own_origin_uploads(served: str, chromium: Any, data_dir: Path) -> None:
    text = (data_dir / LOG).read_text()
    page = chromium.new_page()
    page.goto(served + "/api/health")  # a page of the server's own origin
    target = served + "/api/runs/own/files"
    with page.expect_response(target) as answer:
        page.evaluate(
            "async ([base]) => { await fetch(base + '/api/runs', {method: 'POST', "
            "headers: {'Content-Type': 'application/json'}, body: JSON.stringify({name: 'own'})}); }",
            [served],
        )
        page.evaluate(POST_UPLOAD, [target, text])
    assert answer.value.status == 202
    job_id = answer.value.json()["job_id"]
    page.close()
    with httpx.Client(base_url=served, timeout=60) as api:
        job = wait_job(api, job_id)
        assert {r["upload"]: r["status"] for r in job["results"]} == {"evil.log": "ok"}
        assert [s["path"] for s in api.get("/api/runs/own/sources").json()["items"]] == ["evil.log"]


def test_a_rebound_name_is_refused_by_its_host(served: str, chromium: Any) -> None:
    port = served.rsplit(":", 1)[1]
    page = chromium.new_page()
    response = page.goto(f"http://rebind.test:{port}/api/runs")
    assert response is not None and response.status == 421
    assert "rebinding" in page.text_content("body")
    page.close()
    with httpx.Client(base_url=served, timeout=60) as api:
        before = _state(api)
        r = api.post("/api/runs", json={"name": "rebound"}, headers={"Host": f"attacker.example:{port}"})
        assert r.status_code == 421 and r.headers["content-type"].startswith("application/problem+json")
        assert "'attacker.example:" in r.json()["detail"]
        assert api.get("/api/runs/victim", headers={"Host": f"evil.example:{port}"}).status_code == 421
        assert _state(api) == before
        # loopback names of this machine are the server's own
        for host in (f"localhost:{port}", f"127.0.0.1:{port}"):
            assert api.get("/api/runs/victim", headers={"Host": host}).status_code == 200


def test_clients_that_are_not_browsers_write(served: str) -> None:
    with httpx.Client(base_url=served, timeout=60) as api:
        assert api.post("/api/runs", json={"name": "from-curl"}).status_code == 201
        assert api.delete("/api/runs/from-curl").status_code == 204
        # a browser form posted from elsewhere says so in Sec-Fetch-Site even without Origin
        r = api.post("/api/runs", json={"name": "x"}, headers={"Sec-Fetch-Site": "cross-site"})
        assert r.status_code == 403 and "cross-site" in r.json()["detail"]
        r = api.post("/api/runs", json={"name": "x"}, headers={"Origin": "null"})
        assert r.status_code == 403 and "another origin (null)" in r.json()["detail"]
        assert api.get("/api/runs/x").status_code == 404


@pytest.mark.parametrize(
    ("method", "headers", "loopback", "status"),
    [
        ("POST", {b"host": b"127.0.0.1:8050", b"origin": b"http://127.0.0.1:8050"}, True, None),
        ("POST", {b"host": b"127.0.0.1:8050", b"origin": b"http://localhost:8050"}, True, 403),
        ("POST", {b"host": b"127.0.0.1:8050", b"origin": b"https://127.0.0.1:8050"}, True, 403),
        ("POST", {b"host": b"127.0.0.1:8050", b"sec-fetch-site": b"same-site"}, True, 403),
        ("DELETE", {b"host": b"[::1]:8050", b"sec-fetch-site": b"same-origin"}, True, None),
        ("GET", {b"host": b"127.0.0.1:8050", b"origin": b"http://elsewhere.example"}, True, None),
        ("GET", {b"host": b"rebind.example:8050"}, True, 421),
        ("GET", {b"host": b"server.lan:8050"}, False, None),
        ("PUT", {b"host": b"server.lan:8050", b"origin": b"http://server.lan:8050"}, False, None),
        ("PATCH", {b"host": b"server.lan:8050", b"origin": b"http://evil.lan:8050"}, False, 403),
    ],
)
def test_refusal_rule(method: str, headers: dict[bytes, bytes], loopback: bool, status: int | None) -> None:
    got = refusal(method, headers, "http", loopback)
    assert (got.status if got else None) == status


def test_host_name() -> None:
    assert [host_name(h) for h in ("[::1]:8050", "[::1]", "localhost:80", "127.0.0.1", "::1")] == [
        "::1",
        "::1",
        "localhost",
        "127.0.0.1",
        "::1",
    ]
