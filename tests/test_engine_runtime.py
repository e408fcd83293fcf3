"""The overlapped runtime: cancellation leaves nothing behind, concurrent generations queue safely, a round hands the
target its pass before the last verdict's probes, a slow draft is flagged, a step the other model waits on gets its own
thread count, and bad branch settings are refused."""

from __future__ import annotations

import asyncio

import pytest

from engine.cli import main
from engine.config import GenerationConfig
from engine.engine import Engine
from engine.events import Finished, Notice, RunStarted, TokensEmitted
from engine.models.loading import load_pair
from engine.runtime import Worker, new_event_loop

from .conftest import make_tiny_model

CFG = GenerationConfig(method="specbranch", max_new_tokens=24, gamma=3, epsilon=1.0, temperature=0.0)


def test_cancel_midway_then_generate_again(tiny_engine):
    want = tiny_engine.run([2, 3, 4], CFG).token_ids

    async def cancel_after(n):
        agen = tiny_engine.generate([5, 6, 7], CFG)
        seen = 0
        async for e in agen:
            seen += isinstance(e, TokensEmitted)
            if seen >= n:
                break
        await agen.aclose()  # what a client disconnect or the Stop button does

    loop = new_event_loop()
    try:
        loop.run_until_complete(cancel_after(3))
    finally:
        loop.close()
    assert tiny_engine.run([2, 3, 4], CFG).token_ids == want


def test_two_generations_on_one_engine_queue(tiny_engine):
    solo = [tiny_engine.run(p, CFG).token_ids for p in ([2, 3], [4, 5])]

    async def both():
        async def one(p):
            return [e async for e in tiny_engine.generate(p, CFG)]

        return await asyncio.gather(one([2, 3]), one([4, 5]))

    loop = new_event_loop()
    try:
        a, b = loop.run_until_complete(both())
    finally:
        loop.close()
    for events, want in zip((a, b), solo):
        assert [t for e in events if isinstance(e, TokensEmitted) for t in e.tokens] == want
    # they queued: the second started only after the first had finished
    assert isinstance(a[0], RunStarted) and isinstance(b[0], RunStarted) and isinstance(a[-1], Finished)
    assert b[0].wall_clock >= a[0].wall_clock + a[-1].prefill_s + a[-1].decode_s - 0.01


def test_slow_draft_is_flagged(tmp_path, tiny_dirs):
    slow = make_tiny_model(tmp_path / "slow", seed=1, layers=12)  # 12 layers vs the target's 2
    engine = Engine(load_pair(str(tiny_dirs["target"]), str(slow), device="cpu"))
    r = engine.run([2, 3, 4], GenerationConfig(method="sd", max_new_tokens=20, gamma=3))
    assert len(r.token_ids) == 20
    assert any(isinstance(e, Notice) and "slower than the target" in e.message for e in r.events)
    engine.close()


def test_one_stalled_draft_step_or_a_forks_rows_raise_no_slow_draft_notice():
    """The notice says a pair cannot pay off, so it reads typical steps: medians of one-row draft steps against the
    target's. One stall (another program busy for a moment) and a fork's costlier k-row steps leave it quiet."""
    from engine.engine import slow_draft_notice
    from engine.events import TimingSpan

    def spans(worker, kind, ms):
        out, t = [], 0.0
        for d in ms:
            out.append(TimingSpan(worker, kind, 1, t, t + d / 1000))
            t += d / 1000
        return out

    target = spans("target", "verify", [50, 52, 51])
    quiet = spans("draft", "draft", [10, 11, 500, 10]) + spans("draft", "branch_draft", [300, 300]) + target
    assert slow_draft_notice(quiet) is None  # the means (130 ms, 190 ms with the forks) would have raised it
    slow = spans("draft", "draft", [60, 61, 62]) + target
    assert "slower than the target (61.0 ms vs 51.0 ms" in slow_draft_notice(slow).message


def test_hrad_missing_gives_visible_notice(tiny_engine):
    r = tiny_engine.run([2, 3], GenerationConfig(method="specbranch", max_new_tokens=4, hrad=True))
    assert any(isinstance(e, Notice) and "H-RAD off" in e.message for e in r.events)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--branches", "0"], "branches must be an integer >= 1"),
        (["--gamma", "0"], "gamma (draft length) must be an integer >= 1"),
        (["--epsilon", "1.5"], "epsilon must be in [0, 1]"),
        (["--epsilon", "-0.1"], "epsilon must be in [0, 1]"),
        (["--solo-threads", "0"], "--solo-threads must be at least 1, got 0"),
    ],
)
def test_bad_branch_settings(capsys, tiny_dirs, extra, message):
    code = main(
        [
            "generate",
            "--method",
            "specbranch",
            "--target",
            str(tiny_dirs["target"]),
            "--draft",
            str(tiny_dirs["draft"]),
            "--prompt",
            "a b",
            *extra,
        ]
    )
    assert code == 2 and message in capsys.readouterr().err


