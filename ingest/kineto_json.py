"""Streaming reader for Kineto (Chrome trace) JSON that never builds the whole document.

The document is `{"key": value, ..., "traceEvents": [event, ...], ...}`. Top-level values other than
`traceEvents` are small and parsed exactly. Events are read in one of two modes:

- exact: the array is cut into batches at candidate element boundaries (`}` `,` `{`); each batch is
  parsed with orjson, which also proves the cut was a real boundary (a cut inside a string or inside a
  nested object leaves the batch unterminated and the batch is extended to the next candidate). Every
  event is parsed and checked, so errors carry `$.traceEvents[i]`. Used for the first EXACT_BYTES of
  the array (a small trace is validated in full) and wherever the fast mode is unsure.
- fast: a regex finds `"name": "<prefix>` for the name prefixes the caller cares about; only the
  enclosing event is cut out (backwards to a `{` that follows `,`/`[`, forwards to `}` followed by
  `,{` or `]`) and parsed. A successful parse proves both cuts (a cut inside a string cannot parse).
  Everything between the last proven boundary and the scan head is kept, so when a cut fails to
  parse the region is re-read in exact mode. Events the caller does not want are never parsed, so a
  syntax error inside them goes unnoticed; structure, truncation and every event that is read are
  still checked.
- blocks (fast mode, where wanted events are dense and the caller gives `on_block`): each window's run
  of whole events, up to the last separator like the one before the window's first event, is handed to
  the caller at once (kineto_blocks and kineto_bulk read it as columns); a run it declines is scanned
  as above.

Decompression (the stream's read) runs in a background thread: zlib releases the GIL, so it overlaps
with the regex scan on the caller's thread.
"""

from __future__ import annotations

import contextlib
import io
import queue
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from .records import ParseError

BLOCK = 8 << 20  # bytes per read from the decompressed stream
EXACT_BYTES = 2 << 20  # the first bytes of traceEvents are parsed in full
BATCH = 1 << 20  # exact-mode batch size
RETAIN = 16 << 20  # fast mode proves a boundary near the scan head once this much is unproven
_WS = b" \t\r\n"

_BOUND = re.compile(rb"}\s*,\s*(?={)")  # between two object elements: '}' ... up to the next '{'
_END = re.compile(rb"}\s*(?:,\s*(?={)|])")  # end of an object element: before the next one or the array end
_STRUCT = re.compile(rb'[{}\[\]",]')
_STR_TAIL = re.compile(rb'(?:[^"\\]|\\.)*"', re.S)
_SCALAR = re.compile(rb'[^\s,\]}{\[":]+')
_NONWS = re.compile(rb"[^ \t\r\n]")
# A runtime launch event in Kineto's own key order, read with one regex instead of being cut out and
# parsed: these are the most frequent wanted events (one per kernel) and four numbers are needed.
_LAUNCH = re.compile(
    rb'"name"\s*:\s*"((?:cu|hip)\w*Launch\w*)",\s*"pid"\s*:\s*(-?\d+),\s*"tid"\s*:\s*(-?\d+),'
    rb'\s*"ts"\s*:\s*(-?\d+(?:\.\d+)?),\s*"dur"\s*:\s*(-?\d+(?:\.\d+)?),'
    rb'\s*"args"\s*:\s*\{\s*(?:"External id"\s*:\s*(\d+)\s*,)?[^{}]*?"correlation"\s*:\s*(\d+)[^{}]*\}\s*\}'
)
LaunchSink = Callable[[int, int, float, int, "int | None"], bool]
# Activity (device kernels, copies, memsets; CPU ops) read straight from the bytes as they stream past,
# whatever the reading mode: the header in Kineto's key order (category, name, pid, tid, ts, dur), then
# the flat args object for a device event's stream and bytes. Only the name's first bytes are kept.
_ACT_HEAD = (
    rb'"name"\s*:\s*"([^"\\]{0,16})[^"\\]*(?:\\.[^"\\]*)*"\s*,\s*"pid"\s*:\s*(?:-?\d+|"[^"]*")\s*,'
    rb'\s*"tid"\s*:\s*(-?\d+)\s*,\s*"ts"\s*:\s*(-?\d+(?:\.\d+)?)\s*,\s*"dur"\s*:\s*(-?\d+(?:\.\d+)?)'
)
_ACT_ALL = re.compile(rb'"cat"\s*:\s*"(kernel|gpu_memcpy|gpu_memset|cpu_op)"\s*,\s*' + _ACT_HEAD)
_ACT_DEVICE = re.compile(rb'"cat"\s*:\s*"(kernel|gpu_memcpy|gpu_memset)"\s*,\s*' + _ACT_HEAD)
_ACT_ARGS = re.compile(rb'\s*,\s*"args"\s*:\s*\{([^{}]*)\}')
_ACT_STREAM = re.compile(rb'"stream"\s*:\s*(-?\d+)')
_ACT_BYTES = re.compile(rb'"bytes"\s*:\s*(\d+)')
_ACT_MARGIN = 1 << 16  # an activity header is matched only with this much of the document after it
# (category, name's first bytes, tid, ts, dur, stream or None, bytes); returns whether CPU ops are
# still wanted (a trace with device activity needs none).
ActivitySink = Callable[[bytes, bytes, int, float, float, "int | None", int], bool]
# (the window, where a run of whole elements starts and ends in it, what separates them, whether it must take
# their device activity as on_activity would) -> wanted events taken, or None: read it event by event. The
# sink reads the window during the call only.
BlockSink = Callable[[bytearray, int, int, bytes, bool], "int | None"]
DENSE = 1536  # wanted events per MiB from which a window is read as a block (else by the name regex)
BLOCK_PAUSE = 4  # windows read by the regex after a declined block before a block is tried again


