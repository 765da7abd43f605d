"""NCCL debug-log ingester (NCCL_DEBUG=INFO output; docs/formats.md section A).

One file may hold one process (NCCL_DEBUG_FILE=name.%h.%p) or many processes interleaved (stdout of a
launcher). The stream is read in blocks of whole lines; lines longer than `Limits.max_line_bytes` are
skipped without being held in memory.

Speed: per-operation (COLL) lines dominate large logs. Rows come from a template cached per (envelope
with op name, "datatype .. comm .. [nranks=..]" text); only opCount, count and the sequence number vary.
A large block (`VECTOR_MIN_LINES` lines or more) is split into lines and cut at the COLL markers with
pyarrow kernels; the pieces are checked (the repeated ones once per distinct value) so that a line takes
the vectorised route only when `_FAST` would match it as a clean COLL line with these very groups; its
rows then go into an Arrow table (`ParseResult.event_tables`). Every other line (init, topology,
tuning, damaged lines), and short runs of clean COLL lines between such lines, go through the
per-line path in order (`_block_lines`), so sequence numbers, communicator instances and skips come
out exactly as line by line. A small block is matched with one compiled bytes regex that yields one
tuple per line (`_block_lines`); everything but clean COLL lines goes through the slower line-by-line
path (`_Parser.line`), which yields the same rows for COLL lines.

Damage from concurrent writers: every "host:pid:tid [dev] NCCL INFO" envelope on a line starts a
message that ends at the next envelope; a COLL message that lost its prefix is attributed through its
comm pointer when exactly one process uses it; a host name with text glued in front is matched back to
a known host. What cannot be recovered is counted in `skipped` by reason, with the first line number in
`warnings`. "#" header lines and prose without NCCL markers are ignored silently.

Process identity ("process" column): "host:pid". When one process drives several GPUs (its communicators
live on more than one CUDA device) each device is a process of its own, "host:pid/cuda:N", because each
device is a separate rank. When a paste dropped the "host:pid:tid" part ("[0] NCCL INFO ..."), the
process is "unknown/cuda:N".

Group keys written here are provisional: events get "nccl:ptr:<host:pid>:<comm>:n<nranks>" and
nccl_comms rows "nccl:<commId>" when the init line has a commId, else the same provisional key.
`ingest.nccl_link.link_run` replaces them with run-wide keys; events of communicators that no init line
describes keep the provisional key (and a NULL rank unless their process is mapped through another
communicator). A communicator pointer that is initialised again after Init COMPLETE (destroyed and
reused) gets the label "<pointer>#2", "#3"... in comm_ptr. The split counter of 2.24+ split lines
(splitCount / childCount) has no nccl_comms column; it travels in sources.meta["split_counts"].
"""

from __future__ import annotations

import io
import re
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.compute as pc

from commlens.vocab import NCCL_DTYPES, DTYPE_BYTES, msg_bytes_from_nccl_count, normalize_op

from .inputs import Limits
from .records import ParseError, ParseResult, RankHint

KIND = "nccl_log"
BLOCK_BYTES = 4 << 20
MAX_KEPT_WARN_LINES = 20
# Blocks of fewer lines, and runs of fewer clean COLL lines between other lines, take the per-line path:
# the vectorised path has a fixed cost per block and per run.
VECTOR_MIN_LINES = 4096
VECTOR_MIN_RUN = 256
VECTOR_PAUSE_BLOCKS = 4  # blocks parsed line by line after one that was mostly other lines

# NCCL COLL names that are not two-sided collectives commlens counts (one-sided ops, 2.29+).
ONE_SIDED = frozenset({"PutSignal", "Signal", "WaitSignal"})

ALGOS = {0: "TREE", 1: "RING", 2: "COLLNET_DIRECT", 3: "COLLNET_CHAIN", 4: "NVLS", 5: "NVLS_TREE", 6: "PAT"}
PROTOS = {0: "LL", 1: "LL128", 2: "SIMPLE"}
_ALGO_NAMES = {
    "tree": "TREE", "ring": "RING", "collnet": "COLLNET_DIRECT", "collnetdirect": "COLLNET_DIRECT",
    "collnetchain": "COLLNET_CHAIN", "nvls": "NVLS", "nvlstree": "NVLS_TREE", "pat": "PAT",
}
_PROTO_NAMES = {"ll": "LL", "ll128": "LL128", "simple": "SIMPLE"}

# ------------------------------------------------------------------------------------------ patterns

# Every pattern used with search/finditer starts with a literal or a lookbehind that fails inside a run of
# its first character class, so scanning a long line stays linear.

# Fast path over a block of lines: either a clean COLL line (foreign prefix allowed) or any line.
# Groups: prefix, "host:pid:tid [dev] NCCL INFO Name", opCount, count, "dt op r root p comm c [nranks=n]",
# trailing text, other line. The lookbehind keeps the scan linear on long words.
_FAST = re.compile(
    rb"(?m)^(?:([^\n]*?)(?<![\w.-])([\w.-]+:\d+:\d+ \[-?\d+\] NCCL INFO [A-Za-z]+): opCount ([0-9a-fA-F]+) "
    rb"sendbuff \S+ recvbuff \S+ count (\d+) datatype (\d+ op \d+ root -?\d+ comm \S+ \[nranks=\d+\]) "
    rb"stream \S+([^\n]*)|([^\n]*))$"
)
_FAST_HEAD = re.compile(r"(.+):(\d+):\d+ \[(-?\d+)\] NCCL INFO ([A-Za-z]+)")
_FAST_TAIL = re.compile(r"(\d+) op (\d+) root (-?\d+) comm (\S+) \[nranks=(\d+)\]", re.ASCII)
# The pieces of a COLL line between the markers ": opCount ", " ", " count ", " " (vectorised path); each
# fullmatch below is the corresponding part of `_FAST`, so that the pieces of a line all match exactly
# when `_FAST` matches the line as a COLL line, with the same groups (see `_clean_coll`).
_PIECE_HEAD = re.compile(rb"([^\n]*?)(?<![\w.-])([\w.-]+:\d+:\d+ \[-?\d+\] NCCL INFO [A-Za-z]+)")
_PIECE_BUFFERS = re.compile(rb"sendbuff \S+ recvbuff \S+")
_PIECE_TAIL = re.compile(rb"datatype (\d+ op \d+ root -?\d+ comm \S+ \[nranks=\d+\]) stream \S+([^\n]*)")

