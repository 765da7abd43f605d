"""The time analysis holds one rank's timeline at a time: `persist.load_run` leaves the intervals in the store
and `analyze_columns` reads each rank's (`intervals_of`) when it reaches that rank, building its spans,
breakdown, memcpy lane and its part of the critical paths, then lets them go before the next rank.

Checked on DLRM's 8 real ranks, a real gloo trace (CPU-only timeline) and the harness's 4-rank dp x tp run
with a planted straggler (tests/harness_runs.py, launched once per session): the tables are the ones the analysis gives with every rank's intervals in memory, to the bit; the reader is
asked once per rank, in rank order; and when it is asked for a rank, nothing holds the previous rank's
interval arrays any more."""

from __future__ import annotations

import gc
import struct
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import shared_data
from harness_runs import HarnessRuns, named

from commlens import store
from commlens.backend.timing import persist
from commlens.backend.timing.analysis import analyze_columns
from commlens.backend.timing.model import IntervalArrays
from commlens.harness import launch
from commlens.ingest.inputs import iter_inputs
from commlens.service.ingest import ingest_run

TRACES = ["kineto-param/dlrm_kineto.tar.gz", "kineto-hta/rank_non_gpu"]


def _exact(tables: dict[str, Any]) -> dict[str, dict[str, list[Any]]]:
    """Every column as a list, floats by their bytes (NaN and -0.0 included)."""
    out = {}
    for name, cols in tables.items():
        out[name] = {}
        for k, v in cols.items():
            values = v.to_pylist() if hasattr(v, "to_pylist") else v.tolist() if isinstance(v, np.ndarray) else v
            out[name][k] = [struct.pack("d", x) if isinstance(x, float) else x for x in values]
    return out


@pytest.mark.parametrize("trace", TRACES)
def test_real_traces(tmp_path: Path, trace: str) -> None:
    con = store.connect(tmp_path / "t.duckdb")
    report = ingest_run(con, "job", iter_inputs([shared_data() / trace]))
    assert all(f.status == "ok" for f in report.files), [f.error for f in report.files]
    _one_rank_at_a_time_gives_the_whole_run_analysis(con, ranks=8 if "dlrm" in trace else 1)
    con.close()


@pytest.mark.slow
def test_harness_dp_tp_straggler_run(harness_runs: HarnessRuns, tmp_path: Path) -> None:
    db = tmp_path / "h.duckdb"
    assert not launch.ingest_run(db, named(harness_runs.straggler("dp-tp-delay"), "job")).failed
    con = store.connect(db)
    _one_rank_at_a_time_gives_the_whole_run_analysis(con, ranks=4)
    con.close()


def _one_rank_at_a_time_gives_the_whole_run_analysis(con: Any, ranks: int) -> None:
    run_id = int(con.execute("SELECT run_id FROM runs WHERE name = 'job'").fetchall()[0][0])
    data = persist.load_run(con, run_id)
    assert data.interval_counts and all(not len(d.intervals) for d in data.ranks.values())
    assert sum(data.interval_counts.values()) == con.execute("SELECT count(*) FROM timeline_intervals").fetchall()[0][0]

    held = {r: replace(d, intervals=data.intervals(r)) for r, d in data.ranks.items()}
    whole = analyze_columns(held, data.calls, data.world_size, data.hosts, data.schemes)
    del held

    asked: list[int] = []
    alive: list[weakref.ref[np.ndarray]] = []

    def intervals_of(rank: int) -> IntervalArrays:
        gc.collect()
        assert all(ref() is None for ref in alive), f"rank {asked[-1]}'s intervals are still held at rank {rank}"
        alive.clear()
        iv = data.intervals(rank)
        alive.extend(weakref.ref(a) for a in (iv.kind, iv.stream, iv.start, iv.end, iv.nbytes))
        asked.append(rank)
        return iv

    streamed = analyze_columns(
        data.ranks, data.calls, data.world_size, data.hosts, data.schemes, intervals_of=intervals_of
    )
    assert asked == sorted(data.ranks)
    assert len(asked) == ranks
    assert _exact(persist.result_tables(data, streamed)) == _exact(persist.result_tables(data, whole))
    # and what ingest stored is that analysis
    stored = persist.analysed_tables(con, run_id)
    assert _exact(stored) == _exact(persist.result_tables(data, whole))
