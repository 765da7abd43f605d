"""GET /api/runs/{run}/calls: the calls of one histogram bar, with the histogram's own semantics (step is the
profiler step or the detected iteration, scheme 'unattributed', dtype 'unknown', normalisation), over real
uploads to a real server: every bar lists exactly as many calls as it counts."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from test_api_ingest import module_data_dir

from commlens.backend.api import Settings
from commlens.backend.api.testing import ServerThread, wait_job

MiB = 1 << 20
RUNS = {
    # NCCL logs: iterations detected in nvidia-nccl-1238 (4 repeats of one all_reduce), none in the others
    "logs": [
        "nccl-logs/nvidia-nccl-1238.log",
        "nccl-logs/nvidia-nccl-1193.log",
        "nccl-logs/nvidia-nccl-584.log",
        "nccl-logs/rocm-rccl-429.log",
    ],
    "hta": ["kineto-hta/nccl_parser_config/nccl_data.json.gz"],  # profiler steps
}


def synthetic_log() -> bytes:
    """Two ranks of one 2-rank communicator: a setup broadcast, three iterations of (all_gather,
    reduce_scatter) x 2 + all_reduce, and a trailing all_gather: calls outside complete iterations."""
    lines = []
    for rank in range(2):
        pre = f"node{rank}:{100 + rank}:{100 + rank} [{rank}] NCCL INFO"
        lines.append(f"{pre} comm 0xc{rank} rank {rank} nranks 2 cudaDev {rank} busId {rank}000 - Init COMPLETE")
        calls = [("Broadcast", 16, 4)]  # 16 int64
        for _ in range(3):
            calls += [("AllGather", 65536, 7), ("ReduceScatter", 65536, 7)] * 2 + [("AllReduce", 2 * MiB, 7)]
        calls += [("AllGather", 65536, 7)]
        for n, (name, count, dtype) in enumerate(calls):
            lines.append(
                f"{pre} {name}: opCount {n:x} sendbuff 0x1000 recvbuff 0x2000 count {count} datatype {dtype} "
                f"op 0 root 0 comm 0xc{rank} [nranks=2] stream 0x9"
            )
    return ("\n".join(lines) + "\n").encode()


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest):
    data = module_data_dir(request.config)
    db = tmp_path_factory.mktemp("calls") / "store.duckdb"
    uploads = {run: [(Path(f).name, (data / f).read_bytes()) for f in files] for run, files in RUNS.items()}
    uploads["synthetic"] = [("synthetic.log", synthetic_log())]
    with ServerThread(Settings(db=db)) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        for run, files in uploads.items():
            assert c.post("/api/runs", json={"name": run}).status_code == 201
            job = c.post(f"/api/runs/{run}/files", files=[("files", f) for f in files]).json()
            done = wait_job(c, job["job_id"], timeout=120)
            assert done["state"] == "done" and all(r["status"] == "ok" for r in done["results"]), done
        yield c


def bar_params(s: dict, b: dict) -> dict:
    """The /calls selection of a histogram bar: its series (scheme, op, dtype) and its bin."""
    return {"bin": b["key"], "scheme": s["scheme"] or "unattributed", "op": s["op"], "dtype": s["dtype"] or "unknown"}


def calls_of(client: httpx.Client, run: str, **params) -> dict:
    r = client.get(f"/api/runs/{run}/calls", params={"limit": 1000, **params})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("run", ["logs", "hta", "synthetic"])
def test_every_bar_lists_exactly_the_calls_it_counts(client: httpx.Client, run: str) -> None:
    every = calls_of(client, run, normalize="false")
    assert every["total"] == client.get(f"/api/runs/{run}").json()["events"] and every["bin"] is None
    steps = sorted({c["iteration"] for c in every["items"] if c["iteration"] is not None})
    assert steps, "the run has iterations"
    checked = 0
    for normalize in ("false", "true"):
        for step in [None, *steps, 10**6]:
            scope = {"normalize": normalize, **({"step": step} if step is not None else {})}
            h = client.get(f"/api/runs/{run}/histograms", params=scope).json()
            if step == 10**6:
                assert h["series"] == [] and calls_of(client, run, **scope)["total"] == 0
                continue
            iters = set(h["iterations"]["iterations"].values())
            assert len(iters) == 1  # every rank with iterations has as many: one factor turns the bar into calls
            per_rank = h["n_ranks"] * (iters.pop() if step is None else 1)
            factor = {"none": 1, "per_rank": h["n_ranks"], "per_rank_per_iteration": per_rank}[h["normalization"]]
            for s in h["series"]:
                for i, b in enumerate(h["bins"]):
                    if not s["calls"][i]:
                        continue
                    page = calls_of(client, run, **scope, **bar_params(s, b))
                    assert page["total"] == len(page["items"]) == round(s["calls"][i] * factor), (s, b, scope)
                    assert page["total"] == pytest.approx(s["calls"][i] * factor)
                    assert page["bin"] == b and page["iterations_only"] == (
                        h["normalization"] == "per_rank_per_iteration"
                    )
                    for c in page["items"]:
                        assert (c["scheme"], c["op"], c["dtype"]) == (s["scheme"], s["op"], s["dtype"])
                        assert b["lo"] <= c["msg_bytes"] < b["hi"]
                        assert step is None or c["iteration"] == step
                        assert c["iteration"] is not None or not page["iterations_only"]
                    checked += 1
    assert checked >= 6


def test_a_step_of_an_nccl_log_is_its_detected_iteration(client: httpx.Client) -> None:
    """The logs have no profiler steps: the histogram's step 1 is the second detected iteration, and so is the
    step of /calls (export's step is the comms.step column, empty for logs)."""
    h = client.get("/api/runs/logs/histograms", params={"step": 1, "normalize": "false"}).json()
    [s] = h["series"]
    assert (s["op"], s["dtype"], h["n_ranks"], sum(s["calls"])) == ("all_reduce", "float32", 1, 1)
    b = h["bins"][s["calls"].index(1)]
    page = calls_of(client, "logs", step=1, normalize="false", **bar_params(s, b))
    [call] = page["items"]
    assert (call["file"], call["msg_bytes"], call["iteration"], call["step"]) == (
        "nvidia-nccl-1238.log",
        128 * MiB,
        1,
        None,
    )
    assert client.get("/api/runs/logs/export", params={"format": "jsonl", "step": 1}).text == ""


def test_calls_outside_iterations_follow_normalisation(client: httpx.Client) -> None:
    """The setup broadcast and the trailing all_gather are left out of the normalised bars, and listed
    with normalize=false."""
    sel = {"op": "broadcast", "dtype": "int64", "bin": "2^7"}
    assert calls_of(client, "synthetic", **sel)["total"] == 0
    setup = calls_of(client, "synthetic", normalize="false", **sel)
    assert [(c["rank"], c["msg_bytes"], c["iteration"]) for c in setup["items"]] == [(0, 128, None), (1, 128, None)]
    gathers = {"op": "all_gather", "bin": "2^19"}  # S = 2 ranks x 65536 float32
    assert calls_of(client, "synthetic", **gathers)["total"] == 2 * 3 * 2
    assert calls_of(client, "synthetic", normalize="false", **gathers)["total"] == 2 * 3 * 2 + 2


def test_pages_and_refusals(client: httpx.Client) -> None:
    whole = calls_of(client, "synthetic", normalize="false")
    pages, offset = [], 0
    while offset is not None:
        page = client.get(
            "/api/runs/synthetic/calls", params={"normalize": "false", "limit": 7, "offset": offset}
        ).json()
        assert page["total"] == whole["total"] == 34 and page["limit"] == 7
        pages += page["items"]
        offset = page["next_offset"]
    assert pages == whole["items"]
    assert [(c["file"], c["rank"]) for c in pages] == sorted((c["file"], c["rank"]) for c in pages)
    for params, words in (
        ({"bin": "2^63"}, "0 <= k <= 62"),
        ({"bin": "2^x"}, "bin"),
        ({"scheme": "nope"}, "scheme"),
        ({"rank": -1}, "rank"),
        ({"limit": 0}, "limit"),
    ):
        r = client.get("/api/runs/synthetic/calls", params=params)
        assert r.status_code == 422 and r.headers["content-type"].startswith("application/problem+json"), r.text
        assert words in r.json()["detail"], r.json()
    r = client.get("/api/runs/ghost/calls")
    assert r.status_code == 404 and "no run named 'ghost'" in r.json()["detail"]


def test_unattributed_selects_the_same_calls_in_histograms_calls_and_export(tmp_path: Path, data_dir: Path) -> None:
    """The DLRM job's calls have no process group: `scheme=unattributed` is their series in /histograms, their
    rows in /calls and /export alike (it was a 422 on /histograms and /export, so they could not be selected)."""
    archive = data_dir / "kineto-param" / "dlrm_kineto.tar.gz"
    with ServerThread(Settings(db=tmp_path / "s.duckdb")) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        assert c.post("/api/runs", json={"name": "dlrm"}).status_code == 201
        job = c.post("/api/runs/dlrm/files", files=[("files", (archive.name, archive.read_bytes()))]).json()
        assert wait_job(c, job["job_id"], timeout=120)["state"] == "done"
        params = {"scheme": "unattributed", "normalize": "false"}
        hist = c.get("/api/runs/dlrm/histograms", params=params)
        assert hist.status_code == 200, hist.text
        series = hist.json()["series"]
        assert series and {s["scheme"] for s in series} == {None}
        counted = sum(s["total_calls"] for s in series)
        listed = c.get("/api/runs/dlrm/calls", params={**params, "limit": 1}).json()["total"]
        exported = c.get("/api/runs/dlrm/export", params={"scheme": "unattributed", "format": "jsonl"})
        assert exported.status_code == 200, exported.text
        rows = exported.text.splitlines()
        assert counted == listed == len(rows) > 0
        everything = c.get("/api/runs/dlrm/export", params={"format": "jsonl"}).text.splitlines()
        assert len(everything) == len(rows)  # every call of this run is unattributed
        assert c.get("/api/runs/dlrm/histograms", params={"scheme": "dp"}).json()["series"] == []
