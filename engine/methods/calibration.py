"""How often the target accepts a drafted token, by the draft's confidence where it was drafted: measured on an
engine's own verdicts, so SpecBranch forks where its draft is actually wrong.

The paper's rule reads the draft's confidence (its largest probability at a position) as the odds that the drafted
token is accepted, and forks below ε. That holds for a draft as calibrated as it is sure; for a draft close to its
target it does not: the embedded target read in 4 bits agrees with the float32 target at 0.99 of positions, also
where its largest probability is 0.05 (at T=1 a flat row is flat for both models, and min(1, p/q) stays near 1),
so the paper's rule forks where nothing is ever rescued (docs/models.md: 17 % of draft tokens wasted at T=1).

AcceptanceCalibration keeps, per confidence bin, how many drafted path tokens the target judged and accepted, and
reads a confidence as the posterior mean acceptance of its bin under a prior centred on the confidence itself
(PRIOR_WEIGHT pseudo-verdicts): before any verdict it is the paper's rule, and it moves to the measured rate as
verdicts arrive. Only positions the target judged count (those after a rejection were never judged). The policy
(policy.Policy) reads it; it changes where the draft forks, never what is emitted, so it is lossless.

The same class, with RESCUE_BINS and RESCUE_PRIOR_WEIGHT, keeps the rescue table: where a fork's first candidate was
rejected, whether another was the target's token, by the share of the draft's remaining mass they covered. Its prior is
pooled: a bin with few verdicts reads the rate the other bins measured (itself starting at the share), not the share
alone, because a far-off draft's share is a guess the pair's own rescues refute at once (the weak draft: 0 rescues in
4 judged forks a run, docs/methods.md), and forks are too few to fill 5 bins one by one. So, where a decision
reads the table (Policy.reads_rescues), every rejection of the draft's own token is a verdict too
(verdict.missed_rescue): greedy, whether the target's token was among the draft's top k, which is exactly what a fork
there would have decided; sampled, one play of that fork.
SpecBranch's hold (policy.Policy.held_back) reads both tables to decide whether to draft at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BINS = 20  # confidence bins of width 0.05
PRIOR_WEIGHT = 8.0  # pseudo-verdicts at the confidence itself: a bin needs about this many verdicts to move halfway
RESCUE_BINS, RESCUE_PRIOR_WEIGHT = 5, 2.0  # the rescue table (Engine.calibration): forks are few, and its prior (the
# share of the draft's mass the other candidates cover) is a weaker guess, so wider bins and a lighter prior


@dataclass(slots=True)
class Bin:
    """One confidence bin's verdicts."""

    judged: int = 0
    accepted: float = 0.0  # a verdict counts 1 or 0; a held-back position (parallel.release_hold) its acceptance
    # probability


@dataclass
class AcceptanceCalibration:
    prior_weight: float = PRIOR_WEIGHT
    bins: int = BINS
    pooled: bool = False  # the prior is centred on the other bins' rate (shrunk to the confidence), not on it alone
    counts: list[Bin] = field(init=False)  # [bins]

    def __post_init__(self):
        self.counts = [Bin() for _ in range(self.bins)]

    def bin_of(self, confidence: float) -> int:
        return min(self.bins - 1, max(0, int(confidence * self.bins)))

    def record(self, confidence: float, accepted: bool | float) -> None:
        b = self.counts[self.bin_of(confidence)]
        b.judged += 1
        b.accepted += float(accepted)

    def acceptance(self, confidence: float) -> float:
        """The odds that a token drafted at this confidence is accepted: the bin's verdicts, with a prior worth
        prior_weight verdicts at the confidence itself, or (pooled) at the rate the other bins measured, read with
        the same prior: two levels of shrinkage, so a table's first verdicts move every bin a little."""
        b, w = self.counts[self.bin_of(confidence)], self.prior_weight
        prior = confidence
        if self.pooled:  # the rescue table: a few bins, summed at each read
            judged, accepted = sum(c.judged for c in self.counts), sum(c.accepted for c in self.counts)
            prior = (accepted - b.accepted + w * confidence) / (judged - b.judged + w)
        return (b.accepted + w * prior) / (b.judged + w)

    def table(self) -> list[dict]:
        """The bins that have verdicts: their confidence range, verdicts and measured acceptance (for the bench)."""
        return [
            {
                "confidence": [i / self.bins, (i + 1) / self.bins],
                "judged": b.judged,
                "accepted": round(b.accepted, 4),
                "rate": round(b.accepted / b.judged, 4),
            }
            for i, b in enumerate(self.counts)
            if b.judged
        ]
