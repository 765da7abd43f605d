"""Shared fixtures. Real data lives in ../shared/data and is read in place, never copied."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # test-only helpers (synthetic.py) import by module name
import background  # noqa: E402  (found through the path set above)
from harness_runs import HarnessRuns  # noqa: E402

SHARED_DATA = Path(os.environ.get("COMMLENS_DATA", ROOT.parent / "shared" / "data"))


def shared_data() -> Path:
    """The shared data folder; skip when absent, except under CI where its absence is a failure."""
    if not SHARED_DATA.is_dir():
        if os.environ.get("CI") == "true":
            pytest.fail(f"shared data folder {SHARED_DATA} is missing; CI needs it beside the clone")
        pytest.skip(f"shared data folder {SHARED_DATA} not present")
    return SHARED_DATA


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the selected modules' `BACKGROUND` commands (tests/background.py): their waiting overlaps the tests."""
    if session.config.option.collectonly:
        return
    modules = {item.module for item in session.items if isinstance(item, pytest.Function)}
    for module in sorted(modules, key=lambda m: m.__name__):
        for name, make in getattr(module, "BACKGROUND", {}).items():
            background.start(name, make)


def pytest_sessionfinish(session: pytest.Session) -> None:
    background.stop_all()


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
