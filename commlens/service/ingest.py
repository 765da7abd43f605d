"""Ingesting a run: every adapter's one sequence (the CLI's `ingest`, the harness launcher, the API's
upload queue): the run made if missing, each file parsed and written on its own (all rows or none),
the run's sources linked and its aggregates refreshed, then its process groups attributed to schemes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import duckdb

from commlens import store
from commlens.backend.attribution import attribute_run
from commlens.ingest import pipeline
from commlens.ingest.inputs import DEFAULT_LIMITS, InputFile, Limits
from commlens.ingest.pipeline import FileOutcome, IngestSummary
from commlens.ingest.records import RankHint

log = logging.getLogger("commlens.service.ingest")

CONFLICT_RETRIES = 3


@dataclass
class IngestReport(IngestSummary):
    attribution_error: str | None = None  # the files are stored; their schemes are not


def ingest_run(
    con: duckdb.DuckDBPyConnection,
    run: str,
    inputs: Iterable[InputFile],
    hint: RankHint | None = None,
    limits: Limits = DEFAULT_LIMITS,
    on_file: Callable[[InputFile, FileOutcome], None] | None = None,
    description: str | None = None,
    replace: bool = False,
) -> IngestReport:
    """Ingest the files into the run (created if missing; `replace` first removes what earlier files of it
    stored, its review and overrides kept), link and refresh it, and attribute its groups to schemes.
    A file that fails is recorded with its error; an exception of `inputs` itself stops before the linking."""
    run_id = store.ensure_run(con, run, description=description)
    if replace:
        store.replace_run_data(con, run_id)
    report = IngestReport(run)
    for item in inputs:
        outcome = ingest_file(con, run_id, item, hint or RankHint(), limits)
        report.files.append(outcome)
        if on_file is not None:
            on_file(item, outcome)
    pipeline.finalize_run(con, run_id)
    report.attribution_error = attribute(con, run)
    return report


def ingest_file(
    con: duckdb.DuckDBPyConnection, run_id: int, item: InputFile, hint: RankHint, limits: Limits = DEFAULT_LIMITS
) -> FileOutcome:
    """One file, written again when a concurrent transaction conflicted; a parser's bug fails the file
    (recorded with its error), not the run."""
    for attempt in range(CONFLICT_RETRIES):
        try:
            return pipeline.ingest_file(con, run_id, item, hint, limits)
        except duckdb.TransactionException:
            if attempt == CONFLICT_RETRIES - 1:
                error = f"{item.name}: could not be written: concurrent changes conflicted {CONFLICT_RETRIES} times"
                break
        except Exception as exc:  # a parser bug must not stop the other files
            log.exception("ingesting %s", item.name)
            error = f"{item.name}: internal error while ingesting ({type(exc).__name__}: {exc})"
            break
    store.record_failure(con, run_id, item.name, "unknown", "", item.size, error)
    return FileOutcome(item.name, "failed", error=error, size=item.size)


def attribute(con: duckdb.DuckDBPyConnection, run: str) -> str | None:
    """Scheme attribution after new files; a failure leaves the files stored and says so."""
    try:
        attribute_run(con, run)
    except Exception as exc:  # the files are stored whatever attribution makes of them
        log.exception("attribution of %s", run)
        return f"files stored, but scheme attribution failed: {type(exc).__name__}: {exc}"
    return None


def attribute_pending(con: duckdb.DuckDBPyConnection) -> dict[str, str]:
    """Attribute the runs that have groups without a scheme (ingested while no server held the store, by
    a tool that did not attribute); the runs whose attribution failed, with why."""
    pending = [
        str(r[0])
        for r in con.execute(
            "SELECT DISTINCT r.name FROM runs r JOIN process_groups g USING (run_id) WHERE g.scheme IS NULL ORDER BY 1"
        ).fetchall()
    ]
    return {run: error for run in pending if (error := attribute(con, run)) is not None}
