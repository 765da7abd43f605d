"""Routes and page state in the URL: every view is `path?query`, so a copied link reproduces it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import parse_qsl, quote, unquote, urlencode

from commlens.contract.review import Anchor

RUN_PAGES: dict[str, str] = {
    "overview": "Overview",
    "histograms": "Histograms",
    "predicted": "Predicted vs measured",
    "ranks": "Ranks",
    "topology": "Topology",
    "time": "Time",
    "review": "Review",
}
# Views named by findings and anchors that live on another page (bandwidth is part of the ranks page).
VIEW_PAGE = {"bandwidth": "ranks"}


@dataclass(frozen=True)
class Route:
    page: str  # "runs", "compare", one of RUN_PAGES, or "missing"
    run: str | None = None


def route(pathname: str | None) -> Route:
    parts = [unquote(p) for p in (pathname or "/").strip("/").split("/") if p]
    if not parts:
        return Route("runs")
    if parts == ["compare"]:
        return Route("compare")
    if parts[0] == "runs" and len(parts) == 2:
        return Route("overview", parts[1])
    if parts[0] == "runs" and len(parts) == 3 and parts[2] in RUN_PAGES and parts[2] != "overview":
        return Route(parts[2], parts[1])
    return Route("missing")


def parse(search: str | None) -> dict[str, str]:
    """The query string as a dict (last value wins; blank values dropped)."""
    return dict(parse_qsl((search or "").lstrip("?"), keep_blank_values=False))


def query(state: dict[str, object]) -> str:
    """'?a=1&b=x' of the non-empty values in the given order; '' when nothing is set."""
    pairs = [(k, _text(v)) for k, v in state.items() if v is not None and v != "" and v is not False]
    return "?" + urlencode(pairs) if pairs else ""


def _text(v: object) -> str:
    if v is True:
        return "1"
    return str(v)


def run_path(run: str, page: str = "overview") -> str:
    base = f"/runs/{quote(run, safe='')}"
    return base if page == "overview" else f"{base}/{page}"


def view_link(run: str, view: Mapping[str, object]) -> str:
    """The page a finding's `view` points at, its filters in the query."""
    page = str(view.get("page") or "overview")
    page = VIEW_PAGE.get(page, page)
    if page not in RUN_PAGES:
        page = "overview"
    params = {k: v for k, v in view.items() if k != "page"}
    if view.get("page") == "bandwidth":
        params["section"] = "bandwidth"
    return run_path(run, page) + query(params)


def anchor_link(run: str, anchor: Anchor | None) -> str:
    """The exact view a review item is anchored to: the saved query when there is one, else its fields."""
    if anchor is None:
        return run_path(run)
    page = VIEW_PAGE.get(anchor.view or "", anchor.view or "overview")
    if page not in RUN_PAGES:
        page = "overview"
    free = anchor.free or ""
    if free.startswith("?"):
        return run_path(run, page) + free
    params: dict[str, object] = {"scheme": anchor.scheme, "op": anchor.op, "rank": anchor.rank}
    if anchor.bin:
        params["bin"] = anchor.bin
    for part in free.split(";"):
        key, sep, value = part.strip().partition("=")
        if sep and key and value and value != "None":
            params.setdefault(key, value)
    return run_path(run, page) + query(params)


def int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value not in (None, "") else None
    except ValueError:
        return None


def count_or_none(value: str | None) -> int | None:
    """A rank or an offset from the address: a whole number >= 0, else None (as if not given)."""
    n = int_or_none(value)
    return n if n is not None and n >= 0 else None


def one_of(value: str | None, allowed: Sequence[str]) -> str | None:
    """A value from the address that must be one of `allowed` (an op, a scheme), else None."""
    return value if value in allowed else None
