"""NCCL calls written already linked (`ingest.nccl_prelink`), comm_agg joined to the detected iterations as
seq ranges (`aggregates._iteration_ranges`) and the period tokens sorted in numpy (`aggregates._period_calls`)
against what they replace (the link after the write by `link_run`'s UPDATE passes, the join to each call's
comm_iterations row, the lists ordered by DuckDB): the store the same row for
row, on every real NCCL log, on bench-shaped per-process files, with garbled lines, into a run that already
holds NCCL files, and when a planned file fails at its write (its communicators missing: the calls are put
back and linked again)."""

from __future__ import annotations

import random
from pathlib import Path

import duckdb
import pytest
from nccl_bench import nccl_bench

from commlens import store
from commlens.ingest import nccl_prelink
from commlens.ingest.inputs import iter_inputs
from commlens.service.ingest import ingest_run
from commlens.store import aggregates
from commlens.store.tables import AGG_TABLES, TIME_TABLES

# Every table a run's NCCL rows reach, compared whole (rowids too, through comm_agg.first_row).
TABLES = ("comm_events", "nccl_comms", "nccl_topology", "nccl_tuning", "process_groups", *AGG_TABLES, *TIME_TABLES)


def _ingest(db: Path, paths: list[Path], run: str, new: bool, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Split ingest of `paths` into the store at `db`, the new way (calls written linked, iteration ranges)
    or the former (linked after the write, the row join); the files' outcomes, what each link_run found
    (True: the calls were linked already) and whether each refresh joined ranges."""
    found: list[bool] = []
    ranged: list[bool] = []
    matches, iteration_ranges = nccl_prelink.Prelinked.matches, aggregates._iteration_ranges

    def recorded(self, con, run_id, plan):
        found.append(matches(self, con, run_id, plan))
        return found[-1]

    def ranges(*args):
        ranged.append(iteration_ranges(*args) is not None)
        return iteration_ranges(*args) if new else None

    with monkeypatch.context() as m:
        m.setattr(nccl_prelink.Prelinked, "matches", recorded)
        m.setattr(aggregates, "_iteration_ranges", ranges)
        if not new:
            m.setattr(nccl_prelink.Prelinks, "plan", lambda *a, **k: None)
            m.setattr(aggregates, "_SEQ_LIMIT", 0)  # no seq but 0 packs: the lists ordered by DuckDB
        con = store.connect(db)
        try:
            report = ingest_run(con, run, iter_inputs(paths), split_jobs=True)
        finally:
            con.close()
    return {"files": [(Path(f.path).name, f.status, f.run) for f in report.files], "linked": found, "ranged": ranged}


def _tables(db: Path) -> dict[str, tuple[list[str], list[tuple]]]:
    """Each table's columns and rows (but the times they were made), ordered, the run's name for its id."""
    con = duckdb.connect(str(db), read_only=True)
    try:
        names = dict(con.execute("SELECT run_id, name FROM runs").fetchall())
        out = {}
        for table in TABLES:
            cols = [r[0] for r in con.execute(f"DESCRIBE {table}").fetchall() if not r[1].startswith("TIMESTAMP")]
            k = cols.index("run_id")
            rows = con.execute(f"SELECT {', '.join(cols)} FROM {table}").fetchall()
            out[table] = (
                cols,
                sorted((tuple(names[r[k]] if i == k else v for i, v in enumerate(r)) for r in rows), key=repr),
            )
        return out
    finally:
        con.close()


def _same_both_ways(tmp_path: Path, batches: list[list[Path]], run: str, monkeypatch) -> tuple[dict, list[dict]]:
    """Ingest the batches one after the other, each way into a store of its own; assert the stores equal;
    the tables and the prelinked side's reports."""
    reports = {}
    for prelink in (False, True):
        db = tmp_path / f"{'pre' if prelink else 'after'}.duckdb"
        reports[prelink] = [_ingest(db, paths, run, prelink, monkeypatch) for paths in batches]
    after, pre = _tables(tmp_path / "after.duckdb"), _tables(tmp_path / "pre.duckdb")
    assert [r["files"] for r in reports[True]] == [r["files"] for r in reports[False]]
    for table in TABLES:
        assert pre[table][1] == after[table][1], table
    return pre, reports[True]


def _column(tables: dict, table: str, name: str) -> list:
    cols, rows = tables[table]
    return [r[cols.index(name)] for r in rows]


def test_real_logs_linked_before_the_write(tmp_path, data_dir, monkeypatch):
    logs = sorted((data_dir / "nccl-logs").glob("*.log"))
    assert len(logs) >= 10
    pre, (report,) = _same_both_ways(tmp_path, [logs], "real", monkeypatch)
    runs = {f[2] for f in report["files"]}
    assert len(runs) >= 10 and report["linked"] == [True] * len(runs)  # every run's calls went in linked
    assert report["ranged"] == [True] * len(runs)
    # the excerpts' few COLL lines name communicators no init line of theirs describes: provisional keys
    assert len(_column(pre, "comm_events", "group_key")) >= 20 and len(_column(pre, "nccl_comms", "group_key")) >= 20


def test_bench_per_process_files(tmp_path, monkeypatch):
    folder = tmp_path / "pp"
    nccl_bench().write_per_process(folder, 16_000, "2.21.5")
    files = sorted(folder.iterdir())
    pre, (report,) = _same_both_ways(tmp_path, [files], "pp", monkeypatch)
    assert report["linked"] == [True] and report["ranged"] == [True]
    assert [f[1] for f in report["files"]] == ["ok"] * 8
    # planted: a 2 x 2 x 2 job; the pp Send/Recv peers are global ranks 4 apart
    events = pre["comm_events"]
    cols = events[0]
    p2p = [(r[cols.index("rank")], r[cols.index("peer")]) for r in events[1] if r[cols.index("op")] in ("send", "recv")]
    assert p2p and all(abs(rank - peer) == 4 for rank, peer in p2p)
    assert set(_column(pre, "comm_events", "rank")) == set(range(8))


def test_garbled_interleaved_log(tmp_path, monkeypatch):
    clean = tmp_path / "clean.log"
    nccl_bench().write_interleaved(clean, 30_000, "2.28.3")
    lines = clean.read_text().splitlines()
    rnd = random.Random(5)
    for i in sorted(rnd.sample(range(200, len(lines)), 40), reverse=True):
        if "opCount" in lines[i]:
            lines.insert(i, lines[i][: lines[i].index(" count ")] + " count zz")  # a COLL line cut and damaged
        else:
            lines[i] = lines[i][: len(lines[i]) // 2]  # any other line cut in half
    path = tmp_path / "garbled.log"
    path.write_text("\n".join(lines) + "\n")
    pre, (report,) = _same_both_ways(tmp_path, [[path]], "garbled", monkeypatch)
    assert report["linked"] == [True] and report["ranged"] == [True] and report["files"][0][1] == "ok"
    assert len(set(_column(pre, "process_groups", "group_key"))) >= 4
    assert _column(pre, "agg_sources", "rank_key") == ["0"]  # of 8 ranks' calls, the smallest key (not any)


def test_into_a_run_that_already_holds_nccl_files(tmp_path, monkeypatch):
    folder = tmp_path / "pp"
    nccl_bench().write_per_process(folder, 8_000, "2.21.5")
    files = sorted(folder.iterdir())
    _, reports = _same_both_ways(tmp_path, [files[:3], files[3:]], "pp", monkeypatch)
    assert [r["linked"] for r in reports] == [[True], []]  # the second batch is linked after its write


def test_a_planned_file_failing_at_its_write(tmp_path, monkeypatch):
    """A file whose write fails (a value the store refuses) had its communicators in the plan: the other files'
    calls, written linked without them, go back as parsed and are linked after, as before."""
    folder = tmp_path / "pp"
    nccl_bench().write_per_process(folder, 8_000, "2.21.5")
    files = sorted(folder.iterdir())
    write_result = store.write_result

    def refusing(con, run_id, path, sha256, size, result):
        if path == str(files[2]):
            raise duckdb.ConversionException("a value out of range (planted)")
        return write_result(con, run_id, path, sha256, size, result)

    monkeypatch.setattr(store, "write_result", refusing)
    pre, (report,) = _same_both_ways(tmp_path, [files], "pp", monkeypatch)
    assert [f[1] for f in report["files"]] == ["ok", "ok", "failed", "ok", "ok", "ok", "ok", "ok"]
    assert report["linked"] == [False]
    assert set(_column(pre, "comm_events", "rank")) == {0, 1, 3, 4, 5, 6, 7}


def test_real_profile_unchanged(tmp_path, data_dir, monkeypatch):
    """A Kineto trace (no NCCL rows): the same store both ways, iteration ranges or not."""
    pre, (report,) = _same_both_ways(tmp_path, [[data_dir / "kineto-param/dlrm_kineto.tar.gz"]], "dlrm", monkeypatch)
    assert report["ranged"] == [True] and len(pre["comm_agg"][1]) >= 4