def test_a_solo_forward_runs_on_its_own_threads_and_gives_them_back():
    """Worker.run(solo=True) runs on solo_threads, on that worker's thread only; its next forward, and the other
    worker's, run on `threads` again. The function reports what torch sees inside it."""
    import torch

    draft, target = Worker("draft", 1, solo_threads=2), Worker("target", 1)

    async def threads_in(worker, solo):
        seen, _ = await worker.run(torch.get_num_threads, kind="draft", step=0, t0=0.0, solo=solo)
        return seen

    loop = new_event_loop()
    try:
        seen = [
            loop.run_until_complete(threads_in(w, solo))
            for w, solo in ((draft, True), (draft, False), (target, True), (draft, True), (target, False))
        ]
    finally:
        loop.close()
        draft.shutdown()
        target.shutdown()
    assert seen == [2, 1, 1, 2, 1]  # the target's worker has no solo threads of its own (solo_threads = threads)


def test_greedy_output_with_the_draft_on_two_threads_equals_ar(tiny_dirs):
    """SD's draft block and a parallel method's head start run the draft on solo threads; the draft's numbers may
    change with them, the output may not."""
    engine = Engine(
        load_pair(str(tiny_dirs["target"]), str(tiny_dirs["draft"]), device="cpu", draft_matmul="float32"),
        solo_threads=2,
    )
    try:
        ids = engine.encode("the quick brown fox", chat=False)
        ar = engine.run(ids, GenerationConfig(method="ar", max_new_tokens=40)).token_ids
        for method, extra in (("sd", {}), ("pearl", {"head_start": 0.01}), ("specbranch", {"head_start": 0.01})):
            cfg = GenerationConfig(method=method, max_new_tokens=40, gamma=3, epsilon=1.0, **extra)
            assert engine.run(ids, cfg).token_ids == ar, method
    finally:
        engine.close()


def test_the_host_loop_runs_on_one_thread(tiny_engine):
    """A caller whose thread runs more torch threads would give the host work between forwards an OpenMP team that,
    on 2 cores, takes a core from the workers: a generation runs its host side on one thread."""
    import threading

    import torch

    seen = []

    def run():
        torch.set_num_threads(2)
        tiny_engine.run(tiny_engine.encode("a b", chat=False), GenerationConfig(method="sd", max_new_tokens=4))
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [1]


def test_importing_the_engine_lets_idle_openmp_threads_sleep_unless_told_otherwise():
    """libgomp reads OMP_WAIT_POLICY as torch is imported: the engine's package sets it to PASSIVE before, so an idle
    OpenMP thread (a 2-thread draft step's) does not spin on a core the other model or the loop needs; a value the
    caller set stays. The draft's own process inherits it (process._start passes the environment)."""
    import os
    import subprocess
    import sys

    probe = "import engine, os, torch; print(os.environ['OMP_WAIT_POLICY'])"
    for given, want in ((None, "PASSIVE"), ("ACTIVE", "ACTIVE")):
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        if given:
            env["OMP_WAIT_POLICY"] = given
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want


def test_the_targets_pass_is_on_its_worker_before_the_last_verdicts_probes(tiny_dirs, monkeypatch):
    """The last verdict's sampled probes, host work that runs beside the target's pass, start only once the pass is
    on the target's worker: an asyncio task starts at the loop's next turn, so the loop yields once after making it.
    Checked by the order of the calls, not by clocks: in each round that runs probes (run_later), the call right
    before them is that round's verify pass (the round's step is read where the loop plans its feed)."""
    import dataclasses
    import sys

    from engine.events import VERIFY
    from engine.methods import parallel

    calls, real_run, real_later, real_plan = [], Worker.run, parallel.run_later, parallel.plan_feed

    async def run(self, fn, *args, kind, step, **kwargs):  # the real run, its calls logged in order
        calls.append((self.name, kind, step))
        return await real_run(self, fn, *args, kind=kind, step=step, **kwargs)

    def plan_feed(state, spec, policy):
        calls.append(("plan", None, state.step))
        return real_plan(state, spec, policy)

    def run_later(ds):  # by whom: the loop's round (`step`), or verify_round's at a run's end, with no pass to come
        calls.append(("later", len(ds.later), sys._getframe(1).f_code.co_name))
        real_later(ds)

    monkeypatch.setattr(Worker, "run", run)
    monkeypatch.setattr(parallel, "plan_feed", plan_feed)
    monkeypatch.setattr(parallel, "run_later", run_later)
    engine = Engine(load_pair(str(tiny_dirs["target"]), str(tiny_dirs["draft"]), device="cpu", draft_matmul="float32"))
    try:  # T=1 with a hold: the verdicts leave sampled probes for the next round (rescue table, held positions). ε 0:
        # no fork, so every rejected token plays the fork it could have made (~57 rounds with probes in these 4 runs;
        # with ε 0.9 most positions fork, and how many rounds probe, 4-8, hangs on how far the draft gets per pass)
        cfg = GenerationConfig(method="specbranch", max_new_tokens=24, gamma=3, epsilon=0.0, hold=0.3, temperature=1.0)
        for seed in range(4):
            engine.run([2, 3, 4], dataclasses.replace(cfg, seed=seed))
    finally:
        engine.close()
    probes = [i for i, c in enumerate(calls) if c[0] == "later" and c[1] > 0 and c[2] == "step"]
    assert len(probes) > 5  # rounds that ran probes
    for i in probes:
        step = next(c[2] for c in reversed(calls[:i]) if c[0] == "plan")
        assert calls[i - 1] == ("target", VERIFY, step), calls[max(i - 4, 0) : i + 2]
