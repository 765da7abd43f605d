"""Exact prediction for the bundled harness: mirrors harness/README.md ("What each rank issues per step").

Everything here follows the harness's own algorithm: its parameter shapes and registration order,
DDP's rebuilt buckets in gradient-ready order, flat ZeRO-1/2 buffers padded to a multiple of dp,
FSDP2 units padded per parameter on dim 0, its TP/SP collectives and its pipeline point-to-point
calls. A difference between this and a harness trace is a bug in one of them.
"""

from __future__ import annotations

import math

from commlens.runconfig import RunConfig
from commlens.vocab import DTYPE_BYTES

from .predict import (
    IMPLEMENTATIONS, BucketSpec, DtypeSpec, ModelSpec, ParallelSpec, PredictedOp, Prediction, PredictInput,
    RecordedParams, StagePrediction, _merge, check_params, mean_totals, param_count, totals,
)

Param = tuple[str, tuple[int, ...]]  # (registration name, shape)


def harness_params(m: ModelSpec, t: int, first: bool, last: bool, layers: int) -> list[Param]:
    """The stage's parameters on one tp rank, in registration order, with their shapes."""
    h, V, s, f = m.hidden, m.vocab, m.seq_len, m.f
    out: list[Param] = []
    if first:
        out += [("embed.wte", (V // t, h)), ("embed.wpe", (s, h))]
    for i in range(layers):
        out += [
            (f"blocks.{i}.ln1.weight", (h,)), (f"blocks.{i}.ln1.bias", (h,)),
            (f"blocks.{i}.attn.qkv.weight", (3 * h // t, h)), (f"blocks.{i}.attn.qkv.bias", (3 * h // t,)),
            (f"blocks.{i}.attn.proj.weight", (h, h // t)), (f"blocks.{i}.attn.proj.bias", (h,)),
            (f"blocks.{i}.ln2.weight", (h,)), (f"blocks.{i}.ln2.bias", (h,)),
            (f"blocks.{i}.mlp.fc1.weight", (f // t, h)), (f"blocks.{i}.mlp.fc1.bias", (f // t,)),
            (f"blocks.{i}.mlp.fc2.weight", (h, f // t)), (f"blocks.{i}.mlp.fc2.bias", (h,)),
        ]
    if last:
        out += [("head.ln_f.weight", (h,)), ("head.ln_f.bias", (h,)), ("head.lm_head.weight", (V // t, h))]
    return out


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _is_sp_param(name: str) -> bool:
    leaf = name.split(".")
    return name == "embed.wpe" or leaf[-2].startswith("ln") or (leaf[-1] == "bias" and leaf[-2] in ("proj", "fc2"))


def gradient_ready_order(params: list[Param]) -> list[Param]:
    """The order autograd finishes the gradients of the harness GPT (measured on the model): modules in
    reverse; within a Linear bias before weight, within a LayerNorm weight before bias; head first
    (lm_head, ln_f.weight, ln_f.bias), embedding last (wpe, wte)."""
    by_name = dict(params)
    order: list[str] = []
    if "head.lm_head.weight" in by_name:
        order += ["head.lm_head.weight", "head.ln_f.weight", "head.ln_f.bias"]
    blocks = sorted({int(n.split(".")[1]) for n in by_name if n.startswith("blocks.")}, reverse=True)
    for i in blocks:
        order += [f"blocks.{i}.{n}" for n in (
            "mlp.fc2.bias", "mlp.fc2.weight", "mlp.fc1.bias", "mlp.fc1.weight", "ln2.weight", "ln2.bias",
            "attn.proj.bias", "attn.proj.weight", "attn.qkv.bias", "attn.qkv.weight", "ln1.weight", "ln1.bias")]
    if "embed.wte" in by_name:
        order += ["embed.wpe", "embed.wte"]
    return [(n, by_name[n]) for n in order]


def ddp_rebuilt_buckets(params: list[Param], w: int, first_cap: int, cap: int) -> list[int]:
    """Bucket bytes after DDP's rebuild: gradient-ready order, a bucket closes once it reaches its limit
    (first limit `first_cap`, then `cap`), the remainder forms the last bucket."""
    buckets, current, limit = [], 0, first_cap
    for _, shape in gradient_ready_order(params):
        current += _numel(shape) * w
        if current >= limit:
            buckets.append(current)
            current, limit = 0, cap
    if current:
        buckets.append(current)
    return buckets


def _fsdp_unit(params: list[Param], d: int) -> int:
    """Elements of an FSDP2 unit's all-gather output: dim 0 of every parameter padded to a multiple of d."""
    return d * sum(math.ceil(shape[0] / d) * (_numel(shape) // shape[0]) for _, shape in params)


def _chunk_rows(dim0: int, d: int, r: int) -> int:
    """Rows of torch.chunk(dim0 rows, d)[r] (empty chunks past the end)."""
    c = math.ceil(dim0 / d)
    return max(0, min(c, dim0 - r * c))


def predict_harness(inp: PredictInput) -> Prediction:
    m, p, dt, b = inp.model, inp.parallel, inp.dtypes, inp.buckets
    if p.cp > 1 or p.virtual_stages > 1 or p.recompute != "none":
        raise ValueError("the harness has no context parallelism, interleaving or recomputation")
    if m.tied_embeddings or not m.learned_pos or m.f != 4 * m.hidden or m.h_kv != m.hidden:
        raise ValueError("the harness GPT has learned positions, untied embeddings, FFN 4h and multi-head attention")
    if m.padded_vocab(p.tp) != m.vocab:
        raise ValueError("the harness does not pad the vocabulary (vocab_divisible_by must leave it unchanged)")
    if dt.act != dt.grad or dt.act != dt.param:
        raise ValueError("the harness uses one dtype for parameters, gradients and activations")
    d, t, pp, M = p.dp, p.tp, p.pp, p.micro_batches
    w = DTYPE_BYTES[dt.act]
    l_stage = m.layers // pp
    A = p.micro_batch_size * m.seq_len * m.hidden * w
    dp_sync = _dp_sync(p)
    entries: list[StagePrediction] = []
    for stage in range(pp):
        first, last = stage == 0, stage == pp - 1
        params = harness_params(m, t, first, last, l_stage)
        n_params = sum(_numel(s) for _, s in params)
        common: list[PredictedOp] = []

        def add(ops: list[PredictedOp], scheme: str, group: str, n: int, op: str, size: int, calls: int,
                what: str, dtype: str | None = None, per_micro: bool = True) -> None:
            if calls:
                ops.append(PredictedOp(scheme=scheme, group=group, group_size=n, op=op, dtype=dtype or dt.act,
                                       msg_bytes=size, calls_per_iter=calls, per_micro_step=per_micro, what=what))

        # ---- tp
        if t > 1:
            if not p.sp:
                add(common, "tp", "tp", t, "all_reduce", A, M * (4 * l_stage + first + last),
                    "row-parallel outputs (fwd) and column-parallel input grads (bwd); embedding output; LM-head input grad")
            else:
                n = M * (4 * l_stage + first + last)
                add(common, "tp", "tp", t, "all_gather", A, n, "sequence-parallel gathers (fwd) and their transposes (bwd)")
                add(common, "tp", "tp", t, "reduce_scatter", A, n, "sequence-parallel scatters (fwd) and their transposes (bwd)")
            if last:
                add(common, "tp", "tp", t, "all_reduce", p.micro_batch_size * m.seq_len * 4, 3 * M,
                    "vocab-parallel cross-entropy (max, target logit, sum of exp)", dtype="float32")
        # ---- pp
        if pp > 1:
            s_p = m.seq_len // t if p.sp else m.seq_len
            S = p.micro_batch_size * s_p * m.hidden * w
            for peer_group, present in (("pp:prev", stage > 0), ("pp:next", stage < pp - 1)):
                if present:
                    what = "activation gradients / activations" if peer_group == "pp:prev" else "activations / activation gradients"
                    add(common, "pp", peer_group, 2, "send", S, M, what)
                    add(common, "pp", peer_group, 2, "recv", S, M, what)
        # ---- dp
        if d > 1:
            if dp_sync == "ddp":
                first_cap = b.ddp_first_bucket_bytes or 2**20
                cap = int(b.ddp_bucket_cap_mb * 2**20)
                sizes = ddp_rebuilt_buckets(params, w, first_cap, cap)
                rounds = M if p.sync_every_micro_step else 1
                for size in sorted(set(sizes), reverse=True):
                    add(common, "dp", "dp", d, "all_reduce", size, sizes.count(size) * rounds, "DDP gradient bucket", per_micro=rounds > 1)
            elif dp_sync == "allreduce":
                add(common, "dp", "dp", d, "all_reduce", n_params * w, 1, "flat gradient buffer", per_micro=False)
            elif dp_sync in ("zero1", "zero2"):
                P = math.ceil(n_params / d) * d
                add(common, "dp", "dp", d, "reduce_scatter", P * w, M if dp_sync == "zero2" else 1, "flat gradient buffer",
                    per_micro=dp_sync == "zero2")
                add(common, "dp", "dp", d, "all_gather", P * w, 1, "flat parameter buffer after the update", per_micro=False)
            elif dp_sync == "zero3":
                root = [(n, s) for n, s in params if not n.startswith("blocks.")]
                for i in range(l_stage):
                    U = _fsdp_unit([(n, s) for n, s in params if n.startswith(f"blocks.{i}.")], d)
                    add(common, "dp", "dp", d, "all_gather", U * w, 2 * M, f"block {i} parameters (fwd and bwd)")
                    add(common, "dp", "dp", d, "reduce_scatter", U * w, M, f"block {i} gradients")
                if root:
                    U = _fsdp_unit(root, d)
                    add(common, "dp", "dp", d, "all_gather", U * w, M, "root unit parameters")
                    add(common, "dp", "dp", d, "reduce_scatter", U * w, M, "root unit gradients")
        # ---- SP parameter-gradient all_reduce in tp (differs by dp rank under ZeRO-3)
        ranks = [(stage * d + r) * t + k for r in range(d) for k in range(t)]
        if t > 1 and p.sp:
            sp_params = [(n, s) for n, s in params if _is_sp_param(n)]
            per_dp: dict[int, int] = {}
            for r in range(d):
                if dp_sync == "zero3":
                    per_dp[r] = sum(_chunk_rows(s[0], d, r) * (_numel(s) // s[0]) for _, s in sp_params) * w
                else:
                    per_dp[r] = sum(_numel(s) for _, s in sp_params) * w
            calls = M if dp_sync == "zero2" else 1
            for size in sorted(set(per_dp.values()), reverse=True):
                dp_ranks = [r for r in range(d) if per_dp[r] == size]
                ops = list(common)
                add(ops, "tp", "tp", t, "all_reduce", size, calls, "sequence-parallel parameter gradients", per_micro=calls > 1)
                rk = [(stage * d + r) * t + k for r in dp_ranks for k in range(t)]
                entries.append(StagePrediction(stage=stage, ranks=rk, params_per_rank=n_params, ops=_merge(ops), totals=totals(ops)))
        else:
            entries.append(StagePrediction(stage=stage, ranks=ranks, params_per_rank=n_params, ops=_merge(common), totals=totals(common)))
    check = check_params(inp, entries)
    if check is None or check.agrees:
        notes = ["harness implementation: exact to the byte for profiled steps (set-up traffic excluded)"]
    else:
        notes = ["harness implementation: not exact for this run, its recorded parameter counts disagree"]
    if p.zero >= 2 and M > 1:
        notes.append(f"ZeRO-{p.zero} communicates every micro-step: {M} micro-steps multiply that traffic")
    return Prediction(implementation="harness", world_size=p.world_size, param_count=param_count(m),
                      stages=entries, totals=mean_totals(entries), notes=notes + (check.notes if check else []),
                      param_check=check)


def _dp_sync(p: ParallelSpec) -> str:
    if p.dp == 1:
        return "none"
    if p.zero == 0:
        return "ddp" if p.pp == 1 else "allreduce"
    return f"zero{p.zero}"


def input_from_run_config(cfg: RunConfig | dict) -> PredictInput:
    """The predictor input for a harness run.json (or any RunConfig-shaped config): its implementation,
    model, parallel layout, dtypes and buckets, and its recorded parameter counts (checked against the
    prediction's). Bucket sizes the config leaves unset keep the predictor's defaults."""
    if isinstance(cfg, dict):
        cfg = RunConfig.model_validate(cfg)
    if cfg.implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {cfg.implementation!r}; one of {', '.join(IMPLEMENTATIONS)}")
    m, p, bk = cfg.model, cfg.parallel, cfg.buckets
    framework_buckets = {n: getattr(bk, n) for n in ("megatron_bucket_params", "deepspeed_reduce_bucket_elems",
                                                     "deepspeed_allgather_bucket_elems") if getattr(bk, n) is not None}
    per_rank = {r.rank: r.param_count for r in cfg.ranks if r.param_count is not None}
    recorded = RecordedParams(total=m.param_count, per_rank=per_rank) if m.param_count is not None or per_rank else None
    return PredictInput(
        model=ModelSpec(layers=m.layers, hidden=m.hidden, heads=m.heads, vocab=m.vocab, seq_len=m.seq_len,
                        ffn_hidden=m.ffn_hidden, tied_embeddings=m.tied_embeddings, learned_pos=m.learned_pos,
                        kv_heads=m.kv_heads, vocab_divisible_by=m.vocab_divisible_by),
        parallel=ParallelSpec(dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp, zero=p.zero, sp=p.sp, micro_batches=p.micro_batches,
                              micro_batch_size=p.micro_batch_size, schedule=p.schedule, recompute=p.recompute,
                              virtual_stages=p.virtual_stages, sync_every_micro_step=not p.ddp_no_sync),
        dtypes=DtypeSpec(act=cfg.dtypes.act, grad=cfg.dtypes.grad, param=cfg.dtypes.param),
        buckets=BucketSpec(ddp_bucket_cap_mb=bk.ddp_bucket_cap_mb or 25.0,
                           ddp_first_bucket_bytes=bk.ddp_first_bucket_bytes or 2**20,
                           zero_bucket_bytes=bk.zero_bucket_bytes, **framework_buckets),
        implementation=cfg.implementation,  # type: ignore[arg-type]
        recorded_params=recorded,
    )


def predict_input_from_config(raw: dict) -> PredictInput:
    """The predictor input of a stored or supplied config: a harness run.json (`"schema": "commlens.run/..."`)
    or a predictor input as it is. ValueError (pydantic's included) says why neither fits."""
    if str(raw.get("schema", "")).startswith("commlens.run"):
        return input_from_run_config(raw)
    return PredictInput.model_validate(raw)
