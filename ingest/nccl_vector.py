"""The vectorised path of the NCCL log reader: a large block of lines is cut into words at its blanks with
numpy, the lines that are clean COLL lines are found (`clean_coll`), the block is planned
into runs of such lines and the lines between them (`plan`), and each run becomes one Arrow table of rows
(`run_table`), exactly as the per-line path would make them one by one."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .nccl_grammar import PIECE_HEAD, PIECE_TAIL

# Blocks of fewer lines, and runs of fewer clean COLL lines between other lines, take the per-line path:
# the vectorised path has a fixed cost per block and per run.
VECTOR_MIN_LINES = 4096
VECTOR_MIN_RUN = 256

# (row template, bytes per count, elems_in factor, elems_out factor, sequence cell); a template without
# row skips its lines, with the reason in the second place.
Template = tuple[Any, ...]


class Templates(Protocol):
    """Where row templates come from (the reader, which knows the processes and communicators)."""

    def cached_template(self, head: bytes, tail: bytes, line_no: Callable[[], int]) -> Template:
        """The template of lines with this head and tail; `line_no()` (the first such line) is asked only
        when the template is made."""

    def skip(self, reason: str, line_no: int, n: int = 1) -> None: ...


class Counting:
    """0 .. n-1 as int64, from one cached array."""

    def __init__(self) -> None:
        self._array = pa.array([], pa.int64())

    def __call__(self, n: int) -> pa.Array:
        if len(self._array) < n:
            self._array = pa.array(range(max(n, 2 * len(self._array))), pa.int64())
        return self._array.slice(0, n)


def counts_of(values: pa.Array) -> dict[Any, int]:
    """How often each value occurs."""
    vc = pc.value_counts(values)
    return dict(zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist(), strict=True))


def plan(lines: pa.Array, clean: CleanColl, arange: Counting) -> list[tuple[bool, int, int]]:
    """(vectorised, start, end) parts of a block in line order: runs of clean COLL lines long enough for the
    vectorised path (positions in `clean`), and the lines between them (line indices) for the per-line path,
    which a run only needs the state of."""
    n = len(lines)
    nv = len(clean.line)
    others: list[int] = []  # lines that are not clean COLL lines but mention NCCL: line by line
    if nv < n:
        rest = pc.indices_nonzero(pc.invert(pc.is_in(arange(n), value_set=clean.line)))
        texts = lines.take(rest).to_pylist()
        others = [i for i, t in zip(rest.to_pylist(), texts, strict=True) if b"CCL" in t or b"opCount" in t]
    vlines = clean.line.to_pylist() if others else None

    def v_line(p: int) -> int:
        return vlines[p] if vlines is not None else clean.line[p].as_py()

    parts: list[tuple[bool, int, int]] = []
    py_start: int | None = None
    pv = 0
    for s in [*others, n]:
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
    return parts


def run_table(
    clean: CleanColl, p0: int, p1: int, first_line: int, templates: Templates, arange: Counting
) -> pa.Table | None:
    """Rows of the clean COLL lines p0..p1-1 of `clean` as one Arrow table (None when every line is
    skipped), exactly as the per-line path would make them one by one."""
    n = p1 - p0
    enc = pc.dictionary_encode(clean.key.slice(p0, n))
    ind = enc.indices

    def line_of(u: int) -> int:  # the first line of template u
        return first_line + clean.line[p0 + pc.index(ind, u).as_py()].as_py()

    found = []
    for u, key in enumerate(enc.dictionary.to_pylist()):  # in order of first appearance
        head, tail = clean.heads[key // clean.n_tails], clean.tails[key % clean.n_tails]
        found.append(templates.cached_template(head, tail, lambda u=u: line_of(u)))  # type: ignore[misc]
    opc = clean.op_count.slice(p0, n)
    count = clean.count.slice(p0, n)
    if any(t[0] is None for t in found):
        counts = counts_of(ind)
        for u, t in enumerate(found):
            if t[0] is None:
                templates.skip(t[1], line_of(u), counts[u])
        keep = pc.take(pa.array([t[0] is not None for t in found]), ind)
        ind, opc, count = ind.filter(keep), opc.filter(keep), count.filter(keep)
        if not len(ind):
            return None
    return _table(found, ind, opc, count, arange)


def _table(templates: list[Template], ind: pa.Array, opc: pa.Array, count: pa.Array, arange: Counting) -> pa.Table:
    """The rows of template ind[i] with opCount opc[i] and count count[i]; each process counts on."""
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
        seq = pc.add(arange(m), cells[0][0])
        cells[0][0] += m
    else:
        seq = _sequence(pc.take(pa.array(cell_ids, pa.int32()), ind), cells, arange)

    def dict_col(k: str) -> pa.Array:
        return pa.DictionaryArray.from_arrays(ind, pa.array([r.get(k, "") for r in rows], pa.string()))

    def col(values: list[Any], typ: pa.DataType) -> pa.Array:
        return pc.take(pa.array(values, typ), ind)

    return pa.table(
        {
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
        }
    )


def _sequence(cell: pa.Array, cells: list[list[int]], arange: Counting) -> pa.Array:
    """Sequence numbers of rows whose process counter is cells[cell]: each counter counts on in row order."""
    m = len(cell)
    order = pc.sort_indices(cell)  # stable: row order within a counter
    in_order = pc.take(cell, order)
    counts = counts_of(cell)
    starts, first = [], 0
    for c in range(len(cells)):
        starts.append(cells[c][0] - first)  # seq = position in sorted order - first + counter
        first += counts.get(c, 0)
        cells[c][0] += counts.get(c, 0)
    ranked = pc.add(arange(m), pc.take(pa.array(starts, pa.int64()), in_order))
    return pc.take(ranked, pc.sort_indices(order))


@dataclass
class CleanColl:
    """The clean COLL lines of a block: line index, template key (head id x n_tails + tail id), opCount
    and count, one entry per line; heads and tails are the `nccl_grammar.FAST` head and tail groups by id."""

    line: pa.Array
    key: pa.Array
    op_count: pa.Array
    count: pa.Array
    heads: list[bytes]
    tails: list[bytes]
    n_tails: int


class Block:
    """A block of whole lines (the last without its newline) as numpy views of its bytes: where each line
    starts and ends, and unaligned little-endian words at every byte (for literal tests and prefixes)."""

    def __init__(self, data: bytes):
        self.data = data
        self.padded = data + b"\0" * 8  # a word read at the last bytes stays inside the buffer
        self.bytes = np.frombuffer(data, np.uint8)
        n = len(data)
        self.word = np.ndarray(shape=(n + 1,), dtype="<u8", buffer=self.padded, strides=(1,))
        self.word32 = np.ndarray(shape=(n + 1,), dtype="<i4", buffer=self.padded, strides=(1,))
        newlines = np.flatnonzero(self.bytes == 10)
        self.starts = np.concatenate(([0], newlines + 1))
        self.ends = np.concatenate((newlines, [n]))

    def __len__(self) -> int:
        return len(self.starts)

    def lines(self) -> pa.Array:
        """The lines as a binary array over the block's bytes (each with its newline; nothing copied)."""
        offsets = np.concatenate((self.starts, [len(self.data)])).astype(np.int64)
        return pa.Array.from_buffers(
            pa.large_binary(), len(self), [None, pa.py_buffer(offsets), pa.py_buffer(self.data)]
        )

    def views(self, begin: np.ndarray, end: np.ndarray) -> pa.Array:
        """The byte ranges [begin, end) of the block, each longer than 12 bytes, as an Arrow binary view
        array that points into the block (nothing copied)."""
        v = np.empty((len(begin), 4), np.int32)
        v[:, 0] = end - begin
        v[:, 1] = self.word32[begin]  # the view's 4-byte prefix
        v[:, 2] = 0  # buffer index
        v[:, 3] = begin
        return pa.Array.from_buffers(pa.binary_view(), len(begin), [None, pa.py_buffer(v), pa.py_buffer(self.data)])


