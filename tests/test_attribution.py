"""Scheme attribution on synthetic stores (labels, structure, overrides) and on real traces."""

from __future__ import annotations

import json

import pytest
from synthetic import write_rows as write

from commlens import store
from commlens.backend.attribution import (
    attribute_run,
    attribution_summary,
    clear_override,
    description_label,
    layout_stride,
    set_override,
)

MiB = 1 << 20


def ev(rank: int, seq: int, op: str, size: int | None, group: str | None, n: int, **kw) -> dict:
    return {
        "rank": rank,
        "process": f"r{rank}",
        "seq": seq,
        "op": op,
        "dtype": "float32",
        "msg_bytes": size,
        "group_size": n,
        "group_key": group,
        **kw,
    }


def grid_2x2(con, run: str, descs: dict[str, str] | None = None, mesh_dims: dict[str, str] | None = None) -> None:
    """4 ranks: tp groups {0,1},{2,3} with many same-size all_reduces; dp groups {0,2},{1,3} with few big ones."""
    descs = descs or {}
    mesh_dims = mesh_dims or {}
    layout = {"tpA": [0, 1], "tpB": [2, 3], "dpA": [0, 2], "dpB": [1, 3]}
    groups = [
        {
            "group_key": f"pg:{k}",
            "ranks": ranks,
            "size": 2,
            "origin": "pg_config",
            "description": descs.get(k),
            "mesh_dim": mesh_dims.get(k),
        }
        for k, ranks in layout.items()
    ]
    groups.append(
        {"group_key": "pg:0", "ranks": [0, 1, 2, 3], "size": 4, "origin": "pg_config", "description": "default_pg"}
    )
    for rank in range(4):
        tp = "pg:tpA" if rank < 2 else "pg:tpB"
        dp = "pg:dpA" if rank % 2 == 0 else "pg:dpB"
        events = [ev(rank, i, "all_reduce", 64 * 1024, tp, 2) for i in range(8)]
        events += [ev(rank, 8 + i, "all_reduce", 25 * MiB, dp, 2) for i in range(2)]
        events.append(ev(rank, 10, "barrier", 0, "pg:0", 4))
        write(con, run, events, groups if rank == 0 else [], rank=rank)


def schemes(con, run: str) -> dict[str, tuple[str, str]]:
    return {a.group_key: (a.scheme, a.source) for a in attribution_summary(con, run).groups}


def test_2x2_by_structure_alone(con):
    grid_2x2(con, "grid")
    result = {a.group_key: a for a in attribute_run(con, "grid")}
    assert {k: (a.scheme, a.source) for k, a in result.items()} == {
        "pg:tpA": ("tp", "structure"),
        "pg:tpB": ("tp", "structure"),
        "pg:dpA": ("dp", "structure"),
        "pg:dpB": ("dp", "structure"),
        "pg:0": ("other", "structure"),
    }
    # Structure is a convention, and the reason and confidence say so.
    assert result["pg:tpA"].confidence <= 0.5 and "convention" in result["pg:tpA"].reason
    assert "stride 2" in result["pg:dpA"].reason
    # The comms view shows it.
    rows = dict(con.execute("SELECT scheme, count(*) FROM comms WHERE run = 'grid' GROUP BY 1").fetchall())
    assert rows == {"tp": 32, "dp": 8, "other": 4}


def test_2x2_labels_win_over_structure(con):
    # Labels that contradict the layout convention: the labels are what the user's code said.
    grid_2x2(
        con,
        "labelled",
        descs={"tpA": "mesh_dp", "tpB": "mesh_dp", "dpA": "TENSOR_MODEL_PARALLEL_GROUP"},
        mesh_dims={"dpB": "tp"},
    )
    result = {a.group_key: a for a in attribute_run(con, "labelled")}
    assert (result["pg:tpA"].scheme, result["pg:tpA"].source) == ("dp", "label")
    assert "mesh_dp" in result["pg:tpA"].reason
    assert (result["pg:dpA"].scheme, result["pg:dpA"].source) == ("tp", "label")
    assert "Megatron" in result["pg:dpA"].reason
    assert (result["pg:dpB"].scheme, result["pg:dpB"].source) == ("tp", "label")


