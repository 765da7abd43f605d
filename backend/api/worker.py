"""Upload jobs: spooled files are ingested in order by one background thread.

Each file goes through ingest.pipeline.ingest_file (one transaction per file: all rows or none). The
job row is updated after every uploaded file; live byte progress of the current file is kept in
memory. Jobs left queued or running by a stopped or killed server are marked failed at start-up.
"""

from __future__ import annotations

import json
import logging
import queue
import shutil
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import duckdb

from commlens.ingest import pipeline, store
from commlens.ingest.inputs import InputFile, TapReader, iter_inputs
from commlens.ingest.records import RankHint

from .db import Database
from .settings import Settings

log = logging.getLogger("commlens.api.worker")

MANIFEST = "manifest.json"
CONFLICT_RETRIES = 3


@dataclass
class Live:
    bytes_done: int = 0
    current: str | None = None


@dataclass
class SpooledUpload:
    name: str  # display name (sanitised client file name)
    path: str  # spooled file, relative to the job's spool folder
    size: int


@dataclass
class Manifest:
    run: str
    rank: int | None
    files: list[SpooledUpload] = field(default_factory=list)

    def dump(self, folder: Path) -> None:
        data = {"run": self.run, "rank": self.rank, "files": [f.__dict__ for f in self.files]}
        (folder / MANIFEST).write_text(json.dumps(data))

    @classmethod
    def load(cls, folder: Path) -> "Manifest":
        data = json.loads((folder / MANIFEST).read_text())
        return cls(data["run"], data["rank"], [SpooledUpload(**f) for f in data["files"]])


def _progress(live: Live, base: int) -> Callable[[bytes], None]:
    """Counts bytes read from an uploaded file into the job's live progress."""
    done = [0]

    def on_data(data: bytes) -> None:
        done[0] += len(data)
        live.bytes_done = base + done[0]

    return on_data


def new_job_id() -> str:
    return uuid.uuid4().hex


