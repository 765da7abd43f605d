"""The time analysis of runs without times (NCCL logs) against the general path, row for row.

A run whose calls carry no time is read by `persist.load_untimed`, matching groups the calls by a radix
sort (`ordering.stable_order`), and `instance_stats` returns the all-None numbers at once. The reference
is the general path, called explicitly: `load_run`, np.lexsort, and instance_stats's whole computation.
Every time table of the run, every row in its stored order, must be the same: on every real NCCL log,
on bench-shaped logs (interleaved and per process; with garbled lines; with calls lost on one member;
with every opCount 0, so matched by call order, and a call lost mid-way), and the runs the untimed path
must leave to the general one (a profiler trace: DLRM)."""

from __future__ import annotations

import random
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pytest
from nccl_bench import nccl_bench

from commlens.backend.timing import instances, matching, ordering, persist
from commlens.ingest.inputs import iter_inputs
from commlens.service.ingest import ingest_run
from commlens.store.tables import TIME_TABLES


def _lexsort(*keys):
    return np.lexsort(keys[::-1])


def _run_id(con: duckdb.DuckDBPyConnection, run: str) -> int:
    return int(con.execute("SELECT run_id FROM runs WHERE name = ?", [run]).fetchall()[0][0])


def _rows(con: duckdb.DuckDBPyConnection, run_id: int) -> dict[str, list[tuple]]:
    """Every time table's rows of the run, in their stored order."""
    return {
        t: con.execute(f"SELECT * EXCLUDE (run_id) FROM {t} WHERE run_id = ? ORDER BY rowid", [run_id]).fetchall()
        for t in TIME_TABLES
    }


def _ingest(con: duckdb.DuckDBPyConnection, run: str, paths: list[Path]) -> int:
    report = ingest_run(con, run, iter_inputs(paths))
    assert all(f.status == "ok" for f in report.files), [f.error for f in report.files]
    return _run_id(con, run)


def _same_as_general(con: duckdb.DuckDBPyConnection, run_id: int, monkeypatch, untimed: bool = True) -> dict:
    """The run's time tables as the ingest stored them, checked against the general path's, which then
    replaces them (so a difference in what either writes shows)."""
    data = persist.load_untimed(con, run_id)
    assert (data is not None) == untimed
    stored = _rows(con, run_id)
    with monkeypatch.context() as m:
        m.setattr(matching, "stable_order", _lexsort)
        m.setattr(instances, "_no_start_times", lambda arrivals: False)
        general = persist.load_run(con, run_id)
        if data is not None:
            for name in general.calls.__dataclass_fields__:
                a, b = getattr(general.calls, name), getattr(data.calls, name)
                if isinstance(a, np.ndarray):
                    assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), name
                else:
                    assert a == b, name
            assert (data.ranks.keys(), data.world_size, data.hosts, data.schemes, data.timed, data.source_notes) == (
                general.ranks.keys(),
                general.world_size,
                general.hosts,
                general.schemes,
                general.timed,
                general.source_notes,
            )
        persist.write_tables(con, run_id, persist.analysed_tables(con, run_id, general=True))
    assert _rows(con, run_id) == stored
    return stored


def _status(rows: dict) -> list[tuple[str, bool, str]]:
    return rows["time_status"]


def test_every_real_nccl_log(con, data_dir, monkeypatch):
    logs = sorted((data_dir / "nccl-logs").glob("*.log"))
    assert len(logs) >= 10
    nothing = [("matching", False, "no call of a known rank: nothing to match")]
    for i, log in enumerate(logs):
        assert _status(_same_as_general(con, _ingest(con, f"log{i}", [log]), monkeypatch)) == nothing
    run_id = _ingest(con, "all", logs)
    assert _status(_same_as_general(con, run_id, monkeypatch)) == nothing
    # excerpts: their calls are stored, but no excerpt has the Init lines that give a call its rank
    calls = con.execute("SELECT count(*), count(rank) FROM comm_events WHERE run_id = ?", [run_id]).fetchall()
    assert calls == [(26, 0)]


