"""Sender x receiver bytes of a run's all-to-all calls (commlens/contract/pairs.py): the a2a_pairs rows
(what each call sent to each group rank) joined to their calls, summed per group over the run or one step,
receivers named by their global ranks through the group's member list.

Raises `UnknownRunError` (a LookupError) for a run that does not exist; a run without a matrix answers an
empty list with the reason.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import duckdb

from commlens.backend.iterations import run_id_of
from commlens.contract.pairs import PairMatrix, PairsReport
from commlens.vocab import Scheme

Con = duckdb.DuckDBPyConnection

# Every counted all_to_all call of the run, with whether its trace recorded a split list.
_CALLS = """
    SELECT e.source_id, e.seq, e.rank, e.step, e.group_key, p.seq IS NOT NULL AS has_pairs
    FROM comm_events e
    LEFT JOIN (SELECT DISTINCT source_id, seq FROM a2a_pairs WHERE run_id = ?) p
        ON p.source_id = e.source_id AND p.seq = e.seq
    WHERE e.run_id = ? AND e.counted AND e.op = 'all_to_all'
"""

NO_SPLITS = (
    "none of the run's {n} all_to_all calls records its split list, so who sent how much to whom is unknown: "
    "PyTorch profiler traces carry it as record_param_comms' `In split size` (NCCL, PyTorch 2.3 and later) or, "
    "with record_shapes=True, as the c10d::alltoall_base_ arguments (gloo); traces ingested before commlens "
    "stored splits need ingesting again"
)


def pairs(
    con: Con, run: str, group: str | None = None, step: int | None = None, bins: int | None = None
) -> PairsReport:
    """The run's all-to-all matrices, for one group or all, summed over the run or over one profiler step;
    with `bins`, a group wider than `bins` ranks comes as at most `bins` x `bins` blocks of consecutive ranks
    (1,024 ranks: 128 x 128 cells instead of 1,048,576)."""
    run_id = run_id_of(con, run)
    filters, extra = "", list[Any]()
    if group is not None:
        filters += " AND c.group_key = ?"
        extra.append(group)
    if step is not None:
        filters += " AND c.step = ?"
        extra.append(step)
    with_splits, without = con.execute(
        f"SELECT count(*) FILTER (WHERE has_pairs), count(*) FILTER (WHERE NOT has_pairs) FROM ({_CALLS})",
        [run_id, run_id],
    ).fetchall()[0]
    steps = [
        int(r[0])
        for r in con.execute(
            f"SELECT DISTINCT step FROM ({_CALLS}) WHERE has_pairs AND step IS NOT NULL ORDER BY step",
            [run_id, run_id],
        ).fetchall()
    ]
    groups = con.execute(
        f"""SELECT c.group_key, any_value(g.scheme), any_value(g.ranks), count(*)
            FROM ({_CALLS}) c LEFT JOIN process_groups g ON g.run_id = ? AND g.group_key = c.group_key
            WHERE has_pairs{filters}
            GROUP BY c.group_key ORDER BY c.group_key NULLS LAST""",
        [run_id, run_id, run_id, *extra],
    ).fetchall()
    cells = con.execute(
        f"""SELECT c.group_key, c.rank, p.peer, sum(p.bytes)::BIGINT
            FROM ({_CALLS}) c JOIN a2a_pairs p ON p.run_id = ? AND p.source_id = c.source_id AND p.seq = c.seq
            WHERE true{filters}
            GROUP BY ALL""",
        [run_id, run_id, run_id, *extra],
    ).fetchall()
    by_group: dict[str | None, list[tuple[Any, ...]]] = defaultdict(list)
    for key, rank, peer, n in cells:
        by_group[key].append((rank, peer, int(n)))
    matrices: list[PairMatrix] = []
    notes: list[str] = []
    for key, scheme, ranks, calls in groups:
        matrix = _matrix(key, scheme, ranks, int(calls), by_group[key], notes)
        if matrix is not None:
            matrices.append(binned(matrix, bins) if bins is not None and len(matrix.ranks) > bins else matrix)
    reason = None
    if not matrices:
        reason = _reason(with_splits, without, group, step, steps, notes)
    elif without:
        notes.append(f"{without} all_to_all calls of the run record no split list and are not in the matrices")
    return PairsReport(
        run=run,
        step=step,
        group=group,
        matrices=matrices,
        steps=steps,
        calls_with_splits=with_splits,
        calls_without_splits=without,
        reason=reason,
        notes=notes,
    )


def _matrix(
    key: str | None,
    scheme: Scheme | None,
    ranks: list[int] | None,
    calls: int,
    cells: list[tuple[Any, ...]],
    notes: list[str],
) -> PairMatrix | None:
    """One group's matrix in its members' order; None (with a note) where receivers cannot be named."""
    if key is None:
        notes.append(f"{calls} all_to_all calls name no process group: their receivers' global ranks are unknown")
        return None
    if not ranks:
        notes.append(f"group {key}: its members' global ranks are unknown, so the receivers cannot be named")
        return None
    size = len(ranks)
    where = {r: i for i, r in enumerate(ranks)}
    grid: list[list[int | None]] = [[None] * size for _ in range(size)]
    strays = 0
    for rank, peer, n in cells:
        if rank not in where or not 0 <= peer < size:
            strays += n
            continue
        row = grid[where[rank]]
        if row[0] is None:
            row[:] = [0] * size
        row[peer] = (row[peer] or 0) + n
    if strays:
        notes.append(f"group {key}: {strays} bytes from senders or to receivers outside its members are left out")
    total = sum(v or 0 for row in grid for v in row)
    return PairMatrix(group_key=key, scheme=scheme, ranks=list(ranks), bytes=grid, calls=calls, total_bytes=total)


def binned(m: PairMatrix, bins: int) -> PairMatrix:
    """The matrix as sums over blocks of consecutive group ranks, at most `bins` per side."""
    n = len(m.ranks)
    k = -(-n // bins)
    edges = [(a, min(a + k, n)) for a in range(0, n, k)]
    grid: list[list[int | None]] = []
    for a, b in edges:
        rows = [r for r in m.bytes[a:b] if r[0] is not None]  # a sender's row is all None or all known
        grid.append([sum(v or 0 for r in rows for v in r[c:d]) if rows else None for c, d in edges])
    labels = [f"{m.ranks[a]}-{m.ranks[b - 1]}" if b - a > 1 else str(m.ranks[a]) for a, b in edges]
    return m.model_copy(update={"bytes": grid, "per_block": k, "labels": labels})


def _reason(
    with_splits: int, without: int, group: str | None, step: int | None, steps: list[int], notes: list[str]
) -> str:
    if with_splits + without == 0:
        return "this run has no all_to_all calls"
    if with_splits == 0:
        return NO_SPLITS.format(n=without)
    if notes:
        return "; ".join(notes)
    scope = " and ".join(
        s for s in (f"group {group}" if group else "", f"step {step}" if step is not None else "") if s
    )
    known = f" (steps with them: {', '.join(map(str, steps))})" if step is not None and steps else ""
    return f"no all_to_all call with a split list in {scope}{known}"
