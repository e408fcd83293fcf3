"""The target's verdict on a speculation, from one pass's rows (speculation.Feed says which row judges which token):
the path's, then at a branch point the multi-candidate rule's, then the surviving branch's, each with the exact rules
of sampling.py.

Sampled, on a GPU every verdict the rows can reach is computed before any is read: the path's; the fork's, where the
whole path was fed; each fed branch's. They count only where what precedes them holds up, and each draws from the
verification generator either way: fresh draws, independent of the ones that decide, so the rules stay exact. They are
computed on the rows' device and read in one host transfer (sampling.settle). On a CPU, where a read costs nothing
and each verdict a few passes over vocabulary-wide rows, they are computed in turn and only where they count: the
fork's where the path holds up, then the surviving branch's alone (judge_in_turn).

Greedy, every rule reduces to comparing a token with the target's argmax of its row (a one-hot p accepts x iff
p(x) = 1; the residual of two different one-hot rows is p; the candidates are the draft's top k, each a point mass),
so the whole verdict is one argmax over the pass's rows and one read of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.events import ACCEPTED, BONUS, CORRECTION, RESCUED, BranchResolved, Event, Verified
from engine.methods.decoding import RunState
from engine.methods.sampling import (
    NO_REPLACEMENT,
    CandidateVerdict,
    Verdict,
    candidate_q,
    check_block,
    check_candidates,
    draw_candidates,
    greedy_block,
    read_argmax,
    residual_distribution,
    settle,
    verify_candidates,
)
from engine.methods.speculation import Drafted, Feed, Fork, Speculation


@dataclass
class Outcome:
    """What a verdict commits, what stays speculative, and what the draft loses."""

    tokens: list[int]
    kinds: list[str]
    pending: Speculation
    kept: list[int]  # the fed tokens (indices in the pass) the target's cache keeps: Feed.kept
    dropped: list[int] = field(default_factory=list)
    why: str = ""
    branch: int | None = None  # the fork's surviving branch (the draft cache row to keep), None: no fork resolved
    judged: list[tuple[float, bool]] = field(default_factory=list)  # (draft's top probability, accepted) per
    # drafted token judged where that probability is known: what AcceptanceCalibration learns from
    rescue: tuple[float, bool] | None = None  # (Fork.share, rescued) where a fork's first candidate was rejected,
    # or where a path token was rejected: whether a fork there would have rescued it (missed_rescue)
    probe: Callable[[], tuple[float, bool] | None] | None = None  # sampled: that fork's play (missed_rescue), left
    # for after the next target pass has started (parallel.learn): its draws and reads are not on the critical path


@dataclass
class Judgements:
    """Every verdict one pass's rows reach, before any is applied."""

    path: Verdict
    fork: CandidateVerdict | None = None  # where the whole path was fed and a fork hangs off it
    branches: list[Verdict | None] = field(default_factory=list)  # per branch, where it was fed (judge_in_turn:
    # the surviving branch's only)


def judge(
    state: RunState, spec: Speculation, feed: Feed, logits: torch.Tensor, in_turn: bool | None = None
) -> Judgements:
    """The verdicts of the pass's rows (logits [T, V], T = feed.size) on the speculation. Sampled: in turn
    (judge_in_turn) or at once; None: in turn where the rows are on a CPU."""
    fork_row = spec.fork is not None and feed.path == len(spec.path)
    fed = range(len(feed.branches)) if fork_row else range(0)
    if state.cfg.greedy:
        best = read_argmax(logits)  # [T]: the one read of a greedy verdict
        path = greedy_block([d.token for d in spec.path], [best[r] for r in feed.path_rows()], spec.fork is None)
        fork = greedy_fork(spec.fork, best[feed.fork_row()]) if fork_row else None
        branches = [branch_verdict(spec.fork.branches[i], feed, i, best) for i in fed]
        return Judgements(path, fork, branches)
    if in_turn is None:
        in_turn = logits.device.type == "cpu"
    if in_turn:
        return judge_in_turn(state, spec, feed, logits, fork_row)
    base = feed.path_rows().start  # the committed tokens' rows before it judge nothing
    rows = state.probs(logits[base:])  # [T - base, V]: the target's distributions, as sampling reads them
    pending = [line_check(state, spec.path, rows[: feed.path + 1], spec.fork is None)]
    if fork_row:
        f = spec.fork
        at = feed.fork_row() - base
        pending.append(check_candidates(rows[at], f.q, f.candidates, f.scheme, state.generator, False))
        for i in fed:
            r = feed.branch_rows(i)
            lo, hi = r.start - base, r.stop - base
            pending.append(line_check(state, f.branches[i].tokens, rows[lo:hi], True) if len(r) else None)
    path, *rest = settle(*pending)
    return Judgements(path, rest[0] if rest else None, rest[1:])


