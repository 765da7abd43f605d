"""Predicted against measured: per scheme bytes per iteration per rank, per (op, dtype, S) calls,
calls measured but not predicted and predicted but missing, and inferences for runs without a config.

A run's configuration is what the caller supplies, else what is attached to the run (a predictor input, a
harness run.json or a model description); without one, each scheme says what the measurements support
(each scheme's `prediction_source`: "config", "inferred" or "none"). A call's scheme is its process group's, as
in every view (the store's `comms` view); calls without a process group are UNATTRIBUTED.

Measured calls count only inside complete iterations (profiler steps for traces, detected periods
for NCCL logs), so set-up traffic stays out, as the models require (docs/models.md §8.4). Measured
counts come from the run's aggregates (comm_agg), not from the calls themselves."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping
from typing import Literal

import duckdb

from commlens import store
from commlens.contract.analysis import UNATTRIBUTED
from commlens.contract.compare import Comparison, Inference, OpComparison, PredictionSource, SchemeResult
from commlens.contract.model_description import ModelDescription
from commlens.contract.predict import ParallelSpec, PredictInput, Prediction
from commlens.store.aggregates import ensure_fresh
from commlens.vocab import DTYPE_BYTES, busbw_factor

from .iterations import iteration_info, run_id_of
from .predict import predict, predict_described, predict_input_from_config

OpKey = tuple[str, str, str | None, int | None]  # scheme, op, dtype, msg_bytes
Config = PredictInput | ModelDescription
DESCRIPTION_KEY = "model_description"  # a run's stored config holding an attached model description


def _measured(con: duckdb.DuckDBPyConnection, run: str) -> tuple[dict[str, dict[OpKey, int]], dict[str, int], str, str]:
    """Calls per rank key and (scheme, op, dtype, S) inside complete iterations, the scheme being the call's group's
    (UNATTRIBUTED without one); iterations per rank key."""
    run_id = store.get_run_id(con, run)
    if run_id is None:
        raise KeyError(f"no run named {run!r}")
    ensure_fresh(con, run_id)
    info = iteration_info(con, run, run_id)
    rows = con.execute(
        """
        SELECT a.rank_key AS rk, coalesce(g.scheme, ?), a.op, a.dtype, a.msg_bytes, sum(a.calls)
        FROM comm_agg a
        LEFT JOIN process_groups g ON g.run_id = a.run_id AND g.group_key = a.group_key
        WHERE a.run_id = ? AND a.in_iteration
        GROUP BY ALL
        """,
        [UNATTRIBUTED, run_id],
    ).fetchall()
    calls: dict[str, dict[OpKey, int]] = defaultdict(dict)
    for rk, scheme, op, dtype, size, n in rows:
        calls[rk][(scheme, op, dtype, size)] = n
    return calls, dict(info.iterations), info.mode, info.message


def _predicted_per_rank(pred: Prediction, rank_keys: list[str]) -> dict[str, dict[OpKey, float]]:
    """Predicted calls per iteration for each measured rank (the mean over all ranks when a rank is unknown)."""
    world = sum(len(st.ranks) for st in pred.stages) or 1
    mean: dict[OpKey, float] = defaultdict(float)
    for st in pred.stages:
        for o in st.ops:
            mean[(o.scheme, o.op, o.dtype, o.msg_bytes)] += o.calls_per_iter * len(st.ranks) / world
    out: dict[str, dict[OpKey, float]] = {}
    stage_of = {r: st for st in reversed(pred.stages) for r in st.ranks}  # a rank's first stage, as _entry_for
    for rk in rank_keys:
        entry = stage_of.get(int(rk)) if rk.lstrip("-").isdigit() else None
        if entry is None:
            out[rk] = dict(mean)
            continue
        calls: dict[OpKey, float] = defaultdict(float)
        for o in entry.ops:
            calls[(o.scheme, o.op, o.dtype, o.msg_bytes)] += o.calls_per_iter
        out[rk] = calls
    return out


def _absent_ranks(pred: Prediction | None, calls: Mapping[str, object]) -> list[int]:
    """The prediction's ranks the run's files hold no call of, when they name global ranks (a job measured in
    part: one rank's trace of four). Processes without a global rank (NCCL logs) say nothing of it."""
    held = {int(k) for k in calls if k.lstrip("-").isdigit()}
    if pred is None or not held:
        return []
    return sorted({r for st in pred.stages for r in st.ranks} - held)


def _group_sizes(pred: Prediction | None) -> dict[tuple[str, str], int]:
    sizes: dict[tuple[str, str], int] = {}
    if pred:
        for st in pred.stages:
            for o in st.ops:
                sizes[(o.scheme, o.op)] = o.group_size
    return sizes


Status = Literal["match", "more", "fewer", "unexplained", "missing", "bucketed", "measured_only"]
ConfigSource = Literal["run", "supplied", "none"]
_BUCKETED_OPS = ("all_reduce", "reduce_scatter", "all_gather", "reduce")


def _prediction(config: Config | None) -> tuple[Prediction | None, str | None]:
    """The prediction of a configuration and the implementation name the comparison shows."""
    if config is None:
        return None, None
    if isinstance(config, ModelDescription):
        return predict_described(config), f"described:{config.strategy.kind}"
    pred = predict(config)
    return pred, pred.implementation


def compare(con: duckdb.DuckDBPyConnection, run: str, config: Config | None = None) -> Comparison:
    """Predicted against measured for a run; `config` overrides (or supplies) the run's configuration."""
    calls, iterations, mode, message = _measured(con, run)
    config, source, notes = _configuration(con, run, config)
    pred, implementation = _prediction(config)
    rank_keys = _complete_ranks(calls, iterations)
    skipped = sorted(set(calls) - set(rank_keys))
    if skipped:
        notes.append(f"ranks without complete iterations left out: {', '.join(skipped)}")
    predicted = _mean_predicted(pred, rank_keys)
    exact_buckets = isinstance(config, ModelDescription) or (pred is not None and pred.implementation == "harness")
    by_scheme = _op_comparisons(pred, predicted, _mean_measured(calls, iterations, rank_keys), exact_buckets)
    group_sizes, measured_sizes = _group_sizes(pred), _measured_group_sizes(con, run)
    schemes = [
        _scheme_result(scheme, ops, group_sizes, measured_sizes, pred is not None)
        for scheme, ops in sorted(by_scheme.items())
    ]
    unsized = sorted(
        {
            f"{scheme} {o.op}"
            for scheme, ops in by_scheme.items()
            for o in ops
            if o.op != "recv"
            and o.msg_bytes is not None
            and not (group_sizes.get((scheme, o.op)) or measured_sizes.get(f"{scheme}/{o.op}"))
        }
    )
    if unsized:
        notes.append(f"wire bytes leave out {', '.join(unsized)}: no group size is known for them")
    if pred is None:
        notes.append("no configuration: measured volumes only; supply a config for predictions")
    if UNATTRIBUTED in by_scheme:
        notes.append(
            f"{UNATTRIBUTED}: calls whose files name no process group, so no scheme, as in every view (profiler "
            "traces name groups in record_param_comms' Process Group fields, from PyTorch of 2024 on; NCCL logs do)"
        )
    if mode == "none":
        notes.append(message)
    absent = _absent_ranks(pred, calls)
    if absent:
        shown = ", ".join(map(str, absent[:12])) + (f" and {len(absent) - 12} more" if len(absent) > 12 else "")
        job = {r for st in pred.stages for r in st.ranks} if pred else set()
        notes.append(
            f"the run's files hold {len(job) - len(absent)} of the job's {len(job)} ranks (missing: {shown}): "
            "predicted against measured covers those ranks only"
        )
    another_job = next((n for n in notes if n.startswith(ANOTHER_JOB)), None)
    check = pred.param_check if pred else None
    if check is not None:
        notes += check.notes
    return Comparison(
        run=run,
        config_source=source,
        implementation=implementation,
        iterations_mode=mode,
        iterations_message=message,
        ranks=rank_keys,
        exact=bool(pred)
        and bool(rank_keys)
        and all(o.status == "match" for s in schemes for o in s.ops)
        and (check is None or check.agrees)
        and another_job is None,
        another_job=another_job,
        ranks_absent=len(absent),
        schemes=schemes,
        unexplained=[o for s in schemes for o in s.ops if o.status == "unexplained"],
        missing=[o for s in schemes for o in s.ops if o.status == "missing"],
        inferences=infer(schemes),
        notes=notes,
        param_check=check,
    )


def world_conflict(con: duckdb.DuckDBPyConnection, run_id: int, world: int) -> str | None:
    """Why a configuration of `world` ranks cannot be the job the run's stored files come from, or None: a
    profiler trace's distributedInfo states the job's world size, and no file may show a rank or a communicator
    beyond it. An NCCL log's largest communicator may be smaller than the world (the default group's
    communicator exists only once a collective ran on it), but not when the logs hold every member of every
    communicator they name: ranks beyond those would share no communicator with them, so they are another job."""
    traced, largest, top_rank, files = con.execute(
        "SELECT max(world_size) FILTER (WHERE kind = 'kineto'), max(world_size), max(rank), count(*) "
        "FROM sources WHERE run_id = ? AND status = 'ok' AND kind <> 'run_json'",
        [run_id],
    ).fetchall()[0]
    comms, closed_ranks = con.execute(
        """SELECT count(*), CASE WHEN bool_and(members = nranks) THEN max(nranks) END FROM (
               SELECT group_key, max(nranks) AS nranks, count(DISTINCT comm_rank) AS members
               FROM nccl_comms WHERE run_id = ? GROUP BY group_key
           )""",
        [run_id],
    ).fetchall()[0]
    if traced is not None and traced != world:
        said = f"the run's profiler traces say world size {traced} (distributedInfo)"
    elif largest is not None and largest > world:
        said = f"the run's files hold a communicator of {largest} ranks"
    elif top_rank is not None and top_rank >= world:
        said = f"the run's files hold rank {top_rank}"
    elif traced is None and closed_ranks is not None and closed_ranks < world:
        said = (
            f"the run's NCCL logs hold every member of each of their {comms} communicators, the largest of "
            f"{closed_ranks} ranks: a job of {closed_ranks}"
        )
    else:
        return None
    return f"{said} ({files} file(s))"


def _config_world(config: Config) -> int:
    return config.strategy.dp if isinstance(config, ModelDescription) else config.parallel.world_size


ANOTHER_JOB = "the configuration describes a job"


def _configuration(
    con: duckdb.DuckDBPyConnection, run: str, supplied: Config | None
) -> tuple[Config | None, ConfigSource, list[str]]:
    """The supplied config, else the run's stored one; a stored config the predictor cannot read is a note, and
    so is a supplied one of another job's size or another layout than the run's own."""
    stored, notes = _stored_config(con, run)
    if supplied is None:
        return stored, "run" if stored is not None else "none", notes
    notes = []
    conflict = world_conflict(con, run_id_of(con, run), world := _config_world(supplied))
    if conflict:
        ranks = f"{world} rank{'s' if world != 1 else ''}"
        notes.append(f"{ANOTHER_JOB} of {ranks}, but {conflict}: it predicts another job")
    if isinstance(supplied, PredictInput) and isinstance(stored, PredictInput):
        theirs, ours = _layout(supplied.parallel), _layout(stored.parallel)
        if theirs != ours:
            notes.append(
                f"the configuration's layout ({theirs}) is not the run's own ({ours}): the comparison is of "
                "another layout"
            )
    return supplied, "supplied", notes


def _layout(p: ParallelSpec) -> str:
    degrees = [f"{k} {v}" for k, v in (("dp", p.dp), ("tp", p.tp), ("pp", p.pp), ("cp", p.cp), ("ep", p.ep)) if v > 1]
    return ", ".join(degrees + ([f"zero {p.zero}"] if p.zero else []) + (["sp"] if p.sp else [])) or "one rank"


def _stored_config(con: duckdb.DuckDBPyConnection, run: str) -> tuple[Config | None, list[str]]:
    row = con.execute("SELECT config FROM runs WHERE name = ?", [run]).fetchone()
    if not (row and row[0]):
        return None, []
    stored = json.loads(row[0])
    try:
        if isinstance(stored, dict) and DESCRIPTION_KEY in stored:
            return ModelDescription.model_validate(stored[DESCRIPTION_KEY]), []
        return predict_input_from_config(stored), []
    except ValueError as exc:
        return None, [f"the run's config could not be used for a prediction: {exc}"]


def _complete_ranks(calls: dict[str, dict[OpKey, int]], iterations: dict[str, int]) -> list[str]:
    """Rank keys with complete iterations: global ranks in order, then other keys."""
    return sorted(
        (rk for rk in calls if iterations.get(rk)), key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0, k)
    )


