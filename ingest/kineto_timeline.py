"""The per-rank timeline that the time analysis needs, from one Kineto trace.

Device activity becomes intervals by kind per stream (compute kernels, communication kernels, memcpy by
direction with bytes, memset), merged where adjacent or overlapping intervals of one kind on one stream
lose nothing. A trace without device activity (gloo on CPU) gives the collectives' CPU intervals as
communication and the other CPU ops of the process as compute. Collective calls are grouped exactly as
the ingest groups them (kineto_events.build_calls, kineto_calls.call_row), so `CallColumns.seq` is the
stored `comm_events.seq` of the same file: (source file, rank, seq) joins a record to its stored call.
"""

from __future__ import annotations

import bisect
import io
import re
from array import array
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from .inputs import DEFAULT_LIMITS, Limits
from .kineto_calls import call_row, parse_ranks, step_of
from .kineto_events import Collector, build_calls
from .kineto_json import scan_trace
from .kineto_model import EPS, Call, TraceContext, as_float, as_int
from .records import ParseResult, RankHint

COMPUTE = "compute"
COMM = "comm"
MEMSET = "memset"
MEMCPY_KINDS = ("memcpy_htod", "memcpy_dtoh", "memcpy_dtod", "memcpy_ptop")
_MEMCPY = re.compile(r"Memcpy (HtoD|DtoH|DtoD|PtoP)")
_ALL_NAMES = "."  # every event is looked at: kernel names are arbitrary, so no name prefix selects them


@dataclass
class IntervalColumns:
    """Activity intervals, one row each: kind (COMPUTE, COMM, MEMSET or a MEMCPY_KINDS name), the stream
    (the thread id for CPU-only traces), start and end in µs, and bytes (memcpy; 0 otherwise)."""

    kind: list[str] = field(default_factory=list)
    stream: list[int] = field(default_factory=list)
    start: list[float] = field(default_factory=list)
    end: list[float] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)


@dataclass
class StepColumns:
    """ProfilerStep windows of the rank (µs)."""

    step: list[int] = field(default_factory=list)
    start: list[float] = field(default_factory=list)
    end: list[float] = field(default_factory=list)


@dataclass
class CallColumns:
    """One row per collective call, in the ingest's order (seq = comm_events.seq).

    `arrival`/`end` are the device kernels' span where the trace has them, else the measured CPU time
    (gloo); `end` is None where only the enqueue is known. `match_key` is PyTorch's `Seq` (None before
    the traces that record it). Group fields are as the trace gives them (None when it does not)."""

    seq: list[int] = field(default_factory=list)
    op: list[str] = field(default_factory=list)
    dtype: list[str | None] = field(default_factory=list)
    msg_bytes: list[int | None] = field(default_factory=list)
    group_key: list[str | None] = field(default_factory=list)
    group_name: list[str | None] = field(default_factory=list)
    group_desc: list[str | None] = field(default_factory=list)
    group_ranks: list[tuple[int, ...] | None] = field(default_factory=list)
    group_size: list[int | None] = field(default_factory=list)
    match_key: list[int | None] = field(default_factory=list)
    step: list[int | None] = field(default_factory=list)
    cpu_start: list[float | None] = field(default_factory=list)
    cpu_end: list[float | None] = field(default_factory=list)
    dev_start: list[float | None] = field(default_factory=list)
    dev_end: list[float | None] = field(default_factory=list)
    arrival: list[float | None] = field(default_factory=list)
    end: list[float | None] = field(default_factory=list)


@dataclass
class RankTimeline:
    """Everything the time analysis reads from one rank's trace."""

    file: str
    rank: int | None
    world_size: int | None
    has_device: bool
    intervals: IntervalColumns
    steps: StepColumns
    calls: CallColumns
    notes: list[str] = field(default_factory=list)  # what could not be read, and why


