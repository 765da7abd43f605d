"""Histograms: bins at the edges, weights, normalisation by profiler steps and by detected periods."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from synthetic import write_rows as write

from commlens.backend.attribution import attribute_run
from commlens.backend.histograms import bin_key, histogram
from commlens.backend.iterations import Period, UnknownRunError, detect_period, find_period
from commlens.contract.analysis import bin_spec
from commlens.vocab import format_bytes

MiB = 1 << 20


def ev(
    rank, seq: int, op: str, size: int | None, group: str | None = "pg:0", n: int = 2, process: str | None = None, **kw
) -> dict:
    return {
        "rank": rank,
        "process": process or f"r{rank}",
        "seq": seq,
        "op": op,
        "dtype": "float32",
        "msg_bytes": size,
        "group_size": n,
        "group_key": group,
        **kw,
    }


def series(h, op: str, scheme=...) -> dict[str, float]:
    [s] = [s for s in h.series if s.op == op and (scheme is ... or s.scheme == scheme)]
    return {b.label: v for b, v in zip(h.bins, s.values, strict=True) if v}


# ---------------------------------------------------------------------------------- bins


@pytest.mark.parametrize(
    "size, key, label",
    [
        (0, "zero", "0 B"),
        (None, "unknown", "unknown size"),
        (1, "2^0", "1 B-2 B"),
        (1023, "2^9", "512 B-1 KiB"),
        (1024, "2^10", "1 KiB-2 KiB"),
        (2047, "2^10", "1 KiB-2 KiB"),
        (2048, "2^11", "2 KiB-4 KiB"),
        (25 * MiB, "2^24", "16 MiB-32 MiB"),
        (2**62 + 5, "2^62", "4 EiB-8 EiB"),
        (2**63 - 1, "2^62", "4 EiB-8 EiB"),
    ],
)
def test_bin_edges(size, key, label):
    assert bin_key(size) == key
    assert bin_spec(key).label == label
    spec = bin_spec(key)
    if spec.k is not None:
        assert spec.lo <= size < spec.hi


def test_format_bytes():
    sizes = (0, 1000, 1024, 1536, 3 * MiB, 1 << 30)
    assert [format_bytes(n) for n in sizes] == ["0 B", "1000 B", "1 KiB", "1.5 KiB", "3 MiB", "1 GiB"]


def test_raw_counts_weights_and_contiguous_axis(con):
    sizes = [0, None, 1023, 1024, 2047, 2048, 1 << 20, 2**62 + 5]
    write(con, "raw", [ev(0, i, "all_reduce", s) for i, s in enumerate(sizes)], rank=0)
    h = histogram(con, "raw", normalize=False)
    assert h.normalization == "none"
    labels = [b.label for b in h.bins]
    assert labels[0] == "0 B" and labels[1] == "512 B-1 KiB" and labels[-1] == "unknown size"
    assert labels[-2] == "4 EiB-8 EiB" and len(labels) == 2 + (62 - 9 + 1)  # every bin from 2^9 to 2^62
    assert series(h, "all_reduce") == {
        "0 B": 1,
        "unknown size": 1,
        "512 B-1 KiB": 1,
        "1 KiB-2 KiB": 2,
        "2 KiB-4 KiB": 1,
        "1 MiB-2 MiB": 1,
        "4 EiB-8 EiB": 1,
    }
    hb = histogram(con, "raw", weight="bytes", normalize=False)
    assert series(hb, "all_reduce") == {
        "512 B-1 KiB": 1023,
        "1 KiB-2 KiB": 1024 + 2047,
        "2 KiB-4 KiB": 2048,
        "1 MiB-2 MiB": 1 << 20,
        "4 EiB-8 EiB": float(2**62 + 5),
    }
    # Without steps or a repeat the normalised histogram is per rank only, and says why.
    hn = histogram(con, "raw")
    assert hn.normalization == "per_rank" and hn.n_ranks == 1 and hn.notes
    with pytest.raises(ValueError):
        histogram(con, "raw", weight="time")
    with pytest.raises(UnknownRunError):
        histogram(con, "nope")


def steps_run(con) -> None:
    """Rank 0: steps 5, 6 and one setup call outside them. Rank 1: steps 5, 6, 7.
    Each step: two 4 MiB all_reduces and one 4-byte all_reduce."""
    for rank, nsteps in ((0, 2), (1, 3)):
        events, seq = [], 0
        if rank == 0:
            events.append(ev(0, seq, "broadcast", 4096, step=None))
            seq += 1
        for step in range(5, 5 + nsteps):
            for size in (4 * MiB, 4 * MiB, 4):
                events.append(ev(rank, seq, "all_reduce", size, step=step))
                seq += 1
        steps = [{"rank": rank, "step": s, "ts_us": 0.0, "dur_us": 1.0} for s in range(5, 5 + nsteps)]
        groups = [{"group_key": "pg:0", "ranks": [0, 1], "size": 2, "origin": "pg_config", "description": "default_pg"}]
        write(con, "steps", events, groups, steps, rank=rank)


def test_normalised_per_rank_per_profiler_step(con):
    steps_run(con)
    h = histogram(con, "steps")
    assert h.normalization == "per_rank_per_iteration" and h.iterations.mode == "steps"
    assert h.iterations.iterations == {"0": 2, "1": 3}
    assert h.n_ranks == 2
    # (4 calls / 2 steps + 6 calls / 3 steps) / 2 ranks = 2 per rank per step.
    assert series(h, "all_reduce") == {"4 MiB-8 MiB": 2.0, "4 B-8 B": 1.0}
    assert h.excluded == {"outside profiler steps": 1}
    assert not [s for s in h.series if s.op == "broadcast"]
    hb = histogram(con, "steps", weight="bytes")
    assert series(hb, "all_reduce") == {"4 MiB-8 MiB": 8.0 * MiB, "4 B-8 B": 4.0}
    # Filters: one rank, one step.
    assert series(histogram(con, "steps", rank=1), "all_reduce") == {"4 MiB-8 MiB": 2.0, "4 B-8 B": 1.0}
    h7 = histogram(con, "steps", step=7)
    assert h7.n_ranks == 1 and series(h7, "all_reduce") == {"4 MiB-8 MiB": 2.0, "4 B-8 B": 1.0}
    # Raw counts keep everything.
    raw = histogram(con, "steps", normalize=False)
    assert series(raw, "all_reduce") == {"4 MiB-8 MiB": 10, "4 B-8 B": 5}
    # the report's per-iteration tables leave the same call out, and say so (they did not)
    from commlens.backend.report import build_report, render_markdown

    md = render_markdown(build_report(con, "steps"))
    volumes = md.split("## Bytes per iteration per rank", 1)[1].split("\n## ", 1)[0]
    assert "Left out of the per-iteration tables: 1 calls (outside profiler steps)" in volumes
    assert "Bytes sent: the sum of S over each rank's collectives and sends; receives are not added" in volumes
    assert series(raw, "broadcast") == {"4 KiB-8 KiB": 1}


def test_scheme_filter_after_attribution(con):
    steps_run(con)
    before = histogram(con, "steps", normalize=False)
    assert {s.scheme for s in before.series} == {None}
    attribute_run(con, "steps")
    h = histogram(con, "steps", scheme="dp", normalize=False)
    assert {s.scheme for s in h.series} == {"dp"}
    assert histogram(con, "steps", scheme="tp").series == []
    assert histogram(con, "steps", op="broadcast", normalize=False).series[0].total_calls == 1


def log_run(con, trailing: bool = False) -> None:
    """One NCCL-log process: dp communicator = setup broadcast + 3 x [all_reduce 8 MiB];
    tp communicator = 3 iterations x 2 micro-batches x [all_gather 1 MiB, reduce_scatter 1 MiB]."""
    events, seq = [], 0

    def add(op, size, comm):
        nonlocal seq
        events.append(ev(None, seq, op, size, group=comm, n=4, process="host:17"))
        seq += 1

    add("broadcast", 4096, "nccl:dp")
    for _ in range(3):
        for _ in range(2):
            add("all_gather", MiB, "nccl:tp")
            add("reduce_scatter", MiB, "nccl:tp")
        add("all_reduce", 8 * MiB, "nccl:dp")
    if trailing:
        add("all_gather", MiB, "nccl:tp")
    write(con, "log", events, kind="nccl_log")


def test_detected_period_with_micro_batch_units(con):
    log_run(con, trailing=True)
    report = detect_period(con, "log")
    assert report.found and [p.iterations for p in report.processes] == [3]
    comms = {c.group_key: c for c in report.comms}
    assert (comms["nccl:dp"].period, comms["nccl:dp"].offset, comms["nccl:dp"].repeats) == (1, 1, 3)
    assert (comms["nccl:tp"].period, comms["nccl:tp"].repeats, comms["nccl:tp"].units_per_iteration) == (2, 6, 2)
    h = histogram(con, "log")
    assert h.normalization == "per_rank_per_iteration" and h.iterations.mode == "detected"
    assert h.iterations.iterations == {"host:17": 3}
    assert series(h, "all_gather") == {"1 MiB-2 MiB": 2.0}
    assert series(h, "reduce_scatter") == {"1 MiB-2 MiB": 2.0}
    assert series(h, "all_reduce") == {"8 MiB-16 MiB": 1.0}
    assert h.excluded == {"before the repeating pattern (setup)": 1, "after the last complete iteration": 1}
    # Iteration filter on detected iterations (0-based).
    assert series(histogram(con, "log", step=2), "all_gather") == {"1 MiB-2 MiB": 2.0}


def test_no_period_found(con):
    write(con, "noper", [ev(None, i, "all_reduce", 1000 + i, process="h:1") for i in range(6)], kind="nccl_log")
    report = detect_period(con, "noper")
    assert not report.found and report.comms[0].period is None and "no repeating" in report.message
    h = histogram(con, "noper")
    assert h.normalization == "per_rank" and h.excluded == {}
    assert sum(h.series[0].calls) == 6


def test_find_period_cases():
    assert find_period([1, 2, 3, 4, 5, 6]) is None
    assert find_period([9, 1, 1, 1, 1]) == Period(1, 1, 4)
    assert find_period(["a", "b", "a", "b"]) == Period(2, 0, 2)
    assert find_period([1]) is None
    # Setup longer than the repeating tail: no period.
    assert find_period([1, 2, 3, 4, 5, 6, 7, 8, 8]) is None
    # A multiple of the true period covers the same tail: the shortest wins.
    assert find_period([0] + [1, 2, 3] * 4) == Period(3, 1, 4)


def _period_by_definition(seq: list) -> Period | None:
    """The module docstring's rule, computed the slow way: the tail each p covers, compared item by item."""
    n = len(seq)
    best_p, best_cov = 0, 0
    for p in range(1, n // 2 + 1):
        tail = 0  # longest tail with s[i] == s[i + p]
        while tail < n - p and seq[n - 1 - tail] == seq[n - 1 - tail - p]:
            tail += 1
        cov = min(n, p + tail)
        if cov // p >= 2 and cov > best_cov:
            best_p, best_cov = p, cov
    if not best_p or best_cov < 0.5 * n:
        return None
    return Period(best_p, n - best_cov, best_cov // best_p)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=80))
def test_find_period_equals_its_definition_on_short_sequences(seq):
    assert find_period(seq) == _period_by_definition(seq)


@settings(max_examples=60, deadline=None)
@given(
    setup=st.lists(st.integers(0, 4), max_size=40),
    unit=st.lists(st.integers(0, 4), min_size=1, max_size=50),
    repeats=st.integers(2, 12),
    partial=st.integers(0, 49),
    noise=st.integers(0, 2),
)
def test_find_period_equals_its_definition_on_planted_periods(setup, unit, repeats, partial, noise):
    """Long, strongly periodic sequences: the candidate filter and the skipped multiples must not change the answer."""
    seq = setup + unit * repeats + unit[: partial % len(unit)]  # an incomplete last repeat
    if noise:
        seq[len(seq) // (noise + 1)] = 9  # one broken item inside the repeats
    assert find_period(seq) == _period_by_definition(seq)


def test_find_period_of_a_long_log_is_exact():
    """A million calls of a 7-call iteration after 13 setup calls (the shape of a real NCCL log)."""
    import numpy as np

    from commlens.ingest.periods import find_period_tokens

    unit = np.array([3, 1, 4, 1, 5, 9, 2])
    tokens = np.concatenate([np.arange(100, 113), np.tile(unit, 1_000_000 // 7)])
    assert find_period_tokens(tokens) == Period(7, 13, 1_000_000 // 7)


# ------------------------------------------------------------------------------ real data


def ingest_real(con, path, run: str) -> None:
    from commlens.service.ingest import ingest_paths

    summary = ingest_paths(con, [path], run)
    assert not summary.failed, summary.failed


def test_real_nccl_log_without_period(con, data_dir):
    ingest_real(con, data_dir / "nccl-logs" / "nvidia-nccl-1193.log", "ray")
    assert not detect_period(con, "ray").found
    raw = histogram(con, "ray", normalize=False)
    assert series(raw, "all_reduce") == {"16 MiB-32 MiB": 4}
    h = histogram(con, "ray")
    assert h.normalization == "per_rank" and h.n_ranks == 3  # three processes, global ranks unknown
    assert series(h, "all_reduce") == {"16 MiB-32 MiB": pytest.approx(4 / 3)}


def test_real_nccl_log_with_period_and_int8_bins(con, data_dir):
    ingest_real(con, data_dir / "nccl-logs" / "nvidia-nccl-1238.log", "single")
    report = detect_period(con, "single")
    assert report.found and [(c.period, c.offset, c.repeats) for c in report.comms] == [(1, 0, 4)]
    h = histogram(con, "single")
    assert h.iterations.mode == "detected" and list(h.iterations.iterations.values()) == [4]
    assert series(h, "all_reduce") == {"128 MiB-256 MiB": 1.0}
    ingest_real(con, data_dir / "nccl-logs" / "rocm-rccl-429.log", "hang")
    gathers = histogram(con, "hang", op="all_gather", normalize=False)
    assert [s.dtype for s in gathers.series] == ["int8"]
    assert series(gathers, "all_gather") == {"32 KiB-64 KiB": 1, "128 MiB-256 MiB": 1}


def test_real_kineto_ddp_buckets_per_iteration(con, data_dir):
    ingest_real(con, data_dir / "kineto-hta" / "nccl_parser_config" / "nccl_data.json.gz", "resnet")
    attribute_run(con, "resnet")
    h = histogram(con, "resnet")
    assert h.iterations.mode == "steps" and h.iterations.iterations == {"0": 3} and h.excluded == {}
    assert series(h, "all_reduce", "dp") == {"4 MiB-8 MiB": 1.0, "8 MiB-16 MiB": 1.0, "16 MiB-32 MiB": 3.0}
    assert {s.dtype: s.total_calls for s in h.series if s.op == "broadcast"} == {"float32": 1.0, "int64": 1.0}
    hb = histogram(con, "resnet", weight="bytes", op="all_reduce")
    # Five buckets per iteration carry every ResNet-50 gradient: 25,557,032 float32 parameters.
    assert hb.series[0].total_bytes == 25_557_032 * 4


def test_real_kineto_dlrm_eight_ranks(con, data_dir):
    ingest_real(con, data_dir / "kineto-param" / "dlrm_kineto.tar.gz", "dlrm")
    h = histogram(con, "dlrm")
    assert h.n_ranks == 8 and h.iterations.iterations == {str(r): 1 for r in range(8)}
    totals = {(s.op, s.dtype): s.total_calls for s in h.series}
    assert totals == {
        ("all_reduce", "float32"): 3.0,
        ("all_to_all", "float32"): 2.0,
        ("all_to_all", "int32"): 2.0,
        ("all_to_all", "int64"): 1.0,
    }
    assert h.unattributed_events == 64 and {s.scheme for s in h.series} == {None}
    # Every rank issues the same calls: rank 5 alone gives the same histogram.
    assert {(s.op, s.dtype): s.total_calls for s in histogram(con, "dlrm", rank=5).series} == totals
