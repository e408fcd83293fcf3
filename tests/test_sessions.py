"""Sessions: recorded runs replay exactly (tokens, metrics, figures, views), export/import is byte-stable,
killed or stopped runs stay readable as partial, concurrent recorders lose nothing, owners see only
their own and shared sessions, and search text is only ever text."""

from __future__ import annotations

import json
import os
import select
import signal
import sqlite3
import subprocess
import sys
import threading
from contextlib import aclosing
from pathlib import Path

import pytest

from app.figures import cumulative_figure, timeline_figure
from app.tabs.replay import step_alignment_figure
from app.tree import tree_html
from app.views import metric_panel, token_view
from engine.config import GenerationConfig
from engine.events import DraftProposed, Finished, TokensEmitted
from engine.measure.metrics import compute_metrics
from engine.runtime import new_event_loop
from sessions.export import chrome_trace, chrome_trace_runs, export_json, import_json
from sessions.replay import compare_runs, events_up_to_step, replay_steps
from sessions.store import SessionStoreError, Store, default_db_path

from .conftest import schedule_draft

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {
    # forks at every fresh draft step, and holds back where even a fork is unlikely to hold up (kind "held"); by
    # the draft's confidence as is, so what the shared engine measured in other tests' runs changes nothing here
    "specbranch": GenerationConfig(
        method="specbranch", max_new_tokens=20, gamma=3, epsilon=1.0, hold=0.5, calibrate=False
    ),
    "sd": GenerationConfig(method="sd", max_new_tokens=20, gamma=3),
}
PROMPT_IDS = [2, 3, 4]


def record_generation(engine, recorder, cfg, prompt_ids=PROMPT_IDS, stop_after_tokens=None):
    """Drive the engine's event stream the way the app does, handing each event to the recorder."""
    live = []

    async def consume():
        async with aclosing(engine.generate(list(prompt_ids), cfg, "a b c")) as stream:
            async for event in stream:
                live.append(event)
                recorder.add(event)
                emitted = sum(len(e.tokens) for e in live if isinstance(e, TokensEmitted))
                if stop_after_tokens is not None and emitted >= stop_after_tokens:
                    break  # what the Stop button or a closed tab does

    loop = new_event_loop()
    try:
        loop.run_until_complete(consume())
    finally:
        loop.close()
    recorder.close()
    return live


def token_ids(events):
    return [t for e in events if isinstance(e, TokensEmitted) for t in e.tokens]


def event_rows(path, run_id=None):
    with sqlite3.connect(path) as conn:
        if run_id is None:
            return conn.execute("SELECT count(*) FROM events").fetchone()[0]
        return conn.execute("SELECT count(*) FROM events WHERE run_id = ?", [run_id]).fetchone()[0]


@pytest.fixture(scope="module")
def recorded(tiny_engine, tmp_path_factory):
    """One session with a live specbranch run and a live sd run, recorded while they streamed. Beside each target
    pass the draft drafts on to the depth cap (schedule_draft), as where the target's pass is the slower: how far it
    gets is then a rule, not this machine's timing, and the specbranch run forks and holds on any machine (where the
    verdict lands after one draft step, as on a quiet one, no line grows long enough to hold)."""
    path = tmp_path_factory.mktemp("sessions") / "sessions.db"
    store = Store(path)
    session_id = store.start_session("alice", "a b c", "tiny-target", "tiny-draft", CONFIGS["specbranch"])
    live = {}
    with pytest.MonkeyPatch.context() as patch:
        schedule_draft(patch, lambda state: 2 * state.cfg.gamma)
        for method, cfg in CONFIGS.items():
            recorder = store.recorder(session_id)
            live[method] = record_generation(tiny_engine, recorder, cfg)
            assert recorder.error is None
    yield {"store": store, "path": path, "session_id": session_id, "live": live}
    store.close()


def stored_runs(recorded):
    store = recorded["store"]
    runs = store.get_session(recorded["session_id"])["runs"]
    return {run["method"]: (run, store.load_run_events(run["id"])) for run in runs}


def test_default_location_is_a_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECBRANCH_DB", str(tmp_path / "x.db"))
    assert default_db_path() == tmp_path / "x.db"
    monkeypatch.delenv("SPECBRANCH_DB")
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_db_path() == tmp_path / ".local" / "share" / "specbranch" / "sessions.db"


