"""Synthetic stores for analysis tests: rows written through the real store writer, one source per call."""

from __future__ import annotations

import hashlib
import json

from commlens import store
from commlens.ingest.records import ParseResult


def write_rows(
    con,
    run: str,
    events: list[dict],
    groups: list[dict] = (),
    steps: list[dict] = (),
    kind: str = "kineto",
    rank: int | None = None,
    config: dict | None = None,
) -> None:
    """Store `events` (comm_events rows), `groups` and `steps` as one source of `run`; attach `config`."""
    run_id = store.ensure_run(con, run)
    result = ParseResult(kind=kind, rank=rank, events=events, groups=list(groups), steps=list(steps))
    digest = hashlib.sha256(json.dumps([run, events, list(groups), list(steps)], default=str).encode()).hexdigest()
    store.write_result(con, run_id, f"{run}-{digest[:8]}", digest, 1, result)
    if config is not None:
        store.set_run_config(con, run_id, config)
