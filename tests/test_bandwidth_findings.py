"""Bandwidth (algbw, busbw factors, half-bandwidth size), per-rank totals and findings, each checked
firing and staying silent."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from synthetic import write_rows as write

from commlens.backend.attribution import attribute_run
from commlens.backend.bandwidth import bandwidth, call_bandwidth
from commlens.backend.findings import findings
from commlens.backend.ranks import rank_totals
from commlens.contract.analysis import ComparisonInput

MiB = 1 << 20


def ev(rank: int, seq: int, op: str, size, group: str, n: int, dur=None, src="kernel", **kw) -> dict:
    return {
        "rank": rank,
        "process": f"r{rank}",
        "seq": seq,
        "op": op,
        "dtype": "float32",
        "msg_bytes": size,
        "group_size": n,
        "group_key": group,
        "dur_us": dur,
        "dur_source": src if dur is not None else None,
        **kw,
    }


def group(key: str, ranks: list[int], desc: str | None = None, backend: str = "cuda:nccl") -> dict:
    return {
        "group_key": key,
        "ranks": ranks,
        "size": len(ranks),
        "origin": "pg_config",
        "description": desc,
        "backend": backend,
    }


# -------------------------------------------------------------------------------- bandwidth


def bw_run(con) -> None:
    events = [
        ev(0, 0, "all_reduce", 4096, "pg:w", 4, dur=10.0),
        ev(0, 1, "all_reduce", MiB, "pg:w", 4, dur=40.0),
        ev(0, 2, "all_reduce", 64 * MiB, "pg:w", 4, dur=900.0),
        ev(0, 3, "all_reduce", 64 * MiB, "pg:w", 4, dur=1000.0),
        ev(0, 4, "all_reduce", 64 * MiB, "pg:w", 4, dur=1100.0),
        ev(0, 5, "all_gather", 8 * MiB, "pg:pair", 2, dur=100.0),
        ev(0, 6, "send", MiB, "pg:pair", 2, dur=20.0, peer=1),
        # Left out, each for its reason:
        ev(0, 7, "broadcast", MiB, "pg:w", 4, dur=5.0, src="cpu_op"),
        ev(0, 8, "all_reduce", MiB, "pg:w", 4),
        ev(0, 9, "barrier", 0, "pg:w", 4, dur=3.0),
        ev(0, 10, "all_gather", 0, "pg:w", 4, dur=3.0),
        ev(0, 11, "all_reduce", MiB, "pg:self", 1, dur=3.0),
        ev(0, 12, "all_reduce", MiB, "pg:w", 4, dur=3.0, src=None) | {"dur_source": None},
        ev(0, 13, "all_reduce", None, "pg:w", 4, dur=3.0),
        # gloo: the CPU op time is the transfer time.
        ev(0, 14, "all_reduce", MiB, "pg:gloo", 2, dur=100.0, src="cpu_op"),
    ]
    groups = [
        group("pg:w", [0, 1, 2, 3], "default_pg"),
        group("pg:pair", [0, 1]),
        group("pg:self", [0]),
        group("pg:gloo", [0, 1], backend="cpu:gloo"),
    ]
    write(con, "bw", events, groups, rank=0)


def test_bandwidth_factors_bins_and_half_size(con):
    bw_run(con)
    report = bandwidth(con, "bw")
    assert report.calls_with_duration == 8
    assert report.excluded == {
        "CPU enqueue time of an NCCL call is not its transfer time": 1,
        "no measured duration": 1,
        "barrier moves no payload": 1,
        "zero-byte call": 1,
        "single-rank group": 1,
        "duration of unknown origin": 1,
        "no message size": 1,
    }
    bins = {(b.op, b.bin.label): b for b in report.bins}
    big = bins[("all_reduce", "64 MiB-128 MiB")]
    assert big.calls == 3 and big.median_dur_us == 1000.0
    assert big.median_algbw_gbps == pytest.approx(64 * MiB / 1000 / 1e3)
    assert big.median_busbw_gbps == pytest.approx(64 * MiB / 1000 / 1e3 * 2 * 3 / 4)  # 2(n-1)/n, n = 4
    ag = bins[("all_gather", "8 MiB-16 MiB")]
    assert ag.median_busbw_gbps == pytest.approx(8 * MiB / 100 / 1e3 * 0.5)  # (n-1)/n, n = 2
    assert bins[("send", "1 MiB-2 MiB")].median_busbw_gbps == pytest.approx(MiB / 20 / 1e3)  # factor 1
    # The 1 MiB all_reduce bin holds one NCCL call (4 ranks) and one gloo call (2 ranks): median of both.
    mid = bins[("all_reduce", "1 MiB-2 MiB")]
    assert mid.calls == 2 and mid.group_sizes == [2, 4]
    assert mid.median_busbw_gbps == pytest.approx((MiB / 40 / 1e3 * 1.5 + MiB / 100 / 1e3 * 1.0) / 2)
    ops = {o.op: o for o in report.ops}
    ar = ops["all_reduce"]
    assert ar.best_busbw_gbps == pytest.approx(big.median_busbw_gbps) and ar.best_bin == "64 MiB-128 MiB"
    # 1 MiB reaches ~25 % of the best, so the curve crosses half only at 64 MiB: latency-bound below.
    assert ar.half_bw_bytes == 64 * MiB and ar.half_bw_label == "64 MiB-128 MiB"
    assert ar.latency_bound_calls == 3 and ar.latency_bound_time_us == pytest.approx(10 + 40 + 100)
    assert report.best_busbw_gbps == pytest.approx(big.median_busbw_gbps)
    calls = call_bandwidth(con, "bw", op="send")
    assert len(calls) == 1 and calls[0].busbw_factor == 1.0 and calls[0].algbw_gbps == pytest.approx(MiB / 20 / 1e3)
    assert len(call_bandwidth(con, "bw", limit=2)) == 2 and call_bandwidth(con, "bw")[0].msg_bytes == 64 * MiB


def test_bandwidth_without_durations_says_so(con):
    write(con, "nodur", [ev(0, 0, "all_reduce", MiB, "pg:w", 4)], [group("pg:w", [0, 1, 2, 3])], rank=0)
    report = bandwidth(con, "nodur")
    assert report.calls_with_duration == 0 and report.bins == [] and report.best_busbw_gbps is None
    assert report.notes and report.excluded == {"no measured duration": 1}


# ------------------------------------------------------------------------------ rank totals


def test_rank_totals_and_imbalance(con):
    groups = [group("pg:dp", [0, 1], "mesh_dp")]
    write(con, "imb", [ev(0, i, "all_reduce", MiB, "pg:dp", 2, dur=10.0) for i in range(4)], groups, rank=0)
    write(con, "imb", [ev(1, i, "all_reduce", MiB, "pg:dp", 2, dur=30.0) for i in range(2)], rank=1)
    attribute_run(con, "imb")
    totals = rank_totals(con, "imb")
    rows = {(r.rank, r.scheme): r for r in totals.rows}
    assert rows[("0", "dp")].bytes == 4 * MiB and rows[("1", "dp")].bytes == 2 * MiB
    assert rows[("0", "dp")].time_us == 40.0 and rows[("1", "dp")].time_us == 60.0
    imb = {(i.scheme, i.metric): i for i in totals.imbalance}
    assert imb[("dp", "bytes")].max_over_mean == pytest.approx(4 / 3) and imb[("dp", "bytes")].max_rank == "0"
    assert imb[("dp", "time_us")].max_over_mean == pytest.approx(60 / 50) and imb[("dp", "time_us")].max_rank == "1"
    assert imb[("dp", "bytes")].basis == "total"  # detected iterations differ (4 vs 2 repeats): totals
    overall = {i.metric: i for i in totals.imbalance if i.all_schemes}
    assert overall["bytes"].max_over_mean == pytest.approx(4 / 3) and overall["bytes"].scheme is None
    # Both ranks are in the data, but rank 0's recording holds 4 all-reduces and rank 1's 2: every member
    # of an all-reduce moves the same bytes per call, so the difference is the recordings', not the job's.
    assert not [f for f in findings(con, "imb") if f.id.startswith("imbalance")]


def uneven_all_to_all(con, run: str, calls: int) -> None:
    """An ep group of 2 ranks whose rank 0 sends 3 MiB per all_to_all and rank 1 1 MiB, `calls` calls each."""
    groups = [group("pg:ep", [0, 1], "mesh_ep")]
    for rank, size in ((0, 3 * MiB), (1, MiB)):
        events = [ev(rank, i, "all_to_all", size, "pg:ep", 2, dur=50.0) for i in range(calls)]
        write(con, run, events, groups if rank == 0 else [], rank=rank)
    attribute_run(con, run)


def test_uneven_bytes_scale_with_the_evidence(con):
    """max/mean 1.5 is high by ratio; 64 calls a rank make it medium, 4 low, 3 nothing."""
    expected = {64: "medium", 4: "low", 3: None}
    for calls, severity in expected.items():
        uneven_all_to_all(con, f"a2a{calls}", calls)
        found = {f.id: f for f in findings(con, f"a2a{calls}") if f.id.startswith("imbalance")}
        if severity is None:
            assert found == {}
            continue
        assert list(found) == ["imbalance:ep:bytes"] and found["imbalance:ep:bytes"].severity == severity
        f = found["imbalance:ep:bytes"]
        assert f.evidence["max_rank"] == "0" and f.evidence["max_over_mean"] == pytest.approx(1.5)
        assert f.evidence["max"] == pytest.approx(1.5 * f.evidence["mean"])
        assert f.view == {"page": "ranks", "scheme": "ep", "metric": "bytes", "rank": "0"}
    f = {f.id: f for f in findings(con, "a2a64")}["imbalance:ep:bytes"]
    assert f.evidence["basis"] == "per_iteration"  # one call per detected iteration
    text = f.evidence_text
    assert (text["max"], text["mean"], text["max_over_mean"], text["expected_max_over_mean"]) == (
        "3 MiB",
        "2 MiB",
        "1.50x",
        "1.00x",
    )


def test_uneven_bytes_not_raised_on_ranks_missing_from_the_data(con):
    """A group of 4 with 2 members in the data: their bytes say nothing about the other two."""
    groups = [group("pg:ep", [0, 1, 2, 3], "mesh_ep")]
    for rank, size in ((0, 3 * MiB), (1, MiB)):
        events = [ev(rank, i, "all_to_all", size, "pg:ep", 4, dur=50.0) for i in range(64)]
        write(con, "half", events, groups if rank == 0 else [], rank=rank)
    attribute_run(con, "half")
    assert {(i.scheme, i.metric) for i in rank_totals(con, "half").imbalance} >= {("ep", "bytes")}
    assert not [f for f in findings(con, "half") if f.id.startswith("imbalance")]


def test_balanced_ranks_and_pipeline_ends_do_not_fire(con):
    groups = [group("pg:dp", [0, 1], "mesh_dp")]
    for rank in (0, 1):
        write(
            con,
            "bal",
            [ev(rank, i, "all_reduce", 64 * MiB, "pg:dp", 2, dur=1000.0) for i in range(4)],
            groups if rank == 0 else [],
            rank=rank,
        )
    attribute_run(con, "bal")
    assert not [f for f in findings(con, "bal") if f.id.startswith("imbalance")]
    # A 4-stage chain: end stages move half the bytes of interior stages, as expected (ratio 4/3).
    pp = [group("pg:pp", [0, 1, 2, 3], "mesh_pp")]
    seqs = {0: [("send", 1)], 1: [("recv", 0), ("send", 2)], 2: [("recv", 1), ("send", 3)], 3: [("recv", 2)]}
    for rank, calls in seqs.items():
        write(
            con,
            "chain",
            [ev(rank, i, op, 64 * MiB, "pg:pp", 4, peer=p) for i, (op, p) in enumerate(calls)],
            pp if rank == 0 else [],
            rank=rank,
        )
    attribute_run(con, "chain")
    totals = rank_totals(con, "chain")
    assert {(i.scheme, i.metric): i.max_over_mean for i in totals.imbalance}[("pp", "bytes")] == pytest.approx(4 / 3)
    assert not [f for f in findings(con, "chain") if f.id.startswith("imbalance")]


# --------------------------------------------------------------------------- small messages


def pipe_run(con, small: int, ranks: tuple[int, ...] = (0,)) -> str:
    """`small` sends of 4 KiB (10 us) and 2 of 64 MiB (1 ms) on each of `ranks`, timed on the device."""
    name = f"pipe{small}x{len(ranks)}"
    groups = [group("pg:pp", [0, 1], "mesh_pp")]
    for rank in ranks:
        events = [ev(rank, i, "send", 4096, "pg:pp", 2, dur=10.0, peer=1 - rank) for i in range(small)]
        events += [ev(rank, small + i, "send", 64 * MiB, "pg:pp", 2, dur=1000.0, peer=1 - rank) for i in range(2)]
        write(con, name, events, groups if rank == ranks[0] else [], rank=rank)
    attribute_run(con, name)
    return name


def test_small_pipeline_messages_fire_with_exact_evidence(con):
    run = pipe_run(con, 10)
    [f] = [f for f in findings(con, run) if f.id.startswith("small-messages")]
    # 10 of 12 calls, but 100 of 2100 us: the cost is low, and 12 calls could not make it more
    assert f.id == "small-messages:pp" and f.severity == "low"
    assert f.evidence["small_calls"] == 10 and f.evidence["calls"] == 12
    assert f.evidence["small_call_share"] == pytest.approx(10 / 12)
    assert f.evidence["small_time_share"] == pytest.approx(100 / 2100)
    assert f.evidence["threshold_bytes"] == MiB and "measured" in f.evidence["threshold"]  # 64 MiB, capped
    assert f.evidence_text["small_call_share"] == "83%" and f.evidence_text["small_time_us"] == "100 µs"
    assert f.stability == "small calls' share of time 4.8% to 4.8% across 1 rank(s)"
    assert f.view == {"page": "histograms", "scheme": "pp", "op": "send"}
    assert "batch_isend_irecv" in f.suggestion
    assert f.impact == pytest.approx(100 / 2100)


def test_small_messages_severity_scales_with_time_and_evidence(con):
    """300 small sends take 3 of 5 ms: high by time; on one rank (602 calls) medium, on two ranks high."""
    for ranks, severity in (((0,), "medium"), ((0, 1), "high")):
        run = pipe_run(con, 300, ranks)
        [f] = [f for f in findings(con, run) if f.id.startswith("small-messages")]
        assert (f.severity, f.evidence["small_time_share"]) == (severity, pytest.approx(3000 / 5000))
        assert f.title == "pp: 99% of calls and 60% of communication time are small, latency-bound messages"


def test_small_messages_silent_when_few(con):
    run = pipe_run(con, 0)
    assert not [f for f in findings(con, run) if f.id.startswith("small-messages")]
    # Without durations the default threshold applies and the evidence says so; 4 calls are no evidence,
    # 12 are at most low, 96 may be medium (three quarters of the calls small).
    groups = [group("pg:tp", [0, 1], "mesh_tp")]
    for calls, severity in ((4, None), (12, "low"), (96, "medium")):
        events = [ev(0, i, "all_reduce", 8192, "pg:tp", 2) for i in range(calls * 3 // 4)]
        events += [ev(0, calls + i, "all_reduce", 8 * MiB, "pg:tp", 2) for i in range(calls // 4)]
        write(con, f"nodur{calls}", events, groups, rank=0)
        attribute_run(con, f"nodur{calls}")
        found = findings(con, f"nodur{calls}")
        if severity is None:
            assert found == []
            continue
        [f] = found
        assert f.id == "small-messages:tp" and f.severity == severity and f.evidence["small_time_share"] is None
        assert "default" in f.evidence["threshold"] and f.evidence["threshold_bytes"] == 64 * 1024
        assert f.stability is None


def test_small_messages_label_names_the_threshold_each_op_was_judged_by(con, data_dir):
    """ResNet-50's trace and the DLRM job in one run (what --one-run stores): each op is judged by its own
    measured curve. DLRM's calls name no group, so their busbw takes the run's world (8 ranks): all_reduce
    reaches half its best at 1 MiB; all_to_all at 8 KiB, a curve still latency-bound, so the 64 KiB floor. The
    label names both thresholds, the evidence both bytes (it once said "below 64 KiB (default ...)" beside
    threshold_bytes = 1 MiB)."""
    from commlens.ingest.inputs import iter_inputs
    from commlens.service.ingest import ingest_run

    resnet, dlrm = (
        data_dir / "kineto-hta/nccl_parser_config/nccl_data.json.gz",
        data_dir / "kineto-param/dlrm_kineto.tar.gz",
    )
    ingest_run(con, "mixed", iter_inputs([resnet, dlrm]))
    report = bandwidth(con, "mixed")
    assert {o.op: o.half_bw_bytes for o in report.ops} == {
        "all_reduce": MiB,
        "all_to_all": 8 << 10,
        "broadcast": 128 << 10,
    }
    # no all_to_all is bandwidth-bound below the floor, so none is judged against the run's best busbw
    assert [s.large_calls for s in report.by_scheme if s.op == "all_to_all"] == [0]
    found = findings(con, "mixed")
    assert not [f for f in found if f.id.startswith("low-busbw") and "all_to_all" in f.id]
    [f] = [f for f in found if f.id.startswith("small-messages")]
    assert f.id == "small-messages:unattributed"
    # 8 ranks x (448 B + 907,840 B) all_reduces below 1 MiB, 8 x (192 + 1,536 + 13,568 + 2 x 24,576) B all_to_alls
    assert (f.evidence["small_calls"], f.evidence["calls"]) == (16 + 40, 64)
    assert f.evidence["small_bytes"] == 8 * (448 + 907_840) + 8 * (192 + 1536 + 13_568 + 2 * 24_576)
    assert f.evidence["threshold"] == (
        "below 1 MiB for all_reduce (the size where busbw reaches half its best, measured on the device in this run); "
        "below 64 KiB for all_to_all (the floor: this run's device curve reaches half its best at a smaller size, "
        "still latency-bound)"
    )
    assert (f.evidence["threshold_bytes"], f.evidence["threshold_bytes_min"]) == (MiB, 64 << 10)
    assert (f.evidence_text["threshold_bytes"], f.evidence_text["threshold_bytes_min"]) == ("1 MiB", "64 KiB")
    # the report shows the same text as the dashboard (evidence_text), not raw numbers
    from commlens.backend.report import build_report, render_markdown

    md = render_markdown(build_report(con, "mixed"))
    line = next(x for x in md.splitlines() if "small, latency-bound messages" in x)
    assert f"threshold={f.evidence['threshold']}, threshold_bytes=1 MiB, threshold_bytes_min=64 KiB" in line
    assert "1.049e+06" not in line and "small_bytes=7.42 MiB" in line


def test_small_messages_label_says_which_op_had_no_curve(con):
    """One op measured on the device, one only launched (NCCL CPU time): the first is judged by its curve
    (capped at 1 MiB), the second by the default, and the label says which is which."""
    groups = [group("pg:dp", [0, 1], "mesh_dp")]
    # all_reduce: 4 KiB at 10 us, 4 MiB at 100 us, 64 MiB at 1 ms: half the best at 4 MiB, capped at 1 MiB
    events = [ev(0, i, "all_reduce", 4096, "pg:dp", 2, dur=10.0) for i in range(8)]
    events += [ev(0, 8 + i, "all_reduce", 4 * MiB, "pg:dp", 2, dur=100.0) for i in range(2)]
    events += [ev(0, 10 + i, "all_reduce", 64 * MiB, "pg:dp", 2, dur=1000.0) for i in range(2)]
    events += [ev(0, 12 + i, "all_gather", 1024, "pg:dp", 2, dur=5.0, src="cpu_op") for i in range(8)]
    write(con, "half", events, groups, rank=0)
    attribute_run(con, "half")
    assert {o.op: o.half_bw_bytes for o in bandwidth(con, "half").ops} == {"all_reduce": 4 * MiB}
    [f] = [f for f in findings(con, "half") if f.id.startswith("small-messages")]
    assert f.evidence["threshold"] == (
        "below 1 MiB for all_reduce (the size where busbw reaches half its best, measured on the device in this run, "
        "capped at 1 MiB); below 64 KiB for all_gather (default; no device-measured bandwidth curve for it)"
    )
    assert (f.evidence["small_calls"], f.evidence["threshold_bytes_min"]) == (16, 64 << 10)


def test_small_messages_label_states_the_measured_threshold_itself(con):
    """Every small op measured and one threshold: the label names it (it said "at most 1 MiB" whatever it was)."""
    groups = [group("pg:pp", [0, 1], "mesh_pp")]
    # 4 KiB sends: 10 us (0.41 GB/s); 64 KiB: 20 us (3.3 GB/s); 256 KiB: 40 us (6.6 GB/s): half the best at 64 KiB
    events = [ev(0, i, "send", 4096, "pg:pp", 2, dur=10.0, peer=1) for i in range(12)]
    events += [ev(0, 12 + i, "send", 64 << 10, "pg:pp", 2, dur=20.0, peer=1) for i in range(2)]
    events += [ev(0, 14 + i, "send", 256 << 10, "pg:pp", 2, dur=40.0, peer=1) for i in range(2)]
    write(con, "p2p", events, groups, rank=0)
    attribute_run(con, "p2p")
    assert [o.half_bw_bytes for o in bandwidth(con, "p2p").ops] == [64 << 10]
    [f] = [f for f in findings(con, "p2p") if f.id.startswith("small-messages")]
    assert f.evidence["small_calls"] == 12 and f.evidence["threshold_bytes"] == 64 << 10
    assert f.evidence["threshold"] == (
        "below 64 KiB (the size where busbw reaches half its best, measured on the device in this run)"
    )
    assert "threshold_bytes_min" not in f.evidence


# ------------------------------------------------------------------------------- low busbw


def test_low_busbw_against_run_best(con):
    groups = [group("pg:tp", [0, 1], "mesh_tp"), group("pg:dp", [0, 2], "mesh_dp")]
    events = [ev(0, i, "all_reduce", 16 * MiB, "pg:tp", 2, dur=100.0) for i in range(64)]
    events += [ev(0, 64 + i, "all_reduce", 16 * MiB, "pg:dp", 2, dur=1000.0) for i in range(64)]
    write(con, "slow", events, groups, rank=0)
    attribute_run(con, "slow")
    found = {f.id: f for f in findings(con, "slow")}
    low = found["low-busbw:dp:all_reduce"]
    fast, slow = 16 * MiB / 100 / 1e3, 16 * MiB / 1000 / 1e3  # factor 1 for n = 2
    assert low.evidence["run_best_busbw_gbps"] == pytest.approx((fast + slow) / 2)
    assert low.evidence["ratio"] == pytest.approx(slow / ((fast + slow) / 2))
    assert low.severity == "medium"  # high by ratio (0.18), 64 calls on one rank's trace
    assert low.evidence_text["ratio"] == "18%" and low.evidence_text["median_busbw_gbps"] == "16.8 GB/s"
    # no NCCL topology lines in this run: the suggestion does not send anyone to the topology page
    assert "topology page" not in low.suggestion and "NCCL_DEBUG=INFO" in low.suggestion
    assert "low-busbw:tp:all_reduce" not in found
    # Same speed everywhere: nothing to report.
    events = [ev(0, i, "all_reduce", 16 * MiB, g, 2, dur=100.0) for i, g in enumerate(["pg:tp"] * 64 + ["pg:dp"] * 64)]
    write(con, "even", events, groups, rank=0)
    attribute_run(con, "even")
    assert not [f for f in findings(con, "even") if f.id.startswith("low-busbw")]
    # The same calls timed on the CPU by gloo say nothing about links: no bandwidth finding.
    cpu = [group("pg:tp", [0, 1], "mesh_tp", "cpu:gloo"), group("pg:dp", [0, 2], "mesh_dp", "cpu:gloo")]
    events = [ev(0, i, "all_reduce", 16 * MiB, "pg:tp", 2, dur=100.0, src="cpu_op") for i in range(64)]
    events += [ev(0, 64 + i, "all_reduce", 16 * MiB, "pg:dp", 2, dur=1000.0, src="cpu_op") for i in range(64)]
    write(con, "gloo", events, cpu, rank=0)
    attribute_run(con, "gloo")
    assert bandwidth(con, "gloo").best_busbw_gbps == pytest.approx((fast + slow) / 2)
    assert not [f for f in findings(con, "gloo") if f.id.startswith("low-busbw")]


# ----------------------------------------------------------------------- config and comparison


def test_zero_accumulation_from_config(con):
    def cfg(zero, m):
        return {"strategy": "zero", "world_size": 2, "parallel": {"dp": 2, "zero": zero, "micro_batches": m}}

    for name, zero, m in (("z3m4", 3, 4), ("z2m3", 2, 3), ("z1m4", 1, 4), ("z3m1", 3, 1)):
        write(
            con,
            name,
            [ev(0, 0, "reduce_scatter", 64 * MiB, "pg:dp", 2)],
            [group("pg:dp", [0, 1], "mesh_dp")],
            config=cfg(zero, m),
            rank=0,
        )
        attribute_run(con, name)
    [z3] = [f for f in findings(con, "z3m4") if f.id == "zero-accumulation"]
    assert z3.severity == "high" and z3.evidence["predicted_ratio"] == 6.0 and z3.evidence["micro_batches"] == 4
    [z2] = [f for f in findings(con, "z2m3") if f.id == "zero-accumulation"]
    assert z2.severity == "medium" and z2.evidence["predicted_ratio"] == 2.0
    assert not [f for f in findings(con, "z1m4") if f.id == "zero-accumulation"]
    assert not [f for f in findings(con, "z3m1") if f.id == "zero-accumulation"]


def test_comparison_findings_and_ranking(con):
    write(con, "cmp", [ev(0, 0, "all_reduce", 64 * MiB, "pg:dp", 2)], [group("pg:dp", [0, 1], "mesh_dp")], rank=0)
    attribute_run(con, "cmp")
    comparison = {
        "per_scheme": [
            {
                "scheme": "dp",
                "predicted_bytes": 100.0,
                "measured_bytes": 160.0,
                "unexplained_calls": 3,
                "unexplained_bytes": 1.0,
            },
            {"scheme": "tp", "predicted_bytes": 100.0, "measured_bytes": 104.0},
            {"scheme": "pp", "predicted_bytes": 100.0, "measured_bytes": 110.0},
        ]
    }
    found = findings(con, "cmp", comparison)
    ids = [f.id for f in found]
    assert ids == ["above-prediction:dp", "above-prediction:pp", "unexplained-calls:dp"]
    dp = found[0]
    assert dp.severity == "high" and dp.evidence["excess"] == pytest.approx(0.6)
    assert found[1].severity == "low" and found[1].evidence["excess"] == pytest.approx(0.1)
    assert found[2].severity == "low" and found[2].evidence["unexplained_calls"] == 3
    # Any object with the same attributes works; so does the model itself.
    obj = SimpleNamespace(
        per_scheme=[
            SimpleNamespace(
                scheme="dp", predicted_bytes=100.0, measured_bytes=100.0, unexplained_calls=0, unexplained_bytes=0.0
            )
        ],
        basis="per rank per iteration",
        tolerance=0.05,
    )
    assert findings(con, "cmp", obj) == []
    assert findings(con, "cmp", ComparisonInput.model_validate(comparison))[0].id == "above-prediction:dp"
    # measured_bytes is what the prediction explains: calls of a scheme it explains none of are all of its
    # bytes (the share read 0 B and the impact was the bytes themselves, ranked above every fraction)
    none_explained = {"per_scheme": [{"scheme": "x", "predicted_bytes": 0.0, "measured_bytes": 0.0}]}
    none_explained["per_scheme"][0] |= {"unexplained_calls": 8, "unexplained_bytes": 2_549_700.0}
    (unexplained,) = findings(con, "cmp", none_explained)
    assert unexplained.evidence["share_of_measured_bytes"] == 1.0 and unexplained.impact == 1.0
    assert (unexplained.severity, unexplained.evidence_text["share_of_measured_bytes"]) == ("medium", "100%")


# ------------------------------------------------------------------------------ real data


def test_real_nccl_log_has_no_bandwidth(con, data_dir):
    from commlens.service.ingest import ingest_paths

    assert not ingest_paths(con, [data_dir / "nccl-logs" / "nvidia-nccl-1193.log"], "ray").failed
    attribute_run(con, "ray")
    report = bandwidth(con, "ray")
    assert report.calls_with_duration == 0 and report.excluded == {"no measured duration": 4}
    # All four calls are 27-28 MiB: no small-message finding, no busbw finding.
    assert not [f for f in findings(con, "ray") if f.id.startswith(("small-messages", "low-busbw"))]


def test_real_kineto_ddp_bandwidth_from_kernel_durations(con, data_dir):
    from statistics import median

    from commlens.service.ingest import ingest_paths

    trace = data_dir / "kineto-hta" / "nccl_parser_config" / "nccl_data.json.gz"
    assert not ingest_paths(con, [trace], "resnet").failed
    attribute_run(con, "resnet")
    report = bandwidth(con, "resnet")
    assert report.calls_with_duration == 21 and report.excluded == {}
    rows = con.execute("SELECT op, msg_bytes, dur_us, group_size FROM comms WHERE run = 'resnet'").fetchall()
    assert {r[3] for r in rows} == {2}  # 2 ranks: all_reduce factor 2(n-1)/n = 1, broadcast 1
    by_bin: dict = {}
    for op, size, dur, _ in rows:
        by_bin.setdefault((op, size.bit_length() - 1), []).append(size / dur / 1e3)
    assert {(b.op, b.bin.k): b.median_busbw_gbps for b in report.bins} == pytest.approx(
        {key: median(v) for key, v in by_bin.items()}
    )
    for call in call_bandwidth(con, "resnet"):
        assert call.busbw_gbps == pytest.approx(call.algbw_gbps) and call.busbw_factor == 1.0
    ar = next(o for o in report.ops if o.op == "all_reduce")
    assert ar.best_bin == "16 MiB-32 MiB" and ar.half_bw_bytes == 16 * MiB and ar.latency_bound_calls == 6
    # DDP over 2 ranks with 25 MiB buckets: no bandwidth or small-message finding is warranted (the 4-16
    # MiB buckets sit below the measured half-bandwidth size, but that is above the 1 MiB cap: overlap,
    # not latency). The time analysis finds the all-reduces' exposed time: 10.2, 10.5 and 18.9 ms with no
    # compute running in profiler steps 4-6 of 220-225 ms, on one rank: 3 steps are too few to tell its
    # spread (findings_time.MIN_STEPS), so no timing finding either.
    exposed = con.execute(
        "SELECT step, exposed_us + wait_us FROM time_breakdown WHERE scheme IS NULL ORDER BY step"
    ).fetchall()
    assert [(s, round(x, 2)) for s, x in exposed] == [(4, 10163.76), (5, 10539.61), (6, 18856.09)]
    assert findings(con, "resnet") == []


def test_calls_naming_no_group_take_the_world_as_wire_bytes_do(con, data_dir):
    """DLRM's trace names no group for its calls: they are the default group's, the 8 ranks of the run's world
    (as wire bytes and the time analysis take them), and a note says so; bandwidth refused them all before."""
    from commlens.service.ingest import ingest_paths

    assert not ingest_paths(con, [data_dir / "kineto-param" / "dlrm_kineto.tar.gz"], "dlrm").failed
    report = bandwidth(con, "dlrm")
    assert (report.calls_with_duration, report.excluded) == (64, {})
    assert {n for b in report.bins for n in b.group_sizes} == {8}
    assert report.notes == [
        "64 measured calls name no process group: their busbw takes the default group's 8 ranks (the run's world "
        "size), as the wire bytes and the time analysis do"
    ]
    # with no world size known either, the size stays unknown and the call is left out
    write(con, "anon", [ev(0, 0, "all_reduce", MiB, None, None, dur=50.0)], rank=0)
    anon = bandwidth(con, "anon")
    assert (anon.calls_with_duration, anon.excluded) == (0, {"group size unknown": 1})
    assert anon.notes == [
        "no bandwidth: 1 calls: group size unknown (the files name no process group for them and the run's world "
        "size is unknown, and busbw needs the group's size)"
    ]
