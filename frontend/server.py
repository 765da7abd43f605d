"""The dashboard as its own service (`commlens ui`, `python -m commlens.frontend`) against an API URL."""

from __future__ import annotations

import argparse
from typing import Any
from urllib.parse import urlsplit

import uvicorn
from a2wsgi import WSGIMiddleware

from commlens.contract.access import is_loopback, refusal

from .app import create_ui


class UiRefusedError(RuntimeError):
    """The UI must not start with these settings (the message says why)."""


def check_exposure(host: str, api_url: str, insecure: bool) -> None:
    """A UI reachable from the network in front of a loopback API would hand every visitor the API's
    tokenless local admin (the API sees the UI's loopback address); refuse that unless told --insecure."""
    parts = urlsplit(api_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UiRefusedError(
            f"--api must be an http(s) URL of the commlens server, like http://127.0.0.1:8050; got {api_url!r}"
        )
    if not is_loopback(host) and is_loopback(parts.hostname) and not insecure:
        raise UiRefusedError(
            f"refusing to serve the UI on {host} in front of the API at {api_url}: that API trusts loopback clients as "
            "its local admin, so every visitor of the UI would be one. Serve the API off loopback with users "
            "(commlens users add NAME) and point --api at that address, bind the UI to 127.0.0.1, or pass --insecure."
        )


class OriginGuard:
    """The API's rule (`refusal`) in front of the dashboard: its callbacks write through the API as this
    process, a loopback client, so a page of another site (403) or one reached by a rebound name (421 on
    a loopback bind) must not reach them."""

    def __init__(self, app: Any, loopback_bind: bool) -> None:
        self.app = app
        self.loopback_bind = loopback_bind

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        refused = None
        if scope["type"] == "http":
            refused = refusal(scope["method"], scope["headers"], scope.get("scheme", "http"), self.loopback_bind)
        if refused is None:
            await self.app(scope, receive, send)
            return
        body = f"{refused.status} {refused.kind}: {refused.detail}\n".encode()
        headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": refused.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def serve_ui(
    api_url: str, host: str = "127.0.0.1", port: int = 8051, insecure: bool = False, log_level: str = "info"
) -> None:
    check_exposure(host, api_url, insecure)
    dash = WSGIMiddleware(create_ui(api_url=api_url).server)  # Dash's Flask app, in uvicorn's thread pool
    app = OriginGuard(dash, loopback_bind=is_loopback(host))
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, proxy_headers=False)).run()


def tcp_port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (0-65535)")
    return port


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m commlens.frontend", description=__doc__)
    p.add_argument("--api", required=True, help="the commlens server's root URL, e.g. http://api:8050")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=tcp_port, default=8051)
    p.add_argument("--insecure", action="store_true", help="serve off loopback in front of a loopback API")
    args = p.parse_args(argv)
    try:
        serve_ui(args.api, args.host, args.port, args.insecure)
    except UiRefusedError as exc:
        p.exit(2, f"error: {exc}\n")
