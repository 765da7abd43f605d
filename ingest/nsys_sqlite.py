"""Nsight Systems SQLite exports (`nsys export --type sqlite`): NCCL kernels as calls, sized by NCCL's own
NVTX ranges, and every kernel, memcpy and memset on the rank's timeline for the time analysis.

Read as the export documents its tables (Nsight Systems "SQLite Export Schema Reference"): StringIds
(id, value), CUPTI_ACTIVITY_KIND_KERNEL (start, end in ns, deviceId, streamId, correlationId, shortName ->
StringIds), CUPTI_ACTIVITY_KIND_MEMCPY (start, end, bytes, copyKind, streamId), CUPTI_ACTIVITY_KIND_MEMSET,
CUPTI_ACTIVITY_KIND_RUNTIME (start, end, globalTid, correlationId) and NVTX_EVENTS (start, end, text or
textId, globalTid, jsonText, binaryData). The schema version is META_DATA_EXPORT's EXPORT_SCHEMA_VERSION; majors other
than those in SCHEMA_MAJORS are refused by name. NCCL (2.19+ with NVTX payloads, `src/collectives.cc` at
v2.30.3-1) opens an `ncclAllReduce`-style range around each call whose payload "Message size [bytes]" is
count x type size; the kernel a call launches is found through the launch's correlationId inside the range.
NCCL's payloads are binary (nvtxPayloadData_t against schemas NCCL registers): exports store them in
NVTX_EVENTS.binaryData with their layout in NVTX_PAYLOAD_SCHEMA_ENTRIES (domainId, schemaId, idx, type,
name, offset), read by _binary_payload; a jsonText payload is read as well.

The file is hostile until read: spooled to a temporary file within MAX_DB_BYTES, opened read-only and
immutable through a `file:` URI, extension loading off, and an authorizer that allows only reads of the
tables above (no ATTACH, PRAGMA, writes or function calls); a trigger, or a view that calls functions, refuses
the file by name.
"""

from __future__ import annotations

import io
import json
import re
import sqlite3
import struct
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from commlens.vocab import msg_bytes_from_nccl_count, normalize_op

from .inputs import Limits
from .kineto_timeline import COMM, COMPUTE, INTERVAL_SCHEMA, MEMSET, merge_intervals
from .records import ParseError, ParseResult, RankHint

SQLITE_MAGIC = b"SQLite format 3\x00"
MAX_DB_BYTES = 8 * 2**30
SCHEMA_MAJORS = (2, 3)
META_TABLES = ("META_DATA_EXPORT", "EXPORT_META_DATA")
READ_TABLES = frozenset(
    {
        *META_TABLES,
        "StringIds",
        "CUPTI_ACTIVITY_KIND_KERNEL",
        "CUPTI_ACTIVITY_KIND_MEMCPY",
        "CUPTI_ACTIVITY_KIND_MEMSET",
        "CUPTI_ACTIVITY_KIND_RUNTIME",
        "NVTX_EVENTS",
        "NVTX_PAYLOAD_SCHEMA_ENTRIES",
        "sqlite_master",
    }
)
# CUPTI copyKind -> timeline kind (CUpti_ActivityMemcpyKind: 1 HtoD, 2 DtoH, 8 DtoD, 10 PtoP)
COPY_KINDS = {1: "memcpy_htod", 2: "memcpy_dtoh", 8: "memcpy_dtod", 10: "memcpy_ptop"}
_NCCL_KERNEL = re.compile(r"^nccl(?:Dev)?Kernel_([A-Za-z]+)")
_NCCL_RANGE = re.compile(
    r"^nccl(AllReduce|AllGather|ReduceScatter|Broadcast|Reduce|AlltoAll|Send|Recv|Gather|Scatter)$"
)
# NVTX payload entry types (nvToolsExtPayload.h) -> struct format: the integer ones NCCL's schemas use and kin
_PAYLOAD_INTS = {1: "b", 2: "B", 3: "h", 4: "H", 5: "i", 6: "I", 7: "q", 8: "Q", 9: "q", 10: "Q", 11: "b", 12: "B",
                 13: "h", 14: "H", 15: "i", 16: "I", 17: "q", 18: "Q", 22: "Q", 23: "Q"}  # fmt: skip
