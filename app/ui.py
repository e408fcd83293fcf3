"""The Gradio app: chat with a live speculation view, the branch tree of any step, the measured
bubble timeline, acceptance/rollback charts, a side-by-side comparison and a teaching panel.
Everything shown is computed from the engine's event stream (app/views.py, app/figures.py)."""
from __future__ import annotations

import html
import time
from pathlib import Path

import gradio as gr

from engine.config import GenerationConfig, SpecBranchError
from engine.events import Event, Notice, TokensEmitted
from engine.metrics import compute_metrics, metrics_of
from engine.models import is_skip_draft
from sessions.replay import replay_steps

from .figures import acceptance_figure, cumulative_figure, timeline_figure
from .identity import browser_id_state, browser_identity, owner_of
from .navigator import build_navigator, clamp_step, notice_of, slider_update, step_strip, step_times, wire_navigator
from .race import NEEDS_TWO, is_greedy, race_updates
from .replay_tab import VIEWS, build_replay_tab, stored_ar_speed
from .stream import stream_events
from .tree import tree_html
from .views import fmt, glance_html, metric_panel, token_view

STATIC = Path(__file__).resolve().parent.parent / "static"
LIVE_METHODS = ["specbranch", "pearl", "sd", "ar", "specbranch-no-branch", "specbranch-no-hrad"]
COMPARE_METHODS = ["ar", "sd", "pearl", "specbranch"]
LEGEND = ('<div class="legend"><span class="tok tok-accepted">accepted draft</span>'
          '<span class="tok tok-rescued">rescued by a branch</span><span class="tok tok-correction">target correction'
          '</span><span class="tok tok-bonus">bonus</span><span class="tok tok-target">target</span>'
          '<span class="rb-key">↶n</span> n drafted tokens rolled back in that step (click to show) · hover a token '
          'for p, q, p/q and u</div>')
