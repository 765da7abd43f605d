"""Where the UI finds the API, and a client for the browser's user.

Mounted in `commlens serve`, the API is the same server: its address is the local socket the request
arrived on (the WSGI environ's SERVER_NAME/PORT, set by the server, not by the client), so the UI
works on any port, including an ephemeral one. Run alone, the UI is given the API's URL.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import flask
import httpx

from .client import TIMEOUT, ApiClient


def local_base_url(environ: dict[str, Any]) -> str:
    host = str(environ.get("SERVER_NAME") or "127.0.0.1")
    port = str(environ.get("SERVER_PORT") or "80")
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


@dataclass
class UiConfig:
    api_url: str | None = None  # None: the API is the server this UI is mounted in
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=TIMEOUT))

    def base_url(self) -> str:
        if self.api_url:
            return self.api_url.rstrip("/")
        return local_base_url(flask.request.environ)

    def client(self, token: str | None) -> ApiClient:
        """A client calling as the browser's user: their token, else the API's tokenless rules."""
        return ApiClient(self.base_url(), token, self.http)
