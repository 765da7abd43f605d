"""What the time analysis reads per rank: read-only column protocols, met by the Kineto timeline reader's
dataclasses and by anything the store loads into columns of the same names."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from commlens.vocab import P2P_OPS

COMPUTE = "compute"
COMM = "comm"
MEMORY_KINDS = frozenset({"memset", "memcpy_htod", "memcpy_dtoh", "memcpy_dtod", "memcpy_ptop"})
EPS = 0.002  # µs: Kineto timestamps carry ns fractions


class Intervals(Protocol):
    @property
    def kind(self) -> Sequence[str]: ...
    @property
    def stream(self) -> Sequence[int]: ...
    @property
    def start(self) -> Sequence[float]: ...
    @property
    def end(self) -> Sequence[float]: ...
    @property
    def nbytes(self) -> Sequence[int]: ...


class Steps(Protocol):
    @property
    def step(self) -> Sequence[int]: ...
    @property
    def start(self) -> Sequence[float]: ...
    @property
    def end(self) -> Sequence[float]: ...


class Calls(Protocol):
    """Collective calls of one rank in issue order; `arrival`/`end` in the rank's own clock (µs)."""

    @property
    def seq(self) -> Sequence[int]: ...
    @property
    def op(self) -> Sequence[str]: ...
    @property
    def dtype(self) -> Sequence[str | None]: ...
    @property
    def msg_bytes(self) -> Sequence[int | None]: ...
    @property
    def group_key(self) -> Sequence[str | None]: ...
    @property
    def group_ranks(self) -> Sequence[tuple[int, ...] | None]: ...
    @property
    def group_size(self) -> Sequence[int | None]: ...
    @property
    def match_key(self) -> Sequence[int | None]: ...
    @property
    def step(self) -> Sequence[int | None]: ...
    @property
    def arrival(self) -> Sequence[float | None]: ...
    @property
    def end(self) -> Sequence[float | None]: ...


class RankInput(Protocol):
    @property
    def rank(self) -> int | None: ...
    @property
    def has_device(self) -> bool: ...
    @property
    def intervals(self) -> Intervals: ...
    @property
    def steps(self) -> Steps: ...
    @property
    def calls(self) -> Calls: ...


# ------------------------------------------------------------------------------- the same as arrays
# A 10M-call run held as Python lists and tuples took most of its memory in object headers; the analysis
# works on these numpy columns, built once per run (persist.load_run fills them straight from Arrow).

F64 = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]
KINDS = (COMPUTE, COMM, "memset", "memcpy_htod", "memcpy_dtoh", "memcpy_dtod", "memcpy_ptop")
KIND_CODE = {k: i for i, k in enumerate(KINDS)}


def kind_codes(kinds: Sequence[str]) -> Ints:
    """Codes into KINDS; -1 for a kind the analysis does not read."""
    return np.asarray([KIND_CODE.get(k, -1) for k in kinds], dtype=np.int64)


@dataclass
class IntervalArrays:
    """Intervals as columns; `kind` holds codes into KINDS."""

    kind: Ints
    stream: Ints
    start: F64
    end: F64
    nbytes: Ints

    def __len__(self) -> int:
        return len(self.start)

    def of(self, kinds: Iterable[str]) -> Bools:
        return np.isin(self.kind, [KIND_CODE[k] for k in kinds])

    def subset(self, rows: Bools) -> IntervalArrays:
        """The intervals where `rows` is true, in their order."""
        return IntervalArrays(self.kind[rows], self.stream[rows], self.start[rows], self.end[rows], self.nbytes[rows])

    @classmethod
    def of_columns(cls, iv: Intervals | IntervalArrays) -> IntervalArrays:
        if isinstance(iv, IntervalArrays):
            return iv
        return cls(
            kind_codes(iv.kind),
            np.asarray(iv.stream, dtype=np.int64),
            np.asarray(iv.start, dtype=np.float64),
            np.asarray(iv.end, dtype=np.float64),
            np.asarray([b or 0 for b in iv.nbytes], dtype=np.int64),
        )


@dataclass
class StepArrays:
    step: Ints
    start: F64
    end: F64

    def __len__(self) -> int:
        return len(self.step)

    @classmethod
    def of_columns(cls, st: Steps | StepArrays) -> StepArrays:
        if isinstance(st, StepArrays):
            return st
        return cls(
            np.asarray(st.step, dtype=np.int64),
            np.asarray(st.start, dtype=np.float64),
            np.asarray(st.end, dtype=np.float64),
        )


