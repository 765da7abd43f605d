"""Threads per parse: a parse alone may use the cores (an NCCL log's block cutters), a parse beside worker
processes one, in the workers themselves and in the writer while its workers run."""

from __future__ import annotations

import threading

from commlens.ingest import parse_threads as pt
from commlens.service.parse_pool import ParsePool


def test_a_parse_alone_uses_the_cores_and_one_beside_workers():
    alone = pt.parse_threads(2)
    assert alone == min(2, pt.cores())
    with pt.sharing_cores():
        assert pt.parse_threads(2) == 1
        with pt.sharing_cores():
            assert pt.parse_threads(2) == 1
        assert pt.parse_threads(2) == 1  # the outer ingest still shares
    assert pt.parse_threads(2) == alone


def test_concurrent_ingests_leave_the_count_as_it_was():
    barrier = threading.Barrier(8)

    def ingest() -> None:
        with pt.sharing_cores():
            barrier.wait()

    threads = [threading.Thread(target=ingest) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pt._sharing == 0


def test_a_parse_pool_worker_shares_the_cores():
    with ParsePool(1) as pool:
        assert pool.executor.submit(pt.parse_threads, 2).result(timeout=120) == 1
