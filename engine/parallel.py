"""Parallel speculative decoding: PEARL and SpecBranch on one overlapped loop.

Each round two jobs run at the same time, each on its own worker thread:
  target  verifies the next block of the pending path: one forward over [unfed committed tokens,
          path[:γ]]
  draft   drafts on beyond everything pending until the verdict lands (at least one step; at most
          2γ deep; ending early after a token it is unsure of, --draft-stop): linearly, or, once the
          policy expects a rejection, as k branches from k candidates, all in one batched forward a step
When both are done, the verdict: commit the accepted prefix of the path, then resolve the next
draft node with the target's last row (a linear token by the ordinary rule, a branch point by the
multi-candidate rule), and roll back whatever no longer hangs off the committed tokens.

PEARL is this loop with no branches: an empty path is its pre-verify mode (the target scores the
first drafted token's position while the draft drafts), a non-empty path its post-verify mode.
SpecBranch branches where the policy says: at the first low-confidence token (q < ε), or where
H-RAD predicts a rejection; k adapts to the draft's confidence, up to --branches.
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import torch

from . import cache as kv
from . import hrad
from .decoding import RunState, crop_draft, emit, forward, share_features, step_loop
from .events import (ACCEPTED, BONUS, BRANCH_DRAFT, CORRECTION, DRAFT, RESCUED, VERIFY, BranchResolved, DraftProposed,
                     Event, Rollback, Verified)
from .sampling import NO_REPLACEMENT, TOPK, draw_candidates, sample, top_alternatives, verify_block, verify_candidates

REJECT_AT_ONCE, PARTLY, ALL_ACCEPTED = 0, 1, 2  # H-RAD classes


@dataclass
class Fork:
    """k candidates for one position, each followed by its own drafted branch."""
    q: torch.Tensor  # the draft row [V] the candidates were drawn from
    candidates: list[int]
    scheme: str
    branches: list[list[int]] = field(default_factory=list)
    branch_q: list[list[torch.Tensor]] = field(default_factory=list)


@dataclass
class Speculation:
    """What the draft has proposed beyond the committed tokens: a linear path, then maybe a fork."""
    path: list[int] = field(default_factory=list)
    path_q: list[torch.Tensor] = field(default_factory=list)
    fork: Fork | None = None

    def tokens(self) -> list[int]:
        extra = [] if self.fork is None else [t for c, b in zip(self.fork.candidates, self.fork.branches) for t in [c, *b]]
        return self.path + extra


@dataclass
class Policy:
    """Where to branch and how wide. max_branches = 1 gives PEARL."""
    max_branches: int = 1
    epsilon: float = 0.5  # branch at the first token whose draft confidence is below this
    hrad: object | None = None  # engine.hrad.HRAD, or None for confidence only
    fixed_at: int | None = None  # ablation: always branch after this many linear draft steps of a round

    def branch_width(self, confidence: float, fresh: bool, hrad_class: int | None, linear_steps: int = 0) -> int:
        """How many candidates to fork at this draft position (1 = no fork).
        `fresh`: the first draft step after a verdict, where H-RAD's prediction applies."""
        if self.max_branches <= 1:
            return 1
        if self.fixed_at is not None:
            return self.max_branches if linear_steps == self.fixed_at else 1
        if hrad_class == ALL_ACCEPTED:
            return 1
        if hrad_class == REJECT_AT_ONCE and fresh:
            return self.max_branches
        if confidence >= self.epsilon:
            return 1
        # the paper's k = k_max (1 - q(x_b)), at least 2 where we do branch
        return min(self.max_branches, max(2, math.ceil(self.max_branches * (1 - confidence))))


@dataclass
class DraftState:
    rows: list[list[int]]  # the tokens each row of the draft cache holds (k rows while forked)
    fresh: bool = True  # no draft step yet since the last verdict
    hrad_class: int | None = None
    linear_steps: int = 0  # linear draft steps since the last verdict
    confidence: float = 1.0  # the draft's (untempered) confidence in the token it drafted last


