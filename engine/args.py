"""The model flags, defined once for `python -m engine` (engine/cli.py) and `python app.py`, and the typed settings a
parsed command line becomes: below the command line, code takes those settings, never an argparse Namespace."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from engine.config import DRAFT_FORWARDS, DRAFT_MATMULS, DRAFT_WORKERS, TARGET_FORWARDS, ModelSettings

MAX_THREADS = 1024

Settings = TypeVar("Settings")


def thread_count(text: str) -> int:
    """A torch thread count for argparse: an integer from 0 to MAX_THREADS (torch.set_num_threads overflowed past
    2**31 with a traceback)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not 0 <= value <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"must be from 0 to {MAX_THREADS}, got {value}")
    return value


def layer_list(text: str) -> tuple[int, ...]:
    """Hidden-state indices for argparse: "2,15,27" -> (2, 15, 27), each >= 0, no repeats (the target's depth is
    checked once it is loaded)."""
    try:
        layers = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of layer indices: {text!r}") from None
    if any(i < 0 for i in layers) or len(set(layers)) != len(layers):
        raise argparse.ArgumentTypeError(f"layer indices must be >= 0 and distinct, got {text!r}")
    return layers


def word_list(text: str) -> tuple[str, ...]:
    """Words or short phrases for argparse: "Write,Act as" -> ("Write", "Act as"), none empty, no repeats."""
    words = tuple(w.strip() for w in text.split(","))
    if not all(words) or len(set(words)) != len(words):
        raise argparse.ArgumentTypeError(f"need distinct, non-empty comma-separated words, got {text!r}")
    return words


DRAFT_HELP = (
    "embedded | embedded-weak | embedded-head | self | self-skip:I,J,... | truncated:N | PATH.gguf | DIR | hub id "
    "(default: the fastest this machine supports, engine/presets.py default_draft: self, the target read in 4 bits, "
    "on a CPU with the int4 kernel, else embedded). The draft's preset sets every generation setting not given as a "
    "flag. For more rejections and branches to watch: embedded or embedded-weak; for forks that rescue: "
    "self-skip:3,4,5,25"
)
DRAFT_MATMUL_HELP = (
    "how the draft's matmuls read its weights: bfloat16 (half float32's memory traffic), int4 (an eighth; with "
    "--draft self, the target's own weights as a cheap draft) or float32; auto: int4 on a CPU whose torch has "
    "the int4 kernel, else bfloat16 where the CPU runs it natively. Output stays exact: only the target decides it"
)
DRAFT_FORWARD_HELP = (
    "lean: a Llama draft on the CPU runs engine/models/lean.py (fused matmuls, a KV cache that rolls back by a "
    "pointer); lean-compiled: that, with its one-token steps through torch.compile (a C++ compiler needed, else "
    "eager with a note; about a minute the first time): `python -m engine` compiles when the draft loads, the app "
    "in a second process of the draft's once it has loaded, its runs drafting with the eager step meanwhile; "
    "transformers: the model's own forward (default: lean-compiled, or $SPECBRANCH_DRAFT_FORWARD)"
)
TARGET_FORWARD_HELP = (
    "static: a Llama target on the CPU runs engine/models/static_forward.py (transformers' ops, with q/k/v and "
    "gate/up each one stacked matmul, over a KV cache written in place: the same bits, checked at load, and a "
    "faster step); transformers: the model's own forward"
)
DRAFT_WORKER_HELP = (
    "process: a draft on the CPU runs its forwards in a child process of its own (the models no longer take turns "
    "at one Python interpreter; the child loads the same draft and its logits are checked bit for bit at start); "
    "thread: on a thread of this process"
)
SOLO_THREADS_HELP = (
    "torch threads for a draft step the target waits on (SD's draft block, a parallel method's head start), when "
    "the draft has the cores to itself (default: the cores available, at most 2; 1 turns it off)"
)


def add_model_arguments(p: argparse.ArgumentParser, defaults: Mapping[str, Any] | None = None) -> None:
    """The flags of ModelSettings. defaults: a default other than the command line's, by field name (the app reads
    some from its environment)."""
    d = {
        "target": "embedded",
        "draft": None,
        "device": None,
        "draft_matmul": "auto",
        "draft_forward": None,
        "target_forward": "static",
        "draft_worker": "process",
        **(defaults or {}),
    }
    p.add_argument("--target", default=d["target"], help="embedded | PATH.gguf | DIR | hub id")
    p.add_argument("--draft", default=d["draft"], help=DRAFT_HELP)
    p.add_argument("--device", default=d["device"], help="cuda, cuda:0, cpu (default: cuda when present)")
    p.add_argument("--draft-device", default=None)
    p.add_argument("--dtype", default=None, help="float32 (CPU default) | bfloat16 (CUDA default) | float16")
    p.add_argument("--draft-matmul", default=d["draft_matmul"], choices=DRAFT_MATMULS, help=DRAFT_MATMUL_HELP)
    p.add_argument("--draft-forward", default=d["draft_forward"], choices=DRAFT_FORWARDS, help=DRAFT_FORWARD_HELP)
    p.add_argument("--target-forward", default=d["target_forward"], choices=TARGET_FORWARDS, help=TARGET_FORWARD_HELP)
    p.add_argument("--draft-worker", default=d["draft_worker"], choices=DRAFT_WORKERS, help=DRAFT_WORKER_HELP)
    p.add_argument("--threads", type=thread_count, default=1, help="torch threads per model worker")
    p.add_argument("--solo-threads", type=thread_count, default=None, help=SOLO_THREADS_HELP)
    p.add_argument("--trust-remote-code", action="store_true")


def fill_model_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill, in place, what no model flag gave: the draft (the fastest this machine supports) and the draft's
    forward ($SPECBRANCH_DRAFT_FORWARD, else lean-compiled). A command without a flag keeps its value."""
    from engine.presets import default_draft, draft_forward

    if getattr(args, "draft", "none") is None:
        args.draft = default_draft(args.device)
    if getattr(args, "draft_forward", "set") is None:
        args.draft_forward = draft_forward()
    return args


def settings_from(cls: type[Settings], args: argparse.Namespace, **given: Any) -> Settings:
    """A settings dataclass from the parsed flags of the same names; `given` sets fields no flag has."""
    names = [f.name for f in dataclasses.fields(cls) if f.name not in given]
    return cls(**{name: getattr(args, name) for name in names}, **given)


def model_settings(args: argparse.Namespace) -> ModelSettings:
    """The model flags, typed (after fill_model_defaults)."""
    return settings_from(ModelSettings, args)
