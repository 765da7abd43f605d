"""The store's tables grouped by what deleting or replacing a run must touch: the one list of a run's tables."""

from __future__ import annotations

# Rows parsed from a run's files (each has run_id and source_id).
TRACE_TABLES = (
    "comm_events",
    "steps",
    "timeline_intervals",
    "nccl_comms",
    "nccl_topology",
    "nccl_tuning",
    "fr_entries",  # hang.sql: Flight Recorder entries with their state
    "a2a_pairs",  # pairs.sql: bytes per (all_to_all call, receiver)
)

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

# The time analysis's results of a run (time.sql), all replaced together (backend/timing/persist.py).
TIME_TABLES = (
    "time_status",
    "time_instances",
    "time_instance_members",
    "time_mismatches",
    "time_unmatched",
    "time_clock_offsets",
    "time_breakdown",
    "time_memcpy",
    "time_rank_totals",
    "time_arrivals",
    "time_stragglers",
    "time_critical_path",
    "time_critical_segments",
    "time_critical_schemes",
)

# The timing findings' inputs of a run (time.sql), replaced together after the time tables
# (backend/findings_time.py store_timing_inputs).
TIME_FINDING_TABLES = ("time_finding_cells", "time_finding_keys", "time_finding_runs")

# Every table with rows of a run besides `runs` itself: deleting a run deletes its rows in all of them.
RUN_TABLES = (
    *TRACE_TABLES,
    "run_aliases",  # trace.sql: the run's former names
    "process_groups",
    "review_items",
    "sources",
    "jobs",
    *AGG_TABLES,
    *TIME_TABLES,
    *TIME_FINDING_TABLES,
)