def test_run_config_groups_and_mesh_label_by_ranks(con):
    grid_2x2(con, "cfg")
    config = {
        "strategy": "dp2-tp2",
        "world_size": 4,
        "parallel": {"dp": 2, "tp": 2},
        "mesh_dims": ["dp", "tp"],
        "mesh_shape": [2, 2],
        "groups": [{"dim": "tp", "ranks": [2, 3]}],
    }
    store.set_run_config(con, store.get_run_id(con, "cfg"), config)
    result = {a.group_key: a for a in attribute_run(con, "cfg")}
    assert result["pg:tpB"].scheme == "tp" and "run.json group" in result["pg:tpB"].reason
    # {0,1} is not listed but the row-major 2x2 mesh (dp, tp) makes it a tp group, {0,2} a dp group.
    assert result["pg:tpA"].scheme == "tp" and "mesh_dims" in result["pg:tpA"].reason
    assert result["pg:dpA"].scheme == "dp" and result["pg:dpA"].source == "label"


def test_override_is_kept_and_can_be_cleared(con):
    grid_2x2(con, "ovr")
    attribute_run(con, "ovr")
    with pytest.raises(ValueError):
        set_override(con, "ovr", "pg:tpA", "zz", "typo")
    with pytest.raises(ValueError):
        set_override(con, "ovr", "pg:tpA", "cp", " ")
    with pytest.raises(LookupError):
        set_override(con, "ovr", "pg:nope", "cp", "no such group")
    a = set_override(con, "ovr", "pg:tpA", "cp", "ring attention over these ranks")
    assert (a.scheme, a.source, a.confidence) == ("cp", "override", 1.0)
    again = {g.group_key: g for g in attribute_run(con, "ovr")}
    assert (again["pg:tpA"].scheme, again["pg:tpA"].source) == ("cp", "override")
    assert "ring attention" in again["pg:tpA"].reason
    assert again["pg:tpB"].scheme == "tp"
    cleared = {g.group_key: g for g in clear_override(con, "ovr", "pg:tpA")}
    assert (cleared["pg:tpA"].scheme, cleared["pg:tpA"].source) == ("tp", "structure")


def test_world_group_alone_with_gradient_all_reduce_is_dp(con):
    groups = [
        {"group_key": "pg:0", "ranks": [0, 1], "size": 2, "origin": "pg_config", "description": "default_pg"},
        {"group_key": "pg:1", "ranks": [0, 1], "size": 2, "origin": "pg_config", "description": "undefined"},
    ]
    events = [ev(0, 0, "broadcast", 4096, "pg:0", 2)]
    events += [ev(0, i, "all_reduce", 24 * MiB, "pg:0", 2) for i in range(1, 4)]
    write(con, "ddp", events, groups, rank=0)
    result = {a.group_key: a for a in attribute_run(con, "ddp")}
    assert (result["pg:0"].scheme, result["pg:0"].source) == ("dp", "structure")
    assert "only group with collectives" in result["pg:0"].reason and "24.0 MiB" in result["pg:0"].reason
    # The unused second group says why it stays other.
    assert (result["pg:1"].scheme, result["pg:1"].source, result["pg:1"].confidence) == ("other", "unknown", 0.0)


def test_world_group_with_small_all_reduce_only_is_not_dp(con):
    events = [ev(0, i, "all_reduce", 4, "pg:0", 2) for i in range(10)]
    write(con, "tiny", events, [{"group_key": "pg:0", "ranks": [0, 1], "size": 2, "origin": "pg_config"}], rank=0)
    [a] = attribute_run(con, "tiny")
    assert (
        a.scheme == "other"
        and "without gradient-sized all_reduce (the largest 4 B, all_reduce 100% of its 40 B)" in a.reason
    )


def test_world_group_mixing_all_to_all_and_all_reduce_is_other(con):
    events = [ev(0, 0, "all_to_all", 8 * MiB, "pg:0", 8), ev(0, 1, "all_reduce", 4 * MiB, "pg:0", 8)]
    world = [{"group_key": "pg:0", "ranks": list(range(8)), "size": 8, "origin": "pg_config"}]
    write(con, "dlrm", events, world, rank=0)
    [a] = attribute_run(con, "dlrm")
    assert a.scheme == "other" and "all_to_all" in a.reason and a.confidence <= 0.3


