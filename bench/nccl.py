"""NCCL log benchmark: whole `commlens ingest` processes on the two shapes NCCL logs come in, against
floors measured in the same run on the same files.

Shapes (generated into a temporary directory, never into the repository):

- **interleaved**: one file, the stdout of 8 processes of one job whose lines interleave (a launcher's
  log): version banner, Init START/COMPLETE of a world communicator and three split communicators (tp, dp,
  pp of a 2 x 2 x 2 layout), node, ring, tree, connection and channel lines, TUNING lines, prose lines,
  then training iterations of COLL lines (AllReduce, ReduceScatter, AllGather, Broadcast) and P2P lines
  (Send/Recv), with buffer pointers that change from call to call as a caching allocator's do. Two NCCL
  generations: 2.21 (splits with commId) and 2.28 (splits with splitCount, no commId; AlltoAll calls).
- **per-process**: the harness's layout (`NCCL_DEBUG_FILE=nccl.%h.%p.log`): 8 files of the same job in
  the 2.21 format, one process each.

Each measurement is a fresh process (imports included); its peak RSS comes from os.wait4. Floors: `wc -l`
over the same files, and a plain Python loop over their lines (interpreter start included); the parse alone
(`parse_file`, no store) says how the time splits between the reader and the store.

    python bench/nccl.py                      # 2 M lines per shape, results into bench/README.md
    python bench/nccl.py --lines 200000 --no-write
    python bench/nccl.py --stages             # and each step's CPU and wall seconds (service calls in turn)
    python bench/nccl.py --generate /tmp/nccl-shapes --lines 2000000   # only write the files
    git archive REV | tar -x -C /tmp/old && make -C /tmp/old layout
    python bench/nccl.py --baseline /tmp/old/.layout --baseline-label "REV"  # and an earlier code beside it
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMLENS = Path(sys.executable).with_name("commlens")

HOST = "gpu-a100-017"
WORLD = 8
# dtype codes of ncclDataType_t: float32, bfloat16
F32, BF16 = 7, 9


# ------------------------------------------------------------------------------------------ generation


class _Process:
    """One rank of a tp=2 x dp=2 x pp=2 job (tp fastest, then dp, then pp): its envelope and communicators."""

    def __init__(self, rank: int, version: str):
        self.rank = rank
        self.version = version
        self.pid = 52100 + 17 * rank
        self.main = f"{HOST}:{self.pid}:{self.pid} [{rank}] NCCL INFO "
        self.init = f"{HOST}:{self.pid}:{self.pid + 61} [{rank}] NCCL INFO "
        self.tp, self.dp, self.pp = rank % 2, (rank // 2) % 2, rank // 4
        base = 0x55D0_0000_0000 + rank * 0x1_0000_0000 + 0x3E10
        self.comm = {"world": base, "tp": base + 0x9_0000, "dp": base + 0x12_0000, "pp": base + 0x1B_0000}
        self.stream = 0x55D0_8000_0000 + rank * 0x1_0000_0000 + 0x1F0
        self.heap = 0x7F3C_0000_0000 + rank * 0x10_0000_0000
        self.op_count = {"world": 0, "tp": 0, "dp": 0, "pp": 0}
        self.calls = 0

    def init_lines(self) -> list[str]:
        """Version, init and topology lines of the world communicator and the three splits."""
        r, e = self.rank, self.init
        v21 = self.version.startswith("2.21")
        out = [] if not v21 or r else [f"NCCL version {self.version}+cuda12.4"]
        if not v21:
            out.append(f"{e}NCCL version {self.version}+cuda12.8")
        out.append(f"{self.main}Bootstrap : Using eth0:10.42.0.{17 + r}<0>")
        out.append(f"{e}cudaDriverVersion 12040")
        api = "ncclCommInitRank" if v21 else "ncclCommInitRankConfig"
        world = f"comm 0x{self.comm['world']:x} rank {r} nranks {WORLD} cudaDev {r} nvmlDev {r} busId {r + 1}8000"
        out.append(f"{e}{api} {world} commId 0x5f3e9c2a1b7d4e60 - Init START")
        out.append(
            f"{e}comm 0x{self.comm['world']:x} rank {r} nRanks {WORLD} nNodes 1 localRanks {WORLD} localRank {r} MNNVL 0"
        )
        for ch in range(4):
            ring = "".join(f" {(x + ch) % WORLD:3d}" for x in range(WORLD))
            out.append(f"{e}Channel {ch:02d}/04 :{ring}")
        trees = " ".join(f"[{ch}] {(r + 1) % WORLD}/-1/-1->{r}->{(r - 1) % WORLD}" for ch in range(4))
        out.append(f"{e}Trees {trees}")
        out.append(f"{e}P2P Chunksize set to 524288")
        for ch in range(4):
            nxt = (r + 1) % WORLD
            out.append(f"{e}Channel {ch:02d}/0 : {r}[{r}] -> {nxt}[{nxt}] via P2P/CUMEM/read")
        out.append(f"{e}Connected all rings")
        out.append(f"{e}Connected all trees")
        out.append(f"{e}4 coll channels, 4 collnet channels, 0 nvls channels, 4 p2p channels, 2 p2p channels per peer")
        if r == 0:
            out.extend(
                f"{e}AllReduce: {1 << k} Bytes -> Algo RING proto {'LL' if k < 18 else 'SIMPLE'} time 12.5"
                for k in range(10, 30, 4)
            )
        out.append(f"{e}{api} {world} commId 0x5f3e9c2a1b7d4e60 - Init COMPLETE")
        for n, (name, color, key) in enumerate(
            (
                ("tp", self.pp * 2 + self.dp, self.tp),
                ("dp", 100 + self.pp * 2 + self.tp, self.dp),
                ("pp", 200 + r % 4, self.pp),
            )
        ):
            child = f"comm 0x{self.comm[name]:x} rank {key} nranks 2 cudaDev {r} nvmlDev {r} busId {r + 1}8000"
            parent = f"parent 0x{self.comm['world']:x}"
            if v21:
                tail = f"{parent} color {color} key {key} commId 0x{0x6A00_0000_0000_0000 + n * 0x100 + color:x}"
            else:
                tail = f"{parent} splitCount {n + 1} color {color} key {key}"
            out.append(f"{e}ncclCommSplit {child} {tail} - Init START")
            out.append(f"{e}Channel 00/02 :    0   1")
            out.append(f"{e}Channel 00/0 : {key}[{r}] -> {1 - key}[{r ^ 1}] via P2P/CUMEM/read")
            out.append(f"{e}ncclCommSplit {child} {tail} - Init COMPLETE")
        return out

    def coll(self, name: str, comm: str, count: int, dtype: int, root: int = 0, redop: int = 0) -> str:
        """One COLL (or P2P) line with the buffers a caching allocator hands out."""
        self.calls += 1
        send = self.heap + (self.calls * 0x2A3000) % 0x4_0000_0000
        recv = "(nil)" if name == "Send" else f"0x{send + 0x800000:x}"
        send_text = "(nil)" if name == "Recv" else f"0x{send:x}"
        opc = self.op_count[comm]
        if name not in ("Send", "Recv") or comm != "pp":
            self.op_count[comm] += 1
        nranks = WORLD if comm == "world" else 2
        return (
            f"{self.main}{name}: opCount {opc:x} sendbuff {send_text} recvbuff {recv} count {count} datatype {dtype} "
            f"op {redop} root {root} comm 0x{self.comm[comm]:x} [nranks={nranks}] stream 0x{self.stream:x}"
        )

    def iteration(self, it: int) -> list[str]:
        """One training iteration: pipeline sends/receives, tp all-reduces, dp gradient reduce-scatter and
        parameter all-gather, a loss all-reduce on the world communicator."""
        out = []
        peer = 1 - self.pp
        for _mb in range(4):
            if self.pp:
                out.append(self.coll("Recv", "pp", 4096 * 1024, BF16, root=peer))
            out.extend(self.coll("AllReduce", "tp", 4096 * 1024 + layer * 64, BF16) for layer in range(3))
            if not self.pp:
                out.append(self.coll("Send", "pp", 4096 * 1024, BF16, root=peer))
        for _mb in range(4):
            if not self.pp:
                out.append(self.coll("Recv", "pp", 4096 * 1024, BF16, root=peer))
            out.extend(self.coll("AllReduce", "tp", 4096 * 1024 + layer * 64, BF16) for layer in range(3))
            if self.pp:
                out.append(self.coll("Send", "pp", 4096 * 1024, BF16, root=peer))
        out.extend(self.coll("ReduceScatter", "dp", 6_250_000 + bucket, F32) for bucket in range(4))
        if self.version.startswith("2.28"):
            out.append(self.coll("AlltoAll", "dp", 262_144, BF16))
        out.extend(self.coll("AllGather", "dp", 3_125_000 + bucket, BF16) for bucket in range(4))
        out.append(self.coll("AllReduce", "world", 1, F32))
        if it % 50 == 0:
            out.append(self.coll("Broadcast", "world", 16, F32))
        return out


def _streams(lines: int, version: str) -> list[Iterator[str]]:
    """Each process's lines (init, then iterations) until the job has about `lines` lines in all."""
    procs = [_Process(r, version) for r in range(WORLD)]
    per_proc = lines // WORLD

    def gen(p: _Process) -> Iterator[str]:
        n = 0
        for line in p.init_lines():
            n += 1
            yield line
        it = 0
        while n < per_proc:
            for line in p.iteration(it):
                n += 1
                yield line
                if n >= per_proc:
                    break
            it += 1
            if it % 100 == 0:
                yield f"[rank{p.rank}]: iteration {it} loss 2.{it % 97:02d}"  # a trainer's print, prose
                n += 1

    return [gen(p) for p in procs]


