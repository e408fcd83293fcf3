"""SpecBranch's verdict through a branch point (the target verifies the path and the branches as one token tree,
so a rescue's branch is judged in the same pass), the policy that forks only where the measured costs say it pays,
the acceptance it reads the draft's confidence as (engine/methods/calibration.py), and the hold that drafts nothing
where that acceptance is too low to pay."""

from __future__ import annotations

import torch

from app.tree import step_caption
from engine.config import GenerationConfig
from engine.events import (
    ACCEPTED,
    BONUS,
    CORRECTION,
    RESCUED,
    VERIFY,
    BranchResolved,
    DraftProposed,
    TimingSpan,
    Verified,
)
from engine.methods.calibration import PRIOR_WEIGHT, RESCUE_BINS, RESCUE_PRIOR_WEIGHT, AcceptanceCalibration
from engine.methods.decoding import RunState
from engine.methods.policy import BranchCosts, Policy, alternatives_share
from engine.methods.sampling import TOPK
from engine.methods.speculation import Branch, Drafted, Feed, Fork, Speculation, feed_limit, plan_branches
from engine.methods.verdict import judged_path, missed_rescue, resolve

from .conftest import schedule_draft

V = 10


def one_hot_rows(tokens: list[int]) -> torch.Tensor:
    """Greedy target rows: row i puts all its mass on tokens[i] (as logits, their argmax)."""
    rows = torch.zeros(len(tokens), V, dtype=torch.float64)
    rows[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return rows


def greedy_state(tiny_engine) -> RunState:
    return RunState(
        tiny_engine.pair,
        GenerationConfig(method="specbranch", temperature=0.0),
        None,
        None,
        tokens=[2, 3],
        prompt_len=2,
        eos_ids=set(),
    )


def drafted(tokens: list[int], conf: list[float] | None = None, top: list | None = None, alts=None) -> list[Drafted]:
    """Greedy drafted tokens (q: a point mass, None)."""
    conf = conf or [1.0] * len(tokens)
    top = top or [None] * len(tokens)
    alts = alts or [None] * len(tokens)
    return [Drafted(t, None, c, p, a) for t, c, p, a in zip(tokens, conf, top, alts)]


def forked(path: list[int], candidates: list[int], branches: list[list[int]], **fork) -> Speculation:
    q = torch.full((V,), 1.0 / V, dtype=torch.float64)
    lines = [Branch(Drafted(c, q, 1.0 / V), drafted(b)) for c, b in zip(candidates, branches)]
    return Speculation(drafted(path), Fork(q, TOPK, lines, len(path), **fork))


def resolve_greedy(state, spec: Speculation, feed: Feed, best: list[int], events=None):
    """The verdict of a pass whose rows' argmaxes are `best` (feed.size of them)."""
    assert len(best) == feed.size
    return resolve(state, spec, feed, one_hot_rows(best), [] if events is None else events)


def line_feed(path: int) -> Feed:
    """One committed token the target has not seen, and `path` path tokens."""
    return Feed((3,), path)


def test_line_reads_the_first_branch():
    spec = forked([4], [5, 6], [[7, 8], [9]])
    assert [d.token for d in spec.line()] == [4, 5, 7, 8]
    assert [d.token for d in Speculation(drafted([4, 5])).line()] == [4, 5]
    assert spec.tokens() == [4, 5, 7, 8, 6, 9] and spec.depth() == 4


def test_a_feed_is_a_token_tree_and_says_which_row_judges_what():
    """Fed: one committed token, the path [4], then branch 0's line [5, 7] and branch 1's [6]: rows 0 and 1 judge
    the path token and the branch point; branch 0's rows (2, 3) judge 7 and then 8 (drafted beyond the feed);
    branch 1's row (4) judges 9."""
    spec = forked([4], [5, 6], [[7, 8], [9]])
    feed = Feed((3,), 1, (2, 1))
    assert feed.ids(spec) == [3, 4, 5, 7, 6] and feed.size == 5
    assert feed.tree().parents == (-1, 0, 1, 2, 1)
    assert list(feed.path_rows()) == [0, 1] and feed.fork_row() == 1
    assert list(feed.branch_rows(0)) == [2, 3] and list(feed.branch_rows(1)) == [4]
    assert feed.kept(1, 1, 0) == [0, 1, 4] and feed.kept(1, 0, 5) == [0, 1, 2, 3] and feed.kept(0) == [0]
    assert Feed((3,), 2).tree() is None and Feed((3,), 1, (0, 0)).tree() is None


def test_feed_limit_follows_the_odds_along_the_first_branch():
    """The line is fed while the product of its tokens' acceptance stays at or above the stop: through a fork, the
    first candidate's counts, and so do its branch's tokens. With no calibration a token reads as the draft's
    probability of it."""
    q = torch.full((V,), 1.0 / V, dtype=torch.float64)
    branches = [
        Branch(Drafted(5, q, 0.4), drafted([7, 8], [0.9, 0.5])),
        Branch(Drafted(6, q, 0.3), drafted([9], [0.8])),
    ]
    spec = Speculation(drafted([4], [0.9]), Fork(q, TOPK, branches, 1))
    assert [d.token for d in spec.line()] == [4, 5, 7, 8]
    acceptance = Policy().line_acceptance(spec)
    assert acceptance == [0.9, 0.4, 0.9, 0.5]
    # odds along the line: 0.9, 0.36, 0.324, 0.162
    assert [feed_limit(acceptance, stop) for stop in (0.0, 0.2, 0.33, 0.5, 0.95)] == [4, 3, 2, 1, 0]
    assert Policy().line_acceptance(Speculation(drafted([4, 5]))) == [1.0, 1.0]
    assert feed_limit([0.5, 0.5], 0.3) == 1 and feed_limit([], 0.3) == 0


def test_the_tree_feeds_the_likeliest_tokens_of_the_branches_first():
    """plan_branches: with the room left after the path, the branch tokens whose odds (of being reached and accepted)
    are highest, a tree: a token never before its parent; none below the stop."""
    # branch 0: 0.6, then 0.9 and 0.9 after it; branch 1: 0.3, then 0.9; branch 2: 0.1
    odds = [[0.6, 0.9, 0.9], [0.3, 0.9], [0.1]]
    assert plan_branches(1.0, odds, 3, 0.0) == (3, 0, 0)  # 0.6, 0.54, 0.486 before 0.3
    assert plan_branches(1.0, odds, 5, 0.0) == (3, 2, 0)  # then 0.3, 0.27 before 0.1
    assert plan_branches(1.0, odds, 9, 0.0) == (3, 2, 1)
    assert plan_branches(1.0, odds, 9, 0.29) == (3, 1, 0)  # 0.27 and 0.1 below the stop
    assert plan_branches(0.5, odds, 9, 0.29) == (1, 0, 0)  # the path's odds scale them all: 0.3, then 0.27
    assert plan_branches(1.0, odds, 0, 0.0) == (0, 0, 0)
    # the policy's odds of a branch: the first candidate as the draft's own token, the others by their share of the
    # rest of the draft's mass, times the odds that the first is rejected
    q = torch.full((V,), 1.0 / V, dtype=torch.float64)
    fork = Fork(q, TOPK, [Branch(Drafted(5, q, 0.5), drafted([7], [0.8])), Branch(Drafted(6, q, 0.3))], 0)
    got = Policy().branch_odds(Speculation([], fork))
    assert got[0] == [0.5, 0.8] and abs(got[1][0] - 0.5 * 0.3 / 0.5) < 1e-12 and len(got[1]) == 1


def test_line_acceptance_reads_the_measured_acceptance_where_a_token_was_drafted():
    """Sampled, the rule accepts a token drawn from q with probability sum(min(p, q)) whichever token was drawn.
    Unmeasured (PEARL), a token reads as its own probability. Measured (SpecBranch), it reads as the acceptance
    measured at the draft's largest probability where it was drafted: a token the draft gave 0.1 at a position where
    it was 0.8 sure, at a confidence where every token was accepted, reads near 1. A branch token, whose position's
    largest probability is not kept, reads at its own."""
    q = torch.full((V,), 1.0 / V, dtype=torch.float64)
    spec = Speculation(drafted([4, 5], [0.1, 0.6], [0.8, None]))
    assert Policy().line_acceptance(spec) == [0.1, 0.6]
    measured = AcceptanceCalibration()
    for _ in range(200):
        measured.record(0.8, True)
    policy = Policy(calibration=measured)
    first, second = policy.line_acceptance(spec)
    assert first > 0.96 and second == measured.acceptance(0.6) == 0.6
    branches = [Branch(Drafted(6, q, 0.2, 0.8), drafted([8], [0.3])), Branch(Drafted(7, q, 0.1), drafted([9], [0.5]))]
    forked_spec = Speculation(drafted([4, 5], [0.1, 0.6], [0.8, None]), Fork(q, TOPK, branches, 2, top=0.8))
    assert policy.line_acceptance(forked_spec) == [first, 0.6, first, 0.3]
    assert Policy().line_acceptance(forked_spec) == [0.1, 0.6, 0.2, 0.3]


def test_feed_stop_shortens_verify_passes_and_stays_greedy(tiny_engine):
    """Through the engine: with a feed stop the target is fed fewer drafted tokens per verify pass, and the
    output is still the target's own greedy output (the token after the fed ones is judged by the last row).
    A head start with a bar of ~0 makes the draft lead every pass by a whole block, so what is there to feed does
    not depend on how fast the two models run on this machine."""
    prompt = [2, 3, 4, 5]
    want = tiny_engine.run(prompt, GenerationConfig(method="ar", max_new_tokens=40)).token_ids
    fed = {}
    for stop in (0.0, 0.6):
        r = tiny_engine.run(
            prompt,
            GenerationConfig(
                method="specbranch", max_new_tokens=40, gamma=4, epsilon=0.7, feed_stop=stop, head_start=1e-9
            ),
        )
        assert r.token_ids == want
        spans = [e for e in r.events if isinstance(e, TimingSpan) and e.kind == VERIFY]
        fed[stop] = sum(e.tokens for e in spans) / len(spans)
    assert fed[0.6] < fed[0.0]


def test_first_candidate_right_goes_on_along_its_branch(tiny_engine):
    """The target was fed path + candidate 0 + its branch: one round commits past the branch point."""
    state, events = greedy_state(tiny_engine), []
    spec = forked([4], [5, 6], [[7, 8], [9]])
    # rows judge 4, the branch point, 7, 8; the target wants 4, 5, 7 and then 3 instead of 8
    out = resolve_greedy(state, spec, Feed((3,), 1, (2, 0)), [4, 5, 7, 3], events)
    assert out.tokens == [4, 5, 7, 3]
    assert out.kinds == [ACCEPTED, ACCEPTED, ACCEPTED, CORRECTION]
    assert sorted(out.dropped) == [6, 8, 9] and out.pending.path == [] and out.pending.fork is None
    assert out.kept == [0, 1, 2, 3] and out.branch == 0
    verdicts = [e for e in events if isinstance(e, Verified)]
    assert [(v.branch, v.drafted, v.accepted) for v in verdicts] == [(0, 1, 1), (1, 2, 1)]
    fork = next(e for e in events if isinstance(e, BranchResolved))
    assert fork.survivor == 0 and not fork.rescued and fork.depth == 1


def test_whole_first_branch_accepted_draws_a_bonus(tiny_engine):
    state = greedy_state(tiny_engine)
    out = resolve_greedy(state, forked([], [5, 6], [[7], []]), Feed((3,), 0, (2, 0)), [5, 7, 1])
    assert out.tokens == [5, 7, 1] and out.kinds == [ACCEPTED, ACCEPTED, BONUS]
    assert out.dropped == [6]


def test_fed_part_of_the_branch_accepted_rest_stays_pending(tiny_engine):
    state = greedy_state(tiny_engine)
    # fed: 5 (the branch point's candidate) and 7; the row after 7 judges 8; 9 was drafted beyond what was fed
    out = resolve_greedy(state, forked([], [5, 6], [[7, 8, 9], [2]]), Feed((3,), 0, (2, 0)), [5, 7, 8])
    assert out.tokens == [5, 7, 8] and [d.token for d in out.pending.path] == [9] and out.branch == 0


def test_rescue_from_the_same_row(tiny_engine):
    """Candidate 0 is wrong: the target's token is candidate 1. Its branch was not fed: it becomes the next path."""
    state, events = greedy_state(tiny_engine), []
    out = resolve_greedy(state, forked([4], [5, 6], [[7, 8], [9, 2]]), Feed((3,), 1, (3, 0)), [4, 6, 7, 8, 0], events)
    assert out.tokens == [4, 6] and out.kinds == [ACCEPTED, RESCUED]
    assert [d.token for d in out.pending.path] == [9, 2] and out.branch == 1
    assert sorted(out.dropped) == [5, 7, 8]
    assert [e.branch for e in events if isinstance(e, Verified)] == [0]  # the fed first branch is moot


def test_a_rescued_branch_is_judged_in_the_same_pass(tiny_engine):
    """The tree: the path [4], then branch 0's line [5, 7] and branch 1's [6, 9], fed in one pass. The target wants 4,
    then 6 (candidate 1: a rescue), then 9 (judged by 6's row), then 1 where the draft had 2 (judged by 9's row). The
    pass commits four tokens where verifying the first branch only would commit two; the target's cache keeps the
    path and branch 1's fed tokens (rows 0, 1, 4, 5)."""
    state, events = greedy_state(tiny_engine), []
    spec = forked([4], [5, 6], [[7, 8], [9, 2]])
    feed = Feed((3,), 1, (2, 2))
    assert feed.ids(spec) == [3, 4, 5, 7, 6, 9]
    out = resolve_greedy(state, spec, feed, [4, 6, 0, 0, 9, 1], events)
    assert out.tokens == [4, 6, 9, 1] and out.kinds == [ACCEPTED, RESCUED, ACCEPTED, CORRECTION]
    assert out.kept == [0, 1, 4, 5] and out.branch == 1 and out.pending.path == []
    assert sorted(out.dropped) == [2, 5, 7, 8]
    verdicts = [(e.branch, e.drafted, e.accepted) for e in events if isinstance(e, Verified)]
    assert verdicts == [(0, 1, 1), (2, 2, 1)]
    fork = next(e for e in events if isinstance(e, BranchResolved))
    assert fork.survivor == 1 and fork.rescued
    # the rescued branch wholly accepted: its last fed row draws the bonus; drafted beyond: the rest is pending
    out = resolve_greedy(state, forked([4], [5, 6], [[7, 8], [9]]), feed, [4, 6, 0, 0, 9, 2])
    assert out.tokens == [4, 6, 9, 2] and out.kinds[-1] == BONUS
    out = resolve_greedy(state, forked([4], [5, 6], [[7, 8], [9, 2, 3]]), feed, [4, 6, 0, 0, 9, 2])
    assert out.tokens == [4, 6, 9, 2] and [d.token for d in out.pending.path] == [3]


def test_costs_decide_whether_a_fork_pays():
    """A rescue is judged in the same target pass as the path (its candidate's row judges its branch's first token),
    so it returns a token more than the pass would have, worth a target step, and its branch's tokens become the next
    block, drafting saved. A fork pays where that saving, at the rescue odds, beats the extra cost of its steps on k
    rows and what k rows do to the target step beside them."""
    cheap = BranchCosts({1: 10.0, 2: 11.0, 3: 12.0}, target_busy_ms={1: 60.0, 2: 60.0, 3: 60.0})
    # 5 branch steps: a rescue at odds 0.3 saves 0.3 · (a 60 ms target step + 5 one-row steps); 3 rows cost 5 · 2 ms
    assert abs(cheap.net_gain_ms(3, 0.3, steps=5) - (0.3 * (60.0 + 50.0) - 10.0)) < 1e-9
    # the break-even odds: what k rows cost over one, against a target step and the steps saved
    assert abs(cheap.net_gain_ms(3, 8 / 100, steps=4)) < 1e-9 and cheap.net_gain_ms(3, 0.07, steps=4) < 0
    policy = Policy(max_branches=3, epsilon=0.5, costs=cheap)
    top = [0.3, 0.25, 0.2]  # rescue odds (1 - 0.3) · share: 0.25 with 2 candidates, 0.45 with 3
    assert policy.branch_width(top, fresh=False, hrad_class=None, steps_left=5) == 3
    dear = BranchCosts({1: 10.0, 2: 40.0, 3: 70.0}, target_busy_ms={1: 60.0, 2: 60.0, 3: 60.0})
    assert Policy(max_branches=3, epsilon=0.5, costs=dear).branch_width(top, False, None, steps_left=5) == 1
    # cheap draft steps, but k rows slow the target step beside them (shared cores): 2 rows cost 4 ms of target
    # time, 3 rows 30 ms; gains 0.25 · 112 - 5 - 4 = 19 and 0.45 · 112 - 10 - 30 = 10.4: fork 2 wide
    crowded = BranchCosts({1: 10.0, 2: 11.0, 3: 12.0}, {1: 62.0, 2: 66.0, 3: 92.0})
    assert Policy(max_branches=3, epsilon=0.5, costs=crowded).branch_width(top, False, None, steps_left=5) == 2
    # k rows beside the target never speed it up: a target step measured faster beside more rows counts as no change
    noisy = BranchCosts({1: 10.0, 2: 11.0, 3: 12.0}, {1: 60.0, 2: 50.0, 3: 60.0})
    assert noisy.net_gain_ms(2, 0.3, steps=5) == cheap.net_gain_ms(2, 0.3, steps=5)
    # a draft whose k-row step costs 1.5 one-row steps (the layer-skipping self-draft on this CPU): at odds 0.45 the
    # saved target step pays for 3 rows; at a rescue's odds of 0.05 nothing pays
    cpu = BranchCosts({1: 14.1, 2: 17.4, 3: 21.3}, {1: 52.1, 2: 55.3, 3: 51.7})
    assert Policy(max_branches=3, epsilon=0.5, costs=cpu).branch_width(top, False, None, steps_left=5) == 3
    assert Policy(max_branches=3, epsilon=0.5, costs=cpu).branch_width([0.3, 0.02, 0.01], False, None, 0, 5) == 1
    assert Policy(max_branches=3, epsilon=0.5).branch_width(top, False, None, steps_left=5) == 3  # paper's rule
    assert policy.branch_width([0.9, 0.05, 0.01], False, None, steps_left=5) == 1  # confident: no fork


def test_engine_measures_branch_costs(tiny_engine):
    costs = tiny_engine.branch_costs(3)
    assert tiny_engine.measured_branch_costs is costs  # what the bench JSON records
    assert sorted(costs.draft_ms) == sorted(costs.target_busy_ms) == [1, 2, 3]
    assert all(ms > 0 for ms in [*costs.draft_ms.values(), *costs.target_busy_ms.values()])
    assert tiny_engine.policy(GenerationConfig(method="specbranch", branches=3, branch_costs=True)).costs is costs
    assert tiny_engine.policy(GenerationConfig(method="specbranch", branches=3)).costs is None  # the paper's rule
    assert tiny_engine.policy(GenerationConfig(method="pearl")).costs is None


def test_a_fork_keeps_drafting_its_branches(tiny_engine):
    """The draft-stop rule reads the mass the fork's candidates cover, not the confidence left over from
    the last token of the previous round: an unsure token is what a fork hedges, so its branches get drafted."""
    import asyncio

    from engine.methods.drafting import DraftState, draft_until_verdict

    async def fork_and_draft():
        cfg = GenerationConfig(method="specbranch", gamma=3, draft_stop=0.3, epsilon=1.0)
        state = RunState(
            tiny_engine.pair,
            cfg,
            tiny_engine.target_worker,
            tiny_engine.draft_worker,
            tokens=[2, 3, 4],
            prompt_len=3,
            eos_ids=set(),
        )
        ds = DraftState(cached=[], confidence=0.01)  # the previous round ended on an unsure token
        spec, verdict_pending = Speculation(), asyncio.get_running_loop().create_future()
        await draft_until_verdict(state, spec, ds, Policy(max_branches=3, epsilon=1.0), verdict_pending, [])
        return spec

    spec = asyncio.run(fork_and_draft())
    fork = spec.fork
    assert fork is not None and fork.depth == 0
    covered = float(fork.q[fork.candidates].sum())
    assert covered >= 0.3  # the tiny draft is peaky enough: the candidates cover more than the stop threshold
    assert all(len(b.tokens) >= 1 for b in fork.branches)


def test_drafting_stops_at_the_token_budget(tiny_engine):
    """However long the verdict takes, the draft never drafts past what the run may still emit (so never
    past the context: a head's cache has exactly that many rows)."""
    import asyncio

    from engine.methods.drafting import DraftState, draft_until_verdict

    async def draft_long():
        cfg = GenerationConfig(method="specbranch", gamma=4, max_new_tokens=3, epsilon=1.0)
        state = RunState(
            tiny_engine.pair,
            cfg,
            tiny_engine.target_worker,
            tiny_engine.draft_worker,
            tokens=[2, 3, 4],
            prompt_len=3,
            eos_ids=set(),
        )
        spec = Speculation()
        await draft_until_verdict(
            state,
            spec,
            DraftState(cached=[]),
            Policy(max_branches=3, epsilon=1.0),
            asyncio.get_running_loop().create_future(),
            [],
        )
        return spec

    assert asyncio.run(draft_long()).depth() == 3  # the budget, not 2γ = 8


def test_calibration_starts_at_the_confidence_and_moves_to_the_measured_rate():
    cal = AcceptanceCalibration()
    assert cal.acceptance(0.07) == 0.07 and cal.acceptance(0.93) == 0.93 and cal.table() == []  # the paper's rule
    for _ in range(40):
        cal.record(0.07, True)  # a draft that is right where it is unsure
    cal.record(0.92, False)
    assert abs(cal.acceptance(0.07) - (40 + PRIOR_WEIGHT * 0.07) / (40 + PRIOR_WEIGHT)) < 1e-12
    assert abs(cal.acceptance(0.06) - (40 + PRIOR_WEIGHT * 0.06) / (40 + PRIOR_WEIGHT)) < 1e-12  # the same bin
    assert cal.acceptance(0.12) == 0.12  # another bin: no verdicts yet
    assert abs(cal.acceptance(0.92) - PRIOR_WEIGHT * 0.92 / (1 + PRIOR_WEIGHT)) < 1e-12
    assert cal.table() == [
        {"confidence": [0.05, 0.1], "judged": 40, "accepted": 40, "rate": 1.0},
        {"confidence": [0.9, 0.95], "judged": 1, "accepted": 0, "rate": 0.0},
    ]
    assert cal.bin_of(0.0) == 0 and cal.bin_of(1.0) == cal.bin_of(0.999)
    wide = AcceptanceCalibration(2.0, 5)  # the rescue table's shape: 5 bins, a prior worth 2 verdicts
    wide.record(0.5, False)
    assert wide.table() == [{"confidence": [0.4, 0.6], "judged": 1, "accepted": 0, "rate": 0.0}]
    assert abs(wide.acceptance(0.59) - 2 * 0.59 / 3) < 1e-12 and wide.acceptance(0.61) == 0.61


def test_a_pooled_table_moves_every_bin_with_its_first_verdicts():
    """The rescue table's prior (Engine.calibration): an empty table reads the share itself; verdicts in one bin
    move the others toward the rate measured there (a prior at the share, worth W verdicts, over those verdicts),
    and a bin's own verdicts then count over that."""
    pooled = AcceptanceCalibration(RESCUE_PRIOR_WEIGHT, RESCUE_BINS, pooled=True)
    w = RESCUE_PRIOR_WEIGHT
    assert pooled.acceptance(0.7) == 0.7 and pooled.acceptance(0.1) == 0.1
    for _ in range(4):
        pooled.record(0.1, False)  # four forks whose alternatives all missed, in the lowest bin
    others = w * 0.7 / (4 + w)  # what bin [0.6, 0.8) reads as its prior: the other bins' 0 of 4, over the share
    assert abs(pooled.acceptance(0.7) - others) < 1e-12 and pooled.acceptance(0.7) < 0.7 / 2
    assert abs(pooled.acceptance(0.1) - w * 0.1 / (4 + w)) < 1e-12  # its own bin: no other bin has verdicts yet
    pooled.record(0.7, True)
    prior = w * 0.7 / (4 + w)
    assert abs(pooled.acceptance(0.7) - (1 + w * prior) / (1 + w)) < 1e-12
    assert abs(pooled.acceptance(0.1) - (0 + w * (1 + w * 0.1) / (1 + w)) / (4 + w)) < 1e-12
    plain = AcceptanceCalibration(RESCUE_PRIOR_WEIGHT, RESCUE_BINS)
    for _ in range(4):
        plain.record(0.1, False)
    assert plain.acceptance(0.7) == 0.7  # unpooled: a bin without verdicts keeps its prior


def test_calibrated_policy_forks_where_the_draft_is_measured_wrong():
    """At confidence 0.3 the paper's rule (ε 0.5) forks 3 wide; once that bin measured every token accepted,
    the policy does not fork there, and where it measured every token rejected it forks as wide as allowed."""
    cal = AcceptanceCalibration()
    top = [0.3, 0.25, 0.2]
    assert Policy(max_branches=3, epsilon=0.5, calibration=cal).branch_width(top, False, None) == 3
    for _ in range(40):
        cal.record(0.3, True)
        cal.record(0.8, False)
    assert Policy(max_branches=3, epsilon=0.5, calibration=cal).branch_width(top, False, None) == 1
    assert Policy(max_branches=3, epsilon=0.5).branch_width(top, False, None) == 3  # uncalibrated: as before
    assert Policy(max_branches=3, epsilon=0.5).branch_width([0.8, 0.1, 0.05], False, None) == 1
    assert Policy(max_branches=3, epsilon=0.5, calibration=cal).branch_width([0.8, 0.1, 0.05], False, None) == 3
    # with measured costs, the rescue odds are the measured miss rate times the candidates' share of the rest
    cheap = BranchCosts({1: 10.0, 2: 11.0, 3: 12.0}, target_busy_ms={1: 60.0, 2: 60.0, 3: 60.0})
    assert (
        Policy(max_branches=3, epsilon=0.5, costs=cheap, calibration=cal).branch_width(
            [0.8, 0.1, 0.05], False, None, steps_left=5
        )
        == 3
    )


def test_resolve_reports_what_the_target_judged(tiny_engine):
    """(draft's top probability, accepted) per judged path token: up to and including the first rejection, none
    after it, none without a recorded probability; at a branch point, the first candidate, the draft's own token."""
    state = greedy_state(tiny_engine)
    spec = Speculation(drafted([4, 5, 6], top=[0.9, 0.4, 0.2]))
    out = resolve_greedy(state, spec, line_feed(3), [4, 7, 6, 1])  # 5 is rejected; 6 is never judged
    assert out.tokens == [4, 7] and out.judged == [(0.9, True), (0.4, False)]
    out = resolve_greedy(state, spec, line_feed(1), [4, 5])  # two rows reach only 4 and 5: both accepted, 6 pending
    assert out.judged == [(0.9, True), (0.4, True)] and [d.top for d in out.pending.path] == [0.2]
    spec = forked([4], [5, 6], [[7, 8], [9, 2]], top=0.35)
    spec.path[0].top = 0.8
    out = resolve_greedy(state, spec, Feed((3,), 1, (3, 0)), [4, 6, 7, 8, 0])  # a rescue: the draft's own rejected
    assert out.judged == [(0.8, True), (0.35, False)] and [d.top for d in out.pending.path] == [None, None]
    assert judged_path(out.pending.path, 2, False) == []  # the rescued branch's tokens have no recorded probability


def test_engine_learns_where_its_draft_is_right(tiny_dirs, monkeypatch):
    """The tiny target as its own float32 draft is never wrong. With ε 0.6 the paper's rule forks wherever the
    draft's confidence is below 0.6, run after run; calibrated, the engine learns from its verdicts that the draft
    is right at those confidences, and by its third run forks far less. Greedy output equals AR's either way. Beside
    each pass the draft takes one step (schedule_draft: as where it costs what the target does, which this one does),
    so where it forks is the rule's, not this machine's timing."""
    from engine.engine import Engine
    from engine.models.loading import load_pair

    schedule_draft(monkeypatch, lambda state: 0)
    engine = Engine(load_pair(str(tiny_dirs["target"]), "self", device="cpu", draft_matmul="float32"))
    try:
        prompt = [2, 3, 4, 5]
        want = engine.run(prompt, GenerationConfig(method="ar", max_new_tokens=40)).token_ids
        forks = {}
        for calibrate in (False, True):
            cfg = GenerationConfig(method="specbranch", max_new_tokens=40, gamma=4, epsilon=0.6, calibrate=calibrate)
            for run in range(3):
                r = engine.run(prompt, cfg)
                assert r.token_ids == want
                forks[calibrate, run] = r.metrics["branch_points"]
                # each fork's event says why it is there: the odds the policy read, below ε
                cands = [e for e in r.events if isinstance(e, DraftProposed) and e.kind == "candidates"]
                assert all(0 < e.confidence <= 1 and 0 <= e.odds < 0.6 for e in cands)
                assert all(e.odds == e.confidence for e in cands) or calibrate
                assert all(
                    e.odds == -1 and e.confidence == -1
                    for e in r.events
                    if isinstance(e, DraftProposed) and e.kind != "candidates"
                )
                for c in cands:  # the step's caption gives them where the fork is resolved in the same step
                    mine = [e for e in r.events if getattr(e, "step", None) == c.step]
                    if any(isinstance(e, BranchResolved) for e in mine):
                        assert f"acceptance odds {c.odds:.2f}" in step_caption(mine, c.step)
        assert min(forks[False, run] for run in range(3)) >= 5
        assert forks[True, 2] <= forks[False, 2] // 2
        table = engine.calibration(cfg).table()
        assert sum(b["judged"] for b in table) > 0 and all(b["rate"] == 1.0 for b in table)
        assert engine.policy(GenerationConfig(method="pearl")).calibration is None
        assert engine.policy(GenerationConfig(method="specbranch", calibrate=False)).calibration is None
        assert (
            engine.policy(GenerationConfig(method="specbranch", temperature=1.0)).calibration
            is not engine.policy(GenerationConfig(method="specbranch")).calibration
        )  # a table per way of sampling
    finally:
        engine.close()


def test_resolve_reports_whether_a_fork_rescued(tiny_engine):
    """Where the first candidate is rejected, the fork's alternatives' share and whether one of them was the
    target's token (what the rescue table learns); nothing where the first candidate was right. Greedy, the same
    where a path token is rejected, for the fork the draft could have made there (missed_rescue)."""
    state = greedy_state(tiny_engine)
    spec = forked([4], [5, 6], [[7, 8], [9, 2]], share=0.6)
    feed = Feed((3,), 1, (3, 0))
    assert resolve_greedy(state, spec, feed, [4, 6, 7, 8, 0]).rescue == (0.6, True)
    assert resolve_greedy(state, spec, feed, [4, 3, 7, 8, 0]).rescue == (0.6, False)  # every candidate lost
    assert resolve_greedy(state, spec, feed, [4, 5, 7, 8, 0]).rescue is None
    assert alternatives_share([0.6, 0.2, 0.1], 3) == (0.2 + 0.1) / 0.4 and alternatives_share([0.6, 0.2], 1) == 0
    # greedy, a rejected path token tells whether the fork the draft could have made there (its share, its top 3)
    # would have rescued it: the target's token among the draft's 2nd and 3rd
    spec = Speculation(drafted([4, 5, 6], alts=[None, (0.5, [5, 7, 8]), (0.3, [6, 1, 2])]))
    assert resolve_greedy(state, spec, line_feed(3), [4, 7, 6, 1]).rescue == (0.5, True)
    assert resolve_greedy(state, spec, line_feed(3), [4, 3, 6, 1]).rescue == (0.5, False)
    assert resolve_greedy(state, spec, line_feed(3), [9, 5, 6, 1]).rescue is None  # no fork known at the first token
    assert resolve_greedy(state, spec, line_feed(3), [4, 5, 6, 1]).rescue is None  # a bonus: nothing was rejected
    assert [d.alts for d in resolve_greedy(state, spec, line_feed(1), [4, 5]).pending.path] == [(0.3, [6, 1, 2])]
    probe = torch.Generator().manual_seed(0)
    q = torch.full((V,), 1.0 / V, dtype=torch.float64)
    p7 = one_hot_rows([7])[0]
    assert missed_rescue(p7, q, (0.5, [7, 5, 8]), None, True, probe) is None  # held: its own token was the target's
    assert missed_rescue(p7, q, (0.5, [5, 8, 7]), None, True, probe) == (0.5, True)
    assert missed_rescue(p7, q, None, 5, True, probe) is None


def test_a_missed_rescue_sampled_plays_the_fork_with_its_exact_odds():
    """Sampled, missed_rescue plays the fork the draft could have made: its verdicts come with the probabilities
    that the multi-candidate rule (k = 3, candidates drawn without replacement) gives, enumerated here in float64.
    Where the draft's own token x was rejected: a rescue with R(x), the odds that candidate 2 or 3 survives from the
    residual that x's rejection leaves. Where it held back: no verdict with the odds that its first candidate would
    have been accepted, sum(min(p, q)), and a rescue with sum_x q(x) (1 - min(1, p(x)/q(x))) R(x)."""
    p = torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1], dtype=torch.float64)
    q = torch.tensor([0.5, 0.2, 0.1, 0.15, 0.05], dtype=torch.float64)
    p1 = (p - q).clamp_min(0) / (p - q).clamp_min(0).sum()  # after any rejection of a token drawn from q

    def without(dist, *drop):
        out = dist.clone()
        out[list(drop)] = 0
        return out / out.sum()

    def rescue_odds(x):  # candidates 2 and 3 drawn from q without x (and without candidate 2), tried against p1, p2
        q1, total = without(q, x), 0.0
        p2 = (p1 - q1).clamp_min(0) / (p1 - q1).clamp_min(0).sum()
        for x2 in range(5):
            if q1[x2] == 0:
                continue
            a2 = min(1.0, float(p1[x2] / q1[x2]))
            q2 = without(q, x, x2)
            a3 = sum(float(q2[x3]) * min(1.0, float(p2[x3] / q2[x3])) for x3 in range(5) if q2[x3] > 0)
            total += float(q1[x2]) * (a2 + (1 - a2) * a3)
        return total

    probe, n, alts = torch.Generator().manual_seed(0), 20000, (0.4, [0, 1, 2])
    rescued = sum(missed_rescue(p, q, alts, 0, False, probe)[1] for _ in range(n)) / n
    assert abs(rescued - rescue_odds(0)) < 4 * (rescue_odds(0) * (1 - rescue_odds(0)) / n) ** 0.5
    held = [missed_rescue(p, q, alts, None, False, probe) for _ in range(n)]
    kept = float(torch.minimum(p, q).sum())
    rescue = sum(float(q[x]) * (1 - min(1.0, float(p[x] / q[x]))) * rescue_odds(x) for x in range(5))
    for share, want in ((None, kept), (True, rescue), (False, 1 - kept - rescue)):
        got = sum((v is None) if share is None else (v is not None and v[1] == share) for v in held) / n
        assert abs(got - want) < 4 * (want * (1 - want) / n) ** 0.5, (share, got, want)
    assert all(v is None or v[0] == 0.4 for v in held)


