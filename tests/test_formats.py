"""The format registry: one entry per format, detection of each kind from real files, and ingest rules
that follow the traits of a format rather than its name."""

from __future__ import annotations

import gzip
import io
import random
import tarfile
from pathlib import Path

import pytest

from commlens.ingest import formats
from commlens.ingest.formats import Claim, Format, Trait
from commlens.ingest.inputs import DEFAULT_LIMITS, open_content
from commlens.ingest.records import ParseError, ParseResult, RankHint
from commlens.service.ingest import ingest_paths

RUN_JSON = (
    b'{"schema": "commlens.run/1", "strategy": "ddp", "world_size": 2, '
    b'"model": {"layers": 2, "hidden": 32, "heads": 4, "vocab": 128, "seq_len": 16}, "parallel": {"dp": 2}, '
    b'"groups": [{"dim": "dp", "ranks": [0, 1], "pg_name": "0", "backend": "gloo"}]}'
)


def _detect(raw: bytes) -> str:
    return formats.detect(open_content(io.BytesIO(raw), "x", DEFAULT_LIMITS)).kind  # type: ignore[arg-type]


def test_each_kind_is_declared_once_with_its_traits() -> None:
    kinds = [f.kind for f in formats.FORMATS]
    assert kinds == [
        "kineto",
        "run_config",
        "nccl_log",
        "nccl_inspector",
        "nccl_inspector_prom",
        "flight_recorder",
        "nsys_sqlite",
        "pytorch_et",
        "chakra_et",
    ]
    assert formats.kinds_with(Trait.REFUSED) == ["nccl_inspector_prom", "pytorch_et", "chakra_et"]
    assert formats.kinds_with(Trait.PER_RANK_TIMED_TRACE) == ["kineto", "nsys_sqlite"]
    assert formats.kinds_with(Trait.SUPERSEDED_BY_TRACE) == ["nccl_log", "nccl_inspector", "flight_recorder"]
    assert formats.kinds_with(Trait.SUPERSEDED_BY_LOG) == ["nccl_inspector", "flight_recorder"]
    assert formats.kinds_with(Trait.NCCL_COMMUNICATORS) == ["nccl_log", "nccl_inspector"]
    assert formats.get("nccl_log").has(Trait.SUPERSEDED_BY_TRACE) and not formats.get("run_config").traits
    with pytest.raises(KeyError):
        formats.get("pickle")


def test_every_real_file_is_detected_as_its_kind_and_parsed_as_that_kind(data_dir: Path) -> None:
    real = sorted((data_dir / "kineto-hta").rglob("*.json.gz")) + sorted((data_dir / "nccl-logs").glob("*.log"))
    assert len(real) >= 25
    for path in real:
        with open(path, "rb") as f:
            stream = open_content(f, path.name)
            fmt = formats.detect(stream)
            assert fmt.kind == ("nccl_log" if path.suffix == ".log" else "kineto"), path.name
            result = fmt.parse(stream, path.name, RankHint(), DEFAULT_LIMITS)
        assert result.kind == fmt.kind, path.name
    with tarfile.open(data_dir / "kineto-param" / "dlrm_kineto.tar.gz") as tar:
        member = next(m for m in tar if m.isfile() and m.name.endswith(".json"))
        assert _detect(tar.extractfile(member).read()) == "kineto"  # type: ignore[union-attr]
    assert _detect(RUN_JSON) == "run_config"
    assert _detect(gzip.compress(RUN_JSON)) == "run_config"


