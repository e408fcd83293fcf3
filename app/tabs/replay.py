"""The Replay tab: list this browser's stored sessions (plus shared ones), re-render any run step by
step from its stored events (no model needed), compare stored runs, export, import and delete."""

from __future__ import annotations

import atexit
import html
import os
import shutil
import tempfile
import time
from functools import cache
from pathlib import Path

import gradio as gr
import plotly.graph_objects as go

from engine.config import METHODS
from engine.events import RunStarted, TokensEmitted
from sessions import SessionStoreError
from sessions.db import check_id
from sessions.export import read_import, write_export, write_trace
from sessions.replay import compare_runs, events_up_to_step, replay_steps, stored_run_label

from ..context import AppContext, stored_ar_speed
from ..figures import plot_text, timeline_figure
from ..identity import owner_of
from ..navigator import build_navigator, clamp_step, notice_of, slider_update, wire_navigator
from ..race import NEEDS_TWO, race_updates
from ..render import VIEWS, error_html, skips, views_at
from ..views import fmt, token_view

LINE_DASHES = ("solid", "dash", "dot", "dashdot", "longdash")  # one a run in "Aligned by step"
MARKERS = ("circle", "square", "diamond", "triangle-up", "x")  # shrinking: an earlier run's shows round a later's


def export_dir() -> Path:
    """This process's private folder for exported files, made on first use (a forked child makes its own)."""
    return _private_dir(os.getpid())


@cache
def _private_dir(pid: int) -> Path:
    path = Path(tempfile.mkdtemp(prefix="specbranch-exports-"))  # mode 0700: no other local user reads exports
    atexit.register(_remove_dir, path, pid)
    return path


def _remove_dir(path: Path, pid: int) -> None:
    if os.getpid() == pid:  # a forked child inherits atexit hooks: only the maker removes its folder
        shutil.rmtree(path, ignore_errors=True)


def export_paths(session_id: str) -> tuple[Path, Path]:
    """The session file and the trace file of an export: the id becomes part of their names, so it must be safe."""
    check_id(session_id, "session id")
    folder = export_dir()
    return folder / f"session-{session_id}.json", folder / f"session-{session_id}.trace.json"


def when(created) -> str:
    """A session's creation time as the table shows it; "?" for a value no clock reads (a store written before
    imports were checked may hold one)."""
    try:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(created))
    except (OverflowError, OSError, ValueError, TypeError):
        return "?"


def chat_of(events) -> list[dict]:
    start = next((e for e in events if isinstance(e, RunStarted)), None)
    text = "".join(e.text for e in events if isinstance(e, TokensEmitted))
    return [{"role": "user", "content": start.prompt_text if start else ""}, {"role": "assistant", "content": text}]


def step_alignment_figure(by_step: list[dict], labels: list[str]) -> go.Figure:
    """compare_runs' by_step rows drawn: each run's running total at the steps in which it committed tokens. Runs
    that commit alike draw the same line (SD and PEARL often do, with a draft that is rarely wrong), so each run has
    its own dash and marker, and the one drawn last does not hide the others."""
    fig = go.Figure()
    for i, label in enumerate(labels):
        rows = [row for row in by_step if row["tokens"][i]]
        fig.add_trace(
            go.Scatter(
                x=[row["step"] for row in rows],
                y=[row["total"][i] for row in rows],
                mode="lines+markers",
                name=plot_text(label),
                line=dict(dash=LINE_DASHES[i % len(LINE_DASHES)], width=2),
                marker=dict(symbol=MARKERS[i % len(MARKERS)], size=7 + 2 * (len(labels) - 1 - i)),
            )
        )
    fig.update_layout(
        title="Committed tokens by step (aligned by step)",
        height=300,
        xaxis_title="step",
        yaxis_title="tokens committed",
        margin=dict(l=10, r=10, t=40, b=30),
    )
    return fig


def compare_html(result: dict) -> str:
    """The compare table. Its values come from stored or imported runs: every cell is escaped as text."""
    keys = [
        "tokens_per_s",
        "mean_accepted_length",
        "acceptance_rate",
        "path_rollback_rate",
        "wasted_draft_rate",
        "overlap",
        "draft_alone_fraction",
        "pace",
        "no_waste_headroom",
        "new_tokens",
    ]
    head = "".join(f"<th>{html.escape(h)}</th>" for h in ["run", *keys, "speedup vs first"])
    rows = []
    for i, label in enumerate(result["labels"]):
        m, diff = result["metrics"][i], result["diffs"][i]
        cells = [label]
        for k in keys:
            d = diff.get(k)
            cells.append(fmt(m.get(k)) + ("" if i == 0 or d is None else f" ({'+' if d >= 0 else ''}{fmt(d)})"))
        cells.append(fmt(result["speedup"][i]))
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    return f'<table class="compare-table"><tr>{head}</tr>{"".join(rows)}</table>'


