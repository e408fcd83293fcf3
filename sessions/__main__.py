"""Command line for the session database:
  python -m sessions list [--db PATH] [--search TEXT] [--method M] [--json]
  python -m sessions export SESSION_ID [OUT.json] [--trace OUT.trace.json] [--db PATH]
  python -m sessions import FILE.json [--owner ID] [--shared] [--db PATH]
  python -m sessions delete SESSION_ID [--db PATH]
Errors print `error: ...` to stderr and exit 2. The CLI is the local admin: it sees every owner's sessions."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .export import read_import, write_export, write_trace
from .store import SessionStoreError, Store, default_db_path


def build_parser() -> argparse.ArgumentParser:
    db = argparse.ArgumentParser(add_help=False)
    db.add_argument(
        "--db", type=Path, default=None, help=f"session database (default: $SPECBRANCH_DB or {default_db_path()})"
    )
    parser = argparse.ArgumentParser(prog="python -m sessions", description="Recorded SpecBranch sessions.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", parents=[db], help="list sessions, newest first")
    p.add_argument("--search", default=None, help="literal text in the prompt or title")
    p.add_argument("--method", default=None, help="only sessions with a run of this method")
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p = sub.add_parser("export", parents=[db], help="write a session as JSON and/or a Chrome trace")
    p.add_argument("session_id")
    p.add_argument("out", nargs="?", type=Path, default=None, help="session JSON file to write")
    p.add_argument("--trace", type=Path, default=None, help="Chrome trace file to write (open in Perfetto)")
    p = sub.add_parser("import", parents=[db], help="add a session from an exported JSON file")
    p.add_argument("file", type=Path)
    p.add_argument("--owner", default="local", help="owner id to give it (default: local)")
    p.add_argument("--shared", action="store_true", help="show it to every browser in the app")
    p = sub.add_parser("delete", parents=[db], help="delete a session with its runs and events")
    p.add_argument("session_id")
    return parser


def cmd_list(args) -> None:
    path = args.db or default_db_path()
    if not path.exists():  # nothing recorded yet is not an error
        print("[]" if args.json else f"no sessions ({path} does not exist yet)")
        return
    with Store(path, create=False) as store:
        rows = store.list_sessions(search=args.search, method=args.method, limit=args.limit)
    if args.json:
        print(json.dumps(rows, indent=1, ensure_ascii=False))
        return
    print(f"{'ID':16}  {'CREATED':16}  {'STATUS':8}  {'METHODS':24}  PROMPT")
    for r in rows:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(r["created"]))
        print(f"{r['id']:16}  {created:16}  {r['status']:8}  {','.join(r['methods']):24}  {r['title']}")


SQLITE_HEADER = b"SQLite format 3\x00"


def not_the_database(out: Path | None, db: Path) -> None:
    """Refuse an output that is the database being read (or its -wal, -shm or -journal file), or any SQLite file (a
    store of another --db, say): writing there would destroy a store."""
    if out is None:
        return
    target = out.expanduser().resolve()
    for name in (Path(f"{db}{suffix}") for suffix in ("", "-wal", "-shm", "-journal")):  # db may be "" (--db '')
        if target == name.expanduser().resolve():
            raise SessionStoreError(f"will not write {out} over the session database {db}: name another file")
    try:
        with open(target, "rb") as f:
            is_sqlite = f.read(len(SQLITE_HEADER)) == SQLITE_HEADER
    except OSError:  # missing (to be made), or a folder: writing says so
        return
    if is_sqlite:
        raise SessionStoreError(f"will not write {out} over an SQLite file (a session database?): name another file")


def cmd_export(args) -> None:
    if args.out is None and args.trace is None:
        raise SessionStoreError("say where to write: OUT.json and/or --trace OUT.trace.json")
    db = args.db or default_db_path()
    not_the_database(args.out, db)
    not_the_database(args.trace, db)
    with Store(args.db, create=False) as store:
        if args.out is not None:
            print(f"wrote {write_export(store, args.session_id, args.out)}")
        if args.trace is not None:
            print(f"wrote {write_trace(store, args.session_id, args.trace)}")


def cmd_import(args) -> None:
    with Store(args.db) as store:
        session_id = read_import(store, args.file, args.owner, args.shared)
    print(f"imported session {session_id}")


def cmd_delete(args) -> None:
    with Store(args.db, create=False) as store:
        store.delete_session(args.session_id, owner=None)
    print(f"deleted session {args.session_id}")


COMMANDS = {"list": cmd_list, "export": cmd_export, "import": cmd_import, "delete": cmd_delete}


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse has printed its own usage error (exit 2) or the help (exit 0)
        return int(exc.code or 0)
    try:
        COMMANDS[args.command](args)
    except SessionStoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
