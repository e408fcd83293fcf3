"""The Replay tab: list this browser's stored sessions (plus shared ones), re-render any run step by
step from its stored events (no model needed), compare stored runs, export, import and delete."""
from __future__ import annotations

import html
import json
import tempfile
import time
from pathlib import Path

import gradio as gr
import plotly.graph_objects as go

from engine.config import METHODS
from engine.events import RunStarted, TokensEmitted
from sessions import SessionStoreError
from sessions.export import chrome_trace_runs, export_json, import_json
from sessions.replay import compare_runs, events_up_to_step, replay_steps

from .figures import timeline_figure
from .views import fmt

EXPORT_DIR = Path(tempfile.gettempdir()) / "specbranch-exports"


def owner_of(request: gr.Request | None) -> str:
    """Each browser session is its own owner: it sees its own sessions and the shared ones."""
    return (request.session_hash if request is not None and request.session_hash else "anonymous")


def run_label(run: dict) -> str:
    return f"{run['method']} · {run['status']} · {run['id']}"


def chat_of(events) -> list[dict]:
    start = next((e for e in events if isinstance(e, RunStarted)), None)
    text = "".join(e.text for e in events if isinstance(e, TokensEmitted))
    return [{"role": "user", "content": start.prompt_text if start else ""}, {"role": "assistant", "content": text}]


def step_alignment_figure(runs, labels) -> go.Figure:
    fig = go.Figure()
    for events, label in zip(runs, labels):
        steps = replay_steps(events)
        counts, total = [], 0
        for s in steps:
            total += sum(len(e.tokens) for e in events if isinstance(e, TokensEmitted) and e.step == s)
            counts.append(total)
        fig.add_trace(go.Scatter(x=steps, y=counts, mode="lines+markers", name=label))
    fig.update_layout(title="Committed tokens by step (aligned by step)", height=300, xaxis_title="step",
                      yaxis_title="tokens committed", margin=dict(l=10, r=10, t=40, b=30))
    return fig


def compare_html(result: dict) -> str:
    keys = ["tokens_per_s", "mean_accepted_length", "acceptance_rate", "path_rollback_rate", "wasted_draft_rate",
            "overlap", "new_tokens"]
    head = "".join(f"<th>{html.escape(h)}</th>" for h in ["run", *keys, "speedup vs first"])
    rows = []
    for i, label in enumerate(result["labels"]):
        m, diff = result["metrics"][i], result["diffs"][i]
        cells = [html.escape(label)]
        for k in keys:
            d = diff.get(k)
            cells.append(fmt(m.get(k)) + ("" if i == 0 or d is None else f" ({'+' if d >= 0 else ''}{fmt(d)})"))
        cells.append(fmt(result["speedup"][i]))
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return f'<table class="compare-table"><tr>{head}</tr>{"".join(rows)}</table>'


