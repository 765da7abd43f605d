"""`commlens harness`: validate, launch the ranks with torchrun, list (and optionally ingest) the outputs.

Importing this module does not import torch.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from commlens.vocab import format_bytes

from .config import ConfigError, Hang, HarnessConfig, parse_delays

if TYPE_CHECKING:
    from .launch import PlannedRun

# emoji off: a value such as "--hang 1:-1" must not print as ":-1:", an emoji code
console = Console(width=None if sys.stdout.isatty() else 200, emoji=False)
err = Console(stderr=True, emoji=False)

EPILOG = """\
Multi-node: validate and write the config once (--dry-run), then start the worker on every node with torchrun:

  commlens harness --out /shared/run1 --dp 2 --tp 8 --device cuda --dry-run

  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 --rdzv-id run1 -m commlens.harness.worker --config /shared/run1/.harness-config.json --out /shared/run1

Outputs per run: trace.rank<R>.json.gz (Kineto), nccl.<host>.<pid>.log (cuda), run.json (rank 0).
"""

_DEFAULTS = HarnessConfig()
# Options whose defaults are objects (paths, lists) are built once, here (ruff B008).
OUT_OPTION = typer.Option(..., "--out", help="Output directory (one sub-directory per value with --sweep).")
SWEEP_OPTION = typer.Option(
    [], "--sweep", help="FLAG=V1,V2,...: one run per value (any numeric flag; repeat for a grid)."
)
DB_OPTION = typer.Option(Path("commlens.duckdb"), "--db", help="DuckDB store for --ingest.")
DELAY_OPTION = typer.Option(
    [],
    "--delay",
    help="RANK:MS[:PHASE]: that rank sleeps MS ms before PHASE (forward, backward, optimizer; default forward) of every step, in a 'commlens.delay' profiler range: a planted straggler (repeatable).",
)
HANG_OPTION = typer.Option(
    None,
    "--hang",
    help="RANK:STEP: at that step the rank stops before its next collective and never arrives; the others time out "
    "(--timeout), every rank leaves flight_recorder.rank<R>.json, and the job exits non-zero naming the hung ranks.",
)


def _device_defaults(device: str | None, dtype: str | None) -> tuple[str, str, int | None]:
    """cuda when a GPU is visible, else cpu; bfloat16 on cuda, float32 on cpu. Returns the GPU count too."""
    try:
        import torch
    except ImportError:
        err.print("[red]error:[/red] the harness needs torch: pip install 'commlens[harness]'")
        raise typer.Exit(2) from None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = device or ("cuda" if gpus else "cpu")
    return device, dtype or ("bfloat16" if device == "cuda" else "float32"), gpus


def harness(
    out: Path = OUT_OPTION,
    dp: int | None = typer.Option(None, "--dp", help="Data-parallel degree [default: nproc/(tp*pp), or 1]."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel degree (Megatron column/row, vocab-parallel)."),
    pp: int = typer.Option(1, "--pp", help="Pipeline-parallel degree (stages)."),
    zero: int = typer.Option(0, "--zero", help="ZeRO stage over dp: 0 DDP, 1, 2, 3 (FSDP2)."),
    sp: bool = typer.Option(False, "--sp", help="Sequence parallelism (needs --tp > 1)."),
    cp: int = typer.Option(1, "--cp", help="Context-parallel degree: the sequence split over cp ranks."),
    cp_style: str = typer.Option(
        _DEFAULTS.cp_style, "--cp-style", help="Context-parallel attention: ring (Ring Attention) or attention2d."
    ),
    cp_rq: int | None = typer.Option(
        None, "--cp-rq", help="ATTENTION2D r_Q (ranks sharing a Q block) [default: sqrt(cp)]; r_KV = cp / r_Q."
    ),
    ep: int = typer.Option(1, "--ep", help="Expert-parallel degree: the experts spread over ep ranks."),
    experts: int = typer.Option(0, "--experts", help="Routed experts per MLP (mixture of experts; 0: dense)."),
    top_k: int = typer.Option(_DEFAULTS.top_k, "--top-k", help="Experts each token is routed to."),
    capacity_factor: float | None = typer.Option(
        None, "--capacity-factor", help="Tokens per expert capped at ceil(F*tokens*top_k/experts) [default: no cap]."
    ),
    offload: str = typer.Option(
        "none", "--offload", help="optimizer: ZeRO-3's optimizer step on the host, its state in pinned memory (CUDA)."
    ),
    offload_gpu_fraction: str | None = typer.Option(
        None,
        "--offload-gpu-fraction",
        help="1/g: every g-th parameter shard updated on the GPU (Deep Optimizer States) [default: all on the host].",
    ),
    micro_batches: int = typer.Option(
        _DEFAULTS.micro_batches, "--micro-batches", help="Micro-batches per step (gradient accumulation / pipeline)."
    ),
    schedule: str = typer.Option(_DEFAULTS.schedule, "--schedule", help="Pipeline schedule: gpipe or 1f1b."),
    layers: int = typer.Option(_DEFAULTS.layers, "--layers"),
    hidden: int = typer.Option(_DEFAULTS.hidden, "--hidden"),
    heads: int = typer.Option(_DEFAULTS.heads, "--heads"),
    vocab: int = typer.Option(_DEFAULTS.vocab, "--vocab"),
    seq_len: int = typer.Option(_DEFAULTS.seq_len, "--seq-len"),
    micro_batch_size: int = typer.Option(_DEFAULTS.micro_batch_size, "--micro-batch-size"),
    steps: int = typer.Option(_DEFAULTS.steps, "--steps"),
    lr: float = typer.Option(_DEFAULTS.lr, "--lr", help="AdamW learning rate."),
    device: str | None = typer.Option(None, "--device", help="cuda (NCCL) or cpu (gloo) [default: cuda if available]."),
    dtype: str | None = typer.Option(
        None, "--dtype", help="float32, bfloat16 [default: bfloat16 on cuda, float32 on cpu]."
    ),
    seed: int = typer.Option(_DEFAULTS.seed, "--seed"),
    profile_wait: int = typer.Option(
        _DEFAULTS.profile_wait, "--profile-wait", help="Profiler schedule: steps skipped."
    ),
    profile_warmup: int = typer.Option(
        _DEFAULTS.profile_warmup, "--profile-warmup", help="Profiler schedule: warm-up steps."
    ),
    profile_active: int = typer.Option(
        _DEFAULTS.profile_active, "--profile-active", help="Profiler schedule: recorded steps."
    ),
    timeout: float = typer.Option(
        _DEFAULTS.timeout_s, "--timeout", help="Process-group timeout in seconds (a dead peer ends the job)."
    ),
    nproc: int | None = typer.Option(
        None, "--nproc", help="Processes to start (= dp*tp*pp; derives --dp when it is omitted)."
    ),
    sweep: list[str] = SWEEP_OPTION,
    ingest: bool = typer.Option(
        False, "--ingest", help="Ingest each finished run into --db, named after its directory (DIR.VALUE in a sweep)."
    ),
    db: Path = DB_OPTION,
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Replace the outputs of an earlier run in --out (and, with --ingest, its data in --db).",
    ),
    delay: list[str] = DELAY_OPTION,
    hang: str | None = HANG_OPTION,
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Validate, write the config and print the torchrun commands; start nothing."
    ),
    verbose: bool = typer.Option(
        False, "--verbose", help="Also show the profiler's start/stop markers (STAGE:/USDT: lines), hidden by default."
    ),
) -> None:
    """Train a small GPT under DDP, ZeRO-1/2/3, TP(+SP), PP and their combinations, with profiler traces."""
    from . import launch

    if device is None or (device == "cuda" and not dry_run):  # needs torch: which GPUs are visible
        device, dtype, gpus = _device_defaults(device, dtype)
    else:
        dtype, gpus = dtype or ("bfloat16" if device == "cuda" else "float32"), None
    options: dict[str, object] = {
        "dp": dp,
        "tp": tp,
        "pp": pp,
        "zero": zero,
        "sp": sp,
        "cp": cp,
        "cp_style": cp_style,
        "cp_rq": cp_rq,
        "ep": ep,
        "experts": experts,
        "top_k": top_k,
        "capacity_factor": capacity_factor,
        "offload": offload,
        "offload_gpu_fraction": offload_gpu_fraction,
        "micro_batches": micro_batches,
        "schedule": schedule,
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "vocab": vocab,
        "seq_len": seq_len,
        "micro_batch_size": micro_batch_size,
        "steps": steps,
        "lr": lr,
        "seed": seed,
        "device": device,
        "dtype": dtype,
        "profile_wait": profile_wait,
        "profile_warmup": profile_warmup,
        "profile_active": profile_active,
        "timeout_s": timeout,
    }
    try:
        options["delays"] = parse_delays(delay)
        options["hang"] = _hang(hang) if hang is not None else None
        runs = launch.plan_runs(out, options, _nproc_per_cp(nproc, cp * ep), sweep, None if dry_run else gpus)
        for run in runs:
            old = launch.existing_outputs(run.out)
            if old and not overwrite:
                raise ConfigError(
                    f"{run.out} already holds harness outputs ({old[0].name}, ...); pass --overwrite or another --out"
                )
        if ingest and not dry_run and not overwrite:
            taken = launch.runs_in_store(db, runs)
            if taken:
                raise ConfigError(
                    f"{db} already holds run(s) {', '.join(taken)}; pass --overwrite to replace their "
                    "data (review items and scheme overrides are kept) or choose another --out"
                )
    except ConfigError as exc:
        err.print("[red]invalid harness configuration:[/red]")
        for line in str(exc).splitlines():
            err.print(f"  - {line}", markup=False, soft_wrap=True)
        raise typer.Exit(2) from None
    _note_thin_delays(runs)
    command = (
        ["commlens", "harness", *sys.argv[2:]] if len(sys.argv) > 1 and sys.argv[1] == "harness" else list(sys.argv)
    )
    for i, run in enumerate(runs, 1):
        launch.prepare(run, overwrite)
        header = f"run {i}/{len(runs)} {run.name}: {run.cfg.strategy}, world {run.cfg.world_size} ({run.cfg.device})"
        if dry_run:
            console.print(f"[bold]{escape(header)}[/bold] config {escape(str(run.out / launch.CONFIG_NAME))}")
            # shell lines to paste: the job they start records itself as launched without --dry-run
            launched = [word for word in command if word != "--dry-run"]
            single = shlex.join(launch.torchrun_command(run, launched))
            console.print("  single node: " + single, markup=False, soft_wrap=True)
            multi = launch.multinode_command(run)
            console.print(
                "  multi-node:  " + (multi or "(a world of one process runs on one node)"), markup=False, soft_wrap=True
            )
            continue
        console.print(f"[bold]{escape(header)}[/bold] -> {escape(str(run.out))}")
        code = launch.launch(run, command, verbose=verbose)
        if code != 0 and run.cfg.hang is not None:
            if ingest:  # the dumps and traces it left are what a hang is analysed from
                _ingest_into(db, run, overwrite)
            _report_hang(run, code)
        if code != 0:
            err.print(
                f"[red]run {escape(run.name)} failed[/red] (torchrun exit code {code}); the failing rank's traceback is above."
            )
            raise typer.Exit(1)
        _list_outputs(run, launch.output_files(run.out))
        if ingest and _ingest_into(db, run, overwrite):
            raise typer.Exit(1)


def _ingest_into(db: Path, run: PlannedRun, overwrite: bool) -> bool:
    """Ingest the run's outputs into `db`, saying how many; whether a file failed."""
    from . import launch

    summary = launch.ingest_run(db, run, replace=overwrite)
    failed = summary.failed
    console.print(
        f"ingested {len(summary.files) - len(failed)}/{len(summary.files)} files into {db} as run {run.name!r}",
        markup=False,
    )
    for f in failed:
        err.print(f"[red]failed[/red] {escape(f.error or '')}")
    return bool(failed)