def _mean_measured(
    calls: dict[str, dict[OpKey, int]], iterations: dict[str, int], rank_keys: list[str]
) -> dict[OpKey, float]:
    """Measured calls per iteration, averaged over the ranks."""
    n = len(rank_keys) or 1
    measured: dict[OpKey, float] = defaultdict(float)
    for rk in rank_keys:
        for key, c in calls[rk].items():
            measured[key] += c / iterations[rk] / n
    return measured


def _mean_predicted(pred: Prediction | None, rank_keys: list[str]) -> dict[OpKey, float]:
    """Predicted calls per iteration, averaged over the measured ranks."""
    n = len(rank_keys) or 1
    predicted: dict[OpKey, float] = defaultdict(float)
    if pred:
        for per in _predicted_per_rank(pred, rank_keys).values():
            for key, c in per.items():
                predicted[key] += c / n
    return predicted


def _measured_group_sizes(con: duckdb.DuckDBPyConnection, run: str) -> dict[str, int]:
    """The largest measured group per "scheme/op", for the wire factor of ops the prediction lacks. Calls that
    name no group and no size are the default group's, the world (as the time analysis matches them)."""
    return {
        key: n
        for key, n in con.execute(
            """
        SELECT coalesce(g.scheme, ?) || '/' || a.op,
               max(coalesce(a.max_group_size, CASE WHEN a.group_key IS NULL THEN r.world_size END))
        FROM comm_agg a JOIN runs r ON r.run_id = a.run_id
        LEFT JOIN process_groups g ON g.run_id = a.run_id AND g.group_key = a.group_key
        WHERE r.name = ? GROUP BY ALL
        """,
            [UNATTRIBUTED, run],
        ).fetchall()
        if n is not None
    }


