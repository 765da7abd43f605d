"""Issue 17 item 4, attacked again: the standalone dashboard (`commlens ui`) and repeated headers.

`commlens ui --api http://127.0.0.1:PORT` on loopback turns each visitor's Dash callback into a tokenless API
request from 127.0.0.1, which the loopback API takes for its local admin. A page reached through a DNS name
re-pointed at 127.0.0.1 is the UI's own origin to the browser, so it may send the JSON callbacks a
cross-site page cannot: before the UI applied the API's rule, such a page added review items as `local`.
Real processes on loopback: the API in a server thread, `commlens ui` as a subprocess, real HTTP; and a
real Chromium resolving `rebind.test` to 127.0.0.1. The API's own guard is attacked with repeated
`Origin` / `Sec-Fetch-Site` values and a bracketed Host with a name after it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from commlens.backend.api.settings import Settings
from commlens.backend.api.testing import ServerThread
from commlens.contract.access import host_name, is_loopback, refusal

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path(os.environ.get("COMMLENS_CHROMIUM", "/usr/bin/chromium"))


def _review_callback(text: str) -> dict[str, Any]:
    """The review page's "add comment" callback (frontend/page_review.py `act`) as Dash's page posts it."""
    return {
        "output": "..rv-msg.children...rv-refresh.data...rv-new-text.value..",
        "outputs": [
            {"id": "rv-msg", "property": "children"},
            {"id": "rv-refresh", "property": "data"},
            {"id": "rv-new-text", "property": "value"},
        ],
        "inputs": [{"id": "rv-new-btn", "property": "n_clicks", "value": 1}, [], [], []],
        "changedPropIds": ["rv-new-btn.n_clicks"],
        "state": [
            {"id": "rv-new-text", "property": "value", "value": text},
            [],
            {"id": "rv-refresh", "property": "data", "value": 0},
            {"id": "rv-run", "property": "data", "value": "victim"},
            {"id": "token", "property": "data", "value": None},
        ],
    }


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A loopback-bound API (tokenless local mode) with a run 'victim'."""
    with ServerThread(Settings(db=tmp_path_factory.mktemp("api") / "s.duckdb")) as srv:
        assert httpx.post(srv.url + "/api/runs", json={"name": "victim"}, timeout=60).status_code == 201
        yield srv.url


@pytest.fixture(scope="module")
def ui(api: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`commlens ui` on 127.0.0.1 in front of the loopback API."""
    log_path = tmp_path_factory.mktemp("ui") / "ui.log"
    log = open(log_path, "w+")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "commlens.cli", "ui", "--api", api, "--port", "0"],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    url = ""
    try:
        deadline = time.monotonic() + 90
        while not url:
            assert proc.poll() is None, "commlens ui exited: " + log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "commlens ui did not start in 90 s"
            m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", log_path.read_text())
            url = m.group(1) if m else ""
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _comments(api: str) -> list[str]:
    items = httpx.get(api + "/api/runs/victim/review", timeout=60).json()["items"]
    return sorted(i["body"] for i in items)


def test_a_rebound_page_cannot_use_the_dashboards_callbacks(api: str, ui: str) -> None:
    port = ui.rsplit(":", 1)[1]
    rebound = f"rebind.test:{port}"
    before = _comments(api)
    with httpx.Client(base_url=ui, timeout=60) as c:
        page = c.get("/", headers={"Host": rebound})
        assert page.status_code == 421 and "rebinding" in page.text
        # what a rebound page's fetch sends: same origin to the browser, so JSON and no preflight
        r = c.post(
            "/_dash-update-component",
            json=_review_callback("written by a rebound page"),
            headers={"Host": rebound, "Origin": f"http://{rebound}", "Sec-Fetch-Site": "same-origin"},
        )
        assert r.status_code == 421, r.text
        # a page of another site (another loopback port) is refused before the callback runs
        r = c.post(
            "/_dash-update-component",
            json=_review_callback("written by another site"),
            headers={"Origin": "http://127.0.0.1:9", "Sec-Fetch-Site": "same-site"},
        )
        assert r.status_code == 403 and "cross-origin-write" in r.text
    assert _comments(api) == before


def test_the_dashboards_own_page_still_writes(api: str, ui: str) -> None:
    host = ui.removeprefix("http://")
    with httpx.Client(base_url=ui, timeout=60) as c:
        assert c.get("/").status_code == 200
        r = c.post(
            "/_dash-update-component",
            json=_review_callback("written on the dashboard"),
            headers={"Origin": ui, "Sec-Fetch-Site": "same-origin", "Host": host},
        )
    assert r.status_code == 200, r.text
    assert re.search(r"Comment #\d+ added by local\.", r.text)
    assert "written on the dashboard" in _comments(api)


def test_a_rebound_name_opens_no_dashboard_in_chromium(ui: str) -> None:
    if not CHROMIUM.exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"no Chromium at {CHROMIUM}; CI needs it")
        pytest.skip(f"no Chromium at {CHROMIUM}")
    from playwright.sync_api import sync_playwright

    port = ui.rsplit(":", 1)[1]
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=str(CHROMIUM),
            args=["--no-sandbox", "--disable-gpu", "--no-first-run", "--host-resolver-rules=MAP rebind.test 127.0.0.1"],
        )
        try:
            page = browser.new_page()
            response = page.goto(f"http://rebind.test:{port}/")
            assert response is not None and response.status == 421
            assert "DNS rebinding" in page.text_content("body")
            own = page.goto(ui + "/")
            assert own is not None and own.status == 200
            # the dashboard's own callbacks (same-origin POSTs) pass: "who am I" is filled by one
            page.wait_for_selector("#whoami-name", timeout=60_000)
            assert page.text_content("#whoami-name") == "local"
        finally:
            browser.close()


def test_repeated_headers_cannot_hide_a_foreign_value(api: str) -> None:
    port = api.rsplit(":", 1)[1]
    own = f"http://127.0.0.1:{port}"
    with httpx.Client(base_url=api, timeout=60) as c:
        for headers in (
            [("Origin", "http://evil.example"), ("Origin", own)],
            [("Sec-Fetch-Site", "cross-site"), ("Sec-Fetch-Site", "same-origin")],
        ):
            r = c.post("/api/runs", json={"name": "smuggled"}, headers=headers)
            assert r.status_code == 403 and r.json()["type"].endswith("/cross-origin-write"), (headers, r.text)
        r = c.post("/api/runs", json={"name": "smuggled"}, headers={"Host": f"[::1]evil.example:{port}"})
        assert r.status_code == 421, r.text
        assert c.get("/api/runs/smuggled").status_code == 404


def test_the_rule_reads_every_value() -> None:
    pairs = [(b"host", b"127.0.0.1:8050"), (b"origin", b"http://127.0.0.1:8050"), (b"origin", b"null")]
    refused = refusal("POST", pairs, "http", True)
    assert refused is not None and (refused.status, refused.kind) == (403, "cross-origin-write")
    assert refusal("POST", pairs[:2], "http", True) is None
    two_hosts = [(b"host", b"127.0.0.1:8050"), (b"host", b"rebind.example:8050")]
    assert getattr(refusal("GET", two_hosts, "http", True), "status", None) == 421
    assert [host_name(h) for h in ("[::1]:8050", "[::1]", "[::1]evil.example", "[::1]:80x")] == [
        "::1",
        "::1",
        "[::1]evil.example",
        "[::1]:80x",
    ]
    assert not is_loopback(host_name("[::1]evil.example"))
