"""Shared fixtures. Real data lives in ../shared/data and is read in place, never copied."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # test-only helpers (synthetic.py) import by module name
import background  # noqa: E402  (found through the path set above)
import machine  # noqa: E402
from harness_runs import HarnessRuns  # noqa: E402

_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
SHARED_DATA = Path(os.environ.get("COMMLENS_DATA", ROOT.parent / "shared" / "data"))


def shared_data() -> Path:
    """The shared data folder; skip when absent, except under CI where its absence is a failure."""
    if not SHARED_DATA.is_dir():
        if os.environ.get("CI") == "true":
            pytest.fail(f"shared data folder {SHARED_DATA} is missing; CI needs it beside the clone")
        pytest.skip(f"shared data folder {SHARED_DATA} not present")
    return SHARED_DATA


# What makes a module part of the harness scope: it reads the session's harness runs or starts background commands.
_HARNESS_MARKS = ("harness_runs", "gloo_trace_files", "\nBACKGROUND = ")


@functools.cache
def in_harness_scope(module_path: str) -> bool:
    """Whether a test module reads harness runs (or starts background launches). Under `pytest -n` all such modules
    run in one worker, so each torchrun launch happens once and the planted stragglers' launches (HarnessRuns'
    `alone`) know every other launch of the session."""
    path = Path(module_path)
    path = path if path.is_absolute() else ROOT / path
    try:
        text = path.read_text()
    except OSError:
        return False
    return any(mark in text for mark in _HARNESS_MARKS)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Whole modules to a worker (their module fixtures start servers and browsers once), the harness scope as one."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScopes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "harness-scope" if in_harness_scope(module) else module

    return ModuleScopes(config, log)


def _start_background(session: pytest.Session) -> None:
    """Start the selected modules' `BACKGROUND` commands (tests/background.py): their waiting overlaps the tests."""
    modules = {item.module for item in session.items if isinstance(item, pytest.Function)}
    for module in sorted(modules, key=lambda m: m.__name__):
        for name, make in getattr(module, "BACKGROUND", {}).items():
            background.start(name, make)


def pytest_collection_finish(session: pytest.Session) -> None:
    if not session.config.option.collectonly and not _XDIST_WORKER:
        _start_background(session)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """Under `pytest -n`: the background commands start with the harness scope's first test (the worker that runs
    it runs all of it), and each test shares the machine with the other worker's (tests/machine.py)."""
    if _XDIST_WORKER and in_harness_scope(str(item.path)) and not background.any_started():
        _start_background(item.session)
    with machine.shared():
        return (yield)


def pytest_sessionfinish(session: pytest.Session) -> None:
    background.stop_all()
    machine.release()


@pytest.fixture(scope="session")
def harness_runs(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[HarnessRuns]:
    """Harness runs of the whole session, one torchrun launch per configuration (tests/harness_runs.py); from
    its first use, the runs the selected modules' `harness_prefetch(items)` list launch in the background."""
    pytest.importorskip("torch")
    runs = HarnessRuns(tmp_path_factory.mktemp("harness-runs"))
    by_module: dict[Any, list[pytest.Item]] = {}
    for item in request.session.items:
        if isinstance(item, pytest.Function):
            by_module.setdefault(item.module, []).append(item)
    for module, items in by_module.items():  # run order
        if prefetch := getattr(module, "harness_prefetch", None):
            runs.prefetch(prefetch(items))
    yield runs
    runs.close()


@pytest.fixture(scope="session")
def gloo_trace_files(tmp_path_factory: pytest.TempPathFactory, harness_runs: HarnessRuns) -> list[Path]:
    """Real profiler traces of every gloo collective on 2 ranks (tests/gloo_traces.py), made once, alone: the
    time analysis reads their end times (made beside two background launches and a CPU burner on 2 cores, one
    rank's systematic lateness was once taken by the clock rule for a clock offset)."""
    import gloo_traces

    with harness_runs.alone():
        return gloo_traces.generate(tmp_path_factory.mktemp("gloo"), world=2)


@pytest.fixture
def data_dir() -> Path:
    return shared_data()


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "store.duckdb"


@pytest.fixture
def con(db_path: Path):
    from commlens import store

    c = store.connect(db_path)
    yield c
    c.close()


@pytest.fixture
def resnet(con, data_dir: Path):
    """The real DDP ResNet-50 trace (rank 0 of 2) ingested as run "resnet" and attributed."""
    from commlens.backend.attribution import attribute_run
    from commlens.service.ingest import ingest_paths

    summary = ingest_paths(con, [data_dir / "kineto-hta/nccl_parser_config/nccl_data.json.gz"], "resnet")
    assert not summary.failed
    attribute_run(con, "resnet")
    return con
