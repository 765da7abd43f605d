"""/api/runs: list (paginated, searchable), create, read, update, delete; the run's sources."""

from __future__ import annotations

import json
from typing import Annotated, Any

import duckdb
from fastapi import APIRouter, Query, Response
from pydantic import ValidationError

from commlens.backend.iterations import UnknownRunError, run_id_of
from commlens.contract.common import Page
from commlens.contract.predict import PredictInput
from commlens.contract.runs import TAG_PATTERN, RunCreate, RunDetail, RunSummary, RunUpdate, SourceCounts, SourceOut
from commlens.ingest import aggregates
from commlens.ingest.aggregates import AGG_TABLES
from commlens.ingest.store import TRACE_TABLES
from commlens.runconfig import RunConfig

from .db import transaction
from .deps import Admin, Ctx, Cursor, Limit, Offset, Writer, next_offset
from .errors import ApiError, problem_responses

router = APIRouter(tags=["runs"])

_TAG_RE = __import__("re").compile(TAG_PATTERN)


# ------------------------------------------------------------------------------------- config


def _first_error(exc: ValidationError) -> str:
    e = exc.errors()[0]
    loc = ".".join(str(x) for x in e.get("loc", ()))
    return f"{loc}: {e.get('msg')}" if loc else str(e.get("msg"))


def validate_config(config: dict[str, Any]) -> tuple[str, dict[str, Any], str | None, int | None]:
    """(kind, config to store, strategy, world_size) of a run config, or ApiError 422 saying why not."""
    if "schema" in config or "strategy" in config:
        try:
            rc = RunConfig.model_validate(config)
        except ValidationError as exc:
            raise ApiError(422, f"config looks like a harness run.json but is not valid: {_first_error(exc)} "
                           f"({exc.error_count()} error(s))", "invalid-config") from None
        return "run_config", rc.model_dump(mode="json", by_alias=True), rc.strategy, rc.world_size
    try:
        pi = PredictInput.model_validate(config)
    except ValidationError as exc:
        raise ApiError(422, "config is neither a harness run.json (needs \"schema\": \"commlens.run/1\") nor a "
                       f"predictor input: {_first_error(exc)} ({exc.error_count()} error(s))", "invalid-config") from None
    return "predict_input", pi.model_dump(mode="json"), None, pi.parallel.world_size


def config_kind(config: dict[str, Any] | None) -> str | None:
    if config is None:
        return None
    if str(config.get("schema", "")).startswith("commlens.run"):
        return "run_config"
    try:
        PredictInput.model_validate(config)
        return "predict_input"
    except ValidationError:
        return "other"


def _check_tags(tags: list[str]) -> list[str]:
    bad = [t for t in tags if not _TAG_RE.match(t)]
    if bad:
        raise ApiError(422, f"tags must be 1-64 letters, digits or . _ : + @ = / -, starting with a letter or digit; "
                       f"refused: {bad[:5]}", "invalid-tag")
    return sorted(set(tags))


# -------------------------------------------------------------------------------------- reads

_SUMMARY_SQL = """
SELECT r.run_id, r.name, r.description, r.tags, r.strategy, r.world_size, r.config, r.created_at, r.updated_at,
       coalesce(s.total, 0), coalesce(s.ok, 0), coalesce(s.failed, 0), coalesce(s.events, 0), coalesce(j.active, 0)
FROM runs r
LEFT JOIN (SELECT run_id, count(*) AS total, count(*) FILTER (WHERE status = 'ok') AS ok,
                  count(*) FILTER (WHERE status = 'failed') AS failed,
                  sum(n_events) FILTER (WHERE status = 'ok') AS events
           FROM sources GROUP BY run_id) s USING (run_id)
LEFT JOIN (SELECT run_id, count(*) AS active FROM jobs WHERE state IN ('queued', 'running') GROUP BY run_id) j
       USING (run_id)
"""


def _load_json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _summaries(cur: duckdb.DuckDBPyConnection, where: str, params: list[Any], tail: str = "") -> list[dict[str, Any]]:
    rows = cur.execute(f"{_SUMMARY_SQL} {where} {tail}", params).fetchall()
    ids = [r[0] for r in rows]
    kinds: dict[int, dict[str, int]] = {i: {} for i in ids}
    if ids:
        for run_id, kind, n in cur.execute(
            "SELECT run_id, kind, count(*) FROM sources WHERE list_contains(?, run_id) GROUP BY ALL ORDER BY ALL", [ids]
        ).fetchall():
            kinds[run_id][kind] = n
    out = []
    for r in rows:
        config = _load_json(r[6])
        out.append({
            "run_id": r[0], "name": r[1], "description": r[2], "tags": list(r[3] or []), "strategy": r[4],
            "world_size": r[5], "config": config, "config_kind": config_kind(config if isinstance(config, dict) else None),
            "created_at": r[7], "updated_at": r[8],
            "sources": SourceCounts(total=r[9], ok=r[10], failed=r[11], by_kind=kinds[r[0]]),
            "events": int(r[12]), "jobs_active": r[13],
        })
    return out


