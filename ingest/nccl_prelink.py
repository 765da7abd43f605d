"""NCCL calls written already linked: when every file of a command is parsed before any is written (the split
ingest holds the parses) and the run holds no NCCL rows yet, the communicators of the files are linked
here on their parsed nccl_comms rows (`nccl_link.plan_link`, the same code as the run-level link) and each
call is written with its final group key, global rank and Send/Recv peer, instead of provisional values that
`nccl_link.link_run` rewrites with UPDATE passes over every call.

`link_run` is still called after the files land (nccl_comms, topology and process groups are linked there,
on few rows): it plans from the stored members again and, when the maps a call goes through are the same
as the ones used here, and every NCCL file of the run went through them, leaves the calls alone. Otherwise
(a planned file was refused or failed to store, so its communicators are missing) the calls are first put
back as parsed from the values kept here, and linked by the UPDATE passes as before: the store is the same
row for row either way (tests/test_nccl_prelink.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import formats
from .arrow_views import registered
from .formats import Trait
from .nccl_link import MEMBER_COLUMNS, LinkPlan, members_of, plan_link
from .parse_file import ParsedFile
from .records import FROM_ROWS, ParseResult, rows_table

_P2P = ("send", "recv")


@dataclass
class _Written:
    """A file whose calls were linked before its write: where it went, and its calls' values as parsed."""

    path: str
    sha256: str | None
    parsed: list[pa.RecordBatch]  # process, seq, group_key, rank, peer as parsed; whether linking changed the row


@dataclass
class Prelinked:
    """The link plan of a command's NCCL files for one run, applied to each file's calls before its write."""

    plan: LinkPlan
    written: list[_Written] = field(default_factory=list)

    def apply(self, path: str, parsed: ParsedFile) -> None:
        """Give the file's calls (an NCCL format's) their linked group key, rank and peer, in place."""
        result = parsed.result
        if result is None or not formats.get(result.kind).has(Trait.NCCL_COMMUNICATORS):
            return
        if result.events:  # the row dicts are written first: they go first as a table, in the same order
            result.event_tables.insert(
                0, rows_table("comm_events", result.events).replace_schema_metadata({FROM_ROWS: b"1"})
            )
            result.events = []
        if any(c not in t.column_names for t in result.event_tables for c in ("process", "seq")):
            return  # calls that could not be put back: written as parsed, so link_run links the run's calls
        maps = _Maps(self.plan)
        kept: list[pa.RecordBatch] = []
        for i, table in enumerate(result.event_tables):
            result.event_tables[i], before = maps.link(table)
            kept += before
        self.written.append(_Written(path, parsed.content_sha256 or parsed.sha256, kept))

    def matches(self, con: duckdb.DuckDBPyConnection, run_id: int, plan: LinkPlan) -> bool:
        """Whether the run's calls are linked as `plan` (made from the stored members) links them: the same
        maps, and every stored NCCL file of the run written through them."""
        if not plan.same_calls(self.plan):
            return False
        done = {(w.path, w.sha256) for w in self.written}
        stored = con.execute(
            "SELECT path, sha256 FROM sources WHERE run_id = ? AND status = 'ok' AND list_contains(?, kind)",
            [run_id, formats.kinds_with(Trait.NCCL_COMMUNICATORS)],
        ).fetchall()
        if not all((path, sha) in done for path, sha in stored):
            return False
        for w in self.written:  # the calls stay as written: their values as parsed are not needed
            w.parsed = []
        return True

    def undo(self, con: duckdb.DuckDBPyConnection, run_id: int) -> None:
        """Put the calls of the files written here back as parsed (the rows linking changed)."""
        for w in self.written:
            found = con.execute(
                "SELECT source_id FROM sources WHERE run_id = ? AND path = ? AND sha256 = ? AND status = 'ok'",
                [run_id, w.path, w.sha256],
            ).fetchall()
            for before in w.parsed if found else []:
                rows = before.filter(before.column("changed"))
                if not rows.num_rows:
                    continue
                parsed = pa.table(
                    {
                        "process": rows.column("process").cast(pa.string()),
                        "seq": rows.column("seq"),
                        "group_key": rows.column("group_key").cast(pa.string()),
                        "rank": rows.column("rank").cast(pa.int32()),
                        "peer": rows.column("peer").cast(pa.int32()),
                    }
                )
                with registered(con, parsed, "_nl_parsed"):
                    con.execute(
                        """UPDATE comm_events SET group_key = p.group_key, rank = p.rank, peer = p.peer
                        FROM _nl_parsed p WHERE comm_events.run_id = ? AND comm_events.source_id = ?
                          AND comm_events.process = p.process AND comm_events.seq = p.seq""",
                        [run_id, found[0][0]],
                    )


