"""The Gradio app: a prompt, a method, and a live view of the engine's event stream."""
from __future__ import annotations

import html
from pathlib import Path

import gradio as gr

from engine.config import METHODS, GenerationConfig, SpecBranchError
from engine.events import Event, Finished, TokensEmitted

from .views import metric_panel, token_view

STATIC = Path(__file__).resolve().parent.parent / "static"
LEGEND = ('<div class="legend"><span class="tok tok-accepted">accepted</span><span class="tok tok-correction">'
          'correction</span><span class="tok tok-bonus">bonus</span><span class="tok tok-target">target</span>'
          '<span class="tok tok-rollback">rolled back</span></div>')


def build_app(get_engine) -> gr.Blocks:
    """get_engine() returns a loaded Engine (loaded once, lazily)."""

    async def generate(prompt, method, max_new_tokens, temperature, top_p, gamma, seed, chat):
        events: list[Event] = []
        text = ""
        try:
            engine = get_engine()
            cfg = GenerationConfig(method=method, max_new_tokens=int(max_new_tokens), temperature=float(temperature),
                                   top_p=float(top_p), gamma=int(gamma), seed=int(seed)).validate()
            ids = engine.encode(prompt, bool(chat))
            async for event in engine.generate(ids, cfg, prompt):
                events.append(event)
                if isinstance(event, TokensEmitted):
                    text += event.text
                    if len(events) % 8 == 0:
                        yield text, token_view(events), gr.skip()
                elif isinstance(event, Finished):
                    yield text, token_view(events), metric_panel(events)
        except SpecBranchError as exc:
            yield text, f'<div class="error">{html.escape(str(exc))}</div>', gr.skip()

    with gr.Blocks(title="SpecBranch Studio") as demo:
        gr.Markdown("# SpecBranch Studio\nSpeculative decoding, made visible. Each token is coloured by where it came from.")
        with gr.Row():
            with gr.Column(scale=2):
                prompt = gr.Textbox(label="Prompt", lines=3, value="Explain speculative decoding in two sentences.")
                with gr.Row():
                    method = gr.Dropdown(list(METHODS), value="sd", label="Method")
                    max_new = gr.Slider(1, 2048, value=128, step=1, label="Max new tokens (1–2048)")
                    temperature = gr.Slider(0, 2, value=0, step=0.05, label="Temperature (0 = greedy)")
                with gr.Row():
                    top_p = gr.Slider(0.01, 1, value=1, step=0.01, label="Top-p (0, 1]")
                    gamma = gr.Slider(1, 16, value=4, step=1, label="γ draft length (1–16)")
                    seed = gr.Number(0, precision=0, label="Seed")
                    chat = gr.Checkbox(True, label="Chat template")
                run = gr.Button("Generate", variant="primary")
            with gr.Column(scale=3):
                output = gr.Textbox(label="Output", lines=6)
                gr.HTML(LEGEND)
                tokens = gr.HTML(elem_id="token-view")
                metrics = gr.HTML(elem_id="metric-panel")
        run.click(generate, [prompt, method, max_new, temperature, top_p, gamma, seed, chat], [output, tokens, metrics],
                  concurrency_limit=1)
    return demo


def css_paths() -> list[str]:
    return [str(STATIC / "app.css")]
