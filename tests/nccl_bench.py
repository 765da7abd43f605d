"""bench/nccl.py loaded as a module: the tests write its log shapes (interleaved, per process) at small sizes."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench" / "nccl.py"


@functools.cache
def nccl_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_nccl", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_nccl"] = module
    spec.loader.exec_module(module)
    return module
