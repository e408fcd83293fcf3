"""Every input fuzzed with hypothesis: the session import (malformed JSON, wrong types, huge numbers, deep nesting, a
file too large to read), the command lines' arguments (`python -m engine ...`, `python -m sessions ...`, built from
their real parsers; no model ever loads: the target named is one that does not exist), and the app's endpoints
(their handlers called as gradio calls them, with a tiny real engine and a real store). Each bad input gets a clear
error (exit 2 with `error: ...` on a command line, a SessionStoreError, a notice on the page), never a traceback;
nothing is half-written (the store's rows are unchanged by a refusal, and `integrity_check` stays ok); every value
that reaches a page is escaped.

150 examples per target here; SPECBRANCH_FUZZ=fuzz runs 2,000 (by hand: `SPECBRANCH_FUZZ=fuzz pytest
tests/test_fuzz.py`).
Regression examples of the bugs fuzzing found sit next to each target (@example, and tests named for the bug)."""

from __future__ import annotations

import atexit
import contextlib
import copy
import inspect
import io
import json
import math
import os
import shutil
import sqlite3
import tempfile
import tracemalloc
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import app.race
from app.context import AppContext
from app.main import build_app
from app.render import views_at
from app.tabs.replay import ReplayTab
from engine import cli as engine_cli
from engine.engine import Engine
from sessions import __main__ as sessions_cli
from sessions.export import MAX_IMPORT_BYTES, chrome_trace_runs, export_json, export_session, import_json, read_import
from sessions.replay import compare_runs
from sessions.store import SessionStoreError, Store

from .test_sessions import recorded  # noqa: F401  (fixture)

PROFILE = os.environ.get("SPECBRANCH_FUZZ", "suite")
EXAMPLES = {"suite": 150, "fuzz": 2000}[PROFILE]
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=PROFILE == "suite",
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)
PAYLOAD = '"><img src=x onerror=alert(1)>'
OWNER = "f" * 32  # a browser's id: what the Replay tab lists sessions for
MARKUP = ("<img", "<script", "onerror=alert(1)>")


def counts(path) -> tuple[int, int, int]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return tuple(conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("sessions", "runs", "events"))


def no_markup(value) -> None:
    """No string in an output (nested in updates, lists, dicts) carries the payload as markup. A chat message is
    data, not markup: the page's Chatbots sanitize what they render (sanitize_html=True)."""
    if isinstance(value, dict) and "role" in value and "content" in value:
        return
    if isinstance(value, str):
        low = value.lower()
        assert not any(m in low for m in MARKUP), value[:300]
    elif isinstance(value, dict):
        for v in value.values():
            no_markup(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            no_markup(v)


# ================================================================ (a) the session import

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.sampled_from([2**63, -(2**63) - 1, 2**64, 1e308, -0.0])
    | st.text(max_size=20)
    | st.sampled_from(
        [
            PAYLOAD,
            "",
            "\ud800",
            "run_started",
            "tokens_emitted",
            "finished",
            "complete",
            "partial",
            "ar",
            "draft",
            "target",
        ]
    )
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=10,
)


