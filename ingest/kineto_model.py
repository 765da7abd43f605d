"""Compact records of the Kineto events that describe communication, shared by the grouping
(kineto_events) and the per-call semantics (kineto_calls)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

EPS = 0.002  # µs; Kineto timestamps carry ns fractions
# The communication library's device kernels: NCCL's and RCCL's (`ncclDevKernel_…`, `ncclKernel_…`) and the
# MSCCL kernels RCCL runs some collectives with (`mscclKernel_<redop>_<type>_<proto>[_<fullOps>]`, on by
# default on MI300X), whose names tell no op.
COMM_KERNEL_PREFIXES = ("nccl", "mscclKernel_")
COMM_KERNEL_PREFIXES_BYTES = tuple(p.encode() for p in COMM_KERNEL_PREFIXES)


def comm_kernel(name: str) -> bool:
    """Whether a device kernel of this name is the communication library's."""
    return name.startswith(COMM_KERNEL_PREFIXES)


@dataclass(slots=True)
class CpuEv:
    kind: str  # container | annot
    name: str
    op: str | None
    pid: Any
    tid: Any
    ts: float
    dur: float
    ext: Any
    args: dict[str, Any]  # the args the parse reads, shared by events that carry the same (Collector.compact)
    backend: str | None = None  # for annotations
    seq: Any = None  # PyTorch's collective sequence number (args "Seq"), per event


@dataclass(slots=True)
class Kernel:
    name: str
    ts: float
    dur: float
    ext: Any
    corr: Any
    args: dict[str, Any]  # as CpuEv.args
    seq: Any = None  # as CpuEv.seq


@dataclass(slots=True)
class Label:
    """A `commlens:<dim>:<pg name>` range: the calls inside it are on that group."""

    pid: Any
    tid: Any
    ts: float
    dur: float
    dim: str
    pg: str


@dataclass(slots=True)
class Call:
    root: CpuEv | None
    members: list[CpuEv] = field(default_factory=list)
    kernels: list[Kernel] = field(default_factory=list)
    worker: CpuEv | None = None  # the gloo worker annotation that ran it
    issue_ts: float = 0.0
    label: Label | None = None


@dataclass
class Sizes:
    elems_in: int | None = None
    elems_out: int | None = None
    dtype: str | None = None
    group_size: int | None = None


@dataclass
class TraceContext:
    """What the file says about its job, needed to turn calls into rows."""

    backend: str | None = None  # distributedInfo backend
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)  # pg name -> {ranks, size, desc, uid}
    complete_groups: bool = False  # pg_config lists every group of the job


def as_float(v: Any) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    if isinstance(v, str):
        try:
            f = float(v)
        except ValueError:
            return None
        return f if math.isfinite(f) else None
    return None


def as_int(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        return int(v)
    return None
