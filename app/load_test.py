"""Load test: many browsers generate at once against one app, on loopback.

  python -m app.load_test --clients 50 --tokens 16 --json OUT.json [--target T --draft D] [--max-queue N]
                          [--app-arg=--draft-forward=lean ...]

starts `python app.py` on a free 127.0.0.1 port with a throw-away session store, sends one warm-up run (the models
load on the first request; not counted), then opens one gradio_client session per client, each with a browser id of
its own, and submits every client's /generate at once. It prints, and writes as JSON: how many completed, how many
were refused by the bounded queue (with the message they got) and how many failed; time to first token (from the
submit to the first streamed update that holds answer text) at p50 and p95; the peak RSS of the app's process with
its children (the draft's processes); and the checks:
- every completed run is stored, complete, under its own browser id, and a refused one stores nothing;
- no browser reads another's runs: each client searches with its own id and asks /open_session, /export_session and
  /share_session for the next client's session (refused, whether by gradio's check of the session menu's choices or
  by the store's owner check), and its search never lists it;
- SQLite's `PRAGMA integrity_check` is ok.
It exits 0 when every client completed or was refused with a busy message and every check passed, else 1.
tests/test_load.py runs the same functions, bounded, on tiny models in this process (run_load).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = "a b c d e f g h".split()  # words every tokenizer the app serves knows, the tiny test models' included
POLL_S = 0.02
BUSY_WORDS = ("busy", "try again", "queue is full")  # what a refusal by the bounded queue says (any of them)


def prompt_for(i: int) -> str:
    """A prompt of its own for client i: 'a' then i in base 8 spelled with the words a-h (raw text, no chat)."""
    digits = []
    while True:
        i, d = divmod(i, 8)
        digits.append(WORDS[d])
        if i == 0:
            break
    return "a " + " ".join(reversed(digits))


def answer_text(history) -> str:
    """The last assistant message's text in a chatbot value (content may be a list of typed parts)."""
    if not history:
        return ""
    last = history[-1]
    if not isinstance(last, dict) or last.get("role") != "assistant":
        return ""
    c = last.get("content")
    return c if isinstance(c, str) else "".join(p.get("text", "") for p in c or [] if isinstance(p, dict))


def is_busy_message(message: str) -> bool:
    low = (message or "").lower()
    return any(w in low for w in BUSY_WORDS)


@dataclass
class ClientRun:
    index: int
    browser: str
    prompt: str
    outcome: str = "pending"  # completed | refused | failed
    message: str = ""
    ttft_s: float | None = None
    total_s: float | None = None
    text: str = ""
    session_id: str | None = None
    run_id: str | None = None
    problems: list[str] = field(default_factory=list)


def new_browser_id() -> str:
    from app.identity import browser_identity

    return browser_identity(None)  # what a new browser gets: 32 hex digits, kept in its localStorage


def make_client(url: str):
    from gradio_client import Client

    return Client(url, verbose=False, download_files=False)


