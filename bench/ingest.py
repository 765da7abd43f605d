"""Ingest benchmark: commlens against HTA's TraceAnalysis load and against the decompression floor.

Each measurement runs in its own process so its peak RSS is its own (os.wait4 rusage). Everything is
measured in the same run on the same files; results are ratios against those baselines, written to
bench/README.md between the RESULTS markers.

    python bench/ingest.py                 # real traces + a synthetic trace of >= 500 MB + NCCL logs
    python bench/ingest.py --synthetic-mb 100 --no-write   # quicker look
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
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


# ------------------------------------------------------------------------------- workers (child side)


def _worker(mode: str, path: str) -> dict:
    """One measurement; imports happen before the clock starts, so small files are not all start-up."""
    if mode == "commlens":
        from commlens import store
        from commlens.service.ingest import ingest_paths  # imports every format's parser

        with tempfile.TemporaryDirectory() as d:
            con = store.connect(Path(d) / "bench.duckdb")
            t0 = time.perf_counter()
            summary = ingest_paths(con, [Path(path)], "bench")
            seconds = time.perf_counter() - t0
            con.close()
        return {
            "seconds": seconds,
            "rows": sum(f.events for f in summary.files),
            "status": [f.status for f in summary.files],
        }
    if mode == "hta":
        import logging

        logging.disable(logging.CRITICAL)
        from hta.trace_analysis import TraceAnalysis

        with tempfile.TemporaryDirectory() as d:
            os.symlink(os.path.abspath(path), os.path.join(d, "rank0" + ("".join(Path(path).suffixes[-2:]) or ".json")))
            t0 = time.perf_counter()
            ta = TraceAnalysis(trace_dir=d)
            seconds = time.perf_counter() - t0
            rows = int(sum(len(df) for df in ta.t.traces.values()))
        return {"seconds": seconds, "rows": rows}
    t0 = time.perf_counter()
    if mode == "decompress":
        n = 0
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as f:
            while chunk := f.read(1 << 22):
                n += len(chunk)
        return {"seconds": time.perf_counter() - t0, "bytes": n}
    if mode == "lines":
        n = 0
        with open(path, "rb") as f:
            for _ in f:
                n += 1
        return {"seconds": time.perf_counter() - t0, "lines": n}
    raise SystemExit(f"unknown mode {mode}")


# ------------------------------------------------------------------------------- parent side


def measure(mode: str, path: Path) -> dict:
    """Run one measurement in a fresh process; add its peak RSS in bytes."""
    proc = subprocess.Popen(
        [sys.executable, __file__, "--worker", mode, str(path)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    out = proc.stdout.read()  # type: ignore[union-attr]
    _, status, rusage = os.wait4(proc.pid, 0)
    if status != 0:
        return {"error": f"{mode} failed on {path.name} (status {status})"}
    result = json.loads(out.decode().strip().splitlines()[-1])
    result["peak_rss"] = rusage.ru_maxrss * 1024
    return result


def size_and_events(path: Path) -> tuple[int, int]:
    """Decompressed bytes and trace events (counted by their "ph" key) of a trace."""
    n = events = 0
    tail = b""
    with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            n += len(chunk)
            events += (tail + chunk).count(b'"ph"') - tail.count(b'"ph"')
            tail = chunk[-4:]
    return n, events


def make_synthetic_trace(src: Path, target_mb: int, out: Path) -> Path:
    """Replicate the events of a real trace (shifting timestamps by its span) until >= target_mb."""
    doc = json.loads(gzip.decompress(src.read_bytes()))
    events = doc["traceEvents"]
    ts = [e["ts"] for e in events if isinstance(e.get("ts"), (int, float))]
    span = (max(ts) - min(ts)) + 1000.0
    head = {k: v for k, v in doc.items() if k != "traceEvents"}
    head_json = json.dumps(head)[:-1]
    chunk_events = [json.dumps(e) for e in events]
    written = 0
    target = target_mb * 2**20
    with gzip.open(out, "wb", compresslevel=1) as f:
        f.write((head_json + ', "traceEvents": [\n').encode())
        copy = 0
        first = True
        while written < target:
            shift = copy * span
            parts = []
            for e, line in zip(events, chunk_events, strict=True):
                if isinstance(e.get("ts"), (int, float)) and copy:
                    e2 = dict(e)
                    e2["ts"] = e["ts"] + shift
                    args = e.get("args")
                    if isinstance(args, dict):
                        e2["args"] = {
                            k: (
                                v + copy * 10_000_000
                                if k in ("External id", "correlation") and isinstance(v, int)
                                else v
                            )
                            for k, v in args.items()
                        }
                    if "id" in e and e.get("ph") in ("s", "f") and isinstance(e["id"], int):
                        e2["id"] = e["id"] + copy * 10_000_000
                    parts.append(json.dumps(e2))
                else:
                    parts.append(line)
            block = (",\n" if not first else "") + ",\n".join(parts)
            first = False
            data = block.encode()
            f.write(data)
            written += len(data)
            copy += 1
        f.write(b"\n]}\n")
    return out


def make_nccl_log(lines: int, out: Path) -> Path:
    """An interleaved NCCL log of 8 processes: Init lines then `lines` COLL lines."""
    with open(out, "w") as f:
        for r in range(8):
            f.write(
                f"node1:{1000 + r}:{2000 + r} [{r}] NCCL INFO comm 0x55{r:02d} rank {r} nranks 8 cudaDev {r} "
                f"nvmlDev {r} busId {r}000 commId 0xabcdef - Init COMPLETE\n"
            )
        template = (
            "node1:{pid}:{tid} [{dev}] NCCL INFO AllReduce: opCount {op:x} sendbuff 0x7f00 recvbuff 0x7f00 "
            "count {count} datatype 7 op 0 root 0 comm 0x55{dev:02d} [nranks=8] stream 0x7e00\n"
        )
        buf = []
        for i in range(lines):
            r = i % 8
            buf.append(template.format(pid=1000 + r, tid=2000 + r, dev=r, op=i // 8, count=1024 << (i % 12)))
            if len(buf) == 100_000:
                f.write("".join(buf))
                buf.clear()
        f.write("".join(buf))
    return out


def run(args: argparse.Namespace) -> str:
    files = sorted((DATA / "kineto-hta").rglob("*.json.gz"))
    work = Path(tempfile.mkdtemp(prefix="commlens-bench-"))
    rows = []
    try:
        if args.synthetic_mb:
            print(f"building a synthetic trace of >= {args.synthetic_mb} MB ...", flush=True)
            files.append(
                make_synthetic_trace(
                    DATA / "kineto-hta/nccl_parser_config/nccl_data.json.gz",
                    args.synthetic_mb,
                    work / "synthetic.json.gz",
                )
            )
        for path in files:
            size, events = size_and_events(path)
            print(f"{path.name}: {size / 1e6:.1f} MB decompressed, {events} events", flush=True)
            res = {m: measure(m, path) for m in ("decompress", "commlens", "hta")}
            rows.append((path, size, events, res))
        nccl = make_nccl_log(args.nccl_lines, work / "nccl.log")
        nccl_res = {m: measure(m, nccl) for m in ("lines", "commlens")}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report(rows, nccl_res, args.nccl_lines)


def report(rows, nccl_res, nccl_lines: int) -> str:
    mb = 1e6
    out = [
        f"Measured {dt.date.today().isoformat()} on {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, `python bench/ingest.py`.",
        "",
        "Times exclude interpreter start-up and imports (both tools); peak RSS is the whole process's.",
        "",
        "| trace | MB (decompressed) | trace events | commlens MB/s | commlens events/s | comm rows kept | HTA MB/s | x HTA | decompress MB/s | commlens time / decompress time | commlens peak RSS / MB | HTA peak RSS / MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for path, size, events, res in rows:
        c, h, d = res["commlens"], res["hta"], res["decompress"]
        if "error" in c:
            out.append(f"| {path.name} | {size / mb:.1f} | {events} | {c['error']} | | | | | | | | |")
            continue
        c_mbs = size / mb / c["seconds"]
        h_mbs = size / mb / h["seconds"] if "seconds" in h else float("nan")
        d_mbs = size / mb / d["seconds"]
        out.append(
            f"| {path.name} | {size / mb:.1f} | {events} | {c_mbs:.1f} | {events / c['seconds']:.0f} | {c['rows']} | "
            f"{h_mbs:.1f} | {c_mbs / h_mbs:.1f} | {d_mbs:.1f} | {c['seconds'] / d['seconds']:.2f} | "
            f"{c['peak_rss'] / size:.2f} | {h.get('peak_rss', float('nan')) / size:.2f} |"
        )
    c, lines_only = nccl_res["commlens"], nccl_res["lines"]
    out += [
        "",
        f"NCCL log, {nccl_lines:,} COLL lines (8 processes interleaved): commlens {nccl_lines / c['seconds'] / 1e6:.2f} M lines/s "
        f"({c['seconds']:.2f} s incl. store), reading the lines alone {nccl_lines / lines_only['seconds'] / 1e6:.2f} M lines/s, "
        f"peak RSS {c['peak_rss'] / 2**20:.0f} MiB.",
    ]
    return "\n".join(out)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print(json.dumps(_worker(sys.argv[2], sys.argv[3])))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--synthetic-mb", type=int, default=500)
    ap.add_argument("--nccl-lines", type=int, default=4_000_000)
    ap.add_argument("--no-write", action="store_true", help="print only; do not update bench/README.md")
    args = ap.parse_args()
    text = run(args)
    print(text)
    if not args.no_write:
        write_section("ingest", text)


if __name__ == "__main__":
    main()
