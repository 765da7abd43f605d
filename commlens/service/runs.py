"""Runs: create, list, read, rename and update, delete; a run's sources and its predictor input.

Results are plain dicts whose keys are the API's field names (`RunSummary`, `RunDetail`, `SourceOut`),
so every adapter shows the same thing.

A run created through the API is owned by its creator's user id; only the owner or an admin renames it
(runs without an owner: admins, which the tokenless local user is). A rename keeps the old name as an
alias (`run_aliases`) that the API resolves, so shared links keep working; no run may take a name that
is another run's alias, and deleting a run deletes its aliases.
"""

from __future__ import annotations

import json
import re
from typing import Any

import duckdb
from pydantic import ValidationError

from commlens import store
from commlens.backend.compare import DESCRIPTION_KEY, world_conflict
from commlens.backend.iterations import run_id_of
from commlens.backend.predict import config_kind as kind_of_config
from commlens.backend.predict import predict_input_from_config
from commlens.contract.predict import PredictInput
from commlens.contract.runs import TAG_PATTERN
from commlens.run_json import RunConfig
from commlens.store import RUN_TABLES, aggregates, transaction
from commlens.store.aggregates import rank_key_sql
from commlens.store.transaction import NAME_RACES

from .errors import ConflictError, ForbiddenError, InvalidError
from .jobs import check_idle
from .users import Actor
from .write_order import RUN_ROWS

_TAG = re.compile(TAG_PATTERN)
WRITE_ATTEMPTS = 5


# ------------------------------------------------------------------------------------- config


def _first_error(exc: ValidationError) -> str:
    e = exc.errors()[0]
    loc = ".".join(str(x) for x in e.get("loc", ()))
    return f"{loc}: {e.get('msg')}" if loc else str(e.get("msg"))


def validate_config(config: dict[str, Any]) -> tuple[str, dict[str, Any], str | None, int | None]:
    """(kind, config to store, strategy, world_size) of a run config, or InvalidError saying why not."""
    if kind_of_config(config) == "run_config":
        try:
            rc = RunConfig.model_validate(config)
        except ValidationError as exc:
            raise InvalidError(
                f"config looks like a harness run.json but is not valid: {_first_error(exc)} "
                f"({exc.error_count()} error(s))",
                "invalid-config",
            ) from None
        return "run_config", rc.model_dump(mode="json", by_alias=True), rc.strategy, rc.world_size
    try:
        pi = PredictInput.model_validate(config)
    except ValidationError as exc:
        raise InvalidError(
            'config is neither a harness run.json (needs "schema": "commlens.run/1") nor a '
            f"predictor input: {_first_error(exc)} ({exc.error_count()} error(s))",
            "invalid-config",
        ) from None
    return "predict_input", pi.model_dump(mode="json"), None, pi.parallel.world_size


def config_kind(config: dict[str, Any] | None) -> str | None:
    """run_config, predict_input, model_description (attached by `commlens config`), other, or None without a
    config."""
    if config is None:
        return None
    if DESCRIPTION_KEY in config:
        return "model_description"
    if kind_of_config(config) == "run_config":
        return "run_config"
    try:
        PredictInput.model_validate(config)
        return "predict_input"
    except ValidationError:
        return "other"


def stored_config(con: duckdb.DuckDBPyConnection, run: str) -> dict[str, Any] | None:
    """The run's stored config (a harness run.json, a predictor input, or what a user attached)."""
    run_id = run_id_of(con, run)
    raw = con.execute("SELECT config FROM runs WHERE run_id = ?", [run_id]).fetchall()[0][0]
    config = _load_json(raw)
    return config if isinstance(config, dict) else None


def predict_input_for_run(con: duckdb.DuckDBPyConnection, run: str) -> PredictInput | None:
    """The predictor input of the run's config; None when it has none the predictor reads, InvalidError when
    its config claims to be one but cannot be used."""
    config = stored_config(con, run)
    if config_kind(config) not in ("run_config", "predict_input"):
        return None
    assert config is not None
    try:
        return predict_input_from_config(config)
    except ValueError as exc:
        raise InvalidError(
            f"the run's stored config cannot be used for a prediction: {exc}", "invalid-config"
        ) from None


