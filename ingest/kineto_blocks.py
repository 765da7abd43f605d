"""A run of whole traceEvents elements read as columns in C++ (pyarrow's JSON reader), for dense traces.

Kineto separates elements the same way throughout a file (`},\\n{` or `\\n  },\\n  {\\n`): every such
separator in a block is made a line break (lengths kept, so each element's text stays where it was) and
the block is read as newline-delimited JSON with an explicit schema of the fields the parse reads. A
separator inside a string or a nested value leaves pieces that are no JSON object, so a block whose
pieces all parse, one row each, was cut at real element boundaries (the pieces joined by commas are the
array). Newlines elsewhere become tabs: whitespace between tokens, an error inside a string, as in the
original. Anything the reader would take differently from orjson (NaN, a type that differs from the
schema, invalid UTF-8, escapes, which the fast scan's name regex does not see through) makes
`BlockReader.read` return None, and the caller reads that block event by event.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.json as pj

HEADER = [
    ("ph", pa.string()),
    ("cat", pa.string()),
    ("name", pa.string()),
    ("pid", pa.int64()),
    ("tid", pa.int64()),
    ("ts", pa.float64()),
    ("dur", pa.float64()),
]
IDS = [("External id", pa.int64()), ("correlation", pa.int64()), ("Seq", pa.int64())]


def schema(args: list[tuple[str, pa.DataType]]) -> pj.ParseOptions:
    """Parse options reading the header fields, the ids and these args (other fields are not checked)."""
    fields = [*HEADER, ("args", pa.struct(IDS + args))]
    return pj.ParseOptions(explicit_schema=pa.schema(fields), unexpected_field_behavior="ignore")


@dataclass
class Block:
    """The elements of a block: their fields as columns, and their texts (newlines made tabs)."""

    table: pa.Table
    offsets: np.ndarray  # element i is the text between offsets[i] and offsets[i + 1]
    body: np.ndarray  # the block's text (uint8), as pyarrow read it

    def text(self, i: int) -> bytes:
        return self.body[self.offsets[i] : self.offsets[i + 1]].tobytes()

    def args(self) -> dict[str, pa.Array]:
        """The args columns by key, null where the event has no args."""
        column = self.table.column("args").chunk(0)
        return {f.name: a for f, a in zip(column.type, column.flatten(), strict=True)}

    def nest(self) -> np.ndarray:
        """Each element's count of '{' and '[' (as the scanner's depth check counts them)."""
        where = _positions(self.body, lambda a: (a == 0x7B) | (a == 0x5B))
        return np.bincount(np.searchsorted(self.offsets, where, side="right") - 1, minlength=len(self.offsets) - 1)


class BlockReader:
    """Cuts and reads the blocks of one trace in one buffer kept between blocks (a fresh 8 MiB buffer per
    window costs its pages' faults each time)."""

    def __init__(self) -> None:
        self._buf = np.empty(0, dtype=np.uint8)

    def read(self, data: bytearray, start: int, end: int, sep: bytes, options: pj.ParseOptions) -> Block | None:
        """The elements of data[start:end] (whole elements separated by `sep`), or None where the block
        must be read event by event (see the module's docstring)."""
        if data.find(b"\\", start, end) >= 0 or data.find(b"\x00", start, end) >= 0:
            return None
        if b"\n" not in sep:  # a separator inside a string is possible: cut on the text's copy, as bytes
            body = bytes(memoryview(data)[start:end])
            nd = body.replace(b"}" + sep + b"{", b"}\n" + b" " * (len(sep) - 1) + b"{")
            return _read(np.frombuffer(nd, dtype=np.uint8), options)
        n = end - start
        if len(self._buf) < n:
            self._buf = np.empty(n + (n >> 3), dtype=np.uint8)
        a = self._buf[:n]
        a[:] = np.frombuffer(data, dtype=np.uint8, count=n, offset=start)
        newlines = _positions(a, lambda x: x == 0x0A)
        # each separator's first newline, back to the '}' before it: the cuts, checked byte by byte
        cut = newlines - sep.index(b"\n") - 1
        cut = cut[(cut >= 0) & (cut + len(sep) + 1 < n)]
        ok = a[cut] == 0x7D
        for j, byte in enumerate(sep + b"{"):
            ok &= a[cut + 1 + j] == byte
        cut = cut[ok]
        a[newlines] = 0x09  # newlines left inside events become tabs (whitespace, or an error in a string)
        a[cut + 1] = 0x0A
        for j in range(2, len(sep) + 1):
            a[cut + j] = 0x20
        return _read(a, options)


def _read(nd: np.ndarray, options: pj.ParseOptions) -> Block | None:
    """The block of NDJSON text `nd` (one element a line)."""
    if nd.max(initial=0) >= 0x80 and not _utf8(nd.tobytes()):
        return None
    ends = _positions(nd, lambda a: a == 0x0A)
    try:
        table = pj.read_json(
            pa.BufferReader(pa.py_buffer(nd)),
            read_options=pj.ReadOptions(use_threads=False, block_size=len(nd) + 1),
            parse_options=options,
        )
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    if table.num_rows != len(ends) + 1:
        return None  # a piece held more than one object
    offsets = np.empty(len(ends) + 2, dtype=np.int64)
    offsets[0], offsets[-1] = 0, len(nd)
    offsets[1:-1] = ends + 1
    return Block(table.combine_chunks(), offsets, nd)


def _positions(a: np.ndarray, test: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """Where test(bytes) holds, 256 KiB at a time (temporaries below glibc's mapping threshold are reused
    from the heap instead of mapped and faulted in anew)."""
    step = 1 << 18
    parts = [np.flatnonzero(test(a[i : i + step])) + i for i in range(0, len(a), step)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _utf8(body: bytes) -> bool:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
