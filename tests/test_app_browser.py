"""End to end in a real browser: headless Chromium (Debian's package) driven by Playwright, on tiny models.
It asserts what a person sees: streamed tokens, the branch tree of a chosen step (its node count and the
survivor's highlight), the step navigator moving tree and timeline together, the race streaming in both
columns before the end with the identity check, and Replay re-rendering and racing stored runs.
Saves screenshots to artifacts/. Fails (never skips) when the browser is missing, in CI or not: `make test` installs
it (as root). Each test asks for the runs it reads (the live_run and raced fixtures: whichever test comes first makes
them) and opens its own tab, so none depends on the order the tests run in."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from app.main import css_paths
from app.tree import build_tree, step_events
from engine.events import BranchResolved, StepStarted

from .conftest import serve_app

pytestmark = pytest.mark.slow  # a browser: `make test` runs it, `make test-fast` leaves it out
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
PROMPT = "a b c d"
# Every state of a race the page shows, recorded by a MutationObserver as the page repaints (not by polling, which
# a busy machine slows down): per state, whether the race is done and per column its label, "n/N tokens", how much
# text it shows and its speed. window.raceStates collects them, the observer runs until the page is left.
RACE_JS = """(root) => { window.raceStates = []; const seen = () => {
  const w = document.querySelector(root + ' .race-wrap'); if (!w) return;
  const state = {done: w.dataset.done === 'true', cols: [...w.querySelectorAll('.race-col')].map(c => ({
    label: c.dataset.label, count: c.querySelector('.race-count').innerText,
    text: c.querySelector('.race-text').innerText.length, speed: c.querySelector('.race-speed').innerText}))};
  const last = window.raceStates[window.raceStates.length - 1];
  if (!last || JSON.stringify(last) !== JSON.stringify(state)) window.raceStates.push(state); };
  new MutationObserver(seen).observe(document.body, {subtree: true, childList: true, characterData: true,
                                                      attributes: true}); }"""


@pytest.fixture(scope="module")
def app_url(tiny_engine, app_store):
    demo, url = serve_app(tiny_engine, app_store, css_paths=css_paths())
    yield url
    demo.close()


@pytest.fixture(scope="module")
def page(app_url):
    """One page for the module: its browser id owns the runs it makes, so Replay finds them."""
    if CHROMIUM is None:
        pytest.fail("chromium is not installed: `make test` installs it when run as root (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        page = browser.new_page(viewport={"width": 1400, "height": 2200})
        page.goto(app_url, wait_until="load")
        page.wait_for_selector("#prompt textarea", timeout=60_000)
        page.locator("#advanced").get_by_text("Advanced").first.click()  # the settings past the basic ones
        page.locator("#chat-template input[type=checkbox]").uncheck()  # tiny models: raw text
        yield page
        browser.close()


@pytest.fixture(scope="module")
def live_run(page, app_store) -> str:
    """A Live run of PROMPT, finished and drawn (tokens, metrics, timeline, tree): the run the Live view and the step
    navigator read. Returns its session id."""
    page.get_by_role("tab", name="Live").click()
    page.locator("#prompt textarea").fill(PROMPT)
    page.locator("#generate").click()
    page.wait_for_selector("#token-view .tok", timeout=60_000)  # streamed tokens arrived
    page.wait_for_selector("#metric-panel table.metric-panel", timeout=60_000)
    page.wait_for_selector("#timeline-plot .js-plotly-plot", timeout=60_000)
    page.wait_for_selector("#tree-view svg.branch-tree", timeout=60_000)
    page.wait_for_function("document.querySelector('#metric-panel').innerText.includes('tokens per s')")
    sessions = app_store.list_sessions(search=PROMPT)
    assert len(sessions) == 1, sessions
    return sessions[0]["id"]


@pytest.fixture(scope="module")
def raced(page) -> list[dict]:
    """A Compare race of ar and specbranch on the Compare tab's own prompt ("Explain how a hash map works."), sampled
    while it streams, to its end: stored, so Replay finds it. Returns the samples."""
    page.get_by_role("tab", name="Compare").click()
    methods = page.locator("#compare-methods")
    for name in ("sd", "pearl"):
        methods.get_by_label(name).uncheck()
    methods.get_by_label("specbranch").check()
    samples = watch_race(page, "#compare-race", page.locator("#compare").click)
    page.wait_for_selector("#compare-table .identical", timeout=60_000)
    return samples


def shown_step(page, root: str) -> int | None:
    step = page.locator(f"{root} .tree-view").get_attribute("data-step")
    return int(step) if step else None


def wait_for_step(page, root: str, step: int) -> None:
    page.wait_for_function(f"document.querySelector('{root} .tree-view')?.dataset.step === '{step}'", timeout=30_000)


def watch_race(page, root: str, start) -> list[dict]:
    """Every state the race in `root` showed, from start() (which starts it) until it was over."""
    page.evaluate(RACE_JS, root)
    start()
    page.wait_for_function(
        "window.raceStates.length > 0 && window.raceStates[window.raceStates.length - 1].done", timeout=120_000
    )
    return page.evaluate("window.raceStates")


def assert_both_columns_streamed(samples: list[dict], labels: list[str]) -> None:
    """Every column was shown part-way (some tokens shown, not all, before the race ended), and at least one was
    shown twice, growing. Not every column twice: on tiny models AR finishes in the first fifth of the race, and
    on a loaded machine the page may repaint only once in that time (seen in a full suite run)."""
    assert samples and samples[-1]["done"], "the race never finished"
    assert [c["label"] for c in samples[-1]["cols"]] == labels
    grew = []
    for i, label in enumerate(labels):
        partial = []
        for s in samples:
            shown, total = map(int, re.match(r"(\d+)/(\d+)", s["cols"][i]["count"]).groups())
            if not s["done"] and 0 < shown < total:
                partial.append((shown, s["cols"][i]["text"]))
        assert partial, (label, "never shown part-way: not streamed")
        grew.append(len(set(partial)) >= 2 and partial[-1][1] > partial[0][1])
        final = samples[-1]["cols"][i]
        shown, total = map(int, re.match(r"(\d+)/(\d+)", final["count"]).groups())
        assert shown == total > 0 and "tokens/s" in final["speed"]
    assert any(grew), "no column grew while the race was on"


def test_live_view_in_chromium(page, live_run):
    page.get_by_role("tab", name="Live").click()
    assert page.locator("#token-view .tok").count() > 3
    assert page.locator("#notices .notice-error").count() == 0, page.locator("#notices").inner_text()
    assert "acceptance rate" in page.locator("#metric-panel").inner_text()
    assert "tokens per target forward" in page.locator("#glance").inner_text()
    assert page.locator("#timeline-plot .bars .point, #timeline-plot path.bar, #timeline-plot .trace.bars").count() > 0
    # rolled-back text hides behind per-step markers: closed until clicked or "show all rollbacks"
    markers = page.locator("#token-view details.rb")
    assert markers.count() > 0 and page.locator("#token-view details.rb[open]").count() == 0
    assert not markers.first.locator(".tok-rollback").is_visible()
    markers.first.locator("summary").click()
    assert markers.first.locator(".tok-rollback").is_visible()
    show_all = page.locator("#show-rollbacks").get_by_label("Show all rollbacks (else click a ↶ marker)")
    show_all.check()  # (the Live tab's: Replay has one of the same name)
    page.wait_for_function("document.querySelectorAll('#token-view details.rb:not([open])').length === 0")
    show_all.uncheck()
    page.screenshot(path=str(ARTIFACTS / "app_live.png"), full_page=True)
    assert (ARTIFACTS / "app_live.png").stat().st_size > 10_000


def test_a_projectors_first_screen_holds_the_prompt_the_glance_line_and_the_tree(page, live_run):
    """At 1280x720, the page as it opens (scrolled to the top): the prompt, its Generate button, the glance line and
    the step's tree all start on the first screen, beside the settings (app/tabs/live.py)."""
    page.get_by_role("tab", name="Live").click()
    page.set_viewport_size({"width": 1280, "height": 720})
    try:
        page.evaluate("window.scrollTo(0, 0)")
        page.wait_for_selector("#tree-view svg.branch-tree", timeout=30_000)
        boxes = {
            name: page.locator(selector).first.bounding_box()
            for name, selector in {
                "prompt": "#prompt textarea",
                "generate": "#generate",
                "glance": "#glance .glance",
                "tree": "#tree-view svg.branch-tree",
                "method": "#live-method",
            }.items()
        }
        page.screenshot(path=str(ARTIFACTS / "app_live_1280x720.png"))
        assert all(box is not None for box in boxes.values()), boxes
        assert boxes["prompt"]["y"] + boxes["prompt"]["height"] <= 720, boxes
        assert boxes["generate"]["y"] + boxes["generate"]["height"] <= 720, boxes
        assert boxes["glance"]["y"] + boxes["glance"]["height"] <= 720, boxes
        assert boxes["tree"]["y"] + min(boxes["tree"]["height"], 120) <= 720, boxes  # the tree's first 120 px
        assert boxes["method"]["x"] + boxes["method"]["width"] <= boxes["tree"]["x"], boxes  # settings beside it
    finally:
        page.set_viewport_size({"width": 1400, "height": 2200})


