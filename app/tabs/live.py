"""The Live tab: a chat whose answer streams with the speculation view, the branch tree of any step, the measured
timeline, the acceptance and cumulative charts and the metric panel."""

from __future__ import annotations

import html
import time

import gradio as gr

from engine.config import SpecBranchError
from engine.events import Event, Notice, TokensEmitted
from engine.presets import SCENARIOS
from sessions.replay import replay_steps

from ..context import AppContext
from ..figures import timeline_figure
from ..identity import owner_of
from ..navigator import build_navigator, clamp_step, notice_of, slider_update, step_strip, wire_navigator
from ..render import VIEWS, failure_message, highlight_of, notice_html, skips, views_at
from ..settings import LIVE_METHODS, SLIDER_KEYS, examples, make_config, slider_defaults
from ..stream import stream_events
from ..tree import tree_html
from ..views import metric_panel, token_view

LEGEND = (
    '<div class="legend"><span class="tok tok-accepted">accepted draft</span>'
    '<span class="tok tok-rescued">rescued by a branch</span><span class="tok tok-correction">target correction'
    '</span><span class="tok tok-bonus">bonus</span><span class="tok tok-target">target</span>'
    '<span class="rb-key">↶n</span> n drafted tokens rolled back in that step (click to show) · hover a token '
    "for p, q, p/q and u</div>"
)
METHOD_INFO = "specbranch forks where the draft is unsure; pearl never forks; sd drafts, then verifies; ar: no draft"
HOLD_BRANCHES_INFO = (
    "SpecBranch, with a hold: a branch step that would take the first branch's odds below the hold "
    "keeps nothing. On for the embedded-weak and self-skip drafts: it cut path rollback at the same "
    "speed; off for the distilled draft, which it made 7 % slower at T=0 (docs/methods.md)"
)
# H-RAD ships off: on held-out prompts it placed branch points no better than the draft's confidence alone
HRAD_INFO = (
    "a classifier places the branch points. Off by default: on held-out prompts it was no faster than the "
    "draft's confidence alone (docs/methods.md)"
)
# the Advanced sliders, in order: (setting, low, high, step, label, info)
ADVANCED_SLIDERS = (
    ("top_p", 0.01, 1, 0.01, "Top-p", "in (0, 1]: sample from the fewest tokens holding this much probability"),
    (
        "gamma",
        1,
        16,
        1,
        "γ (draft length)",
        "SD: the block length; PEARL and SpecBranch: the most tokens verified per round (1–16)",
    ),
    ("branches", 1, 6, 1, "k (branches)", "SpecBranch: the most candidates at a branch point (1–6)"),
    (
        "epsilon",
        0,
        1,
        0.05,
        "ε (where to fork)",
        "fork where the draft's token is accepted less often than this: its confidence, read as the acceptance "
        "this engine measured at it [0, 1]",
    ),
    ("draft_stop", 0, 1, 0.05, "Draft stop", "end a round's drafting below this confidence (0 = off)"),
    (
        "feed_stop",
        0,
        1,
        0.05,
        "Feed stop",
        "verify drafted tokens only while the draft's odds that all are accepted stay above this (0 = up to γ)",
    ),
    (
        "head_start",
        0,
        1,
        0.01,
        "Head start",
        "after a rejection, the draft leads the target's next pass while its odds that the block is accepted stay "
        "above this (0 = off: the target starts at once, as in PEARL)",
    ),
    (
        "hold",
        0,
        1,
        0.05,
        "Hold",
        "SpecBranch: draft nothing where the odds that it is accepted, the pending tokens' included, fall below "
        "this; the target takes that token itself (0 = off)",
    ),
)
FIXED_STARTS = {"top_p": 1, "branches": 3}  # the sliders no draft's preset sets
# A live view that does not slow what it shows: while a run streams, only the answer and the token view update, at
# most TOKENS_EVERY_S apart; the figures, the tree, the metric panel and the glance line are drawn once at the end,
# and every PLOT_EVERY_S during a long run (the browser redrawing three Plotly figures took cores the engine needs)
TOKENS_EVERY_S = 0.25
PLOT_EVERY_S = 10.0


