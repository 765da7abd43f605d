"""The Time page in a real browser (Playwright + Debian's Chromium) against a real `commlens serve` over a
store with the real 8-rank DLRM job and a harness gloo run with a planted straggler (`--dp 2 --delay
1:MS`, tests/harness_runs.py): the bars, the timeline, the wait heatmap and the straggler table are read
from the Plotly figures and the DOM and compared with the API's numbers; the URL state survives a reload."""

from __future__ import annotations

import importlib.util
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
import test_ui
from harness_runs import PROFILED_STEPS, HarnessRuns, named
from test_ui import CHROMIUM, WAIT_MS, Tab, _cli, _data_dir, _missing, _num, expect

from commlens.frontend.page_time import CATEGORY_LABELS
from commlens.harness import launch

pytestmark = pytest.mark.slow
# test_ui's server, API client, browser and tab fixtures, over this module's own store
server, api, browser, tab = test_ui.server, test_ui.api, test_ui.browser, test_ui.tab

DLRM = "kineto-param/dlrm_kineto.tar.gz"
DLRM_RUN = "dlrm"
GLOO_RUN = "straggler"
FIELDS = {
    "compute": "compute_us",
    "overlapped": "overlapped_us",
    "wait": "wait_us",
    "exposed": "exposed_us",
    "memcpy": "memcpy_us",
    "idle": "idle_us",
}


