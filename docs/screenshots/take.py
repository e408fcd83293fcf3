"""Screenshots of each tab on the embedded pair, for the README: `python docs/screenshots/take.py`.

Serves app.py on a private port with a throw-away session store, drives it with Debian's chromium
(Playwright), and writes palette PNGs (each well under 400 KB) next to this file."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from PIL import Image
from playwright.sync_api import sync_playwright

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PORT = 7897
PROMPT = "Explain how a hash map works in two sentences."
MAX_NEW = "64"


def serve(db: Path) -> subprocess.Popen:
    # the draft's step eager: the app's default compiles it in the background for about a minute, and runs beside
    # that compile stall for up to a second (docs/app.md), which the timed screenshots would show
    proc = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--port", str(PORT), "--db", str(db),
                             "--target", "embedded", "--draft", "self-skip:3,4,5,25", "--draft-forward", "lean"],
                            cwd=ROOT)
    for _ in range(120):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{PORT}/", timeout=2)
            return proc
        except OSError:
            time.sleep(1)
    proc.kill()
    raise SystemExit("the app did not start")


def save(page, name: str) -> None:
    """A full-page screenshot, reduced to a 256-colour palette (flat UI colours survive it)."""
    path = HERE / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    Image.open(path).convert("RGB").quantize(256, dither=Image.Dither.NONE).save(path, optimize=True)
    print(f"{path.name}: {path.stat().st_size // 1024} KB")


def set_number(page, elem_id: str, value: str) -> None:
    box = page.locator(f"#{elem_id} input[type=number]")
    box.fill(value)
    box.press("Enter")


def settle(page, selector: str, quiet: float = 6.0, limit: float = 600.0) -> None:
    """Wait until the element's text has not changed for `quiet` seconds (the stream is over)."""
    last, since, start = None, time.time(), time.time()
    while time.time() - start < limit:
        text = page.locator(selector).inner_text()
        if text != last:
            last, since = text, time.time()
        elif text and time.time() - since > quiet:
            return
        time.sleep(0.5)


def generate(page, method: str) -> None:
    """One generation of PROMPT on a fresh page (no earlier turn in its context; the browser id stays)."""
    page.goto(f"http://127.0.0.1:{PORT}/", wait_until="load")
    page.wait_for_selector("#prompt textarea", timeout=120_000)
    set_number(page, "max-new", MAX_NEW)
    page.locator("#live-method input").click()
    page.get_by_role("option", name=method, exact=True).click()
    page.locator("#prompt textarea").fill(PROMPT)
    page.locator("#generate").click()
    page.wait_for_function(f"document.querySelector('#timeline-plot')?.innerText.includes('{method} ·')",
                           timeout=600_000)
    settle(page, "#metric-panel")


def pick_interesting_step(page, root: str) -> None:
    """A step a branch rescued, else one with a rollback: the tree has something to show."""
    for kind in ("rescued", "rollback"):
        marks = page.locator(f"{root} .step-mark.mark-{kind}")
        if marks.count():
            marks.nth(marks.count() // 2).click()
            time.sleep(3)
            return


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        proc = serve(Path(tmp) / "sessions.db")
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=shutil.which("chromium"),
                                             args=["--no-sandbox", "--disable-gpu"])
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                generate(page, "ar")  # a stored AR run of this prompt: the glance then shows a speedup
                generate(page, "specbranch")
                pick_interesting_step(page, "#step-strip")
                save(page, "live")

                page.get_by_role("tab", name="Compare").click()
                page.locator("#compare-prompt textarea").fill(PROMPT)
                page.locator("#compare").click()
                page.wait_for_selector("#compare-race .race-wrap", timeout=600_000)
                page.wait_for_function("document.querySelector('#compare-race .race-col[data-done=\"true\"]')",
                                       timeout=120_000)
                save(page, "compare_race")  # mid-race: the fastest column is done, the others still stream
                page.wait_for_selector("#compare-table .identical", timeout=120_000)
                page.wait_for_selector("#compare-timeline .js-plotly-plot", timeout=60_000)
                time.sleep(2)
                save(page, "compare")

                page.get_by_role("tab", name="Replay").click()
                page.locator("#replay-find").click()
                page.wait_for_function("document.querySelector('#replay-status').innerText.includes('session')")
                page.locator("#replay-open").click()
                page.wait_for_selector("#replay-tree-view svg.branch-tree", timeout=60_000)
                page.locator("#replay-run input").click()
                page.get_by_role("option", name="specbranch", exact=False).first.click()
                time.sleep(3)
                pick_interesting_step(page, "#replay-step-strip")
                page.get_by_text("Compare and race stored runs").click()
                page.locator("#replay-race-btn").click()
                page.wait_for_selector("#replay-compare-table .identical", timeout=300_000)
                time.sleep(2)
                save(page, "replay")

                page.get_by_role("tab", name="How to read this").click()
                time.sleep(1)
                save(page, "how_to_read")
                browser.close()
        finally:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
