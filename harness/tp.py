"""Tensor- and sequence-parallel communication as autograd functions (Megatron's f, g and SP operators).

Activations are [b, s, h]. With sequence parallelism the residual stream is split along s: tp rank r
holds positions [r*s/t, (r+1)*s/t). Every function is the identity when `group` is None (tp = 1).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import Function

from .comm import Group


class CopyToTP(Function):
    """f: identity forward; all_reduce of the input gradient in backward (enters a column-parallel region)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        g = g.contiguous().clone()
        ctx.group.all_reduce(g)
        return g, None


class ReduceFromTP(Function):
    """g: all_reduce of the partial sums forward (leaves a row-parallel region); identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        x = x.contiguous().clone()
        group.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, None


def _gather_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    b, s_local, h = x.shape
    out = torch.empty(group.size * x.numel(), dtype=x.dtype, device=x.device)
    group.all_gather(out, x.contiguous().view(-1))
    return out.view(group.size, b, s_local, h).transpose(0, 1).reshape(b, group.size * s_local, h)


def _reduce_scatter_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    b, s, h = x.shape
    s_local = s // group.size
    inp = x.reshape(b, group.size, s_local, h).transpose(0, 1).contiguous().view(-1)
    out = torch.empty(b * s_local * h, dtype=x.dtype, device=x.device)
    group.reduce_scatter(out, inp)
    return out.view(b, s_local, h)


class GatherSeq(Function):
    """SP, entering a column-parallel region: all_gather along s forward, reduce_scatter backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _reduce_scatter_seq(g, ctx.group), None


class ReduceScatterSeq(Function):
    """SP, leaving a row-parallel region: reduce_scatter along s forward, all_gather backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _gather_seq(g, ctx.group), None


def enter_parallel(x: torch.Tensor, group: Group | None, sp: bool) -> torch.Tensor:
    """Before a column-parallel linear (QKV, fc1, LM head)."""
    if group is None:
        return x
    return GatherSeq.apply(x, group) if sp else CopyToTP.apply(x, group)


def leave_parallel(x: torch.Tensor, group: Group | None, sp: bool) -> torch.Tensor:
    """After a row-parallel linear (attention projection, fc2) or the vocab-parallel embedding."""
    if group is None:
        return x
    return ReduceScatterSeq.apply(x, group) if sp else ReduceFromTP.apply(x, group)


class VocabParallelCrossEntropy(Function):
    """Per-token cross-entropy over logits split along the vocabulary (float32).

    Forward issues three all_reduces of N = b*s float32 values in tp, in this order: the max logit (MAX),
    the target's logit (SUM), the sum of exponentials (SUM). Backward is local."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: Group | None, vocab_start: int):
        n_local = logits.shape[-1]
        lmax = logits.max(dim=-1).values
        if group is not None:
            group.all_reduce(lmax, op=dist.ReduceOp.MAX)
        shifted = logits - lmax.unsqueeze(-1)
        outside = (target < vocab_start) | (target >= vocab_start + n_local)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        if group is not None:
            group.all_reduce(picked)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if group is not None:
            group.all_reduce(sum_exp)
        loss = sum_exp.log() - picked
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_target.unsqueeze(-1), (outside.to(grad.dtype) - 1.0).unsqueeze(-1))
        return grad * g.unsqueeze(-1), None, None, None
