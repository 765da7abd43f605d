"""Kineto ingester: real traces (HTA, param DLRM, generated gloo runs) through ingest_paths into a
DuckDB file, read back through the `comms` view; expected values are computed independently from
the raw JSON (plain json.load) or from the shapes the gloo run used."""

from __future__ import annotations

import gzip
import importlib.util
import io
import json
import math
import sys
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from commlens.ingest import kineto_json
from commlens.ingest.inputs import DEFAULT_LIMITS, Limits
from commlens.ingest.kineto import parse_kineto
from commlens.ingest.records import ParseError, RankHint
from commlens.service.ingest import ingest_paths

HTA = "kineto-hta"
NCCL_DATA = f"{HTA}/nccl_parser_config/nccl_data.json.gz"
PGID = f"{HTA}/ns_resolution_trace/rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz"
NEGQ = f"{HTA}/negative_queue_length_values_check/rank0.json.gz"
CONTROL = f"{HTA}/trace_diff/control/control.json.gz"
DF_INDEX = f"{HTA}/df_index_resolver/df_index_resolver.json.gz"
NO_DIST = f"{HTA}/distributed_info_unavailable/distributed_info_not_found.json.gz"
PARTIAL = f"{HTA}/rank_non_gpu/rank_non_gpu.json.gz"
DLRM = "kineto-param/dlrm_kineto.tar.gz"

# C++ type names of `Input type` -> element size, for the independent checks
CPP_SIZE = {"float": 4, "double": 8, "int": 4, "long int": 8, "long": 8, "c10::BFloat16": 2, "c10::Half": 2}


def _gloo_module():
    spec = importlib.util.spec_from_file_location("gloo_traces", Path(__file__).with_name("gloo_traces.py"))
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["gloo_traces"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


gloo = _gloo_module()


def _raw(path: Path) -> dict:
    with gzip.open(path) if path.suffix == ".gz" else open(path, "rb") as f:
        return json.load(f)


def _ingest(con, paths: list[Path], run: str = "r", hint: RankHint | None = None):
    return ingest_paths(con, paths, run, hint)


def _rows(con, sql: str, params: list | None = None) -> list[dict]:
    cur = con.execute(sql, params or [])
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r, strict=False)) for r in cur.fetchall()]


def _parse_bytes(doc: bytes, name: str = "t.json", hint: RankHint | None = None, limits: Limits = DEFAULT_LIMITS):
    return parse_kineto(io.BufferedReader(io.BytesIO(doc)), name, hint or RankHint(), limits)  # type: ignore[arg-type]


def _prod(dims: list[int]) -> int:
    return math.prod(dims)


# ------------------------------------------------------------------------------ real traces


def test_every_shared_trace_ingests(data_dir: Path, con) -> None:
    summary = _ingest(con, [data_dir / HTA, data_dir / "kineto-param"])
    assert len(summary.files) == 15  # 7 HTA traces + the 8 ranks inside the DLRM archive
    assert [f for f in summary.files if f.status != "ok"] == []
    assert {f.kind for f in summary.files} == {"kineto"}
    per_file = dict(con.execute("SELECT file, count(*) FROM comms GROUP BY file").fetchall())
    assert sum(per_file.values()) == con.execute("SELECT count(*) FROM comm_events").fetchone()[0]
    assert all(n > 0 for n in per_file.values())


