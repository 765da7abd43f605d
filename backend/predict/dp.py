"""Data parallelism: DDP gradient buckets, ZeRO-1/2 flat buffers, ZeRO-3 / FSDP units, for the framework
implementations (their bucket rules) and for the bundled harness (exact: its rebuilt DDP buckets, its flat
buffers padded to a multiple of dp, its FSDP2 units padded per parameter on dim 0). The dp group spans dp x cp
ranks: context-parallel ranks hold the same parameters and reduce gradients together."""

from __future__ import annotations

import math

from commlens.contract.predict import ParamCheck, PredictedOp, PredictInput

from .adapters import Param, Stage, StageOps, chunks, ddp_buckets, merge, numel, width
from .layout import gradient_ready_order

# ------------------------------------------------------------------------------------ frameworks


def _op(stage: Stage, o: str, size: int, calls: int, dtype: str, what: str, per_micro: bool = False) -> PredictedOp:
    p = stage.inp.parallel
    return PredictedOp(
        scheme="dp",
        group="dp",
        group_size=p.dp * p.cp,
        op=o,
        dtype=dtype,
        msg_bytes=size,
        calls_per_iter=calls,
        per_micro_step=per_micro,
        what=what,
    )


def framework_ops(stage: Stage) -> StageOps:
    p = stage.inp.parallel
    if p.dp * p.cp == 1:
        return StageOps()
    if p.zero == 0:
        return StageOps(_gradient_buckets(stage))
    if p.zero in (1, 2):
        return StageOps(merge(_zero12(stage)))
    return StageOps(merge(_zero3(stage)))


def _gradient_buckets(stage: Stage) -> list[PredictedOp]:
    """Gradient all_reduce buckets without ZeRO, by each framework's bucketing rule (paper: one buffer)."""
    inp = stage.inp
    p, dt, b, impl = inp.parallel, inp.dtypes, inp.buckets, inp.implementation
    n_params, w = stage.n_params, width(dt.grad)
    rounds = p.micro_batches if p.sync_every_micro_step else 1
    if impl == "fsdp":
        sizes = ddp_buckets(
            [numel(s) * w for _, s in stage.params], int(b.ddp_bucket_cap_mb * 2**20), b.ddp_first_bucket_bytes
        )
    elif impl == "megatron":
        cap = b.megatron_bucket_params or max(40_000_000, 1_000_000 * p.dp * p.cp)
        sizes = [c * w for c in chunks(n_params, cap)]
    elif impl == "deepspeed":
        sizes = [c * w for c in chunks(n_params, b.deepspeed_reduce_bucket_elems)]
    else:
        sizes = [n_params * w]
    return [
        _op(stage, "all_reduce", s, sizes.count(s) * rounds, dt.grad, "gradient bucket", rounds > 1)
        for s in sorted(set(sizes), reverse=True)
    ]


def _pad(stage: Stage, n: int) -> int:
    """ZeRO's flat buffers are padded to a multiple of the dp group."""
    d = stage.inp.parallel.dp * stage.inp.parallel.cp
    return math.ceil(n / d) * d


