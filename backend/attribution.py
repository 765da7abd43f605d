"""Scheme attribution: which parallelism dimension (dp, tp, pp, cp, ep, other) each process group or
NCCL communicator of a run serves.

Evidence in order, first match wins: a user's override (never overwritten); explicit labels (the
DeviceMesh dimension / run.json group dim on the group, run.json groups and mesh matched by ranks,
DeviceMesh descriptions `mesh_<dim>`, Megatron group descriptions, other descriptive names); then
structure (the world group when it is the only group with traffic, point-to-point between
neighbours, the rank layout of all groups: contiguous blocks vs strides, and op patterns). Whatever
stays unknown is `other`, and every result carries the evidence in its reason and confidence.

A scheme belongs to a group: it is stored on process_groups (what the store's `comms` view shows and an
override pins), and every view reads a call's scheme from its group there. A call that names no group has
no scheme, UNATTRIBUTED in every view: no reader guesses one of its own, so the views cannot disagree.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field, replace
from typing import Any

import duckdb

from commlens.contract.analysis import UNATTRIBUTED, AttributionSummary, GroupAttribution
from commlens.store import transaction
from commlens.store.aggregates import ensure_fresh, refresh_if_stale
from commlens.store.groups import SchemeVerdict, add_event_groups, pin_scheme, store_verdicts, unpin_scheme
from commlens.vocab import P2P_OPS, SCHEMES, format_bytes

from .iterations import run_id_of

MiB = 1 << 20

# DeviceMesh / run.json dimension names -> scheme.
_DIM_SCHEMES: dict[str, str] = {
    **dict.fromkeys(
        (
            "dp",
            "ddp",
            "data",
            "data_parallel",
            "fsdp",
            "zero",
            "hsdp",
            "replicate",
            "shard",
            "dp_replicate",
            "dp_shard",
            "dp_shard_cp",
            "dp_cp",
            "dp_ep",
            "dp_replicate_cp",
            "edp",
            "ep_dp",
            "dp_shard_mod_ep",
            "dp_shard_in_ep",
            "efsdp",
        ),
        "dp",
    ),
    **dict.fromkeys(("tp", "tensor", "tensor_parallel", "etp"), "tp"),
    **dict.fromkeys(("pp", "pipe", "pipeline", "pipeline_parallel", "stage"), "pp"),
    **dict.fromkeys(("cp", "context", "context_parallel", "cp_q", "cp_kv"), "cp"),
    **dict.fromkeys(("ep", "expert", "expert_parallel", "moe"), "ep"),
}

# Megatron-LM / Megatron-core `group_desc` values (parallel_state.py) -> (scheme, what the group is).
_MEGATRON: dict[str, tuple[str, str]] = {
    "TENSOR_MODEL_PARALLEL_GROUP": ("tp", "tensor-parallel group"),
    "DATA_PARALLEL_GROUP": ("dp", "data-parallel group"),
    "DATA_PARALLEL_GROUP_WITH_CP": ("dp", "data-parallel group including context-parallel ranks (gradient sync)"),
    "INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": ("dp", "partial data-parallel group (distributed optimizer)"),
    "INTER_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": ("dp", "partial data-parallel group (distributed optimizer)"),
    "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": ("dp", "distributed-optimizer instance group"),
    "PIPELINE_MODEL_PARALLEL_GROUP": ("pp", "pipeline-parallel group"),
    "EMBEDDING_GROUP": ("pp", "embedding group (tied-embedding sync between first and last stage)"),
    "POSITION_EMBEDDING_GROUP": ("pp", "position-embedding group between pipeline stages"),
    "CONTEXT_PARALLEL_GROUP": ("cp", "context-parallel group"),
    "HIERARCHICAL_CONTEXT_PARALLEL_GROUPS": ("cp", "hierarchical context-parallel group"),
    "EXPERT_MODEL_PARALLEL_GROUP": ("ep", "expert-parallel group"),
    "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": ("ep", "expert tensor-and-model group (MoE token dispatch)"),
    "EXPERT_TENSOR_PARALLEL_GROUP": ("tp", "expert tensor-parallel group"),
    "EXPERT_DATA_PARALLEL_GROUP": ("dp", "expert data-parallel group"),
    "INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": ("dp", "partial expert data-parallel group"),
    "INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": ("dp", "partial expert data-parallel group"),
    "MODEL_PARALLEL_GROUP": ("other", "model-parallel group, tp and pp together (grad-norm and similar reductions)"),
    "TENSOR_AND_DATA_PARALLEL_GROUP": ("other", "tp and dp together (fp8 amax and MoE reductions)"),
    "TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": ("other", "tp, cp and dp together"),
    "TENSOR_AND_CONTEXT_PARALLEL_GROUP": ("other", "tp and cp together"),
    "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": ("other", "expert tp, ep and pp together"),
}

_SUFFIXES = re.compile(r"(_GLOO|_AG)+$")


@dataclass
class _Group:
    key: str
    name: str | None
    description: str | None
    backend: str | None
    ranks: list[int] | None
    size: int | None
    origin: str
    mesh_dim: str | None
    source: str | None
    scheme: str | None
    reason: str | None
    confidence: float | None
    calls: int = 0
    bytes: int = 0
    op_calls: dict[str, int] = field(default_factory=dict)
    op_bytes: dict[str, int] = field(default_factory=dict)
    op_max: dict[str, int] = field(default_factory=dict)
    peers: list[tuple[int | None, int | None, str]] = field(default_factory=list)  # (rank, peer, op)

    @property
    def n(self) -> int:
        return self.size or (len(self.ranks) if self.ranks else 0)


@dataclass(frozen=True)
class _Verdict:
    scheme: str
    source: str  # label | structure | unknown
    reason: str
    confidence: float


# ------------------------------------------------------------------------------------ loading


def _load(con: duckdb.DuckDBPyConnection, run_id: int) -> dict[str, _Group]:
    """The run's groups with their stored schemes and their traffic (calls, bytes per op, p2p pairs)."""
    groups: dict[str, _Group] = {}
    for row in con.execute(
        """
        SELECT group_key, name, description, backend, ranks, size, origin, mesh_dim,
               scheme_source, scheme, scheme_reason, scheme_confidence
        FROM process_groups WHERE run_id = ? ORDER BY group_key
        """,
        [run_id],
    ).fetchall():
        key, name, description, backend, ranks, size, origin, mesh_dim, source, scheme, reason, confidence = row
        ranks = sorted(ranks) if ranks is not None else None
        groups[key] = _Group(
            key, name, description, backend, ranks, size, origin, mesh_dim, source, scheme, reason, confidence
        )
    for key, op, calls, nbytes, biggest, size in con.execute(
        """
        SELECT group_key, op, count(*), coalesce(sum(msg_bytes), 0), coalesce(max(msg_bytes), 0), max(group_size)
        FROM comm_events WHERE run_id = ? AND group_key IS NOT NULL GROUP BY group_key, op
        """,
        [run_id],
    ).fetchall():
        g = groups[key]
        g.calls += calls
        g.bytes += nbytes
        g.op_calls[op] = calls
        g.op_bytes[op] = nbytes
        g.op_max[op] = biggest
        if g.size is None and size:
            g.size = size
    for key, rank, peer, op in con.execute(
        """
        SELECT DISTINCT group_key, rank, peer, op FROM comm_events
        WHERE run_id = ? AND group_key IS NOT NULL AND op IN ('send', 'recv')
        """,
        [run_id],
    ).fetchall():
        groups[key].peers.append((rank, peer, op))
    return groups


