"""The app's page: a title, the draft menu, and the tabs (app/tabs/), each building its UI and wiring its events.
Everything shown is computed from the engine's event stream (app/render.py)."""
from __future__ import annotations

import html
from pathlib import Path

import gradio as gr

from .context import AppContext, no_store
from .identity import browser_id_state, browser_identity
from .settings import DEFAULTS, DRAFT_LABEL
from .tabs.compare import CompareTab
from .tabs.how_to_read import HowToReadTab
from .tabs.live import LiveTab
from .tabs.replay import ReplayTab

STATIC = Path(__file__).resolve().parent.parent / "static"
TABS = (LiveTab, CompareTab, ReplayTab, HowToReadTab)  # in page order; Compare reads the controls Live builds


def build_app(get_engine, get_store=None, defaults: dict | None = None, about: str = "",
              drafts: list[tuple[str, str]] | None = None) -> gr.Blocks:
    """The whole page (AppContext says what each argument is); about: a line under the title, shown as text."""
    ctx = AppContext(get_engine, get_store or no_store("recording is off"), {**DEFAULTS, **(defaults or {})}, drafts)
    with gr.Blocks(title="SpecBranch Studio") as demo:
        gr.Markdown("# SpecBranch Studio\nSpeculative decoding, made visible: every token is coloured by where it "
                    "came from, every forward pass is on the timeline.")
        if about:
            gr.HTML(f'<div class="about">{html.escape(about)}</div>')
        ctx.draft = gr.Dropdown(drafts, value=ctx.specs[0], label=DRAFT_LABEL, elem_id="draft") if drafts \
            else gr.State(None)
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
