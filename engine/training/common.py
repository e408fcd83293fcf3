"""What the training tools share: `distill`'s settings, reading corpora, batching (prompt, response) rows, splitting
them by prompt, capping a corpus at a token budget, the frequent-token vocabulary of a reduced head, the optimiser and
its schedule, and a training run's progress and log."""

from __future__ import annotations

import gzip
import json
import math
import random
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO, TypeVar

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
    generate_only: bool = False  # stop after generating responses
    max_new_tokens: int = 128
    gen_batch_size: int = 16
    gen_temperature: float = 0.0
    max_tokens: int = 0  # cap on response tokens used (0: all)
    kind: str = "standalone"  # standalone: the target's first layers; head: a feature-conditioned head
    layers: int = 4
    init: str | None = None  # standalone: go on training this saved draft
    unroll: int = 3  # head: training-time-test steps
    vocab: int = 8192  # reduced LM-head size (FR-Spec)
    epochs: float = 3
    lr: float = 5e-4
    batch_size: int = 16
    label_batch_size: int = 8
    top_k: int = 32  # teacher probabilities kept per position
    val_fraction: float = 0.03
    seed: int = 0
    max_minutes: float | None = None  # stop training after this long
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


@dataclass
class Progress:
    """A training run's steps against its budget (total steps, minutes), its progress bar and its JSON-lines log."""

    log: TextIO
    total_steps: int
    per_epoch: int  # steps an epoch
    max_minutes: float | None
    step: int = 0
    start: float = field(default_factory=time.time)
    bar: Any = None  # tqdm's, once open_bar is called

    def open_bar(self, desc: str) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=self.total_steps, desc=desc, unit="step")

    def advance(self, **postfix) -> None:
        """One step taken."""
        self.step += 1
        self.bar.update(1)
        self.bar.set_postfix(**postfix)

    def write(self, **fields) -> None:
        print(json.dumps(fields), file=self.log, flush=True)

    @property
    def epoch(self) -> float:
        return round(self.step / self.per_epoch, 3)

    @property
    def minutes(self) -> float:
        return round((time.time() - self.start) / 60, 2)

    def spent(self) -> bool:
        """Whether the run has taken its steps, or its minutes."""
        return self.step >= self.total_steps or bool(
            self.max_minutes and time.time() - self.start > 60 * self.max_minutes
        )
