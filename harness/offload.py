"""ZeRO-3 with the optimizer offloaded to the host (`--offload optimizer [--offload-gpu-fraction 1/g]`, CUDA).

FSDP2 shards the parameters over dp as for `--zero 3`; the AdamW state (fp32 master weights, m, v: 12 bytes
per parameter) of the rank's shards lives in pinned host memory. At the end of every step, per parameter
shard in registration order (harness/README.md):

- updated on the host (every shard without `--offload-gpu-fraction`): its gradient is copied to the host
  (device -> host, numel x w bytes), AdamW runs on the CPU in fp32, the updated parameter is copied back
  (host -> device, numel x w);
- with `--offload-gpu-fraction 1/g`, every g-th shard (index i with i mod g = g-1) is updated on the GPU
  instead, as Deep Optimizer States do: its optimizer state is prefetched (host -> device, numel x 12) and
  written back after the update (device -> host, numel x 12); its parameter and gradient stay on the GPU.

The copies run inside a `commlens.offload` profiler range; the profiler's memcpy activity records their
bytes, which the time analysis stores per rank (timeline_intervals, kinds memcpy_h2d / memcpy_d2h).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from .comm import Mesh
from .dpsync import ADAMW, Zero3Sync, _grads, sp_allreduce
from .model import Stage

OFFLOAD_RANGE = "commlens.offload"
STATE_BYTES = 12  # fp32 master weight, Adam m and v


@dataclass
class _HostState:
    """One parameter shard's optimizer state in pinned host memory."""

    state: torch.Tensor  # [3, numel] float32: master, m, v
    grad: torch.Tensor  # [numel] in the parameter dtype (host-updated shards)
    param: torch.Tensor  # [numel] in the parameter dtype (host-updated shards)
    on_gpu: bool


def _adamw_(state: torch.Tensor, grad: torch.Tensor, step: int, lr: float) -> None:
    """torch's AdamW update (no weight decay) on a [3, n] fp32 state, in place."""
    b1, b2 = ADAMW.betas
    master, m, v = state[0], state[1], state[2]
    m.mul_(b1).add_(grad, alpha=1 - b1)
    v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    denom = (v.sqrt() / (1 - b2**step) ** 0.5).add_(ADAMW.eps)
    master.addcdiv_(m, denom, value=-lr / (1 - b1**step))


class OffloadSync(Zero3Sync):
    """ZeRO-3 whose AdamW runs on the host, or on the GPU for every g-th shard (state moved each step)."""

    name = "zero3-offload"

    def __init__(self, stage: Stage, mesh: Mesh, lr: float, gap: int):
        self.gap = gap
        self.step_count = 0
        super().__init__(stage, mesh, lr)

    def _make_optimizer(self) -> torch.optim.Optimizer:
        """No device optimizer: the state is allocated on the host; an empty optimizer keeps the interface."""
        self.params = list(self.stage.parameters())
        self.host: list[_HostState] = []
        for i, p in enumerate(self.params):
            local = p.to_local() if isinstance(p, DTensor) else p
            state = torch.zeros((3, local.numel()), dtype=torch.float32, pin_memory=True)
            state[0].copy_(local.detach().reshape(-1).float())
            on_gpu = self.gap > 1 and i % self.gap == self.gap - 1
            empty = torch.empty(0 if on_gpu else local.numel(), dtype=local.dtype, pin_memory=True)
            self.host.append(_HostState(state, empty, torch.empty_like(empty, pin_memory=True), on_gpu))
        return torch.optim.SGD([torch.zeros(1)], lr=0.0)

    def finish(self) -> None:
        sp_allreduce(self.tp, [g.to_local() if isinstance(g, DTensor) else g for g in _grads(self.sp)])
        self.step_count += 1
        with record_function(OFFLOAD_RANGE), torch.no_grad():
            for p, host in zip(self.params, self.host, strict=True):
                if p.grad is None:
                    continue
                local = p.to_local() if isinstance(p, DTensor) else p
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                if host.on_gpu:
                    state = host.state.to(local.device, non_blocking=True)  # prefetch, host -> device
                    _adamw_(state, grad.reshape(-1).float(), self.step_count, self.lr)
                    local.copy_(state[0].view_as(local))
                    host.state.copy_(state, non_blocking=True)  # write back, device -> host
                else:
                    host.grad.copy_(grad.reshape(-1))  # device -> host (synchronous: the CPU reads it next)
                    _adamw_(host.state, host.grad.float(), self.step_count, self.lr)
                    host.param.copy_(host.state[0])
                    local.copy_(host.param.view_as(local), non_blocking=True)  # host -> device
            torch.cuda.synchronize()
        for p in self.params:
            p.grad = None

    def describe(self) -> dict[str, Any]:
        return {
            "offload_gap": self.gap,
            "offload_shards": [[h.state.shape[1], h.on_gpu] for h in self.host],
        }
