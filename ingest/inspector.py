"""NCCL Inspector output: one JSON record per line for each completed collective (and, from NCCL 2.30,
each point-to-point call) of each communicator of a process.

Read as NVIDIA/nccl writes it (`plugins/profiler/inspector/inspector_json.cc` at v2.30.3-1, commit
5067397c; `ext-profiler/inspector/` from v2.28.3-1 on): every record is
`{"header": {id, [comm_name], rank, n_ranks, nnodes}, "metadata": {inspector_output_format_version,
git_rev, rec_mechanism, dump_timestamp_us, hostname, pid}, "coll_perf" | "p2p_perf": {...}}`.
`inspector_output_format_version` is "v4.0" in every release so far; 2.28-2.29 records have no
`comm_name` and no `p2p_perf`; `coll_timing_source` (kernel_gpu | kernel_cpu | collective_cpu) and, with
NCCL_INSPECTOR_DUMP_VERBOSE=1, `event_trace_sn`/`event_trace_ts` (per-channel kernel start/stop, in
microseconds) may follow. A double NCCL cannot print is the string "nan".

Records are per call, so each is one call: `coll_msg_size_bytes` is the NCCL count x type size (per-rank
count, as in COLL lines), S as formats.md A.3 says; `coll_exec_time_us` the duration; `coll_sn` the
communicator's call number of that function (`op_count`): NCCL numbers each function apart
(`comm->seqNumber[func]`, src/plugin/profiler.cc), so AllReduce #0 and AllGather #0 of one communicator
share 0, and `match_key` is `coll_sn x len(FUNC_KEYS) + the function's place in FUNC_KEYS`. `header.id` is the communicator hash NCCL logs print
as commId, `header.rank` the rank in that communicator: the parser writes an nccl_comms row per process
and communicator and `nccl_link` groups them across processes and resolves global ranks (the rank in the
largest communicator), like NCCL logs. Bus bandwidth is recomputed with our factors and compared with the
record's (a warning names the first disagreement). Files are named `<host>-pid<pid>.log` by the plugin:
they are recognised by content.
"""

from __future__ import annotations

import io
import json
import math
from typing import Any

from commlens.vocab import busbw_factor, msg_bytes_from_nccl_count, normalize_op

from .inputs import Limits
from .records import ParseError, ParseResult, RankHint

