"""The API's background ingest jobs: one row per upload, updated after every file it ingests.

The `results` JSON column holds {"files": [per-file results], "jobs": [runs the files went to]} (a bare
list of file results in rows written before uploads were split by job, read the same)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

import duckdb

from commlens.store import active_jobs, get_run_id
from commlens.store.jobs import ACTIVE_STATES

from .errors import ConflictError, NotFoundError

JobState = Literal["queued", "running", "done", "failed"]


@dataclass
class Job:
    job_id: str
    run: str | None  # None once the run is gone
    state: JobState
    files_total: int
    files_done: int
    bytes_total: int
    bytes_done: int
    error: str | None
    created_at: datetime
    updated_at: datetime
    results: list[dict[str, Any]] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)  # with files of several jobs: what went where

    def touched_runs(self) -> list[str]:
        """Every run the job's files went to: its own and those a split sent files to."""
        names = [self.run, *(r.get("run") for r in self.results), *(r.get("run") for r in self.runs)]
        return sorted({n for n in names if isinstance(n, str)})


_SELECT = """SELECT j.job_id, r.name, j.state, j.files_total, j.files_done, j.bytes_total, j.bytes_done, j.error,
                    j.created_at, j.updated_at, j.results
             FROM jobs j LEFT JOIN runs r USING (run_id)"""


def _job(row: tuple[Any, ...]) -> Job:
    stored = json.loads(row[10]) if isinstance(row[10], str) else (row[10] or [])
    results, runs = (stored, []) if isinstance(stored, list) else (stored.get("files", []), stored.get("jobs", []))
    return Job(
        job_id=row[0],
        run=row[1],
        state=row[2],
        files_total=row[3],
        files_done=row[4],
        bytes_total=row[5],
        bytes_done=row[6],
        error=row[7],
        created_at=row[8],
        updated_at=row[9],
        results=results,
        runs=runs,
    )


def create_job(con: duckdb.DuckDBPyConnection, job_id: str, run: str, files: int, size: int) -> Job:
    """A queued job for the run's uploaded files (the caller holds the lock that keeps the run alive)."""
    run_id = get_run_id(con, run)
    if run_id is None:
        raise NotFoundError(
            f"run {run!r} was deleted or renamed during the upload; nothing of it was queued", "unknown-run"
        )
    con.execute(
        "INSERT INTO jobs (job_id, run_id, state, files_total, bytes_total, results) "
        "VALUES (?, ?, 'queued', ?, ?, '[]')",
        [job_id, run_id, files, size],
    )
    return get_job(con, job_id)


