"""The Recorder: records one run from its live event stream without ever blocking it.

`add(event)` only puts the event on a queue; a background thread writes batches and commits. A store
problem sets `error` (a plain message) and later events are dropped: generation goes on, unrecorded.
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any

import sqlite_utils

from engine.events import Event, Finished, RunStarted, TokensEmitted
from engine.measure.metrics import compute_metrics

from .db import (
    SessionStoreError,
    dumps,
    event_row,
    new_id,
    open_db,
    refresh_session_status,
    run_finish_fields,
    store_errors,
    transaction,
)

_STOP = object()


class Recorder:
    """Records one run. `add(event)` only puts the event on a queue (it never blocks the token stream);
    a background thread writes batches (every `batch_size` events or `interval` seconds) and commits.
    The run row is created from the RunStarted event; it stays "partial" until a Finished event is
    written, so a cancelled or killed run is kept, marked partial. Any store problem sets `error`
    (a plain message), after which events are dropped: generation goes on, unrecorded."""

    def __init__(
        self, path: Path | str, session_id: str, batch_size: int = 50, interval: float = 0.2, owns_session: bool = False
    ):
        self.path = Path(path)
        self.session_id = session_id
        self.owns_session = owns_session  # the session was started for this run: no run, no session
        self.run_id = new_id()
        self.batch_size = max(1, batch_size)
        self.interval = interval
        self.error: str | None = None
        self.written = 0  # events committed so far
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._events: list[Event] = []  # the writer's copy, for metrics of a run that stops early
        self._start: RunStarted | None = None
        self._finished = False
        self._tokens = 0
        try:
            self._db = open_db(self.path)
        except SessionStoreError as exc:
            self.error = str(exc)
            return
        self._thread = threading.Thread(target=self._write_loop, daemon=True, name=f"specbranch-rec-{self.run_id}")
        self._thread.start()

    @classmethod
    def disabled(cls, reason: str) -> Recorder:
        """A recorder that records nothing (e.g. when the store could not be opened)."""
        rec = cls.__new__(cls)
        rec.path, rec.session_id, rec.run_id, rec.error, rec.written = None, None, None, reason, 0
        rec._closed, rec._thread = True, None
        return rec

    @property
    def recording(self) -> bool:
        return self.error is None and not self._closed

    def add(self, event: Event) -> None:
        if self.error is None and not self._closed:
            self._queue.put(event)

    def close(self, timeout: float = 30.0) -> str | None:
        """Write what is queued and stop. Returns the error message, if recording failed."""
        if not self._closed:
            self._closed = True
            if self._thread is not None:
                self._queue.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout)
        return self.error

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the writer thread -------------------------------------------------------------------------

    def _write_loop(self) -> None:
        pending: list[Event] = []
        deadline = 0.0
        try:
            while True:
                wait = max(0.0, deadline - time.monotonic()) if pending else None
                try:
                    item = self._queue.get(timeout=wait)
                except queue.Empty:
                    item = None
                if item is _STOP:
                    break
                if item is not None:
                    if not pending:
                        deadline = time.monotonic() + self.interval
                    pending.append(item)
                if pending and (len(pending) >= self.batch_size or time.monotonic() >= deadline):
                    self._flush(pending)
                    pending = []
            self._flush(pending)
            self._finish_partial()
            self._drop_empty_session()
        finally:
            self._db.conn.close()

    def _flush(self, batch: list[Event]) -> None:
        if self.error is not None or not batch:
            return
        try:
            with store_errors(self.path), transaction(self._db) as db:
                self._write_batch(db, batch)
        except SessionStoreError as exc:
            self.error = str(exc)
            return
        except Exception as exc:  # anything else must not kill the writer silently either
            self.error = f"recording failed: {type(exc).__name__}: {exc}"
            return
        self._events.extend(batch)
        self.written += len(batch)

    def _write_batch(self, db: sqlite_utils.Database, batch: list[Event]) -> None:
        seq = self.written
        if seq == 0:
            self._create_run(db, batch[0])
        updates: dict[str, Any] = {}
        for event in batch:
            if isinstance(event, TokensEmitted):
                self._tokens += len(event.tokens)
            elif isinstance(event, Finished) and not self._finished:
                updates.update(run_finish_fields(self._start, event))
                self._finished = True
        db["events"].insert_all(event_row(self.run_id, seq + i, e) for i, e in enumerate(batch))
        updates["token_count"] = self._tokens
        db["runs"].update(self.run_id, updates)
        if "status" in updates:
            refresh_session_status(db, self.session_id)

    def _create_run(self, db: sqlite_utils.Database, first: Event) -> None:
        if not isinstance(first, RunStarted):
            raise SessionStoreError(f"a run must begin with a run_started event, got {first.type!r}")
        if not db.execute("SELECT 1 FROM sessions WHERE id = ?", [self.session_id]).fetchone():
            raise SessionStoreError(f"no session {self.session_id!r} in {self.path}")
        ord_ = db.execute(
            "SELECT coalesce(max(ord), -1) + 1 FROM runs WHERE session_id = ?", [self.session_id]
        ).fetchone()[0]
        self._start = first
        db["runs"].insert(
            {
                "id": self.run_id,
                "session_id": self.session_id,
                "ord": ord_,
                "method": first.method,
                "started": first.wall_clock,
                "finished": None,
                "status": "partial",
                "reason": None,
                "metrics": None,
                "token_count": 0,
            }
        )
        refresh_session_status(db, self.session_id)

    def _drop_empty_session(self) -> None:
        """A session started for a run that never began (refused or failed before its first event) is removed, so a
        request that ran nothing leaves no row behind. Only a session of no runs, and only the one this run owns."""
        if not self.owns_session or self.written or self.error is not None:
            return
        try:
            with store_errors(self.path), transaction(self._db) as db:
                db.execute(
                    "DELETE FROM sessions WHERE id = ? AND NOT EXISTS (SELECT 1 FROM runs WHERE session_id = ?)",
                    [self.session_id, self.session_id],
                )
        except SessionStoreError as exc:
            self.error = str(exc)

    def _finish_partial(self) -> None:
        """A stream that ended without Finished (stopped, crashed): keep it, partial, with the metrics so far."""
        if self.error is not None or self._finished or not self._events:
            return
        try:
            with store_errors(self.path), transaction(self._db) as db:
                db["runs"].update(self.run_id, {"metrics": dumps(compute_metrics(self._events))})
        except SessionStoreError as exc:
            self.error = str(exc)
        except Exception as exc:
            self.error = f"recording failed: {type(exc).__name__}: {exc}"
