"""`commlens report` and `commlens predict`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from collections.abc import Callable

    from pydantic import ValidationError

    from commlens.contract.model_description import ModelDescription
    from commlens.contract.predict import PredictInput

console = Console(width=None if sys.stdout.isatty() else 200, emoji=False)
err = Console(
    stderr=True, width=None if sys.stderr.isatty() else 1000, emoji=False
)  # an error stays one line in a pipe

# Options whose values are paths are declared once here (a call in a default would run at import anyway).
DB_OPTION = typer.Option(Path("commlens.duckdb"), "--db", help="DuckDB store file.")
CONFIG_OPTION = typer.Option(
    None,
    "--config",
    help="A model description (commlens describe-model), run.json or predictor-input JSON, detected by content, "
    "used instead of the run's own configuration.",
)
RUN_JSON_OPTION = typer.Option(None, "--run-json", help="Predict for a harness run.json (or predictor-input JSON).")


def validation_lines(exc: ValidationError, place: Callable[[tuple[int | str, ...]], str | None]) -> list[str]:
    """One line per error of pydantic's ValidationError, "PLACE: rule (got VALUE)", where `place` names the
    option or the document path of an error's loc (None: the error is about several values, its text names
    them); never pydantic's own multi-line text with its links."""
    lines = []
    for e in exc.errors():
        loc = tuple(e.get("loc", ()))
        msg = str(e.get("msg", "")).removeprefix("Value error, ")
        if msg[:2].istitle():  # pydantic's "Input should be ...", after a colon
            msg = msg[0].lower() + msg[1:]
        value = e.get("input")
        shown = repr(value)
        scalar = loc and not isinstance(value, dict | list) and e.get("type") != "missing" and len(shown) <= 80
        got = f" (got {shown})" if scalar else ""
        where = place(loc)
        lines.append(f"{where}: {msg}{got}" if where else f"{msg}{got}")
    return lines


def document_place(path: Path) -> Callable[[tuple[int | str, ...]], str]:
    """`place` for a document read from a file: the file, then the loc as a dotted path (model.kv_heads)."""
    return lambda loc: f"{path}: {'.'.join(str(x) for x in loc) or 'document'}"


def print_errors(lines: list[str]) -> None:
    for line in lines:
        err.print(f"[red]error:[/red] {escape(line)}")


def report(
    run: str = typer.Option(..., "--run", help="Run to report on."),
    db: Path = DB_OPTION,
    fmt: str = typer.Option("md", "--format", help="json or md."),
    config: Path | None = CONFIG_OPTION,
) -> None:
    """Attribution, histograms, predicted against measured, bandwidth, where the time goes and findings of one run."""
    from commlens import store
    from commlens.backend.report import build_report, render_markdown
    from commlens.service.runs import resolve_alias, run_names
    from commlens.service.time import time_summary

    if fmt not in ("json", "md"):
        err.print("--format must be json or md")
        raise typer.Exit(2)
    try:
        con = store.connect(db)
    except store.StoreError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None
    if store.get_run_id(con, run) is None and (current := resolve_alias(con, run)) is not None:
        err.print(escape(f"{run!r} is a former name of run {current!r}: reporting on {current!r}"))
        run = current  # as the API does for a link holding the old name
    if store.get_run_id(con, run) is None:
        names = run_names(con)
        err.print(f"[red]error:[/red] {escape(f'no run {run!r} in {db}; runs: ' + (', '.join(names) or 'none'))}")
        raise typer.Exit(2)
    inp = _report_config(config) if config else None
    rep = build_report(con, run, inp, time_summary(con, run))
    con.close()
    if fmt == "json":
        sys.stdout.write(rep.model_dump_json(indent=2) + "\n")
    else:
        sys.stdout.write(render_markdown(rep))


# Files that say part of a configuration (the model, or how it is trained), as messages name them
_PARTIAL = {
    "hf_config": "a Hugging Face config.json",
    "deepspeed_config": "a DeepSpeed config",
}


