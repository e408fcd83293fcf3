"""Parallel speculative decoding: PEARL and SpecBranch on one overlapped loop.

Each round two jobs run at the same time, each on its own worker thread:
  target  one forward over what the round feeds it (speculation.Feed): the committed tokens it has not seen, the
          pending path as far as the draft's odds say it is worth it (--feed-stop) and γ allow, and where the whole
          path is fed and a fork hangs off it, the most likely tokens of every branch: the path and the branches as
          one token tree, each branch seeing the path and its own tokens (speculation.plan_branches)
  draft   drafts on beyond everything pending until the verdict lands (drafting.draft_until_verdict): linearly, or,
          once the policy expects a rejection, as k branches from k candidates, all in one batched forward a step;
          with --head-start, where the block to verify is shorter than γ, it first leads alone while it is sure
When both are done, the verdict (verdict.resolve): commit the accepted prefix of the path; at a branch point the
target's row picks a candidate by the multi-candidate rule; the surviving branch's fed tokens are judged by their own
rows in the same pass, so a rescue returns its candidate and the branch tokens after it (what the paper's SpecBranch,
which verifies the first branch only, leaves to the next pass); the first token of each line the pass did not reach
is judged by that line's last row. Then both caches keep what still hangs off the committed tokens: the target's the
verified line of the tree (KVBuffer.keep), the draft's the surviving branch.

PEARL is this loop with no branches (policy.Policy, max_branches = 1): an empty path is its pre-verify mode (the
target scores the first drafted token's position while the draft drafts), a non-empty path its post-verify mode.
"""

from __future__ import annotations

import asyncio

import torch

from engine.events import VERIFY, Event, Rollback
from engine.methods.decoding import RunState, crop_draft, emit, forward, share_features, step_loop
from engine.methods.drafting import DraftState, draft_until_verdict, head_start, hrad_features
from engine.methods.policy import Policy
from engine.methods.speculation import Feed, Fork, Speculation, feed_limit, plan_branches
from engine.methods.verdict import Outcome, greedy_rescue, missed_rescue, resolve
from engine.models import cache as kv


def parallel_decode(state: RunState, policy: Policy):
    """PEARL (policy.max_branches == 1) or SpecBranch: an async generator of events."""
    state.target_len = len(state.tokens)  # after prefill both caches hold the prompt; the first token is unfed
    ds = DraftState(cached=list(state.tokens) if not state.head_draft else [])
    spec = Speculation()

    async def step(events: list[Event]) -> None:
        nonlocal spec
        await head_start(state, spec, ds, policy, events)
        feed = plan_feed(state, spec, policy)
        target_job = asyncio.ensure_future(verify_pass(state, spec, feed, policy, events))
        try:  # the draft drafts ahead while the target verifies; the last verdict's sampled probes run first
            if ds.later:  # a task starts at the loop's next turn: yield once, so the target's pass is on its worker
                await asyncio.sleep(0)  # before the probes run (without probes the draft's step is handed over first)
            run_later(ds)
            await draft_until_verdict(state, spec, ds, policy, target_job, events)
            out = await target_job
        except BaseException:
            target_job.cancel()
            raise
        spec = verify_round(state, spec, feed, out, ds, policy, events)

    return step_loop(state, step)


def plan_feed(state: RunState, spec: Speculation, policy: Policy) -> Feed:
    """What the target verifies this round: at most γ drafted tokens (never past the token budget) of the path,
    cut where the draft's odds that all of it is accepted fall below cfg.feed_stop; where the whole path fits and a
    fork hangs off it, the most likely tokens of its branches, where the target verifies a tree: in the room left
    under γ, plus cfg.tree_tokens (a pass over a few more tokens costs little more than one over γ)."""
    room = min(state.cfg.gamma, max(state.remaining - 1, 0))
    odds = [policy.token_odds(d) for d in spec.path]
    n = min(len(spec.path), room, feed_limit(odds, state.cfg.feed_stop))
    committed = tuple(state.tokens[state.target_len :])
    # branch tokens sit past the path: never beyond the token budget, where an accepted one could not be kept
    branch_room = min(room - n + state.cfg.tree_tokens, max(state.remaining - 1, 0) - n)
    if spec.fork is None or n < len(spec.path) or branch_room <= 0:
        return Feed(committed, n)
    line = 1.0
    for a in odds:
        line *= a
    branch_odds = policy.branch_odds(spec)
    if not state.pair.target.trees:  # a target without trees verifies the first branch's line only
        branch_odds = branch_odds[:1]
    return Feed(committed, n, plan_branches(line, branch_odds, branch_room, state.cfg.feed_stop))


async def verify_pass(state: RunState, spec: Speculation, feed: Feed, policy: Policy, events: list[Event]):
    """The target's forward over the feed (a token tree where branches are fed): Out(logits [T, V], hidden states
    where H-RAD reads them, features for a head draft)."""
    need_hidden = policy.hrad is not None or state.hrad_samples is not None
    return await forward(
        state, state.pair.target, state.target_worker, state.target_cache, feed.ids(spec), VERIFY, events,
        hidden_states=need_hidden, features=True, tree=feed.tree(),
    )  # fmt: skip


