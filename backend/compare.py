"""Predicted against measured: per scheme bytes per iteration per rank, per (op, dtype, S) calls,
calls measured but not predicted and predicted but missing, and inferences for runs without a config.

Measured calls count only inside complete iterations (profiler steps for traces, detected periods
for NCCL logs), so set-up traffic stays out, as the models require (docs/models.md §8.4). Measured
counts come from the run's aggregates (comm_agg), not from the calls themselves."""

from __future__ import annotations

from collections import defaultdict
from typing import Literal

import duckdb
from pydantic import BaseModel

from commlens.ingest import store
from commlens.ingest.aggregates import ensure_fresh
from commlens.vocab import DTYPE_BYTES, busbw_factor

from .iterations import iteration_info
from .models import ComparisonInput, SchemeComparison as FindingsSchemeComparison
from .predict import ParamCheck, Prediction, PredictInput, StagePrediction, predict
from .predict_harness import predict_input_from_config

OpKey = tuple[str, str, str | None, int | None]  # scheme, op, dtype, msg_bytes


class OpComparison(BaseModel):
    scheme: str
    op: str
    dtype: str | None
    msg_bytes: int | None
    predicted_calls_per_iter: float
    measured_calls_per_iter: float
    difference: float  # measured - predicted
    # bucketed: a DP/ZeRO op of a framework prediction, compared on the scheme total only (bucket
    # boundaries are framework internals, volume-models.md §1.3)
    status: Literal["match", "more", "fewer", "unexplained", "missing", "bucketed"]


class SchemeResult(BaseModel):
    scheme: str
    predicted_bytes_per_iter: float  # S-sum of sent ops per rank per iteration
    measured_bytes_per_iter: float  # every measured call, explained or not
    unexplained_bytes_per_iter: float  # measured calls the model does not contain (not charged, §1.3)
    ratio: float | None  # (measured - unexplained) / predicted
    predicted_wire_bytes_per_iter: float
    measured_wire_bytes_per_iter: float
    ops: list[OpComparison]


class Inference(BaseModel):
    quantity: str
    value: float
    evidence: str


class Comparison(BaseModel):
    run: str
    config_source: Literal["run", "supplied", "none"]
    implementation: str | None
    iterations_mode: str
    iterations_message: str
    ranks: list[str]  # rank keys measured (global rank, else process)
    exact: bool  # every (op, dtype, S) count equal, nothing unexplained or missing
    schemes: list[SchemeResult]
    unexplained: list[OpComparison]
    missing: list[OpComparison]
    inferences: list[Inference]
    notes: list[str]
    # the prediction's parameter counts against the run's recorded ones (None: nothing recorded); a
    # disagreement means the config does not describe the model that ran, so no exactness is claimed
    param_check: ParamCheck | None = None

    def findings_input(self, tolerance: float = 0.05) -> ComparisonInput:
        per = []
        for s in self.schemes:
            unexplained = [o for o in self.unexplained if o.scheme == s.scheme]
            per.append(FindingsSchemeComparison(
                scheme=s.scheme, predicted_bytes=s.predicted_bytes_per_iter,
                measured_bytes=s.measured_bytes_per_iter - s.unexplained_bytes_per_iter,
                unexplained_calls=round(sum(o.measured_calls_per_iter for o in unexplained)),
                unexplained_bytes=sum((o.msg_bytes or 0) * o.measured_calls_per_iter for o in unexplained if o.op != "recv"),
            ))
        return ComparisonInput(per_scheme=per, tolerance=tolerance)


def _measured(con: duckdb.DuckDBPyConnection, run: str) -> tuple[dict[str, dict[OpKey, int]], dict[str, int], str, str]:
    """Calls per rank key and (scheme, op, dtype, S) inside complete iterations; iterations per rank key."""
    run_id = store.get_run_id(con, run)
    if run_id is None:
        raise KeyError(f"no run named {run!r}")
    ensure_fresh(con, run_id)
    info = iteration_info(con, run, run_id)
    rows = con.execute(
        """
        SELECT a.rank_key AS rk, coalesce(g.scheme, 'other') AS scheme, a.op, a.dtype, a.msg_bytes, sum(a.calls)
        FROM comm_agg a
        LEFT JOIN process_groups g ON g.run_id = a.run_id AND g.group_key = a.group_key
        WHERE a.run_id = ? AND a.in_iteration
        GROUP BY ALL
        """,
        [run_id],
    ).fetchall()
    calls: dict[str, dict[OpKey, int]] = defaultdict(dict)
    for rk, scheme, op, dtype, size, n in rows:
        calls[rk][(scheme, op, dtype, size)] = n
    return calls, dict(info.iterations), info.mode, info.message


