"""Run-level linking of NCCL communicators across processes and files.

A COLL line names its communicator only by a per-process pointer, so the ingester writes provisional
group keys (`nccl:ptr:<host:pid>:<comm>:n<nranks>`). After every ingest batch `link_run` groups the
communicator members of the whole run (nccl_comms rows, one per process and communicator):

1. key by commId when the init line has one: `nccl:<commId>`;
2. else a split child (2.23+ lines without commId) keys by its parent's key, the split counter printed
   by 2.24+ (else the order of the split in the process, see `_assign_keys`) and the color:
   `<parent key>/split<n>:color<c>`;
3. else by size and order of creation on that device of the process: `nccl:n<nranks>#<k>` (the k-th
   communicator of that size each rank created). When two different communicators land on one such
   key (e.g. two TP groups of 2), members are dealt into sub-groups `...#k.<j>` in global-rank order,
   each rank of a communicator once: this recovers contiguous and strided layouts.

The world communicator is the group with the largest nranks (ties: the one created first); a
process's (per device) global rank is its rank in it. Then comm_events get the final group_key, the
global `rank`, and Send/Recv `peer` translated from communicator rank to global rank — only for
groups whose every member's global rank is known, which makes the translation reversible: a later
run first maps peers back with the mapping stored in nccl_comms.global_rank, so linking is
idempotent and can be repeated as more files arrive. COLL lines of communicators without any init
line keep the provisional key and a NULL rank (when no world mapping covers their process). A split
ingest into a run without NCCL rows plans the same link on the parsed rows (`plan_link`) and writes the
calls linked (`nccl_prelink`); link_run is told so and skips the UPDATE passes over the calls when the
stored rows give the same maps. Last, the calls of a rank that a profiler trace of the run also describes stop counting in the log
(`count_each_call_once`; which formats are which is `formats.Trait`).

Runs inside the caller's transaction (no BEGIN/COMMIT here).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Protocol

import duckdb
import pyarrow as pa

from . import formats
from .arrow_views import all_registered, registered
from .formats import Trait


@dataclass
class _Member:
    rid: int
    order: int  # creation order in the run (source, then row)
    host: str | None
    pid: int | None
    dev: int | None
    ptr: str
    comm_rank: int | None
    nranks: int | None
    comm_id: str | None
    parent: str | None
    color: int | None
    split_count: int | None
    old_key: str
    old_global: int | None
    key: str = ""
    parent_key: str | None = None

    @property
    def base(self) -> str:
        return f"{self.host}:{self.pid}" if self.host is not None else f"unknown/cuda:{self.dev}"

    @property
    def proc(self) -> tuple:
        return (self.host, self.pid) if self.host is not None else (None, self.dev)

    @property
    def context(self) -> tuple:
        return (self.host, self.pid, self.dev)

    def labels(self) -> list[str]:
        """Every "process" label the ingester may have given this member's COLL rows."""
        if self.host is None:
            return [self.base]
        return [self.base, f"{self.base}/cuda:{self.dev}"]


@dataclass
class LinkPlan:
    """What linking does with a run's communicator members: each member's key, the global rank per (host,
    pid, device), and the three maps comm_events rows go through (`event_keys`: (process, comm_ptr) -> group
    key; `process_ranks`: process -> global rank; `peers`: fully mapped group key -> global rank per
    communicator rank)."""

    members: list[_Member]
    world_rank: dict[tuple, int]
    groups: dict[str, dict[int | None, _Member]]
    full: dict[str, dict[int | None, _Member]]
    event_keys: dict[tuple[str, str], str]
    process_ranks: dict[str, int]
    peers: dict[str, list[int]]

    def same_calls(self, other: LinkPlan) -> bool:
        """Whether comm_events rows go through the same maps under both plans."""
        return (self.event_keys, self.process_ranks, self.peers) == (
            other.event_keys,
            other.process_ranks,
            other.peers,
        )