def _dense(wanted: int, nbytes: int) -> bool:
    return nbytes > 0 and wanted * (1 << 20) >= DENSE * nbytes


def _separator(data: bytes | bytearray, start: int) -> bytes | None:
    """The whitespace and comma between the element that ends before data[start] and the one at data[start]
    (a proven element start), or None when data[start] does not follow another element's '}'."""
    i = start - 1
    while i >= 0 and data[i] in b" \t\r\n,":
        i -= 1
    sep = bytes(data[i + 1 : start])
    if i < 0 or data[i] != 0x7D or sep.count(b",") != 1:
        return None
    return sep


def hit_pattern(prefixes: str) -> re.Pattern[bytes]:
    """The fast-mode regex: `name": "` followed by one of the (non-capturing) name prefixes.

    Without the opening quote the regex runs ~15% faster; a hit at the end of another key
    ("thread_name") only costs a parse, the event's real name decides."""
    return re.compile(rb'name"\s*:\s*"(?:' + prefixes.encode() + b")")


class _NeedMoreError(Exception):
    """The value continues past the end of the buffered window."""


@dataclass
class ScanResult:
    top: dict[str, Any] = field(default_factory=dict)  # top-level keys other than traceEvents
    has_events: bool = False
    events_total: int | None = None  # every element of traceEvents, when all were counted
    events_parsed: int = 0
    fast_bytes: int = 0  # bytes of traceEvents read in fast mode
    fallbacks: int = 0  # fast-mode regions re-read exactly
    decompressed_bytes: int = 0


# --------------------------------------------------------------------------------- block reader


POOL = 3  # block buffers: the consumer copies one out while the reader has read at most two ahead


class _StoppedError(Exception):
    """The consumer closed the reader while it waited for a buffer."""


