"""The training harness: validation without processes, then real torchrun/gloo runs of every scheme.

Each run is checked three ways: its losses against the single-process reference, its run.json, and
its traces against the per-rank call list of harness/README.md (computed here from the formulas, not
from the harness's code) — once on the raw Kineto JSON and once through the ingester's `comms` view.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import os
import re
import shlex
import subprocess
import sys
from collections import Counter
from pathlib import Path

import background
import pytest
from harness_runs import params

from commlens.harness import launch
from commlens.harness.config import ConfigError, HarnessConfig, resolve_world, validation_errors

# Profiled steps 2 and 3: step 1 holds DDP's one-time bucket rebuild (README), outside the window.
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

SCHEMES: dict[str, dict] = {
    # 1.8 MB of gradients: PyTorch's 1 MiB first bucket, then the rest (the predictor's bucket rule, exercised);
    # two micro-batches: DDP still all-reduces each bucket once per step. (One bucket: the dp runs of the other
    # modules.)
    "ddp": {"dp": 2, "micro_batches": 2, "hidden": 128, "vocab": 256},
    "zero1": {"dp": 2, "zero": 1, "micro_batches": 2},
    "zero2": {"dp": 2, "zero": 2, "micro_batches": 2},
    "zero3": {"dp": 2, "zero": 3, "micro_batches": 2},
    "tp": {"tp": 2},
    "tp-sp": {"tp": 2, "sp": True},
    "pp-gpipe": {"pp": 2, "micro_batches": 3, "schedule": "gpipe"},
    "pp-1f1b": {"pp": 2, "micro_batches": 3, "schedule": "1f1b"},
    "ddp+tp": {"dp": 2, "tp": 2, "micro_batches": 2},
    "tp-sp+pp": {"tp": 2, "pp": 2, "sp": True, "micro_batches": 2, "schedule": "1f1b"},
}
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
# Everything `commlens harness` itself prints on stdout: the run header, the ranks' progress, the table of output
# files (title and box lines), the losses and the ingest summary.
HARNESS_STDOUT = re.compile(
    r"run \d+/\d+ \S+: \S+, world \d+ \((?:cpu|cuda)\) -> \S+"
    r"|\[commlens harness\] (?:step \d+/\d+ loss[^\n]* \(\d+\.\d\ds\)|wrote \S+/run\.json)"
    r"| *\S+: output files *|[┏┃┡│└].*[┓┃┩│┘]"
    r"|loss per step: \d+\.\d{4}(?:, \d+\.\d{4})*"
    r"|ingested \d+/\d+ files into \S+ as run '\S+'"
)
# Kineto's start/stop markers (STAGE:..., USDT:...), which `commlens harness` leaves out unless --verbose
PROFILER_MARKER = re.compile(r"^(?:STAGE|USDT):", re.MULTILINE)


# ----------------------------------------------------------------------------- no processes


def test_validation_lists_every_problem():
    cfg = HarnessConfig(tp=3, pp=2, layers=3, heads=4, vocab=64, sp=True, seq_len=16, zero=2, steps=1)
    errors = "\n".join(validation_errors(cfg))
    for needle in (
        "--layers 3 is not divisible by --pp 2",
        "--heads 4 is not divisible by --tp 3",
        "--vocab 64 is not divisible by --tp 3",
        "--seq-len 16 is not divisible by --tp 3",
        "--zero 2 shards over the dp group",
        "--steps 1 is shorter than the profiler schedule",
    ):
        assert needle in errors
    assert validation_errors(HarnessConfig(sp=True)) == ["--sp (sequence parallelism) needs --tp > 1"]
    assert validation_errors(HarnessConfig(dp=2, tp=2, pp=2, layers=4, sp=True, zero=1)) == []
    assert "no CUDA device" in validation_errors(HarnessConfig(device="cuda"), cuda_devices=0)[0]
    assert "needs 8 GPUs" in validation_errors(HarnessConfig(device="cuda", dp=8), cuda_devices=4)[0]


def test_world_size_resolution():
    assert resolve_world(None, 2, 2, 8) == 2
    assert resolve_world(None, 1, 1, None) == 1 and resolve_world(4, 1, 1, None) == 4
    with pytest.raises(ConfigError, match=r"world size 6 .* not divisible by tp\*pp = 2\*2 = 4"):
        resolve_world(None, 2, 2, 6)
    with pytest.raises(ConfigError, match="does not equal dp\\*tp\\*pp"):
        resolve_world(2, 2, 1, 8)


def test_sweep_plans_one_validated_run_per_value(tmp_path):
    runs = launch.plan_runs(tmp_path, dict(TINY, dp=None, tp=2, pp=1), 2, ["seq-len=16,32", "lr=0.01"], None)
    assert [(r.name, r.cfg.seq_len, r.cfg.lr, r.cfg.dp) for r in runs] == [
        (f"{tmp_path.name}.seq-len-16_lr-0.01", 16, 0.01, 1),
        (f"{tmp_path.name}.seq-len-32_lr-0.01", 32, 0.01, 1),
    ]
    assert runs[0].out == tmp_path / "seq-len-16_lr-0.01"
    with pytest.raises(ConfigError, match="not a numeric harness flag"):
        launch.parse_sweep("schedule=gpipe,1f1b")
    with pytest.raises(ConfigError, match="'seq-len=32,64,32': 32 given twice"):  # two runs into one folder
        launch.parse_sweep("seq-len=32,64,32")
    with pytest.raises(ConfigError, match="seq-len-15: --sp splits the sequence"):
        launch.plan_runs(tmp_path, dict(TINY, dp=None, tp=2, pp=1, sp=True), None, ["seq-len=16,15"], None)


def test_a_run_is_named_after_its_folder_even_as_dot(tmp_path, monkeypatch):
    """`--out .` names the run after the current folder (it was "", which ingest refused after training); a
    folder whose name no run can take is refused before anything starts."""
    monkeypatch.chdir(tmp_path)
    (run,) = launch.plan_runs(Path("."), dict(TINY, dp=1, tp=1, pp=1), None, [], None)
    assert run.name == tmp_path.name
    (tmp_path / " padded").mkdir()
    with pytest.raises(ConfigError, match="--out  padded: run name ' padded' begins or ends with whitespace"):
        launch.plan_runs(Path(" padded"), dict(TINY, dp=1, tp=1, pp=1), None, [], None)
    # an --out that is a file (or under one) is said before anything starts (it was FileExistsError's traceback)
    (tmp_path / "afile").write_text("x")
    for out in ("afile", "afile/sub"):
        with pytest.raises(ConfigError, match=f"--out {out}: afile is a file, not a directory"):
            launch.plan_runs(Path(out), dict(TINY, dp=1, tp=1, pp=1), None, [], None)


def test_cli_refuses_impossible_config_before_starting(tmp_path):
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
            "--nproc",
            "3",
            "--tp",
            "2",
            "--layers",
            "3",
            "--pp",
            "2",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "world size 3 (--nproc) is not divisible by tp*pp = 2*2 = 4" in proc.stderr
    assert "--layers 3 is not divisible by --pp 2" in proc.stderr
    assert not out.exists()  # nothing written, nothing started


def test_dry_run_prints_shell_lines_that_start_the_job(tmp_path):
    """The printed lines paste into a shell as they are (quoted words, the recorded command without --dry-run),
    and the multi-node line splits the world evenly over its nodes (3 processes: 3 nodes of 1, not 2 of 1)."""

    def dry_run(out: Path, *flags: str) -> list[str]:
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
                "--dry-run",
                *flags,
            ],
            capture_output=True,
            text=True,
            env=ENV,
            timeout=120,
            check=True,
        )
        return [line.split(":", 1)[1].strip() for line in proc.stdout.splitlines() if line.startswith("  ")]

    out = tmp_path / "my run"
    single, multi = dry_run(out, "--dp", "3")
    words = shlex.split(single)
    assert words[1:] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "3",
        "-m",
        "commlens.harness.worker",
        "--config",
        str(out / launch.CONFIG_NAME),
        "--out",
        str(out),
        "--command",
        json.dumps(["commlens", "harness", "--out", str(out), "--device", "cpu", "--dp", "3"]),
    ]
    assert shlex.split(multi)[:5] == ["torchrun", "--nnodes", "3", "--nproc-per-node", "1"]
    assert shlex.split(multi)[-4:] == ["--config", str(out / launch.CONFIG_NAME), "--out", str(out)]
    assert shlex.split(dry_run(tmp_path / "w8", "--dp", "2", "--tp", "4")[1])[1:5] == [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "4",
    ]
    assert dry_run(tmp_path / "w1", "--dp", "1")[1] == "(a world of one process runs on one node)"


def test_sweep_takes_the_command_line_names_of_flags():
    assert launch.parse_sweep("timeout=30,60") == ("timeout_s", [30, 60])
    assert launch.parse_sweep("timeout-s=30") == ("timeout_s", [30])
    with pytest.raises(ConfigError, match=r"one of: .*steps, timeout, top-k"):
        launch.parse_sweep("device=1,2")


def test_profiler_markers_are_left_out_and_everything_else_passes():
    kept = [
        b"[W123 socket.cpp:464] a warning of gloo's\n",
        b"ERROR:2026-11-25 02:09:48 27459:27459 CuptiActivityApi.cpp:52] an error of Kineto's\n",
        b"Traceback (most recent call last):\n",
        "  \u00e9 not ASCII\n".encode(),
    ]
    markers = [
        b"STAGE:2026-11-25 02:09:48 27459:27459 SyncActivityProfilerHandler.cpp:51] Completed Stage: Warm Up\n",
        b"USDT:2026-11-25 02:09:48 27459:27459 SyncActivityProfilerHandler.cpp:52] profiler_start\n",
    ]
    source = io.BytesIO(b"".join([markers[0], kept[0], markers[1], *kept[1:]]))
    sink = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True)
    launch.copy_without_noise(source, sink)
    assert sink.buffer.getvalue() == b"".join(kept)  # type: ignore[attr-defined]


def test_cli_import_does_not_import_torch():
    code = "import sys, commlens.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env=ENV, timeout=120)


def test_model_slices_compute_the_full_model():
    torch = pytest.importorskip("torch")
    from commlens.harness.model import GPTShape, TPInfo, build_stage, full_model

    shape = GPTShape(layers=4, hidden=32, heads=4, vocab=64, seq_len=16)
    full = full_model(shape, seed=3)
    count = sum(p.numel() for p in full.parameters())
    h, vocab, s, layers = 32, 64, 16, 4
    assert count == 2 * vocab * h + s * h + layers * (12 * h * h + 13 * h) + 2 * h == shape.param_count()
    for t, p in ((2, 1), (1, 2), (2, 2)):
        held = 0
        for pp_i in range(p):
            for k in range(t):
                stage = build_stage(shape, 3, TPInfo(t, k), pp_i, p)
                n = sum(x.numel() for x in stage.parameters())
                assert n == psi_r(shape.layers, h, vocab, s, t, p, pp_i)
                held += n
        replicated = (t - 1) * (s * h + layers * 6 * h + 2 * h)  # wpe, LayerNorms, row biases on every tp rank
        assert held - replicated == count
    # tp=1, pp=1 is the full model, parameter for parameter
    same = build_stage(shape, 3, TPInfo(), 0, 1)
    for (n1, a), (n2, b) in zip(full.named_parameters(), same.named_parameters(), strict=True):
        assert n1 == n2 and torch.equal(a, b)


def test_reference_loss_falls():
    from commlens.harness.reference import reference_losses

    losses = reference_losses(HarnessConfig(**dict(TINY, steps=4)))
    assert losses[0] == pytest.approx(math.log(64), rel=0.05)  # untrained: about ln V
    assert losses[-1] < losses[0] - 0.2


# ----------------------------------------------------------------------------- expected calls (README)


def psi_r(layers: int, h: int, vocab: int, s: int, t: int, p: int, stage: int) -> int:
    first, last, n = stage == 0, stage == p - 1, layers // p
    return first * (vocab * h // t + s * h) + n * ((12 * h * h + 7 * h) // t + 6 * h) + last * (2 * h + vocab * h // t)


def _fsdp_units(cfg: HarnessConfig, rank: int) -> tuple[list[int], int]:
    """FSDP2 unit sizes (elements, all ranks) for the rank's stage: blocks, root."""
    from commlens.harness.model import GPTShape, TPInfo, build_stage

    co = cfg.coords(rank)
    stage = build_stage(
        GPTShape(cfg.layers, cfg.hidden, cfg.heads, cfg.vocab, cfg.seq_len),
        cfg.seed,
        TPInfo(cfg.tp, co["tp"]),
        co["pp"],
        cfg.pp,
    )
    d = cfg.dp

    def unit(params) -> int:
        return d * sum(math.ceil(q.shape[0] / d) * (q.numel() // q.shape[0]) for q in params)

    blocks = [unit(b.parameters()) for b in stage.blocks]
    root = [q for n, q in stage.named_parameters() if not n.startswith("blocks.")]
    return blocks, unit(root) if root else 0


def expected_calls(cfg: HarnessConfig, rank: int, run: dict) -> Counter:
    """(dim, op, pp_msg bytes) -> calls of one profiled step on `rank`, per harness/README.md."""
    co = cfg.coords(rank)
    layers, h, vocab, s, b, micros = (
        cfg.layers,
        cfg.hidden,
        cfg.vocab,
        cfg.seq_len,
        cfg.micro_batch_size,
        cfg.micro_batches,
    )
    d, t, p, w = cfg.dp, cfg.tp, cfg.pp, 4
    first, last, n = co["pp"] == 0, co["pp"] == p - 1, layers // p
    act = b * s * h * w
    calls: Counter = Counter()
    if t > 1:
        per_micro = 4 * n + first + last
        if cfg.sp:
            calls["tp", "all_gather", act] += micros * per_micro
            calls["tp", "reduce_scatter", act] += micros * per_micro
            sp_numel = first * s * h + n * 6 * h + last * 2 * h
            if cfg.zero == 3:
                sp_numel //= d  # every SP parameter's dim 0 divides by d in these runs
            calls["tp", "all_reduce", sp_numel * w] += micros if cfg.zero == 2 else 1
        else:
            calls["tp", "all_reduce", act] += micros * per_micro
        if last:
            calls["tp", "all_reduce", b * s * 4] += 3 * micros
    if p > 1:
        pp_msg = b * (s // t if cfg.sp else s) * h * w
        for op in ("send", "recv"):
            calls["pp", op, pp_msg] += micros * ((co["pp"] < p - 1) + (co["pp"] > 0))
    if d > 1:
        psi = psi_r(layers, h, vocab, s, t, p, co["pp"])
        padded = math.ceil(psi / d) * d
        sync = cfg.dp_sync
        if sync == "ddp":
            buckets = run["ranks"][rank]["sync"]["ddp_bucket_bytes"]
            assert sum(buckets) == psi * w  # DDP buckets cover every gradient exactly once
            assert len(buckets) == (2 if psi * w > 1 << 20 else 1)  # a 1 MiB first bucket, then 25 MiB ones
            for size in buckets:
                calls["dp", "all_reduce", size] += 1
        elif sync == "allreduce":
            calls["dp", "all_reduce", psi * w] += 1
        elif sync in ("zero1", "zero2"):
            calls["dp", "reduce_scatter", padded * w] += 1 if sync == "zero1" else micros
            calls["dp", "all_gather", padded * w] += 1
        elif sync == "zero3":
            blocks, root = _fsdp_units(cfg, rank)
            for u in blocks:
                calls["dp", "all_gather", u * w] += 2 * micros
                calls["dp", "reduce_scatter", u * w] += micros
            if root:
                calls["dp", "all_gather", root * w] += micros
                calls["dp", "reduce_scatter", root * w] += micros
    return calls


# ----------------------------------------------------------------------------- raw traces

_C10D = {
    "c10d::allreduce_": "all_reduce",
    "c10d::_allgather_base_": "all_gather",
    "c10d::_reduce_scatter_base_": "reduce_scatter",
    "c10d::send": "send",
    "c10d::recv_": "recv",
}


def _numel(dims) -> int:
    while dims and isinstance(dims[0], list):
        dims = dims[0]
    return math.prod(dims)


def trace_calls(path: Path) -> tuple[dict, dict[int, Counter]]:
    """distributedInfo and, per ProfilerStep, (dim, op, S bytes) -> calls of the labelled c10d ops."""
    with gzip.open(path) as f:
        data = json.loads(f.read())
    events = data["traceEvents"]
    steps = [
        (int(e["name"].split("#")[1]), e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("name", "").startswith("ProfilerStep#")
    ]
    labels = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("commlens:")]
    out: dict[int, Counter] = {n: Counter() for n, _, _ in steps}
    for e in events:
        if e.get("cat") != "cpu_op" or not e["name"].startswith("c10d::"):
            continue
        op = _C10D.get(e["name"])
        assert op is not None, f"unexpected {e['name']} in {path.name}"
        around = [
            lab
            for lab in labels
            if lab["tid"] == e["tid"] and lab["ts"] <= e["ts"] and e["ts"] + e["dur"] <= lab["ts"] + lab["dur"]
        ]
        assert around, f"{e['name']} at {e['ts']} in {path.name} has no commlens label"
        dims = e["args"]["Input Dims"]
        numel = _numel(dims[1]) if op == "reduce_scatter" else _numel(dims[0])  # S: gather output, scatter input
        _, dim, _pg = around[-1]["name"].split(":")
        step = next(n for n, t0, t1 in steps if t0 <= e["ts"] <= t1)
        out[step][dim, op, numel * 4] += 1
    return data["distributedInfo"], out


# ----------------------------------------------------------------------------- real runs


def harness_prefetch(items: list[pytest.Item]) -> list[tuple[str, dict]]:
    """The selected tests' schemes (tests/harness_runs.py launches them in the background)."""
    return [(scheme, dict(TINY, **SCHEMES[scheme])) for scheme in params(items, "scheme")]


@pytest.fixture
def runs(harness_runs, request):
    """A scheme's run, shared by the session (tests/harness_runs.py): launched once."""
    chosen = {item.name for item in request.session.items if getattr(item, "module", None) is request.module}
    for test, (name, make) in BACKGROUND_WITH_RUNS.items():  # the CLI's crash and sweep runs beside them
        if test in chosen:
            background.start(name, make)
    return lambda scheme: harness_runs(scheme, dict(TINY, **SCHEMES[scheme]))


@pytest.mark.slow
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_scheme_run(scheme, runs):
    from commlens.harness.reference import reference_losses
    from commlens.run_json import RunConfig

    run = runs(scheme)
    cfg = run.cfg
    world = cfg.world_size
    files = sorted(p.name for p in launch.output_files(run.out))
    assert files == sorted(["run.json"] + [f"trace.rank{r}.json.gz" for r in range(world)])

    data = json.loads((run.out / "run.json").read_text())
    rc = RunConfig.model_validate(data)
    assert rc.strategy == cfg.strategy and rc.world_size == world and rc.parallel.dp_sync == cfg.dp_sync
    layers, h, vocab, s = (
        cfg.layers,
        cfg.hidden,
        cfg.vocab,
        cfg.seq_len,
    )  # embeddings + LM head, positions, blocks, final LN
    assert rc.model.param_count == 2 * vocab * h + s * h + layers * (12 * h * h + 13 * h) + 2 * h
    assert rc.profile.profiled_steps == [2, 3] and rc.mesh_dims == cfg.mesh_dims
    assert rc.torch_version and rc.backend == "gloo" and rc.command == ["pytest", run.name]
    for info in rc.ranks:
        assert info.coords == cfg.coords(info.rank)
        assert info.param_count == psi_r(
            cfg.layers, cfg.hidden, cfg.vocab, cfg.seq_len, cfg.tp, cfg.pp, info.coords["pp"]
        )
    # every rank is in exactly one group per mesh dim, holding the ranks that differ only along that dim
    for dim in cfg.mesh_dims:
        groups = [g for g in rc.groups if g.dim == dim]
        assert sorted(r for g in groups for r in g.ranks) == list(range(world))
        for g in groups:
            others = [{k: v for k, v in cfg.coords(r).items() if k != dim} for r in g.ranks]
            assert all(o == others[0] for o in others) and len(g.ranks) == getattr(cfg, dim)

    losses = rc.results.losses
    ref = reference_losses(cfg)
    assert losses[0] == pytest.approx(ref[0], rel=1e-5)  # the same function at the same initial weights
    assert losses == pytest.approx(ref, rel=2e-3)
    assert losses[-1] < losses[0]

    pg_of = {(g.dim, r): g.pg_name for g in rc.groups for r in g.ranks}
    for r in range(world):
        info, per_step = trace_calls(run.out / f"trace.rank{r}.json.gz")
        assert info["rank"] == r and info["world_size"] == world
        names = {g["pg_name"] for g in info["pg_config"]}
        assert {pg_of[dim, r] for dim in cfg.mesh_dims} <= names  # run.json names are the trace's names
        expected = expected_calls(cfg, r, data)
        assert sorted(per_step) == [2, 3]
        for step, calls in per_step.items():
            assert calls == expected, f"rank {r} step {step}: {sorted(calls.items())} != {sorted(expected.items())}"


@pytest.mark.slow
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_harness_predictor_matches_the_traces(scheme, runs):
    """The harness predictor (backend/predict/) reads run.json only; it must match every rank's trace."""
    from commlens.backend.predict import predict, predict_input_from_config

    run = runs(scheme)
    prediction = predict(predict_input_from_config(json.loads((run.out / "run.json").read_text())))
    covered = []
    for entry in prediction.stages:
        expected: Counter = Counter()
        for op in entry.ops:
            expected[op.scheme, op.op, op.msg_bytes] += op.calls_per_iter
        for r in entry.ranks:
            covered.append(r)
            _, per_step = trace_calls(run.out / f"trace.rank{r}.json.gz")
            for step, calls in per_step.items():
                assert calls == expected, (
                    f"rank {r} step {step}: trace {sorted(calls.items())} != prediction {sorted(expected.items())}"
                )
    assert sorted(covered) == list(range(run.cfg.world_size))


def _crash_run(folder: Path) -> background.Command:
    args = [sys.executable, "-m", "commlens.cli", "harness", "--out", str(folder / "crash"), "--device", "cpu"]
    args += ["--dp", "2", "--layers", "2", "--hidden", "32", "--vocab", "64", "--seq-len", "16", "--steps", "3"]
    args += ["--profile-wait", "1", "--profile-warmup", "0", "--timeout", "60"]
    return background.Command(args, dict(ENV, COMMLENS_HARNESS_FAIL_RANK="1"))


def _sweep_args(out: Path, db: Path, sweep: str) -> list[str]:
    args = [sys.executable, "-m", "commlens.cli", "harness", "--out", str(out), "--device", "cpu", "--tp", "2"]
    args += ["--layers", "2", "--hidden", "32", "--vocab", "64", "--steps", "4", "--sweep", sweep]
    return [*args, "--ingest", "--db", str(db)]


def _sweep_run(folder: Path) -> background.Command:
    return background.Command(_sweep_args(folder / "sweep", folder / "store.duckdb", "seq-len=8,16"), ENV)


# The CLI runs of these tests, started with the schemes' runs (the `runs` fixture) rather than when collection
# ends, so that only this module's byte-exact runs share the host with them (tests/background.py).
BACKGROUND_WITH_RUNS = {
    "test_crashing_rank_ends_the_job_with_its_traceback": ("crash", _crash_run),
    "test_cli_sweep_ingests_each_run_and_tp_volume_is_linear_in_seq_len": ("sweep", _sweep_run),
}


@pytest.mark.slow
def test_crashing_rank_ends_the_job_with_its_traceback():
    folder, proc = background.result("crash", _crash_run, timeout=240)
    out = folder / "crash"
    assert proc.returncode == 1
    both = proc.stdout + proc.stderr
    assert "injected failure on rank 1" in both and "Traceback" in both
    assert "run crash failed (torchrun exit code" in both
    assert not (out / "run.json").exists()


@pytest.mark.slow
def test_cli_sweep_ingests_each_run_and_tp_volume_is_linear_in_seq_len():
    folder, proc = background.result("sweep", _sweep_run, timeout=600)
    out, db = folder / "sweep", folder / "store.duckdb"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "trace.rank1.json.gz" in proc.stdout and "loss per step" in proc.stdout
    # no profiler or library noise: stdout holds only the harness's own lines, stderr no profiler marker
    assert [line for line in proc.stdout.splitlines() if not HARNESS_STDOUT.fullmatch(line)] == []
    assert PROFILER_MARKER.findall(proc.stderr) == [], proc.stderr[-2000:]
    tp_bytes = {}
    for s in (8, 16):
        run_dir = out / f"seq-len-{s}"
        assert json.loads((run_dir / "run.json").read_text())["model"]["seq_len"] == s
        _, per_step = trace_calls(run_dir / "trace.rank0.json.gz")
        tp_bytes[s] = sum(S * n for (dim, op, S), n in per_step[2].items() if dim == "tp" and op == "all_reduce")
    assert tp_bytes[16] == 2 * tp_bytes[8]

    from commlens import store

    con = store.connect(db)
    try:
        names = {r[0] for r in con.execute("SELECT DISTINCT run FROM comms").fetchall()}
        assert names == {"sweep.seq-len-8", "sweep.seq-len-16"}
        per_run = dict(
            con.execute(
                "SELECT run, sum(msg_bytes) FROM comms WHERE rank = 0 AND step = 2 AND op = 'all_reduce' GROUP BY run"
            ).fetchall()
        )
        assert per_run == {"sweep.seq-len-8": tp_bytes[8], "sweep.seq-len-16": tp_bytes[16]}
        calls = con.execute("SELECT count(*) FROM comms WHERE run = 'sweep.seq-len-8'").fetchone()[0]
    finally:
        con.close()

    def again(out_dir: Path, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*_sweep_args(out_dir, db, "seq-len=8"), *extra],
            capture_output=True,
            text=True,
            env=ENV,
            timeout=600,
            check=False,
        )

    # The same sweep again is refused before anything starts: its outputs exist, and (from another
    # directory of the same name) the store holds its run ...
    proc = again(out)
    assert proc.returncode == 2 and "already holds harness outputs" in proc.stderr
    proc = again(folder / "other" / "sweep")
    assert proc.returncode == 2 and "already holds run(s) sweep.seq-len-8" in proc.stderr
    assert not (folder / "other").exists()
    # ... and with --overwrite the run's data is replaced, not added to.
    proc = again(out, "--overwrite")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    con = store.connect(db)
    try:
        assert con.execute("SELECT count(*) FROM comms WHERE run = 'sweep.seq-len-8'").fetchone()[0] == calls
        assert (
            con.execute(
                "SELECT count(*) FROM sources s JOIN runs r USING (run_id) WHERE r.name = 'sweep.seq-len-8'"
            ).fetchone()[0]
            == 3
        )  # run.json and two traces, once
    finally:
        con.close()


# ----------------------------------------------------------------------------- through the ingester


@pytest.mark.slow
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_ingested_run_shows_the_scheme_in_the_right_groups(scheme, runs, tmp_path):
    from commlens import store
    from commlens.backend.attribution import attribute_run
    from commlens.service.ingest import ingest_paths

    run = runs(scheme)
    cfg = run.cfg
    data = json.loads((run.out / "run.json").read_text())
    con = store.connect(tmp_path / "store.duckdb")
    try:
        summary = ingest_paths(con, launch.output_files(run.out), scheme)
        assert not summary.failed, [f.error for f in summary.failed]
        attribute_run(con, scheme)
        rows = con.execute(
            "SELECT rank, step, scheme, group_key, op, msg_bytes, count(*) FROM comms WHERE run = ? GROUP BY ALL",
            [scheme],
        ).fetchall()
    finally:
        con.close()
    pg_of = {(g["dim"], r): g["pg_name"] for g in data["groups"] for r in g["ranks"]}
    measured: dict[tuple[int, int], Counter] = {}
    for rank, step, sch, key, op, size, n in rows:
        if step not in (2, 3):
            continue
        # the rank's own group of that dim (gloo traces name it only through the commlens:<dim>:<pg> labels)
        assert (sch, rank) in pg_of and key == f"pg:{pg_of[sch, rank]}", (
            f"rank {rank} step {step}: {n} x {op} of {size} B landed in group {key} with scheme {sch}"
        )
        measured.setdefault((rank, step), Counter())[sch, op, size] += n
    for r in range(cfg.world_size):
        expected = expected_calls(cfg, r, data)
        for step in (2, 3):
            assert measured.get((r, step), Counter()) == expected, f"rank {r} step {step}"
    if scheme == "ddp":  # the headline: DDP all-reduces every parameter once per step
        dp_bytes = sum(S * n for (sch, op, S), n in measured[0, 2].items() if sch == "dp")
        assert dp_bytes == data["model"]["param_count"] * 4


@pytest.mark.slow
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_report_shows_predicted_equal_to_measured(scheme, runs, tmp_path):
    """The whole analysis chain on a harness run: ingest -> attribution -> compare is exact for every scheme."""
    from commlens import store
    from commlens.backend.attribution import attribute_run
    from commlens.backend.compare import compare
    from commlens.service.ingest import ingest_paths

    run = runs(scheme)
    con = store.connect(tmp_path / "store.duckdb")
    try:
        assert not ingest_paths(con, launch.output_files(run.out), scheme).failed
        attribute_run(con, scheme)
        c = compare(con, scheme)
    finally:
        con.close()
    assert c.config_source == "run" and c.implementation == "harness" and c.iterations_mode == "steps"
    assert c.ranks == [str(r) for r in range(run.cfg.world_size)]
    assert not c.unexplained and not c.missing, (c.unexplained, c.missing)
    assert c.exact, [o for s in c.schemes for o in s.ops if o.status != "match"]
    assert {s.scheme for s in c.schemes} == set(run.cfg.mesh_dims)
    assert all(s.ratio == 1.0 for s in c.schemes)
