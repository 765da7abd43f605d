"""The topology page over every shared NCCL log excerpt in one run (`--one-run`), in a real browser against a
real `commlens serve`: each table equals the API's rows, the connections grid names each sender -> receiver
pair's transport and channel count, a chosen communicator filters the page and stays in the URL, and the
page is a handful of Dash components whatever the number of rows (the renderer's cost grows with them;
bench/topology.py times it)."""

from __future__ import annotations

import importlib.util
from collections import defaultdict
from typing import Any

import httpx
import pytest
import test_ui
from test_ui import CHROMIUM, Tab, _cli, _data_dir, _missing, expect

from commlens.frontend.client import ApiClient
from commlens.frontend.page_topology import fetch

pytestmark = pytest.mark.slow
# test_ui's server, API client, browser and tab fixtures, over this module's own store
server, api, browser, tab = test_ui.server, test_ui.api, test_ui.browser, test_ui.tab

RUN = "logs"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, Any]:
    if importlib.util.find_spec("playwright") is None:
        _missing("playwright is not installed")
    if not CHROMIUM.exists():
        _missing(f"no Chromium at {CHROMIUM}")
    data = _data_dir(request.config)
    tmp = tmp_path_factory.mktemp("ui-topology")
    db = tmp / "topology.duckdb"
    _cli("ingest", str(data / "nccl-logs"), "--db", str(db), "--run", RUN, "--one-run")
    return {"db": db, "tmp": tmp, "data": data}


def _rows(api: httpx.Client, table: str, **params: Any) -> list[dict[str, Any]]:
    page = api.get(f"/runs/{RUN}/topology/{table}", params={"limit": 500, **params}).json()
    return [dict(zip(page["columns"], r, strict=True)) for r in page["rows"]]


def _texts(tab: Tab, table_id: str, rows: int) -> list[list[str]]:
    expect(tab.page.locator(f"#{table_id} tbody tr")).to_have_count(rows)
    return tab.page.evaluate(
        "(id) => Array.from(document.querySelectorAll('#' + id + ' tbody tr'))"
        ".map(tr => Array.from(tr.children).map(td => td.innerText.trim()))",
        table_id,
    )


def test_tables_equal_the_api(tab: Tab, api: httpx.Client) -> None:
    topo = _rows(api, "topology")
    comms = _rows(api, "comms")
    tuning = _rows(api, "tuning")
    assert len(topo) == 140 and len(comms) == 20 and len(tuning) == 10  # the shared excerpts, all 19 files
    tab.open(f"/runs/{RUN}/topology")
    tab.no_error_boxes()

    rings = [r for r in topo if r["kind"] == "ring"]
    shown = _texts(tab, "tp-rings", len(rings))
    assert [r[2] for r in shown] == [" → ".join(map(str, r["ranks"])) for r in rings]
    assert [r[0] for r in _texts(tab, "tp-comms", len(comms))] == [c["group_key"] for c in comms]
    assert [r[2] for r in _texts(tab, "tp-tuning", len(tuning))] == [t["algo"] for t in tuning]

    channels: dict[tuple[int, int], dict[str, set[int]]] = defaultdict(lambda: defaultdict(set))
    for r in topo:
        if r["kind"] == "connection":
            channels[(r["src_rank"], r["dst_rank"])][r["transport"]].add(r["channel"])
    senders = sorted({a for a, _ in channels})
    receivers = sorted({b for _, b in channels})
    grid = _texts(tab, "tp-connections", len(senders))
    head = tab.page.locator("#tp-connections thead th").all_inner_texts()
    assert head == ["from \\ to", *map(str, receivers)]
    for row in grid:
        a = int(row[0])
        for b, text in zip(receivers, row[1:], strict=True):
            want = "; ".join(
                f"{t} ({len(c)} channel{'s' if len(c) != 1 else ''})" for t, c in sorted(channels[(a, b)].items())
            )
            assert text == want, (a, b)
    assert grid[senders.index(9)][1 + receivers.index(11)] == "P2P/direct pointer (2 channels)"


def test_a_communicator_filters_the_page_and_stays_in_the_url(tab: Tab, api: httpx.Client) -> None:
    group = "nccl:n16#0.0"
    comms = _rows(api, "comms", group_key=group)
    assert len(comms) == 9
    tab.open(f"/runs/{RUN}/topology")
    tab.page.locator("#tp-group").click()
    tab.page.get_by_role("option", name=group, exact=False).first.click()
    tab.wait_for_query(group=group)
    tab.idle()
    assert {r[0] for r in _texts(tab, "tp-comms", len(comms))} == {group}
    tab.page.reload()
    tab.idle()
    _texts(tab, "tp-comms", len(comms))
    tab.no_error_boxes()


def test_the_page_is_a_handful_of_components(server: str) -> None:
    """Tables are one component each however many rows they have (the page had 1,002 with a component per
    cell); the count is what the dashboard's renderer pays for."""
    from dash.development.base_component import Component

    def count(node: Any) -> int:
        if isinstance(node, (list, tuple)):
            return sum(count(c) for c in node)
        return 1 + count(getattr(node, "children", None)) if isinstance(node, Component) else 0

    view, options = fetch(ApiClient(server), RUN, None, 0)
    assert count(view) <= 30
    assert options[0]["value"] == "" and len(options) > 1
