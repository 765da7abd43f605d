"""NCCL debug-log ingester and run-level communicator linking.

Real logs (../shared/data/nccl-logs) are ingested through the pipeline, one run per file, and checked
against values read off the files; multi-process behaviour is checked on synthetic logs written here.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from commlens import store
from commlens.ingest.inputs import DEFAULT_LIMITS, Limits
from commlens.ingest.nccl_link import link_run
from commlens.ingest.nccl_log import parse_nccl_log
from commlens.ingest.records import ParseResult, RankHint
from commlens.service.ingest import ingest_paths

REAL_LOGS = {
    "aws-aws-ofi-nccl-65.log",
    "huggingface-accelerate-3240.log",
    "huggingface-transformers-15618.log",
    "huggingface-transformers-22363.log",
    "nvidia-nccl-1193.log",
    "nvidia-nccl-1238.log",
    "nvidia-nccl-1357.log",
    "nvidia-nccl-1453-turn0.log",
    "nvidia-nccl-1595.log",
    "nvidia-nccl-203.log",
    "nvidia-nccl-429.log",
    "nvidia-nccl-584.log",
    "nvidia-nccl-629.log",
    "nvidia-nccl-634.log",
    "nvidia-nccl-671.log",
    "nvidia-nccl-tests-252.log",
    "pytorch-pytorch-131781.log",
    "pytorch-pytorch-54232.log",
    "rocm-rccl-429.log",
}


def parse(data: bytes, limits: Limits = DEFAULT_LIMITS, hint: RankHint | None = None) -> ParseResult:
    return parse_nccl_log(io.BufferedReader(io.BytesIO(data)), "t.log", hint or RankHint(), limits)


def ingest_one(con, path: Path, run: str | None = None) -> int:
    summary = ingest_paths(con, [path], run or path.stem)
    assert [f.status for f in summary.files] == ["ok"], summary.files
    return store.get_run_id(con, run or path.stem)


def rows(con, sql: str, params: list | None = None) -> list[tuple]:
    return con.execute(sql, params or []).fetchall()


def source_meta(con, run_id: int) -> tuple[dict, dict]:
    import json

    meta, skipped = con.execute("SELECT meta, skipped FROM sources WHERE run_id = ?", [run_id]).fetchone()
    return json.loads(meta), json.loads(skipped)


# ------------------------------------------------------------------------------------- real logs


def test_every_real_log_ingests_ok_without_false_damage(data_dir, con):
    logs = sorted((data_dir / "nccl-logs").glob("*.log"))
    assert {p.name for p in logs} == REAL_LOGS
    for path in logs:
        run_id = ingest_one(con, path)
        kind, status, skipped = con.execute(
            "SELECT kind, status, skipped FROM sources WHERE run_id = ?", [run_id]
        ).fetchone()
        assert (kind, status, skipped) == ("nccl_log", "ok", "{}"), path.name


def test_ray_prefixed_allreduce_lines(data_dir, con):
    run_id = ingest_one(con, data_dir / "nccl-logs" / "nvidia-nccl-1193.log")
    got = rows(
        con,
        """SELECT process, seq, op, dtype, msg_bytes, op_count, group_size, rank, group_key
                       FROM comm_events WHERE run_id = ? ORDER BY process, seq""",
        [run_id],
    )
    host = "r24-02-22-23-29-0066-raycluster-lv52c-worker-l4-8-"
    assert [(r[0], r[1], r[4], r[5]) for r in got] == [
        (host + "fqztx:615", 0, 7382228 * 4, 0x139D),
        (host + "hzhzd:619", 0, 7066572 * 4, 0x139E),
        (host + "srrss:22754", 0, 7382228 * 4, 0x139D),
        (host + "srrss:22754", 1, 7066572 * 4, 0x139E),
    ]
    assert {(r[2], r[3], r[6], r[7]) for r in got} == {("all_reduce", "float32", 128, None)}
    # no init lines: the group stays the per-process provisional key
    assert got[2][8] == f"nccl:ptr:{host}srrss:22754:0x7fb4b3e6ee80:n128"
    assert rows(
        con, "SELECT size, origin FROM process_groups WHERE run_id = ? AND group_key = ?", [run_id, got[2][8]]
    ) == [(128, "event")]


def test_markdown_quoted_single_rank_lines(data_dir, con):
    run_id = ingest_one(con, data_dir / "nccl-logs" / "nvidia-nccl-1238.log")
    got = rows(
        con, "SELECT process, seq, msg_bytes, op_count, group_size, peer FROM comm_events WHERE run_id = ?", [run_id]
    )
    assert sorted(got) == [("ip-172-31-54-74:30125", i, 128 * 2**20, 0, 1, None) for i in range(4)]


def test_send_recv_peers_and_comms(data_dir, con):
    run_id = ingest_one(con, data_dir / "nccl-logs" / "nvidia-nccl-584.log")
    got = rows(
        con,
        """SELECT op, peer, op_count, comm_ptr, msg_bytes, elems_in, elems_out FROM comm_events
                       WHERE run_id = ? ORDER BY seq""",
        [run_id],
    )
    c1, c2 = "0x7f5128002e10", "0x7f516c002e10"
    assert [(r[0], r[1], r[2], r[3]) for r in got] == [
        ("send", 1, 0x12, c1),
        ("send", 1, 0x14, c1),
        ("send", 1, 0x16, c1),
        ("send", 1, 0x18, c1),
        ("send", 0, 0xD60, c2),
        ("send", 0, 0xD62, c2),
        ("recv", 1, 0xD60, c1),
    ]
    assert {r[4:] for r in got} == {(2420736 * 4, 2420736, 2420736)}


def test_rccl_hang_log_opcounts_and_int8_allgather(data_dir, con):
    run_id = ingest_one(con, data_dir / "nccl-logs" / "rocm-rccl-429.log")
    got = rows(
        con,
        """SELECT process, op, dtype, op_count, msg_bytes, elems_in, elems_out FROM comm_events
                       WHERE run_id = ? ORDER BY process, seq""",
        [run_id],
    )
    assert got == [
        ("h03r3n06:45006", "all_reduce", "float32", 0x28C, 9984512 * 4, 9984512, 9984512),
        ("h03r3n06:45006", "all_reduce", "float32", 0x28D, 8149504 * 4, 8149504, 8149504),
        ("h03r3n06:45012", "all_gather", "int8", 0x28C, 59205120 * 4, 59205120, 59205120 * 4),
        ("h03r3n06:45012", "all_gather", "int8", 0x28D, 15360 * 4, 15360, 15360 * 4),
    ]


def test_one_process_driving_two_gpus_is_two_processes(data_dir, con):
    run_id = ingest_one(con, data_dir / "nccl-logs" / "nvidia-nccl-203.log")
    got = rows(
        con,
        """SELECT process, list(op_count ORDER BY seq), list(msg_bytes ORDER BY seq)
                       FROM comm_events WHERE run_id = ? GROUP BY process ORDER BY process""",
        [run_id],
    )
    assert got == [
        ("gpu1:13135/cuda:0", [0x1A, 0x1B, 0x1C], [256, 237184 * 4, 386560 * 4]),
        ("gpu1:13135/cuda:1", [0x1A, 0x1B, 0x1C, 0x1D], [256, 237184 * 4, 386560 * 4, 8192 * 4]),
    ]


def test_tuning_lines_of_the_2_20_format(data_dir, con):
    run_id = ingest_one(con, data_dir / "nccl-logs" / "nvidia-nccl-1595.log")
    got = rows(
        con, "SELECT host, pid, op, bytes, algo, proto, time_us, channels FROM nccl_tuning WHERE run_id = ?", [run_id]
    )
    assert got == [(None, None, None, 805306368, "RING", "SIMPLE", 3970.683594, None)] * 10


def test_init_start_lines_with_commid_link_into_one_world(data_dir, con):
    run_id = ingest_one(con, data_dir / "nccl-logs" / "nvidia-nccl-tests-252.log")
    got = rows(
        con,
        """SELECT host, pid, cuda_dev, nvml_dev, bus_id, comm_rank, nranks, global_rank, api, comm_id,
                              group_key FROM nccl_comms WHERE run_id = ? ORDER BY comm_rank""",
        [run_id],
    )
    assert [(r[0], r[1], r[2], r[4], r[5], r[7]) for r in got] == [
        ("kolyoz1", 27255, 0, "42000", 0, 0),
        ("kolyoz1", 27223, 1, "55000", 1, 1),
        ("kolyoz2", 25146, 0, "42000", 4, 4),
        ("kolyoz2", 25172, 1, "55000", 5, 5),
        ("kolyoz2", 25169, 2, "d4000", 6, 6),
        ("kolyoz2", 25148, 3, "e6000", 7, 7),
    ]
    assert {(r[6], r[8], r[9], r[10]) for r in got} == {
        (8, "ncclCommInitRank", "0x996ee6f117cb8e1e", "nccl:0x996ee6f117cb8e1e")
    }
    # ranks 2 and 3 are missing from the excerpt: the group's rank list stays unknown
    assert rows(con, "SELECT size, ranks, origin FROM process_groups WHERE run_id = ?", [run_id]) == [
        (8, None, "nccl_init")
    ]


def test_busid_init_complete_lines_of_multi_gpu_processes(data_dir, con):
    run_id = ingest_one(con, data_dir / "nccl-logs" / "nvidia-nccl-629.log")
    got = rows(
        con,
        """SELECT host, cuda_dev, comm_rank, global_rank, bus_id, comm_id, group_key FROM nccl_comms
                       WHERE run_id = ? ORDER BY comm_rank""",
        [run_id],
    )
    assert [(r[1], r[2], r[3], r[4]) for r in got] == [
        (2, 2, 2, "64000"),
        (4, 4, 4, "a2000"),
        (5, 5, 5, "a7000"),
        (0, 8, 8, "25000"),
        (1, 9, 9, "2b000"),
        (4, 12, 12, "a2000"),
        (6, 14, 14, "e1000"),
        (7, 15, 15, "e7000"),
    ]
    assert {(r[5], r[6]) for r in got} == {(None, "nccl:n16#0")}
    # channel-count lines of two init threads whose Init COMPLETE is not in the excerpt
    assert rows(
        con, "SELECT kind, count(*), count(comm_ptr) FROM nccl_topology WHERE run_id = ? GROUP BY kind", [run_id]
    ) == [("channels", 2, 0)]


def test_nranks_lines_trees_and_global_ranks(data_dir, con):
    run_id = ingest_one(con, data_dir / "nccl-logs" / "nvidia-nccl-1357.log")
    assert rows(
        con,
        "SELECT pid, comm_rank, nranks, global_rank, group_key FROM nccl_comms WHERE run_id = ? ORDER BY pid",
        [run_id],
    ) == [(39634, 13, 16, 13, "nccl:n16#0"), (39635, 14, 16, 14, "nccl:n16#0")]
    trees = rows(
        con,
        """SELECT pid, channel, ranks, comm_ptr, group_key FROM nccl_topology
                         WHERE run_id = ? AND kind = 'tree' ORDER BY pid, channel""",
        [run_id],
    )
    assert len(trees) == 32
    assert trees[10][:3] == (39633, 10, [14, 4, -1, 12, -1])
    # pid 39634's Trees line follows its "comm ... nRanks" line, so it belongs to that communicator
    assert {t[3:] for t in trees if t[0] == 39634} == {("0x5558e3c10180", "nccl:n16#0")}
    assert rows(con, "SELECT detail FROM nccl_topology WHERE run_id = ? AND kind = 'nodes' ORDER BY pid", [run_id]) == [
        ("nNodes 2 localRanks 8 localRank 5 MNNVL 0",),
        ("nNodes 2 localRanks 8 localRank 6 MNNVL 0",),
    ]


def test_mpirun_prefix_rings_cut_at_20_ranks_and_nvls_heads(data_dir, con):
    run_id = ingest_one(con, data_dir / "nccl-logs" / "nvidia-nccl-1453-turn0.log")
    rings = rows(
        con,
        """SELECT channel, ranks, detail, comm_ptr FROM nccl_topology
                         WHERE run_id = ? AND kind = 'ring' ORDER BY channel""",
        [run_id],
    )
    assert [r[0] for r in rings] == [0, 1]
    assert rings[1][1] == [0, 7, 6, 5, 4, 3, 2, 9, 8, 15, 14, 13, 12, 11, 10, 17, 16, 23, 22, 21]
    assert rings[0][2].endswith("(NCCL printed only the first 20 of 24 ranks)")
    assert {r[3] for r in rings} == {"0x5639e9f0e8c0"}
    heads = rows(
        con, "SELECT channel, ranks FROM nccl_topology WHERE run_id = ? AND kind = 'nvls_head' ORDER BY 1", [run_id]
    )
    assert heads[0] == (0, [0, 8, 16]) and heads[7] == (7, [7, 15, 23]) and len(heads) == 8
    assert rows(con, "SELECT comm_rank, nranks, global_rank FROM nccl_comms WHERE run_id = ?", [run_id]) == [(0, 24, 0)]


def test_pre_2_8_double_trees(data_dir, con):
    run_id = ingest_one(con, data_dir / "nccl-logs" / "aws-aws-ofi-nccl-65.log")
    trees = rows(
        con, "SELECT pid, channel, ranks, detail FROM nccl_topology WHERE run_id = ? ORDER BY pid, channel", [run_id]
    )
    assert len(trees) == 16
    assert trees[6] == (3915, 6, [14, 4, -1, 13, 12], "[6] 14/4/-1->13->12|12->13->14/4/-1")
    assert trees[15] == (3917, 7, [8, 6, -1, 15, 14], "[7] 8/6/-1->15->14|14->15->8/6/-1")


def test_connection_transports(data_dir, con):
    net = ingest_one(con, data_dir / "nccl-logs" / "nvidia-nccl-429.log")
    assert rows(
        con,
        """SELECT transport, src_rank, dst_rank, count(*) FROM nccl_topology
                        WHERE run_id = ? AND kind = 'connection' GROUP BY ALL ORDER BY ALL""",
        [net],
    ) == [
        ("NET/IB/0/GDRDMA", 14, 6, 3),
        ("P2P/direct pointer", 8, 10, 1),
        ("P2P/direct pointer", 9, 11, 2),
    ]
    # old-format channel counts are printed before Init COMPLETE on the same thread
    assert rows(
        con,
        """SELECT n.comm_rank, n.cuda_dev, n.bus_id FROM nccl_topology t JOIN nccl_comms n
                        ON n.run_id = t.run_id AND n.pid = t.pid AND n.comm_ptr = t.comm_ptr
                        WHERE t.run_id = ? AND t.kind = 'channels' ORDER BY 1""",
        [net],
    ) == [(4, 4, "88000"), (5, 5, "89000")]
    shm = ingest_one(con, data_dir / "nccl-logs" / "huggingface-accelerate-3240.log")
    got = rows(
        con,
        """SELECT pid, channel, src_rank, dst_rank, transport, group_key FROM nccl_topology
                       WHERE run_id = ? AND kind = 'connection' ORDER BY pid, channel""",
        [shm],
    )
    assert got == [
        (1157794, 0, 0, 1, "SHM/direct/direct", "nccl:n2#0"),
        (1157794, 1, 0, 1, "SHM/direct/direct", "nccl:n2#0"),
        (1157795, 0, 1, 0, "SHM/direct/direct", None),
        (1157795, 1, 1, 0, "SHM/direct/direct", None),
    ]
    assert rows(con, "SELECT kind, count(*) FROM nccl_topology WHERE run_id = ? GROUP BY 1 ORDER BY 1", [shm]) == [
        ("channels", 1),
        ("connection", 4),
        ("nodes", 1),
        ("ring", 2),
        ("tree", 2),
    ]
    p2p = ingest_one(con, data_dir / "nccl-logs" / "nvidia-nccl-671.log")
    assert rows(con, "SELECT DISTINCT transport, pid FROM nccl_topology WHERE run_id = ?", [p2p]) == [
        ("P2P/direct pointer", 60725)
    ]
    assert rows(con, "SELECT count(*) FROM nccl_topology WHERE run_id = ?", [p2p]) == [(16,)]


def test_fixed_width_rings_of_2_8_to_2_22(data_dir, con):
    run_id = ingest_one(con, data_dir / "nccl-logs" / "nvidia-nccl-634.log")
    rings = rows(
        con, "SELECT channel, ranks FROM nccl_topology WHERE run_id = ? AND kind = 'ring' ORDER BY 1", [run_id]
    )
    assert rings == [
        (8, [0, 3, 1, 6, 4, 7, 5, 10, 8, 11, 9, 14, 12, 15, 13, 2]),
        (9, [0, 6, 5, 7, 4, 10, 9, 11, 8, 14, 13, 15, 12, 2, 1, 3]),
    ]
    assert rows(con, "SELECT count(*) FROM nccl_topology WHERE run_id = ? AND kind = 'tree'", [run_id]) == [(40,)]


def test_versions_bare_and_driver(data_dir, con):
    expect = {
        "pytorch-pytorch-54232.log": ("2.7.8", "10.2", None),
        "huggingface-transformers-15618.log": ("2.10.3", "11.3", None),
        "pytorch-pytorch-131781.log": ("2.18.1", "12.1", 12040),
    }
    for name, (version, cuda, driver) in expect.items():
        meta, _ = source_meta(con, ingest_one(con, data_dir / "nccl-logs" / name))
        assert (meta.get("nccl_version"), meta.get("cuda_version"), meta.get("cuda_driver_version")) == (
            version,
            cuda,
            driver,
        ), name
    meta, _ = source_meta(con, ingest_one(con, data_dir / "nccl-logs" / "huggingface-transformers-22363.log"))
    assert meta["nccl_lines"] == 13 and "nccl_version" not in meta


# --------------------------------------------------------------------------------- synthetic jobs

# A 4-rank job: two processes, each driving two GPUs. Global rank g = 2 * process + device.
PROCS = [("nodeA", 100), ("nodeB", 200)]


def _ptr(g: int, k: int) -> str:
    return f"0x7f{g}{k}0000"


def _line(g: int, msg: str) -> str:
    host, pid = PROCS[g // 2]
    return f"{host}:{pid}:{pid + 10 + g % 2} [{g % 2}] NCCL INFO {msg}\n"


def _coll(name: str, opc: int, count: int, dt: int, root: int, comm: str, nranks: int) -> str:
    recv = "(nil)" if name == "Send" else "0x7e00"
    send = "(nil)" if name == "Recv" else "0x7d00"
    return (
        f"{name}: opCount {opc:x} sendbuff {send} recvbuff {recv} count {count} datatype {dt} op 0 "
        f"root {root} comm {comm} [nranks={nranks}] stream 0x5600"
    )


def job_lines(g: int, form: str) -> list[str]:
    """Lines of global rank g: world init, a TP split (color g // 2) and a PP split (color g % 2), then
    an all-reduce on the world, an all-gather on TP and a send (first stage) or recv (second stage) on PP."""
    dev = g % 2
    out = []
    if form in ("2.29",):
        out.append(
            _line(
                g,
                f"[Rank {g}] ncclCommInitRank comm {_ptr(g, 0)} rank {g} nranks 4 cudaDev {dev} "
                f"nvmlDev {dev} busId {dev}1000 commId 0xaaa - Init START",
            )
        )
    out.append(
        _line(
            g,
            f"ncclCommInitRank comm {_ptr(g, 0)} rank {g} nranks 4 cudaDev {dev} nvmlDev {dev} "
            f"busId {dev}1000 commId 0xaaa - Init COMPLETE",
        )
    )
    splits = [(1, g // 2, g % 2, "b"), (2, g % 2, g // 2, "c")]  # (comm, color, comm rank, commId prefix)
    for n, (k, color, crank, cid) in enumerate(splits):
        base = (
            f"ncclCommSplit comm {_ptr(g, k)} rank {crank} nranks 2 cudaDev {dev} nvmlDev {dev} "
            f"busId {dev}1000 parent {_ptr(g, 0)}"
        )
        if form == "2.21":
            out.append(_line(g, f"{base} color {color} key {g} commId 0x{cid}{color}0 - Init COMPLETE"))
        elif form == "2.23":
            out.append(_line(g, f"{base} color {color} key {g} - Init COMPLETE"))
        elif form == "2.29":
            out.append(_line(g, f"{base} childCount {n + 1} color {color} key {g} - Init COMPLETE"))
    out.append(_line(g, _coll("AllReduce", 0, 1024, 7, 0, _ptr(g, 0), 4)))
    out.append(_line(g, _coll("AllGather", 0, 256, 9, 0, _ptr(g, 1), 2)))
    if g < 2:
        out.append(_line(g, _coll("Send", 0, 100, 7, 1, _ptr(g, 2), 2)))
    else:
        out.append(_line(g, _coll("Recv", 0, 100, 7, 0, _ptr(g, 2), 2)))
    return out


def write_job(tmp_path: Path, form: str) -> list[Path]:
    """Two per-process files (NCCL_DEBUG_FILE=nccl.%h.%p), each with the interleaved lines of its 2 GPUs."""
    paths = []
    for i, (host, pid) in enumerate(PROCS):
        a, b = job_lines(2 * i, form), job_lines(2 * i + 1, form)
        text = "".join(x + y for x, y in zip(a, b, strict=False))
        path = tmp_path / f"nccl.{host}.{pid}"
        path.write_text(text)
        paths.append(path)
    return paths


def check_linked_job(con, run_id: int, split_keys: list[str]) -> None:
    tp0, tp1, pp0, pp1 = split_keys
    groups = {
        k: (size, ranks)
        for k, size, ranks in rows(con, "SELECT group_key, size, ranks FROM process_groups WHERE run_id = ?", [run_id])
    }
    assert groups == {
        "nccl:0xaaa": (4, [0, 1, 2, 3]),
        tp0: (2, [0, 1]),
        tp1: (2, [2, 3]),
        pp0: (2, [0, 2]),
        pp1: (2, [1, 3]),
    }
    comms = rows(
        con, "SELECT host, cuda_dev, comm_ptr, global_rank, group_key FROM nccl_comms WHERE run_id = ?", [run_id]
    )
    assert len(comms) == 12
    for host, dev, ptr, grank, _key in comms:
        assert grank == 2 * [p[0] for p in PROCS].index(host) + dev
        assert ptr == _ptr(grank, int(ptr[5]))
    events = rows(
        con,
        """SELECT process, rank, op, peer, group_key, msg_bytes FROM comm_events
                          WHERE run_id = ? ORDER BY rank, seq""",
        [run_id],
    )
    assert events == [
        ("nodeA:100/cuda:0", 0, "all_reduce", None, "nccl:0xaaa", 4096),
        ("nodeA:100/cuda:0", 0, "all_gather", None, tp0, 1024),
        ("nodeA:100/cuda:0", 0, "send", 2, pp0, 400),
        ("nodeA:100/cuda:1", 1, "all_reduce", None, "nccl:0xaaa", 4096),
        ("nodeA:100/cuda:1", 1, "all_gather", None, tp0, 1024),
        ("nodeA:100/cuda:1", 1, "send", 3, pp1, 400),
        ("nodeB:200/cuda:0", 2, "all_reduce", None, "nccl:0xaaa", 4096),
        ("nodeB:200/cuda:0", 2, "all_gather", None, tp1, 1024),
        ("nodeB:200/cuda:0", 2, "recv", 0, pp0, 400),
        ("nodeB:200/cuda:1", 3, "all_reduce", None, "nccl:0xaaa", 4096),
        ("nodeB:200/cuda:1", 3, "all_gather", None, tp1, 1024),
        ("nodeB:200/cuda:1", 3, "recv", 1, pp1, 400),
    ]


SPLIT_KEYS = {
    "2.21": ["nccl:0xb00", "nccl:0xb10", "nccl:0xc00", "nccl:0xc10"],
    # no commId: parent's key + n-th split of that parent + color (colors 0/1 are reused by both splits)
    "2.23": [
        "nccl:0xaaa/split0:color0",
        "nccl:0xaaa/split0:color1",
        "nccl:0xaaa/split1:color0",
        "nccl:0xaaa/split1:color1",
    ],
    # the split counter printed by NCCL
    "2.29": [
        "nccl:0xaaa/split1:color0",
        "nccl:0xaaa/split1:color1",
        "nccl:0xaaa/split2:color0",
        "nccl:0xaaa/split2:color1",
    ],
}


@pytest.mark.parametrize("form", ["2.21", "2.23", "2.29"])
def test_two_per_process_files_link_groups_ranks_and_peers(tmp_path, con, form):
    paths = write_job(tmp_path, form)
    summary = ingest_paths(con, paths, "job")
    assert [f.status for f in summary.files] == ["ok", "ok"]
    run_id = store.get_run_id(con, "job")
    check_linked_job(con, run_id, SPLIT_KEYS[form])
    # linking again changes nothing (peers are not translated twice)
    before = rows(con, "SELECT * FROM comm_events ORDER BY source_id, seq, process")
    con.execute("BEGIN")
    link_run(con, run_id)
    con.execute("COMMIT")
    assert rows(con, "SELECT * FROM comm_events ORDER BY source_id, seq, process") == before


def test_files_arriving_in_separate_batches_link_the_same(tmp_path, con):
    a, b = write_job(tmp_path, "2.23")
    ingest_paths(con, [a], "job")
    run_id = store.get_run_id(con, "job")
    # alone, process A knows its world ranks but not who its PP peers are globally
    assert rows(con, "SELECT rank, peer FROM comm_events WHERE run_id = ? AND op = 'send' ORDER BY rank", [run_id]) == [
        (0, 1),
        (1, 1),
    ]
    ingest_paths(con, [b], "job")
    check_linked_job(con, run_id, SPLIT_KEYS["2.23"])


def test_interleaved_stdout_of_four_processes_without_commid(tmp_path, con):
    """Old (2.8-2.15) lines: no commId, no split lines. Two 2-rank communicators of each layout are told apart."""
    lines = ["NCCL version 2.10.3+cuda11.3\n"]
    tp = {0: 0, 1: 1, 2: 0, 3: 1}  # contiguous pairs {0,1} {2,3}: comm rank
    pp = {0: 0, 1: 0, 2: 1, 3: 1}  # strided pairs {0,2} {1,3}
    for comm, rank_of in (("a", {g: g for g in range(4)}), ("b", tp), ("c", pp)):
        lines.extend(
            f"host{g // 2}:{500 + g}:{600 + g} [{g % 2}] NCCL INFO comm 0x{g}{comm} rank {rank_of[g]} "
            f"nranks {4 if comm == 'a' else 2} cudaDev {g % 2} busId {g}000 - Init COMPLETE\n"
            for g in range(4)
        )
    for g in (2, 0, 3, 1):
        peer = 1 - pp[g]
        lines.append(
            f"host{g // 2}:{500 + g}:{700 + g} [{g % 2}] NCCL INFO "
            + _coll("Send" if pp[g] == 0 else "Recv", 5, 8, 8, peer, f"0x{g}c", 2)
            + "\n"
        )
    path = tmp_path / "stdout.log"
    path.write_text("".join(lines))
    run_id = ingest_one(con, path, "stdout")
    groups = rows(con, "SELECT group_key, ranks FROM process_groups WHERE run_id = ? ORDER BY 1", [run_id])
    assert groups == [
        ("nccl:n2#0.0", [0, 1]),
        ("nccl:n2#0.1", [2, 3]),
        ("nccl:n2#1.0", [0, 2]),
        ("nccl:n2#1.1", [1, 3]),
        ("nccl:n4#0", [0, 1, 2, 3]),
    ]
    assert rows(
        con, "SELECT process, rank, op, peer, group_key FROM comm_events WHERE run_id = ? ORDER BY rank", [run_id]
    ) == [
        ("host0:500", 0, "send", 2, "nccl:n2#1.0"),
        ("host0:501", 1, "send", 3, "nccl:n2#1.1"),
        ("host1:502", 2, "recv", 0, "nccl:n2#1.0"),
        ("host1:503", 3, "recv", 1, "nccl:n2#1.1"),
    ]
    assert rows(con, "SELECT DISTINCT nccl_version FROM nccl_comms WHERE run_id = ?", [run_id]) == [("2.10.3",)]


def test_missing_peer_files_leave_peers_as_communicator_ranks(tmp_path, con):
    a, _ = write_job(tmp_path, "2.21")
    run_id = ingest_one(con, a, "half")
    got = rows(
        con, "SELECT rank, op, peer, group_key FROM comm_events WHERE run_id = ? AND op = 'send' ORDER BY 1", [run_id]
    )
    assert got == [(0, "send", 1, "nccl:0xc00"), (1, "send", 1, "nccl:0xc10")]
    assert rows(con, "SELECT group_key, ranks FROM process_groups WHERE run_id = ? ORDER BY 1", [run_id]) == [
        ("nccl:0xaaa", None),
        ("nccl:0xb00", [0, 1]),
        ("nccl:0xc00", None),
        ("nccl:0xc10", None),
    ]


# ------------------------------------------------------------------------------ lines and damage


OK_COLL = (
    "AllReduce: opCount 3 sendbuff 0x1 recvbuff 0x2 count 10 datatype 7 op 0 root 0 comm 0xc1 [nranks=2] stream 0x9"
)


def test_foreign_prefixes_and_line_endings():
    body = "\n".join(
        [
            f"h1:11:12 [0] NCCL INFO {OK_COLL}",
            f"> > > h1:11:12 [0] NCCL INFO {OK_COLL}  ",
            f"2025-07-25 19:54:57.101122 h1:11:12 [0] NCCL INFO {OK_COLL}",
            f"[2026-04-28 14:14:42] h1:11:12 [0] NCCL INFO {OK_COLL}",
            f"(RayTrainWorker pid=11, ip=10.0.0.1) h1:11:12 [0] NCCL INFO {OK_COLL} task 3 globalrank 5",
            f"h1:11:12 [0] NCCL INFO {OK_COLL}\r",
            "[0] h1:11:12 [0] NCCL INFO NCCL version 2.22.3+cuda12.6",
            f"[1] NCCL INFO {OK_COLL}",  # a paste that kept only the [cudaDev] part
            "",
            "h1:11:12 [0] transport/net.cc:821 NCCL WARN NET/IB : Got completion with error 12",
        ]
    ).encode()
    res = parse(body)
    assert [(e["process"], e["seq"], e["msg_bytes"], e["op_count"]) for e in res.events] == [
        ("h1:11", i, 40, 3) for i in range(6)
    ] + [("unknown/cuda:1", 0, 40, 3)]
    assert res.meta["nccl_version"] == "2.22.3" and res.meta["cuda_version"] == "12.6"
    assert res.meta["nccl_warn_lines"] == 1
    assert res.meta["nccl_warnings"] == ["NET/IB : Got completion with error 12"]
    assert not res.skipped and not res.warnings


def test_garbled_lines_recover_what_parses_and_count_the_rest():
    lines = [
        "# header line naming the issue, mentions NCCL INFO and opCount",
        "h1:11:12 [0] NCCL INFO comm 0xc1 rank 0 nranks 2 cudaDev 0 busId 1000 - Init COMPLETE",
        # a COLL line cut by another writer's line
        "h1:11:12 [0] NCCL INFO AllReduce: opCount 4 sendbuff 0x1 recvbuff 0x2 count 1h1:11:13 [0] NCCL INFO "
        + OK_COLL.replace("opCount 3", "opCount 5"),
        # the prefix was lost: attributed through the comm pointer
        OK_COLL.replace("opCount 3", "opCount 6"),
        # a prefix-less COLL line of an unknown communicator
        OK_COLL.replace("comm 0xc1", "comm 0xdead"),
        # the [dev] part is missing
        "h1:11:12 NCCL INFO Channel 00/02 :    0   1",
        # a message cut in the middle, then a full INFO line glued after it
        "h1:11:12 [0] NCCL INFO Bootstrap : Usih1:11:12 [0] NCCL INFO NET/IB : No device found.",
        "Some prose between the lines, opCount 7 at rank 0",
        "h1:11:12 [0] NCCL INFO PutSignal: opCount 8 sendbuff 0x1 recvbuff (nil) count 1 datatype 7 op 0 root 1 "
        "comm 0xc1 [nranks=2] stream 0x9",
        "h1:11:12 [0] NCCL INFO " + OK_COLL.replace("datatype 7", "datatype 42").replace("opCount 3", "opCount 9"),
    ]
    res = parse("\n".join(lines).encode())
    assert [(e["process"], e["op_count"], e["dtype"], e["msg_bytes"], e["elems_in"]) for e in res.events] == [
        ("h1:11", 5, "float32", 40, 10),
        ("h1:11", 6, "float32", 40, 10),
        ("h1:11", 9, None, None, 10),
    ]
    assert dict(res.skipped) == {
        "COLL line cut or garbled": 1,
        "COLL line without its host:pid:tid [dev] prefix (comm pointer not seen elsewhere)": 1,
        "NCCL INFO line without a '[dev] NCCL INFO' prefix (garbled)": 1,
        "message cut by another writer's output": 1,
        "one-sided PutSignal operation, not a collective (not counted)": 1,
    }
    assert "t.log:line 3: skipped: COLL line cut or garbled (first of 1)" in res.warnings
    assert any("unknown NCCL datatype 42" in w and "line 10" in w for w in res.warnings)
    assert len(res.nccl_comms) == 1 and res.nccl_comms[0]["host"] == "h1"


def test_overlong_line_is_skipped_without_crashing(tmp_path, con):
    limits = Limits(max_line_bytes=1 << 20)
    path = tmp_path / "long.log"
    with open(path, "wb") as f:
        f.write(f"h1:11:12 [0] NCCL INFO {OK_COLL}\n".encode())
        f.write(b"h1:11:12 [0] NCCL INFO " + b"x" * (20 << 20) + b"\n")
        f.write(f"h1:11:12 [0] NCCL INFO {OK_COLL.replace('opCount 3', 'opCount 4')}\n".encode())
        f.write(b"y" * (3 << 20))  # and one more at the very end, without a newline
    summary = ingest_paths(con, [path], "long", limits=limits)
    assert [f.status for f in summary.files] == ["ok"]
    assert summary.files[0].skipped == {f"line longer than {1 << 20} bytes": 2}
    assert rows(con, "SELECT op_count FROM comm_events ORDER BY seq") == [(3,), (4,)]
    assert summary.files[0].warnings == [f"{path}:line 2: skipped: line longer than 1048576 bytes (first of 2)"]
    # lines just under the limit, crossing read blocks, are kept
    res = parse(b"a" * 1000 + b"\n" + f"h1:11:12 [0] NCCL INFO {OK_COLL}".encode(), Limits(max_line_bytes=300))
    assert dict(res.skipped) == {"line longer than 300 bytes": 1} and len(res.events) == 1
    assert res.warnings == ["t.log:line 1: skipped: line longer than 300 bytes (first of 1)"]


def test_invalid_utf8_is_replaced():
    data = b"\n".join(
        [
            b"h1:11:12 [0] NCCL INFO Bootstrap : Using \xff\xfeeth0",
            b"h1:11:12 [0] NCCL INFO AllReduce: opCount 1 sendbuff 0x\xff recvbuff 0x2 count 4 datatype 9 op 0 root 0 "
            b"comm 0xc1 [nranks=2] stream 0x9",
            b"h\xc3\xa9:11:12 [0] NCCL INFO Channel 00 : 0[0] -> 1[1] via P2P/\xffIPC",
            b"\xff\xff prose \xc3",
        ]
    )
    res = parse(data)
    assert [(e["process"], e["dtype"], e["msg_bytes"]) for e in res.events] == [("h1:11", "bfloat16", 8)]
    assert [(t["host"], t["transport"]) for t in res.topology] == [("h\u00e9", "P2P/\ufffdIPC")]
    assert not res.skipped


def test_fast_and_line_paths_give_the_same_rows():
    from commlens.ingest.nccl_log import _Parser

    names = [
        ("AllReduce", 7),
        ("AllGather", 9),
        ("ReduceScatter", 6),
        ("Broadcast", 4),
        ("Reduce", 8),
        ("Send", 0),
        ("Recv", 1),
        ("AlltoAll", 7),
        ("Gather", 10),
        ("Scatter", 11),
    ]
    text = ["h1:11:12 [0] NCCL INFO " + _coll(n, i, 100 + i, dt, i % 3, "0xc1", 3) for i, (n, dt) in enumerate(names)]
    fast = _Parser("t", RankHint())
    fast.block("\n".join(text).encode(), 1)
    slow = _Parser("t", RankHint())
    for i, line in enumerate(text):
        slow.line(line, i + 1)
    assert fast.res.events == slow.res.events
    got = [(e["op"], e["dtype"], e["msg_bytes"], e["elems_in"], e["elems_out"], e.get("peer")) for e in fast.res.events]
    assert got == [
        ("all_reduce", "float32", 400, 100, 100, None),
        ("all_gather", "bfloat16", 3 * 101 * 2, 101, 303, None),
        ("reduce_scatter", "float16", 3 * 102 * 2, 306, 102, None),
        ("broadcast", "int64", 103 * 8, 103, 103, None),
        ("reduce", "float64", 104 * 8, 104, 104, None),
        ("send", "int8", 105, 105, 105, 2),
        ("recv", "uint8", 106, 106, 106, 0),
        ("all_to_all", "float32", 3 * 107 * 4, 321, 321, None),
        ("gather", "float8_e4m3fn", 3 * 108, 108, 324, None),
        ("scatter", "float8_e5m2", 3 * 109, 327, 109, None),
    ]


def test_tuning_lines_of_2_23_and_2_24():
    res = parse(
        b"\n".join(
            [
                b"h1:11:12 [0] NCCL INFO AllReduce: 4194304 Bytes -> Algo 0 proto 1 time 35.5",
                b"h1:11:12 [0] NCCL INFO AllGather: 8 Bytes -> Algo PAT proto LL channel{Lo..Hi}={0..1}",
                b"h1:11:12 [0] NCCL INFO ReduceScatter: 8 Bytes -> Algo COLLNET_DIRECT proto SIMPLE channel{Lo..Hi}={2..3}",
            ]
        )
    )
    assert [(t["op"], t["bytes"], t["algo"], t["proto"], t["time_us"], t["channels"]) for t in res.tuning] == [
        ("all_reduce", 4194304, "TREE", "LL128", 35.5, None),
        ("all_gather", 8, "PAT", "LL", None, "0..1"),
        ("reduce_scatter", 8, "COLLNET_DIRECT", "SIMPLE", None, "2..3"),
    ]


def test_reused_comm_pointer_is_a_new_communicator(tmp_path, con):
    lines = []
    for g in range(2):
        for cid in ("0x11", "0x22"):
            lines.append(
                f"n:{g}:{g} [0] NCCL INFO ncclCommInitRank comm 0xc1 rank {g} nranks 2 cudaDev 0 nvmlDev 0 "
                f"busId 1000 commId {cid} - Init COMPLETE"
            )
            lines.append(f"n:{g}:{g} [0] NCCL INFO " + OK_COLL)
            lines.append(
                f"n:{g}:{g} [0] NCCL INFO comm 0xc1 rank {g} nranks 2 cudaDev 0 busId 1000 commId {cid} "
                "- Destroy COMPLETE"
            )
    path = tmp_path / "reuse.log"
    path.write_text("\n".join(lines))
    run_id = ingest_one(con, path, "reuse")
    assert rows(
        con, "SELECT process, comm_ptr, group_key, rank FROM comm_events WHERE run_id = ? ORDER BY 1, seq", [run_id]
    ) == [
        ("n:0", "0xc1", "nccl:0x11", 0),
        ("n:0", "0xc1#2", "nccl:0x22", 0),
        ("n:1", "0xc1", "nccl:0x11", 1),
        ("n:1", "0xc1#2", "nccl:0x22", 1),
    ]


def test_file_without_nccl_lines_fails_with_a_reason(tmp_path, con):
    path = tmp_path / "notes.log"
    path.write_text("We saw NCCL hang yesterday.\nNo log attached.\n")
    summary = ingest_paths(con, [path], "bad")
    assert summary.files[0].status == "failed"
    assert (
        summary.files[0].error
        == f"{path}:line 1: not a Kineto JSON trace or an NCCL debug log: no NCCL INFO lines found (not an NCCL_DEBUG=INFO log?)"
    )
    # tried as an NCCL log for want of another kind, it is of no kind commlens reads (it was listed as nccl_log)
    assert con.execute("SELECT kind FROM sources WHERE path = ?", [str(path)]).fetchall() == [("unknown",)]


def test_hint_rank_of_a_single_process_file():
    res = parse(f"h1:11:12 [0] NCCL INFO {OK_COLL}\n".encode(), hint=RankHint(rank=5))
    assert res.rank == 5 and res.events[0]["rank"] == 5


@pytest.mark.timeout(120)
def test_long_hostile_lines_parse_in_linear_time():
    """Lines of a few MB built to make a backtracking regex quadratic (runs of one character class)."""
    n = 1 << 20
    data = b"\n".join(
        [
            b"a" * n + b" NCCL INFO x",
            b"h:1:1 [0] NCCL INFO " + b"a" * n + b" - Init COMPLETE",
            b"h:1:1 [0] NCCL INFO NVLS Trees : " + b"1" * n + b"/",
            b"b" * n + b": opCount",
            b"1:" * (n // 2) + b" NCCL INFO",
            b"h:1:1 [0] NCCL INFO Channel 00/02 :" + b" 1" * (n // 2) + b"x",
            b"[0] NCCL INFO NCCL version 2.1.1+" + b"c" * n + b" z",
            f"h:1:1 [0] NCCL INFO {OK_COLL}".encode(),
        ]
    )
    res = parse(data)
    assert [e["op_count"] for e in res.events] == [3]
    assert dict(res.skipped) == {"NCCL INFO line without a '[dev] NCCL INFO' prefix (garbled)": 2}


def test_init_line_forms_of_every_generation():
    forms = [
        "comm 0x1 rank 0 nranks 2 cudaDev 0 nvmlDev 3 - Init COMPLETE",  # 2.4
        "comm 0x2 rank 1 nranks 2 cudaDev 0 busId 7000 - Init COMPLETE",  # 2.5-2.16.1
        "comm 0x3 rank 0 nranks 2 cudaDev 0 busId e7000 commId 0x5f - Init COMPLETE",  # 2.16.2
        "comm 0x4 rank 0 nranks 2 cudaDev 0 nvmlDev 2 busId 1000 commId 0x6f - Init START",  # 2.18.3 START ...
        "comm 0x4 rank 0 nranks 2 cudaDev 0 nvmlDev 2 busId 1000 commId 0x6f - Init COMPLETE",  # ... merged
        "ncclCommInitRankConfig comm 0x5 rank 0 nranks 2 cudaDev 0 nvmlDev 0 busId 1000 commId 0x7f - Init COMPLETE",
        "ncclCommSplit comm 0x6 rank 0 nranks 1 cudaDev 0 nvmlDev 0 busId 1000 parent 0x5 color 3 key 0 "
        "commId 0x8f - Init COMPLETE",  # 2.21
        "ncclCommSplit comm 0x7 rank 0 nranks 1 cudaDev 0 nvmlDev 0 busId 1000 parent 0x5 color 4 key 1 "
        "- Init COMPLETE",  # 2.23
        "ncclCommSplit comm 0x8 rank 0 nranks 1 cudaDev 0 nvmlDev 0 busId 1000 parent 0x5 splitCount 3 color 5 "
        "key 2 - Init COMPLETE",  # 2.24
        "[Rank 0] ncclCommInitRankScalable comm 0x9 rank 0 nranks 2 cudaDev 0 nvmlDev 0 busId 1000 commId 0x9f "
        "- Init START",  # 2.29
        "ncclCommSplit comm 0xa rank 0 nranks 1 cudaDev 0 nvmlDev 0 busId 1000 commId 0xaf parent 0x9 childCount 1 "
        "color 6 key 3 - Init COMPLETE",  # newest
    ]
    res = parse("".join(f"h:7:8 [0] NCCL INFO {f}\n" for f in forms).encode())
    cols = (
        "comm_ptr",
        "comm_rank",
        "cuda_dev",
        "nvml_dev",
        "bus_id",
        "comm_id",
        "parent_ptr",
        "color",
        "split_key",
        "api",
        "group_key",
    )
    got = [tuple(r[c] for c in cols) for r in res.nccl_comms]
    assert got == [
        ("0x1", 0, 0, 3, None, None, None, None, None, None, "nccl:ptr:h:7:0x1:n2"),
        ("0x2", 1, 0, None, "7000", None, None, None, None, None, "nccl:ptr:h:7:0x2:n2"),
        ("0x3", 0, 0, None, "e7000", "0x5f", None, None, None, None, "nccl:0x5f"),
        ("0x4", 0, 0, 2, "1000", "0x6f", None, None, None, None, "nccl:0x6f"),
        ("0x5", 0, 0, 0, "1000", "0x7f", None, None, None, "ncclCommInitRankConfig", "nccl:0x7f"),
        ("0x6", 0, 0, 0, "1000", "0x8f", "0x5", 3, 0, "ncclCommSplit", "nccl:0x8f"),
        ("0x7", 0, 0, 0, "1000", None, "0x5", 4, 1, "ncclCommSplit", "nccl:ptr:h:7:0x7:n1"),
        ("0x8", 0, 0, 0, "1000", None, "0x5", 5, 2, "ncclCommSplit", "nccl:ptr:h:7:0x8:n1"),
        ("0x9", 0, 0, 0, "1000", "0x9f", None, None, None, "ncclCommInitRankScalable", "nccl:0x9f"),
        ("0xa", 0, 0, 0, "1000", "0xaf", "0x9", 6, 3, "ncclCommSplit", "nccl:0xaf"),
    ]
    assert res.meta["split_counts"] == {"h:7:0x8": 3, "h:7:0xa": 1}
    assert res.rank == 0 and res.world_size == 2


def test_topology_line_forms():
    lines = [
        "comm 0xc1 rank 0 nRanks 4 nNodes 1 localRanks 4 localRank 0 MNNVL 0",
        "Channel 00/24 : 0 1 2 3",
        "Trees [0] 1/-1/-1->0->-1 [1] 2/-1/-1->0->-1",
        "NVLS Trees : 1/2/-1->0->-1 3/-1/-1->0->-1",
        "Channel 00/0 : 0[6000] -> 1[7000] via P2P/IPC",
        "Channel 01/1 : 0[0] -> 3[3] [send] via NET/IB/0(1)/GDRDMA/Shared",
        "Channel 02/0 : 3[3] -> 0[0] [receive] via NET/Socket/0 comm 0xc1 nRanks 04",
        "4 coll channels, 4 collnet channels, 2 nvls channels, 8 p2p channels, 2 p2p channels per peer",
        "Connected all rings, use ring PXN 0 GDR 1",
        "ncclCommInitRank comm 0xc1 rank 0 nranks 4 cudaDev 0 nvmlDev 0 busId 1000 commId 0xfe - Init COMPLETE",
        "Channel 00/02 :    0   1",  # after COMPLETE, before any new init: no communicator known
    ]
    res = parse("".join(f"h:7:8 [0] NCCL INFO {x}\n" for x in lines).encode())
    got = [
        (t["kind"], t["channel"], t["ranks"], t["src_rank"], t["dst_rank"], t["transport"], t["comm_ptr"])
        for t in res.topology
    ]
    assert got == [
        ("nodes", None, None, 0, None, None, "0xc1"),
        ("ring", 0, [0, 1, 2, 3], None, None, None, "0xc1"),
        ("tree", 0, [1, -1, -1, 0, -1], None, None, None, "0xc1"),
        ("tree", 1, [2, -1, -1, 0, -1], None, None, None, "0xc1"),
        ("nvls_tree", 0, [1, 2, -1, 0, -1], None, None, None, "0xc1"),
        ("nvls_tree", 1, [3, -1, -1, 0, -1], None, None, None, "0xc1"),
        ("connection", 0, None, 0, 1, "P2P/IPC", "0xc1"),
        ("connection", 1, None, 0, 3, "NET/IB/0(1)/GDRDMA/Shared", "0xc1"),
        ("connection", 2, None, 3, 0, "NET/Socket/0", "0xc1"),
        ("channels", None, None, None, None, None, "0xc1"),
        ("ring", 0, [0, 1], None, None, None, None),
    ]
    assert res.topology[0]["detail"] == "nNodes 1 localRanks 4 localRank 0 MNNVL 0"
    assert len(res.nccl_comms) == 1 and res.nccl_comms[0]["comm_id"] == "0xfe"


def test_log_of_only_overlong_lines_fails_naming_the_skips():
    from commlens.ingest.records import ParseError

    with pytest.raises(ParseError) as err:
        parse(b"h:1:1 [0] NCCL INFO " + b"x" * 1000, Limits(max_line_bytes=100))
    assert str(err.value) == (
        "line 1: not a Kineto JSON trace or an NCCL debug log: no NCCL INFO lines found (not an NCCL_DEBUG=INFO log?); skipped 1: line longer than 100 bytes"
    )


def test_splits_with_hashed_colors_where_non_members_sit_out(tmp_path, con):
    """PyTorch-style new_group via ncclCommSplit (2.23 lines, no commId): the color is a hash of the member
    list and non-members pass NCCL_SPLIT_NOCOLOR, so they print nothing for that split."""
    groups = [([0, 1], 111), ([1, 2], 222), ([0, 3], 333)]
    lines = [
        f"n{g}:{g}:{g} [0] NCCL INFO ncclCommInitRank comm 0x{g}0 rank {g} nranks 4 cudaDev 0 "
        f"nvmlDev 0 busId 1000 commId 0xaaa - Init COMPLETE"
        for g in range(4)
    ]
    for k, (members, color) in enumerate(groups, 1):
        lines.extend(
            f"n{g}:{g}:{g} [0] NCCL INFO ncclCommSplit comm 0x{g}{k} rank {members.index(g)} nranks 2 "
            f"cudaDev 0 nvmlDev 0 busId 1000 parent 0x{g}0 color {color} key {g} - Init COMPLETE"
            for g in members
        )
    for g, peer, k in ((1, 1, 2), (2, 0, 2)):  # 1 -> 2 on the {1, 2} group
        lines.append(
            f"n{g}:{g}:{g} [0] NCCL INFO " + _coll("Send" if g == 1 else "Recv", 0, 4, 7, peer, f"0x{g}{k}", 2)
        )
    path = tmp_path / "hashed.log"
    path.write_text("\n".join(lines))
    run_id = ingest_one(con, path, "hashed")
    assert rows(con, "SELECT group_key, ranks FROM process_groups WHERE run_id = ? ORDER BY 1", [run_id]) == [
        ("nccl:0xaaa", [0, 1, 2, 3]),
        ("nccl:0xaaa/split0:color111", [0, 1]),
        ("nccl:0xaaa/split0:color222", [1, 2]),
        ("nccl:0xaaa/split0:color333", [0, 3]),
    ]
    assert rows(con, "SELECT rank, op, peer FROM comm_events WHERE run_id = ? ORDER BY rank", [run_id]) == [
        (1, "send", 2),
        (2, "recv", 1),
    ]


def test_linking_an_empty_run_is_a_no_op(con):
    run_id = store.ensure_run(con, "empty")
    con.execute("BEGIN")
    link_run(con, run_id)
    con.execute("COMMIT")
    assert rows(con, "SELECT count(*) FROM process_groups") == [(0,)]


def _two_rank_log(path, calls: int) -> None:
    """Two processes of one world communicator, `calls` all_reduces of 4 KiB each."""
    lines = [
        f"node1:{100 + r}:{200 + r} [{r}] NCCL INFO comm 0x5{r} rank {r} nranks 2 cudaDev {r} nvmlDev {r} "
        f"busId {r}000 commId 0xfeed - Init COMPLETE"
        for r in range(2)
    ]
    lines += [
        f"node1:{100 + r}:{200 + r} [{r}] NCCL INFO AllReduce: opCount {i:x} sendbuff 0x1 recvbuff 0x2 "
        f"count 1024 datatype 7 op 0 root 0 comm 0x5{r} [nranks=2] stream 0x3"
        for i in range(calls)
        for r in range(2)
    ]
    path.write_text("\n".join(lines) + "\n")


def test_a_log_and_a_trace_of_the_same_rank_count_each_call_once(tmp_path, con, data_dir):
    """Rank 0 has a profiler trace (the DDP ResNet-50 one, rank 0 of 2) and a log; rank 1 only the log.
    Rank 0 counts from its trace alone; rank 1 from the log; the log's rank-0 calls stay in the store."""
    log = tmp_path / "nccl.node1.log"
    _two_rank_log(log, calls=6)
    trace = data_dir / "kineto-hta" / "nccl_parser_config" / "nccl_data.json.gz"
    ingest_paths(con, [log], "both")  # the log first: its rank-0 calls count until the trace arrives
    assert con.execute(
        "SELECT rank, count(*) FROM comms WHERE run = 'both' GROUP BY rank ORDER BY rank"
    ).fetchall() == [(0, 6), (1, 6)]
    ingest_paths(con, [trace], "both")
    per_rank = con.execute(
        "SELECT rank, source_kind, count(*) FROM comms WHERE run = 'both' GROUP BY ALL ORDER BY ALL"
    ).fetchall()
    assert per_rank == [(0, "kineto", 21), (1, "nccl_log", 6)]  # 15 all_reduce + 6 broadcast on rank 0
    assert con.execute("SELECT count(*) FROM comm_events WHERE NOT counted").fetchone()[0] == 6
    assert (
        con.execute("SELECT sum(calls) FROM comm_agg a JOIN runs r USING (run_id) WHERE r.name = 'both'").fetchone()[0]
        == 27
    )
