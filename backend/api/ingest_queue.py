"""Upload jobs: spooled files are ingested by a pool of background threads.

Each job is one call of commlens.service.ingest.ingest_run (one transaction per file: all rows or
none). Files of several training jobs are split into one run per job as the CLI does (`split_jobs`: every
file is parsed first, then each job's stored in its run; the upload's run is the first), unless the upload
asked for one run (`one_run`). The job row is updated after every uploaded file is stored; live byte
progress of the current file is kept in memory. Jobs left queued or running by a stopped or killed server are settled at start-up: done
(with the interruption noted) when every uploaded file was ingested, else failed with each file's state.
The slow part of recovery (linking and analysing their runs, attributing runs the CLI stored) runs in the
background while the server already answers (`recovering`); workers start jobs once it is over.

One job never blocks the others: `Settings.ingest_workers` threads take the oldest job they may run, a
user holds at most all workers but one (the last is left for everybody else's jobs), and the jobs of one
run go one at a time (each ends by linking and analysing its whole run).
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, cast

import duckdb

from commlens.ingest.inputs import InputFile, TapReader, iter_inputs
from commlens.ingest.records import RankHint
from commlens.service import jobs
from commlens.service.ingest import FileOutcome, IngestReport, attribute_pending, complete_run, ingest_run
from commlens.service.jobs_split import job_row
from commlens.store import get_run_id

from .db import Database
from .settings import Settings

log = logging.getLogger("commlens.api.ingest_queue")

MANIFEST = "manifest.json"


class _StoppedError(Exception):
    """The server is stopping: the job ends after the file being ingested."""


@dataclass
class Live:
    bytes_done: int = 0
    current: str | None = None  # the file being ingested
    upload: str | None = None  # the uploaded file it comes from


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
    one_run: bool = False  # store every file in `run` even when they are of several jobs
    owner_id: int | None = None  # the uploading user, who owns the runs the job splits off

    def dump(self, folder: Path) -> None:
        data = {
            "run": self.run,
            "rank": self.rank,
            "files": [f.__dict__ for f in self.files],
            "one_run": self.one_run,
            "owner_id": self.owner_id,
        }
        (folder / MANIFEST).write_text(json.dumps(data))

    @classmethod
    def load(cls, folder: Path) -> Manifest:
        data = json.loads((folder / MANIFEST).read_text())
        files = [SpooledUpload(**f) for f in data["files"]]
        return cls(data["run"], data["rank"], files, bool(data.get("one_run", False)), data.get("owner_id"))


def _progress(live: Live, base: int) -> Callable[[memoryview], None]:
    """Counts bytes read from an uploaded file into the job's live progress."""
    done = [0]

    def on_data(data: memoryview) -> None:
        done[0] += len(data)
        live.bytes_done = base + done[0]

    return on_data


def _tapped(opener: Callable[[], BinaryIO], live: Live, base: int) -> Callable[[], BinaryIO]:
    """An opener whose reads count into the job's live progress."""
    return lambda: cast(BinaryIO, TapReader(opener(), _progress(live, base)))


def new_job_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Queued:
    job_id: str
    run: str
    user: str  # who uploaded it: the unit of the per-user share


