"""Long profiler traces: memory and throughput of `commlens ingest` on one trace of many small all-reduces.

The trace is synthetic (tests/kineto_synth.py): the event shapes of the real DDP trace `nccl_data.json.gz`
(record_param_comms, nccl:all_reduce, cudaLaunchKernelExC, the NCCL kernel; Kineto's key order), repeated
with fresh ids and times, gzipped into a temporary folder. Each measurement is a whole process
(`python -m commlens.cli ingest`, imports included), its peak RSS and CPU time from os.wait4; the floor is
a process that gunzips the same file and `orjson.loads` it, in the same run. The read floor is what any
parse of the file pays before looking at an event: gunzip and the two sha256 of `parse_file` (the file's
bytes and its content), in one process. `--compare-blocks` also runs the same ingest with the Kineto
block reader off (`ingest.kineto.BLOCKS = False`: every event read one by one by the fast scan), the
baseline of the block reader, in the same run.

    python bench/stream.py --events 1000000 4000000           # sizes to measure (trace events)
    python bench/stream.py --events 1000000 4000000 20000000   # the floor only up to --floor-up-to events
    python bench/stream.py --events 1000000 4000000 --compare-blocks
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results import write_section

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("COMMLENS_DATA", ROOT.parent / "shared" / "data"))
sys.path.insert(0, str(ROOT / "tests"))
import kineto_synth  # noqa: E402 - the generator the tests use

SRC = DATA / "kineto-hta/nccl_parser_config/nccl_data.json.gz"
FLOOR = "import gzip, sys, orjson; orjson.loads(gzip.open(sys.argv[1], 'rb').read())"
READ_FLOOR = (
    "import gzip, hashlib, sys\n"
    "hashlib.sha256(open(sys.argv[1], 'rb').read())\n"
    "h, f = hashlib.sha256(), gzip.open(sys.argv[1], 'rb')\n"
    "while b := f.read(8 << 20): h.update(b)"
)
# `commlens ingest` with the Kineto block reader off
NO_BLOCKS = (
    "import sys; from commlens.ingest import kineto; kineto.BLOCKS = False; from commlens.cli import main; main()"
)


def measure(cmd: list[str]) -> dict:
    """Wall and CPU seconds and peak RSS of one process; its exit status."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = proc.stdout.read()  # type: ignore[union-attr]
    _, status, ru = os.wait4(proc.pid, 0)
    lines = out.decode(errors="replace").strip().splitlines()
    return {
        "wall": time.perf_counter() - t0,
        "cpu": ru.ru_utime + ru.ru_stime,
        "rss_mb": ru.ru_maxrss / 1024,
        "status": os.waitstatus_to_exitcode(status),
        # a failed file's error names it: those lines, else the last one
        "tail": ([x for x in lines if ".json" in x][-2:] or lines[-1:]) if status else [],
    }


def run(sizes: list[int], budget: int | None, floor_up_to: int, compare: bool) -> str:
    work = Path(tempfile.mkdtemp(prefix="commlens-stream-"))
    lines = []
    try:
        for events in sizes:
            calls = events // kineto_synth.EVENTS_PER_CALL
            trace = work / f"allreduce-{calls}.json.gz"
            print(f"generating {calls:,} calls ...", flush=True)
            written = kineto_synth.write_trace_gz(SRC, calls, trace)
            args = ["ingest", str(trace), "--db", str(work / f"{calls}.duckdb"), "--run", "long", "-j", "1"]
            args += ["--max-trace-events", str(budget)] if budget else []
            c = measure([sys.executable, "-m", "commlens.cli", *args])
            (work / f"{calls}.duckdb").unlink(missing_ok=True)
            off = measure([sys.executable, "-c", NO_BLOCKS, *args]) if compare else None
            (work / f"{calls}.duckdb").unlink(missing_ok=True)
            f = measure([sys.executable, "-c", FLOOR, str(trace)]) if events <= floor_up_to else None
            read = measure([sys.executable, "-c", READ_FLOOR, str(trace)])
            result = "stored" if c["status"] == 0 else f"exit {c['status']}: {' '.join(c['tail'])[:300]}"
            floor_txt = (
                f"{f['wall']:.1f} s, {f['rss_mb']:,.0f} MB ({c['wall'] / f['wall']:.1f}x)"
                if f and not f["status"]
                else "-"
            )
            off_txt = (
                f"{off['cpu']:.1f} s, {off['rss_mb']:,.0f} MB ({off['cpu'] / c['cpu']:.2f}x)"
                if off and not off["status"]
                else "-"
            )
            lines.append(
                f"| {written:,} | {calls:,} | {trace.stat().st_size / 2**20:,.0f} | {result} | {c['wall']:.1f} | "
                f"{c['cpu']:.1f} | {written / c['cpu']:,.0f} | {calls / c['cpu']:,.0f} | {c['rss_mb']:,.0f} | {off_txt} | "
                f"{floor_txt} | {read['cpu']:.2f} s ({calls / read['cpu']:,.0f} calls/s) |"
            )
            print(lines[-1], flush=True)
            trace.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load = os.getloadavg()
    head = [
        f"Measured {dt.date.today().isoformat()} on {platform.machine()}, {os.cpu_count()} cores, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, "
        f"Python {platform.python_version()}, `python bench/stream.py --events {' '.join(map(str, sizes))}"
        f"{f' --max-trace-events {budget}' if budget else ''}"
        f"{f' --floor-up-to {floor_up_to}' if floor_up_to != 4_000_000 else ''}"
        f"{' --compare-blocks' if compare else ''}` (load average {load[0]:.1f} at the end: other "
        "jobs shared the cores, so CPU seconds are the fairer measure).",
        "",
        "| trace events | all-reduce calls | MB gzipped | result | wall s | CPU s | trace events / CPU s | "
        "calls / CPU s | peak RSS MB | block reader off: CPU s, peak RSS (x CPU s) | "
        "floor: gunzip + orjson.loads (x commlens wall) | read floor: gunzip + 2 sha256, CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    return "\n".join(head + lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, nargs="+", default=[1_000_000, 4_000_000])
    ap.add_argument("--max-trace-events", type=int, default=None, help="passed to commlens ingest")
    ap.add_argument(
        "--floor-up-to",
        type=int,
        default=4_000_000,
        help="measure the gunzip + orjson.loads floor up to this many events (it holds the whole document: "
        "~11 GB at 4 M events); 0: never",
    )
    ap.add_argument(
        "--compare-blocks", action="store_true", help="also ingest with the Kineto block reader off (the baseline)"
    )
    ap.add_argument("--no-write", action="store_true", help="print only; do not update bench/README.md")
    args = ap.parse_args()
    text = run(args.events, args.max_trace_events, args.floor_up_to, args.compare_blocks)
    print(text)
    if not args.no_write:
        write_section("stream", text)


if __name__ == "__main__":
    main()