def judge_in_turn(state: RunState, spec: Speculation, feed: Feed, logits: torch.Tensor, fork_row: bool) -> Judgements:
    """judge's sampled verdicts one after another, each read at once: the path's; the fork's only where the path holds
    up (fork_row: the whole path was fed, its last row judges the candidates); the surviving branch's only, where it
    was fed. Each draws afresh, so the rules stay exact; the verdicts that would not count are never computed. Why:
    on a CPU each verdict costs softmaxes, a residual and a float64 CDF over the vocabulary, and SpecBranch's judging
    at T=1 took 1.9 ms a step against PEARL's 0.9 (docs/results/README.md)."""
    base = feed.path_rows().start  # the committed tokens' rows before it judge nothing
    rows = state.probs(logits[base : base + feed.path + 1])  # [path + 1, V]: the path's rows, the fork's last
    path = settle(line_check(state, spec.path, rows, spec.fork is None))[0]
    if not fork_row or path.next_token is not None:
        return Judgements(path)
    f = spec.fork
    fork = settle(check_candidates(rows[feed.path], f.q, f.candidates, f.scheme, state.generator, False))[0]
    branches: list[Verdict | None] = [None] * len(feed.branches)
    i = fork.index
    if i is not None and i < len(feed.branches) and feed.branches[i]:
        r = feed.branch_rows(i)
        branches[i] = settle(line_check(state, f.branches[i].tokens, state.probs(logits[r.start : r.stop]), True))[0]
    return Judgements(path, fork, branches)


def greedy_fork(fork: Fork, best: int) -> CandidateVerdict:
    """The multi-candidate rule at T=0: the candidate that is the target's argmax survives; none: the argmax."""
    index = next((i for i, c in enumerate(fork.candidates) if c == best), None)
    tried = len(fork.candidates) if index is None else index + 1
    p = [float(c == best) for c in fork.candidates]
    return CandidateVerdict(index, best, 1.0, p, [-1.0] * tried)


def branch_verdict(branch, feed: Feed, i: int, best: list[int]) -> Verdict | None:
    rows = feed.branch_rows(i)
    return greedy_block([d.token for d in branch.tokens], [best[r] for r in rows], True) if len(rows) else None


def line_check(state: RunState, tokens: list[Drafted], rows: torch.Tensor, ends: bool):
    """A linear run of drafted tokens against the rows that reach it (row i judges tokens[i]), left pending on the
    rows' device. `ends`: nothing is drafted after the run, so one spare row draws the bonus token."""
    checked = tokens[: len(rows)]
    use = rows if ends and len(rows) > len(checked) else rows[: len(checked)]
    qs = torch.stack([d.q for d in checked]) if checked else rows[:0]
    return check_block([d.token for d in checked], qs, use, state.generator, False)


def resolve(state: RunState, spec: Speculation, feed: Feed, logits: torch.Tensor, events: list[Event]) -> Outcome:
    """The verdict on the speculation: the path's, then, where the path holds up and the rows reach it, the fork's
    and its surviving branch's."""
    j = judge(state, spec, feed, logits)
    record_line(state, [d.token for d in spec.path[: len(feed.path_rows())]], j.path, 0, events)
    n = j.path.accepted
    if j.path.next_token is not None:  # a rejection on the path, or a bonus after it
        return path_ends(state, spec, feed, logits, j.path)
    judged = judged_path(spec.path, n, False)
    if j.fork is None:  # the path holds up; the rest waits for the next round
        rest = Speculation(spec.path[n:], spec.fork)
        return Outcome([d.token for d in spec.path[:n]], [ACCEPTED] * n, rest, feed.kept(n), judged=judged)
    return fork_resolved(state, spec, feed, j, judged, events)