class IngestQueue:
    def __init__(self, db: Database, settings: Settings):
        self.db = db
        self.settings = settings
        self.spool = settings.spool
        self.run_lock = threading.Lock()  # held while a job is created or a run deleted
        self.workers = max(1, settings.ingest_workers)
        self.per_user = max(1, self.workers - 1)
        self._ready = threading.Condition()
        self._waiting: list[Queued] = []  # oldest first
        self._running: dict[str, Queued] = {}
        self._live: dict[str, Live] = {}
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._recovered = threading.Event()

    @property
    def recovering(self) -> bool:
        """True while the runs left unfinished by a previous server are being completed."""
        return not self._recovered.is_set()

    # --------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self.spool.mkdir(parents=True, exist_ok=True)
        runs = self.settle()
        self._threads = [threading.Thread(target=self.recover, args=(runs,), name="commlens-recover", daemon=True)]
        self._threads += [
            threading.Thread(target=self._loop, name=f"commlens-ingest-{i}", daemon=True) for i in range(self.workers)
        ]
        for t in self._threads:
            t.start()

    def stop(self, timeout: float = 10.0) -> bool:
        """Ask the workers to stop after their current file; True when all did within the timeout."""
        self._stopping.set()
        with self._ready:
            self._ready.notify_all()
        for t in self._threads:
            t.join(timeout)
        return not any(t.is_alive() for t in self._threads)

    def settle(self) -> list[tuple[int, str]]:
        """Before any upload: jobs a previous server left unfinished are settled (their rows stay: each file
        was all-or-none) and its spool emptied. The (run_id, run) of jobs settled as done, to complete."""
        runs: list[tuple[int, str]] = []
        with self.db.session() as cur:
            for job_id, state in jobs.fail_unfinished(cur):
                job = jobs.get_job(cur, job_id)
                log.warning("job %s, %s when the server stopped, is %s", job_id, state, job.state)
                for run in job.touched_runs() if job.state == "done" else []:
                    run_id = get_run_id(cur, run)
                    if run_id is not None:
                        runs.append((run_id, run))
        if self.spool.is_dir():
            for folder in self.spool.iterdir():
                shutil.rmtree(folder, ignore_errors=True)
        return runs

    def recover(self, runs: list[tuple[int, str]]) -> None:
        """Complete the runs of interrupted jobs, then attribute the runs the CLI ingested while no server held
        the store; workers wait until this is over."""
        try:
            with self.db.session() as cur:
                for run_id, run in sorted(set(runs)):
                    error = complete_run(cur, run_id, run)
                    if error:
                        log.warning("%s: %s", run, error)
                for run, error in attribute_pending(cur).items():
                    log.warning("%s: %s", run, error)
        except Exception:  # the server serves what is stored even when recovery fails
            log.exception("recovery at start-up")
        finally:
            with self._ready:
                self._recovered.set()
                self._ready.notify_all()

    def submit(self, job_id: str, run: str, user: str) -> None:
        self._live[job_id] = Live()
        with self._ready:
            self._waiting.append(Queued(job_id, run, user))
            self._ready.notify()

    def live(self, job_id: str) -> Live | None:
        return self._live.get(job_id)

    def pending(self) -> int:
        with self._ready:
            return len(self._waiting)

    # ------------------------------------------------------------------------------- work

    def _next(self) -> Queued | None:
        """The oldest waiting job whose user is within its share and whose run is idle (None when stopping)."""
        with self._ready:
            while not self._stopping.is_set():
                if not self._recovered.is_set():
                    self._ready.wait()
                    continue
                users = [q.user for q in self._running.values()]
                busy = {q.run for q in self._running.values()}  # runs whose next job must wait (order kept)
                for q in self._waiting:
                    if users.count(q.user) < self.per_user and q.run not in busy:
                        self._waiting.remove(q)
                        self._running[q.job_id] = q
                        return q
                    busy.add(q.run)
                self._ready.wait()
            return None

    def _loop(self) -> None:
        while (q := self._next()) is not None:
            try:
                self._run(q.job_id)
            except Exception as exc:  # the pool must survive any job
                log.exception("job %s failed", q.job_id)
                self._finish(q.job_id, "failed", f"internal error: {type(exc).__name__}: {exc}")
            finally:
                self._live.pop(q.job_id, None)
                shutil.rmtree(self.spool / q.job_id, ignore_errors=True)
                with self._ready:
                    self._running.pop(q.job_id, None)
                    self._ready.notify_all()

    def _finish(self, job_id: str, state: str, error: str | None) -> None:
        with self.db.session() as cur:
            jobs.finish_job(cur, job_id, state, error)

    def _run(self, job_id: str) -> None:
        folder = self.spool / job_id
        manifest = Manifest.load(folder)
        live = self._live.setdefault(job_id, Live())
        progress = _Progress(manifest, split=not manifest.one_run)

        with self.db.session() as cur:
            run = jobs.get_job(cur, job_id).run
            if run is None:
                self._finish(job_id, "failed", f"run {manifest.run!r} no longer exists")
                return

            def record(item: InputFile, outcome: FileOutcome) -> None:
                if progress.add(item, _result(progress.upload_name(item), outcome, run)):
                    jobs.record_progress(
                        cur, job_id, progress.files_done, progress.bytes_done, progress.results, progress.runs
                    )

            def split(report: IngestReport) -> None:
                # stored at once, before any file: a restart keeps it, and the runs it sends files to are busy
                # (service.jobs.check_idle) until the job ends
                progress.runs = [job_row(j) for j in report.jobs] if report.split else []
                if progress.runs:
                    jobs.record_progress(
                        cur, job_id, progress.files_done, progress.bytes_done, progress.results, progress.runs
                    )

            jobs.start_job(cur, job_id)
            try:
                report = ingest_run(
                    cur,
                    run,
                    self._inputs(cur, job_id, folder, manifest, live, progress),
                    RankHint(rank=manifest.rank),
                    self.settings.ingest_limits,
                    on_file=record,
                    split_jobs=progress.split,
                    owner_id=manifest.owner_id,
                    on_split=split,
                )
            except _StoppedError:
                self._finish(
                    job_id, "failed", "the server was stopped during this job; upload the files without a result again"
                )
                return
            jobs.record_progress(
                cur, job_id, len(manifest.files), sum(f.size for f in manifest.files), progress.results, progress.runs
            )
        self._finish(job_id, "done", report.attribution_error)

    def _inputs(
        self,
        cur: duckdb.DuckDBPyConnection,
        job_id: str,
        folder: Path,
        manifest: Manifest,
        live: Live,
        progress: _Progress,
    ) -> Iterator[InputFile]:
        """The job's files in upload order, named as uploaded, counting bytes into the live progress. Without
        a split each file is stored before the next is read, so the job row is updated after each upload
        here; a split reads them all first, and `_Progress.add` records each upload once it is stored."""
        bytes_done = 0
        for index, upload in enumerate(manifest.files):
            if self._stopping.is_set():
                raise _StoppedError
            path = folder / upload.path
            live.upload = upload.name
            for item in iter_inputs([path], self.settings.ingest_limits):
                item.name = upload.name + item.name[len(str(path)) :]
                live.current = item.name
                if item.name == upload.name and item.error is None:
                    item.open_raw = _tapped(item.open_raw, live, bytes_done)
                progress.owner[id(item)] = index
                progress.items[index] += 1
                yield item
            bytes_done += upload.size
            live.bytes_done = bytes_done
            if not progress.split:
                progress.files_done, progress.bytes_done = index + 1, bytes_done
                jobs.record_progress(cur, job_id, index + 1, bytes_done, progress.results)
        live.current = None


