"""Real traces uploaded to a real server: jobs report every file, and every analysis endpoint returns
exactly what the analysis function returns when called directly on the same store."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from commlens.backend.api import Settings
from commlens.backend.api.testing import ServerThread, wait_job
from commlens.backend.attribution import attribution_summary
from commlens.backend.bandwidth import bandwidth
from commlens.backend.compare import compare
from commlens.backend.findings import findings
from commlens.backend.histograms import histogram
from commlens.backend.iterations import assign_iterations
from commlens.backend.ranks import rank_totals

RESNET50_PARAMS = 25_557_032
RUNS = {
    "hta-ddp": ["kineto-hta/nccl_parser_config/nccl_data.json.gz"],
    "dlrm": ["kineto-param/dlrm_kineto.tar.gz"],
    "nccl-logs": ["nccl-logs/nvidia-nccl-1193.log", "nccl-logs/nvidia-nccl-584.log", "nccl-logs/nvidia-nccl-1595.log"],
}


def module_data_dir(config: pytest.Config) -> Path:
    """conftest's shared_data() (skip when absent, fail under CI) for module-scoped fixtures."""
    for plugin in config.pluginmanager.get_plugins():
        if str(getattr(plugin, "__file__", "")).endswith("conftest.py") and callable(
            getattr(plugin, "shared_data", None)
        ):
            return plugin.shared_data()
    raise RuntimeError("tests/conftest.py with shared_data() not loaded")


@pytest.fixture(scope="module")
def ingested(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest):
    data_dir = module_data_dir(request.config)
    db = tmp_path_factory.mktemp("ingest") / "store.duckdb"
    with ServerThread(Settings(db=db)) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        jobs = {}
        for run, files in RUNS.items():
            assert c.post("/api/runs", json={"name": run}).status_code == 201
            # three excerpts of unrelated jobs: one run on request (one_run), else one run each (test_api_split)
            r = c.post(
                f"/api/runs/{run}/files",
                files=[("files", (Path(f).name, (data_dir / f).read_bytes())) for f in files],
                data={"one_run": "true"} if run == "nccl-logs" else None,
            )
            assert r.status_code == 202 and r.headers["location"] == f"/api/jobs/{r.json()['job_id']}"
            jobs[run] = r.json()["job_id"]
        done = {run: wait_job(c, job_id, timeout=120) for run, job_id in jobs.items()}
        yield srv, done, data_dir


@pytest.fixture
def client(ingested):
    with httpx.Client(base_url=ingested[0].url, timeout=60) as c:
        yield c


def same(api_json: dict, model) -> None:
    assert api_json == json.loads(model.model_dump_json())


def test_jobs_account_for_every_file(ingested, client: httpx.Client) -> None:
    _srv, done, data = ingested
    dlrm = done["dlrm"]
    assert dlrm["state"] == "done" and dlrm["error"] is None
    size = (data / RUNS["dlrm"][0]).stat().st_size
    assert (dlrm["files_total"], dlrm["files_done"], dlrm["bytes_total"], dlrm["bytes_done"]) == (1, 1, size, size)
    assert sorted(r["rank"] for r in dlrm["results"]) == list(range(8))
    assert dlrm["jobs"] == [] and {r["run"] for r in dlrm["results"]} == {"dlrm"}  # one job: one run
    assert all(
        r["status"] == "ok" and r["upload"] == "dlrm_kineto.tar.gz" and "!" in r["path"] for r in dlrm["results"]
    )
    for run, job in done.items():
        assert job["state"] == "done", job
        detail = client.get(f"/api/runs/{run}").json()
        assert detail["sources"]["ok"] == sum(r["status"] == "ok" for r in job["results"])
        assert detail["events"] == sum(r["events"] for r in job["results"]) == sum(detail["ops"].values()) > 0
    listed = client.get("/api/jobs", params={"run": "dlrm"}).json()
    assert [j["job_id"] for j in listed["items"]] == [dlrm["job_id"]]
    everyone = client.get("/api/jobs").json()["total"]
    assert client.get("/api/jobs", params={"run": ""}).json()["total"] == everyone > 1  # empty: no filter


