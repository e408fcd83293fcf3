"""PEARL and SpecBranch are lossless: sampled output follows the target's distribution (chi-square
through the real overlapped engine on tiny models, branching forced everywhere), and greedy output
equals the target's greedy `generate()` on the embedded pair."""

from __future__ import annotations

import pytest

from engine.config import GenerationConfig
from engine.engine import Engine
from engine.events import (
    BRANCH_DRAFT,
    DRAFT,
    VERIFY,
    BranchResolved,
    DraftProposed,
    TimingSpan,
    TokensEmitted,
    Verified,
)
from engine.kernels.lm_head import int4_supported
from engine.models.loading import load_pair

from .conftest import GREEDY_NEW, bfloat16_refused_here, engine_with_draft, schedule_draft, seeded_schedule
from .reference import PROMPT, chi_square, exact_joint

N = 800  # runs of check_sampled. Its control, the draft's own distribution, is rejected at p ~ 1e-146 (the 4-bit
# self-draft's ~1e-125): medians of 200 multinomial samples of N outputs from the target's exact joint, every one of
# them below the test's bar of 1e-6


def rounds_computed_at_once(events) -> int:
    """Rounds in which a draft step and the target's pass of the same round computed at once: their spans intersect
    (an order of events, not a duration)."""
    spans = [e for e in events if isinstance(e, TimingSpan)]
    target = {s.step: s for s in spans if s.worker == "target" and s.kind == VERIFY}
    return len(
        {
            d.step
            for d in spans
            if d.worker == "draft"
            and d.kind in (DRAFT, BRANCH_DRAFT)
            and d.step in target
            and d.start < target[d.step].end
            and target[d.step].start < d.end
        }
    )


@pytest.mark.parametrize(
    "draft, matmul",
    [
        ("draft", "bfloat16"),  # or its refusal, on a CPU without native bfloat16
        pytest.param("self", "int4", marks=pytest.mark.skipif(not int4_supported(), reason="no CPU int4 kernel")),
    ],
)
@pytest.mark.slow
def test_sampled_output_is_exact_with_a_low_precision_draft(
    tiny_dirs, tiny_reference_model, draft, matmul, monkeypatch
):
    """q is whatever the draft's bfloat16 or 4-bit pass gave (the target itself in 4 bits: a twin over its weights),
    so the rules stay exact: the same chi-square, with branches."""
    spec = "self" if draft == "self" else str(tiny_dirs[draft])
    if matmul == "bfloat16" and bfloat16_refused_here(target=str(tiny_dirs["target"]), draft=spec):
        return
    engine = Engine(load_pair(str(tiny_dirs["target"]), spec, device="cpu", draft_matmul=matmul))
    try:
        assert engine.pair.draft.matmul == matmul
        check_sampled(
            engine,
            tiny_reference_model,
            "specbranch",
            dict(gamma=3, branches=3, epsilon=1.0, head_start=0.2),
            monkeypatch,
        )
    finally:
        engine.close()


def check_sampled(engine, reference, method: str, extra: dict, monkeypatch) -> None:
    """N seeded runs of 3 tokens: their joint follows the target's exact distribution (from `reference`, the target as
    transformers' own model loaded apart from the engine's), not the draft's. How far the draft drafts beside each
    target pass is drawn from the run's seed (conftest.seeded_schedule), not left to this machine's timing, so every
    run of this test sees the same outputs, p-values, forks, rescues and holds."""
    seeded_schedule(monkeypatch)
    extra = dict(extra)
    cfg = GenerationConfig(method=method, temperature=extra.pop("temperature", 1.0), max_new_tokens=3, **extra)
    counts: dict = {}
    forks = rescues = holds = branch_holds = 0
    for seed in range(N):
        r = engine.run(PROMPT, GenerationConfig(**{**cfg.to_dict(), "seed": seed}))
        key = tuple(r.token_ids[:3])
        counts[key] = counts.get(key, 0) + 1
        forks += sum(isinstance(e, BranchResolved) for e in r.events)
        held = [e for e in r.events if isinstance(e, DraftProposed) and e.kind == "held"]
        holds, branch_holds = holds + len(held), branch_holds + sum(e.branch > 0 for e in held)
        rescues += r.metrics["branch_rescues"]
    if method == "specbranch":
        assert forks > N / 2 and rescues > 0, "branches must be exercised, or this tests only PEARL"
    assert (holds > 0) is (cfg.hold > 0)  # the draft held back where, and only where, asked to
    assert (branch_holds > 0) is cfg.hold_branches  # a branch step kept nothing where, and only where, asked to
    vocab = engine.pair.target.vocab_size
    assert chi_square(counts, exact_joint(reference, PROMPT, 3, cfg, vocab), N) > 1e-4
    assert chi_square(counts, exact_joint(engine.pair.draft.model, PROMPT, 3, cfg, vocab), N) < 1e-6


