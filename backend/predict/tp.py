"""Tensor parallelism with and without sequence parallelism: the activation collectives of every layer, the
vocabulary-parallel embedding and cross-entropy, and the TP share of Megatron's PP scatter/gather."""

from __future__ import annotations

import math

from commlens.contract.predict import PredictedOp

from .adapters import Stage, StageOps, merge, numel, width
from .dp import harness_sync
from .layout import is_sp_param
from .pp import messages

# ------------------------------------------------------------------------------------ frameworks


def _op(stage: Stage, o: str, size: int, calls: int, what: str, dtype: str | None = None) -> PredictedOp:
    inp = stage.inp
    return PredictedOp(
        scheme="tp",
        group="tp",
        group_size=inp.parallel.tp,
        op=o,
        dtype=dtype or inp.dtypes.act,
        msg_bytes=size,
        calls_per_iter=calls,
        per_micro_step=True,
        what=what,
    )


def _activation(stage: Stage) -> int:
    """A: one micro-batch's activations of one layer (b x s/cp x h) in bytes."""
    m, p = stage.inp.model, stage.inp.parallel
    return p.micro_batch_size * (m.seq_len // p.cp) * m.hidden * width(stage.inp.dtypes.act)


def framework_ops(stage: Stage) -> StageOps:
    inp = stage.inp
    m, p, dt = inp.model, inp.parallel, inp.dtypes
    if p.tp == 1:
        return StageOps()
    ops = _sequence_parallel(stage) if p.sp else _plain(stage)
    if stage.last:
        ce = p.micro_batch_size * (m.seq_len // p.cp) * width(dt.loss)
        ops.append(
            _op(
                stage,
                "all_reduce",
                ce,
                3 * p.micro_batches,
                "vocab-parallel cross-entropy (max, target logit, sum exp)",
                dt.loss,
            )
        )
    if p.pp_scatter_gather and p.pp > 1:
        fwd, bwd = messages(p, stage.index)
        if fwd + bwd:
            ops.append(
                _op(
                    stage,
                    "all_gather",
                    _activation(stage),
                    fwd + bwd,
                    "PP scatter/gather: each received activation or gradient re-assembled",
                )
            )
    return StageOps(merge(ops))


def _recomputed(stage: Stage) -> int:
    """Extra forward collectives of full recomputation: two per layer per micro-batch."""
    p = stage.inp.parallel
    return 2 * (stage.inp.model.layers // p.pp) * p.micro_batches if p.recompute == "full" else 0


def _plain(stage: Stage) -> list[PredictedOp]:
    p, a = stage.inp.parallel, _activation(stage)
    mb, l_stage = p.micro_batches, stage.inp.model.layers // p.pp
    ops = [
        _op(
            stage,
            "all_reduce",
            a,
            4 * l_stage * mb + _recomputed(stage),
            "attention and MLP outputs (fwd) and input grads (bwd)",
        )
    ]
    if stage.first:
        ops.append(_op(stage, "all_reduce", a, mb, "vocab-parallel embedding output"))
    if stage.last:
        ops.append(_op(stage, "all_reduce", a, mb, "LM-head input gradient"))
    return ops


def _sequence_parallel(stage: Stage) -> list[PredictedOp]:
    inp = stage.inp
    m, p, a = inp.model, inp.parallel, _activation(stage)
    mb, l_stage, extra = p.micro_batches, m.layers // p.pp, _recomputed(stage)
    ag = (6 if inp.implementation == "megatron" else 4) * l_stage * mb
    ops = [
        _op(stage, "all_gather", a, ag + extra, "sequence-parallel inputs of column-parallel layers"),
        _op(stage, "reduce_scatter", a, 4 * l_stage * mb + extra, "row-parallel outputs and input grads"),
    ]
    ln = (6 * m.hidden * l_stage + (2 * m.hidden if stage.last else 0)) * width(inp.dtypes.grad)
    ops.append(
        PredictedOp(
            scheme="tp",
            group="tp",
            group_size=p.tp,
            op="all_reduce",
            dtype=inp.dtypes.grad,
            msg_bytes=ln,
            calls_per_iter=1,
            what="sequence-parallel LayerNorm and bias gradients",
        )
    )
    if stage.first:
        ops.append(_op(stage, "reduce_scatter", a, mb, "vocab-parallel embedding output"))
    if stage.last:
        ops.append(_op(stage, "all_gather", a, mb, "LM-head input (fwd)"))
        ops.append(_op(stage, "reduce_scatter", a, mb, "LM-head input gradient (bwd)"))
    return ops


# ------------------------------------------------------------------------------------ the harness


def _harness_op(
    stage: Stage, o: str, size: int, calls: int, what: str, dtype: str | None = None, per_micro: bool = True
) -> PredictedOp:
    inp = stage.inp
    return PredictedOp(
        scheme="tp",
        group="tp",
        group_size=inp.parallel.tp,
        op=o,
        dtype=dtype or inp.dtypes.act,
        msg_bytes=size,
        calls_per_iter=calls,
        per_micro_step=per_micro,
        what=what,
    )


def harness_ops(stage: Stage) -> StageOps:
    """The harness's TP collectives; under sequence parallelism the gradient all_reduce of the replicated
    parameters differs between dp replicas when ZeRO-3 shards them (torch.chunk rows per replica)."""
    inp = stage.inp
    m, p = inp.model, inp.parallel
    if p.tp == 1:
        return StageOps()
    s_local = m.seq_len // p.cp  # with context parallelism each rank holds s/cp positions
    a = p.micro_batch_size * s_local * m.hidden * width(inp.dtypes.act)
    n = p.micro_batches * (4 * (m.layers // p.pp) + stage.first + stage.last)
    if not p.sp:
        ops = [
            _harness_op(
                stage,
                "all_reduce",
                a,
                n,
                "row-parallel outputs (fwd) and column-parallel input grads "
                "(bwd); embedding output; LM-head input grad",
            )
        ]
    else:
        ops = [
            _harness_op(stage, "all_gather", a, n, "sequence-parallel gathers (fwd) and their transposes (bwd)"),
            _harness_op(stage, "reduce_scatter", a, n, "sequence-parallel scatters (fwd) and their transposes (bwd)"),
        ]
    if stage.last:
        ops.append(
            _harness_op(
                stage,
                "all_reduce",
                p.micro_batch_size * s_local * 4,
                3 * p.micro_batches,
                "vocab-parallel cross-entropy (max, target logit, sum of exp)",
                dtype="float32",
            )
        )
    return StageOps(ops, _harness_sp_gradients(stage) if p.sp else None)


def _chunk_rows(dim0: int, d: int, r: int) -> int:
    """Rows of torch.chunk(dim0 rows, d)[r] (empty chunks past the end)."""
    c = math.ceil(dim0 / d)
    return max(0, min(c, dim0 - r * c))


def _harness_sp_gradients(stage: Stage) -> list[list[PredictedOp]]:
    """Per dp replica: the all_reduce of the sequence-parallel parameters' gradients (its shard under ZeRO-3)."""
    inp = stage.inp
    d, w, sync = inp.parallel.dp, width(inp.dtypes.act), harness_sync(inp)
    sp_params = [shape for name, shape in stage.params if is_sp_param(name)]
    calls = inp.parallel.micro_batches if sync == "zero2" else 1
    out = []
    for r in range(d):
        if sync == "zero3":
            size = sum(_chunk_rows(s[0], d, r) * (numel(s) // s[0]) for s in sp_params) * w
        else:
            size = sum(numel(s) for s in sp_params) * w
        out.append(
            [
                _harness_op(
                    stage, "all_reduce", size, calls, "sequence-parallel parameter gradients", per_micro=calls > 1
                )
            ]
        )
    return out
