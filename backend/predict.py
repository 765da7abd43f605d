"""Analytical communication-volume predictor (the specification is ../shared/docs/volume-models.md).

`predict(PredictInput) -> Prediction` lists, per pipeline stage (ranks of one stage behave alike), the
collectives one rank issues per iteration: (scheme, group, op, dtype, S, calls). Implementations:
`paper` (textbook forms), `megatron`, `deepspeed`, `fsdp` (PyTorch DDP/FSDP) and `harness`, whose
prediction mirrors the bundled harness's algorithm and is exact to the byte (backend/predict_harness.py).
"""

from __future__ import annotations

import math
from typing import Literal, get_args

from pydantic import BaseModel, Field, model_validator

from commlens.vocab import DTYPE_BYTES, busbw_factor

Implementation = Literal["harness", "megatron", "deepspeed", "fsdp", "paper"]
IMPLEMENTATIONS: tuple[str, ...] = get_args(Implementation)
MEGATRON_VOCAB_DIVISIBLE_BY = 128  # Megatron-LM's make_vocab_size_divisible_by default (volume-models.md §5.3)
MAX_DEGREE = 1 << 20  # bound of the mesh split and the prefetch gap (API inputs must not be unbounded)


class ModelSpec(BaseModel):
    layers: int = Field(ge=1)
    hidden: int = Field(ge=1)
    heads: int = Field(ge=1)
    kv_heads: int | None = None  # GQA; default = heads
    ffn_hidden: int | None = None  # default 4h
    vocab: int = Field(ge=1)
    seq_len: int = Field(ge=1)
    learned_pos: bool = True
    tied_embeddings: bool = False
    # Megatron's rule (volume-models.md §5.3): V padded to a multiple of this x tp. None: the implementation's
    # default, which PredictInput fills in: 128 for megatron (`make_vocab_size_divisible_by`), else no padding.
    vocab_divisible_by: int | None = Field(None, ge=1)
    # Total parameters of a model the GPT formulas do not describe (a CNN, a recommender): DP and ZeRO
    # volumes then come from this count as one flat gradient; TP/PP/CP still use the shape fields.
    params_override: int | None = Field(None, ge=1)

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
    dp: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    cp: int = Field(1, ge=1)
    zero: Literal[0, 1, 2, 3] = 0
    sp: bool = False
    micro_batches: int = Field(1, ge=1)
    micro_batch_size: int = Field(1, ge=1)
    virtual_stages: int = Field(1, ge=1)  # interleaved model chunks per pipeline device
    recompute: Literal["none", "selective", "full"] = "none"
    sync_every_micro_step: bool = False  # DDP without no_sync()
    schedule: Literal["gpipe", "1f1b"] = "1f1b"
    # Megatron's PP scatter/gather (volume-models.md §6.5): each TP rank sends A/t, the receiver all-gathers A.
    pp_scatter_gather: bool = False
    # Context parallelism (§6.7): ring attention, or ATTENTION2D on an r_Q x r_KV mesh with r_Q = cp_rq,
    # r_KV = cp / r_Q (default r_Q = r_KV = sqrt(cp), which needs cp to be a perfect square).
    cp_style: Literal["ring", "attention2d"] = "ring"
    cp_rq: int | None = Field(None, ge=1, le=MAX_DEGREE)
    # CPU offload of the ZeRO-3 optimizer (§6.8): host<->device copies, reported apart from the collectives.
    offload: Literal["none", "zero_offload", "deep_optimizer_states"] = "none"
    prefetch_gap: int = Field(1, ge=1, le=MAX_DEGREE)  # Deep Optimizer States' prefetch_optimizer_gap g

    @model_validator(mode="after")
    def _check(self) -> "ParallelSpec":
        if self.sp and self.tp == 1:
            raise ValueError("sequence parallelism (sp) needs tp > 1")
        if self.pp_scatter_gather and self.tp == 1:
            raise ValueError("pp_scatter_gather splits pipeline messages over the TP group and needs tp > 1")
        if self.pp_scatter_gather and self.sp:
            raise ValueError("pp_scatter_gather and sp exclude each other: with sequence parallelism pipeline "
                             "messages are already A/t per TP rank (volume-models.md §6.5)")
        if self.cp_style == "ring" and self.cp_rq is not None:
            raise ValueError("cp_rq is the ATTENTION2D mesh split; it needs cp_style='attention2d'")
        if self.cp_style == "attention2d":
            if self.cp_rq is None and math.isqrt(self.cp) ** 2 != self.cp:
                raise ValueError(f"ATTENTION2D with cp={self.cp}: cp is not a perfect square, so give cp_rq "
                                 f"(r_Q, a divisor of cp; r_KV = cp / r_Q)")
            if self.cp_rq is not None and self.cp % self.cp_rq:
                raise ValueError(f"ATTENTION2D: cp_rq={self.cp_rq} must divide cp={self.cp} (r_Q x r_KV = cp)")
        if self.offload != "none" and self.zero != 3:
            raise ValueError(f"offload={self.offload!r}: the CPU-offload volumes (volume-models.md §6.8) assume "
                             f"ZeRO-3; set zero=3 (got zero={self.zero})")
        if self.prefetch_gap != 1 and self.offload != "deep_optimizer_states":
            raise ValueError("prefetch_gap is Deep Optimizer States' prefetch_optimizer_gap; it needs "
                             "offload='deep_optimizer_states'")
        return self

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

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
    # Host-side optimizer state per parameter for CPU offload (§6.8): fp32 master weights + Adam m and v.
    optimizer_state_bytes: int = Field(12, ge=1, le=64)

    @model_validator(mode="after")
    def _known(self) -> "DtypeSpec":
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
    deepspeed_param_persistence_threshold: int = Field(100_000, ge=0, le=1 << 62)


