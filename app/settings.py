"""The generation controls' settings: methods offered, per-draft starting values, labels, and the config the
controls build. Each tab that runs the engine reads them from here."""
from __future__ import annotations

import gradio as gr

from engine.config import GenerationConfig, SpecBranchError
from engine.models.loading import is_skip_draft

LIVE_METHODS = ["specbranch", "pearl", "sd", "ar", "specbranch-no-branch", "specbranch-no-hrad"]
COMPARE_METHODS = ["ar", "sd", "pearl", "specbranch"]

# The Live and Compare defaults, chosen by the bench on data/tuning_prompts.jsonl for each kind of draft: a
# distilled draft (docs/models.md), and the target itself read in 4 bits, which agrees with the target on
# over 99 % of tokens, so it drafts long blocks without stopping and forks only where it is very unsure (docs/models.md; γ 8
# since SpecBranch's head start reads its measured acceptance, docs/methods.md: on the tuning prompts SpecBranch ran 2.49 / 2.63 /
# 2.72× ar at T=0 and 2.30 / 2.60 / 2.38× at T=1 with γ 6 / 8 / 10).
# SpecBranch's hold (docs/methods.md): 0.5 for a distilled draft (tuning prompts: 1.01× PEARL at T=1 against 0.86× without, a
# tie at T=0, path rollback halved); 0 for the 4-bit self-draft, which it only slowed (0.71-0.75× PEARL)
# The hold on a fork's branches (docs/methods.md) cut path rollback at the same speed with the weak draft (benchmark split,
# foreign prompts: 0.42× PEARL's against 0.51× without, 1.16× PEARL's speed either way) and with the layer-skipping
# self-draft (tuning prompts), but cost the distilled draft 7 % at T=0 on the tuning prompts: on for the first two
DEFAULTS = {"gamma": 3, "epsilon": 0.5, "draft_stop": 0.3, "feed_stop": 0.0, "head_start": 0.3, "hold": 0.5,
            "hold_branches": False, "hrad": False}
HOLD_BRANCHES_DEFAULTS = {**DEFAULTS, "hold_branches": True}
SELF_DEFAULTS = {"gamma": 8, "epsilon": 0.1, "draft_stop": 0.0, "feed_stop": 0.0, "head_start": 0.02, "hold": 0.0,
                 "hold_branches": False, "hrad": False}

# H-RAD ships off: on held-out prompts it placed branch points no better than the draft's confidence alone
# (classification and speed, docs/methods.md); the checkbox says so where the user decides
HRAD_LABEL = ("H-RAD (classifier places branch points). Off by default: on held-out prompts it was no faster "
              "than confidence only (docs/methods.md)")


HOLD_BRANCHES_LABEL = ("Hold the branches too (SpecBranch, with a hold): a branch step that would take the first "
                       "branch's odds below the hold keeps nothing. On by default for embedded-weak and self-skip "
                       "drafts: it cut path rollback at the same speed; off for the distilled draft, which it made 7 % "
                       "slower at T=0 (docs/methods.md)")

DRAFT_LABEL = "Draft (loaded on first use; picking one sets the sliders to the settings the bench chose for its kind)"


def defaults_for(draft: str | None) -> dict:
    """The sliders' starting values for the draft spec the app serves."""
    if draft == "self":
        return SELF_DEFAULTS
    if draft == "embedded-weak" or is_skip_draft(draft):
        return HOLD_BRANCHES_DEFAULTS
    return DEFAULTS


SLIDER_KEYS = ("gamma", "epsilon", "draft_stop", "feed_stop", "head_start", "hold", "hold_branches", "hrad")


def slider_defaults(draft: str | None) -> list:
    """The settings sliders (SLIDER_KEYS, in order) set to a newly picked draft's defaults."""
    return [gr.update(value=defaults_for(draft)[key]) for key in SLIDER_KEYS]


def examples() -> list[list]:
    """Example prompts from the benchmark split: three chats, two maths questions, one code completion."""
    from engine.measure.datasets import benchmark_prompts

    out = [[p.text, p.chat] for p in benchmark_prompts("mt_bench", 3)]
    out += [[p.text, p.chat] for p in benchmark_prompts("gsm8k", 2)]
    out += [[p.text, p.chat] for p in benchmark_prompts("humaneval", 1)]
    return out


def make_config(method, max_new, temperature, top_p, gamma, branches, epsilon, draft_stop, feed_stop, head_start,
                hold, hold_branches, hrad, seed) -> GenerationConfig:
    """Build and validate settings from the controls; raises SpecBranchError with the reason."""
    def number(value, name, cast):
        try:
            return cast(value)
        except (TypeError, ValueError):
            raise SpecBranchError(f"{name} must be a number, got {value!r}") from None
    return GenerationConfig(method=method, max_new_tokens=number(max_new, "max new tokens", int),
                            temperature=number(temperature, "temperature", float),
                            top_p=number(top_p, "top-p", float), gamma=number(gamma, "γ", int),
                            branches=number(branches, "branches k", int), epsilon=number(epsilon, "ε", float),
                            draft_stop=number(draft_stop, "draft stop", float),
                            feed_stop=number(feed_stop, "feed stop", float),
                            head_start=number(head_start, "head start", float), hold=number(hold, "hold", float),
                            hold_branches=bool(hold_branches), hrad=bool(hrad),
                            seed=number(seed, "seed", int)).validate()
