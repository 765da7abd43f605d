"""Collective mismatches found in NCCL logs: a real hang report (ROCm/rccl#429: at one opCount two ranks of a
4-rank job call AllReduce, another AllGather), none in the other real logs, and a communicator whose members
are known by its commId (real INIT lines of nccl-tests#252 with two COLL lines added) checked as it is."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest

from commlens.backend.findings import findings
from commlens.ingest.inputs import iter_inputs
from commlens.service.ingest import ingest_run


def _mismatches(con: duckdb.DuckDBPyConnection, run: str) -> list:
    return [f for f in findings(con, run) if f.id.startswith("collective-mismatch")]


def test_the_rccl_hang_report_is_a_probable_mismatch_and_no_other_log_is(
    con: duckdb.DuckDBPyConnection, data_dir: Path
) -> None:
    report = ingest_run(con, "logs", iter_inputs([data_dir / "nccl-logs"]), split_jobs=True)
    with_mismatch = {job.run: _mismatches(con, job.run) for job in report.jobs}
    assert [run for run, found in with_mismatch.items() if found] == ["logs-rocm-rccl-429"]
    (f,) = with_mismatch["logs-rocm-rccl-429"]
    assert f.severity == "high"
    assert f.title == "Probable collective mismatch: different collectives at opCount 0x28c, 0x28d"
    assert f.evidence == {
        "group": "communicator of 4 ranks (COLL lines only)",
        "members": 2,
        "mismatched_op_counts": 2,
        "first_op_count": "0x28c",
        # the log's own lines: count 9984512 datatype 7 on one process, count 59205120 datatype 0 on the other
        "at_first": "h03r3n06:45006 calls all_reduce(9984512 x float32); "
        "h03r3n06:45012 calls all_gather(59205120 x int8)",
        "inferred_members": "yes",
    }
    assert "inferred" in f.suggestion and "TORCH_DISTRIBUTED_DEBUG=DETAIL" in f.suggestion


def _coll(process: str, comm: str, op: str, count: int) -> str:
    return (
        f"{process}:1 [0] NCCL INFO {op}: opCount 0 sendbuff 0x7f0000000000 recvbuff 0x7f0000000000 count {count} "
        f"datatype 7 op 0 root 0 comm {comm} [nranks=8] stream 0x55000000\n"
    )


@pytest.mark.parametrize(
    ("second", "expected"),
    [
        (("AllReduce", 1024), None),  # agreeing members: nothing to say
        (
            ("AllReduce", 2048),
            "Collective mismatch: one collective with different counts or datatypes at opCount 0x0",
        ),
        (("Broadcast", 1024), "Collective mismatch: different collectives at opCount 0x0"),
    ],
)
def test_members_known_by_their_commid_are_checked_as_one_communicator(
    con: duckdb.DuckDBPyConnection, data_dir: Path, tmp_path: Path, second: tuple[str, int], expected: str | None
) -> None:
    log = tmp_path / "job.log"
    init = (data_dir / "nccl-logs" / "nvidia-nccl-tests-252.log").read_text()  # 8 ranks' INIT lines, one commId
    # rank 4 (kolyoz2:25146, comm 0x559d5aa8ca00) and rank 0 (kolyoz1:27255, comm 0x555de9802860)
    log.write_text(
        init
        + _coll("kolyoz2:25146", "0x559d5aa8ca00", "AllReduce", 1024)
        + _coll("kolyoz1:27255", "0x555de9802860", *second)
    )
    ingest_run(con, "job", iter_inputs([log]))
    found = _mismatches(con, "job")
    if expected is None:
        assert found == []
        return
    (f,) = found
    assert f.title == expected and f.evidence["inferred_members"] == "no"
    assert f.evidence["group"] == "nccl:0x996ee6f117cb8e1e"
    assert f.evidence["at_first"] == (
        f"rank 0 (kolyoz1:27255) calls {second[0].lower().replace('allreduce', 'all_reduce')}({second[1]} x float32); "
        "rank 4 (kolyoz2:25146) calls all_reduce(1024 x float32)"
    )


def test_a_rank_whose_log_stops_early_is_named(tmp_path: Path) -> None:
    """One process's log cut 30 COLL lines before its end, the others whole: the time analysis counted the
    peers' later calls "missing on a member" and no finding said so. The bench's own logs end a few calls apart
    (rank 0 misses its last 4 there): the cut names rank 2 besides, with calls in each of its groups."""
    from nccl_bench import nccl_bench

    from commlens import store

    nccl_bench().write_per_process(tmp_path / "job", 8000, "2.21.5")
    files = sorted((tmp_path / "job").iterdir())
    lines = files[2].read_text().splitlines(keepends=True)
    coll = [i for i, line in enumerate(lines) if "opCount" in line]
    cut = tmp_path / "cut"
    cut.mkdir()
    for f in files:
        (cut / f.name).write_text("".join(lines[: coll[-30]]) if f == files[2] else f.read_text())
    con = store.connect(tmp_path / "x.duckdb")

    def stopped(run: str, folder: Path) -> dict[int, int]:
        assert not ingest_run(con, run, iter_inputs([folder]), split_jobs=True).failed
        found = [f for f in findings(con, run) if f.id.startswith("calls-stop-early:")]
        assert all(f.severity == "medium" and f.view == {"page": "time", "rank": f.evidence["rank"]} for f in found)
        return {int(f.evidence["rank"]): int(f.evidence["missing_calls"]) for f in found}

    whole, cut_short = stopped("whole", tmp_path / "job"), stopped("cut", cut)
    assert whole == {0: 4}
    assert cut_short.pop(2) in range(1, 31) and cut_short == whole
    con.close()
