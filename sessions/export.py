"""Session export/import as JSON, and Chrome trace export of runs.

A session file holds the session's prompt, models and settings and every run with every event, exactly
as stored; export -> import -> export gives the same bytes (sorted keys; json's float repr round-trips).
Browser owner ids are never exported (the importer chooses the owner). An import is checked in full
before anything is written: a bad file is refused with a SessionStoreError that says why.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
from functools import cache
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from engine.events import EVENT_TYPES, BranchResolved, Event, Finished, RunStarted, TimingSpan, TokensEmitted, from_dict

from .db import SessionStoreError, check_id, run_finish_fields
from .replay import run_label
from .store import Store

FORMAT = "specbranch-session"
FORMAT_VERSION = 1
MAX_IMPORT_BYTES = 64 * 2**20  # a session of 2,048-token runs of every method exports to a few MB
MAX_DEPTH = 32  # a session file nests about 9 deep (runs, a run, its events, an event, its metrics, a list of lists)
INT_RANGE = (-(2**63), 2**63 - 1)  # what SQLite's INTEGER holds
SESSION_FIELDS = {
    "id": str,
    "created": float,
    "title": str,
    "prompt": str,
    "target": str,
    "draft": str | None,
    "config": dict,
    "versions": dict,
}
RUN_FIELDS = {
    "id": str,
    "method": str,
    "started": float,
    "finished": float | None,
    "status": str,
    "reason": str | None,
    "metrics": dict | None,
    "token_count": int,
    "events": list,
}
# an event's fields that run in step, one entry per token (the page reads one by another's index); what the engine
# writes always agrees (a Verified's tokens may be longer than its p: those past a rejection; u of a fork may be short)
SAME_LENGTH = {
    "draft_proposed": [("tokens", "pieces", "q")],
    "verified": [("p", "q", "u"), ("tokens", "pieces")],
    "branch_resolved": [("candidates", "pieces", "q", "branches", "branch_pieces")],
    "rollback": [("tokens", "pieces")],
    "tokens_emitted": [("tokens", "pieces", "kinds")],
}
# engine.measure.metrics.compute_metrics' keys and types: imported metrics reach the page, so each is checked
METRIC_FIELDS = {
    "new_tokens": int,
    "tokens_per_s": float,
    "prefill_s": float,
    "decode_s": float,
    "acceptance_rate": float | None,
    "mean_accepted_length": float | None,
    "wasted_draft_rate": float | None,
    "path_rollback_rate": float | None,
    "drafted_tokens": int,
    "wasted_draft_tokens": int,
    "path_drafted_tokens": int,
    "path_rolled_back_tokens": int,
    "verified_tokens": int,
    "accepted_tokens": int,
    "target_forwards": int,
    "draft_forwards": int,
    "per_position_acceptance": list[float | None],
    "per_position_counts": list[list[int]],
    "accepted_length_histogram": dict[str, int],
    "target_idle_fraction": float,
    "draft_idle_fraction": float | None,
    "overlap": float,
    "target_alone_fraction": float,
    "draft_alone_fraction": float,
    "neither_fraction": float,
    "host_overhead_ms_per_step": float | None,
    "branch_points": int,
    "branch_rescues": int,
    "rescue_rate": float | None,
    "rescues_by_k": dict[str, list[int]],
    "rescues_by_depth": list[list[int]],
    "target_forward_ms": float | None,
    "draft_forward_ms": float | None,
    "pace": str | None,
    "no_waste_headroom": float | None,
    # written by earlier versions (one rollback figure); replay recomputes both figures from events
    "rollback_rate": float | None,
    "rolled_back_tokens": int,
}


# -- export ----------------------------------------------------------------------------------------


def export_session(store: Store, session_id: str, owner: str | None = None) -> dict:
    """The session as a JSON-ready dict (owner: restrict to that owner's or shared sessions)."""
    session = store.get_session(session_id, owner)
    runs = []
    for run in session["runs"]:
        fields = {k: run[k] for k in RUN_FIELDS if k != "events"}
        fields["events"] = [e.to_dict() for e in store.load_run_events(run["id"])]
        runs.append(fields)
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "session": {k: session[k] for k in SESSION_FIELDS},
        "runs": runs,
    }


