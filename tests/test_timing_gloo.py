"""Time analysis of real gloo runs on CPU (no device activity): generated traces of 2 ranks."""

from __future__ import annotations

from pathlib import Path

import gloo_traces as gloo
import pytest

from commlens.backend.timing.analysis import analyze
from commlens.ingest.inputs import iter_inputs, open_content
from commlens.ingest.kineto import read_timeline
from commlens.ingest.kineto_timeline import RankTimeline


@pytest.fixture(scope="module")
def timelines(gloo_trace_files: list[Path]) -> dict[int, RankTimeline]:
    """The session's gloo traces (conftest.py), read as timelines."""
    out = {}
    for f in iter_inputs(gloo_trace_files):
        with f.open_raw() as raw:
            tl = read_timeline(open_content(raw, f.name), f.name)
        assert tl.rank is not None
        out[tl.rank] = tl
    return out


def test_gloo_without_device(timelines: dict[int, RankTimeline]) -> None:
    for tl in timelines.values():
        assert not tl.has_device and set(tl.intervals.kind) == {"compute", "comm"}
        assert any("no device activity" in n for n in tl.notes)
        assert len(tl.steps.step) == gloo.ACTIVE
        assert all(e is not None for e in tl.calls.end)  # gloo's measured CPU time
    # both ranks ran on this machine: one clock, as the ingest knows from the hosts. Without hosts the offset is
    # estimated from end times, which a loaded machine skews (seen in CI: 164 µs with a 49 µs spread, applied)
    job = analyze(timelines, hosts=dict.fromkeys(timelines, "localhost"))
    inst = job.match.instances
    assert not job.match.mismatches and len(inst) > 0
    assert set(job.match.not_matched) == {"send/recv (point to point, not a group instance)"}
    assert all(m == (0, 1) for m in inst.member_rank)
    assert all(s is not None for s in job.stats.skew_us) and all(r is not None for r in job.stats.real_us)
    b = job.breakdown
    assert len(b.rank) == 2 * gloo.ACTIVE
    for i in range(len(b.rank)):
        parts = [b.compute_us[i], b.overlapped_us[i], b.wait_us[i], b.exposed_us[i], b.memcpy_us[i], b.idle_us[i]]
        assert sum(parts) == pytest.approx(b.step_us[i]) and b.exposed_us[i] + b.wait_us[i] > 0
        assert b.memcpy_us[i] == 0.0 and b.htod_bytes[i] == 0
    assert job.clocks.trusted and not job.clocks.applied
    # without a delay one rank can still arrive last systematically on a loaded machine: only the
    # verdicts' presence is asserted here (the harness --delay runs test the rule itself)
    assert set(job.stragglers.verdicts) == set(inst.group)
