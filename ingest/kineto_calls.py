"""What one call is: its op, sizes (formats.md B.4/B.5), process group, duration and peer.

Sources are tried best first: record_param_comms / kernel metadata (`In msg nelems`, or the older
`In msg size`), then the c10d op's `Input Dims`/`Input type` (`_base_` ops list the output first;
TensorLists have empty dims before torch 2.13), then the backend annotation's dims (the input
tensor). The process group comes from metadata (`Process Group Name`, or `Process Group ID` / ranks
matched against pg_config), else from an enclosing `commlens:<mesh dim>:<pg name>` range, else from
pg_config when it lists a single group; otherwise it is NULL, never guessed.
"""

from __future__ import annotations

import bisect
import json
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from commlens.vocab import C10_DTYPES, CPP_DTYPES, DTYPE_BYTES, SYMM_MEM_NAMESPACE, WRAPPER_NAMESPACES, normalize_op

from .kineto_fields import Field, has, meta, spelling
from .kineto_model import EPS, Call, CpuEv, Kernel, Sizes, TraceContext, as_int
from .records import ParseResult

# ncclDevKernel_AllReduce_Sum_bf16_RING_LL (NCCL 2.19+), ncclKernel_AllGather_RING_LL (older), the symmetric kernels
# of NCCL 2.27+ (ncclSymDevKernel_AllReduce_RSxLD_AGxST_sum_bf16, later ncclSymkDevKernel_...), and before NCCL 2.8
# ncclAllReduceRingLLKernel_sum_f32
_KERNEL = re.compile(r"nccl(?:Symk?)?(?:Dev)?Kernel_([A-Za-z]+)|nccl([A-Z][A-Za-z]+?)(?:Ring|Tree|CollNet)")
_KERNEL_TYPE = re.compile(
    r"_(?:Sum|Prod|Max|Min|Avg|PreMulSum|SumPostDiv|sum|prod|max|min|avg)_([A-Za-z0-9_]+?)(?:_[A-Z]|\(|$)"
)
_KERNEL_OPS = {
    "AllReduce": "all_reduce",
    "AllGather": "all_gather",
    "ReduceScatter": "reduce_scatter",
    "Broadcast": "broadcast",
    "Reduce": "reduce",
    "AllToAll": "all_to_all",
    "AlltoAll": "all_to_all",
    "Gather": "gather",
    "Scatter": "scatter",
    "Send": "send",
    "Recv": "recv",
}
_KERNEL_DTYPES = {
    "f32": "float32",
    "float": "float32",
    "f16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "__nv_bfloat16": "bfloat16",
    "hip_bfloat16": "bfloat16",  # RCCL's MSCCL kernels: mscclKernel_Sum_hip_bfloat16_Simple_false
    "rccl_bfloat16": "bfloat16",
    "f64": "float64",
    "double": "float64",
    "i8": "int8",
    "int8_t": "int8",
    "u8": "uint8",
    "uint8_t": "uint8",
    "i32": "int32",
    "int32_t": "int32",
    "int": "int32",
    "u32": "uint32",
    "uint32_t": "uint32",
    "i64": "int64",
    "int64_t": "int64",
    "u64": "uint64",
    "uint64_t": "uint64",
    "f8e4m3": "float8_e4m3fn",
    "__nv_fp8_e4m3": "float8_e4m3fn",
    "f8e5m2": "float8_e5m2",
    "__nv_fp8_e5m2": "float8_e5m2",
}
_REDUCING = {"all_reduce", "reduce_scatter", "reduce"}
# c10d dispatcher ops whose first two arguments are (output, input); all others are in place (arg 0).
_OUT_IN = {
    "_allgather_base_",
    "allgather_",
    "allgather_coalesced_",
    "allgather_into_tensor_coalesced_",
    "_reduce_scatter_base_",
    "reduce_scatter_",
    "reduce_scatter_tensor_coalesced_",
    "alltoall_base_",
    "alltoall_",
    "gather_",
    "scatter_",
    "all_gather_into_tensor_out",
}


def call_op(call: Call) -> str | None:
    """The logical op: dispatcher op > record_param_comms metadata > annotation > kernel."""
    for kind in ("c10d", "rpc", "annot"):
        for ev in call.members:
            if kind == "c10d" and ev.kind == "container" and ev.name != "record_param_comms" and ev.op:
                return ev.op
            if kind == "rpc" and ev.name == "record_param_comms" and ev.op:
                return ev.op
            if kind == "annot" and ev.kind == "annot" and ev.op and ev is not call.worker:
                return ev.op
    for k in call.kernels:
        op = kernel_op(k)
        if op:
            return op
    return None


