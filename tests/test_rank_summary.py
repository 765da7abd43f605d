"""The rank summary's bands on a run smaller than a band: DLRM's 8 ranks were labelled "ranks 0-31"."""

from __future__ import annotations

from commlens.backend.ranks import rank_summary
from commlens.ingest.inputs import iter_inputs
from commlens.service.ingest import ingest_run


def test_a_band_ends_at_the_runs_last_rank(con, data_dir) -> None:
    ingest_run(con, "dlrm", iter_inputs([data_dir / "kineto-param/dlrm_kineto.tar.gz"]))
    s = rank_summary(con, "dlrm")
    assert [(g.label, g.first, g.last, g.members) for g in s.groups] == [("ranks 0-7", 0, 7, 8)]