def dump_export(doc: dict) -> str:
    """Stable text: sorted keys, fixed indentation, floats as Python's shortest round-trip repr."""
    return json.dumps(doc, sort_keys=True, indent=1, ensure_ascii=False) + "\n"


def export_json(store: Store, session_id: str, owner: str | None = None) -> str:
    return dump_export(export_session(store, session_id, owner))


def write_export(store: Store, session_id: str, path: Path | str, owner: str | None = None) -> Path:
    text = export_json(store, session_id, owner)
    return _write_text(Path(path), text)


def _write_text(path: Path, text: str) -> Path:
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise SessionStoreError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path


# -- import ----------------------------------------------------------------------------------------


def too_large(size: int) -> SessionStoreError:
    return SessionStoreError(
        f"the file is too large to import: {size / 2**20:.1f} MB; a session file is at most "
        f"{MAX_IMPORT_BYTES / 2**20:.0f} MB"
    )


def import_json(store: Store, text: str | bytes, owner: str, shared: bool = False) -> str:
    """Import a session file's text into the store; returns the session id (kept from the file)."""
    if len(text) > MAX_IMPORT_BYTES:  # checked before parsing (a str's length in characters: at least as strict)
        raise too_large(len(text))
    return import_session(store, parse_json(text), owner, shared)


class NotANumber(ValueError):
    """A number JSON allows but a session file may not hold."""


def _constant(name: str):
    raise NotANumber(f"{name} is not a number a session file may hold")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NotANumber(f"{text} is not a number a session file may hold (it is out of range)")
    return value


def parse_json(text: str | bytes):
    """The JSON document of a session file, or SessionStoreError saying why not: not JSON, NaN or a number out of
    range (1e999, an integer past 64 bits), nested deeper than MAX_DEPTH, or text that is not Unicode (a lone
    surrogate)."""
    try:
        doc = json.loads(text, parse_constant=_constant, parse_float=_finite)
    except NotANumber as exc:
        raise SessionStoreError(f"not a session file: {exc}") from None
    except RecursionError:
        raise SessionStoreError(
            f"not a session file: nested too deeply (a session file nests at most {MAX_DEPTH} levels)"
        ) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise SessionStoreError(f"not a session file: not valid JSON ({exc})") from None
    return doc


def check_values(doc) -> None:
    """Walk the document once, without recursion: its depth, numbers (finite; integers SQLite can hold) and strings
    (text, no lone surrogates), keys included."""
    stack = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise SessionStoreError(
                f"not a session file: nested too deeply (a session file nests at most {MAX_DEPTH} levels)"
            )
        if isinstance(value, dict):
            stack.extend((k, depth + 1) for k in value)
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, float) and not math.isfinite(value):
            raise SessionStoreError(f"not a session file: {value!r} is not a number a session file may hold")
        elif isinstance(value, int) and not isinstance(value, bool) and not INT_RANGE[0] <= value <= INT_RANGE[1]:
            raise SessionStoreError(
                f"not a session file: {value!r:.40} is not a number a session file may hold (it is out of range)"
            )
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise SessionStoreError(
                    f"not a session file: {value!r:.40} is not valid text (a lone surrogate)"
                ) from None


def read_import(store: Store, path: Path | str, owner: str, shared: bool = False) -> str:
    """Import a session file; one larger than MAX_IMPORT_BYTES is refused by its size, before it is read."""
    try:
        size = Path(path).stat().st_size
        if size > MAX_IMPORT_BYTES:
            raise too_large(size)
        text = Path(path).read_bytes()
    except OSError as exc:
        raise SessionStoreError(f"cannot read {path}: {exc.strerror or exc}") from None
    return import_json(store, text, owner, shared)