def kernel_op(k: Kernel) -> str | None:
    coll = meta(k.args, "collective")
    if isinstance(coll, str) and normalize_op(coll):
        return normalize_op(coll)
    m = _KERNEL.match(k.name)
    if not m:
        return None
    return _KERNEL_OPS.get(m.group(1) or m.group(2))


def _kernel_dtype(k: Kernel, op: str) -> str | None:
    if op not in _REDUCING:
        return None  # AllGather/Broadcast/SendRecv kernels are typed by bytes, not by the payload
    m = _KERNEL_TYPE.search(k.name)
    return _KERNEL_DTYPES.get(m.group(1)) if m else None


def _prod(dims: Any) -> int | None:
    if not isinstance(dims, list):
        return None
    n = 1
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int):
            return None
        n *= d
    return n


def _numel(typ: Any, dims: Any) -> int | None:
    """Elements of one recorded argument: a tensor (dims = shape) or a tensor list (dims = shapes)."""
    if isinstance(typ, str) and typ in CPP_DTYPES:
        return _prod(dims)
    if not isinstance(dims, list) or not dims:
        return None
    total = 0
    for d in dims:
        n = _prod(d) if (d and all(isinstance(x, int) for x in d)) or d == [] else _numel("TensorList", d)
        if n is None:
            return None
        total += n
    return total


def _meta_sizes(args: dict[str, Any]) -> Sizes | None:
    """Sizes from collective metadata; None for args that are not collective metadata."""
    if not has(args, "collective"):
        return None
    dt = meta(args, "dtype")
    dtype = C10_DTYPES.get(dt) if isinstance(dt, str) else None
    if dtype is None and isinstance(dt, str) and dt.lower() in DTYPE_BYTES:
        dtype = dt.lower()
    return Sizes(
        as_int(meta(args, "elems_in")), as_int(meta(args, "elems_out")), dtype, as_int(meta(args, "group_size"))
    )


def container_sizes(call: Call) -> Sizes:
    """Sizes from the outermost c10d op's Input Dims / Input type."""
    for ev in call.members:
        if ev.kind != "container" or ev.name == "record_param_comms":
            continue
        dims, types = ev.args.get("Input Dims"), ev.args.get("Input type")
        if not isinstance(dims, list) or not isinstance(types, list):
            continue
        base = ev.name.rsplit("::", 1)[-1]
        nargs = min(len(dims), len(types))
        if nargs == 0:
            continue
        dtype = next((CPP_DTYPES[t] for t in types[:2] if isinstance(t, str) and t in CPP_DTYPES), None)
        if base in _OUT_IN and nargs >= 2:
            return Sizes(_numel(types[1], dims[1]), _numel(types[0], dims[0]), dtype, _concrete_group_size(ev, base))
        n = _numel(types[0], dims[0])
        # functional and symmetric-memory ops: the input only
        if base.startswith(("all_gather", "reduce_scatter", "all_to_all")) or (
            ev.backend == SYMM_MEM_NAMESPACE and ev.op in ("all_gather", "reduce_scatter", "all_to_all")
        ):
            return Sizes(n, None, dtype, _concrete_group_size(ev, base))
        return Sizes(n, n, dtype)
    return Sizes()


def _concrete_group_size(ev: CpuEv, base: str) -> int | None:
    """`_c10d_functional::all_gather_into_tensor(input, group_size, group_name)` records its group size."""
    if not ev.name.startswith(("_c10d_functional::", "c10d_functional::")):
        return None
    conc = ev.args.get("Concrete Inputs")
    if base.startswith(("all_gather", "reduce_scatter")) and isinstance(conc, list) and len(conc) > 1:
        return as_int(conc[1] if base.startswith("all_gather") else (conc[2] if len(conc) > 2 else None))
    return None


def annot_elems(ev: CpuEv) -> int | None:
    dims, types = ev.args.get("Input Dims"), ev.args.get("Input type")
    if not isinstance(dims, list) or not isinstance(types, list) or not dims:
        return None
    total = 0
    for t, d in zip(types, dims, strict=False):
        if isinstance(t, str) and t in CPP_DTYPES:
            n = _prod(d)
            if n is None:
                return None
            total += n
    return total if any(isinstance(t, str) and t in CPP_DTYPES for t in types) else None