def _word(text: bytes) -> int:
    return int.from_bytes(text.ljust(8, b"\0"), "little")


OPCOUNT_WORD = np.uint64(_word(b"opCount "))
# The literal words between the variable parts of a COLL line, by the blank before each (counted from the
# one before "opCount"): where, their length, and their bytes as a little-endian word with its mask.
LITERALS = ((2, b"sendbuff"), (4, b"recvbuff"), (6, b"count"), (8, b"datatype"), (17, b"stream"))
LITERAL_AT = np.array([k for k, _ in LITERALS])
LITERAL_LEN = np.array([len(t) for _, t in LITERALS])
LITERAL_WORD = np.array([_word(t) for _, t in LITERALS], np.uint64)
LITERAL_MASK = np.array([(1 << (8 * len(t))) - 1 for _, t in LITERALS], np.uint64)
HEX_NIBBLE = np.full(256, 16, np.uint8)
HEX_NIBBLE[list(b"0123456789")] = np.arange(10)
HEX_NIBBLE[list(b"abcdef")] = np.arange(10, 16)
HEX_NIBBLE[list(b"ABCDEF")] = np.arange(10, 16)


def clean_coll(block: Block) -> CleanColl | None:
    """Find the lines that `nccl_grammar.FAST` matches as COLL lines without NCCL text glued before or after.

    Blanks cut a COLL line into words: after the first ": opCount " come the opCount, "sendbuff", a
    buffer, "recvbuff", a buffer, "count", the count, "datatype", then eight words "D op O root R comm C
    [nranks=N]" (the tail), "stream" and the stream, then anything (the trailing text). The positions of
    the blanks and the 8-byte words at them (numpy over the whole block) test the literals; the text
    before ": opCount " (prefix + head) and the tail are checked once per distinct value against their
    parts of `nccl_grammar.FAST` (`PIECE_HEAD`, `PIECE_TAIL`); the opCount must be 1 to 15 hex digits and
    the count 1 to 18 decimal digits (larger numbers may not fit int64). When all hold, `FAST` matches the
    line with the same groups: `\\S+`, digits and hex digits cannot hold a blank, so each takes one word; a
    head cannot contain ": opCount ", and the lazy prefix is the shortest for which the head matches, in
    `FAST` as in `PIECE_HEAD`. Lines with other ASCII whitespace (tab, CR, VT, FF), with NCCL text in the
    prefix or the trailing text, or where anything else differs go to the per-line path, which decides."""
    b = block.bytes
    sp = np.flatnonzero(b == 32)
    ns = len(sp)
    if ns < 19:
        return None
    word = block.word
    colon = np.flatnonzero(b[np.maximum(sp - 1, 0)] == 58)  # a ": opCount " has its colon before the blank
    colon = colon[sp[colon] >= 1]
    cand = colon[word[sp[colon] + 1] == OPCOUNT_WORD]
    if not len(cand):
        return None
    line = np.searchsorted(block.starts, sp[cand], "right") - 1
    first = np.ones(len(cand), bool)  # the first ": opCount " of each line
    first[1:] = line[1:] != line[:-1]
    j, line = cand[first], line[first]
    ends = block.ends[line]
    ok = j + 18 < ns
    j, line, ends = j[ok], line[ok], ends[ok]
    s = sp[j[:, None] + np.arange(19)]  # blanks from the one before "opCount" to the one after "stream"
    ok = s[:, 18] < ends
    nxt = np.where(j + 19 < ns, sp[np.minimum(j + 19, ns - 1)], ends)
    post = np.minimum(nxt, ends)  # where the trailing text starts (the line's end when there is none)
    ok &= np.all(np.diff(s, axis=1) > 1, axis=1) & (post > s[:, 18] + 1)  # no word is empty
    at = s[:, LITERAL_AT]
    ok &= np.all(s[:, LITERAL_AT + 1] - at - 1 == LITERAL_LEN, axis=1)
    ok &= np.all(word[at + 1] & LITERAL_MASK == LITERAL_WORD, axis=1)
    opc_len = s[:, 2] - s[:, 1] - 1
    count_len = s[:, 8] - s[:, 7] - 1
    ok &= (opc_len <= 15) & (count_len <= 18)
    if np.count_nonzero(b - np.uint8(9) < 5) > len(block) - 1:  # other whitespace: those lines go line by line
        ws = np.flatnonzero((b >= 9) & (b <= 13) & (b != 10))
        ok &= ~np.isin(line, np.searchsorted(block.starts, ws, "right") - 1)
    sel = np.flatnonzero(ok)
    if not len(sel):
        return None
    s, line, post, ends = s[sel], line[sel], post[sel], ends[sel]
    op_count, opc_ok = _hex(b, s[:, 2], opc_len[sel])
    count, count_ok = _decimal(b, s[:, 8], count_len[sel])
    ok = opc_ok & count_ok
    with_post = np.flatnonzero(post < ends)
    if len(with_post):
        data = block.data
        ok[with_post] &= [
            b"NCCL" not in data[p:e] for p, e in zip(post[with_post].tolist(), ends[with_post].tolist(), strict=True)
        ]

    line_starts = block.starts[line]
    head_end = s[:, 0] - 1
    ok &= head_end - line_starts > 12  # a shorter head cannot match
    heads: dict[bytes, int] = {}
    head_id = _ids(block.views(line_starts[ok], head_end[ok]), lambda text: _head(text, heads))
    tails: dict[bytes, int] = {}
    tail_id = _ids(block.views(s[ok, 9] + 1, s[ok, 17]), lambda text: _tail(text, tails))
    keep = (head_id >= 0) & (tail_id >= 0)
    rows = np.flatnonzero(ok)[keep]
    if not len(rows):
        return None
    n_tails = len(tails)
    return CleanColl(
        line=_int64(line[rows]),
        key=_int64(head_id[keep] * n_tails + tail_id[keep]),
        op_count=_int64(op_count[rows]),
        count=_int64(count[rows]),
        heads=list(heads),
        tails=list(tails),
        n_tails=n_tails,
    )


