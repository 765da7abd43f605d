"""The import graph checks itself: the contracts in .importlinter, and a dashboard that loads no server.

The package maps `commlens.backend` to backend/ (and so on), which import-linter cannot follow, so the
contracts run over a tree of links laid out as the installed package, built from pyproject's mapping.
"""

from __future__ import annotations

import configparser
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / ".importlinter"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
SERVER_MODULES = (
    "duckdb",
    "fastapi",
    "uvicorn",
    "pyarrow",
    "starlette",
    "commlens.backend",
    "commlens.ingest",
    "commlens.store",
    "commlens.service",
    "commlens.harness",
)


def _contract_ids() -> list[str]:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(CONFIG)
    return [
        s.removeprefix("importlinter:contract:") for s in parser.sections() if s.startswith("importlinter:contract:")
    ]


@pytest.fixture(scope="module")
def package_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`commlens/` as installed: its own files, and each mapped sub-package linked in under its name."""
    tree = tmp_path_factory.mktemp("layout")
    package = tree / "commlens"
    package.mkdir()
    for entry in (ROOT / "commlens").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name, folder in mapping.items():
        if name.count(".") == 1:  # commlens.backend = backend ...; deeper packages come with their parent
            (package / name.split(".")[1]).symlink_to(ROOT / folder)
    return tree


@pytest.mark.parametrize("contract", _contract_ids())
def test_import_contract_is_kept(package_tree: Path, contract: str) -> None:
    proc = subprocess.run(
        [str(LINT_IMPORTS), str(CONFIG), "--contract", contract, "--no-cache", "--no-logo"],
        cwd=package_tree,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dashboard_loads_no_server_module() -> None:
    """`commlens ui` ships the dashboard, not the store, the ingest pipeline or the API server."""
    code = "import json, sys, commlens.frontend.app; print(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    loaded = json.loads(proc.stdout.splitlines()[-1])
    server = [m for m in loaded if any(m == s or m.startswith(f"{s}.") for s in SERVER_MODULES)]
    assert "commlens.frontend.client" in loaded and "commlens.contract.analysis" in loaded
    assert server == []


def test_the_api_client_loads_no_dashboard() -> None:
    """`commlens runs` and `report` talk to a server through the client: they do not pay for Dash and Plotly."""
    code = "import json, sys, commlens.frontend.client; print(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    loaded = json.loads(proc.stdout.splitlines()[-1])
    assert "commlens.frontend.client" in loaded
    assert [m for m in loaded if m.split(".")[0] in ("dash", "plotly", "pandas")] == []
