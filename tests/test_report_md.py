"""`commlens report`: the Markdown histogram and bandwidth sections on a real trace, the parameter-count
check in a comparison, and findings from a supplied config."""

from __future__ import annotations

import pytest
from synthetic import write_rows as write

from commlens.backend.attribution import attribute_run
from commlens.backend.compare import compare
from commlens.backend.findings import findings
from commlens.backend.report import build_report, render_markdown
from commlens.contract.predict import DtypeSpec, ModelSpec, ParallelSpec, PredictInput

RESNET50_PARAMS = 25_557_032


def test_markdown_histogram_and_bandwidth_on_a_real_ddp_trace(resnet) -> None:
    rep = build_report(
        resnet,
        "resnet",
        PredictInput(
            model=ModelSpec(layers=1, hidden=1, heads=1, vocab=1, seq_len=1, params_override=RESNET50_PARAMS),
            parallel=ParallelSpec(dp=2),
            dtypes=DtypeSpec(act="float32", grad="float32", param="float32"),
            implementation="fsdp",
        ),
    )
    md = render_markdown(rep)
    assert "## Message sizes per scheme (per rank per iteration)" in md and "### dp" in md
    # ResNet-50's five DDP gradient buckets per iteration: 8196000 + 9724160 + 3 buckets of 84307968 B in
    # total, which is every fp32 gradient (Ψ * 4 B); plus two buffer broadcasts (424 B int64, 212480 B)
    assert RESNET50_PARAMS * 4 == 8_196_000 + 9_724_160 + 84_307_968
    for row in (
        "| 4 MiB-8 MiB | all_reduce | float32 | 1 | 7.82 MiB |",
        "| 8 MiB-16 MiB | all_reduce | float32 | 1 | 9.27 MiB |",
        "| 16 MiB-32 MiB | all_reduce | float32 | 3 | 80.4 MiB |",
        "| 256 B-512 B | broadcast | int64 | 1 | 424 B |",
        "| 128 KiB-256 KiB | broadcast | float32 | 1 | 208 KiB |",
        "| **total** | | | 7 | 97.7 MiB |",
    ):  # 102228128 + 424 + 212480 B
        assert row in md, row
    # bandwidth: the median of S / duration over the nine 16-32 MiB all_reduces of the three profiled
    # steps, from the calls themselves; group size 2, so busbw = algbw (factor 2(n-1)/n = 1, §7)
    median = resnet.execute(
        """SELECT median(msg_bytes / dur_us / 1e3) FROM comms WHERE run = 'resnet' AND op = 'all_reduce'
           AND msg_bytes >= 16 * 1048576 AND msg_bytes < 32 * 1048576"""
    ).fetchone()[0]
    assert f"| all_reduce | 16 MiB-32 MiB | 9 | 25.3 MiB | {median:.2f} | {median:.2f} | 2 |" in md
    assert f"{median:.2f}" == "10.98"
    # half the best (5.49 GB/s) is first reached in the 16 MiB bin (the 8-16 MiB median is 4.79); the six
    # smaller all_reduces are below it
    assert "| all_reduce | 10.98 | 16 MiB-32 MiB | 16 MiB | 6 |" in md
    assert "| broadcast | 6.89 | 128 KiB-256 KiB | 128 KiB | 3 |" in md
    # the same numbers as the JSON
    best = next(o for o in rep.bandwidth.ops if o.op == "all_reduce")
    assert (round(best.best_busbw_gbps, 2), best.half_bw_bytes) == (10.98, 16 * 2**20)


# ------------------------------------------------------------------- parameter-count check

# The harness GPT (harness/README.md) with L = 1, h = 32, a = 4, V = 64, s = 16 on t = 2, float32, one
# micro-batch of b = 1: A = b s h w = 2048 B, all_reduced M (4l + 2) = 6 times; cross-entropy 3 x b s 4 B.
PSI = 2 * 64 * 32 + 16 * 32 + (12 * 32 * 32 + 13 * 32) + 2 * 32  # 17376
PSI_RANK = 64 * 32 // 2 + 16 * 32 + (12 * 32 * 32 + 7 * 32) // 2 + 6 * 32 + 2 * 32 + 64 * 32 // 2  # 9072


