"""The predictor's input and output: what `POST /api/predict` takes and returns, and what a run's
stored configuration becomes (`PredictInput`). The validators refuse layouts the models do not cover."""

from __future__ import annotations

import math
from typing import Literal, get_args

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from commlens.vocab import DTYPE_BYTES

from .common import MAX_WORLD

Implementation = Literal["harness", "megatron", "deepspeed", "fsdp", "paper"]
IMPLEMENTATIONS: tuple[str, ...] = get_args(Implementation)
MEGATRON_VOCAB_DIVISIBLE_BY = 128  # Megatron-LM's make_vocab_size_divisible_by default (docs/models.md)
MAX_DEGREE = 1 << 20  # bound of the mesh split and the prefetch gap (API inputs must not be unbounded)


class ModelSpec(BaseModel):
    layers: int = Field(ge=1)
    hidden: int = Field(ge=1)
    heads: int = Field(ge=1)
    kv_heads: int | None = None  # GQA: each KV head serves heads / kv_heads query heads; None (not 0): heads
    ffn_hidden: int | None = None  # None (not 0): 4h
    vocab: int = Field(ge=1)
    seq_len: int = Field(ge=1)
    learned_pos: bool = True
    tied_embeddings: bool = False
    # Megatron's rule (docs/models.md): V padded to a multiple of this x tp. None: the implementation's
    # default, which PredictInput fills in: 128 for megatron (`make_vocab_size_divisible_by`), else no padding.
    vocab_divisible_by: int | None = Field(default=None, ge=1)
    # Total parameters of a model the GPT formulas do not describe (a CNN, a recommender): DP and ZeRO
    # volumes then come from this count as one flat gradient; TP/PP/CP still use the shape fields.
    params_override: int | None = Field(default=None, ge=1)
    # Mixture of experts (docs/models.md §6.9): routed experts per MLP (0: dense), experts per token, and the
    # capacity factor F (tokens per expert capped at ceil(F·tokens·k/experts); None: no cap).
    experts: int = Field(default=0, ge=0, le=MAX_DEGREE)
    top_k: int = Field(default=1, ge=1, le=MAX_DEGREE)
    capacity_factor: float | None = Field(default=None, gt=0, le=MAX_DEGREE)

    @field_validator("heads")
    @classmethod
    def _heads_divide_hidden(cls, heads: int, info: ValidationInfo) -> int:
        """Each head is hidden / heads wide: a model whose heads do not divide it does not exist."""
        hidden = info.data.get("hidden")  # absent when hidden itself was invalid
        if hidden is not None and hidden % heads:
            raise ValueError(f"must divide hidden ({hidden}): each attention head is hidden / heads wide")
        return heads

    @field_validator("kv_heads")
    @classmethod
    def _kv_heads_divide_heads(cls, kv: int | None, info: ValidationInfo) -> int | None:
        """No formula describes other KV-head counts: h_kv = h x kv_heads / heads would be cut to an integer."""
        heads = info.data.get("heads")  # absent when heads itself was invalid
        if kv is None:
            return kv
        if kv < 1:
            raise ValueError("must be at least 1; leave it out for multi-head attention (kv_heads = heads)")
        if heads is not None and kv > heads:
            raise ValueError(f"must be at most heads ({heads})")
        if heads is not None and heads % kv:
            raise ValueError(f"must divide heads ({heads}): each KV head serves heads / kv_heads heads")
        return kv

    @field_validator("ffn_hidden")
    @classmethod
    def _ffn_positive(cls, ffn: int | None) -> int | None:
        if ffn is not None and ffn < 1:
            raise ValueError("must be at least 1; leave it out for the default 4 x hidden")
        return ffn

    @property
    def f(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def h_kv(self) -> int:
        return self.hidden * (self.kv_heads or self.heads) // self.heads

    def padded_vocab(self, tp: int) -> int:
        if self.vocab_divisible_by is None:
            return self.vocab
        multiple = self.vocab_divisible_by * tp
        return math.ceil(self.vocab / multiple) * multiple


class ParallelSpec(BaseModel):
    dp: int = Field(default=1, ge=1)
    tp: int = Field(default=1, ge=1)
    pp: int = Field(default=1, ge=1)
    cp: int = Field(default=1, ge=1)
    ep: int = Field(default=1, ge=1, le=MAX_DEGREE)  # expert parallelism: ranks the experts spread over
    zero: Literal[0, 1, 2, 3] = 0
    sp: bool = False
    micro_batches: int = Field(default=1, ge=1)
    micro_batch_size: int = Field(default=1, ge=1)
    virtual_stages: int = Field(default=1, ge=1)  # interleaved model chunks per pipeline device
    recompute: Literal["none", "selective", "full"] = "none"
    sync_every_micro_step: bool = False  # DDP without no_sync()
    schedule: Literal["gpipe", "1f1b"] = "1f1b"
    # Megatron's PP scatter/gather (docs/models.md): each TP rank sends A/t, the receiver all-gathers A.
    pp_scatter_gather: bool = False
    # Context parallelism (docs/models.md): ring attention, or ATTENTION2D on an r_Q x r_KV mesh with r_Q = cp_rq,
    # r_KV = cp / r_Q (default r_Q = r_KV = sqrt(cp), which needs cp to be a perfect square).
    cp_style: Literal["ring", "attention2d"] = "ring"
    cp_rq: int | None = Field(default=None, ge=1, le=MAX_DEGREE)
    # CPU offload of the ZeRO-3 optimizer (docs/models.md): host<->device copies, reported apart from the collectives.
    offload: Literal["none", "zero_offload", "deep_optimizer_states"] = "none"
    prefetch_gap: int = Field(default=1, ge=1, le=MAX_DEGREE)  # Deep Optimizer States' prefetch_optimizer_gap g

    @model_validator(mode="after")
    def _check(self) -> ParallelSpec:
        if self.world_size > MAX_WORLD:
            raise ValueError(
                f"world size dp*tp*pp*cp*ep = {self.dp}*{self.tp}*{self.pp}*{self.cp}*{self.ep} = {self.world_size:,} "
                f"is more than {MAX_WORLD:,} ranks"
            )
        if self.sp and self.tp == 1:
            raise ValueError("sequence parallelism (sp) needs tp > 1")
        if self.pp_scatter_gather and self.tp == 1:
            raise ValueError("pp_scatter_gather splits pipeline messages over the TP group and needs tp > 1")
        if self.pp_scatter_gather and self.sp:
            raise ValueError(
                "pp_scatter_gather and sp exclude each other: with sequence parallelism pipeline "
                "messages are already A/t per TP rank (docs/models.md §6.5)"
            )
        if self.cp_style == "ring" and self.cp_rq is not None:
            raise ValueError("cp_rq is the ATTENTION2D mesh split; it needs cp_style='attention2d'")
        if self.cp_style == "attention2d":
            if self.cp_rq is None and math.isqrt(self.cp) ** 2 != self.cp:
                raise ValueError(
                    f"ATTENTION2D with cp={self.cp}: cp is not a perfect square, so give cp_rq "
                    f"(r_Q, a divisor of cp; r_KV = cp / r_Q)"
                )
            if self.cp_rq is not None and self.cp % self.cp_rq:
                raise ValueError(f"ATTENTION2D: cp_rq={self.cp_rq} must divide cp={self.cp} (r_Q x r_KV = cp)")
        if self.offload != "none" and self.zero != 3:
            raise ValueError(
                f"offload={self.offload!r}: the CPU-offload volumes (docs/models.md §6.8) assume "
                f"ZeRO-3; set zero=3 (got zero={self.zero})"
            )
        if self.prefetch_gap != 1 and self.offload != "deep_optimizer_states":
            raise ValueError(
                "prefetch_gap is Deep Optimizer States' prefetch_optimizer_gap; it needs "
                "offload='deep_optimizer_states'"
            )
        return self

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp * self.ep

    @property
    def cp_mesh(self) -> tuple[int, int]:
        """ATTENTION2D (r_Q, r_KV): r_Q ranks share Q and the output reduction, r_KV share K and V."""
        r_q = self.cp_rq if self.cp_rq is not None else math.isqrt(self.cp)
        return r_q, self.cp // r_q


class DtypeSpec(BaseModel):
    act: str = "bfloat16"
    grad: str = "bfloat16"
    param: str = "bfloat16"
    loss: str = "float32"
    # Host-side optimizer state per parameter for CPU offload (docs/models.md): fp32 master weights + Adam m and v.
    optimizer_state_bytes: int = Field(default=12, ge=1, le=64)

    @model_validator(mode="after")
    def _known(self) -> DtypeSpec:
        for name in (self.act, self.grad, self.param, self.loss):
            if name not in DTYPE_BYTES:
                raise ValueError(f"unknown dtype {name!r}; one of {sorted(DTYPE_BYTES)}")
        return self


class BucketSpec(BaseModel):
    ddp_bucket_cap_mb: float = 25.0
    ddp_first_bucket_bytes: int | None = 2**20  # PyTorch's smaller first bucket (default cap only)
    megatron_bucket_params: int | None = None  # default max(4e7, 1e6 * dp)
    deepspeed_reduce_bucket_elems: int = 500_000_000
    deepspeed_allgather_bucket_elems: int = 500_000_000
    zero_bucket_bytes: int | None = None  # harness ZeRO-1/2 bucket (None: one flat buffer)
    # DeepSpeed ZeRO-3 stage3_param_persistence_threshold (elements, default 1e5): parameters with at most this
    # many elements stay whole on every rank and are not all-gathered per micro-step (0: none persist).
    deepspeed_param_persistence_threshold: int = Field(default=100_000, ge=0, le=1 << 62)


class RecordedParams(BaseModel):
    """Parameter counts recorded with a run (a harness run.json holds the built model's real counts),
    checked against the counts the predictor derives from the model config."""

    total: int | None = Field(default=None, ge=1)  # the whole model, one copy (run.json model.param_count)
    per_rank: dict[int, int] = {}  # global rank -> parameters it holds before ZeRO sharding (ranks[].param_count)


class PredictInput(BaseModel):
    model: ModelSpec
    parallel: ParallelSpec = ParallelSpec()
    dtypes: DtypeSpec = DtypeSpec()
    buckets: BucketSpec = BucketSpec()
    implementation: Implementation = "paper"
    recorded_params: RecordedParams | None = None
    # MoE routing as measured (a harness run.json's moe_routing): per iteration, global rank -> per dispatch
    # all-to-all, the rows the rank sent to each ep rank. With it the EP prediction is exact; without it, the
    # expectation under uniform routing with its spread.
    moe_routing: list[dict[int, list[list[int]]]] = Field(default_factory=list, exclude_if=lambda v: not v)

    @model_validator(mode="after")
    def _vocab_padding(self) -> PredictInput:
        if self.model.vocab_divisible_by is None and self.implementation == "megatron":
            self.model = self.model.model_copy(update={"vocab_divisible_by": MEGATRON_VOCAB_DIVISIBLE_BY})
        return self

    @model_validator(mode="after")
    def _supported(self) -> PredictInput:
        p = self.parallel
        if self.implementation == "harness" and p.pp_scatter_gather:
            raise ValueError("the harness has no PP scatter/gather")
        if self.implementation == "fsdp" and p.offload != "none":
            raise ValueError(
                "offload models DeepSpeed-style ZeRO-3 optimizer offload (docs/models.md §6.8); "
                "PyTorch FSDP CPUOffload also moves parameters and is not specified"
            )
        return self

    @model_validator(mode="after")
    def _divisible(self) -> PredictInput:
        m, p = self.model, self.parallel
        if m.layers % p.pp:
            raise ValueError(f"layers ({m.layers}) must be divisible by pp ({p.pp})")
        if m.heads % p.tp:
            raise ValueError(f"heads ({m.heads}) must be divisible by tp ({p.tp})")
        if p.virtual_stages > 1 and m.layers % (p.pp * p.virtual_stages):
            raise ValueError("layers must be divisible by pp x virtual_stages")
        if m.seq_len % p.cp:
            raise ValueError(f"seq_len ({m.seq_len}) must be divisible by cp ({p.cp})")
        if p.ep > 1 and not m.experts:
            raise ValueError(f"ep={p.ep} spreads experts over ranks: give model.experts (a multiple of ep)")
        if m.experts and m.experts % p.ep:
            raise ValueError(f"experts ({m.experts}) must be divisible by ep ({p.ep})")
        if m.experts and m.top_k > m.experts:
            raise ValueError(f"top_k ({m.top_k}) exceeds experts ({m.experts})")
        return self


class PredictedOp(BaseModel):
    scheme: str  # dp | tp | pp | cp
    group: str  # e.g. "dp", "tp", "pp:next", "pp:prev", "pp:embedding"
    group_size: int
    op: str
    dtype: str
    msg_bytes: int
    # Calls per iteration; a mean over the measured iterations (not a whole number) where their sizes differed
    # (MoE routing that changed between steps).
    calls_per_iter: int | float
    per_micro_step: bool = False  # issued every micro-step (ZeRO-2/3, TP, PP) rather than once per step
    what: str = ""  # which tensor(s)
    # One standard deviation of msg_bytes when the size is an expectation (EP under uniform routing); absent
    # when the size is exact.
    spread_bytes: float | None = Field(default=None, exclude_if=lambda v: v is None)


class HostTransfer(BaseModel):
    """A host<->device copy (cudaMemcpy over PCIe, docs/models.md) per rank per iteration: not a
    collective, so never part of the scheme totals."""

    direction: Literal["d2h", "h2d"]
    what: str
    bytes_per_iter: int


class SchemeTotal(BaseModel):
    scheme: str
    s_sum: int  # sum of S x calls of sent ops (recv not added)
    wire_bytes: float  # ring wire bytes: sum of S x f(op, n) x calls
    paper_bytes: int  # paper convention: 2S for all_reduce, S otherwise
    recv_bytes: int = 0


class StagePrediction(BaseModel):
    """What each rank in `ranks` issues per iteration (ranks that behave identically share one entry)."""

    stage: int
    ranks: list[int]  # global ranks, Megatron layout rank = (pp_i * dp + dp_i) * tp + tp_i (cp inside dp)
    params_per_rank: int
    ops: list[PredictedOp]
    totals: list[SchemeTotal]
    # CPU offload copies (docs/models.md), apart from the collectives; left out of the JSON when there are none.
    host_transfers: list[HostTransfer] = Field(default_factory=list, exclude_if=lambda v: not v)


class ParamCheck(BaseModel):
    """The predictor's parameter counts against the counts recorded with the run (RecordedParams)."""

    agrees: bool
    notes: list[str]


class Prediction(BaseModel):
    implementation: Implementation
    world_size: int
    param_count: int
    stages: list[StagePrediction]
    totals: list[SchemeTotal]  # mean over the ranks of the world, per rank per iteration
    notes: list[str] = []
    param_check: ParamCheck | None = None  # None: the input recorded no parameter counts