def build_replay_tab(get_store, views_at) -> None:
    """get_store() -> (Store | None, error message); views_at(events, step) -> the live tab's views."""

    def store_or_raise():
        store, error = get_store()
        if store is None:
            raise SessionStoreError(f"no session store: {error}")
        return store

    def search(text, method, request: gr.Request):
        try:
            rows = store_or_raise().list_sessions(owner=owner_of(request), search=text or None, method=method or None)
        except SessionStoreError as exc:
            return gr.update(), gr.update(), f'<div class="notice notice-error">{html.escape(str(exc))}</div>'
        table = [[r["id"], time.strftime("%Y-%m-%d %H:%M", time.localtime(r["created"])), r["prompt"][:80],
                  ", ".join(r["methods"]), f"{r['target']} / {r['draft']}", r["status"],
                  "shared" if r["shared"] else ("mine" if r.get("mine") else "")] for r in rows]
        choices = [(f"{r['id']} · {r['prompt'][:40]}", r["id"]) for r in rows]
        return table, gr.update(choices=choices, value=choices[0][1] if choices else None), \
            f"{len(rows)} session(s)" if rows else "no stored sessions yet: generate something in the Live tab"

    def open_session(session_id, request: gr.Request):
        if not session_id:
            return gr.update(), gr.update(), {}, "pick a session"
        try:
            store = store_or_raise()
            session = store.get_session(session_id, owner_of(request))
            runs = {r["id"]: store.load_run_events(r["id"]) for r in session["runs"]}
        except SessionStoreError as exc:
            return gr.update(), gr.update(), {}, f'<div class="notice notice-error">{html.escape(str(exc))}</div>'
        choices = [(run_label(r), r["id"]) for r in session["runs"]]
        first = choices[0][1] if choices else None
        return (gr.update(choices=choices, value=first), gr.update(choices=choices, value=[c[1] for c in choices]),
                runs, f"opened {session_id}: {len(runs)} run(s)")

    def show_run(run_id, runs):
        events = (runs or {}).get(run_id)
        if not events:
            return (gr.skip(),) * 9
        steps = replay_steps(events)
        return (chat_of(events), *views_at(events, None), gr.update(maximum=max(2, len(steps)), value=len(steps)))

    def show_step(index, run_id, runs):
        events = (runs or {}).get(run_id)
        steps = replay_steps(events or [])
        if not steps:
            return (gr.skip(),) * 8
        step = steps[min(max(int(index), 1), len(steps)) - 1]
        prefix = events_up_to_step(events, step)
        return (chat_of(prefix), *views_at(prefix, step))

    def tick(index, run_id, runs):
        steps = replay_steps((runs or {}).get(run_id) or [])
        if not steps or int(index) >= len(steps):
            return gr.update(), gr.Timer(active=False)
        return int(index) + 1, gr.Timer(active=True)

    def compare(run_ids, runs):
        chosen = [(rid, runs[rid]) for rid in run_ids or [] if rid in (runs or {})]
        if len(chosen) < 2:
            return "pick two or more runs", gr.skip(), gr.skip()
        result = compare_runs([events for _, events in chosen])
        return (compare_html(result), timeline_figure([events for _, events in chosen]),
                step_alignment_figure([events for _, events in chosen], result["labels"]))

    def export(session_id, request: gr.Request):
        try:
            store = store_or_raise()
            text = export_json(store, session_id, owner_of(request))
            runs = store.load_session_events(session_id, owner_of(request))
        except SessionStoreError as exc:
            return None, None, f'<div class="notice notice-error">{html.escape(str(exc))}</div>'
        EXPORT_DIR.mkdir(parents=True, exist_ok=True)
        session_file = EXPORT_DIR / f"session-{session_id}.json"
        trace_file = EXPORT_DIR / f"session-{session_id}.trace.json"
        session_file.write_text(text)
        trace_file.write_text(json.dumps(chrome_trace_runs(runs)))
        return str(session_file), str(trace_file), "exported: the .trace.json opens in ui.perfetto.dev"

    def do_import(file, request: gr.Request):
        if file is None:
            return "choose a session .json exported from SpecBranch Studio"
        try:
            sid = import_json(store_or_raise(), Path(file).read_bytes(), owner_of(request))
        except SessionStoreError as exc:
            return f'<div class="notice notice-error">import refused: {html.escape(str(exc))}</div>'
        return f"imported as session {sid}"

    def delete(session_id, request: gr.Request):
        try:
            store_or_raise().delete_session(session_id, owner_of(request))
        except SessionStoreError as exc:
            return f'<div class="notice notice-error">{html.escape(str(exc))}</div>'
        return f"deleted {session_id} and its events"

    def share(session_id, shared, request: gr.Request):
        try:
            store_or_raise().mark_shared(session_id, owner_of(request), bool(shared))
        except SessionStoreError as exc:
            return f'<div class="notice notice-error">{html.escape(str(exc))}</div>'
        return f"{session_id} is now {'shared with everyone' if shared else 'private'}"

    with gr.Tab("Replay"):
        gr.Markdown("Stored runs of this browser session (and shared teaching examples), re-rendered from their "
                    "events: no model is needed. Search matches the prompt as plain text.")
        with gr.Row():
            text = gr.Textbox(label="Search prompt", scale=3, elem_id="replay-search")
            method = gr.Dropdown(["", *METHODS], value="", label="Method", scale=1)
            find = gr.Button("Search", scale=1, elem_id="replay-find")
        status = gr.HTML(elem_id="replay-status")
        table = gr.Dataframe(headers=["id", "when", "prompt", "methods", "pair", "status", "visibility"],
                             interactive=False, wrap=True)
        with gr.Row():
            session = gr.Dropdown([], label="Session", scale=3, elem_id="replay-session")
            open_btn = gr.Button("Open", scale=1, elem_id="replay-open")
        runs_state = gr.State({})
        run = gr.Dropdown([], label="Run", elem_id="replay-run")
        with gr.Row():
            step = gr.Slider(1, 2, value=1, step=1, label="Step", scale=4, elem_id="replay-step")
            speed = gr.Slider(0.1, 5, value=0.5, step=0.1, label="Seconds per step", scale=2)
            play = gr.Button("▶ Play", scale=1)
            pause = gr.Button("⏸ Pause", scale=1)
        timer = gr.Timer(0.5, active=False)
        chat = gr.Chatbot(label="Replayed chat", height=220, sanitize_html=True)
        notices = gr.HTML()
        tokens = gr.HTML(elem_id="replay-token-view")
        metrics = gr.HTML(elem_id="replay-metric-panel")
        tree = gr.Plot(label="Branch tree")
        timeline = gr.Plot(label="Timeline (measured)")
        with gr.Row():
            acceptance = gr.Plot(label="Acceptance")
            cumulative = gr.Plot(label="Drafted / accepted / rolled back")
        with gr.Accordion("Compare stored runs", open=False):
            pick = gr.CheckboxGroup([], label="Runs to compare (first = baseline)")
            compare_btn = gr.Button("Compare")
            compare_table = gr.HTML()
            compare_timeline = gr.Plot(label="Timelines on one axis")
            compare_steps = gr.Plot(label="Aligned by step")
        with gr.Accordion("Export, import, share, delete", open=False):
            with gr.Row():
                export_btn = gr.Button("Export session")
                session_file = gr.File(label="Session JSON")
                trace_file = gr.File(label="Chrome trace (Perfetto)")
            with gr.Row():
                upload = gr.File(label="Import a session JSON", file_types=[".json"])
                import_btn = gr.Button("Import")
            with gr.Row():
                shared = gr.Checkbox(False, label="Shared with everyone")
                share_btn = gr.Button("Apply sharing")
                delete_btn = gr.Button("Delete session", variant="stop")
            manage_status = gr.HTML()

        views = [tokens, metrics, notices, tree, timeline, acceptance, cumulative]
        find.click(search, [text, method], [table, session, status])
        text.submit(search, [text, method], [table, session, status])
        open_btn.click(open_session, [session], [run, pick, runs_state, status]).then(
            show_run, [run, runs_state], [chat, *views, step])
        run.change(show_run, [run, runs_state], [chat, *views, step])
        step.release(show_step, [step, run, runs_state], [chat, *views])
        play.click(lambda s: gr.Timer(value=float(s), active=True), [speed], timer)
        pause.click(lambda: gr.Timer(active=False), None, timer)
        timer.tick(tick, [step, run, runs_state], [step, timer]).then(show_step, [step, run, runs_state],
                                                                      [chat, *views])
        compare_btn.click(compare, [pick, runs_state], [compare_table, compare_timeline, compare_steps])
        export_btn.click(export, [session], [session_file, trace_file, manage_status])
        import_btn.click(do_import, [upload], [manage_status])
        share_btn.click(share, [session, shared], [manage_status])
        delete_btn.click(delete, [session], [manage_status])
