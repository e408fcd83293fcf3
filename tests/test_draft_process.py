"""The draft in a process of its own (engine/drafts/process.py): the child loads the same draft and computes its bits,
through a fork, a collapse, rollbacks and steps taken ahead; output through it stays exact (greedy equals the target's
generate(), sampled follows the target's distribution); a draft that cannot go there stays here with the reason; a
child that dies ends the run with a message; closing the engine ends the child."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time

import pytest
import torch
import uvloop

from engine.config import GenerationConfig, SpecBranchError
from engine.drafts.child import LOW_PRIORITY, low_priority
from engine.drafts.process import RemoteLM, in_process, step_fn
from engine.engine import Engine
from engine.methods.sampling import NextDraw, draw_u, logits_to_probs
from engine.models.loading import ModelPair, load_pair, with_draft
from engine.runtime import Measured, Worker

from .reference import PROMPT
from .test_parallel_lossless import check_sampled


@pytest.fixture(scope="module")
def process_engine(tiny_dirs):
    engine = Engine(
        load_pair(
            str(tiny_dirs["target"]),
            str(tiny_dirs["draft"]),
            device="cpu",
            draft_matmul="float32",
            draft_worker="process",
        )
    )
    yield engine
    engine.close()


def test_the_child_computes_the_local_drafts_bits(process_engine):
    pair = process_engine.pair
    assert (pair.draft_worker, pair.draft_worker_why) == ("process", "")
    remote = pair.draft
    assert isinstance(remote, RemoteLM) and remote._process.pid != os.getpid()
    assert remote.name == remote.local.name and remote.vocab_size == remote.local.vocab_size  # the local draft's
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, remote.vocab_size, (1, 9), generator=g)
    caches = [remote.local.new_cache(), remote.new_cache()]

    def both(x, ahead=0):  # the same forward on the local draft and in the child
        local = remote.local.forward(x, caches[0])
        there = remote.forward(x, caches[1], ahead=ahead)  # ahead: the child then steps on the argmax at once
        assert torch.equal(local, there)  # every position's logits, as the local draft's forward returns them
        assert caches[1].get_seq_length() == caches[0].get_seq_length()
        return there[:, -1].argmax(-1)[:, None]  # [B, 1]: what greedy drafting feeds next

    nxt = both(ids, ahead=1)  # a prefill
    taken, on_board = remote.steps_taken_ahead, remote.answers_on_board
    nxt = both(nxt, ahead=1)  # the step taken ahead, asked for: served from it
    assert remote.steps_taken_ahead == taken + 1
    both(ids[:, :1] + (ids[:, :1] == nxt))  # another step than the one taken ahead: undone first
    assert remote.steps_taken_ahead == taken + 1
    for c in caches:
        c.crop(-2)  # a rollback, transformers' way
    both(ids[:, 3:5], ahead=1)
    for c in caches:
        c.batch_repeat_interleave(3)  # a fork (undoing the step taken ahead): one row per branch
    nxt = both(torch.randint(0, remote.vocab_size, (3, 1), generator=g), ahead=1)
    both(nxt, ahead=1)  # every branch's argmax, taken ahead
    assert remote.steps_taken_ahead == taken + 2
    for c in caches:
        c.batch_select_indices(torch.tensor([2]))  # the surviving branch
        c.crop(6)  # keep the first 6 positions
    assert caches[1].get_seq_length() == 6 and caches[1].rows == 1
    both(ids[:, :2])
    with pytest.raises(SpecBranchError, match="failed in its process: IndexError"):  # an id past the vocabulary
        remote.forward(torch.tensor([[10**6]]), caches[1])
    both(ids[:, :1])  # the child serves on
    assert remote.answers_on_board - on_board == (7 if hasattr(os, "memfd_create") else 0)  # each answer since, off
    # the board (board.py), the ones taken ahead too
    with pytest.raises(ValueError, match="rows"):
        remote.forward(torch.zeros(2, 1, dtype=torch.long), caches[1])


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the answer board is Linux's memfd")
def test_answers_come_off_the_board_and_one_too_large_for_it_through_the_socket(process_engine):
    """A board of two rows: a step's answer and a fork's two rows come off it, a prefill's five rows through the
    socket; each is the local draft's bits, and none reads what an earlier answer left there."""
    remote = process_engine.pair.draft
    small = RemoteLM(remote.local, remote.recipe, board_bytes=2 * remote.vocab_size * 4)
    try:
        g = torch.Generator().manual_seed(3)
        caches = [remote.local.new_cache(), small.new_cache()]

        def both(x):  # the same forward locally and in the child; whether its answer came off the board
            before = small.answers_on_board
            assert torch.equal(remote.local.forward(x, caches[0]), small.forward(x, caches[1]))
            return small.answers_on_board - before

        assert both(torch.randint(0, remote.vocab_size, (1, 5), generator=g)) == 0  # 5 rows: the socket
        assert both(torch.randint(0, remote.vocab_size, (1, 1), generator=g)) == 1  # 1 row: the board
        for c in caches:
            c.batch_repeat_interleave(2)
        assert both(torch.randint(0, remote.vocab_size, (2, 1), generator=g)) == 1  # 2 rows: fills it
        assert both(torch.randint(0, remote.vocab_size, (2, 3), generator=g)) == 0  # 6 rows: the socket again
        assert both(torch.randint(0, remote.vocab_size, (2, 1), generator=g)) == 1
    finally:
        small.close()


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the answer board is Linux's memfd")
def test_a_prefill_answers_its_last_row_off_the_board(process_engine):
    """The draft's prefill (decoding.prefill reads it through last_row) is answered with its last row alone: on a board
    of one row a 6-token prompt's answer comes off the board, the local draft's bits for that row, and the child's
    cache holds the whole prompt (the next step is the local draft's bits too)."""
    remote = process_engine.pair.draft
    small = RemoteLM(remote.local, remote.recipe, board_bytes=remote.vocab_size * 4)
    try:
        g = torch.Generator().manual_seed(5)
        prompt, step = torch.randint(0, remote.vocab_size, (1, 6), generator=g), torch.tensor([[7]])
        caches = [remote.local.new_cache(), small.new_cache()]
        want = remote.local.last_row.forward(prompt, caches[0])
        before = small.answers_on_board
        got = small.last_row.forward(prompt, caches[1])
        assert got.shape == (1, 1, remote.vocab_size) and torch.equal(got, want)
        assert small.answers_on_board - before == 1 and caches[1].get_seq_length() == 6
        assert torch.equal(remote.local.forward(step, caches[0]), small.forward(step, caches[1]))
    finally:
        small.close()


