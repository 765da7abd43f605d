"""Input files: walking directories, opening .gz transparently, expanding .tar/.tar.gz/.zip archives,
guarding against hostile archives (path traversal, links, member count, decompression bombs). A file's
format is detected from its content by `formats.detect`."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, TYPE_CHECKING, BinaryIO, cast

from isal import isal_zlib

from .records import ParseError
from .walk import passed_over, walk

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer


@dataclass(frozen=True)
class Limits:
    max_decompressed_bytes: int = 16 * 2**30  # per file
    max_ratio: float = 200.0  # decompressed / compressed read so far, enforced once past ratio_floor_bytes
    ratio_floor_bytes: int = 2**20  # from the first MiB on: a bomb is refused before it costs any time
    max_members: int = 100_000
    max_line_bytes: int = 16 * 2**20  # NCCL log lines longer than this are skipped
    max_json_depth: int = 64
    # communication records (CPU ops, NCCL kernels, launches) a profiler trace may make the parse hold
    # until its end, as columns (~26 B each; bench/stream.py, docs/security.md). A trace the columnar path
    # cannot read is held as objects and refused past kineto.OBJECT_BUDGET records instead. At most one
    # record per event: 24 M admits a 20 M-event trace whatever its events.
    max_trace_events: int = 24_000_000


DEFAULT_LIMITS = Limits()

GZIP_MAGIC = b"\x1f\x8b"
ZIP_MAGIC = b"PK\x03\x04"


@dataclass
class InputFile:
    """One file to ingest. `open_raw` gives its bytes as stored (possibly gzip-compressed)."""

    name: str  # shown to users: "dir/rank0.json.gz" or "jobs.tar.gz!worker0.json"
    size: int
    open_raw: Callable[[], BinaryIO]
    error: str | None = None  # set when the container itself could not be read
    skip: str | None = None  # set for files a directory walk passes over (documentation, code, images)


@dataclass(frozen=True)
class OpenPath:
    """A picklable opener of a file on disk (an InputFile's `open_raw` that can go to another process)."""

    path: str

    def __call__(self) -> BinaryIO:
        return open(self.path, "rb")


@dataclass(frozen=True)
class OpenBytes:
    """A picklable opener of bytes held in memory (an archive member sent to another process)."""

    data: bytes

    def __call__(self) -> BinaryIO:
        return io.BytesIO(self.data)


def portable(item: InputFile) -> InputFile:
    """The same input with a picklable opener: a file on disk by its path, an archive member by its bytes
    (read here, so the archive is expanded once, in the caller's process, within its limits)."""
    if isinstance(item.open_raw, (OpenPath, OpenBytes)) or item.error or item.skip:
        return item
    with item.open_raw() as f:
        data = f.read()
    return InputFile(item.name, item.size, OpenBytes(data))


class TapReader(io.RawIOBase):
    """Passes a stream's bytes through unchanged and shows each chunk to `on_data` (hashing, progress),
    so a file is read once for everything that needs its bytes."""

    def __init__(self, raw: BinaryIO, on_data: Callable[[memoryview], None]):
        self._raw = raw
        self._on_data = on_data  # sees a view of the caller's buffer, valid during the call only
        self._readinto = getattr(raw, "readinto", None)

    def readable(self) -> bool:
        return True

    def readinto(self, b: WriteableBuffer) -> int:
        """Read straight into b where the stream can: a read() of a large block is a new allocation, fresh
        pages for the kernel to zero on every block."""
        with memoryview(b) as mv, mv.cast("B") as view:
            if self._readinto is not None:
                n = self._readinto(view) or 0
            else:
                data = self._raw.read(len(view))
                n = len(data)
                view[:n] = data
            with view[:n] as got:
                self._on_data(got)
        return n

    def drain(self) -> None:
        buf = bytearray(1 << 20)
        while self.readinto(buf):
            pass

    def close(self) -> None:
        self._raw.close()
        super().close()


# gzip (deflate) errors of either decompressor (isal's stub declares its error an instance)
GZIP_ERRORS: tuple[type[Exception], ...] = (zlib.error, cast("type[Exception]", isal_zlib.error))


def _gunzip() -> isal_zlib.Decompress:
    """A decompressor of one gzip member: ISA-L's inflate, the same stream as zlib's at about three times its
    speed (the real .gz traces: 0.82 -> 0.26 ms per MB), which for a profiler trace is a tenth of its parse."""
    return isal_zlib.decompressobj(isal_zlib.MAX_WBITS | 16)


class BoundedGzipReader(io.RawIOBase):
    """Decompresses gzip (all members) while enforcing the size and ratio limits."""

    def __init__(self, raw: BinaryIO, name: str, limits: Limits):
        self._raw = raw
        self._name = name
        self._limits = limits
        self._dec = _gunzip()
        self._fed = False  # the current member's decompressor has been given input
        self._pending = b""  # the start of the next gzip member, read with the end of the previous one
        self._out = b""  # decompressed bytes not yet handed out, from self._pos on
        self._pos = 0
        self._eof = False
        self.compressed = 0
        self.decompressed = 0

    def readable(self) -> bool:
        return True

    def _produce(self, want: int) -> bytes:
        """The next block of decompressed bytes (b"" at the end), at most about `want` bytes."""
        while not self._eof:
            if self._dec.unconsumed_tail:
                chunk = self._dec.unconsumed_tail
            elif self._pending:
                chunk, self._pending = self._pending, b""
            else:
                chunk = self._raw.read(1 << 18)
                self.compressed += len(chunk)
                if not chunk:
                    if self._fed and not self._dec.eof:
                        raise ParseError(
                            "truncated gzip data: the compressed stream ends early", f"byte {self.compressed}"
                        )
                    self._eof = True
                    break
            self._fed = True
            try:
                out = self._dec.decompress(chunk, max(want, 1 << 16))
            except GZIP_ERRORS as exc:
                raise ParseError(f"corrupt gzip data ({exc})", f"byte {self.compressed}") from None
            if self._dec.eof:
                rest = self._dec.unused_data
                self._dec = _gunzip()
                self._fed = False
                if rest[:2] == GZIP_MAGIC:
                    self._pending = rest  # another member follows; trailing zeros or garbage are ignored
            if out:
                self.decompressed += len(out)
                self._check()
                return out
        return b""

    def _check(self) -> None:
        lim = self._limits
        if self.decompressed > lim.max_decompressed_bytes:
            raise ParseError(
                f"decompressed size exceeds the limit of {lim.max_decompressed_bytes} bytes (decompression bomb?)"
            )
        # against the compressed bytes the decompressor has consumed, not those read ahead into its input
        consumed = self.compressed - len(self._dec.unconsumed_tail) - len(self._pending)
        if self.decompressed > lim.ratio_floor_bytes and self.decompressed > lim.max_ratio * max(consumed, 1):
            raise ParseError(
                f"compression ratio above {lim.max_ratio:.0f}:1 after {self.decompressed} bytes (decompression bomb?)"
            )

    def readinto(self, b: WriteableBuffer) -> int:
        view = memoryview(b).cast("B")
        if self._pos >= len(self._out):
            self._out = self._produce(len(view))
            self._pos = 0
        n = min(len(view), len(self._out) - self._pos)
        view[:n] = memoryview(self._out)[self._pos : self._pos + n]
        self._pos += n
        return n


def open_content(
    raw: io.BufferedIOBase | io.RawIOBase, name: str, limits: Limits = DEFAULT_LIMITS
) -> io.BufferedReader:
    """A buffered, peekable stream of the file's content, gunzipped when it is gzip."""
    buffered = raw if isinstance(raw, io.BufferedReader) else io.BufferedReader(raw, 1 << 20)
    if buffered.peek(2)[:2] == GZIP_MAGIC:
        return io.BufferedReader(BoundedGzipReader(buffered, name, limits), 1 << 20)
    return buffered


# ------------------------------------------------------------------------------- walking inputs


def _is_archive(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith((".tar.gz", ".tgz", ".tar")):
        return "tar"
    if name.endswith(".zip"):
        return "zip"
    return None


def iter_inputs(paths: list[Path], limits: Limits = DEFAULT_LIMITS) -> Iterator[InputFile]:
    """Every file under `paths`, archives expanded. Order is stable (sorted) so runs are reproducible."""
    for path in paths:
        if path.is_dir():
            for sub in walk(path):
                if skip := passed_over(sub):
                    yield InputFile(str(sub), sub.stat().st_size, lambda: io.BytesIO(b""), skip=skip)
                    continue
                yield from _iter_file(sub, str(sub), limits)
        elif path.is_file():
            yield from _iter_file(path, str(path), limits)
        else:
            yield InputFile(str(path), 0, lambda: io.BytesIO(b""), error="no such file or directory")


def _iter_file(path: Path, name: str, limits: Limits) -> Iterator[InputFile]:
    with open(path, "rb") as f:
        kind = _is_archive(path) or archive_kind(f)
    if kind == "tar":
        yield from _iter_tar(path, name, path.stat().st_size, limits)
    elif kind == "zip":
        yield from _iter_zip(path, name, path.stat().st_size, limits)
    else:
        yield InputFile(name, path.stat().st_size, OpenPath(str(path)))


def _safe_member_name(member: str) -> str | None:
    """The reason a member path is refused, or None when it is safe."""
    p = PurePosixPath(member.replace("\\", "/"))
    if p.is_absolute() or member.startswith(("/", "\\")) or (len(member) > 1 and member[1] == ":"):
        return "absolute path"
    if ".." in p.parts:
        return "path escapes the archive ('..')"
    return None


class ArchiveBombError(ParseError):
    """The archive as a whole expands past the limits: no later member is read."""


@dataclass
class _Budget:
    """Decompressed bytes of one archive so far, against the archive's bytes read so far (`read`): the
    limits hold for the archive as a whole, so many members each under the limits cannot add up to a bomb,
    and a bomb is refused from its first MiB, not once its whole size on disk has been multiplied."""

    read: Callable[[], int]
    used: int = 0

    def charge(self, n: int, limits: Limits) -> None:
        self.used += n
        if self.used > limits.max_decompressed_bytes:
            raise ArchiveBombError(
                f"archive expands past the limit of {limits.max_decompressed_bytes} bytes (decompression bomb?)"
            )
        read = self.read()
        if self.used > limits.ratio_floor_bytes and self.used > limits.max_ratio * max(read, 1):
            raise ArchiveBombError(
                f"archive expands more than {limits.max_ratio:.0f}:1 ({self.used} bytes out of "
                f"{read}; decompression bomb?)"
            )


def _spool(src: IO[bytes], budget: _Budget, limits: Limits) -> BinaryIO:
    """Copy an archive member to a temporary file, charging its bytes to the archive's budget."""
    out = tempfile.SpooledTemporaryFile(max_size=64 << 20)  # noqa: SIM115 - returned; closed here on failure
    try:
        while chunk := src.read(1 << 20):
            budget.charge(len(chunk), limits)
            out.write(chunk)
    except BaseException:
        out.close()
        raise
    out.seek(0)
    return out  # type: ignore[return-value]


MAX_NESTING = 1  # an archive inside an archive is expanded; one inside that is refused


def archive_kind(f: BinaryIO) -> str | None:
    """'tar' or 'zip' when the content at f's start is an archive (a tar possibly gzipped), else None; f is
    rewound. Archives are found by content too, so that one is never read as text whatever its name."""
    head = f.read(512)
    f.seek(0)
    if head.startswith(ZIP_MAGIC):
        return "zip"
    if head.startswith(GZIP_MAGIC):
        try:
            head = zlib.decompressobj(zlib.MAX_WBITS | 16).decompress(head, 512)
        except zlib.error:
            return None
    return "tar" if head[257:262] == b"ustar" else None


def _nested(
    label: str, spooled: BinaryIO, size: int, limits: Limits, budget: _Budget, depth: int
) -> Iterator[InputFile] | None:
    """The members of an archive member (expanded within the outer archive's budget), an error for one nested
    too deep, or None when the member is not an archive."""
    kind = _is_archive(Path(label)) or archive_kind(spooled)
    if kind is None:
        return None
    if depth >= MAX_NESTING:
        spooled.close()
        return iter(
            [
                InputFile(
                    label,
                    size,
                    lambda: io.BytesIO(b""),
                    error=f"archive member refused: an archive nested more than {MAX_NESTING} deep",
                )
            ]
        )
    expand = _iter_tar if kind == "tar" else _iter_zip
    return expand(spooled, label, size, limits, budget, depth + 1)


def _iter_tar(
    src: Path | BinaryIO, name: str, size: int, limits: Limits, budget: _Budget | None = None, depth: int = 0
) -> Iterator[InputFile]:
    try:
        path, fileobj = (src, None) if isinstance(src, Path) else (None, src)
        tar = tarfile.open(path, "r:*", fileobj)  # noqa: SIM115 - closed by the `with tar` below
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        yield InputFile(name, size, lambda: io.BytesIO(b""), error=f"cannot read archive: {exc}")
        return
    archive_size = size
    raw = getattr(tar.fileobj, "fileobj", None)  # a .tar.gz's compressed file under tarfile's GzipFile
    budget = budget or _Budget(raw.tell if raw is not None else lambda: archive_size)
    count = 0
    last = None  # the last member read whole, for an archive cut short after it
    with tar:
        try:
            for member in tar:
                count += 1
                if count > limits.max_members:
                    yield InputFile(
                        name, 0, lambda: io.BytesIO(b""), error=f"archive has more than {limits.max_members} members"
                    )
                    return
                label = f"{name}!{member.name}"
                if member.isdir():
                    continue
                reason = _safe_member_name(member.name)
                if reason is None and (member.issym() or member.islnk()):
                    reason = "links are not followed"
                elif reason is None and not member.isfile():
                    reason = "not a regular file"
                if reason:
                    yield InputFile(label, 0, lambda: io.BytesIO(b""), error=f"archive member refused: {reason}")
                    continue
                if PurePosixPath(member.name).name.startswith("."):
                    continue
                try:
                    fobj = tar.extractfile(member)
                    assert fobj is not None
                    spooled = _spool(fobj, budget, limits)
                except ParseError as exc:
                    yield InputFile(label, member.size, lambda: io.BytesIO(b""), error=str(exc))
                    if isinstance(exc, ArchiveBombError):
                        return
                    continue
                except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
                    error = f"archive is truncated or corrupt in this member ({member.size} bytes stated): {exc}"
                    yield InputFile(label, member.size, lambda: io.BytesIO(b""), error=error)
                    return
                last = member.name
                inner = _nested(label, spooled, member.size, limits, budget, depth)
                if inner is not None:
                    yield from inner
                    continue
                yield InputFile(label, member.size, lambda s=spooled: _rewound(s))  # type: ignore[misc]
        except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
            where = f" after member {last} (the last read whole)" if last else " before its first member"
            yield InputFile(
                name, archive_size, lambda: io.BytesIO(b""), error=f"archive is truncated or corrupt{where}: {exc}"
            )


def _rewound(f: BinaryIO) -> BinaryIO:
    f.seek(0)
    return _Unclosable(f)


class _Unclosable(io.BufferedReader):
    """Lets a parser 'close' a spooled member without discarding it (it may be read again for hashing)."""

    def __init__(self, f: BinaryIO):
        super().__init__(f, 1 << 20)  # type: ignore[arg-type]  # BinaryIO does not declare readinto; the spool file has it

    def close(self) -> None:
        pass


def _iter_zip(
    src: Path | BinaryIO, name: str, size: int, limits: Limits, budget: _Budget | None = None, depth: int = 0
) -> Iterator[InputFile]:
    try:
        zf = zipfile.ZipFile(src)
    except (zipfile.BadZipFile, OSError) as exc:
        yield InputFile(name, size, lambda: io.BytesIO(b""), error=f"cannot read archive: {exc}")
        return
    archive_size = size
    budget = budget or _Budget(lambda: archive_size)
    with zf:
        infos = zf.infolist()
        if len(infos) > limits.max_members:
            yield InputFile(
                name, 0, lambda: io.BytesIO(b""), error=f"archive has more than {limits.max_members} members"
            )
            return
        for info in infos:
            if info.is_dir():
                continue
            label = f"{name}!{info.filename}"
            reason = _safe_member_name(info.filename)
            if reason is None and (info.external_attr >> 16) & 0o170000 == 0o120000:
                reason = "links are not followed"
            if reason:
                yield InputFile(label, 0, lambda: io.BytesIO(b""), error=f"archive member refused: {reason}")
                continue
            if PurePosixPath(info.filename).name.startswith("."):
                continue
            if info.file_size > limits.max_decompressed_bytes or (
                info.file_size > limits.ratio_floor_bytes
                and info.file_size > limits.max_ratio * max(info.compress_size, 1)
            ):
                yield InputFile(
                    label,
                    info.file_size,
                    lambda: io.BytesIO(b""),
                    error="member too large or too compressed (decompression bomb?)",
                )
                continue
            try:
                with zf.open(info) as fobj:
                    spooled = _spool(fobj, budget, limits)
            except ArchiveBombError as exc:
                yield InputFile(label, info.file_size, lambda: io.BytesIO(b""), error=str(exc))
                return
            except (ParseError, zipfile.BadZipFile, zlib.error, OSError) as exc:
                yield InputFile(label, info.file_size, lambda: io.BytesIO(b""), error=str(exc))
                continue
            except (RuntimeError, NotImplementedError) as exc:  # encrypted member, unsupported compression method
                yield InputFile(label, info.file_size, lambda: io.BytesIO(b""), error=f"cannot read member: {exc}")
                continue
            inner = _nested(label, spooled, info.file_size, limits, budget, depth)
            if inner is not None:
                yield from inner
                continue
            yield InputFile(label, info.file_size, lambda s=spooled: _rewound(s))  # type: ignore[misc]


def gzip_content_sha256(open_raw: Callable[[], BinaryIO], name: str, limits: Limits = DEFAULT_LIMITS) -> str | None:
    """sha256 of a gzip file's decompressed content (within the limits), None for a file that is not gzip.
    A file's identity is its content: `x.log` and `x.log.gz` are the same file."""
    with open_raw() as raw:
        buffered = io.BufferedReader(cast(io.RawIOBase, raw), 1 << 20)  # every opener's stream has readinto
        if buffered.peek(2)[:2] != GZIP_MAGIC:
            return None
        h = hashlib.sha256()
        content = open_content(buffered, name, limits)
        while chunk := content.read(1 << 20):
            h.update(chunk)
        return h.hexdigest()


def file_rank_hint(name: str) -> int | None:
    """A rank from a file name: rank-3.json, rank3, worker5_step_12..., trace_rank_2, _r7."""
    import re

    base = os.path.basename(name.split("!")[-1])
    for pattern in (r"rank[-_]?(\d+)", r"worker[-_]?(\d+)", r"(?:^|[-_.])r(\d+)(?:[-_.]|$)"):
        m = re.search(pattern, base, re.IGNORECASE)
        if m:
            return int(m.group(1))
    return None
