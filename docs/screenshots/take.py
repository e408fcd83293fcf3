"""Screenshots of each tab on the embedded pair, for the README: `python docs/screenshots/take.py` (all of them),
`python docs/screenshots/take.py scenarios` (the Live tab's three scenarios only) or
`python docs/screenshots/take.py how_to_read` (that tab only: it runs nothing).

Serves app.py on a private port with a throw-away session store, drives it with Debian's chromium
(Playwright), and writes palette PNGs (each well under 400 KB) next to this file.

The scenarios: one 1280x720 page each, as a projector shows it: the first screen, with the tree of a forking step
(a rescue where there is one) under the glance line. Each scenario's draft first makes a short warm-up run, so that it
is loaded and its compiled step has landed (the app compiles it in the background), then answers PROMPT. "Fastest"
is a first chat: its glance line compares with the target's one-token step; the other two run `ar` on the prompt
first, so theirs is the measured comparison with AR."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from PIL import Image
from playwright.sync_api import sync_playwright

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))  # engine.presets: the scenarios
PORT = 7897
PROMPT = "Explain how a hash map works in two sentences."
MAX_NEW = "64"
SCENARIO_PROMPT = "Why is the sky blue?"
SCENARIO_MAX_NEW = "128"
LOG: list[str] = []  # the app's output: says when a draft's compiled step has landed


def serve(db: Path, *options: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "app.py"), "--port", str(PORT), "--db", str(db), *options],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )

    def read():
        for line in proc.stdout:
            LOG.append(line)
            sys.stdout.write("[app] " + line)

    threading.Thread(target=read, daemon=True).start()
    for _ in range(120):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{PORT}/", timeout=2)
            return proc
        except OSError:
            time.sleep(1)
    proc.kill()
    raise SystemExit("the app did not start")


def wait_for_compile(draft: str, limit: float = 600) -> None:
    """Until the app says the draft's step compiled (or that it stays eager)."""
    end = time.time() + limit
    while time.time() < end:
        if any(f"'{draft}'" in line and ("compiled" in line or "eager" in line) for line in LOG):
            return
        time.sleep(1)


def save(page, name: str, full_page: bool = True) -> None:
    """A screenshot (the full page, or what the window shows), reduced to a 256-colour palette (flat UI colours
    survive it)."""
    path = HERE / f"{name}.png"
    page.screenshot(path=str(path), full_page=full_page)
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


def generate(page, method: str, prompt: str = PROMPT, max_new: str = MAX_NEW, scenario: str | None = None) -> None:
    """One generation of a prompt on a fresh page (no earlier turn in its context; the browser id stays), in a
    scenario where one is named."""
    page.goto(f"http://127.0.0.1:{PORT}/", wait_until="load")
    page.wait_for_selector("#prompt textarea", timeout=120_000)
    if scenario is not None:
        page.locator(f'#scenario input[value="{scenario}"]').check()
        page.wait_for_function("document.querySelector('#scenario-note')?.innerText.length > 0")
        time.sleep(1)  # the draft menu and the settings follow
    set_number(page, "max-new", max_new)
    page.locator("#live-method input").click()
    page.get_by_role("option", name=method, exact=True).click()
    page.locator("#prompt textarea").fill(prompt)
    page.locator("#generate").click()
    page.wait_for_function(
        f"document.querySelector('#timeline-plot')?.innerText.includes('{method} ·')", timeout=600_000
    )
    settle(page, "#metric-panel")


def click_middle_mark(page, selectors: list[str]) -> None:
    """Click the middle step marker of the first selector that finds any, and let the tree redraw."""
    for selector in selectors:
        marks = page.locator(selector)
        if marks.count():
            marks.nth(marks.count() // 2).click()
            time.sleep(3)
            return


def pick_interesting_step(page, root: str) -> None:
    """A step a branch rescued, else one with a rollback: the tree has something to show."""
    click_middle_mark(page, [f"{root} .step-mark.mark-{kind}" for kind in ("rescued", "rollback")])


def pick_forking_step(page) -> None:
    """A step a branch rescued, else one whose fork the first branch won, else one with a rollback."""
    click_middle_mark(
        page, [f"#step-strip .step-mark{kind}" for kind in (".mark-rescued", "[data-fork]", ".mark-rollback")]
    )


def scenarios(browser) -> None:
    """One 1280x720 screenshot per scenario, as projected: the page's first screen (the prompt, the glance line and
    the step's tree beside the settings)."""
    from engine.presets import SCENARIOS

    page = browser.new_page(viewport={"width": 1280, "height": 720})
    for key, s in SCENARIOS.items():
        generate(page, "specbranch", SCENARIO_PROMPT, "16", scenario=key)  # loads the draft; its compile starts
        wait_for_compile(s.draft)
        if key != "fastest":  # a stored AR run of the prompt: the glance then shows the measured comparison
            generate(page, "ar", SCENARIO_PROMPT, SCENARIO_MAX_NEW, scenario=key)
        generate(page, "specbranch", SCENARIO_PROMPT, SCENARIO_MAX_NEW, scenario=key)
        pick_forking_step(page)  # (its marker is under the timeline: the click scrolls there)
        page.evaluate("window.scrollTo(0, 0)")  # the first screen, as the page opens
        time.sleep(1)
        save(page, f"scenario_{key}", full_page=False)
    page.close()


def how_to_read(page) -> None:
    page.get_by_role("tab", name="How to read this").click()
    page.wait_for_selector("#regime-map .js-plotly-plot", timeout=60_000)
    time.sleep(1)
    save(page, "how_to_read")


def main() -> None:
    only_scenarios = sys.argv[1:] == ["scenarios"]
    only_how_to_read = sys.argv[1:] == ["how_to_read"]
    with tempfile.TemporaryDirectory() as tmp:
        # the scenarios: the app as `make run` serves it; the tabs: the layer-skipping draft, its step eager (a
        # compile in the background would stall the timed runs)
        proc = (
            serve(Path(tmp) / "sessions.db")
            if only_scenarios
            else serve(Path(tmp) / "sessions.db", "--draft", "self-skip:3,4,5,25", "--draft-forward", "lean")
        )
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(
                    executable_path=shutil.which("chromium"), args=["--no-sandbox", "--disable-gpu"]
                )
                if only_scenarios:
                    scenarios(browser)
                    browser.close()
                    return
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                if only_how_to_read:
                    page.goto(f"http://127.0.0.1:{PORT}/")
                    how_to_read(page)
                    browser.close()
                    return
                generate(page, "ar")  # a stored AR run of this prompt: the glance then shows a speedup
                generate(page, "specbranch")
                pick_interesting_step(page, "#step-strip")
                save(page, "live")

                page.get_by_role("tab", name="Compare").click()
                page.locator("#compare-prompt textarea").fill(PROMPT)
                page.locator("#compare").click()
                page.wait_for_selector("#compare-race .race-wrap", timeout=600_000)
                page.wait_for_function(
                    "document.querySelector('#compare-race .race-col[data-done=\"true\"]')", timeout=120_000
                )
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

                how_to_read(page)
                browser.close()
        finally:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
