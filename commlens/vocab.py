"""The one vocabulary of commlens: op names, dtype names and sizes, message-size convention.

Every ingester maps its source names onto these; the store, analysis, API and UI use nothing else.
How each source maps onto them: docs/formats.md (A.3, A.4, B.4, B.5); S in the predictor: docs/models.md §3.
"""

from __future__ import annotations

import re
from typing import Literal, get_args

Op = Literal[
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "all_to_all",
    "gather",
    "scatter",
    "send",
    "recv",
    "barrier",
]
OPS: tuple[str, ...] = get_args(Op)

# The parallelism dimension a collective serves; "other" when it serves none of them.
Scheme = Literal["dp", "tp", "pp", "cp", "ep", "other"]
SCHEMES: tuple[str, ...] = get_args(Scheme)

P2P_OPS = frozenset({"send", "recv"})

# Element sizes in bytes of the commlens dtype names.
DTYPE_BYTES: dict[str, int] = {
    "bool": 1,
    "int8": 1,
    "uint8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,  # ROCm (MI300) fp8
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,  # MX scales (torch 2.7+)
    "float4_e2m1fn_x2": 1,  # two fp4 values per element
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
}

# ncclDataType_t values (src/nccl.h.in).
NCCL_DTYPES: dict[int, str] = {
    0: "int8",
    1: "uint8",
    2: "int32",
    3: "uint32",
    4: "int64",
    5: "uint64",
    6: "float16",
    7: "float32",
    8: "float64",
    9: "bfloat16",
    10: "float8_e4m3fn",
    11: "float8_e5m2",
}

# c10 ScalarType names as written in record_param_comms "dtype".
C10_DTYPES: dict[str, str] = {
    "Float": "float32",
    "BFloat16": "bfloat16",
    "Half": "float16",
    "Double": "float64",
    "Long": "int64",
    "Int": "int32",
    "Short": "int16",
    "Char": "int8",
    "Byte": "uint8",
    "Bool": "bool",
    "Float8_e4m3fn": "float8_e4m3fn",
    "Float8_e5m2": "float8_e5m2",
    "Float8_e4m3fnuz": "float8_e4m3fnuz",
    "Float8_e5m2fnuz": "float8_e5m2fnuz",
    "Float8_e8m0fnu": "float8_e8m0fnu",
    "Float4_e2m1fn_x2": "float4_e2m1fn_x2",
    "ComplexHalf": "complex32",
    "ComplexFloat": "complex64",
    "ComplexDouble": "complex128",
    "UInt16": "uint16",
    "UInt32": "uint32",
    "UInt64": "uint64",
}

# C++ type names as written in Kineto "Input type".
CPP_DTYPES: dict[str, str] = {
    "float": "float32",
    "double": "float64",
    "c10::Half": "float16",
    "c10::BFloat16": "bfloat16",
    "long int": "int64",
    "long": "int64",
    "int64_t": "int64",
    "int": "int32",
    "short int": "int16",
    "short": "int16",
    "signed char": "int8",
    "unsigned char": "uint8",
    "bool": "bool",
    "c10::Float8_e4m3fn": "float8_e4m3fn",
    "c10::Float8_e5m2": "float8_e5m2",
    "c10::Float8_e4m3fnuz": "float8_e4m3fnuz",
    "c10::Float8_e5m2fnuz": "float8_e5m2fnuz",
    "c10::Float8_e8m0fnu": "float8_e8m0fnu",
    "unsigned short": "uint16",
    "uint16_t": "uint16",
    "c10::complex<c10::Half>": "complex32",
    "c10::complex<float>": "complex64",
    "c10::complex<double>": "complex128",
}

# Source op names -> commlens op. Keys are lower-cased and stripped of namespaces/underscores by
# `normalize_op`, so "AllReduce", "allreduce", "c10d::allreduce_", "nccl:all_reduce",
# "gloo:all_reduce" and "_allgather_base" all land on one key.
_OP_ALIASES: dict[str, str] = {
    "allreduce": "all_reduce",
    "allreducecoalesced": "all_reduce",
    "allreducesparse": "all_reduce",
    "allgather": "all_gather",
    "allgatherbase": "all_gather",
    "allgatherintotensor": "all_gather",
    "allgatherintotensorcoalesced": "all_gather",
    "allgathercoalesced": "all_gather",
    "allgathertogether": "all_gather",
    "reducescatter": "reduce_scatter",
    "reducescatterbase": "reduce_scatter",
    "reducescattertensor": "reduce_scatter",
    "reducescattertensorcoalesced": "reduce_scatter",
    "broadcast": "broadcast",
    "bcast": "broadcast",
    "reduce": "reduce",
    "alltoall": "all_to_all",
    "alltoallbase": "all_to_all",
    "alltoallv": "all_to_all",
    "alltoallsingle": "all_to_all",
    "gather": "gather",
    "scatter": "scatter",
    "send": "send",
    "recv": "recv",
    "recvanysource": "recv",
    "barrier": "barrier",
    "monitoredbarrier": "barrier",
    # PyTorch symmetric-memory collectives (`symm_mem::*`, torch 2.5+), which bypass NCCL
    "multimemallreduce": "all_reduce",
    "multimemoneshotallreduce": "all_reduce",
    "multimemoneshotallreduceout": "all_reduce",
    "oneshotallreduce": "all_reduce",
    "oneshotallreduceout": "all_reduce",
    "oneshotallreducecopy": "all_reduce",
    "oneshotallreducecopyout": "all_reduce",
    "twoshotallreduce": "all_reduce",
    "twoshotallreduceout": "all_reduce",
    "multimemoneshotreduceout": "reduce",
    "multimemallgatherout": "all_gather",
    "lowcontentionallgather": "all_gather",
    "reducescatterout": "reduce_scatter",
    "lowcontentionreducescatter": "reduce_scatter",
    "alltoallvdev": "all_to_all",
    "alltoallvdevd": "all_to_all",
    "alltoallvdevdoffset": "all_to_all",
}

