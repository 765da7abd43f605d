"""The grouping of kineto_events and the rows of kineto_calls, done on the columns of kineto_records.

Same rules, same answer as `kineto_events.build_calls` + `kineto_calls.call_row` (the reference, which
tests compare this with row for row), without an object per event or per call: calls are found by sorts
and `searchsorted` per thread, kernels joined by correlation / External id the same way, each distinct
shape of call (its events' names, kinds and shared args; its kernels') described once by the reference's
own `describe_call` on one call of that shape made as objects, and the rows built as Arrow columns whose
per-shape values are dictionary-encoded. Traces outside what this covers (gloo worker threads, commlens
labels, ids that are no plain integers, calls of many events) return None and take the reference path.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from .kineto_calls import CallFacts, call_op, describe_call, kernel_op
from .kineto_events import (
    KERNEL_BEFORE_WINDOW,
    Collector,
    _is_coalesced,
    _is_wait,
    _skip_coalesced,
    _skip_not_collective,
)
from .kineto_model import EPS, Call, Kernel, TraceContext
from .kineto_records import NONE, CpuColumns, KernelColumns
from .records import FROM_ROWS, TABLE_COLUMNS, ParseResult

_CHUNK = 1 << 20  # elements per chunk of a search whose temporaries would otherwise scale with the trace
MAX_PARTS = 16  # events (or kernels) of one call beyond which the reference path is taken
_PER_SHAPE = ("op", "dtype", "msg_bytes", "elems_in", "elems_out", "group_size", "group_key", "peer", "dur_source")


def covered(col: Collector) -> bool:
    """Whether the columnar path reads this trace (else the reference path does)."""
    return (
        not col.labels
        and col.cpu_cols.exact()
        and col.kernel_cols.exact()
        and col.launch_cols.exact()
        and not any(k[5] == "gloo" for k in col.cpu_cols.keys.values)
    )


@dataclass
class _Calls:
    """The CPU calls of the trace in the reference's thread order: member records (CPU record indices)
    ordered by call then position; per thread its calls' issue times and the number of its first call."""

    member: np.ndarray  # CPU record indices, grouped by call, in member order
    bounds: np.ndarray  # member[bounds[c]:bounds[c + 1]] are call c's
    starts: list[np.ndarray]  # per thread: issue times of its calls (sorted)
    first: list[int]  # per thread: its first call's number


def _containing(starts: np.ndarray, rstart: np.ndarray, rend: np.ndarray, t: np.ndarray) -> np.ndarray:
    """kineto_events._containing vectorised: the call (index into starts) whose root contains t, else -1.
    A chunk of t at a time: the search's temporaries would otherwise be several arrays as long as t."""
    found = np.full(len(t), -1, dtype=np.int64)
    for a in range(0, len(t), _CHUNK):
        tt, got = t[a : a + _CHUNK], found[a : a + _CHUNK]  # got: a view, filled in place
        i = np.searchsorted(starts, tt + EPS, side="right") - 1
        for off in range(4):
            j = i - off
            ok = (got < 0) & (j >= 0)
            jj = np.where(ok, j, 0)
            ok &= (rstart[jj] - EPS <= tt) & (tt <= rend[jj] + EPS) if len(rstart) else False
            got[ok] = j[ok]
    return found


def _nest(s: np.ndarray, e: np.ndarray) -> np.ndarray:
    """Call number (within the thread) of each container, given their starts and ends sorted by start,
    longest first, by _thread_calls' stack rule: an op inside the innermost open op that contains it
    joins its call."""
    reach = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > reach[:-1] + EPS
    del reach
    if new.all():  # no op starts inside an earlier one: each is a call (the usual case)
        return np.arange(len(s), dtype=np.int32)
    out = np.empty(len(s), dtype=np.int32)
    stack: list[float] = []  # ends of the open ops of the current call
    call = -1
    for i, (a, b) in enumerate(zip(s.tolist(), e.tolist(), strict=True)):
        while stack and a > stack[-1] + EPS:
            stack.pop()
        if not (stack and b <= stack[-1] + EPS):
            stack.clear()
            call += 1
        stack.append(b)
        out[i] = call
    return out


