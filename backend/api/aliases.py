"""ASGI middleware: a path that names a run by a former name reaches the run, so shared links survive a rename.

`/api/runs/<old>/...` is served as `/api/runs/<new>/...` (every client gets its answer, whether or not it
follows redirects: the dashboard's own client does not), with `Content-Location` naming the current path.
A dashboard page `/runs/<old>/...` answers 308 to `/runs/<new>/...` with its query, so the address bar
shows the current name. A name that is a run's own name is never looked up as an alias. The former name stays
on `request.state` for routes that must not act on a run by it (deleting it).
"""

from __future__ import annotations

from urllib.parse import quote

from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from commlens.service.runs import resolve_alias
from commlens.store import StoreError

from .db import Database

API_PREFIX = "/api/runs/"
FORMER_NAME = "former_run_name"  # request.state attribute: the former name a rewritten request used
PAGE_PREFIX = "/runs/"


class RunAliases:
    def __init__(self, app: ASGIApp, db: Database, pages: bool):
        self.app = app
        self.db = db
        self.pages = pages  # whether the dashboard is mounted here

    def _current_name(self, old: str) -> str | None:
        try:
            with self.db.session() as cur:
                return resolve_alias(cur, old)
        except StoreError:  # shutting down: the route answers as it would
            return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        prefix = API_PREFIX if path.startswith(API_PREFIX) else PAGE_PREFIX if self.pages else ""
        run, sep, rest = path[len(prefix) :].partition("/") if prefix and path.startswith(prefix) else ("", "", "")
        new = await run_in_threadpool(self._current_name, run) if run else None
        if new is None:
            await self.app(scope, receive, send)
            return
        query = scope.get("query_string", b"")
        raw = (prefix + quote(new, safe="")).encode() + _raw_tail(scope, prefix)
        location = raw + (b"?" + query if query else b"")
        if prefix == PAGE_PREFIX:
            headers = [(b"location", location), (b"content-length", b"0")]
            await send({"type": "http.response.start", "status": 308, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_with_location(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"content-location", location)]}
            await send(message)

        state = {**scope.get("state", {}), FORMER_NAME: run}  # what the request named (request.state)
        current = {**scope, "path": prefix + new + sep + rest, "raw_path": raw, "state": state}
        await self.app(current, receive, send_with_location)


def _raw_tail(scope: Scope, prefix: str) -> bytes:
    """What follows the run's segment in the request's own (still percent-encoded) path: '/...' or ''."""
    raw = scope.get("raw_path") or quote(scope["path"]).encode()
    _, slash, rest = raw[len(prefix) :].partition(b"/")
    return slash + rest
