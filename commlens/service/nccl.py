"""A run's NCCL rows as tables: communicators, topology (rings, trees, connections), tuning."""

from __future__ import annotations

from typing import Any

import duckdb

from commlens.backend.iterations import run_id_of

# name -> (store table, columns shown, order); fixed SQL fragments chosen by a validated name.
NCCL_TABLES: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "comms": (
        "nccl_comms",
        (
            "group_key",
            "host",
            "pid",
            "cuda_dev",
            "comm_ptr",
            "comm_rank",
            "nranks",
            "global_rank",
            "comm_id",
            "parent_ptr",
            "color",
            "split_key",
            "bus_id",
            "nvml_dev",
            "api",
            "nccl_version",
        ),
        ("group_key", "host", "pid", "comm_rank"),
    ),
    "topology": (
        "nccl_topology",
        (
            "group_key",
            "host",
            "pid",
            "comm_ptr",
            "kind",
            "channel",
            "ranks",
            "src_rank",
            "dst_rank",
            "transport",
            "detail",
        ),
        ("group_key", "host", "pid", "kind", "channel", "src_rank"),
    ),
    "tuning": (
        "nccl_tuning",
        ("host", "pid", "op", "bytes", "algo", "proto", "time_us", "channels"),
        ("host", "pid", "op", "bytes"),
    ),
}


def nccl_rows(
    con: duckdb.DuckDBPyConnection, run: str, table: str, limit: int, offset: int, group_key: str | None = None
) -> tuple[list[str], list[list[Any]], int]:
    """(columns, a page of rows with the file each came from, how many match) of one of NCCL_TABLES."""
    run_id = run_id_of(con, run)
    name, cols, order = NCCL_TABLES[table]
    where = "WHERE t.run_id = ?"
    params: list[Any] = [run_id]
    if group_key is not None and table != "tuning":
        where += " AND t.group_key = ?"
        params.append(group_key)
    total = int(con.execute(f"SELECT count(*) FROM {name} t {where}", params).fetchall()[0][0])
    select = ", ".join(f"t.{c}" for c in cols)
    order_by = ", ".join(f"t.{c}" for c in order)
    result = con.execute(
        f"SELECT {select}, s.path AS file FROM {name} t JOIN sources s ON s.source_id = t.source_id "
        f"{where} ORDER BY {order_by} NULLS LAST LIMIT ? OFFSET ?",
        [*params, limit, offset],
    )
    columns = [d[0] for d in result.description]
    return columns, [list(r) for r in result.fetchall()], total