def _current_names(con: duckdb.DuckDBPyConnection, jobs: list[Job]) -> list[Job]:
    """The jobs with the runs their results and split rows name under those runs' current names: a run
    renamed since keeps working through its former name, but a former name is freed when its run is deleted."""
    named = {r["run"] for j in jobs for r in (*j.results, *j.runs) if isinstance(r.get("run"), str)}
    if not named:
        return jobs
    now = dict(
        con.execute(
            "SELECT a.alias, r.name FROM run_aliases a JOIN runs r USING (run_id) WHERE list_contains(?, a.alias)",
            [sorted(named)],
        ).fetchall()
    )
    if not now:
        return jobs

    def rows(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [r | {"run": now[r["run"]]} if r.get("run") in now else r for r in items]

    for j in jobs:
        j.results, j.runs = rows(j.results), rows(j.runs)
    return jobs


def get_job(con: duckdb.DuckDBPyConnection, job_id: str) -> Job:
    rows = con.execute(f"{_SELECT} WHERE j.job_id = ?", [job_id]).fetchall()
    if not rows:
        raise NotFoundError(f"no job {job_id!r}; jobs are listed at GET /api/jobs", "unknown-job")
    return _current_names(con, [_job(rows[0])])[0]


def list_jobs(
    con: duckdb.DuckDBPyConnection, limit: int, offset: int, run: str | None = None, state: str | None = None
) -> tuple[list[Job], int]:
    """A page of jobs, newest first, and how many match."""
    conditions: list[str] = []
    params: list[Any] = []
    if run is not None:  # by its name or a former one, as every path addressing a run
        conditions.append("(r.name = ? OR j.run_id = (SELECT run_id FROM run_aliases WHERE alias = ?))")
        params += [run, run]
    if state is not None:
        conditions.append("j.state = ?")
        params.append(state)
    where = ("WHERE " + " AND ".join(conditions)) if conditions else ""
    total = con.execute(f"SELECT count(*) FROM jobs j LEFT JOIN runs r USING (run_id) {where}", params).fetchall()[0][0]
    rows = con.execute(
        f"{_SELECT} {where} ORDER BY j.created_at DESC, j.job_id LIMIT ? OFFSET ?", [*params, limit, offset]
    ).fetchall()
    return _current_names(con, [_job(r) for r in rows]), int(total)


def job_counts(con: duckdb.DuckDBPyConnection) -> dict[str, int]:
    """Jobs queued and running now."""
    rows = con.execute(
        "SELECT state, count(*) FROM jobs WHERE state IN ('queued', 'running') GROUP BY state"
    ).fetchall()
    return {"queued": 0, "running": 0} | {str(r[0]): int(r[1]) for r in rows}


def start_job(con: duckdb.DuckDBPyConnection, job_id: str) -> None:
    con.execute("UPDATE jobs SET state = 'running', updated_at = current_timestamp WHERE job_id = ?", [job_id])


def record_progress(
    con: duckdb.DuckDBPyConnection,
    job_id: str,
    files_done: int,
    bytes_done: int,
    results: list[dict[str, Any]],
    runs: list[dict[str, Any]] | None = None,
) -> None:
    """The uploads done so far (each ingested whole), their files' results and, once split, the runs."""
    con.execute(
        "UPDATE jobs SET files_done = ?, bytes_done = ?, results = ?, updated_at = current_timestamp WHERE job_id = ?",
        [files_done, bytes_done, json.dumps({"files": results, "jobs": runs or []}), job_id],
    )


def finish_job(con: duckdb.DuckDBPyConnection, job_id: str, state: str, error: str | None) -> None:
    """Mark the job done or failed; an error given earlier is kept when none is given now."""
    con.execute(
        "UPDATE jobs SET state = ?, error = coalesce(?, error), updated_at = current_timestamp WHERE job_id = ?",
        [state, error, job_id],
    )


def fail_unfinished(con: duckdb.DuckDBPyConnection) -> list[tuple[str, str]]:
    """Settle the jobs a previous server left queued or running, saying what of them was stored (each file
    was all or none): a running job whose every upload was ingested is done, with the interruption noted
    (the caller links and analyses its run again); the others failed, their
    results listing each file's state. Their (job_id, state they were in)."""
    stale = [
        (str(r[0]), str(r[1]), int(r[2]), int(r[3]))
        for r in con.execute(
            "SELECT job_id, state, files_done, files_total FROM jobs WHERE state IN ('queued', 'running')"
        ).fetchall()
    ]
    for job_id, state, done, total in stale:
        if state == "running" and done == total:
            finish_job(con, job_id, "done", INTERRUPTED)
        elif state == "running":
            finish_job(
                con,
                job_id,
                "failed",
                f"the server stopped while this job was running, after {done} of {total} uploaded files: files "
                "listed in results were stored (each with its state), the others were not: upload them again",
            )
        else:
            finish_job(
                con,
                job_id,
                "failed",
                "the server stopped before this job started; nothing of it was stored: upload again",
            )
    return [(job_id, state) for job_id, state, _, _ in stale]


INTERRUPTED = (
    "interrupted: the server stopped after every file of this job was ingested (results say what each became); "
    "the run was linked and analysed again when the server restarted"
)


def _splitting_into(con: duckdb.DuckDBPyConnection, run: str, run_id: int) -> list[str]:
    """Ids of other runs' active jobs whose split sends files to `run` (recorded once the split is decided)."""
    rows = con.execute(
        f"{_SELECT} WHERE list_contains(?, j.state) AND j.run_id IS DISTINCT FROM ? ORDER BY j.created_at",
        [list(ACTIVE_STATES), run_id],
    ).fetchall()
    return [job.job_id for job in map(_job, rows) if run in job.touched_runs()]


def check_idle(con: duckdb.DuckDBPyConnection, run: str, run_id: int, action: str) -> None:
    """ConflictError while the run has ingest jobs queued or running (they find their run by name), its own
    or another run's whose files a split sends to it."""
    active = active_jobs(con, run_id) + _splitting_into(con, run, run_id)
    if active:
        raise ConflictError(
            f"run {run!r} has ingest jobs in progress ({', '.join(active)}); {action} it when they are "
            "done (GET /api/jobs/{job_id} shows their state)",
            "run-busy",
        )
