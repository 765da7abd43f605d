"""Kineto (PyTorch profiler) trace ingester: one comm_events row per logical call per rank.

kineto_json reads the document as a stream, kineto_events groups the events that describe one call,
kineto_calls tells what each call is; this module reads the file's job description (distributedInfo:
rank, world size, process groups) and assembles the ParseResult.
"""

from __future__ import annotations

import io
import os
from collections import Counter
from typing import Any

import numpy as np

from commlens.contract.common import MAX_RANK

from .inputs import DEFAULT_LIMITS, Limits
from .kineto_bulk import BulkReader
from .kineto_calls import call_row, parse_ranks, step_of
from .kineto_columns import columnar_rows
from .kineto_events import LAUNCH_PREFIXES, PREFIXES, Collector, build_calls
from .kineto_fields import has, spelling
from .kineto_json import scan_trace
from .kineto_model import TraceContext, as_int
from .kineto_timeline import Activity, RankTimeline, call_times, timeline_notes, timeline_of
from .records import ParseError, ParseResult, RankHint

ROW_BATCH = 65_536  # rows held as dicts before they are moved into an Arrow table (ParseResult.flush_events)
# Calls grouped and rows made on the record columns (kineto_columns) where the trace allows; False: always
# by the reference path (build_calls + call_row), which the columnar one is tested against.
COLUMNAR = True
# Records a trace the columnar path does not read (gloo worker threads, labels...) may hold: the reference
# path makes ~0.3 KB objects of each, so it keeps the budget of the object-only parse.
OBJECT_BUDGET = 3_000_000
# Where wanted events are dense, runs of whole events are read as columns (kineto_blocks, kineto_bulk);
# False: always event by event (Collector.add), which the block reader is tested against.
BLOCKS = True


def parse_kineto(stream: io.BufferedReader, name: str, hint: RankHint, limits: Limits) -> ParseResult:
    """Parse one Kineto JSON trace (decompressed stream) into comm_events, steps, process groups and the
    rank's timeline (activity intervals; each call's match key and CPU/device spans), in one pass."""
    result = ParseResult(kind="kineto")
    col = Collector(limits.max_trace_events)
    act = Activity()
    on_block = BulkReader(col, act, limits.max_json_depth) if BLOCKS else None
    scan = scan_trace(
        stream,
        limits.max_json_depth,
        PREFIXES,
        Collector.wanted,
        col.add,
        LAUNCH_PREFIXES,
        col.launch,
        act.add,
        on_block,
    )
    top = scan.top
    for reason, n in col.skipped.items():
        result.skip(reason, n)

    dist, gen_dist = _distributed_info(top.get("distributedInfo"), result)
    rank = as_int(dist.get("rank"))
    if rank is not None and not 0 <= rank <= MAX_RANK:
        raise ParseError(f"rank {rank} is outside 0..{MAX_RANK}", "$.distributedInfo.rank")
    if rank is None:
        rank = hint.rank
        if rank is not None:
            what = "no distributedInfo" if gen_dist == "absent" else "distributedInfo has no rank"
            result.warn(f"{what}: rank {rank} taken from {hint.rank_from}")
        else:
            result.warn("no rank in distributedInfo, the file name or --rank: rank recorded as NULL")
    elif hint.rank is not None and hint.rank != rank:
        result.warn(f"distributedInfo says rank {rank}, {hint.rank_from} says {hint.rank}: using {rank}")
    result.rank = rank
    result.world_size = as_int(dist.get("world_size")) or hint.world_size

    ctx = TraceContext(backend=dist.get("backend") if isinstance(dist.get("backend"), str) else None)
    for g in _pg_config(dist.get("pg_config"), result):
        ctx.groups[g["name"]] = {"ranks": g["ranks"], "size": g["size"], "desc": g["description"], "uid": g.pop("uid")}
        result.groups.append(g)
    ctx.complete_groups = bool(ctx.groups)  # pg_config lists every group this rank belongs to

    steps = sorted((ts, dur, n) for n, (ts, dur) in col.steps.items())
    result.steps = [{"rank": rank, "step": n, "ts_us": ts, "dur_us": dur} for ts, dur, n in steps]

    process = str(rank) if rank is not None else os.path.basename(name.split("!")[-1])
    has_device = act.has_device  # without device activity the CPU records serve the timeline after the rows
    gen = columnar_rows(col, ctx, result, process, steps, ROW_BATCH, has_device) if COLUMNAR else None
    if gen is None:
        budget = min(OBJECT_BUDGET, limits.max_trace_events)
        if col.kept > budget:
            raise ParseError(
                f"more than {budget:,} communication records (CPU ops, NCCL kernels, launches) in a trace whose "
                "calls are grouped as objects (gloo worker threads, commlens labels or ids that are not plain "
                "integers): refused to bound memory (`commlens ingest --max-trace-events N` raises the limit)"
            )
        gen = _reference_rows(col, ctx, result, rank, process, steps)
    result.groups = _dedupe_groups(result.groups)
    # CPU ops serve as compute only in traces without device activity
    result.intervals = (
        act.intervals_table(rank, _comm_spans(result), [])
        if act.has_device
        else act.intervals_table(rank, _comm_spans(result), col.cpu, _call_windows(result))
    )

    result.meta = {
        "generation": _generation(col, gen, gen_dist),
        "distributedInfo": top.get("distributedInfo"),
        "nccl_version": dist.get("nccl_version"),
        "pg_count": dist.get("pg_count"),
        **{
            k: top[k]
            for k in ("schemaVersion", "displayTimeUnit", "baseTimeNanoseconds", "trace_id", "traceName")
            if k in top
        },
        "devices": len(top["deviceProperties"]) if isinstance(top.get("deviceProperties"), list) else None,
        "scan": {
            "events_total": scan.events_total,
            "events_parsed": scan.events_parsed,
            "fast_bytes": scan.fast_bytes,
            "fallbacks": scan.fallbacks,
            "decompressed_bytes": scan.decompressed_bytes,
            "nccl_kernels": len(col.kernel_cols),
            "launches": col.launch_cols.distinct(),
            "kernel_link": col.link_style,
        },
        "sized_by": {k.split(":", 1)[1]: v for k, v in sorted(gen.items()) if k.startswith("sized_by:")},
        "timeline": {
            "has_device": act.has_device,
            "intervals": result.intervals.num_rows,
            "notes": timeline_notes(result, act.has_device, bool(top.get("deviceProperties"))),
        },
    }
    return result