def test_nccl_parser_config_resnet50_buckets(data_dir: Path, con) -> None:
    _ingest(con, [data_dir / NCCL_DATA])
    rows = _rows(con, "SELECT * FROM comms ORDER BY ts_us")
    ar = [r for r in rows if r["op"] == "all_reduce"]
    bc = [r for r in rows if r["op"] == "broadcast"]
    assert len(rows) == 21 and len(ar) == 15 and len(bc) == 6
    assert {r["rank"] for r in rows} == {0}
    assert {r["dtype"] for r in ar} == {"float32"}
    buckets = Counter(r["elems_in"] for r in ar)
    assert len(buckets) == 5 and set(buckets.values()) == {3}
    assert sum(buckets) == 25_557_032  # ResNet-50's parameter count
    assert all(r["msg_bytes"] == r["elems_in"] * 4 for r in ar)
    assert Counter((r["dtype"], r["elems_in"]) for r in bc) == {("float32", 53120): 3, ("int64", 53): 3}
    assert {(r["group_key"], r["group_size"]) for r in rows} == {("pg:0", 2)}
    # durations are the NCCL kernels' own
    raw = _raw(data_dir / NCCL_DATA)["traceEvents"]
    kernels = [e for e in raw if e.get("cat") == "kernel" and e["name"].startswith("nccl")]
    assert {r["dur_us"] for r in rows} == {k["dur"] for k in kernels}
    assert {r["ts_us"] for r in rows} == {k["ts"] for k in kernels}
    assert con.execute("SELECT DISTINCT dur_source FROM comm_events").fetchall() == [("kernel",)]
    # steps: ProfilerStep#4..6, 7 calls each
    steps = _rows(con, "SELECT step, ts_us, dur_us FROM steps ORDER BY step")
    raw_steps = sorted(
        (int(e["name"].split("#")[1]), e["ts"], e["dur"]) for e in raw if e.get("name", "").startswith("ProfilerStep#")
    )
    assert [(s["step"], s["ts_us"], s["dur_us"]) for s in steps] == raw_steps
    assert Counter(r["step"] for r in rows) == {4: 7, 5: 7, 6: 7}
    groups = _rows(con, "SELECT group_key, ranks, size, origin, description, backend FROM process_groups")
    assert groups == [
        {
            "group_key": "pg:0",
            "ranks": [0, 1],
            "size": 2,
            "origin": "pg_config",
            "description": "default_pg",
            "backend": "cuda:nccl",
        }
    ]
    meta = json.loads(con.execute("SELECT meta FROM sources").fetchone()[0])
    assert meta["generation"]["distributed_info"] == "3"
    assert meta["generation"]["comm_metadata"] == "record_param_comms+kernel"
    assert meta["nccl_version"] == "2.17.1"
    skipped = json.loads(con.execute("SELECT skipped FROM sources").fetchone()[0])
    assert skipped["record_param_comms 'wait'"] == 6


def test_dlrm_all_eight_ranks(data_dir: Path, con, tmp_path: Path) -> None:
    summary = _ingest(con, [data_dir / DLRM])
    assert sorted(f.rank for f in summary.files) == list(range(8))
    with tarfile.open(data_dir / DLRM) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            doc = json.load(tar.extractfile(member))  # type: ignore[arg-type]
            rank = doc["distributedInfo"]["rank"]
            evs = doc["traceEvents"]
            expected = Counter()
            for e in evs:
                a = e.get("args", {})
                if e.get("name") == "c10d::alltoall_base_":  # (output, input): S is the input sent
                    expected[("all_to_all", _prod(a["Input Dims"][1]) * CPP_SIZE[a["Input type"][1]])] += 1
                if e.get("name") == "nccl:all_reduce":  # c10d::allreduce_ has empty TensorList dims
                    expected[("all_reduce", _prod(a["Input Dims"][0]) * CPP_SIZE[a["Input type"][0]])] += 1
            got = Counter(
                (r["op"], r["msg_bytes"]) for r in _rows(con, "SELECT op, msg_bytes FROM comms WHERE rank = ?", [rank])
            )
            assert got == expected, rank
            kdur = sum(e["dur"] for e in evs if e.get("cat") == "kernel" and e["name"].startswith("nccl"))
            assert con.execute("SELECT sum(dur_us) FROM comms WHERE rank = ?", [rank]).fetchone()[0] == pytest.approx(
                kdur
            )
    counts = dict(con.execute("SELECT op, count(*) FROM comms GROUP BY op").fetchall())
    assert counts == {"all_reduce": 8 * 3, "all_to_all": 8 * 5}


