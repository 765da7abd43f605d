"""The per-rank program torchrun starts: ``python -m commlens.harness.worker --config FILE --out DIR``.

Builds the mesh, the rank's slice of the model and its dp-sync strategy, trains `steps` steps under
the profiler, writes ``trace.rank<R>.json.gz``; rank 0 writes ``run.json`` for the whole job.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import signal
import socket
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from . import cp as context
from . import moe as experts
from .comm import Mesh, build_mesh
from .config import MESH_ORDER, HarnessConfig, gpu_fraction_gap, validate
from .data import global_batch, micro_batch
from .dpsync import ADAMW, Sync, make_sync
from .model import GPTShape, TPInfo, build_stage, full_model
from .schedule import StepRunner

PROGRESS_PREFIX = "[commlens harness]"
FAIL_RANK_ENV = "COMMLENS_HARNESS_FAIL_RANK"  # fault injection for tests: that rank raises in step 1
NCCL_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,COLL,P2P,GRAPH,TUNING"}


def progress(message: str) -> None:
    """One progress line in one write: the ranks share torchrun's stdout, and print's separate newline lets
    two ranks' lines run together."""
    sys.stdout.write(f"{PROGRESS_PREFIX} {message}\n")
    sys.stdout.flush()


def trace_path(out: Path, rank: int) -> Path:
    return out / f"trace.rank{rank}.json.gz"


def flight_recorder_path(out: Path, rank: int) -> Path:
    return out / f"flight_recorder.rank{rank}.json"


def dump_flight_recorder(out: Path, rank: int) -> None:
    """This rank's Flight Recorder entries as JSON (torch's _dump_fr_trace_json), for --hang."""
    from torch._C import _distributed_c10d as c10d

    # torch's stub (_distributed_c10d.pyi) does not declare the binding it has
    flight_recorder_path(out, rank).write_bytes(c10d._dump_fr_trace_json(True, False))  # type: ignore[attr-defined]


def _hang_here(cfg: HarnessConfig, out: Path, rank: int, step: int) -> None:
    """--hang: the planted rank dumps its entries and stops before its next collective, never arriving; its
    peers time out (--timeout) and torchrun then ends it. It leaves by itself if nobody does."""
    progress(f"rank {rank} hangs at step {step} (--hang): it never enters its next collective")
    dump_flight_recorder(out, rank)
    time.sleep(2 * cfg.timeout_s + 30)
    os._exit(3)


def _dump_on_sigterm(out: Path, rank: int) -> None:
    """torchrun ends the other ranks with SIGTERM once one fails: each dumps its entries first."""

    def handler(signum: int, frame: object) -> None:
        dump_flight_recorder(out, rank)
        os._exit(1)

    signal.signal(signal.SIGTERM, handler)


def _init(cfg: HarnessConfig, out: Path) -> torch.device:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if "RANK" not in os.environ:  # started without torchrun: a world of one
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"})
    timeout = timedelta(seconds=cfg.timeout_s)
    if cfg.hang is not None:  # Flight Recorder records only with a buffer, read when the first group is made
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "20000")
    if cfg.device == "cuda":
        for key, value in NCCL_ENV.items():
            os.environ.setdefault(key, value)
        os.environ.setdefault("NCCL_DEBUG_FILE", str(out / "nccl.%h.%p.log"))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    if dist.get_world_size() != cfg.world_size:
        raise SystemExit(f"torchrun started {dist.get_world_size()} processes but dp*tp*pp = {cfg.world_size}")
    return device


def _profiler(cfg: HarnessConfig, out: Path, rank: int) -> torch.profiler.profile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cfg.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def on_ready(prof: torch.profiler.profile) -> None:
        prof.export_chrome_trace(str(trace_path(out, rank)))

    sched = torch.profiler.schedule(
        wait=cfg.profile_wait, warmup=cfg.profile_warmup, active=cfg.profile_active, repeat=1
    )
    return torch.profiler.profile(activities=activities, schedule=sched, record_shapes=True, on_trace_ready=on_ready)


