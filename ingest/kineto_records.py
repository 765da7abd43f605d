"""The wanted events of one Kineto trace held as typed columns, about 30 bytes per record.

A kernel can come millions of events after its CPU op (Kineto writes every CPU op before the device
activity), so every wanted CPU op, NCCL kernel and launch is held until the trace ends. Held as Python
objects that cost ~0.3 KB each; held here as growing typed arrays (`array.array`, read as numpy without a
copy): times as float64 (durations as float32 while every value is exact in it), ids (External id,
correlation, Seq) as int32 while they fit, and what events share (name, kind, op, thread, the args the
parse reads) as the index of an interned key. Ids that are not plain integers are kept aside exactly
(`Ids.other`). `kineto_columns` groups the columns into calls; `objects()` gives the reference path
(`kineto_events.build_calls`) its CpuEv / Kernel records.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
from array import array
from typing import Any

import numpy as np

from .kineto_model import CpuEv, Kernel

_I32 = 2**31
_I64 = 2**63
NONE = -_I64  # an id that is absent (None), as int64
OTHER = -_I64 + 1  # an id that is no plain integer (kept in Ids.other), as int64
_NONE32, _OTHER32 = -_I32, -_I32 + 1
EXACT_INT = 2**53  # integer timestamps beyond this are not exact as float64
IdColumn = tuple[np.ndarray, np.ndarray]  # plain-integer ids as int64 and whether each is present (not None)


@functools.cache
def map_large_blocks() -> None:
    """Have glibc map blocks of 1 MiB and more, and unmap them when freed. By default it raises that
    threshold as large blocks are freed, after which growing columns and numpy temporaries come from the
    heap and their freed space stays in the process (measured: 530 MB instead of 220 MB resident after
    the parse of a 4 M-event trace). Once per process; nothing elsewhere."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # not glibc
            ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD


class Ids:
    """A column of ids: None, int32 while every value fits, else int64; anything else kept aside."""

    __slots__ = ("data", "other")

    def __init__(self) -> None:
        self.data = array("i")
        self.other: dict[int, Any] = {}  # row -> a value that is no int (a string, a float, a bool...)

    def append(self, v: Any) -> None:
        data = self.data
        if v is None:
            data.append(_NONE32 if data.typecode == "i" else NONE)
        elif type(v) is int and -_I32 + 2 <= v < _I32:
            data.append(v)
        elif type(v) is int and -_I64 + 2 <= v < _I64:
            if data.typecode == "i":
                self._widen()
            self.data.append(v)
        else:
            self.other[len(data)] = v
            data.append(_OTHER32 if data.typecode == "i" else OTHER)

    def extend(self, v: np.ndarray, present: np.ndarray) -> None:
        """Append plain integers `v` (int64, none of them NONE or OTHER) in bulk; None where not `present`."""
        v = np.where(present, v, NONE)
        if self.data.typecode == "i":
            if len(v) and ((v[present] < -_I32 + 2) | (v[present] >= _I32)).any():
                self._widen()
            else:
                self.data.frombytes(np.where(present, v, _NONE32).astype(np.int32).tobytes())
                return
        self.data.frombytes(v.astype(np.int64).tobytes())

    def _widen(self) -> None:
        old = np.frombuffer(self.data, dtype=np.int32).astype(np.int64)
        old[old == _NONE32] = NONE
        old[old == _OTHER32] = OTHER
        self.data = array("q", old.tobytes())

    def __len__(self) -> int:
        return len(self.data)

    def numpy(self) -> np.ndarray:
        """The column as int64 (NONE for None, OTHER for a value kept aside)."""
        if self.data.typecode == "q":
            return np.frombuffer(self.data, dtype=np.int64)
        out = np.frombuffer(self.data, dtype=np.int32).astype(np.int64)
        out[out == _NONE32] = NONE
        out[out == _OTHER32] = OTHER
        return out

    def value(self, i: int) -> Any:
        v = self.data[i]
        if v in (_NONE32, NONE):
            return None
        if v in (_OTHER32, OTHER):
            return self.other[i]
        return v


