"""Sessions on bad ground: a corrupt or foreign file, a read-only place, a full disk and malformed imports
give a clear SessionStoreError; a recorder that cannot write says why and the generation still completes."""

from __future__ import annotations

import copy
import sqlite3

import pytest

import sessions.db as db_mod
from engine.events import Finished, TokensEmitted
from sessions.db import explain
from sessions.export import export_session, import_json, import_session
from sessions.store import Recorder, SessionStoreError, Store

from .test_sessions import CONFIGS, record_generation, recorded  # noqa: F401  (fixture)


def generate_unrecorded_ok(engine, recorder):
    """The generation completes whatever happens to the recorder."""
    live = record_generation(engine, recorder, CONFIGS["specbranch"])
    assert isinstance(live[-1], Finished)
    assert sum(len(e.tokens) for e in live if isinstance(e, TokensEmitted)) == 20
    return live


def test_corrupt_file(tiny_engine, tmp_path):
    path = tmp_path / "s.db"
    path.write_bytes(bytes(range(256)) * 40)
    with pytest.raises(SessionStoreError, match="not a readable SpecBranch session database"):
        Store(path)
    recorder = Recorder(path, "whatever")
    assert not recorder.recording and "corrupt or not SQLite" in recorder.error
    generate_unrecorded_ok(tiny_engine, recorder)
    assert path.read_bytes() == bytes(range(256)) * 40  # untouched


def test_foreign_sqlite_file(tmp_path):
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:  # another program's database, even with a "sessions" table
        conn.execute("CREATE TABLE sessions (cookie TEXT, expires INTEGER)")
        conn.execute("INSERT INTO sessions VALUES ('x', 1)")
    before = path.read_bytes()
    with pytest.raises(SessionStoreError, match=r"not a SpecBranch session database .*tables: sessions"):
        Store(path)
    assert path.read_bytes() == before


@pytest.mark.parametrize(
    "where, message",
    [
        ("/proc/specbranch-test/sessions.db", "cannot create the folder /proc/specbranch-test"),
        ("/proc/specbranch-test.db", "cannot open /proc/specbranch-test.db"),
    ],
)
def test_unwritable_location(where, message):
    with pytest.raises(SessionStoreError, match=message):  # fails as root too (chmod would not)
        Store(where)


def test_read_only_database(tiny_engine, tmp_path, monkeypatch):
    path = tmp_path / "s.db"
    with Store(path) as store:
        session_id = store.start_session("alice", "a b c", "t", "d", {})
    with Store(path, readonly=True) as ro:
        assert [s["id"] for s in ro.list_sessions()] == [session_id]  # reading works
        with pytest.raises(SessionStoreError, match="read-only"):
            ro.start_session("alice", "x", "t", "d", {})
        assert "read-only" in ro.recorder(session_id).error
    # a file SQLite could only open read-only: the recorder finds out at its first write
    real = db_mod.connect
    monkeypatch.setattr(db_mod, "connect", lambda p, readonly=False: real(p, True))
    recorder = Recorder(path, session_id)
    generate_unrecorded_ok(tiny_engine, recorder)
    assert "is read-only" in recorder.error and not recorder.recording
    monkeypatch.undo()
    with Store(path) as store:
        assert store.get_session(session_id)["runs"] == [] and store.integrity_check() == "ok"


def full_disk(monkeypatch):
    """Connections that may not grow the file by a single page: SQLite's own SQLITE_FULL."""
    real = db_mod.connect

    def tiny(path, readonly=False):
        conn = real(path, readonly)
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count = {pages}")
        return conn

    monkeypatch.setattr(db_mod, "connect", tiny)


def test_full_disk(tiny_engine, tmp_path, monkeypatch):
    path = tmp_path / "s.db"
    with Store(path) as store:
        session_id = store.start_session("alice", "a b c", "t", "d", {})
    full_disk(monkeypatch)
    with Store(path) as store:
        with pytest.raises(SessionStoreError, match="is full"):
            store.start_session("alice", "x" * 20000, "t", "d", {})
        recorder = store.recorder(session_id)
        generate_unrecorded_ok(tiny_engine, recorder)
        assert recorder.error.startswith(f"the disk holding {path} is full")
        recorder.add(Finished("length", 0.0, 0.0, 0, {}))  # dropped, no error
        assert store.integrity_check() == "ok"
        assert store.get_session(session_id)["status"] == "empty"


