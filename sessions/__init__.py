"""Sessions: SQLite persistence, replay, export/import and Chrome traces of SpecBranch runs (see README.md)."""

from .export import chrome_trace, chrome_trace_runs, export_json, export_session, import_json, import_session
from .recording import SessionLog, start_recording
from .replay import compare_runs, events_up_to_step, replay_steps
from .store import Recorder, SessionStoreError, Store, default_db_path

__all__ = [
    "Store",
    "Recorder",
    "SessionLog",
    "start_recording",
    "SessionStoreError",
    "default_db_path",
    "replay_steps",
    "events_up_to_step",
    "compare_runs",
    "export_session",
    "export_json",
    "import_session",
    "import_json",
    "chrome_trace",
    "chrome_trace_runs",
]
