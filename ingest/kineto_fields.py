"""Spellings of the collective metadata that PyTorch's profiler writes on `record_param_comms` and on NCCL
kernels, per generation of the trace format (docs/formats.md B.4), kept as data rather than branches.

Each generation lists only the fields it added or renamed; a field is read under its newest spelling
present in an event's args, so a trace of any generation reads through the same lookups. Adding a
generation (a rename in a new PyTorch) is one entry here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Field = Literal[
    "collective",
    "dtype",
    "elems_in",
    "elems_out",
    "group_size",
    "rank_start",
    "rank_stride",
    "group_id",
    "group_ranks",
    "group_name",
    "group_desc",
    "rank",
    "src_rank",
    "dst_rank",
    "in_splits",
]


@dataclass(frozen=True)
class Generation:
    since: str  # the Kineto change that brought these spellings
    spellings: Mapping[Field, str]


# Oldest first. Traces before the first entry carry no metadata (sizes come from Input Dims).
GENERATIONS: tuple[Generation, ...] = (
    Generation(
        "kineto #821, Oct 2023: metadata on record_param_comms and kernels",
        {
            "collective": "Collective name",
            "dtype": "dtype",
            "elems_in": "In msg size",
            "elems_out": "Out msg size",
            "group_size": "Group size",
            "rank_start": "Global rank start",
            "rank_stride": "Global rank stride",
        },
    ),
    Generation(
        "kineto #849, Dec 2023: sizes renamed to element counts",
        {
            "elems_in": "In msg nelems",
            "elems_out": "Out msg nelems",
        },
    ),
    Generation(
        "kineto #880, Mar 2024: process group id and ranks",
        {
            "group_id": "Process Group ID",
            "group_ranks": "Process Group Ranks",
        },
    ),
    Generation(
        "kineto #906, Apr 2024: process group name and description",
        {
            "group_name": "Process Group Name",
            "group_desc": "Process Group Description",
        },
    ),
    Generation(
        "kineto #963, Jul 2024: ranks of the caller and of the peer",
        {
            "rank": "Rank",
            "src_rank": "Src Rank",
            "dst_rank": "Dst Rank",
        },
    ),
    Generation(
        "all_to_allv split lists (rows per peer, '[]' for an even split), seen from the Apr 2024 traces on",
        {
            "in_splits": "In split size",
        },
    ),
)


def _spellings() -> dict[Field, tuple[str, ...]]:
    out: dict[Field, tuple[str, ...]] = {}
    for gen in reversed(GENERATIONS):  # newest spelling first
        for f, key in gen.spellings.items():
            out[f] = (*out.get(f, ()), key)
    return out


SPELLINGS: Mapping[Field, tuple[str, ...]] = _spellings()


def spelling(args: Mapping[str, Any], field: Field) -> str | None:
    """The key under which `args` holds `field` (its newest spelling present), or None."""
    return next((key for key in SPELLINGS[field] if key in args), None)


def meta(args: Mapping[str, Any], field: Field) -> Any:
    """The value of `field` in `args` under its newest spelling present, else None."""
    key = spelling(args, field)
    return args[key] if key is not None else None


def has(args: Mapping[str, Any], field: Field) -> bool:
    return spelling(args, field) is not None