def train(cfg: HarnessConfig, out: Path, command: list[str]) -> None:
    device = _init(cfg, out)
    rank = dist.get_rank()
    dtype = getattr(torch, cfg.dtype)
    mesh = build_mesh(cfg, device.type)
    coords = cfg.coords(rank)
    shape = GPTShape(cfg.layers, cfg.hidden, cfg.heads, cfg.vocab, cfg.seq_len, cfg.experts)
    tp = TPInfo(cfg.tp, coords["tp"], mesh.group("tp"), cfg.sp)
    cp = context.setup(cfg, mesh)
    moe = experts.setup(cfg, mesh)
    stage = build_stage(shape, cfg.seed, tp, coords["pp"], cfg.pp, cp, moe).to(device=device, dtype=dtype)
    local_params = sum(p.numel() for p in stage.parameters())
    experts.prepare_for_ddp(stage, moe)
    if cfg.offload == "optimizer":  # ZeRO-3 with the optimizer on the host (harness/offload.py)
        from .offload import OffloadSync

        sync: Sync = OffloadSync(stage, mesh, cfg.lr, gpu_fraction_gap(cfg.offload_gpu_fraction))
    else:
        sync = make_sync(
            stage, context.gradient_mesh(mesh), cfg.lr, cfg.dp_sync, [device.index] if cfg.device == "cuda" else None
        )
    s_local = cfg.seq_len // cfg.tp if cfg.sp else cfg.seq_len
    delays: dict[str, float] = {}
    for d in cfg.delays:
        if d.rank == rank:
            delays[d.phase] = delays.get(d.phase, 0.0) + d.ms
    runner = StepRunner(
        stage,
        sync,
        mesh.group("pp"),
        cfg.micro_batches,
        cfg.schedule,
        (cfg.micro_batch_size, s_local, cfg.hidden),
        dtype,
        device,
        delays,
    )
    for group in mesh.groups.values():  # create every communicator now, not inside a step (NCCL is lazy)
        dist.barrier(group=group.pg)
    # one progress line per step, from the last stage's first rank (ep ranks train replicas of their own too)
    reporter = coords["pp"] == cfg.pp - 1 and all(coords.get(d, 0) == 0 for d in ("dp", "tp", "cp", "ep"))
    losses: list[float] = []
    seconds: list[float] = []
    replicas, replica = cfg.dp * cfg.ep, coords["dp"] * cfg.ep + coords.get("ep", 0)  # ep ranks see other samples
    samples = replicas * cfg.micro_batches * cfg.micro_batch_size
    routing: dict[int, list[list[int]]] = {}  # profiled step -> rows sent to each ep rank, per all-to-all
    fail_rank = os.environ.get(FAIL_RANK_ENV)
    if cfg.hang is not None:
        _dump_on_sigterm(out, rank)
    with _profiler(cfg, out, rank) as prof:
        for step in range(cfg.steps):
            if step == 1 and fail_rank == str(rank):
                raise RuntimeError(f"injected failure on rank {rank} ({FAIL_RANK_ENV})")
            if cfg.hang is not None and (rank, step) == (cfg.hang.rank, cfg.hang.step):
                _hang_here(cfg, out, rank, step)
            tokens = global_batch(cfg.seed, step, samples, cfg.seq_len, cfg.vocab)
            batches = [
                context.local_tokens(
                    micro_batch(tokens, replica, replicas, j, cfg.micro_batch_size), cfg.cp, cp.rank
                ).to(device)
                for j in range(cfg.micro_batches)
            ]
            if moe is not None and step in cfg.profiled_steps:
                moe.log = routing.setdefault(step, [])
            t0 = time.perf_counter()
            loss = _step(runner, batches, cfg, out, rank)
            if moe is not None:
                moe.log = None
            if cfg.device == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t0)
            prof.step()
            if loss is not None:
                losses.append(loss)
            if reporter:
                which = " (dp replica 0)" if cfg.dp > 1 else ""
                progress(f"step {step + 1}/{cfg.steps} loss{which} {loss:.4f} ({seconds[-1]:.2f}s)")
    info = {
        "rank": rank,
        "coords": coords,
        "host": socket.gethostname(),
        "param_count": local_params,
        "sync": sync.describe(),
        "losses": losses if losses else None,
        "seconds": seconds,
        "groups": [g.info() for g in mesh.groups.values()],
        "routing": routing,
    }
    gathered: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(gathered, info)
    if rank == 0:
        path = write_run_json(cfg, out, gathered, mesh, shape, command)
        progress(f"wrote {path}")
    dist.barrier()


def _step(runner: StepRunner, batches: list[torch.Tensor], cfg: HarnessConfig, out: Path, rank: int) -> float | None:
    """One step; under --hang a collective that times out leaves this rank's Flight Recorder dump behind."""
    if cfg.hang is None:
        return runner.step(batches)
    try:
        return runner.step(batches)
    except Exception:
        dump_flight_recorder(out, rank)
        progress(f"rank {rank}: a collective timed out (--hang); Flight Recorder dumped")
        raise


def _groups(infos: list[dict], mesh: Mesh) -> list[dict]:
    seen: dict[tuple[str, str], dict] = {}
    for info in infos:
        for g in info["groups"]:
            seen.setdefault((g["dim"], g["pg_name"]), dict(g, backend=mesh.backend))
    order = {d: i for i, d in enumerate((*MESH_ORDER, "dp_cp", "cp_q", "cp_kv", "dp_ep"))}
    groups = sorted(seen.values(), key=lambda g: (order[g["dim"]], g["ranks"]))
    if not any(g["pg_name"] == "0" for g in groups):
        world = dist.distributed_c10d._get_default_group()
        groups.insert(
            0,
            {
                "dim": "world",
                "ranks": list(range(dist.get_world_size())),
                "pg_name": world.group_name,
                "pg_desc": "default_pg",
                "backend": mesh.backend,
            },
        )
    return groups


