"""Screenshot of the live dashboard (docs/img/dashboard.png) while something runs against a server.

    .venv/bin/python scripts/dashboard_screenshot.py http://127.0.0.1:8080 docs/img/dashboard.png --wait-sessions 2

Waits until the page shows at least ``--wait-sessions`` live sessions (or ``--timeout`` seconds), then
lets the charts fill for ``--settle`` seconds and saves a full-page PNG. Uses Debian's chromium.
"""

from __future__ import annotations

import argparse
import shutil
import time

from playwright.sync_api import sync_playwright

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("url")
    p.add_argument("out")
    p.add_argument("--key", default=None, help="API key, when the server has one")
    p.add_argument("--wait-sessions", type=int, default=2)
    p.add_argument("--settle", type=float, default=6.0)
    p.add_argument("--timeout", type=float, default=300.0)
    a = p.parse_args()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=shutil.which("chromium") or "/usr/bin/chromium", args=ARGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1000})
        if a.key:
            page.add_init_script(f"sessionStorage.setItem('opencoti.key', {a.key!r});")
        page.goto(a.url.rstrip("/") + "/dashboard")
        t0 = time.time()
        while time.time() - t0 < a.timeout:
            if page.locator("[data-session]").count() >= a.wait_sessions:
                break
            time.sleep(0.5)
        time.sleep(a.settle)
        page.screenshot(path=a.out, full_page=True)
        print(f"saved {a.out}: {page.locator('[data-pool]').count()} pools, "
              f"{page.locator('[data-session]').count()} sessions on the page")
        browser.close()


if __name__ == "__main__":
    main()
