"""The dashboard as a new user meets it, over real data: the DLRM job, the same job rewritten to 128 ranks (rank
fields and clocks per rank, as bench/scale.py does for 1,024), an NCCL log whose run name has spaces and an NCCL
log without calls. Defects found by using it in Chromium, each pinned here: the overview and the Time page drew
a component per table cell (188 s for the overview of a 1,024-rank run), and the volumes table called every byte
of a run without configuration "unexplained" against a predicted 0 B. Beyond 64 ranks the Time page's breakdown is
a bar per band of ranks equal to the API's rows averaged, and its Ranks dropdown drills down to one band's bars,
timeline and waits (the URL keeps the band); the overlaid histograms of the DLRM job ingested twice draw both runs,
nested, and say they are identical."""

from __future__ import annotations

import gzip
import importlib.util
import subprocess
import sys
import tarfile
from pathlib import Path
from statistics import fmean
from typing import Any
from urllib.parse import quote

import httpx
import orjson
import pytest
import test_ui
from dash.development.base_component import Component
from test_ui import CHROMIUM, ROOT, WAIT_MS, Tab, _cli, _data_dir, _missing, expect

from commlens.frontend import page_overview, page_time
from commlens.frontend.client import ApiClient
from commlens.frontend.config import UiConfig

# test_ui's server, API client, browser and tab fixtures, over this module's own store
server, api, browser, tab = test_ui.server, test_ui.api, test_ui.browser, test_ui.tab

DLRM = "kineto-param/dlrm_kineto.tar.gz"
WIDE = "wide"  # the DLRM job as 128 ranks
WIDE_RANKS = 128  # above components.STATIC_ABOVE: the per-rank tables take their long form
LOG_RUN = "nccl log 1193"  # spaces in a run name
SLASHED = "resnet ddp/v1"  # a slash too: `commlens ingest --run` takes it
KINETO = "kineto-hta/nccl_parser_config/nccl_data.json.gz"


def write_wide(out: Path, data: Path, ranks: int) -> None:
    """The DLRM job's 8 traces as `ranks` rank files: rank i is worker i % 8 with its rank fields rewritten and its
    clock shifted by i microseconds, so every rank is a distinct file of one job."""
    with tarfile.open(data / DLRM) as tar:
        members = sorted(
            (m for m in tar.getmembers() if m.isfile() and m.name.endswith(".pt.trace.json")),
            key=lambda m: int(Path(m.name).name.split("_")[0].removeprefix("worker")),
        )
        traces = [orjson.loads(tar.extractfile(m).read()) for m in members]  # type: ignore[union-attr]
    out.mkdir()
    for rank in range(ranks):
        base = traces[rank % len(traces)]
        trace = {**base, "distributedInfo": {**base["distributedInfo"], "rank": rank, "world_size": ranks}}
        trace["traceEvents"] = [{**e, "ts": e["ts"] + rank} if "ts" in e else e for e in base["traceEvents"]]
        (out / f"rank{rank:04d}.pt.trace.json.gz").write_bytes(gzip.compress(orjson.dumps(trace), compresslevel=1))


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, Any]:
    if importlib.util.find_spec("playwright") is None:
        _missing("playwright is not installed")
    if not CHROMIUM.exists():
        _missing(f"no Chromium at {CHROMIUM}")
    data = _data_dir(request.config)
    tmp = tmp_path_factory.mktemp("ui-review")
    db = tmp / "review.duckdb"
    write_wide(tmp / "wide", data, WIDE_RANKS)
    _cli("ingest", str(tmp / "wide"), "--db", str(db), "--run", WIDE)
    _cli("ingest", str(data / DLRM), "--db", str(db), "--run", "dlrm")
    _cli("ingest", str(data / DLRM), "--db", str(db), "--run", "dlrm-again")  # Compare of identical runs
    _cli("ingest", str(data / "nccl-logs/nvidia-nccl-1193.log"), "--db", str(db), "--run", LOG_RUN)
    slashed = subprocess.run(  # before the server owns the store; the CLI may refuse the name
        [sys.executable, "-m", "commlens.cli", "ingest", str(data / KINETO), "--db", str(db), "--run", SLASHED],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
        timeout=300,
    )
    return {"db": db, "tmp": tmp, "data": data, "slashed": slashed}