def write_interleaved(path: Path, lines: int, version: str, seed: int = 7) -> int:
    """One log of 8 interleaved processes; returns its line count."""
    rnd = random.Random(seed)
    streams = _streams(lines, version)
    live = list(range(WORLD))
    n = 0
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt") as f:
        buf: list[str] = []
        while live:
            k = rnd.choice(live)
            for _ in range(rnd.randint(1, 3)):  # a writer often gets a few lines out before the next
                line = next(streams[k], None)
                if line is None:
                    live.remove(k)
                    break
                buf.append(line)
            if len(buf) >= 50_000:
                n += len(buf)
                f.write("\n".join(buf) + "\n")
                buf.clear()
        n += len(buf)
        f.write("\n".join(buf) + "\n")
    return n


def write_per_process(folder: Path, lines: int, version: str, gz: bool = False) -> int:
    """One file per process, as the harness names them; returns the line count of all files."""
    folder.mkdir(parents=True, exist_ok=True)
    n = 0
    for r, stream in enumerate(_streams(lines, version)):
        path = folder / f"nccl.{HOST}.{52100 + 17 * r}.log{'.gz' if gz else ''}"
        opener = gzip.open if gz else open
        with opener(path, "wt") as f:
            buf: list[str] = []
            for line in stream:
                buf.append(line)
                if len(buf) >= 50_000:
                    f.write("\n".join(buf) + "\n")
                    n += len(buf)
                    buf.clear()
            f.write("\n".join(buf) + "\n")
            n += len(buf)
    return n


