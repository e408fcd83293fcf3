"""Sessions that outlive a Space's restart (sessions/snapshot.py): the store stays on local disk, a consistent copy
goes to a mounted bucket, and a fresh machine starts from it."""

from __future__ import annotations

import sqlite3

from engine.config import GenerationConfig
from sessions import Store
from sessions.snapshot import SNAPSHOT_NAME, Snapshots, from_environment


def record(store: Store, engine, prompt: str) -> str:
    sid = store.start_session("me", prompt, "t", "d", GenerationConfig(method="sd", max_new_tokens=6))
    recorder = store.recorder(sid)
    engine.run([2, 3, 4], GenerationConfig(method="sd", max_new_tokens=6), prompt, on_event=recorder.add)
    assert recorder.close() is None
    return sid


def integrity(path) -> str:
    with sqlite3.connect(path) as db:
        return db.execute("PRAGMA integrity_check").fetchone()[0]


def test_a_restarted_space_starts_from_the_bucket(tmp_path, tiny_engine):
    local, bucket = tmp_path / "disk" / "sessions.db", tmp_path / "bucket"
    snapshots = Snapshots(local, bucket)
    assert not snapshots.seed()  # nothing to seed from yet
    with Store(local) as store:
        sid = record(store, tiny_engine, "first")
        assert snapshots.copy_if_changed() and not snapshots.copy_if_changed()  # unchanged: no second copy
        record(store, tiny_engine, "second")  # written while the first copy exists, and copied at stop
        snapshots.stop()
    assert integrity(bucket / SNAPSHOT_NAME) == "ok"
    assert not list(bucket.glob("*-wal")) and not list(bucket.glob("*.partial"))
    local.unlink()  # the Space restarts on an empty disk
    for extra in local.parent.glob("sessions.db-*"):
        extra.unlink()
    again = Snapshots(local, bucket)
    assert again.seed()
    with Store(local) as store:
        prompts = {s["prompt"] for s in store.list_sessions(owner="me")}
        assert prompts == {"first", "second"}
        assert store.get_session(sid, "me")["runs"][0]["status"] == "complete"


def test_a_bucket_that_cannot_be_written_is_reported_and_recording_goes_on(tmp_path, tiny_engine):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the bucket should be")
    snapshots = Snapshots(tmp_path / "sessions.db", blocker)
    with Store(tmp_path / "sessions.db") as store:
        record(store, tiny_engine, "kept")
        assert not snapshots.copy_if_changed() and "could not copy the sessions" in snapshots.last_error
        assert [s["prompt"] for s in store.list_sessions(owner="me")] == ["kept"]


def test_the_variable_turns_snapshots_on(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECBRANCH_SNAPSHOT_DIR", raising=False)
    assert from_environment(tmp_path / "s.db") is None
    monkeypatch.setenv("SPECBRANCH_SNAPSHOT_DIR", str(tmp_path / "bucket"))
    snapshots = from_environment(tmp_path / "s.db")
    try:
        assert snapshots.folder == tmp_path / "bucket" and snapshots._thread.is_alive()
    finally:
        snapshots.stop()
