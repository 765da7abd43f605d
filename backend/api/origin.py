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

The rule itself (`refusal`) is in commlens.contract.access: the standalone dashboard (`commlens ui`) applies it too.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from commlens.contract.access import host_name, refusal

from .errors import problem_response

__all__ = ["OriginGuard", "host_name", "refusal"]  # the rule is the contract's, shared with `commlens ui`


class OriginGuard:
    """Refuses cross-site writes (403) and foreign Host names on a loopback bind (421) before any route runs."""

    def __init__(self, app: ASGIApp, loopback_bind: bool):
        self.app = app
        self.loopback_bind = loopback_bind

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = refusal(scope["method"], scope["headers"], scope.get("scheme", "http"), self.loopback_bind)
        if refused is None:
            await self.app(scope, receive, send)
            return
        await problem_response(Request(scope), refused.status, refused.detail, refused.kind)(scope, receive, send)