def check_tags(tags: list[str]) -> list[str]:
    bad = [t for t in tags if not _TAG.fullmatch(t)]
    if bad:
        raise InvalidError(
            "tags must be 1-64 letters, digits or . _ : + @ = / -, starting with a letter or digit; "
            "refused: " + ", ".join(repr(t if len(t) <= 70 else t[:64] + "...") for t in bad[:5]),
            "invalid-tag",
        )
    return sorted(set(tags))


# -------------------------------------------------------------------------------------- reads

_SUMMARY_SQL = """
SELECT r.run_id, r.name, r.description, r.tags, r.strategy, r.world_size, r.config, r.created_at, r.updated_at,
       coalesce(s.total, 0), coalesce(s.ok, 0), coalesce(s.failed, 0), coalesce(s.events, 0), coalesce(j.active, 0),
       o.name
FROM runs r
LEFT JOIN users o ON o.user_id = r.owner_id
LEFT JOIN (SELECT run_id, count(*) AS total, count(*) FILTER (WHERE status = 'ok') AS ok,
                  count(*) FILTER (WHERE status = 'failed') AS failed,
                  sum(n_events) FILTER (WHERE status = 'ok') AS events
           FROM sources GROUP BY run_id) s USING (run_id)
LEFT JOIN (SELECT run_id, count(*) AS active FROM jobs WHERE state IN ('queued', 'running') GROUP BY run_id) j
       USING (run_id)
"""


def _load_json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _summaries(con: duckdb.DuckDBPyConnection, where: str, params: list[Any], tail: str = "") -> list[dict[str, Any]]:
    rows = con.execute(f"{_SUMMARY_SQL} {where} {tail}", params).fetchall()
    ids = [r[0] for r in rows]
    kinds: dict[int, dict[str, int]] = {i: {} for i in ids}
    if ids:
        for run_id, kind, n in con.execute(
            "SELECT run_id, kind, count(*) FROM sources WHERE list_contains(?, run_id) GROUP BY ALL ORDER BY ALL", [ids]
        ).fetchall():
            kinds[run_id][kind] = n
    out = []
    for r in rows:
        config = _load_json(r[6])
        out.append(
            {
                "run_id": r[0],
                "name": r[1],
                "description": r[2],
                "tags": list(r[3] or []),
                "strategy": r[4],
                "world_size": r[5],
                "config": config,
                "config_kind": config_kind(config if isinstance(config, dict) else None),
                "created_at": r[7],
                "updated_at": r[8],
                "sources": {"total": r[9], "ok": r[10], "failed": r[11], "by_kind": kinds[r[0]]},
                "events": int(r[12]),
                "jobs_active": r[13],
                "owner": r[14],
            }
        )
    return out


def list_runs(
    con: duckdb.DuckDBPyConnection,
    limit: int,
    offset: int,
    q: str | None = None,
    tag: str | None = None,
    strategy: str | None = None,
) -> tuple[list[dict[str, Any]], int]:
    """A page of run summaries (newest first) matching a substring, a tag and a strategy; and how many match."""
    conditions: list[str] = []
    params: list[Any] = []
    if q:
        pattern = "%" + q.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        conditions.append(
            "(r.name ILIKE ? ESCAPE '\\' OR coalesce(r.description, '') ILIKE ? ESCAPE '\\' "
            "OR array_to_string(r.tags, ' ') ILIKE ? ESCAPE '\\')"
        )
        params += [pattern, pattern, pattern]
    if tag:
        conditions.append("list_contains(r.tags, ?)")
        params.append(tag)
    if strategy:
        conditions.append("r.strategy = ?")
        params.append(strategy)
    where = ("WHERE " + " AND ".join(conditions)) if conditions else ""
    total = int(con.execute(f"SELECT count(*) FROM runs r {where}", params).fetchall()[0][0])
    items = _summaries(con, where, [*params, limit, offset], "ORDER BY r.created_at DESC, r.name LIMIT ? OFFSET ?")
    return items, total


def run_names(con: duckdb.DuckDBPyConnection) -> list[str]:
    return [str(r[0]) for r in con.execute("SELECT name FROM runs ORDER BY name").fetchall()]


def count_runs(con: duckdb.DuckDBPyConnection) -> int:
    return int(con.execute("SELECT count(*) FROM runs").fetchall()[0][0])