def test_c10d_input_dims_and_annotations(data_dir: Path, con) -> None:
    """2023 trace: sizes only from c10d Input Dims (_base_ ops list the output first) and nccl: annotations."""
    _ingest(con, [data_dir / NEGQ])
    evs = _raw(data_dir / NEGQ)["traceEvents"]
    expected = Counter()
    for e in evs:
        a, n = e.get("args", {}), e.get("name")
        if n == "c10d::_allgather_base_":
            expected[("all_gather", _prod(a["Input Dims"][0]) * 4, 8)] += 1
        elif n == "c10d::_reduce_scatter_base_":
            expected[("reduce_scatter", _prod(a["Input Dims"][1]) * 4, 8)] += 1
        elif n == "c10d::alltoall_base_":
            expected[("all_to_all", _prod(a["Input Dims"][1]) * CPP_SIZE[a["Input type"][1]], None)] += 1
        elif n == "nccl:all_reduce":
            expected[("all_reduce", _prod(a["Input Dims"][0]) * 4, None)] += 1
    got = Counter((r["op"], r["msg_bytes"], r["group_size"]) for r in _rows(con, "SELECT * FROM comms"))
    assert got == expected and sum(got.values()) == 85
    assert con.execute("SELECT DISTINCT rank FROM comms").fetchall() == [(0,)]


def test_control_all_to_all_from_annotations(data_dir: Path, con) -> None:
    _ingest(con, [data_dir / CONTROL])
    evs = _raw(data_dir / CONTROL)["traceEvents"]
    a2a = Counter(
        _prod(e["args"]["Input Dims"][0]) * CPP_SIZE[e["args"]["Input type"][0]]
        for e in evs
        if e.get("name") == "nccl:all_to_all"
    )
    got = Counter(r["msg_bytes"] for r in _rows(con, "SELECT msg_bytes FROM comms WHERE op = 'all_to_all'"))
    assert got == a2a and sum(a2a.values()) == 42
    assert con.execute("SELECT count(*) FROM comms WHERE op = 'all_reduce'").fetchone()[0] == sum(
        1 for e in evs if e.get("name") == "c10d::allreduce_"
    )
    # old kernels carry no CPU link but their launch sits inside the call: every call has its kernel
    kernels = [e for e in evs if e.get("cat") == "kernel" and e["name"].startswith("nccl")]
    assert con.execute("SELECT count(*), sum(dur_us) FROM comm_events WHERE dur_source = 'kernel'").fetchone() == (
        60,
        pytest.approx(sum(k["dur"] for k in kernels)),
    )
    assert con.execute("SELECT rank, count(DISTINCT step) FROM comms GROUP BY rank").fetchall() == [(3, 6)]


def test_kernels_without_any_size(data_dir: Path, con) -> None:
    """df_index_resolver: no shapes recorded anywhere; one row per all-reduce kernel, size NULL."""
    _ingest(con, [data_dir / DF_INDEX])
    evs = _raw(data_dir / DF_INDEX)["traceEvents"]
    kernels = [e for e in evs if e.get("cat") == "kernel" and e["name"].startswith("ncclKernel_AllReduce")]
    assert len(kernels) == 2020
    row = con.execute(
        "SELECT count(*), count(msg_bytes), count(DISTINCT ts_us), sum(dur_us), min(op), max(op), min(dtype) FROM comms"
    ).fetchone()
    assert row == (2020, 0, 2020, pytest.approx(sum(k["dur"] for k in kernels)), "all_reduce", "all_reduce", "float32")
    assert con.execute("SELECT DISTINCT rank FROM comms").fetchall() == [(1,)]


def test_process_group_id_generation(data_dir: Path, con) -> None:
    _ingest(con, [data_dir / PGID])
    evs = _raw(data_dir / PGID)["traceEvents"]
    rpc = Counter(e["args"]["Collective name"] for e in evs if e.get("name") == "record_param_comms")
    got = dict(con.execute("SELECT op, count(*) FROM comms GROUP BY op").fetchall())
    assert got == {"all_reduce": rpc["allreduce"], "broadcast": rpc["broadcast"]}
    assert con.execute("SELECT DISTINCT group_key, group_size FROM comms").fetchall() == [("pg:0", 1)]
    # no NCCL kernel in this excerpt: CPU time of an NCCL call is only its enqueue, so no duration
    assert con.execute("SELECT count(dur_us) FROM comms").fetchone() == (0,)
    meta = json.loads(con.execute("SELECT meta FROM sources").fetchone()[0])
    assert meta["generation"]["group_field"] == "Process Group ID"
    assert meta["displayTimeUnit"] == "ns"
    assert _rows(con, "SELECT group_key, ranks, origin FROM process_groups") == [
        {"group_key": "pg:0", "ranks": [0], "origin": "pg_config"}
    ]


