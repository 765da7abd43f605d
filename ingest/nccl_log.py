"""NCCL debug-log ingester (NCCL_DEBUG=INFO output; docs/formats.md section A).

One file may hold one process (NCCL_DEBUG_FILE=name.%h.%p) or many processes interleaved (stdout of a
launcher). The stream is read in blocks of whole lines; lines longer than `Limits.max_line_bytes` are
skipped without being held in memory.

The reader is split by job: `nccl_grammar` (patterns, message classification, name tables),
`nccl_state` (processes, threads, communicator owners), `nccl_vector` (the vectorised COLL path),
`nccl_relabel` (multi-GPU processes) and this module (reading messages in order, assembling the result).

Speed: per-operation (COLL) lines dominate large logs. Rows come from a template cached per (envelope
with op name, "datatype .. comm .. [nranks=..]" text); only opCount, count and the sequence number vary.
A large block (`VECTOR_MIN_LINES` lines or more) is cut into words at its blanks with numpy; the words
are checked (the literals as 8-byte words, opCount and count as digit columns, the head and the tail
once per distinct value) so that a line takes the vectorised route only when `FAST` would match it as a
clean COLL line with these very groups; its rows then go into an Arrow table
(`ParseResult.event_tables`). A thread reads, decompresses and hashes the next blocks and two more cut
them (`_ahead`, `CUTTERS`) while this module's state machine works on the current one: the cuts are
most of the parse's CPU and numpy releases the GIL in them, so on two cores they overlap. Every other line (init, topology,
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
import queue
import re
import threading
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from typing import Any

import pyarrow as pa

from commlens.vocab import DTYPE_BYTES, NCCL_DTYPES, msg_bytes_from_nccl_count, normalize_op

from . import nccl_vector
from .inputs import Limits
from .nccl_grammar import (
    BARE,
    BARE_VERSION,
    COLL,
    COLL_HEAD,
    CONN_COMM,
    ENVELOPE,
    FALLBACK,
    FAST,
    FAST_HEAD,
    FAST_TAIL,
    NVLS_TREE,
    ONE_SIDED,
    TREE_CHANNEL,
    TREE_CHANNEL_24,
    algo_name,
    classify,
    coll_name,
    elem_factors,
    init_fields,
    proto_name,
)
from .nccl_relabel import relabel
from .nccl_state import Proc, Processes
from .nccl_vector import VECTOR_MIN_LINES, Counting, Template
from .parse_threads import parse_threads
from .records import ParseResult, RankHint, UnknownFormatError

KIND = "nccl_log"
BLOCK_BYTES = 4 << 20
MAX_KEPT_WARN_LINES = 20
VECTOR_PAUSE_BLOCKS = 4  # blocks parsed line by line after one that was mostly other lines


class _Parser:
    """Reads the messages of one log in order: COLL rows (through cached templates), communicator init,
    topology and tuning lines, and damaged lines; `finish` assembles the ParseResult."""

    def __init__(self, name: str, hint: RankHint):
        self.name = name
        self.hint = hint
        self.res = ParseResult(kind=KIND)
        self.state = Processes()
        self.procs = self.state.procs
        self.fast_cache: dict[tuple[Any, ...], Template] = {}
        self.slow_cache: dict[tuple[Any, ...], Template] = {}
        self.versions: dict[str, None] = {}  # in order of appearance
        self.cuda: str | None = None
        self.library: str | None = None
        self.nccl_lines = 0
        self.warn_lines = 0
        self.warn_texts: list[str] = []
        self.max_nranks = 0
        self.comm_owner = self.state.comm_owner
        self.first_skip_line: dict[str, int] = {}
        self.vector_pause = 0  # blocks left to parse line by line after one that was mostly not clean COLL
        self.unprefixed_seen = False
        self.arange = Counting()

    # ------------------------------------------------------------------ bookkeeping

    def skip(self, reason: str, line_no: int, n: int = 1) -> None:
        self.res.skip(reason, n)
        if reason not in self.first_skip_line:
            self.first_skip_line[reason] = line_no

    # ------------------------------------------------------------------ COLL rows

    def template(
        self, p: Proc, dev: int | None, name: str, dt: int, root: int, ptr: str, nranks: int, line_no: int
    ) -> tuple:
        """(row template, bytes per count, elems_in factor, elems_out factor, seq cell); a template
        without row (see `_skip_template`) makes lines skipped with its reason."""
        base, root_is_peer = coll_name(name)
        if base is None:
            return _skip_template(f"{name} line without its per-peer counts (not counted)")
        op = normalize_op(base)
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
        f_in, f_out = elem_factors(op, nranks)
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
            row["peer"] = root if root_is_peer else None
        return (row, per_count, f_in, f_out, p.seq)

    def coll(self, host: str | None, pid: str | None, dev: int | None, m: re.Match, line_no: int) -> None:
        """A COLL message found by the line-by-line path (same rows as the fast path)."""
        name, opc, count, dt, _redop, root, ptr, nranks = m.groups()
        p = self.state.proc(host, pid, dev)
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

    def block(self, data: bytes, first_line: int, cut: Cut | None = None) -> int:
        """A block of whole lines (without the last newline) whose first line is `first_line`; returns
        the number of its lines. `cut` is the block's `vector_cut` when it was made ahead."""
        if self.vector_pause or len(data) < VECTOR_MIN_LINES * 32:
            self.vector_pause = max(0, self.vector_pause - 1)
            return self._block_lines(data, first_line)
        return self._block_vector(data, first_line, cut or vector_cut(data))

    def _block_vector(self, data: bytes, first_line: int, cut: Cut) -> int:
        """Clean COLL lines in runs through numpy and pyarrow (`nccl_vector`), everything else through
        `_block_lines`, in line order."""
        block, clean = cut
        n = len(block)
        if clean is None:
            self.vector_pause = VECTOR_PAUSE_BLOCKS
            return self._block_lines(data, first_line)
        by_line = 0
        for vectorised, a, b in nccl_vector.plan(block.lines(), clean, self.arange):
            if vectorised:
                self.nccl_lines += b - a
                table = nccl_vector.run_table(clean, a, b, first_line, self, self.arange)
                if table is not None:
                    self.res.event_tables.append(table)
            else:
                by_line += b - a
                self._block_lines(data[block.starts[a] : block.ends[b - 1]], first_line + a)
        if by_line * 2 > n:
            self.vector_pause = VECTOR_PAUSE_BLOCKS
        return n

    def cached_template(self, head: bytes, tail: bytes, line_no: Callable[[], int]) -> Template:
        t = self.fast_cache.get((head, tail))
        if t is None:
            t = self.fast_cache[(head, tail)] = self.fast_template(head, tail, line_no())
        return t

    def _block_lines(self, data: bytes, first_line: int) -> int:
        """`block` line by line: one `FAST` match per line."""
        cache = self.fast_cache
        append = self.res.events.append
        n_coll = 0
        matches = FAST.findall(data)
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
        h = FAST_HEAD.fullmatch(head.decode("utf-8", "replace"))
        m = FAST_TAIL.fullmatch(tail.decode("utf-8", "replace"))
        if h is None or m is None:  # bytes that are not UTF-8 text
            return _skip_template("COLL line cut or garbled")
        host, pid, dev, name = h.groups()
        dt, _redop, root, ptr, nranks = m.groups()
        p = self.state.proc(host, pid, int(dev))
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
        envs = list(ENVELOPE.finditer(text))
        if envs:
            head = text[: envs[0].start()]
            if "NCCL INFO" in head or COLL_HEAD.search(head):
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
        fb = FALLBACK.search(text)
        if fb is not None:
            head = text[: fb.start()]
            if COLL_HEAD.search(head):
                self.orphan_coll(head, line_no)
            dev, level = fb.groups()
            self.message(text[fb.end() :].rstrip(), None, None, None, int(dev), level, line_no, fragment)
            return
        v = BARE_VERSION.search(text)
        if v is not None and "NCCL INFO" not in text:
            self.version(v, None)
            return
        bare = BARE.search(text) if not self.state.hosts_seen else None
        if bare is not None:
            self.unprefixed(text[bare.end() :].rstrip(), bare.group(1), line_no, fragment)
            return
        if "NCCL INFO" in text or "NCCL WARN" in text:
            if not self.orphan_coll(text, line_no):
                self.skip("NCCL INFO line without a '[dev] NCCL INFO' prefix (garbled)", line_no)
            return
        if COLL_HEAD.search(text):
            self.orphan_coll(text, line_no)
        # anything else is prose around the log (launcher output, comments): ignored silently

    def unprefixed(self, msg: str, level: str, line_no: int, cut: bool) -> None:
        """A "NCCL INFO <message>" line with no host:pid:tid [dev] at all, in a file where no line has had
        one so far: the paste is read as one process ("unknown", see `_name_unprefixed`), whose communicators come from its own
        Init lines (formats.md A.1)."""
        if not self.unprefixed_seen:
            self.unprefixed_seen = True
            self.res.warn(
                f"{self.name}:line {line_no}: lines without the host:pid:tid [dev] envelope: read as one process"
            )
        self.message(msg, None, None, None, None, level, line_no, cut)

    def orphan_coll(self, text: str, line_no: int) -> bool:
        """A COLL message whose prefix was lost: attributed through its comm pointer when that is unique."""
        m = COLL.search(text)
        if m is None:
            if COLL_HEAD.search(text):
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
        self,
        msg: str,
        host: str | None,
        pid: str | None,
        tid: str | None,
        dev: int | None,
        level: str,
        line_no: int,
        cut: bool,
    ) -> None:
        self.nccl_lines += 1
        if host is not None and (host, pid) not in self.procs:
            host = self.state.glued_host(host, pid)
        if level == "WARN":
            self.warn_lines += 1
            if len(self.warn_texts) < MAX_KEPT_WARN_LINES:
                self.warn_texts.append(msg)
            return
        m = COLL.match(msg)
        if m is not None:
            self.coll(host, pid, dev, m, line_no)
            return
        if COLL_HEAD.match(msg):
            self.skip("COLL line cut or garbled", line_no)
            return
        if self.init_message(msg, host, pid, tid, dev, line_no):
            return
        if cut:
            self.skip("message cut by another writer's output", line_no)

    def init_message(
        self, msg: str, host: str | None, pid: str | None, tid: str | None, dev: int | None, line_no: int
    ) -> bool:
        """Version, communicator, topology and tuning lines; False when the message is none of these."""
        found = classify(msg)
        if found is None:
            return False
        kind, m = found
        if kind in ("ring", "connection"):
            self.channel(kind, m, msg, host, pid, tid, dev)
        elif m is None or kind not in ("version", "driver", "nodes", "init", "tuning"):
            self.topology_message(kind, m, msg, host, pid, tid, dev)
        elif kind == "version":
            self.version(m, self.state.proc(host, pid, dev))
        elif kind == "driver":
            self.res.meta["cuda_driver_version"] = int(m.group(1))
        elif kind == "nodes":
            self.nodes(m, msg, host, pid, tid, dev)
        elif kind == "init":
            self.init(m, host, pid, tid, dev, line_no)
        else:
            self.tuning(m, host, pid)
        return True

    def topology_message(
        self,
        kind: str,
        m: re.Match[str] | None,
        msg: str,
        host: str | None,
        pid: str | None,
        tid: str | None,
        dev: int | None,
    ) -> None:
        """Trees, NVLS trees and heads, channel counts."""
        if kind == "trees":
            for t in TREE_CHANNEL.finditer(msg):
                ranks = [int(t.group(k)) for k in (2, 3, 4, 5, 6)]
                self.topo(host, pid, tid, dev, "tree", t.group(0), channel=int(t.group(1)), ranks=ranks)
            for t in TREE_CHANNEL_24.finditer(msg):  # 2.4: parent->rank->children, stored in the 2.5+ order
                ranks = [int(t.group(k)) for k in (4, 5, 6, 3, 2)]
                self.topo(host, pid, tid, dev, "tree", t.group(0), channel=int(t.group(1)), ranks=ranks)
        elif kind == "nvls_trees":
            self.nvls_trees(msg, host, pid, tid, dev)
        elif kind == "nvls_head":
            assert m is not None
            ranks = [int(x) for x in m.group(2).split()]
            self.topo(host, pid, tid, dev, "nvls_head", msg, channel=int(m.group(1)), ranks=ranks)
        elif kind == "channels":
            self.topo(host, pid, tid, dev, "channels", msg)

    # ------------------------------------------------------------------ init lines

    def version(self, v: re.Match, p: Proc | None) -> None:
        lib, ver, build = v.groups()
        self.library = lib.lower()
        if build and build.startswith("cuda"):
            self.cuda = build[4:]
        if p is not None:
            p.version = p.version or ver
        self.versions.setdefault(ver)

    def comm_row(self, p: Proc, ptr: str, opening: bool, closing: bool) -> dict[str, Any]:
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
            "group_key": None,
            "host": p.host,
            "pid": p.pid,
            "cuda_dev": None,
            "comm_ptr": label,
            "comm_rank": None,
            "nranks": None,
            "global_rank": None,
            "comm_id": None,
            "parent_ptr": None,
            "color": None,
            "split_key": None,
            "bus_id": None,
            "nvml_dev": None,
            "api": None,
            "nccl_version": None,
            "_complete": False,
            "_proc": p.key,
        }
        p.comms[ptr] = row
        self.res.nccl_comms.append(row)
        if n > 1:  # cached COLL templates point at the previous instance
            self.fast_cache.clear()
            self.slow_cache.clear()
        return row

    def init(
        self, m: re.Match, host: str | None, pid: str | None, tid: str | None, dev: int | None, line_no: int
    ) -> None:
        api, ptr, rank, nranks, rest, phase = m.groups()
        p = self.state.proc(host, pid, dev)
        row = self.comm_row(p, ptr, opening=phase == "START", closing=phase == "COMPLETE")
        row["comm_rank"] = int(rank)
        row["nranks"] = int(nranks)
        row["api"] = api or row["api"]
        values, unreadable = init_fields(rest)
        row.update(values)
        for k, v in unreadable:
            self.res.warn(f"{self.name}:line {line_no}: unreadable {k} {v!r} in an Init line")
        if row["cuda_dev"] is None:
            row["cuda_dev"] = dev
        p.comm_devs[row["comm_ptr"]] = row["cuda_dev"]
        self.max_nranks = max(self.max_nranks, row["nranks"])
        self.comm_owner.setdefault(ptr, set()).add(p.key)
        th = self.state.thread(host, pid, tid, dev)
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

    def nodes(self, m: re.Match, msg: str, host: str | None, pid: str | None, tid: str | None, dev: int | None) -> None:
        ptr, rank, nranks = m.group(1), int(m.group(2)), int(m.group(3))
        p = self.state.proc(host, pid, dev)
        row = self.comm_row(p, ptr, opening=True, closing=False)
        if row["comm_rank"] is None:
            row["comm_rank"], row["nranks"] = rank, nranks
        if row["cuda_dev"] is None:
            row["cuda_dev"] = dev
        p.comm_devs.setdefault(row["comm_ptr"], row["cuda_dev"])
        self.max_nranks = max(self.max_nranks, nranks)
        self.comm_owner.setdefault(ptr, set()).add(p.key)
        th = self.state.thread(host, pid, tid, dev)
        th.comm = row["comm_ptr"]
        detail = msg[m.end(3) + 1 :].strip()
        self.res.topology.append(_topo_row(p, row["comm_ptr"], "nodes", detail, src_rank=rank))

    # ------------------------------------------------------------------ topology and tuning

    def topo(
        self,
        host: str | None,
        pid: str | None,
        tid: str | None,
        dev: int | None,
        kind: str,
        detail: str,
        channel: int | None = None,
        ranks: list[int] | None = None,
        src: int | None = None,
        dst: int | None = None,
        transport: str | None = None,
        comm: str | None = None,
    ) -> None:
        p = self.state.proc(host, pid, dev)
        th = self.state.thread(host, pid, tid, dev)
        row = _topo_row(p, comm or th.comm, kind, detail, channel, ranks, src, dst, transport)
        if row["comm_ptr"] is None:
            th.pending.append(row)
        self.res.topology.append(row)

    def channel(
        self,
        kind: str,
        m: re.Match[str] | None,
        msg: str,
        host: str | None,
        pid: str | None,
        tid: str | None,
        dev: int | None,
    ) -> None:
        """A ring ("Channel 00/02 : 0 1 2 3") or a connection ("Channel 00/0 : 0[0] -> 1[1] via P2P/IPC")."""
        assert m is not None
        if kind == "ring":
            ranks = [int(x) for x in m.group(3).split()]
            detail = msg
            nr = self.state.current_nranks(host, pid, tid, dev)
            if len(ranks) == 20 and nr is not None and nr > 20:
                detail += f" (NCCL printed only the first 20 of {nr} ranks)"
            self.topo(host, pid, tid, dev, "ring", detail, channel=int(m.group(1)), ranks=ranks)
            return
        via = m.group("via")
        comm = None
        cc = CONN_COMM.search(via)
        if cc is not None:
            via = via[: cc.start()]
            p = self.state.proc(host, pid, dev)
            comm = p.comms[cc.group(1)]["comm_ptr"] if cc.group(1) in p.comms else cc.group(1)
        self.topo(
            host,
            pid,
            tid,
            dev,
            "connection",
            msg,
            channel=int(m.group("ch")),
            src=int(m.group("src")),
            dst=int(m.group("dst")),
            transport=via,
            comm=comm,
        )

    def nvls_trees(self, msg: str, host: str | None, pid: str | None, tid: str | None, dev: int | None) -> None:
        for ch, t in enumerate(NVLS_TREE.finditer(msg)):
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
        self.res.tuning.append(
            {
                "host": host,
                "pid": int(pid) if pid is not None else None,
                "op": normalize_op(name) if name else None,
                "bytes": int(nbytes),
                "algo": algo_name(algo),
                "proto": proto_name(proto),
                "time_us": time_us,
                "channels": f"{lo}..{hi}" if lo is not None else None,
            }
        )

    # ------------------------------------------------------------------ finish

    def finish(self) -> ParseResult:
        """The ParseResult: communicator keys, multi-GPU processes relabelled, the file's rank, meta."""
        res = self.res
        if self.nccl_lines == 0 and not self.versions:
            skipped = "".join(f"; skipped {n}: {reason}" for reason, n in res.skipped.items())
            raise UnknownFormatError(
                f"not a Kineto JSON trace or an NCCL debug log: no NCCL INFO lines found "
                f"(not an NCCL_DEBUG=INFO log?){skipped}",
                "line 1",
            )
        self._name_unprefixed()
        self._finish_comms()
        self._warn_of_several_jobs()
        multi = self.state.multi_device()
        if multi:
            relabel(res, self.state, multi, self.arange)
        contexts = self.state.contexts()
        if len(contexts) == 1:
            self._file_rank()
        res.world_size = self.max_nranks or self.hint.world_size
        for reason, line_no in self.first_skip_line.items():
            res.warn(f"{self.name}:line {line_no}: skipped: {reason} (first of {res.skipped[reason]})")
        res.meta.update(self._meta(len(contexts)))
        return res

    def _warn_of_several_jobs(self) -> None:
        """Processes whose communicators never meet, each set with a world-sized one, are separate jobs in one
        file (two srun steps, an elastic restart appended): their ranks collide, so say so."""
        world = max((int(c["nranks"]) for c in self.res.nccl_comms if c.get("nranks")), default=0)
        parent: dict[Any, Any] = {}

        def root(x: Any) -> Any:
            while parent.setdefault(x, x) != x:
                x = parent[x]
            return x

        for c in self.res.nccl_comms:
            if c.get("comm_id"):
                parent[root(("proc", c.get("host"), c.get("pid")))] = root(("comm", c["comm_id"]))
        worlds = sorted(
            {
                (root(("comm", c["comm_id"])), str(c["comm_id"]))
                for c in self.res.nccl_comms
                if c.get("comm_id") and c.get("nranks") == world and world > 1
            }
        )
        jobs = dict(worlds)  # one world communicator per job named
        if len(jobs) > 1:
            ids = ", ".join(sorted(jobs.values()))
            self.res.warn(
                f"{self.name}: holds {len(jobs)} jobs: world communicators {ids} of {world} ranks share no process, "
                "so their ranks collide (the later job's processes get no global rank); split the file per job "
                "(per srun step or restart) and ingest each into its own run"
            )

    def _name_unprefixed(self) -> None:
        """The process of envelope-less lines takes the device its Init lines name ("unknown/cuda:N", as a
        paste that kept "[N]"), so that linking maps it to its rank like any other process."""
        p = self.procs.get((None, None))
        devs = {row["cuda_dev"] for row in p.comms.values() if row["cuda_dev"] is not None} if p else set()
        if p is None or len(devs) != 1:
            return
        old = p.base
        p.dev_hint = devs.pop()
        for ev in self.res.events:
            if ev["process"] == old:
                ev["process"] = p.base
                ev["group_key"] = provisional_key(p.base, ev["comm_ptr"], ev["group_size"])

    def _finish_comms(self) -> None:
        """Each nccl_comms row gets its version and (provisional) group key; split counters go to meta."""
        file_version = next(iter(self.versions)) if len(self.versions) == 1 else None
        for row in self.res.nccl_comms:
            p = self.procs[row.pop("_proc")]
            row["nccl_version"] = p.version or file_version
            base = p.base
            if row["comm_id"]:
                row["group_key"] = f"nccl:{row['comm_id']}"
            else:
                row["group_key"] = provisional_key(base, row["comm_ptr"], row["nranks"])
            if "_split_count" in row:
                self.res.meta.setdefault("split_counts", {})[f"{base}:{row['comm_ptr']}"] = row.pop("_split_count")
            row.pop("_complete", None)

    def _file_rank(self) -> None:
        """The rank of a one-process log: the caller's hint (set on every row), else its world rank."""
        res = self.res
        world = [r for r in res.nccl_comms if r["nranks"] == self.max_nranks]
        stated = world[0]["comm_rank"] if world else None
        if self.hint.rank is not None:
            if stated is not None and stated != self.hint.rank:
                res.warn(
                    f"{self.name}: the log states rank {stated} (in its largest communicator), the file name or "
                    f"--rank says {self.hint.rank}: using {self.hint.rank}"
                )
            res.rank = self.hint.rank
            for ev in res.events:
                ev["rank"] = self.hint.rank
            for i, t in enumerate(res.event_tables):
                rank = pa.repeat(pa.scalar(self.hint.rank, pa.int32()), t.num_rows)
                k = t.schema.get_field_index("rank")
                res.event_tables[i] = t.set_column(k, "rank", rank) if k >= 0 else t.append_column("rank", rank)
        else:
            res.rank = stated

    def _meta(self, processes: int) -> dict[str, Any]:
        meta: dict[str, Any] = {}
        if self.versions:
            meta["nccl_version"] = next(iter(self.versions))
            if len(self.versions) > 1:
                meta["nccl_versions"] = list(self.versions)
        if self.library == "rccl":
            meta["library"] = "rccl"
        if self.cuda:
            meta["cuda_version"] = self.cuda
        meta["nccl_lines"] = self.nccl_lines
        meta["processes"] = processes
        if self.warn_lines:
            meta["nccl_warn_lines"] = self.warn_lines
            meta["nccl_warnings"] = self.warn_texts
        return meta