def _annot_dtype(ev: CpuEv) -> str | None:
    types = ev.args.get("Input type")
    if isinstance(types, list):
        return next((CPP_DTYPES[t] for t in types if isinstance(t, str) and t in CPP_DTYPES), None)
    return None


@dataclass(frozen=True)
class GroupInfo:
    key: str | None = None
    size: int | None = None
    ranks: list[int] | None = None
    name: str | None = None
    desc: str | None = None
    mesh_dim: str | None = None

    @staticmethod
    def named(name: str, ctx: TraceContext) -> GroupInfo:
        """The group `name` as pg_config describes it (size and ranks unknown when it does not)."""
        info = ctx.groups.get(name, {})
        return GroupInfo(key=f"pg:{name}", size=info.get("size"), ranks=info.get("ranks"), name=name)


def parse_ranks(value: Any) -> list[int] | None:
    """Ranks as a JSON list or a string "[0, 1, 2]"; None when truncated ("...") or unreadable."""
    if isinstance(value, list):
        out = [as_int(v) for v in value]
        return None if any(v is None for v in out) else out  # type: ignore[return-value]
    if isinstance(value, str):
        text = value.strip()
        if "..." in text:
            return None
        text = text.strip("[]() ")
        if not text:
            return []
        try:
            return [int(x) for x in re.split(r"[,\s]+", text) if x]
        except ValueError:
            return None
    return None


def group_of(args: dict[str, Any], ctx: TraceContext) -> GroupInfo:
    """The process group named by record_param_comms / kernel metadata."""
    size = as_int(meta(args, "group_size"))
    ranks = _meta_ranks(args, size)
    name = _meta_group_name(args, ranks, ctx)
    desc = meta(args, "group_desc")
    desc = str(desc) if desc is not None else None
    if name is None:
        return GroupInfo(size=size, ranks=ranks, desc=desc)
    info = ctx.groups.get(name)
    if info:
        size, ranks = size or info.get("size"), ranks or info.get("ranks")
    return GroupInfo(f"pg:{name}", size, ranks, name, desc)


def _meta_ranks(args: dict[str, Any], size: int | None) -> list[int] | None:
    """The group's global ranks: listed, else the arithmetic progression start/stride of `size` ranks."""
    ranks = parse_ranks(meta(args, "group_ranks"))
    start, stride = as_int(meta(args, "rank_start")), as_int(meta(args, "rank_stride"))
    if ranks is None and start is not None and stride and size:
        return list(range(start, start + stride * size, stride))
    return ranks


def _meta_group_name(args: dict[str, Any], ranks: list[int] | None, ctx: TraceContext) -> str | None:
    """The pg name: given; else the pg_config group of the (older) numeric id; else the one group with these ranks."""
    name = meta(args, "group_name")
    if name is not None:
        return str(name)
    pgid = meta(args, "group_id")
    if pgid is not None:
        by_uid = [
            pname for pname, info in ctx.groups.items() if info.get("uid") is not None and info.get("uid") == pgid
        ]
        if by_uid:
            return by_uid[0]
        if str(pgid) in ctx.groups and ctx.groups[str(pgid)].get("uid") is None:
            return str(pgid)
    if ranks:
        matches = [n for n, info in ctx.groups.items() if info.get("ranks") == ranks]
        if len(matches) == 1:
            return matches[0]
    return None


@dataclass(frozen=True)
class CallFacts:
    """What one call is, and what it adds to the file's result besides its row."""

    row: dict[str, Any]  # comm_events row (rank, process, seq and step are the caller's)
    group: dict[str, Any] | None  # process_groups row of the group the call names
    notes: tuple[str, ...] = ()  # warnings
    tally: Counter[str] = field(default_factory=Counter)  # which metadata generation sized it
    peer_bytes: tuple[int, ...] | None = None  # all_to_all: bytes sent to each group rank, when recorded


# A call's shape: everything describe_call reads but the times (event kinds, names, ops, backends, the
# shared args dicts by identity, the kernels, the gloo worker, the label's group), so calls of one shape
# have the same facts but for their timing.
_Shape = tuple[Any, ...]


