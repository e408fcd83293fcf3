"""What watching costs: the first chat's speed through the API (gradio_client, no browser) and in Chromium, each
against an AR chat of the same prompt: `python docs/results/tools/app_speed.py --json
docs/results/json/app-speed.json`.

Serves app.py as `make run` does (every setting its default: the embedded target, the 4-bit self-draft in a process of
its own, its one-token step compiled in a second process) on a private port with a throw-away session store. One
warm-up chat loads the models and starts the draft's compile; the script waits until the app reports the compile
done, so every measured chat runs the compiled step. Then, `--rounds` times, in this order: an AR chat and a
SpecBranch chat through gradio_client, then the same two in headless Chromium (Playwright, a 1280x720 page), each a
first chat: a fresh browser id (a new browser context: empty localStorage), no history, "Why is the sky blue?" (in
Chromium typed at 60 ms a key, 3 s after the page showed, then Generate a second later),
128 new tokens, everything else the page's defaults (T=0). Each chat's tokens/s is what the engine measured while the
page (or the client) received the stream: decode tokens over decode time, read from the run the app stored. The
page's figures are left to finish drawing before the next chat starts.

Targets (docs/app.md): SpecBranch through the API at least 1.5x AR; in Chromium within 15 % of the API's figure.
The machine has 2 cores, shared with other work: `uptime` is recorded around every chat."""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
PROMPT = "Why is the sky blue?"
MAX_NEW = 128
COMPILED = "one-token steps compiled"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class Server:
    """app.py with its defaults, its output collected so the script can wait for the draft's compile."""

    def __init__(self, db: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "app.py", "--port", str(self.port), "--db", str(db)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        threading.Thread(target=self._read, daemon=True).start()
        for _ in range(300):
            try:
                urllib.request.urlopen(self.url, timeout=2)
                return
            except OSError:
                time.sleep(1)
        self.stop()
        raise SystemExit("the app did not start:\n" + "".join(self.lines[-20:]))

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            sys.stderr.write("[app] " + line)

    def wait_for(self, text: str, limit: float) -> bool:
        end = time.time() + limit
        while time.time() < end:
            if any(text in line for line in self.lines):
                return True
            time.sleep(1)
        return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def new_run(store, seen: set, limit: float = 600) -> dict:
    """The next complete run of PROMPT stored after `seen` (session ids already counted)."""
    end = time.time() + limit
    while time.time() < end:
        for s in store.list_sessions(search=PROMPT, limit=200):
            if s["id"] in seen:
                continue
            runs = store.get_session(s["id"])["runs"]
            if runs and runs[0]["status"] == "complete":  # "partial" until its Finished event is stored
                seen.add(s["id"])
                run = runs[0]
                notices = [e.message for e in store.load_run_events(run["id"]) if e.type == "notice"]
                m = run["metrics"] or {}
                return {
                    "method": run["method"],
                    "status": run["status"],
                    "tokens_per_s": m.get("tokens_per_s"),
                    "new_tokens": m.get("new_tokens"),
                    "decode_s": m.get("decode_s"),
                    "notices": notices,
                }
        time.sleep(0.5)
    raise SystemExit("no run was stored in time")


def api_chat(url: str, method: str, store, seen: set) -> dict:
    from gradio_client import Client

    client = Client(url, verbose=False)
    before, start = load(), time.perf_counter()
    job = client.submit(PROMPT, [], method, max_new=MAX_NEW, browser_id=secrets.token_hex(16), api_name="/generate")
    updates = sum(1 for _ in job)
    job.result()
    wall = time.perf_counter() - start
    return {
        **new_run(store, seen),
        "where": "api",
        "updates_received": updates,
        "wall_s": round(wall, 2),
        "load_before": before,
        "load_after": load(),
    }


def browser_chat(browser, url: str, method: str, store, seen: set) -> dict:
    context = browser.new_context(viewport={"width": 1280, "height": 720})  # a new browser: its first chat
    page = context.new_page()
    try:
        page.goto(url, wait_until="load")
        page.wait_for_selector("#prompt textarea", timeout=120_000)
        if method != "specbranch":  # the page's default
            page.locator("#live-method input").click()
            page.get_by_role("option", name=method, exact=True).click()
        time.sleep(3)  # a person looks at the page before typing (the page keeps a connection open: no "idle")
        page.locator("#prompt textarea").press_sequentially(PROMPT, delay=60)  # typed, as a person types
        time.sleep(1)
        before, start = load(), time.perf_counter()
        page.locator("#generate").click()
        run = new_run(store, seen)
        wall = time.perf_counter() - start
        # the last update (every figure) drawn before the next chat starts
        page.wait_for_function(
            f"document.querySelector('#timeline-plot')?.innerText.includes('{method} ·')", timeout=120_000
        )
        page.wait_for_function(
            "document.querySelector('#glance')?.innerText.includes('tokens per target')", timeout=60_000
        )
        time.sleep(2)
        return {
            **run,
            "where": "chromium",
            "wall_s": round(wall, 2),
            "load_before": before,
            "load_after": load(),
            "glance": page.locator("#glance").inner_text(),
        }
    finally:
        context.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    from sessions import Store

    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "sessions.db"
        server = Server(db)
        store, seen = Store(db), set()
        try:
            warm = api_chat(server.url, "specbranch", store, seen)  # loads the models; the draft's compile starts
            compiled = server.wait_for(COMPILED, 600)
            chats = []
            with sync_playwright() as pw:
                browser = pw.chromium.launch(
                    executable_path=shutil.which("chromium"), args=["--no-sandbox", "--disable-gpu"]
                )
                for r in range(args.rounds):
                    for where, method in (
                        ("api", "ar"),
                        ("api", "specbranch"),
                        ("chromium", "ar"),
                        ("chromium", "specbranch"),
                    ):
                        chat = (
                            api_chat(server.url, method, store, seen)
                            if where == "api"
                            else browser_chat(browser, server.url, method, store, seen)
                        )
                        chats.append({"round": r, **chat})
                        print(
                            f"round {r} {where:8} {method:10} {chat['tokens_per_s']} tokens/s "
                            f"(load {chat['load_before']})",
                            file=sys.stderr,
                            flush=True,
                        )
                browser.close()
        finally:
            server.stop()
            store.close()

    def median(where, method):
        return round(
            statistics.median(c["tokens_per_s"] for c in chats if c["where"] == where and c["method"] == method), 2
        )

    api_sb, api_ar = median("api", "specbranch"), median("api", "ar")
    br_sb, br_ar = median("chromium", "specbranch"), median("chromium", "ar")
    per_round = [
        {
            w: round(
                next(
                    c["tokens_per_s"]
                    for c in chats
                    if c["round"] == r and c["where"] == w and c["method"] == "specbranch"
                )
                / next(c["tokens_per_s"] for c in chats if c["round"] == r and c["where"] == w and c["method"] == "ar"),
                3,
            )
            for w in ("api", "chromium")
        }
        for r in range(args.rounds)
    ]
    report = {
        "command": " ".join(["python", os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "note": "2 cores shared with other work; load averages (1, 5, 15 min) around each chat",
        },
        "server": "app.py with its defaults (draft self, lean-compiled, in a process of its own)",
        "prompt": PROMPT,
        "max_new_tokens": MAX_NEW,
        "compile_landed_before_measuring": compiled,
        "warm_up": warm,
        "median_tokens_per_s": {
            "api": {"specbranch": api_sb, "ar": api_ar},
            "chromium": {"specbranch": br_sb, "ar": br_ar},
        },
        "specbranch_vs_ar": {"api": round(api_sb / api_ar, 3), "chromium": round(br_sb / br_ar, 3)},
        "specbranch_vs_ar_per_round": per_round,
        "chromium_vs_api": {"specbranch": round(br_sb / api_sb, 3), "ar": round(br_ar / api_ar, 3)},
        "targets": {"api_specbranch_vs_ar_at_least": 1.5, "chromium_vs_api_at_least": 0.85},
        "met": {"api_vs_ar": api_sb / api_ar >= 1.5, "chromium_vs_api": br_sb / api_sb >= 0.85},
        "chats": chats,
    }
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(
        json.dumps(
            {k: report[k] for k in ("median_tokens_per_s", "specbranch_vs_ar", "chromium_vs_api", "met")}, indent=2
        )
    )


if __name__ == "__main__":
    main()
