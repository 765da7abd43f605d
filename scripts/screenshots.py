#!/usr/bin/env python3
"""Screenshots of the dashboard's main pages from the demo store (`make demo` builds commlens.duckdb
with the runs ddp, zero3, tp, pp, resnet50-ddp, dlrm and nccl-logs): starts `commlens serve` on it, opens each page in
Chromium at 1366x768 and writes docs/screenshots/<page>.png.

    python scripts/screenshots.py [--db commlens.duckdb] [--out docs/screenshots]

Before serving, zero3's top finding is promoted to a review item so the review page has one (the
runs' schemes were attributed when `make demo` ingested them).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]
# (file name, path, run the page needs or None, what to wait for)
PAGES = [
    ("runs", "/", None, "#runs"),
    ("overview", "/runs/zero3", "zero3", "#ov-volumes .js-plotly-plot"),
    ("histograms", "/runs/tp/histograms?weight=bytes", "tp", ".js-plotly-plot"),
    ("predicted", "/runs/pp/predicted?scheme=pp", "pp", "#pv-volumes .js-plotly-plot"),
    ("ranks", "/runs/dlrm/ranks?basis=total", "dlrm", "#rk-heatmap .js-plotly-plot"),
    ("topology", "/runs/nccl-logs/topology", "nccl-logs", "#tp-connections .js-plotly-plot"),
    ("time", "/runs/dlrm/time", "dlrm", "#tm-timeline-graph .js-plotly-plot"),
    ("review", "/runs/zero3/review", "zero3", "#rv-content h2"),
    ("compare", "/compare?runs=ddp,zero3,tp,pp&weight=bytes", "ddp", "#cmp-volumes .js-plotly-plot"),
]


def run_names(db: Path) -> list[str]:
    from commlens import store

    con = store.connect(db)
    try:
        return [r[0] for r in con.execute("SELECT name FROM runs ORDER BY name").fetchall()]
    finally:
        con.close()


def review_example(url: str) -> None:
    """The review page shows an item: zero3's top finding promoted (once; later runs find it promoted)."""
    from commlens.frontend.client import ApiClient, ApiProblem

    client = ApiClient(url)
    try:
        top = client.findings("zero3", limit=1).items
        if top:
            client.promote_finding("zero3", top[0].id)
    except ApiProblem as exc:
        if exc.status not in (404, 409):
            raise


def serve(db: Path, log: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "commlens.cli", "serve", "--db", str(db), "--port", "0"],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while True:
        m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", log.read_text())
        if m:
            return proc, m.group(1)
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"commlens serve did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--db", type=Path, default=ROOT / "commlens.duckdb")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    p.add_argument("--chromium", default="/usr/bin/chromium")
    args = p.parse_args()
    if not args.db.exists():
        raise SystemExit(f"no store at {args.db}: run `make demo` first")
    runs = set(run_names(args.db))
    args.out.mkdir(parents=True, exist_ok=True)
    proc, url = serve(args.db, args.out.parent / ".screenshots-serve.log")
    from playwright.sync_api import sync_playwright

    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            assert c.get("/api/health").json()["status"] == "ok"
        if "zero3" in runs:
            review_example(url)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1366, "height": 768})
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            for name, path, needs, ready in PAGES:
                if needs is not None and needs not in runs:
                    print(f"skip {name}: the store has no run {needs!r}")
                    continue
                page.goto(url + path)
                page.wait_for_selector(ready, timeout=60_000)
                page.wait_for_load_state("networkidle")
                page.wait_for_function(
                    "() => document.querySelectorAll('[data-dash-is-loading=\"true\"]').length === 0"
                )
                time.sleep(0.5)  # plotly's transitions
                target = args.out / f"{name}.png"
                page.screenshot(path=str(target))
                print(f"{target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}: {path}")
            browser.close()
        if errors:
            raise SystemExit("browser errors: " + "; ".join(errors))
    finally:
        proc.terminate()
        proc.wait(20)
        (args.out.parent / ".screenshots-serve.log").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