def path_ends(state: RunState, spec: Speculation, feed: Feed, logits: torch.Tensor, v: Verdict) -> Outcome:
    """A verdict that ends on the path: a rejection there (everything after it is rolled back), or a bonus token."""
    n, path = v.accepted, spec.path
    missed = probe = None
    if not v.bonus and n < len(path) and path[n].alts is not None:
        if state.cfg.greedy:  # exact: was the target's token (the correction) among the draft's 2nd to kth?
            missed = greedy_rescue(path[n].alts, v.next_token)
        else:
            row, d = logits[feed.path_rows()[n]], path[n]

            def probe():
                p = state.probs(row)
                return missed_rescue(p, d.q, d.alts, d.token, False, state.probe_generator)

    return Outcome(
        [d.token for d in path[:n]] + [v.next_token],
        [ACCEPTED] * n + [BONUS if v.bonus else CORRECTION],
        Speculation(),
        feed.kept(n),
        spec.tokens()[n:],
        "superseded" if v.bonus else "rejected",
        judged=judged_path(path, n, not v.bonus),
        rescue=missed,
        probe=probe,
    )


def fork_resolved(
    state: RunState, spec: Speculation, feed: Feed, j: Judgements, judged: list, events: list[Event]
) -> Outcome:
    """The path held up and the target's row reached the branch point: the candidate the rule picks survives (or
    none: the token drawn from the last residual), then its branch's fed tokens are judged by their own rows."""
    fork, cv, n = spec.fork, j.fork, len(spec.path)
    if fork.top is not None:  # the first candidate is the draft's own token here, judged like a path token
        judged.append((fork.top, cv.index == 0))
    rescue = (fork.share, cv.index is not None and cv.index > 0) if fork.share is not None and cv.index != 0 else None
    events.append(branch_resolved(state, fork, cv, len(state.tokens) + n))
    tokens = [d.token for d in spec.path] + [cv.token]
    kinds = [ACCEPTED] * n + [CORRECTION if cv.index is None else RESCUED if cv.index else ACCEPTED]
    losers = [
        t
        for i, b in enumerate(fork.branches)
        if i != cv.index
        for t in [b.candidate.token, *(d.token for d in b.tokens)]
    ]
    if cv.index is None:
        return Outcome(
            tokens, kinds, Speculation(), feed.kept(n), losers, "all branches rejected", None, judged, rescue
        )
    branch = fork.branches[cv.index]
    bv = j.branches[cv.index] if cv.index < len(j.branches) else None
    if bv is None:  # its branch was not fed: it is the next block
        pending = Speculation(branch.tokens)
        return Outcome(
            tokens, kinds, pending, feed.kept(n, cv.index), losers, "losing branches", cv.index, judged, rescue
        )
    judged_tokens = branch.tokens[: len(feed.branch_rows(cv.index))]
    record_line(state, [d.token for d in judged_tokens], bv, cv.index + 1, events)
    m = bv.accepted
    tokens, kinds = tokens + [d.token for d in branch.tokens[:m]], kinds + [ACCEPTED] * m
    kept = feed.kept(n, cv.index, m)
    if bv.next_token is None:  # the judged part holds up: the rest of the branch is the next block
        return Outcome(
            tokens, kinds, Speculation(branch.tokens[m:]), kept, losers, "losing branches", cv.index, judged, rescue
        )
    why = "losing branches" if bv.bonus else "rejected on the surviving branch, and the losing branches"
    kinds.append(BONUS if bv.bonus else CORRECTION)
    dropped = losers + [d.token for d in branch.tokens[m:]]
    return Outcome(tokens + [bv.next_token], kinds, Speculation(), kept, dropped, why, cv.index, judged, rescue)


