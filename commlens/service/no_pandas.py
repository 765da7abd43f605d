"""Commands that make no pandas object run without pandas.

pyarrow imports pandas (0.2-0.3 s) on its first array only to tell pandas objects apart, and commlens makes
none. This module imports nothing else, so a command can use it before its heavy imports.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
from collections.abc import Iterator


class NoPandas(importlib.abc.MetaPathFinder):
    """Answers `import pandas` with ModuleNotFoundError."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if fullname.split(".", 1)[0] == "pandas":
            raise ModuleNotFoundError("pandas is not loaded while this commlens command runs", name=fullname)


def block_pandas() -> None:
    """For the rest of the process (a parse worker), unless something imported pandas already."""
    if "pandas" not in sys.modules:
        sys.meta_path.insert(0, NoPandas())


@contextlib.contextmanager
def arrow_without_pandas() -> Iterator[None]:
    """While the block runs, pandas is absent, unless something imported it already. Afterwards `import
    pandas` works again (pyarrow's own conversions to pandas import it then)."""
    if "pandas" in sys.modules:
        yield
        return
    blocker = NoPandas()
    sys.meta_path.insert(0, blocker)
    try:
        yield
    finally:
        sys.meta_path.remove(blocker)
