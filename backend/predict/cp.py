"""Context parallelism: ring attention (K and V blocks passed around the ring, forward and backward) and
ATTENTION2D on an r_Q x r_KV mesh (forward from the source, backward derived from the harness's
implementation, harness/cp.py); `harness_ops` is the harness's exact form of both."""

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
    """ATTENTION2D per layer per micro-batch on the r_Q x r_KV mesh; each rank starts with s/c tokens. The
    backward is the transpose of the forward (docs/models.md §6.7). Groups of one rank issue nothing."""
    inp = stage.inp
    m, p, dt = inp.model, inp.parallel, inp.dtypes
    r_q, r_kv = p.cp_mesh
    b, s, w = p.micro_batch_size, m.seq_len, width(dt.act)
    calls = (m.layers // p.pp) * p.micro_batches

    def op(
        o: str, group: str, n: int, size: int, what: str, dtype: str | None = None, calls: int = calls
    ) -> PredictedOp:
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
        ops.append(op("all_gather", "cp:q", r_q, q, "ATTENTION2D Q blocks (fwd); dO blocks (bwd)", calls=2 * calls))
        ops.append(op("reduce_scatter", "cp:q", r_q, q, "ATTENTION2D partial outputs (fwd); dQ (bwd)", calls=2 * calls))
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
        ops.append(
            op(
                "all_gather",
                "cp:q",
                r_q,
                b * (s // r_kv) * m.heads * 4,
                "ATTENTION2D rowsum(dO * O) of the Q block (bwd)",
                "float32",
            )
        )
    if r_kv > 1:
        kv = 2 * b * (s // r_q) * m.h_kv * w
        ops.append(op("all_gather", "cp:kv", r_kv, kv, "ATTENTION2D K and V blocks, fused (fwd)"))
        ops.append(op("reduce_scatter", "cp:kv", r_kv, kv, "ATTENTION2D dK and dV, fused (bwd)"))
    return ops


def attention2d_note(inp: PredictInput, check: ParamCheck | None) -> str | None:
    p = inp.parallel
    if p.cp == 1 or p.cp_style != "attention2d":
        return None
    r_q, r_kv = p.cp_mesh
    return (
        f"ATTENTION2D (§6.7) on an r_Q x r_KV = {r_q} x {r_kv} mesh: forward (Q all_gather and output "
        f"reduce_scatter in groups 'cp:q' of {r_q}, fused K/V all_gather in groups 'cp:kv' of {r_kv}, the fp32 "
        "log-sum-exp exchange as an all_to_all) and backward derived from the harness's implementation (dO "
        "all_gather, fp32 rowsum(dO*O) all_gather and dQ reduce_scatter in 'cp:q', fused dK/dV reduce_scatter in "
        "'cp:kv'). Widths are not divided by tp (the spec does not compose ATTENTION2D with TP); the gradient "
        "reduction still spans dp x cp ranks"
    )


# ------------------------------------------------------------------------------------ the harness


def harness_ops(stage: Stage) -> StageOps:
    """The harness's context-parallel calls per iteration (harness/cp.py; derivation in docs/models.md): per
    layer and micro-batch, with n = s/c local positions and u = b·n·(h/t)·w one local Q (or K, or V) block."""
    inp = stage.inp
    m, p = inp.model, inp.parallel
    if p.cp == 1:
        return StageOps()
    b, n, t, w = p.micro_batch_size, m.seq_len // p.cp, p.tp, width(inp.dtypes.act)
    u = b * n * (m.hidden // t) * w
    per = (m.layers // p.pp) * p.micro_batches

    def op(o: str, group: str, size: int, n_group: int, calls: int, what: str, dtype: str | None = None) -> PredictedOp:
        return PredictedOp(
            scheme="cp",
            group=group,
            group_size=n_group,
            op=o,
            dtype=dtype or inp.dtypes.act,
            msg_bytes=size,
            calls_per_iter=calls * per,
            per_micro_step=True,
            what=what,
        )

    c = p.cp
    if p.cp_style == "ring":
        ops = []
        for o in ("send", "recv"):
            ops.append(
                op(o, "cp", 2 * u, c, c, "K and V blocks (fwd: c-1 hops); dK and dV home to their owner (bwd: 1)")
            )
            ops.append(op(o, "cp", 4 * u, c, c - 1, "K, V, dK, dV blocks around the ring (bwd: c-1 hops)"))
        return StageOps(ops)
    r_q, r_kv = p.cp_mesh
    heads = m.heads // t
    ops = []
    if r_q > 1:
        ops += [
            op("all_gather", "cp_q", r_q * u, r_q, 2, "Q block (fwd) and dO block (bwd)"),
            op("reduce_scatter", "cp_q", r_q * u, r_q, 2, "weighted partial outputs (fwd) and dQ (bwd)"),
            op(
                "all_gather",
                "cp_q",
                r_q * r_q * b * heads * n * 4,
                r_q,
                1,
                "log-sum-exp of the Q block (fwd)",
                "float32",
            ),
            op("all_gather", "cp_q", r_q * b * heads * n * 4, r_q, 1, "rowsum(dO * O) of the Q block (bwd)", "float32"),
        ]
    if r_kv > 1:
        ops += [
            op("all_gather", "cp_kv", r_kv * 2 * u, r_kv, 1, "K and V block, fused (fwd)"),
            op("reduce_scatter", "cp_kv", r_kv * 2 * u, r_kv, 1, "dK and dV, fused (bwd)"),
        ]
    return StageOps(ops)
