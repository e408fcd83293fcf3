"""What the training tools share: reading corpora, batching (prompt, response) rows, splitting them by prompt,
capping a corpus at a token budget, the frequent-token vocabulary of a reduced head, and one optimizer step."""

from __future__ import annotations

import gzip
import hashlib
import json
import random
from pathlib import Path

import torch

from engine.config import SpecBranchError


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


def split_by_prompt(rows: list[dict], val_fraction: float, seed: int):
    """Hold out whole prompts (a prompt's greedy and sampled responses go to the same side)."""
    keys = sorted({tuple(r["prompt_ids"]) for r in rows})
    random.Random(seed).shuffle(keys)
    val_keys = set(keys[: max(1, int(len(keys) * val_fraction))])
    train = [r for r in rows if tuple(r["prompt_ids"]) not in val_keys]
    val = [r for r in rows if tuple(r["prompt_ids"]) in val_keys]
    return train, val


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