def run_detail(con: duckdb.DuckDBPyConnection, name: str) -> dict[str, Any]:
    """The run's summary with its calls per op and its number of ranks."""
    run_id_of(con, name)  # UnknownRunError
    row = _summaries(con, "WHERE r.name = ?", [name])[0]
    run_id = row["run_id"]
    aggregates.ensure_fresh(con, run_id)
    # The run's aggregates when they are up to date; the calls themselves while an ingest job writes.
    fresh = aggregates.is_fresh(con, run_id)
    table, count, where = ("comm_agg", "sum(calls)", "") if fresh else ("comm_events", "count(*)", " AND counted")
    ops = {
        op: int(n)
        for op, n in con.execute(
            f"SELECT op, {count} FROM {table} WHERE run_id = ?{where} GROUP BY op ORDER BY op", [run_id]
        ).fetchall()
    }
    key = "rank_key" if fresh else rank_key_sql(table)
    ranks, processes = con.execute(
        f"SELECT count(DISTINCT rank), count(DISTINCT {key}) FILTER (WHERE rank IS NULL) FROM {table} "
        f"WHERE run_id = ?{where}",
        [run_id],
    ).fetchall()[0]
    aliases = [
        a[0]
        for a in con.execute(
            "SELECT alias FROM run_aliases WHERE run_id = ? ORDER BY created_at, alias", [run_id]
        ).fetchall()
    ]
    return {**row, "ranks": ranks, "n_processes": processes, "ops": ops, "aliases": aliases}


def resolve_alias(con: duckdb.DuckDBPyConnection, name: str) -> str | None:
    """The current name of the run formerly called `name`; None when a run has that name or none had it.
    Called on every request addressing a run, so the common case (no alias) is one index lookup."""
    aliased = con.execute("SELECT run_id FROM run_aliases WHERE alias = ?", [name]).fetchall()
    if not aliased or con.execute("SELECT 1 FROM runs WHERE name = ?", [name]).fetchall():
        return None
    current = con.execute("SELECT name FROM runs WHERE run_id = ?", [aliased[0][0]]).fetchall()
    return str(current[0][0]) if current else None  # None: deleted meanwhile


def _check_not_alias(c: duckdb.DuckDBPyConnection, name: str, run_id: int | None = None) -> None:
    """ConflictError when `name` is a former name of another run (its links lead there)."""
    rows = c.execute(
        "SELECT r.name FROM run_aliases a JOIN runs r USING (run_id) WHERE a.alias = ? AND a.run_id IS DISTINCT FROM ?",
        [name, run_id],
    ).fetchall()
    if rows:
        raise ConflictError(
            f"{name!r} is a former name of run {rows[0][0]!r} and links holding it lead there; pick another name",
            "run-name-is-alias",
        )


def list_sources(
    con: duckdb.DuckDBPyConnection, run: str, limit: int, offset: int, status: str | None = None
) -> tuple[list[dict[str, Any]], int]:
    """A page of the run's ingested files with their status and errors, and how many match."""
    run_id = run_id_of(con, run)
    where = "WHERE run_id = ?"
    params: list[Any] = [run_id]
    if status:
        where += " AND status = ?"
        params.append(status)
    total = int(con.execute(f"SELECT count(*) FROM sources {where}", params).fetchall()[0][0])
    rows = con.execute(
        f"""SELECT source_id, path, kind, status, error, rank, world_size, n_events, size_bytes, sha256, skipped,
                   warnings, ingested_at FROM sources {where} ORDER BY source_id LIMIT ? OFFSET ?""",
        [*params, limit, offset],
    ).fetchall()
    items = [
        {
            "source_id": r[0],
            "path": r[1],
            "kind": r[2],
            "status": r[3],
            "error": r[4],
            "rank": r[5],
            "world_size": r[6],
            "n_events": r[7],
            "size_bytes": r[8],
            "sha256": r[9],
            "skipped": _load_json(r[10]),
            "warnings": _load_json(r[11]),
            "ingested_at": r[12],
        }
        for r in rows
    ]
    return items, total


def run_layout(con: duckdb.DuckDBPyConnection, run: str) -> tuple[str | None, int | None]:
    """The run's (strategy, world_size)."""
    run_id = run_id_of(con, run)
    row = con.execute("SELECT strategy, world_size FROM runs WHERE run_id = ?", [run_id]).fetchall()[0]
    return row[0], row[1]