def test_the_child_steps_ahead_on_the_token_a_sampled_draw_picks(process_engine):
    """Sampling, the engine fixes each row's uniform before it asks for the row (sampling.NextDraw), so the child takes
    the step on the token the engine will draw: on the path, and on every branch of a fork. A step the engine does not
    ask for is undone, and every answer is the local draft's bits."""
    remote = process_engine.pair.draft
    g = torch.Generator().manual_seed(11)
    caches = [remote.local.new_cache(), remote.new_cache()]

    def step(x, draws):  # one draft step, on the local draft and in the child; returns the tokens the engine draws
        local = remote.local.forward(x, caches[0])
        there = remote.forward(x, caches[1], ahead=1, draws=draws)
        assert torch.equal(local, there)
        probs = logits_to_probs(there[:, -1], 0.8, 40, 0.95)  # [B, V]: the engine's own probabilities
        return torch.tensor([[int(d.pick(p))] for d, p in zip(draws, probs)])

    nxt = step(torch.randint(0, remote.vocab_size, (1, 8), generator=g), [NextDraw(0.8, 40, 0.95, draw_u(g))])
    taken = remote.steps_taken_ahead
    for _ in range(3):  # each asked for step was taken ahead on the drawn token
        nxt = step(nxt, [NextDraw(0.8, 40, 0.95, draw_u(g))])
    assert remote.steps_taken_ahead == taken + 3
    for c in caches:
        c.batch_repeat_interleave(3)  # a fork: the step taken ahead is undone, then one row per branch
    nxt = step(torch.cat([nxt] * 3), [NextDraw(0.8, 40, 0.95, draw_u(g)) for _ in range(3)])
    step(nxt, [NextDraw(0.8, 40, 0.95, draw_u(g)) for _ in range(3)])  # every branch's drawn token, taken ahead
    assert remote.steps_taken_ahead == taken + 4
    step(1 - nxt.clamp(max=1), [NextDraw(0.8, 40, 0.95, draw_u(g)) for _ in range(3)])  # not those: undone first
    assert remote.steps_taken_ahead == taken + 4