def _int64(values: np.ndarray) -> pa.Array:
    values = np.ascontiguousarray(values, np.int64)
    return pa.Array.from_buffers(pa.int64(), len(values), [None, pa.py_buffer(values)])


def _ids(values: pa.Array, check: Callable[[bytes], int]) -> np.ndarray:
    """The id `check` gives each value's text (-1: not valid), asking once per distinct value."""
    if not len(values):
        return np.empty(0, np.int64)
    enc = pc.dictionary_encode(values)
    ids = np.array([check(t) for t in enc.dictionary.to_pylist()], np.int64)
    return ids[enc.indices.to_numpy()]


def _head(text: bytes, heads: dict[bytes, int]) -> int:
    h = PIECE_HEAD.fullmatch(text)
    if h is None or b"NCCL" in h.group(1) or b"opCount" in h.group(1):
        return -1
    return heads.setdefault(h.group(2), len(heads))


def _tail(text: bytes, tails: dict[bytes, int]) -> int:
    return tails.setdefault(text, len(tails)) if PIECE_TAIL.fullmatch(text) else -1


def _hex(b: np.ndarray, end: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hex numbers of 1 to 15 digits ending before `end` as int64, and which were all hex digits."""
    cols = np.arange(-int(length.max()), 0)
    nib = HEX_NIBBLE[b[np.maximum(end[:, None] + cols, 0)]]
    inside = cols >= -length[:, None]
    nib = np.where(inside, nib, 0)
    ok = np.all(nib < 16, axis=1)
    value = (nib.astype(np.int64) << (4 * (-1 - cols))).sum(axis=1)
    return value, ok


def _decimal(b: np.ndarray, end: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decimal numbers of 1 to 18 digits ending before `end` as int64, and which were all digits."""
    cols = np.arange(-int(length.max()), 0)
    digit = b[np.maximum(end[:, None] + cols, 0)].astype(np.int64) - 48
    inside = cols >= -length[:, None]
    digit = np.where(inside, digit, 0)
    ok = np.all((digit >= 0) & (digit <= 9), axis=1)
    value = digit @ (10 ** (-1 - cols)).astype(np.int64)
    return value, ok