def _reference_rows(
    col: Collector,
    ctx: TraceContext,
    result: ParseResult,
    rank: int | None,
    process: str,
    steps: list[tuple[float, float, int]],
) -> Counter[str]:
    """The rows by the reference path: calls as objects (build_calls), one row each (call_row)."""
    gen: Counter[str] = Counter()
    calls = build_calls(col, result)
    shapes: dict[Any, Any] = {}
    seq = 0
    for i, call in enumerate(calls):
        calls[i] = None  # type: ignore[call-overload]  # each call's objects go once its row is made
        row = call_row(call, ctx, result, gen, shapes)
        if row is None:
            continue
        row.update(rank=rank, process=process, seq=seq, step=step_of(steps, call.issue_ts))
        row.update(call_times(call))
        result.events.append(row)
        seq += 1
        if len(result.events) >= ROW_BATCH:
            result.flush_events()  # rows are held as columns, not as dicts
    return gen


def _comm_spans(result: ParseResult) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) of the calls with a CPU time span (ts_us and dur_us), rows and event tables."""
    timed = [(e["ts_us"], e["dur_us"]) for e in result.events if e["ts_us"] is not None and e["dur_us"] is not None]
    pairs = np.asarray(timed, dtype=np.float64).reshape(-1, 2)
    starts, ends = [pairs[:, 0]], [pairs[:, 0] + pairs[:, 1]]
    for t in result.event_tables:
        if "ts_us" in t.column_names and "dur_us" in t.column_names:
            ts = t.column("ts_us").to_numpy(zero_copy_only=False).astype(np.float64)
            dur = t.column("dur_us").to_numpy(zero_copy_only=False).astype(np.float64)
            ok = ~(np.isnan(ts) | np.isnan(dur))
            starts.append(ts[ok])
            ends.append(ts[ok] + dur[ok])
    return np.concatenate(starts), np.concatenate(ends)


def _call_windows(result: ParseResult) -> tuple[np.ndarray, np.ndarray]:
    """(CPU op start, end of the call) of the calls with a CPU op: the end is the later of the op's end and
    the call's measured end (gloo's work on its worker threads)."""
    starts, ends = [], []
    rows = [e for e in result.events if e.get("cpu_start_us") is not None]
    if rows:
        starts.append(np.asarray([e["cpu_start_us"] for e in rows], dtype=np.float64))
        ends.append(
            np.asarray(
                [
                    max(
                        e.get("cpu_end_us") or e["cpu_start_us"],
                        (e["ts_us"] + e["dur_us"])
                        if e.get("dur_us") is not None and e.get("ts_us") is not None
                        else 0.0,
                    )
                    for e in rows
                ],
                dtype=np.float64,
            )
        )
    for t in result.event_tables:
        if "cpu_start_us" not in t.column_names:
            continue
        cs = t.column("cpu_start_us").to_numpy(zero_copy_only=False).astype(np.float64)
        ce = t.column("cpu_end_us").to_numpy(zero_copy_only=False).astype(np.float64)
        ts = t.column("ts_us").to_numpy(zero_copy_only=False).astype(np.float64)
        dur = t.column("dur_us").to_numpy(zero_copy_only=False).astype(np.float64)
        ok = ~np.isnan(cs)
        end = np.fmax(np.where(np.isnan(ce), cs, ce), ts + dur)  # fmax: a NaN call end leaves the op's
        starts.append(cs[ok])
        ends.append(end[ok])
    if not starts:
        return np.zeros(0), np.zeros(0)
    return np.concatenate(starts), np.concatenate(ends)


def read_timeline(
    stream: io.BufferedReader, name: str, hint: RankHint | None = None, limits: Limits = DEFAULT_LIMITS
) -> RankTimeline:
    """One Kineto trace (decompressed stream) as the time analysis reads it, without a store."""
    return timeline_of(parse_kineto(stream, name, hint or RankHint(), limits), name)


def _distributed_info(value: Any, result: ParseResult) -> tuple[dict[str, Any], str]:
    """distributedInfo and its generation: absent, partial, 1 (backend/rank/world_size), 2 (+pg_config), 3 (+nccl_version)."""
    if value is None:
        return {}, "absent"
    if not isinstance(value, dict):
        result.warn(f"distributedInfo is a {type(value).__name__}, not an object: ignored")
        return {}, "absent"
    missing = [k for k in ("backend", "rank", "world_size") if k not in value]
    if missing:
        result.warn(f"distributedInfo is partial: no {', '.join(missing)}")
        return value, "partial"
    if "nccl_version" in value:
        return value, "3"
    if "pg_config" in value or "pg_count" in value:
        return value, "2"
    return value, "1"


def _pg_config(value: Any, result: ParseResult) -> list[dict[str, Any]]:
    """process_groups rows from distributedInfo.pg_config (a list; ranks as a list or a string)."""
    if value is None:
        return []
    items = list(value.values()) if isinstance(value, dict) else value
    if not isinstance(items, list):
        result.warn("distributedInfo.pg_config is not a list: ignored")
        return []
    rows = []
    for i, g in enumerate(items):
        if not isinstance(g, dict) or g.get("pg_name") is None:
            result.warn(f"distributedInfo.pg_config[{i}] has no pg_name: ignored")
            continue
        ranks = parse_ranks(g.get("ranks"))
        rows.append(
            {
                "group_key": f"pg:{g['pg_name']}",
                "name": str(g["pg_name"]),
                "description": g.get("pg_desc"),
                "backend": g.get("backend_config"),
                "ranks": ranks,
                "size": as_int(g.get("pg_size")) or (len(ranks) if ranks else None),
                "origin": "pg_config",
                "uid": g.get("uid"),
            }
        )
    return rows


def _dedupe_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per group_key: pg_config first, then fields the events add."""
    out: dict[str, dict[str, Any]] = {}
    for g in groups:
        have = out.get(g["group_key"])
        if have is None:
            out[g["group_key"]] = dict(g)
        else:
            for k, v in g.items():
                if have.get(k) is None and v is not None:
                    have[k] = v
    return list(out.values())


