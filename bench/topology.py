"""Topology page benchmark: time from navigation to the settled page in a real headless Chromium against a
real `commlens serve` (uvicorn + Dash) over the shared NCCL logs (all excerpts in one run, `--one-run`),
median of N loads, beside an empty page (the not-found page: the dashboard's fixed cost) loaded in the same
run. Where the time goes: the page's Dash callback answers (server time as the browser saw it, and their
size), the components the topology view returns, and the rest (the browser building and drawing them).

    python bench/topology.py            # 5 loads each, writes the topology section of bench/README.md
    python bench/topology.py --loads 3 --no-write
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from results import write_section

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("COMMLENS_DATA", ROOT.parent / "shared" / "data"))
LOGS = DATA / "nccl-logs"
CHROMIUM = Path(os.environ.get("COMMLENS_CHROMIUM", "/usr/bin/chromium"))
RUN = "logs"
EMPTY = "/no/such/page"
SETTLED = (
    "() => window.dash_clientside !== undefined && document.querySelector('#page') !== null"
    " && document.querySelector('#page').children.length > 0"
    " && document.querySelectorAll('[data-dash-is-loading=\"true\"]').length === 0"
)
TOPOLOGY_SHOWN = (
    "() => { const tables = document.querySelectorAll('#tp-content .md-table');"
    " return tables.length > 0 && document.querySelectorAll('#tp-content .md-table table').length === tables.length; }"
)


def serve(db: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    out = log.open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "commlens.cli", "serve", "--db", str(db), "--port", "0"],
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", log.read_text())
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("commlens serve did not start:\n" + log.read_text()[-2000:])


def count_components(node: Any) -> int:
    """Dash components in a layout tree (what the browser's renderer builds one by one)."""
    from dash.development.base_component import Component

    if isinstance(node, (list, tuple)):
        return sum(count_components(c) for c in node)
    if isinstance(node, Component):
        return 1 + count_components(getattr(node, "children", None))
    return 0


def load(context: Any, url: str, path: str, drawn: str | None) -> dict[str, float]:
    """One load in a new tab of a browser that has seen the dashboard (its scripts cached, as for a user
    moving between pages): seconds to the settled page, and the Dash callbacks' server time (request sent
    -> response end, as the browser timed it) and bytes."""
    page = context.new_page()
    callbacks: list[Any] = []
    page.on("requestfinished", lambda r: callbacks.append(r) if "_dash-update-component" in r.url else None)
    t0 = time.perf_counter()
    page.goto(url + path)
    page.wait_for_load_state("networkidle")
    page.wait_for_function(SETTLED, timeout=120_000)
    if drawn:
        page.wait_for_function(drawn, timeout=120_000)
    page.wait_for_load_state("networkidle")
    total = time.perf_counter() - t0
    server = 0.0
    size = 0
    slowest = 0.0
    for r in callbacks:
        timing = r.timing
        took = (timing["responseEnd"] - timing["requestStart"]) / 1e3 if timing["responseEnd"] > 0 else 0.0
        server += took
        slowest = max(slowest, took)
        size += r.sizes()["responseBodySize"]
    page.close()
    return {
        "total": total,
        "callbacks": len(callbacks),
        "server": server,
        "slowest": slowest,
        "bytes": size,
    }


NAVIGATE = "(path) => { window.history.pushState({}, '', path); window.dispatchEvent(new CustomEvent('_dashprivate_pushstate')); }"
NOT_FOUND_SHOWN = "() => (document.querySelector('#page') || {innerText: ''}).innerText.includes('There is no page at')"


def navigate(context: Any, url: str, path: str, drawn: str) -> float:
    """Seconds from an in-app move (what a dcc.Link does: pushState and Dash's event) from the run's overview,
    plotly.js already loaded there, to the settled page: what a user switching pages waits."""
    page = context.new_page()
    page.goto(url + f"/runs/{RUN}")
    page.wait_for_load_state("networkidle")
    page.wait_for_function(SETTLED + " && window.Plotly !== undefined", timeout=120_000)
    page.wait_for_load_state("networkidle")
    t0 = time.perf_counter()
    page.evaluate(NAVIGATE, path)
    page.wait_for_function(drawn, timeout=120_000)
    page.wait_for_function(SETTLED, timeout=120_000)
    took = time.perf_counter() - t0
    page.close()
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loads", type=int, default=5)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    from commlens.frontend.client import ApiClient
    from commlens.frontend.page_topology import fetch

    tmp = Path(tempfile.mkdtemp(prefix="bench-topology-"))
    db = tmp / "topology.duckdb"
    done = subprocess.run(
        [sys.executable, "-m", "commlens.cli", "ingest", str(LOGS), "--db", str(db), "--run", RUN, "--one-run"],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    m = re.search(r"(\d+) files: (\d+) ingested.*?(\d+) failed", done.stdout)
    if not m or m.group(2) == "0":
        raise SystemExit("ingest of the NCCL logs failed:\n" + done.stdout[-2000:] + done.stderr[-2000:])
    ingested = f"{m.group(2)} of {m.group(1)} files ingested" + (f", {m.group(3)} failed" if m.group(3) != "0" else "")
    proc, url = serve(db, tmp / "serve.log")
    try:
        client = ApiClient(url)
        views = []
        for _ in range(args.loads):
            t0 = time.perf_counter()
            view, _ = fetch(client, RUN, None, 0)
            views.append(time.perf_counter() - t0)
        components = count_components(view)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-gpu"])
            context = browser.new_context(viewport={"width": 1366, "height": 768})
            load(context, url, f"/runs/{RUN}/topology", TOPOLOGY_SHOWN)  # warm-up: scripts cached
            load(context, url, EMPTY, None)
            topo, empty, nav_topo, nav_empty = [], [], [], []
            for _ in range(args.loads):  # interleaved, so both see the same machine load
                empty.append(load(context, url, EMPTY, None))
                topo.append(load(context, url, f"/runs/{RUN}/topology", TOPOLOGY_SHOWN))
                nav_empty.append(navigate(context, url, EMPTY, NOT_FOUND_SHOWN))
                nav_topo.append(navigate(context, url, f"/runs/{RUN}/topology", TOPOLOGY_SHOWN))
            browser.close()
    finally:
        proc.terminate()
        proc.wait(20)

    def med(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    t_med, e_med = med(topo, "total"), med(empty, "total")
    load_avg = os.getloadavg()[0]
    lines = [
        f"Topology page (`python bench/topology.py --loads {args.loads}`), {dt.date.today().isoformat()}, "
        f"{platform.machine()}, {os.cpu_count()} cores, load {load_avg:.1f} at the end; the {RUN!r} run is "
        f"every excerpt of `nccl-logs/` in one run ({ingested}). Median of {args.loads} loads (a new tab each, "
        "scripts cached), "
        "navigation to the settled page (no callback in flight, every table of the page drawn):",
        "",
        "| page | median (s) | loads (s) | Dash callbacks | server time of callbacks (s) | callback bytes |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for name, rows in ((f"topology ({RUN})", topo), ("empty (not-found page)", empty)):
        each = ", ".join(f"{r['total']:.2f}" for r in rows)
        lines.append(
            f"| {name} | {med(rows, 'total'):.2f} | {each} "
            f"| {med(rows, 'callbacks'):.0f} | {med(rows, 'server'):.2f} | {med(rows, 'bytes'):,.0f} |"
        )
    n_t, n_e = statistics.median(nav_topo), statistics.median(nav_empty)
    lines += [
        "",
        "Moving to the page inside the dashboard (from the run's overview, plotly.js loaded there, as a tab link does):",
        "",
        "| page | median (s) | moves (s) |",
        "|---|---:|---|",
        f"| topology ({RUN}) | {n_t:.2f} | {', '.join(f'{x:.2f}' for x in nav_topo)} |",
        f"| empty (not-found page) | {n_e:.2f} | {', '.join(f'{x:.2f}' for x in nav_empty)} |",
        "",
        f"Topology over the empty page: **{t_med / e_med:.2f}x** ({t_med - e_med:+.2f} s) as a new tab, "
        f"**{n_t / n_e:.2f}x** ({n_t - n_e:+.2f} s) moving inside the dashboard. The topology view builds "
        f"{components} Dash components; fetching and building it in-process (four API calls side by side) takes "
        f"{statistics.median(views) * 1e3:.0f} ms (median of {args.loads}).",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("topology", text)


if __name__ == "__main__":
    main()
