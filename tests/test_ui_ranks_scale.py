"""The ranks page at 1,024 ranks: a synthetic run written through the store's writer with planted ground truth
(every rank all-reduces 2 x 16 MiB per step in dp, rank 700 a third time; ranks 0-999 send 2 MiB per step in
pp, ranks 1000-1023 none), summarised by the API (spread, outliers, bands of 32) and drilled down in a real
browser: bands first, then one band's 32 ranks, then one rank. Matrices wider than 128 ranks are binned."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import httpx
import pytest
import test_ui
from dash import dcc
from synthetic import write_rows
from test_ui import CHROMIUM, WAIT_MS, Tab, _data_dir, _missing, expect

from commlens import store as store_mod
from commlens.backend.attribution import set_override
from commlens.backend.ranks import rank_summary, rank_totals
from commlens.contract.pairs import PairMatrix
from commlens.frontend.page_ranks import MAX_CELLS, pairs_heatmap
from commlens.store.transaction import transaction

# test_ui's server, API client, browser and tab fixtures, over this module's own store
server, api, browser, tab = test_ui.server, test_ui.api, test_ui.browser, test_ui.tab

RUN = "scale"
RANKS = 1024
STEPS = 4
MiB = 1 << 20
HOT = 700  # the planted outlier: one dp all-reduce more per step


def build(con: Any) -> None:
    groups = [
        {"group_key": key, "ranks": list(range(RANKS)), "size": RANKS, "origin": "pg_config", "backend": "cuda:nccl"}
        for key in ("pg:dp", "pg:pp")
    ]

    def write(c: Any) -> None:
        for rank in range(RANKS):  # one trace per rank, as a profiler writes them
            events, steps, seq = [], [], 0
            for step in range(STEPS):
                steps.append({"rank": rank, "step": step})
                for _ in range(3 if rank == HOT else 2):
                    events.append(_ev(rank, seq, "all_reduce", 16 * MiB, "pg:dp", RANKS, step))
                    seq += 1
                if rank < 1000:
                    events.append(_ev(rank, seq, "send", 2 * MiB, "pg:pp", RANKS, step))
                    seq += 1
            write_rows(c, RUN, events, groups=groups if rank == 0 else (), steps=steps, rank=rank)

    # one transaction for the 1,024 files: a commit apiece was most of this fixture's time
    transaction(con, write)
    set_override(con, RUN, "pg:dp", "dp", "test: planted")
    set_override(con, RUN, "pg:pp", "pp", "test: planted")


def _ev(rank: int, seq: int, op: str, size: int, group: str, n: int, step: int) -> dict[str, Any]:
    return {
        "rank": rank,
        "process": f"r{rank}",
        "seq": seq,
        "op": op,
        "dtype": "float32",
        "msg_bytes": size,
        "group_size": n,
        "group_key": group,
        "dur_us": None,
        "dur_source": None,
        "step": step,
    }


@pytest.fixture(scope="module")
def scale_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 1,024-rank store, built once for the module."""
    db = tmp_path_factory.mktemp("ui-scale") / "scale.duckdb"
    con = store_mod.connect(db)
    try:
        build(con)
    finally:
        con.close()
    return db


def test_summary_names_the_planted_outlier_and_bands(scale_db: Path) -> None:
    con = store_mod.connect(scale_db)
    try:
        _check_summary(con)
    finally:
        con.close()