def plan_link(members: list[_Member]) -> LinkPlan:
    """Keys, world ranks and the maps of comm_events rows for the members (in creation order)."""
    _assign_keys(members)
    world_rank = _split_collisions(members)
    groups = _groups(members)
    full = {k: g for k, g in groups.items() if _fully_mapped(g, world_rank)}
    peers = {k: [world_rank[g[r].context] for r in range(len(g))] for k, g in full.items()}
    return LinkPlan(members, world_rank, groups, full, _event_keys(members), _rank_labels(world_rank), peers)


class WrittenLinked(Protocol):
    """Calls written already linked by a command (`nccl_prelink.Prelinked`)."""

    def matches(self, con: duckdb.DuckDBPyConnection, run_id: int, plan: LinkPlan) -> bool:
        """Whether the run's calls are linked as `plan` links them."""

    def undo(self, con: duckdb.DuckDBPyConnection, run_id: int) -> None:
        """Put the calls written linked back as parsed."""


def link_run(con: duckdb.DuckDBPyConnection, run_id: int, written: WrittenLinked | None = None) -> None:
    """Group the run's NCCL communicators across files, fill global ranks, rewrite event group keys.

    `written` (an `nccl_prelink.Prelinked`) holds the plan with which this command wrote its files' calls
    already linked: when the run's stored members give the same maps, the calls are left as they are (the
    UPDATE passes over every call are skipped); else they are first put back as parsed and linked here."""
    members = _load_members(con, run_id)
    revert = _old_full_mapping(members)
    plan = plan_link(members)
    members, world_rank, groups, full = plan.members, plan.world_rank, plan.groups, plan.full
    events_linked = written is not None and written.matches(con, run_id, plan)
    if written is not None and not events_linked:
        written.undo(con, run_id)
    distinct = list({(m.host, m.pid, m.ptr): m for m in members}.values())

    nccl_sources = "SELECT source_id FROM sources WHERE run_id = $run AND list_contains($linked, kind)"
    tables: dict[str, pa.Table] = {
        "_nl_revert": pa.table(
            {
                "group_key": pa.array([r[0] for r in revert], pa.string()),
                "comm_rank": pa.array([r[1] for r in revert], pa.int32()),
                "global_rank": pa.array([r[2] for r in revert], pa.int32()),
            }
        ),
        "_nl_comms": pa.table(
            {
                "rid": pa.array([m.rid for m in members], pa.int64()),
                "group_key": pa.array([m.key for m in members], pa.string()),
                "global_rank": pa.array([world_rank.get(m.context) for m in members], pa.int32()),
            }
        ),
        "_nl_events": pa.table(
            {
                "process": pa.array([k[0] for k in plan.event_keys], pa.string()),
                "comm_ptr": pa.array([k[1] for k in plan.event_keys], pa.string()),
                "group_key": pa.array(list(plan.event_keys.values()), pa.string()),
            }
        ),
        "_nl_peer": pa.table(
            {
                "group_key": pa.array([k for k, g in plan.peers.items() for _ in g], pa.string()),
                "comm_rank": pa.array([r for g in plan.peers.values() for r in range(len(g))], pa.int32()),
                "global_rank": pa.array([x for g in plan.peers.values() for x in g], pa.int32()),
            }
        ),
        "_nl_rank": pa.table(
            {
                "process": pa.array(list(plan.process_ranks), pa.string()),
                "global_rank": pa.array(list(plan.process_ranks.values()), pa.int32()),
            }
        ),
        "_nl_topo": pa.table(
            {
                "host": pa.array([m.host for m in distinct], pa.string()),
                "pid": pa.array([m.pid for m in distinct], pa.int32()),
                "comm_ptr": pa.array([m.ptr for m in distinct], pa.string()),
                "group_key": pa.array([m.key for m in distinct], pa.string()),
            }
        ),
    }
    with all_registered(con, tables):
        params = {"run": run_id, "linked": formats.kinds_with(Trait.NCCL_COMMUNICATORS)}
        if not events_linked:
            _link_events(con, params, nccl_sources)
        con.execute(
            """UPDATE nccl_comms SET group_key = u.group_key, global_rank = u.global_rank
            FROM _nl_comms u WHERE nccl_comms.rowid = u.rid""",
        )
        con.execute(
            f"""UPDATE nccl_topology SET group_key = m.group_key FROM _nl_topo m
            WHERE nccl_topology.run_id = $run AND nccl_topology.source_id IN ({nccl_sources})
              AND nccl_topology.host IS NOT DISTINCT FROM m.host AND nccl_topology.pid IS NOT DISTINCT FROM m.pid
              AND nccl_topology.comm_ptr = m.comm_ptr""",
            params,
        )
        _write_groups(con, run_id, groups, full, world_rank, members)
    count_each_call_once(con, run_id)