class Durations:
    """A float column held as float32 while every value is exact in it, else float64."""

    __slots__ = ("data",)

    def __init__(self) -> None:
        self.data = array("f")

    def append(self, v: float) -> None:
        data = self.data
        data.append(v)
        if data.typecode == "f" and data[-1] != v:
            self.data = array("d", data)
            self.data[-1] = v

    def extend(self, v: np.ndarray) -> None:
        """Append float64 values in bulk (float32 kept while every value is exact in it)."""
        if self.data.typecode == "f":
            narrow = v.astype(np.float32)
            if (narrow == v).all():
                self.data.frombytes(narrow.tobytes())
                return
            self.data = array("d", self.data)
        self.data.frombytes(np.ascontiguousarray(v, dtype=np.float64).tobytes())

    def __len__(self) -> int:
        return len(self.data)

    def numpy(self) -> np.ndarray:
        """The column without a copy: float32 or float64 (float32 values widen exactly in arithmetic)."""
        return np.frombuffer(self.data, dtype=np.float32 if self.data.typecode == "f" else np.float64)


class Times:
    """Timestamps as float64; an integer too large to be exact in float64 is kept aside."""

    __slots__ = ("data", "other")

    def __init__(self) -> None:
        self.data = array("d")
        self.other: dict[int, Any] = {}

    def append(self, v: float) -> None:
        if type(v) is int and not -EXACT_INT <= v <= EXACT_INT:
            self.other[len(self.data)] = v
        self.data.append(v)

    def extend(self, v: np.ndarray) -> None:
        """Append float64 timestamps in bulk (the caller has checked that each is exact)."""
        self.data.frombytes(np.ascontiguousarray(v, dtype=np.float64).tobytes())

    def __len__(self) -> int:
        return len(self.data)

    def numpy(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.float64)

    def value(self, i: int) -> Any:
        return self.other.get(i, self.data[i])


class Interned:
    """Distinct values of a key, numbered in order of first appearance."""

    __slots__ = ("index", "values")

    def __init__(self) -> None:
        self.index: dict[Any, int] = {}
        self.values: list[Any] = []

    def __call__(self, key: Any, value: Any) -> int:
        i = self.index.get(key)
        if i is None:
            i = self.index[key] = len(self.values)
            self.values.append(value)
        return i


class CpuColumns:
    """CPU ops and annotations. key -> (kind, name, op, pid, tid, backend, args)."""

    def __init__(self) -> None:
        self.ts = Times()
        self.dur = Durations()
        self.ext = Ids()
        self.seq = Ids()
        self.key = array("i")
        self.keys = Interned()
        self.released: int | None = None  # the count of records, once their columns were dropped

    def release(self) -> None:
        """Drop the columns; the count and the interned keys stay."""
        self.released = len(self)
        self.ts, self.dur, self.ext, self.seq, self.key = Times(), Durations(), Ids(), Ids(), array("i")

    def append(
        self, kind: str, name: str, op: str | None, pid: Any, tid: Any, ts: float, dur: float, ext: Any, args: Any,
        backend: str | None, seq: Any,
    ) -> None:  # fmt: skip
        k = (kind, name, op, pid, tid, backend, id(args))
        self.key.append(self.keys(k, (kind, name, op, pid, tid, backend, args)))
        self.ts.append(ts)
        self.dur.append(dur)
        self.ext.append(ext)
        self.seq.append(seq)

    def key_of(self, kind: str, name: str, op: str | None, pid: Any, tid: Any, backend: str | None, args: Any) -> int:
        """The interned key index of records with these shared values (numbered as append() numbers them)."""
        return self.keys((kind, name, op, pid, tid, backend, id(args)), (kind, name, op, pid, tid, backend, args))

    def extend(self, key: np.ndarray, ts: np.ndarray, dur: np.ndarray, ext: IdColumn, seq: IdColumn) -> None:
        """Append records in bulk: key indices (key_of), times, and the ids as (values, present)."""
        self.key.frombytes(key.astype(np.int32).tobytes())
        self.ts.extend(ts)
        self.dur.extend(dur)
        self.ext.extend(*ext)
        self.seq.extend(*seq)

    def __len__(self) -> int:
        return len(self.key) if self.released is None else self.released

    def exact(self) -> bool:
        """Whether every id is a plain integer and every timestamp exact as float64 (the columnar path's
        condition)."""
        return not (self.ext.other or self.seq.other or self.ts.other)

    def record(self, i: int) -> CpuEv:
        kind, name, op, pid, tid, backend, args = self.keys.values[self.key[i]]
        return CpuEv(
            kind, name, op, pid, tid, self.ts.value(i), self.dur.data[i], self.ext.value(i), args, backend,
            self.seq.value(i),
        )  # fmt: skip

    def objects(self) -> list[CpuEv]:
        """The records as CpuEv objects (the reference path)."""
        return [self.record(i) for i in range(len(self.key))]


