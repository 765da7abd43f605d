"""Cell text of the dashboard's tables: exact values readable, identifiers as written."""

from __future__ import annotations

import json

from commlens.contract.compare import Comparison, SchemeResult
from commlens.frontend.components import td_id, td_num
from commlens.frontend.fmt import exact_bytes
from commlens.frontend.page_overview import volumes_chart


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


def _measured_only() -> Comparison:
    scheme = SchemeResult(
        scheme="dp",
        predicted_bytes_per_iter=0.0,
        measured_bytes_per_iter=4096.0,
        unexplained_bytes_per_iter=0.0,
        ratio=None,
        predicted_wire_bytes_per_iter=0.0,
        measured_wire_bytes_per_iter=8192.0,
        prediction_source="none",
        ops=[],
    )
    return Comparison(
        run="r",
        config_source="none",
        implementation=None,
        iterations_mode="profiler",
        iterations_message="2 profiler steps",
        ranks=["0"],
        exact=False,
        schemes=[scheme],
        unexplained=[],
        missing=[],
        inferences=[],
        notes=[],
    )


def test_the_volumes_table_names_its_ratio_and_points_to_the_what_if_only_off_its_page() -> None:
    overview = json.dumps(volumes_chart(_measured_only()).to_plotly_json(), default=str)
    predicted = json.dumps(volumes_chart(_measured_only(), "pv", on_predicted=True).to_plotly_json(), default=str)
    assert "explained / predicted" in overview and "measured / predicted" not in overview
    assert "use the what-if on Predicted" in overview and "use the what-if on Predicted" not in predicted
    assert "Bytes sent: receives are not added" in overview