def _link_events(con: duckdb.DuckDBPyConnection, params: dict[str, Any], nccl_sources: str) -> None:
    """The UPDATE passes over the run's NCCL calls: peers of the last link back to communicator ranks, then
    the group key, the peer and the rank of the new one (the tables link_run registered)."""
    # Send/Recv peers of groups that were fully mapped at the last link go back to communicator ranks.
    con.execute(
        f"""UPDATE comm_events SET peer = r.comm_rank FROM _nl_revert r
        WHERE comm_events.run_id = $run AND comm_events.source_id IN ({nccl_sources})
          AND comm_events.op IN ('send', 'recv') AND comm_events.group_key = r.group_key
          AND comm_events.peer = r.global_rank""",
        params,
    )
    con.execute(
        f"""UPDATE comm_events SET group_key = m.group_key FROM _nl_events m
        WHERE comm_events.run_id = $run AND comm_events.source_id IN ({nccl_sources})
          AND comm_events.process = m.process AND comm_events.comm_ptr = m.comm_ptr
          AND comm_events.group_key IS DISTINCT FROM m.group_key""",
        params,
    )
    con.execute(
        f"""UPDATE comm_events SET peer = t.global_rank FROM _nl_peer t
        WHERE comm_events.run_id = $run AND comm_events.source_id IN ({nccl_sources})
          AND comm_events.op IN ('send', 'recv') AND comm_events.group_key = t.group_key
          AND comm_events.peer = t.comm_rank""",
        params,
    )
    con.execute(
        f"""UPDATE comm_events SET rank = m.global_rank FROM _nl_rank m
        WHERE comm_events.run_id = $run AND comm_events.source_id IN ({nccl_sources})
          AND comm_events.process = m.process AND comm_events.rank IS DISTINCT FROM m.global_rank""",
        params,
    )


def count_each_call_once(con: duckdb.DuckDBPyConnection, run_id: int) -> None:
    """An NCCL log and a profiler trace of the same rank describe the same calls: the trace's count (its
    profiler steps are the iterations, its kernels the durations) and the log's calls of that rank are
    kept, for communicators and topology, with `counted = false`. Ranks without a trace count from the log;
    Inspector records and Flight Recorder entries (SUPERSEDED_BY_LOG) of a rank count only when neither a trace
    nor an NCCL log describes it."""
    covered = [
        r
        for (r,) in con.execute(
            """SELECT DISTINCT e.rank FROM comm_events e JOIN sources s ON s.source_id = e.source_id
        WHERE e.run_id = ? AND list_contains(?, s.kind) AND e.rank IS NOT NULL""",
            [run_id, formats.kinds_with(Trait.PER_RANK_TIMED_TRACE)],
        ).fetchall()
    ]
    con.execute(
        """UPDATE comm_events SET counted = NOT (rank IS NOT NULL AND list_contains($covered, rank))
        WHERE run_id = $run
          AND source_id IN (SELECT source_id FROM sources WHERE run_id = $run AND list_contains($logs, kind))
          AND counted <> NOT (rank IS NOT NULL AND list_contains($covered, rank))""",
        {"run": run_id, "covered": covered, "logs": formats.kinds_with(Trait.SUPERSEDED_BY_TRACE)},
    )
    # Inspector records and Flight Recorder entries of a rank an NCCL log describes repeat the log's calls.
    repeats = formats.kinds_with(Trait.SUPERSEDED_BY_LOG)
    logs = [k for k in formats.kinds_with(Trait.SUPERSEDED_BY_TRACE) if k not in repeats]
    covered += [
        r
        for (r,) in con.execute(
            """SELECT DISTINCT e.rank FROM comm_events e JOIN sources s ON s.source_id = e.source_id
        WHERE e.run_id = ? AND list_contains(?, s.kind) AND e.rank IS NOT NULL""",
            [run_id, logs],
        ).fetchall()
    ]
    con.execute(
        """UPDATE comm_events SET counted = NOT (rank IS NOT NULL AND list_contains($covered, rank))
        WHERE run_id = $run
          AND source_id IN (SELECT source_id FROM sources WHERE run_id = $run AND list_contains($repeats, kind))
          AND counted <> NOT (rank IS NOT NULL AND list_contains($covered, rank))""",
        {"run": run_id, "covered": covered, "repeats": repeats},
    )


