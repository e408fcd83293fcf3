"""What the training tools share: `distill`'s settings, reading corpora, batching (prompt, response) rows, splitting
them by prompt, capping a corpus at a token budget, the frequent-token vocabulary of a reduced head, the optimiser and
its schedule, and a training run's checkpoint (what a rerun resumes from)."""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import random
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from engine.config import SpecBranchError

Item = TypeVar("Item")


@dataclass(frozen=True)
class DistillSpec:
    """What `python -m engine distill` trains, from what, and where it writes (the flags of the same names)."""

    out: str  # the folder the draft is written to
    target: str = "embedded"
    corpus: list[str] | None = None  # JSONL rows with prompt_ids and response_ids
    prompts: str | None = None  # JSONL prompts to generate the target's responses to
    limit: int = 0  # use only the first N prompts (0: all)
    self_prompts: int = 0  # let the target write N user questions of its own (Magpie) and answer them
    self_prompt_leads: tuple[str, ...] | None = None  # with self_prompts: open the questions with these words
    generate_only: bool = False  # stop after generating responses
    max_new_tokens: int = 128
    gen_batch_size: int = 16
    gen_temperature: float = 0.0
    max_tokens: int = 0  # cap on response tokens used (0: all)
    kind: str = "standalone"  # standalone: the target's first layers; head: a feature-conditioned head
    layers: int = 4
    init: str | None = None  # standalone: go on training this saved draft
    grow: int = 0  # standalone, with init: add N layers on top that start as no-ops
    unroll: int = 3  # head: training-time-test steps
    feature_layers: tuple[int, ...] | None = None  # head: fuse these of the target's hidden states (EAGLE-3)
    hard_labels: bool = False  # standalone: train on the answers' own tokens (no target pass labels them)
    held_out: str | None = None  # JSONL rows held out instead of a random split (their prompts leave training)
    eval_every: int = 0  # held-out evaluation every N steps too (0: at each epoch's end only)
    vocab: int = 8192  # reduced LM-head size (FR-Spec)
    epochs: float = 3
    lr: float = 5e-4
    batch_size: int = 16
    label_batch_size: int = 8
    top_k: int = 32  # teacher probabilities kept per position
    val_fraction: float = 0.03
    seed: int = 0
    max_minutes: float | None = None  # stop training after this long (wall clock, this run; a rerun resumes)
    threads: int = 0  # torch threads (0: torch's default)
    device: str | None = None
    work_dir: str = "runs/distill"

    def training_meta(self) -> dict:
        """The training settings a saved draft's card records."""
        return {"epochs": self.epochs, "lr": self.lr, "batch_size": self.batch_size, "seed": self.seed}


# ---------------------------------------------------------------- data
def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSON-lines file, plain or gzipped (name ending .gz: the shipped training corpora are)."""
    rows = []
    try:
        with gzip.open(path, "rt") if str(path).endswith(".gz") else open(path) as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise SpecBranchError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
    except (OSError, UnicodeDecodeError, EOFError) as exc:  # missing, a folder, unreadable, not text or not gzip
        raise SpecBranchError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    return rows


def batches(rows: list[dict], batch_size: int, shuffle: bool, seed: int = 0):
    """Length-bucketed batches of (input_ids [B, T], mask [B, T], response start per row)."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["prompt_ids"]) + len(rows[i]["response_ids"]))
    chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    if shuffle:
        random.Random(seed).shuffle(chunks)
    for chunk in chunks:
        seqs = [rows[i]["prompt_ids"] + rows[i]["response_ids"] for i in chunk]
        width = max(map(len, seqs))
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])  # right padding
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        yield chunk, ids, mask


def frequent_vocab(rows: list[dict], size: int, vocab_size: int) -> torch.Tensor:
    """FR-Spec head: the `size` most frequent response tokens, topped up with the lowest ids
    (BPE gives low ids to early, frequent merges). Sorted ids."""
    counts = torch.bincount(torch.tensor([t for r in rows for t in r["response_ids"]]), minlength=vocab_size)
    ranked = torch.argsort(counts, descending=True, stable=True)  # ties keep low ids first
    return torch.sort(ranked[: min(size, vocab_size)]).values