class _BlockReader:
    """Reads the stream in large blocks on a background thread (decompression releases the GIL)."""

    def __init__(self, stream: io.BufferedIOBase, block: int):
        self._stream = stream
        self._block = block
        self._queue: queue.Queue = queue.Queue(maxsize=2)
        self._free: queue.Queue[bytearray] = queue.Queue()  # buffers the consumer has copied out
        self._made = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kineto-reader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                buf = self._buffer()
                n = self._fill(buf)
                self._put((buf, n))
                if not n:
                    return
        except BaseException as exc:  # handed to the consumer
            self._put(exc)

    def _buffer(self) -> bytearray:
        """A block's buffer: one handed back by the consumer, else a new one (at most POOL in all)."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        if self._made < POOL:
            self._made += 1
            return bytearray(self._block)
        while True:
            try:
                return self._free.get(timeout=0.1)
            except queue.Empty:
                if self._stop.is_set():
                    raise _StoppedError from None

    def _fill(self, buf: bytearray) -> int:
        """Read into buf until it is full or the stream ends; the bytes read."""
        n = 0
        with memoryview(buf) as view:
            while n < len(buf):
                got = self._stream.readinto(view[n:])
                if not got:
                    break
                n += got
        return n

    def _put(self, item: Any) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def get(self) -> tuple[bytearray, int]:
        """The next block: its buffer and length (0 at the end); hand the buffer back with release()."""
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def release(self, buf: bytearray) -> None:
        self._free.put(buf)

    def close(self) -> None:
        self._stop.set()
        while self._thread.is_alive():
            with contextlib.suppress(queue.Empty):
                self._queue.get(timeout=0.05)
        self._thread.join()


class _Window:
    """The buffered part of the document, with absolute offsets and line numbers for messages.

    Counting lines costs as much as the fast scan itself, so data dropped in fast mode is not
    counted; past that point errors give the byte offset in the decompressed file instead."""

    def __init__(self, reader: _BlockReader, on_activity: ActivitySink | None = None):
        self._reader = reader
        self.data = bytearray()  # one allocation for the whole scan where it can (_next_block)
        self.base = 0  # absolute offset of data[0]
        self.lines: int | None = 0  # newlines before data[0], while known
        self.col0 = 0  # bytes after the last newline before data[0]
        self.eof = False
        self.count_lines = True
        self.on_activity = on_activity
        self.cpu_ops = True  # whether CPU ops are still read as activity
        self._act_pos = 0  # activity is read up to here (relative to data[0])

    def activity(self, stop: int) -> None:
        """Hand the activity whose header starts before data[stop] to on_activity (every byte of the
        document passes here once, before it is dropped, whichever mode read it)."""
        if self.on_activity is None:
            return
        while stop > self._act_pos and self._read_activity(stop):
            pass  # CPU ops are no longer wanted: on with the device-only pattern
        self._act_pos = max(self._act_pos, stop)

    def skip_activity(self, stop: int) -> None:
        """The activity before data[stop] was handed over otherwise (a block sink took it)."""
        self._act_pos = max(self._act_pos, stop)

    def _read_activity(self, stop: int) -> bool:
        """Read activity from _act_pos up to stop; True when it stopped early to drop CPU ops."""
        assert self.on_activity is not None
        data, sink = self.data, self.on_activity
        for m in (_ACT_ALL if self.cpu_ops else _ACT_DEVICE).finditer(data, self._act_pos):
            if m.start() >= stop:
                return False
            self._act_pos = m.end()
            cat, name, tid, ts, dur = m.groups()
            stream, nbytes = None, 0
            if cat != b"cpu_op":
                a = _ACT_ARGS.match(data, self._act_pos)
                if a is not None:
                    args = a.group(1)
                    sm = _ACT_STREAM.search(args)
                    stream = int(sm.group(1)) if sm else None
                    bm = _ACT_BYTES.search(args) if cat == b"gpu_memcpy" else None
                    nbytes = int(bm.group(1)) if bm else 0
            if not sink(cat, name, int(tid), float(ts), float(dur), stream, nbytes) and self.cpu_ops:
                self.cpu_ops = False
                return True
        return False

    def more(self, keep_from: int) -> int:
        """Drop data[:keep_from], append the next block; return keep_from (the shift of positions)."""
        if self.on_activity is not None:
            if not self.eof and len(self.data) - keep_from < _ACT_MARGIN:
                return self._more_with_activity(keep_from)
            self.activity(keep_from)  # every header before keep_from is whole in the window
            self._act_pos = max(0, self._act_pos - keep_from)
        self._count_dropped(keep_from)
        self.base += keep_from
        self._next_block(keep_from)
        return keep_from

    def _next_block(self, drop: int = 0) -> None:
        """Drop data[:drop] and append the next block (none at the end: eof), in the buffer's own memory.
        A bytearray whose front was deleted moves to a new allocation when it grows next, and a new large
        allocation is fresh pages the kernel must zero: that churn was ~12% of a scan's CPU."""
        if self.eof:
            self._drop(drop)
            return
        buf, n = self._reader.get()
        if not n:
            self.eof = True
            self._drop(drop)
        else:
            data = self.data
            kept = len(data) - drop
            self._drop(drop, shrink=False)
            # over the dropped bytes, growing in place when longer; a value other than a bytearray would be
            # copied into a new one first
            data[kept : kept + n] = buf if n == len(buf) else buf[:n]
            del data[kept + n :]
        self._reader.release(buf)

    def _drop(self, drop: int, shrink: bool = True) -> None:
        """Move data[drop:] to the front (the buffer keeps its allocation); shrink: cut the rest off."""
        data = self.data
        if drop:
            kept = len(data) - drop
            if kept:
                with memoryview(data) as view:
                    moved = np.frombuffer(view, dtype=np.uint8)
                    moved[:kept] = moved[drop:]  # numpy copies overlapping ranges as memmove does
                    del moved
            if shrink:
                del data[kept:]

    def _more_with_activity(self, keep_from: int) -> int:
        """more() when a header before keep_from may reach past the window: the next block is appended
        before the dropped part is read."""
        self._next_block()
        self.activity(keep_from)
        self._act_pos -= keep_from
        self._count_dropped(keep_from)
        self.base += keep_from
        self._drop(keep_from)
        return keep_from

    def _count_dropped(self, keep_from: int) -> None:
        if self.lines is not None and keep_from:
            if self.count_lines:
                nl = self.data.count(b"\n", 0, keep_from)
                if nl:
                    self.lines += nl
                    self.col0 = keep_from - self.data.rfind(b"\n", 0, keep_from) - 1
                else:
                    self.col0 += keep_from
            else:
                self.lines = None

    def loc(self, pos: int) -> str:
        pos = max(0, min(pos, len(self.data)))
        if self.lines is None:
            return f"byte {self.base + pos}"
        nl = self.data.count(b"\n", 0, pos)
        col = pos - self.data.rfind(b"\n", 0, pos) if nl else self.col0 + pos + 1
        return f"line {self.lines + nl + 1} column {col}"


