"""The Time page beyond 64 ranks and Compare of two identical runs, in a real browser over real data: the DLRM job
rewritten to 72 ranks (tests/test_ui_review_scale.py's `write_wide`, as bench/scale.py does for 1,024) and the
DLRM job ingested twice under two names. The breakdown draws a bar per band of ranks equal to the API's rows
averaged, the Ranks dropdown drills down to one band's bars, timeline and waits, the URL keeps the band; the
overlaid histograms of identical runs draw both runs, nested, and say they are identical."""

from __future__ import annotations

import importlib.util
from statistics import fmean
from typing import Any

import httpx
import pytest
import test_ui
from test_ui import CHROMIUM, WAIT_MS, Tab, _cli, _data_dir, _missing, expect
from test_ui_review_scale import DLRM, write_wide

pytestmark = pytest.mark.slow
# test_ui's server, API client, browser and tab fixtures, over this module's own store
server, api, browser, tab = test_ui.server, test_ui.api, test_ui.browser, test_ui.tab

WIDE = "wide72"
RANKS = 72  # above the page's 64: bands of 32 ranks (0-31, 32-63, 64-71)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, Any]:
    if importlib.util.find_spec("playwright") is None:
        _missing("playwright is not installed")
    if not CHROMIUM.exists():
        _missing(f"no Chromium at {CHROMIUM}")
    data = _data_dir(request.config)
    tmp = tmp_path_factory.mktemp("ui-scale-time")
    db = tmp / "scale-time.duckdb"
    write_wide(tmp / "wide", data, RANKS)
    _cli("ingest", str(tmp / "wide"), "--db", str(db), "--run", WIDE, "--jobs", "1")
    for run in ("dlrm", "dlrm-again"):
        _cli("ingest", str(data / DLRM), "--db", str(db), "--run", run, "--jobs", "1")
    return {"db": db, "tmp": tmp, "data": data}


def _drawn(tab: Tab, dom_id: str, condition: str, expr: str) -> Any:
    """`expr` of the drawn plot `g` once `condition` holds (a graph redrawn in place keeps its old data until the
    callback's answer lands, so the condition names the state the test waits for)."""
    tab.page.wait_for_function(
        f"(id) => {{ const e = document.getElementById(id); const g = e && e.querySelector('.js-plotly-plot');"
        f" return !!(g && g.data && g.data.length && ({condition})); }}",
        arg=dom_id,
        timeout=WAIT_MS,
    )
    return tab.page.evaluate(
        f"(id) => {{ const g = document.getElementById(id).querySelector('.js-plotly-plot'); return {expr}; }}",
        dom_id,
    )


BARS = "g.data.map(t => ({name: t.name, type: t.type, x: Array.from(t.x).map(v => Array.isArray(v) ? Array.from(v) "
BARS += ": v), y: Array.from(t.y), width: t.width === undefined ? null : t.width}))"


def test_the_breakdown_shows_one_bands_ranks_then_every_band(tab: Tab, api: httpx.Client) -> None:
    rows = api.get(f"/runs/{WIDE}/time/breakdown", params={"limit": 1000}).json()["rows"]
    assert len({r["rank"] for r in rows}) == RANKS
    tab.open(f"/runs/{WIDE}/time?band=32")  # a link to a band: the URL holds it
    tab.no_error_boxes()
    band = _drawn(tab, "tm-bars", "Array.isArray(g.data[0].x[0])", BARS)
    steps = sorted({r["step"] for r in rows})
    assert band[0]["x"][0] == [f"rank {r}" for r in range(32, 64) for _ in steps]
    ticks = _drawn(
        tab, "tm-timeline-graph", "g.layout.title.text.endsWith('ranks 32-63')", "Array.from(g.layout.yaxis.tickvals)"
    )
    assert ticks == list(range(32, 64))
    waits = _drawn(tab, "tm-heatmap", "g.data[0].y.length === 32", "Array.from(g.data[0].y)")
    assert waits == list(range(32, 64))
    expect(tab.page.locator("#tm-band")).to_contain_text("ranks 32-63")
    tab.shot("scale-time-band")

    tab.page.locator("#tm-band").click()
    tab.page.get_by_role("option", name="all ranks (bands)", exact=True).click()
    tab.wait_for_query(step=str(steps[-1]))  # the band left the URL
    traces = _drawn(tab, "tm-bars", "g.data[0].x.length === 3", BARS)
    compute = next(t for t in traces if t["name"] == "compute")
    assert compute["x"] == ["ranks 0-31", "ranks 32-63", "ranks 64-71"]
    for i, (lo, hi) in enumerate([(0, 31), (32, 63), (64, 71)]):
        mine = [r["compute_us"] for r in rows if lo <= r["rank"] <= hi]
        assert compute["y"][i] == pytest.approx(fmean(mine) / 1e3, rel=1e-9)
    slowest = next(t for t in traces if t["name"] == "slowest step in the band")
    assert slowest["y"][0] == pytest.approx(max(r["step_us"] for r in rows if r["rank"] <= 31) / 1e3, rel=1e-9)
    assert _drawn(tab, "tm-heatmap", "g.data[0].y.length === 72", "g.data[0].y.length") == RANKS
    tab.shot("scale-time-bands")
    tab.no_error_boxes()


def test_identical_runs_overlaid_both_show(tab: Tab, api: httpx.Client) -> None:
    a, b = (api.get(f"/runs/{r}/histograms").json() for r in ("dlrm", "dlrm-again"))
    assert [s["values"] for s in a["series"]] == [s["values"] for s in b["series"]]
    tab.open("/compare?runs=dlrm,dlrm-again")
    traces = _drawn(tab, "cmp-hist", "g.data.length === 8", BARS)
    widths = {t["name"].split(" · ")[0]: t["width"] for t in traces}
    assert widths == {"dlrm": 0.8, "dlrm-again": 0.4}  # nested: one run inside the other, both in sight
    expect(tab.page.locator("#cmp-hist-same")).to_have_text(
        "dlrm and dlrm-again: identical distributions, every bar equal; overlaid, each run's bars are drawn "
        "narrower than the one before, so all show."
    )
    tab.shot("scale-compare-identical")
    tab.no_error_boxes()