def rounds_led_by_the_draft(events) -> int:
    """Rounds in which a draft step ended before the target's pass of the same round began: a head start, which the
    target waits for (an order of events, not a duration)."""
    spans = [e for e in events if isinstance(e, TimingSpan)]
    target = {s.step: s for s in spans if s.worker == "target" and s.kind == VERIFY}
    return len({d.step for d in spans if d.worker == "draft" and d.step in target and d.end <= target[d.step].start})


@pytest.mark.parametrize(
    "method, extra",
    [  # (plain PEARL on this target: every round below where the draft does not lead; test_greedy_equivalence.py)
        ("specbranch", dict(gamma=4, branches=3, epsilon=0.9)),
        ("specbranch", dict(gamma=4, branches=3, epsilon=0.9, feed_stop=0.4, hold=0.3)),  # and a hold
        ("specbranch", dict(gamma=4, branches=3, epsilon=0.9, hold=0.3, hold_branches=True)),  # on the branches too
        ("pearl", dict(gamma=3, head_start=0.3)),
    ],
)
def test_greedy_equals_generate(embedded_target, greedy_references, method, extra, monkeypatch):
    """PEARL and SpecBranch with a draft that is often wrong, forks, holds and a head start: the target's own greedy
    output (conftest.greedy_references), and each fork's verdict is what was emitted. How far the draft drafts beside
    each target pass is drawn from a seeded generator (conftest.seeded_schedule), not left to this machine's timing,
    so the rollbacks, forks, rescues, holds and head starts asserted here happen on any machine."""
    seeded_schedule(monkeypatch)
    engine = engine_with_draft(embedded_target, "truncated:6")
    forks, held, wasted, led = [], 0, 0, 0
    for ids, want in greedy_references:
        r = engine.run(ids, GenerationConfig(method=method, max_new_tokens=GREEDY_NEW, **extra))
        assert r.token_ids == want
        wasted += r.metrics["wasted_draft_tokens"]
        assert rounds_computed_at_once(r.events) > 0  # the two workers really ran at once, inside a round
        emitted = [t for e in r.events if isinstance(e, TokensEmitted) for t in e.tokens]
        kinds = [k for e in r.events if isinstance(e, TokensEmitted) for k in e.kinds]
        for f in (e for e in r.events if isinstance(e, BranchResolved)):  # each fork's verdict is what was emitted
            at = f.position - len(ids)
            assert f.rescued is (f.survivor > 0) and (f.survivor == -1 or f.candidates[f.survivor] == f.token)
            if at < len(emitted):  # (not cut by the token budget)
                assert emitted[at] == f.token
                assert kinds[at] == {-1: "correction", 0: "accepted"}.get(f.survivor, "rescued")
            forks.append(f)
        held += sum(isinstance(e, DraftProposed) and e.kind == "held" for e in r.events)
        led += rounds_led_by_the_draft(r.events)
    assert wasted > 0  # the draft was wrong somewhere, so rejection and rollback were exercised
    if method == "specbranch":
        assert forks  # branch points were resolved, and checked above
        if extra.get("hold"):
            assert held > 0  # the draft held back where unsure
        else:  # a fork rescued a position: the target's token was a candidate other than the draft's own
            assert any(f.rescued for f in forks)
    else:
        assert not forks and not held
    if extra.get("head_start"):
        assert led > 0  # the draft led the target's pass where the block was short


