"""The vectorised path of the NCCL log reader: a large block of lines is split and cut at the COLL markers
with pyarrow kernels, the lines that are clean COLL lines are found (`clean_coll`), the block is planned
into runs of such lines and the lines between them (`plan`), and each run becomes one Arrow table of rows
(`run_table`), exactly as the per-line path would make them one by one."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc

from .nccl_grammar import PIECE_BUFFERS, PIECE_HEAD, PIECE_TAIL

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


def split_lines(data: bytes) -> tuple[pa.Array, pa.Array]:
    """The lines of a block (without copying it) and where each starts in the block's buffer."""
    typ = pa.binary() if len(data) < 2**31 - 1 else pa.large_binary()
    offset_type = pa.int32() if typ == pa.binary() else pa.int64()
    ends = pa.array([0, len(data)], offset_type)
    whole = pa.Array.from_buffers(typ, 1, [None, ends.buffers()[1], pa.py_buffer(data)])  # no copy
    lines = pc.split_pattern(whole, b"\n").flatten()
    offsets = pa.Array.from_buffers(offset_type, len(lines) + 1, [None, lines.buffers()[1]], offset=lines.offset)
    return lines, offsets


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


def clean_coll(lines: pa.Array, arange: pa.Array) -> CleanColl | None:
    """Find the lines that `nccl_grammar.FAST` matches as COLL lines without NCCL text glued before or after.

    A line is cut at the first ": opCount ", the first space after it, the first " count " after that
    and the first space after that: prefix+head | opCount | "sendbuff .. recvbuff .." | count | "datatype
    .. stream ..". Each piece must fullmatch its part of `nccl_grammar.FAST` (`PIECE_*`, hex and decimal digits); the
    repeated pieces are checked once per distinct value. When all do, `nccl_grammar.FAST` matches the line with the
    same groups: each run of non-blanks or digits ends where the next literal starts, a head cannot contain
    ": opCount ", and the lazy prefix is the shortest for which the head matches, in `nccl_grammar.FAST` as in
    `PIECE_HEAD`. Lines where some piece does not match go to the per-line path, which decides exactly;
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
        h = PIECE_HEAD.fullmatch(text)
        if h is None or b"NCCL" in h.group(1) or b"opCount" in h.group(1):
            ids.append(-1)
        else:
            ids.append(heads.setdefault(h.group(2), len(heads)))
    head_id = pc.take(pa.array(ids, pa.int64()), enc.indices)
    tails: dict[bytes, int] = {}
    enc = pc.dictionary_encode(tail_piece)
    ids = []
    for text in enc.dictionary.to_pylist():
        t = PIECE_TAIL.fullmatch(text)
        ids.append(-1 if t is None or b"NCCL" in t.group(2) else tails.setdefault(t.group(1), len(tails)))
    tail_id = pc.take(pa.array(ids, pa.int64()), enc.indices)
    enc = pc.dictionary_encode(buf_piece)
    buf_ok = [PIECE_BUFFERS.fullmatch(b) is not None for b in enc.dictionary.to_pylist()]
    buf_ok = pc.take(pa.array(buf_ok, pa.bool_()), enc.indices)
    op_count, opc_ok = hex_int64(opc_piece)
    try:
        count_text = pc.cast(count_piece, pa.string())
        count_ok = pc.and_(pc.ascii_is_decimal(count_text), pc.less_equal(pc.binary_length(count_piece), 18))
    except pa.ArrowInvalid:  # not UTF-8
        count_text = None
        count_ok = pc.match_substring_regex(count_piece, r"^[0-9]{1,18}$")
    ok = pc.and_(
        pc.and_(pc.and_(pc.greater_equal(head_id, 0), pc.greater_equal(tail_id, 0)), buf_ok), pc.and_(opc_ok, count_ok)
    )
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
    return CleanColl(
        line=line,
        key=pc.add(pc.multiply(head_id, n_tails), tail_id),
        op_count=op_count,
        count=pc.cast(count_text if count_text is not None else pc.cast(count_piece, pa.string()), pa.int64()),
        heads=list(heads),
        tails=list(tails),
        n_tails=n_tails,
    )


# Nibble of each byte value; 16 for bytes that are not hex digits.
HEX_NIBBLE = pa.array([int(chr(b), 16) if chr(b) in "0123456789abcdefABCDEF" else 16 for b in range(256)], pa.uint8())


def hex_int64(text: pa.Array) -> tuple[pa.Array, pa.Array]:
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
    nibbles = pc.take(HEX_NIBBLE, digits)
    bad = pc.equal(nibbles, 16)
    if bad.offset or nibbles.offset:  # not expected from fresh kernel outputs
        raise AssertionError("unexpected array offset")
    bad_any = pa.Array.from_buffers(pa.uint16(), n, [None, bad.buffers()[1]])  # 16 flags per string
    ok = pc.and_(ok_len, pc.equal(bad_any, 0))
    pairs = pa.Array.from_buffers(pa.uint16(), n * 8, [None, nibbles.buffers()[1]])  # low nibble | high << 8
    packed = pc.bit_wise_or(pc.bit_wise_and(pairs, 0x0F), pc.bit_wise_and(pc.shift_right(pairs, 4), 0xF0))
    as_bytes = pc.cast(packed, pa.uint8())
    return pa.Array.from_buffers(pa.int64(), n, [None, as_bytes.buffers()[1]]), ok
