"""Context parallelism: ring attention (K and V blocks passed around the ring, forward and backward) and
ATTENTION2D's forward on an r_Q x r_KV mesh."""

from __future__ import annotations

from commlens.contract.predict import ParamCheck, PredictedOp, PredictInput

from .adapters import Stage, StageOps, width


def framework_ops(stage: Stage) -> StageOps:
    inp = stage.inp
    m, p, dt = inp.model, inp.parallel, inp.dtypes
    c = p.cp
    if c == 1:
        return StageOps()
    if p.cp_style == "attention2d":
        return StageOps(_attention2d(stage))
    size = 2 * p.micro_batch_size * (m.seq_len // c) * m.h_kv * width(dt.act)
    calls = 3 * (c - 1) * (m.layers // p.pp) * p.micro_batches  # forward c-1 steps, backward about twice that
    return StageOps(
        [
            PredictedOp(
                scheme="cp",
                group="cp:ring",
                group_size=c,
                op=o,
                dtype=dt.act,
                msg_bytes=size,
                calls_per_iter=calls,
                per_micro_step=True,
                what="K and V blocks around the ring (fwd + bwd)",
            )
            for o in ("send", "recv")
        ]
    )


def _attention2d(stage: Stage) -> list[PredictedOp]:
    """ATTENTION2D forward per layer per micro-batch on the r_Q x r_KV mesh; each rank starts with s/c
    tokens. The spec gives no backward pass, so none is predicted. Groups of one rank issue nothing."""
    inp = stage.inp
    m, p, dt = inp.model, inp.parallel, inp.dtypes
    r_q, r_kv = p.cp_mesh
    b, s, w = p.micro_batch_size, m.seq_len, width(dt.act)
    calls = (m.layers // p.pp) * p.micro_batches

    def op(o: str, group: str, n: int, size: int, what: str, dtype: str | None = None) -> PredictedOp:
        return PredictedOp(
            scheme="cp",
            group=group,
            group_size=n,
            op=o,
            dtype=dtype or dt.act,
            msg_bytes=size,
            calls_per_iter=calls,
            per_micro_step=True,
            what=what,
        )

    ops: list[PredictedOp] = []
    if r_q > 1:
        q = b * (s // r_kv) * m.hidden * w
        ops.append(op("all_gather", "cp:q", r_q, q, "ATTENTION2D Q blocks (fwd)"))
        ops.append(op("reduce_scatter", "cp:q", r_q, q, "ATTENTION2D partial outputs (fwd)"))
        # the log-sum-exp statistics that weight the combine: fp32, one per head and token
        ops.append(
            op(
                "all_to_all",
                "cp:q",
                r_q,
                b * (s // r_kv) * m.heads * 4,
                "ATTENTION2D log-sum-exp of partial outputs (fwd)",
                "float32",
            )
        )
    if r_kv > 1:
        ops.append(
            op("all_gather", "cp:kv", r_kv, 2 * b * (s // r_q) * m.h_kv * w, "ATTENTION2D K and V blocks, fused (fwd)")
        )
    return ops


def attention2d_note(inp: PredictInput, check: ParamCheck | None) -> str | None:
    p = inp.parallel
    if p.cp == 1 or p.cp_style != "attention2d":
        return None
    r_q, r_kv = p.cp_mesh
    return (
        f"ATTENTION2D (§6.7) on an r_Q x r_KV = {r_q} x {r_kv} mesh: forward ops only (Q all_gather and output "
        f"reduce_scatter in groups 'cp:q' of {r_q}, fused K/V all_gather in groups 'cp:kv' of {r_kv}, plus the "
        "fp32 log-sum-exp exchange as an all_to_all). The spec does not give the backward pass, so it is not "
        "included: measured CP traffic should exceed this prediction. Widths are not divided by tp (the spec does "
        "not compose ATTENTION2D with TP); the gradient reduction still spans dp x cp ranks"
    )