def paths_of(doc, prefix=()):
    """Every path into a JSON document (keys and indices), the root's children first."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        yield prefix + (key,)
        yield from paths_of(value, prefix + (key,))


EXTREMES = st.sampled_from(
    [
        math.inf,
        -math.inf,
        math.nan,
        2**63,
        2**64,
        -(2**63) - 1,
        1e308,
        -0.0,
        "\ud800",
        PAYLOAD,
        "",
        None,
        True,
        [],
        {},
        "x" * 300,
    ]
)


@st.composite
def mutated_exports(draw, doc):
    """A valid export with one to three changes: a field of the session, of a run or of an event replaced by an
    extreme or any JSON value, removed, or joined by an unknown one; a run's start moved together with its
    run_started event (so the check that they agree passes); or any value anywhere."""
    doc = copy.deepcopy(doc)
    suffix = draw(st.text("0123456789abcdef", min_size=6, max_size=6))  # fresh ids: an accepted one does not collide
    doc["session"]["id"] = f"fz{suffix}"
    for i, run in enumerate(doc["runs"]):
        run["id"] = f"fz{suffix}r{i}"
    values = EXTREMES | json_values
    for _ in range(draw(st.integers(1, 3))):
        runs = [r for r in doc.get("runs") or [] if isinstance(r, dict)] if isinstance(doc.get("runs"), list) else []
        run = draw(st.sampled_from(runs)) if runs else None
        events = (
            [e for e in run.get("events") or [] if isinstance(e, dict)]
            if run is not None and isinstance(run.get("events"), list)
            else []
        )
        where = draw(st.sampled_from(["session", "run", "event", "start", "anywhere"]))
        if where == "session" or (where in ("run", "event", "start") and run is None):
            target = doc.get("session")
        elif where == "run":
            target = run
        elif where == "event" and events:
            target = draw(st.sampled_from(events))
        elif where == "start" and events:
            run["started"] = events[0]["wall_clock"] = draw(values)
            continue
        else:
            paths = list(paths_of(doc))
            if not paths:
                continue
            path = draw(st.sampled_from(paths))
            target = doc
            try:
                for key in path[:-1]:
                    target = target[key]
                target[path[-1]] = draw(values)
            except (KeyError, IndexError, TypeError):  # an earlier change removed or replaced the way there
                pass
            continue
        if not isinstance(target, dict):
            continue
        action = draw(st.sampled_from(["replace", "replace", "replace", "remove", "add"]))
        if action == "add" or not target:
            target[draw(st.text(max_size=8))] = draw(values)
        elif action == "remove":
            del target[draw(st.sampled_from(sorted(target)))]
        else:
            target[draw(st.sampled_from(sorted(target)))] = draw(values)
    return doc


@pytest.fixture(scope="module")
def export_doc(recorded):  # noqa: F811
    return export_session(recorded["store"], recorded["session_id"])


@pytest.fixture(scope="module")
def import_store(tmp_path_factory):
    with Store(tmp_path_factory.mktemp("fuzz-import") / "sessions.db") as store:
        yield store


def check_import(store, text) -> str | None:
    """Import `text`: accepted (its session renders, escaped, and exports again) or refused with a
    SessionStoreError that writes nothing. Any other exception fails."""
    before = counts(store.path)
    try:
        sid = import_json(store, text, owner=OWNER)
    except SessionStoreError as exc:
        assert str(exc) and "Traceback" not in str(exc)
        assert counts(store.path) == before
        return None
    finally:
        assert store.integrity_check() == "ok"
    table, _, status = ReplayTab(AppContext(None, lambda: (store, ""))).search("", "", OWNER)  # lists it
    assert sid in json.dumps(table, default=str) and "session(s)" in status  # the table: a Dataframe of "str"
    no_markup(status)  # cells, which the page shows as text, so an imported prompt may hold anything there
    runs = store.load_session_events(sid, OWNER)
    for events in runs:
        no_markup(views_at(events)[:5])
    no_markup(compare_runs(runs)["labels"])
    chrome_trace_runs(runs)
    json.loads(export_json(store, sid, OWNER))  # what it stored exports as standard JSON again
    return sid


@FUZZ
@given(data=st.data())
def test_fuzz_import_of_a_mutated_export(import_store, export_doc, data):
    doc = data.draw(mutated_exports(export_doc))
    check_import(import_store, json.dumps(doc))  # json.dumps writes NaN and Infinity as Python does


@FUZZ
@given(
    text=st.one_of(
        st.text(max_size=200),
        st.binary(max_size=200),
        json_values.map(json.dumps),
        st.integers(1, 5000).map(lambda n: "[" * n + "]" * n),
        st.integers(1, 5000).map(lambda n: '{"a":' * n + "1" + "}" * n),
    )
)
@example(text="[" * 100_000 + "]" * 100_000)  # deeper than json's recursion: it raised RecursionError
@example(text='{"format": "specbranch-session", "version": 1e999}')
@example(text="NaN")
def test_fuzz_import_of_any_text(import_store, text):
    check_import(import_store, text)


@pytest.mark.parametrize(
    "where, value",
    [
        ([("session", "created")], 1e999),  # parsed as inf: accepted, then Replay's search raised OverflowError
        ([("session", "created")], float("nan")),
        ([("runs", 0, "started"), ("runs", 0, "events", 0, "wall_clock")], 2**64),  # OverflowError from the insert
        ([("runs", 0, "events", 1, "step")], 2**63),
        ([("runs", 0, "events", 1, "step")], -(2**63) - 1),
        ([("session", "prompt")], "\ud800"),  # a lone surrogate: UnicodeEncodeError from the insert
        ([("session", "config")], {"\udfff": 1}),
    ],
)
def test_values_the_store_cannot_hold_are_refused(import_store, export_doc, where, value):
    doc = copy.deepcopy(export_doc)
    doc["session"]["id"] = "bignumbers"
    for i, run in enumerate(doc["runs"]):
        run["id"] = f"bignumbers{i}"
    for path in where:
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    before = counts(import_store.path)
    with pytest.raises(SessionStoreError, match="not a number a session file may hold|not valid text"):
        import_json(import_store, json.dumps(doc), owner="fuzz")
    assert counts(import_store.path) == before


@pytest.mark.parametrize(
    "kind, field",
    [
        ("verified", "u"),
        ("verified", "q"),
        ("tokens_emitted", "kinds"),
        ("draft_proposed", "pieces"),
        ("rollback", "pieces"),
    ],
)
def test_an_event_whose_per_token_fields_disagree_in_length_is_refused(import_store, export_doc, kind, field):
    """Found by the 2,000-example fuzz: a verified event with fewer u than p was imported, and the token view raised
    IndexError showing it."""
    doc = copy.deepcopy(export_doc)
    doc["session"]["id"] = f"lengths{kind}{field}"
    for i, run in enumerate(doc["runs"]):
        run["id"] = f"lengths{kind}{field}{i}"
    event = next(e for run in doc["runs"] for e in run["events"] if e["type"] == kind and len(e[field]) > 0)
    event[field] = event[field][:-1]
    before = counts(import_store.path)
    with pytest.raises(SessionStoreError, match=f"{kind} fields .*{field}.* should be as long as each other"):
        import_json(import_store, json.dumps(doc), owner=OWNER)
    assert counts(import_store.path) == before


def test_a_stored_time_no_clock_reads_is_listed_not_raised(tmp_path):
    """Found by fuzzing: an import's "created" of 1e308 (or inf, before imports refused it) made Replay's search raise
    OverflowError; a store written then still lists."""
    with Store(tmp_path / "s.db") as store:
        for i, created in enumerate((1e308, math.inf, -1e30)):
            sid = store.start_session(OWNER, f"odd time {i}", "t", "d", {})
            store.db.execute("UPDATE sessions SET created = ? WHERE id = ?", [created, sid])
        table, _, status = ReplayTab(AppContext(None, lambda: (store, ""))).search("odd time", "", OWNER)
        assert status == "3 session(s)" and [row[1] for row in table] == ["?", "?", "?"]


def test_deep_nesting_is_refused_with_the_reason(import_store):
    for text in (
        "[" * 100_000 + "]" * 100_000,  # past json's own recursion limit
        '{"format": "specbranch-session", "version": 1, "session": {"config": '
        + "[" * 200
        + "]" * 200
        + '}, "runs": []}',
    ):  # within it, and far deeper than any session file
        with pytest.raises(SessionStoreError, match="nested too deeply"):
            import_json(import_store, text, owner="fuzz")


def test_a_200_mb_file_is_refused_by_its_size_before_it_is_read(import_store, tmp_path):
    """A sparse 200 MB file (no disk used): refused by its size alone; reading it would take 200 MB, and parsing it
    would say "not valid JSON" instead."""
    big = tmp_path / "huge.json"
    with open(big, "wb") as f:
        f.truncate(200 * 2**20)
    tracemalloc.start()
    try:
        with pytest.raises(SessionStoreError, match=r"too large to import: 200\.0 MB; a session file is at most"):
            read_import(import_store, big, owner="fuzz")
        assert tracemalloc.get_traced_memory()[1] < 2**20  # never read
    finally:
        tracemalloc.stop()
    with pytest.raises(SessionStoreError, match="too large to import"):
        import_json(import_store, b" " * (MAX_IMPORT_BYTES + 1), owner="fuzz")


# ================================================================ (b) the command lines

SCRATCH = Path(tempfile.mkdtemp(prefix="specbranch-fuzz-cli-"))
atexit.register(shutil.rmtree, SCRATCH, True)
MISSING_MODEL = str(SCRATCH / "no-such-model")
GARBAGE = SCRATCH / "garbage.json"
GARBAGE.write_text('{"not": "what is asked for"}\n{oops\n')
PATHS = [
    str(SCRATCH / "new" / "out.json"),
    str(SCRATCH / "missing.jsonl"),
    str(SCRATCH),
    str(GARBAGE),
    "/proc/specbranch-fuzz/x.json",
    "",
    str(SCRATCH / "new2"),
]
PATH_DESTS = {
    "json_out",
    "out",
    "work_dir",
    "samples",
    "prompt_file",
    "corpus",
    "prompts",
    "bench",
    "db",
    "file",
    "trace",
    "reports",
    "init",
}
numbers_as_text = st.one_of(
    st.integers(-10, 10**6).map(str),
    st.integers().map(str),
    st.floats().map(repr),
    st.sampled_from(["nan", "inf", "-inf", "1e999", "0x10", "", "-0"]),
)


def option_values(action):
    """What hypothesis may give an option of the real parser: its choices, or garbage; a number, or garbage;
    a path among a few prepared ones (all in a scratch folder, or unwritable)."""
    if action.dest in PATH_DESTS:
        return st.sampled_from(PATHS)
    garbage = st.text(max_size=12).filter(lambda s: not s.startswith("-"))
    # mostly values the parser takes, so that most command lines get past it to the checks behind
    if action.choices:
        return st.one_of(*[st.sampled_from(list(action.choices))] * 3, garbage)
    if action.type in (int, float):
        plain = st.sampled_from(
            ["0", "1", "2", "3", "8", "0.5", "0.3"] if action.type is float else ["0", "1", "2", "3", "8", "16", "-1"]
        )
        return st.one_of(plain, plain, numbers_as_text, garbage)
    return garbage | st.sampled_from(["ar,sd", "sd@embedded", "all", "mt_bench", "cuda", "cpu", "bfloat16"])


def subcommands(parser):
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return sub.choices


@st.composite
def argvs(draw, parser, forced):
    """A command line of the real parser: a subcommand, some of its options with values, its positionals, and the
    `forced` options of that subcommand (a target that does not exist, outputs in the scratch folder)."""
    name, sub = draw(st.sampled_from(sorted(subcommands(parser).items())))
    argv = [name]
    options = [a for a in sub._actions if a.option_strings and a.dest != "help"]
    for action in draw(st.lists(st.sampled_from(options), max_size=6, unique_by=lambda a: a.dest)) if options else []:
        argv.append(draw(st.sampled_from(action.option_strings)))
        if action.nargs != 0:
            argv.append(draw(option_values(action)))
    for action in (a for a in sub._actions if not a.option_strings):
        if action.nargs == "?" and draw(st.booleans()):
            continue
        argv.append(draw(option_values(action)))
    if draw(st.integers(0, 9)) == 0:
        argv.append(draw(st.sampled_from(["--no-such-option", "extra", "--", "-x"])))
    for option, value in forced.get(name, []):
        if any(a.option_strings and option in a.option_strings for a in sub._actions):
            argv += [option, value]
    return argv


ENGINE_FORCED = {
    name: [
        ("--target", MISSING_MODEL),
        ("--work-dir", str(SCRATCH / "work")),
        ("--samples", str(SCRATCH / "samples.pt")),
    ]
    for name in ("generate", "bench", "costs", "train-hrad", "distill")
}


def run_main(main, argv) -> tuple[int, str]:
    err = io.StringIO()
    threads = torch.get_num_threads()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    finally:
        torch.set_num_threads(threads)  # --threads sets this process's count before the model would load
    return code, err.getvalue()


@FUZZ
@given(argv=argvs(engine_cli.build_parser(), ENGINE_FORCED))
@example(argv=["generate", "--prompt-file", str(SCRATCH / "missing.jsonl"), "--target", MISSING_MODEL])
@example(argv=["generate", "--prompt", "x", "--temperature", "inf", "--target", MISSING_MODEL])
@example(argv=["generate", "--prompt", "x", "--seed", str(2**64), "--target", MISSING_MODEL])
@example(argv=["bench", "--threads", "2147483648", "--target", MISSING_MODEL])  # 2,000-example fuzz: torch's
@example(
    argv=[
        "distill",
        "--threads",
        "2147483648",
        "--out",
        str(SCRATCH / "d"),  # ValueError overflow traceback
        "--corpus",
        str(GARBAGE),
        "--target",
        MISSING_MODEL,
    ]
)
def test_fuzz_the_engine_command_line(argv):
    """Every generated command line is refused (the model named does not exist, if nothing before it is wrong):
    exit 2 and one `error: ...` message, never a traceback."""
    code, err = run_main(engine_cli.main, argv)
    assert code == 2, (code, err[-500:])
    assert "error:" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def cli_store(recorded, tmp_path_factory):  # noqa: F811
    """A real store with one session, and a valid export of it, for `python -m sessions`."""
    folder = tmp_path_factory.mktemp("fuzz-cli")
    saved = os.environ.get("SPECBRANCH_DB")
    os.environ["SPECBRANCH_DB"] = str(folder / "default.db")  # never the user's own store, whatever a command omits
    export = folder / "export.json"
    export.write_text(export_json(recorded["store"], recorded["session_id"]))
    with Store(folder / "sessions.db") as store:
        import_json(store, export.read_text(), owner="someone")
    yield folder / "sessions.db", export, recorded["session_id"]
    if saved is None:
        os.environ.pop("SPECBRANCH_DB", None)
    else:
        os.environ["SPECBRANCH_DB"] = saved


@FUZZ
@given(data=st.data())
def test_fuzz_the_sessions_command_line(cli_store, data):
    """Exit 0, or 2 with `error: ...`; never a traceback; the store stays sound, and a refusal changes nothing."""
    db, export, session_id = cli_store
    paths = PATHS + [str(db), str(export)]
    parser = sessions_cli.build_parser()
    name = data.draw(st.sampled_from(sorted(subcommands(parser))))
    argv = [name]
    if name in ("export", "delete"):
        argv.append(data.draw(st.sampled_from([session_id, "nope", PAYLOAD, "../x"]) | st.text(max_size=10)))
    if name == "import":
        argv.append(data.draw(st.sampled_from(paths)))
    if name == "export" and data.draw(st.booleans()):
        argv.append(data.draw(st.sampled_from(paths)))
    argv += ["--db", data.draw(st.sampled_from(paths + [str(db)] * 4))]
    if name == "list":
        for option, values in (
            ("--search", st.text(max_size=10)),
            ("--method", st.text(max_size=6)),
            ("--limit", numbers_as_text),
        ):
            if data.draw(st.booleans()):
                argv += [option, data.draw(values)]
        if data.draw(st.booleans()):
            argv.append("--json")
    if name == "export" and data.draw(st.booleans()):
        argv += ["--trace", data.draw(st.sampled_from(paths))]
    if name == "import":
        if data.draw(st.booleans()):
            argv += ["--owner", data.draw(st.text(max_size=10))]
        if data.draw(st.booleans()):
            argv.append("--shared")
    before = counts(db)
    code, err = run_main(sessions_cli.main, argv)
    assert code in (0, 2), (code, err[-500:])
    try:
        with Store(db, create=False) as store:
            assert store.integrity_check() == "ok"
    except SessionStoreError as exc:
        raise AssertionError(f"{argv} left the store unreadable: {exc}") from None
    if code == 2:
        assert "error:" in err and "Traceback" not in err
        assert counts(db) == before
    assert export.read_text().startswith("{")  # never written over by an export


def test_an_export_is_never_written_over_the_database(cli_store, export_doc, tmp_path):
    """Found by fuzzing (2,000 examples): `python -m sessions export ID sessions.db --db sessions.db` wrote the JSON
    over the database it read, and the store was gone."""
    db, export, session_id = cli_store
    before, kept = counts(db), db.read_bytes()
    for argv in (
        ["export", session_id, str(db), "--db", str(db)],
        ["export", session_id, "--trace", str(db), "--db", str(db)],
        ["export", session_id, str(db) + "-wal", "--db", str(db)],
    ):
        code, err = run_main(sessions_cli.main, argv)
        assert code == 2 and "error: will not write" in err and "session database" in err
    code, err = run_main(sessions_cli.main, ["export", session_id, str(tmp_path / "x.json"), "--db", ""])
    assert code == 2 and "error:" in err  # the check itself once raised on an empty --db (ValueError)
    # over another store than the one read (found next: a store the fuzz had imported into, then --trace onto this one)
    other = tmp_path / "other.db"
    with Store(other) as store:
        import_json(store, json.dumps(export_doc), owner="x")
    code, err = run_main(sessions_cli.main, ["export", session_id, "--trace", str(db), "--db", str(other)])
    assert code == 2 and "will not write" in err and "over an SQLite file" in err
    assert counts(db) == before and db.read_bytes() == kept
    assert counts(db) == before and db.read_bytes() == kept


# ================================================================ (c) the app's endpoints


@pytest.fixture(scope="module")
def app_under_fuzz(tiny_engine, tmp_path_factory, recorded):  # noqa: F811
    """The app's page on a tiny engine of its own (so nothing the fuzz runs changes what the shared engine measured)
    and a store holding one session, and each public endpoint's handler by name."""
    engine = Engine(tiny_engine.pair)
    folder = tmp_path_factory.mktemp("fuzz-app")
    with Store(folder / "sessions.db") as store:
        # someone else's session, shared with every browser: any may open it, none may unshare or delete it
        import_json(store, export_json(recorded["store"], recorded["session_id"]), owner="c" * 32, shared=True)
        demo = build_app(lambda draft=None: engine, lambda: (store, ""), drafts=[("tiny", "tiny"), ("also", "also")])
        fns = {fn.api_name: fn for fn in demo.fns.values() if fn.fn is not None}
        runs = {r["id"]: store.load_run_events(r["id"]) for r in store.get_session(recorded["session_id"])["runs"]}
        garbage = folder / "garbage.json"
        garbage.write_text('{"format": "specbranch-session", "version": 1, "session": ' + PAYLOAD + "}")
        yield {
            "engine": engine,
            "store": store,
            "fns": fns,
            "runs": runs,
            "sid": recorded["session_id"],
            "events": next(iter(runs.values())),
            "files": [str(garbage), str(folder / "missing.json"), str(folder)],
        }
    engine.close()