class Prelinks:
    """The split ingest's side of it: sees each parse as it comes (their communicators only), plans each run
    once the files are split into runs, links each file's calls before its write."""

    def __init__(self) -> None:
        self._members: dict[int, tuple[list[tuple[Any, ...]], dict[str, int]]] = {}
        self._runs: dict[str, Prelinked] = {}

    def saw(self, key: int, result: ParseResult) -> None:
        """A parsed file's communicators (the rows link_run would read back from the store)."""
        rows = rows_table("nccl_comms", result.nccl_comms).to_pylist() if result.nccl_comms else []
        members = [tuple(r.get(c) for c in MEMBER_COLUMNS) for r in rows]
        counts = result.meta.get("split_counts") or {}
        linked = formats.get(result.kind).has(Trait.NCCL_COMMUNICATORS)
        self._members[key] = (members, {k: int(n) for k, n in counts.items()} if linked else {})

    def plan(self, con: duckdb.DuckDBPyConnection, run: str, run_id: int | None, keys: list[int]) -> None:
        """Plan the run's link from the files `keys` (in the order they are written) when the run holds no
        NCCL rows yet (else the stored calls would need linking again anyway: link_run does it all)."""
        if (
            run_id is not None
            and con.execute(
                """SELECT (SELECT count(*) FROM nccl_comms WHERE run_id = $run) + (SELECT count(*) FROM sources
                WHERE run_id = $run AND status = 'ok' AND list_contains($kinds, kind))""",
                {"run": run_id, "kinds": formats.kinds_with(Trait.NCCL_COMMUNICATORS)},
            ).fetchall()[0][0]
        ):
            return
        rows: list[tuple[Any, ...]] = []
        counts: dict[tuple[Any, str], int] = {}
        for i, key in enumerate(k for k in keys if k in self._members):
            members, split_counts = self._members[key]
            rows += [(None, i, *m) for m in members]
            counts.update({(i, label): n for label, n in split_counts.items()})
        self._runs[run] = Prelinked(plan_link(members_of(rows, counts)))

    def apply(self, run: str, path: str, parsed: ParsedFile | None) -> None:
        """Link the file's calls if its run was planned."""
        prelinked = self._runs.get(run)
        if prelinked is not None and parsed is not None:
            prelinked.apply(path, parsed)

    def written(self, run: str) -> Prelinked | None:
        """What link_run of the run is told was written already linked."""
        return self._runs.get(run)