# Namespaces of profiler op names counted as collectives besides c10d: PyTorch symmetric memory (its
# own backend) and framework wrappers whose op describes the call made inside it (counted once).
SYMM_MEM_NAMESPACE = "symm_mem"
WRAPPER_NAMESPACES: frozenset[str] = frozenset({"vllm"})
# An op name that looks like a collective (warned about when no rule above understands it).
COLLECTIVE_LIKE = re.compile(r"all_?reduce|all_?gather|reduce_?scatter|all_?to_?all", re.IGNORECASE)

_STRIP = re.compile(r"[^a-z]")


def normalize_op(name: str) -> str | None:
    """Map a source op name to the commlens op, or None when it is not a communication op.

    >>> normalize_op("c10d::_allgather_base_"), normalize_op("AllReduce"), normalize_op("nccl:all_to_all")
    ('all_gather', 'all_reduce', 'all_to_all')
    """
    base = name.rsplit("::", 1)[-1].rsplit(":", 1)[-1].lower()
    return _OP_ALIASES.get(_STRIP.sub("", base))


def dtype_size(dtype: str | None) -> int | None:
    return DTYPE_BYTES.get(dtype) if dtype else None


def msg_bytes_from_nccl_count(op: str, count: int, elem_size: int, nranks: int) -> int:
    """S (nccl-tests size) from the `count` of an NCCL COLL line (formats.md A.3)."""
    if op in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return count * nranks * elem_size
    return count * elem_size


def msg_bytes_from_nelems(elems_in: int | None, elems_out: int | None, elem_size: int) -> int:
    """S from Kineto In/Out msg nelems: max(In, Out) x element size (formats.md B.5)."""
    return max(elems_in or 0, elems_out or 0) * elem_size


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests bus-bandwidth factor for an op in a group of n ranks (docs/models.md §4, §7)."""
    if n <= 1:
        return 0.0 if op not in ("send", "recv", "broadcast", "reduce") else 1.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return (n - 1) / n
    return 1.0


BYTE_UNITS: tuple[str, ...] = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def format_bytes(n: float | None) -> str:
    """A byte count in binary units, the one spelling of sizes in reports, the CLI and the UI.

    Three significant digits, whole from 100 up (so no exponent ever shows: 1023.9 KiB is '1024 KiB');
    exact values next to it are the caller's choice. '-' for a missing value.

    >>> format_bytes(1024), format_bytes(1536), format_bytes(120_320), format_bytes(3), format_bytes(None)
    ('1 KiB', '1.5 KiB', '118 KiB', '3 B', '-')
    """
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    value = abs(float(n))
    unit = 0
    while value >= 1024 and unit < len(BYTE_UNITS) - 1:
        value /= 1024
        unit += 1
    digits = ".0f" if value >= 100 or value == int(value) else ".3g"
    return f"{sign}{value:{digits}} {BYTE_UNITS[unit]}"


# A CSV cell a spreadsheet would run as a formula starts with one of these (OWASP "CSV injection").
FORMULA_PREFIXES = ("=", "+", "-", "@", "\t", "\r")


def csv_text(value: str) -> str:
    """A text cell of a CSV meant for spreadsheets: one a spreadsheet would evaluate (a file named
    '=HYPERLINK(...).log') gets a leading apostrophe, which spreadsheets show as text."""
    return "'" + value if value.startswith(FORMULA_PREFIXES) else value


def evidence_key(key: str) -> str:
    """A finding's evidence key as shown beside its text, which carries the unit ('mean_step_us' is shown
    '102 ms'): the key without its unit suffix."""
    for suffix in ("_us", "_gbps"):
        if key.endswith(suffix):
            return key.removesuffix(suffix)
    return key
