"""The textbook predictor against the worked examples of docs/models.md §9."""

from __future__ import annotations

import pytest

from commlens.backend.predict import ddp_buckets, param_count, predict
from commlens.contract.predict import ModelSpec, ParallelSpec, PredictInput

GIB = 2**30
GPT_1B3 = ModelSpec(layers=24, hidden=2048, heads=16, vocab=50304, seq_len=2048, tied_embeddings=True)


def test_parameter_count_is_megatron_eq2_plus_final_layernorm() -> None:
    assert param_count(GPT_1B3) == 1_315_815_424 + 2 * 2048


@pytest.mark.parametrize(
    ("zero", "s_sum_gib", "wire_gib"),
    [(0, 2.45, 4.29), (1, 4.90, 4.29), (2, 12.25, 10.72), (3, 29.41, 25.73)],
)
def test_pure_dp_zero_stages_match_worked_example(zero: int, s_sum_gib: float, wire_gib: float) -> None:
    pred = predict(PredictInput(model=GPT_1B3, parallel=ParallelSpec(dp=8, micro_batches=4, zero=zero)))
    (dp,) = pred.totals
    assert dp.scheme == "dp"
    assert dp.s_sum / GIB == pytest.approx(s_sum_gib, abs=0.006)
    assert dp.wire_bytes / GIB == pytest.approx(wire_gib, abs=0.006)


def test_zero3_is_one_and_a_half_dp_with_one_micro_batch() -> None:
    base = predict(PredictInput(model=GPT_1B3, parallel=ParallelSpec(dp=8, zero=0))).totals[0]
    z3 = predict(PredictInput(model=GPT_1B3, parallel=ParallelSpec(dp=8, zero=3))).totals[0]
    assert z3.wire_bytes / base.wire_bytes == pytest.approx(1.5, rel=1e-6)


def test_3d_worked_example_ops() -> None:
    pred = predict(PredictInput(model=GPT_1B3, parallel=ParallelSpec(dp=4, tp=2, pp=2, micro_batches=8)))
    first, last = pred.stages
    mib8 = 8 * 2**20
    ops0 = {(o.scheme, o.op, o.msg_bytes): o.calls_per_iter for o in first.ops}
    ops1 = {(o.scheme, o.op, o.msg_bytes): o.calls_per_iter for o in last.ops}
    assert ops0[("tp", "all_reduce", mib8)] == 4 * 12 * 8 + 8  # layer ops + embedding output
    assert ops1[("tp", "all_reduce", mib8)] == 4 * 12 * 8 + 8  # layer ops + LM-head input grad
    assert ops1[("tp", "all_reduce", 8192)] == 24  # cross-entropy, 3 per micro-batch
    assert ops0[("pp", "send", mib8)] == 8 and ops1[("pp", "send", mib8)] == 8
    assert ops0[("pp", "all_reduce", 103_022_592)] == 1  # tied embedding gradient


def test_sequence_parallel_swaps_all_reduce_for_gather_and_scatter() -> None:
    plain = predict(PredictInput(model=GPT_1B3, parallel=ParallelSpec(tp=4, micro_batches=2)))
    sp = predict(PredictInput(model=GPT_1B3, parallel=ParallelSpec(tp=4, sp=True, micro_batches=2)))
    ops = {o.op for o in sp.stages[0].ops}
    assert {"all_gather", "reduce_scatter"} <= ops
    layer_ar = next(o for o in plain.stages[0].ops if o.op == "all_reduce" and o.msg_bytes == 2 * 2048 * 2048)
    layer_ag = next(o for o in sp.stages[0].ops if o.op == "all_gather" and o.msg_bytes == 2 * 2048 * 2048)
    layer_rs = next(o for o in sp.stages[0].ops if o.op == "reduce_scatter" and o.msg_bytes == 2 * 2048 * 2048)
    assert layer_ar.calls_per_iter == 4 * 24 * 2 + 2 + 2  # layers, embedding output, LM-head input grad
    assert layer_ag.calls_per_iter == 4 * 24 * 2 + 2  # layers, LM-head input (fwd)
    assert layer_rs.calls_per_iter == 4 * 24 * 2 + 2 + 2  # layers, embedding output, LM-head input grad


def test_ddp_buckets_close_once_they_reach_the_cap() -> None:
    # reverse order: 3, 2, 2, 5 -> first cap 4: [3+2=5], then cap 6: [2+5=7]
    assert ddp_buckets([5, 2, 2, 3], cap_bytes=6, first_cap=4) == [5, 7]
    assert ddp_buckets([1, 1, 1], cap_bytes=100, first_cap=None) == [3]


def test_impossible_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="divisible by pp"):
        PredictInput(model=GPT_1B3, parallel=ParallelSpec(pp=5))
    with pytest.raises(ValueError, match="needs tp > 1"):
        ParallelSpec(sp=True)