class _Activity:
    """Device activity and CPU ops as they stream past, kept as flat arrays."""

    def __init__(self, col: Collector) -> None:
        self.col = col
        self.raw: dict[tuple[str, int], list[tuple[float, float, int]]] = defaultdict(list)
        self.cpu_tid = array("q")
        self.cpu_start = array("d")
        self.cpu_end = array("d")

    def add(self, ev: dict[str, Any]) -> None:
        if Collector.wanted(ev):
            self.col.add(ev)
        if ev.get("ph") != "X":
            return
        cat = ev.get("cat") or ""
        ts, dur = as_float(ev.get("ts")), as_float(ev.get("dur"))
        if ts is None or dur is None or dur < 0:
            return
        args = ev.get("args")
        args = args if isinstance(args, dict) else {}
        name = str(ev.get("name", ""))
        if cat == "kernel":
            kind = COMM if name.startswith("nccl") else COMPUTE
        elif cat == "gpu_memcpy":
            m = _MEMCPY.match(name)
            kind = f"memcpy_{m.group(1).lower()}" if m else "memcpy_dtod"
        elif cat == "gpu_memset":
            kind = MEMSET
        elif cat == "cpu_op":
            tid = as_int(ev.get("tid"))
            if tid is not None:
                self.cpu_tid.append(tid)
                self.cpu_start.append(ts)
                self.cpu_end.append(ts + dur)
            return
        else:
            return
        stream = as_int(args.get("stream"))
        if stream is None:
            stream = as_int(ev.get("tid")) or 0
        nbytes = as_int(args.get("bytes")) or 0 if kind in MEMCPY_KINDS else 0
        self.raw[(kind, stream)].append((ts, ts + dur, nbytes))


def _merge(rows: list[tuple[float, float, int]]) -> list[tuple[float, float, int]]:
    """Union of one kind's intervals on one stream; bytes of merged copies add up."""
    out: list[tuple[float, float, int]] = []
    for s, e, b in sorted(rows):
        if out and s <= out[-1][1] + EPS:
            ps, pe, pb = out[-1]
            out[-1] = (ps, max(pe, e), pb + b)
        else:
            out.append((s, e, b))
    return out


def _context(dist: dict[str, Any]) -> TraceContext:
    """The job's process groups from distributedInfo.pg_config, as the ingest reads them."""
    backend = dist.get("backend")
    ctx = TraceContext(backend=backend if isinstance(backend, str) else None)
    pgs = dist.get("pg_config")
    items = list(pgs.values()) if isinstance(pgs, dict) else pgs if isinstance(pgs, list) else []
    for g in items:
        if isinstance(g, dict) and g.get("pg_name") is not None:
            ranks = parse_ranks(g.get("ranks"))
            size = as_int(g.get("pg_size")) or (len(ranks) if ranks else None)
            ctx.groups[str(g["pg_name"])] = {
                "ranks": ranks,
                "size": size,
                "desc": g.get("pg_desc"),
                "uid": g.get("uid"),
            }
    ctx.complete_groups = bool(ctx.groups)
    return ctx


def _pt_seq(call: Call) -> int | None:
    """PyTorch's collective sequence number (`Seq`, newest traces) from the call's metadata."""
    for args in [ev.args for ev in call.members if ev.name == "record_param_comms"] + [k.args for k in call.kernels]:
        seq = as_int(args.get("Seq"))
        if seq is not None:
            return seq
    return None


def read_timeline(
    stream: io.BufferedIOBase, name: str, hint: RankHint | None = None, limits: Limits = DEFAULT_LIMITS
) -> RankTimeline:
    """Read one Kineto trace (decompressed stream) into its RankTimeline; ParseError when not a trace."""
    col = Collector()
    act = _Activity(col)
    scan = scan_trace(stream, limits.max_json_depth, _ALL_NAMES, lambda ev: True, act.add)
    dist = scan.top.get("distributedInfo")
    dist = dist if isinstance(dist, dict) else {}
    hint = hint or RankHint()
    rank = as_int(dist.get("rank"))
    rank = hint.rank if rank is None else rank
    notes: list[str] = []
    if rank is None:
        notes.append("no rank in distributedInfo or the file name: the rank is unknown")
    ctx = _context(dist)

    steps = StepColumns()
    for n, (ts, dur) in sorted(col.steps.items(), key=lambda kv: kv[1][0]):
        steps.step.append(n)
        steps.start.append(ts)
        steps.end.append(ts + dur)
    if not steps.step:
        notes.append("no ProfilerStep ranges: per-step quantities cannot be computed")

    result = ParseResult(kind="kineto")
    gen: Counter[str] = Counter()
    step_index = sorted(
        zip(steps.start, [e - s for s, e in zip(steps.start, steps.end, strict=True)], steps.step, strict=True)
    )
    calls = CallColumns()
    for call in build_calls(col, result):
        row = call_row(call, ctx, result, gen)
        if row is None:
            continue
        _add_call(calls, len(calls.seq), call, row, result, step_index)

    no_end = sum(e is None for e in calls.end)
    if no_end:
        notes.append(
            f"{no_end} of {len(calls.seq)} calls have no measured duration (NCCL without its kernels "
            "records only the enqueue): no real time or end for them"
        )
    has_device = bool(act.raw)
    intervals = IntervalColumns()
    if has_device:
        for (kind, strm), rows in sorted(act.raw.items()):
            for s, e, b in _merge(rows):
                _append(intervals, kind, strm, s, e, b)
    else:
        notes.append("no device activity: communication is the collectives' CPU time (gloo), compute the other CPU ops")
        _cpu_intervals(intervals, act, calls, col)
    return RankTimeline(
        name, rank, as_int(dist.get("world_size")) or hint.world_size, has_device, intervals, steps, calls, notes
    )