def component_values(component, ctx, endpoint=""):
    """What a handler may get for an input component, past gradio's preprocessing or from a plain HTTP client."""
    kind = type(component).__name__
    text = st.text(max_size=40) | st.sampled_from([PAYLOAD, "", "   ", "a b c", "h g", ctx["sid"], *ctx["runs"]])
    number = (
        st.integers(-10, 3000)
        | st.floats()
        | st.sampled_from([2**63, 10**30, -1, 0, 0.5, 1, 2, 3])
        | st.just(None)
        | text
    )
    if kind == "State":  # held by the server, never sent by a client: the values the page itself keeps there
        if isinstance(component.value, list) and endpoint == "compare_race":  # Compare's runs, one event list each
            return st.sampled_from([[], [ctx["events"]], list(ctx["runs"].values())])
        if isinstance(component.value, list):  # Live's events
            return st.sampled_from([[], ctx["events"]])
        if isinstance(component.value, dict):  # Replay's opened runs
            return st.sampled_from([{}, ctx["runs"]])
        return st.sampled_from([None, 12.5])  # a stored AR speed, or none
    if kind == "BrowserState":
        return st.sampled_from([None, "a" * 32, "b" * 32, "local", 42]) | st.text(max_size=40)
    if kind in ("Slider", "Number"):
        return number
    if kind == "Checkbox":
        return st.booleans() | st.sampled_from([None, 0, "yes"])
    if kind == "CheckboxGroup":
        return st.lists(text | st.sampled_from(["ar", "sd", "pearl", "specbranch"]), max_size=5) | st.just(None)
    if kind == "Dropdown":
        choices = [c[1] if isinstance(c, (list, tuple)) else c for c in component.choices or []]
        return st.sampled_from(choices or [None]) | text | st.just(None)
    if kind == "Chatbot":
        message = st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "assistant"]),
                "content": text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2),
            }
        )
        return st.lists(message, max_size=3) | st.just(None)
    if kind == "File":
        return st.sampled_from([None, *ctx["files"]])
    return text | st.just(None)