_ENVELOPE = re.compile(r"(?<![\w.-])([\w.-]+):(\d+):(\d+) \[(-?\d+)\] (?:\S+:\d+ )?NCCL (INFO|WARN)(?= |$) ?")
_FALLBACK = re.compile(r"\[(-?\d+)\] (?:\S+:\d+ )?NCCL (INFO|WARN)(?= |$) ?")
_COLL = re.compile(
    r"(?<![A-Za-z])([A-Za-z]+): opCount ([0-9a-fA-F]+) sendbuff \S+ recvbuff \S+ count (\d+) datatype (\d+) op (\d+) "
    r"root (-?\d+) comm (\S+) \[nranks=(\d+)\] stream \S+"
)
_COLL_HEAD = re.compile(r"(?<![A-Za-z])[A-Za-z]+: opCount ")
_VERSION = re.compile(r"\b([NR]CCL) version (\d+\.\d+\.\d+[^\s+]*)(?:\+(\S+))?")
_BARE_VERSION = re.compile(r"(?:^|[\s>\]):])([NR]CCL) version (\d+\.\d+\.\d+[^\s+]*)(?:\+(\S+))?\s*$")
_DRIVER = re.compile(r"cudaDriverVersion (\d+)")
_INIT = re.compile(
    r"(?:\[Rank -?\d+\] )?(?:(\w+) )?comm (\S+) rank (-?\d+) nranks (\d+)((?: \S+ \S+)*?) - Init (START|COMPLETE)\s*$"
)
_NODES = re.compile(
    r"comm (\S+) rank (-?\d+) nRanks (\d+) nNodes (\d+) localRanks (\d+) localRank (-?\d+)(?: MNNVL (\d+))?"
)
_RING = re.compile(r"Channel (\d+)/(\d+) :((?: +-?\d+)*)\s*$")
_CONNECTION = re.compile(
    r"Channel (\d+)(?:/(\d+))? : (-?\d+)\[([0-9a-fA-F]+)\] -> (-?\d+)\[([0-9a-fA-F]+)\]"
    r"(?: \[(send|receive)\])? via (.+?)\s*$"
)
_CONN_COMM = re.compile(r" comm (0x[0-9a-fA-F]+) nRanks (\d+)$")
_TREE_CHANNEL = re.compile(r"\[(\d+)\] (-?\d+)/(-?\d+)/(-?\d+)->(-?\d+)->(-?\d+)(\|\S+)?")
_NVLS_TREE = re.compile(r"(?<![\d-])(-?\d+)/(-?\d+)/(-?\d+)->(-?\d+)->(-?\d+)")
_NVLS_HEAD = re.compile(r"NVLS Head +(\d+):((?: +-?\d+)*)\s*$")
_CHANNELS = re.compile(
    r"(\d+) coll channels, (?:(\d+) collnet channels, )?(?:(\d+) nvls channels, )?(\d+) p2p channels, "
    r"(\d+) p2p channels per peer"
)
_TUNING = re.compile(
    r"(?:([A-Za-z]+): )?(\d+) Bytes -> Algo (\w+) proto (\w+)"
    r"(?: time (\S+))?(?: channel\{Lo\.\.Hi\}=\{(-?\d+)\.\.(-?\d+)\})?"
)


# ------------------------------------------------------------------------------------------- state


@dataclass
class _Proc:
    """One process (or, for pastes without host:pid, one device of an unknown process)."""

    key: tuple
    host: str | None
    pid: int | None
    dev_hint: int | None  # device of an unknown process
    seq: list[int] = field(default_factory=lambda: [0])
    comm_devs: dict[str, int] = field(default_factory=dict)  # comm label -> CUDA device
    comms: dict[str, dict[str, Any]] = field(default_factory=dict)  # raw pointer -> current nccl_comms row
    instances: dict[str, int] = field(default_factory=dict)  # raw pointer -> instances seen
    version: str | None = None

    @property
    def base(self) -> str:
        return f"{self.host}:{self.pid}" if self.host is not None else f"unknown/cuda:{self.dev_hint}"

    def label(self, dev: int | None, multi: bool) -> str:
        if self.host is None or not multi or dev is None:
            return self.base
        return f"{self.base}/cuda:{dev}"


@dataclass
class _Thread:
    """Per-thread init context: topology lines belong to the communicator being initialised."""

    comm: str | None = None  # comm label of an open Init START / nRanks line
    pending: list[dict[str, Any]] = field(default_factory=list)  # rows waiting for an Init COMPLETE