def _entry_for(pred: Prediction, rank_key: str) -> StagePrediction | None:
    if not rank_key.lstrip("-").isdigit():
        return None
    rank = int(rank_key)
    return next((st for st in pred.stages if rank in st.ranks), None)


def _predicted_per_rank(pred: Prediction, rank_keys: list[str]) -> dict[str, dict[OpKey, float]]:
    """Predicted calls per iteration for each measured rank (the mean over all ranks when a rank is unknown)."""
    world = sum(len(st.ranks) for st in pred.stages) or 1
    mean: dict[OpKey, float] = defaultdict(float)
    for st in pred.stages:
        for o in st.ops:
            mean[(o.scheme, o.op, o.dtype, o.msg_bytes)] += o.calls_per_iter * len(st.ranks) / world
    out: dict[str, dict[OpKey, float]] = {}
    for rk in rank_keys:
        st = _entry_for(pred, rk)
        if st is None:
            out[rk] = dict(mean)
            continue
        calls: dict[OpKey, float] = defaultdict(float)
        for o in st.ops:
            calls[(o.scheme, o.op, o.dtype, o.msg_bytes)] += o.calls_per_iter
        out[rk] = calls
    return out


def _group_sizes(pred: Prediction | None) -> dict[tuple[str, str], int]:
    sizes: dict[tuple[str, str], int] = {}
    if pred:
        for st in pred.stages:
            for o in st.ops:
                sizes[(o.scheme, o.op)] = o.group_size
    return sizes


