"""Writes one benchmark's results into its own marked section of bench/README.md."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parent / "README.md"


def write_section(name: str, text: str, readme: Path = README) -> None:
    """Replace the text between `<!-- RESULTS:<name> START -->` and its END marker (appended if absent)."""
    start, end = f"<!-- RESULTS:{name} START -->", f"<!-- RESULTS:{name} END -->"
    body = readme.read_text() if readme.exists() else "# Benchmarks\n"
    block = f"{start}\n{text}\n{end}"
    if start in body:
        pre, rest = body.split(start, 1)
        body = pre + block + rest.split(end, 1)[1]
    else:
        body = body.rstrip("\n") + "\n\n" + block + "\n"
    readme.write_text(body)