def message_text(message: dict) -> str:
    """A chat message's text (Gradio may hand content back as a list of typed parts)."""
    c = message.get("content")
    return c if isinstance(c, str) else "".join(p.get("text", "") for p in c or [] if isinstance(p, dict))


def scenario_note(key: str | None) -> str:
    """The picked scenario's one line: what to watch, and its measured speed."""
    s = SCENARIOS.get(key) if key else None
    return f'<div class="scenario-note">{html.escape(s.summary)}</div>' if s else ""


def pick_scenario(key: str):
    """The draft, the method, the settings (SLIDER_KEYS, in order) and the note of a scenario."""
    s = SCENARIOS.get(key)
    if s is None:
        return (gr.skip(),) * (3 + len(SLIDER_KEYS))
    settings = s.preset.settings()
    return (
        gr.update(value=s.draft),
        gr.update(value=s.method),
        *(gr.update(value=settings[k]) for k in SLIDER_KEYS),
        scenario_note(key),
    )


def leave_scenario(_draft):
    """A draft picked by hand: no scenario is picked any more."""
    return None, ""


def notice_only(history, notice: str, events: list[Event]) -> tuple:
    """The Live tab's outputs with only the chat, a notice and the events set."""
    return (history, *skips(2), notice, *skips(VIEWS - 3 + 2), events)


class ChatStream:
    """What the Live tab shows of one answer as its events arrive: the answer text and its tokens a few times a
    second, every view now and then in a long run (TOKENS_EVERY_S, PLOT_EVERY_S)."""

    def __init__(self, history: list, show_rollbacks, ar_speed: float | None, clock):
        self.history, self.show_rollbacks, self.ar_speed, self.clock = history, show_rollbacks, ar_speed, clock
        self.events: list[Event] = []
        self.text = ""
        self.last_all, self.last_text = clock(), float("-inf")  # the first tokens show at once

    def take(self, event: Event) -> tuple | None:
        """The outputs to show after `event`, or None to show nothing new yet."""
        self.events.append(event)
        if isinstance(event, Notice):  # e.g. the draft's step still compiling: say so at once
            return notice_only(self.history, notice_html(self.events), self.events)
        if not isinstance(event, TokensEmitted):
            return None
        self.text += event.text
        self.history[-1] = {"role": "assistant", "content": self.text}  # the chat holds the answer text only
        now = self.clock()
        if now - self.last_all >= PLOT_EVERY_S:  # a long run: every view, now and then
            self.last_all = self.last_text = now
            return self.everything()
        if now - self.last_text >= TOKENS_EVERY_S:  # the answer and its tokens, a few times a second
            self.last_text = now
            return (self.history, token_view(self.events, self.show_rollbacks), *skips(VIEWS - 1 + 2), self.events)
        return None

    def everything(self, warning: str | None = None) -> tuple:
        steps = replay_steps(self.events)
        return (
            self.history,
            *views_at(self.events, None, warning, self.show_rollbacks, self.ar_speed),
            slider_update(steps, steps[-1] if steps else None),
            "",
            self.events,
        )

    def failed(self, exc: Exception) -> tuple:
        """The outputs where the run broke off (out of memory, a draft's process gone): what it made, and why."""
        return (
            self.history,
            token_view(self.events, self.show_rollbacks),
            metric_panel(self.events),
            notice_html(self.events, failure_message(exc)),
            *skips(VIEWS - 3 + 2),
            self.events,
        )


