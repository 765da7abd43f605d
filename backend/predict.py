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

    @model_validator(mode="after")
    def _check(self) -> "ParallelSpec":
        if self.sp and self.tp == 1:
            raise ValueError("sequence parallelism (sp) needs tp > 1")
        return self

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


class DtypeSpec(BaseModel):
    act: str = "bfloat16"
    grad: str = "bfloat16"
    param: str = "bfloat16"
    loss: str = "float32"

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
    units: dict[str, int] = {}
    for name, c in params:
        key = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else "root"
        units[key] = units.get(key, 0) + c
    if impl == "paper":
        units = {"all": n_params}
    for key, n in units.items():
        ops.append(op("all_gather", pad(n) * _w(dt.param), mb, dt.param, f"{key} parameters (forward)", True))
        ops.append(op("all_gather", pad(n) * _w(dt.param), mb, dt.param, f"{key} parameters (backward)", True))
        ops.append(op("reduce_scatter", pad(n) * _w(dt.grad), mb, dt.grad, f"{key} gradients", True))
    return _merge(ops)


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
    return _merge(ops)


def _pp_ops(inp: PredictInput, stage: int) -> list[PredictedOp]:
    m, p, dt = inp.model, inp.parallel, inp.dtypes
    if p.pp == 1:
        return []
    mb, v = p.micro_batches, p.virtual_stages
    A = p.micro_batch_size * (m.seq_len // p.cp) * m.hidden * _w(dt.act)
    S = A // p.tp if p.sp else A
    first, last = stage == 0, stage == p.pp - 1
    fwd = mb * (v - 1 if last else v) if v > 1 else (0 if last else mb)
    bwd = mb * (v - 1 if first else v) if v > 1 else (0 if first else mb)
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


def _cp_ops(inp: PredictInput, stage: int) -> list[PredictedOp]:
    m, p, dt = inp.model, inp.parallel, inp.dtypes
    c = p.cp
    if c == 1:
        return []
    l_stage, mb = m.layers // p.pp, p.micro_batches
    S = 2 * p.micro_batch_size * (m.seq_len // c) * m.h_kv * _w(dt.act)
    calls = 3 * (c - 1) * l_stage * mb  # forward c-1 steps, backward about twice that
    return [
        PredictedOp(scheme="cp", group="cp:ring", group_size=c, op="send", dtype=dt.act, msg_bytes=S,
                    calls_per_iter=calls, per_micro_step=True, what="K and V blocks around the ring (fwd + bwd)"),
        PredictedOp(scheme="cp", group="cp:ring", group_size=c, op="recv", dtype=dt.act, msg_bytes=S,
                    calls_per_iter=calls, per_micro_step=True, what="K and V blocks around the ring (fwd + bwd)"),
    ]


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
                                      ops=ops, totals=totals(ops)))
    notes = []
    m = inp.model
    if m.params_override is None and m.padded_vocab(p.tp) != m.vocab:
        notes.append(f"vocabulary padded from {m.vocab:,} to {m.padded_vocab(p.tp):,} (a multiple of "
                     f"{m.vocab_divisible_by} x tp={p.tp}) in the embedding, LM head and their gradients")
    if inp.implementation != "paper":
        notes.append("bucketed DP/ZeRO ops are compared on totals (bucket boundaries are framework internals); ±5 % tolerance")
    if p.zero >= 2 and p.micro_batches > 1:
        notes.append(f"ZeRO-{p.zero} communicates gradients every micro-step: {p.micro_batches} micro-steps multiply that traffic")
    check = check_params(inp, stages)
    return Prediction(
        implementation=inp.implementation, world_size=p.world_size, param_count=param_count(inp.model),
        stages=stages, totals=mean_totals(stages), notes=notes + (check.notes if check else []), param_check=check,
    )


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
