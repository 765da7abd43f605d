"""ASGI guard against writes from other web sites and against DNS rebinding.

A browser sends "simple" cross-site requests (a multipart POST with `mode: 'no-cors'`) without any
preflight, and a loopback-bound server takes a tokenless loopback client for its local admin: without
this guard any page the user opens could write into the store. So:

- a state-changing request (POST, PUT, PATCH, DELETE) whose `Sec-Fetch-Site` is neither `same-origin`
  nor `none`, or whose `Origin` is not this server's own (scheme and the `Host` it was reached by), is
  refused with 403; clients that send neither header (curl, the CLI, the dashboard's server-side
  client) are not browsers acting for another site and pass;
- on a loopback-bound server every request must name a loopback host (`localhost`, 127.0.0.0/8,
  `[::1]`) in `Host`: a page whose own name was re-pointed at 127.0.0.1 (DNS rebinding) is the same
  origin to the browser, and only its `Host` header gives it away. Off loopback, callers write with
  tokens, which a browser never attaches on its own, so there the `Host` is not restricted.
"""

from __future__ import annotations

from typing import NamedTuple
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from commlens.contract.access import is_loopback

from .errors import problem_response

STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
OWN_SITE = frozenset({"same-origin", "none"})  # Sec-Fetch-Site values a page of this server (or the user) sends


def host_name(host: str) -> str:
    """The name part of a Host header value ('[::1]:8050' -> '::1', 'localhost:80' -> 'localhost')."""
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class Refusal(NamedTuple):
    status: int
    kind: str
    detail: str


def refusal(method: str, headers: dict[bytes, bytes], scheme: str, loopback_bind: bool) -> Refusal | None:
    """Why this request must be refused, or None. `headers` are the request's, names in lower case."""
    host = headers.get(b"host", b"").decode("latin-1").strip()
    if loopback_bind and host and not is_loopback(host_name(host)):
        return Refusal(
            421,
            "misdirected-request",
            f"this server listens on loopback and answers only to a loopback Host (localhost, 127.0.0.1, [::1]), "
            f"not {host!r}: a name pointed at this machine by another site (DNS rebinding) does not reach it",
        )
    if method not in STATE_CHANGING:
        return None
    site = headers.get(b"sec-fetch-site", b"").decode("latin-1").strip().lower()
    if site and site not in OWN_SITE:
        return Refusal(
            403,
            "cross-origin-write",
            f"a {site} request may not change anything here (Sec-Fetch-Site: {site}); "
            "write from this server's own pages, the CLI or an HTTP client",
        )
    origin = headers.get(b"origin")
    if origin is not None:
        seen = origin.decode("latin-1").strip()
        parts = urlsplit(seen)
        if seen == "null" or parts.scheme != scheme or not host or parts.netloc.lower() != host.lower():
            return Refusal(
                403,
                "cross-origin-write",
                f"a request from another origin ({seen}) may not change anything on {scheme}://{host}; "
                "write from this server's own pages, the CLI or an HTTP client",
            )
    return None


class OriginGuard:
    """Refuses cross-site writes (403) and foreign Host names on a loopback bind (421) before any route runs."""

    def __init__(self, app: ASGIApp, loopback_bind: bool):
        self.app = app
        self.loopback_bind = loopback_bind

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = refusal(scope["method"], dict(scope["headers"]), scope.get("scheme", "http"), self.loopback_bind)
        if refused is None:
            await self.app(scope, receive, send)
            return
        await problem_response(None, refused.status, refused.detail, refused.kind)(scope, receive, send)
