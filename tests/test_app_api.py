"""The app through its HTTP API (gradio_client) on a launched server with tiny models: a streamed
generation returns tokens and the figures' data; bad input gets a message; token text is escaped."""

from __future__ import annotations

import re

import pytest

from app.views import token_view
from engine.events import Rollback, TokensEmitted

from .conftest import serve_app


@pytest.fixture(scope="module")
def client(tiny_engine, app_store):
    from gradio_client import Client

    demo, url = serve_app(tiny_engine, app_store)
    yield Client(url, verbose=False)
    demo.close()


ARGS = dict(
    history=[],
    method="specbranch",
    max_new=24,
    temperature=0,
    top_p=1,
    gamma=3,
    branches=3,
    epsilon=1.0,
    draft_stop=0.0,
    feed_stop=0.0,
    head_start=0.0,
    hold=0.0,
    hold_branches=False,
    hrad=True,
    seed=0,
    chat=False,
)
CONTROLS = (
    "max_new",
    "temperature",
    "top_p",
    "gamma",
    "branches",
    "epsilon",
    "draft_stop",
    "feed_stop",
    "head_start",
    "hold",
    "hold_branches",
    "hrad",
    "seed",
    "chat",
)


def controls(a: dict) -> list:
    """The Live tab's controls, in the order /generate takes them."""
    return [a[k] for k in CONTROLS]


def call(client, prompt, **overrides):
    a = {**ARGS, **overrides}
    job = client.submit(prompt, a["history"], a["method"], *controls(a), api_name="/generate")
    updates = list(job)
    return updates, job.outputs()[-1]


def value(update):
    """A component's value from an output that may be a gr.update(...) dict."""
    return update["value"] if isinstance(update, dict) else update


def content(message) -> str:
    c = message["content"]
    return c if isinstance(c, str) else "".join(part.get("text", "") for part in c)