def _group_cpu(col: Collector, ts: np.ndarray, dur: np.ndarray) -> _Calls | None:
    """Calls of each thread (kineto_events._thread_calls), threads in order of first appearance."""
    cpu = col.cpu_cols
    keys = cpu.keys.values
    key = np.frombuffer(cpu.key, dtype=np.int32)
    thread_ids: dict[tuple[Any, Any], int] = {}
    key_thread = np.asarray([thread_ids.setdefault((k[3], k[4]), len(thread_ids)) for k in keys], dtype=np.int32)
    key_annot = np.asarray([k[0] == "annot" for k in keys], dtype=bool)
    rec_thread = key_thread[key] if len(key) else np.zeros(0, dtype=np.int32)
    by_thread = np.argsort(rec_thread, kind="stable").astype(np.int32) if len(thread_ids) > 1 else None
    cuts = np.searchsorted(rec_thread[by_thread], np.arange(len(thread_ids) + 1)) if by_thread is not None else None
    del rec_thread
    members: list[np.ndarray] = []
    sizes: list[np.ndarray] = []
    starts: list[np.ndarray] = []
    first: list[int] = []
    n_calls = 0
    for t in range(len(thread_ids)):  # dict order = first appearance of the thread
        if by_thread is None or cuts is None:
            idx = np.arange(len(key), dtype=np.int32)
        else:
            idx = by_thread[cuts[t] : cuts[t + 1]]
        annot = key_annot[key[idx]]
        cont, ann = idx[~annot], idx[annot]
        del idx, annot
        cont = cont[np.lexsort((-dur[cont], ts[cont]))]
        call_of = _nest(ts[cont], ts[cont] + dur[cont])
        nc = int(call_of[-1]) + 1 if len(cont) else 0
        roots = cont[np.flatnonzero(np.r_[True, call_of[1:] != call_of[:-1]])] if len(cont) else cont
        ann = ann[np.argsort(ts[ann], kind="stable")]
        rstart = ts[roots]
        into = _containing(rstart, rstart, rstart + dur[roots], ts[ann])
        del rstart
        joined = into >= 0
        alone = ann[~joined]
        # the thread's calls: container calls then lone annotations, stably sorted by issue time
        issue = np.concatenate([ts[roots], ts[alone]])
        del roots
        order = np.argsort(issue, kind="stable")
        rank_of = np.empty(len(order), dtype=np.int32)
        rank_of[order] = np.arange(len(order), dtype=np.int32)
        # members by call, each call's containers (sorted) first, then its annotations (in time order)
        m_call = np.concatenate([rank_of[call_of], rank_of[into[joined]], rank_of[nc + np.arange(len(alone))]])
        del call_of, into, rank_of
        m_rec = np.concatenate([cont, ann[joined], alone])
        del cont, ann, alone, joined
        members.append(m_rec[np.argsort(m_call, kind="stable")])
        del m_rec
        sizes.append(np.bincount(m_call, minlength=len(order)))
        del m_call
        starts.append(issue[order])
        first.append(n_calls)
        n_calls += len(order)
    size = np.concatenate(sizes) if sizes else np.zeros(0, dtype=np.int64)
    if len(size) and size.max() > MAX_PARTS:
        return None
    return _Calls(
        member=np.concatenate(members) if members else np.zeros(0, dtype=np.int32),
        bounds=np.r_[0, np.cumsum(size)],
        starts=starts,
        first=first,
    )


def _launch_index(col: Collector, kcorr: np.ndarray) -> np.ndarray:
    """For each kernel, the launch of its correlation id (the last one listed, as the reference's dict
    keeps), else -1."""
    lc = col.launch_cols
    out = np.full(len(kcorr), -1, dtype=np.int64)
    if not len(lc):
        return out
    corr = lc.corr.numpy()
    last = None  # launch of each entry of uniq; None: uniq is corr itself
    if len(corr) > 1 and not (corr[1:] > corr[:-1]).all():
        uniq, at = np.unique(corr[::-1], return_index=True)
        last = len(corr) - 1 - at
    else:  # ids rising in file order (the usual case): sorted and distinct already, no sort
        uniq = corr
    pos = np.clip(np.searchsorted(uniq, kcorr), 0, len(uniq) - 1)
    hit = (kcorr != NONE) & (uniq[pos] == kcorr)
    out[hit] = pos[hit] if last is None else last[pos[hit]]
    return out