def test_hold_weighs_the_whole_path_and_the_forks_rescues():
    """What the draft would propose holds up with the odds that every pending path token is accepted, times its
    own token's acceptance, plus, at a fork, the measured odds of a rescue. Below the hold it proposes nothing."""
    acceptance, rescues = AcceptanceCalibration(), AcceptanceCalibration(RESCUE_PRIOR_WEIGHT, RESCUE_BINS)
    for _ in range(40):
        acceptance.record(0.3, False)  # wrong where it is unsure
        acceptance.record(0.9, True)  # right where it is sure
    policy = Policy(max_branches=3, epsilon=0.5, calibration=acceptance, rescues=rescues, hold=0.4)
    top = [0.3, 0.35, 0.2]
    own = policy.acceptance(0.3)
    assert own < 0.1 and policy.holds_up(top, 1) == own
    share = alternatives_share(top, 3)
    assert abs(policy.rescue_odds(top, 3) - (1 - own) * share) < 1e-12  # no rescue measured yet: the share itself
    assert abs(policy.holds_up(top, 3) - (own + (1 - own) * share)) < 1e-12
    assert policy.held_back(policy.holds_up(top, 1)) and not policy.held_back(policy.holds_up(top, 3))
    for _ in range(20):
        rescues.record(share, False)  # its alternatives never held the target's token
    assert policy.held_back(policy.holds_up(top, 3))
    q = torch.full((V,), 1.0 / V, dtype=torch.float64)
    spec = Speculation(drafted([4, 5, 6], [0.9, 0.9, 0.3], [0.9, None, 0.3]))
    assert abs(policy.path_odds(spec) - policy.acceptance(0.9) ** 2 * own) < 1e-12  # a rescued token: its conf
    assert policy.path_odds(Speculation()) == 1.0
    # through a fork: the path's odds, the fork's (one candidate survives), and its first branch's tokens'
    lines = [Branch(Drafted(7, q, 0.3), drafted([9], [0.9])), Branch(Drafted(8, q, 0.2), drafted([2], [0.4]))]
    spec.fork = Fork(q, TOPK, lines, 3, odds=0.6)
    assert abs(policy.line_odds(spec) - policy.path_odds(spec) * 0.6 * policy.acceptance(0.9)) < 1e-12
    assert not Policy(max_branches=3).held_back(0.0)  # hold 0: never
    # the forks it did not make are played for the rescue table only where a decision reads it
    assert policy.reads_rescues and not Policy(max_branches=3, rescues=rescues).reads_rescues


