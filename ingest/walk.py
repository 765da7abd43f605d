"""Which files of a directory are read as traces: the same for `commlens ingest` and `commlens upload` (no heavy
imports: the upload command reads files only to send them)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

# Files a directory walk passes over: what sits next to traces in real job folders but is never one.
NOT_TRACES = frozenset(
    {
        ".md",
        ".rst",
        ".py",
        ".sh",
        ".ipynb",
        ".yaml",
        ".yml",
        ".toml",
        ".ini",
        ".cfg",
        ".html",
        ".css",
        ".js",
        ".png",
        ".jpg",
        ".jpeg",
        ".svg",
        ".pdf",
        ".duckdb",
        ".wal",
        ".pt",
        ".pth",
        ".safetensors",
        ".ckpt",
    }
)


def passed_over(path: Path) -> str | None:
    """Why a directory walk does not read this file as a trace, or None when it does."""
    suffix = path.suffix.lower()
    return f"not a trace ({suffix} files are passed over in directories)" if suffix in NOT_TRACES else None


def walk(directory: Path) -> Iterator[Path]:
    """Every file under `directory`, hidden ones left out, in a stable (sorted) order."""
    return iter(sorted(p for p in directory.rglob("*") if p.is_file() and not p.name.startswith(".")))


def nothing_to_read(directory: Path) -> str | None:
    """Why a directory holds nothing a walk reads (an empty folder, a harness run not started yet: only its hidden
    config), or None when it holds a file to read."""
    if any(passed_over(p) is None for p in walk(directory)):
        return None
    everything = [p for p in directory.rglob("*") if p.is_file()]
    hidden = sum(p.name.startswith(".") for p in everything)
    left = len(everything) - hidden
    if not everything:
        return "an empty directory: no trace or log to ingest"
    return (
        f"no trace or log to ingest: its {len(everything)} file(s) are {hidden} hidden and {left} passed over "
        "(notes, code, images)"
    )