def _calls_of_ext(ext: np.ndarray, calls: _Calls, wanted: np.ndarray) -> np.ndarray:
    """For each of the `wanted` External ids, the call of the first member (in member order) that has it,
    else -1. Only members whose id some kernel wants are sorted, not every member."""
    out = np.full(len(wanted), -1, dtype=np.int32)
    if not len(wanted):
        return out
    sought = np.unique(wanted)
    mext = ext[calls.member]
    pos = np.clip(np.searchsorted(sought, mext), 0, len(sought) - 1)
    hit = np.flatnonzero(sought[pos] == mext)  # member positions, in member order
    del pos
    uext, at = np.unique(mext[hit], return_index=True)
    del mext
    ext_call = (np.searchsorted(calls.bounds, hit[at], side="right") - 1).astype(np.int32)
    if len(uext):
        pos = np.clip(np.searchsorted(uext, wanted), 0, len(uext) - 1)
        found = uext[pos] == wanted
        out[found] = ext_call[pos[found]]
    return out


def _at(a: np.ndarray, i: np.ndarray, fill: Any = 0) -> np.ndarray:
    """a[i], or `fill` everywhere when a is empty (then i only holds placeholders)."""
    return a[i] if len(a) else np.full(len(i), fill, dtype=a.dtype)


def _call_objects(
    cpu: CpuColumns, kc: KernelColumns, member: np.ndarray, bounds: np.ndarray, korder: np.ndarray,
    kbounds: np.ndarray, c: int,
) -> Call:  # fmt: skip
    """Call c as the reference's objects."""
    mem = [cpu.record(int(i)) for i in member[bounds[c] : bounds[c + 1]]]
    return Call(mem[0], mem, [kc.record(int(i)) for i in korder[kbounds[c] : kbounds[c + 1]]], issue_ts=mem[0].ts)


def _padded(values: np.ndarray, bounds: np.ndarray, width: int) -> np.ndarray:
    """Segments values[bounds[i]:bounds[i + 1]] as the rows of a matrix, padded with -1."""
    sizes = np.diff(bounds)
    out = np.full((len(sizes), width), -1, dtype=np.int64)
    if len(values):
        pos = np.arange(len(values)) - np.repeat(bounds[:-1], sizes)
        out[np.repeat(np.arange(len(sizes)), sizes), pos] = values
    return out