def _shape(call: Call) -> _Shape:
    return (
        tuple((ev.kind, ev.name, ev.op, ev.backend, id(ev.args)) for ev in call.members),
        tuple((k.name, id(k.args)) for k in call.kernels),
        None if call.root is None else (call.root.kind, call.root.name, call.root.op, id(call.root.args)),
        None if call.worker is None else id(call.worker.args),
        None if call.label is None else (call.label.dim, call.label.pg),
    )


def call_row(
    call: Call, ctx: TraceContext, result: ParseResult, gen: Counter[str], shapes: dict[_Shape, CallFacts | None]
) -> dict[str, Any] | None:
    """The comm_events row of one call, its group, warnings and tally recorded in `result` and `gen`. A
    training loop repeats a few shapes of call millions of times: each shape is described once (`shapes`,
    the file's cache; the args dicts it keys by identity must live as long as it) and each call gets its
    own times."""
    key = _shape(call)
    new = key not in shapes
    facts = shapes[key] = describe_call(call, ctx) if new else shapes[key]
    if facts is None:
        result.skip("call whose collective cannot be told")
        return None
    for note in facts.notes:
        result.warn(note)
    if facts.group is not None and new:
        result.groups.append(facts.group)
    gen.update(facts.tally)
    if facts.peer_bytes is not None:
        # the caller numbers its rows in order (seq = the row's index among the file's calls) on result.rank
        seq = result.n_events
        result.a2a_pairs += [
            {"rank": result.rank, "seq": seq, "peer": peer, "bytes": n} for peer, n in enumerate(facts.peer_bytes)
        ]
    row = dict(facts.row)
    if not new:
        row["ts_us"], row["dur_us"], row["dur_source"] = _timing(call, ctx)
    return row


def describe_call(call: Call, ctx: TraceContext) -> CallFacts | None:
    """Op, sizes, group, timing and peer of one call; None when its collective cannot be told."""
    op = call_op(call)
    if op is None:
        return None
    sources, group, tally, meta_notes = _metadata(call, op, ctx)
    cs = container_sizes(call)
    if cs.elems_in is not None or cs.elems_out is not None or cs.dtype is not None:
        sources.append(("input_dims", cs))
    sources += _annotation_sizes(call, op, cs)
    size, used = _merge_sizes(sources)
    if size.dtype is None and call.kernels:
        size = replace(size, dtype=_kernel_dtype(call.kernels[0], op))
    gsize = size.group_size or group.size
    if gsize is None:
        gsize = _derived_group_size(op, size)
    group, notes = _labelled_group(call, _named_by_argument(call, group, ctx), ctx)
    notes = meta_notes + notes
    group = _sole_group(group, ctx)
    gsize = gsize or group.size
    if gsize is None:
        gsize = _uniform_group_size(ctx)
    size = _with_derived(op, size, gsize)
    tally.update(f"sized_by:{label}" for label in used or ["none"])
    peer = None
    if op in ("send", "recv"):
        peer, note = _peer(call, op, group, ctx)
        notes += (note,) if note else ()
    ts, dur, dur_source = _timing(call, ctx)
    row = {
        "op": op,
        "dtype": size.dtype,
        "msg_bytes": _msg_bytes(op, size, gsize),
        "elems_in": size.elems_in,
        "elems_out": size.elems_out,
        "group_size": gsize,
        "group_key": group.key,
        "peer": peer,
        "ts_us": ts,
        "dur_us": dur,
        "dur_source": dur_source,
        "raw_name": _raw_name(call, op),
    }
    group_row = None
    if group.key is not None:
        group_row = {
            "group_key": group.key,
            "name": group.name,
            "description": group.desc,
            "ranks": group.ranks,
            "size": group.size or gsize,
            "origin": "event",
            "mesh_dim": group.mesh_dim,
        }
    peer_bytes = _peer_bytes(call, size, gsize) if op == "all_to_all" else None
    return CallFacts(row, group_row, notes, tally, peer_bytes)


