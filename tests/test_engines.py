"""The app's engine cache (app/engines.py) on real tiny models, each draft in a process of its own as the app runs it:
at most `cap` engines stay loaded, the least recently used idle one is closed (its draft's process ends), the target
is loaded once and outlives the engine that loaded it, and an engine a generation holds is never closed."""

from __future__ import annotations

import threading

import pytest

from app.engines import EngineCache, max_drafts_from
from engine.config import GenerationConfig
from engine.drafts.process import RemoteLM
from engine.engine import Engine
from engine.models.loading import load_pair, with_draft
from engine.runtime import new_event_loop

from .conftest import make_tiny_model

WAIT_S = 60  # generous: a bound on waits for a process to end, never a timing assertion


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    """A tiny target and three tiny drafts (the same weights perturbed three ways): three menu entries."""
    root = tmp_path_factory.mktemp("engines")
    target = make_tiny_model(root / "target", seed=1)
    specs = {f"d{i}": str(make_tiny_model(root / f"d{i}", seed=1, perturb=0.3, perturb_seed=10 + i)) for i in range(3)}
    return str(target), specs


@pytest.fixture
def cache(drafts, request):
    """The cache, each draft in a process of its own (as the app runs them); parametrized "thread", on threads of
    this process (starting a process costs seconds on a busy machine; closing one is tested by the others)."""
    target, specs = drafts
    made = []
    worker = getattr(request, "param", "process")

    def make(draft, loaded_target):
        made.append((draft, loaded_target))
        pair = (
            load_pair(target, specs[draft], device="cpu", draft_matmul="float32", draft_worker=worker)
            if loaded_target is None
            else with_draft(loaded_target, specs[draft], draft_matmul="float32", draft_worker=worker)
        )
        return Engine(pair)

    cache = EngineCache(make, "d0", cap=2)
    cache.made = made
    yield cache
    cache.close()


def child_of(engine):
    draft = engine.pair.draft
    assert isinstance(draft, RemoteLM), "the draft should run in a process of its own"
    return draft._process


def closed(engine) -> bool:
    """An engine whose draft runs on a thread: closed when its draft's worker thread is shut down (the target's worker
    is every engine's on that target, runtime.model_worker: it runs on while another uses it)."""
    return engine.draft_worker.closed and not engine.target_worker.closed


def ended(process) -> bool:
    try:
        process.wait(timeout=WAIT_S)
    except Exception:  # subprocess.TimeoutExpired: still running after the generous bound
        return False
    return True


def test_the_cap_closes_the_least_recently_used_draft_and_its_process(cache):
    d0 = cache.get()  # the app's own draft
    assert cache.loaded() == ["d0"]
    d1 = cache.get("d1")
    assert cache.loaded() == ["d0", "d1"]
    p0, p1 = child_of(d0), child_of(d1)
    assert cache.get("d0") is d0  # d0 used again: d1 is now the least recently used
    assert cache.loaded() == ["d1", "d0"]
    d2 = cache.get("d2")
    assert cache.loaded() == ["d0", "d2"]  # d1 closed: over the cap of 2
    assert ended(p1) and p1.returncode is not None
    assert p0.poll() is None and child_of(d2).poll() is None  # the others' processes run on
    # the target was loaded once, by the first engine, and every later draft paired with it
    assert [t is None for _, t in cache.made] == [True, False, False]
    assert d2.pair.target is d0.pair.target is cache.target
    # a closed draft loads again on its next pick, closing the least recently used (d0): the target outlives it
    again = cache.get("d1")
    assert again is not d1 and cache.loaded() == ["d2", "d1"]
    assert ended(p0) and again.pair.target is cache.target
    result = again.run([2, 3, 4], GenerationConfig(method="sd", max_new_tokens=6, gamma=3))
    assert len(result.token_ids) == 6


@pytest.mark.parametrize("cache", ["thread"], indirect=True)
def test_a_draft_in_use_is_never_closed(cache):
    d0, d1 = cache.get("d0"), cache.get("d1")
    cfg = GenerationConfig(method="sd", max_new_tokens=6, gamma=3)
    loop = new_event_loop()
    stream = d0.generate([2, 3, 4], cfg)
    try:
        loop.run_until_complete(stream.__anext__())  # RunStarted: this generation holds d0, the least recently used
        assert d0.busy
        d2 = cache.get("d2")
        assert cache.loaded() == ["d0", "d2"] and not closed(d0) and closed(d1)  # passed over: d1 closed instead

        async def rest():
            return [e async for e in stream]

        events = loop.run_until_complete(rest())  # the held generation finishes on its engine
        assert events[-1].type == "finished"
    finally:
        loop.run_until_complete(stream.aclose())
        loop.close()
    assert not d0.busy
    cache.get("d2")  # nothing over the cap: nothing closed
    assert cache.loaded() == ["d0", "d2"] and not closed(d0) and not closed(d2)


@pytest.mark.parametrize("cache", ["thread"], indirect=True)
def test_every_engine_busy_leaves_the_cache_over_the_cap_until_one_is_idle(cache):
    """With both loaded engines held by generations (a stopped run still letting go of one, say), a third draft
    loads anyway, and the next pick closes the idle least recently used one."""
    d0, d1 = cache.get("d0"), cache.get("d1")
    held = [d0._busy, d1._busy]  # the engines' own locks, as a generation holds them
    for lock in held:
        lock.acquire()
    try:
        d2 = cache.get("d2")
        assert cache.loaded() == ["d0", "d1", "d2"]
    finally:
        for lock in held:
            lock.release()
        assert not any(closed(e) for e in (d0, d1, d2))
    cache.get("d2")
    assert cache.loaded() == ["d1", "d2"] and closed(d0) and not closed(d1) and not closed(d2)


@pytest.mark.parametrize("cache", ["thread"], indirect=True)
def test_concurrent_picks_load_each_draft_once(cache):
    got, errors = [], []

    def pick():
        try:
            got.append(cache.get("d1"))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=pick) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert not errors and len(got) == 4 and all(e is got[0] for e in got)
    assert [d for d, _ in cache.made] == ["d1"]


@pytest.mark.parametrize("value, cap", [(None, 2), ("", 2), ("1", 1), (3, 3)])
def test_the_cap_setting(value, cap):
    assert max_drafts_from(value) == cap


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_a_bad_cap_is_refused_with_the_reason(value):
    with pytest.raises(ValueError, match="SPECBRANCH_MAX_DRAFTS must be an integer >= 1"):
        max_drafts_from(value)
