"""Kineto trace shapes seen in the wild (PyTorch 2.3-2.8 on CUDA and ROCm) that the shared real traces do
not cover, each written by the test itself: every trace is read by the reference object path, the
columnar path and (for the long ones) the block reader, which must agree row for row, and the rows are
checked against what the trace says (docs/formats.md B)."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import orjson
import pytest
from parse_compare import assert_same_parse, count_block_events

from commlens.ingest import kineto, kineto_json
from commlens.ingest.inputs import iter_inputs
from commlens.ingest.parse_file import parse_file
from commlens.ingest.records import ParseResult, RankHint

DIST = {"backend": "nccl", "rank": 1, "world_size": 8}


def _x(name: str, ts: float, dur: float, cat: str = "cpu_op", pid: int = 1, tid: int = 1, **args: Any) -> dict:
    """A complete event in Kineto's key order."""
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _write(path: Path, events: list[dict], **top: Any) -> Path:
    """One event per line, as Kineto writes them (the block reader cuts at these separators)."""
    head = orjson.dumps({"schemaVersion": 1, "distributedInfo": DIST, **top})[:-1] + b',"traceEvents":[\n'
    path.write_bytes(gzip.compress(head + b",\n".join(orjson.dumps(e) for e in events) + b"\n]}\n", 1))
    return path


def _parse(path: Path, monkeypatch: pytest.MonkeyPatch, columnar: bool, blocks: bool) -> ParseResult:
    monkeypatch.setattr(kineto, "COLUMNAR", columnar)
    monkeypatch.setattr(kineto, "BLOCKS", blocks)
    parsed = parse_file(next(iter_inputs([path])), RankHint())
    assert parsed.result is not None, parsed.error
    return parsed.result


def _read(path: Path, monkeypatch: pytest.MonkeyPatch, min_block_events: int = 0) -> ParseResult:
    """The parse by the reference path, checked equal to the columnar path's and to the block reader's
    (offered every window past the exact prefix, of which it must take `min_block_events` events)."""
    reference = _parse(path, monkeypatch, columnar=False, blocks=False)
    assert_same_parse(_parse(path, monkeypatch, columnar=True, blocks=False), reference)
    taken = count_block_events(monkeypatch)
    monkeypatch.setattr(kineto_json, "DENSE", 0)
    monkeypatch.setattr(kineto_json, "BLOCK_PAUSE", 0)
    blocks = _parse(path, monkeypatch, columnar=True, blocks=True)
    assert_same_parse(blocks, reference, scan_keys=("nccl_kernels", "launches", "kernel_link"))
    assert taken[0] >= min_block_events, taken
    return reference


def _rows(res: ParseResult, *keys: str) -> list[tuple]:
    return [tuple(e[k] for k in keys) for e in res.all_events()]


def _intervals(res: ParseResult) -> list[tuple]:
    t = res.tables()["timeline_intervals"].to_pydict()
    return sorted(zip(t["kind"], t["start_us"], t["end_us"], strict=True))


# ------------------------------------------------------------------------------ ROCm: RCCL's MSCCL kernels

ALLREDUCE = {
    "Collective name": "allreduce",
    "dtype": "BFloat16",
    "In msg nelems": 1024,
    "Out msg nelems": 1024,
    "Group size": 8,
    "Process Group Name": "0",
    "Process Group Description": "default_pg",
    "Process Group Ranks": "[0, 1, 2, 3, 4, 5, 6, 7]",
}
# RCCL on MI300X runs small all-reduces with MSCCL by default: its kernels are not named nccl*.
ROCM_KERNELS = (
    "mscclKernel_Sum_hip_bfloat16_Simple_false(ncclDevComm*, mscclAlgo*, mscclWork*)",
    "ncclDevKernel_Generic_1(ncclDevComm*, channelMasks, ncclWork*)",
    "mscclKernel_Sum_half_Simple(ncclDevComm*, mscclAlgo*, mscclWork*)",
)


