"""GET /api/runs/{run}/export: the run's rows of the `comms` view as CSV, Parquet or JSON lines,
streamed batch by batch (never the whole result in memory), with optional filters."""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from commlens.backend.iterations import run_id_of
from commlens.vocab import Op

from .db import Database
from .deps import Ctx, Cursor
from .errors import problem_responses

router = APIRouter(tags=["export"])

COMMS_COLUMNS = ("run", "rank", "op", "dtype", "msg_bytes", "elems_in", "elems_out", "group_size", "group_key",
                 "scheme", "peer", "step", "ts_us", "dur_us", "source_kind", "file")
BATCH_ROWS = 64_000
MEDIA = {"csv": "text/csv; charset=utf-8", "jsonl": "application/x-ndjson", "parquet": "application/vnd.apache.parquet"}
Scheme = Literal["dp", "tp", "pp", "cp", "ep", "other"]


def export_query(run: str, filters: dict[str, Any]) -> tuple[str, list[Any]]:
    """SQL over the comms view; filter columns are fixed names, values are parameters."""
    conditions, params = ["run = ?"], [run]
    for column, value in filters.items():
        if value is not None:
            conditions.append(f"{column} = ?")
            params.append(value)
    cols = ", ".join(COMMS_COLUMNS)
    return f"SELECT {cols} FROM comms WHERE {' AND '.join(conditions)} ORDER BY file, rank, ts_us NULLS LAST", params


class _Sink(io.RawIOBase):
    """A write-only stream that hands out what was written so far and keeps the true position."""

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._pos = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[override]
        data = bytes(b)
        self._chunks.append(data)
        self._pos += len(data)
        return len(data)

    def tell(self) -> int:
        return self._pos

    def take(self) -> bytes:
        out = b"".join(self._chunks)
        self._chunks.clear()
        return out


def _batches(db: Database, sql: str, params: list[Any]) -> Iterator[pa.RecordBatch]:
    cur = db.cursor()
    try:
        reader = cur.sql(sql, params=params).to_arrow_reader(BATCH_ROWS)
        for batch in reader:
            yield batch
    finally:
        cur.close()


def stream_csv(db: Database, sql: str, params: list[Any]) -> Iterator[bytes]:
    first = True
    for batch in _batches(db, sql, params):
        buf = io.BytesIO()
        pacsv.write_csv(batch, buf, pacsv.WriteOptions(include_header=first))
        first = False
        yield buf.getvalue()
    if first:
        yield (",".join(COMMS_COLUMNS) + "\n").encode()


def stream_jsonl(db: Database, sql: str, params: list[Any]) -> Iterator[bytes]:
    json_sql = f"SELECT to_json(c)::VARCHAR AS line FROM ({sql}) c"
    for batch in _batches(db, json_sql, params):
        lines = batch.column(0).to_pylist()
        if lines:
            yield ("\n".join(lines) + "\n").encode()


def stream_parquet(db: Database, sql: str, params: list[Any]) -> Iterator[bytes]:
    sink = _Sink()
    writer: pq.ParquetWriter | None = None
    schema = None
    for batch in _batches(db, sql, params):
        if writer is None:
            schema = batch.schema
            writer = pq.ParquetWriter(sink, schema, compression="zstd")
        writer.write_batch(batch)
        chunk = sink.take()
        if chunk:
            yield chunk
    if writer is None:  # no rows: an empty file with the view's columns
        cur = db.cursor()
        try:
            schema = cur.sql(f"SELECT * FROM ({sql}) LIMIT 0", params=params).to_arrow_table().schema
        finally:
            cur.close()
        writer = pq.ParquetWriter(sink, schema, compression="zstd")
    writer.close()
    yield sink.take()


_STREAMS = {"csv": stream_csv, "jsonl": stream_jsonl, "parquet": stream_parquet}


@router.get(
    "/runs/{run}/export", responses={**problem_responses(404, 422), 200: {"content": {m: {} for m in MEDIA.values()},
                                                                          "description": "the rows, streamed"}},
    response_class=StreamingResponse, summary="Export the run's rows of the comms view (streamed)",
)
def export_run(
    run: str, cur: Cursor, ctx: Ctx,
    format: Annotated[Literal["csv", "parquet", "jsonl"], Query()] = "csv",
    scheme: Annotated[Scheme | None, Query()] = None,
    op: Annotated[Op | None, Query()] = None,
    dtype: Annotated[str | None, Query(max_length=32)] = None,
    rank: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
    step: Annotated[int | None, Query(ge=-(2**31), le=2**31 - 1, description=(
        "the comms.step column (profiler step); for detected iterations of NCCL logs, and for a histogram "
        "bar's calls, use GET /api/runs/{run}/calls"))] = None,
) -> StreamingResponse:
    run_id_of(cur, run)  # 404 before the stream starts
    sql, params = export_query(run, {"scheme": scheme, "op": op, "dtype": dtype, "rank": rank, "step": step})
    filename = re.sub(r"[^A-Za-z0-9._+@=-]", "_", run) + f".{format}"
    return StreamingResponse(_STREAMS[format](ctx.db, sql, params), media_type=MEDIA[format],
                             headers={"Content-Disposition": f'attachment; filename="{filename}"'})
