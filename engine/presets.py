"""The one set of defaults: each draft's settings, the default draft, the draft's forward, and the app's scenarios.

The CLI (`generate`, `bench`, `costs`, `train-hrad`), the bench and the app read them from here; every CLI flag and
every app control still overrides its preset. The figures behind each choice are in docs/results/README.md
("Which draft to pick") and docs/methods.md; the tuning runs used the tuning prompts, never the benchmark split.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.config import GenerationConfig
from engine.models.loading import draft_matmul_kind, is_skip_draft, pick_device, pick_dtype

# how a draft's forward runs unless told (engine.config.DRAFT_FORWARDS): the lean path with its one-token step
# compiled. The CLI compiles when the draft loads (about a minute the first time); the app compiles in the background
# and drafts with the eager step meanwhile (docs/app.md). $SPECBRANCH_DRAFT_FORWARD changes it for the app and the CLI
# alike (the test suite sets "lean": each of its many tiny drafts would compile anew).
DRAFT_FORWARD_ENV = "SPECBRANCH_DRAFT_FORWARD"


def draft_forward() -> str:
    return os.environ.get(DRAFT_FORWARD_ENV) or "lean-compiled"


@dataclass(frozen=True)
class Preset:
    """A draft's settings, named as GenerationConfig's fields (engine/config.py says what each does)."""

    gamma: int
    epsilon: float
    draft_stop: float
    feed_stop: float
    head_start: float
    hold: float
    hold_branches: bool
    hrad: bool

    def settings(self) -> dict:
        return dataclasses.asdict(self)


# A distilled draft (embedded, embedded-head, a draft directory; right 35-45 % of the time): short blocks, stop
# drafting at a doubtful token, and hold where the odds are poor (docs/methods.md "Hold"). The hold is 0.25 for the
# draft read in 4 bits (auto on a CPU), whose step costs a tenth of the target's: SpecBranch ran 0.94 / 1.03 / 1.00x
# PEARL with the hold 0.5 / 0.25 / 0 at T=0 and 0.99 / 1.10x with 0.5 / 0.25 at T=1 on the tuning prompts
# (docs/results/README.md "The distilled draft in 4 bits").
DISTILLED = Preset(
    gamma=3, epsilon=0.5, draft_stop=0.3, feed_stop=0.0, head_start=0.3, hold=0.25, hold_branches=False, hrad=False
)
# A draft wrong often (embedded-weak, self-skip:...): the hold at 0.5, and applied to a fork's branches too, which
# cut path rollback at the same speed (docs/methods.md "Hold"; tuned on the foreign prompts).
OFTEN_WRONG = dataclasses.replace(DISTILLED, hold=0.5, hold_branches=True)
# The target read in 4 bits (self; right about 99 % of the time): long blocks without stopping, fork only where it is
# very unsure, a small head start (γ 6 / 8 / 10 gave 2.49 / 2.63 / 2.72x ar at T=0 and 2.30 / 2.60 / 2.38x at T=1 on
# the tuning prompts: docs/results/README.md); the hold only slowed it.
SELF = Preset(
    gamma=8, epsilon=0.1, draft_stop=0.0, feed_stop=0.0, head_start=0.02, hold=0.0, hold_branches=False, hrad=False
)


def preset_for(draft: str | None) -> Preset:
    """The settings a draft spec starts from (None: a distilled draft's)."""
    if draft == "self":
        return SELF
    if draft == "embedded-weak" or is_skip_draft(draft):
        return OFTEN_WRONG
    return DISTILLED


def config_for(method: str, draft: str | None, given: Mapping[str, Any]) -> GenerationConfig:
    """The settings `method` runs with on the draft spec `draft`: those in `given` (what the user set: flags,
    controls), the draft's preset where `given` has none, GenerationConfig's defaults for the rest. Not validated:
    the caller validates it (GenerationConfig.validate) when it runs it."""
    return GenerationConfig(method=method, **{**preset_for(draft).settings(), **given})


def default_draft(device: str | None = None) -> str:
    """The fastest draft this machine supports: the target itself read in 4 bits where the CPU has the int4 kernel
    and the target is float32 (docs/models.md), else the distilled 6-layer draft `embedded` (on a GPU a draft in the
    target's own precision would cost what the target does; a CPU without the kernel would read the self-draft in
    float32 or bfloat16, no cheaper than the target)."""
    dev = pick_device(device)
    self_kind = draft_matmul_kind("auto", dev, pick_dtype(None, dev))
    return "self" if self_kind == "int4" else "embedded"


@dataclass(frozen=True)
class Scenario:
    """What the app's scenario picker sets together: a draft, a method and its settings."""

    key: str
    label: str
    draft: str
    method: str
    preset: Preset
    summary: str  # one line: what to watch, and the measured speed against ar


# The scenarios' settings and figures, on the tuning prompts (T=0), docs/app.md "How the scenarios were chosen".
# "fastest": docs/results/tools/tune_scenarios.py (128 tokens, each run right after an ar run of the same prompt).
# "rescue" is the paper's regime, the distilled draft in 4 bits (the target sets the pace), with its preset: one bench
# run against ar and pearl (96 tokens, docs/results/json/scenario-rescue-xeon.json, the Intel Xeon with the AVX-512
# panel kernel and grouped attention). "weak": one bench run of its preset
# against ar and pearl (96 tokens, docs/results/json/scenarios-weak-int4.json). Each draft in its process, as the app
# runs it.
SCENARIOS: dict[str, Scenario] = {
    s.key: s
    for s in (
        Scenario(
            "fastest",
            "Fastest",
            "self",
            "specbranch",
            SELF,
            "the target in 4 bits drafts for itself: long accepted blocks, few forks; 1.9× ar on the tuning "
            "prompts, with the CPU shared",
        ),
        Scenario(
            "rescue",
            "Watch branches rescue",
            "embedded",
            "specbranch",
            DISTILLED,
            "the distilled 6-layer draft in 4 bits, ~10× cheaper than the target: forks in 6 of 10 steps, about 6 "
            "rescues a chat; 1.36× ar and 1.00× pearl on the tuning prompts",
        ),
        Scenario(
            "weak",
            "A poorly aligned draft",
            "embedded-weak",
            "specbranch",
            OFTEN_WRONG,
            "a draft right about 10 % of the time: rejections, rollbacks and holds to watch; 1.02× ar and 0.86× "
            "pearl on the tuning prompts",
        ),
    )
}