# ------------------------------------------------------------------------------------------ grouping


def _load_members(con: duckdb.DuckDBPyConnection, run_id: int) -> list[_Member]:
    split_counts: dict[tuple[int, str], int] = {}
    for source_id, meta in con.execute(
        "SELECT source_id, meta FROM sources WHERE run_id = ? AND list_contains(?, kind) AND status = 'ok'",
        [run_id, formats.kinds_with(Trait.NCCL_COMMUNICATORS)],
    ).fetchall():
        counts = (json.loads(meta) if isinstance(meta, str) else (meta or {})).get("split_counts") or {}
        for label, n in counts.items():
            split_counts[(source_id, label)] = int(n)
    rows = con.execute(
        f"""SELECT rowid, source_id, {", ".join(MEMBER_COLUMNS)}
           FROM nccl_comms WHERE run_id = ? ORDER BY source_id, rowid""",
        [run_id],
    ).fetchall()
    return members_of(rows, split_counts)


# nccl_comms columns a member is made of, after (rowid, source): see members_of
MEMBER_COLUMNS = (
    "host",
    "pid",
    "cuda_dev",
    "comm_ptr",
    "comm_rank",
    "nranks",
    "comm_id",
    "parent_ptr",
    "color",
    "group_key",
    "global_rank",
)


def members_of(rows: list[tuple[Any, ...]], split_counts: dict[tuple[Any, str], int]) -> list[_Member]:
    """Members from (rowid, source, *MEMBER_COLUMNS) rows in creation order; split counters by (source, "process
    base:pointer")."""
    out = []
    for i, (rid, sid, host, pid, dev, ptr, crank, nranks, cid, parent, color, key, grank) in enumerate(rows):
        m = _Member(rid, i, host, pid, dev, ptr, crank, nranks, cid, parent, color, None, key, grank)
        m.split_count = split_counts.get((sid, f"{m.base}:{ptr}"))
        out.append(m)
    return out


def _assign_keys(members: list[_Member]) -> None:
    """Keys by commId, split parent + color, or size + creation order (see module docstring).

    Split children without commId or split counter are first numbered per (parent, color): right when
    colors name groups (PyTorch hashes the member list into the color) even if some ranks sat out
    earlier splits. When that puts one communicator rank twice into a group, the children of that
    parent are numbered per parent instead: right when every rank takes part in every split with
    small reused colors (color = rank // tp, then rank % tp)."""
    per_parent: set[str] = set()
    for _ in range(8):
        _key_pass(members, per_parent)
        bad = _colliding_split_parents(members)
        if bad <= per_parent:
            return
        per_parent |= bad


def _key_pass(members: list[_Member], per_parent: set[str]) -> None:
    by_proc_ptr: dict[tuple, _Member] = {}  # latest member per (process, raw pointer)
    split_seen: dict[tuple, int] = defaultdict(int)
    size_seen: dict[tuple, int] = defaultdict(int)
    for m in members:  # creation order: parents come before their children
        parent = by_proc_ptr.get((m.proc, m.parent)) if m.parent else None
        m.parent_key = None
        if m.comm_id:
            m.key = f"nccl:{m.comm_id}"
        elif parent is not None and m.color is not None:
            m.parent_key = parent.key
            n = m.split_count
            if n is None:
                cls = (m.context, parent.key) if parent.key in per_parent else (m.context, parent.key, m.color)
                n = split_seen[cls]
                split_seen[cls] += 1
            m.key = f"{parent.key}/split{n}:color{m.color}"
        else:
            size_cls = (m.context, m.nranks, m.color)
            k = size_seen[size_cls]
            size_seen[size_cls] += 1
            color = f":color{m.color}" if m.color is not None else ""
            m.key = f"nccl:n{m.nranks}{color}#{k}"
        by_proc_ptr[(m.proc, m.ptr.split("#")[0])] = m