def branch_resolved(state: RunState, fork: Fork, cv: CandidateVerdict, position: int) -> BranchResolved:
    """The BranchResolved event of a fork's verdict."""
    lines = [[d.token for d in b.tokens] for b in fork.branches]
    return BranchResolved(
        step=state.step,
        position=position,
        candidates=fork.candidates,
        pieces=state.pieces(fork.candidates),
        q=fork.qx or [b.candidate.conf for b in fork.branches],
        p=cv.p,
        u=cv.u,
        scheme=fork.scheme,
        branches=lines,
        branch_pieces=[state.pieces(b) for b in lines],
        survivor=-1 if cv.index is None else cv.index,
        token=cv.token,
        rescued=cv.index is not None and cv.index > 0,
        depth=fork.depth,
    )


def record_line(state: RunState, checked: list[int], v: Verdict, branch: int, events: list[Event]) -> None:
    """The Verified event of a verdict on a linear run (branch: 0 for the path, i + 1 for the fork's branch i):
    `checked`, the tokens the pass's rows judged (those after a rejection count as judged, never as tried)."""
    events.append(
        Verified(
            step=state.step,
            drafted=len(checked),
            accepted=v.accepted,
            p=v.p,
            q=v.q,
            u=v.u,
            next_token=-1 if v.next_token is None else v.next_token,
            next_kind="" if v.next_token is None else (BONUS if v.bonus else CORRECTION),
            next_p=v.next_p,
            branch=branch,
            tokens=list(checked),
            pieces=state.pieces(checked),
        )
    )


def judged_path(path: list[Drafted], accepted: int, rejected: bool) -> list[tuple[float, bool]]:
    """(top probability, accepted) for each path token a verdict judged: the accepted ones, then the rejected one."""
    return [(d.top, i < accepted) for i, d in enumerate(path[: accepted + rejected]) if d.top is not None]


def greedy_rescue(alts: tuple[float, list[int]], target: int) -> tuple[float, bool] | None:
    """missed_rescue at T=0 where the target's token is known: None where the draft's own token was the target's,
    else (the alternatives' share, whether the target's token was among the draft's 2nd to kth)."""
    share, top_k = alts
    return None if top_k[0] == target else (share, target in top_k[1:])


def missed_rescue(
    p: torch.Tensor,
    q: torch.Tensor | None,
    alts: tuple[float, list[int]] | None,
    first: int | None,
    greedy: bool,
    probe: torch.Generator,
) -> tuple[float, bool] | None:
    """At a position where the draft made no fork (alts: the fork it could have made, Drafted.alts; p, q: the
    target's and the draft's rows there): (the alternatives' share, whether that fork would have rescued the
    position), where its first candidate is rejected; None where it would have been accepted. `first`: the draft's
    own token there, rejected by the target; None where the draft held back and drew none.
    Greedy (p: the target's logits or probabilities there, only its argmax is read) it is exact: the candidates are
    the draft's top k, and the rule accepts candidate j iff it is the target's token. Sampled it is one play of that
    fork on draws of its own (`probe`: RunState.probe_generator, never the output's): candidates 2..k drawn from q
    without the first, through the multi-candidate rule from the residual the first's rejection leaves, so its
    verdict has the rescue's exact probability. Either way the rescue table learns from every rejection."""
    if alts is None:
        return None
    share, top_k = alts
    if greedy:
        return greedy_rescue(alts, read_argmax(p[None])[0])
    if first is None:  # the whole fork: its first candidate may survive
        cands = draw_candidates(q, len(top_k), NO_REPLACEMENT, probe)
        cv = verify_candidates(p, q, cands, NO_REPLACEMENT, probe, False)
        return None if cv.index == 0 else (share, cv.index is not None)
    rest = candidate_q(q, [first], NO_REPLACEMENT)  # the draft's token was rejected: the rest of the fork
    cands = draw_candidates(rest, len(top_k) - 1, NO_REPLACEMENT, probe)
    cv = verify_candidates(residual_distribution(p, q), rest, cands, NO_REPLACEMENT, probe, False)
    return share, cv.index is not None
