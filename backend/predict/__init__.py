"""Analytical communication-volume predictor (the formulas and their derivations: docs/models.md).

`predict(PredictInput) -> Prediction` lists, per pipeline stage (ranks that behave alike share an entry), the
collectives one rank issues per iteration: (scheme, group, op, dtype, S, calls). Implementations: `paper`
(textbook forms), `megatron`, `deepspeed`, `fsdp` (PyTorch DDP/FSDP) and `harness`, which mirrors the bundled
harness's algorithm and is exact to the byte. One module per scheme family (dp, tp, pp, cp, offload) holds
every implementation's rules for it; `registry` says which predictor serves which (scheme, implementation).
The input and output models are the wire contract's (commlens.contract.predict).
"""

from commlens.contract.predict import BucketSpec, DtypeSpec, ModelSpec, ParallelSpec, PredictInput, Prediction

from .adapters import ddp_buckets
from .config import config_kind, predict_input_from_config
from .described import predict_described
from .layout import param_count
from .registry import predict

__all__ = [
    "BucketSpec",
    "DtypeSpec",
    "ModelSpec",
    "ParallelSpec",
    "PredictInput",
    "Prediction",
    "config_kind",
    "ddp_buckets",
    "param_count",
    "predict",
    "predict_described",
    "predict_input_from_config",
]