def _peer_bytes(call: Call, size: Sizes, gsize: int | None) -> tuple[int, ...] | None:
    """Bytes an all_to_all sends to each group rank, from its input split list (rows per peer): the
    metadata's `In split size`, else the c10d `alltoall_base_` argument 4 (Concrete Inputs); an empty
    list is an even split. None when no split list is recorded or it does not fit the input's size."""
    es = DTYPE_BYTES.get(size.dtype) if size.dtype else None
    if size.elems_in is None or es is None:
        return None
    splits = _input_splits(call)
    if splits == [] and gsize:
        splits = [1] * gsize
    if not splits or (gsize and len(splits) != gsize):
        return None
    rows = sum(splits)
    if rows == 0:
        return tuple(0 for _ in splits) if size.elems_in == 0 else None
    if size.elems_in % rows:
        return None
    return tuple(n * (size.elems_in // rows) * es for n in splits)


def _input_splits(call: Call) -> list[int] | None:
    for args in [ev.args for ev in call.members if ev.name == "record_param_comms"] + [k.args for k in call.kernels]:
        if has(args, "in_splits"):
            return parse_ranks(meta(args, "in_splits"))
    for ev in call.members:
        conc = ev.args.get("Concrete Inputs")
        if ev.name.rsplit("::", 1)[-1] == "alltoall_base_" and isinstance(conc, list) and len(conc) > 4:
            return parse_ranks(conc[4])
    return None


_COUNTS: tuple[Field, ...] = ("elems_in", "elems_out", "group_size")


def _unreadable_counts(carrier: str, ts: float, args: dict[str, Any]) -> tuple[str, ...]:
    """A warning per count in `args` that holds no whole number ("abc", 1.5, true): it sizes nothing."""
    out = []
    for f in _COUNTS:
        key = spelling(args, f)
        if key is not None and args[key] is not None and as_int(args[key]) is None:
            shown = json.dumps(args[key], default=str)[:80]
            at = f"{ts:.3f}".rstrip("0").rstrip(".")  # the file's "ts", to find the event by
            out.append(f"{carrier} at ts {at}: {key!r} is {shown}, not a whole number: not used to size the call")
    return tuple(out)


def _metadata(
    call: Call, op: str, ctx: TraceContext
) -> tuple[list[tuple[str, Sizes]], GroupInfo, Counter[str], tuple[str, ...]]:
    """Sizes from collective metadata (record_param_comms of this op, then kernels), the group the first
    telling one names, how many carriers had metadata, and warnings about counts it could not read."""
    carriers = [
        ("record_param_comms", ev.ts, ev.args, ev.op in (op, None))
        for ev in call.members
        if ev.name == "record_param_comms"
    ]
    carriers += [("kernel", k.ts, k.args, True) for k in call.kernels]
    sources: list[tuple[str, Sizes]] = []
    group = GroupInfo()
    tally: Counter[str] = Counter()
    notes: tuple[str, ...] = ()
    for label, ts, args, same_op in carriers:
        s = _meta_sizes(args)
        if s is None:
            continue
        notes += _unreadable_counts(label, ts, args)
        if same_op:
            sources.append((label, s))
        if group.key is None and group.size is None:
            group = group_of(args, ctx)
        tally["kernel_metadata" if label == "kernel" else "record_param_comms"] += 1
    return sources, group, tally, notes


def _annotation_sizes(call: Call, op: str, cs: Sizes) -> list[tuple[str, Sizes]]:
    """Sizes from the backend annotations of this op (or the gloo worker) that agree with the c10d op's input."""
    out = []
    for ev in call.members:
        if ev.kind != "annot" or not (ev.op == op or ev is call.worker):
            continue
        n, dtype = annot_elems(ev), _annot_dtype(ev)
        if (n is None and dtype is None) or (cs.elems_in is not None and n is not None and n != cs.elems_in):
            continue
        out.append(("annotation_dims", _annot_sizes(op, n, dtype)))
    return out


_SIZE_FIELDS = ("elems_in", "elems_out", "dtype", "group_size")


def _merge_sizes(sources: list[tuple[str, Sizes]]) -> tuple[Sizes, list[str]]:
    """Each field from the first source that has it; the labels of the sources that gave some field."""
    merged: dict[str, Any] = dict.fromkeys(_SIZE_FIELDS)
    used = []
    for label, s in sources:
        took = [f for f in _SIZE_FIELDS if merged[f] is None and getattr(s, f) is not None]
        for f in took:
            merged[f] = getattr(s, f)
        if took:
            used.append(label)
    return Sizes(**merged), used


def _labelled_group(call: Call, group: GroupInfo, ctx: TraceContext) -> tuple[GroupInfo, tuple[str, ...]]:
    """A `commlens:<dim>:<pg>` range gives the group when metadata does not, and its mesh dimension."""
    lab = call.label
    if lab is None:
        return group, ()
    notes: tuple[str, ...] = ()
    if group.key is None:
        group = GroupInfo.named(lab.pg, ctx)
    elif group.name != lab.pg:
        notes = (f"a call labelled commlens:{lab.dim}:{lab.pg} names process group {group.name!r}: using the latter",)
    if group.key == f"pg:{lab.pg}":
        group = replace(group, mesh_dim=lab.dim)
    return group, notes


def _named_by_argument(call: Call, group: GroupInfo, ctx: TraceContext) -> GroupInfo:
    """A symmetric-memory op or a framework wrapper takes its group's name as a string argument
    (`Concrete Inputs`): the group when metadata names none and pg_config knows that name."""
    if group.key is not None:
        return group
    for ev in call.members:
        if ev.kind != "container" or ev.name.split("::", 1)[0] not in _NAMED_GROUP_NAMESPACES:
            continue
        conc = ev.args.get("Concrete Inputs")
        if not isinstance(conc, list):
            continue
        name = next((c for c in conc if isinstance(c, str) and c in ctx.groups), None)
        if name is not None:
            return GroupInfo.named(name, ctx)
    return group


_NAMED_GROUP_NAMESPACES = WRAPPER_NAMESPACES | {SYMM_MEM_NAMESPACE}


def _sole_group(group: GroupInfo, ctx: TraceContext) -> GroupInfo:
    """A call of unknown group in a job whose pg_config lists a single group is on that group."""
    if group.key is None and ctx.complete_groups and len(ctx.groups) == 1:
        return GroupInfo.named(next(iter(ctx.groups)), ctx)
    return group


def _uniform_group_size(ctx: TraceContext) -> int | None:
    """The size every group of a complete pg_config has, when they all have one and the same."""
    if not ctx.complete_groups:
        return None
    sizes = {g.get("size") for g in ctx.groups.values()}
    return sizes.pop() if len(sizes) == 1 and None not in sizes else None


def _msg_bytes(op: str, size: Sizes, gsize: int | None) -> int | None:
    es = DTYPE_BYTES.get(size.dtype) if size.dtype else None
    s_elems = _s_elems(op, size, gsize)
    return s_elems * es if (s_elems is not None and es is not None) else None


def _raw_name(call: Call, op: str) -> str:
    """The source's name of the call: the symmetric-memory op when one ran it (so the store says which
    backend moved the data), else the outermost op of this collective."""
    for ev in call.members:
        if ev.backend == SYMM_MEM_NAMESPACE:
            return ev.name
    for ev in call.members:
        if ev.kind == "container" and ev.name != "record_param_comms" and ev.op == op:
            return ev.name
    for ev in call.members:
        if ev.name == "record_param_comms" and ev.op == op:
            return str(ev.args.get("Collective name"))
    for ev in call.members:
        if ev.kind == "annot":
            return ev.name
    if call.kernels:
        return call.kernels[0].name.split("(", 1)[0]
    return call.members[0].name if call.members else op


def _annot_sizes(op: str, n: int | None, dtype: str | None) -> Sizes:
    """Annotation dims are the input tensor's."""
    if op in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return Sizes(n, None, dtype)
    return Sizes(n, n, dtype)


def _derived_group_size(op: str, s: Sizes) -> int | None:
    """all_gather out = in x n, reduce_scatter in = out x n: the group size follows from both counts."""
    a, b = (s.elems_out, s.elems_in) if op == "all_gather" else (s.elems_in, s.elems_out)
    if op in ("all_gather", "reduce_scatter") and a and b and a % b == 0:
        return a // b
    return None


def _with_derived(op: str, s: Sizes, n: int | None) -> Sizes:
    """The count all_gather / reduce_scatter lack, from the other one and the group size n."""
    if not n:
        return s
    if op == "all_gather" and s.elems_out is None and s.elems_in is not None:
        return replace(s, elems_out=s.elems_in * n)
    if op == "reduce_scatter" and s.elems_in is None and s.elems_out is not None:
        return replace(s, elems_in=s.elems_out * n)
    if op == "reduce_scatter" and s.elems_out is None and s.elems_in is not None and s.elems_in % n == 0:
        return replace(s, elems_out=s.elems_in // n)
    return s


def _s_elems(op: str, s: Sizes, n: int | None) -> int | None:
    """Elements of the nccl-tests size S (formats.md A.3/B.5)."""
    ein, eout = s.elems_in, s.elems_out
    if op == "all_to_all":
        return ein if ein is not None else eout
    if op == "all_gather":
        return eout if eout is not None else (ein * n if ein is not None and n else None)
    if op == "reduce_scatter":
        return ein if ein is not None else (eout * n if eout is not None and n else None)
    if op == "gather":
        return ein * n if ein is not None and n else None
    if op == "scatter":
        return eout * n if eout is not None and n else None
    if ein is None and eout is None:
        return None
    return max(ein or 0, eout or 0)


def _timing(call: Call, ctx: TraceContext) -> tuple[float | None, float | None, str | None]:
    """(ts, dur, source): the NCCL kernels' span, else gloo's measured CPU time, else no duration."""
    if call.kernels:
        start = min(k.ts for k in call.kernels)
        # offsets from the first start keep the kernels' own precision (ts ~ 1e12 µs would not)
        return start, max((k.ts - start) + k.dur for k in call.kernels), "kernel"
    root = call.root
    backend = _backend(call, ctx)
    if call.worker is not None and call.worker.args.get("finished") is not False:
        return call.worker.ts, call.worker.dur, "cpu_op"  # gloo's own measured time of the work
    if root is None:
        return None, None, None
    if backend == "gloo":
        # gloo's P2P annotation on the caller's thread outlives the op that started it: it ends when the
        # transfer does (a pipeline stage's recv waits there for its peer), the op's own span is the enqueue
        later = [ev for ev in call.members if ev.kind == "annot" and ev.ts + ev.dur > root.ts + root.dur]
        if later:
            end = max(ev.ts + ev.dur for ev in later)
            return root.ts, end - root.ts, "cpu_op"
        return root.ts, root.dur, "cpu_op"
    return root.ts, None, None  # NCCL (or unknown) CPU time is only the enqueue


def _backend(call: Call, ctx: TraceContext) -> str | None:
    for ev in call.members:
        if ev.kind == "annot" and ev.backend:
            return ev.backend
    b = (ctx.backend or "").lower()
    if "nccl" in b:
        return "nccl"
    if "gloo" in b:
        return "gloo"
    return None


def _peer(call: Call, op: str, group: GroupInfo, ctx: TraceContext) -> tuple[int | None, str | None]:
    """The peer's global rank: Src/Dst Rank; else the group rank (metadata Rank or the c10d argument)
    mapped through the group's ranks; else the group rank itself, with a warning."""
    field_name: Field = "dst_rank" if op == "send" else "src_rank"
    metas = [ev.args for ev in call.members if ev.name == "record_param_comms"]
    global_rank = next((g for args in metas if (g := as_int(meta(args, field_name))) is not None), None)
    if global_rank is None:
        global_rank = next((g for k in call.kernels if (g := as_int(meta(k.args, field_name))) is not None), None)
    if global_rank is not None:
        return global_rank, None
    group_rank = _meta_group_rank(metas)
    if group_rank is None:
        group_rank = _c10d_group_rank(call)
    if group_rank is None:
        return None, None
    ranks = group.ranks
    if ranks is None and ctx.complete_groups and len(ctx.groups) == 1:
        ranks = next(iter(ctx.groups.values())).get("ranks")
    if ranks and 0 <= group_rank < len(ranks):
        return ranks[group_rank], None
    return group_rank, "send/recv peers are group ranks: the trace does not tell the process group of those calls"


def _meta_group_rank(metas: list[dict[str, Any]]) -> int | None:
    """The first metadata `Rank` (for send/recv, the peer's rank in the group)."""
    return next((r for args in metas if (r := as_int(meta(args, "rank"))) is not None), None)


def _c10d_group_rank(call: Call) -> int | None:
    """The peer's group rank as the c10d send/recv op's third argument."""
    for ev in call.members:
        if ev.kind == "container" and ev.name.startswith("c10d::"):
            conc = ev.args.get("Concrete Inputs")
            if isinstance(conc, list) and len(conc) > 2:
                return as_int(conc[2])
    return None


def step_of(steps: list[tuple[float, float, int]], ts: float | None) -> int | None:
    """The ProfilerStep whose interval contains ts (steps sorted by start)."""
    if ts is None or not steps:
        return None
    i = bisect.bisect_right([s[0] for s in steps], ts + EPS) - 1
    if i >= 0 and ts <= steps[i][0] + steps[i][1] + EPS:
        return steps[i][2]
    return None