@pytest.mark.parametrize("method", list(CONFIGS))
def test_replay_matches_live(recorded, method):
    live = recorded["live"][method]
    run, events = stored_runs(recorded)[method]
    assert events == live  # every event, exactly
    assert run["status"] == "complete" and run["token_count"] == 20 == len(token_ids(events))
    assert token_ids(events) == token_ids(live)
    finished = events[-1]
    assert isinstance(finished, Finished)
    assert compute_metrics(events) == compute_metrics(live) == finished.metrics == run["metrics"]
    assert timeline_figure([events]).to_json() == timeline_figure([live]).to_json()
    assert cumulative_figure(events).to_json() == cumulative_figure(live).to_json()
    assert token_view(events) == token_view(live)
    assert metric_panel(events) == metric_panel(live)
    for step in replay_steps(events):
        assert tree_html(events, step) == tree_html(live, step)
    if method == "specbranch":  # the run both forked and held back, and replay shows both as live did
        kinds = {e.kind for e in events if isinstance(e, DraftProposed)}
        assert {"candidates", "held"} <= kinds


@pytest.mark.parametrize("method", list(CONFIGS))
def test_any_step_re_renders_from_its_prefix(recorded, method):
    events = stored_runs(recorded)[method][1]
    steps = replay_steps(events)
    assert steps == list(range(1, len(steps) + 1))
    previous = []
    for step in steps:
        prefix = events_up_to_step(events, step)
        assert events[: len(prefix)] == prefix and len(prefix) > len(previous)
        assert not any(getattr(e, "step", -1) == step for e in events[len(prefix) :])  # the whole step is in
        assert tree_html(prefix, step) == tree_html(events, step)
        previous = prefix
    assert isinstance(events_up_to_step(events, 0)[-1], TokensEmitted)  # prefill and its first token
    assert events_up_to_step(events, steps[-1]) == events  # the last step runs through Finished
    assert token_view(events_up_to_step(events, steps[-1])) == token_view(events)


def test_export_import_export_is_byte_stable(recorded, tmp_path):
    text = export_json(recorded["store"], recorded["session_id"])
    doc = json.loads(text)
    assert doc["version"] == 1
    assert [len(r["events"]) for r in doc["runs"]] == [len(v) for v in recorded["live"].values()]
    assert "alice" not in text  # the browser owner id is not exported
    with Store(tmp_path / "fresh.db") as fresh:
        session_id = import_json(fresh, text, owner="bob")
        assert session_id == recorded["session_id"]
        assert export_json(fresh, session_id) == text
        runs = fresh.get_session(session_id)["runs"]
        assert [fresh.load_run_events(r["id"]) for r in runs] == list(recorded["live"].values())
        assert fresh.list_sessions(owner="bob")[0]["status"] == "complete"


def test_compare_runs_aligns_by_step_and_time(recorded):
    runs = [stored_runs(recorded)[m][1] for m in ("sd", "specbranch")]
    cmp = compare_runs(runs)
    assert cmp["labels"] == ["sd", "specbranch"]
    assert cmp["metrics"] == [r[-1].metrics for r in runs]
    assert all(v in (0, None) for v in cmp["diffs"][0].values())
    drafted = [m["drafted_tokens"] for m in cmp["metrics"]]
    assert cmp["diffs"][1]["drafted_tokens"] == drafted[1] - drafted[0]
    assert cmp["speedup"][0] == 1.0
    assert cmp["by_step"][-1]["total"] == [20, 20] and cmp["by_time"][-1]["total"] == [20, 20]
    for row in cmp["by_step"]:
        assert row["tokens"] == [
            sum(len(e.tokens) for e in r if isinstance(e, TokensEmitted) and e.step == row["step"]) for r in runs
        ]
    times = [row["t"] for row in cmp["by_time"]]
    assert times == sorted(times)


def test_runs_that_commit_alike_stay_apart_in_the_aligned_plot(recorded):
    """The same run twice commits alike step for step: both lines coincide, and each must still be seen."""
    run = stored_runs(recorded)["sd"][1]
    cmp = compare_runs([run, run])
    fig = step_alignment_figure(cmp["by_step"], ["sd", "sd again"])
    first, second = fig.data
    assert list(first.x) == list(second.x) and list(first.y) == list(second.y) and len(first.x) > 1
    assert first.line.dash != second.line.dash and first.marker.symbol != second.marker.symbol
    assert first.marker.size > second.marker.size  # the one drawn first shows round the one drawn over it


