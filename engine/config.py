"""Generation settings and their validation. Bad input raises SpecBranchError with a plain message."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path


class SpecBranchError(ValueError):
    """A user-facing error: the message says what is wrong and what is allowed."""


def writable_dir(path: Path, what: str) -> Path:
    """Create `path` and prove a file can be written there, before any slow stage runs."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise SpecBranchError(f"cannot write the {what} to {path}: {exc.strerror or exc}") from None
    return path


def writable_file(path: str | None, what: str) -> None:
    """Refuse, before any model loads, an output file that could not be written (its folder is created)."""
    if not path:
        return
    if Path(path).is_dir():
        raise SpecBranchError(f"cannot write the {what} to {path}: it is a folder")
    writable_dir(Path(path).resolve().parent, what)


def write_json(path: str | None, data: dict) -> None:
    """Write a command's results as indented JSON, where a path is given (checked first by writable_file)."""
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)


# what decodes a method: plain decoding, SD's draft-then-verify rounds, the overlapped loop of
# engine/methods/parallel.py, or transformers' assisted generation (engine/methods/assisted.py)
AR, SD, PARALLEL, ASSISTED = "ar", "sd", "parallel", "assisted"
# a parallel method's branching policy (Engine.policy): never branch (PEARL); k candidates at the first doubtful draft
# token (SpecBranch); one candidate, with SpecBranch's hold (no-branch); k at a fixed depth every round (fixed)
PEARL_POLICY, CONFIDENCE, NO_BRANCH, FIXED = "pearl", "confidence", "no-branch", "fixed"


@dataclass(frozen=True)
class Method:
    """What every check that depends on a method reads: one entry per name in METHODS."""

    name: str
    decoder: str  # AR, SD, PARALLEL or ASSISTED
    needs_draft: bool
    overlapped: bool  # draft and target compute at once (PEARL, SpecBranch); else they take turns
    policy: str | None = None  # a parallel method's branching policy
    hrad: bool = False  # H-RAD may place its branch points (--hrad)

    @property
    def drafts_here(self) -> bool:
        """The engine's own loop drives the draft (its worker, the lean path); hf-assisted hands the draft's model to
        transformers' generate(), which runs it in this process on transformers' forward."""
        return self.needs_draft and self.decoder != ASSISTED

    @property
    def calibrated(self) -> bool:
        """A SpecBranch variant: its policy reads the acceptance the engine measured (Engine.calibration)."""
        return self.policy in (CONFIDENCE, NO_BRANCH, FIXED)


REGISTRY: dict[str, Method] = {
    m.name: m
    for m in (
        Method("ar", AR, needs_draft=False, overlapped=False),
        Method("sd", SD, needs_draft=True, overlapped=False),
        Method("pearl", PARALLEL, needs_draft=True, overlapped=True, policy=PEARL_POLICY),
        Method("specbranch", PARALLEL, needs_draft=True, overlapped=True, policy=CONFIDENCE, hrad=True),
        Method("specbranch-no-branch", PARALLEL, needs_draft=True, overlapped=True, policy=NO_BRANCH),
        Method("specbranch-no-hrad", PARALLEL, needs_draft=True, overlapped=True, policy=CONFIDENCE),
        Method("specbranch-fixed", PARALLEL, needs_draft=True, overlapped=True, policy=FIXED),
        Method("hf-assisted", ASSISTED, needs_draft=True, overlapped=False),
    )
}
METHODS = tuple(REGISTRY)
BASELINE = "ar"  # the method every speedup is measured against (the bench's reference, the app's "vs AR")


def method_of(name: str) -> Method:
    """The registry's entry for a method name, or a SpecBranchError that lists the names."""
    if name not in REGISTRY:
        raise SpecBranchError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}")
    return REGISTRY[name]


# how a draft's matmuls read its weights (models.draft_matmul_kind)
DRAFT_MATMULS = ("auto", "float32", "bfloat16", "int4")
# how a draft's forward runs: engine/models/lean.py where the draft fits it (else transformers'), or always
# transformers'
DRAFT_FORWARDS = ("lean", "lean-compiled", "transformers")
# where a draft's forwards run: in a child process of their own where the draft fits (engine/drafts/process.py), or on
# a thread of this process
DRAFT_WORKERS = ("process", "thread")
# how the target's forward runs: engine/models/static_forward.py where the target fits it (else transformers'), or
# always transformers'; both compute the same bits
TARGET_FORWARDS = ("static", "transformers")


