"""What every implementation's scheme predictors share: the stage they are given, what they return, and the
helpers that turn op lists into a stage entry (merging, totals, rank layout, bucketing)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from commlens.contract.predict import PredictedOp, PredictInput, SchemeTotal, StagePrediction
from commlens.vocab import DTYPE_BYTES, busbw_factor

Param = tuple[str, tuple[int, ...]]  # (name, shape); a layout that knows only counts gives shape (count,)


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


@dataclass(frozen=True)
class Stage:
    """One pipeline stage of one input, as every scheme predictor of that input sees it."""

    inp: PredictInput
    index: int
    params: list[Param]  # the parameters one rank of the stage holds, in the implementation's order

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.inp.parallel.pp - 1

    @property
    def n_params(self) -> int:
        return sum(numel(shape) for _, shape in self.params)


@dataclass(frozen=True)
class StageOps:
    """A scheme's ops on one stage: `ops` every rank issues and, when they differ between the stage's
    data-parallel replicas, `by_replica[r]` that replica r issues after every scheme's common ops."""

    ops: list[PredictedOp] = field(default_factory=list)
    by_replica: list[list[PredictedOp]] | None = None


def width(dtype: str) -> int:
    """Bytes of one element of a vocabulary dtype."""
    return DTYPE_BYTES[dtype]


def merge(ops: list[PredictedOp]) -> list[PredictedOp]:
    """Merge entries that share (scheme, group, op, dtype, S), adding calls."""
    merged: dict[tuple[str, str, str, str, int], PredictedOp] = {}
    for o in ops:
        key = (o.scheme, o.group, o.op, o.dtype, o.msg_bytes)
        if key in merged:
            prev = merged[key]
            merged[key] = prev.model_copy(
                update={
                    "calls_per_iter": prev.calls_per_iter + o.calls_per_iter,
                    "what": prev.what if o.what in prev.what else f"{prev.what}; {o.what}",
                }
            )
        else:
            merged[key] = o
    return list(merged.values())


def totals(ops: list[PredictedOp]) -> list[SchemeTotal]:
    """Per-scheme totals of one rank's ops: S-sum, ring wire bytes and the paper's convention (recv apart).
    Byte counts are rounded where calls are means over iterations (MoE routing)."""
    acc: dict[str, list[float]] = {}  # s_sum, wire, paper, recv
    for o in ops:
        a = acc.setdefault(o.scheme, [0, 0.0, 0, 0])
        if o.op == "recv":
            a[3] += o.msg_bytes * o.calls_per_iter
            continue
        a[0] += o.msg_bytes * o.calls_per_iter
        a[1] += o.msg_bytes * busbw_factor(o.op, o.group_size) * o.calls_per_iter
        a[2] += o.msg_bytes * o.calls_per_iter * (2 if o.op == "all_reduce" else 1)
    return [
        SchemeTotal(scheme=scheme, s_sum=round(a[0]), wire_bytes=a[1], paper_bytes=round(a[2]), recv_bytes=round(a[3]))
        for scheme, a in sorted(acc.items())
    ]


def mean_totals(stages: list[StagePrediction]) -> list[SchemeTotal]:
    """Per-rank totals averaged over all ranks of the entries."""
    acc: dict[str, list[float]] = {}
    for st in stages:
        k = len(st.ranks)
        for t in st.totals:
            a = acc.setdefault(t.scheme, [0, 0.0, 0, 0])
            a[0] += t.s_sum * k
            a[1] += t.wire_bytes * k
            a[2] += t.paper_bytes * k
            a[3] += t.recv_bytes * k
    n = sum(len(st.ranks) for st in stages) or 1
    return [
        SchemeTotal(
            scheme=s,
            s_sum=round(a[0] / n),
            wire_bytes=a[1] / n,
            paper_bytes=round(a[2] / n),
            recv_bytes=round(a[3] / n),
        )
        for s, a in sorted(acc.items())
    ]


def stage_ranks(inp: PredictInput, stage: int) -> list[int]:
    """Global ranks of a stage in Megatron's layout, rank = (pp_i * dp + dp_i) * tp + tp_i (cp inside dp)."""
    p = inp.parallel
    per_stage = p.dp * p.ep * p.cp * p.tp
    return list(range(stage * per_stage, (stage + 1) * per_stage))


def replica_ranks(inp: PredictInput, stage: int, replica: int) -> list[int]:
    """Global ranks of one data-parallel replica of a stage (its cp x tp block of the stage's ranks); with expert
    parallelism each (dp, ep) pair is a replica, replica = dp_i · ep + ep_i."""
    p = inp.parallel
    block = p.cp * p.tp
    start = stage * p.dp * p.ep * block + replica * block
    return list(range(start, start + block))


def chunks(total: int, chunk: int) -> list[int]:
    """`total` elements cut into buckets of `chunk` (the last one shorter); one bucket when chunk <= 0."""
    if chunk <= 0 or total <= chunk:
        return [total] if total else []
    full, rest = divmod(total, chunk)
    return [chunk] * full + ([rest] if rest else [])


def ddp_buckets(sizes_bytes: list[int], cap_bytes: int, first_cap: int | None) -> list[int]:
    """PyTorch DDP bucket assignment: tensors in reverse parameter order, a bucket closes once it
    reaches its cap (so it may exceed it by one tensor); the first bucket's cap is `first_cap`."""
    buckets: list[int] = []
    current = 0
    cap = first_cap or cap_bytes
    for size in reversed(sizes_bytes):
        current += size
        if current >= cap:
            buckets.append(current)
            current = 0
            cap = cap_bytes
    if current:
        buckets.append(current)
    return buckets