def optimizer_step(loss: torch.Tensor, params, opt, sched) -> None:
    """Backward, clip the gradient norm at 1, step the optimiser and the learning-rate schedule."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    sched.step()


def split_by_prompt(
    items: list[Item], fraction: float, seed: int, prompt_of: Callable[[Item], Hashable] | None = None
) -> tuple[list[Item], list[Item]]:
    """(train, held out): whole prompts held out, a seeded `fraction` of them (at least one), so that no held-out
    item has a neighbour from its prompt in training (a prompt's greedy and sampled responses, a response's
    samples). prompt_of: an item's prompt (default: a row's prompt_ids)."""
    key = prompt_of or (lambda row: tuple(row["prompt_ids"]))
    prompts = sorted({key(x) for x in items})
    random.Random(seed).shuffle(prompts)
    held = set(prompts[: max(1, int(len(prompts) * fraction))])
    return [x for x in items if key(x) not in held], [x for x in items if key(x) in held]


def held_out_split(rows: list[dict], held_out: str | None, val_fraction: float, seed: int):
    """(training rows, held-out rows): the rows of the file `held_out` (training rows with their prompts left out),
    else a seeded split by prompt."""
    if not held_out:
        return split_by_prompt(rows, val_fraction, seed)
    val = [{"prompt_ids": r["prompt_ids"], "response_ids": r["response_ids"]} for r in read_jsonl(Path(held_out))]
    keys = {tuple(r["prompt_ids"]) for r in val}
    return [r for r in rows if tuple(r["prompt_ids"]) not in keys], val


def capped_rows(rows: list[dict], max_tokens: int, seed: int) -> list[int]:
    """Indices of a seeded random subset of rows holding about `max_tokens` response tokens (whole rows)."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    kept, n = [], 0
    for i in order:
        if n >= max_tokens:
            break
        kept.append(i)
        n += len(rows[i]["response_ids"])
    return kept


@dataclass
class Optimiser:
    """AdamW without weight decay over `params`, with its learning-rate schedule."""

    params: list
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler

    @classmethod
    def warm_cosine(cls, params, lr: float, total_steps: int, warmup: int) -> Optimiser:
        """A linear warm-up over `warmup` steps times a cosine decay to 0 at `total_steps`."""
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt,
            lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)),
        )
        return cls(params, opt, sched)

    def step(self, loss: torch.Tensor) -> None:
        optimizer_step(loss, self.params, self.opt, self.sched)

    @property
    def lr(self) -> float:
        return self.sched.get_last_lr()[0]


class Checkpoint:
    """A training run's state on disk (`state_dict`s by name, the step reached and the CPU seconds spent), written
    every `every` steps under a temporary name and renamed, so a rerun of the same command resumes exactly (the
    batches are a function of the seed and the epoch, so the rerun skips those already taken). The file is named by
    a hash of the run's settings and training rows: another run in the same work dir starts afresh."""

    def __init__(self, work: Path, kind: str, settings, rows: list[dict], every: int):
        fields = {k: str(v) for k, v in sorted(vars(settings).items()) if k not in ("max_minutes", "stop_at")}
        tokens = [r["prompt_ids"] + r["response_ids"] for r in rows]
        key = hashlib.sha1(json.dumps([fields, tokens]).encode()).hexdigest()[:16]
        self.path, self.every = work / f"{kind}_checkpoint_{key}.pt", every

    def restore(self, parts: dict) -> tuple[int, float]:
        """Load `parts` (name -> module, optimiser or schedule) from the file where there is one: (step, CPU s)."""
        if not self.path.exists():
            return 0, 0.0
        state = torch.load(self.path)
        for name, part in parts.items():
            part.load_state_dict(state[name])
        return state["step"], state["cpu_s"]

    def save(self, parts: dict, step: int, cpu_s: float) -> None:
        tmp = self.path.with_suffix(".tmp")
        torch.save({**{name: part.state_dict() for name, part in parts.items()}, "step": step, "cpu_s": cpu_s}, tmp)
        tmp.rename(self.path)

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0
