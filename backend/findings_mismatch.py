"""Collective mismatches in NCCL logs: members of one communicator that issue different collectives (or one
collective with different counts or types) at the same opCount, which hangs the job or corrupts its data.

NCCL numbers each communicator's collectives (`opCount`) on every member alike, so at one opCount every member
must call the same op with the same count and datatype. A communicator whose members are known (its INIT lines
give a commId: one group key for all) is checked as it is. A communicator seen only in COLL lines has a
pointer-keyed group per process; processes that each hold exactly one such communicator of one size, no more
of them than that size, are taken for members of one communicator (the usual shape: the world communicator of
a small job, or the one communicator a hang report shows), and the finding says it is inferred.
Point-to-point calls are left out: their opCount counts per peer.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import duckdb

from commlens.contract.analysis import Finding

_P2P = ("send", "recv")
_SHOWN = 3  # mismatching opCounts named in a title


@dataclass(frozen=True)
class _Call:
    process: str
    rank: int | None
    op: str
    dtype: str | None
    count: int | None

    def what(self) -> tuple[str, str | None, int | None]:
        return self.op, self.dtype, self.count

    def who(self) -> str:
        return self.process if self.rank is None else f"rank {self.rank} ({self.process})"

    def said(self) -> str:
        return f"{self.op}({self.count if self.count is not None else '?'} x {self.dtype or '?'})"


def collective_mismatches(con: duckdb.DuckDBPyConnection, run_id: int) -> list[Finding]:
    """One finding per communicator whose members disagree at an opCount (see the module's docstring)."""
    rows = con.execute(
        """SELECT e.process, e.rank, e.group_key, e.group_size, e.op_count, e.op, e.dtype, e.elems_in
           FROM comm_events e
           WHERE e.run_id = ? AND e.op_count IS NOT NULL AND e.group_size > 1 AND NOT list_contains(?, e.op)
             AND e.process IS NOT NULL AND e.group_key LIKE 'nccl:%'""",
        [run_id, list(_P2P)],
    ).fetchall()
    known: dict[str, dict[int, list[_Call]]] = defaultdict(lambda: defaultdict(list))
    per_process: dict[tuple[str, int], set[str]] = defaultdict(set)  # (process, size) -> pointer-keyed groups
    pointer_calls: dict[str, list[tuple[int, _Call]]] = defaultdict(list)
    for process, rank, key, size, op_count, op, dtype, count in rows:
        call = _Call(str(process), rank, str(op), dtype, None if count is None else int(count))
        if key.startswith("nccl:ptr:"):
            per_process[(str(process), int(size))].add(key)
            pointer_calls[key].append((int(op_count), call))
        else:
            known[key][int(op_count)].append(call)
    out = [f for key, by_count in known.items() if (f := _finding(key, by_count, inferred=False))]
    by_size: dict[int, list[str]] = defaultdict(list)
    for (_, size), held in per_process.items():
        if len(held) == 1:
            by_size[size].append(next(iter(held)))
    for size, keys in sorted(by_size.items()):
        if not 1 < len(keys) <= size:  # one process alone, or more than one communicator of this size
            continue
        calls: dict[int, list[_Call]] = defaultdict(list)
        for key in keys:
            for op_count, call in pointer_calls[key]:
                calls[op_count].append(call)
        if finding := _finding(f"communicator of {size} ranks (COLL lines only)", calls, inferred=True):
            out.append(finding)
    return out


def _finding(group: str, calls: dict[int, list[_Call]], inferred: bool) -> Finding | None:
    mismatched = {n: c for n, c in sorted(calls.items()) if len({x.what() for x in c}) > 1}
    if not mismatched:
        return None
    first, at_first = next(iter(mismatched.items()))
    members = sorted({c.process for cs in calls.values() for c in cs})
    ops_differ = any(len({c.op for c in cs}) > 1 for cs in mismatched.values())
    said = "; ".join(
        f"{c.who()} calls {c.said()}"
        for c in sorted({c.process: c for c in at_first}.values(), key=lambda c: (c.rank is None, c.rank, c.process))
    )
    shown = ", ".join(f"{n:#x}" for n in list(mismatched)[:_SHOWN]) + (", ..." if len(mismatched) > _SHOWN else "")
    kind = "different collectives" if ops_differ else "one collective with different counts or datatypes"
    whose = (
        f"processes {', '.join(members)}, each with one {group}" if inferred else f"the members of communicator {group}"
    )
    return Finding(
        id=f"collective-mismatch:{group}",
        title=f"{'Probable c' if inferred else 'C'}ollective mismatch: {kind} at opCount {shown}",
        severity="high",
        impact=1.0,  # a mismatch hangs the communicator (or corrupts what it moves): all of its traffic
        evidence={
            "group": group,
            "members": len(members),
            "mismatched_op_counts": len(mismatched),
            "first_op_count": f"{first:#x}",
            "at_first": said,
            "inferred_members": "yes" if inferred else "no",
        },
        view={"page": "overview"},
        suggestion=(
            f"At opCount {first:#x} {said}. NCCL pairs the members' collectives by opCount, so every member must "
            "call the same collective with the same count and datatype in the same order: this one waits forever "
            "(the hang NCCL reports as a timeout) or moves the wrong bytes. Find the code path where these ranks "
            "diverge (a collective inside a rank-dependent branch, an uneven number of buckets, a different model "
            "or batch shape on one rank); TORCH_DISTRIBUTED_DEBUG=DETAIL makes PyTorch check collectives' "
            "shapes across ranks."
            + (
                f" These members are inferred: the log has no INIT lines with a commId, and each of {whose} is "
                "taken to be the same communicator."
                if inferred
                else ""
            )
        ),
    )
