"""Starting to record a run: one way for the app and the command line, that never raises. A store that is missing or
fails only means "not recording": the run goes on, and the recorder says why in `error`."""

from __future__ import annotations

import sys
from typing import Any

from .store import Recorder, SessionStoreError, Store

NOT_RECORDING = "recording is off"


def start_recording(
    store: Store | None,
    owner: str,
    prompt: str,
    pair: tuple[str, str | None],
    cfg: Any,
    why_not: str = NOT_RECORDING,
    shared: bool = False,
    owns_session: bool = True,
) -> tuple[Recorder, str | None]:
    """(recorder, session id) for the first run of a new session of `prompt` on `pair` (target, draft names);
    (Recorder.disabled, None) where store is None (why_not says why) or the session cannot be started. Later runs of
    the session: store.recorder(session id). owns_session: a run that records nothing leaves no session."""
    if store is None:
        return Recorder.disabled(why_not), None
    target, draft = pair
    try:
        sid = store.start_session(owner, prompt, target, draft, cfg, shared=shared)
    except SessionStoreError as exc:
        return Recorder.disabled(str(exc)), None
    return store.recorder(sid, owns_session=owns_session), sid


def warn(message: str) -> None:
    print(f"warning: not recording: {message}", file=sys.stderr)


class SessionLog:
    """Records the command line's runs (--record): one session per prompt, one run per method. Never stops a
    generation: where the store cannot be used, it says so on stderr and the runs go on unrecorded."""

    def __init__(self, store: Store | None = None, pair: tuple[str, str | None] = ("", None), shared: bool = False):
        self.store, self.pair, self.shared = store, pair, shared
        self.session_id: str | None = None

    @classmethod
    def open(cls, db: str | None, pair: tuple[str, str | None], shared: bool = False) -> SessionLog:
        """A log on the store at `db` (None: the default place), or one that records nothing if it cannot open."""
        try:
            return cls(Store(db), pair, shared)
        except SessionStoreError as exc:
            warn(str(exc))
            return cls()

    def start(self, prompt: str, cfg: Any) -> Recorder:
        """The recorder of the first run of a new session of `prompt` (its settings: cfg)."""
        recorder, self.session_id = start_recording(
            self.store, "cli", prompt, self.pair, cfg, shared=self.shared, owns_session=False
        )
        if self.store is not None and self.session_id is None:
            warn(recorder.error)
        return recorder

    def another(self) -> Recorder:
        """The recorder of one more run of the session `start` began."""
        if self.session_id is None:
            return Recorder.disabled(NOT_RECORDING)
        return self.store.recorder(self.session_id)

    def finish(self, recorder: Recorder) -> None:
        """Close a run's recorder; say so where one that was recording failed."""
        error = recorder.close()
        if error and self.session_id is not None:
            warn(error)
