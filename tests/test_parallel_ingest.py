"""Ingest with --jobs N: files parsed in worker processes give the same store as one process; the CLI's
ingest of one small file loads no pandas, FastAPI, Dash or plotly; a killed ingest leaves no empty run."""

from __future__ import annotations

import gc
import json
import os
import pickle
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest
from conftest import shared_data

from commlens import store
from commlens.ingest.inputs import InputFile, iter_inputs
from commlens.ingest.parse_file import ParsedFile
from commlens.ingest.records import ParseResult
from commlens.service import held_parses, parse_pool
from commlens.service import ingest as ingest_module
from commlens.service import parallel as parallel_module
from commlens.service.ingest import ingest_run
from commlens.store.tables import AGG_TABLES, TRACE_TABLES

DLRM = "kineto-param/dlrm_kineto.tar.gz"
RESNET = "kineto-hta/nccl_parser_config/nccl_data.json.gz"
# Per-run tables compared row for row: every column but the ids the store assigns and the clock's
COMPARED = (*TRACE_TABLES, "sources", "process_groups", *AGG_TABLES)


def _rows(con: duckdb.DuckDBPyConnection, table: str) -> list[tuple]:
    cols = [
        name
        for name, typ in con.execute(
            "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = ? ORDER BY ordinal_position",
            [table],
        ).fetchall()
        if name not in ("run_id", "source_id") and "TIMESTAMP" not in typ
    ]
    listed = ", ".join(f't."{c}"' for c in cols)
    sql = f"SELECT r.name, {listed} FROM {table} t JOIN runs r USING (run_id) ORDER BY ALL"  # fixed names
    return [tuple(json.dumps(v, default=str) for v in row) for row in con.execute(sql).fetchall()]


def _ingest(tmp_path: Path, name: str, paths: list[Path], jobs: int) -> duckdb.DuckDBPyConnection:
    con = store.connect(tmp_path / f"{name}.duckdb")
    report = ingest_run(con, "run", iter_inputs(paths), split_jobs=True, jobs=jobs)
    assert not report.failed, [f.error for f in report.failed]
    return con


@pytest.mark.parametrize("inputs", [[DLRM], ["kineto-hta"]], ids=["dlrm-archive", "hta-directory"])
def test_workers_store_what_one_process_stores(
    tmp_path: Path, inputs: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = [shared_data() / p for p in inputs]
    serial = _ingest(tmp_path, "serial", paths, jobs=1)
    monkeypatch.setattr(parse_pool, "PARALLEL_MIN_BYTES", 0)  # workers even for these small files
    started = []
    in_workers = parallel_module._in_workers
    monkeypatch.setattr(parallel_module, "_in_workers", lambda *a: started.append(a[-1].workers) or in_workers(*a))
    here = []  # files this process parsed while the worker had its share queued
    parse_here = parallel_module.parse_file
    monkeypatch.setattr(parallel_module, "parse_file", lambda item, *a: here.append(item.name) or parse_here(item, *a))
    parallel = _ingest(tmp_path, "parallel", paths, jobs=2)
    assert started == [1]  # --jobs 2: one worker and this process
    assert here, "this process parsed no file"
    runs = serial.execute("SELECT name FROM runs ORDER BY 1").fetchall()
    assert runs == parallel.execute("SELECT name FROM runs ORDER BY 1").fetchall()
    for table in COMPARED:
        assert _rows(serial, table) == _rows(parallel, table), table
    n = serial.execute("SELECT count(*) FROM comm_events").fetchone()
    assert n is not None
    # the DLRM job: 8 ranks x 8 calls; the HTA directory: every trace's calls
    assert n[0] == (64 if inputs == [DLRM] else 2233)


def test_parses_held_on_disk_store_what_memory_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A split ingest holds every parse until the files are grouped into jobs: past its memory budget they wait
    on disk (pickled), and the store is the same."""
    paths = [shared_data() / DLRM]
    in_memory = _ingest(tmp_path, "memory", paths, jobs=1)
    spilled = []
    made = held_parses.HeldParses

    def tiny(budget: int | None = None) -> held_parses.HeldParses:
        held = made(budget=20_000)  # a few of the DLRM archive's 8 parses fit, the rest go to disk
        spilled.append(held)
        return held

    monkeypatch.setattr(ingest_module, "HeldParses", tiny)
    on_disk = _ingest(tmp_path, "disk", paths, jobs=1)
    assert 0 < spilled[0].spilled < 8, spilled[0].spilled
    for table in COMPARED:
        assert _rows(in_memory, table) == _rows(on_disk, table), table


def test_held_parses_keep_the_latest_in_memory_and_the_rest_on_disk() -> None:
    def parse(i: int) -> ParsedFile:
        result = ParseResult(kind="nccl_log")
        result.event_tables.append(pa.table({"op": ["all_reduce"] * 1000, "msg_bytes": [i] * 1000}))
        return ParsedFile(f"f{i}", "nccl_log", "sha", 1, result=result)

    with held_parses.HeldParses(budget=0) as held:
        for i in range(3):
            held.put(i, parse(i))
        assert held.spilled == 2  # the latest waits in memory: a single file never goes to disk
        first = held.pop(0)
        assert first is not None and first.result is not None
        assert first.result.event_tables[0]["msg_bytes"][0].as_py() == 0
        held.put(3, parse(3))  # the previous latest goes to disk under a name of its own
        assert held.spilled == 3
        assert [p.name for k in (1, 2, 3) if (p := held.pop(k)) is not None] == ["f1", "f2", "f3"]
        assert held.pop(4) is None


def test_a_parse_pickles_at_the_size_of_its_rows() -> None:
    """A parser's table sliced from larger buffers is copied on its own by as_tables(): pickled whole (a worker's
    answer, a parse held on disk) it would carry every row of the buffers it was cut from."""
    big = pa.table({"op": ["all_reduce"] * 1_000_000, "msg_bytes": list(range(1_000_000))})
    result = ParseResult(kind="nccl_log")
    result.event_tables.append(big.slice(10, 1000))
    assert len(pickle.dumps(result)) > 8_000_000  # the slice alone pickles its source's buffers
    result.as_tables()
    assert len(pickle.dumps(result)) < 100_000
    assert result.event_tables[0].to_pydict() == big.slice(10, 1000).to_pydict()


def test_split_ingest_releases_each_archive_member_once_parsed(tmp_path: Path) -> None:
    """Archive members are spooled (in memory up to 64 MiB each): a split ingest, which stores only after every
    file is parsed, lets each member's spool go once it is parsed instead of holding all until the end."""
    openers: list[weakref.ref] = []

    def watched() -> Iterator[InputFile]:
        for item in iter_inputs([shared_data() / DLRM]):
            openers.append(weakref.ref(item.open_raw))
            yield item

    alive_when_stored = []

    def stored(_: InputFile, __: object) -> None:
        gc.collect()
        alive_when_stored.append(sum(ref() is not None for ref in openers))

    con = store.connect(tmp_path / "s.duckdb")
    report = ingest_run(con, "run", watched(), split_jobs=True, on_file=stored)
    assert len(report.files) == len(openers) == 8 and not report.failed
    assert alive_when_stored == [0] * 8


