"""The method registry (engine/config.py REGISTRY) says what each method does, and a run on the tiny pair shows it:
whether it needs a draft, whether the engine's own loop drives the draft, and whether the two models take turns."""

from __future__ import annotations

import threading
import time

import pytest

from engine.config import METHODS, REGISTRY, GenerationConfig, SpecBranchError
from engine.engine import Engine
from engine.events import BRANCH_DRAFT, DRAFT, DraftProposed, TimingSpan

PROMPT = [2, 3, 4, 5]


@pytest.fixture(scope="module")
def target_only(tiny_dirs):
    from engine.models.loading import load_pair

    engine = Engine(load_pair(str(tiny_dirs["target"]), None, device="cpu"))
    yield engine
    engine.close()


def test_every_method_has_one_entry():
    assert tuple(REGISTRY) == METHODS
    assert all(name == m.name for name, m in REGISTRY.items())


@pytest.mark.parametrize("method", METHODS)
def test_a_method_without_a_draft_runs_only_where_it_needs_none(target_only, method):
    cfg = GenerationConfig(method=method, max_new_tokens=4)
    if REGISTRY[method].needs_draft:
        with pytest.raises(SpecBranchError, match="needs a draft model"):
            target_only.run(PROMPT, cfg)
    else:
        assert len(target_only.run(PROMPT, cfg).token_ids) == 4


def beside_the_draft(pair, monkeypatch, wait_s: float = 1.0) -> None:
    """Every target forward (a verify pass of one token or several, or the prefill) returns only once a draft forward
    that started after it began has ended (or after wait_s: a serial method never drafts beside it). On a busy
    machine a tiny pair's 1 ms pass could otherwise end before the draft's thread is scheduled at all, and show no
    overlap by chance; this way a draft step asked for beside a pass lies wholly within its span. A rule, not a
    sleep: it waits on the draft's step, never on time alone (wait_s bounds only the serial method's wait)."""
    starts, started = [], threading.Condition()
    target_forward, draft_forward = pair.target.forward, pair.draft.forward

    def draft(*args, **kwargs):
        began = time.perf_counter()
        out = draft_forward(*args, **kwargs)
        with started:  # a whole draft forward inside the pass, so the overlap is a step, not microseconds
            starts.append(began)
            started.notify_all()
        return out

    def target(input_ids, *args, **kwargs):
        began = time.perf_counter()
        out = target_forward(input_ids, *args, **kwargs)
        with started:
            started.wait_for(lambda: bool(starts) and starts[-1] >= began, timeout=wait_s)
        return out

    monkeypatch.setattr(pair.draft, "forward", draft)
    monkeypatch.setattr(pair.target, "forward", target)


@pytest.mark.parametrize("method", METHODS)
def test_what_a_run_shows_matches_the_registry(tiny_engine, method, monkeypatch):
    kind = REGISTRY[method]
    if kind.drafts_here:  # a method whose draft never steps in the loop has nothing to wait on
        beside_the_draft(tiny_engine.pair, monkeypatch)
    result = tiny_engine.run(PROMPT, GenerationConfig(method=method, max_new_tokens=8, gamma=3))
    spans = [e for e in result.events if isinstance(e, TimingSpan)]
    draft_steps = [s for s in spans if s.worker == "draft" and s.kind in (DRAFT, BRANCH_DRAFT)]
    proposed = [e for e in result.events if isinstance(e, DraftProposed)]
    # the engine's loop drives the draft on its worker, and shows what it drafted; hf-assisted's draft runs inside
    # transformers' generate() on the target's worker, unseen (a draft's prefill runs for every method)
    assert bool(draft_steps) == bool(proposed) == kind.drafts_here
    assert any(s.kind == "assisted_generate" for s in spans) == (kind.decoder == "assisted")
    # the spans themselves: an overlapped method's draft steps beside the target's passes; a serial one's (SD) never
    # computes while the other does
    overlap = result.metrics["overlap"]
    assert (overlap > 0) == (kind.drafts_here and kind.overlapped)
