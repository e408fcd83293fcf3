"""The engines the app has loaded: one per draft picked in the menu, on one loaded target, at most `cap` of them.

Each engine's draft may run in a process of its own (--draft-worker process: 1.1-1.7 GB each on the embedded pair,
docs/app.md), so a visitor who tries every draft in the menu would otherwise leave one process per draft behind. Past
the cap, the least recently used engine is closed (its draft's process ends; its worker threads stop) and loads again
on its next pick. An engine a generation is using is never closed: the queue runs one engine request at a time, and a
generation holds its engine's lock while it runs (also a run stopped by Stop or a closed tab, until it has let go), so
such an engine is passed over and the cache stays above the cap until a later pick, when it is idle."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from engine.engine import check_prompt_length, encode_prompt

from .settings import count_setting

DEFAULT_MAX_DRAFTS = 2
MAX_DRAFTS_ENV = "SPECBRANCH_MAX_DRAFTS"


def max_drafts_from(value: str | int | None) -> int:
    """The draft cap from a setting (count_setting)."""
    return count_setting(value, DEFAULT_MAX_DRAFTS, MAX_DRAFTS_ENV)


def in_use(engine) -> bool:
    """Whether a generation holds the engine now (Engine.busy: its lock)."""
    return bool(getattr(engine, "busy", False))


class EngineCache:
    """make(draft, target) -> a loaded Engine for a draft spec; target: the LM loaded with the first engine (None for
    the first, which loads it), so every draft pairs with one target in memory. default: the draft of get(None)."""

    def __init__(self, make: Callable, default: str, cap: int = DEFAULT_MAX_DRAFTS):
        self.make, self.default, self.cap = make, default, max_drafts_from(cap)
        self.target = None  # the target's LM, kept when the engine that loaded it is closed
        self._engines: OrderedDict[str, object] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def get(self, draft: str | None = None):
        """The engine for a draft spec (None: the app's own), loaded on first use; it becomes the most recently used,
        and the least recently used idle ones past the cap are closed."""
        draft = draft or self.default
        with self._lock:
            engine = self._engines.pop(draft, None)
            if engine is None:
                engine = self.make(draft, self.target)
                if self.target is None:
                    self.target = engine.pair.target
            self._engines[draft] = engine
            self._trim(keep=draft)
            return engine

    __call__ = get

    def loaded(self) -> list[str]:
        """The drafts whose engines are loaded, least recently used first."""
        with self._lock:
            return list(self._engines)

    def _trim(self, keep: str) -> None:
        for draft in list(self._engines):
            if len(self._engines) <= self.cap:
                return
            engine = self._engines[draft]
            if draft == keep or in_use(engine):
                continue
            del self._engines[draft]
            engine.close()

    def close(self) -> None:
        """Close every engine (the app's exit)."""
        with self._lock:
            engines, self._engines = list(self._engines.values()), OrderedDict()
        for engine in engines:
            engine.close()


def cap_from_env() -> int:
    return max_drafts_from(os.environ.get(MAX_DRAFTS_ENV))


@dataclass(frozen=True)
class Named:
    """A model as the app's process on ZeroGPU knows it: by its spec (an Engine's LM is named by its spec too)."""

    name: str


@dataclass(frozen=True)
class FrontPair:
    """What the app reads of an Engine's pair (ModelPair): the models' names and the target's tokenizer."""

    target: Named
    draft: Named | None
    tokenizer: object


class GpuFront:
    """On ZeroGPU, the app's process stands for a draft's Engine with this: the target's tokenizer and context length,
    and the pair's names, with no model and no CUDA. The tabs encode and check a prompt and record the run as they do
    with an Engine; its runs go to the GPU function by the draft's spec (app/stream.py), which builds the Engine in
    the GPU worker."""

    busy = False  # nothing runs in this process

    def __init__(self, target: str, draft: str, tokenizer, context_length: int):
        self.draft, self.tokenizer, self.context_length = draft, tokenizer, context_length
        self.pair = FrontPair(Named(target), Named(draft), tokenizer)

    def encode(self, prompt: str, chat: bool, history: list[dict] | None = None) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, chat, history)

    def check_prompt(self, prompt_ids: list[int]) -> None:
        check_prompt_length(prompt_ids, self.context_length)

    def close(self) -> None:
        """Nothing to close: the engines live in the GPU worker."""


def gpu_fronts(target: str, drafts: list[str]) -> dict[str, GpuFront]:
    """A GpuFront for each draft spec on `target`: its tokenizer and context length read from its files once, here
    (the embedded GGUF is dequantized once on its first load, so the GPU worker then loads it from that cache). Call
    it at start, on the main thread, never on a request's thread: no weights load here."""
    from transformers import AutoConfig, AutoTokenizer

    from engine.models.loading import resolve_source

    source = resolve_source(target)
    tokenizer = AutoTokenizer.from_pretrained(source)
    context = int(getattr(AutoConfig.from_pretrained(source), "max_position_embeddings", 2048))
    return {draft: GpuFront(target, draft, tokenizer, context) for draft in drafts}
