"""One collective instance = the same call on every member of its group.

Calls are keyed, best first, by the source's own counter (PyTorch's `Seq` in newest Kineto traces,
NCCL's `opCount` per communicator) and otherwise by their position in the group's call order. Either
way op and dtype must agree, and so must the size for ops whose nccl-tests size S is the same on every
member (all_to_all and gather/scatter sizes may differ per rank). A disagreement or a missing member is
a Mismatch with both sides; in order mode the group's pairing stops at the first disagreement, since
every later position would be paired on a broken assumption.

Matching works on a CallTable (numpy columns): each group's calls form a (position x member) matrix of
call rows, checked against the lowest member's column at once; instances keep their members in flat
arrays (member-major within an instance, rank order), which every later stage reads as columns.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from commlens.vocab import P2P_OPS

from .model import F64, Bools, Calls, CallTable, Ints, call_table
from .ordering import stable_order

WORLD = "world"  # the group of calls whose trace names no process group (the default group)
_SIZE_MAY_DIFFER = frozenset({"all_to_all", "gather", "scatter"})
_REASONS = ("ops disagree", "dtypes disagree", "sizes disagree")


@dataclass
class Mismatch:
    """Calls that could not be paired: `side_a` on `rank_a` against `side_b` on `rank_b` (None: absent)."""

    group: str
    position: int  # the key (seq/opCount) or the position in the group's call order
    reason: str
    rank_a: int
    side_a: str | None
    rank_b: int
    side_b: str | None


def _empty_ints() -> Ints:
    return np.zeros(0, dtype=np.int64)


def _empty_f64() -> F64:
    return np.zeros(0, dtype=np.float64)


def _empty_bools() -> Bools:
    return np.zeros(0, dtype=bool)


@dataclass
class Instances:
    """Matched instances as columns. Strings are codes into `groups` / `ops` / `dtypes` (-1: None);
    members lie in flat m_* arrays, instance k's at [offsets[k], offsets[k + 1]), in rank order. Times
    are each member's own clock (NaN: none; clocks.py aligns them). The list-valued properties are for
    small inputs and tests."""

    groups: list[str] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    group_code: Ints = field(default_factory=_empty_ints)
    keys: Ints = field(default_factory=_empty_ints)
    by_key: Bools = field(default_factory=_empty_bools)
    op_code: Ints = field(default_factory=_empty_ints)
    dtype_code: Ints = field(default_factory=_empty_ints)
    size: Ints = field(default_factory=_empty_ints)  # the lowest rank's S
    has_size: Bools = field(default_factory=_empty_bools)
    steps: Ints = field(default_factory=_empty_ints)
    has_step: Bools = field(default_factory=_empty_bools)
    offsets: Ints = field(default_factory=lambda: np.zeros(1, dtype=np.int64))
    m_inst: Ints = field(default_factory=_empty_ints)
    m_rank: Ints = field(default_factory=_empty_ints)
    m_row: Ints = field(default_factory=_empty_ints)  # the member's row in the CallTable
    m_seq: Ints = field(default_factory=_empty_ints)
    m_arrival: F64 = field(default_factory=_empty_f64)
    m_end: F64 = field(default_factory=_empty_f64)

    def __len__(self) -> int:
        return len(self.group_code)

    @property
    def members(self) -> Ints:
        return np.diff(self.offsets)

    def per_member(self, values: npt.NDArray[Any]) -> list[tuple[Any, ...]]:
        out = values.tolist()
        return [tuple(out[a:b]) for a, b in zip(self.offsets[:-1].tolist(), self.offsets[1:].tolist(), strict=True)]

    @property
    def group(self) -> list[str]:
        return [self.groups[c] for c in self.group_code.tolist()]

    @property
    def key(self) -> list[int]:
        return [int(k) for k in self.keys.tolist()]

    @property
    def keyed_by(self) -> list[str]:
        return ["key" if k else "order" for k in self.by_key.tolist()]

    @property
    def op(self) -> list[str]:
        return [self.ops[c] for c in self.op_code.tolist()]

    @property
    def dtype(self) -> list[str | None]:
        return [self.dtypes[c] if c >= 0 else None for c in self.dtype_code.tolist()]

    @property
    def msg_bytes(self) -> list[int | None]:
        return [s if h else None for s, h in zip(self.size.tolist(), self.has_size.tolist(), strict=True)]

    @property
    def step(self) -> list[int | None]:
        return [s if h else None for s, h in zip(self.steps.tolist(), self.has_step.tolist(), strict=True)]

    @property
    def member_rank(self) -> list[tuple[int, ...]]:
        return self.per_member(self.m_rank)

    @property
    def member_seq(self) -> list[tuple[int, ...]]:
        return self.per_member(self.m_seq)

    @property
    def member_arrival(self) -> list[tuple[float | None, ...]]:
        return [tuple(None if x != x else x for x in t) for t in self.per_member(self.m_arrival)]

    @property
    def member_end(self) -> list[tuple[float | None, ...]]:
        return [tuple(None if x != x else x for x in t) for t in self.per_member(self.m_end)]


@dataclass
class MatchResult:
    instances: Instances
    mismatches: list[Mismatch]
    not_matched: Counter[str]  # reason -> calls left out


def match_instances(ranks: Mapping[int, Calls], world_size: int | None = None) -> MatchResult:
    """Match every group collective across the given ranks (send/recv are not group instances)."""
    world = world_size or len(ranks)
    return match_table(call_table(ranks, world), list(ranks), world)


@dataclass
class _Block:
    """One group's matched positions: rows (instances x members) of the CallTable."""

    group: int
    member_ranks: list[int]
    keys: Ints
    by_key: bool
    rows: Ints