_TIMES_NRANKS = frozenset({"all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"})
_PAYLOAD_HEADER = 32  # binaryData: u64 domainId, u64 schemaId, u64 payload size, u64; the payload follows
_CALLS_FUNCTION = re.compile(r"\b[A-Za-z_]\w*\s*\(")
_KEYWORDS_WITH_PAREN = frozenset({"as", "in", "values", "from", "join", "on", "where", "and", "or", "not", "exists"})

__all__ = ["MAX_DB_BYTES", "SCHEMA_MAJORS", "SQLITE_MAGIC", "parse_nsys_sqlite"]


def _authorizer(action: int, arg1: str | None, arg2: str | None, db: str | None, trigger: str | None) -> int:
    """Reads of the known tables and SELECT only: no ATTACH, PRAGMA, write, function or view body."""
    if action == sqlite3.SQLITE_SELECT:
        return sqlite3.SQLITE_OK
    if action == sqlite3.SQLITE_READ and arg1 in READ_TABLES and trigger is None:
        return sqlite3.SQLITE_OK
    return sqlite3.SQLITE_DENY


def _spool(stream: io.BufferedReader) -> Path:
    tmp = tempfile.NamedTemporaryFile(prefix="commlens-nsys-", suffix=".sqlite", delete=False)  # noqa: SIM115
    path = Path(tmp.name)
    try:
        with tmp:
            copied = 0
            while chunk := stream.read(1 << 20):
                copied += len(chunk)
                if copied > MAX_DB_BYTES:
                    raise ParseError(f"SQLite export larger than {MAX_DB_BYTES >> 30} GiB: refused", "byte 0")
                tmp.write(chunk)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


def _open(path: Path) -> sqlite3.Connection:
    con = sqlite3.connect(f"{path.as_uri()}?mode=ro&immutable=1", uri=True)
    if hasattr(con, "enable_load_extension"):  # absent where CPython cannot load extensions at all
        con.enable_load_extension(False)
    con.set_authorizer(_authorizer)
    return con


def _check_schema(con: sqlite3.Connection) -> tuple[set[str], str]:
    """The export's tables and schema version; triggers and function-calling views refused by name."""
    try:
        rows = con.execute("SELECT type, name, sql FROM sqlite_master").fetchall()
    except sqlite3.DatabaseError as exc:
        raise ParseError(f"not a readable SQLite database ({exc})", "byte 0") from None
    tables: set[str] = set()
    for kind, name, sql in rows:
        if kind == "trigger":
            raise ParseError(f"SQLite trigger {name!r}: refused (an Nsight Systems export has none)", "sqlite_master")
        if kind == "view" and any(
            m.group(0).split("(")[0].strip().lower() not in _KEYWORDS_WITH_PAREN
            for m in _CALLS_FUNCTION.finditer(sql or "")
        ):
            raise ParseError(f"SQLite view {name!r} calls functions: refused", "sqlite_master")
        if kind == "table":
            tables.add(name)
    if "StringIds" not in tables or "CUPTI_ACTIVITY_KIND_KERNEL" not in tables:
        raise ParseError(
            "a SQLite database without StringIds and CUPTI_ACTIVITY_KIND_KERNEL: not an Nsight Systems export "
            "with CUDA kernels (nsys profile --trace cuda,nvtx; nsys export --type sqlite)",
            "sqlite_master",
        )
    meta = next((t for t in META_TABLES if t in tables), None)
    if meta is None:
        raise ParseError("no META_DATA_EXPORT table: the export's schema version is unknown, refused", "sqlite_master")
    found = con.execute(f"SELECT value FROM {meta} WHERE name = 'EXPORT_SCHEMA_VERSION'").fetchall()
    version = str(found[0][0]) if found else ""
    major = version.split(".")[0]
    if not major.isdigit() or int(major) not in SCHEMA_MAJORS:
        raise ParseError(
            f"Nsight Systems export schema {version or '(none)'} is unknown (read: "
            f"{', '.join(f'{m}.x' for m in SCHEMA_MAJORS)})",
            f"{meta}.EXPORT_SCHEMA_VERSION",
        )
    return tables, version


