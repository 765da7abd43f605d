"""The single-process reference: the same model, data and optimizer as a parallel run, in this process.

A run with dp replicas of m micro-batches of b samples sees dp*m*b samples per step; the reference
feeds the same samples as dp*m micro-batches, so its losses must equal the run's within float
tolerance (exactly the same function, different summation order).
"""

from __future__ import annotations

import dataclasses

import torch

from .comm import Mesh
from .config import HarnessConfig
from .data import global_batch
from .dpsync import Sync
from .model import GPTShape, TPInfo, build_stage
from .schedule import StepRunner


def reference_losses(cfg: HarnessConfig, steps: int | None = None) -> list[float]:
    """Per-step losses of the equivalent single-process run (float32, CPU, no process group)."""
    single = dataclasses.replace(
        cfg, dp=1, tp=1, pp=1, zero=0, sp=False, micro_batches=cfg.dp * cfg.micro_batches, device="cpu", dtype="float32"
    )
    shape = GPTShape(cfg.layers, cfg.hidden, cfg.heads, cfg.vocab, cfg.seq_len)
    stage = build_stage(shape, cfg.seed, TPInfo(), 0, 1)
    sync = Sync(stage, Mesh(single, 0, None, {}, "none"), cfg.lr)
    runner = StepRunner(
        stage,
        sync,
        None,
        single.micro_batches,
        "gpipe",
        (cfg.micro_batch_size, cfg.seq_len, cfg.hidden),
        torch.float32,
        torch.device("cpu"),
    )
    b, m = cfg.micro_batch_size, single.micro_batches
    losses: list[float] = []
    for step in range(cfg.steps if steps is None else steps):
        tokens = global_batch(cfg.seed, step, m * b, cfg.seq_len, cfg.vocab)
        loss = runner.step([tokens[j * b : (j + 1) * b] for j in range(m)])
        assert loss is not None  # one stage: it is the last and has the loss
        losses.append(loss)
    return losses