TEACHING = """
### How to read this
**Speculative decoding (SD).** A small *draft* model guesses the next few tokens; the big *target* model
checks all of them in one forward pass. A guess x is kept with probability min(1, p(x)/q(x)) (p: target,
q: draft). At the first rejected guess the target supplies a *correction*; if all pass, it adds a *bonus*
token. The output has exactly the target's distribution (at temperature 0: exactly its greedy text).
In plain SD the two models take turns, so each waits while the other works: the red *bubbles* in the timeline.

**PEARL.** The draft keeps drafting the next block *while* the target verifies the current one, so the
bubbles shrink. But a rejection throws away everything drafted after it (the ↶ markers: click one to see).
Right after a rejection nothing drafted is left to verify, so the target's next pass can return one token
only. The *head start* slider lets the draft lead that pass by a few tokens while it is sure enough: a short
bubble on the target's lane in exchange for a longer block (0 = PEARL as published).

**SpecBranch.** Where a rejection is likely (the draft is unsure, or the H-RAD classifier reading the
target's hidden state says so), the draft forks *k branches* from its top candidates and drafts them
all at once. The target verifies along the draft's first choice, through the branch point, so a fork
never shortens a round; if the target's token is another candidate instead, that branch's tokens are
already drafted and survive (purple *rescued* tokens); only the other branches are rolled back.
"Unsure" is measured, not assumed: the engine counts how often the target accepted tokens the draft drafted at
each confidence (each method keeps its own counts, for as long as the app runs), and forks where that rate is
below ε. A draft that is right even when unsure (the app's 4-bit draft) then stops forking after its first few
rounds; the paper's rule, which trusts the confidence as is, is `--no-calibrate` on the CLI.
The same counts set how far the draft leads the target (the head start): sampled, a near-copy of the target is
accepted even where it drew a token it gave little mass, so SpecBranch leads whole blocks where PEARL, which reads
each drawn token's probability, starts the target's pass early (docs/RESULTS.md §0o).
The *hold* slider makes SpecBranch rollback-aware: where the odds that what it would draft is accepted (those of
the tokens still pending times its own, or a fork's, as measured) fall below the hold, the draft drafts nothing,
and the target takes that token itself, as in plain decoding. The step's caption says "the draft held back". With
a draft that is often wrong, this is what keeps the rollback markers rare. *Hold the branches too* (on by default
for `embedded-weak` and `self-skip:...`, off for the distilled draft) also stops a fork's branches where one more
token would take their odds below the hold; the step's caption then says "the branches held back" (docs/RESULTS.md
§0q). A fork's odds are counted the same way:
wherever the target rejects the draft's token, fork or not, the engine plays the fork the draft could have made
there and counts whether it would have rescued that position. Where, in this run, the draft has more often held
back again than drafted right after a hold, the target's next pass starts at once: on the timeline the draft's next
step runs beside that pass instead of before it, and the step's caption says the pass did not wait on a draft step
(docs/RESULTS.md §0p).

**Which draft.** On a CPU the app drafts with the target itself, its weights read in 4 bits (the GGUF file they came
from stores them so; docs/RESULTS.md §0f, §0h). A draft step then costs about a third of a target step, and the
draft agrees with the target on over 99 % of tokens, so speculation pays, but there is little to reject, roll back
or branch. To watch those, pick another draft in the Draft menu: `embedded` (a distilled 6-layer draft, right about
half the time) or `embedded-weak`. To watch forks rescue, `self-skip:3,4,5,25` (the target without 4 of its 30
layers, right about 70 % of the time): where it is unsure, its runners-up often hold the target's token and about a
quarter of its forks rescue. Over the benchmark prompts it ran about as fast as plain decoding (1.02–1.09× over 3
seeds, docs/RESULTS.md §0l); one short run can be slower. A draft loads on first use (seconds), and picking one sets
the sliders to the settings the bench chose for its kind.

**The charts.** *Branch tree*: one step, left to right: the committed prefix, the drafted path, the fork
with its k candidates and each branch. Green accepted, purple rescued, red rejected, orange the target's
correction, blue its bonus, dashed never verified; the orange outline follows what survives the step.
Hover a node for p, q, p/q and u. Pick a step with ◀ ▶, the slider, or a marker under the timeline.
*Timeline*: measured forward passes of each model; overlap means both computed at once. The metric panel's *wall
split* divides the run's time four ways: both models compute, the target alone, the draft alone (the target waits
on it) and neither. On this 2-core CPU two models computing at once share the memory bus, so each forward runs
slower beside the other: in one bench run a target pass cost 66 ms in SD and 87 ms in PEARL (docs/RESULTS.md §0m).
*Per-position acceptance*: how often the i-th draft token survives given the ones before it did.
*Race* (Compare, Replay): the runs, recorded one after another, replayed side by side on one clock.
"""


# The Live and Compare defaults, chosen by the bench on data/tuning_prompts.jsonl for each kind of draft: a
# distilled draft (docs/RESULTS.md §0, §0e), and the target itself read in 4 bits, which agrees with the target on
# over 99 % of tokens, so it drafts long blocks without stopping and forks only where it is very unsure (§0f; γ 8
# since SpecBranch's head start reads its measured acceptance, §0o: on the tuning prompts SpecBranch ran 2.49 / 2.63 /
# 2.72× ar at T=0 and 2.30 / 2.60 / 2.38× at T=1 with γ 6 / 8 / 10).
# SpecBranch's hold (§0i): 0.5 for a distilled draft (tuning prompts: 1.01× PEARL at T=1 against 0.86× without, a
# tie at T=0, path rollback halved); 0 for the 4-bit self-draft, which it only slowed (0.71-0.75× PEARL)
# The hold on a fork's branches (§0q) cut path rollback at the same speed with the weak draft (benchmark split,
# foreign prompts: 0.42× PEARL's against 0.51× without, 1.16× PEARL's speed either way) and with the layer-skipping
# self-draft (tuning prompts), but cost the distilled draft 7 % at T=0 on the tuning prompts: on for the first two
DEFAULTS = {"gamma": 3, "epsilon": 0.5, "draft_stop": 0.3, "feed_stop": 0.0, "head_start": 0.3, "hold": 0.5,
            "hold_branches": False, "hrad": False}
HOLD_BRANCHES_DEFAULTS = {**DEFAULTS, "hold_branches": True}
SELF_DEFAULTS = {"gamma": 8, "epsilon": 0.1, "draft_stop": 0.0, "feed_stop": 0.0, "head_start": 0.02, "hold": 0.0,
                 "hold_branches": False, "hrad": False}

