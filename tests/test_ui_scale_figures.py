"""The time page's figures at 1,024 ranks and the Compare histograms of identical runs, built with planted ground
truth (no server): what the browser would draw is in the figure object.

- breakdown: one bar per (rank, step) at 8 ranks; at 1,024 ranks a bar per band of 32 ranks (the band's mean step,
  computed by the service in the store from planted rows), its slowest and fastest step marked, and a band drilled
  down to its 32 ranks;
- timeline: a tick per rank at 8 ranks; at 1,024 ranks Plotly's spaced ticks, or the band's ranks only;
- critical path and a selected instance: said in one short line at 1,024 ranks;
- Compare: two identical runs overlaid are nested bars of two widths, and a note says they are identical."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import duckdb
import plotly.graph_objects as go
import pyarrow as pa
import pytest
from dash import dcc

from commlens import store
from commlens.contract.analysis import BinSpec, Histogram, HistogramSeries
from commlens.contract.time import (
    BreakdownBands,
    CriticalPath,
    Instance,
    InstanceMember,
    PathSegment,
    StepBreakdown,
    TimeStatus,
)
from commlens.frontend import page_compare, page_time
from commlens.service import time as service

RANKS = 1024
STEPS = (3, 4)
LONG_STEPS = range(3, 603)  # 4 ranks x 600 steps: more bars than page_time.MAX_BARS
SLOW = 700  # planted: the slowest rank, 10 ms more idle in step 4
STATUS = TimeStatus(available=True, parts=[])


def _row(rank: int, step: int) -> StepBreakdown:
    compute = 1000.0 + rank  # µs; rank r computes 1 ms + r µs
    idle = 10_000.0 if (rank, step) == (SLOW, 4) else 0.0
    return StepBreakdown(
        rank=rank,
        step=step,
        step_us=compute + 500.0 + idle,
        compute_us=compute,
        overlapped_us=0.0,
        wait_us=500.0,
        exposed_us=0.0,
        memcpy_us=0.0,
        idle_us=idle,
        schemes=[],
        memcpy=[],
    )


def _rows(ranks: int, steps: Sequence[int] = STEPS) -> list[StepBreakdown]:
    return [_row(r, s) for r in range(ranks) for s in steps]


class _Client:
    """The two breakdown calls of the dashboard's client, answered by the service on a store."""

    def __init__(self, con: duckdb.DuckDBPyConnection) -> None:
        self.con = con

    def time_breakdown_bands(self, run: str, *, scheme: str | None = None, band: int | None = None) -> Any:
        return service.breakdown_bands(self.con, run, scheme=scheme, band=band)

    def time_breakdown(self, run: str, **query: Any) -> Any:
        return service.breakdown(self.con, run, **query)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Client]:
    """A store whose runs 'r' (1,024 ranks) and 'r8' hold the planted breakdown rows and, for 'r', a dp split."""
    con = store.connect(Path(tmp_path_factory.mktemp("bands")) / "store.duckdb")
    for run, ranks, steps in (("r", RANKS, STEPS), ("r8", 8, STEPS), ("long", 4, LONG_STEPS)):
        run_id = store.ensure_run(con, run)
        rows = [
            (run_id, x.rank, x.step, None, x.step_us, x.compute_us, 0.0, x.wait_us, 0.0, 0.0, x.idle_us)
            for x in _rows(ranks, steps)
        ]
        # rank r's dp waits r % 2 * 100 µs of its 500 µs
        rows += [
            (run_id, x.rank, x.step, "dp", None, None, 0.0, x.rank % 2 * 100.0, 0.0, None, None)
            for x in _rows(ranks, steps)
        ]
        planted = pa.table(list(zip(*rows, strict=True)), names=[f"c{i}" for i in range(11)])  # noqa: F841 (read by SQL)
        con.execute("INSERT INTO time_breakdown SELECT * FROM planted")  # one insert: executemany takes seconds
    yield _Client(con)
    con.close()


def _breakdown(client: _Client, run: str, band: str | None = None, scheme: str | None = None) -> Any:
    return page_time.breakdown_figure(client, run, scheme, STATUS, band)  # type: ignore[arg-type]


def _graph(block: Any) -> go.Figure:
    """The figure of the first dcc.Graph inside a component tree."""
    todo = [block]
    while todo:
        c = todo.pop(0)
        if isinstance(c, dcc.Graph):
            return c.figure
        children = getattr(c, "children", None)
        todo += children if isinstance(children, list) else [children] if children is not None else []
    raise AssertionError("no graph")


def _text(block: Any) -> str:
    """Every string of a component tree, in order."""
    if isinstance(block, str):
        return block
    children = getattr(block, "children", None)
    if isinstance(children, list):
        return " ".join(_text(c) for c in children)
    return "" if children is None else _text(children)


def test_eight_ranks_draw_a_bar_per_rank_and_step(client: _Client) -> None:
    fig = _graph(_breakdown(client, "r8"))
    compute = fig.data[0]
    assert list(compute.x[0]) == [f"rank {r}" for r in range(8) for _ in STEPS]
    assert list(compute.y) == [(1000.0 + r) / 1e3 for r in range(8) for _ in STEPS]