def test_distributed_info_generations(data_dir: Path, con) -> None:
    _ingest(con, [data_dir / CONTROL, data_dir / PARTIAL, data_dir / NO_DIST, data_dir / NCCL_DATA])
    src = {Path(r["path"]).name: r for r in _rows(con, "SELECT path, rank, world_size, warnings, meta FROM sources")}
    gen = {k: json.loads(v["meta"])["generation"]["distributed_info"] for k, v in src.items()}
    assert gen == {
        "control.json.gz": "1",
        "rank_non_gpu.json.gz": "partial",
        "distributed_info_not_found.json.gz": "absent",
        "nccl_data.json.gz": "3",
    }
    assert (src["control.json.gz"]["rank"], src["control.json.gz"]["world_size"]) == (3, 8)
    assert (src["rank_non_gpu.json.gz"]["rank"], src["rank_non_gpu.json.gz"]["world_size"]) == (0, None)
    # rank_non_gpu is an excerpt of control.json's rank 3 relabelled rank 0: its six all_to_alls start at the very
    # instants of six of control's (they were counted twice, unsaid)
    assert json.loads(src["rank_non_gpu.json.gz"]["warnings"]) == [
        "distributedInfo is partial: no backend, world_size",
        f"its calls start at the very instants of calls of {data_dir / CONTROL} (rank 3; this file says rank 0): the "
        "same recording under another rank? Then its calls count twice in this run",
    ]
    assert json.loads(src["control.json.gz"]["warnings"]) == []
    assert src["distributed_info_not_found.json.gz"]["rank"] is None
    assert "rank recorded as NULL" in json.loads(src["distributed_info_not_found.json.gz"]["warnings"])[0]
    nulls = con.execute(
        "SELECT count(*), count(e.rank), min(process) FROM comm_events e JOIN sources s USING (source_id) "
        "WHERE s.path LIKE '%distributed_info_not_found%'"
    ).fetchone()
    assert nulls == (6, 0, "distributed_info_not_found.json.gz")


def test_rank_from_file_name_or_hint(data_dir: Path, con, tmp_path: Path) -> None:
    named = tmp_path / "trace_rank5.json.gz"
    named.write_bytes((data_dir / NO_DIST).read_bytes())
    _ingest(con, [named], run="named")
    row = con.execute("SELECT rank, warnings FROM sources").fetchone()
    assert row[0] == 5 and "rank 5 taken from the file name" in row[1]
    assert con.execute("SELECT DISTINCT rank, process FROM comm_events").fetchall() == [(5, "5")]
    _ingest(con, [data_dir / NO_DIST], run="hinted", hint=RankHint(rank=2))
    assert con.execute("SELECT DISTINCT rank FROM comms WHERE run = 'hinted'").fetchall() == [(2,)]
    # a file that says its rank wins over the hint, with a warning
    _ingest(con, [data_dir / CONTROL], run="conflict", hint=RankHint(rank=1))
    row = con.execute("SELECT rank, warnings FROM sources WHERE path LIKE '%control%'").fetchone()
    assert row[0] == 3 and "distributedInfo says rank 3, --rank says 1: using 3" in row[1]


# ------------------------------------------------------------------------------ gloo (generated)


@pytest.fixture(scope="module")
def gloo_traces(gloo_trace_files: list[Path]) -> list[Path]:
    return gloo_trace_files  # generated once per session (conftest.py), shared with test_timing_gloo.py