def submit(client, run: ClientRun, tokens: int, method: str):
    return client.submit(
        run.prompt, [], method, max_new=tokens, chat=False, browser_id=run.browser, api_name="/generate"
    )


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (nearest rank) of values; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def run_clients(
    url: str,
    clients: int,
    tokens: int,
    method: str = "specbranch",
    timeout: float = 600.0,
    gate=None,
    settled_timeout: float = 120.0,
) -> tuple[list[ClientRun], list]:
    """Open `clients` gradio_client sessions, each with a browser id of its own, and submit every /generate at once.
    gate: a context manager held from just before the submits until every job has settled (running, waiting or
    refused), e.g. one that holds the engine so that the queue fills (tests/test_load.py). Returns the runs and the
    clients (for the isolation checks)."""
    runs = [ClientRun(i, new_browser_id(), prompt_for(i)) for i in range(clients)]
    with ThreadPoolExecutor(max_workers=min(8, clients)) as pool:  # connecting: each fetches the app's config
        sessions = list(pool.map(lambda _: make_client(url), range(clients)))
    from gradio_client.utils import Status

    with gate if gate is not None else contextlib.nullcontext():
        started = time.perf_counter()
        jobs = [submit(c, r, tokens, method) for c, r in zip(sessions, runs)]
        submitted = [started] * clients
        if gate is not None:
            limit = time.monotonic() + settled_timeout
            while time.monotonic() < limit:
                codes = [job.status().code for job in jobs]
                if all(job.done() or code in (Status.IN_QUEUE, Status.PROCESSING) for job, code in zip(jobs, codes)):
                    break
                time.sleep(POLL_S)
    deadline = time.monotonic() + timeout
    pending = set(range(clients))
    while pending and time.monotonic() < deadline:
        for i in list(pending):
            job, run = jobs[i], runs[i]
            if run.ttft_s is None:
                outputs = job.outputs()
                if any(isinstance(o, (list, tuple)) and o and answer_text(o[0]) for o in outputs):
                    run.ttft_s = time.perf_counter() - submitted[i]
            if job.done():
                pending.discard(i)
                finish(run, job, submitted[i])
        time.sleep(POLL_S)
    for i in pending:
        jobs[i].cancel()
        runs[i].outcome, runs[i].message = "failed", f"no answer within {timeout:.0f} s"
    return runs, sessions


def finish(run: ClientRun, job, submitted: float) -> None:
    from gradio_client.exceptions import AppError
    from gradio_client.utils import QueueError

    run.total_s = time.perf_counter() - submitted
    try:
        final = job.result(timeout=0)
    except QueueError as exc:
        run.outcome, run.message = "refused", str(exc)
        return
    except (AppError, Exception) as exc:  # noqa: BLE001 - anything else is a failure, reported with its message
        run.outcome, run.message = "failed", f"{type(exc).__name__}: {exc}"
        return
    run.text = answer_text(final[0])
    notices = final[3] if isinstance(final[3], str) else ""
    if "notice-error" in notices or not run.text:
        run.outcome, run.message = "failed", notices or "no answer text"
    else:
        run.outcome = "completed"


def check_store(db: Path, runs: list[ClientRun], others: set[str] = frozenset()) -> dict:
    """Every completed run stored, complete, under its own browser id, one session each; nothing stored for a refused
    or failed client; no session of an owner outside the clients and `others` (the warm-up); integrity ok."""
    from sessions import Store

    with Store(db, readonly=True) as store:
        integrity = store.integrity_check()
        everyone = store.list_sessions(limit=None)
        for run in runs:
            mine = store.list_sessions(owner=run.browser, include_shared=False, limit=None)
            if run.outcome != "completed":
                if mine:
                    run.problems.append(f"{run.outcome} but {len(mine)} session(s) stored")
                continue
            if [s["prompt"] for s in mine] != [run.prompt]:
                run.problems.append(f"stored sessions {[s['prompt'] for s in mine]}, not its one prompt")
                continue
            session = store.get_session(mine[0]["id"], run.browser)
            run.session_id = session["id"]
            if session["status"] != "complete" or len(session["runs"]) != 1:
                run.problems.append(f"stored {session['status']} with {len(session['runs'])} run(s)")
                continue
            run.run_id = session["runs"][0]["id"]
            stored = "".join(e.text for e in store.load_run_events(run.run_id) if e.type == "tokens_emitted")
            if stored.strip() != run.text.strip():  # gradio's Chatbot trims a message's ends (" way to" is "way to")
                run.problems.append("the stored tokens are not the text it was shown")
    owners = {run.browser for run in runs} | set(others)
    strangers = [s["id"] for s in everyone if s["owner"] not in owners]
    return {"integrity_check": integrity, "sessions": len(everyone), "strangers": strangers}


