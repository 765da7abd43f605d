"""Predicted against measured on real third-party data (the harness's exactness is in test_harness.py)."""

from __future__ import annotations

from commlens.backend.compare import compare
from commlens.backend.report import build_report, render_markdown
from commlens.contract.predict import DtypeSpec, ModelSpec, ParallelSpec, PredictInput

RESNET50_PARAMS = 25_557_032


def _resnet_ddp(implementation: str = "fsdp") -> PredictInput:
    return PredictInput(
        model=ModelSpec(layers=1, hidden=1, heads=1, vocab=1, seq_len=1, params_override=RESNET50_PARAMS),
        parallel=ParallelSpec(dp=2),
        dtypes=DtypeSpec(act="float32", grad="float32", param="float32"),
        implementation=implementation,  # type: ignore[arg-type]
    )


def test_resnet50_ddp_trace_against_a_ddp_prediction(resnet) -> None:
    c = compare(resnet, "resnet", _resnet_ddp())
    (dp,) = c.schemes
    assert dp.scheme == "dp"
    assert dp.predicted_bytes_per_iter == RESNET50_PARAMS * 4
    # five all-reduce buckets add up to every parameter; two buffer broadcasts come on top, unexplained
    bcast = sum(o.msg_bytes * o.measured_calls_per_iter for o in dp.ops if o.op == "broadcast")
    assert dp.unexplained_bytes_per_iter == bcast > 0
    assert dp.measured_bytes_per_iter == RESNET50_PARAMS * 4 + bcast
    assert dp.ratio == 1.0 and dp.prediction_source == "config"
    measured_ar = [o for o in dp.ops if o.op == "all_reduce" and o.measured_calls_per_iter]
    assert len(measured_ar) == 5 and all(o.status == "bucketed" for o in dp.ops if o.op == "all_reduce")
    # DDP's per-forward BatchNorm buffer broadcasts are real traffic the gradient model does not contain
    assert {o.op for o in c.unexplained} == {"broadcast"}
    assert sum(o.measured_calls_per_iter for o in c.unexplained) == 2.0
    assert not c.missing and not c.exact
    inferred = next(i for i in c.inferences if i.quantity.startswith("parameters per rank"))
    assert inferred.value == RESNET50_PARAMS


def test_without_a_config_only_measurements_and_inferences(resnet) -> None:
    c = compare(resnet, "resnet")
    assert c.config_source == "none" and c.implementation is None
    assert c.schemes[0].predicted_bytes_per_iter == 0 and c.schemes[0].ratio is None
    # the gradient volume and the buffer broadcasts explain themselves: the API's comparison says so per scheme
    assert [(s.scheme, s.prediction_source) for s in c.schemes] == [("dp", "inferred")]
    assert any("no configuration" in n for n in c.notes)
    # nothing predicted, so nothing unexplained: every call was "unexplained", all its bytes with it
    assert {o.status for o in c.schemes[0].ops} == {"measured_only"}
    assert c.unexplained == [] and c.schemes[0].unexplained_bytes_per_iter == 0


def test_report_shape_and_markdown(resnet) -> None:
    rep = build_report(resnet, "resnet", _resnet_ddp())
    doc = rep.model_dump(mode="json")
    assert doc["run"] == "resnet"
    dp = next(s for s in doc["schemes"] if s["scheme"] == "dp")
    assert dp["predicted_bytes_per_iter"] == RESNET50_PARAMS * 4 and dp["ratio"] == 1.0
    assert {"op", "msg_bytes", "predicted_calls_per_iter", "measured_calls_per_iter"} <= set(dp["ops"][0])
    assert all({"title", "severity"} <= set(f) for f in doc["findings"])
    # the unexplained broadcasts are reported, the bucketed all-reduces are not
    ids = [f["id"] for f in doc["findings"]]
    assert "unexplained-calls:dp" in ids and "above-prediction:dp" not in ids
    md = render_markdown(rep)
    assert "| dp | 97.5 MiB | 97.7 MiB | 208 KiB | 1.000 |" in md


def test_a_stored_predictor_input_is_the_runs_config(resnet) -> None:
    """A config a user attached to a third-party run (a predictor input, not a run.json) is read by compare itself."""
    import json

    resnet.execute(
        "UPDATE runs SET config = ? WHERE name = 'resnet'", [json.dumps(_resnet_ddp().model_dump(mode="json"))]
    )
    c = compare(resnet, "resnet")
    assert c.config_source == "run" and c.implementation == "fsdp"
    assert c.schemes[0].predicted_bytes_per_iter == RESNET50_PARAMS * 4


def test_dlrm_calls_without_groups_are_unattributed(con, data_dir) -> None:
    """The DLRM job records no process group, so its calls have no scheme: unattributed in the comparison and the
    report as in every other view (tests/test_scheme_agreement.py), measured only, nothing inferred from them."""
    from commlens.backend.attribution import attribute_run
    from commlens.contract.analysis import UNATTRIBUTED
    from commlens.service.ingest import ingest_paths

    assert not ingest_paths(con, [data_dir / "kineto-param/dlrm_kineto.tar.gz"], "dlrm").failed
    attribute_run(con, "dlrm")
    c = compare(con, "dlrm")
    assert [(s.scheme, s.prediction_source) for s in c.schemes] == [(UNATTRIBUTED, "none")]
    (s,) = c.schemes
    assert {o.op for o in s.ops} == {"all_reduce", "all_to_all"}
    assert s.measured_bytes_per_iter == 448 + 907_840 + 1_576_964 + 192 + 1536 + 13_568 + 2 * 24_576
    assert c.inferences == []
    # wire bytes on the default group, the world of 8 (the traces' distributedInfo): not a group of 2
    all_reduce, all_to_all = 448 + 907_840 + 1_576_964, 192 + 1536 + 13_568 + 2 * 24_576
    assert s.measured_wire_bytes_per_iter == all_reduce * 2 * 7 / 8 + all_to_all * 7 / 8
    assert not [n for n in c.notes if n.startswith("wire bytes leave out")]
    assert any(n.startswith("unattributed: calls whose files name no process group, so no scheme") for n in c.notes)
    report = build_report(con, "dlrm")
    assert [(s.scheme, s.prediction_source) for s in report.schemes] == [(UNATTRIBUTED, "none")]


def test_wire_bytes_of_calls_without_a_group_size_are_left_out_and_said(con, data_dir) -> None:
    """A trace without distributedInfo whose all_to_alls name no group: their wire bytes were those of a group
    of 2, silently; with no size known they are left out, with a note naming them."""
    from commlens.service.ingest import ingest_paths

    trace = data_dir / "kineto-hta/rank_non_gpu/rank_non_gpu.json.gz"
    assert not ingest_paths(con, [trace], "cpu").failed
    c = compare(con, "cpu")
    (s,) = c.schemes
    assert s.measured_bytes_per_iter > 0 and s.measured_wire_bytes_per_iter == 0
    assert "wire bytes leave out unattributed all_to_all: no group size is known for them" in c.notes
