"""PP scatter/gather (docs/models.md §6.5), ATTENTION2D context parallelism (§6.7), CPU-offload host<->device
volumes (§6.8) and DeepSpeed ZeRO-3 parameter persistence (§6.2). Expected numbers are worked out by hand from
the spec's formulas in each test; the defaults must leave every earlier prediction byte-identical."""

from __future__ import annotations

import hashlib
import json

import httpx
import pytest
from pydantic import ValidationError

from commlens.backend.api import Settings
from commlens.backend.api.testing import ServerThread
from commlens.backend.predict import predict
from commlens.contract.predict import BucketSpec, DtypeSpec, ModelSpec, ParallelSpec, PredictInput

# L = 4, h = 64, a = 8, V = 1000, s = 128; bf16 (2 bytes) unless stated
SMALL = {"layers": 4, "hidden": 64, "heads": 8, "vocab": 1000, "seq_len": 128}
GPT = {"layers": 24, "hidden": 2048, "heads": 16, "vocab": 50304, "seq_len": 2048}


def _ops(stage) -> dict[tuple[str, str, str, int], int]:
    return {(o.scheme, o.group, o.op, o.msg_bytes): o.calls_per_iter for o in stage.ops}


def _total(pred, scheme: str):
    return next(t for t in pred.totals if t.scheme == scheme)


# ------------------------------------------------------------------------- defaults: nothing changes


# sha256 of predict(...).model_dump_json() computed with predict.py before these features (git HEAD 49a059e),
# for inputs built without any of the new fields.
BEFORE = {
    "paper-3d-tied": "bba6d308562aa6102d8e263dff381b8bff6b919c304aa000f69ef8ac20600740",
    "megatron-sp-cp-ring-interleaved": "53478f4607ed0486b4ee2fa00581d0766ac03b7d255b87a802557ef6df63f613",
    "deepspeed-zero1": "a985a4a4713e8193185c0c75f5f0986e8ae5d320e4f44d1c341aff40ae08943e",
    "deepspeed-zero2-tp": "95aee6e0f9e990d977fefcb9e9a0ca71948b4ab9db9fcfd166442e288baedce7",
    "fsdp-zero3-pp": "398671a059f740bb1ca219be9e6fd296474bebac736bdd42ae147f8508630243",
    "paper-zero3-cp4": "59e71ecdf1bfacb0ea0faaf85d41052b90bf848da099a3d18db9c304c3c918cc",
    "fsdp-ddp": "c55b62a839544a4ed4ce1662850cbbb1467536e3e44432f4b81d06db460c272e",
    "harness-tp-pp": "77de5286e6a247b63668b0ff03345e56325d040445c919d497618b6a9ff4285b",
    # DeepSpeed ZeRO-3 with stage3_param_persistence_threshold = 0 (no persistent parameters): the old model
    "deepspeed-zero3-no-persistence": "18d3f6aaf393bf719c16ed9b19cafffd1f249ed176653c209b9e4d119bc46533",
}


def _before_cases() -> dict[str, PredictInput]:
    return {
        "paper-3d-tied": PredictInput(
            model=ModelSpec(**GPT, tied_embeddings=True), parallel=ParallelSpec(dp=4, tp=2, pp=2, micro_batches=8)
        ),
        "megatron-sp-cp-ring-interleaved": PredictInput(
            model=ModelSpec(**GPT, kv_heads=4),
            implementation="megatron",
            parallel=ParallelSpec(dp=2, tp=2, pp=2, cp=2, sp=True, micro_batches=4, virtual_stages=3, recompute="full"),
        ),
        "deepspeed-zero1": PredictInput(
            model=ModelSpec(**GPT), parallel=ParallelSpec(dp=8, zero=1, micro_batches=4), implementation="deepspeed"
        ),
        "deepspeed-zero2-tp": PredictInput(
            model=ModelSpec(**SMALL),
            parallel=ParallelSpec(dp=2, tp=2, zero=2, micro_batches=2),
            implementation="deepspeed",
        ),
        "fsdp-zero3-pp": PredictInput(
            model=ModelSpec(**GPT),
            parallel=ParallelSpec(dp=4, pp=2, zero=3, micro_batches=2),
            implementation="fsdp",
            dtypes=DtypeSpec(grad="float32"),
        ),
        "paper-zero3-cp4": PredictInput(
            model=ModelSpec(**SMALL), parallel=ParallelSpec(dp=2, cp=4, zero=3, micro_batches=2)
        ),
        "fsdp-ddp": PredictInput(
            model=ModelSpec(**SMALL),
            parallel=ParallelSpec(dp=4, sync_every_micro_step=True, micro_batches=3),
            implementation="fsdp",
        ),
        "harness-tp-pp": PredictInput(
            model=ModelSpec(**SMALL),
            parallel=ParallelSpec(dp=2, tp=2, pp=2, zero=1, micro_batches=2),
            implementation="harness",
        ),
        "deepspeed-zero3-no-persistence": PredictInput(
            model=ModelSpec(**GPT),
            parallel=ParallelSpec(dp=8, zero=3, micro_batches=4),
            implementation="deepspeed",
            buckets=BucketSpec(deepspeed_param_persistence_threshold=0),
        ),
    }


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_defaults_leave_earlier_predictions_byte_identical(name: str) -> None:
    pred = predict(_before_cases()[name])
    assert hashlib.sha256(pred.model_dump_json().encode()).hexdigest() == BEFORE[name]
    assert all("host_transfers" not in st for st in pred.model_dump()["stages"])


