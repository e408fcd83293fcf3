"""The app's generation as a ZeroGPU Space runs it (app/stream.py): inside `spaces.GPU`, which a stand-in here runs
in a forked process as ZeroGPU does (tests/zerogpu/spaces.py). Events and errors must cross that boundary unchanged,
and the GPU time asked for follows the request."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

from app.stream import BASE_GPU_S, GPU_S_PER_TOKEN, MAX_GPU_S, gpu_seconds, on_zerogpu, run_events
from engine.config import GenerationConfig, SpecBranchError
from engine.events import Finished, Notice, RunStarted, StepStarted, TimingSpan
from engine.measure.metrics import compute_metrics

TIMES = {
    RunStarted: ("wall_clock",),
    StepStarted: ("t",),
    TimingSpan: ("start", "end"),
    Finished: ("prefill_s", "decode_s", "metrics"),
}


def stand_in():
    spec = importlib.util.spec_from_file_location("spaces_stand_in", Path(__file__).parent / "zerogpu" / "spaces.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def untimed(events):
    """The events' fields but the clock readings, which differ between any two runs, and the notices made of them
    (e.g. "the draft is slower than the target (2.8 ms vs 2.0 ms a forward)")."""
    out = []
    for event in events:
        if isinstance(event, Notice) and re.search(r"[0-9.]+ ms", event.message):
            continue
        data = dataclasses.asdict(event)
        for name in TIMES.get(type(event), ()):
            data.pop(name)
        out.append((type(event).__name__, data))
    return out


@pytest.fixture
def fresh_engine(tiny_dirs):
    from engine.engine import Engine
    from engine.models.loading import load_pair

    engine = Engine(load_pair(str(tiny_dirs["target"]), str(tiny_dirs["draft"]), device="cpu", draft_matmul="float32"))
    yield engine
    engine.close()


def tokens(events) -> list[int]:
    return [t for e in events if e.type == "tokens_emitted" for t in e.tokens]


def test_sd_events_cross_the_gpu_boundary_unchanged(fresh_engine):
    """SD's steps do not depend on timing: every event but the clock readings is the same there as here (the two
    prefills' spans may land in either order)."""
    spaces = stand_in()
    cfg = GenerationConfig(method="sd", max_new_tokens=24, gamma=3)
    there = list(on_zerogpu(run_events, spaces)(fresh_engine, [2, 3, 4], cfg))
    here = list(run_events(fresh_engine, [2, 3, 4], cfg))
    spans = lambda events: sorted(map(repr, (e for e in untimed(events) if e[0] == "TimingSpan")))
    assert [e for e in untimed(there) if e[0] != "TimingSpan"] == [e for e in untimed(here) if e[0] != "TimingSpan"]
    assert spans(there) == spans(here)
    assert spaces.CALLS == [gpu_seconds(fresh_engine, [2, 3, 4], cfg)] == [int(BASE_GPU_S + GPU_S_PER_TOKEN * 24)]


@pytest.mark.parametrize("method", ["pearl", "specbranch"])
def test_a_parallel_run_on_the_gpu_side_is_whole(fresh_engine, method):
    """A parallel method drafts as far as fits beside each verification, so its steps follow the clock; what must
    hold there as here: the same greedy output, and events that carry the whole run (their metrics are the ones the
    run computed from them)."""
    cfg = GenerationConfig(method=method, max_new_tokens=24, gamma=3)
    there = list(on_zerogpu(run_events, stand_in())(fresh_engine, [2, 3, 4], cfg))
    here = list(run_events(fresh_engine, [2, 3, 4], cfg))
    assert tokens(there) == tokens(here) and len(tokens(there)) == 24
    assert {e.type for e in there} >= {
        "run_started",
        "step_started",
        "draft_proposed",
        "verified",
        "timing_span",
        "tokens_emitted",
        "finished",
    }
    assert there[-1].metrics == compute_metrics(there)


def test_a_fork_after_this_process_ran_does_not_hang_on_its_threads(fresh_engine):
    """The app's process may have run a generation (its workers' and the engine's lock's threads then exist); a
    forked GPU call gets threads of its own (runtime.PerProcess) instead of queueing on ones the fork left behind."""
    cfg = GenerationConfig(method="pearl", max_new_tokens=8, gamma=3)
    list(run_events(fresh_engine, [2, 3, 4], cfg))
    there = list(on_zerogpu(run_events, stand_in())(fresh_engine, [2, 3, 4], cfg))
    assert isinstance(there[-1], Finished) and there[-1].new_tokens == 8


def test_an_error_raised_on_the_gpu_side_reaches_the_app(fresh_engine):
    stream = on_zerogpu(run_events, stand_in())
    too_long = list(range(2, 10)) * 20  # past the tiny model's 64-position context
    with pytest.raises(SpecBranchError, match="context"):
        list(stream(fresh_engine, too_long, GenerationConfig(method="sd", max_new_tokens=4)))


def test_the_gpu_time_asked_for_follows_the_request_and_is_capped():
    asked = [gpu_seconds(None, [], GenerationConfig(method="specbranch", max_new_tokens=n)) for n in (1, 128, 2048)]
    assert asked[0] < asked[1] < asked[2] <= MAX_GPU_S
    assert on_zerogpu(run_events, None) is run_events  # no `spaces` package: nothing wraps
