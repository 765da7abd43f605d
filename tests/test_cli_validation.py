"""Bad input to the CLI is said in one line per problem, naming the option (or the file) and the rule, with exit
code 2 and no traceback or pydantic dump; nothing is stored for it. A rank given to `commlens ingest --rank` that an
NCCL log contradicts (it holds several processes, or states a world size the rank is not below) fails that file; `commlens delete` deletes a
run (asking first unless --yes) through the service the API's DELETE uses."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pytest
from conftest import shared_data
from pydantic import ValidationError
from typer.testing import CliRunner, Result

from commlens import store
from commlens.backend.predict import predict_input_from_config
from commlens.cli import app
from commlens.service.runs import rename_run

TWO_PROCESSES = "nccl-logs/nvidia-nccl-203.log"  # one log of 2 processes, world size 2
ONE_PROCESS = "nccl-logs/nvidia-nccl-584.log"  # one process of a world of 2, its rank not stated


def _cli(*args: str, stdin: str | None = None) -> Result:
    return CliRunner().invoke(app, list(args), input=stdin)


def _errors(result: Result) -> list[str]:
    return [line for line in result.output.splitlines() if line.strip()]


def _runs(db: Path) -> list[tuple[str, int | None]]:
    with duckdb.connect(str(db), read_only=True) as con:
        return con.execute(
            "SELECT r.name, s.rank FROM runs r LEFT JOIN sources s USING (run_id) ORDER BY r.name"
        ).fetchall()


# ------------------------------------------------------------------------------------ ingest --rank


def _failed(result: Result) -> list[str]:
    return [line for line in result.output.splitlines() if line.startswith("failed ")]


def test_rank_for_a_log_of_several_processes_fails_that_file_alone(tmp_path: Path) -> None:
    """The parser passed the given rank over for a log of several processes without a word; now the file fails
    (in the parse, so CLI, uploads and worker processes alike) and the others of the ingest are stored."""
    db = tmp_path / "s.duckdb"
    several, one = shared_data() / TWO_PROCESSES, shared_data() / ONE_PROCESS
    result = _cli("ingest", str(several), str(one), "--db", str(db), "--run", "r", "--rank", "1")
    assert _failed(result) == [
        f"failed {several}: the rank given (1) is for a single-rank file, but this NCCL log holds 2 processes of a "
        "world of 2, whose ranks it states itself: ingest it without a rank"
    ]
    assert sorted(_runs(db), key=str) == [("r", 1), ("r", None)]  # the one-process log as rank 1, the other failed
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM comm_events WHERE rank IS DISTINCT FROM 1").fetchall() == [(0,)]


def test_rank_at_or_past_the_world_size_a_log_states_fails(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    log = shared_data() / ONE_PROCESS
    for rank in ("2", "7"):
        result = _cli("ingest", str(log), "--db", str(db), "--run", "r", "--rank", rank)
        assert result.exit_code == 1, result.output
        assert _failed(result) == [
            f"failed {log}: the rank given ({rank}) is not below the world size this NCCL log states (2: ranks 0-1)"
        ]
        with duckdb.connect(str(db), read_only=True) as con:  # recorded as failed, nothing of it stored
            assert con.execute("SELECT status, n_events FROM sources").fetchall() == [("failed", 0)]
    result = _cli("ingest", str(log), "--db", str(db), "--run", "r", "--rank", "1")
    assert result.exit_code == 0, result.output
    with duckdb.connect(str(db), read_only=True) as con:  # stored now: its failure is gone with it
        assert con.execute("SELECT status, rank FROM sources ORDER BY status").fetchall() == [("ok", 1)]


def test_a_negative_rank_is_a_usage_error(tmp_path: Path) -> None:
    result = _cli(
        "ingest", str(shared_data() / ONE_PROCESS), "--db", str(tmp_path / "s.duckdb"), "--run", "r", "--rank", "-1"
    )
    assert result.exit_code == 2 and "'--rank'" in result.output


# ------------------------------------------------------------------------------------------ delete


def test_delete_asks_first_and_deletes_the_run_with_its_rows(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    assert _cli("ingest", str(shared_data() / ONE_PROCESS), "--db", str(db), "--run", "a").exit_code == 0
    assert _cli("ingest", str(shared_data() / ONE_PROCESS), "--db", str(db), "--run", "b").exit_code == 0

    kept = _cli("delete", "a", "--db", str(db), stdin="n\n")
    assert kept.exit_code == 1 and "delete run 'a' (1 files, 7 calls)" in kept.output
    assert "nothing deleted" in kept.output
    assert [r[0] for r in _runs(db)] == ["a", "b"]

    done = _cli("delete", "a", "--db", str(db), stdin="y\n")
    assert done.exit_code == 0, done.output
    assert "deleted run 'a' (1 files, 7 calls)" in done.output
    assert [r[0] for r in _runs(db)] == ["b"]
    with duckdb.connect(str(db), read_only=True) as con:  # its rows went with it; b's stay
        assert con.execute("SELECT DISTINCT run FROM comms").fetchall() == [("b",)]

    again = _cli("delete", "a", "--db", str(db), "--yes")
    assert again.exit_code == 2 and _errors(again) == [f"error: no run 'a' in {db}; runs: b"]

    con = store.connect(db)
    rename_run(con, "b", "c")
    con.close()
    alias = _cli("delete", "b", "--db", str(db), "--yes")
    assert alias.exit_code == 2
    assert _errors(alias) == ["error: 'b' is a former name of run 'c'; delete that one by its name"]
    assert _cli("delete", "c", "--db", str(db), "--yes").exit_code == 0
    assert _runs(db) == []


def test_delete_needs_an_existing_store(tmp_path: Path) -> None:
    result = _cli("delete", "a", "--db", str(tmp_path / "none.duckdb"), "--yes")
    assert result.exit_code == 2 and "no store at" in result.output
    assert not (tmp_path / "none.duckdb").exists()


# ----------------------------------------------------------------------------------------- predict


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--ffn", "-1"], "error: --ffn: must be at least 1; leave it out for the default 4 x hidden (got -1)"),
        (["--ffn", "0"], "error: --ffn: must be at least 1; leave it out for the default 4 x hidden (got 0)"),
        (
            ["--kv-heads", "0"],
            "error: --kv-heads: must be at least 1; leave it out for multi-head attention (kv_heads = heads) (got 0)",
        ),
        (
            ["--kv-heads", "3"],
            "error: --kv-heads: must divide heads (16): each KV head serves heads / kv_heads heads (got 3)",
        ),
        (["--kv-heads", "32"], "error: --kv-heads: must be at most heads (16) (got 32)"),
        (
            ["--hidden", "100", "--heads", "16"],
            "error: --heads: must divide hidden (100): each attention head is hidden / heads wide (got 16)",
        ),
        (["--format", "xml"], "error: --format must be table or json"),
        (["--zero", "5"], "error: --zero: input should be 0, 1, 2 or 3 (got 5)"),
        (["--dp", "0"], "error: --dp: input should be greater than or equal to 1 (got 0)"),
        (["--cp-style", "tree"], "error: --cp-style: input should be 'ring' or 'attention2d' (got 'tree')"),
        (["--sp"], "error: sequence parallelism (sp) needs tp > 1"),
    ],
)
def test_predict_says_each_bad_option_in_one_line(args: list[str], line: str) -> None:
    result = _cli("predict", *args)
    assert result.exit_code == 2, result.output
    assert _errors(result) == [line]


def test_predict_takes_kv_heads_that_divide_the_heads() -> None:
    result = _cli("predict", "--kv-heads", "4", "--ffn", "5504", "--format", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["implementation"] == "paper"


GQA = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 16}


def test_a_config_file_breaking_the_model_rules_is_said_by_its_path(tmp_path: Path) -> None:
    bad = tmp_path / "input.json"
    bad.write_text(json.dumps({"model": {**GQA, "kv_heads": 3, "ffn_hidden": 0}}))
    result = _cli("predict", "--run-json", str(bad))
    assert result.exit_code == 2
    assert _errors(result) == [
        f"error: {bad}: model.kv_heads: must divide heads (4): each KV head serves heads / kv_heads heads (got 3)",
        f"error: {bad}: model.ffn_hidden: must be at least 1; leave it out for the default 4 x hidden (got 0)",
    ]
    bad.write_text(json.dumps({"model": GQA, "parallel": {"dp": 0}}))
    result = _cli("predict", "--run-json", str(bad))
    assert _errors(result) == [f"error: {bad}: parallel.dp: input should be greater than or equal to 1 (got 0)"]


def test_the_model_rules_hold_for_every_config_read() -> None:
    """Stored configs, comparisons and the CLI all read configs through predict_input_from_config."""
    with pytest.raises(ValidationError) as caught:
        predict_input_from_config({"model": {**GQA, "kv_heads": 8}})
    assert [(e["loc"], e["input"]) for e in caught.value.errors()] == [(("model", "kv_heads"), 8)]
    assert predict_input_from_config({"model": {**GQA, "kv_heads": 2}}).model.h_kv == 32


def test_report_config_and_config_options_are_said_in_one_line(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    assert _cli("ingest", str(shared_data() / ONE_PROCESS), "--db", str(db), "--run", "r").exit_code == 0
    bad = tmp_path / "input.json"
    bad.write_text(json.dumps({"model": {**GQA, "kv_heads": 5}}))
    report = _cli("report", "--run", "r", "--db", str(db), "--config", str(bad))
    assert report.exit_code == 2
    assert _errors(report) == [f"error: {bad}: model.kv_heads: must be at most heads (4) (got 5)"]
    attach = _cli("config", str(bad), "--run", "r", "--db", str(db), "--dp", "0", "--zero", "4")
    assert attach.exit_code == 2
    assert _errors(attach) == [
        "error: --dp: input should be greater than or equal to 1 (got 0)",
        "error: --zero: input should be 0, 1, 2 or 3 (got 4)",
    ]


def test_user_values_print_as_typed_not_as_markup_or_emoji(tmp_path: Path) -> None:
    """`--hang 1:-1` printed "--hang 1👎 step -1" (rich's :-1: emoji code) and `--out runs/[bold]x` lost its
    brackets as markup."""
    bad = _cli("harness", "--out", str(tmp_path / "h"), "--dp", "2", "--hang", "1:-1", "--device", "cpu", "--dry-run")
    assert bad.exit_code != 0 and "--hang 1:-1: step -1 is not run" in " ".join(bad.output.split())
    out = tmp_path / "[bold]x"
    ok = _cli("harness", "--out", str(out), "--dp", "2", "--device", "cpu", "--dry-run")
    assert ok.exit_code == 0, ok.output
    assert f"run 1/1 [bold]x: ddp, world 2 (cpu) config {out}/.harness-config.json" in ok.output