def _shape_ids(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """(shape number of each segment, first segment of each shape), segments given as (values, bounds)
    pairs side by side: segment i is every pair's values[bounds[i]:bounds[i + 1]] padded with -1 to the
    pair's widest. Packed into one int64 per segment where the codes fit (built position by position,
    no padded matrix), else a unique over the padded rows."""
    n = len(parts[0][1]) - 1
    if not n:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    sizes = [np.diff(b) for _, b in parts]
    widths = [int(z.max()) for z in sizes]
    top = max((int(v.max()) for v, _ in parts if len(v)), default=-1) + 2
    bits = max(1, top.bit_length())
    if bits * sum(widths) <= 62:  # one int64 per segment: a 1-D unique
        packed = np.zeros(n, dtype=np.int64)
        for a in range(0, n, _CHUNK):  # segments a chunk at a time: the gathers' temporaries stay small
            p = packed[a : a + _CHUNK]
            for (values, bounds), size, width in zip(parts, sizes, widths, strict=True):
                starts, part_size = bounds[a : a + len(p)], size[a : a + len(p)]
                for j in range(width):
                    p <<= bits
                    has = part_size > j
                    p[has] |= values[starts[has] + j] + 1
        return _codes(packed)
    m = np.concatenate([_padded(v, b, w) for (v, b), w in zip(parts, widths, strict=True)], axis=1)
    _, first, inverse = np.unique(m, axis=0, return_index=True, return_inverse=True)
    return inverse.reshape(-1), first


def _codes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(values, return_index=True, return_inverse=True) as (inverse, first), its temporaries a
    chunk at a time: a trace's calls have few distinct shapes, so the inverse is a search among them."""
    chunks = range(0, len(values), _CHUNK)
    distinct = np.unique(np.concatenate([np.unique(values[a : a + _CHUNK]) for a in chunks] or [values[:0]]))
    inverse = np.empty(len(values), dtype=np.int32 if len(distinct) < 2**31 else np.int64)
    first = np.full(len(distinct), len(values), dtype=np.int64)
    for a in chunks:
        part = np.searchsorted(distinct, values[a : a + _CHUNK])
        inverse[a : a + len(part)] = part
        seen, at = np.unique(part, return_index=True)
        first[seen] = np.minimum(first[seen], a + at)
    return inverse, first


def _segment_first(valid: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Per segment [bounds[i], bounds[i + 1]), the first position where valid, else -1 (a search in the
    valid positions: no array of every position)."""
    at = np.flatnonzero(valid)
    j = np.searchsorted(at, bounds[:-1])
    first = at[np.minimum(j, len(at) - 1)] if len(at) else np.zeros(len(j), dtype=np.int64)
    return np.where((j < len(at)) & (first < bounds[1:]), first, -1)


def _kernel_spans(
    kts: np.ndarray, kdur: np.ndarray, kidx: np.ndarray, counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row (its kernels: kidx in segments of `counts`): first start, the reference's duration (max of
    each kernel's offset from that start plus its duration) and last end; NaN for rows without kernels."""
    n = len(counts)
    start, span, end = (np.full(n, np.nan) for _ in range(3))
    has = counts > 0
    if not has.any():
        return start, span, end
    at = (np.cumsum(counts) - counts)[has]
    t, d = kts[kidx], kdur[kidx]
    start[has] = np.minimum.reduceat(t, at)
    span[has] = np.maximum.reduceat((t - np.repeat(start, counts)) + d, at)
    end[has] = np.maximum.reduceat(t + d, at)
    return start, span, end


def _steps(steps: list[tuple[float, float, int]], ts: np.ndarray) -> np.ndarray:
    """kineto_calls.step_of vectorised; -1 for none."""
    out = np.full(len(ts), -1, dtype=np.int64)
    if not steps:
        return out
    s0 = np.asarray([s[0] for s in steps], dtype=np.float64)
    s1 = np.asarray([s[1] for s in steps], dtype=np.float64)
    n = np.asarray([s[2] for s in steps], dtype=np.int64)
    i = np.searchsorted(s0, ts + EPS, side="right") - 1
    j = np.maximum(i, 0)
    ok = (i >= 0) & (ts <= s0[j] + s1[j] + EPS)
    out[ok] = n[j[ok]]
    return out


def columnar_rows(  # noqa: C901 - one pass through the reference's steps, in its order
    col: Collector,
    ctx: TraceContext,
    result: ParseResult,
    process: str,
    steps: list[tuple[float, float, int]],
    batch: int,
    release: bool = False,
) -> Counter[str] | None:
    """Group the trace's records into calls and add their rows to `result` (tables of `batch` rows, the
    rest as dicts, as the reference flushes them); the generation tally, or None (nothing changed) when
    the trace is not `covered` or a call has more than MAX_PARTS events. `release`: drop the records'
    columns once read (Collector.release)."""
    if not covered(col):
        return None
    cpu, kc = col.cpu_cols, col.kernel_cols
    ts, dur = cpu.ts.numpy(), cpu.dur.numpy()
    calls = _group_cpu(col, ts, dur)
    if calls is None:
        return None
    kts, kdur, kext, kcorr = kc.ts.numpy(), kc.dur.numpy(), kc.ext.numpy(), kc.corr.numpy()
    kkey = np.frombuffer(kc.key, dtype=np.int32)
    n_calls = len(calls.bounds) - 1
    root = calls.member[calls.bounds[:-1]]

    # kernels -> calls (_attach_kernels): the call around the launch on its thread, else the call of the
    # kernel's External id (its first member in thread and call order)
    launch = _launch_index(col, kcorr)
    lts = col.launch_cols.ts.numpy()
    kcall = np.full(len(kts), -1, dtype=np.int32)
    if (launch >= 0).any():
        thread_no: dict[tuple[Any, Any], int] = {}
        for k in cpu.keys.values:
            thread_no.setdefault((k[3], k[4]), len(thread_no))
        lthread = np.asarray([thread_no.get(th, -1) for th in col.launch_cols.threads.values], dtype=np.int32)
        kthr = lthread[np.frombuffer(col.launch_cols.thread, dtype=np.int32)[np.maximum(launch, 0)]]
        kthr[launch < 0] = -1
        for t, first in enumerate(calls.first):
            sel = np.flatnonzero(kthr == t)
            if len(sel):
                r = root[first : first + len(calls.starts[t])]
                found = _containing(calls.starts[t], ts[r], ts[r] + dur[r], lts[launch[sel]])
                kcall[sel[found >= 0]] = first + found[found >= 0]
                del r, found
        del kthr
    want = (kcall < 0) & (kext != NONE) & (kext != kcorr)
    if want.any():
        kcall[want] = _calls_of_ext(cpu.ext.numpy(), calls, kext[want])
    del want
    korder = np.argsort(kcall, kind="stable").astype(np.int32)
    korder = korder[kcall[korder] >= 0]  # each call's kernels, in file order
    kcount = np.bincount(kcall[korder], minlength=n_calls)
    if n_calls and kcount.max() > MAX_PARTS:
        return None
    kbounds = np.r_[0, np.cumsum(kcount)]

    # the shape of each call (kineto_calls._shape): members' (kind, name, op, backend, args), kernels' (name, args)
    ref_ids: dict[Any, int] = {}
    key_ref = np.asarray(
        [ref_ids.setdefault((k[0], k[1], k[2], k[5], id(k[6])), len(ref_ids)) for k in cpu.keys.values],
        dtype=np.int32,
    )
    member_ref = key_ref[np.frombuffer(cpu.key, dtype=np.int32)[calls.member]] if len(cpu) else calls.member
    shape_of, shape_first = _shape_ids([(member_ref, calls.bounds), (kkey[korder], kbounds)])
    del member_ref

    objects = functools.partial(_call_objects, cpu, kc, calls.member, calls.bounds, korder, kbounds)

    # _sort_calls: what each shape is (0 a collective, 1 skipped with its kernels loose, 2 skipped) and skips
    n_shapes = len(shape_first)
    kind_of = np.zeros(n_shapes, dtype=np.int8)
    skips: list[list[tuple[str, int]]] = []
    for s, c in enumerate(shape_first.tolist()):
        call = objects(c)
        probe = ParseResult(kind="kineto")
        assert call.root is not None
        if _is_coalesced(call.root):
            _skip_coalesced(call, probe)
            kind_of[s] = 2
        elif _is_wait(call.root):
            probe.skip("record_param_comms 'wait'")
            kind_of[s] = 1
        elif call_op(call) is None:
            kind_of[s] = 1 if _skip_not_collective(call, call.root, probe) else 2
        skips.append(list(probe.skipped.items()))
    counts = np.bincount(shape_of, minlength=n_shapes)
    for s in np.argsort(shape_first, kind="stable").tolist():
        for reason, n in skips[s]:
            result.skip(reason, n * int(counts[s]))
    call_kind = kind_of[shape_of]

    # _kernel_calls: kernels of no call, then those of skipped calls, as calls of their own
    loose = np.concatenate([np.flatnonzero(kcall < 0), korder[np.repeat(call_kind == 1, kcount)]])
    lk = launch[loose]
    before = (lk < 0) & (col.link_style == "correlation") & bool(len(col.launch_cols))
    if col.link_style == "external_id":
        before |= (kext[loose] == NONE) | (kext[loose] == 0)
    told = np.asarray([kernel_op(Kernel(n, 0.0, 0.0, None, None, a)) is not None for n, a in kc.keys.values] or [False])
    reason = np.where(before, 1, np.where(told[kkey[loose]] if len(loose) else False, 0, 2))
    texts = {
        1: KERNEL_BEFORE_WINDOW,
        2: "NCCL kernel with no CPU call, whose name does not tell the collective (SendRecv, Generic)",
    }
    first_at = {r: int(np.argmax(reason == r)) for r in {1, 2} & set(reason.tolist())}
    for r in sorted(first_at, key=first_at.__getitem__):
        result.skip(texts[r], int((reason == r).sum()))
    alone = loose[reason == 0]
    del loose, lk, before, reason, kcall
    alone_issue = np.where(launch[alone] >= 0, _at(lts, np.maximum(launch[alone], 0), 0.0), kts[alone])
    for name, n in sorted(col.not_understood.items()):
        result.warn(f"{n} events named {name!r} look like a collective but are not understood: not counted")

    # the calls in issue order (collectives in thread order, then kernel calls; a stable sort)
    coll = np.flatnonzero(call_kind == 0)
    issue = np.concatenate([ts[root[coll]], alone_issue])
    order = np.argsort(issue, kind="stable")
    is_k = order >= len(coll)
    src = coll[np.where(is_k, 0, order)] if len(coll) else np.zeros(len(order), dtype=np.int64)
    ksrc = alone[np.where(is_k, order - len(coll), 0)] if len(alone) else np.zeros(len(order), dtype=np.int64)
    row_shape = np.where(is_k, n_shapes + _at(kkey, ksrc), _at(shape_of, src))
    issue = issue[order]
    del order, coll, alone, alone_issue, call_kind, shape_of

    # each shape described once, on its first call (call_row), in call order
    n_row_shapes = n_shapes + len(kc.keys.values)
    facts: list[CallFacts | None] = [None] * n_row_shapes
    present, first_row = np.unique(row_shape, return_index=True)
    gen: Counter[str] = Counter()
    shape_rows = np.bincount(row_shape, minlength=n_row_shapes)
    for s in present[np.argsort(first_row)].tolist():
        i = int(first_row[np.searchsorted(present, s)])
        call = objects(int(src[i])) if s < n_shapes else Call(None, [], [kc.record(int(ksrc[i]))])
        f = facts[s] = describe_call(call, ctx)
        if f is None:
            continue
        for note in f.notes:
            result.warn(note)
        if f.group is not None:
            result.groups.append(f.group)
        gen.update({k: v * int(shape_rows[s]) for k, v in f.tally.items()})
    del objects  # it holds the grouping's arrays
    ok = np.asarray([f is not None for f in facts] or [False])
    keep = ok[row_shape] if len(row_shape) else np.zeros(0, dtype=bool)
    if (~keep).any():
        result.skip("call whose collective cannot be told", int((~keep).sum()))
    if not keep.all():
        src, ksrc, is_k, row_shape, issue = src[keep], ksrc[keep], is_k[keep], row_shape[keep], issue[keep]
    del keep

    # match key (call_times): the first Seq of a record_param_comms member, else of a kernel
    rpc = np.asarray([k[1] == "record_param_comms" for k in cpu.keys.values] or [False])
    mseq = cpu.seq.numpy()[calls.member]
    mrpc = rpc[np.frombuffer(cpu.key, dtype=np.int32)[calls.member]] if len(calls.member) else np.zeros(0, dtype=bool)
    m_at = _segment_first(mrpc & (mseq != NONE), calls.bounds)
    del mrpc, calls
    kseq_sorted = kc.seq.numpy()[korder]
    k_at = _segment_first(kseq_sorted != NONE, kbounds)
    k_key = np.where(k_at >= 0, _at(kseq_sorted, np.maximum(k_at, 0), NONE), NONE)
    del kseq_sorted, k_at
    call_key = np.where(m_at >= 0, _at(mseq, np.maximum(m_at, 0), NONE), k_key)
    del mseq, m_at, k_key
    match_key = np.where(is_k, _at(kc.seq.numpy(), ksrc, NONE), _at(call_key, src, NONE))
    del call_key

    # per row: the root's CPU span, the kernels' span, the step
    croot = _at(root, src)
    del root
    k_n = np.where(is_k, 1, _at(kcount, src))
    k_first = np.where(is_k, 0, _at(kbounds[:-1], src))
    last_k = max(len(korder) - 1, 0)
    if (k_n == 1).all():  # one kernel a row (the usual case): no per-kernel segment arrays
        kidx = np.where(is_k, ksrc, _at(korder, np.minimum(k_first, last_k)))
    else:
        seg = np.repeat(np.arange(len(k_n)), k_n)
        within = np.arange(len(seg)) - np.repeat(np.cumsum(k_n) - k_n, k_n)
        kidx = np.where(is_k[seg], ksrc[seg], _at(korder, np.minimum(k_first[seg] + within, last_k)))
        del seg, within
    del k_first, korder, kbounds, kcount
    dev_start, k_span, dev_end = _kernel_spans(kts, kdur, kidx, k_n)
    has_k = k_n > 0
    del kidx, k_n, src, ksrc
    cpu_start = np.where(is_k, np.nan, _at(ts, croot, np.nan))
    cpu_dur = np.where(is_k, np.nan, _at(dur, croot, np.nan))
    cpu_end = cpu_start + cpu_dur
    del croot
    gloo = np.asarray([f is not None and f.row["dur_source"] == "cpu_op" for f in facts] or [False])[row_shape]
    ts_us = dev_start if has_k.all() else np.where(has_k, dev_start, cpu_start)
    dur_us = np.where(has_k, k_span, np.where(gloo & ~has_k, cpu_dur, np.nan))
    del cpu_dur, k_span, gloo, has_k, is_k
    if release:  # the records are no longer read: their memory goes before the rows are built
        col.release()
    _emit(result, facts, process, row_shape, issue, steps, batch,
          {"ts_us": ts_us, "dur_us": dur_us, "cpu_start_us": cpu_start, "cpu_end_us": cpu_end,
           "dev_start_us": dev_start, "dev_end_us": dev_end}, match_key)  # fmt: skip
    return gen


def _emit(
    result: ParseResult,
    facts: list[CallFacts | None],
    process: str,
    row_shape: np.ndarray,
    issue: np.ndarray,
    steps: list[tuple[float, float, int]],
    batch: int,
    times: dict[str, np.ndarray],
    match_key: np.ndarray,
) -> None:
    """The rows as Arrow columns (per-shape values dictionary-encoded), in tables of `batch` rows and the
    rest as dicts; the all_to_all rows' a2a_pairs. Each table is made from its own rows' slices of the
    numpy columns, not sliced from one table: a slice of an Arrow array pickles its whole buffers (a 4M-event
    trace's 15 tables pickled to 1.4 GB instead of 90 MB, for a parse worker or one held on disk)."""
    n = len(row_shape)
    index = row_shape.astype(np.int32)
    step = _steps(steps, issue)
    step_null, step = step < 0, step.astype(np.int32)
    shared = {id(v): v for v in times.values()}  # ts_us is often the very array dev_start_us is
    nulls = {k: np.isnan(v) for k, v in shared.items()}
    dictionaries: dict[str, pa.Array] = {}
    unfit = []  # per-shape columns with a value their Arrow type cannot hold (a count past int64)
    for c in (*_PER_SHAPE, "raw_name"):
        values = [f.row[c] if f is not None else None for f in facts]
        try:
            dictionaries[c] = pa.array(values, TABLE_COLUMNS["comm_events"][c])
        except (OverflowError, pa.ArrowInvalid):
            unfit.append(c)

    def table(a: int, b: int) -> pa.Table:
        """Rows [a, b) as one table."""
        zero = pa.array(np.zeros(b - a, dtype=np.int8))  # the index of every column that has one value

        def column(v: np.ndarray, null: np.ndarray, typ: pa.DataType) -> pa.Array:
            """v as a column (null where `null`): one shared dictionary value when all rows agree, else plain."""
            if len(v) and (null.all() or (not null.any() and (v == v[0]).all())):
                return pa.DictionaryArray.from_arrays(zero, pa.array([None if null[0] else v[0].item()], typ))
            return pa.array(v, mask=null if null.any() else None)

        rows = pa.array(index[a:b])
        cols: dict[str, pa.Array] = {
            "rank": pa.DictionaryArray.from_arrays(zero, pa.array([result.rank], pa.int32())),
            "process": pa.DictionaryArray.from_arrays(zero, pa.array([process], pa.string())),
            "seq": pa.array(np.arange(a, b, dtype=np.int64)),
            **{c: pa.DictionaryArray.from_arrays(rows, d) for c, d in dictionaries.items()},
            "step": column(step[a:b], step_null[a:b], pa.int32()),
            "match_key": column(match_key[a:b], match_key[a:b] == NONE, pa.int64()),
        }
        made = {k: column(v[a:b], nulls[k][a:b], pa.float64()) for k, v in shared.items()}
        cols |= {c: made[id(v)] for c, v in times.items()}
        names = [c for c in TABLE_COLUMNS["comm_events"] if c in cols]
        return pa.table([cols[c] for c in names], names=names).replace_schema_metadata({FROM_ROWS: b"1"})

    if unfit:  # rows as dicts, flushed as the reference flushes them: the error comes where it comes there
        for i, row in enumerate(table(0, n).to_pylist()):
            f = facts[int(row_shape[i])]
            assert f is not None
            row.update({c: f.row[c] for c in unfit})
            result.events.append(row)
            if len(result.events) >= batch:
                result.flush_events()
    else:
        full = n - n % batch
        result.event_tables += [table(i, i + batch) for i in range(0, full, batch)]
        result.events += table(full, n).to_pylist()
    pairs = [s for s, f in enumerate(facts) if f is not None and f.peer_bytes is not None]
    for seq in np.flatnonzero(np.isin(row_shape, pairs)).tolist() if pairs else []:
        pb = facts[int(row_shape[seq])].peer_bytes  # type: ignore[union-attr]
        result.a2a_pairs += [{"rank": result.rank, "seq": seq, "peer": p, "bytes": b} for p, b in enumerate(pb)]  # type: ignore[arg-type]