def verify_round(
    state: RunState, spec: Speculation, feed: Feed, out, ds: DraftState, policy: Policy, events: list[Event]
) -> Speculation:
    """Apply the target's verdict on the fed speculation; returns what stays speculative. Both caches keep what
    still hangs off the committed tokens."""
    start, fed = state.target_len, feed.ids(spec)
    result = resolve(state, spec, feed, out.logits, events)
    learn(policy, result, ds)
    if ds.held is not None:
        release_hold(state, out.logits, feed, result, ds, policy)
    if result.dropped:
        events.append(Rollback(state.step, "draft", result.dropped, state.pieces(result.dropped), result.why))
    if result.tokens:
        events.append(emit(state, result.tokens, result.kinds))
    new = result.pending
    if new.fork is None:
        collapse_draft(state, ds, spec.fork, result.branch or 0)
    else:  # the fork is still pending, behind fewer path tokens: its branches' odds are read afresh
        new.fork.held = False
    keep_verified(state, fed, start, result, out, events)
    ds.hrad_class, ds.hrad_features = None, None
    if out.hidden_states is not None and not new.path and new.fork is None and not state.finish_reason:
        ds.hrad_features = hrad_features(state, out.hidden_states, result.kept[-1])
    if state.finish_reason:
        run_later(ds)
        return Speculation()
    sync_draft(state, ds, new)
    ds.fresh, ds.linear_steps = True, 0
    return new


def learn(policy: Policy, result: Outcome, ds: DraftState) -> None:
    """The measured tables learn from the verdict: the acceptance by confidence, and the rescues (a sampled
    missed_rescue's play once the next target pass has started: run_later)."""
    if policy.calibration is not None:
        for top, accepted in result.judged:
            policy.calibration.record(top, accepted)
    if policy.rescues is not None and result.rescue is not None:
        policy.rescues.record(*result.rescue)
    if policy.rescues is not None and result.probe is not None:
        probe = result.probe
        ds.later.append(lambda: record(policy.rescues, probe()))


def record(table, verdict: tuple[float, bool] | None) -> None:
    if verdict is not None:
        table.record(*verdict)


def run_later(ds: DraftState) -> None:
    """What the last verdict left for later (DraftState.later): host work off the critical path, beside the pass."""
    for job in ds.later:
        job()
    ds.later.clear()


def keep_verified(state: RunState, fed: list[int], start: int, result: Outcome, out, events: list[Event]) -> None:
    """The target's cache keeps the fed tokens (`fed`, from position `start`) the verdict committed, a line of the
    tree; a head draft gets their features. The rest of what it was fed is rolled back."""
    kept = result.kept
    kv.keep_rows(state.target_cache, start, kept)
    if out.features is not None:
        share_features(state, start, out.features[kept], start + len(kept))
    state.target_len += len(kept)
    dropped = set(kept)
    removed = [t for i, t in enumerate(fed) if i not in dropped]
    if removed:
        events.append(Rollback(state.step, "target", removed, state.pieces(removed), "unverified positions"))


def release_hold(state: RunState, logits: torch.Tensor, feed: Feed, result: Outcome, ds: DraftState, policy: Policy):
    """After a verdict, before it is emitted, while the draft holds back at the position after its row 0. A
    rejection before that position makes the hold moot. Where the target produced its own token there, the
    calibration learns the acceptance the held token would have had, sum(min(p, q)) (1 or 0 when greedy), and the
    rescue table whether a fork would have rescued it (missed_rescue), so both keep measuring where the draft no
    longer drafts; the draft drafts on after that token. Else the hold stays: the target's next pass produces that
    position. The target's row for it is the row of the committed token before it, all of which were on the path."""
    at = len(ds.cached)
    line = state.tokens + result.tokens + [d.token for d in result.pending.path]
    if common_prefix(ds.cached, line) < at:
        ds.held = None
    elif len(state.tokens) + len(result.tokens) > at:
        held, i = ds.held, at - len(state.tokens)
        if state.cfg.greedy:  # the target's token there is known: q is a point mass at the draft's argmax
            target = result.tokens[i]
            missed = None if held.alts is None else greedy_rescue(held.alts, target)
            learn_held(policy, held.top, float(held.token == target), missed)
        else:
            row = logits[feed.path_rows()[i]]

            def later():
                p = state.probs(row)
                missed = missed_rescue(p, held.q, held.alts, None, False, state.probe_generator)
                learn_held(policy, held.top, float(torch.minimum(p, held.q).sum()), missed)

            ds.later.append(later)
        ds.held, ds.after_hold = None, True


def learn_held(policy: Policy, top: float, acceptance: float, missed: tuple[float, bool] | None) -> None:
    """A held position the target produced: the acceptance the held token would have had, and the missed rescue."""
    if policy.calibration is not None:
        policy.calibration.record(top, acceptance)
    if policy.rescues is not None:
        record(policy.rescues, missed)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def collapse_draft(state: RunState, ds: DraftState, fork: Fork | None, row: int) -> None:
    """Keep one cache row of a forked draft (the surviving branch's, or any when all speculation is dropped)."""
    if ds.forked:
        kv.select_row(state.draft_cache, row)
        ds.cached, ds.forked = ds.cached + fork.branches[row].fed(), False


def sync_draft(state: RunState, ds: DraftState, spec: Speculation) -> None:
    """Crop the draft cache to what still hangs off the committed tokens and the speculation.
    A pending fork means nothing before it was rejected: every row still holds its branch."""
    if spec.fork is not None:
        return
    crop_draft(state, common_prefix(ds.cached, state.tokens + [d.token for d in spec.path]))
    del ds.cached[kv.cache_length(state.draft_cache) :]
