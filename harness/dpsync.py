"""Gradient synchronisation over the dp group, one class per strategy.

Each strategy owns the optimizer of its rank and exposes the three hooks the schedules call:
`micro(index, last)` (context around one micro-batch's forward+backward when pp = 1),
`after_backward()` (after each micro-batch's backward on this stage) and `finish()` (end of step:
reductions, optimizer step, parameter all-gather, zeroing). README.md gives the exact calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from .comm import Group, Mesh, all_gather_flat, reduce_scatter_flat
from .model import Stage

ADAMW = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}


def _adamw(params: list[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, foreach=False, **ADAMW)


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
        self.dp = mesh.group("dp")
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
        sp_allreduce(self.tp, [p.grad for p in self.sp])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def describe(self) -> dict:
        return {}


class DDPSync(Sync):
    """torch DistributedDataParallel (pp = 1), default buckets; accumulation micro-steps under no_sync().

    A Python comm hook equal to torch's default allreduce hook (divide by the group size, then
    all_reduce the bucket) wraps each bucket's all_reduce in the group's label and records its size."""

    name = "ddp"

    def __init__(self, stage: Stage, mesh: Mesh, lr: float, device_ids: list[int] | None):
        super().__init__(stage, mesh, lr)
        from torch.nn.parallel import DistributedDataParallel

        self.module = DistributedDataParallel(stage, process_group=self.dp.pg, device_ids=device_ids)
        self.module.register_comm_hook(self, _labelled_allreduce_hook)
        self.calls: list[int] = []  # bytes of each bucket all_reduce of the current step, in call order
        self.last_calls: list[int] = []

    @contextlib.contextmanager
    def micro(self, index: int, last: bool) -> Iterator[None]:
        with contextlib.nullcontext() if last else self.module.no_sync():
            yield

    def finish(self) -> None:
        super().finish()
        self.last_calls, self.calls = self.calls, []

    def describe(self) -> dict:
        return {
            "ddp_bucket_bytes": self.last_calls,
            "ddp_bucket_cap_mb": 25.0,
            "ddp_first_bucket_bytes": int(getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 1 << 20)),
        }


def _labelled_allreduce_hook(state, bucket):
    buf = bucket.buffer()
    state.calls.append(buf.numel() * buf.element_size())
    buf.div_(state.dp.size)
    with record_function(state.dp.tag):
        fut = dist.all_reduce(buf, group=state.dp.pg, async_op=True).get_future()
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
        super().__init__(stage, mesh, lr)

    def finish(self) -> None:
        sp_allreduce(self.tp, [p.grad for p in self.sp])
        self.dp.all_reduce(self.flat.grad[: self.flat.numel])
        self.flat.grad.div_(self.dp.size)
        self.optimizer.step()
        self.flat.grad.zero_()

    def describe(self) -> dict:
        return {"flat_numel": self.flat.numel}


class ZeroSync(Sync):
    """ZeRO-1 (stage 1) and ZeRO-2 (stage 2) over one flat buffer, padded to a multiple of dp.

    Stage 1: per step, reduce_scatter of the whole flat gradient buffer, AdamW on the rank's shard,
    all_gather of the flat parameter buffer. Stage 2: the reduce_scatter runs after every
    micro-batch's backward instead (accumulating into the shard's gradient)."""

    def __init__(self, stage: Stage, mesh: Mesh, lr: float, zero: int):
        self.zero = zero
        self.name = f"zero{zero}"
        self.dp = mesh.group("dp")
        self.flat = FlatBuffer(list(stage.parameters()), self.dp.size)
        n = self.flat.padded // self.dp.size
        lo = self.dp.rank * n
        self.shard = nn.Parameter(self.flat.param[lo : lo + n])  # shares storage with the flat buffer
        self.shard.grad = torch.zeros_like(self.shard)
        super().__init__(stage, mesh, lr)

    def _make_optimizer(self) -> torch.optim.Optimizer:
        return _adamw([self.shard], self.lr)

    def _reduce_scatter(self) -> None:
        sp_allreduce(self.tp, [p.grad for p in self.sp])
        out = torch.empty_like(self.shard.grad)
        self.dp.reduce_scatter(out, self.flat.grad)
        self.shard.grad.add_(out)
        self.flat.grad.zero_()

    def after_backward(self) -> None:
        if self.zero == 2:
            self._reduce_scatter()

    def finish(self) -> None:
        if self.zero == 1:
            self._reduce_scatter()
        self.shard.grad.div_(self.dp.size)
        self.optimizer.step()
        self.shard.grad.zero_()
        self.dp.all_gather(self.flat.param, self.shard.detach().clone())

    def describe(self) -> dict:
        return {"flat_numel": self.flat.numel, "flat_padded": self.flat.padded}


class Zero3Sync(Sync):
    """ZeRO-3 with FSDP2: `fully_shard` on every block, then on the stage (root: embedding, final
    LayerNorm and LM head). Its all_gather / reduce_scatter run through labelled custom comms."""

    name = "zero3"

    def __init__(self, stage: Stage, mesh: Mesh, lr: float):
        from torch.distributed.fsdp import fully_shard

        self.dp = mesh.group("dp")
        dp_mesh = mesh.submesh("dp")
        units = [*stage.blocks, stage]
        for unit in units:
            fully_shard(unit, mesh=dp_mesh)
        ag, rs = _LabelledAllGather(self.dp), _LabelledReduceScatter(self.dp)
        for unit in units:
            unit.set_custom_all_gather(ag)
            unit.set_custom_reduce_scatter(rs)
        self.units = units
        super().__init__(stage, mesh, lr)

    def finish(self) -> None:
        sp_allreduce(self.tp, [p.grad.to_local() for p in self.sp])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def describe(self) -> dict:
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