def _generation(col: Collector, gen: Counter[str], gen_dist: str) -> dict[str, Any]:
    """Which generation of the format the file is (formats.md B.2-B.4; spellings in kineto_fields)."""
    size_field = group_field = None
    tensorlist_dims = False
    for kind, *_, a in col.cpu_cols.keys.values:  # each distinct (event, args), in order of first appearance
        size_field = size_field or spelling(a, "elems_in")
        group_field = group_field or spelling(a, "group_name") or spelling(a, "group_id")
        if not tensorlist_dims and kind == "container" and isinstance(a.get("Input type"), list):
            dims = a.get("Input Dims")
            tensorlist_dims = any(
                t == "TensorList" and isinstance(d, list) and bool(d)
                for t, d in zip(a["Input type"], dims if isinstance(dims, list) else [], strict=False)
            )
    kernel_meta = any(has(args, "collective") for _, args in col.kernel_cols.keys.values)
    if kernel_meta:
        comm = "record_param_comms+kernel"
    elif gen.get("record_param_comms"):
        comm = "record_param_comms"
    elif gen.get("sized_by:input_dims") or gen.get("sized_by:annotation_dims"):
        comm = "input_dims"
    else:
        comm = "none"
    return {
        "distributed_info": gen_dist,
        "comm_metadata": comm,
        "size_field": size_field,
        "group_field": group_field,
        "tensorlist_dims": tensorlist_dims,
    }
