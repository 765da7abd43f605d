"""Expert parallelism in the harness: MoE layers with all-to-all-v on real torchrun/gloo runs.

Each configuration runs once per module and is ingested. Checks: the routing the harness records per
profiled step makes the prediction of that step exact, per rank and (scheme, op, dtype, S), against the
store's `comms` view; the run's own prediction (all profiled steps) makes the comparison exact, as
`commlens report` shows it; without the routing the prediction is the expectation under uniform routing and
every measured size lies within four standard deviations of it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from harness_runs import HarnessRuns, named, params

from commlens.harness import launch
from commlens.harness.config import HarnessConfig, validation_errors

TINY = {
    "layers": 2,
    "hidden": 32,
    "heads": 4,
    "vocab": 64,
    "seq_len": 16,
    "micro_batch_size": 2,
    "steps": 4,
    "profile_wait": 1,
    "profile_warmup": 1,
    "profile_active": 2,
    "device": "cpu",
    "dtype": "float32",
    "timeout_s": 120.0,
}
CONFIGS: dict[str, dict] = {
    "ep2": {"ep": 2, "experts": 4, "top_k": 2},
    "ep2-capacity": {"ep": 2, "experts": 4, "top_k": 2, "capacity_factor": 1.0, "micro_batches": 2},
}
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
CLI = (sys.executable, "-m", "commlens.cli", "harness")
Calls = Counter[tuple[str, str, str, int]]


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"ep": 2, "experts": 3}, "--experts 3 is not divisible by --ep 2"),
        ({"ep": 2}, "--ep 2 spreads experts over ranks: give --experts N"),
        ({"experts": 2, "top_k": 3}, "--top-k 3 exceeds --experts 2"),
        ({"experts": 4, "capacity_factor": 0.0}, "--capacity-factor must be a number > 0"),
        ({"dp": 2, "top_k": 2}, "--top-k 2 routes each token to that many experts: it needs --experts"),
        ({"ep": 2, "experts": 4, "tp": 2}, "--experts with tp 2 is not supported"),
        (
            {"dp": 2, "experts": 4},
            "--experts with dp 2 is not supported by the harness: the ep ranks are its "
            "data-parallel replicas (give them as --ep; --nproc without --ep counts them as dp)",
        ),
    ],
)
def test_impossible_ep_configs_are_refused(options: dict, needle: str) -> None:
    errors = validation_errors(HarnessConfig(**options))
    assert any(needle in e for e in errors), errors


def test_cli_refuses_experts_not_divisible_by_ep(tmp_path: Path) -> None:
    out = tmp_path / "never"
    proc = subprocess.run(
        [*CLI, "--out", str(out), "--device", "cpu", "--ep", "4", "--experts", "6", "--top-k", "2"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--experts 6 is not divisible by --ep 4" in proc.stderr
    assert not out.exists()


def harness_prefetch(items: list[pytest.Item]) -> list[tuple[str, dict]]:
    """The selected tests' configurations (tests/harness_runs.py launches them in the background)."""
    return [(name, dict(TINY, **CONFIGS[name])) for name in params(items, "name")]


@pytest.fixture(scope="module")
def runs(harness_runs: HarnessRuns, tmp_path_factory: pytest.TempPathFactory):
    """A configuration's run (shared by the session: tests/harness_runs.py), ingested into this module's store."""
    db = tmp_path_factory.mktemp("ep") / "store.duckdb"
    done: dict[str, launch.PlannedRun] = {}

    def get(name: str) -> tuple[launch.PlannedRun, Path]:
        if name not in done:
            run = named(harness_runs(name, dict(TINY, **CONFIGS[name])), name)
            assert not launch.ingest_run(db, run).failed
            done[name] = run
        return done[name], db

    return get


def measured(db: Path, run: str) -> dict[tuple[int, int], Calls]:
    from commlens import store

    con = store.connect(db)
    try:
        rows = con.execute(
            "SELECT rank, step, scheme, op, dtype, msg_bytes, count(*) FROM comms WHERE run = ? GROUP BY ALL", [run]
        ).fetchall()
    finally:
        con.close()
    out: dict[tuple[int, int], Calls] = {}
    for rank, step, scheme, op, dtype, size, k in rows:
        out.setdefault((rank, step), Counter())[scheme, op, dtype, size] += k
    return out


