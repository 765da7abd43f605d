"""Gradient synchronisation over the dp group, one class per strategy.

Each strategy owns the optimizer of its rank and exposes the three hooks the schedules call:
`micro(index, last)` (context around one micro-batch's forward+backward when pp = 1),
`after_backward()` (after each micro-batch's backward on this stage) and `finish()` (end of step:
reductions, optimizer step, parameter all-gather, zeroing). README.md gives the exact calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from .comm import Group, Mesh, all_gather_flat, reduce_scatter_flat
from .model import Stage


@dataclass(frozen=True)
class AdamWSettings:
    """The optimizer's settings but the learning rate (run.json records them)."""

    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0


ADAMW = AdamWSettings()


def _adamw(params: list[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        params, lr=lr, betas=ADAMW.betas, eps=ADAMW.eps, weight_decay=ADAMW.weight_decay, foreach=False
    )


def _grads(params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
    """The gradients of the parameters that have one (a parameter outside this step's graph has none)."""
    return [p.grad for p in params if p.grad is not None]


def sp_allreduce(tp: Group | None, grads: list[torch.Tensor]) -> None:
    """One tp all_reduce of the concatenated (partial) gradients of sequence-parallel replicated params."""
    if tp is None or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    tp.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


class Sync:
    """No dp group (dp = 1): local optimizer; only the SP gradient all_reduce, once per step."""

    name = "none"

    def __init__(self, stage: Stage, mesh: Mesh, lr: float):
        self.stage = stage
        self.module: nn.Module = stage
        self.tp = mesh.group("tp")
        self.sp = stage.sp_params()
        self.lr = lr
        self.optimizer = self._make_optimizer()

    def _make_optimizer(self) -> torch.optim.Optimizer:
        return _adamw(list(self.stage.parameters()), self.lr)

    @contextlib.contextmanager
    def micro(self, index: int, last: bool) -> Iterator[None]:
        yield

    def after_backward(self) -> None:
        pass

    def finish(self) -> None:
        sp_allreduce(self.tp, _grads(self.sp))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def describe(self) -> dict[str, Any]:
        return {}


class DDPSync(Sync):
    """torch DistributedDataParallel (pp = 1), default buckets; accumulation micro-steps under no_sync().

    A Python comm hook equal to torch's default allreduce hook (divide by the group size, then
    all_reduce the bucket) wraps each bucket's all_reduce in the group's label and records its size."""

    name = "ddp"

    def __init__(self, stage: Stage, mesh: Mesh, lr: float, device_ids: list[int] | None):
        super().__init__(stage, mesh, lr)
        from torch.nn.parallel import DistributedDataParallel

        self.dp_group = mesh.require("dp")
        self.ddp = DistributedDataParallel(stage, process_group=self.dp_group.pg, device_ids=device_ids)
        self.module = self.ddp
        self.ddp.register_comm_hook(self, _labelled_allreduce_hook)
        self.calls: list[int] = []  # bytes of each bucket all_reduce of the current step, in call order
        self.last_calls: list[int] = []

    @contextlib.contextmanager
    def micro(self, index: int, last: bool) -> Iterator[None]:
        with contextlib.nullcontext() if last else self.ddp.no_sync():
            yield

    def finish(self) -> None:
        super().finish()
        self.last_calls, self.calls = self.calls, []

    def describe(self) -> dict[str, Any]:
        return {
            "ddp_bucket_bytes": self.last_calls,
            "ddp_bucket_cap_mb": 25.0,
            "ddp_first_bucket_bytes": int(getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 1 << 20)),
        }


# `bucket` and the return stay unannotated: DDP compares the hook's annotations with dist.GradBucket and
# Future[Tensor] objects, and this module's annotations are strings (from __future__ import annotations).
def _labelled_allreduce_hook(state: DDPSync, bucket):
    buf = bucket.buffer()
    state.calls.append(buf.numel() * buf.element_size())
    buf.div_(state.dp_group.size)
    with record_function(state.dp_group.tag):
        work = dist.all_reduce(buf, group=state.dp_group.pg, async_op=True)
        assert work is not None  # async_op=True always returns the work
        fut = work.get_future()
    return fut.then(lambda f: f.value()[0])


class FlatBuffer:
    """The stage's parameters and gradients as views into two flat buffers (registration order),
    zero-padded at the end to a multiple of `multiple` elements."""

    def __init__(self, params: list[nn.Parameter], multiple: int):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.padded = -(-self.numel // multiple) * multiple
        p0 = params[0]
        self.param = torch.zeros(self.padded, dtype=p0.dtype, device=p0.device)
        self.grad = torch.zeros_like(self.param)
        offset = 0
        for p in params:
            n = p.numel()
            self.param[offset : offset + n].copy_(p.detach().reshape(-1))
            p.data = self.param[offset : offset + n].view_as(p)
            p.grad = self.grad[offset : offset + n].view_as(p)  # backward accumulates in place
            offset += n


class AllReduceSync(Sync):
    """dp without ZeRO when pp > 1 (DDP cannot sync after a pipeline flush): once per step, one
    all_reduce of the whole flat gradient buffer (unpadded), then divide by dp."""

    name = "allreduce"

    def __init__(self, stage: Stage, mesh: Mesh, lr: float):
        self.flat = FlatBuffer(list(stage.parameters()), 1)
        self.dp_group = mesh.require("dp")
        super().__init__(stage, mesh, lr)

    def finish(self) -> None:
        sp_allreduce(self.tp, _grads(self.sp))
        self.dp_group.all_reduce(self.flat.grad[: self.flat.numel])
        self.flat.grad.div_(self.dp_group.size)
        self.optimizer.step()
        self.flat.grad.zero_()

    def describe(self) -> dict[str, Any]:
        return {"flat_numel": self.flat.numel}


class ZeroSync(Sync):
    """ZeRO-1 (stage 1) and ZeRO-2 (stage 2) over one flat buffer, padded to a multiple of dp.

    Stage 1: per step, reduce_scatter of the whole flat gradient buffer, AdamW on the rank's shard,
    all_gather of the flat parameter buffer. Stage 2: the reduce_scatter runs after every
    micro-batch's backward instead (accumulating into the shard's gradient)."""

    def __init__(self, stage: Stage, mesh: Mesh, lr: float, zero: int):
        self.zero = zero
        self.name = f"zero{zero}"
        self.dp_group = mesh.require("dp")
        self.flat = FlatBuffer(list(stage.parameters()), self.dp_group.size)
        n = self.flat.padded // self.dp_group.size
        lo = self.dp_group.rank * n
        self.shard = nn.Parameter(self.flat.param[lo : lo + n])  # shares storage with the flat buffer
        self.shard_grad = torch.zeros_like(self.shard)  # the optimizer reads it as shard.grad
        self.shard.grad = self.shard_grad
        super().__init__(stage, mesh, lr)

    def _make_optimizer(self) -> torch.optim.Optimizer:
        return _adamw([self.shard], self.lr)

    def _reduce_scatter(self) -> None:
        sp_allreduce(self.tp, _grads(self.sp))
        out = torch.empty_like(self.shard_grad)
        self.dp_group.reduce_scatter(out, self.flat.grad)
        self.shard_grad.add_(out)
        self.flat.grad.zero_()

    def after_backward(self) -> None:
        if self.zero == 2:
            self._reduce_scatter()

    def finish(self) -> None:
        if self.zero == 1:
            self._reduce_scatter()
        self.shard_grad.div_(self.dp_group.size)
        self.optimizer.step()
        self.shard_grad.zero_()
        self.dp_group.all_gather(self.flat.param, self.shard.detach().clone())

    def describe(self) -> dict[str, Any]:
        return {"flat_numel": self.flat.numel, "flat_padded": self.flat.padded}


class Zero3Sync(Sync):
    """ZeRO-3 with FSDP2: `fully_shard` on every block, then on the stage (root: embedding, final
    LayerNorm and LM head). Its all_gather / reduce_scatter run through labelled custom comms."""

    name = "zero3"

    def __init__(self, stage: Stage, mesh: Mesh, lr: float):
        from torch.distributed.fsdp import fully_shard

        dp = mesh.require("dp")
        dp_mesh = mesh.submesh("dp")
        units = [fully_shard(unit, mesh=dp_mesh) for unit in [*stage.blocks, stage]]
        ag, rs = _LabelledAllGather(dp), _LabelledReduceScatter(dp)
        for unit in units:
            unit.set_custom_all_gather(ag)
            unit.set_custom_reduce_scatter(rs)
        self.units = units
        super().__init__(stage, mesh, lr)

    def finish(self) -> None:
        # FSDP2's gradients are DTensors: the SP sum is over the local shards
        sp_allreduce(self.tp, [g.to_local() if isinstance(g, DTensor) else g for g in _grads(self.sp)])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def describe(self) -> dict[str, Any]:
        return {}


class _LabelledAllGather:
    def __init__(self, group: Group):
        self.group = group

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        with record_function(self.group.tag):
            return all_gather_flat(output_tensor, input_tensor, group=group, async_op=async_op)


class _LabelledReduceScatter:
    def __init__(self, group: Group):
        self.group = group

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        with record_function(self.group.tag):
            return reduce_scatter_flat(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def make_sync(stage: Stage, mesh: Mesh, lr: float, strategy: str, device_ids: list[int] | None) -> Sync:
    if strategy == "none":
        return Sync(stage, mesh, lr)
    if strategy == "ddp":
        return DDPSync(stage, mesh, lr, device_ids)
    if strategy == "allreduce":
        return AllReduceSync(stage, mesh, lr)
    if strategy in ("zero1", "zero2"):
        return ZeroSync(stage, mesh, lr, int(strategy[-1]))
    if strategy == "zero3":
        return Zero3Sync(stage, mesh, lr)
    raise ValueError(f"unknown dp strategy {strategy!r}")
