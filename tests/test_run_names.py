"""A run name with a '/' is refused when a run would be made with it: the API and the dashboard address runs
by name in their paths, which cannot carry one (such a run was stored by the CLI and unreachable everywhere
else). So are names those paths cannot address otherwise: empty or only whitespace, '.' and '..' (resolved
away in a URL), whitespace at either end. Refused before any file is parsed, naming the run and why; an
existing run of such a name still takes files."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest
from conftest import shared_data
from typer.testing import CliRunner

from commlens import store
from commlens.cli import app
from commlens.ingest.inputs import InputFile, iter_inputs
from commlens.service.errors import InvalidError
from commlens.service.ingest import ingest_run
from commlens.service.runs import create_run, update_run

TRACE = "kineto-hta/nccl_parser_config/nccl_data.json.gz"


def test_a_new_run_with_a_slash_is_refused_up_front(tmp_path: Path) -> None:
    con = store.connect(tmp_path / "s.duckdb")
    try:

        def never_read() -> Iterator[InputFile]:  # inputs the refusal must not start reading
            raise AssertionError("the files were read before the name was checked")
            yield  # a generator: the error comes at its first item

        with pytest.raises(store.StoreError, match=r"'ddp/v1' holds a '/'"):
            ingest_run(con, "ddp/v1", never_read(), split_jobs=True)
        assert con.execute("SELECT count(*) FROM runs").fetchone() == (0,)
    finally:
        con.close()


def test_the_cli_names_the_run_and_stores_nothing(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    done = subprocess.run(
        [sys.executable, "-m", "commlens.cli", "ingest", str(shared_data() / TRACE), "--db", str(db), "--run", "a b/c"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "'a b/c' holds a '/'" in done.stderr
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM runs").fetchone() == (0,)
        assert con.execute("SELECT count(*) FROM sources").fetchone() == (0,)


# name -> what the refusal says is wrong with it
UNADDRESSABLE = {
    "": "is empty or only whitespace",
    " ": "is empty or only whitespace",
    "\t\n": "is empty or only whitespace",
    ".": "is a relative path segment",
    "..": "is a relative path segment",
    " .. ": "is a relative path segment",
    " ddp": "begins or ends with whitespace",
    "ddp ": "begins or ends with whitespace",
}


@pytest.mark.parametrize("name", list(UNADDRESSABLE))
def test_a_new_run_of_a_name_no_path_can_address_is_refused_up_front(tmp_path: Path, name: str) -> None:
    con = store.connect(tmp_path / "s.duckdb")
    try:

        def never_read() -> Iterator[InputFile]:
            raise AssertionError("the files were read before the name was checked")
            yield

        with pytest.raises(store.StoreError, match=f"run name {re.escape(repr(name))} {UNADDRESSABLE[name]}"):
            ingest_run(con, name, never_read(), split_jobs=True)
        with pytest.raises(store.StoreError, match=UNADDRESSABLE[name]):  # the ingest's way a run is made
            store.ensure_run(con, name)
        with pytest.raises(InvalidError, match=UNADDRESSABLE[name]):  # and the service's, for the API and CLI
            create_run(con, name)
        create_run(con, "fine")
        with pytest.raises(InvalidError, match=UNADDRESSABLE[name]):
            update_run(con, "fine", {"name": name})
        assert con.execute("SELECT name FROM runs").fetchall() == [("fine",)]
        assert con.execute("SELECT count(*) FROM run_aliases").fetchone() == (0,)
    finally:
        con.close()


def test_the_cli_refuses_each_such_name_and_stores_nothing(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    for name in ("", " ", ".", "..", "ddp "):
        result = CliRunner().invoke(app, ["ingest", str(shared_data() / TRACE), "--db", str(db), "--run", name])
        assert result.exit_code == 2, result.output
        assert f"error: run name {name!r} {UNADDRESSABLE[name]}" in result.output
        assert "pick another name" in result.output and "Traceback" not in result.output
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM runs").fetchone() == (0,)
        assert con.execute("SELECT count(*) FROM sources").fetchone() == (0,)


def test_an_existing_run_of_such_a_name_still_takes_files(tmp_path: Path) -> None:
    con = store.connect(tmp_path / "s.duckdb")
    try:
        con.execute("INSERT INTO runs (name) VALUES ('legacy/run')")  # a store written before the rule
        report = ingest_run(con, "legacy/run", iter_inputs([shared_data() / TRACE]))
        assert [f.status for f in report.files] == ["ok"]
    finally:
        con.close()
