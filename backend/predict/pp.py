"""Pipeline parallelism: point-to-point activations and their gradients between neighbouring stages (with
interleaving and Megatron's scatter/gather), and the tied-embedding gradient between the first and last stage."""

from __future__ import annotations

from commlens.contract.predict import ParallelSpec, ParamCheck, PredictedOp, PredictInput

from .adapters import Stage, StageOps, width


def messages(p: ParallelSpec, stage: int) -> tuple[int, int]:
    """(messages sent to the next stage, messages sent to the previous stage) per iteration; each has a
    matching recv from that same neighbour."""
    mb, v = p.micro_batches, p.virtual_stages
    first, last = stage == 0, stage == p.pp - 1
    fwd = mb * (v - 1 if last else v) if v > 1 else (0 if last else mb)
    bwd = mb * (v - 1 if first else v) if v > 1 else (0 if first else mb)
    return fwd, bwd


def framework_ops(stage: Stage) -> StageOps:
    inp = stage.inp
    m, p, dt = inp.model, inp.parallel, inp.dtypes
    if p.pp == 1:
        return StageOps()
    a = p.micro_batch_size * (m.seq_len // p.cp) * m.hidden * width(dt.act)
    size = a // p.tp if p.sp or p.pp_scatter_gather else a
    fwd, bwd = messages(p, stage.index)

    def op(o: str, group: str, calls: int, what: str) -> PredictedOp:
        return PredictedOp(
            scheme="pp",
            group=group,
            group_size=2,
            op=o,
            dtype=dt.act,
            msg_bytes=size,
            calls_per_iter=calls,
            per_micro_step=True,
            what=what,
        )

    ops: list[PredictedOp] = []
    if fwd:
        ops.append(op("send", "pp:next", fwd, "activations to the next stage"))
        ops.append(op("recv", "pp:next", fwd, "activation gradients from the next stage"))
    if bwd:
        ops.append(op("send", "pp:prev", bwd, "activation gradients to the previous stage"))
        ops.append(op("recv", "pp:prev", bwd, "activations from the previous stage"))
    if m.tied_embeddings and (stage.first or stage.last):
        grad = m.padded_vocab(p.tp) * m.hidden * width(dt.grad) // p.tp
        ops.append(
            PredictedOp(
                scheme="pp",
                group="pp:embedding",
                group_size=2,
                op="all_reduce",
                dtype=dt.grad,
                msg_bytes=grad,
                calls_per_iter=1,
                what="tied embedding gradient (first and last stage)",
            )
        )
    return StageOps(ops)


def harness_ops(stage: Stage) -> StageOps:
    """The harness's 1F1B / GPipe send and recv: one of each per micro-batch and neighbour."""
    inp = stage.inp
    m, p = inp.model, inp.parallel
    if p.pp == 1:
        return StageOps()
    seq = m.seq_len // p.tp if p.sp else m.seq_len
    size = p.micro_batch_size * seq * m.hidden * width(inp.dtypes.act)
    ops: list[PredictedOp] = []
    for group, present, what in (
        ("pp:prev", not stage.first, "activation gradients / activations"),
        ("pp:next", not stage.last, "activations / activation gradients"),
    ):
        if present:
            ops += [
                PredictedOp(
                    scheme="pp",
                    group=group,
                    group_size=2,
                    op=o,
                    dtype=inp.dtypes.act,
                    msg_bytes=size,
                    calls_per_iter=p.micro_batches,
                    per_micro_step=True,
                    what=what,
                )
                for o in ("send", "recv")
            ]
    return StageOps(ops)


def scatter_gather_note(inp: PredictInput, check: ParamCheck | None) -> str | None:
    p = inp.parallel
    if not p.pp_scatter_gather:
        return None
    return (
        "PP scatter/gather (§6.5): each TP rank sends and receives A/t, and every received message is followed "
        "by an all_gather (S = A) in the TP group. Assumed in both directions, activations (forward) and their "
        "gradients (backward): Megatron's p2p _communicate splits every tensor it sends and gathers every tensor "
        "it receives, send_forward and send_backward alike; PTD-P §4.1 describes only the forward"
        + (" (no effect with pp = 1)" if p.pp == 1 else "")
    )
