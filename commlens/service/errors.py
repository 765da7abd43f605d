"""What an operation refuses, by kind of refusal; adapters map each class onto their own answer (HTTP
status, exit code). `kind` is a stable slug a client can branch on."""

from __future__ import annotations


class ServiceError(Exception):
    def __init__(self, detail: str, kind: str):
        super().__init__(detail)
        self.detail = detail
        self.kind = kind


class NotFoundError(ServiceError, LookupError):
    """The thing named does not exist."""


class ConflictError(ServiceError):
    """The store's state forbids it now (a name taken, a run with jobs in progress)."""


class InvalidError(ServiceError, ValueError):
    """The input itself is wrong, whatever the store holds."""


class ForbiddenError(ServiceError):
    """The caller may not do it (not the author, not an admin)."""