def _hang(spec: str) -> Hang:
    """--hang's value, refused by name when this torch records no Flight Recorder entries to dump."""
    hang = Hang.parse(spec)
    try:
        import torch
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        raise ConfigError("--hang needs torch: pip install 'commlens[harness]'") from None
    if not hasattr(c10d, "_dump_fr_trace_json"):
        raise ConfigError(
            f"--hang: torch {torch.__version__} cannot dump Flight Recorder entries (no _dump_fr_trace_json), "
            "so the hang could not be analysed; use a torch that records them (2.6 or later)"
        )
    return hang


def _note_thin_delays(runs: list[PlannedRun]) -> None:
    """A planted straggler the analysis cannot name: the straggler rule needs a spread across profiled steps."""
    from commlens.backend.timing.stragglers import DEFAULT_RULE

    # a group with one collective a step (DDP with one bucket) has as many instances as profiled steps
    need = max(DEFAULT_RULE.min_steps, DEFAULT_RULE.min_instances)
    thin = next((r.cfg for r in runs if r.cfg.delays and r.cfg.profile_active < need), None)
    if thin is not None:
        err.print(
            f"note: --delay plants a straggler, but the analysis names one from {DEFAULT_RULE.min_steps} profiled "
            f"steps and {DEFAULT_RULE.min_instances} collectives of its group on, and this run profiles "
            f"{thin.profile_active} (a group with one collective a step, DDP with one bucket, needs "
            f"{need} steps): add --profile-active {need + 2} --steps "
            f"{thin.profile_wait + thin.profile_warmup + need + 2} to see it named",
            soft_wrap=True,
        )