def import_session(store: Store, doc: Any, owner: str, shared: bool = False) -> str:
    """Validate everything first, then write the session, its runs and events in one transaction."""
    session, runs = parse_export(doc)
    store.insert_session(session, runs, owner, shared)
    return session["id"]


def parse_export(doc: Any) -> tuple[dict, list[dict]]:
    """(session fields, runs with their events rebuilt as Event objects), or SessionStoreError saying why."""
    check_values(doc)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SessionStoreError(f'not a session file: expected a JSON object with "format": "{FORMAT}"')
    if doc.get("version") != FORMAT_VERSION:
        raise SessionStoreError(
            f"session file version {doc.get('version')!r} is not supported "
            f"(this SpecBranch reads version {FORMAT_VERSION})"
        )
    session = check_fields(doc.get("session"), SESSION_FIELDS, "session")
    check_id(session["id"], "session: id")
    if not isinstance(doc.get("runs"), list):
        raise SessionStoreError('session file: "runs" must be a list')
    runs = [parse_run(run, i + 1) for i, run in enumerate(doc["runs"])]
    ids = [r["id"] for r in runs]
    if len(set(ids)) != len(ids):
        raise SessionStoreError("session file: two runs have the same id")
    return session, runs


def check_fields(obj: Any, spec: dict[str, Any], where: str, optional: bool = False) -> dict:
    """Every field of `spec` present (unless `optional`) and of its type, and no other field."""
    if not isinstance(obj, dict):
        raise SessionStoreError(f"{where}: expected a JSON object")
    missing = sorted(set(spec) - set(obj))
    if missing and not optional:
        raise SessionStoreError(f"{where} is missing fields: {', '.join(missing)}")
    unknown = sorted(set(obj) - set(spec))
    if unknown:
        raise SessionStoreError(f"{where} has unknown fields: {', '.join(unknown)}")
    for name, hint in spec.items():
        if name in obj and not fits(obj[name], hint):
            raise SessionStoreError(f"{where}: field {name!r} should be {type_name(hint)}, got {obj[name]!r:.60}")
    return dict(obj)


def parse_run(raw: Any, number: int) -> dict:
    where = f"run {number}"
    run = check_fields(raw, RUN_FIELDS, where)
    check_id(run["id"], f"{where}: id")
    if run["metrics"] is not None:  # a partial run's metrics so far; a complete run's equal its Finished event's
        # metrics added by later versions may be missing from an older export: replay recomputes them from events
        check_fields(run["metrics"], METRIC_FIELDS, f"{where} metrics", optional=True)
    events = [parse_event(e, f"{where}, event {i + 1}") for i, e in enumerate(run["events"])]
    if not events or not isinstance(events[0], RunStarted):
        raise SessionStoreError(f"{where}: its events must begin with a run_started event")
    derived = derived_run_fields(events)
    for name, value in derived.items():
        if run[name] != value:
            raise SessionStoreError(f"{where}: {name} is {run[name]!r}, but its events say {value!r}")
    run["events"] = events
    return run


def derived_run_fields(events: list[Event]) -> dict:
    """Run fields that follow from its events (as the Recorder writes them)."""
    start = events[0]
    done = next((e for e in events if isinstance(e, Finished)), None)
    fields = {
        "method": start.method,
        "started": start.wall_clock,
        "status": "partial",
        "reason": None,
        "finished": None,
        "token_count": sum(len(e.tokens) for e in events if isinstance(e, TokensEmitted)),
    }
    if done is not None:
        fields.update(run_finish_fields(start, done))
        fields["metrics"] = done.metrics  # stored as JSON text by the store, compared as a dict here
    return fields