def test_streamed_generation_returns_tokens_and_figures(client, tiny_engine):
    updates, final = call(client, "a b c")
    assert len(updates) >= 2  # streamed: intermediate updates before the final one
    history, tokens_html, metrics_html, notices, glance, tree, timeline, strip, acceptance, cumulative = final[:10]
    assert history[-1]["role"] == "assistant" and content(history[-1])
    assert 'class="tok tok-' in tokens_html
    assert "tokens per s" in metrics_html and "acceptance rate" in metrics_html
    assert "tokens per target forward" in glance and "vs AR" not in glance  # no AR run of this prompt yet
    assert '<svg class="branch-tree"' in tree and '<g class="node ' in tree  # the last step's tree
    assert strip.count('class="step-mark') >= 2
    for fig in (timeline, acceptance, cumulative):
        assert fig and fig.get("plot")  # plotly JSON for each figure
    assert "verify" in timeline["plot"] and "draft" in timeline["plot"]
    # same tokens as the engine gives directly
    from engine.config import GenerationConfig

    want = tiny_engine.run(
        tiny_engine.encode("a b c", False),
        GenerationConfig(method="specbranch", max_new_tokens=24, gamma=3, epsilon=1.0),
    ).text
    assert content(history[-1]) == want


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(temperature=-1), "Value -1 is less than minimum value 0."),
        (dict(top_p=0), "Value 0 is less than minimum value 0.01."),
        (dict(max_new=0), "Value 0 is less than minimum value 1."),
        (dict(gamma=99), "Value 99 is greater than maximum value 16."),
    ],
)
def test_out_of_range_controls_are_refused_and_the_app_keeps_serving(client, overrides, message):
    """gradio refuses a slider's value out of its range, by name, before the handler runs."""
    from gradio_client.exceptions import AppError

    a = {**ARGS, **overrides}
    job = client.submit("a b", a["history"], a["method"], *controls(a), api_name="/generate")
    with pytest.raises(AppError, match=re.escape(message)):
        job.result()
    _, final = call(client, "a b")
    assert content(final[0][-1])


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(temperature="-1"), "temperature must be >= 0"),
        (dict(top_p="1.5"), "top-p must be in (0, 1]"),
        (dict(max_new="zero"), "max new tokens must be a number"),
        (dict(epsilon="2"), "epsilon must be in [0, 1]"),
        (dict(branches="0"), "branches must be an integer >= 1"),
        (dict(draft_stop="1.5"), "draft-stop must be in [0, 1]"),
        (dict(feed_stop="-0.1"), "feed-stop must be in [0, 1]"),
        (dict(feed_stop="x"), "feed stop must be a number"),
        (dict(head_start="1.2"), "head-start must be in [0, 1]"),
        (dict(head_start="soon"), "head start must be a number"),
        (dict(hold="-1"), "hold must be in [0, 1]"),
        (dict(hold="much"), "hold must be a number"),
        (dict(hold_branches=True), "hold-branches needs a hold above 0"),
    ],
)
def test_settings_validation_messages(args, message):
    from app.settings import make_config
    from engine.config import SpecBranchError

    base = dict(
        method="specbranch",
        max_new=8,
        temperature=0,
        top_p=1,
        gamma=3,
        branches=3,
        epsilon=0.5,
        draft_stop=0.0,
        feed_stop=0.0,
        head_start=0.0,
        hold=0.0,
        hold_branches=False,
        hrad=True,
        seed=0,
    )
    with pytest.raises(SpecBranchError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        make_config(**{**base, **args})


def test_empty_prompt_gets_a_message(client):
    _, final = call(client, "   ")
    assert "prompt is empty" in final[3]


def test_holding_the_branches_reaches_the_engine_settings(client):
    """The "hold the branches too" checkbox is read: without a hold it is refused with the reason, and the app serves
    on; with one the run goes through."""
    _, final = call(client, "a b", hold=0.0, hold_branches=True)
    assert "hold-branches needs a hold above 0" in final[3]
    _, final = call(client, "a b", hold=0.3, hold_branches=True)
    assert content(final[0][-1])


def test_token_text_is_escaped():
    hostile = ["<script>alert(1)</script>", '<img src=x onerror="alert(2)">']
    events = [
        TokensEmitted(1, [5, 6], hostile, ["accepted", "correction"], "".join(hostile)),
        Rollback(1, "draft", [7], ["<b onmouseover=alert(3)>"], "rejected"),
    ]
    for out in (token_view(events), token_view(events, show_rollbacks=True)):
        assert "<script>" not in out and "<img" not in out and "<b " not in out
        assert "&lt;script&gt;" in out and "&lt;img" in out


def test_rolled_back_text_sits_behind_a_per_step_marker():
    events = [
        Rollback(1, "draft", [7, 8], ["x", "y"], "rejected"),
        TokensEmitted(1, [5], ["a"], ["correction"], "a"),
        Rollback(1, "target", [7], ["x"], "unverified positions"),  # the target's copy: not counted again
        TokensEmitted(2, [6], ["b"], ["bonus"], "b"),
    ]
    closed, opened = token_view(events), token_view(events, show_rollbacks=True)
    assert closed.count("<details") == 1 and "↶2</summary>" in closed and '<details class="rb">' in closed
    assert closed.index(">a</span>") < closed.index("<details") < closed.index(">b</span>")  # after its step's tokens
    assert '<details class="rb" open>' in opened


def test_the_glance_gives_a_speedup_only_against_a_stored_ar_run_of_the_same_prompt(client):
    _, final = call(client, "b c d e f", method="ar")
    assert "vs AR" not in final[4]  # an AR run is not its own baseline
    _, final = call(client, "b c d e f")
    assert "vs AR on this prompt" in final[4] and "×" in final[4]
    _, final = call(client, "b c d e f g")  # another prompt: no AR run, no speedup claimed
    assert "vs AR" not in final[4]


def test_the_navigator_moves_and_a_step_out_of_range_is_clamped_with_a_notice(client):
    _, final = call(client, "a b c")
    last = value(final[10])  # the slider sits on the last step
    slider, notice, tree, _, strip = client.predict(2, api_name="/step_slide")
    assert value(slider) == 2 and not notice and 'data-step="2"' in tree and 'selected" data-step="2"' in strip
    slider, notice, tree, _, _ = client.predict(2, api_name="/step_next")
    assert value(slider) == 3 and 'data-step="3"' in tree
    for api, at, clamped in (("/step_next", last, last), ("/step_prev", 1, 1)):  # past either end
        slider, notice, tree, _, strip = client.predict(at, api_name=api)
        assert value(slider) == clamped and "there is no step" in notice and f'data-step="{clamped}"' in tree


def test_live_runs_are_recorded_and_replayed_without_a_model(client, app_store):
    _, final = call(client, "a b c d e")
    history, tokens_html = final[0], final[1]
    sessions = app_store.list_sessions(search="a b c d e")
    assert sessions and sessions[0]["status"] == "complete"
    # replay through the app: search, open, and the replayed views equal the live ones
    client.predict("a b c d e", "", api_name="/search")
    client.predict(sessions[0]["id"], api_name="/open_session")
    replayed = client.predict(app_store.get_session(sessions[0]["id"])["runs"][0]["id"], False, api_name="/show_run")
    assert content(replayed[2][-1]) == content(history[-1])
    assert replayed[3] == tokens_html


def test_other_browser_sessions_do_not_see_private_runs(client, app_store):
    """The API client above is one browser session; a run stored by another owner stays invisible."""
    sid = app_store.start_session("someone-else", "private prompt zzz", "t", "d", {"method": "ar"})
    table, _, status = client.predict("private prompt zzz", "", api_name="/search")
    assert "no stored sessions" in status
    app_store.mark_shared(sid, "someone-else", True)
    table, _, status = client.predict("private prompt zzz", "", api_name="/search")
    assert "1 session" in status


def test_two_browser_sessions_each_see_their_own_stream(client, tiny_engine):
    from gradio_client import Client

    other = Client(client.src, verbose=False)
    a = ARGS | {"max_new": 16}
    jobs = [
        c.submit(p, [], a["method"], *controls(a | {"chat": False}), api_name="/generate")
        for c, p in ((client, "a b a b"), (other, "h g f e"))
    ]
    finals = [job.result() for job in jobs]
    assert [m["role"] for m in finals[0][0]] == ["user", "assistant"]  # only its own turn
    assert content(finals[0][0][0]) == "a b a b" and content(finals[1][0][0]) == "h g f e"
    from engine.config import GenerationConfig

    for prompt, final in zip(("a b a b", "h g f e"), finals):
        want = tiny_engine.run(
            tiny_engine.encode(prompt, False),
            GenerationConfig(method="specbranch", max_new_tokens=16, gamma=3, epsilon=1.0),
        ).text
        assert content(final[0][-1]) == want


def test_a_bad_import_is_refused_and_the_app_keeps_serving(client, app_store, tmp_path):
    import html
    import json

    from gradio_client import handle_file

    from sessions.export import export_session

    call(client, "c c d")
    doc = export_session(app_store, app_store.list_sessions(search="c c d")[0]["id"])
    finished = next(e for e in doc["runs"][0]["events"] if e["type"] == "finished")
    finished["metrics"]["tokens_per_s"] = "<img src=x onerror=alert(1)>"
    crafted = tmp_path / "crafted.json"
    crafted.write_text(json.dumps(doc))
    status = client.predict(handle_file(str(crafted)), api_name="/import_session")
    assert "<img" not in status  # the refusal quotes the bad value, as text
    assert "import refused" in status and "field 'tokens_per_s' should be float" in html.unescape(status)
    _, final = call(client, "a b")
    assert content(final[0][-1])


def test_a_browser_id_owns_its_runs_across_page_loads(client, app_store):
    """Two page loads of one browser are two Gradio sessions with the same stored id: both see its runs."""
    from gradio_client import Client

    from app.identity import browser_identity

    mine = browser_identity(None)
    a = ARGS | {"max_new": 8}
    client.submit("g g h", [], a["method"], *controls(a | {"chat": False}), mine, api_name="/generate").result()
    assert [s["prompt"] for s in app_store.list_sessions(owner=mine, include_shared=False)] == ["g g h"]
    for page in (client, Client(client.src, verbose=False)):
        _, _, status = page.predict("g g h", "", mine, api_name="/search")
        assert "1 session" in status
    _, _, status = client.predict("g g h", "", browser_identity(None), api_name="/search")
    assert "no stored sessions" in status


def test_app_defaults_follow_the_draft_and_the_pair_line_is_text(tiny_engine):
    """The sliders start at the settings the bench chose for the draft the app serves (docs/models.md for the
    target read in 4 bits), and the line naming the pair is text, never markup."""
    from app.main import build_app
    from app.settings import defaults_for
    from engine.kernels.lm_head import int4_supported
    from engine.presets import DISTILLED, OFTEN_WRONG, SELF, default_draft

    assert defaults_for("self") == SELF.settings() and defaults_for("embedded") == DISTILLED.settings()
    # the branches held too for the drafts where that cut path rollback at the same speed (docs/methods.md), not the
    # distilled one
    assert defaults_for("embedded-weak") == defaults_for("self-skip:3,4,5,25") == OFTEN_WRONG.settings()
    assert defaults_for(None) == defaults_for("/some/draft") == DISTILLED.settings()
    assert default_draft("cpu") == ("self" if int4_supported() else "embedded")
    for defaults, held in ((SELF.settings(), False), (DISTILLED.settings(), False), (OFTEN_WRONG.settings(), True)):
        demo = build_app(lambda draft=None: tiny_engine, defaults=defaults, about="target <b>x</b> · draft self")
        props = [c["props"] for c in demo.config["components"]]
        value = lambda elem_id: next(p["value"] for p in props if p.get("elem_id") == elem_id)
        assert value("gamma") == defaults["gamma"] and value("epsilon") == defaults["epsilon"]
        assert value("draft-stop") == defaults["draft_stop"] and value("head-start") == defaults["head_start"]
        assert value("hold") == defaults["hold"] and value("hold-branches") is defaults["hold_branches"] is held
        about = [p["value"] for p in props if 'class="about"' in str(p.get("value", ""))]
        assert about == ['<div class="about">target &lt;b&gt;x&lt;/b&gt; · draft self</div>']


def test_a_visitor_picks_a_draft_from_the_offered_ones_only(tiny_engine, app_store):
    """With drafts to pick from, a run goes to the engine of the draft picked (each loaded on first use, here two
    tiny engines on one target); a draft outside the list never reaches the engine loader (a spec can name a path);
    picking a draft sets the sliders to its kind's defaults."""
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    from app.settings import SLIDER_KEYS, slider_defaults
    from engine.config import GenerationConfig
    from engine.engine import Engine
    from engine.models.loading import with_draft
    from engine.presets import SELF

    own = Engine(with_draft(tiny_engine.pair.target, "self", draft_matmul="float32"))
    engines, asked = {"tiny-draft": tiny_engine, "self": own}, []

    def get_engine(draft):
        asked.append(draft)
        return engines[draft]

    demo, url = serve_app(get_engine, app_store, drafts=[(f"the {spec} draft", spec) for spec in engines])
    try:
        menu = next(c["props"] for c in demo.config["components"] if c["props"].get("elem_id") == "draft")
        assert [list(c) for c in menu["choices"]] == [
            ["the tiny-draft draft", "tiny-draft"],
            ["the self draft", "self"],
        ]
        assert menu["value"] == "tiny-draft"  # the app's own draft first
        client = Client(url, verbose=False)
        a = {**ARGS, "method": "sd"}
        job = client.submit("a b c", [], "sd", *controls(a), draft="self", api_name="/generate")
        history = list(job) and job.outputs()[-1][0]
        want = own.run(own.encode("a b c", False), GenerationConfig(method="sd", max_new_tokens=24, gamma=3))
        assert asked == ["self"] and content(history[-1]) == want.text
        assert own.pair.draft.model is tiny_engine.pair.target.model  # the target's own weights, loaded once
        job = client.submit("a b c", [], "sd", *controls(a), draft="/etc/passwd", api_name="/generate")
        with pytest.raises(AppError, match="not in the list of choices"):  # gradio checks the dropdown first
            job.result()
        # and the handler itself, called past gradio's check, refuses it with a notice
        generate = next(f.fn for f in demo.fns.values() if f.name == "generate")
        *_, last = generate("a b c", [], "sd", *controls(a), draft="/etc/passwd")
        assert "unknown draft" in last[3] and "choose one of tiny-draft, self" in last[3]
        assert asked == ["self"]
        assert [u["value"] for u in slider_defaults("self")] == [SELF.settings()[k] for k in SLIDER_KEYS]
        # ... into the sliders of those names, in that order
        ids = {c["id"]: c["props"].get("elem_id") for c in demo.config["components"]}
        picked = next(
            d
            for d in demo.config["dependencies"]
            if any(ids.get(target) == "draft" and event == "input" for target, event in d["targets"])
            and d["api_name"] == "slider_defaults"
        )
        assert [ids[o] for o in picked["outputs"]] == [key.replace("_", "-") for key in SLIDER_KEYS]
    finally:
        demo.close()
        own.close()