def test_plain_errors_are_explained():
    assert "is full" in explain(sqlite3.OperationalError("database or disk is full"), "x.db")
    assert "read-only" in explain(sqlite3.OperationalError("attempt to write a readonly database"), "x.db")
    assert "is busy" in explain(sqlite3.OperationalError("database is locked"), "x.db")


def test_recorder_for_a_missing_session(tiny_engine, tmp_path):
    with Store(tmp_path / "s.db") as store:
        recorder = store.recorder("nope")
        generate_unrecorded_ok(tiny_engine, recorder)
        assert "no session 'nope'" in recorder.error


def test_recorder_disabled():
    recorder = Recorder.disabled("not recording: test")
    recorder.add(Finished("length", 0.0, 0.0, 0, {}))
    assert recorder.close() == "not recording: test" and not recorder.recording


def corrupt(doc, how):
    doc = copy.deepcopy(doc)
    events = doc["runs"][1]["events"]
    step_event = next(e for e in events if "step" in e)
    if how == "version":
        doc["version"] = 99
    elif how == "format":
        doc["format"] = "something-else"
    elif how == "missing session field":
        del doc["session"]["prompt"]
    elif how == "missing run field":
        del doc["runs"][0]["events"]
    elif how == "unknown event type":
        events[3]["type"] = "teleported"
    elif how == "unknown event field":
        events[3]["colour"] = "red"
    elif how == "missing event field":
        del step_event["step"]
    elif how == "wrong event field type":
        step_event["step"] = "three"
    elif how == "bool is not a number":
        step_event["step"] = True
    elif how == "nested type":
        next(e for e in events if e["type"] == "tokens_emitted")["tokens"] = [1, "b"]
    elif how == "first event":
        events.pop(0)
    elif how == "lying status":
        doc["runs"][1]["status"] = "partial"
    elif how == "lying token count":
        doc["runs"][1]["token_count"] = 3
    return doc


@pytest.mark.parametrize(
    "how, reason",
    [
        ("version", "version 99 is not supported"),
        ("format", "not a session file"),
        ("missing session field", "session is missing fields: prompt"),
        ("missing run field", "run 1 is missing fields: events"),
        ("unknown event type", "run 2, event 4: unknown event type 'teleported'"),
        ("unknown event field", "run 2, event 4: .*unknown fields \\['colour'\\]"),
        ("missing event field", "run 2, event .*step"),
        ("wrong event field type", "field 'step' should be int, got 'three'"),
        ("bool is not a number", "field 'step' should be int, got True"),
        ("nested type", "field 'tokens' should be list\\[int\\]"),
        ("first event", "must begin with a run_started event"),
        ("lying status", "run 2: status is 'partial', but its events say 'complete'"),
        ("lying token count", "run 2: token_count is 3, but its events say 20"),
    ],
)
def test_malformed_import_is_refused_with_the_reason(recorded, tmp_path, how, reason):  # noqa: F811
    doc = export_session(recorded["store"], recorded["session_id"])
    with Store(tmp_path / "s.db") as store:
        with pytest.raises(SessionStoreError, match=reason):
            import_session(store, corrupt(doc, how), owner="bob")
        assert store.list_sessions() == []  # nothing written
        import_session(store, doc, owner="bob")  # the intact file imports
        with pytest.raises(SessionStoreError, match="already in"):
            import_session(store, doc, owner="bob")
        assert len(store.list_sessions()) == 1


@pytest.mark.parametrize(
    "text, reason",
    [
        ("{not json", "not valid JSON"),
        (b"\xff\xfe\x00garbage", "not valid JSON"),
        ("[1, 2]", "not a session file"),
        ('{"format": "specbranch-session", "version": 1, "session": {}, "runs": []}', "session is missing fields"),
    ],
)
def test_import_of_non_session_text(tmp_path, text, reason):
    with Store(tmp_path / "s.db") as store:
        with pytest.raises(SessionStoreError, match=reason):
            import_json(store, text, owner="bob")
        assert store.list_sessions() == []
