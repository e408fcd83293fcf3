"""`python -m engine distill --kind head`: train a feature-conditioned draft head (engine/drafts/head.py).

Two resumable stages in --work-dir, after distill's own generate stage:
  features  the target's post-norm last hidden state at every position of every (prompt, response) row,
            float16, in chunk files (one target forward per batch; bfloat16 autocast on CPU for speed)
  train     the head, unrolled on its own predictions ("training-time test", EAGLE-3): unroll step j
            feeds the head its step j-1 predictions and attends exactly as drafting at depth j+1 does
            (to the true-feature rows up to t-j and to its own chain after that). Loss per step: the
            target's distribution over the reduced vocabulary (from the true feature, so no labels are
            stored) against the head's, plus a smooth-L1 pull of the predicted feature to the true one.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from engine.drafts.head import FeatureHead, save_head
from engine.kernels.lm_head import bf16_supported
from engine.training.common import (
    Checkpoint,
    DistillSpec,
    Optimiser,
    batches,
    capped_rows,
    frequent_vocab,
    held_out_split,
)

CHUNK_ROWS = 256


def autocast(device: torch.device):
    """bfloat16 matmuls where they pay (a CPU that runs them natively measured 2.2x fp32; CUDA); else float32 (a CPU
    without them emulates bfloat16 no faster, and the target drafts on float32 features)."""
    on = device.type == "cuda" or bf16_supported()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=on)


class FeatureStore:
    """The target's features for a list of (prompt, response) rows, on disk: per row [n, W] float16 (n = its prompt and
    response tokens). W is (k + 1) H for a head fusing k layers (those hidden states side by side, then the final-norm
    state the labels are computed from), H for a last-state head (the two coincide). One raw float16 file per chunk of
    CHUNK_ROWS rows, rows back to back, read through a memory map (a corpus larger than memory trains). A chunk is
    written under a temporary name and renamed when whole, so an interrupted extraction resumes; each file is named by
    a hash of its rows and the layers, so another corpus never reads it (and one sharing whole chunks shares them)."""

    def __init__(self, work: Path, rows: list[dict], feature_layers: tuple[int, ...] | None, hidden: int):
        self.layers, self.hidden = tuple(feature_layers or ()), hidden
        self.width = (len(self.layers) + 1) * hidden if self.layers else hidden
        self.lengths = [len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows]
        self.paths = [
            work / f"feats_{chunk_key(rows[c0 : c0 + CHUNK_ROWS], self.layers)}.f16"
            for c0 in range(0, len(rows), CHUNK_ROWS)
        ]
        self.offsets = []  # (chunk, first token row in it) per row
        for c0 in range(0, len(rows), CHUNK_ROWS):
            at = 0
            for n in self.lengths[c0 : c0 + CHUNK_ROWS]:
                self.offsets.append((c0 // CHUNK_ROWS, at))
                at += n
        self._maps: dict[int, np.memmap] = {}

    def chunk_tokens(self, c: int) -> int:
        return sum(self.lengths[c * CHUNK_ROWS : (c + 1) * CHUNK_ROWS])

    def missing(self) -> list[int]:
        return [c for c, path in enumerate(self.paths) if not path.exists()]

    def write(self, c: int, feats: np.ndarray) -> None:
        """feats [chunk tokens, W] float16, the chunk's rows back to back."""
        tmp = self.paths[c].with_suffix(".tmp")
        feats.astype(np.float16).tofile(tmp)
        tmp.rename(self.paths[c])

    def __getitem__(self, i: int) -> torch.Tensor:
        """Row i's features [n, W] float16 (a copy)."""
        c, at = self.offsets[i]
        if c not in self._maps:
            self._maps[c] = np.memmap(self.paths[c], np.float16, "r", shape=(self.chunk_tokens(c), self.width))
        return torch.from_numpy(np.array(self._maps[c][at : at + self.lengths[i]]))

    def __len__(self) -> int:
        return len(self.lengths)


def chunk_key(rows: list[dict], layers: tuple[int, ...]) -> str:
    """A chunk file's name: a hash of its rows' tokens and the layers (row lists that share chunks share files)."""
    tokens = [r["prompt_ids"] + r["response_ids"] for r in rows]
    return hashlib.sha1(json.dumps([list(layers), tokens]).encode()).hexdigest()[:16]


class Rows:
    """Some rows of a FeatureStore, by index (a split, a capped subset), read as a list is."""

    def __init__(self, store: FeatureStore, index: list[int]):
        self.store, self.index = store, index

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.store[self.index[i]]

    def __len__(self) -> int:
        return len(self.index)


def target_features(target, ids: torch.Tensor, mask: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    """One target pass: [B, T, W], the hidden states `layers` and the final-norm state side by side (or that alone)."""
    out = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=bool(layers))
    if not layers:
        return out.last_hidden_state
    return torch.cat([out.hidden_states[i] for i in layers] + [out.last_hidden_state], dim=-1)


