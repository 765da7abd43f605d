"""`commlens config` / `PUT /api/runs/{run}/config`: files detected by content, combined with the options they
lack, stored as the run's configuration, and refused naming the file and the line or field that is wrong."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest
from test_resnet50_prediction import RESNET50_PARAMS, resnet50_description

from commlens import store
from commlens.backend.api import Settings
from commlens.backend.api.testing import ServerThread
from commlens.backend.compare import compare
from commlens.backend.iterations import UnknownRunError
from commlens.backend.report import build_report
from commlens.cli_server import announce, withdraw
from commlens.contract.model_description import ConfigFile, ConfigUpload, ModelDescription, ParallelOptions
from commlens.frontend.client import ApiClient, ApiProblem
from commlens.service.config import attach_config
from commlens.service.errors import ConflictError, InvalidError
from commlens.service.runs import create_run, predict_input_for_run, run_detail

ROOT = Path(__file__).resolve().parents[1]

HF_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_attention_heads": 32,
    "num_hidden_layers": 22,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
DEEPSPEED = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": 50_000_000, "stage3_param_persistence_threshold": "auto"},
}
MEGATRON_LOG = """\
[default0]:using world size: 16, data-parallel size: 2, context-parallel size: 1, tensor-model-parallel size: 4
[default0]:------------------------ arguments ------------------------
[default0]:  accumulate_allreduce_grads_in_fp32 .............. True
[default0]:  bf16 ............................................ True
[default0]:  data_parallel_size .............................. 2
[default0]:  ffn_hidden_size ................................. 16384
[default0]:  global_batch_size ............................... 64
[default0]:  hidden_size ..................................... 4096
[default0]:  make_vocab_size_divisible_by .................... 128
[default0]:  micro_batch_size ................................ 1
[default0]:  num_attention_heads ............................. 32
[default0]:  num_layers ...................................... 32
[default0]:  padded_vocab_size ............................... 50688
[default0]:  params_dtype .................................... torch.bfloat16
[default0]:  pipeline_model_parallel_size .................... 2
[default0]:  position_embedding_type ......................... rope
[default0]:  sequence_parallel ............................... True
[default0]:  seq_length ...................................... 4096
[default0]:  tensor_model_parallel_size ...................... 4
[default0]:  untie_embeddings_and_output_weights ............. True
[default0]:  use_distributed_optimizer ....................... True
[default0]:-------------------- end of arguments ---------------------
[default0]:setting number of micro-batches to constant 32
"""


def _file(name: str, doc: object) -> ConfigFile:
    return ConfigFile(name=name, content=doc if isinstance(doc, str) else json.dumps(doc, indent=2))


def test_a_description_makes_the_resnet_trace_exact(resnet) -> None:
    got = attach_config(resnet, "resnet", [_file("resnet50.json", resnet50_description(dp=1))], ParallelOptions(dp=2))
    assert got.stored == "model_description"
    assert [(f.name, f.kind) for f in got.files] == [("resnet50.json", "model_description")]
    assert got.summary.startswith(f"torchvision.models:resnet50: 161 parameters ({RESNET50_PARAMS:,} elements)")
    detail = run_detail(resnet, "resnet")
    assert (detail["strategy"], detail["world_size"], detail["config_kind"]) == ("ddp", 2, "model_description")
    assert predict_input_for_run(resnet, "resnet") is None  # not a transformer input: the comparison reads it
    c = compare(resnet, "resnet")
    assert (c.config_source, c.implementation, c.exact) == ("run", "described:ddp", True)
    assert [(s.scheme, s.prediction_source) for s in c.schemes] == [("dp", "config")]
    report = json.loads(build_report(resnet, "resnet").model_dump_json())
    assert [(s["scheme"], s["prediction_source"]) for s in report["schemes"]] == [("dp", "config")]


def test_without_configuration_the_trace_explains_itself(resnet) -> None:
    report = build_report(resnet, "resnet")
    assert [(s.scheme, s.prediction_source, s.predicted_bytes_per_iter) for s in report.schemes] == [
        ("dp", "inferred", None)
    ]
    inferred = {i.quantity.split(" (")[0]: i for i in report.comparison.inferences}
    assert inferred["parameters per rank"].value == RESNET50_PARAMS
    assert inferred["buffer elements"].value == 53_120 + 53
    assert "53,120 float32, 53 int64" in inferred["buffer elements"].evidence


def test_report_config_reads_a_model_description(resnet, db_path: Path, tmp_path: Path) -> None:
    """`commlens report --config` detects its file by content as `commlens config` does: a model description
    makes the ResNet-50 trace exact without attaching anything; a file that says only part of a configuration,
    or a description with a bad field, is refused naming the file (and the field)."""
    resnet.close()  # the CLI opens the store itself
    (tmp_path / "resnet50.json").write_text(json.dumps(resnet50_description(dp=2)))
    (tmp_path / "config.json").write_text(json.dumps(HF_LLAMA))
    broken = resnet50_description(dp=2)
    broken["parameters"][0]["shape"] = "wide"
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    cli = [str(ROOT / ".venv" / "bin" / "commlens"), "report", "--db", str(db_path), "--run", "resnet"]

    def report(name: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*cli, "--format", "json", "--config", str(tmp_path / name)],
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
            env={**os.environ, "COLUMNS": "400"},
        )

    ok = report("resnet50.json")
    assert ok.returncode == 0, ok.stderr
    doc = json.loads(ok.stdout)
    assert (doc["exact"], doc["comparison"]["config_source"], doc["comparison"]["implementation"]) == (
        True,
        "supplied",
        "described:ddp",
    )
    assert [(s["scheme"], s["prediction_source"], s["predicted_bytes_per_iter"]) for s in doc["schemes"]] == [
        ("dp", "config", RESNET50_PARAMS * 4 + 53_120 * 4 + 53 * 8)
    ]
    partial = report("config.json")
    assert (
        partial.returncode == 2
        and "config.json: a Hugging Face config.json says only part of a configuration" in partial.stderr
    )
    bad = report("broken.json")
    assert bad.returncode == 2 and "broken.json: parameters.0.shape" in bad.stderr
    # Megatron's argument block says the model and its layout, as `commlens config train.log` alone stores it (it
    # was refused as "only part of a configuration"); this one is of a 16-rank job, so it is not exact here
    (tmp_path / "train.log").write_text(MEGATRON_LOG)
    mega = report("train.log")
    assert mega.returncode == 0, mega.stderr
    doc = json.loads(mega.stdout)
    assert doc["comparison"]["implementation"] == "megatron" and not doc["exact"]
    assert doc["comparison"]["another_job"].startswith("the configuration describes a job of 16 ranks")


def test_hugging_face_and_deepspeed_combine_with_options(con) -> None:
    create_run(con, "llama")
    got = attach_config(
        con, "llama", [_file("config.json", HF_LLAMA), _file("ds.json", DEEPSPEED)], ParallelOptions(dp=8, seq_len=1024)
    )
    assert [f.kind for f in got.files] == ["hf_config", "deepspeed_config"]
    assert got.stored == "predict_input"
    inp = predict_input_for_run(con, "llama")
    assert inp is not None
    m, p = inp.model, inp.parallel
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.ffn_hidden, m.vocab, m.seq_len) == (
        22,
        2048,
        32,
        4,
        5632,
        32000,
        1024,
    )
    assert (m.tied_embeddings, m.learned_pos) == (False, False)
    assert (p.dp, p.zero, p.micro_batches, p.micro_batch_size) == (8, 3, 4, 2)
    assert (inp.implementation, inp.dtypes.param, inp.buckets.deepspeed_reduce_bucket_elems) == (
        "deepspeed",
        "bfloat16",
        50_000_000,
    )
    assert any("stage3_param_persistence_threshold is 'auto'" in n for n in got.notes)
    assert not any("max_position_embeddings" in n for n in got.notes)  # --seq-len said it, not the config
    assert run_detail(con, "llama")["world_size"] == 8
    positions = attach_config(con, "llama", [_file("config.json", HF_LLAMA)], ParallelOptions(dp=8))
    assert predict_input_for_run(con, "llama").model.seq_len == 2048  # type: ignore[union-attr]
    assert "config.json: sequence length 2048 from max_position_embeddings (give --seq-len if training used less)" in (
        positions.notes
    )


@pytest.mark.parametrize("prefix", ["0: ", "2024-05-01 12:00:01,123 INFO ", "[rank0]: "])
def test_megatron_arguments_behind_any_launcher_prefix(con, prefix: str) -> None:
    """srun --label's '0: ' and a logger's timestamp were refused ("line 3: not an argument line"), where NCCL
    logs behind the same prefixes are read."""
    create_run(con, "gpt")
    text = MEGATRON_LOG.replace("[default0]:", prefix).replace("\n", "\r\n")
    attach_config(con, "gpt", [_file("train.log", text)])
    create_run(con, "ref")
    attach_config(con, "ref", [_file("train.log", MEGATRON_LOG)])
    got = predict_input_for_run(con, "gpt")
    assert got is not None and got == predict_input_for_run(con, "ref") and got.parallel.tp == 4


def test_megatron_arguments_from_a_log(con) -> None:
    create_run(con, "gpt")
    got = attach_config(con, "gpt", [_file("train.log", MEGATRON_LOG)])
    assert [f.kind for f in got.files] == ["megatron_args"]
    inp = predict_input_for_run(con, "gpt")
    assert inp is not None
    assert inp.implementation == "megatron"
    m, p = inp.model, inp.parallel
    assert (m.layers, m.hidden, m.vocab, m.seq_len, m.learned_pos, m.tied_embeddings) == (
        32,
        4096,
        50688,
        4096,
        False,
        False,
    )
    assert (p.dp, p.tp, p.pp, p.sp, p.zero, p.micro_batches) == (2, 4, 2, True, 1, 32)
    assert (inp.dtypes.param, inp.dtypes.grad) == ("bfloat16", "float32")
    assert p.world_size == 16


@pytest.mark.parametrize(
    ("files", "options", "message"),
    [
        ([("cfg.json", '{\n  "model_type": "llama",\n  "hidden_size": 20,,\n}')], {}, "cfg.json: line 3 column 21"),
        ([("x.json", {"foo": 1})], {}, "x.json: not a configuration commlens reads"),
        ([("notes.txt", "hello")], {}, "notes.txt: neither JSON"),
        ([("ds.json", DEEPSPEED)], {}, "says how the model is trained, not what it is"),
        ([("config.json", HF_LLAMA | {"hidden_size": "big"})], {}, "model.hidden"),
        (
            [("config.json", {k: v for k, v in HF_LLAMA.items() if k != "vocab_size"})],
            {},
            "config.json: no 'vocab_size'",
        ),
        (
            [("train.log", MEGATRON_LOG.replace("  bf16 ....", "  bf16 broken"))],
            {},
            "train.log: line 4: not an argument line",
        ),
        (
            [("train.log", MEGATRON_LOG.split("[default0]:---------------- end")[0][:900])],
            {},
            "no '---- end of arguments",
        ),
        (
            [("d.json", resnet50_description() | {"buffers": [{"name": "b", "shape": [1], "dtype": "f32"}]})],
            {},
            "d.json: buffers.0",
        ),
        ([("d.json", resnet50_description())], {"tp": 2}, "a model description takes only --dp (got tp)"),
        ([("d.json", resnet50_description()), ("config.json", HF_LLAMA)], {}, "attach it alone"),
        (
            [("config.json", HF_LLAMA), ("ds.json", DEEPSPEED | {"gradient_accumulation_steps": "four"})],
            {},
            "ds.json: gradient_accumulation_steps: a number",
        ),
    ],
)
def test_bad_files_name_the_line_or_field(con, files: list[tuple[str, object]], options: dict, message: str) -> None:
    create_run(con, "r")
    with pytest.raises(InvalidError) as err:
        attach_config(con, "r", [_file(n, d) for n, d in files], ParallelOptions(**options))
    assert message in str(err.value)
    assert run_detail(con, "r")["config"] is None


def test_an_unknown_run_is_refused_before_reading(con) -> None:
    with pytest.raises(UnknownRunError):
        attach_config(con, "nope", [_file("x.json", {"foo": 1})])


def test_a_configuration_of_another_job_size_is_refused(resnet, data_dir: Path) -> None:
    """The trace's distributedInfo says world size 2: a description of 1 rank or a predictor input of 16 is
    not this job, and attaching it would have set the run's world size to it (the report then counted the
    trace's ranks against the wrong world)."""
    one_rank = [_file("resnet50.json", resnet50_description(dp=1))]
    with pytest.raises(ConflictError) as err:
        attach_config(resnet, "resnet", one_rank)
    assert err.value.kind == "config-world-mismatch"
    assert err.value.detail.startswith(
        "resnet50.json (ddp) describes a job of 1 rank, but the run's profiler traces say world size 2"
    )
    with pytest.raises(ConflictError, match=r"train.log describes a job of 16 ranks, but .* world size 2"):
        attach_config(resnet, "resnet", [_file("train.log", MEGATRON_LOG)])
    detail = run_detail(resnet, "resnet")
    assert (detail["world_size"], detail["config_kind"]) == (2, None)  # nothing was stored
    # a description naming no strategy is DDP over one rank, and the refusal says it was assumed
    bare = {k: v for k, v in resnet50_description().items() if k != "strategy"}
    with pytest.raises(
        ConflictError, match=r"^bare.json \(no strategy, so DDP over 1 rank\) describes a job of 1 rank"
    ):
        attach_config(resnet, "resnet", [_file("bare.json", bare)])
    assert run_detail(resnet, "resnet")["config_kind"] is None
    assert attach_config(resnet, "resnet", [_file("bare.json", bare)], ParallelOptions(dp=2)).summary.endswith(
        "ddp over 2 ranks"
    )
    # supplied for one comparison (`commlens report --config`, a what-if), it is said to be another job's
    supplied = compare(resnet, "resnet", ModelDescription.model_validate(resnet50_description(dp=1)))
    assert (
        "the configuration describes a job of 1 rank, but the run's profiler traces say world size 2 "
        "(distributedInfo) (1 file(s)): it predicts another job"
    ) in supplied.notes
    # however its counts compare, it is not this job's prediction: no "predicted equals measured" headline
    assert not supplied.exact and supplied.another_job in supplied.notes
    from commlens.backend.report import build_report, render_markdown

    md = render_markdown(build_report(resnet, "resnet", ModelDescription.model_validate(resnet50_description(dp=1))))
    assert "predicted equals measured" not in md
    assert "**Not exact:** the configuration describes a job of 1 rank, but the run's profiler traces say" in md
    same = compare(resnet, "resnet", ModelDescription.model_validate(resnet50_description(dp=2)))
    assert not [n for n in same.notes if "another job" in n]
    assert same.another_job is None and same.exact
    # the trace is rank 0's of the two: exact for the rank it holds, and said to be that (the report claimed
    # "predicted equals measured for every scheme" of one rank's file as of the whole job)
    assert (
        same.ranks_absent == 1
        and (
            "the run's files hold 1 of the job's 2 ranks (missing: 1): predicted against measured covers those ranks only"
        )
        in same.notes
    )
    md = render_markdown(build_report(resnet, "resnet", ModelDescription.model_validate(resnet50_description(dp=2))))
    assert (
        "**predicted equals measured for every scheme** (of the ranks the files hold: 1 of the job's are missing)" in md
    )
    assert attach_config(resnet, "resnet", one_rank, ParallelOptions(dp=2)).stored == "model_description"
    # an NCCL log's communicators: no job smaller than its largest one
    from commlens.service.ingest import ingest_paths

    assert not ingest_paths(resnet, [data_dir / "nccl-logs/nvidia-nccl-1193.log"], "logs").failed
    with pytest.raises(ConflictError, match="the run's files hold a communicator of 128 ranks"):
        attach_config(resnet, "logs", [_file("config.json", HF_LLAMA)], ParallelOptions(dp=2))