def test_ingest_of_one_small_file_loads_no_server_or_dataframe_library(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from commlens.cli import app\n"
        "try:\n"
        f"    app(['ingest', {str(shared_data() / RESNET)!r}, '--db', {str(tmp_path / 's.duckdb')!r}, '--run', 'r'])\n"
        "except SystemExit as exc:\n"
        "    assert not exc.code, exc.code\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'pandas', 'fastapi', 'dash', 'plotly', 'starlette'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
    con = duckdb.connect(str(tmp_path / "s.duckdb"), read_only=True)
    assert con.execute("SELECT count(*) FROM comm_events").fetchone() == (21,)


def test_cli_starts_its_workers_before_its_own_imports(tmp_path: Path) -> None:
    """`commlens ingest -j 2` of a directory worth workers starts one (the CLI's process parses too) before it
    imports DuckDB, so the worker's start-up overlaps the CLI's; the store holds every file's calls. (The
    pool an in-process caller gets from parsed_inputs is spawned: test_workers_store_what_one_process_stores.)"""
    code = (
        "import sys\n"
        "from commlens.service import parse_pool\n"
        "parse_pool.PARALLEL_MIN_BYTES = 0\n"
        "seen = []\n"
        "class Spy(parse_pool.ParsePool):\n"
        "    def __init__(self, workers, fork_ok=False):\n"
        "        imported = 'duckdb' in sys.modules\n"
        "        super().__init__(workers, fork_ok)\n"
        "        seen.append((workers, imported, self.start_method))\n"
        "parse_pool.ParsePool = Spy\n"
        "from commlens.cli import app\n"
        "try:\n"
        f"    app(['ingest', {str(shared_data() / 'kineto-hta')!r}, '--db', {str(tmp_path / 's.duckdb')!r},"
        " '--run', 'r', '--one-run', '-j', '2'])\n"
        "except SystemExit as exc:\n"
        "    assert not exc.code, exc.code\n"
        "print(seen)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    # forked: no other thread yet, so no interpreter start and no semaphore tracker process
    assert out.stdout.strip().splitlines()[-1] == "[(1, False, 'fork')]", out.stdout + out.stderr
    con = duckdb.connect(str(tmp_path / "s.duckdb"), read_only=True)
    assert con.execute("SELECT count(*) FROM comm_events").fetchone() == (2233,)


def test_a_killed_ingest_leaves_no_empty_run(tmp_path: Path) -> None:
    """SIGKILL while the first file is being parsed: no file committed, so no run either."""
    import kineto_synth

    trace = tmp_path / "big.json.gz"
    # 200k calls: about 5 s of parse on an idle machine, so the kill 1 s after the store opens lands in
    # the parse even when the test's own sleep overruns on a loaded machine (40k calls was parsed and
    # committed within 1.5 s, and a loaded run saw the commit)
    kineto_synth.write_trace_gz(shared_data() / RESNET, 200_000, trace)
    db = tmp_path / "s.duckdb"
    proc = subprocess.Popen(
        [sys.executable, "-m", "commlens.cli", "ingest", str(trace), "--db", str(db), "--run", "killed", "-j", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not db.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # the store is open (the run used to be made here) and the parse is under way
        assert proc.poll() is None, "the ingest finished before it could be killed: make the trace longer"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    con = store.connect(db)
    assert con.execute("SELECT count(*) FROM runs").fetchone() == (0,)
    assert con.execute("SELECT count(*) FROM sources").fetchone() == (0,)
    con.close()