@torch.inference_mode()
def extract_features(target, rows: list[dict], store: FeatureStore, batch_size: int = 8) -> FeatureStore:
    """Fill the store's missing chunks, one target forward per batch; chunks already on disk are kept."""
    device = next(target.parameters()).device
    for c in tqdm(store.missing(), desc="features", unit="chunk"):
        c0 = c * CHUNK_ROWS
        part = rows[c0 : c0 + CHUNK_ROWS]
        out = np.empty((store.chunk_tokens(c), store.width), np.float16)
        for chunk, ids, mask in batches(part, batch_size, shuffle=False):
            with autocast(device):
                feats = target_features(target, ids.to(device), mask.to(device), store.layers)
            for b, i in enumerate(chunk):
                at, n = store.offsets[c0 + i][1], store.lengths[c0 + i]
                out[at : at + n] = feats[b, :n].to("cpu", torch.float16).numpy()
        store.write(c, out)
    return store


def feature_batches(rows, feats, batch_size: int, shuffle: bool, seed: int, device="cpu", hidden: int | None = None):
    """Length-bucketed batches on `device`: ids [B, T], the head's input features [B, T, W'] (the feature layers side
    by side, or the final-norm state), the final-norm features [B, T, H] (float32; the labels' source) and the loss
    mask [B, T] (rows that predict a response token). hidden: H where the stored rows are wider than H."""
    for chunk, ids, _ in batches(rows, batch_size, shuffle, seed):
        t = ids.shape[1]
        f = torch.zeros(len(chunk), t, feats[chunk[0]].shape[-1])
        loss_mask = torch.zeros(len(chunk), t, dtype=torch.bool)
        for b, i in enumerate(chunk):
            row = feats[i]
            f[b, : row.shape[0]] = row.float()
            p, r = len(rows[i]["prompt_ids"]), len(rows[i]["response_ids"])
            loss_mask[b, p - 1 : p + r - 1] = True
        f = f.to(device)
        if hidden is None or f.shape[-1] == hidden:
            yield ids.to(device), f, f, loss_mask.to(device)
        else:
            yield ids.to(device), f[..., :-hidden], f[..., -hidden:], loss_mask.to(device)


def ttt_mask(t: int, step: int, device=None) -> torch.Tensor:
    """bool [1, 1, t, (step + 1) * t]: at unroll step j, query t sees step-0 keys at s <= t - j, the step-i
    key at s = t - j + i for 0 < i < j, and its own key (step j, s = t)."""
    q = torch.arange(t, device=device)[:, None]
    s = torch.arange(t, device=device)[None, :]
    blocks = [s <= q - step] + [s == q - step + i for i in range(1, step + 1)]
    return torch.cat(blocks, dim=1)[None, None]


def unrolled_outputs(head: FeatureHead, embeds: torch.Tensor, true_feats: torch.Tensor, steps: int):
    """The head's predictions at depths 1..steps for every position: a list of [B, T, H]. true_feats: the target's
    features as the head reads them ([B, T, k H] side by side for a fused head, fused here; else [B, T, H])."""
    from transformers import DynamicCache

    b, t, _ = embeds.shape
    cache = DynamicCache(config=head.config)
    position_ids = torch.arange(t, device=embeds.device)[None]
    prev = head.fused(true_feats)
    outs = []
    for j in range(steps):
        feats_in = F.pad(prev[:, :-1], (0, 0, 1, 0))  # row r reads f_{r-1}; row 0 reads zeros
        out = head(embeds, feats_in, position_ids, ttt_mask(t, j, embeds.device), cache)
        outs.append(out)
        prev = out
    return outs


def losses(outs, true_feats, loss_mask, sub_head: torch.Tensor, reg_weight: float):
    """Per unroll step: soft cross-entropy against the target's reduced-vocabulary distribution (from its final-norm
    features true_feats [B, T, H]), smooth L1 of the predicted feature to it (a last-state head's output stands in
    for it; reg_weight 0 for a fused head, whose output stands in for the fused layers), and greedy agreements
    (argmax equal) at the rows in loss_mask."""
    with torch.no_grad():
        p = (true_feats[loss_mask] @ sub_head.T).float().softmax(-1)  # [N, S]
        target_top = p.argmax(-1)
    total, agree = 0.0, []
    for j, out in enumerate(outs):
        # rows t < j have no chain of j steps behind them: leave them out
        valid = loss_mask.clone()
        valid[:, :j] = False
        keep = valid[loss_mask]
        logq = (out[loss_mask] @ sub_head.T).float().log_softmax(-1)
        ce = -(p[keep] * logq[keep]).sum(-1).mean()
        total = total + ce
        if reg_weight:
            total = total + reg_weight * F.smooth_l1_loss(out[valid].float(), true_feats[valid])
        agree.append((int((logq[keep].argmax(-1) == target_top[keep]).sum()), int(keep.sum())))
    return total / len(outs), agree


