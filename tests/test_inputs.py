"""Inputs, archives, hostile files and the store's per-file atomicity (independent of the trace parsers)."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
import zipfile
from pathlib import Path

import duckdb
import pytest

from commlens import store
from commlens.ingest.inputs import Limits, file_rank_hint, iter_inputs
from commlens.service.ingest import ingest_paths


def _run_json(world_size: int = 2, strategy: str = "ddp") -> bytes:
    return json.dumps(
        {
            "schema": "commlens.run/1",
            "strategy": strategy,
            "world_size": world_size,
            "model": {"layers": 2, "hidden": 32, "heads": 4, "vocab": 128, "seq_len": 16},
            "parallel": {"dp": world_size},
            "groups": [{"dim": "dp", "ranks": list(range(world_size)), "pg_name": "0", "backend": "gloo"}],
        }
    ).encode()


def _outcomes(summary) -> dict[str, tuple[str, str | None]]:
    return {Path(f.path.split("!")[-1]).name: (f.status, f.error) for f in summary.files}


def test_empty_binary_and_unknown_files_fail_with_file_and_place(tmp_path: Path, con) -> None:
    tmp_path = tmp_path / "in"
    tmp_path.mkdir()
    (tmp_path / "empty.json").write_bytes(b"")
    (tmp_path / "junk.bin").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "notes.txt").write_text("just some text\nwith no trace in it\n")
    summary = ingest_paths(con, [tmp_path], "bad")
    out = _outcomes(summary)
    assert out["empty.json"][0] == "failed" and out["empty.json"][1].endswith("empty.json: empty file")
    assert (
        out["junk.bin"][0] == "failed"
        and "binary data" in out["junk.bin"][1]
        and "junk.bin:byte 0" in out["junk.bin"][1]
    )
    assert out["notes.txt"][0] == "failed" and "not a Kineto JSON trace or an NCCL debug log" in out["notes.txt"][1]
    rows = con.execute("SELECT path, status, error FROM sources ORDER BY path").fetchall()
    assert [r[1] for r in rows] == ["failed"] * 3 and all(r[2] for r in rows)


def test_truncated_gzip_names_the_file(tmp_path: Path, con) -> None:
    blob = gzip.compress(_run_json() * 1)
    (tmp_path / "cut.json.gz").write_bytes(blob[: len(blob) // 2])
    summary = ingest_paths(con, [tmp_path / "cut.json.gz"], "gz")
    (outcome,) = summary.files
    assert outcome.status == "failed"
    assert outcome.error.startswith(str(tmp_path / "cut.json.gz"))
    assert "truncated gzip" in outcome.error or "corrupt gzip" in outcome.error


def test_gzip_decompression_bomb_is_refused(tmp_path: Path, con) -> None:
    bomb = tmp_path / "bomb.json.gz"
    with gzip.open(bomb, "wb", compresslevel=9) as f:
        f.write(b'{"traceEvents": [' + b" " * (8 << 20))
    limits = Limits(ratio_floor_bytes=1 << 20, max_ratio=50)
    summary = ingest_paths(con, [bomb], "bomb", limits=limits)
    (outcome,) = summary.files
    assert outcome.status == "failed" and "decompression bomb" in outcome.error


def test_archive_traversal_links_and_bombs_are_refused_member_by_member(tmp_path: Path, con) -> None:
    archive = tmp_path / "evil.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in (
            ("../escape.json", _run_json()),
            ("/abs/run.json", _run_json()),
            ("ok/run.json", _run_json()),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("ok/link.json")
        link.type = tarfile.SYMTYPE
        link.linkname = "/etc/passwd"
        tar.addfile(link)
        big = b" " * (4 << 20)
        info = tarfile.TarInfo("ok/bomb.json")
        info.size = len(big)
        tar.addfile(info, io.BytesIO(big))
    limits = Limits(ratio_floor_bytes=1 << 20, max_ratio=50)
    summary = ingest_paths(con, [archive], "evil", limits=limits)
    by_member = {f.path.split("!", 1)[1]: f for f in summary.files}
    assert "path escapes the archive" in by_member["../escape.json"].error
    assert "absolute path" in by_member["/abs/run.json"].error
    assert "links are not followed" in by_member["ok/link.json"].error
    assert "decompression bomb" in by_member["ok/bomb.json"].error
    assert by_member["ok/run.json"].status == "ok"
    assert not (tmp_path.parent / "escape.json").exists()


def test_zip_members_and_zip_traversal(tmp_path: Path, con) -> None:
    archive = tmp_path / "runs.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("a/run.json", _run_json(4, "dp4"))
        zf.writestr("../../evil.json", _run_json())
    summary = ingest_paths(con, [archive], "zipped")
    by_member = {f.path.split("!", 1)[1]: f for f in summary.files}
    assert by_member["a/run.json"].status == "ok"
    assert by_member["../../evil.json"].status == "failed"
    assert con.execute("SELECT strategy, world_size FROM runs WHERE name = 'zipped'").fetchone() == ("dp4", 4)


def test_too_many_members(tmp_path: Path) -> None:
    archive = tmp_path / "many.tar"
    with tarfile.open(archive, "w") as tar:
        for i in range(5):
            info = tarfile.TarInfo(f"f{i}.log")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    items = list(iter_inputs([archive], Limits(max_members=3)))
    assert items[-1].error == "archive has more than 3 members"


def test_corrupt_archive_is_an_error_not_a_crash(tmp_path: Path, con) -> None:
    tmp_path = tmp_path / "in"
    tmp_path.mkdir()
    (tmp_path / "broken.tar.gz").write_bytes(gzip.compress(b"not a tar at all" * 100)[:50])
    (tmp_path / "broken.zip").write_bytes(b"PK\x03\x04garbage")
    summary = ingest_paths(con, [tmp_path], "broken")
    assert [f.status for f in summary.files] == ["failed", "failed"]
    assert all("archive" in f.error for f in summary.files)


@pytest.mark.parametrize(
    ("mode", "failed", "error"),
    [
        # tarfile finds a plain tar short when it reads the next header: the cut is placed after the last whole member
        ("w", "cut.tar", "cut.tar: archive is truncated or corrupt after member first.log (the last read whole)"),
        ("w:gz", "cut.tar.gz!second.log", "second.log: archive is truncated or corrupt in this member (1704 bytes"),
    ],
)
def test_an_archive_cut_short_says_where(
    tmp_path: Path, con, data_dir: Path, mode: str, failed: str, error: str
) -> None:
    """A tar (plain or gzipped) cut inside its second member: the first member is stored, the failure says which
    member the cut lost or follows (it named only the archive, not what of it was lost)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tar:  # type: ignore[call-overload]
        for name, log in (("first.log", "nvidia-nccl-1238.log"), ("second.log", "nvidia-nccl-203.log")):
            tar.add(data_dir / "nccl-logs" / log, arcname=name)
    whole = buf.getvalue()
    cut = tmp_path / ("cut.tar.gz" if mode == "w:gz" else "cut.tar")
    first = (data_dir / "nccl-logs" / "nvidia-nccl-1238.log").stat().st_size
    # plain: 700 bytes into the second member (a 512-byte header, then data in 512-byte blocks, for each member)
    cut.write_bytes(whole[: len(whole) * 3 // 4] if mode == "w:gz" else whole[: 512 + -(-first // 512) * 512 + 700])
    summary = ingest_paths(con, [cut], "cut")
    assert [(Path(f.path).name, f.status) for f in summary.files] == [
        (f"{cut.name}!first.log", "ok"),
        (failed, "failed"),
    ]
    assert error in summary.files[1].error, summary.files[1].error


def test_failed_file_rolls_back_alone_and_reingest_is_a_noop(tmp_path: Path, con) -> None:
    good = tmp_path / "run.json"
    good.write_bytes(_run_json())
    first = ingest_paths(con, [good], "r1")
    assert [f.status for f in first.files] == ["ok"]
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"schema": "commlens.run/1", "strategy": "ddp", "world_size": "two"}')
    second = ingest_paths(con, [bad, good], "r1")
    statuses = {Path(f.path).name: f.status for f in second.files}
    assert statuses == {"bad.json": "failed", "run.json": "duplicate"}
    bad_err = next(f.error for f in second.files if f.path.endswith("bad.json"))
    assert "$.world_size" in bad_err or "$.model" in bad_err
    counts = con.execute("SELECT status, count(*) FROM sources GROUP BY status ORDER BY status").fetchall()
    assert counts == [("failed", 1), ("ok", 1)]
    assert con.execute("SELECT count(*) FROM process_groups").fetchone()[0] == 1


def test_store_refuses_foreign_db_and_newer_schema(tmp_path: Path) -> None:
    foreign = tmp_path / "other.duckdb"
    c = duckdb.connect(str(foreign))
    c.execute("CREATE TABLE x (a INT)")
    c.close()
    with pytest.raises(store.StoreError, match="not a commlens store"):
        store.connect(foreign)
    newer = tmp_path / "newer.duckdb"
    c = store.connect(newer)
    c.execute("UPDATE meta SET value = '999' WHERE key = 'schema_version'")
    c.close()
    with pytest.raises(store.StoreError, match="newer than this commlens"):
        store.connect(newer)


def test_comms_view_has_exactly_the_contract_columns(con) -> None:
    cols = [r[0] for r in con.execute("DESCRIBE comms").fetchall()]
    assert cols == [
        "run",
        "rank",
        "op",
        "dtype",
        "msg_bytes",
        "elems_in",
        "elems_out",
        "group_size",
        "group_key",
        "scheme",
        "peer",
        "step",
        "ts_us",
        "dur_us",
        "source_kind",
        "file",
    ]


@pytest.mark.parametrize(
    ("name", "rank"),
    [
        ("rank-3.json.gz", 3),
        ("trace_rank_12.json", 12),
        ("worker5_step_12.1694.pt.trace.json", 5),
        ("a.tar.gz!dir/rank0.json", 0),
        ("host_1234.1700.pt.trace.json", None),
    ],
)
def test_rank_from_file_name(name: str, rank: int | None) -> None:
    assert file_rank_hint(name) == rank


def test_directory_walk_passes_over_documentation_but_named_files_are_tried(tmp_path: Path, con) -> None:
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "run.json").write_bytes(_run_json())
    (folder / "NOTES.md").write_text("We saw `NCCL INFO` lines in the log.\n")
    summary = ingest_paths(con, [folder], "walk")
    by_name = {Path(f.path).name: f for f in summary.files}
    assert by_name["run.json"].status == "ok"
    assert by_name["NOTES.md"].status == "skipped" and "passed over" in by_name["NOTES.md"].error
    assert con.execute("SELECT count(*) FROM sources WHERE path LIKE '%NOTES.md'").fetchone()[0] == 0
    named = ingest_paths(con, [folder / "NOTES.md"], "walk")
    assert named.files[0].status == "failed"  # a file named explicitly is parsed, and fails clearly


