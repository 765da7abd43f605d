"""The application factory: the API under /api, OpenAPI docs at /docs, an optional UI mounted at /."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import RedirectResponse
from fastapi.routing import APIRoute

from commlens import __version__
from commlens.service.users import admin_count, user_count

from . import analysis, config, errors, export, hang, pairs, review, runs, uploads, users
from . import time as time_routes
from .aliases import RunAliases
from .bodies import JsonBodyGuard
from .db import Database
from .deps import AppContext, single_query_values
from .errors import ApiError
from .ingest_queue import IngestQueue
from .origin import OriginGuard
from .settings import Settings

log = logging.getLogger("commlens.api")


class StartupRefusedError(RuntimeError):
    """The server must not start with these settings (the message says why and what to do)."""


def check_exposure(settings: Settings, db: Database) -> None:
    """Bound off loopback, the server needs users (tokens) unless told --insecure."""
    if settings.loopback or settings.insecure:
        return
    with db.session() as cur:
        if user_count(cur) == 0:
            raise StartupRefusedError(
                f"refusing to listen on {settings.host}: the store has no users, so anyone on the network could write. "
                "Create one with `commlens users add NAME --admin --db ...`, bind to 127.0.0.1, or pass --insecure."
            )
        if admin_count(cur) == 0:
            raise StartupRefusedError(
                f"refusing to listen on {settings.host}: none of the store's users is an admin, so nobody could add "
                "a user or change a role once it serves (the store is the server's while it runs). Create one with "
                "`commlens users add NAME --admin --db ...` first."
            )


def as_asgi(ui: Any) -> Any:
    """A Dash app, a Flask/WSGI app or an ASGI app, as an ASGI app for the mount at /."""
    server = getattr(ui, "server", None)  # Dash keeps its Flask app here
    wsgi = server if server is not None and hasattr(server, "wsgi_app") else (ui if hasattr(ui, "wsgi_app") else None)
    if wsgi is None:
        return ui
    from a2wsgi import WSGIMiddleware  # a dependency: Dash gets its own thread pool

    return WSGIMiddleware(wsgi)


def create_app(settings: Settings, ui: Any = None, db: Database | None = None) -> FastAPI:
    """The commlens service. `ui` (a Dash, WSGI or ASGI app) is mounted at `/` after the API routes."""
    db = db or Database(settings.db)
    check_exposure(settings, db)
    ingest_queue = IngestQueue(db, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ingest_queue.start()
        log.info("commlens serving %s on %s:%s", settings.db, settings.host, settings.port)
        try:
            yield
        finally:
            if ingest_queue.stop():
                db.close()
            else:
                log.warning("ingest queue still busy at shutdown; the unfinished job is marked failed at next start")

    app = FastAPI(
        title="commlens",
        version=__version__,
        lifespan=lifespan,
        docs_url="/docs",
        redoc_url=None,
        openapi_url="/api/openapi.json",
        description="Communication of distributed training runs: ingest, attribution, histograms, predictions, "
        "findings and review. Errors are application/problem+json. Lists are paginated with "
        "limit/offset (`next_offset` is null on the last page). Auth: `Authorization: Bearer <token>`; "
        "on a loopback-bound server loopback clients need none.",
    )
    app.state.ctx = AppContext(settings=settings, db=db, ingest_queue=ingest_queue)
    errors.install(app)
    api = APIRouter(prefix="/api", dependencies=[Depends(single_query_values)])
    for module in (users, runs, uploads, export, analysis, review, time_routes, hang, config, pairs):
        api.include_router(module.router)
    app.include_router(api)
    _install_api_fallback(
        app,
        [
            r
            for m in (users, runs, uploads, export, analysis, review, time_routes, hang, config, pairs)
            for r in m.router.routes
            if isinstance(r, APIRoute)
        ],
    )

    @app.get("/openapi.json", include_in_schema=False)
    def _openapi_at_the_root() -> RedirectResponse:  # FastAPI's usual place; the dashboard's page otherwise
        return RedirectResponse("/api/openapi.json", status_code=308)

    if ui is not None:
        app.mount("/", as_asgi(ui), name="ui")
    app.add_middleware(RunAliases, db=db, pages=ui is not None)  # a run's former names reach it
    app.add_middleware(JsonBodyGuard, max_bytes=settings.max_json_body_bytes)
    app.add_middleware(OriginGuard, loopback_bind=settings.loopback)  # outermost: refuses before a body is read
    return app


def _install_api_fallback(app: FastAPI, routes: list[APIRoute]) -> None:
    """Unknown /api paths answer problem+json 404/405 even when a UI is mounted at / (it would catch them)."""

    @app.api_route(
        "/api/{rest:path}",
        methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"],
        include_in_schema=False,
    )
    async def _fallback(request: Request, rest: str) -> None:
        path = "/" + rest
        allowed = sorted({m for r in routes if r.path_regex.match(path) for m in r.methods or ()})
        if allowed:
            raise ApiError(
                405,
                f"{request.method} is not allowed on {request.url.path}; allowed: {', '.join(allowed)}",
                "method-not-allowed",
                headers={"Allow": ", ".join(allowed)},
            )
        raise ApiError(
            404, f"no such endpoint: {request.method} {request.url.path}; see /docs for the API", "not-found"
        )