@dataclass
class RankArrays:
    """One rank's timeline as columns (its calls are in the run's CallTable)."""

    rank: int
    has_device: bool
    intervals: IntervalArrays
    steps: StepArrays


@dataclass
class CallTable:
    """Every rank's calls in one set of columns, each rank's in issue order. Strings are codes into the
    lists beside them (-1: None); a missing number is flagged in has_* (ints) or NaN (times)."""

    rank: Ints
    seq: Ints
    op: Ints
    ops: list[str]
    dtype: Ints
    dtypes: list[str]
    msg_bytes: Ints
    has_bytes: Bools
    group: Ints
    groups: list[str]
    group_size: Ints  # -1: unknown
    match_key: Ints
    has_key: Bools
    step: Ints
    has_step: Bools
    arrival: F64
    end: F64
    # The ranks of each group (by code) as its first call gives them, and those of the first call
    # without a group key that belongs to the world (matching.WORLD).
    group_ranks: list[tuple[int, ...] | None]
    world_ranks: tuple[int, ...] | None
    source_id: Ints | None = None

    def __len__(self) -> int:
        return len(self.rank)

    def describe(self, i: int) -> str:
        dtype = self.dtypes[self.dtype[i]] if self.dtype[i] >= 0 else None
        size = int(self.msg_bytes[i]) if self.has_bytes[i] else None
        return f"seq {int(self.seq[i])}: {self.ops[self.op[i]]} {dtype} {size} B"


def _codes(values: Sequence[str | None]) -> tuple[Ints, list[str]]:
    vocab: dict[str, int] = {}
    codes = [-1 if v is None else vocab.setdefault(v, len(vocab)) for v in values]
    return np.asarray(codes, dtype=np.int64), list(vocab)


def _flagged(values: Sequence[int | None]) -> tuple[Ints, Bools]:
    return (
        np.asarray([0 if v is None else v for v in values], dtype=np.int64),
        np.asarray([v is not None for v in values], dtype=bool),
    )


def _times(values: Sequence[float | None]) -> F64:
    return np.asarray([np.nan if v is None else v for v in values], dtype=np.float64)


def call_table(ranks: Mapping[int, Calls], world: int) -> CallTable:
    """The calls of protocol-shaped inputs (the Kineto timeline's lists) as a CallTable, ranks in the
    mapping's order; `world` decides which calls without a group key belong to the world group."""
    rank: list[int] = []
    cols: dict[str, list[Any]] = {n: [] for n in ("seq", "op", "dtype", "msg_bytes", "group_key", "group_size")}
    cols |= {n: [] for n in ("match_key", "step", "arrival", "end")}
    first_ranks: dict[str, tuple[int, ...] | None] = {}
    world_ranks: list[tuple[int, ...] | None] = []
    for r, calls in ranks.items():
        rank += [r] * len(calls.seq)
        for name, col in cols.items():
            col.extend(getattr(calls, name))
        for o, gk, gs, gr in zip(calls.op, calls.group_key, calls.group_size, calls.group_ranks, strict=True):
            if o in P2P_OPS:
                continue
            if gk is not None:
                first_ranks.setdefault(gk, gr)
            elif not world_ranks and (gs is None or gs == world):
                world_ranks.append(gr)
    group, groups = _codes(cols["group_key"])
    op, ops = _codes(cols["op"])
    dtype, dtypes = _codes(cols["dtype"])
    size, has_size = _flagged(cols["msg_bytes"])
    key, has_key = _flagged(cols["match_key"])
    step, has_step = _flagged(cols["step"])
    gsize, has_gsize = _flagged(cols["group_size"])
    return CallTable(
        np.asarray(rank, dtype=np.int64),
        np.asarray(cols["seq"], dtype=np.int64),
        op,
        ops,
        dtype,
        dtypes,
        size,
        has_size,
        group,
        groups,
        np.where(has_gsize, gsize, -1),
        key,
        has_key,
        step,
        has_step,
        _times(cols["arrival"]),
        _times(cols["end"]),
        [first_ranks.get(g) for g in groups],
        world_ranks[0] if world_ranks else None,
    )
