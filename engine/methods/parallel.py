"""Parallel speculative decoding: PEARL and SpecBranch on one overlapped loop.

Each round two jobs run at the same time, each on its own worker thread (with --head-start, where the block
to verify is shorter than γ, as after every rejection, the draft first leads alone while it is sure enough):
  target  verifies the next block of the pending speculation read along its first branch (line_of):
          one forward over [unfed committed tokens, (path + candidate 1 + its branch)[:γ]], cut where the
          draft's odds that all of it is accepted fall below --feed-stop (feed_limit)
  draft   drafts on beyond everything pending until the verdict lands (at least one step; at most
          2γ deep; ending early after a token it is unsure of, --draft-stop): linearly, or, once the
          policy expects a rejection, as k branches from k candidates, all in one batched forward a step
When both are done, the verdict (`resolve`): commit the accepted prefix of the path; at a branch point the
target's row picks a candidate by the multi-candidate rule (whose first step is the ordinary rule for
candidate 1, so feeding candidate 1's branch is exact); if candidate 1 survived, its fed branch is judged
in the same pass; the next drafted token is judged by the last row. Then roll back whatever no longer
hangs off the committed tokens.

PEARL is this loop with no branches: an empty path is its pre-verify mode (the target scores the
first drafted token's position while the draft drafts), a non-empty path its post-verify mode.
SpecBranch branches where the policy says: at the first token the target is unlikely to accept (q < ε, with
q the draft's confidence read as the acceptance this engine measured at that confidence, engine/methods/calibration.py;
--no-calibrate reads q as is, the paper's rule), or where H-RAD predicts a rejection; k adapts to q, up to
--branches; with measured costs (--branch-costs) only where the fork's expected saving exceeds what its k rows cost.
With --hold, SpecBranch is rollback-aware: it drafts nothing where the measured odds that it holds up (the pending
path's times its own token's, or a fork's) fall below the hold, and the target takes that position (Policy.held_back).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import torch

from engine.drafts.process import step_fn
from engine.events import (
    ACCEPTED,
    BONUS,
    BRANCH_DRAFT,
    CORRECTION,
    DRAFT,
    RESCUED,
    VERIFY,
    BranchResolved,
    DraftProposed,
    Event,
    Rollback,
    Verified,
)
from engine.methods import hrad
from engine.methods.calibration import AcceptanceCalibration
from engine.methods.decoding import RunState, crop_draft, emit, forward, share_features, step_loop
from engine.methods.sampling import (
    NO_REPLACEMENT,
    TOPK,
    candidate_q,
    check_block,
    check_candidates,
    draw_candidates,
    residual_distribution,
    settle,
    top_alternatives,
    verify_candidates,
)
from engine.models import cache as kv

REJECT_AT_ONCE, PARTLY, ALL_ACCEPTED = 0, 1, 2  # H-RAD classes


@dataclass
class Fork:
    """k candidates for one position, each followed by its own drafted branch."""

    q: torch.Tensor  # the draft row [V] the candidates were drawn from
    candidates: list[int]
    scheme: str
    depth: int = 0  # path tokens before the branch point when it was forked
    branches: list[list[int]] = field(default_factory=list)
    branch_q: list[list[torch.Tensor]] = field(default_factory=list)
    conf: list[float] = field(default_factory=list)  # the draft's untempered probability of each candidate
    branch_conf: list[list[float]] = field(default_factory=list)  # ... of each branch token
    top: float | None = None  # the draft's largest untempered probability at the branch point
    share: float | None = None  # alternatives_share at the branch point (what Policy.rescues learns from)
    odds: float = 1.0  # Policy.holds_up at the branch point: the odds that one of the candidates survives
    held: bool = False  # a branch step held back (draft_step): no branch is drafted further until the next verdict


@dataclass
class Speculation:
    """What the draft has proposed beyond the committed tokens: a linear path, then maybe a fork."""

    path: list[int] = field(default_factory=list)
    path_q: list[torch.Tensor] = field(default_factory=list)
    fork: Fork | None = None
    path_conf: list[float] = field(default_factory=list)  # the draft's untempered probability of each path token
    path_top: list[float | None] = field(default_factory=list)  # its largest untempered probability where each
    # was drafted (None: not known, for a branch that became the path)
    path_alts: list[tuple[float, list[int]] | None] = field(default_factory=list)  # where Policy.reads_rescues:
    # the fork the draft could have made at each path token, (alternatives_share, the draft's top k), so a
    # rejection there tells the rescue table whether a fork would have rescued it (missed_rescue; None: not known)

    def tokens(self) -> list[int]:
        extra = (
            [] if self.fork is None else [t for c, b in zip(self.fork.candidates, self.fork.branches) for t in [c, *b]]
        )
        return self.path + extra


@dataclass(frozen=True)
class BranchCosts:
    """Measured forward costs that decide whether a fork pays (Engine.branch_costs): draft_ms[k] is one draft
    step on k cache rows, target_busy_ms[k] one target step while the draft steps on k rows beside it (on a CPU
    the two share cores and memory bandwidth)."""

    draft_ms: dict[int, float]
    target_busy_ms: dict[int, float]

    def net_gain_ms(self, k: int, alternatives: float, steps: int) -> float:
        """Expected ms a fork of k candidates saves over drafting on along its first candidate, for `steps`
        branch steps. A rescue (odds `alternatives`: that candidate 2..k is the target's token) does not save a
        target pass: the target's correction is that token anyway, and the surviving branch was not verified.
        It saves the drafting of that branch's tokens, which become the next block (docs/specbranch.md (SpecBranch)):
        `steps` one-row steps. The fork costs each of those steps on k rows instead of 1, and what k rows do
        to the target step beside them. The draft's time counts in full: it drafts on until the verdict."""
        saved = alternatives * steps * self.draft_ms[1]
        extra_draft = steps * (self.draft_ms[k] - self.draft_ms[1])
        slowdown = max(0.0, self.target_busy_ms[k] - self.target_busy_ms[1])  # below 0 is the machine's noise
        return saved - extra_draft - slowdown


@dataclass
class Policy:
    """Where to branch and how wide. max_branches = 1 gives PEARL."""

    max_branches: int = 1
    epsilon: float = 0.5  # branch at the first token whose draft confidence is below this
    hrad: object | None = None  # engine.methods.hrad.HRAD, or None for confidence only
    fixed_at: int | None = None  # ablation: always branch after this many linear draft steps of a round
    costs: BranchCosts | None = None  # measured costs: fork only where it pays (None: the paper's k rule alone)
    calibration: AcceptanceCalibration | None = None  # measured acceptance by confidence (None: confidence as is)
    rescues: AcceptanceCalibration | None = None  # measured rescues by the alternatives' share (None: the share as is)
    hold: float = 0.0  # draft nothing where the odds that it holds up fall below this (held_back; 0 = off)
    hold_branches: bool = False  # ... and keep nothing of a branch step that would take the line below it (draft_step)

    def acceptance(self, confidence: float) -> float:
        """The odds that a token drafted at this confidence is accepted: measured, or the confidence itself."""
        return confidence if self.calibration is None else self.calibration.acceptance(confidence)

    def rescue_odds(self, top: list[float], k: int) -> float:
        """The odds that candidate 2..k of a fork is the target's token, where `top` are the draft's largest
        probabilities: that its own token is rejected, times the odds that they hold the target's token then:
        the share of the draft's remaining mass they cover (alternatives_share), read as measured (`rescues`)."""
        share = alternatives_share(top, k)
        return (1 - self.acceptance(top[0])) * (share if self.rescues is None else self.rescues.acceptance(share))

    def holds_up(self, top: list[float], k: int) -> float:
        """The odds that what the draft would propose here holds up: its own token (k = 1), or one of k candidates."""
        return self.acceptance(top[0]) + (self.rescue_odds(top, k) if k > 1 else 0.0)

    def path_odds(self, spec: Speculation) -> float:
        """The odds that every pending path token is accepted: what a token drafted after them needs to pay."""
        return math.prod(self.acceptance(c if t is None else t) for t, c in zip(spec.path_top, spec.path_conf))

    def line_odds(self, spec: Speculation) -> float:
        """The odds that the speculation along its first branch holds up to its last token: the path's, the fork's
        (one candidate survives) and the first branch's tokens' (read from their probabilities)."""
        odds = self.path_odds(spec)
        if spec.fork is not None:
            first = spec.fork.branch_conf[0] if spec.fork.branch_conf else []
            odds *= spec.fork.odds * math.prod(self.acceptance(c) for c in first)
        return odds

    def line_acceptance(self, spec: Speculation) -> list[float]:
        """The odds that each token of line_of(spec) is accepted, for the draft-length rules (the head start, the
        feed stop); 1.0 where nothing was recorded. Without measurements (PEARL, --no-calibrate): the draft's own
        probability of the token. With them: the acceptance measured at the draft's largest probability where the
        token was drafted (path_odds' reading; a branch token, whose position's largest probability is not kept,
        at its own). The two differ when sampling: the rule accepts a token drawn from q with probability
        sum(min(p, q)) whichever token it is, so a near-copy of the target is accepted almost always, also where it
        drew a token it gave 0.1, and only a measured table can say so (docs/methods.md)."""

        def read(tops, confs, n):
            tops = list(tops[:n]) + [None] * (n - len(tops))
            confs = list(confs[:n]) + [None] * (n - len(confs))
            if self.calibration is None:
                return [1.0 if c is None else c for c in confs]
            return [
                1.0 if t is None and c is None else self.acceptance(c if t is None else t) for t, c in zip(tops, confs)
            ]

        out = read(spec.path_top, spec.path_conf, len(spec.path))
        if spec.fork is not None:
            f = spec.fork
            branch_conf = f.branch_conf[0] if f.branch_conf else []
            out += read([f.top], f.conf[:1], 1) + read([], branch_conf, len(f.branches[0]))
        return out

    @property
    def reads_rescues(self) -> bool:
        """Whether a decision reads the rescue table (the hold's odds, the measured-cost rule): only then is it worth
        playing the forks the draft did not make (missed_rescue), which costs host time between the forwards."""
        return self.rescues is not None and (self.hold > 0 or self.costs is not None)

    def held_back(self, odds: float) -> bool:
        """Rollback-aware drafting: below `hold` odds (path_odds times holds_up), what the draft would propose here
        would only be rolled back, so it proposes nothing and leaves the position to the target's own next token."""
        return self.hold > 0 and odds < self.hold

    def branch_width(
        self, top: list[float], fresh: bool, hrad_class: int | None, linear_steps: int = 0, steps_left: int = 1
    ) -> int:
        """How many candidates to fork at this draft position (1 = no fork). `top`: the draft's largest
        (untempered) probabilities here, best first; `fresh`: the first draft step after a verdict, where
        H-RAD's prediction applies; `steps_left`: branch steps the depth cap leaves after this one."""
        if self.max_branches <= 1:
            return 1
        if self.fixed_at is not None:
            return self.max_branches if linear_steps == self.fixed_at else 1
        confidence = self.acceptance(top[0])
        if hrad_class == ALL_ACCEPTED:
            return 1
        if hrad_class == REJECT_AT_ONCE and fresh:
            k = self.max_branches
        elif confidence >= self.epsilon:
            return 1
        else:  # the paper's k = k_max (1 - q(x_b)), at least 2 where we do branch
            k = min(self.max_branches, max(2, math.ceil(self.max_branches * (1 - confidence))))
        if self.costs is None:
            return k
        gains = {w: self.costs.net_gain_ms(w, self.rescue_odds(top, w), steps_left) for w in range(2, k + 1)}
        best = max(gains, key=gains.get)
        return best if gains[best] > 0 else 1


def alternatives_share(top: list[float], k: int) -> float:
    """The share of the draft's mass beyond its own token that candidates 2..k cover (top: its largest
    probabilities, best first): its own odds that they hold the target's token where its own is rejected."""
    return min(1.0, sum(top[1:k]) / max(1 - top[0], 1e-9))


@dataclass
class DraftState:
    rows: list[list[int]]  # the tokens each row of the draft cache holds (k rows while forked)
    fresh: bool = True  # no draft step yet since the last verdict
    hrad_class: int | None = None
    hrad_features: torch.Tensor | None = None  # the target's state at the last verdict, read at the next draft step
    linear_steps: int = 0  # linear draft steps since the last verdict
    confidence: float = 1.0  # the draft's (untempered) confidence in the token it drafted last
    held: torch.Tensor | None = None  # the draft's row q where it held back (Policy.held_back), the position after
    # rows[0]: it drafts no further until the target has produced that position's token, or a rejection drops it
    held_top: float = 0.0  # ... and its largest untempered probability there
    held_alts: tuple[float, list[int]] | None = None  # ... and the fork it could have made there (path_alts)
    after_hold: bool = False  # the target produced the position the draft held back at, and the draft has not
    # stepped since: its next step's decision is counted in holds_again
    holds_again: list[int] = field(default_factory=lambda: [1, 2])  # [first steps after a hold that held again, first
    # steps after a hold], with a prior of 1 in 2

    def holding(self, spec: Speculation) -> bool:
        """The draft holds back: at the position after the path (held), or on the fork's branches (Fork.held)."""
        return self.held is not None or (spec.fork is not None and spec.fork.held)

    @property
    def follows(self) -> bool:
        """Right after a hold, where this run's draft has more often held again than drafted at its next step: the
        draft follows the target. The target's next pass starts at once, without a head start (head_start), which
        would most likely be a step that holds again while the target waits on it; the draft's next step runs
        beside the pass, which judges the token it drafts, if any (PEARL's pre-verify)."""
        return self.after_hold and 2 * self.holds_again[0] > self.holds_again[1]


async def draft_step(
    state: RunState, spec: Speculation, ds: DraftState, policy: Policy, events: list[Event], solo: bool = False
) -> None:
    """One draft forward: extend the path by a token, or fork here, or extend every branch by one.
    solo: the target waits on this step (the head start), so it may have the cores (Worker.run)."""
    if spec.fork is None:
        await path_step(state, spec, ds, policy, events, solo)
    else:
        await branch_step(state, spec, ds, policy, events, solo)


async def path_step(
    state: RunState, spec: Speculation, ds: DraftState, policy: Policy, events: list[Event], solo: bool
) -> None:
    """The draft's next token on the path; or, where the policy expects a rejection, a fork here (fork_here); or,
    where what it would draft would most likely be rolled back, nothing (a hold)."""
    draft, cache = state.pair.draft, state.draft_cache
    seq = state.tokens + spec.path
    feed = seq[len(ds.rows[0]) :]
    draw = state.next_draws(1)  # drawn before the row is seen: a fork or a hold below leaves it unused
    logits = await forward(
        state, draft, state.draft_worker, cache, feed, DRAFT, events, solo=solo, ahead=ahead_threads(state), draws=draw
    )
    ds.rows[0] = seq
    raw = logits[-1].float().softmax(-1)  # confidence is read from the untempered distribution
    q = state.probs(logits[-1])
    if ds.hrad_features is not None:
        hrad_predict(state, ds, policy, float(raw.max()))
    # the largest probabilities, best first (PEARL never forks: its confidence is all it needs)
    best = raw.topk(min(policy.max_branches, raw.shape[-1])) if policy.max_branches > 1 else None
    top = best.values.tolist() if best is not None else [float(raw.max())]
    # the fork the draft could make here: where its token is rejected, missed_rescue plays it for the rescue table
    alts = (
        (alternatives_share(top, len(top)), best.indices.tolist())
        if best is not None and policy.reads_rescues
        else None
    )
    k = policy.branch_width(
        top, ds.fresh, ds.hrad_class, ds.linear_steps, steps_left=2 * state.cfg.gamma - len(spec.path) - 1
    )
    ds.fresh = False
    ds.linear_steps += 1
    odds = policy.path_odds(spec) * policy.holds_up(top, k) if policy.hold > 0 else 1.0
    if ds.after_hold:
        ds.holds_again[0] += policy.held_back(odds)
        ds.holds_again[1] += 1
        ds.after_hold = False
    if policy.held_back(odds):
        ds.held, ds.held_top, ds.held_alts = q, top[0], alts
        events.append(
            DraftProposed(state.step, [], [], [], parent_position=len(seq), kind="held", confidence=top[0], odds=odds)
        )
        return
    if k > 1 and fork_here(state, spec, ds, policy, events, k, raw, q, top, len(seq)):
        return
    x = draw[0].token(q)
    ds.confidence = float(raw.max())
    spec.path.append(x)
    spec.path_q.append(q)
    spec.path_conf.append(float(raw[x]))
    spec.path_top.append(top[0])
    spec.path_alts.append(alts)
    events.append(
        DraftProposed(
            state.step, [x], state.pieces([x]), [float(q[x])], parent_position=len(seq), top=[top_alternatives(q)]
        )
    )


def fork_here(
    state: RunState,
    spec: Speculation,
    ds: DraftState,
    policy: Policy,
    events: list[Event],
    k: int,
    raw: torch.Tensor,
    q: torch.Tensor,
    top: list[float],
    position: int,
) -> bool:
    """Fork k branches here from the draft's candidates (raw: its untempered row [V], q: the row tokens are drawn
    from); False where fewer than two distinct candidates came out, so the path goes on."""
    # greedy: the draft's top-k (point masses; the rule needs only p, so the untempered row serves);
    # sampled: k draws from q without replacement, verified in the order drawn
    scheme, row = (TOPK, raw) if state.cfg.greedy else (NO_REPLACEMENT, q)
    cands = draw_candidates(row, k, scheme, state.draft_generator)
    if len(cands) < 2:
        return False
    spec.fork = Fork(
        row,
        cands,
        scheme,
        len(spec.path),
        [[] for _ in cands],
        [[] for _ in cands],
        [float(raw[c]) for c in cands],
        [[] for _ in cands],
        top[0],
        alternatives_share(top, len(cands)),
        policy.holds_up(top, len(cands)),
    )
    # the draft is as sure as the mass its candidates cover: a fork hedges an unsure token, so the draft-stop rule
    # must not end the round before the branches are drafted
    ds.confidence = float(raw[cands].sum())
    events.append(
        DraftProposed(
            state.step,
            cands,
            state.pieces(cands),
            [float(q[c]) for c in cands],
            parent_position=position,
            top=[top_alternatives(q)],
            kind="candidates",
            confidence=top[0],
            odds=policy.acceptance(top[0]),
        )
    )
    return True


async def branch_step(
    state: RunState, spec: Speculation, ds: DraftState, policy: Policy, events: list[Event], solo: bool
) -> None:
    """Every branch of the fork one token further, in one k-row forward; or none, where the branches hold."""
    draft, cache = state.pair.draft, state.draft_cache
    fork = spec.fork
    k = len(fork.candidates)
    if len(ds.rows) == 1:  # first step after forking: one cache row per branch
        cache.batch_repeat_interleave(k)
        ds.rows = [list(ds.rows[0]) for _ in range(k)]
    last = [(b[-1] if b else c) for c, b in zip(fork.candidates, fork.branches)]
    x = torch.tensor(last, dtype=torch.long)[:, None]  # [k, 1]
    draws = state.next_draws(k)
    logits, span = await state.draft_worker.run(
        step_fn(draft, ahead_threads(state), draws),
        x,
        cache,
        kind=BRANCH_DRAFT,
        step=state.step,
        t0=state.t0,
        tokens=k,
        solo=solo,
    )
    events.append(span)
    raw = logits[:, -1].float().softmax(-1)  # [k, V], untempered
    ds.fresh = False
    # --hold-branches: the hold, as on the path. Where the first branch's line, with what this step would add (read,
    # like a path token's, at the row's largest probability, before any draw, so that q stays what a kept token is
    # drawn from: a token redrawn until it looked likely would not be), would most likely be rolled back, keep none
    # of this step; the rows stay where they were (Fork.held)
    odds = policy.line_odds(spec) * policy.acceptance(float(raw[0].max())) if policy.hold_branches else 1.0
    if policy.held_back(odds):
        kv.rollback(cache, len(ds.rows[0]))  # undo what the step fed
        fork.held = True
        events.append(
            DraftProposed(
                state.step,
                [],
                [],
                [],
                branch=1,
                parent_position=len(ds.rows[0]) + 1,
                kind="held",
                confidence=float(raw[0].max()),
                odds=odds,
            )
        )
        return
    ds.confidence = float(raw.amax(-1).max())  # the surest branch's
    for i in range(k):
        ds.rows[i] = ds.rows[i] + [last[i]]
        q = state.probs(logits[i, -1])
        t = draws[i].token(q)
        fork.branches[i].append(t)
        fork.branch_q[i].append(q)
        fork.branch_conf[i].append(float(raw[i, t]))
        events.append(
            DraftProposed(
                state.step,
                [t],
                state.pieces([t]),
                [float(q[t])],
                branch=i + 1,
                parent_position=len(ds.rows[i]),
                top=[top_alternatives(q)],
                kind="branch",
            )
        )


def ahead_threads(state: RunState) -> int:
    """A draft in its own process takes its next step on the token each row's draw picks (state.next_draws: the argmax
    when greedy, the inverse CDF at a uniform drawn beforehand when sampling) while this one is read
    (draft_process.step_ahead), on the worker's own threads: the target's next pass may start beside it, and a step on
    the solo threads would take a core from it."""
    return state.draft_worker.threads


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def collapse_draft(state: RunState, ds: DraftState, row: int) -> None:
    """Keep one cache row (the surviving branch, or any when all speculation is dropped)."""
    if len(ds.rows) > 1:
        state.draft_cache.batch_select_indices(torch.tensor([row]))
        ds.rows = [ds.rows[row]]


def sync_draft(state: RunState, ds: DraftState, spec: Speculation) -> None:
    """Crop the draft cache to what still hangs off the committed tokens and the speculation.
    A pending fork means nothing before it was rejected: every row still holds its branch."""
    if spec.fork is not None:
        return
    crop_draft(state, common_prefix(ds.rows[0], state.tokens + spec.path))
    keep = kv.cache_length(state.draft_cache)
    ds.rows = [row[:keep] for row in ds.rows]


def line_of(spec: Speculation) -> list[int]:
    """The speculation read along its first branch: what the target is fed to verify. The first candidate
    is the draft's own choice at the branch point, so when it is right the round goes on past the fork
    as PEARL would, and when it is wrong another candidate may still be rescued from the same row."""
    if spec.fork is None:
        return spec.path
    return spec.path + [spec.fork.candidates[0]] + spec.fork.branches[0]


def feed_limit(acceptance: list[float], stop: float) -> int:
    """How many leading tokens of a line are worth feeding the target. Feeding token j only pays if tokens
    1..j are all accepted (then its row yields one more token); the odds of that are the product of their
    `acceptance` (Policy.line_acceptance). Below `stop`, a longer verify pass costs more than it is expected to
    return (on a CPU each extra token fed costs a share of a step; 0 feeds everything). Token j+1 is judged all the
    same, by row j."""
    odds, n = 1.0, 0
    for a in acceptance:
        odds *= a
        if odds < stop:
            break
        n += 1
    return n


def check_line(state: RunState, tokens: list[int], qs: list[torch.Tensor], rows: torch.Tensor, ends: bool):
    """Verify a linear run of draft tokens against the target rows that reach it (row i judges tokens[i]), on the
    rows' device: (the tokens judged, the pending verdict; resolve reads it). `ends`: nothing is drafted after the
    run, so one spare row draws the bonus token."""
    checked = tokens[: len(rows)]
    use = rows if ends and len(rows) > len(checked) else rows[: len(checked)]
    return checked, check_block(
        checked, torch.stack(qs[: len(checked)]) if checked else rows[:0], use, state.generator, state.cfg.greedy
    )


def record_line(state: RunState, checked: list[int], verdict, branch: int, events: list[Event]):
    """The Verified event of a verdict on a linear run (check_line); returns the verdict."""
    events.append(
        Verified(
            state.step,
            len(checked),
            verdict.accepted,
            verdict.p,
            verdict.q,
            verdict.u,
            -1 if verdict.next_token is None else verdict.next_token,
            "" if verdict.next_token is None else (BONUS if verdict.bonus else CORRECTION),
            verdict.next_p,
            branch=branch,
            tokens=list(checked),
            pieces=state.pieces(checked),
        )
    )
    return verdict


@dataclass
class Outcome:
    """What a verdict commits, what stays speculative, and what the draft loses."""

    tokens: list[int]
    kinds: list[str]
    pending: Speculation
    dropped: list[int] = field(default_factory=list)
    why: str = ""
    row: int = 0  # the draft cache row to keep: the surviving branch's, when a fork was resolved
    judged: list[tuple[float, bool]] = field(default_factory=list)  # (draft's top probability, accepted) per
    # drafted token the target judged where that probability is known: what AcceptanceCalibration learns from
    rescue: tuple[float, bool] | None = None  # (Fork.share, rescued) where a fork's first candidate was rejected,
    # or where a path token was rejected: whether a fork there would have rescued it (missed_rescue)


def judged_path(spec: Speculation, accepted: int, rejected: bool) -> list[tuple[float, bool]]:
    """(top probability, accepted) for each path token a verdict judged: the accepted ones, then the rejected one."""
    tops = spec.path_top[: accepted + rejected]
    return [(top, i < accepted) for i, top in enumerate(tops) if top is not None]


def missed_rescue(
    p: torch.Tensor,
    q: torch.Tensor,
    alts: tuple[float, list[int]] | None,
    first: int | None,
    greedy: bool,
    probe: torch.Generator,
) -> tuple[float, bool] | None:
    """At a position where the draft made no fork (alts: the fork it could have made, Speculation.path_alts; p, q:
    the target's and the draft's rows there): (the alternatives' share, whether that fork would have rescued the
    position), where its first candidate is rejected; None where it would have been accepted. `first`: the draft's
    own token there, rejected by the target; None where the draft held back and drew none. Greedy it is exact: the
    candidates are the draft's top k, and the rule accepts candidate j iff it is the target's token. Sampled it is
    one play of that fork on draws of its own (`probe`, never the output's): candidates 2..k drawn from q without
    the first, through the multi-candidate rule from the residual the first's rejection leaves, so its verdict has
    the rescue's exact probability. Either way the rescue table learns from every rejection, not only from forks."""
    if alts is None:
        return None
    share, top_k = alts
    if greedy or first is None:  # the whole fork: its first candidate may survive
        cands = top_k if greedy else draw_candidates(q, len(top_k), NO_REPLACEMENT, probe)
        cv = verify_candidates(p, q, cands, TOPK if greedy else NO_REPLACEMENT, probe, greedy)
        return None if cv.index == 0 else (share, cv.index is not None)
    rest = candidate_q(q, [first], NO_REPLACEMENT)  # the draft's token was rejected: the rest of the fork
    cv = verify_candidates(
        residual_distribution(p, q),
        rest,
        draw_candidates(rest, len(top_k) - 1, NO_REPLACEMENT, probe),
        NO_REPLACEMENT,
        probe,
        False,
    )
    return share, cv.index is not None


def resolve(state: RunState, spec: Speculation, rows: torch.Tensor, events: list[Event]) -> Outcome:
    """The verdict on the speculation. rows [n_fed + 1, V]: the target's rows for line_of(spec)[0..n_fed].
    Every verdict the rows can reach (the path's; the fork's, where the rows reach its branch point; the first
    branch's, where it was fed) is computed on the rows' device at once and read in one host transfer (settle); the
    fork's and the branch's count only where the path, and then the first candidate, hold up. They draw from the
    verification generator either way: fresh draws, independent of the ones that decide, so the rule stays exact."""
    path, fork = spec.path, spec.fork
    checked, path_check = check_line(state, path, spec.path_q, rows, fork is None)
    fork_check = branch_check = None
    if fork is not None and len(rows) > len(path):  # a target row reaches the branch point
        fork_check = check_candidates(
            rows[len(path)], fork.q, fork.candidates, fork.scheme, state.generator, state.cfg.greedy
        )
        if len(rows) > len(path) + 1:  # the target was fed the first branch
            branch_checked, branch_check = check_line(
                state, fork.branches[0], fork.branch_q[0], rows[len(path) + 1 :], True
            )
    verdict, cv, branch_verdict = settle(path_check, fork_check, branch_check)
    record_line(state, checked, verdict, 0, events)
    n = verdict.accepted
    if verdict.next_token is not None:  # a rejection on the path, or a bonus after it
        kind = BONUS if verdict.bonus else CORRECTION
        missed = (
            None
            if verdict.bonus or n >= len(spec.path_alts)
            else missed_rescue(
                rows[n], spec.path_q[n], spec.path_alts[n], path[n], state.cfg.greedy, state.probe_generator
            )
        )
        return Outcome(
            path[:n] + [verdict.next_token],
            [ACCEPTED] * n + [kind],
            Speculation(),
            spec.tokens()[n:],
            "superseded" if verdict.bonus else "rejected",
            judged=judged_path(spec, n, not verdict.bonus),
            rescue=missed,
        )
    judged = judged_path(spec, n, False)
    if cv is None:  # the path holds up; the rest waits for the next round
        return Outcome(
            path[:n],
            [ACCEPTED] * n,
            Speculation(
                path[n:], spec.path_q[n:], spec.fork, spec.path_conf[n:], spec.path_top[n:], spec.path_alts[n:]
            ),
            judged=judged,
        )
    rescued = cv.index is not None and cv.index > 0  # the path was accepted and a target row reaches the branch point
    if fork.top is not None:  # the first candidate is the draft's own token here, judged like a path token
        judged.append((fork.top, cv.index == 0))
    rescue = (fork.share, rescued) if fork.share is not None and cv.index != 0 else None
    events.append(
        BranchResolved(
            state.step,
            len(state.tokens) + n,
            fork.candidates,
            state.pieces(fork.candidates),
            [float(fork.q[c]) for c in fork.candidates],
            cv.p,
            cv.u,
            fork.scheme,
            [list(b) for b in fork.branches],
            [state.pieces(b) for b in fork.branches],
            -1 if cv.index is None else cv.index,
            cv.token,
            rescued,
            fork.depth,
        )
    )
    losers = [t for i, (c, b) in enumerate(zip(fork.candidates, fork.branches)) if i != cv.index for t in [c, *b]]
    tokens, kinds = (
        path + [cv.token],
        [ACCEPTED] * n + [(RESCUED if rescued else ACCEPTED) if cv.index is not None else CORRECTION],
    )
    if cv.index is None:
        return Outcome(tokens, kinds, Speculation(), losers, "all branches rejected", judged=judged, rescue=rescue)
    branch, branch_q = fork.branches[cv.index], fork.branch_q[cv.index]
    branch_conf = fork.branch_conf[cv.index] if fork.branch_conf else []
    why = "losing branches"
    if cv.index == 0 and branch_verdict is not None:  # the target was fed the first branch: its verdict counts
        verdict = record_line(state, branch_checked, branch_verdict, 1, events)
        m = verdict.accepted
        tokens, kinds = tokens + branch[:m], kinds + [ACCEPTED] * m
        if verdict.next_token is not None:
            losers += branch[m:]
            why = "rejected on the first branch, and the losing branches"
            return Outcome(
                tokens + [verdict.next_token],
                kinds + [BONUS if verdict.bonus else CORRECTION],
                Speculation(),
                losers,
                why,
                judged=judged,
            )
        branch, branch_q, branch_conf = branch[m:], branch_q[m:], branch_conf[m:]
    return Outcome(
        tokens,
        kinds,
        Speculation(branch, branch_q, None, branch_conf, [None] * len(branch), [None] * len(branch)),
        losers,
        why,
        cv.index,
        judged,
        rescue,
    )


async def verify_round(
    state: RunState,
    spec: Speculation,
    n_fed: int,
    logits: torch.Tensor,
    hidden,
    feats,
    ds: DraftState,
    policy: Policy,
    events: list[Event],
) -> Speculation:
    """Apply the target's verdict on line_of(spec)[:n_fed] and the node right after it; returns what stays
    speculative. Both caches are rolled back to what still hangs off the committed tokens."""
    rows = state.probs(logits[-(n_fed + 1) :])
    out = resolve(state, spec, rows, events)
    if policy.calibration is not None:
        for top, accepted in out.judged:
            policy.calibration.record(top, accepted)
    if policy.rescues is not None and out.rescue is not None:
        policy.rescues.record(*out.rescue)
    if ds.held is not None:
        release_hold(state, rows, out, ds, policy)
    if out.dropped:
        events.append(Rollback(state.step, "draft", out.dropped, state.pieces(out.dropped), out.why))
    if out.tokens:
        events.append(emit(state, out.tokens, out.kinds))
    new = out.pending
    if new.fork is None:
        collapse_draft(state, ds, out.row)
    else:  # the fork is still pending, behind fewer path tokens: its branches' odds are read afresh
        new.fork.held = False
    # target: keep only the committed part of what it was fed; a head draft gets its features
    kept = common_prefix(state.target_seq, state.tokens)
    share_features(state, len(state.target_seq) - logits.shape[0], feats, kept)
    ds.hrad_class, ds.hrad_features = None, None
    if hidden is not None and not new.path and new.fork is None and not state.finish_reason:
        ds.hrad_features = hrad_features(state, hidden, kept - (len(state.target_seq) - logits.shape[0]) - 1)
    removed = state.target_seq[kept:]
    kv.rollback(state.target_cache, kept)
    state.target_seq = state.target_seq[:kept]
    if removed:
        events.append(Rollback(state.step, "target", removed, state.pieces(removed), "unverified positions"))
    if state.finish_reason:
        return Speculation()
    sync_draft(state, ds, new)
    ds.fresh, ds.linear_steps = True, 0
    return new


def release_hold(state: RunState, rows: torch.Tensor, out: Outcome, ds: DraftState, policy: Policy) -> None:
    """After a verdict, before it is emitted, while the draft holds back at the position after its row 0. A
    rejection before that position makes the hold moot. Where the target produced its own token there (rows[i] is
    the target's row for position len(state.tokens) + i), the calibration learns the acceptance the held token
    would have had, sum(min(p, q)) (1 or 0 when greedy), and the rescue table whether a fork would have rescued it
    (missed_rescue), so both keep measuring where the draft no longer drafts; the draft drafts on after
    that token. Else the hold stays: the target's next pass produces that position."""
    at = len(ds.rows[0])
    if common_prefix(ds.rows[0], state.tokens + out.tokens + out.pending.path) < at:
        ds.held, ds.held_alts = None, None
    elif len(state.tokens) + len(out.tokens) > at:
        if policy.calibration is not None:
            policy.calibration.record(ds.held_top, float(torch.minimum(rows[at - len(state.tokens)], ds.held).sum()))
        missed = missed_rescue(
            rows[at - len(state.tokens)], ds.held, ds.held_alts, None, state.cfg.greedy, state.probe_generator
        )
        if policy.rescues is not None and missed is not None:
            policy.rescues.record(*missed)
        ds.held, ds.held_alts, ds.after_hold = None, None, True


def hrad_features(state: RunState, hidden, position: int) -> torch.Tensor:
    """The draft starts afresh: the target's state at the last verified position, for H-RAD."""
    target = state.pair.target
    with torch.inference_mode():
        emb = target.model.get_input_embeddings()(torch.tensor([state.tokens[-1]], device=target.device))[0]
    return hrad.features(hidden, position, emb)


def hrad_predict(state: RunState, ds: DraftState, policy: Policy, confidence: float) -> None:
    """At the first draft step after a verdict: let H-RAD choose how to draft from the target's state
    and the draft's confidence (and/or log both for training H-RAD)."""
    if policy.hrad is not None:
        ds.hrad_class = policy.hrad.predict(ds.hrad_features, confidence)
    if state.hrad_samples is not None:  # nothing is emitted between the verdict and this step
        state.hrad_samples.append((state.emitted - 1, ds.hrad_features, confidence))
    ds.hrad_features = None


def depth(spec: Speculation) -> int:
    """How far the speculation reaches beyond the committed tokens (a fork counts its candidate and branch)."""
    return len(spec.path) + (0 if spec.fork is None else 1 + max(map(len, spec.fork.branches)))


async def draft_until_verdict(
    state: RunState, spec: Speculation, ds: DraftState, policy: Policy, target_job: asyncio.Future, events: list[Event]
) -> None:
    """Draft while the target verifies: at least one step, then on until the verdict lands, the speculation
    reaches the depth cap (2γ: one block of γ under verification, one block ahead of it, as in PEARL's
    post-verify mode; never beyond the tokens the run may still emit), or the draft's confidence in its last
    token falls below cfg.draft_stop (it would likely be rejected: drafting on wastes draft time, and
    verifying it wastes target time). With a hold, branches are drafted only while the first one's odds of holding
    up (Policy.line_odds) stay at least the hold: past it, a branch token would only be rolled back. With
    hold_branches, also a step that would take them below keeps nothing (draft_step)."""
    steps = 0
    cap = min(2 * state.cfg.gamma, state.remaining)  # never past the token budget, so never past the context
    landed = state.target_worker.landed  # on CUDA: the pass has run on the device, not merely been queued
    while not ds.holding(spec) and depth(spec) < cap and (steps == 0 or not landed(target_job)):
        if spec.fork is not None and policy.hold > 0 and policy.held_back(policy.line_odds(spec)):
            break
        await draft_step(state, spec, ds, policy, events)
        steps += 1
        if ds.confidence < state.cfg.draft_stop:
            break


async def head_start(state: RunState, spec: Speculation, ds: DraftState, policy: Policy, events: list[Event]) -> None:
    """Before the target's pass, where the block it would verify is shorter than γ (after a rejection it is
    empty: PEARL's pre-verify, a pass that can return one token only), let the draft step first while the odds
    that the whole block is accepted (the product of Policy.line_acceptance) stay at least cfg.head_start. The
    target waits a draft step (a fraction of its own) for each token, and each token it then verifies returns a
    whole token when accepted. 0 = off. Nor where the draft follows the target (DraftState.follows)."""
    if state.cfg.head_start <= 0 or ds.follows:
        return
    cap = min(state.cfg.gamma, state.remaining - 1)
    while (
        not ds.holding(spec)
        and len(line_of(spec)) < cap
        and math.prod(policy.line_acceptance(spec)) >= state.cfg.head_start
    ):
        await draft_step(state, spec, ds, policy, events, solo=True)


def parallel_decode(state: RunState, policy: Policy):
    """PEARL (policy.max_branches == 1) or SpecBranch: an async generator of events."""
    state.target_seq = list(state.tokens)  # after prefill both caches hold the prompt; the first token is unfed
    ds = DraftState(rows=[list(state.tokens)] if not state.head_draft else [[]])
    spec = Speculation()

    async def step(events):
        nonlocal spec
        await head_start(state, spec, ds, policy, events)
        # verify at most one block of γ along the first branch (the rest waits for the next round), never
        # past the token budget, nor past where the draft's odds fall below cfg.feed_stop
        line = line_of(spec)
        n_fed = min(
            len(line),
            state.cfg.gamma,
            max(state.remaining - 1, 0),
            feed_limit(policy.line_acceptance(spec), state.cfg.feed_stop),
        )
        feed = state.tokens[len(state.target_seq) :] + line[:n_fed]
        need_hidden = policy.hrad is not None or state.hrad_samples is not None
        target_job = asyncio.ensure_future(
            forward(
                state,
                state.pair.target,
                state.target_worker,
                state.target_cache,
                feed,
                VERIFY,
                events,
                hidden_states=need_hidden,
                features=True,
            )
        )
        state.target_seq = state.target_seq + feed
        try:  # the draft drafts ahead while the target verifies
            await draft_until_verdict(state, spec, ds, policy, target_job, events)
            out = await target_job
        except BaseException:
            target_job.cancel()
            raise
        spec = await verify_round(state, spec, n_fed, out.logits, out.hidden_states, out.features, ds, policy, events)

    return step_loop(state, step)