@dataclass(frozen=True)
class ModelSettings:
    """Which models to load and how they run (the model flags, engine/args.py); engine/load.py loads them."""

    target: str = "embedded"  # a spec: embedded | PATH.gguf | DIR | hub id
    draft: str | None = None  # a draft spec (engine/models/loading.py); None or "none": no draft
    device: str | None = None  # None: cuda when present
    draft_device: str | None = None  # None: the target's
    dtype: str | None = None  # None: float32 on a CPU, bfloat16 on CUDA
    draft_matmul: str = "auto"  # one of DRAFT_MATMULS
    draft_forward: str = "lean-compiled"  # one of DRAFT_FORWARDS
    target_forward: str = "static"  # one of TARGET_FORWARDS
    draft_worker: str = "process"  # one of DRAFT_WORKERS
    threads: int = 1  # torch threads per model worker (0 reads as 1)
    solo_threads: int | None = None  # the draft's, for a step the target waits on (None: runtime's default)
    trust_remote_code: bool = False


SEED_LIMIT = 2**62  # torch seeds are 64-bit, and the draft's generator is seeded with the seed plus a little


@dataclass(frozen=True)
class GenerationConfig:
    method: str = "sd"
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0
    seed: int = 0
    gamma: int = 4  # draft block length (sd); depth cap of the speculation (pearl, specbranch)
    draft_stop: float = 0.0  # pearl, specbranch: stop drafting a round after a token drawn with confidence below this
    feed_stop: float = 0.0  # pearl, specbranch: feed the target drafted tokens only while the draft's odds that all are
    # accepted (policy.Policy.line_acceptance) stay at least this (0 = up to γ): a cheaper verify pass on a CPU
    head_start: float = 0.0  # pearl, specbranch: before a pass on a block shorter than γ, the draft steps first while
    # its odds that the whole block is accepted stay at least this (0 = off: the target starts at once, as in PEARL)
    branches: int = 3  # specbranch: most candidates at a branch point (k_max)
    tree_tokens: int = 0  # specbranch: branch tokens a target pass may verify beside a path of γ, as a token tree
    # (0: a fork's branches are fed only in the room a shorter path leaves under γ)
    epsilon: float = 0.5  # specbranch: branch at the first draft token with confidence below this
    hrad: bool = False  # specbranch: let the H-RAD classifier place branch points (off by default: docs/methods.md)
    branch_costs: bool = False  # specbranch: fork only where the measured costs say it pays (else the paper's k rule)
    calibrate: bool = True  # specbranch: read the draft's confidence as the acceptance this engine measured at it
    # (engine/methods/calibration.py) before comparing it with ε; False: the confidence as is (the paper's rule)
    hold: float = 0.0  # specbranch: draft nothing where the odds that it is accepted (its own token, or one of a fork's
    # candidates; the acceptance read as for ε) fall below this: the target takes that position itself (0 = off)
    hold_branches: bool = False  # specbranch, with a hold: a branch step keeps nothing where the first branch's odds
    # with the token it would add fall below the hold (else only the odds before the step are read): fewer branch
    # tokens rolled back, a little less τ where branch tokens are often accepted (docs/methods.md)

    @property
    def kind(self) -> Method:
        """The method's registry entry (validate() has refused an unknown method)."""
        return method_of(self.method)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> GenerationConfig:
        method_of(self.method)
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise SpecBranchError(f"max-new-tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not (self.temperature >= 0.0) or not math.isfinite(self.temperature):
            raise SpecBranchError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not -SEED_LIMIT <= self.seed <= SEED_LIMIT:
            raise SpecBranchError(f"seed must be an integer from -2**62 to 2**62, got {self.seed!r:.40}")
        if not (0.0 < self.top_p <= 1.0):
            raise SpecBranchError(f"top-p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SpecBranchError(f"top-k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.gamma, int) or self.gamma < 1:
            raise SpecBranchError(f"gamma (draft length) must be an integer >= 1, got {self.gamma!r}")
        if not isinstance(self.branches, int) or self.branches < 1:
            raise SpecBranchError(f"branches must be an integer >= 1, got {self.branches!r}")
        if not isinstance(self.tree_tokens, int) or isinstance(self.tree_tokens, bool) or self.tree_tokens < 0:
            raise SpecBranchError(f"tree-tokens must be an integer >= 0 (0 = within γ), got {self.tree_tokens!r}")
        if not (0.0 <= self.draft_stop <= 1.0):
            raise SpecBranchError(f"draft-stop must be in [0, 1] (0 = off), got {self.draft_stop!r}")
        if not (0.0 <= self.feed_stop <= 1.0):
            raise SpecBranchError(f"feed-stop must be in [0, 1] (0 = off), got {self.feed_stop!r}")
        if not (0.0 <= self.head_start <= 1.0):
            raise SpecBranchError(f"head-start must be in [0, 1] (0 = off), got {self.head_start!r}")
        if not (0.0 <= self.hold <= 1.0):
            raise SpecBranchError(f"hold must be in [0, 1] (0 = off), got {self.hold!r}")
        if self.hold_branches and self.hold <= 0:
            raise SpecBranchError("hold-branches needs a hold above 0: it applies the hold to the branches")
        if not (0.0 <= self.epsilon <= 1.0):
            raise SpecBranchError(f"epsilon must be in [0, 1], got {self.epsilon!r}")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
