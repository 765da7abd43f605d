"""The one answer to "is this configuration a run.json or a predictor input?", and the predictor input of
either: every reader of a stored, uploaded or supplied config (API, CLI, comparison) goes through here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, cast

from commlens.contract.predict import (
    IMPLEMENTATIONS,
    BucketSpec,
    DtypeSpec,
    Implementation,
    ModelSpec,
    ParallelSpec,
    PredictInput,
    RecordedParams,
)
from commlens.run_json import RunConfig

ConfigKind = Literal["run_config", "predict_input"]


def config_kind(config: Mapping[str, Any]) -> ConfigKind:
    """A run.json names its schema (`commlens.run/...`) or, written by hand, its strategy; a predictor input
    has neither. The kind only says which model to validate with, not that it validates."""
    return "run_config" if "schema" in config or "strategy" in config else "predict_input"


def predict_input_from_config(config: Mapping[str, Any] | RunConfig) -> PredictInput:
    """The predictor input of a run.json (its implementation, model, parallel layout, dtypes, buckets and
    recorded parameter counts) or of a predictor input as it is. ValueError (pydantic's included) says why
    the config is neither."""
    if isinstance(config, RunConfig):
        return _from_run_config(config)
    if config_kind(config) == "run_config":
        return _from_run_config(RunConfig.model_validate(config))
    return PredictInput.model_validate(config)


def _implementation(name: str) -> Implementation:
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {name!r}; one of {', '.join(IMPLEMENTATIONS)}")
    return cast(Implementation, name)


def _from_run_config(cfg: RunConfig) -> PredictInput:
    """Bucket sizes the run.json leaves unset keep the predictor's defaults."""
    implementation = _implementation(cfg.implementation)
    m, p, bk = cfg.model, cfg.parallel, cfg.buckets
    framework_buckets = {
        n: getattr(bk, n)
        for n in ("megatron_bucket_params", "deepspeed_reduce_bucket_elems", "deepspeed_allgather_bucket_elems")
        if getattr(bk, n) is not None
    }
    per_rank = {r.rank: r.param_count for r in cfg.ranks if r.param_count is not None}
    recorded = RecordedParams(total=m.param_count, per_rank=per_rank) if m.param_count is not None or per_rank else None
    return PredictInput(
        model=ModelSpec(
            layers=m.layers,
            hidden=m.hidden,
            heads=m.heads,
            vocab=m.vocab,
            seq_len=m.seq_len,
            ffn_hidden=m.ffn_hidden,
            tied_embeddings=m.tied_embeddings,
            learned_pos=m.learned_pos,
            kv_heads=m.kv_heads,
            vocab_divisible_by=m.vocab_divisible_by,
            experts=m.experts,
            top_k=m.top_k,
            capacity_factor=m.capacity_factor,
        ),
        parallel=ParallelSpec(
            dp=p.dp,
            tp=p.tp,
            pp=p.pp,
            cp=p.cp,
            cp_style=p.cp_style,
            cp_rq=p.cp_rq,
            ep=p.ep,
            offload="none"
            if p.offload == "none"
            else "zero_offload"
            if p.offload_gap == 1
            else "deep_optimizer_states",
            prefetch_gap=p.offload_gap,
            zero=p.zero,
            sp=p.sp,
            micro_batches=p.micro_batches,
            micro_batch_size=p.micro_batch_size,
            schedule=p.schedule,
            recompute=p.recompute,
            virtual_stages=p.virtual_stages,
            sync_every_micro_step=not p.ddp_no_sync,
        ),
        dtypes=DtypeSpec(act=cfg.dtypes.act, grad=cfg.dtypes.grad, param=cfg.dtypes.param),
        buckets=BucketSpec(
            ddp_bucket_cap_mb=bk.ddp_bucket_cap_mb or 25.0,
            ddp_first_bucket_bytes=bk.ddp_first_bucket_bytes or 2**20,
            zero_bucket_bytes=bk.zero_bucket_bytes,
            **framework_buckets,
        ),
        implementation=implementation,
        recorded_params=recorded,
        moe_routing=[cfg.moe_routing[step] for step in sorted(cfg.moe_routing)],
    )