class LiveTab:
    def __init__(self, ctx: AppContext, clock=time.perf_counter):
        self.ctx = ctx
        self.clock = clock  # what paces the stream's updates (a test hands it a clock of its own)

    # ------------------------------------------------------------------ UI
    def create_ui(self) -> None:
        """Laid out to be projected: a 1280x720 first screen holds the controls (the settings folded) at the left and
        the prompt, the glance line and the step's tree with its navigator at the right; the chat, the answer's
        tokens, the measured figures and the metric panel follow below."""
        with gr.Tab("Live"):
            with gr.Row():
                with gr.Column(scale=1, min_width=300) as left:
                    self.create_controls()
                with gr.Column(scale=3, elem_id="live-main"):
                    self.create_prompt()
                    self.notices = gr.HTML(elem_id="notices")
                    self.glance = gr.HTML(elem_id="glance")
                    gr.Markdown(
                        "**Branch tree of a step** · pick one with the buttons and the slider under it, or a marker "
                        "under the timeline; the timeline's shading follows",
                        elem_classes="tree-title",
                    )
                    self.tree = gr.HTML(elem_id="tree-view")
                    self.nav = build_navigator("step")
                    self.chatbot = gr.Chatbot(
                        label="Chat (the answer text)", height=220, sanitize_html=True, elem_id="chatbot"
                    )
            with left:  # under the controls, now that the prompt they fill exists
                gr.Examples(examples(), [self.prompt, self.chat], label="Example prompts (benchmark split)")
            with gr.Row(equal_height=True):
                gr.HTML(LEGEND)
                self.show_rollbacks = gr.Checkbox(
                    False,
                    label="Show all rollbacks (else click a ↶ marker)",
                    elem_id="show-rollbacks",
                    scale=0,
                    min_width=300,
                )
            self.tokens = gr.HTML(elem_id="token-view")  # scrolls past a few lines (app.css)
            self.timeline = gr.Plot(label="Bubble timeline", elem_id="timeline-plot")
            self.nav.add_strip()
            with gr.Row():
                self.acceptance = gr.Plot(label="Acceptance", elem_id="acceptance-plot")
                self.cumulative = gr.Plot(label="Drafted / accepted / rolled back", elem_id="cumulative-plot")
            self.metrics = gr.HTML(elem_id="metric-panel")
            self.events = gr.State([])

    def create_controls(self) -> None:
        """Basic controls (method, max new tokens, temperature; the draft menu sits above the tabs) show at once;
        everything else waits in the Advanced accordion, each with a one-line label and its explanation as info."""
        self.create_scenarios()
        self.method = gr.Dropdown(
            LIVE_METHODS, value="specbranch", label="Method", info=METHOD_INFO, elem_id="live-method"
        )
        max_new = gr.Slider(1, 2048, value=128, step=1, label="Max new tokens", info="1–2048", elem_id="max-new")
        temperature = gr.Slider(
            0, 2, value=0, step=0.05, label="Temperature", info="0 = greedy (≥ 0)", elem_id="temperature"
        )
        with gr.Accordion("Advanced", open=False, elem_id="advanced"):
            advanced = self.create_advanced(self.ctx.defaults)
        self.settings = {key: advanced[key] for key in SLIDER_KEYS}
        self.ctx.controls = [max_new, temperature, *advanced.values(), self.chat]

    def create_advanced(self, d: dict) -> dict:
        """The Advanced controls by name, in make_config's order from top-p to seed (then the chat switch): the
        sliders start at the draft's preset (`d`) where it has a value, the rest at FIXED_STARTS."""
        controls = {
            name: gr.Slider(
                low,
                high,
                value=FIXED_STARTS[name] if name in FIXED_STARTS else d[name],
                step=step,
                label=label,
                elem_id=name.replace("_", "-"),
                info=info,
            )
            for name, low, high, step, label, info in ADVANCED_SLIDERS
        }
        controls["hold_branches"] = gr.Checkbox(
            d["hold_branches"], label="Hold the branches too", info=HOLD_BRANCHES_INFO, elem_id="hold-branches"
        )
        controls["hrad"] = gr.Checkbox(d["hrad"], label="H-RAD", info=HRAD_INFO, elem_id="hrad")
        controls["seed"] = gr.Number(0, precision=0, label="Seed", info="an integer", elem_id="seed")
        self.chat = gr.Checkbox(
            True, label="Chat template", info="off: raw text, e.g. code completion", elem_id="chat-template"
        )
        return controls

    def create_scenarios(self) -> None:
        """The scenario picker: each sets the draft, the method and every setting together (engine/presets.py). Only
        the scenarios whose draft the menu offers; none without a draft menu. It starts on the scenario the page
        opens with, if any."""
        ctx, self.scenario = self.ctx, None
        offered = [s for s in SCENARIOS.values() if ctx.drafts and s.draft in ctx.specs]
        if not offered:
            return
        start = next(
            (
                s.key
                for s in offered
                if s.draft == ctx.specs[0] and all(ctx.defaults.get(k) == v for k, v in s.preset.settings().items())
            ),
            None,
        )
        self.scenario = gr.Radio(
            [(s.label, s.key) for s in offered],
            value=start,
            label="Scenario",
            info="sets the draft, the method and the Advanced settings together",
            elem_id="scenario",
        )
        self.scenario_note = gr.HTML(scenario_note(start), elem_id="scenario-note")

    def create_prompt(self) -> None:
        """The prompt with its buttons beside it: one line of the first screen."""
        with gr.Row(equal_height=True):
            self.prompt = gr.Textbox(
                label="Prompt", lines=2, placeholder="Ask something…", elem_id="prompt", scale=6, min_width=300
            )
            with gr.Column(scale=1, min_width=120):
                self.send = gr.Button("Generate", variant="primary", elem_id="generate")
                self.stop = gr.Button("Stop", variant="stop", elem_id="stop")

    # ------------------------------------------------------------------ events
    def create_event_handlers(self) -> None:
        ctx = self.ctx
        views = [
            self.tokens,
            self.metrics,
            self.notices,
            self.glance,
            self.tree,
            self.timeline,
            self.nav.strip,
            self.acceptance,
            self.cumulative,
        ]
        outputs = [self.chatbot, *views, self.nav.slider, self.nav.notice, self.events]
        inputs = [self.prompt, self.chatbot, self.method, *ctx.controls, ctx.browser, self.show_rollbacks, ctx.draft]
        # progress shows on the token view only, minimal: not an animated timer over each of the 13 outputs, which
        # the browser redraws all through the run on the cores the engine needs
        progress = dict(show_progress="minimal", show_progress_on=[self.tokens])
        run = self.send.click(
            self.generate,
            inputs,
            outputs,
            concurrency_limit=1,
            concurrency_id="engine",
            api_name="generate",
            **progress,
        )
        submit = self.prompt.submit(
            self.generate,
            inputs,
            outputs,
            concurrency_limit=1,
            concurrency_id="engine",
            api_name="generate_on_enter",
            api_visibility="private",
            **progress,
        )
        self.stop.click(None, cancels=[run, submit], api_name="stop", api_visibility="private")
        self.create_view_handlers()
        self.create_settings_handlers()

    def create_view_handlers(self) -> None:
        """The navigator moves the tree, the timeline's shading and the strip; the rollback switch redraws the
        tokens."""
        wire_navigator(
            self.nav,
            self.show_step,
            [self.events],
            [self.nav.slider, self.nav.notice, self.tree, self.timeline, self.nav.strip],
        )
        self.show_rollbacks.change(
            self.rerender_tokens,
            [self.show_rollbacks, self.events],
            self.tokens,
            api_name="live_tokens",
            api_visibility="private",
        )

    def create_settings_handlers(self) -> None:
        """A draft picked by hand sets the sliders to its preset; a scenario sets the draft, the method and the
        sliders together, and a draft picked by hand leaves it."""
        ctx = self.ctx
        sliders = [self.settings[key] for key in SLIDER_KEYS]
        if ctx.drafts:  # a draft picked by hand brings the settings chosen for its kind (a scenario brings its own)
            ctx.draft.input(slider_defaults, ctx.draft, sliders, api_name="slider_defaults", api_visibility="private")
        if self.scenario is not None:
            self.scenario.input(
                pick_scenario,
                self.scenario,
                [ctx.draft, self.method, *sliders, self.scenario_note],
                api_name="pick_scenario",
                api_visibility="private",
            )
            ctx.draft.input(
                leave_scenario,
                ctx.draft,
                [self.scenario, self.scenario_note],
                api_name="leave_scenario",
                api_visibility="private",
            )

    def prepare(self, prompt, history, method, controls, chat, draft):
        """(config, engine, prompt ids) for a request; raises SpecBranchError with what is wrong."""
        cfg = make_config(method, *controls)
        if not prompt or not prompt.strip():
            raise SpecBranchError("the prompt is empty")
        engine = self.ctx.engine_for(draft)
        turns = [{"role": m["role"], "content": message_text(m)} for m in history if message_text(m)]
        ids = engine.encode(prompt, bool(chat), history=turns)
        engine.check_prompt(ids)
        return cfg, engine, ids

    def generate(
        self,
        prompt,
        history,
        method,
        max_new,
        temperature,
        top_p,
        gamma,
        branches,
        epsilon,
        draft_stop,
        feed_stop,
        head_start,
        hold,
        hold_branches,
        hrad,
        seed,
        chat,
        browser_id=None,
        show_rollbacks=False,
        draft=None,
        request: gr.Request = None,
    ):
        controls = (
            max_new,
            temperature,
            top_p,
            gamma,
            branches,
            epsilon,
            draft_stop,
            feed_stop,
            head_start,
            hold,
            hold_branches,
            hrad,
            seed,
        )
        yield from self.chat_turn(
            prompt, list(history or []), method, controls, chat, browser_id, show_rollbacks, draft, request
        )

    def chat_turn(self, prompt, history, method, controls, chat, browser_id, show_rollbacks, draft, request):
        """One answer: refused with the reason, or streamed (ChatStream) while it is recorded."""
        try:
            cfg, engine, ids = self.prepare(prompt, history, method, controls, chat, draft)
        except SpecBranchError as exc:
            yield notice_only(history, notice_html([], str(exc)), [])
            return
        except Exception as exc:  # a model that fails to load: say so, keep serving
            yield notice_only(history, notice_html([], f"could not load the models: {exc}"), [])
            return
        history += [{"role": "user", "content": prompt}, {"role": "assistant", "content": ""}]
        owner = owner_of(browser_id, request)
        ar_speed = self.ctx.ar_speed_of(owner, prompt, engine)  # before this run is stored: not its own baseline
        recorder, _ = self.ctx.start_recording(owner, prompt, engine, cfg)
        stream = ChatStream(history, show_rollbacks, ar_speed, self.clock)
        try:
            for event in stream_events(engine, ids, cfg, prompt):
                update = stream.take(event)
                recorder.add(event)
                if update is not None:
                    yield update
        except Exception as exc:
            yield stream.failed(exc)
            return
        finally:  # also on Stop: the run is kept, marked partial when it has no Finished event
            recorder.close()
        yield stream.everything(f"not recording: {recorder.error}" if recorder.error else None)

    @staticmethod
    def show_step(requested, events):
        """The navigator's step: the tree, the timeline's shading and the strip follow it."""
        events = events or []
        step, notice = clamp_step(requested, replay_steps(events))
        if step is None:
            return slider_update([], None), notice_of("no steps yet: generate something first"), *skips(3)
        return (
            slider_update(replay_steps(events), step),
            notice_of(notice),
            tree_html(events, step),
            timeline_figure([events], highlight_of(events, step)),
            step_strip(events, step),
        )

    @staticmethod
    def rerender_tokens(show_rollbacks, events):
        return token_view(events or [], bool(show_rollbacks))
