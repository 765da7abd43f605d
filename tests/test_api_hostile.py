"""Hostile input against a real server with small limits: each case gets a clear answer, the server
stays up, nothing already stored is lost and no spooled upload is left behind."""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import tarfile
import time
import zipfile

import httpx
import pytest

from commlens.backend.api import Settings
from commlens.backend.api.testing import ServerThread, wait_job
from commlens.contract.jobs import JobOut
from commlens.frontend.page_runs import job_view
from commlens.ingest.inputs import Limits

KiB, MiB = 1 << 10, 1 << 20
RUN_JSON = json.dumps(
    {
        "schema": "commlens.run/1",
        "strategy": "ddp",
        "world_size": 2,
        "model": {"layers": 2, "hidden": 32, "heads": 4, "vocab": 128, "seq_len": 16},
        "parallel": {"dp": 2},
    }
).encode()
SETTINGS = {
    "max_file_bytes": 2 * MiB,
    "max_request_bytes": 6 * MiB,
    "max_files_per_request": 5,
    "max_json_body_bytes": 64 * KiB,
    "ingest_limits": Limits(
        max_members=20, ratio_floor_bytes=1 * MiB, max_ratio=50, max_line_bytes=256 * KiB, max_json_depth=64
    ),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    db = tmp_path_factory.mktemp("hostile") / "store.duckdb"
    with ServerThread(Settings(db=db, **SETTINGS)) as srv:  # type: ignore[arg-type]
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            c.post("/api/runs", json={"name": "victim"})
            job = c.post("/api/runs/victim/files", files={"files": ("run.json", RUN_JSON)}).json()
            assert wait_job(c, job["job_id"])["results"][0]["status"] == "ok"
        yield srv


@pytest.fixture
def client(server: ServerThread):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
        # After every case: the server answers, the stored run is intact, nothing is left in the spool.
        assert c.get("/api/health").status_code == 200
        victim = c.get("/api/runs/victim").json()
        ok = c.get("/api/runs/victim/sources", params={"status": "ok"}).json()["items"]
        assert victim["strategy"] == "ddp" and ok[0]["path"] == "run.json"
        deadline = time.monotonic() + 30
        while (
            c.get("/api/jobs", params={"state": "running"}).json()["total"]
            or c.get("/api/jobs", params={"state": "queued"}).json()["total"]
        ):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert os.listdir(server.settings.spool) == []


def problem(r: httpx.Response, status: int, *words: str) -> str:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    detail = r.json()["detail"]
    for w in words:
        assert w in detail, detail
    return detail


def jobs_total(c: httpx.Client) -> int:
    return c.get("/api/jobs").json()["total"]


def upload(c: httpx.Client, files: list[tuple[str, bytes]], run: str = "victim") -> httpx.Response:
    return c.post(f"/api/runs/{run}/files", files=[("files", (n, b)) for n, b in files])


def results(c: httpx.Client, files: list[tuple[str, bytes]]) -> dict[str, dict]:
    r = upload(c, files)
    assert r.status_code == 202, r.text
    job = wait_job(c, r.json()["job_id"])
    assert job["state"] == "done", job
    return {x["path"]: x for x in job["results"]}


def nccl_lines(n: int) -> bytes:
    return b"".join(
        b"node0:100:100 [0] NCCL INFO comm 0x1 rank 0 nranks 2 cudaDev 0 busId 1000 - Init COMPLETE\n" for _ in range(n)
    )


# ----------------------------------------------------------------------------------- sizes


def test_file_over_the_limit_is_413_and_nothing_is_queued(client: httpx.Client) -> None:
    before = jobs_total(client)
    problem(upload(client, [("big.log", nccl_lines(40_000))]), 413, "big.log", "limit")
    assert jobs_total(client) == before


def test_request_over_the_limit_is_413(client: httpx.Client) -> None:
    chunk = nccl_lines(19_000)  # ~1.9 MiB each, four of them
    problem(upload(client, [(f"r{i}.log", chunk) for i in range(4)]), 413, "limit")


def test_too_many_files_is_413(client: httpx.Client) -> None:
    problem(upload(client, [(f"r{i}.json", RUN_JSON) for i in range(6)]), 413, "more than 5 files")


def test_json_bodies_too_large_or_too_deep(client: httpx.Client) -> None:
    problem(client.post("/api/runs", json={"name": "big", "description": "x" * (70 * KiB)}), 413, "limit")
    deep = '{"name": "deep", "config": ' + "[" * 5000 + "]" * 5000 + "}"
    problem(
        client.post("/api/runs", content=deep, headers={"content-type": "application/json"}), 422, "nests 5001 levels"
    )
    problem(
        client.post("/api/predict", content=b'{"model": "\xff\xfe"}', headers={"content-type": "application/json"}),
        422,
        "UTF-8",
    )
    problem(client.post("/api/runs", content=b"{not json", headers={"content-type": "application/json"}), 422)
    # refused before the routes, the problem names the request's path as every other one does
    r = client.post("/api/runs", content=deep, headers={"content-type": "application/json"})
    assert r.json()["instance"] == "/api/runs"
    r = client.post("/api/runs", json={"name": "x"}, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and r.json()["instance"] == "/api/runs", r.text


# --------------------------------------------------------------------------------- formats


def test_unknown_formats_are_415_and_nothing_is_queued(client: httpx.Client) -> None:
    before = jobs_total(client)
    png = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
    detail = problem(
        upload(
            client,
            [
                ("ok.json", RUN_JSON),
                ("pic.png", png),
                ("empty.log", b""),
                ("noise.gz", gzip.compress(random.Random(0).randbytes(4096))),  # any noise: see test_formats
            ],
        ),
        415,
        "pic.png: binary",
        "empty.log: empty file",
        "noise.gz",
        "Nothing",
    )
    assert "ok.json" not in detail
    assert jobs_total(client) == before


def test_text_without_nccl_lines_fails_in_its_job(client: httpx.Client) -> None:
    """Plain text may be a launcher's stdout before NCCL starts, so it is queued; the NCCL parser fails it.
    The job still ends `done`, so its counts (and the dashboard's summary) say nothing was stored."""
    r = upload(client, [("notes.txt", b"hello world\n")])
    job = wait_job(client, r.json()["job_id"])
    out = job["results"][0]
    assert (
        out["status"] == "failed" and "notes.txt:line 1: not a Kineto JSON trace or an NCCL debug log" in out["error"]
    )
    assert (job["state"], job["files_stored"], job["files_failed"], job["files_duplicate"]) == ("done", 0, 1, 0)
    summary = str(job_view(JobOut.model_validate(job)))
    assert "nothing new was stored (1 failed)" in summary, summary
    again = wait_job(client, upload(client, [("ok.json", RUN_JSON), ("notes.txt", b"hello\n")]).json()["job_id"])
    assert (again["files_stored"], again["files_failed"], again["files_duplicate"]) == (0, 1, 1)
    assert "nothing new was stored (1 failed, 1 already stored)" in str(job_view(JobOut.model_validate(again)))


def test_not_multipart_is_415_and_malformed_multipart_is_422(client: httpx.Client) -> None:
    problem(
        client.post("/api/runs/victim/files", content=RUN_JSON, headers={"content-type": "application/json"}),
        415,
        "multipart/form-data",
    )
    body = b'--XYZ\r\nContent-Disposition: form-data; name="files"; filename="a.json"\r\n\r\n' + RUN_JSON  # no end
    problem(
        client.post(
            "/api/runs/victim/files", content=body, headers={"content-type": "multipart/form-data; boundary=XYZ"}
        ),
        422,
    )
    problem(
        client.post(
            "/api/runs/victim/files",
            content=b"--XYZ--\r\n",
            headers={"content-type": "multipart/form-data; boundary=XYZ"},
        ),
        422,
        "no file parts",
    )
    problem(upload(client, [("x.json", RUN_JSON)], run="nope"), 404, "create it first")


def test_a_part_named_only_by_rfc5987_filename_star_is_a_file(client: httpx.Client) -> None:
    """A part whose name is only `filename*=UTF-8''...` (RFC 5987, which some clients send alone) is a file with its
    decoded name; python-multipart does not read it, and the part was dropped ("no file parts") before."""
    assert client.post("/api/runs", json={"name": "star"}).status_code == 201
    body = (
        b"--XYZ\r\nContent-Disposition: form-data; name=\"files\"; filename*=UTF-8''r%C3%A9sum%C3%A9%20run.json\r\n"
        b"Content-Type: application/json\r\n\r\n" + RUN_JSON + b"\r\n--XYZ--\r\n"
    )
    r = client.post("/api/runs/star/files", content=body, headers={"content-type": "multipart/form-data; boundary=XYZ"})
    assert r.status_code == 202, r.text
    job = wait_job(client, r.json()["job_id"])
    assert [(f["upload"], f["status"]) for f in job["results"]] == [("résumé run.json", "ok")], job
    assert client.delete("/api/runs/star").status_code == 204


# -------------------------------------------------------------------------------- archives


def _tar(members: list[tuple[str, bytes | None, str | None]]) -> bytes:
    """(name, data, link target) members; data None with a target makes a symlink."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data, target in members:
            info = tarfile.TarInfo(name)
            if target is not None:
                info.type, info.linkname = tarfile.SYMTYPE, target
                tar.addfile(info)
            else:
                info.size = len(data or b"")
                tar.addfile(info, io.BytesIO(data or b""))
    return buf.getvalue()


def test_hostile_archive_members_fail_alone(client: httpx.Client) -> None:
    tgz = _tar(
        [
            ("../escape.json", RUN_JSON, None),
            ("/abs/root.json", RUN_JSON, None),
            ("link.json", None, "/etc/passwd"),
            ("good/run.json", RUN_JSON, None),
        ]
    )
    zbuf = io.BytesIO()
    with zipfile.ZipFile(zbuf, "w") as z:
        z.writestr("../../zip-escape.json", RUN_JSON)
    out = results(client, [("../../etc/evil.tar.gz", tgz), ("z.zip", zbuf.getvalue())])
    assert out["evil.tar.gz!../escape.json"]["error"].endswith("path escapes the archive ('..')")
    assert out["evil.tar.gz!/abs/root.json"]["error"].endswith("absolute path")
    assert out["evil.tar.gz!link.json"]["error"].endswith("links are not followed")
    assert "path escapes" in out["z.zip!../../zip-escape.json"]["error"]
    good = out["evil.tar.gz!good/run.json"]
    assert good["status"] == "duplicate" and good["upload"] == "evil.tar.gz"  # same bytes as the run's run.json
    assert sum(1 for r in out.values() if r["status"] == "failed") == 4


def test_too_many_members_and_decompression_bomb(client: httpx.Client) -> None:
    many = _tar([(f"m{i}.json", b"{}", None) for i in range(25)])
    bomb = gzip.compress(b'{"traceEvents": [' + b" " * (16 * MiB) + b"]}", compresslevel=9)
    out = results(client, [("many.tar.gz", many), ("bomb.json.gz", bomb)])
    assert "more than 20 members" in out["many.tar.gz"]["error"]
    assert "decompression bomb" in out["bomb.json.gz"]["error"]


def test_deeply_nested_trace_fails_with_its_reason(client: httpx.Client) -> None:
    deep = b'{"traceEvents": [' + b"[" * 100_000 + b"]" * 100_000 + b"]}"
    out = results(client, [("deep.json", deep)])
    assert out["deep.json"]["status"] == "failed" and "nested" in out["deep.json"]["error"], out


COLL = (
    "node0:100:100 [0] NCCL INFO AllReduce: opCount {n} sendbuff 0x7f00 recvbuff 0x7f10 count {count} datatype 7 "
    "op 0 root 0 comm 0x1 [nranks=2] stream 0x99\n"
)


def test_overlong_lines_and_invalid_utf8_are_skipped_not_fatal(client: httpx.Client) -> None:
    lines = [
        b"node0:100:100 [0] NCCL INFO NCCL version 2.18.1+cuda12.1\n",
        nccl_lines(1),
        COLL.format(n=0, count=1024).encode(),
        b"node0:100:100 [0] NCCL INFO " + b"x" * MiB + b"\n",  # line 4
        b"node0:100:100 [0] NCCL INFO \xff\xfe\xfd broken bytes\n",  # line 5: an INFO line of no interest
        COLL.format(n=1, count="10\xff24").encode("latin-1"),  # line 6: a call whose count is not text
        COLL.format(n=2, count=1024).encode(),
    ]
    out = results(client, [("long.log", b"".join(lines))])["long.log"]
    assert out["status"] == "ok" and out["events"] == 2, out  # the two intact calls
    assert out["skipped"] == {f"line longer than {256 * KiB} bytes": 1, "COLL line cut or garbled": 1}, out
    assert any("long.log:line 6" in w and "COLL line cut or garbled" in w for w in out["warnings"]), out
    rows = client.get("/api/runs/victim/export", params={"format": "jsonl", "op": "all_reduce"}).text.splitlines()
    assert [r["msg_bytes"] for r in map(json.loads, rows) if r["file"] == "long.log"] == [4096, 4096]


def test_kineto_trace_with_invalid_utf8_fails_alone_naming_the_file(client: httpx.Client) -> None:
    before = client.get("/api/runs/victim").json()["events"]
    trace = (
        b'{"schemaVersion": 1, "distributedInfo": {"rank": 0, "world_size": 2}, "traceEvents": ['
        b'{"ph": "X", "cat": "kernel", "name": "ncclKernel_AllReduce_\xff\xfe", "pid": 0, "tid": 7, "ts": 1, "dur": 2}]}'
    )
    log = b"node0:100:100 [0] NCCL INFO NCCL version 2.18.1+cuda12.1\n" + COLL.format(n=0, count=2048).encode()
    out = results(client, [("bad-utf8.json", trace), ("other.log", log)])
    bad = out["bad-utf8.json"]
    assert bad["status"] == "failed" and bad["events"] == 0, bad
    assert bad["error"].startswith("bad-utf8.json:$.traceEvents[0]") and "UTF-8" in bad["error"], bad
    assert out["other.log"]["status"] == "ok" and out["other.log"]["events"] == 1  # the other file is stored
    failed = client.get("/api/runs/victim/sources", params={"status": "failed"}).json()["items"]
    assert [s["error"] for s in failed if s["path"] == "bad-utf8.json"] == [bad["error"]]
    assert client.get("/api/runs/victim").json()["events"] == before + 1


# ----------------------------------------------------------------------------------- review


def test_review_anchor_rank_is_bounded_and_stored_items_never_break_the_list(
    client: httpx.Client, server: ServerThread
) -> None:
    problem(client.post("/api/runs/victim/review", json={"body": "x", "anchor": {"rank": 10**20}}), 422, "anchor.rank")
    problem(client.post("/api/runs/victim/review", json={"body": "x", "anchor": {"rank": 2**31}}), 422, "anchor.rank")
    top = client.post("/api/runs/victim/review", json={"body": "top rank", "anchor": {"rank": 2**31 - 1}})
    assert top.status_code == 201, top.text
    problem(client.get("/api/runs/victim/review", params={"rank": 2**31}), 422, "rank")
    problem(client.get("/api/runs/victim/review", params={"rank": 10**20}), 422, "rank")
    # an item stored before the bound existed (or by other means) with a rank no BIGINT holds
    cur = server.app.state.ctx.db.cursor()
    try:
        cur.execute(
            "INSERT INTO review_items (run_id, author, body, anchor) SELECT run_id, 'old', 'legacy', ? "
            "FROM runs WHERE name = 'victim'",
            ['{"view": "ranks", "rank": 100000000000000000000}'],
        )
    finally:
        cur.close()
    r = client.get("/api/runs/victim/review", params={"rank": 1})
    assert r.status_code == 200 and r.json()["total"] == 0, r.text
    r = client.get("/api/runs/victim/review", params={"rank": 2**31 - 1})
    assert [i["body"] for i in r.json()["items"]] == ["top rank"]
    listed = {i["body"]: i for i in client.get("/api/runs/victim/review").json()["items"]}
    assert listed["legacy"]["anchor"] == {
        "view": "ranks",
        "scheme": None,
        "op": None,
        "bin": None,
        "rank": None,
        "free": None,
    }  # the rank that no longer validates is dropped, not a 500
    for item in listed.values():
        assert client.delete(f"/api/review/{item['item_id']}").status_code == 204


# ------------------------------------------------------------------------------ SQL-looking


def test_sql_looking_names_and_filters_are_plain_values(client: httpx.Client) -> None:
    problem(client.get("/api/runs/x' OR '1'='1"), 404)
    problem(client.get("/api/runs/victim; DROP TABLE runs"), 404)
    r = client.get("/api/runs", params={"q": "'; DROP TABLE runs; --", "tag": "' OR 1=1 --"})
    assert r.status_code == 200 and r.json()["total"] == 0
    h = client.get("/api/runs/victim/histograms", params={"dtype": "float32' OR '1'='1"})
    assert h.status_code == 200 and h.json()["series"] == []
    problem(client.get("/api/runs/victim/histograms", params={"scheme": "dp' --"}), 422)
    problem(client.get("/api/runs/victim/histograms", params={"rank": "0 OR 1=1"}), 422)
    assert client.get("/api/runs/victim/review", params={"view": "x' OR '1'='1"}).json()["total"] == 0


def test_csv_export_cells_a_spreadsheet_would_run_are_text(client: httpx.Client) -> None:
    """A file named '=HYPERLINK(...)' ends up as a cell of every colleague's export: it is written with a leading
    apostrophe (text to a spreadsheet); JSON lines keep the name as it is."""
    name = "=HYPERLINK(1)+cmd.log"
    log = b"node9:900:900 [0] NCCL INFO NCCL version 2.18.1+cuda12.1\n" + COLL.format(n=0, count=256).encode()
    assert results(client, [(name, log)])[name]["status"] == "ok"
    csv_rows = client.get("/api/runs/victim/export", params={"format": "csv"}).text.splitlines()
    assert csv_rows[0].startswith('"run",')
    mine = [r for r in csv_rows if "HYPERLINK" in r]
    assert mine and all(f'"\'{name}"' in r and f',"{name}"' not in r for r in mine), mine
    rows = client.get("/api/runs/victim/export", params={"format": "jsonl"}).text.splitlines()
    assert name in {json.loads(r)["file"] for r in rows}


def test_csv_text_of_the_dashboards_tables() -> None:
    from commlens.frontend.components import csv_href
    from commlens.vocab import csv_text

    assert [csv_text(x) for x in ("=1+1", "@SUM(A1)", "+cmd", "-2", "\tx", "rank 0", "")] == [
        "'=1+1",
        "'@SUM(A1)",
        "'+cmd",
        "'-2",
        "'\tx",
        "rank 0",
        "",
    ]
    assert "%27%3DHYPERLINK" in csv_href(["file"], [["=HYPERLINK(1)"]]) and "-3" in csv_href(["n"], [[-3]])


def test_a_review_body_of_only_white_space_is_refused(client: httpx.Client) -> None:
    """Stored as an empty item before (201, body_html ""), though the dashboard refuses it."""
    detail = problem(client.post("/api/runs/victim/review", json={"body": " \n\t "}), 422)
    assert "body" in detail and "only white space" in detail
    item = client.post("/api/runs/victim/review", json={"body": "real words"})
    assert item.status_code == 201, item.text
    assert "only white space" in problem(
        client.patch(f"/api/review/{item.json()['item_id']}", json={"body": "  "}), 422
    )
