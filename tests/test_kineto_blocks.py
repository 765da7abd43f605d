"""The block reader (kineto_blocks + kineto_bulk) takes exactly what the event-by-event scan takes: the
same rows, tables, groups, steps, skips (in order), warnings and errors, on every real trace of the shared
data with every window offered to it, on a long synthetic trace, and on synthetic traces of odd shapes."""

from __future__ import annotations

import gzip
import re
from pathlib import Path
from typing import Any

import orjson
import pytest
from conftest import shared_data
from kineto_synth import STEP_CALLS, write_trace_gz
from parse_compare import assert_same_parse, count_block_events

from commlens.ingest import kineto, kineto_json
from commlens.ingest.inputs import InputFile, iter_inputs
from commlens.ingest.parse_file import ParsedFile, parse_file
from commlens.ingest.records import ParseResult, RankHint

RESNET = "kineto-hta/nccl_parser_config/nccl_data.json.gz"
SYNTH_CALLS = 20_000


def _inputs() -> list[InputFile]:
    data = shared_data()
    paths = [*sorted(data.glob("kineto-hta/**/*.json.gz")), data / "kineto-param/dlrm_kineto.tar.gz"]
    return list(iter_inputs(paths))


def _parse(item: InputFile, monkeypatch: pytest.MonkeyPatch, blocks: bool) -> tuple[ParsedFile, int]:
    """The parse with the block reader on (offered every window) or off; the wanted events it took."""
    monkeypatch.setattr(kineto, "BLOCKS", blocks)
    monkeypatch.setattr(kineto_json, "DENSE", 0)  # every window is offered to the block reader
    monkeypatch.setattr(kineto_json, "BLOCK", 1 << 20)  # small windows: many blocks, many window edges
    monkeypatch.setattr(kineto_json, "BLOCK_PAUSE", 0)  # a declined block does not keep the next ones out
    taken = count_block_events(monkeypatch)
    return parse_file(item, RankHint()), taken[0]


def _same(a: ParseResult, b: ParseResult) -> None:
    # how the events were read differs; what was found does not
    assert_same_parse(a, b, scan_keys=("decompressed_bytes", "nccl_kernels", "launches", "kernel_link"))


def _compare(item: InputFile, monkeypatch: pytest.MonkeyPatch) -> tuple[ParsedFile, int]:
    off, _ = _parse(item, monkeypatch, blocks=False)
    on, taken = _parse(item, monkeypatch, blocks=True)
    assert (on.error, on.kind) == (off.error, off.kind)
    if off.result is not None:
        assert on.result is not None
        _same(on.result, off.result)
    return on, taken


def test_real_traces_read_as_blocks_give_the_same_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    took = {}
    for item in _inputs():
        parsed, taken = _compare(item, monkeypatch)
        assert parsed.result is not None, parsed.error
        took[Path(item.name.split("!")[-1]).name] = taken
    assert len(took) == 15
    # the pretty-printed ResNet trace is read as blocks past its exact prefix
    assert took["nccl_data.json.gz"] > 1000, took


def test_a_long_synthetic_trace_is_read_as_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "allreduce.json.gz"
    write_trace_gz(shared_data() / RESNET, SYNTH_CALLS, path)
    parsed, taken = _compare(next(iter_inputs([path])), monkeypatch)
    assert parsed.result is not None
    rows = parsed.result.all_events()
    assert len(rows) == SYNTH_CALLS and {(r["op"], r["msg_bytes"], r["dur_us"]) for r in rows} == {
        ("all_reduce", 4096, 15.0)
    }
    assert taken > 3 * SYNTH_CALLS  # nearly every wanted event came through the block reader
    assert len(parsed.result.steps) == SYNTH_CALLS // STEP_CALLS


def _odd_trace(tmp_path: Path, name: str, edit: Any) -> InputFile:
    """The synthetic trace with `edit(event, i)` applied to each event (returning the event, or a list of
    events, or raw JSON text), written one event per line like the generator."""
    src = tmp_path / "base.json.gz"
    if not src.exists():
        write_trace_gz(shared_data() / RESNET, 4 * STEP_CALLS, src)
    doc = orjson.loads(gzip.decompress(src.read_bytes()))
    out: list[bytes] = []
    for i, ev in enumerate(doc.pop("traceEvents")):
        new = edit(ev, i)
        out.extend(e if isinstance(e, bytes) else orjson.dumps(e) for e in (new if isinstance(new, list) else [new]))
    head = orjson.dumps(doc)[:-1] + b',"traceEvents":[\n'
    path = tmp_path / f"{name}.json.gz"
    path.write_bytes(gzip.compress(head + b",\n".join(out) + b"\n]}\n", 1))
    return next(iter_inputs([path]))


