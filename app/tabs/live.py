"""The Live tab: a chat whose answer streams with the speculation view, the branch tree of any step, the measured
timeline, the acceptance and cumulative charts and the metric panel."""
from __future__ import annotations

import time

import gradio as gr

from engine.config import SpecBranchError
from engine.events import Event, TokensEmitted
from sessions.replay import replay_steps

from ..context import AppContext
from ..identity import owner_of
from ..navigator import build_navigator, clamp_step, notice_of, slider_update, step_strip, wire_navigator
from ..render import VIEWS, highlight_of, notice_html, skips, views_at
from ..settings import (HOLD_BRANCHES_LABEL, HRAD_LABEL, LIVE_METHODS, SLIDER_KEYS, examples,
                        make_config, slider_defaults)
from ..figures import timeline_figure
from ..stream import stream_events
from ..tree import tree_html
from ..views import metric_panel, token_view

LEGEND = ('<div class="legend"><span class="tok tok-accepted">accepted draft</span>'
          '<span class="tok tok-rescued">rescued by a branch</span><span class="tok tok-correction">target correction'
          '</span><span class="tok tok-bonus">bonus</span><span class="tok tok-target">target</span>'
          '<span class="rb-key">↶n</span> n drafted tokens rolled back in that step (click to show) · hover a token '
          'for p, q, p/q and u</div>')
PLOT_EVERY_S = 1.0  # long outputs stay responsive: the figures redraw about once a second, the tokens every 4


def message_text(message: dict) -> str:
    """A chat message's text (Gradio may hand content back as a list of typed parts)."""
    c = message.get("content")
    return c if isinstance(c, str) else "".join(p.get("text", "") for p in c or [] if isinstance(p, dict))