def run_detail(cur: duckdb.DuckDBPyConnection, name: str) -> RunDetail:
    rows = _summaries(cur, "WHERE r.name = ?", [name])
    if not rows:
        raise UnknownRunError(f"no run named {name!r} in this store")
    row = rows[0]
    run_id = row["run_id"]
    aggregates.ensure_fresh(cur, run_id)
    # The run's aggregates when they are up to date; the calls themselves while an ingest job writes.
    fresh = aggregates.is_fresh(cur, run_id)
    table, count, where = ("comm_agg", "sum(calls)", "") if fresh else ("comm_events", "count(*)", " AND counted")
    ops = {op: int(n) for op, n in cur.execute(
        f"SELECT op, {count} FROM {table} WHERE run_id = ?{where} GROUP BY op ORDER BY op", [run_id]).fetchall()}
    ranks = cur.execute(f"SELECT count(DISTINCT rank) FROM {table} WHERE run_id = ?{where}", [run_id]).fetchone()[0]
    return RunDetail(**row, ranks=ranks, ops=ops)


@router.get("/runs", response_model=Page[RunSummary], summary="List runs (newest first), searchable")
def list_runs(
    cur: Cursor,
    limit: Limit = 50,
    offset: Offset = 0,
    q: Annotated[str | None, Query(max_length=200, description="substring of name, description or a tag")] = None,
    tag: Annotated[str | None, Query(max_length=64, description="runs with exactly this tag")] = None,
    strategy: Annotated[str | None, Query(max_length=128)] = None,
) -> Page[RunSummary]:
    conditions: list[str] = []
    params: list[Any] = []
    if q:
        pattern = "%" + q.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        conditions.append("(r.name ILIKE ? ESCAPE '\\' OR coalesce(r.description, '') ILIKE ? ESCAPE '\\' "
                          "OR array_to_string(r.tags, ' ') ILIKE ? ESCAPE '\\')")
        params += [pattern, pattern, pattern]
    if tag:
        conditions.append("list_contains(r.tags, ?)")
        params.append(tag)
    if strategy:
        conditions.append("r.strategy = ?")
        params.append(strategy)
    where = ("WHERE " + " AND ".join(conditions)) if conditions else ""
    total = cur.execute(f"SELECT count(*) FROM runs r {where}", params).fetchone()[0]
    items = _summaries(cur, where, params + [limit, offset], "ORDER BY r.created_at DESC, r.name LIMIT ? OFFSET ?")
    return Page[RunSummary](items=[RunSummary(**i) for i in items], total=total, limit=limit, offset=offset,
                            next_offset=next_offset(offset, limit, total))


@router.get("/runs/{run}", response_model=RunDetail, responses=problem_responses(404))
def get_run(run: str, cur: Cursor) -> RunDetail:
    return run_detail(cur, run)


@router.get("/runs/{run}/sources", response_model=Page[SourceOut], responses=problem_responses(404),
            summary="The run's ingested files with their status and errors")
def list_sources(
    run: str, cur: Cursor, limit: Limit = 100, offset: Offset = 0,
    status: Annotated[str | None, Query(pattern="^(ok|failed)$")] = None,
) -> Page[SourceOut]:
    run_id = run_id_of(cur, run)
    where, params = "WHERE run_id = ?", [run_id]
    if status:
        where += " AND status = ?"
        params.append(status)
    total = cur.execute(f"SELECT count(*) FROM sources {where}", params).fetchone()[0]
    rows = cur.execute(
        f"""SELECT source_id, path, kind, status, error, rank, world_size, n_events, size_bytes, sha256, skipped,
                   warnings, ingested_at FROM sources {where} ORDER BY source_id LIMIT ? OFFSET ?""",
        params + [limit, offset],
    ).fetchall()
    items = [SourceOut(source_id=r[0], path=r[1], kind=r[2], status=r[3], error=r[4], rank=r[5], world_size=r[6],
                       n_events=r[7], size_bytes=r[8], sha256=r[9], skipped=_load_json(r[10]),
                       warnings=_load_json(r[11]), ingested_at=r[12]) for r in rows]
    return Page[SourceOut](items=items, total=total, limit=limit, offset=offset,
                           next_offset=next_offset(offset, limit, total))


