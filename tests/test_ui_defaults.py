"""Defaults that show all the data (real NCCL logs and the DLRM job): histograms keep the calls of ranks
without iterations, every histogram has a log y axis, each gap comes with its hint, empty states and the
bandwidth section give the run's real reason. The page tests run a real server and Chromium."""

from __future__ import annotations

import importlib.util
import os
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
    ingest_run(con, "dlrm", iter_inputs([data_dir / DLRM]))
    ingest_run(con, "log", iter_inputs([data_dir / "nccl-logs/nvidia-nccl-1193.log"]))
    dlrm = bandwidth(con, "dlrm").notes
    assert dlrm == [
        "no bandwidth: 64 calls: group size unknown (the files name no process group for them, and busbw "
        "needs the group's size)"
    ]
    assert "NCCL logs" not in dlrm[0]
    assert bandwidth(con, "log").notes == [
        "no bandwidth: 4 calls: no measured duration (NCCL logs carry no durations; a profiler trace of the "
        "same ranks gives them)"
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
        "hint: no call of run gaps-nvidia-nccl-1193 has a known global rank: for a single-rank file, ingest it "
        "again with --rank N (into a new run, or after deleting this one)",
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
                " return [g.layout.yaxis.type, g.layout.yaxis.title.text]; }",
                dom_id,
            )
            assert axis[0] == "log" and axis[1].endswith("(log scale)")
        if run == "logs":
            assert sum(s["total_calls"] for s in h["series"]) * h["n_ranks"] == pytest.approx(26)
            expect(page.locator("#hg-content .note-list")).to_contain_text("the 22 calls of ranks without iterations")


@pytest.mark.slow
def test_an_empty_histogram_says_the_real_reason(tab: Tab) -> None:
    page = tab.open("/runs/nocoll/histograms")
    expect(page.locator("#hg-content")).to_contain_text("NCCL_DEBUG_SUBSYS=COLL")
    page = tab.open("/runs/logs/histograms?op=broadcast")
    expect(page.locator("#hg-content")).to_contain_text("No calls match these filters (op broadcast).")