def test_1024_ranks_draw_a_bar_per_band_with_its_slowest_step(client: _Client) -> None:
    block = _breakdown(client, "r")
    fig = _graph(block)
    bars = [t for t in fig.data if t.type == "bar"]
    labels = [f"ranks {i}-{i + 31}" for i in range(0, RANKS, 32)]
    assert all(list(t.x) == labels for t in bars)  # 32 categories, not 1,024 (or 2,048 rank-steps)
    compute = next(t for t in bars if t.name == "compute")
    # the mean over the band's ranks and both steps: 1 ms + the mean rank's µs
    assert list(compute.y) == pytest.approx([(1000.0 + i + 15.5) / 1e3 for i in range(0, RANKS, 32)], rel=1e-12)
    idle = next(t for t in bars if t.name == "idle")
    assert idle.y[SLOW // 32] == pytest.approx(10_000.0 / 64 / 1e3) and sum(idle.y) == idle.y[SLOW // 32]
    slowest = next(t for t in fig.data if t.name == "slowest step in the band")
    assert list(slowest.customdata[SLOW // 32][:2]) == [SLOW, 4]
    assert slowest.y[SLOW // 32] == (1000.0 + SLOW + 500.0 + 10_000.0) / 1e3
    assert [list(c[:2]) for c in slowest.customdata[:2]] == [
        [31, 3],
        [63, 3],
    ]  # the band's highest rank computes longest
    assert "Slowest steps: rank 700 step 4" in _text(block)


def test_a_band_drills_down_to_its_ranks(client: _Client) -> None:
    block = _breakdown(client, "r", band="672")
    compute = _graph(block).data[0]
    assert list(compute.x[0]) == [f"rank {r}" for r in range(672, 704) for _ in STEPS]
    assert "ranks 672-703 of 1,024" in _text(block)
    # a band the run lacks falls back to the bands
    assert len(_graph(_breakdown(client, "r", band="5")).data[0].x) == 32


def test_a_scheme_splits_each_band_into_its_communication_and_the_rest(client: _Client) -> None:
    fig = _graph(_breakdown(client, "r", scheme="dp"))
    wait = next(t for t in fig.data if t.name == "dp: wait in collectives")
    other = next(t for t in fig.data if t.name == "other schemes' comm")
    # half of each band's ranks wait 100 µs in dp: 50 µs a mean rank-step; the rest of the 500 µs is other comm
    assert list(wait.y) == pytest.approx([50.0 / 1e3] * 32) and list(other.y) == pytest.approx([450.0 / 1e3] * 32)


def test_bands_follow_the_rank_count_and_a_band_bounds_the_rows(client: _Client) -> None:
    assert service.band_width(63) == 32 and service.band_width(1023) == 32 and service.band_width(2047) == 64
    bands = service.breakdown_bands(client.con, "r")
    assert (bands.ranks, bands.rank_steps, bands.band, bands.steps) == (RANKS, RANKS * len(STEPS), 32, list(STEPS))
    assert [(b.first, b.last, b.ranks, b.rank_steps) for b in bands.bands[:2]] == [
        (0, 31, 32, 64),
        (32, 63, 32, 64),
    ]
    assert [(r.rank, r.step) for r in bands.slowest] == [(SLOW, 4), (1023, 3), (1023, 4), (1022, 3), (1022, 4)]
    page = service.breakdown(client.con, "r", first=672, last=703, limit=1000)
    assert page.total == 64 and {r.rank for r in page.rows} == set(range(672, 704))


def _instance(ranks: int) -> Instance:
    members = [
        InstanceMember(rank=r, seq=0, arrival_us=100.0 + r, end_us=2000.0, wait_us=float(ranks - 1 - r))
        for r in range(ranks)
    ]
    return Instance(
        instance_id=0,
        group="world",
        scheme="dp",
        key=0,
        keyed_by="key",
        op="all_reduce",
        dtype="float32",
        msg_bytes=1 << 20,
        step=3,
        skew_us=float(ranks - 1),
        last_rank=ranks - 1,
        first_arrival_us=100.0,
        last_arrival_us=100.0 + ranks - 1,
        real_us=2000.0 - (100.0 + ranks - 1),
        algbw_gbps=None,
        busbw_gbps=None,
        members=members,
        member_count=ranks,
    )


def _path(ranks: int) -> CriticalPath:
    # from the step's end back: 9 segments on the last rank, then 2 on rank 4 (said from the step's start)
    segs = [PathSegment(rank=ranks - 1, start_us=0.0, end_us=10.0, kind="work", instance_id=None)] * 9
    segs += [PathSegment(rank=4, start_us=0.0, end_us=10.0, kind="work", instance_id=None)] * 2
    return CriticalPath(step=3, start_us=0.0, end_us=3000.0, segments=segs, categories={}, exposed_share_by_scheme={})


def test_eight_ranks_timeline_has_a_tick_per_rank() -> None:
    fig = _graph(page_time.timeline_view("r", 3, [_instance(8)], 1, None, None, STATUS))
    assert list(fig.layout.yaxis.tickvals) == list(range(8))


def test_1024_ranks_timeline_spaces_its_ticks_and_a_band_draws_its_ranks() -> None:
    inst = _instance(RANKS)
    fig = _graph(page_time.timeline_view("r", 3, [inst], 1, _path(RANKS), 0, STATUS))
    # a label per rank overlapped into a black smear left of the axis; Plotly spaces them now
    assert fig.layout.yaxis.tickvals is None and fig.layout.yaxis.tickmode == "auto"
    band = _graph(page_time.timeline_view("r", 3, [inst], 1, _path(RANKS), 0, STATUS, shown=(672, 703)))
    drawn = {y for t in band.data if t.type == "bar" for y in t.y}
    assert drawn == set(range(672, 704)) and list(band.layout.yaxis.tickvals) == list(range(672, 704))
    assert band.layout.title.text == "Step 3: collectives per rank, ranks 672-703"


def test_the_path_and_a_selected_instance_stay_one_line_at_1024_ranks() -> None:
    assert page_time.path_ranks(_path(RANKS)) == "4 (2 segments) → 1023 (9 segments)"
    assert page_time.path_ranks(_path(8)) == "4 (2 segments) → 7 (9 segments)"
    said = page_time._member_waits(_instance(RANKS))
    assert said.startswith("1,024 members, the longest waits: 0 waits 1.02 ms, 1 waits 1.02 ms")
    assert said.count(" waits ") == 8
    assert page_time._member_waits(_instance(2)) == "members 0 waits 1 µs, 1 waits 0 µs"


def _hist(run: str) -> Histogram:
    bins = [BinSpec(key="2^10", label="1 KiB-2 KiB", k=10), BinSpec(key="2^20", label="1 MiB-2 MiB", k=20)]
    series = HistogramSeries(
        scheme="dp",
        op="all_reduce",
        dtype="float32",
        calls=[2.0, 1.0],
        bytes=[2048.0, float(1 << 20)],
        values=[2.0, 1.0],
        total_calls=3.0,
        total_bytes=2048.0 + (1 << 20),
    )
    return Histogram(
        run=run,
        weight="calls",
        normalization="per_rank_per_iteration",
        filters={},
        n_ranks=8,
        bins=bins,
        series=[series],
    )


def test_identical_runs_overlaid_are_nested_and_said_identical() -> None:
    block = page_compare.overlaid([_hist("a"), _hist("b")], "overlay")
    fig = _graph(block)
    a, b = fig.data
    assert list(a.y) == list(b.y) == [2.0, 1.0] and fig.layout.barmode == "overlay"
    # drawn over each other at one width, the second hid the first; nested, both show
    assert (a.width, b.width) == (0.8, 0.4)
    assert a.marker.color != b.marker.color
    assert "a and b: identical distributions, every bar equal" in _text(block)


def test_different_runs_carry_no_identical_note_and_side_by_side_keeps_plotly_widths() -> None:
    other = _hist("b")
    other.series[0].values = [2.0, 3.0]
    assert "identical" not in _text(page_compare.overlaid([_hist("a"), other], "overlay"))
    fig = _graph(page_compare.overlaid([_hist("a"), _hist("b")], "group"))
    assert fig.layout.barmode == "group" and [t.width for t in fig.data] == [None, None]


def test_a_run_without_breakdown_has_no_band_and_says_so() -> None:
    """An NCCL log has no profiler steps: the page's layout took the first rank of an empty band (a 500)."""
    assert "No breakdown for this run" in _text(page_time.breakdown_view("r", [], None, STATUS))
    empty = page_time.bands_breakdown_view(
        "r",
        BreakdownBands(run="r", scheme=None, ranks=0, rank_steps=0, steps=[], band=32, bands=[], slowest=[]),
        None,
        STATUS,
    )
    assert "No breakdown for this run" in _text(empty)


def test_bands_are_kept_per_version_of_the_run(client: _Client) -> None:
    """The aggregate reads every (rank, step) row: a repeated request is answered from backend/run_cache.py until
    a write changes the run's version."""
    first = service.breakdown_bands(client.con, "r8")
    assert service.breakdown_bands(client.con, "r8") is first
    assert service.breakdown_bands(client.con, "r8", scheme="dp") is not first  # another result of the same run
    client.con.execute("UPDATE runs SET description = 'changed' WHERE name = 'r8'")
    again = service.breakdown_bands(client.con, "r8")
    assert again is not first and again == first


def test_a_long_profile_draws_a_bar_per_rank_then_one_ranks_steps(client: _Client) -> None:
    block = _breakdown(client, "long")
    compute = next(t for t in _graph(block).data if t.name == "compute")
    assert list(compute.x) == ["rank 0", "rank 1", "rank 2", "rank 3"]  # 4 bars, not 2,400
    assert list(compute.y) == pytest.approx([(1000.0 + r) / 1e3 for r in range(4)])
    assert "2,400 (rank, step) rows of 4 ranks" in _text(block)
    one = _breakdown(client, "long", band="2")
    assert list(_graph(one).data[0].x[0]) == ["rank 2"] * 600 and "rank 2 of 4" in _text(one)
