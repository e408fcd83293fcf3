"""Typed events: the one stream that flows from a decoder to the CLI, the UI and SQLite unchanged.

Every event is a small frozen dataclass of JSON-friendly fields (ints, floats, strings, lists).
`to_dict` / `from_dict` round-trip exactly, so a stored run replays exactly what live did.
Times are seconds since the run's clock started (RunStarted is t=0).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

# Where an emitted token came from (the UI colours tokens by this).
ACCEPTED, CORRECTION, BONUS, TARGET, RESCUED = "accepted", "correction", "bonus", "target", "rescued"
# What a timing span's forward pass did.
PREFILL, DRAFT, BRANCH_DRAFT, VERIFY, DECODE = "prefill", "draft", "branch_draft", "verify", "decode"


@dataclass(frozen=True)
class Event:
    type: ClassVar[str] = "event"

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, **dataclasses.asdict(self)}


@dataclass(frozen=True)
class RunStarted(Event):
    type: ClassVar[str] = "run_started"
    method: str
    target: str
    draft: str | None
    prompt_ids: list[int]
    prompt_text: str
    config: dict[str, Any]
    device: str
    wall_clock: float  # unix time when the run started
    # ms of one target forward of one token, measured by the engine before the run (Engine.target_step_ms; -1: not
    # measured, as for AR, whose own decode steps are one-token forwards): what a speculative run's speed is read
    # against before an AR run of its prompt exists
    target_step_ms: float = -1.0


@dataclass(frozen=True)
class StepStarted(Event):
    type: ClassVar[str] = "step_started"
    step: int
    position: int  # number of committed tokens (prompt + emitted) when the step began
    t: float


@dataclass(frozen=True)
class DraftProposed(Event):
    """A block (or one branch) of draft tokens with the exact q each was sampled from."""

    type: ClassVar[str] = "draft_proposed"
    step: int
    tokens: list[int]
    pieces: list[str]  # decoded text of each token, so replay needs no tokenizer
    q: list[float]  # q(x_i): probability of each drafted token under the distribution it was sampled from
    branch: int = 0  # 0 for the linear path; i >= 1 for the i-th branch of a fork
    parent_position: int = 0  # number of tokens (committed + drafted) the block hangs from
    kind: str = "path"  # "path" (linear tokens), "candidates" (a fork's k candidates), "branch" (one branch step),
    # "held" (no token: SpecBranch's hold left this position to the target, policy.Policy.held_back; on branch 1,
    # it kept no token of a branch step, and the fork's branches wait for the target's verdict)
    top: list[list[list[float]]] = field(default_factory=list)  # per token: [[id, q], ...] top alternatives
    # a fork's candidates, or a hold (else -1): the draft's largest untempered probability there, and the odds the
    # policy read it as (engine/methods/calibration.py): that its own token is accepted (a fork), or that what it
    # would have proposed holds up, the pending path included (a hold)
    confidence: float = -1.0
    odds: float = -1.0


@dataclass(frozen=True)
class Verified(Event):
    """The target's verdict on a drafted block."""

    type: ClassVar[str] = "verified"
    step: int
    drafted: int  # tokens the target verified
    accepted: int  # how many of them were accepted (a prefix)
    p: list[float]  # p(x_i) under the target, for each verified draft token
    q: list[float]  # q(x_i), as drafted
    u: list[float]  # the uniform draw for each verified token (NaN-free: -1 when greedy)
    next_token: int  # correction (on rejection) or bonus (all accepted); -1: none (a branch point follows)
    next_kind: str  # CORRECTION, BONUS, or "" when next_token is -1
    next_p: float  # probability of next_token under the distribution it was drawn from
    branch: int = 0
    tokens: list[int] = field(default_factory=list)  # the verified draft tokens (so a step draws on its own)
    pieces: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class BranchResolved(Event):
    """The target's verdict at a branch point: which of the k candidates (if any) survived."""

    type: ClassVar[str] = "branch_resolved"
    step: int
    position: int  # committed length at the branch point
    candidates: list[int]
    pieces: list[str]
    q: list[float]  # q(candidate) under the draft row the candidates were drawn from
    p: list[float]  # p(candidate) under the target
    u: list[float]  # uniform draw per tried candidate (-1 when greedy)
    scheme: str  # how candidates were drawn: topk / without_replacement / iid
    branches: list[list[int]]  # tokens drafted after each candidate
    branch_pieces: list[list[str]]
    survivor: int  # index of the surviving candidate, -1 if none
    token: int  # the committed token (survivor, or a sample from the final residual)
    rescued: bool  # a candidate other than the draft's first choice survived
    depth: int = -1  # draft tokens on the path before the branch point when it was forked (-1: not recorded)


@dataclass(frozen=True)
class Rollback(Event):
    """Tokens thrown away: drafted but rejected, or drafted after a rejection, or on a losing branch."""

    type: ClassVar[str] = "rollback"
    step: int
    model: str  # "draft" or "target"
    tokens: list[int]
    pieces: list[str]
    reason: str


@dataclass(frozen=True)
class TokensEmitted(Event):
    type: ClassVar[str] = "tokens_emitted"
    step: int
    tokens: list[int]
    pieces: list[str]
    kinds: list[str]  # ACCEPTED / CORRECTION / BONUS / TARGET / RESCUED per token
    text: str  # text delta of the whole output so far (multi-byte safe)


@dataclass(frozen=True)
class TimingSpan(Event):
    """One forward pass on one worker."""

    type: ClassVar[str] = "timing_span"
    worker: str  # "draft" or "target"
    kind: str  # "prefill", "draft", "branch_draft", "verify", "decode"
    step: int
    start: float
    end: float
    tokens: int = 1  # tokens fed in this forward (x batch rows)


@dataclass(frozen=True)
class Notice(Event):
    type: ClassVar[str] = "notice"
    level: str  # "info" or "warning"
    message: str


@dataclass(frozen=True)
class Finished(Event):
    type: ClassVar[str] = "finished"
    reason: str  # "length", "eos", "cancelled", "error"
    prefill_s: float
    decode_s: float  # wall time of decoding, after prefill
    new_tokens: int
    metrics: dict[str, Any]


EVENT_TYPES: dict[str, type[Event]] = {
    cls.type: cls
    for cls in (
        RunStarted,
        StepStarted,
        DraftProposed,
        Verified,
        BranchResolved,
        Rollback,
        TokensEmitted,
        TimingSpan,
        Notice,
        Finished,
    )
}


def from_dict(data: dict[str, Any]) -> Event:
    """Rebuild an event from `to_dict` output; unknown types or fields raise ValueError."""
    data = dict(data)
    kind = data.pop("type", None)
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        raise ValueError(f"unknown event type {kind!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    extra = set(data) - names
    if extra:
        raise ValueError(f"event {kind!r} has unknown fields {sorted(extra)}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise ValueError(f"event {kind!r}: {exc}") from None
