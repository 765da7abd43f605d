"""Context parallelism: causal attention over a sequence split across the cp ranks, in plain torch.

cp rank i holds the n = s/c consecutive positions [i*n, (i+1)*n). Two styles (harness/README.md lists every
call they issue):

- **ring**: K and V travel around the ring of the cp group (send to i+1, receive from i-1), c-1 hops
  forward; backward passes K, V and the dK/dV accumulators around again and returns dK/dV to their owner.
- **attention2d** (ATTENTION2D): the cp ranks form an r_Q x r_KV mesh. The r_Q ranks of a `cp_q` group
  (consecutive cp ranks) all-gather their Q chunks into one Q block; the r_KV ranks of a `cp_kv` group
  (stride r_Q) all-gather K and V into one K/V block. Each rank attends its Q block to its K/V block; the
  partial outputs are combined over `cp_q` (log-sum-exp statistics all-gathered, weighted outputs
  reduce-scattered). Backward gathers dO and the row statistic D over `cp_q` and reduce-scatters dQ over
  `cp_q` and dK/dV over `cp_kv`.

Both are exact (not approximate) attention: the first step's loss equals the single-process reference.
Gradients of the replicated parameters are reduced over dp x cp (group `dp_cp`), as Megatron-LM does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from .comm import Group, Mesh
from .config import HarnessConfig


@dataclass
class CPInfo:
    """This rank's place in the context-parallel layout; size 1 means no context parallelism."""

    size: int = 1
    rank: int = 0
    style: str = "ring"
    ring: Group | None = None  # the cp group (ring style)
    q: Group | None = None  # ATTENTION2D: ranks sharing a Q block (None when r_Q = 1)
    kv: Group | None = None  # ATTENTION2D: ranks sharing a K/V block (None when r_KV = 1)
    r_q: int = 1
    r_kv: int = 1

    def positions(self, n: int) -> torch.Tensor:
        """The sequence positions of this rank's n local tokens."""
        return torch.arange(self.rank * n, (self.rank + 1) * n)


