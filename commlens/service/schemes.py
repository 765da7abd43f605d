"""Users' scheme overrides: pin or drop a group's scheme, then recompute what depends on the schemes.

The time tables carry each call's scheme (the per-scheme breakdown, stragglers per scheme, the critical path's
shares), so an override recomputes the run's time analysis in the same transaction as the pin.
"""

from __future__ import annotations

import duckdb

from commlens.backend import attribution
from commlens.backend.findings_time import store_timing_inputs
from commlens.backend.iterations import run_id_of
from commlens.backend.timing.persist import persist_run
from commlens.contract.analysis import GroupAttribution
from commlens.store import release_memory, transaction

from .runs import WRITE_ATTEMPTS


def override_scheme(
    con: duckdb.DuckDBPyConnection, run: str, group_key: str, scheme: str, reason: str
) -> GroupAttribution:
    """Pin `group_key`'s scheme (with the user's reason) and recompute the run's time analysis."""

    def pin(c: duckdb.DuckDBPyConnection) -> GroupAttribution:
        result = attribution.set_override(c, run, group_key, scheme, reason)
        persist_run(c, run_id := run_id_of(c, run))
        store_timing_inputs(c, run_id)
        return result

    try:
        return transaction(con, pin, WRITE_ATTEMPTS)
    finally:
        release_memory(con)  # the time analysis' reads are not kept cached in a long-lived server


def clear_scheme_override(con: duckdb.DuckDBPyConnection, run: str, group_key: str) -> list[GroupAttribution]:
    """Drop the override, attribute the run again from its evidence, and recompute its time analysis."""

    def unpin(c: duckdb.DuckDBPyConnection) -> list[GroupAttribution]:
        result = attribution.clear_override(c, run, group_key)
        persist_run(c, run_id := run_id_of(c, run))
        store_timing_inputs(c, run_id)
        return result

    try:
        return transaction(con, unpin, WRITE_ATTEMPTS)
    finally:
        release_memory(con)  # the time analysis' reads are not kept cached in a long-lived server
