"""The ingest parser of run.json files (validated by commlens.run_json.RunConfig): the config is attached to the
run, its process groups labelled with their mesh dimension."""

from __future__ import annotations

import io

import orjson
from pydantic import ValidationError

from commlens.run_json import RunConfig

from .inputs import Limits
from .records import ParseError, ParseResult, RankHint


def parse_run_config(stream: io.BufferedReader, name: str, hint: RankHint, limits: Limits) -> ParseResult:
    data = stream.read(16 << 20)
    if stream.read(1):
        raise ParseError("run.json larger than 16 MiB")
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ParseError(f"invalid JSON ({exc})", f"line {getattr(exc, 'lineno', '?')}") from None
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        path = "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"])
        raise ParseError(f"not a valid commlens run.json: {first['msg']}", path) from None
    result = ParseResult(kind="run_config", world_size=cfg.world_size)
    result.run_config = cfg.model_dump(mode="json", by_alias=True)
    for g in cfg.groups:
        if g.pg_name is None:
            continue
        result.groups.append(
            {
                "group_key": f"pg:{g.pg_name}",
                "name": g.pg_name,
                "description": g.pg_desc,
                "backend": g.backend,
                "ranks": g.ranks,
                "size": len(g.ranks),
                "origin": "run_config",
                "mesh_dim": g.dim,
            }
        )
    return result
