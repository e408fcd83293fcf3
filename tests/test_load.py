"""Load, bounded: a burst of gradio_client sessions against the app on loopback (app/load_test.py's own code), with a
small queue bound and tiny models. Each client completes or is told the app is busy; every completed run is stored
under its own browser id, no browser reads another's, and the store stays sound. Nothing here times anything: the
queue is filled by holding the engine, as a long generation would, until every request has settled."""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import contextmanager

import httpx
import pytest

from app.load_test import ROOT, is_busy_message, make_client, new_browser_id, prompt_for, run_load
from app.main import BUSY
from engine.engine import Engine
from sessions import Store

from .conftest import serve_app

BOUND, CLIENTS = 4, 12
SETTLE_S = 120  # generous bounds on waits, never timing assertions


@pytest.fixture(scope="module")
def app(tiny_engine, tmp_path_factory):
    engine = Engine(tiny_engine.pair)  # the tiny models with a lock of their own: holding it cannot stall other tests
    with Store(tmp_path_factory.mktemp("load") / "sessions.db") as store:
        demo, url = serve_app(engine, store, max_queue=BOUND)
        try:
            yield engine, store, url
        finally:
            demo.close()
            engine.close()


@contextmanager
def engine_held(engine):
    """The engine busy, as while a long generation runs: the first request to reach it waits, the others queue."""
    engine._busy.acquire()
    try:
        yield
    finally:
        engine._busy.release()


def test_a_burst_completes_or_is_told_busy_and_every_run_stays_its_browsers(app):
    engine, store, url = app
    before = len(store.list_sessions(limit=None))
    report = run_load(
        url,
        store.path,
        CLIENTS,
        tokens=8,
        gate=engine_held(engine),
        timeout=SETTLE_S,
        others={s["owner"] for s in store.list_sessions(limit=None)},
    )
    assert report["problems"] == [] and report["ok"], report["problems"]
    assert report["completed"] + report["refused"] == CLIENTS and report["failed"] == 0
    # one request reached the engine and BOUND waited; whether the first had left the waiting line when the last of
    # the burst arrived decides whether one more got in
    assert report["completed"] in (BOUND, BOUND + 1), report
    assert report["refused_messages"] == ["Queue is full! Please try again."]  # gradio_client's words for a 503
    assert report["stored_sessions"] - before == report["completed"] and report["integrity_check"] == "ok"
    assert report["isolation_attempts"] == 4 * report["completed"]
    assert all(r["ttft_s"] is not None for r in report["runs"] if r["outcome"] == "completed")


def test_a_full_queue_answers_busy_and_the_other_endpoints_still_serve(app):
    """Past the bound, the HTTP answer is 503 with the app's busy message (what a browser or a plain HTTP client
    reads); Replay's endpoints do not wait behind the engine, so they serve while its queue is full."""
    engine, store, url = app
    clients = [make_client(url) for _ in range(BOUND + 1)]
    fn_index = next(d["id"] for d in clients[0].config["dependencies"] if d.get("api_name") == "generate")
    with engine_held(engine):
        jobs = [
            c.submit(
                prompt_for(100 + i), [], "sd", max_new=4, chat=False, browser_id=new_browser_id(), api_name="/generate"
            )
            for i, c in enumerate(clients)
        ]
        settle(jobs)
        answer = httpx.post(
            f"{url}gradio_api/queue/join",
            timeout=30,
            json={
                "data": ["a b", [], "sd"],
                "fn_index": fn_index,
                "session_hash": "loadtest0",
                "event_data": None,
                "trigger_id": None,
            },
        )
        assert answer.status_code == 503
        detail = answer.json()["detail"]
        assert detail == BUSY.format(waiting=BOUND, bound=BOUND) and is_busy_message(detail)
        table, _, status = clients[0].predict("", "", new_browser_id(), api_name="/search")  # served meanwhile
        assert "no stored sessions" in status
    finals = [job.result(timeout=SETTLE_S) for job in jobs]
    assert all(final[0][-1]["role"] == "assistant" for final in finals)


def settle(jobs) -> None:
    """Wait until one job runs and the others wait in the queue (bounded)."""
    import time

    from gradio_client.utils import Status

    limit = time.monotonic() + SETTLE_S
    while time.monotonic() < limit:
        codes = [job.status().code for job in jobs]
        if codes.count(Status.PROCESSING) == 1 and codes.count(Status.IN_QUEUE) == len(jobs) - 1:
            return
        time.sleep(0.02)
    raise AssertionError(f"the jobs did not settle: {codes}")


@pytest.mark.slow
def test_the_command_runs_the_app_and_reports(tiny_dirs, tmp_path):
    """`python -m app.load_test` end to end: it starts app.py in a process of its own on the tiny models, warms it
    up, sends the burst, checks and writes its JSON; it exits 0 when every check passed."""
    out = tmp_path / "load.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.load_test",
            "--clients",
            "4",
            "--tokens",
            "4",
            "--max-queue",
            "2",
            "--target",
            str(tiny_dirs["target"]),
            "--draft",
            str(tiny_dirs["draft"]),
            "--app-arg=--draft-worker=thread",
            "--app-arg=--draft-forward=lean",
            "--timeout",
            "300",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    report = json.loads(out.read_text())
    assert report["completed"] + report["refused"] == 4 and report["completed"] >= 1 and report["failed"] == 0
    assert report["integrity_check"] == "ok" and report["ok"] and report["peak_rss_mb"] > 0
    assert report["ttft_p50_s"] is not None and len(report["load_average_before"]) == 3
    assert "Traceback" not in done.stderr
