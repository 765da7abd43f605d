"""Two parses of one file compared: the same rows, table for table, and the same counts, warnings and meta;
and a count of what the Kineto block reader took, for the tests that compare its path with the others."""

from __future__ import annotations

from typing import Any

import pytest

from commlens.ingest import kineto_bulk
from commlens.ingest.records import ParseResult


def count_block_events(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on (for the test), the wanted events the block reader takes add up in the list's one item."""
    taken = [0]
    call = kineto_bulk.BulkReader.__call__

    def spy(self: kineto_bulk.BulkReader, *args: Any) -> int | None:
        n = call(self, *args)
        taken[0] += n or 0
        return n

    monkeypatch.setattr(kineto_bulk.BulkReader, "__call__", spy)
    return taken


def assert_same_parse(a: ParseResult, b: ParseResult, scan_keys: tuple[str, ...] | None = None) -> None:
    """With `scan_keys`, meta["scan"] (how the events were read) is compared on those keys only."""
    assert (a.rank, a.world_size, a.kind) == (b.rank, b.world_size, b.kind)
    ta, tb = a.tables(), b.tables()
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert ta[name].equals(tb[name]), name
    assert a.all_events() == b.all_events()
    assert a.groups == b.groups and a.steps == b.steps
    assert list(a.skipped.items()) == list(b.skipped.items())
    assert a.warnings == b.warnings
    meta_a, meta_b = dict(a.meta), dict(b.meta)
    if scan_keys is not None:
        scan_a, scan_b = meta_a.pop("scan"), meta_b.pop("scan")
        for key in scan_keys:
            assert scan_a[key] == scan_b[key], key
    assert meta_a == meta_b
