"""The schema version kept in `meta.schema_version`, a new store's tables, and the explicit upgrades.

The DDL is split by owner: `trace.sql` (runs and their former names, ingested rows and the `comms` view),
`review.sql` (users, review items), `jobs.sql` (the API's ingest jobs), `aggregates.sql` (per-run
aggregates), `time.sql` (the time analysis's results), `pairs.sql` (all-to-all bytes per sender and
receiver). A new store gets all of them at the current version; an older one is upgraded step by step,
each step in one transaction.
"""

from __future__ import annotations

import functools
import re
from importlib import resources

import duckdb

from .errors import StoreError
from .layout import BREAKDOWN_ORDER, MEMCPY_ORDER
from .tables import AGG_TABLES, TIME_FINDING_TABLES, TIME_TABLES
from .transaction import transaction

SCHEMA_VERSION = 11
SCHEMA_FILES = ("trace.sql", "review.sql", "jobs.sql", "aggregates.sql", "time.sql", "hang.sql", "pairs.sql")
META_SQL = """CREATE TABLE IF NOT EXISTS meta (
    key   VARCHAR PRIMARY KEY,
    value VARCHAR NOT NULL
);
"""
_VIEW = "CREATE OR REPLACE VIEW comms"


def schema_file(name: str) -> str:
    return resources.files("commlens.store").joinpath(name).read_text()


def schema_sql() -> str:
    """The whole schema of a new store, in creation order."""
    return META_SQL + "\n".join(schema_file(name) for name in SCHEMA_FILES)


def _create_tables(file: str, names: tuple[str, ...]) -> list[str]:
    """The CREATE TABLE statements of `names` in one schema file (upgrades create tables as declared)."""
    return [
        m.group(0)
        for m in re.finditer(r"CREATE TABLE IF NOT EXISTS (\w+) \(.*?\n\);", schema_file(file), re.S)
        if m.group(1) in names
    ]


_TIME_COLUMNS = (
    "match_key BIGINT",
    "cpu_start_us DOUBLE",
    "cpu_end_us DOUBLE",
    "dev_start_us DOUBLE",
    "dev_end_us DOUBLE",
)


def _reorder(table: str, order: str) -> list[str]:
    """Rewrite a time table as declared now (its row order, its keys): renamed aside, created, filled in order."""
    return [
        f"ALTER TABLE {table} RENAME TO {table}_before",
        *_create_tables("time.sql", (table,)),
        f"INSERT INTO {table} BY NAME SELECT * FROM {table}_before ORDER BY {order}",  # later columns NULL
        f"DROP TABLE {table}_before",
    ]