class _Parser:
    def __init__(self, name: str, hint: RankHint):
        self.name = name
        self.hint = hint
        self.res = ParseResult(kind=KIND)
        self.procs: dict[tuple, _Proc] = {}
        self.threads: dict[tuple, _Thread] = {}
        self.fast_cache: dict[tuple, tuple] = {}
        self.slow_cache: dict[tuple, tuple] = {}
        self.versions: dict[str, None] = {}  # in order of appearance
        self.cuda: str | None = None
        self.library: str | None = None
        self.nccl_lines = 0
        self.warn_lines = 0
        self.warn_texts: list[str] = []
        self.max_nranks = 0
        self.comm_owner: dict[str, set[tuple]] = {}  # raw comm pointer -> process keys using it
        self.first_skip_line: dict[str, int] = {}
        self.vector_pause = 0  # blocks left to parse line by line after one that was mostly not clean COLL
        self.counting = pa.array([], pa.int64())

    # ------------------------------------------------------------------ bookkeeping

    def skip(self, reason: str, line_no: int, n: int = 1) -> None:
        self.res.skip(reason, n)
        if reason not in self.first_skip_line:
            self.first_skip_line[reason] = line_no

    def arange(self, n: int) -> pa.Array:
        """0 .. n-1 as int64 (cached)."""
        if len(self.counting) < n:
            self.counting = pa.array(range(max(n, 2 * len(self.counting))), pa.int64())
        return self.counting.slice(0, n)

    def proc(self, host: str | None, pid: str | None, dev: int) -> _Proc:
        if host is not None and (host, pid) not in self.procs:
            host = self.glued_host(host, pid)
        key = (host, pid) if host is not None else (None, dev)
        p = self.procs.get(key)
        if p is None:
            p = self.procs[key] = _Proc(key, host, int(pid) if pid is not None else None, None if host else dev)
        return p

    def glued_host(self, host: str, pid: str | None) -> str:
        """A host name with another writer's text glued in front ("Usinghost1") becomes the known
        host it ends with, when exactly one known process of that pid matches."""
        known = {h for h, p in self.procs if h is not None and p == pid and h != host and host.endswith(h)}
        return known.pop() if len(known) == 1 else host

    def thread(self, host: str | None, pid: str | None, tid: str | None, dev: int) -> _Thread:
        if host is not None and (host, pid) not in self.procs:
            host = self.glued_host(host, pid)
        key = (host, pid, tid, dev if host is None else None)
        t = self.threads.get(key)
        if t is None:
            t = self.threads[key] = _Thread()
        return t

    # ------------------------------------------------------------------ COLL rows

    def template(
        self, p: _Proc, dev: int, name: str, dt: int, root: int, ptr: str, nranks: int, line_no: int
    ) -> tuple:
        """(row template, bytes per count, elems_in factor, elems_out factor, seq cell); a template
        without row (see `_skip_template`) makes lines skipped with its reason."""
        op = normalize_op(name)
        if name in ONE_SIDED:
            return _skip_template(f"one-sided {name} operation, not a collective (not counted)")
        if op is None or op == "barrier":
            return _skip_template(f"unknown COLL operation name {name!r}")
        comm = p.comms.get(ptr)
        label = comm["comm_ptr"] if comm is not None else ptr
        p.comm_devs.setdefault(label, comm["cuda_dev"] if comm is not None and comm["cuda_dev"] is not None else dev)
        self.comm_owner.setdefault(ptr, set()).add(p.key)
        self.max_nranks = max(self.max_nranks, nranks)
        dtype = NCCL_DTYPES.get(dt)
        if dtype is None:
            self.res.warn(f"{self.name}:line {line_no}: unknown NCCL datatype {dt}: dtype and msg_bytes left NULL")
            per_count = None
        else:
            per_count = msg_bytes_from_nccl_count(op, 1, DTYPE_BYTES[dtype], nranks)
        f_in, f_out = _elem_factors(op, nranks)
        row: dict[str, Any] = {
            "process": p.base,
            "seq": 0,
            "op": op,
            "dtype": dtype,
            "msg_bytes": None,
            "elems_in": 0,
            "elems_out": 0,
            "group_size": nranks,
            "group_key": provisional_key(p.base, label, nranks),
            "op_count": 0,
            "comm_ptr": label,
            "raw_name": name,
        }
        if op in ("send", "recv"):
            row["peer"] = root
        return (row, per_count, f_in, f_out, p.seq)

    def coll(self, host: str | None, pid: str | None, dev: int, m: re.Match, line_no: int) -> None:
        """A COLL message found by the line-by-line path (same rows as the fast path)."""
        name, opc, count, dt, _redop, root, ptr, nranks = m.groups()
        p = self.proc(host, pid, dev)
        key = (p.base, dev, name, dt, root, ptr, nranks)
        t = self.slow_cache.get(key)
        if t is None:
            t = self.slow_cache[key] = self.template(p, dev, name, int(dt), int(root), ptr, int(nranks), line_no)
        self.emit(t, opc, count, line_no)

    def emit(self, t: tuple, opc: str | bytes, count: str | bytes, line_no: int) -> None:
        row, per_count, f_in, f_out, seq = t
        if row is None:
            self.skip(per_count, line_no)
            return
        n = int(count)
        d = row.copy()
        s = seq[0]
        seq[0] = s + 1
        d["seq"] = s
        d["op_count"] = int(opc, 16)
        if per_count is not None:
            d["msg_bytes"] = n * per_count
        d["elems_in"] = n * f_in
        d["elems_out"] = n * f_out
        self.res.events.append(d)

    # ------------------------------------------------------------------ blocks (fast paths)

    def block(self, data: bytes, first_line: int) -> int:
        """A block of whole lines (without the last newline) whose first line is `first_line`; returns
        the number of its lines."""
        if self.vector_pause or len(data) < VECTOR_MIN_LINES * 32:
            self.vector_pause = max(0, self.vector_pause - 1)
            return self._block_lines(data, first_line)
        return self._block_vector(data, first_line)

    def _block_vector(self, data: bytes, first_line: int) -> int:
        """Clean COLL lines in runs through pyarrow kernels, everything else through `_block_lines`, in
        line order: a run of clean COLL lines between two other lines only needs the state those lines left."""
        typ = pa.binary() if len(data) < 2**31 - 1 else pa.large_binary()
        ends = pa.array([0, len(data)], pa.int32() if typ == pa.binary() else pa.int64())
        whole = pa.Array.from_buffers(typ, 1, [None, ends.buffers()[1], pa.py_buffer(data)])  # no copy
        lines = pc.split_pattern(whole, b"\n").flatten()
        n = len(lines)
        clean = _clean_coll(lines, self.arange(n)) if n >= VECTOR_MIN_LINES else None
        if clean is None:
            self.vector_pause = VECTOR_PAUSE_BLOCKS
            return self._block_lines(data, first_line)
        nv = len(clean.line)
        others: list[int] = []  # lines that are not clean COLL lines but mention NCCL: line by line
        if nv < n:
            rest = pc.indices_nonzero(pc.invert(pc.is_in(self.arange(n), value_set=clean.line)))
            texts = lines.take(rest).to_pylist()
            others = [i for i, t in zip(rest.to_pylist(), texts) if b"CCL" in t or b"opCount" in t]
        vlines = clean.line.to_pylist() if others else None

        def v_line(p: int) -> int:
            return vlines[p] if vlines is not None else clean.line[p].as_py()

        # Runs of clean lines long enough for the vectorised path; everything between them line by line.
        parts: list[tuple[bool, int, int]] = []  # (vectorised, start, end): positions in clean, else lines
        py_start: int | None = None
        pv = 0
        for s in others + [n]:
            pe = bisect_left(vlines, s) if vlines is not None else nv
            if pe - pv >= VECTOR_MIN_RUN:
                if py_start is not None:
                    parts.append((False, py_start, v_line(pv)))
                parts.append((True, pv, pe))
                py_start = s if s < n else None
            elif py_start is None and (pe > pv or s < n):
                py_start = v_line(pv) if pe > pv else s
            pv = pe
        if py_start is not None:
            parts.append((False, py_start, n))

        offsets = pa.Array.from_buffers(  # where each line starts in the buffer of all lines
            pa.int32() if typ == pa.binary() else pa.int64(), n + 1, [None, lines.buffers()[1]], offset=lines.offset
        )
        base = offsets[0].as_py()
        by_line = 0
        for vectorised, a, b in parts:
            if vectorised:
                self._emit_run(clean, a, b, first_line)
            else:
                by_line += b - a
                start = offsets[a].as_py() - base + a
                end = offsets[b].as_py() - base + b - 1
                self._block_lines(data[start:end], first_line + a)
        if by_line * 2 > n:
            self.vector_pause = VECTOR_PAUSE_BLOCKS
        return n

    def _emit_run(self, clean: "_CleanColl", p0: int, p1: int, first_line: int) -> None:
        """Rows of the clean COLL lines p0..p1-1 of `clean` as one Arrow table, exactly as `_block_lines`
        would make them one by one."""
        n = p1 - p0
        enc = pc.dictionary_encode(clean.key.slice(p0, n))
        ind = enc.indices
        templates = []
        for u, key in enumerate(enc.dictionary.to_pylist()):  # in order of first appearance
            head, tail = clean.heads[key // clean.n_tails], clean.tails[key % clean.n_tails]
            t = self.fast_cache.get((head, tail))
            if t is None:
                line_no = first_line + clean.line[p0 + pc.index(ind, u).as_py()].as_py()
                t = self.fast_cache[(head, tail)] = self.fast_template(head, tail, line_no)
            templates.append(t)
        self.nccl_lines += n
        opc = clean.op_count.slice(p0, n)
        count = clean.count.slice(p0, n)
        if any(t[0] is None for t in templates):
            vc = pc.value_counts(ind)
            counts = dict(zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist()))
            for u, t in enumerate(templates):
                if t[0] is None:
                    line_no = first_line + clean.line[p0 + pc.index(ind, u).as_py()].as_py()
                    self.skip(t[1], line_no, counts[u])
            keep = pc.take(pa.array([t[0] is not None for t in templates]), ind)
            ind, opc, count = ind.filter(keep), opc.filter(keep), count.filter(keep)
            if not len(ind):
                return
        rows = [t[0] or {} for t in templates]
        cells: list[list[int]] = []  # the processes' sequence counters
        cell_ids: list[int] = []
        for t in templates:
            c = next((i for i, cell in enumerate(cells) if cell is t[4]), None) if t[4] is not None else 0
            if c is None:
                c = len(cells)
                cells.append(t[4])
            cell_ids.append(c)
        m = len(ind)
        if len(cells) == 1:
            seq = pc.add(self.arange(m), cells[0][0])
            cells[0][0] += m
        else:
            seq = self._seq(pc.take(pa.array(cell_ids, pa.int32()), ind), cells)

        def dict_col(k: str) -> pa.Array:
            return pa.DictionaryArray.from_arrays(ind, pa.array([r.get(k, "") for r in rows], pa.string()))

        def col(values: list, typ: pa.DataType) -> pa.Array:
            return pc.take(pa.array(values, typ), ind)

        self.res.event_tables.append(pa.table({
            "process": dict_col("process"),
            "seq": seq,
            "op": dict_col("op"),
            "dtype": col([r.get("dtype") for r in rows], pa.string()),
            "msg_bytes": pc.multiply_checked(count, col([t[1] if t[0] else None for t in templates], pa.int64())),
            "elems_in": pc.multiply_checked(count, col([t[2] for t in templates], pa.int64())),
            "elems_out": pc.multiply_checked(count, col([t[3] for t in templates], pa.int64())),
            "group_size": col([r.get("group_size") for r in rows], pa.int32()),
            "group_key": dict_col("group_key"),
            "peer": col([r.get("peer") for r in rows], pa.int32()),
            "op_count": opc,
            "comm_ptr": dict_col("comm_ptr"),
            "raw_name": dict_col("raw_name"),
        }))

    def _seq(self, cell: pa.Array, cells: list[list[int]]) -> pa.Array:
        """Sequence numbers of rows whose process counter is cells[cell]: each counter counts on in row order."""
        m = len(cell)
        order = pc.sort_indices(cell)  # stable: row order within a counter
        in_order = pc.take(cell, order)
        vc = pc.value_counts(cell)
        counts = dict(zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist()))
        starts, first = [], 0
        for c in range(len(cells)):
            starts.append(cells[c][0] - first)  # seq = position in sorted order - first + counter
            first += counts.get(c, 0)
            cells[c][0] += counts.get(c, 0)
        ranked = pc.add(self.arange(m), pc.take(pa.array(starts, pa.int64()), in_order))
        return pc.take(ranked, pc.sort_indices(order))

    def _block_lines(self, data: bytes, first_line: int) -> int:
        """`block` line by line: one `_FAST` match per line."""
        cache = self.fast_cache
        append = self.res.events.append
        n_coll = 0
        matches = _FAST.findall(data)
        for line_no, (pre, head, opc, count, tail, post, other) in enumerate(matches, first_line):
            if head:
                if pre and (b"NCCL" in pre or b"opCount" in pre):
                    self.fragment(pre, line_no)
                t = cache.get((head, tail))
                if t is None:
                    t = cache[(head, tail)] = self.fast_template(head, tail, line_no)
                row, per_count, f_in, f_out, seq = t
                if row is None:
                    self.skip(per_count, line_no)
                else:
                    n = int(count)
                    d = row.copy()
                    s = seq[0]
                    seq[0] = s + 1
                    d["seq"] = s
                    d["op_count"] = int(opc, 16)
                    if per_count is not None:
                        d["msg_bytes"] = n * per_count
                    d["elems_in"] = n * f_in
                    d["elems_out"] = n * f_out
                    append(d)
                n_coll += 1
                if post and b"NCCL" in post:
                    self.fragment(post, line_no)
            elif other and (b"CCL" in other or b"opCount" in other):
                self.line(other.decode("utf-8", "replace"), line_no)
        self.nccl_lines += n_coll
        return len(matches)

    def fast_template(self, head: bytes, tail: bytes, line_no: int) -> tuple:
        h = _FAST_HEAD.fullmatch(head.decode("utf-8", "replace"))
        m = _FAST_TAIL.fullmatch(tail.decode("utf-8", "replace"))
        if h is None or m is None:  # bytes that are not UTF-8 text
            return _skip_template("COLL line cut or garbled")
        host, pid, dev, name = h.groups()
        dt, _redop, root, ptr, nranks = m.groups()
        p = self.proc(host, pid, int(dev))
        return self.template(p, int(dev), name, int(dt), int(root), ptr, int(nranks), line_no)

    def fragment(self, piece: bytes, line_no: int) -> None:
        """Text glued before or after a COLL line by another writer."""
        text = piece.decode("utf-8", "replace").strip()
        if text:
            self.line(text, line_no, fragment=True)

    # ------------------------------------------------------------------ lines (slow path)

    def line(self, text: str, line_no: int, fragment: bool = False) -> None:
        text = text.rstrip()
        if not text or text.startswith("#"):
            return
        envs = list(_ENVELOPE.finditer(text))
        if envs:
            head = text[: envs[0].start()]
            if "NCCL INFO" in head or _COLL_HEAD.search(head):
                self.headless(head, line_no)
            for i, m in enumerate(envs):
                end = envs[i + 1].start() if i + 1 < len(envs) else len(text)
                host, pid, tid, dev, level = m.groups()
                cut = i + 1 < len(envs) or fragment
                self.message(text[m.end() : end].rstrip(), host, pid, tid, int(dev), level, line_no, cut)
            return
        self.headless(text, line_no, fragment)

    def headless(self, text: str, line_no: int, fragment: bool = False) -> None:
        """A line (or piece) without a full host:pid:tid [dev] envelope."""
        fb = _FALLBACK.search(text)
        if fb is not None:
            head = text[: fb.start()]
            if _COLL_HEAD.search(head):
                self.orphan_coll(head, line_no)
            dev, level = fb.groups()
            self.message(text[fb.end() :].rstrip(), None, None, None, int(dev), level, line_no, fragment)
            return
        v = _BARE_VERSION.search(text)
        if v is not None and "NCCL INFO" not in text:
            self.version(v, None)
            return
        if "NCCL INFO" in text or "NCCL WARN" in text:
            if not self.orphan_coll(text, line_no):
                self.skip("NCCL INFO line without a '[dev] NCCL INFO' prefix (garbled)", line_no)
            return
        if _COLL_HEAD.search(text):
            self.orphan_coll(text, line_no)
        # anything else is prose around the log (launcher output, comments): ignored silently

    def orphan_coll(self, text: str, line_no: int) -> bool:
        """A COLL message whose prefix was lost: attributed through its comm pointer when that is unique."""
        m = _COLL.search(text)
        if m is None:
            if _COLL_HEAD.search(text):
                self.skip("COLL line cut or garbled", line_no)
                return True
            return False
        owners = self.comm_owner.get(m.group(7), set())
        if len(owners) != 1:
            self.skip("COLL line without its host:pid:tid [dev] prefix (comm pointer not seen elsewhere)", line_no)
            return True
        p = self.procs[next(iter(owners))]
        ptr = m.group(7)
        label = p.comms[ptr]["comm_ptr"] if ptr in p.comms else ptr
        dev = p.comm_devs.get(label, p.dev_hint if p.dev_hint is not None else 0)
        self.coll(p.host, p.key[1] if p.host is not None else None, dev, m, line_no)
        self.res.warn(f"{self.name}:line {line_no}: COLL line without its prefix attributed by comm pointer")
        return True

    def message(
        self, msg: str, host: str | None, pid: str | None, tid: str | None, dev: int, level: str,
        line_no: int, cut: bool,
    ) -> None:
        self.nccl_lines += 1
        if host is not None and (host, pid) not in self.procs:
            host = self.glued_host(host, pid)
        if level == "WARN":
            self.warn_lines += 1
            if len(self.warn_texts) < MAX_KEPT_WARN_LINES:
                self.warn_texts.append(msg)
            return
        m = _COLL.match(msg)
        if m is not None:
            self.coll(host, pid, dev, m, line_no)
            return
        if _COLL_HEAD.match(msg):
            self.skip("COLL line cut or garbled", line_no)
            return
        if self.init_message(msg, host, pid, tid, dev, line_no):
            return
        if cut:
            self.skip("message cut by another writer's output", line_no)

    def init_message(
        self, msg: str, host: str | None, pid: str | None, tid: str | None, dev: int, line_no: int
    ) -> bool:
        """Version, communicator, topology and tuning lines; False when the message is none of these."""
        c = msg[:1]
        if c == "N" and ("NCCL version" in msg or "NVLS" in msg):
            v = _VERSION.search(msg)
            if v is not None:
                self.version(v, self.proc(host, pid, dev))
                return True
            if msg.startswith("NVLS Trees"):
                self.nvls_trees(msg, host, pid, tid, dev)
                return True
            h = _NVLS_HEAD.match(msg)
            if h is not None:
                ranks = [int(x) for x in h.group(2).split()]
                self.topo(host, pid, tid, dev, "nvls_head", msg, channel=int(h.group(1)), ranks=ranks)
                return True
            return False
        if c == "R" and msg.startswith("RCCL version"):
            v = _VERSION.search(msg)
            if v is not None:
                self.version(v, self.proc(host, pid, dev))
                return True
        if c == "c":
            d = _DRIVER.match(msg)
            if d is not None:
                self.res.meta["cuda_driver_version"] = int(d.group(1))
                return True
            n = _NODES.match(msg)
            if n is not None:
                self.nodes(n, msg, host, pid, tid, dev)
                return True
        if " - Init " in msg:
            i = _INIT.match(msg)
            if i is not None:
                self.init(i, host, pid, tid, dev, line_no)
                return True
            return False
        if c == "C" and msg.startswith("Channel "):
            return self.channel(msg, host, pid, tid, dev)
        if c == "T" and msg.startswith("Trees"):
            for t in _TREE_CHANNEL.finditer(msg):
                ranks = [int(t.group(k)) for k in (2, 3, 4, 5, 6)]
                self.topo(host, pid, tid, dev, "tree", t.group(0), channel=int(t.group(1)), ranks=ranks)
            return True
        if " Bytes -> Algo " in msg:
            t = _TUNING.match(msg)
            if t is not None:
                self.tuning(t, host, pid)
                return True
        if " coll channels, " in msg:
            if _CHANNELS.match(msg):
                self.topo(host, pid, tid, dev, "channels", msg)
                return True
        return False

    # ------------------------------------------------------------------ init lines

    def version(self, v: re.Match, p: _Proc | None) -> None:
        lib, ver, build = v.groups()
        self.library = lib.lower()
        if build and build.startswith("cuda"):
            self.cuda = build[4:]
        if p is not None:
            p.version = p.version or ver
        self.versions.setdefault(ver)

    def comm_row(self, p: _Proc, ptr: str, opening: bool, closing: bool) -> dict[str, Any]:
        """The nccl_comms row of pointer `ptr` in process p; a new instance when the pointer is reused."""
        row = p.comms.get(ptr)
        if row is not None and not row["_complete"]:
            return row
        if row is not None and not (opening or closing):
            return row
        n = p.instances.get(ptr, 0) + 1
        p.instances[ptr] = n
        label = ptr if n == 1 else f"{ptr}#{n}"
        row = {
            "group_key": None, "host": p.host, "pid": p.pid, "cuda_dev": None, "comm_ptr": label,
            "comm_rank": None, "nranks": None, "global_rank": None, "comm_id": None, "parent_ptr": None,
            "color": None, "split_key": None, "bus_id": None, "nvml_dev": None, "api": None,
            "nccl_version": None, "_complete": False, "_proc": p.key,
        }
        p.comms[ptr] = row
        self.res.nccl_comms.append(row)
        if n > 1:  # cached COLL templates point at the previous instance
            self.fast_cache.clear()
            self.slow_cache.clear()
        return row

    def init(self, m: re.Match, host: str | None, pid: str | None, tid: str | None, dev: int, line_no: int) -> None:
        api, ptr, rank, nranks, rest, phase = m.groups()
        p = self.proc(host, pid, dev)
        row = self.comm_row(p, ptr, opening=phase == "START", closing=phase == "COMPLETE")
        row["comm_rank"] = int(rank)
        row["nranks"] = int(nranks)
        row["api"] = api or row["api"]
        toks = rest.split()
        for k, v in zip(toks[::2], toks[1::2]):
            try:
                if k == "cudaDev":
                    row["cuda_dev"] = int(v)
                elif k == "nvmlDev":
                    row["nvml_dev"] = int(v)
                elif k == "busId":
                    row["bus_id"] = v.lower()
                elif k == "commId":
                    if int(v, 16) != 0:
                        row["comm_id"] = v.lower()
                elif k == "parent":
                    row["parent_ptr"] = v
                elif k == "color":
                    row["color"] = int(v)
                elif k == "key":
                    row["split_key"] = int(v)
                elif k in ("splitCount", "childCount"):
                    row["_split_count"] = int(v)
            except ValueError:
                self.res.warn(f"{self.name}:line {line_no}: unreadable {k} {v!r} in an Init line")
        if row["cuda_dev"] is None:
            row["cuda_dev"] = dev
        p.comm_devs[row["comm_ptr"]] = row["cuda_dev"]
        self.max_nranks = max(self.max_nranks, row["nranks"])
        self.comm_owner.setdefault(ptr, set()).add(p.key)
        th = self.thread(host, pid, tid, dev)
        if phase == "START":
            th.comm = row["comm_ptr"]
            for r in th.pending:  # topology printed before this START belongs to no known communicator
                r["comm_ptr"] = None
            th.pending = []
        else:
            row["_complete"] = True
            for r in th.pending:
                r["comm_ptr"] = row["comm_ptr"]
            th.pending = []
            th.comm = None

    def nodes(self, m: re.Match, msg: str, host: str | None, pid: str | None, tid: str | None, dev: int) -> None:
        ptr, rank, nranks = m.group(1), int(m.group(2)), int(m.group(3))
        p = self.proc(host, pid, dev)
        row = self.comm_row(p, ptr, opening=True, closing=False)
        if row["comm_rank"] is None:
            row["comm_rank"], row["nranks"] = rank, nranks
        if row["cuda_dev"] is None:
            row["cuda_dev"] = dev
        p.comm_devs.setdefault(row["comm_ptr"], row["cuda_dev"])
        self.max_nranks = max(self.max_nranks, nranks)
        self.comm_owner.setdefault(ptr, set()).add(p.key)
        th = self.thread(host, pid, tid, dev)
        th.comm = row["comm_ptr"]
        detail = msg[m.end(3) + 1 :].strip()
        self.res.topology.append(_topo_row(p, row["comm_ptr"], "nodes", detail, src_rank=rank))

    # ------------------------------------------------------------------ topology and tuning

    def topo(
        self, host: str | None, pid: str | None, tid: str | None, dev: int, kind: str, detail: str,
        channel: int | None = None, ranks: list[int] | None = None, src: int | None = None,
        dst: int | None = None, transport: str | None = None, comm: str | None = None,
    ) -> None:
        p = self.proc(host, pid, dev)
        th = self.thread(host, pid, tid, dev)
        row = _topo_row(p, comm or th.comm, kind, detail, channel, ranks, src, dst, transport)
        if row["comm_ptr"] is None:
            th.pending.append(row)
        self.res.topology.append(row)

    def channel(self, msg: str, host: str | None, pid: str | None, tid: str | None, dev: int) -> bool:
        if "->" not in msg:
            r = _RING.match(msg)
            if r is None:
                return False
            ranks = [int(x) for x in r.group(3).split()]
            detail = msg
            nr = self._current_nranks(host, pid, tid, dev)
            if len(ranks) == 20 and nr is not None and nr > 20:
                detail += f" (NCCL printed only the first 20 of {nr} ranks)"
            self.topo(host, pid, tid, dev, "ring", detail, channel=int(r.group(1)), ranks=ranks)
            return True
        c = _CONNECTION.match(msg)
        if c is None:
            return False
        via = c.group(8)
        comm = None
        cc = _CONN_COMM.search(via)
        if cc is not None:
            via = via[: cc.start()]
            p = self.proc(host, pid, dev)
            comm = p.comms[cc.group(1)]["comm_ptr"] if cc.group(1) in p.comms else cc.group(1)
        self.topo(
            host, pid, tid, dev, "connection", msg, channel=int(c.group(1)),
            src=int(c.group(3)), dst=int(c.group(5)), transport=via, comm=comm,
        )
        return True

    def _current_nranks(self, host: str | None, pid: str | None, tid: str | None, dev: int) -> int | None:
        th = self.thread(host, pid, tid, dev)
        if th.comm is None:
            return None
        p = self.proc(host, pid, dev)
        for row in p.comms.values():
            if row["comm_ptr"] == th.comm:
                return row["nranks"]
        return None

    def nvls_trees(self, msg: str, host: str | None, pid: str | None, tid: str | None, dev: int) -> None:
        for ch, t in enumerate(_NVLS_TREE.finditer(msg)):
            ranks = [int(t.group(k)) for k in (1, 2, 3, 4, 5)]
            self.topo(host, pid, tid, dev, "nvls_tree", t.group(0), channel=ch, ranks=ranks)

    def tuning(self, m: re.Match, host: str | None, pid: str | None) -> None:
        name, nbytes, algo, proto, time_s, lo, hi = m.groups()
        time_us = None
        if time_s is not None:
            try:
                time_us = float(time_s)
            except ValueError:
                time_us = None
        self.res.tuning.append({
            "host": host, "pid": int(pid) if pid is not None else None,
            "op": normalize_op(name) if name else None, "bytes": int(nbytes),
            "algo": _algo_name(algo), "proto": _proto_name(proto), "time_us": time_us,
            "channels": f"{lo}..{hi}" if lo is not None else None,
        })

    # ------------------------------------------------------------------ finish

    def finish(self) -> ParseResult:
        res = self.res
        if self.nccl_lines == 0 and not self.versions:
            skipped = "".join(f"; skipped {n}: {reason}" for reason, n in res.skipped.items())
            raise ParseError(f"not a Kineto JSON trace or an NCCL debug log: no NCCL INFO lines found "
                             f"(not an NCCL_DEBUG=INFO log?){skipped}", "line 1")
        file_version = next(iter(self.versions)) if len(self.versions) == 1 else None
        multi = self._multi_device()
        for row in res.nccl_comms:
            p = self.procs[row.pop("_proc")]
            row["nccl_version"] = p.version or file_version
            base = p.base
            if row["comm_id"]:
                row["group_key"] = f"nccl:{row['comm_id']}"
            else:
                row["group_key"] = provisional_key(base, row["comm_ptr"], row["nranks"])
            if "_split_count" in row:
                res.meta.setdefault("split_counts", {})[f"{base}:{row['comm_ptr']}"] = row.pop("_split_count")
            row.pop("_complete", None)
        if multi:
            self._relabel(multi)
        contexts = self._contexts()
        if len(contexts) == 1 and self.hint.rank is not None:
            res.rank = self.hint.rank
            for ev in res.events:
                ev["rank"] = self.hint.rank
            for i, t in enumerate(res.event_tables):
                rank = pa.repeat(pa.scalar(self.hint.rank, pa.int32()), t.num_rows)
                k = t.schema.get_field_index("rank")
                res.event_tables[i] = t.set_column(k, "rank", rank) if k >= 0 else t.append_column("rank", rank)
        elif len(contexts) == 1 and res.nccl_comms:
            world = [r for r in res.nccl_comms if r["nranks"] == self.max_nranks]
            res.rank = world[0]["comm_rank"] if world else None
        res.world_size = self.max_nranks or self.hint.world_size
        for reason, line_no in self.first_skip_line.items():
            res.warn(f"{self.name}:line {line_no}: skipped: {reason} (first of {res.skipped[reason]})")
        meta = res.meta
        if self.versions:
            meta["nccl_version"] = next(iter(self.versions))
            if len(self.versions) > 1:
                meta["nccl_versions"] = list(self.versions)
        if self.library == "rccl":
            meta["library"] = "rccl"
        if self.cuda:
            meta["cuda_version"] = self.cuda
        meta["nccl_lines"] = self.nccl_lines
        meta["processes"] = len(contexts)
        if self.warn_lines:
            meta["nccl_warn_lines"] = self.warn_lines
            meta["nccl_warnings"] = self.warn_texts
        return res

    def _multi_device(self) -> set[tuple]:
        """Keys of processes whose communicators live on more than one CUDA device."""
        return {k for k, p in self.procs.items() if p.host is not None and len(set(p.comm_devs.values())) > 1}

    def _contexts(self) -> set[str]:
        out: set[str] = set()
        multi = self._multi_device()
        for k, p in self.procs.items():
            if k in multi:
                out.update(p.label(d, True) for d in p.comm_devs.values())
            elif p.comm_devs or p.comms:
                out.add(p.base)
        return out

    def _relabel(self, multi: set[tuple]) -> None:
        """Give each device of a multi-GPU process its own process label and sequence."""
        labels: dict[tuple[str, str], str] = {}
        bases: set[str] = set()
        for k in multi:
            p = self.procs[k]
            bases.add(p.base)
            for comm, dev in p.comm_devs.items():
                labels[(p.base, comm)] = p.label(dev, True)
        if self.res.event_tables:
            self.res.event_tables = [self._relabel_table(labels)]
            return
        seqs: dict[str, int] = {}
        for ev in self.res.events:
            if ev["process"] in bases:
                label = labels[(ev["process"], ev["comm_ptr"])]
                ev["process"] = label
                s = seqs.get(label, 0)
                ev["seq"] = s
                seqs[label] = s + 1

    def _relabel_table(self, labels: dict[tuple[str, str], str]) -> pa.Table:
        """`_relabel` on the event tables, after the rows of the per-line path joined them: the new
        sequence of a label follows the old sequence of its process, the order in which its rows were made."""
        tables = [_plain_events(t) for t in self.res.event_tables]
        if self.res.events:
            tables.append(_events_table(self.res.events))
            self.res.events = []
        t = pa.concat_tables(tables).combine_chunks()
        process = t["process"].combine_chunks()
        seq = t["seq"].combine_chunks()
        keys = pc.binary_join_element_wise(process, t["comm_ptr"].combine_chunks(), "\x00")
        found = pc.index_in(keys, value_set=pa.array([f"{b}\x00{c}" for b, c in labels], pa.string()))
        label = pc.take(pa.array(list(labels.values()), pa.string()), found)
        moved = pc.is_valid(label)
        rows = pc.indices_nonzero(moved)
        if not len(rows):
            return t
        enc = pc.dictionary_encode(pc.take(label, rows))
        by = pa.table({"label": enc.indices, "seq": pc.take(seq, rows)})
        order = pc.sort_indices(by, sort_keys=[("label", "ascending"), ("seq", "ascending")])
        sorted_label = pc.take(enc.indices, order)
        vc = pc.value_counts(enc.indices)
        counts = dict(zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist()))
        starts, first = [], 0
        for k in range(len(enc.dictionary)):
            starts.append(-first)
            first += counts.get(k, 0)
        ranked = pc.add(self.arange(len(rows)), pc.take(pa.array(starts, pa.int64()), sorted_label))
        new_seq = pc.take(ranked, pc.sort_indices(order))
        t = t.set_column(t.schema.get_field_index("process"), "process", pc.coalesce(label, process))
        return t.set_column(t.schema.get_field_index("seq"), "seq", pc.replace_with_mask(seq, moved, new_seq))


