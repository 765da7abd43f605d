"""Expert parallelism: the all-to-all-v of a mixture-of-experts layer (docs/models.md §6.9).

Per MoE layer and micro-batch a rank all-to-alls its per-expert counts (int64, N values), dispatches its
(token, expert) rows to the experts' ranks and gets the outputs back (combine); backward runs the transposes
of combine and dispatch. The sizes depend on the routing: from the routing a run recorded they are exact (a
mean over its iterations where they differed); without it they are the expectation under uniform routing,
each with one standard deviation (`spread_bytes`).
"""

from __future__ import annotations

import math
from collections import Counter

from commlens.contract.predict import ParamCheck, PredictedOp, PredictInput

from .adapters import Stage, StageOps, replica_ranks, width


def _tokens(inp: PredictInput) -> int:
    """Tokens one rank routes per micro-batch and layer."""
    m, p = inp.model, inp.parallel
    return p.micro_batch_size * m.seq_len // p.cp


def _op(
    inp: PredictInput, op: str, size: int, calls: float, what: str, dtype: str, spread: float | None
) -> PredictedOp:
    return PredictedOp(
        scheme="ep",
        group="ep",
        group_size=inp.parallel.ep,
        op=op,
        dtype=dtype,
        msg_bytes=size,
        calls_per_iter=int(calls) if float(calls).is_integer() else calls,
        per_micro_step=True,
        what=what,
        spread_bytes=spread,
    )


def ep_ops(stage: Stage) -> StageOps:
    inp = stage.inp
    m, p = inp.model, inp.parallel
    if not m.experts or p.ep == 1:
        return StageOps()
    per = (m.layers // p.pp) * p.micro_batches  # MoE layers x micro-batches: all-to-all rounds per iteration
    counts = _op(inp, "all_to_all", m.experts * 8, per, "per-expert row counts (fwd)", "int64", None)
    if inp.moe_routing:
        return StageOps([], [[counts, *_recorded(stage, r, per)] for r in range(p.dp * p.ep)])
    return StageOps([counts, *_expected(inp, per)])


def _recorded(stage: Stage, replica: int, per: int) -> list[PredictedOp]:
    """Exact sizes from the recorded routing: per round, rows sent (dispatch fwd, combine bwd) and received
    (combine fwd, dispatch bwd), averaged over the recorded iterations."""
    inp = stage.inp
    p = inp.parallel
    row = inp.model.hidden * width(inp.dtypes.act)
    me = replica_ranks(inp, stage.index, replica)[0]
    peers = [replica_ranks(inp, stage.index, replica - replica % p.ep + e)[0] for e in range(p.ep)]
    sizes: Counter[tuple[str, int]] = Counter()
    for it, routing in enumerate(inp.moe_routing):
        missing = [r for r in peers if r not in routing]
        if missing:
            raise ValueError(f"moe_routing[{it}] has no routing for ranks {missing}")
        for r in peers:
            if len(routing[r]) != per or any(len(c) != p.ep for c in routing[r]):
                raise ValueError(
                    f"moe_routing[{it}][{r}]: expected {per} all-to-all rounds (layers x micro-batches) of {p.ep} "
                    "counts (one per ep rank)"
                )
        for c in range(per):
            sizes["sent", sum(routing[me][c]) * row] += 2
            sizes["received", sum(routing[r][c][replica % p.ep] for r in peers) * row] += 2
    n = len(inp.moe_routing)
    what = {
        "sent": "dispatched rows (fwd) and combine gradients (bwd), as routed",
        "received": "expert outputs (combine fwd) and dispatch gradients (bwd), as routed",
    }
    return [_op(inp, "all_to_all", size, k / n, what[kind], inp.dtypes.act, None) for (kind, size), k in sizes.items()]


def _kept_moments(trials: int, p: float, cap: int | None) -> tuple[float, float]:
    """Mean and variance of min(X, cap), X ~ Binomial(trials, p) (X itself when cap is None)."""
    if cap is None:
        return trials * p, trials * p * (1 - p)
    mean = second = 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    for x in range(trials + 1):
        pr = math.exp(
            math.lgamma(trials + 1)
            - math.lgamma(x + 1)
            - math.lgamma(trials - x + 1)
            + x * log_p
            + (trials - x) * log_q
        )
        kept = min(x, cap)
        mean += pr * kept
        second += pr * kept * kept
    return mean, max(second - mean * mean, 0.0)


def expected_rows(inp: PredictInput) -> tuple[float, float, float, float]:
    """(mean, sd) of the rows a rank sends and of the rows it receives per all-to-all round, under uniform
    routing (each token's k experts a uniform draw without repetition)."""
    m, p = inp.model, inp.parallel
    n, k, e, t = m.experts, m.top_k, p.ep, _tokens(inp)
    if m.capacity_factor is None:
        # a token puts a hypergeometric number of its k choices on one ep rank's n/e experts
        var_token = k * (1 / e) * (1 - 1 / e) * ((n - k) / (n - 1) if n > 1 else 0.0)
        return t * k, 0.0, t * k, math.sqrt(e * t * var_token)
    cap = math.ceil(m.capacity_factor * t * k / n)
    mean, var = _kept_moments(t * k, 1 / n, cap)  # kept rows per (rank, expert), experts taken as independent
    return n * mean, math.sqrt(n * var), n * mean, math.sqrt(n * var)


def _expected(inp: PredictInput, per: int) -> list[PredictedOp]:
    row = inp.model.hidden * width(inp.dtypes.act)
    sent, sent_sd, recv, recv_sd = expected_rows(inp)
    # received first: without a capacity cap both sizes expect t·k rows and merge, keeping the received spread
    return [
        _op(
            inp,
            "all_to_all",
            round(recv * row),
            2 * per,
            "expert outputs (fwd), dispatch gradients (bwd): expected",
            inp.dtypes.act,
            recv_sd * row or None,
        ),
        _op(
            inp,
            "all_to_all",
            round(sent * row),
            2 * per,
            "dispatched rows (fwd), combine gradients (bwd): expected",
            inp.dtypes.act,
            sent_sd * row or None,
        ),
    ]


def routing_note(inp: PredictInput, check: ParamCheck | None) -> str | None:
    m, p = inp.model, inp.parallel
    if not m.experts or p.ep == 1:
        return None
    if inp.moe_routing:
        return (
            f"EP all-to-all sizes from the routing recorded for {len(inp.moe_routing)} iteration(s): exact; calls per "
            "iteration are their mean where the sizes changed between iterations"
        )
    cap = "" if m.capacity_factor is None else f", capacity factor {m.capacity_factor:g} (experts taken as independent)"
    return (
        f"EP all-to-all sizes are expectations under uniform top-{m.top_k} routing over {m.experts} experts on "
        f"{p.ep} ranks{cap}; spread_bytes is one standard deviation (docs/models.md §6.9)"
    )