# ------------------------------------------------------------------------------------- writes


def create_run(
    con: duckdb.DuckDBPyConnection,
    name: str,
    description: str | None = None,
    tags: list[str] | None = None,
    config: dict[str, Any] | None = None,
    strategy: str | None = None,
    world_size: int | None = None,
    owner: Actor | None = None,
) -> None:
    """A new empty run owned by `owner` (when a user of the store); ConflictError when the name is taken or is
    another run's former name. A config fills strategy and world size not given."""
    checked = check_tags(tags or [])
    _check_name(name)
    stored = None
    if config is not None:
        _, stored, cfg_strategy, cfg_world = validate_config(config)
        strategy = strategy or cfg_strategy
        world_size = world_size or cfg_world

    def insert(c: duckdb.DuckDBPyConnection) -> None:
        if c.execute("SELECT 1 FROM runs WHERE name = ?", [name]).fetchall():
            raise ConflictError(f"a run named {name!r} exists already; PATCH it or pick another name", "run-exists")
        _check_not_alias(c, name)
        c.execute(
            "INSERT INTO runs (name, description, tags, config, strategy, world_size, owner_id) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            [
                name,
                description,
                checked,
                json.dumps(stored) if stored is not None else None,
                strategy,
                world_size,
                owner.user_id if owner else None,
            ],
        )

    transaction(con, insert, WRITE_ATTEMPTS, retry_on=NAME_RACES)


def _check_name(name: str) -> None:
    """InvalidError for a name no run may take (the store's rule; the API's pattern refuses them first)."""
    try:
        store.check_new_run_name(name)
    except store.StoreError as exc:
        raise InvalidError(str(exc), "invalid-request") from None


def update_run(
    con: duckdb.DuckDBPyConnection,
    run: str,
    changes: dict[str, Any],
    actor: Actor | None = None,
    config_from: str = "the config",
) -> str:
    """Apply the given fields (name, description, tags, strategy, world_size, config) and return the run's
    name now. Renaming needs the run idle (queued uploads find their run by name) and, when an `actor` is
    given (None: the store's own operator, the CLI), the run's owner or an admin; the old name becomes an
    alias. A config fills strategy and world size unless they are among the changes, and must be of the job the
    run's files come from (`config_from` names it in the refusal). The caller keeps new jobs off the run
    meanwhile."""
    if "name" in changes and changes["name"] is None:
        raise InvalidError("name cannot be null", "invalid-request")
    if "name" in changes:
        _check_name(changes["name"])
    sets: list[str] = []
    params: list[Any] = []
    if "tags" in changes:
        sets.append("tags = ?")
        params.append(check_tags(changes["tags"] or []))
    for col in ("name", "description", "strategy", "world_size"):
        if col in changes:
            sets.append(f"{col} = ?")
            params.append(changes[col])
    config_world = _config_changes(changes, sets, params) if "config" in changes else None
    new_name: str = changes.get("name", run)

    def update(c: duckdb.DuckDBPyConnection) -> None:
        run_id = run_id_of(c, run)
        if config_world:
            check_config_world(c, run_id, config_world, config_from)
        if new_name != run:
            if actor is not None:
                _check_may_rename(c, run, run_id, actor)
            if c.execute("SELECT 1 FROM runs WHERE name = ?", [new_name]).fetchall():
                raise ConflictError(f"a run named {new_name!r} exists already", "run-exists")
            _check_not_alias(c, new_name, run_id)
            check_idle(c, run, run_id, "rename")
            c.execute("DELETE FROM run_aliases WHERE alias = ?", [new_name])  # its own former name, taken back
            c.execute("INSERT INTO run_aliases (alias, run_id) VALUES (?, ?)", [run, run_id])
        if sets:
            c.execute(
                f"UPDATE runs SET {', '.join(sets)}, updated_at = current_timestamp WHERE run_id = ?", [*params, run_id]
            )

    with RUN_ROWS:  # an alias inserted while the run is deleted would outlive it
        transaction(con, update, WRITE_ATTEMPTS, retry_on=NAME_RACES)
    return new_name