class KernelColumns:
    """NCCL kernels. key -> (name, args)."""

    def __init__(self) -> None:
        self.ts = Times()
        self.dur = Durations()
        self.ext = Ids()
        self.corr = Ids()
        self.seq = Ids()
        self.key = array("i")
        self.keys = Interned()
        self.released: int | None = None

    def release(self) -> None:
        self.released = len(self)
        self.ts, self.dur, self.ext, self.corr, self.seq, self.key = (
            Times(),
            Durations(),
            Ids(),
            Ids(),
            Ids(),
            array("i"),
        )

    def append(self, name: str, ts: float, dur: float, ext: Any, corr: Any, args: Any, seq: Any) -> None:
        self.key.append(self.keys((name, id(args)), (name, args)))
        self.ts.append(ts)
        self.dur.append(dur)
        self.ext.append(ext)
        self.corr.append(corr)
        self.seq.append(seq)

    def key_of(self, name: str, args: Any) -> int:
        return self.keys((name, id(args)), (name, args))

    def extend(
        self, key: np.ndarray, ts: np.ndarray, dur: np.ndarray, ext: IdColumn, corr: IdColumn, seq: IdColumn
    ) -> None:
        self.key.frombytes(key.astype(np.int32).tobytes())
        self.ts.extend(ts)
        self.dur.extend(dur)
        self.ext.extend(*ext)
        self.corr.extend(*corr)
        self.seq.extend(*seq)

    def __len__(self) -> int:
        return len(self.key) if self.released is None else self.released

    def exact(self) -> bool:
        return not (self.ext.other or self.corr.other or self.seq.other or self.ts.other)

    def record(self, i: int) -> Kernel:
        name, args = self.keys.values[self.key[i]]
        return Kernel(
            name, self.ts.value(i), self.dur.data[i], self.ext.value(i), self.corr.value(i), args, self.seq.value(i)
        )

    def objects(self) -> list[Kernel]:
        return [self.record(i) for i in range(len(self.key))]


class LaunchColumns:
    """Runtime launches (kept while kernels point at their op by correlation id). thread -> (pid, tid)."""

    def __init__(self) -> None:
        self.corr = Ids()
        self.ts = Times()
        self.thread = array("i")
        self.threads = Interned()
        self.released: tuple[int, int] | None = None  # (launches, distinct correlation ids) once dropped

    def release(self) -> None:
        self.released = (len(self), self.distinct())
        self.corr, self.ts, self.thread = Ids(), Times(), array("i")

    def distinct(self) -> int:
        """Distinct correlation ids (the size of the reference's dict of launches)."""
        if self.released is not None:
            return self.released[1]
        return len(np.unique(self.corr.numpy())) if self.exact() else len(self.as_dict())

    def append(self, pid: Any, tid: Any, ts: float, corr: Any) -> None:
        self.thread.append(self.threads((pid, tid), (pid, tid)))
        self.ts.append(ts)
        self.corr.append(corr)

    def extend(self, thread: np.ndarray, ts: np.ndarray, corr: np.ndarray) -> None:
        """Append launches in bulk: thread indices (self.threads), times, plain-integer correlation ids."""
        self.thread.frombytes(thread.astype(np.int32).tobytes())
        self.ts.extend(ts)
        self.corr.extend(corr, np.ones(len(corr), dtype=bool))

    def __len__(self) -> int:
        return len(self.thread) if self.released is None else self.released[0]

    def exact(self) -> bool:
        return not (self.corr.other or self.ts.other)

    def as_dict(self) -> dict[Any, tuple[Any, Any, float]]:
        """correlation -> (pid, tid, ts); a later launch of the same correlation id replaces an earlier one."""
        threads = self.threads.values
        return {self.corr.value(i): (*threads[t], self.ts.value(i)) for i, t in enumerate(self.thread)}