def match_table(t: CallTable, present: Sequence[int], world: int) -> MatchResult:
    """match_instances over a CallTable; `present`: every rank of the input (with or without calls)."""
    not_matched: Counter[str] = Counter()
    p2p = np.isin(t.op, [i for i, o in enumerate(t.ops) if o in P2P_OPS])
    names = list(t.groups)
    if WORLD not in names:
        names.append(WORLD)
    world_code = names.index(WORLD)
    g = t.group.copy()
    nokey = g < 0
    to_world = nokey & ((t.group_size < 0) | (t.group_size == world))
    g[to_world] = world_code
    unnamed = nokey & ~to_world & ~p2p
    g[p2p | unnamed] = -1
    left_out = [
        (int(np.argmax(mask)), reason, int(mask.sum()))
        for mask, reason in (
            (p2p, "send/recv (point to point, not a group instance)"),
            (unnamed, "call on an unnamed group smaller than the world"),
        )
        if mask.any()
    ]
    for _, reason, n in sorted(left_out):
        not_matched[reason] += n
    valid = np.flatnonzero(g >= 0)
    order = valid[stable_order(g[valid], t.rank[valid])]  # stable: call order within (group, rank)
    gs = g[order]
    cut = np.flatnonzero(gs[1:] != gs[:-1]) + 1
    bounds = (
        dict(
            zip(
                gs[np.r_[0, cut]].tolist(),
                zip(np.r_[0, cut].tolist(), np.r_[cut, len(gs)].tolist(), strict=True),
                strict=True,
            )
        )
        if len(gs)
        else {}
    )
    present_set = set(present)
    out = MatchResult(Instances(), [], not_matched)
    blocks: list[_Block] = []
    for code in sorted(bounds, key=lambda c: names[c]):
        name = names[code]
        a, b = bounds[code]
        rows = order[a:b]
        rr = t.rank[rows]
        gr = t.group_ranks[code] if code < len(t.groups) else t.world_ranks
        expected = set(gr) if gr else (set(range(world)) if name == WORLD else set())
        expected = expected or set(np.unique(rr).tolist())
        absent = sorted(expected - present_set)
        if absent:
            not_matched[f"group {name}: members {absent} have no trace"] += len(rows)
            continue
        member_ranks = sorted(expected)
        lo = np.searchsorted(rr, member_ranks, side="left")
        hi = np.searchsorted(rr, member_ranks, side="right")
        by_rank = [rows[x:y] for x, y in zip(lo.tolist(), hi.tolist(), strict=True)]
        mine = np.concatenate(by_rank)
        keyed = bool(t.has_key[mine].all() and (t.match_key[mine] != 0).any())
        match = _match_keyed if keyed else _match_ordered
        blocks.append(match(t, code, name, member_ranks, by_rank, out))
    out.instances = _instances(t, names, blocks)
    return out


