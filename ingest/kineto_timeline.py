"""The per-rank timeline that the time analysis needs, read in the ingest's own pass over a Kineto trace.

`Activity` receives device kernels, copies and memsets (and CPU ops, until the trace shows device
activity) straight from the scanner's bytes (kineto_json.ActivitySink) and keeps them as intervals per
(kind, stream), merged as they arrive where adjacent or overlapping intervals of one kind on one stream
lose nothing; `intervals_table` finishes them into the `timeline_intervals` rows. A trace without
device activity (gloo on CPU) gives the collectives' measured CPU intervals as communication and the
CPU ops outside every communication event of their thread as compute, less the time their thread spends
in its collectives (an op enclosing a blocking collective waits there). `call_times` gives each call's
match key (PyTorch's `Seq`) and its CPU and device spans, stored on its comm_events row.

`timeline_of` shows a parse result as the columns the analysis reads (kineto.read_timeline: one file
without a store, for the analysis library's tests and tools).
"""

from __future__ import annotations

from array import array
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .kineto_model import COMM_KERNEL_PREFIXES_BYTES, EPS, Call, CpuEv, as_int
from .records import ParseResult

COMPUTE = "compute"
COMM = "comm"
MEMSET = "memset"
MEMCPY_KINDS = ("memcpy_htod", "memcpy_dtoh", "memcpy_dtod", "memcpy_ptop")
COMM_LANE = -1  # the stream of a CPU-only trace's communication intervals
_MEMCPY = {b"HtoD": "memcpy_htod", b"DtoH": "memcpy_dtoh", b"DtoD": "memcpy_dtod", b"PtoP": "memcpy_ptop"}
INTERVAL_SCHEMA = pa.schema(
    [
        ("rank", pa.int32()),
        ("kind", pa.string()),
        ("stream", pa.int64()),
        ("start_us", pa.float64()),
        ("end_us", pa.float64()),
        ("nbytes", pa.int64()),
    ]
)