@pytest.mark.parametrize(
    ("head", "kind"),
    [
        (b'\xef\xbb\xbf  {"traceEvents": []}', "kineto"),
        (b'[{"name": "x"}]', "kineto"),  # some JSON: the Kineto parser says why it is not a trace
        (b'{"x": "NCCL INFO in a string"}', "kineto"),  # JSON first: an NCCL marker inside JSON is not a log
        (b'{"traceEvents": [], "schema": "commlens.run/1"}', "kineto"),  # both SURE: the earlier entry wins
        (b"epoch 0 loss 3.2\n", "nccl_log"),  # text: a launcher's stdout before NCCL starts
        (b"h:1:2 [0] NCCL INFO NCCL version 2.21.5+cuda12.4\n", "nccl_log"),
        (b'[\n  {"ph": "X"}]', "kineto"),
        (b"[1, 2, 3]", "kineto"),  # a JSON array without log lines: the Kineto parser says what it is
        (b"[rank0]:h:1:2 [0] NCCL INFO NCCL version 2.21.5+cuda12.4\n", "nccl_log"),  # torchrun's prefixes
        (b"[default0]:h:1:2 [0] NCCL INFO Bootstrap : Using eth0\n", "nccl_log"),
        (b"[1,0]<stdout>:h:1:2 [0] NCCL INFO Bootstrap : Using eth0\n", "nccl_log"),  # mpirun --tag-output
        (b"[2025-03-01 10:00:00] h:1:2 [0] net.cc:912 NCCL WARN NET/IB : no device\n", "nccl_log"),  # NCCL 2.26+
        (b"[2025-03-01 10:00:00] RCCL version : 2.21.5-HEAD:1a2b3c4\n", "nccl_log"),
    ],
)
def test_detection_by_claims(head: bytes, kind: str) -> None:
    assert _detect(head) == kind


COLL = (
    b"h:1:2 [0] NCCL INFO AllReduce: opCount 0 sendbuff 0x7f00 recvbuff 0x7f80 count 1024 datatype 7 op 0 "
    b"root 0 comm 0x55d0 [nranks=2] stream 0x55e0\n"
)


@pytest.mark.parametrize("prefix", [b"[rank0]:", b"[default0]:", b"[1,0]<stdout>:", b"[2025-03-01 10:00:00] "])
def test_logs_whose_lines_start_with_a_bracketed_prefix_are_read_as_logs(tmp_path: Path, con, prefix: bytes) -> None:
    """A launcher's (or NCCL's own timestamp) prefix opens every line with '[': the log was taken for JSON and
    failed as 'a JSON array, not a Kineto trace'."""
    path = tmp_path / "job.log"
    path.write_bytes(prefix + b"h:1:2 [0] NCCL INFO NCCL version 2.21.5+cuda12.4\n" + prefix + COLL)
    summary = ingest_paths(con, [path], "job")
    assert [(f.kind, f.status, f.error) for f in summary.files] == [("nccl_log", "ok", None)]
    assert con.execute("SELECT op, msg_bytes FROM comms WHERE run = 'job'").fetchall() == [("all_reduce", 4096)]


def test_nothing_claims_binary_or_empty_heads() -> None:
    with pytest.raises(
        ParseError,
        match=r"binary data, not a Kineto JSON trace, a commlens run.json, an NCCL debug log, NCCL Inspector output, "
        r"a PyTorch Flight Recorder dump or an Nsight Systems SQLite export",
    ):
        _detect(b"\x89PNG\r\n\x1a\n\x00\x00")
    with pytest.raises(ParseError, match="only white space in its first bytes"):
        _detect(b" \n\t")
    with pytest.raises(ParseError, match=r"^empty file$"):
        _detect(b"")


@pytest.mark.parametrize("start", [b"{", b"[", b"\n [", b"\x80\x02\x00", b"\x80\x04K"])
def test_random_bytes_behind_a_json_or_pickle_start_are_binary(start: bytes) -> None:
    """One random file in 128 starts with '{' or '[' and was taken for JSON (an upload of noise was queued, not
    refused); one in 16,384 starts like a pickle."""
    rng = random.Random(start)
    for _ in range(50):
        with pytest.raises(ParseError, match="binary data"):
            _detect(start + rng.randbytes(4096).replace(b"traceEvents", b"x"))


def test_upload_sniffing_tells_archives_from_formats(tmp_path: Path) -> None:
    def sniffed(name: str, raw: bytes) -> str:
        (tmp_path / name).write_bytes(raw)
        return formats.sniff_file(tmp_path / name, DEFAULT_LIMITS)

    tar = io.BytesIO()
    with tarfile.open(fileobj=tar, mode="w") as t:
        info = tarfile.TarInfo("run.json")
        info.size = len(RUN_JSON)
        t.addfile(info, io.BytesIO(RUN_JSON))
    assert sniffed("a.part", tar.getvalue()) == "tar"
    assert sniffed("b.part", gzip.compress(tar.getvalue())) == "tar"
    assert sniffed("c.part", b"PK\x05\x06" + bytes(18)) == "zip"
    assert sniffed("d.part", RUN_JSON) == "run_config"
    with pytest.raises(ParseError, match="empty file"):
        sniffed("e.part", b"")


