"""Context parallelism in the harness: Ring Attention and ATTENTION2D on real torchrun/gloo runs.

Each configuration runs once per module. Checks: the losses equal the single-process reference (the
same function at the same weights, so the first step to float tolerance); every rank's calls, read from
the store's `comms` view after ingesting the traces, equal the per-step list written here from
harness/README.md's formulas and the harness predictor's output, per (scheme, op, dtype, S); the groups
are attributed `cp` from run.json and, without run.json, from the traces' own labels.
"""

from __future__ import annotations

import json
import os
import shutil
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
    "ring": {"cp": 2},
    "attention2d": {"cp": 4, "cp_style": "attention2d", "cp_rq": 2},
    "dp+ring": {"dp": 2, "cp": 2, "micro_batches": 2},
    "tp+ring": {"cp": 2, "tp": 2},
}
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
Calls = Counter[tuple[str, str, str, int]]  # (scheme, op, dtype, S) -> calls per profiled step


# ----------------------------------------------------------------------------- no processes


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"cp": 3, "seq_len": 16}, "--seq-len 16 is not divisible by --cp 3"),
        ({"cp": 4, "cp_style": "attention2d", "cp_rq": 3}, "--cp-rq 3 does not divide --cp 4"),
        ({"cp": 8, "cp_style": "attention2d"}, "--cp 8 is not a perfect square"),
        ({"cp": 2, "cp_rq": 2}, "--cp-rq is the ATTENTION2D mesh split"),
        ({"dp": 2, "cp_style": "attention2d"}, "--cp-style attention2d splits the context-parallel group"),
        ({"cp": 2, "cp_style": "ulysses"}, "--cp-style must be one of ring, attention2d"),
        ({"cp": 2, "pp": 2}, "--cp with --pp is not supported"),
        ({"cp": 2, "dp": 2, "zero": 1}, "--cp with --zero 1 is not supported"),
    ],
)
def test_impossible_cp_configs_are_refused(options: dict, needle: str) -> None:
    assert any(needle in e for e in validation_errors(HarnessConfig(**options))), validation_errors(
        HarnessConfig(**options)
    )