def test_the_child_steps_ahead_only_on_a_row_as_sure_as_asked(process_engine):
    """Where the engine would most likely fork or hold (a row less sure than Policy.sure_enough), the child takes no
    step ahead, so the fork's step is not kept waiting on one to undo; on a row that sure it does. The answers are
    the local draft's bits either way."""
    remote = process_engine.pair.draft
    caches = [remote.local.new_cache(), remote.new_cache()]

    def step(x, sure):  # one greedy draft step, locally and in the child; returns the argmax and its probability
        local = remote.local.forward(x, caches[0])
        there = remote.forward(x, caches[1], ahead=1, sure=sure)
        assert torch.equal(local, there)
        top = there[0, -1].softmax(-1).max(-1)
        return top.indices.view(1, 1), float(top.values)

    nxt, top = step(torch.tensor([PROMPT]), 1.0)  # a prefill whose row is less sure than 1: no step ahead
    assert top < 1.0
    taken = remote.steps_taken_ahead
    nxt, top = step(nxt, 0.0)  # not taken ahead; every row is at least 0 sure: the child steps ahead
    assert remote.steps_taken_ahead == taken and top < 1.0
    nxt, top = step(nxt, 1.0)  # served from the step taken ahead; below 1 sure: none taken after it
    assert remote.steps_taken_ahead == taken + 1 and top < 1.0
    nxt, _ = step(nxt, None)  # not taken ahead; None: the child steps ahead whatever the row
    assert remote.steps_taken_ahead == taken + 1
    step(nxt, None)  # served from it
    assert remote.steps_taken_ahead == taken + 2


def test_a_step_taken_ahead_is_timed_when_the_child_computed_it(process_engine):
    """A draft's span in its own process is when the child computed, on its clock, which is this one's: a step taken
    ahead ran while the engine was busy elsewhere (the child takes it as soon as it has answered, before it reads the
    next request), so its span is that step's, between the answer before it and the answer that returns it. Worker.run
    times a span by such a result (runtime.Measured) instead of by the call around it. Causal order only: how long
    the engine takes to ask again is not assumed."""
    remote = process_engine.pair.draft
    assert remote.shares_clock  # Linux's perf_counter is system-wide
    cache = remote.new_cache()
    before = time.perf_counter()
    first = remote.forward(torch.tensor([PROMPT]), cache, ahead=1, measured=True)
    assert isinstance(first, Measured) and before <= first.start < first.end <= time.perf_counter()
    nxt = first.result[:, -1].argmax(-1)[:, None]  # the token greedy drafting feeds: the child steps on it at once
    taken = remote.steps_taken_ahead
    ahead = remote.forward(nxt, cache, measured=True)
    assert remote.steps_taken_ahead == taken + 1  # the answer is the step the child took ahead, unasked
    assert first.end <= ahead.start < ahead.end <= time.perf_counter()  # its own span, after the first's
    asked = time.perf_counter()
    plain = remote.forward(ahead.result[:, -1].argmax(-1)[:, None], cache, measured=True)  # not taken ahead (ahead=0)
    assert remote.steps_taken_ahead == taken + 1
    assert asked <= plain.start < plain.end <= time.perf_counter()  # computed once asked
    assert torch.is_tensor(remote.forward(nxt, cache))  # unmeasured: the logits alone (the probe, engine costs)

    worker, t0 = Worker("draft"), time.perf_counter() - 10.0
    try:
        out, span = asyncio.run(
            worker.run(lambda: Measured("logits", t0 + 1.25, t0 + 1.5), kind="draft", step=3, t0=t0)
        )
    finally:
        worker.shutdown()
    assert out == "logits" and (span.start, span.end, span.step) == (1.25, 1.5, 3)


