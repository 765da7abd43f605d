"""Kineto metadata spellings per generation: read as data, newest spelling first, on real traces of each."""

from __future__ import annotations

from pathlib import Path

import pytest

from commlens.ingest.inputs import DEFAULT_LIMITS, open_content
from commlens.ingest.kineto import parse_kineto
from commlens.ingest.kineto_fields import GENERATIONS, SPELLINGS, meta, spelling
from commlens.ingest.records import RankHint


def test_each_field_reads_under_its_newest_spelling_present() -> None:
    assert SPELLINGS["elems_in"] == ("In msg nelems", "In msg size")
    assert meta({"In msg size": 8, "In msg nelems": 4}, "elems_in") == 4
    assert meta({"In msg size": 8}, "elems_in") == 8
    assert meta({"In msg nelems": None, "In msg size": 8}, "elems_in") is None  # present wins, even if null
    assert spelling({"Process Group ID": 3}, "group_id") == "Process Group ID" and meta({}, "group_name") is None
    fields = [f for g in GENERATIONS for f in g.spellings]
    assert len(fields) == len(set(fields)) + 2  # only the two size fields were renamed


@pytest.mark.parametrize(
    ("path", "size_field", "group_field"),
    [
        (
            "kineto-hta/ns_resolution_trace/rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz",
            "In msg nelems",
            "Process Group ID",
        ),
        ("kineto-hta/nccl_parser_config/nccl_data.json.gz", "In msg nelems", "Process Group Name"),
        ("kineto-hta/trace_diff/control/control.json.gz", None, None),
    ],
)
def test_the_generation_of_real_traces(
    data_dir: Path, path: str, size_field: str | None, group_field: str | None
) -> None:
    with open(data_dir / path, "rb") as f:
        result = parse_kineto(open_content(f, path), path, RankHint(), DEFAULT_LIMITS)
    gen = result.meta["generation"]
    assert (gen["size_field"], gen["group_field"]) == (size_field, group_field)
