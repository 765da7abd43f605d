"""Cluster benchmark: `commlens ingest --cluster` on a Dask LocalCluster against the single-process ingest of
the same files, whole processes (interpreter start and imports included), in the same run.

The input is an 8-rank job built from the real 54 MB Kineto trace in the shared data (df_index_resolver):
each rank's copy has its own `distributedInfo` rank (world size 8), so the eight files are eight ranks of
one job, written gzipped to a temporary folder (never into the repository). The cluster is started once,
before the clock, as a long-lived cluster is; its start-up time is reported apart.

    python bench/cluster.py                 # 2 workers x 1 thread; results into bench/README.md
    python bench/cluster.py --workers 2 --ranks 4 --no-write
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb
from results import write_section

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("COMMLENS_DATA", ROOT.parent / "shared" / "data"))
TRACE = DATA / "kineto-hta" / "df_index_resolver" / "df_index_resolver.json.gz"
RANK_FIELD = b'"distributedInfo": {"backend": "nccl", "rank": 1, "world_size": 2}'


def build_job(folder: Path, ranks: int) -> int:
    """`ranks` gzipped copies of the trace, each naming its own rank; the decompressed bytes of one."""
    content = gzip.decompress(TRACE.read_bytes())
    if content.count(RANK_FIELD) != 1:
        raise SystemExit(f"{TRACE}: its distributedInfo is not the expected {RANK_FIELD!r}")
    for rank in range(ranks):
        mine = content.replace(
            RANK_FIELD, f'"distributedInfo": {{"backend": "nccl", "rank": {rank}, "world_size": {ranks}}}'.encode()
        )
        (folder / f"rank{rank}.json.gz").write_bytes(gzip.compress(mine, compresslevel=1))
    return len(content)


def ingest(db: Path, folder: Path, *extra: str) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one whole `commlens ingest` process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "commlens.cli",
            "ingest",
            str(folder),
            "--db",
            str(db),
            "--run",
            "job",
            "--one-run",
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    if status != 0:
        raise SystemExit(
            f"commlens ingest {' '.join(extra)} failed: {proc.stderr.read().decode() if proc.stderr else ''}"
        )
    return seconds, usage.ru_maxrss / 1024


def counts(db: Path) -> tuple[int, int, int]:
    """(sources ok, calls, timeline intervals) of the run: the two ingests must agree."""
    con = duckdb.connect(str(db), read_only=True)
    row = con.execute(
        "SELECT (SELECT count(*) FROM sources WHERE status = 'ok'), (SELECT count(*) FROM comm_events), "
        "(SELECT count(*) FROM timeline_intervals)"
    ).fetchone()
    con.close()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def phases(folder: Path, scheduler: str, tmp: Path) -> dict[str, float]:
    """Where the cluster ingest's time goes, measured in this process: the parse phase (tasks on the
    workers: wall, and the workers' own parse and Parquet-write seconds summed), storing the files (attach
    and write, then the run's finishing), and the finishing alone, run again on the same store."""
    from distributed import Client

    from commlens import store
    from commlens.ingest.inputs import DEFAULT_LIMITS
    from commlens.ingest.records import RankHint
    from commlens.service import cluster
    from commlens.service.ingest import complete_run

    con = store.connect(tmp / "phases.duckdb")
    with Client(scheduler) as client:
        t0 = time.perf_counter()
        done = cluster.parse_on(client, [str(folder)], str(tmp / "parts"), "job", RankHint(), DEFAULT_LIMITS)
        t1 = time.perf_counter()
    cluster.store_files(con, "job", done, RankHint(), DEFAULT_LIMITS, None, None, False)
    t2 = time.perf_counter()
    run_id = store.get_run_id(con, "job")
    assert run_id is not None
    complete_run(con, run_id, "job")
    t3 = time.perf_counter()
    con.close()
    return {
        "parse wall": t1 - t0,
        "parse (workers' sum)": sum(d.parse_s for d in done),
        "Parquet write (workers' sum)": sum(d.write_s for d in done),
        "attach, write and finish": t2 - t1,
        "finish alone (link, aggregates, attribution, time)": t3 - t2,
    }


def has_jobs_option() -> bool:
    out = subprocess.run(
        [sys.executable, "-m", "commlens.cli", "ingest", "--help"], capture_output=True, text=True, check=False
    )
    return "--jobs" in out.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/README.md alone")
    args = parser.parse_args()
    from distributed import LocalCluster

    with tempfile.TemporaryDirectory(prefix="commlens-bench-cluster-") as tmp:
        folder = Path(tmp) / "job"
        folder.mkdir()
        size = build_job(folder, args.ranks)
        t0 = time.perf_counter()
        with LocalCluster(
            n_workers=args.workers, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=":0"
        ) as cluster:
            start = time.perf_counter() - t0
            rows = []
            single = ("--jobs", "1") if has_jobs_option() else ()
            for label, extra in (
                ("single process" + (" (--jobs 1)" if single else ""), single),
                (
                    f"--cluster, LocalCluster {args.workers} workers x 1 thread",
                    ("--cluster", cluster.scheduler_address),
                ),
            ):
                db = Path(tmp) / f"{len(rows)}.duckdb"
                seconds, rss = ingest(db, folder, *extra)
                rows.append((label, seconds, rss, counts(db)))
            split = phases(folder, cluster.scheduler_address, Path(tmp))
        base = rows[0][1]
        if len({r[3] for r in rows}) != 1:
            raise SystemExit(f"the ingests differ: {[(r[0], r[3]) for r in rows]}")
        lines = [
            f"Measured {dt.date.today()} on {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"`python bench/cluster.py --workers {args.workers} --ranks {args.ranks}`.",
            "",
            f"{args.ranks} ranks x {size / 1e6:.1f} MB of real Kineto JSON (gzipped copies of df_index_resolver, each "
            f"its own rank); whole `commlens ingest` processes, imports included; both stores hold the same "
            f"{rows[0][3][0]} files, {rows[0][3][1]} calls and {rows[0][3][2]} timeline intervals. Cluster start-up "
            f"(not in the times): {start:.1f} s. Peak RSS is the ingest process's (workers apart).",
            "",
            "| ingest | wall s | x single process | peak RSS MiB |",
            "|---|---|---|---|",
            *(f"| {label} | {s:.1f} | {s / base:.2f} | {rss:.0f} |" for label, s, rss, _ in rows),
            "",
            "Where the cluster ingest's time goes (in one process, same files, after the two runs above):",
            "",
            "| phase | s |",
            "|---|---|",
            *(f"| {phase} | {s:.1f} |" for phase, s in split.items()),
        ]
        text = "\n".join(lines)
        print(text)
        if not args.no_write:
            write_section("cluster", text)


if __name__ == "__main__":
    main()