def _op_comparisons(
    pred: Prediction | None, predicted: dict[OpKey, float], measured: dict[OpKey, float], exact_buckets: bool
) -> dict[str, list[OpComparison]]:
    """Every (scheme, op, dtype, S) measured or predicted, with its status, per scheme; a framework prediction's
    DP buckets are compared on totals unless the prediction knows every bucket (harness, model description)."""
    bucketed: set[tuple[str, str]] = set()
    if pred is not None and not exact_buckets:
        bucketed = {(k[0], k[1]) for k in predicted if k[0] == "dp" and k[1] in _BUCKETED_OPS}
    by_scheme: dict[str, list[OpComparison]] = defaultdict(list)
    for key in sorted(set(measured) | set(predicted), key=lambda k: (k[0], k[1], str(k[2]), k[3] or -1)):
        p, m = predicted.get(key, 0.0), measured.get(key, 0.0)
        status = _status(p, m, pred is not None, (key[0], key[1]) in bucketed)
        by_scheme[key[0]].append(
            OpComparison(
                scheme=key[0],
                op=key[1],
                dtype=key[2],
                msg_bytes=key[3],
                predicted_calls_per_iter=p,
                measured_calls_per_iter=m,
                difference=m - p,
                status=status,
            )
        )
    return by_scheme