# ------------------------------------------------------------------------------------------ vectorised


@dataclass
class _CleanColl:
    """The clean COLL lines of a block: line index, template key (head id x n_tails + tail id), opCount
    and count, one entry per line; heads and tails are the `_FAST` head and tail groups by id."""

    line: pa.Array
    key: pa.Array
    op_count: pa.Array
    count: pa.Array
    heads: list[bytes]
    tails: list[bytes]
    n_tails: int


def _clean_coll(lines: pa.Array, arange: pa.Array) -> _CleanColl | None:
    """Find the lines that `_FAST` matches as COLL lines without NCCL text glued before or after.

    A line is cut at the first ": opCount ", the first space after it, the first " count " after that
    and the first space after that: prefix+head | opCount | "sendbuff .. recvbuff .." | count | "datatype
    .. stream ..". Each piece must fullmatch its part of `_FAST` (`_PIECE_*`, hex and decimal digits); the
    repeated pieces are checked once per distinct value. When all do, `_FAST` matches the line with the
    same groups: each run of non-blanks or digits ends where the next literal starts, a head cannot contain
    ": opCount ", and the lazy prefix is the shortest for which the head matches, in `_FAST` as in
    `_PIECE_HEAD`. Lines where some piece does not match go to the per-line path, which decides exactly;
    so do opCount of more than 15 and count of more than 18 digits, which int64 cannot always hold."""
    idx: pa.Array | None = None  # surviving line indices, None while all lines survive
    pieces: list[pa.Array] = []
    rest = lines
    for sep in (b": opCount ", b" ", b" count ", b" "):
        parts = pc.split_pattern(rest, sep, max_splits=1)
        ok = pc.equal(pc.list_value_length(parts), 2)
        if ok.false_count:
            idx = pc.indices_nonzero(ok) if idx is None else idx.filter(ok)
            parts = parts.filter(ok)
            pieces = [piece.filter(ok) for piece in pieces]
            if not len(parts):
                return None
        pieces.append(pc.list_element(parts, 0))
        rest = pc.list_element(parts, 1)
    head_piece, opc_piece, buf_piece, count_piece = pieces
    tail_piece = rest

    heads: dict[bytes, int] = {}
    enc = pc.dictionary_encode(head_piece)
    ids = []
    for text in enc.dictionary.to_pylist():
        h = _PIECE_HEAD.fullmatch(text)
        if h is None or b"NCCL" in h.group(1) or b"opCount" in h.group(1):
            ids.append(-1)
        else:
            ids.append(heads.setdefault(h.group(2), len(heads)))
    head_id = pc.take(pa.array(ids, pa.int64()), enc.indices)
    tails: dict[bytes, int] = {}
    enc = pc.dictionary_encode(tail_piece)
    ids = []
    for text in enc.dictionary.to_pylist():
        t = _PIECE_TAIL.fullmatch(text)
        ids.append(-1 if t is None or b"NCCL" in t.group(2) else tails.setdefault(t.group(1), len(tails)))
    tail_id = pc.take(pa.array(ids, pa.int64()), enc.indices)
    enc = pc.dictionary_encode(buf_piece)
    buf_ok = [_PIECE_BUFFERS.fullmatch(b) is not None for b in enc.dictionary.to_pylist()]
    buf_ok = pc.take(pa.array(buf_ok, pa.bool_()), enc.indices)
    op_count, opc_ok = _hex_int64(opc_piece)
    try:
        count_text = pc.cast(count_piece, pa.string())
        count_ok = pc.and_(pc.ascii_is_decimal(count_text), pc.less_equal(pc.binary_length(count_piece), 18))
    except pa.ArrowInvalid:  # not UTF-8
        count_text = None
        count_ok = pc.match_substring_regex(count_piece, r"^[0-9]{1,18}$")
    ok = pc.and_(pc.and_(pc.and_(pc.greater_equal(head_id, 0), pc.greater_equal(tail_id, 0)), buf_ok),
                 pc.and_(opc_ok, count_ok))
    if idx is None:
        idx = pc.indices_nonzero(ok) if ok.false_count else None
    elif ok.false_count:
        idx = idx.filter(ok)
    if ok.false_count:
        head_id, tail_id, op_count, count_piece = (a.filter(ok) for a in (head_id, tail_id, op_count, count_piece))
        count_text = None
        if not len(head_id):
            return None
    line = pc.cast(idx, pa.int64()) if idx is not None else arange
    n_tails = len(tails)
    return _CleanColl(
        line=line,
        key=pc.add(pc.multiply(head_id, n_tails), tail_id),
        op_count=op_count,
        count=pc.cast(count_text if count_text is not None else pc.cast(count_piece, pa.string()), pa.int64()),
        heads=list(heads),
        tails=list(tails),
        n_tails=n_tails,
    )


