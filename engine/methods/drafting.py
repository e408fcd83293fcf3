"""The draft's side of the parallel loop (parallel.py): one draft step extends the path by a token, or forks k
branches there, or extends every branch by one token in one k-row forward, or holds back; the draft drafts while the
target verifies (draft_until_verdict) and, where the block to verify is short, a little before (head_start).

Each draft row is read once (read_row): the best k of its untempered probabilities (what the policy decides by), and
the token its draw picks with the exact row it was drawn from (greedy: the argmax, a point mass, so no row is kept).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import torch

from engine.drafts.process import RemoteLM
from engine.events import BRANCH_DRAFT, DRAFT, DraftProposed, Event
from engine.methods import hrad
from engine.methods.decoding import DraftRow, RunState, forward, read_row
from engine.methods.policy import Policy, alternatives_share
from engine.methods.sampling import (
    ALTERNATIVES,
    NO_REPLACEMENT,
    TOPK,
    NextDraw,
    alternatives,
    read_top,
    to_host,
    without_replacement,
)
from engine.methods.speculation import Branch, Drafted, Fork, Speculation
from engine.models import cache as kv


@dataclass
class DraftState:
    cached: list[int]  # the tokens the draft cache holds: on the path; while forked, those every row holds (up to
    # the fork), row i then holding branch i's fed tokens (Branch.fed)
    forked: bool = False  # the cache holds a row per branch of the fork
    fresh: bool = True  # no draft step yet since the last verdict
    hrad_class: int | None = None
    hrad_features: torch.Tensor | None = None  # the target's state at the last verdict, read at the next draft step
    linear_steps: int = 0  # linear draft steps since the last verdict
    confidence: float = 1.0  # the draft's (untempered) confidence in the token it drafted last
    held: Drafted | None = None  # where it held back (Policy.held_back), at the position after `cached`: the row q
    # (token: what its draw would have picked), its largest untempered probability (top), the fork it could have
    # made (alts); it drafts no further until the target has produced that position's token, or a rejection drops it
    after_hold: bool = False  # the target produced the held position, and the draft has not stepped since: its next
    # step's decision is counted in holds_again
    holds_again: list[int] = field(default_factory=lambda: [1, 2])  # [first steps after a hold that held again,
    # first steps after a hold], with a prior of 1 in 2
    later: list = field(default_factory=list)  # host work a verdict left for after the next pass has started

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


@dataclass(slots=True)
class BranchRow:
    """One of a branch step's k draft rows, read once (read_rows)."""

    best: float  # its largest untempered probability
    token: int  # what its draw picks
    q: torch.Tensor | None  # [V]: the exact row the token was drawn from (None when greedy: a point mass)
    conf: float  # the untempered probability of the token
    q_x: float  # q(token)
    shown: list[list[float]]  # the UI's alternatives at the token ([[id, q], ...])


def read_rows(state: RunState, logits: torch.Tensor, draws: list[NextDraw]) -> list[BranchRow]:
    """logits [k, V] -> k BranchRows, in one host read (read_row's, for k rows at once)."""
    raw = logits.float().softmax(-1)  # [k, V], untempered
    if state.cfg.greedy:
        tops, ids = read_top(raw, 1)
        return [BranchRow(t, i, None, t, 1.0, [[i, 1.0]]) for (t,), (i,) in zip(tops, ids)]
    k = raw.shape[0]
    best = raw.amax(-1)  # [k]
    q = state.probs_beside(logits, raw)  # [k, V]
    token = torch.stack([draw.pick(row) for draw, row in zip(draws, q)])  # [k]
    at = torch.arange(k, device=q.device)
    shown = q.topk(min(ALTERNATIVES, q.shape[-1]), -1)  # [k, a]
    packed = [best, token, raw[at, token], q[at, token], shown.values.flatten(), shown.indices.flatten()]
    v = to_host(torch.cat([t.double() for t in packed]))  # [4k + 2ka]: each field's k values, then the alternatives
    a = shown.values.shape[-1]
    values, ids = v[4 * k : (4 + a) * k], v[(4 + a) * k :]  # [k * a] each
    return [
        BranchRow(v[i], int(v[k + i]), q[i], v[2 * k + i], v[3 * k + i],
                  alternatives(values[i * a : (i + 1) * a], ids[i * a : (i + 1) * a]))
        for i in range(k)
    ]  # fmt: skip


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
    seq = state.tokens + [d.token for d in spec.path]
    draw = state.next_draws(1)  # drawn before the row is seen: a fork or a hold below leaves it unused
    logits = await forward(
        state,
        state.pair.draft,
        state.draft_worker,
        state.draft_cache,
        seq[len(ds.cached) :],
        DRAFT,
        events,
        solo=solo,
        ahead=ahead_threads(state),
        draws=draw,
        sure=policy.sure_enough(spec) if isinstance(state.pair.draft, RemoteLM) else None,
    )
    ds.cached = seq
    row = read_row(state, logits[-1], draw[0], max(policy.max_branches, 1))
    if ds.hrad_features is not None:
        hrad_predict(state, ds, policy, row.top[0])
    # the fork the draft could make here: where its token is rejected, missed_rescue plays it for the rescue table
    alts = (
        (alternatives_share(row.top, len(row.top)), row.ids)
        if policy.max_branches > 1 and policy.reads_rescues
        else None
    )
    steps_left = 2 * state.cfg.gamma - len(spec.path) - 1
    k = policy.branch_width(row.top, ds.fresh, ds.hrad_class, ds.linear_steps, steps_left=steps_left)
    ds.fresh = False
    ds.linear_steps += 1
    if hold_here(state, spec, ds, policy, row, k, alts, len(seq), logits[-1], events):
        return
    if k > 1 and fork_here(state, spec, ds, policy, events, k, row, len(seq)):
        return
    ds.confidence = row.top[0]
    spec.path.append(Drafted(row.token, row.q, row.conf, row.top[0], alts))
    events.append(
        DraftProposed(
            step=state.step,
            tokens=[row.token],
            pieces=state.pieces([row.token]),
            q=[row.q_x],
            parent_position=len(seq),
            top=[row.shown],
        )
    )


