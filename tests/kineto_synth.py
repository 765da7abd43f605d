"""A long synthetic Kineto trace built from the event shapes of a real one (tests and bench/stream.py).

The real DDP ResNet-50 trace (`nccl_data.json.gz`) gives one all-reduce's events as PyTorch wrote them, in
Kineto's key order: the `record_param_comms` CPU op with its metadata, the `nccl:all_reduce` annotation, the
`cudaLaunchKernelExC` runtime launch and the NCCL kernel with its copy of the metadata. They are repeated
with fresh External ids, correlation ids and times; like Kineto, each block of calls lists its CPU events
first and its device events after them. One `ProfilerStep#n` range spans each block.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import IO, Any

import orjson

EVENTS_PER_CALL = 4
STEP_CALLS = 1000  # calls per profiler step (and per block of CPU events, then device events)


def _templates(src: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The trace's header (everything but traceEvents) and one all-reduce's four events."""
    doc = orjson.loads(gzip.decompress(src.read_bytes()))
    events = doc.pop("traceEvents")
    rpc = next(
        e
        for e in events
        if e.get("name") == "record_param_comms" and (e.get("args") or {}).get("Collective name") == "allreduce"
    )
    ext = rpc["args"]["External id"]
    end = rpc["ts"] + rpc["dur"]
    annot = next(
        e
        for e in events
        if e.get("name") == "nccl:all_reduce" and e["tid"] == rpc["tid"] and rpc["ts"] <= e["ts"] <= end
    )
    launch = next(
        e
        for e in events
        if e.get("cat") == "cuda_runtime"
        and "LaunchKernel" in e.get("name", "")
        and (e.get("args") or {}).get("External id") == ext
    )
    kernel = next(
        e
        for e in events
        if e.get("cat") == "kernel" and (e.get("args") or {}).get("correlation") == launch["args"]["correlation"]
    )
    return doc, [rpc, annot, launch, kernel]


def write_trace(src: Path, calls: int, out: IO[bytes], elems: int = 1024) -> int:
    """Write a trace of `calls` small all-reduces (`elems` float32 elements each) to `out`; the number of
    events written (EVENTS_PER_CALL per call plus one ProfilerStep per STEP_CALLS calls)."""
    head, (rpc, annot, launch, kernel) = _templates(src)
    t0 = rpc["ts"]
    period = 40.0  # µs between calls; each call's CPU op and kernel fit inside it
    rpc = {**rpc, "dur": 20.0, "args": {**rpc["args"], "In msg nelems": elems, "Out msg nelems": elems}}
    annot = {**annot, "dur": 10.0}
    kernel = {
        **kernel,
        "dur": 15.0,
        "args": {**kernel["args"], "In msg nelems": elems, "Out msg nelems": elems},
    }
    offsets = [2.0, 5.0, 12.0]  # annotation, launch, kernel after the CPU op's start
    header = orjson.dumps(head)[:-1] + b',"traceEvents":[\n'
    out.write(header)
    written = 0
    first = True
    for block in range(0, calls, STEP_CALLS):
        n = min(STEP_CALLS, calls - block)
        cpu: list[bytes] = []
        dev: list[bytes] = []
        start = t0 + block * period
        cpu.append(
            orjson.dumps(
                {
                    "ph": "X",
                    "cat": "user_annotation",
                    "name": f"ProfilerStep#{block // STEP_CALLS}",
                    "pid": rpc["pid"],
                    "tid": rpc["tid"],
                    "ts": start - 1.0,
                    "dur": n * period,
                    "args": {"External id": 1, "Record function id": 0},
                }
            )
        )
        for i in range(block, block + n):
            ts = t0 + i * period
            ext = 10 + 2 * i
            corr = 10 + i
            cpu.append(orjson.dumps({**rpc, "ts": ts, "args": {**rpc["args"], "External id": ext, "Ev Idx": i}}))
            cpu.append(
                orjson.dumps({**annot, "ts": ts + offsets[0], "args": {**annot["args"], "External id": ext + 1}})
            )
            cpu.append(
                orjson.dumps(
                    {
                        **launch,
                        "ts": ts + offsets[1],
                        "args": {**launch["args"], "External id": ext, "correlation": corr},
                    }
                )
            )
            dev.append(
                orjson.dumps(
                    {
                        **kernel,
                        "ts": ts + offsets[2],
                        "args": {**kernel["args"], "External id": ext, "correlation": corr},
                    }
                )
            )
        chunk = b",\n".join(cpu + dev)
        out.write(chunk if first else b",\n" + chunk)
        first = False
        written += len(cpu) + len(dev)
    out.write(b"\n]}\n")
    return written


def write_trace_gz(src: Path, calls: int, path: Path, elems: int = 1024) -> int:
    """write_trace into a gzip file (level 1: the generator is not what is measured)."""
    with gzip.open(path, "wb", compresslevel=1) as f:
        return write_trace(src, calls, f, elems)  # type: ignore[arg-type]