# ------------------------------------------------------------------------------------- writes


@router.post("/runs", response_model=RunDetail, status_code=201, responses=problem_responses(401, 409, 422))
def create_run(body: RunCreate, cur: Cursor, _: Writer, response: Response) -> RunDetail:
    tags = _check_tags(body.tags)
    strategy, world_size, stored = body.strategy, body.world_size, None
    if body.config is not None:
        _, stored, cfg_strategy, cfg_world = validate_config(body.config)
        strategy = strategy or cfg_strategy
        world_size = world_size or cfg_world

    def insert(c: duckdb.DuckDBPyConnection) -> None:
        if c.execute("SELECT 1 FROM runs WHERE name = ?", [body.name]).fetchone():
            raise ApiError(409, f"a run named {body.name!r} exists already; PATCH it or pick another name", "run-exists")
        c.execute(
            "INSERT INTO runs (name, description, tags, config, strategy, world_size) VALUES (?, ?, ?, ?, ?, ?)",
            [body.name, body.description, tags, json.dumps(stored) if stored is not None else None, strategy, world_size],
        )

    transaction(cur, insert)
    response.headers["Location"] = f"/api/runs/{body.name}"
    return run_detail(cur, body.name)


@router.patch("/runs/{run}", response_model=RunDetail, responses=problem_responses(401, 404, 409, 422))
def update_run(run: str, body: RunUpdate, cur: Cursor, ctx: Ctx, _: Writer) -> RunDetail:
    fields = body.model_fields_set
    sets: list[str] = []
    params: list[Any] = []
    if "name" in fields and body.name is None:
        raise ApiError(422, "name cannot be null", "invalid-request")
    if "tags" in fields:
        sets.append("tags = ?")
        params.append(_check_tags(body.tags or []))
    for col in ("name", "description", "strategy", "world_size"):
        if col in fields:
            sets.append(f"{col} = ?")
            params.append(getattr(body, col))
    if "config" in fields:
        stored = None
        if body.config is not None:
            _, stored, cfg_strategy, cfg_world = validate_config(body.config)
            if "strategy" not in fields and cfg_strategy:
                sets.append("strategy = ?")
                params.append(cfg_strategy)
            if "world_size" not in fields and cfg_world:
                sets.append("world_size = ?")
                params.append(cfg_world)
        sets.append("config = ?")
        params.append(json.dumps(stored) if stored is not None else None)
    new_name = body.name if "name" in fields else run

    def update(c: duckdb.DuckDBPyConnection) -> None:
        run_id = run_id_of(c, run)
        if new_name != run:
            if c.execute("SELECT 1 FROM runs WHERE name = ?", [new_name]).fetchone():
                raise ApiError(409, f"a run named {new_name!r} exists already", "run-exists")
            busy(c, run, run_id, "rename")  # queued uploads find their run by name
        if sets:
            c.execute(f"UPDATE runs SET {', '.join(sets)}, updated_at = current_timestamp WHERE run_id = ?",
                      params + [run_id])

    with ctx.worker.run_lock:  # no job may be created on this run while it is renamed
        transaction(cur, update)
    return run_detail(cur, new_name)  # type: ignore[arg-type]


def busy(c: duckdb.DuckDBPyConnection, run: str, run_id: int, action: str) -> None:
    """409 while the run has ingest jobs queued or running."""
    active = c.execute("SELECT job_id FROM jobs WHERE run_id = ? AND state IN ('queued', 'running') ORDER BY created_at",
                       [run_id]).fetchall()
    if active:
        raise ApiError(409, f"run {run!r} has ingest jobs in progress ({', '.join(j[0] for j in active)}); "
                       f"{action} it when they are done (GET /api/jobs/{{job_id}} shows their state)", "run-busy")


RUN_TABLES = (*TRACE_TABLES, "process_groups", "review_items", "sources", "jobs", *AGG_TABLES)


@router.delete("/runs/{run}", status_code=204, responses=problem_responses(401, 403, 404, 409))
def delete_run(run: str, cur: Cursor, ctx: Ctx, _: Admin) -> Response:
    def delete(c: duckdb.DuckDBPyConnection) -> None:
        run_id = run_id_of(c, run)
        busy(c, run, run_id, "delete")
        for table in RUN_TABLES:  # fixed names, not user input
            c.execute(f"DELETE FROM {table} WHERE run_id = ?", [run_id])
        c.execute("DELETE FROM runs WHERE run_id = ?", [run_id])

    with ctx.worker.run_lock:  # no job may start on this run while it is deleted
        transaction(cur, delete)
    return Response(status_code=204)
