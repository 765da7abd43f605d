"""One collective instance = the same call on every member of its group.

Calls are keyed, best first, by the source's own counter (PyTorch's `Seq` in newest Kineto traces,
NCCL's `opCount` per communicator) and otherwise by their position in the group's call order. Either
way op and dtype must agree, and so must the size for ops whose nccl-tests size S is the same on every
member (all_to_all and gather/scatter sizes may differ per rank). A disagreement or a missing member is
a Mismatch with both sides; in order mode the group's pairing stops at the first disagreement, since
every later position would be paired on a broken assumption.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from commlens.vocab import P2P_OPS

from .model import Calls

WORLD = "world"  # the group of calls whose trace names no process group (the default group)
_SIZE_MAY_DIFFER = frozenset({"all_to_all", "gather", "scatter"})


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


@dataclass
class Instances:
    """Matched instances as columns; member_* hold one entry per member rank, in rank order.
    Times are each member's own clock (clocks.py aligns them)."""

    group: list[str] = field(default_factory=list)
    key: list[int] = field(default_factory=list)
    keyed_by: list[str] = field(default_factory=list)  # "key" (Seq, opCount) | "order"
    op: list[str] = field(default_factory=list)
    dtype: list[str | None] = field(default_factory=list)
    msg_bytes: list[int | None] = field(default_factory=list)  # the lowest rank's S
    step: list[int | None] = field(default_factory=list)
    member_rank: list[tuple[int, ...]] = field(default_factory=list)
    member_seq: list[tuple[int, ...]] = field(default_factory=list)
    member_arrival: list[tuple[float | None, ...]] = field(default_factory=list)
    member_end: list[tuple[float | None, ...]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.group)


@dataclass
class MatchResult:
    instances: Instances
    mismatches: list[Mismatch]
    not_matched: Counter[str]  # reason -> calls left out


def _describe(calls: Calls, i: int) -> str:
    return f"seq {calls.seq[i]}: {calls.op[i]} {calls.dtype[i]} {calls.msg_bytes[i]} B"


def _group_of(calls: Calls, i: int, world_size: int) -> str | None:
    key = calls.group_key[i]
    if key is not None:
        return key
    size = calls.group_size[i]
    return WORLD if size is None or size == world_size else None


def match_instances(ranks: Mapping[int, Calls], world_size: int | None = None) -> MatchResult:
    """Match every group collective across the given ranks (send/recv are not group instances)."""
    world = world_size or len(ranks)
    not_matched: Counter[str] = Counter()
    per_group: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    members: dict[str, set[int]] = {}
    for rank, calls in ranks.items():
        for i in range(len(calls.seq)):
            if calls.op[i] in P2P_OPS:
                not_matched["send/recv (point to point, not a group instance)"] += 1
                continue
            g = _group_of(calls, i, world)
            if g is None:
                not_matched["call on an unnamed group smaller than the world"] += 1
                continue
            per_group[g][rank].append(i)
            gr = calls.group_ranks[i]
            members.setdefault(g, set(gr) if gr else (set(range(world)) if g == WORLD else set()))
    out = MatchResult(Instances(), [], not_matched)
    for g in sorted(per_group):
        by_rank = per_group[g]
        expected = members[g] or set(by_rank)
        absent = sorted(expected - set(ranks))
        if absent:
            n = sum(len(v) for v in by_rank.values())
            not_matched[f"group {g}: members {absent} have no trace"] += n
            continue
        member_ranks = sorted(expected)
        for r in member_ranks:
            by_rank.setdefault(r, [])
        keyed = all(ranks[r].match_key[i] is not None for r in member_ranks for i in by_rank[r]) and any(
            ranks[r].match_key[i] for r in member_ranks for i in by_rank[r]
        )
        if keyed:
            _match_keyed(g, member_ranks, ranks, by_rank, out)
        else:
            _match_ordered(g, member_ranks, ranks, by_rank, out)
    return out


