"""Users and tokens (admins only), who am I, and health."""

from __future__ import annotations

from fastapi import APIRouter, Response

from commlens import __version__
from commlens.contract.common import Page
from commlens.contract.users import AuthInfo, Health, Me, UserCreate, UserOut, UserToken, UserUpdate
from commlens.service import jobs, runs
from commlens.service import users as service
from commlens.store import SCHEMA_VERSION

from .deps import Admin, Caller, Ctx, Cursor, Limit, Offset, next_offset
from .errors import problem_responses

router = APIRouter()


@router.get("/health", response_model=Health, tags=["meta"])
def health(cur: Cursor, ctx: Ctx) -> Health:
    states = jobs.job_counts(cur)
    return Health(
        status="recovering" if ctx.ingest_queue.recovering else "ok",
        version=__version__,
        schema_version=SCHEMA_VERSION,
        runs=runs.count_runs(cur),
        jobs_queued=states["queued"],
        jobs_running=states["running"],
        auth=AuthInfo(
            loopback_bind=ctx.settings.loopback, insecure=ctx.settings.insecure, users=service.user_count(cur)
        ),
    )


@router.get("/me", response_model=Me, tags=["users"], responses=problem_responses(401))
def me(who: Caller) -> Me:
    return Me(
        name=who.name,
        user_id=who.user_id,
        is_admin=who.is_admin,
        can_write=who.can_write,
        via=who.via,  # type: ignore[arg-type]
    )


@router.get("/users", response_model=Page[UserOut], tags=["users"], responses=problem_responses(401, 403))
def list_users(cur: Cursor, _: Admin, limit: Limit = 100, offset: Offset = 0) -> Page[UserOut]:
    total = service.user_count(cur)
    items = [
        UserOut(user_id=u.user_id, name=u.name, is_admin=u.is_admin, created_at=u.created_at)
        for u in service.list_users(cur, limit, offset)
    ]
    return Page[UserOut](
        items=items, total=total, limit=limit, offset=offset, next_offset=next_offset(offset, limit, total)
    )


@router.post(
    "/users",
    response_model=UserToken,
    status_code=201,
    tags=["users"],
    responses=problem_responses(401, 403, 409, 422),
    summary="Create a user; the token is shown only here",
)
def create_user(body: UserCreate, cur: Cursor, _: Admin) -> UserToken:
    token = service.add_user(cur, body.name, body.admin)
    return UserToken(name=body.name, is_admin=body.admin, token=token)


@router.post(
    "/users/{name}/token",
    response_model=UserToken,
    tags=["users"],
    responses=problem_responses(401, 403, 404),
    summary="Replace a user's token (the old one stops working)",
)
def rotate(name: str, cur: Cursor, _: Admin) -> UserToken:
    token, is_admin = service.rotate_token(cur, name)
    return UserToken(name=name, is_admin=is_admin, token=token)


@router.patch(
    "/users/{name}",
    response_model=UserOut,
    tags=["users"],
    responses=problem_responses(401, 403, 404, 409, 422),
    summary="Make a user an admin or not (the last admin stays one)",
)
def update_user(name: str, body: UserUpdate, cur: Cursor, _: Admin) -> UserOut:
    u = service.set_admin(cur, name, body.admin)
    return UserOut(user_id=u.user_id, name=u.name, is_admin=u.is_admin, created_at=u.created_at)


@router.delete(
    "/users/{name}",
    status_code=204,
    tags=["users"],
    responses=problem_responses(401, 403, 404, 409),
    summary="Delete a user (not the last admin); its review items keep its name, editable by admins only",
)
def delete_user(name: str, cur: Cursor, _: Admin) -> Response:
    service.remove_user(cur, name)
    return Response(status_code=204)