def _status(p: float, m: float, predicted: bool, bucketed: bool) -> Status:
    """How measured calls `m` stand against predicted `p`; bucketed ops differ without being wrong. With no
    configuration nothing is predicted, so nothing is unexplained either: measured only."""
    if not predicted:
        return "measured_only"
    if bucketed and abs(p - m) >= 1e-9:
        return "bucketed"
    if abs(p - m) < 1e-9:
        return "match"
    if p == 0:
        return "unexplained"
    if m == 0:
        return "missing"
    return "more" if m > p else "fewer"


def _scheme_result(
    scheme: str,
    ops: list[OpComparison],
    group_sizes: dict[tuple[str, str], int],
    measured_sizes: dict[str, int],
    predicted: bool,
) -> SchemeResult:
    """A scheme's predicted and measured volumes (S-sums and wire bytes) over its ops, and where its prediction
    comes from: the configuration where it predicts this scheme, else the inferences where the measurements
    support any (only without a configuration), else none (measured only: a neutral state, not an error)."""

    def volume(attr: str, wire: bool) -> float:
        total = 0.0
        for o in ops:
            if o.op == "recv" or o.msg_bytes is None:
                continue
            n_group = group_sizes.get((scheme, o.op)) or measured_sizes.get(f"{scheme}/{o.op}")
            if wire and n_group is None:
                continue  # no group size: no wire bytes (compare() says which ops)
            total += o.msg_bytes * getattr(o, attr) * (busbw_factor(o.op, n_group) if wire and n_group else 1.0)
        return total

    pb, mb = volume("predicted_calls_per_iter", False), volume("measured_calls_per_iter", False)
    ub = sum(
        (o.msg_bytes or 0) * o.measured_calls_per_iter for o in ops if o.status == "unexplained" and o.op != "recv"
    )
    source: PredictionSource = "none"
    if predicted and pb > 0:
        source = "config"
    elif not predicted and infer_scheme(scheme, ops):
        source = "inferred"
    return SchemeResult(
        scheme=scheme,
        predicted_bytes_per_iter=pb,
        measured_bytes_per_iter=mb,
        unexplained_bytes_per_iter=ub,
        ratio=((mb - ub) / pb) if pb else None,
        predicted_wire_bytes_per_iter=volume("predicted_calls_per_iter", True),
        measured_wire_bytes_per_iter=volume("measured_calls_per_iter", True),
        prediction_source=source,
        ops=ops,
    )