def _disagreement(t: CallTable, rows: Ints) -> Ints:
    """Per position (row of `rows`, positions x members): 0 when every member agrees with the first,
    else 1 + the index into _REASONS of the first member's disagreement, and that member's column."""
    a, b = rows[:, :1], rows[:, 1:]
    truthy = np.asarray([bool(d) for d in t.dtypes] + [False], dtype=bool)  # code -1: None
    may_differ = np.asarray([o in _SIZE_MAY_DIFFER for o in t.ops], dtype=bool)
    op_bad = t.op[a] != t.op[b]
    dt_bad = truthy[t.dtype[a]] & truthy[t.dtype[b]] & (t.dtype[a] != t.dtype[b])
    sz_bad = ~may_differ[t.op[a]] & t.has_bytes[a] & t.has_bytes[b] & (t.msg_bytes[a] != t.msg_bytes[b])
    code = np.where(op_bad, 1, np.where(dt_bad, 2, np.where(sz_bad, 3, 0)))
    bad = code > 0
    col = np.argmax(bad, axis=1) if bad.shape[1] else np.zeros(len(rows), dtype=np.int64)
    first = code[np.arange(len(rows)), col] if bad.shape[1] else np.zeros(len(rows), dtype=np.int64)
    return np.stack([first, col + 1], axis=1)


def _bad_mismatch(t: CallTable, name: str, pos: int, ranks: list[int], row: Ints, why: Ints) -> Mismatch:
    code, j = int(why[0]), int(why[1])
    return Mismatch(name, pos, _REASONS[code - 1], ranks[0], t.describe(int(row[0])), ranks[j], t.describe(int(row[j])))


def _match_ordered(
    t: CallTable, code: int, name: str, member_ranks: list[int], by_rank: list[Ints], out: MatchResult
) -> _Block:
    counts = [len(x) for x in by_rank]
    common = min(counts)
    rows = np.stack([x[:common] for x in by_rank], axis=1) if common else np.zeros((0, len(by_rank)), np.int64)
    why = _disagreement(t, rows)
    bad = np.flatnonzero(why[:, 0])
    if len(bad):
        d = int(bad[0])
        out.mismatches.append(_bad_mismatch(t, name, d, member_ranks, rows[d], why[d]))
        left = sum(max(0, n - d - 1) for n in counts)
        out.not_matched[f"group {name}: calls after an order disagreement (not paired)"] += left
        return _Block(code, member_ranks, np.arange(d, dtype=np.int64), False, rows[:d])
    for pos in range(common, max(counts, default=0)):
        have = [j for j, n in enumerate(counts) if pos < n]
        first = int(by_rank[have[0]][pos])
        for j, n in enumerate(counts):
            if pos >= n:
                out.mismatches.append(
                    Mismatch(
                        name,
                        pos,
                        "missing on a member",
                        member_ranks[have[0]],
                        t.describe(first),
                        member_ranks[j],
                        None,
                    )
                )
    return _Block(code, member_ranks, np.arange(common, dtype=np.int64), False, rows)


def _match_keyed(
    t: CallTable, code: int, name: str, member_ranks: list[int], by_rank: list[Ints], out: MatchResult
) -> _Block:
    keys, rows = _aligned([_last_per_key(t.match_key[x], x) for x in by_rank])
    complete = (rows >= 0).all(axis=1)
    found: list[tuple[int, int, Mismatch]] = []
    for q in np.flatnonzero(~complete).tolist():
        have = np.flatnonzero(rows[q] >= 0).tolist()
        side = t.describe(int(rows[q, have[0]]))
        for n, j in enumerate(np.flatnonzero(rows[q] < 0).tolist()):
            found.append(
                (
                    q,
                    n,
                    Mismatch(
                        name, int(keys[q]), "missing on a member", member_ranks[have[0]], side, member_ranks[j], None
                    ),
                )
            )
    full = np.flatnonzero(complete)
    why = _disagreement(t, rows[full])
    bad = why[:, 0] > 0
    for i in np.flatnonzero(bad).tolist():
        q = int(full[i])
        found.append((q, 0, _bad_mismatch(t, name, int(keys[q]), member_ranks, rows[q], why[i])))
    out.mismatches.extend(m for _, _, m in sorted(found, key=lambda x: (x[0], x[1])))
    ok = full[~bad]
    return _Block(code, member_ranks, keys[ok], True, rows[ok])