def _disagreement(ranks: Mapping[int, Calls], a: tuple[int, int], b: tuple[int, int]) -> str | None:
    ca, cb = ranks[a[0]], ranks[b[0]]
    i, j = a[1], b[1]
    if ca.op[i] != cb.op[j]:
        return "ops disagree"
    if ca.dtype[i] and cb.dtype[j] and ca.dtype[i] != cb.dtype[j]:
        return "dtypes disagree"
    s1, s2 = ca.msg_bytes[i], cb.msg_bytes[j]
    if ca.op[i] not in _SIZE_MAY_DIFFER and s1 is not None and s2 is not None and s1 != s2:
        return "sizes disagree"
    return None


def _emit(
    g: str, key: int, how: str, ranks: Mapping[int, Calls], picks: list[tuple[int, int]], out: MatchResult
) -> None:
    inst = out.instances
    r0, i0 = picks[0]
    c0 = ranks[r0]
    steps = Counter(ranks[r].step[i] for r, i in picks)
    inst.group.append(g)
    inst.key.append(key)
    inst.keyed_by.append(how)
    inst.op.append(c0.op[i0])
    inst.dtype.append(c0.dtype[i0])
    inst.msg_bytes.append(c0.msg_bytes[i0])
    inst.step.append(steps.most_common(1)[0][0])
    inst.member_rank.append(tuple(r for r, _ in picks))
    inst.member_seq.append(tuple(ranks[r].seq[i] for r, i in picks))
    inst.member_arrival.append(tuple(ranks[r].arrival[i] for r, i in picks))
    inst.member_end.append(tuple(ranks[r].end[i] for r, i in picks))


def _check(g: str, pos: int, ranks: Mapping[int, Calls], picks: list[tuple[int, int]], out: MatchResult) -> bool:
    for p in picks[1:]:
        why = _disagreement(ranks, picks[0], p)
        if why is not None:
            out.mismatches.append(
                Mismatch(
                    g,
                    pos,
                    why,
                    picks[0][0],
                    _describe(ranks[picks[0][0]], picks[0][1]),
                    p[0],
                    _describe(ranks[p[0]], p[1]),
                )
            )
            return False
    return True


def _match_keyed(
    g: str, member_ranks: Sequence[int], ranks: Mapping[int, Calls], by_rank: Mapping[int, list[int]], out: MatchResult
) -> None:
    index = {r: {ranks[r].match_key[i]: i for i in by_rank[r]} for r in member_ranks}
    keys = sorted({k for d in index.values() for k in d if k is not None})
    for k in keys:
        have = [(r, index[r][k]) for r in member_ranks if k in index[r]]
        lacking = [r for r in member_ranks if k not in index[r]]
        if lacking:
            r, i = have[0]
            for m in lacking:
                out.mismatches.append(Mismatch(g, k, "missing on a member", r, _describe(ranks[r], i), m, None))
            continue
        if _check(g, k, ranks, have, out):
            _emit(g, k, "key", ranks, have, out)


def _match_ordered(
    g: str, member_ranks: Sequence[int], ranks: Mapping[int, Calls], by_rank: Mapping[int, list[int]], out: MatchResult
) -> None:
    longest = max(len(by_rank[r]) for r in member_ranks)
    for pos in range(longest):
        have = [(r, by_rank[r][pos]) for r in member_ranks if pos < len(by_rank[r])]
        lacking = [r for r in member_ranks if pos >= len(by_rank[r])]
        if lacking:
            r, i = have[0]
            for m in lacking:
                out.mismatches.append(Mismatch(g, pos, "missing on a member", r, _describe(ranks[r], i), m, None))
            continue
        if not _check(g, pos, ranks, have, out):
            left = sum(max(0, len(by_rank[r]) - pos - 1) for r in member_ranks)
            out.not_matched[f"group {g}: calls after an order disagreement (not paired)"] += left
            return
        _emit(g, pos, "order", ranks, have, out)
