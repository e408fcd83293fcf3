"""What the tabs share: the engines (one a draft, loaded on first use), the session store, and the page-wide
components (the draft menu, the browser's id, the generation controls that Live builds and Compare reads)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import gradio as gr

from engine.config import BASELINE, SpecBranchError
from sessions import SessionStoreError, start_recording


def no_store(reason: str):
    return lambda: (None, reason)


def stored_ar_speed(
    store, owner: str, prompt: str, pair: tuple[str, str | None] | None = None, session_id: str | None = None
) -> float | None:
    """tokens/s of the newest complete AR run of exactly this prompt that this owner stored (a run in
    `session_id` first): the baseline for a speedup. None when there is none, so no speedup is claimed."""
    if store is None or not prompt:
        return None
    try:
        rows = store.list_sessions(
            owner=owner, search=prompt, method=BASELINE, pair=pair, include_shared=False, limit=20
        )
        ids = [r["id"] for r in rows if r["prompt"] == prompt]
        for sid in ([session_id] if session_id else []) + [i for i in ids if i != session_id]:
            for run in store.get_session(sid, owner)["runs"]:
                speed = (run["metrics"] or {}).get("tokens_per_s")
                if (
                    run["method"] == BASELINE
                    and run["status"] == "complete"
                    and isinstance(speed, (int, float))
                    and not isinstance(speed, bool)
                    and speed > 0
                ):
                    return float(speed)
    except SessionStoreError:
        return None
    return None


def pair_names(engine) -> tuple[str, str | None]:
    pair = engine.pair
    return pair.target.name, pair.draft.name if pair.draft else None


@dataclass
class AppContext:
    """get_engine(draft) returns the loaded Engine for a draft spec, one of `drafts` (None: the app's own), each
    loaded once, lazily; get_store() returns (sessions.Store | None, reason) for recording and replay (None: nothing
    is recorded); defaults: the controls' starting values; drafts: (what the menu says, draft spec) for each draft a
    visitor may pick, the app's own first (None: no choice). A pick outside them is refused: a spec can name a path
    or a hub id, so a visitor never types one."""

    get_engine: Callable
    get_store: Callable = field(default_factory=lambda: no_store("recording is off"))
    defaults: dict = field(default_factory=dict)
    drafts: list[tuple[str, str]] | None = None
    # page-wide components, set as the page is built
    draft: gr.components.Component | None = None
    browser: gr.BrowserState | None = None
    controls: list = field(default_factory=list)  # Live's generation controls, in make_config's order after method

    @property
    def specs(self) -> list[str]:
        return [spec for _, spec in self.drafts or []]

    def engine_for(self, draft):
        if self.drafts and draft not in self.specs:
            raise SpecBranchError(f"unknown draft {str(draft)!r}; choose one of {', '.join(self.specs)}")
        return self.get_engine(draft if self.drafts else None)

    def store_or_raise(self):
        store, error = self.get_store()
        if store is None:
            raise SessionStoreError(f"no session store: {error}")
        return store

    def start_recording(self, owner, prompt, engine, cfg):
        """(recorder, session id or None) for a run on `engine` (sessions.start_recording: never raises)."""
        store, reason = self.get_store()
        return start_recording(store, owner, prompt, pair_names(engine), cfg, why_not=reason)

    def ar_speed_of(self, owner, prompt, engine):
        """tokens/s of this browser's latest stored AR run of the same prompt on the same pair, if any."""
        return stored_ar_speed(self.get_store()[0], owner, prompt, pair_names(engine))
