"""CPU offload of the ZeRO-3 optimizer (ZeRO-Offload, Deep Optimizer States): host<->device copies per rank
per iteration. They are not collectives, so they are listed apart from the scheme totals."""

from __future__ import annotations

import math

from commlens.contract.predict import HostTransfer, ParamCheck, PredictInput

from .adapters import Stage, numel, width


def host_transfers(stage: Stage) -> list[HostTransfer]:
    """Bytes on the rank's ZeRO-3 partition Ψ_z = ceil(Ψ_r / d) (d: the ZeRO group, dp x cp). Deep Optimizer
    States update floor(Ψ_z / g) parameters on the GPU (the fraction 1/g) and the rest on the CPU."""
    p, dt = stage.inp.parallel, stage.inp.dtypes
    if p.offload == "none":
        return []
    if stage.inp.implementation == "harness":
        return _harness_transfers(stage)
    psi_z = math.ceil(stage.n_params / (p.dp * p.cp))
    g_bytes, state = width(dt.grad), dt.optimizer_state_bytes
    gpu = psi_z // p.prefetch_gap if p.offload == "deep_optimizer_states" else 0
    cpu = psi_z - gpu
    out: list[HostTransfer] = []
    if cpu:
        out.append(HostTransfer(direction="d2h", what="gradients to the CPU optimizer", bytes_per_iter=cpu * g_bytes))
        out.append(HostTransfer(direction="h2d", what="updated 16-bit parameters", bytes_per_iter=cpu * 2))
    if gpu:
        out.append(
            HostTransfer(
                direction="h2d", what="optimizer state prefetched for the GPU update", bytes_per_iter=gpu * state
            )
        )
        out.append(
            HostTransfer(
                direction="d2h", what="optimizer state written back after the GPU update", bytes_per_iter=gpu * state
            )
        )
    return out


def note(inp: PredictInput, check: ParamCheck | None) -> str | None:
    p = inp.parallel
    if p.offload == "none":
        return None
    how = (
        "ZeRO-Offload: all updates on the CPU"
        if p.offload == "zero_offload"
        else f"Deep Optimizer States, gap g = {p.prefetch_gap}: floor(Ψ_z/g) parameters updated on the GPU, "
        "the rest on the CPU; the spec's fraction 1/g assumes many equal optimizer sub-groups "
        "(sub_group_size is not modelled)"
    )
    return (
        f"CPU offload (§6.8, {how}): host<->device copies are listed per stage under host_transfers, not in "
        f"the scheme totals. Ψ_z = ceil(Ψ_r / (dp x cp)); gradients in {inp.dtypes.grad}, updated parameters "
        f"2 bytes, optimizer state {inp.dtypes.optimizer_state_bytes} bytes per parameter; gradients move once "
        "per iteration as in the spec's table (a framework that copies them every micro-step moves m times that)"
    )


def _harness_transfers(stage: Stage) -> list[HostTransfer]:
    """The harness (harness/offload.py): per FSDP2 shard of each parameter (dim 0 in torch.chunk rows over dp, the
    first dp rank's), in registration order, shard i is updated on the GPU when i mod g = g-1 (g > 1): its 12-byte
    state moves both ways; otherwise its gradient goes to the host and the parameter comes back (w bytes each)."""
    p, dt = stage.inp.parallel, stage.inp.dtypes
    g = p.prefetch_gap if p.offload == "deep_optimizer_states" else 1
    w, d = width(dt.param), p.dp
    cpu = gpu = 0
    for i, (_, shape) in enumerate(stage.params):
        rows = math.ceil(shape[0] / d)
        local = min(rows, shape[0]) * (numel(shape) // shape[0])
        if g > 1 and i % g == g - 1:
            gpu += local
        else:
            cpu += local
    out = [
        HostTransfer(direction="d2h", what="gradient shards to the host optimizer", bytes_per_iter=cpu * w),
        HostTransfer(direction="h2d", what="updated parameter shards", bytes_per_iter=cpu * w),
    ]
    if gpu:
        out += [
            HostTransfer(
                direction="h2d", what="optimizer state prefetched for the GPU update", bytes_per_iter=gpu * 12
            ),
            HostTransfer(direction="d2h", what="optimizer state written back", bytes_per_iter=gpu * 12),
        ]
    return out
