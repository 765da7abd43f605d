"""Defaults that show all the data (real NCCL logs and the DLRM job): histograms keep the calls of ranks
without iterations, every histogram has a log y axis, each gap comes with its hint, empty states and the
bandwidth section give the run's real reason. The page tests run a real server and Chromium."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import duckdb
import httpx
import pytest
import test_ui
from test_ui import CHROMIUM, Tab, _cli, _data_dir, _missing, expect, pattern_id

from commlens.backend.bandwidth import bandwidth
from commlens.backend.histograms import bar_calls, histogram
from commlens.ingest.inputs import iter_inputs
from commlens.service.ingest import ingest_run

# test_ui's server, API client, browser and tab fixtures, over this module's own store
server, api, browser, tab = test_ui.server, test_ui.api, test_ui.browser, test_ui.tab

DLRM = "kineto-param/dlrm_kineto.tar.gz"
NO_COLL = "nccl-logs/nvidia-nccl-1357.log"  # init and topology lines only
UNRANKED_TRACE = "kineto-hta/distributed_info_unavailable/distributed_info_not_found.json.gz"  # no rank anywhere


def test_histogram_keeps_the_calls_of_ranks_without_iterations(con: duckdb.DuckDBPyConnection, data_dir: Path) -> None:
    """All 19 excerpts in one run: one process has detected iterations, eight do not. Per iteration would
    keep 4 of the 26 calls; the default keeps all 26, per rank, and says why."""
    ingest_run(con, "logs", iter_inputs([data_dir / "nccl-logs"]))
    h = histogram(con, "logs")
    assert h.iterations.iterations == {"ip-172-31-54-74:30125": 4}
    assert h.normalization == "per_rank" and h.n_ranks == 9 and h.excluded == {}
    assert sum(s.total_calls for s in h.series) * h.n_ranks == pytest.approx(26)
    assert (
        "iterations are known for 1 of 9 ranks: values are per rank over all calls, so the 22 calls of ranks "
        "without iterations count too (per iteration would leave them out)"
    ) in h.notes
    calls = bar_calls(con, "logs", limit=1000)
    assert calls.total == 26 and not calls.iterations_only
    # one process alone has its iterations: per rank per iteration, as before
    one = histogram(con, "logs", rank=None, step=0)
    assert one.normalization == "per_rank_per_iteration"


def test_bandwidth_says_the_runs_own_reason(con: duckdb.DuckDBPyConnection, data_dir: Path) -> None:
    ingest_run(con, "cpu", iter_inputs([data_dir / "kineto-hta/rank_non_gpu/rank_non_gpu.json.gz"]))
    ingest_run(con, "log", iter_inputs([data_dir / "nccl-logs/nvidia-nccl-1193.log"]))
    cpu = bandwidth(con, "cpu").notes
    assert cpu == [
        "no bandwidth: 6 calls: no measured duration (an NCCL call's CPU time is only its launch: the profiler "
        "must record CUDA activities so the trace holds its kernels; gloo calls are timed on the CPU)"
    ]
    assert bandwidth(con, "log").notes == [
        "no bandwidth: 4 calls: no measured duration (NCCL logs carry no durations; a profiler trace of the "
        "same ranks gives them)"
    ]
    ingest_run(con, "init-only", iter_inputs([data_dir / "nccl-logs/nvidia-nccl-671.log"]))  # INIT lines, no calls
    assert bandwidth(con, "init-only").notes == [
        "no bandwidth: the run holds no collective or point-to-point call to measure"
    ]


def test_ingest_hints_for_each_gap(tmp_path: Path, data_dir: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "commlens.cli",
            "ingest",
            str(data_dir / NO_COLL),
            str(data_dir / "nccl-logs/nvidia-nccl-1193.log"),
            str(data_dir / UNRANKED_TRACE),
            "--db",
            str(tmp_path / "s.duckdb"),
            "--run",
            "gaps",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "400"},
    )
    assert proc.returncode == 0, proc.stderr
    hints = [line for line in proc.stdout.splitlines() if line.startswith("hint: ")]
    assert hints == [
        f"hint: {data_dir / NO_COLL} has no COLL lines, so no calls: NCCL logs each collective only with "
        "NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=COLL (add INIT,GRAPH for the topology)",
        # three processes without INIT lines: --rank (one rank for the file) would be refused
        f"hint: {data_dir / 'nccl-logs/nvidia-nccl-1193.log'}: its 3 processes name no global rank: NCCL logs each "
        "process's rank in its INIT lines (NCCL_DEBUG_SUBSYS=INIT,COLL: `comm 0x... rank R nranks N ...`)",
        "hint: no call of run gaps-distributed_info_not_found has a known global rank: for a single-rank file, "
        "ingest it again with --rank N (into a new run, or after `commlens delete gaps-distributed_info_not_found`)",
    ]


# ------------------------------------------------------------------------------------ the pages


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, Any]:
    """The 19 excerpts in one run (--one-run), the DLRM job, and a log without COLL lines."""
    if importlib.util.find_spec("playwright") is None:
        _missing("playwright is not installed")
    if not CHROMIUM.exists():
        _missing(f"no Chromium at {CHROMIUM}")
    data = _data_dir(request.config)
    tmp = tmp_path_factory.mktemp("ui-defaults")
    db = tmp / "defaults.duckdb"
    _cli("ingest", str(data / "nccl-logs"), "--db", str(db), "--run", "logs", "--one-run")
    _cli("ingest", str(data / DLRM), "--db", str(db), "--run", "dlrm")
    _cli("ingest", str(data / NO_COLL), "--db", str(db), "--run", "nocoll")
    return {"db": db, "tmp": tmp, "data": data}


@pytest.mark.slow
def test_histograms_have_a_log_axis_and_keep_every_call(tab: Tab, api: httpx.Client) -> None:
    for run, weight in (("logs", "calls"), ("dlrm", "bytes"), ("dlrm", "calls")):
        h = api.get(f"/runs/{run}/histograms", params={"weight": weight}).json()
        page = tab.open(f"/runs/{run}/histograms?weight={weight}")
        for scheme in dict.fromkeys(s["scheme"] or "-" for s in h["series"]):  # "-": the page's key for no group
            dom_id = pattern_id(type="hg-graph", scheme=scheme)
            series = [s for s in h["series"] if (s["scheme"] or "-") == scheme]
            traces = tab.figure_data(dom_id, first_y=series[0]["values"])
            assert [t["y"] for t in traces] == [s["values"] for s in series]
            axis = page.evaluate(
                "(id) => { const g = document.getElementById(id).querySelector('.js-plotly-plot');"
                " return [g.layout.yaxis.type, g.layout.yaxis.title.text, g.layout.yaxis.range]; }",
                dom_id,
            )
            assert axis[0] == "log" and axis[1].endswith("(log scale)")
            # the smallest bar stands half a decade tall (autorange began at it: a bin of one call was a sliver)
            smallest = min(v for s in series for v in s["values"] if v > 0)
            assert axis[2][0] == pytest.approx(math.log10(smallest) - 0.5)
        if run == "logs":
            assert sum(s["total_calls"] for s in h["series"]) * h["n_ranks"] == pytest.approx(26)
            expect(page.locator("#hg-content .note-list")).to_contain_text("the 22 calls of ranks without iterations")


@pytest.mark.slow
def test_an_empty_histogram_says_the_real_reason(tab: Tab) -> None:
    page = tab.open("/runs/nocoll/histograms")
    expect(page.locator("#hg-content")).to_contain_text("NCCL_DEBUG_SUBSYS=COLL")
    page = tab.open("/runs/logs/histograms?op=broadcast")
    expect(page.locator("#hg-content")).to_contain_text("No calls match these filters (op broadcast).")
    # values no filter takes are left out, as if not given (the page was only the API's refusal of rank -1)
    page = tab.open("/runs/logs/histograms?rank=-1&op=zzz&scheme=nope")
    expect(page.locator("#hg-content .js-plotly-plot").first).to_be_visible()
    assert "Refused by the API" not in page.locator("#hg-content").inner_text()


# ------------------------------------------------------------------------- colour bars (figures)

FRONTEND = Path(__file__).resolve().parents[1] / "frontend"
HUMAN_BYTES = re.compile(r"^\d+(\.\d+)? (B|KiB|MiB|GiB|TiB)$")
HUMAN_TIME = re.compile(r"^\d+(\.\d+)? (µs|ms|s)$")


def _graphs(node: Any) -> list[Any]:
    """The dcc.Graph components of a Dash layout tree."""
    from dash import dcc

    if isinstance(node, (list, tuple)):
        return [g for c in node for g in _graphs(c)]
    if isinstance(node, dcc.Graph):
        return [node]
    return _graphs(getattr(node, "children", None)) if hasattr(node, "children") else []


def _heatmaps(view: Any) -> list[Any]:
    return [t for g in _graphs(view) for t in g.figure.data if t.type == "heatmap"]


def _assert_colour_bar(trace: Any, human: re.Pattern[str], top: float) -> list[str]:
    """Tick marks drawn outside the bar, every tick labelled in human units, at least three inside the range,
    starting at the scale's zero; returns the labels inside the range."""
    bar = trace.colorbar
    assert (bar.ticks, bar.tickmode, bar.showticklabels) == ("outside", "array", True)
    assert bar.ticklen >= 5 and bar.tickwidth >= 1
    assert trace.zmin == 0 and trace.zmax >= top
    inside = [t for t, v in zip(bar.ticktext, bar.tickvals, strict=True) if v <= trace.zmax]
    assert bar.tickvals[0] == 0 and len(inside) >= 3, inside
    assert all(human.match(t) for t in bar.ticktext), bar.ticktext
    assert list(bar.tickvals) == sorted(bar.tickvals)
    return inside


