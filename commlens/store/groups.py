"""Writes of process groups' schemes: the rows scheme attribution and users' overrides change.

Attribution (`commlens.backend.attribution`) decides; these functions are the SQL that stores what it
decided. An override (`scheme_source = 'override'`) is a user's and attribution never overwrites it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import duckdb

from .transaction import transaction


@dataclass(frozen=True)
class SchemeVerdict:
    """A group's scheme and the evidence for it, as process_groups stores them."""

    group_key: str
    scheme: str
    source: str  # label | structure | unknown
    reason: str
    confidence: float


def add_event_groups(con: duckdb.DuckDBPyConnection, run_id: int) -> None:
    """A row for every group the run's events name but no source described, so the comms view can show
    its scheme once attribution gives it one."""
    con.execute(
        """
        INSERT INTO process_groups (run_id, group_key, size, origin)
        SELECT ?, group_key, max(group_size), 'event' FROM comm_events
        WHERE run_id = ? AND group_key IS NOT NULL
          AND group_key NOT IN (SELECT group_key FROM process_groups WHERE run_id = ?)
        GROUP BY group_key
        """,
        [run_id, run_id, run_id],
    )


def store_verdicts(con: duckdb.DuckDBPyConnection, run_id: int, verdicts: Iterable[SchemeVerdict]) -> None:
    """The attributed schemes onto their groups, overrides left as they are."""
    for v in verdicts:
        con.execute(
            """
            UPDATE process_groups SET scheme = ?, scheme_source = ?, scheme_reason = ?, scheme_confidence = ?
            WHERE run_id = ? AND group_key = ? AND coalesce(scheme_source, '') <> 'override'
            """,
            [v.scheme, v.source, v.reason, v.confidence, run_id, v.group_key],
        )


def pin_scheme(con: duckdb.DuckDBPyConnection, run_id: int, group_key: str, scheme: str, reason: str) -> None:
    """A user's override of a group's scheme, in one transaction; a group only events name gets its row
    first. LookupError when neither a group row nor any event has the key."""

    def pin(c: duckdb.DuckDBPyConnection) -> None:
        known = c.execute(
            "SELECT count(*) FROM process_groups WHERE run_id = ? AND group_key = ?", [run_id, group_key]
        ).fetchall()[0][0]
        if not known:
            calls, size = c.execute(
                "SELECT count(*), max(group_size) FROM comm_events WHERE run_id = ? AND group_key = ?",
                [run_id, group_key],
            ).fetchall()[0]
            if not calls:
                raise LookupError(group_key)
            c.execute(
                "INSERT INTO process_groups (run_id, group_key, size, origin) VALUES (?, ?, ?, 'event')",
                [run_id, group_key, size],
            )
        c.execute(
            """
            UPDATE process_groups SET scheme = ?, scheme_source = 'override', scheme_reason = ?, scheme_confidence = 1.0
            WHERE run_id = ? AND group_key = ?
            """,
            [scheme, reason, run_id, group_key],
        )

    transaction(con, pin)


def unpin_scheme(con: duckdb.DuckDBPyConnection, run_id: int, group_key: str) -> None:
    """Drop a user's override: the group's scheme is attribution's again."""
    con.execute(
        "UPDATE process_groups SET scheme_source = NULL WHERE run_id = ? AND group_key = ? AND scheme_source = 'override'",
        [run_id, group_key],
    )
