"""Scale benchmark (issue 15 item 3): a 1,024-rank run from real traces, and 100 million calls answered.

Part 1, 1,024 ranks ingested as a user does: the 8 real rank traces of the DLRM job
(`kineto-param/dlrm_kineto.tar.gz`) rewritten to `--ranks` ranks (rank copy k of worker w is global rank
8k + w: `distributedInfo.rank` and `world_size` rewritten, every timestamp shifted by a per-rank clock offset of
up to +-2 ms), written gzipped under a temporary folder and ingested by `commlens ingest --jobs N` as one whole
process (imports included); wall time, peak RSS of the process tree (sampled) and of its largest process, store size.

Part 2, the analysis endpoints on a big store: stores built the way `bench/api.py` builds its 10M-call store
(the real DDP trace scaled in DuckDB to every rank and many profiler steps, aggregates, attribution and the
time tables filled through the real code where the real code fits, `build_time_rows` for the time rows), at
the baseline size (default 10 M calls) and at the target size (default 100 M calls), both over `--ranks` ranks
and built in the same run, each in its own process (`nice -n 10`; build time and peak RSS reported). Then
`commlens serve` on each store and every analysis endpoint timed over HTTP (p50 and p90 over `-n` requests after
warm-up); the 1,024-rank ingested run's own endpoints too.

    python bench/scale.py                              # 1,024 ranks; 10M baseline and 100M target
    python bench/scale.py --ranks 64 --calls 2e4 4e4 -n 3 --no-write       # quick look
    python bench/scale.py --work /tmp/scale   # keep the stores; a second run reuses them (build numbers kept)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gzip
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
from api import RUN, start_server
from results import write_section

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("COMMLENS_DATA", ROOT.parent / "shared" / "data"))
DLRM = DATA / "kineto-param" / "dlrm_kineto.tar.gz"
CALLS_PER_COPY = 21  # calls of the DDP trace's rank per copy of its profiler steps (bench/api.py's scaling)
RANKS_RUN = "ranks1024"
SKEW_US = 2000  # per-rank clock offsets are within +-SKEW_US
TARGET_MS = 100  # issue 15: every analysis endpoint under 100 ms p50 on the 100M-call store


# ------------------------------------------------------------------------------------ part 1: ranks


def write_rank_traces(out: Path, ranks: int) -> dict[str, Any]:
    """The DLRM job's 8 traces as `ranks` rank files: rank fields rewritten, clocks offset per rank, gzipped."""
    with tarfile.open(DLRM) as tar:
        workers = sorted(
            (m for m in tar.getmembers() if m.isfile() and m.name.endswith(".pt.trace.json")),
            key=lambda m: int(Path(m.name).name.split("_")[0].removeprefix("worker")),
        )
        traces = [orjson.loads(tar.extractfile(m).read()) for m in workers]  # type: ignore[union-attr]
    out.mkdir(parents=True, exist_ok=True)
    raw = packed = 0
    for rank in range(ranks):
        base = traces[rank % len(traces)]
        offset = (rank * 7919) % (2 * SKEW_US + 1) - SKEW_US
        trace = dict(base)
        trace["distributedInfo"] = {**base["distributedInfo"], "rank": rank, "world_size": ranks}
        trace["traceName"] = f"./kineto/rank{rank}.pt.trace.json"
        trace["traceEvents"] = [{**e, "ts": e["ts"] + offset} if "ts" in e else e for e in base["traceEvents"]]
        data = orjson.dumps(trace)
        raw += len(data)
        path = out / f"rank{rank:04d}.pt.trace.json.gz"
        path.write_bytes(gzip.compress(data, compresslevel=1))
        packed += path.stat().st_size
    return {"files": ranks, "raw_mb": raw / 2**20, "gz_mb": packed / 2**20}


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and all its descendants, MiB."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
    return total / 1024