def _zero12(stage: Stage) -> list[PredictedOp]:
    inp = stage.inp
    p, dt, b = inp.parallel, inp.dtypes, inp.buckets
    d, flat = p.dp * p.cp, _pad(stage, stage.n_params)
    rs_rounds = p.micro_batches if p.zero == 2 else 1
    ops: list[PredictedOp] = []
    if inp.implementation == "deepspeed":
        ops += [
            _op(
                stage,
                "reduce",
                s * width(dt.grad) // d,
                d * rs_rounds,
                dt.grad,
                "gradient partition to its owner",
                p.zero == 2,
            )
            for s in chunks(flat, b.deepspeed_reduce_bucket_elems)
        ]
        gathered = chunks(flat, b.deepspeed_allgather_bucket_elems)
    else:
        ops += [
            _op(stage, "reduce_scatter", s * width(dt.grad), rs_rounds, dt.grad, "gradients", p.zero == 2)
            for s in chunks(flat, (b.zero_bucket_bytes or 0) // width(dt.grad))
        ]
        gathered = chunks(flat, (b.zero_bucket_bytes or 0) // width(dt.param))
    ops += [_op(stage, "all_gather", s * width(dt.param), 1, dt.param, "updated parameters") for s in gathered]
    return ops


def _zero3(stage: Stage) -> list[PredictedOp]:
    """ZeRO-3 / FSDP FULL_SHARD: per unit (each layer, plus the rest as the root unit) per micro-step.
    DeepSpeed keeps parameters of at most stage3_param_persistence_threshold elements whole: they are not
    gathered per micro-step, their gradients are still reduce-scattered."""
    inp = stage.inp
    dt, mb = inp.dtypes, inp.parallel.micro_batches
    persist = persistent(inp, stage.params)
    units: dict[str, list[int]] = {}  # unit -> [all parameters, gathered parameters]
    for name, shape in stage.params:
        key = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else "root"
        u = units.setdefault(key, [0, 0])
        u[0] += numel(shape)
        u[1] += 0 if name in persist else numel(shape)
    if inp.implementation == "paper":
        units = {"all": [stage.n_params, stage.n_params]}
    ops: list[PredictedOp] = []
    for key, (n, gathered) in units.items():
        if gathered:
            size = _pad(stage, gathered) * width(dt.param)
            ops.append(_op(stage, "all_gather", size, mb, dt.param, f"{key} parameters (forward)", True))
            ops.append(_op(stage, "all_gather", size, mb, dt.param, f"{key} parameters (backward)", True))
        ops.append(_op(stage, "reduce_scatter", _pad(stage, n) * width(dt.grad), mb, dt.grad, f"{key} gradients", True))
    if persist:
        # DeepSpeed's _post_step re-gathers the persistent parameters (each padded to d) once per optimizer step.
        ops.append(
            _op(
                stage,
                "all_gather",
                sum(_pad(stage, c) for c in persist.values()) * width(dt.param),
                1,
                dt.param,
                "persistent parameters after the optimizer step",
            )
        )
    return ops


def persistent(inp: PredictInput, params: list[Param]) -> dict[str, int]:
    """DeepSpeed ZeRO-3 persistent parameters: numel <= stage3_param_persistence_threshold
    (DeepSpeed's mark_persistent_parameters; model_persistence_threshold, unlimited by default, not modelled)."""
    if inp.implementation != "deepspeed" or inp.parallel.zero != 3:
        return {}
    threshold = inp.buckets.deepspeed_param_persistence_threshold
    return {name: numel(shape) for name, shape in params if numel(shape) <= threshold}


def bucketed_note(inp: PredictInput, check: ParamCheck | None) -> str | None:
    return "bucketed DP/ZeRO ops are compared on totals (bucket boundaries are framework internals); ±5 % tolerance"


def micro_step_note(inp: PredictInput, check: ParamCheck | None) -> str | None:
    p = inp.parallel
    if p.zero >= 2 and p.micro_batches > 1:
        return (
            f"ZeRO-{p.zero} communicates gradients every micro-step: {p.micro_batches} micro-steps multiply "
            "that traffic"
        )
    return None


def persistence_note(inp: PredictInput, check: ParamCheck | None) -> str | None:
    p, threshold = inp.parallel, inp.buckets.deepspeed_param_persistence_threshold
    if inp.implementation == "deepspeed" and p.zero == 3 and p.dp * p.cp > 1 and threshold > 0:
        return (
            f"DeepSpeed ZeRO-3 (§6.2): parameters of at most {threshold:,} elements "
            "(stage3_param_persistence_threshold) stay whole on every rank and are not gathered in forward or "
            "backward; their gradients are still reduce-scattered, and DeepSpeed re-gathers them once per optimizer "
            "step (stage3.py _post_step), which the spec leaves out. stage3_prefetch_bucket_size is not modelled "
            "(the spec gives no rule for its counts; it does not change the S-sum)"
        )
    return None


# ------------------------------------------------------------------------------------ the harness


def harness_sync(inp: PredictInput) -> str:
    """How the harness's dp group reduces gradients: none | ddp | allreduce (DDP under PP) | zero1-3. With context
    parallelism the gradients are reduced over dp x cp (Megatron's data-parallel-with-cp group); with expert
    parallelism the dense gradients over dp x ep (the ep ranks are data-parallel replicas for them)."""
    p = inp.parallel
    if p.dp * p.cp * p.ep == 1:
        return "none"
    if p.zero == 0:
        return "ddp" if p.pp == 1 else "allreduce"
    return f"zero{p.zero}"


def _harness_op(stage: Stage, o: str, size: int, calls: int, what: str, per_micro: bool = True) -> PredictedOp:
    inp = stage.inp
    return PredictedOp(
        scheme="dp",
        group="dp" if inp.parallel.cp * inp.parallel.ep == 1 else "dp_cp" if inp.parallel.ep == 1 else "dp_ep",
        group_size=inp.parallel.dp * inp.parallel.cp * inp.parallel.ep,
        op=o,
        dtype=inp.dtypes.act,
        msg_bytes=size,
        calls_per_iter=calls,
        per_micro_step=per_micro,
        what=what,
    )


def harness_ops(stage: Stage) -> StageOps:
    sync = harness_sync(stage.inp)
    if sync == "ddp":
        return StageOps(_harness_ddp(stage))
    if sync == "allreduce":
        w = width(stage.inp.dtypes.act)
        return StageOps([_harness_op(stage, "all_reduce", stage.n_params * w, 1, "flat gradient buffer", False)])
    if sync in ("zero1", "zero2"):
        return StageOps(_harness_zero12(stage, sync == "zero2"))
    if sync == "zero3":
        return StageOps(_harness_fsdp(stage))
    return StageOps()


def ddp_rebuilt_buckets(params: list[Param], w: int, first_cap: int, cap: int) -> list[int]:
    """Bucket bytes after DDP's rebuild: gradient-ready order, a bucket closes once it reaches its limit
    (first limit `first_cap`, then `cap`), the remainder forms the last bucket."""
    buckets: list[int] = []
    current, limit = 0, first_cap
    for _, shape in gradient_ready_order(params):
        current += numel(shape) * w
        if current >= limit:
            buckets.append(current)
            current, limit = 0, cap
    if current:
        buckets.append(current)
    return buckets


def _harness_ddp(stage: Stage) -> list[PredictedOp]:
    p, b = stage.inp.parallel, stage.inp.buckets
    first_cap = b.ddp_first_bucket_bytes or 2**20
    sizes = ddp_rebuilt_buckets(stage.params, width(stage.inp.dtypes.act), first_cap, int(b.ddp_bucket_cap_mb * 2**20))
    rounds = p.micro_batches if p.sync_every_micro_step else 1
    return [
        _harness_op(stage, "all_reduce", size, sizes.count(size) * rounds, "DDP gradient bucket", rounds > 1)
        for size in sorted(set(sizes), reverse=True)
    ]


def _harness_zero12(stage: Stage, every_micro_step: bool) -> list[PredictedOp]:
    p = stage.inp.parallel
    flat = math.ceil(stage.n_params / p.dp) * p.dp * width(stage.inp.dtypes.act)
    return [
        _harness_op(
            stage,
            "reduce_scatter",
            flat,
            p.micro_batches if every_micro_step else 1,
            "flat gradient buffer",
            every_micro_step,
        ),
        _harness_op(stage, "all_gather", flat, 1, "flat parameter buffer after the update", False),
    ]


def fsdp_unit(params: list[Param], d: int) -> int:
    """Elements of an FSDP2 unit's all-gather output: dim 0 of every parameter padded to a multiple of d."""
    return d * sum(math.ceil(shape[0] / d) * (numel(shape) // shape[0]) for _, shape in params)


def _harness_fsdp(stage: Stage) -> list[PredictedOp]:
    """FSDP2 with one unit per block and the rest as the root unit."""
    inp = stage.inp
    d, mb, w = inp.parallel.dp, inp.parallel.micro_batches, width(inp.dtypes.act)
    ops: list[PredictedOp] = []
    for i in range(inp.model.layers // inp.parallel.pp):
        unit = fsdp_unit([(n, s) for n, s in stage.params if n.startswith(f"blocks.{i}.")], d) * w
        ops.append(_harness_op(stage, "all_gather", unit, 2 * mb, f"block {i} parameters (fwd and bwd)"))
        ops.append(_harness_op(stage, "reduce_scatter", unit, mb, f"block {i} gradients"))
    root = [(n, s) for n, s in stage.params if not n.startswith("blocks.")]
    if root:
        unit = fsdp_unit(root, d) * w
        ops.append(_harness_op(stage, "all_gather", unit, mb, "root unit parameters"))
        ops.append(_harness_op(stage, "reduce_scatter", unit, mb, "root unit gradients"))
    return ops


def harness_micro_step_note(inp: PredictInput, check: ParamCheck | None) -> str | None:
    p = inp.parallel
    if p.zero >= 2 and p.micro_batches > 1:
        return f"ZeRO-{p.zero} communicates every micro-step: {p.micro_batches} micro-steps multiply that traffic"
    return None