@pytest.mark.parametrize("method", ["pearl", "specbranch", "specbranch-no-hrad", "specbranch-fixed"])
@pytest.mark.parametrize("gamma", [2, 3, 6])
def test_long_runs_to_the_context_end_match_ar(tiny_engine, tiny_reference, method, gamma):
    """Many rounds, forks placed mid-path and kept across rounds, the context's end: greedy output
    equals AR's, which is transformers' own greedy generate() (conftest.tiny_reference), and sampled runs complete
    with every token accounted for."""
    for prompt in ([2, 3, 4, 5], [8] * 10):
        want = tiny_engine.run(prompt, GenerationConfig(method="ar", max_new_tokens=100)).token_ids
        assert len(want) == 64 - len(prompt) and want == tiny_reference(prompt, 100)
        for epsilon in (0.5, 0.7, 1.0):
            cfg = dict(
                method=method,
                max_new_tokens=100,
                gamma=gamma,
                branches=3,
                epsilon=epsilon,
                feed_stop=0.4 if epsilon == 0.7 else 0.0,
            )
            assert tiny_engine.run(prompt, GenerationConfig(**cfg)).token_ids == want
            s = tiny_engine.run(prompt, GenerationConfig(**cfg, temperature=1.0, seed=int(epsilon * 10)))
            assert len(s.token_ids) == 64 - len(prompt) and s.finish_reason == "length"


def test_sampled_head_start_reads_the_measured_acceptance(tiny_dirs, monkeypatch):
    """A draft that is the target is accepted at every token, also where it drew one it gave little mass. Sampled,
    PEARL's head start reads each token's own probability and stops leading early; SpecBranch's (here without forks,
    which keeps its tables) reads the acceptance it measured where each token was drafted (Policy.line_acceptance),
    so once its table has verdicts it leads the target's passes to γ: fewer passes for the same number of tokens.
    Beside each pass the draft takes one step (schedule_draft: as where the draft costs what the target does, which
    this one does), so how far it drafts is the rule's, not this machine's timing."""
    schedule_draft(monkeypatch, lambda state: 0)
    engine = Engine(load_pair(str(tiny_dirs["target"]), str(tiny_dirs["target"]), device="cpu", draft_matmul="float32"))
    try:

        def passes(method, seeds):
            """Drafted tokens each pass judged, every run's last pass left out (it ends at the token budget), and
            target passes, over runs of these seeds."""
            fed, n = [], 0
            for seed in seeds:
                run = engine.run(
                    [2, 3, 4, 5],
                    GenerationConfig(
                        method=method, max_new_tokens=40, gamma=3, head_start=0.6, temperature=1.0, seed=seed
                    ),
                )
                assert run.metrics["acceptance_rate"] == 1.0 and len(run.token_ids) == 40
                fed += [e.drafted for e in run.events if isinstance(e, Verified)][:-1]
                n += run.metrics["target_forwards"]
            return sum(fed) / len(fed), n

        passes("specbranch-no-branch", range(3))  # SpecBranch's first runs fill its table
        (measured, measured_passes), (pearl, pearl_passes) = (
            passes(m, range(3, 6)) for m in ("specbranch-no-branch", "pearl")
        )
        assert measured >= pearl + 0.5 and measured_passes < pearl_passes
    finally:
        engine.close()


def test_head_start_verifies_drafted_tokens_after_a_rejection(tiny_engine):
    """Without a head start, the pass after a rejection is fed no drafted token (PEARL's pre-verify: its one row
    judges the first token drafted beside it, so it returns one token). With one, the draft leads: every pass is
    fed γ drafted tokens while the draft's joint odds allow (here always), so the same tokens take fewer target
    passes, and the output is still the target's."""
    prompt = [2, 3, 4, 5]
    want = tiny_engine.run(prompt, GenerationConfig(method="ar", max_new_tokens=40)).token_ids
    for method in ("pearl", "specbranch"):
        runs = {
            lead: tiny_engine.run(
                prompt, GenerationConfig(method=method, max_new_tokens=40, gamma=3, epsilon=0.7, head_start=lead)
            )
            for lead in (0.0, 1e-6)
        }
        assert all(r.token_ids == want for r in runs.values())
        assert runs[1e-6].metrics["target_forwards"] < runs[0.0].metrics["target_forwards"]
        if method == "pearl":  # (SpecBranch's line may start at a branch point, judged by BranchResolved)
            passes = [e.drafted for e in runs[1e-6].events if isinstance(e, Verified)]
            assert min(passes[:-3]) == 3 + 1  # γ fed, and the next drafted token judged by the last row
