"""The time endpoints over a real uvicorn server, on the real 8-rank DLRM job (one profiled step; the
numbers are docs/time.md's worked example) and on a real torchrun/gloo harness run with a planted
straggler (`--dp 2 --delay 1:MS`, tests/harness_runs.py), plus a run without any trace and the bad requests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, get_args

import httpx
import pytest
from conftest import shared_data
from harness_runs import PROFILED_STEPS, HarnessRuns, imposed_by_the_sleep, named

from commlens import store
from commlens.backend.api import Settings
from commlens.backend.api.testing import ServerThread
from commlens.backend.api.time import SchemeFilter
from commlens.contract.time import UNATTRIBUTED, BreakdownReport, InstancesPage, StragglerReport, TimeSummary
from commlens.ingest.inputs import iter_inputs
from commlens.service.ingest import ingest_run
from commlens.vocab import SCHEMES

DLRM = "kineto-param/dlrm_kineto.tar.gz"
CATEGORIES = ("compute_us", "overlapped_us", "wait_us", "exposed_us", "memcpy_us", "idle_us")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    data = shared_data()
    db = tmp_path_factory.mktemp("time-api") / "store.duckdb"
    con = store.connect(db)
    report = ingest_run(con, "dlrm", iter_inputs([data / DLRM]))
    assert not report.failed
    store.ensure_run(con, "empty", description="no files")
    con.close()
    with ServerThread(Settings(db=db)) as srv:
        yield srv


@pytest.fixture
def client(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def ok(r: httpx.Response) -> Any:
    assert r.status_code == 200, r.text
    return r.json()


def problem(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    body = r.json()
    assert body["status"] == status and len(body["detail"]) > 10
    return body


# ------------------------------------------------------------------------------------ DLRM


def test_summary_of_the_dlrm_job(client: httpx.Client) -> None:
    s = TimeSummary.model_validate(ok(client.get("/api/runs/dlrm/time")))
    assert s.status.available and (s.instances, s.mismatches) == (8, 0)
    assert {p.part for p in s.status.parts} >= {"matching", "clocks", "waits", "breakdown", "stragglers"}
    assert s.clocks is not None and (s.clocks.applied, s.clocks.trusted) == (False, True)
    assert "shared clock" in s.clocks.reason and [o.offset_us for o in s.clocks.offsets] == [0.0] * 8
    assert [(r.rank, r.steps, r.instances, r.arrived_last, r.wait_us) for r in s.ranks] == [
        (0, 1, 8, 0, 5580.0),
        (1, 1, 8, 0, 11125.0),
        (2, 1, 8, 0, 3280.0),
        (3, 1, 8, 0, 9571.0),
        (4, 1, 8, 1, 6370.0),
        (5, 1, 8, 2, 6041.0),
        (6, 1, 8, 0, 3342.0),
        (7, 1, 8, 5, 1534.0),
    ]
    r7 = s.ranks[7]
    assert (r7.step_us, r7.exposed_us, r7.overlapped_us) == (12509.0, 1380.0 + 200.0, 166.0)
    assert s.stragglers == []
    (v,) = s.verdicts
    assert (v.group, v.verdict, v.candidate_rank) == ("world", "no straggler", 7)
    assert "1 step(s) with instances, consistency needs 4" in v.reason


def test_breakdown_per_rank_and_step(client: httpx.Client) -> None:
    b = BreakdownReport.model_validate(ok(client.get("/api/runs/dlrm/time/breakdown")))
    assert (b.total, b.next_offset, [r.rank for r in b.rows]) == (8, None, list(range(8)))
    row = b.rows[0]
    assert (row.step, row.step_us) == (10, 14455.0)
    assert [getattr(row, c) for c in CATEGORIES] == [773.0, 261.0, 5342.0, 195.0, 19.0, 7865.0]
    for r in b.rows:
        assert sum(getattr(r, c) for c in CATEGORIES) == pytest.approx(r.step_us, abs=1e-6)
    (sc,) = row.schemes
    assert (sc.scheme, sc.overlapped_us, sc.wait_us, sc.exposed_us) == ("unattributed", 261.0, 5342.0, 195.0)
    lanes = {m.direction: m.bytes for m in row.memcpy}
    assert (lanes["htod"], lanes["dtoh"]) == (31112, 216)
    one = BreakdownReport.model_validate(ok(client.get("/api/runs/dlrm/time/breakdown", params={"rank": 7})))
    assert [(r.rank, r.step, r.wait_us) for r in one.rows] == [(7, 10, 1380.0)]
    page = ok(client.get("/api/runs/dlrm/time/breakdown", params={"limit": 3, "offset": 6}))
    assert ([r["rank"] for r in page["rows"]], page["total"], page["next_offset"]) == ([6, 7], 8, None)
    page = ok(client.get("/api/runs/dlrm/time/breakdown", params={"limit": 3}))
    assert ([r["rank"] for r in page["rows"]], page["next_offset"]) == ([0, 1, 2], 3)
    assert ok(client.get("/api/runs/dlrm/time/breakdown", params={"step": 11}))["rows"] == []
    dp_only = ok(client.get("/api/runs/dlrm/time/breakdown", params={"scheme": "dp"}))
    assert len(dp_only["rows"]) == 8 and all(r["schemes"] == [] for r in dp_only["rows"])


def test_instances_with_skew_waits_and_bandwidth(client: httpx.Client) -> None:
    p = InstancesPage.model_validate(ok(client.get("/api/runs/dlrm/time/instances")))
    assert (p.total, p.next_offset) == (8, None)
    assert [i.last_rank for i in p.items] == [7, 7, 7, 7, 7, 5, 5, 4]
    assert [i.skew_us for i in p.items] == [7624.0, 1101.0, 168.0, 125.0, 223.0, 534.0, 584.0, 885.0]
    i4 = p.items[4]
    assert (i4.instance_id, i4.op, i4.msg_bytes, i4.group, i4.keyed_by, i4.step) == (
        4,
        "all_reduce",
        1576964,
        "world",
        "order",
        10,
    )
    assert (i4.real_us, i4.bandwidth_time) == (86.0, "real_us")
    assert i4.algbw_gbps == pytest.approx(1576964 / 86.0 / 1e3)
    assert i4.busbw_gbps == pytest.approx(1576964 / 86.0 / 1e3 * 2 * 7 / 8)
    first = p.items[0]
    assert [m.rank for m in first.members] == list(range(8))
    waits = {m.rank: m.wait_us for m in first.members}
    assert (waits[1], waits[7]) == (7624.0, 0.0)
    assert first.last_arrival_us is not None and first.first_arrival_us is not None
    assert first.last_arrival_us - first.first_arrival_us == 7624.0
    # the members' waits add up to each rank's total in the summary
    totals = {r["rank"]: r["wait_us"] for r in ok(client.get("/api/runs/dlrm/time"))["ranks"]}
    summed = {r: sum(m.wait_us or 0.0 for i in p.items for m in i.members if m.rank == r) for r in range(8)}
    assert summed == pytest.approx(totals)


def test_instances_filters_and_pages(client: httpx.Client) -> None:
    def get(**params: Any) -> dict[str, Any]:
        return ok(client.get("/api/runs/dlrm/time/instances", params=params))

    ar = get(op="all_reduce")
    assert (ar["total"], [i["instance_id"] for i in ar["items"]]) == (3, [4, 6, 7])
    assert ar["filters"] == {"group": None, "op": "all_reduce", "step": None, "rank": None}
    assert get(op="all_to_all")["total"] == 5
    assert get(rank=3)["total"] == 8 and get(rank=8)["total"] == 0
    assert get(step=10)["total"] == 8 and get(step=11)["total"] == 0
    assert get(group="world", op="all_reduce", step=10, rank=0)["total"] == 3
    assert get(group="pg:none")["items"] == []
    page = get(limit=3, offset=3)
    assert ([i["instance_id"] for i in page["items"]], page["next_offset"], page["limit"]) == ([3, 4, 5], 6, 3)
    assert all(len(i["members"]) == 8 for i in page["items"])
    last = get(limit=3, offset=6)
    assert ([i["instance_id"] for i in last["items"]], last["next_offset"]) == ([6, 7], None)


def test_critical_path_and_mismatches(client: httpx.Client) -> None:
    (path,) = ok(client.get("/api/runs/dlrm/time/critical-path"))["paths"]
    assert path["step"] == 10 and path["note"] is None
    collectives = [s for s in path["segments"] if s["kind"] == "collective"]
    assert [s["rank"] for s in collectives] == [4, 4, 5, 5, 7, 7, 7, 7]
    assert [s["instance_id"] for s in collectives] == [7, 6, 5, 4, 3, 2, 1, 0]
    assert path["segments"][0]["end_us"] == path["end_us"]
    assert path["categories"] == {
        "compute": 1097.0,
        "overlapped": 4.0,
        "wait": 0.0,
        "exposed": 212.0,
        "memcpy": 27.0,
        "idle": 11970.0,
    }
    assert path["exposed_share_by_scheme"] == {"unattributed": pytest.approx(212.0 / 20823.0)}
    assert ok(client.get("/api/runs/dlrm/time/critical-path", params={"step": 10}))["paths"][0] == path
    assert ok(client.get("/api/runs/dlrm/time/critical-path", params={"step": 3}))["paths"] == []
    assert path["segment_count"] == len(path["segments"]) and path["segments_included"]
    (bare,) = ok(client.get("/api/runs/dlrm/time/critical-path", params={"segments": "false"}))["paths"]
    assert bare == {**path, "segments": [], "segments_included": False}  # the count and everything else kept
    assert ok(client.get("/api/runs/dlrm/time/mismatches")) == {"run": "dlrm", "mismatches": [], "not_matched": {}}


def test_stragglers_endpoint(client: httpx.Client) -> None:
    s = StragglerReport.model_validate(ok(client.get("/api/runs/dlrm/time/stragglers")))
    assert s.stragglers == [] and [g.verdict for g in s.groups] == ["no straggler"]
    assert [(a.rank, a.instances, a.arrived_last) for a in s.ranks] == [
        (r, 8, {4: 1, 5: 2, 7: 5}.get(r, 0)) for r in range(8)
    ]
    assert all(a.group == "world" and a.steps == 1 for a in s.ranks)
    # rank 7's instances carry most of the step's wait (it is "mostly last"), but one step cannot show consistency
    assert [a.steps_mostly_last for a in s.ranks] == [0, 0, 0, 0, 0, 0, 0, 1]
    assert [a.imposed_us for a in s.ranks] == [0.0, 0.0, 0.0, 0.0, 5009.0, 6282.0, 0.0, 35552.0]
    assert sum(a.imposed_us for a in s.ranks) == pytest.approx(sum(a.wait_us for a in s.ranks))


# ----------------------------------------------------------------------------- no timeline, bad requests


def test_a_run_without_traces_says_so(client: httpx.Client) -> None:
    s = ok(client.get("/api/runs/empty/time"))
    assert s["status"] == {"available": False, "parts": []}
    assert (s["clocks"], s["ranks"], s["stragglers"], s["instances"]) == (None, [], [], 0)
    assert ok(client.get("/api/runs/empty/time/breakdown"))["rows"] == []
    assert ok(client.get("/api/runs/empty/time/instances"))["total"] == 0
    assert ok(client.get("/api/runs/empty/time/critical-path"))["paths"] == []


@pytest.mark.parametrize("tail", ["", "/breakdown", "/instances", "/stragglers", "/critical-path", "/mismatches"])
def test_unknown_run_is_a_problem(client: httpx.Client, tail: str) -> None:
    body = problem(client.get(f"/api/runs/ghost/time{tail}"), 404)
    assert "no run named 'ghost'" in body["detail"] and body["type"].endswith("unknown-run")


def test_bad_parameters_are_problems(client: httpx.Client) -> None:
    for path, params, field in (
        ("instances", {"op": "allreduce"}, "query.op"),
        ("instances", {"rank": -1}, "query.rank"),
        ("instances", {"limit": 0}, "query.limit"),
        ("instances", {"step": "ten"}, "query.step"),
        ("breakdown", {"scheme": "zz"}, "query.scheme"),
        ("breakdown", {"limit": 1001}, "query.limit"),
        ("critical-path", {"step": 2**40}, "query.step"),
    ):
        body = problem(client.get(f"/api/runs/dlrm/time/{path}", params=params), 422)
        assert body["errors"][0]["field"] == field, body
    assert "GET" in problem(client.post("/api/runs/dlrm/time/instances"), 405)["detail"]


def test_openapi_shapes_come_from_the_contract(client: httpx.Client) -> None:
    spec = ok(client.get("/api/openapi.json"))
    paths = spec["paths"]
    for tail, model in (
        ("", "TimeSummary"),
        ("/breakdown", "BreakdownReport"),
        ("/instances", "InstancesPage"),
        ("/stragglers", "StragglerReport"),
        ("/critical-path", "CriticalPathReport"),
        ("/mismatches", "MismatchReport"),
    ):
        get = paths[f"/api/runs/{{run}}/time{tail}"]["get"]
        assert get["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(model)
        assert "application/problem+json" in get["responses"]["404"]["content"]
    assert "bandwidth_time" in spec["components"]["schemas"]["Instance"]["properties"]
    assert get_args(SchemeFilter) == (*SCHEMES, UNATTRIBUTED)  # the scheme filter follows the vocabulary


def test_one_name_for_unattributed_calls() -> None:
    """The time contract, the time service and the breakdown name calls without a scheme by the contract's one
    constant (issue 12): none spells the word itself."""
    import inspect

    from commlens.backend.timing import breakdown
    from commlens.contract import analysis
    from commlens.contract import time as time_contract
    from commlens.service import time as time_service

    assert time_contract.UNATTRIBUTED is analysis.UNATTRIBUTED == "unattributed"
    for module in (time_contract, time_service, breakdown):
        assert '"unattributed"' not in inspect.getsource(module), module.__name__


# ----------------------------------------------------------------------- a real gloo run with a straggler


@pytest.fixture(scope="module")
def gloo_server(harness_runs: HarnessRuns, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """`commlens harness --dp 2 --delay 1:MS` (torchrun, gloo on CPU; 8 profiled steps of one DDP bucket each,
    shared by the session: tests/harness_runs.py) ingested as run "straggler"."""
    from commlens.harness import launch

    db = tmp_path_factory.mktemp("time-gloo") / "store.duckdb"
    assert not launch.ingest_run(db, named(harness_runs.straggler("dp-delay"), "straggler")).failed
    with ServerThread(Settings(db=db)) as srv:
        yield srv


def test_gloo_run_names_the_planted_straggler(gloo_server: ServerThread, harness_runs: HarnessRuns) -> None:
    with httpx.Client(base_url=gloo_server.url, timeout=60) as c:
        s = TimeSummary.model_validate(ok(c.get("/api/runs/straggler/time")))
        report = StragglerReport.model_validate(ok(c.get("/api/runs/straggler/time/stragglers")))
        dp = next(g for g in report.groups if g.scheme == "dp")
        instances = InstancesPage.model_validate(
            ok(c.get("/api/runs/straggler/time/instances", params={"group": dp.group, "limit": 1000}))
        )
        b = BreakdownReport.model_validate(ok(c.get("/api/runs/straggler/time/breakdown")))
    assert s.status.available and s.mismatches == 0
    assert any(p.part == "breakdown" and "no device activity" in p.reason for p in s.status.parts)
    (st,) = [x for x in s.stragglers if x.scheme == "dp"]
    assert (st.rank, st.group, st.verdict) == (1, dp.group, "straggler") and st == report.stragglers[0]
    assert st.steps == st.steps_consistent == len(PROFILED_STEPS) and st.arrived_last_share >= 0.9
    assert imposed_by_the_sleep(st.imposed_ms_per_step, harness_runs.slept_ms("dp-delay")), st
    assert "straggler rank 1" in st.reason
    # the instances behind the verdict: rank 1 last in the share stated, rank 0's waits are what it imposed
    assert instances.total == st.instances == len(instances.items)
    assert all([m.rank for m in i.members] == [0, 1] for i in instances.items)
    last1 = [i for i in instances.items if i.last_rank == 1]
    assert len(last1) / len(instances.items) == pytest.approx(st.arrived_last_share)
    imposed = sum(m.wait_us or 0.0 for i in last1 for m in i.members if m.rank == 0)
    assert imposed / 1000 / st.steps == pytest.approx(st.imposed_ms_per_step)
    # no device: no memcpy; each rank's eight profiled steps split into the six categories
    assert [r.rank for r in b.rows] == [0] * 8 + [1] * 8
    assert all(r.memcpy == [] and r.memcpy_us == 0.0 for r in b.rows)
    for r in b.rows:
        assert sum(getattr(r, cat) for cat in CATEGORIES) == pytest.approx(r.step_us, abs=1e-6)