# --------------------------------------------------- files that break a parser or the store in odd ways


def _kineto_with(distributed: dict, events: list[dict]) -> bytes:
    return json.dumps({"schemaVersion": 1, "distributedInfo": distributed, "traceEvents": events}).encode()


_ALLREDUCE = {
    "ph": "X",
    "cat": "cpu_op",
    "name": "record_param_comms",
    "pid": 1,
    "tid": 1,
    "ts": 10,
    "dur": 5,
    "args": {
        "Collective name": "allreduce",
        "dtype": "Float",
        "In msg nelems": 4,
        "Out msg nelems": 4,
        "Group size": 2,
        "Process Group Name": "0",
        "Rank": 0,
    },
}


@pytest.mark.parametrize(
    "name, content, needle",
    [
        (
            "huge-rank.json",
            _kineto_with({"rank": 10**12, "world_size": 2, "backend": "nccl"}, [_ALLREDUCE]),
            "$.distributedInfo.rank: rank 1000000000000 is outside 0..2147483647",
        ),
        (
            "list-ext.json",
            _kineto_with(
                {"rank": 0, "world_size": 2, "backend": "nccl"},
                [
                    dict(_ALLREDUCE, args=dict(_ALLREDUCE["args"], **{"External id": 7})),
                    {
                        "ph": "X",
                        "cat": "kernel",
                        "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
                        "pid": 0,
                        "tid": 7,
                        "ts": 11,
                        "dur": 2,
                        "args": {"External id": [7]},
                    },
                ],
            ),
            "unexpected TypeError in the kineto parser",
        ),
        (
            "huge-nelems.json",
            _kineto_with(
                {"rank": 0, "world_size": 2, "backend": "nccl"},
                [dict(_ALLREDUCE, args=dict(_ALLREDUCE["args"], **{"In msg nelems": 1e30, "Out msg nelems": 1e30}))],
            ),
            "a value does not fit the store (OverflowError",
        ),
        (
            "huge-count.log",
            b"host:1:2 [0] NCCL INFO AllReduce: opCount 0 sendbuff 0x1 recvbuff 0x2 count "
            b"99999999999999999999999 datatype 7 op 0 root 0 comm 0xab [nranks=2] stream 0x3\n",
            "a value does not fit the store (OverflowError",
        ),
    ],
)
def test_a_file_that_breaks_the_parser_or_the_store_fails_alone(
    tmp_path: Path, con, data_dir, name, content, needle
) -> None:
    """Whatever a malformed file raises, it is that file's error; the files after it are ingested and linked."""
    bad = tmp_path / name
    bad.write_bytes(content)
    good = data_dir / "nccl-logs" / "nvidia-nccl-584.log"
    summary = ingest_paths(con, [bad, good], "odd")
    first, second = summary.files
    # "<file>: reason", or "<file>:<line or JSON path>: reason" where the parser names the place
    assert first.status == "failed" and first.error.startswith(f"{bad}:") and needle in first.error
    assert second.status == "ok" and second.events > 0
    rows = con.execute("SELECT count(*) FROM comms WHERE run = 'odd' AND file = ?", [str(good)]).fetchone()[0]
    assert rows == second.events
    failed = con.execute("SELECT count(*) FROM sources WHERE status = 'failed'").fetchone()[0]
    ingest_paths(con, [bad], "odd")  # the same bytes again: still one failure record
    assert con.execute("SELECT count(*) FROM sources WHERE status = 'failed'").fetchone()[0] == failed


