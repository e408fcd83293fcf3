"""The generation controls' settings: methods offered, per-draft starting values, labels, and the config the
controls build. Each tab that runs the engine reads them from here."""

from __future__ import annotations

import math

import gradio as gr

from engine.config import GenerationConfig, SpecBranchError
from engine.presets import preset_for

LIVE_METHODS = ["specbranch", "pearl", "sd", "ar", "specbranch-no-branch", "specbranch-no-hrad"]
COMPARE_METHODS = ["ar", "sd", "pearl", "specbranch"]


def defaults_for(draft: str | None) -> dict:
    """The sliders' starting values for a draft spec: its preset, as the CLI and the bench read it
    (engine/presets.py)."""
    return preset_for(draft).settings()


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


def make_config(
    method,
    max_new,
    temperature,
    top_p,
    gamma,
    branches,
    epsilon,
    draft_stop,
    feed_stop,
    head_start,
    hold,
    hold_branches,
    hrad,
    seed,
) -> GenerationConfig:
    """Build and validate settings from the controls; raises SpecBranchError with the reason."""

    def number(value, name, cast):
        """value as a float or an int; an integer setting refuses a fraction or an infinity instead of rounding it."""
        if cast is int and isinstance(value, int) and not isinstance(value, bool):
            return value  # exact, however large (a seed): float() would round it
        try:
            x = float(value)
        except (TypeError, ValueError, OverflowError):
            raise SpecBranchError(f"{name} must be a number, got {value!r:.40}") from None
        if cast is float:
            return x
        if not math.isfinite(x) or x != int(x):
            raise SpecBranchError(f"{name} must be a whole number, got {value!r:.40}")
        return int(x)

    return GenerationConfig(
        method=method,
        max_new_tokens=number(max_new, "max new tokens", int),
        temperature=number(temperature, "temperature", float),
        top_p=number(top_p, "top-p", float),
        gamma=number(gamma, "γ", int),
        branches=number(branches, "branches k", int),
        epsilon=number(epsilon, "ε", float),
        draft_stop=number(draft_stop, "draft stop", float),
        feed_stop=number(feed_stop, "feed stop", float),
        head_start=number(head_start, "head start", float),
        hold=number(hold, "hold", float),
        hold_branches=bool(hold_branches),
        hrad=bool(hrad),
        seed=number(seed, "seed", int),
    ).validate()


def count_setting(value: str | int | None, default: int, name: str) -> int:
    """A count from a setting (an environment variable or a flag; None or "": the default); ValueError saying why when
    it is not an integer >= 1."""
    if value is None or value == "":
        return default
    try:
        count = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}") from None
    if count < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return count