class _Maps:
    """A plan's maps as lookups over the dictionaries of an event table's columns."""

    def __init__(self, plan: LinkPlan) -> None:
        self.event_keys = plan.event_keys
        self.ranks = plan.process_ranks
        self.full = {key: i for i, key in enumerate(plan.peers)}
        sizes = [len(g) for g in plan.peers.values()]
        self.size = np.array([*sizes, 0], np.int64)  # the last: no fully mapped group
        self.offset = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.globals = np.array([r for g in plan.peers.values() for r in g] or [0], np.int64)

    def link(self, table: pa.Table) -> tuple[pa.Table, list[pa.RecordBatch]]:
        """The table with its rows' group key, rank and peer linked, and batches of (process, seq, the three
        as parsed, changed) of its rows (the parsed columns themselves, not copies)."""
        batches, before = [], []
        for batch in table.to_batches():
            linked, kept = self._batch(batch)
            batches.append(linked)
            before.append(kept)
        if not batches:
            return table, []
        return pa.Table.from_batches(batches, batches[0].schema), before

    def _batch(self, batch: pa.RecordBatch) -> tuple[pa.RecordBatch, pa.RecordBatch]:
        n = batch.num_rows
        names = batch.schema.names
        proc, procs = _codes(batch.column("process"))
        ptr, ptrs = _codes(batch.column("comm_ptr")) if "comm_ptr" in names else (np.full(n, -1), [])
        # (process, pointer) -> index of its new key in `keys` (-1: none), for the pairs the rows hold
        width = len(ptrs) + 1
        pair_code = np.where(proc >= 0, proc, len(procs)) * width + np.where(ptr >= 0, ptr, len(ptrs))
        present = np.zeros((len(procs) + 1) * width, bool)
        present[pair_code] = True
        pair = np.full(len(present), -1, np.int64)
        keys: list[str] = []
        index: dict[str, int] = {}
        for code in np.flatnonzero(present).tolist():
            i, j = divmod(code, width)
            key = self.event_keys.get((procs[i], ptrs[j])) if i < len(procs) and j < len(ptrs) else None
            if key is not None:
                pair[code] = index.setdefault(key, len(index))
                if len(keys) < len(index):
                    keys.append(key)
        new_key = pair[pair_code]
        old, olds = _codes(batch.column("group_key")) if "group_key" in names else (np.full(n, -1), [])
        key_code = np.where(new_key >= 0, len(olds) + new_key, old)
        values = [*olds, *keys]
        group_key = pa.DictionaryArray.from_arrays(
            pa.array(key_code, pa.int32(), mask=key_code < 0), pa.array(values, pa.string())
        )
        # Send/Recv peers of fully mapped groups: communicator rank -> global rank
        full = np.array([*(self.full.get(v, -1) if v is not None else -1 for v in values), -1], np.int64)[key_code]
        ops, opv = _codes(batch.column("op")) if "op" in names else (np.full(n, -1), [])
        p2p = np.array([*(v in _P2P for v in opv), False])[ops]
        peer_col = batch.column("peer") if "peer" in names else pa.nulls(n, pa.int32())
        peer_valid = _valid(peer_col)
        peer = pc.fill_null(peer_col, 0).to_numpy(zero_copy_only=False).astype(np.int64)
        group = np.where(full >= 0, full, len(self.size) - 1)
        moved = p2p & peer_valid & (full >= 0) & (peer >= 0) & (peer < self.size[group])
        target = np.where(moved, self.offset[group] + np.where(moved, peer, 0), 0)
        new_peer = np.where(moved, self.globals[target], peer)
        peers = pa.array(new_peer, pa.int32(), mask=~(peer_valid | moved))
        # global rank of the process label
        by_proc = np.array([*(self.ranks.get(p, -1) if p is not None else -1 for p in procs), -1], np.int64)
        has_rank = by_proc[proc] >= 0
        rank_col = batch.column("rank") if "rank" in names else pa.nulls(n, pa.int32())
        rank_valid = _valid(rank_col)
        rank = np.where(has_rank, by_proc[proc], pc.fill_null(rank_col, 0).to_numpy(zero_copy_only=False))
        ranks = pa.array(rank, pa.int32(), mask=~(rank_valid | has_rank))
        columns = dict(zip(names, batch.columns, strict=True))
        columns.update(group_key=group_key, peer=peers, rank=ranks)
        linked = pa.RecordBatch.from_arrays(list(columns.values()), names=list(columns))
        linked = linked.replace_schema_metadata(batch.schema.metadata)
        changed = (new_key >= 0) | moved | has_rank
        before = pa.RecordBatch.from_arrays(
            [
                batch.column("process"),
                batch.column("seq"),
                batch.column("group_key") if "group_key" in names else pa.nulls(n, pa.string()),
                rank_col,
                peer_col,
                pa.array(changed),
            ],
            names=["process", "seq", "group_key", "rank", "peer", "changed"],
        )
        return linked, before


def _codes(col: pa.Array) -> tuple[np.ndarray, list[Any]]:
    """Dictionary codes of a string column (-1 for NULL) and the dictionary's values."""
    arr = col if pa.types.is_dictionary(col.type) else pc.dictionary_encode(col)
    codes = pc.fill_null(arr.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64)
    if arr.null_count:
        codes = np.where(_valid(arr), codes, -1)
    return codes, arr.dictionary.to_pylist()


def _valid(col: pa.Array) -> np.ndarray:
    if not col.null_count:
        return np.ones(len(col), bool)
    return pc.is_valid(col).to_numpy(zero_copy_only=False)
