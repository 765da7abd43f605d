"""A job directory of 8 ranks x 54 MB of real Kineto JSON: `commlens ingest` against HTA's TraceAnalysis load
and against the floor, whole processes, imports included, in the same run.

The directory is the real 2-rank trace `df_index_resolver.json.gz` (54 MB of JSON, 2,020 all-reduce kernels)
written out 8 times as plain JSON with distributedInfo's rank set to 0..7 and world_size to 8 (the only
bytes changed), into a temporary folder. The floor is what any reader must do: read each file and
`orjson.loads` it, in as many processes as commlens uses. Peak RSS is the whole process tree's (psutil,
sampled every 20 ms), so worker processes count. One more commlens run ingests every file 4 times over (32
hard links): its memory must be that of the 8.

    python bench/ingest_vs_hta.py                # --jobs 2 (the cores here) and 1; HTA; the floor
    python bench/ingest_vs_hta.py --no-write
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import psutil
from results import write_section

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("COMMLENS_DATA", ROOT.parent / "shared" / "data"))
SRC = DATA / "kineto-hta/df_index_resolver/df_index_resolver.json.gz"
RANKS = 8
COPIES = 4

HTA = (
    "import logging, sys; logging.disable(logging.CRITICAL)\n"
    "from hta.trace_analysis import TraceAnalysis\n"
    "ta = TraceAnalysis(trace_dir=sys.argv[1])\n"
    "assert len(ta.t.traces) == 8, sorted(ta.t.traces)\n"
)
FLOOR = (
    "import sys, orjson\n"
    "from multiprocessing import Pool\n"
    "from pathlib import Path\n"
    "def load(p):\n"
    "    return len(orjson.loads(Path(p).read_bytes())['traceEvents'])\n"
    "if __name__ == '__main__':\n"
    "    files = sorted(str(p) for p in Path(sys.argv[1]).iterdir())\n"
    "    with Pool(int(sys.argv[2])) as pool:\n"
    "        print(sum(pool.map(load, files)))\n"
)


def build(out: Path) -> int:
    """The 8-rank directory (the file's own bytes but for distributedInfo); the size of the largest file."""
    data = gzip.decompress(SRC.read_bytes())
    m = re.search(rb'"distributedInfo"\s*:\s*(\{[^{}]*\})', data)
    assert m is not None, "no distributedInfo in the source trace"
    info = orjson.loads(m.group(1))
    size = 0
    for rank in range(RANKS):
        new = json.dumps({**info, "rank": rank, "world_size": RANKS}).encode()  # its spacing: HTA greps for it
        text = data[: m.start(1)] + new + data[m.end(1) :]
        (out / f"rank{rank}.json").write_bytes(text)
        size = max(size, len(text))
    return size


def measure(cmd: list[str]) -> dict:
    """Wall seconds; CPU seconds and peak memory of the process tree (workers included), sampled every 20 ms:
    the sum over processes of their last CPU time seen, and the peaks of the summed RSS (shared library
    pages counted once per process) and of the summed PSS (shared pages split between their processes)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    top = psutil.Process(proc.pid)
    peak = peak_pss = 0
    cpu_of: dict[int, float] = {}
    while proc.poll() is None:
        rss = pss = 0
        try:
            procs = [top, *top.children(recursive=True)]
        except psutil.Error:
            procs = []
        for p in procs:
            try:
                with p.oneshot():
                    mem = p.memory_full_info()
                    rss += mem.rss
                    pss += mem.pss
                    t = p.cpu_times()
                    cpu_of[p.pid] = t.user + t.system
            except psutil.Error:
                pass
        peak, peak_pss = max(peak, rss), max(peak_pss, pss)
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    cpu = sum(cpu_of.values())
    err = proc.stderr.read().decode(errors="replace")  # type: ignore[union-attr]
    return {
        "wall": wall,
        "cpu": cpu,
        "rss_mb": peak / 2**20,
        "pss_mb": peak_pss / 2**20,
        "status": proc.returncode,
        "err": err.strip()[-300:],
    }


def run(jobs: int) -> str:
    work = Path(tempfile.mkdtemp(prefix="commlens-vs-hta-"))
    traces = work / "traces"
    traces.mkdir()
    try:
        largest = build(traces)
        total = sum(p.stat().st_size for p in traces.iterdir())
        res = {}
        for j in (jobs, 1):
            db = work / f"j{j}.duckdb"
            cmd = [sys.executable, "-m", "commlens.cli", "ingest", str(traces), "--db", str(db), "--run", "job"]
            res[f"commlens -j {j}"] = measure([*cmd, "--jobs", str(j)])
            db.unlink(missing_ok=True)
        many = work / "many"  # the same files 4 times over (hard links): memory must not grow with the count
        many.mkdir()
        for p in sorted(traces.iterdir()):
            for k in range(COPIES):
                os.link(p, many / f"{p.stem}-copy{k}.json")
        db = work / "many.duckdb"
        cmd = [sys.executable, "-m", "commlens.cli", "ingest", str(many), "--db", str(db), "--run", "job"]
        res[f"commlens -j {jobs}, {COPIES * RANKS} files"] = measure([*cmd, "--jobs", str(jobs)])
        db.unlink(missing_ok=True)
        res["HTA TraceAnalysis"] = measure([sys.executable, "-c", HTA, str(traces)])
        res[f"floor ({jobs} processes)"] = measure([sys.executable, "-c", FLOOR, str(traces), str(jobs)])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for name, r in res.items():
        if r["status"]:
            print(f"{name} failed: {r['err']}", file=sys.stderr)
    c, h, f = res[f"commlens -j {jobs}"], res["HTA TraceAnalysis"], res[f"floor ({jobs} processes)"]
    goal_rss = 2 * largest / 2**20 + 300
    load = os.getloadavg()
    out = [
        f"Measured {dt.date.today().isoformat()} on {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, `python bench/ingest_vs_hta.py` (load average {load[0]:.1f} at "
        "the end; other jobs shared the cores).",
        "",
        f"{RANKS} ranks x {largest / 1e6:.1f} MB of Kineto JSON ({total / 1e6:.0f} MB), whole processes, imports "
        "included; peak RSS and PSS of the process tree.",
        "",
        "| process | wall s | CPU s | peak RSS MB | peak PSS MB |",
        "|---|---|---|---|---|",
        *(
            f"| {name} | {r['wall']:.2f} | {r['cpu']:.2f} | {r['rss_mb']:,.0f} | {r['pss_mb']:,.0f} |"
            for name, r in res.items()
        ),
        "",
        f"commlens (--jobs {jobs}) against HTA: **{h['wall'] / c['wall']:.1f}x** faster in wall time, "
        f"{h['cpu'] / c['cpu']:.1f}x in CPU time (goal 10x); against the floor: **{c['wall'] / f['wall']:.2f}x** its "
        f"wall time, {c['cpu'] / f['cpu']:.2f}x its CPU time (goal within 1.5x); peak RSS {c['rss_mb']:,.0f} MB "
        f"(PSS {c['pss_mb']:,.0f} MB) "
        f"against the goal of 2 x the largest file + 300 MB = {goal_rss:,.0f} MB; with {COPIES * RANKS} files "
        f"(each file {COPIES} times) {res[f'commlens -j {jobs}, {COPIES * RANKS} files']['rss_mb']:,.0f} MB.",
    ]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--no-write", action="store_true", help="print only; do not update bench/README.md")
    args = ap.parse_args()
    text = run(args.jobs)
    print(text)
    if not args.no_write:
        write_section("ingest_vs_hta", text)


if __name__ == "__main__":
    main()