def predicted(prediction) -> dict[int, Calls]:
    out: dict[int, Calls] = {}
    for entry in prediction.stages:
        calls: Calls = Counter()
        for o in entry.ops:
            calls[o.scheme, o.op, o.dtype, o.msg_bytes] += o.calls_per_iter
        for r in entry.ranks:
            out[r] = calls
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logged_routing_makes_each_step_exact(name: str, runs) -> None:
    from commlens.backend.predict import predict, predict_input_from_config

    run, db = runs(name)
    cfg = run.cfg
    data = json.loads((run.out / "run.json").read_text())
    assert data["parallel"]["ep"] == 2 and data["model"]["experts"] == 4 and data["strategy"].startswith("ddp+moe4")
    routing = data["moe_routing"]
    assert sorted(routing) == ["2", "3"]
    tokens_k = cfg.micro_batch_size * cfg.seq_len * cfg.top_k
    for step in routing.values():
        for calls in step.values():
            assert len(calls) == cfg.layers * cfg.micro_batches
            if cfg.capacity_factor is None:
                assert all(sum(c) == tokens_k for c in calls)  # every (token, choice) row is dispatched
            else:
                cap = -(-int(cfg.capacity_factor * tokens_k) // cfg.experts)
                assert all(sum(c) <= cfg.experts * cap for c in calls)
    per_rank_step = measured(db, run.name)
    for step, step_routing in routing.items():
        one_step = dict(data, moe_routing={step: step_routing})
        expected = predicted(predict(predict_input_from_config(one_step)))
        for rank in range(cfg.world_size):
            got = per_rank_step[rank, int(step)]
            assert got == expected[rank], (
                f"rank {rank} step {step}: {sorted(got.items())} != {sorted(expected[rank].items())}"
            )
            # the all-to-all sizes, worked out here from the counts: rows sent, rows received (fwd and bwd each)
            row = cfg.hidden * 4
            sizes: Counter[int] = Counter()
            for c in range(cfg.layers * cfg.micro_batches):
                sizes[sum(step_routing[str(rank)][c]) * row] += 2
                sizes[sum(step_routing[str(r)][c][rank] for r in range(cfg.ep)) * row] += 2
            assert sizes == Counter({k[3]: n for k, n in got.items() if k[:3] == ("ep", "all_to_all", "float32")})
            assert got["ep", "all_to_all", "int64", cfg.experts * 8] == cfg.layers * cfg.micro_batches


@pytest.mark.slow
def test_report_of_a_harness_ep_run_is_exact(runs) -> None:
    from commlens import store
    from commlens.backend.compare import compare

    run, db = runs("ep2")
    con = store.connect(db)
    try:
        comparison = compare(con, run.name)
    finally:
        con.close()
    assert comparison.exact, [(o.op, o.msg_bytes, o.status) for s in comparison.schemes for o in s.ops]
    schemes = {s.scheme for s in comparison.schemes}
    assert schemes == {"dp", "ep"}


@pytest.mark.slow
def test_measured_sizes_lie_within_the_uniform_routing_spread(runs) -> None:
    """Without a capacity cap (with one, the learned router's skew drops more rows than uniform routing would:
    the expectation is for uniform routing only, and the run's own routing is what makes it exact)."""
    from commlens.backend.predict import predict, predict_input_from_config

    run, db = runs("ep2")
    data = json.loads((run.out / "run.json").read_text())
    data.pop("moe_routing")
    prediction = predict(predict_input_from_config(data))
    assert any("expectations under uniform" in n for n in prediction.notes)
    band = [
        (o.msg_bytes, o.spread_bytes or 0.0)
        for o in prediction.stages[0].ops
        if o.dtype == "float32" and o.scheme == "ep"
    ]
    # t·k rows sent (exact) and received (expected): one merged entry with the received spread
    tokens_k = run.cfg.micro_batch_size * run.cfg.seq_len * run.cfg.top_k
    assert band == [(tokens_k * run.cfg.hidden * 4, pytest.approx(band[0][1]))] and band[0][1] > 0
    for (_, step), calls in measured(db, run.name).items():
        for scheme, _op, dtype, size in calls:
            if scheme == "ep" and dtype == "float32":
                assert any(abs(size - mean) <= 4 * spread for mean, spread in band), (step, size, band)
