"""`commlens harness --hang RANK:STEP`: real torchrun/gloo processes where one rank never arrives.

The planted rank stops before its next collective; its peers' gloo all-reduce times out (--timeout), every
rank leaves its Flight Recorder dump (torch 2.13 records gloo collectives when TORCH_FR_BUFFER_SIZE is set),
the command exits non-zero naming the rank, and the dumps ingested into a store give the report's "hang"."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import background
import pytest

from commlens.backend.findings import findings
from commlens.backend.hang import root_ranks
from commlens.backend.report import _hang_md, build_report, render_markdown
from commlens.contract.hang import HangGroup
from commlens.harness import launch
from commlens.harness.config import ConfigError, Hang, HarnessConfig, validation_errors
from commlens.service.hang import hang_report
from commlens.service.ingest import ingest_paths

# The process-group timeout of the hang run: the test waits it out once. 8 s once expired inside a healthy
# all-reduce of step 1 on a crowded host (rank 1 arrived that late, finished it and went on to its planted hang,
# so both dumps ended at the same call and no rank was named): it must exceed any scheduling stall.
HANG_TIMEOUT_S = 20


def test_bad_hang_specs_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"--hang '1-2': expected RANK:STEP with two integers, for example 1:2"):
        Hang.parse("1-2")
    cfg = HarnessConfig(dp=2, steps=4, hang=Hang(2, 4))
    assert validation_errors(cfg) == [
        "--hang 2:4: rank 2 is not in the job (ranks 0-1)",
        "--hang 2:4: step 4 is not run (steps 0-3)",
    ]
    assert HarnessConfig(**json.loads(HarnessConfig(dp=2, hang=Hang(1, 2)).to_json())).hang == Hang(1, 2)


def test_flight_recorder_dumps_are_harness_outputs(tmp_path: Path) -> None:
    """Dumps a --hang run left are outputs: listed for ingestion after run.json and the traces, seen by the
    'already holds outputs' check, and deleted by --overwrite."""
    out = tmp_path / "run"
    out.mkdir()
    for name in ("flight_recorder.rank1.json", "flight_recorder.rank0.json", "trace.rank0.json.gz", "run.json"):
        (out / name).write_text("{}")
    assert [p.name for p in launch.output_files(out)] == [
        "run.json",
        "trace.rank0.json.gz",
        "flight_recorder.rank0.json",
        "flight_recorder.rank1.json",
    ]
    for name in ("run.json", "trace.rank0.json.gz"):
        (out / name).unlink()
    run = launch.PlannedRun(name="run", out=out, cfg=HarnessConfig(dp=2))
    with pytest.raises(ConfigError, match=r"already holds harness outputs \(flight_recorder.rank0.json, ...\)"):
        launch.prepare(run, overwrite=False)
    launch.prepare(run, overwrite=True)
    assert launch.existing_outputs(out) == [] and (out / launch.CONFIG_NAME).is_file()


def _hang_run(folder: Path) -> background.Command:
    args = [sys.executable, "-m", "commlens.cli", "harness", "--out", str(folder / "hang"), "--dp", "2"]
    args += ["--device", "cpu", "--steps", "4", "--hang", "1:2", "--timeout", str(HANG_TIMEOUT_S)]
    args += ["--ingest", "--db", str(folder / "ingested.duckdb")]  # a hung run is ingested too: its dumps tell why
    return background.Command(args, dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="400"))


# The hang run waits out its timeout while the tests before this module run (tests/background.py).
BACKGROUND = {"hang": _hang_run} if importlib.util.find_spec("torch") else {}


def test_the_hang_starts_where_a_missing_rank_waits_in_nothing() -> None:
    """`--dp 2 --tp 2 --hang 3:3`: rank 2 never enters dp's all-reduce because it waits in tp's for rank 3; the
    harness named "hung ranks: 2, 3" and the report listed both as never arrived, the bystander unmarked."""
    tp = HangGroup(
        group="tp", group_key="pg:2", op="all_reduce", seq=41, msg_bytes=4, arrived_ranks=[2], missing_ranks=[3]
    )
    dp = HangGroup(
        group="dp", group_key="pg:1", op="all_reduce", seq=9, msg_bytes=8, arrived_ranks=[0], missing_ranks=[2]
    )
    assert root_ranks([dp, tp]) == [3]
    assert (
        "**Where it starts: rank 3** (never arrived, and waits in no call that hung; rank 2 only missing"
        in "\n".join(_hang_md([dp, tp]))
    )
    cycle = HangGroup(
        group="w", group_key="pg:0", op="all_reduce", seq=1, msg_bytes=4, arrived_ranks=[0], missing_ranks=[1]
    )
    back = HangGroup(
        group="v", group_key="pg:3", op="broadcast", seq=1, msg_bytes=4, arrived_ranks=[1], missing_ranks=[0]
    )
    assert root_ranks([cycle, back]) == [0, 1]  # each waits for the other: both are named


def test_a_rank_that_never_arrives_is_named(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    folder, proc = background.result("hang", _hang_run, timeout=300)
    out = folder / "hang"
    output = proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.returncode == 1, output
    assert "[commlens harness] rank 1 hangs at step 2 (--hang)" in proc.stdout, output
    assert "hung ranks: 1" in proc.stderr, output
    assert "ranks [1] never arrived (arrived: [0])" in proc.stderr, output
    assert re.search(r"ingested (\d+)/\1 files into .* as run 'hang'", " ".join(proc.stdout.split())), output
    dumps = sorted(p.name for p in out.glob("flight_recorder.rank*.json"))
    assert dumps == ["flight_recorder.rank0.json", "flight_recorder.rank1.json"]
    assert [p.name for p in launch.output_files(out) if p.name.startswith("flight_recorder.")] == dumps

    from commlens import store

    con = store.connect(tmp_path / "s.duckdb")
    try:
        summary = ingest_paths(con, [out / d for d in dumps], "hang")
        assert [(f.kind, f.rank, f.status) for f in summary.files] == [
            ("flight_recorder", 0, "ok"),
            ("flight_recorder", 1, "ok"),
        ]
        report = hang_report(con, "hang")
        [g] = report.groups
        assert (g.group, g.op, g.arrived_ranks, g.missing_ranks) == ("default_pg", "all_reduce", [0], [1])
        # rank 0 entered one more DDP bucket all-reduce than rank 1 (which stopped before step 2's forward)
        rank1 = next(r for r in g.ranks if r.rank == 1)
        assert rank1.last_seq == g.seq - 1 and rank1.last_op == "all_reduce"
        hang = json.loads(build_report(con, "hang").model_dump_json())["hang"]
        assert [(h["group"], h["op"], h["seq"], h["arrived_ranks"], h["missing_ranks"]) for h in hang] == [
            ("default_pg", "all_reduce", g.seq, [0], [1])
        ]
        # the report and the findings say where the hang starts
        md = render_markdown(build_report(con, "hang"))
        assert "**Where it starts: rank 1**." in md, md
        (hung,) = [f for f in findings(con, "hang") if f.id == "hang"]
        assert hung.severity == "high" and hung.ranks == [1] and "rank 1 never arrived at all_reduce" in hung.title
        # the whole output directory is one job: a rank's dump and its trace describe one process from two
        # sides (they were split into two runs, "rank 0-1 in both"), so hang and time analysis share a run
        whole = ingest_paths(con, [out], "whole")
        stored = [(Path(f.path).name, f.run or "whole") for f in whole.files if f.status == "ok"]
        assert {name for name, _ in stored} >= {*dumps, "trace.rank0.json.gz"}, stored  # rank 1 hung before its trace
        assert {run for _, run in stored} == {"whole"}, stored
        assert [grp.missing_ranks for grp in hang_report(con, "whole").groups] == [[1]]
    finally:
        con.close()