class ReplayTab:
    """Stored runs re-rendered from their events (no model needed): search, open, step or play, compare and race
    stored runs, export, import, share and delete. The page's browser id owns what it stores and sees."""

    def __init__(self, ctx: AppContext):
        self.ctx = ctx

    # ------------------------------------------------------------------ UI
    def create_ui(self) -> None:
        with gr.Tab("Replay"):
            gr.Markdown(
                "Stored runs of this browser (and shared teaching examples), re-rendered from their "
                "events: no model is needed. Search matches the prompt as plain text."
            )
            self.create_finder()
            self.create_views()
            with gr.Accordion("Compare and race stored runs", open=False):
                self.create_comparison()
            with gr.Accordion("Export, import, share, delete", open=False):
                self.create_manager()

    def create_finder(self) -> None:
        with gr.Row():
            self.text = gr.Textbox(label="Search prompt", scale=3, elem_id="replay-search")
            self.method = gr.Dropdown(["", *METHODS], value="", label="Method", scale=1)
            self.find = gr.Button("Search", scale=1, elem_id="replay-find")
        self.status = gr.HTML(elem_id="replay-status")
        self.table = gr.Dataframe(
            headers=["id", "when", "prompt", "methods", "pair", "status", "visibility"], interactive=False, wrap=True
        )
        with gr.Row():
            self.session = gr.Dropdown([], label="Session", scale=3, elem_id="replay-session")
            self.open = gr.Button("Open", scale=1, elem_id="replay-open")
        self.runs = gr.State({})
        self.ar_speed = gr.State(None)  # tokens/s of a stored AR run of this session's prompt, for the speedup
        self.run = gr.Dropdown([], label="Run", elem_id="replay-run")

    def create_views(self) -> None:
        with gr.Row():
            self.speed = gr.Slider(0.1, 5, value=0.5, step=0.1, label="Seconds per step (Play)", scale=4)
            self.play = gr.Button("▶ Play", scale=1)
            self.pause = gr.Button("⏸ Pause", scale=1)
        self.timer = gr.Timer(0.5, active=False)
        self.chat = gr.Chatbot(label="Replayed chat (the answer text)", height=220, sanitize_html=True)
        notices = gr.HTML()
        glance = gr.HTML(elem_id="replay-glance")
        self.show_all = gr.Checkbox(False, label="Show all rollbacks (else click a ↶ marker)")
        self.tokens = gr.HTML(elem_id="replay-token-view")
        metrics = gr.HTML(elem_id="replay-metric-panel")
        self.nav = build_navigator("replay-step")
        tree = gr.HTML(elem_id="replay-tree-view")
        timeline = gr.Plot(label="Timeline (measured)")
        self.nav.add_strip()
        with gr.Row():
            acceptance = gr.Plot(label="Acceptance")
            cumulative = gr.Plot(label="Drafted / accepted / rolled back")
        views = [self.tokens, metrics, notices, glance, tree, timeline, self.nav.strip, acceptance, cumulative]
        self.shown = [self.nav.slider, self.nav.notice, self.chat, *views]

    def create_comparison(self) -> None:
        self.pick = gr.CheckboxGroup([], label="Runs to compare or race (first = baseline)", elem_id="replay-pick")
        with gr.Row():
            self.compare_btn = gr.Button("Compare")
            self.race_btn = gr.Button("Race", variant="primary", elem_id="replay-race-btn")
        self.race_view = gr.HTML(elem_id="replay-race")
        self.compare_table = gr.HTML(elem_id="replay-compare-table")
        self.compare_timeline = gr.Plot(label="Timelines on one axis")
        self.compare_steps = gr.Plot(label="Aligned by step", elem_id="replay-compare-steps")

    def create_manager(self) -> None:
        with gr.Row():
            self.export_btn = gr.Button("Export session")
            self.session_file = gr.File(label="Session JSON")
            self.trace_file = gr.File(label="Chrome trace (Perfetto)")
        with gr.Row():
            self.upload = gr.File(label="Import a session JSON", file_types=[".json"])
            self.import_btn = gr.Button("Import")
        with gr.Row():
            self.shared = gr.Checkbox(False, label="Shared with everyone")
            self.share_btn = gr.Button("Apply sharing")
            self.delete_btn = gr.Button("Delete session", variant="stop")
        self.manage_status = gr.HTML()

    # ------------------------------------------------------------------ events
    def create_event_handlers(self) -> None:
        """Search and open sessions, show a run and step through it (by hand or played)."""
        browser, shown = self.ctx.browser, self.shown
        viewing = [self.run, self.runs, self.show_all, self.ar_speed]
        private = dict(api_visibility="private")  # what only the page calls: the same work as a public endpoint
        self.find.click(
            self.search, [self.text, self.method, browser], [self.table, self.session, self.status], api_name="search"
        )
        self.text.submit(
            self.search,
            [self.text, self.method, browser],
            [self.table, self.session, self.status],
            api_name="search_on_enter",
            **private,
        )
        self.open.click(
            self.open_session,
            [self.session, browser],
            [self.run, self.pick, self.runs, self.status, self.ar_speed],
            api_name="open_session",
        ).then(self.show_run, viewing, shown, api_name="show_opened_run", **private)
        self.run.change(self.show_run, viewing, shown, api_name="show_run")
        wire_navigator(self.nav, self.show_step, viewing, shown)
        self.show_all.change(
            self.rerender_tokens,
            [self.nav.slider, self.run, self.runs, self.show_all],
            self.tokens,
            api_name="replay_tokens",
            **private,
        )
        self.play.click(self.play_timer, [self.speed], self.timer, api_name="replay_play", **private)
        self.pause.click(self.pause_timer, None, self.timer, api_name="replay_pause", **private)
        self.timer.tick(
            self.tick,
            [self.nav.slider, self.run, self.runs],
            [self.nav.slider, self.timer],
            api_name="replay_tick",
            **private,
        ).then(self.show_step, [self.nav.slider, *viewing], shown, api_name="replay_tick_show", **private)
        self.create_session_handlers()

    def create_session_handlers(self) -> None:
        """Compare and race the picked runs; export, import, share and delete a session."""
        browser = self.ctx.browser
        self.compare_btn.click(
            self.compare,
            [self.pick, self.runs],
            [self.compare_table, self.compare_timeline, self.compare_steps],
            api_name="compare_runs",
        )
        self.race_btn.click(
            self.race,
            [self.pick, self.runs],
            [self.race_view, self.compare_table, self.compare_timeline, self.compare_steps],
            api_name="race_runs",
        )
        self.export_btn.click(
            self.export,
            [self.session, browser],
            [self.session_file, self.trace_file, self.manage_status],
            api_name="export_session",
        )
        self.import_btn.click(self.do_import, [self.upload, browser], [self.manage_status], api_name="import_session")
        self.share_btn.click(
            self.share, [self.session, self.shared, browser], [self.manage_status], api_name="share_session"
        )
        self.delete_btn.click(self.delete, [self.session, browser], [self.manage_status], api_name="delete_session")

    def search(self, text, method, browser_id=None, request: gr.Request = None):
        try:
            rows = self.ctx.store_or_raise().list_sessions(
                owner=owner_of(browser_id, request), search=text or None, method=method or None
            )
        except SessionStoreError as exc:
            return gr.update(), gr.update(), error_html(str(exc))
        table = [
            [
                r["id"],
                when(r["created"]),
                r["prompt"][:80],
                ", ".join(r["methods"]),
                f"{r['target']} / {r['draft']}",
                r["status"],
                "shared" if r["shared"] else ("mine" if r.get("mine") else ""),
            ]
            for r in rows
        ]
        choices = [(f"{r['id']} · {r['prompt'][:40]}", r["id"]) for r in rows]
        return (
            table,
            gr.update(choices=choices, value=choices[0][1] if choices else None),
            f"{len(rows)} session(s)" if rows else "no stored sessions yet: generate something in the Live tab",
        )

    def open_session(self, session_id, browser_id=None, request: gr.Request = None):
        if not session_id:
            return gr.update(), gr.update(), {}, "pick a session", None
        owner = owner_of(browser_id, request)
        try:
            store = self.ctx.store_or_raise()
            session = store.get_session(session_id, owner)
            runs = {r["id"]: store.load_run_events(r["id"]) for r in session["runs"]}
        except SessionStoreError as exc:
            return gr.update(), gr.update(), {}, error_html(str(exc)), None
        ar_speed = stored_ar_speed(store, owner, session["prompt"], (session["target"], session["draft"]), session_id)
        choices = [(stored_run_label(r), r["id"]) for r in session["runs"]]
        first = choices[0][1] if choices else None
        return (
            gr.update(choices=choices, value=first),
            gr.update(choices=choices, value=[c[1] for c in choices]),
            runs,
            f"opened {html.escape(session_id)}: {len(runs)} run(s)",
            ar_speed,
        )

    @staticmethod
    def show_step(requested, run_id, runs, show_all, ar_speed):
        """The run as it stood at the end of a step (None: the whole run): chat, views and the navigator."""
        events = (runs or {}).get(run_id)
        if not events:
            return skips(3 + VIEWS)
        steps = replay_steps(events)
        step, notice = clamp_step(steps[-1] if requested is None and steps else requested, steps)
        prefix = events if step is None or step == steps[-1] else events_up_to_step(events, step)
        return (
            slider_update(steps, step),
            notice_of(notice),
            chat_of(prefix),
            *views_at(prefix, step, None, bool(show_all), ar_speed, events),
        )

    def show_run(self, run_id, runs, show_all, ar_speed):
        return self.show_step(None, run_id, runs, show_all, ar_speed)

    @staticmethod
    def rerender_tokens(index, run_id, runs, show_all):
        events = (runs or {}).get(run_id)
        if not events:
            return gr.skip()
        step, _ = clamp_step(index, replay_steps(events))
        return token_view(events if step is None else events_up_to_step(events, step), bool(show_all))

    @staticmethod
    def play_timer(seconds_per_step):
        """Play: the timer ticks every `seconds_per_step` (the slider's 0.1-5; anything else is clamped to it)."""
        try:
            seconds = float(seconds_per_step)
        except (TypeError, ValueError):
            seconds = 0.5
        return gr.Timer(value=min(5.0, max(0.1, seconds)) if seconds == seconds else 0.5, active=True)

    @staticmethod
    def pause_timer():
        return gr.Timer(active=False)

    @staticmethod
    def tick(index, run_id, runs):
        steps = replay_steps((runs or {}).get(run_id) or [])
        step, _ = clamp_step(index, steps)
        if step is None or step >= steps[-1]:
            return gr.update(), gr.Timer(active=False)
        return step + 1, gr.Timer(active=True)

    @staticmethod
    def chosen_runs(run_ids, runs):
        return [runs[rid] for rid in run_ids or [] if rid in (runs or {})]

    def compare(self, run_ids, runs):
        chosen = self.chosen_runs(run_ids, runs)
        if len(chosen) < 2:
            return "pick two or more runs", gr.skip(), gr.skip()
        result = compare_runs(chosen)
        return (
            compare_html(result),
            timeline_figure(chosen),
            step_alignment_figure(result["by_step"], result["labels"]),
        )

    def race(self, run_ids, runs):
        chosen = self.chosen_runs(run_ids, runs)
        if len(chosen) < 2:
            yield NEEDS_TWO, gr.skip(), gr.skip(), gr.skip()
            return
        result = compare_runs(chosen)
        for update in race_updates(chosen, lambda rs: compare_html(result)):
            yield *update, gr.skip()
        # the race ends as Compare does, with these runs aligned by step too (not a plot an earlier Compare left)
        yield gr.skip(), gr.skip(), gr.skip(), step_alignment_figure(result["by_step"], result["labels"])

    def export(self, session_id, browser_id=None, request: gr.Request = None):
        try:
            session_file, trace_file = export_paths(session_id)
            store = self.ctx.store_or_raise()
            owner = owner_of(browser_id, request)
            write_export(store, session_id, session_file, owner)
            write_trace(store, session_id, trace_file, owner)
        except SessionStoreError as exc:
            return None, None, error_html(str(exc))
        return str(session_file), str(trace_file), "exported: the .trace.json opens in ui.perfetto.dev"

    def do_import(self, file, browser_id=None, request: gr.Request = None):
        if file is None:
            return "choose a session .json exported from SpecBranch Studio"
        try:  # read_import: a file too large is refused by its size, before it is read
            sid = read_import(self.ctx.store_or_raise(), file, owner_of(browser_id, request))
        except SessionStoreError as exc:
            return error_html(f"import refused: {exc}")
        return f"imported as session {html.escape(sid)}"

    def delete(self, session_id, browser_id=None, request: gr.Request = None):
        try:
            self.ctx.store_or_raise().delete_session(session_id, owner_of(browser_id, request))
        except SessionStoreError as exc:
            return error_html(str(exc))
        return f"deleted {html.escape(session_id)} and its events"

    def share(self, session_id, shared, browser_id=None, request: gr.Request = None):
        try:
            self.ctx.store_or_raise().mark_shared(session_id, owner_of(browser_id, request), bool(shared))
        except SessionStoreError as exc:
            return error_html(str(exc))
        return f"{html.escape(session_id)} is now {'shared with everyone' if shared else 'private'}"