def test_a_configuration_larger_than_a_closed_job_of_nccl_logs_is_refused(con, tmp_path: Path) -> None:
    """NCCL logs whose every communicator has all its members in the files are a whole job: a description of
    more ranks was accepted and set the world size to it (a 4-rank job described as dp 8 became 8 ranks and its
    world communicator tp)."""
    from nccl_bench import nccl_bench

    from commlens.service.ingest import ingest_paths

    nccl_bench().write_interleaved(tmp_path / "job.log", 4_000, "2.21.5")  # 8 processes, 13 communicators
    assert not ingest_paths(con, [tmp_path / "job.log"], "job").failed
    with pytest.raises(ConflictError) as err:
        attach_config(con, "job", [_file("config.json", HF_LLAMA)], ParallelOptions(dp=16))
    assert err.value.kind == "config-world-mismatch"
    assert "describes a job of 16 ranks, but the run's NCCL logs hold every member of each of their 13 " in str(
        err.value.detail
    )
    assert run_detail(con, "job")["world_size"] == 8
    assert attach_config(con, "job", [_file("config.json", HF_LLAMA)], ParallelOptions(dp=8)).stored


def test_a_supplied_layout_unlike_the_runs_own_is_said(resnet) -> None:
    """`commlens report --config` of another layout than the run's own configuration (a ZeRO-1 run.json on a TP
    run) compared silently: every call 'missing' under one scheme and 'unexplained' under another."""
    attach_config(resnet, "resnet", [_file("config.json", HF_LLAMA)], ParallelOptions(dp=2))
    own = predict_input_for_run(resnet, "resnet")
    assert own is not None
    other = own.model_copy(update={"parallel": own.parallel.model_copy(update={"dp": 1, "tp": 2, "sp": True})})
    notes = compare(resnet, "resnet", other).notes
    assert (
        "the configuration's layout (tp 2, sp) is not the run's own (dp 2): the comparison is of another layout"
        in notes
    )
    assert not [n for n in compare(resnet, "resnet", own).notes if "layout" in n]


