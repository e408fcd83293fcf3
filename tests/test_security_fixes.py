"""Issue 12: a crafted import never reaches the page as markup, mistyped metrics and unsafe ids are refused,
exports go to a private per-process folder, a browser keeps its runs across a reload, and a request
cancelled while it waits for the engine's lock leaves the engine usable."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import stat
import threading
from types import SimpleNamespace

import pytest

from app.figures import timeline_figure
from app.identity import STORAGE_KEY, browser_id_state, browser_identity, owner_of
from app.render import views_at
from app.tabs import replay as replay_tab
from app.tabs.replay import compare_html, export_dir, export_paths, step_alignment_figure
from engine.config import GenerationConfig
from engine.engine import Engine
from engine.runtime import new_event_loop
from sessions.export import export_session, import_session, parse_export
from sessions.replay import compare_runs, stored_run_label
from sessions.store import SessionStoreError, Store

from .test_sessions import PROMPT_IDS, recorded  # noqa: F401  (fixture)

PAYLOAD = '"><img src=x onerror=alert(1)>'  # breaks out of an attribute, then a tag
KEEP = {"format", "type", "id", "status"}  # the file's structure and what the importer checks by value


def poisoned(value, key=None):
    """Every string in an export document, keys aside, replaced by the payload (ids, types and statuses kept:
    the importer refuses other values there outright)."""
    if isinstance(value, dict):
        return {k: poisoned(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [poisoned(v, key) for v in value]
    return PAYLOAD if isinstance(value, str) and key not in KEEP else value


def poison_metrics(doc):
    """The payload in every metric field too (as a file that skipped the importer's checks would have it)."""
    for run in doc["runs"]:
        finished = next(e for e in run["events"] if e["type"] == "finished")
        for metrics in (run["metrics"], finished["metrics"]):
            for key in metrics:
                metrics[key] = PAYLOAD
    return doc


AS_TEXT = "&quot;&gt;&lt;img src=x onerror=alert(1)&gt;"


def assert_no_markup(html_text: str) -> None:
    assert "<img" not in html_text.lower() and "onerror=alert(1)>" not in html_text


def replay_html(store, session_id) -> list[str]:
    """Every HTML string the Replay tab builds for a session: the compare table, then each run's token view,
    metric panel and notices (what views_at gives the tab)."""
    runs = store.load_session_events(session_id, "bob")
    out = [compare_html(compare_runs(runs))]
    for events in runs:
        out += list(views_at(events)[:3])
    return out


def test_crafted_import_never_reaches_the_page_as_markup(recorded, tmp_path):  # noqa: F811
    doc = poisoned(export_session(recorded["store"], recorded["session_id"]))
    doc["runs"][0]["events"].append({"type": "notice", "level": PAYLOAD, "message": PAYLOAD})
    with Store(tmp_path / "s.db") as store:
        session_id = import_session(store, doc, owner="bob")
        pages = replay_html(store, session_id)
        for html_text in pages:
            assert_no_markup(html_text)
        compare, tokens, _, notices = pages[:4]
        assert AS_TEXT in compare and AS_TEXT in tokens and notices.count(AS_TEXT) >= 2  # shown, as text
        assert all(PAYLOAD in stored_run_label(r) for r in store.get_session(session_id)["runs"])  # a plain label


def test_metrics_that_are_not_numbers_are_escaped(recorded, tmp_path):  # noqa: F811
    """A store written before imports were checked may hold anything in its metrics: still only text."""
    doc = poison_metrics(poisoned(export_session(recorded["store"], recorded["session_id"])))
    with pytest.raises(SessionStoreError, match="should be"):
        parse_export(doc)
    session, runs = parse_export(poisoned(export_session(recorded["store"], recorded["session_id"])))
    for run, raw in zip(runs, doc["runs"]):  # the poisoned metrics, past the check, as an old store has them
        run["metrics"] = raw["metrics"]
        run["events"][-1] = dataclasses.replace(run["events"][-1], metrics=raw["metrics"])
    with Store(tmp_path / "s.db") as store:
        store.insert_session(session, runs, "bob")
        pages = replay_html(store, session["id"])
    for html_text in pages:
        assert_no_markup(html_text)
    compare, _, metrics = pages[:3]
    assert compare.count(AS_TEXT) == 2 * (1 + 10)  # both runs' labels and compared metrics, as text
    assert metrics.count(AS_TEXT) >= 6


PLOT_PAYLOAD = '<a href="javascript:alert(1)">x</a><span style="x">%{x}'  # markup Plotly renders; a template field


def plot_strings(fig) -> list[str]:
    """Every string of a figure's traces: names, category labels, hover templates, legend groups."""
    out = []

    def walk(value):
        if isinstance(value, str):
            out.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(fig.to_dict()["data"])
    return out


def test_an_imported_method_and_span_kind_reach_the_figures_as_text(recorded, tmp_path):  # noqa: F811
    """Plotly renders a subset of HTML in trace names, tick labels and hover text, and reads %{...} in a hover
    template: a crafted method or span kind is escaped there, and Plotly's entities show it as written."""
    doc = export_session(recorded["store"], recorded["session_id"])
    for run in doc["runs"]:
        run["method"] = PLOT_PAYLOAD
        for e in run["events"]:
            if e["type"] == "run_started":
                e["method"] = PLOT_PAYLOAD
            if e["type"] == "timing_span" and e["kind"] == "verify":
                e["kind"] = PLOT_PAYLOAD
    with Store(tmp_path / "s.db") as store:
        session_id = import_session(store, doc, owner="bob")
        runs = store.load_session_events(session_id, "bob")
    result = compare_runs(runs)
    strings = plot_strings(timeline_figure(runs)) + plot_strings(
        step_alignment_figure(result["by_step"], result["labels"])
    )
    shown = '&lt;a href="javascript:alert(1)"&gt;x&lt;/a&gt;&lt;span style="x"&gt;&#37;{x}'
    assert sum(shown in s for s in strings) >= 4  # lanes, a legend entry, hover text, the aligned plot's names
    for s in strings:
        assert "<a" not in s and "<span" not in s and "%{x}" not in s, s


@pytest.mark.parametrize(
    "how, reason",
    [
        ("event metric", r"run 2, event \d+: finished metrics: field 'tokens_per_s' should be float, got '\"><img"),
        ("run metric", r"run 2 metrics: field 'overlap' should be float, got '\"><img"),
        ("nested metric", r"finished metrics: field 'per_position_acceptance' should be list\[float \| None\]"),
        ("histogram", r"finished metrics: field 'accepted_length_histogram' should be dict\[str, int\]"),
        ("unknown metric", r"finished metrics has unknown fields: evil"),
        ("bool metric", r"finished metrics: field 'new_tokens' should be int, got True"),
    ],
)
def test_mistyped_metric_is_refused_naming_the_field(recorded, tmp_path, how, reason):  # noqa: F811
    doc = export_session(recorded["store"], recorded["session_id"])
    run = doc["runs"][1]
    metrics = next(e for e in run["events"] if e["type"] == "finished")["metrics"]
    if how == "event metric":
        metrics["tokens_per_s"] = PAYLOAD
    elif how == "run metric":
        run["metrics"]["overlap"] = PAYLOAD
    elif how == "nested metric":
        metrics["per_position_acceptance"] = [0.5, PAYLOAD]
    elif how == "histogram":
        metrics["accepted_length_histogram"] = {"1": PAYLOAD}
    elif how == "unknown metric":
        metrics["evil"] = PAYLOAD
    elif how == "bool metric":
        metrics["new_tokens"] = True
    with Store(tmp_path / "s.db") as store:
        with pytest.raises(SessionStoreError, match=reason):
            import_session(store, doc, owner="bob")
        assert store.list_sessions() == []  # nothing written


def test_an_older_export_without_later_metrics_imports(recorded, tmp_path):  # noqa: F811
    """Metrics added by a later version (per_position_counts) are missing from older exports: replay
    recomputes every metric from the events, so such a file still imports."""
    doc = export_session(recorded["store"], recorded["session_id"])
    for run in doc["runs"]:
        for metrics in [run["metrics"]] + [e["metrics"] for e in run["events"] if e["type"] == "finished"]:
            metrics.pop("per_position_counts", None)
    with Store(tmp_path / "s.db") as store:
        import_session(store, doc, owner="bob")
        assert len(store.list_sessions()) == 1


@pytest.mark.parametrize(
    "where, bad_id, reason",
    [
        ("session", "../../tmp/x", r"session: id '\.\./\.\./tmp/x' is not allowed"),
        ("session", PAYLOAD, "session: id .* is not allowed: an id is 1 to 64 letters, digits"),
        ("session", "a" * 65, "session: id 'a+ is not allowed"),
        ("session", "", "session: id '' is not allowed"),
        ("run", "run/../../x", r"run 1: id 'run/\.\./\.\./x' is not allowed"),
    ],
)
def test_unsafe_session_and_run_ids_are_refused(recorded, tmp_path, where, bad_id, reason):  # noqa: F811
    doc = export_session(recorded["store"], recorded["session_id"])
    (doc["session"] if where == "session" else doc["runs"][0])["id"] = bad_id
    with Store(tmp_path / "s.db") as store:
        with pytest.raises(SessionStoreError, match=reason):
            import_session(store, doc, owner="bob")
        assert store.list_sessions() == []
    with pytest.raises(SessionStoreError, match="session id .* is not allowed"):
        export_paths(bad_id)  # an unsafe id already in a store never names an export file either


def test_exports_go_to_a_private_folder_of_this_process(monkeypatch):
    folder = export_dir()
    assert export_dir() == folder  # made once per process
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == os.getuid()
    assert all(p.parent == folder for p in export_paths("0123abcd"))
    real_pid = os.getpid()
    monkeypatch.setattr(replay_tab.os, "getpid", lambda: real_pid + 1)  # what a forked child sees
    child = export_dir()
    monkeypatch.undo()
    assert stat.S_IMODE(child.stat().st_mode) == 0o700
    shutil.rmtree(child)  # its exit hook only removes it in that (pretend) process
    assert child != folder and child.parent == folder.parent
    assert export_dir() == folder


def test_a_reload_keeps_ones_private_runs_and_another_browser_does_not_see_them(tmp_path):
    assert browser_id_state().storage_key == STORAGE_KEY  # every page load reads the same localStorage entry
    first_visit = browser_identity(None)  # a new browser: a new id, which it keeps in localStorage
    with Store(tmp_path / "s.db") as store:
        mine = store.start_session(
            owner_of(first_visit, SimpleNamespace(session_hash="tab-1")), "my prompt", "t", "d", {}
        )
        shared = store.start_session("someone", "their shared prompt", "t", "d", {}, shared=True)
        reloaded = browser_identity(first_visit)  # the reload: a new Gradio session, the same stored id
        assert reloaded == first_visit
        owner = owner_of(reloaded, SimpleNamespace(session_hash="tab-2"))
        assert {s["id"] for s in store.list_sessions(owner=owner)} == {mine, shared}
        other = owner_of(browser_identity(None), SimpleNamespace(session_hash="tab-3"))  # another browser
        assert {s["id"] for s in store.list_sessions(owner=other)} == {shared}
    for forged in ("local", "anonymous", PAYLOAD, 42):  # a garbled or forged stored value is never an identity
        assert browser_identity(forged) != forged
        assert owner_of(forged, SimpleNamespace(session_hash="tab-4")) == "tab-4"


async def drain(stream) -> None:
    async for _ in stream:
        pass


def test_a_request_cancelled_while_it_waits_for_the_lock_leaves_the_engine_usable(tiny_engine):
    engine = Engine(tiny_engine.pair)  # the tiny models, with a lock of its own: a failure cannot hang other tests
    cfg = GenerationConfig(method="sd", max_new_tokens=12, gamma=3)
    loop = new_event_loop()
    try:
        first = engine.generate(list(PROMPT_IDS), cfg)
        loop.run_until_complete(first.__anext__())  # RunStarted: the first generation holds the lock
        second = loop.create_task(drain(engine.generate(list(PROMPT_IDS), cfg)))
        loop.run_until_complete(asyncio.sleep(0.3))
        assert not second.done()  # it waits for the lock
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            loop.run_until_complete(second)
        loop.run_until_complete(drain(first))  # the first finishes and gives the lock back
    finally:
        loop.close()
    results = []
    third = threading.Thread(target=lambda: results.append(engine.run(list(PROMPT_IDS), cfg)), daemon=True)
    third.start()  # from another thread and event loop, as the app's requests come
    third.join(timeout=10)
    assert results and len(results[0].token_ids) == 12, "the cancelled request kept the engine's lock"
    engine.close()
