"""The step navigator the Live and Replay tabs share: previous / next buttons, a slider and a strip of
clickable step markers on the run's measured clock. Each selects one step; the branch tree and the
timeline follow it. A step out of range (typed, stale, or past either end) is clamped, with a notice."""

from __future__ import annotations

import html
from dataclasses import dataclass

import gradio as gr

from engine.events import BranchResolved, Event, Rollback, StepStarted, TimingSpan, TokensEmitted

# Gradio 6 gr.HTML runs this once per page: one listener on the component, so re-rendered markers keep working.
STRIP_JS = (
    "element.addEventListener('click', (e) => { const m = e.target.closest('[data-step]'); "
    "if (m) trigger('click', {step: Number(m.dataset.step)}); });"
)


def clamp_step(requested, steps: list[int]) -> tuple[int | None, str]:
    """(the step to show, a notice when the request was outside the run's steps)."""
    if not steps:
        return None, ""
    try:
        want = int(requested)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an infinite step
        return steps[-1], f"step {str(requested)!r:.40} is not a number: showing step {steps[-1]}"
    if want < steps[0]:
        return steps[0], (
            f"there is no step {want}: this run's steps are {steps[0]}–{steps[-1]}; showing step {steps[0]}"
        )
    if want > steps[-1]:
        return steps[-1], (
            f"there is no step {want}: this run's steps are {steps[0]}–{steps[-1]}; showing step {steps[-1]}"
        )
    return want, ""


def step_beside(index, by: int):
    """The step `by` away from the slider's `index`; a value that is no step number passes through unchanged, so
    that clamp_step says so (a slider sends a number; a hand-made request may send anything)."""
    try:
        return int(float(index)) + by
    except (TypeError, ValueError, OverflowError):
        return index


def step_times(events: list[Event]) -> dict[int, tuple[float, float]]:
    """Each step's span on the run's clock: its forward passes where it has any, else from its start
    to the next step's start."""
    starts = {e.step: e.t for e in events if isinstance(e, StepStarted)}
    spans: dict[int, list[TimingSpan]] = {}
    for e in events:
        if isinstance(e, TimingSpan):
            spans.setdefault(e.step, []).append(e)
    order = sorted(starts)
    out = {}
    for i, step in enumerate(order):
        mine = spans.get(step)
        if mine:
            out[step] = (min([starts[step], *(s.start for s in mine)]), max(s.end for s in mine))
        else:
            end = starts[order[i + 1]] if i + 1 < len(order) else starts[step]
            out[step] = (starts[step], end)
    return out


def step_outcome(events: list[Event], step: int) -> tuple[str, str]:
    """(css class, hover text) of a step marker: did the step roll anything back, did a branch rescue it."""
    mine = [e for e in events if getattr(e, "step", None) == step]
    committed = sum(len(e.tokens) for e in mine if isinstance(e, TokensEmitted))
    dropped = sum(len(e.tokens) for e in mine if isinstance(e, Rollback) and e.model == "draft")
    rescued = any(isinstance(e, BranchResolved) and e.rescued for e in mine)
    kind = "rescued" if rescued else ("rollback" if dropped else "clean")
    title = f"step {step}: {committed} committed, {dropped} rolled back" + (", rescued by a branch" if rescued else "")
    return kind, title


def step_strip(events: list[Event], selected: int | None) -> str:
    """One clickable marker per step, placed and sized by its measured time (a thin one still gets 3 px)."""
    times = step_times(events)
    if not times:
        return '<div class="step-strip empty">no steps yet</div>'
    t0 = min(a for a, _ in times.values())
    span = max(b for _, b in times.values()) - t0 or 1.0
    marks, forks = [], {e.step for e in events if isinstance(e, BranchResolved)}
    for step, (a, b) in sorted(times.items()):
        kind, title = step_outcome(events, step)
        chosen = " selected" if step == selected else ""
        fork = ' data-fork="true"' if step in forks else ""
        marks.append(
            f'<button type="button" class="step-mark mark-{kind}{chosen}" data-step="{step}"{fork} '
            f'style="left:{100 * (a - t0) / span:.3f}%;width:max(3px, {100 * (b - a) / span:.3f}%)" '
            f'title="{html.escape(title)}">{step}</button>'
        )
    return (
        f'<div class="step-strip-wrap"><div class="step-strip-axis">steps on the measured clock '
        f'({1000 * span:.0f} ms): click one</div><div class="step-strip">{"".join(marks)}</div></div>'
    )


def slider_update(steps: list[int], step: int | None):
    return gr.update(minimum=1, maximum=max(2, len(steps)), value=step if step is not None else 1)


def notice_of(text: str) -> str:
    return f'<div class="notice notice-warning">{html.escape(text)}</div>' if text else ""


@dataclass
class Navigator:
    prefix: str
    prev: gr.Button
    slider: gr.Slider
    next: gr.Button
    notice: gr.HTML
    strip: gr.HTML | None = None

    def add_strip(self) -> gr.HTML:
        """The clickable step markers, laid out where this is called (under the timeline)."""
        self.strip = gr.HTML(elem_id=f"{self.prefix}-strip", js_on_load=STRIP_JS)
        return self.strip


def build_navigator(prefix: str) -> Navigator:
    """The buttons and the slider, laid out where this is called; element ids start with `prefix`."""
    with gr.Row():
        prev = gr.Button("◀ Previous", scale=1, min_width=100, size="sm", elem_id=f"{prefix}-prev")
        slider = gr.Slider(1, 2, value=1, step=1, label="Step", scale=8, elem_id=f"{prefix}-slider")
        nxt = gr.Button("Next ▶", scale=1, min_width=100, size="sm", elem_id=f"{prefix}-next")
    notice = gr.HTML(elem_id=f"{prefix}-notice")
    return Navigator(prefix, prev, slider, nxt, notice)


def wire_navigator(nav: Navigator, render, inputs: list, outputs: list) -> None:
    """render(requested_step, *inputs) -> outputs; every control of the navigator asks for one step."""

    def on_prev(index, *args):
        return render(step_beside(index, -1), *args)

    def on_next(index, *args):
        return render(step_beside(index, +1), *args)

    def on_slide(index, *args):
        return render(index, *args)

    def on_mark(evt: gr.EventData, *args):
        return render(getattr(evt, "step", None) if evt is not None else None, *args)

    api = nav.prefix.replace("-", "_")
    nav.prev.click(on_prev, [nav.slider, *inputs], outputs, api_name=f"{api}_prev")
    nav.next.click(on_next, [nav.slider, *inputs], outputs, api_name=f"{api}_next")
    nav.slider.release(on_slide, [nav.slider, *inputs], outputs, api_name=f"{api}_slide")
    nav.strip.click(on_mark, inputs, outputs, api_name=f"{api}_mark", api_visibility="private")  # the browser's
