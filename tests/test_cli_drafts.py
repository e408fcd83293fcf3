"""Every draft the README lists runs through `python -m engine generate` (engine.cli.main, what `python -m engine`
calls), with the draft's preset and the CLI's defaults but for the draft's worker (a thread: a child process per draft
would load the target again), and gives a short greedy output that is the target's own: transformers' generate() on a
model loaded apart from the engine's (tests/reference.py). The embedded draft head through `bench` too."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from engine.cli import main
from engine.models.loading import embedded_gguf_path

from .reference import greedy_generate

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PROMPT = "The capital of France is"
NEW = 6
# each spec of the README's draft table, as a draft this suite runs
EMBEDDED_DRAFTS = {
    "self": "self",
    "self-skip:I,J,...": "self-skip:3,4,5,25",
    "embedded": "embedded",
    "embedded-weak": "embedded-weak",
    "embedded-head": "embedded-head",
    "truncated:N": "truncated:4",
    "PATH.gguf": str(embedded_gguf_path()),  # the embedded target's own GGUF file, as a draft
}
TINY_DRAFTS = {"DIR": "test_a_directory_draft", "owner/name": "test_a_hub_id_draft"}  # drafts of the tiny target


def readme_drafts() -> set[str]:
    """The draft specs of the README's table ("| `self` | ...", "| `PATH.gguf`, `DIR`, `owner/name` | ...")."""
    table = README.read_text().split("## Drafts", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    return {spec for row in rows for spec in re.findall(r"`([^`]+)`", row)}


def generate(capsys, prompt: str, *argv: str) -> dict:
    """`python -m engine generate --prompt PROMPT ... --json` in this process: its one JSON record."""
    capsys.readouterr()
    code = main(["generate", "--prompt", prompt, "--max-new-tokens", str(NEW), "--json", "--device", "cpu", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_every_draft_the_readme_lists_is_run_here():
    assert readme_drafts() == set(EMBEDDED_DRAFTS) | set(TINY_DRAFTS)


@pytest.fixture(scope="module")
def embedded_want(embedded_reference_model):
    """The embedded target's own greedy continuation of PROMPT (raw text, as `generate` without --chat encodes it)."""
    from transformers import AutoTokenizer

    from engine.models.loading import resolve_source

    ids = AutoTokenizer.from_pretrained(resolve_source("embedded")).encode(PROMPT)
    return greedy_generate(embedded_reference_model, ids, NEW)


@pytest.mark.slow  # the embedded target loaded by each command
@pytest.mark.parametrize("spec", list(EMBEDDED_DRAFTS))
def test_generate_with_each_embedded_draft(capsys, embedded_want, spec):
    record = generate(capsys, PROMPT, "--draft", EMBEDDED_DRAFTS[spec], "--draft-worker", "thread")
    assert record["method"] == "specbranch" and record["token_ids"] == embedded_want
    assert record["metrics"]["drafted_tokens"] > 0  # the draft drafted


def test_a_directory_draft(capsys, tiny_dirs, tiny_reference):
    """DIR: a local transformers directory as the draft (of the tiny target, whose vocabulary it shares)."""
    tiny = ["--target", str(tiny_dirs["target"]), "--draft", str(tiny_dirs["draft"]), "--draft-worker", "thread"]
    record = generate(capsys, "a b c", *tiny)
    assert record["token_ids"] == tiny_reference([2, 3, 4], NEW)  # the tiny tokenizer's ids of "a b c"
    assert record["metrics"]["drafted_tokens"] > 0


@pytest.mark.slow
def test_bench_with_the_draft_head(tmp_path, capsys):
    """`bench` with the shipped draft head: its greedy output is AR's on every prompt."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT, "chat": False}) + "\n")
    out = tmp_path / "bench.json"
    argv = ["bench", "--methods", "ar,specbranch", "--draft", "embedded-head", "--device", "cpu", "--draft-worker"]
    code = main([*argv, "thread", "--dataset", str(prompts), "--max-new-tokens", str(NEW), "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    assert report["identical_to_ar"] == {"specbranch": "1/1"}
    assert report["draft_forward"]["specbranch"] == "transformers"  # a head runs its own forward


class HubStandIn(BaseHTTPRequestHandler):
    """The Hugging Face Hub's endpoints that transformers' from_pretrained reads, on 127.0.0.1, serving one model
    directory (`folder`) as the repository `repo`: its info, an empty file tree, and its files by name (404 for any
    other, as the Hub answers a file a repository lacks)."""

    repo, folder, commit = "owner/name", Path(), "0" * 40

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self.send_file(body=False)

    def do_GET(self) -> None:
        api = f"/api/models/{self.repo}"
        if self.path.startswith(api + "/tree/"):
            self.send_bytes(b"[]", {"Content-Type": "application/json"})
        elif self.path.split("?")[0] in (api, f"{api}/revision/main"):
            files = [{"rfilename": p.name} for p in self.folder.iterdir()]
            info = {"id": self.repo, "sha": self.commit, "siblings": files}
            self.send_bytes(json.dumps(info).encode(), {"Content-Type": "application/json"})
        else:
            self.send_file(body=True)

    def send_file(self, body: bool) -> None:
        prefix = f"/{self.repo}/resolve/"
        name = self.path.split("?")[0][len(prefix) :].partition("/")[2] if self.path.startswith(prefix) else ""
        files = {p.name: p for p in self.folder.iterdir() if p.is_file()}  # names from the folder, never the request
        if name not in files:
            self.send_bytes(b"", {"X-Error-Code": "EntryNotFound"}, status=404)
            return
        data = files[name].read_bytes()
        headers = {"X-Repo-Commit": self.commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
        self.send_bytes(data, headers, body=body)

    def send_bytes(self, data: bytes, headers: dict, status: int = 200, body: bool = True) -> None:
        self.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(data))}.items():
            self.send_header(key, value)
        self.end_headers()
        if body:
            self.wfile.write(data)


@pytest.mark.slow  # a process of its own
def test_a_hub_id_draft(tiny_dirs, tiny_reference, tmp_path):
    """owner/name: a Hub id as the draft, fetched by transformers' own client (huggingface_hub) from a stand-in for
    the Hub's endpoint on 127.0.0.1 (HF_ENDPOINT) that serves the tiny draft's directory, through `python -m engine`
    in a process of its own (the client reads HF_ENDPOINT when it is imported)."""
    handler = type("Hub", (HubStandIn,), {"folder": tiny_dirs["draft"]})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = dict(os.environ, HF_ENDPOINT=f"http://127.0.0.1:{server.server_address[1]}", HF_HOME=str(tmp_path / "hf"))
    argv = ["--target", str(tiny_dirs["target"]), "--draft", "owner/name", "--draft-worker", "thread", "--prompt"]
    argv += ["a b c", "--max-new-tokens", str(NEW), "--json", "--device", "cpu"]
    try:
        done = subprocess.run(
            [sys.executable, "-m", "engine", "generate", *argv], cwd=ROOT, env=env, capture_output=True, text=True
        )
    finally:
        server.shutdown()
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record["token_ids"] == tiny_reference([2, 3, 4], NEW) and record["metrics"]["drafted_tokens"] > 0
    assert (tmp_path / "hf" / "hub" / "models--owner--name").is_dir()  # fetched from the stand-in, into its cache