def test_gloo_every_collective_exactly_once(gloo_traces: list[Path], con) -> None:
    world = len(gloo_traces)
    summary = _ingest(con, gloo_traces, run="gloo")
    assert [f.status for f in summary.files] == ["ok"] * world
    for rank in range(world):
        rows = _rows(con, "SELECT * FROM comm_events WHERE rank = ? ORDER BY seq", [rank])
        expected = [e for e in gloo.expected_calls(world) if e.ranks is None or rank in e.ranks]
        want = Counter()
        for e in expected:
            sized = e.sized_on is None or rank in e.sized_on
            key = (
                e.op,
                e.dtype if sized else None,
                e.msg_bytes if sized else None,
                e.peer.get(rank) if e.peer else None,
                e.group_key,
            )
            want[key] += gloo.ACTIVE
        # two groups in pg_config and no group on gloo events: only labelled calls get a group_key
        got = Counter((r["op"], r["dtype"], r["msg_bytes"], r["peer"], r["group_key"]) for r in rows)
        assert got == want, rank
        assert len(rows) == gloo.ACTIVE * len(expected)  # nothing counted twice (op + gloo:* annotations)
        assert Counter(r["step"] for r in rows) == {s: len(expected) for s in range(1, gloo.ACTIVE + 1)}
        assert {r["dur_source"] for r in rows} == {"cpu_op"} and all(r["dur_us"] > 0 for r in rows)
        assert {r["group_size"] for r in rows} == {world}
    groups = _rows(con, "SELECT group_key, ranks, origin, description, mesh_dim FROM process_groups ORDER BY group_key")
    assert groups == [
        {"group_key": "pg:0", "ranks": [0, 1], "origin": "pg_config", "description": "default_pg", "mesh_dim": None},
        {"group_key": "pg:1", "ranks": [0, 1], "origin": "pg_config", "description": "undefined", "mesh_dim": "dp"},
    ]


def test_gloo_elements_and_durations(gloo_traces: list[Path]) -> None:
    """elems_in/out follow the op convention; gloo's worker annotation gives the duration."""
    with gzip.open(gloo_traces[0]) as f:
        res = parse_kineto(io.BufferedReader(f), gloo_traces[0].name, RankHint(), DEFAULT_LIMITS)  # type: ignore[arg-type]
    w = len(gloo_traces)
    by = Counter((e["op"], e["elems_in"], e["elems_out"]) for e in res.events)
    assert by[("all_gather", 300, 300 * w)] == gloo.ACTIVE  # _allgather_base_ lists (output, input)
    assert by[("all_gather", 50, 50 * w)] == gloo.ACTIVE  # list all_gather: output from the group size
    assert by[("reduce_scatter", 200 * w, 200)] == gloo.ACTIVE
    assert by[("all_to_all", 40 * w, 40 * w)] == gloo.ACTIVE
    raw = _raw(gloo_traces[0])["traceEvents"]
    worker = sorted(
        e["dur"]
        for e in raw
        if e.get("name", "").startswith("gloo:") and e.get("name") not in ("gloo:send", "gloo:recv")
    )
    ops = sorted(e["dur_us"] for e in res.events if e["op"] not in ("send", "recv"))
    assert ops == worker  # every collective took its duration from its own gloo work annotation
    assert res.meta["generation"]["tensorlist_dims"] is True


# ------------------------------------------------------------------------------ linking rules


def _doc(events: list[dict], **top) -> bytes:
    return json.dumps({"schemaVersion": 1, **top, "traceEvents": events}).encode()