def test_cp_layout_and_cli_refusal(tmp_path: Path) -> None:
    cfg = HarnessConfig(dp=2, cp=2, tp=2)
    assert cfg.world_size == 8 and cfg.mesh_dims == ["dp", "cp", "tp"] and cfg.dp_sync == "ddp"
    assert [cfg.coords(r)["cp"] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert cfg.coords(6) == {"pp": 0, "dp": 1, "cp": 1, "tp": 0}
    assert HarnessConfig(cp=2).strategy == "ddp+cp-ring"  # gradients reduced over dp x cp even with dp = 1
    out = tmp_path / "never"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "commlens.cli",
            "harness",
            "--out",
            str(out),
            "--device",
            "cpu",
            "--cp",
            "4",
            "--cp-style",
            "attention2d",
            "--cp-rq",
            "3",
            "--seq-len",
            "18",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--seq-len 18 is not divisible by --cp 4" in proc.stderr
    assert "--cp-rq 3 does not divide --cp 4" in proc.stderr
    assert not out.exists()


# ----------------------------------------------------------------------------- expected calls (README)


def expected_calls(cfg: HarnessConfig) -> Calls:
    """One profiled step of any rank (all ranks alike here), from harness/README.md's CP section."""
    layers, h, a, s, b, m = cfg.layers, cfg.hidden, cfg.heads, cfg.seq_len, cfg.micro_batch_size, cfg.micro_batches
    c, t, w, f32 = cfg.cp, cfg.tp, 4, "float32"
    n = s // c
    u = b * n * (h // t) * w  # one local Q, K or V block
    per = layers * m
    calls: Calls = Counter()
    if cfg.cp_style == "ring":
        for op in ("send", "recv"):
            calls["cp", op, f32, 2 * u] += c * per  # c-1 K/V hops forward, dK/dV home once backward
            calls["cp", op, f32, 4 * u] += (c - 1) * per  # K, V, dK, dV hops backward
    else:
        rq, rkv = cfg.cp_mesh
        heads = a // t
        calls["cp", "all_gather", f32, rq * u] += 2 * per  # Q (fwd), dO (bwd)
        calls["cp", "reduce_scatter", f32, rq * u] += 2 * per  # output (fwd), dQ (bwd)
        calls["cp", "all_gather", f32, rq * rq * b * heads * n * 4] += per  # log-sum-exp (fwd)
        calls["cp", "all_gather", f32, rq * b * heads * n * 4] += per  # rowsum(dO * O) (bwd)
        calls["cp", "all_gather", f32, rkv * 2 * u] += per  # K and V (fwd)
        calls["cp", "reduce_scatter", f32, rkv * 2 * u] += per  # dK and dV (bwd)
    if t > 1:
        calls["tp", "all_reduce", f32, b * n * h * w] += m * (4 * layers + 2)  # A = b·n·h·w
        calls["tp", "all_reduce", f32, b * n * 4] += 3 * m
    psi = 2 * (cfg.vocab // t) * h + s * h + layers * ((12 * h * h + 7 * h) // t + 6 * h) + 2 * h
    calls["dp", "all_reduce", f32, psi * w] += 1  # one DDP bucket over dp x cp (< 1 MiB)
    return calls


# ----------------------------------------------------------------------------- real runs


def harness_prefetch(items: list[pytest.Item]) -> list[tuple[str, dict]]:
    """The selected tests' configurations (tests/harness_runs.py launches them in the background)."""
    return [(name, dict(TINY, **CONFIGS[name])) for name in params(items, "name")]


@pytest.fixture(scope="module")
def runs(harness_runs: HarnessRuns, tmp_path_factory: pytest.TempPathFactory):
    """A configuration's run (shared by the session: tests/harness_runs.py), ingested into this module's store
    under its name, once, on first use."""
    db = tmp_path_factory.mktemp("cp") / "store.duckdb"
    done: dict[str, launch.PlannedRun] = {}

    def get(name: str) -> tuple[launch.PlannedRun, Path]:
        if name not in done:
            run = named(harness_runs(name, dict(TINY, **CONFIGS[name])), name)
            assert not launch.ingest_run(db, run, replace=False).failed
            done[name] = run
        return done[name], db

    return get


def measured(db: Path, run: str) -> dict[tuple[int, int], Calls]:
    from commlens import store

    con = store.connect(db)
    try:
        rows = con.execute(
            "SELECT rank, step, scheme, op, dtype, msg_bytes, count(*) FROM comms WHERE run = ? GROUP BY ALL",
            [run],
        ).fetchall()
    finally:
        con.close()
    out: dict[tuple[int, int], Calls] = {}
    for rank, step, scheme, op, dtype, size, k in rows:
        out.setdefault((rank, step), Counter())[scheme, op, dtype, size] += k
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cp_run_matches_reference_formulas_and_prediction(name: str, runs) -> None:
    from commlens.backend.predict import predict, predict_input_from_config
    from commlens.harness.reference import reference_losses
    from commlens.run_json import RunConfig

    run, db = runs(name)
    cfg = run.cfg
    data = json.loads((run.out / "run.json").read_text())
    rc = RunConfig.model_validate(data)
    assert (rc.parallel.cp, rc.parallel.cp_style, rc.world_size) == (cfg.cp, cfg.cp_style, cfg.world_size)
    dims = {g.dim for g in rc.groups}
    assert {"cp", "dp_cp"} <= dims and ({"cp_q", "cp_kv"} <= dims) == (cfg.cp_style == "attention2d")
    for g in rc.groups:
        if g.dim == "dp_cp":
            assert len(g.ranks) == cfg.dp * cfg.cp
    ref = reference_losses(cfg)
    assert rc.results.losses[0] == pytest.approx(ref[0], rel=1e-5)  # exact attention, same weights
    assert rc.results.losses == pytest.approx(ref, rel=2e-3)

    expected = expected_calls(cfg)
    prediction = predict(predict_input_from_config(data))
    assert any("exact to the byte" in n for n in prediction.notes)
    (entry,) = prediction.stages
    predicted: Calls = Counter()
    for o in entry.ops:
        predicted[o.scheme, o.op, o.dtype, o.msg_bytes] += o.calls_per_iter
    assert predicted == expected
    per_rank_step = measured(db, run.name)
    assert sorted(per_rank_step) == [(r, s) for r in range(cfg.world_size) for s in (2, 3)]
    for (rank, step), calls in per_rank_step.items():
        assert calls == expected, f"rank {rank} step {step}: {sorted(calls.items())} != {sorted(expected.items())}"


@pytest.mark.slow
def test_cp_groups_are_attributed_from_the_trace_labels_without_run_json(runs, tmp_path: Path) -> None:
    from commlens import store

    run, _ = runs("attention2d")
    traces = tmp_path / "traces"
    traces.mkdir()
    for f in run.out.glob("trace.rank*.json.gz"):
        shutil.copy(f, traces / f.name)
    db = tmp_path / "bare.duckdb"
    report = launch.ingest_run(db, launch.PlannedRun("bare", traces, run.cfg))
    assert not report.failed
    con = store.connect(db)
    try:
        rows = con.execute(
            "SELECT scheme, size, count(*) FROM process_groups JOIN runs USING (run_id) WHERE runs.name = 'bare' "
            "AND size > 1 GROUP BY ALL ORDER BY ALL"
        ).fetchall()
    finally:
        con.close()
    # cp_q and cp_kv groups of 2 (two of each), the dp x cp gradient group of 4; the cp mesh group issues nothing
    assert ("cp", 2, 4) in rows and ("dp", 4, 1) in rows