def hold_here(
    state: RunState,
    spec: Speculation,
    ds: DraftState,
    policy: Policy,
    row: DraftRow,
    k: int,
    alts: tuple[float, list[int]] | None,
    position: int,
    logits: torch.Tensor,
    events: list[Event],
) -> bool:
    """Rollback-aware drafting on the path: where the odds that the pending path and what the draft would propose
    here (its own token, or a fork of k) hold up fall below the hold, keep nothing and leave the position to the
    target (DraftState.held); count what the first step after a hold decides (DraftState.follows)."""
    odds = policy.path_odds(spec) * policy.holds_up(row.top, k) if policy.hold > 0 else 1.0
    if ds.after_hold:
        ds.holds_again[0] += policy.held_back(odds)
        ds.holds_again[1] += 1
        ds.after_hold = False
    if not policy.held_back(odds):
        return False
    q = row.q if row.q is not None else state.probs(logits)  # the row the target's token there is measured against
    ds.held = Drafted(row.token, q, row.conf, row.top[0], alts)  # the token its draw would pick, not drafted
    events.append(held_event(state, position, row.top[0], odds))
    return True


def held_event(state: RunState, position: int, confidence: float, odds: float, branch: int = 0) -> DraftProposed:
    """A hold, as the UI and the store see it: no token at `position` (on the path; branch 1: the fork's branches)."""
    return DraftProposed(
        step=state.step,
        tokens=[],
        pieces=[],
        q=[],
        branch=branch,
        parent_position=position,
        kind="held",
        confidence=confidence,
        odds=odds,
    )


def fork_here(
    state: RunState,
    spec: Speculation,
    ds: DraftState,
    policy: Policy,
    events: list[Event],
    k: int,
    row: DraftRow,
    position: int,
) -> bool:
    """Fork k branches here from the draft's candidates; False where fewer than two distinct candidates came out, so
    the path goes on. Greedy: the draft's top k (point masses: the rule needs only p, so the untempered row serves);
    sampled: k draws from q without replacement, verified in the order drawn."""
    if state.cfg.greedy:  # the point masses: q(x) = 1 at the draft's token; the rule reads the untempered row
        chosen = [(t, v) for t, v in zip(row.ids[:k], row.top[:k]) if v > 0]
        scheme, q, cands, conf = TOPK, row.raw, [t for t, _ in chosen], [v for _, v in chosen]
        qx, shown = conf, [float(c == row.token) for c in cands]
    else:
        scheme, q = NO_REPLACEMENT, row.q
        drawn = without_replacement(q, state.uniforms(k))  # [k]: -1 past the support
        at = drawn.clamp(min=0)
        values = to_host(torch.cat([drawn.double(), row.raw[at].double(), q[at].double()]))
        cands = [int(t) for t in values[:k] if t >= 0]
        conf, qx = values[k : k + len(cands)], values[2 * k : 2 * k + len(cands)]
        shown = qx
    if len(cands) < 2:
        return False
    branches = [Branch(Drafted(c, q, p, row.top[0] if i == 0 else None)) for i, (c, p) in enumerate(zip(cands, conf))]
    share = alternatives_share(row.top, len(cands))
    spec.fork = Fork(
        q,
        scheme,
        branches,
        qx=qx,
        depth=len(spec.path),
        top=row.top[0],
        share=share,
        odds=policy.holds_up(row.top, len(cands)),
    )
    # the draft is as sure as the mass its candidates cover: a fork hedges an unsure token, so the draft-stop rule
    # must not end the round before the branches are drafted
    ds.confidence = sum(conf)
    events.append(
        DraftProposed(
            step=state.step,
            tokens=cands,
            pieces=state.pieces(cands),
            q=shown,
            parent_position=position,
            top=[row.shown],
            kind="candidates",
            confidence=row.top[0],
            odds=policy.acceptance(row.top[0]),
        )
    )
    return True


