"""POST /api/runs/{run}/files (multipart upload, streamed to the spool, limits enforced while reading)
and GET /api/jobs (the ingest jobs the uploads become). Files of several training jobs become one run
each (the job's `jobs` table says what went where and why); `one_run=true`, as a query parameter or a
form field, stores them all in the run."""

from __future__ import annotations

import re
import shutil
from collections import Counter
from email.message import Message
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, BinaryIO

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect

from commlens import store
from commlens.contract.common import Page
from commlens.contract.jobs import FileResult, JobOut, JobRun
from commlens.ingest.formats import sniff_file
from commlens.ingest.inputs import Limits
from commlens.ingest.records import ParseError
from commlens.service import jobs

from . import auth
from .deps import AppContext, Ctx, Cursor, Limit, Offset, next_offset
from .errors import ApiError, problem_responses
from .ingest_queue import IngestQueue, Manifest, SpooledUpload, new_job_id
from .settings import Settings

router = APIRouter(tags=["uploads"])

MAX_FIELD_BYTES = 64 << 10
SPOOL_HEADROOM = 256 << 20  # keep this much disk free for the store itself


class _RefusedError(Exception):
    def __init__(self, status: int, detail: str, kind: str):
        self.error = ApiError(status, detail, kind)


# ------------------------------------------------------------------------------- spooling


def safe_file_name(raw: str, index: int) -> str:
    """The base name of a client's file name, without folders, control characters or '..'."""
    name = PurePosixPath(raw.replace("\\", "/")).name
    name = re.sub(r"[\x00-\x1f\x7f!]", "_", name).strip()
    return name[:255] if name not in ("", ".", "..") else f"file{index}"


def _file_name(disposition: bytes, options: dict[bytes, bytes]) -> str | None:
    """A part's file name: `filename`, or the RFC 5987 `filename*` (charset'lang'percent-encoded) that some clients
    send alone and python-multipart does not read; None for a form field."""
    if b"filename" in options:
        return options[b"filename"].decode("utf-8", "replace")
    if b"filename*" not in disposition.lower():
        return None
    header = Message()
    header["content-disposition"] = disposition.decode("latin-1")
    name = header.get_filename()
    return name if name is not None else ""


class _Spooler:
    """multipart callbacks that write file parts straight to disk, counting against the limits."""

    def __init__(self, folder: Path, max_file: int, max_files: int):
        self.folder = folder
        self.max_file = max_file
        self.max_files = max_files
        self.files: list[SpooledUpload] = []
        self._fh: BinaryIO | None = None
        self._size = 0
        self._is_file = False
        self._field = 0
        self._hname = b""
        self._hvalue = b""
        self._disposition = b""
        self._name = ""  # the form field being read
        self._value = b""
        self.fields: dict[str, str] = {}  # form fields (not files), by name
        self.ended = False

    def callbacks(self) -> dict[str, Any]:
        return {
            "on_part_begin": self._begin,
            "on_part_data": self._data,
            "on_part_end": self._end,
            "on_header_field": self._hf,
            "on_header_value": self._hv,
            "on_header_end": self._he,
            "on_headers_finished": self._headers_done,
            "on_end": self._done,
        }

    def _done(self) -> None:
        self.ended = True

    def _begin(self) -> None:
        self._disposition, self._is_file, self._size, self._field = b"", False, 0, 0
        self._name, self._value = "", b""

    def _hf(self, data: bytes, start: int, end: int) -> None:
        self._hname += data[start:end]

    def _hv(self, data: bytes, start: int, end: int) -> None:
        self._hvalue += data[start:end]

    def _he(self) -> None:
        if self._hname.lower() == b"content-disposition":
            self._disposition = self._hvalue
        self._hname, self._hvalue = b"", b""

    def _headers_done(self) -> None:
        _, options = parse_options_header(self._disposition)
        raw_name = _file_name(self._disposition, options)
        if raw_name is None:
            self._name = options.get(b"name", b"").decode("utf-8", "replace")
            return
        if len(self.files) >= self.max_files:
            raise _RefusedError(
                413, f"more than {self.max_files} files in one request; split the upload", "too-many-files"
            )
        index = len(self.files)
        name = safe_file_name(raw_name, index)
        rel = f"{index:05d}.part"
        self._fh = open(self.folder / rel, "wb")  # noqa: SIM115 - closed in _end or close()
        self._is_file = True
        self.files.append(SpooledUpload(name=name, path=rel, size=0))

    def _data(self, data: bytes, start: int, end: int) -> None:
        n = end - start
        if not self._is_file:
            self._field += n
            if self._field > MAX_FIELD_BYTES:
                raise _RefusedError(
                    413,
                    f"a form field is larger than {MAX_FIELD_BYTES} bytes; only file parts may be large",
                    "field-too-large",
                )
            self._value += data[start:end]
            return
        self._size += n
        if self._size > self.max_file:
            raise _RefusedError(
                413,
                f"{self.files[-1].name} is larger than the limit of {self.max_file} bytes per file "
                "(commlens serve --max-file-mb); split it or compress it",
                "file-too-large",
            )
        assert self._fh is not None
        self._fh.write(data[start:end])

    def _end(self) -> None:
        if not self._is_file and self._name:
            self.fields[self._name] = self._value.decode("utf-8", "replace")
        if self._is_file and self._fh is not None:
            self._fh.close()
            self._fh = None
            self.files[-1].size = self._size

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


