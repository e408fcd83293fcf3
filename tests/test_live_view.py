"""The Live tab as a teacher projects it: the basic controls show at once and the rest wait in Advanced (each with
a one-line label and its explanation as info), the glance line's speedup from the first chat on, and a stream whose
heavy figures are drawn once at the end (and now and then in a long run), never on every token."""

from __future__ import annotations

import gradio as gr
import pytest

from app.context import AppContext
from app.main import build_app
from app.tabs.live import PLOT_EVERY_S, TOKENS_EVERY_S, LiveTab
from app.views import glance_html, one_token_step_s
from engine.events import BranchResolved, Finished, RunStarted, TimingSpan, TokensEmitted

BASIC = ("draft", "live-method", "max-new", "temperature")
ADVANCED = (
    "top-p",
    "gamma",
    "branches",
    "epsilon",
    "draft-stop",
    "feed-stop",
    "head-start",
    "hold",
    "hold-branches",
    "hrad",
    "seed",
    "chat-template",
)


def by_id(demo) -> dict:
    return {b.elem_id: b for b in demo.blocks.values() if getattr(b, "elem_id", None)}


def accordion_of(block):
    while block is not None:
        if isinstance(block, gr.Accordion):
            return block
        block = block.parent
    return None


@pytest.fixture(scope="module")
def demo():
    return build_app(lambda draft=None: None, drafts=[("the app's own", "self"), ("another", "embedded")])


def test_basic_controls_show_at_once_and_the_rest_wait_in_advanced(demo):
    blocks = by_id(demo)
    for elem_id in BASIC:
        assert accordion_of(blocks[elem_id]) is None, elem_id  # on the page as it opens
    advanced = blocks["advanced"]
    assert isinstance(advanced, gr.Accordion) and advanced.open is False and advanced.label == "Advanced"
    for elem_id in ADVANCED:
        control = blocks[elem_id]
        assert accordion_of(control) is advanced, elem_id
        # a one-line label; the long explanation is the control's info text
        assert len(control.label) <= 24 and "\n" not in control.label, control.label
        assert control.info and len(control.info) > len(control.label), elem_id
    for elem_id in ("live-method", "max-new", "temperature"):
        assert len(blocks[elem_id].label) <= 24 and blocks[elem_id].info


def events_of(n_tokens: int, step_ms: float, spans: list[tuple[float, int]], tokens_per_s: float) -> list:
    """A finished specbranch run: target forwards (ms long, tokens fed) and its measured speed."""
    events = [RunStarted("specbranch", "t", "d", [1], "why?", {}, "cpu", 0.0)]
    t = 0.0
    for ms, fed in spans:
        events.append(TimingSpan("target", "verify", 1, t, t + ms / 1000, fed))
        t += ms / 1000
    events.append(TokensEmitted(1, list(range(n_tokens)), ["a"] * n_tokens, ["accepted"] * n_tokens, "a" * n_tokens))
    events.append(Finished("length", 0.1, 1.0, n_tokens, {"tokens_per_s": tokens_per_s}))
    return events


def test_the_first_chat_gets_a_speedup_against_the_targets_one_token_step():
    """No AR run of the prompt yet: the run's tokens/s times the median of its one-token target forwards (a
    4-token verify pass does not count), labelled as such; once an AR run exists, the measured comparison."""
    events = events_of(8, 0, [(50, 1), (60, 1), (200, 4), (40, 1), (70, 1)], tokens_per_s=30.0)
    step_s, where = one_token_step_s(events)
    assert step_s == pytest.approx(0.055) and "4 one-token forwards in this run" in where
    first = glance_html(events)
    assert "≈ 1.65× the target&#x27;s one-token step" in first and "(30 tokens/s; one step 55.0 ms)" in first
    assert "glance-speed" in first and "vs AR" not in first
    assert first.index("one-token step") < first.index("tokens per target forward")  # the speedup comes first
    measured = glance_html(events, ar_tokens_per_s=20.0)
    assert "vs AR on this prompt" in measured and "<b>1.50×</b>" in measured and "one-token step" not in measured
    # no one-token target forward (a speculative run's passes feed several tokens each): the step the engine
    # measured before the run, which its Finished metrics carry; neither: no speedup is claimed
    engine_step = events_of(8, 0, [(200, 4)], tokens_per_s=30.0)
    engine_step[0] = RunStarted("specbranch", "t", "d", [1], "why?", {}, "cpu", 0.0, target_step_ms=40.0)
    assert "≈ 1.20× the target&#x27;s one-token step" in glance_html(engine_step)
    assert "measured by the engine before this run" in glance_html(engine_step)
    none = glance_html(events_of(8, 0, [(200, 4)], tokens_per_s=30.0))
    assert "×" not in none and "tokens per target forward" in none


def test_a_speculative_run_carries_the_targets_one_token_step(tiny_engine, monkeypatch):
    """An engine asked to (the app's) measures the target's one-token step once, before a run's clock starts; a
    speculative run's RunStarted carries it (an AR run's own decode steps are one-token forwards). Not asked (the
    CLI, the bench), it runs no forward besides the run's own and says -1."""
    from engine.config import GenerationConfig

    ids = tiny_engine.encode("a b c", False)
    assert tiny_engine.run(ids, GenerationConfig(method="sd", max_new_tokens=4)).events[0].target_step_ms == -1.0
    monkeypatch.setattr(tiny_engine, "measure_target_step", True)
    start = tiny_engine.run(ids, GenerationConfig(method="specbranch", max_new_tokens=8)).events[0]
    assert isinstance(start, RunStarted) and start.target_step_ms == tiny_engine.target_step_ms() > 0
    assert tiny_engine.run(ids, GenerationConfig(method="ar", max_new_tokens=8)).events[0].target_step_ms == -1.0