def _count(node: Any) -> int:
    """Dash components in a layout tree: what the dashboard's renderer pays for."""
    if isinstance(node, (list, tuple)):
        return sum(_count(c) for c in node)
    return 1 + _count(getattr(node, "children", None)) if isinstance(node, Component) else 0


def test_per_rank_tables_are_a_handful_of_components(server: str) -> None:
    """A component per cell made 1,293 components of the overview's file table alone at 128 ranks (17,536 of the
    Time page's layout at 1,024 ranks: minutes of a browser's time); one static table apiece now."""
    client = ApiClient(server)
    assert _count(page_overview.sources(client, WIDE)) <= 10
    assert _count(page_overview.rank_sources(client, WIDE)) <= 5
    assert _count(page_time.layout(UiConfig(api_url=server), None, WIDE, {})) <= 150


def test_the_wide_runs_overview_and_time_pages_show_every_rank(tab: Tab, api: httpx.Client) -> None:
    tab.open(f"/runs/{WIDE}")
    tab.no_error_boxes()
    rows = tab.cells("ov-rank-sources", WIDE_RANKS)
    assert [r[0] for r in rows] == [str(r) for r in range(WIDE_RANKS)]
    assert rows[127][2].endswith("rank0127.pt.trace.json.gz") and rows[127][3] == "8"
    src = tab.cells("ov-sources", WIDE_RANKS)  # the API's first page holds all 128
    assert [(r[2], r[3], r[4]) for r in src[:2]] == [("ok", "0", "8"), ("ok", "1", "8")]
    tab.shot("review-wide-overview")

    summary = api.get(f"/runs/{WIDE}/time").json()
    assert len(summary["ranks"]) == WIDE_RANKS
    tab.open(f"/runs/{WIDE}/time")
    tab.no_error_boxes()
    shown = tab.cells("tm-ranks", WIDE_RANKS)
    assert [(int(r[0]), int(r[1]), int(r[2].replace(",", ""))) for r in shown] == [
        (int(r["rank"]), r["steps"], r["instances"]) for r in summary["ranks"]
    ]
    tab.figure_data("tm-bars")  # the breakdown still draws, its long table static
    expect(tab.page.locator("#tm-clocks tbody tr")).to_have_count(WIDE_RANKS)
    tab.shot("review-wide-time")


def test_a_run_without_configuration_has_nothing_unexplained(tab: Tab, api: httpx.Client) -> None:
    """Measured only is neutral: the volumes table said predicted 0 B and every measured byte unexplained."""
    c = api.get("/runs/dlrm/comparison").json()
    assert c["config_source"] == "none"
    tab.open("/runs/dlrm")
    table = tab.page.locator("#ov-volumes ~ details table")
    expect(table.locator("tbody tr")).to_have_count(len(c["schemes"]))
    rows = [[td.inner_text().strip() for td in tr.locator("td").all()] for tr in table.locator("tbody tr").all()]
    assert [r[0] for r in rows] == [s["scheme"] for s in c["schemes"]]
    assert all((r[1], r[3], r[4]) == ("-", "-", "-") for r in rows), rows
    assert rows[0][2] == "2,549,700 B (2.43 MiB)"  # DLRM's calls per step, measured; no group gives them a scheme


def test_a_run_name_with_spaces_opens_every_page(tab: Tab) -> None:
    for page in ("", "/histograms", "/ranks", "/time", "/topology", "/review"):
        tab.open(f"/runs/{quote(LOG_RUN, safe='')}{page}")
        tab.no_error_boxes()
        expect(tab.page.locator("#page h1 .run-name")).to_have_text(LOG_RUN)
    expect(tab.page.locator("#page")).not_to_contain_text("Traceback")


