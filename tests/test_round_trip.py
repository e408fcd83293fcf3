"""docs/results/tools/draft_round_trip.py: every answer of the draft's process is timed, as asked or as taken ahead,
on both sides of the socket, through a real child."""

from __future__ import annotations

from engine.config import GenerationConfig
from engine.drafts import process
from engine.engine import Engine
from engine.models.loading import load_pair

from .reference import PROMPT
from .scripts import load_script


def test_each_answer_is_timed_as_asked_or_taken_ahead(tiny_dirs, monkeypatch):
    """SD's block is served by steps the child took ahead (test_draft_process.py), the rest asked for: the counts
    add up to the answers logged, an asked step's forward starts after its request left, and each step taken ahead
    after the forward before it (the child's turnaround, one a step taken ahead)."""
    tool = load_script("docs/results/tools/draft_round_trip.py")
    pair = load_pair(str(tiny_dirs["target"]), str(tiny_dirs["draft"]), device="cpu", draft_matmul="float32",
                     draft_worker="process")  # fmt: skip
    engine = Engine(pair)
    try:
        assert isinstance(engine.pair.draft, process.RemoteLM)
        log: list = []
        ask, answer = tool.timed(log)
        monkeypatch.setattr(process.RemoteLM, "_ask", ask)
        monkeypatch.setattr(process.RemoteLM, "_answer", answer)
        m = tool.measure(engine, GenerationConfig(method="sd", max_new_tokens=16, gamma=3), [PROMPT], log)
    finally:
        engine.close()
    ahead = [a for a in log if a.ahead]
    asked = [a for a in log if not a.ahead]
    assert ahead and asked
    assert (round(len(ahead) / m["steps"], 3), round(len(asked) / m["steps"], 3)) == (
        m["taken_ahead_a_step"], m["asked_a_step"])  # fmt: skip
    assert all(a.start >= a.asked_at for a in asked)  # an asked step starts once its request left (one shared clock)
    # the child runs one forward at a time: a step taken ahead starts after the answered forward before it ended
    assert all(b.start >= a.end for a, b in zip(log, log[1:]) if b.ahead)
    assert all(a.read_from <= a.read_until for a in log) and m["read_ms"]["n"] == len(log)
    assert m["turnaround_ms"]["n"] == sum(1 for b in log[1:] if b.ahead)  # one a step taken ahead after another answer
