"""The Compare tab: one prompt and seed through several methods, one after another so each is timed alone; then
the race, all of them replayed side by side from their recorded events on one clock, and the speedup table."""

from __future__ import annotations

import html

import gradio as gr

from engine.config import BASELINE, SpecBranchError
from engine.events import Event, TokensEmitted
from engine.measure.metrics import metrics_of

from ..context import AppContext
from ..identity import owner_of
from ..race import NEEDS_TWO, is_greedy, race_updates
from ..render import failure_message, notice_html
from ..settings import COMPARE_METHODS, make_config
from ..stream import stream_events
from ..views import fmt

TABLE_HEAD = (
    "method",
    "tokens/s",
    "speedup vs ar",
    "tokens per target forward",
    "acceptance",
    "path rollback",
    "wasted draft",
    "overlap",
    "target waits on the draft",
    "pace",
    "no-waste headroom",
    "output vs first",
)


def comparison_table(runs: list[list[Event]], greedy: bool) -> str:
    """One row a run: its speed against the `ar` run among them, its metrics, and whether its output is the first
    run's (greedy only: sampled runs differ by design)."""
    results = []
    for events in runs:
        m = metrics_of(events)
        ids = [t for e in events if isinstance(e, TokensEmitted) for t in e.tokens]
        results.append((events[0].method, m, ids))
    base = next((m["tokens_per_s"] for name, m, _ in results if name == BASELINE), None)
    reference = results[0][2]
    rows = []
    for name, m, ids in results:
        speed = f"{m['tokens_per_s'] / base:.2f}×" if base else "–"
        same = ("identical" if ids == reference else "DIFFERENT") if greedy else "(sampled)"
        rows.append(
            "<tr>"
            + "".join(
                f"<td>{html.escape(str(c))}</td>"
                for c in (
                    name,
                    f"{m['tokens_per_s']:.1f}",
                    speed,
                    fmt(m["mean_accepted_length"]),
                    fmt(m["acceptance_rate"]),
                    fmt(m["path_rollback_rate"]),
                    fmt(m["wasted_draft_rate"]),
                    fmt(m["overlap"]),
                    fmt(m["draft_alone_fraction"]),
                    fmt(m.get("pace")),
                    fmt(m.get("no_waste_headroom")),
                    same,
                )
            )
            + "</tr>"
        )
    head = "".join(f"<th>{h}</th>" for h in TABLE_HEAD)
    note = "" if greedy else "<p>Sampled runs differ by design; compare their statistics, not their text.</p>"
    return f'<table class="compare-table"><tr>{head}</tr>{"".join(rows)}</table>{note}'


def running_html(method: str, i: int, n: int) -> str:
    return (
        f'<div class="race-status">running {html.escape(method)} ({i + 1} of {n}): the methods run one after '
        f"another so each is timed alone; then they race</div>"
    )


class CompareTab:
    def __init__(self, ctx: AppContext):
        self.ctx = ctx

    def create_ui(self) -> None:
        with gr.Tab("Compare"):
            gr.Markdown(
                "Run several methods on one prompt and seed, one after the other (so each is timed alone), "
                "then watch them **race** side by side from their recorded events, each at its measured "
                "speed. Speedups are against `ar` from the same comparison."
            )
            self.prompt = gr.Textbox(
                label="Prompt", lines=2, value="Explain how a hash map works.", elem_id="compare-prompt"
            )
            self.methods = gr.CheckboxGroup(
                COMPARE_METHODS, value=COMPARE_METHODS, label="Methods (two or more)", elem_id="compare-methods"
            )
            self.run = gr.Button("Compare", variant="primary", elem_id="compare")
            self.runs = gr.State([])
            self.notice = gr.HTML(elem_id="compare-notice")
            self.race_view = gr.HTML(elem_id="compare-race")
            self.table = gr.HTML(elem_id="compare-table")
            self.timeline = gr.Plot(label="Timelines, one axis", elem_id="compare-timeline")

    def create_event_handlers(self) -> None:
        ctx = self.ctx
        self.run.click(
            self.compare,
            [self.prompt, self.methods, *ctx.controls, ctx.browser, ctx.draft],
            [self.notice, self.race_view, self.table, self.runs],
            concurrency_limit=1,
            concurrency_id="engine",
            api_name="compare",
        ).then(self.race, [self.runs], [self.race_view, self.table, self.timeline], api_name="compare_race")

    def compare(
        self,
        prompt,
        methods,
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
        draft=None,
        request: gr.Request = None,
    ):
        """Run each chosen method once, one after another (clean timings); the race then replays them."""
        if not methods or len(methods) < 2:
            yield NEEDS_TWO, "", "", []
            return
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
        try:
            cfgs, engine, ids = self.prepare(prompt, methods, controls, chat, draft)
        except SpecBranchError as exc:
            yield notice_html([], str(exc)), "", "", []
            return
        except OverflowError as exc:  # a setting no integer holds (an infinite token count): refused like the others
            yield notice_html([], f"a setting is out of range: {exc}"), "", "", []
            return
        except Exception as exc:  # a model that fails to load: say so, keep serving
            yield notice_html([], f"could not load the models: {exc}"), "", "", []
            return
        yield from self.run_each(cfgs, engine, ids, prompt, owner_of(browser_id, request))

    def prepare(self, prompt, methods, controls, chat, draft):
        """(each method's config, the engine, the prompt's ids); raises SpecBranchError with what is wrong."""
        if not prompt or not prompt.strip():
            raise SpecBranchError("the prompt is empty")
        cfgs = [make_config(m, *controls) for m in methods]
        engine = self.ctx.engine_for(draft)
        ids = engine.encode(prompt, bool(chat))
        engine.check_prompt(ids)
        return cfgs, engine, ids

    def run_each(self, cfgs, engine, ids, prompt, owner):
        """Each config's run in turn, recorded as one session; the runs' events at the end, for the race."""
        recorder, sid = self.ctx.start_recording(owner, prompt, engine, cfgs[0])
        runs = []
        for i, cfg in enumerate(cfgs):  # one stored session, one run per method
            yield "", running_html(cfg.method, i, len(cfgs)), "", []
            if sid is not None and runs:
                recorder = self.ctx.get_store()[0].recorder(sid)
            try:
                runs.append([])
                for event in stream_events(engine, ids, cfg, prompt):
                    runs[-1].append(event)
                    recorder.add(event)
            except Exception as exc:  # out of memory, a draft's process gone: the runs so far stay, partial
                yield notice_html([], f"{cfg.method}: {failure_message(exc)}"), "", "", []
                return
            finally:
                recorder.close()
        note = (
            f'<div class="notice notice-warning">not recording: {html.escape(recorder.error)}</div>'
            if recorder.error
            else ""
        )
        yield note, gr.skip(), gr.skip(), runs

    @staticmethod
    def race(runs):
        """The recorded runs side by side on one clock (no engine needed: this does not queue behind generation)."""
        if not runs or len(runs) < 2:
            return
        yield from race_updates(runs, lambda rs: comparison_table(rs, all(is_greedy(r) for r in rs)))