def evaluate(head, rows, feats, embed, sub_head, steps: int, batch_size: int) -> list[float]:
    """Held-out greedy agreement with the target at drafting depths 1..steps (conditional on the chain so far)."""
    head.eval()
    a, n = [0] * steps, [0] * steps
    device, hidden = next(head.parameters()).device, head.config.hidden_size
    with torch.inference_mode():
        for ids, raw, f, m in feature_batches(rows, feats, batch_size, False, 0, device, hidden):
            outs = unrolled_outputs(head, embed(ids).float(), raw, steps)
            _, agree = losses(outs, f, m, sub_head, 0.0)
            for j, (x, y) in enumerate(agree):
                a[j] += x
                n[j] += y
    head.train()
    return [round(x / max(y, 1), 4) for x, y in zip(a, n)]


@dataclass(frozen=True)
class HeadSettings:
    """How a head is trained (distill's flags for --kind head)."""

    layers: int = 1
    vocab: int = 8192
    unroll: int = 3  # training-time-test steps
    epochs: float = 2
    lr: float = 5e-4
    batch_size: int = 8
    seed: int = 0
    feature_layers: tuple[int, ...] | None = None  # fused: these hidden states; None: the final-norm state
    max_minutes: float | None = None  # stop after this long (wall clock, this run)
    cpu_minutes: float | None = None  # stop after this much of the process's CPU time (fair on a shared machine)
    eval_every: int = 0  # steps between held-out evaluations besides each epoch's end (0: at epoch ends only)
    checkpoint_every: int = 100  # steps between checkpoints a rerun resumes from (0: none)
    stop_at: int = 0  # stop (checkpointed) at this step, for a rerun to go on from (0: run to the end)
    warmup: int = 50

    @property
    def reg_weight(self) -> float:
        return 0.0 if self.feature_layers else 0.5


class Trainer:
    """One head's training state: the head, its optimiser and schedule, the step reached; checkpointed to `ckpt`
    every `checkpoint_every` steps so a rerun of the same command resumes where it stopped."""

    def __init__(self, target, rows, settings: HeadSettings, work: Path):
        s = self.settings = settings
        torch.manual_seed(s.seed)
        device = next(target.parameters()).device
        self.head = FeatureHead.from_target(target, s.layers, feature_layers=s.feature_layers)
        self.head = self.head.float().to(device).train()
        self.subset = frequent_vocab(rows, s.vocab, target.get_output_embeddings().weight.shape[0])
        self.sub_head = target.get_output_embeddings().weight[self.subset].detach().float().contiguous()
        self.embed = target.get_input_embeddings()
        self.per_epoch = math.ceil(len(rows) / s.batch_size)
        self.total = max(1, int(s.epochs * self.per_epoch))
        params = [p for p in self.head.parameters() if p.requires_grad]
        self.optimiser = Optimiser.warm_cosine(params, s.lr, self.total, warmup=s.warmup)
        self.ckpt = Checkpoint(work, "head", s, rows, s.checkpoint_every)
        self.step, cpu_s = self.ckpt.restore(self.parts())
        self.cpu0 = time.process_time() - cpu_s

    def parts(self) -> dict:
        return {"head": self.head, "opt": self.optimiser.opt, "sched": self.optimiser.sched}

    def save(self) -> None:
        self.ckpt.save(self.parts(), self.step, time.process_time() - self.cpu0)

    def cpu_minutes(self) -> float:
        return (time.process_time() - self.cpu0) / 60

    def train_step(self, ids, raw, f, m) -> tuple[float, list]:
        device = ids.device
        with autocast(device):
            outs = unrolled_outputs(self.head, self.embed(ids).float(), raw, self.settings.unroll)
            loss, agree = losses(outs, f, m, self.sub_head, self.settings.reg_weight)
        self.optimiser.step(loss)
        self.step += 1
        if self.ckpt.due(self.step):
            self.save()
        return loss.item(), agree


def log_line(log, **fields) -> None:
    print(json.dumps(fields), file=log, flush=True)


