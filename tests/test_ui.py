"""The dashboard in a real browser (Playwright + Debian's Chromium) against a real `commlens serve`
(subprocess, ephemeral port) over a store with real ingested runs: a tiny harness run, a Kineto trace
and NCCL logs. Numbers on the pages are read from the DOM and from the Plotly figures and compared
with the API's. Screenshots of every page go to test-artifacts/ui/."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import httpx
import pytest
from harness_runs import HarnessRuns, named

from commlens.harness import launch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts" / "ui"
CHROMIUM = Path(os.environ.get("COMMLENS_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]
VIEWPORT = {"width": 1366, "height": 768}
WAIT_MS = 30_000  # how long a read waits for the state it asserts (a loaded machine renders slowly)
HARNESS_RUN = "ddp"  # the harness run's name in the store
LOG_FILES = ["nccl-logs/nvidia-nccl-671.log", "nccl-logs/nvidia-nccl-429.log"]
KINETO = "kineto-hta/nccl_parser_config/nccl_data.json.gz"
UPLOAD_LOG = "nccl-logs/nvidia-nccl-1238.log"


def _missing(what: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what}; CI needs it (apt-get install -y chromium; pip install -e '.[test]')")
    pytest.skip(what)


def _data_dir(config: pytest.Config) -> Path:
    """conftest's shared_data() (skip when absent, fail under CI) for module-scoped fixtures."""
    for plugin in config.pluginmanager.get_plugins():
        if str(getattr(plugin, "__file__", "")).endswith("conftest.py") and callable(
            getattr(plugin, "shared_data", None)
        ):
            return plugin.shared_data()
    raise RuntimeError("tests/conftest.py with shared_data() not loaded")


def expect(target: Any) -> Any:
    """Playwright's expect (imported late: without Playwright the tests skip) with WAIT_MS to settle."""
    from playwright.sync_api import expect as playwright_expect

    playwright_expect.set_options(timeout=WAIT_MS)
    return playwright_expect(target)


