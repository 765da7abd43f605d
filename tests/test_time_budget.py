"""The time analysis within its memory budget (backend/timing/budget.py): a run whose analysis would need more than
the budget is not analysed (time_status says why, and the run's other analyses answer as before), instead of the
process being killed for its memory; analyses that do not fit together wait for each other."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from commlens.backend.histograms import histogram
from commlens.backend.timing import budget
from commlens.service.ingest import ingest_paths

TRACE = "kineto-param/dlrm_kineto.tar.gz"  # 8 ranks: calls, timeline intervals and matched instances


def _status(con, run: str) -> list[tuple]:
    return con.execute(
        "SELECT part, ok, reason FROM time_status JOIN runs USING (run_id) WHERE name = ? ORDER BY part, reason",
        [run],
    ).fetchall()


def _rows(con, table: str, run: str) -> int:
    return con.execute(f"SELECT count(*) FROM {table} JOIN runs USING (run_id) WHERE name = ?", [run]).fetchone()[0]


def test_a_run_over_the_budget_is_not_analysed_and_says_why(con, data_dir: Path, monkeypatch) -> None:
    assert not ingest_paths(con, [data_dir / TRACE], "fits").failed
    assert _rows(con, "time_instances", "fits") == 8 and all(ok for _, ok, _ in _status(con, "fits"))
    calls, intervals, need = budget.estimate(
        con, con.execute("SELECT run_id FROM runs WHERE name = 'fits'").fetchone()[0]
    )
    per_run = con.execute("SELECT count(*) FROM timeline_intervals JOIN runs USING (run_id) WHERE name = 'fits'")
    cached = per_run.fetchall()[0][0] * budget.CACHED_INTERVAL_BYTES
    assert calls == 8 * 8 and need == calls * budget.CALL_BYTES + intervals * budget.INTERVAL_BYTES + cached
    # a rank's intervals are held during its turn only: the estimate counts the largest rank's (DLRM: rank 3's 335)
    per_rank = con.execute(
        "SELECT count(*) FROM timeline_intervals JOIN runs USING (run_id) WHERE name = 'fits' GROUP BY rank"
    ).fetchall()
    assert len(per_rank) == 8 and intervals == max(n for (n,) in per_rank) < sum(n for (n,) in per_rank)

    monkeypatch.setenv(budget.ENV, f"{need - 1}")
    assert not ingest_paths(con, [data_dir / TRACE], "over").failed
    ((part, ok, reason),) = _status(con, "over")
    assert (part, ok) == ("matching", False)
    assert reason == (
        f"not computed: the time analysis of 64 calls, with {intervals:,} timeline intervals on its largest rank, "
        f"needs about {need / 1e3:.1f} kB, more than the {(need - 1) / 1e3:.1f} kB it may use ({budget.ENV}); the "
        "run's other analyses are unaffected"
    )
    assert 10**3 <= need < 10**6
    assert _rows(con, "time_instances", "over") == _rows(con, "time_breakdown", "over") == 0
    assert histogram(con, "over").series == histogram(con, "fits").series != []

    monkeypatch.setenv(budget.ENV, f"{need}")  # exactly enough
    assert not ingest_paths(con, [data_dir / TRACE], "exactly").failed
    assert _rows(con, "time_instances", "exactly") == 8


def test_sizes_and_the_default_budget(monkeypatch) -> None:
    assert [budget.parse_size(t) for t in ("8GB", "512 MiB", "1.5GiB", "1000", "2kb")] == [
        8 * 10**9,
        512 * 2**20,
        3 * 2**29,
        1000,
        2000,
    ]
    with pytest.raises(ValueError, match=budget.ENV):
        budget.parse_size("lots")
    assert [budget._size(n) for n in (999, 1000, 5_300_000, 2 * 10**9)] == ["999 B", "1.0 kB", "5.3 MB", "2.0 GB"]
    monkeypatch.delenv(budget.ENV, raising=False)
    total, source = budget.budget()
    assert total == int(budget.machine_memory() * budget.SHARE) > 0 and budget.ENV in source


def test_analyses_that_do_not_fit_together_wait_for_each_other() -> None:
    shared = budget.MemoryBudget()
    order: list[str] = []
    first_in = threading.Event()

    def first() -> None:
        with shared.reserve(60, 100):
            order.append("first in")
            first_in.set()
            time.sleep(0.3)
            order.append("first out")

    def second() -> None:
        first_in.wait()
        with shared.reserve(60, 100):
            order.append("second in")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert order == ["first in", "first out", "second in"]
    with shared.reserve(40, 100), shared.reserve(60, 100):  # these two fit together: no wait
        pass


def test_the_command_line_refuses_a_budget_that_is_not_a_size(tmp_path: Path, data_dir: Path) -> None:
    """Said at once, before anything is stored (it was a traceback per analysis after the ingest, exit status 0)."""
    env = dict(os.environ, **{budget.ENV: "lots"})
    db = tmp_path / "s.duckdb"
    proc = subprocess.run(
        [sys.executable, "-m", "commlens.cli", "ingest", str(data_dir / TRACE), "--db", str(db)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip() == f"error: {budget.ENV}='lots' is not a size (write e.g. 8GB, 512MiB or a number of bytes)"
    )
    assert not db.exists()
