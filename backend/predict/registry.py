"""The predictor as a table: scheme predictors keyed by (scheme, implementation), each implementation's
parameter layout and the notes it writes. `predict` walks the table; a new scheme (EP) is a module of its own
plus its rows here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from commlens.contract.predict import (
    Implementation,
    ParamCheck,
    PredictedOp,
    PredictInput,
    Prediction,
    StagePrediction,
)
from commlens.vocab import Scheme

from . import cp, dp, ep, layout, offload, pp, tp
from .adapters import Param, Stage, StageOps, mean_totals, merge, replica_ranks, stage_ranks, totals

SchemePredictor = Callable[[Stage], StageOps]
NoteWriter = Callable[[PredictInput, ParamCheck | None], str | None]

FRAMEWORKS: tuple[Implementation, ...] = ("paper", "megatron", "deepspeed", "fsdp")
BUCKETED: tuple[Implementation, ...] = ("megatron", "deepspeed", "fsdp")  # bucket rules of their own


@dataclass(frozen=True)
class Profile:
    """What an implementation assumes beyond its scheme predictors."""

    layout: Callable[[PredictInput, int], list[Param]]  # the parameters one rank of a stage holds
    check: Callable[[PredictInput], None]  # ValueError for an input the implementation cannot describe


def _describes_any(inp: PredictInput) -> None:
    """The framework implementations take every input PredictInput's validators accept."""


PROFILES: dict[Implementation, Profile] = {
    **{impl: Profile(layout.framework_layout, _describes_any) for impl in FRAMEWORKS},
    "harness": Profile(layout.harness_layout, layout.harness_check),
}


def _rows(
    scheme: Scheme, ops: SchemePredictor, implementations: tuple[Implementation, ...]
) -> dict[tuple[Scheme, Implementation], SchemePredictor]:
    return {(scheme, impl): ops for impl in implementations}


# A stage lists each implementation's ops in the order of its rows here.
PREDICTORS: dict[tuple[Scheme, Implementation], SchemePredictor] = {
    **_rows("dp", dp.framework_ops, FRAMEWORKS),
    **_rows("tp", tp.framework_ops, FRAMEWORKS),
    **_rows("pp", pp.framework_ops, FRAMEWORKS),
    **_rows("cp", cp.framework_ops, FRAMEWORKS),
    ("tp", "harness"): tp.harness_ops,
    ("pp", "harness"): pp.harness_ops,
    ("dp", "harness"): dp.harness_ops,
    ("cp", "harness"): cp.harness_ops,
    **_rows("ep", ep.ep_ops, (*FRAMEWORKS, "harness")),
}

# Notes in the order a prediction lists them (before the parameter check's own).
NOTES: tuple[tuple[tuple[Implementation, ...], NoteWriter], ...] = (
    (("harness",), layout.exactness_note),
    (FRAMEWORKS, layout.padding_note),
    (BUCKETED, dp.bucketed_note),
    (FRAMEWORKS, dp.micro_step_note),
    (("harness",), dp.harness_micro_step_note),
    (FRAMEWORKS, pp.scatter_gather_note),
    (FRAMEWORKS, cp.attention2d_note),
    (FRAMEWORKS, offload.note),
    (FRAMEWORKS, dp.persistence_note),
    ((*FRAMEWORKS, "harness"), ep.routing_note),
)


def predictors(implementation: Implementation) -> list[SchemePredictor]:
    return [ops for (_, impl), ops in PREDICTORS.items() if impl == implementation]


def predict(inp: PredictInput) -> Prediction:
    """Per pipeline stage, the collectives one rank issues per iteration (ranks that behave alike share an
    entry), their per-scheme totals, and the notes that qualify them."""
    profile = PROFILES[inp.implementation]
    profile.check(inp)
    stages = [entry for index in range(inp.parallel.pp) for entry in _stage_entries(inp, index, profile)]
    check = layout.check_params(inp, stages)
    notes = [n for impls, write in NOTES if inp.implementation in impls if (n := write(inp, check)) is not None]
    return Prediction(
        implementation=inp.implementation,
        world_size=inp.parallel.world_size,
        param_count=layout.param_count(inp.model),
        stages=stages,
        totals=mean_totals(stages),
        notes=notes + (check.notes if check else []),
        param_check=check,
    )


def _stage_entries(inp: PredictInput, index: int, profile: Profile) -> list[StagePrediction]:
    stage = Stage(inp, index, profile.layout(inp, index))
    results = [ops_of(stage) for ops_of in predictors(inp.implementation)]
    common = [o for r in results for o in r.ops]
    split = [r.by_replica for r in results if r.by_replica is not None]
    transfers = offload.host_transfers(stage)
    groups = _replica_groups(inp, index, split) if split else [(stage_ranks(inp, index), [])]
    return [
        StagePrediction(
            stage=index,
            ranks=ranks,
            params_per_rank=stage.n_params,
            ops=merge(common + extra),
            totals=totals(common + extra),
            host_transfers=transfers,
        )
        for ranks, extra in groups
    ]


def _replica_groups(
    inp: PredictInput, index: int, split: list[list[list[PredictedOp]]]
) -> list[tuple[list[int], list[PredictedOp]]]:
    """Data-parallel replicas (with EP, each (dp, ep) pair) with identical extra ops share one entry (in the order of
    their first replica)."""
    groups: dict[tuple[str, ...], tuple[list[int], list[PredictedOp]]] = {}
    n = inp.parallel.dp * inp.parallel.ep
    for r in range(n):
        # a scheme that lists dp replicas only gives every ep rank of dp replica r // ep the same ops
        extra = [o for per_replica in split for o in per_replica[r * len(per_replica) // n]]
        key = tuple(o.model_dump_json() for o in extra)
        groups.setdefault(key, ([], extra))[0].extend(replica_ranks(inp, index, r))
    return list(groups.values())
