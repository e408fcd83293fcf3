"""Faults through the served app (gradio_client and plain HTTP on loopback, tiny models): the target runs out of memory
mid-run, the client goes away mid-stream (a cancelled job, a dropped connection), the store's disk is full. In each
case generation ends with a message or goes on, the engine is free for the next request, and nothing stored is
damaged. (The engine-level faults have their tests too: out of memory in tests/test_devices.py, a killed draft
process in tests/test_draft_process.py, a corrupt, read-only or full store in tests/test_sessions_errors.py.)"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

import sessions.db as db_mod
from app.identity import browser_identity
from app.load_test import answer_text, make_client
from engine.engine import Engine
from engine.models.loading import load_pair
from sessions import Store
from sessions.export import export_json

from .conftest import serve_app

WAIT_S = 120  # generous bounds on waits (polled), never timing assertions


class Faulty:
    """The real LM's forward with a fault at its `at`-th call from arm(): raise `error` there, or wait there until
    release() (a forward that has not returned yet). `slow` seconds of sleep after every call from the fault on keep
    the rest of a run long enough to be cut off."""

    def __init__(self, lm):
        self.lm, self.real, self.calls = lm, lm.forward, 0
        self.at, self.error, self.slow = None, None, 0.0
        self.gate, self.waiting = threading.Event(), threading.Event()
        lm.forward = self.forward

    def arm(self, at: int, error: BaseException | None = None, slow: float = 0.0) -> None:
        self.calls, self.at, self.error, self.slow = 0, at, error, slow
        self.gate.clear()
        self.waiting.clear()

    def disarm(self) -> None:
        self.at, self.slow = None, 0.0
        self.gate.set()

    def release(self) -> None:
        self.gate.set()

    def forward(self, *args, **kwargs):
        self.calls += 1
        if self.at is not None and self.calls == self.at:
            if self.error is not None:
                self.at = None  # once: the next run works
                raise self.error
            self.waiting.set()
            self.gate.wait(WAIT_S)
        if self.at is not None and self.calls >= self.at and self.slow:
            time.sleep(self.slow)
        return self.real(*args, **kwargs)


@pytest.fixture(scope="module")
def served(tiny_dirs, tmp_path_factory):
    """An app of its own on fresh tiny models (their forwards can be faulted without touching other tests'),
    recording to a fresh store."""
    engine = Engine(load_pair(str(tiny_dirs["target"]), str(tiny_dirs["draft"]), device="cpu", draft_matmul="float32"))
    faulty = Faulty(engine.pair.target)
    with Store(tmp_path_factory.mktemp("faults") / "sessions.db") as store:
        demo, url = serve_app(engine, store)
        try:
            yield engine, faulty, store, url
        finally:
            faulty.disarm()
            demo.close()
            engine.close()


def generate(client, prompt, browser, max_new=24, method="sd"):
    return client.submit(prompt, [], method, max_new=max_new, chat=False, browser_id=browser, api_name="/generate")


def stored_runs(store, browser) -> list[dict]:
    return [
        run
        for s in store.list_sessions(owner=browser, include_shared=False)
        for run in store.get_session(s["id"], browser)["runs"]
    ]


def wait_for(condition, what: str) -> None:
    limit = time.monotonic() + WAIT_S
    while time.monotonic() < limit:
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError(f"not within {WAIT_S} s: {what}")


def works_again(client, engine, store) -> None:
    """The next request completes, and is stored complete."""
    browser = browser_identity(None)
    final = generate(client, "h g f", browser, max_new=8).result(timeout=WAIT_S)
    assert answer_text(final[0]) and "notice-error" not in final[3]
    assert [r["status"] for r in stored_runs(store, browser)] == ["complete"]
    assert not engine.busy and store.integrity_check() == "ok"


def test_the_target_running_out_of_memory_mid_run_ends_it_with_a_message(served):
    engine, faulty, store, url = served
    client, browser = make_client(url), browser_identity(None)
    faulty.arm(at=4, error=torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    final = generate(client, "a b c", browser).result(timeout=WAIT_S)
    assert "out of memory" in final[3] and "notice-error" in final[3]
    assert answer_text(final[0])  # what came before the fault stays on the page
    wait_for(lambda: not engine.busy, "the engine is free")
    (run,) = stored_runs(store, browser)
    assert run["status"] == "partial" and run["token_count"] > 0  # kept, marked partial
    works_again(client, engine, store)


def kept_partial(engine, faulty, store, client, browser, cause: str) -> None:
    """After a run cut off by `cause`: the engine is free, the run is stored partial (and its recorder closed), and
    the app serves the next run."""
    wait_for(lambda: not engine.busy, f"the engine is free after {cause}")
    wait_for(
        lambda: stored_runs(store, browser) and stored_runs(store, browser)[0]["metrics"] is not None,
        "the run is stored and its recorder closed",
    )
    (run,) = stored_runs(store, browser)
    assert run["status"] == "partial" and 0 < run["token_count"] < 60
    faulty.disarm()
    works_again(client, engine, store)


def test_a_client_that_cancels_mid_stream_frees_the_engine_and_its_run_is_kept_partial(served):
    """gradio_client's job.cancel() posts /cancel, which waits for the handler's current step: so here nothing is
    held, the forwards are only slow, and the cancel comes once tokens have streamed, with most of the run to go."""
    engine, faulty, store, url = served
    client, browser = make_client(url), browser_identity(None)
    faulty.arm(at=1, slow=0.2)
    faulty.release()  # no forward waits: each is only slow
    job = generate(client, "b c d", browser, max_new=60)
    wait_for(lambda: any(answer_text(o[0]) for o in job.outputs()), "tokens reach the client")
    job.cancel()
    kept_partial(engine, faulty, store, client, browser, "the cancel")


def test_a_dropped_connection_mid_stream_frees_the_engine_and_its_run_is_kept_partial(served):
    """A browser tab closed mid-run: the HTTP stream goes away without a word."""
    engine, faulty, store, url = served
    client, browser = make_client(url), browser_identity(None)
    api = client.view_api(return_format="dict", print_info=False)["named_endpoints"]["/generate"]["parameters"]
    data = {p["parameter_name"]: p.get("parameter_default") for p in api}
    data.update(prompt="c d e", history=[], method="sd", max_new=60, chat=False, browser_id=browser)
    fn_index = next(d["id"] for d in client.config["dependencies"] if d.get("api_name") == "generate")
    faulty.arm(at=4, slow=0.2)
    join = httpx.post(
        f"{url}gradio_api/queue/join",
        timeout=30,
        json={
            "data": [*data.values(), None],
            "fn_index": fn_index,
            "session_hash": "droppedtab1",  # None: the draft state
            "event_data": None,
            "trigger_id": None,
        },
    )
    assert join.status_code == 200, join.text
    with httpx.stream("GET", f"{url}gradio_api/queue/data?session_hash=droppedtab1", timeout=WAIT_S) as stream:
        for line in stream.iter_lines():
            if "process_generating" in line and "c d e" in line:
                break  # a streamed update: the run is under way
        assert faulty.waiting.wait(WAIT_S)
    # the connection is closed here, with the engine inside a forward
    faulty.release()
    kept_partial(engine, faulty, store, client, browser, "the drop")


def test_a_full_disk_stops_recording_not_generating_and_damages_nothing(tiny_engine, tmp_path, monkeypatch):
    """The store's disk fills: SQLite may not grow the file by one page (PRAGMA max_page_count, on the store's own
    connection and on every recorder's). Generation goes on; the page says it is not recording; the sessions stored
    before are intact and the file is sound."""
    engine = Engine(tiny_engine.pair)
    with Store(tmp_path / "sessions.db") as store:
        demo, url = serve_app(engine, store)
        try:
            client, before = make_client(url), browser_identity(None)
            final = generate(client, "d e f", before, max_new=12).result(timeout=WAIT_S)
            assert answer_text(final[0]) and "not recording" not in final[3]
            (earlier,) = store.list_sessions(owner=before, include_shared=False)
            kept = export_json(store, earlier["id"])
            sessions_before = len(store.list_sessions(limit=None))

            real = db_mod.connect

            def full(path, readonly=False):
                conn = real(path, readonly)
                conn.execute(f"PRAGMA max_page_count = {conn.execute('PRAGMA page_count').fetchone()[0]}")
                return conn

            monkeypatch.setattr(db_mod, "connect", full)  # every recorder's connection, from now on
            pages = store.db.execute("PRAGMA page_count").fetchone()[0]
            store.db.execute(f"PRAGMA max_page_count = {pages}")  # and the store's own
            browser = browser_identity(None)
            final = generate(client, "e f g " * 8, browser, max_new=24).result(timeout=WAIT_S)
            assert answer_text(final[0])  # generated all the same
            assert "not recording: the disk holding" in final[3] and "is full" in final[3]
            monkeypatch.undo()
            store.db.execute("PRAGMA max_page_count = 1073741823")
            assert store.integrity_check() == "ok"
            assert export_json(store, earlier["id"]) == kept  # byte for byte
            # the session row, and even a first batch of events, may fit in free space left in the file's pages:
            # what was written is whole (each batch is one transaction): a partial run whose row agrees with its events
            mine = store.list_sessions(owner=browser, include_shared=False)
            assert len(store.list_sessions(limit=None)) - sessions_before == len(mine) <= 1
            for session in mine:
                for run in store.get_session(session["id"], browser)["runs"]:
                    events = store.load_run_events(run["id"])
                    assert run["status"] == "partial" and events[0].type == "run_started"
                    assert run["token_count"] == sum(len(e.tokens) for e in events if e.type == "tokens_emitted")
            final = generate(client, "f g h", browser_identity(None), max_new=8).result(timeout=WAIT_S)
            assert answer_text(final[0]) and "not recording" not in final[3]  # room again: recording again
        finally:
            demo.close()
            engine.close()