# ------------------------------------------------------------------------------------------ helpers


def _skip_template(reason: str) -> tuple:
    return (None, reason, 0, 0, None)


def provisional_key(process_base: str, comm_label: str, nranks: int | None) -> str:
    """Group key of a communicator known only inside one process (its pointer), before linking."""
    return f"nccl:ptr:{process_base}:{comm_label}:n{nranks}"


def _topo_row(
    p: Proc,
    comm: str | None,
    kind: str,
    detail: str,
    channel: int | None = None,
    ranks: list[int] | None = None,
    src_rank: int | None = None,
    dst_rank: int | None = None,
    transport: str | None = None,
) -> dict[str, Any]:
    return {
        "group_key": None,
        "host": p.host,
        "pid": p.pid,
        "comm_ptr": comm,
        "kind": kind,
        "channel": channel,
        "ranks": ranks,
        "src_rank": src_rank,
        "dst_rank": dst_rank,
        "transport": transport,
        "detail": detail,
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


# A block's lines and clean COLL lines (`nccl_vector`), made ahead of the reader's state machine.
Cut = tuple[nccl_vector.Block, nccl_vector.CleanColl | None]


def vector_cut(data: bytes) -> Cut:
    block = nccl_vector.Block(data)
    return block, nccl_vector.clean_coll(block) if len(block) >= VECTOR_MIN_LINES else None


# What the reader thread hands over per block: lines before the NCCL part, that part, lines after it, and
# its cut (being made by a cutter thread); None for an overlong line.
Piece = tuple[int, bytes, int, "Future[Cut] | None"] | None
# Threads cutting blocks ahead of the state machine (fewer where cores are few or shared: parse_threads). One
# cut took 2.8 s of a 2 M-line log's parse; two threads 1.8 s (numpy holds the GIL only between its calls).
CUTTERS = 2


def _pieces(stream: io.BufferedReader, limits: Limits, cutter: ThreadPoolExecutor) -> Iterator[Piece]:
    """The blocks of the stream with blank and foreign lines before a block's first NCCL line and after its
    last counted, never split (a log padded with millions of empty lines costs what reading it costs), and
    the vectorised cut of each large block, handed to `cutter`."""
    first = True
    for body in iter_blocks(stream, limits):
        if body is None:
            yield None
            continue
        data = body.removeprefix(b"\xef\xbb\xbf") if first else body
        first = False
        hits = [i for i in (data.find(b"CCL"), data.find(b"opCount")) if i >= 0]
        if not hits:
            yield data.count(b"\n") + 1, b"", 0, None
            continue
        start = data.rfind(b"\n", 0, min(hits)) + 1
        end = data.find(b"\n", max(data.rfind(b"CCL"), data.rfind(b"opCount")))
        end = len(data) if end < 0 else end
        part = data[start:end]
        cut = cutter.submit(vector_cut, part) if len(part) >= VECTOR_MIN_LINES * 32 else None
        yield data.count(b"\n", 0, start), part, data.count(b"\n", end), cut


def _ahead(items: Iterator[Piece], depth: int = 2) -> Generator[Piece, None, None]:
    """The items, made by a thread `depth` items ahead of the consumer: reading, decompressing and hashing
    release the GIL (and so do the cuts the items carry), so on two cores they overlap the reader's Python
    state machine.
    An exception in the thread is raised here; a consumer that stops early stops the thread."""
    q: queue.Queue[tuple[bool, Any]] = queue.Queue(depth)
    stop = threading.Event()

    def put(entry: tuple[bool, Any]) -> bool:
        while not stop.is_set():
            try:
                q.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            for item in items:
                if not put((True, item)):
                    return
            put((False, None))
        except BaseException as exc:  # handed to the consumer, which raises it
            put((False, exc))

    thread = threading.Thread(target=run, name="nccl-log-reader", daemon=True)
    thread.start()
    try:
        while True:
            more, item = q.get()
            if not more:
                if item is not None:
                    raise item
                return
            yield item
    finally:
        stop.set()
        thread.join()


def parse_nccl_log(stream: io.BufferedReader, name: str, hint: RankHint, limits: Limits) -> ParseResult:
    """Parse one NCCL debug log (one process or many interleaved) into comm_events, nccl_comms,
    nccl_topology and nccl_tuning rows. Damaged lines are counted in `skipped`, not fatal."""
    parser = _Parser(name, hint)
    line_no = 1
    # the queue holds at least as many pieces as there are cutters, so that each has a cut under way while the
    # parser works on one; the reader stops (closing) before the cutters are shut down
    cutters = parse_threads(CUTTERS)
    with (
        ThreadPoolExecutor(cutters, thread_name_prefix="nccl-log-cut") as cutter,
        closing(_ahead(_pieces(stream, limits, cutter), depth=max(2, cutters))) as pieces,
    ):
        for piece in pieces:
            if piece is None:
                parser.skip(f"line longer than {limits.max_line_bytes} bytes", line_no)
                line_no += 1
                continue
            before, part, after, cut = piece
            line_no += before
            if part:
                line_no += parser.block(part, line_no, cut.result() if cut is not None else None)
                line_no += after
    return parser.finish()
