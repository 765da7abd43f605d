"""Expert parallelism: a mixture-of-experts MLP whose tokens travel to their experts with all-to-all-v.

Every block's MLP becomes N experts (each the dense MLP's fc1/gelu/fc2) behind a top-k router (a linear
map h -> N, no bias; softmax, top-k, the chosen probabilities weight the experts' outputs). The ep group's
E ranks hold N/E experts each (rank r: experts [r·N/E, (r+1)·N/E)) and see different samples, as data
parallel replicas do. Per MoE layer and micro-batch (harness/README.md lists the sizes):

1. the rank counts, per expert, the (token, choice) pairs it routes there (with a capacity factor F, at
   most C = ceil(F·T·k/N) per expert in token order, the rest dropped) and all-to-alls those counts
   (int64, N/E per destination);
2. dispatch: the pairs' token vectors, sorted by expert, all-to-all-v (uneven splits) to the expert's rank;
3. the experts run on what they received; combine: the outputs all-to-all-v back (splits swapped);
4. backward: the transposes of 3 and 2 (the same two splits, swapped).

The send counts of every call of the profiled steps are recorded (`Router.log`), so the run's prediction
is exact for each step; without them it is the expectation under uniform routing (docs/models.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 (torch's own spelling)
from torch import nn
from torch.profiler import record_function

from .comm import Group, Mesh
from .config import HarnessConfig
from .cp import subgroups


@dataclass
class MoEInfo:
    """The experts' layout as this rank sees it; experts 0 means a dense MLP."""

    experts: int = 0
    top_k: int = 1
    capacity_factor: float | None = None
    size: int = 1  # ep degree E
    rank: int = 0
    group: Group | None = None
    log: list[list[int]] | None = field(default=None)  # per call, rows sent to each ep rank (when recording)

    @property
    def local(self) -> int:
        return self.experts // self.size


def _all_to_all(
    group: Group, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
) -> None:
    import torch.distributed as dist

    with record_function(group.tag):
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=group.pg)


class AllToAllV(torch.autograd.Function):
    """Rows of `inp` (split `in_splits` by destination) to their ep ranks; backward sends the gradients back."""

    @staticmethod
    def forward(ctx: Any, inp: torch.Tensor, group: Group, in_splits: list[int], out_splits: list[int]) -> torch.Tensor:
        out = inp.new_empty((sum(out_splits), *inp.shape[1:]))
        _all_to_all(group, out, inp.contiguous(), out_splits, in_splits)
        ctx.group, ctx.splits = group, (in_splits, out_splits)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        in_splits, out_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        _all_to_all(ctx.group, back, grad.contiguous(), in_splits, out_splits)
        return back, None, None, None


def _exchange(x: torch.Tensor, info: MoEInfo, in_splits: list[int], out_splits: list[int]) -> torch.Tensor:
    if info.group is None:
        return x
    out: torch.Tensor = AllToAllV.apply(x, info.group, in_splits, out_splits)  # type: ignore[no-untyped-call]
    return out


class Expert(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(F.gelu(self.fc1(x)))
        return out


class MoE(nn.Module):
    """Top-k routed experts; this rank holds experts [rank·N/E, (rank+1)·N/E)."""

    def __init__(self, hidden: int, ffn: int, info: MoEInfo):
        super().__init__()
        self.info = info
        self.router = nn.Linear(hidden, info.experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden, ffn) for _ in range(info.local))

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token index, expert, weight) of every kept (token, choice) pair, sorted by expert (stable)."""
        info = self.info
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weight, expert = probs.topk(info.top_k, dim=-1)
        tokens = torch.arange(x.shape[0], device=x.device).repeat_interleave(info.top_k)
        expert, weight = expert.reshape(-1), weight.reshape(-1)
        order = torch.sort(expert, stable=True).indices
        tokens, expert, weight = tokens[order], expert[order], weight[order]
        if info.capacity_factor is not None:
            capacity = math.ceil(info.capacity_factor * x.shape[0] * info.top_k / info.experts)
            starts = torch.searchsorted(expert, expert, right=False)  # first pair of each pair's expert
            keep = torch.arange(len(expert), device=x.device) - starts < capacity
            tokens, expert, weight = tokens[keep], expert[keep], weight[keep]
        return tokens, expert, weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        info = self.info
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        tokens, expert, weight = self._route(flat)
        per_expert = torch.bincount(expert, minlength=info.experts)
        received = self._counts(per_expert)  # [E, N/E]: rows from each ep rank for each local expert
        send = per_expert.view(info.size, info.local).sum(1).tolist()
        recv = received.sum(1).tolist()
        if info.log is not None:
            info.log.append(send)
        rows = _exchange(flat[tokens], info, send, recv)
        local_expert = torch.repeat_interleave(
            torch.arange(info.local, device=x.device).repeat(info.size), received.reshape(-1)
        )
        out = torch.zeros_like(rows)
        for j, module in enumerate(self.experts):
            mask = local_expert == j
            if bool(mask.any()):
                out = out.index_put((mask.nonzero().squeeze(1),), module(rows[mask]))
        back = _exchange(out, info, recv, send)
        y = torch.zeros_like(flat).index_add(0, tokens, back * weight.unsqueeze(1).to(back.dtype))
        return y.view(b, s, h)

    def _counts(self, per_expert: torch.Tensor) -> torch.Tensor:
        """All-to-all of the per-expert counts (int64): what each ep rank sends to this rank's experts."""
        info = self.info
        if info.group is None:
            return per_expert.view(1, info.local)
        out = torch.empty_like(per_expert)
        _all_to_all(info.group, out, per_expert.contiguous(), [info.local] * info.size, [info.local] * info.size)
        return out.view(info.size, info.local)


def setup(cfg: HarnessConfig, mesh: Mesh) -> MoEInfo | None:
    """This rank's MoEInfo (None for dense MLPs) and, with ep > 1, the `dp_ep` group over which the dense
    parameters' gradients are averaged (the ep ranks are data-parallel replicas for them)."""
    if not cfg.experts:
        return None
    info = MoEInfo(cfg.experts, cfg.top_k, cfg.capacity_factor, cfg.ep, cfg.coords(mesh.rank).get("ep", 0))
    if cfg.ep > 1:
        info.group = mesh.group("ep")
        dp_ep = subgroups("dp_ep", [list(range(cfg.world_size))])
        if dp_ep is not None:
            mesh.groups["dp_ep"] = dp_ep
    return info


def prepare_for_ddp(stage: nn.Module, info: MoEInfo | None) -> None:
    """Keep the experts out of DDP (each ep rank holds other experts) and average their gradients over the
    ep ranks' losses as DDP does the dense ones: every expert's gradient sums what E ranks' tokens gave it."""
    if info is None or info.size == 1:
        return
    from torch.nn.parallel import DistributedDataParallel

    names = [n for n, _ in stage.named_parameters() if ".mlp.experts." in n]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(stage, names)  # type: ignore[no-untyped-call]
    scale = 1.0 / info.size
    for n, p in stage.named_parameters():
        if n in names:
            p.register_hook(lambda g: g * scale)  # type: ignore[no-untyped-call]