def test_sure_enough_is_where_the_next_path_step_neither_forks_nor_holds():
    """The least largest probability at which the draft's next path step drafts its token as it is (a draft in its
    own process steps ahead only there): ε where only forks decide; the hold's bar over the path's odds where that
    is higher; every row forks where the table measured every token wrong; none for PEARL."""
    assert Policy().sure_enough(Speculation()) is None  # PEARL: never forks or holds
    assert Policy(max_branches=3, fixed_at=2).sure_enough(Speculation()) is None  # forks by position, not confidence
    fork_only = Policy(max_branches=3, epsilon=0.5).sure_enough(Speculation())
    assert 0.5 <= fork_only <= 0.5 + 2**-10
    spec = Speculation(drafted([4, 5], [0.8, 0.8]))
    for epsilon, want in ((0.5, 0.5), (0.2, 0.3 / 0.64)):  # hold 0.3 over a path of odds 0.8 * 0.8
        got = Policy(max_branches=3, epsilon=epsilon, hold=0.3).sure_enough(spec)
        assert want <= got <= want + 2**-10, (epsilon, got)
    wrong = AcceptanceCalibration()
    for b in range(20):
        for _ in range(200):
            wrong.record(b / 20 + 0.01, False)
    assert Policy(max_branches=3, epsilon=0.5, calibration=wrong).sure_enough(Speculation()) == 1.0