def _check_summary(con: Any) -> None:
    s = rank_summary(con, RUN)
    assert (s.ranks, s.band, [sp.scheme for sp in s.schemes]) == (RANKS, 32, ["dp", "pp"])
    dp, pp = s.schemes
    assert (dp.ranks, dp.median, dp.max, dp.max_rank) == (RANKS, 32 * MiB, 48 * MiB, str(HOT))
    assert [(o.rank, o.value) for o in dp.outliers] == [(str(HOT), 48 * MiB)] and dp.outliers_total == 1
    assert (pp.ranks, pp.min, pp.max, pp.outliers_total) == (1000, 2 * MiB, 2 * MiB, 0)
    assert [g.label for g in s.groups] == [f"ranks {i}-{i + 31}" for i in range(0, RANKS, 32)]
    hot = s.groups[HOT // 32]
    dp_cell = hot.cells[0]
    assert (hot.first, hot.last, hot.members) == (672, 703, 32)
    assert (dp_cell.max, dp_cell.max_rank, dp_cell.mean) == (48 * MiB, str(HOT), (31 * 32 + 48) * MiB / 32)
    assert [c.ranks for c in s.groups[-1].cells] == [32, 8]  # ranks 992-999 only in pp
    band = rank_totals(con, RUN, first=672, last=703)
    assert band.ranks == RANKS and {r.rank for r in band.rows} == {str(r) for r in range(672, 704)}
    assert len(band.rows) == 64 and band.imbalance[0].max_rank == str(HOT)  # imbalance over every rank


def test_a_1024_rank_matrix_is_binned_to_the_screen() -> None:
    n = RANKS
    matrix = [[(s * n + r) % 7 for r in range(n)] for s in range(n)]
    block = pairs_heatmap(
        PairMatrix(
            group_key="pg:ep",
            scheme="ep",
            ranks=list(range(n)),
            bytes=matrix,
            calls=n,
            total_bytes=sum(map(sum, matrix)),
        ),
        "the whole run",
        RUN,
        0,
    )
    graph = next(c for c in block.children if isinstance(c, dcc.Graph))
    heat = graph.figure.data[0]
    assert len(heat.z) == MAX_CELLS and all(len(row) == MAX_CELLS for row in heat.z)
    assert heat.x[0] == "0-7" and heat.y[-1] == "1016-1023"
    assert heat.z[1][2] == sum(matrix[s][r] for s in range(8, 16) for r in range(16, 24))
    assert sum(map(sum, heat.z)) == sum(map(sum, matrix))


# ------------------------------------------------------------------------------------ the page


@pytest.fixture(scope="module")
def store(scale_db: Path, request: pytest.FixtureRequest) -> dict[str, Any]:
    if importlib.util.find_spec("playwright") is None:
        _missing("playwright is not installed")
    if not CHROMIUM.exists():
        _missing(f"no Chromium at {CHROMIUM}")
    return {"db": scale_db, "tmp": scale_db.parent, "data": _data_dir(request.config)}


def _heatmap(tab: Tab, dom_id: str, rows: int) -> dict[str, Any]:
    """The drawn heatmap of `dom_id` once it has `rows` rows, with its colour bar's settings."""
    tab.page.wait_for_function(
        "([id, n]) => { const e = document.getElementById(id); const g = e && e.querySelector('.js-plotly-plot');"
        " return !!(g && g.data && g.data.length && g.data[0].z && g.data[0].z.length === n); }",
        arg=[dom_id, rows],
        timeout=WAIT_MS,
    )
    return tab.page.evaluate(
        "(id) => { const t = document.getElementById(id).querySelector('.js-plotly-plot').data[0];"
        " return {x: Array.from(t.x), y: Array.from(t.y), z: t.z, ticks: t.colorbar.ticks,"
        " ticktext: Array.from(t.colorbar.ticktext || []),"
        " yrange: document.getElementById(id).querySelector('.js-plotly-plot')._fullLayout.yaxis.range}; }",
        dom_id,
    )


@pytest.mark.slow
def test_the_page_summarises_then_drills_down_to_a_band_and_a_rank(tab: Tab, api: httpx.Client) -> None:
    summary = api.get(f"/runs/{RUN}/ranks/summary").json()
    assert summary["ranks"] == RANKS and len(summary["groups"]) == 32
    tab.open(f"/runs/{RUN}/ranks")
    tab.no_error_boxes()
    bands = _heatmap(tab, "rk-bands", 32)
    assert bands["y"][0] == "ranks 0-31" and bands["x"] == ["dp", "pp"] and bands["ticks"] == "outside"
    assert bands["z"][HOT // 32][0] == (31 * 32 + 48) * MiB / 32 and bands["z"][-1][1] == 2 * MiB
    assert all(t.endswith("B") for t in bands["ticktext"])
    expect(tab.page.locator("#rk-outliers tbody tr")).to_have_count(1)
    expect(tab.page.locator("#rk-outliers tbody tr")).to_contain_text(str(HOT))
    assert tab.page.locator("#rk-heatmap").count() == 0  # no per-rank drawing before a band is chosen
    tab.shot("ranks-scale-summary")

    tab.page.locator("#rk-band").click()
    tab.page.get_by_role("option", name="ranks 672-703", exact=True).click()
    tab.wait_for_query(band="672")
    band = _heatmap(tab, "rk-heatmap", 32)
    assert band["y"] == [str(r) for r in range(672, 704)] and band["x"] == ["dp", "pp"]
    assert band["z"][HOT - 672] == [48 * MiB, 2 * MiB]
    assert sorted(band["yrange"]) == [-0.5, 31.5]  # the marker on rank 700 is placed by position, not read as 700

    tab.page.locator("#rk-rank").click()
    tab.page.get_by_role("option", name=str(HOT), exact=True).click()
    tab.wait_for_query(band="672", rank=str(HOT))
    tab.idle()
    detail = tab.cells("rk-rank-detail", 2)
    assert [(r[0], int(r[1]), float(r[5])) for r in detail] == [
        ("dp", 3 * STEPS, 48.0 * MiB),
        ("pp", STEPS, 2.0 * MiB),
    ]
    # the URL reproduces the drill-down
    tab.page.reload()
    tab.idle()
    again = _heatmap(tab, "rk-heatmap", 32)
    assert again["y"][0] == "672" and sorted(again["yrange"]) == [-0.5, 31.5]  # with the chosen rank's line
    expect(tab.page.locator("#rk-rank-detail tbody tr")).to_have_count(2)
    tab.shot("ranks-scale-band")


@pytest.mark.slow
def test_a_link_to_one_rank_opens_its_band(tab: Tab) -> None:
    tab.open(f"/runs/{RUN}/ranks?rank=5")
    band = _heatmap(tab, "rk-heatmap", 32)
    assert band["y"][0] == "0" and band["y"][-1] == "31"
    expect(tab.page.locator("#rk-rank-detail")).to_contain_text("Rank 5")
    tab.no_error_boxes()