def train_head(target, rows, feats, val_rows, val_feats, settings: HeadSettings, work: Path):
    """Train (or resume) a feature-conditioned head on the target's features of `rows`: (head, its vocabulary subset,
    a summary). Logs to work/train_head_log.jsonl (appended to on a resume)."""
    s = settings
    t = Trainer(target, rows, s, work)
    held_out = lambda: evaluate(t.head, val_rows, val_feats, t.embed, t.sub_head, s.unroll, s.batch_size)  # noqa: E731
    tokens_per_step = sum(len(r["response_ids"]) for r in rows) / t.per_epoch
    with open(work / "train_head_log.jsonl", "a" if t.step else "w") as log:
        if not t.step:
            log_line(log, step=0, val_agreement_by_depth=held_out())
        start, val = time.time(), None
        bar = tqdm(total=t.total, initial=t.step, desc="train head", unit="step")
        while t.step < t.total and not out_of_time(s, start, t):
            epoch, skip = divmod(t.step, t.per_epoch)
            batches_ = feature_batches(
                rows, feats, s.batch_size, True, s.seed + epoch, t.head.fc.weight.device, t.head.config.hidden_size
            )
            for k, (ids, raw, f, m) in enumerate(batches_):
                if k < skip:
                    continue  # done before a resume
                loss, agree = t.train_step(ids, raw, f, m)
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", d1=f"{agree[0][0] / max(agree[0][1], 1):.3f}")
                if t.step % 25 == 0:
                    log_line(
                        log,
                        step=t.step,
                        epoch=round(t.step / t.per_epoch, 3),
                        tokens=round(t.step * tokens_per_step),
                        loss=round(loss, 4),
                        train_agreement_by_depth=[round(x / max(y, 1), 4) for x, y in agree],
                        lr=t.optimiser.lr,
                        cpu_minutes=round(t.cpu_minutes(), 2),
                    )
                end = t.step >= t.total or out_of_time(s, start, t) or t.step % t.per_epoch == 0
                if end or (s.eval_every and t.step % s.eval_every == 0):
                    val = held_out()
                    log_line(
                        log,
                        step=t.step,
                        epoch=round(t.step / t.per_epoch, 3),
                        tokens=round(t.step * tokens_per_step),
                        val_agreement_by_depth=val,
                        cpu_minutes=round(t.cpu_minutes(), 2),
                    )
                    tqdm.write(f"step {t.step}: held-out agreement by depth {val}")
                if end:
                    break
        bar.close()
    t.save()
    val = val or held_out()
    summary = {"val_agreement_by_depth": val, "steps": t.step, "cpu_minutes": round(t.cpu_minutes(), 2)}
    return t.head.eval(), t.subset, summary


def out_of_time(s: HeadSettings, start: float, t: Trainer) -> bool:
    return bool(
        (s.stop_at and t.step >= s.stop_at)
        or (s.max_minutes and time.time() - start > 60 * s.max_minutes)
        or (s.cpu_minutes and t.cpu_minutes() > s.cpu_minutes)
    )


def head_settings(spec: DistillSpec) -> HeadSettings:
    """The head's training settings from distill's."""
    return HeadSettings(
        layers=spec.layers,
        vocab=spec.vocab,
        unroll=spec.unroll,
        epochs=spec.epochs,
        lr=spec.lr,
        batch_size=spec.batch_size,
        seed=spec.seed,
        feature_layers=tuple(spec.feature_layers) if spec.feature_layers else None,
        max_minutes=spec.max_minutes,
        eval_every=spec.eval_every,
    )


def run_head_distill(spec: DistillSpec, target, rows: list[dict], work: Path) -> dict:
    """Stages features and train for --kind head; saves the head to spec.out with its card's facts."""
    torch.manual_seed(spec.seed)
    settings = head_settings(spec)
    train_rows, val_rows = held_out_split(rows, spec.held_out, spec.val_fraction, spec.seed)
    ordered = train_rows + val_rows
    store = FeatureStore(work, ordered, settings.feature_layers, target.config.hidden_size)
    extract_features(target, ordered, store, spec.label_batch_size)
    train_index = list(range(len(train_rows)))
    if spec.max_tokens:  # a data-size curve: fewer training rows, the same held-out rows
        train_index = capped_rows(train_rows, spec.max_tokens, spec.seed)
        train_rows = [train_rows[i] for i in train_index]
    val_feats = Rows(store, list(range(len(ordered) - len(val_rows), len(ordered))))
    n_tokens = sum(len(r["response_ids"]) for r in train_rows)
    print(
        f"distill --kind head: {len(train_rows)} training rows ({n_tokens} response tokens), {len(val_rows)} held out"
    )
    head, subset, summary = train_head(
        target, train_rows, Rows(store, train_index), val_rows, val_feats, settings, work
    )
    meta = {
        "kind": "head",
        "target": spec.target,
        "target_layers": target.config.num_hidden_layers,
        "layers": spec.layers,
        "unroll": spec.unroll,
        "vocab_subset_size": int(len(subset)),
        "train_rows": len(train_rows),
        "train_response_tokens": n_tokens,
        "held_out_rows": len(val_rows),
        **spec.training_meta(),
        **summary,
    }
    save_head(head, Path(spec.out), subset, meta)
    (Path(spec.out) / "training_log.jsonl").write_text((work / "train_head_log.jsonl").read_text())
    print(json.dumps(meta))
    return meta