def test_chrome_trace(recorded):
    events = stored_runs(recorded)["specbranch"][1]
    trace = json.loads(json.dumps(chrome_trace(events)))
    spans = [e for e in events if e.type == "timing_span"]
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(spans)
    lanes = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(lanes) == {"draft", "target"}
    for x, span in zip(complete, spans):
        assert x["tid"] == lanes[span.worker] and x["name"] == span.kind
        assert x["ts"] == pytest.approx(span.start * 1e6, abs=1e-3) and x["dur"] >= 0
        assert x["args"] == {"step": span.step, "tokens": span.tokens}
    both = chrome_trace_runs(list(recorded["live"].values()))
    assert {e["pid"] for e in both["traceEvents"]} == {1, 2}


def test_stopped_generation_is_kept_as_partial(tiny_engine, tmp_path):
    store = Store(tmp_path / "s.db")
    session_id = store.start_session("alice", "a b c", "t", "d", CONFIGS["specbranch"])
    live = record_generation(tiny_engine, store.recorder(session_id), CONFIGS["specbranch"], stop_after_tokens=4)
    assert not any(isinstance(e, Finished) for e in live)
    (run,) = store.get_session(session_id)["runs"]
    assert run["status"] == "partial" and run["finished"] is None
    assert store.load_run_events(run["id"]) == live
    assert run["metrics"] == compute_metrics(live)  # the metrics so far
    assert store.list_sessions()[0]["status"] == "partial"
    assert store.integrity_check() == "ok"


CHILD = r"""
import json, sys, time
from engine.events import from_dict
from sessions.store import Store
db, events_file, session_id = sys.argv[1:4]
events = [from_dict(d) for d in json.load(open(events_file))]
recorder = Store(db).recorder(session_id, batch_size=10, interval=0.02)
for i, event in enumerate(events[:-1]):  # never the last: however late the kill, it lands before the run's end
    recorder.add(event)
    if i == 40:
        while recorder.written < 41:
            time.sleep(0.01)
        print("ready", flush=True)
    if i >= 40:
        time.sleep(0.01)  # a slow stream: the kill lands mid-run, maybe mid-batch
time.sleep(60)
"""


def test_killed_process_leaves_a_readable_partial_session(recorded, tmp_path):
    events = recorded["live"]["specbranch"]
    events_file = tmp_path / "events.json"
    events_file.write_text(json.dumps([e.to_dict() for e in events]))
    path = tmp_path / "s.db"
    with Store(path) as store:
        session_id = store.start_session("alice", "a b c", "t", "d", {})
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), str(events_file), session_id],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready, _, _ = select.select([child.stdout], [], [], 60)
        assert ready and child.stdout.readline().strip() == "ready", child.stderr.read() if not ready else ""
        threading.Event().wait(0.3)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    with Store(path) as store:
        assert store.integrity_check() == "ok"
        (run,) = store.get_session(session_id)["runs"]
        stored = store.load_run_events(run["id"])
        assert 41 <= len(stored) < len(events) and stored == events[: len(stored)]
        assert run["status"] == "partial" and run["token_count"] == len(token_ids(stored))
        assert store.list_sessions(owner="alice")[0]["status"] == "partial"