def write_run_json(
    cfg: HarnessConfig, out: Path, infos: list[dict], mesh: Mesh, shape: GPTShape, command: list[str]
) -> Path:
    from commlens.run_json import RunConfig

    last = [i for i in infos if i["losses"] is not None and i["coords"]["tp"] == 0]
    losses = [sum(i["losses"][k] for i in last) / len(last) for k in range(cfg.steps)]
    ddp = cfg.dp_sync == "ddp"
    first_sync = infos[0]["sync"]
    nccl = None
    if cfg.device == "cuda":
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    data = {
        "schema": "commlens.run/1",
        "strategy": cfg.strategy,
        "world_size": cfg.world_size,
        "model": {
            "layers": cfg.layers,
            "hidden": cfg.hidden,
            "heads": cfg.heads,
            "vocab": cfg.vocab,
            "seq_len": cfg.seq_len,
            "ffn_hidden": shape.ffn,
            "tied_embeddings": False,
            "learned_pos": True,
            "param_count": sum(p.numel() for p in full_model(shape, cfg.seed).parameters()),
            "experts": cfg.experts,
            "top_k": cfg.top_k,
            "capacity_factor": cfg.capacity_factor,
        },
        "parallel": {
            "dp": cfg.dp,
            "tp": cfg.tp,
            "pp": cfg.pp,
            "zero": cfg.zero,
            "sp": cfg.sp,
            "micro_batches": cfg.micro_batches,
            "micro_batch_size": cfg.micro_batch_size,
            "schedule": cfg.schedule,
            "dp_sync": cfg.dp_sync,
            "ddp_no_sync": True,
            "cp": cfg.cp,
            "cp_style": cfg.cp_style,
            "cp_rq": cfg.cp_rq,
            "ep": cfg.ep,
            "offload": cfg.offload,
            "offload_gap": gpu_fraction_gap(cfg.offload_gpu_fraction),
        },
        "mesh_dims": cfg.mesh_dims,
        "mesh_shape": cfg.mesh_shape,
        "groups": _groups(infos, mesh),
        "dtypes": {"param": cfg.dtype, "grad": cfg.dtype, "act": cfg.dtype},
        "buckets": {
            "ddp_bucket_cap_mb": first_sync.get("ddp_bucket_cap_mb") if ddp else None,
            "ddp_first_bucket_bytes": first_sync.get("ddp_first_bucket_bytes") if ddp else None,
            "zero_bucket_bytes": None,
        },
        "profile": {
            "wait": cfg.profile_wait,
            "warmup": cfg.profile_warmup,
            "active": cfg.profile_active,
            "profiled_steps": cfg.profiled_steps,
        },
        "steps": cfg.steps,
        "seed": cfg.seed,
        "device": cfg.device,
        "backend": mesh.backend,
        "torch_version": torch.__version__,
        "nccl_version": nccl,
        "host": socket.gethostname(),
        "command": command,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "implementation": "harness",
        "optimizer": {
            "name": "adamw",
            "lr": cfg.lr,
            "betas": list(ADAMW.betas),
            "eps": ADAMW.eps,
            "weight_decay": ADAMW.weight_decay,
        },
        "ranks": [
            {
                "rank": i["rank"],
                "coords": i["coords"],
                "host": i["host"],
                "param_count": i["param_count"],
                "sync": i["sync"],
            }
            for i in infos
        ],
        "results": {"losses": losses, "step_seconds": infos[0]["seconds"]},
        "step_wall_ms": {i["rank"]: [1000 * t for t in i["seconds"]] for i in infos},
        "delays": [dataclasses.asdict(d) for d in cfg.delays],
        "moe_routing": {step: {i["rank"]: i["routing"][step] for i in infos} for step in infos[0]["routing"]},
    }
    cfg_model = RunConfig.model_validate(data)
    path = out / "run.json"
    path.write_text(json.dumps(cfg_model.model_dump(mode="json", by_alias=True), indent=2) + "\n")
    return path


@record
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m commlens.harness.worker", description=__doc__)
    parser.add_argument(
        "--config", type=Path, required=True, help="harness config JSON (commlens harness --dry-run writes one)"
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory (shared by all ranks of a node)")
    parser.add_argument("--command", default=None, help="JSON list: the command line that launched the job")
    args = parser.parse_args(argv)
    cfg = HarnessConfig.load(args.config)
    validate(cfg)
    args.out.mkdir(parents=True, exist_ok=True)
    command = (
        json.loads(args.command) if args.command else [sys.executable, "-m", "commlens.harness.worker", *sys.argv[1:]]
    )
    train(cfg, args.out, command)
    _shutdown()


def _shutdown() -> None:
    """Tear down while the interpreter is whole, then leave without finalising it.

    gloo's worker threads belong to process-group objects that DDP, FSDP and the DeviceMesh keep alive;
    when the last reference goes during interpreter finalisation, a still-joinable std::thread aborts
    the process ("terminate called without an active exception", SIGABRT) after every file was written,
    and torchrun reports the job failed. Everything the job produces is on disk and flushed by now.
    """
    gc.collect()  # the training objects of `train` (DDP reducer, FSDP states, mesh) release their groups
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
