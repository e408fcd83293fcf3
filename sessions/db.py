"""The session database file: where it lives, opening it (refusing a corrupt or foreign file), its
schema, transactions, and turning sqlite3/OS errors into a SessionStoreError with a plain message.

One file holds everything (WAL mode, so readers never wait for the writer). Tables: sessions (one
prompt each), runs (one per method generated on it), events (one row per event, `event.to_dict()`).
"""

from __future__ import annotations

import json
import os
import platform
import re
import secrets
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

import sqlite_utils

from engine.events import Event, Finished, RunStarted

SCHEMA_VERSION = 1
APPLICATION_ID = 0x53425231  # "SBR1" in the file header: marks a file as ours, so a foreign one is never written
BUSY_TIMEOUT_S = 30.0  # concurrent writers queue on SQLite's lock instead of failing
SAFE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # ids name export files: no separators, dots or control characters


class SessionStoreError(RuntimeError):
    """A user-facing store problem: the message says what is wrong with which file."""


def default_db_path() -> Path:
    """$SPECBRANCH_DB, else the user's data dir (never the code dir, which may be read-only or shared)."""
    env = os.environ.get("SPECBRANCH_DB")
    if env:
        return Path(env).expanduser()
    data_home = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data_home) / "specbranch" / "sessions.db"


def new_id() -> str:
    # unguessable: a session id is not a secret, but it should not be enumerable either
    return secrets.token_hex(8)


def is_safe_id(value: Any) -> bool:
    """A string of 1 to 64 letters, digits, '-' or '_' (what new_id makes is one)."""
    return isinstance(value, str) and SAFE_ID.fullmatch(value) is not None


def check_id(value: Any, what: str) -> str:
    """The id, or a SessionStoreError naming it: an id from a file may become part of a file name."""
    if not is_safe_id(value):
        raise SessionStoreError(f"{what} {value!r:.60} is not allowed: an id is 1 to 64 letters, digits, '-' or '_'")
    return value


def explain(exc: BaseException, path: Path | str) -> str:
    """A plain sentence for a sqlite3 or OS error on the database file."""
    name = getattr(exc, "sqlite_errorname", "") or ""
    msg = str(exc)
    low = msg.lower()
    if name == "SQLITE_FULL" or "disk is full" in low or getattr(exc, "errno", None) == 28:
        return f"the disk holding {path} is full ({msg})"
    if name.startswith("SQLITE_READONLY") or "readonly" in low or "read-only" in low:
        return f"{path} is read-only ({msg})"
    if name in ("SQLITE_NOTADB", "SQLITE_CORRUPT") or "not a database" in low or "malformed" in low:
        return f"{path} is not a readable SpecBranch session database: the file is corrupt or not SQLite ({msg})"
    if name.startswith("SQLITE_CANTOPEN") or "unable to open" in low:
        return f"cannot open {path}: its folder is missing or not writable ({msg})"
    if name.startswith("SQLITE_BUSY") or "locked" in low:
        return f"{path} is busy: another process holds its lock ({msg})"
    if isinstance(exc, OSError):
        return f"cannot use {path}: {exc.strerror or msg}"
    return f"session database {path}: {msg}"


@contextmanager
def store_errors(path: Path | str) -> Iterator[None]:
    """Turn sqlite3/OS errors into SessionStoreError (callers show the message, not a traceback)."""
    try:
        yield
    except SessionStoreError:
        raise
    except (sqlite3.Error, OSError) as exc:
        raise SessionStoreError(explain(exc, path)) from None
    except (OverflowError, UnicodeEncodeError) as exc:  # a value SQLite cannot hold: an int past 64 bits, a surrogate
        raise SessionStoreError(f"session database {path}: a value it cannot hold ({exc})") from None


def connect(path: Path, readonly: bool = False) -> sqlite3.Connection:
    """A raw connection. Autocommit mode: every write goes through `transaction`, nothing is left open.
    (Tests replace this function to simulate a full disk.)"""
    if readonly:
        return sqlite3.connect(
            Path(path).absolute().as_uri() + "?mode=ro",
            uri=True,
            isolation_level=None,
            check_same_thread=False,
            timeout=BUSY_TIMEOUT_S,
        )
    return sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_S)


@contextmanager
def transaction(db: sqlite_utils.Database) -> Iterator[sqlite_utils.Database]:
    """BEGIN IMMEDIATE takes the write lock up front, so a concurrent writer waits (busy timeout)
    instead of failing mid-transaction; sqlite-utils nests its own work as savepoints inside."""
    db.conn.execute("BEGIN IMMEDIATE")
    try:
        yield db
        db.conn.execute("COMMIT")  # may itself fail (disk full): then roll back below
    except BaseException:
        if db.conn.in_transaction:
            db.conn.execute("ROLLBACK")
        raise


def open_db(path: Path, readonly: bool = False, create: bool = True) -> sqlite_utils.Database:
    """Open (and on first use create) the session database; refuse a file that is not ours."""
    path = Path(path)
    with store_errors(path):
        if not path.exists():
            if readonly or not create:
                raise SessionStoreError(f"no session database at {path} (nothing recorded yet)")
            make_folder(path.parent)
        conn = connect(path, readonly)
        try:
            db = sqlite_utils.Database(conn, execute_plugins=False)
            check_schema(db, path, readonly)  # first: a foreign file must not be touched, not even its header
            if not readonly:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a crash loses at most the last commit
        except BaseException:
            conn.close()
            raise
    return db


