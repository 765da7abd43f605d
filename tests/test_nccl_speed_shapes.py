"""The vectorised NCCL log path (`ingest.nccl_vector`) against the line-by-line path, and exact results on the
two shapes `bench/nccl.py` measures (one interleaved log of 8 processes; one file per process), small."""

from __future__ import annotations

import io
import random
import threading
from collections import Counter

import pyarrow as pa
import pytest
from nccl_bench import nccl_bench

from commlens.ingest import nccl_log, nccl_vector
from commlens.ingest.inputs import DEFAULT_LIMITS
from commlens.ingest.nccl_grammar import FAST
from commlens.ingest.nccl_log import parse_nccl_log
from commlens.ingest.nccl_relabel import EVENT_FIELDS, _plain_events, events_table
from commlens.ingest.records import ParseResult, RankHint
from commlens.service.ingest import ingest_paths


def _parse(data: bytes) -> ParseResult:
    return parse_nccl_log(io.BufferedReader(io.BytesIO(data)), "t.log", RankHint(), DEFAULT_LIMITS)  # type: ignore[arg-type]


def _rows(res: ParseResult) -> list[dict]:
    tables = [_plain_events(t) for t in res.event_tables]
    if res.events:
        tables.append(events_table(res.events))
    if not tables:
        return []
    t = pa.concat_tables(tables)
    keys = [f.name for f in EVENT_FIELDS]
    return sorted(t.select(keys).to_pylist(), key=lambda r: (r["process"], r["seq"]))


def _line_by_line(data: bytes, monkeypatch: pytest.MonkeyPatch) -> ParseResult:
    with monkeypatch.context() as m:
        m.setattr(nccl_log, "VECTOR_MIN_LINES", 1 << 40)
        return _parse(data)


def _same(data: bytes, monkeypatch: pytest.MonkeyPatch) -> ParseResult:
    fast = _parse(data)
    slow = _line_by_line(data, monkeypatch)
    assert fast.event_tables, "the vectorised path was not taken"
    assert _rows(fast) == _rows(slow)
    assert fast.skipped == slow.skipped
    assert fast.warnings == slow.warnings
    assert fast.nccl_comms == slow.nccl_comms
    assert fast.topology == slow.topology
    assert fast.meta == slow.meta
    assert fast.rank == slow.rank
    return fast


CLEAN = (
    "{pre}h{h}:{pid}:{pid} [{dev}] NCCL INFO {name}: opCount {opc} sendbuff {sb} recvbuff {rb} count {count} "
    "datatype {dt} op 0 root {root} comm 0x55{h}0 [nranks={nr}] stream 0x7e{post}"
)


def _mutations(rnd: random.Random, rate: float = 0.3) -> dict[str, str]:
    """One COLL line's fields, most clean, some damaged in the ways logs are (and some FAST still takes)."""
    f = {
        "pre": "",
        "h": str(rnd.randint(0, 3)),
        "pid": str(100 + rnd.randint(0, 3)),
        "dev": str(rnd.randint(0, 1)),
        "name": rnd.choice(["AllReduce", "AllGather", "ReduceScatter", "Send", "Recv", "Broadcast"]),
        "opc": f"{rnd.randint(0, 5000):x}",
        "sb": f"0x7f{rnd.randint(0, 1 << 30):x}",
        "rb": rnd.choice(["(nil)", f"0x7f{rnd.randint(0, 1 << 30):x}"]),
        "count": str(rnd.randint(0, 1 << 26)),
        "dt": str(rnd.choice([7, 9, 6])),
        "root": str(rnd.randint(0, 1)),
        "nr": "2",
        "post": "",
    }
    if rnd.random() < rate:
        k, v = rnd.choice(
            [
                ("pre", "[1] "),
                ("pre", "> "),
                ("pre", "(RayTrainWorker pid=615, ip=10.72.7.6) "),
                ("pre", "[default0]:"),
                ("pre", "NCCL "),
                ("pre", "x: opCount 3 "),
                ("pre", "Using"),
                ("pre", "a  b "),
                ("post", " "),
                ("post", " task 3 globalrank 1"),
                ("post", " h9:1:1 [0] NCCL INFO Channel 00/02 :    0   1"),
                ("post", "\r"),
                ("post", "\t"),
                ("post", "\x85"),
                ("post", " stream 0x1"),
                ("opc", "f" * 15),
                ("opc", "1" * 16),
                ("opc", "g1"),
                ("opc", "ABC"),
                ("count", "9" * 18),
                ("count", "1" * 19),
                ("count", "12a"),
                ("count", ""),
                ("sb", "count"),
                ("sb", "0x1  "),
                ("sb", "a\tb"),
                ("rb", ""),
                ("nr", "x"),
                ("nr", "2] [nranks=3"),
                ("dt", "99"),
                ("name", "PutSignal"),
                ("name", "Foo"),
                ("name", "All-Reduce"),
                ("h", "\xe9"),
                ("root", "-1"),
            ]
        )
        f[k] = v
    return f


