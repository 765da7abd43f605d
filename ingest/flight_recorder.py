"""PyTorch Flight Recorder dumps: the last N collectives of one rank, written when a job hangs or times out.

Read as PyTorch 2.13 writes them (`torch/csrc/distributed/c10d/FlightRecorder.hpp`, dump version "2.10";
earlier versions not checked): a dict with `version`, `pg_config`
(group name -> {name, desc, ranks}), `pg_status` and `entries`, each entry one call with `record_id`,
`pg_id`, `process_group` [name, desc], `collective_seq_id`, `p2p_seq_id`, `op_id`, `profiling_name`
("nccl:all_reduce", "gloo:broadcast"), `input_sizes`/`output_sizes` (one shape per tensor), their dtypes
(c10 names: "Float", "BFloat16"), `state` (scheduled | started | completed), `time_created_ns`,
`time_discovered_started_ns`/`..._completed_ns` (0: not seen), `duration_ms` (NCCL with timing only),
`timeout_ms`, `retired`, `is_p2p`.

Two encodings: `_dump_fr_trace_json` (JSON, no stack frames) and `_dump_fr_trace` (pickle, what
`TORCH_FR_DUMP_TEMP_FILE` files hold). A pickle is code: it is read by `SafeUnpickler`, which builds only
plain containers and scalars and refuses any global (class or function) by its name.

The dump does not say its rank: the file name does (`nccl_trace_rank_3`, `host1-rank3.json`, `fr.rank3`),
else `--rank`. Each entry becomes a call (comm_events, group `pg:<name>` as in profiler traces, `match_key`
the collective sequence number) and an `fr_entries` row with its state for the hang analysis.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import re
from typing import Any

from commlens.vocab import C10_DTYPES, dtype_size, normalize_op

from .inputs import Limits
from .records import ParseError, ParseResult, RankHint

MAX_DUMP_BYTES = 512 * 2**20  # a dump holds at most TORCH_FR_BUFFER_SIZE entries: far below this
STATES = ("scheduled", "started", "completed")
PICKLE_PROTOCOLS = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")

# A `_coalescing_manager` group outside its fast path (an all_gather or reduce_scatter whose tensors differ in
# size) runs one _broadcast_oop / _reduce_oop per rank and ends with an entry named after the op (torch 2.8+,
# dump version 2.7+: each part recorded, with the same collective_seq_id, then the end entry without sizes).
# The group is one call: the end entry's, sized by its parts (all_gather: outputs, reduce_scatter: inputs).
COALESCED_ENDS = {"ALLGATHER_coalesced": "all_gather", "REDUCE_SCATTER_coalesced": "reduce_scatter"}
COALESCED_PARTS = ("_broadcast_oop", "_reduce_oop")
# ProcessGroupNCCL names a point-to-point call with both group ranks: "nccl:send 0->1", "nccl:recv 1<-0".
_P2P_PEER = re.compile(r"(?:send|recv) (\d+)(?:->|<-)(\d+)$")

__all__ = ["STATES", "SafeUnpickler", "parse_flight_recorder", "read_dump"]


class SafeUnpickler(pickle.Unpickler):
    """Builds dicts, lists, tuples, strings, numbers, bools and None; any global is refused by name, so
    a pickle that would import or call something (os.system, builtins.eval, a class) never runs it."""

    def find_class(self, module: str, name: str) -> Any:
        raise ParseError(
            f"a pickle that would load {module}.{name}: refused (a Flight Recorder dump holds only plain "
            "containers and scalars; an uploaded pickle is code)",
            "pickle",
        )

    def persistent_load(self, pid: Any) -> Any:
        raise ParseError("a pickle with persistent ids: refused (not a Flight Recorder dump)", "pickle")


def _read_bounded(stream: io.BufferedReader) -> bytes:
    data = stream.read(MAX_DUMP_BYTES + 1)
    if len(data) > MAX_DUMP_BYTES:
        raise ParseError(f"larger than {MAX_DUMP_BYTES >> 20} MiB: not a Flight Recorder dump", "byte 0")
    return data


def read_dump(data: bytes, limits: Limits) -> tuple[dict[str, Any], str]:
    """The dump as a dict and its encoding ("json" or "pickle"), from JSON or (restricted) pickle bytes;
    ParseError naming what is wrong."""
    if data[:2] in PICKLE_PROTOCOLS:
        try:
            obj = SafeUnpickler(io.BytesIO(data)).load()
        except ParseError:
            raise
        except RecursionError:
            raise ParseError("pickle nested too deeply", "pickle") from None
        except Exception as exc:  # any malformed pickle (truncated, bad opcode)
            raise ParseError(f"unreadable pickle ({type(exc).__name__}: {exc})", "pickle") from None
        where = encoding = "pickle"
    else:
        try:
            obj = json.loads(data, parse_constant=_no_constant)
        except RecursionError:
            raise ParseError(f"JSON nested deeper than {limits.max_json_depth} levels", "$") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            line = getattr(exc, "lineno", 1)
            raise ParseError(f"truncated or malformed JSON ({exc})", f"line {line}") from None
        where, encoding = "$", "json"
    if isinstance(obj, dict) and "entries" not in obj and "pg_config" in obj:
        obj["entries"] = []  # torch leaves the key out of a dump whose buffer holds no entry
    if not isinstance(obj, dict) or not isinstance(obj.get("entries"), list):
        raise ParseError("not a Flight Recorder dump: no 'entries' list", where)
    return obj, encoding


def _no_constant(token: str) -> None:
    raise ParseError(f"{token} is not JSON", "$")


def _dtype(names: Any) -> str | None:
    if isinstance(names, list | tuple) and names and isinstance(names[0], str):
        return C10_DTYPES.get(names[0], names[0].lower())
    return None


def _tensors(shapes: Any, dtypes: Any) -> tuple[int | None, int | None, str | None]:
    """Elements and bytes of all tensors of one side of a call (input_sizes/output_sizes: one shape per tensor,
    input_dtypes/output_dtypes: one c10 name per tensor), and the first tensor's dtype. Coalesced ops
    (allreduce_coalesced, all_gather_into_tensor_coalesced) and list forms (gloo's all_gather, all_to_all)
    record one shape per tensor: they are summed, as Kineto's In/Out msg nelems are. (None, None, dtype) when
    the shapes are unreadable; bytes None when a dtype is unknown."""
    names = list(dtypes) if isinstance(dtypes, list | tuple) else []
    dtype = _dtype(names)
    if not isinstance(shapes, list | tuple) or not shapes:
        return None, None, dtype
    elems: int = 0
    nbytes: int | None = 0
    for i, dims in enumerate(shapes):
        if not isinstance(dims, list | tuple) or not all(isinstance(d, int) and d >= 0 for d in dims):
            return None, None, dtype
        n = math.prod(dims)
        size = dtype_size(_dtype(names[i : i + 1]) or dtype)
        elems += n
        nbytes = nbytes + n * size if size and nbytes is not None else None
    return elems, nbytes, dtype


def _add_part(
    parts: dict[tuple[str | None, Any], list[Any]], key: tuple[str | None, Any], entry: dict[str, Any]
) -> None:
    """Adds one part of a coalesced group to the running sums [elems_in, bytes_in, elems_out, bytes_out, dtype]."""
    ein, bin_, din = _tensors(entry.get("input_sizes"), entry.get("input_dtypes"))
    eout, bout, dout = _tensors(entry.get("output_sizes"), entry.get("output_dtypes"))
    acc = parts.setdefault(key, [0, 0, 0, 0, din or dout])
    for j, v in enumerate((ein, bin_, eout, bout)):
        acc[j] = acc[j] + v if acc[j] is not None and v is not None else None


def _peer(raw: str, op: str, group_ranks: list[int] | None) -> int | None:
    """The global rank of a send's or recv's peer: the group rank its profiling name ends with, through the
    group's ranks (pg_config); None when the name or the ranks do not say it."""
    m = _P2P_PEER.search(raw) if op in ("send", "recv") else None
    if m is None or not group_ranks:
        return None
    peer = int(m.group(2))
    return group_ranks[peer] if peer < len(group_ranks) else None


def _ns_to_us(v: Any) -> float | None:
    return v / 1000.0 if isinstance(v, int | float) and v > 0 else None


def _group_ranks(pg_config: Any) -> dict[str, list[int]]:
    """group name -> global ranks, from pg_config (its `ranks` is a JSON list written as a string)."""
    out: dict[str, list[int]] = {}
    if not isinstance(pg_config, dict):
        return out
    for key, cfg in pg_config.items():
        if isinstance(cfg, list) and cfg and all(isinstance(r, int) for r in cfg):
            out[str(key)] = cfg  # dump version 1.x: pg_id -> [global ranks]
            continue
        if not isinstance(cfg, dict):
            continue
        ranks = cfg.get("ranks")
        if isinstance(ranks, str):
            try:
                ranks = json.loads(ranks)
            except json.JSONDecodeError:
                continue
        if isinstance(ranks, list) and ranks and all(isinstance(r, int) for r in ranks):
            out[str(cfg.get("name") or key)] = ranks
    return out


def parse_flight_recorder(stream: io.BufferedReader, name: str, hint: RankHint, limits: Limits) -> ParseResult:
    """One rank's dump: calls in comm_events, each entry with its state in fr_entries."""
    dump, encoding = read_dump(_read_bounded(stream), limits)
    if hint.rank is None:
        raise ParseError(
            "a Flight Recorder dump does not say its rank: name the file with it (nccl_trace_rank_3, "
            "host-rank3.json) or pass --rank",
            None,
        )
    rank = hint.rank
    version = str(dump.get("version", ""))
    result = ParseResult(kind="flight_recorder", rank=rank, world_size=hint.world_size)
    ranks_of = _group_ranks(dump.get("pg_config"))
    seen_groups: dict[str, dict[str, Any]] = {}
    parts: dict[tuple[str | None, Any], list[Any]] = {}
    for i, entry in enumerate(dump["entries"]):
        where = f"$.entries[{i}]"
        if not isinstance(entry, dict):
            raise ParseError("an entry is not an object", where)
        raw = entry.get("profiling_name")
        if not isinstance(raw, str):
            raise ParseError("entry without profiling_name", where)
        state = entry.get("state")
        if state not in STATES:
            raise ParseError(f"state {state!r} is none of {', '.join(STATES)}", f"{where}.state")
        pg = entry.get("process_group")
        pg_name, pg_desc = (str(pg[0]), str(pg[1])) if isinstance(pg, list | tuple) and len(pg) == 2 else (None, None)
        if pg_name is None and "process_group" not in entry and isinstance(entry.get("pg_id"), int):
            pg_name = str(entry["pg_id"])  # dump version 1.x (torch 2.2-2.3): the group is its pg_id only
        seq_id = entry.get("collective_seq_id", entry.get("seq_id"))  # 1.x: "seq_id"
        base = raw.rsplit(":", 1)[-1]
        end_of = COALESCED_ENDS.get(base)
        if base in COALESCED_PARTS:
            _add_part(parts, (pg_name, seq_id), entry)
            result.skip(f"part of a coalesced all_gather or reduce_scatter (counted with its end entry): {raw[:60]}")
            continue
        op = end_of or normalize_op(raw)
        if op is None:
            result.skip(f"not a communication op: {raw[:60]}")
            continue
        group_key = f"pg:{pg_name}" if pg_name is not None else None
        elems_in, bytes_in, dtype_in = _tensors(entry.get("input_sizes"), entry.get("input_dtypes"))
        elems_out, bytes_out, dtype_out = _tensors(entry.get("output_sizes"), entry.get("output_dtypes"))
        dtype = dtype_in or dtype_out
        if end_of is not None and not entry.get("input_sizes") and not entry.get("output_sizes"):
            part = parts.pop((pg_name, seq_id), None)  # the entries of the group this one ends
            elems_in, bytes_in, elems_out, bytes_out, dtype = part or (None, None, None, None, None)
        msg = max(bytes_in or 0, bytes_out or 0) if bytes_in is not None or bytes_out is not None else None
        group_ranks = ranks_of.get(pg_name or "")
        dur_ms = entry.get("duration_ms")
        dur_us = float(dur_ms) * 1000.0 if isinstance(dur_ms, int | float) and dur_ms >= 0 else None
        created = _ns_to_us(entry.get("time_created_ns"))
        p2p_seq = entry.get("p2p_seq_id")
        is_p2p = bool(entry.get("is_p2p"))
        peer = _peer(raw, op, group_ranks)
        result.events.append(
            {
                "rank": rank,
                "process": f"rank{rank}",
                "seq": i,
                "op": op,
                "dtype": dtype,
                "msg_bytes": msg,
                "elems_in": elems_in,
                "elems_out": elems_out,
                "group_size": len(group_ranks) if group_ranks else None,
                "group_key": group_key,
                "peer": peer,
                "ts_us": created,
                "dur_us": dur_us,
                "dur_source": "kernel" if dur_us is not None else None,
                "raw_name": raw,
                "match_key": p2p_seq if is_p2p else seq_id,
            }
        )
        result.fr_entries.append(
            {
                "rank": rank,
                "record_id": entry.get("record_id"),
                "group_key": group_key,
                "group_name": pg_name,
                "group_desc": pg_desc,
                "group_ranks": group_ranks,
                "collective_seq": seq_id,
                "p2p_seq": p2p_seq,
                "op_id": entry.get("op_id"),
                "op": op,
                "raw_name": raw,
                "is_p2p": is_p2p,
                "dtype": dtype,
                "msg_bytes": msg,
                "state": state,
                "created_us": created,
                "started_us": _ns_to_us(entry.get("time_discovered_started_ns")),
                "completed_us": _ns_to_us(entry.get("time_discovered_completed_ns")),
                "duration_us": dur_us,
                "timeout_ms": entry.get("timeout_ms") if isinstance(entry.get("timeout_ms"), int | float) else None,
                "retired": bool(entry.get("retired")),
            }
        )
        if group_key is not None and group_key not in seen_groups:
            seen_groups[group_key] = {
                "group_key": group_key,
                "name": pg_name,
                "description": pg_desc,
                "ranks": group_ranks,
                "size": len(group_ranks) if group_ranks else None,
                "origin": "event",
            }
    result.groups = list(seen_groups.values())
    completed = [e for e in result.fr_entries if e["state"] == "completed"]
    result.meta = {
        "format": "flight_recorder",
        "version": version,
        "encoding": encoding,
        "entries": len(result.fr_entries),
        "records_completion": bool(completed) or any(e["started_us"] for e in result.fr_entries),
    }
    if not dump["entries"]:
        result.warn(
            "the dump holds no entry: no collective had run on this rank when it was written, or the buffer is off "
            "(TORCH_NCCL_TRACE_BUFFER_SIZE unset or 0)"
        )
    if result.fr_entries and all(e["dtype"] is None for e in result.fr_entries):
        result.warn(
            f"dump version {version or '?'} records no input_dtypes/output_dtypes (before 2.x): "
            "the calls' sizes in bytes are unknown"
        )
    if result.fr_entries and not result.meta["records_completion"]:
        result.warn(
            "no entry of this dump is started or completed: the backend (gloo) records when calls are scheduled "
            "only, so the hang analysis compares sequence numbers across ranks"
        )
    return result
