"""python -m sessions: list, export (JSON and Chrome trace), import and delete, in-process."""

from __future__ import annotations

import json
import sqlite3

from sessions.__main__ import main

from .test_sessions import recorded  # noqa: F401  (fixture)


def test_list_export_import_delete(recorded, tmp_path, capsys):  # noqa: F811
    db, session_id = str(recorded["path"]), recorded["session_id"]
    assert main(["list", "--db", db, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in rows] == [session_id] and rows[0]["methods"] == ["specbranch", "sd"]
    assert main(["list", "--db", db, "--search", "a b"]) == 0
    assert session_id in capsys.readouterr().out
    assert main(["list", "--db", db, "--search", "zzz", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []

    out, trace = tmp_path / "s.json", tmp_path / "s.trace.json"
    assert main(["export", session_id, str(out), "--trace", str(trace), "--db", db]) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == sum(
        e.type == "timing_span" for r in recorded["live"].values() for e in r
    )
    assert "wrote" in capsys.readouterr().out

    other = str(tmp_path / "other.db")
    assert main(["import", str(out), "--db", other, "--shared"]) == 0
    assert session_id in capsys.readouterr().out
    again = tmp_path / "again.json"
    assert main(["export", session_id, str(again), "--db", other]) == 0
    assert again.read_bytes() == out.read_bytes()

    assert main(["delete", session_id, "--db", other]) == 0
    assert f"deleted session {session_id}" in capsys.readouterr().out
    assert main(["list", "--db", other, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    with sqlite3.connect(other) as conn:
        assert conn.execute("SELECT count(*) FROM events").fetchone()[0] == 0


def test_errors_exit_2_with_a_message(recorded, tmp_path, capsys):  # noqa: F811
    db = str(recorded["path"])
    assert main(["delete", "no-such-id", "--db", db]) == 2
    assert "error: no session 'no-such-id'" in capsys.readouterr().err
    assert main(["export", "no-such-id", str(tmp_path / "x.json"), "--db", db]) == 2
    assert "error: no session 'no-such-id'" in capsys.readouterr().err
    assert main(["export", recorded["session_id"], "--db", db]) == 2
    assert "error: say where to write" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "specbranch-session", "version": 7}')
    assert main(["import", str(bad), "--db", str(tmp_path / "new.db")]) == 2
    assert "error: session file version 7 is not supported" in capsys.readouterr().err
    assert main(["import", str(tmp_path / "missing.json"), "--db", str(tmp_path / "new.db")]) == 2
    assert "error: cannot read" in capsys.readouterr().err
    assert main(["delete", "x", "--db", str(tmp_path / "nothing.db")]) == 2
    assert "error: no session database at" in capsys.readouterr().err
    assert main(["list", "--db", str(tmp_path / "nothing.db")]) == 0  # nothing recorded yet is not an error
    assert "no sessions" in capsys.readouterr().out
    assert main(["bogus"]) == 2
    assert "invalid choice" in capsys.readouterr().err
