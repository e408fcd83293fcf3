"""Sessions, runs and their events in SQLite: the Store (write sessions, list, load, share, delete).

A session is one prompt; it has one run per method generated on it; a run is the exact event stream.
Recording a run goes through a Recorder (recorder.py) so that writes never block the token stream.
Every database problem surfaces as a SessionStoreError whose message says what is wrong.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlite_utils

from engine.events import Event, from_dict

from .db import (
    SessionStoreError,
    default_db_path,
    dumps,
    event_row,
    like_pattern,
    make_title,
    new_id,
    open_db,
    refresh_session_status,
    run_dict,
    session_dict,
    software_versions,
    store_errors,
    transaction,
)
from .recorder import Recorder

__all__ = ["Store", "Recorder", "SessionStoreError", "default_db_path"]


class Store:
    """The session database. Thread-safe (one connection behind a lock); recorders use their own."""

    def __init__(self, path: Path | str | None = None, readonly: bool = False, create: bool = True):
        self.path = Path(path).expanduser() if path is not None else default_db_path()
        self.readonly = readonly
        self._lock = threading.RLock()
        self.db = open_db(self.path, readonly, create)

    def close(self) -> None:
        with self._lock:
            self.db.conn.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite_utils.Database]:
        with self._lock, store_errors(self.path), transaction(self.db) as db:
            yield db

    def _query(self, sql: str, params: list | tuple = ()) -> list[dict]:
        with self._lock, store_errors(self.path):
            return list(self.db.query(sql, params))

    # -- writing -----------------------------------------------------------------------------------

    def start_session(
        self,
        owner: str,
        prompt_text: str,
        target: str,
        draft: str | None,
        config: Any,
        shared: bool = False,
        title: str | None = None,
    ) -> str:
        """A new session (one prompt; its runs come from recorders). Returns its id."""
        config = config.to_dict() if hasattr(config, "to_dict") else dict(config or {})
        session_id = new_id()
        row = {
            "id": session_id,
            "created": round(time.time(), 6),
            "owner": owner,
            "shared": int(bool(shared)),
            "title": title if title is not None else make_title(prompt_text),
            "prompt": prompt_text,
            "target": target,
            "draft": draft,
            "config": dumps(config),
            "versions": dumps(software_versions()),
            "status": "empty",
        }
        with self._write() as db:
            db["sessions"].insert(row)
        return session_id

    def recorder(
        self, session_id: str, batch_size: int = 50, interval: float = 0.2, owns_session: bool = False
    ) -> Recorder:
        """A Recorder for one new run of this session (never raises: a problem shows in `recorder.error`).
        owns_session: the session was started for this run, and goes if the run records nothing."""
        if self.readonly:
            return Recorder.disabled(f"{self.path} is opened read-only")
        return Recorder(self.path, session_id, batch_size, interval, owns_session)

    def insert_session(self, session: dict, runs: list[dict], owner: str, shared: bool = False) -> None:
        """Write a whole session at once (used by import; `runs` carry their events as Event objects).
        Refused, writing nothing, when its session or run ids are already taken."""
        with self._write() as db:
            if db.execute("SELECT 1 FROM sessions WHERE id = ?", [session["id"]]).fetchone():
                raise SessionStoreError(f"session {session['id']!r} is already in {self.path}")
            for run in runs:
                if db.execute("SELECT 1 FROM runs WHERE id = ?", [run["id"]]).fetchone():
                    raise SessionStoreError(f"run {run['id']!r} is already in {self.path}")
            db["sessions"].insert(
                {
                    **{k: session[k] for k in ("id", "created", "title", "prompt", "target", "draft")},
                    "owner": owner,
                    "shared": int(bool(shared)),
                    "config": dumps(session["config"]),
                    "versions": dumps(session["versions"]),
                    "status": "empty",
                }
            )
            for ord_, run in enumerate(runs):
                db["runs"].insert(
                    {
                        "id": run["id"],
                        "session_id": session["id"],
                        "ord": ord_,
                        "method": run["method"],
                        "started": run["started"],
                        "finished": run["finished"],
                        "status": run["status"],
                        "reason": run["reason"],
                        "token_count": run["token_count"],
                        "metrics": None if run["metrics"] is None else dumps(run["metrics"]),
                    }
                )
                db["events"].insert_all(event_row(run["id"], seq, e) for seq, e in enumerate(run["events"]))
            refresh_session_status(db, session["id"])

    def mark_shared(self, session_id: str, owner: str | None, shared: bool = True) -> None:
        """Share (or unshare) a session with every browser; only its owner may (owner None: local admin)."""
        self._owned(session_id, owner)
        with self._write() as db:
            db.execute("UPDATE sessions SET shared = ? WHERE id = ?", [int(bool(shared)), session_id])

    def delete_session(self, session_id: str, owner: str | None) -> None:
        """Delete a session with all its runs and events; only its owner may (owner None: local admin)."""
        self._owned(session_id, owner)
        with self._write() as db:
            db.execute("DELETE FROM events WHERE run_id IN (SELECT id FROM runs WHERE session_id = ?)", [session_id])
            db.execute("DELETE FROM runs WHERE session_id = ?", [session_id])
            db.execute("DELETE FROM sessions WHERE id = ?", [session_id])

    def _owned(self, session_id: str, owner: str | None) -> None:
        rows = self._query("SELECT owner FROM sessions WHERE id = ?", [session_id])
        if not rows or (owner is not None and rows[0]["owner"] != owner):
            # the same message either way: do not reveal that someone else's session exists
            raise SessionStoreError(f"no session {session_id!r} of yours in {self.path}")

    # -- reading -----------------------------------------------------------------------------------

    def list_sessions(
        self,
        owner: str | None = None,
        search: str | None = None,
        method: str | None = None,
        since: float | None = None,
        pair: tuple[str, str | None] | None = None,
        include_shared: bool = True,
        limit: int | None = 100,
    ) -> list[dict]:
        """Newest first. owner=None lists everyone's (local admin/CLI); otherwise that owner's sessions
        plus shared ones. search: literal substring of the title or prompt (ASCII case-insensitive);
        method: has a run of that method; since: created at or after this unix time; pair: (target, draft)."""
        where, params = [], []
        if owner is not None:
            where.append("(owner = ? OR shared = 1)" if include_shared else "owner = ?")
            params.append(owner)
        if search:
            where.append("(prompt LIKE ? ESCAPE '\\' OR title LIKE ? ESCAPE '\\')")
            params += [like_pattern(search)] * 2
        if method:
            where.append("id IN (SELECT session_id FROM runs WHERE method = ?)")
            params.append(method)
        if since is not None:
            where.append("created >= ?")
            params.append(float(since))
        if pair is not None:
            where.append("target = ? AND draft IS ?")
            params += [pair[0], pair[1]]
        sql = "SELECT * FROM sessions" + (" WHERE " + " AND ".join(where) if where else "")
        rows = self._query(
            sql + " ORDER BY created DESC, rowid DESC LIMIT ?", params + [-1 if limit is None else int(limit)]
        )
        runs = self._runs_of([r["id"] for r in rows])
        out = []
        for row in rows:
            item = session_dict(row, owner)
            mine = runs.get(row["id"], [])
            item["methods"] = [r["method"] for r in mine]
            item["runs"] = len(mine)
            item["token_count"] = sum(r["token_count"] for r in mine)
            out.append(item)
        return out

    def _runs_of(self, session_ids: list[str]) -> dict[str, list[dict]]:
        if not session_ids:
            return {}
        marks = ",".join("?" * len(session_ids))
        rows = self._query(f"SELECT * FROM runs WHERE session_id IN ({marks}) ORDER BY ord, started", session_ids)
        out: dict[str, list[dict]] = {}
        for row in rows:
            out.setdefault(row["session_id"], []).append(run_dict(row))
        return out

    def get_session(self, session_id: str, owner: str | None = None) -> dict:
        """One session with its runs (no events). With an owner: theirs or shared, else 'no session'."""
        rows = self._query("SELECT * FROM sessions WHERE id = ?", [session_id])
        if not rows or (owner is not None and rows[0]["owner"] != owner and not rows[0]["shared"]):
            raise SessionStoreError(f"no session {session_id!r} in {self.path}")
        item = session_dict(rows[0], owner)
        item["runs"] = self._runs_of([session_id]).get(session_id, [])
        return item

    def load_run_events(self, run_id: str) -> list[Event]:
        """The run's events exactly as they were generated (a partial run: those written before it stopped)."""
        rows = self._query("SELECT data FROM events WHERE run_id = ? ORDER BY seq", [run_id])
        if not rows and not self._query("SELECT 1 FROM runs WHERE id = ?", [run_id]):
            raise SessionStoreError(f"no run {run_id!r} in {self.path}")
        return [from_dict(json.loads(r["data"])) for r in rows]

    def load_session_events(self, session_id: str, owner: str | None = None) -> list[list[Event]]:
        """Every run of a session, in order, as event lists (e.g. for the compare view or a trace)."""
        return [self.load_run_events(run["id"]) for run in self.get_session(session_id, owner)["runs"]]

    def integrity_check(self) -> str:
        """SQLite's own check: "ok" when the file is sound."""
        return "; ".join(r["integrity_check"] for r in self._query("PRAGMA integrity_check"))
