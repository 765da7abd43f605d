"""The Histograms page's figure on its log axis: bars side by side (a stacked part's height on a log axis is no
measure of its value) and every series of one op told apart by its fill."""

from __future__ import annotations

from commlens.contract.analysis import Histogram, HistogramSeries, bin_spec
from commlens.frontend.components import PATTERNS
from commlens.frontend.page_histograms import panel


def _series(op: str, dtype: str, values: list[float]) -> HistogramSeries:
    return HistogramSeries(
        scheme="dp",
        op=op,
        dtype=dtype,
        calls=values,
        bytes=[v * 1024 for v in values],
        values=values,
        total_calls=sum(values),
        total_bytes=sum(values) * 1024,
    )


def _figure(series: list[HistogramSeries]) -> dict:
    h = Histogram(
        run="r",
        weight="calls",
        normalization="per_rank_per_iteration",
        filters={},
        n_ranks=8,
        bins=[bin_spec("2^17"), bin_spec("2^18")],
        series=series,
    )
    graph = next(c for c in panel(h, "dp", series)._traverse() if type(c).__name__ == "Graph")
    return graph.figure.to_plotly_json()


def test_equal_halves_of_a_bin_are_bars_of_equal_height() -> None:
    """control.json's 128-256 KiB bin: all_to_all float32 and int32, 0.8333 calls each, stacked on the log axis
    the first filled the bar and the second was a thin cap."""
    fig = _figure([_series("all_to_all", "float32", [0.8333, 0.0]), _series("all_to_all", "int32", [0.8333, 0.0])])
    assert fig["layout"]["barmode"] == "group"
    assert [t["y"][0] for t in fig["data"]] == [0.8333, 0.8333]
    low, high = fig["layout"]["yaxis"]["range"]
    assert low < -0.079 < high  # log10(0.8333): the bars reach inside the axis, whatever their count


def test_each_dtype_of_one_op_has_its_own_fill() -> None:
    """DLRM's all_to_all int32 and int64 were both the op's colour with the same '/' fill."""
    dtypes = ["float32", "int32", "int64", "bfloat16", "float16"]
    fig = _figure([_series("all_to_all", d, [1.0, 2.0]) for d in dtypes] + [_series("all_reduce", "float32", [1.0, 1])])
    styles = [(t["marker"]["color"], t["marker"]["pattern"]["shape"]) for t in fig["data"]]
    assert len(set(styles)) == len(styles)
    assert [s for _, s in styles[:5]] == PATTERNS[:5] and styles[5][1] == ""
