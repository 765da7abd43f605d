"""One optimizer step: micro-batches through the pipeline (GPipe or 1F1B) with explicit send/recv.

With pp = 1 both schedules reduce to forward+backward per micro-batch. Point-to-point messages go
through the pp group as batches (`Group.p2p`), in Megatron's pairing: 1F1B's steady state sends the
output forward and receives the output gradient in one batch, and sends the input gradient back and
receives the next input in another.

An injected delay (`--delay`) sleeps once per step, before the step's first forward, its first
backward or its end-of-step synchronisation and optimizer update (`Sync.finish`), inside a
``commlens.delay`` profiler range.
"""

from __future__ import annotations

import time

import torch
from torch.profiler import record_function

from .comm import Group
from .dpsync import Sync
from .model import Stage

DELAY_RANGE = "commlens.delay"  # not "commlens:": that prefix labels collectives


class StepRunner:
    def __init__(
        self,
        stage: Stage,
        sync: Sync,
        pp: Group | None,
        micro_batches: int,
        schedule: str,
        act_shape: tuple[int, int, int],
        dtype: torch.dtype,
        device: torch.device,
        delays: dict[str, float] | None = None,
    ):
        """`delays`: milliseconds this rank sleeps per step before each phase (forward, backward, optimizer)."""
        self.stage, self.sync, self.pp = stage, sync, pp
        self.delays = delays or {}
        self.pending: set[str] = set()  # phases whose delay is still to come this step
        self.m = micro_batches
        self.schedule = schedule if pp is not None else "gpipe"
        self.act_shape, self.dtype, self.device = act_shape, dtype, device
        self.first = pp is None or pp.rank == 0
        self.last = pp is None or pp.rank == pp.size - 1
        self.batches: list[torch.Tensor] = []
        self.inputs: dict[int, torch.Tensor] = {}  # micro-batch -> the stage's input (pp > 1)
        self.outputs: dict[int, torch.Tensor] = {}  # micro-batch -> the stage's output (pp > 1)
        self.loss_sum = 0.0

    # ------------------------------------------------------------------ point to point
    def _buf(self) -> torch.Tensor:
        return torch.empty(self.act_shape, dtype=self.dtype, device=self.device)

    def _exchange(
        self,
        send_next: torch.Tensor | None = None,
        send_prev: torch.Tensor | None = None,
        recv_next: bool = False,
        recv_prev: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One batch: sends (to prev, then to next) and receives (from prev, then from next)."""
        if self.pp is None:
            return None, None
        sends: list[tuple[torch.Tensor, int]] = []
        recvs: list[tuple[torch.Tensor, int]] = []
        from_prev = self._buf() if recv_prev and not self.first else None
        from_next = self._buf() if recv_next and not self.last else None
        if send_prev is not None and not self.first:
            sends.append((send_prev.contiguous(), self.pp.rank - 1))
        if send_next is not None and not self.last:
            sends.append((send_next.contiguous(), self.pp.rank + 1))
        if from_prev is not None:
            recvs.append((from_prev, self.pp.rank - 1))
        if from_next is not None:
            recvs.append((from_next, self.pp.rank + 1))
        self.pp.p2p(sends, recvs)
        return from_prev, from_next

    # ------------------------------------------------------------------ injected delay
    def _delay(self, phase: str) -> None:
        """Sleep the phase's delay at its first occurrence in the step.

        On CUDA the queued kernels are drained first: otherwise a host running ahead of the device hides
        the sleep, and the device would not idle for the whole delay."""
        if phase not in self.pending:
            return
        self.pending.discard(phase)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        with record_function(DELAY_RANGE):
            time.sleep(self.delays[phase] / 1000)

    # ------------------------------------------------------------------ compute
    def _forward(self, j: int, x: torch.Tensor | None) -> torch.Tensor:
        """pp > 1: forward of micro-batch j; returns the stage output (the scaled loss on the last stage)."""
        self._delay("forward")
        tokens = self.batches[j]
        if self.first:
            x = tokens[:, :-1]
        else:
            assert x is not None, "a later pipeline stage always receives its input"
            x.requires_grad_()
        self.inputs[j] = x
        out = self.sync.module(x)
        if self.last:
            out = self.stage.loss(out, tokens[:, 1:]) / self.m
            self.loss_sum += float(out.detach())
        self.outputs[j] = out
        return out

    def _backward(self, j: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        out = self.outputs.pop(j)
        x = self.inputs.pop(j)
        self._delay("backward")
        if self.last:
            out.backward()
        else:
            torch.autograd.backward(out, grad_tensors=grad)
        self.sync.after_backward()
        return None if self.first else x.grad

    def _micro(self, j: int) -> None:
        """pp = 1: forward and backward of one micro-batch inside the sync's micro context (DDP no_sync)."""
        with self.sync.micro(j, j == self.m - 1):
            tokens = self.batches[j]
            self._delay("forward")
            out = self.sync.module(tokens[:, :-1])
            loss = self.stage.loss(out, tokens[:, 1:]) / self.m
            self.loss_sum += float(loss.detach())
            self._delay("backward")
            loss.backward()
        self.sync.after_backward()

    # ------------------------------------------------------------------ schedules
    def step(self, batches: list[torch.Tensor]) -> float | None:
        """Run all micro-batches and the optimizer step; the stage's loss (last stage) or None."""
        self.batches, self.inputs, self.outputs, self.loss_sum = batches, {}, {}, 0.0
        self.pending = set(self.delays)
        if self.pp is None:
            for j in range(self.m):
                self._micro(j)
        elif self.schedule == "gpipe":
            self._gpipe()
        else:
            self._one_f_one_b(self.pp)
        self._delay("optimizer")
        self.sync.finish()
        return self.loss_sum if self.last else None

    def _gpipe(self) -> None:
        for j in range(self.m):
            x, _ = self._exchange(recv_prev=True)
            self._exchange(send_next=self._forward(j, x))
        for j in range(self.m):
            _, g = self._exchange(recv_next=True)
            self._exchange(send_prev=self._backward(j, g))

    def _one_f_one_b(self, pp: Group) -> None:
        warmup = min(pp.size - pp.rank - 1, self.m)
        steady = self.m - warmup
        for j in range(warmup):
            x, _ = self._exchange(recv_prev=True)
            self._exchange(send_next=self._forward(j, x))
        x = self._exchange(recv_prev=True)[0] if steady else None
        for k in range(steady):
            y = self._forward(warmup + k, x)
            _, g = self._exchange(send_next=y, recv_next=True)
            gx = self._backward(k, g)
            if k == steady - 1:
                self._exchange(send_prev=gx)
            else:
                x, _ = self._exchange(send_prev=gx, recv_prev=True)
        for k in range(steady, self.m):
            _, g = self._exchange(recv_next=True)
            self._exchange(send_prev=self._backward(k, g))