def baseline(component, ctx, endpoint):
    """A valid value for an input, as the page would send it (short runs on the tiny models, raw text)."""
    kind, elem = type(component).__name__, getattr(component, "elem_id", None)
    if kind == "State":
        if isinstance(component.value, list):
            return list(ctx["runs"].values()) if endpoint == "compare_race" else ctx["events"]
        return ctx["runs"] if isinstance(component.value, dict) else None
    if kind == "BrowserState":
        return "b" * 32
    if elem in ("prompt", "compare-prompt", "replay-search"):
        return "a b c" if elem != "replay-search" else ""
    if elem == "max-new":
        return 6
    if kind == "Checkbox" and str(component.label).startswith("Chat template"):
        return False
    if elem == "replay-session":
        return ctx["sid"]
    if elem in ("replay-run",):
        return next(iter(ctx["runs"]))
    if kind == "CheckboxGroup" and elem == "replay-pick":
        return list(ctx["runs"])
    if kind == "Dropdown" and elem == "draft":
        return "tiny"
    return component.value


FUZZED = [
    "generate",
    "step_prev",
    "step_next",
    "step_slide",
    "compare",
    "compare_race",
    "search",
    "open_session",
    "show_run",
    "replay_step_prev",
    "replay_step_next",
    "replay_step_slide",
    "compare_runs",
    "race_runs",
    "export_session",
    "import_session",
    "share_session",
    "delete_session",
    # private ones too: the page calls them, and so may a crafted request
    "step_mark",
    "live_tokens",
    "replay_tokens",
    "replay_play",
    "replay_tick",
    "slider_defaults",
]
STATS: dict = {}
WRITES = {"generate", "compare", "import_session", "share_session", "delete_session"}