async def branch_step(
    state: RunState, spec: Speculation, ds: DraftState, policy: Policy, events: list[Event], solo: bool
) -> None:
    """Every branch of the fork one token further, in one k-row forward; or none, where the branches hold."""
    fork, cache = spec.fork, state.draft_cache
    k = len(fork.branches)
    if not ds.forked:  # first step after forking: one cache row per branch
        cache.batch_repeat_interleave(k)
        ds.forked = True
    last = [(b.tokens[-1] if b.tokens else b.candidate).token for b in fork.branches]
    draws = state.next_draws(k)
    logits = await forward(
        state,
        state.pair.draft,
        state.draft_worker,
        cache,
        last,
        BRANCH_DRAFT,
        events,
        solo=solo,
        ahead=ahead_threads(state),
        draws=draws,
        rows=True,
    )
    rows = read_rows(state, logits, draws)  # logits [k, V]
    ds.fresh = False
    if branches_hold(state, spec, ds, policy, rows[0].best, events):
        return
    ds.confidence = max(row.best for row in rows)  # the surest branch's
    for i, (branch, row) in enumerate(zip(fork.branches, rows)):
        branch.tokens.append(Drafted(row.token, row.q, row.conf))  # its cache row now holds the token before it
        events.append(
            DraftProposed(
                step=state.step,
                tokens=[row.token],
                pieces=state.pieces([row.token]),
                q=[row.q_x],
                branch=i + 1,
                parent_position=len(ds.cached) + len(branch.tokens),
                top=[row.shown],
                kind="branch",
            )
        )


def branches_hold(
    state: RunState, spec: Speculation, ds: DraftState, policy: Policy, top: float, events: list[Event]
) -> bool:
    """--hold-branches: the hold, as on the path. Where the first branch's line, with what this step would add (read,
    like a path token's, at the row's largest probability `top`, before any draw, so that q stays what a kept token
    is drawn from: a token redrawn until it looked likely would not be), would most likely be rolled back, keep none
    of this step: the rows stay where they were, and the fork holds until the verdict (Fork.held)."""
    odds = policy.line_odds(spec) * policy.acceptance(top) if policy.hold_branches else 1.0
    if not policy.held_back(odds):
        return False
    fed = len(ds.cached) + len(spec.fork.branches[0].tokens)  # what every row held before the step (Branch.fed)
    kv.rollback(state.draft_cache, fed)  # undo what the step fed
    spec.fork.held = True
    events.append(held_event(state, fed + 1, top, odds, branch=1))
    return True


def ahead_threads(state: RunState) -> int:
    """A draft in its own process takes its next step on the token each row's draw picks (state.next_draws: the
    argmax when greedy, the inverse CDF at a uniform drawn beforehand when sampling) while this one is read
    (process.step_ahead), on the worker's own threads: the target's next pass may start beside it, and a step on the
    solo threads would take a core from it."""
    return state.draft_worker.threads


def hrad_predict(state: RunState, ds: DraftState, policy: Policy, confidence: float) -> None:
    """At the first draft step after a verdict: let H-RAD choose how to draft from the target's state
    and the draft's confidence (and/or log both for training H-RAD)."""
    if policy.hrad is not None:
        ds.hrad_class = policy.hrad.predict(ds.hrad_features, confidence)
    if state.hrad_samples is not None:  # nothing is emitted between the verdict and this step
        state.hrad_samples.append((state.emitted - 1, ds.hrad_features, confidence))
    ds.hrad_features = None


def hrad_features(state: RunState, hidden, position: int) -> torch.Tensor:
    """The draft starts afresh: the target's state at the last verified position, for H-RAD."""
    target = state.pair.target
    with torch.inference_mode():
        emb = target.model.get_input_embeddings()(torch.tensor([state.tokens[-1]], device=target.device))[0]
    return hrad.features(hidden, position, emb)


async def draft_until_verdict(
    state: RunState, spec: Speculation, ds: DraftState, policy: Policy, target_job: asyncio.Future, events: list[Event]
) -> None:
    """Draft while the target verifies: at least one step, then on until the verdict lands, the speculation
    reaches the depth cap (2γ: one block of γ under verification, one block ahead of it, as in PEARL's
    post-verify mode; never beyond the tokens the run may still emit), or the draft's confidence in its last
    token falls below cfg.draft_stop (it would likely be rejected: drafting on wastes draft time, and
    verifying it wastes target time). With a hold, branches are drafted only while the first one's odds of holding
    up (Policy.line_odds) stay at least the hold: past it, a branch token would only be rolled back. With
    hold_branches, also a step that would take them below keeps nothing (branch_step)."""
    steps = 0
    cap = min(2 * state.cfg.gamma, state.remaining)  # never past the token budget, so never past the context
    landed = state.target_worker.landed  # on CUDA: the pass has run on the device, not merely been queued
    while not ds.holding(spec) and spec.depth() < cap and (steps == 0 or not landed(target_job)):
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
        and len(spec.line()) < cap
        and math.prod(policy.line_acceptance(spec)) >= state.cfg.head_start
    ):
        await draft_step(state, spec, ds, policy, events, solo=True)
