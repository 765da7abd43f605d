"""The DuckDB store: its schema split by owner (`*.sql`), the schema version and explicit upgrades
(`migrations`), opening a store (`connection`), the one transaction helper (`transaction`), the one
writer of trace rows (`writer`), the check for a rank's trace already in a run (`overlap`) and the
one list of a run's tables (`tables`).

Callers import the names below from `commlens.store`; nothing else of the project writes trace rows.
"""

from .connection import connect, release_memory
from .errors import StoreError
from .jobs import active_jobs
from .migrations import MIGRATIONS, SCHEMA_VERSION, schema_sql
from .overlap import same_calls_trace, same_rank_trace
from .tables import AGG_TABLES, RUN_TABLES, TRACE_TABLES
from .transaction import in_transaction, retry_conflicts, transaction
from .writer import (
    check_new_run_name,
    ensure_run,
    find_source,
    get_run_id,
    record_failure,
    replace_run_data,
    set_run_config,
    write_result,
)

__all__ = [
    "AGG_TABLES",
    "MIGRATIONS",
    "RUN_TABLES",
    "SCHEMA_VERSION",
    "TRACE_TABLES",
    "StoreError",
    "active_jobs",
    "check_new_run_name",
    "connect",
    "ensure_run",
    "find_source",
    "get_run_id",
    "in_transaction",
    "record_failure",
    "release_memory",
    "replace_run_data",
    "retry_conflicts",
    "same_calls_trace",
    "same_rank_trace",
    "schema_sql",
    "set_run_config",
    "transaction",
    "write_result",
]
