"""Process groups of the mesh and the labelled collectives the harness issues.

Every collective the harness issues runs inside a profiler range named ``commlens:<dim>:<pg_name>``
(LABEL_PREFIX). gloo does not emit ``record_param_comms`` (torch 2.13), so a gloo Kineto trace has no
process-group name on its ``c10d::*`` events; the enclosing range is what ties each call to its
group. On NCCL the label is redundant with ``record_param_comms``' ``Process Group Name``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.profiler import record_function

from .config import HarnessConfig

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

LABEL_PREFIX = "commlens:"

# torch 2.13 renamed the tensor collectives (same c10d ops underneath: _allgather_base_, _reduce_scatter_base_).
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def label(dim: str, pg_name: str) -> str:
    return f"{LABEL_PREFIX}{dim}:{pg_name}"


@dataclass
class Group:
    """One process group of the mesh, as this rank sees it."""

    dim: str
    pg: dist.ProcessGroup
    ranks: list[int]  # global ranks, in group-rank order
    name: str  # torch process-group name (Kineto "Process Group Name", pg_config pg_name)
    desc: str
    rank: int  # this rank's rank inside the group
    tag: str = field(init=False)

    def __post_init__(self) -> None:
        self.tag = label(self.dim, self.name)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        with record_function(self.tag):
            dist.all_reduce(t, op=op, group=self.pg)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """out (flat, size * inp.numel()) <- concatenation of every rank's inp, in group-rank order."""
        with record_function(self.tag):
            all_gather_flat(out, inp, group=self.pg)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """out <- sum over ranks of chunk `self.rank` of inp (inp split into `size` equal chunks)."""
        with record_function(self.tag):
            reduce_scatter_flat(out, inp, op=dist.ReduceOp.SUM, group=self.pg)

    def p2p(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> None:
        """Post the sends then the receives (group-rank peers) as one batch and wait for all of them.

        Batching keeps crossed send/recv pairs (1F1B steady state) from deadlocking on NCCL and gloo."""
        ops = [dist.P2POp(dist.isend, t, group=self.pg, group_peer=p) for t, p in sends]
        ops += [dist.P2POp(dist.irecv, t, group=self.pg, group_peer=p) for t, p in recvs]
        if not ops:
            return
        with record_function(self.tag):
            works = dist.batch_isend_irecv(ops)
        for w in works:
            w.wait()

    def info(self) -> dict:
        return {"dim": self.dim, "ranks": self.ranks, "pg_name": self.name, "pg_desc": self.desc}


@dataclass
class Mesh:
    """The rank's groups (one per mesh dim of size > 1) and its coordinates."""

    cfg: HarnessConfig
    rank: int
    device_mesh: DeviceMesh | None  # None when world size is 1
    groups: dict[str, Group]
    backend: str

    def group(self, dim: str) -> Group | None:
        return self.groups.get(dim)

    def require(self, dim: str) -> Group:
        """The group of a dim the caller cannot run without (a dp strategy needs its dp group)."""
        group = self.groups.get(dim)
        if group is None:
            raise ValueError(f"the mesh has no {dim} group ({dim} = 1): {sorted(self.groups)} only")
        return group

    @property
    def coords(self) -> dict[str, int]:
        return self.cfg.coords(self.rank)

    def submesh(self, dim: str) -> DeviceMesh | None:
        return None if self.device_mesh is None else self.device_mesh[dim]


def build_mesh(cfg: HarnessConfig, device_type: str) -> Mesh:
    """A DeviceMesh over the dims of size > 1 (order pp, dp, tp), its groups labelled with their dim."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    dims, shape = cfg.mesh_dims, cfg.mesh_shape
    if not dims:
        return Mesh(cfg, rank, None, {}, dist.get_backend() if dist.is_initialized() else "none")
    from torch.distributed.device_mesh import init_device_mesh

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(dims))
    from torch.distributed.distributed_c10d import _get_pg_config

    groups = {}
    for d in dims:
        pg = mesh.get_group(d)
        conf = _get_pg_config(pg)
        groups[d] = Group(
            d, pg, dist.get_process_group_ranks(pg), pg.group_name, conf.get("pg_desc", ""), dist.get_rank(pg)
        )
    return Mesh(cfg, rank, mesh, groups, dist.get_backend())