def _report_hang(run: PlannedRun, code: int) -> None:
    """Say which ranks never arrived, from the Flight Recorder dumps the ranks left, and exit non-zero."""
    from commlens.backend.hang import FrCall, analyze, fr_call, root_ranks
    from commlens.ingest.inputs import DEFAULT_LIMITS, iter_inputs
    from commlens.ingest.parse_file import parse_file
    from commlens.ingest.records import RankHint

    dumps = sorted(run.out.glob("flight_recorder.rank*.json"))
    calls: list[FrCall] = []
    dumped: list[int] = []
    for item in iter_inputs(dumps, DEFAULT_LIMITS):
        parsed = parse_file(item, RankHint())
        if parsed.result is None or parsed.result.rank is None:
            err.print(f"[red]unreadable Flight Recorder dump[/red] {escape(parsed.error or '')}")
            continue
        dumped.append(parsed.result.rank)
        calls += [c for e in parsed.result.fr_entries if (c := fr_call(e)) is not None]
    hung = analyze(calls, dumped)
    err.print(
        f"[red]run {escape(run.name)} hung[/red] (torchrun exit code {code}); Flight Recorder dumps: {len(dumps)} in "
        f"{escape(str(run.out))}"
    )
    for g in hung:
        err.print(
            f"  group {g.group}: {g.op} #{g.seq}: ranks {g.missing_ranks} never arrived (arrived: {g.arrived_ranks})",
            markup=False,
        )
        for r in g.ranks:
            if r.rank in g.missing_ranks:
                err.print(f"    rank {r.rank}: {r.doing}", markup=False)
    missing = sorted({r for g in hung for r in g.missing_ranks})
    err.print(f"hung ranks: {', '.join(map(str, missing)) if missing else 'none found in the dumps'}", markup=False)
    roots = root_ranks(hung)
    if roots and roots != missing:  # the others wait in calls the root never entered
        err.print(f"where it starts: rank {', '.join(map(str, roots))}", markup=False)
    raise typer.Exit(1)


def _nproc_per_cp(nproc: int | None, cp: int) -> int | None:
    """--nproc counts every process; the launcher derives dp from the processes of one cp (and ep) rank."""
    if nproc is None or cp <= 1:
        return nproc
    if nproc % cp:
        raise ConfigError(f"world size {nproc} (--nproc) is not divisible by cp*ep = {cp}")
    return nproc // cp


def _list_outputs(run, files: list[Path]) -> None:
    import json

    table = Table(title=f"{run.name}: output files")
    table.add_column("file", overflow="fold")
    table.add_column("size", justify="right")
    for f in files:
        table.add_row(str(f), format_bytes(f.stat().st_size))
    console.print(table)
    run_json = run.out / "run.json"
    if run_json.exists():
        losses = json.loads(run_json.read_text()).get("results", {}).get("losses", [])
        if losses:
            console.print("loss per step: " + ", ".join(f"{x:.4f}" for x in losses))