class LiveTab:
    def __init__(self, ctx: AppContext):
        self.ctx = ctx

    # ------------------------------------------------------------------ UI
    def create_ui(self) -> None:
        with gr.Tab("Live"):
            with gr.Row():
                with gr.Column(scale=1, min_width=320):
                    self.create_controls()
                with gr.Column(scale=2):
                    self.create_chat()
            gr.Markdown("### Branch tree of a step\nPick a step with the buttons, the slider, or a marker under the "
                        "timeline; the tree and the timeline's shading follow.")
            self.nav = build_navigator("step")
            self.tree = gr.HTML(elem_id="tree-view")
            self.timeline = gr.Plot(label="Bubble timeline", elem_id="timeline-plot")
            self.nav.add_strip()
            with gr.Row():
                self.acceptance = gr.Plot(label="Acceptance", elem_id="acceptance-plot")
                self.cumulative = gr.Plot(label="Drafted / accepted / rolled back", elem_id="cumulative-plot")
            self.events = gr.State([])

    def create_controls(self) -> None:
        d = self.ctx.defaults
        self.method = gr.Dropdown(LIVE_METHODS, value="specbranch", label="Method", elem_id="live-method")
        max_new = gr.Slider(1, 2048, value=128, step=1, label="Max new tokens (1–2048)", elem_id="max-new")
        temperature = gr.Slider(0, 2, value=0, step=0.05, label="Temperature (0 = greedy, ≥ 0)")
        top_p = gr.Slider(0.01, 1, value=1, step=0.01, label="Top-p, in (0, 1]")
        gamma = gr.Slider(1, 16, value=d["gamma"], step=1, elem_id="gamma",
                          label="γ: SD block length; PEARL/SpecBranch: tokens verified per round (1–16)")
        branches = gr.Slider(1, 6, value=3, step=1, label="k: most branches at a branch point (1–6)")
        epsilon = gr.Slider(0, 1, value=d["epsilon"], step=0.05, elem_id="epsilon",
                            label="ε: branch where the draft's token is accepted less often than this: its "
                                  "confidence, read as the acceptance this engine measured at it [0, 1]")
        draft_stop = gr.Slider(0, 1, value=d["draft_stop"], step=0.05, elem_id="draft-stop",
                               label="Draft stop: end a round's drafting below this confidence (0 = off)")
        feed_stop = gr.Slider(0, 1, value=d["feed_stop"], step=0.05, elem_id="feed-stop",
                              label="Feed stop: verify drafted tokens only while the draft's odds that all are "
                                    "accepted stay above this (0 = up to γ)")
        head_start = gr.Slider(0, 1, value=d["head_start"], step=0.01, elem_id="head-start",
                               label="Head start: after a rejection, the draft leads the target's next pass while "
                                     "its odds that the block is accepted stay above this (0 = off, the target "
                                     "starts at once as in PEARL)")
        hold = gr.Slider(0, 1, value=d["hold"], step=0.05, elem_id="hold",
                         label="Hold (SpecBranch): draft nothing where the odds that it is accepted, the pending "
                               "tokens' included, fall below this; the target takes that token itself (0 = off)")
        hold_branches = gr.Checkbox(d["hold_branches"], label=HOLD_BRANCHES_LABEL, elem_id="hold-branches")
        hrad = gr.Checkbox(d["hrad"], label=HRAD_LABEL, elem_id="hrad")
        seed = gr.Number(0, precision=0, label="Seed (integer)")
        self.chat = gr.Checkbox(True, label="Chat template (off: raw text, e.g. code completion)")
        self.settings = {"gamma": gamma, "epsilon": epsilon, "draft_stop": draft_stop, "feed_stop": feed_stop,
                         "head_start": head_start, "hold": hold, "hold_branches": hold_branches, "hrad": hrad}
        self.ctx.controls = [max_new, temperature, top_p, gamma, branches, epsilon, draft_stop, feed_stop,
                             head_start, hold, hold_branches, hrad, seed, self.chat]

    def create_chat(self) -> None:
        self.chatbot = gr.Chatbot(label="Chat (the answer text)", height=320, sanitize_html=True, elem_id="chatbot")
        self.prompt = gr.Textbox(label="Prompt", lines=2, placeholder="Ask something…", elem_id="prompt")
        with gr.Row():
            self.send = gr.Button("Generate", variant="primary", elem_id="generate")
            self.stop = gr.Button("Stop", variant="stop", elem_id="stop")
        gr.Examples(examples(), [self.prompt, self.chat], label="Example prompts (benchmark split)")
        self.notices = gr.HTML(elem_id="notices")
        self.glance = gr.HTML(elem_id="glance")
        gr.HTML(LEGEND)
        self.show_rollbacks = gr.Checkbox(False, label="Show all rollbacks (else click a ↶ marker)",
                                          elem_id="show-rollbacks")
        self.tokens = gr.HTML(elem_id="token-view")
        self.metrics = gr.HTML(elem_id="metric-panel")

    # ------------------------------------------------------------------ events
    def create_event_handlers(self) -> None:
        ctx = self.ctx
        views = [self.tokens, self.metrics, self.notices, self.glance, self.tree, self.timeline, self.nav.strip,
                 self.acceptance, self.cumulative]
        outputs = [self.chatbot, *views, self.nav.slider, self.nav.notice, self.events]
        inputs = [self.prompt, self.chatbot, self.method, *ctx.controls, ctx.browser, self.show_rollbacks, ctx.draft]
        run = self.send.click(self.generate, inputs, outputs, concurrency_limit=1, concurrency_id="engine",
                              api_name="generate")
        submit = self.prompt.submit(self.generate, inputs, outputs, concurrency_limit=1, concurrency_id="engine",
                                    api_name="generate_on_enter", api_visibility="private")
        self.stop.click(None, cancels=[run, submit], api_name="stop", api_visibility="private")
        wire_navigator(self.nav, self.show_step, [self.events],
                       [self.nav.slider, self.nav.notice, self.tree, self.timeline, self.nav.strip])
        self.show_rollbacks.change(self.rerender_tokens, [self.show_rollbacks, self.events], self.tokens,
                                   api_name="live_tokens", api_visibility="private")
        if ctx.drafts:  # a draft brings the settings the bench chose for its kind
            ctx.draft.change(slider_defaults, ctx.draft, [self.settings[key] for key in SLIDER_KEYS],
                             api_name="slider_defaults", api_visibility="private")

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

    def generate(self, prompt, history, method, max_new, temperature, top_p, gamma, branches, epsilon, draft_stop,
                 feed_stop, head_start, hold, hold_branches, hrad, seed, chat,
                 browser_id=None, show_rollbacks=False, draft=None, request: gr.Request = None):
        history = list(history or [])
        events: list[Event] = []
        controls = (max_new, temperature, top_p, gamma, branches, epsilon, draft_stop, feed_stop, head_start, hold,
                    hold_branches, hrad, seed)
        try:
            cfg, engine, ids = self.prepare(prompt, history, method, controls, chat, draft)
        except SpecBranchError as exc:
            yield (history, *skips(2), notice_html([], str(exc)), *skips(VIEWS - 3 + 2), events)
            return
        except Exception as exc:  # a model that fails to load: say so, keep serving
            yield (history, *skips(2), notice_html([], f"could not load the models: {exc}"), *skips(VIEWS - 3 + 2),
                   events)
            return
        history += [{"role": "user", "content": prompt}, {"role": "assistant", "content": ""}]
        owner = owner_of(browser_id, request)
        ar_speed = self.ctx.ar_speed_of(owner, prompt, engine)  # before this run is stored: not its own baseline
        recorder, _ = self.ctx.start_recording(owner, prompt, engine, cfg)

        def everything(warning=None):
            steps = replay_steps(events)
            return (history, *views_at(events, None, warning, show_rollbacks, ar_speed),
                    slider_update(steps, steps[-1] if steps else None), "", events)

        text, last_plot, tokens_seen = "", 0.0, 0
        try:
            for event in stream_events(engine, ids, cfg, prompt):
                events.append(event)
                recorder.add(event)
                if isinstance(event, TokensEmitted):
                    text += event.text
                    tokens_seen += len(event.tokens)
                    history[-1] = {"role": "assistant", "content": text}  # the chat holds the answer text only
                    if time.perf_counter() - last_plot > PLOT_EVERY_S:
                        last_plot = time.perf_counter()
                        yield everything()
                    elif tokens_seen % 4 == 0:
                        yield (history, token_view(events, show_rollbacks), *skips(VIEWS - 1 + 2), events)
        except Exception as exc:
            message = "out of memory: try fewer tokens or a smaller pair" if "out of memory" in str(exc) else str(exc)
            yield (history, token_view(events, show_rollbacks), metric_panel(events), notice_html(events, message),
                   *skips(VIEWS - 3 + 2), events)
            return
        finally:  # also on Stop: the run is kept, marked partial when it has no Finished event
            recorder.close()
        yield everything(f"not recording: {recorder.error}" if recorder.error else None)

    @staticmethod
    def show_step(requested, events):
        """The navigator's step: the tree, the timeline's shading and the strip follow it."""
        events = events or []
        step, notice = clamp_step(requested, replay_steps(events))
        if step is None:
            return slider_update([], None), notice_of("no steps yet: generate something first"), *skips(3)
        return (slider_update(replay_steps(events), step), notice_of(notice), tree_html(events, step),
                timeline_figure([events], highlight_of(events, step)), step_strip(events, step))

    @staticmethod
    def rerender_tokens(show_rollbacks, events):
        return token_view(events or [], bool(show_rollbacks))