def infer(schemes: list[SchemeResult]) -> list[Inference]:
    """Quantities the measurements imply, stated as inferences (not facts)."""
    return [i for s in schemes for i in infer_scheme(s.scheme, s.ops)]


def prediction_sources(c: Comparison) -> dict[str, PredictionSource]:
    """Per scheme, where its prediction comes from (the report's per-scheme `prediction_source`)."""
    return {s.scheme: s.prediction_source for s in c.schemes}


def _sent(ops: list[OpComparison]) -> list[OpComparison]:
    return [
        o for o in ops if o.op != "recv" and o.msg_bytes and o.dtype in DTYPE_BYTES and o.measured_calls_per_iter > 0
    ]


def _per_dtype(ops: list[OpComparison]) -> dict[str, float]:
    """Elements per iteration per rank, per dtype."""
    out: dict[str, float] = defaultdict(float)
    for o in ops:
        out[str(o.dtype)] += (o.msg_bytes or 0) * o.measured_calls_per_iter / DTYPE_BYTES[str(o.dtype)]
    return dict(out)


def _elements(per_dtype: dict[str, float]) -> str:
    return ", ".join(f"{n:,.0f} {dtype}" for dtype, n in sorted(per_dtype.items()))


def infer_scheme(scheme: str, ops: list[OpComparison]) -> list[Inference]:
    """What one scheme's measured calls imply: DP gradient volume as parameters, DP broadcasts as DDP's buffer
    sync, all-gathers as ZeRO/FSDP parameter gathers (S is the gathered unit, a shard is S / group), TP/PP
    activations."""
    sent = _sent(ops)
    out: list[Inference] = []
    if scheme == "dp":
        ar = [o for o in sent if o.op == "all_reduce"]
        if ar:
            grads = _per_dtype(ar)
            out.append(
                Inference(
                    quantity="parameters per rank (from DP all_reduce volume)",
                    value=sum(grads.values()),
                    evidence=f"{_elements(grads)} gradient elements all-reduced per iteration per rank; assumes one "
                    "gradient sync per iteration (no ZeRO, no per-micro-step sync)",
                )
            )
        bc = [o for o in sent if o.op == "broadcast"]
        if bc:
            bufs = _per_dtype(bc)
            out.append(
                Inference(
                    quantity="buffer elements (from DP broadcasts: DDP's buffer sync before each forward)",
                    value=sum(bufs.values()),
                    evidence=f"{_elements(bufs)} broadcast per iteration, one call per dtype as DDP's "
                    "broadcast_buffers coalesces them (BatchNorm: 2 float32 statistics per channel, 1 int64 counter)",
                )
            )
        ag = [o for o in sent if o.op == "all_gather"]
        if ag:
            gathered = _per_dtype(ag)
            out.append(
                Inference(
                    quantity="parameters gathered per iteration (from DP all_gather sizes: ZeRO/FSDP parameter gathers)",
                    value=sum(gathered.values()),
                    evidence=f"{_elements(gathered)} gathered per iteration in {len(ag)} distinct unit sizes; each "
                    "rank holds 1/group of every unit",
                )
            )
    if scheme in ("tp", "pp") and sent:
        top = max(sent, key=lambda o: o.measured_calls_per_iter * (o.msg_bytes or 0))
        elems = (top.msg_bytes or 0) / DTYPE_BYTES[str(top.dtype)]
        out.append(
            Inference(
                quantity=f"b x s x h (from {scheme.upper()} {top.op} messages)",
                value=elems,
                evidence=f"the dominant {scheme} {top.op} carries {top.msg_bytes} B of {top.dtype} "
                f"({top.measured_calls_per_iter:g} per iteration per rank)"
                + (
                    "; with sequence parallelism a stage sends b x (s/t) x h: multiply by t"
                    if scheme == "pp"
                    else "; a TP all_gather's output and reduce_scatter's input are b x s x h with or without "
                    "sequence parallelism"
                ),
            )
        )
    return out