class RecordedParams(BaseModel):
    """Parameter counts recorded with a run (a harness run.json holds the built model's real counts),
    checked against the counts the predictor derives from the model config."""

    total: int | None = Field(None, ge=1)  # the whole model, one copy (run.json model.param_count)
    per_rank: dict[int, int] = {}  # global rank -> parameters it holds before ZeRO sharding (ranks[].param_count)


class PredictInput(BaseModel):
    model: ModelSpec
    parallel: ParallelSpec = ParallelSpec()
    dtypes: DtypeSpec = DtypeSpec()
    buckets: BucketSpec = BucketSpec()
    implementation: Implementation = "paper"
    recorded_params: RecordedParams | None = None

    @model_validator(mode="after")
    def _vocab_padding(self) -> "PredictInput":
        if self.model.vocab_divisible_by is None and self.implementation == "megatron":
            self.model = self.model.model_copy(update={"vocab_divisible_by": MEGATRON_VOCAB_DIVISIBLE_BY})
        return self

    @model_validator(mode="after")
    def _supported(self) -> "PredictInput":
        p = self.parallel
        if self.implementation == "harness" and (p.pp_scatter_gather or p.offload != "none"):
            raise ValueError("the harness has no PP scatter/gather and no CPU offload")
        if self.implementation == "fsdp" and p.offload != "none":
            raise ValueError("offload models DeepSpeed-style ZeRO-3 optimizer offload (volume-models.md §6.8); "
                             "PyTorch FSDP CPUOffload also moves parameters and is not specified")
        return self

    @model_validator(mode="after")
    def _divisible(self) -> "PredictInput":
        m, p = self.model, self.parallel
        if m.layers % p.pp:
            raise ValueError(f"layers ({m.layers}) must be divisible by pp ({p.pp})")
        if m.heads % p.tp:
            raise ValueError(f"heads ({m.heads}) must be divisible by tp ({p.tp})")
        if p.virtual_stages > 1 and m.layers % (p.pp * p.virtual_stages):
            raise ValueError("layers must be divisible by pp x virtual_stages")
        if m.seq_len % p.cp:
            raise ValueError(f"seq_len ({m.seq_len}) must be divisible by cp ({p.cp})")
        return self


class PredictedOp(BaseModel):
    scheme: str  # dp | tp | pp | cp
    group: str  # e.g. "dp", "tp", "pp:next", "pp:prev", "pp:embedding"
    group_size: int
    op: str
    dtype: str
    msg_bytes: int
    calls_per_iter: int
    per_micro_step: bool = False  # issued every micro-step (ZeRO-2/3, TP, PP) rather than once per step
    what: str = ""  # which tensor(s)