@pytest.mark.parametrize("loop_of", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_a_worker_asks_the_child_from_the_loop_and_its_thread_only_when_busy(process_engine, loop_of):
    """Worker.run awaits a draft step in its own process on the loop's thread (RemoteStep.on_loop): the worker's thread
    is never made, and the answer is the local draft's, timed by the child. Where another thread's forward holds the
    connection, the step goes to the worker's thread, which waits its turn. A run cancelled while it waits still reads
    its answer, so the next step gets its own (uvloop makes the socket non-blocking while it watches it: the reads
    after it must still wait for a whole answer)."""
    remote = process_engine.pair.draft
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, remote.vocab_size, (1, 40), generator=g)
    local, there = remote.local.new_cache(), remote.new_cache()
    worker, t0 = Worker("draft"), time.perf_counter()

    def step(x):
        return worker.run(step_fn(remote, 0), x, there, kind="draft", step=0, t0=t0)

    async def busy(x):  # another thread's forward holds the connection as the step is asked for
        remote._call_lock.acquire()
        job = asyncio.ensure_future(step(x))
        await asyncio.sleep(0)  # the job runs to its first wait: on the worker's thread, behind the lock
        remote._call_lock.release()
        return await job

    async def cancelled(x):
        job = asyncio.ensure_future(step(x))
        await asyncio.sleep(0)  # asked: waiting for the answer
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job

    loop = loop_of()
    try:
        asked = time.perf_counter() - t0
        out, span = loop.run_until_complete(step(ids))  # a prefill
        assert torch.equal(out, remote.local.forward(ids, local))
        assert asked <= span.start < span.end <= time.perf_counter() - t0  # when the child computed
        assert not worker._executor.made_here()  # no thread of this process ran it
        loop.run_until_complete(cancelled(ids[:, :1]))
        remote.local.forward(ids[:, :1], local)  # the cancelled step stays in both caches, as fed
        assert there.get_seq_length() == local.get_seq_length() == 41
        out, _ = loop.run_until_complete(step(ids[:, 1:3]))
        assert torch.equal(out, remote.local.forward(ids[:, 1:3], local))
        assert not worker._executor.made_here()
        out, _ = loop.run_until_complete(busy(ids[:, 3:4]))
        assert torch.equal(out, remote.local.forward(ids[:, 3:4], local))
        assert worker._executor.made_here()  # the busy step went to the worker's thread
        out, _ = loop.run_until_complete(step(ids[:, 4:5]))
        assert torch.equal(out, remote.local.forward(ids[:, 4:5], local))
    finally:
        loop.close()
        worker.shutdown()


@pytest.mark.parametrize("method, extra", [("sd", {}), ("pearl", {}), ("specbranch", dict(epsilon=1.0))])
def test_greedy_output_through_the_child_is_the_targets(process_engine, tiny_reference, method, extra):
    want = tiny_reference(PROMPT, 12)  # transformers' own generate(), on a model loaded apart from the engine's
    taken = process_engine.pair.draft.steps_taken_ahead
    r = process_engine.run(PROMPT, GenerationConfig(method=method, max_new_tokens=12, gamma=3, **extra))
    assert r.token_ids == want
    if method == "sd":  # SD's block was served by steps taken ahead. In PEARL and SpecBranch whether the next
        # request is the step taken ahead depends on whether the target's verdict landed first: a race, not a rule
        assert process_engine.pair.draft.steps_taken_ahead > taken


@pytest.mark.slow
def test_sampled_pearl_through_the_child_follows_the_target(process_engine, tiny_reference_model, monkeypatch):
    """PEARL's head start's second step is served by the sampled step taken ahead, and its output still follows the
    target. (SpecBranch with its draft in a process, forks, holds and head starts: test_montecarlo_engine.py's
    specbranch-distilled-process.)"""
    taken = process_engine.pair.draft.steps_taken_ahead
    check_sampled(process_engine, tiny_reference_model, "pearl", dict(gamma=3, head_start=0.01), monkeypatch)
    assert process_engine.pair.draft.steps_taken_ahead > taken


