"""A real uvicorn server in a background thread on an ephemeral port (tests and benchmarks)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any

import uvicorn

from .app import create_app
from .settings import Settings


class ServerThread:
    """`with ServerThread(settings) as srv: httpx.get(srv.url + "/api/health")`"""

    def __init__(self, settings: Settings, ui: Any = None, startup_timeout: float = 30.0):
        self.settings = replace(settings, port=0)
        self.ui = ui
        self.startup_timeout = startup_timeout
        self.url = ""
        self.app: Any = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ServerThread:
        self.app = create_app(self.settings, ui=self.ui)
        config = uvicorn.Config(self.app, host=self.settings.host, port=0, log_level="warning", lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="commlens-test-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        host = self.settings.host if self.settings.host not in ("0.0.0.0", "::") else "127.0.0.1"
        self.url = f"http://{host}:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None and self._thread is not None
        self._server.should_exit = True
        self._thread.join(30)


def wait_job(client: Any, job_id: str, timeout: float = 60.0) -> dict[str, Any]:
    """Poll GET /api/jobs/{id} until the job is done or failed; the final job document."""
    deadline = time.monotonic() + timeout
    while True:
        job = client.get(f"/api/jobs/{job_id}").json()
        if job["state"] in ("done", "failed"):
            return job
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {job['state']} after {timeout} s: {job}")
        time.sleep(0.05)