def compare(con: duckdb.DuckDBPyConnection, run: str, config: PredictInput | None = None) -> Comparison:
    """Predicted against measured for a run; `config` overrides (or supplies) the run's configuration."""
    calls, iterations, mode, message = _measured(con, run)
    notes: list[str] = []
    source: Literal["run", "supplied", "none"] = "supplied" if config else "none"
    if config is None:
        row = con.execute("SELECT config FROM runs WHERE name = ?", [run]).fetchone()
        if row and row[0]:
            import json

            try:
                config = predict_input_from_config(json.loads(row[0]))
                source = "run"
            except ValueError as exc:
                notes.append(f"the run's config could not be used for a prediction: {exc}")
    pred = predict(config) if config else None
    rank_keys = sorted((rk for rk in calls if iterations.get(rk)), key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0, k))
    skipped = sorted(set(calls) - set(rank_keys))
    if skipped:
        notes.append(f"ranks without complete iterations left out: {', '.join(skipped)}")
    n = len(rank_keys) or 1
    measured: dict[OpKey, float] = defaultdict(float)
    for rk in rank_keys:
        for key, c in calls[rk].items():
            measured[key] += c / iterations[rk] / n
    predicted: dict[OpKey, float] = defaultdict(float)
    if pred:
        for per in _predicted_per_rank(pred, rank_keys).values():
            for key, c in per.items():
                predicted[key] += c / n
    group_sizes = _group_sizes(pred)
    measured_sizes = dict(con.execute(
        """
        SELECT coalesce(g.scheme, 'other') || '/' || a.op, max(a.max_group_size)
        FROM comm_agg a JOIN runs r ON r.run_id = a.run_id
        LEFT JOIN process_groups g ON g.run_id = a.run_id AND g.group_key = a.group_key
        WHERE r.name = ? GROUP BY ALL
        """,
        [run],
    ).fetchall())
    by_scheme: dict[str, list[OpComparison]] = defaultdict(list)
    bucketed = set()
    if pred is not None and pred.implementation != "harness":
        bucketed = {(k[0], k[1]) for k in predicted if k[0] == "dp" and k[1] in ("all_reduce", "reduce_scatter", "all_gather", "reduce")}
    for key in sorted(set(measured) | set(predicted), key=lambda k: (k[0], k[1], str(k[2]), k[3] or -1)):
        p, m = predicted.get(key, 0.0), measured.get(key, 0.0)
        if pred is None:
            status = "unexplained"
        elif (key[0], key[1]) in bucketed and abs(p - m) >= 1e-9:
            status = "bucketed"
        elif abs(p - m) < 1e-9:
            status = "match"
        elif p == 0:
            status = "unexplained"
        elif m == 0:
            status = "missing"
        else:
            status = "more" if m > p else "fewer"
        by_scheme[key[0]].append(OpComparison(scheme=key[0], op=key[1], dtype=key[2], msg_bytes=key[3],
                                              predicted_calls_per_iter=p, measured_calls_per_iter=m,
                                              difference=m - p, status=status))  # type: ignore[arg-type]
    schemes = []
    for scheme, ops in sorted(by_scheme.items()):
        def volume(attr: str, wire: bool) -> float:
            total = 0.0
            for o in ops:
                if o.op == "recv" or o.msg_bytes is None:
                    continue
                n_group = group_sizes.get((scheme, o.op)) or measured_sizes.get(f"{scheme}/{o.op}") or 2
                total += o.msg_bytes * getattr(o, attr) * (busbw_factor(o.op, n_group) if wire else 1.0)
            return total

        pb, mb = volume("predicted_calls_per_iter", False), volume("measured_calls_per_iter", False)
        ub = sum((o.msg_bytes or 0) * o.measured_calls_per_iter for o in ops if o.status == "unexplained" and o.op != "recv")
        schemes.append(SchemeResult(
            scheme=scheme, predicted_bytes_per_iter=pb, measured_bytes_per_iter=mb, unexplained_bytes_per_iter=ub,
            ratio=((mb - ub) / pb) if pb else None,
            predicted_wire_bytes_per_iter=volume("predicted_calls_per_iter", True),
            measured_wire_bytes_per_iter=volume("measured_calls_per_iter", True), ops=ops,
        ))
    unexplained = [o for s in schemes for o in s.ops if o.status == "unexplained"]
    missing = [o for s in schemes for o in s.ops if o.status == "missing"]
    if pred is None:
        notes.append("no configuration: measured volumes only; supply a config for predictions")
    if mode == "none":
        notes.append(message)
    check = pred.param_check if pred else None
    if check is not None:
        notes += check.notes
    return Comparison(
        run=run, config_source=source, implementation=pred.implementation if pred else None,
        iterations_mode=mode, iterations_message=message, ranks=rank_keys,
        exact=bool(pred) and bool(rank_keys) and all(o.status == "match" for s in schemes for o in s.ops)
        and (check is None or check.agrees),
        schemes=schemes, unexplained=unexplained, missing=missing, inferences=infer(schemes), notes=notes,
        param_check=check,
    )


def infer(schemes: list[SchemeResult]) -> list[Inference]:
    """Quantities the measurements imply, stated as inferences (not facts)."""
    out: list[Inference] = []
    for s in schemes:
        sent = [o for o in s.ops if o.op != "recv" and o.msg_bytes and o.dtype in DTYPE_BYTES and o.measured_calls_per_iter > 0]
        if not sent:
            continue
        if s.scheme == "dp":
            ar = [o for o in sent if o.op == "all_reduce"]
            if ar:
                w = DTYPE_BYTES[ar[0].dtype]  # type: ignore[index]
                params = sum(o.msg_bytes * o.measured_calls_per_iter for o in ar) / w  # type: ignore[operator]
                out.append(Inference(
                    quantity="parameters per rank (from DP all_reduce volume)", value=params,
                    evidence=f"{params * w:.0f} B of {ar[0].dtype} gradients all-reduced per iteration per rank; "
                             "assumes one gradient sync per iteration (no ZeRO, no per-micro-step sync)"))
        if s.scheme in ("tp", "pp"):
            top = max(sent, key=lambda o: o.measured_calls_per_iter * (o.msg_bytes or 0))
            elems = top.msg_bytes / DTYPE_BYTES[top.dtype]  # type: ignore[operator,index]
            out.append(Inference(
                quantity=f"b x s x h (from {s.scheme.upper()} {top.op} messages)", value=elems,
                evidence=f"the dominant {s.scheme} {top.op} carries {top.msg_bytes} B of {top.dtype} "
                         f"({top.measured_calls_per_iter:g} per iteration per rank); divide by t with sequence parallelism"))
    return out
