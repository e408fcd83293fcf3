"""The app as a ZeroGPU Space runs it, against the real `spaces` package (SPACES_ZERO_GPU=true): app.py serves in a
process of its own (tests/zerogpu_space.py), spaces patches torch there, forks its GPU worker and pickles each call's
arguments and events across; only ZeroGPU's device API is a stand-in (an HTTP server on 127.0.0.1, started and
stopped here), and only the calls that need a CUDA build or a GPU (named in tests/zerogpu_space.py). Two chats go
through the Live tab's /generate: each streams to its end, the second on the worker the first started, and the models
load once, in that worker, never in the app's process."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.engines import EngineCache, GpuFront, gpu_fronts
from app.stream import BASE_GPU_S, GPU_S_PER_TOKEN, MAX_GPU_S, GpuError, gpu_seconds, on_zerogpu, stream_events
from engine.config import GenerationConfig, SpecBranchError
from engine.events import Finished, Notice, RunStarted, StepStarted, TimingSpan
from engine.measure.metrics import compute_metrics

from .zerogpu_space import LOG_ENV, DeviceApi

ROOT = Path(__file__).resolve().parent.parent
NEW = 12
TIMES = {
    RunStarted: ("wall_clock", "target_step_ms"),
    StepStarted: ("t",),
    TimingSpan: ("start", "end"),
    Finished: ("prefill_s", "decode_s", "metrics"),
}


def untimed(events):
    """The events' fields but the clock readings, which differ between any two runs, and the notices made of them
    (e.g. "the draft is slower than the target (2.8 ms vs 2.0 ms a forward)"); the two prefills' spans in a fixed
    order (they run at once, and land in either)."""
    out, spans = [], []
    for event in events:
        if isinstance(event, Notice) and re.search(r"[0-9.]+ ms", event.message):
            continue
        data = dataclasses.asdict(event)
        for name in TIMES.get(type(event), ()):
            data.pop(name)
        (spans if isinstance(event, TimingSpan) else out).append((type(event).__name__, repr(data)))
    return out, sorted(spans)


def tokens(events) -> list[int]:
    return [t for e in events if e.type == "tokens_emitted" for t in e.tokens]


@pytest.fixture(scope="module")
def space(tiny_dirs, tmp_path_factory):
    """Two chats on a ZeroGPU Space on this machine: (the device API's calls, the Engine log, the app's pid, the
    stored runs' events by method, the chats' answers)."""
    from app.load_test import free_port, make_client, new_browser_id, stop_app, wait_until_serving
    from sessions import Store

    tmp = tmp_path_factory.mktemp("space")
    port, db, log = free_port(), tmp / "sessions.db", tmp / "engines.log"
    argv = ["--host", "127.0.0.1", "--port", str(port), "--db", str(db), "--target", str(tiny_dirs["target"])]
    argv += ["--draft", str(tiny_dirs["draft"]), "--draft-worker", "thread", "--draft-forward", "lean"]
    argv += ["--draft-matmul", "float32"]  # no --device: the worker picks it, through spaces' unpatched torch
    with DeviceApi() as api, open(tmp / "app.log", "w") as out:
        env = {**os.environ, "SPACES_ZERO_GPU": "true", "SPACES_ZERO_DEVICE_API_URL": api.url, LOG_ENV: str(log)}
        env.update(GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1")
        app = subprocess.Popen(
            [sys.executable, "-m", "tests.zerogpu_space", *argv],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=out,
            start_new_session=True,  # so stop_app ends the GPU worker that spaces forks from it too
        )
        try:
            url = f"http://127.0.0.1:{port}/"
            wait_until_serving(url, app, 300)
            client, browser, answers = make_client(url), new_browser_id(), {}
            for method in ("sd", "specbranch"):
                final = client.predict(
                    "a b c", [], method, max_new=NEW, temperature=0, gamma=3, chat=False, browser_id=browser,
                    api_name="/generate",
                )  # fmt: skip
                answers[method] = (final[0][-1]["content"], final[3])
        finally:
            stop_app(app)
    with Store(db, readonly=True) as store:
        runs = [r for s in store.list_sessions(owner=browser, limit=None) for r in store.get_session(s["id"])["runs"]]
        stored = {r["method"]: (r["status"], store.load_run_events(r["id"])) for r in runs}
    return api.calls, log.read_text().split(), app.pid, stored, answers, (tmp / "app.log").read_text()


def running(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie, ended but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_two_chats_stream_to_the_end_on_one_gpu_worker(space):
    calls, engines, app_pid, stored, answers, app_log = space
    assert [path for path, _ in calls] == [
        "/startup-report",  # at launch: the app has a GPU function
        "/schedule",
        "/allow",  # the worker's start: one process, which asks for the GPU once
        "/release",
        "/schedule",
        "/release",  # the second chat: the same worker, idle since the first
    ], app_log[-3000:]
    worker = int(calls[2][1]["pid"])
    assert worker != app_pid and all(q["fail"] == "false" for p, q in calls if p == "/release")
    assert not running(worker)  # stopping the app ended the worker spaces forked from it
    asked = [int(q["durationSeconds"]) for p, q in calls if p == "/schedule"]
    assert asked == [int(BASE_GPU_S + GPU_S_PER_TOKEN * NEW)] * 2
    assert engines == ["engine", str(worker)]  # loaded once, in the worker; the second chat reuses it
    assert set(stored) == {"sd", "specbranch"} and all(status == "complete" for status, _ in stored.values())
    for method, (_, events) in stored.items():
        assert isinstance(events[-1], Finished) and events[-1].new_tokens == NEW
        assert events[-1].metrics == compute_metrics(events)
        assert "notice-error" not in answers[method][1], answers[method][1]


def test_the_events_that_crossed_are_the_runs_own(space, tiny_dirs):
    """SD's steps do not depend on timing: what crossed from the worker, pickled, and was stored is, but for the
    clock readings, what the same run gives in this process; SpecBranch's output is the target's own greedy one."""
    from engine.engine import Engine
    from engine.models.loading import load_pair

    _, _, _, stored, answers, _ = space
    engine = Engine(load_pair(str(tiny_dirs["target"]), str(tiny_dirs["draft"]), device="cpu", draft_matmul="float32"))
    try:
        ids = engine.encode("a b c", chat=False)
        cfg = GenerationConfig(**stored["sd"][1][0].config)  # the settings the app sent
        here = engine.run(ids, cfg, "a b c").events
        with torch.inference_mode():
            out = engine.pair.target.model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)
        greedy = out[0, len(ids) :].tolist()
    finally:
        engine.close()
    assert untimed(stored["sd"][1]) == untimed(here)
    assert tokens(stored["specbranch"][1]) == greedy == tokens(here)
    assert answers["specbranch"][0][0]["text"].strip() == engine.pair.tokenizer.decode(greedy).strip()


def test_an_error_in_the_gpu_function_reaches_the_app_with_its_message(tiny_dirs, monkeypatch):
    """spaces hands the app only an error's class name; the GPU function sends its message across instead (GpuError),
    and the app's side raises it again: a SpecBranchError as one (a message for the visitor), anything else not."""
    from app import stream

    def broken(draft, target):
        raise SpecBranchError(f"model path not found or not a model: {draft}")

    monkeypatch.setattr(stream, "_gpu_engines", None)
    stream.serve_on_gpu(lambda: EngineCache(broken, "nowhere"))
    front = gpu_fronts(str(tiny_dirs["target"]), ["nowhere"])["nowhere"]
    cfg = GenerationConfig(method="sd", max_new_tokens=4)
    with pytest.raises(SpecBranchError, match="model path not found or not a model: nowhere"):
        list(stream_events(front, front.encode("a b", False), cfg))
    assert isinstance(GpuError("boom", False).error(), RuntimeError)
    assert not isinstance(GpuError("boom", False).error(), SpecBranchError)