def measure_process(cmd: list[str]) -> dict[str, Any]:
    """Wall and CPU time of a whole process; peak RSS of its tree (sampled every 50 ms) and of its largest process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    peak = [0.0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], tree_rss_mb(proc.pid))
            done.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out = proc.stdout.read()  # type: ignore[union-attr]
    _, status, ru = os.wait4(proc.pid, 0)
    done.set()
    sampler.join()
    code = os.waitstatus_to_exitcode(status)
    if code:
        raise RuntimeError(f"{' '.join(cmd)} exited {code}:\n{out.decode(errors='replace')[-3000:]}")
    return {
        "wall_s": time.perf_counter() - t0,
        "cpu_s": ru.ru_utime + ru.ru_stime,
        "tree_rss_mb": peak[0],
        "max_rss_mb": ru.ru_maxrss / 1024,
        "stdout": out.decode(errors="replace"),
    }


def bench_ranks(tmp: Path, ranks: int, jobs: int) -> dict[str, Any]:
    traces = tmp / "ranks"
    t0 = time.perf_counter()
    made = write_rank_traces(traces, ranks)
    made["write_s"] = time.perf_counter() - t0
    db = tmp / "ranks.duckdb"
    db.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "commlens.cli", "ingest", "--db", str(db), "--run", RANKS_RUN, "--jobs", str(jobs)]
    m = measure_process([*cmd, str(traces)])
    con = __import__("duckdb").connect(str(db), read_only=True)
    calls, n_ranks = con.execute(
        "SELECT count(*), count(DISTINCT rank) FROM comms WHERE run = ?", [RANKS_RUN]
    ).fetchone()
    con.close()
    shutil.rmtree(traces)
    m.pop("stdout")
    return {**made, **m, "jobs": jobs, "calls": calls, "ranks": n_ranks, "db": db, "db_mb": db.stat().st_size / 2**20}


# ------------------------------------------------------------------------------------ part 2: stores


def build_in_child(db: Path, ranks: int, copies: int, memory_limit: str) -> dict[str, Any]:
    """bench/api.py's store, built by a `nice -n 10` child process (its own peak RSS), its summary back as JSON."""
    cmd = ["nice", "-n", "10", sys.executable, __file__, "--build", str(db), "--ranks", str(ranks)]
    m = measure_process([*cmd, "--copies", str(copies), "--memory-limit", memory_limit])
    info = json.loads(m.pop("stdout").strip().splitlines()[-1])
    return {**info, **m, "memory_limit": memory_limit}


def build_main(db: Path, ranks: int, copies: int, memory_limit: str) -> None:
    from api import build_store

    info = build_store(db, ranks, copies, {"memory_limit": memory_limit, "temp_directory": str(db.parent / "spill")})
    print(json.dumps(info))


# ------------------------------------------------------------------------------------ endpoints


def endpoints(run: str, step: int | None, other: str | None) -> dict[str, tuple[str, dict[str, Any]]]:
    """Every analysis endpoint the dashboard's pages call, by page."""
    r = f"/api/runs/{run}"
    step_q = {} if step is None else {"step": step}
    return {
        "overview: run detail": (r, {}),
        "overview: groups": (f"{r}/groups", {}),
        "overview: sources (first page)": (f"{r}/sources", {}),
        "overview: rank sources": (f"{r}/rank-sources", {}),
        "overview: hang": (f"{r}/hang", {}),
        "findings": (f"{r}/findings", {}),
        "histograms (per rank per iteration)": (f"{r}/histograms", {}),
        "histograms (weight=bytes, scheme=dp)": (f"{r}/histograms", {"weight": "bytes", "scheme": "dp"}),
        "histograms (rank=3, one step)": (f"{r}/histograms", {"rank": 3, **step_q}),
        "comparison (predicted vs measured)": (f"{r}/comparison", {}),
        **({"compare runs": ("/api/compare", {"runs": f"{run},{other}"})} if other else {}),
        "ranks (every rank)": (f"{r}/ranks", {}),
        "ranks (one band: 0-31)": (f"{r}/ranks", {"first": 0, "last": 31}),
        "ranks/summary": (f"{r}/ranks/summary", {}),
        "bandwidth": (f"{r}/bandwidth", {}),
        "iterations": (f"{r}/iterations", {}),
        "time summary": (f"{r}/time", {}),
        "time breakdown (one step, every rank)": (f"{r}/time/breakdown", step_q),
        "time breakdown (rank=3, first page)": (f"{r}/time/breakdown", {"rank": 3}),
        "time breakdown bands (every rank)": (f"{r}/time/breakdown/bands", {}),
        "time breakdown (one band: 0-31, first page)": (f"{r}/time/breakdown", {"first": 0, "last": 31}),
        "time stragglers": (f"{r}/time/stragglers", {}),
        "time instances (first page)": (f"{r}/time/instances", {}),
        "time instances (first page of 100, members=false)": (f"{r}/time/instances", {"members": "false"}),
        "time instance (one, every member)": (f"{r}/time/instances/0", {}),
        "time critical path (one step)": (f"{r}/time/critical-path", step_q),
    }


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used: what a request costs, apart from waiting for a core."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def quantile(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, max(0, round(q * len(s)) - 1))]