def local_tokens(tokens: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    """The [b, s/c + 1] slice of a micro-batch's tokens that cp rank `cp_rank` trains on (inputs [:, :-1],
    targets [:, 1:])."""
    n = (tokens.shape[1] - 1) // cp
    return tokens[:, cp_rank * n : (cp_rank + 1) * n + 1]


def _new_group(dim: str, ranks: list[int]) -> tuple[dist.ProcessGroup | None, list[int]]:
    pg = dist.new_group(ranks=ranks, group_desc=f"mesh_{dim}")
    return (pg if dist.get_rank() in ranks else None), ranks


def subgroups(dim: str, blocks: list[list[int]]) -> Group | None:
    """Create one process group per block (every rank calls new_group for every block, in order) and return
    this rank's as a labelled Group."""
    from torch.distributed.distributed_c10d import _get_pg_config

    mine: Group | None = None
    for ranks in blocks:
        pg, _ = _new_group(dim, ranks)
        if pg is not None:
            desc = _get_pg_config(pg).get("pg_desc", f"mesh_{dim}")
            mine = Group(dim, pg, ranks, pg.group_name, desc, ranks.index(dist.get_rank()))
    return mine


def setup(cfg: HarnessConfig, mesh: Mesh) -> CPInfo:
    """Add the context-parallel groups to the mesh (`dp_cp` for the gradient reduction; `cp_q` and `cp_kv`
    for ATTENTION2D) and return this rank's CPInfo. Every rank calls it: group creation is collective."""
    if cfg.cp == 1:
        return CPInfo()
    d, c, t = cfg.dp, cfg.cp, cfg.tp
    rank = mesh.rank
    co = cfg.coords(rank)

    def global_rank(pp_i: int, dp_i: int, cp_i: int, tp_i: int) -> int:
        return ((pp_i * d + dp_i) * c + cp_i) * t + tp_i

    blocks = [
        [global_rank(pp_i, dp_i, cp_i, tp_i) for dp_i in range(d) for cp_i in range(c)]
        for pp_i in range(cfg.pp)
        for tp_i in range(t)
    ]
    dp_cp = subgroups("dp_cp", blocks)
    if dp_cp is not None:
        mesh.groups["dp_cp"] = dp_cp
    info = CPInfo(c, co["cp"], cfg.cp_style, ring=mesh.group("cp"))
    if cfg.cp_style == "attention2d":
        r_q, r_kv = cfg.cp_mesh
        info.r_q, info.r_kv = r_q, r_kv
        outer = [(pp_i, dp_i, tp_i) for pp_i in range(cfg.pp) for dp_i in range(d) for tp_i in range(t)]
        if r_q > 1:
            q_blocks = [
                [global_rank(p, a, qa * r_q + x, k) for x in range(r_q)] for p, a, k in outer for qa in range(r_kv)
            ]
            info.q = subgroups("cp_q", q_blocks)
            mesh.groups["cp_q"] = info.q  # type: ignore[assignment]
        if r_kv > 1:
            kv_blocks = [
                [global_rank(p, a, kb + r_q * x, k) for x in range(r_kv)] for p, a, k in outer for kb in range(r_q)
            ]
            info.kv = subgroups("cp_kv", kv_blocks)
            mesh.groups["cp_kv"] = info.kv  # type: ignore[assignment]
    return info


def gradient_mesh(mesh: Mesh) -> Mesh:
    """The mesh the dp-sync strategy sees: with context (expert) parallelism its dp group is dp x cp (dp x ep)."""
    group = mesh.group("dp_cp") or mesh.group("dp_ep")
    if group is None:
        return mesh
    return replace(mesh, groups={**mesh.groups, "dp": group})


# ------------------------------------------------------------------------------------------ block maths


def _block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of q [b, H, nq, d] to k, v [b, H, nk, d] in float32: (output, log-sum-exp [b, H, nq]).
    A query row that sees no key of the block gets output 0 and log-sum-exp -inf."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill((k_pos[None, :] > q_pos[:, None]).to(scores.device), -math.inf)
    m = scores.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(scores - m)
    total = p.sum(-1, keepdim=True)
    out = (p @ v.float()) / total.clamp_min(1e-30)
    return out, (m + total.log()).squeeze(-1)


def _block_grad(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block given the final log-sum-exp of the rows and delta = rowsum(dO * O)."""
    qf, kf, vf, dof = q.float(), k.float(), v.float(), do.float()
    scores = (qf @ kf.transpose(-1, -2)) * scale
    scores = scores.masked_fill((k_pos[None, :] > q_pos[:, None]).to(scores.device), -math.inf)
    p = torch.exp(scores - lse.unsqueeze(-1))
    dv = p.transpose(-1, -2) @ dof
    ds = p * (dof @ vf.transpose(-1, -2) - delta.unsqueeze(-1))
    return (ds @ kf) * scale, (ds.transpose(-1, -2) @ qf) * scale, dv


def _merge(
    out: torch.Tensor, lse: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    new = torch.logaddexp(lse, lse2)
    w1, w2 = torch.exp(lse - new).unsqueeze(-1), torch.exp(lse2 - new).unsqueeze(-1)
    return out * w1 + out2 * w2, new


# ------------------------------------------------------------------------------------------ ring


def _ring_pass(group: Group, t: torch.Tensor) -> torch.Tensor:
    """Send t to the next cp rank and receive the previous rank's tensor of the same shape (one batch)."""
    c, i = group.size, group.rank
    buf = torch.empty_like(t)
    group.p2p([(t.contiguous(), (i + 1) % c)], [(buf, (i - 1) % c)])
    return buf


class RingAttention(torch.autograd.Function):
    """Causal ring attention over the cp group; q, k, v are the local [b, H, n, d] blocks."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPInfo) -> torch.Tensor:
        n, scale = q.shape[2], 1.0 / math.sqrt(q.shape[-1])
        c, i = cp.size, cp.rank
        pos = cp.positions(n)
        out, lse = _block(q, k, v, pos, pos, scale)
        kv = torch.stack([k, v])
        for j in range(1, c):
            kv = _ring_pass(cp.ring, kv)  # type: ignore[arg-type]
            src = (i - j) % c
            if src < i:  # blocks of later positions are masked out entirely (causal)
                out, lse = _merge(out, lse, *_block(q, kv[0], kv[1], pos, torch.arange(src * n, (src + 1) * n), scale))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp = cp
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        cp: CPInfo = ctx.cp
        n, scale = q.shape[2], 1.0 / math.sqrt(q.shape[-1])
        c, i = cp.size, cp.rank
        pos = cp.positions(n)
        delta = (do.float() * out).sum(-1)
        dq = torch.zeros_like(out)
        held = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])  # K, V, dK, dV of block src
        for j in range(c):
            src = (i - j) % c
            if src <= i:
                k_pos = torch.arange(src * n, (src + 1) * n)
                gq, gk, gv = _block_grad(q, held[0], held[1], do, lse, delta, pos, k_pos, scale)
                dq += gq
                held[2] += gk.to(held.dtype)
                held[3] += gv.to(held.dtype)
            if j < c - 1:
                held = _ring_pass(cp.ring, held)  # type: ignore[arg-type]
        own = _ring_pass(cp.ring, held[2:]) if c > 1 else held[2:]  # type: ignore[arg-type]
        return dq.to(q.dtype), own[0], own[1], None


# ------------------------------------------------------------------------------------------ ATTENTION2D


def _gather(group: Group | None, t: torch.Tensor, dim: int) -> torch.Tensor:
    """All-gather t over the group and concatenate the members' tensors along `dim` (group-rank order)."""
    if group is None:
        return t
    t = t.contiguous()
    out = torch.empty((group.size, *t.shape), dtype=t.dtype, device=t.device)
    group.all_gather(out.view(-1), t.view(-1))
    return torch.cat(out.unbind(0), dim=dim)


def _scatter(group: Group | None, t: torch.Tensor, dim: int) -> torch.Tensor:
    """Reduce-scatter (sum) t over the group: the member of group rank r gets chunk r along `dim`."""
    if group is None:
        return t
    chunks = torch.stack(t.chunk(group.size, dim=dim)).contiguous()
    out = torch.empty_like(chunks[0])
    group.reduce_scatter(out.view(-1), chunks.view(-1))
    return out


class Attention2D(torch.autograd.Function):
    """Causal ATTENTION2D on the r_Q x r_KV mesh; q, k, v are the local [b, H, n, d] blocks."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPInfo) -> torch.Tensor:
        n, scale = q.shape[2], 1.0 / math.sqrt(q.shape[-1])
        qa, kb = divmod(cp.rank, cp.r_q)
        q_pos = torch.arange(qa * cp.r_q * n, (qa + 1) * cp.r_q * n)
        k_pos = torch.cat([torch.arange((kb + cp.r_q * x) * n, (kb + cp.r_q * x + 1) * n) for x in range(cp.r_kv)])
        q_blk = _gather(cp.q, q, dim=2)
        kv_blk = _gather(cp.kv, torch.stack([k, v]), dim=3)
        part, lse = _block(q_blk, kv_blk[0], kv_blk[1], q_pos, k_pos, scale)
        lse_all = _gather(cp.q, lse.unsqueeze(0), dim=0)
        lse_tot = torch.logsumexp(lse_all, dim=0)
        weighted = part * torch.exp(lse - lse_tot).unsqueeze(-1)
        out = _scatter(cp.q, weighted.to(q.dtype), dim=2)
        ctx.save_for_backward(q_blk, kv_blk, lse_tot, out, q_pos, k_pos)
        ctx.cp = cp
        return out

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q_blk, kv_blk, lse_tot, out, q_pos, k_pos = ctx.saved_tensors
        cp: CPInfo = ctx.cp
        scale = 1.0 / math.sqrt(q_blk.shape[-1])
        delta = _gather(cp.q, (do.float() * out.float()).sum(-1), dim=2)
        do_blk = _gather(cp.q, do, dim=2)
        gq, gk, gv = _block_grad(q_blk, kv_blk[0], kv_blk[1], do_blk, lse_tot, delta, q_pos, k_pos, scale)
        dq = _scatter(cp.q, gq.to(do.dtype), dim=2)
        dkv = _scatter(cp.kv, torch.stack([gk, gv]).to(do.dtype), dim=3)
        return dq, dkv[0], dkv[1], None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPInfo) -> torch.Tensor:
    """Causal attention of the local blocks under the rank's context-parallel style."""
    fn = Attention2D if cp.style == "attention2d" else RingAttention
    out: torch.Tensor = fn.apply(q, k, v, cp)  # type: ignore[no-untyped-call]  # torch leaves apply untyped
    return out