# --------------------------------------------------------------------------------- helpers


def _path(parts: list[Any]) -> str:
    """'$.traceEvents[3].args.x'; an unknown index is written [?]."""
    out = "$"
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) or p == "?" else f".{p}"
    return out


def _decode_key(raw: bytes) -> str:
    try:
        return orjson.loads(b'"' + raw + b'"')
    except orjson.JSONDecodeError:
        return raw.decode("utf-8", "replace")


def _skip_value(data: bytes | bytearray, pos: int, prefix: list[Any], depth0: int, max_depth: int, win: _Window) -> int:  # noqa: C901 - the trace scanner's hot path: one flat loop per byte class, measured (bench/ingest.py)
    """End (exclusive) of the JSON value starting at data[pos]; checks nesting depth with its path."""
    c = data[pos : pos + 1]
    if c == b'"':
        m = _STR_TAIL.match(data, pos + 1)
        if m is None:
            raise _NeedMoreError
        return m.end()
    if c not in (b"{", b"["):
        m = _SCALAR.match(data, pos)
        if m is None:
            raise ParseError("invalid JSON: expected a value", win.loc(pos))
        if m.end() >= len(data) and not win.eof:
            raise _NeedMoreError
        return m.end()
    stack: list[list[Any]] = []  # [is_object, key or index, expecting a key]
    i = pos
    while True:
        m = _STRUCT.search(data, i)
        if m is None:
            raise _NeedMoreError
        j = m.start()
        ch = data[j]
        if ch == 0x22:  # '"'
            e = _STR_TAIL.match(data, j + 1)
            if e is None:
                raise _NeedMoreError
            top = stack[-1]
            if top[0] and top[2]:
                top[1] = data[j + 1 : e.end() - 1]
                top[2] = False
            i = e.end()
        elif ch in (0x7B, 0x5B):  # '{' '['
            stack.append([ch == 0x7B, None if ch == 0x7B else 0, ch == 0x7B])
            if depth0 + len(stack) > max_depth:
                parts = list(prefix)
                for obj, key, _ in stack[:-1]:
                    parts.append(_decode_key(bytes(key)) if obj and isinstance(key, (bytes, bytearray)) else key)
                raise ParseError(f"JSON nested deeper than {max_depth} levels", f"{_path(parts)} ({win.loc(j)})")
            i = j + 1
        elif ch in (0x7D, 0x5D):  # '}' ']'
            stack.pop()
            i = j + 1
            if not stack:
                return i
        else:  # ','
            top = stack[-1]
            if top[0]:
                top[2] = True
            else:
                top[1] += 1
            i = j + 1


def _depth_path(value: Any, budget: int) -> list[Any] | None:
    """Path to a container nested more than `budget` levels deep in `value` (itself level 1), or None."""
    if budget < 1:
        return []
    items = value.items() if type(value) is dict else enumerate(value)
    for k, x in items:
        if type(x) is dict or type(x) is list:
            sub = _depth_path(x, budget - 1)
            if sub is not None:
                return [k, *sub]
    return None


# --------------------------------------------------------------------------------- the scanner