async def draft_step(state: RunState, spec: Speculation, ds: DraftState, policy: Policy, events: list[Event]) -> None:
    """One draft forward: extend the path by a token, or fork here, or extend every branch by one."""
    draft, cache = state.pair.draft, state.draft_cache
    if spec.fork is None:
        seq = state.tokens + spec.path
        feed = seq[len(ds.rows[0]):]
        logits = await forward(state, draft, state.draft_worker, cache, feed, DRAFT, events)
        ds.rows[0] = seq
        raw = logits[-1].float().softmax(-1)  # confidence is read from the untempered distribution
        q = state.probs(logits[-1])
        k = policy.branch_width(float(raw.max()), ds.fresh, ds.hrad_class, ds.linear_steps)
        ds.fresh = False
        ds.linear_steps += 1
        if k > 1:
            # greedy: the draft's top-k (point masses; the rule needs only p, so the untempered row serves);
            # sampled: k draws from q without replacement, verified in the order drawn
            scheme, row = (TOPK, raw) if state.cfg.greedy else (NO_REPLACEMENT, q)
            cands = draw_candidates(row, k, scheme, state.draft_generator)
            if len(cands) > 1:
                spec.fork = Fork(row, cands, scheme, [[] for _ in cands], [[] for _ in cands])
                events.append(DraftProposed(state.step, cands, state.pieces(cands), [float(q[c]) for c in cands],
                                            parent_position=len(seq), top=[top_alternatives(q)], kind="candidates"))
                return
        x = sample(q, state.draft_generator)
        ds.confidence = float(raw.max())
        spec.path.append(x)
        spec.path_q.append(q)
        events.append(DraftProposed(state.step, [x], state.pieces([x]), [float(q[x])],
                                    parent_position=len(seq), top=[top_alternatives(q)]))
        return
    fork = spec.fork
    k = len(fork.candidates)
    if len(ds.rows) == 1:  # first step after forking: one cache row per branch
        cache.batch_repeat_interleave(k)
        ds.rows = [list(ds.rows[0]) for _ in range(k)]
    last = [(b[-1] if b else c) for c, b in zip(fork.candidates, fork.branches)]
    x = torch.tensor(last, dtype=torch.long)[:, None]  # [k, 1]
    logits, span = await state.draft_worker.run(draft.forward, x, cache, kind=BRANCH_DRAFT, step=state.step,
                                                t0=state.t0, tokens=k)
    events.append(span)
    ds.confidence = float(logits[:, -1].float().softmax(-1).amax(-1).max())  # the surest branch's
    for i in range(k):
        ds.rows[i] = ds.rows[i] + [last[i]]
        q = state.probs(logits[i, -1])
        t = sample(q, state.draft_generator)
        fork.branches[i].append(t)
        fork.branch_q[i].append(q)
        events.append(DraftProposed(state.step, [t], state.pieces([t]), [float(q[t])], branch=i + 1,
                                    parent_position=len(ds.rows[i]), top=[top_alternatives(q)], kind="branch"))
    ds.fresh = False


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


async def verify_round(state: RunState, spec: Speculation, n_path: int, logits: torch.Tensor, hidden, feats,
                       ds: DraftState, policy: Policy, events: list[Event]) -> Speculation:
    """Apply the target's verdict on path[:n_path] and the node right after it; returns what stays speculative."""
    p_rows = state.probs(logits[-(n_path + 1):])  # rows for path[0..n_path) and the position after
    linear_next = len(spec.path) > n_path
    checked = spec.path[: n_path + 1] if linear_next else spec.path[:n_path]
    q_rows = torch.stack(spec.path_q[: len(checked)]) if checked else p_rows[:0]
    verdict = verify_block(checked, q_rows, p_rows[: len(checked)] if (linear_next or spec.fork) else p_rows,
                           state.generator, state.cfg.greedy)
    n = verdict.accepted
    events.append(Verified(state.step, len(checked), n, verdict.p, verdict.q, verdict.u,
                           -1 if verdict.next_token is None else verdict.next_token,
                           "" if verdict.next_token is None else (BONUS if verdict.bonus else CORRECTION),
                           verdict.next_p, tokens=list(checked), pieces=state.pieces(checked)))
    kinds = [ACCEPTED] * n
    if verdict.next_token is not None:  # a rejection, or a bonus with nothing drafted beyond the path
        dropped = spec.tokens()[n:]
        if dropped:
            events.append(Rollback(state.step, "draft", dropped, state.pieces(dropped),
                                   "rejected" if not verdict.bonus else "superseded"))
        events.append(emit(state, checked[:n] + [verdict.next_token],
                           kinds + [BONUS if verdict.bonus else CORRECTION]))
        collapse_draft(state, ds, 0)
        new = Speculation()
    elif linear_next:  # the whole path and the next drafted token were accepted: the rest stays pending
        events.append(emit(state, checked, kinds))
        new = Speculation(spec.path[n:], spec.path_q[n:], spec.fork)
    else:  # path accepted and a branch point follows: pick a branch with the multi-candidate rule
        fork = spec.fork
        cv = verify_candidates(p_rows[-1], fork.q, fork.candidates, fork.scheme, state.generator, state.cfg.greedy)
        position = len(state.tokens) + n
        rescued = cv.index is not None and cv.index > 0
        events.append(BranchResolved(
            state.step, position, fork.candidates, state.pieces(fork.candidates),
            [float(fork.q[c]) for c in fork.candidates], cv.p, cv.u, fork.scheme, [list(b) for b in fork.branches],
            [state.pieces(b) for b in fork.branches], -1 if cv.index is None else cv.index, cv.token, rescued))
        losers = [i for i in range(len(fork.candidates)) if i != cv.index]
        dropped = [t for i in losers for t in [fork.candidates[i], *fork.branches[i]]]
        if dropped:
            events.append(Rollback(state.step, "draft", dropped, state.pieces(dropped),
                                   "losing branches" if cv.index is not None else "all branches rejected"))
        kind = (RESCUED if rescued else ACCEPTED) if cv.index is not None else CORRECTION
        events.append(emit(state, checked + [cv.token], kinds + [kind]))
        if cv.index is None:
            collapse_draft(state, ds, 0)
            new = Speculation()
        else:
            collapse_draft(state, ds, cv.index)
            new = Speculation(fork.branches[cv.index], fork.branch_q[cv.index])
    # target: keep only the committed part of what it was fed; a head draft gets its features
    kept = common_prefix(state.target_seq, state.tokens)
    share_features(state, len(state.target_seq) - logits.shape[0], feats, kept)
    ds.hrad_class = None
    if hidden is not None and not new.path and new.fork is None and not state.finish_reason:
        hrad_features(state, hidden, kept - (len(state.target_seq) - logits.shape[0]) - 1, ds, policy)
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


