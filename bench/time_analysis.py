"""Time analysis benchmark: `persist_run` (the analysis ingest runs) on synthetic runs of 100k to 10M calls.

Each run is the real HTA DDP trace (`nccl_data.json.gz`, 21 calls in 3 profiler steps) ingested once, then
scaled inside DuckDB as bench/api.py scales it: every call, step and a share of the timeline copied to
more ranks and more steps, with each rank's arrivals jittered deterministically and one rank 400 µs late.
persist_run runs in a fresh process per run (so its peak RSS is its own), timed whole: load, analysis and
the write of the time tables. `--before DIR` runs the same in a tree exported from an older commit
(`git archive <commit> backend/timing | tar -x -C DIR`), so before and after are measured in the same run.

    python bench/time_analysis.py --before /tmp/before            # 100k, 1M, 10M x 8, 64 ranks
    python bench/time_analysis.py --calls 100000 --ranks 8 --no-write
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from results import write_section

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("COMMLENS_DATA", ROOT.parent / "shared" / "data"))
TRACE = DATA / "kineto-hta" / "nccl_parser_config" / "nccl_data.json.gz"
RUN = "big"
LATE_RANK = 5
COMPUTE_EVERY = 100  # one non-communication interval in this many is copied (the trace has 180 per call)


def build_store(db: Path, ranks: int, calls: int, compute_every: int = COMPUTE_EVERY) -> dict[str, Any]:
    """Ingest the real trace and scale it to about `calls` counted calls over `ranks` ranks."""
    from commlens import store
    from commlens.service.ingest import ingest_paths

    con = store.connect(db)
    ingest_paths(con, [TRACE], RUN)
    run_id = store.get_run_id(con, RUN)
    src = con.execute("SELECT source_id FROM sources WHERE run_id = ? AND status = 'ok'", [run_id]).fetchone()[0]
    base = con.execute("SELECT count(*) FROM comm_events WHERE run_id = ? AND counted", [run_id]).fetchone()[0]
    n_steps = con.execute("SELECT max(step) - min(step) + 1 FROM comm_events WHERE run_id = ?", [run_id]).fetchone()[0]
    span = con.execute("SELECT max(ts_us) - min(ts_us) + 1000 FROM comm_events WHERE run_id = ?", [run_id]).fetchone()[
        0
    ]
    copies = max(1, round(calls / (base * ranks)))
    con.execute("BEGIN TRANSACTION")
    con.execute(
        """INSERT INTO sources (run_id, path, kind, sha256, size_bytes, rank, world_size, status, n_events, skipped,
                                warnings, meta)
           SELECT run_id, 'scaled/rank' || r.i || '.json', kind, sha256 || '-' || r.i, size_bytes, r.i, ?, status,
                  n_events * ?, skipped, warnings, meta
           FROM sources, range(1, ?) r(i) WHERE source_id = ?""",
        [ranks, copies, ranks, src],
    )
    con.execute("CREATE TEMP TABLE rank_src AS SELECT rank, source_id FROM sources WHERE run_id = ?", [run_id])
    jitter = f"((rs.rank * 7919 + e.seq * 104729) % 997) / 10.0 + (rs.rank = {LATE_RANK})::INTEGER * 400.0"
    con.execute(
        f"""INSERT INTO comm_events (run_id, source_id, rank, process, seq, op, dtype, msg_bytes, elems_in,
                                    elems_out, group_size, group_key, peer, step, ts_us, dur_us, dur_source, op_count,
                                    comm_ptr, raw_name, match_key, cpu_start_us, cpu_end_us, dev_start_us, dev_end_us,
                                    counted)
           SELECT e.run_id, rs.source_id, rs.rank, 'rank' || rs.rank, e.seq + c.k * 100000, e.op, e.dtype,
                  e.msg_bytes, e.elems_in, e.elems_out, ?, e.group_key, e.peer, e.step + c.k * ?,
                  e.ts_us + c.k * ? + {jitter}, e.dur_us, e.dur_source, e.op_count, e.comm_ptr, e.raw_name,
                  e.match_key, e.cpu_start_us + c.k * ?, e.cpu_end_us + c.k * ?, e.dev_start_us + c.k * ?,
                  e.dev_end_us + c.k * ?, e.counted
           FROM comm_events e, rank_src rs, range(?) c(k)
           WHERE e.run_id = ? AND e.source_id = ? AND NOT (rs.source_id = ? AND c.k = 0)""",
        [ranks, n_steps, span, span, span, span, span, copies, run_id, src, src],
    )
    con.execute(
        """INSERT INTO steps
           SELECT s.run_id, rs.source_id, rs.rank, s.step + c.k * ?, s.ts_us + c.k * ?, s.dur_us
           FROM steps s, rank_src rs, range(?) c(k)
           WHERE s.run_id = ? AND s.source_id = ? AND NOT (rs.source_id = ? AND c.k = 0)""",
        [n_steps, span, copies, run_id, src, src],
    )
    cols = [r[0] for r in con.execute("DESCRIBE timeline_intervals").fetchall()]
    shifted = {"run_id": "t.run_id", "source_id": "rs.source_id", "rank": "rs.rank"}
    shifted |= {c: f"t.{c} + c.k * {span}" for c in ("start_us", "end_us")}
    select = ", ".join(shifted.get(c, f"t.{c}") for c in cols)
    con.execute(
        f"""INSERT INTO timeline_intervals
            SELECT {select} FROM (SELECT *, row_number() OVER (ORDER BY start_us) AS i FROM timeline_intervals
                                  WHERE run_id = ? AND source_id = ?) t, rank_src rs, range(?) c(k)
            WHERE (t.kind = 'comm' OR t.i % {compute_every} = 0) AND NOT (rs.source_id = ? AND c.k = 0)""",
        [run_id, src, copies, src],
    )
    con.execute(
        "UPDATE process_groups SET ranks = range(0, ?)::INTEGER[], size = ? WHERE run_id = ?", [ranks, ranks, run_id]
    )
    con.execute("UPDATE comm_events SET group_size = ? WHERE run_id = ?", [ranks, run_id])
    con.execute("UPDATE runs SET world_size = ? WHERE run_id = ?", [ranks, run_id])
    con.execute("COMMIT")
    n = con.execute("SELECT count(*) FROM comm_events WHERE run_id = ? AND counted", [run_id]).fetchone()[0]
    iv = con.execute("SELECT count(*) FROM timeline_intervals WHERE run_id = ?", [run_id]).fetchone()[0]
    con.execute("CHECKPOINT")
    con.close()
    return {"calls": n, "ranks": ranks, "steps_per_rank": n_steps * copies, "intervals": iv}


CHILD = """
import json, resource, sys, time
if sys.argv[3] != "0":  # a cap on the address space: a run too big fails instead of taking the machine
    cap = int(float(sys.argv[3]) * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
timing_dir = sys.argv[2]
if timing_dir:
    import commlens.backend.timing as t
    t.__path__[:] = [timing_dir]
from commlens import store
from commlens.backend.timing.persist import persist_run
con = store.connect(sys.argv[1])
run_id = store.get_run_id(con, "big")
t0, c0 = time.perf_counter(), time.process_time()
persist_run(con, run_id)
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
rows = con.execute("SELECT count(*) FROM time_instance_members WHERE run_id = ?", [run_id]).fetchone()[0]
ok = con.execute("SELECT count(*) FROM time_status WHERE run_id = ? AND part = 'matching' AND NOT ok "
                 "AND reason LIKE 'the time analysis failed%'", [run_id]).fetchone()[0] == 0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "peak_rss_mb": rss, "members": rows, "ok": ok}))
