"""One number, one meaning, on every surface: the Markdown report (GET /runs/{run}/report?format=md, what
`commlens report` prints) against the API's own endpoints, over real data in a real store behind a real server.

- bandwidth: the report counts the calls left out, per reason, as /bandwidth's `excluded` does, timed calls or not,
  and states the API's notes;
- the small-message finding: its label names the thresholds its `threshold_bytes` says were used;
- ranks: the run detail's `ranks` counts global ranks; /histograms' `n_ranks` and /ranks' `ranks` count rank keys,
  processes without a global rank included (an NCCL log's host:pid, a trace without distributedInfo), and both say
  so in their notes; the report states the two counts apart.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from test_api_ingest import module_data_dir

from commlens import store
from commlens.backend.api import Settings
from commlens.backend.api.testing import ServerThread
from commlens.ingest.inputs import iter_inputs
from commlens.service.ingest import ingest_run

RUNS = {
    # 16-rank job, rank 0: 75 timed calls (55 naming no group: the world's 16 ranks), 10 zero-byte ones left out
    "nq": ["kineto-hta/negative_queue_length_values_check/rank0.json.gz"],
    # NCCL log excerpt: 3 processes of a 128-rank job, their lines name no global rank
    "log": ["nccl-logs/nvidia-nccl-1193.log"],
    # a trace without distributedInfo: one process, keyed by its file
    "noinfo": ["kineto-hta/distributed_info_unavailable/distributed_info_not_found.json.gz"],
    # ResNet-50 (rank 0 of 2, timed kernels) and the 8-rank DLRM job in one run, as --one-run stores them
    "mixed": ["kineto-hta/nccl_parser_config/nccl_data.json.gz", "kineto-param/dlrm_kineto.tar.gz"],
}


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[httpx.Client]:
    data = module_data_dir(request.config)
    db = tmp_path_factory.mktemp("consistency") / "store.duckdb"
    con = store.connect(db)
    try:
        for run, files in RUNS.items():
            report = ingest_run(con, run, iter_inputs([data / f for f in files]))
            assert not report.failed and {f.status for f in report.files} == {"ok"}, report
    finally:
        con.close()
    with ServerThread(Settings(db=db)) as srv, httpx.Client(base_url=srv.url + "/api", timeout=120) as client:
        yield client


def _get(api: httpx.Client, path: str, **params: str) -> dict:
    r = api.get(path, params=params)
    assert r.status_code == 200, r.text
    return r.json()


def _markdown(api: httpx.Client, run: str) -> str:
    r = api.get(f"/runs/{run}/report", params={"format": "md"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/markdown"), r.text
    return r.text


def _section(md: str, title: str) -> str:
    return md.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


@pytest.mark.parametrize("run", list(RUNS))
def test_the_report_counts_the_calls_bandwidth_leaves_out_as_the_api_does(api: httpx.Client, run: str) -> None:
    bw = _get(api, f"/runs/{run}/bandwidth")
    section = _section(_markdown(api, run), "Bandwidth")
    left = sum(bw["excluded"].values())
    for reason, n in bw["excluded"].items():
        assert f"{n:,} calls: {reason}" in section, (reason, section)
    if bw["calls_with_duration"]:
        assert f"Medians over {bw['calls_with_duration']:,} of {bw['calls_with_duration'] + left:,} calls" in section
        assert ("Left out of bandwidth: " if left else "No call is left out.") in section
        assert all(f"\n- {n}\n" in section for n in bw["notes"]), section
    else:
        assert section.strip() == "\n".join(f"- {n}" for n in bw["notes"])


def test_known_left_out_counts(api: httpx.Client) -> None:
    assert _get(api, "/runs/nq/bandwidth")["excluded"] == {"zero-byte call": 10}
    assert _get(api, "/runs/noinfo/bandwidth")["excluded"] == {"no measured duration": 6}
    mixed = _get(api, "/runs/mixed/bandwidth")
    assert (mixed["calls_with_duration"], mixed["excluded"]) == (85, {})
    section = _section(_markdown(api, "mixed"), "Bandwidth")
    assert "Medians over 85 of 85 calls" in section and "No call is left out." in section
    assert "- 64 measured calls name no process group: their busbw takes the default group's 8 ranks" in section


def test_the_small_message_label_says_the_thresholds_used(api: httpx.Client) -> None:
    [f] = [f for f in _get(api, "/runs/mixed/findings")["items"] if f["id"].startswith("small-messages")]
    ev, text = f["evidence"], f["evidence_text"]
    assert ev["threshold_bytes"] == 1 << 20 and ev["threshold_bytes_min"] == 64 << 10
    # each size the evidence names is in the label, and the label names no other
    assert "below 1 MiB for all_reduce" in ev["threshold"] and "below 64 KiB for all_to_all" in ev["threshold"]
    assert ev["threshold"].count("below ") == 2
    assert (text["threshold_bytes"], text["threshold_bytes_min"], text["threshold"]) == (
        "1 MiB",
        "64 KiB",
        ev["threshold"],
    )
    line = next(x for x in _markdown(api, "mixed").splitlines() if x.startswith("- **[") and "small" in x)
    assert f"threshold={text['threshold']}, threshold_bytes=1 MiB, threshold_bytes_min=64 KiB" in line


@pytest.mark.parametrize(
    ("run", "ranks", "processes"),
    [("log", 0, 3), ("noinfo", 0, 1), ("nq", 1, 0), ("mixed", 8, 0)],
)
def test_ranks_and_processes_agree_across_surfaces(api: httpx.Client, run: str, ranks: int, processes: int) -> None:
    """Global ranks (run detail) + processes without a rank = the rank keys of /ranks and (all calls averaged
    over) of /histograms; where processes are counted, those two say so."""
    detail = _get(api, f"/runs/{run}")
    totals = _get(api, f"/runs/{run}/ranks")
    hist = _get(api, f"/runs/{run}/histograms")
    keys = {r["rank"] for r in totals["rows"]}
    assert detail["ranks"] == ranks == len({k for k in keys if k.lstrip("-").isdigit()})
    assert totals["ranks"] == len(keys) == ranks + processes
    assert hist["n_ranks"] == ranks + processes
    assert detail["n_processes"] == totals["n_processes"] == hist["n_processes"] == processes
    said = [n for n in totals["notes"] if "processes without a global rank" in n]
    hist_said = [n for n in hist["notes"] if "processes without a global rank" in n]
    summary = _get(api, f"/runs/{run}/ranks/summary")
    if processes:
        which = "all" if not ranks else f"{processes:,} of the {ranks + processes:,}"
        assert said == [
            f"{which} ranks of these rows are processes without a global rank (their files name none; keyed by "
            "host:pid or by file): the run's count of ranks counts global ranks only, so it leaves them out"
        ]
        assert hist_said and hist_said[0].startswith(f"{which} ranks averaged over are processes")
        assert said[0] in summary["notes"]  # the ranks page shows the summary's notes
    else:
        assert said == hist_said == []
    head = _markdown(api, run).split("\n## ", 1)[0]
    expected = f"Ranks with calls: {ranks}" + (
        f", and {processes} process(es) without a global rank (their files name none)" if processes else ""
    )
    assert expected in head, head


def test_the_report_json_lists_the_processes(api: httpx.Client) -> None:
    rep = _get(api, "/runs/log/report")
    assert len(rep["processes"]) == 3 and all(":" in p for p in rep["processes"])  # host:pid
    assert sorted(rep["processes"]) == sorted(r["rank"] for r in rep["ranks"]["rows"])
    assert _get(api, "/runs/nq/report")["processes"] == []
