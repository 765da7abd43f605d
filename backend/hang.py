"""Hang analysis from Flight Recorder entries: per process group, the last collective each rank entered or
completed, which ranks never arrived at the group's latest call and what they were doing instead.

A collective is one `collective_seq_id` on every member of its group. For each group the frontier is the
highest sequence number any member entered; members whose last entry is below it never arrived (their
last call in the group, and their latest call in any group, say what they were doing instead). Members at
the frontier that disagree on op or size with the first arrival are mismatches. A group is listed when a
member is missing, when its members disagree, or when a backend that records completion (NCCL) shows the
frontier call not completed; gloo records calls as scheduled only, so there only sequence numbers count.
Members come from the dump's pg_config, else from the run's process_groups, else the ranks that dumped
(the default group spans them all).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import duckdb

from commlens.contract.hang import HangGroup, HangRank


@dataclass(frozen=True)
class FrCall:
    """One Flight Recorder entry of a rank (a row of fr_entries)."""

    rank: int
    group_key: str
    group: str  # the group's description, else its name
    seq: int
    op: str
    msg_bytes: int | None
    state: str
    created_us: float | None
    group_ranks: tuple[int, ...] | None = None


def _describe(c: FrCall | None) -> str:
    if c is None:
        return "no call recorded"
    size = f", {c.msg_bytes} B" if c.msg_bytes is not None else ""
    return f"{c.op} #{c.seq} in {c.group} ({c.state}{size})"


def analyze(
    calls: Iterable[FrCall], dumped_ranks: Iterable[int], group_ranks: dict[str, list[int]] | None = None
) -> list[HangGroup]:
    """The groups whose latest collective did not complete on every member (empty when all did)."""
    dumped = sorted(set(dumped_ranks))
    by_group: dict[str, list[FrCall]] = defaultdict(list)
    latest_anywhere: dict[int, FrCall] = {}
    for c in calls:
        by_group[c.group_key].append(c)
        prev = latest_anywhere.get(c.rank)
        if prev is None or (c.created_us or 0) >= (prev.created_us or 0):
            latest_anywhere[c.rank] = c
    records_completion = any(c.state != "scheduled" for cs in by_group.values() for c in cs)
    out: list[HangGroup] = []
    for key, cs in sorted(by_group.items()):
        known = next((c.group_ranks for c in cs if c.group_ranks), None)
        members = sorted(
            set(known or (group_ranks or {}).get(key) or (dumped if key == "pg:0" else [])) | {c.rank for c in cs}
        )
        last: dict[int, FrCall] = {}
        for c in cs:
            if c.rank not in last or c.seq > last[c.rank].seq:
                last[c.rank] = c
        frontier = max(c.seq for c in last.values())
        at = sorted((c for c in last.values() if c.seq == frontier), key=lambda c: c.rank)
        first = at[0]
        arrived = [c.rank for c in at]
        missing = [r for r in members if r not in arrived]
        mismatches = [
            f"rank {c.rank} entered {c.op} ({c.msg_bytes} B) at #{frontier} where rank {first.rank} entered "
            f"{first.op} ({first.msg_bytes} B)"
            for c in at[1:]
            if c.op != first.op or c.msg_bytes != first.msg_bytes
        ]
        unfinished = records_completion and any(c.state != "completed" for c in at)
        if not missing and not mismatches and not unfinished:
            continue
        states = []
        for r in members:
            mine = last.get(r)
            elsewhere = latest_anywhere.get(r)
            if r not in dumped:
                doing = "no Flight Recorder dump of this rank"
            elif mine is not None and mine.seq == frontier:
                doing = f"waiting in {_describe(mine)}"
            elif elsewhere is not None and elsewhere.group_key != key:
                doing = f"last in this group {_describe(mine)}; latest call {_describe(elsewhere)}"
            else:
                doing = f"last call {_describe(mine)}; never entered #{frontier}"
            states.append(
                HangRank(
                    rank=r,
                    last_seq=mine.seq if mine else None,
                    last_op=mine.op if mine else None,
                    last_state=mine.state if mine else None,
                    doing=doing,
                )
            )
        out.append(
            HangGroup(
                group=first.group,
                group_key=key,
                op=first.op,
                seq=frontier,
                msg_bytes=first.msg_bytes,
                arrived_ranks=arrived,
                missing_ranks=missing,
                mismatches=mismatches,
                ranks=states,
            )
        )
    return out


def root_ranks(groups: list[HangGroup]) -> list[int]:
    """The ranks the hang starts from: missing from a hung group's latest call and waiting in none (a rank that
    never entered a dp all-reduce because it waits in a tp one for a third rank is that rank's victim). When
    every missing rank waits somewhere (a cycle, or ranks that entered different calls), all the missing."""
    missing = {r for g in groups for r in g.missing_ranks}
    waiting = {r for g in groups for r in g.arrived_ranks}
    return sorted(missing - waiting) or sorted(missing)


def load_calls(con: duckdb.DuckDBPyConnection, run_id: int) -> tuple[list[FrCall], list[int], dict[str, list[int]]]:
    """A run's collective Flight Recorder entries, the ranks that dumped, and the known ranks of its groups."""
    rows = con.execute(
        """SELECT rank, group_key, coalesce(nullif(group_desc, ''), group_name, group_key), collective_seq, op,
                  msg_bytes, state, created_us, group_ranks
           FROM fr_entries WHERE run_id = ? AND NOT is_p2p AND collective_seq IS NOT NULL AND group_key IS NOT NULL
           ORDER BY rank, record_id""",
        [run_id],
    ).fetchall()
    calls = [
        FrCall(
            int(r[0]), str(r[1]), str(r[2]), int(r[3]), str(r[4]), r[5], str(r[6]), r[7], tuple(r[8]) if r[8] else None
        )
        for r in rows
    ]
    dumped = [
        int(r[0])
        for r in con.execute(
            """SELECT DISTINCT rank FROM sources WHERE run_id = ? AND kind = 'flight_recorder' AND status = 'ok'
               AND rank IS NOT NULL""",
            [run_id],
        ).fetchall()
    ]
    groups = {
        str(k): [int(x) for x in ranks]
        for k, ranks in con.execute(
            "SELECT group_key, ranks FROM process_groups WHERE run_id = ? AND ranks IS NOT NULL", [run_id]
        ).fetchall()
    }
    return calls, dumped, groups


def fr_call(row: dict[str, object]) -> FrCall | None:
    """The FrCall of a parsed fr_entries row; None for point-to-point calls and entries without a group."""
    if row["is_p2p"] or row["collective_seq"] is None or row["group_key"] is None:
        return None
    ranks = row["group_ranks"]
    return FrCall(
        rank=int(str(row["rank"])),
        group_key=str(row["group_key"]),
        group=str(row["group_desc"] or row["group_name"]),
        seq=int(str(row["collective_seq"])),
        op=str(row["op"]),
        msg_bytes=row["msg_bytes"] if isinstance(row["msg_bytes"], int) else None,
        state=str(row["state"]),
        created_us=row["created_us"] if isinstance(row["created_us"], float) else None,
        group_ranks=tuple(ranks) if isinstance(ranks, list) and ranks else None,
    )


def run_hang(con: duckdb.DuckDBPyConnection, run_id: int) -> list[HangGroup]:
    """The hang analysis of a stored run (empty when it has no Flight Recorder dump or nothing hung)."""
    calls, dumped, groups = load_calls(con, run_id)
    return analyze(calls, dumped, groups)
