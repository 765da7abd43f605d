"""Instances pages sized by member rows, instances without members, and one instance's members on request
(issue 15 item 3: a page of 100 instances at 1,024 ranks was 102,400 member rows), on a planted store; the Time
page's wait heatmap binned beyond 128 ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from dash import dcc

from commlens import store
from commlens.backend.api import Settings
from commlens.backend.api.testing import ServerThread
from commlens.contract.time import MAX_MEMBER_ROWS, Instance, InstanceMember, InstancesPage, TimeStatus
from commlens.frontend.client import ApiClient
from commlens.frontend.page_time import waits_view
from commlens.service import time as service
from commlens.service.errors import NotFoundError

SIZES = [4, 4, 10, 3, 3, 3]  # members of instances 0..5


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "paging.duckdb"
    con = store.connect(path)
    run_id = store.ensure_run(con, "p")
    for k, n in enumerate(SIZES):
        con.execute(
            "INSERT INTO time_instances (run_id, instance_id, group_key, scheme, op, step, match_key, keyed_by, members) "
            "VALUES (?, ?, 'g', 'dp', 'all_reduce', 1, ?, 'key', ?)",
            [run_id, k, 100 + k, n],
        )
        con.execute(
            "INSERT INTO time_instance_members SELECT ?, ?, r, 1, 10 * r + ?, 1.0 * r, 50.0, ? - 1.0 * r FROM range(?) t(r)",
            [run_id, k, k, n - 1, n],
        )
    con.close()
    return path


def _ids(page: InstancesPage) -> list[int]:
    return [i.instance_id for i in page.items]


def test_pages_stop_at_the_member_rows_and_hold_at_least_one_instance(db: Path) -> None:
    con = store.connect(db)
    try:
        pages, offset = [], 0
        while offset is not None:
            page = service.instances(con, "p", limit=100, offset=offset, max_members=8)
            pages.append((_ids(page), [len(i.members) for i in page.items], page.next_offset))
            offset = page.next_offset
        assert pages == [([0, 1], [4, 4], 2), ([2], [10], 3), ([3, 4], [3, 3], 5), ([5], [3], None)]
        assert _ids(service.instances(con, "p", limit=2, offset=3, max_members=100)) == [3, 4]
        # the default cap keeps a small run's page whole; limit still bounds it
        whole = service.instances(con, "p")
        assert (_ids(whole), whole.next_offset, whole.max_members) == ([0, 1, 2, 3, 4, 5], None, MAX_MEMBER_ROWS)
        bare = service.instances(con, "p", members=False, max_members=1)
        assert [(i.instance_id, i.member_count, i.members, i.members_included) for i in bare.items] == [
            (k, n, [], False) for k, n in enumerate(SIZES)
        ]
        one = service.instance(con, "p", 2)
        assert (one.member_count, one.members_included) == (10, True)
        assert [(m.rank, m.seq, m.wait_us) for m in one.members] == [(r, 10 * r + 2, 9.0 - r) for r in range(10)]
        with pytest.raises(NotFoundError, match="no instance 6"):
            service.instance(con, "p", 6)
    finally:
        con.close()


def test_the_api_and_the_dashboard_client(db: Path) -> None:
    with ServerThread(Settings(db=db)) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        url = "/api/runs/p/time/instances"
        page = c.get(url, params={"max_members": 9, "offset": 2}).json()
        assert ([i["instance_id"] for i in page["items"]], page["next_offset"], page["total"]) == ([2], 3, 6)
        bare = c.get(url, params={"members": "false", "limit": 2}).json()
        assert [(i["member_count"], i["members"], i["members_included"]) for i in bare["items"]] == [
            (4, [], False),
            (4, [], False),
        ]
        assert c.get(url, params={"max_members": 0}).status_code == 422
        assert c.get(f"{url}/6").status_code == 404 and c.get(f"{url}/-1").status_code == 422
        # the pairs matrices' bins (no all_to_all in this run: the reason, and a refused 0)
        assert c.get("/api/runs/p/pairs", params={"bins": 4}).json()["reason"] == "this run has no all_to_all calls"
        assert c.get("/api/runs/p/pairs", params={"bins": 0}).status_code == 422
        ui = ApiClient(srv.url)
        assert ui.pairs("p", bins=4).matrices == []
        assert [m.rank for m in ui.time_instance("p", 3).members] == [0, 1, 2]
        assert _ids(ui.time_instances("p", max_members=11)) == [0, 1]
        assert ui.time_instances("p", members=False).items[2].member_count == 10


def _graph(component: Any) -> Any:
    """The first dcc.Graph under a Dash component."""
    if isinstance(component, dcc.Graph):
        return component
    children = getattr(component, "children", None)
    for child in children if isinstance(children, list) else [children]:
        if child is not None and not isinstance(child, str) and (found := _graph(child)) is not None:
            return found
    return None


def test_the_wait_heatmap_bins_ranks_beyond_128() -> None:
    """300 ranks: rows of 3 consecutive ranks holding their longest wait; 100 ranks: one row per rank."""

    def inst(k: int, ranks: int) -> Instance:
        members = [
            InstanceMember(rank=r, seq=k, arrival_us=0.0, end_us=1.0, wait_us=float(r % 7)) for r in range(ranks)
        ]
        return Instance(
            instance_id=k, group="g", scheme="dp", key=k, keyed_by="key", op="all_reduce", dtype=None,
            msg_bytes=None, step=1, skew_us=6.0, last_rank=0, first_arrival_us=0.0, last_arrival_us=6.0,
            real_us=1.0, algbw_gbps=None, busbw_gbps=None, members=members, member_count=ranks,
        )  # fmt: skip

    status = TimeStatus(available=True, parts=[])
    heat = _graph(waits_view("r", 1, [inst(0, 300), inst(1, 300)], status)).figure["data"][0]
    assert len(heat["y"]) == 100 and list(heat["y"][:2]) == ["0-2", "3-5"] and heat["y"][-1] == "297-299"
    # ranks 0-2 wait 0, 1, 2 µs: the row holds 2 µs (0.002 ms); ranks 6-8 wait 6, 0, 1: 6 µs
    assert [round(v, 6) for v in heat["z"][0]] == [0.002, 0.002] and round(heat["z"][2][1], 6) == 0.006
    plain = _graph(waits_view("r", 1, [inst(0, 100)], status)).figure["data"][0]
    assert list(plain["y"]) == list(range(100)) and round(plain["z"][6][0], 6) == 0.006
