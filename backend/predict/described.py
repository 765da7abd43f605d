"""Prediction from a model description (commlens.contract.model_description): the collectives PyTorch's
DistributedDataParallel issues for exactly these parameters and buffers, to the byte (docs/models.md §6.10).

The transformer formulas of the other scheme modules need shapes a CNN or a recommender does not have; a
description lists every tensor instead, so DDP's own rules apply directly: the Reducer's bucket assignment
(gradient-ready order, per dtype, the small first bucket, the cap) and the buffer broadcast before each forward
(coalesced per dtype). Strategies other than DDP are refused by name until their rules are written here."""

from __future__ import annotations

from collections.abc import Callable

from commlens.contract.model_description import (
    DEFAULT_FIRST_BUCKET_BYTES,
    ModelDescription,
    Strategy,
    TensorSpec,
)
from commlens.contract.predict import PredictedOp, Prediction, StagePrediction

from .adapters import merge, totals

Bucket = tuple[str, int]  # (dtype, bytes)


def first_bucket_cap(strategy: Strategy) -> int:
    """The first bucket's cap: as recorded, else PyTorch 2.13's rule (1 MiB with the default cap, the cap itself
    when bucket_cap_mb is set; earlier versions always use 1 MiB, which a description records explicitly)."""
    if strategy.first_bucket_bytes is not None:
        return strategy.first_bucket_bytes
    return DEFAULT_FIRST_BUCKET_BYTES if strategy.bucket_cap_mb is None else strategy.cap_bytes


def assign_by_size(tensors: list[TensorSpec], limits: list[int]) -> list[Bucket]:
    """PyTorch's compute_bucket_assignment_by_size over tensors in the order given: one open bucket per dtype;
    a tensor joins its dtype's bucket, which closes once it holds at least its limit (so a tensor larger than
    the cap closes the bucket it lands in, alone when that bucket was empty); each dtype steps through `limits`
    (the last one repeats); buckets still open at the end follow, in the order their dtypes first appeared."""
    open_: dict[str, list[int]] = {}  # dtype -> [bytes, tensors, limit index]
    out: list[Bucket] = []
    for t in tensors:
        acc = open_.setdefault(t.dtype, [0, 0, 0])
        acc[0] += t.nbytes
        acc[1] += 1
        if acc[0] >= limits[acc[2]]:
            out.append((t.dtype, acc[0]))
            acc[0], acc[1], acc[2] = 0, 0, min(acc[2] + 1, len(limits) - 1)
    out += [(dtype, acc[0]) for dtype, acc in open_.items() if acc[1]]
    return out


def gradient_buckets(desc: ModelDescription) -> list[Bucket]:
    """DDP's buckets after their rebuild at the end of the first iteration: parameters that require gradients in
    gradient-ready order, approximated (as DDP's initial assignment assumes) by reverse registration order."""
    s = desc.strategy
    first, cap = first_bucket_cap(s), s.cap_bytes
    limits = [first, cap] if first < cap else [cap]
    ready = [p for p in reversed(desc.parameters) if p.requires_grad]
    return assign_by_size(ready, limits)


def buffer_broadcasts(desc: ModelDescription) -> list[Bucket]:
    """`_broadcast_coalesced` of every buffer from rank 0 before each forward: per dtype, in chunks of
    broadcast_bucket_bytes (250 MiB), in named_buffers() order; none without buffers or broadcast_buffers."""
    s = desc.strategy
    if not (s.broadcast_buffers and desc.buffers):
        return []
    return assign_by_size(desc.buffers, [s.broadcast_bucket_bytes])


def _ddp_ops(desc: ModelDescription) -> list[PredictedOp]:
    dp = desc.strategy.dp

    def op(name: str, bucket: Bucket, what: str) -> PredictedOp:
        return PredictedOp(
            scheme="dp",
            group="dp",
            group_size=dp,
            op=name,
            dtype=bucket[0],
            msg_bytes=bucket[1],
            calls_per_iter=1,
            what=what,
        )

    return [op("broadcast", b, "buffers (broadcast_buffers)") for b in buffer_broadcasts(desc)] + [
        op("all_reduce", b, "gradient bucket") for b in gradient_buckets(desc)
    ]


# The strategies a description can be predicted for, each with its per-iteration ops of one rank.
STRATEGIES: dict[str, Callable[[ModelDescription], list[PredictedOp]]] = {"ddp": _ddp_ops}


def predict_described(desc: ModelDescription) -> Prediction:
    """Per iteration, the collectives every rank of the data-parallel group issues for this description.
    ValueError for a strategy without rules here."""
    ops_of = STRATEGIES.get(desc.strategy.kind)
    if ops_of is None:
        raise ValueError(
            f"strategy.kind {desc.strategy.kind!r}: predictions from a model description cover "
            f"{', '.join(sorted(STRATEGIES))}; attach a DeepSpeed config or a predictor input for ZeRO/FSDP"
        )
    ops = merge(ops_of(desc))
    n_grad = sum(p.numel for p in desc.parameters if p.requires_grad)
    stage = StagePrediction(
        stage=0, ranks=list(range(desc.strategy.dp)), params_per_rank=n_grad, ops=ops, totals=totals(ops)
    )
    return Prediction(
        implementation="fsdp",  # PyTorch's own data parallelism (DDP/FSDP), as the contract names it
        world_size=desc.strategy.dp,
        param_count=desc.param_count,
        stages=[stage],
        totals=totals(ops),
        notes=[
            f"from the model description {desc.model or '(unnamed)'}: {len(desc.parameters)} parameters "
            f"({desc.param_count:,} elements), {len(desc.buffers)} buffers; DDP buckets as rebuilt after the first "
            f"iteration (reverse registration order), described with PyTorch {desc.torch_version or 'unknown'}"
        ],
    )
