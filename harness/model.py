"""Decoder-only GPT in plain PyTorch, built so that any tp/pp layout computes the same function.

The full model is always built first (float32, CPU, from the seed), then each rank copies its slice:
initialisation is identical regardless of the parallel layout. Parameter registration order (which
the flat ZeRO buffers and DDP buckets follow) is:
  embed.wte, embed.wpe,
  per block: ln1.weight, ln1.bias, attn.qkv.weight, attn.qkv.bias, attn.proj.weight, attn.proj.bias,
             ln2.weight, ln2.bias, mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias,
  head.ln_f.weight, head.ln_f.bias, head.lm_head.weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812 (torch's own spelling)
from torch import nn

from .comm import Group
from .cp import CPInfo, attention
from .moe import MoE, MoEInfo
from .tp import VocabParallelCrossEntropy, enter_parallel, leave_parallel


@dataclass(frozen=True)
class GPTShape:
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    experts: int = 0  # 0: dense MLPs; else every MLP is this many routed experts (harness/moe.py)

    @property
    def ffn(self) -> int:
        return 4 * self.hidden

    def param_count(self) -> int:
        h = self.hidden
        mlp = 8 * h * h + 5 * h
        block = 4 * h * h + 8 * h + (self.experts * (mlp + h) if self.experts else mlp)
        return 2 * self.vocab * h + self.seq_len * h + self.layers * block + 2 * h


@dataclass
class TPInfo:
    """The tp slice a module holds: size 1 and group None for an unsharded model."""

    size: int = 1
    rank: int = 0
    group: Group | None = None
    sp: bool = False


class Embedding(nn.Module):
    """Vocab-parallel token embedding (rows [r*V/t, (r+1)*V/t)) plus learned positions (replicated)."""

    def __init__(self, shape: GPTShape, tp: TPInfo, cp: CPInfo | None = None):
        super().__init__()
        self.tp = tp
        self.cp = cp or CPInfo()
        self.vocab_start = tp.rank * shape.vocab // tp.size
        self.wte = nn.Parameter(torch.empty(shape.vocab // tp.size, shape.hidden))
        self.wpe = nn.Parameter(torch.empty(shape.seq_len, shape.hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            x = F.embedding(ids, self.wte)
        else:
            outside = (ids < self.vocab_start) | (ids >= self.vocab_start + self.wte.shape[0])
            x = F.embedding((ids - self.vocab_start).masked_fill(outside, 0), self.wte)
            x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        x = leave_parallel(x, self.tp.group, self.tp.sp)  # all_reduce, or reduce_scatter along s with SP
        s_local = x.shape[1]
        start = self.tp.rank * s_local if self.tp.sp else self.cp.rank * s_local
        return x + self.wpe[start : start + s_local]


class Attention(nn.Module):
    def __init__(self, shape: GPTShape, tp: TPInfo, cp: CPInfo | None = None):
        super().__init__()
        h = shape.hidden
        self.tp = tp
        self.cp = cp or CPInfo()
        self.heads = shape.heads // tp.size
        self.head_dim = h // shape.heads
        self.qkv = nn.Linear(h, 3 * h // tp.size)  # column parallel: [q_r; k_r; v_r]
        self.proj = nn.Linear(h // tp.size, h)  # row parallel; bias added after the reduction

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter_parallel(x, self.tp.group, self.tp.sp)
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.cp.size > 1:  # the sequence is split over the cp ranks (harness/cp.py)
            y = attention(qkv[0], qkv[1], qkv[2], self.cp)
        else:
            y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        y = y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        y = leave_parallel(F.linear(y, self.proj.weight), self.tp.group, self.tp.sp)
        return y + self.proj.bias


class MLP(nn.Module):
    def __init__(self, shape: GPTShape, tp: TPInfo):
        super().__init__()
        self.tp = tp
        self.fc1 = nn.Linear(shape.hidden, shape.ffn // tp.size)  # column parallel
        self.fc2 = nn.Linear(shape.ffn // tp.size, shape.hidden)  # row parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter_parallel(x, self.tp.group, self.tp.sp)
        y = F.linear(F.gelu(self.fc1(x)), self.fc2.weight)
        return leave_parallel(y, self.tp.group, self.tp.sp) + self.fc2.bias


class Block(nn.Module):
    def __init__(self, shape: GPTShape, tp: TPInfo, cp: CPInfo | None = None, moe: MoEInfo | None = None):
        super().__init__()
        self.ln1 = nn.LayerNorm(shape.hidden)
        self.attn = Attention(shape, tp, cp)
        self.ln2 = nn.LayerNorm(shape.hidden)
        self.mlp: nn.Module = MoE(shape.hidden, shape.ffn, moe) if moe is not None else MLP(shape, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final LayerNorm and the untied, vocab-parallel LM head (no bias); returns local-vocab logits."""

    def __init__(self, shape: GPTShape, tp: TPInfo):
        super().__init__()
        self.tp = tp
        self.ln_f = nn.LayerNorm(shape.hidden)
        self.lm_head = nn.Linear(shape.hidden, shape.vocab // tp.size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(enter_parallel(self.ln_f(x), self.tp.group, self.tp.sp))


class Stage(nn.Module):
    """The part of the GPT one rank runs: blocks [first_layer, first_layer + n), plus the embedding on
    the first pipeline stage and the head on the last."""

    def __init__(
        self,
        shape: GPTShape,
        tp: TPInfo,
        first_layer: int,
        n_layers: int,
        first: bool,
        last: bool,
        cp: CPInfo | None = None,
        moe: MoEInfo | None = None,
    ):
        super().__init__()
        self.shape, self.tp = shape, tp
        self.first_layer = first_layer
        self.embed = Embedding(shape, tp, cp) if first else None
        self.blocks = nn.ModuleList(Block(shape, tp, cp, moe) for _ in range(n_layers))
        self.head = Head(shape, tp) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean token cross-entropy in float32 (vocab-parallel when tp > 1)."""
        vocab_start = self.tp.rank * self.shape.vocab // self.tp.size
        per_token = VocabParallelCrossEntropy.apply(
            logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), self.tp.group, vocab_start
        )
        return per_token.mean()

    def sp_params(self) -> list[nn.Parameter]:
        """Parameters replicated across tp whose gradients are partial under sequence parallelism:
        wpe, LayerNorms, and the biases added after a reduce_scatter (attn.proj, mlp.fc2), in
        registration order."""
        if not self.tp.sp:
            return []
        out = []
        for name, p in self.named_parameters():
            leaf = name.split(".")
            if name == "embed.wpe" or leaf[-2].startswith("ln") or (leaf[-1] == "bias" and leaf[-2] in ("proj", "fc2")):
                out.append(p)
        return out


def full_model(shape: GPTShape, seed: int) -> Stage:
    """The unsharded float32 model, initialised from the seed (GPT-2 style), on CPU."""
    moe = MoEInfo(experts=shape.experts) if shape.experts else None
    model = Stage(shape, TPInfo(), 0, shape.layers, True, True, moe=moe)
    gen = torch.Generator().manual_seed(seed)
    resid_std = 0.02 / math.sqrt(2 * shape.layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("head.ln_f"):
                p.fill_(1.0)
            else:
                std = resid_std if name.endswith(("proj.weight", "fc2.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


def _tp_slice(name: str, full: torch.Tensor, tp: TPInfo, hidden: int) -> torch.Tensor:
    """The part of a full parameter that tp rank `tp.rank` holds."""
    t, r = tp.size, tp.rank
    if t == 1:
        return full
    if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
        per = hidden // t
        qkv = full.view(3, hidden, *full.shape[1:])
        return qkv[:, r * per : (r + 1) * per].reshape(3 * per, *full.shape[1:])
    if name.endswith(("embed.wte", "lm_head.weight", "mlp.fc1.weight", "mlp.fc1.bias")):
        return full.chunk(t, dim=0)[r]
    if name.endswith(("attn.proj.weight", "mlp.fc2.weight")):
        return full.chunk(t, dim=1)[r]
    return full  # LayerNorms, wpe, row-parallel biases: replicated


def build_stage(
    shape: GPTShape,
    seed: int,
    tp: TPInfo,
    pp_rank: int,
    pp_size: int,
    cp: CPInfo | None = None,
    moe: MoEInfo | None = None,
) -> Stage:
    """This rank's stage, holding exactly its slice of the seed's full model (float32, CPU); with context
    parallelism every cp rank holds the same slice and attends over its part of the sequence; with expert
    parallelism ep rank r holds experts [r·N/E, (r+1)·N/E) of every MoE layer."""
    per_stage = shape.layers // pp_size
    first_layer = pp_rank * per_stage
    stage = Stage(shape, tp, first_layer, per_stage, pp_rank == 0, pp_rank == pp_size - 1, cp, moe)
    full = dict(full_model(shape, seed).named_parameters())
    with torch.no_grad():
        for name, p in stage.named_parameters():
            full_name = name
            if name.startswith("blocks."):
                _, idx, rest = name.split(".", 2)
                if moe is not None and rest.startswith("mlp.experts."):
                    _, _, local, leaf = rest.split(".", 3)
                    rest = f"mlp.experts.{moe.rank * moe.local + int(local)}.{leaf}"
                full_name = f"blocks.{int(idx) + first_layer}.{rest}"
            p.copy_(_tp_slice(full_name, full[full_name].detach(), tp, shape.hidden))
    return stage