def test_every_heatmap_has_a_colour_bar_with_ticks_in_human_units() -> None:
    from commlens.contract.analysis import RankGroup, RankGroupCell, RankSchemeTotal, RankSummary, RankTotals
    from commlens.contract.pairs import PairMatrix
    from commlens.contract.time import Instance, InstanceMember, TimeStatus
    from commlens.frontend import page_ranks, page_time

    rows = [
        RankSchemeTotal(
            rank=str(r),
            scheme="dp",
            calls=4,
            bytes=(3 + r) << 20,
            time_us=1500.0 * (r + 1),
            iterations=2,
            bytes_per_iteration=((3 + r) << 20) / 2,
            time_us_per_iteration=750.0 * (r + 1),
        )
        for r in range(3)
    ]
    totals = RankTotals(run="r", rows=rows, imbalance=[], ranks=3)
    (by_bytes,) = _heatmaps(page_ranks.heatmap(totals, "bytes", "total", [], {}))
    assert _assert_colour_bar(by_bytes, HUMAN_BYTES, 5 << 20) == ["0 B", "1 MiB", "2 MiB", "3 MiB", "4 MiB", "5 MiB"]
    (by_time,) = _heatmaps(page_ranks.heatmap(totals, "time_us", "per_iteration", [], {}))
    assert _assert_colour_bar(by_time, HUMAN_TIME, 2250.0) == ["0 µs", "500 µs", "1 ms", "1.5 ms", "2 ms"]

    cell = RankGroupCell(scheme="dp", ranks=32, mean=9e9, min=1e9, max=2e10, min_rank="3", max_rank="9")
    summary = RankSummary(
        run="r",
        metric="bytes",
        basis="total",
        band=32,
        ranks=64,
        outlier_limit=32,
        schemes=[],
        groups=[
            RankGroup(label=f"ranks {i}-{i + 31}", kind="band", first=i, last=i + 31, members=32, cells=[cell])
            for i in (0, 32)
        ],
    )
    (bands,) = _heatmaps(page_ranks.bands_chart(summary, "r"))
    assert _assert_colour_bar(bands, HUMAN_BYTES, 9e9)[-1] == "8 GiB"

    matrix = PairMatrix(group_key="g", scheme="ep", ranks=[0, 1], bytes=[[0, 700], [300, 0]], calls=2, total_bytes=1000)
    (pairs,) = _heatmaps(page_ranks.pairs_heatmap(matrix, "the whole run", "r", 0))
    assert _assert_colour_bar(pairs, HUMAN_BYTES, 700) == ["0 B", "200 B", "400 B", "600 B"]

    members = [
        InstanceMember(rank=r, seq=1, arrival_us=10.0 * r, end_us=100.0, wait_us=2400.0 - 1200.0 * r) for r in range(3)
    ]
    instance = Instance(
        instance_id=1,
        group="g",
        scheme="dp",
        key=1,
        keyed_by="key",
        op="all_reduce",
        dtype="float32",
        msg_bytes=4,
        step=0,
        skew_us=2400.0,
        last_rank=2,
        first_arrival_us=0.0,
        last_arrival_us=20.0,
        real_us=80.0,
        algbw_gbps=None,
        busbw_gbps=None,
        members=members,
    )
    (waits,) = _heatmaps(page_time.waits_view("r", 0, [instance], TimeStatus(available=True, parts=[])))
    assert _assert_colour_bar(waits, HUMAN_TIME, 2.4) == ["0 ms", "0.5 ms", "1 ms", "1.5 ms", "2 ms"]
    assert waits.colorbar.title.text == "wait (ms)"