def markup_outputs(fn, outputs) -> list:
    """What of a handler's outputs the page renders as markup: the values for its HTML components, and its figures
    (Plotly renders some HTML in names and hover text). A Dropdown's labels, a Dataframe's cells and a Chatbot's
    messages are shown as text (the Chatbots also sanitize), so the fuzz does not flag markup there."""
    out = []
    for item in outputs:
        values = item if len(fn.outputs) > 1 else (item,)
        for component, value in zip(fn.outputs, values if isinstance(values, (tuple, list)) else (values,)):
            if type(component).__name__ == "HTML":
                out.append(value)
            elif type(component).__name__ == "Plot":
                out.append(value.to_dict() if hasattr(value, "to_dict") else value)
    return out


def call_handler(fn, args):
    result = fn(*args)
    if inspect.isgenerator(result):
        return list(result)
    return [result]


@FUZZ
@given(data=st.data())
def test_fuzz_the_app_endpoints(app_under_fuzz, data, monkeypatch):
    ctx = app_under_fuzz
    monkeypatch.setattr(app.race, "MIN_SECONDS", 0.0)  # a race plays at its measured speed: tiny runs, short races
    name = data.draw(st.sampled_from(FUZZED))
    fn = ctx["fns"][name]
    if data.draw(st.booleans(), label="from the page's own values"):  # most inputs valid: the run goes deep
        args = [baseline(c, ctx, name) for c in fn.inputs]
        for i in (
            data.draw(st.lists(st.integers(0, len(args) - 1), max_size=2, unique=True), label="changed") if args else []
        ):
            args[i] = data.draw(
                component_values(fn.inputs[i], ctx, name), label=f"{name}:{type(fn.inputs[i]).__name__}"
            )
    else:
        args = [data.draw(component_values(c, ctx, name), label=f"{name}:{type(c).__name__}") for c in fn.inputs]
    if name == "step_mark":
        args = [None, *args]  # its gr.EventData, absent from a plain request
    before = counts(ctx["store"].path)
    outputs = call_handler(fn.fn, args)
    shown = markup_outputs(fn, outputs)
    if os.environ.get("SPECBRANCH_FUZZ_STATS"):  # what the fuzz reached: outcomes by endpoint, printed at the end
        text = json.dumps(outputs, default=str)
        outcome = "error notice" if "notice-error" in text else "refused" if "refused" in text else "served"
        STATS[(name, outcome)] = STATS.get((name, outcome), 0) + 1
    no_markup(shown)
    assert ctx["store"].integrity_check() == "ok"
    if name in WRITES and "notice-error" in json.dumps(outputs, default=str):
        assert counts(ctx["store"].path) == before, "a refused request wrote to the store"
    assert ctx["store"].get_session(ctx["sid"])["shared"]  # another browser's: never unshared, never deleted