def test_pipeline_neighbours_pp_and_ring_cp_and_unattributed_count(con):
    groups = [
        {"group_key": "nccl:pp", "ranks": [0, 2, 4, 6], "size": 4, "origin": "nccl_init"},
        {"group_key": "nccl:ring", "ranks": [1, 3, 5, 7], "size": 4, "origin": "nccl_init"},
    ]
    events = []
    for i, r in enumerate([0, 2, 4]):
        events.append(ev(r, i, "send", 8 * MiB, "nccl:pp", 4, peer=[2, 4, 6][i]))
    for i, (r, peer) in enumerate([(1, 3), (3, 5), (5, 7), (7, 1)]):
        events.append(ev(r, 10 + i, "send", 1 * MiB, "nccl:ring", 4, peer=peer))
    events.append(ev(0, 20, "all_reduce", 4, None, 8))
    write(con, "pp", events, groups, kind="nccl_log")
    result = {a.group_key: a for a in attribute_run(con, "pp")}
    assert (result["nccl:pp"].scheme, result["nccl:pp"].source) == ("pp", "structure")
    assert "neighbouring" in result["nccl:pp"].reason
    assert result["nccl:ring"].scheme == "cp" and "ring" in result["nccl:ring"].reason
    summary = attribution_summary(con, "pp")
    assert summary.unattributed_events == 1
    assert summary.events_by_scheme == {"pp": 3, "cp": 4, "unattributed": 1}


def test_all_to_all_subgroup_is_weak_ep_and_events_without_group_rows(con):
    # The group exists only in events: attribution creates its row so the view can show a scheme.
    events = [ev(r, 0, "all_to_all", MiB, "pg:7", 4) for r in range(4)]
    write(con, "moe", events)
    [a] = attribute_run(con, "moe")
    assert (a.group_key, a.scheme, a.source) == ("pg:7", "ep", "structure")
    assert a.confidence <= 0.3 and "weak evidence" in a.reason
    assert con.execute("SELECT DISTINCT scheme FROM comms WHERE run = 'moe'").fetchall() == [("ep",)]


def test_description_and_layout_helpers():
    assert description_label("mesh_dp_shard")[0] == "dp"
    assert description_label("mesh_tp")[0] == "tp"
    assert description_label("DATA_PARALLEL_GROUP_WITH_CP_GLOO")[0] == "dp"
    assert description_label("EXPERT_DATA_PARALLEL_GROUP")[0] == "dp"
    assert description_label("EXPERT_MODEL_PARALLEL_GROUP")[0] == "ep"
    assert description_label("EMBEDDING_GROUP")[0] == "pp"
    assert description_label("MODEL_PARALLEL_GROUP")[0] == "other"
    assert description_label("sequence_data_parallel_group")[0] == "dp"
    assert description_label("sequence_parallel_group")[0] == "cp"
    assert description_label("default_pg") is None
    assert description_label("undefined") is None
    assert layout_stride([0, 1, 2, 3]) == 1 and layout_stride([1, 5, 9]) == 4
    assert layout_stride([0, 1, 3]) is None and layout_stride([3]) is None


# ------------------------------------------------------------------------------ real data


def ingest_real(con, path, run: str) -> None:
    from commlens.service.ingest import ingest_paths

    summary = ingest_paths(con, [path], run)
    assert not summary.failed, summary.failed


def test_real_nccl_log_128_rank_all_reduce_is_dp(con, data_dir):
    ingest_real(con, data_dir / "nccl-logs" / "nvidia-nccl-1193.log", "ray")
    groups = attribute_run(con, "ray")
    assert groups and all(g.size == 128 for g in groups)
    assert {(g.scheme, g.source) for g in groups} == {("dp", "structure")}
    assert all("all_reduce" in g.reason and "MiB" in g.reason for g in groups)
    # three processes' pointer-keyed groups: none is "the only group with collectives"
    assert len(groups) == 3 and not [g for g in groups if "only group" in g.reason]
    assert all("(one of 3 world-sized groups, each seen from one process" in g.reason for g in groups)
    summary = attribution_summary(con, "ray")
    assert summary.events_by_scheme == {"dp": 4} and summary.unattributed_events == 0


def test_real_rccl_hang_log(con, data_dir):
    # Rank processes caught in different collectives: one all_reduces ~38 MiB buffers, the other
    # all_gathers int8 bytes; neither communicator is linked across processes.
    ingest_real(con, data_dir / "nccl-logs" / "rocm-rccl-429.log", "hang")
    by_process = {g.group_key.split(":")[3]: g for g in attribute_run(con, "hang")}
    assert by_process["45006"].scheme == "dp"
    # its 226 MiB are all_gather: not "setup or small traffic", as the reason said
    other = by_process["45012"]
    assert other.scheme == "other" and "has no all_reduce; all_gather carries 100% of its 226 MiB" in other.reason


# ----------------------------------------------------------------------- a tiny harness run


