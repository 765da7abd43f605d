"""Normalised rows that parsers produce and the store writes.

A parser turns one input file into a `ParseResult`. Row dicts use exactly the column names of the
matching table in commlens/store/trace.sql (minus run_id/source_id, which the store fills in); missing keys are
NULL. Parsers never touch the database.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

# Column order and Arrow types of the store tables parsers fill (the store adds run_id and source_id).
TABLE_COLUMNS: dict[str, dict[str, pa.DataType]] = {
    "comm_events": {
        "rank": pa.int32(),
        "process": pa.string(),
        "seq": pa.int64(),
        "op": pa.string(),
        "dtype": pa.string(),
        "msg_bytes": pa.int64(),
        "elems_in": pa.int64(),
        "elems_out": pa.int64(),
        "group_size": pa.int32(),
        "group_key": pa.string(),
        "peer": pa.int32(),
        "step": pa.int32(),
        "ts_us": pa.float64(),
        "dur_us": pa.float64(),
        "dur_source": pa.string(),
        "op_count": pa.int64(),
        "comm_ptr": pa.string(),
        "raw_name": pa.string(),
        "match_key": pa.int64(),
        "cpu_start_us": pa.float64(),
        "cpu_end_us": pa.float64(),
        "dev_start_us": pa.float64(),
        "dev_end_us": pa.float64(),
    },
    "steps": {"rank": pa.int32(), "step": pa.int32(), "ts_us": pa.float64(), "dur_us": pa.float64()},
    "timeline_intervals": {
        "rank": pa.int32(),
        "kind": pa.string(),
        "stream": pa.int64(),
        "start_us": pa.float64(),
        "end_us": pa.float64(),
        "nbytes": pa.int64(),
    },
    "nccl_comms": {
        "group_key": pa.string(),
        "host": pa.string(),
        "pid": pa.int32(),
        "cuda_dev": pa.int32(),
        "comm_ptr": pa.string(),
        "comm_rank": pa.int32(),
        "nranks": pa.int32(),
        "global_rank": pa.int32(),
        "comm_id": pa.string(),
        "parent_ptr": pa.string(),
        "color": pa.int32(),
        "split_key": pa.int32(),
        "bus_id": pa.string(),
        "nvml_dev": pa.int32(),
        "api": pa.string(),
        "nccl_version": pa.string(),
    },
    "nccl_topology": {
        "group_key": pa.string(),
        "host": pa.string(),
        "pid": pa.int32(),
        "comm_ptr": pa.string(),
        "kind": pa.string(),
        "channel": pa.int32(),
        "ranks": pa.list_(pa.int32()),
        "src_rank": pa.int32(),
        "dst_rank": pa.int32(),
        "transport": pa.string(),
        "detail": pa.string(),
    },
    "fr_entries": {
        "rank": pa.int32(),
        "record_id": pa.int64(),
        "group_key": pa.string(),
        "group_name": pa.string(),
        "group_desc": pa.string(),
        "group_ranks": pa.list_(pa.int32()),
        "collective_seq": pa.int64(),
        "p2p_seq": pa.int64(),
        "op_id": pa.int64(),
        "op": pa.string(),
        "raw_name": pa.string(),
        "is_p2p": pa.bool_(),
        "dtype": pa.string(),
        "msg_bytes": pa.int64(),
        "state": pa.string(),
        "created_us": pa.float64(),
        "started_us": pa.float64(),
        "completed_us": pa.float64(),
        "duration_us": pa.float64(),
        "timeout_ms": pa.float64(),
        "retired": pa.bool_(),
    },
    "a2a_pairs": {"rank": pa.int32(), "seq": pa.int64(), "peer": pa.int32(), "bytes": pa.int64()},
    "nccl_tuning": {
        "host": pa.string(),
        "pid": pa.int32(),
        "op": pa.string(),
        "bytes": pa.int64(),
        "algo": pa.string(),
        "proto": pa.string(),
        "time_us": pa.float64(),
        "channels": pa.string(),
    },
}

# ParseResult's row lists by the store table they fill (comm_events also has event_tables).
ROW_LISTS = {
    "comm_events": "events",
    "steps": "steps",
    "nccl_comms": "nccl_comms",
    "nccl_topology": "topology",
    "nccl_tuning": "tuning",
    "fr_entries": "fr_entries",
    "a2a_pairs": "a2a_pairs",
}


class ParseError(Exception):
    """A file that cannot be ingested. `where` is a line number ("line 12") or a JSON path ("$.traceEvents[3]")."""

    def __init__(self, reason: str, where: str | None = None):
        self.reason = reason
        self.where = where
        super().__init__(f"{where}: {reason}" if where else reason)


class UnknownFormatError(ParseError):
    """A file that is none of the formats read: the format it was tried as (the fallback) is not its kind."""


@dataclass
class RankHint:
    """What the caller knows about the file's rank when the file itself may not say."""

    rank: int | None = None  # from --rank
    world_size: int | None = None
    rank_from: str = "--rank"  # what said the rank, for warnings (parse_file: --rank or the file's name)


