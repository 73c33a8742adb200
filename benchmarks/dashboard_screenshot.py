"""The README's dashboard picture: `python -m llumdask.benchmarks.dashboard_screenshot [--out docs/dashboard.png]`.

Three sim instances, six long streams and one operator-forced live migration, then headless
Chromium (the system's, as the browser test uses it) photographs the llumdask page while the
streams still run, so every plot has data.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path
from typing import Sequence

from llumdask.api.client import connect
from llumdask.clusters.local import local_cluster

# What Chromium needs on a closed network, as root, without a display.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 30000 + 1 for i in range(length)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llumdask.benchmarks.dashboard_screenshot", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/dashboard.png"))
    args = parser.parse_args(argv)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        parser.error("no Chromium on PATH (make test installs Debian's chromium when it runs as root)")
    from playwright.sync_api import sync_playwright

    with local_cluster(3, config_overrides={"sim-engine": {"total-blocks": 320}}) as cluster, connect(cluster) as llum:
        streams = [llum.stream(prompt(k, 100 + 40 * k), max_tokens=1500 + 200 * k) for k in range(6)]
        for stream in streams:
            next(stream)
        time.sleep(3)
        moved = streams[0]
        llum.migrate(moved.request_id, to=next(r["instance"] for r in llum.instances() if r["instance"] != moved.instance))
        time.sleep(8)  # some history for the time series
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                page.goto(cluster.dashboard_link.rsplit("/", 1)[0] + "/llumdask")
                page.get_by_text("The last minutes").wait_for(timeout=30_000)
                time.sleep(3)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(args.out), full_page=True)
            finally:
                browser.close()
        for stream in streams:
            list(stream)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