def _colliding_split_parents(members: list[_Member]) -> set[str]:
    """Parent keys whose counted split children hold one communicator rank twice in a group."""
    by_key: dict[str, list[_Member]] = defaultdict(list)
    for m in _distinct(members):
        if m.parent_key is not None and m.split_count is None:
            by_key[m.key].append(m)
    bad: set[str] = set()
    for ms in by_key.values():
        parent = ms[0].parent_key
        if parent is not None and (
            len({m.comm_rank for m in ms}) < len(ms) or len(ms) > max(m.nranks or 0 for m in ms)
        ):
            bad.add(parent)
    return bad


def _distinct(members: list[_Member]) -> list[_Member]:
    """One member per (process, device, pointer): the same process ingested twice counts once."""
    seen: dict[tuple, _Member] = {}
    for m in members:
        seen.setdefault((m.context, m.ptr), m)
    return list(seen.values())


def _world_ranks(members: list[_Member], exclude: set[str]) -> dict[tuple, int]:
    """Global rank per (host, pid, device): the rank in the largest (then first created) communicator."""
    by_key: dict[str, list[_Member]] = defaultdict(list)
    for m in members:
        if m.key not in exclude and m.comm_rank is not None:
            by_key[m.key].append(m)
    if not by_key:
        return {}
    world = min(by_key, key=lambda k: (-max(x.nranks or 0 for x in by_key[k]), min(x.order for x in by_key[k]), k))
    out: dict[tuple, int] = {}
    for m in by_key[world]:
        if m.comm_rank is not None:  # always: by_key holds members with a rank
            out.setdefault(m.context, m.comm_rank)
    return out


def _split_collisions(members: list[_Member]) -> dict[tuple, int]:
    """Deal members of size+order keys that hold one communicator rank twice into sub-groups;
    returns the final world mapping (host, pid, device) -> global rank."""
    distinct = _distinct(members)
    by_key: dict[str, list[_Member]] = defaultdict(list)
    for m in distinct:
        by_key[m.key].append(m)
    collided = {k for k, ms in by_key.items() if k.startswith("nccl:n") and len({m.comm_rank for m in ms}) < len(ms)}
    if collided:
        provisional = _world_ranks(distinct, collided)
        for key in sorted(collided):
            ms = sorted(by_key[key], key=lambda m: (provisional.get(m.context, 1 << 30), m.base, m.dev or 0, m.order))
            subgroups: list[dict[int | None, _Member]] = []
            for m in ms:
                for sg in subgroups:
                    if m.comm_rank not in sg and len(sg) < (m.nranks or 0):
                        sg[m.comm_rank] = m
                        break
                else:
                    subgroups.append({m.comm_rank: m})
            new_key = {}
            for j, sg in enumerate(subgroups):
                for m in sg.values():
                    new_key[(m.context, m.ptr)] = f"{key}.{j}"
            for m in members:
                if m.key == key:
                    m.key = new_key[(m.context, m.ptr)]
    return _world_ranks(_distinct(members), set())


def _groups(members: list[_Member]) -> dict[str, dict[int | None, _Member]]:
    """group key -> {communicator rank: member}."""
    out: dict[str, dict[int | None, _Member]] = defaultdict(dict)
    for m in _distinct(members):
        out[m.key].setdefault(m.comm_rank, m)
    return dict(out)


def _fully_mapped(group: dict[int | None, _Member], world_rank: dict[tuple, int]) -> bool:
    """Every rank 0..nranks-1 present with a distinct known global rank."""
    nranks = max((m.nranks or 0) for m in group.values())
    if set(group) != set(range(nranks)):
        return False
    globals_ = [world_rank.get(m.context) for m in group.values()]
    return None not in globals_ and len(set(globals_)) == len(globals_)


