"""Normalised rows that parsers produce and the store writes.

A parser turns one input file into a `ParseResult`. Row dicts use exactly the column names of the
matching table in commlens/store/trace.sql (minus run_id/source_id, which the store fills in); missing keys are
NULL. Parsers never touch the database.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa


class ParseError(Exception):
    """A file that cannot be ingested. `where` is a line number ("line 12") or a JSON path ("$.traceEvents[3]")."""

    def __init__(self, reason: str, where: str | None = None):
        self.reason = reason
        self.where = where
        super().__init__(f"{where}: {reason}" if where else reason)


@dataclass
class RankHint:
    """What the caller knows about the file's rank when the file itself may not say."""

    rank: int | None = None  # from --rank
    world_size: int | None = None


@dataclass
class ParseResult:
    kind: str  # kineto | nccl_log | run_config
    rank: int | None = None  # global rank of a per-rank file
    world_size: int | None = None
    events: list[dict[str, Any]] = field(default_factory=list)  # comm_events rows
    # More comm_events rows as Arrow tables (columns named as comm_events; dictionary-encoded strings
    # allowed; missing columns are NULL). Large NCCL logs put their rows here.
    event_tables: list[pa.Table] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)  # steps rows
    # timeline_intervals rows (kineto_timeline.INTERVAL_SCHEMA): the rank's activity, merged intervals.
    intervals: pa.Table | None = None
    groups: list[dict[str, Any]] = field(default_factory=list)  # process_groups rows
    nccl_comms: list[dict[str, Any]] = field(default_factory=list)
    topology: list[dict[str, Any]] = field(default_factory=list)
    tuning: list[dict[str, Any]] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)  # reason -> count
    warnings: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    run_config: dict[str, Any] | None = None  # a validated run.json, when the file is one
    fr_entries: list[dict[str, Any]] = field(default_factory=list)  # Flight Recorder entries (hang.sql)
    # a2a_pairs rows (pairs.sql): bytes each all_to_all call (rank, seq of its comm_events row) sends to
    # each member of its group (peer = the member's group rank)
    a2a_pairs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def n_events(self) -> int:
        """comm_events rows in `events` and `event_tables`."""
        return len(self.events) + sum(t.num_rows for t in self.event_tables)

    def skip(self, reason: str, n: int = 1) -> None:
        self.skipped[reason] += n

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)