def test_every_heatmap_in_the_dashboard_takes_the_shared_colour_bar() -> None:
    """No page draws a heatmap with a colour bar of its own making (the figure test above covers each kind)."""
    found = {}
    for path in sorted(FRONTEND.glob("*.py")):
        text = path.read_text()
        calls = len(re.findall(r"go\.Heatmap\(|add_heatmap\(", text))
        if calls:
            found[path.name] = (calls, text.count("colorbar=colorbar("))
    assert found == {"page_ranks.py": (3, 3), "page_time.py": (1, 1)}


def test_two_runs_that_differ_in_two_parameters_offer_no_sweep() -> None:
    """Two runs put any two differing keys in the same partition; only a key that follows from another (world
    size from dp, FFN width from hidden) rides along."""
    from commlens.frontend.page_compare import varied_keys

    base = {
        "model.seq_len": 64.0,
        "model.hidden": 32.0,
        "model.ffn_hidden": 128.0,
        "parallel.dp": 2.0,
        "world_size": 2.0,
    }
    assert varied_keys({"a": base, "b": {**base, "model.seq_len": 128.0, "parallel.dp": 4.0, "world_size": 4.0}}) == []
    assert varied_keys({"a": base, "b": {**base, "model.seq_len": 128.0, "model.hidden": 64.0}}) == []
    assert varied_keys({"a": base, "b": {**base, "model.hidden": 64.0, "model.ffn_hidden": 256.0}}) == [
        "model.ffn_hidden",
        "model.hidden",
    ]
    assert varied_keys({"a": base, "b": {**base, "world_size": 4.0}}) == ["world_size"]