def test_tree_and_step_navigator_in_chromium(page, app_store, live_run):
    page.get_by_role("tab", name="Live").click()
    events = app_store.load_run_events(app_store.get_session(live_run)["runs"][0]["id"])
    steps = sorted({e.step for e in events if isinstance(e, BranchResolved)}) or [2]
    step = next((s for s in steps if s > 1), steps[0])  # a step with a fork, where there is one
    page.wait_for_selector("#step-strip .step-mark", timeout=30_000)
    page.locator(f'#step-strip .step-mark[data-step="{step}"]').click()  # a marker under the timeline
    wait_for_step(page, "#tree-view", step)
    tree = build_tree(step_events(events, step))
    nodes = list(tree.walk())
    assert page.locator("#tree-view svg g.node").count() == len(nodes)
    assert page.locator("#tree-view svg g.node.survivor").count() == sum(n.survivor for n in nodes)
    assert page.locator("#tree-view svg path.edge.survivor").count() == sum(n.survivor for n in nodes) - 1
    fork = next((e for e in events if isinstance(e, BranchResolved) and e.step == step), None)
    if fork is not None and fork.survivor >= 0:  # the winning candidate carries the survivor's highlight
        winner = page.locator("#tree-view svg g.node.survivor", has_text=fork.pieces[fork.survivor])
        assert winner.count() >= 1
    assert page.locator("#step-slider input[type=number]").input_value() == str(step)
    assert page.locator(f'#step-strip .step-mark.selected[data-step="{step}"]').count() == 1
    page.wait_for_function(
        f"[...document.querySelectorAll('#timeline-plot .annotation-text')].some(a => a.textContent === 'step {step}')",
        timeout=30_000,
    )  # the timeline follows
    page.locator("#step-next").click()
    wait_for_step(page, "#tree-view", step + 1)
    page.locator("#step-prev").click()
    wait_for_step(page, "#tree-view", step)
    last = max(e.step for e in events if isinstance(e, StepStarted))
    page.locator(f'#step-strip .step-mark[data-step="{last}"]').click()
    wait_for_step(page, "#tree-view", last)
    page.locator("#step-next").click()  # past the end: clamped, with a notice
    page.wait_for_selector("#step-notice .notice", timeout=30_000)
    assert "there is no step" in page.locator("#step-notice").inner_text() and shown_step(page, "#tree-view") == last