"""


def persist(db: Path, timing_dir: str, timeout: float, max_gb: float) -> dict[str, Any]:
    """persist_run in a fresh process on a fresh copy of the store (a second run on the same file would
    first delete the rows the first one wrote: measured, that made 'after' 23% slower than 'before' at 1M x
    8); `timing_dir` replaces backend/timing ('' = this tree); `max_gb` caps its address space (0: no cap)."""
    work = db.with_suffix(".run.duckdb")
    shutil.copyfile(db, work)
    try:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(work), timing_dir, str(max_gb)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
        )
    except subprocess.TimeoutExpired:
        return {"timeout_s": timeout}
    except subprocess.CalledProcessError as exc:
        return {"error": exc.stderr.strip().splitlines()[-1] if exc.stderr.strip() else f"exit {exc.returncode}"}
    finally:
        work.unlink(missing_ok=True)
        work.with_suffix(".duckdb.wal").unlink(missing_ok=True)
    return dict(json.loads(out.stdout[out.stdout.rfind('{"wall_s"') :]))  # after DuckDB's progress bars


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, nargs="+", default=[100_000, 1_000_000, 10_000_000])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--before", default="", help="a tree exported from an older commit (holding backend/timing)")
    ap.add_argument("--before-max", type=int, default=1_000_000, help="largest run the older code is timed on")
    ap.add_argument(
        "--before-from", type=Path, help="the JSON lines an earlier run printed: its 'before' of each run size"
    )
    ap.add_argument(
        "--compute-every",
        type=int,
        default=COMPUTE_EVERY,
        help="keep one non-communication interval of the trace in this many (1: all, 180 a call)",
    )
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--max-gb", type=float, default=0, help="address space cap of each persist_run process")
    ap.add_argument("--no-write", action="store_true", help="print only; do not update bench/README.md")
    args = ap.parse_args()
    earlier = {}
    if args.before_from:
        for line in args.before_from.read_text().splitlines():
            if line.startswith("{") and "before" in (row := json.loads(line)):
                earlier[(row["calls"], row["ranks"])] = row["before"]
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="commlens-bench-time-"))
    try:
        for calls in args.calls:
            for ranks in args.ranks:
                db = tmp / f"run-{calls}-{ranks}.duckdb"
                t0 = time.perf_counter()
                info = build_store(db, ranks, calls, args.compute_every)
                info["build_s"] = time.perf_counter() - t0
                if args.before and calls <= args.before_max:
                    info["before"] = persist(
                        db, str(Path(args.before) / "backend" / "timing"), args.timeout, args.max_gb
                    )
                elif (info["calls"], ranks) in earlier:
                    info["before"] = earlier[(info["calls"], ranks)]
                info["after"] = persist(db, "", args.timeout, args.max_gb)
                print(json.dumps(info), flush=True)
                rows.append(info)
                db.unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = render(rows, args)
    print(text)
    if not args.no_write:
        write_section("time_analysis", text)


def _cell(m: dict[str, Any] | None) -> str:
    if m is None:
        return "not run"
    if "timeout_s" in m:
        return f"> {m['timeout_s']:.0f} s (timed out)"
    if "error" in m:
        return f"failed: {m['error']}"
    return f"{m['wall_s']:.1f} s wall, {m['cpu_s']:.1f} s CPU, {m['peak_rss_mb']:.0f} MB"


def _ratio(b: dict[str, Any] | None, a: dict[str, Any], key: str) -> str:
    if not b or key not in b or key not in a:
        return "-"
    return f"{a[key] / b[key]:.3f}"


def render(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    cpu = platform.processor() or platform.machine()
    lines = [
        "## Time analysis at ingest (`bench/time_analysis.py`)",
        "",
        f"{dt.date.today().isoformat()}, {platform.system()} {cpu}, {os.cpu_count()} cores (shared with other "
        f"work), Python {platform.python_version()}. persist_run on the HTA DDP trace scaled in DuckDB (one "
        f"compute/memory interval in {args.compute_every} kept; rank {LATE_RANK} 400 µs late), each in a fresh process: wall and CPU time "
        "of the whole call (load, analysis, write) and the process's peak RSS. Ratios are after / before; with "
        "other jobs on the cores, CPU time is the measure, wall time says how loaded the machine was.",
        "",
        "| calls | ranks | steps/rank | intervals | before | after | CPU ratio | wall ratio | RSS ratio |",
        "|---:|---:|---:|---:|---|---|---:|---:|---:|",
    ]
    for r in rows:
        b, a = r.get("before"), r["after"]
        lines.append(
            f"| {r['calls']:,} | {r['ranks']} | {r['steps_per_rank']:,} | {r['intervals']:,} | {_cell(b)} | "
            f"{_cell(a)} | {_ratio(b, a, 'cpu_s')} | {_ratio(b, a, 'wall_s')} | {_ratio(b, a, 'peak_rss_mb')} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