class HostTransfer(BaseModel):
    """A host<->device copy (cudaMemcpy over PCIe, volume-models.md §6.8) per rank per iteration: not a
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
    # CPU offload copies (§6.8), apart from the collectives; left out of the JSON when there are none.
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


# ------------------------------------------------------------------------------------ parameters


def layer_params(m: ModelSpec, tp: int) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(TP-sharded tensors, replicated tensors) of one transformer layer on one TP rank, forward order."""
    h, f, qkv = m.hidden, m.f, m.hidden + 2 * m.h_kv
    sharded = [
        ("attn.qkv.weight", h * qkv // tp), ("attn.qkv.bias", qkv // tp), ("attn.proj.weight", h * h // tp),
        ("mlp.fc1.weight", h * f // tp), ("mlp.fc1.bias", f // tp), ("mlp.fc2.weight", f * h // tp),
    ]
    replicated = [("ln1.weight", h), ("ln1.bias", h), ("attn.proj.bias", h), ("ln2.weight", h), ("ln2.bias", h), ("mlp.fc2.bias", h)]
    return sharded, replicated


def stage_parameters(m: ModelSpec, p: ParallelSpec, stage: int) -> list[tuple[str, int]]:
    """Parameter tensors held by one rank of a pipeline stage, in the model's parameter order."""
    if m.params_override is not None:
        return [("params", math.ceil(m.params_override / (p.tp * p.pp)))]
    t, V = p.tp, m.padded_vocab(p.tp)
    l_stage = m.layers // p.pp
    params: list[tuple[str, int]] = []
    if stage == 0:
        params.append(("embed.tok", V * m.hidden // t))
        if m.learned_pos:
            params.append(("embed.pos", m.seq_len * m.hidden))
    for layer in range(stage * l_stage, (stage + 1) * l_stage):
        sharded, replicated = layer_params(m, t)
        order = [
            ("ln1.weight", replicated[0][1]), ("ln1.bias", replicated[1][1]),
            sharded[0], sharded[1], sharded[2], ("attn.proj.bias", replicated[2][1]),
            ("ln2.weight", replicated[3][1]), ("ln2.bias", replicated[4][1]),
            sharded[3], sharded[4], sharded[5], ("mlp.fc2.bias", replicated[5][1]),
        ]
        params += [(f"blocks.{layer}.{n}", c) for n, c in order]
    if stage == p.pp - 1:
        params += [("ln_f.weight", m.hidden), ("ln_f.bias", m.hidden)]
        if not m.tied_embeddings or p.pp > 1:
            params.append(("lm_head.weight", V * m.hidden // t))
    return params


def param_count(m: ModelSpec) -> int:
    """Total parameters of the GPT (one copy, unsharded, unpadded vocabulary)."""
    if m.params_override is not None:
        return m.params_override
    one = ParallelSpec()
    total = sum(c for _, c in stage_parameters(m.model_copy(update={"vocab_divisible_by": None}), one, 0))
    return total


def check_params(inp: PredictInput, stages: list[StagePrediction]) -> ParamCheck | None:
    """Compare the recorded parameter counts (whole model, and per rank) with the predictor's: the
    model's count with its padded vocabulary, and each rank's stage entry's params_per_rank."""
    rec = inp.recorded_params
    if rec is None or (rec.total is None and not rec.per_rank):
        return None
    m = inp.model
    predicted = param_count(m.model_copy(update={"vocab": m.padded_vocab(inp.parallel.tp)}))
    problems: list[str] = []
    if rec.total is not None and rec.total != predicted:
        problems.append(f"model: {rec.total:,} recorded, {predicted:,} from the model config")
    wrong: list[str] = []
    for rank, n in sorted(rec.per_rank.items()):
        entry = next((st for st in stages if rank in st.ranks), None)
        if entry is None:
            wrong.append(f"rank {rank}: {n:,} recorded, rank outside the predicted world of {inp.parallel.world_size}")
        elif entry.params_per_rank != n:
            wrong.append(f"rank {rank}: {n:,} recorded, {entry.params_per_rank:,} predicted (stage {entry.stage})")
    problems += wrong[:4] + ([f"and {len(wrong) - 4} more ranks"] if len(wrong) > 4 else [])
    if problems:
        return ParamCheck(agrees=False, notes=[
            "parameter counts disagree with the run's record (" + "; ".join(problems) + "): the model config does "
            "not describe the model that ran, so the prediction cannot be exact"])
    what = [f"model {rec.total:,}"] if rec.total is not None else []
    what += [f"{len(rec.per_rank)} ranks"] if rec.per_rank else []
    return ParamCheck(agrees=True, notes=[f"parameter counts agree with the run's record ({', '.join(what)})"])


# ------------------------------------------------------------------------------------ helpers


def _w(name: str) -> int:
    return DTYPE_BYTES[name]


def ddp_buckets(sizes_bytes: list[int], cap_bytes: int, first_cap: int | None) -> list[int]:
    """PyTorch DDP bucket assignment: tensors in reverse parameter order, a bucket closes once it
    reaches its cap (so it may exceed it by one tensor); the first bucket's cap is `first_cap`."""
    buckets: list[int] = []
    current = 0
    cap = first_cap or cap_bytes
    for size in reversed(sizes_bytes):
        current += size
        if current >= cap:
            buckets.append(current)
            current = 0
            cap = cap_bytes
    if current:
        buckets.append(current)
    return buckets


def _chunks(total: int, chunk: int) -> list[int]:
    if chunk <= 0 or total <= chunk:
        return [total] if total else []
    full, rest = divmod(total, chunk)
    return [chunk] * full + ([rest] if rest else [])


def totals(ops: list[PredictedOp]) -> list[SchemeTotal]:
    out: dict[str, SchemeTotal] = {}
    for o in ops:
        t = out.setdefault(o.scheme, SchemeTotal(scheme=o.scheme, s_sum=0, wire_bytes=0.0, paper_bytes=0))
        if o.op == "recv":
            t.recv_bytes += o.msg_bytes * o.calls_per_iter
            continue
        t.s_sum += o.msg_bytes * o.calls_per_iter
        t.wire_bytes += o.msg_bytes * busbw_factor(o.op, o.group_size) * o.calls_per_iter
        t.paper_bytes += o.msg_bytes * o.calls_per_iter * (2 if o.op == "all_reduce" else 1)
    return sorted(out.values(), key=lambda t: t.scheme)


# ------------------------------------------------------------------------------------ schemes


def _dp_ops(inp: PredictInput, stage: int, params: list[tuple[str, int]]) -> list[PredictedOp]:
    p, dt, b = inp.parallel, inp.dtypes, inp.buckets
    d = p.dp * p.cp
    if d == 1:
        return []
    n_params = sum(c for _, c in params)
    G = n_params * _w(dt.grad)
    mb = p.micro_batches
    impl = inp.implementation

    def op(o: str, size: int, calls: int, dtype: str, what: str, per_micro: bool = False) -> PredictedOp:
        return PredictedOp(scheme="dp", group="dp", group_size=d, op=o, dtype=dtype, msg_bytes=size,
                           calls_per_iter=calls, per_micro_step=per_micro, what=what)

    ops: list[PredictedOp] = []
    if p.zero == 0:
        rounds = mb if p.sync_every_micro_step else 1
        if impl == "fsdp":
            sizes = ddp_buckets([c * _w(dt.grad) for _, c in params], int(b.ddp_bucket_cap_mb * 2**20), b.ddp_first_bucket_bytes)
        elif impl == "megatron":
            cap = b.megatron_bucket_params or max(40_000_000, 1_000_000 * d)
            sizes = [c * _w(dt.grad) for c in _chunks(n_params, cap)]
        elif impl == "deepspeed":
            sizes = [c * _w(dt.grad) for c in _chunks(n_params, b.deepspeed_reduce_bucket_elems)]
        else:
            sizes = [G]
        for s in sorted(set(sizes), reverse=True):
            ops.append(op("all_reduce", s, sizes.count(s) * rounds, dt.grad, "gradient bucket", rounds > 1))
        return ops
    # ZeRO: padded flat buffers divisible by d.
    pad = lambda n: math.ceil(n / d) * d  # noqa: E731
    if p.zero in (1, 2):
        rs_rounds = mb if p.zero == 2 else 1
        if impl == "deepspeed":
            for s in _chunks(pad(n_params), b.deepspeed_reduce_bucket_elems):
                ops.append(op("reduce", s * _w(dt.grad) // d, d * rs_rounds, dt.grad, "gradient partition to its owner", p.zero == 2))
            ag = _chunks(pad(n_params), b.deepspeed_allgather_bucket_elems)
        else:
            for s in _chunks(pad(n_params), (b.zero_bucket_bytes or 0) // _w(dt.grad)):
                ops.append(op("reduce_scatter", s * _w(dt.grad), rs_rounds, dt.grad, "gradients", p.zero == 2))
            ag = _chunks(pad(n_params), (b.zero_bucket_bytes or 0) // _w(dt.param))
        for s in ag:
            ops.append(op("all_gather", s * _w(dt.param), 1, dt.param, "updated parameters"))
        return _merge(ops)
    # ZeRO-3 / FSDP FULL_SHARD: per unit (each layer, plus the rest as the root unit) per micro-step.
    # DeepSpeed keeps parameters of at most stage3_param_persistence_threshold elements whole (§6.2): they
    # are not gathered per micro-step, their gradients are still reduce-scattered.
    persist = _persistent(inp, params)
    units: dict[str, list[int]] = {}  # unit -> [all parameters, gathered parameters]
    for name, c in params:
        key = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else "root"
        u = units.setdefault(key, [0, 0])
        u[0] += c
        u[1] += 0 if name in persist else c
    if impl == "paper":
        units = {"all": [n_params, n_params]}
    for key, (n, gathered) in units.items():
        if gathered:
            ops.append(op("all_gather", pad(gathered) * _w(dt.param), mb, dt.param, f"{key} parameters (forward)", True))
            ops.append(op("all_gather", pad(gathered) * _w(dt.param), mb, dt.param, f"{key} parameters (backward)", True))
        ops.append(op("reduce_scatter", pad(n) * _w(dt.grad), mb, dt.grad, f"{key} gradients", True))
    if persist:
        # DeepSpeed's _post_step re-gathers the persistent parameters (each padded to d) once per optimizer step.
        ops.append(op("all_gather", sum(pad(c) for c in persist.values()) * _w(dt.param), 1, dt.param,
                      "persistent parameters after the optimizer step"))
    return _merge(ops)


def _persistent(inp: PredictInput, params: list[tuple[str, int]]) -> dict[str, int]:
    """DeepSpeed ZeRO-3 persistent parameters: numel <= stage3_param_persistence_threshold
    (DeepSpeed's mark_persistent_parameters; model_persistence_threshold, unlimited by default, not modelled)."""
    if inp.implementation != "deepspeed" or inp.parallel.zero != 3:
        return {}
    threshold = inp.buckets.deepspeed_param_persistence_threshold
    return {name: c for name, c in params if c <= threshold}


def _tp_ops(inp: PredictInput, stage: int) -> list[PredictedOp]:
    m, p, dt = inp.model, inp.parallel, inp.dtypes
    t = p.tp
    if t == 1:
        return []
    mb, l_stage = p.micro_batches, m.layers // p.pp
    A = p.micro_batch_size * (m.seq_len // p.cp) * m.hidden * _w(dt.act)
    first, last = stage == 0, stage == p.pp - 1

    def op(o: str, size: int, calls: int, what: str, dtype: str | None = None) -> PredictedOp:
        return PredictedOp(scheme="tp", group="tp", group_size=t, op=o, dtype=dtype or dt.act, msg_bytes=size,
                           calls_per_iter=calls, per_micro_step=True, what=what)

    ops: list[PredictedOp] = []
    recompute = 2 * l_stage * mb if p.recompute == "full" else 0
    if not p.sp:
        ops.append(op("all_reduce", A, 4 * l_stage * mb + recompute, "attention and MLP outputs (fwd) and input grads (bwd)"))
        if first:
            ops.append(op("all_reduce", A, mb, "vocab-parallel embedding output"))
        if last:
            ops.append(op("all_reduce", A, mb, "LM-head input gradient"))
    else:
        ag = (6 if inp.implementation == "megatron" else 4) * l_stage * mb
        ops.append(op("all_gather", A, ag + recompute, "sequence-parallel inputs of column-parallel layers"))
        ops.append(op("reduce_scatter", A, 4 * l_stage * mb + recompute, "row-parallel outputs and input grads"))
        ln = (6 * m.hidden * l_stage + (2 * m.hidden if last else 0)) * _w(dt.grad)
        ops.append(PredictedOp(scheme="tp", group="tp", group_size=t, op="all_reduce", dtype=dt.grad, msg_bytes=ln,
                               calls_per_iter=1, what="sequence-parallel LayerNorm and bias gradients"))
        if first:
            ops.append(op("reduce_scatter", A, mb, "vocab-parallel embedding output"))
        if last:
            ops.append(op("all_gather", A, mb, "LM-head input (fwd)"))
            ops.append(op("reduce_scatter", A, mb, "LM-head input gradient (bwd)"))
    if last:
        ce = p.micro_batch_size * (m.seq_len // p.cp) * _w(dt.loss)
        ops.append(op("all_reduce", ce, 3 * mb, "vocab-parallel cross-entropy (max, target logit, sum exp)", dt.loss))
    if p.pp_scatter_gather and p.pp > 1:
        fwd, bwd = _pp_messages(p, stage)
        if fwd + bwd:
            ops.append(op("all_gather", A, fwd + bwd, "PP scatter/gather: each received activation or gradient re-assembled"))
    return _merge(ops)


def _pp_ops(inp: PredictInput, stage: int) -> list[PredictedOp]:
    m, p, dt = inp.model, inp.parallel, inp.dtypes
    if p.pp == 1:
        return []
    A = p.micro_batch_size * (m.seq_len // p.cp) * m.hidden * _w(dt.act)
    S = A // p.tp if p.sp or p.pp_scatter_gather else A
    first, last = stage == 0, stage == p.pp - 1
    fwd, bwd = _pp_messages(p, stage)
    ops: list[PredictedOp] = []

    def op(o: str, group: str, calls: int, what: str) -> PredictedOp:
        return PredictedOp(scheme="pp", group=group, group_size=2, op=o, dtype=dt.act, msg_bytes=S,
                           calls_per_iter=calls, per_micro_step=True, what=what)

    if fwd:
        ops.append(op("send", "pp:next", fwd, "activations to the next stage"))
        ops.append(op("recv", "pp:next", fwd, "activation gradients from the next stage"))
    if bwd:
        ops.append(op("send", "pp:prev", bwd, "activation gradients to the previous stage"))
        ops.append(op("recv", "pp:prev", bwd, "activations from the previous stage"))
    if m.tied_embeddings and (first or last):
        size = m.padded_vocab(p.tp) * m.hidden * _w(dt.grad) // p.tp
        ops.append(PredictedOp(scheme="pp", group="pp:embedding", group_size=2, op="all_reduce", dtype=dt.grad,
                               msg_bytes=size, calls_per_iter=1, what="tied embedding gradient (first and last stage)"))
    return ops


def _pp_messages(p: ParallelSpec, stage: int) -> tuple[int, int]:
    """(messages sent to the next stage, messages sent to the previous stage) per iteration; each has a
    matching recv from that same neighbour (§6.5)."""
    mb, v = p.micro_batches, p.virtual_stages
    first, last = stage == 0, stage == p.pp - 1
    fwd = mb * (v - 1 if last else v) if v > 1 else (0 if last else mb)
    bwd = mb * (v - 1 if first else v) if v > 1 else (0 if first else mb)
    return fwd, bwd


def _cp_ops(inp: PredictInput, stage: int) -> list[PredictedOp]:
    m, p, dt = inp.model, inp.parallel, inp.dtypes
    c = p.cp
    if c == 1:
        return []
    if p.cp_style == "attention2d":
        return _attention2d_ops(inp)
    l_stage, mb = m.layers // p.pp, p.micro_batches
    S = 2 * p.micro_batch_size * (m.seq_len // c) * m.h_kv * _w(dt.act)
    calls = 3 * (c - 1) * l_stage * mb  # forward c-1 steps, backward about twice that
    return [
        PredictedOp(scheme="cp", group="cp:ring", group_size=c, op="send", dtype=dt.act, msg_bytes=S,
                    calls_per_iter=calls, per_micro_step=True, what="K and V blocks around the ring (fwd + bwd)"),
        PredictedOp(scheme="cp", group="cp:ring", group_size=c, op="recv", dtype=dt.act, msg_bytes=S,
                    calls_per_iter=calls, per_micro_step=True, what="K and V blocks around the ring (fwd + bwd)"),
    ]


def _attention2d_ops(inp: PredictInput) -> list[PredictedOp]:
    """ATTENTION2D forward per layer per micro-batch (§6.7 table) on the r_Q x r_KV mesh; each rank starts with
    s/c tokens. The spec gives no backward pass, so none is predicted. Groups of one rank issue nothing."""
    m, p, dt = inp.model, inp.parallel, inp.dtypes
    r_q, r_kv = p.cp_mesh
    b, s, w = p.micro_batch_size, m.seq_len, _w(dt.act)
    calls = (m.layers // p.pp) * p.micro_batches

    def op(o: str, group: str, n: int, size: int, what: str, dtype: str | None = None) -> PredictedOp:
        return PredictedOp(scheme="cp", group=group, group_size=n, op=o, dtype=dtype or dt.act, msg_bytes=size,
                           calls_per_iter=calls, per_micro_step=True, what=what)

    ops: list[PredictedOp] = []
    if r_q > 1:
        q = b * (s // r_kv) * m.hidden * w
        ops.append(op("all_gather", "cp:q", r_q, q, "ATTENTION2D Q blocks (fwd)"))
        ops.append(op("reduce_scatter", "cp:q", r_q, q, "ATTENTION2D partial outputs (fwd)"))
        # the log-sum-exp statistics that weight the combine: fp32, one per head and token
        ops.append(op("all_to_all", "cp:q", r_q, b * (s // r_kv) * m.heads * 4, "ATTENTION2D log-sum-exp of partial outputs (fwd)", "float32"))
    if r_kv > 1:
        ops.append(op("all_gather", "cp:kv", r_kv, 2 * b * (s // r_q) * m.h_kv * w, "ATTENTION2D K and V blocks, fused (fwd)"))
    return ops


def _host_transfers(inp: PredictInput, params: list[tuple[str, int]]) -> list[HostTransfer]:
    """CPU-offload host<->device bytes per rank per iteration (§6.8 table) on the rank's ZeRO-3 partition
    Ψ_z = ceil(Ψ_r / d) (d: the ZeRO group, dp x cp). Deep Optimizer States update floor(Ψ_z / g) parameters
    on the GPU (the table's fraction 1/g) and the rest on the CPU."""
    p, dt = inp.parallel, inp.dtypes
    if p.offload == "none":
        return []
    psi_z = math.ceil(sum(c for _, c in params) / (p.dp * p.cp))
    g_bytes, state = _w(dt.grad), dt.optimizer_state_bytes
    gpu = psi_z // p.prefetch_gap if p.offload == "deep_optimizer_states" else 0
    cpu = psi_z - gpu
    out: list[HostTransfer] = []
    if cpu:
        out.append(HostTransfer(direction="d2h", what="gradients to the CPU optimizer", bytes_per_iter=cpu * g_bytes))
        out.append(HostTransfer(direction="h2d", what="updated 16-bit parameters", bytes_per_iter=cpu * 2))
    if gpu:
        out.append(HostTransfer(direction="h2d", what="optimizer state prefetched for the GPU update",
                                bytes_per_iter=gpu * state))
        out.append(HostTransfer(direction="d2h", what="optimizer state written back after the GPU update",
                                bytes_per_iter=gpu * state))
    return out


def _merge(ops: list[PredictedOp]) -> list[PredictedOp]:
    """Merge entries that share (scheme, group, op, dtype, S), adding calls."""
    merged: dict[tuple, PredictedOp] = {}
    for o in ops:
        key = (o.scheme, o.group, o.op, o.dtype, o.msg_bytes)
        if key in merged:
            prev = merged[key]
            merged[key] = prev.model_copy(update={
                "calls_per_iter": prev.calls_per_iter + o.calls_per_iter,
                "what": prev.what if o.what in prev.what else f"{prev.what}; {o.what}",
            })
        else:
            merged[key] = o
    return list(merged.values())


def predict(inp: PredictInput) -> Prediction:
    if inp.implementation == "harness":
        from .predict_harness import predict_harness

        return predict_harness(inp)
    p = inp.parallel
    stages: list[StagePrediction] = []
    for stage in range(p.pp):
        params = stage_parameters(inp.model, p, stage)
        ops = _dp_ops(inp, stage, params) + _tp_ops(inp, stage) + _pp_ops(inp, stage) + _cp_ops(inp, stage)
        stages.append(StagePrediction(stage=stage, ranks=stage_ranks(p, stage), params_per_rank=sum(c for _, c in params),
                                      ops=ops, totals=totals(ops), host_transfers=_host_transfers(inp, params)))
    notes = []
    m = inp.model
    if m.params_override is None and m.padded_vocab(p.tp) != m.vocab:
        notes.append(f"vocabulary padded from {m.vocab:,} to {m.padded_vocab(p.tp):,} (a multiple of "
                     f"{m.vocab_divisible_by} x tp={p.tp}) in the embedding, LM head and their gradients")
    if inp.implementation != "paper":
        notes.append("bucketed DP/ZeRO ops are compared on totals (bucket boundaries are framework internals); ±5 % tolerance")
    if p.zero >= 2 and p.micro_batches > 1:
        notes.append(f"ZeRO-{p.zero} communicates gradients every micro-step: {p.micro_batches} micro-steps multiply that traffic")
    notes += _spec_notes(inp)
    check = check_params(inp, stages)
    return Prediction(
        implementation=inp.implementation, world_size=p.world_size, param_count=param_count(inp.model),
        stages=stages, totals=mean_totals(stages), notes=notes + (check.notes if check else []), param_check=check,
    )


def _spec_notes(inp: PredictInput) -> list[str]:
    """The assumptions behind PP scatter/gather, ATTENTION2D, CPU offload and ZeRO-3 persistence."""
    p, notes = inp.parallel, []
    if p.pp_scatter_gather:
        notes.append(
            "PP scatter/gather (§6.5): each TP rank sends and receives A/t, and every received message is followed "
            "by an all_gather (S = A) in the TP group. Assumed in both directions, activations (forward) and their "
            "gradients (backward): Megatron's p2p _communicate splits every tensor it sends and gathers every tensor "
            "it receives, send_forward and send_backward alike; PTD-P §4.1 describes only the forward"
            + (" (no effect with pp = 1)" if p.pp == 1 else ""))
    if p.cp > 1 and p.cp_style == "attention2d":
        r_q, r_kv = p.cp_mesh
        notes.append(
            f"ATTENTION2D (§6.7) on an r_Q x r_KV = {r_q} x {r_kv} mesh: forward ops only (Q all_gather and output "
            f"reduce_scatter in groups 'cp:q' of {r_q}, fused K/V all_gather in groups 'cp:kv' of {r_kv}, plus the "
            "fp32 log-sum-exp exchange as an all_to_all). The spec does not give the backward pass, so it is not "
            "included: measured CP traffic should exceed this prediction. Widths are not divided by tp (the spec does "
            "not compose ATTENTION2D with TP); the gradient reduction still spans dp x cp ranks")
    if p.offload != "none":
        how = ("ZeRO-Offload: all updates on the CPU" if p.offload == "zero_offload" else
               f"Deep Optimizer States, gap g = {p.prefetch_gap}: floor(Ψ_z/g) parameters updated on the GPU, "
               "the rest on the CPU; the spec's fraction 1/g assumes many equal optimizer sub-groups "
               "(sub_group_size is not modelled)")
        notes.append(
            f"CPU offload (§6.8, {how}): host<->device copies are listed per stage under host_transfers, not in "
            f"the scheme totals. Ψ_z = ceil(Ψ_r / (dp x cp)); gradients in {inp.dtypes.grad}, updated parameters "
            f"2 bytes, optimizer state {inp.dtypes.optimizer_state_bytes} bytes per parameter; gradients move once "
            "per iteration as in the spec's table (a framework that copies them every micro-step moves m times that)")
    threshold = inp.buckets.deepspeed_param_persistence_threshold
    if inp.implementation == "deepspeed" and p.zero == 3 and p.dp * p.cp > 1 and threshold > 0:
        notes.append(
            f"DeepSpeed ZeRO-3 (§6.2): parameters of at most {threshold:,} elements "
            "(stage3_param_persistence_threshold) stay whole on every rank and are not gathered in forward or "
            "backward; their gradients are still reduce-scattered, and DeepSpeed re-gathers them once per optimizer "
            "step (stage3.py _post_step), which the spec leaves out. stage3_prefetch_bucket_size is not modelled "
            "(the spec gives no rule for its counts; it does not change the S-sum)")
    return notes


def stage_ranks(p: ParallelSpec, stage: int) -> list[int]:
    per_stage = p.dp * p.cp * p.tp
    return list(range(stage * per_stage, (stage + 1) * per_stage))


def mean_totals(stages: list[StagePrediction]) -> list[SchemeTotal]:
    """Per-rank totals averaged over all ranks of the entries."""
    acc: dict[str, list[float]] = {}
    for st in stages:
        k = len(st.ranks)
        for t in st.totals:
            a = acc.setdefault(t.scheme, [0, 0.0, 0, 0])
            a[0] += t.s_sum * k
            a[1] += t.wire_bytes * k
            a[2] += t.paper_bytes * k
            a[3] += t.recv_bytes * k
    n = sum(len(st.ranks) for st in stages) or 1
    return [SchemeTotal(scheme=s, s_sum=round(a[0] / n), wire_bytes=a[1] / n, paper_bytes=round(a[2] / n), recv_bytes=round(a[3] / n))
            for s, a in sorted(acc.items())]
