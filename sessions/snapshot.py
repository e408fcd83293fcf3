"""Sessions that outlive a Space's restarts: SQLite on local disk, copied now and then to a mounted bucket.

A Space's own disk is lost on restart, and `/data` persistent storage is gone; what persists is a storage bucket
mounted at a path of one's choosing. SQLite in WAL mode wants a local file system (its locks and shared memory do
not work on object storage), so the store stays local and a consistent copy goes to the bucket:
`SPECBRANCH_SNAPSHOT_DIR=/mnt/bucket` (docs/hosting.md). At start an empty local store is seeded from the newest
snapshot; after that the store is copied there at most every `every_s` seconds while it changes, and once more at
exit. A copy is made with SQLite's online backup (sqlite3.Connection.backup: consistent while recorders write) into a
temporary file in the bucket, then renamed over the snapshot, so a snapshot is never half written. A bucket that
cannot be read or written is reported (`last_error`) and never stops recording.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path

SNAPSHOT_NAME = "sessions.db"
EVERY_S = 60.0


class Snapshots:
    def __init__(self, db_path: Path | str, folder: Path | str, every_s: float = EVERY_S):
        self.db_path, self.folder, self.every_s = Path(db_path), Path(folder), every_s
        self.last_error = ""
        self._copied_mtime: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def snapshot(self) -> Path:
        return self.folder / SNAPSHOT_NAME

    def seed(self) -> bool:
        """Copy the snapshot to the local path where the local store does not exist yet; whether it did."""
        if self.db_path.exists() or not self.snapshot.exists():
            return False
        try:
            self.db_path.parent.mkdir(parents=True, exist_ok=True)
            copy_database(self.snapshot, self.db_path)
        except (OSError, sqlite3.Error) as exc:
            self.last_error = f"could not seed {self.db_path} from {self.snapshot}: {exc}"
            return False
        self._copied_mtime = modified(self.db_path)
        return True

    def copy_if_changed(self) -> bool:
        """Copy the local store to the bucket if it changed since the last copy; whether it copied."""
        mtime = modified(self.db_path)
        if mtime is None or mtime == self._copied_mtime:
            return False
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            partial = self.folder / f".{SNAPSHOT_NAME}.{os.getpid()}.partial"
            copy_database(self.db_path, partial)
            partial.replace(self.snapshot)
        except (OSError, sqlite3.Error) as exc:
            self.last_error = f"could not copy the sessions to {self.folder}: {exc}"
            return False
        self._copied_mtime, self.last_error = mtime, ""
        return True

    def start(self) -> None:
        """Copy every `every_s` seconds on a daemon thread, and at stop()."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True, name="session-snapshots")
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.copy_if_changed()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.every_s + 5)
        self.copy_if_changed()


def modified(path: Path) -> float | None:
    """The newest change to a WAL-mode database: the file or its write-ahead log."""
    times = [p.stat().st_mtime_ns for p in (path, path.with_name(path.name + "-wal")) if p.exists()]
    return max(times) if times else None


def copy_database(source: Path, target: Path) -> None:
    """A consistent copy of the SQLite database `source` at `target` (replaced), by SQLite's online backup, in
    rollback-journal mode, so that opening the copy (a snapshot on a bucket) makes no -wal or -shm files beside it."""
    target.unlink(missing_ok=True)
    src = sqlite3.connect(source, timeout=30)
    try:
        dst = sqlite3.connect(target)
        try:
            src.backup(dst)
            dst.execute("PRAGMA journal_mode=DELETE")
        finally:
            dst.close()
    finally:
        src.close()


def from_environment(db_path: Path | str) -> Snapshots | None:
    """Snapshots to $SPECBRANCH_SNAPSHOT_DIR, seeded and started, or None where it is not set."""
    folder = os.environ.get("SPECBRANCH_SNAPSHOT_DIR")
    if not folder:
        return None
    snapshots = Snapshots(db_path, Path(folder).expanduser())
    snapshots.seed()
    snapshots.start()
    return snapshots
