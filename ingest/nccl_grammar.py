"""The grammar of NCCL debug logs: line patterns, the classification of init/topology/tuning messages,
and the tables that name algorithms, protocols and per-op element factors (docs/formats.md section A).
Nothing here keeps state; `nccl_log` reads a log with it."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

# NCCL COLL names that are not two-sided collectives commlens counts (one-sided ops, 2.29+).
ONE_SIDED = frozenset({"PutSignal", "Signal", "WaitSignal"})
# RCCL names a COLL line after the path that runs the call (formats.md A.2): its MSCCL path prints
# `mscclFuncAllReduce` (ROCm 6.1+), its MSCCL++ path `mscclpp_ncclAllReduce` (ROCm 6.3+). The MSCCL line
# prints root 0 for Send/Recv (the peer is another argument, not printed); its AllToAllv prints count 0.
MSCCL_PREFIX = "mscclFunc"
MSCCLPP_PREFIX = "mscclpp_nccl"
MSCCL_ALLTOALLV = "mscclFuncAllToAllv"

ALGOS = {0: "TREE", 1: "RING", 2: "COLLNET_DIRECT", 3: "COLLNET_CHAIN", 4: "NVLS", 5: "NVLS_TREE", 6: "PAT"}
PROTOS = {0: "LL", 1: "LL128", 2: "SIMPLE"}
ALGO_NAMES = {
    "tree": "TREE",
    "ring": "RING",
    "collnet": "COLLNET_DIRECT",
    "collnetdirect": "COLLNET_DIRECT",
    "collnetchain": "COLLNET_CHAIN",
    "nvls": "NVLS",
    "nvlstree": "NVLS_TREE",
    "pat": "PAT",
}
PROTO_NAMES = {"ll": "LL", "ll128": "LL128", "simple": "SIMPLE"}

# ------------------------------------------------------------------------------------------ patterns

# Every pattern used with search/finditer starts with a literal or a lookbehind that fails inside a run of
# its first character class, so scanning a long line stays linear.

# Fast path over a block of lines: either a clean COLL line (foreign prefix allowed) or any line.
# Groups: prefix, "host:pid:tid [dev] NCCL INFO Name", opCount, count, "dt op r root p comm c [nranks=n]",
# trailing text, other line. The lookbehind keeps the scan linear on long words.
FAST = re.compile(
    rb"(?m)^(?:([^\n]*?)(?<![\w.-])([\w.-]+:\d+:\d+ \[-?\d+\] NCCL INFO (?:mscclpp_)?[A-Za-z]+): opCount ([0-9a-fA-F]+) "
    rb"sendbuff \S+ recvbuff \S+ count (\d+) datatype (\d+ op \d+ root -?\d+ comm \S+ \[nranks=\d+\]) "
    rb"stream \S+([^\n]*)|([^\n]*))$"
)
FAST_HEAD = re.compile(r"(.+):(\d+):\d+ \[(-?\d+)\] NCCL INFO ((?:mscclpp_)?[A-Za-z]+)")
FAST_TAIL = re.compile(r"(\d+) op (\d+) root (-?\d+) comm (\S+) \[nranks=(\d+)\]", re.ASCII)
# The parts of a COLL line the vectorised path checks once per distinct value (`nccl_vector.clean_coll`):
# the text before ": opCount " (prefix and head) and the eight words from the datatype to "[nranks=N]".
# Each is the corresponding part of `FAST`, with the same groups.
PIECE_HEAD = re.compile(rb"([^\n]*?)(?<![\w.-])([\w.-]+:\d+:\d+ \[-?\d+\] NCCL INFO (?:mscclpp_)?[A-Za-z]+)")
PIECE_TAIL = re.compile(rb"\d+ op \d+ root -?\d+ comm \S+ \[nranks=\d+\]")

# A WARN names its source line, `file:line `, from 2.30.7 followed by the function, `(func) `.
ENVELOPE = re.compile(
    r"(?<![\w.-])([\w.-]+):(\d+):(\d+) \[(-?\d+)\] (?:\S+:\d+ (?:\(\S+\) )?)?NCCL (INFO|WARN)(?= |$) ?"
)
FALLBACK = re.compile(r"\[(-?\d+)\] (?:\S+:\d+ (?:\(\S+\) )?)?NCCL (INFO|WARN)(?= |$) ?")
# "NCCL INFO <message>" at the start of a line (after Markdown quoting) with no envelope at all: a paste
# that kept only the level.
BARE = re.compile(r"^[\s>]*NCCL (INFO|WARN)(?= |$) ?")
# Everything a call needs comes before `stream`: a line wrapped after `stream`, cut before it or printed
# without it still counts. RCCL (ROCm 6+) adds `acc <ptr>` before `count` and `task N globalrank N` after.
COLL = re.compile(
    r"(?<![A-Za-z])((?:mscclpp_)?[A-Za-z]+): opCount ([0-9a-fA-F]+) sendbuff \S+ recvbuff \S+ (?:acc \S+ )?count (\d+) "
    r"datatype (\d+) op (\d+) root (-?\d+) comm (\S+) \[nranks=(\d+)\]"
)
COLL_HEAD = re.compile(r"(?<![A-Za-z])(?:mscclpp_)?[A-Za-z]+: opCount ")
VERSION = re.compile(r"\b([NR]CCL) version (?:: )?(\d+\.\d+\.\d+[^\s+]*)(?:\+(\S+))?")
BARE_VERSION = re.compile(r"(?:^|[\s>\]):])([NR]CCL) version (?:: )?(\d+\.\d+\.\d+[^\s+]*)(?:\+(\S+))?\s*$")
DRIVER = re.compile(r"cudaDriverVersion (\d+)")
INIT = re.compile(
    r"(?:\[Rank -?\d+\] )?(?:(\w+) )?comm (\S+) rank (-?\d+) nranks (\d+)((?: \S+ \S+)*?) ?- Init (START|COMPLETE)\s*$"
)
NODES = re.compile(
    r"comm (\S+) rank (-?\d+) nRanks (\d+) nNodes (\d+) localRanks (\d+) localRank (-?\d+)(?: MNNVL (\d+))?"
)
# 2.5+ "Channel 00/02 :    0   1"; 2.4 and older "Channel 00 :    0   1" (no ring count, padded with blanks).
RING = re.compile(r"Channel (\d+)(?:/(\d+))? :((?: +-?\d+)*)\s*$")
CONNECTION = re.compile(
    r"Channel (?P<ch>\d+)(?:/\d+)? : (?P<src>-?\d+)\[[0-9a-fA-F]+\] -> (?P<dst>-?\d+)\[[0-9a-fA-F]+\]"
    r"(?: \[(?:send|receive)\])? via (?P<via>.+?)\s*$"
)
# 2.3-2.4 connections: "Ring %02d : %d -> %d [send] via NET/%s/%d%s" (no bus ids; P2P and SHM without [send]).
RING_CONNECTION = re.compile(
    r"Ring (?P<ch>\d+) : (?P<src>-?\d+) -> (?P<dst>-?\d+)(?: \[(?:send|receive)\])? via (?P<via>.+?)\s*$"
)
CONN_COMM = re.compile(r" comm (0x[0-9a-fA-F]+) nRanks (\d+)$")
TREE_CHANNEL = re.compile(r"\[(\d+)\] (-?\d+)/(-?\d+)/(-?\d+)->(-?\d+)->(-?\d+)(\|\S+)?")
# 2.4: " [%d] %d->%d->%d/%d/%d" (parent -> this rank -> children).
TREE_CHANNEL_24 = re.compile(r"\[(\d+)\] (-?\d+)->(-?\d+)->(-?\d+)/(-?\d+)/(-?\d+)(?![\d/>-])")
NVLS_TREE = re.compile(r"(?<![\d-])(-?\d+)/(-?\d+)/(-?\d+)->(-?\d+)->(-?\d+)")
NVLS_HEAD = re.compile(r"NVLS Head +(\d+):((?: +-?\d+)*)\s*$")
CHANNELS = re.compile(
    r"(\d+) coll channels, (?:(\d+) collnet channels, )?(?:(\d+) nvls channels, )?(\d+) p2p channels, "
    r"(\d+) p2p channels per peer"
)
TUNING = re.compile(
    r"(?:([A-Za-z]+): )?(\d+) Bytes -> Algo (\w+) proto (\w+)"
    r"(?: time (\S+))?(?: channel\{Lo\.\.Hi\}=\{(-?\d+)\.\.(-?\d+)\})?"
)


def coll_name(name: str) -> tuple[str | None, bool]:
    """The NCCL op name of a COLL line's name and whether its `root` is the Send/Recv peer; None for a
    call whose line carries no size (RCCL's MSCCL AllToAllv)."""
    if name.startswith(MSCCL_PREFIX):
        return (None if name == MSCCL_ALLTOALLV else name[len(MSCCL_PREFIX) :]), False
    if name.startswith(MSCCLPP_PREFIX):
        return name[len(MSCCLPP_PREFIX) :], False
    return name, True


def elem_factors(op: str, nranks: int) -> tuple[int, int]:
    """(elems_in, elems_out) per unit of the COLL `count` (formats.md A.3)."""
    if op in ("all_gather", "gather"):
        return 1, nranks
    if op in ("reduce_scatter", "scatter"):
        return nranks, 1
    if op == "all_to_all":
        return nranks, nranks
    return 1, 1


def algo_name(s: str) -> str:
    if s.isdigit():
        return ALGOS.get(int(s), s)
    return ALGO_NAMES.get(s.replace("_", "").lower(), s)


def proto_name(s: str) -> str:
    if s.isdigit():
        return PROTOS.get(int(s), s)
    return PROTO_NAMES.get(s.lower(), s)


# The kind of a message `classify` tells apart, with the match that carries its fields.
Classified = tuple[str, re.Match[str] | None]


def classify(msg: str) -> Classified | None:
    """The kind of an init, topology or tuning message (text after the envelope), or None. A message that
    starts like one kind but does not match it is none (it is not tried as another)."""
    c = msg[:1]
    if c == "N" and ("NCCL version" in msg or "NVLS" in msg):
        return _classify_n(msg)
    if c == "R" and msg.startswith("RCCL version"):
        v = VERSION.search(msg)
        if v is not None:
            return "version", v
    if c == "c":
        for kind, pattern in (("driver", DRIVER), ("nodes", NODES)):
            m = pattern.match(msg)
            if m is not None:
                return kind, m
    if "- Init " in msg:  # 2.24-2.29 split START lines have no blank before the dash: "key 0- Init START"
        return _matched("init", INIT.match(msg))
    if c == "C" and msg.startswith("Channel "):
        if "->" not in msg:
            return _matched("ring", RING.match(msg))
        return _matched("connection", CONNECTION.match(msg))
    if c == "R" and msg.startswith("Ring ") and " via " in msg:
        return _matched("connection", RING_CONNECTION.match(msg))
    if c == "T" and msg.startswith("Trees"):
        return "trees", None
    if " Bytes -> Algo " in msg:
        t = TUNING.match(msg)
        if t is not None:
            return "tuning", t
    if " coll channels, " in msg and CHANNELS.match(msg):
        return "channels", None
    return None


def _classify_n(msg: str) -> Classified | None:
    v = VERSION.search(msg)
    if v is not None:
        return "version", v
    if msg.startswith("NVLS Trees"):
        return "nvls_trees", None
    return _matched("nvls_head", NVLS_HEAD.match(msg))


def _matched(kind: str, m: re.Match[str] | None) -> Classified | None:
    return (kind, m) if m is not None else None


def _comm_id(v: str) -> str | None:
    return v.lower() if int(v, 16) != 0 else None  # 0x0: no commId


# Init line fields after "nranks N": nccl_comms column and how the value reads (None: leave the column).
INIT_FIELDS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "cudaDev": ("cuda_dev", int),
    "nvmlDev": ("nvml_dev", int),
    "busId": ("bus_id", str.lower),
    "commId": ("comm_id", _comm_id),
    "parent": ("parent_ptr", str),
    "color": ("color", int),
    "key": ("split_key", int),
    "splitCount": ("_split_count", int),
    "childCount": ("_split_count", int),
}


def init_fields(rest: str) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """The columns of an Init line's "key value" pairs, and the pairs whose value does not read."""
    toks = rest.split()
    values: dict[str, Any] = {}
    unreadable = []
    for k, v in zip(toks[::2], toks[1::2], strict=False):  # a last key without value is ignored
        column, read = INIT_FIELDS.get(k, ("", str))
        if not column:
            continue
        try:
            value = read(v)
        except ValueError:
            unreadable.append((k, v))
            continue
        if value is not None:
            values[column] = value
    return values, unreadable