def hrad_features(state: RunState, hidden, position: int, ds: DraftState, policy: Policy) -> None:
    """The draft starts afresh: read the target's state at the last verified position and let H-RAD
    choose how to draft (and/or log the features for training H-RAD)."""
    target = state.pair.target
    with torch.inference_mode():
        emb = target.model.get_input_embeddings()(torch.tensor([state.tokens[-1]], device=target.device))[0]
    feats = hrad.features(hidden, position, emb)
    if policy.hrad is not None:
        ds.hrad_class = policy.hrad.predict(feats)
    if state.hrad_samples is not None:
        state.hrad_samples.append((state.emitted - 1, feats))


def depth(spec: Speculation) -> int:
    """How far the speculation reaches beyond the committed tokens (a fork counts its candidate and branch)."""
    return len(spec.path) + (0 if spec.fork is None else 1 + max(map(len, spec.fork.branches)))


async def draft_until_verdict(state: RunState, spec: Speculation, ds: DraftState, policy: Policy,
                              target_job: asyncio.Future, events: list[Event]) -> None:
    """Draft while the target verifies: at least one step, then on until the verdict lands, the speculation
    reaches the depth cap (2γ: one block of γ under verification, one block ahead of it, as in PEARL's
    post-verify mode), or the draft's confidence in its last token falls below cfg.draft_stop (it would
    likely be rejected: drafting on wastes draft time, and verifying it wastes target time)."""
    steps = 0
    while depth(spec) < 2 * state.cfg.gamma and (steps == 0 or not target_job.done()):
        await draft_step(state, spec, ds, policy, events)
        steps += 1
        if ds.confidence < state.cfg.draft_stop:
            break


def parallel_decode(state: RunState, policy: Policy):
    """PEARL (policy.max_branches == 1) or SpecBranch: an async generator of events."""
    state.target_seq = list(state.tokens)  # after prefill both caches hold the prompt; the first token is unfed
    ds = DraftState(rows=[list(state.tokens)] if not state.head_draft else [[]])
    spec = Speculation()

    async def step(events):
        nonlocal spec
        # verify at most one block of γ (the rest waits for the next round), never past the token budget
        n_path = min(len(spec.path), state.cfg.gamma, max(state.remaining - 1, 0))
        feed = state.tokens[len(state.target_seq):] + spec.path[:n_path]
        need_hidden = policy.hrad is not None or state.hrad_samples is not None
        target_job = asyncio.ensure_future(forward(state, state.pair.target, state.target_worker, state.target_cache,
                                                   feed, VERIFY, events, hidden_states=need_hidden, features=True))
        state.target_seq = state.target_seq + feed
        try:  # the draft drafts ahead while the target verifies
            await draft_until_verdict(state, spec, ds, policy, target_job, events)
            out = await target_job
        except BaseException:
            target_job.cancel()
            raise
        spec = await verify_round(state, spec, n_path, out.logits, out.hidden_states, out.features, ds, policy, events)

    return step_loop(state, step)