# Nibble of each byte value; 16 for bytes that are not hex digits.
_HEX_NIBBLE = pa.array(
    [int(chr(b), 16) if chr(b) in "0123456789abcdefABCDEF" else 16 for b in range(256)], pa.uint8()
)


def _hex_int64(text: pa.Array) -> tuple[pa.Array, pa.Array]:
    """Hex strings of 1 to 15 digits as int64, and which strings were such (others give garbage).

    Reversed and padded with "0" to 16 bytes, the digits are mapped to nibbles through a lookup table;
    pairs of nibbles make the bytes of a little-endian int64."""
    n = len(text)
    length = pc.binary_length(text)
    ok_len = pc.and_(pc.greater_equal(length, 1), pc.less_equal(length, 15))
    pad = pa.scalar(b"0" * 16, text.type)
    joined = pc.binary_join_element_wise(pc.binary_reverse(text), pad, pa.scalar(b"", text.type))
    padded = pc.binary_slice(joined, 0, 16)
    fixed = padded.cast(pa.binary(16))
    digits = pa.Array.from_buffers(pa.uint8(), n * 16, [None, fixed.buffers()[1]], offset=fixed.offset * 16)
    nibbles = pc.take(_HEX_NIBBLE, digits)
    bad = pc.equal(nibbles, 16)
    if bad.offset or nibbles.offset:  # not expected from fresh kernel outputs
        raise AssertionError("unexpected array offset")
    bad_any = pa.Array.from_buffers(pa.uint16(), n, [None, bad.buffers()[1]])  # 16 flags per string
    ok = pc.and_(ok_len, pc.equal(bad_any, 0))
    pairs = pa.Array.from_buffers(pa.uint16(), n * 8, [None, nibbles.buffers()[1]])  # low nibble | high << 8
    packed = pc.bit_wise_or(pc.bit_wise_and(pairs, 0x0F), pc.bit_wise_and(pc.shift_right(pairs, 4), 0xF0))
    as_bytes = pc.cast(packed, pa.uint8())
    return pa.Array.from_buffers(pa.int64(), n, [None, as_bytes.buffers()[1]]), ok


