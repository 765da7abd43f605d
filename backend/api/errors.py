"""Errors as RFC 9457 problem details (application/problem+json), each with a detail a person can act on."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

import duckdb
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from commlens.backend.iterations import UnknownRunError
from commlens.service.errors import ConflictError, ForbiddenError, InvalidError, NotFoundError, ServiceError
from commlens.store import StoreError

log = logging.getLogger("commlens.api")

PROBLEM_JSON = "application/problem+json"
TYPE_BASE = "https://commlens.dev/problems/"


class Problem(BaseModel):
    type: str
    title: str
    status: int
    detail: str
    instance: str | None = None
    errors: list[dict[str, Any]] | None = None  # request validation: one entry per bad field


class ApiError(Exception):
    """Raised by routes; becomes a problem+json response."""

    def __init__(
        self,
        status: int,
        detail: str,
        kind: str | None = None,
        headers: dict[str, str] | None = None,
        errors: list[dict[str, Any]] | None = None,
    ):
        self.status = status
        self.detail = detail
        self.kind = kind or HTTPStatus(status).phrase.lower().replace(" ", "-")
        self.headers = headers
        self.errors = errors
        super().__init__(detail)


def problem_response(
    request: Request | None,
    status: int,
    detail: str,
    kind: str | None = None,
    headers: dict[str, str] | None = None,
    errors: list[dict[str, Any]] | None = None,
) -> JSONResponse:
    phrase = HTTPStatus(status).phrase
    body = Problem(
        type=TYPE_BASE + (kind or phrase.lower().replace(" ", "-")),
        title=phrase,
        status=status,
        detail=detail,
        instance=request.url.path if request is not None else None,
        errors=errors,
    )
    return JSONResponse(
        body.model_dump(exclude_none=True), status_code=status, media_type=PROBLEM_JSON, headers=headers
    )


def problem_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses=` entries documenting problem+json errors."""
    return {
        s: {
            "model": Problem,
            "description": HTTPStatus(s).phrase,
            "content": {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}},
        }
        for s in statuses
    }


def _body_not_json(exc: RequestValidationError) -> bool:
    """Whether the body as a whole was not an object (not: a field of it was wrong)."""
    return any(tuple(e.get("loc", ())) == ("body",) and e.get("type") != "missing" for e in exc.errors())


def _validation_errors(exc: RequestValidationError) -> tuple[str, list[dict[str, Any]]]:
    errors = []
    parts = []
    for e in exc.errors():
        if e.get("type") == "json_invalid":  # its loc is ("body", character offset), not a field
            offset = e.get("loc", ("body", "?"))[-1]
            loc, msg = "body", f"not valid JSON at character {offset}: {e.get('ctx', {}).get('error', 'decode error')}"
        else:
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
            msg = str(e.get("msg", "invalid"))
        errors.append({"field": loc, "message": msg})
        parts.append(f"{loc}: {msg}")
    return "invalid request: " + "; ".join(parts[:5]) + (
        f" (and {len(parts) - 5} more)" if len(parts) > 5 else ""
    ), errors


_SERVICE_STATUS: dict[type[ServiceError], int] = {
    NotFoundError: 404,
    ConflictError: 409,
    InvalidError: 422,
    ForbiddenError: 403,
}


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return problem_response(request, exc.status, exc.detail, exc.kind, exc.headers, exc.errors)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        said = request.headers.get("content-type", "")
        if _body_not_json(exc) and not said.split(";")[0].strip().lower().endswith("json"):
            # `curl -d '{...}'` without -H sends a form: FastAPI then finds no object at all
            what = f"Content-Type {said!r}" if said else "no Content-Type"
            return problem_response(
                request,
                415,
                f"the body is read as JSON: send it with Content-Type: application/json (this request has {what})",
                "unsupported-media-type",
            )
        detail, errors = _validation_errors(exc)
        return problem_response(request, 422, detail, "invalid-request", errors=errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"no such endpoint: {request.method} {request.url.path}; see /docs for the API"
        elif exc.status_code == 405:
            detail = f"{request.method} is not allowed on {request.url.path}; see /docs for the methods it takes"
        return problem_response(request, exc.status_code, detail, headers=getattr(exc, "headers", None))

    @app.exception_handler(ServiceError)
    async def _refused(request: Request, exc: ServiceError) -> JSONResponse:
        return problem_response(request, _SERVICE_STATUS[type(exc)], exc.detail, exc.kind)

    @app.exception_handler(UnknownRunError)
    async def _unknown_run(request: Request, exc: UnknownRunError) -> JSONResponse:
        return problem_response(request, 404, f"{exc}; GET /api/runs lists the runs", "unknown-run")

    @app.exception_handler(StoreError)
    async def _store(request: Request, exc: StoreError) -> JSONResponse:
        return problem_response(request, 503, str(exc), "store-unavailable")

    @app.exception_handler(duckdb.TransactionException)
    async def _conflict(request: Request, exc: duckdb.TransactionException) -> JSONResponse:
        return problem_response(
            request, 409, f"a concurrent change touched the same rows ({exc}); retry the request", "write-conflict"
        )

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return problem_response(
            request,
            500,
            f"internal error ({type(exc).__name__}); the server log has the traceback. "
            "Nothing was changed by this request unless its response said so.",
            "internal-error",
        )