@dataclass
class _Progress:
    """Which upload each ingested file came from, and the uploads stored whole so far."""

    manifest: Manifest
    split: bool
    owner: dict[int, int] = field(default_factory=dict)  # id(InputFile) -> index of its upload
    items: list[int] = field(default_factory=list)  # files read from each upload
    stored: list[int] = field(default_factory=list)  # files stored (or recorded failed) of each upload
    results: list[dict[str, Any]] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)  # a split's table of what goes where
    files_done: int = 0
    bytes_done: int = 0

    def __post_init__(self) -> None:
        self.items = [0] * len(self.manifest.files)
        self.stored = [0] * len(self.manifest.files)

    def upload_name(self, item: InputFile) -> str:
        index = self.owner.get(id(item))
        return item.name if index is None else self.manifest.files[index].name

    def add(self, item: InputFile, result: dict[str, Any]) -> bool:
        """Count a file's outcome; True when, in a split, it completes the uploads up to a new one."""
        self.results.append(result)
        index = self.owner.get(id(item))
        if not self.split or index is None:
            return False
        self.stored[index] += 1
        done = self.files_done
        while done < len(self.items) and self.stored[done] >= self.items[done]:
            done += 1
        if done == self.files_done:
            return False
        self.files_done, self.bytes_done = done, sum(f.size for f in self.manifest.files[:done])
        return True


def _result(upload: str, o: FileOutcome, run: str) -> dict[str, Any]:
    return {
        "run": o.run or run,
        "upload": upload,
        "path": o.path,
        "status": o.status,
        "kind": o.kind,
        "rank": o.rank,
        "events": o.events,
        "size": o.size,
        "error": o.error,
        "skipped": o.skipped,
        "warnings": o.warnings,
    }