class IngestWorker:
    def __init__(self, db: Database, settings: Settings):
        self.db = db
        self.settings = settings
        self.spool = settings.spool
        self.run_lock = threading.Lock()  # held while a job is created or a run deleted
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._live: dict[str, Live] = {}
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # --------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self.spool.mkdir(parents=True, exist_ok=True)
        self.recover()
        self._thread = threading.Thread(target=self._loop, name="commlens-ingest", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> bool:
        """Ask the worker to stop after the current file; True when it did within the timeout."""
        self._stopping.set()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def recover(self) -> None:
        """Jobs a previous server left unfinished are failed (their rows stay: each file was all-or-none)."""
        with self.db.session() as cur:
            stale = cur.execute("SELECT job_id, state FROM jobs WHERE state IN ('queued', 'running')").fetchall()
            for job_id, state in stale:
                reason = ("the server stopped while this job was running; files listed in results were stored, the "
                          "others were not: upload them again" if state == "running" else
                          "the server stopped before this job started; nothing of it was stored: upload again")
                cur.execute("UPDATE jobs SET state = 'failed', error = ?, updated_at = current_timestamp WHERE job_id = ?",
                            [reason, job_id])
                log.warning("job %s marked failed at start-up (%s)", job_id, state)
        if self.spool.is_dir():
            for folder in self.spool.iterdir():
                shutil.rmtree(folder, ignore_errors=True)
        # Runs ingested with the CLI while no server held the store may not be attributed yet.
        with self.db.session() as cur:
            pending = [r[0] for r in cur.execute(
                "SELECT DISTINCT r.name FROM runs r JOIN process_groups g USING (run_id) WHERE g.scheme IS NULL"
            ).fetchall()]
            for run in pending:
                if error := self._attribute(cur, run):
                    log.warning("%s: %s", run, error)

    def submit(self, job_id: str) -> None:
        self._live[job_id] = Live()
        self._queue.put(job_id)

    def live(self, job_id: str) -> Live | None:
        return self._live.get(job_id)

    def pending(self) -> int:
        return self._queue.qsize()

    # ------------------------------------------------------------------------------- work

    def _loop(self) -> None:
        while True:
            job_id = self._queue.get()
            if job_id is None or self._stopping.is_set():
                return
            try:
                self._run(job_id)
            except Exception as exc:  # noqa: BLE001 - the worker must survive any job
                log.exception("job %s failed", job_id)
                self._finish(job_id, "failed", f"internal error: {type(exc).__name__}: {exc}")
            finally:
                self._live.pop(job_id, None)
                shutil.rmtree(self.spool / job_id, ignore_errors=True)

    def _finish(self, job_id: str, state: str, error: str | None) -> None:
        with self.db.session() as cur:
            cur.execute("UPDATE jobs SET state = ?, error = coalesce(?, error), updated_at = current_timestamp "
                        "WHERE job_id = ?", [state, error, job_id])

    def _run(self, job_id: str) -> None:
        folder = self.spool / job_id
        manifest = Manifest.load(folder)
        live = self._live.setdefault(job_id, Live())
        with self.db.session() as cur:
            run_id = store.get_run_id(cur, manifest.run)
            if run_id is None:
                self._finish(job_id, "failed", f"run {manifest.run!r} no longer exists")
                return
            cur.execute("UPDATE jobs SET state = 'running', updated_at = current_timestamp WHERE job_id = ?", [job_id])
            results: list[dict[str, Any]] = []
            files_done = bytes_done = 0
            hint = RankHint(rank=manifest.rank)
            for upload in manifest.files:
                if self._stopping.is_set():
                    self._finish(job_id, "failed", "the server was stopped during this job; upload the files "
                                 "without a result again")
                    return
                path = folder / upload.path
                for item in iter_inputs([path], self.settings.ingest_limits):
                    item.name = upload.name + item.name[len(str(path)):]
                    live.current = item.name
                    if item.name == upload.name and item.error is None:
                        opener = item.open_raw
                        item.open_raw = lambda o=opener, b=bytes_done: TapReader(o(), _progress(live, b))  # type: ignore[misc]
                    outcome = self._ingest_one(cur, run_id, item, hint)
                    results.append(_result(upload.name, outcome))
                files_done += 1
                bytes_done += upload.size
                live.bytes_done = bytes_done
                cur.execute(
                    "UPDATE jobs SET files_done = ?, bytes_done = ?, results = ?, updated_at = current_timestamp "
                    "WHERE job_id = ?", [files_done, bytes_done, json.dumps(results), job_id])
            live.current = None
            pipeline.finalize_run(cur, run_id)
            note = self._attribute(cur, manifest.run)
        self._finish(job_id, "done", note)

    def _ingest_one(self, cur: duckdb.DuckDBPyConnection, run_id: int, item: InputFile,
                    hint: RankHint) -> pipeline.FileOutcome:
        for attempt in range(CONFLICT_RETRIES):
            try:
                return pipeline.ingest_file(cur, run_id, item, hint, self.settings.ingest_limits)
            except duckdb.TransactionException:
                if attempt == CONFLICT_RETRIES - 1:
                    error = f"{item.name}: could not be written: concurrent changes conflicted {CONFLICT_RETRIES} times"
                    break
            except Exception as exc:  # noqa: BLE001 - a parser bug must not stop the job
                log.exception("ingesting %s", item.name)
                error = f"{item.name}: internal error while ingesting ({type(exc).__name__}: {exc})"
                break
        store.record_failure(cur, run_id, item.name, "unknown", "", item.size, error)
        return pipeline.FileOutcome(item.name, "failed", error=error, size=item.size)

    @staticmethod
    def _attribute(cur: duckdb.DuckDBPyConnection, run: str) -> str | None:
        """Scheme attribution after new files; a failure here leaves the files stored and says so."""
        from commlens.backend.attribution import attribute_run

        try:
            attribute_run(cur, run)
        except Exception as exc:  # noqa: BLE001
            log.exception("attribution of %s", run)
            return f"files stored, but scheme attribution failed: {type(exc).__name__}: {exc}"
        return None


def _result(upload: str, o: pipeline.FileOutcome) -> dict[str, Any]:
    return {"upload": upload, "path": o.path, "status": o.status, "kind": o.kind, "rank": o.rank, "events": o.events,
            "size": o.size, "error": o.error, "skipped": o.skipped, "warnings": o.warnings}