def make_folder(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SessionStoreError(
            f"cannot create the folder {folder} for the session database: "
            f"{exc.strerror or exc}; set SPECBRANCH_DB to a writable file"
        ) from None


def check_schema(db: sqlite_utils.Database, path: Path, readonly: bool) -> None:
    app_id = db.execute("PRAGMA application_id").fetchone()[0]
    if app_id == 0 and not db.table_names():
        if readonly:
            raise SessionStoreError(f"{path} is an empty database opened read-only: nothing recorded yet")
        create_schema(db, path)
        return
    if app_id != APPLICATION_ID:
        tables = ", ".join(db.table_names()) or "none"
        raise SessionStoreError(
            f"{path} is not a SpecBranch session database (it is some other SQLite file, "
            f"tables: {tables}); point SPECBRANCH_DB at another file"
        )
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise SessionStoreError(
            f"{path} was written by a newer SpecBranch (schema {version}; this one reads up to {SCHEMA_VERSION})"
        )


def create_schema(db: sqlite_utils.Database, path: Path) -> None:
    with transaction(db):
        # re-check under the write lock: two processes may open a new file at the same moment
        if db.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID:
            return
        if db.table_names():
            raise SessionStoreError(f"{path} is not a SpecBranch session database (it has other tables)")
        db["sessions"].create(
            {
                "id": str,
                "created": float,
                "owner": str,
                "shared": int,
                "title": str,
                "prompt": str,
                "target": str,
                "draft": str,
                "config": str,
                "versions": str,
                "status": str,
            },
            pk="id",
            not_null={"created", "owner", "shared", "prompt", "status"},
        )
        db["runs"].create(
            {
                "id": str,
                "session_id": str,
                "ord": int,
                "method": str,
                "started": float,
                "finished": float,
                "status": str,
                "reason": str,
                "metrics": str,
                "token_count": int,
            },
            pk="id",
            foreign_keys=[("session_id", "sessions", "id")],
            not_null={"session_id", "ord", "method", "status", "token_count"},
        )
        db["events"].create(
            {"run_id": str, "seq": int, "type": str, "step": int, "data": str},
            pk=("run_id", "seq"),
            foreign_keys=[("run_id", "runs", "id")],
            not_null={"run_id", "seq", "type", "data"},
        )
        db["sessions"].create_index(["owner", "created"])
        db["sessions"].create_index(["created"])
        db["runs"].create_index(["session_id", "ord"])
        db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


@lru_cache(maxsize=1)
def software_versions() -> dict[str, str]:
    """Versions that produced a run, read without importing torch (cheap)."""

    def version(pkg):
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "not installed"

    return {
        "python": platform.python_version(),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "specbranch": code_version(),
    }


def code_version() -> str:
    """The git commit of this checkout, read from .git without a subprocess; "unknown" outside git."""
    git = Path(__file__).resolve().parent.parent / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if head.startswith("ref: "):
            ref = head[5:]
            ref_file = git / ref
            if ref_file.exists():
                return ref_file.read_text().strip()[:12]
            packed = (git / "packed-refs").read_text().splitlines()
            return next(line.split()[0][:12] for line in packed if line.endswith(" " + ref))
        return head[:12]
    except (OSError, StopIteration, IndexError):
        return "unknown"


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def event_row(run_id: str, seq: int, event: Event) -> dict:
    return {
        "run_id": run_id,
        "seq": seq,
        "type": event.type,
        "step": getattr(event, "step", None),
        "data": dumps(event.to_dict()),
    }


def run_finish_fields(start: RunStarted, done: Finished) -> dict:
    """Run columns that a Finished event decides (derived from events, so an import reproduces them)."""
    return {
        "status": "complete",
        "reason": done.reason,
        "metrics": dumps(done.metrics),
        "finished": round(start.wall_clock + done.prefill_s + done.decode_s, 6),
    }


def refresh_session_status(db: sqlite_utils.Database, session_id: str) -> None:
    """A session is partial while any of its runs is (live, stopped or crashed), complete when all are."""
    db.execute(
        "UPDATE sessions SET status = (SELECT CASE WHEN count(*) = 0 THEN 'empty' "
        "WHEN sum(status != 'complete') > 0 THEN 'partial' ELSE 'complete' END "
        "FROM runs WHERE session_id = ?) WHERE id = ?",
        [session_id, session_id],
    )


def like_pattern(text: str) -> str:
    """Search text as a literal substring: escape LIKE's wildcards (the text itself is a bound parameter)."""
    return "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def session_dict(row: dict, owner: str | None) -> dict:
    out = {k: row[k] for k in ("id", "created", "title", "prompt", "target", "draft", "status")}
    out["shared"] = bool(row["shared"])
    out["config"] = loads(row["config"])
    out["versions"] = loads(row["versions"])
    if owner is None:  # the owner id is a browser secret: only the local admin view (CLI) shows it
        out["owner"] = row["owner"]
    out["mine"] = owner is not None and row["owner"] == owner
    return out


def run_dict(row: dict) -> dict:
    return {
        "id": row["id"],
        "session_id": row["session_id"],
        "method": row["method"],
        "started": row["started"],
        "finished": row["finished"],
        "status": row["status"],
        "reason": row["reason"],
        "metrics": loads(row["metrics"]),
        "token_count": row["token_count"],
    }


def make_title(prompt_text: str, width: int = 80) -> str:
    line = next((ln.strip() for ln in (prompt_text or "").splitlines() if ln.strip()), "")
    return line if len(line) <= width else line[: width - 1] + "…"