def _args(ev: dict, **kw: Any) -> dict:
    return {**ev, "args": {**(ev.get("args") or {}), **kw}}


ODD = {
    # keys the parse does not read, and key orders other than Kineto's
    "extra_keys": lambda ev, i: {**ev, "x": [1, {"y": i}], "args": {**ev.get("args", {}), "z": {"n": [i]}}},
    "reordered": lambda ev, i: dict(reversed(list(ev.items()))) if i % 3 else ev,
    "args_reordered": lambda ev, i: (
        {**ev, "args": dict(reversed(list(ev.get("args", {}).items())))} if i % 5 == 1 else ev
    ),
    # an escaped name (the name regex of the fast scan does not see it), a quote inside a value
    "escaped": lambda ev, i: (
        orjson.dumps(ev).replace(b'"nccl:all_reduce"', b'"\\u006eccl:all_reduce"') if i % 7 == 2 else ev
    ),
    "quoted": lambda ev, i: _args(ev, note='say "hi"') if i % 11 == 3 else ev,
    # other phases, string and absent pids, nulls, a shared value whose type changes, sizes that change
    "phases": lambda ev, i: (
        {**ev, "ph": ["B", "i", "X", "E"][i % 4]} if i % 9 == 4 and "Launch" not in ev["name"] else ev
    ),
    "launch_phases": lambda ev, i: {**ev, "ph": "i"} if i == 9001 else ev,
    "string_pid": lambda ev, i: {**ev, "pid": "Spans"} if i % 13 == 5 else ev,
    "no_pid": lambda ev, i: {k: v for k, v in ev.items() if k != "pid"} if i % 17 == 6 else ev,
    "nulls": lambda ev, i: _args(ev, dtype=None) if i % 19 == 7 else ev,
    "type_change": lambda ev, i: (
        _args(ev, **{"Group size": "2"}) if i > 10000 and "Group size" in ev.get("args", {}) else ev
    ),
    "sizes": lambda ev, i: (
        _args(ev, **{"In msg nelems": i % 5, "Out msg nelems": i % 5}) if "In msg nelems" in ev.get("args", {}) else ev
    ),
    # ids past float64's exact integers, beside events without them
    "big_ids": lambda ev, i: (
        _args(ev, **{"External id": 2**60 + i, "Seq": 2**60 + 3 * i})
        if i % 3
        else {**ev, "args": {k: v for k, v in ev.get("args", {}).items() if k != "External id"}}
    ),
    "float_ids": lambda ev, i: _args(ev, **{"External id": 1.5}) if i % 23 == 8 else ev,
    "negative_dur": lambda ev, i: {**ev, "dur": -0.0 if i % 2 else -3.0} if i % 29 == 9 else ev,
    "labels": lambda ev, i: (
        [
            {**ev, "name": "commlens:dp:0", "ts": ev["ts"] - 0.5, "dur": ev["dur"] + 1, "args": {}},
            ev,
        ]
        if ev.get("name") == "record_param_comms" and i % 3 == 0
        else ev
    ),
    "gpu_annotations": lambda ev, i: [ev, {**ev, "cat": "gpu_user_annotation"}] if ev.get("cat") == "kernel" else ev,
    "nan": lambda ev, i: re.sub(rb'"dur":[0-9.]+', b'"dur":NaN', orjson.dumps(ev)) if i == 12001 else ev,
    "deep": lambda ev, i: (
        orjson.dumps(_args(ev, deep=0)).replace(b'"deep":0', b'"deep":' + b"[" * 70 + b"]" * 70) if i == 12002 else ev
    ),
}


@pytest.mark.parametrize("shape", sorted(ODD))
def test_odd_shapes_read_as_blocks_give_the_same_parse(
    shape: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    item = _odd_trace(tmp_path, shape, ODD[shape])
    parsed, taken = _compare(item, monkeypatch)
    if shape not in ("escaped", "quoted", "string_pid", "nulls", "float_ids"):
        assert taken > 1000  # the block reader took part of it
    if shape == "nan":
        assert parsed.error is not None and re.search(r"NaN .*not a JSON number", parsed.error), parsed.error
    elif shape == "deep":
        assert parsed.error is not None and "nested deeper" in parsed.error, parsed.error
    else:
        assert parsed.result is not None and parsed.result.n_events > 0, parsed.error
