"""Property-based run over the OpenAPI schema (schemathesis): generated requests never get a 5xx."""

from __future__ import annotations

import json

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the test extra")
import requests  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402

from commlens.backend.api import Settings  # noqa: E402
from commlens.backend.api.testing import ServerThread, wait_job  # noqa: E402

RUN_JSON = {
    "schema": "commlens.run/1",
    "strategy": "ddp",
    "world_size": 2,
    "model": {"layers": 2, "hidden": 32, "heads": 4, "vocab": 128, "seq_len": 16},
    "parallel": {"dp": 2},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    db = tmp_path_factory.mktemp("schema") / "store.duckdb"
    with ServerThread(Settings(db=db)) as srv, httpx.Client(base_url=srv.url) as c:
        c.post("/api/runs", json={"name": "fuzz", "tags": ["fuzz"]})
        job = c.post("/api/runs/fuzz/files", files={"files": ("run.json", json.dumps(RUN_JSON).encode())}).json()
        wait_job(c, job["job_id"])
        c.post("/api/runs/fuzz/review", json={"body": "seed item"})
        yield srv


def test_no_server_errors(server: ServerThread) -> None:
    """Every operation, with generated path/query/body values (hypothesis strategies from the schema)."""
    schema = schemathesis.openapi.from_url(server.url + "/api/openapi.json")
    failures: list[str] = []
    operations = 0
    with requests.Session() as session:
        for result in schema.get_all_operations():
            op = result.ok()
            operations += 1

            @given(case=op.as_strategy())
            @settings(
                max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
            )
            def check(case) -> None:
                response = case.call(base_url=server.url, session=session, timeout=30)
                if response.status_code >= 500:
                    failures.append(
                        f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:300]}"
                    )

            check()
    assert operations >= 20
    assert failures == []
    assert httpx.get(server.url + "/api/health").status_code == 200


def test_schema_documents_problem_details(server: ServerThread) -> None:
    spec = httpx.get(server.url + "/api/openapi.json").json()
    assert {"title", "status", "detail", "type"} <= set(spec["components"]["schemas"]["Problem"]["properties"])
    upload = spec["paths"]["/api/runs/{run}/files"]["post"]
    assert "multipart/form-data" in upload["requestBody"]["content"]
    assert {"413", "415"} <= set(upload["responses"])