@pytest.fixture(scope="module")
def store(
    harness_runs: HarnessRuns, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> dict[str, Any]:
    """The DLRM job and a 2-rank gloo run whose rank 1 sleeps DELAY_MS before each step's forward (eight profiled
    steps of one DDP bucket each; the session's run: tests/harness_runs.py)."""
    if importlib.util.find_spec("playwright") is None:
        _missing("playwright is not installed")
    if not CHROMIUM.exists():
        _missing(f"no Chromium at {CHROMIUM}")
    data = _data_dir(request.config)
    tmp = tmp_path_factory.mktemp("ui-time")
    db = tmp / "time.duckdb"
    _cli("ingest", str(data / DLRM), "--db", str(db), "--run", DLRM_RUN)
    assert not launch.ingest_run(db, named(harness_runs.straggler("dp-delay"), GLOO_RUN)).failed
    return {"db": db, "tmp": tmp, "data": data}


def _figure_attr(tab: Tab, graph_dom_id: str, expr: str) -> Any:
    """One property of the drawn figure (`g` is the plot element), after it is drawn."""
    tab.figure_data(graph_dom_id)
    return tab.page.evaluate(
        f"(id) => {{ const g = document.getElementById(id).querySelector('.js-plotly-plot'); return {expr}; }}",
        graph_dom_id,
    )


def _drawn_when(tab: Tab, graph_dom_id: str, condition: str) -> list[dict[str, Any]]:
    """The figure's traces once `condition` (JavaScript over the plot element `g`) holds: a graph redrawn
    in place shows its old data until the callback's answer lands."""
    tab.page.wait_for_function(
        "([id, cond]) => { const e = document.getElementById(id); const g = e && e.querySelector('.js-plotly-plot');"
        " return !!(g && g.data && g.layout) && new Function('g', 'return ' + cond)(g); }",
        arg=[graph_dom_id, condition],
        timeout=WAIT_MS,
    )
    return tab.figure_data(graph_dom_id)


def _select(tab: Tab, dropdown: str, option: str) -> None:
    tab.page.locator(f"#{dropdown}").click()
    tab.page.get_by_role("option", name=option, exact=True).click()
    tab.idle()


# --------------------------------------------------------------------------------------- tests


def test_bars_of_every_rank_equal_the_breakdown(tab: Tab, api: httpx.Client) -> None:
    rows = api.get(f"/runs/{DLRM_RUN}/time/breakdown", params={"limit": 1000}).json()["rows"]
    assert sorted({r["rank"] for r in rows}) == list(range(8))
    tab.open(f"/runs/{DLRM_RUN}/time")
    tab.no_error_boxes()
    traces = {t["name"]: t for t in tab.figure_data("tm-bars", first_y=[r["compute_us"] / 1e3 for r in rows])}
    assert list(traces) == [CATEGORY_LABELS[c] for c in FIELDS]
    for cat, field in FIELDS.items():
        t = traces[CATEGORY_LABELS[cat]]
        assert t["x"] == [[f"rank {r['rank']}" for r in rows], [str(r["step"]) for r in rows]]
        assert t["y"] == pytest.approx([r[field] / 1e3 for r in rows], rel=1e-12)
    # each bar is its rank's whole step: the six categories add up to the step time
    for i, r in enumerate(rows):
        assert sum(t["y"][i] for t in traces.values()) == pytest.approx(r["step_us"] / 1e3, rel=1e-9)
    assert _figure_attr(tab, "tm-bars", "g.layout.yaxis.title.text") == "time (ms)"
    tab.shot("time-dlrm")


def test_timeline_and_wait_heatmap_of_a_step(tab: Tab, api: httpx.Client) -> None:
    summary = api.get(f"/runs/{DLRM_RUN}/time").json()
    paths = api.get(f"/runs/{DLRM_RUN}/time/critical-path").json()["paths"]
    step = next(p["step"] for p in paths if p["segments"])
    items = api.get(f"/runs/{DLRM_RUN}/time/instances", params={"step": step, "limit": 1000}).json()["items"]
    assert items and summary["status"]["available"]
    page = tab.open(f"/runs/{DLRM_RUN}/time?step={step}")
    tab.no_error_boxes()
    # the heatmap: every member's wait, in ms, at (rank, instance)
    heat = tab.figure_data("tm-heatmap")[0]
    shown = {
        (y, x): v for y, row in zip(heat["y"], heat["z"], strict=True) for x, v in zip(heat["x"], row, strict=True)
    }
    expected = {
        (m["rank"], f"#{i['instance_id']} {i['op']}"): m["wait_us"] / 1e3
        for i in items
        for m in i["members"]
        if m["wait_us"] is not None
    }
    assert {k: v for k, v in shown.items() if v is not None} == pytest.approx(expected, rel=1e-12)
    assert _figure_attr(tab, "tm-heatmap", "g.data[0].colorbar.title.text") == "wait (ms)"
    # the timeline: a row per rank, a bar per member, the critical path through the segments' ranks
    traces = {t["name"]: t for t in tab.figure_data("tm-timeline-graph")}
    ops = {i["op"] for i in items}
    assert ops <= set(traces)
    assert sorted({y for op in ops for y in traces[op]["y"]}) == list(range(8))
    assert sum(len(traces[op]["y"]) for op in ops) == sum(len(i["members"]) for i in items)
    (path,) = [p for p in paths if p["step"] == step]
    segs = sorted(path["segments"], key=lambda s: s["start_us"])
    assert traces["critical path"]["y"] == [s["rank"] for s in segs for _ in (0, 1)]
    # a click on one member's bar links the instance's members across ranks
    target = next(i for i in items if i["op"] == "all_reduce")
    graph = page.locator("#tm-timeline-graph .js-plotly-plot")
    page.evaluate(
        "([g, id]) => { const c = g.data.findIndex(t => t.name === 'all_reduce');"
        " const k = g.data[c].customdata.findIndex(d => d[0] === id);"
        " g.emit('plotly_click', {points: [{curveNumber: c, pointNumber: k, customdata: g.data[c].customdata[k]}],"
        " event: {}}); }",
        [graph.element_handle(), target["instance_id"]],
    )
    tab.wait_for_query(step=str(step), inst=str(target["instance_id"]))
    drawn = _drawn_when(tab, "tm-timeline-graph", "g.data.some(t => (t.name || '').startsWith('instance '))")
    linked = next(t for t in drawn if t["name"].startswith("instance "))
    assert linked["name"] == f"instance {target['instance_id']} (all_reduce)"
    assert linked["y"] == sorted(m["rank"] for m in target["members"])
    expect(page.locator("#tm-selected")).to_contain_text(f"last rank {target['last_rank']}")
    tab.shot("time-dlrm-selected")


def test_straggler_tables_equal_the_api(tab: Tab, api: httpx.Client) -> None:
    for run in (GLOO_RUN, DLRM_RUN):
        report = api.get(f"/runs/{run}/time/stragglers").json()
        assert report["groups"], run
        page = tab.open(f"/runs/{run}/time")
        rows = tab.cells("tm-stragglers-table", len(report["groups"]))
        assert [
            (r[0], r[1], r[2], None if r[3] == "-" else int(r[3]), _num(r[4]), _num(r[5]), _num(r[6]), _num(r[7]))
            for r in rows
        ] == [
            (
                g["group"],
                g["scheme"],
                g["verdict"],
                g["candidate_rank"],
                g["arrived_last_share"],
                g["steps_consistent"],
                g["steps"],
                g["imposed_ms_per_step"],
            )
            for g in report["groups"]
        ]
        assert [r[9] for r in rows] == [g["reason"] for g in report["groups"]]
        head = expect(page.locator("#tm-stragglers .msg"))
        if run == GLOO_RUN:  # the planted straggler is named, with its group and scheme
            (st,) = [s for s in report["stragglers"] if s["scheme"] == "dp"]
            assert st["rank"] == 1
            head.to_contain_text(f"rank 1 in {st['group']} (dp)")
        else:  # one profiled step: no straggler, and the reason says why
            assert not report["stragglers"]
            head.to_contain_text("No straggler")
            head.to_contain_text("consistency needs 4")
        tab.shot(f"time-stragglers-{run}")


def test_url_state_survives_a_reload_and_the_run_selector(tab: Tab, api: httpx.Client) -> None:
    steps = sorted({r["step"] for r in api.get(f"/runs/{GLOO_RUN}/time/breakdown").json()["rows"]})
    assert len(steps) == len(PROFILED_STEPS)
    page = tab.open(f"/runs/{GLOO_RUN}/time")
    _select(tab, "tm-scheme", "dp")
    tab.wait_for_query(scheme="dp")
    _select(tab, "tm-step", str(steps[-1]))
    tab.wait_for_query(scheme="dp", step=str(steps[-1]))
    bars = _drawn_when(tab, "tm-bars", "g.data.some(t => t.name === 'dp: wait in collectives')")
    timeline = _drawn_when(tab, "tm-timeline-graph", f"g.layout.title.text.startsWith('Step {steps[-1]}:')")
    assert parse_qs(urlsplit(page.url).query) == {"scheme": ["dp"], "step": [str(steps[-1])]}
    page.reload()
    tab.idle()
    tab.wait_for_query(scheme="dp", step=str(steps[-1]))
    expect(page.locator("#tm-scheme")).to_have_text("dp")
    expect(page.locator("#tm-step")).to_have_text(str(steps[-1]))
    assert _drawn_when(tab, "tm-bars", "g.data.some(t => t.name === 'dp: wait in collectives')") == bars
    assert _drawn_when(tab, "tm-timeline-graph", f"g.layout.title.text.startsWith('Step {steps[-1]}:')") == timeline
    # another run from the selector: its Time page, the same scheme kept in the query
    _select(tab, "tm-runsel", DLRM_RUN)
    page.wait_for_url(f"**/runs/{DLRM_RUN}/time**")
    tab.idle()
    expect(page.locator(".run-name")).to_have_text(DLRM_RUN)
    assert parse_qs(urlsplit(page.url).query)["scheme"] == ["dp"]
    tab.no_error_boxes()