def _add_call(
    calls: CallColumns,
    seq: int,
    call: Call,
    row: dict[str, Any],
    result: ParseResult,
    step_index: list[tuple[float, float, int]],
) -> None:
    group = next((g for g in result.groups if g["group_key"] == row["group_key"]), None) if row["group_key"] else None
    ranks = group.get("ranks") if group else None
    dev_start = min(k.ts for k in call.kernels) if call.kernels else None
    dev_end = max(k.ts + k.dur for k in call.kernels) if call.kernels else None
    root = call.root
    ts, dur = row["ts_us"], row["dur_us"]
    calls.seq.append(seq)
    calls.op.append(row["op"])
    calls.dtype.append(row["dtype"])
    calls.msg_bytes.append(row["msg_bytes"])
    calls.group_key.append(row["group_key"])
    calls.group_name.append(group.get("name") if group else None)
    calls.group_desc.append(group.get("description") if group else None)
    calls.group_ranks.append(tuple(ranks) if ranks else None)
    calls.group_size.append(row["group_size"])
    calls.match_key.append(_pt_seq(call))
    calls.step.append(step_of(step_index, call.issue_ts))
    calls.cpu_start.append(root.ts if root else None)
    calls.cpu_end.append(root.ts + root.dur if root else None)
    calls.dev_start.append(dev_start)
    calls.dev_end.append(dev_end)
    calls.arrival.append(ts)
    calls.end.append(ts + dur if ts is not None and dur is not None else None)


def _append(iv: IntervalColumns, kind: str, stream: int, start: float, end: float, nbytes: int) -> None:
    iv.kind.append(kind)
    iv.stream.append(stream)
    iv.start.append(start)
    iv.end.append(end)
    iv.nbytes.append(nbytes)


def _cpu_intervals(iv: IntervalColumns, act: _Activity, calls: CallColumns, col: Collector) -> None:
    """CPU-only trace: each call's measured CPU span is communication; CPU ops that start outside
    every communication event of their thread are compute (nested ops of a c10d op are its own work)."""
    comm_by_tid: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for ev in col.cpu:
        tid = as_int(ev.tid)
        if tid is not None:
            comm_by_tid[tid].append((ev.ts, ev.ts + ev.dur))
    comm_rows: list[tuple[float, float, int]] = []
    for a, e in zip(calls.arrival, calls.end, strict=True):
        if a is not None and e is not None:
            comm_rows.append((a, e, 0))
    for s, e, _ in _merge(comm_rows):
        _append(iv, COMM, -1, s, e, 0)
    merged = {tid: _merge([(s, e, 0) for s, e in rows]) for tid, rows in comm_by_tid.items()}
    starts = {tid: [r[0] for r in rows] for tid, rows in merged.items()}
    per_tid: dict[int, list[tuple[float, float, int]]] = defaultdict(list)
    for tid, s, e in zip(act.cpu_tid, act.cpu_start, act.cpu_end, strict=True):
        i = bisect.bisect_right(starts.get(tid, []), s + EPS) - 1
        if i < 0 or s > merged[tid][i][1] + EPS:
            per_tid[tid].append((s, e, 0))
    for tid, rows in sorted(per_tid.items()):
        for s, e, _ in _merge(rows):
            _append(iv, COMPUTE, tid, s, e, 0)