# ------------------------------------------------------------------------- §6.5 PP scatter/gather


def _pp(t: int, scatter_gather: bool, pp: int = 4, v: int = 1) -> PredictInput:
    return PredictInput(
        model=ModelSpec(**SMALL),
        parallel=ParallelSpec(
            tp=t, pp=pp, dp=2, micro_batches=3, micro_batch_size=2, virtual_stages=v, pp_scatter_gather=scatter_gather
        ),
    )


def test_pp_scatter_gather_sends_a_over_t_and_gathers_every_received_message() -> None:
    act = 2 * 128 * 64 * 2  # b s h w = 32768 bytes
    m = 3
    plain, sg = predict(_pp(4, False)), predict(_pp(4, True))
    # stage i: sends m to i+1 (i < 3) and m to i-1 (i > 0), with a matching recv for each
    recvs = [m, 2 * m, 2 * m, m]
    for st, st_plain, n_recv in zip(sg.stages, plain.stages, recvs, strict=True):
        ops, plain_ops = _ops(st), _ops(st_plain)
        pp_msgs = {k: c for k, c in ops.items() if k[0] == "pp"}
        assert {k[3] for k in pp_msgs} == {act // 4}  # 8192: S = A/t per TP rank, sends and recvs
        assert sum(c for k, c in pp_msgs.items() if k[2] == "recv") == n_recv
        assert sum(c for k, c in pp_msgs.items() if k[2] == "send") == n_recv  # v = 1: as many sends as recvs
        assert ops[("tp", "tp", "all_gather", act)] == n_recv  # one all_gather of S = A per received message
        # every other TP op is unchanged, and without scatter/gather the messages are the full A
        assert {k: c for k, c in ops.items() if k[0] == "tp" and k[2] != "all_gather"} == {
            k: c for k, c in plain_ops.items() if k[0] == "tp"
        }
        assert {k[3] for k in plain_ops if k[0] == "pp"} == {act}
    # the tp all_gather sits in group "tp" of size t
    gather = next(o for o in sg.stages[1].ops if o.op == "all_gather")
    assert (gather.scheme, gather.group, gather.group_size, gather.dtype) == ("tp", "tp", 4, "bfloat16")
    # pp totals: the sent bytes drop by t; mean over the 4 stages' ranks of (3 + 6 + 6 + 3) * A/4 sent
    assert _total(sg, "pp").s_sum == (3 + 6 + 6 + 3) * (act // 4) // 4
    assert _total(sg, "pp").s_sum * 4 == _total(plain, "pp").s_sum
    assert any("both directions" in n for n in sg.notes)


def test_pp_scatter_gather_with_interleaving_counts_every_recv() -> None:
    # p = 2, v = 2, m = 3: device 0 sends v m = 6 forward and (v-1) m = 3 backward; device 1 the reverse
    act = 2 * 128 * 64 * 2
    pred = predict(_pp(2, True, pp=2, v=2))
    for st in pred.stages:
        ops = _ops(st)
        assert sum(c for k, c in ops.items() if k[0] == "pp" and k[2] == "recv") == 9
        assert ops[("tp", "tp", "all_gather", act)] == 9


@pytest.mark.parametrize(
    ("parallel", "words"),
    [
        ({"tp": 1, "pp": 2, "pp_scatter_gather": True}, "needs tp > 1"),
        ({"tp": 2, "pp": 2, "sp": True, "pp_scatter_gather": True}, "exclude each other"),
    ],
)
def test_pp_scatter_gather_rejects_impossible_combinations(parallel: dict, words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        ParallelSpec(**parallel)


# ------------------------------------------------------------------------- §6.7 ATTENTION2D


def _a2d(c: int, rq: int | None = None, kv_heads: int | None = None) -> PredictInput:
    return PredictInput(
        model=ModelSpec(**SMALL, kv_heads=kv_heads),
        parallel=ParallelSpec(cp=c, cp_style="attention2d", cp_rq=rq, micro_batches=3, micro_batch_size=2),
    )


def test_attention2d_c4_square_mesh() -> None:
    # c = 4 -> r_Q = r_KV = 2; b = 2, s = 128, h = h_kv = 64, a = 8, w = 2; calls = L m = 4 * 3 = 12
    b, s, h, a, w, cp_size, rq, rkv, calls = 2, 128, 64, 8, 2, 4, 2, 2, 12
    pred = predict(_a2d(4))
    ops = {k: c for k, c in _ops(pred.stages[0]).items() if k[0] == "cp"}
    q = b * (s // rkv) * h * w  # 16384
    kv = 2 * b * (s // rq) * h * w  # 32768
    lse = b * (s // rkv) * a * 4  # 4096, also the size of the backward's rowsum(dO * O) gather
    assert ops == {
        ("cp", "cp:q", "all_gather", q): 2 * calls,  # Q (fwd), dO (bwd)
        ("cp", "cp:q", "reduce_scatter", q): 2 * calls,  # outputs (fwd), dQ (bwd)
        ("cp", "cp:q", "all_to_all", lse): calls,
        ("cp", "cp:q", "all_gather", lse): calls,
        ("cp", "cp:kv", "all_gather", kv): calls,
        ("cp", "cp:kv", "reduce_scatter", kv): calls,  # dK and dV (bwd)
    }
    # wire bytes per rank from the table's last column, per layer per micro-batch: forward, then backward
    forward = (
        (rq - 1) * b * (s // cp_size) * h * w  # Q all_gather
        + 2 * (rkv - 1) * b * (s // cp_size) * h * w  # K, V all_gather
        + (rq - 1) * b * (s // cp_size) * h * w
        + (rq - 1) * b * (s // cp_size) * a * 4
    )  # reduce_scatter + log-sum-exp
    assert forward == 8192 + 16384 + 8192 + 2048
    backward = forward  # the transpose: dO gather, dK/dV scatter, dQ scatter, rowsum(dO * O) gather
    cp = _total(pred, "cp")
    assert cp.wire_bytes == pytest.approx((forward + backward) * calls)
    assert cp.s_sum == (4 * q + 2 * kv + 2 * lse) * calls
    assert {o.group_size for o in pred.stages[0].ops if o.group == "cp:q"} == {2}
    assert any("backward derived" in n for n in pred.notes)


def test_attention2d_c8_rq2_with_gqa() -> None:
    # c = 8, r_Q = 2 -> r_KV = 4; h_kv = 64 * 2 / 8 = 16
    b, s, h, h_kv, a, w, cp_size, rq, rkv, calls = 2, 128, 64, 16, 8, 2, 8, 2, 4, 12
    pred = predict(_a2d(8, rq=2, kv_heads=2))
    ops = pred.stages[0].ops
    by = {(o.group, o.op, o.dtype): o for o in ops if o.scheme == "cp"}
    assert by[("cp:q", "all_gather", "bfloat16")].msg_bytes == b * (s // rkv) * h * w == 8192
    assert by[("cp:q", "reduce_scatter", "bfloat16")].msg_bytes == 8192
    assert by[("cp:q", "all_to_all", "float32")].msg_bytes == b * (s // rkv) * a * 4 == 2048
    assert by[("cp:q", "all_gather", "float32")].msg_bytes == 2048  # rowsum(dO * O), backward
    assert by[("cp:kv", "all_gather", "bfloat16")].msg_bytes == 2 * b * (s // rq) * h_kv * w == 8192
    assert by[("cp:kv", "reduce_scatter", "bfloat16")].msg_bytes == 8192
    assert (by[("cp:q", "all_gather", "bfloat16")].group_size, by[("cp:kv", "all_gather", "bfloat16")].group_size) == (
        2,
        4,
    )
    assert {k: o.calls_per_iter for k, o in by.items() if o.calls_per_iter != calls} == {
        ("cp:q", "all_gather", "bfloat16"): 2 * calls,
        ("cp:q", "reduce_scatter", "bfloat16"): 2 * calls,
    }
    wire = (
        (rq - 1) * b * (s // cp_size) * h * w * 2
        + (rq - 1) * b * (s // cp_size) * a * 4
        + 2 * (rkv - 1) * b * (s // cp_size) * h_kv * w
    )
    assert wire == 4096 * 2 + 1024 + 6144
    assert _total(pred, "cp").wire_bytes == pytest.approx(2 * wire * calls)  # backward moves what forward does


def test_attention2d_degenerate_mesh_and_ring_default() -> None:
    # r_Q = 4, r_KV = 1: the K/V groups hold one rank and issue nothing
    groups = {o.group for o in predict(_a2d(4, rq=4)).stages[0].ops if o.scheme == "cp"}
    assert groups == {"cp:q"}
    ring = predict(
        PredictInput(model=ModelSpec(**SMALL), parallel=ParallelSpec(cp=4, micro_batches=3, micro_batch_size=2))
    )
    # ring (the default): 3 (c-1) L m send/recv of 2 b (s/c) h_kv w = 2 * 2 * 32 * 64 * 2
    assert _ops(ring.stages[0])[("cp", "cp:ring", "send", 16384)] == 3 * 3 * 4 * 3


@pytest.mark.parametrize(
    ("parallel", "words"),
    [
        ({"cp": 8, "cp_style": "attention2d"}, "not a perfect square"),
        ({"cp": 8, "cp_style": "attention2d", "cp_rq": 3}, "must divide cp=8"),
        ({"cp": 4, "cp_style": "attention2d", "cp_rq": 16}, "must divide cp=4"),
        ({"cp": 4, "cp_rq": 2}, "needs cp_style='attention2d'"),
    ],
)
def test_attention2d_rejects_impossible_meshes(parallel: dict, words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        ParallelSpec(**parallel)


# ------------------------------------------------------------------------- §6.8 CPU offload


def _offload(style: str, gap: int = 1, **dtypes) -> PredictInput:
    # Ψ_r = 1 200 000 (one flat parameter count), d = 4 -> Ψ_z = 300 000
    return PredictInput(
        model=ModelSpec(**SMALL, params_override=1_200_000),
        implementation="deepspeed",
        parallel=ParallelSpec(dp=4, zero=3, offload=style, prefetch_gap=gap),  # type: ignore[arg-type]
        dtypes=DtypeSpec(**dtypes),
    )


def _host(st) -> dict[tuple[str, str], int]:
    return {(h.direction, h.what): h.bytes_per_iter for h in st.host_transfers}


def _by_direction(st) -> dict[str, int]:
    out: dict[str, int] = {}
    for h in st.host_transfers:
        out[h.direction] = out.get(h.direction, 0) + h.bytes_per_iter
    return out


def test_zero_offload_moves_gradients_down_and_parameters_up() -> None:
    psi_z, g_bytes = 300_000, 4
    pred = predict(_offload("zero_offload", grad="float32"))
    (st,) = pred.stages
    assert _by_direction(st) == {"d2h": psi_z * g_bytes, "h2d": psi_z * 2}  # 1 200 000 and 600 000
    assert _by_direction(st) == {"d2h": 1_200_000, "h2d": 600_000}
    # not collectives: the scheme totals are those of the same run without offload
    plain = predict(_offload("none", grad="float32"))
    assert pred.totals == plain.totals and st.ops == plain.stages[0].ops
    assert "host_transfers" in pred.model_dump()["stages"][0]


def test_deep_optimizer_states_gap_4() -> None:
    # g = 4: 1/4 of Ψ_z (75 000) updated on the GPU, 3/4 (225 000) on the CPU; fp32 gradients
    psi_z, g, g_bytes, state = 300_000, 4, 4, 12
    st = predict(_offload("deep_optimizer_states", gap=g, grad="float32")).stages[0]
    cpu, gpu = psi_z * (g - 1) // g, psi_z // g
    host = _host(st)
    assert host[("d2h", "gradients to the CPU optimizer")] == cpu * g_bytes == 900_000
    assert host[("h2d", "updated 16-bit parameters")] == cpu * 2 == 450_000
    assert host[("h2d", "optimizer state prefetched for the GPU update")] == gpu * state == 900_000
    assert host[("d2h", "optimizer state written back after the GPU update")] == gpu * state == 900_000
    assert _by_direction(st) == {"d2h": 1_800_000, "h2d": 1_350_000}
    # 16-byte optimizer state (e.g. an extra fp32 gradient copy): only the GPU-updated fraction changes
    st16 = predict(_offload("deep_optimizer_states", gap=g, grad="float32", optimizer_state_bytes=16)).stages[0]
    assert _by_direction(st16) == {"d2h": 900_000 + 75_000 * 16, "h2d": 450_000 + 75_000 * 16}
    # g = 1: every sub-group is GPU-updated, so only optimizer state moves
    assert _by_direction(predict(_offload("deep_optimizer_states", gap=1)).stages[0]) == {
        "d2h": psi_z * 12,
        "h2d": psi_z * 12,
    }


def test_offload_uses_each_stages_own_partition() -> None:
    # pp = 2, dp = 2, untied, learned positions, bf16 gradients. A layer has 12h² + 13h = 49 984 parameters.
    # stage 0: V h + s h + 2 layers = 64 000 + 8192 + 99 968 = 172 160; stage 1: 2 layers + 2h + V h = 164 096
    pred = predict(
        PredictInput(model=ModelSpec(**SMALL), parallel=ParallelSpec(dp=2, pp=2, zero=3, offload="zero_offload"))
    )
    assert [st.params_per_rank for st in pred.stages] == [172_160, 164_096]
    # Ψ_z = Ψ_r / d = 86 080 and 82 048; D2H gradients Ψ_z * 2, H2D parameters Ψ_z * 2
    assert [_by_direction(st) for st in pred.stages] == [
        {"d2h": 86_080 * 2, "h2d": 86_080 * 2},
        {"d2h": 82_048 * 2, "h2d": 82_048 * 2},
    ]


@pytest.mark.parametrize(
    ("parallel", "implementation", "words"),
    [
        ({"dp": 4, "zero": 2, "offload": "zero_offload"}, "deepspeed", "assume ZeRO-3"),
        (
            {"dp": 4, "zero": 3, "offload": "zero_offload", "prefetch_gap": 2},
            "deepspeed",
            "needs offload='deep_optimizer_states'",
        ),
        ({"dp": 4, "zero": 3, "prefetch_gap": 2}, "deepspeed", "needs offload='deep_optimizer_states'"),
        ({"dp": 4, "zero": 3, "offload": "zero_offload", "pp_scatter_gather": True, "tp": 2}, "harness", "no PP"),
        ({"dp": 4, "zero": 3, "offload": "zero_offload"}, "fsdp", "FSDP CPUOffload"),
        (
            {"dp": 4, "zero": 3, "offload": "deep_optimizer_states", "prefetch_gap": 0},
            "deepspeed",
            "greater than or equal to 1",
        ),
    ],
)
def test_offload_rejects_impossible_combinations(parallel: dict, implementation: str, words: str) -> None:
    body = {"model": SMALL, "parallel": parallel, "implementation": implementation}
    with pytest.raises(ValidationError, match=words):
        PredictInput.model_validate(body)


# ------------------------------------------------------------------------- §6.2 ZeRO-3 persistence


def _persist(threshold: int | None = None, implementation: str = "deepspeed") -> PredictInput:
    buckets = BucketSpec() if threshold is None else BucketSpec(deepspeed_param_persistence_threshold=threshold)
    return PredictInput(
        model=ModelSpec(layers=2, hidden=256, heads=8, vocab=1000, seq_len=128),
        parallel=ParallelSpec(dp=4, zero=3, micro_batches=2),
        buckets=buckets,
        implementation=implementation,
    )  # type: ignore[arg-type]


def test_deepspeed_zero3_keeps_small_parameters_whole() -> None:
    # h = 256: per layer, QKV weight 196 608, fc1 and fc2 weights 262 144 each exceed 1e5 elements and are
    # gathered (720 896); the rest (proj weight 65 536, biases, LayerNorms) persist: 12h² + 13h - 720 896 = 68 864.
    # Root: token embedding and LM head (256 000 each) gathered; position embedding (32 768) and ln_f (512) persist.
    w, m = 2, 2
    layer, layer_gathered = 12 * 256**2 + 13 * 256, 720_896
    root, root_gathered = 256_000 + 32_768 + 512 + 256_000, 512_000
    persistent = 2 * (layer - layer_gathered) + 32_768 + 512
    ops = _ops(predict(_persist()).stages[0])
    assert ops == {
        ("dp", "dp", "all_gather", root_gathered * w): 2 * m,  # forward + backward, every micro-step
        ("dp", "dp", "reduce_scatter", root * w): m,  # gradients of all root parameters
        ("dp", "dp", "all_gather", layer_gathered * w): 2 * 2 * m,  # 2 layers, forward + backward
        ("dp", "dp", "reduce_scatter", layer * w): 2 * m,
        ("dp", "dp", "all_gather", persistent * w): 1,  # re-gathered once after the optimizer step
    }
    assert persistent == 171_008


def test_persistence_threshold_is_inclusive_and_deepspeed_only() -> None:
    w = 2
    # at 65 536 the attention projection weight (65 536 elements) persists; one element less and it is gathered
    at = _ops(predict(_persist(65_536)).stages[0])
    below = _ops(predict(_persist(65_535)).stages[0])
    assert ("dp", "dp", "all_gather", 720_896 * w) in at
    assert ("dp", "dp", "all_gather", (720_896 + 65_536) * w) in below
    # threshold 0: nothing persists, every parameter is gathered with its unit (the earlier model)
    none = _ops(predict(_persist(0)).stages[0])
    assert none[("dp", "dp", "all_gather", (12 * 256**2 + 13 * 256) * w)] == 8
    assert sum(c for k, c in none.items() if k[2] == "all_gather" and c == 1) == 0
    # paper and fsdp ignore the DeepSpeed threshold
    for impl in ("paper", "fsdp"):
        assert predict(_persist(10**9, impl)).stages == predict(_persist(0, impl)).stages


# ------------------------------------------------------------------------- the API keeps validating


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory):
    with (
        ServerThread(Settings(db=tmp_path_factory.mktemp("spec") / "store.duckdb")) as srv,
        httpx.Client(base_url=srv.url) as c,
    ):
        yield c


def test_api_predict_with_the_new_inputs(client: httpx.Client) -> None:
    body = {
        "model": SMALL,
        "implementation": "deepspeed",
        "parallel": {"dp": 4, "zero": 3, "offload": "deep_optimizer_states", "prefetch_gap": 4},
    }
    r = client.post("/api/predict", json=body)
    assert r.status_code == 200, r.text
    assert r.json() == json.loads(predict(PredictInput.model_validate(body)).model_dump_json())
    assert {h["direction"] for h in r.json()["stages"][0]["host_transfers"]} == {"d2h", "h2d"}


@pytest.mark.parametrize(
    "parallel",
    [
        {"cp": 4, "cp_style": "attention2d", "cp_rq": 10**30},
        {"cp": 4, "cp_style": "attention2d", "cp_rq": 0},
        {"cp": 4, "cp_style": "ulysses"},
        {"dp": 4, "zero": 3, "offload": "deep_optimizer_states", "prefetch_gap": 10**30},
        {"dp": 4, "zero": 3, "offload": "nvme"},
        {"tp": 1, "pp": 2, "pp_scatter_gather": True},
    ],
)
def test_api_rejects_absurd_new_inputs_with_422(client: httpx.Client, parallel: dict) -> None:
    r = client.post("/api/predict", json={"model": SMALL, "parallel": parallel})
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/problem+json")


@pytest.mark.parametrize("field,value", [("optimizer_state_bytes", 10**30), ("optimizer_state_bytes", 0)])
def test_api_rejects_absurd_dtype_and_bucket_inputs(client: httpx.Client, field: str, value: int) -> None:
    r = client.post("/api/predict", json={"model": SMALL, "dtypes": {field: value}})
    assert r.status_code == 422, r.text
    r = client.post("/api/predict", json={"model": SMALL, "buckets": {"deepspeed_param_persistence_threshold": -1}})
    assert r.status_code == 422, r.text