def _world_size(con: duckdb.DuckDBPyConnection, run_id: int, groups: dict[str, _Group]) -> int | None:
    row = con.execute(
        """
        SELECT r.world_size, (SELECT max(rank) + 1 FROM comm_events WHERE run_id = r.run_id)
        FROM runs r WHERE run_id = ?
        """,
        [run_id],
    ).fetchall()[0]
    candidates = [row[0], row[1], *(g.n for g in groups.values())]
    known = [c for c in candidates if c]
    return max(known) if known else None


def _config(con: duckdb.DuckDBPyConnection, run_id: int) -> dict[str, Any] | None:
    row = con.execute("SELECT config FROM runs WHERE run_id = ?", [run_id]).fetchall()[0]
    if not row or row[0] is None:
        return None
    value = json.loads(row[0]) if isinstance(row[0], str) else row[0]
    return value if isinstance(value, dict) else None


# ------------------------------------------------------------------------------------- labels


def scheme_of_dim(dim: str | None) -> str | None:
    """The scheme a DeviceMesh / run.json dimension name stands for, or None when it does not say."""
    if not dim:
        return None
    return _DIM_SCHEMES.get(dim.strip().lower())


def _mesh_groups(dims: list[str], shape: list[int]) -> dict[tuple[int, ...], str]:
    """The rank sets of every dimension of a row-major mesh (DeviceMesh's layout)."""
    if not dims or len(dims) != len(shape) or any(s < 1 for s in shape):
        return {}
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    total = strides[0] * shape[0]
    out: dict[tuple[int, ...], str] = {}
    for d, (size, stride) in enumerate(zip(shape, strides, strict=True)):
        if size < 2:
            continue
        for start in range(total):
            if (start // stride) % size == 0:
                out[tuple(start + i * stride for i in range(size))] = dims[d]
    return out


def _config_label(g: _Group, config: dict[str, Any] | None, world: int | None) -> _Verdict | None:
    if not config or not g.ranks:
        return None
    ranks = tuple(g.ranks)
    for cg in config.get("groups") or []:
        if isinstance(cg, dict) and sorted(cg.get("ranks") or []) == list(ranks):
            return _dim_verdict(str(cg.get("dim")), config, world, g, "run.json group with the same ranks", 0.98)
    mesh = _mesh_groups(list(config.get("mesh_dims") or []), [int(x) for x in config.get("mesh_shape") or []])
    if ranks in mesh:
        where = "run.json mesh_dims x mesh_shape (row-major, as DeviceMesh)"
        return _dim_verdict(mesh[ranks], config, world, g, where, 0.9)
    return None


def _dim_verdict(
    dim: str, config: dict[str, Any] | None, world: int | None, g: _Group, where: str, conf: float
) -> _Verdict:
    scheme = scheme_of_dim(dim)
    if scheme is not None:
        return _Verdict(scheme, "label", f"{where}: dimension '{dim}'", conf)
    parallel = (config or {}).get("parallel") or {}
    if dim.lower() in ("world", "default", "global") and world and parallel.get("dp") == world and g.n == world:
        return _Verdict(
            "dp", "label", f"{where}: the world group, and the run config has parallel.dp = {world} = world size", conf
        )
    return _Verdict("other", "label", f"{where}: dimension '{dim}' is not one parallelism scheme", conf)


def description_label(text: str | None) -> tuple[str, str, float] | None:
    """(scheme, reason, confidence) from a group description or name, or None when it says nothing."""
    if not text:
        return None
    raw = text.strip()
    if raw.lower().startswith("mesh_"):
        dim = raw[5:]
        scheme = scheme_of_dim(dim)
        if scheme is not None:
            return scheme, f"DeviceMesh group '{raw}' (dimension '{dim}')", 0.95
        return "other", f"DeviceMesh group '{raw}': dimension '{dim}' is not one parallelism scheme", 0.6
    upper = _SUFFIXES.sub("", raw.upper())
    if upper in _MEGATRON:
        scheme, what = _MEGATRON[upper]
        return scheme, f"Megatron group description '{raw}': {what}", 0.95
    low = re.sub(r"[^a-z]+", "_", raw.lower()).strip("_")
    tokens = set(low.split("_"))
    rules: list[tuple[bool, str, str]] = [
        ("and" in tokens, "other", "names several dimensions together"),
        ({"expert", "data"} <= tokens, "dp", "expert data-parallel"),
        ({"expert", "tensor"} <= tokens, "tp", "expert tensor-parallel"),
        ("expert" in tokens or "moe" in tokens, "ep", "expert-parallel"),
        ("pipeline" in tokens or "pipe" in tokens or "embedding" in tokens, "pp", "pipeline"),
        ("context" in tokens, "cp", "context-parallel"),
        ({"sequence", "data"} <= tokens, "dp", "sequence-and-data-parallel gradient group"),
        ("sequence" in tokens, "cp", "sequence-parallel group (DeepSpeed-Ulysses style, splits the sequence like cp)"),
        ("tensor" in tokens, "tp", "tensor-parallel"),
        (
            ("data" in tokens and ("parallel" in tokens or "group" in tokens)) or "ddp" in tokens or "fsdp" in tokens,
            "dp",
            "data-parallel",
        ),
    ]
    for hit, scheme, what in rules:
        if hit:
            return scheme, f"group description '{raw}' reads as {what}", 0.75
    return None


# ---------------------------------------------------------------------------------- structure


def layout_stride(ranks: list[int] | None) -> int | None:
    """The common difference of a sorted rank list (1 = contiguous block), or None when irregular."""
    if not ranks or len(ranks) < 2:
        return None
    diffs = {b - a for a, b in itertools.pairwise(ranks)}
    return diffs.pop() if len(diffs) == 1 else None


def _p2p_only(g: _Group) -> bool:
    return g.calls > 0 and all(op in P2P_OPS for op in g.op_calls)


def _p2p_verdict(g: _Group) -> _Verdict:
    calls = sum(g.op_calls.values())
    if not g.ranks or not any(peer is not None for _, peer, _ in g.peers):
        return _Verdict(
            "pp",
            "structure",
            f"only point-to-point calls ({calls}); peers or group ranks unknown, "
            "so neighbour order could not be checked",
            0.5,
        )
    pos = {r: i for i, r in enumerate(g.ranks)}
    n = len(g.ranks)
    steps = set()
    for rank, peer, _ in g.peers:
        if rank in pos and peer is not None:
            p = pos.get(peer, peer if 0 <= peer < n else None)  # peer may be a group rank
            if p is not None:
                steps.add(abs(pos[rank] - p))
    if not steps:
        return _Verdict("pp", "structure", f"only point-to-point calls ({calls}); peers not in the group's ranks", 0.4)
    if steps <= {1}:
        return _Verdict(
            "pp",
            "structure",
            f"only point-to-point calls ({calls}), each between neighbouring ranks "
            f"of the group {g.ranks}: a pipeline chain",
            0.7,
        )
    if n > 2 and steps <= {1, n - 1}:
        return _Verdict(
            "cp",
            "structure",
            f"only point-to-point calls ({calls}) around a ring (last rank to first) "
            f"of {g.ranks}: ring attention passes KV blocks this way",
            0.4,
        )
    return _Verdict(
        "other",
        "structure",
        f"only point-to-point calls ({calls}) between ranks {sorted(steps)} positions apart: not a pipeline chain",
        0.2,
    )


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def _world_verdict(
    g: _Group, others_with_collectives: int, config: dict[str, Any] | None, world: int, twins: int = 0
) -> _Verdict:
    """`twins`: the other world-sized groups (COLL lines without INIT: one communicator per process)."""
    verdict = _world_group_verdict(g, others_with_collectives, config, world, twins)
    if world == 1:
        return replace(verdict, reason=verdict.reason + " (a one-rank job: its collectives move no data between ranks)")
    return verdict


def _world_group_verdict(
    g: _Group, others_with_collectives: int, config: dict[str, Any] | None, world: int, twins: int
) -> _Verdict:
    parallel = (config or {}).get("parallel") or {}
    if parallel.get("dp") == world and world > 1:
        return _Verdict("dp", "label", f"world group; the run config has parallel.dp = {world} = world size", 0.95)
    desc = f"world group '{g.description}'" if g.description else "world group"
    alone = "is the only group with collectives"
    if twins:
        n = twins + 1
        desc += (
            f" (one of {n} world-sized groups, each seen from one process: without INIT lines naming a commId, one "
            f"communicator seen from {n} processes stays {n} groups)"
        )
        alone = "has no sub-group with collectives beside it"
    if others_with_collectives:
        return _Verdict(
            "other",
            "structure",
            f"{desc} next to {others_with_collectives} sub-group(s) with collectives: it carries setup "
            "and cross-scheme traffic, not one dimension",
            0.5,
        )
    ar_bytes, ar_max = g.op_bytes.get("all_reduce", 0), g.op_max.get("all_reduce", 0)
    a2a = g.op_bytes.get("all_to_all", 0)
    ar_share, a2a_share = _share(ar_bytes, g.bytes), _share(a2a, g.bytes)
    if ar_bytes and a2a_share >= 0.1:
        return _Verdict(
            "other",
            "structure",
            f"{desc} {alone} but mixes all_reduce ({ar_share:.0%} of bytes, "
            f"data-parallel-like) and all_to_all ({a2a_share:.0%}, model-parallel exchange as in "
            "embedding or expert layers): one group serves two schemes; set an override if one of "
            "them is what you want to see",
            0.3,
        )
    if ar_share >= 0.9 and ar_max >= MiB:
        return _Verdict(
            "dp",
            "structure",
            f"{desc} {alone}; {ar_share:.0%} of its bytes are all_reduce "
            f"with calls up to {ar_max / MiB:.1f} MiB (gradient-bucket sized): data-parallel gradient "
            "synchronisation",
            0.75,
        )
    if a2a_share >= 0.5:
        return _Verdict(
            "ep", "structure", f"{desc} does mostly all_to_all ({a2a_share:.0%} of bytes); {_A2A_WEAK}", 0.3
        )
    if not ar_bytes:
        top = max(g.op_bytes, key=lambda op: g.op_bytes[op], default=None)
        what = (
            f"no all_reduce; {top} carries {_share(g.op_bytes[top], g.bytes):.0%} of its {format_bytes(g.bytes)}"
            if top and g.bytes
            else "no sized calls"
        )
        return _Verdict(
            "other", "structure", f"{desc} has {what}: nothing in it marks one scheme (an override can say)", 0.4
        )
    return _Verdict(
        "other",
        "structure",
        f"{desc} without gradient-sized all_reduce (the largest {format_bytes(ar_max)}, all_reduce {ar_share:.0%} "
        f"of its {format_bytes(g.bytes)}): setup or small traffic",
        0.4,
    )


_A2A_WEAK = (
    "expert parallelism uses all_to_all, but so do Ulysses context parallelism and embedding exchange: weak evidence"
)


def _layout_verdict(g: _Group, s: int | None, distinct: list[int], has_pp: bool) -> _Verdict:
    """A collective sub-group from its rank layout among the layouts of all collective sub-groups."""
    ops = ", ".join(f"{op} x{n}" for op, n in sorted(g.op_calls.items()))
    where = f"stride {s}, ranks {g.ranks}; {ops}"
    several = f"among {len(distinct)} group layouts with collectives"
    if g.ranks is None:
        return _Verdict(
            "other",
            "unknown",
            f"collectives ({ops}) on a group whose global ranks are unknown: no layout to reason from",
            0.0,
        )
    if s is None:
        return _Verdict("other", "unknown", f"irregular rank layout {g.ranks} ({ops})", 0.0)
    if len(distinct) >= 2 and s == distinct[0]:
        return _Verdict(
            "tp",
            "structure",
            f"contiguous-most layout ({where}) {several}: Megatron and DeviceMesh put tp innermost so "
            "it stays within a node; layout convention, not a label",
            0.5,
        )
    if len(distinct) >= 2 and s == distinct[-1]:
        return _Verdict(
            "dp",
            "structure",
            f"widest-stride layout ({where}) {several}: data parallelism spans the outer mesh "
            "dimension; layout convention, not a label",
            0.5,
        )
    if len(distinct) >= 2:
        return _Verdict(
            "other",
            "unknown",
            f"stride {s} lies between the tp-like ({distinct[0]}) and dp-like ({distinct[-1]}) layouts; "
            "by Megatron's order this is cp or ep, which the layout cannot decide",
            0.0,
        )
    if s > 1:
        return _Verdict(
            "dp",
            "structure",
            f"the only layout with collectives is strided ({where}): an outer mesh dimension, as data "
            "parallelism usually is",
            0.4,
        )
    if has_pp:
        return _Verdict(
            "tp",
            "structure",
            f"contiguous blocks ({where}) next to pipeline groups: the inner dimension of a tp x pp layout",
            0.4,
        )
    return _Verdict(
        "other",
        "unknown",
        f"one family of contiguous rank blocks ({where}): tp and dp cannot be told apart by layout alone",
        0.0,
    )


def _structure(groups: list[_Group], world: int | None, config: dict[str, Any] | None) -> dict[str, _Verdict]:
    out: dict[str, _Verdict] = {}
    collective: list[_Group] = []
    # A one-rank job's one group with calls is its world: DDP of one rank still issues its gradient all_reduces
    # (they move nothing between ranks), and a configuration of that job predicts them.
    single_with_calls = [g for g in groups if g.n == 1 and g.calls]
    one_rank_world = single_with_calls[0] if (world or 1) == 1 and len(single_with_calls) == 1 else None
    for g in groups:
        if g is one_rank_world:
            continue  # decided below, as a world group
        if g.n == 1:
            out[g.key] = _Verdict("other", "structure", "single-rank group: moves no data between ranks", 0.9)
        elif g.calls == 0:
            out[g.key] = _Verdict("other", "unknown", "no calls recorded on this group and no label", 0.0)
        elif _p2p_only(g):
            out[g.key] = _p2p_verdict(g)
        elif world and g.n == world and world > 1:
            continue  # decided below, once the sub-groups are known
        elif _share(g.op_calls.get("all_to_all", 0), g.calls) >= 0.5:
            n_a2a = g.op_calls["all_to_all"]
            reason = f"mostly all_to_all ({n_a2a} of {g.calls} calls): {_A2A_WEAK}"
            out[g.key] = _Verdict("ep", "structure", reason, 0.3)
        else:
            collective.append(g)
    worlds = [g for g in groups if g.key not in out and g not in collective]
    by_pointer = [g for g in worlds if g.key.startswith("nccl:ptr:")]  # a process's communicator, no commId
    for g in worlds:
        twins = len(by_pointer) - 1 if g in by_pointer else 0
        out[g.key] = _world_verdict(g, len(collective), config, world or g.n, twins)
    strides = {g.key: layout_stride(g.ranks) for g in collective}
    distinct = sorted({s for s in strides.values() if s is not None})
    has_pp = any(v.scheme == "pp" for v in out.values())
    for g in collective:
        out[g.key] = _layout_verdict(g, strides[g.key], distinct, has_pp)
    return out


# ---------------------------------------------------------------------------------------- API


def _label(g: _Group, config: dict[str, Any] | None, world: int | None) -> _Verdict | None:
    if g.mesh_dim:
        where = "run.json group" if g.origin == "run_config" else "DeviceMesh dimension of the group"
        return _dim_verdict(g.mesh_dim, config, world, g, where, 0.99 if g.origin == "run_config" else 0.95)
    verdict = _config_label(g, config, world)
    if verdict is not None:
        return verdict
    for text in (g.description, g.name):
        hit = description_label(text)
        if hit is not None:
            return _Verdict(hit[0], "label", hit[1], hit[2])
    return None


def _result(g: _Group) -> GroupAttribution:
    """The wire form of a group's attribution (its scheme and source validated against the vocabulary)."""
    return GroupAttribution.model_validate(
        {
            "group_key": g.key,
            "name": g.name,
            "description": g.description,
            "ranks": g.ranks,
            "size": g.size,
            "scheme": g.scheme or "other",
            "source": g.source or "unknown",
            "reason": g.reason or "",
            "calls": g.calls,
            "confidence": g.confidence if g.confidence is not None else 0.0,
        }
    )


def attribute_run(con: duckdb.DuckDBPyConnection, run: str) -> list[GroupAttribution]:
    """Attribute every process group / communicator of the run to a scheme and store it on
    process_groups (scheme, scheme_source, scheme_reason, scheme_confidence), in one transaction with the
    scheme-dependent aggregates. Overrides are kept."""
    run_id = run_id_of(con, run)
    return transaction(con, lambda c: _attribute(c, run_id))


def _attribute(con: duckdb.DuckDBPyConnection, run_id: int) -> list[GroupAttribution]:
    add_event_groups(con, run_id)
    groups = _load(con, run_id)
    verdicts = _verdicts(groups, _config(con, run_id), _world_size(con, run_id, groups))
    store_verdicts(
        con, run_id, (SchemeVerdict(key, v.scheme, v.source, v.reason, v.confidence) for key, v in verdicts.items())
    )
    for key, v in verdicts.items():
        g = groups[key]
        g.scheme, g.source, g.reason, g.confidence = v.scheme, v.source, v.reason, v.confidence
    refresh_if_stale(con, run_id)  # schemes changed: the scheme-dependent aggregates, atomically
    return [_result(g) for g in groups.values()]


def _verdicts(groups: dict[str, _Group], config: dict[str, Any] | None, world: int | None) -> dict[str, _Verdict]:
    """A verdict for every group but the overridden: its label when it has one, else the run's structure."""
    verdicts: dict[str, _Verdict] = {}
    rest: list[_Group] = []
    for g in groups.values():
        if g.source == "override":
            continue
        label = _label(g, config, world)
        if label is not None:
            verdicts[g.key] = label
        else:
            rest.append(g)
    verdicts.update(_structure(rest, world, config))
    return verdicts


def set_override(
    con: duckdb.DuckDBPyConnection, run: str, group_key: str, scheme: str, reason: str
) -> GroupAttribution:
    """Pin a group's scheme; attribute_run never overwrites it."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, not {scheme!r}")
    if not reason or not reason.strip():
        raise ValueError("an override needs a reason (what you know that the traces do not say)")
    run_id = run_id_of(con, run)
    try:
        pin_scheme(con, run_id, group_key, scheme, f"set by a user: {reason.strip()}")
    except LookupError:
        raise LookupError(f"run {run!r} has no process group {group_key!r}") from None
    refresh_if_stale(con, run_id)
    return next(a for a in attribution_summary(con, run).groups if a.group_key == group_key)


def clear_override(con: duckdb.DuckDBPyConnection, run: str, group_key: str) -> list[GroupAttribution]:
    """Drop a user's override and attribute the run again from its evidence."""
    unpin_scheme(con, run_id_of(con, run), group_key)
    return attribute_run(con, run)


def attribution_summary(con: duckdb.DuckDBPyConnection, run: str) -> AttributionSummary:
    """The stored attribution of a run (as last written), with the events no scheme can cover (calls
    counted from the run's aggregates)."""
    run_id = run_id_of(con, run)
    ensure_fresh(con, run_id)
    rows = con.execute(
        """
        SELECT g.group_key, g.name, g.description, g.ranks, g.size, g.scheme, g.scheme_source, g.scheme_reason,
               g.scheme_confidence, coalesce(a.calls, 0)
        FROM process_groups g
        LEFT JOIN (SELECT group_key, sum(calls) AS calls FROM comm_agg WHERE run_id = ? GROUP BY group_key) a
               ON a.group_key = g.group_key
        WHERE g.run_id = ? ORDER BY g.group_key
        """,
        [run_id, run_id],
    ).fetchall()
    groups = [
        GroupAttribution(
            group_key=r[0],
            name=r[1],
            description=r[2],
            ranks=sorted(r[3]) if r[3] is not None else None,
            size=r[4],
            scheme=r[5] or "other",
            source=r[6] or "unknown",
            reason=r[7] or "not attributed yet (run attribute_run)",
            confidence=r[8] or 0.0,
            calls=r[9],
        )
        for r in rows
    ]
    unattributed = int(
        con.execute(
            "SELECT coalesce(sum(calls), 0) FROM comm_agg WHERE run_id = ? AND group_key IS NULL", [run_id]
        ).fetchall()[0][0]
    )
    by_scheme = {
        k: int(n)
        for k, n in con.execute(
            """
        SELECT coalesce(g.scheme, ?), sum(a.calls) FROM comm_agg a
        LEFT JOIN process_groups g ON g.run_id = a.run_id AND g.group_key = a.group_key
        WHERE a.run_id = ? GROUP BY ALL ORDER BY 1
        """,
            [UNATTRIBUTED, run_id],
        ).fetchall()
    }
    return AttributionSummary(run=run, groups=groups, unattributed_events=unattributed, events_by_scheme=by_scheme)
