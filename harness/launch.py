"""Planning and launching harness runs: sweeps, the torchrun command, output files, ingestion.

Imports no torch: the launcher process only validates, starts torchrun and reads the results.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from .config import ConfigError, HarnessConfig, resolve_world, validation_errors

if TYPE_CHECKING:
    from commlens.service.ingest import IngestReport

CONFIG_NAME = ".harness-config.json"  # hidden: `commlens ingest DIR` skips it
# In ingestion order: run.json first (it labels the groups), then traces, NCCL logs and the Flight Recorder dumps
# a --hang run leaves (ingested beside the traces, they show where the job stopped)
OUTPUT_GLOBS = ("run.json", "trace.rank*.json.gz", "nccl.*.log", "flight_recorder.rank*.json")
# The markers Kineto (the profiler's C++ side) writes to every rank's stderr at each start and stop, whatever
# KINETO_LOG_LEVEL says short of silencing its errors too, e.g.
#   STAGE:2026-11-25 02:09:48 27459:27459 SyncActivityProfilerHandler.cpp:51] Completed Stage: Warm Up
#   USDT:2026-11-25 02:09:48 27459:27459 SyncActivityProfilerHandler.cpp:52] profiler_start
# They say nothing about the run; the launcher drops them unless --verbose. Kineto's warnings and errors pass.
PROFILER_NOISE = re.compile(rb"^(?:STAGE|USDT):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ [\w.]+\.cpp:\d+\] ")


@dataclass
class PlannedRun:
    name: str  # run name for ingestion: the output directory's name
    out: Path
    cfg: HarnessConfig


# HarnessConfig fields whose command-line flag has another name
_FIELD_FLAGS = {"timeout_s": "timeout"}


def parse_sweep(spec: str) -> tuple[str, list[float | int]]:
    """`seq-len=128,256,512` -> ("seq_len", [128, 256, 512]); the flag must be a numeric harness option, named as
    on the command line (`timeout`) or as its config field (`timeout-s`)."""
    if "=" not in spec:
        raise ConfigError(f"--sweep {spec!r}: expected FLAG=V1,V2,... (for example seq-len=128,256,512)")
    flag, values = spec.split("=", 1)
    field = flag.strip().lstrip("-").replace("-", "_")
    field = {v: k for k, v in _FIELD_FLAGS.items()}.get(field, field)
    types = {f.name: f.type for f in dataclasses.fields(HarnessConfig)}
    if types.get(field) not in ("int", "float", int, float):
        numeric = sorted(
            _FIELD_FLAGS.get(k, k).replace("_", "-") for k, t in types.items() if t in ("int", "float", int, float)
        )
        raise ConfigError(f"--sweep {flag!r} is not a numeric harness flag; one of: {', '.join(numeric)}")
    cast = float if types[field] in ("float", float) else int
    try:
        parsed = [cast(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--sweep {spec!r}: values must be {cast.__name__}s separated by commas") from None
    if not parsed:
        raise ConfigError(f"--sweep {spec!r}: no values")
    twice = sorted({v for v in parsed if parsed.count(v) > 1})
    if twice:  # two runs of one value would write the same folder
        raise ConfigError(f"--sweep {spec!r}: {', '.join(f'{v:g}' for v in twice)} given twice")
    return field, parsed


def plan_runs(
    out: Path, options: dict, nproc: int | None, sweeps: list[str], cuda_devices: int | None
) -> list[PlannedRun]:
    """One run per sweep combination (the cartesian product), every config validated before any starts.

    `options` holds HarnessConfig fields; options["dp"] may be None (derived from nproc)."""
    axes = [parse_sweep(s) for s in sweeps]
    combos: list[list[tuple[str, float | int]]] = [[]]
    for field, values in axes:
        combos = [[*c, (field, v)] for c in combos for v in values]
    runs, errors = [], []
    for combo in combos:
        opts = dict(options, **dict(combo))
        try:
            opts["dp"] = resolve_world(opts.get("dp"), opts.get("tp", 1), opts.get("pp", 1), nproc)
        except ConfigError as exc:  # keep going: report the other problems of this config too
            errors.append(str(exc))
            opts["dp"] = opts.get("dp") or 1
        cfg = HarnessConfig(**opts)
        sub = "_".join(f"{k.replace('_', '-')}-{v if isinstance(v, int) else f'{v:g}'}" for k, v in combo)
        problems = validation_errors(cfg, cuda_devices)
        errors += [f"{sub}: {p}" if combo else p for p in problems]
        # A sweep's runs are named DIR.VALUE: two sweeps over the same values into one store stay apart. DIR is the
        # folder's own name (`--out .` names the run after the current folder, not "").
        folder = out.resolve().name
        runs.append(PlannedRun(f"{folder}.{sub}" if combo else folder, out / sub if combo else out, cfg))
    from commlens import store  # here, not at import: the workers import this module

    for run in runs:
        try:
            store.check_new_run_name(run.name)
        except store.StoreError as exc:
            errors.append(f"--out {out}: {exc}")
        # the run's folder, or a folder above it, is a file: nothing could be written there
        blocking = next((p for p in (run.out, *run.out.parents) if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            errors.append(f"--out {out}: {blocking} is a file, not a directory; pick another --out")
    if errors:
        raise ConfigError("\n".join(dict.fromkeys(errors)))
    return runs


def existing_outputs(out: Path) -> list[Path]:
    """The harness's outputs in `out`, in OUTPUT_GLOBS order (each kind sorted by name)."""
    return [p for pattern in OUTPUT_GLOBS for p in sorted(out.glob(pattern))] if out.is_dir() else []


