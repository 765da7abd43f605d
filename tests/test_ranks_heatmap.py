"""The Ranks page's heatmap of a run without iterations (NCCL logs whose communicators repeat no pattern): its
default, per iteration, drew axes and no cell; it shows the whole trace instead and says why."""

from __future__ import annotations

from commlens.contract.analysis import RankSchemeTotal, RankTotals
from commlens.frontend.page_ranks import heatmap


def _totals(per_iteration: bool) -> RankTotals:
    rows = [
        RankSchemeTotal(
            rank=f"host:{pid}",
            scheme="dp",
            calls=10,
            bytes=1000 * (i + 1),
            time_us=None,
            iterations=2 if per_iteration else None,
            bytes_per_iteration=500.0 * (i + 1) if per_iteration else None,
            time_us_per_iteration=None,
        )
        for i, pid in enumerate((615, 619, 22754))
    ]
    return RankTotals(run="logs", rows=rows, imbalance=[], ranks=3, n_processes=3)


def _parts(view: object) -> tuple[list[list[float | None]], str, str]:
    graph = next(c for c in view._traverse() if type(c).__name__ == "Graph")  # type: ignore[attr-defined]
    fig = graph.figure.to_plotly_json()
    texts = [getattr(c, "children", None) for c in view._traverse()]  # type: ignore[attr-defined]
    notes = " ".join(t for t in texts if isinstance(t, str))
    return fig["data"][0]["z"], fig["layout"]["title"]["text"], notes


def test_no_iterations_shows_the_whole_trace_and_says_why() -> None:
    z, title, notes = _parts(heatmap(_totals(False), "bytes", "per_iteration", [], {}))
    assert z == [[1000], [2000], [3000]] and "whole trace" in title
    assert "No rank has per-iteration values (the run has no iterations" in notes


def test_with_iterations_the_chosen_basis_stays() -> None:
    z, title, notes = _parts(heatmap(_totals(True), "bytes", "per_iteration", [], {}))
    assert z == [[500.0], [1000.0], [1500.0]] and "whole trace" not in title
    assert "No rank has per-iteration values" not in notes