def _columns(con: sqlite3.Connection, table: str) -> set[str]:
    sql = con.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", [table]).fetchone()
    return set(re.findall(r"[(,]\s*\[?(\w+)\]?\s", sql[0])) if sql and sql[0] else set()


def _dtype_of_kernel(name: str) -> str | None:
    for token, dtype in (
        ("_bf16", "bfloat16"),
        ("_f16", "float16"),
        ("_f32", "float32"),
        ("_f64", "float64"),
        ("_i8", "int8"),
        ("_u8", "uint8"),
        ("_i32", "int32"),
        ("_i64", "int64"),
    ):
        if token in name:
            return dtype
    return None


def _nvtx_sizes(con: sqlite3.Connection, tables: set[str]) -> tuple[dict[int, tuple[str, int | None]], dict[int, int]]:
    """correlationId of a kernel launch -> (op, payload bytes) of the NCCL range around it; commHash -> nranks."""
    if "NVTX_EVENTS" not in tables or "CUPTI_ACTIVITY_KIND_RUNTIME" not in tables:
        return {}, {}
    cols = _columns(con, "NVTX_EVENTS")
    text = "n.text" if "text" in cols else "NULL"
    json_text = "n.jsonText" if "jsonText" in cols else "NULL"
    strings = dict(con.execute("SELECT id, value FROM StringIds").fetchall())
    ranges: dict[int, list[tuple[int, int, str, int | None, int | None]]] = defaultdict(list)
    nranks_of: dict[int, int] = {}
    text_id = "n.textId" if "textId" in cols else "NULL"
    binary = "n.binaryData" if "binaryData" in cols else "NULL"
    schemas = _payload_schemas(con, tables) if binary != "NULL" else {}
    for start, end, tid, txt, tid_text, payload, blob in con.execute(
        f"SELECT n.start, n.[end], n.globalTid, {text}, {text_id}, {json_text}, {binary} FROM NVTX_EVENTS n"
    ):
        name = txt if isinstance(txt, str) else strings.get(tid_text, "")
        data = _payload(payload) or _binary_payload(blob, schemas)
        comm = data.get("NCCL communicator ID")
        if name.startswith("ncclCommInit") and isinstance(comm, int) and isinstance(data.get("No. of ranks"), int):
            nranks_of[comm] = data["No. of ranks"]
        m = _NCCL_RANGE.match(name or "")
        if m and end is not None:
            size = data.get("Message size [bytes]")
            ranges[tid].append((start, end, m.group(1), size if isinstance(size, int) else None, comm))
    out: dict[int, tuple[str, int | None]] = {}
    for start, tid, corr in con.execute(
        "SELECT r.start, r.globalTid, r.correlationId FROM CUPTI_ACTIVITY_KIND_RUNTIME r"
    ):
        for s, e, op, size, comm in ranges.get(tid, ()):
            if s <= start <= e and size is not None:
                normalized = normalize_op(op) or op
                n = nranks_of.get(comm, 0) if isinstance(comm, int) else 0
                # S is the payload x nranks for these: unknown (not 0) without the communicator's size
                unknown = normalized in _TIMES_NRANKS and not n
                out[corr] = (normalized, None if unknown else msg_bytes_from_nccl_count(normalized, size, 1, n))
                break
    return out, nranks_of