def torchrun_command(run: PlannedRun, command: list[str]) -> list[str]:
    """Single node: `python -m torch.distributed.run --standalone --nproc-per-node W -m commlens.harness.worker ...`."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(run.cfg.world_size),
        "-m",
        "commlens.harness.worker",
        "--config",
        str(run.out / CONFIG_NAME),
        "--out",
        str(run.out),
        "--command",
        json.dumps(command),
    ]


def multinode_command(run: PlannedRun) -> str | None:
    """The same job over several nodes, as a shell line to start on every node: the fewest nodes (two or more)
    that split the world evenly; None for a world of one process."""
    world = run.cfg.world_size
    nodes = next((n for n in range(2, world + 1) if world % n == 0), None)
    if nodes is None:
        return None
    return shlex.join(
        [
            "torchrun",
            "--nnodes",
            str(nodes),
            "--nproc-per-node",
            str(world // nodes),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "HOST0:29500",
            "--rdzv-id",
            "commlens",
            "-m",
            "commlens.harness.worker",
            "--config",
            str(run.out / CONFIG_NAME),
            "--out",
            str(run.out),
        ]
    )


def prepare(run: PlannedRun, overwrite: bool) -> Path:
    """Create the output directory and write the config; refuse to mix with an earlier run's outputs."""
    old = existing_outputs(run.out)
    if old and not overwrite:
        raise ConfigError(
            f"{run.out} already holds harness outputs ({old[0].name}, ...); pass --overwrite or another --out"
        )
    for path in old:
        path.unlink()
    run.out.mkdir(parents=True, exist_ok=True)
    path = run.out / CONFIG_NAME
    path.write_text(run.cfg.to_json() + "\n")
    return path


def launch(run: PlannedRun, command: list[str], timeout_s: float | None = None, verbose: bool = False) -> int:
    """Run torchrun in the foreground: its output (progress, any rank's traceback) goes to ours, less the
    profiler's start/stop markers on stderr (PROFILER_NOISE) unless `verbose`."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    proc = subprocess.Popen(torchrun_command(run, command), env=env, stderr=None if verbose else subprocess.PIPE)
    copier = None
    if proc.stderr is not None:
        copier = threading.Thread(target=copy_without_noise, args=(proc.stderr, sys.stderr), daemon=True)
        copier.start()
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        if copier is not None:  # ranks that outlive torchrun keep the pipe open: stop copying soon
            copier.join(timeout=5)
        return 124
    if copier is not None:
        copier.join()
    return code


def copy_without_noise(source: IO[bytes], sink: IO[str]) -> None:
    """Copy the ranks' stderr line by line as it comes, leaving out the profiler's markers."""
    out = getattr(sink, "buffer", None)
    for line in iter(source.readline, b""):
        if PROFILER_NOISE.match(line):
            continue
        if out is not None:
            out.write(line)
            out.flush()
        else:
            sink.write(line.decode(errors="replace"))
            sink.flush()


def output_files(out: Path) -> list[Path]:
    """The run's files in ingestion order: run.json first (it labels the groups), then traces, logs and dumps."""
    return existing_outputs(out)


def runs_in_store(db: Path, runs: list[PlannedRun]) -> list[str]:
    """Names of the planned runs that the store already holds (checked before any process starts)."""
    if not db.exists():
        return []
    from commlens import store

    con = store.connect(db)
    try:
        return [r.name for r in runs if store.get_run_id(con, r.name) is not None]
    finally:
        con.close()


def ingest_run(db: Path, run: PlannedRun, replace: bool = False) -> IngestReport:
    """Ingest run.json, the traces and NCCL logs as a run named after the output directory; `replace`
    first removes what an earlier ingest of the run stored (its outputs were just made anew). run.json
    comes first: its labelled groups give the schemes straight away."""
    from commlens import store
    from commlens.ingest.inputs import DEFAULT_LIMITS, iter_inputs
    from commlens.service import ingest

    con = store.connect(db)
    try:
        report = ingest.ingest_run(
            con,
            run.name,
            iter_inputs(output_files(run.out), DEFAULT_LIMITS),
            description=f"commlens harness: {run.cfg.strategy}",
            replace=replace,
        )
    finally:
        con.close()
    if report.attribution_error:  # the harness's own runs are always attributable: a bug, not a bad input
        raise RuntimeError(f"{run.name}: {report.attribution_error}")
    return report