def test_a_seed_or_temperature_no_run_can_take_is_refused_before_anything_is_stored():
    """Found by fuzzing the endpoints: a seed of 1e300 passed the settings, started a stored session, and failed in the
    run ("Overflow when unpacking long long"); an infinite temperature passed as ">= 0"."""
    from engine.config import GenerationConfig, SpecBranchError

    for cfg, message in (
        (GenerationConfig(seed=10**300), "seed must be an integer from -2\\*\\*62"),
        (GenerationConfig(seed=2**64), "seed must be"),
        (GenerationConfig(seed=True), "seed must be"),
        (GenerationConfig(temperature=math.inf), "temperature must be >= 0"),
    ):
        with pytest.raises(SpecBranchError, match=message):
            cfg.validate()
    GenerationConfig(seed=-(2**62), temperature=1.5).validate()


def test_a_run_that_never_began_leaves_no_session(tiny_engine, tmp_path):
    """What the seed above left behind: the app starts a session, then the run fails before its first event; the
    session goes with it. A run that began is kept (partial), and so is a session that has runs."""
    from app.context import AppContext
    from engine.config import GenerationConfig
    from engine.events import RunStarted

    with Store(tmp_path / "s.db") as store:
        ctx = AppContext(None, lambda: (store, ""))
        cfg = GenerationConfig(method="sd")
        recorder, sid = ctx.start_recording(OWNER, "never ran", tiny_engine, cfg)
        assert store.list_sessions(owner=OWNER) and recorder.close() is None
        assert store.list_sessions(owner=OWNER) == [] and counts(store.path) == (0, 0, 0)
        recorder, sid = ctx.start_recording(OWNER, "began", tiny_engine, cfg)
        recorder.add(RunStarted("sd", "t", "d", [2, 3], "began", cfg.to_dict(), "cpu", 1.0))
        assert recorder.close() is None
        assert [s["status"] for s in store.list_sessions(owner=OWNER)] == ["partial"]
        second = store.recorder(sid)  # a later run of the session (Compare's): never takes the session with it
        assert second.close() is None and len(store.list_sessions(owner=OWNER)) == 1


