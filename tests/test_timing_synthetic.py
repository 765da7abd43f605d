"""Time analysis on built inputs: mismatches, clocks that cannot be aligned, a consistent straggler,
keyed (PyTorch Seq) matching and a trace without device activity."""

from __future__ import annotations

import pytest
from conftest import shared_data

from commlens.backend.timing.analysis import analyze
from commlens.backend.timing.clocks import align_clocks
from commlens.backend.timing.matching import match_instances
from commlens.backend.timing.stragglers import rank_totals
from commlens.ingest.inputs import iter_inputs, open_content
from commlens.ingest.kineto import read_timeline
from commlens.ingest.kineto_timeline import CallColumns, IntervalColumns, RankTimeline, StepColumns


def _rank(
    rank: int, calls: list[tuple[str, int, float, float, int | None, int]], steps: int = 1, step_us: float = 1000.0
) -> RankTimeline:
    """calls: (op, bytes, arrival, end, seq key, step)."""
    c = CallColumns()
    iv = IntervalColumns()
    for i, (op, size, a, e, key, st) in enumerate(calls):
        for col, v in (
            ("seq", i),
            ("op", op),
            ("dtype", "float32"),
            ("msg_bytes", size),
            ("group_key", None),
            ("group_name", None),
            ("group_desc", None),
            ("group_ranks", None),
            ("group_size", None),
            ("match_key", key),
            ("step", st),
            ("cpu_start", a),
            ("cpu_end", a),
            ("dev_start", a),
            ("dev_end", e),
            ("arrival", a),
            ("end", e),
        ):
            getattr(c, col).append(v)
        for col, v in (("kind", "comm"), ("stream", 7), ("start", a), ("end", e), ("nbytes", 0)):
            getattr(iv, col).append(v)
    s = StepColumns(list(range(steps)), [k * step_us for k in range(steps)], [(k + 1) * step_us for k in range(steps)])
    return RankTimeline(f"r{rank}", rank, 2, True, iv, s, c)


def test_missing_call_and_disagreeing_op_reported_with_both_sides() -> None:
    r0 = _rank(
        0,
        [("all_reduce", 64, 10, 20, None, 0), ("all_gather", 64, 30, 40, None, 0), ("all_reduce", 8, 50, 60, None, 0)],
    )
    r1 = _rank(1, [("all_reduce", 64, 12, 20, None, 0), ("reduce_scatter", 64, 30, 40, None, 0)])
    m = match_instances({0: r0.calls, 1: r1.calls})
    assert len(m.instances) == 1
    (bad,) = m.mismatches
    assert (bad.position, bad.reason, bad.rank_a, bad.rank_b) == (1, "ops disagree", 0, 1)
    assert "all_gather" in (bad.side_a or "") and "reduce_scatter" in (bad.side_b or "")
    assert m.not_matched["group world: calls after an order disagreement (not paired)"] == 1


def test_keyed_matching_pairs_by_seq_not_order() -> None:
    r0 = _rank(0, [("all_reduce", 64, 10, 20, 1, 0), ("all_reduce", 64, 30, 40, 2, 0)])
    r1 = _rank(1, [("all_reduce", 64, 32, 40, 2, 0)])  # seq 1 missing on rank 1
    m = match_instances({0: r0.calls, 1: r1.calls})
    assert m.instances.key == [2] and m.instances.keyed_by == ["key"]
    (miss,) = m.mismatches
    assert (miss.position, miss.reason, miss.rank_b, miss.side_b) == (1, "missing on a member", 1, None)


def test_a_key_seen_twice_on_a_rank_pairs_its_last_call() -> None:
    r0 = _rank(0, [("all_reduce", 64, 10, 20, 1, 0), ("all_reduce", 64, 30, 40, 2, 0)])
    r1 = _rank(
        1, [("all_reduce", 64, 12, 20, 1, 0), ("all_reduce", 64, 33, 40, 1, 0), ("all_reduce", 64, 35, 40, 2, 0)]
    )
    m = match_instances({0: r0.calls, 1: r1.calls})
    assert m.instances.key == [1, 2] and not m.mismatches
    assert m.instances.member_seq == [(0, 1), (1, 2)] and m.instances.member_arrival == [(10, 33), (30, 35)]


def test_size_must_agree_except_all_to_all() -> None:
    r0 = _rank(0, [("all_to_all", 64, 10, 20, None, 0), ("all_reduce", 64, 30, 40, None, 0)])
    r1 = _rank(1, [("all_to_all", 96, 10, 20, None, 0), ("all_reduce", 32, 30, 40, None, 0)])
    m = match_instances({0: r0.calls, 1: r1.calls})
    assert m.instances.op == ["all_to_all"] and m.mismatches[0].reason == "sizes disagree"


def test_clocks_of_two_hosts_aligned_or_refused() -> None:
    n = 6
    r0 = _rank(0, [("all_reduce", 64, 100 * k, 100 * k + 50, None, 0) for k in range(n)])
    r1 = _rank(1, [("all_reduce", 64, 100 * k + 5000, 100 * k + 5050, None, 0) for k in range(n)])
    m = match_instances({0: r0.calls, 1: r1.calls})
    hosts = {0: "a", 1: "b"}
    ok = align_clocks(m.instances, [0, 1], hosts)
    assert ok.applied and ok.offsets == {0: 0.0, 1: -5000.0}
    few = align_clocks(m.instances, [0, 1], hosts, min_instances=10)
    assert not few.applied and not few.trusted and "need 10" in few.reason
    r1b = _rank(1, [("all_reduce", 64, 100 * k, 100 * k + 50 + (400 if k % 2 else -400), None, 0) for k in range(n)])
    m2 = match_instances({0: r0.calls, 1: r1b.calls})
    bad = align_clocks(m2.instances, [0, 1], hosts)
    assert not bad.applied and "inconsistent" in bad.reason
    job = analyze({0: r0, 1: r1b}, hosts=hosts)
    assert job.stats.skew_us == [None] * n and "skew and waits not computed" in job.stats.notes[0]
    assert job.paths[0].note is not None and job.paths[0].note.startswith("no path across ranks")


