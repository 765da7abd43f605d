"""The formats commlens reads, declared once each: kind name, detection from the first bytes, parser, and
the traits that the ingest rules ask about instead of naming kinds.

A format is one `Format` entry in `FORMATS` plus its parser: detection, the pipeline's choice of parser,
the same-rank trace check, the trace-supersedes-log rule, communicator linking and the API's upload check
all read this table. Detection is a vote: each format claims the head of a file as SURE (its own marker
is there) or FALLBACK (the family fits, e.g. some JSON; the parser then says precisely why it is not
one); the strongest claim wins, ties go to the earlier entry.
"""

from __future__ import annotations

import enum
import io
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .flight_recorder import PICKLE_PROTOCOLS, parse_flight_recorder
from .inputs import ZIP_MAGIC, Limits, open_content
from .inspector import parse_inspector
from .kineto import parse_kineto
from .nccl_log import parse_nccl_log
from .nsys_sqlite import SQLITE_MAGIC, parse_nsys_sqlite
from .records import ParseError, ParseResult, RankHint
from .run_json_parser import parse_run_config

Parser = Callable[[io.BufferedReader, str, RankHint, Limits], ParseResult]

HEAD_BYTES = 1 << 16  # what detection looks at
_ZIP_EMPTY = b"PK\x05\x06"
_TAR_MAGIC_AT = slice(257, 262)


class Claim(enum.IntEnum):
    """How strongly a format claims a file's head."""

    NONE = 0
    FALLBACK = 1  # the right family; taken when no format is sure
    SURE = 2


class Trait(enum.Flag):
    """What the ingest rules need to know about a format."""

    NONE = 0
    # Per-rank trace with timed, step-windowed calls: a second trace of a rank whose steps (or time span)
    # overlap one already in the run would count its calls twice, so it is refused.
    PER_RANK_TIMED_TRACE = enum.auto()
    # A log whose calls of a rank stop counting when a PER_RANK_TIMED_TRACE of that rank is in the run
    # (the trace has the steps and the device durations).
    SUPERSEDED_BY_TRACE = enum.auto()
    # Calls of a rank that also stop counting when an NCCL log (a SUPERSEDED_BY_TRACE format without this
    # trait) describes that rank: Inspector records and Flight Recorder entries repeat the log's calls.
    SUPERSEDED_BY_LOG = enum.auto()
    # Its events name communicators by per-process pointers, grouped across the run by `nccl_link`.
    NCCL_COMMUNICATORS = enum.auto()
    # Detected only to be refused by name: a file people mistake for an input (sources.kind says what it is).
    REFUSED = enum.auto()


@dataclass(frozen=True)
class Format:
    kind: str  # sources.kind and ParseResult.kind
    description: str  # "a Kineto JSON trace": used in messages about files that are none of these
    claim: Callable[[bytes], Claim]
    parse: Parser
    traits: Trait = Trait.NONE

    def has(self, trait: Trait) -> bool:
        return trait in self.traits


# ------------------------------------------------------------------------------------------ claims


# What a log line's '[' opens where a launcher or NCCL prefixes it: torchrun's "[rank0]:" / "[default0]:",
# mpirun --tag-output's "[1,0]<stdout>:", NCCL 2.26+'s "[2025-03-01 10:00:00] " before a WARN.
_LOG_MARKERS = (b"NCCL INFO", b"NCCL WARN", b"NCCL version", b"RCCL version")


def _json_text(head: bytes) -> bytes | None:
    """The head without BOM and leading blanks when it starts like JSON, else None. An object starts JSON; a
    '[' does when an object, array, string or its end follows (a trace written as a bare array of events),
    or anything else in a head without NCCL log lines, whose '[' opens a launcher's or NCCL's own prefix."""
    text = head.lstrip(b"\xef\xbb\xbf").lstrip()
    if text[:1] == b"{":
        return text
    if text[:1] != b"[":
        return None
    if text[1:].lstrip()[:1] in (b"{", b"[", b"]", b'"', b""):
        return text
    return None if any(m in head for m in _LOG_MARKERS) else text


def _claims_kineto(head: bytes) -> Claim:
    if _json_text(head) is None:
        return Claim.NONE
    if b'"traceEvents"' in head:
        return Claim.SURE  # invalid UTF-8 further on is the parser's to name, at its event
    # A '{' or '[' then binary is not JSON: about one random file in 128 starts with one of them.
    return Claim.NONE if _mostly_binary(head) else Claim.FALLBACK


def _claims_run_config(head: bytes) -> Claim:
    if _json_text(head) is not None and (b'"commlens.run' in head or b'"commlens_run' in head):
        return Claim.SURE
    return Claim.NONE


def _claims_nccl_log(head: bytes) -> Claim:
    if _json_text(head) is not None:
        return Claim.NONE
    if any(m in head for m in _LOG_MARKERS):
        return Claim.SURE
    if b"\x00" in head or _mostly_binary(head):
        return Claim.NONE
    # Text without NCCL lines up front: a launcher's stdout may print for megabytes before NCCL starts.
    # The NCCL parser reads all of it and fails the file when no line anywhere is an NCCL one.
    return Claim.FALLBACK