def test_held_positions_are_left_to_the_target_and_still_measured(tiny_dirs, monkeypatch):
    """Hold 1: the draft proposes nothing (its odds are always below 1), every position is the target's own
    token, output equals AR's, and the calibration still learns at every held position the target reached. How many
    tokens are drafted beside each pass is a rule here (schedule_draft: on to the depth cap), not this machine's
    timing, so a partial hold's count is compared with the same schedule's."""
    from engine.engine import Engine
    from engine.models.loading import load_pair

    schedule_draft(monkeypatch, lambda state: 2 * state.cfg.gamma)
    engine = Engine(load_pair(str(tiny_dirs["target"]), str(tiny_dirs["draft"]), device="cpu", draft_matmul="float32"))
    try:
        prompt = [2, 3, 4, 5]
        want = engine.run(prompt, GenerationConfig(method="ar", max_new_tokens=30)).token_ids
        cfg = GenerationConfig(method="specbranch", max_new_tokens=30, gamma=3, epsilon=0.5, hold=1.0)
        r = engine.run(prompt, cfg)
        assert r.token_ids == want
        assert r.metrics["drafted_tokens"] == 0 and r.metrics["wasted_draft_tokens"] == 0
        held = [e for e in r.events if isinstance(e, DraftProposed) and e.kind == "held"]
        assert len(held) >= 20 and all(e.tokens == [] and 0 <= e.odds < 1 and 0 < e.confidence <= 1 for e in held)
        table = engine.calibration(cfg).table()
        judged = sum(b["judged"] for b in table)
        assert judged >= len(held) - 1  # the last may be past the end
        # ... and the rescue table (no fork was made): one verdict at each held position where the target's token
        # was not the draft's own (greedy, the acceptance table recorded 0 there), whether a fork would have rescued it
        missed = judged - sum(b["accepted"] for b in table)
        assert missed > 0 and sum(b["judged"] for b in engine.calibration(cfg, "rescue").table()) == missed
        mine = [e for e in r.events if getattr(e, "step", None) == held[0].step]
        assert f"the draft held back (acceptance odds {held[0].odds:.2f}," in step_caption(mine, held[0].step)
        # a partial hold on the same engine: fewer tokens drafted than without it, output still AR's
        free = engine.run(prompt, GenerationConfig(method="specbranch", max_new_tokens=30, gamma=3, epsilon=0.5))
        some = engine.run(
            prompt, GenerationConfig(method="specbranch", max_new_tokens=30, gamma=3, epsilon=0.5, hold=0.5)
        )
        assert free.token_ids == some.token_ids == want
        assert some.metrics["drafted_tokens"] < free.metrics["drafted_tokens"]
        assert engine.policy(GenerationConfig(method="pearl", hold=0.5)).hold == 0  # PEARL never holds back
        # each variant keeps its own tables: SpecBranch's verdicts are not the ablation's
        assert engine.calibration(GenerationConfig(method="specbranch-no-branch", hold=1.0)).table() == []
    finally:
        engine.close()