def test_consistent_straggler_named_and_no_delay_gives_none() -> None:
    steps = 4
    calls0 = [
        ("all_reduce", 1 << 20, 1000 * s + 100 * k, 1000 * s + 100 * k + 90, None, s)
        for s in range(steps)
        for k in range(3)
    ]
    late = [(op, b, a + 60, e, key, st) for op, b, a, e, key, st in calls0]
    job = analyze({0: _rank(0, calls0, steps), 1: _rank(1, late, steps)}, schemes={"world": "dp"})
    (s,) = job.stragglers.stragglers
    assert (s.rank, s.scheme, s.steps_mostly_last, s.steps) == (1, "dp", 4, 4)
    assert s.imposed_us_per_step == pytest.approx(3 * 60)
    b = job.breakdown
    assert b.wait_us[0] == pytest.approx(3 * 60) and b.wait_us[b.rank.tolist().index(1)] == 0.0
    assert {sc for _, _, sc, *_ in b.by_scheme} == {"dp"}
    even = analyze({0: _rank(0, calls0, steps), 1: _rank(1, calls0, steps)})
    assert even.stragglers.stragglers == [] and even.stragglers.verdicts["world"].startswith("no straggler")


def test_waits_for_calls_in_flight_together_count_once() -> None:
    """DDP's buckets: rank 1 issues both of a step's all_reduces at +90 us, rank 0 at 0 and +10 and waits for
    both at once. It waits 90 us a step, not 90 + 80: the straggler imposes 90 us per step, and the rank totals
    count the time rank 0 spent waiting, as the breakdown does."""
    steps = 6
    early = [
        ("all_reduce", 1 << 20, 1000 * s + 10 * k, 1000 * s + 100 + 10 * k, None, s)
        for s in range(steps)
        for k in range(2)
    ]
    late = [(op, b, 1000 * st + 90, e, key, st) for op, b, a, e, key, st in early]  # both issued at +90
    job = analyze({0: _rank(0, early, steps), 1: _rank(1, late, steps)}, schemes={"world": "dp"})
    assert job.stats.member_wait_us[:2] == [(90.0, 0.0), (80.0, 0.0)]  # each instance keeps its own wait
    (s,) = job.stragglers.stragglers
    assert (s.rank, s.steps_mostly_last) == (1, steps)
    assert s.imposed_us_per_step == pytest.approx(90.0)  # the union of [0, 90] and [10, 90]
    t = rank_totals(job.match.instances, job.stats)
    totals = dict(zip(t.rank, t.wait_us, strict=True))
    assert totals[0] == pytest.approx(90.0 * steps) and totals[1] == 0.0
    b = job.breakdown
    assert b.wait_us[b.rank == 0].sum() == pytest.approx(90.0 * steps)


def test_trace_without_device_says_what_it_cannot_compute() -> None:
    src = shared_data() / "kineto-hta/rank_non_gpu/rank_non_gpu.json.gz"
    (f,) = iter_inputs([src])
    with f.open_raw() as raw:
        tl = read_timeline(open_content(raw, f.name), f.name)
    assert not tl.has_device and tl.rank == 0
    assert any("no device activity" in n for n in tl.notes)
    assert set(tl.intervals.kind) == {"compute"} and len(tl.calls.seq) == 6
    assert tl.calls.end == [None] * 6  # NCCL on CPU records only the enqueue: no duration
    assert any(n.startswith("6 of 6 calls have no measured duration") for n in tl.notes)
    job = analyze({0: tl})
    assert job.breakdown.step_us[0] == pytest.approx(
        sum(
            getattr(job.breakdown, f"{c}_us")[0] for c in ("compute", "overlapped", "wait", "exposed", "memcpy", "idle")
        )
    )
    assert any("no device activity" in n for n in job.breakdown.notes)
    assert job.stats.real_us == [None] * len(job.match.instances)


def test_nccl_op_count_keys_and_zero_op_counts_fall_back_to_order() -> None:
    """NCCL logs: opCount per communicator is the key; NCCL 2.27+ leaves it 0, then order decides."""

    def ranks(keys: list[int]) -> dict[int, CallColumns]:
        out = {}
        for r in (0, 1):
            tl = _rank(r, [("all_reduce", 64, 10 * k, 10 * k + 5, keys[k], 0) for k in range(len(keys))])
            tl.calls.group_key[:] = ["comm:0xabc"] * len(keys)
            out[r] = tl.calls
        return out

    keyed = match_instances(ranks([3, 4, 5]))
    assert keyed.instances.keyed_by == ["key"] * 3 and keyed.instances.key == [3, 4, 5]
    zeros = match_instances(ranks([0, 0, 0]))
    assert zeros.instances.keyed_by == ["order"] * 3 and zeros.instances.group == ["comm:0xabc"] * 3