def time_endpoints(db: Path, run: str, step: int | None, other: str | None, n: int, warmup: int) -> dict[str, Any]:
    proc, url = start_server(db, db.with_suffix(".log"))
    out: dict[str, Any] = {}
    try:
        with httpx.Client(base_url=url, timeout=600) as c:
            for label, (path, params) in endpoints(run, step, other).items():
                for _ in range(warmup):
                    c.get(path, params=params)
                samples, status, size = [], 0, 0
                cpu0 = cpu_s(proc.pid)
                for _ in range(n):
                    t0 = time.perf_counter()
                    resp = c.get(path, params=params)
                    samples.append((time.perf_counter() - t0) * 1000)
                    status, size = resp.status_code, len(resp.content)
                out[label] = {
                    "p50": quantile(samples, 0.5),
                    "p90": quantile(samples, 0.9),
                    "cpu_ms": (cpu_s(proc.pid) - cpu0) * 1000 / n,
                    "status": status,
                    "kib": size / 1024,
                }
                print(f"  {label}: {out[label]}", flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    return out


def first_step(db: Path, run: str) -> int | None:
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    try:
        row = con.execute("SELECT min(step), max(step) FROM comms WHERE run = ?", [run]).fetchone()
        return None if row[0] is None else (row[0] + row[1]) // 2
    finally:
        con.close()


# ------------------------------------------------------------------------------------------ main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="commlens ingest --jobs")
    ap.add_argument("--calls", type=float, nargs="+", default=[10e6, 100e6], help="store sizes, the baseline first")
    ap.add_argument("-n", type=int, default=20, help="timed requests per endpoint")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--memory-limit", default="6GB", help="DuckDB memory_limit of the store builds")
    ap.add_argument(
        "--work",
        type=Path,
        help="keep the stores here (each with its build summary, calls<N>M.json) and reuse those already built; "
        "default: a temporary folder, removed at the end",
    )
    ap.add_argument("--no-write", action="store_true", help="print only; do not update bench/README.md")
    ap.add_argument("--build", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--copies", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.build:
        build_main(args.build, args.ranks, args.copies, args.memory_limit)
        return

    work = args.work or Path(tempfile.mkdtemp(prefix="commlens-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.UTC)
    try:
        print(f"part 1: {args.ranks} rank traces, ingest --jobs {args.jobs}", flush=True)
        ranks = bench_ranks(work, args.ranks, args.jobs)
        print(f"  {ranks}", flush=True)
        ranks["latency"] = time_endpoints(
            ranks["db"], RANKS_RUN, first_step(ranks["db"], RANKS_RUN), None, args.n, args.warmup
        )
        stores, failed = [], []
        for calls in args.calls:
            try:
                stores.append(store_latency(work, calls, args))
            except BuildError as exc:  # a size the machine cannot build: report it, keep the others
                print(f"  {exc}", flush=True)
                failed.append(str(exc))
        text = render(args, started, ranks, stores, failed)
        print(text)
        if not args.no_write:
            write_section("scale", text)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


class BuildError(RuntimeError):
    """A store could not be built (its process failed): why, in one line."""


def store_latency(work: Path, calls: float, args: argparse.Namespace) -> dict[str, Any]:
    """Build (or reuse) the store of about `calls` calls and time the endpoints on it."""
    copies = max(1, round(calls / (CALLS_PER_COPY * args.ranks)))
    db = work / f"calls{calls / 1e6:g}M.duckdb"
    summary = db.with_suffix(".json")
    if summary.exists() and db.exists():
        info = {**json.loads(summary.read_text()), "reused": True}
        print(f"part 2: reusing {db} ({info['calls']:,} calls)", flush=True)
    else:
        print(f"part 2: building a store of {args.ranks} ranks x {copies} copies", flush=True)
        db.unlink(missing_ok=True)
        try:
            info = build_in_child(db, args.ranks, copies, args.memory_limit)
        except RuntimeError as exc:
            db.unlink(missing_ok=True)
            tail = str(exc).strip().splitlines()
            # the first exception raised (later ones are raised while handling it)
            why = next((ln for ln in tail if re.match(r"[\w.]+(Error|Exception): ", ln)), tail[-1])
            raise BuildError(
                f"the {calls / 1e6:g}M-call store ({args.ranks} ranks x {copies} copies) failed: {why}"
            ) from None
        summary.write_text(json.dumps(info))
    print(f"  {info}", flush=True)
    step = info["first_step"] + info["steps_per_rank"] // 2
    info["latency"] = time_endpoints(db, RUN, step, "small", args.n, args.warmup)
    return info


def render(
    args: argparse.Namespace,
    started: dt.datetime,
    ranks: dict[str, Any],
    stores: list[dict[str, Any]],
    failed: list[str],
) -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        )
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    lines = [
        f"### Scale ({started:%Y-%m-%d %H:%M} UTC, {cpu}, {os.cpu_count()} cores, {mem_gib:.0f} GiB, "
        f"Python {platform.python_version()})",
        "",
        f"`python bench/scale.py --ranks {args.ranks} --jobs {args.jobs} --calls {' '.join(f'{c:g}' for c in args.calls)} "
        f"-n {args.n} --warmup {args.warmup} --memory-limit {args.memory_limit}`",
        "",
        f"**{ranks['ranks']:,} ranks ingested** from the DLRM job's 8 real rank traces ({ranks['files']:,} files, "
        f"{ranks['raw_mb']:,.0f} MiB of JSON, {ranks['gz_mb']:,.0f} MiB gzipped, {ranks['calls']:,} calls): "
        f"`commlens ingest --jobs {ranks['jobs']}` as one process {ranks['wall_s']:.1f} s wall, {ranks['cpu_s']:.1f} s CPU, "
        f"peak RSS {ranks['tree_rss_mb']:,.0f} MiB for the process tree ({ranks['max_rss_mb']:,.0f} MiB its largest "
        f"process), store {ranks['db_mb']:,.0f} MiB.",
        "",
        "| store | calls | ranks | build wall s (DuckDB memory_limit) | build CPU s | of which: scale, aggregates, attribution, time rows, "
        "findings inputs (wall s) | build peak RSS MiB | store MiB |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    lines += [
        f"| {s['calls'] / 1e6:.3g}M{' (built by an earlier run of the command)' if s.get('reused') else ''} | "
        f"{s['calls']:,} | {s['ranks']:,} | {s['wall_s']:.0f} ({s['memory_limit']}) | {s['cpu_s']:.0f} | "
        + ", ".join(f"{s[k]:.1f}" for k in ("scale_s", "refresh_s", "attribute_s", "time_s", "inputs_s"))
        + f" | {s['tree_rss_mb']:,.0f} | {s['db_mb']:,.0f} |"
        for s in stores
    ]
    lines += [f"| not built: {why} |||||||" for why in failed]
    head = ["endpoint", f"{ranks['ranks']} ranks ingested: p50 / p90 / CPU ms"] + [
        f"{s['calls'] / 1e6:.3g}M calls: p50 / p90 / CPU ms" for s in stores
    ]
    head.append(f"p50 {stores[-1]['calls'] / 1e6:.3g}M / {stores[0]['calls'] / 1e6:.3g}M")
    lines += ["", "| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    big, base = stores[-1]["latency"], stores[0]["latency"]
    for label in big:
        cells = [label]
        for lat in [ranks["latency"], *(s["latency"] for s in stores)]:
            m = lat.get(label)
            cells.append(
                ""
                if m is None
                else f"{m['p50']:.1f} / {m['p90']:.1f} / {m['cpu_ms']:.0f}"
                + ("" if m["status"] == 200 else f" (HTTP {m['status']})")
            )
        cells.append(f"{big[label]['p50'] / base[label]['p50']:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    missed = [
        f"{label} ({m['p50']:.0f} ms, {m['p50'] / TARGET_MS:.1f}x the target)"
        for label, m in big.items()
        if m["p50"] > TARGET_MS
    ]
    lines += [
        "",
        f"**Against the target** (p50 under {TARGET_MS} ms on the {stores[-1]['calls'] / 1e6:.3g}M-call store): "
        + (f"missed by {len(missed)} of {len(big)}: " + "; ".join(missed) + "." if missed else f"all {len(big)} met."),
        "",
        NOTES,
    ]
    return "\n".join(lines)


NOTES = """**How it is measured.** Part 1 is a user's whole command: `commlens ingest` in its own process,
imports included, on freshly written gzipped files; the process tree's RSS is sampled every 50 ms. Part 2's
stores are `bench/api.py`'s (`build_store`): the real DDP trace ingested, then scaled in DuckDB to every rank
and many copies of its profiler steps; the run's aggregates (`aggregates.refresh_run`), scheme attribution and
the timing findings' inputs (`store_timing_inputs`) come from the real code, the time tables from
`build_time_rows` (generated in SQL with the row counts of a real analysis: the real time analysis needs every
rank's timeline and the base trace has one rank). Each build runs in its own `nice -n 10` process with DuckDB's
`memory_limit` capped (the machine is shared). The endpoints are timed over HTTP against `commlens serve` in its
own process, sequentially after warm-up; "CPU ms" is the server process's CPU time per request
(`/proc/PID/stat`, 10 ms ticks averaged over the requests): on a 2-core machine shared with other jobs the
wall-clock p50 is mostly the wait for a core, the CPU time is what the request costs."""


if __name__ == "__main__":
    main()
