"""ResNet-50 under DDP predicted from its own parameter list, to the byte, against the shared real trace.

The description is written here from the architecture (torchvision's ResNet-50: a 7x7 stem, Bottleneck blocks
[3, 4, 6, 3] of widths 64-512 with expansion 4, a 1000-way classifier), not downloaded."""

from __future__ import annotations

from typing import Any

import pytest

from commlens.backend.compare import compare, prediction_sources
from commlens.backend.predict import predict_described
from commlens.backend.predict.described import assign_by_size, gradient_buckets
from commlens.contract.model_description import ModelDescription, TensorSpec

RESNET50_PARAMS = 25_557_032


def _bn(prefix: str, c: int, params: list[dict[str, Any]], buffers: list[dict[str, Any]]) -> None:
    params += [{"name": f"{prefix}.weight", "shape": [c], "dtype": "float32"}]
    params += [{"name": f"{prefix}.bias", "shape": [c], "dtype": "float32"}]
    buffers += [
        {"name": f"{prefix}.running_mean", "shape": [c], "dtype": "float32"},
        {"name": f"{prefix}.running_var", "shape": [c], "dtype": "float32"},
        {"name": f"{prefix}.num_batches_tracked", "shape": [], "dtype": "int64"},
    ]


def resnet50_description(dp: int = 2, **strategy: Any) -> dict[str, Any]:
    """torchvision.models.resnet50()'s named_parameters() and named_buffers(), in their order."""
    params: list[dict[str, Any]] = []
    buffers: list[dict[str, Any]] = []

    def conv(name: str, cout: int, cin: int, k: int) -> None:
        params.append({"name": name, "shape": [cout, cin, k, k], "dtype": "float32"})

    conv("conv1.weight", 64, 3, 7)
    _bn("bn1", 64, params, buffers)
    cin = 64
    for li, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3), strict=True), start=1):
        for b in range(blocks):
            p = f"layer{li}.{b}"
            conv(f"{p}.conv1.weight", width, cin, 1)
            _bn(f"{p}.bn1", width, params, buffers)
            conv(f"{p}.conv2.weight", width, width, 3)
            _bn(f"{p}.bn2", width, params, buffers)
            conv(f"{p}.conv3.weight", width * 4, width, 1)
            _bn(f"{p}.bn3", width * 4, params, buffers)
            if b == 0:
                conv(f"{p}.downsample.0.weight", width * 4, cin, 1)
                _bn(f"{p}.downsample.1", width * 4, params, buffers)
            cin = width * 4
    params += [
        {"name": "fc.weight", "shape": [1000, 2048], "dtype": "float32"},
        {"name": "fc.bias", "shape": [1000], "dtype": "float32"},
    ]
    return {
        "schema": "commlens.model-description/1",
        "model": "torchvision.models:resnet50",
        "torch_version": "2.13.0",
        "parameters": params,
        "buffers": buffers,
        "strategy": {"kind": "ddp", "dp": dp, **strategy},
    }


def test_the_description_is_resnet50() -> None:
    desc = ModelDescription.model_validate(resnet50_description())
    assert desc.param_count == RESNET50_PARAMS
    assert len(desc.parameters) == 161
    bn_counters = [b for b in desc.buffers if b.dtype == "int64"]
    assert len(bn_counters) == 53
    assert sum(b.numel for b in desc.buffers if b.dtype == "float32") == 53_120


def test_ddp_buckets_by_the_reducers_rules() -> None:
    desc = ModelDescription.model_validate(resnet50_description())
    buckets = gradient_buckets(desc)
    # the 1 MiB first bucket closes on fc.weight (fc.bias 4,000 B + 8,192,000 B), then 25 MiB caps; the order is
    # the trace's launch order within a step
    assert buckets == [
        ("float32", 8_196_000),
        ("float32", 31_502_336),
        ("float32", 26_255_360),
        ("float32", 26_550_272),
        ("float32", 9_724_160),
    ]
    assert sum(b for _, b in buckets) == RESNET50_PARAMS * 4
    # an explicit bucket_cap_mb makes the first bucket that cap too (PyTorch 2.13), unless recorded otherwise
    capped = ModelDescription.model_validate(resnet50_description(bucket_cap_mb=50))
    assert gradient_buckets(capped) == [("float32", 56_512_416), ("float32", 45_715_712)]
    old = ModelDescription.model_validate(resnet50_description(bucket_cap_mb=50, first_bucket_bytes=2**20))
    assert gradient_buckets(old)[0] == ("float32", 8_196_000)


def test_buckets_per_dtype_and_a_tensor_over_the_cap() -> None:
    t = [
        TensorSpec(name="a", shape=[10], dtype="float32"),
        TensorSpec(name="b", shape=[100], dtype="bfloat16"),
        TensorSpec(name="big", shape=[1000], dtype="float32"),
        TensorSpec(name="c", shape=[3], dtype="float32"),
        TensorSpec(name="d", shape=[20], dtype="int64"),
    ]
    # limits 64 B then 256 B per dtype: float32 closes at 'big' (40 + 4000 B), bfloat16 at 'b' (200 >= 64)
    assert assign_by_size(t, [64, 256]) == [
        ("bfloat16", 200),
        ("float32", 4040),
        ("int64", 160),
        ("float32", 12),
    ]


def test_resnet50_trace_predicted_to_the_byte(resnet) -> None:
    """Every (op, dtype, S) the trace measures per iteration equals the description's prediction."""
    desc = ModelDescription.model_validate(resnet50_description())
    pred = predict_described(desc)
    ops = {(o.op, o.dtype, o.msg_bytes): o.calls_per_iter for o in pred.stages[0].ops}
    assert ops == {
        ("broadcast", "float32", 212_480): 1,
        ("broadcast", "int64", 424): 1,
        ("all_reduce", "float32", 8_196_000): 1,
        ("all_reduce", "float32", 26_550_272): 1,
        ("all_reduce", "float32", 31_502_336): 1,
        ("all_reduce", "float32", 26_255_360): 1,
        ("all_reduce", "float32", 9_724_160): 1,
    }
    c = compare(resnet, "resnet", desc)
    assert c.exact, [(o.op, o.msg_bytes, o.status) for s in c.schemes for o in s.ops]
    assert c.implementation == "described:ddp"
    (dp,) = c.schemes
    assert [(o.op, o.dtype, o.msg_bytes, o.measured_calls_per_iter, o.status) for o in dp.ops] == [
        ("all_reduce", "float32", 8_196_000, 1.0, "match"),
        ("all_reduce", "float32", 9_724_160, 1.0, "match"),
        ("all_reduce", "float32", 26_255_360, 1.0, "match"),
        ("all_reduce", "float32", 26_550_272, 1.0, "match"),
        ("all_reduce", "float32", 31_502_336, 1.0, "match"),
        ("broadcast", "float32", 212_480, 1.0, "match"),
        ("broadcast", "int64", 424, 1.0, "match"),
    ]
    assert dp.predicted_bytes_per_iter == dp.measured_bytes_per_iter == RESNET50_PARAMS * 4 + 212_480 + 424
    assert prediction_sources(c) == {"dp": "config"}


def test_other_strategies_are_refused_by_name() -> None:
    desc = ModelDescription.model_validate(resnet50_description() | {"strategy": {"kind": "fsdp", "dp": 2}})
    with pytest.raises(ValueError, match=r"strategy\.kind 'fsdp'"):
        predict_described(desc)