def _harness_tp_run(con, total: int) -> None:
    config = {
        "schema": "commlens.run/1",
        "strategy": "tp",
        "world_size": 2,
        "model": {"layers": 1, "hidden": 32, "heads": 4, "vocab": 64, "seq_len": 16, "param_count": total},
        "parallel": {"tp": 2},
        "mesh_dims": ["tp"],
        "mesh_shape": [2],
        "groups": [{"dim": "tp", "ranks": [0, 1], "pg_name": "1"}],
        "ranks": [{"rank": r, "param_count": PSI_RANK} for r in (0, 1)],
    }
    group = {"group_key": "pg:1", "name": "1", "ranks": [0, 1], "size": 2, "origin": "run_config", "mesh_dim": "tp"}
    for rank in (0, 1):
        events = [
            {
                "rank": rank,
                "process": f"r{rank}",
                "seq": i,
                "op": "all_reduce",
                "dtype": "float32",
                "msg_bytes": size,
                "group_size": 2,
                "group_key": "pg:1",
                "step": 3,
            }
            for i, size in enumerate([2048] * 6 + [64] * 3)
        ]
        write(
            con,
            "tp",
            events,
            [group],
            [{"rank": rank, "step": 3, "ts_us": 0.0, "dur_us": 1.0}],
            rank=rank,
            config=config,
        )
    attribute_run(con, "tp")


def test_agreeing_parameter_counts_keep_the_exact_match(con) -> None:
    assert (PSI, PSI_RANK) == (17376, 9072)
    _harness_tp_run(con, PSI)
    c = compare(con, "tp")
    assert c.config_source == "run" and c.implementation == "harness"
    assert c.param_check is not None and c.param_check.agrees and c.exact
    assert "predicted equals measured for every scheme" in render_markdown(build_report(con, "tp"))


def test_disagreeing_parameter_counts_withdraw_the_exactness_claim(con) -> None:
    _harness_tp_run(con, PSI + 100)
    c = compare(con, "tp")
    assert all(o.status == "match" for s in c.schemes for o in s.ops)  # the volumes still agree ...
    assert c.param_check is not None and not c.param_check.agrees and not c.exact  # ... but not the model
    assert any("model: 17,476 recorded, 17,376 from the model config" in n for n in c.notes)
    md = render_markdown(build_report(con, "tp"))
    assert "predicted equals measured" not in md
    assert "**Not exact:** parameter counts disagree with the run's record (model: 17,476 recorded" in md


# ---------------------------------------------------------------- findings from a supplied config


def _dp_run(con, stored: dict | None) -> None:
    events = [
        {
            "rank": r,
            "process": f"r{r}",
            "seq": 0,
            "op": "reduce_scatter",
            "dtype": "float32",
            "msg_bytes": 1 << 20,
            "group_size": 2,
            "group_key": "pg:0",
            "step": 1,
        }
        for r in (0, 1)
    ]
    group = {"group_key": "pg:0", "ranks": [0, 1], "size": 2, "origin": "pg_config", "description": "default_pg"}
    write(
        con, "dp", events, [group], [{"rank": r, "step": 1, "ts_us": 0.0, "dur_us": 1.0} for r in (0, 1)], config=stored
    )


def _zero(stage: int, m: int) -> PredictInput:
    return PredictInput(
        model=ModelSpec(layers=1, hidden=8, heads=1, vocab=16, seq_len=4),
        parallel=ParallelSpec(dp=2, zero=stage, micro_batches=m),
    )  # type: ignore[arg-type]


def test_zero_accumulation_finding_reads_a_supplied_config(con) -> None:
    _dp_run(con, {"strategy": "ddp", "world_size": 2, "parallel": {"dp": 2, "zero": 0, "micro_batches": 1}})
    assert not [f for f in findings(con, "dp") if f.id == "zero-accumulation"]
    # ZeRO-3 with m = 4 against stage 0: 3m/2 = 6x (§6.2)
    [z3] = [f for f in findings(con, "dp", config=_zero(3, 4)) if f.id == "zero-accumulation"]
    assert z3.evidence["predicted_ratio"] == 6.0 and z3.evidence["zero_stage"] == 3 and z3.severity == "high"
    # `commlens report --config` hands its config to findings: ZeRO-2, m = 3 against ZeRO-1: (m + 1)/2 = 2x
    rep = build_report(con, "dp", _zero(2, 3))
    [z2] = [f for f in rep.findings if f.id == "zero-accumulation"]
    assert z2.evidence["predicted_ratio"] == 2.0 and z2.evidence["micro_batches"] == 3
    # the ratio is the predictor's for the configuration, not the one-width estimate: the harness's ZeRO-3 moves
    # 2.84x its DDP's dp wire bytes at m = 2 (the title said "about 3.0x")
    harness = PredictInput(
        implementation="harness",
        model=ModelSpec(layers=2, hidden=32, heads=2, vocab=64, seq_len=16),
        parallel=ParallelSpec(dp=2, zero=3, micro_batches=2),
    )  # type: ignore[arg-type]
    [h] = [f for f in findings(con, "dp", config=harness) if f.id == "zero-accumulation"]
    assert h.evidence["predicted_ratio"] == pytest.approx(2.8447, abs=1e-4) and "about 2.8x" in h.title
    assert h.evidence["ratio_from"].startswith("the predictor's dp wire bytes")