def check_isolation(runs: list[ClientRun], sessions: list) -> int:
    """Each completed client (its own gradio session and browser id) tries to read the next completed client's
    session through every endpoint that takes a session id, and searches for its prompt. Returns the number of
    attempts; a read that succeeds is a problem of the reader."""
    done = [r for r in runs if r.outcome == "completed" and r.session_id]
    attempts = 0
    for k, run in enumerate(done):
        if len(done) < 2:
            break
        other = done[(k + 1) % len(done)]
        client = sessions[run.index]
        table, _, status = client.predict("", "", run.browser, api_name="/search")
        attempts += 1
        ids = (
            [row[0] for row in (table or {}).get("data", [])]
            if isinstance(table, dict)
            else [row[0] for row in table or []]
        )
        if ids != [run.session_id]:
            run.problems.append(f"its search listed {ids}, not only its own session")
        for api, args in (
            ("/open_session", (other.session_id, run.browser)),
            ("/export_session", (other.session_id, run.browser)),
            ("/share_session", (other.session_id, False, run.browser)),
        ):
            attempts += 1
            try:
                out = client.predict(*args, api_name=api)
            except Exception:  # noqa: BLE001 - refused by gradio (not a choice of this session's menu): not read
                continue
            shown = json.dumps(out, default=str)
            if other.prompt in shown or "notice-error" not in shown:
                run.problems.append(f"{api} gave it another browser's session {other.session_id}")
    return attempts


class PeakRss:
    """Samples the RSS of a process and all its children every `every` seconds; peak_mb once stopped."""

    def __init__(self, pid: int, every: float = 0.25):
        import psutil

        self.process, self.every, self.peak = psutil.Process(pid), every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="peak-rss")

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                total = self.process.memory_info().rss
                for child in self.process.children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        total += child.memory_info().rss
            except psutil.Error:
                return
            self.peak = max(self.peak, total)
            self._stop.wait(self.every)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak_mb(self) -> float:
        return round(self.peak / 2**20, 1)


def warm_up(url: str, tokens: int, method: str) -> str:
    """One run before the burst, so that loading the models is not in anyone's time to first token. Its owner."""
    run = ClientRun(-1, new_browser_id(), "a warm up")
    job = submit(make_client(url), run, tokens, method)
    final = job.result(timeout=900)
    if not answer_text(final[0]):
        raise RuntimeError(f"the warm-up run got no answer: {final[3]}")
    return run.browser


def summarize(runs: list[ClientRun], store: dict, attempts: int, rss_mb: float | None, **extra) -> dict:
    ttft = [r.ttft_s for r in runs if r.outcome == "completed" and r.ttft_s is not None]
    counts = {k: sum(r.outcome == k for r in runs) for k in ("completed", "refused", "failed")}
    refused_messages = sorted({r.message for r in runs if r.outcome == "refused"})
    problems = [f"client {r.index}: {p}" for r in runs for p in r.problems]
    problems += [f"client {r.index} failed: {r.message}" for r in runs if r.outcome == "failed"]
    problems += [
        f"client {r.index} refused without a busy message: {r.message!r}"
        for r in runs
        if r.outcome == "refused" and not is_busy_message(r.message)
    ]
    if store["integrity_check"] != "ok":
        problems.append(f"integrity_check: {store['integrity_check']}")
    if store["strangers"]:
        problems.append(f"sessions of unknown owners: {store['strangers']}")
    return {
        **extra,
        "clients": len(runs),
        **counts,
        "refused_messages": refused_messages,
        "ttft_p50_s": round_or_none(percentile(ttft, 50)),
        "ttft_p95_s": round_or_none(percentile(ttft, 95)),
        "total_p50_s": round_or_none(percentile([r.total_s for r in runs if r.outcome == "completed"], 50)),
        "peak_rss_mb": rss_mb,
        "stored_sessions": store["sessions"],
        "integrity_check": store["integrity_check"],
        "isolation_attempts": attempts,
        "ok": not problems and counts["completed"] + counts["refused"] == len(runs),
        "problems": problems,
        "runs": [{k: v for k, v in asdict(r).items() if k != "browser"} for r in runs],
    }