def _damaged_log(n: int, rate: float, seed: int) -> bytes:
    rnd = random.Random(seed)
    lines = [
        f"h{i}:{100 + i}:{100 + i} [0] NCCL INFO comm 0x55{i}0 rank {i % 2} nranks 2 cudaDev 0 busId 1000 "
        "- Init COMPLETE"
        for i in range(4)
    ]
    for i in range(n):
        lines.append(CLEAN.format(**_mutations(rnd, rate)))
        if i % 997 == 0:
            lines.append(f"h{i % 4}:{100 + i % 4}:7 [0] NCCL INFO Channel 00/02 :    0   1")
        if i % 1500 == 0:
            lines.append("prose without markers")
    return "\n".join(lines).encode("utf-8", "surrogateescape")


def test_clean_coll_takes_exactly_the_lines_fast_takes():
    """Every line `FAST` matches as a COLL line without NCCL text around it, with its groups, and no other."""
    data = _damaged_log(8000, 0.5, 15)
    clean = nccl_vector.clean_coll(nccl_vector.Block(data))
    assert clean is not None
    want = {}
    for i, line in enumerate(data.split(b"\n")):
        m = FAST.fullmatch(line)
        if m is None or not m.group(2):
            continue
        pre, head, opc, count, tail, post, _ = m.groups()
        if b"NCCL" in pre or b"opCount" in pre or b"NCCL" in post:
            continue
        if len(opc) > 15 or len(count) > 18:
            continue  # left to the line-by-line path on purpose (int64)
        want[i] = (head, tail, int(opc, 16), int(count))
    got = {
        line: (clean.heads[key // clean.n_tails], clean.tails[key % clean.n_tails], opc, count)
        for line, key, opc, count in zip(
            clean.line.to_pylist(),
            clean.key.to_pylist(),
            clean.op_count.to_pylist(),
            clean.count.to_pylist(),
            strict=True,
        )
    }
    assert got.keys() <= want.keys()
    # lines with other whitespace (tab, CR, VT, FF) anywhere are left to the line-by-line path
    others = {i for i, line in enumerate(data.split(b"\n")) if any(c in line for c in b"\t\r\x0b\x0c")}
    assert want.keys() - got.keys() <= others
    assert got == {i: want[i] for i in got}
    assert len(got) > 4000


def test_vectorised_path_equals_line_by_line_on_damaged_lines(monkeypatch):
    res = _same(_damaged_log(40_000, 0.004, 15), monkeypatch)
    assert sum(t.num_rows for t in res.event_tables) > 30_000  # most lines went the vectorised way
    assert res.skipped  # and the damaged ones were decided line by line


def test_vectorised_path_on_ray_prefixed_and_quoted_logs(monkeypatch):
    rnd = random.Random(3)
    lines = []
    for i in range(9000):
        f = _mutations(random.Random(i), 0)
        f["pre"] = rnd.choice(["(RayTrainWorker pid=615, ip=10.72.7.6) ", "> ", "> > "])
        f["post"] = rnd.choice(["", " "])
        f["opc"], f["count"], f["nr"], f["name"], f["dt"] = f"{i:x}", str(i), "2", "AllReduce", "7"
        lines.append(CLEAN.format(**f))
    res = _same(("\n".join(lines) + "\n").encode(), monkeypatch)
    assert sum(t.num_rows for t in res.event_tables) == 9000


@pytest.fixture(scope="module")
def bench():
    return nccl_bench()


def _expected_calls(bench, version: str, lines: int) -> Counter:
    """Calls per (rank, op, group size) the generator wrote, counted from its own processes."""
    calls: Counter = Counter()
    for r, stream in enumerate(bench._streams(lines, version)):
        for line in stream:
            if " opCount " in line:
                name = line.split(" NCCL INFO ", 1)[1].split(":", 1)[0]
                nranks = int(line.rsplit("[nranks=", 1)[1].split("]", 1)[0])
                calls[(r, name, nranks)] += 1
    return calls


OPS = {
    "AllReduce": "all_reduce",
    "ReduceScatter": "reduce_scatter",
    "AllGather": "all_gather",
    "Send": "send",
    "Recv": "recv",
    "Broadcast": "broadcast",
    "AlltoAll": "all_to_all",
}


@pytest.mark.parametrize("version", ["2.21.5", "2.28.3"])
def test_interleaved_shape_exact(tmp_path, con, bench, version, monkeypatch):
    path = tmp_path / "job.log"
    n = bench.write_interleaved(path, 60_000, version)
    assert n == 60_000
    res = _same(path.read_bytes(), monkeypatch)
    assert res.meta["processes"] == 8 and res.meta["nccl_version"] == version
    summary = ingest_paths(con, [path], "job")
    assert [f.status for f in summary.files] == ["ok"]
    got = Counter(
        {
            (r, op, n): c
            for r, op, n, c in con.execute(
                "SELECT rank, op, group_size, count(*) FROM comms WHERE run = 'job' GROUP BY ALL"
            ).fetchall()
        }
    )
    want = Counter({(r, OPS[name], nr): c for (r, name, nr), c in _expected_calls(bench, version, 60_000).items()})
    assert got == want
    # tp all-reduces: 24 per iteration on a group of 2; pipeline peers are global ranks 4 apart
    assert con.execute(
        "SELECT DISTINCT rank, peer FROM comms WHERE run = 'job' AND op IN ('send', 'recv') ORDER BY 1, 2"
    ).fetchall() == [(r, r ^ 4) for r in range(8)]
    groups = con.execute(
        "SELECT size, count(*) FROM process_groups g JOIN runs r USING (run_id) WHERE r.name = 'job' "
        "GROUP BY size ORDER BY size"
    ).fetchall()
    assert groups == [(2, 12), (8, 1)]  # 4 tp, 4 dp, 4 pp groups of 2, one world


def test_per_process_shape_exact(tmp_path, con, bench, monkeypatch):
    folder = tmp_path / "job"
    n = bench.write_per_process(folder, 80_000, "2.21.5")
    assert n == 80_000
    files = sorted(folder.iterdir())
    assert len(files) == 8
    res = _same(files[3].read_bytes(), monkeypatch)
    assert res.meta["processes"] == 1 and res.rank == 3
    summary = ingest_paths(con, [folder], "job")
    assert sorted((f.rank, f.status) for f in summary.files) == [(r, "ok") for r in range(8)]
    got = Counter(
        {
            (r, op, n): c
            for r, op, n, c in con.execute(
                "SELECT rank, op, group_size, count(*) FROM comms WHERE run = 'job' GROUP BY ALL"
            ).fetchall()
        }
    )
    want = Counter({(r, OPS[name], nr): c for (r, name, nr), c in _expected_calls(bench, "2.21.5", 80_000).items()})
    assert got == want
    assert sum(want.values()) == con.execute("SELECT count(*) FROM comms WHERE run = 'job'").fetchone()[0]


class _FailingRaw(io.RawIOBase):
    """A file whose read fails after `good` bytes (a disk or network error mid-file)."""

    def __init__(self, data: bytes, good: int):
        self._data, self._good, self._pos = data, good, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[override]
        if self._pos >= self._good:
            raise OSError("read failed mid-file")
        n = min(len(b), self._good - self._pos)
        b[:n] = self._data[self._pos : self._pos + n]
        self._pos += n
        return n


def _parse_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("nccl-log-reader", "nccl-log-cut"))]


def test_blocks_cut_on_several_threads_in_order_and_none_left_behind(tmp_path, bench, monkeypatch):
    """Blocks are cut by CUTTERS threads ahead of the state machine: the rows are the line-by-line path's,
    in order, and no reading or cutting thread outlives the parse, whether it ends or its file fails."""
    path = tmp_path / "job.log"
    bench.write_interleaved(path, 200_000, "2.28.3")
    data = path.read_bytes()
    assert len(data) > 6 * nccl_log.BLOCK_BYTES  # several blocks in flight at once
    _same(data, monkeypatch)
    assert _parse_threads() == []
    raw = _FailingRaw(data, 5 * nccl_log.BLOCK_BYTES + 123)
    with pytest.raises(OSError, match="read failed mid-file"):
        parse_nccl_log(io.BufferedReader(raw), "t.log", RankHint(), DEFAULT_LIMITS)
    assert _parse_threads() == []