def test_a_supplied_config_overrides_the_stored_one_in_findings(con) -> None:
    _dp_run(con, {"strategy": "zero3", "world_size": 2, "parallel": {"dp": 2, "zero": 3, "micro_batches": 4}})
    assert [f.id for f in findings(con, "dp") if f.id == "zero-accumulation"] == ["zero-accumulation"]
    assert not [f for f in findings(con, "dp", config=_zero(1, 4)) if f.id == "zero-accumulation"]
    assert not [f for f in build_report(con, "dp", _zero(0, 4)).findings if f.id == "zero-accumulation"]


# ------------------------------------------------------------------- calls left out of bandwidth


def test_bandwidth_section_counts_the_calls_left_out_beside_the_timed_ones(con, data_dir) -> None:
    """The 16-rank trace (rank 0): 10 all_to_alls move zero bytes. The section said "Medians over 20 calls" and
    nothing of the other 65: it counts those left out with their reasons, as the API's `excluded` and the
    dashboard's "left out" note do, and says the 55 calls naming no group took the world's 16 ranks."""
    from commlens.backend.bandwidth import bandwidth
    from commlens.ingest.inputs import iter_inputs
    from commlens.service.ingest import ingest_run

    ingest_run(con, "nq", iter_inputs([data_dir / "kineto-hta/negative_queue_length_values_check/rank0.json.gz"]))
    bw = bandwidth(con, "nq")
    assert (bw.calls_with_duration, bw.excluded) == (75, {"zero-byte call": 10})
    md = render_markdown(build_report(con, "nq"))
    section = md.split("## Bandwidth", 1)[1].split("\n## ", 1)[0]
    assert "Medians over 75 of 85 calls; busbw" in section
    assert "Left out of bandwidth: 10 calls: zero-byte call.\n\n- 55 measured calls name no process group: " in section
    assert "| all_reduce | 1 GiB-2 GiB | 5 | 1.67 GiB | 71.01 | 133.15 | 16 |" in section
    assert "| all_gather | 16 MiB-32 MiB | 5 | 16 MiB |" in section  # the timed calls are still there


def test_bandwidth_section_of_a_fully_timed_run_says_nothing_is_left_out(resnet) -> None:
    md = render_markdown(build_report(resnet, "resnet"))
    section = md.split("## Bandwidth", 1)[1].split("\n## ", 1)[0]
    assert "Medians over 21 of 21 calls; busbw" in section and "No call is left out." in section


def test_bandwidth_section_without_timed_calls_keeps_the_runs_own_reason(con, data_dir) -> None:
    from commlens.ingest.inputs import iter_inputs
    from commlens.service.ingest import ingest_run

    ingest_run(con, "cpu", iter_inputs([data_dir / "kineto-hta/rank_non_gpu/rank_non_gpu.json.gz"]))
    section = render_markdown(build_report(con, "cpu")).split("## Bandwidth", 1)[1].split("\n## ", 1)[0]
    assert section.strip() == (
        "- no bandwidth: 6 calls: no measured duration (an NCCL call's CPU time is only its launch: the profiler "
        "must record CUDA activities so the trace holds its kernels; gloo calls are timed on the CPU)"
    )


# ------------------------------------------------------------------- ranks and processes