def _rocm_calls(n: int) -> list[dict]:
    """n all-reduces as PyTorch on ROCm writes them: the c10d op, record_param_comms, the nccl: annotation,
    the hipExtLaunchKernel launch, then (after all CPU events, as Kineto lists them) the kernels."""
    cpu, dev = [_x("ProfilerStep#5", 0, 100.0 * n + 100, cat="user_annotation")], []
    for i in range(n):
        t, ext, corr = 100.0 * i + 10, 10 * i + 10, 5000 + i
        cpu += [
            _x("c10d::allreduce_", t, 50, **{"External id": ext}),
            _x("record_param_comms", t + 5, 40, **{"External id": ext + 1}, **ALLREDUCE),
            _x("nccl:all_reduce", t + 10, 20, cat="user_annotation", **{"External id": ext + 2}),
            _x("hipExtLaunchKernel", t + 15, 3, cat="cuda_runtime", **{"External id": ext + 1, "correlation": corr}),
        ]
        kernel = ROCM_KERNELS[i % len(ROCM_KERNELS)]
        args = {"External id": ext + 1, "device": 1, "stream": 3, "correlation": corr}
        dev.append(_x(kernel, t + 30, 40.5, cat="kernel", pid=1, tid=3, **args))
    return cpu + dev


# within the exact prefix; past it (by the scanner and the block reader)
@pytest.mark.parametrize(("calls", "block_events"), [(3, 0), (6000, 10_000)])
def test_rccl_msccl_kernels_time_their_calls(
    calls: int, block_events: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    res = _read(_write(tmp_path / "rocm.json.gz", _rocm_calls(calls)), monkeypatch, block_events)
    rows = _rows(res, "op", "msg_bytes", "group_size", "ts_us", "dur_us", "dur_source", "step")
    assert rows == [("all_reduce", 2048, 8, 100.0 * i + 40, 40.5, "kernel", 5) for i in range(calls)]
    # their device time is communication, not compute
    assert {kind for kind, *_ in _intervals(res)} == {"comm"}
    assert res.meta["scan"]["nccl_kernels"] == calls


def test_msccl_kernel_without_metadata_takes_its_dtype_from_the_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = [
        _x("c10d::allreduce_", 10, 50, **{"External id": 1}),
        _x("nccl:all_reduce", 12, 20, cat="user_annotation", **{"Input Dims": [[4096]], "Input type": ["unknown"]}),
        _x("hipExtLaunchKernel", 15, 3, cat="cuda_runtime", **{"External id": 1, "correlation": 7}),
        _x(ROCM_KERNELS[0], 30, 12.0, cat="kernel", tid=3, **{"External id": 1, "correlation": 7, "stream": 3}),
    ]
    res = _read(_write(tmp_path / "rocm_old.json.gz", events), monkeypatch)
    assert _rows(res, "op", "dtype", "dur_us", "dur_source") == [("all_reduce", "bfloat16", 12.0, "kernel")]


# ------------------------------------------------------------------------------ NCCL 2.27+ symmetric kernels

# vLLM / PyNCCL on registered (symmetric) buffers, replayed in a CUDA graph: the kernels have no c10d op,
# only the graph launch inside the profiler step, so their names must tell the op.
SYMMETRIC = (
    ("ncclSymDevKernel_AllReduce_RSxLD_AGxST_sum_bf16(ncclSymDevArgs)", "all_reduce", "bfloat16"),
    ("ncclSymDevKernel_AllGather_LL(ncclSymDevArgs)", "all_gather", None),
    ("ncclSymDevKernel_ReduceScatter_LL_sum_f8e5m2(ncclSymDevArgs)", "reduce_scatter", "float8_e5m2"),
    ("ncclSymkDevKernel_AllReduce_AGxLLMC_R_sum_bf16(ncclSymkDevWorkArgs4K)", "all_reduce", "bfloat16"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all_reduce", "bfloat16"),
)


def test_symmetric_kernels_of_a_graph_replay_are_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events = [
        _x("ProfilerStep#2", 0, 1000, cat="user_annotation", **{"External id": 1}),
        _x("cudaGraphLaunch", 10, 5, cat="cuda_runtime", **{"External id": 1, "correlation": 50}),
    ]
    for i, (name, _, _) in enumerate(SYMMETRIC):
        args = {"External id": 1, "correlation": 50, "stream": 7}
        events.append(_x(name, 100 + 50 * i, 20, cat="kernel", pid=0, tid=7, **args))
    res = _read(_write(tmp_path / "graph.json.gz", events), monkeypatch)
    assert _rows(res, "op", "dtype", "ts_us", "dur_us", "dur_source", "step") == [
        (op, dtype, 100.0 + 50 * i, 20.0, "kernel", 2) for i, (_, op, dtype) in enumerate(SYMMETRIC)
    ]
    assert res.skipped == {}


# ------------------------------------------------------------------------------ FSDP2's ranges and copy ops

ALL_GATHER = {
    "Collective name": "_allgather_base",
    "dtype": "BFloat16",
    "In msg nelems": 1000,
    "Out msg nelems": 8000,
    "Group size": 8,
    "Process Group Name": "0",
    "Process Group Ranks": "[0, 1, 2, 3, 4, 5, 6, 7]",
}


def _fsdp2_layers(n: int) -> list[dict]:
    """fully_shard's unshard of n layers as torch 2.4+ records it: the `FSDP::all_gather (<fqn>)` range
    around the `fsdp::all_gather_copy_in` op and the c10d all-gather, then `FSDP::all_gather_copy_out`;
    and one op of a namespace commlens does not read, which is warned about."""
    events = [_x("ProfilerStep#1", 0, 1000.0 * n + 1000, cat="user_annotation")]
    for i in range(n):
        t, ext = 100 + 1000.0 * i, 10 * i + 10
        events += [
            _x(f"FSDP::pre_forward (layers.{i})", t, 900, cat="user_annotation"),
            _x(f"FSDP::all_gather (layers.{i})", t + 1, 300, cat="user_annotation"),
            _x("fsdp::all_gather_copy_in", t + 2, 50, **{"External id": ext}),
            _x("c10d::_allgather_base_", t + 60, 100, **{"External id": ext + 1}),
            _x("record_param_comms", t + 65, 80, **{"External id": ext + 2}, **ALL_GATHER),
            _x("nccl:_all_gather_base", t + 70, 20, cat="user_annotation", **{"External id": ext + 3}),
            _x(f"FSDP::all_gather_copy_out (layers.{i})", t + 400, 100, cat="user_annotation"),
            _x("fsdp::split_with_sizes_copy", t + 401, 90),
        ]
    return [*events, _x("trtllm::allreduce", 1000.0 * n + 500, 5)]


@pytest.mark.parametrize(("layers", "block_events"), [(3, 0), (3000, 5000)])
def test_fsdp2_ranges_are_not_collectives_commlens_missed(
    layers: int, block_events: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    res = _read(_write(tmp_path / "fsdp2.json.gz", _fsdp2_layers(layers)), monkeypatch, block_events)
    assert (
        _rows(res, "op", "raw_name", "msg_bytes", "group_size")
        == [("all_gather", "c10d::_allgather_base_", 16000, 8)] * layers
    )
    # no warning per layer that FSDP::all_gather (layers.N) looks like a collective that was not counted
    assert res.warnings == [
        "1 events named 'trtllm::allreduce' look like a collective but are not understood: not counted"
    ]


# ------------------------------------------------------------------------------ coalescing groups

BROADCAST = {
    "Collective name": "broadcast",
    "dtype": "Float",
    "In msg nelems": 100,
    "Out msg nelems": 100,
    "Group size": 2,
    "Process Group Name": "0",
}


def _launch_ids(link: str, ext: int, corr: int) -> dict:
    """A launch's ids: the launching op's External id (newer Kineto), or the correlation id alone."""
    return {"External id": ext, "correlation": corr} if link == "external_id" else {"correlation": corr}


def _coalesced_groups(n: int, link: str) -> list[dict]:
    """n `_coalescing_manager` groups of two broadcasts (outside its fast path, like batch_isend_irecv):
    each broadcast's c10d op and record_param_comms, then at the group's end ProcessGroupNCCL's
    `nccl:coalesced` work around the launch of the one kernel that runs them all; an all-reduce after
    each group, issued while the `nccl:coalesced` range (ended when the work completes) is still open.
    `link`: how kernels name their launch (External id, or older traces' correlation id)."""
    cpu, dev = [_x("ProfilerStep#1", 0, 1000.0 * n + 1000, cat="user_annotation", **{"External id": 1})], []
    for i in range(n):
        t, ext, corr = 100 + 1000.0 * i, 10 * i + 10, 5000 + 2 * i
        for j in range(2):
            cpu += [
                _x("c10d::broadcast_", t + 30 * j, 20, **{"External id": ext + 2 * j}),
                _x("record_param_comms", t + 30 * j + 2, 10, **{"External id": ext + 2 * j + 1}, **BROADCAST),
            ]
        cpu += [
            _x("nccl:coalesced", t + 80, 500, cat="user_annotation", **{"External id": ext + 4}),
            _x("cudaLaunchKernel", t + 85, 3, cat="cuda_runtime", **_launch_ids(link, ext + 4, corr)),
            _x("c10d::allreduce_", t + 200, 50, **{"External id": ext + 5}),
            _x("record_param_comms", t + 202, 40, **{"External id": ext + 6}, **ALLREDUCE),
            _x("cudaLaunchKernel", t + 210, 3, cat="cuda_runtime", **_launch_ids(link, ext + 6, corr + 1)),
        ]
        for k, (name, at) in enumerate(
            [
                ("ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)", t + 90),
                ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", t + 300),
            ]
        ):
            ids = {"External id": corr + k if link == "correlation" else ext + 4 + 2 * k, "correlation": corr + k}
            dev.append(_x(name, at, 50, cat="kernel", pid=0, tid=7, **ids))
    return cpu + dev


@pytest.mark.parametrize("link", ["external_id", "correlation"])
@pytest.mark.parametrize(("groups", "block_events"), [(2, 0), (2000, 5000)])
def test_kernel_of_a_coalescing_group_is_not_a_call_of_its_own(
    link: str, groups: int, block_events: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    res = _read(_write(tmp_path / "coalesced.json.gz", _coalesced_groups(groups, link)), monkeypatch, block_events)
    rows = _rows(res, "op", "msg_bytes", "dur_us", "dur_source")
    # the two broadcasts once each (no duration: one kernel ran both), not a third kernel-only broadcast
    assert rows == ([("broadcast", 400, None, None)] * 2 + [("all_reduce", 2048, 50.0, "kernel")]) * groups
    assert res.skipped == {
        "NCCL kernel of a coalescing group ('nccl:coalesced')": groups,
        "annotation 'nccl:coalesced' (not a collective)": groups,
    }
    if groups > 10:  # the first 16 launches tell the link
        assert res.meta["scan"]["kernel_link"] == link


# ------------------------------------------------------------------------------ newer dtypes

NEW_DTYPES = [
    ("Float8_e4m3fnuz", "float8_e4m3fnuz", 1),  # ROCm MI300 fp8
    ("Float8_e5m2fnuz", "float8_e5m2fnuz", 1),
    ("Float8_e8m0fnu", "float8_e8m0fnu", 1),
    ("UInt16", "uint16", 2),
    ("ComplexHalf", "complex32", 4),
]


@pytest.mark.parametrize(("c10", "dtype", "size"), NEW_DTYPES)
def test_newer_dtypes_are_sized(c10: str, dtype: str, size: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """record_param_comms of these c10 types gave dtype and msg_bytes NULL, without a word."""
    events = _rocm_calls(2)
    for e in events:
        if e["name"] == "record_param_comms":
            e["args"]["dtype"] = c10
    res = _read(_write(tmp_path / "dtypes.json.gz", events), monkeypatch)
    assert _rows(res, "op", "dtype", "msg_bytes") == [("all_reduce", dtype, 1024 * size)] * 2
