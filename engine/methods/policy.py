"""Where SpecBranch forks, how wide, and where it holds back: the Policy of the parallel loop (parallel.py).

PEARL is the policy with one branch and no hold. SpecBranch forks at the first token the target is unlikely to
accept (the draft's confidence below ε, read as the acceptance this engine measured at that confidence,
calibration.py; --no-calibrate reads it as is, the paper's rule), or where H-RAD predicts a rejection; k adapts to the
confidence, up to --branches; with measured costs (--branch-costs) only where a fork's expected saving exceeds what
its k rows cost. With --hold it drafts nothing where the measured odds that what it drafts holds up fall below the
hold (rollback-aware drafting): the target takes that position itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.methods.calibration import AcceptanceCalibration
from engine.methods.speculation import Drafted, Speculation

REJECT_AT_ONCE, PARTLY, ALL_ACCEPTED = 0, 1, 2  # H-RAD classes


def alternatives_share(top: list[float], k: int) -> float:
    """The share of the draft's mass beyond its own token that candidates 2..k cover (top: its largest
    probabilities, best first): its own odds that they hold the target's token where its own is rejected."""
    return min(1.0, sum(top[1:k]) / max(1 - top[0], 1e-9))


@dataclass(frozen=True)
class BranchCosts:
    """Measured forward costs that decide whether a fork pays (Engine.branch_costs): draft_ms[k] is one draft
    step on k cache rows, target_busy_ms[k] one target step while the draft steps on k rows beside it (on a CPU
    the two share cores and memory bandwidth)."""

    draft_ms: dict[int, float]
    target_busy_ms: dict[int, float]

    def net_gain_ms(self, k: int, alternatives: float, steps: int) -> float:
        """Expected ms a fork of k candidates saves over drafting on along its first candidate, for `steps` branch
        steps. A rescue (odds `alternatives`: that candidate 2..k is the target's token) is judged in the same target
        pass as the path, its branch's first token by its candidate's row (the tree the target verifies): the pass
        returns one token more than it would have, worth a target step; and its branch's tokens become the next
        block, `steps` one-row draft steps not drafted again. The fork costs each of those steps on k rows instead of
        1, and what k rows do to the target step beside them. The draft's time counts in full: it drafts on until the
        verdict."""
        saved = alternatives * (self.target_busy_ms[1] + steps * self.draft_ms[1])
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
    rescues: AcceptanceCalibration | None = None  # measured rescues by the alternatives' share (None: the share)
    hold: float = 0.0  # draft nothing where the odds that it holds up fall below this (held_back; 0 = off)
    hold_branches: bool = False  # ... and keep nothing of a branch step that would take the line below it

    def acceptance(self, confidence: float) -> float:
        """The odds that a token drafted at this confidence is accepted: measured, or the confidence itself."""
        return confidence if self.calibration is None else self.calibration.acceptance(confidence)

    def token_odds(self, d: Drafted) -> float:
        """The odds that a drafted token is accepted. Without measurements (PEARL, --no-calibrate): the draft's own
        probability of it. With them: the acceptance measured at the draft's largest probability where it was
        drafted (a branch token, whose position's largest probability is not kept, at its own). The two differ
        when sampling: the rule accepts a token drawn from q with probability sum(min(p, q)) whichever token it
        is, so a near-copy of the target is accepted almost always, also where it drew a token it gave 0.1, and
        only a measured table can say so (docs/methods.md)."""
        if self.calibration is None:
            return d.conf
        return self.acceptance(d.conf if d.top is None else d.top)

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
        return math.prod(self.acceptance(d.conf if d.top is None else d.top) for d in spec.path)

    def line_odds(self, spec: Speculation) -> float:
        """The odds that the speculation along its first branch holds up to its last token: the path's, the fork's
        (one candidate survives) and the first branch's tokens' (read from their probabilities)."""
        odds = self.path_odds(spec)
        if spec.fork is not None:
            odds *= spec.fork.odds * math.prod(self.acceptance(d.conf) for d in spec.fork.branches[0].tokens)
        return odds

    def line_acceptance(self, spec: Speculation) -> list[float]:
        """The odds that each token of spec.line() is accepted (token_odds; a fork's first candidate read at the
        branch point's largest probability), for the draft-length rules (the head start, the feed stop)."""
        return [self.token_odds(d) for d in spec.line()]

    def branch_odds(self, spec: Speculation) -> list[list[float]]:
        """For each branch of the fork, the odds of each token of its line given what precedes it: the first
        candidate's as the draft's own token (token_odds), another's as its share of the rescue odds (the rescue
        table's reading of the share of the draft's remaining mass it holds), then each branch token's (token_odds).
        What the tree a target pass verifies is chosen by (speculation.plan_branches)."""
        fork = spec.fork
        first = fork.branches[0].candidate
        own = self.token_odds(first)
        rest = max(1.0 - first.conf, 1e-9)
        out = []
        for i, branch in enumerate(fork.branches):
            share = min(1.0, branch.candidate.conf / rest)
            c = own if i == 0 else (1 - own) * (share if self.rescues is None else self.rescues.acceptance(share))
            out.append([c] + [self.token_odds(d) for d in branch.tokens])
        return out

    @property
    def reads_rescues(self) -> bool:
        """Whether a decision reads the rescue table (the hold's odds, the measured-cost rule): only then is it worth
        playing the forks the draft did not make (verdict.missed_rescue), which costs host time between forwards."""
        return self.rescues is not None and (self.hold > 0 or self.costs is not None)

    def sure_enough(self, spec: Speculation, steps: int = 10) -> float | None:
        """The least largest probability of the draft's next path row at which that step would most likely draft its
        token as it is: no fork (its acceptance at least ε) and no hold (held_back on the path as it stands, k = 1),
        found by bisection in `steps` halvings; None where this policy never forks or holds by confidence. A draft in
        its own process takes its next step ahead only on a row at least this sure (process.step_ahead): a fork or a
        hold asks for another step, which waits while the one taken ahead finishes and is undone. A guess for timing
        alone (H-RAD, the measured costs and the alternatives are left out): the output is the same either way."""
        forks = self.max_branches > 1 and self.fixed_at is None
        if not forks and self.hold <= 0:
            return None
        path = self.path_odds(spec) if self.hold > 0 else 1.0

        def linear(top: float) -> bool:
            sure = self.acceptance(top)
            return not (forks and sure < self.epsilon) and not self.held_back(path * sure)

        lo, hi = 0.0, 1.0
        if not linear(hi):
            return hi
        for _ in range(steps):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if linear(mid) else (mid, hi)
        return hi

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
