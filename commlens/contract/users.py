"""Who is calling and who may: health, the caller, users and their tokens."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field, StrictBool

from .common import StrictModel


class AuthInfo(BaseModel):
    loopback_bind: bool
    insecure: bool
    users: int


class Health(BaseModel):
    # "recovering": the server answers while it settles and re-queues the jobs a previous run left
    status: Literal["ok", "recovering"]
    version: str
    schema_version: int
    runs: int
    jobs_queued: int
    jobs_running: int
    auth: AuthInfo


class Me(BaseModel):
    name: str
    user_id: int | None = Field(default=None, description="null for the tokenless local user and anonymous callers")
    is_admin: bool
    can_write: bool
    via: Literal["token", "loopback", "anonymous"]


# Request booleans are JSON true or false only: pydantic's lax bool takes "yes", "on", "1" and 1 for true, so a
# typo or a form-encoded value would promote a user.
class UserCreate(StrictModel):
    name: str = Field(min_length=1, max_length=64)
    admin: StrictBool = False


class UserUpdate(StrictModel):
    admin: StrictBool = Field(description="whether the user is an admin; the last admin cannot be demoted")


class UserOut(BaseModel):
    user_id: int = Field(description="never reused: a new user given a deleted user's name gets a new id")
    name: str
    is_admin: bool
    created_at: datetime


class UserToken(BaseModel):
    name: str
    is_admin: bool
    token: str = Field(description="shown once; only its sha256 is stored")