# ------------------------------------------------------------------------------------------ measurement


def _worker(mode: str, paths: list[str]) -> dict:
    """In-process measurements (child side): a plain Python line loop, or the parse alone."""
    t0 = time.perf_counter()
    if mode == "lines":
        n = 0
        for p in paths:
            with gzip.open(p, "rb") if p.endswith(".gz") else open(p, "rb") as f:
                for _ in f:
                    n += 1
        return {"lines": n, "seconds": time.perf_counter() - t0}
    if mode == "parse":
        from commlens.ingest.inputs import DEFAULT_LIMITS, iter_inputs
        from commlens.ingest.parse_file import parse_file
        from commlens.ingest.records import RankHint

        rows = 0
        for item in iter_inputs([Path(p) for p in paths], DEFAULT_LIMITS):
            parsed = parse_file(item, RankHint())
            if parsed.result is None:
                raise SystemExit(parsed.error)
            rows += parsed.result.n_events
        return {"rows": rows, "seconds": time.perf_counter() - t0}
    if mode == "stages":
        return _stages(paths)
    raise SystemExit(f"unknown mode {mode}")


def _stages(paths: list[str]) -> dict:
    """CPU and wall seconds of each step of `commlens ingest` (the service's own calls, one after the other,
    into a fresh store beside the first file): where the time goes."""
    import resource

    from commlens import store
    from commlens.backend.findings_time import store_timing_inputs
    from commlens.backend.timing.persist import persist_run
    from commlens.ingest.inputs import DEFAULT_LIMITS, iter_inputs
    from commlens.ingest.nccl_link import link_run
    from commlens.ingest.nccl_prelink import Prelinks
    from commlens.ingest.parse_file import parse_file
    from commlens.ingest.records import RankHint
    from commlens.service import ingest
    from commlens.store import aggregates

    def clock() -> tuple[float, float]:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return time.perf_counter(), r.ru_utime + r.ru_stime

    out: dict[str, list[float]] = {}
    last = clock()

    def mark(stage: str) -> None:
        nonlocal last
        now = clock()
        out[stage] = [round(now[0] - last[0], 2), round(now[1] - last[1], 2)]
        last = now

    with tempfile.TemporaryDirectory(dir=Path(paths[0]).parent) as tmp:
        con = store.connect(Path(tmp) / "stages.duckdb")
        mark("store")
        items = list(iter_inputs([Path(p) for p in paths], DEFAULT_LIMITS))
        parsed = [parse_file(i, RankHint()) for i in items]
        mark("parse")
        links = Prelinks()  # as the split ingest: every file parsed, then linked before the write
        for item, p in zip(items, parsed, strict=True):
            if p.result is not None:
                links.saw(id(item), p.result)
        links.plan(con, "stages", None, [id(i) for i in items])
        mark("link plan")
        run = ingest.PendingRun("stages")
        for item, p in zip(items, parsed, strict=True):
            links.apply("stages", item.name, p)
            ingest.ingest_file(con, run, item, RankHint(), DEFAULT_LIMITS, p)
        del parsed, p
        mark("write")
        run_id = run.made(con)
        store.transaction(con, lambda c: link_run(c, run_id, links.written("stages")))
        mark("link")
        aggregates.refresh_run(con, run_id)
        mark("aggregates")
        ingest.attribute(con, "stages")
        mark("attribution")
        persist_run(con, run_id)
        mark("time analysis")
        store_timing_inputs(con, run_id)
        mark("timing findings' inputs")
        con.close()
    return {"stages [wall s, CPU s]": out}