def _last_per_key(k: Ints, rows: Ints) -> tuple[Ints, Ints]:
    """The distinct keys of one member in ascending order, each with the row of its last call. Keys that
    only grow in call order (opCount) are that already: the sort is skipped."""
    if len(k) < 2 or bool((k[1:] > k[:-1]).all()):
        return k, rows
    uk, first = np.unique(k[::-1], return_index=True)
    return uk, rows[::-1][first]


def _aligned(last: list[tuple[Ints, Ints]]) -> tuple[Ints, Ints]:
    """Every key any member has, ascending, and per key each member's row (-1: missing on that member),
    from each member's (keys, rows) of `_last_per_key`. Members that all saw the same keys (NCCL logs,
    complete profiles) are their rows side by side."""
    if last and all(np.array_equal(last[0][0], k) for k, _ in last[1:]):
        return last[0][0], np.stack([r for _, r in last], axis=1).astype(np.int64, copy=False)
    return _aligned_any(last)


def _aligned_any(last: list[tuple[Ints, Ints]]) -> tuple[Ints, Ints]:
    keys = np.unique(np.concatenate([k for k, _ in last]))
    rows = np.full((len(keys), len(last)), -1, dtype=np.int64)
    for j, (uk, ur) in enumerate(last):
        rows[np.searchsorted(keys, uk), j] = ur
    return keys, rows


def _step_of(t: CallTable, rows: Ints) -> tuple[Ints, Bools]:
    """Each instance's step: the most common among its members (ties: the lowest rank's first)."""
    step, has = t.step[rows], t.has_step[rows]
    same = ((step == step[:, :1]) & (has == has[:, :1])).all(axis=1)
    out_s, out_h = step[:, 0].copy(), has[:, 0].copy()
    for i in np.flatnonzero(~same).tolist():
        c = Counter(s if h else None for s, h in zip(step[i].tolist(), has[i].tolist(), strict=True))
        best = c.most_common(1)[0][0]
        out_s[i], out_h[i] = (0, False) if best is None else (best, True)
    return out_s, out_h


def _instances(t: CallTable, names: list[str], blocks: list[_Block]) -> Instances:
    inst = Instances(groups=names, ops=list(t.ops), dtypes=list(t.dtypes))
    blocks = [b for b in blocks if len(b.rows)]
    if not blocks:
        return inst
    first = np.concatenate([b.rows[:, 0] for b in blocks])
    steps = [_step_of(t, b.rows) for b in blocks]
    inst.group_code = np.concatenate([np.full(len(b.rows), b.group, dtype=np.int64) for b in blocks])
    inst.keys = np.concatenate([b.keys for b in blocks]).astype(np.int64)
    inst.by_key = np.concatenate([np.full(len(b.rows), b.by_key, dtype=bool) for b in blocks])
    inst.op_code, inst.dtype_code = t.op[first], t.dtype[first]
    inst.size, inst.has_size = t.msg_bytes[first], t.has_bytes[first]
    inst.steps = np.concatenate([s for s, _ in steps])
    inst.has_step = np.concatenate([h for _, h in steps])
    counts = np.concatenate([np.full(len(b.rows), len(b.member_ranks), dtype=np.int64) for b in blocks])
    inst.offsets = np.r_[0, np.cumsum(counts)].astype(np.int64)
    inst.m_inst = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    inst.m_row = np.concatenate([b.rows.ravel() for b in blocks])
    inst.m_rank = np.concatenate([np.tile(np.asarray(b.member_ranks, dtype=np.int64), len(b.rows)) for b in blocks])
    inst.m_seq = t.seq[inst.m_row]
    inst.m_arrival = t.arrival[inst.m_row]
    inst.m_end = t.end[inst.m_row]
    return inst
