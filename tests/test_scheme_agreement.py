"""One scheme per call in every view: each endpoint that reports a scheme gives the same calls and bytes per scheme
as the store's `comms` view, on real jobs over a real uvicorn server.

The three real traces that name no process group (the 8-rank DLRM job, HTA's trace_diff control rank and
df_index_resolver) were once dp (and other) in the comparison, the run comparison and the report, and unattributed
in the overview, histograms, ranks, time views and findings. A scheme is a group's (backend/attribution.py): a call
without a group is unattributed everywhere. The ResNet-50 DDP rank, whose group is attributed dp, is the control."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import shared_data

from commlens import store
from commlens.backend.api import Settings
from commlens.backend.api.testing import ServerThread
from commlens.contract.analysis import UNATTRIBUTED
from commlens.ingest.inputs import iter_inputs
from commlens.service.ingest import ingest_run

RUNS = {
    "dlrm": "kineto-param/dlrm_kineto.tar.gz",
    "control": "kineto-hta/trace_diff/control/control.json.gz",
    "dfidx": "kineto-hta/df_index_resolver/df_index_resolver.json.gz",
    "resnet": "kineto-hta/nccl_parser_config/nccl_data.json.gz",
}

# Every counted call: scheme -> (calls, bytes), as the comms view has them.
ALL_CALLS: dict[str, dict[str, tuple[int, int]]] = {
    "dlrm": {UNATTRIBUTED: (64, 20_397_600)},
    "control": {UNATTRIBUTED: (60, 5_065_412_632)},
    "dfidx": {UNATTRIBUTED: (2020, 0)},  # its kernels carry no size
    "resnet": {"dp": (21, 307_323_096)},
}
# Calls inside complete iterations, per rank per iteration: scheme -> (calls, bytes).
PER_ITERATION: dict[str, dict[str, tuple[float, float]]] = {
    "dlrm": {UNATTRIBUTED: (8, 448 + 907_840 + 1_576_964 + 192 + 1536 + 13_568 + 2 * 24_576)},
    "control": {UNATTRIBUTED: (10, 2_532_706_316 / 3)},  # 3 complete profiler steps
    "dfidx": {UNATTRIBUTED: (404, 0)},  # 5 complete profiler steps
    "resnet": {"dp": (7, 102_441_032)},
}

# The views that name a scheme for each run; the others have nothing to say of it (bandwidth: no message size in
# dfidx; stragglers: one rank's trace; pairs: no all_to_all split recorded; findings: none).
# DLRM's and control's calls name no group: bandwidth takes the world's size for them, as wire bytes do.
_TIME = ("time/breakdown", "time/critical-path")
NAMING: dict[str, tuple[str, ...]] = {
    "dlrm": ("bandwidth", "ranks/summary", "findings", *_TIME, "time/stragglers"),
    "control": ("bandwidth", "ranks/summary", "findings", *_TIME),
    "dfidx": ("ranks/summary", "findings", *_TIME),
    "resnet": ("bandwidth", "ranks/summary", *_TIME),
}


@pytest.fixture(scope="module")
def stored(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ServerThread, dict[str, dict[str, tuple[float, float]]]]]:
    """The four runs ingested into one store, served; with each run's (calls, bytes) per scheme in the comms view."""
    data = shared_data()
    db = tmp_path_factory.mktemp("scheme-agreement") / "store.duckdb"
    con = store.connect(db)
    for run, path in RUNS.items():
        assert not ingest_run(con, run, iter_inputs([data / path])).failed
    sql = "SELECT scheme, count(*), coalesce(sum(msg_bytes), 0) FROM comms WHERE run = ? GROUP BY ALL"
    comms = {run: totals(con.execute(sql, [run]).fetchall()) for run in RUNS}
    con.close()
    with ServerThread(Settings(db=db)) as srv:
        yield srv, comms


@pytest.fixture(scope="module")
def client(stored: tuple[ServerThread, Any]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stored[0].url, timeout=120) as c:
        yield c


def get(client: httpx.Client, path: str, **params: Any) -> Any:
    r = client.get(path, params=params)
    assert r.status_code == 200, r.text
    return r.json()


def name(scheme: str | None) -> str:
    return scheme or UNATTRIBUTED


def totals(rows: list[tuple[str | None, float, float]]) -> dict[str, tuple[float, float]]:
    out: dict[str, list[float]] = defaultdict(lambda: [0, 0])
    for scheme, calls, nbytes in rows:
        out[name(scheme)][0] += calls
        out[name(scheme)][1] += nbytes
    return {k: (v[0], v[1]) for k, v in out.items()}


def comparison_totals(comparison: dict[str, Any]) -> dict[str, tuple[float, float]]:
    return {
        s["scheme"]: (sum(o["measured_calls_per_iter"] for o in s["ops"]), s["measured_bytes_per_iter"])
        for s in comparison["schemes"]
    }