def _cli(*args: str, timeout: float = 300) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "commlens.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, f"commlens {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def store(
    harness_runs: HarnessRuns, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> dict[str, Any]:
    """Three real runs, attributed, and two users with tokens."""
    if importlib.util.find_spec("playwright") is None:
        _missing("playwright is not installed")
    if not CHROMIUM.exists():
        _missing(f"no Chromium at {CHROMIUM}")
    data = _data_dir(request.config)
    tmp = tmp_path_factory.mktemp("ui")
    db = tmp / "ui.duckdb"
    _cli("ingest", str(data / KINETO), "--db", str(db), "--run", "hta")
    # two excerpts of different jobs, kept in one run on purpose (the topology page reads both)
    _cli("ingest", *[str(data / f) for f in LOG_FILES], "--db", str(db), "--run", "nccl", "--one-run")
    # the session's `--dp 2` gloo run (tests/harness_runs.py, shared with the delay, time and findings tests),
    # ingested as `commlens harness --ingest` does
    assert not launch.ingest_run(db, named(harness_runs.straggler("dp"), HARNESS_RUN)).failed
    from commlens import store as store_mod
    from commlens.service.users import add_user

    con = store_mod.connect(db)  # `commlens ingest` and the harness run's ingest attributed the runs' schemes
    try:
        tokens = {name: add_user(con, name) for name in ("alice", "bob")}
    finally:
        con.close()
    return {"db": db, "tmp": tmp, "data": data, "tokens": tokens}


@pytest.fixture(scope="module")
def server(store: dict[str, Any]) -> Iterator[str]:
    log = open(store["tmp"] / "serve.log", "w+")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "commlens.cli", "serve", "--db", str(store["db"]), "--port", "0"],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    url = ""
    try:
        deadline = time.monotonic() + 60
        while not url:
            assert proc.poll() is None, "commlens serve exited: " + (store["tmp"] / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "commlens serve did not start in 60 s"
            m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", (store["tmp"] / "serve.log").read_text())
            url = m.group(1) if m else ""
            time.sleep(0.1)
        assert httpx.get(url + "/api/health").json()["status"] == "ok"
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def api(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server + "/api", timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def browser(server: str) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield b
        b.close()


class Tab:
    """A browser page on the server with every console error and page error recorded."""

    def __init__(self, browser: Any, base: str):
        self.context = browser.new_context(viewport=VIEWPORT)
        self.page = self.context.new_page()
        self.base = base
        self.errors: list[str] = []
        self.page.on(
            "console", lambda m: self.errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None
        )
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.on("dialog", lambda d: (self.errors.append(f"dialog opened: {d.message}"), d.dismiss()))

    def open(self, path: str) -> Any:
        self.page.goto(self.base + path)
        self.idle()
        return self.page

    def idle(self, timeout: float = 60_000) -> None:
        """Dash is done: no callback in flight, no component marked loading."""
        self.page.wait_for_load_state("networkidle")
        self.page.wait_for_function(
            "() => window.dash_clientside !== undefined && document.querySelector('#page') !== null "
            "&& document.querySelector('#page').children.length > 0 "
            "&& document.querySelectorAll('[data-dash-is-loading=\"true\"]').length === 0",
            timeout=timeout,
        )
        self.page.wait_for_load_state("networkidle")

    def wait_for_query(self, timeout: float = 30_000, **want: str) -> None:
        """The URL's query holds these values (none at all when called without any): the URL is written by
        a server callback that no loading marker covers, so `idle` alone can return before it lands."""
        self.page.wait_for_function(
            "(want) => { const q = new URLSearchParams(location.search);"
            " const keys = Object.keys(want);"
            " return keys.length ? keys.every((k) => q.get(k) === want[k]) : location.search === ''; }",
            arg=want,
            timeout=timeout,
        )

    def shot(self, name: str) -> None:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)

    def set_token(self, token: str, user: str) -> None:
        """Use `token` and wait until the page acts as `user`."""
        self.page.fill("#token-input", token)
        self.page.click("#token-save")
        self.wait_for_user(user)

    def wait_for_user(self, user: str) -> None:
        """The page says it acts as `user`: the whoami element shows the loopback user until the server
        callback answers for the token, so its presence alone proves nothing (a timeout fails the test)."""
        self.page.wait_for_function(
            "(user) => { const e = document.querySelector('#whoami-name'); return e && e.innerText === user; }",
            arg=user,
            timeout=30_000,
        )
        self.idle()

    def figure_data(self, graph_dom_id: str, first_y: list[Any] | None = None) -> list[dict[str, Any]]:
        """The traces Plotly drew in the graph (waits for the lazily loaded plotly.js to draw and, given
        `first_y`, for the first trace to show those values: a graph redrawn in place keeps its old data
        until the callback's answer lands)."""
        self.page.wait_for_function(
            "([id, want]) => { const e = document.getElementById(id); const g = e && e.querySelector('.js-plotly-plot');"
            " if (!(g && g.data && g.data.length > 0)) return false;"
            " return want === null || JSON.stringify(Array.from(g.data[0].y || [])) === JSON.stringify(want); }",
            arg=[graph_dom_id, first_y],
            timeout=WAIT_MS,
        )
        return self.page.evaluate(
            "(id) => { const g = document.getElementById(id).querySelector('.js-plotly-plot');"
            " return g.data.map(t => ({name: t.name, x: Array.from(t.x || []), y: Array.from(t.y || []),"
            " z: t.z ? t.z.map(r => Array.from(r)) : null})); }",
            graph_dom_id,
        )

    def cells(self, table_id: str, rows: int) -> list[list[str]]:
        """data-value of numeric cells, text of the others, per row of a table, once it has `rows` rows."""
        expect(self.page.locator(f"#{table_id} tbody tr")).to_have_count(rows)
        return self.page.evaluate(
            "(id) => Array.from(document.querySelectorAll('#' + id + ' tbody tr')).map(tr =>"
            " Array.from(tr.children).map(td => td.hasAttribute('data-value') ? td.getAttribute('data-value')"
            " : td.innerText.trim()))",
            table_id,
        )

    def no_error_boxes(self) -> None:
        boxes = self.page.locator(".msg-error").all_inner_texts()
        assert not boxes, f"error messages on {self.page.url}: {boxes}"

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def tab(browser: Any, server: str) -> Iterator[Tab]:
    t = Tab(browser, server)
    yield t
    errors = list(t.errors)
    t.close()
    assert not errors, f"browser errors: {errors}"


def pattern_id(**parts: str) -> str:
    """The DOM id Dash gives a pattern-matching component id (JSON, keys sorted, no spaces)."""
    return json.dumps(dict(sorted(parts.items())), separators=(",", ":"))


def _num(value: str) -> float | None:
    return None if value in ("", "None") else float(value)


# --------------------------------------------------------------------------------------- tests


PAGES = {
    "runs": "/",
    "overview": f"/runs/{HARNESS_RUN}",
    "histograms": f"/runs/{HARNESS_RUN}/histograms",
    "predicted": f"/runs/{HARNESS_RUN}/predicted",
    "ranks": "/runs/hta/ranks",
    "topology": "/runs/nccl/topology",
    "review": f"/runs/{HARNESS_RUN}/review",
    "compare": f"/compare?runs={HARNESS_RUN},hta",
    "missing-run": "/runs/no-such-run/histograms",
    "not-found": "/no/such/page",
}


def test_every_page_loads_without_errors(tab: Tab) -> None:
    for name, path in PAGES.items():
        page = tab.open(path)
        if name == "missing-run":
            expect(page.locator("#page")).to_contain_text("Not found")  # the API's 404 in words, not a blank page
            expect(page.locator("#page")).to_contain_text("no-such-run")
        elif name == "not-found":
            expect(page.locator("#page")).to_contain_text("There is no page at")
        else:
            expect(page.locator("#page h1").first).to_be_visible()
            tab.no_error_boxes()
        tab.shot(name)
        assert "Traceback" not in page.inner_text("#page")
    assert tab.page.locator(".js-plotly-plot").count() == 0  # the not-found page draws nothing


def test_runs_and_overview_show_the_api_numbers(tab: Tab, api: httpx.Client) -> None:
    runs = api.get("/runs").json()["items"]
    page = tab.open("/")
    rows = tab.cells("runs", len(runs))
    assert [r[0] for r in rows] == [r["name"] for r in runs]
    assert [int(r[5]) for r in rows] == [r["events"] for r in runs]  # calls column
    assert [int(r[2]) for r in rows] == [r["world_size"] for r in runs]
    page.click(f"text={HARNESS_RUN}")
    page.wait_for_url(f"**/runs/{HARNESS_RUN}")
    tab.idle()
    assert urlsplit(page.url).path == f"/runs/{HARNESS_RUN}"
    comparison = api.get(f"/runs/{HARNESS_RUN}/comparison").json()
    data = {t["name"]: t for t in tab.figure_data("ov-volumes")}  # a page of its own: drawn once, from the API
    assert data["predicted"]["y"] == [s["predicted_bytes_per_iter"] for s in comparison["schemes"]]
    assert data["measured"]["y"] == [s["measured_bytes_per_iter"] for s in comparison["schemes"]]
    assert data["measured"]["x"] == [s["scheme"] for s in comparison["schemes"]] == ["dp"]
    groups = api.get(f"/runs/{HARNESS_RUN}/groups").json()["items"]
    shown = tab.cells("ov-groups", len(groups))
    assert [(r[0], r[4], r[5], int(r[8])) for r in shown] == [
        (g["group_key"], g["scheme"], g["source"], g["calls"]) for g in groups
    ]
    sources = api.get(f"/runs/{HARNESS_RUN}/sources").json()["items"]
    assert [(r[0], r[2], int(r[4])) for r in tab.cells("ov-sources", len(sources))] == [
        (s["path"], s["status"], s["n_events"]) for s in sources
    ]


def test_histogram_bars_equal_the_api_and_a_click_lists_the_calls(tab: Tab, api: httpx.Client) -> None:
    page = tab.open(f"/runs/{HARNESS_RUN}/histograms?weight=bytes")
    h = api.get(f"/runs/{HARNESS_RUN}/histograms", params={"weight": "bytes"}).json()
    series = [s for s in h["series"] if s["scheme"] == "dp"]
    assert series, h
    traces = tab.figure_data(pattern_id(type="hg-graph", scheme="dp"))
    assert [t["y"] for t in traces] == [s["values"] for s in series]
    assert all(t["x"] == [b["label"] for b in h["bins"]] for t in traces)
    # the CSV alternative holds the same numbers
    csv_link = page.locator(f"[id='{pattern_id(type='hg-graph', scheme='dp')}'] ~ a.csv")
    expect(csv_link).to_have_attribute("href", re.compile(r"^data:text/csv"))
    href = csv_link.get_attribute("href")
    rows = list(csv.DictReader(io.StringIO(unquote(href.split(",", 1)[1]))))
    assert [(r["op"], r["size bin"], float(r["bytes per rank per iteration"])) for r in rows] == [
        (s["op"], b["label"], s["bytes"][i])
        for s in series
        for i, b in enumerate(h["bins"])
        if s["calls"][i] or s["bytes"][i]
    ]
    # the click: the tallest bar of the first series
    first = series[0]
    k = max(range(len(first["values"])), key=lambda i: first["values"][i])
    graph = page.locator(f"[id='{pattern_id(type='hg-graph', scheme='dp')}'] .js-plotly-plot")
    page.evaluate(
        "([el, k]) => { const g = el; const pt = {curveNumber: 0, pointNumber: k, pointIndex: k,"
        " customdata: g.data[0].customdata[k], x: g.data[0].x[k], y: g.data[0].y[k]};"
        " g.emit('plotly_click', {points: [pt], event: {}}); }",
        [graph.element_handle(), k],
    )
    bin_ = h["bins"][k]
    listed = api.get(
        f"/runs/{HARNESS_RUN}/calls",
        params={"bin": bin_["key"], "scheme": "dp", "op": first["op"], "dtype": first["dtype"], "limit": 1000},
    ).json()
    rows = tab.cells("hg-calls-table", len(listed["items"]))
    assert [(int(r[0]), int(r[3]), int(r[6])) for r in rows] == [
        (r["rank"], r["msg_bytes"], r["iteration"]) for r in listed["items"]
    ]
    # the bar's calls: its value per rank per iteration times ranks and iterations
    iters = set(h["iterations"]["iterations"].values())
    assert len(iters) == 1 and len(rows) == round(first["calls"][k] * h["n_ranks"] * iters.pop())
    assert all(bin_["lo"] <= int(r[3]) < bin_["hi"] for r in rows)
    tab.wait_for_query(sel=f"dp:{first['op']}:{first['dtype']}:{bin_['key']}")
    assert parse_qs(urlsplit(page.url).query)["sel"] == [f"dp:{first['op']}:{first['dtype']}:{bin_['key']}"]
    tab.shot("histograms-selected")


def test_a_bar_of_an_nccl_log_iteration_lists_its_calls(tab: Tab, api: httpx.Client, store: dict[str, Any]) -> None:
    """NCCL logs have detected iterations, no profiler steps: step 2 of the page is the third iteration."""
    api.post("/runs", json={"name": "iters"})
    log = store["data"] / UPLOAD_LOG
    job = api.post("/runs/iters/files", files={"files": (log.name, log.read_bytes())}).json()
    deadline = time.monotonic() + 60
    while api.get(f"/jobs/{job['job_id']}").json()["state"] in ("queued", "running"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    h = api.get("/runs/iters/histograms", params={"step": 2}).json()
    [s] = h["series"]
    k = next(i for i, v in enumerate(s["calls"]) if v)
    sel = f"{s['scheme'] or '-'}:{s['op']}:{s['dtype'] or ''}:{h['bins'][k]['key']}"
    page = tab.open(f"/runs/iters/histograms?step=2&sel={sel}")
    rows = tab.cells("hg-calls-table", 1)
    assert [(r[1], int(r[3]), int(r[6]), r[10]) for r in rows] == [("all_reduce", 128 << 20, 2, log.name)]
    expect(page.locator("#hg-calls-title")).to_contain_text(h["bins"][k]["label"])


def test_predicted_page_labels_where_each_scheme_prediction_comes_from(tab: Tab, api: httpx.Client) -> None:
    """A run without configuration is measured only, in neutral colours: each scheme says where its prediction
    comes from (the API's prediction_source), no row or bar is flagged unexplained; a configured run's schemes
    say they are predicted from it. The scheme filter offers calls without a group (unattributed)."""
    labels = {
        "config": "predicted from the configuration",
        "inferred": "inferred from the measurements",
        "none": "measured only",
    }
    page = tab.open("/runs/hta/predicted")
    comparison = api.get("/runs/hta/comparison").json()
    assert comparison["config_source"] == "none"
    assert [(s["scheme"], s["prediction_source"]) for s in comparison["schemes"]] == [("dp", "inferred")]
    for s in comparison["schemes"]:
        expect(page.locator(f"#pv-source-{s['scheme']}")).to_have_text(labels[s["prediction_source"]])
        rows = tab.cells(f"pv-ops-{s['scheme']}", len(s["ops"]))
        assert [(r[0], int(r[2]), _num(r[4]), r[6]) for r in rows] == [
            (o["op"], o["msg_bytes"], o["measured_calls_per_iter"], "measured") for o in s["ops"]
        ]
    assert page.locator("#pv-content .st-failed, #pv-content tr.flag, #pv-content .msg-warn").count() == 0
    expect(page.locator("#pv-content .msg-info").first).to_contain_text("This run has no configuration")
    volumes = {t["name"]: t for t in tab.figure_data("pv-volumes")}
    assert set(volumes) == {"measured"}  # no orange "of which unexplained" bars

    page = tab.open(f"/runs/{HARNESS_RUN}/predicted?scheme=unattributed")
    expect(page.locator("#pv-scheme")).to_contain_text("unattributed")
    page = tab.open(f"/runs/{HARNESS_RUN}/predicted")
    configured = api.get(f"/runs/{HARNESS_RUN}/comparison").json()
    assert [s["prediction_source"] for s in configured["schemes"]] == ["config"]
    expect(page.locator("#pv-source-dp")).to_have_text(labels["config"])


def test_predicted_ranks_topology_compare_equal_the_api(tab: Tab, api: httpx.Client) -> None:
    tab.open(f"/runs/{HARNESS_RUN}/predicted")
    comparison = api.get(f"/runs/{HARNESS_RUN}/comparison").json()
    for s in comparison["schemes"]:
        rows = tab.cells(f"pv-ops-{s['scheme']}", len(s["ops"]))
        assert [(r[0], int(r[2]), _num(r[3]), _num(r[4]), r[6]) for r in rows] == [
            (o["op"], o["msg_bytes"], o["predicted_calls_per_iter"], o["measured_calls_per_iter"], o["status"])
            for o in s["ops"]
        ]
    # what-if at another scale: the form posts to /api/predict and shows its totals
    page = tab.page
    page.fill("#wi-dp", "8")
    page.fill("#wi-layers", "4")
    page.click("#wi-go")
    page.wait_for_selector("#wi-totals .js-plotly-plot")
    tab.idle()
    tab.wait_for_query(w_dp="8", w_layers="4")
    q = parse_qs(urlsplit(page.url).query)
    assert q["w_dp"] == ["8"] and q["w_layers"] == ["4"]
    config = api.get(f"/runs/{HARNESS_RUN}").json()["config"]
    body = {
        "model": {k: config["model"][k] for k in ("layers", "hidden", "heads", "vocab", "seq_len", "ffn_hidden")},
        "parallel": {
            "dp": 8,
            "tp": 1,
            "pp": 1,
            "cp": 1,
            "zero": 0,
            "sp": False,
            "micro_batches": config["parallel"]["micro_batches"],
            "micro_batch_size": config["parallel"]["micro_batch_size"],
        },
        "implementation": config["implementation"],
        "dtypes": {"grad": "float32", "param": "float32", "act": "float32"},
    }
    body["model"]["layers"] = 4
    predicted = api.post("/predict", json=body).json()
    totals = {t["name"]: t for t in tab.figure_data("wi-totals")}
    assert totals["sum of S (sent)"]["y"] == [t["s_sum"] for t in predicted["totals"]]
    tab.shot("predicted-whatif")

    tab.open("/runs/hta/ranks")
    ranks = api.get("/runs/hta/ranks").json()
    heat = tab.figure_data("rk-heatmap")[0]
    cell = {(r["rank"], r["scheme"] or "unattributed"): r["bytes_per_iteration"] for r in ranks["rows"]}
    shown = {
        (y, x): v
        for y, row in zip(heat["y"], heat["z"], strict=True)
        for x, v in zip(heat["x"], row, strict=True)
        if v is not None
    }
    assert shown == {k: v for k, v in cell.items() if v is not None} and shown
    bw = api.get("/runs/hta/bandwidth").json()
    traces = {t["name"]: t for t in tab.figure_data("rk-busbw")}
    for op in {b["op"] for b in bw["bins"]}:
        assert traces[op]["y"] == [b["median_busbw_gbps"] for b in bw["bins"] if b["op"] == op]

    tab.open("/runs/nccl/topology")
    rings = api.get("/runs/nccl/topology/topology", params={"limit": 500}).json()
    cols = rings["columns"]
    ring_rows = [dict(zip(cols, r, strict=True)) for r in rings["rows"] if r[cols.index("kind")] == "ring"]
    shown = tab.cells("tp-rings", len(ring_rows))
    assert [r[2] for r in shown] == [" → ".join(map(str, r["ranks"])) for r in ring_rows]
    comms = api.get("/runs/nccl/topology/comms", params={"limit": 500}).json()
    assert comms["rows"] and len(tab.cells("tp-comms", len(comms["rows"]))) == len(comms["rows"])

    tab.open(f"/compare?runs={HARNESS_RUN},hta")
    both = api.get("/compare", params={"runs": f"{HARNESS_RUN},hta"}).json()["runs"]
    traces = {t["name"]: t for t in tab.figure_data("cmp-volumes")}
    for r in both:
        assert traces[f"{r['run']} measured"]["y"] == [s["measured_bytes_per_iter"] for s in r["comparison"]["schemes"]]


def test_upload_through_the_page(tab: Tab, api: httpx.Client, store: dict[str, Any]) -> None:
    broken = store["tmp"] / "broken.json"
    broken.write_text('{"schemaVersion": 1, "traceEvents": [{"ph": "X", "name": "ncclKernel_AllReduce", ')
    page = tab.open("/")
    page.fill("#up-run", "uploaded")
    page.set_input_files("#up-files input[type=file]", [str(store["data"] / UPLOAD_LOG), str(broken)])
    page.wait_for_selector("#up-job-view[data-state=done], #up-job-view[data-state=failed]", timeout=90_000)
    tab.idle()
    results = {r[0]: r for r in tab.cells("up-results", 2)}
    assert results[Path(UPLOAD_LOG).name][2] == "ok"
    assert results["broken.json"][2] == "failed" and results["broken.json"][7]  # the file's error, in words
    job = api.get("/jobs", params={"run": "uploaded"}).json()["items"][0]
    assert {r["upload"]: r["status"] for r in job["results"]} == {Path(UPLOAD_LOG).name: "ok", "broken.json": "failed"}
    page.wait_for_selector("#runs a.run-link:text-is('uploaded')")
    tab.shot("runs-uploaded")
    # a file of no known format is refused whole, and the page says so
    junk = store["tmp"] / "picture.png"
    junk.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    page.set_input_files("#up-files input[type=file]", [str(junk)])
    page.wait_for_selector("#up-msg .msg-error")
    expect(page.locator("#up-msg")).to_contain_text("picture.png")


def test_review_comment_persists_and_a_second_user_sees_it(
    browser: Any, server: str, store: dict[str, Any], api: httpx.Client
) -> None:
    alice, bob = Tab(browser, server), Tab(browser, server)
    try:
        view = f"/runs/{HARNESS_RUN}/histograms?scheme=dp&weight=bytes"
        page = alice.open(view)
        alice.set_token(store["tokens"]["alice"], "alice")
        expect(page.locator("#whoami-name")).to_have_text("alice")
        page.click("#comment-box summary")
        body = "DP buckets look **right** <img src=x onerror=alert(1)><script>alert(2)</script>"
        page.fill("#comment-body", body)
        page.click("#comment-add")
        page.wait_for_selector("#comment-result .msg-ok")
        expect(page.locator("#comment-result")).to_contain_text("added by alice")
        page.reload()
        alice.wait_for_user("alice")  # the token survives the reload (local storage)
        page = alice.open(f"/runs/{HARNESS_RUN}/review")
        item = page.locator(".review-item").first
        expect(item).to_contain_text("alice")
        expect(item.locator("strong", has_text="right")).to_have_count(1)  # Markdown rendered
        expect(item).to_contain_text("<img src=x onerror=alert(1)>")
        assert item.locator("img, script").count() == 0  # raw HTML shown as text, never injected
        link = item.locator("a", has_text="view:")
        expect(link).to_have_attribute("href", f"/runs/{HARNESS_RUN}/histograms?scheme=dp&weight=bytes")
        alice.shot("review")

        page_b = bob.open(f"/runs/{HARNESS_RUN}/review")
        bob.set_token(store["tokens"]["bob"], "bob")
        item_b = page_b.locator(".review-item").first
        expect(item_b).to_contain_text("alice")
        expect(item_b).to_contain_text("right")
        item_b.locator("textarea").fill("Agreed, resolving.")
        item_b.locator("button", has_text="Reply").click()
        page_b.wait_for_selector("#rv-msg .msg-ok")
        bob.idle()
        page_b.locator(".review-item").first.locator("button", has_text="Resolve").click()
        page_b.wait_for_selector(".review-item[data-status=resolved]")
        items = api.get(f"/runs/{HARNESS_RUN}/review").json()["items"]
        top = items[0]
        assert (top["author"], top["status"]) == ("alice", "resolved")
        assert [(r["author"], r["body"]) for r in top["replies"]] == [("bob", "Agreed, resolving.")]
        assert top["anchor"]["view"] == "histograms" and top["anchor"]["scheme"] == "dp"
        # alice sees bob's reply after a reload
        page = alice.open(f"/runs/{HARNESS_RUN}/review")
        expect(page.locator(".review-item").first).to_contain_text("Agreed, resolving.")
        assert not alice.errors and not bob.errors, alice.errors + bob.errors
    finally:
        alice.close()
        bob.close()


def test_a_copied_url_reproduces_the_view(tab: Tab, browser: Any, server: str, api: httpx.Client) -> None:
    page = tab.open(f"/runs/{HARNESS_RUN}/histograms")
    page.click("#hg-weight label:has-text('bytes')")
    tab.idle()
    tab.wait_for_query(weight="bytes")  # its own history entry before the next change (Back is tested below)
    page.locator("#hg-scheme").click()
    page.get_by_role("option", name="dp", exact=True).click()
    tab.idle()
    tab.wait_for_query(scheme="dp", weight="bytes")
    q = parse_qs(urlsplit(page.url).query)
    assert q == {"scheme": ["dp"], "weight": ["bytes"]}, page.url
    graph = pattern_id(type="hg-graph", scheme="dp")
    h = api.get(f"/runs/{HARNESS_RUN}/histograms", params={"weight": "bytes", "scheme": "dp"}).json()
    [dp] = [s for s in h["series"] if s["scheme"] == "dp"]
    before = tab.figure_data(graph, first_y=dp["values"])  # redrawn in place: wait for the bytes
    copied = page.url
    other = Tab(browser, server)
    try:
        other.page.goto(copied)
        other.idle()
        assert other.figure_data(graph, first_y=before[0]["y"]) == before
        expect(other.page.locator("#hg-weight input[value=bytes]")).to_be_checked()
        expect(other.page.locator("#hg-scheme")).to_contain_text("dp")
        other.shot("histograms-from-link")
        assert not other.errors, other.errors
    finally:
        other.close()
    # back in the first tab, Back returns to the unfiltered view
    page.go_back()
    tab.idle()
    page.go_back()
    tab.idle()
    tab.wait_for_query()
    assert urlsplit(page.url).query == ""
    expect(page.locator("#hg-weight input[value=bytes]")).not_to_be_checked()


def test_an_unreachable_api_is_said_in_words(browser: Any, tmp_path: Path) -> None:
    """The dashboard alone (`commlens ui`) in front of an API that is not there: every page says so."""
    log = tmp_path / "ui.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "commlens.cli", "ui", "--api", "http://127.0.0.1:9", "--port", "0"],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    tab = Tab(browser, "")
    try:
        deadline = time.monotonic() + 60
        while not (m := re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        tab.base = m.group(1)
        for path in ("/", f"/runs/{HARNESS_RUN}", f"/runs/{HARNESS_RUN}/histograms", "/compare?runs=a,b"):
            page = tab.open(path)
            expect(page.locator("#page")).to_contain_text("The API cannot be reached")
            expect(page.locator("#whoami")).to_have_text("API unreachable")
        tab.shot("api-unreachable")
        assert not tab.errors, tab.errors
    finally:
        tab.close()
        proc.terminate()
        proc.wait(20)