def test_race_in_chromium(page, raced):
    page.get_by_role("tab", name="Compare").click()
    assert_both_columns_streamed(raced, ["ar", "specbranch"])
    assert "identical output at temperature 0" in page.locator("#compare-table .identical-yes").inner_text()
    assert page.locator("#compare-table table.compare-table tr").count() == 3  # the final speedup table
    page.wait_for_selector("#compare-timeline .js-plotly-plot", timeout=60_000)
    page.screenshot(path=str(ARTIFACTS / "app_compare.png"), full_page=True)
    methods = page.locator("#compare-methods")
    methods.get_by_label("specbranch").uncheck()
    page.locator("#compare").click()  # one method: no race
    page.wait_for_function("document.querySelector('#compare-notice').innerText.includes('needs two')", timeout=30_000)
    methods.get_by_label("specbranch").check()


def test_replay_in_chromium(page, raced):
    page.get_by_role("tab", name="Replay").click()
    page.locator("#replay-search textarea, #replay-search input").first.fill("Explain how a hash map")
    page.locator("#replay-find").click()
    page.wait_for_function("document.querySelector('#replay-status').innerText.includes('1 session')", timeout=30_000)
    page.locator("#replay-open").click()
    page.wait_for_selector("#replay-tree-view svg.branch-tree", timeout=60_000)
    page.wait_for_selector("#replay-step-strip .step-mark", timeout=30_000)
    page.locator('#replay-step-strip .step-mark[data-step="2"]').click()
    wait_for_step(page, "#replay-tree-view", 2)
    assert page.locator("#replay-tree-view svg g.node").count() >= 2
    page.get_by_text("Compare and race stored runs").click()
    samples = watch_race(page, "#replay-race", page.locator("#replay-race-btn").click)
    assert_both_columns_streamed(samples, ["ar", "specbranch"])
    page.wait_for_selector("#replay-compare-table .identical-yes", timeout=60_000)
    # the race also draws the runs aligned by step (it used to leave that plot empty, or as an earlier Compare left it)
    page.wait_for_selector("#replay-compare-steps .js-plotly-plot", timeout=30_000)
    page.screenshot(path=str(ARTIFACTS / "app_replay.png"), full_page=True)