def test_a_draft_that_holds_again_after_a_hold_follows_the_target(tiny_engine):
    """Where the target produced the position the draft held back at (release_hold), the draft's next step decides
    again, and the run counts how often it held again. Where it has more often than not, the draft follows the
    target: the next pass starts at once, with no head start, and the draft steps beside it. Otherwise it leads as
    before. A rejection before the held position makes the hold moot and counts nothing."""
    import asyncio

    from engine.methods.drafting import DraftState, draft_step, head_start
    from engine.methods.parallel import release_hold
    from engine.methods.verdict import Outcome

    cfg = GenerationConfig(method="specbranch", gamma=3, epsilon=0.5, head_start=0.3, hold=0.5)
    state = RunState(
        tiny_engine.pair,
        cfg,
        tiny_engine.target_worker,
        tiny_engine.draft_worker,
        tokens=[2, 3, 4],
        prompt_len=3,
        eos_ids=set(),
    )
    q = torch.full((V,), 1.0 / V, dtype=torch.float64)
    feed = Feed((4,), 0)  # the row of the committed token 4 judges position 3
    for outcome, released in (
        (Outcome([6], [CORRECTION], Speculation(), [0]), True),  # the target produced position 3
        (Outcome([], [], Speculation(), [0]), False),
    ):  # nothing committed yet: the hold stays
        ds = DraftState(cached=[2, 3, 4], held=Drafted(7, q, 0.1, 0.1))
        release_hold(state, one_hot_rows([6]), feed, outcome, ds, Policy(max_branches=3, hold=0.5))
        assert ds.after_hold is released and (ds.held is None) is released
    ds = DraftState(cached=[2, 3, 4, 9], held=Drafted(7, q, 0.1, 0.1))  # held at 4, but the target rejected 3's token
    release_hold(state, one_hot_rows([6]), feed, Outcome([6], [CORRECTION], Speculation(), [0]), ds, Policy(hold=0.5))
    assert ds.held is None and not ds.after_hold

    def step(ds: DraftState, policy: Policy, lead: bool) -> list:
        """The draft's forwards at the start of a round (lead) or beside the pass, from a fresh cache."""
        fresh, events = (
            RunState(
                tiny_engine.pair,
                cfg,
                tiny_engine.target_worker,
                tiny_engine.draft_worker,
                tokens=[2, 3, 4],
                prompt_len=3,
                eos_ids=set(),
            ),
            [],
        )
        ds.cached, ds.held = [], None
        asyncio.run(
            head_start(fresh, Speculation(), ds, policy, events)
            if lead
            else draft_step(fresh, Speculation(), ds, policy, events)
        )
        return [e for e in events if isinstance(e, TimingSpan)]

    always, never = Policy(max_branches=3, hold=1.0), Policy(max_branches=3, hold=1e-9)  # hold again / draft on
    ds = DraftState(cached=[], after_hold=True)
    assert not ds.follows  # the prior (1 in 2) leads
    assert len(step(ds, always, lead=True)) == 1 and ds.holds_again == [2, 3] and not ds.after_hold
    ds.after_hold = True
    assert ds.follows and step(ds, always, lead=True) == []  # held again more often than not: no step first
    step(ds, always, lead=False)  # its step beside the pass is counted all the same
    assert ds.holds_again == [3, 4] and not ds.after_hold and not ds.follows
    ds = DraftState(cached=[], after_hold=True, holds_again=[1, 2])
    step(ds, never, lead=False)
    assert ds.holds_again == [1, 3] and ds.held is None and not ds.after_hold
    ds.after_hold = True
    assert not ds.follows and len(step(ds, never, lead=True)) >= 1  # it drafted on: the head start leads