class _Lane:
    """One (kind, stream)'s intervals; one that starts within the last one's span extends it."""

    __slots__ = ("end", "nbytes", "start")

    def __init__(self) -> None:
        self.start = array("d")
        self.end = array("d")
        self.nbytes = array("q")

    def add(self, s: float, e: float, b: int) -> None:
        if self.start and self.start[-1] <= s <= self.end[-1] + EPS:
            if e > self.end[-1]:
                self.end[-1] = e
            self.nbytes[-1] += b
            return
        self.start.append(s)
        self.end.append(e)
        self.nbytes.append(b)

    def merged(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The union of the lane (sorted, touching intervals joined; bytes of joined ones add up)."""
        s = np.frombuffer(self.start, dtype=np.float64)
        e = np.frombuffer(self.end, dtype=np.float64)
        b = np.frombuffer(self.nbytes, dtype=np.int64)
        return merge_intervals(s, e, b)


def merge_intervals(s: np.ndarray, e: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Union of intervals [s, e] with their bytes, as sorted disjoint intervals (gaps > EPS)."""
    if not len(s):
        return s, e, b
    order = np.argsort(s, kind="stable")
    s, e, b = s[order], e[order], b[order]
    reach = np.maximum.accumulate(e)
    new = np.empty(len(s), dtype=bool)
    new[0] = True
    new[1:] = s[1:] > reach[:-1] + EPS
    idx = np.flatnonzero(new)
    ends = np.append(idx[1:], len(s)) - 1
    return s[idx], reach[ends], np.add.reduceat(b, idx)


class Activity:
    """The activity sink of one trace's scan (kineto_json.ActivitySink)."""

    def __init__(self) -> None:
        self.lanes: dict[tuple[str, int], _Lane] = defaultdict(_Lane)
        self.cpu_tid = array("q")
        self.cpu_start = array("d")
        self.cpu_end = array("d")
        self.has_device = False

    def add(self, cat: bytes, name: bytes, tid: int, ts: float, dur: float, stream: int | None, nbytes: int) -> bool:
        if dur < 0:
            return not self.has_device
        if cat == b"cpu_op":
            if not self.has_device:
                self.cpu_tid.append(tid)
                self.cpu_start.append(ts)
                self.cpu_end.append(ts + dur)
            return not self.has_device
        if cat == b"kernel":
            kind = COMM if name.startswith(COMM_KERNEL_PREFIXES_BYTES) else COMPUTE
        elif cat == b"gpu_memcpy":
            kind = _MEMCPY.get(name[7:11], "memcpy_dtod") if name.startswith(b"Memcpy ") else "memcpy_dtod"
        else:
            kind = MEMSET
        if not self.has_device:  # CPU ops only serve traces without device activity
            self.has_device = True
            self.cpu_tid, self.cpu_start, self.cpu_end = array("q"), array("d"), array("d")
        self.lanes[(kind, tid if stream is None else stream)].add(ts, ts + dur, nbytes if kind != COMPUTE else 0)
        return False

    def extend(self, kind: str, stream: int, start: np.ndarray, end: np.ndarray, nbytes: np.ndarray) -> None:
        """Device intervals of one (kind, stream) at once, as add() of each would keep them (a lane is
        merged as a whole when read, so the order intervals arrive in does not matter)."""
        if not self.has_device:
            self.has_device = True
            self.cpu_tid, self.cpu_start, self.cpu_end = array("q"), array("d"), array("d")
        s, e, b = merge_intervals(start, end, nbytes if kind != COMPUTE else np.zeros(len(start), dtype=np.int64))
        lane = self.lanes[(kind, stream)]
        lane.start.frombytes(s.tobytes())
        lane.end.frombytes(e.tobytes())
        lane.nbytes.frombytes(b.astype(np.int64).tobytes())

    def intervals_table(
        self,
        rank: int | None,
        comm_spans: tuple[np.ndarray, np.ndarray],
        comm_cpu: list[CpuEv],
        call_windows: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> pa.Table:
        """The timeline_intervals rows: device lanes, or for a trace without device activity the calls'
        CPU spans (`comm_spans`: starts and ends of the calls with ts_us and dur_us) as communication and
        the CPU ops of each thread as compute, less what the thread waits in its own calls (`_cpu_compute`;
        `comm_cpu`: the calls' CPU events, `call_windows`: each call's CPU op start and the end of its work)."""
        parts: list[tuple[str, int, tuple[np.ndarray, np.ndarray, np.ndarray]]] = []
        if self.has_device:
            parts = [(kind, stream, lane.merged()) for (kind, stream), lane in sorted(self.lanes.items())]
        else:
            s, e = comm_spans
            parts.append((COMM, COMM_LANE, merge_intervals(s, e, np.zeros(len(s), dtype=np.int64))))
            parts.extend(self._cpu_compute(comm_cpu, call_windows))
        lengths = [len(p[2][0]) for p in parts]
        n = sum(lengths)
        return pa.table(
            [
                pa.nulls(n, pa.int32()) if rank is None else pa.array(np.full(n, rank, dtype=np.int32)),
                pa.array([k for (k, _, _), m in zip(parts, lengths, strict=True) for _ in range(m)], pa.string()),
                pa.array(np.repeat(np.asarray([p[1] for p in parts], dtype=np.int64), lengths)),
                pa.array(np.concatenate([p[2][0] for p in parts]) if parts else np.zeros(0)),
                pa.array(np.concatenate([p[2][1] for p in parts]) if parts else np.zeros(0)),
                pa.array(np.concatenate([p[2][2] for p in parts]) if parts else np.zeros(0, dtype=np.int64)),
            ],
            schema=INTERVAL_SCHEMA,
        )

    def _cpu_compute(
        self, comm_cpu: list[CpuEv], call_windows: tuple[np.ndarray, np.ndarray] | None
    ) -> list[tuple[str, int, tuple[np.ndarray, np.ndarray, np.ndarray]]]:
        """Per thread, the union of its CPU ops that start outside its calls' CPU events, less its waits: from
        a call's CPU op to the end of its work (gloo runs it on worker threads), the thread computes only in
        ops that enclose none of its calls. An op around a blocking collective (an autograd Function around a
        TP all_reduce, a pipeline stage's recv) only waits there, while DDP's backward ops run on beside
        their buckets' all_reduce."""
        tids = np.frombuffer(self.cpu_tid, dtype=np.int64)
        starts = np.frombuffer(self.cpu_start, dtype=np.float64)
        ends = np.frombuffer(self.cpu_end, dtype=np.float64)
        by_tid: dict[int, list[tuple[float, float]]] = defaultdict(list)
        tid_at: dict[float, int] = {}  # a call's CPU op start -> its thread
        for ev in comm_cpu:
            tid = as_int(ev.tid)
            if tid is not None:
                by_tid[tid].append((ev.ts, ev.ts + ev.dur))
                tid_at.setdefault(ev.ts, tid)
        waits: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for cpu_start, end in zip(*(call_windows or ((), ())), strict=True):
            tid = tid_at.get(float(cpu_start))
            if tid is not None and end > cpu_start:
                waits[tid].append((float(cpu_start), float(end)))
        out = []
        for tid in np.unique(tids):
            sel = tids == tid
            s, e = starts[sel], ends[sel]
            cs, ce, _ = _union(by_tid.get(int(tid), []))
            if len(cs):  # ops starting inside a communication event are its own work
                i = np.searchsorted(cs, s + EPS, side="right") - 1
                inside = (i >= 0) & (s <= ce[np.maximum(i, 0)] + EPS)
                s, e = s[~inside], e[~inside]
            ws, we, _ = _union(waits.get(int(tid), []))
            compute_s, compute_e, _ = merge_intervals(s, e, np.zeros(len(s), dtype=np.int64))
            if len(ws):
                # ops enclosing one of the thread's calls (their start before it, their end after it)
                j = np.searchsorted(ws, s, side="right")  # the first wait starting after the op starts
                encloses = (j < len(ws)) & (e >= ws[np.minimum(j, len(ws) - 1)])
                ns, ne, _ = merge_intervals(
                    s[~encloses], e[~encloses], np.zeros(int((~encloses).sum()), dtype=np.int64)
                )
                cut_s, cut_e = subtract_intervals(ws, we, ns, ne)
                compute_s, compute_e = subtract_intervals(compute_s, compute_e, cut_s, cut_e)
            out.append((COMPUTE, int(tid), (compute_s, compute_e, np.zeros(len(compute_s), dtype=np.int64))))
        return out


def _union(spans: list[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    arr = np.asarray(spans, dtype=np.float64).reshape(-1, 2)
    return merge_intervals(arr[:, 0], arr[:, 1], np.zeros(len(arr), dtype=np.int64))


def subtract_intervals(
    s: np.ndarray, e: np.ndarray, cut_s: np.ndarray, cut_e: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The parts of the sorted disjoint intervals [s, e] outside the sorted disjoint intervals [cut_s, cut_e],
    as sorted disjoint intervals (pieces shorter than EPS dropped)."""
    if not len(s) or not len(cut_s):
        return s, e
    # a sweep over every boundary: inside a kept interval (depth 1) and outside every cut (depth 0)
    points = np.concatenate([s, e, cut_s, cut_e])
    keep = np.concatenate([np.ones(len(s)), -np.ones(len(e)), np.zeros(2 * len(cut_s))])
    cut = np.concatenate([np.zeros(2 * len(s)), np.ones(len(cut_s)), -np.ones(len(cut_e))])
    order = np.argsort(points, kind="stable")
    points, depth_keep, depth_cut = points[order], np.cumsum(keep[order]), np.cumsum(cut[order])
    kept = (depth_keep[:-1] > 0) & (depth_cut[:-1] == 0) & (points[1:] - points[:-1] > EPS)
    ps, pe = points[:-1][kept], points[1:][kept]
    if not len(ps):
        return ps, pe
    merged_s, merged_e, _ = merge_intervals(ps, pe, np.zeros(len(ps), dtype=np.int64))
    return merged_s, merged_e


def call_times(call: Call) -> dict[str, Any]:
    """The call's match key (PyTorch's collective `Seq`, newest traces), its CPU op's span and its
    device kernels' span (first start, last end), for its comm_events row."""
    root = call.root
    key = None
    for seq in [ev.seq for ev in call.members if ev.name == "record_param_comms"] + [k.seq for k in call.kernels]:
        key = as_int(seq)
        if key is not None:
            break
    return {
        "match_key": key,
        "cpu_start_us": root.ts if root else None,
        "cpu_end_us": root.ts + root.dur if root else None,
        "dev_start_us": min(k.ts for k in call.kernels) if call.kernels else None,
        "dev_end_us": max(k.ts + k.dur for k in call.kernels) if call.kernels else None,
    }


# ------------------------------------------------------------------------- the parse seen as columns


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


def timeline_of(result: ParseResult, name: str) -> RankTimeline:
    """A parsed trace's timeline as columns (the rows the store gets, before they are written)."""
    tl = result.meta.get("timeline") or {}
    notes = list(tl.get("notes", []))
    iv = IntervalColumns()
    if result.intervals is not None:
        d = result.intervals.to_pydict()
        iv = IntervalColumns(d["kind"], d["stream"], d["start_us"], d["end_us"], d["nbytes"])
    steps = StepColumns()
    for row in result.steps:
        steps.step.append(row["step"])
        steps.start.append(row["ts_us"])
        steps.end.append(row["ts_us"] + row["dur_us"])
    groups = {g["group_key"]: g for g in result.groups}
    calls = CallColumns()
    for row in result.all_events():
        g = groups.get(row["group_key"]) if row["group_key"] else None
        ts, dur = row["ts_us"], row["dur_us"]
        calls.seq.append(row["seq"])
        calls.op.append(row["op"])
        calls.dtype.append(row["dtype"])
        calls.msg_bytes.append(row["msg_bytes"])
        calls.group_key.append(row["group_key"])
        calls.group_name.append(g.get("name") if g else None)
        calls.group_desc.append(g.get("description") if g else None)
        calls.group_ranks.append(tuple(g["ranks"]) if g and g.get("ranks") else None)
        calls.group_size.append(row["group_size"])
        calls.match_key.append(row["match_key"])
        calls.step.append(row["step"])
        calls.cpu_start.append(row["cpu_start_us"])
        calls.cpu_end.append(row["cpu_end_us"])
        calls.dev_start.append(row["dev_start_us"])
        calls.dev_end.append(row["dev_end_us"])
        calls.arrival.append(ts)
        calls.end.append(ts + dur if ts is not None and dur is not None else None)
    return RankTimeline(name, result.rank, result.world_size, bool(tl.get("has_device")), iv, steps, calls, notes)


def _timed(t: pa.Table) -> int:
    """Rows of an event table with both ts_us and dur_us."""
    if "ts_us" not in t.column_names or "dur_us" not in t.column_names:
        return 0
    return int(pc.sum(pc.and_(pc.is_valid(t.column("ts_us")), pc.is_valid(t.column("dur_us")))).as_py() or 0)


def _one_rank_groups_only(result: ParseResult) -> bool:
    """Every call of the trace is on a group of one rank (a one-GPU job's own group)."""
    sizes = {r.get("group_size") for r in result.events}
    for t in result.event_tables:
        if t.num_rows:
            sizes |= set(pc.unique(t.column("group_size")).to_pylist()) if "group_size" in t.column_names else {None}
    return sizes == {1}


def timeline_notes(result: ParseResult, has_device: bool, lists_devices: bool) -> list[str]:
    """What the trace's timeline lacks, and why (kept in the source's meta)."""
    notes = []
    if result.rank is None:
        notes.append("no rank in distributedInfo or the file name: the rank is unknown")
    if not result.steps:
        notes.append("no ProfilerStep ranges: per-step quantities cannot be computed")
    no_end = sum(r.get("ts_us") is None or r.get("dur_us") is None for r in result.events) + sum(
        t.num_rows - _timed(t) for t in result.event_tables
    )
    if no_end:
        one_rank = _one_rank_groups_only(result)
        notes.append(
            f"{no_end} of {result.n_events} calls have no measured duration "
            + (
                "(one-rank groups: NCCL launches no kernel there, it moves nothing between ranks)"
                if one_rank
                else "(NCCL without its kernels records only the enqueue)"
            )
            + ": no real time or end for them"
        )
    if not has_device and lists_devices:
        notes.append(
            "no device activity although the trace lists devices: communication is the collectives' CPU "
            "time, compute is unknown (CPU ops are read only from traces without devices)"
        )
    elif not has_device:
        notes.append("no device activity: communication is the collectives' CPU time (gloo), compute the other CPU ops")
    return notes