# H-RAD ships off: on held-out prompts it placed branch points no better than the draft's confidence alone
# (classification and speed, docs/RESULTS.md §0b); the checkbox says so where the user decides
HRAD_LABEL = ("H-RAD (classifier places branch points). Off by default: on held-out prompts it was no faster "
              "than confidence only (docs/RESULTS.md §0b)")


HOLD_BRANCHES_LABEL = ("Hold the branches too (SpecBranch, with a hold): a branch step that would take the first "
                       "branch's odds below the hold keeps nothing. On by default for embedded-weak and self-skip "
                       "drafts: it cut path rollback at the same speed; off for the distilled draft, which it made 7 % "
                       "slower at T=0 (docs/RESULTS.md §0q)")


def defaults_for(draft: str | None) -> dict:
    """The sliders' starting values for the draft spec the app serves."""
    if draft == "self":
        return SELF_DEFAULTS
    if draft == "embedded-weak" or is_skip_draft(draft):
        return HOLD_BRANCHES_DEFAULTS
    return DEFAULTS


SLIDER_KEYS = ("gamma", "epsilon", "draft_stop", "feed_stop", "head_start", "hold", "hold_branches", "hrad")


def slider_defaults(draft: str | None) -> list:
    """The settings sliders (SLIDER_KEYS, in order) set to a newly picked draft's defaults."""
    return [gr.update(value=defaults_for(draft)[key]) for key in SLIDER_KEYS]


DRAFT_LABEL = "Draft (loaded on first use; picking one sets the sliders to the settings the bench chose for its kind)"


def examples() -> list[list]:
    from engine.datasets import benchmark_prompts

    out = [[p.text, p.chat] for p in benchmark_prompts("mt_bench", 3)]
    out += [[p.text, p.chat] for p in benchmark_prompts("gsm8k", 2)]
    out += [[p.text, p.chat] for p in benchmark_prompts("humaneval", 1)]
    return out


def make_config(method, max_new, temperature, top_p, gamma, branches, epsilon, draft_stop, feed_stop, head_start,
                hold, hold_branches, hrad, seed) -> GenerationConfig:
    """Build and validate settings from the controls; raises SpecBranchError with the reason."""
    def number(value, name, cast):
        try:
            return cast(value)
        except (TypeError, ValueError):
            raise SpecBranchError(f"{name} must be a number, got {value!r}") from None
    return GenerationConfig(method=method, max_new_tokens=number(max_new, "max new tokens", int),
                            temperature=number(temperature, "temperature", float),
                            top_p=number(top_p, "top-p", float), gamma=number(gamma, "γ", int),
                            branches=number(branches, "branches k", int), epsilon=number(epsilon, "ε", float),
                            draft_stop=number(draft_stop, "draft stop", float),
                            feed_stop=number(feed_stop, "feed stop", float),
                            head_start=number(head_start, "head start", float), hold=number(hold, "hold", float),
                            hold_branches=bool(hold_branches), hrad=bool(hrad),
                            seed=number(seed, "seed", int)).validate()


def message_text(message: dict) -> str:
    """A chat message's text (Gradio may hand content back as a list of typed parts)."""
    c = message.get("content")
    return c if isinstance(c, str) else "".join(p.get("text", "") for p in c or [] if isinstance(p, dict))


def notice_html(events: list[Event], error: str | None = None, warning: str | None = None) -> str:
    notes = [f'<div class="notice notice-{html.escape(e.level)}">{html.escape(e.message)}</div>'
             for e in events if isinstance(e, Notice)]  # a replayed Notice may come from an imported file
    if warning:
        notes.append(f'<div class="notice notice-warning">{html.escape(warning)}</div>')
    if error:
        notes.append(f'<div class="notice notice-error">{html.escape(error)}</div>')
    return "".join(notes)


def highlight_of(events: list[Event], step: int | None):
    """(step, start, end) for the timeline's shading of the selected step, where the step has a time."""
    span = step_times(events).get(step) if step is not None else None
    return None if span is None else (step, *span)