def test_a_branch_step_below_the_hold_keeps_nothing(tiny_engine):
    """With hold_branches the hold reads a branch step as it reads a path token: the first branch's line odds
    (Policy.line_odds) times the acceptance read at the step's largest probability, before any draw. Where that falls
    below the hold, the step keeps nothing (no branch token, the draft cache where it was), the fork holds until the
    next verdict, and a "held" event on branch 1 says so; just above it, every branch grows by a token. Without it
    (the default) only the odds before a step are read. Greedy output stays AR's either way."""
    import asyncio

    from engine.methods.drafting import DraftState, draft_step, draft_until_verdict
    from engine.models import cache as kv

    cfg = GenerationConfig(method="specbranch", gamma=3, epsilon=1.0, hold=0.5)
    state = RunState(
        tiny_engine.pair,
        cfg,
        tiny_engine.target_worker,
        tiny_engine.draft_worker,
        tokens=[2, 3, 4],
        prompt_len=3,
        eos_ids=set(),
    )
    ds, spec, events = DraftState(cached=[]), Speculation(), []

    def draft(hold: float = 0.0, strict: bool = False, until_verdict: bool = True) -> None:
        """Draft steps with no verdict coming (one step, or on until the policy stops)."""
        policy = Policy(max_branches=3, epsilon=1.0, hold=hold, hold_branches=strict)

        async def go():
            if not until_verdict:
                return await draft_step(state, spec, ds, policy, events)
            await draft_until_verdict(state, spec, ds, policy, asyncio.get_running_loop().create_future(), events)

        asyncio.run(go())

    draft(until_verdict=False)  # ε 1: the draft forks at its first step
    draft(until_verdict=False)  # ... and steps its branches
    fork = spec.fork
    assert fork is not None and len(fork.candidates) >= 2 and all(len(b.tokens) == 1 for b in fork.branches)

    def lines() -> list[list[int]]:
        return [[d.token for d in b.tokens] for b in fork.branches]

    def grew(before: list[list[int]]) -> bool:
        return [len(b) for b in lines()] == [len(b) + 1 for b in before]

    def rows() -> list[list[int]]:  # what each row of the draft cache holds, by the draft's own record
        return [ds.cached + b.fed() for b in fork.branches]

    line, before = Policy(max_branches=3).line_odds(spec), lines()
    draft(hold=line)  # the default reads the line before a step: it takes one, then stops below the hold
    assert grew(before) and not fork.held and not any(e.kind == "held" for e in events if isinstance(e, DraftProposed))
    line, before = Policy(max_branches=3).line_odds(spec), lines()
    length, held_rows = kv.cache_length(state.draft_cache), rows()
    events.clear()
    draft(hold=line, strict=True)  # the line alone holds up at the hold; with the next token it does not
    held = [e for e in events if isinstance(e, DraftProposed) and e.kind == "held"]
    assert len(held) == 1 and held[0].branch == 1 and held[0].tokens == [] and held[0].odds < line
    assert abs(held[0].odds - line * held[0].confidence) < 1e-9  # no calibration: acceptance is the confidence
    assert sum(isinstance(e, TimingSpan) for e in events) == 1  # one step taken, then no more this round
    assert fork.held and lines() == before and rows() == held_rows
    assert kv.cache_length(state.draft_cache) == length == len(rows()[0])
    fork.held = False  # as after a verdict that leaves the fork pending (verify_round)
    events.clear()
    draft(hold=held[0].odds * (1 - 1e-6), strict=True, until_verdict=False)  # just below what it read: kept
    assert grew(before) and not fork.held and kv.cache_length(state.draft_cache) == len(rows()[0]) == length + 1
    assert not any(isinstance(e, DraftProposed) and e.kind == "held" for e in events)
    # through the engine: forks whose branches hold, and the target's own greedy output
    prompt = [2, 3, 4, 5]
    want = tiny_engine.run(prompt, GenerationConfig(method="ar", max_new_tokens=40)).token_ids
    for strict in (True, False):
        r = tiny_engine.run(
            prompt,
            GenerationConfig(
                method="specbranch",
                max_new_tokens=40,
                gamma=3,
                epsilon=1.0,
                hold=0.3,
                hold_branches=strict,
                head_start=1e-9,
            ),
        )
        assert r.token_ids == want
        assert any(isinstance(e, DraftProposed) and e.kind == "held" and e.branch == 1 for e in r.events) is strict