# Explicit upgrades: {from_version: [sql, ...]} applied in order up to SCHEMA_VERSION.
# 1 -> 2: per-run aggregate tables, empty; each run's are filled by its first refresh.
# 2 -> 3: comm_events.counted (an NCCL log and a profiler trace of the same rank count each call once);
#         every existing call counts, as before, until its run is linked again.
# 3 -> 4: the time analysis: comm_events gains match_key and the CPU/device spans of each call (NULL for
#         calls ingested before: their run's next ingest fills them), timeline_intervals and the result
#         tables of time.sql, empty until each run's next ingest or attribution computes them.
# 4 -> 5: fr_entries (hang.sql), empty: Flight Recorder dumps ingested from now on fill it.
# 5 -> 6: a2a_pairs (pairs.sql), empty: traces ingested from now on fill it (a run ingested before shows
#         no all-to-all matrix until its files are ingested again).
# 6 -> 7: the timing findings' inputs (time_finding_cells, _keys, _runs in time.sql), empty: a run's timing
#         findings appear at its next ingest or scheme change, which fills them after its time tables.
# 7 -> 8: identity and ownership: review_items.author_id, each item mapped to the user of its author's name (NULL
#         where none exists now: no one edits such an item as its author); runs.owner_id, NULL for every
#         existing run (admins rename those); run_aliases (a run's former names), empty.
# 8 -> 9: time_breakdown and time_memcpy rewritten in the step-block order (layout.py), so that reads of one step
#         and of one rank prune row groups; the rows themselves are unchanged.
# 9 -> 10: time_instances and time_instance_members rewritten without their primary keys (time.sql says why), in
#          the order the analysis writes them; the rows are unchanged.
# 10 -> 11: time_instances.last_own_us (the wait the last arrival imposed less what it inherited), filled with the
#           whole imposed wait (what the wait-dominated finding's cause rank weighed before) until the run's next
#           time analysis.
MIGRATIONS: dict[int, list[str]] = {
    1: _create_tables("aggregates.sql", AGG_TABLES),
    2: ["ALTER TABLE comm_events ADD COLUMN counted BOOLEAN DEFAULT true"],
    3: [
        *(f"ALTER TABLE comm_events ADD COLUMN {col}" for col in _TIME_COLUMNS),
        *_create_tables("trace.sql", ("timeline_intervals",)),
        *_create_tables("time.sql", TIME_TABLES),
    ],
    4: _create_tables("hang.sql", ("fr_entries",)),
    5: _create_tables("pairs.sql", ("a2a_pairs",)),
    6: _create_tables("time.sql", TIME_FINDING_TABLES),
    7: [  # idempotent: IF NOT EXISTS, and only items not mapped yet
        "ALTER TABLE review_items ADD COLUMN IF NOT EXISTS author_id INTEGER",
        "UPDATE review_items SET author_id = u.user_id FROM users u "
        "WHERE review_items.author_id IS NULL AND u.name = review_items.author",
        "ALTER TABLE runs ADD COLUMN IF NOT EXISTS owner_id INTEGER",
        *_create_tables("trace.sql", ("run_aliases",)),
    ],
    8: [*_reorder("time_breakdown", BREAKDOWN_ORDER), *_reorder("time_memcpy", MEMCPY_ORDER)],
    9: [
        *_reorder("time_instances", "run_id, instance_id"),
        *_reorder("time_instance_members", "run_id, instance_id, rank"),
    ],
    10: [
        "ALTER TABLE time_instances ADD COLUMN IF NOT EXISTS last_own_us DOUBLE",
        """UPDATE time_instances i SET last_own_us = m.w FROM (
               SELECT run_id, instance_id, sum(wait_us) AS w FROM time_instance_members GROUP BY ALL
           ) m
           WHERE i.run_id = m.run_id AND i.instance_id = m.instance_id AND i.last_rank IS NOT NULL""",
    ],
}


def stored_version(con: duckdb.DuckDBPyConnection) -> int | None:
    rows = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchall()
    return int(rows[0][0]) if rows else None


def create(con: duckdb.DuckDBPyConnection) -> None:
    """Create every table of a new store at the current version."""
    con.execute(schema_sql())
    con.execute("INSERT INTO meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)])


def check_version(con: duckdb.DuckDBPyConnection, path: str) -> None:
    version = stored_version(con)
    if version != SCHEMA_VERSION:
        raise StoreError(
            f"{path} has schema version {version}, this commlens expects {SCHEMA_VERSION}; "
            "open it once for writing to upgrade it"
        )


def migrate(con: duckdb.DuckDBPyConnection, path: str) -> None:
    """Upgrade an older store to SCHEMA_VERSION; refuse a newer one."""
    version = stored_version(con)
    if version is None:
        raise StoreError(f"{path}: the meta table has no schema_version")
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"{path} has schema version {version}, newer than this commlens ({SCHEMA_VERSION}); upgrade commlens"
        )
    while version < SCHEMA_VERSION:
        steps = MIGRATIONS.get(version)
        if steps is None:
            raise StoreError(f"{path}: no upgrade from schema version {version}")
        version += 1
        transaction(con, functools.partial(_apply, steps=steps, version=version))
    # Views are recreated on every open so a fixed view definition reaches old files too.
    con.execute(_VIEW + schema_file("trace.sql").split(_VIEW, 1)[1])


def _apply(con: duckdb.DuckDBPyConnection, steps: list[str], version: int) -> None:
    for sql in steps:
        con.execute(sql)
    con.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", [str(version)])