def _fake_trace(stream: io.BufferedReader, name: str, hint: RankHint, limits: object) -> ParseResult:
    """A per-rank timed trace of another format: `FAKE <rank> <first ts> <calls>`."""
    _, rank, ts, calls = stream.read().split()
    events = [
        {
            "rank": int(rank),
            "process": "p",
            "seq": i,
            "op": "all_reduce",
            "dtype": "float32",
            "msg_bytes": 4096,
            "group_size": 2,
            "group_key": "g",
            "ts_us": float(ts) + i,
            "dur_us": 1.0,
        }
        for i in range(int(calls))
    ]
    return ParseResult(kind="fake_trace", rank=int(rank), world_size=2, events=events)


def test_the_rules_follow_traits_not_kind_names(tmp_path: Path, con, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new per-rank timed trace format, declared with its trait alone, supersedes the NCCL log of its rank
    and refuses a second trace of that rank over the same time span, as Kineto traces do."""
    fake = Format(
        "fake_trace",
        "a fake trace",
        lambda head: Claim.SURE if head.startswith(b"FAKE ") else Claim.NONE,
        _fake_trace,
        Trait.PER_RANK_TIMED_TRACE,
    )
    monkeypatch.setattr(formats, "FORMATS", (fake, *formats.FORMATS))
    log = tmp_path / "nccl.log"
    log.write_text(
        "".join(
            [
                f"node1:{100 + r}:{200 + r} [{r}] NCCL INFO comm 0x5{r} rank {r} nranks 2 cudaDev {r} commId 0xfeed"
                " - Init COMPLETE\n"
                for r in range(2)
            ]
            + [
                f"node1:{100 + r}:{200 + r} [{r}] NCCL INFO AllReduce: opCount {i:x} sendbuff 0x1 recvbuff 0x2 count 1024 "
                f"datatype 7 op 0 root 0 comm 0x5{r} [nranks=2] stream 0x3\n"
                for i in range(6)
                for r in range(2)
            ]
        )
    )
    (tmp_path / "t0.fake").write_text("FAKE 0 100 4")
    (tmp_path / "t0-again.fake").write_text("FAKE 0 102 4")
    (tmp_path / "t0-later.fake").write_text("FAKE 0 500 4")
    summary = ingest_paths(
        con, [log, tmp_path / "t0.fake", tmp_path / "t0-again.fake", tmp_path / "t0-later.fake"], "fake"
    )
    status = {Path(f.path).name: (f.status, f.kind) for f in summary.files}
    assert status == {
        "nccl.log": ("ok", "nccl_log"),
        "t0.fake": ("ok", "fake_trace"),
        "t0-again.fake": ("failed", "fake_trace"),
        "t0-later.fake": ("ok", "fake_trace"),
    }
    assert "rank 0 already has a profiler trace" in summary.failed[0].error  # type: ignore[operator]
    per_rank = con.execute(
        "SELECT rank, source_kind, count(*) FROM comms WHERE run = 'fake' GROUP BY ALL ORDER BY ALL"
    ).fetchall()
    assert per_rank == [(0, "fake_trace", 8), (1, "nccl_log", 6)]


# PyTorch's ExecutionTraceObserver (torch/csrc/profiler/standalone/execution_trace_observer.cpp) opens its
# file with `{"schema": "<version>", "pid": <pid>, "time": "<date>", "start_ts": <ts>, "nodes": [` and writes
# one object per operator: the version was 1.0.1 in PyTorch 2.0, "1.0.2-chakra.0.0.4" from 2.1, today
# "1.1.1-chakra.0.0.4".
PYTORCH_ET = (
    b'{"schema": "1.1.1-chakra.0.0.4", "pid": 2831, "time": "2025-03-04 10:11:12", "start_ts": 1201, "nodes": ['
    b'{"id": 2, "name": "[pytorch|profiler|execution_trace|process]", "ctrl_deps": 1, "inputs": '
    b'{"values": [], "shapes": [], "types": []}, "outputs": {"values": [], "shapes": [], "types": []}, "attrs": []}'
    b'], "finish_ts": 1290}'
)
# Chakra's converter writes protobuf: a varint length, then GlobalMetadata {string version = 1} ("0.0.4"),
# then the Node messages (chakra/schema/protobuf/et_def.proto, third_party/utils/protolib encodeMessage).
CHAKRA_ET = b"\x07\x0a\x050.0.4" + b"\x0c\x08\x01\x12\x08all_gath"


@pytest.mark.parametrize(
    ("raw", "kind", "error"),
    [
        (
            PYTORCH_ET,
            "pytorch_et",
            "x.json:$.schema: a PyTorch execution trace (schema 1.1.1-chakra.0.0.4), not a profiler trace",
        ),
        (gzip.compress(PYTORCH_ET.replace(b"1.1.1-chakra.0.0.4", b"1.0.1")), "pytorch_et", "(schema 1.0.1)"),
        (CHAKRA_ET, "chakra_et", "x.json:byte 0: a Chakra execution trace (protobuf, version 0.0.4), not a profiler"),
    ],
)
def test_execution_traces_are_refused_by_their_real_kind(tmp_path: Path, con, raw: bytes, kind: str, error: str):
    path = tmp_path / "x.json"
    path.write_bytes(raw)
    summary = ingest_paths(con, [path], "et")
    (f,) = summary.files
    assert (f.status, f.kind) == ("failed", kind)
    assert error in f.error  # type: ignore[operator]
    assert "record a torch.profiler (Kineto) trace" in f.error  # type: ignore[operator]
    assert con.execute("SELECT kind, status FROM sources").fetchall() == [(kind, "failed")]


def test_a_run_json_with_a_schema_is_not_an_execution_trace() -> None:
    assert _detect(RUN_JSON) == "run_config"
    assert _detect(b'{"schema": "commlens.run/1", "nodes": []}') == "run_config"


INSPECTOR_LINE = (
    b'{"header":{"id":"0x7f8c496ae9f661","comm_name":"unknown","rank":2,"n_ranks":8,"nnodes":1},"metadata":'
    b'{"inspector_output_format_version":"v4.0","git_rev":"","rec_mechanism":"nccl_profiler_interface",'
    b'"dump_timestamp_us":1748030377748202,"hostname":"example-hostname","pid":1639453},"coll_perf":{"coll":'
    b'"AllReduce","coll_sn":1407,"coll_msg_size_bytes":17179869184,"coll_exec_time_us":61974,'
    b'"coll_timing_source":"kernel_gpu","coll_algobw_gbs":277.210914,"coll_busbw_gbs":485.119099}}\n'
)


@pytest.mark.parametrize(
    ("head", "kind"),
    [
        (INSPECTOR_LINE, "nccl_inspector"),
        (b'nccl_bus_bandwidth_gbs{version="v5.1",node="n"} 678.263\n', "nccl_inspector_prom"),
        (
            b'{"comm_lib_version": "", "entries": [{"collective_seq_id": 1, "profiling_name": "gloo:all_reduce"}]}',
            "flight_recorder",
        ),
        (b"\x80\x02}q\x00(X\x07\x00\x00\x00version", "flight_recorder"),
        (b"SQLite format 3\x00" + bytes(84), "nsys_sqlite"),
    ],
)
def test_new_sources_are_detected_by_content_whatever_their_name(head: bytes, kind: str) -> None:
    assert _detect(head) == kind


def test_the_upload_check_names_the_new_kinds(tmp_path: Path) -> None:
    """The API's upload check asks the registry: an Inspector file named like an NCCL log is Inspector."""
    path = tmp_path / "example-hostname-pid1639453.log"
    path.write_bytes(INSPECTOR_LINE)
    assert formats.sniff_file(path, DEFAULT_LIMITS) == "nccl_inspector"
    gz = tmp_path / "records.jsonl.gz"
    gz.write_bytes(gzip.compress(INSPECTOR_LINE))
    assert formats.sniff_file(gz, DEFAULT_LIMITS) == "nccl_inspector"