def unshared(table: pa.Table) -> pa.Table:
    """`table`, or a copy of its rows alone when it is a slice of much larger buffers: pickle (a parse worker's
    answer, a split ingest's parse held on disk) writes a slice's whole buffers, not the rows it shows."""
    if table.get_total_buffer_size() <= 2 * table.nbytes + (1 << 16):
        return table
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return pa.ipc.open_stream(sink.getvalue()).read_all()


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
    # rows of the tables above moved into Arrow by as_tables(), by store table
    arrow_rows: dict[str, pa.Table] = field(default_factory=dict)

    @property
    def n_events(self) -> int:
        """comm_events rows in `events` and `event_tables`."""
        return len(self.events) + sum(t.num_rows for t in self.event_tables)

    def flush_events(self) -> None:
        """Move the comm_events row dicts into `event_tables` (one Arrow table): a parser that makes many
        rows calls it every few thousand, so rows are kept as columns, not as dicts."""
        if self.events:
            table = rows_table("comm_events", self.events)
            self.event_tables.append(table.replace_schema_metadata({FROM_ROWS: b"1"}))
            self.events = []

    def all_events(self) -> list[dict[str, Any]]:
        """Every comm_events row as a dict of every column, those in `event_tables` first (as made: a parser
        that flushes moves its earlier rows there). For tools and tests of one file; the store reads tables."""
        tables = self.event_tables + ([rows_table("comm_events", self.events)] if self.events else [])
        return [row for t in tables for row in conform("comm_events", t).to_pylist()]

    def event_rows(self, columns: list[str]) -> list[dict[str, Any]]:
        """`columns` of the comm_events rows made as dicts (in `events`, or moved into `event_tables` by
        flush_events), without the tables a parser built as columns."""
        rows = [{c: e.get(c) for c in columns} for e in self.events]
        for t in self.event_tables:
            if t.schema.metadata and t.schema.metadata.get(FROM_ROWS):
                have = [c for c in columns if c in t.column_names]
                rows += [{c: r.get(c) for c in columns} for r in t.select(have).to_pylist()]
        return rows

    def tables(self) -> dict[str, pa.Table]:
        """Every row of the file as one Arrow table per store table (columns of TABLE_COLUMNS; tables
        without rows left out): what a worker process or a cluster task hands back, pickled."""
        out: dict[str, pa.Table] = {}
        for table, attr in ROW_LISTS.items():
            parts = [rows_table(table, getattr(self, attr))] if getattr(self, attr) else []
            if table == "comm_events":
                parts += [t for t in self.event_tables if t.num_rows]
            if table in self.arrow_rows:
                parts.append(self.arrow_rows[table])
            if parts:
                out[table] = _concat_conformed(table, parts)
        if self.intervals is not None and self.intervals.num_rows:
            out["timeline_intervals"] = conform("timeline_intervals", self.intervals)
        return out

    def as_tables(self) -> ParseResult:
        """This result with its bulky rows as Arrow tables: comm_events row dicts moved into `event_tables`,
        a2a_pairs into `arrow_rows`; compact to hold and to pickle, written by the store the same way. The
        few rows per file the service reads as dicts (steps, groups, NCCL communicators) stay dicts."""
        if self.a2a_pairs:
            self.arrow_rows["a2a_pairs"] = rows_table("a2a_pairs", self.a2a_pairs)
            self.a2a_pairs = []
        self.flush_events()
        self.event_tables = [unshared(t) for t in self.event_tables]
        self.arrow_rows = {name: unshared(t) for name, t in self.arrow_rows.items()}
        if self.intervals is not None:
            self.intervals = unshared(self.intervals)
        return self

    def skip(self, reason: str, n: int = 1) -> None:
        self.skipped[reason] += n

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)


FROM_ROWS = b"commlens.from_rows"  # schema metadata of an event table made from row dicts


def rows_table(table: str, rows: list[dict[str, Any]]) -> pa.Table:
    """Row dicts as an Arrow table of `table`'s columns (TABLE_COLUMNS types) that any row has; keys that
    are no column are ignored."""
    present = set().union(*(r.keys() for r in rows))
    columns = {k: t for k, t in TABLE_COLUMNS[table].items() if k in present}
    return pa.table(
        {k: pa.array([r.get(k) for r in rows], type=t) for k, t in columns.items()},
        schema=pa.schema(list(columns.items())),
    )


def conform(table: str, arrow: pa.Table) -> pa.Table:
    """`arrow` with every column of `table` in TABLE_COLUMNS order and type (dictionaries decoded, missing
    columns NULL, other columns dropped): one schema per store table, whichever parser made the rows."""
    cols = []
    for name, typ in TABLE_COLUMNS[table].items():
        if name not in arrow.column_names:
            cols.append(pa.nulls(arrow.num_rows, typ))
            continue
        col = arrow[name]
        cols.append(col if col.type == typ else col.cast(typ))
    return pa.table(cols, schema=pa.schema(list(TABLE_COLUMNS[table].items())))


def _concat_conformed(table: str, tables: list[pa.Table]) -> pa.Table:
    return pa.concat_tables([conform(table, t) for t in tables])
