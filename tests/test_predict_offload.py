"""Host offload of the ZeRO-3 optimizer in the harness (`--offload optimizer [--offload-gpu-fraction 1/g]`).

Without a GPU: the option is refused before any process starts, and the harness predictor's host<->device
bytes follow harness/offload.py's rule (worked out here per parameter shard). With two CUDA devices (never
in CI, which has no GPU; the `cuda` marker): a real run's memcpy lane, as the time analysis stores it,
against the prediction.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from commlens.backend.predict import predict, predict_input_from_config
from commlens.contract.predict import ModelSpec, ParallelSpec, PredictInput
from commlens.harness.config import ConfigError, HarnessConfig, gpu_fraction_gap, validation_errors

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
MODEL = ModelSpec(layers=2, hidden=32, heads=4, vocab=64, seq_len=16)


def test_offload_is_refused_on_cpu_and_without_zero3(tmp_path: Path) -> None:
    errors = validation_errors(HarnessConfig(dp=2, zero=3, offload="optimizer"))
    assert errors == [
        "--offload optimizer needs --device cuda: it measures host<->device copies of the optimizer step, and on "
        "CPU there is no device memory to offload from"
    ]
    errors = validation_errors(HarnessConfig(dp=2, zero=2, offload="optimizer", device="cuda"))
    assert "--offload optimizer offloads the ZeRO-3 optimizer: add --zero 3 (got --zero 2)" in errors
    assert "it needs --offload optimizer" in validation_errors(HarnessConfig(offload_gpu_fraction="1/2"))[0]
    assert gpu_fraction_gap("1/4") == 4 and gpu_fraction_gap(None) == 1
    with pytest.raises(ConfigError, match="expected 1/g"):
        gpu_fraction_gap("2/3")
    out = tmp_path / "never"
    cmd = [sys.executable, "-m", "commlens.cli", "harness", "--out", str(out), "--device", "cpu", "--dp", "2"]
    proc = subprocess.run(
        [*cmd, "--zero", "3", "--offload", "optimizer"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--offload optimizer needs --device cuda" in proc.stderr
    assert not out.exists()


def _harness_shards(gap: int) -> tuple[int, int]:
    """(host-updated, GPU-updated) elements of dp rank 0's shards, registration order, dp = 2."""
    h, v, s, f = 32, 64, 16, 128
    shapes = [(v, h), (s, h)]
    for _ in range(2):
        shapes += [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,), (f, h), (f,), (h, f), (h,)]
    shapes += [(h,), (h,), (v, h)]
    host = gpu = 0
    for i, shape in enumerate(shapes):
        local = math.ceil(shape[0] / 2) * math.prod(shape[1:])
        if gap > 1 and i % gap == gap - 1:
            gpu += local
        else:
            host += local
    return host, gpu


@pytest.mark.parametrize("gap", [1, 4])
def test_harness_offload_prediction_per_shard(gap: int) -> None:
    offload = "zero_offload" if gap == 1 else "deep_optimizer_states"
    parallel = ParallelSpec(dp=2, zero=3, offload=offload, prefetch_gap=gap)
    inp = PredictInput(model=MODEL, parallel=parallel, implementation="harness")
    transfers = {(t.direction, t.what): t.bytes_per_iter for t in predict(inp).stages[0].host_transfers}
    host, gpu = _harness_shards(gap)
    w = 2  # bfloat16 by default
    expected = {
        ("d2h", "gradient shards to the host optimizer"): host * w,
        ("h2d", "updated parameter shards"): host * w,
    }
    if gpu:
        expected[("h2d", "optimizer state prefetched for the GPU update")] = gpu * 12
        expected[("d2h", "optimizer state written back")] = gpu * 12
    assert transfers == expected
    assert host + gpu == (2 * 64 * 32 + 16 * 32 + 2 * (12 * 32 * 32 + 13 * 32) + 2 * 32) // 2  # Ψ / dp: even dims


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(
    not (__import__("torch").cuda.is_available() and __import__("torch").cuda.device_count() >= 2),
    reason="needs two CUDA devices (ZeRO-3 over dp = 2); CI has none",
)
@pytest.mark.parametrize("fraction", [None, "1/4"])
def test_measured_memcpy_matches_the_offload_model(fraction: str | None, tmp_path: Path) -> None:
    """Per rank per profiled step, the memcpy bytes the time analysis stores equal the offload model's plus the
    step's own copies: the micro-batches' tokens in (int64, b·(s+1) each) and each micro-batch's loss out (4 B)."""
    from commlens import store
    from commlens.harness import launch

    options = {"dp": 2, "zero": 3, "layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "seq_len": 16}
    options |= {"micro_batch_size": 2, "steps": 4, "device": "cuda", "dtype": "bfloat16", "offload": "optimizer"}
    options |= {"offload_gpu_fraction": fraction}
    (run,) = launch.plan_runs(tmp_path / "offload", options, None, [], 2)
    launch.prepare(run, overwrite=False)
    proc = subprocess.run(
        launch.torchrun_command(run, ["pytest"]), env=ENV, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    db = tmp_path / "store.duckdb"
    assert not launch.ingest_run(db, run).failed
    prediction = predict(predict_input_from_config(json.loads((run.out / "run.json").read_text())))
    h2d = sum(t.bytes_per_iter for t in prediction.stages[0].host_transfers if t.direction == "h2d")
    d2h = sum(t.bytes_per_iter for t in prediction.stages[0].host_transfers if t.direction == "d2h")
    con = store.connect(db)
    try:
        rows = con.execute(
            """
            SELECT i.rank, s.step, i.kind, sum(i.nbytes)
            FROM timeline_intervals i JOIN runs r USING (run_id)
            JOIN steps s ON s.run_id = i.run_id AND s.rank = i.rank
                AND i.start_us >= s.ts_us AND i.start_us < s.ts_us + s.dur_us
            WHERE r.name = ? AND i.kind IN ('memcpy_htod', 'memcpy_dtoh')
            GROUP BY ALL
            """,
            [run.name],
        ).fetchall()
    finally:
        con.close()
    tokens = 2 * 17 * 8
    measured = {(rank, step, kind): n for rank, step, kind, n in rows}
    for rank in (0, 1):
        for step in (2, 3):
            assert measured[rank, step, "memcpy_htod"] == h2d + tokens
            assert measured[rank, step, "memcpy_dtoh"] == d2h + 4