def _old_full_mapping(members: list[_Member]) -> list[tuple[str, int, int]]:
    """(old key, comm rank, old global rank) of the groups the previous link fully mapped."""
    by_key: dict[str, dict[int, int]] = defaultdict(dict)
    nranks: dict[str, int] = defaultdict(int)
    for m in members:
        nranks[m.old_key] = max(nranks[m.old_key], m.nranks or 0)
        if m.old_global is not None and m.comm_rank is not None:
            by_key[m.old_key].setdefault(m.comm_rank, m.old_global)
    out: list[tuple[str, int, int]] = []
    for key, mapping in by_key.items():
        if set(mapping) == set(range(nranks[key])) and len(set(mapping.values())) == len(mapping):
            out.extend((key, r, g) for r, g in mapping.items())
    return out


def _event_keys(members: list[_Member]) -> dict[tuple[str, str], str]:
    """(process label, comm_ptr) -> group key; the first member of a label and pointer wins."""
    seen: dict[tuple[str, str], str] = {}
    for m in members:
        for label in m.labels():
            seen.setdefault((label, m.ptr), m.key)
    return seen


def _rank_labels(world_rank: dict[tuple, int]) -> dict[str, int]:
    """process label -> global rank; "host:pid" only when that process has a single device in the world (a
    member without a device, as NCCL Inspector's, takes the process's one device when another source names it)."""
    devs: dict[tuple, set[int | None]] = defaultdict(set)
    for context in world_rank:
        devs[context[:2]].add(context[2])
    labels: dict[str, int] = {}
    for context, g in world_rank.items():
        host, pid, dev = context
        if host is None:
            labels[f"unknown/cuda:{dev}"] = g
            continue
        known = devs[(host, pid)] - {None}
        if dev is not None:
            labels[f"{host}:{pid}/cuda:{dev}"] = g
        if len(known) == 1 if dev is not None else not known:
            labels[f"{host}:{pid}"] = g
    return labels


def _write_groups(
    con: duckdb.DuckDBPyConnection,
    run_id: int,
    groups: dict[str, dict[int | None, _Member]],
    full: dict[str, dict[int | None, _Member]],
    world_rank: dict[tuple, int],
    members: list[_Member],
) -> None:
    """Upsert process_groups for every communicator and provisional group; drop stale NCCL groups."""
    rows: list[tuple[Any, ...]] = []
    for key, group in groups.items():
        nranks = max((m.nranks or 0) for m in group.values()) or None
        ranks = [world_rank[group[r].context] for r in range(nranks)] if key in full and nranks else None
        comm_id = next((m.comm_id for m in group.values() if m.comm_id), None)
        desc = f"NCCL communicator of {nranks} ranks" + (f", commId {comm_id}" if comm_id else "")
        rows.append((key, desc, ranks, nranks, "nccl_init"))
    known = {r[0] for r in rows}
    for key, size in con.execute(
        """SELECT group_key, max(group_size) FROM comm_events
           WHERE run_id = ? AND group_key LIKE 'nccl:ptr:%' GROUP BY group_key""",
        [run_id],
    ).fetchall():
        if key not in known:
            rows.append(
                (key, f"NCCL communicator of {size} ranks seen only in COLL lines of one process", None, size, "event")
            )
    for key, desc, ranks, size, origin in rows:
        con.execute(
            """INSERT INTO process_groups (run_id, group_key, description, backend, ranks, size, origin)
               VALUES (?, ?, ?, 'nccl', ?, ?, ?)
               ON CONFLICT (run_id, group_key) DO UPDATE SET
                   description = excluded.description, ranks = excluded.ranks, size = excluded.size""",
            [run_id, key, desc, ranks, size, origin],
        )
    keep = pa.table({"group_key": pa.array([r[0] for r in rows], pa.string())})
    with registered(con, keep, "_nl_keep"):
        con.execute(
            """DELETE FROM process_groups WHERE run_id = ? AND group_key LIKE 'nccl:%'
               AND origin IN ('nccl_init', 'event') AND group_key NOT IN (SELECT group_key FROM _nl_keep)""",
            [run_id],
        )