class _Scanner:
    def __init__(
        self,
        stream: io.BufferedIOBase,
        max_depth: int,
        prefixes: str,
        wanted: Callable[[dict], bool],
        on_event: Callable[[dict], None],
        launch_prefixes: str | None,
        on_launch: LaunchSink | None,
        on_activity: ActivitySink | None = None,
        on_block: BlockSink | None = None,
    ):
        self.on_launch = on_launch if launch_prefixes else None
        self.on_block = on_block
        self.dense = False  # whether the next window is read as a block (on_block)
        self.block_pause = 0  # windows left before a block is tried again after one was declined
        self.launches = 0  # launches handed to on_launch
        self.start = 0  # absolute offset of the first element of traceEvents
        self.sep: bytes | None = None  # what separates two elements (the first seen before a proven start)
        self.prefixes = prefixes
        self.hit = hit_pattern(prefixes + ("|" + launch_prefixes if launch_prefixes else ""))
        self.reader = _BlockReader(stream, BLOCK)
        self.win = _Window(self.reader, on_activity)
        self.max_depth = max_depth
        self.wanted = wanted
        self.on_event = on_event
        self.result = ScanResult()
        self.index: int | None = 0  # index of the element at self.pos, while every element was counted
        self.pos = 0

    # ---- low-level helpers

    def _ensure(self, pos: int, n: int = 1) -> int:
        """Make data[pos:pos+n] available (reading more); returns the possibly shifted pos."""
        while len(self.win.data) < pos + n and not self.win.eof:
            pos -= self.win.more(0)
        return pos

    def _skip_ws(self, pos: int) -> int:
        while True:
            m = _NONWS.search(self.win.data, pos)
            if m is not None:
                return m.start()
            if self.win.eof:
                return len(self.win.data)
            pos = len(self.win.data)
            pos -= self.win.more(pos)

    def _truncated(self, where: str) -> ParseError:
        return ParseError(f"truncated JSON: the document ends inside {where}", self.win.loc(len(self.win.data)))

    def _value(self, pos: int, parts: list[Any], depth0: int) -> tuple[Any, int]:
        """Parse the value at pos exactly; returns (value, end)."""
        while True:
            try:
                end = _skip_value(self.win.data, pos, parts, depth0, self.max_depth, self.win)
                break
            except _NeedMoreError:
                if self.win.eof:
                    raise self._truncated(_path(parts)) from None
                pos -= self.win.more(pos)
        try:
            return orjson.loads(self.win.data[pos:end]), end
        except orjson.JSONDecodeError as exc:
            raise self._json_error(exc, self.win.data[pos:end], pos, _path(parts)) from None

    def _json_error(self, exc: orjson.JSONDecodeError, doc: bytes | bytearray, doc_pos: int, where: str) -> ParseError:
        """A ParseError at the absolute place of an orjson error in `doc`, which starts at data[doc_pos]."""
        bpos = len(doc.decode("utf-8", "replace")[: exc.pos].encode("utf-8"))
        loc = self.win.loc(doc_pos + min(bpos, len(doc)))
        if "depth" in exc.msg or "recursion" in exc.msg:
            return ParseError(f"JSON nested too deeply ({exc.msg})", f"{where} ({loc})")
        text = doc.decode("utf-8", "replace")
        number = re.match(r"-?(NaN|Infinity)", text[exc.pos - (text[exc.pos - 1 : exc.pos] == "-") :])
        if number is not None:  # Python's json.dump writes these; JSON has no such numbers
            key = re.search(r'"([^"\\]{1,200})"\s*:\s*-?$', text[max(0, exc.pos - 300) : exc.pos])
            field = f" (the value of {key.group(1)!r})" if key else ""
            return ParseError(
                f"{number.group(0)}{field} is not a JSON number (a value written by a NaN/Infinity-permitting "
                "encoder); the trace's writer must write finite numbers or null",
                f"{where} ({loc})",
            )
        return ParseError(f"invalid JSON: {exc.msg}", f"{where} ({loc})")

    # ---- document level

    def run(self) -> ScanResult:
        try:
            self._document()
            self.win.activity(len(self.win.data))
        finally:
            self.reader.close()
        return self.result

    def _document(self) -> None:  # noqa: C901 - the trace scanner's hot path: one flat loop per byte class, measured (bench/ingest.py)
        pos = self._ensure(0, 3)
        if self.win.data.startswith(b"\xef\xbb\xbf"):
            pos = 3
        pos = self._skip_ws(pos)
        if pos >= len(self.win.data):
            raise ParseError("empty document: not a Kineto trace", "line 1")
        first = self.win.data[pos : pos + 1]
        if first == b"[":
            raise ParseError("a JSON array, not a Kineto trace (expected an object with 'traceEvents')", "$")
        if first != b"{":
            raise ParseError("not JSON: a Kineto trace is a JSON object", self.win.loc(pos))
        pos = self._skip_ws(pos + 1)
        if self.win.data[pos : pos + 1] == b"}":
            pos += 1
        else:
            while True:
                if self.win.data[pos : pos + 1] != b'"':
                    if pos >= len(self.win.data):
                        raise self._truncated("the top-level object")
                    raise ParseError("invalid JSON: expected a key string", self.win.loc(pos))
                key, pos = self._value(pos, [], 1)
                pos = self._skip_ws(pos)
                if self.win.data[pos : pos + 1] != b":":
                    if pos >= len(self.win.data):
                        raise self._truncated(_path([key]))
                    raise ParseError("invalid JSON: expected ':' after a key", self.win.loc(pos))
                pos = self._skip_ws(pos + 1)
                if pos >= len(self.win.data):
                    raise self._truncated(_path([key]))
                if key == "traceEvents":
                    if self.result.has_events:
                        raise ParseError("'traceEvents' appears twice", "$.traceEvents")
                    self.result.has_events = True
                    if self.win.data[pos : pos + 1] != b"[":
                        value, _ = self._value(pos, ["traceEvents"], 1)
                        raise ParseError(
                            f"'traceEvents' is {type(value).__name__}, not a list: not a Kineto trace", "$.traceEvents"
                        )
                    pos = self._events(pos + 1)
                else:
                    value, pos = self._value(pos, [key], 1)
                    self.result.top[key] = value
                pos = self._skip_ws(pos)
                c = self.win.data[pos : pos + 1]
                if c == b",":
                    pos = self._skip_ws(pos + 1)
                    continue
                if c == b"}":
                    pos += 1
                    break
                if not c:
                    raise self._truncated("the top-level object")
                raise ParseError("invalid JSON: expected ',' or '}' in the top-level object", self.win.loc(pos))
        pos = self._skip_ws(pos)
        if pos < len(self.win.data):
            raise ParseError("invalid JSON: extra data after the end of the document", self.win.loc(pos))
        self.result.decompressed_bytes = self.win.base + len(self.win.data)
        if not self.result.has_events:
            raise ParseError("no 'traceEvents' list: not a Kineto trace", "$")

    # ---- traceEvents

    def _events(self, pos: int) -> int:
        """Read the array whose '[' was just before pos; return the position after its ']'."""
        if self.result.top.get("deviceProperties"):
            self.win.cpu_ops = False  # the trace lists devices: its activity is theirs, CPU ops are not read
        self.pos = self._skip_ws(pos)
        start_abs = self.start = self.win.base + self.pos
        done = False
        while not done:
            budget_end = start_abs + EXACT_BYTES if self.index is not None else 0
            done = self._exact(until_abs=budget_end) if self.win.base + self.pos < budget_end else self._fast()
        if self.index is not None:
            self.result.events_total = self.index
        return self.pos + 1  # after ']'

    def _element(self, value: Any, where_pos: int, raw: bytes | bytearray | None = None) -> None:
        """Handle one parsed element of traceEvents (`raw`: its text, when at hand)."""
        if not isinstance(value, dict):
            idx = "?" if self.index is None else self.index
            raise ParseError(
                f"an event that is not an object ({type(value).__name__})",
                f"{_path(['traceEvents', idx])} ({self.win.loc(where_pos)})",
            )
        if self.wanted(value):
            shallow = raw is not None and raw.count(b"[") + raw.count(b"{") <= self.max_depth - 2
            deep = None if shallow else _depth_path(value, self.max_depth - 2)
            if deep is not None:
                idx = "?" if self.index is None else self.index
                raise ParseError(
                    f"JSON nested deeper than {self.max_depth} levels",
                    f"{_path(['traceEvents', idx, *deep])} ({self.win.loc(where_pos)})",
                )
            self.result.events_parsed += 1
            self.on_event(value)

    def _exact(self, until_abs: int | None) -> bool:
        """Parse elements from self.pos in batches until self.pos passes until_abs; True at the array end."""
        while True:
            self.pos = self._ensure(self.pos, 2)
            data = self.win.data
            if self.pos >= len(data):
                raise self._truncated("$.traceEvents")
            if data[self.pos] == 0x5D:  # ']'
                return True
            if until_abs is not None and self.win.base + self.pos >= until_abs:
                return False
            m = self._batch_cut()
            data = self.win.data
            items = None
            while m is not None:
                doc = b"[" + data[self.pos : m.start() + 1] + b"]"
                try:
                    items = orjson.loads(doc)
                    break
                except orjson.JSONDecodeError as exc:
                    if "end of data" in exc.msg or exc.pos >= len(doc) - 1:
                        m = _BOUND.search(data, m.end())  # the cut was inside a string or a nested value
                        continue
                    # the array ends (or the text is broken) inside the batch: cut before that point
                    bpos = self.pos - 1 + len(doc.decode("utf-8", "replace")[: exc.pos].encode("utf-8"))
                    m = None
                    for m in _BOUND.finditer(data, self.pos, max(bpos, self.pos)):  # noqa: B007 - the last one
                        pass
            if items is None:
                # the first element or the rest of the array, one element at a time and exactly
                if self._elements(1 if m is None and self._more_boundaries() else None):
                    return True
                continue
            base = self.pos
            for value in items:
                self._element(value, base)
                if self.index is not None:
                    self.index += 1
            self.pos = m.end()  # type: ignore[union-attr]

    def _more_boundaries(self) -> bool:
        return _BOUND.search(self.win.data, self.pos) is not None

    def _batch_cut(self) -> re.Match[bytes] | None:
        """A candidate boundary about BATCH bytes after self.pos (the last one when less is left)."""
        while self.pos + BATCH >= len(self.win.data) and not self.win.eof:
            self.pos -= self.win.more(self.pos)
        data = self.win.data
        if self.pos + BATCH < len(data):
            m = _BOUND.search(data, self.pos + BATCH)
            if m is not None:
                return m
        last = None
        for last in _BOUND.finditer(data, self.pos):  # noqa: B007 - the last one
            pass
        return last

    def _one_element(self, idx: int | str) -> tuple[Any, int]:
        """The element at self.pos and its end. An object is tried against the next few candidate ends
        with orjson, whose message and position are precise for broken text; anything else (and an
        object whose every candidate end falls inside a string) goes through the tokenizer."""
        data = self.win.data
        where = _path(["traceEvents", idx])
        if data[self.pos] == 0x7B:  # '{'
            e = _END.search(data, self.pos)
            for _ in range(8):
                if e is None:
                    break
                text = data[self.pos : e.start() + 1]
                try:
                    return orjson.loads(text), e.start() + 1
                except orjson.JSONDecodeError as exc:
                    if "after document" in exc.msg:  # the object ended before this candidate
                        cut = len(bytes(text).decode("utf-8", "replace")[: exc.pos].encode("utf-8"))
                        return orjson.loads(text[:cut]), self.pos + cut
                    if not ("end of data" in exc.msg or exc.pos >= len(text) - 1):
                        raise self._json_error(exc, bytes(text), self.pos, where) from None
                e = _END.search(data, e.end())
        return self._value(self.pos, ["traceEvents", idx], 2)

    def _elements(self, count: int | None) -> bool:
        """`count` elements (all when None) read one by one with the exact tokenizer; True at ']'."""
        while count is None or count > 0:
            self.pos = self._skip_ws(self.pos)
            data = self.win.data
            if self.pos >= len(data):
                raise self._truncated("$.traceEvents")
            if data[self.pos] == 0x5D:
                return True
            idx = "?" if self.index is None else self.index
            value, end = self._one_element(idx)
            self._element(value, self.pos)
            if self.index is not None:
                self.index += 1
            self.pos = self._skip_ws(end)
            c = self.win.data[self.pos : self.pos + 1]
            if c == b",":
                self.pos = self._skip_ws(self.pos + 1)
            elif c != b"]":
                if not c:
                    raise self._truncated("$.traceEvents")
                raise ParseError(
                    "invalid JSON: expected ',' or ']' after an event",
                    f"{_path(['traceEvents', idx])} ({self.win.loc(self.pos)})",
                )
            if count is not None:
                count -= 1
        return False

    def _event_start(self, data: bytes | bytearray, p: int, lower: int) -> int | None:
        """The '{' that opens the element containing p: the nearest one preceded by ',' or '['."""
        i = p
        while True:
            i = data.rfind(b"{", lower, i)
            if i < 0:
                return None
            if i == lower:
                return i
            j = i - 1
            while j > lower and data[j] in _WS:
                j -= 1
            if data[j] in (0x2C, 0x5B):  # ',' '['
                return i

    def _fast(self) -> bool:  # noqa: C901 - the trace scanner's hot path: one flat loop per byte class, measured (bench/ingest.py)
        """Scan for wanted events from self.pos (a proven element start); True at the array end."""
        self.index = None
        self.win.count_lines = False
        scan = self.pos
        on_launch = self.on_launch
        launch_match = _LAUNCH.match
        self.dense = self.on_block is not None and _dense(
            self.result.events_parsed, self.win.base + self.pos - self.start
        )
        while True:
            data = self.win.data
            limit = len(data) if self.win.eof else max(len(data) - 512, scan)
            action = "more"
            if self.dense and self._block(limit):
                scan = self._more(limit, self.pos)
                continue
            window = (self.pos, self.result.events_parsed + self.launches)
            for m in self.hit.finditer(data, scan, limit):
                p = m.start()
                if p < scan:
                    continue  # inside an event already read
                if on_launch is not None and data[m.end() - 6 : m.end()] == b"Launch":
                    lm = launch_match(data, p - 1)
                    if lm is not None:
                        _, pid, tid, ts, _, ext, corr = lm.groups()
                        scan = lm.end()
                        self.launches += 1
                        if not on_launch(int(pid), int(tid), float(ts), int(corr), int(ext) if ext else None):
                            action = "restart"  # the caller needs no more launches: stop matching them
                            self.on_launch = on_launch = None
                            self.hit = hit_pattern(self.prefixes)
                            break
                        continue
                e = _END.search(data, p)
                if e is None or (e.end() >= len(data) and not self.win.eof):
                    action = "more" if not self.win.eof else "exact"
                    scan = p
                    break
                s = self._event_start(data, p, self.pos)
                value = raw = None
                if s is not None:
                    raw = data[s : e.start() + 1]
                    try:
                        value = orjson.loads(raw)
                    except orjson.JSONDecodeError:
                        value = None
                if s is None or not isinstance(value, dict):
                    action, scan = "fallback", e.end()
                    break
                self.result.fast_bytes += e.end() - self.pos
                self._element(value, s, raw)
                if data[e.end() - 1] == 0x5D:  # ']' : that was the last element
                    self.pos = e.end() - 1
                    return True
                self.pos = scan = e.end()
            else:
                if self.win.eof:
                    action = "exact"
            if action == "restart":
                continue
            if action == "exact":
                self.win.count_lines = True
                return self._exact(until_abs=None)
            if action == "fallback":
                # an unproven cut: re-read from the last proven boundary exactly, past this event
                self.result.fallbacks += 1
                self.win.count_lines = True
                done = self._exact(until_abs=self.win.base + scan)
                self.win.count_lines = False
                if done:
                    return True
                scan = self.pos
                continue
            if self.on_block is not None:  # the window's density decides whether the next is read as a block
                self.block_pause -= 1
                wanted = self.result.events_parsed + self.launches - window[1]
                self.dense = self.block_pause <= 0 and _dense(wanted, max(scan, self.pos) - window[0])
            scan = self._more(limit, scan)

    def _more(self, limit: int, scan: int) -> int:
        """Drop what is read and take the next block of the stream; the scan head, shifted."""
        if len(self.win.data) - self.pos > RETAIN:
            self._prove_near(limit)
        scan = max(min(scan, limit - 64), self.pos)
        shift = self.win.more(self.pos)
        self.pos -= shift
        return scan - shift

    def _block(self, limit: int) -> bool:
        """Hand the whole elements from self.pos to before `limit` to on_block as one block; False (nothing
        read) when there are none, they cannot be read as a block or on_block declines them."""
        assert self.on_block is not None
        data = self.win.data
        sep = self.sep = self.sep or _separator(data, self.pos)
        end = data.rfind(b"}" + sep + b"{", self.pos, limit) if sep is not None else -1
        if sep is None or end < 0:
            return False
        activity = self.win.on_activity is not None and not self.win.cpu_ops
        if activity:
            self.win.activity(self.pos)  # what comes before the block is read from the bytes, in order
        taken = self.on_block(data, self.pos, end + 1, sep, activity)
        if taken is None:
            self.block_pause = BLOCK_PAUSE
            return False
        if activity:
            self.win.skip_activity(end + 1)
        self.result.events_parsed += taken
        self.result.fast_bytes += end + 1 + len(sep) - self.pos
        self.dense = _dense(taken, end + 1 - self.pos)
        self.pos = end + 1 + len(sep)
        return True

    def _prove_near(self, limit: int) -> None:
        """Move the proven boundary up to the scan head by parsing one element there."""
        data = self.win.data
        start = max(self.pos, limit - (1 << 20))
        for m in _BOUND.finditer(data, start, limit):
            s = m.end()
            e = _END.search(data, s, limit)
            if e is None:
                break
            try:
                value = orjson.loads(data[s : e.start() + 1])
            except orjson.JSONDecodeError:
                continue
            if isinstance(value, dict) and data[e.end() - 1] != 0x5D:
                self.result.fast_bytes += s - self.pos
                self.pos = s
                return


