"""Users and tokens (admins only), who am I, and health."""

from __future__ import annotations

from fastapi import APIRouter, Response

from commlens import __version__
from commlens.contract.common import Page
from commlens.contract.users import AuthInfo, Health, Me, UserCreate, UserOut, UserToken
from commlens.ingest.store import SCHEMA_VERSION

from . import auth
from .db import transaction
from .deps import Admin, Caller, Ctx, Cursor, Limit, Offset, next_offset
from .errors import ApiError, problem_responses

router = APIRouter()


@router.get("/health", response_model=Health, tags=["meta"])
def health(cur: Cursor, ctx: Ctx) -> Health:
    runs = cur.execute("SELECT count(*) FROM runs").fetchone()[0]
    states = dict(cur.execute("SELECT state, count(*) FROM jobs WHERE state IN ('queued', 'running') GROUP BY state").fetchall())
    return Health(status="ok", version=__version__, schema_version=SCHEMA_VERSION, runs=runs,
                  jobs_queued=states.get("queued", 0), jobs_running=states.get("running", 0),
                  auth=AuthInfo(loopback_bind=ctx.settings.loopback, insecure=ctx.settings.insecure,
                                users=auth.user_count(cur)))


@router.get("/me", response_model=Me, tags=["users"], responses=problem_responses(401))
def me(who: Caller) -> Me:
    return Me(name=who.name, is_admin=who.is_admin, can_write=who.can_write, via=who.via)  # type: ignore[arg-type]


@router.get("/users", response_model=Page[UserOut], tags=["users"], responses=problem_responses(401, 403))
def list_users(cur: Cursor, _: Admin, limit: Limit = 100, offset: Offset = 0) -> Page[UserOut]:
    total = auth.user_count(cur)
    rows = cur.execute("SELECT name, is_admin, created_at FROM users ORDER BY name LIMIT ? OFFSET ?", [limit, offset]).fetchall()
    return Page[UserOut](items=[UserOut(name=r[0], is_admin=r[1], created_at=r[2]) for r in rows], total=total,
                         limit=limit, offset=offset, next_offset=next_offset(offset, limit, total))


@router.post("/users", response_model=UserToken, status_code=201, tags=["users"],
             responses=problem_responses(401, 403, 409, 422), summary="Create a user; the token is shown only here")
def create_user(body: UserCreate, cur: Cursor, _: Admin) -> UserToken:
    try:
        auth.check_user_name(body.name)
    except ValueError as exc:
        raise ApiError(422, str(exc), "invalid-user-name") from None

    def add(c):  # noqa: ANN001, ANN202
        try:
            return auth.add_user(c, body.name, body.admin)
        except ValueError as exc:
            raise ApiError(409, str(exc), "user-exists") from None

    token = transaction(cur, add)
    return UserToken(name=body.name, is_admin=body.admin, token=token)


@router.post("/users/{name}/token", response_model=UserToken, tags=["users"], responses=problem_responses(401, 403, 404),
             summary="Replace a user's token (the old one stops working)")
def rotate(name: str, cur: Cursor, _: Admin) -> UserToken:
    def do(c):  # noqa: ANN001, ANN202
        try:
            token = auth.rotate_token(c, name)
        except LookupError as exc:
            raise ApiError(404, str(exc), "unknown-user") from None
        return token, c.execute("SELECT is_admin FROM users WHERE name = ?", [name]).fetchone()[0]

    token, is_admin = transaction(cur, do)
    return UserToken(name=name, is_admin=is_admin, token=token)


@router.delete("/users/{name}", status_code=204, tags=["users"], responses=problem_responses(401, 403, 404))
def delete_user(name: str, cur: Cursor, _: Admin) -> Response:
    def do(c):  # noqa: ANN001, ANN202
        if not c.execute("DELETE FROM users WHERE name = ? RETURNING name", [name]).fetchall():
            raise ApiError(404, f"no user named {name!r}", "unknown-user")

    transaction(cur, do)
    return Response(status_code=204)
