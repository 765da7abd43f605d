"""Cell text of the dashboard's tables: exact values readable, identifiers as written."""

from __future__ import annotations

from commlens.frontend.components import td_id, td_num
from commlens.frontend.fmt import exact_bytes


def test_exact_bytes_keeps_only_the_fraction_that_is_there() -> None:
    assert exact_bytes(2_059_614_664.8) == "2,059,614,664.8 B (1.92 GiB)"
    assert exact_bytes(120_320) == "120,320 B (118 KiB)"
    assert exact_bytes(1.125) == "1.125 B"
    assert exact_bytes(3.0) == "3 B"
    assert exact_bytes(None) == "-"


def test_ranks_and_steps_have_no_thousands_separators_but_sort_as_numbers() -> None:
    cell = td_id(1024)
    assert cell.children == "1024" and cell.to_plotly_json()["props"]["data-value"] == "1024"
    assert td_num(1024).children == "1,024"
    assert td_id(None).children == "-"