# The comm_events columns this parser fills, with their store types.
_EVENT_FIELDS = pa.schema([
    ("rank", pa.int32()), ("process", pa.string()), ("seq", pa.int64()), ("op", pa.string()),
    ("dtype", pa.string()), ("msg_bytes", pa.int64()), ("elems_in", pa.int64()), ("elems_out", pa.int64()),
    ("group_size", pa.int32()), ("group_key", pa.string()), ("peer", pa.int32()), ("op_count", pa.int64()),
    ("comm_ptr", pa.string()), ("raw_name", pa.string()),
])


def _events_table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_struct_array(pa.array(rows, type=pa.struct(_EVENT_FIELDS)))


def _plain_events(t: pa.Table) -> pa.Table:
    """All `_EVENT_FIELDS` columns with their plain types (dictionaries decoded, missing ones NULL)."""
    cols = [t[f.name].cast(f.type) if f.name in t.column_names else pa.nulls(t.num_rows, f.type) for f in _EVENT_FIELDS]
    return pa.Table.from_arrays(cols, schema=_EVENT_FIELDS)


# ------------------------------------------------------------------------------------------ helpers


def _skip_template(reason: str) -> tuple:
    return (None, reason, 0, 0, None)


def provisional_key(process_base: str, comm_label: str, nranks: int | None) -> str:
    """Group key of a communicator known only inside one process (its pointer), before linking."""
    return f"nccl:ptr:{process_base}:{comm_label}:n{nranks}"