def _x(name: str, ts: float, dur: float, cat: str = "cpu_op", pid: int = 1, tid: int = 1, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


META = {
    "Collective name": "allreduce",
    "dtype": "BFloat16",
    "In msg nelems": 1024,
    "Out msg nelems": 1024,
    "Group size": 4,
    "Process Group Name": "7",
    "Process Group Description": "mesh_tp",
    "Process Group Ranks": "[0, 1, 2, 3]",
}


def test_one_call_described_five_times() -> None:
    events = [
        _x("ProfilerStep#3", 0, 1000, cat="user_annotation"),
        _x("c10d::allreduce_", 100, 50, **{"External id": 10}),
        _x("record_param_comms", 105, 40, **{"External id": 11}, **META),
        _x("nccl:all_reduce", 110, 20, cat="user_annotation", **{"External id": 12}),
        _x("cudaLaunchKernel", 115, 3, cat="cuda_runtime", **{"External id": 11, "correlation": 900}),
        _x(
            "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
            130,
            77.5,
            cat="kernel",
            pid=0,
            tid=7,
            **{"External id": 11, "correlation": 900},
            **META,
        ),
        _x("nccl:all_reduce", 128, 80, cat="gpu_user_annotation", pid=0, tid=7, **{"External id": 12}),
    ]
    res = _parse_bytes(_doc(events, distributedInfo={"backend": "nccl", "rank": 1, "world_size": 4}))
    assert len(res.events) == 1
    e = res.events[0]
    assert (e["op"], e["dtype"], e["msg_bytes"], e["group_key"], e["group_size"]) == (
        "all_reduce",
        "bfloat16",
        2048,
        "pg:7",
        4,
    )
    assert (e["ts_us"], e["dur_us"], e["dur_source"], e["step"], e["rank"]) == (130, 77.5, "kernel", 3, 1)
    assert {g["group_key"]: (g["origin"], g["ranks"], g["description"]) for g in res.groups} == {
        "pg:7": ("event", [0, 1, 2, 3], "mesh_tp")
    }


def test_send_recv_peers_and_old_spellings() -> None:
    send = {
        "Collective name": "send",
        "dtype": "Float",
        "In msg size": 10,
        "Out msg size": 10,
        "Group size": 2,
        "Process Group Name": "3",
        "Rank": 1,
        "Dst Rank": 6,
    }
    recv = {
        "Collective name": "recv",
        "dtype": "Float",
        "In msg size": 12,
        "Out msg size": 12,
        "Group size": 2,
        "Process Group Name": "3",
        "Rank": 1,
    }
    events = [_x("record_param_comms", 10, 5, **send), _x("record_param_comms", 20, 5, **recv)]
    pg = [{"pg_name": "3", "pg_desc": "pp", "backend_config": "cuda:nccl", "pg_size": 2, "ranks": "[2, 6]"}]
    res = _parse_bytes(_doc(events, distributedInfo={"backend": "nccl", "rank": 2, "world_size": 8, "pg_config": pg}))
    assert [(e["op"], e["msg_bytes"], e["peer"]) for e in res.events] == [("send", 40, 6), ("recv", 48, 6)]
    assert res.groups[0]["ranks"] == [2, 6]  # on-demand traces write ranks as a string


def test_wait_and_empty_record_param_comms_are_skipped() -> None:
    events = [
        _x("record_param_comms", 10, 5, **{"Collective name": "wait", "dtype": "Byte", "In msg nelems": 0}),
        _x("record_param_comms", 20, 5),  # 2022: bookkeeping keys only, outside any collective
        _x("c10d::allreduce_", 30, 9, **{"Input Dims": [[], [], []], "Input type": ["TensorList", "", "Scalar"]}),
        _x("record_param_comms", 31, 7),
        _x("nccl:all_reduce", 32, 5, cat="user_annotation", **{"Input Dims": [[394241]], "Input type": ["float"]}),
    ]
    res = _parse_bytes(_doc(events))
    assert [(e["op"], e["msg_bytes"], e["raw_name"]) for e in res.events] == [
        ("all_reduce", 394241 * 4, "c10d::allreduce_")
    ]
    assert res.skipped["record_param_comms 'wait'"] == 1
    assert sum(res.skipped.values()) == 2
    assert res.rank is None and res.warnings


# ------------------------------------------------------------------------------ streaming


def test_fast_mode_matches_exact_mode(data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same rows whether events are cut out by the fast scan (small blocks, hits across block
    ends) or every event is parsed."""

    def parse(path: str) -> list[dict]:
        with gzip.open(data_dir / path) as f:
            return parse_kineto(io.BufferedReader(f), path, RankHint(), DEFAULT_LIMITS).events  # type: ignore[arg-type]

    files = [NCCL_DATA, NEGQ]
    monkeypatch.setattr(kineto_json, "EXACT_BYTES", 1 << 40)
    exact = {f: parse(f) for f in files}
    monkeypatch.setattr(kineto_json, "EXACT_BYTES", 0)
    monkeypatch.setattr(kineto_json, "BLOCK", 64 << 10)
    monkeypatch.setattr(kineto_json, "RETAIN", 256 << 10)
    for f in files:
        assert parse(f) == exact[f]


def test_fast_mode_falls_back_on_braces_in_strings(monkeypatch: pytest.MonkeyPatch) -> None:
    """A `}, {` inside a string makes the fast cut fail; the region is re-read exactly. A name inside
    a string is not an event."""
    monkeypatch.setattr(kineto_json, "EXACT_BYTES", 0)
    tricky = 'x}, {"name": "nccl:all_reduce", "ph": "X"}, {"y'
    events = [_x("aten::mm", i, 1, **{"Call stack": tricky}) for i in range(50)]
    events.append(
        _x(
            "nccl:all_reduce",
            100,
            5,
            cat="user_annotation",
            note=tricky,
            **{"Input Dims": [[8]], "Input type": ["float"]},
        )
    )
    events += [_x("aten::mm", 200 + i, 1, s='"name": "nccl:all_reduce"') for i in range(50)]
    res = _parse_bytes(_doc(events))
    assert [(e["op"], e["msg_bytes"]) for e in res.events] == [("all_reduce", 32)]
    assert res.meta["scan"]["fallbacks"] >= 1


def test_keeps_only_what_matters(data_dir: Path) -> None:
    with gzip.open(data_dir / DF_INDEX) as f:
        res = parse_kineto(io.BufferedReader(f), DF_INDEX, RankHint(), DEFAULT_LIMITS)  # type: ignore[arg-type]
    scan = res.meta["scan"]
    n_events = len(_raw(data_dir / DF_INDEX)["traceEvents"])
    assert scan["events_parsed"] < n_events / 5  # most events are never turned into objects
    assert scan["decompressed_bytes"] == len(gzip.decompress((data_dir / DF_INDEX).read_bytes()))


def test_distributed_info_after_trace_events(data_dir: Path) -> None:
    doc = _raw(data_dir / NCCL_DATA)
    events = doc.pop("traceEvents")
    text = json.dumps({"traceEvents": events, **doc}).encode()
    assert text.index(b'"traceEvents"') < text.index(b'"distributedInfo"')
    res = _parse_bytes(text)
    assert res.rank == 0 and res.world_size == 2 and len(res.events) == 21


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "doc, reason, path, place",
    [
        (
            b'{"traceEvents": [{"ph": "X", "name": "a", "ts": 1,, "dur": 2}]}',
            "invalid JSON",
            "$.traceEvents[0]",
            "line 1 column 51",
        ),
        (
            b'{"traceEvents": [\n {"ph": "X"},\n {"ph": "X", "name": "nccl:all_reduce" "ts": 3}\n]}',
            "invalid JSON",
            "$.traceEvents[1]",
            "line 3 column 40",
        ),
        (b'{"schemaVersion": 1, "deviceProperties": []}', "no 'traceEvents'", "$", ""),
        (b'{"traceEvents": {"ph": "X"}}', "not a list", "$.traceEvents", ""),
        (
            b'{"traceEvents": [{"ph": "X", "name": "x"}, 5, {"ph": "X"}]}',
            "not an object",
            "$.traceEvents[1]",
            "line 1 column 44",
        ),
        (b'[{"ph": "X"}]', "JSON array", "$", ""),
        (b'{"traceEvents": [{"ph": "X"}]} trailing', "extra data", "", "line 1 column 32"),
        (b'{"traceEvents": [{"ph": "X", "name": "nccl:all_reduce", "ts": 1', "truncated", "", "line 1 column 64"),
        (
            b'{"distributedInfo": {"a": ' + b"[" * 80 + b"]" * 80 + b'}, "traceEvents": []}',
            "nested deeper",
            "$.distributedInfo.a" + "[0]" * 62,
            "line 1 column 89",
        ),
        (
            b'{"traceEvents": [{"ph": "X", "name": "c10d::allreduce_", "ts": 1, "args": {"x": '
            + b"[" * 70
            + b"]" * 70
            + b"}}]}",
            "nested deeper",
            "$.traceEvents[0].args.x" + "[0]" * 59,
            "line 1 column",
        ),
    ],
)
def test_bad_input(doc: bytes, reason: str, path: str, place: str) -> None:
    with pytest.raises(ParseError) as exc:
        _parse_bytes(doc)
    where = exc.value.where
    assert reason in exc.value.reason and where is not None
    assert where.startswith(path) and place in where, where


def test_bad_input_through_the_pipeline(con, tmp_path: Path) -> None:
    bad = tmp_path / "rank0.json"
    bad.write_bytes(b'{"traceEvents": [\n  {"ph": "X", "name": "c10d::allreduce_", "ts": 1, "dur": 2},\n  7\n]}')
    good = tmp_path / "rank1.json"
    good.write_bytes(_doc([_x("nccl:all_reduce", 1, 2, **{"Input Dims": [[4]], "Input type": ["float"]})]))
    summary = _ingest(con, [bad, good])
    assert [f.status for f in summary.files] == ["failed", "ok"]
    assert summary.files[0].error == f"{bad}:$.traceEvents[1] (line 3 column 3): an event that is not an object (int)"
    assert con.execute("SELECT rank, op, msg_bytes FROM comms").fetchall() == [(1, "all_reduce", 16)]


def test_truncated_big_trace_names_the_place(data_dir: Path, con, tmp_path: Path) -> None:
    """A real 54 MB trace cut in the middle (read in fast mode) fails as truncated, with its byte offset,
    and is recorded as a failed source with the file name."""
    full = gzip.decompress((data_dir / DF_INDEX).read_bytes())
    cut = tmp_path / "cut_rank1.json.gz"
    cut.write_bytes(gzip.compress(full[: len(full) * 3 // 5], compresslevel=1))
    summary = _ingest(con, [cut])
    (f,) = summary.files
    assert f.status == "failed"
    assert f.error.startswith(f"{cut}:") and "truncated JSON" in f.error
    assert f"byte {len(full) * 3 // 5}" in f.error
    assert con.execute("SELECT count(*) FROM comm_events").fetchone() == (0,)
    assert con.execute("SELECT status FROM sources").fetchall() == [("failed",)]


def test_invalid_json_in_a_real_trace(data_dir: Path) -> None:
    text = gzip.decompress((data_dir / PARTIAL).read_bytes())
    at = text.index(b'"ph": "X"', len(text) // 2)
    broken = text[:at] + b'"ph": X"' + text[at + 9 :]
    line = broken[:at].count(b"\n") + 1
    with pytest.raises(ParseError) as exc:
        _parse_bytes(broken)
    assert exc.value.reason.startswith("invalid JSON")
    assert f"line {line} column" in exc.value.where  # type: ignore[operator]
    assert exc.value.where.startswith("$.traceEvents[")  # type: ignore[union-attr]


def test_a_second_trace_of_the_same_rank_and_steps_is_refused(tmp_path, con, data_dir):
    """The same trace with other content (a trailing newline: re-serialised) has the same calls: refused, not
    counted twice. (Only re-compressed, it is the same content: a duplicate, tests/test_ingest_identity.py.)"""
    import gzip

    from commlens.service.ingest import ingest_paths

    src = data_dir / "kineto-hta" / "nccl_parser_config" / "nccl_data.json.gz"
    again = tmp_path / "rank0-again.json.gz"
    again.write_bytes(gzip.compress(gzip.decompress(src.read_bytes()) + b"\n", compresslevel=1))
    first, second = ingest_paths(con, [src, again], "twice").files
    assert first.status == "ok" and second.status == "failed"
    assert f"rank 0 already has a profiler trace in this run ({src})" in second.error and "steps" in second.error
    assert con.execute("SELECT count(*) FROM comms WHERE run = 'twice'").fetchone()[0] == first.events == 21
