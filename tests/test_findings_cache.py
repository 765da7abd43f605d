"""Findings kept per version of the run (backend/run_cache.py): a repeated request is answered from the
cache, and every kind of write to the run (a scheme override with its re-analysis, a config, a new file) and an
ingest job in progress make the next request compute them again, equal to findings computed afresh."""

from __future__ import annotations

from collections.abc import Callable

import duckdb
import pytest

from commlens.backend.findings import findings
from commlens.backend.iterations import UnknownRunError
from commlens.backend.run_cache import cached_findings, run_version
from commlens.contract.analysis import Finding
from commlens.service.schemes import override_scheme

DLRM = "kineto-param/dlrm_kineto.tar.gz"
LOG = "nccl-logs/nvidia-nccl-1238.log"


def test_findings_are_kept_until_the_run_changes(resnet: duckdb.DuckDBPyConnection) -> None:
    con = resnet
    calls: list[int] = []

    def counted() -> Callable[[], list[Finding]]:
        def compute() -> list[Finding]:
            calls.append(1)
            return findings(con, "resnet")

        return compute

    first = cached_findings(con, "resnet", counted())
    again = cached_findings(con, "resnet", counted())
    assert len(calls) == 1 and again == first and [f.id for f in first] == [f.id for f in findings(con, "resnet")]

    # a scheme override re-analyses the run in one transaction: computed again, equal to a fresh computation
    (group,) = con.execute("SELECT group_key FROM process_groups LIMIT 1").fetchall()[0]
    before = run_version(con, "resnet")
    override_scheme(con, "resnet", group, "tp", "test")
    assert run_version(con, "resnet") != before
    changed = cached_findings(con, "resnet", counted())
    assert len(calls) == 2 and changed == findings(con, "resnet")

    # a config written to the run
    con.execute("UPDATE runs SET config = '{\"parallel\": {\"dp\": 8}}' WHERE name = 'resnet'")
    cached_findings(con, "resnet", counted())
    assert len(calls) == 3

    # an ingest job queued for the run: nothing is kept while it writes
    con.execute(
        "INSERT INTO jobs (job_id, run_id, state) SELECT 'j1', run_id, 'running' FROM runs WHERE name = 'resnet'"
    )
    assert run_version(con, "resnet") is None
    cached_findings(con, "resnet", counted())
    cached_findings(con, "resnet", counted())
    assert len(calls) == 5
    con.execute("UPDATE jobs SET state = 'done'")

    # the job wrote nothing: the findings kept before it
    cached_findings(con, "resnet", counted())
    assert len(calls) == 5

    # a new file of the run: computed again (its aggregates refreshed meanwhile, so kept only the next time)
    con.execute(
        "INSERT INTO sources (run_id, path, kind, sha256, size_bytes, status) "
        "SELECT run_id, 'more.json', 'kineto', 'f00d', 1, 'ok' FROM runs WHERE name = 'resnet'"
    )
    assert cached_findings(con, "resnet", counted()) == findings(con, "resnet") and len(calls) == 6
    cached_findings(con, "resnet", counted())
    cached_findings(con, "resnet", counted())
    assert len(calls) == 7

    # a write landing while the findings are computed: the result is returned, not kept
    def racing() -> list[Finding]:
        calls.append(1)
        con.execute("UPDATE runs SET description = 'edited meanwhile' WHERE name = 'resnet'")
        return findings(con, "resnet")

    con.execute("UPDATE runs SET description = 'edited' WHERE name = 'resnet'")
    cached_findings(con, "resnet", racing)
    cached_findings(con, "resnet", counted())
    cached_findings(con, "resnet", counted())
    assert len(calls) == 9

    with pytest.raises(UnknownRunError):
        cached_findings(con, "nope", counted())
