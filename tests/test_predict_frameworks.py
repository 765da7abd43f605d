"""Framework specifics of the predictor (docs/models.md §5.3, §8.1), run.json inputs and the check of
the predictor's parameter counts against a run's recorded ones. Expected numbers are worked out by hand
from the spec in each test."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from commlens.backend.predict import predict, predict_input_from_config
from commlens.contract.predict import ModelSpec, ParallelSpec, PredictInput

# L = 2, h = 64, a = 8, s = 128, GPT-2 vocabulary; bf16 (2 bytes)
SMALL_GPT2 = {"layers": 2, "hidden": 64, "heads": 8, "vocab": 50257, "seq_len": 128}


def _ops(stage) -> dict[tuple[str, str, str, int], int]:
    return {(o.scheme, o.group, o.op, o.msg_bytes): o.calls_per_iter for o in stage.ops}


# ------------------------------------------------------------------------- vocabulary padding


def _padded_case(implementation: str, **model) -> PredictInput:
    return PredictInput(
        model=ModelSpec(**SMALL_GPT2, tied_embeddings=True, **model),
        parallel=ParallelSpec(dp=2, tp=8, pp=2),
        implementation=implementation,
    )  # type: ignore[arg-type]


def test_megatron_pads_the_vocabulary_to_128_x_tp_and_paper_does_not() -> None:
    # §5.3: 50257 up to a multiple of 128 * 8 = 1024 -> 50 * 1024 = 51200.
    # One layer per stage on a tp rank: (12h² + 7h)/t + 6h = (49152 + 448)/8 + 384 = 6584.
    # Stage 0: V h/t + s h + layer; stage 1: layer + 2h (ln_f) + V h/t (tied embedding copy, p > 1).
    mega, paper = predict(_padded_case("megatron")), predict(_padded_case("paper"))
    assert [st.params_per_rank for st in mega.stages] == [51200 * 64 // 8 + 8192 + 6584, 6584 + 128 + 51200 * 64 // 8]
    assert [st.params_per_rank for st in paper.stages] == [50257 * 64 // 8 + 8192 + 6584, 6584 + 128 + 50257 * 64 // 8]
    assert [st.params_per_rank for st in mega.stages] == [424_376, 416_312]
    assert [st.params_per_rank for st in paper.stages] == [416_832, 408_768]
    m0, p0 = _ops(mega.stages[0]), _ops(paper.stages[0])
    # tied-embedding gradient between first and last stage (§6.5): V h w / t
    assert m0[("pp", "pp:embedding", "all_reduce", 51200 * 64 * 2 // 8)] == 1  # 819200 B
    assert p0[("pp", "pp:embedding", "all_reduce", 50257 * 64 * 2 // 8)] == 1  # 804112 B
    # DP gradient all_reduce of stage 0 (one Megatron bucket, < 4e7 parameters): Ψ_r w
    assert m0[("dp", "dp", "all_reduce", 424_376 * 2)] == 1
    assert p0[("dp", "dp", "all_reduce", 416_832 * 2)] == 1
    # the model's parameter count stays one unpadded copy: (V + s) h + L (12h² + 13h) + 2h
    assert mega.param_count == paper.param_count == (50257 + 128) * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 128
    assert any("51,200" in n for n in mega.notes) and not any("padded" in n for n in paper.notes)


def test_an_explicit_vocab_divisible_by_wins_over_the_megatron_default() -> None:
    # Megatron's rule with make_vocab_size_divisible_by = 1 still pads to a multiple of t: 50257 -> 50264
    by_one = predict(_padded_case("megatron", vocab_divisible_by=1))
    assert _ops(by_one.stages[0])[("pp", "pp:embedding", "all_reduce", 50264 * 64 * 2 // 8)] == 1
    # §5.3's own examples: 50304 at t = 1, 50432 at t = 2
    gpt2 = ModelSpec(**{**SMALL_GPT2, "heads": 8}, vocab_divisible_by=128)
    assert (gpt2.padded_vocab(1), gpt2.padded_vocab(2)) == (50304, 50432)


def _cli_predict(*args: str) -> dict:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "commlens.cli",
            "predict",
            "--layers",
            "2",
            "--hidden",
            "64",
            "--heads",
            "8",
            "--vocab",
            "50257",
            "--seq-len",
            "128",
            "--tp",
            "8",
            "--pp",
            "2",
            "--dp",
            "2",
            "--tied",
            "--format",
            "json",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _embedding_sync_bytes(pred: dict) -> int:
    return next(o["msg_bytes"] for o in pred["stages"][0]["ops"] if o["group"] == "pp:embedding")


def test_cli_vocab_divisible_by_flag() -> None:
    assert _embedding_sync_bytes(_cli_predict("--implementation", "megatron")) == 51200 * 64 * 2 // 8
    assert (
        _embedding_sync_bytes(_cli_predict("--implementation", "megatron", "--vocab-divisible-by", "1"))
        == 50264 * 64 * 2 // 8
    )
    assert _embedding_sync_bytes(_cli_predict()) == 804_112  # paper: unpadded, V h w / t
    # 64 * 8 = 512: 50257 -> 99 * 512 = 50688
    assert _embedding_sync_bytes(_cli_predict("--vocab-divisible-by", "64")) == 50688 * 64 * 2 // 8


# ---------------------------------------------------------------------- DeepSpeed ZeRO-1/2


@pytest.mark.parametrize(("zero", "m"), [(1, 1), (2, 4)])
def test_deepspeed_zero12_reduce_and_gather_buckets_are_merged(zero: int, m: int) -> None:
    # Ψ = 1.2e9 on d = 8, buckets of 5e8 elements: [5e8, 5e8, 2e8]. §8.1: one reduce per destination rank
    # of bucket/d elements, so 8 reduces per bucket (x m micro-steps for ZeRO-2); all_gather per bucket.
    inp = PredictInput(
        model=ModelSpec(layers=1, hidden=1, heads=1, vocab=1, seq_len=1, params_override=1_200_000_000),
        parallel=ParallelSpec(dp=8, zero=zero, micro_batches=m),
        implementation="deepspeed",
    )
    ops = predict(inp).stages[0].ops
    keys = [(o.op, o.msg_bytes) for o in ops]
    assert len(keys) == len(set(keys)) == 4
    calls = {(o.op, o.msg_bytes): o.calls_per_iter for o in ops}
    assert calls == {
        ("reduce", 500_000_000 * 2 // 8): 2 * 8 * m,
        ("reduce", 200_000_000 * 2 // 8): 8 * m,
        ("all_gather", 500_000_000 * 2): 2,
        ("all_gather", 200_000_000 * 2): 1,
    }


# --------------------------------------------------------------------------- run.json inputs


def _run_json(model: dict, parallel: dict, world: int, implementation: str, **extra) -> dict:
    return {
        "schema": "commlens.run/1",
        "strategy": "test",
        "world_size": world,
        "model": model,
        "parallel": parallel,
        "implementation": implementation,
        **extra,
    }


def test_run_json_implementation_and_megatron_padding_are_carried() -> None:
    model = dict(SMALL_GPT2)
    inp = predict_input_from_config(_run_json(model, {"tp": 2}, 2, "megatron"))
    assert inp.implementation == "megatron"
    # V padded to 50432 (§5.3, t = 2); untied: embedding and LM head V h/t each, one layer pair
    # 2 * ((12h² + 7h)/2 + 6h) = 2 * 25184, s h = 8192, ln_f 2h = 128
    (st,) = predict(inp).stages
    assert st.params_per_rank == 2 * 50432 * 64 // 2 + 8192 + 2 * 25184 + 128 == 3_286_336
    assert predict_input_from_config(_run_json(model, {"tp": 2}, 2, "paper")).implementation == "paper"
    assert predict_input_from_config(_run_json(model, {"tp": 2}, 2, "fsdp")).implementation == "fsdp"
    with pytest.raises(ValueError, match="unknown implementation 'jax'"):
        predict_input_from_config(_run_json(model, {"tp": 2}, 2, "jax"))


def test_run_json_cp_recompute_kv_heads_are_carried() -> None:
    cfg = _run_json(
        {**SMALL_GPT2, "kv_heads": 2}, {"tp": 2, "cp": 2, "recompute": "full", "micro_batches": 2}, 4, "megatron"
    )
    inp = predict_input_from_config(cfg)
    assert (inp.parallel.cp, inp.parallel.recompute, inp.model.kv_heads) == (2, "full", 2)
    ops = _ops(predict(inp).stages[0])
    # run.json dtypes default to float32 (w = 4)
    # §6.7 ring: S = 2 b (s/c) h_kv w = 2 * 64 * (64 * 2/8) * 4 = 8192; 3 (c-1) l m = 12 sends
    assert ops[("cp", "cp:ring", "send", 8192)] == 12
    # §6.3 with s/c: A = 64 * 64 * 4 = 16384; 4 l m + 2 l m (full recompute) + m (embedding) + m (LM head)
    assert ops[("tp", "tp", "all_reduce", 16384)] == 16 + 8 + 2 + 2


def test_run_json_framework_buckets_are_carried() -> None:
    # Ψ = 2 V h + s h + L (12h² + 13h) + 2h = 32768 + 8192 + 99968 + 128 = 141056 (V = 256, untied); float32
    model = {**SMALL_GPT2, "vocab": 256}

    def sizes(cfg: dict, op: str) -> dict[int, int]:
        return {
            o.msg_bytes: o.calls_per_iter for o in predict(predict_input_from_config(cfg)).stages[0].ops if o.op == op
        }

    # default 5e8-element buckets: one bucket, d = 2 reduces of Ψ/d * 4 B
    assert sizes(_run_json(model, {"dp": 2, "zero": 1}, 2, "deepspeed"), "reduce") == {141056 * 4 // 2: 2}
    cfg = _run_json(
        model,
        {"dp": 2, "zero": 1},
        2,
        "deepspeed",
        buckets={"deepspeed_reduce_bucket_elems": 100_000, "deepspeed_allgather_bucket_elems": 50_000},
    )
    # reduce buckets [100000, 41056] elements: d = 2 reduces of bucket/d * 4 B each
    assert sizes(cfg, "reduce") == {200_000: 2, 82_112: 2}
    # all_gather buckets [50000, 50000, 41056] elements, S = bucket * 4 B
    assert sizes(cfg, "all_gather") == {200_000: 2, 164_224: 1}


# ----------------------------------------------------------------------- parameter-count check

# The harness GPT (harness/README.md): L = 2, h = 32, a = 4, V = 64, s = 16 on t = 2, p = 2 (a layer per stage).
HARNESS_MODEL = {"layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "seq_len": 16}
PSI = 2 * 64 * 32 + 16 * 32 + 2 * (12 * 32 * 32 + 13 * 32) + 2 * 32  # 30080
LAYER = (12 * 32 * 32 + 7 * 32) // 2 + 6 * 32  # 6448 per layer on a tp rank
PSI_STAGE0 = 64 * 32 // 2 + 16 * 32 + LAYER  # 7984
PSI_STAGE1 = LAYER + 2 * 32 + 64 * 32 // 2  # 7536


def harness_run_json(total: int = PSI, per_rank: dict[int, int] | None = None) -> dict:
    per_rank = per_rank or {0: PSI_STAGE0, 1: PSI_STAGE0, 2: PSI_STAGE1, 3: PSI_STAGE1}
    return _run_json(
        {**HARNESS_MODEL, "param_count": total},
        {"tp": 2, "pp": 2},
        4,
        "harness",
        ranks=[{"rank": r, "param_count": n} for r, n in per_rank.items()],
    )


def test_recorded_parameter_counts_that_agree() -> None:
    assert (PSI, PSI_STAGE0, PSI_STAGE1) == (30080, 7984, 7536)
    pred = predict(predict_input_from_config(harness_run_json()))
    assert pred.param_check is not None and pred.param_check.agrees
    assert any("exact to the byte" in n for n in pred.notes)
    assert any("agree with the run's record (model 30,080, 4 ranks)" in n for n in pred.notes)


def test_recorded_parameter_counts_that_disagree() -> None:
    wrong_total = predict(predict_input_from_config(harness_run_json(total=PSI + 1)))
    assert wrong_total.param_check is not None and not wrong_total.param_check.agrees
    assert "model: 30,081 recorded, 30,080 from the model config" in wrong_total.param_check.notes[0]
    assert not any("exact to the byte" in n for n in wrong_total.notes)
    wrong_rank = predict(
        predict_input_from_config(
            harness_run_json(per_rank={0: PSI_STAGE0, 1: PSI_STAGE0, 2: PSI_STAGE1, 3: PSI_STAGE0})
        )
    )
    assert not wrong_rank.param_check.agrees  # type: ignore[union-attr]
    assert "rank 3: 7,984 recorded, 7,536 predicted (stage 1)" in wrong_rank.param_check.notes[0]  # type: ignore[union-attr]
    # the textbook predictor checks the same counts
    paper = predict(predict_input_from_config({**harness_run_json(total=PSI + 1), "implementation": "paper"}))
    assert not paper.param_check.agrees  # type: ignore[union-attr]