def test_cli_attaches_and_explains_refusals(tmp_path: Path, db_path: Path) -> None:
    con = store.connect(db_path)
    create_run(con, "llama")
    con.close()
    (tmp_path / "config.json").write_text(json.dumps(HF_LLAMA))
    (tmp_path / "bad.json").write_text("{\n  oops\n}")
    cli = str(ROOT / ".venv" / "bin" / "commlens")
    ok = subprocess.run(
        [
            cli,
            "config",
            "--db",
            str(db_path),
            "--run",
            "llama",
            str(tmp_path / "config.json"),
            "--dp",
            "4",
            "--tp",
            "2",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert "config.json: hf_config" in ok.stdout
    assert "run llama: predict_input: fsdp: 22 layers, hidden 2048" in ok.stdout and "dp 4 tp 2" in ok.stdout
    bad = subprocess.run(
        [cli, "config", "--db", str(db_path), "--run", "llama", str(tmp_path / "bad.json")],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert bad.returncode == 2
    assert "bad.json: line 2 column 3" in bad.stderr


def test_api_put_config_and_the_client(tmp_path: Path) -> None:
    db = tmp_path / "api.duckdb"
    con = store.connect(db)
    create_run(con, "gpt")
    con.close()
    with ServerThread(Settings(db=db)) as srv:
        client = ApiClient(srv.url)
        got = client.attach_config("gpt", ConfigUpload(files=[_file("train.log", MEGATRON_LOG)]))
        assert got.stored == "predict_input" and got.files[0].kind == "megatron_args"
        assert client.run("gpt").world_size == 16
        with pytest.raises(ApiProblem) as err:
            client.attach_config("gpt", ConfigUpload(files=[_file("x.json", {"foo": 1})]))
        assert err.value.status == 422 and "x.json: not a configuration" in err.value.detail
        r = httpx.put(f"{srv.url}/api/runs/missing/config", json={"files": [{"name": "a", "content": "{}"}]})
        assert r.status_code == 404
        r = httpx.put(f"{srv.url}/api/runs/gpt/config", json={"files": [], "options": {"dp": 0}})
        assert r.status_code == 422 and "files" in r.text
        # the CLI goes through the server that holds the store (the file itself is locked by it)
        (tmp_path / "config.json").write_text(json.dumps(HF_LLAMA))
        announce(db, srv.url)
        try:
            cli = [str(ROOT / ".venv" / "bin" / "commlens"), "config", "--db", str(db), "--run", "gpt"]
            ok = subprocess.run(
                [*cli, str(tmp_path / "config.json"), "--dp", "2"],
                capture_output=True,
                text=True,
                check=False,
                timeout=120,
            )
            assert ok.returncode == 0, ok.stderr
            assert "run gpt: predict_input: fsdp: 22 layers" in ok.stdout
            assert client.run("gpt").world_size == 2
            bad = subprocess.run(
                [*cli, str(tmp_path / "config.json"), "--tp", "3"],
                capture_output=True,
                text=True,
                check=False,
                timeout=120,
            )
            assert bad.returncode == 2 and "heads (32) must be divisible by tp (3)" in bad.stderr
        finally:
            withdraw(db)
