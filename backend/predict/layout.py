"""Which parameters each rank holds: the GPT layout the framework implementations assume, the bundled
harness's own GPT (its registration order, shapes and gradient-ready order), and the check of both against
the counts a run recorded."""

from __future__ import annotations

import math

from commlens.contract.predict import ModelSpec, ParallelSpec, ParamCheck, PredictInput, StagePrediction

from .adapters import Param

# ------------------------------------------------------------------------------------ frameworks


def _mlp(m: ModelSpec, tp: int, ep: int) -> list[tuple[str, int]]:
    """The MLP's tensors on one rank: dense and column/row parallel, or a router and the rank's experts."""
    h, f = m.hidden, m.f
    if not m.experts:
        return [
            ("mlp.fc1.weight", h * f // tp),
            ("mlp.fc1.bias", f // tp),
            ("mlp.fc2.weight", f * h // tp),
            ("mlp.fc2.bias", h),
        ]
    out = [("mlp.router.weight", m.experts * h)]
    for j in range(m.experts // ep):
        out += [
            (f"mlp.experts.{j}.fc1.weight", h * f),
            (f"mlp.experts.{j}.fc1.bias", f),
            (f"mlp.experts.{j}.fc2.weight", f * h),
            (f"mlp.experts.{j}.fc2.bias", h),
        ]
    return out


def _layer(m: ModelSpec, tp: int, layer: int, ep: int = 1) -> list[Param]:
    """One transformer layer's tensors on one TP (and EP) rank, in the model's parameter order."""
    h, qkv = m.hidden, m.hidden + 2 * m.h_kv
    counts = [
        ("ln1.weight", h),
        ("ln1.bias", h),
        ("attn.qkv.weight", h * qkv // tp),
        ("attn.qkv.bias", qkv // tp),
        ("attn.proj.weight", h * h // tp),
        ("attn.proj.bias", h),
        ("ln2.weight", h),
        ("ln2.bias", h),
        *_mlp(m, tp, ep),
    ]
    return [(f"blocks.{layer}.{name}", (c,)) for name, c in counts]


def stage_parameters(m: ModelSpec, p: ParallelSpec, stage: int) -> list[Param]:
    """Parameter tensors held by one rank of a pipeline stage, in the model's parameter order."""
    if m.params_override is not None:
        return [("params", (math.ceil(m.params_override / (p.tp * p.pp)),))]
    t, vocab = p.tp, m.padded_vocab(p.tp)
    l_stage = m.layers // p.pp
    params: list[Param] = []
    if stage == 0:
        params.append(("embed.tok", (vocab * m.hidden // t,)))
        if m.learned_pos:
            params.append(("embed.pos", (m.seq_len * m.hidden,)))
    for layer in range(stage * l_stage, (stage + 1) * l_stage):
        params += _layer(m, t, layer, p.ep)
    if stage == p.pp - 1:
        params += [("ln_f.weight", (m.hidden,)), ("ln_f.bias", (m.hidden,))]
        if not m.tied_embeddings or p.pp > 1:
            params.append(("lm_head.weight", (vocab * m.hidden // t,)))
    return params


def framework_layout(inp: PredictInput, stage: int) -> list[Param]:
    return stage_parameters(inp.model, inp.parallel, stage)


def param_count(m: ModelSpec) -> int:
    """Total parameters of the GPT (one copy, unsharded, unpadded vocabulary)."""
    if m.params_override is not None:
        return m.params_override
    unpadded = m.model_copy(update={"vocab_divisible_by": None})
    return sum(c for _, (c,) in stage_parameters(unpadded, ParallelSpec(), 0))


def padding_note(inp: PredictInput, check: ParamCheck | None) -> str | None:
    m, p = inp.model, inp.parallel
    if m.params_override is None and m.padded_vocab(p.tp) != m.vocab:
        return (
            f"vocabulary padded from {m.vocab:,} to {m.padded_vocab(p.tp):,} (a multiple of "
            f"{m.vocab_divisible_by} x tp={p.tp}) in the embedding, LM head and their gradients"
        )
    return None


# ------------------------------------------------------------------------------------ the harness GPT


def harness_check(inp: PredictInput) -> None:
    """ValueError for an input the harness's GPT and training loop cannot describe."""
    m, p, dt = inp.model, inp.parallel, inp.dtypes
    if p.virtual_stages > 1 or p.recompute != "none":
        raise ValueError("the harness has no interleaving or recomputation")
    if p.cp > 1 and (p.pp > 1 or p.sp or p.zero):
        raise ValueError("the harness runs context parallelism without pp, sp or ZeRO")
    if m.tied_embeddings or not m.learned_pos or m.f != 4 * m.hidden or m.h_kv != m.hidden:
        raise ValueError("the harness GPT has learned positions, untied embeddings, FFN 4h and multi-head attention")
    if m.padded_vocab(p.tp) != m.vocab:
        raise ValueError("the harness does not pad the vocabulary (vocab_divisible_by must leave it unchanged)")
    if dt.act != dt.grad or dt.act != dt.param:
        raise ValueError("the harness uses one dtype for parameters, gradients and activations")


def harness_layout(inp: PredictInput, stage: int) -> list[Param]:
    """The stage's parameters on one tp rank, in registration order, with their shapes."""
    m, p = inp.model, inp.parallel
    h, vocab, s, f, t = m.hidden, m.vocab, m.seq_len, m.f, p.tp
    out: list[Param] = []
    if stage == 0:
        out += [("embed.wte", (vocab // t, h)), ("embed.wpe", (s, h))]
    for i in range(m.layers // p.pp):
        out += [
            (f"blocks.{i}.ln1.weight", (h,)),
            (f"blocks.{i}.ln1.bias", (h,)),
            (f"blocks.{i}.attn.qkv.weight", (3 * h // t, h)),
            (f"blocks.{i}.attn.qkv.bias", (3 * h // t,)),
            (f"blocks.{i}.attn.proj.weight", (h, h // t)),
            (f"blocks.{i}.attn.proj.bias", (h,)),
            (f"blocks.{i}.ln2.weight", (h,)),
            (f"blocks.{i}.ln2.bias", (h,)),
        ]
        if not m.experts:
            out += [
                (f"blocks.{i}.mlp.fc1.weight", (f // t, h)),
                (f"blocks.{i}.mlp.fc1.bias", (f // t,)),
                (f"blocks.{i}.mlp.fc2.weight", (h, f // t)),
                (f"blocks.{i}.mlp.fc2.bias", (h,)),
            ]
            continue
        out.append((f"blocks.{i}.mlp.router.weight", (m.experts, h)))
        for j in range(m.experts // p.ep):
            out += [
                (f"blocks.{i}.mlp.experts.{j}.fc1.weight", (f, h)),
                (f"blocks.{i}.mlp.experts.{j}.fc1.bias", (f,)),
                (f"blocks.{i}.mlp.experts.{j}.fc2.weight", (h, f)),
                (f"blocks.{i}.mlp.experts.{j}.fc2.bias", (h,)),
            ]
    if stage == p.pp - 1:
        out += [("head.ln_f.weight", (h,)), ("head.ln_f.bias", (h,)), ("head.lm_head.weight", (vocab // t, h))]
    return out


def is_sp_param(name: str) -> bool:
    """A harness parameter replicated across the TP group under sequence parallelism (its gradient is
    all-reduced there): position embedding, LayerNorms, row-parallel biases."""
    leaf = name.split(".")
    return name == "embed.wpe" or leaf[-2].startswith("ln") or (leaf[-1] == "bias" and leaf[-2] in ("proj", "fc2"))


def gradient_ready_order(params: list[Param]) -> list[Param]:
    """The order autograd finishes the gradients of the harness GPT (measured on the model): modules in
    reverse; within a Linear bias before weight, within a LayerNorm weight before bias; head first
    (lm_head, ln_f.weight, ln_f.bias), embedding last (wpe, wte). A MoE block's router stands where the MLP's
    tensors do; its experts are not listed (DDP leaves them to the ep layout)."""
    by_name = dict(params)
    order: list[str] = []
    if "head.lm_head.weight" in by_name:
        order += ["head.lm_head.weight", "head.ln_f.weight", "head.ln_f.bias"]
    blocks = sorted({int(n.split(".")[1]) for n in by_name if n.startswith("blocks.")}, reverse=True)
    for i in blocks:
        order += [
            f"blocks.{i}.{n}"
            for n in (
                "mlp.fc2.bias",
                "mlp.fc2.weight",
                "mlp.fc1.bias",
                "mlp.fc1.weight",
                "mlp.router.weight",
                "ln2.weight",
                "ln2.bias",
                "attn.proj.bias",
                "attn.proj.weight",
                "attn.qkv.bias",
                "attn.qkv.weight",
                "ln1.weight",
                "ln1.bias",
            )
        ]
    if "embed.wte" in by_name:
        order += ["embed.wpe", "embed.wte"]
    return [(n, by_name[n]) for n in order if n in by_name]


# ------------------------------------------------------------------------------------ recorded counts


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
        return ParamCheck(
            agrees=False,
            notes=[
                "parameter counts disagree with the run's record (" + "; ".join(problems) + "): the model config does "
                "not describe the model that ran, so the prediction cannot be exact"
            ],
        )
    what = [f"model {rec.total:,}"] if rec.total is not None else []
    what += [f"{len(rec.per_rank)} ranks"] if rec.per_rank else []
    return ParamCheck(agrees=True, notes=[f"parameter counts agree with the run's record ({', '.join(what)})"])


def exactness_note(inp: PredictInput, check: ParamCheck | None) -> str | None:
    """The harness prediction claims to be exact unless the run's recorded counts say it ran another model."""
    if check is None or check.agrees:
        return "harness implementation: exact to the byte for profiled steps (set-up traffic excluded)"
    return "harness implementation: not exact for this run, its recorded parameter counts disagree"
