"""Read one input file: hash its bytes as they stream past, detect its format, parse it.

Parsing only: what the file holds and what went wrong, never the store. The ingest service
(`commlens.service.ingest`) decides what is written, skipped or recorded as failed."""

from __future__ import annotations

import contextlib
import hashlib
import io
from dataclasses import dataclass

from . import formats
from .inputs import DEFAULT_LIMITS, InputFile, Limits, TapReader, file_rank_hint, open_content
from .records import ParseError, ParseResult, RankHint, UnknownFormatError


@dataclass
class ParsedFile:
    """One file's parse: its result, or the error text that names the file and the place."""

    name: str
    kind: str | None  # the detected format; None when detection failed
    sha256: str  # of the bytes read (as read so far when the file failed)
    size: int
    result: ParseResult | None = None
    error: str | None = None
    # sha256 of the content, decompressed (the file's identity: x.log and x.log.gz are one file); None
    # when unknown (a failed file, a parser that closed its stream)
    content_sha256: str | None = None


class _Hash:
    """sha256 and size of the bytes a TapReader passes through."""

    def __init__(self) -> None:
        self.sha = hashlib.sha256()
        self.size = 0

    def __call__(self, data: memoryview) -> None:
        self.sha.update(data)
        self.size += len(data)


def parse_file(item: InputFile, hint: RankHint, limits: Limits = DEFAULT_LIMITS) -> ParsedFile:
    """Detect and parse one input file; never raises for a bad file (its error is in the answer)."""
    kind = None
    digest = _Hash()
    content_digest: _Hash | None = None
    hashing = TapReader(item.open_raw(), digest)
    try:
        raw = io.BufferedReader(hashing, 1 << 20)
        stream = open_content(raw, item.name, limits)
        if stream is not raw:  # gzip: the content is hashed as the parser reads it
            content_digest = _Hash()
            stream = io.BufferedReader(TapReader(stream, content_digest), 1 << 20)
        fmt = formats.detect(stream)
        kind = fmt.kind
        file_hint = RankHint(
            rank=hint.rank if hint.rank is not None else file_rank_hint(item.name),
            world_size=hint.world_size,
            rank_from="--rank" if hint.rank is not None else "the file name",
        )
        result = fmt.parse(stream, item.name, file_hint, limits)
        if hint.rank is not None and kind == "nccl_log":
            _check_given_rank(result, hint.rank)
        if stream.closed:  # a parser that closed its stream: the service hashes the content itself
            content_digest = None
        else:
            while stream.read(1 << 20):  # what the parser left unread counts for the content's identity
                pass
        hashing.drain()
    except Exception as exc:  # one bad file never stops the others
        with contextlib.suppress(Exception):  # the hash of a broken file is best effort
            hashing.drain()
        if isinstance(exc, UnknownFormatError):  # tried as an NCCL log for want of another kind: it is not one
            kind = "unknown"
        return ParsedFile(item.name, kind, digest.sha.hexdigest(), digest.size, error=_error_text(item.name, exc, kind))
    finally:
        hashing.close()
    content = (content_digest or digest).sha.hexdigest() if content_digest is not None or stream is raw else None
    return ParsedFile(item.name, kind, digest.sha.hexdigest(), digest.size, result=result, content_sha256=content)


def _check_given_rank(result: ParseResult, rank: int) -> None:
    """ParseError when an NCCL log contradicts the rank its ingest was given (--rank, an upload's `rank`): a log
    of several processes states each one's rank (the given one would be passed over without a word), and no
    rank is at or past the world size its communicators state."""
    processes = int(result.meta.get("processes") or 0)
    world = result.world_size
    if processes > 1:
        of_world = f" of a world of {world}" if world else ""
        raise ParseError(
            f"the rank given ({rank}) is for a single-rank file, but this NCCL log holds {processes} processes"
            f"{of_world}, whose ranks it states itself: ingest it without a rank"
        )
    if world is not None and rank >= world:
        raise ParseError(
            f"the rank given ({rank}) is not below the world size this NCCL log states ({world}: ranks 0-{world - 1})"
        )


def parse_tables(item: InputFile, hint: RankHint, limits: Limits = DEFAULT_LIMITS) -> ParsedFile:
    """parse_file with the rows as Arrow tables (ParseResult.as_tables; `result.tables()` gives one per store
    table): the parse step a worker process or a cluster task runs, its answer compact and picklable. `item`
    must open with a picklable opener to be sent (inputs.portable, inputs.OpenPath)."""
    parsed = parse_file(item, hint, limits)
    if parsed.result is not None:
        parsed.result.as_tables()
    return parsed


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, at most 300 characters (for an error a person reads)."""
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else "no message"


def _error_text(name: str, exc: Exception, kind: str | None) -> str:
    """`name:where: reason` for a ParseError; for anything else, what failed and that it is not the user's to fix."""
    if isinstance(exc, ParseError):
        return f"{name}:{exc.where}: {exc.reason}" if exc.where else f"{name}: {exc.reason}"
    what = f"{kind} parser" if kind else "reading the file"
    return (
        f"{name}: unexpected {type(exc).__name__} in the {what}: {first_line(exc)} "
        "(a commlens bug, or a shape of file it does not read yet: please report it with the file)"
    )
