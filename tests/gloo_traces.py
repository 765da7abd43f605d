"""Real PyTorch profiler traces of gloo collectives on CPU, for the Kineto ingester tests.

`generate(out_dir, world=2)` runs this file as a script in a fresh interpreter (torch and
torch.distributed stay out of the test process), which forks `world` ranks that rendezvous on
127.0.0.1 with a free port, run STEP (every collective with known shapes) under
`torch.profiler.profile(record_shapes=True)` for WARMUP + ACTIVE steps and write one gzipped trace
per rank, `rank<r>.pt.trace.json.gz`. `expected_calls(world)` lists what one active step issues on
a rank, with the nccl-tests message size S computed from the shapes used here.

    python tests/gloo_traces.py OUT_DIR [--world 2]
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

WARMUP = 1
ACTIVE = 2

# dtype name -> bytes per element (torch-style names, as commlens stores them)
_SIZE = {"float32": 4, "float64": 8, "bfloat16": 2, "int64": 8, "int32": 4, "uint8": 1}


@dataclass(frozen=True)
class Expected:
    """One call per rank per step: op, dtype and S (msg_bytes) as commlens must store them."""

    label: str
    op: str
    dtype: str
    msg_bytes: int
    ranks: tuple[int, ...] | None = None  # the ranks that make the call (None: every rank)
    peer: dict[int, int] | None = None  # send/recv: rank -> global peer
    sized_on: tuple[int, ...] | None = None  # ranks whose trace records the dtype (None: every rank)
    group_key: str | None = None  # known only where a commlens:<dim>:<pg> range labels the call


def expected_calls(world: int) -> list[Expected]:
    """What STEP issues per rank; sizes follow the shapes in _step below."""
    w = world
    return [
        Expected("all_reduce", "all_reduce", "float32", 1000 * 4),
        Expected("all_reduce async on a subgroup, labelled", "all_reduce", "float64", 500 * 8, group_key="pg:1"),
        Expected("all_gather_into_tensor", "all_gather", "bfloat16", w * 300 * 2),
        Expected("all_gather (list)", "all_gather", "int64", w * 50 * 8),
        Expected("reduce_scatter_tensor", "reduce_scatter", "float32", w * 200 * 4),
        Expected("broadcast on a subgroup, labelled", "broadcast", "float64", 77 * 8, group_key="pg:1"),
        Expected("all_to_all_single", "all_to_all", "float32", w * 40 * 4),
        Expected("reduce", "reduce", "float32", 10 * 4),
        Expected("gather", "gather", "float32", w * 5 * 4),
        # a non-root rank records only its output TensorList (no dtype) and an empty gloo:scatter
        Expected("scatter", "scatter", "float32", w * 6 * 4, sized_on=(0,)),
        Expected("functional all_reduce", "all_reduce", "float32", 64 * 4),
        Expected("send", "send", "int32", 33 * 4, ranks=(0,), peer={0: 1}),
        Expected("recv", "recv", "int32", 33 * 4, ranks=(1,), peer={1: 0}),
        Expected("batch_isend_irecv: isend", "send", "float32", 11 * 4, peer={r: r ^ 1 for r in range(w)}),
        Expected("batch_isend_irecv: irecv", "recv", "float32", 11 * 4, peer={r: r ^ 1 for r in range(w)}),
        Expected("barrier", "barrier", "uint8", 1),
    ]


def _step(rank: int, world: int, sub) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc
    from torch.profiler import record_function

    w = world
    tag = f"commlens:dp:{sub.group_name}"  # the harness's label: the range ties the calls to their group
    dist.all_reduce(torch.ones(1000, dtype=torch.float32))
    with record_function(tag):
        work = dist.all_reduce(torch.ones(500, dtype=torch.float64), group=sub, async_op=True)
    work.wait()
    dist.all_gather_into_tensor(torch.empty(w * 300, dtype=torch.bfloat16), torch.ones(300, dtype=torch.bfloat16))
    dist.all_gather([torch.empty(50, dtype=torch.int64) for _ in range(w)], torch.ones(50, dtype=torch.int64))
    dist.reduce_scatter_tensor(torch.empty(200), torch.ones(w * 200))
    with record_function(tag):
        dist.broadcast(torch.ones(77, dtype=torch.float64), src=0, group=sub)
    dist.all_to_all_single(torch.empty(w * 40), torch.ones(w * 40))
    dist.reduce(torch.ones(10), dst=0)
    dist.gather(torch.ones(5), [torch.empty(5) for _ in range(w)] if rank == 0 else None, dst=0)
    dist.scatter(torch.empty(6), [torch.ones(6) for _ in range(w)] if rank == 0 else None, src=0)
    fc.wait_tensor(fc.all_reduce(torch.ones(64), "sum", dist.group.WORLD))
    if rank == 0:
        dist.send(torch.ones(33, dtype=torch.int32), dst=1)
    elif rank == 1:
        dist.recv(torch.empty(33, dtype=torch.int32), src=0)
    peer = rank ^ 1
    if peer < w:
        ops = [dist.P2POp(dist.isend, torch.ones(11), peer), dist.P2POp(dist.irecv, torch.empty(11), peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    dist.barrier()


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import warnings

    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, schedule

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    sub = dist.new_group(list(range(world)))
    path = os.path.join(out, f"rank{rank}.pt.trace.json.gz")
    with profile(
        activities=[ProfilerActivity.CPU],
        record_shapes=True,
        schedule=schedule(wait=0, warmup=WARMUP, active=ACTIVE, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(path),
    ) as prof:
        for _ in range(WARMUP + ACTIVE):
            _step(rank, world, sub)
            prof.step()
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _main(out: str, world: int) -> None:
    import torch.multiprocessing as mp

    Path(out).mkdir(parents=True, exist_ok=True)
    mp.start_processes(_worker, args=(world, _free_port(), out), nprocs=world, start_method="fork")


def generate(out_dir: Path, world: int = 2, timeout: float = 120.0) -> list[Path]:
    """Run the ranks in a fresh interpreter; return the per-rank trace files."""
    proc = subprocess.run(
        [sys.executable, __file__, str(out_dir), "--world", str(world)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=False,
    )
    files = [out_dir / f"rank{r}.pt.trace.json.gz" for r in range(world)]
    if proc.returncode != 0 or not all(f.is_file() for f in files):
        raise RuntimeError(f"gloo trace generation failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return files


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--world", type=int, default=2)
    a = ap.parse_args()
    _main(a.out, a.world)