@pytest.fixture(scope="module")
def bench_log(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("untimed") / "job.log"
    nccl_bench().write_interleaved(path, 24_000, "2.21.5")
    return path


def test_bench_shaped_log(con, bench_log, monkeypatch):
    out = _same_as_general(con, _ingest(con, "whole", [bench_log]), monkeypatch)
    n = len(out["time_instances"])
    assert n > 5000
    assert {r[8] for r in out["time_instances"]} == {"key"}  # keyed_by: opCount
    assert all(r[10:] == (None,) * 8 for r in out["time_instances"])  # no time: no arrival, skew, bandwidth, wait
    assert len(out["time_instance_members"]) == sum(r[9] for r in out["time_instances"])
    assert {r[2] for r in out["time_mismatches"]} == {"missing on a member"}  # the processes stop mid-iteration
    assert out["time_rank_totals"] == [(r, 0, 0, 0, 0.0, 0.0, None, None, None) for r in range(8)]
    status = {(part, reason) for part, ok, reason in _status(out) if not ok}
    assert ("memcpy", "no device activity recorded (no profiler trace with CUDA activity): no memcpy lane") in status


def test_logs_of_two_hosts_have_no_clocks_to_align(con, tmp_path, monkeypatch) -> None:
    """The per-process logs of two hosts: no call has a time, so there is nothing to align; it read "clocks not
    aligned: host B: 0 instances shared with host A (need 5)", host A's ranks with every instance of the run."""
    nccl_bench().write_per_process(tmp_path / "job", 8_000, "2.21.5")
    for f in sorted((tmp_path / "job").iterdir())[4:]:
        f.write_text(f.read_text().replace("gpu-a100-017", "gpu-a100-018"))
    out = _same_as_general(con, _ingest(con, "two", sorted((tmp_path / "job").iterdir())), monkeypatch)
    assert ("clocks", False, "the calls carry no times (NCCL logs): no clocks to align") in _status(out)
    offsets = out["time_clock_offsets"]
    assert {r[1] for r in offsets} == {"gpu-a100-017", "gpu-a100-018"} and {r[5] for r in offsets} == {0}


def test_bench_shaped_log_with_losses_and_garbled_lines(tmp_path, con, bench_log, monkeypatch):
    lines = bench_log.read_text().splitlines()
    # 5 all-gathers of process 3 lost, and 20 COLL lines cut and damaged
    lost = {i for i, line in enumerate(lines) if ":52151:52151 [3]" in line and "AllGather: opCount" in line}
    lost = set(sorted(lost)[5:10])
    rnd = random.Random(5)
    garbled = sorted(rnd.sample([i for i, line in enumerate(lines) if "opCount" in line and i not in lost], 20))
    out_lines = []
    for i, line in enumerate(lines):
        if i in lost:
            continue
        if i in garbled:
            out_lines.append(line[: line.index(" count ")] + " count zz")
        out_lines.append(line)
    path = tmp_path / "damaged.log"
    path.write_text("\n".join(out_lines) + "\n")
    whole = _same_as_general(con, _ingest(con, "whole", [bench_log]), monkeypatch)
    out = _same_as_general(con, _ingest(con, "damaged", [path]), monkeypatch)
    assert len(out["time_instances"]) == len(whole["time_instances"]) - 5
    assert len(out["time_mismatches"]) == len(whole["time_mismatches"]) + 5


def test_per_process_files(tmp_path, con, monkeypatch):
    nccl_bench().write_per_process(tmp_path / "pp", 16_000, "2.21.5")
    files = sorted((tmp_path / "pp").iterdir())
    out = _same_as_general(con, _ingest(con, "pp", files), monkeypatch)
    assert len(files) == 8 and len(out["time_instances"]) > 3000
    members = {r[2] for r in out["time_instance_members"]}  # source_id: one file per rank
    assert len(members) == 8


def test_order_matched_log_with_a_lost_call(tmp_path, con, bench_log, monkeypatch):
    """NCCL 2.27+ logs every opCount as 0: members are paired by call order, and a lost call stops its
    communicator's pairing at the first disagreement."""
    lines = [_zero_op_count(line) for line in bench_log.read_text().splitlines()]
    zero = tmp_path / "zero.log"
    zero.write_text("\n".join(lines) + "\n")
    out = _same_as_general(con, _ingest(con, "zero", [zero]), monkeypatch)
    assert {r[8] for r in out["time_instances"]} == {"order"}
    drop = [i for i, line in enumerate(lines) if ":52151:52151 [3]" in line and "ReduceScatter: opCount" in line][40]
    lost = tmp_path / "zero-lost.log"
    lost.write_text("\n".join(line for i, line in enumerate(lines) if i != drop) + "\n")
    cut = _same_as_general(con, _ingest(con, "zero-lost", [lost]), monkeypatch)
    assert "sizes disagree" in {r[2] for r in cut["time_mismatches"]}
    assert any("calls after an order disagreement" in r[0] for r in cut["time_unmatched"])
    assert len(cut["time_instances"]) < len(out["time_instances"])


def _zero_op_count(line: str) -> str:
    at = line.find(": opCount ")
    if at < 0:
        return line
    start = at + len(": opCount ")
    return line[:start] + "0" + line[line.index(" ", start) :]


def test_a_profiler_trace_takes_the_general_path(con, data_dir, monkeypatch):
    run_id = _ingest(con, "dlrm", [data_dir / "kineto-param/dlrm_kineto.tar.gz"])
    out = _same_as_general(con, run_id, monkeypatch, untimed=False)
    assert len(out["time_instances"]) == 8


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stable_order_is_lexsorts(seed):
    rnd = np.random.default_rng(seed)
    n = 5000
    small = [rnd.integers(0, 8, n), rnd.integers(3, 40, n)]  # packs into 16 bits: radix sort
    wide = [rnd.integers(0, 8, n), rnd.integers(0, 1 << 20, n)]  # does not: lexsort
    for keys in (small, wide, small[:1], [rnd.integers(-5, 5, n)]):
        assert np.array_equal(ordering.stable_order(*keys), np.lexsort(keys[::-1]))
    assert len(ordering.stable_order(np.zeros(0, dtype=np.int64))) == 0


def test_strings_are_stored_as_the_plain_strings_were():
    """Instance columns go to DuckDB dictionary encoded; stored, they are the strings a `take` gave."""
    vocab = ["dp", None, "nccl:0x6a00000000000164", ""]
    codes = np.asarray([0, 1, 2, -1, 3, 2, 0], dtype=np.int64)
    plain = pa.array(vocab, type=pa.string()).take(pa.array(codes, mask=codes < 0))
    encoded = persist._strings(vocab, codes)
    assert encoded.dictionary_decode().equals(plain)
    con = duckdb.connect()
    con.execute("CREATE TABLE t (i INTEGER, s VARCHAR)")
    for i, column in enumerate((plain, encoded)):
        con.register("v", pa.table({"s": column}))
        con.execute("INSERT INTO t SELECT ?, s FROM v", [i])
        con.unregister("v")
    rows = [con.execute("SELECT s FROM t WHERE i = ? ORDER BY rowid", [i]).fetchall() for i in (0, 1)]
    assert (
        rows[0]
        == rows[1]
        == [("dp",), (None,), ("nccl:0x6a00000000000164",), (None,), ("",), ("nccl:0x6a00000000000164",), ("dp",)]
    )