def parse_event(raw: Any, where: str) -> Event:
    if not isinstance(raw, dict):
        raise SessionStoreError(f"{where}: expected a JSON object")
    kind = raw.get("type")
    if not isinstance(kind, str) or kind not in EVENT_TYPES:
        raise SessionStoreError(f"{where}: unknown event type {kind!r}")
    try:
        event = from_dict(raw)
    except ValueError as exc:
        raise SessionStoreError(f"{where}: {exc}") from None
    for name, hint in event_hints(type(event)).items():
        value = getattr(event, name)
        if not fits(value, hint):
            raise SessionStoreError(
                f"{where}: {event.type} field {name!r} should be {type_name(hint)}, got {value!r:.60}"
            )
    if isinstance(event, Finished):
        check_fields(event.metrics, METRIC_FIELDS, f"{where}: finished metrics", optional=True)
    for names in SAME_LENGTH.get(event.type, ()):
        lengths = [len(getattr(event, name)) for name in names]
        if len(set(lengths)) > 1:
            raise SessionStoreError(
                f"{where}: {event.type} fields {', '.join(names)} hold one entry per token and "
                f"should be as long as each other, got {', '.join(map(str, lengths))}"
            )
    if isinstance(event, BranchResolved):
        if len(event.p) > len(event.candidates) or any(
            len(a) != len(b) for a, b in zip(event.branches, event.branch_pieces)
        ):
            raise SessionStoreError(
                f"{where}: branch_resolved has more p than candidates, or a branch whose tokens "
                f"and pieces differ in length"
            )
    return event


@cache
def event_hints(cls: type) -> dict[str, Any]:
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def fits(value: Any, hint: Any) -> bool:
    """Does a JSON value fit a field's type? (bool is not a number here; an int is a fine float.)"""
    origin = get_origin(hint)
    if hint is Any:
        return True
    if hint is None or hint is type(None):
        return value is None
    if origin in (Union, types.UnionType):
        return any(fits(value, arg) for arg in get_args(hint))
    if hint is list or origin is list:
        args = get_args(hint)
        return isinstance(value, list) and (not args or all(fits(v, args[0]) for v in value))
    if hint is dict or origin is dict:
        args = get_args(hint)
        return (
            isinstance(value, dict)
            and all(isinstance(k, str) for k in value)
            and (not args or all(fits(v, args[1]) for v in value.values()))
        )
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def type_name(hint: Any) -> str:
    if get_args(hint):  # list[int], str | None: spell out the arguments
        return str(hint).replace("typing.", "")
    return getattr(hint, "__name__", str(hint))


# -- Chrome trace ----------------------------------------------------------------------------------

LANES = {"draft": 1, "target": 2}  # fixed thread ids: draft above target in Perfetto


def chrome_trace(events: list[Event]) -> dict:
    """One run as a Chrome trace (open in ui.perfetto.dev or chrome://tracing)."""
    return chrome_trace_runs([events])


def chrome_trace_runs(runs: list[list[Event]]) -> dict:
    """Several runs in one trace: one process per run, one lane (thread) per model worker; each forward
    pass is a complete ("X") event, times in microseconds on the run's own clock."""
    trace: list[dict] = []
    for pid, events in enumerate(runs, start=1):
        trace += run_trace_events(events, pid, f"{run_label(events)} (run {pid})")
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def run_trace_events(events: list[Event], pid: int, process: str) -> list[dict]:
    spans = [e for e in events if isinstance(e, TimingSpan)]
    lanes = dict(LANES)
    for span in spans:  # an unexpected worker name still gets a lane of its own
        lanes.setdefault(span.worker, len(lanes) + 1)
    out = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process}}]
    for worker, tid in lanes.items():
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": worker}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    for span in spans:
        out.append(
            {
                "ph": "X",
                "name": span.kind,
                "cat": span.worker,
                "pid": pid,
                "tid": lanes[span.worker],
                "ts": round(span.start * 1e6, 3),
                "dur": round((span.end - span.start) * 1e6, 3),
                "args": {"step": span.step, "tokens": span.tokens},
            }
        )
    return out


def write_trace(store: Store, session_id: str, path: Path | str, owner: str | None = None) -> Path:
    trace = chrome_trace_runs(store.load_session_events(session_id, owner))
    return _write_text(Path(path), json.dumps(trace) + "\n")