def test_the_child_loads_the_targets_weights_without_its_fast_layouts(tiny_dirs, process_engine):
    """The child never runs the target, so its recipe skips the target's fast layouts (a packed and a transposed copy
    of every weight: ~850 MB of the embedded pair's child), and the draft there still computes the local bits (the
    other tests here). Without layouts the target is routed nowhere and its head keeps no copy."""
    assert process_engine.pair.draft.recipe["target_layouts"] is False
    bare = load_pair(
        str(tiny_dirs["target"]), None, device="cpu", target_forward="transformers", target_layouts=False
    ).target
    routed = load_pair(str(tiny_dirs["target"]), None, device="cpu", target_forward="transformers").target
    assert not any(getattr(m, "_fast_layout", False) for m in bare.model.modules())
    assert any(getattr(m, "_fast_layout", False) for m in routed.model.modules())
    assert bare._head.wt is None and bare._head.packed is None and routed._head.wt is not None
    ids = torch.randint(0, bare.vocab_size, (1, 7), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(
        bare.forward(ids, bare.new_cache()), routed.forward(ids, routed.new_cache()), rtol=1e-5, atol=1e-5
    )  # the same model, only its kernels differ


def test_a_draft_that_cannot_go_stays_here_with_the_reason(tiny_dirs, process_engine):
    local = process_engine.pair.draft.local
    assert in_process(local, None) == (local, "the draft was not loaded from a spec")
    recipe = dict(process_engine.pair.draft.recipe, target=str(tiny_dirs["target"] / "missing"))
    lm, why = in_process(local, recipe)
    assert lm is local and "could not load" in why and "not found" in why
    target = process_engine.pair.target
    with pytest.raises(SpecBranchError, match="unknown draft worker"):
        with_draft(target, str(tiny_dirs["draft"]), draft_matmul="float32", draft_worker="fiber")
    thread = with_draft(target, str(tiny_dirs["draft"]), draft_matmul="float32")  # the library's default
    assert thread.draft_worker == "thread" and not isinstance(thread.draft, RemoteLM)


def test_a_child_that_dies_ends_the_run_with_a_message_and_close_ends_the_child(process_engine):
    remote = process_engine.pair.draft
    engine = Engine(ModelPair(process_engine.pair.target, RemoteLM(remote.local, remote.recipe)))
    cfg = GenerationConfig(method="pearl", max_new_tokens=8, gamma=3)
    assert len(engine.run(PROMPT, cfg).token_ids) == 8
    engine.pair.draft._process.kill()
    engine.pair.draft._process.wait()
    with pytest.raises(SpecBranchError, match="the draft's process (ended|is gone)"):
        engine.run(PROMPT, cfg)
    engine.close()
    spare = RemoteLM(remote.local, remote.recipe)
    Engine(ModelPair(process_engine.pair.target, spare)).close()
    assert spare._process.poll() is not None  # closing the engine ended its child


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own priority is Linux's")
def test_a_twin_loads_at_the_lowest_priority_and_serves_at_its_own(process_engine):
    """A compiled twin (RemoteLM.start_compile) loads and compiles on a thread at nice 19, so that the runs beside it
    keep the cores; the thread that serves its forwards keeps the usual priority, and a failure reaches the caller."""

    def priority():
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # this thread's own, on Linux

    base, seen = priority(), []
    assert low_priority(lambda: seen.append(priority()) or "loaded") == "loaded"
    assert seen == [LOW_PRIORITY] and priority() == base

    def fails():
        raise FileNotFoundError("no such draft")

    with pytest.raises(FileNotFoundError, match="no such draft"):
        low_priority(fails)
    remote = process_engine.pair.draft
    twin = RemoteLM(remote.local, remote.recipe, low=True)
    try:
        assert os.getpriority(os.PRIO_PROCESS, twin._process.pid) == base  # its main thread, which serves
        assert twin.agrees()  # loaded there, it computes the local draft's bits
    finally:
        twin.close()