def _config_changes(changes: dict[str, Any], sets: list[str], params: list[Any]) -> int | None:
    """Add the config's column (and the strategy and world size it fills) to an UPDATE; its world size."""
    stored, world = None, None
    if changes["config"] is not None:
        _, stored, strategy, world = validate_config(changes["config"])
        if "strategy" not in changes and strategy:
            sets.append("strategy = ?")
            params.append(strategy)
        if "world_size" not in changes and world:
            sets.append("world_size = ?")
            params.append(world)
    sets.append("config = ?")
    params.append(json.dumps(stored) if stored is not None else None)
    return world


def check_config_world(c: duckdb.DuckDBPyConnection, run_id: int, world: int, what: str) -> None:
    """ConflictError when a configuration of `world` ranks cannot be the job the run's stored files come from
    (backend.compare.world_conflict says when)."""
    said = world_conflict(c, run_id, world)
    if said is None:
        return
    raise ConflictError(
        f"{what} describes a job of {world} rank{'s' if world != 1 else ''}, but {said}: a configuration must "
        "describe the job the run's files come from (a model description takes --dp, or options.dp through the API)",
        "config-world-mismatch",
    )


def _check_may_rename(c: duckdb.DuckDBPyConnection, run: str, run_id: int, actor: Actor) -> None:
    """ForbiddenError unless the actor owns the run or is an admin."""
    if actor.is_admin:
        return
    owner = c.execute(
        "SELECT r.owner_id, u.name FROM runs r LEFT JOIN users u ON u.user_id = r.owner_id WHERE r.run_id = ?",
        [run_id],
    ).fetchall()[0]
    if owner[0] is not None and owner[0] == actor.user_id:
        return
    who_may = f"its owner {owner[1]!r} or an admin" if owner[1] else "an admin (it has no owner)"
    raise ForbiddenError(f"only {who_may} may rename run {run!r}: its name is in the links people share", "forbidden")


def rename_run(con: duckdb.DuckDBPyConnection, run: str, new_name: str, actor: Actor | None = None) -> None:
    update_run(con, run, {"name": new_name}, actor)


def delete_run(con: duckdb.DuckDBPyConnection, run: str) -> None:
    """Delete the run and every row of it (review items and jobs included); ConflictError while jobs ingest into it.
    The caller keeps new jobs off the run meanwhile."""

    def delete(c: duckdb.DuckDBPyConnection) -> None:
        run_id = run_id_of(c, run)
        check_idle(c, run, run_id, "delete")
        for table in RUN_TABLES:  # fixed names, not user input
            c.execute(f"DELETE FROM {table} WHERE run_id = ?", [run_id])
        c.execute("DELETE FROM runs WHERE run_id = ?", [run_id])

    with RUN_ROWS:  # no review item or alias is committed for the run while it is deleted
        transaction(con, delete, WRITE_ATTEMPTS)


def comms_totals(con: duckdb.DuckDBPyConnection, run: str) -> tuple[dict[str, int], dict[str, tuple[int, int]], int]:
    """Calls per op of the run's `comms` rows, their bytes (sum of S over the calls of known size, and how many
    calls have no known size), and its number of known ranks."""
    rows = con.execute(
        "SELECT op, count(*), coalesce(sum(msg_bytes), 0), count(*) - count(msg_bytes) FROM comms WHERE run = ? "
        "GROUP BY op ORDER BY op",
        [run],
    ).fetchall()
    ranks = con.execute("SELECT count(DISTINCT rank) FROM comms WHERE run = ? AND rank IS NOT NULL", [run]).fetchall()
    return {r[0]: int(r[1]) for r in rows}, {r[0]: (int(r[2]), int(r[3])) for r in rows}, int(ranks[0][0])


def unranked_processes(con: duckdb.DuckDBPyConnection, run: str) -> dict[str, int]:
    """Per file of the run with calls that name no global rank, the number of processes that made them (a
    profiler trace is one; an NCCL log of several processes without INIT lines, more)."""
    rows = con.execute(
        """
        SELECT s.path, count(DISTINCT coalesce(e.process, '')) FROM comm_events e
        JOIN runs r ON r.run_id = e.run_id JOIN sources s ON s.source_id = e.source_id
        WHERE r.name = ? AND e.rank IS NULL AND e.counted
        GROUP BY s.path ORDER BY s.path
        """,
        [run],
    ).fetchall()
    return {str(path): int(n) for path, n in rows}