# PyTorch's ExecutionTraceObserver writes `{"schema": "1.0.1", "pid": .., "time": .., "start_ts": .., "nodes": [`
# (schema "1.0.2-chakra.0.0.4" and later from PyTorch 2.1; 1.1.1-chakra.0.0.4 today).
_ET_SCHEMA = re.compile(rb'"schema"\s*:\s*"([^"\\]{1,64})"')
# Chakra's protobuf trace (.et) starts with a varint length and its GlobalMetadata: field 1, the version string.
_CHAKRA_HEAD = re.compile(rb"^(?:[\x01-\x7f]|[\x80-\xff][\x01-\x7f])\x0a([\x03-\x20])(\d{1,4}\.\d{1,4}\.\d{1,4})")
_NOT_A_PROFILER_TRACE = (
    "not a profiler trace: it describes the operator graph, without the per-rank device times and collective "
    "sizes commlens counts; record a torch.profiler (Kineto) trace or an NCCL_DEBUG=INFO log of the same steps"
)


def _et_schema(head: bytes) -> str | None:
    """The schema of a PyTorch execution trace's head, else None (a run.json has a schema but no nodes)."""
    if _json_text(head) is None or b'"nodes"' not in head:
        return None
    m = _ET_SCHEMA.search(head)
    return m.group(1).decode() if m and not m.group(1).startswith(b"commlens") else None


def _chakra_version(head: bytes) -> str | None:
    m = _CHAKRA_HEAD.match(head)
    return m.group(2).decode() if m and len(m.group(2)) == m.group(1)[0] else None


def _claims_execution_trace(head: bytes) -> Claim:
    return Claim.SURE if _et_schema(head) is not None else Claim.NONE


def _claims_chakra(head: bytes) -> Claim:
    return Claim.SURE if _chakra_version(head) is not None else Claim.NONE


def _refuse_execution_trace(stream: io.BufferedReader, name: str, hint: RankHint, limits: Limits) -> ParseResult:
    schema = _et_schema(stream.peek(HEAD_BYTES)[:HEAD_BYTES])
    raise ParseError(f"a PyTorch execution trace (schema {schema}), {_NOT_A_PROFILER_TRACE}", "$.schema")


def _refuse_chakra(stream: io.BufferedReader, name: str, hint: RankHint, limits: Limits) -> ParseResult:
    version = _chakra_version(stream.peek(HEAD_BYTES)[:HEAD_BYTES])
    raise ParseError(f"a Chakra execution trace (protobuf, version {version}), {_NOT_A_PROFILER_TRACE}", "byte 0")


def _claims_inspector(head: bytes) -> Claim:
    """NCCL Inspector JSON lines: every record carries its format version (the plugin names files *.log)."""
    text = _json_text(head)
    if text is None or not text.startswith(b"{"):
        return Claim.NONE
    return Claim.SURE if b'"inspector_output_format_version"' in head and b'"header"' in head else Claim.NONE


# NCCL_INSPECTOR_PROM_DUMP=1 writes Prometheus gauges per communicator, collective and size bucket.
_INSPECTOR_PROM = re.compile(
    rb"^nccl_(?:p2p_)?(?:bus_bandwidth_gbs|collective_exec_time_microseconds|p2p_exec_time_microseconds)\{", re.M
)


def _claims_inspector_prom(head: bytes) -> Claim:
    return Claim.SURE if _INSPECTOR_PROM.search(head) else Claim.NONE


def _refuse_inspector_prom(stream: io.BufferedReader, name: str, hint: RankHint, limits: Limits) -> ParseResult:
    raise ParseError(
        "NCCL Inspector Prometheus output (NCCL_INSPECTOR_PROM_DUMP=1): bandwidth and time per communicator and "
        "size bucket, without call counts, so no call can be counted from it; record the JSON output "
        "(NCCL_INSPECTOR_PROM_DUMP=0, the default) instead",
        "line 1",
    )


def _claims_flight_recorder(head: bytes) -> Claim:
    """A Flight Recorder dump: JSON with its entry keys (or, for a dump of no entry, whose "entries" torch leaves
    out, its group keys), or any pickle (refused unless it is a plain dump)."""
    if head[:2] in PICKLE_PROTOCOLS:
        return Claim.SURE if _pickle_starts(head) else Claim.NONE
    if _json_text(head) is None:
        return Claim.NONE
    if b'"entries"' in head and (
        b'"comm_lib_version"' in head or b'"profiling_name"' in head or b'"pg_config"' in head
    ):
        return Claim.SURE
    return Claim.SURE if b'"pg_config"' in head and b'"pg_status"' in head else Claim.NONE


