"""GET /api/runs/{run}/export: the run's rows of the `comms` view as CSV, Parquet or JSON lines,
streamed batch by batch (never the whole result in memory), with optional filters."""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from commlens.service import export
from commlens.vocab import FORMULA_PREFIXES, Op

from .db import Database
from .deps import Ctx, Cursor
from .errors import problem_responses

router = APIRouter(tags=["export"])

BATCH_ROWS = 64_000
MEDIA = {"csv": "text/csv; charset=utf-8", "jsonl": "application/x-ndjson", "parquet": "application/vnd.apache.parquet"}
Scheme = Literal["dp", "tp", "pp", "cp", "ep", "other"]


class _Sink(io.RawIOBase):
    """A write-only stream that hands out what was written so far and keeps the true position."""

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._pos = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
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


def _batches(db: Database, run: str, filters: dict[str, Any], json_lines: bool = False) -> Iterator[pa.RecordBatch]:
    """Batches on a cursor of the stream's own: the request's cursor is closed when the route returns."""
    cur = db.cursor()
    try:
        yield from export.comms_batches(cur, run, filters, BATCH_ROWS, json_lines)
    finally:
        cur.close()


_FORMULA = "^[" + re.escape("".join(FORMULA_PREFIXES)) + "]"


def _spreadsheet_safe(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Text cells a spreadsheet would run as formulas (a file or run name starting with '=') prefixed with an
    apostrophe, as commlens.vocab.csv_text does cell by cell."""
    columns = []
    for col in batch.columns:
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            formula = pc.fill_null(pc.match_substring_regex(col, _FORMULA), False)
            columns.append(pc.if_else(formula, pc.binary_join_element_wise("'", col, ""), col))
        else:
            columns.append(col)
    return pa.RecordBatch.from_arrays(columns, schema=batch.schema)


def stream_csv(db: Database, run: str, filters: dict[str, Any]) -> Iterator[bytes]:
    first = True
    for batch in _batches(db, run, filters):
        buf = io.BytesIO()
        pacsv.write_csv(_spreadsheet_safe(batch), buf, pacsv.WriteOptions(include_header=first))
        first = False
        yield buf.getvalue()
    if first:  # quoted as pyarrow writes the header of a file with rows
        yield (",".join(f'"{c}"' for c in export.COMMS_COLUMNS) + "\n").encode()


def stream_jsonl(db: Database, run: str, filters: dict[str, Any]) -> Iterator[bytes]:
    for batch in _batches(db, run, filters, json_lines=True):
        lines = batch.column(0).to_pylist()
        if lines:
            yield ("\n".join(lines) + "\n").encode()


def stream_parquet(db: Database, run: str, filters: dict[str, Any]) -> Iterator[bytes]:
    sink = _Sink()
    writer: pq.ParquetWriter | None = None
    for batch in _batches(db, run, filters):
        if writer is None:
            writer = pq.ParquetWriter(sink, batch.schema, compression="zstd")
        writer.write_batch(batch)
        chunk = sink.take()
        if chunk:
            yield chunk
    if writer is None:  # no rows: an empty file with the view's columns
        cur = db.cursor()
        try:
            schema = export.comms_schema(cur, run, filters)
        finally:
            cur.close()
        writer = pq.ParquetWriter(sink, schema, compression="zstd")
    writer.close()
    yield sink.take()


_STREAMS = {"csv": stream_csv, "jsonl": stream_jsonl, "parquet": stream_parquet}


@router.get(
    "/runs/{run}/export",
    responses={
        **problem_responses(404, 422),
        200: {"content": {m: {} for m in MEDIA.values()}, "description": "the rows, streamed"},
    },
    response_class=StreamingResponse,
    summary="Export the run's rows of the comms view (streamed)",
)
def export_run(
    run: str,
    cur: Cursor,
    ctx: Ctx,
    format: Annotated[Literal["csv", "parquet", "jsonl"], Query()] = "csv",
    scheme: Annotated[
        Scheme | Literal["unattributed"] | None, Query(description="'unattributed': calls without a scheme")
    ] = None,
    op: Annotated[Op | None, Query()] = None,
    dtype: Annotated[str | None, Query(max_length=32)] = None,
    rank: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
    step: Annotated[
        int | None,
        Query(
            ge=-(2**31),
            le=2**31 - 1,
            description=(
                "the comms.step column (profiler step); for detected iterations of NCCL logs, and for a histogram "
                "bar's calls, use GET /api/runs/{run}/calls"
            ),
        ),
    ] = None,
) -> StreamingResponse:
    export.check_run(cur, run)  # 404 before the stream starts
    filters = {"scheme": scheme, "op": op, "dtype": dtype, "rank": rank, "step": step}
    filename = re.sub(r"[^A-Za-z0-9._+@=-]", "_", run) + f".{format}"
    return StreamingResponse(
        _STREAMS[format](ctx.db, run, filters),
        media_type=MEDIA[format],
        headers={"Content-Disposition": f'attachment; filename="{filename}"'},
    )