def _payload_schemas(con: sqlite3.Connection, tables: set[str]) -> dict[tuple[int, int], list[tuple[str, str, int]]]:
    """(domainId, schemaId) -> [(entry name, struct format, offset)] of the integer entries of each payload
    schema; an entry without an offset lies where C puts it (natural alignment after the previous one)."""
    if "NVTX_PAYLOAD_SCHEMA_ENTRIES" not in tables:
        return {}
    cols = _columns(con, "NVTX_PAYLOAD_SCHEMA_ENTRIES")
    if not {"schemaId", "idx", "type", "name"} <= cols:
        return {}
    domain = "e.domainId" if "domainId" in cols else "0"
    offset = "e.[offset]" if "offset" in cols else "NULL"
    rows = con.execute(
        f"SELECT {domain}, e.schemaId, e.idx, e.[type], e.name, {offset} FROM NVTX_PAYLOAD_SCHEMA_ENTRIES e"
    ).fetchall()
    out: dict[tuple[int, int], list[tuple[str, str, int]]] = defaultdict(list)
    end: dict[tuple[int, int], int] = {}
    for dom, sid, _idx, kind, name, off in sorted(rows, key=lambda r: (r[0] or 0, r[1] or 0, r[2] or 0)):
        key = (int(dom or 0), int(sid or 0))
        fmt = _PAYLOAD_INTS.get(kind) if isinstance(kind, int) else None
        size = struct.calcsize("<" + fmt) if fmt else 4  # an enum schema (NCCL's reduction op) is a C enum
        at = off if isinstance(off, int) else -(-end.get(key, 0) // size) * size
        end[key] = at + size
        if fmt and isinstance(name, str):
            out[key].append((name, fmt, at))
    return out


def _binary_payload(blob: Any, schemas: dict[tuple[int, int], list[tuple[str, str, int]]]) -> dict[str, Any]:
    """The integer entries of one binaryData payload by name; {} where its schema is unknown or it is short."""
    if not isinstance(blob, bytes) or len(blob) < _PAYLOAD_HEADER or not schemas:
        return {}
    domain, schema, size = struct.unpack_from("<QQQ", blob, 0)
    entries = schemas.get((domain, schema))
    if entries is None:
        same = [v for (_, sid), v in schemas.items() if sid == schema]
        entries = same[0] if len(same) == 1 else None
    if not entries:
        return {}
    body = blob[_PAYLOAD_HEADER : _PAYLOAD_HEADER + size]
    out: dict[str, Any] = {}
    for name, fmt, at in entries:
        if at >= 0 and at + struct.calcsize("<" + fmt) <= len(body):
            out[name] = struct.unpack_from("<" + fmt, body, at)[0]
    return out


def _payload(text: Any) -> dict[str, Any]:
    if not isinstance(text, str) or not text.startswith("{") or len(text) > 1 << 16:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def parse_nsys_sqlite(stream: io.BufferedReader, name: str, hint: RankHint, limits: Limits) -> ParseResult:
    """One rank's export (rank from the file name or --rank): NCCL kernels as calls, the timeline as intervals."""
    path = _spool(stream)
    try:
        con = _open(path)
        try:
            return _read(con, hint)
        except sqlite3.DatabaseError as exc:
            raise ParseError(f"SQLite read refused or failed: {exc}", "sqlite") from None
        finally:
            con.close()
    finally:
        path.unlink(missing_ok=True)


def _read(con: sqlite3.Connection, hint: RankHint) -> ParseResult:
    tables, version = _check_schema(con)
    result = ParseResult(kind="nsys_sqlite", rank=hint.rank, world_size=hint.world_size)
    if hint.rank is None:
        result.warn("the export does not say its rank: name the file with it (rank3.sqlite) or pass --rank")
    strings = dict(con.execute("SELECT id, value FROM StringIds").fetchall())
    sized, _ = _nvtx_sizes(con, tables)
    lanes: dict[tuple[str, int], list[tuple[float, float, int]]] = defaultdict(list)
    devices: set[int] = set()
    n = no_nranks = 0
    for start, end, dev, stream_id, corr, short in con.execute(
        "SELECT k.start, k.[end], k.deviceId, k.streamId, k.correlationId, k.shortName "
        "FROM CUPTI_ACTIVITY_KIND_KERNEL k ORDER BY k.start"
    ):
        kname = strings.get(short, "") if isinstance(short, int) else str(short)
        s_us, e_us = start / 1000.0, end / 1000.0
        devices.add(dev)
        m = _NCCL_KERNEL.match(kname)
        lanes[(COMM if m else COMPUTE, int(stream_id))].append((s_us, e_us, 0))
        if not m:
            continue
        op_s, msg = sized.get(corr, (None, None))
        no_nranks += corr in sized and msg is None
        op = op_s or normalize_op(m.group(1))
        if op is None:  # ncclDevKernel_Generic / SendRecv without a range: a call we cannot name
            result.skip(f"NCCL kernel without an NCCL NVTX range naming its call: {kname[:60]}")
            continue
        result.events.append(
            {
                "rank": hint.rank,
                "process": f"cuda:{dev}",
                "seq": n,
                "op": op,
                "dtype": _dtype_of_kernel(kname),
                "msg_bytes": msg,
                "ts_us": s_us,
                "dur_us": e_us - s_us,
                "dur_source": "kernel",
                "raw_name": kname,
                "dev_start_us": s_us,
                "dev_end_us": e_us,
            }
        )
        n += 1
    if "CUPTI_ACTIVITY_KIND_MEMCPY" in tables:
        for start, end, nbytes, kind, stream_id in con.execute(
            "SELECT m.start, m.[end], m.bytes, m.copyKind, m.streamId FROM CUPTI_ACTIVITY_KIND_MEMCPY m"
        ):
            lanes[(COPY_KINDS.get(kind, "memcpy_dtod"), int(stream_id))].append((start / 1e3, end / 1e3, int(nbytes)))
    if "CUPTI_ACTIVITY_KIND_MEMSET" in tables:
        for start, end, nbytes, stream_id in con.execute(
            "SELECT m.start, m.[end], m.bytes, m.streamId FROM CUPTI_ACTIVITY_KIND_MEMSET m"
        ):
            lanes[(MEMSET, int(stream_id))].append((start / 1e3, end / 1e3, int(nbytes)))
    result.intervals = _intervals(hint.rank, lanes)
    if len(devices) > 1:
        result.warn(f"the export holds {len(devices)} devices: their calls are kept apart by process cuda:<device>")
    unsized = sum(1 for e in result.events if e["msg_bytes"] is None)
    if unsized > no_nranks:
        result.warn(
            f"{unsized - no_nranks} NCCL kernels without an NVTX payload size (NCCL before 2.19, or --trace "
            "without nvtx)"
        )
    if no_nranks:
        result.warn(
            f"{no_nranks} all_gather/reduce_scatter/all_to_all/gather/scatter calls unsized: S is their payload x "
            "the communicator's size, and no ncclCommInit* range of the export gives it (ncclCommSplit's payload "
            "names the parent's size)"
        )
    result.meta = {"format": "nsys_sqlite", "export_schema_version": version, "devices": sorted(devices)}
    return result


def _intervals(rank: int | None, lanes: dict[tuple[str, int], list[tuple[float, float, int]]]) -> pa.Table:
    cols: dict[str, list[Any]] = {k: [] for k in INTERVAL_SCHEMA.names}
    for (kind, stream_id), spans in sorted(lanes.items()):
        arr = np.array(spans, dtype=np.float64).reshape(-1, 3)
        s, e, b = merge_intervals(arr[:, 0], arr[:, 1], arr[:, 2].astype(np.int64))
        cols["rank"] += [rank] * len(s)
        cols["kind"] += [kind] * len(s)
        cols["stream"] += [stream_id] * len(s)
        cols["start_us"] += s.tolist()
        cols["end_us"] += e.tolist()
        cols["nbytes"] += b.tolist()
    return pa.table(cols, schema=INTERVAL_SCHEMA)
