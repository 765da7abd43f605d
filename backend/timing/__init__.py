"""Where the time goes: collectives matched across ranks, clock alignment, waits, the per-step breakdown,
stragglers and the critical path. Pure functions over per-rank timelines (see model.py)."""