def round_or_none(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def run_load(
    url: str,
    db: Path,
    clients: int,
    tokens: int,
    method: str = "specbranch",
    gate=None,
    timeout: float = 600.0,
    rss_pid: int | None = None,
    others: set[str] = frozenset(),
    **extra,
) -> dict:
    """The burst and every check, against an app already serving at `url` and recording to `db`."""
    with PeakRss(rss_pid) if rss_pid else contextlib.nullcontext() as rss:
        runs, sessions = run_clients(url, clients, tokens, method, timeout, gate)
    store = check_store(db, runs, others)
    attempts = check_isolation(runs, sessions)
    for client in sessions:
        with contextlib.suppress(Exception):
            client.close()
    return summarize(
        runs, store, attempts, rss.peak_mb if rss is not None else None, tokens=tokens, method=method, **extra
    )


# -- the app in a subprocess ------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(
    port: int, db: Path, max_queue: int, target: str | None, draft: str | None, app_args: list[str], log
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        str(ROOT / "app.py"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--db",
        str(db),
        "--max-queue",
        str(max_queue),
    ]
    cmd += ["--target", target] if target else []
    cmd += ["--draft", draft] if draft else []
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd + list(app_args), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_until_serving(url: str, app: subprocess.Popen, timeout: float) -> None:
    import httpx

    limit = time.monotonic() + timeout
    while time.monotonic() < limit:
        if app.poll() is not None:
            raise RuntimeError(f"the app exited with code {app.returncode} before serving")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"the app did not serve {url} within {timeout:.0f} s")


def stop_app(app: subprocess.Popen) -> None:
    """Stop the app; started in a session of its own (Popen(start_new_session=True)), also every process it left,
    such as a ZeroGPU worker that `spaces` forked from it."""
    group = app.pid if app.poll() is None and os.getpgid(app.pid) == app.pid else None
    if app.poll() is None:
        app.terminate()
        try:
            app.wait(timeout=30)
        except subprocess.TimeoutExpired:
            app.kill()
            app.wait(timeout=30)
    if group is not None:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:  # the group had ended with its leader
            pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m app.load_test", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=50, help="browser sessions that submit at once (default 50)")
    p.add_argument("--tokens", type=int, default=16, help="max new tokens of each run (default 16)")
    p.add_argument("--method", default="specbranch")
    p.add_argument("--max-queue", type=int, default=32, help="the app's --max-queue (default 32, the app's own)")
    p.add_argument("--target", default=None, help="the app's --target (default: the app's own, embedded)")
    p.add_argument("--draft", default=None, help="the app's --draft (default: the app's own)")
    p.add_argument("--app-arg", action="append", default=[], help="one more argument for app.py (repeatable)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds the burst may take before a run fails")
    p.add_argument("--json", dest="json_out", type=Path, default=None, help="write the figures here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.clients < 1 or args.tokens < 1 or args.max_queue < 1:
        print("error: --clients, --tokens and --max-queue must be at least 1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="specbranch-load-") as tmp:
        db, port = Path(tmp) / "sessions.db", free_port()
        url = f"http://127.0.0.1:{port}/"
        with open(Path(tmp) / "app.log", "w+") as log:
            app = start_app(port, db, args.max_queue, args.target, args.draft, args.app_arg, log)
            try:
                wait_until_serving(url, app, timeout=600)
                warm = warm_up(url, args.tokens, args.method)
                load_before = os.getloadavg()
                report = run_load(
                    url,
                    db,
                    args.clients,
                    args.tokens,
                    args.method,
                    timeout=args.timeout,
                    rss_pid=app.pid,
                    others={warm},
                    command=" ".join(["python -m app.load_test", *(argv or sys.argv[1:])]),
                    max_queue=args.max_queue,
                    target=args.target or "embedded",
                    draft=args.draft or "the app's default",
                    app_args=args.app_arg,
                    cpus=os.cpu_count(),
                    load_average_before=[round(x, 2) for x in load_before],
                )
                report["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
            except Exception as exc:
                log.seek(0)
                print(log.read()[-4000:], file=sys.stderr)
                print(f"error: {exc}", file=sys.stderr)
                return 1
            finally:
                stop_app(app)
    brief = {k: v for k, v in report.items() if k != "runs"}
    print(json.dumps(brief, indent=1))
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