def views_at(events: list[Event], step: int | None = None, warning: str | None = None, show_rollbacks: bool = False,
             ar_speed: float | None = None, whole: list[Event] | None = None):
    """Every view of a (possibly partial) event stream: live and replay render through this. In order:
    token view, metric panel, notices, at-a-glance line, branch tree, timeline, step strip, acceptance,
    cumulative. step None: the last step. whole: the whole run, when `events` is a prefix of it (Replay
    at a step): its step strip still offers every step."""
    steps = replay_steps(events)
    step = step if step in steps else (steps[-1] if steps else None)
    return (token_view(events, show_rollbacks), metric_panel(events), notice_html(events, warning=warning),
            glance_html(events, ar_speed), tree_html(events, step),
            timeline_figure([events], highlight_of(events, step)),
            step_strip(whole or events, step), acceptance_figure(compute_metrics(events)), cumulative_figure(events))


def skips(n: int) -> tuple:
    return (gr.skip(),) * n


def no_store(reason: str):
    return lambda: (None, reason)


def build_app(get_engine, get_store=None, defaults: dict | None = None, about: str = "",
              drafts: list[tuple[str, str]] | None = None) -> gr.Blocks:
    """get_engine(draft) returns the loaded Engine for a draft spec, one of `drafts` (None: the app's own), each
    loaded once, lazily; get_store() returns (sessions.Store | None, reason) for recording and replay (None: nothing
    is recorded); defaults: the sliders' starting values (defaults_for the draft the app serves; DEFAULTS if not
    given); about: a line under the title (the pair the app serves), shown as text; drafts: (what the menu says,
    draft spec) for each draft a visitor may pick, the app's own first (None: no choice). A pick outside them is
    refused: a spec can name a path or a hub id, so a visitor never types one."""
    get_store = get_store or no_store("recording is off")
    defaults = {**DEFAULTS, **(defaults or {})}

    specs = [spec for _, spec in drafts or []]

    def engine_for(draft):
        if drafts and draft not in specs:
            raise SpecBranchError(f"unknown draft {str(draft)!r}; choose one of {', '.join(specs)}")
        return get_engine(draft if drafts else None)

    def start_recording(owner, prompt, engine, cfg):
        """(recorder or None, message). Never raises: a broken store only means 'not recording'."""
        from sessions import Recorder, SessionStoreError

        store, reason = get_store()
        if store is None:
            return Recorder.disabled(reason), None
        pair = engine.pair
        try:
            sid = store.start_session(owner, prompt, pair.target.name, pair.draft.name if pair.draft else None, cfg)
        except SessionStoreError as exc:
            return Recorder.disabled(str(exc)), None
        return store.recorder(sid), sid

    def ar_speed_of(owner, prompt, engine):
        """tokens/s of this browser's latest stored AR run of the same prompt on the same pair, if any."""
        store, _ = get_store()
        pair = engine.pair
        return stored_ar_speed(store, owner, prompt, (pair.target.name, pair.draft.name if pair.draft else None))

    def generate(prompt, history, method, max_new, temperature, top_p, gamma, branches, epsilon, draft_stop, feed_stop,
                 head_start, hold, hold_branches, hrad, seed, chat,
                 browser_id=None, show_rollbacks=False, draft=None, request: gr.Request = None):
        history = list(history or [])
        events: list[Event] = []
        try:
            cfg = make_config(method, max_new, temperature, top_p, gamma, branches, epsilon, draft_stop, feed_stop,
                              head_start, hold, hold_branches, hrad, seed)
            if not prompt or not prompt.strip():
                raise SpecBranchError("the prompt is empty")
            engine = engine_for(draft)
            turns = [{"role": m["role"], "content": message_text(m)} for m in history if message_text(m)]
            ids = engine.encode(prompt, bool(chat), history=turns)
            engine.check_prompt(ids)
        except SpecBranchError as exc:
            yield (history, *skips(2), notice_html([], str(exc)), *skips(VIEWS - 3 + 2), events)
            return
        except Exception as exc:  # a model that fails to load: say so, keep serving
            yield (history, *skips(2), notice_html([], f"could not load the models: {exc}"), *skips(VIEWS - 3 + 2),
                   events)
            return
        history += [{"role": "user", "content": prompt}, {"role": "assistant", "content": ""}]
        text, last_plot, tokens_seen = "", 0.0, 0
        owner = owner_of(browser_id, request)
        ar_speed = ar_speed_of(owner, prompt, engine)  # before this run is stored: an AR run is not its own baseline
        recorder, _ = start_recording(owner, prompt, engine, cfg)

        def everything(warning=None):
            steps = replay_steps(events)
            return (history, *views_at(events, None, warning, show_rollbacks, ar_speed),
                    slider_update(steps, steps[-1] if steps else None), "", events)

        try:
            for event in stream_events(engine, ids, cfg, prompt):
                events.append(event)
                recorder.add(event)
                if isinstance(event, TokensEmitted):
                    text += event.text
                    tokens_seen += len(event.tokens)
                    history[-1] = {"role": "assistant", "content": text}  # the chat holds the answer text only
                    if time.perf_counter() - last_plot > 1.0:  # long outputs stay responsive: plots ~1/s
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

    def show_step(requested, events):
        """The navigator's step: the tree, the timeline's shading and the strip follow it."""
        events = events or []
        step, notice = clamp_step(requested, replay_steps(events))
        if step is None:
            return slider_update([], None), notice_of("no steps yet: generate something first"), *skips(3)
        return (slider_update(replay_steps(events), step), notice_of(notice), tree_html(events, step),
                timeline_figure([events], highlight_of(events, step)), step_strip(events, step))

    def rerender_tokens(show_rollbacks, events):
        return token_view(events or [], bool(show_rollbacks))

    def compare(prompt, methods, max_new, temperature, top_p, gamma, branches, epsilon, draft_stop, feed_stop,
                head_start, hold, hold_branches, hrad, seed, chat,
                browser_id=None, draft=None, request: gr.Request = None):
        """Run each chosen method once, one after another (clean timings); the race then replays them."""
        try:
            if not methods or len(methods) < 2:
                yield NEEDS_TWO, "", "", []
                return
            if not prompt or not prompt.strip():
                raise SpecBranchError("the prompt is empty")
            cfgs = [make_config(m, max_new, temperature, top_p, gamma, branches, epsilon, draft_stop, feed_stop,
                                head_start, hold, hold_branches, hrad, seed) for m in methods]
            engine = engine_for(draft)
            ids = engine.encode(prompt, bool(chat))
            engine.check_prompt(ids)
        except SpecBranchError as exc:
            yield notice_html([], str(exc)), "", "", []
            return
        recorder, sid = start_recording(owner_of(browser_id, request), prompt, engine, cfgs[0])
        runs = []
        for i, cfg in enumerate(cfgs):  # one stored session, one run per method
            yield ("", f'<div class="race-status">running {html.escape(cfg.method)} ({i + 1} of {len(cfgs)}): the '
                   f'methods run one after another so each is timed alone; then they race</div>', "", [])
            if sid is not None and runs:
                recorder = get_store()[0].recorder(sid)
            try:
                runs.append([])
                for event in stream_events(engine, ids, cfg, prompt):
                    runs[-1].append(event)
                    recorder.add(event)
            finally:
                recorder.close()
        note = f'<div class="notice notice-warning">not recording: {html.escape(recorder.error)}</div>' \
            if recorder.error else ""
        yield note, gr.skip(), gr.skip(), runs

    def race(runs):
        """The recorded runs side by side on one clock (no engine needed: this does not queue behind generation)."""
        if not runs or len(runs) < 2:
            return
        yield from race_updates(runs, lambda rs: comparison_table(rs, all(is_greedy(r) for r in rs)))

    with gr.Blocks(title="SpecBranch Studio") as demo:
        gr.Markdown("# SpecBranch Studio\nSpeculative decoding, made visible: every token is coloured by where it "
                    "came from, every forward pass is on the timeline.")
        if about:
            gr.HTML(f'<div class="about">{html.escape(about)}</div>')
        if drafts:
            draft = gr.Dropdown(drafts, value=specs[0], label=DRAFT_LABEL, elem_id="draft")
        else:
            draft = gr.State(None)
        events_state = gr.State([])
        browser = browser_id_state()
        with gr.Tab("Live"):
            with gr.Row():
                with gr.Column(scale=1, min_width=320):
                    method = gr.Dropdown(LIVE_METHODS, value="specbranch", label="Method", elem_id="live-method")
                    max_new = gr.Slider(1, 2048, value=128, step=1, label="Max new tokens (1–2048)",
                                        elem_id="max-new")
                    temperature = gr.Slider(0, 2, value=0, step=0.05, label="Temperature (0 = greedy, ≥ 0)")
                    top_p = gr.Slider(0.01, 1, value=1, step=0.01, label="Top-p, in (0, 1]")
                    gamma = gr.Slider(1, 16, value=defaults["gamma"], step=1, elem_id="gamma",
                                      label="γ: SD block length; PEARL/SpecBranch: tokens verified per round (1–16)")
                    branches = gr.Slider(1, 6, value=3, step=1, label="k: most branches at a branch point (1–6)")
                    epsilon = gr.Slider(0, 1, value=defaults["epsilon"], step=0.05, elem_id="epsilon",
                                        label="ε: branch where the draft's token is accepted less often than "
                                              "this: its confidence, read as the acceptance this engine measured "
                                              "at it [0, 1]")
                    draft_stop = gr.Slider(0, 1, value=defaults["draft_stop"], step=0.05, elem_id="draft-stop",
                                           label="Draft stop: end a round's drafting below this confidence (0 = off)")
                    feed_stop = gr.Slider(0, 1, value=defaults["feed_stop"], step=0.05, elem_id="feed-stop",
                                          label="Feed stop: verify drafted tokens only while the draft's odds that all "
                                                "are accepted stay above this (0 = up to γ)")
                    head_start = gr.Slider(0, 1, value=defaults["head_start"], step=0.01, elem_id="head-start",
                                           label="Head start: after a rejection, the draft leads the target's next "
                                                 "pass while its odds that the block is accepted stay above this "
                                                 "(0 = off, the target starts at once as in PEARL)")
                    hold = gr.Slider(0, 1, value=defaults["hold"], step=0.05, elem_id="hold",
                                     label="Hold (SpecBranch): draft nothing where the odds that it is accepted, the "
                                           "pending tokens' included, fall below this; the target takes that token "
                                           "itself (0 = off)")
                    hold_branches = gr.Checkbox(defaults["hold_branches"], label=HOLD_BRANCHES_LABEL,
                                                elem_id="hold-branches")
                    hrad = gr.Checkbox(defaults["hrad"], label=HRAD_LABEL, elem_id="hrad")
                    seed = gr.Number(0, precision=0, label="Seed (integer)")
                    chat = gr.Checkbox(True, label="Chat template (off: raw text, e.g. code completion)")
                with gr.Column(scale=2):
                    chatbot = gr.Chatbot(label="Chat (the answer text)", height=320, sanitize_html=True,
                                         elem_id="chatbot")
                    prompt = gr.Textbox(label="Prompt", lines=2, placeholder="Ask something…", elem_id="prompt")
                    with gr.Row():
                        send = gr.Button("Generate", variant="primary", elem_id="generate")
                        stop = gr.Button("Stop", variant="stop", elem_id="stop")
                    gr.Examples(examples(), [prompt, chat], label="Example prompts (benchmark split)")
                    notices = gr.HTML(elem_id="notices")
                    glance = gr.HTML(elem_id="glance")
                    gr.HTML(LEGEND)
                    show_rollbacks = gr.Checkbox(False, label="Show all rollbacks (else click a ↶ marker)",
                                                 elem_id="show-rollbacks")
                    tokens = gr.HTML(elem_id="token-view")
                    metrics = gr.HTML(elem_id="metric-panel")
            gr.Markdown("### Branch tree of a step\nPick a step with the buttons, the slider, or a marker under the "
                        "timeline; the tree and the timeline's shading follow.")
            nav = build_navigator("step")
            tree = gr.HTML(elem_id="tree-view")
            timeline = gr.Plot(label="Bubble timeline", elem_id="timeline-plot")
            nav.add_strip()
            with gr.Row():
                acceptance = gr.Plot(label="Acceptance", elem_id="acceptance-plot")
                cumulative = gr.Plot(label="Drafted / accepted / rolled back", elem_id="cumulative-plot")
        with gr.Tab("Compare"):
            gr.Markdown("Run several methods on one prompt and seed, one after the other (so each is timed alone), "
                        "then watch them **race** side by side from their recorded events, each at its measured "
                        "speed. Speedups are against `ar` from the same comparison.")
            c_prompt = gr.Textbox(label="Prompt", lines=2, value="Explain how a hash map works.",
                                  elem_id="compare-prompt")
            c_methods = gr.CheckboxGroup(COMPARE_METHODS, value=COMPARE_METHODS, label="Methods (two or more)",
                                         elem_id="compare-methods")
            c_run = gr.Button("Compare", variant="primary", elem_id="compare")
            c_runs = gr.State([])
            c_notice = gr.HTML(elem_id="compare-notice")
            c_race = gr.HTML(elem_id="compare-race")
            c_table = gr.HTML(elem_id="compare-table")
            c_timeline = gr.Plot(label="Timelines, one axis", elem_id="compare-timeline")
        build_replay_tab(get_store, views_at, browser)
        with gr.Tab("How to read this"):
            gr.Markdown(TEACHING)

        controls = [max_new, temperature, top_p, gamma, branches, epsilon, draft_stop, feed_stop, head_start, hold,
                    hold_branches, hrad, seed, chat]
        views = [tokens, metrics, notices, glance, tree, timeline, nav.strip, acceptance, cumulative]
        outputs = [chatbot, *views, nav.slider, nav.notice, events_state]
        demo.load(browser_identity, browser, browser, api_visibility="private")
        live = [prompt, chatbot, method, *controls, browser, show_rollbacks, draft]
        run_event = send.click(generate, live, outputs, concurrency_limit=1, concurrency_id="engine")
        submit_event = prompt.submit(generate, live, outputs, concurrency_limit=1, concurrency_id="engine")
        stop.click(None, cancels=[run_event, submit_event])
        wire_navigator(nav, show_step, [events_state], [nav.slider, nav.notice, tree, timeline, nav.strip])
        show_rollbacks.change(rerender_tokens, [show_rollbacks, events_state], tokens)
        if drafts:  # a draft brings the settings the bench chose for its kind
            settings = {"gamma": gamma, "epsilon": epsilon, "draft_stop": draft_stop, "feed_stop": feed_stop,
                        "head_start": head_start, "hold": hold, "hold_branches": hold_branches, "hrad": hrad}
            draft.change(slider_defaults, draft, [settings[key] for key in SLIDER_KEYS], api_visibility="private")
        c_run.click(compare, [c_prompt, c_methods, *controls, browser, draft], [c_notice, c_race, c_table, c_runs],
                    concurrency_limit=1, concurrency_id="engine").then(race, [c_runs], [c_race, c_table, c_timeline])
    return demo