def test_archive_limits_hold_for_the_archive_as_a_whole(tmp_path: Path, con) -> None:
    """Ten members each under the limits, 9 MB from a few KB together: the archive stops at the budget."""
    archive = tmp_path / "many.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for i in range(10):
            data = b" " * (900 << 10)
            info = tarfile.TarInfo(f"m{i}.log")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    limits = Limits(ratio_floor_bytes=1 << 20, max_ratio=50)
    summary = ingest_paths(con, [archive], "many", limits=limits)
    errors = [f.error for f in summary.files if f.error and "archive expands more than 50:1" in f.error]
    assert len(errors) == 1 and len(summary.files) <= 3  # members after the budget are not read at all


def test_encrypted_zip_member_is_a_clear_error(tmp_path: Path, con) -> None:
    archive = tmp_path / "locked.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("run.json", _run_json())
    blob = bytearray(archive.read_bytes())
    for magic, flag_at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):  # set the "encrypted" bit in both headers
        at = blob.index(magic) + flag_at
        blob[at] |= 1
    archive.write_bytes(bytes(blob))
    (outcome,) = ingest_paths(con, [archive], "locked").files
    assert outcome.status == "failed" and "encrypted" in outcome.error and "run.json" in outcome.path


def test_interleaved_stdout_with_a_long_preamble_is_an_nccl_log(tmp_path: Path, con, data_dir) -> None:
    """A launcher's stdout may print far more than the first read before NCCL starts."""
    log = tmp_path / "stdout.txt"
    preamble = "".join(f"epoch 0 step {i}: loading shard {i} of the dataset ...\n" for i in range(2000))
    assert len(preamble) > 64 << 10
    log.write_text(preamble + (data_dir / "nccl-logs" / "nvidia-nccl-584.log").read_text())
    (outcome,) = ingest_paths(con, [log], "stdout").files
    (alone,) = ingest_paths(con, [data_dir / "nccl-logs" / "nvidia-nccl-584.log"], "alone").files
    assert outcome.status == "ok" and outcome.kind == "nccl_log" and outcome.events == alone.events > 0