def test_resnet50_gradients_per_iteration(client: httpx.Client) -> None:
    """The DDP trace all-reduces ResNet-50's fp32 gradients once per iteration."""
    h = client.get("/api/runs/hta-ddp/histograms", params={"op": "all_reduce", "weight": "bytes"}).json()
    assert h["normalization"] == "per_rank_per_iteration"
    assert sum(s["total_bytes"] for s in h["series"]) == RESNET50_PARAMS * 4
    assert sum(s["total_calls"] for s in h["series"]) == 5  # five gradient buckets


@pytest.mark.parametrize("run", list(RUNS))
def test_analysis_endpoints_equal_direct_calls(ingested, client: httpx.Client, run: str) -> None:
    cur = ingested[0].app.state.ctx.db.cursor()
    try:
        groups, summary = (
            client.get(f"/api/runs/{run}/groups", params={"limit": 1000}).json(),
            attribution_summary(cur, run),
        )
        assert groups["items"] == [json.loads(g.model_dump_json()) for g in summary.groups]
        assert (groups["total"], groups["unattributed_events"], groups["events_by_scheme"]) == (
            len(summary.groups),
            summary.unattributed_events,
            summary.events_by_scheme,
        )
        same(client.get(f"/api/runs/{run}/iterations").json(), assign_iterations(cur, run).info)
        same(client.get(f"/api/runs/{run}/bandwidth").json(), bandwidth(cur, run))
        same(client.get(f"/api/runs/{run}/ranks").json(), rank_totals(cur, run))
        same(client.get(f"/api/runs/{run}/comparison").json(), compare(cur, run))
        page = client.get(f"/api/runs/{run}/findings").json()
        assert page["items"] == [json.loads(f.model_dump_json()) for f in findings(cur, run)]
        for params in (
            {},
            {"weight": "bytes"},
            {"normalize": "false"},
            {"op": "all_reduce"},
            {"rank": 0},
            {"scheme": "dp", "weight": "bytes"},
            {"step": 0},
        ):
            kwargs = {k: (v == "true" if k == "normalize" else v) for k, v in params.items()}
            same(client.get(f"/api/runs/{run}/histograms", params=params).json(), histogram(cur, run, **kwargs))
    finally:
        cur.close()


def test_reupload_is_a_duplicate_and_changes_nothing(ingested, client: httpx.Client) -> None:
    data = ingested[2]
    before = client.get("/api/runs/hta-ddp").json()
    path = data / RUNS["hta-ddp"][0]
    r = client.post("/api/runs/hta-ddp/files", files={"files": ("again.json.gz", path.read_bytes())})
    job = wait_job(client, r.json()["job_id"])
    assert [(x["status"], x["error"]) for x in job["results"]] == [
        ("duplicate", "same bytes as nccl_data.json.gz, already ingested")
    ]
    after = client.get("/api/runs/hta-ddp").json()
    assert (after["events"], after["sources"]) == (before["events"], before["sources"])


@pytest.mark.parametrize("run", ["dlrm", "nccl-logs"])
def test_export_has_every_row(client: httpx.Client, run: str) -> None:
    detail = client.get(f"/api/runs/{run}").json()
    lines = client.get(f"/api/runs/{run}/export", params={"format": "jsonl"}).text.splitlines()
    rows = [json.loads(x) for x in lines]
    assert len(rows) == detail["events"]
    by_op: dict[str, int] = {}
    for row in rows:
        by_op[row["op"]] = by_op.get(row["op"], 0) + 1
    assert by_op == detail["ops"]
    first = client.get(f"/api/runs/{run}/export", params={"format": "csv", "op": "all_reduce"}).text.splitlines()
    assert len(first) - 1 == detail["ops"].get("all_reduce", 0)


def test_topology_rows_of_nccl_logs(ingested, client: httpx.Client) -> None:
    cur = ingested[0].app.state.ctx.db.cursor()
    try:
        for table, sql_table in (("comms", "nccl_comms"), ("topology", "nccl_topology"), ("tuning", "nccl_tuning")):
            page = client.get(f"/api/runs/nccl-logs/topology/{table}", params={"limit": 1000}).json()
            n = cur.execute(
                f"SELECT count(*) FROM {sql_table} t JOIN runs r USING (run_id) WHERE r.name = 'nccl-logs'"
            ).fetchone()[0]
            assert page["total"] == len(page["rows"]) == n
        assert (
            client.get("/api/runs/nccl-logs/topology/tuning").json()["total"] > 0
        )  # nvidia-nccl-1595 has TUNING lines
    finally:
        cur.close()
