"""One run per job: files of several jobs are split into runs, files of one job stay one run (real data)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import duckdb
import pytest

from commlens import store
from commlens.ingest.inputs import InputFile, iter_inputs
from commlens.service.ingest import ingest_run
from commlens.service.jobs_split import FileEvidence, split_jobs


def _runs(con: duckdb.DuckDBPyConnection) -> dict[str, list[str]]:
    """Each run with the names of its ingested files."""
    rows = con.execute(
        "SELECT r.name, s.path FROM runs r JOIN sources s USING (run_id) WHERE s.status = 'ok' ORDER BY 1, 2"
    ).fetchall()
    out: dict[str, list[str]] = {}
    for run, path in rows:
        out.setdefault(run, []).append(Path(path.split("!")[-1]).name)
    for files in out.values():
        files.sort()
    return out


NOTHING_SHARED = "nothing shows they are one job (no shared communicator, rank or time)"


def test_nccl_log_excerpts_are_not_one_run(con: duckdb.DuckDBPyConnection, data_dir: Path) -> None:
    report = ingest_run(con, "logs", iter_inputs([data_dir / "nccl-logs"]), split_jobs=True)
    runs = _runs(con)
    assert len(report.jobs) == 19 and len(runs) == 19
    assert all(len(files) == 1 for files in runs.values())  # no two excerpts share a job
    # the first file (aws-65) has INIT lines and no call: the run keeps the first job with calls, 1193's
    assert runs["logs"] == ["nvidia-nccl-1193.log"] and runs["logs-aws-aws-ofi-nccl-65"] == ["aws-aws-ofi-nccl-65.log"]
    assert con.execute("SELECT world_size FROM runs WHERE name = 'logs'").fetchone() == (128,)
    job = next(j for j in report.jobs if j.run == "logs-nvidia-nccl-1357")
    assert job.apart == ["world size 128 vs 16"]  # against the run's job, 1193's
    assert [j.run for j in report.jobs if j.apart == [NOTHING_SHARED]][:1] == ["logs-aws-aws-ofi-nccl-65"]
    # 1193's four all-reduce calls and 203's seven are each in their own run, counted once
    calls = dict(con.execute("SELECT run, count(*) FROM comms GROUP BY 1").fetchall())
    assert calls["logs"] == 4 and calls["logs-nvidia-nccl-203"] == 7


def test_hta_directory_is_split_by_world_size_rank_and_time(con: duckdb.DuckDBPyConnection, data_dir: Path) -> None:
    report = ingest_run(con, "hta", iter_inputs([data_dir / "kineto-hta"]), split_jobs=True)
    runs = _runs(con)
    assert runs == {
        "hta": ["df_index_resolver.json.gz"],
        "hta-distributed_info_not_found": ["distributed_info_not_found.json.gz"],
        "hta-nccl_data": ["nccl_data.json.gz"],
        "hta-rank-0.Apr_03_18_51_38.1102": ["rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz"],
        "hta-rank0": ["rank0.json.gz"],
        # rank 0 without a world size and rank 3 of 8, recorded over the same step at the same time
        "hta-rank_non_gpu": ["control.json.gz", "rank_non_gpu.json.gz"],
    }
    apart = {j.run: j.apart for j in report.jobs}
    assert apart["hta-rank0"] == ["world size 2 vs 16"]
    assert apart["hta-nccl_data"] == ["recorded 2022-11-30 04:48 UTC vs 2024-05-23 00:15 UTC"]
    # the four rank-0 traces are in four runs, so no rank-0 trace was refused as a second trace of its rank
    assert not report.failed
    rank0 = con.execute("SELECT count(DISTINCT run) FROM comms WHERE rank = 0").fetchone()
    assert rank0 == (4,)


def test_dlrm_job_of_eight_ranks_stays_one_run(con: duckdb.DuckDBPyConnection, data_dir: Path) -> None:
    report = ingest_run(con, "dlrm", iter_inputs([data_dir / "kineto-param/dlrm_kineto.tar.gz"]), split_jobs=True)
    assert [j.run for j in report.jobs] == ["dlrm"]
    assert report.jobs[0].ranks == frozenset(range(8))
    assert report.jobs[0].joined_by == ["ranks of one world, running at the same time"]
    assert con.execute("SELECT count(*), count(DISTINCT rank) FROM comms WHERE run = 'dlrm'").fetchone() == (64, 8)


def _ev(path: str, **kw: object) -> FileEvidence:
    fields: dict[str, object] = {
        "kind": "nccl_log",
        "world_size": None,
        "ranks": frozenset(),
        "comm_ids": frozenset(),
        "hosts": frozenset(),
        "span_us": None,
        "calls": 1,
    }
    fields.update(kw)
    return FileEvidence(path, **fields)  # type: ignore[arg-type]


def test_a_shared_communicator_joins_hosts_and_a_conflict_keeps_jobs_apart() -> None:
    host_a = _ev("a.log", world_size=16, ranks=frozenset(range(8)), comm_ids=frozenset({"0x1"}), hosts=frozenset({"a"}))
    host_b = _ev("b.log", world_size=16, ranks=frozenset(range(8, 16)), comm_ids=frozenset({"0x1"}))
    other = _ev("c.log", world_size=8, comm_ids=frozenset({"0x1"}))  # same id, another world size: not joined
    config = _ev("run.json", kind="run_config", calls=0, world_size=16)
    jobs = split_jobs("x", [config, host_a, host_b, other])
    assert [(j.run, [f.path for f in j.files]) for j in jobs] == [
        ("x", ["run.json", "a.log", "b.log"]),
        ("x-c", ["c.log"]),
    ]
    assert jobs[0].joined_by == ["communicator 0x1 in both"] and jobs[1].apart == ["world size 16 vs 8"]
    # the same rank twice is two jobs even at the same time
    t = (1.7e15, 1.7e15 + 10)
    twice = split_jobs(
        "y", [_ev("r0.json", ranks=frozenset({0}), span_us=t), _ev("r0b.json", ranks=frozenset({0}), span_us=t)]
    )
    assert [j.run for j in twice] == ["y", "y-r0b"] and twice[1].apart == ["rank 0 in both"]
    # a rank's Flight Recorder dump and its profiler trace are one process seen from two sides: one job (a
    # `--hang` run's directory was split in two, "rank 0-1 in both", the hang and the time analysis apart)
    side = [
        _ev(f"{name}.rank{r}", kind=kind, ranks=frozenset({r}), span_us=t)
        for kind, name in (("flight_recorder", "fr"), ("kineto", "trace"))
        for r in (0, 1)
    ]
    (one,) = split_jobs("z", side)
    assert (one.run, [f.path for f in one.files]) == ("z", ["fr.rank0", "fr.rank1", "trace.rank0", "trace.rank1"])


def test_the_same_nccl_processes_in_two_files_are_one_job_and_the_copy_is_refused(
    con: duckdb.DuckDBPyConnection, tmp_path: Path
) -> None:
    """A job's logs and the same lines gathered into another file (a CRLF copy, a scheduler's combined output):
    the rank conflict made the copy a run of its own, the whole job stored twice under another name."""
    from nccl_bench import nccl_bench

    log = tmp_path / "job.log"
    nccl_bench().write_interleaved(log, 4_000, "2.21.5")
    copy = tmp_path / "slurm-1234.out"
    copy.write_bytes(log.read_bytes().replace(b"\n", b"\r\n"))
    report = ingest_run(con, "job", iter_inputs([log, copy]), split_jobs=True)
    assert [j.run for j in report.jobs] == ["job"]
    assert [(f.path.rsplit("/", 1)[-1], f.status) for f in report.files] == [
        ("job.log", "ok"),
        ("slurm-1234.out", "failed"),
    ]
    assert "is already in this run from" in str(report.files[1].error)
    assert _runs(con) == {"job": ["job.log"]}


def _commlens(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "commlens.cli", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "400"},
    )


@pytest.mark.parametrize("one_run", [False, True])
def test_cli_prints_what_went_where_and_one_run_merges(tmp_path: Path, data_dir: Path, one_run: bool) -> None:
    db = tmp_path / "s.duckdb"
    files = [str(data_dir / "nccl-logs" / f) for f in ("nvidia-nccl-1193.log", "nvidia-nccl-203.log")]
    proc = _commlens("ingest", *files, "--db", str(db), "--run", "pair", *(["--one-run"] if one_run else []))
    assert proc.returncode == 0, proc.stderr
    con = duckdb.connect(str(db), read_only=True)
    runs = sorted(r[0] for r in con.execute("SELECT name FROM runs").fetchall())
    if one_run:
        assert runs == ["pair"] and "jobs" not in proc.stdout
    else:
        assert runs == ["pair", "pair-nvidia-nccl-203"]
        assert "The files are of 2 jobs: each is a run of its own (--one-run stores them all in pair)." in proc.stdout
        assert "pair-nvidia-nccl-203" in proc.stdout and "world size 128" in proc.stdout


def _calls(con: duckdb.DuckDBPyConnection) -> dict[str, int]:
    return dict(con.execute("SELECT run, count(*) FROM comms GROUP BY 1").fetchall())


def test_the_same_files_again_in_another_order_are_duplicates_where_they_are(
    con: duckdb.DuckDBPyConnection, data_dir: Path
) -> None:
    logs = [data_dir / "nccl-logs" / f for f in ("nvidia-nccl-203.log", "nvidia-nccl-584.log")]
    ingest_run(con, "x", iter_inputs(logs), split_jobs=True)
    before = _runs(con), _calls(con)
    assert before[0] == {"x": ["nvidia-nccl-203.log"], "x-nvidia-nccl-584": ["nvidia-nccl-584.log"]}
    # the split of the second ingest would put 584 first, into x: it stays in the run that holds it
    report = ingest_run(con, "x", iter_inputs(logs[::-1]), split_jobs=True)
    assert [(f.status, f.run) for f in report.files] == [("duplicate", "x-nvidia-nccl-584"), ("duplicate", "x")]
    assert (_runs(con), _calls(con)) == before


def test_a_folder_or_an_archive_of_files_stored_before_adds_none_of_them_again(
    con: duckdb.DuckDBPyConnection, data_dir: Path, tmp_path: Path
) -> None:
    folder = data_dir / "nccl-logs"
    ingest_run(con, "logs", iter_inputs([folder / "nvidia-nccl-584.log"]), split_jobs=True)
    ingest_run(con, "logs", iter_inputs([folder]), split_jobs=True)
    calls = _calls(con)
    assert [run for run, files in _runs(con).items() if "nvidia-nccl-584.log" in files] == ["logs"]
    # and no other job joins it: the run's job is 584's, as if the folder had been ingested in one go (the first
    # new job, aws-65, which nothing shows is 584's job, took the name before)
    assert _runs(con)["logs"] == ["nvidia-nccl-584.log"]
    fresh = store.connect(tmp_path / "fresh.duckdb")  # the folder alone: every call once
    ingest_run(fresh, "logs", iter_inputs([folder]), split_jobs=True)
    assert sum(calls.values()) == sum(_calls(fresh).values())
    fresh.close()
    archive = tmp_path / "logs.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname="nccl-logs")
    before = _runs(con), calls
    report = ingest_run(con, "logs", iter_inputs([archive]), split_jobs=True)
    assert {f.status for f in report.files if f.status != "skipped"} == {"duplicate"}
    assert (_runs(con), _calls(con)) == before


def test_the_same_file_in_a_run_of_another_name_is_stored_there(con: duckdb.DuckDBPyConnection, data_dir: Path) -> None:
    log = data_dir / "nccl-logs" / "nvidia-nccl-203.log"
    ingest_run(con, "a", iter_inputs([log]), split_jobs=True)
    report = ingest_run(con, "b", iter_inputs([log]), split_jobs=True)
    assert [(f.status, f.run) for f in report.files] == [("ok", "b")]
    assert _calls(con) == {"a": 7, "b": 7}


def _dlrm_members(data_dir: Path) -> dict[str, InputFile]:
    return {
        Path(i.name.split("!")[-1]).name[:7]: i for i in iter_inputs([data_dir / "kineto-param/dlrm_kineto.tar.gz"])
    }


def test_a_later_ingest_of_another_job_into_a_run_goes_to_a_run_of_its_own(
    con: duckdb.DuckDBPyConnection, data_dir: Path
) -> None:
    one = data_dir / "kineto-hta/ns_resolution_trace/rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz"  # world size 1
    ingest_run(con, "mix", iter_inputs([one]), split_jobs=True)
    report = ingest_run(con, "mix", [_dlrm_members(data_dir)["worker1"]], split_jobs=True)  # world size 8
    assert [(j.run, j.apart) for j in report.jobs] == [
        ("mix-worker1_step_12.1694128201556", ["world size 1 vs 8 (run mix holds files of another job)"])
    ]
    assert report.split and [f.run for f in report.files] == ["mix-worker1_step_12.1694128201556"]
    assert _calls(con) == {"mix": 35, "mix-worker1_step_12.1694128201556": 8}


def test_ranks_of_one_job_ingested_one_by_one_stay_one_run(con: duckdb.DuckDBPyConnection, data_dir: Path) -> None:
    members = _dlrm_members(data_dir)
    for name in ("worker0", "worker1", "worker5"):
        report = ingest_run(con, "dlrm", [members[name]], split_jobs=True)
        assert not report.split and [f.status for f in report.files] == ["ok"]
    assert con.execute("SELECT count(DISTINCT rank) FROM comms WHERE run = 'dlrm'").fetchone() == (3,)
    assert list(_runs(con)) == ["dlrm"]


def test_a_file_again_into_a_run_stored_with_one_run_is_a_duplicate_and_nothing_else(
    con: duckdb.DuckDBPyConnection, data_dir: Path
) -> None:
    """A run stored with --one-run holds two jobs (world sizes 1 and 2); one of its files again is a duplicate
    where it is: no run is made for it (an empty one was, named as if the file had gone there)."""
    logs = [data_dir / "nccl-logs" / f for f in ("nvidia-nccl-1238.log", "nvidia-nccl-584.log")]
    ingest_run(con, "both", iter_inputs(logs))  # one run, as --one-run stores them
    before = _runs(con), _calls(con)
    report = ingest_run(con, "both", iter_inputs(logs[:1]), split_jobs=True)
    assert not report.split and [j.run for j in report.jobs] == ["both"]
    assert [(f.status, f.run) for f in report.files] == [("duplicate", "both")]
    assert (_runs(con), _calls(con)) == before
    assert con.execute("SELECT list(name) FROM runs").fetchone() == (["both"],)


def test_split_names_keep_to_a_run_names_length() -> None:
    """A 128-character run and a 200-character file name made a 329-character run, which the API then refused
    in every other place (?run=, POST /api/runs): split names are cut, with their number inside the limit."""
    from commlens.contract.runs import MAX_RUN_NAME, RUN_NAME_PATTERN

    run = "L" * MAX_RUN_NAME
    jobs = split_jobs(
        run, [_ev("a.log", comm_ids=frozenset({"1"})), _ev("s" * 200 + ".log", comm_ids=frozenset({"2"}))]
    )
    assert [j.run for j in jobs] == [run, "L" * (MAX_RUN_NAME - 2) + "-2"]
    assert all(re.fullmatch(RUN_NAME_PATTERN, j.run) for j in jobs)


def test_a_file_without_calls_does_not_keep_the_runs_name_from_the_calls() -> None:
    """An upload of a trace with no communication first, then a log with calls: the run named by the user kept
    the empty trace and the calls went to `up2-...`."""
    empty = _ev("nocomm.json", kind="kineto", calls=0)
    log = _ev("train.log", comm_ids=frozenset({"0x1"}), calls=7)
    jobs = split_jobs("up2", [empty, log])
    assert [(j.run, [f.path for f in j.files]) for j in jobs] == [
        ("up2", ["train.log"]),
        ("up2-nocomm", ["nocomm.json"]),
    ]