def _report_config(path: Path) -> PredictInput | ModelDescription:
    """A file that says everything a prediction needs, detected by content as `commlens config` detects it (a
    Megatron argument block says the model and its layout); a file that says only part of it (a Hugging Face
    config.json, DeepSpeed) goes through `commlens config`, whose options complete it."""
    from pydantic import ValidationError

    from commlens.backend.predict import predict_input_from_config
    from commlens.contract import model_description as md
    from commlens.service.config import ParallelOptions, combine, detect
    from commlens.service.errors import InvalidError

    try:
        kind, doc = detect(md.ConfigFile(name=str(path), content=path.read_text()))
        if kind == "model_description":
            return md.ModelDescription.model_validate(doc)
        if kind in ("run_json", "predict_input"):
            return predict_input_from_config(doc)
        if kind == "megatron_args":  # the model and its layout: as `commlens config FILE` alone stores it
            return combine([(str(path), kind, doc)], ParallelOptions(), [])
        message = (
            f"{path}: {_PARTIAL[kind]} says only part of a configuration: attach it with "
            "`commlens config --run RUN FILE... --dp/--tp/--seq-len ...`, then report without --config"
        )
    except InvalidError as exc:
        message = str(exc)
    except ValidationError as exc:
        print_errors(validation_lines(exc, document_place(path)))
        raise typer.Exit(2) from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        message = f"{path}: {exc}"
    err.print(f"[red]error:[/red] {escape(message)}")
    raise typer.Exit(2)


def _load_config(path: Path) -> PredictInput:
    """The predictor input of a run.json or predictor-input JSON file; exit 2 saying why it is neither."""
    from pydantic import ValidationError

    from commlens.backend.predict import predict_input_from_config

    try:
        return predict_input_from_config(json.loads(path.read_text()))
    except ValidationError as exc:
        print_errors(validation_lines(exc, document_place(path)))
        raise typer.Exit(2) from None
    except (OSError, json.JSONDecodeError, ValueError) as exc:
        err.print(f"[red]error:[/red] {escape(f'{path}: {exc}')}")
        raise typer.Exit(2) from None


# The predict option that sets each PredictInput field whose name is not the option's; errors of a whole section
# (its model validator) name the option when one option sets it all.
_OPTION_OF_FIELD = {
    "ffn_hidden": "--ffn",
    "tied_embeddings": "--tied",
    "act": "--dtype",
    "grad": "--dtype",
    "param": "--dtype",
}
_OPTION_OF_SECTION: dict[tuple[int | str, ...], str | None] = {
    (): None,
    ("model",): None,
    ("parallel",): None,
    ("dtypes",): "--dtype",
}


def _predict_option(loc: tuple[int | str, ...]) -> str | None:
    """The predict option an error's loc (section, field) is about; None for a rule over several options."""
    if loc in _OPTION_OF_SECTION:
        return _OPTION_OF_SECTION[loc]
    field = str(loc[-1])
    return _OPTION_OF_FIELD.get(field, "--" + field.replace("_", "-"))


