"""The store's tables grouped by what deleting or replacing a run must touch: the one list of a run's tables."""

from __future__ import annotations

# Rows parsed from a run's files (each has run_id and source_id).
TRACE_TABLES = ("comm_events", "steps", "nccl_comms", "nccl_topology", "nccl_tuning")

# Every table holding a run's aggregates (each has run_id), in refresh order (aggregates.py).
AGG_TABLES = (
    "agg_sources",
    "comm_periods",
    "process_iterations",
    "comm_iterations",
    "comm_agg",
    "agg_iterations",
    "bw_excluded",
    "bw_bins",
    "bw_ops",
    "bw_schemes",
    "agg_runs",
)

# Every table with rows of a run besides `runs` itself: deleting a run deletes its rows in all of them.
RUN_TABLES = (*TRACE_TABLES, "process_groups", "review_items", "sources", "jobs", *AGG_TABLES)