# ------------------------------------------------------------------- palettes and legends (pages)

LEGEND_CLEAR = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(g => {
  const legend = g.querySelector('.legend');
  const box = (e) => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  const titles = Array.from(g.querySelectorAll('.g-xtitle text, .g-ytitle text, .g-x2title text, .g-y2title text'))
    .filter(t => t.textContent.trim() !== '').map(box);
  const l = legend ? box(legend) : null;
  const hit = l ? titles.filter(t => t[0] < l[2] && l[0] < t[2] && t[1] < l[3] && l[1] < t[3]) : [];
  return {id: g.parentElement.id || g.closest('[id]').id, titles: titles.length, overlaps: hit.length};
})"""


def test_one_palette_per_kind_of_thing() -> None:
    """Schemes, ops and runs: runs never take a colour that means a scheme or an op anywhere."""
    from commlens.frontend.components import OP_COLORS, RUN_COLORS, SCHEME_COLORS, scheme_color

    assert not set(RUN_COLORS) & (set(SCHEME_COLORS.values()) | set(OP_COLORS.values()))
    assert scheme_color("unattributed") == scheme_color(None) == SCHEME_COLORS[None]
    assert scheme_color("dp") == SCHEME_COLORS["dp"] and scheme_color("mystery") == SCHEME_COLORS["other"]


@pytest.mark.slow
def test_no_legend_over_an_axis_title_and_colours_that_mean_one_thing(tab: Tab, api: httpx.Client) -> None:
    from commlens.frontend.components import RUN_COLORS, scheme_color

    pages = [
        "/runs/dlrm",
        "/runs/dlrm/histograms",
        "/runs/dlrm/predicted",
        "/runs/dlrm/ranks",
        "/runs/logs/histograms",
        "/runs/logs/ranks",
        "/compare?runs=dlrm,logs",
    ]
    for path in pages:
        page = tab.open(path)
        drawn = (
            "() => { const gs = Array.from(document.querySelectorAll('.js-plotly-plot'));"
            " return gs.length > 0 && gs.every(g => g.data && g.layout && g.querySelector('.main-svg')); }"
        )
        page.wait_for_function(drawn, timeout=test_ui.WAIT_MS)
        tab.idle()
        page.wait_for_function(drawn, timeout=test_ui.WAIT_MS)
        plots = page.evaluate(LEGEND_CLEAR)
        assert plots, f"no chart on {path}"
        assert all(p["titles"] >= 1 for p in plots), (path, plots)
        assert [p for p in plots if p["overlaps"]] == [], path
    # the ranks page's bandwidth section says how DLRM's calls, naming no group, got their group size
    tab.open("/runs/dlrm/ranks")
    expect(tab.page.locator("#rk-bandwidth")).to_contain_text(
        "64 measured calls name no process group: their busbw takes the default group's 8 ranks"
    )
    # the overview colours its measured bars by scheme; Compare colours by run
    tab.open("/runs/dlrm")
    bars = tab.page.evaluate(
        "() => { const g = document.querySelector('#ov-volumes .js-plotly-plot');"
        " const t = g.data.find(d => d.name === 'measured'); return [Array.from(t.x), t.marker.color]; }"
    )
    assert bars[1] == [scheme_color(s) for s in bars[0]]
    tab.open("/compare?runs=dlrm,logs")
    traces = {t["name"] for t in tab.figure_data("cmp-volumes")}
    colours = tab.page.evaluate(
        "() => document.querySelector('#cmp-volumes .js-plotly-plot').data.map(d => [d.name, d.marker.color])"
    )
    assert {name for name, _ in colours} == traces
    assert {c for _, c in colours} <= set(RUN_COLORS[:2])
    assert dict(colours)["dlrm measured"] != dict(colours)["logs measured"]


def test_a_link_past_the_last_runs_page_says_so_and_typed_text_over_its_limit_is_said_plainly() -> None:
    """`/?offset=99999` said "No runs yet" beside five runs; a 100,001-character comment showed pydantic's raw
    ValidationError (with its input and a URL) as "The page could not draw this view"."""
    from commlens.contract.common import Page
    from commlens.contract.review import MAX_BODY, ReviewCreate
    from commlens.contract.runs import RunSummary
    from commlens.frontend.components import guarded
    from commlens.frontend.page_runs import runs_table

    past = runs_table(Page[RunSummary](items=[], total=5, limit=50, offset=99999, next_offset=None), None, None, 99999)
    said = " ".join(c if isinstance(c, str) else c.children for c in past.children)
    assert said == "No runs this far down the list: it has 5; go to  the first page ."
    none = runs_table(Page[RunSummary](items=[], total=0, limit=50, offset=0, next_offset=None), None, None, 0)
    assert none.children.startswith("No runs yet")

    @guarded()
    def comment() -> None:
        ReviewCreate(body="x" * (MAX_BODY + 1))

    box = comment()
    assert box.children[1] == f"body: String should have at most {MAX_BODY} characters" and "error" in box.className


def test_compare_of_runs_without_calls_says_so_instead_of_an_empty_chart() -> None:
    from commlens.contract.compare import Comparison, RunComparison, RunsComparison
    from commlens.frontend.page_compare import volumes

    def bare(run: str) -> RunComparison:
        comparison = Comparison(
            run=run,
            config_source="none",
            implementation=None,
            iterations_mode="none",
            iterations_message="",
            ranks=[],
            exact=False,
            schemes=[],
            unexplained=[],
            missing=[],
            inferences=[],
            notes=[],
        )
        return RunComparison(run=run, strategy=None, world_size=None, comparison=comparison)

    shown = volumes(RunsComparison(runs=[bare("topo"), bare("topo-up_b")]))
    assert shown.children == "No calls to compare: topo, topo-up_b hold no collective calls."


def test_what_was_computed_shows_one_row_per_part() -> None:
    """A part with a row of what it did and one of what it could not was listed twice (yes, then no)."""
    from commlens.contract.time import TimePart, TimeStatus
    from commlens.frontend.page_time import status_block

    status = TimeStatus(
        available=True,
        parts=[
            TimePart(part="matching", computed=True, reason="0 instances matched"),
            TimePart(part="matching", computed=False, reason="21 calls not matched"),
            TimePart(part="clocks", computed=True, reason="one rank"),
        ],
    )
    table = str(status_block(status))
    assert table.count("'matching'") == 1 and "0 instances matched; 21 calls not matched" in table
    assert "'partly'" in table and "'yes'" in table


def test_what_if_values_in_the_address_that_the_form_does_not_take_are_said() -> None:
    """`?w_tp=abc&w_dp=-4` became the defaults without a word (then an error about other fields)."""
    from commlens.frontend.page_predicted import defaults_from_config, from_query

    values, ignored = from_query(
        {"w_tp": "abc", "w_dp": "-4", "w_pp": "2", "w_zero": "7", "w_impl": "x", "w_experts": "0"},
        defaults_from_config(None),
    )
    assert (values["tp"], values["dp"], values["pp"], values["zero"], values["impl"], values["experts"]) == (
        1,
        1,
        2,
        0,
        "paper",
        0,
    )
    assert ignored == [
        "w_dp=-4 (a whole number >= 1)",
        "w_tp=abc (a whole number >= 1)",
        "w_zero=7 (0, 1, 2 or 3)",
        "w_impl=x (one of paper, megatron, deepspeed, fsdp, harness)",
    ]


def test_a_step_without_matched_collectives_says_why_its_timeline_is_only_the_critical_path() -> None:
    from commlens.contract.time import TimePart, TimeStatus
    from commlens.frontend.page_time import _unmatched

    status = TimeStatus(
        available=True,
        parts=[
            TimePart(part="matching", computed=True, reason="0 instances matched"),
            TimePart(part="matching", computed=False, reason="one rank: nothing to match across ranks"),
        ],
    )
    note = _unmatched(5, 0, status)
    assert note.children == (
        "No collective of step 5 was matched across ranks, so only the critical path is drawn: "
        "matching: one rank: nothing to match across ranks."
    )
    assert _unmatched(5, 3, status) is None
