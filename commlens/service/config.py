"""Attach configuration to a run (`commlens config`, `PUT /api/runs/{run}/config`), detecting each file by its
content: a model description (`commlens describe-model`), a harness run.json, a predictor input, a Hugging Face
config.json, a DeepSpeed JSON config, or the argument block Megatron-LM prints at start-up.

A model description or a run.json says everything and is stored as it is. The others say part of it (a model,
how it is trained) and combine into one predictor input, with the options (`--dp/--tp/...`) for what no file
says. Bad files are refused naming the file and the line or field that is wrong (docs/model-descriptions.md)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import duckdb
from pydantic import ValidationError

from commlens.backend.compare import DESCRIPTION_KEY
from commlens.backend.iterations import run_id_of
from commlens.contract.model_description import (
    AttachedConfig,
    ConfigFile,
    ConfigFileKind,
    DetectedFile,
    ModelDescription,
    ParallelOptions,
    is_model_description,
)
from commlens.contract.predict import PredictInput
from commlens.store import transaction

from .errors import InvalidError
from .runs import WRITE_ATTEMPTS, check_config_world, update_run

Doc = dict[str, Any]
_WHOLE: tuple[ConfigFileKind, ...] = ("model_description", "run_json", "predict_input")
_MEGATRON_START = re.compile(r"-{3,} arguments -{3,}")
_MEGATRON_END = re.compile(r"-{3,} end of arguments -{3,}")
# after any prefix a launcher or logger puts on each line (torchrun's '[default0]:', srun --label's '0: ', a
# logging timestamp): Megatron indents each argument and pads its name with dots
_MEGATRON_ARG = re.compile(r"(?:^|\s)(?P<key>[A-Za-z_][A-Za-z0-9_]*) \.{2,} ?(?P<value>.*)$")
_HF_LAYERS = ("num_hidden_layers", "n_layer", "num_layers")
_DEEPSPEED_KEYS = (
    "zero_optimization",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
)
_LEARNED_POSITIONS = ("gpt2", "gpt_neo", "gpt_bigcode", "opt", "bloom")  # model types with a position embedding table


def _invalid(message: str) -> InvalidError:
    return InvalidError(message, "invalid-config")


def _field_error(name: str, exc: ValidationError) -> InvalidError:
    e = exc.errors()[0]
    loc = ".".join(str(x) for x in e.get("loc", ()))
    return _invalid(
        f"{name}: {loc or 'document'}: {e.get('msg')}"
        + (f" ({exc.error_count()} errors)" if exc.error_count() > 1 else "")
    )


# ------------------------------------------------------------------------------------- detection


def detect(f: ConfigFile) -> tuple[ConfigFileKind, Doc]:
    """The kind of one file and its content (JSON as parsed, Megatron's arguments as a dict)."""
    text = f.content.lstrip("\ufeff")
    if _MEGATRON_START.search(text):
        return "megatron_args", megatron_arguments(f.name, text)
    if not text.lstrip().startswith("{"):
        raise _invalid(
            f"{f.name}: neither JSON (a model description, run.json, config.json or DeepSpeed config) nor "
            "Megatron-LM's printed argument block (no '---- arguments ----' line)"
        )
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _invalid(f"{f.name}: line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    if not isinstance(doc, dict):
        raise _invalid(f"{f.name}: a JSON object expected, not {type(doc).__name__}")
    if is_model_description(doc):
        return "model_description", doc
    if str(doc.get("schema", "")).startswith("commlens.run/"):
        return "run_json", doc
    if isinstance(doc.get("model"), dict) and not ("schema" in doc or "strategy" in doc):
        return "predict_input", doc
    if any(k in doc for k in _HF_LAYERS) and ("model_type" in doc or "architectures" in doc):
        return "hf_config", doc
    if any(k in doc for k in _DEEPSPEED_KEYS):
        return "deepspeed_config", doc
    raise _invalid(
        f"{f.name}: not a configuration commlens reads: no model-description or run.json 'schema', no "
        f"'model_type' with {'/'.join(_HF_LAYERS)} (Hugging Face), no {'/'.join(_DEEPSPEED_KEYS)} (DeepSpeed)"
    )


def _value(raw: str) -> Any:
    raw = raw.strip()
    if raw in ("True", "False"):
        return raw == "True"
    if raw == "None":
        return None
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw


def megatron_arguments(name: str, text: str) -> Doc:
    """The `name ..... value` lines between Megatron-LM's '---- arguments ----' and '---- end of arguments ----'
    (with any per-line prefix of a launcher or logger); a line in between that is not one is an error."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if _MEGATRON_START.search(line))
    args: Doc = {}
    for i in range(start + 1, len(lines)):
        line = lines[i]
        if _MEGATRON_END.search(line):
            return args
        if not line.strip():
            continue
        m = _MEGATRON_ARG.search(line)
        if m is None:
            raise _invalid(f"{name}: line {i + 1}: not an argument line ('name ..... value'): {line.strip()[:120]!r}")
        args[m["key"]] = _value(m["value"])
    raise _invalid(f"{name}: line {len(lines)}: the argument block has no '---- end of arguments ----' line")


# ------------------------------------------------------------------------------------ conversion


def _get(doc: Doc, name: str, keys: tuple[str, ...], required: bool = True) -> Any:
    for k in keys:
        if doc.get(k) is not None:
            return doc[k]
    if required:
        raise _invalid(f"{name}: no {' / '.join(repr(k) for k in keys)}")
    return None


def _dtype(name: str, field: str, value: Any) -> str:
    short = str(value).removeprefix("torch.")
    aliases = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "half": "float16", "float": "float32"}
    short = aliases.get(short, short)
    if short not in ("float32", "float16", "bfloat16"):
        raise _invalid(f"{name}: {field}: {value!r} is not float32, float16 or bfloat16")
    return short


def _from_hf(name: str, doc: Doc, notes: list[str]) -> Doc:
    """ModelSpec fields (and dtypes) of a Hugging Face config.json."""
    heads = _get(doc, name, ("num_attention_heads", "n_head"))
    model: Doc = {
        "layers": _get(doc, name, _HF_LAYERS),
        "hidden": _get(doc, name, ("hidden_size", "n_embd", "d_model")),
        "heads": heads,
        "kv_heads": _get(doc, name, ("num_key_value_heads",), required=False),
        "ffn_hidden": _get(doc, name, ("intermediate_size", "n_inner", "ffn_dim"), required=False),
        "vocab": _get(doc, name, ("vocab_size",)),
        "tied_embeddings": bool(doc.get("tie_word_embeddings", True)),
        "learned_pos": doc.get("model_type") in _LEARNED_POSITIONS,
    }
    experts = _get(doc, name, ("num_local_experts", "num_experts", "n_routed_experts"), required=False)
    if experts:
        model["experts"] = experts
        model["top_k"] = _get(doc, name, ("num_experts_per_tok", "moe_topk"), required=False) or 1
    positions = _get(doc, name, ("max_position_embeddings", "n_positions"), required=False)
    if positions is not None:  # the most the model takes; combine() notes it where nothing else says
        model["seq_len"] = positions
    out: Doc = {"model": model}
    if doc.get("torch_dtype"):
        dt = _dtype(name, "torch_dtype", doc["torch_dtype"])
        out["dtypes"] = {"act": dt, "grad": dt, "param": dt}
    return out


def _number(name: str, field: str, value: Any, notes: list[str]) -> int | None:
    if value == "auto":
        notes.append(f"{name}: {field} is 'auto' (set by the launcher): the predictor's default is used")
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _invalid(f"{name}: {field}: a number expected, not {value!r}")
    return int(value)


def _from_deepspeed(name: str, doc: Doc, notes: list[str]) -> Doc:
    """Parallel, dtype and bucket fields of a DeepSpeed config."""
    zero = doc.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise _invalid(f"{name}: zero_optimization: an object expected")
    parallel: Doc = {"zero": _number(name, "zero_optimization.stage", zero.get("stage", 0), notes) or 0}
    buckets: Doc = {}
    for key, field in (
        ("reduce_bucket_size", "deepspeed_reduce_bucket_elems"),
        ("allgather_bucket_size", "deepspeed_allgather_bucket_elems"),
        ("stage3_param_persistence_threshold", "deepspeed_param_persistence_threshold"),
    ):
        if key in zero and (n := _number(name, f"zero_optimization.{key}", zero[key], notes)) is not None:
            buckets[field] = n
    for key, field in (
        ("gradient_accumulation_steps", "micro_batches"),
        ("train_micro_batch_size_per_gpu", "micro_batch_size"),
    ):
        if key in doc and (n := _number(name, key, doc[key], notes)) is not None:
            parallel[field] = n
    offload = zero.get("offload_optimizer") or {}
    if isinstance(offload, dict) and offload.get("device") in ("cpu", "nvme") and parallel["zero"] == 3:
        parallel["offload"] = "zero_offload"
    out: Doc = {"parallel": parallel, "buckets": buckets}
    for key, dt in (("bf16", "bfloat16"), ("fp16", "float16")):
        section = doc.get(key)
        if isinstance(section, dict) and section.get("enabled") is True:
            out["dtypes"] = {"act": dt, "grad": dt, "param": dt}
    return out


def _from_megatron(name: str, a: Doc) -> Doc:
    """Model, parallel and dtype fields of Megatron-LM's printed arguments."""
    dp = int(a.get("data_parallel_size") or 1)
    mbs = int(a.get("micro_batch_size") or 1)
    model: Doc = {
        "layers": _get(a, name, ("num_layers",)),
        "hidden": _get(a, name, ("hidden_size",)),
        "heads": _get(a, name, ("num_attention_heads",)),
        "kv_heads": a.get("num_query_groups") if a.get("group_query_attention") else None,
        "ffn_hidden": a.get("ffn_hidden_size"),
        "vocab": _get(a, name, ("padded_vocab_size", "vocab_size")),
        "seq_len": _get(a, name, ("seq_length",)),
        "learned_pos": a.get("position_embedding_type", "learned_absolute") == "learned_absolute",
        "tied_embeddings": not a.get("untie_embeddings_and_output_weights", False),
    }
    if a.get("make_vocab_size_divisible_by"):
        model["vocab_divisible_by"] = a["make_vocab_size_divisible_by"]
    if a.get("num_experts"):
        model["experts"] = a["num_experts"]
        model["top_k"] = a.get("moe_router_topk") or 1
    pp = int(a.get("pipeline_model_parallel_size") or 1)
    parallel: Doc = {
        "dp": dp,
        "tp": int(a.get("tensor_model_parallel_size") or 1),
        "pp": pp,
        "cp": int(a.get("context_parallel_size") or 1),
        "ep": int(a.get("expert_model_parallel_size") or 1),
        "sp": bool(a.get("sequence_parallel")),
        "zero": 1 if a.get("use_distributed_optimizer") else 0,
        "micro_batch_size": mbs,
        "recompute": a.get("recompute_granularity") or "none",
    }
    if a.get("global_batch_size"):
        parallel["micro_batches"] = max(1, int(a["global_batch_size"]) // (mbs * dp))
    if a.get("num_layers_per_virtual_pipeline_stage"):
        parallel["virtual_stages"] = int(model["layers"]) // pp // int(a["num_layers_per_virtual_pipeline_stage"])
    param = _dtype(name, "params_dtype", a.get("params_dtype", "torch.float32"))
    grad = "float32" if a.get("accumulate_allreduce_grads_in_fp32") else param
    return {"model": model, "parallel": parallel, "dtypes": {"act": param, "grad": grad, "param": param}}


def _merge(into: Doc, part: Mapping[str, Any]) -> None:
    for section, values in part.items():
        into.setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})


def combine(files: list[tuple[str, ConfigFileKind, Doc]], options: ParallelOptions, notes: list[str]) -> PredictInput:
    """One predictor input from a model's config (Hugging Face or Megatron's arguments), how it is trained
    (DeepSpeed, Megatron) and the options, which override the files."""
    kinds = [k for _, k, _ in files]
    if not any(k in ("hf_config", "megatron_args", "predict_input") for k in kinds):
        raise _invalid(
            f"{', '.join(n for n, _, _ in files)}: says how the model is trained, not what it is: attach it together "
            "with the model's config.json (or a model description from `commlens describe-model`)"
        )
    doc: Doc = {}
    positions_of: str | None = None  # the Hugging Face config whose max_position_embeddings is the sequence length
    for name, kind, content in files:
        if kind == "predict_input":
            part = {k: v for k, v in content.items() if isinstance(v, dict)}
            doc.update({k: v for k, v in content.items() if not isinstance(v, dict)})
        elif kind == "hf_config":
            part = _from_hf(name, content, notes)
        elif kind == "megatron_args":
            part = _from_megatron(name, content)
        elif kind == "deepspeed_config":
            part = _from_deepspeed(name, content, notes)
        else:
            continue
        _merge(doc, part)
        if "seq_len" in (part.get("model") or {}):
            positions_of = name if kind == "hf_config" else None
    o = options.model_dump(exclude_none=True)
    if "seq_len" in o:
        doc.setdefault("model", {})["seq_len"] = o.pop("seq_len")
        positions_of = None
    if positions_of is not None:
        notes.append(
            f"{positions_of}: sequence length {doc['model']['seq_len']} from max_position_embeddings (give "
            "--seq-len if training used less)"
        )
    implementation = o.pop("implementation", None)
    _merge(doc, {"parallel": o})
    if implementation is None and "implementation" not in doc:
        implementation = (
            "megatron" if "megatron_args" in kinds else "deepspeed" if "deepspeed_config" in kinds else "fsdp"
        )
        notes.append(f"implementation {implementation!r} (from the files given; --implementation to choose)")
    if implementation is not None:
        doc["implementation"] = implementation
    if "seq_len" not in doc.get("model", {}):
        raise _invalid("no file gives the sequence length: give --seq-len")
    try:
        return PredictInput.model_validate(doc)
    except ValidationError as exc:
        raise _field_error("the combined configuration", exc) from None


# ---------------------------------------------------------------------------------------- attach


def _store_description(
    con: duckdb.DuckDBPyConnection, run: str, name: str, desc: ModelDescription, defaulted: bool = False
) -> None:
    """A description is stored as the run's config under DESCRIPTION_KEY (the comparison reads it there), with the
    strategy and data-parallel size it names (`defaulted`: it names none, so DDP over one rank is assumed)."""
    stored = json.dumps({DESCRIPTION_KEY: desc.model_dump(mode="json", by_alias=True)})

    def write(c: duckdb.DuckDBPyConnection) -> None:
        run_id = run_id_of(c, run)
        what = f"{name} (no strategy, so DDP over 1 rank)" if defaulted else f"{name} ({desc.strategy.kind})"
        check_config_world(c, run_id, desc.strategy.dp, what)
        c.execute(
            "UPDATE runs SET config = ?, strategy = ?, world_size = ?, updated_at = current_timestamp WHERE run_id = ?",
            [stored, desc.strategy.kind, desc.strategy.dp, run_id],
        )

    transaction(con, write, WRITE_ATTEMPTS)


def attach_config(
    con: duckdb.DuckDBPyConnection, run: str, files: list[ConfigFile], options: ParallelOptions | None = None
) -> AttachedConfig:
    """Detect each file, combine them and store the result as the run's configuration (replacing any)."""
    options = options or ParallelOptions()
    run_id_of(con, run)  # an unknown run fails before any file is read
    if not files:
        raise _invalid("no configuration file given")
    detected = [(f.name, *detect(f)) for f in files]
    listing = [DetectedFile(name=n, kind=k) for n, k, _ in detected]
    whole = [(n, k, d) for n, k, d in detected if k in ("model_description", "run_json")]
    notes: list[str] = []
    if whole:
        name, kind, doc = whole[0]
        if len(detected) > 1:
            raise _invalid(
                f"{name}: a {kind.replace('_', ' ')} says everything; attach it alone (got {len(detected)} files)"
            )
        if kind == "model_description":
            return _attach_description(con, run, name, doc, options, listing)
        if options.model_dump(exclude_none=True):
            raise _invalid(f"{name}: a harness run.json records its own parallel layout; give no options with it")
        update_run(con, run, {"config": doc}, config_from=f"{name} (harness run.json)")
        return AttachedConfig(run=run, files=listing, stored="run_config", summary=_summary_of_run_json(doc))
    inp = combine(detected, options, notes)
    update_run(con, run, {"config": inp.model_dump(mode="json")}, config_from=" + ".join(n for n, _, _ in detected))
    m, p = inp.model, inp.parallel
    summary = (
        f"{inp.implementation}: {m.layers} layers, hidden {m.hidden}, {m.heads} heads, vocab {m.vocab}, seq {m.seq_len}; "
        f"dp {p.dp} tp {p.tp} pp {p.pp} cp {p.cp} ep {p.ep} zero {p.zero}"
    )
    return AttachedConfig(run=run, files=listing, stored="predict_input", summary=summary, notes=notes)


def _attach_description(
    con: duckdb.DuckDBPyConnection, run: str, name: str, doc: Doc, options: ParallelOptions, listing: list[DetectedFile]
) -> AttachedConfig:
    try:
        desc = ModelDescription.model_validate(doc)
    except ValidationError as exc:
        raise _field_error(name, exc) from None
    given = options.model_dump(exclude_none=True)
    if set(given) - {"dp"}:
        raise _invalid(f"{name}: a model description takes only --dp (got {', '.join(sorted(set(given) - {'dp'}))})")
    if "dp" in given:
        desc = desc.model_copy(update={"strategy": desc.strategy.model_copy(update={"dp": given["dp"]})})
    _store_description(con, run, name, desc, defaulted="strategy" not in doc and "dp" not in given)
    s = desc.strategy
    summary = (
        f"{desc.model or name}: {len(desc.parameters)} parameters ({desc.param_count:,} elements), "
        f"{len(desc.buffers)} buffers; {s.kind} over {s.dp} ranks"
    )
    return AttachedConfig(run=run, files=listing, stored="model_description", summary=summary)


def _summary_of_run_json(doc: Doc) -> str:
    return f"harness run.json: {doc.get('strategy', '?')} over {doc.get('world_size', '?')} ranks"