def test_a_run_name_the_cli_accepts_opens_on_the_dashboard(tab: Tab, store: dict[str, Any]) -> None:
    """The CLI stored 'resnet ddp/v1', which the API (its paths decode %2F before routing) and so the dashboard
    could not reach: every page said 'no such endpoint'. Either the CLI refuses the name, naming it, or the name
    opens."""
    done = store["slashed"]
    if done.returncode != 0:
        assert SLASHED in done.stdout + done.stderr
        return
    tab.open(f"/runs/{quote(SLASHED, safe='')}")
    tab.no_error_boxes()
    expect(tab.page.locator("#page h1 .run-name")).to_have_text(SLASHED)


def test_a_flat_spread_has_a_labelled_axis(tab: Tab, api: httpx.Client) -> None:
    """Every rank of the wide run carries the same bytes: the box is a line, and its axis autoranged to a sliver
    around it with no tick inside, so no number said what the line was. The axis starts at zero now."""
    s = api.get(f"/runs/{WIDE}/ranks/summary").json()
    [sp] = s["schemes"]
    assert sp["min"] == sp["max"] == 2_549_700  # per iteration, every rank
    tab.open(f"/runs/{WIDE}/ranks")
    tab.figure_data("rk-spread")
    labels = tab.page.evaluate(
        "() => Array.from(document.querySelectorAll('#rk-spread .ytick text')).map(t => t.textContent)"
    )
    assert labels[0] == "0 B" and "2 MiB" in labels, labels
    tab.no_error_boxes()


def test_the_histogram_says_each_note_once(tab: Tab, api: httpx.Client) -> None:
    h = api.get("/runs/dlrm/histograms").json()
    assert h["unattributed_events"] == 64
    tab.open("/runs/dlrm/histograms")
    notes = tab.page.locator("#hg-content .note-list li")
    expect(notes.first).to_be_visible()
    texts = notes.all_inner_texts()
    assert sum("no process group" in t or "no group" in t for t in texts) == 1, texts


def test_measured_only_calls_have_no_predicted_count(tab: Tab, api: httpx.Client) -> None:
    """The op table of a scheme nothing predicts said 'predicted 0' and a difference of +1 per call."""
    c = api.get("/runs/dlrm/comparison").json()
    (s,) = c["schemes"]  # DLRM's calls name no group: all unattributed
    assert (s["scheme"], s["prediction_source"]) == ("unattributed", "none")
    tab.open("/runs/dlrm/predicted")
    rows = tab.cells("pv-ops-unattributed", len(s["ops"]))
    assert [(r[0], r[2], r[3], r[4], r[5], r[6]) for r in rows] == [
        (o["op"], str(o["msg_bytes"]), "", repr(o["measured_calls_per_iter"]), "", "measured") for o in s["ops"]
    ]


def test_calls_without_a_group_are_not_called_nothing(tab: Tab, api: httpx.Client) -> None:
    """The DLRM traces name no process group: the overview said 'nothing to attribute' under a chart of dp and
    other bytes; it now counts the calls and says where the chart's schemes come from."""
    g = api.get("/runs/dlrm/groups").json()
    assert (g["total"], g["unattributed_events"]) == (0, 64)
    tab.open("/runs/dlrm")
    section = tab.page.locator("section", has=tab.page.get_by_role("heading", name="Schemes and how they were"))
    expect(section).to_contain_text("none of the 64 calls has a group")
    assert "nothing to attribute" not in section.inner_text()


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
    bands = [(0, 31), (32, 63), (64, 95), (96, 127)]
    assert len({r["rank"] for r in rows}) == WIDE_RANKS
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
    traces = _drawn(tab, "tm-bars", "g.data[0].x.length === 4", BARS)
    compute = next(t for t in traces if t["name"] == "compute")
    assert compute["x"] == [f"ranks {lo}-{hi}" for lo, hi in bands]
    for i, (lo, hi) in enumerate(bands):
        mine = [r["compute_us"] for r in rows if lo <= r["rank"] <= hi]
        assert compute["y"][i] == pytest.approx(fmean(mine) / 1e3, rel=1e-9)
    slowest = next(t for t in traces if t["name"] == "slowest step in the band")
    assert slowest["y"][0] == pytest.approx(max(r["step_us"] for r in rows if r["rank"] <= 31) / 1e3, rel=1e-9)
    assert _drawn(tab, "tm-heatmap", "g.data[0].y.length === 128", "g.data[0].y.length") == WIDE_RANKS
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
