"""The wanted events of a block read as columns (kineto_blocks) into the Collector's records at once.

Same answer as `Collector.add` on each event in file order (the reference, which the tests compare this
with). Events are told apart by name (each distinct name classified once), phase and category with Arrow
and numpy. CPU ops and NCCL kernels are grouped by what their records share (name, thread and the args
the parse reads, `Collector.compact`): those args are read as typed columns too, each with the type its
values had in the events read so far (a key not seen yet must be absent: pyarrow's null type refuses any
value), so each group's first event, parsed with orjson and classified by the Collector's own rules,
stands for all of its events. Steps, labels and other phases go through `Collector.add` one by one.
Where the scanner asks for it, the block's device activity is read by the scanner's own regex with its
values converted in bulk and handed to `Activity.extend` per lane. Whatever this cannot take as the event-by-event path would (a launch while the trace's link style is
still unknown, a launch outside the 'X' phase, a `null` that could be an absent key, args whose values
have no single Arrow type, numbers orjson would refuse or keep apart) declines the whole block before
anything is taken.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from itertools import islice
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from .kineto_blocks import Block, BlockReader, schema
from .kineto_events import _LAUNCH, _SHARED_ARGS, _WANTED, Collector
from .kineto_json import _ACT_ARGS, _ACT_BYTES, _ACT_DEVICE, _ACT_STREAM
from .kineto_model import COMM_KERNEL_PREFIXES_BYTES, comm_kernel
from .kineto_records import EXACT_INT, OTHER
from .kineto_timeline import _MEMCPY, COMM, COMPUTE, MEMSET, Activity

_NOT, _LAUNCHES, _OTHER = 0, 1, 2  # what a name is
_CPU, _GPU, _KERNEL = 0, 1, 2  # what a category is
_ARROW = {int: pa.int64(), str: pa.string(), bool: pa.bool_()}  # the args' value types a column holds exactly


# The scanner's device activity regex with the args that follow (kineto_json._Window._read_activity).
_ACT_WITH_ARGS = re.compile(_ACT_DEVICE.pattern + b"(?:" + _ACT_ARGS.pattern + b")?")


def _name_class(name: str | None) -> int:
    if name is None or _WANTED.match(name) is None:
        return _NOT
    return _LAUNCHES if name[0] in "ch" and _LAUNCH.match(name) else _OTHER


def _rare_name(name: str | None) -> bool:
    """Names Collector.add reads one event at a time (labels, profiler steps)."""
    return name is not None and name.startswith(("commlens:", "ProfilerStep#"))


def _cat_class(cat: str | None) -> int:
    return _KERNEL if cat == "kernel" else _GPU if (cat or "").startswith("gpu") else _CPU


def _encode(column: pa.Array) -> tuple[list[Any], np.ndarray]:
    """(distinct values, then None) and each row's index into them."""
    enc = pc.dictionary_encode(column)
    values = [*enc.dictionary.to_pylist(), None]
    idx = enc.indices
    codes = idx.to_numpy(zero_copy_only=False)
    if idx.null_count:
        codes = np.where(idx.is_valid().to_numpy(zero_copy_only=False), np.nan_to_num(codes), len(values) - 1)
    return values, codes.astype(np.int64)


def _codes(encoded: tuple[list[Any], np.ndarray], of: Callable[[Any], Any], rows: np.ndarray) -> np.ndarray:
    """of(value) at `rows`, computed once per distinct value."""
    values, codes = encoded
    return np.array([of(v) for v in values])[codes[rows]]