def test_report_counts_processes_apart_from_global_ranks(con, data_dir) -> None:
    """An NCCL log whose lines name no global rank (3 processes of a 128-rank job): the run detail counts 0 ranks,
    the histogram averages over the 3 processes. The report says both, and the histogram section says why."""
    from commlens.ingest.inputs import iter_inputs
    from commlens.service.ingest import ingest_run

    ingest_run(con, "log", iter_inputs([data_dir / "nccl-logs/nvidia-nccl-1193.log"]))
    rep = build_report(con, "log")
    assert rep.histogram.n_ranks == 3 and rep.ranks.ranks == 3 and len(rep.processes) == 3
    md = render_markdown(rep)
    assert "Ranks with calls: 0, and 3 process(es) without a global rank (their files name none);" in md
    section = md.split("## Message sizes", 1)[1].split("\n## ", 1)[0]
    assert "averaged over 3 rank(s)." in section
    assert "- all ranks averaged over are processes without a global rank" in section
    # a trace with its rank: nothing to say
    ingest_run(con, "nq", iter_inputs([data_dir / "kineto-hta/negative_queue_length_values_check/rank0.json.gz"]))
    md = render_markdown(build_report(con, "nq"))
    assert "Ranks with calls: 1. Prediction" in md and "processes without a global rank" not in md


def test_a_one_gpu_job_reads_as_one_rank_of_ddp(con, data_dir) -> None:
    """The real one-rank ResNet-50 DDP trace (ns_resolution_trace: world size 1, GPU tracing on): its one group
    is the job's data parallelism (it was "other: moves no data", so a dp=1 description predicted 97.7 MiB
    against 0 B measured under dp), a run without a configuration is measured only (every row read
    "predicted 0 ... unexplained"), and nothing says kernels are missing or that ranks were matched."""
    from test_config_attach import _file
    from test_resnet50_prediction import resnet50_description

    from commlens.service.config import attach_config
    from commlens.service.ingest import ingest_paths
    from commlens.service.time import time_summary

    assert not ingest_paths(con, [data_dir / "kineto-hta/ns_resolution_trace"], "one").failed
    report = build_report(con, "one", time=time_summary(con, "one"))
    md = render_markdown(report)
    group = report.attribution.groups[0]
    assert (group.scheme, group.size) == ("dp", 1) and "a one-rank job" in group.reason, group
    assert "| dp | - | 97.7 MiB | - | - |" in md
    assert "| dp | all_reduce | float32 | 8196000 | - | 1 | measured only |" in md and "| unexplained |" not in md
    assert "every call is on a one-rank group, where NCCL moves no data between ranks" in md
    assert "the profiler must record CUDA activities" not in md
    assert "35 collective instances of one rank (nothing to match across ranks or wait for)" in md
    assert "one-rank groups: NCCL launches no kernel there" in md
    assert "no straggler: a one-member group: nothing waits for anything" in md
    attach_config(con, "one", [_file("resnet50.json", resnet50_description(dp=1))])
    configured = build_report(con, "one")
    assert configured.exact and [(s.scheme, s.prediction_source) for s in configured.schemes] == [("dp", "config")]
    assert "measured only" not in render_markdown(configured)


def test_a_trace_without_its_rank_says_why_no_rank_has_steps(con, data_dir) -> None:
    """distributed_info_unavailable holds ProfilerStep ranges but names no rank: the time section said "No rank
    has ... profiled steps" without saying it is the rank that is missing (and not the one-rank sentence)."""
    from commlens.service.ingest import ingest_paths
    from commlens.service.time import time_summary

    assert not ingest_paths(con, [data_dir / "kineto-hta/distributed_info_unavailable"], "noinfo").failed
    md = render_markdown(build_report(con, "noinfo", time=time_summary(con, "noinfo")))
    assert "no file names its rank (`commlens ingest --rank N` gives a single-rank file's)" in md
    assert "of one rank" not in md


def test_calls_of_unknown_size_read_unknown_not_zero_bytes(con, data_dir) -> None:
    """The df_index_resolver trace's 2,020 all_reduces carry no size: the report said "measured 0 B" and the
    ingest summary "all_reduce 2020 0 B", as if they moved nothing."""
    from commlens.ingest.inputs import iter_inputs
    from commlens.service.ingest import ingest_run
    from commlens.service.runs import comms_totals

    ingest_run(con, "d", iter_inputs([data_dir / "kineto-hta/df_index_resolver/df_index_resolver.json.gz"]))
    calls, sizes, _ = comms_totals(con, "d")
    assert calls == {"all_reduce": 2020} and sizes == {"all_reduce": (0, 2020)}
    md = render_markdown(build_report(con, "d"))
    assert "| unattributed | - | unknown (no call's size is known) | - | - |" in md
    assert "| unknown size | all_reduce | float32 | 404 | unknown |" in md and "| **total** | | | 404 | unknown |" in md
    assert "0 B" not in md.split("## Bandwidth", 1)[0]