def comparison_table(runs: list[list[Event]], greedy: bool) -> str:
    results = []
    for events in runs:
        m = metrics_of(events)
        ids = [t for e in events if isinstance(e, TokensEmitted) for t in e.tokens]
        results.append((events[0].method, m, ids))
    base = next((m["tokens_per_s"] for name, m, _ in results if name == "ar"), None)
    reference = results[0][2]
    rows = []
    for name, m, ids in results:
        speed = f"{m['tokens_per_s'] / base:.2f}×" if base else "–"
        same = ("identical" if ids == reference else "DIFFERENT") if greedy else "(sampled)"
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in (
            name, f"{m['tokens_per_s']:.1f}", speed, fmt(m["mean_accepted_length"]), fmt(m["acceptance_rate"]),
            fmt(m["path_rollback_rate"]), fmt(m["wasted_draft_rate"]), fmt(m["overlap"]),
            fmt(m["draft_alone_fraction"]), fmt(m.get("pace")), fmt(m.get("no_waste_headroom")), same)) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("method", "tokens/s", "speedup vs ar", "tokens per target forward",
                                               "acceptance", "path rollback", "wasted draft", "overlap",
                                               "target waits on the draft", "pace", "no-waste headroom",
                                               "output vs first"))
    note = "" if greedy else "<p>Sampled runs differ by design; compare their statistics, not their text.</p>"
    return f'<table class="compare-table"><tr>{head}</tr>{"".join(rows)}</table>{note}'


def css_paths() -> list[str]:
    return [str(STATIC / "app.css")]