FORMAT_VERSIONS = ("v4.0",)
TIMING_SOURCES = {"kernel_gpu": "kernel", "kernel_cpu": "cpu_op", "collective_cpu": "cpu_op"}
BUSBW_TOLERANCE = 0.01  # relative: both sides compute from the same integer microseconds
_HEADER_KEYS = ("id", "rank", "n_ranks")
# the functions whose coll_sn NCCL counts apart (ncclFunc_t order); match_key keeps them apart
FUNC_KEYS = ("broadcast", "reduce", "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "gather", "scatter")

__all__ = ["FORMAT_VERSIONS", "parse_inspector"]


def _field(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = obj.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ParseError(f"field {key!r} missing or not a {getattr(kind, '__name__', 'number')}", f"{where}.{key}")
    return value


def _number(value: Any) -> float | None:
    """A JSON number, or None for NCCL's "nan"."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


class _Reader:
    """One file's records into rows; state across lines (communicators, bandwidth check)."""

    def __init__(self, name: str, limits: Limits):
        self.name = name
        self.limits = limits
        self.result = ParseResult(kind="nccl_inspector")
        self.comms: dict[tuple[str, int, str], dict[str, Any]] = {}
        self.seq: dict[str, int] = {}
        self.versions: set[str] = set()
        self.busbw_checked = 0
        self.busbw_off = 0

    def record(self, rec: Any, line: int) -> None:
        where = f"line {line}"
        if not isinstance(rec, dict):
            raise ParseError("a record is not a JSON object", where)
        header, meta = rec.get("header"), rec.get("metadata")
        if not isinstance(header, dict) or not isinstance(meta, dict):
            raise ParseError("record without 'header' and 'metadata' objects: not NCCL Inspector output", where)
        version = meta.get("inspector_output_format_version")
        if version not in FORMAT_VERSIONS:
            raise ParseError(
                f"inspector_output_format_version {version!r} is unknown (read: {', '.join(FORMAT_VERSIONS)})",
                f"{where}: $.metadata.inspector_output_format_version",
            )
        self.versions.add(version)
        comm_id = _field(header, "id", str, f"{where}: $.header")
        comm_rank = _field(header, "rank", int, f"{where}: $.header")
        nranks = _field(header, "n_ranks", int, f"{where}: $.header")
        host = _field(meta, "hostname", str, f"{where}: $.metadata")
        pid = _field(meta, "pid", int, f"{where}: $.metadata")
        if not 0 <= comm_rank < nranks:
            raise ParseError(f"rank {comm_rank} outside the communicator's {nranks} ranks", f"{where}: $.header.rank")
        process = f"{host}:{pid}"
        key = (host, pid, comm_id)
        if key not in self.comms:
            self.comms[key] = {
                "group_key": f"nccl:ptr:{process}:{comm_id}:n{nranks}",
                "host": host,
                "pid": pid,
                "comm_ptr": comm_id,
                "comm_rank": comm_rank,
                "nranks": nranks,
                "comm_id": comm_id,
                "api": "inspector",
            }
        if "coll_perf" in rec:
            self._call(rec["coll_perf"], "coll", key, process, nranks, f"{where}: $.coll_perf")
        elif "p2p_perf" in rec:
            self._call(rec["p2p_perf"], "p2p", key, process, nranks, f"{where}: $.p2p_perf")
        else:
            self.result.skip("record without coll_perf or p2p_perf")

    def _call(self, perf: Any, prefix: str, key: tuple[str, int, str], process: str, nranks: int, where: str) -> None:
        if not isinstance(perf, dict):
            raise ParseError(f"{prefix}_perf is not an object", where)
        raw = _field(perf, prefix, str, where)
        op = normalize_op(raw)
        if raw == "Invalid":  # the plugin's name lookup knows no AlltoAll, Gather or Scatter (NCCL 2.28-2.30)
            self.result.skip("a call the plugin names 'Invalid' (its AlltoAll, Gather and Scatter): op unknown")
            return
        if op is None:
            self.result.skip(f"not a communication op: {raw[:40]}")
            return
        sn = _field(perf, f"{prefix}_sn", int, where)
        size = _field(perf, f"{prefix}_msg_size_bytes", int, where)
        exec_us = _field(perf, f"{prefix}_exec_time_us", (int, float), where)
        msg = msg_bytes_from_nccl_count(op, size, 1, nranks) if prefix == "coll" else size
        peer = perf.get("p2p_peer") if prefix == "p2p" else None
        timing = perf.get(f"{prefix}_timing_source")
        start, end = _kernel_span(perf.get("event_trace_ts"))
        comm = self.comms[key]
        n = self.seq.get(process, 0)
        self.seq[process] = n + 1
        self.result.events.append(
            {
                "process": process,
                "seq": n,
                "op": op,
                "msg_bytes": msg,
                "group_size": nranks,
                "group_key": comm["group_key"],
                "peer": peer if isinstance(peer, int) else None,
                "ts_us": start,
                "dur_us": float(exec_us),
                "dur_source": TIMING_SOURCES.get(timing, "kernel") if isinstance(timing, str) else "kernel",
                "op_count": sn,
                "comm_ptr": comm["comm_ptr"],
                "raw_name": f"inspector:{raw}",
                "match_key": _match_key(op, sn) if prefix == "coll" else sn,
                "dev_start_us": start,
                "dev_end_us": end,
            }
        )
        self._check_busbw(op, msg, exec_us, nranks, _number(perf.get(f"{prefix}_busbw_gbs")), where)

    def _check_busbw(self, op: str, msg: int, exec_us: float, nranks: int, theirs: float | None, where: str) -> None:
        if theirs is None or exec_us <= 0 or op in ("send", "recv"):
            return
        ours = msg / (exec_us * 1e-6) / 1e9 * busbw_factor(op, nranks)
        self.busbw_checked += 1
        if not math.isclose(ours, theirs, rel_tol=BUSBW_TOLERANCE, abs_tol=1e-6):
            self.busbw_off += 1
            self.result.warn(
                f"{where}: busbw {theirs:g} GB/s in the record, {ours:g} GB/s by commlens's factors "
                f"({op}, {msg} B, {exec_us:g} us, {nranks} ranks)"
            )

    def finish(self) -> ParseResult:
        r = self.result
        r.nccl_comms = list(self.comms.values())
        r.world_size = max((c["nranks"] for c in r.nccl_comms), default=None)
        r.meta = {
            "format": "nccl_inspector",
            "inspector_output_format_version": sorted(self.versions),
            "records": "per_call",
            "processes": sorted({f"{c['host']}:{c['pid']}" for c in r.nccl_comms}),
            "busbw_checked": self.busbw_checked,
            "busbw_disagreeing": self.busbw_off,
        }
        return r


def _match_key(op: str, sn: int) -> int | None:
    """A key one collective has on every member: its function's sequence number, kept apart per function."""
    return sn * len(FUNC_KEYS) + FUNC_KEYS.index(op) if op in FUNC_KEYS else None


def _kernel_span(trace: Any) -> tuple[float | None, float | None]:
    """First kernel start and last kernel stop of a verbose record (event_trace_ts), microseconds."""
    if not isinstance(trace, dict) or not isinstance(trace.get("kernel_events"), list):
        return None, None
    starts = [k.get("kernel_start_ts") for k in trace["kernel_events"] if isinstance(k, dict)]
    stops = [k.get("kernel_stop_ts") for k in trace["kernel_events"] if isinstance(k, dict)]
    s = [float(v) for v in starts if isinstance(v, int | float) and v > 0]
    e = [float(v) for v in stops if isinstance(v, int | float) and v > 0]
    return (min(s) if s else None), (max(e) if e else None)


def parse_inspector(stream: io.BufferedReader, name: str, hint: RankHint, limits: Limits) -> ParseResult:
    """Every record of one Inspector file (one process); a cut or malformed line fails the file by its number."""
    reader = _Reader(name, limits)
    text = io.TextIOWrapper(stream, encoding="utf-8", errors="strict", newline="\n")
    line_no = 0
    while True:
        line = text.readline(limits.max_line_bytes + 1)
        if not line:
            break
        line_no += 1
        if len(line) > limits.max_line_bytes:
            raise ParseError(f"line longer than {limits.max_line_bytes} bytes", f"line {line_no}")
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            cut = not line.endswith("\n")
            reason = "truncated JSON record (the file ends inside it)" if cut else f"malformed JSON record ({exc.msg})"
            raise ParseError(reason, f"line {line_no}") from None
        except RecursionError:
            raise ParseError("JSON nested too deeply", f"line {line_no}") from None
        reader.record(rec, line_no)
    text.detach()
    if not reader.result.events and not reader.comms:
        raise ParseError("no NCCL Inspector record", "line 1")
    return reader.finish()
