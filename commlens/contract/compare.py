"""Predicted against measured, for one run (`/runs/{run}/comparison`) and across runs (`/compare`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from .analysis import ComparisonInput, SchemeComparison
from .predict import ParamCheck

# Where a scheme's prediction comes from: the run's configuration, what its measurements support (the comparison's
# inferences), or nothing (measured only: a neutral state, not an error)
PredictionSource = Literal["config", "inferred", "none"]


class OpComparison(BaseModel):
    scheme: str
    op: str
    dtype: str | None
    msg_bytes: int | None
    predicted_calls_per_iter: float
    measured_calls_per_iter: float
    difference: float  # measured - predicted
    # bucketed: a DP/ZeRO op of a framework prediction, compared on the scheme total only (bucket
    # boundaries are framework internals, docs/models.md); measured_only: the run has no configuration
    status: Literal["match", "more", "fewer", "unexplained", "missing", "bucketed", "measured_only"]


class SchemeResult(BaseModel):
    scheme: str
    predicted_bytes_per_iter: float  # S-sum of sent ops per rank per iteration
    measured_bytes_per_iter: float  # every measured call, explained or not
    unexplained_bytes_per_iter: float  # measured calls the model does not contain (not charged)
    ratio: float | None  # (measured - unexplained) / predicted
    predicted_wire_bytes_per_iter: float
    measured_wire_bytes_per_iter: float
    prediction_source: PredictionSource
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
    # a supplied configuration of another job's size than the run's files (backend.compare.world_conflict): it
    # predicts another job, so no exactness is claimed however the counts compare
    another_job: str | None = None
    # ranks of the configured job the run's files hold no call of (notes name them): the comparison covers the
    # others only, so an exact one is exact for those
    ranks_absent: int = 0

    def findings_input(self, tolerance: float = 0.05) -> ComparisonInput:
        """Per scheme, the bytes the prediction explains and what it does not, as the findings weigh them."""
        per = []
        for s in self.schemes:
            unexplained = [o for o in self.unexplained if o.scheme == s.scheme]
            per.append(
                SchemeComparison(
                    scheme=s.scheme,
                    predicted_bytes=s.predicted_bytes_per_iter,
                    measured_bytes=s.measured_bytes_per_iter - s.unexplained_bytes_per_iter,
                    unexplained_calls=round(sum(o.measured_calls_per_iter for o in unexplained)),
                    unexplained_bytes=sum(
                        (o.msg_bytes or 0) * o.measured_calls_per_iter for o in unexplained if o.op != "recv"
                    ),
                )
            )
        return ComparisonInput(per_scheme=per, tolerance=tolerance)


class RunComparison(BaseModel):
    run: str
    strategy: str | None
    world_size: int | None
    comparison: Comparison


class RunsComparison(BaseModel):
    runs: list[RunComparison]