# Opcodes of pickle protocols 0-3 (pickletools.opcodes, one byte each): what may follow a protocol 2/3 header.
_PICKLE_OPCODES = frozenset(
    b"().012BCFGIJKLMNPQRSTUVX]abcdeghijlopqrstu}\x80\x81\x82\x83\x84\x85\x86\x87\x88\x89\x8a\x8b"
)


def _pickle_starts(head: bytes) -> bool:
    """Whether a pickle header is followed by what the pickler writes next: an opcode for protocols 2 and 3, a FRAME
    from 4 on (pickle leaves it out only below 4 bytes of payload, far less than any dump). Random bytes pass the
    two-byte header check once in 16,384 files; this leaves about one in 120,000."""
    if len(head) < 3:
        return False
    return head[2] == 0x95 if head[1] >= 4 else head[2] in _PICKLE_OPCODES


def _claims_sqlite(head: bytes) -> Claim:
    return Claim.SURE if head.startswith(SQLITE_MAGIC) else Claim.NONE


def _mostly_binary(head: bytes) -> bool:
    sample = head[:4096]
    try:
        sample.decode("utf-8")
        return False
    except UnicodeDecodeError as exc:
        return exc.start < len(sample) - 4  # a cut multi-byte char at the end is fine


# ------------------------------------------------------------------------------------------ the table

FORMATS: tuple[Format, ...] = (
    Format("kineto", "a Kineto JSON trace", _claims_kineto, parse_kineto, Trait.PER_RANK_TIMED_TRACE),
    Format("run_config", "a commlens run.json", _claims_run_config, parse_run_config),
    Format(
        "nccl_log",
        "an NCCL debug log",
        _claims_nccl_log,
        parse_nccl_log,
        Trait.SUPERSEDED_BY_TRACE | Trait.NCCL_COMMUNICATORS,
    ),
    Format(
        "nccl_inspector",
        "NCCL Inspector output",
        _claims_inspector,
        parse_inspector,
        Trait.SUPERSEDED_BY_TRACE | Trait.SUPERSEDED_BY_LOG | Trait.NCCL_COMMUNICATORS,
    ),
    Format(
        "nccl_inspector_prom",
        "NCCL Inspector Prometheus output",
        _claims_inspector_prom,
        _refuse_inspector_prom,
        Trait.REFUSED,
    ),
    Format(
        "flight_recorder",
        "a PyTorch Flight Recorder dump",
        _claims_flight_recorder,
        parse_flight_recorder,
        Trait.SUPERSEDED_BY_TRACE | Trait.SUPERSEDED_BY_LOG,
    ),
    Format(
        "nsys_sqlite",
        "an Nsight Systems SQLite export",
        _claims_sqlite,
        parse_nsys_sqlite,
        Trait.PER_RANK_TIMED_TRACE,
    ),
    Format("pytorch_et", "a PyTorch execution trace", _claims_execution_trace, _refuse_execution_trace, Trait.REFUSED),
    Format("chakra_et", "a Chakra execution trace", _claims_chakra, _refuse_chakra, Trait.REFUSED),
)


def get(kind: str) -> Format:
    """The format of a kind name; KeyError for a kind no format declares."""
    for fmt in FORMATS:
        if fmt.kind == kind:
            return fmt
    raise KeyError(kind)


def kinds_with(trait: Trait) -> list[str]:
    """Kind names of the formats with `trait`, for SQL over sources.kind (`list_contains(?, kind)`)."""
    return [f.kind for f in FORMATS if f.has(trait)]


def detect(stream: io.BufferedReader) -> Format:
    """The format of a content stream, from its first bytes (peeked, not consumed); ParseError for none."""
    head = stream.peek(HEAD_BYTES)[:HEAD_BYTES]
    if not head.strip():  # no line to name: the file has nothing in it
        raise ParseError("empty file" if not head else "only white space in its first bytes")
    best, claim = None, Claim.NONE
    for fmt in FORMATS:
        c = fmt.claim(head)
        if c > claim:
            best, claim = fmt, c
    if best is None:
        names = [f.description for f in FORMATS if not f.has(Trait.REFUSED)]
        raise ParseError(
            f"binary data, not {', '.join(names[:-1])} or {names[-1]} (first bytes {head[:8]!r})", "byte 0"
        )
    return best


def sniff_file(path: Path, limits: Limits) -> str:
    """'zip', 'tar' (also gzipped) or the format kind of a file on disk; ParseError when it is none of them.
    The API's upload check: archives are expanded later by the ingest walker."""
    with io.BufferedReader(io.FileIO(path), 1 << 20) as f:
        head = f.peek(512)[:512]
        if not head:
            raise ParseError("empty file")
        if head.startswith((ZIP_MAGIC, _ZIP_EMPTY)):
            return "zip"
        if head[_TAR_MAGIC_AT] == b"ustar":
            return "tar"
        stream = open_content(f, path.name, limits)
        if stream.peek(HEAD_BYTES)[_TAR_MAGIC_AT] == b"ustar":
            return "tar"  # .tar.gz
        return detect(stream).kind
