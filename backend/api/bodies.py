"""ASGI guard for JSON request bodies: size limit (413) and nesting depth (422) checked before any
parser sees the body, so a hostile body gets a clear answer instead of a recursion error."""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import problem_response

MAX_JSON_DEPTH = 64
_BRACKETS = bytes(range(256)).translate(None, b"[]{}")  # every byte except the brackets, to delete


def json_depth(body: bytes) -> int:
    """Deepest nesting of [ and { outside JSON strings."""
    plain = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = b"".join(plain.split(b'"')[0::2])
    depth = deepest = 0
    for c in outside.translate(None, _BRACKETS):
        if c in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


class JsonBodyGuard:
    def __init__(self, app: ASGIApp, max_bytes: int, max_depth: int = MAX_JSON_DEPTH):
        self.app = app
        self.max_bytes = max_bytes
        self.max_depth = max_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if ctype.startswith(b"multipart/") or not scope["path"].startswith("/api/"):
            await self.app(scope, receive, send)  # uploads stream under their own limits; the UI has its own
            return
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(
                scope,
                receive,
                send,
                413,
                f"the request body has {int(declared)} bytes; the limit for JSON bodies is {self.max_bytes}",
                "body-too-large",
            )
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(
                    scope,
                    receive,
                    send,
                    413,
                    f"the request body exceeds the limit of {self.max_bytes} bytes for JSON bodies",
                    "body-too-large",
                )
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            await self._refuse(
                scope,
                receive,
                send,
                422,
                f"the request body is not valid UTF-8 (byte {exc.start}); JSON must be UTF-8",
                "invalid-utf8",
            )
            return
        depth = json_depth(body)
        if depth > self.max_depth:
            await self._refuse(
                scope,
                receive,
                send,
                422,
                f"the JSON body nests {depth} levels deep; at most {self.max_depth} are accepted",
                "json-too-deep",
            )
            return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, status: int, detail: str, kind: str) -> None:
        response = problem_response(Request(scope), status, detail, kind)
        await response(scope, receive, send)