def predict(
    run_json: Path | None = RUN_JSON_OPTION,
    layers: int = typer.Option(24, help="Transformer layers L."),
    hidden: int = typer.Option(2048, help="Hidden size h."),
    heads: int = typer.Option(16, help="Attention heads."),
    kv_heads: int | None = typer.Option(None, help="KV heads (GQA)."),
    ffn: int | None = typer.Option(None, help="FFN width (default 4h)."),
    vocab: int = typer.Option(50304, help="Vocabulary size."),
    vocab_divisible_by: int | None = typer.Option(
        None, min=1, help="Pad the vocabulary to a multiple of this x tp (default: 128 for megatron, else no padding)."
    ),
    seq_len: int = typer.Option(2048, help="Sequence length s."),
    tied: bool = typer.Option(False, help="Tied input/output embeddings."),
    dp: int = typer.Option(1),
    tp: int = typer.Option(1),
    pp: int = typer.Option(1),
    cp: int = typer.Option(1, help="Context-parallel degree c (the sequence is split c ways)."),
    cp_style: str = typer.Option(
        "ring",
        help="Context parallelism: ring (ring attention) or attention2d "
        "(ATTENTION2D on an r_Q x r_KV mesh; forward only, the spec gives no backward).",
    ),
    cp_rq: int | None = typer.Option(
        None, help="ATTENTION2D r_Q, a divisor of --cp (r_KV = cp / r_Q); default sqrt(cp) when cp is a perfect square."
    ),
    zero: int = typer.Option(0, help="ZeRO stage 0-3."),
    sp: bool = typer.Option(False, help="Sequence parallelism (tp > 1)."),
    pp_scatter_gather: bool = typer.Option(
        False,
        help="Megatron PP scatter/gather (tp > 1, no --sp): pipeline messages are A/t per TP rank and each "
        "received message is all-gathered in the TP group.",
    ),
    offload: str = typer.Option(
        "none",
        help="CPU offload with ZeRO-3: none, zero_offload or deep_optimizer_states; "
        "host<->device copies are listed apart from the collectives.",
    ),
    prefetch_gap: int = typer.Option(
        1,
        help="Deep Optimizer States prefetch gap g: 1/g of the optimizer "
        "sub-groups are updated on the GPU (--offload deep_optimizer_states).",
    ),
    optimizer_state_bytes: int = typer.Option(
        12, help="Optimizer-state bytes per parameter on the host for --offload (fp32 master weights + Adam m, v: 12)."
    ),
    micro_batches: int = typer.Option(1, help="Micro-batches per iteration m."),
    micro_batch_size: int = typer.Option(1, help="Micro-batch size b."),
    dtype: str = typer.Option("bfloat16", help="Activation, gradient and parameter dtype."),
    implementation: str = typer.Option("paper", help="paper, megatron, deepspeed, fsdp or harness."),
    fmt: str = typer.Option("table", "--format", help="table or json."),
) -> None:
    """Predicted communication per rank per iteration, for a run.json or any configuration (what-if at any scale)."""
    from pydantic import ValidationError

    from commlens.backend.predict import predict as run_predict
    from commlens.contract.predict import PredictInput
    from commlens.vocab import format_bytes

    if fmt not in ("table", "json"):
        err.print("[red]error:[/red] --format must be table or json")
        raise typer.Exit(2)
    if run_json:
        inp = _load_config(run_json)
    else:
        # validated as one document, so that every error's loc names its section and field, hence its option
        options = {
            "model": {
                "layers": layers,
                "hidden": hidden,
                "heads": heads,
                "kv_heads": kv_heads,
                "ffn_hidden": ffn,
                "vocab": vocab,
                "seq_len": seq_len,
                "tied_embeddings": tied,
                "vocab_divisible_by": vocab_divisible_by,
            },
            "parallel": {
                "dp": dp,
                "tp": tp,
                "pp": pp,
                "cp": cp,
                "zero": zero,
                "sp": sp,
                "micro_batches": micro_batches,
                "micro_batch_size": micro_batch_size,
                "pp_scatter_gather": pp_scatter_gather,
                "cp_style": cp_style,
                "cp_rq": cp_rq,
                "offload": offload,
                "prefetch_gap": prefetch_gap,
            },
            "dtypes": {"act": dtype, "grad": dtype, "param": dtype, "optimizer_state_bytes": optimizer_state_bytes},
            "implementation": implementation,
        }
        try:
            inp = PredictInput.model_validate(options)
        except ValidationError as exc:
            print_errors(validation_lines(exc, _predict_option))
            raise typer.Exit(2) from None
    try:
        pred = run_predict(inp)
    except ValueError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None
    if fmt == "json":
        sys.stdout.write(pred.model_dump_json(indent=2) + "\n")
        return
    console.print(f"{pred.implementation} prediction, world size {pred.world_size}, {pred.param_count:,} parameters")
    for st in pred.stages:
        table = Table(title=f"stage {st.stage}: ranks {_ranges(st.ranks)}, {st.params_per_rank:,} parameters per rank")
        for col in ("scheme", "group", "op", "dtype", "S", "calls / iter", "S x calls"):
            table.add_column(col, justify="right" if col in ("S", "calls / iter", "S x calls") else "left")
        for o in st.ops:
            table.add_row(
                o.scheme,
                escape(o.group),
                o.op,
                o.dtype,
                format_bytes(o.msg_bytes),
                str(o.calls_per_iter),
                format_bytes(o.msg_bytes * o.calls_per_iter),
            )
        console.print(table)
        if st.host_transfers:
            host = Table(
                title=f"stage {st.stage}: host<->device copies per rank per iteration (CPU offload, not collectives)"
            )
            for col in ("direction", "what", "bytes / iter"):
                host.add_column(col, justify="right" if col == "bytes / iter" else "left")
            for h in st.host_transfers:
                host.add_row(h.direction, escape(h.what), format_bytes(h.bytes_per_iter))
            console.print(host)
    totals = Table(title="per rank per iteration (mean over ranks)")
    for col in ("scheme", "S-sum", "ring wire bytes", "paper (2S all_reduce)"):
        totals.add_column(col, justify="left" if col == "scheme" else "right")
    for t in pred.totals:
        totals.add_row(t.scheme, format_bytes(t.s_sum), format_bytes(round(t.wire_bytes)), format_bytes(t.paper_bytes))
    console.print(totals)
    for note in pred.notes:
        console.print(f"note: {escape(note)}")


def _ranges(ranks: list[int]) -> str:
    if not ranks:
        return "-"
    out, start, prev = [], ranks[0], ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(f"{start}-{prev}" if prev != start else str(start))
        if r is not None:
            start = prev = r
    return ",".join(out)