def test_the_front_encodes_and_refuses_as_an_engine_does(tiny_engine, tiny_dirs):
    """The app's process on ZeroGPU holds a GpuFront, no model: it encodes a prompt and refuses one past the context
    as the Engine would, and names the pair as the Engine's does (what a recorded session stores)."""
    front = gpu_fronts(str(tiny_dirs["target"]), [str(tiny_dirs["draft"])])[str(tiny_dirs["draft"])]
    assert isinstance(front, GpuFront) and front.context_length == tiny_engine.pair.target.context_length == 64
    assert front.encode("a b c d", False) == tiny_engine.encode("a b c d", False)
    too_long = list(range(2, 10)) * 8
    for side in (front, tiny_engine):
        with pytest.raises(SpecBranchError, match="the prompt is 64 tokens; the model's context holds 64"):
            side.check_prompt(too_long)
    assert (front.pair.target.name, front.pair.draft.name) == (tiny_engine.pair.target.name, str(tiny_dirs["draft"]))


def test_the_gpu_time_asked_for_follows_the_request_and_is_capped():
    asked = [gpu_seconds("d", [], GenerationConfig(method="specbranch", max_new_tokens=n)) for n in (1, 128, 2048)]
    assert asked[0] < asked[1] < asked[2] <= MAX_GPU_S
    assert on_zerogpu(stream_events, None) is stream_events  # no `spaces` package: nothing wraps
