"""The app's page: a title, the draft menu, and the tabs (app/tabs/), each building its UI and wiring its events.
Everything shown is computed from the engine's event stream (app/render.py)."""

from __future__ import annotations

import asyncio
import html
import os
from pathlib import Path

import gradio as gr

from .context import AppContext, no_store
from .identity import browser_id_state, browser_identity
from .settings import count_setting, defaults_for
from .tabs.compare import CompareTab
from .tabs.how_to_read import HowToReadTab
from .tabs.live import LiveTab
from .tabs.replay import ReplayTab

STATIC = Path(__file__).resolve().parent.parent / "static"
# launch(show_error=...): a request gradio itself refuses (a number where a slider's value goes, a malformed chat
# history) gets gradio's message, which names the input, instead of "the upstream app has raised an exception"; the
# handlers catch their own errors and say what is wrong in a notice, so nothing else reaches this
SHOW_ERROR = True
ENGINE = "engine"  # the concurrency id of every endpoint that runs the engine (Live's Generate, Compare's Compare)
DEFAULT_MAX_QUEUE = 32
MAX_QUEUE_ENV = "SPECBRANCH_MAX_QUEUE"
OTHERS_PER_ENGINE_SLOT = 4  # gradio's own bound, on events of every endpoint, is this many times the engine's
BUSY = (
    "The app is busy: {waiting} runs are already waiting for the engine (at most {bound} may wait). Please try "
    "again in a minute."
)
DRAFT_INFO = "loaded on first use; picking one sets the Advanced settings to the ones chosen for its kind"
TABS = (LiveTab, CompareTab, ReplayTab, HowToReadTab)  # in page order; Compare reads the controls Live builds


def build_app(
    get_engine,
    get_store=None,
    defaults: dict | None = None,
    about: str = "",
    drafts: list[tuple[str, str]] | None = None,
) -> gr.Blocks:
    """The whole page (AppContext says what each argument is); about: a line under the title, shown as text."""
    ctx = AppContext(
        get_engine, get_store or no_store("recording is off"), {**defaults_for(None), **(defaults or {})}, drafts
    )
    with gr.Blocks(title="SpecBranch Studio") as demo:
        with gr.Row(equal_height=False):  # the title and the draft menu side by side: more of the run on screen
            with gr.Column(scale=3):
                gr.Markdown(
                    "# SpecBranch Studio\nSpeculative decoding, made visible: every token is coloured by "
                    "where it came from, every forward pass is on the timeline."
                )
                if about:
                    gr.HTML(f'<div class="about">{html.escape(about)}</div>')
            with gr.Column(scale=2, min_width=320):
                ctx.draft = (
                    gr.Dropdown(drafts, value=ctx.specs[0], label="Draft", elem_id="draft", info=DRAFT_INFO)
                    if drafts
                    else gr.State(None)
                )
        ctx.browser = browser_id_state()
        tabs = [tab(ctx) for tab in TABS]
        for tab in tabs:
            tab.create_ui()
        demo.load(browser_identity, ctx.browser, ctx.browser, api_visibility="private")
        for tab in tabs:
            tab.create_event_handlers()
    return demo


def css_paths() -> list[str]:
    return [str(STATIC / "app.css")]


def max_queue_from(value: str | int | None) -> int:
    """The engine queue's bound from a setting (count_setting)."""
    return count_setting(value, DEFAULT_MAX_QUEUE, MAX_QUEUE_ENV)


def bounded_queue(demo: gr.Blocks, max_size: int | None = None) -> gr.Blocks:
    """The app's queue: one request at a time per endpoint (the engine's endpoints share one slot, ENGINE), and at most
    `max_size` requests (default $SPECBRANCH_MAX_QUEUE, else DEFAULT_MAX_QUEUE) waiting for the engine; the one it is
    running does not count. A request past the bound is refused at once with HTTP 503 and the BUSY message (a browser
    shows "This application is currently busy. Please try again."; gradio_client raises QueueError "Queue is full!
    Please try again."). Requests of other endpoints (Replay, the navigator) never wait behind the engine; gradio's own
    bound, OTHERS_PER_ENGINE_SLOT times as large, holds them all with the same message."""
    bound = max_queue_from(os.environ.get(MAX_QUEUE_ENV) if max_size is None else max_size)
    demo.queue(default_concurrency_limit=1, max_size=OTHERS_PER_ENGINE_SLOT * bound)
    queue = demo._queue
    push, pushing = queue.push, asyncio.Lock()

    async def push_bounded(body, request, username):
        async with pushing:  # the count and the append, one request at a time: never past the bound
            waiting = queue.event_queue_per_concurrency_id.get(ENGINE)
            waiting = len(waiting.queue) if waiting is not None else 0
            if body.fn_index is not None and waiting >= bound and engine_endpoint(queue, body):
                return False, BUSY.format(waiting=waiting, bound=bound), "queue_full"
            ok, detail, state = await push(body, request, username)
            if state == "queue_full":
                detail = BUSY.format(waiting=len(queue), bound=queue.max_size)
            return ok, detail, state

    queue.push = push_bounded
    return demo


def engine_endpoint(queue, body) -> bool:
    """Whether a queued request is for an endpoint that runs the engine."""
    from gradio import route_utils

    try:
        return route_utils.get_fn(queue.blocks, None, body).concurrency_id == ENGINE
    except (KeyError, IndexError, ValueError):  # an unknown fn_index: gradio's own push refuses it
        return False
