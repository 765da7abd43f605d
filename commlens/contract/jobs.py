"""Ingest jobs: an upload's progress and the outcome of each of its files."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field


class FileResult(BaseModel):
    upload: str  # the uploaded file this result belongs to
    path: str  # the ingested file ("upload.tar.gz!member" for archive members)
    status: Literal["ok", "failed", "duplicate"]
    kind: str | None = None
    rank: int | None = None
    events: int = 0
    size: int = 0
    error: str | None = None
    skipped: dict[str, int] = {}
    warnings: list[str] = []
    run: str | None = None  # the run it went to (an upload of several jobs is split into one run per job)


class JobRun(BaseModel):
    """One run an upload's files went to, and the evidence that put them there."""

    run: str
    files: list[str]  # ingested paths, as in FileResult.path
    calls: int  # calls parsed from those files
    job: str  # the job's identity: world size, ranks, hosts, communicators, time
    joined_by: list[str] = []  # the evidence that these files are one job
    apart: list[str] = []  # why this is not the upload's first job (empty for the first)


class JobOut(BaseModel):
    job_id: str
    run: str | None
    state: Literal["queued", "running", "done", "failed"]
    files_total: int = Field(description="uploaded files (an archive is one): progress is files_done / files_total")
    files_done: int = Field(description="uploaded files ingested so far (an archive is one)")
    # Outcomes of the ingested files (archive members one by one): a job can end `done` with every file
    # failed, so scripts read these, not the state alone, to know what was stored.
    files_stored: int = Field(default=0, description="files stored (archive members one by one)")
    files_failed: int = Field(default=0, description="files that failed (archive members one by one)")
    files_duplicate: int = Field(default=0, description="files already in the run (archive members one by one)")
    bytes_total: int
    bytes_done: int
    current: str | None = None  # the file being ingested
    results: list[FileResult]
    # With files of several jobs: one row per run they went to, the upload's run first (else empty).
    jobs: list[JobRun] = []
    error: str | None
    created_at: datetime
    updated_at: datetime
