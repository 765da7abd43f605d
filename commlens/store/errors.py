"""The store's one error type."""

from __future__ import annotations


class StoreError(Exception):
    """A store problem a person can act on (locked file, wrong schema version, unknown run)."""
