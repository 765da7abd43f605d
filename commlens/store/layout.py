"""The physical row order of the time tables read by step and by rank (schema 9).

DuckDB skips a row group (122,880 rows) when its min/max of a filtered column excludes the value. Rows in
(rank, step) order make a one-step read scan every row group; (step, rank) order does the same to a one-rank
read. Blocks of STEP_BLOCK steps, rank-major inside a block, keep both reads to a few row groups: a step's
rows lie in one block, and inside each block a rank's rows are contiguous (measured on 28.6 M breakdown rows,
1,024 ranks x 13,950 steps: one step 84 -> 9 ms, one rank's first page 1.5 -> 9.5 ms).
"""

from __future__ import annotations

STEP_BLOCK = 256
# ORDER BY of the rows of time_breakdown and time_memcpy, as written by the time analysis and the 8 -> 9 upgrade.
BREAKDOWN_ORDER = f"run_id, step // {STEP_BLOCK}, rank, step, scheme NULLS FIRST"
MEMCPY_ORDER = f"run_id, step // {STEP_BLOCK}, rank, step, direction"
