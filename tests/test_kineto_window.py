"""The scan window's buffer handling: blocks read into reused buffers, the dropped front moved in place
(kineto_json._BlockReader, _Window). The bytes the window holds must be exactly the stream's, whatever
the block size and however much of the front each step drops."""

from __future__ import annotations

import io
import random

import pytest

from commlens.ingest import kineto_json
from commlens.ingest.inputs import TapReader


@pytest.mark.parametrize("block", [1, 7, 64, 4096])
def test_window_holds_the_stream_bytes_across_blocks_and_drops(block: int) -> None:
    rng = random.Random(block)
    content = bytes(rng.randrange(256) for _ in range(20_000))
    reader = kineto_json._BlockReader(io.BufferedReader(io.BytesIO(content), 16), block)
    win = kineto_json._Window(reader)
    try:
        win.more(0)
        while True:
            assert bytes(win.data) == content[win.base : win.base + len(win.data)]
            if win.eof:
                break
            win.more(rng.randrange(len(win.data) + 1))  # anything from nothing to everything held
        assert win.base + len(win.data) == len(content)
    finally:
        reader.close()
    assert reader._made <= kineto_json.POOL  # buffers are handed back and reused, not made per block


def test_tap_reader_reads_into_the_buffer_and_shows_each_chunk_once() -> None:
    content = bytes(range(256)) * 100
    seen: list[bytes] = []
    tap = TapReader(io.BytesIO(content), lambda view: seen.append(bytes(view)))
    out = io.BufferedReader(tap, 1000).read()
    assert out == content
    assert b"".join(seen) == content


def test_tap_reader_of_a_stream_without_readinto() -> None:
    class ReadOnly:
        def __init__(self, data: bytes) -> None:
            self._f = io.BytesIO(data)

        def read(self, n: int = -1) -> bytes:
            return self._f.read(min(n, 100))

        def close(self) -> None:
            pass

    seen: list[int] = []
    tap = TapReader(ReadOnly(b"x" * 1234), lambda view: seen.append(len(view)))  # type: ignore[arg-type]
    assert io.BufferedReader(tap, 64).read() == b"x" * 1234
    assert sum(seen) == 1234