def _values(column: pa.Array, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(values, present) of a numeric column at rows (values of absent rows are undefined)."""
    taken = column.take(pa.array(rows))
    if taken.null_count == 0:
        return taken.to_numpy(), np.ones(len(rows), dtype=bool)
    present = taken.is_valid().to_numpy(zero_copy_only=False)
    return pc.fill_null(taken, pa.scalar(0, taken.type)).to_numpy(), present


class BulkReader:
    """The scanner's block sink (kineto_json.BlockSink) for one trace's Collector."""

    def __init__(self, col: Collector, act: Activity, max_depth: int) -> None:
        self.col = col
        self.act = act
        self.max_depth = max_depth
        self._seen = 0  # shared args (Collector.compact) whose types are counted in _types
        self._types: dict[str, set[type]] = {}
        self._options: pj.ParseOptions | None = None
        self._untyped = False  # a shared key has had values of several types (or one no column holds)
        self._reader = BlockReader()
        self._args: list[str] = []  # the shared keys read as columns, in schema order

    def _parse_options(self) -> pj.ParseOptions | None:
        """Options reading every shared key with the one type its values had so far; None when a key had
        several (or a type no column holds exactly)."""
        shared = self.col._shared
        if not self._untyped and (len(shared) > self._seen or self._options is None):
            for args in islice(shared.values(), self._seen, None):
                for k, v in args.items():
                    self._types.setdefault(k, set()).add(type(v))
            self._seen = len(shared)
            fields = []
            for k in sorted(_SHARED_ARGS):
                types = self._types.get(k, set())
                if len(types) > 1 or not types <= _ARROW.keys():
                    self._untyped, self._options = True, None  # types only grow: for the rest of the trace
                    break
                fields.append((k, _ARROW[next(iter(types))] if types else pa.null()))
            else:
                self._args = [k for k, _ in fields]
                self._options = schema(fields)
        return self._options

    def __call__(self, data: bytearray, start: int, end: int, sep: bytes, activity: bool) -> int | None:
        """Take the wanted events of the whole elements in data[start:end] (and their device activity, where
        asked); how many, or None (nothing taken)."""
        options = self._parse_options()
        if options is None or data.find(b"null", start, end) >= 0:
            return None
        block = self._reader.read(data, start, end, sep, options)
        if block is None:
            return None
        intervals = _device_activity(block) if activity else []
        if intervals is None:
            return None
        taken = self._take(block)
        if taken is not None:
            for lane in intervals:
                self.act.extend(*lane)
        return taken

    def _take(self, block: Block) -> int | None:  # noqa: C901 - one pass over the block's kinds, in the order Collector.add tells them apart
        col, t = self.col, block.table
        names, args = _encode(t.column("name").chunk(0)), block.args()
        wanted = np.flatnonzero(_codes(names, _name_class, np.arange(t.num_rows)) != _NOT)
        if not len(wanted):
            return 0
        cls = _codes(names, _name_class, wanted)
        ph_x = _codes(_encode(t.column("ph").chunk(0)), lambda v: v == "X", wanted).astype(bool)
        ts, has_ts = _values(t.column("ts").chunk(0), wanted)
        dur, has_dur = _values(t.column("dur").chunk(0), wanted)
        dur = np.where(has_dur, dur, 0.0)
        if not (np.isfinite(ts[has_ts]).all() and np.isfinite(dur).all()) or (np.abs(ts[has_ts]) >= EXACT_INT).any():
            return None  # no JSON number (orjson refuses it), or a time orjson would keep as an exact integer
        for key in ("External id", "correlation", "Seq"):
            low = pc.min(args[key]).as_py()
            if low is not None and low <= OTHER:
                return None
        if (block.nest()[wanted] > self.max_depth - 2).any():
            return None  # the event-by-event path names the place
        launch = cls == _LAUNCHES
        if (launch & ~(ph_x & has_ts)).any():
            return None  # the fast scan's launch regex takes these whatever their phase
        corr = _values(args["correlation"], wanted)
        launch_keep = launch & corr[1]
        if launch_keep.any() and col.link_style is None:
            return None  # the first launches decide how kernels link (Collector.launch), one at a time

        rare = ~(ph_x & has_ts) | _codes(names, _rare_name, wanted).astype(bool)  # through Collector.add
        cats = _encode(t.column("cat").chunk(0))
        cat = _codes(cats, _cat_class, wanted)
        nccl = _codes(names, lambda v: v is not None and comm_kernel(v), wanted).astype(bool)
        other = ~rare & (cls == _OTHER)
        kernel = other & (cat == _KERNEL) & nccl
        grouped = np.flatnonzero(kernel | (other & (cat == _CPU)))  # positions in `wanted`
        group, first = self._groups(block, names[1], wanted[grouped], kernel[grouped])

        # each group's first event and each rare event parsed (nothing is taken before all are)
        firsts = grouped[first].tolist()
        rare_pos = np.flatnonzero(rare).tolist()
        events: list[dict[str, Any]] = []
        for pos in firsts + rare_pos:
            try:
                ev = orjson.loads(block.text(int(wanted[pos])))
            except orjson.JSONDecodeError:
                return None
            if type(ev) is not dict or ev.get("name") != names[0][names[1][wanted[pos]]]:
                return None
            events.append(ev)

        # take them: what the reference counts as skipped is counted in its order
        actions: list[tuple[int, Callable[[], None]]] = [
            (pos, partial(col.add, ev)) for pos, ev in zip(rare_pos, events[len(firsts) :], strict=True)
        ]
        annot = np.flatnonzero(other & (cat == _GPU) & _codes(cats, lambda v: v == "gpu_user_annotation", wanted))
        if len(annot):
            reason = "gpu_user_annotation (the device view of a call already counted)"
            actions.append((int(annot[0]), partial(_skip, col, reason, len(annot))))
        counts = np.bincount(group, minlength=len(firsts))
        keys = np.full(len(firsts), -1, dtype=np.int64)
        for g, (pos, ev) in enumerate(zip(firsts, events, strict=False)):
            ev_args = ev.get("args")
            ev_args = ev_args if type(ev_args) is dict else {}
            if kernel[pos]:
                keys[g] = col.kernel_cols.key_of(ev["name"], col.compact(ev_args))
                continue
            what = col.cpu_kind(ev["name"], ev_args, int(counts[g]))
            if isinstance(what, str):
                actions.append((pos, partial(_skip, col, what, int(counts[g]))))
            elif what is not None:
                kind, op, backend = what
                shared = col.compact(ev_args)
                keys[g] = col.cpu_cols.key_of(kind, ev["name"], op, ev.get("pid"), ev.get("tid"), backend, shared)
        for _, act in sorted(actions, key=lambda a: a[0]):
            act()

        if launch_keep.any() and col.link_style == "correlation":
            rows = wanted[launch_keep]
            col._keep(len(rows))
            col.launch_cols.extend(_threads(col, t, rows), ts[launch_keep], corr[0][launch_keep])
        d = np.where(dur == 0, 0.0, dur)  # `as_float(dur) or 0.0`: -0.0 is 0.0
        ext, seq = _values(args["External id"], wanted), _values(args["Seq"], wanted)
        row_key = keys[group]
        for is_kernel in (False, True):
            take = (row_key >= 0) & (kernel[grouped] == is_kernel)
            if not take.any():
                continue
            pos = grouped[take]
            col._keep(len(pos))
            e, s = (ext[0][pos], ext[1][pos]), (seq[0][pos], seq[1][pos])
            if is_kernel:
                col.kernel_cols.extend(row_key[take], ts[pos], d[pos], e, (corr[0][pos], corr[1][pos]), s)
            else:
                col.cpu_cols.extend(row_key[take], ts[pos], d[pos], e, s)
        return len(wanted)

    def _groups(
        self, block: Block, name_codes: np.ndarray, rows: np.ndarray, kernel: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Each row's group (numbered in order of first appearance) and each group's first position in
        `rows`: rows of one group have the same name, thread, kind and shared args."""
        if not len(rows):
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        t, args = block.table, block.args()
        taken = pa.array(rows)
        key, radix = name_codes[rows] * 2 + kernel, (int(name_codes.max()) + 1) * 2
        wide = []  # columns past what one int64 key holds
        for column in [t.column("pid").chunk(0), t.column("tid").chunk(0)] + [args[k] for k in self._args]:
            if pa.types.is_null(column.type):
                continue
            values, codes = _encode(column.take(taken))
            if radix * len(values) < 1 << 62:
                key, radix = key * len(values) + codes, radix * len(values)
            else:
                wide.append(codes)
        if wide:
            _, inverse = np.unique(np.stack([key, *wide], axis=1), axis=0, return_inverse=True)
            key = inverse.reshape(-1)
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        order = np.argsort(first, kind="stable")  # groups numbered by first appearance
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        return rank[inverse.reshape(-1)], first[order]


def _skip(col: Collector, reason: str, n: int) -> None:
    col.skipped[reason] += n


def _threads(col: Collector, t: pa.Table, rows: np.ndarray) -> np.ndarray:
    """The launch thread (LaunchColumns.threads) of each row, numbered in order of first appearance as
    Collector.launch numbers them."""
    pid, pid_ok = _values(t.column("pid").chunk(0), rows)
    tid, tid_ok = _values(t.column("tid").chunk(0), rows)
    _, first, inverse = np.unique(
        np.stack([pid, pid_ok, tid, tid_ok], axis=1).astype(np.int64), axis=0, return_index=True, return_inverse=True
    )
    index = np.empty(len(first), dtype=np.int64)
    for g in np.argsort(first, kind="stable").tolist():
        i = int(first[g])
        thread = (int(pid[i]) if pid_ok[i] else None, int(tid[i]) if tid_ok[i] else None)
        index[g] = col.launch_cols.threads(thread, thread)
    return index[inverse.reshape(-1)]


def _device_activity(block: Block) -> list[tuple[str, int, np.ndarray, np.ndarray, np.ndarray]] | None:
    """The device intervals of a block per (kind, stream), read from its text by the scanner's own activity
    regex (kineto_json._Window._read_activity) with its values converted in bulk; None when a value does
    not fit the columns."""
    found = _ACT_WITH_ARGS.findall(block.body.data)
    if not found:
        return []
    cat, name, tid_t, ts_t, dur_t, args = zip(*found, strict=True)
    try:
        tid = np.array([int(x) for x in tid_t], dtype=np.int64)
    except OverflowError:
        return None
    ts = np.array(ts_t).astype(np.float64)
    dur = np.array(dur_t).astype(np.float64)
    streams = [_ACT_STREAM.search(a) for a in args]
    lane = np.array([int(m.group(1)) if m else t for m, t in zip(streams, tid.tolist(), strict=True)], dtype=np.int64)
    kinds: dict[tuple[bytes, bytes], str] = {}
    kind = np.array([kinds.get(k) or kinds.setdefault(k, _kind(*k)) for k in zip(cat, name, strict=True)])
    nbytes = np.zeros(len(found), dtype=np.int64)
    for i in np.flatnonzero(np.char.startswith(kind, "memcpy")).tolist():
        m = _ACT_BYTES.search(args[i])
        nbytes[i] = int(m.group(1)) if m else 0
    keep = dur >= 0
    out = []
    for k, st in sorted(set(zip(kind[keep].tolist(), lane[keep].tolist(), strict=True))):
        m = keep & (kind == k) & (lane == st)
        out.append((k, st, ts[m], ts[m] + dur[m], nbytes[m]))
    return out


def _kind(cat: bytes, name: bytes) -> str:
    """Activity.add's kind of a device event (`name`: the first bytes the regex keeps)."""
    if cat == b"kernel":
        return COMM if name.startswith(COMM_KERNEL_PREFIXES_BYTES) else COMPUTE
    if cat == b"gpu_memcpy":
        return _MEMCPY.get(name[7:11], "memcpy_dtod") if name.startswith(b"Memcpy ") else "memcpy_dtod"
    return MEMSET