def _elem_factors(op: str, nranks: int) -> tuple[int, int]:
    """(elems_in, elems_out) per unit of the COLL `count` (formats.md A.3)."""
    if op in ("all_gather", "gather"):
        return 1, nranks
    if op in ("reduce_scatter", "scatter"):
        return nranks, 1
    if op == "all_to_all":
        return nranks, nranks
    return 1, 1


def _algo_name(s: str) -> str:
    if s.isdigit():
        return ALGOS.get(int(s), s)
    return _ALGO_NAMES.get(s.replace("_", "").lower(), s)


def _proto_name(s: str) -> str:
    if s.isdigit():
        return PROTOS.get(int(s), s)
    return _PROTO_NAMES.get(s.lower(), s)


def _topo_row(
    p: _Proc, comm: str | None, kind: str, detail: str, channel: int | None = None,
    ranks: list[int] | None = None, src_rank: int | None = None, dst_rank: int | None = None,
    transport: str | None = None,
) -> dict[str, Any]:
    return {
        "group_key": None, "host": p.host, "pid": p.pid, "comm_ptr": comm, "kind": kind, "channel": channel,
        "ranks": ranks, "src_rank": src_rank, "dst_rank": dst_rank, "transport": transport, "detail": detail,
    }


def iter_blocks(stream: io.BufferedReader, limits: Limits) -> Iterator[bytes | None]:
    """Blocks of whole lines without the last newline, in order; None for an overlong line (counts as
    one line). No line longer than limits.max_line_bytes is ever held in memory whole."""
    max_line = max(1, limits.max_line_bytes)
    size = min(BLOCK_BYTES, max_line)
    carry = b""
    skipping = False
    while True:
        block = stream.read(size)
        if not block:
            break
        if skipping:
            nl = block.find(b"\n")
            if nl < 0:
                continue
            block = block[nl + 1 :]
            skipping = False
        if carry:
            nl = block.find(b"\n")
            if nl < 0:
                if len(carry) + len(block) > max_line:
                    yield None
                    carry, skipping = b"", True
                else:
                    carry += block
                continue
            first = carry + block[:nl]
            carry = b""
            if len(first) > max_line:
                yield None
            else:
                yield first
            block = block[nl + 1 :]
        cut = block.rfind(b"\n")
        if cut < 0:
            if len(block) > max_line:
                yield None
                skipping = True
            else:
                carry = block
            continue
        body = block[:cut]
        yield body
        carry = block[cut + 1 :]
    if carry:
        yield carry


def parse_nccl_log(stream: io.BufferedReader, name: str, hint: RankHint, limits: Limits) -> ParseResult:
    """Parse one NCCL debug log (one process or many interleaved) into comm_events, nccl_comms,
    nccl_topology and nccl_tuning rows. Damaged lines are counted in `skipped`, not fatal."""
    parser = _Parser(name, hint)
    first = True
    line_no = 1
    for body in iter_blocks(stream, limits):
        if body is None:
            parser.skip(f"line longer than {limits.max_line_bytes} bytes", line_no)
            line_no += 1
            continue
        if first:
            first = False
            if body.startswith(b"\xef\xbb\xbf"):
                body = body[3:]
        line_no += parser.block(body, line_no)
    return parser.finish()