# --------------------------------------------------------------------------------- sniffing


_EXT = {"tar": ".tar", "zip": ".zip"}


def _sniff_all(folder: Path, files: list[SpooledUpload], limits: Limits) -> list[str]:
    """Rename archives so the ingest walker expands them; the reasons of files that are no known format."""
    refused = []
    for up in files:
        path = folder / up.path
        try:
            kind = sniff_file(path, limits)
        except ParseError as exc:
            refused.append(f"{up.name}: {exc.reason}")
            continue
        except OSError as exc:
            refused.append(f"{up.name}: cannot read ({exc})")
            continue
        if kind in _EXT:
            new = up.path.replace(".part", _EXT[kind])
            path.rename(folder / new)
            up.path = new
    return refused


# ------------------------------------------------------------------------------------ routes


def job_out(job: jobs.Job, queue: IngestQueue) -> JobOut:
    """The job as stored, with the live byte progress and current file of a running one."""
    live = queue.live(job.job_id) if job.state == "running" else None
    results = [FileResult(**r) for r in job.results]
    outcomes = Counter(r.status for r in results)
    return JobOut(
        job_id=job.job_id,
        run=job.run,
        state=job.state,
        files_total=job.files_total,
        files_done=job.files_done,
        files_stored=outcomes["ok"],
        files_failed=outcomes["failed"],
        files_duplicate=outcomes["duplicate"],
        bytes_total=job.bytes_total,
        bytes_done=max(job.bytes_done, live.bytes_done) if live else job.bytes_done,
        current=live.current if live else None,
        results=results,
        jobs=[JobRun(**r) for r in job.runs],
        error=job.error,
        created_at=job.created_at,
        updated_at=job.updated_at,
    )


@router.get("/jobs/{job_id}", response_model=JobOut, responses=problem_responses(404))
def get_job(job_id: str, cur: Cursor, ctx: Ctx) -> JobOut:
    return job_out(jobs.get_job(cur, job_id), ctx.ingest_queue)


@router.get("/jobs", response_model=Page[JobOut])
def list_jobs(
    cur: Cursor,
    ctx: Ctx,
    limit: Limit = 50,
    offset: Offset = 0,
    run: Annotated[str | None, Query(max_length=128)] = None,
    state: Annotated[str | None, Query(pattern="^(queued|running|done|failed)$")] = None,
) -> Page[JobOut]:
    items, total = jobs.list_jobs(cur, limit, offset, run=run or None, state=state)  # empty: no filter, as tag=
    return Page[JobOut](
        items=[job_out(j, ctx.ingest_queue) for j in items],
        total=total,
        limit=limit,
        offset=offset,
        next_offset=next_offset(offset, limit, total),
    )


@router.post(
    "/runs/{run}/files",
    status_code=202,
    response_model=JobOut,
    responses=problem_responses(401, 404, 413, 415, 422, 507),
    summary="Upload trace files (multipart/form-data, any number of file parts); returns the ingest job",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "required": ["files"],
                        "properties": {
                            "files": {"type": "array", "items": {"type": "string", "format": "binary"}},
                            "one_run": {"type": "boolean", "description": "store every file in this run"},
                        },
                    }
                }
            },
        }
    },
)
async def upload_files(
    run: str,
    request: Request,
    ctx: Ctx,
    rank: Annotated[
        int | None, Query(ge=0, le=10_000_000, description="global rank of single-rank files that do not say")
    ] = None,
    one_run: Annotated[
        bool | None,
        Query(
            description="store every file in this run even when they are of several jobs (by default each job "
            "gets a run of its own); also accepted as a form field"
        ),
    ] = None,
) -> JSONResponse:
    settings = ctx.settings

    def who() -> tuple[auth.Principal, int | None]:
        with ctx.db.session() as cur:
            p = auth.principal_for(request, cur, settings.loopback, settings.insecure)
            return p, store.get_run_id(cur, run)

    principal, run_id = await run_in_threadpool(who)
    auth.require_write(principal)
    if run_id is None:
        raise ApiError(404, f"no run named {run!r}; create it first with POST /api/runs", "unknown-run")
    boundary = _multipart_boundary(request, settings)
    job_id = new_job_id()
    folder = settings.spool / job_id
    folder.mkdir(parents=True)
    spooler = _Spooler(folder, settings.max_file_bytes, settings.max_files_per_request)
    parser = MultipartParser(boundary, spooler.callbacks())  # type: ignore[arg-type]
    try:
        refused = await _receive(request, parser, spooler, settings.max_request_bytes)
        if refused is None:
            bad = await run_in_threadpool(_sniff_all, folder, spooler.files, settings.ingest_limits)
            if bad:
                refused = _RefusedError(
                    415,
                    "not a Kineto trace, NCCL log, run.json or archive of them: "
                    + "; ".join(bad[:20])
                    + (f" (and {len(bad) - 20} more)" if len(bad) > 20 else "")
                    + ". Nothing of this upload was queued.",
                    "unsupported-file",
                )
        if refused is not None:
            raise refused.error
        merge = one_run if one_run is not None else _flag(spooler.fields, "one_run")
        manifest = Manifest(run=run, rank=rank, files=spooler.files, one_run=merge, owner_id=principal.user_id)
        manifest.dump(folder)
        job = await run_in_threadpool(_create_job, ctx, job_id, run, manifest)
    except BaseException:
        spooler.close()
        shutil.rmtree(folder, ignore_errors=True)
        raise
    ctx.ingest_queue.submit(job_id, run, principal.name)
    return JSONResponse(job.model_dump(mode="json"), status_code=202, headers={"Location": f"/api/jobs/{job_id}"})


TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off", "")


def _flag(fields: dict[str, str], name: str) -> bool:
    """A boolean form field (absent: false), or a 422 naming the field and the values it takes."""
    value = fields.get(name, "").strip().lower()
    if value in TRUE or value in FALSE:
        return value in TRUE
    raise ApiError(422, f"form field {name!r} is {fields[name]!r}; it takes true or false", "invalid-field")


def _multipart_boundary(request: Request, settings: Settings) -> bytes:
    """The multipart boundary of an upload whose headers the server accepts: multipart, within the request
    limit and the spool's free disk; else the ApiError that says what to send instead."""
    ctype, options = parse_options_header(request.headers.get("content-type", ""))
    if ctype != b"multipart/form-data" or not options.get(b"boundary"):
        raise ApiError(
            415,
            "send the files as multipart/form-data (for example curl -F files=@rank0.json.gz)",
            "unsupported-media-type",
        )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > settings.max_request_bytes:
        raise ApiError(
            413,
            f"the request declares {declared} bytes, more than the limit of {settings.max_request_bytes} "
            "per request (commlens serve --max-request-mb); send the files in several requests",
            "request-too-large",
        )
    if declared is not None and declared.isdigit():
        free = shutil.disk_usage(settings.spool).free
        if int(declared) > free - SPOOL_HEADROOM:
            raise ApiError(
                507,
                f"the server's disk has {free} bytes free next to the store; this upload needs "
                f"{declared} bytes plus headroom. Free space or upload fewer files",
                "insufficient-storage",
            )
    return options[b"boundary"]


async def _receive(
    request: Request, parser: MultipartParser, spooler: _Spooler, max_request_bytes: int
) -> _RefusedError | None:
    """Stream the body into the spool; why the upload is refused (the rest of the body is read and discarded
    so the client gets the answer), or None when every part arrived whole."""
    refused: _RefusedError | None = None
    received = 0
    try:
        async for chunk in request.stream():
            received += len(chunk)
            if received > max_request_bytes:
                refused = refused or _RefusedError(
                    413,
                    f"the request is larger than the limit of {max_request_bytes} "
                    "bytes (commlens serve --max-request-mb)",
                    "request-too-large",
                )
                break  # stop reading: the connection is closed after the answer
            if refused is None:
                try:
                    parser.write(chunk)
                except _RefusedError as exc:
                    refused = exc  # keep reading (and discarding) so the client gets the answer
                except Exception as exc:
                    refused = _RefusedError(422, f"malformed multipart body: {exc}", "malformed-upload")
        if refused is None:
            parser.finalize()
    except ClientDisconnect:
        refused = _RefusedError(400, "the client disconnected before the upload was complete", "incomplete-upload")
    except Exception as exc:
        refused = refused or _RefusedError(422, f"malformed multipart body: {exc}", "malformed-upload")
    spooler.close()
    if refused is None and not spooler.ended:
        refused = _RefusedError(
            422,
            "the multipart body ends before its closing boundary (truncated upload?); "
            "nothing was queued, send it again",
            "malformed-upload",
        )
    if refused is None and not spooler.files:
        refused = _RefusedError(
            422,
            "the upload has no file parts; send files as multipart parts with a filename "
            "(curl -F files=@rank0.json.gz)",
            "no-files",
        )
    return refused


def _create_job(ctx: AppContext, job_id: str, run: str, manifest: Manifest) -> JobOut:
    with ctx.ingest_queue.run_lock, ctx.db.session() as cur:
        job = jobs.create_job(cur, job_id, run, len(manifest.files), sum(f.size for f in manifest.files))
    return job_out(job, ctx.ingest_queue)


__all__ = ["router", "safe_file_name"]