def scan_trace(
    stream: io.BufferedIOBase,
    max_depth: int,
    prefixes: str,
    wanted: Callable[[dict], bool],
    on_event: Callable[[dict], None],
    launch_prefixes: str | None = None,
    on_launch: LaunchSink | None = None,
    on_activity: ActivitySink | None = None,
    on_block: BlockSink | None = None,
) -> ScanResult:
    """Read a Kineto JSON document from `stream`.

    `prefixes` (a regex without capturing groups) matches the start of the name of every event
    that `wanted` accepts: fast mode parses only events named so. `on_event` receives each parsed
    event that `wanted` accepts, in file order. Runtime launch events (names matching
    `launch_prefixes`) in Kineto's key order go to `on_launch(pid, tid, ts, correlation, external
    id)` without being parsed; once it returns False, fast mode stops looking for them.
    `on_activity` receives every device kernel, copy and memset and, while it returns True, every CPU
    op, read from the bytes whatever the mode (ActivitySink), in file order.
    `on_block`, where wanted events are dense (DENSE per MiB), receives runs of whole elements in fast
    mode (where they lie in the window and the separator between them, BlockSink) and returns how many wanted events it
    took, or None to have that run read event by event; it must take exactly what `on_event` and
    `on_launch` would, and where asked (once CPU ops are no longer read as activity) what `on_activity`
    would.
    Raises ParseError (with a JSON path and/or line and column) for anything that is not a trace.
    """
    return _Scanner(
        stream, max_depth, prefixes, wanted, on_event, launch_prefixes, on_launch, on_activity, on_block
    ).run()
