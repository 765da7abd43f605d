"""The all-to-all matrix on the ranks page in a real browser (Playwright + Debian's Chromium) against a real
`commlens serve` over a store with a gloo expert-parallel harness run (test_harness_ep's sizes) and the
2023 DLRM job (all_to_all without split lists): the heatmap's cells, axes and colour bar are read from the
drawn Plotly figure and compared with the API's matrices, over the run and for a chosen step (kept in the
URL across a reload); the DLRM run shows the API's reason instead of a matrix."""

from __future__ import annotations

import importlib.util
from typing import Any

import httpx
import pytest
import test_ui
from harness_runs import HarnessRuns, named
from test_harness_ep import CONFIGS, TINY
from test_ui import CHROMIUM, WAIT_MS, Tab, _cli, _data_dir, _missing, expect

from commlens.harness import launch

pytestmark = pytest.mark.slow
# test_ui's server, API client, browser and tab fixtures, over this module's own store
server, api, browser, tab = test_ui.server, test_ui.api, test_ui.browser, test_ui.tab

EP_RUN = "ep2"
DLRM_RUN = "dlrm"
DLRM = "kineto-param/dlrm_kineto.tar.gz"


@pytest.fixture(scope="module")
def store(
    harness_runs: HarnessRuns, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> dict[str, Any]:
    """The DLRM job and test_harness_ep's "ep2" run (the session's: tests/harness_runs.py)."""
    if importlib.util.find_spec("playwright") is None:
        _missing("playwright is not installed")
    if not CHROMIUM.exists():
        _missing(f"no Chromium at {CHROMIUM}")
    data = _data_dir(request.config)
    tmp = tmp_path_factory.mktemp("ui-pairs")
    db = tmp / "pairs.duckdb"
    _cli("ingest", str(data / DLRM), "--db", str(db), "--run", DLRM_RUN)
    assert not launch.ingest_run(db, named(harness_runs(EP_RUN, dict(TINY, **CONFIGS[EP_RUN])), EP_RUN)).failed
    return {"db": db, "tmp": tmp, "data": data}


def _heatmap_when(tab: Tab, graph_dom_id: str, z: list[list[int]]) -> dict[str, Any]:
    """The drawn heatmap once it shows `z` (a graph redrawn in place keeps its old data until the answer lands)."""
    tab.page.wait_for_function(
        "([id, want]) => { const e = document.getElementById(id); const g = e && e.querySelector('.js-plotly-plot');"
        " return !!(g && g.data && g.data.length) && JSON.stringify(g.data[0].z) === JSON.stringify(want); }",
        arg=[graph_dom_id, z],
        timeout=WAIT_MS,
    )
    return tab.page.evaluate(
        "(id) => { const g = document.getElementById(id).querySelector('.js-plotly-plot'); const t = g.data[0];"
        " return {x: Array.from(t.x), y: Array.from(t.y), z: t.z, cb: t.colorbar.title.text,"
        " drawn: Array.from(g.querySelectorAll('.colorbar .cbaxis text, .colorbar .ytick text')).map(e => e.textContent),"
        " ticks: Array.from(t.colorbar.ticktext || []), vals: Array.from(t.colorbar.tickvals || []),"
        " xt: g.layout.xaxis.title.text, yt: g.layout.yaxis.title.text,"
        " title: g.layout.title.text}; }",
        graph_dom_id,
    )


def test_heatmap_shows_the_api_matrix_over_the_run_and_per_step(tab: Tab, api: httpx.Client) -> None:
    whole = api.get(f"/runs/{EP_RUN}/pairs").json()
    (m,) = whole["matrices"]
    assert whole["steps"] == [2, 3] and m["ranks"] == [0, 1] and all(v > 0 for row in m["bytes"] for v in row)
    tab.open(f"/runs/{EP_RUN}/ranks")
    tab.no_error_boxes()
    heat = _heatmap_when(tab, "rk-pairs-0", m["bytes"])
    assert (heat["x"], heat["y"]) == (["0", "1"], ["0", "1"])
    assert (heat["xt"], heat["yt"], heat["cb"]) == ("receiver (global rank)", "sender (global rank)", "bytes")
    # the colour bar starts at 0 B and labels every tick inside the range in binary units
    top = max(max(row) for row in m["bytes"])
    labels = [t for t, v in zip(heat["ticks"], heat["vals"], strict=True) if v <= top]
    assert labels[0] == "0 B" and len(labels) >= 3 and all(t.endswith("B") for t in labels)
    assert heat["drawn"] == labels
    assert heat["title"] == "All-to-all bytes sent, pg:0 (ep), the whole run"
    note = tab.page.locator("#rk-pairs .chart-note")
    expect(note).to_contain_text(f"{m['calls']} all_to_all calls")

    step3 = api.get(f"/runs/{EP_RUN}/pairs", params={"step": 3}).json()["matrices"][0]
    assert step3["bytes"] != m["bytes"]
    tab.page.locator("#rk-pairs-step").click()
    tab.page.get_by_role("option", name="step 3", exact=True).click()
    tab.wait_for_query(pairs_step="3")
    heat = _heatmap_when(tab, "rk-pairs-0", step3["bytes"])
    assert heat["title"] == "All-to-all bytes sent, pg:0 (ep), step 3"
    tab.page.reload()
    tab.idle()
    assert _heatmap_when(tab, "rk-pairs-0", step3["bytes"])["title"].endswith("step 3")
    tab.shot("ranks-pairs")


def test_a_run_without_split_lists_says_why(tab: Tab, api: httpx.Client) -> None:
    report = api.get(f"/runs/{DLRM_RUN}/pairs").json()
    assert report["matrices"] == [] and report["calls_without_splits"] > 0
    tab.open(f"/runs/{DLRM_RUN}/ranks")
    tab.no_error_boxes()
    expect(tab.page.locator("#rk-pairs")).to_contain_text(f"No all-to-all matrix: {report['reason']}.")
    assert tab.page.locator("#rk-pairs .js-plotly-plot").count() == 0
