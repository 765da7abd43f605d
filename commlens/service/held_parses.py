"""Parsed files waiting to be stored, in memory up to a budget and on disk past it.

A split ingest (`commlens ingest` without --one-run) learns which run each file goes to only once every file
is parsed; until then the parses wait here. Held in memory whole, a directory of many large traces would
need memory for all of them at once; past BUDGET_BYTES the parses are pickled (their rows are Arrow tables,
written without copies) to a private temporary folder and read back when stored.
"""

from __future__ import annotations

import pickle
import tempfile
from pathlib import Path
from types import TracebackType

from commlens.ingest.parse_file import ParsedFile

BUDGET_BYTES = 32 << 20  # parses held in memory at most (Arrow bytes of their rows)


def parsed_nbytes(parsed: ParsedFile) -> int:
    """The Arrow bytes of a parse's rows (made Arrow here if they were still row dicts)."""
    result = parsed.result
    if result is None:
        return 0
    result.as_tables()
    tables = [*result.event_tables, *result.arrow_rows.values()]
    if result.intervals is not None:
        tables.append(result.intervals)
    return sum(t.nbytes for t in tables)


class HeldParses:
    """put(key, parse) / pop(key): parses kept in memory while they hold under `budget` bytes together, the
    rest in files that pop() reads back and deletes. The latest parse put stays in memory until the next put
    (a single file, or the last one, is stored without a round trip through the disk). A context manager: the
    folder goes with it."""

    def __init__(self, budget: int | None = None) -> None:
        self.budget = BUDGET_BYTES if budget is None else budget
        self.spilled = 0  # parses that went to disk
        self.in_memory = 0
        self._latest: tuple[int, ParsedFile] | None = None
        self._memory: dict[int, tuple[ParsedFile, int]] = {}
        self._disk: dict[int, Path] = {}
        self._folder: tempfile.TemporaryDirectory[str] | None = None

    def put(self, key: int, parsed: ParsedFile) -> None:
        if self._latest is not None:
            self._place(*self._latest)
        self._latest = (key, parsed)

    def _place(self, key: int, parsed: ParsedFile) -> None:
        size = parsed_nbytes(parsed)
        if self.in_memory + size <= self.budget:
            self._memory[key] = (parsed, size)
            self.in_memory += size
            return
        if self._folder is None:
            self._folder = tempfile.TemporaryDirectory(prefix="commlens-parses-")
        path = Path(self._folder.name) / f"{self.spilled}.pickle"
        with path.open("wb") as f:
            pickle.dump(parsed, f, protocol=pickle.HIGHEST_PROTOCOL)
        self._disk[key] = path
        self.spilled += 1

    def pop(self, key: int) -> ParsedFile | None:
        """The parse put under `key` (None if none was)."""
        if self._latest is not None and self._latest[0] == key:
            latest = self._latest[1]
            self._latest = None
            return latest
        if key in self._memory:
            kept, size = self._memory.pop(key)
            self.in_memory -= size
            return kept
        path = self._disk.pop(key, None)
        if path is None:
            return None
        with path.open("rb") as f:
            parsed: ParsedFile = pickle.load(f)
        path.unlink()
        return parsed

    def __enter__(self) -> HeldParses:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._folder is not None:
            self._folder.cleanup()
