"""Relabelling of a finished NCCL log: when one process drives several GPUs, each device is a rank of its
own, so its rows move to the process label "host:pid/cuda:N" with a sequence of their own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from .nccl_state import Processes
from .nccl_vector import counts_of
from .records import ParseResult

# The comm_events columns this parser fills, with their store types.
EVENT_FIELDS = pa.schema(
    [
        ("rank", pa.int32()),
        ("process", pa.string()),
        ("seq", pa.int64()),
        ("op", pa.string()),
        ("dtype", pa.string()),
        ("msg_bytes", pa.int64()),
        ("elems_in", pa.int64()),
        ("elems_out", pa.int64()),
        ("group_size", pa.int32()),
        ("group_key", pa.string()),
        ("peer", pa.int32()),
        ("op_count", pa.int64()),
        ("comm_ptr", pa.string()),
        ("raw_name", pa.string()),
    ]
)


def events_table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_struct_array(pa.array(rows, type=pa.struct(EVENT_FIELDS)))


def _plain_events(t: pa.Table) -> pa.Table:
    """All `EVENT_FIELDS` columns with their plain types (dictionaries decoded, missing ones NULL)."""
    cols = [t[f.name].cast(f.type) if f.name in t.column_names else pa.nulls(t.num_rows, f.type) for f in EVENT_FIELDS]
    return pa.Table.from_arrays(cols, schema=EVENT_FIELDS)


def relabel(res: ParseResult, procs: Processes, multi: set[tuple[Any, ...]], arange: Callable[[int], pa.Array]) -> None:
    """Give each device of a multi-GPU process its own process label and sequence."""
    labels: dict[tuple[str, str], str] = {}
    bases: set[str] = set()
    for k in multi:
        p = procs.procs[k]
        bases.add(p.base)
        for comm, dev in p.comm_devs.items():
            labels[(p.base, comm)] = p.label(dev, True)
    if res.event_tables:
        res.event_tables = [_relabel_table(res, labels, arange)]
        return
    seqs: dict[str, int] = {}
    for ev in res.events:
        if ev["process"] in bases:
            label = labels[(ev["process"], ev["comm_ptr"])]
            ev["process"] = label
            s = seqs.get(label, 0)
            ev["seq"] = s
            seqs[label] = s + 1


def _relabel_table(res: ParseResult, labels: dict[tuple[str, str], str], arange: Callable[[int], pa.Array]) -> pa.Table:
    """`_relabel` on the event tables, after the rows of the per-line path joined them: the new
    sequence of a label follows the old sequence of its process, the order in which its rows were made."""
    tables = [_plain_events(t) for t in res.event_tables]
    if res.events:
        tables.append(events_table(res.events))
        res.events = []
    t = pa.concat_tables(tables).combine_chunks()
    process = t["process"].combine_chunks()
    seq = t["seq"].combine_chunks()
    keys = pc.binary_join_element_wise(process, t["comm_ptr"].combine_chunks(), "\x00")
    found = pc.index_in(keys, value_set=pa.array([f"{b}\x00{c}" for b, c in labels], pa.string()))
    label = pc.take(pa.array(list(labels.values()), pa.string()), found)
    moved = pc.is_valid(label)
    rows = pc.indices_nonzero(moved)
    if not len(rows):
        return t
    enc = pc.dictionary_encode(pc.take(label, rows))
    by = pa.table({"label": enc.indices, "seq": pc.take(seq, rows)})
    order = pc.sort_indices(by, sort_keys=[("label", "ascending"), ("seq", "ascending")])
    sorted_label = pc.take(enc.indices, order)
    counts = counts_of(enc.indices)
    starts, first = [], 0
    for k in range(len(enc.dictionary)):
        starts.append(-first)
        first += counts.get(k, 0)
    ranked = pc.add(arange(len(rows)), pc.take(pa.array(starts, pa.int64()), sorted_label))
    new_seq = pc.take(ranked, pc.sort_indices(order))
    t = t.set_column(t.schema.get_field_index("process"), "process", pc.coalesce(label, process))
    return t.set_column(t.schema.get_field_index("seq"), "seq", pc.replace_with_mask(seq, moved, new_seq))