def harness_prefetch(items: list[pytest.Item]) -> list[tuple[str, dict]]:
    """test_harness's "ddp+tp" run when a selected test reads it (tests/harness_runs.py)."""
    from test_harness import SCHEMES, TINY

    if not any("harness_run" in getattr(item, "fixturenames", ()) for item in items):
        return []
    return [("ddp+tp", dict(TINY, **SCHEMES["ddp+tp"]))]


@pytest.fixture(scope="module")
def harness_run(harness_runs, tmp_path_factory):
    """dp=2 x tp=2 GPT on gloo, 4 steps (2 profiled): test_harness's "ddp+tp" run, shared by the session
    (tests/harness_runs.py), ingested into a store file."""
    from test_harness import SCHEMES, TINY

    run = harness_runs("ddp+tp", dict(TINY, **SCHEMES["ddp+tp"]))
    con = store.connect(tmp_path_factory.mktemp("h") / "store.duckdb")
    ingest_real(con, run.out, "dp2tp2")
    attribute_run(con, "dp2tp2")
    yield con
    con.close()


def _predicted(con, run: str):
    from commlens.backend.predict import predict, predict_input_from_config

    config = con.execute("SELECT config FROM runs WHERE name = ?", [run]).fetchall()[0][0]
    return predict(predict_input_from_config(json.loads(config)))


@pytest.mark.slow
def test_harness_run_groups_take_run_json_labels(harness_run):
    from commlens.backend.histograms import histogram

    con = harness_run
    groups = {g.group_key: g for g in attribution_summary(con, "dp2tp2").groups}
    assert {k: (g.scheme, g.source) for k, g in groups.items()} == {
        "pg:0": ("other", "label"),
        "pg:1": ("dp", "label"),
        "pg:2": ("dp", "label"),
        "pg:3": ("tp", "label"),
        "pg:4": ("tp", "label"),
    }
    assert groups["pg:1"].ranks == [0, 2] and groups["pg:3"].ranks == [0, 1]
    # Profiled steps 2 and 3 on every rank; calls per rank per step equal the harness predictor's.
    h = histogram(con, "dp2tp2")
    assert h.iterations.mode == "steps" and h.iterations.iterations == {str(r): 2 for r in range(4)}
    predicted = _predicted(con, "dp2tp2")
    per_rank = sum(o.calls_per_iter for st in predicted.stages for o in st.ops for _ in st.ranks) / predicted.world_size
    assert sum(s.total_calls for s in h.series) == pytest.approx(per_rank)


@pytest.mark.slow
def test_harness_run_histogram_per_scheme_equals_prediction(harness_run):
    """gloo traces carry no process-group name; the ingester ties each call to its group through the
    harness's commlens:<dim>:<pg> ranges, and the groups take their scheme from run.json."""
    from commlens.backend.histograms import histogram

    con = harness_run
    h = histogram(con, "dp2tp2", rank=0)
    measured = {(s.scheme, s.op, b.lo): v for s in h.series for b, v in zip(h.bins, s.calls, strict=True) if v}
    predicted = _predicted(con, "dp2tp2")
    [stage] = [st for st in predicted.stages if 0 in st.ranks]
    expected: dict = {}
    for o in stage.ops:
        key = (o.scheme, o.op, 1 << (o.msg_bytes.bit_length() - 1))
        expected[key] = expected.get(key, 0) + o.calls_per_iter
    assert measured == expected


def test_real_kineto_ddp_default_pg_is_dp(con, data_dir):
    ingest_real(con, data_dir / "kineto-hta" / "nccl_parser_config" / "nccl_data.json.gz", "resnet")
    [g] = attribute_run(con, "resnet")
    assert (g.group_key, g.description, g.scheme, g.source) == ("pg:0", "default_pg", "dp", "structure")
    assert "'default_pg'" in g.reason and "30.0 MiB" in g.reason and g.calls == 21
    assert attribution_summary(con, "resnet").events_by_scheme == {"dp": 21}


def test_real_kineto_without_group_metadata_counts_unattributed(con, data_dir):
    # 2023 DLRM traces: no record_param_comms metadata, so no process group on any call.
    ingest_real(con, data_dir / "kineto-param" / "dlrm_kineto.tar.gz", "dlrm")
    assert attribute_run(con, "dlrm") == []
    summary = attribution_summary(con, "dlrm")
    assert summary.unattributed_events == 64 and summary.events_by_scheme == {"unattributed": 64}
