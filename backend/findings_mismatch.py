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
from typing import Any

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

    def who(self) -> str:
        return self.process if self.rank is None else f"rank {self.rank} ({self.process})"

    def said(self) -> str:
        return f"{self.op}({self.count if self.count is not None else '?'} x {self.dtype or '?'})"


_CALLS = """FROM comm_events e WHERE e.run_id = ? AND e.op_count IS NOT NULL AND e.group_size > 1
             AND NOT list_contains(?, e.op) AND e.process IS NOT NULL"""


def collective_mismatches(con: duckdb.DuckDBPyConnection, run_id: int) -> list[Finding]:
    """One finding per communicator whose members disagree at an opCount (see the module's docstring). The
    grouping is in SQL: only the opCounts that disagree come back, whatever the number of calls."""
    base = [run_id, list(_P2P)]
    known = con.execute(
        f"""SELECT e.group_key, list(DISTINCT e.process) {_CALLS} AND e.group_key LIKE 'nccl:%'
            AND NOT starts_with(e.group_key, 'nccl:ptr:') GROUP BY e.group_key ORDER BY e.group_key""",
        base,
    ).fetchall()
    out = [f for key, members in known if (f := _finding(con, base, [key], key, members, inferred=False))]
    held = con.execute(  # pointer-keyed communicators held by each process, per size
        f"""SELECT e.group_size, e.process, list(DISTINCT e.group_key) {_CALLS}
            AND starts_with(e.group_key, 'nccl:ptr:') GROUP BY ALL ORDER BY ALL""",
        base,
    ).fetchall()
    by_size: dict[int, list[tuple[str, str]]] = defaultdict(list)
    for size, process, keys in held:
        if len(keys) == 1:
            by_size[int(size)].append((str(process), str(keys[0])))
    for size, members in sorted(by_size.items()):
        if not 1 < len(members) <= size:  # one process alone, or more than one communicator of this size
            continue
        group = f"communicator of {size} ranks (COLL lines only)"
        keys, processes = [k for _, k in members], [p for p, _ in members]
        if finding := _finding(con, base, keys, group, processes, inferred=True):
            out.append(finding)
    return out


def _disagreements(con: duckdb.DuckDBPyConnection, base: list[Any], keys: list[str]) -> dict[int, list[_Call]]:
    """The opCounts at which the calls of these communicators' members differ, with one call per member."""
    rows = con.execute(
        f"""SELECT e.op_count, list(DISTINCT struct_pack(p := e.process, r := e.rank, o := e.op, d := e.dtype,
                                                          n := e.elems_in))
            {_CALLS} AND list_contains(?, e.group_key)
            GROUP BY e.op_count HAVING count(DISTINCT (e.op, e.dtype, e.elems_in)) > 1 ORDER BY e.op_count""",
        [*base, keys],
    ).fetchall()
    return {
        int(n): [
            _Call(str(c["p"]), c["r"], str(c["o"]), c["d"], None if c["n"] is None else int(c["n"])) for c in calls
        ]
        for n, calls in rows
    }


def _finding(
    con: duckdb.DuckDBPyConnection,
    base: list[Any],
    keys: list[str],
    group: str,
    processes: list[str],
    inferred: bool,
) -> Finding | None:
    mismatched = _disagreements(con, base, keys)
    if not mismatched:
        return None
    first, at_first = next(iter(mismatched.items()))
    members = sorted(set(processes))
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


def calls_stop_early(con: duckdb.DuckDBPyConnection, run_id: int) -> list[Finding]:
    """One finding per rank whose NCCL log ends while its peers' go on: the collectives they issued after its last
    one are missing from it (the time analysis' "missing on a member" mismatches, all after the rank's last call in
    each group). A log cut short and a rank that stopped (a hang, a crash) look alike; profiler traces are left
    out, since their windows end where each rank's profiler stopped."""
    rows = con.execute(
        """
        WITH miss AS (
            SELECT rank_b AS rank, group_key, count(DISTINCT position) AS n, min(position) AS first_missing
            FROM time_mismatches WHERE run_id = $run AND reason = 'missing on a member' AND side_b IS NULL
            GROUP BY ALL
        ), had AS (
            SELECT i.group_key, m.rank, max(i.match_key) AS last_had
            FROM time_instances i JOIN time_instance_members m ON m.run_id = i.run_id AND m.instance_id = i.instance_id
            WHERE i.run_id = $run GROUP BY ALL
        ), kinds AS (
            SELECT e.rank, bool_or(s.kind = 'nccl_log') AS logged, bool_or(s.kind = 'kineto') AS traced
            FROM comm_events e JOIN sources s ON s.source_id = e.source_id
            WHERE e.run_id = $run AND e.rank IS NOT NULL GROUP BY e.rank
        )
        SELECT miss.rank, sum(miss.n), list(miss.group_key ORDER BY miss.group_key)
        FROM miss LEFT JOIN had ON had.group_key = miss.group_key AND had.rank = miss.rank
        JOIN kinds ON kinds.rank = miss.rank
        WHERE kinds.logged AND NOT kinds.traced
        GROUP BY miss.rank
        HAVING bool_and(had.last_had IS NULL OR miss.first_missing > had.last_had)
        ORDER BY miss.rank
        """,
        {"run": run_id},
    ).fetchall()
    out = []
    for rank, missing, groups in rows:
        n = int(missing)
        out.append(
            Finding(
                id=f"calls-stop-early:{rank}",
                title=f"Rank {rank}'s NCCL log stops early: {n} collective{'s' if n != 1 else ''} its peers issued "
                "after its last one are missing from it",
                severity="medium",
                impact=0.0,  # no bytes of its own: it says what the run's files do not hold
                evidence={"rank": rank, "missing_calls": n, "groups": ", ".join(groups)},
                view={"page": "time", "rank": rank},
                suggestion=f"Either rank {rank}'s log was cut short (copied while the job was writing it, a full disk, "
                f"NCCL_DEBUG_FILE not flushed when the process was killed) or rank {rank} stopped there while its peers "
                "went on to wait for it: a hang or a crash. If the job did not end cleanly, look at that rank first "
                "(its exit code and stderr); PyTorch's Flight Recorder (TORCH_NCCL_TRACE_BUFFER_SIZE) dumps what each "
                "rank was doing when a collective timed out. The time page's mismatches list the calls.",
            )
        )
    return out