def test_a_race_of_a_run_whose_clock_says_hours_ends_in_a_minute(export_doc):
    """Found while fuzzing imports: a run whose spans end at 1e9 s (a crafted file, or a real run hours long) raced
    for that long, a frame every 0.1 s, holding the request. The race is now sped up to end within MAX_SECONDS."""
    from app.race import FPS, MAX_SECONDS, race_frames
    from sessions.export import parse_export

    doc = copy.deepcopy(export_doc)
    for run in doc["runs"]:
        for e in run["events"]:
            if e["type"] == "timing_span":
                e["start"], e["end"] = e["start"] * 1e8, e["end"] * 1e8
    _, runs = parse_export(doc)
    now = [0.0]
    frames = list(
        race_frames([r["events"] for r in runs], clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    )
    assert len(frames) <= MAX_SECONDS * FPS + 2 and now[0] <= MAX_SECONDS + 1  # on the fake clock: no waiting here
    assert "faster; tokens/s are as measured" in frames[-1]


# ---------------------------------------------------------------- through gradio_client: gradio's own checks


@pytest.fixture(scope="module")
def fuzz_client(tiny_engine, tmp_path_factory):
    from .conftest import serve_app

    engine = Engine(tiny_engine.pair)
    with Store(tmp_path_factory.mktemp("fuzz-client") / "sessions.db") as store:
        demo, url = serve_app(engine, store)
        try:
            yield make_client(url), store
        finally:
            demo.close()
            engine.close()


def make_client(url):
    from gradio_client import Client

    return Client(url, verbose=False, download_files=False)


UNCLEAR = "has not enabled verbose error reporting"
json_safe = (
    st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.none()
    | st.booleans()
    | st.lists(st.integers(), max_size=2)
)


@settings(FUZZ, max_examples=min(EXAMPLES, 40))
@given(
    slot=st.sampled_from(["max_new", "temperature", "gamma", "seed", "history", "method", "chat", "prompt"]),
    value=json_safe,
)
@example(slot="max_new", value="abc")  # gradio's slider check raised, and the client read only "has not enabled
@example(slot="history", value=[1, 2])  # verbose error reporting": launch(show_error=True) passes its message on
def test_fuzz_generate_through_gradio_client(fuzz_client, slot, value):
    """What a gradio_client user may send: either the run is served, or the error says what is wrong with which
    input; a refusal stores nothing."""
    client, store = fuzz_client
    args = dict(prompt="a b", history=[], method="sd", max_new=4, chat=False, browser_id="e" * 32)
    args[slot] = value
    before = counts(store.path)
    try:
        final = client.predict(**args, api_name="/generate")
    except Exception as exc:  # noqa: BLE001 - gradio refused an input: its message must say which and why
        assert UNCLEAR not in str(exc) and str(exc), str(exc)
        assert counts(store.path) == before
        return
    no_markup(final)
    if "notice-error" in final[3]:
        assert counts(store.path) == before