def measure(cmd: list[str], env: dict[str, str] | None = None) -> dict:
    """A whole process: wall seconds, CPU seconds (user + system) and peak RSS of the process tree's
    largest member, through os.wait4 on the child."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    out = proc.stdout.read()
    err = proc.stderr.read()
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if status != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (status {status}):\n{err.decode(errors='replace')[-3000:]}")
    return {
        "wall": wall,
        "cpu": ru.ru_utime + ru.ru_stime,
        "rss": ru.ru_maxrss * 1024,
        "out": out.decode(errors="replace"),
    }


def measure_shape(
    name: str, paths: list[Path], lines: int, work: Path, repeat: int, baseline: Path | None = None
) -> dict:
    """Floors and the whole `commlens ingest`, best of `repeat` for each; with `baseline` (the package
    layout of an earlier checkout, `make layout`), its `commlens ingest` too, runs alternating."""
    strs = [str(p) for p in paths]

    def best(cmd: list[str]) -> dict:
        return min((measure(cmd) for _ in range(repeat)), key=lambda m: m["wall"])

    res = {"name": name, "lines": lines, "bytes": sum(p.stat().st_size for p in paths), "files": len(paths)}
    res["wc"] = best(["wc", "-l", *strs])
    res["loop"] = best([sys.executable, __file__, "--worker", "lines", *strs])
    res["parse"] = best([sys.executable, __file__, "--worker", "parse", *strs])
    runs, before = [], []
    for i in range(repeat):
        db = work / f"{name}-{i}.duckdb"
        runs.append(measure([str(COMMLENS), "ingest", *strs, "--db", str(db), "--run", name]))
        calls = _calls(db)
        db.unlink()
        if baseline is not None:
            env = {**os.environ, "PYTHONPATH": str(baseline)}
            before.append(measure([str(COMMLENS), "ingest", *strs, "--db", str(db), "--run", name], env))
            if _calls(db) != calls:
                raise SystemExit(f"{name}: the baseline stored a different number of calls")
            db.unlink()
    res["ingest"] = min(runs, key=lambda m: m["wall"])
    res["calls"] = calls
    if before:
        res["before"] = min(before, key=lambda m: m["cpu"])
        res["before_wall"] = min(b["wall"] for b in before)
        res["ingest_cpu"] = min(r["cpu"] for r in runs)
    return res


def _calls(db: Path) -> int:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import duckdb; print(duckdb.connect({str(db)!r}).execute('SELECT count(*) FROM comms').fetchall()[0][0])",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.strip())


def report(results: list[dict], baseline: str = "") -> str:
    out = [
        f"Measured {dt.date.today().isoformat()} on {platform.machine()}, {os.cpu_count()} cores "
        f"({_mem_gib():.0f} GiB), Python {platform.python_version()}, `python bench/nccl.py`; whole processes "
        "(interpreter start and imports included), best of the runs; peak RSS of the process (os.wait4).",
        "",
        "| shape | files | lines | MB | calls stored | `commlens ingest` s | M lines/s | CPU s | peak RSS MiB "
        "| parse alone s | Python line loop s | `wc -l` s | ingest / line loop |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ing = r["ingest"]
        out.append(
            f"| {r['name']} | {r['files']} | {r['lines']:,} | {r['bytes'] / 1e6:.0f} | {r['calls']:,} | {ing['wall']:.2f} "
            f"| **{r['lines'] / ing['wall'] / 1e6:.2f}** | {ing['cpu']:.2f} | {ing['rss'] / 2**20:.0f} "
            f"| {r['parse']['wall']:.2f} | {r['loop']['wall']:.2f} | {r['wc']['wall']:.2f} "
            f"| {ing['wall'] / r['loop']['wall']:.2f} |"
        )
    if any("before" in r for r in results):
        out += [
            "",
            f"Against the baseline code ({baseline}), the same files, runs alternating, best wall and best CPU of each:",
            "",
            "| shape | baseline wall s | wall s | wall ratio | baseline CPU s | CPU s | CPU ratio "
            "| baseline peak RSS MiB | peak RSS MiB | M lines per CPU s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in results:
            b, wall = r["before"], r["ingest"]["wall"]
            out.append(
                f"| {r['name']} | {r['before_wall']:.2f} | {wall:.2f} | {wall / r['before_wall']:.2f} "
                f"| {b['cpu']:.2f} | {r['ingest_cpu']:.2f} | {r['ingest_cpu'] / b['cpu']:.2f} "
                f"| {b['rss'] / 2**20:.0f} | {r['ingest']['rss'] / 2**20:.0f} | {r['lines'] / r['ingest_cpu'] / 1e6:.2f} |"
            )
    return "\n".join(out)


def _mem_gib() -> float:
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) / 2**20


def generate(folder: Path, lines: int, gz: bool) -> list[tuple[str, list[Path], int]]:
    folder.mkdir(parents=True, exist_ok=True)
    ext = ".log.gz" if gz else ".log"
    shapes = []
    for version in ("2.21.5", "2.28.3"):
        path = folder / f"interleaved-{version}{ext}"
        n = write_interleaved(path, lines, version)
        shapes.append((f"interleaved, NCCL {version}", [path], n))
    n = write_per_process(folder / "per-process", lines, "2.21.5", gz)
    shapes.append(("per-process, NCCL 2.21.5", sorted((folder / "per-process").iterdir()), n))
    return shapes


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print(json.dumps(_worker(sys.argv[2], sys.argv[3:])))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=2_000_000, help="lines per shape (about)")
    ap.add_argument("--gzip", action="store_true", help="write the logs gzipped")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--baseline-label", default="an earlier checkout", help="what --baseline is, for the report")
    ap.add_argument("--stages", action="store_true", help="print where the time of each shape's ingest goes")
    ap.add_argument("--generate", type=Path, help="only write the shapes into this folder")
    ap.add_argument("--no-write", action="store_true", help="print only; do not update bench/README.md")
    ap.add_argument(
        "--baseline",
        type=Path,
        help="package layout of an earlier checkout (`git archive REV | tar -x -C DIR && make -C DIR layout`, then "
        "DIR/.layout): its `commlens ingest` measured beside this one",
    )
    args = ap.parse_args()
    if args.generate:
        for name, paths, n in generate(args.generate, args.lines, args.gzip):
            print(f"{name}: {n:,} lines in {len(paths)} file(s) under {args.generate}")
        return
    work = Path(tempfile.mkdtemp(prefix="commlens-nccl-bench-"))
    try:
        results = []
        for name, paths, n in generate(work, args.lines, args.gzip):
            print(f"{name}: {n:,} lines ...", flush=True)
            results.append(
                measure_shape(
                    name.split(",")[0].replace(" ", "-") + str(len(results)), paths, n, work, args.repeat, args.baseline
                )
            )
            results[-1]["name"] = name
            if args.stages:
                print(measure([sys.executable, __file__, "--worker", "stages", *map(str, paths)])["out"], flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = report(results, args.baseline_label)
    print(text)
    if not args.no_write:
        sys.path.insert(0, str(Path(__file__).parent))
        from results import write_section

        write_section("nccl", text)


if __name__ == "__main__":
    main()