class Clock:
    """A clock that moves `dt` seconds each time it is read."""

    def __init__(self, dt: float):
        self.t, self.dt = 0.0, dt

    def __call__(self) -> float:
        self.t += self.dt
        return self.t


TIMELINE = 6  # the timeline's place among /generate's outputs (chat, tokens, metrics, notices, glance, tree, ...)


def stream(tiny_engine, clock) -> tuple[list, list]:
    """Every update a Live run yields, and the run's events."""
    tab = LiveTab(AppContext(lambda draft=None: tiny_engine), clock=clock)
    updates = list(
        tab.generate("a b c", [], "specbranch", 40, 0, 1, 3, 3, 0.5, 0.0, 0.0, 0.0, 0.0, False, False, 0, False)
    )
    return updates, updates[-1][-1]


def token_updates(updates: list) -> list:
    """The updates that show tokens (not those that only show a notice, e.g. that the draft is slow)."""
    return [u for u in updates if u[1] != gr.skip()]


def drawn(update) -> bool:
    return update[TIMELINE] != gr.skip()


def test_a_streamed_run_draws_its_figures_once_at_the_end(tiny_engine):
    """However many steps a run takes, if it ends within PLOT_EVERY_S its figures (timeline, acceptance, cumulative,
    tree, metric panel, glance) are drawn once: in the last update. The answer shows at its first tokens."""
    updates, events = stream(tiny_engine, Clock(0.0))
    emits = sum(isinstance(e, TokensEmitted) for e in events)
    assert emits >= 5  # many steps, one drawing
    assert [drawn(u) for u in updates].count(True) == 1 and drawn(updates[-1])
    assert len(updates) >= 2 and "tok tok-" in updates[0][1]  # the first tokens, at once
    # the step strip marks the steps that forked (the screenshots pick one to show its tree)
    forks = {e.step for e in events if isinstance(e, BranchResolved)}
    assert forks and updates[-1][TIMELINE + 1].count('data-fork="true"') == len(forks)


def test_a_long_run_redraws_its_figures_every_plot_every_s_and_its_tokens_at_most_every_tokens_every_s(tiny_engine):
    """A clock that moves a second a read: the tokens update at every emission (a second apart, more than
    TOKENS_EVERY_S), the figures once per PLOT_EVERY_S of run and at the end."""
    updates, events = stream(tiny_engine, Clock(1.0))
    emits = sum(isinstance(e, TokensEmitted) for e in events)
    assert TOKENS_EVERY_S < 1.0 <= PLOT_EVERY_S and emits >= 2 * PLOT_EVERY_S
    assert len(token_updates(updates)) == emits + 1  # one per emission, then the final drawing
    assert [drawn(u) for u in updates].count(True) == emits // int(PLOT_EVERY_S) + 1
    # a clock a quarter of TOKENS_EVERY_S a read: the tokens update on every fourth emission at most
    updates, events = stream(tiny_engine, Clock(TOKENS_EVERY_S / 4))
    emits = sum(isinstance(e, TokensEmitted) for e in events)
    assert len(token_updates(updates)) - 1 <= emits // 4 + 1 and [drawn(u) for u in updates].count(True) == 1


def test_picking_a_scenario_sets_the_draft_the_method_and_every_setting(demo):
    """Each offered scenario sets the draft menu, the method and the Advanced settings to its preset; the page
    opens on the scenario whose draft and settings it starts with; picking a draft by hand leaves the scenario."""
    from app.settings import SLIDER_KEYS, defaults_for
    from app.tabs.live import leave_scenario, pick_scenario
    from engine.presets import SCENARIOS

    assert {"fastest", "rescue", "weak"} <= set(SCENARIOS)
    for key, s in SCENARIOS.items():
        draft, method, *sliders, note = pick_scenario(key)
        assert draft["value"] == s.draft and method["value"] == s.method == "specbranch"
        assert [u["value"] for u in sliders] == [s.preset.settings()[k] for k in SLIDER_KEYS]
        assert s.summary and "scenario-note" in note
    assert leave_scenario("embedded") == (None, "")
    everything = [(f"the {s.draft} draft", s.draft) for s in SCENARIOS.values()]
    full = build_app(
        lambda draft=None: None,
        defaults=defaults_for(SCENARIOS["fastest"].draft),
        drafts=[*everything, ("embedded", "embedded")],
    )
    blocks = by_id(full)
    picker = blocks["scenario"]
    assert [key for _, key in picker.choices] == list(SCENARIOS) and picker.value == "fastest"
    assert accordion_of(picker) is None  # a basic control
    ids = {c["id"]: c["props"].get("elem_id") for c in full.config["components"]}
    wired = next(d for d in full.config["dependencies"] if any(ids.get(t) == "scenario" for t, _ in d["targets"]))
    assert [ids[o] for o in wired["outputs"]] == [
        "draft",
        "live-method",
        *[k.replace("_", "-") for k in SLIDER_KEYS],
        "scenario-note",
    ]
    # the test page's menu offers self and embedded only: the scenarios on other drafts are not offered
    assert [key for _, key in by_id(demo)["scenario"].choices] == [
        k for k, s in SCENARIOS.items() if s.draft in ("self", "embedded")
    ]
    assert "scenario" not in by_id(build_app(lambda draft=None: None))  # no draft menu, no scenarios