def test_concurrent_recorders_lose_nothing(tiny_engine, recorded, tmp_path):
    path = tmp_path / "s.db"
    store = Store(path)
    replayed = recorded["live"]["specbranch"]
    results, errors = {}, []

    def generate(i):
        session_id = store.start_session(f"user{i}", f"prompt {i}", "t", "d", {})
        recorder = store.recorder(session_id, batch_size=7, interval=0.01)
        live = record_generation(tiny_engine, recorder, CONFIGS["sd" if i % 2 else "specbranch"], [2 + i, 3])
        results[recorder.run_id] = len(live)
        errors.append(recorder.error)

    def replay(i):  # a fast producer: many small batches competing for the write lock
        session_id = store.start_session(f"fast{i}", f"fast {i}", "t", "d", {})
        recorder = store.recorder(session_id, batch_size=3, interval=0.001)
        for event in replayed:
            recorder.add(event)
        errors.append(recorder.close())
        results[recorder.run_id] = len(replayed)

    threads = [threading.Thread(target=generate, args=(i,)) for i in range(3)]
    threads += [threading.Thread(target=replay, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [None] * 7 and len(results) == 7
    for run_id, count in results.items():
        assert event_rows(path, run_id) == count
    assert len(store.list_sessions()) == 7 and all(s["status"] == "complete" for s in store.list_sessions())
    assert store.integrity_check() == "ok"


def test_owners_see_their_own_and_shared_sessions(recorded, tmp_path):
    path = tmp_path / "s.db"
    store = Store(path)
    mine = store.start_session("alice", "alice's prompt", "t", "d", {})
    theirs = store.start_session("bob", "bob's prompt", "t", "d", {})
    public = store.start_session("bob", "bob's shared prompt", "t", "d", {}, shared=True)
    assert [s["id"] for s in store.list_sessions(owner="alice")] == [public, mine]
    assert [s["mine"] for s in store.list_sessions(owner="alice")] == [False, True]
    assert "owner" not in store.list_sessions(owner="alice")[0]
    assert [s["id"] for s in store.list_sessions(owner="alice", include_shared=False)] == [mine]
    assert store.get_session(public, owner="alice")["id"] == public
    with pytest.raises(SessionStoreError, match="no session"):
        store.get_session(theirs, owner="alice")
    with pytest.raises(SessionStoreError, match="no session"):
        store.delete_session(public, owner="alice")  # shared means readable, not deletable
    store.mark_shared(theirs, owner="bob")
    assert theirs in [s["id"] for s in store.list_sessions(owner="alice")]
    store.mark_shared(theirs, owner="bob", shared=False)
    assert theirs not in [s["id"] for s in store.list_sessions(owner="alice")]


def test_delete_removes_runs_and_events(recorded, tmp_path):
    path = tmp_path / "s.db"
    with Store(path) as store:
        keep = store.start_session("alice", "keep", "t", "d", {})
        gone = store.start_session("alice", "gone", "t", "d", {})
        for session_id in (keep, gone):
            recorder = store.recorder(session_id)
            for event in recorded["live"]["sd"]:
                recorder.add(event)
            recorder.close()
        gone_run = store.get_session(gone)["runs"][0]["id"]
        store.delete_session(gone, owner="alice")
        assert [s["id"] for s in store.list_sessions(owner="alice")] == [keep]
        assert event_rows(path, gone_run) == 0 and event_rows(path) == len(recorded["live"]["sd"])
        with sqlite3.connect(path) as conn:
            assert conn.execute("SELECT count(*) FROM runs").fetchone()[0] == 1
        with pytest.raises(SessionStoreError, match="no run"):
            store.load_run_events(gone_run)


NASTY = "50% off_'; DROP TABLE sessions;--"


def test_search_text_is_only_text(tmp_path):
    store = Store(tmp_path / "s.db")
    nasty = store.start_session("alice", f"please {NASTY} now", "t", "d", {})
    store.start_session("alice", "fifty percent off", "t", "d", {})
    store.start_session("alice", "offload_tasks", "t", "d", {})
    store.start_session("alice", "back\\slash", "t", "d", {})
    assert [s["id"] for s in store.list_sessions(search=NASTY)] == [nasty]
    assert [s["id"] for s in store.list_sessions(search="%")] == [nasty]  # '%' is a character, not "anything"
    assert len(store.list_sessions(search="_")) == 2  # the two prompts with an underscore, not every one
    assert len(store.list_sessions(search="'; DROP")) == 1 and len(store.list_sessions(search="\\")) == 1
    assert store.list_sessions(search="50%_off") == []
    assert len(store.list_sessions()) == 4  # the table survived
    assert len(store.list_sessions(search="OFF")) == 3  # case-insensitive, as a plain substring


def test_filters_by_method_time_and_pair(recorded, tmp_path):
    store = Store(tmp_path / "s.db")
    a = store.start_session("alice", "one", "target-a", "draft-a", {})
    b = store.start_session("alice", "two", "target-b", None, {})
    recorder = store.recorder(b)
    for event in recorded["live"]["sd"]:
        recorder.add(event)
    recorder.close()
    assert [s["id"] for s in store.list_sessions(method="sd")] == [b]
    assert [s["id"] for s in store.list_sessions(pair=("target-a", "draft-a"))] == [a]
    assert [s["id"] for s in store.list_sessions(pair=("target-b", None))] == [b]
    created = store.get_session(b)["created"]
    assert b in [s["id"] for s in store.list_sessions(since=created)]
    assert store.list_sessions(since=created + 1) == []
    assert store.list_sessions(limit=1)[0]["id"] == b
    session = store.get_session(b)
    assert session["versions"]["python"] and session["runs"][0]["method"] == "sd"