def histogram_totals(h: dict[str, Any]) -> dict[str, tuple[float, float]]:
    return totals([(s["scheme"], s["total_calls"], s["total_bytes"]) for s in h["series"]])


def approx(d: dict[str, tuple[float, float]]) -> Any:
    return {k: pytest.approx(v, rel=1e-12) for k, v in d.items()}


@pytest.mark.parametrize("run", list(RUNS))
def test_every_call_has_one_scheme_in_every_view(run: str, client: httpx.Client, stored: tuple[Any, Any]) -> None:
    """Calls and bytes per scheme over all calls: comms view, groups, histogram (not normalised), a bar's calls, ranks,
    the report's parts; time instances (calls), where the job has them."""
    expected = ALL_CALLS[run]
    assert stored[1][run] == expected

    groups = get(client, f"/api/runs/{run}/groups")
    assert groups["events_by_scheme"] == {k: calls for k, (calls, _) in expected.items()}
    assert histogram_totals(get(client, f"/api/runs/{run}/histograms", normalize="false")) == expected
    for scheme, (calls, _) in expected.items():
        assert get(client, f"/api/runs/{run}/calls", scheme=scheme, normalize="false", limit=1)["total"] == calls
    ranks = get(client, f"/api/runs/{run}/ranks")
    assert totals([(r["scheme"], r["calls"], r["bytes"]) for r in ranks["rows"]]) == expected

    report = get(client, f"/api/runs/{run}/report")
    assert report["attribution"]["events_by_scheme"] == groups["events_by_scheme"]
    assert totals([(r["scheme"], r["calls"], r["bytes"]) for r in report["ranks"]["rows"]]) == expected

    instances = get(client, f"/api/runs/{run}/time/instances", members="false", limit=1000)
    assert instances["next_offset"] is None
    if run == "dlrm":  # the one job here with every rank's trace: 8 instances per rank, matched on all 8
        seen = totals([(i["scheme"], i["member_count"], 0) for i in instances["items"]])
        assert {k: c for k, (c, _) in seen.items()} == {k: c for k, (c, _) in expected.items()}


@pytest.mark.parametrize("run", list(RUNS))
def test_per_iteration_views_agree(run: str, client: httpx.Client) -> None:
    """Per rank per iteration inside complete iterations: the normalised histogram, the comparison, the comparison
    of runs and the report (its schemes, its comparison and its histogram) give the same calls and bytes per scheme."""
    expected = approx(PER_ITERATION[run])
    assert histogram_totals(get(client, f"/api/runs/{run}/histograms")) == expected
    assert comparison_totals(get(client, f"/api/runs/{run}/comparison")) == expected
    compared = get(client, "/api/compare", runs=f"{run},resnet" if run != "resnet" else run)["runs"]
    assert comparison_totals(compared[0]["comparison"]) == expected
    if run != "resnet":
        assert comparison_totals(compared[1]["comparison"]) == approx(PER_ITERATION["resnet"])
    report = get(client, f"/api/runs/{run}/report")
    assert comparison_totals(report["comparison"]) == expected
    assert {s["scheme"]: s["measured_bytes_per_iter"] for s in report["schemes"]} == {
        k: pytest.approx(b, rel=1e-12) for k, (_, b) in PER_ITERATION[run].items()
    }
    assert histogram_totals(report["histogram"]) == expected


@pytest.mark.parametrize("run", list(RUNS))
def test_views_that_name_schemes_name_the_same(run: str, client: httpx.Client) -> None:
    """Views that report a scheme without call counts (bandwidth, rank spread, findings, the time breakdown, stragglers,
    the critical path, all_to_all pairs) name exactly the schemes the calls have, where they name any."""
    schemes = set(ALL_CALLS[run])
    named: dict[str, set[str]] = {
        "bandwidth": {name(s["scheme"]) for s in get(client, f"/api/runs/{run}/bandwidth")["by_scheme"]},
        "ranks/summary": {name(s["scheme"]) for s in get(client, f"/api/runs/{run}/ranks/summary")["schemes"]},
        "findings": {
            str(f["view"]["scheme"])
            for f in get(client, f"/api/runs/{run}/findings", limit=200)["items"]
            if f["view"].get("scheme")
        },
        "time/breakdown": {
            s["scheme"] for row in get(client, f"/api/runs/{run}/time/breakdown")["rows"] for s in row["schemes"]
        },
        "time/critical-path": {
            k for p in get(client, f"/api/runs/{run}/time/critical-path")["paths"] for k in p["exposed_share_by_scheme"]
        },
        "time/stragglers": {g["scheme"] for g in get(client, f"/api/runs/{run}/time/stragglers")["groups"]},
        "pairs": {name(m["scheme"]) for m in get(client, f"/api/runs/{run}/pairs")["matrices"]},
    }
    assert {view: names for view, names in named.items() if names} == dict.fromkeys(NAMING[run], frozenset(schemes))
