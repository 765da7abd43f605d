"""docker-compose.yml: validated by `docker-compose config`, and its service commands started for real
(with the store and port swapped for temporary ones) so a renamed option cannot hide in YAML."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"


def compose_exe() -> str:
    exe = shutil.which("docker-compose")
    if exe is None:
        if os.environ.get("CI") == "true":
            pytest.fail("docker-compose is not installed; CI needs it (apt-get install -y docker-compose)")
        pytest.skip("docker-compose is not installed (apt-get install -y docker-compose)")
    return exe


ADMIN_TOKEN = "test-admin-token-" + "x" * 24  # what a deployment exports as COMMLENS_ADMIN_TOKEN


def compose_config(**env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "COMMLENS_ADMIN_TOKEN"}
    return subprocess.run(
        [compose_exe(), "-f", str(COMPOSE), "config"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**base, "COMPOSE_PROJECT_NAME": "commlens-test", **env},
        check=False,
    )


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    done = compose_config(COMMLENS_ADMIN_TOKEN=ADMIN_TOKEN)
    assert done.returncode == 0, f"docker-compose config failed:\n{done.stderr}"
    return yaml.safe_load(done.stdout)


def test_compose_refuses_to_run_without_an_admin_token() -> None:
    """Reachable from the network, the server must not accept tokenless writes: no token, no service."""
    done = compose_config()
    assert done.returncode != 0 and "set COMMLENS_ADMIN_TOKEN to a long random secret" in done.stderr


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """target -> source of a service's volumes (string or long syntax, as compose versions render them)."""
    out = {}
    for v in service.get("volumes", []):
        if isinstance(v, str):
            source, target = v.split(":")[:2]
        else:
            source, target = v["source"], v["target"]
        out[target] = source
    return out


def option(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_api_and_ui_service_keeps_the_store_in_a_named_volume(config: dict[str, Any]) -> None:
    svc = config["services"]["commlens"]
    cmd = [str(c) for c in svc["command"]]
    assert cmd[:2] == ["commlens", "serve"]
    assert "--no-ui" not in cmd  # the dashboard is served at / next to the API
    assert option(cmd, "--host") == "0.0.0.0" and "--insecure" not in cmd
    assert svc["environment"]["COMMLENS_ADMIN_TOKEN"] == ADMIN_TOKEN
    db = Path(option(cmd, "--db"))
    volume = mounts(svc)[str(db.parent)]
    assert volume in config["volumes"], "the store's folder must be a named volume"
    assert "profiles" not in svc
    port = int(option(cmd, "--port"))
    assert [int(p["target"]) if isinstance(p, dict) else int(str(p).split(":")[-1]) for p in svc["ports"]] == [port]


def test_separate_ui_service_points_at_the_api_service(config: dict[str, Any]) -> None:
    ui = config["services"]["ui"]
    cmd = [str(c) for c in ui["command"]]
    assert cmd[:2] == ["commlens", "ui"] and ui["profiles"] == ["ui"]
    api = urlsplit(option(cmd, "--api"))
    api_cmd = [str(c) for c in config["services"]["commlens"]["command"]]
    assert api.hostname == "commlens" and api.port == int(option(api_cmd, "--port"))
    assert "commlens" in ui["depends_on"]


def test_harness_is_an_optional_gpu_profile_that_uploads_to_the_api(config: dict[str, Any]) -> None:
    h = config["services"]["harness"]
    assert h["profiles"] == ["harness"]
    assert h["build"]["args"]["EXTRAS"] == "harness"
    devices = h["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    script = " ".join(str(c) for c in h["command"])
    assert "commlens harness" in script and "--device cuda" in script
    assert "commlens upload" in script and "--api http://commlens:8050" in script
    assert h["environment"]["COMMLENS_TOKEN"] == ADMIN_TOKEN  # the upload's token (writes need one)
    assert "/runs" in mounts(h)


def test_dockerfile_copies_every_package_folder() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    copied = {m.group(1) for m in re.finditer(r"^COPY (\S+) \./", dockerfile, re.M)}
    dirs = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    assert dirs <= copied, f"not copied into the image: {dirs - copied}"
    for src in copied:
        assert (ROOT / src).exists(), src


def _start(cmd: list[str], tmp: Path, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str, Path]:
    log = tmp / f"{cmd[1]}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "commlens.cli", *cmd[1:]],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        cwd=tmp,
        env={**os.environ, **(env or {})},
    )
    deadline = time.monotonic() + 60
    while True:
        m = re.search(r"Uvicorn running on http://[^:]+:(\d+)", log.read_text())
        if m:
            return proc, f"http://127.0.0.1:{m.group(1)}", log
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{' '.join(cmd)} did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.mark.slow
def test_the_services_commands_start(config: dict[str, Any], tmp_path: Path) -> None:
    serve = [str(c) for c in config["services"]["commlens"]["command"]]
    serve[serve.index("--db") + 1] = str(tmp_path / "store.duckdb")
    serve[serve.index("--port") + 1] = "0"
    proc, url, _ = _start(
        serve, tmp_path, {k: str(v) for k, v in config["services"]["commlens"]["environment"].items()}
    )
    try:
        assert httpx.get(url + "/api/health", timeout=30).json()["auth"]["insecure"] is False
        run = {"name": "composed"}
        assert httpx.post(url + "/api/runs", json=run, timeout=30).status_code == 401  # bound to 0.0.0.0: a token
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        assert httpx.post(url + "/api/runs", json=run, headers=admin, timeout=30).status_code == 201
        assert httpx.get(url + "/api/me", headers=admin, timeout=30).json()["name"] == "admin"
        page = httpx.get(url + "/", timeout=30)
        assert page.status_code == 200 and "_dash-config" in page.text  # the dashboard at /
        assert httpx.get(url + "/api/nope", timeout=30).status_code == 404  # the API keeps /api

        ui = [str(c) for c in config["services"]["ui"]["command"]]
        ui[ui.index("--port") + 1] = "0"
        # in front of this loopback-bound API, a UI on 0.0.0.0 would make every visitor the local admin
        refused = subprocess.run(
            [sys.executable, "-m", "commlens.cli", *ui[1:3], url, *ui[4:]],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
            check=False,
        )
        assert refused.returncode == 2 and "local admin" in refused.stderr.replace("\n", " ")
        uproc, uurl, _ = _start(ui, tmp_path)  # as composed: the API at http://commlens:8050
        try:
            assert "_dash-config" in httpx.get(uurl + "/", timeout=30).text
            assert httpx.get(uurl + "/_dash-layout", timeout=30).status_code == 200
        finally:
            _stop(uproc)
    finally:
        _stop(proc)
